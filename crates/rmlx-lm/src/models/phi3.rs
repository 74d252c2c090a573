//! Phi-3, Phi-3.5 and Phi-4-mini: the Llama model with its q/k/v projections fused into one
//! `qkv_proj` and its gate/up projections into one `gate_up_proj` (split by rows at load), a
//! rotary embedding over the first `partial_rotary_factor` of each head, LongRoPE for the long-context
//! checkpoints, and a sliding window on every layer where the config sets one (as transformers).

use super::attention::AttentionSpec;
use super::llama;
use super::spec::ArchitectureSpec;
use crate::config::{Architecture, ModelConfig};
use crate::nn::Builder;
use crate::Result;

/// Splits layer `i`'s fused projections into the ones [`llama::Model`] declares.
fn split_fused(cfg: &ModelConfig, b: &mut Builder, i: usize) -> Result<()> {
    let (heads, kv, d) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
    let p = format!("model.layers.{i}");
    let attention = [("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)];
    b.split_rows(&format!("{p}.self_attn.qkv_proj"), &attention.map(|(n, r)| (format!("{p}.self_attn.{n}"), r)))?;
    let mlp = [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)];
    b.split_rows(&format!("{p}.mlp.gate_up_proj"), &mlp.map(|(n, r)| (format!("{p}.mlp.{n}"), r)))
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
    gguf: None,
    build: |cfg, b| Ok(Box::new(load(cfg, b)?)),
};
