//! Prompt-cache files in mlx-lm's format (`fixtures/prompt_cache/`, written by mlx-lm 0.32.2's
//! `save_prompt_cache` through `scripts/make_prompt_cache_references.py`): rmlx reads mlx-lm's
//! files (plain, rotating and quantised caches) and continues with mlx-lm's greedy tokens, which
//! are also the uncached prompt's; rmlx's own files hold the same arrays and metadata as mlx-lm's
//! and give the same tokens; a truncated file, another model's file, or one made in another dtype
//! or with other adapters is refused with the error that names it.

mod common;

use common::{fixture_dir, fixture_with_tokenizer, ids, TempDir};
use rmlx::{Array, Dtype};
use rmlx_lm::cache::{load_prompt_cache, save_prompt_cache, KvCache, PromptCacheFile};
use rmlx_lm::{Error, GenerateOptions, KvQuantization, LoadOptions, LoadedModel};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The fixture's model, and its folder (the files' fingerprint is read from it).
fn load(name: &str, dtype: Dtype) -> (LoadedModel, TempDir) {
    let dir = fixture_with_tokenizer(name);
    let opts = LoadOptions { dtype: Some(dtype), dequantize: Some(false), ..LoadOptions::default() };
    (rmlx_lm::loader::load(dir.path(), &opts).unwrap(), dir)
}

fn references() -> Value {
    let path = fixture_dir("../prompt_cache").join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn mlx_lm_file(case: &str) -> PathBuf {
    fixture_dir("../prompt_cache").join(format!("{case}.safetensors"))
}

fn greedy() -> GenerateOptions {
    GenerateOptions { max_tokens: 8, ignore_eos: true, ..GenerateOptions::default() }
}

fn after(lm: &LoadedModel, file: PromptCacheFile, suffix: &[u32]) -> Vec<u32> {
    lm.generate_after(file.caches, suffix, &greedy()).unwrap().map(|t| t.unwrap().id).collect()
}

/// Every array of a safetensors file, and its metadata.
fn contents(path: &Path) -> (BTreeMap<String, Array>, BTreeMap<String, String>) {
    let f = rmlx::io::load_safetensors(path).unwrap();
    (f.arrays, f.metadata)
}

/// A ring buffer of a rotating cache's file in temporal order: the first `keep` slots, then from
/// the next write slot to the end, then the slots between.
fn temporal(buf: &Array, arrays: &BTreeMap<String, Array>, layer: &str) -> Array {
    let int = |j: usize| arrays[&format!("{layer}.{j}")].item::<i32>().unwrap();
    let (offset, keep, idx, n) = (int(2), int(3), int(5), buf.shape()[2]);
    if idx >= offset.min(n) {
        return buf.slice_axis(2, 0, idx.min(n), 1).unwrap();
    }
    let parts = [(0, keep), (idx, n), (keep, idx)].map(|(a, b)| buf.slice_axis(2, a, b, 1).unwrap());
    rmlx::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 2).unwrap()
}

#[test]
fn rmlx_continues_mlx_lms_files_with_mlx_lms_tokens() {
    let refs = references();
    let (prefix, suffix) = (ids(&refs["prefix"]), ids(&refs["suffix"]));
    for (case, want) in refs["cases"].as_object().unwrap() {
        let (lm, _dir) = load(want["fixture"].as_str().unwrap(), Dtype::Float32);
        let path = mlx_lm_file(case);
        let file = load_prompt_cache(&path).unwrap();
        assert_eq!(file.metadata["model"], want["fixture"].as_str().unwrap(), "{case}: mlx-lm's metadata");
        assert!(file.caches.iter().all(|c| c.offset() == prefix.len()), "{case}: the prefix's positions");
        let kv = want["kv_bits"].as_i64().map(|b| KvQuantization { bits: b as i32, group_size: 32, start: 0 });
        assert_eq!(file.caches.iter().any(|c| matches!(c, KvCache::Quantized(_))), kv.is_some(), "{case}");
        lm.check_prompt_cache(&path, &file, None, kv.as_ref()).unwrap();
        let got = after(&lm, file, &suffix);
        assert_eq!(got, ids(&want["after_cache"]), "{case}: mlx-lm's tokens after its file");
        if let Some(whole) = want["uncached"].as_array() {
            let uncached: Vec<u32> = {
                let prompt: Vec<u32> = prefix.iter().chain(&suffix).copied().collect();
                lm.generate(&prompt, &greedy()).unwrap().map(|t| t.unwrap().id).collect()
            };
            assert_eq!(uncached, ids(&Value::from(whole.clone())), "{case}: the uncached prompt's tokens");
        }
    }
}

