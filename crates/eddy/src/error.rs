//! The one error type of the library. Every user-facing failure (bad model file, bad input, bad request)
//! becomes an [`Error`] whose `Display` is a single line naming the file (where there is one) and the
//! problem; the CLI prints it and exits with code 2.

use std::path::PathBuf;

/// Errors from loading models, tokenizing, templating and generating.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A model file (GGUF, safetensors, config.json, tokenizer file) is missing, truncated, corrupt or
    /// describes something eddy does not support.
    #[error("{}: {problem}", path.display())]
    Model {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong, in words (one line).
        problem: String,
    },
    /// Bad input from the user: a prompt longer than the context, an invalid sampling parameter, ….
    #[error("{0}")]
    Input(String),
    /// Tokenizer or chat template failure.
    #[error("{0}")]
    Text(String),
    /// Any other I/O failure.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl Error {
    /// Shorthand for [`Error::Model`].
    pub fn model(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Error::Model { path: path.into(), problem: problem.into() }
    }
}

/// Result alias used throughout the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;
