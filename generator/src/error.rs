//! Library error type. Every message names the problem and, where there is one, the fix.
//! `main` maps [`Error::exit_code`]: 2 for verification failures and usage errors, 1 otherwise.

use std::path::{Path, PathBuf};

/// Errors raised by the `deepep-nix` library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid version {0:?}: expected dotted numbers such as 3.4.5 (pre-releases like 0.0.0a0 are not locked)")]
    BadVersion(String),

    #[error(
        "--min-version {0} is older than NVSHMEM 3.3.9, the minimum DeepEP requires \
         (DeepEP's README: NVSHMEM >= 3.3.9); pass --min-version 3.3.9 or newer"
    )]
    MinVersionTooOld(String),

    #[error("invalid {what} {value:?}: {reason}")]
    BadHash {
        what: &'static str,
        value: String,
        reason: String,
    },

    #[error("{source_name}: {msg}")]
    Upstream { source_name: String, msg: String },

    #[error("duplicate entry for {key}: found in {first} and in {second}; remove one of them (or fix the upstream data) and run again")]
    Duplicate {
        key: String,
        first: String,
        second: String,
    },

    #[error("GET {url}: {msg}")]
    Http { url: String, msg: String },

    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error(
        "{what} mismatch for {}: expected {expected}, got {actual}; {disposition}",
        file.display()
    )]
    Verify {
        file: PathBuf,
        what: &'static str,
        expected: String,
        actual: String,
        disposition: String,
    },

    #[error("{0}")]
    Usage(String),

    #[error("refusing archive entry {entry:?}: {reason}; nothing was installed")]
    UnsafeArchive { entry: String, reason: String },

    #[error("rendering {template}: {msg}")]
    Template { template: String, msg: String },
}

impl Error {
    /// Process exit code for this error: 2 for verification failures and usage errors
    /// (bad arguments, versions below DeepEP's floor), 1 for everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Verify { .. }
            | Error::Usage(_)
            | Error::MinVersionTooOld(_)
            | Error::BadVersion(_) => 2,
            _ => 1,
        }
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.as_ref().to_path_buf(),
            source,
        }
    }

    /// An error in upstream data (a manifest, the PyPI JSON, the lock), naming where it is.
    pub fn upstream(source_name: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Upstream {
            source_name: source_name.into(),
            msg: msg.into(),
        }
    }
}

/// An error and its causes as one line, each cause once: a cause whose text is already part
/// of the message (as [`Error::Io`] shows its `source`, and many libraries repeat their
/// inner error) is not appended again. `main` prints errors with this.
pub fn chain_message(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if msg.is_empty() {
            msg = text;
        } else if !msg.contains(&text) {
            msg = format!("{msg}: {text}");
        }
    }
    msg
}

/// Library result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
