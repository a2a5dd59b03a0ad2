//! Issue 16 item 2: a prefix made by `deepep-nix install` holds everything DeepEP v1.2.1's
//! `setup.py` reads when `NVSHMEM_DIR` is set, and a DeepEP-shaped extension built with exactly
//! its NVSHMEM flags links against it and is read back correctly by `deepep-nix doctor`.
//!
//! Real bytes throughout: the pinned `nvidia-nvshmem-cu13==3.4.5` wheel (`DEEPEP_NVSHMEM_WHEEL`),
//! installed by the real binary; the build uses the CUDA 13 pip toolchain (`CUDA_HOME`, both set
//! by `scripts/install-toolchain.sh --print-env`). An NVIDIA tarball is checked the same way when
//! `DEEPEP_NVSHMEM_TARBALL` names one (it is not downloadable from CI; `tests/install.rs` covers
//! the tarball's unpacking). Fails when `CI` is set and the wheel or nvcc is missing; skipped
//! with a reason otherwise.
//!
//! What DeepEP v1.2.1's `setup.py` does with `NVSHMEM_DIR` (read at tag v1.2.1):
//! - `assert os.path.exists(nvshmem_dir)`;
//! - `include_dirs += [f'{nvshmem_dir}/include']` (its sources include `nvshmem.h`,
//!   `nvshmemx.h`, `non_abi/device/threadgroup/nvshmemi_common_device_defines.cuh`,
//!   `device_host_transport/nvshmem_common_ibgda.h`);
//! - `library_dirs += [f'{nvshmem_dir}/lib']`;
//! - device link: `-dlink -L{nvshmem_dir}/lib -lnvshmem_device` (`libnvshmem_device.a`);
//! - host link: `-l:libnvshmem_host.so -l:libnvshmem_device.a -Wl,-rpath,{nvshmem_dir}/lib`
//!   (the unversioned `libnvshmem_host.so`: the wheel has only `.so.3`, `deepep-nix install`
//!   adds the link); nvcc flags `-rdc=true`, `TORCH_CUDA_ARCH_LIST` default `9.0`.
//!
//! At run time NVSHMEM opens `nvshmem_bootstrap_uid.so.3` (DeepEP bootstraps with a unique id)
//! and, for internode, `nvshmem_transport_ibgda.so.3`, from the host library's directory.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Headers DeepEP v1.2.1's sources include from NVSHMEM (`git grep '#include' v1.2.1 -- csrc`).
const DEEPEP_HEADERS: &[&str] = &[
    "nvshmem.h",
    "nvshmemx.h",
    "non_abi/device/threadgroup/nvshmemi_common_device_defines.cuh",
    "device_host_transport/nvshmem_common_ibgda.h",
];

fn required_file(var: &str, what: &str) -> Option<PathBuf> {
    let why = match std::env::var_os(var).map(PathBuf::from) {
        Some(p) if p.exists() => return Some(p),
        Some(p) => format!("{var}={} does not exist", p.display()),
        None => format!("{var} is not set"),
    };
    if std::env::var_os("CI").is_some() {
        panic!("{why}; CI must provide {what} (eval \"$(bash scripts/install-toolchain.sh --print-env)\")");
    }
    eprintln!("skipped: {why} ({what}; eval \"$(bash scripts/install-toolchain.sh --print-env)\")");
    None
}

/// Installs `archive` with the real binary and returns NVSHMEM_DIR as the printed exports set it.
fn install(archive: &Path, source: &[&str], prefix: &Path) -> PathBuf {
    let mut args = vec!["install"];
    args.extend_from_slice(source);
    args.extend(common::file_and_prefix(archive, prefix));
    args.extend_from_slice(common::SELECT_3_4_5);
    let out = common::run_in(&common::repo_root(), &args);
    assert!(out.status.success(), "{}", common::stderr(&out));
    // Only the printed exports: evaluate them in a shell and read NVSHMEM_DIR back.
    let sh = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{}\nprintf '%s' \"$NVSHMEM_DIR\"",
            common::stdout(&out)
        ))
        .output()
        .unwrap();
    PathBuf::from(String::from_utf8(sh.stdout).unwrap())
}

/// Every path DeepEP v1.2.1's setup.py and NVSHMEM's start-up use, relative to NVSHMEM_DIR.
fn assert_deepep_build_inputs(dir: &Path) {
    assert!(
        dir.is_dir(),
        "setup.py asserts NVSHMEM_DIR exists: {}",
        dir.display()
    );
    for h in DEEPEP_HEADERS {
        assert!(
            dir.join("include").join(h).is_file(),
            "include/{h} missing in {}",
            dir.display()
        );
    }
    let lib = dir.join("lib");
    // -l:libnvshmem_host.so: the unversioned name must lead to the SONAME the extension records.
    let unversioned = lib.join("libnvshmem_host.so");
    let target = std::fs::canonicalize(&unversioned)
        .unwrap_or_else(|e| panic!("{}: {e}", unversioned.display()));
    let bytes = std::fs::read(&target).unwrap();
    let soname = soname_of(&bytes);
    assert_eq!(
        soname.as_deref(),
        Some("libnvshmem_host.so.3"),
        "{}",
        target.display()
    );
    assert!(lib.join("libnvshmem_host.so.3").is_file());
    // -lnvshmem_device (device link) and -l:libnvshmem_device.a (host link): an ar archive.
    let device = std::fs::read(lib.join("libnvshmem_device.a")).unwrap();
    assert!(
        device.starts_with(b"!<arch>\n"),
        "libnvshmem_device.a is not an ar archive"
    );
    // Run time: the bootstrap DeepEP uses and the IBGDA transport, next to the host library.
    for plugin in ["nvshmem_bootstrap_uid.so.3", "nvshmem_transport_ibgda.so.3"] {
        assert!(
            lib.join(plugin).is_file(),
            "lib/{plugin} missing in {}",
            dir.display()
        );
    }
}

