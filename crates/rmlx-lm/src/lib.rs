//! Large language models on MLX.
//!
//! `rmlx-lm` loads Hugging Face checkpoints (safetensors, MLX-quantised) and GGUF files, builds the
//! tokenizer and chat template that come with them, and generates text with KV caches and a sampling
//! chain. Architectures: Llama 3 (and Mistral-style llama checkpoints), Qwen 2, Qwen 3, Gemma 3.

pub mod error;
pub mod gguf;
pub mod registry;
pub mod sample;
pub mod tokenizer;
pub mod chat;
pub mod weights;
pub mod cache;
pub mod config;
pub mod models;
pub mod nn;
pub mod progress;
pub mod loader;
pub mod gguf_model;
pub mod generate;

pub use generate::{CancelHandle, FinishReason, GenerateOptions, Generation, Metrics, Token};
pub use loader::{load, LoadOptions, LoadedModel};

pub use error::{Error, Result};
