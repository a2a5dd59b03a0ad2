//! GPU architectures: the ones the cubins can be built for, which GPUs each one is, and whether
//! this project has ever run on it (a record in `kernels/results` whose `machine` names such a GPU).
//!
//! `build.rs` includes this file too (`#[path]`), so the build and the runtime share one table:
//! the build parses `DEEPEP_CUDA_ARCHS` with [`parse_arch_list`] and derives the architectures
//! with GPU records from the records' `machine` fields with [`archs_in_machine`]; the runtime
//! picks cubins by the device's compute capability ([`by_cc`]) and builds the one-line
//! untested-architecture warning ([`untested_warning`]). No GPU and no other module needed.

/// One GPU architecture the cubins can be compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    /// nvcc's name of the SASS target, e.g. `sm_90a` (the `a` variants: architecture-specific
    /// features, the code runs on exactly this compute capability).
    pub name: &'static str,
    /// The compute capability (major, minor) the code runs on.
    pub cc: (u32, u32),
    /// The family, for messages: `Hopper`, `Blackwell`, `Blackwell Ultra`.
    pub family: &'static str,
    /// GPU model names of this compute capability, as they appear in `nvidia-smi` and in the
    /// records' `machine` field (`1x NVIDIA H200 (...)`), matched as whole words.
    pub gpus: &'static [&'static str],
}

/// Every architecture the build knows, in build order; the default build compiles all of them.
/// Compute capabilities: CUDA C++ Programming Guide, "Compute Capabilities" (9.0 Hopper, 10.0
/// B200/GB200, 10.3 B300/GB300).
pub const KNOWN: &[Arch] = &[
    Arch { name: "sm_90a", cc: (9, 0), family: "Hopper", gpus: &["H100", "H200", "H800", "H20", "GH200"] },
    Arch { name: "sm_100a", cc: (10, 0), family: "Blackwell", gpus: &["B200", "GB200", "B100"] },
    Arch { name: "sm_103a", cc: (10, 3), family: "Blackwell Ultra", gpus: &["B300", "GB300"] },
];

/// The command that runs this project's GPU tests and DeepEP's on a machine (docs/python.md).
pub const CHECK_COMMAND: &str = "python/scripts/gpu-run.sh";

/// The known architecture named `name` (`sm_90a`, `sm_100a`, `sm_103a`).
pub fn by_name(name: &str) -> Option<&'static Arch> {
    KNOWN.iter().find(|a| a.name == name)
}

/// The known architecture of compute capability `cc`.
pub fn by_cc(cc: (u32, u32)) -> Option<&'static Arch> {
    KNOWN.iter().find(|a| a.cc == cc)
}

/// `DEEPEP_CUDA_ARCHS`: `all`, or a comma-separated list of known names (`sm_90a,sm_100a`);
/// the result is in [`KNOWN`] order without repeats. Anything else is an error naming the fix.
pub fn parse_arch_list(text: &str) -> Result<Vec<&'static Arch>, String> {
    let text = text.trim();
    if text == "all" {
        return Ok(KNOWN.iter().collect());
    }
    let names: Vec<&str> = KNOWN.iter().map(|a| a.name).collect();
    let mut wanted = Vec::new();
    for item in text.split(',').map(str::trim) {
        match by_name(item) {
            Some(a) => wanted.push(a.name),
            None => {
                return Err(format!(
                    "DEEPEP_CUDA_ARCHS={text:?} names {item:?}, which is not an architecture this build knows. Fix: `all` \
                     or a comma-separated list of {} (e.g. DEEPEP_CUDA_ARCHS=sm_90a for a Hopper-only developer build)",
                    names.join(", ")
                ))
            }
        }
    }
    Ok(KNOWN.iter().filter(|a| wanted.contains(&a.name)).collect())
}

/// The architectures whose GPUs a record's `machine` text names (`2x NVIDIA H200 (NV18
/// NVLink, ...)` -> sm_90a); GPU names are matched as whole words. Empty for a machine without a
/// known GPU (a CPU-only or qemu record).
pub fn archs_in_machine(machine: &str) -> Vec<&'static Arch> {
    let words: Vec<&str> = machine.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()).collect();
    KNOWN.iter().filter(|a| a.gpus.iter().any(|g| words.contains(g))).collect()
}

/// The one-line warning for the first `Buffer` on a device of compute capability `cc`, given the
/// compute capabilities that have a GPU record (`recorded`) and those the build has cubins for
/// (`built`): `Some` when the build serves `cc` but no record of this project ran on such a GPU;
/// `None` when a record exists, or when the build has no cubins for `cc` (loading them fails with
/// its own error naming the architectures served).
pub fn untested_warning(cc: (u32, u32), device: &str, recorded: &[(u32, u32)], built: &[(u32, u32)]) -> Option<String> {
    if recorded.contains(&cc) || !built.contains(&cc) {
        return None;
    }
    let (arch, family) = by_cc(cc).map_or(("?", "?"), |a| (a.name, a.family));
    Some(format!(
        "deepep_kernels: {device} is compute capability {}.{} ({arch}, {family}); this project has never run on such a GPU \
         (no record in kernels/results): its {arch} kernels are built and checked without one. Check this GPU with \
         `RECORD=1 {CHECK_COMMAND} <wheel> 2` and add the record it writes to kernels/results",
        cc.0, cc.1
    ))
}

/// `9.0` for `(9, 0)`.
pub fn cc_text(cc: (u32, u32)) -> String {
    format!("{}.{}", cc.0, cc.1)
}
