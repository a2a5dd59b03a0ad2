//! Test and benchmark harness of `deepep-kernels` (not published, not part of the library's API).
//!
//! - [`cases`]: what a GPU test case is (`Case`, `Ctx`, `Skip`, `POISON_U32`) and every
//!   registered case: the runtime's own `selftest/` cases and the kernel families' cases, each
//!   against the CPU reference of `deepep_kernels::reference`; [`gpu_test`]: the collective runner
//!   of `deepep-gpu-tests` (seeds, verdict exchange, per-case timeout). The runner uses the cases,
//!   never the other way round.
//! - [`ranks`]: the rank options and exit codes both binaries share.
//! - [`bench`]: the benchmark framework of `deepep-bench` (DeepEP's figures beside an NCCL
//!   all-to-all baseline moving the same bytes).
//!
//! The harness uses only the library's public API. The library items that exist for it are
//! documented there as diagnostic hooks (output poisoning, phase traces, raw kernel launches);
//! `docs/architecture.md` lists them.

pub mod bench;
pub mod cases;
pub mod gpu_test;
pub mod ranks;
