//! The core's error type. The binding layer maps each kind to one Python exception class
//! (`py/convert.rs`), in one place.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// A value out of range, or buffers that do not fit together (Python `ValueError`).
    Value(String),
    /// A value of the wrong type or dtype (Python `TypeError`).
    Type(String),
    /// An operation that cannot run in the present state (Python `RuntimeError`).
    Runtime(String),
    /// A failed system call, with its errno (Python `OSError`).
    Io(i32, String),
}

impl Error {
    pub fn message(&self) -> &str {
        match self {
            Error::Value(m) | Error::Type(m) | Error::Runtime(m) | Error::Io(_, m) => m,
        }
    }

    /// The same kind of error, its message prefixed with `what: `.
    pub fn context(self, what: &str) -> Error {
        match self {
            Error::Value(m) => Error::Value(format!("{what}: {m}")),
            Error::Type(m) => Error::Type(format!("{what}: {m}")),
            Error::Runtime(m) => Error::Runtime(format!("{what}: {m}")),
            Error::Io(e, m) => Error::Io(e, format!("{what}: {m}")),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
