//! PEFT's adapter layout: mlx-lm's adapter fixture written as PEFT (names, transposed shapes,
//! `lora_alpha = scale · r`) and read back gives mlx-lm's logits; rsLoRA's scale, and the
//! unsupported variants and broken files, are handled as PEFT defines them.

mod common;

use common::{fixture_with_tokenizer, TempDir};
use rmlx::{Array, Dtype};
use rmlx_lm::tuner::{adapters, peft};
use rmlx_lm::{Error, LoadOptions, LoadedModel};
use serde_json::Value;
use std::path::Path;

fn model() -> (TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer("llama_gqa");
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
        .unwrap();
    (dir, lm)
}

fn logits(lm: &LoadedModel, ids: &[i32]) -> Vec<f32> {
    let x = Array::from_slice(ids, &[1, ids.len() as i32]).unwrap();
    lm.model.forward(&x, &mut lm.model.new_caches(None)).unwrap().to_vec::<f32>().unwrap()
}

fn fixture() -> (std::path::PathBuf, Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/adapters/llama_gqa_all");
    let reference = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    (dir, reference)
}

#[test]
fn mlx_lm_adapters_through_peft_layout_keep_mlx_lm_logits() {
    let (src, reference) = fixture();
    let (_d, mut lm) = model();
    adapters::load(lm.model.as_mut(), &src, Dtype::Float32).unwrap();
    let out = TempDir::new("peft");
    let layers = lm.model.config().num_hidden_layers;
    assert_eq!(peft::save(lm.model.as_mut(), out.path(), "llama_gqa").unwrap(), 7 * layers);
    // The file: PEFT's names and orientation.
    let saved = rmlx::io::load_safetensors(out.path().join(peft::WEIGHTS)).unwrap().arrays;
    assert_eq!(saved.len(), 14 * layers);
    let hidden = lm.model.config().hidden_size;
    let a = &saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
    assert_eq!(a.shape(), &[4, hidden]);
    let b = &saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"];
    assert_eq!(b.shape(), &[hidden, 4]);
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!((cfg["r"].as_i64(), cfg["lora_alpha"].as_f64()), (Some(4), Some(12.0)), "alpha = scale (3) x r (4)");
    let targets: Vec<&str> = cfg["target_modules"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(targets, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]);
    assert_eq!(cfg["layers_to_transform"], serde_json::json!((0..layers).collect::<Vec<_>>()));
    // Read back into a fresh model (found by its layout): mlx-lm's logits.
    let (_d2, mut fresh) = model();
    let got = adapters::load(fresh.model.as_mut(), out.path(), Dtype::Float32).unwrap();
    assert_eq!((got.lora.rank, got.lora.scale), (4, 3.0));
    let ids: Vec<i32> = reference["ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap() as i32).collect();
    let want: Vec<f32> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
        .collect();
    let d = logits(&fresh, &ids).iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(d < 1e-4, "{d}");
}

/// Writes the fixture's adapters as PEFT into a fresh folder and returns it.
fn peft_folder(tag: &str) -> TempDir {
    let (src, _) = fixture();
    let (_d, mut lm) = model();
    adapters::load(lm.model.as_mut(), &src, Dtype::Float32).unwrap();
    let out = TempDir::new(tag);
    peft::save(lm.model.as_mut(), out.path(), "llama_gqa").unwrap();
    out
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let path = dir.join("adapter_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut cfg);
    std::fs::write(&path, cfg.to_string()).unwrap();
}

#[test]
fn rslora_scale_and_refused_variants() {
    let dir = peft_folder("peft-rslora");
    edit_config(dir.path(), |c| c["use_rslora"] = Value::Bool(true));
    let (_d, mut lm) = model();
    let cfg = adapters::load(lm.model.as_mut(), dir.path(), Dtype::Float32).unwrap();
    assert_eq!(cfg.lora.scale, 6.0, "lora_alpha / sqrt(r) = 12 / 2");
    // A regular expression that covers every adapted module is accepted, as PEFT does.
    let dir = peft_folder("peft-regex");
    edit_config(dir.path(), |c| c["target_modules"] = Value::from(r".*\.(q|k|v|o|gate|up|down)_proj"));
    let (_d, mut lm) = model();
    adapters::load(lm.model.as_mut(), dir.path(), Dtype::Float32).unwrap();
    for (key, value, message) in [
        ("fan_in_fan_out", Value::Bool(true), "`fan_in_fan_out: true` is not supported"),
        ("peft_type", Value::from("IA3"), "peft_type \"IA3\" is not supported"),
        ("rank_pattern", serde_json::json!({"q_proj": 8}), "per-module `rank_pattern` is not supported"),
        // What PEFT itself refuses: a rank the weights do not have, targets that name nothing or
        // miss an adapted module, blocks outside `layers_to_transform`.
        ("r", Value::from(16), "`r` is 16 but the weights of `model.layers.0.mlp.down_proj` have rank 4"),
        ("r", Value::from(-8), "`r` must be a positive integer, got -8"),
        ("r", Value::from("x"), "`r` must be a positive integer, got \"x\""),
        ("target_modules", serde_json::json!(["q_proj", "w_nothing"]), "names `w_nothing`, which is no linear layer"),
        ("target_modules", serde_json::json!(["q_proj"]), "is adapted in the weights but not in `target_modules`"),
        ("target_modules", Value::from(".*q_proj"), "does not match `model.layers.0.mlp.down_proj`"),
        (
            "layers_to_transform",
            serde_json::json!([1]),
            "`model.layers.0.mlp.down_proj` is adapted in the weights but outside",
        ),
    ] {
        let dir = peft_folder("peft-refused");
        edit_config(dir.path(), |c| c[key] = value);
        let (_d, mut lm) = model();
        match adapters::load(lm.model.as_mut(), dir.path(), Dtype::Float32) {
            Err(Error::Config(m)) => assert!(m.contains(message), "{m}"),
            other => panic!("{key}: expected a config error, got {other:?}"),
        }
    }
}

#[test]
fn broken_peft_weights_are_named() {
    let dir = peft_folder("peft-broken");
    let path = dir.path().join(peft::WEIGHTS);
    let mut arrays = rmlx::io::load_safetensors(&path).unwrap().arrays;
    arrays.remove("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
    rmlx::io::save_safetensors(&path, &arrays, &Default::default()).unwrap();
    let (_d, mut lm) = model();
    match adapters::load(lm.model.as_mut(), dir.path(), Dtype::Float32) {
        Err(Error::MissingTensor(m)) => assert!(m.contains("model.layers.0.self_attn.q_proj.lora_A/lora_B"), "{m}"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    let a = arrays["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"].clone();
    arrays.insert("base_model.model.model.layers.0.self_attn.qkv.lora_A.weight".into(), a.clone());
    arrays.insert(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight".into(),
        rmlx::ops::zeros(&[a.shape()[1], 4], Dtype::Float32).unwrap(),
    );
    rmlx::io::save_safetensors(&path, &arrays, &Default::default()).unwrap();
    let (_d, mut lm) = model();
    match adapters::load(lm.model.as_mut(), dir.path(), Dtype::Float32) {
        Err(Error::Config(m)) => {
            assert!(m.contains("`model.layers.0.self_attn.qkv` is no linear layer of this model"), "{m}")
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}
