//! The error type of `rmlx-lm`: every way loading, tokenising or generating can fail, each naming
//! what was wrong (the field, the tensor, the file) so that a user can act on it.

/// Everything that can go wrong in `rmlx-lm`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An MLX operation failed (shape errors, truncated data found while evaluating, ...).
    #[error(transparent)]
    Mlx(#[from] rmlx::Error),
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
    /// A configuration (config.json, GGUF metadata, generation_config.json) is missing a field or
    /// holds an invalid value.
    #[error("invalid config: {0}")]
    Config(String),
    /// `model_type` (or GGUF `general.architecture`) names an architecture rmlx does not implement.
    #[error("unsupported architecture `{model_type}`; supported: {supported}")]
    UnsupportedArchitecture { model_type: String, supported: String },
    /// A weight the model needs is not in the checkpoint.
    #[error("missing tensor `{0}` in the checkpoint")]
    MissingTensor(String),
    /// A shard named by the index file (or a file the loader needs) does not exist.
    #[error("missing file: {0}")]
    MissingFile(String),
    /// A tensor's shape differs from the one the config implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch { name: String, expected: Vec<i32>, found: Vec<i32> },
    /// A weight file is shorter than its header says, or its header cannot be parsed.
    #[error("corrupt or truncated file {path}: {reason}")]
    Corrupt { path: String, reason: String },
    /// The tokenizer could not be built, or it does not fit the model.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A chat template failed to parse or render (including the template's own `raise_exception`).
    #[error("chat template: {0}")]
    Template(String),
    /// The prompt is unusable: empty, or longer than the context limit.
    #[error("prompt: {0}")]
    Prompt(String),
    /// A prompt-cache file that does not belong to the model it is used with (another model,
    /// dtype, adapter or shape), or holds caches rmlx does not read.
    #[error("prompt cache {path}: {reason}")]
    PromptCache { path: String, reason: String },

    /// A generation or sampling parameter is out of range.
    #[error("invalid parameter: {0}")]
    InvalidParameter(String),
    /// The model produced NaN or infinite logits (or loss): overflowing weights or activations.
    /// Raised on the generation step (or perplexity chunk) where they appear.
    #[error("non-finite values: {0}")]
    NonFinite(String),
    /// A line of a training data file is unusable (not JSON, missing or mistyped fields, a format
    /// that differs from the file's first line).
    #[error("{file}:{line}: {reason}")]
    Data { file: String, line: usize, reason: String },
    /// A backend failed outside the model's own errors: the mlx-lm subprocess could not start,
    /// exited, stopped answering, or reported an error of its own.
    #[error("{backend} backend: {message}")]
    Backend { backend: String, message: String },
    /// A model cannot be split over the ranks of a tensor-parallel job as asked (head or feature
    /// counts the ranks do not divide, quantisation groups a split would cut, fully fine-tuned
    /// weights over split layers).
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),
    /// A model cannot be split by blocks over the ranks of a job as asked (more ranks than blocks,
    /// or split by tensors too).
    #[error("pipeline parallelism: {0}")]
    Pipeline(String),
    /// The ranks of a split model could not stay in step: one could not read rank 0's decisions,
    /// or not every rank could load an adapter.
    #[error("over the ranks of a split model: {0}")]
    Ranks(String),
    /// Downloading a registry package (the default model, tokenizer files) failed.
    #[error("download {url}: {reason}")]
    Download { url: String, reason: String },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        Error::Io { path: path.as_ref().display().to_string(), error: source }
    }
}
