//! Helpers shared by the model tests: fixture folders (copied to a temporary directory with a
//! word-level tokenizer covering the vocabulary, since the random-weight fixtures ship none) and
//! their transformers reference outputs.
#![allow(dead_code)]

pub mod ranks;

use serde_json::Value;
use std::path::{Path, PathBuf};

/// The config.json sizes that must be positive integers below a bound (what a hostile or fuzzed
/// config sets first).
pub const CONFIG_SIZE_FIELDS: &[&str] = &[
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "sliding_window",
    "sliding_window_pattern",
];

/// `tests/fixtures/models/<name>`.
pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

/// A fresh temporary directory (removed when dropped).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "rmlx-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A word-level tokenizer.json whose tokens are `t0 … t{vocab-1}`.
pub fn word_tokenizer(vocab: usize) -> String {
    let map: serde_json::Map<String, Value> = (0..vocab).map(|i| (format!("t{i}"), Value::from(i))).collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": map, "unk_token": "t0"}
    })
    .to_string()
}

/// The fixture copied into a temporary folder with a tokenizer.json added.
pub fn fixture_with_tokenizer(name: &str) -> TempDir {
    let src = fixture_dir(name);
    let dst = TempDir::new(name);
    for e in std::fs::read_dir(&src).unwrap_or_else(|e| panic!("{}: {e}", src.display())) {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.path().join(e.file_name())).unwrap();
    }
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let vocab = cfg
        .get("vocab_size")
        .or_else(|| cfg.get("text_config").and_then(|t| t.get("vocab_size")))
        .and_then(Value::as_u64)
        .unwrap();
    std::fs::write(dst.path().join("tokenizer.json"), word_tokenizer(vocab as usize)).unwrap();
    dst
}

/// `reference.json` of a fixture.
pub fn reference(name: &str) -> Value {
    let p = fixture_dir(name).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// A JSON list of ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("a list").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

/// A JSON matrix of floats, flattened.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("a list")
        .iter()
        .flat_map(|r| r.as_array().expect("rows").iter().map(|x| x.as_f64().unwrap() as f32))
        .collect()
}

/// Whether float32 products run as TF32 here: on a GPU, MLX's default (`MLX_ENABLE_TF32=0` turns
/// it off). Results compared across batch shapes or against float32 references then need the
/// TF32 tolerances.
#[allow(dead_code)]
pub fn tf32() -> bool {
    rmlx::default_device().kind == rmlx::DeviceType::Gpu && std::env::var("MLX_ENABLE_TF32").map_or(true, |v| v != "0")
}

/// Token ids as one int32 row `[1, L]`.
pub fn ids_array(ids: &[u32]) -> rmlx::Array {
    let v: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    rmlx::Array::from_slice(&v, &[1, v.len() as i32]).unwrap()
}

/// The largest element-wise difference of two equally long lists.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The exact distribution of the token after `ids` under `lm` through `sampler`'s chain (its
/// filters and temperature): the tokens it can draw, with their probabilities.
pub fn next_token_distribution(
    lm: &rmlx_lm::LoadedModel,
    sampler: &rmlx_lm::sample::SamplerConfig,
    ids: &[u32],
) -> Vec<(u32, f64)> {
    let logits = lm.model.forward(&ids_array(ids), &mut lm.model.new_caches(None)).unwrap();
    let len = logits.shape()[1];
    let last = logits.slice_axis(1, len - 1, len, 1).unwrap().reshape(&[1, -1]).unwrap();
    let s = rmlx_lm::sample::Sampler::new(sampler.clone()).unwrap();
    let p = s.distribution(&s.logprobs(&last, ids).unwrap()).unwrap().to_vec::<f32>().unwrap();
    p.iter().enumerate().filter(|(_, &x)| x > 0.0).map(|(i, &x)| (i as u32, x as f64)).collect()
}
