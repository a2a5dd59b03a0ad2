//! The NVSHMEM cubins of every release the crate was built for (`NVSHMEM_DIR`'s plus
//! `DEEPEP_NVSHMEM_RELEASES`), and choosing one per process (no GPU needed).
//!
//! CI builds with two releases (scripts/install-toolchain.sh installs NVSHMEM 3.4.5 and 3.3.20),
//! so the choice between sets is exercised there; with one release the multi-release assertions
//! reduce to that one.

use deepep_kernels::cubins::{self, elf};
use std::path::Path;

fn nvshmem_sources() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda/nvshmem");
    let mut v: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn text((a, b, c): (u32, u32, u32)) -> String {
    format!("{a}.{b}.{c}")
}

#[test]
fn every_release_has_every_nvshmem_cubin_linked_with_its_device_library() {
    if !cubins::NVSHMEM_ENABLED {
        assert!(cubins::NVSHMEM_RELEASES.is_empty());
        return;
    }
    let default = cubins::NVSHMEM_VERSION.expect("NVSHMEM enabled");
    assert!(cubins::NVSHMEM_RELEASES.contains(&default), "{:?} lacks the default {default:?}", cubins::NVSHMEM_RELEASES);
    assert!(cubins::NVSHMEM_RELEASES.windows(2).all(|w| w[0] < w[1]), "not ascending: {:?}", cubins::NVSHMEM_RELEASES);
    let mut sizes = Vec::new();
    for &r in cubins::NVSHMEM_RELEASES {
        for s in nvshmem_sources() {
            let c = cubins::get_for(&s, r).unwrap_or_else(|| panic!("no {s} cubin for NVSHMEM {}", text(r)));
            assert!(c.nvshmem && c.nvshmem_release == Some(r), "{s} for {}: {:?}", text(r), c.nvshmem_release);
            let syms: Vec<String> = elf::symbols(c.bytes).unwrap().into_iter().map(|s| s.name).collect();
            for want in ["nvshmemi_device_state_d", "nvshmemi_device_lib_version_d"] {
                assert!(syms.iter().any(|n| n == want), "{s} for {}: no {want} (not linked with -lnvshmem_device)", text(r));
            }
            sizes.push((s.clone(), r, c.bytes.len()));
        }
    }
    // Plain cubins exist once per architecture, whatever the number of releases.
    for c in cubins::CUBINS.iter().filter(|c| !c.nvshmem) {
        assert_eq!(cubins::CUBINS.iter().filter(|d| d.name == c.name && d.arch == c.arch).count(), 1, "{} {} twice", c.name, c.arch);
        assert!(c.nvshmem_release.is_none());
    }
    // Before any choice, get() gives the default release's set.
    for s in nvshmem_sources() {
        assert_eq!(cubins::get(&s).unwrap().nvshmem_release, cubins::nvshmem_release());
    }
    eprintln!("NVSHMEM cubins: {sizes:?}");
}

#[test]
fn the_marker_in_the_binary_lists_the_releases() {
    let want: Vec<String> = cubins::NVSHMEM_RELEASES.iter().map(|&r| text(r)).collect();
    assert_eq!(cubins::releases_from_marker(), want);
    assert_eq!(cubins::RELEASES_MARKER, format!("DEEPEP_KERNELS_NVSHMEM_RELEASES={};", want.join(",")));
    // The marker is in the linked binary's bytes (what `deepep-nix doctor` reads), exactly once.
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let needle = cubins::RELEASES_MARKER.as_bytes();
    let hits = exe.windows(needle.len()).filter(|w| *w == needle).count();
    assert_eq!(hits, 1, "marker {:?} found {hits} times in the test binary", cubins::RELEASES_MARKER);
}

/// One test owns the process-wide choice (tests of one binary share the process).
#[test]
fn choosing_a_release_switches_the_set_and_is_final() {
    if !cubins::NVSHMEM_ENABLED {
        return;
    }
    let e = cubins::select_nvshmem_release((9, 9, 9)).unwrap_err().to_string();
    assert!(e.contains("no NVSHMEM cubins for release 9.9.9") && e.contains(&cubins::releases_text()), "{e}");
    assert!(e.contains("DEEPEP_NVSHMEM_RELEASES") && e.contains("--source pypi"), "{e}");
    // Nothing was chosen by the refusal.
    assert_eq!(cubins::nvshmem_release(), cubins::NVSHMEM_VERSION);
    let default = cubins::NVSHMEM_VERSION.unwrap();
    let other = cubins::NVSHMEM_RELEASES.iter().copied().find(|&r| r != default).unwrap_or(default);
    cubins::select_nvshmem_release(other).unwrap();
    cubins::select_nvshmem_release(other).expect("choosing the same release again is fine");
    assert_eq!(cubins::nvshmem_release(), Some(other));
    for s in nvshmem_sources() {
        let c = cubins::get(&s).unwrap();
        assert_eq!(c.nvshmem_release, Some(other), "{s}");
        assert!(std::ptr::eq(c, cubins::get_for(&s, other).unwrap()));
    }
    if other != default {
        let e = cubins::select_nvshmem_release(default).unwrap_err().to_string();
        assert!(e.contains("already uses NVSHMEM") && e.contains(&text(other)) && e.contains("one NVSHMEM per process"), "{e}");
        assert_eq!(cubins::nvshmem_release(), Some(other));
    } else {
        eprintln!("one release only ({}): the switch between sets is not exercised", text(default));
    }
}
