//! NVSHMEM host binding against the real pip NVSHMEM host library (no GPU needed: `dlopen`,
//! symbol resolution and `nvshmemx_vendor_get_version_info` work without a device).
//!
//! The library comes from `NVSHMEM_DIR`; when it is unset the tests skip, except under CI
//! (`CI` set), where a missing `NVSHMEM_DIR` is a failure of the test setup.

use std::path::{Path, PathBuf};

use deepep_kernels::nvshmem::binding::{self, HostLib, Version, HOST_LIB_NAME, SYMBOLS};

fn nvshmem_dir() -> Option<PathBuf> {
    match std::env::var_os("NVSHMEM_DIR").filter(|d| !d.is_empty()) {
        Some(d) => Some(PathBuf::from(d)),
        None if std::env::var_os("CI").is_some() => {
            panic!("CI is set but NVSHMEM_DIR is not: the CI script must export NVSHMEM_DIR (scripts/install-toolchain.sh)")
        }
        None => {
            eprintln!("skipping: NVSHMEM_DIR not set");
            None
        }
    }
}

/// The version the headers of the same installation declare (`non_abi/nvshmem_version.h`).
fn header_version(dir: &Path) -> Version {
    let text = std::fs::read_to_string(dir.join("include/non_abi/nvshmem_version.h"))
        .expect("NVSHMEM_DIR has include/non_abi/nvshmem_version.h");
    let field = |name: &str| -> u32 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")).map(|v| v.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("{name} not in nvshmem_version.h"))
    };
    Version::new(
        field("NVSHMEM_VENDOR_MAJOR_VERSION"),
        field("NVSHMEM_VENDOR_MINOR_VERSION"),
        field("NVSHMEM_VENDOR_PATCH_VERSION"),
    )
}

#[test]
fn every_bound_symbol_resolves_in_the_pip_host_library() {
    let Some(dir) = nvshmem_dir() else { return };
    let path = dir.join("lib").join(HOST_LIB_NAME);
    // SAFETY: loading NVSHMEM's host library runs only its own constructors.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap_or_else(|e| panic!("dlopen {}: {e}", path.display()));
    let missing: Vec<_> = SYMBOLS
        .iter()
        .filter(|s| unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err())
        .collect();
    assert!(missing.is_empty(), "unresolved symbols: {missing:?}");
}

#[test]
fn loads_from_nvshmem_dir_and_reports_the_header_version() {
    let Some(dir) = nvshmem_dir() else { return };
    let want = header_version(&dir);
    let lib = HostLib::load_from(&binding::candidates(Some(dir.as_os_str())), &[want]).expect("load");
    assert_eq!(lib.version(), want);
    assert_eq!(lib.path(), dir.join("lib").join(HOST_LIB_NAME));
    assert_eq!(lib.init_status(), 0, "freshly loaded library must report NOT_INITIALIZED");
}

#[test]
fn version_mismatch_is_refused_naming_both_versions() {
    let Some(dir) = nvshmem_dir() else { return };
    let have = header_version(&dir);
    let other = Version::new(have.major, have.minor + 1, 0);
    let err = HostLib::load_from(&binding::candidates(Some(dir.as_os_str())), &[other]).unwrap_err().to_string();
    assert!(err.contains("version mismatch"), "{err}");
    assert!(err.contains(&have.to_string()) && err.contains(&other.to_string()), "{err}");
    assert!(err.contains("NVSHMEM_DIR"), "{err}");
}

#[test]
fn missing_library_gives_the_documented_message() {
    let cands = vec![PathBuf::from("/nonexistent-nvshmem/lib").join(HOST_LIB_NAME), PathBuf::from("libnvshmem_host_does_not_exist.so.3")];
    let err = HostLib::load_from(&cands, &[]).unwrap_err().to_string();
    assert!(err.contains("cannot load the NVSHMEM host library"), "{err}");
    assert!(err.contains("/nonexistent-nvshmem/lib") && err.contains("no such file"), "{err}");
    assert!(err.contains("NVSHMEM_DIR") && err.contains("LD_LIBRARY_PATH"), "{err}");
}

#[test]
fn a_library_without_nvshmem_symbols_is_rejected() {
    // libc exists everywhere and lacks the NVSHMEM entry points.
    let err = HostLib::load_from(&[PathBuf::from("libc.so.6")], &[]).unwrap_err().to_string();
    assert!(err.contains("lacks symbol nvshmemx_get_uniqueid"), "{err}");
}

/// A 1-rank rendezvous (no other process): the unique-id broadcast returns rank 0's bytes.
struct OneRank;
impl deepep_kernels::nvshmem::UidExchange for OneRank {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn broadcast(&self, _root: usize, bytes: &[u8]) -> deepep_kernels::Result<Vec<u8>> {
        Ok(bytes.to_vec())
    }
}

/// Whether `LD_LIBRARY_PATH` would give the loader `name` (the CI sets none).
fn on_library_path(name: &str) -> bool {
    std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).any(|d| d.join(name).is_file()))
        .unwrap_or(false)
}

#[test]
fn a_missing_bootstrap_plugin_is_reported_before_nvshmem_starts() {
    use deepep_kernels::nvshmem::{binding::check_bootstrap_plugin, Bootstrap, Nvshmem};
    let Some(dir) = nvshmem_dir() else { return };
    let plugin = Bootstrap::UniqueId.plugin();
    // The real installation has the plugin next to the host library.
    check_bootstrap_plugin(&dir.join("lib").join(HOST_LIB_NAME), plugin).expect("the pip lib/ has the UID plugin");
    // A copy of the host library alone: NVSHMEM 3.4.5 would print "Bootstrap unable to load" and
    // abort the process (double free); we must return the documented error instead.
    let tmp = std::env::temp_dir().join(format!("deepep-no-plugin-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let lone = tmp.join(HOST_LIB_NAME);
    std::fs::copy(dir.join("lib").join(HOST_LIB_NAME), &lone).unwrap();
    if on_library_path(plugin) {
        eprintln!("skipping the missing-plugin half: LD_LIBRARY_PATH provides {plugin}");
        return;
    }
    let e = check_bootstrap_plugin(&lone, plugin).unwrap_err().to_string();
    assert!(e.contains(plugin) && e.contains(&lone.display().to_string()) && e.contains("LD_LIBRARY_PATH"), "{e}");
    let lib = HostLib::load_from(std::slice::from_ref(&lone), &[]).expect("the copied host library loads");
    let e = Nvshmem::init(lib, &OneRank, Bootstrap::UniqueId).unwrap_err().to_string();
    assert!(e.starts_with("NVSHMEM") || e.contains("rank 0:"), "{e}");
    assert!(e.contains(plugin) && e.contains("would abort"), "{e}");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn every_bootstrap_names_its_plugin_and_the_wheel_ships_them() {
    use deepep_kernels::nvshmem::binding::{Bootstrap, PmiFlavor};
    let Some(dir) = nvshmem_dir() else { return };
    for b in [Bootstrap::UniqueId, Bootstrap::Pmi(PmiFlavor::Pmi1), Bootstrap::Pmi(PmiFlavor::Pmi2), Bootstrap::Pmi(PmiFlavor::Pmix)] {
        assert!(dir.join("lib").join(b.plugin()).is_file(), "{:?}: {} not in the pip lib/", b, b.plugin());
    }
}
