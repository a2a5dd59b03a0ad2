//! Every kernel of every embedded cubin, for each architecture and NVSHMEM release, as NVIDIA's
//! `cuobjdump -elf` lists it (independently of this crate's own ELF reader), checked against the
//! kernel list the runtime loads from (`Cubin::kernels`: `Module::kernel` refuses any other name).
//! No GPU needed; cuobjdump comes with the pip toolchain (scripts/install-toolchain.sh).

use deepep_kernels::cubins;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `$CUDA_HOME/bin/cuobjdump`, else the pinned toolchain's, else `cuobjdump` on `PATH`.
fn cuobjdump() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut tried = Vec::new();
    let dirs = std::env::var_os("CUDA_HOME").map(PathBuf::from).into_iter().chain([workspace.join(".toolchain/nvidia/cu13")]);
    for d in dirs {
        let p = d.join("bin/cuobjdump");
        if p.is_file() {
            return p;
        }
        tried.push(p.display().to_string());
    }
    if Command::new("cuobjdump").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return PathBuf::from("cuobjdump");
    }
    panic!(
        "cuobjdump not found (tried {} and PATH). Fix: run scripts/install-toolchain.sh (it installs nvidia-cuda-cuobjdump \
         into .toolchain/) or put a CUDA toolkit's bin/ on PATH",
        tried.join(", ")
    );
}

/// What `cuobjdump -elf` says of one image: the `sm=` of its header and its kernels (the names of
/// its `.nv.constant0.<kernel>` sections: the parameter bank every kernel has and nothing else).
fn listing(tool: &Path, bytes: &[u8], dir: &Path, file: &str) -> (String, Vec<String>) {
    let path = dir.join(file);
    std::fs::write(&path, bytes).unwrap();
    let o = Command::new(tool).arg("-elf").arg(&path).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "cuobjdump -elf {file}: {}", String::from_utf8_lossy(&o.stderr));
    let sm = text
        .lines()
        .find_map(|l| l.split("sm=").nth(1))
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("{file}: no `sm=` in cuobjdump's ELF header line"))
        .to_string();
    let mut kernels: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().last()?.strip_prefix(".nv.constant0.").map(String::from))
        .collect();
    kernels.sort();
    kernels.dedup();
    (sm, kernels)
}

#[test]
fn cuobjdump_lists_the_runtime_kernels_of_every_cubin() {
    let tool = cuobjdump();
    let dir = tempfile::tempdir().unwrap();
    // (source, release) -> architecture -> kernels
    let mut by_set: BTreeMap<(String, String), BTreeMap<&str, Vec<String>>> = BTreeMap::new();
    for c in cubins::CUBINS {
        let release = c.nvshmem_release.map_or("plain".to_string(), |(a, b, d)| format!("nvshmem-{a}.{b}.{d}"));
        let file = format!("{}.{release}.{}.cubin", c.name, c.arch);
        let (sm, listed) = listing(&tool, c.bytes, dir.path(), &file);
        assert_eq!(format!("sm_{sm}"), c.arch, "{file}: cuobjdump says sm={sm}");
        let mut runtime: Vec<String> = c.kernels.iter().map(|k| k.to_string()).collect();
        runtime.sort();
        assert_eq!(listed, runtime, "{file}: kernels (cuobjdump -elf) vs the runtime's list (Cubin::kernels)");
        by_set.entry((c.name.to_string(), release)).or_default().insert(c.arch, listed);
    }
    // Every architecture has every cubin, with the same kernels: a GPU of any of them can load
    // whatever a Hopper GPU loads.
    let mut table = Vec::new();
    for ((name, release), archs) in &by_set {
        let got: Vec<&str> = archs.keys().copied().collect();
        let mut want = cubins::ARCHS.to_vec();
        want.sort();
        assert_eq!(got, want, "{name} {release}: architectures");
        let first = archs.values().next().unwrap();
        for (a, k) in archs {
            assert_eq!(k, first, "{name} {release}: {a} has other kernels than {}", got[0]);
        }
        table.push(format!("{name} ({release}): {} kernels x {}", first.len(), got.join(" ")));
    }
    assert!(!table.is_empty());
    eprintln!("cuobjdump -elf of {} embedded cubins:\n  {}", cubins::CUBINS.len(), table.join("\n  "));
}
