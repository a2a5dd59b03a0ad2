//! Where the NVSHMEM data lives: a repository checkout (`<repo>/pkgs/nvshmem/...`) or the
//! snapshot embedded in the binary at build time.
//!
//! Rule: `--repo DIR` (or `DEEPEP_NIX_REPO`) names the checkout; without it, the nearest
//! directory at or above the current one that contains `pkgs/nvshmem` is used; without
//! such a directory, commands that only read (`releases`, `render --output -`, `verify`,
//! `install`) use the embedded snapshot, and commands that write need `--repo`. Inside a
//! checkout, data missing on disk (e.g. a fresh `--repo` directory) falls back to the
//! embedded snapshot.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::lock::{Inputs, Lock};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded.rs"));
}

/// Relative location of the NVSHMEM data inside a checkout.
pub const DATA_DIR: &str = "pkgs/nvshmem";

/// Paths of the generated and vendored files in a checkout.
#[derive(Debug, Clone)]
pub struct RepoPaths {
    pub root: PathBuf,
}

impl RepoPaths {
    pub fn new(root: impl Into<PathBuf>) -> RepoPaths {
        RepoPaths { root: root.into() }
    }
    pub fn data(&self) -> PathBuf {
        self.root.join(DATA_DIR)
    }
    pub fn manifests(&self) -> PathBuf {
        self.data().join("manifests")
    }
    pub fn nvidia_dir(&self) -> PathBuf {
        self.manifests().join("nvidia")
    }
    pub fn pypi_dir(&self) -> PathBuf {
        self.manifests().join("pypi")
    }
    pub fn lock(&self) -> PathBuf {
        self.data().join("releases.json")
    }
    pub fn nix(&self) -> PathBuf {
        self.data().join("releases.nix")
    }
}

/// Finds the checkout: `explicit` if given (must be a directory), else the nearest ancestor
/// of the current directory that contains `pkgs/nvshmem`.
pub fn find_repo(explicit: Option<&Path>) -> Result<Option<RepoPaths>> {
    if let Some(dir) = explicit {
        if !dir.is_dir() {
            return Err(Error::Usage(format!(
                "--repo {}: not a directory; create it first or pass an existing checkout",
                dir.display()
            )));
        }
        return Ok(Some(RepoPaths::new(dir)));
    }
    let cwd = std::env::current_dir().map_err(|e| Error::io(".", e))?;
    Ok(cwd
        .ancestors()
        .find(|d| d.join(DATA_DIR).is_dir())
        .map(RepoPaths::new))
}

/// Where a piece of data was read from, for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Disk(PathBuf),
    Embedded,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Disk(p) => write!(f, "{}", p.display()),
            Origin::Embedded => f.write_str("the snapshot embedded in deepep-nix"),
        }
    }
}

/// The embedded snapshot.
pub fn embedded_inputs() -> Inputs {
    let table = |t: &[(&str, &[u8])]| t.iter().map(|(n, b)| (n.to_string(), b.to_vec())).collect();
    Inputs {
        nvidia: table(embedded::NVIDIA),
        pypi: table(embedded::PYPI),
    }
}

/// The embedded lock, if the binary was built with one.
pub fn embedded_lock_bytes() -> Option<&'static [u8]> {
    embedded::LOCK
}

fn read_json_dir(dir: &Path) -> Result<std::collections::BTreeMap<String, Vec<u8>>> {
    let mut out = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "json") && path.is_file() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
            out.insert(name, bytes);
        }
    }
    Ok(out)
}

/// Reads the vendored upstream documents: from the checkout when it has
/// `pkgs/nvshmem/manifests/`, else the embedded snapshot.
pub fn read_inputs(repo: Option<&RepoPaths>) -> Result<(Inputs, Origin)> {
    if let Some(r) = repo {
        let m = r.manifests();
        if m.is_dir() {
            let nvidia = if r.nvidia_dir().is_dir() {
                read_json_dir(&r.nvidia_dir())?
            } else {
                Default::default()
            };
            let pypi = if r.pypi_dir().is_dir() {
                read_json_dir(&r.pypi_dir())?
            } else {
                Default::default()
            };
            return Ok((Inputs { nvidia, pypi }, Origin::Disk(m)));
        }
    }
    Ok((embedded_inputs(), Origin::Embedded))
}

/// Reads and validates the lock: from the checkout when it has one, else the embedded lock.
pub fn read_lock(repo: Option<&RepoPaths>) -> Result<(Lock, Vec<u8>, Origin)> {
    if let Some(r) = repo {
        let p = r.lock();
        if p.is_file() {
            let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
            let lock = Lock::from_bytes(&p.display().to_string(), &bytes)?;
            return Ok((lock, bytes, Origin::Disk(p)));
        }
    }
    let bytes = embedded_lock_bytes().ok_or_else(|| {
        Error::Usage("no lock found: this deepep-nix was built without pkgs/nvshmem/releases.json and none is on disk; run `deepep-nix lock --offline` in the checkout".into())
    })?;
    let lock = Lock::from_bytes("embedded releases.json", bytes)?;
    Ok((lock, bytes.to_vec(), Origin::Embedded))
}
