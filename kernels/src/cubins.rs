//! The sm_90a cubins compiled by `build.rs` and embedded in the binary, with their build manifest.
//!
//! Name = file stem of the source (`selftest`, `layout`, `intranode`, `low_latency`, `internode`).
//! NVSHMEM cubins (`cuda/nvshmem/*.cu`) are present only when the crate was built with NVSHMEM
//! (see [`NVSHMEM_ENABLED`]); [`require`] turns a missing one into an error that says how to fix it.
//!
//! NVSHMEM cubins come once per NVSHMEM release the crate was built for ([`NVSHMEM_RELEASES`]:
//! `NVSHMEM_DIR`'s, plus `DEEPEP_NVSHMEM_RELEASES`): each is compiled with that release's headers
//! and linked with its `libnvshmem_device.a`, because the host library copies its own device
//! state into every registered module and the layout changes between releases. The process's
//! NVSHMEM runtime picks the set that matches the loaded `libnvshmem_host.so.3`
//! ([`select_nvshmem_release`]); until then [`get`] gives the default set ([`NVSHMEM_VERSION`]).

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
    /// For an NVSHMEM cubin: the release whose headers and device library it was built with.
    pub nvshmem_release: Option<(u32, u32, u32)>,
    /// The `extern "C" __global__` entry points parsed from the source.
    pub kernels: &'static [&'static str],
    /// Per-kernel resources, same order as `kernels`.
    pub resources: &'static [KernelResources],
}

include!(concat!(env!("OUT_DIR"), "/cubins.rs"));

/// The NVSHMEM release chosen for this process (0 = none yet), packed as `a << 32 | b << 16 | c`.
static SELECTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn pack((a, b, c): (u32, u32, u32)) -> u64 {
    ((a as u64) << 32) | ((b as u64 & 0xffff) << 16) | (c as u64 & 0xffff)
}

fn unpack(v: u64) -> (u32, u32, u32) {
    ((v >> 32) as u32, ((v >> 16) & 0xffff) as u32, (v & 0xffff) as u32)
}

/// The releases served, as "3.3.20, 3.4.5, 3.8.0".
pub fn releases_text() -> String {
    if NVSHMEM_RELEASES.is_empty() {
        return "none (built without NVSHMEM)".into();
    }
    NVSHMEM_RELEASES.iter().map(|(a, b, c)| format!("{a}.{b}.{c}")).collect::<Vec<_>>().join(", ")
}

/// The releases served, read back from the ASCII marker embedded in the binary
/// (`DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.20,3.4.5;`), which tools read from the file's bytes.
pub fn releases_from_marker() -> Vec<String> {
    let m = std::hint::black_box(RELEASES_MARKER);
    let list = m.trim_start_matches("DEEPEP_KERNELS_NVSHMEM_RELEASES=").trim_end_matches(';');
    list.split(',').filter(|s| !s.is_empty()).map(String::from).collect()
}

/// Use the NVSHMEM cubins of release `v` in this process from now on. One NVSHMEM per process:
/// choosing another release after one was chosen is refused, and so is a release this build has
/// no cubins for (the error names the releases it has and the fix).
pub fn select_nvshmem_release(v: (u32, u32, u32)) -> Result<()> {
    use std::sync::atomic::Ordering;
    if !NVSHMEM_RELEASES.contains(&v) {
        return Err(EpError::Unsupported(format!(
            "no NVSHMEM cubins for release {}.{}.{}: this build has them for NVSHMEM {}. The process's \
             libnvshmem_host.so.3 (the one torch or another library loaded first, else $NVSHMEM_DIR/lib, else the \
             nvidia-nvshmem-cu13 wheel) must be one of those. Fix: install a build that serves {}.{}.{} \
             (DEEPEP_NVSHMEM_RELEASES=<its prefix> python/scripts/build-wheel.sh; python/scripts/nvshmem-prefixes.sh \
             installs every pinned release), or use an NVSHMEM this build serves (pip install nvidia-nvshmem-cu13==X.Y.Z, \
             or deepep-nix install --version X.Y.Z --cuda 13 --source pypi --prefix DIR and NVSHMEM_DIR=DIR)",
            v.0,
            v.1,
            v.2,
            releases_text(),
            v.0,
            v.1,
            v.2
        )));
    }
    match SELECTED.compare_exchange(0, pack(v), Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Ok(()),
        Err(cur) if cur == pack(v) => Ok(()),
        Err(cur) => {
            let (a, b, c) = unpack(cur);
            Err(EpError::Unsupported(format!(
                "this process already uses NVSHMEM {a}.{b}.{c}; it cannot switch to {}.{}.{} (one NVSHMEM per process)",
                v.0, v.1, v.2
            )))
        }
    }
}

/// The NVSHMEM release whose cubins [`get`] gives: the selected one, else the default
/// ([`NVSHMEM_VERSION`], the release of `NVSHMEM_DIR` at build time).
pub fn nvshmem_release() -> Option<(u32, u32, u32)> {
    match SELECTED.load(std::sync::atomic::Ordering::Acquire) {
        0 => NVSHMEM_VERSION,
        v => Some(unpack(v)),
    }
}

/// The embedded cubin named `name`, if it was built; for an NVSHMEM cubin, the one of the
/// release in use ([`nvshmem_release`]).
pub fn get(name: &str) -> Option<&'static Cubin> {
    let release = nvshmem_release();
    CUBINS.iter().find(|c| c.name == name && (!c.nvshmem || c.nvshmem_release == release))
}

/// The NVSHMEM cubin `name` built for release `v`, if there is one.
pub fn get_for(name: &str, v: (u32, u32, u32)) -> Option<&'static Cubin> {
    CUBINS.iter().find(|c| c.name == name && c.nvshmem && c.nvshmem_release == Some(v))
}

/// Like [`get`], but an error that says why the cubin is missing and how to get it.
pub fn require(name: &str) -> Result<&'static Cubin> {
    if let Some(c) = get(name) {
        return Ok(c);
    }
    let mut known: Vec<&str> = CUBINS.iter().map(|c| c.name).collect();
    known.sort();
    known.dedup();
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
        Some((a, b, c)) if NVSHMEM_RELEASES.len() > 1 => format!("NVSHMEM {a}.{b}.{c}, serves {}", releases_text()),
        Some((a, b, c)) => format!("NVSHMEM {a}.{b}.{c}"),
        None => "no NVSHMEM".to_string(),
    };
    let mut names: Vec<&str> = CUBINS.iter().map(|c| c.name).collect();
    names.sort();
    names.dedup();
    format!("cubins {ARCH} (nvcc {NVCC_VERSION}, {nvs}, source {SOURCE_HASH}): {}", names.join(", "))
}
