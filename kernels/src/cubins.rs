//! The cubins compiled by `build.rs` and embedded in the binary, with their build manifest.
//!
//! Name = file stem of the source (`selftest`, `layout`, `intranode`, `low_latency`, `internode`).
//! Every source is compiled once per GPU architecture of the build ([`ARCHS`]: sm_90a, sm_100a and
//! sm_103a unless `DEEPEP_CUDA_ARCHS` named fewer; [`crate::arch`]); a GPU loads the cubins of its
//! compute capability ([`require_for_cc`], from `Gpu::module`). [`get`] and [`require`] give the
//! first architecture's ([`DEFAULT_ARCH`]), for checks that do not depend on the device.
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
    /// The SASS target, e.g. `sm_100a` (one of [`ARCHS`]).
    pub arch: &'static str,
    /// The compute capability that runs it, e.g. `(10, 0)`.
    pub cc: (u32, u32),
    /// The ELF image (SASS for [`Cubin::arch`]), ready for `cuModuleLoadData`.
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

/// The first architecture of the build: the one [`get`] and [`require`] give.
pub const DEFAULT_ARCH: &str = ARCHS[0];

/// The embedded cubin named `name` for the default architecture ([`DEFAULT_ARCH`]), if it was
/// built; for an NVSHMEM cubin, the one of the release in use ([`nvshmem_release`]).
pub fn get(name: &str) -> Option<&'static Cubin> {
    get_for_arch(name, DEFAULT_ARCH)
}

/// [`get`] for architecture `arch` (`sm_100a`).
pub fn get_for_arch(name: &str, arch: &str) -> Option<&'static Cubin> {
    let release = nvshmem_release();
    CUBINS.iter().find(|c| c.name == name && c.arch == arch && (!c.nvshmem || c.nvshmem_release == release))
}

/// The NVSHMEM cubin `name` built for release `v` (default architecture), if there is one.
pub fn get_for(name: &str, v: (u32, u32, u32)) -> Option<&'static Cubin> {
    CUBINS.iter().find(|c| c.name == name && c.arch == DEFAULT_ARCH && c.nvshmem && c.nvshmem_release == Some(v))
}

/// The compute capabilities the build has cubins for, in [`ARCHS`] order.
pub fn built_ccs() -> Vec<(u32, u32)> {
    ARCHS.iter().filter_map(|n| crate::arch::by_name(n)).map(|a| a.cc).collect()
}

/// The compute capabilities with a GPU record in kernels/results at build time.
pub fn recorded_ccs() -> Vec<(u32, u32)> {
    RECORDED_ARCHS.iter().filter_map(|n| crate::arch::by_name(n)).map(|a| a.cc).collect()
}

/// The architectures built, as "sm_90a (9.0), sm_100a (10.0)".
pub fn archs_text() -> String {
    let cc = |n: &str| crate::arch::by_name(n).map_or("?".into(), |a| crate::arch::cc_text(a.cc));
    ARCHS.iter().map(|n| format!("{n} ({})", cc(n))).collect::<Vec<_>>().join(", ")
}

/// The architecture whose cubins a device of compute capability `cc` loads; an error naming the
/// architectures this build has and the fix when there is none.
pub fn arch_for_cc(cc: (u32, u32), device: &str) -> Result<&'static str> {
    if let Some(a) = ARCHS.iter().find(|n| crate::arch::by_name(n).is_some_and(|a| a.cc == cc)) {
        return Ok(a);
    }
    let known = crate::arch::by_cc(cc);
    let fix = match known {
        Some(a) => format!(
            "this build left {} out (DEEPEP_CUDA_ARCHS at build time); rebuild without DEEPEP_CUDA_ARCHS (all architectures) or \
             with {} in it",
            a.name, a.name
        ),
        None => format!(
            "this project builds for {} only; use a GPU of one of those compute capabilities",
            crate::arch::KNOWN.iter().map(|a| format!("{} ({})", a.family, crate::arch::cc_text(a.cc))).collect::<Vec<_>>().join(", ")
        ),
    };
    Err(EpError::Unsupported(format!(
        "{device} is compute capability {}: this build has cubins for {} only. Fix: {fix}",
        crate::arch::cc_text(cc),
        archs_text()
    )))
}

/// The cubin `name` that a device of compute capability `cc` loads (its architecture's; for an
/// NVSHMEM cubin, of the release in use). The first load in the process on a device whose
/// architecture has no GPU record prints the untested-architecture warning to stderr
/// ([`untested_arch_warning_once`]): the first `Buffer` loads its cubins through here.
pub fn require_for_cc(name: &str, cc: (u32, u32), device: &str) -> Result<&'static Cubin> {
    let arch = arch_for_cc(cc, device)?;
    if let Some(c) = get_for_arch(name, arch) {
        if let Some(w) = untested_arch_warning_once(cc, device) {
            eprintln!("{w}");
        }
        return Ok(c);
    }
    // Not built at all (the error of `require` says why), or built for the default architecture
    // only, which build.rs never does (every source for every architecture).
    require(name)?;
    Err(EpError::Unsupported(format!("cubin '{name}' is embedded for {DEFAULT_ARCH} but not for {arch}; rebuild the crate")))
}

/// The one-line untested-architecture warning for the first `Buffer` on `device` of compute
/// capability `cc` ([`crate::arch::untested_warning`] against this build's architectures and the
/// GPU records it was built with); `None` when such a GPU has a record.
pub fn untested_arch_warning(cc: (u32, u32), device: &str) -> Option<String> {
    crate::arch::untested_warning(cc, device, &recorded_ccs(), &built_ccs())
}

/// [`untested_arch_warning`], but `Some` only the first time it is `Some` in this process: what
/// the first `Buffer` prints.
pub fn untested_arch_warning_once(cc: (u32, u32), device: &str) -> Option<String> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let w = untested_arch_warning(cc, device)?;
    (!WARNED.swap(true, std::sync::atomic::Ordering::AcqRel)).then_some(w)
}

/// The architectures built and recorded, read back from the ASCII markers embedded in the binary
/// (`DEEPEP_KERNELS_ARCHS=sm_90a,sm_100a,sm_103a;`, `DEEPEP_KERNELS_RECORDED_ARCHS=sm_90a;`).
pub fn archs_from_markers() -> (Vec<String>, Vec<String>) {
    let list = |m: &'static str, prefix: &str| -> Vec<String> {
        let m = std::hint::black_box(m);
        m.trim_start_matches(prefix).trim_end_matches(';').split(',').filter(|s| !s.is_empty()).map(String::from).collect()
    };
    (list(ARCHS_MARKER, "DEEPEP_KERNELS_ARCHS="), list(RECORDED_ARCHS_MARKER, "DEEPEP_KERNELS_RECORDED_ARCHS="))
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
    format!("cubins {} (nvcc {NVCC_VERSION}, {nvs}, source {SOURCE_HASH}): {}", ARCHS.join(" "), names.join(", "))
}
