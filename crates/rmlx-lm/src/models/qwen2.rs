//! Qwen 2 / 2.5: the Llama model with biased query, key and value projections (the output
//! projection has none), grouped-query attention, SwiGLU, tied or separate output head.

use super::attention::AttentionSpec;
use super::llama;
use super::spec::{self, ArchitectureSpec, GgufSpec};
use crate::config::Architecture;
use crate::config::ModelConfig;
use crate::nn::Builder;
use crate::Result;

/// Llama's attention with q/k/v biases, whatever `attention_bias` says.
pub fn attention_spec(cfg: &ModelConfig) -> Result<AttentionSpec> {
    Ok(AttentionSpec { qkv_bias: true, ..llama::attention_spec(cfg)? })
}

/// Builds a Qwen 2 model from `model.*` / `lm_head.*` tensors.
pub fn load(cfg: &ModelConfig, b: &mut Builder) -> Result<llama::Model> {
    llama::Model::load_with(cfg, b, attention_spec)
}

/// Qwen 2 in [`super::spec::ARCHITECTURES`].
pub static SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "qwen2",
    architecture: Architecture::Qwen2,
    model_types: &["qwen2"],
    hf_classes: &[("Qwen2ForCausalLM", "qwen2")],
    signature_tensor: Some("model.layers.0.self_attn.q_proj.bias"),
    chat_family: "chatml",
    gguf: Some(GgufSpec {
        arch: "qwen2",
        model_type: "qwen2",
        ffn_norm: "post_attention_layernorm",
        modules: &[],
        fix_up: spec::no_fix_up,
        config: spec::no_config,
    }),
    build: |cfg, b| Ok(Box::new(load(cfg, b)?)),
    mlx_lm: super::spec::MLX_LM_AS_IS,
};
