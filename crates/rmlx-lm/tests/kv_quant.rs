//! The quantised key/value cache (`--kv-bits`) against mlx-lm's: greedy tokens of fixture models
//! in float32 with 8-, 4- and 2-bit caches, quantised from the start or from position 14 (after
//! three generated tokens), exactly mlx-lm 0.32.2's (`fixtures/kv_quant/reference.json`, written by
//! `scripts/make_kv_quant_references.py`). A cache bounded to a window (which mlx-lm cannot
//! quantise) keeps the positions and masks of the full-precision one, its values within the
//! quantisation's error; Gemma 3's sliding layers generate with it.

mod common;

use common::{fixture_dir, fixture_with_tokenizer, ids};
use rmlx::{Array, Dtype};
use rmlx_lm::{GenerateOptions, KvCache, KvQuantization, LoadOptions, LoadedModel};
use serde_json::Value;

fn load(name: &str) -> LoadedModel {
    let dir = fixture_with_tokenizer(name);
    let opts = LoadOptions { dtype: Some(Dtype::Float32), dequantize: Some(false), ..LoadOptions::default() };
    rmlx_lm::loader::load(dir.path(), &opts).unwrap()
}

fn greedy(lm: &LoadedModel, prompt: &[u32], n: usize, kv: Option<KvQuantization>) -> Vec<u32> {
    let opts = GenerateOptions { max_tokens: n, ignore_eos: true, kv_quantization: kv, ..GenerateOptions::default() };
    lm.generate(prompt, &opts).unwrap().map(|t| t.unwrap().id).collect()
}

#[test]
fn greedy_tokens_are_mlx_lms_with_a_quantised_cache() {
    let path = fixture_dir("../kv_quant").join("reference.json");
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let prompt = ids(&refs["prompt"]);
    for (name, runs) in refs["fixtures"].as_object().unwrap() {
        let lm = load(name);
        for (setting, want) in runs.as_object().unwrap() {
            let kv = match setting.as_str() {
                "full" => None,
                s => {
                    let n: Vec<usize> = s.split('/').map(|x| x.parse().unwrap()).collect();
                    Some(KvQuantization { bits: n[0] as i32, group_size: n[1] as i32, start: n[2] })
                }
            };
            assert_eq!(greedy(&lm, &prompt, 12, kv), ids(want), "{name} {setting}");
        }
    }
}

/// `rows` random `[1, 2, n, 32]` keys or values.
fn rows(n: i32, seed: u64) -> Array {
    rmlx::random::normal(&[1, 2, n, 32], Dtype::Float32, 0.0, 1.0, Some(&rmlx::random::key(seed).unwrap())).unwrap()
}

