//! Gemma 2: Gemma 3's blocks (four `(1 + w)` RMSNorms, a GELU-tanh gated feed-forward, embeddings
//! scaled by `√hidden`) without q/k norms, one RoPE base for every layer, attention scores and final
//! logits soft-capped (`cap · tanh(x / cap)`), and sliding and global layers alternating from a
//! sliding first layer (as transformers' `Gemma2Config`, unless `layer_types` says otherwise).

use super::attention::AttentionSpec;
use super::gemma3;
use super::spec::{ArchitectureSpec, GgufSpec, MetadataNumber};
use super::Rope;
use crate::config::{Architecture, ModelConfig};
use crate::nn::Builder;
use crate::Result;
use serde_json::{json, Map, Value};

/// Gemma 2's attention: `query_pre_attn_scalar^-½` scale, `rope_theta` everywhere, capped scores.
fn attention_spec(cfg: &ModelConfig, _layer: usize) -> Result<AttentionSpec> {
    Ok(AttentionSpec {
        qkv_bias: cfg.attention_bias.unwrap_or(false),
        qk_norm: None,
        scale: cfg.query_pre_attn_scalar.unwrap_or(cfg.head_dim() as f32).powf(-0.5),
        rope: Rope::global(cfg)?,
        logit_softcap: cfg.attn_logit_softcapping.filter(|&cap| cap > 0.0),
        sinks: false,
        o_bias: false,
    })
}

/// Builds a Gemma 2 model from `model.*` tensors.
pub fn load(cfg: &ModelConfig, b: &mut Builder) -> Result<gemma3::Model> {
    gemma3::Model::load_with(cfg, b, attention_spec)
}

/// Gemma 2 in [`super::spec::ARCHITECTURES`].
pub static SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "gemma2",
    architecture: Architecture::Gemma2,
    model_types: &["gemma2"],
    hf_classes: &[("Gemma2ForCausalLM", "gemma2")],
    signature_tensor: None,
    chat_family: "gemma",
    gguf: Some(GgufSpec {
        arch: "gemma2",
        model_type: "gemma2",
        ffn_norm: "pre_feedforward_layernorm",
        modules: &[],
        fix_up: gemma3::gguf_fix_up,
        config: gguf_config,
    }),
    build: |cfg, b| Ok(Box::new(load(cfg, b)?)),
    mlx_lm: super::spec::MLX_LM_AS_IS,
};

/// llama.cpp's `gemma2.*` metadata: the window (every other layer from the first, as llama.cpp
/// and transformers alternate them), both soft-caps, and no query scale: llama.cpp takes
/// `hidden / heads` for the 27B model (46 layers) and the key length for the others, as their
/// checkpoints' `query_pre_attn_scalar` says, so the same rule stands in for it here.
fn gguf_config(num: MetadataNumber, c: &mut Map<String, Value>) {
    if let Some(w) = num("attention.sliding_window") {
        c.insert("sliding_window".into(), json!(w as i64));
    }
    for (key, field) in
        [("attn_logit_softcapping", "attn_logit_softcapping"), ("final_logit_softcapping", "final_logit_softcapping")]
    {
        if let Some(cap) = num(key) {
            c.insert(field.into(), json!(cap));
        }
    }
    let scalar = match (num("block_count"), num("embedding_length"), num("attention.head_count")) {
        (Some(46.0), Some(hidden), Some(heads)) if heads > 0.0 => Some(hidden / heads),
        _ => num("attention.key_length"),
    };
    if let Some(s) = scalar {
        c.insert("query_pre_attn_scalar".into(), json!(s));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Map};

    /// The query scale from llama.cpp's rule: the key length, but `hidden / heads` at 46 layers.
    #[test]
    fn gguf_query_scale_follows_llama_cpp() {
        let scale = |layers: f64, hidden: f64, heads: f64, key: f64| {
            let num = |k: &str| match k {
                "block_count" => Some(layers),
                "embedding_length" => Some(hidden),
                "attention.head_count" => Some(heads),
                "attention.key_length" => Some(key),
                _ => None,
            };
            let mut c = Map::new();
            super::gguf_config(&num, &mut c);
            c["query_pre_attn_scalar"].clone()
        };
        assert_eq!(scale(46.0, 4608.0, 32.0, 128.0), json!(144.0));
        assert_eq!(scale(42.0, 3584.0, 16.0, 256.0), json!(256.0));
        assert_eq!(scale(26.0, 2304.0, 8.0, 256.0), json!(256.0));
    }
}
