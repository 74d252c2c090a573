//! Attention keys: layer 0 of the qwen2 fixture computed by hand from its weights (embedding,
//! RMSNorm, k_proj with bias, RoPE with base 10⁶), causality across prompt lengths, a sliding
//! window layer holding the whole prompt, the summary's arithmetic, and the files written.

mod common;

use common::{fixture_dir, fixture_with_tokenizer, ids, reference};
use rmlx_lm::inspect::{AttentionInspector, Keys};

fn tensor(name: &str) -> (Vec<f32>, Vec<i32>) {
    let st = rmlx::io::load_safetensors(fixture_dir("qwen2").join("model.safetensors")).unwrap();
    let a = st.arrays[name].astype(rmlx::Dtype::Float32).unwrap();
    (a.to_vec::<f32>().unwrap(), a.shape().to_vec())
}

/// Layer 0's keys by hand: k = RMSNorm(embed[t]) · Wkᵀ + b, then each head's halves rotated by
/// position · 10⁶^(−2i/d).
fn layer0_keys(prompt: &[u32]) -> Vec<Vec<Vec<f32>>> {
    let (embed, es) = tensor("model.embed_tokens.weight");
    let (norm, _) = tensor("model.layers.0.input_layernorm.weight");
    let (wk, ws) = tensor("model.layers.0.self_attn.k_proj.weight");
    let (bk, _) = tensor("model.layers.0.self_attn.k_proj.bias");
    let (hidden, rows) = (es[1] as usize, ws[0] as usize);
    let (heads, d) = (2usize, rows / 2);
    let mut out = vec![vec![Vec::new(); prompt.len()]; heads];
    for (pos, &t) in prompt.iter().enumerate() {
        let x = &embed[t as usize * hidden..(t as usize + 1) * hidden];
        let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / hidden as f64;
        let h: Vec<f64> = x.iter().zip(&norm).map(|(v, w)| *v as f64 / (ms + 1e-6).sqrt() * *w as f64).collect();
        let k: Vec<f64> = (0..rows)
            .map(|r| bk[r] as f64 + (0..hidden).map(|c| wk[r * hidden + c] as f64 * h[c]).sum::<f64>())
            .collect();
        for (head, slot) in out.iter_mut().enumerate() {
            let kh = &k[head * d..(head + 1) * d];
            let mut rotated = vec![0f32; d];
            for i in 0..d / 2 {
                let angle = pos as f64 / 1e6f64.powf(2.0 * i as f64 / d as f64);
                let (s, c) = angle.sin_cos();
                rotated[i] = (kh[i] * c - kh[i + d / 2] * s) as f32;
                rotated[i + d / 2] = (kh[i + d / 2] * c + kh[i] * s) as f32;
            }
            slot[pos] = rotated;
        }
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn layer0_keys_match_a_hand_computation() {
    let dir = fixture_with_tokenizer("qwen2");
    let lm = rmlx_lm::loader::load(dir.path(), &Default::default()).unwrap();
    let prompt = ids(&reference("qwen2")["prompt_ids"]);
    let keys = AttentionInspector::new(&lm).keys(&prompt).unwrap();
    assert_eq!((keys.layers, keys.kv_heads, keys.positions, keys.head_dim), (2, 2, 24, 16));
    let want = layer0_keys(&prompt);
    let mut worst = 0f32;
    for (h, head) in want.iter().enumerate() {
        for (p, k) in head.iter().enumerate() {
            worst = worst.max(max_abs_diff(keys.key(0, h, p), k));
        }
    }
    assert!(worst < 1e-4, "max |Δ| {worst}");
    // Keys are causal: a prefix's keys are the longer prompt's first positions, in every layer.
    let short = AttentionInspector::new(&lm).keys(&prompt[..7]).unwrap();
    for l in 0..2 {
        for h in 0..2 {
            for p in 0..7 {
                let d = max_abs_diff(short.key(l, h, p), keys.key(l, h, p));
                assert!(d < 1e-5, "layer {l} head {h} position {p}: {d}");
            }
        }
    }
}

/// gemma3_text's sliding layers (window 8) still report all 24 positions after one prefill.
#[test]
fn sliding_layers_report_every_position() {
    let dir = fixture_with_tokenizer("gemma3_text");
    let lm = rmlx_lm::loader::load(dir.path(), &Default::default()).unwrap();
    let prompt = ids(&reference("gemma3_text")["prompt_ids"]);
    let keys = AttentionInspector::new(&lm).keys(&prompt).unwrap();
    assert_eq!((keys.layers, keys.positions), (6, 24));
    let short = AttentionInspector::new(&lm).keys(&prompt[..20]).unwrap();
    let d = max_abs_diff(short.key(0, 0, 19), keys.key(0, 0, 19));
    assert!(d < 1e-5);
    assert!(AttentionInspector::new(&lm).keys(&[]).is_err());
    assert!(matches!(AttentionInspector::new(&lm).keys(&[100_000]), Err(rmlx_lm::Error::Prompt(_))));
}

#[test]
fn summary_and_files() {
    // Two positions per head: head 0's keys point the same way, head 1's are orthogonal.
    let keys = Keys {
        layers: 1,
        kv_heads: 2,
        positions: 2,
        head_dim: 2,
        data: vec![3.0, 4.0, 6.0, 8.0, 1.0, 0.0, 0.0, 2.0],
        prompt: vec![5, 6],
    };
    let s = keys.summary();
    assert!((s[0].mean_norm - (5.0 + 10.0 + 1.0 + 2.0) / 4.0).abs() < 1e-6);
    assert!((s[0].head_cosine[0].unwrap() - 1.0).abs() < 1e-6);
    assert!(s[0].head_cosine[1].unwrap().abs() < 1e-6);

    let dir = common::TempDir::new("inspect-files");
    let npy = dir.path().join("keys.npy");
    keys.save(&npy).unwrap();
    let bytes = std::fs::read(&npy).unwrap();
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    assert_eq!((10 + header_len) % 64, 0);
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 2, 2), }"), "{header}");
    let body: Vec<f32> =
        bytes[10 + header_len..].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(body, keys.data);

    let st = dir.path().join("keys.safetensors");
    keys.save(&st).unwrap();
    let back = rmlx::io::load_safetensors(&st).unwrap();
    assert_eq!(back.arrays["keys"].shape(), [1, 2, 2, 2]);
    assert_eq!(back.arrays["keys"].to_vec::<f32>().unwrap(), keys.data);
    assert_eq!(back.metadata["prompt"], "5,6");
    assert!(matches!(keys.save(&dir.path().join("keys.txt")), Err(rmlx_lm::Error::InvalidParameter(_))));
}
