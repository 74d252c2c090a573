//! The error type of the safe API.

use crate::Dtype;

/// Everything that can go wrong in `rmlx`.
///
/// MLX's own failures (bad shapes, unsupported dtypes, I/O errors found while evaluating a graph)
/// arrive as [`Error::Mlx`] with MLX's message unchanged; checks made on the Rust side have their own
/// variants.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// MLX threw an exception; the message is MLX's.
    #[error("MLX: {0}")]
    Mlx(String),
    /// An array had a different dtype from the one asked for.
    #[error("dtype mismatch: expected {expected}, found {found}")]
    DtypeMismatch { expected: Dtype, found: Dtype },
    /// Data length and shape disagree, or an argument is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A closure given to a transform (or a custom primitive's method) panicked; the message is the
    /// panic's. The panic never crosses into MLX.
    #[error("panic in a callback: {0}")]
    Callback(String),
    /// A function given to [`compile`](crate::compile::compile) used an array it did not receive as
    /// an input; compiling would have frozen that array's current value into the compiled graph.
    #[error("compiled function `{0}` uses an array it did not receive as an input (pass it as an input)")]
    CapturedArray(String),
    /// In eager mode ([`ExecutionMode::Eager`](crate::ExecutionMode)), evaluating the result of the
    /// named primitive failed.
    #[error("eager evaluation failed at {op}: {message}")]
    Eager { op: String, message: String },
    /// A custom primitive's CPU evaluation returned an error (it runs on MLX's worker thread; the
    /// error is reported by the evaluation that ran it).
    #[error("primitive evaluation failed: {0}")]
    PrimitiveEval(String),
    /// The operation is not available here: a transform a custom primitive does not implement, a
    /// kernel for a GPU backend this MLX lacks.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl From<rmlx_sys::cxx::Exception> for Error {
    fn from(e: rmlx_sys::cxx::Exception) -> Self {
        Error::Mlx(e.what().to_string())
    }
}

impl Error {
    /// MLX's message, when this error came from MLX.
    pub fn mlx_message(&self) -> Option<&str> {
        match self {
            Error::Mlx(m) => Some(m),
            _ => None,
        }
    }
}