#[test]
fn rmlx_writes_mlx_lms_arrays_and_metadata() {
    let refs = references();
    let (prefix, suffix) = (ids(&refs["prefix"]), ids(&refs["suffix"]));
    let dir = TempDir::new("prompt-cache-write");
    for (case, want) in refs["cases"].as_object().unwrap() {
        let (lm, _dir) = load(want["fixture"].as_str().unwrap(), Dtype::Float32);
        let kv = want["kv_bits"].as_i64().map(|b| KvQuantization { bits: b as i32, group_size: 32, start: 0 });
        let opts = GenerateOptions { kv_quantization: kv, ..greedy() };
        let mut seen = Vec::new();
        let caches = lm.cache_prompt(&prefix, &opts, &mut |done, total| seen.push((done, total))).unwrap();
        assert_eq!(seen.last(), Some(&(prefix.len(), prefix.len())), "{case}: progress reaches the whole prompt");
        let path = dir.path().join(format!("{case}.safetensors"));
        let mut metadata = lm.prompt_cache_metadata(None).unwrap();
        metadata.insert("model".into(), want["fixture"].as_str().unwrap().into());
        save_prompt_cache(&path, &caches, &metadata).unwrap();
        let ((ours, our_meta), (theirs, their_meta)) = (contents(&path), contents(&mlx_lm_file(case)));
        // The same classes and scalar listing; mlx-lm's metadata keys all present with its values.
        let listing = |m: &BTreeMap<String, String>| -> Vec<(String, String)> {
            m.iter().filter(|(k, _)| !k.starts_with("0.")).map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        assert_eq!(listing(&our_meta), listing(&their_meta), "{case}: classes and scalars");
        assert_eq!(our_meta["0.model"], their_meta["0.model"], "{case}");
        assert_eq!(our_meta["0.tokenizer_config"], their_meta["0.tokenizer_config"], "{case}");
        assert_eq!(ours.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>(), "{case}: array names");
        for (name, a) in &ours {
            let b = &theirs[name];
            assert_eq!(a.dtype(), b.dtype(), "{case}: {name}");
            let layer = name.split('.').next().unwrap();
            let rotating = our_meta[&format!("1.{layer}")] == "RotatingKVCache";
            if a.ndim() == 0 {
                // A ring's next slot is where each writes its oldest position: rmlx keeps each
                // position in its own slot, mlx-lm restarts the ring after the prompt.
                if !(rotating && name.ends_with(".5")) {
                    assert_eq!(a.item::<i32>().unwrap(), b.item::<i32>().unwrap(), "{case}: {name}");
                }
                continue;
            }
            // mlx-lm keeps an unbounded cache's whole buffer (zeros past the offset); rmlx the
            // positions held. A ring's positions are compared in temporal order.
            let n = a.shape()[2];
            let (a, b) = match rotating {
                true => (temporal(a, &ours, layer), temporal(b, &theirs, layer)),
                false => (a.clone(), b.slice_axis(2, 0, n, 1).unwrap()),
            };
            assert_eq!(&a.shape()[..3], &b.shape()[..3], "{case}: {name}");
            let (x, y) = (a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap());
            let diff = x.iter().zip(&y).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            let words = a.dtype() == Dtype::Uint32;
            assert!(if words { x == y } else { diff < 1e-4 }, "{case}: {name} differs by {diff}");
        }
        let file = load_prompt_cache(&path).unwrap();
        lm.check_prompt_cache(&path, &file, None, kv.as_ref()).unwrap();
        assert_eq!(after(&lm, file, &suffix), ids(&want["after_cache"]), "{case}: tokens after rmlx's file");
    }
}

#[test]
fn foreign_and_truncated_files_are_refused_by_name() {
    let dir = TempDir::new("prompt-cache-errors");
    let (lm, _dir) = load("qwen3", Dtype::Float32);
    let prefix = ids(&references()["prefix"]);
    let caches = lm.cache_prompt(&prefix, &greedy(), &mut |_, _| {}).unwrap();
    let path = dir.path().join("qwen3.safetensors");
    save_prompt_cache(&path, &caches, &lm.prompt_cache_metadata(None).unwrap()).unwrap();
    let file = || load_prompt_cache(&path).unwrap();
    let refused = |r: rmlx_lm::Result<()>, want: &str| match r {
        Err(Error::PromptCache { reason, .. }) => assert!(reason.contains(want), "`{reason}` names `{want}`"),
        other => panic!("expected a prompt-cache error naming `{want}`, got {other:?}"),
    };
    // Another model (its fingerprint differs before any shape is compared).
    let (mistral, _d1) = load("mistral", Dtype::Float32);
    refused(mistral.check_prompt_cache(&path, &file(), None, None), "made for");
    // Another dtype.
    let (half, _d2) = load("qwen3", Dtype::Bfloat16);
    refused(half.check_prompt_cache(&path, &file(), None, None), "made in float32");
    // Adapters now and not then.
    let adapters = fixture_dir("qwen3");
    refused(lm.check_prompt_cache(&path, &file(), Some(&adapters), None), "made without adapters");
    // Quantised at other settings than asked.
    let q_caches = lm
        .cache_prompt(
            &prefix,
            &GenerateOptions {
                kv_quantization: Some(KvQuantization { bits: 4, group_size: 32, start: 0 }),
                ..greedy()
            },
            &mut |_, _| {},
        )
        .unwrap();
    let q_path = dir.path().join("q4.safetensors");
    save_prompt_cache(&q_path, &q_caches, &lm.prompt_cache_metadata(None).unwrap()).unwrap();
    let eight = KvQuantization { bits: 8, group_size: 32, start: 0 };
    refused(
        lm.check_prompt_cache(&q_path, &load_prompt_cache(&q_path).unwrap(), None, Some(&eight)),
        "quantised at 4 bits",
    );
    // mlx-lm's file for another model: its shapes.
    let other = mlx_lm_file("gemma3_text_pattern");
    refused(lm.check_prompt_cache(&other, &load_prompt_cache(&other).unwrap(), None, None), "layers' caches");
    // Cut short: the safetensors header's offsets pass the end.
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    assert!(matches!(load_prompt_cache(&cut), Err(Error::Corrupt { .. })), "a truncated file is corrupt");
    // A weights file is no prompt cache.
    let weights = fixture_dir("qwen3").join("model.safetensors");
    match load_prompt_cache(&weights) {
        Err(Error::Corrupt { reason, .. }) => assert!(reason.contains("not a prompt-cache file"), "{reason}"),
        other => panic!("a weights file: {:?}", other.err()),
    }
    // A batch's cache or a quantised window has no mlx-lm class: not written.
    let window = vec![KvCache::Quantized(rmlx_lm::cache::QuantizedCache::new(eight, Some((8, 0))))];
    assert!(save_prompt_cache(&dir.path().join("w.safetensors"), &window, &BTreeMap::new()).is_err());
}
