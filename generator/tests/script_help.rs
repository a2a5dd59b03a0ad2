//! `--help` of the repository's scripts (issue 39: some started working on `--help`, and two left
//! `gpu-out/` behind): each prints its help text on stdout and exits 0, leaves nothing in the
//! directory it is run from, and creates nothing in the checkout.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Entries of `dir` (names), sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn scripts_print_help_and_exit_0_touching_nothing() {
    let scripts = [
        ("scripts/test-all.sh", "Usage: scripts/test-all.sh"),
        ("scripts/nix-checks.sh", "Usage: scripts/nix-checks.sh"),
        ("python/scripts/gpu-run.sh", "Usage: python/scripts/gpu-run.sh"),
        ("python/scripts/gpu-sweep.sh", "Usage: python/scripts/gpu-sweep.sh"),
        ("python/scripts/nvshmem-matrix.sh", "usage:"),
        ("python/scripts/nvshmem-subset.sh", "Usage: python/scripts/nvshmem-subset.sh"),
        ("python/scripts/nvshmem-prefixes.sh", "Usage: python/scripts/nvshmem-prefixes.sh"),
        ("python/scripts/check-reproducible.sh", "check-reproducible"),
    ];
    let before = listing(&repo());
    for (script, expect) in scripts {
        let cwd = tempfile::tempdir().unwrap();
        let out = Command::new("bash")
            .arg(repo().join(script))
            .arg("--help")
            .current_dir(cwd.path())
            .env("OUT", cwd.path().join("out-should-not-be-made"))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{script} --help: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(expect), "{script} --help:\n{stdout}");
        // Help text, not the script's code (an off-by-one line range printed `set -euo ...`).
        assert!(
            !stdout.contains("set -euo pipefail") && !stdout.contains("set -uo pipefail"),
            "{script} --help printed code:\n{stdout}"
        );
        assert!(
            listing(cwd.path()).is_empty(),
            "{script} --help left {:?} in its working directory",
            listing(cwd.path())
        );
    }
    assert_eq!(
        listing(&repo()),
        before,
        "a --help run created something at the top of the checkout (gpu-out/?)"
    );
}
