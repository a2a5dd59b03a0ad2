//! Test and benchmark harness of `deepep-kernels` (not published, not part of the library's API).
//!
//! - [`gpu_test`]: the collective GPU test runner of `deepep-gpu-tests` (cases, verdict exchange,
//!   the runtime's own `selftest/` cases); [`cases`]: the kernel families' cases, each against
//!   the CPU reference of `deepep_kernels::reference`.
//! - [`bench`]: the benchmark framework of `deepep-bench` (DeepEP's figures beside an NCCL
//!   all-to-all baseline moving the same bytes).
//!
//! The harness uses only the library's public API. The library items that exist for it are
//! documented there as diagnostic hooks (output poisoning, phase traces, raw kernel launches);
//! `docs/architecture.md` lists them.

pub mod bench;
pub mod cases;
pub mod gpu_test;
