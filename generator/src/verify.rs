//! `verify`: check files (downloaded or local) against the lock's pinned size and sha256.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::hash::Sha256;
use crate::http::Http;
use crate::lock::{Lock, LockedArtifact};
use crate::model::{SourceKind, System};
use crate::version::Version;

/// A locked artifact with its coordinates.
#[derive(Debug, Clone)]
pub struct Pinned {
    pub version: String,
    pub system: System,
    pub cuda: String,
    pub source: SourceKind,
    pub artifact: LockedArtifact,
}

impl Pinned {
    pub fn describe(&self) -> String {
        format!(
            "{} {} cuda{} {}",
            self.version, self.system, self.cuda, self.source
        )
    }
}

/// Which artifact to pick from the lock.
#[derive(Debug, Clone, Default)]
pub struct Selector {
    pub version: Option<Version>,
    pub system: Option<System>,
    pub cuda: Option<u32>,
    /// `None`: NVIDIA's tarball when pinned, else the PyPI wheel.
    pub source: Option<SourceKind>,
}

impl Selector {
    pub fn is_empty(&self) -> bool {
        self.version.is_none()
            && self.system.is_none()
            && self.cuda.is_none()
            && self.source.is_none()
    }
}

/// All artifacts whose file name is `name`.
pub fn by_filename(lock: &Lock, name: &str) -> Vec<Pinned> {
    lock.artifacts()
        .filter(|(_, _, _, _, a)| a.filename == name)
        .map(|(r, system, cuda, source, a)| Pinned {
            version: r.version.clone(),
            system,
            cuda: cuda.to_string(),
            source,
            artifact: a.clone(),
        })
        .collect()
}

/// Picks exactly one artifact. `--version` and `--cuda` are required; the system defaults
/// to the host's. Errors name what is missing and what exists instead.
pub fn select(lock: &Lock, sel: &Selector) -> Result<Pinned> {
    let version = sel
        .version
        .as_ref()
        .ok_or_else(|| Error::Usage("--version is required (see `deepep-nix releases`)".into()))?;
    let cuda = sel
        .cuda
        .ok_or_else(|| Error::Usage("--cuda 12|13 is required".into()))?;
    let system = match sel.system {
        Some(s) => s,
        None => System::host().ok_or_else(|| {
            Error::Usage(
                "this CPU has no NVSHMEM builds; pass --system x86_64-linux|aarch64-linux".into(),
            )
        })?,
    };
    let release = lock.release(version).ok_or_else(|| {
        let known: Vec<&str> = lock.releases.iter().map(|r| r.version.as_str()).collect();
        Error::Usage(format!(
            "NVSHMEM {version} is not in the lock; locked versions: {}",
            known.join(", ")
        ))
    })?;
    let builds = release.systems.get(&system).and_then(|s| s.get(&cuda.to_string())).ok_or_else(|| {
        Error::Usage(format!(
            "NVSHMEM {version} has no CUDA {cuda} build for {system}; `deepep-nix releases` lists what exists"
        ))
    })?;
    let source = match sel.source {
        Some(s) => s,
        None => builds
            .sources()
            .first()
            .copied()
            .expect("a locked cell has at least one source"),
    };
    let artifact = builds.get(source).ok_or_else(|| {
        let other: Vec<&str> = builds.sources().iter().map(|s| s.as_str()).collect();
        Error::Usage(format!(
            "NVSHMEM {version} {system} CUDA {cuda} has no {source} artifact in the lock; available: --source {}",
            other.join(" | ")
        ))
    })?;
    Ok(Pinned {
        version: release.version.clone(),
        system,
        cuda: cuda.to_string(),
        source,
        artifact: artifact.clone(),
    })
}

/// What to do with a file that fails verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMismatch {
    /// Downloaded by us: remove it.
    Delete,
    /// The user's own file (`--file`): leave it, say so.
    Keep,
}

/// Checks a file's size (when pinned) and sha256 against the lock. On mismatch the error
/// names expected and actual values; with [`OnMismatch::Delete`] the file is removed first.
pub fn check_file(path: &Path, pinned: &LockedArtifact, on_mismatch: OnMismatch) -> Result<Sha256> {
    let fail = |what: &'static str, expected: String, actual: String| {
        let disposition = match on_mismatch {
            OnMismatch::Delete => match std::fs::remove_file(path) {
                Ok(()) => "the file was deleted".to_string(),
                Err(e) => format!("deleting the file failed ({e}); delete it by hand"),
            },
            OnMismatch::Keep => "the file was left in place; do not use it".to_string(),
        };
        Error::Verify {
            file: path.to_path_buf(),
            what,
            expected,
            actual,
            disposition,
        }
    };
    let actual_size = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .len();
    if let Some(expected) = pinned.size {
        if expected != actual_size {
            return Err(fail(
                "size",
                format!("{expected} bytes"),
                format!("{actual_size} bytes"),
            ));
        }
    }
    let expected = pinned.digest()?;
    let (actual, _) = Sha256::of_file(path)?;
    if actual != expected {
        return Err(fail(
            "sha256",
            format!("{} ({})", expected.to_hex(), expected.to_sri()),
            format!("{} ({})", actual.to_hex(), actual.to_sri()),
        ));
    }
    Ok(actual)
}

/// Downloads a pinned artifact into `dest_dir/<filename>` and verifies it. A complete file
/// already there is verified and reused; a partial `<filename>.part` is resumed. Nothing
/// unverified is left under the final name; a file that fails verification is deleted.
pub fn fetch_verified(http: &Http, pinned: &Pinned, dest_dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dest_dir).map_err(|e| Error::io(dest_dir, e))?;
    let a = &pinned.artifact;
    if a.filename.contains('/') || a.filename.starts_with('.') || a.filename.is_empty() {
        return Err(Error::upstream(
            "lock",
            format!(
                "artifact file name {:?} is not a plain file name",
                a.filename
            ),
        ));
    }
    let dest = dest_dir.join(&a.filename);
    if dest.is_file() {
        match check_file(&dest, a, OnMismatch::Delete) {
            Ok(_) => {
                tracing::info!("{} already present and verified", dest.display());
                return Ok(dest);
            }
            Err(e) => tracing::warn!("{e}; downloading again"),
        }
    }
    let part = dest_dir.join(format!("{}.part", a.filename));
    http.download(&a.url, &part, a.size)?;
    check_file(&part, a, OnMismatch::Delete)?;
    std::fs::rename(&part, &dest).map_err(|e| Error::io(&dest, e))?;
    Ok(dest)
}
