//! GPU architectures without a GPU: which ones the build has records for (derived from
//! kernels/results at build time), the untested-architecture warning with faked compute
//! capabilities, and the markers that `deepep-nix doctor` reads from the binary.

use deepep_kernels::arch::{self, untested_warning};
use deepep_kernels::cubins;
use std::path::Path;

/// The architectures whose GPUs the records' `machine` fields name, computed here with a real
/// JSON parser (build.rs scans the text for the field).
fn recorded_from_results() -> Vec<&'static str> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    let mut names = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let p = e.path();
        if p.extension() != Some(std::ffi::OsStr::new("json")) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let machine = v["machine"].as_str().unwrap_or_else(|| panic!("{}: no machine string", p.display()));
        for a in arch::archs_in_machine(machine) {
            if !names.contains(&a.name) {
                names.push(a.name);
            }
        }
    }
    arch::KNOWN.iter().map(|a| a.name).filter(|n| names.contains(n)).collect()
}

#[test]
fn recorded_architectures_follow_the_records() {
    assert_eq!(cubins::RECORDED_ARCHS, recorded_from_results().as_slice());
    // The H200 records in kernels/results make Hopper a recorded architecture.
    assert!(cubins::RECORDED_ARCHS.contains(&"sm_90a"), "{:?}", cubins::RECORDED_ARCHS);
}

#[test]
fn every_record_naming_an_nvidia_gpu_names_a_known_one() {
    // A GPU record whose GPU the table does not know would silently count for no architecture.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let p = e.path();
        if p.extension() != Some(std::ffi::OsStr::new("json")) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let machine = v["machine"].as_str().unwrap();
        if machine.contains("NVIDIA") && !machine.contains("no GPU") {
            assert!(!arch::archs_in_machine(machine).is_empty(), "{}: machine {machine:?} names no GPU of arch::KNOWN", p.display());
        }
    }
}

#[test]
fn gpu_names_in_machine_text() {
    let names = |m: &str| arch::archs_in_machine(m).iter().map(|a| a.name).collect::<Vec<_>>();
    assert_eq!(names("2x NVIDIA H200 (NV18 NVLink, driver 580.159.04), CUDA 13.0"), ["sm_90a"]);
    assert_eq!(names("4x NVIDIA GB200 (NVL72)"), ["sm_100a"]);
    assert_eq!(names("8x NVIDIA B300 SXM6"), ["sm_103a"]);
    assert_eq!(names("1x NVIDIA H100 80GB HBM3 and 1x NVIDIA B200"), ["sm_90a", "sm_100a"]);
    // whole words only: "H2000" or "B2000x" are no GPU of the table
    assert!(names("x86_64, qemu-aarch64 7.2, no GPU").is_empty());
    assert!(names("NVIDIA H2000 B2000x").is_empty());
}

#[test]
fn the_warning_names_the_architecture_and_the_check_once_per_missing_record() {
    let built = [(9, 0), (10, 0), (10, 3)];
    // Faked compute capability 10.0 with only Hopper recorded: one line, the architecture, the
    // statement and the command.
    let w = untested_warning((10, 0), "NVIDIA B200", &[(9, 0)], &built).expect("10.0 has no record");
    assert!(!w.contains('\n'), "{w}");
    for want in ["NVIDIA B200", "compute capability 10.0", "sm_100a", "Blackwell", "never run on such a GPU", "python/scripts/gpu-run.sh"] {
        assert!(w.contains(want), "{want:?} missing: {w}");
    }
    let w = untested_warning((10, 3), "NVIDIA B300", &[(9, 0)], &built).unwrap();
    assert!(w.contains("compute capability 10.3") && w.contains("sm_103a"), "{w}");
    // A record of that architecture removes it.
    assert_eq!(untested_warning((10, 0), "NVIDIA B200", &[(9, 0), (10, 0)], &built), None);
    assert_eq!(untested_warning((9, 0), "NVIDIA H200", &[(9, 0)], &built), None);
    // No cubins for it: no warning (loading fails with its own error).
    assert_eq!(untested_warning((8, 0), "NVIDIA A100", &[(9, 0)], &built), None);
    assert_eq!(untested_warning((10, 0), "NVIDIA B200", &[(9, 0)], &[(9, 0)]), None);
}

#[test]
fn this_build_warns_exactly_for_built_architectures_without_records() {
    for a in arch::KNOWN {
        let w = cubins::untested_arch_warning(a.cc, "GPU");
        let expect = cubins::ARCHS.contains(&a.name) && !cubins::RECORDED_ARCHS.contains(&a.name);
        assert_eq!(w.is_some(), expect, "{}: {w:?}", a.name);
    }
    assert_eq!(cubins::untested_arch_warning((9, 0), "NVIDIA H100"), None, "Hopper has records");
}

#[test]
fn the_first_buffer_warns_once() {
    // Only this test calls the _once variant in this process.
    let Some(untested) = arch::KNOWN.iter().find(|a| cubins::ARCHS.contains(&a.name) && !cubins::RECORDED_ARCHS.contains(&a.name)) else {
        return; // every built architecture has a record
    };
    assert_eq!(cubins::untested_arch_warning_once((9, 0), "NVIDIA H200"), None);
    assert!(cubins::untested_arch_warning_once(untested.cc, "GPU 0").is_some());
    assert_eq!(cubins::untested_arch_warning_once(untested.cc, "GPU 1"), None);
}

#[test]
fn arch_list_setting() {
    let names = |s: &str| arch::parse_arch_list(s).map(|v| v.iter().map(|a| a.name).collect::<Vec<_>>());
    assert_eq!(names("all").unwrap(), ["sm_90a", "sm_100a", "sm_103a"]);
    assert_eq!(names("sm_103a, sm_90a").unwrap(), ["sm_90a", "sm_103a"]);
    let e = names("sm_90a,sm_80").unwrap_err();
    assert!(e.contains("\"sm_80\"") && e.contains("sm_90a, sm_100a, sm_103a") && e.contains("Fix"), "{e}");
    assert!(names("").is_err());
}

#[test]
fn markers_in_the_binary_list_built_and_recorded_architectures() {
    let (built, recorded) = cubins::archs_from_markers();
    assert_eq!(built, cubins::ARCHS);
    assert_eq!(recorded, cubins::RECORDED_ARCHS);
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    for m in [cubins::ARCHS_MARKER, cubins::RECORDED_ARCHS_MARKER] {
        let hits = exe.windows(m.len()).filter(|w| *w == m.as_bytes()).count();
        assert_eq!(hits, 1, "marker {m:?} found {hits} times in the test binary");
    }
}
