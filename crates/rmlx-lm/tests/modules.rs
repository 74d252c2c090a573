//! Models as trees of named modules: every parameter listed under the checkpoint's own tensor name
//! with the checkpoint's shape and values, replaced by name (atomically, with shape checks), and
//! linear layers reachable by path to carry LoRA adapters whose output and fused weights are
//! checked against the formula computed by hand.

mod common;

use common::fixture_with_tokenizer;
use rmlx::{Array, Dtype};
use rmlx_lm::nn::{Lora, ModuleExt};
use rmlx_lm::{Error, LoadOptions, LoadedModel};
use std::collections::{BTreeMap, HashMap};

fn load(name: &str) -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(name);
    // Quantised fixtures stay quantised: their parameters are weight, scales and biases.
    let opts = LoadOptions { dtype: Some(Dtype::Float32), dequantize: Some(false), ..LoadOptions::default() };
    let lm = rmlx_lm::loader::load(dir.path(), &opts).unwrap();
    (dir, lm)
}

/// Every tensor of the fixture's safetensors files.
fn checkpoint(name: &str) -> BTreeMap<String, Array> {
    let dir = common::fixture_dir(name);
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            out.extend(rmlx::io::load_safetensors(&p).unwrap().arrays);
        }
    }
    out
}

fn vals(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn parameters_are_the_checkpoints_tensors() {
    for name in ["llama_gqa", "llama_mqa_untied", "qwen2", "qwen3", "gemma3_text", "llama_gqa_q4", "qwen3_q4"] {
        let (_d, lm) = load(name);
        let ckpt = checkpoint(name);
        let params = lm.model.parameters("");
        assert_eq!(
            lm.model.parameter_names(""),
            params.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
            "{name}: same order each visit"
        );
        let mut got: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        got.sort();
        assert_eq!(
            got,
            ckpt.keys().map(String::as_str).collect::<Vec<_>>(),
            "{name}: the same names as the checkpoint"
        );
        for (n, a) in &params {
            let c = &ckpt[n];
            assert_eq!(a.shape(), c.shape(), "{name} {n}: shape");
            let want = vals(c);
            // Gemma keeps its norms as 1 + w.
            let gemma_norm = name.starts_with("gemma") && n.ends_with("norm.weight");
            let want: Vec<f32> = if gemma_norm { want.iter().map(|w| 1.0 + w).collect() } else { want };
            assert!(max_diff(&vals(a), &want) <= 1e-6, "{name} {n}: values");
        }
    }
}

fn logits(lm: &LoadedModel, ids: &[i32]) -> Vec<f32> {
    let x = Array::from_slice(ids, &[1, ids.len() as i32]).unwrap();
    vals(&lm.model.forward(&x, &mut lm.model.new_caches(None)).unwrap())
}

#[test]
fn update_replaces_by_name_and_checks_everything_first() {
    let (_d, mut lm) = load("llama_gqa");
    let ids = [1, 5, 9, 3];
    let before = logits(&lm, &ids);
    let norm = lm.model.parameters("").into_iter().find(|(n, _)| n == "model.norm.weight").unwrap().1;
    let hidden = norm.shape()[0];
    // A wrong shape, or an unknown name, changes nothing.
    let bad: HashMap<String, Array> = [
        ("model.norm.weight".to_string(), rmlx::ops::zeros(&[hidden], Dtype::Float32).unwrap()),
        ("model.layers.0.input_layernorm.weight".to_string(), rmlx::ops::zeros(&[hidden + 1], Dtype::Float32).unwrap()),
    ]
    .into_iter()
    .collect();
    match lm.model.update("", bad) {
        Err(Error::ShapeMismatch { name, expected, found }) => {
            assert_eq!(
                (name.as_str(), expected, found),
                ("model.layers.0.input_layernorm.weight", vec![hidden], vec![hidden + 1])
            );
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    assert_eq!(logits(&lm, &ids), before, "a failed update changes nothing");
    let unknown: HashMap<String, Array> = [("model.nope.weight".to_string(), norm.clone())].into_iter().collect();
    assert!(
        matches!(lm.model.update("", unknown), Err(Error::InvalidParameter(m)) if m == "no parameter named `model.nope.weight`")
    );
    // A zero final norm makes every hidden state, hence every logit, zero.
    let zero: HashMap<String, Array> =
        [("model.norm.weight".to_string(), rmlx::ops::zeros(&[hidden], Dtype::Float32).unwrap())].into_iter().collect();
    assert_eq!(lm.model.update("", zero).unwrap(), 1);
    assert!(logits(&lm, &ids).iter().all(|&v| v == 0.0));
}

#[test]
fn lora_adapters_by_path_match_the_formula_and_fuse() {
    let (_d, mut lm) = load("llama_gqa");
    let ids = [1, 5, 9, 3];
    let base = logits(&lm, &ids);
    // Every projection of every block, and nothing else (the embedding is tied).
    let mut paths = Vec::new();
    lm.model.visit_linears("", &mut |path, _| paths.push(path.to_string()));
    let layers = lm.model.config().num_hidden_layers;
    assert_eq!(paths.len(), 7 * layers);
    assert_eq!(
        &paths[..7],
        &[
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj",
            "model.layers.0.self_attn.o_proj",
            "model.layers.0.mlp.gate_proj",
            "model.layers.0.mlp.up_proj",
            "model.layers.0.mlp.down_proj",
        ]
    );
    // Fresh adapters (B = 0) leave the model's output exactly as it was.
    let key = rmlx::random::key(3).unwrap();
    lm.model.visit_linears("", &mut |_, linear| {
        let (i, o) = linear.dims();
        linear.set_lora(Some(Lora::init(i, o, 4, 2.0, Dtype::Float32, Some(&key)).unwrap())).unwrap();
    });
    assert_eq!(logits(&lm, &ids), base);
    let names = lm.model.parameter_names("");
    assert!(names.contains(&"model.layers.1.mlp.down_proj.lora_b".to_string()));
    assert_eq!(names.iter().filter(|n| n.ends_with(".lora_a")).count(), 7 * layers);
    // A non-zero B: one layer's output is W x + 2 (x A) B, computed here by hand.
    let mut checked = false;
    lm.model.visit_linears("", &mut |path, linear| {
        if path != "model.layers.0.mlp.up_proj" {
            return;
        }
        let (i, o) = linear.dims();
        let a = rmlx::random::normal(&[i, 4], Dtype::Float32, 0.0, 0.5, Some(&rmlx::random::key(1).unwrap())).unwrap();
        let b = rmlx::random::normal(&[4, o], Dtype::Float32, 0.0, 0.5, Some(&rmlx::random::key(2).unwrap())).unwrap();
        let w = linear.fused_weight().unwrap(); // B is still zero: the base weight
        linear
            .set_lora(Some(Lora {
                a: a.clone(),
                b: b.clone(),
                scale: 2.0,
                dropout: 0.0,
                magnitude: None,
                kernels: false,
            }))
            .unwrap();
        let x = rmlx::random::normal(&[3, i], Dtype::Float32, 0.0, 1.0, Some(&rmlx::random::key(4).unwrap())).unwrap();
        let (xv, wv, av, bv) = (vals(&x), vals(&w), vals(&a), vals(&b));
        let (i, o) = (i as usize, o as usize);
        let mut want = vec![0.0f32; 3 * o];
        for r in 0..3 {
            let xa: Vec<f32> = (0..4).map(|k| (0..i).map(|j| xv[r * i + j] * av[j * 4 + k]).sum()).collect();
            for c in 0..o {
                let wx: f32 = (0..i).map(|j| wv[c * i + j] * xv[r * i + j]).sum();
                let ab: f32 = (0..4).map(|k| xa[k] * bv[k * o + c]).sum();
                want[r * o + c] = wx + 2.0 * ab;
            }
        }
        assert!(max_diff(&vals(&linear.forward(&x).unwrap()), &want) < 1e-4, "adapter output");
        // The fused weight gives the same output without the adapter.
        let fused = linear.fused_weight().unwrap();
        let via_fused = vals(&x.matmul(&fused.transpose().unwrap()).unwrap());
        assert!(max_diff(&via_fused, &want) < 1e-4, "fused weight");
        checked = true;
    });
    assert!(checked);
    assert_ne!(logits(&lm, &ids), base, "the adapter now changes the output");
    // Adapters that do not fit are refused.
    lm.model.visit_linears("", &mut |_, linear| {
        let (i, o) = linear.dims();
        let wrong = Lora::init(i + 1, o, 2, 1.0, Dtype::Float32, None).unwrap();
        assert!(matches!(linear.set_lora(Some(wrong)), Err(Error::InvalidParameter(_))));
    });
}

/// LoRA dropout acts in training mode only, and is unbiased: the mean of many dropped-out
/// outputs approaches the output without dropout.
#[test]
fn lora_dropout_only_in_training_and_unbiased() {
    let key = |k| rmlx::random::key(k).unwrap();
    let a = rmlx::random::normal(&[64, 4], Dtype::Float32, 0.0, 0.3, Some(&key(1))).unwrap();
    let b = rmlx::random::normal(&[4, 8], Dtype::Float32, 0.0, 0.3, Some(&key(2))).unwrap();
    let x = rmlx::random::normal(&[2, 64], Dtype::Float32, 0.0, 1.0, Some(&key(3))).unwrap();
    let plain = Lora { a: a.clone(), b: b.clone(), scale: 2.0, dropout: 0.0, magnitude: None, kernels: false };
    let dropped = Lora { a, b, scale: 2.0, dropout: 0.5, magnitude: None, kernels: false };
    let want = vals(&plain.forward(&x).unwrap());
    assert_eq!(vals(&dropped.forward(&x).unwrap()), want, "no dropout outside training");
    rmlx::random::seed(11);
    let draws: Vec<Vec<f32>> =
        rmlx_lm::nn::with_training(|| (0..400).map(|_| vals(&dropped.forward(&x).unwrap())).collect());
    assert!(draws[0] != want && draws[0] != draws[1], "training draws differ");
    let mean: Vec<f32> =
        (0..want.len()).map(|i| draws.iter().map(|d| d[i]).sum::<f32>() / draws.len() as f32).collect();
    let scale = want.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    assert!(max_diff(&mean, &want) < 0.15 * scale, "mean {mean:?} against {want:?}");
    assert!(!rmlx_lm::nn::training(), "training mode ends with the closure");
}
