//! Gradient checkpointing (`with_grad_checkpoint`, `rmlx lora --grad-checkpoint`): the loss and
//! every gradient equal those taken without it, for LoRA and for full fine-tuning, on Llama, Qwen 3
//! and Gemma 3 (whose sliding-window layers must keep their window in the recomputation); the
//! checkpointed blocks really run as such (they leave the training caches empty); and LoRA dropout
//! drops the same elements when a block is recomputed (the gradient equals finite differences of
//! the loss with those masks).

mod common;
#[path = "common/training.rs"]
mod training;

use common::fixture_with_tokenizer;
use rmlx::{Array, Dtype};
use rmlx_lm::nn::{with_grad_checkpoint, with_training, ModuleExt};
use rmlx_lm::tuner::{apply_lora, batch_loss, full_parameter_names, lora_parameter_names, loss_and_grad};
use rmlx_lm::tuner::{Batch, LoraConfig, LossAndGrad, Sequence};
use rmlx_lm::{LoadOptions, LoadedModel};
use training::move_lora_b;

fn load(name: &str) -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(name);
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
        .unwrap();
    (dir, lm)
}

fn vals(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

/// Two rows longer than Gemma's fixture window (8), one with a masked prompt.
fn batch() -> Batch {
    let a = Sequence { tokens: vec![3, 17, 42, 8, 99, 5, 61, 23, 70, 11, 54, 36, 90, 14], offset: 3 };
    let b = Sequence { tokens: vec![12, 7, 88, 23, 45, 67, 2, 31, 80, 19], offset: 0 };
    Batch::new(&[&a, &b], 2048)
}

/// LoRA (or DoRA) on every block but the first (which then runs checkpointed with nothing to
/// train), each B moved away from zero so that every factor gets a gradient.
fn with_lora(lm: &mut LoadedModel, dropout: f32, dora: bool) -> Vec<String> {
    let layers = lm.model.config().num_hidden_layers;
    let cfg = LoraConfig { rank: 2, scale: 2.0, dropout, keys: None };
    let attach = if dora { rmlx_lm::tuner::apply_dora } else { apply_lora };
    attach(lm.model.as_mut(), Some(layers - 1), &cfg, Dtype::Float32, 5).unwrap();
    let trainable = lora_parameter_names(lm.model.as_ref());
    move_lora_b(lm, &trainable, 300);
    trainable
}

/// `(without, with)` checkpointing.
fn both(lm: &mut LoadedModel, trainable: &[String]) -> (LossAndGrad, LossAndGrad) {
    let b = batch();
    let plain = loss_and_grad(lm.model.as_mut(), trainable, &b).unwrap();
    let checkpointed = with_grad_checkpoint(true, || loss_and_grad(lm.model.as_mut(), trainable, &b)).unwrap();
    (plain, checkpointed)
}

/// Every element of `got` within `rel` of the largest magnitude of `want`, which is not zero.
fn assert_close(what: &str, got: &Array, want: &Array, rel: f32) {
    let (got, want) = (vals(got), vals(want));
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: an all-zero gradient compares nothing");
    let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0f32, f32::max);
    assert!(worst <= rel * scale, "{what}: differs by {worst} (largest magnitude {scale})");
}

fn assert_same(model: &str, plain: &LossAndGrad, checkpointed: &LossAndGrad) {
    let (l0, l1) = (plain.loss.item::<f32>().unwrap(), checkpointed.loss.item::<f32>().unwrap());
    assert!((l0 - l1).abs() <= 1e-6 * l0.abs(), "{model}: loss {l1} with checkpointing, {l0} without");
    assert_eq!(plain.ntoks.item::<f32>().unwrap(), checkpointed.ntoks.item::<f32>().unwrap());
    assert_eq!(plain.grads.len(), checkpointed.grads.len());
    for (name, g) in &plain.grads {
        assert_close(&format!("{model}: {name}"), &checkpointed.grads[name], g, 1e-6);
    }
}

#[test]
fn lora_loss_and_gradients_equal_those_without_checkpointing() {
    for name in ["llama_gqa", "qwen3", "gemma3_text"] {
        let (_d, mut lm) = load(name);
        let trainable = with_lora(&mut lm, 0.0, false);
        let layers = lm.model.config().num_hidden_layers;
        assert_eq!(trainable.len(), 14 * (layers - 1), "{name}: A and B of 7 linears per adapted block");
        let (plain, checkpointed) = both(&mut lm, &trainable);
        assert_same(name, &plain, &checkpointed);
    }
}

