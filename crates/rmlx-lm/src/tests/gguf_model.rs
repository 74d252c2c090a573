//! A small GGUF llama model for tests, written from a safetensors fixture: the hostile-file tests
//! and the fuzzers edit its metadata.
#![allow(dead_code)]

use std::path::Path;

/// One metadata entry: key, GGUF value type, encoded value.
pub type Meta = (String, u32, Vec<u8>);

/// A GGUF llama model written from the llama_gqa fixture's float32 tensors (llama.cpp names; the
/// Q/K row permutation is not applied, which changes the outputs but not the loading), with its
/// `llama.*` metadata edited by `meta`.
pub fn gguf_model(path: &Path, meta: impl FnOnce(&mut Vec<Meta>)) {
    let mut kv = metadata(
        "llama",
        384,
        &[
            ("embedding_length", U32, u32v(64)),
            ("block_count", U32, u32v(2)),
            ("feed_forward_length", U32, u32v(128)),
            ("attention.head_count", U32, u32v(4)),
            ("attention.head_count_kv", U32, u32v(2)),
            ("attention.layer_norm_rms_epsilon", F32, f32v(1e-5)),
            ("rope.freq_base", F32, f32v(10000.0)),
        ],
    );
    meta(&mut kv);
    write_gguf(path, &kv, &llama_cpp_tensors("llama_gqa", None));
}

/// GGUF value types: uint32, float32.
const U32: u32 = 4;
const F32: u32 = 6;

