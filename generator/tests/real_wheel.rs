//! Real bytes: the `nvidia-nvshmem-cu13==3.4.5` x86_64 wheel (downloaded by the toolchain
//! step, path in `DEEPEP_NVSHMEM_WHEEL`) verifies against the lock's pinned hash. Fails when
//! `CI` is set and the wheel is missing; skipped with a reason otherwise.

mod common;

/// The wheel named by `DEEPEP_NVSHMEM_WHEEL`; `None` (test skipped, with the reason) where
/// it is missing outside CI.
fn real_wheel() -> Option<std::path::PathBuf> {
    let wheel = std::env::var_os("DEEPEP_NVSHMEM_WHEEL").map(std::path::PathBuf::from);
    match wheel {
        Some(w) if w.is_file() => Some(w),
        other => {
            let why = match other {
                Some(w) => format!("DEEPEP_NVSHMEM_WHEEL={} is not a file", w.display()),
                None => "DEEPEP_NVSHMEM_WHEEL is not set".to_string(),
            };
            if std::env::var_os("CI").is_some() {
                panic!("{why}; CI must provide the nvidia-nvshmem-cu13==3.4.5 wheel (scripts/install-toolchain.sh downloads it)");
            }
            eprintln!("skipped: {why} (run `pip download --no-deps nvidia-nvshmem-cu13==3.4.5 -d DIR` and point it at the wheel)");
            None
        }
    }
}

#[test]
fn pinned_wheel_verifies_with_real_bytes() {
    let Some(wheel) = real_wheel() else { return };
    let out = common::run_in(
        &common::repo_root(),
        &["verify", "--json", "--file", wheel.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", common::stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v[0]["version"], "3.4.5");
    assert_eq!(v[0]["cuda"], "13");
    assert_eq!(v[0]["source"], "pypi");
    // The digest printed is the lock's pin, and the lock's pin is the wheel's real digest.
    let (digest, size) = deepep_nix::hash::Sha256::of_file(&wheel).unwrap();
    assert_eq!(v[0]["sha256"], digest.to_hex());
    assert_eq!(v[0]["size"], size);
}

/// Issue 20: `install --version 3.4.5 --cuda 13 --file <the PyPI wheel>` without `--source
/// pypi` compared the wheel with the NVIDIA tarball's hash and reported a mismatch.
#[test]
fn pinned_wheel_installs_without_naming_its_source() {
    let Some(wheel) = real_wheel() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("nvshmem");
    let mut args = vec!["install", "--version", "3.4.5", "--cuda", "13"];
    args.extend(common::file_and_prefix(&wheel, &prefix));
    if std::env::consts::ARCH != "x86_64" {
        args.extend_from_slice(&["--system", "x86_64-linux"]);
    }
    let out = common::run_in(&common::repo_root(), &args);
    assert!(out.status.success(), "{}", common::stderr(&out));
    common::assert_stderr_contains(&out, "3.4.5 x86_64-linux cuda13 pypi");
    assert!(prefix.join("lib/libnvshmem_host.so.3").is_file());
    assert!(prefix.join("include/nvshmem.h").is_file());
}
