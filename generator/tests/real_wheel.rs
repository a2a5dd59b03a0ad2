//! Real bytes: the `nvidia-nvshmem-cu13==3.4.5` x86_64 wheel (downloaded by the toolchain
//! step, path in `DEEPEP_NVSHMEM_WHEEL`) verifies against the lock's pinned hash. Fails when
//! `CI` is set and the wheel is missing; skipped with a reason otherwise.

mod common;

#[test]
fn pinned_wheel_verifies_with_real_bytes() {
    let wheel = std::env::var_os("DEEPEP_NVSHMEM_WHEEL").map(std::path::PathBuf::from);
    let wheel = match wheel {
        Some(w) if w.is_file() => w,
        other => {
            let why = match other {
                Some(w) => format!("DEEPEP_NVSHMEM_WHEEL={} is not a file", w.display()),
                None => "DEEPEP_NVSHMEM_WHEEL is not set".to_string(),
            };
            if std::env::var_os("CI").is_some() {
                panic!("{why}; CI must provide the nvidia-nvshmem-cu13==3.4.5 wheel (scripts/install-toolchain.sh downloads it)");
            }
            eprintln!("skipped: {why} (run `pip download --no-deps nvidia-nvshmem-cu13==3.4.5 -d DIR` and point it at the wheel)");
            return;
        }
    };
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