/// QLoRA (the quantised weights stay captured constants: MLX has no gradient for them) and DoRA
/// (the magnitudes are inputs of the checkpointed blocks too).
#[test]
fn qlora_and_dora_gradients_equal_those_without_checkpointing() {
    let dir = fixture_with_tokenizer("llama_gqa_q4");
    let opts = LoadOptions { dtype: Some(Dtype::Float32), dequantize: Some(false), ..LoadOptions::default() };
    let mut lm = rmlx_lm::loader::load(dir.path(), &opts).unwrap();
    let trainable = with_lora(&mut lm, 0.0, false);
    let (plain, checkpointed) = both(&mut lm, &trainable);
    assert_same("llama_gqa_q4", &plain, &checkpointed);
    let (_d, mut lm) = load("llama_gqa");
    let trainable = with_lora(&mut lm, 0.0, true);
    assert_eq!(trainable.iter().filter(|n| n.ends_with(".m")).count(), 7);
    let (plain, checkpointed) = both(&mut lm, &trainable);
    assert_same("llama_gqa DoRA", &plain, &checkpointed);
}

#[test]
fn full_fine_tuning_gradients_equal_those_without_checkpointing() {
    for name in ["llama_gqa", "gemma3_text"] {
        let (_d, mut lm) = load(name);
        let trainable = full_parameter_names(lm.model.as_ref(), None).unwrap();
        assert!(trainable.iter().any(|n| n == "model.layers.1.self_attn.q_proj.weight"), "{name}: base weights train");
        assert!(trainable.iter().any(|n| n == "model.layers.0.input_layernorm.weight"), "{name}: norms train");
        let (plain, checkpointed) = both(&mut lm, &trainable);
        assert_same(name, &plain, &checkpointed);
    }
}

/// A checkpointed block attends through a cache of its own: the model's caches stay empty, while
/// the logits are the same. A cache that already holds positions (decoding) is used as ever.
#[test]
fn checkpointed_blocks_leave_the_caches_empty() {
    let (_d, lm) = load("gemma3_text");
    let ids = Array::from_slice(&(1..=12).collect::<Vec<i32>>(), &[1, 12]).unwrap();
    let mut caches = lm.model.new_caches(None);
    let plain = lm.model.forward(&ids, &mut caches).unwrap();
    assert!(caches.iter().all(|c| c.offset() == 12));
    let mut fresh = lm.model.new_caches(None);
    let checkpointed = with_grad_checkpoint(true, || lm.model.forward(&ids, &mut fresh)).unwrap();
    assert!(fresh.iter().all(|c| c.offset() == 0), "every block ran checkpointed");
    assert_close("logits", &checkpointed, &plain, 1e-6);
    let next = Array::from_slice(&[13i32], &[1, 1]).unwrap();
    let step = with_grad_checkpoint(true, || lm.model.forward(&next, &mut caches)).unwrap();
    assert!(caches.iter().all(|c| c.offset() == 13));
    assert_eq!(step.shape(), &[1, 1, lm.model.config().vocab_size]);
}

/// LoRA dropout under checkpointing: the recomputed blocks drop what the forward pass dropped, so
/// the gradient is that of the loss computed with those masks (the same seed draws the same masks
/// for the checkpointed loss alone): it equals central finite differences of that loss.
#[test]
fn dropout_is_the_same_in_the_recomputation() {
    let (_d, mut lm) = load("llama_gqa");
    let trainable = with_lora(&mut lm, 0.5, false);
    let b = batch();
    let (tokens, mask) = (b.to_array().unwrap(), b.mask_array().unwrap());
    let loss = |lm: &LoadedModel| -> f64 {
        rmlx::random::seed(11);
        let (l, _) =
            with_training(|| with_grad_checkpoint(true, || batch_loss(lm.model.as_ref(), &tokens, &mask))).unwrap();
        l.item::<f32>().unwrap() as f64
    };
    rmlx::random::seed(11);
    let g = with_grad_checkpoint(true, || loss_and_grad(lm.model.as_mut(), &trainable, &b)).unwrap();
    let base = loss(&lm);
    assert!((g.loss.item::<f32>().unwrap() as f64 - base).abs() <= 1e-6 * base, "the same masks as the loss alone");
    rmlx::random::seed(12);
    let (other, _) =
        with_training(|| with_grad_checkpoint(true, || batch_loss(lm.model.as_ref(), &tokens, &mask))).unwrap();
    assert!((other.item::<f32>().unwrap() as f64 - base).abs() > 1e-4, "another seed drops other elements");
    let eps = 1e-2f32;
    for name in [
        "model.layers.1.self_attn.q_proj.lora_a",
        "model.layers.1.mlp.down_proj.lora_b",
        "model.layers.1.mlp.up_proj.lora_b",
    ] {
        let p = lm.model.parameters("").into_iter().find(|(n, _)| n == name).unwrap().1;
        let (values, grad) = (vals(&p), vals(&g.grads[name]));
        for index in [0, values.len() / 2, values.len() - 1] {
            let mut at = |delta: f32| {
                let mut v = values.clone();
                v[index] += delta;
                let new = Array::from_slice(&v, p.shape()).unwrap();
                lm.model.update("", [(name.to_string(), new)].into_iter().collect()).unwrap();
                loss(&lm)
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
            at(0.0);
            let an = grad[index] as f64;
            assert!(
                (fd - an).abs() <= 2e-3 + 2e-2 * an.abs(),
                "{name}[{index}]: finite difference {fd}, gradient {an}"
            );
        }
    }
}
