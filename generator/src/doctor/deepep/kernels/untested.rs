//! `deepep-kernels.arch-record`: whether this project has ever run the installed build on a GPU
//! of this machine's architecture (issue 40, "Honest labels").
//!
//! The extension carries two markers that kernels/build.rs writes (`cubins::ARCHS_MARKER`,
//! `cubins::RECORDED_ARCHS_MARKER`): `DEEPEP_KERNELS_ARCHS=sm_90a,sm_100a,sm_103a;`, the
//! architectures it has cubins for, and `DEEPEP_KERNELS_RECORDED_ARCHS=sm_90a;`, those for which
//! `kernels/results` held a GPU record when it was built. A GPU whose architecture is built but
//! not recorded gets the warning the first `Buffer` prints (kernels/src/arch.rs,
//! `untested_warning`); a recorded one is ok; one the build has no cubins for is
//! `deepep-kernels.arch`'s failure, not this check's.

use super::super::super::facts::DriverInfo;
use super::super::super::host::Host;
use super::super::super::report::{caps, Check};
use super::super::compute_capability;
use std::path::Path;

const ID: &str = "deepep-kernels.arch-record";
const ARCHS: &str = "DEEPEP_KERNELS_ARCHS=";
const RECORDED: &str = "DEEPEP_KERNELS_RECORDED_ARCHS=";
/// The command that checks a GPU and writes its record (kernels/src/arch.rs `CHECK_COMMAND`).
const CHECK_COMMAND: &str = "python/scripts/gpu-run.sh";

/// The list after `key` up to its `;` (`sm_90a,sm_100a`), or `None` without the marker. Only a
/// list of `sm_` names counts: the key also occurs in the extension as a plain string.
pub(super) fn marker(bytes: &[u8], key: &str) -> Option<Vec<String>> {
    let k = key.as_bytes();
    let mut at = 0;
    while let Some(pos) = bytes[at..].windows(k.len()).position(|w| w == k) {
        let start = at + pos + k.len();
        let rest = &bytes[start..bytes.len().min(start + 256)];
        if let Some(end) = rest.iter().position(|&b| b == b';') {
            if let Ok(text) = std::str::from_utf8(&rest[..end]) {
                let names: Vec<String> = text
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
                if names.iter().all(|n| {
                    n.starts_with("sm_") && n[3..].chars().all(|c| c.is_ascii_alphanumeric())
                }) {
                    return Some(names);
                }
            }
        }
        at = start;
    }
    None
}

/// nvcc's architecture-specific name for compute capability `cc` (9.0 -> `sm_90a`, 10.3 -> `sm_103a`).
fn arch_name(cc: (u32, u32)) -> String {
    format!("sm_{}{}a", cc.0, cc.1)
}

/// The check for the extension's bytes and this machine's GPUs; `None` for a build without the
/// markers (from before issue 40: sm_90a cubins only, and Hopper has records).
pub(super) fn arch_record_check(bytes: &[u8], driver: &DriverInfo) -> Option<Check> {
    let (Some(built), Some(recorded)) = (marker(bytes, ARCHS), marker(bytes, RECORDED)) else {
        return None;
    };
    Some(record_check(&built, &recorded, driver))
}

fn record_check(built: &[String], recorded: &[String], driver: &DriverInfo) -> Check {
    let gpus: Vec<(usize, &str, (u32, u32))> = driver
        .gpus
        .iter()
        .enumerate()
        .filter_map(|(i, g)| compute_capability(&g.model).map(|cc| (i, g.model.as_str(), cc)))
        .collect();
    let skip = |why: &str| Check::skip(ID, caps::ALL, why);
    if gpus.is_empty() {
        return skip("no GPU of known compute capability to compare with");
    }
    let describe = |g: &(usize, &str, (u32, u32))| {
        format!(
            "GPU {} {} ({}, compute capability {}.{})",
            g.0,
            g.1,
            arch_name(g.2),
            g.2 .0,
            g.2 .1
        )
    };
    let untested: Vec<_> = gpus
        .iter()
        .filter(|g| built.contains(&arch_name(g.2)) && !recorded.contains(&arch_name(g.2)))
        .collect();
    if untested.is_empty() {
        let ran: Vec<String> = gpus
            .iter()
            .filter(|g| recorded.contains(&arch_name(g.2)))
            .map(describe)
            .collect();
        if ran.is_empty() {
            return skip("the build has no cubins for this machine's GPUs (deepep-kernels.arch)");
        }
        return Check::ok(
            ID,
            caps::ALL,
            format!(
                "{}: this project has GPU records of that architecture (recorded: {})",
                ran.join(", "),
                recorded.join(", ")
            ),
        );
    }
    let mut names: Vec<String> = untested.iter().map(|g| arch_name(g.2)).collect();
    names.dedup();
    Check::warn(
        ID,
        caps::ALL,
        format!(
            "{}: this project has never run on such a GPU (no record in kernels/results; recorded: {}); its {} kernels are built \
             and checked without one",
            untested.iter().map(|g| describe(g)).collect::<Vec<_>>().join(", "),
            if recorded.is_empty() { "none".to_string() } else { recorded.join(", ") },
            names.join(", ")
        ),
        format!("check this GPU with `RECORD=1 {CHECK_COMMAND} <wheel> 2` and add the record it writes to kernels/results (docs/python.md, \"Supported architectures\")"),
    )
}

