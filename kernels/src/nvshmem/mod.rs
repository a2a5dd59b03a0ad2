//! NVSHMEM: host binding ([`binding`]), runtime knobs ([`knobs`]) and the kernel families that
//! run on it (low-latency dispatch/combine; internode two-hop dispatch/combine).
//!
//! See `docs/nvshmem.md` for the start-up paths (unique id through our rendezvous, Slurm PMI)
//! and the knobs.

pub mod binding;
pub mod knobs;
pub mod internode;

pub use binding::{Bootstrap, HostLib, Nvshmem, RegisteredModule, SymmetricBuffer, UidExchange, Version};