fn u32v(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn f32v(v: f32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// `general.architecture` = `arch`, the `arch.`-prefixed `entries`, and a tokenizer of `vocab`
/// tokens ([`tokenizer`]).
fn metadata(arch: &str, vocab: usize, entries: &[(&str, u32, Vec<u8>)]) -> Vec<Meta> {
    let (tokens, merges) = tokenizer(vocab);
    let mut kv = vec![("general.architecture".to_string(), 8, text(arch))];
    kv.extend(entries.iter().map(|(k, ty, v)| (format!("{arch}.{k}"), *ty, v.clone())));
    kv.extend([
        ("tokenizer.ggml.model".into(), 8, text("gpt2")),
        ("tokenizer.ggml.tokens".into(), 9, tokens),
        ("tokenizer.ggml.merges".into(), 9, merges),
    ]);
    kv
}

/// The float32 tensors of `fixture` under llama.cpp's names, as its converter writes them: the
/// blocks' parts renamed, each layer's experts (`<layer>.<ffn>.experts.<e>.<projection>.weight`,
/// Hugging Face's per-expert layout, Mixtral's `w1`/`w3`/`w2` too) stacked into
/// `ffn_{gate,up,down}_exps` `[experts, out, in]`, and with `permute: Some((heads, kv_heads))` the
/// query and key rows permuted as for a llama.
fn llama_cpp_tensors(fixture: &str, permute: Option<(i32, i32)>) -> Vec<(String, rmlx::Array)> {
    const FIXED: [(&str, &str); 3] =
        [("model.embed_tokens.", "token_embd."), ("model.norm.", "output_norm."), ("lm_head.", "output.")];
    const PARTS: [(&str, &str); 15] = [
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("mlp.gate.", "ffn_gate_inp."),
        ("block_sparse_moe.gate.", "ffn_gate_inp."),
        // Phi-3's fused projections keep their fusion.
        ("self_attn.qkv_proj", "attn_qkv"),
        ("mlp.gate_up_proj", "ffn_up"),
    ];
    let st = rmlx::io::load_safetensors(super::common::fixture_dir(fixture).join("model.safetensors")).unwrap();
    let mut tensors: Vec<(String, rmlx::Array)> = Vec::new();
    let mut experts: std::collections::BTreeMap<(String, &str), Vec<(usize, rmlx::Array)>> = Default::default();
    for (name, arr) in &st.arrays {
        if let Some((a, b)) = FIXED.iter().find(|(a, _)| name.starts_with(a)) {
            tensors.push((name.replacen(a, b, 1), arr.clone()));
        } else if let Some((head, rest)) = name.split_once(".experts.") {
            let (e, projection) = rest.split_once('.').unwrap();
            let kind = match projection {
                "gate_proj.weight" | "w1.weight" => "gate",
                "up_proj.weight" | "w3.weight" => "up",
                _ => "down",
            };
            let layer = head.trim_start_matches("model.layers.").split('.').next().unwrap().to_string();
            experts.entry((layer, kind)).or_default().push((e.parse().unwrap(), arr.clone()));
        } else {
            let arr = match (permute, name) {
                (Some((heads, _)), n) if n.ends_with("q_proj.weight") => permute_rows(arr, heads),
                (Some((_, kv_heads)), n) if n.ends_with("k_proj.weight") => permute_rows(arr, kv_heads),
                _ => arr.clone(),
            };
            let n = name.replacen("model.layers.", "blk.", 1);
            tensors.push((PARTS.iter().fold(n, |n, (a, b)| n.replacen(a, b, 1)), arr));
        }
    }
    for ((layer, kind), mut per) in experts {
        per.sort_by_key(|(e, _)| *e);
        let refs: Vec<&rmlx::Array> = per.iter().map(|(_, a)| a).collect();
        tensors.push((format!("blk.{layer}.ffn_{kind}_exps.weight"), rmlx::ops::stack(&refs, 0).unwrap()));
    }
    tensors
}

/// A GGUF string: its length (u64) then its bytes.
fn string(buf: &mut Vec<u8>, s: &str) {
    buf.extend((s.len() as u64).to_le_bytes());
    buf.extend(s.as_bytes());
}

/// A GGUF string value on its own.
fn text(s: &str) -> Vec<u8> {
    let mut b = Vec::new();
    string(&mut b, s);
    b
}

/// `tokenizer.ggml.tokens` (`a`, `b`, `ab`, then `t3` … up to `vocab`) and `tokenizer.ggml.merges`
/// (`a b`) as GGUF string arrays.
fn tokenizer(vocab: usize) -> (Vec<u8>, Vec<u8>) {
    let mut tokens = 8u32.to_le_bytes().to_vec();
    tokens.extend((vocab as u64).to_le_bytes());
    let token = |i: usize| ["a", "b", "ab"].get(i).map_or(format!("t{i}"), |t| t.to_string());
    (0..vocab).for_each(|i| string(&mut tokens, &token(i)));
    let mut merges = 8u32.to_le_bytes().to_vec();
    merges.extend(1u64.to_le_bytes());
    string(&mut merges, "a b");
    (tokens, merges)
}

/// A GGUF v3 file of metadata `kv` and float32 `tensors` (llama.cpp's names; dimensions stored
/// innermost first), data aligned to 32 bytes.
fn write_gguf(path: &Path, kv: &[Meta], tensors: &[(String, rmlx::Array)]) {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    for (k, ty, v) in kv {
        string(&mut out, k);
        out.extend(ty.to_le_bytes());
        out.extend(v);
    }
    let mut data = Vec::new();
    for (name, a) in tensors {
        string(&mut out, name);
        out.extend((a.shape().len() as u32).to_le_bytes());
        a.shape().iter().rev().for_each(|&d| out.extend((d as u64).to_le_bytes()));
        out.extend(0u32.to_le_bytes());
        out.extend((data.len() as u64).to_le_bytes());
        let a = a.astype(rmlx::Dtype::Float32).unwrap();
        data.extend(a.to_vec::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()));
        data.resize(data.len().div_ceil(32) * 32, 0);
    }
    out.resize(out.len().div_ceil(32) * 32, 0);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

pub fn set_meta(kv: &mut [Meta], key: &str, ty: u32, value: Vec<u8>) {
    let e = kv.iter_mut().find(|e| e.0 == key).unwrap();
    (e.1, e.2) = (ty, value);
}

/// llama.cpp's permutation of llama's query and key rows (`convert_hf_to_gguf`'s `permute`):
/// `w.reshape(heads, 2, rows / heads / 2, ...).swapaxes(1, 2).reshape(w.shape)`.
fn permute_rows(w: &rmlx::Array, heads: i32) -> rmlx::Array {
    let shape = w.shape().to_vec();
    let mut split = vec![heads, 2, shape[0] / heads / 2];
    split.extend_from_slice(&shape[1..]);
    w.reshape(&split).unwrap().swapaxes(1, 2).unwrap().reshape(&shape).unwrap()
}

/// The `mixtral` fixture as llama.cpp's converter writes Mixtral (float32): a `llama` file with
/// `llama.expert_count` / `expert_used_count`, each layer's experts stacked into
/// `ffn_{gate,up,down}_exps` (`w1`, `w3`, `w2`), the router as `ffn_gate_inp`, and the query and
/// key rows permuted as for any llama.
pub fn gguf_mixtral(path: &Path) {
    let kv = metadata(
        "llama",
        320,
        &[
            ("embedding_length", U32, u32v(64)),
            ("block_count", U32, u32v(2)),
            ("feed_forward_length", U32, u32v(48)),
            ("expert_count", U32, u32v(6)),
            ("expert_used_count", U32, u32v(3)),
            ("attention.head_count", U32, u32v(4)),
            ("attention.head_count_kv", U32, u32v(2)),
            ("attention.layer_norm_rms_epsilon", F32, f32v(1e-5)),
            ("rope.freq_base", F32, f32v(1e6)),
        ],
    );
    write_gguf(path, &kv, &llama_cpp_tensors("mixtral", Some((4, 2))));
}

/// The `phi3` fixture as llama.cpp's converter writes a `phi3` GGUF (float32): `attn_qkv` and
/// `ffn_up` fused as in the checkpoint, no row permutation, the rotated features as
/// `rope.dimension_count` (8 of 16), the window, the original context and LongRoPE's attention
/// factor as metadata (with `attn_factor`; older converters did not write it), and its per-pair
/// factors as the `rope_factors_long` / `rope_factors_short` tensors.
pub fn gguf_phi3(path: &Path, attn_factor: bool) {
    let mut kv = metadata(
        "phi3",
        288,
        &[
            ("embedding_length", U32, u32v(64)),
            ("block_count", U32, u32v(2)),
            ("feed_forward_length", U32, u32v(128)),
            ("context_length", U32, u32v(1024)),
            ("rope.scaling.original_context_length", U32, u32v(256)),
            ("rope.dimension_count", U32, u32v(8)),
            ("attention.head_count", U32, u32v(4)),
            ("attention.head_count_kv", U32, u32v(2)),
            ("attention.layer_norm_rms_epsilon", F32, f32v(1e-5)),
            ("attention.sliding_window", U32, u32v(8)),
            ("rope.freq_base", F32, f32v(10000.0)),
            // The converter's √(1 + ln(1024 / 256) / ln(256)).
            ("rope.scaling.attn_factor", F32, f32v(1.25f32.sqrt())),
        ],
    );
    if !attn_factor {
        kv.retain(|(k, _, _)| k != "phi3.rope.scaling.attn_factor");
    }
    let mut tensors = llama_cpp_tensors("phi3", None);
    let factors = rmlx::Array::from_slice(&[1.0f32, 1.5, 2.5, 4.0], &[4]).unwrap();
    tensors.push(("rope_factors_long.weight".into(), factors.clone()));
    tensors.push(("rope_factors_short.weight".into(), factors));
    write_gguf(path, &kv, &tensors);
}

/// The `gemma2` fixture as llama.cpp's converter writes a `gemma2` GGUF (float32): Gemma's norm
/// names (`post_attention_norm`, `ffn_norm` before the feed-forward, `post_ffw_norm`), every norm
/// weight stored as `1 + w`, both soft-caps and the window as metadata; no query scale (the
/// fixture's `query_pre_attn_scalar` of 24 has no place in the file: llama.cpp takes the key
/// length, 16).
pub fn gguf_gemma2(path: &Path) {
    let kv = metadata(
        "gemma2",
        256,
        &[
            ("embedding_length", U32, u32v(64)),
            ("block_count", U32, u32v(4)),
            ("feed_forward_length", U32, u32v(64)),
            ("context_length", U32, u32v(256)),
            ("attention.head_count", U32, u32v(4)),
            ("attention.head_count_kv", U32, u32v(2)),
            ("attention.key_length", U32, u32v(16)),
            ("attention.value_length", U32, u32v(16)),
            ("attention.layer_norm_rms_epsilon", F32, f32v(1e-6)),
            ("attention.sliding_window", U32, u32v(8)),
            ("attn_logit_softcapping", F32, f32v(5.0)),
            ("final_logit_softcapping", F32, f32v(10.0)),
            ("rope.freq_base", F32, f32v(10000.0)),
        ],
    );
    let renames = [
        ("ffn_norm", "post_attention_norm"),
        ("pre_feedforward_layernorm", "ffn_norm"),
        ("post_feedforward_layernorm", "post_ffw_norm"),
    ];
    let tensors: Vec<(String, rmlx::Array)> = llama_cpp_tensors("gemma2", None)
        .into_iter()
        .map(|(name, a)| {
            let name = renames.iter().fold(name, |n, (from, to)| n.replacen(from, to, 1));
            let a = if name.ends_with("norm.weight") { (a + 1.0).unwrap() } else { a };
            (name, a)
        })
        .collect();
    write_gguf(path, &kv, &tensors);
}

/// The `gpt_oss` fixture as llama.cpp's converter writes a `gpt-oss` GGUF from transformers'
/// float layout (float32): the fused `gate_up_proj` `[E, hidden, 2·width]` transposed and split
/// by alternate rows into `ffn_gate_exps` and `ffn_up_exps` `[E, width, hidden]` (its bias by
/// alternate columns), `down_proj` transposed into `ffn_down_exps`, the router as `ffn_gate_inp`,
/// the sinks as `attn_sinks.weight`, `post_attention_norm`; YaRN, experts and window as metadata.
pub fn gguf_gpt_oss(path: &Path) {
    let kv = metadata(
        "gpt-oss",
        320,
        &[
            ("embedding_length", U32, u32v(64)),
            ("block_count", U32, u32v(2)),
            ("feed_forward_length", U32, u32v(32)),
            ("expert_feed_forward_length", U32, u32v(32)),
            ("expert_count", U32, u32v(4)),
            ("expert_used_count", U32, u32v(2)),
            ("context_length", U32, u32v(256)),
            ("attention.head_count", U32, u32v(4)),
            ("attention.head_count_kv", U32, u32v(2)),
            ("attention.key_length", U32, u32v(16)),
            ("attention.value_length", U32, u32v(16)),
            ("attention.layer_norm_rms_epsilon", F32, f32v(1e-5)),
            ("attention.sliding_window", U32, u32v(8)),
            ("rope.freq_base", F32, f32v(150000.0)),
            ("rope.scaling.factor", F32, f32v(8.0)),
            ("rope.scaling.original_context_length", U32, u32v(32)),
        ],
    );
    let st = rmlx::io::load_safetensors(super::common::fixture_dir("gpt_oss").join("model.safetensors")).unwrap();
    let alternate = |a: &rmlx::Array, axis: i32, first: i32| {
        let n = a.shape()[a.ndim() - 1 - (axis == -2) as usize];
        rmlx::ops::contiguous(&a.slice_axis(axis, first, n, 2).unwrap()).unwrap()
    };
    let mut tensors = Vec::new();
    for (name, a) in &st.arrays {
        let renamed = [
            ("model.embed_tokens.", "token_embd."),
            ("model.norm.", "output_norm."),
            ("lm_head.", "output."),
            ("model.layers.", "blk."),
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("self_attn.sinks", "attn_sinks.weight"),
            ("mlp.router", "ffn_gate_inp"),
        ]
        .iter()
        .fold(name.clone(), |n, (from, to)| n.replacen(from, to, 1));
        let Some((head, fused)) = renamed.split_once(".mlp.experts.") else {
            tensors.push((renamed, a.clone()));
            continue;
        };
        match fused {
            "gate_up_proj" => {
                let t = a.swapaxes(-1, -2).unwrap();
                tensors.push((format!("{head}.ffn_gate_exps.weight"), alternate(&t, -2, 0)));
                tensors.push((format!("{head}.ffn_up_exps.weight"), alternate(&t, -2, 1)));
            }
            "gate_up_proj_bias" => {
                tensors.push((format!("{head}.ffn_gate_exps.bias"), alternate(a, -1, 0)));
                tensors.push((format!("{head}.ffn_up_exps.bias"), alternate(a, -1, 1)));
            }
            "down_proj" => tensors.push((format!("{head}.ffn_down_exps.weight"), a.swapaxes(-1, -2).unwrap())),
            "down_proj_bias" => tensors.push((format!("{head}.ffn_down_exps.bias"), a.clone())),
            other => panic!("unexpected expert tensor {other}"),
        }
    }
    write_gguf(path, &kv, &tensors);
}

/// The `qwen3_moe` fixture as llama.cpp's converter writes a `qwen3moe` GGUF (float32): the
/// experts of each routed layer stacked into `ffn_{gate,up,down}_exps` `[experts, out, in]`, the
/// router as `ffn_gate_inp`, the dense layer 1 as `ffn_{gate,up,down}`, 320 tokens.
pub fn gguf_qwen3_moe(path: &Path) {
    let kv = metadata(
        "qwen3moe",
        320,
        &[
            ("embedding_length", U32, u32v(64)),
            ("block_count", U32, u32v(3)),
            ("feed_forward_length", U32, u32v(96)),
            ("expert_feed_forward_length", U32, u32v(32)),
            ("expert_count", U32, u32v(8)),
            ("expert_used_count", U32, u32v(4)),
            ("attention.head_count", U32, u32v(4)),
            ("attention.head_count_kv", U32, u32v(2)),
            ("attention.key_length", U32, u32v(16)),
            ("attention.value_length", U32, u32v(16)),
            ("attention.layer_norm_rms_epsilon", F32, f32v(1e-6)),
            ("rope.freq_base", F32, f32v(1e6)),
        ],
    );
    write_gguf(path, &kv, &llama_cpp_tensors("qwen3_moe", None));
}
