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
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
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
