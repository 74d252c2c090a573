//! Gemma 2: Gemma 3's blocks (four `(1 + w)` RMSNorms, a GELU-tanh gated feed-forward, embeddings
//! scaled by `√hidden`) without q/k norms, one RoPE base for every layer, attention scores and final
//! logits soft-capped (`cap · tanh(x / cap)`), and sliding and global layers alternating from a
//! sliding first layer (as transformers' `Gemma2Config`, unless `layer_types` says otherwise).

use super::attention::AttentionSpec;
use super::gemma3;
use super::spec::ArchitectureSpec;
use super::Rope;
use crate::config::{Architecture, ModelConfig};
use crate::nn::Builder;
use crate::Result;

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
    gguf: None,
    build: |cfg, b| Ok(Box::new(load(cfg, b)?)),
};
