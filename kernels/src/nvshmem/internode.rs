//! Internode normal-mode dispatch/combine (two-hop over NVSHMEM). See `docs/internode.md`.
//!
//! - [`plan`]: limits, [`plan::InternodeConfig`] and its validation, buffer/handle layouts and
//!   the kernels' parameter block (pure, CPU-tested).

pub mod plan;

pub use plan::{InternodeArgs, InternodeConfig, SymLayout};
