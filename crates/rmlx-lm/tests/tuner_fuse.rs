//! Fusing adapters into the base weights: the fused folder, loaded with no adapter, gives the logits
//! of the base with its adapter (mlx-lm's own logits for mlx-lm's adapter fixture); a quantised
//! base comes out dequantised with the same logits; Gemma's norms are written as the checkpoint's
//! `w` again, so the fused Gemma equals the original.

mod common;

use common::{fixture_with_tokenizer, TempDir};
use rmlx::{Array, Dtype};
use rmlx_lm::tuner::adapters;
use rmlx_lm::tuner::fuse::{fuse, FuseSummary};
use rmlx_lm::{LoadOptions, LoadedModel};
use std::path::Path;

fn load(dir: &Path) -> LoadedModel {
    rmlx_lm::loader::load(dir, &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }).unwrap()
}

fn logits(lm: &LoadedModel, ids: &[i32]) -> Vec<f32> {
    let x = Array::from_slice(ids, &[1, ids.len() as i32]).unwrap();
    lm.model.forward(&x, &mut lm.model.new_caches(None)).unwrap().to_vec::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn fused_mlx_lm_adapter_gives_mlx_lm_logits() {
    let adapter_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/adapters/llama_gqa_all");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter_dir.join("reference.json")).unwrap()).unwrap();
    let src = fixture_with_tokenizer("llama_gqa");
    let mut lm = load(src.path());
    adapters::load(lm.model.as_mut(), &adapter_dir, Dtype::Float32).unwrap();
    let out = TempDir::new("fused");
    let summary = fuse(&mut lm, src.path(), out.path()).unwrap();
    let layers = lm.model.config().num_hidden_layers;
    assert_eq!(summary, FuseSummary { fused: 7 * layers, tensors: 2 + 9 * layers, shards: 1, dequantized: false });
    for f in ["config.json", "tokenizer.json", "generation_config.json", "model.safetensors"] {
        assert!(out.path().join(f).exists(), "{f}");
    }
    let fused = load(out.path());
    let ids: Vec<i32> = reference["ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap() as i32).collect();
    let want: Vec<f32> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
        .collect();
    let d = max_diff(&logits(&fused, &ids), &want);
    assert!(d < 1e-4, "fused model against mlx-lm with the adapter: {d}");
    assert!(rmlx_lm::tuner::lora_parameter_names(fused.model.as_ref()).is_empty());
}

/// DoRA fused (rows rescaled to the learned magnitudes) reloads with mlx-lm's DoRA logits.
#[test]
fn fused_dora_gives_mlx_lm_logits() {
    let adapter_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/adapters/llama_gqa_dora");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter_dir.join("reference.json")).unwrap()).unwrap();
    let src = fixture_with_tokenizer("llama_gqa");
    let mut lm = load(src.path());
    adapters::load(lm.model.as_mut(), &adapter_dir, Dtype::Float32).unwrap();
    let out = TempDir::new("fused-dora");
    assert_eq!(fuse(&mut lm, src.path(), out.path()).unwrap().fused, 7);
    let ids: Vec<i32> = reference["ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap() as i32).collect();
    let want: Vec<f32> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
        .collect();
    let d = max_diff(&logits(&load(out.path()), &ids), &want);
    assert!(d < 1e-4, "fused DoRA against mlx-lm: {d}");
}

#[test]
fn quantised_base_is_written_dequantised_and_gemma_norms_round_trip() {
    let ids = [1, 5, 9, 3];
    for name in ["llama_gqa_q4", "gemma3_text", "phi3_q4", "gemma2"] {
        let src = fixture_with_tokenizer(name);
        let mut lm = rmlx_lm::loader::load(
            src.path(),
            &LoadOptions { dtype: Some(Dtype::Float32), dequantize: Some(false), ..LoadOptions::default() },
        )
        .unwrap();
        let before = logits(&lm, &ids);
        let out = TempDir::new("fused-plain");
        let summary = fuse(&mut lm, src.path(), out.path()).unwrap();
        assert_eq!((summary.fused, summary.dequantized), (0, name.ends_with("q4")), "{name}");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap()).unwrap();
        assert!(cfg.get("quantization").is_none(), "{name}: the quantization block is gone");
        let d = max_diff(&logits(&load(out.path()), &ids), &before);
        assert!(d < 1e-4, "{name}: fused (no adapter) against the original: {d}");
        // Written under the checkpoint's own names: Phi-3's fused projections, no split ones.
        let written = rmlx::io::load_safetensors(out.path().join("model.safetensors")).unwrap().arrays;
        let original = rmlx::io::load_safetensors(src.path().join("model.safetensors")).unwrap().arrays;
        let base = |n: &str| n.trim_end_matches(".weight").to_string();
        let mut names: Vec<String> = written.keys().map(|n| base(n)).collect();
        let mut expected: Vec<String> =
            original.keys().filter(|n| !n.ends_with(".scales") && !n.ends_with(".biases")).map(|n| base(n)).collect();
        names.sort();
        expected.sort();
        assert_eq!(names, expected, "{name}");
    }
}
