//! Phi-3, Phi-3.5 and Phi-4-mini: the Llama model with its q/k/v projections fused into one
//! `qkv_proj` and its gate/up projections into one `gate_up_proj` (split by rows at load), a
//! rotary embedding over the first `partial_rotary_factor` of each head, LongRoPE for the long-context
//! checkpoints, and a sliding window on every layer where the config sets one (as transformers).

use super::attention::AttentionSpec;
use super::llama;
use super::spec::{self, ArchitectureSpec, GgufSpec, MetadataNumber};
use crate::config::{Architecture, ModelConfig};
use crate::nn::Builder;
use crate::Result;
use rmlx::Array;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// The fused projections of a layer and the ones each is split into, in row order.
const FUSED: [(&str, &[&str]); 2] = [
    ("self_attn.qkv_proj", &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
    ("mlp.gate_up_proj", &["mlp.gate_proj", "mlp.up_proj"]),
];

/// Splits layer `i`'s fused projections into the ones [`llama::Model`] declares.
fn split_fused(cfg: &ModelConfig, b: &mut Builder, i: usize) -> Result<()> {
    let (heads, kv, d, m) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim(), cfg.intermediate_size);
    let rows = [vec![heads * d, kv * d, kv * d], vec![m, m]];
    for ((fused, parts), rows) in FUSED.into_iter().zip(rows) {
        let parts: Vec<(String, i32)> =
            parts.iter().zip(rows).map(|(p, r)| (format!("model.layers.{i}.{p}"), r)).collect();
        b.split_rows(&format!("model.layers.{i}.{fused}"), &parts)?;
    }
    Ok(())
}

/// The inverse of the split, for writing a checkpoint (`rmlx fuse`): each layer's dense q/k/v and
/// gate/up weights (and biases) in `tensors` joined again by rows under the fused names, as
/// transformers and mlx-lm read Phi-3.
pub fn join_fused(tensors: &mut BTreeMap<String, Array>, layers: usize) -> Result<()> {
    for i in 0..layers {
        for (fused, parts) in FUSED {
            for suffix in ["weight", "bias"] {
                let names: Vec<String> = parts.iter().map(|p| format!("model.layers.{i}.{p}.{suffix}")).collect();
                if !names.iter().all(|n| tensors.contains_key(n)) {
                    continue;
                }
                let pieces: Vec<Array> = names.iter().map(|n| tensors.remove(n).expect("checked")).collect();
                let joined = rmlx::ops::concatenate(&pieces.iter().collect::<Vec<_>>(), 0)?;
                tensors.insert(format!("model.layers.{i}.{fused}.{suffix}"), joined);
            }
        }
    }
    Ok(())
}

/// LoRA `keys` (paths inside a block) with each fused projection replaced by its parts
/// (`self_attn.qkv_proj` → `self_attn.q_proj`, `self_attn.k_proj`, `self_attn.v_proj`).
pub fn split_fused_keys(keys: &[String]) -> Vec<String> {
    keys.iter()
        .flat_map(|k| match FUSED.iter().find(|(fused, _)| fused == k) {
            Some((_, parts)) => parts.iter().map(|p| p.to_string()).collect(),
            None => vec![k.clone()],
        })
        .collect()
}

