//! Determinism: the committed lock and Nix data are exactly what `lock --offline`
//! regenerates; running `lock` twice gives identical bytes; the embedded snapshot gives the
//! same files as the checkout.

mod common;

use common::{repo_root, run_in, snapshot, stderr, stdout};

#[test]
fn committed_files_pass_lock_offline_check() {
    let root = repo_root();
    let out = run_in(&root, &["lock", "--offline", "--check"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "drift in committed files:\n{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(
        stdout(&out).lines().all(|l| l.starts_with("unchanged")),
        "{}",
        stdout(&out)
    );
    let out = run_in(&root, &["render", "--check"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
}

#[test]
fn lock_twice_gives_identical_bytes() {
    let repo = common::temp_repo_with_committed_data();
    let r = repo.path().to_str().unwrap();
    let committed = snapshot(repo.path());
    let first = run_in(repo.path(), &["lock", "--offline", "--repo", r]);
    assert!(first.status.success(), "{}", stderr(&first));
    let once = snapshot(repo.path());
    assert_eq!(
        once, committed,
        "regenerating the committed files changes nothing"
    );
    let second = run_in(repo.path(), &["lock", "--offline", "--repo", r]);
    assert!(second.status.success());
    assert_eq!(snapshot(repo.path()), once);
}

/// `(inode, mtime)` of every file below `dir`.
fn identities(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u64, std::time::SystemTime)> {
    use std::os::unix::fs::MetadataExt;
    snapshot(dir)
        .into_iter()
        .filter(|(_, bytes)| bytes != b"<dir>")
        .map(|(rel, _)| {
            let m = std::fs::metadata(dir.join(&rel)).unwrap();
            (rel, m.ino(), m.modified().unwrap())
        })
        .collect()
}

/// `kernels/build.rs` watches the generated files, so a `lock` that rewrites unchanged files
/// makes the next cargo command rebuild for minutes: only files whose bytes change are
/// written, and those atomically (a new file renamed over the old one).
#[test]
fn lock_writes_only_the_files_whose_bytes_change() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let repo = common::temp_repo_with_committed_data();
    let r = repo.path().to_str().unwrap();
    let data = repo.path().join("pkgs/nvshmem");
    // An old mtime on every file, so that any rewrite would show in it.
    let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    for (rel, _, _) in identities(&data) {
        std::fs::File::options()
            .write(true)
            .open(data.join(rel))
            .unwrap()
            .set_modified(old)
            .unwrap();
    }
    let nix = data.join("releases.nix");
    let committed = std::fs::read(&nix).unwrap();
    std::fs::write(&nix, b"# hand-edited\n").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&nix)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let before = identities(&data);
    let out = run_in(repo.path(), &["lock", "--offline", "--repo", r]);
    assert!(out.status.success(), "{}", stderr(&out));
    let o = stdout(&out);
    let changed: Vec<&str> = o.lines().filter(|l| l.starts_with("changed")).collect();
    assert!(
        changed.len() == 1 && changed[0].contains("releases.nix"),
        "{o}"
    );
    let after = identities(&data);
    assert_eq!(after.len(), before.len(), "no files added or left behind");
    for ((rel, ino, mtime), (rel2, ino2, mtime2)) in before.iter().zip(&after) {
        assert_eq!(rel, rel2);
        if rel.as_path() == std::path::Path::new("releases.nix") {
            assert_ne!(
                ino, ino2,
                "releases.nix is replaced by a rename, not rewritten in place"
            );
            assert_ne!(mtime, mtime2);
        } else {
            assert_eq!(
                (ino, mtime),
                (ino2, mtime2),
                "{} was rewritten",
                rel.display()
            );
        }
    }
    assert_eq!(std::fs::read(&nix).unwrap(), committed);
    let m = std::fs::metadata(&nix).unwrap();
    assert_eq!(m.permissions().mode() & 0o777, 0o644);
    assert_eq!(m.nlink(), 1);
    // A second run changes nothing at all.
    let out = run_in(repo.path(), &["lock", "--offline", "--repo", r]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(identities(&data), after);
}

#[test]
fn check_reports_drift_and_writes_nothing() {
    let repo = common::temp_repo_with_committed_data();
    let lock = repo.path().join("pkgs/nvshmem/releases.json");
    let edited = std::fs::read_to_string(&lock).unwrap().replacen(
        "\"releaseDate\": \"2025-06-26\"",
        "\"releaseDate\": \"2025-06-27\"",
        1,
    );
    std::fs::write(&lock, &edited).unwrap();
    std::fs::remove_file(repo.path().join("pkgs/nvshmem/releases.nix")).unwrap();
    let before = snapshot(repo.path());
    let out = run_in(repo.path(), &["lock", "--offline", "--check"]);
    assert_eq!(out.status.code(), Some(1));
    let o = stdout(&out);
    assert!(
        o.contains("changed") && o.contains("releases.json (+1 -1 lines"),
        "{o}"
    );
    assert!(o.contains("new") && o.contains("releases.nix"), "{o}");
    assert!(
        stderr(&out).contains("drift: 2 file(s)"),
        "{}",
        stderr(&out)
    );
    assert_eq!(snapshot(repo.path()), before);
}

#[test]
fn embedded_snapshot_reproduces_the_checkout() {
    // A directory with no pkgs/nvshmem: inputs come from the binary itself.
    let empty = tempfile::tempdir().unwrap();
    let out = run_in(
        empty.path(),
        &[
            "lock",
            "--offline",
            "--repo",
            empty.path().to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let data = empty.path().join("pkgs/nvshmem");
    let committed = repo_root().join("pkgs/nvshmem");
    for rel in [
        "releases.json",
        "releases.nix",
        "manifests/pypi/nvidia-nvshmem-cu13.json",
        "manifests/nvidia/redistrib_3.3.9.json",
    ] {
        assert_eq!(
            std::fs::read(data.join(rel)).unwrap(),
            std::fs::read(committed.join(rel)).unwrap(),
            "{rel}"
        );
    }
    // Without a checkout, `lock` refuses to guess where to write.
    let out = run_in(tempfile::tempdir().unwrap().path(), &["lock", "--offline"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--repo DIR"), "{}", stderr(&out));
}

#[test]
fn releases_without_checkout_lists_every_version_and_gap() {
    let cwd = tempfile::tempdir().unwrap();
    let out = run_in(cwd.path(), &["releases", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["lock"].as_str().unwrap().contains("embedded"));
    let rels = v["releases"].as_array().unwrap();
    let versions: Vec<&str> = rels
        .iter()
        .map(|r| r["version"].as_str().unwrap())
        .collect();
    for want in [
        "3.3.9", "3.3.20", "3.3.24", "3.4.5", "3.5.19", "3.6.5", "3.7.0", "3.7.1", "3.7.2", "3.8.0",
    ] {
        assert!(versions.contains(&want), "{want} missing from {versions:?}");
    }
    let mut sorted = versions.clone();
    sorted.sort_by_key(|v| {
        v.split('.')
            .map(|p| p.parse::<u32>().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(versions, sorted, "numeric order");
    // Every system x CUDA cell of 3.3.20 and later has at least one pinned artifact with a hash.
    for r in rels.iter().filter(|r| r["version"] != "3.3.9") {
        for c in r["builds"].as_array().unwrap() {
            let arts = c["artifacts"].as_array().unwrap();
            assert!(
                !arts.is_empty()
                    && arts
                        .iter()
                        .all(|a| a["hash"].as_str().unwrap().starts_with("sha256-")),
                "{r}"
            );
        }
    }
    let gap = rels[0]["builds"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["system"] == "x86_64-linux" && c["cuda"] == 13)
        .unwrap();
    assert_eq!(gap["gap"], "none (first CUDA 13 build is 3.3.20)");
    let table = stdout(&run_in(cwd.path(), &["releases"]));
    assert!(table.contains("3.3.9 x86_64-linux cuda13: none (first CUDA 13 build is 3.3.20)"), "{table}");
    let line = "3.4.5 x86_64-linux cuda13 pypi   sha256-KQ8KLulMnzaHoCUC87kpmp+f6Cbm0Ch+4YSC541JW4A= 60412546 bytes";
    assert!(table.contains(line), "artifacts with hashes are listed by default: {table}");
    let brief = stdout(&run_in(cwd.path(), &["releases", "--brief"]));
    assert!(brief.contains("gaps:") && !brief.contains("artifacts:"), "{brief}");
}

/// The rendered Nix evaluates (with whatever Nix is installed) to exactly the lock's data.
#[test]
fn rendered_nix_evaluates_to_the_lock() {
    let root = repo_root();
    let nix = root.join("pkgs/nvshmem/releases.nix");
    let out = match std::process::Command::new("nix-instantiate")
        .args(["--eval", "--strict", "--json", "--expr"])
        .arg(format!("import {}", nix.display()))
        .output()
    {
        Ok(o) => o,
        Err(_) => {
            eprintln!("skipped: nix-instantiate is not installed (scripts/nix-checks.sh evaluates the file in CI)");
            return;
        }
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let evaluated: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lock: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("pkgs/nvshmem/releases.json")).unwrap())
            .unwrap();
    let mut expected = serde_json::Map::new();
    for r in lock["releases"].as_array().unwrap() {
        let mut rel = serde_json::Map::new();
        rel.insert("releaseDate".into(), r["releaseDate"].clone());
        for (system, builds) in r["systems"].as_object().unwrap() {
            let mut sys = serde_json::Map::new();
            for (cuda, b) in builds.as_object().unwrap() {
                let mut cell = serde_json::Map::new();
                for (source, a) in b.as_object().unwrap() {
                    let mut args = serde_json::json!({ "url": a["url"], "hash": a["hash"], "size": a["size"] });
                    if source == "pypi" {
                        args["filename"] = a["filename"].clone();
                    }
                    cell.insert(source.clone(), args);
                }
                sys.insert(cuda.clone(), cell.into());
            }
            rel.insert(system.clone(), sys.into());
        }
        expected.insert(r["version"].as_str().unwrap().to_string(), rel.into());
    }
    assert_eq!(evaluated, serde_json::Value::Object(expected));
}
