//! The sm_90a cubins compiled by `build.rs` and embedded in the binary, with their build manifest.
//!
//! Name = file stem of the source (`selftest`, `layout`, `intranode`, `low_latency`, `internode`).
//! NVSHMEM cubins (`cuda/nvshmem/*.cu`) are present only when the crate was built with NVSHMEM
//! (see [`NVSHMEM_ENABLED`]); [`require`] turns a missing one into an error that says how to fix it.

pub mod elf;

use crate::error::{EpError, Result};

/// Resource usage of one kernel as reported by `ptxas -v` (NVSHMEM cubins: after `nvlink`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelResources {
    pub name: &'static str,
    pub registers: u32,
    pub stack_bytes: u32,
    pub spill_bytes: u32,
    pub static_smem_bytes: u32,
}

/// One embedded cubin.
#[derive(Debug)]
pub struct Cubin {
    /// File stem of the source, e.g. `intranode`.
    pub name: &'static str,
    /// The ELF image (SASS for [`ARCH`]), ready for `cuModuleLoadData`.
    pub bytes: &'static [u8],
    /// Linked against `libnvshmem_device.a` (needs `nvshmemx_cumodule_init` after loading).
    pub nvshmem: bool,
    /// The `extern "C" __global__` entry points parsed from the source.
    pub kernels: &'static [&'static str],
    /// Per-kernel resources, same order as `kernels`.
    pub resources: &'static [KernelResources],
}

include!(concat!(env!("OUT_DIR"), "/cubins.rs"));

/// The embedded cubin named `name`, if it was built.
pub fn get(name: &str) -> Option<&'static Cubin> {
    CUBINS.iter().find(|c| c.name == name)
}

/// Like [`get`], but an error that says why the cubin is missing and how to get it.
pub fn require(name: &str) -> Result<&'static Cubin> {
    if let Some(c) = get(name) {
        return Ok(c);
    }
    let known: Vec<&str> = CUBINS.iter().map(|c| c.name).collect();
    if !NVSHMEM_ENABLED {
        Err(EpError::Unsupported(format!(
            "cubin '{name}' is not embedded: this binary was built without NVSHMEM (NVSHMEM_DIR unset at build time), \
             so the NVSHMEM kernels are left out; rebuild with NVSHMEM_DIR=<nvshmem prefix> (scripts/install-toolchain.sh \
             prints it). Embedded cubins: {known:?}"
        )))
    } else {
        Err(EpError::Unsupported(format!("no cubin named '{name}' in this build; embedded cubins: {known:?}")))
    }
}

impl Cubin {
    /// The ELF symbol table of the image.
    pub fn symbols(&self) -> Result<Vec<elf::Symbol>> {
        elf::symbols(self.bytes).map_err(|e| EpError::InvalidArgument(format!("cubin '{}': {e}", self.name)))
    }
    /// Parameter information of `kernel` as recorded in the cubin (what the driver checks
    /// launches against); available without a GPU.
    pub fn params(&self, kernel: &str) -> Result<elf::ParamInfo> {
        let e = |m: String| EpError::InvalidArgument(format!("cubin '{}': {m}", self.name));
        elf::kernel_params(self.bytes, kernel).map_err(e)?.ok_or_else(|| e(format!("no parameter info for kernel '{kernel}'")))
    }
    /// Resources of kernel `name`.
    pub fn resources_of(&self, kernel: &str) -> Option<&'static KernelResources> {
        self.resources.iter().find(|r| r.name == kernel)
    }
}

/// One line describing the build (printed by the binaries at start-up).
pub fn manifest() -> String {
    let nvs = match NVSHMEM_VERSION {
        Some((a, b, c)) => format!("NVSHMEM {a}.{b}.{c}"),
        None => "no NVSHMEM".to_string(),
    };
    let names: Vec<&str> = CUBINS.iter().map(|c| c.name).collect();
    format!("cubins {ARCH} (nvcc {NVCC_VERSION}, {nvs}, source {SOURCE_HASH}): {}", names.join(", "))
}