/// DT_SONAME of an ELF shared object, read with `object` (the doctor's ELF reader is private).
fn soname_of(bytes: &[u8]) -> Option<String> {
    use object::read::elf::{Dyn, ElfFile64, FileHeader};
    use object::Endianness;
    let file = ElfFile64::<Endianness>::parse(bytes).ok()?;
    let endian = file.endian();
    let header = file.elf_header();
    let sections = header.sections(endian, bytes).ok()?;
    let (dynamic, link) = sections.dynamic(endian, bytes).ok()??;
    let strings = sections.strings(endian, bytes, link).ok()?;
    dynamic.iter().find_map(|d| {
        if d.tag(endian) != object::elf::DT_SONAME {
            return None;
        }
        let name = d.string(endian, strings).ok()?;
        Some(String::from_utf8_lossy(name).into_owned())
    })
}

/// The real NVSHMEM 3.4.5 wheel both tests install (scripts/test-all.sh sets the variable).
fn nvshmem_wheel() -> Option<PathBuf> {
    required_file(
        "DEEPEP_NVSHMEM_WHEEL",
        "the nvidia-nvshmem-cu13==3.4.5 wheel",
    )
}

#[test]
fn installed_wheel_prefix_has_what_deepep_setup_py_reads() {
    let Some(wheel) = nvshmem_wheel() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = install(
        &wheel,
        &["--source", "pypi"],
        &tmp.path().join("nvshmem-wheel"),
    );
    assert_eq!(dir, tmp.path().join("nvshmem-wheel"));
    assert_deepep_build_inputs(&dir);
    // Without the link deepep-nix adds, DeepEP's `-l:libnvshmem_host.so` has nothing to find:
    // the wheel itself ships only the versioned file.
    let archive = zip::ZipArchive::new(std::fs::File::open(&wheel).unwrap()).unwrap();
    let names: Vec<&str> = archive.file_names().collect();
    assert!(names
        .iter()
        .any(|n| n.ends_with("lib/libnvshmem_host.so.3")));
    assert!(!names.iter().any(|n| n.ends_with("lib/libnvshmem_host.so")));
    if let Ok(tarball) = std::env::var("DEEPEP_NVSHMEM_TARBALL") {
        let dir = install(
            Path::new(&tarball),
            &[],
            &tmp.path().join("nvshmem-tarball"),
        );
        assert_deepep_build_inputs(&dir);
    }
}

