//! `deepep-nix`: pin NVSHMEM releases from upstream, render Nix data, verify and install
//! releases, and check a host (`doctor`).
//!
//! Data flow: NVIDIA's `redistrib_<version>.json` manifests and PyPI's JSON for
//! `nvidia-nvshmem-cu12/-cu13` ([`nvidia`], [`pypi`]) -> vendored under
//! `pkgs/nvshmem/manifests/` -> the lock `pkgs/nvshmem/releases.json` ([`lock`]) -> the Nix
//! data `pkgs/nvshmem/releases.nix` ([`render`]).

pub mod cli;
pub mod doctor;
pub mod error;
pub mod generate;
pub mod hash;
pub mod http;
pub mod install;
pub mod interrupt;
pub mod lock;
pub mod model;
pub mod nvidia;
pub mod output;
pub mod pypi;
pub mod releases;
pub mod render;
pub mod repo;
pub mod validate;
pub mod verify;
pub mod version;

pub use error::{Error, Result};
