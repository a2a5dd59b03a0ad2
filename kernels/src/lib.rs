//! DeepEP-equivalent expert-parallel communication kernels.
//!
//! Module map (see `docs/architecture.md`):
//! - [`error`]: error type and the GPU diagnostic record (rank / phase / channel on timeout).
//! - `cubins`: the embedded sm_90a cubins and their build manifest (from `build.rs`).
//! - `reference`: the CPU oracle of the dispatch/combine contract (pure Rust).
//! - `validate`: argument checks run before any launch.
//! - `runtime`: rendezvous, launcher, CUDA context/module/launch helpers, IPC, NCCL, timing.
//! - `intranode`: layout + NVLink dispatch/combine (`Buffer`).
//! - `nvshmem`: NVSHMEM host binding, runtime knobs, low-latency and internode modes.

pub mod error;
pub use error::{EpError, Result};
pub mod cubins;
pub mod common;
pub mod config;
pub mod intranode;
pub mod low_latency;
pub mod internode;
pub mod runtime;
pub mod tensor;
pub mod trace;
pub mod nvshmem;
pub mod reference;
pub mod validate;
