//! One inference interface over several backends.
//!
//! A [`Backend`] loads a checkpoint into a [`LanguageModel`]: a handle that generates and chats
//! (streams of tokens, cancellable), classifies a batch of prompts in one prefill, completes many
//! prompts together, and reports its [`ModelInfo`] and last [`Metrics`]. Two backends are built in:
//!
//! * `native` ([`native::NativeBackend`]): rmlx's own model files on MLX (Llama, Mistral, Qwen 2/3,
//!   Gemma 3; Hugging Face folders and GGUF files);
//! * `mlx-lm` ([`mlx_lm::MlxLmBackend`]): Python's mlx-lm in a subprocess, driven over JSON lines,
//!   for the architectures the native backend does not have yet.
//!
//! [`load_with`] picks the backend: the one a [`BackendChoice`] names, or (`auto`, [`load`]) the first that
//! supports the checkpoint, native first, then those added with [`register`], then mlx-lm.
//!
//! ```
//! # fn main() -> rmlx_lm::Result<()> {
//! use rmlx_lm::backend::{self, Prompt};
//! use rmlx_lm::{GenerateOptions, LoadOptions};
//! let mut lm = backend::load(rmlx_lm::registry::default_model()?, &LoadOptions::default())?;
//! assert_eq!(lm.info().backend, "native");
//! let opts = GenerateOptions { max_tokens: 4, ..GenerateOptions::default() };
//! let text: String = lm
//!     .generate(&Prompt::from("The capital of France is"), &opts)?
//!     .map(|t| t.map(|t| t.text))
//!     .collect::<rmlx_lm::Result<_>>()?;
//! assert!(!text.is_empty());
//! // The next token after each prompt, from one batched forward pass.
//! let next = lm.classify(&["One, two,".into(), "Hello".into()], &Default::default())?;
//! assert_eq!(next.len(), 2);
//! # Ok(()) }
//! ```

pub mod mlx_lm;
pub mod native;

use crate::chat::Message;
use crate::generate::{CancelHandle, FinishReason, GenerateOptions, Metrics, Token};
use crate::loader::{LoadOptions, LoadedModel};
use crate::{Error, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};

/// A prompt: text (encoded as the tokenizer does by default, special tokens included), token ids,
/// or a conversation (the model's chat template, with the generation prompt).
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<Message>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Prompt::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Prompt::Text(s)
    }
}

impl From<Vec<Message>> for Prompt {
    fn from(messages: Vec<Message>) -> Self {
        Prompt::Chat(messages)
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Self {
        Prompt::Tokens(ids)
    }
}

/// A generation in progress: the tokens as they come. Dropping it stops the generation.
pub trait TokenStream: Iterator<Item = Result<Token>> {
    /// A handle that stops the generation before its next token (from any thread).
    fn cancel_handle(&self) -> CancelHandle;
    /// Counters so far (complete once the stream is exhausted).
    fn metrics(&self) -> Metrics;
    /// Why the generation ended, once it has.
    fn finish_reason(&self) -> Option<FinishReason>;
}

/// What [`LanguageModel::classify`] reports for each prompt: the next token's distribution at the
/// prompt's last position.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Classification {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// The most likely next token (greedy) with its text and log-probability.
    pub token_id: u32,
    pub token: String,
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens, most likely first.
    pub top: Vec<Candidate>,
    /// All the last position's logits (float32), when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logits: Option<Vec<f32>>,
}

/// One of the most likely next tokens.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
}

/// How to classify.
#[derive(Clone, Debug)]
pub struct ClassifyOptions {
    /// Most likely tokens reported per prompt.
    pub top_logprobs: usize,
    /// Return every logit of the last position too.
    pub logits: bool,
    /// Most padded prompt tokens per forward pass (prompts are grouped by length within it; a
    /// longer prompt goes alone).
    pub max_batch_tokens: usize,
}

impl Default for ClassifyOptions {
    fn default() -> Self {
        ClassifyOptions { top_logprobs: 5, logits: false, max_batch_tokens: 8192 }
    }
}

/// One prompt's result of [`LanguageModel::batch_generate`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Completion {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub prompt_tokens: usize,
    #[serde(serialize_with = "finish_name")]
    pub finish_reason: FinishReason,
}

fn finish_name<S: serde::Serializer>(r: &FinishReason, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(r.as_str())
}

/// What a loaded model is.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelInfo {
    /// The backend that runs it (`native`, `mlx-lm`, or a registered one's name).
    pub backend: String,
    /// The checkpoint's `model_type` (GGUF: the `model_type` it maps to).
    pub architecture: String,
    pub vocab_size: usize,
    pub layers: usize,
    pub hidden_size: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// `affine 4-bit, group 64`, `gguf`, ... (`None`: dense weights).
    pub quantization: Option<String>,
    /// Compute dtype.
    pub dtype: String,
    /// Where it runs (`gpu`, `cpu`).
    pub device: String,
    pub source: PathBuf,
}

/// A loaded model, whatever runs it. It may move between threads, but is used from one at a time.
pub trait LanguageModel: Send {
    /// What the model is.
    fn info(&self) -> ModelInfo;

