//! Qwen 3 (dense): the Llama model with RMSNorm applied to every query and key head before the
//! rotary embedding, no projection biases (unless `attention_bias`), an explicit `head_dim`.

use super::attention::AttentionSpec;
use super::llama;
use super::spec::{self, ArchitectureSpec, GgufSpec};
use crate::config::Architecture;
use crate::config::ModelConfig;
use crate::nn::Builder;
use crate::Result;

/// Llama's attention with `q_norm` / `k_norm` over each head.
pub fn attention_spec(cfg: &ModelConfig) -> Result<AttentionSpec> {
    Ok(AttentionSpec { qk_norm: Some(false), ..llama::attention_spec(cfg)? })
}

/// Builds a Qwen 3 model from `model.*` / `lm_head.*` tensors.
pub fn load(cfg: &ModelConfig, b: &mut Builder) -> Result<llama::Model> {
    llama::Model::load_with(cfg, b, attention_spec)
}

/// Qwen 3 in [`super::spec::ARCHITECTURES`].
pub static SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "qwen3",
    architecture: Architecture::Qwen3,
    model_types: &["qwen3"],
    hf_classes: &[("Qwen3ForCausalLM", "qwen3")],
    signature_tensor: Some("model.layers.0.self_attn.q_norm.weight"),
    chat_family: "chatml",
    gguf: Some(GgufSpec {
        arch: "qwen3",
        model_type: "qwen3",
        ffn_norm: "post_attention_layernorm",
        modules: &[],
        fix_up: spec::no_fix_up,
        config: spec::no_config,
    }),
    build: |cfg, b| Ok(Box::new(load(cfg, b)?)),
    mlx_lm: super::spec::MLX_LM_AS_IS,
};
