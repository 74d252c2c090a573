//! LoRA on a model and the training loss: adapters go where mlx-lm puts them, the masked
//! cross-entropy equals the one computed here from the logits, and its gradients with respect to
//! the adapters equal central finite differences (fixture `llama_gqa`, float32).

mod common;
#[path = "common/training.rs"]
mod training;

use common::fixture_with_tokenizer;
use rmlx::{Array, Dtype};
use rmlx_lm::nn::ModuleExt;
use rmlx_lm::tuner::{apply_lora, batch_loss, lora_parameter_names, loss_and_grad, Batch, LoraConfig, Sequence};
use rmlx_lm::{Error, LoadOptions, LoadedModel};
use training::{assert_same_step, move_lora_b};

fn load() -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer("llama_gqa");
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
        .unwrap();
    (dir, lm)
}

fn vals(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn batch() -> Batch {
    let a = Sequence { tokens: vec![3, 17, 42, 8, 99, 5, 61], offset: 3 };
    let b = Sequence { tokens: vec![12, 7, 88, 23], offset: 0 };
    Batch::new(&[&a, &b], 2048)
}

#[test]
fn loss_is_the_masked_mean_cross_entropy() {
    let (_d, lm) = load();
    let b = batch();
    let (loss, ntoks) = batch_loss(lm.model.as_ref(), &b.to_array().unwrap(), &b.mask_array().unwrap()).unwrap();
    // By hand: logits of the inputs, then -log softmax at each counted target.
    let inputs: Vec<i32> = (0..b.rows).flat_map(|r| b.tokens[r * b.len..(r + 1) * b.len - 1].to_vec()).collect();
    let x = Array::from_slice(&inputs, &[b.rows as i32, b.len as i32 - 1]).unwrap();
    let logits = vals(&lm.model.forward(&x, &mut lm.model.new_caches(None)).unwrap());
    let vocab = lm.model.config().vocab_size as usize;
    let mask = b.loss_mask();
    let (mut total, mut count) = (0.0f64, 0.0f64);
    for r in 0..b.rows {
        for t in 0..b.len - 1 {
            if mask[r * (b.len - 1) + t] == 0.0 {
                continue;
            }
            let row = &logits[(r * (b.len - 1) + t) * vocab..][..vocab];
            let max = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            let target = b.tokens[r * b.len + t + 1] as usize;
            total += lse - row[target] as f64;
            count += 1.0;
        }
    }
    assert_eq!(count as usize, b.loss_tokens());
    assert_eq!(ntoks.item::<f32>().unwrap(), count as f32);
    let want = total / count;
    let got = loss.item::<f32>().unwrap() as f64;
    assert!((got - want).abs() < 1e-5 * want.abs(), "loss {got} against {want}");
}

#[test]
fn adapters_go_to_the_last_blocks_and_selected_keys() {
    let (_d, mut lm) = load();
    let layers = lm.model.config().num_hidden_layers;
    let cfg = LoraConfig {
        rank: 2,
        scale: 2.0,
        dropout: 0.0,
        keys: Some(vec!["self_attn.q_proj".into(), "mlp.down_proj".into()]),
    };
    let paths = apply_lora(lm.model.as_mut(), Some(1), &cfg, Dtype::Float32, 0).unwrap();
    let last = layers - 1;
    assert_eq!(
        paths,
        vec![format!("model.layers.{last}.self_attn.q_proj"), format!("model.layers.{last}.mlp.down_proj")]
    );
    assert_eq!(lora_parameter_names(lm.model.as_ref()).len(), 4);
    let (_d, mut lm) = load();
    let all = apply_lora(lm.model.as_mut(), None, &LoraConfig::default(), Dtype::Float32, 0).unwrap();
    assert_eq!(all.len(), 7 * layers, "every linear of every block; never the output head");
    let (_d, mut lm) = load();
    let bad = LoraConfig { keys: Some(vec!["attn.q".into()]), ..LoraConfig::default() };
    match apply_lora(lm.model.as_mut(), None, &bad, Dtype::Float32, 0) {
        Err(Error::InvalidParameter(m)) => {
            assert!(m.starts_with("LoRA key `attn.q` names no linear or expert layer"), "{m}")
        }
        other => panic!("expected InvalidParameter, got {other:?}"),
    }
    let zero = LoraConfig { rank: 0, ..LoraConfig::default() };
    assert!(matches!(apply_lora(lm.model.as_mut(), None, &zero, Dtype::Float32, 0), Err(Error::InvalidParameter(_))));
}

fn loss_of(lm: &LoadedModel, b: &Batch) -> f64 {
    let (loss, _) = batch_loss(lm.model.as_ref(), &b.to_array().unwrap(), &b.mask_array().unwrap()).unwrap();
    loss.item::<f32>().unwrap() as f64
}

/// Sets one element of a parameter.
fn set(lm: &mut LoadedModel, name: &str, index: usize, value: f32) {
    let p = lm.model.parameters("").into_iter().find(|(n, _)| n == name).unwrap().1;
    let mut v = vals(&p);
    v[index] = value;
    let new = Array::from_slice(&v, p.shape()).unwrap();
    lm.model.update("", [(name.to_string(), new)].into_iter().collect()).unwrap();
}

/// Asserts that `grad` (the gradient of `name`) equals central finite differences of the loss on
/// `b`, with steps of 1e-2, at `indices` (a function of the parameter's length); returns how many
/// entries were compared.
fn assert_finite_differences(
    lm: &mut LoadedModel,
    b: &Batch,
    name: &str,
    grad: &Array,
    indices: impl Fn(usize) -> Vec<usize>,
) -> usize {
    let p = vals(&lm.model.parameters("").into_iter().find(|(n, _)| n == name).unwrap().1);
    let grad = vals(grad);
    let eps = 1e-2f32;
    let indices = indices(p.len());
    for &index in &indices {
        set(lm, name, index, p[index] + eps);
        let up = loss_of(lm, b);
        set(lm, name, index, p[index] - eps);
        let down = loss_of(lm, b);
        set(lm, name, index, p[index]);
        let fd = (up - down) / (2.0 * eps as f64);
        let an = grad[index] as f64;
        assert!((fd - an).abs() <= 2e-3 + 2e-2 * an.abs(), "{name}[{index}]: finite difference {fd}, gradient {an}");
    }
    indices.len()
}

#[test]
fn gradients_equal_finite_differences() {
    let (_d, mut lm) = load();
    let cfg = LoraConfig { rank: 2, scale: 2.0, dropout: 0.0, keys: None };
    apply_lora(lm.model.as_mut(), None, &cfg, Dtype::Float32, 7).unwrap();
    let trainable = lora_parameter_names(lm.model.as_ref());
    let b = batch();
    // Fresh adapters (B = 0): A gets no gradient, B does.
    let g0 = loss_and_grad(lm.model.as_mut(), &trainable, &b).unwrap();
    for (name, g) in &g0.grads {
        let norm: f32 = vals(g).iter().map(|v| v.abs()).sum();
        if name.ends_with(".lora_a") {
            assert_eq!(norm, 0.0, "{name}");
        }
    }
    assert!(vals(&g0.grads["model.layers.0.mlp.down_proj.lora_b"]).iter().any(|&v| v != 0.0));
    // Move every B away from zero, then compare with central differences.
    move_lora_b(&mut lm, &trainable, 100);
    let base = loss_of(&lm, &b);
    let g = loss_and_grad(lm.model.as_mut(), &trainable, &b).unwrap();
    assert!((g.loss.item::<f32>().unwrap() as f64 - base).abs() < 1e-6 * base, "the same loss as without gradients");
    assert_eq!(loss_of(&lm, &b), base, "the model holds its own parameters again");
    let mut compared = 0;
    for name in [
        "model.layers.0.self_attn.q_proj.lora_a",
        "model.layers.1.mlp.down_proj.lora_b",
        "model.layers.0.self_attn.v_proj.lora_b",
    ] {
        compared += assert_finite_differences(&mut lm, &b, name, &g.grads[name], |n| vec![0, n / 2, n - 1]);
    }
    assert_eq!(compared, 9);
    assert!(matches!(loss_and_grad(lm.model.as_mut(), &[], &b), Err(Error::InvalidParameter(_))));
}

/// QLoRA: adapters on a base kept 4-bit quantised. The gradient flows through MLX's quantised
/// matmul to the adapters and equals finite differences.
#[test]
fn qlora_gradients_through_a_quantised_base() {
    let dir = fixture_with_tokenizer("llama_gqa_q4");
    let opts = LoadOptions { dtype: Some(Dtype::Float32), dequantize: Some(false), ..LoadOptions::default() };
    let mut lm = rmlx_lm::loader::load(dir.path(), &opts).unwrap();
    let mut quantized = 0;
    lm.model.visit_linears("", &mut |_, l| quantized += l.is_quantized() as usize);
    assert!(quantized > 0, "the base stays quantised");
    apply_lora(
        lm.model.as_mut(),
        None,
        &LoraConfig { rank: 2, scale: 2.0, dropout: 0.0, keys: None },
        Dtype::Float32,
        3,
    )
    .unwrap();
    let trainable = lora_parameter_names(lm.model.as_ref());
    let b = batch();
    move_lora_b(&mut lm, &trainable, 200);
    let g = loss_and_grad(lm.model.as_mut(), &trainable, &b).unwrap();
    let name = "model.layers.0.self_attn.q_proj.lora_a";
    assert_eq!(assert_finite_differences(&mut lm, &b, name, &g.grads[name], |n| vec![0, n / 3]), 2);
}

/// DoRA: the gradients of A, B and the magnitudes equal finite differences of the loss with the
/// adapted weight's norm held constant, as mlx-lm defines it (`stop_gradient` on the norm). The
/// finite differences below move one magnitude entry, which leaves that norm unchanged.
#[test]
fn dora_magnitude_gradient_equals_finite_differences() {
    let dir = fixture_with_tokenizer("llama_gqa");
    let mut lm =
        rmlx_lm::loader::load(dir.path(), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
            .unwrap();
    rmlx_lm::tuner::apply_dora(
        lm.model.as_mut(),
        Some(1),
        &LoraConfig { rank: 2, scale: 2.0, dropout: 0.0, keys: None },
        Dtype::Float32,
        1,
    )
    .unwrap();
    let trainable = lora_parameter_names(lm.model.as_ref());
    assert_eq!(trainable.iter().filter(|n| n.ends_with(".m")).count(), 7);
    let b = batch();
    let g = loss_and_grad(lm.model.as_mut(), &trainable, &b).unwrap();
    let name = "model.layers.1.mlp.up_proj.m";
    let grad = &g.grads[name];
    let len = vals(grad).len();
    assert!([0, len / 2].iter().all(|&i| vals(grad)[i] != 0.0), "the magnitude gets a gradient");
    assert_eq!(assert_finite_differences(&mut lm, &b, name, grad, |n| vec![0, n / 2]), 2);
}

/// The compiled step (what `rmlx lora` runs on a GPU) gives the loss and gradients of the op-by-op
/// one, traces once per batch shape, and sees the trainable parameters' new values.
#[test]
fn compiled_loss_and_grad_equal_the_eager_ones() {
    let (_d, mut lm) = load();
    let cfg = LoraConfig { rank: 4, scale: 2.0, dropout: 0.0, keys: None };
    apply_lora(lm.model.as_mut(), None, &cfg, Dtype::Float32, 0).unwrap();
    let trainable = lora_parameter_names(lm.model.as_ref());
    move_lora_b(&mut lm, &trainable, 1);
    let compiled = rmlx_lm::tuner::CompiledLossAndGrad::new(lm.model.as_ref(), &trainable).unwrap();
    let long = Batch::new(&[&Sequence { tokens: (1..40).collect(), offset: 0 }], 2048);
    for (round, b) in [batch(), long, batch()].iter().enumerate() {
        if round == 2 {
            // New adapter values (as after an optimizer step) reach the compiled function.
            move_lora_b(&mut lm, &trainable, 2);
        }
        let eager = loss_and_grad(lm.model.as_mut(), &trainable, b).unwrap();
        let fast = compiled.call(lm.model.as_ref(), b, &rmlx::random::key(0).unwrap()).unwrap();
        assert_same_step(&format!("round {round}"), &eager, &fast, 1e-5, 1e-4);
    }
    assert_eq!(compiled.traces(), 2, "one trace per batch shape");
    // With gradient checkpointing traced into the step.
    let checkpointed = rmlx_lm::tuner::CompiledLossAndGrad::new(lm.model.as_ref(), &trainable).unwrap();
    let fast = rmlx_lm::nn::with_grad_checkpoint(true, || {
        checkpointed.call(lm.model.as_ref(), &batch(), &rmlx::random::key(0).unwrap())
    })
    .unwrap();
    let eager = loss_and_grad(lm.model.as_mut(), &trainable, &batch()).unwrap();
    assert_same_step("checkpointed", &eager, &fast, 1e-5, 1e-4);
}

/// With LoRA dropout the compiled step draws its masks from the key it is given (an input, not a
/// constant of the trace): the op-by-op step with the same key gives the same loss, and another
/// key other masks.
#[test]
fn compiled_step_takes_dropout_masks_from_its_key() {
    let (_d, mut lm) = load();
    let cfg = LoraConfig { rank: 4, scale: 2.0, dropout: 0.5, keys: None };
    apply_lora(lm.model.as_mut(), None, &cfg, Dtype::Float32, 0).unwrap();
    let trainable = lora_parameter_names(lm.model.as_ref());
    move_lora_b(&mut lm, &trainable, 3);
    let compiled = rmlx_lm::tuner::CompiledLossAndGrad::new(lm.model.as_ref(), &trainable).unwrap();
    let mut losses = Vec::new();
    for seed in [1u64, 2, 1] {
        let key = rmlx::random::key(seed).unwrap();
        let fast = compiled.call(lm.model.as_ref(), &batch(), &key).unwrap().loss.item::<f32>().unwrap();
        let eager = rmlx_lm::nn::with_dropout_key(key, || loss_and_grad(lm.model.as_mut(), &trainable, &batch()))
            .unwrap()
            .loss
            .item::<f32>()
            .unwrap();
        assert!((fast - eager).abs() <= 1e-5 * eager.abs(), "key {seed}: compiled {fast} vs op by op {eager}");
        losses.push(fast);
    }
    assert_eq!(losses[0], losses[2], "the same key, the same masks");
    assert!((losses[0] - losses[1]).abs() > 1e-4, "another key, other masks: {losses:?}");
    assert_eq!(compiled.traces(), 1);
}