/// mlx-lm's Phi-3 adapters sit on the fused projections (`…qkv_proj.lora_a` `[in, r]`,
/// `…qkv_proj.lora_b` `[r, q + k + v]`; `gate_up_proj` alike): each part takes the same `A` and
/// its own columns of `B`, exactly what the fused adapter adds to that part's rows. Magnitudes
/// (DoRA) on a fused projection are refused.
pub fn split_fused_adapters(cfg: &ModelConfig, arrays: &mut BTreeMap<String, Array>) -> Result<()> {
    let (heads, kv, d, m) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim(), cfg.intermediate_size);
    let widths = [vec![heads * d, kv * d, kv * d], vec![m, m]];
    for ((fused, parts), widths) in FUSED.iter().zip(&widths) {
        let names: Vec<String> = arrays.keys().filter(|n| n.contains(&format!(".{fused}."))).cloned().collect();
        for name in names {
            let (owner, field) = name.rsplit_once('.').expect("a dotted name");
            let layer = owner.strip_suffix(&format!(".{fused}")).unwrap_or(owner).to_string();
            let a = arrays.remove(&name).expect("listed");
            let pieces = match field {
                "lora_a" => vec![a; parts.len()],
                "lora_b" => {
                    let mut cuts: Vec<i32> =
                        widths.iter().scan(0, |at, w| Some(std::mem::replace(at, *at + w))).collect();
                    cuts.remove(0);
                    if a.shape().get(1) != Some(&widths.iter().sum()) {
                        let expected = vec![a.shape().first().copied().unwrap_or(0), widths.iter().sum()];
                        return Err(crate::Error::ShapeMismatch { name, expected, found: a.shape().to_vec() });
                    }
                    rmlx::ops::split_at(&a, &cuts, 1)?
                }
                _ => {
                    return Err(crate::Error::InvalidParameter(format!(
                        "`{name}`: only LoRA factors on Phi-3's fused `{fused}` can be split into its parts"
                    )))
                }
            };
            for (part, piece) in parts.iter().zip(pieces) {
                arrays.insert(format!("{layer}.{part}.{field}"), piece);
            }
        }
    }
    Ok(())
}

/// Builds a Phi-3 model from `model.*` / `lm_head.*` tensors (fused or already split).
pub fn load(cfg: &ModelConfig, b: &mut Builder) -> Result<llama::Model> {
    for i in 0..cfg.num_hidden_layers {
        split_fused(cfg, b, i)?;
    }
    llama::Model::load_with(cfg, b, |cfg| Ok(AttentionSpec { qkv_bias: false, ..llama::attention_spec(cfg)? }))
}

/// Phi-3 in [`super::spec::ARCHITECTURES`].
pub static SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "phi3",
    architecture: Architecture::Phi3,
    model_types: &["phi3"],
    hf_classes: &[("Phi3ForCausalLM", "phi3")],
    signature_tensor: Some("model.layers.0.self_attn.qkv_proj.weight"),
    chat_family: "phi3",
    gguf: Some(GgufSpec {
        arch: "phi3",
        model_type: "phi3",
        ffn_norm: "post_attention_layernorm",
        // llama.cpp keeps the projections fused, as transformers does.
        modules: &[("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")],
        fix_up: spec::no_fix_up,
        config: gguf_config,
    }),
    build: |cfg, b| Ok(Box::new(load(cfg, b)?)),
    mlx_lm: super::spec::MLX_LM_AS_IS,
};

/// What llama.cpp's `phi3.*` metadata says beyond the shared keys: the rotated features
/// (`rope.dimension_count`, as a fraction of the head), the window (`attention.sliding_window`,
/// 0 for none: Phi-4-mini), and for long-context checkpoints the original context and LongRoPE's
/// attention factor (`rope.scaling.*`; the per-pair factors are the `rope_factors_{long,short}`
/// tensors the loader adds).
fn gguf_config(num: MetadataNumber, c: &mut Map<String, Value>) {
    let head_dim = match (num("embedding_length"), num("attention.head_count")) {
        (Some(hidden), Some(heads)) if heads > 0.0 => hidden / heads,
        _ => 0.0,
    };
    if let (Some(rotated), true) = (num("rope.dimension_count"), head_dim > 0.0) {
        if rotated != head_dim {
            c.insert("partial_rotary_factor".into(), json!(rotated / head_dim));
        }
    }
    if let Some(w) = num("attention.sliding_window").filter(|w| *w > 0.0) {
        c.insert("sliding_window".into(), json!(w as i64));
    }
    if let Some(n) = num("rope.scaling.original_context_length") {
        c.insert("original_max_position_embeddings".into(), json!(n as i64));
    }
    if let Some(f) = num("rope.scaling.attn_factor") {
        c.insert("rope_scaling".into(), json!({"type": "longrope", "attention_factor": f}));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fused_keys_name_their_parts() {
        let keys =
            super::split_fused_keys(&["self_attn.qkv_proj".into(), "mlp.down_proj".into(), "mlp.gate_up_proj".into()]);
        assert_eq!(
            keys,
            [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "mlp.down_proj",
                "mlp.gate_proj",
                "mlp.up_proj"
            ]
        );
    }
}