fn floats(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn mask_of(m: &rmlx_lm::cache::Mask) -> String {
    match m {
        rmlx_lm::cache::Mask::None => "none".into(),
        rmlx_lm::cache::Mask::Causal => "causal".into(),
        rmlx_lm::cache::Mask::Array(a) => format!("{:?}", a.astype(Dtype::Int32).unwrap().to_vec::<i32>().unwrap()),
    }
}

#[test]
fn a_windowed_cache_quantises_keeping_its_positions_and_masks() {
    // A window of 8 keeping the first 2: a prefill of 5, single steps past the window, a second
    // prefill of 4, more steps. Converted after the first prefill, as generation does.
    let q = KvQuantization { bits: 8, group_size: 32, start: 0 };
    let mut full = KvCache::rotating(8, 2);
    let mut quantized = KvCache::rotating(8, 2);
    let mut seed = 0;
    for len in [5, 1, 1, 1, 1, 1, 4, 1, 1, 1] {
        seed += 1;
        let (k, v) = (rows(len, seed), rows(len, seed + 100));
        let (fk, fv, fm) = full.update(&k, &v).unwrap();
        let (qk, qv, qm) = quantized.update(&k, &v).unwrap();
        quantized.quantize(&q).unwrap();
        assert!(matches!(quantized, KvCache::Quantized(_)));
        assert_eq!(quantized.offset(), full.offset());
        // The same keys in the same order under the same mask (a rotating cache's single steps
        // see every key held, in ring order: there, each row must have one close match).
        let (fk, qk) = (floats(&fk), floats(&qk));
        assert_eq!(fk.len(), qk.len(), "after {len}: keys held");
        let dist = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        // 8 bits in groups of 32 of values within ±4: errors below 4/255 (with rounding, 0.02).
        if len == 1 {
            let mut matched = vec![false; qk.len() / 32];
            for row in fk.chunks(32) {
                let best = qk.chunks(32).enumerate().min_by(|a, b| dist(row, a.1).total_cmp(&dist(row, b.1))).unwrap();
                assert!(dist(row, best.1) < 0.02 && !matched[best.0], "after {len}: a key row has no match");
                matched[best.0] = true;
            }
        } else {
            let d = dist(&fk, &qk);
            assert!(d < 0.02, "after {len}: keys differ by {d}");
        }
        assert_eq!(floats(&fv).len(), floats(&qv).len());
        assert_eq!(mask_of(&qm), mask_of(&fm), "after {len}: mask");
    }
}

#[test]
fn gemma3_sliding_layers_attend_through_a_quantised_cache() {
    // Gemma 3's local layers keep a window of 8: 24 positions pass it three times. Token by token
    // through the caches, the 8-bit cache's logits stay within 5 % of the largest of the full
    // cache's (measured: 0.5–3.3 %, no step past the window worse than before it; the cache test
    // above checks the window's keys and masks exactly).
    let lm = load("gemma3_text");
    let tokens: Vec<u32> = (0..24u32).map(|i| (i * 11 + 3) % 200).collect();
    let q = KvQuantization { bits: 8, group_size: 32, start: 0 };
    let (mut full, mut quantized) = (lm.model.new_caches(None), lm.model.new_caches(None));
    for (i, &t) in tokens.iter().enumerate() {
        let ids = Array::from_slice(&[t], &[1, 1]).unwrap();
        let a = floats(&lm.model.forward(&ids, &mut full).unwrap());
        let b = floats(&lm.model.forward(&ids, &mut quantized).unwrap());
        for c in &mut quantized {
            c.quantize(&q).unwrap();
        }
        let range = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(d < 0.05 * range, "position {i}: {d} of {range}");
    }
    assert!(quantized.iter().all(|c| matches!(c, KvCache::Quantized(_))));
    assert!(quantized.iter().any(|c| c.window() == Some(8)), "the sliding layers stay bounded");
}

#[test]
fn settings_mlx_cannot_pack_are_errors() {
    let lm = load("qwen3");
    let prompt: Vec<u32> = (1..5).collect();
    let bad = |bits, group_size| {
        let opts = GenerateOptions {
            kv_quantization: Some(KvQuantization { bits, group_size, start: 0 }),
            ..GenerateOptions::default()
        };
        lm.generate(&prompt, &opts).err().unwrap().to_string()
    };
    assert!(bad(7, 32).contains("--kv-bits 7 is not supported"), "{}", bad(7, 32));
    assert!(bad(4, 48).contains("--kv-group-size 48 is not supported"));
    // qwen3's heads have 32 dimensions: groups of 64 do not divide them.
    let e = bad(4, 64);
    assert!(e.contains("--kv-group-size 64 does not divide the head dimension 32"), "{e}");
}

#[test]
fn packed_attention_is_the_unpacked_attention() {
    // 4 query heads over 2 key/value heads, 5 keys of 32 dimensions packed at 4 bits: the
    // quantised products give the fused attention's output over the same values unpacked (a
    // prompt's piece takes that path; a decoding step the products).
    let q = KvQuantization { bits: 4, group_size: 32, start: 0 };
    let (k, v) = (rows(5, 1), rows(5, 2));
    let queries =
        rmlx::random::normal(&[1, 4, 3, 32], Dtype::Float32, 0.0, 1.0, Some(&rmlx::random::key(3).unwrap())).unwrap();
    let (pk, pv) = (rmlx_lm::cache::pack(&k, &q).unwrap(), rmlx_lm::cache::pack(&v, &q).unwrap());
    let (uk, uv) = (pk.unpack(Dtype::Float32).unwrap(), pv.unpack(Dtype::Float32).unwrap());
    for mask in [rmlx_lm::cache::Mask::None, rmlx_lm::cache::Mask::Causal] {
        let packed = rmlx_lm::cache::quantized_attention(&queries, &pk, &pv, 0.2, &mask, None, None).unwrap();
        let unpacked = rmlx::fast::scaled_dot_product_attention(&queries, &uk, &uv, 0.2, mask.as_attention()).unwrap();
        let d = floats(&packed).iter().zip(floats(&unpacked)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d < 1e-5, "{}: {d}", mask_of(&mask));
    }
}
