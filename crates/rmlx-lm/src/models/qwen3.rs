//! Qwen 3 (dense): the Llama model with RMSNorm applied to every query and key head before the
//! rotary embedding, no projection biases (unless `attention_bias`), an explicit `head_dim`.

use super::attention::AttentionSpec;
use super::llama;
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
