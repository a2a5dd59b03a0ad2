//! Shared vocabulary: Nix systems, CUDA majors, artifact sources, and one resolved artifact.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::hash::Sha256;
use crate::version::Version;

/// A Nix system NVSHMEM ships for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum System {
    #[serde(rename = "aarch64-linux")]
    Aarch64Linux,
    #[serde(rename = "x86_64-linux")]
    X86_64Linux,
}

impl System {
    pub const ALL: [System; 2] = [System::Aarch64Linux, System::X86_64Linux];

    pub fn as_str(self) -> &'static str {
        match self {
            System::Aarch64Linux => "aarch64-linux",
            System::X86_64Linux => "x86_64-linux",
        }
    }

    /// NVIDIA's redist platform key for this system.
    pub fn nvidia_platform(self) -> &'static str {
        match self {
            System::Aarch64Linux => "linux-sbsa",
            System::X86_64Linux => "linux-x86_64",
        }
    }

    /// The system this binary runs on, if NVSHMEM ships for it.
    pub fn host() -> Option<System> {
        match std::env::consts::ARCH {
            "x86_64" => Some(System::X86_64Linux),
            "aarch64" => Some(System::Aarch64Linux),
            _ => None,
        }
    }
}

impl fmt::Display for System {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for System {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "x86_64-linux" | "linux-x86_64" => Ok(System::X86_64Linux),
            "aarch64-linux" | "linux-sbsa" => Ok(System::Aarch64Linux),
            _ => Err(Error::Usage(format!(
                "unknown system {s:?}: use x86_64-linux or aarch64-linux"
            ))),
        }
    }
}

/// CUDA major versions NVSHMEM is built for.
pub const CUDA_MAJORS: [u32; 2] = [12, 13];

/// Where an artifact comes from.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// NVIDIA's redist tarballs (`redistrib_<version>.json` manifests).
    Nvidia,
    /// PyPI wheels `nvidia-nvshmem-cu12` / `nvidia-nvshmem-cu13`.
    Pypi,
}

impl SourceKind {
    pub const ALL: [SourceKind; 2] = [SourceKind::Nvidia, SourceKind::Pypi];

    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Nvidia => "nvidia",
            SourceKind::Pypi => "pypi",
        }
    }
}

impl fmt::Display for SourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One downloadable file, resolved from upstream metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    pub version: Version,
    pub system: System,
    pub cuda: u32,
    pub source: SourceKind,
    pub url: String,
    pub filename: String,
    pub sha256: Sha256,
    /// `None` where upstream metadata does not record it.
    pub size: Option<u64>,
    /// Which upstream document this came from (for error messages and duplicates).
    pub origin: String,
}

impl Artifact {
    /// Human-readable key used in duplicate errors: `3.4.5 x86_64-linux cuda13 pypi`.
    pub fn key(&self) -> String {
        format!(
            "{} {} cuda{} {}",
            self.version, self.system, self.cuda, self.source
        )
    }
}

/// Upper bound for any single artifact size we accept from metadata (16 GiB). Larger values
/// are corrupt metadata, not NVSHMEM builds (the largest wheel is ~0.3 GB).
pub const MAX_ARTIFACT_SIZE: u64 = 16 << 30;

/// Upper bound for a metadata document (manifest, PyPI JSON, index page): 16 MiB.
pub const MAX_METADATA_BYTES: usize = 16 << 20;
