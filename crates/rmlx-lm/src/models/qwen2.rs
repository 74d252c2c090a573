//! Qwen 2 / 2.5: the Llama model with biased query, key and value projections (the output
//! projection has none), grouped-query attention, SwiGLU, tied or separate output head.

use super::attention::AttentionSpec;
use super::llama;
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
