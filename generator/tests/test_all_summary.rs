//! `scripts/test-all.sh`'s cargo summary (`--cargo-summary LOG RC`) on the log of a real
//! `cargo test --no-fail-fast` run: a scratch workspace (no dependencies, built offline) with one
//! passing test binary, one with a failing test, one that aborts before its result line and one
//! more passing binary after them. Issue 39: without `--no-fail-fast` cargo stopped at the first
//! failing binary and the tests after it never ran, while the total did not say so.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `scripts/test-all.sh` with `args`.
fn test_all<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new("bash")
        .arg(repo().join("scripts/test-all.sh"))
        .args(args)
        .output()
        .unwrap()
}

fn summary(log: &Path, rc: i32) -> (String, i32) {
    let rc = rc.to_string();
    let out = test_all(&[Path::new("--cargo-summary"), log, Path::new(&rc)]);
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status.code().unwrap_or(-1),
    )
}

/// A scratch crate whose tests are `tests/<name>.rs` with the given bodies.
fn scratch(dir: &Path, tests: &[(&str, &str)]) {
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        "[package]\nname = \"scratch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[workspace]\n",
    )
    .unwrap();
    std::fs::write(dir.join("src/lib.rs"), "").unwrap();
    for (name, body) in tests {
        std::fs::write(dir.join("tests").join(format!("{name}.rs")), body).unwrap();
    }
}

/// Runs `cargo test --no-fail-fast` (the arguments test-all.sh passes) in `dir` with stderr on
/// stdout, as test-all.sh tees it; returns the log and cargo's exit status.
fn cargo_test(dir: &Path) -> (String, i32) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new("bash")
        .arg("-c")
        .arg("\"$0\" test --all-targets --offline --no-fail-fast 2>&1")
        .arg(cargo)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .env_remove("RUSTFLAGS")
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status.code().unwrap_or(-1),
    )
}

#[test]
fn every_binary_runs_and_one_without_a_result_is_counted_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    scratch(
        dir,
        &[
            ("a_pass", "#[test] fn one() {}\n#[test] fn two() {}\n"),
            (
                "b_fail",
                "#[test] fn good() {}\n#[test] fn bad() { panic!(\"expected failure\") }\n#[test] #[ignore] fn later() {}\n",
            ),
            (
                "c_abort",
                "#[test] fn dies() { std::process::abort() }\n",
            ),
            ("d_pass_after", "#[test] fn after() {}\n#[test] fn after2() {}\n#[test] fn after3() {}\n"),
        ],
    );
    let (log, rc) = cargo_test(dir);
    assert_ne!(rc, 0, "{log}");
    // --no-fail-fast: the binaries after the failing and the aborting one ran.
    assert!(log.contains("test after3 ... ok"), "{log}");
    let saved = dir.join("cargo.log");
    std::fs::write(&saved, &log).unwrap();
    let (out, code) = summary(&saved, rc);
    assert_eq!(code, 0, "{out}");
    // 2 (a) + 1 (b) + 3 (d) passed; 1 failed test (b) + 1 binary without a result (c);
    // 1 ignored; 5 binaries: the library's unit tests and the four above.
    assert!(
        out.contains("cargo test: 5 test binaries run, 6 passed, 2 failed, 1 ignored"),
        "{out}\n--- log:\n{log}"
    );
    let fail = out
        .lines()
        .find(|l| l.starts_with("FAIL  cargo test: no result from 1 of 5 test binaries"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(fail.contains("tests/c_abort.rs"), "{fail}");
}

#[test]
fn a_failed_run_without_a_failing_test_is_one_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("cargo.log");
    // A build error: cargo exits 101 before any binary runs.
    std::fs::write(
        &log,
        "   Compiling scratch v0.0.0\nerror[E0425]: cannot find value `x` in this scope\nerror: could not compile `scratch`\n",
    )
    .unwrap();
    let (out, _) = summary(&log, 101);
    assert!(
        out.contains("FAIL  cargo test exited 101 without a failing test"),
        "{out}"
    );
    assert!(
        out.contains("cargo test: 0 test binaries run, 0 passed, 1 failed, 0 ignored"),
        "{out}"
    );
    // The same log with exit status 0 (nothing ran, nothing failed).
    let (out, _) = summary(&log, 0);
    assert_eq!(
        out,
        "cargo test: 0 test binaries run, 0 passed, 0 failed, 0 ignored\n"
    );
}

#[test]
fn usage_errors() {
    let out = test_all(&["--cargo-summary", "/nonexistent/cargo.log"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs a saved cargo test log"));
    let out = test_all(&["--bogus"]);
    assert_eq!(out.status.code(), Some(2));
    let out = test_all(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("--no-fail-fast")
            && help.ends_with("Usage: scripts/test-all.sh [--help | --cargo-summary LOG [RC]]\n"),
        "{help}"
    );
}
