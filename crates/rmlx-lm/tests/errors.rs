//! Bad input gets a clear error naming the problem, never an abort: each case starts from a valid
//! fixture and breaks one thing.

mod common;

use common::{fixture_with_tokenizer, word_tokenizer, TempDir};
use rmlx_lm::{Error, GenerateOptions, LoadOptions};
use serde_json::Value;
use std::path::Path;

fn load(dir: &Path) -> rmlx_lm::Result<rmlx_lm::LoadedModel> {
    rmlx_lm::loader::load(dir, &LoadOptions { progress: false, ..LoadOptions::default() })
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn missing_config() {
    let d = fixture_with_tokenizer("llama_gqa");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::MissingFile(m) if m.contains("config.json")), "{e}");
}

#[test]
fn config_not_json() {
    let d = fixture_with_tokenizer("llama_gqa");
    std::fs::write(d.path().join("config.json"), "{ not json").unwrap();
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::Config(m) if m.contains("JSON")), "{e}");
}

#[test]
fn missing_config_field() {
    let d = fixture_with_tokenizer("llama_gqa");
    edit_config(d.path(), |c| {
        c.remove("hidden_size");
    });
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::Config(m) if m.contains("hidden_size")), "{e}");
}

#[test]
fn invalid_config_value() {
    let d = fixture_with_tokenizer("llama_gqa");
    edit_config(d.path(), |c| {
        c.insert("num_key_value_heads".into(), Value::from(3));
    });
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::Config(m) if m.contains("num_key_value_heads")), "{e}");
}

#[test]
fn unknown_architecture_lists_supported() {
    let d = fixture_with_tokenizer("llama_gqa");
    edit_config(d.path(), |c| {
        c.insert("model_type".into(), Value::from("mamba"));
    });
    let e = load(d.path()).err().unwrap();
    let msg = e.to_string();
    assert!(matches!(&e, Error::UnsupportedArchitecture { model_type, .. } if model_type == "mamba"), "{msg}");
    for name in ["llama", "qwen2", "qwen3", "gemma3_text"] {
        assert!(msg.contains(name), "{msg}");
    }
}

#[test]
fn unsupported_rope_scaling() {
    let d = fixture_with_tokenizer("llama_gqa");
    edit_config(d.path(), |c| {
        c.remove("rope_parameters");
        c.insert("rope_scaling".into(), serde_json::json!({"rope_type": "dynamic", "factor": 4.0}));
    });
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::Config(m) if m.contains("dynamic")), "{e}");
}

#[test]
fn missing_shard_named_by_index() {
    let d = fixture_with_tokenizer("llama_mqa_untied");
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("model.safetensors.index.json")).unwrap()).unwrap();
    let shard = index["weight_map"].as_object().unwrap().values().next().unwrap().as_str().unwrap().to_string();
    std::fs::remove_file(d.path().join(&shard)).unwrap();
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::MissingFile(m) if m.contains(&shard)), "{e}");
}

#[test]
fn no_weights_at_all() {
    let d = TempDir::new("noweights");
    std::fs::copy(common::fixture_dir("llama_gqa").join("config.json"), d.path().join("config.json")).unwrap();
    std::fs::write(d.path().join("tokenizer.json"), word_tokenizer(16)).unwrap();
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::MissingFile(m) if m.contains("safetensors")), "{e}");
}

/// Rewrites the fixture's single safetensors file without one tensor, or with one tensor replaced.
fn rewrite_weights(dir: &Path, f: impl FnOnce(&mut std::collections::BTreeMap<String, rmlx::Array>)) {
    let p = dir.join("model.safetensors");
    let mut st = rmlx::io::load_safetensors(&p).unwrap();
    f(&mut st.arrays);
    std::fs::remove_file(&p).unwrap();
    rmlx::io::save_safetensors(&p, &st.arrays, &st.metadata).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let d = fixture_with_tokenizer("llama_gqa");
    rewrite_weights(d.path(), |w| {
        w.remove("model.layers.1.mlp.up_proj.weight").unwrap();
    });
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::MissingTensor(n) if n == "model.layers.1.mlp.up_proj.weight"), "{e}");
}

#[test]
fn shape_mismatch_is_named() {
    let d = fixture_with_tokenizer("llama_gqa");
    rewrite_weights(d.path(), |w| {
        let t = w["model.layers.0.self_attn.o_proj.weight"].clone();
        let s = t.shape().to_vec();
        let cut = t.slice_axis(0, 0, s[0] - 1, 1).unwrap();
        w.insert("model.layers.0.self_attn.o_proj.weight".into(), cut);
    });
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::ShapeMismatch { name, .. } if name == "model.layers.0.self_attn.o_proj.weight"), "{e}");
}

#[test]
fn truncated_weights() {
    let d = fixture_with_tokenizer("llama_gqa");
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let e = load(d.path()).err().unwrap();
    assert!(matches!(&e, Error::Corrupt { reason, .. } if reason.contains("truncated")), "{e}");
}

#[test]
fn tokenizer_larger_than_vocabulary() {
    // Loads (as Gemma 3's does); its ids past the embedding are refused as input.
    let d = fixture_with_tokenizer("llama_gqa");
    std::fs::write(d.path().join("tokenizer.json"), word_tokenizer(100_000)).unwrap();
    let lm = load(d.path()).unwrap();
    let e = lm.encode_prompt("t1 t99999", true, None).err().unwrap();
    assert!(
        matches!(&e, Error::Prompt(m) if m.contains("token id 99999 (position 1)") && m.contains("384 rows")),
        "{e}"
    );
}

#[test]
fn empty_and_too_long_prompts() {
    let d = fixture_with_tokenizer("llama_gqa");
    let lm = load(d.path()).unwrap();
    let e = lm.generate(&[], &GenerateOptions::default()).err().unwrap();
    assert!(matches!(&e, Error::Prompt(m) if m.contains("empty")), "{e}");
    let opts = GenerateOptions { context_limit: Some(8), ..GenerateOptions::default() };
    let e = lm.generate(&[1; 9], &opts).err().unwrap();
    assert!(matches!(&e, Error::Prompt(m) if m.contains("9 tokens") && m.contains('8')), "{e}");
    let e = lm.generate(&[1_000_000], &GenerateOptions::default()).err().unwrap();
    assert!(matches!(&e, Error::Prompt(m) if m.contains("1000000")), "{e}");
}

#[test]
fn bad_sampling_parameters() {
    let d = fixture_with_tokenizer("llama_gqa");
    let lm = load(d.path()).unwrap();
    let mut opts = GenerateOptions::default();
    opts.sampler.top_p = 1.5;
    let e = lm.generate(&[1, 2], &opts).err().unwrap();
    assert!(matches!(&e, Error::InvalidParameter(_)), "{e}");
}
