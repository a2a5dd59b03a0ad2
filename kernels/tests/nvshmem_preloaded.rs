//! One NVSHMEM per process: a `libnvshmem_host.so.3` that something loaded first (torch does, by
//! SONAME, through its `libtorch_nvshmem.so`) is the one the kernels use, whatever `NVSHMEM_DIR`
//! says, and its release picks the cubins. Real host libraries, loaded as torch would load them
//! (`dlopen` by path, `RTLD_GLOBAL`); no GPU needed.
//!
//! The preloaded library is the first prefix of `DEEPEP_NVSHMEM_RELEASES` whose release differs
//! from `NVSHMEM_DIR`'s (CI: NVSHMEM 3.3.20 beside 3.4.5), else `NVSHMEM_DIR`'s own. One test per
//! file: the process can load NVSHMEM only once.

use deepep_kernels::cubins;
use deepep_kernels::nvshmem::binding::{HostLib, Version, HOST_LIB_NAME};
use std::path::PathBuf;

fn release_of(prefix: &std::path::Path) -> (u32, u32, u32) {
    let text = std::fs::read_to_string(prefix.join("include/non_abi/nvshmem_version.h")).unwrap();
    let f = |k: &str| -> u32 {
        text.lines().find_map(|l| l.strip_prefix(&format!("#define NVSHMEM_VENDOR_{k}_VERSION "))).unwrap().trim().parse().unwrap()
    };
    (f("MAJOR"), f("MINOR"), f("PATCH"))
}

#[test]
fn a_host_library_loaded_first_wins_over_nvshmem_dir_and_picks_the_cubins() {
    let Some(dir) = std::env::var_os("NVSHMEM_DIR").filter(|d| !d.is_empty()).map(PathBuf::from) else {
        assert!(std::env::var_os("CI").is_none(), "CI must export NVSHMEM_DIR (scripts/install-toolchain.sh)");
        eprintln!("skipping: NVSHMEM_DIR not set");
        return;
    };
    let default = release_of(&dir);
    let other = std::env::var("DEEPEP_NVSHMEM_RELEASES")
        .unwrap_or_default()
        .split(':')
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .find(|p| release_of(p) != default);
    if other.is_none() && std::env::var_os("CI").is_some() {
        panic!("CI must build with a second NVSHMEM release (DEEPEP_NVSHMEM_RELEASES, scripts/install-toolchain.sh)");
    }
    let pre = other.unwrap_or_else(|| dir.clone());
    let want = release_of(&pre);
    assert!(HostLib::already_loaded().unwrap().is_none(), "nothing loaded NVSHMEM yet");

    // What torch's libtorch_nvshmem.so does: the host library of its own NVSHMEM, loaded first.
    let path = pre.join("lib").join(HOST_LIB_NAME);
    // SAFETY: NVSHMEM's host library runs only its own constructors when loaded.
    let torch_copy = unsafe {
        libloading::os::unix::Library::open(Some(&path), libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL)
    }
    .unwrap();

    // An NVSHMEM_DIR naming another place does not load a second copy.
    std::env::set_var("NVSHMEM_DIR", "/nonexistent-nvshmem-dir");
    let e = HostLib::load(&[Version::new(9, 9, 9)]).unwrap_err().to_string();
    assert!(e.contains("version mismatch") && e.contains("9.9.9") && e.contains("already loaded in the process"), "{e}");
    let lib = deepep_kernels::nvshmem::load_host_library().expect("the preloaded library is served");
    assert_eq!(lib.version(), Version::new(want.0, want.1, want.2));
    assert_eq!(
        std::fs::canonicalize(lib.path()).unwrap(),
        std::fs::canonicalize(&path).unwrap(),
        "the library in use is the one loaded first"
    );
    assert_eq!(cubins::nvshmem_release(), Some(want), "the cubins of the loaded release are chosen");
    assert_eq!(cubins::get("low_latency").unwrap().nvshmem_release, Some(want));
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut mapped: Vec<&str> = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).filter(|p| p.ends_with(HOST_LIB_NAME)).collect();
    mapped.dedup();
    assert_eq!(mapped.len(), 1, "one libnvshmem_host.so.3 mapped: {mapped:?}");
    drop(lib);
    drop(torch_copy);
}