    /// Generates after `prompt` (the chat template only for [`Prompt::Chat`]).
    fn generate<'a>(&'a mut self, prompt: &Prompt, opts: &GenerateOptions) -> Result<Box<dyn TokenStream + 'a>>;

    /// Generates the assistant's reply to `messages` (the model's chat template).
    fn chat<'a>(&'a mut self, messages: &[Message], opts: &GenerateOptions) -> Result<Box<dyn TokenStream + 'a>>;

    /// The next token after each prompt (one result per prompt, in order), from batched forward
    /// passes.
    fn classify(&mut self, prompts: &[Prompt], opts: &ClassifyOptions) -> Result<Vec<Classification>>;

    /// Completes every prompt, decoding them together; a prompt that fails (too long, its logits
    /// overflow) gets its own error and the others go on.
    fn batch_generate(&mut self, prompts: &[Prompt], opts: &GenerateOptions) -> Result<Vec<Result<Completion>>>;

    /// The counters of the last finished generation, classification or batch.
    fn metrics(&self) -> Option<Metrics>;

    /// The native model underneath, for what only it offers (adapters, attention inspection).
    fn as_native(&self) -> Option<&LoadedModel> {
        None
    }

    /// Frees the model (the mlx-lm backend ends its subprocess); dropping does the same, silently.
    fn close(self: Box<Self>) -> Result<()>;
}

/// Something that loads checkpoints into [`LanguageModel`]s.
pub trait Backend: Send + Sync {
    /// Its name, as [`BackendChoice::Named`] and the CLI's `--backend` give it.
    fn name(&self) -> &str;

    /// Whether it can load `path`, cheaply (no weights read): `Err` says why not.
    fn supports(&self, path: &Path) -> std::result::Result<(), String>;

    /// Loads `path`.
    fn load(&self, path: &Path, opts: &LoadOptions) -> Result<Box<dyn LanguageModel>>;
}

/// Which backend [`load`] uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// The first that supports the checkpoint: native, registered ones, mlx-lm.
    #[default]
    Auto,
    /// The backend of this name.
    Named(String),
}

impl std::str::FromStr for BackendChoice {
    type Err = Error;

    /// `auto` or a backend's name (`native`, `mlx-lm`, a registered one; checked at load).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "" => Err(Error::InvalidParameter("empty backend name".into())),
            "auto" => Ok(BackendChoice::Auto),
            name => Ok(BackendChoice::Named(name.to_string())),
        }
    }
}

fn registry() -> &'static RwLock<Vec<Arc<dyn Backend>>> {
    static REGISTRY: OnceLock<RwLock<Vec<Arc<dyn Backend>>>> = OnceLock::new();
    REGISTRY
        .get_or_init(|| RwLock::new(vec![Arc::new(native::NativeBackend), Arc::new(mlx_lm::MlxLmBackend::default())]))
}

/// Adds a backend, tried by `auto` after the native one and before mlx-lm; one with the name of a
/// registered backend replaces it.
pub fn register(backend: Arc<dyn Backend>) {
    let mut list = registry().write().unwrap_or_else(|e| e.into_inner());
    if let Some(slot) = list.iter_mut().find(|b| b.name() == backend.name()) {
        *slot = backend;
        return;
    }
    let at = list.iter().position(|b| b.name() == mlx_lm::NAME).unwrap_or(list.len());
    list.insert(at, backend);
}

/// The backends, in the order `auto` tries them.
pub fn backends() -> Vec<Arc<dyn Backend>> {
    registry().read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Loads a model folder or GGUF file with the first backend that supports it
/// ([`BackendChoice::Auto`]; [`load_with`] chooses).
pub fn load(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<Box<dyn LanguageModel>> {
    load_with(path, &BackendChoice::Auto, opts)
}

/// Loads a model folder or GGUF file with the backend `choice` names, or with `auto` the first
/// that supports it: a checkpoint no backend supports gets the native backend's error (for an
/// unknown architecture, [`Error::UnsupportedArchitecture`]); why the others declined is logged.
pub fn load_with(path: impl AsRef<Path>, choice: &BackendChoice, opts: &LoadOptions) -> Result<Box<dyn LanguageModel>> {
    let path = path.as_ref();
    let list = backends();
    match choice {
        BackendChoice::Named(name) => {
            let backend = list.iter().find(|b| b.name() == name).ok_or_else(|| {
                let known: Vec<&str> = list.iter().map(|b| b.name()).collect();
                Error::InvalidParameter(format!("unknown backend `{name}` (known: auto, {})", known.join(", ")))
            })?;
            backend.load(path, opts)
        }
        BackendChoice::Auto => {
            let mut declined = Vec::new();
            for backend in &list {
                match backend.supports(path) {
                    Ok(()) => return backend.load(path, opts),
                    Err(why) => declined.push(format!("{}: {why}", backend.name())),
                }
            }
            tracing::warn!("no backend supports {}: {}", path.display(), declined.join("; "));
            native::NativeBackend.load(path, opts)
        }
    }
}