/// Compiles and links a DeepEP-shaped extension with setup.py's NVSHMEM flags against the
/// installed prefix (`-rdc=true`, `TORCH_CUDA_ARCH_LIST=9.0` -> sm_90, `CPATH` for CUDA 13's CCCL),
/// then checks what doctor reads from it.
#[test]
fn deepep_shaped_extension_builds_against_the_prefix_and_doctor_reads_it() {
    let Some(wheel) = nvshmem_wheel() else {
        return;
    };
    let Some(cuda) = required_file("CUDA_HOME", "the CUDA 13 toolchain with nvcc") else {
        return;
    };
    let nvcc = cuda.join("bin/nvcc");
    assert!(nvcc.is_file(), "{} missing", nvcc.display());
    let tmp = tempfile::tempdir().unwrap();
    let dir = install(&wheel, &["--source", "pypi"], &tmp.path().join("nvshmem"));
    let build = tmp.path().join("build");
    let site = tmp.path().join("site-packages");
    std::fs::create_dir_all(&build).unwrap();
    std::fs::create_dir_all(&site).unwrap();
    // A kernel that uses NVSHMEM device code and a host function that initialises NVSHMEM, as
    // DeepEP's runtime does (this pulls the device library's host-side objects in).
    // `nvshmem_common_ibgda.h` includes rdma-core's `infiniband/mlx5dv.h` (as does DeepEP's
    // `ibgda_device.cuh`): a DeepEP build needs rdma-core's headers besides the NVSHMEM prefix
    // (Debian/Ubuntu: libibverbs-dev). Without them that one include is left out here.
    let ibgda = if Path::new("/usr/include/infiniband/mlx5dv.h").is_file() {
        "#include <device_host_transport/nvshmem_common_ibgda.h>\n"
    } else {
        eprintln!("note: /usr/include/infiniband/mlx5dv.h missing (apt-get install libibverbs-dev); building without device_host_transport/nvshmem_common_ibgda.h");
        ""
    };
    let src = build.join("ext.cu");
    std::fs::write(
        &src,
        "#include <nvshmem.h>\n#include <nvshmemx.h>\n\
         #include <non_abi/device/threadgroup/nvshmemi_common_device_defines.cuh>\n"
            .to_string()
            + ibgda
            + "__global__ void put(int *dst, int pe) { nvshmem_int_p(dst, 1, pe); }\n\
         extern \"C\" int ext_init() { nvshmem_init(); return nvshmem_my_pe(); }\n\
         extern \"C\" void ext_put(int *d) { put<<<1, 1>>>(d, 0); }\n",
    )
    .unwrap();
    let d = dir.to_str().unwrap();
    // CUDA 13's CCCL (`cuda/std/...`, which NVSHMEM's headers include) lives in include/cccl:
    // nvcc adds it by itself, the host compiler that builds DeepEP's deep_ep.cpp does not.
    // docs/deepep.md's CPATH reaches both.
    let cpath = cuda.join("include/cccl");
    let host_tu = build.join("deep_ep_like.cpp");
    std::fs::write(
        &host_tu,
        "#include <nvshmem.h>\n#include <nvshmemx.h>\n\
         #include <non_abi/device/threadgroup/nvshmemi_common_device_defines.cuh>\n\
         int main() { return 0; }\n",
    )
    .unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let host_compile = |with_cpath: bool| {
        let mut cmd = Command::new(&cxx);
        cmd.arg("-fsyntax-only")
            .arg(format!("-I{d}/include"))
            .arg(format!("-I{}/include", cuda.display()))
            .arg(&host_tu)
            .env_remove("CPATH");
        if with_cpath {
            cmd.env("CPATH", &cpath);
        }
        cmd.output().unwrap()
    };
    let without = host_compile(false);
    assert!(
        !without.status.success(),
        "the host compiler found cuda/std without CPATH"
    );
    assert!(
        String::from_utf8_lossy(&without.stderr).contains("cuda/std/"),
        "{}",
        String::from_utf8_lossy(&without.stderr)
    );
    let with = host_compile(true);
    assert!(
        with.status.success(),
        "{}",
        String::from_utf8_lossy(&with.stderr)
    );
    let gencode = ["-gencode", "arch=compute_90,code=sm_90"];
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(Command::new(&nvcc)
        .args(["-O3", "-rdc=true", "-Xcompiler", "-fPIC"])
        .args(gencode)
        .arg(format!("-I{d}/include"))
        .env("CPATH", &cpath)
        .args(["-c", "-o"])
        .arg(build.join("ext.o"))
        .arg(&src));
    run(Command::new(&nvcc)
        .args(["-dlink", "-Xcompiler", "-fPIC"])
        .args(gencode)
        .arg(build.join("ext.o"))
        .arg(format!("-L{d}/lib"))
        .arg("-lnvshmem_device")
        .arg("-o")
        .arg(build.join("dlink.o")));
    let ext = site.join("deep_ep_cpp.cpython-312-x86_64-linux-gnu.so");
    run(
        Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
            .arg("-shared")
            .arg("-o")
            .arg(&ext)
            .arg(build.join("ext.o"))
            .arg(build.join("dlink.o"))
            .arg(format!("-L{d}/lib"))
            .arg(format!("-L{}/lib", cuda.display()))
            .args(["-l:libnvshmem_host.so", "-l:libnvshmem_device.a"])
            .arg(format!("-Wl,-rpath,{d}/lib"))
            .arg("-l:libcudart.so.13"),
    );
    std::fs::create_dir_all(site.join("deep_ep-1.2.1.dist-info")).unwrap();
    std::fs::write(
        site.join("deep_ep-1.2.1.dist-info/METADATA"),
        "Name: deep_ep\nVersion: 1.2.1\n",
    )
    .unwrap();

    let out = Command::new(env!("CARGO_BIN_EXE_deepep-nix"))
        .args(["doctor", "--json", "--python-site"])
        .arg(&site)
        .env("NVSHMEM_DIR", &dir)
        .env("LD_LIBRARY_PATH", dir.join("lib"))
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let check = |id: &str| common::json_check(&json, id).clone();
    let e = check("deepep.extension");
    assert_eq!(e["status"], "ok", "{e}");
    assert_eq!(
        e["found"],
        format!(
            "{}: DeepEP 1.2.1 ({}); NVSHMEM 3.4.5 device library linked in, needs libnvshmem_host.so.3; \
             RUNPATH {d}/lib; GPU code sm_90",
            ext.display(),
            site.join("deep_ep-1.2.1.dist-info/METADATA").display()
        )
    );
    let n = check("deepep.nvshmem");
    assert_eq!(n["status"], "ok", "{n}");
    assert_eq!(
        n["found"],
        format!("loads NVSHMEM 3.4.5 ({d}/lib/libnvshmem_host.so.3) = the device library it was built with")
    );
    assert_eq!(check("deepep.ibgda-plugin")["status"], "ok");
    assert_eq!(check("deepep.pairing")["status"], "ok");
    assert_eq!(check("nvshmem.plugin.bootstrap")["status"], "ok");
}
