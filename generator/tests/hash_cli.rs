//! `deepep-nix hash`: flat file hashes in three formats, and NAR hashes of directories
//! checked against an independent NAR serialiser written here from the spec (Dolstra's
//! thesis, fig. 5.2) and, where Nix is installed, against `nix-hash`.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use sha2::{Digest, Sha256};

fn nar_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
    out.resize(out.len() + (8 - s.len() % 8) % 8, 0);
}

fn nar_node(out: &mut Vec<u8>, p: &Path) {
    let meta = std::fs::symlink_metadata(p).unwrap();
    nar_str(out, b"(");
    nar_str(out, b"type");
    if meta.file_type().is_symlink() {
        nar_str(out, b"symlink");
        nar_str(out, b"target");
        nar_str(
            out,
            std::fs::read_link(p)
                .unwrap()
                .as_os_str()
                .as_encoded_bytes(),
        );
    } else if meta.is_file() {
        nar_str(out, b"regular");
        if meta.permissions().mode() & 0o100 != 0 {
            nar_str(out, b"executable");
            nar_str(out, b"");
        }
        nar_str(out, b"contents");
        nar_str(out, &std::fs::read(p).unwrap());
    } else {
        nar_str(out, b"directory");
        let mut names: Vec<_> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort_by(|a, b| a.as_encoded_bytes().cmp(b.as_encoded_bytes()));
        for n in names {
            nar_str(out, b"entry");
            nar_str(out, b"(");
            nar_str(out, b"name");
            nar_str(out, n.as_encoded_bytes());
            nar_str(out, b"node");
            nar_node(out, &p.join(&n));
            nar_str(out, b")");
        }
    }
    nar_str(out, b")");
}

fn reference_nar_sha256(p: &Path) -> String {
    let mut out = Vec::new();
    nar_str(&mut out, b"nix-archive-1");
    nar_node(&mut out, p);
    hex::encode(Sha256::digest(&out))
}

fn sample_tree() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    std::fs::create_dir_all(d.join("lib/sub")).unwrap();
    std::fs::create_dir_all(d.join("empty")).unwrap();
    std::fs::create_dir_all(d.join("bin")).unwrap();
    std::fs::write(d.join("lib/libx.so.3"), vec![7u8; 1001]).unwrap();
    std::fs::write(d.join("lib/sub/a-longer-file-name.txt"), "hello\n").unwrap();
    std::fs::write(d.join("bin/run"), "#!/bin/sh\necho hi\n").unwrap();
    std::fs::set_permissions(d.join("bin/run"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("libx.so.3", d.join("lib/libx.so")).unwrap();
    std::fs::write(d.join("B-upper-sorts-first"), "").unwrap();
    t
}

fn hash_json(args: &[&str]) -> serde_json::Value {
    let cwd = tempfile::tempdir().unwrap();
    let mut a = vec!["hash", "--json"];
    a.extend_from_slice(args);
    let out = common::run_in(cwd.path(), &a);
    assert!(out.status.success(), "{}", common::stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn directory_nar_hash_matches_independent_serialiser() {
    let t = sample_tree();
    let v = hash_json(&[t.path().to_str().unwrap()]);
    assert_eq!(v[0]["kind"], "nar");
    assert_eq!(
        v[0]["hex"].as_str().unwrap(),
        reference_nar_sha256(t.path())
    );
    let sri = v[0]["sri"].as_str().unwrap();
    assert!(sri.starts_with("sha256-") && sri.len() == 51, "{sri}");
}

#[test]
fn directory_nar_hash_matches_nix_hash_when_nix_is_installed() {
    let t = sample_tree();
    let Some(out) = common::optional_tool(
        std::process::Command::new("nix-hash")
            .args(["--type", "sha256", "--base32"])
            .arg(t.path()),
        "the independent serialiser test still covers NAR hashing",
    ) else {
        return;
    };
    let v = hash_json(&[t.path().to_str().unwrap()]);
    assert_eq!(
        v[0]["nix32"].as_str().unwrap(),
        String::from_utf8_lossy(&out.stdout).trim()
    );
}

/// Each (field, value) of one entry of `hash --json`'s output.
fn assert_fields(entry: &serde_json::Value, want: &[(&str, &str)]) {
    for (field, value) in want {
        assert_eq!(entry[*field], *value, "field {field}");
    }
}

#[test]
fn file_hash_in_three_formats() {
    let t = tempfile::tempdir().unwrap();
    let f = t.path().join("abc");
    std::fs::write(&f, "abc").unwrap();
    let v = hash_json(&[f.to_str().unwrap()]);
    // SHA-256("abc") is the FIPS 180-2 test vector; its SRI form is base64 of those bytes.
    assert_fields(
        &v[0],
        &[
            (
                "hex",
                "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            ),
            ("sri", "sha256-ungWv48Bz+pBQUDeXa4iI7ADYaOWF3qctBD/YfIAFa0="),
        ],
    );
    assert_eq!(v[0]["size"], 3);
    // Round trip through --convert from the nix32 form gives the same digest.
    let back = hash_json(&["--convert", v[0]["nix32"].as_str().unwrap()]);
    assert_eq!(back[0]["hex"], v[0]["hex"]);
}

#[test]
fn convert_facts_vector_and_reject_garbage() {
    let v = hash_json(&[
        "--convert",
        "72a788ef5723a30d8882b193f0a513f454ecaee3ab5a225a5c43db79d433ef66",
    ]);
    assert_fields(
        &v[0],
        &[
            ("sri", "sha256-cqeI71cjow2IgrGT8KUT9FTsruOrWiJaXEPbedQz72Y="),
            (
                "nix32",
                "0rpg6ga7kns3bid24nmbwfpfqm7l2fjz14xiha40v8r3azpqi9vj",
            ),
        ],
    );
    let cwd = tempfile::tempdir().unwrap();
    let out = common::run_in(cwd.path(), &["hash", "--convert", "sha256-notbase64!"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a malformed argument is a usage error"
    );
    common::assert_stderr_contains(&out, "invalid SRI hash");
    let out = common::run_in(cwd.path(), &["hash", "/nonexistent/file"]);
    assert_eq!(out.status.code(), Some(1));
    common::assert_stderr_contains(&out, "/nonexistent/file");
}

/// Runs `deepep-nix hash path`, failing the test instead of hanging when it blocks.
fn hash_with_deadline(path: &Path) -> std::process::Output {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_deepep-nix"))
        .args(["hash", path.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > std::time::Duration::from_secs(10) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("`hash {}` blocked for 10 s", path.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn hash_refuses_fifos_and_devices_instead_of_blocking() {
    let t = tempfile::tempdir().unwrap();
    let fifo = t.path().join("fifo");
    let st = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(st.success());
    let link = t.path().join("link-to-fifo");
    std::os::unix::fs::symlink(&fifo, &link).unwrap();
    for (p, kind) in [
        (&fifo, "FIFO"),
        (&link, "FIFO"),
        (&Path::new("/dev/null").to_path_buf(), "character device"),
    ] {
        let out = hash_with_deadline(p);
        let err = common::assert_exit(&out, 2);
        assert!(err.contains(kind) && err.contains("regular file"), "{err}");
    }
}

#[test]
fn errors_print_each_cause_once() {
    let cwd = tempfile::tempdir().unwrap();
    let out = common::run_in(cwd.path(), &["hash", "/nonexistent/file"]);
    assert_eq!(out.status.code(), Some(1));
    let err = common::stderr(&out);
    assert!(err.contains("No such file or directory"), "{err}");
    common::assert_causes_once(&err);
}
