//! DeepEP-equivalent expert-parallel communication kernels.
//!
//! Module map (see `docs/architecture.md`):
//! - [`error`]: error type and the GPU diagnostic record (rank / phase / channel on timeout).
//! - [`hash`]: FNV-1a, the hash every rank and build computes alike (cross-rank comparisons, seeds).
//! - [`cubins`]: the embedded cubins (sm_90a, sm_100a, sm_103a) and their build manifest (from
//!   `build.rs`); [`arch`]: the GPU architectures, their GPUs and the untested-architecture warning.
//! - [`reference`](mod@reference): the CPU oracle of the dispatch/combine contract (pure Rust).
//! - [`validate`]: argument checks run before any launch; [`args`]: the checks of the Python
//!   entry points on the tensors as passed (real shapes, strides, dtype, device).
//! - [`runtime`]: rendezvous, launcher, CUDA context/module/launch helpers, IPC, NCCL, timing.
//! - [`config`], [`tensor`], [`common`]: intranode configuration and buffer layout, device
//!   tensors, the stream/event and poisoning helpers the families share.
//! - [`context`]: the rank context ([`context::RankContext`]): one owner for a rank's GPU,
//!   exchange, buffers (lifecycle, generations, capacity), stream joins and error records; the
//!   Python binding is a thin layer over it.
//! - The kernel families, peers of each other:
//!   - [`intranode`]: layout + NVLink dispatch/combine ([`intranode::Buffer`]);
//!   - [`low_latency`]: low-latency dispatch/combine over NVSHMEM
//!     ([`low_latency::LowLatencyBuffer`]);
//!   - [`internode`]: DeepEP's two-hop normal-mode dispatch/combine over NVSHMEM
//!     ([`internode::InternodeBuffer`]).
//! - [`nvshmem`]: the NVSHMEM binding only: host library ([`nvshmem::binding`]), runtime knobs
//!   ([`nvshmem::knobs`]) and the process runtime ([`nvshmem::runtime`], [`nvshmem::finalize`],
//!   [`nvshmem::NvshmemRuntime`]) the NVSHMEM families start from.
//! - [`trace`]: [`trace::PhaseTrace`], the phase times every family's `last_trace()` returns.
//!
//! The GPU test suite (`deepep-gpu-tests`) and the benchmark (`deepep-bench`) are in the
//! separate crate `kernels/harness` (`deepep-kernels-harness`, not published). The few library
//! items that exist for it are public but documented as diagnostic hooks: phase tracing
//! (`set_tracing` / `last_trace`), output poisoning (`intranode::Buffer::fill_data_regions`,
//! `low_latency::LowLatencyBuffer::fill_outputs`, `internode::InternodeBuffer::set_output_poison`).

pub mod error;
pub mod hash;
pub use error::{EpError, Result};
pub mod common;
pub mod config;
pub mod context;
pub mod arch;
pub mod cubins;
pub mod elastic;
pub mod internode;
pub mod intranode;
pub mod low_latency;
pub mod nvshmem;
pub mod reference;
pub mod runtime;
pub mod tensor;
pub mod args;
pub mod trace;
pub mod validate;