/// Reads the extension at `native` and pushes the check, if the build has the markers (an
/// unreadable extension is `deepep-kernels.package`'s failure; here it is a skip).
pub(super) fn check(host: &Host, native: &Path, driver: &DriverInfo, out: &mut Vec<Check>) {
    match host.read_bytes(native, super::elf::LIB_CAP) {
        Ok(b) => out.extend(arch_record_check(&b, driver)),
        Err(e) => out.push(Check::skip(
            ID,
            caps::ALL,
            format!("{} {e}", native.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::super::facts::Gpu;
    use super::super::super::super::report::Status;
    use super::*;

    fn driver(models: &[&str]) -> DriverInfo {
        DriverInfo {
            version: Some("580.159.04".into()),
            open_modules: true,
            gpus: models
                .iter()
                .map(|m| Gpu {
                    bus: "0000:00:00.0".into(),
                    model: (*m).into(),
                    minor: Some(0),
                })
                .collect(),
            no_device: false,
        }
    }

    /// Extension bytes with the two markers as build.rs writes them, plus the keys as plain strings.
    fn ext(built: &str, recorded: &str) -> Vec<u8> {
        format!("\x7fELF...DEEPEP_KERNELS_ARCHS=...{ARCHS}{built};..{RECORDED}{recorded};..DEEPEP_KERNELS_RECORDED_ARCHS= and more").into_bytes()
    }

    /// The check for an extension built for `built` with records of `recorded`, on `gpus`.
    fn check_of(built: &str, recorded: &str, gpus: &[&str]) -> Check {
        arch_record_check(&ext(built, recorded), &driver(gpus)).expect("the markers are there")
    }

    #[test]
    fn markers_are_read_and_plain_key_strings_are_not_markers() {
        let b = ext("sm_90a,sm_100a,sm_103a", "sm_90a");
        assert_eq!(marker(&b, ARCHS).unwrap(), ["sm_90a", "sm_100a", "sm_103a"]);
        assert_eq!(marker(&b, RECORDED).unwrap(), ["sm_90a"]);
        assert_eq!(
            marker(&ext("sm_90a", ""), RECORDED).unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(marker(b"DEEPEP_KERNELS_ARCHS= is the key", ARCHS), None);
    }

    #[test]
    fn a_built_but_unrecorded_architecture_warns_naming_it_and_the_command() {
        let c = check_of("sm_90a,sm_100a,sm_103a", "sm_90a", &["NVIDIA B200"]);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        for want in [
            "GPU 0 NVIDIA B200",
            "sm_100a",
            "compute capability 10.0",
            "never run on such a GPU",
        ] {
            assert!(c.found.contains(want), "{want:?} missing: {}", c.found);
        }
        assert!(
            c.fix
                .as_deref()
                .unwrap()
                .contains("python/scripts/gpu-run.sh"),
            "{c:?}"
        );
        let c = check_of(
            "sm_90a,sm_100a,sm_103a",
            "sm_90a",
            &["NVIDIA H200", "NVIDIA B300 SXM6"],
        );
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found.contains("GPU 1 NVIDIA B300 SXM6 (sm_103a") && !c.found.contains("GPU 0"),
            "{}",
            c.found
        );
    }

    #[test]
    fn a_record_of_the_architecture_removes_the_warning() {
        let c = check_of("sm_90a,sm_100a", "sm_90a,sm_100a", &["NVIDIA B200"]);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        let c = check_of("sm_90a,sm_100a", "sm_90a", &["NVIDIA H100 80GB HBM3"]);
        assert_eq!(c.status, Status::Ok, "{c:?}");
    }

    #[test]
    fn no_markers_no_gpu_or_no_cubins_skip() {
        assert!(arch_record_check(b"an old build", &driver(&["NVIDIA H200"])).is_none());
        assert_eq!(check_of("sm_90a", "sm_90a", &[]).status, Status::Skip);
        // A100: no cubins for it, which deepep-kernels.arch reports as a failure.
        assert_eq!(
            check_of("sm_90a", "sm_90a", &["NVIDIA A100-SXM4-80GB"]).status,
            Status::Skip
        );
    }
}
