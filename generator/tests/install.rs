//! `install` / `env`: archives are built here (tar.xz in NVIDIA's redist layout, wheels in
//! PyPI's), including hostile ones (`..`, absolute paths, symlinks escaping the prefix, also
//! through a chain of links); hostile archives are refused and leave the prefix untouched.

mod common;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use deepep_nix::install::{install, Format};
use sha2::Digest;

const TOP: &str = "libnvshmem-linux-x86_64-3.4.5_cuda13-archive";

enum E<'a> {
    Dir(&'a str),
    File(&'a str, &'a [u8], u32),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
}

/// Builds a tar.xz with raw header names (no path sanitising by the tar crate, so hostile
/// names reach the installer exactly as written).
fn tar_xz(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_old();
        let (name, data, mode, kind, link): (&str, &[u8], u32, tar::EntryType, &str) = match e {
            E::Dir(n) => (n, b"", 0o755, tar::EntryType::Directory, ""),
            E::File(n, d, m) => (n, d, *m, tar::EntryType::Regular, ""),
            E::Symlink(n, t) => (n, b"", 0o777, tar::EntryType::Symlink, t),
            E::Hardlink(n, t) => (n, b"", 0o644, tar::EntryType::Link, t),
        };
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        h.set_entry_type(kind);
        h.set_cksum();
        b.append(&h, data).unwrap();
    }
    let tar = b.into_inner().unwrap();
    let mut xz = xz2::write::XzEncoder::new(Vec::new(), 1);
    xz.write_all(&tar).unwrap();
    xz.finish().unwrap()
}

fn good_tar() -> Vec<u8> {
    let top = |p: &str| format!("{TOP}/{p}");
    let (bin, inc, so, so3, dev, hard) = (
        top("bin/nvshmem-info"),
        top("include/nvshmem.h"),
        top("lib/libnvshmem_host.so.3.4.5"),
        top("lib/libnvshmem_host.so.3"),
        top("lib/libnvshmem_device.a"),
        top("lib/libnvshmem_device_copy.a"),
    );
    tar_xz(&[
        E::Dir(&format!("{TOP}/")),
        E::Dir(&top("bin/")),
        E::File(&bin, b"#!/bin/sh\necho nvshmem\n", 0o755),
        E::File(&inc, b"#define NVSHMEM 1\n", 0o644),
        E::File(&so, b"ELF host library", 0o644),
        E::Symlink(&so3, "libnvshmem_host.so.3.4.5"),
        E::File(&dev, b"device archive", 0o644),
        E::Hardlink(&hard, &dev),
    ])
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Asserts that `prefix/rel` is a symlink pointing at `target`.
fn assert_link(prefix: &Path, rel: &str, target: &str) {
    assert_eq!(
        std::fs::read_link(prefix.join(rel)).unwrap().to_str(),
        Some(target),
        "{rel}"
    );
}

/// Asserts that `prefix/rel` (followed through links) holds exactly `content`.
fn assert_file(prefix: &Path, rel: &str, content: &[u8]) {
    assert_eq!(std::fs::read(prefix.join(rel)).unwrap(), content, "{rel}");
}

#[test]
fn tar_xz_installs_with_top_dir_stripped_links_and_modes() {
    let t = tempfile::tempdir().unwrap();
    let archive = write(t.path(), "a.tar.xz", &good_tar());
    let prefix = t.path().join("opt/nvshmem");
    let got = install(&archive, Format::TarXz, &prefix, false).unwrap();
    assert_eq!(got, prefix);
    assert_file(&prefix, "include/nvshmem.h", b"#define NVSHMEM 1\n");
    assert_eq!(
        std::fs::metadata(prefix.join("bin/nvshmem-info"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
    assert_link(
        &prefix,
        "lib/libnvshmem_host.so.3",
        "libnvshmem_host.so.3.4.5",
    );
    assert_link(&prefix, "lib/libnvshmem_host.so", "libnvshmem_host.so.3");
    assert_file(&prefix, "lib/libnvshmem_host.so", b"ELF host library");
    assert_file(&prefix, "lib/libnvshmem_device_copy.a", b"device archive");
    assert!(!prefix.join(TOP).exists());
    let leftovers: Vec<_> = std::fs::read_dir(prefix.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers,
        vec![std::ffi::OsString::from("nvshmem")],
        "no staging directories left"
    );
}

/// Installs a hostile archive into a prefix that already holds a previous install, with
/// `replace` set: the error must name the entry and the prefix's parent must be unchanged.
fn assert_refused(bytes: Vec<u8>, format: Format, expect: &str) {
    let t = tempfile::tempdir().unwrap();
    let archive = write(
        t.path(),
        if format == Format::TarXz {
            "x.tar.xz"
        } else {
            "x.whl"
        },
        &bytes,
    );
    let root = t.path().join("root");
    let prefix = root.join("nvshmem");
    // An earlier install (it has lib/libnvshmem_host.so.3), so --replace applies to it.
    std::fs::create_dir_all(prefix.join("lib")).unwrap();
    std::fs::write(prefix.join("lib/libnvshmem_host.so.3"), "old host library").unwrap();
    std::fs::write(prefix.join("lib/previous"), "keep me").unwrap();
    let before = common::snapshot(&root);
    let err = install(&archive, format, &prefix, true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("refusing archive entry") && err.contains(expect),
        "{expect}: {err}"
    );
    assert_eq!(
        common::snapshot(&root),
        before,
        "prefix and its parent untouched"
    );
    // And into a fresh prefix: it is not created.
    let fresh = root.join("fresh");
    install(&archive, format, &fresh, false).unwrap_err();
    assert!(!fresh.exists());
    assert_eq!(common::snapshot(&root), before);
}

#[test]
fn tar_with_parent_dir_entry_is_refused() {
    let bytes = tar_xz(&[
        E::Dir(&format!("{TOP}/")),
        E::File(&format!("{TOP}/../../evil"), b"x", 0o644),
    ]);
    assert_refused(bytes, Format::TarXz, "contains `..`");
}

#[test]
fn tar_with_absolute_entry_is_refused() {
    assert_refused(
        tar_xz(&[E::File("/tmp/evil", b"x", 0o644)]),
        Format::TarXz,
        "absolute path",
    );
}

#[test]
fn tar_with_escaping_symlink_is_refused() {
    let bytes = tar_xz(&[
        E::File(&format!("{TOP}/lib/libnvshmem_host.so.3"), b"ELF", 0o644),
        E::Symlink(&format!("{TOP}/lib/evil"), "../../etc/passwd"),
    ]);
    assert_refused(bytes, Format::TarXz, "escapes the prefix");
    let bytes = tar_xz(&[
        E::File(&format!("{TOP}/lib/libnvshmem_host.so.3"), b"ELF", 0o644),
        E::Symlink(&format!("{TOP}/lib/abs"), "/etc/passwd"),
    ]);
    assert_refused(bytes, Format::TarXz, "is absolute");
}

#[test]
fn tar_with_symlink_chain_escaping_is_refused() {
    // a/b -> .. stays inside on its own; t -> a/b/../x climbs above the prefix through it.
    let bytes = tar_xz(&[
        E::File(&format!("{TOP}/lib/libnvshmem_host.so.3"), b"ELF", 0o644),
        E::Dir(&format!("{TOP}/a/")),
        E::Symlink(&format!("{TOP}/a/b"), ".."),
        E::Symlink(&format!("{TOP}/t"), "a/b/../x"),
    ]);
    assert_refused(bytes, Format::TarXz, "escapes the prefix");
}

#[test]
fn tar_with_entry_outside_top_dir_or_escaping_hardlink_is_refused() {
    let bytes = tar_xz(&[
        E::Dir(&format!("{TOP}/")),
        E::File("elsewhere/file", b"x", 0o644),
    ]);
    assert_refused(
        bytes,
        Format::TarXz,
        "outside the archive's top-level directory",
    );
    let bytes = tar_xz(&[
        E::File(&format!("{TOP}/lib/libnvshmem_host.so.3"), b"ELF", 0o644),
        E::Hardlink(&format!("{TOP}/lib/h"), "../../etc/passwd"),
    ]);
    assert_refused(bytes, Format::TarXz, "`..`");
}

fn wheel(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut z = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .unix_permissions(0o644);
    for (name, data) in entries {
        z.start_file(*name, opts).unwrap();
        z.write_all(data).unwrap();
    }
    z.finish().unwrap().into_inner()
}

fn good_wheel() -> Vec<u8> {
    wheel(&[
        ("nvidia/__init__.py", b""),
        ("nvidia/nvshmem/include/nvshmem.h", b"#define NVSHMEM 1\n"),
        (
            "nvidia/nvshmem/lib/libnvshmem_host.so.3",
            b"ELF host library",
        ),
        ("nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3", b"ELF uid"),
        ("nvidia_nvshmem_cu13-3.4.5.dist-info/RECORD", b"..."),
    ])
}

#[test]
fn wheel_installs_nvshmem_subtree_and_adds_unversioned_link() {
    let t = tempfile::tempdir().unwrap();
    let archive = write(t.path(), "w.whl", &good_wheel());
    let prefix = t.path().join("p");
    std::fs::create_dir(&prefix).unwrap(); // an existing empty directory is fine
    install(&archive, Format::Wheel, &prefix, false).unwrap();
    let mut top: Vec<String> = std::fs::read_dir(&prefix)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    top.sort();
    assert_eq!(top, ["include", "lib"]);
    assert_link(&prefix, "lib/libnvshmem_host.so", "libnvshmem_host.so.3");
    assert_file(&prefix, "lib/nvshmem_bootstrap_uid.so.3", b"ELF uid");
}

#[test]
fn hostile_wheels_are_refused() {
    assert_refused(
        wheel(&[
            ("nvidia/nvshmem/lib/libnvshmem_host.so.3", b"E"),
            ("nvidia/nvshmem/../../../evil", b"x"),
        ]),
        Format::Wheel,
        "`..`",
    );
    assert_refused(
        wheel(&[("/etc/evil", b"x")]),
        Format::Wheel,
        "absolute path",
    );
}

#[test]
fn archive_without_host_library_is_rejected() {
    let t = tempfile::tempdir().unwrap();
    let archive = write(
        t.path(),
        "w.whl",
        &wheel(&[("nvidia/nvshmem/include/nvshmem.h", b"x")]),
    );
    let prefix = t.path().join("p");
    let err = install(&archive, Format::Wheel, &prefix, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lib/libnvshmem_host.so.3") && err.contains("not an NVSHMEM archive"),
        "{err}"
    );
    assert!(!prefix.exists());
}

// ---- through the CLI, verified against a lock -----------------------------------------------

/// The PyPI name of the 3.4.5 CUDA 13 x86_64 wheel.
const WHEEL_X86: &str =
    "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
/// The PyPI name of the 3.4.5 CUDA 13 aarch64 wheel.
const WHEEL_ARM: &str = "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux_2_28_aarch64.whl";

/// A repo whose lock pins `tarball` (NVIDIA, x86_64 CUDA 13) and `whl` (PyPI) for 3.4.5.
fn repo_pinning(tarball: &[u8], whl: &[u8]) -> tempfile::TempDir {
    repo_pinning_with(
        tarball,
        &[(WHEEL_X86, whl)],
        "https://developer.download.nvidia.com/compute/nvshmem/redist/",
        "https://files.example",
    )
}

/// A repo whose lock pins `tarball` (NVIDIA x86_64 CUDA 13, below `nvidia_url`) and the
/// CUDA 13 `wheels` (PyPI, named as given, below `wheel_base`), all of release 3.4.5.
fn repo_pinning_with(
    tarball: &[u8],
    wheels: &[(&str, &[u8])],
    nvidia_url: &str,
    wheel_base: &str,
) -> tempfile::TempDir {
    let repo = tempfile::tempdir().unwrap();
    let m = repo.path().join("pkgs/nvshmem/manifests");
    std::fs::create_dir_all(m.join("nvidia")).unwrap();
    std::fs::create_dir_all(m.join("pypi")).unwrap();
    let nv = serde_json::json!({ "release_date": "2025-09-06", "release_label": "3.4.5", "release_product": "nvshmem",
        "libnvshmem": { "version": "3.4.5", "cuda_variant": ["13"], "linux-x86_64": { "cuda13": {
            "relative_path": format!("libnvshmem/linux-x86_64/{TOP}.tar.xz"),
            "sha256": hex::encode(sha2::Sha256::digest(tarball)), "size": tarball.len().to_string() } } } });
    std::fs::write(
        m.join("nvidia/redistrib_3.4.5.json"),
        serde_json::to_vec_pretty(&nv).unwrap(),
    )
    .unwrap();
    let files: Vec<serde_json::Value> = wheels.iter().map(|(name, whl)| serde_json::json!({
        "digests": { "sha256": hex::encode(sha2::Sha256::digest(whl)) }, "filename": name, "packagetype": "bdist_wheel",
        "size": whl.len(), "url": format!("{wheel_base}/{name}"), "upload_time_iso_8601": "2025-09-06T00:00:00Z" })).collect();
    let py = serde_json::json!({ "info": { "name": "nvidia-nvshmem-cu13" }, "releases": { "3.4.5": files } });
    std::fs::write(
        m.join("pypi/nvidia-nvshmem-cu13.json"),
        serde_json::to_vec_pretty(&py).unwrap(),
    )
    .unwrap();
    let out = common::run_in(
        repo.path(),
        &["lock", "--offline", "--nvidia-url", nvidia_url],
    );
    assert!(out.status.success(), "{}", common::stderr(&out));
    repo
}

/// A lock pinning `good_tar()` and `good_wheel()`, and a directory of local files holding the
/// wheel under its PyPI name.
struct WheelFixture {
    tarball: Vec<u8>,
    whl: Vec<u8>,
    repo: tempfile::TempDir,
    files: tempfile::TempDir,
    /// `files`/WHEEL_X86.
    w: PathBuf,
}

fn wheel_fixture() -> WheelFixture {
    let (tarball, whl) = (good_tar(), good_wheel());
    let repo = repo_pinning(&tarball, &whl);
    let files = tempfile::tempdir().unwrap();
    let w = write(files.path(), WHEEL_X86, &whl);
    WheelFixture {
        tarball,
        whl,
        repo,
        files,
        w,
    }
}

/// Runs `install` in `repo` with `args` and the pinned release selection.
fn run_install(repo: &Path, args: &[&str]) -> std::process::Output {
    let mut all = vec!["install"];
    all.extend_from_slice(args);
    all.extend_from_slice(common::SELECT_3_4_5);
    common::run_in(repo, &all)
}

#[test]
fn cli_install_from_local_files_prints_exports_and_env_repeats_them() {
    let WheelFixture { tarball, repo, files, w, .. } = wheel_fixture();
    let t = write(files.path(), &format!("{TOP}.tar.xz"), &tarball);
    let prefix = files.path().join("wheel-prefix");
    let mut args = vec!["--source", "pypi"];
    args.extend(common::file_and_prefix(&w, &prefix));
    let out = run_install(repo.path(), &args);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let exports = common::stdout(&out);
    assert_eq!(
        exports,
        format!(
            "export NVSHMEM_DIR='{}'\nexport LD_LIBRARY_PATH=\"$NVSHMEM_DIR/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\"\nexport PATH=\"$NVSHMEM_DIR/bin:$PATH\"\n",
            prefix.display()
        )
    );
    let env = common::run_in(repo.path(), &["env", "--prefix", prefix.to_str().unwrap()]);
    assert_eq!(common::stdout(&env), exports);
    let fish = common::run_in(
        repo.path(),
        &[
            "env",
            "--prefix",
            prefix.to_str().unwrap(),
            "--shell",
            "fish",
        ],
    );
    assert!(
        common::stdout(&fish).starts_with(&format!("set -gx NVSHMEM_DIR '{}'\n", prefix.display()))
    );
    // fish users are told to pipe into `source`, and why not `eval (...)`; the hint is on
    // stderr, so `| source` gets only the three lines.
    let hint = common::stderr(&fish);
    assert!(
        hint.contains(&format!(
            "`deepep-nix env --prefix '{}' --shell fish | source`",
            prefix.display()
        )) && hint.contains("not with `eval (...)`"),
        "{hint}"
    );
    assert_eq!(common::stdout(&fish).lines().count(), 3);
    // bash, zsh and posix are the sh syntax.
    for name in ["bash", "zsh", "posix"] {
        let out = common::run_in(
            repo.path(),
            &["env", "--prefix", prefix.to_str().unwrap(), "--shell", name],
        );
        assert!(out.status.success(), "{name}: {}", common::stderr(&out));
        assert_eq!(common::stdout(&out), exports, "--shell {name}");
    }
    // A directory inside the install is not taken for a prefix: the install is named.
    for inside in ["lib", "include"] {
        let out = common::run_in(
            repo.path(),
            &["env", "--prefix", prefix.join(inside).to_str().unwrap()],
        );
        assert_eq!(out.status.code(), Some(2));
        let err = common::stderr(&out);
        assert!(
            err.contains(&format!(
                "is the {inside}/ directory of the NVSHMEM install in {}; --prefix is the install itself: `deepep-nix env --prefix '{}'`",
                prefix.display(),
                prefix.display()
            )) && !err.contains("deepep-nix install"),
            "{err}"
        );
    }
    // The exports work in a real shell.
    let sh = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{exports}\nprintf '%s' \"$LD_LIBRARY_PATH\""))
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&sh.stdout),
        format!("{}/lib", prefix.display())
    );

    // The same install again: verified against the archive, nothing changed, the exports
    // printed as before.
    let before = common::snapshot(&prefix);
    let again = run_install(repo.path(), &args);
    assert!(again.status.success(), "{}", common::stderr(&again));
    assert!(
        common::stderr(&again).contains(&format!(
            "already installed: {} holds exactly what {WHEEL_X86} installs (",
            prefix.display()
        )) && common::stderr(&again).contains("nothing was changed"),
        "{}",
        common::stderr(&again)
    );
    assert_eq!(common::stdout(&again), exports);
    assert_eq!(common::snapshot(&prefix), before);
    // Another archive over that install needs --replace, and the message says it differs.
    let other = run_install(
        repo.path(),
        &["--file", t.to_str().unwrap(), "--prefix", prefix.to_str().unwrap()],
    );
    assert_eq!(other.status.code(), Some(2));
    let err = common::stderr(&other);
    assert!(
        err.contains("holds another NVSHMEM install than this archive (") && err.contains("--replace"),
        "{err}"
    );
    assert_eq!(common::snapshot(&prefix), before);

    // The NVIDIA tarball is the default source when the lock pins it.
    let tprefix = files.path().join("tar-prefix");
    let out = run_install(
        repo.path(),
        &common::file_and_prefix(&t, &tprefix),
    );
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert!(tprefix.join("bin/nvshmem-info").is_file());

    // env on a directory that is not an install explains the fix.
    let bad = common::run_in(
        repo.path(),
        &["env", "--prefix", files.path().to_str().unwrap()],
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(common::stderr(&bad).contains("deepep-nix install --version 3.4.5 --cuda 13 --prefix"));
}

/// `env` on a directory without an install suggests an `install` command with --version and
/// --cuda (the flake's default release, as pkgs/nvshmem/lib.nix says), which then works.
#[test]
fn env_suggests_an_install_command_that_works() {
    let lib_nix =
        std::fs::read_to_string(common::repo_root().join("pkgs/nvshmem/lib.nix")).unwrap();
    let (v, cuda) = deepep_nix::install::DEFAULT_RELEASE;
    assert!(
        lib_nix.contains(&format!("defaultVersion = \"{v}\";"))
            && lib_nix.contains(&format!("defaultCudaMajor = \"{cuda}\";")),
        "DEFAULT_RELEASE {v}/{cuda} differs from pkgs/nvshmem/lib.nix"
    );
    let repo = repo_pinning(&good_tar(), &good_wheel());
    let files = tempfile::tempdir().unwrap();
    let tarball = write(files.path(), &format!("{TOP}.tar.xz"), &good_tar());
    let prefix = files.path().join("empty dir");
    std::fs::create_dir(&prefix).unwrap();
    let out = common::run_in(repo.path(), &["env", "--prefix", prefix.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = common::stderr(&out);
    let cmd = err
        .split('`')
        .nth(1)
        .unwrap_or_else(|| panic!("no command in: {err}"));
    let quoted = format!("'{}'", prefix.display());
    assert_eq!(
        cmd,
        format!("deepep-nix install --version {v} --cuda {cuda} --prefix {quoted}"),
        "{err}"
    );
    // Run as the shell would (the prefix is one quoted word), with the archive given locally.
    let mut args: Vec<String> = cmd
        .trim_end_matches(&quoted)
        .split_whitespace()
        .skip(1)
        .map(String::from)
        .collect();
    args.push(prefix.to_str().unwrap().to_string());
    args.extend(["--file".to_string(), tarball.to_str().unwrap().to_string()]);
    args.extend(x86_unless_host().iter().map(|s| s.to_string()));
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = common::run_in(repo.path(), &words);
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert_file(&prefix, "include/nvshmem.h", b"#define NVSHMEM 1\n");
}

#[test]
fn cli_install_refuses_a_file_that_does_not_match_the_lock() {
    let (tarball, whl) = (good_tar(), good_wheel());
    let repo = repo_pinning(&tarball, &whl);
    let files = tempfile::tempdir().unwrap();
    let mut tampered = whl.clone();
    let n = tampered.len();
    tampered[n - 30] ^= 1;
    let w = write(files.path(), "x.whl", &tampered);
    let prefix = files.path().join("p");
    let mut args = vec!["--source", "pypi"];
    args.extend(common::file_and_prefix(&w, &prefix));
    let out = run_install(repo.path(), &args);
    assert_eq!(out.status.code(), Some(2));
    common::assert_stderr_contains(&out, "sha256 mismatch");
    assert!(!prefix.exists());
    assert!(w.exists(), "the user's file is not deleted");
    // A CUDA major the release does not have: usage error naming where to look.
    let out = common::run_in(
        repo.path(),
        &[
            "install",
            "--prefix",
            prefix.to_str().unwrap(),
            "--version",
            "3.4.5",
            "--cuda",
            "12",
            "--system",
            "x86_64-linux",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    common::assert_stderr_contains(&out, "deepep-nix releases");
}

// ---- hostile use of `install` (issue 12): refused with the fix, nothing changed --------------

/// Bytes that xz cannot shrink (so a cut lands inside a file's data).
fn noise(n: usize) -> Vec<u8> {
    let mut x: u32 = 0x1234_5678;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// A tar.xz cut off at two thirds, inside the host library's (incompressible) bytes.
fn truncated_tar() -> Vec<u8> {
    let mut tarball = tar_xz(&[
        E::Dir(&format!("{TOP}/")),
        E::File(
            &format!("{TOP}/lib/libnvshmem_host.so.3"),
            &noise(300_000),
            0o644,
        ),
    ]);
    tarball.truncate(tarball.len() * 2 / 3);
    tarball
}

/// Runs `install --file archive --prefix prefix extra...` against a lock pinning `tarball`.
fn install_pinned(
    tarball: &[u8],
    dir: &Path,
    prefix: &Path,
    extra: &[&str],
) -> std::process::Output {
    let repo = repo_pinning(tarball, &good_wheel());
    let t = write(dir, &format!("{TOP}.tar.xz"), tarball);
    let mut args = common::file_and_prefix(&t, prefix).to_vec();
    args.extend_from_slice(extra);
    run_install(repo.path(), &args)
}

#[test]
fn replace_refuses_a_directory_that_is_not_an_earlier_install() {
    let files = tempfile::tempdir().unwrap();
    let work = files.path().join("work");
    std::fs::create_dir_all(work.join("d")).unwrap();
    std::fs::write(work.join("d/important.txt"), "keep").unwrap();
    // An install with a foreign file next to it is not replaced either.
    std::fs::create_dir_all(work.join("mixed/lib")).unwrap();
    std::fs::write(work.join("mixed/lib/libnvshmem_host.so.3"), "old").unwrap();
    std::fs::write(work.join("mixed/notes.txt"), "mine").unwrap();
    let before = common::snapshot(&work);
    for (dir, expect) in [("d", "lib/libnvshmem_host.so.3"), ("mixed", "notes.txt")] {
        let out = install_pinned(&good_tar(), files.path(), &work.join(dir), &["--replace"]);
        let err = common::assert_exit(&out, 2);
        common::assert_contains_all(&err, &["not an earlier NVSHMEM install", expect, "remove"]);
        assert_eq!(common::snapshot(&work), before, "nothing changed");
    }
}

#[test]
fn replace_swaps_an_earlier_install_and_says_what_it_removes() {
    let files = tempfile::tempdir().unwrap();
    let prefix = files.path().join("p");
    std::fs::create_dir_all(prefix.join("lib")).unwrap();
    std::fs::create_dir_all(prefix.join("include")).unwrap();
    std::fs::write(prefix.join("lib/libnvshmem_host.so.3"), "old").unwrap();
    std::fs::write(prefix.join("include/old.h"), "old").unwrap();
    std::fs::write(prefix.join("License.txt"), "old").unwrap();
    let out = install_pinned(&good_tar(), files.path(), &prefix, &["--replace"]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let err = common::stderr(&out);
    common::assert_contains_all(
        &err,
        &[
            "removed the earlier install",
            "include/",
            "lib/",
            "License.txt",
            "3 files",
        ],
    );
    assert!(prefix.join("bin/nvshmem-info").is_file());
    assert!(!prefix.join("include/old.h").exists());
}

/// Installs `tarball` (pinned) into `work/<sub>` of a fresh folder, expecting exit 1; returns
/// the folder (keep it alive), `work` and stderr.
fn failing_install_in_work(tarball: &[u8], sub: &str) -> (tempfile::TempDir, PathBuf, String) {
    let files = tempfile::tempdir().unwrap();
    let work = files.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let out = install_pinned(tarball, files.path(), &work.join(sub), &[]);
    common::assert_exit(&out, 1);
    (files, work, common::stderr(&out))
}

#[test]
fn failed_install_into_a_new_nested_prefix_leaves_no_directories() {
    let (_files, work, err) = failing_install_in_work(&truncated_tar(), "new1/new2/pfx");
    // The truncated archive is named, not the temporary staging directory, and each cause
    // is printed once.
    assert!(
        err.contains(&format!("{TOP}.tar.xz")) && !err.contains(".deepep-nix-install"),
        "{err}"
    );
    common::assert_causes_once(&err);
    eprintln!("{err}");
    assert_eq!(common::snapshot(&work), vec![], "new1/new2 removed again");
}

#[test]
fn a_regular_file_as_prefix_is_called_a_file() {
    let files = tempfile::tempdir().unwrap();
    let f = files.path().join("f");
    std::fs::write(&f, "keep").unwrap();
    for extra in [&[][..], &["--replace"][..]] {
        let out = install_pinned(&good_tar(), files.path(), &f, extra);
        assert_eq!(out.status.code(), Some(2));
        let err = common::stderr(&out);
        assert!(
            err.contains("is a file, not a directory") && !err.contains("not empty"),
            "{err}"
        );
        assert_eq!(std::fs::read(&f).unwrap(), b"keep");
    }
    // A prefix below that file: named, not a raw "Not a directory (os error 20)".
    for below in ["pfx", "new/pfx"] {
        let out = install_pinned(&good_tar(), files.path(), &f.join(below), &[]);
        assert_eq!(out.status.code(), Some(2));
        let err = common::stderr(&out);
        assert!(
            err.contains(&format!(
                "--prefix {} is below {}, which is a file, not a directory",
                f.join(below).display(),
                f.display()
            )) && !err.contains("os error"),
            "{err}"
        );
        assert_eq!(std::fs::read(&f).unwrap(), b"keep");
    }
}

#[test]
fn unpacked_size_is_bounded_and_the_flag_raises_the_bound() {
    let zeros = vec![0u8; 24 << 20];
    let bomb = tar_xz(&[
        E::Dir(&format!("{TOP}/")),
        E::File(&format!("{TOP}/lib/libnvshmem_host.so.3"), b"ELF", 0o644),
        E::File(&format!("{TOP}/lib/zeros"), &zeros, 0o644),
    ]);
    assert!(bomb.len() < 64 << 10, "{} bytes", bomb.len());
    let (files, work, err) = failing_install_in_work(&bomb, "p");
    let prefix = work.join("p");
    assert!(
        err.contains("unpacks to more than") && err.contains("--max-unpacked-size"),
        "{err}"
    );
    assert_eq!(common::snapshot(&work), vec![]);
    let out = install_pinned(
        &bomb,
        files.path(),
        &prefix,
        &["--max-unpacked-size", "32M"],
    );
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert_eq!(
        std::fs::metadata(prefix.join("lib/zeros")).unwrap().len(),
        24 << 20
    );
}

// ---- install --file: the file name says which artifact it is (issue 20) ---------------------

/// Runs `install` in `repo` with exactly `args` (no release selection added).
fn run_bare(repo: &Path, args: &[&str]) -> std::process::Output {
    let mut all = vec!["install"];
    all.extend_from_slice(args);
    common::run_in(repo, &all)
}

/// `--system x86_64-linux` where this machine is another system (the fixtures pin x86_64
/// builds, and a build for another system than the host's needs the flag).
fn x86_unless_host() -> Vec<&'static str> {
    if std::env::consts::ARCH == "x86_64" {
        vec![]
    } else {
        vec!["--system", "x86_64-linux"]
    }
}

#[test]
fn install_file_takes_release_cuda_and_source_from_its_name() {
    let WheelFixture {
        tarball,
        whl,
        repo,
        files,
        w,
    } = wheel_fixture();
    // Issue 20: --version and --cuda without --source compared the wheel with the
    // tarball's hash ("sha256 mismatch"); the wheel's name says it is the PyPI artifact.
    let p1 = files.path().join("p1");
    let mut args = common::SELECT_3_4_5.to_vec();
    args.extend(common::file_and_prefix(&w, &p1));
    let out = run_bare(repo.path(), &args);
    assert!(out.status.success(), "{}", common::stderr(&out));
    common::assert_stderr_contains(&out, "3.4.5 x86_64-linux cuda13 pypi");
    assert_file(&p1, "lib/libnvshmem_host.so.3", b"ELF host library");
    // The file alone: it used to ask for --version, then for --cuda.
    for (name, bytes, probe) in [
        (
            WHEEL_X86.to_string(),
            &whl,
            "lib/nvshmem_bootstrap_uid.so.3",
        ),
        (format!("{TOP}.tar.xz"), &tarball, "bin/nvshmem-info"),
    ] {
        let f = write(files.path(), &name, bytes);
        let p = files.path().join(format!("p-{name}"));
        let mut args = common::file_and_prefix(&f, &p).to_vec();
        args.extend(x86_unless_host());
        let out = run_bare(repo.path(), &args);
        assert!(out.status.success(), "{name}: {}", common::stderr(&out));
        assert!(p.join(probe).is_file(), "{name}");
    }
}

#[test]
fn flags_that_contradict_the_file_name_are_named_with_it() {
    let WheelFixture { repo, files, w, .. } = wheel_fixture();
    let prefix = files.path().join("p");
    let tar_name = format!("{TOP}.tar.xz");
    for (flags, expect, names) in [
        (&["--cuda", "12"][..], "but --cuda 12 says otherwise", None),
        (
            &["--source", "nvidia"][..],
            "but --source nvidia says otherwise",
            Some(tar_name.as_str()),
        ),
        (
            &["--version", "3.4.6", "--system", "aarch64-linux"][..],
            "but --version 3.4.6 --system aarch64-linux say otherwise",
            None,
        ),
    ] {
        let mut args = flags.to_vec();
        args.extend(common::file_and_prefix(&w, &prefix));
        let out = run_bare(repo.path(), &args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{flags:?}: {}",
            common::stderr(&out)
        );
        let err = common::stderr(&out);
        assert!(
            err.contains(&format!(
                "--file {WHEEL_X86} is the lock's 3.4.5 x86_64-linux cuda13 pypi artifact"
            )) && err.contains(expect)
                && err.contains("leave"),
            "{flags:?}: {err}"
        );
        if let Some(other) = names {
            assert!(
                err.contains(&format!("or pass the file it names: {other}")),
                "{err}"
            );
        }
        assert!(!prefix.exists());
    }
    // verify --file applies the same rule (it used to ignore the name once a flag was given).
    let out = common::run_in(
        repo.path(),
        &["verify", "--cuda", "12", "--file", w.to_str().unwrap()],
    );
    common::assert_exit(&out, 2);
    common::assert_stderr_contains(&out, "cuda13 pypi artifact, but --cuda 12");
}

#[test]
fn a_file_name_the_lock_lacks_is_refused_with_the_nearest_entries() {
    let (tarball, whl) = (good_tar(), good_wheel());
    let repo = repo_pinning(&tarball, &whl);
    let files = tempfile::tempdir().unwrap();
    let prefix = files.path().join("p");
    let p = prefix.to_str().unwrap();
    let nearest = format!("nearest locked artifacts: 3.4.5 x86_64-linux cuda13 pypi ({WHEEL_X86})");
    // A release the lock does not have: the nearest locked release's wheel is listed.
    // The same release for another CUDA major: that release's wheel is listed.
    let refresh =
        "refresh the lock with `deepep-nix lock` (3.4.6 is newer than its newest release, 3.4.5)";
    for (name, says, newer) in [
        (
            WHEEL_X86.replace("3.4.5", "3.4.6"),
            "3.4.6 x86_64-linux cuda13 pypi",
            true,
        ),
        (
            WHEEL_X86.replace("cu13", "cu12"),
            "3.4.5 x86_64-linux cuda12 pypi",
            false,
        ),
    ] {
        let f = write(files.path(), &name, &whl);
        let out = run_bare(repo.path(), &["--file", f.to_str().unwrap(), "--prefix", p]);
        let err = common::assert_exit(&out, 2);
        assert!(
            err.contains(&format!(
                "--file {name}: the lock has no artifact of this name (the name says {says})"
            )) && err.contains(&nearest)
                && err.contains(refresh) == newer,
            "{err}"
        );
    }
    // A renamed copy says nothing: both missing flags are named in one message.
    let copy = write(files.path(), "copy.whl", &whl);
    let c = copy.to_str().unwrap();
    let out = run_bare(repo.path(), &["--file", c, "--prefix", p]);
    assert_eq!(out.status.code(), Some(2));
    let err = common::stderr(&out);
    assert!(
        err.contains("--version V and --cuda 12|13 are required") && err.contains("original name"),
        "{err}"
    );
    // Its extension says it is a wheel: --source nvidia contradicts it.
    let mut args = common::SELECT_3_4_5.to_vec();
    args.extend_from_slice(&["--source", "nvidia", "--file", c, "--prefix", p]);
    let out = run_bare(repo.path(), &args);
    assert_eq!(out.status.code(), Some(2));
    let err = common::stderr(&out);
    assert!(
        err.contains("--source nvidia, but --file copy.whl is a wheel (.whl)"),
        "{err}"
    );
    assert!(!prefix.exists());
    // Without --source it is checked against the wheel's pin (it used to be the tarball's).
    let mut args = common::SELECT_3_4_5.to_vec();
    args.extend_from_slice(&["--file", c, "--prefix", p]);
    let out = run_bare(repo.path(), &args);
    assert!(out.status.success(), "{}", common::stderr(&out));
    // No file and no selection: one message names both flags.
    let other = files.path().join("q");
    let out = run_bare(repo.path(), &["--prefix", other.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    common::assert_stderr_contains(&out, "--version V and --cuda 12|13 are required");
}

#[test]
fn a_build_for_another_system_than_the_hosts_needs_system() {
    let x86 = good_wheel();
    let arm = wheel(&[
        (
            "nvidia/nvshmem/lib/libnvshmem_host.so.3",
            b"aarch64 ELF host library",
        ),
        ("nvidia/nvshmem/include/nvshmem.h", b"#define NVSHMEM 1\n"),
    ]);
    let (foreign, foreign_sys, host_name, host_sys) = match std::env::consts::ARCH {
        "x86_64" => (
            (WHEEL_ARM, &arm),
            "aarch64-linux",
            WHEEL_X86,
            "x86_64-linux",
        ),
        "aarch64" => (
            (WHEEL_X86, &x86),
            "x86_64-linux",
            WHEEL_ARM,
            "aarch64-linux",
        ),
        other => {
            eprintln!("skipped: NVSHMEM has no builds for this CPU ({other})");
            return;
        }
    };
    let repo = repo_pinning_with(
        &good_tar(),
        &[(WHEEL_X86, &x86), (WHEEL_ARM, &arm)],
        "https://developer.download.nvidia.com/compute/nvshmem/redist/",
        "https://files.example",
    );
    let files = tempfile::tempdir().unwrap();
    let f = write(files.path(), foreign.0, foreign.1);
    let prefix = files.path().join("p");
    let args = common::file_and_prefix(&f, &prefix);
    let out = run_bare(repo.path(), &args);
    let err = common::assert_exit(&out, 2);
    assert!(
        err.contains(&format!(
            "is the {foreign_sys} build, but this machine is {host_sys}; pass --system {foreign_sys}"
        )) && err.contains(&format!("or use the {host_sys} file {host_name}")),
        "{err}"
    );
    assert!(!prefix.exists());
    let mut with_system = vec!["--system", foreign_sys];
    with_system.extend_from_slice(&args);
    let out = run_bare(repo.path(), &with_system);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let host_lib: &[u8] = if foreign_sys == "aarch64-linux" {
        b"aarch64 ELF host library"
    } else {
        b"ELF host library"
    };
    assert_file(&prefix, "lib/libnvshmem_host.so.3", host_lib);
}

#[test]
fn an_unreachable_nvidia_host_gets_the_pypi_command_which_works() {
    let whl = good_wheel();
    let server = common::Server::start();
    server.route(
        &format!("/w/{WHEEL_X86}"),
        common::Behaviour::ok(whl.clone()),
    );
    // Nothing listens on port 1 of the loopback: the tarball's download is refused at once,
    // as from networks that cannot reach NVIDIA's host.
    let repo = repo_pinning_with(
        &good_tar(),
        &[(WHEEL_X86, &whl)],
        "http://127.0.0.1:1/",
        &server.url("/w"),
    );
    let files = tempfile::tempdir().unwrap();
    let prefix = files.path().join("p");
    let cache = files.path().join("cache");
    let mut args = common::SELECT_3_4_5.to_vec();
    args.extend_from_slice(&[
        "--retries",
        "0",
        "--cache",
        cache.to_str().unwrap(),
        "--prefix",
        prefix.to_str().unwrap(),
    ]);
    let out = run_bare(repo.path(), &args);
    let err = common::assert_exit(&out, 1);
    let expected = format!(
        "deepep-nix install --version 3.4.5 --cuda 13 --system x86_64-linux --source pypi --prefix {} --cache {}",
        prefix.display(),
        cache.display()
    );
    assert!(
        err.contains("127.0.0.1:1")
            && err.contains(&format!(
                "the lock also pins this release's PyPI wheel ({WHEEL_X86})"
            ))
            && err.contains(&format!("`{expected}`")),
        "{err}"
    );
    assert!(!prefix.exists());
    // The suggested command installs the release.
    let words: Vec<&str> = expected.split_whitespace().skip(1).collect();
    let out = common::run_in(repo.path(), &words);
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert_file(&prefix, "lib/libnvshmem_host.so.3", b"ELF host library");
    // A download that fails for a wheel gets no such suggestion.
    server.route(&format!("/w/{WHEEL_X86}"), common::Behaviour::Status(404));
    let other = files.path().join("q");
    let mut args = words[1..].to_vec();
    let at = args.iter().position(|a| *a == "--prefix").unwrap();
    args[at + 1] = other.to_str().unwrap();
    let at = args.iter().position(|a| *a == "--cache").unwrap();
    args[at + 1] = files.path().to_str().unwrap();
    let out = run_bare(repo.path(), &args);
    common::assert_exit(&out, 1);
    assert!(
        !common::stderr(&out).contains("also pins"),
        "{}",
        common::stderr(&out)
    );
}

// ---- where install stages: existing prefixes, mount points, unwritable parents, signals ------

/// Entries below `dir` (recursively) whose name starts like a staging or set-aside directory.
fn staging_dirs(dir: &Path) -> Vec<std::path::PathBuf> {
    common::snapshot(dir)
        .into_iter()
        .map(|(rel, _)| rel)
        .filter(|rel| {
            rel.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with(".deepep-nix-install-") || n.starts_with(".deepep-nix-old-")
            })
        })
        .collect()
}

#[test]
fn an_existing_prefix_is_filled_in_place_and_nothing_is_written_beside_it() {
    use std::os::unix::fs::MetadataExt;
    let t = tempfile::tempdir().unwrap();
    let archive = write(t.path(), "a.tar.xz", &good_tar());
    let parent = t.path().join("opt");
    let prefix = parent.join("nvshmem");
    std::fs::create_dir_all(&prefix).unwrap();
    std::fs::set_permissions(&prefix, std::fs::Permissions::from_mode(0o750)).unwrap();
    let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    std::fs::File::open(&parent)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let ino = std::fs::metadata(&prefix).unwrap().ino();
    let parent_mtime = || std::fs::metadata(&parent).unwrap().modified().unwrap();
    // The old code staged beside the prefix and renamed over it: a new directory (new
    // inode, mode 0755), a write to the parent, and EBUSY on a mount point.
    for replace in [false, true] {
        install(&archive, Format::TarXz, &prefix, replace).unwrap();
        let m = std::fs::metadata(&prefix).unwrap();
        assert_eq!(
            m.ino(),
            ino,
            "the prefix directory itself is kept (replace: {replace})"
        );
        assert_eq!(m.permissions().mode() & 0o777, 0o750);
        assert_eq!(
            parent_mtime(),
            old,
            "nothing was created or removed in the parent"
        );
        assert_file(&prefix, "include/nvshmem.h", b"#define NVSHMEM 1\n");
        assert_eq!(staging_dirs(&parent), Vec::<std::path::PathBuf>::new());
    }
}

#[test]
fn a_failed_install_into_an_existing_prefix_leaves_it_as_it_was() {
    let t = tempfile::tempdir().unwrap();
    let archive = write(t.path(), "a.tar.xz", &truncated_tar());
    let root = t.path().join("root");
    let (empty, earlier) = (root.join("empty"), root.join("earlier"));
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::create_dir_all(earlier.join("lib")).unwrap();
    std::fs::write(earlier.join("lib/libnvshmem_host.so.3"), "old").unwrap();
    let before = common::snapshot(&root);
    install(&archive, Format::TarXz, &empty, false).unwrap_err();
    install(&archive, Format::TarXz, &earlier, true).unwrap_err();
    assert_eq!(common::snapshot(&root), before);
}

/// Runs `sh -c script` in a new user and mount namespace (as root there), or `None` where
/// this kernel or container does not allow that to this user.
fn in_mount_namespace(script: &str, args: &[&str]) -> Option<std::process::Output> {
    let probe = std::process::Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c"])
        .arg("d=$(mktemp -d) && mount -t tmpfs tmpfs \"$d\" && umount \"$d\" && rmdir \"$d\"")
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "skipped: unshare cannot mount a tmpfs here ({})",
                common::stderr(&o).trim()
            );
            return None;
        }
        Err(e) => {
            eprintln!("skipped: no unshare ({e})");
            return None;
        }
    }
    Some(
        std::process::Command::new("unshare")
            .args([
                "--user",
                "--map-root-user",
                "--mount",
                "sh",
                "-c",
                script,
                "sh",
            ])
            .args(args)
            .env_remove("DEEPEP_NIX_REPO")
            .env("DEEPEP_NIX_LOG", "warn")
            .output()
            .unwrap(),
    )
}

/// A mount point cannot be renamed or removed (EBUSY, os error 16), which the old code did
/// with an existing prefix. A real tmpfs is mounted in a user namespace of its own, which
/// needs no privileges where the kernel allows user namespaces; elsewhere the test is
/// skipped with the reason (the in-place staging it relies on is also covered by
/// `an_existing_prefix_is_filled_in_place_and_nothing_is_written_beside_it`).
#[test]
fn installs_into_a_mount_point() {
    let whl = good_wheel();
    let repo = repo_pinning(&good_tar(), &whl);
    let files = tempfile::tempdir().unwrap();
    let w = write(files.path(), WHEEL_X86, &whl);
    let prefix = files.path().join("mnt");
    std::fs::create_dir(&prefix).unwrap();
    let system = if std::env::consts::ARCH == "x86_64" {
        ""
    } else {
        "--system x86_64-linux"
    };
    let script = format!(
        "set -e; mount -t tmpfs tmpfs \"$1\"
         \"$2\" install --repo \"$3\" --file \"$4\" --prefix \"$1\" {system} >/dev/null
         \"$2\" install --repo \"$3\" --file \"$4\" --prefix \"$1\" {system} --replace >/dev/null
         ls -A \"$1\"; ls -A \"$1/lib\""
    );
    let Some(out) = in_mount_namespace(
        &script,
        &[
            prefix.to_str().unwrap(),
            env!("CARGO_BIN_EXE_deepep-nix"),
            repo.path().to_str().unwrap(),
            w.to_str().unwrap(),
        ],
    ) else {
        return;
    };
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert_eq!(
        common::stdout(&out),
        "include\nlib\nlibnvshmem_host.so\nlibnvshmem_host.so.3\nnvshmem_bootstrap_uid.so.3\n",
        "{}",
        common::stderr(&out)
    );
}

/// The user owns the prefix but not its parent (`/opt/x` but not `/opt`). Permission bits do
/// not stop root, so as root the binary runs as `nobody` (uid 65534); otherwise the parent
/// is made read-only. Skipped with the reason where `nobody` cannot run the binary.
#[test]
fn installs_into_a_prefix_whose_parent_is_not_writable() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let root = running_as_root();
    let whl = good_wheel();
    let repo = repo_pinning(&good_tar(), &whl);
    let files = tempfile::tempdir().unwrap();
    let w = write(files.path(), WHEEL_X86, &whl);
    let parent = files.path().join("opt");
    let prefix = parent.join("x");
    std::fs::create_dir_all(&prefix).unwrap();
    // And one that exists but is not the user's.
    let theirs = parent.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    let run = |prefix: &Path| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_deepep-nix"));
        cmd.args(["install", "--repo", repo.path().to_str().unwrap()])
            .args(common::file_and_prefix(&w, prefix))
            .args(x86_unless_host())
            .env_remove("DEEPEP_NIX_REPO")
            .env("DEEPEP_NIX_LOG", "warn");
        if root {
            cmd.uid(65534).gid(65534);
        }
        cmd.output().unwrap()
    };
    let open = std::fs::Permissions::from_mode(0o755);
    if root {
        for d in [repo.path(), files.path()] {
            std::fs::set_permissions(d, open.clone()).unwrap();
        }
        std::os::unix::fs::chown(&prefix, Some(65534), Some(65534)).unwrap();
        let probe = std::process::Command::new(env!("CARGO_BIN_EXE_deepep-nix"))
            .arg("--version")
            .uid(65534)
            .gid(65534)
            .output();
        if !probe.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!(
                "skipped: uid 65534 cannot run {} ({probe:?})",
                env!("CARGO_BIN_EXE_deepep-nix")
            );
            return;
        }
    } else {
        for d in [&parent, &theirs] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o555)).unwrap();
        }
    }
    let before = common::snapshot(&parent);
    let out = run(&prefix);
    let missing = parent.join("y/z");
    let refused = run(&missing);
    let not_mine = run(&theirs);
    let after = common::snapshot(&parent);
    for d in [&parent, &theirs] {
        std::fs::set_permissions(d, open.clone()).unwrap();
    }
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert!(prefix.join("lib/libnvshmem_host.so.3").is_file());
    // A prefix that does not exist cannot be created there: the message says how to make one.
    let err = common::assert_exit(&refused, 2);
    assert!(
        err.contains(&format!(
            "cannot create --prefix {}: {} is not writable by you",
            missing.display(),
            parent.display()
        )) && err.contains(&format!("sudo mkdir -p '{}'", missing.display())),
        "{err}"
    );
    let err = common::assert_exit(&not_mine, 2);
    assert!(
        err.contains(&format!(
            "--prefix {} is not writable by you (Permission denied (os error 13)); make it yours",
            theirs.display()
        )) && !err.contains(".deepep-nix-install"),
        "{err}"
    );
    // Nothing was written beside the prefix, nor into the directory that is not the user's.
    let entries: Vec<_> = after
        .iter()
        .filter(|(rel, _)| rel.components().count() == 1)
        .map(|(rel, _)| rel.clone())
        .collect();
    assert_eq!(entries, ["theirs", "x"].map(std::path::PathBuf::from));
    assert_eq!(before.len(), 2, "{before:?}");
    assert!(std::fs::read_dir(&theirs).unwrap().next().is_none());
}

/// Whether this process runs as root (read from /proc, without libc).
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// Sends SIGname to `pid` with the shell's `kill` (a builtin, so no procps is needed).
fn send(name: &str, pid: u32) -> bool {
    std::process::Command::new("sh")
        .args(["-c", "kill -s \"$1\" \"$2\"", "sh", name, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// An NVSHMEM archive holding `mib` MiB of zeros (a small `.tar.xz` that takes a while to
/// unpack): the repository pinning it, the folder holding it, and its path.
fn slow_archive(mib: usize) -> (tempfile::TempDir, tempfile::TempDir, std::path::PathBuf) {
    let big = tar_xz(&[
        E::Dir(&format!("{TOP}/")),
        E::File(&format!("{TOP}/lib/libnvshmem_host.so.3"), b"ELF", 0o644),
        E::File(&format!("{TOP}/lib/zeros"), &vec![0u8; mib << 20], 0o644),
    ]);
    let repo = repo_pinning(&big, &good_wheel());
    let files = tempfile::tempdir().unwrap();
    let archive = write(files.path(), &format!("{TOP}.tar.xz"), &big);
    (repo, files, archive)
}

/// `deepep-nix install --file archive --prefix prefix --max-unpacked-size 1G` in `repo`, started
/// through `launcher` (e.g. `nohup`) when given; stdout discarded, stderr piped.
fn spawn_install(
    launcher: Option<&str>,
    repo: &Path,
    archive: &Path,
    prefix: &Path,
) -> std::process::Child {
    let bin = env!("CARGO_BIN_EXE_deepep-nix");
    let mut cmd = match launcher {
        Some(l) => {
            let mut c = std::process::Command::new(l);
            c.arg(bin);
            c
        }
        None => std::process::Command::new(bin),
    };
    cmd.args(["install", "--file", archive.to_str().unwrap()])
        .args([
            "--prefix",
            prefix.to_str().unwrap(),
            "--max-unpacked-size",
            "1G",
        ])
        .args(x86_unless_host())
        .current_dir(repo)
        .env_remove("DEEPEP_NIX_REPO")
        .env("DEEPEP_NIX_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits (at most 60 s) until one of `dirs` holds an install staging directory: None then, or
/// the child's exit status if it ended first.
fn wait_for_staging(
    child: &mut std::process::Child,
    dirs: &[&Path],
) -> Option<std::process::ExitStatus> {
    let start = std::time::Instant::now();
    loop {
        let staged = dirs.iter().any(|d| {
            std::fs::read_dir(d).ok().is_some_and(|rd| {
                rd.filter_map(|e| e.ok()).any(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(".deepep-nix-install-")
                })
            })
        });
        if staged {
            return None;
        }
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        assert!(
            start.elapsed().as_secs() < 60,
            "no staging directory after 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// `deepep-nix install` of `archive` into `prefix` (as [`spawn_install`]) with signal `sig`
/// ignored from the start (`ignored`: as `nohup` leaves SIGHUP, and a non-interactive shell's
/// `&` SIGINT) or at its default action, whatever this test process inherited: `scripts/test-all.sh`
/// run in the background gives its tests SIGINT ignored.
fn spawn_install_with_signal(
    repo: &Path,
    archive: &Path,
    prefix: &Path,
    sig: i32,
    ignored: bool,
) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_deepep-nix"));
    cmd.args(["install", "--file", archive.to_str().unwrap()])
        .args(["--prefix", prefix.to_str().unwrap(), "--max-unpacked-size", "1G"])
        .args(x86_unless_host())
        .current_dir(repo)
        .env_remove("DEEPEP_NIX_REPO")
        .env("DEEPEP_NIX_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let disposition = if ignored { libc::SIG_IGN } else { libc::SIG_DFL };
    // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(sig, disposition);
            Ok(())
        });
    }
    cmd.spawn().unwrap()
}

/// The directory holding a new prefix's staging directory: its nearest existing ancestor
/// (the whole new subtree is staged there), or the prefix itself when it exists.
fn staging_place(prefix: &Path) -> PathBuf {
    prefix
        .ancestors()
        .find(|d| d.exists())
        .unwrap()
        .to_path_buf()
}

/// SIGINT (Ctrl-C), SIGTERM and SIGHUP during the unpacking, in both documented cases:
/// - the signal reaches the install: the process dies of it (as a shell expects) after
///   removing its staging directory, inside an existing prefix and in the nearest existing
///   parent of a new nested one, so no new parent directory is left either;
/// - the install was started with the signal ignored (SIGHUP under `nohup`, SIGINT of a
///   command started with `&` in a non-interactive shell): it stays ignored and the install
///   completes.
///
/// Each case sets the disposition itself, so the test means the same run in the foreground
/// or in the background (`nohup scripts/test-all.sh &`).
#[test]
fn a_signal_during_install_removes_staging_and_created_parents() {
    // 128 MiB of zeros: a 20 KiB archive that takes about a second to unpack.
    let (repo, files, archive) = slow_archive(128);
    for (sig, name) in [(libc::SIGINT, "INT"), (libc::SIGTERM, "TERM"), (libc::SIGHUP, "HUP")] {
        for ignored in [false, true] {
            let work = files.path().join(format!("work-{name}-{ignored}"));
            let existing = work.join("existing");
            std::fs::create_dir_all(&existing).unwrap();
            let new = work.join("new1/new2/pfx");
            for prefix in [&existing, &new] {
                let case = format!(
                    "SIG{name} {} into {}",
                    if ignored { "ignored" } else { "reaching the install" },
                    prefix.display()
                );
                let before = common::snapshot(&work);
                let mut child =
                    spawn_install_with_signal(repo.path(), &archive, prefix, sig, ignored);
                if let Some(status) = wait_for_staging(&mut child, &[&staging_place(prefix)]) {
                    let out = child.wait_with_output().unwrap();
                    panic!(
                        "{case}: install ended ({status}) before its staging directory was seen: {}",
                        common::stderr(&out)
                    );
                }
                assert!(send(name, child.id()), "{case}");
                let out = child.wait_with_output().unwrap();
                if ignored {
                    assert!(out.status.success(), "{case}: {:?} {}", out.status, common::stderr(&out));
                    assert_eq!(
                        std::fs::metadata(prefix.join("lib/zeros")).unwrap().len(),
                        128 << 20,
                        "{case}"
                    );
                    assert_eq!(staging_dirs(&work), Vec::<PathBuf>::new(), "{case}");
                } else {
                    use std::os::unix::process::ExitStatusExt;
                    assert_eq!(
                        out.status.signal(),
                        Some(sig),
                        "{case}: {:?} {}",
                        out.status,
                        common::stderr(&out)
                    );
                    assert_eq!(
                        common::snapshot(&work),
                        before,
                        "{case}: staging directory and new parents removed"
                    );
                }
            }
        }
    }
}

/// Under `nohup` SIGHUP is ignored, and the signal handling must keep it so: the install
/// goes on to the end.
#[test]
fn nohup_keeps_sighup_ignored() {
    let (repo, files, archive) = slow_archive(64);
    let prefix = files.path().join("p");
    let mut child = spawn_install(Some("nohup"), repo.path(), &archive, &prefix);
    // Ending first is fine here: the install must succeed either way.
    let _ = wait_for_staging(&mut child, &[files.path()]);
    send("HUP", child.id());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{:?} {}",
        out.status,
        common::stderr(&out)
    );
    assert_eq!(
        std::fs::metadata(prefix.join("lib/zeros")).unwrap().len(),
        64 << 20
    );
}

// ---- two installs into one prefix; read-only and full file systems (issue 31) ---------------

/// `install --file archive --prefix prefix extra...` in `repo`, stderr piped.
fn spawn_install_with(
    repo: &Path,
    archive: &Path,
    prefix: &Path,
    extra: &[&str],
) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_deepep-nix"))
        .args(["install", "--file", archive.to_str().unwrap()])
        .args(["--prefix", prefix.to_str().unwrap()])
        .args(["--max-unpacked-size", "1G"])
        .args(extra)
        .args(x86_unless_host())
        .current_dir(repo)
        .env_remove("DEEPEP_NIX_REPO")
        .env("DEEPEP_NIX_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Two installs into one prefix (a new one, a new one whose parents are missing too, an empty
/// one, and with --replace over an earlier install), the second started while the first
/// unpacks: the second waits, naming the first's PID, and then finds the same install in
/// place (verified, nothing changed) or, with --replace, replaces it; never a raw OS error
/// such as "Directory not empty (os error 39)". No data is lost: the prefix ends with one
/// complete install and no staging directory.
#[test]
fn two_concurrent_installs_into_one_prefix_wait_and_lose_nothing() {
    use std::io::BufRead;
    // 128 MiB of zeros: about a second of unpacking.
    let (repo, files, archive) = slow_archive(128);
    for (case, prepare, below, extra) in [
        ("new prefix", 0, "nvshmem", &[][..]),
        ("new nested prefix", 0, "a/b/nvshmem", &[][..]),
        ("empty prefix", 1, "nvshmem", &[][..]),
        ("--replace over an earlier install", 2, "nvshmem", &["--replace"][..]),
    ] {
        let work = files.path().join(case.replace(' ', "-"));
        let opt = work.join("opt");
        let prefix = opt.join(below);
        std::fs::create_dir_all(&opt).unwrap();
        if prepare >= 1 {
            std::fs::create_dir(&prefix).unwrap();
        }
        if prepare == 2 {
            let out = spawn_install_with(repo.path(), &archive, &prefix, &[])
                .wait_with_output()
                .unwrap();
            assert!(out.status.success(), "{}", common::stderr(&out));
        }
        let mut first = spawn_install_with(repo.path(), &archive, &prefix, extra);
        if let Some(status) = wait_for_staging(&mut first, &[&staging_place(&prefix)]) {
            let out = first.wait_with_output().unwrap();
            panic!(
                "{case}: first install ended ({status}) before staging: {}",
                common::stderr(&out)
            );
        }
        let mut second = spawn_install_with(repo.path(), &archive, &prefix, extra);
        let mut err2 = std::io::BufReader::new(second.stderr.take().unwrap());
        // Its first line names the release ("installing NVSHMEM ..."); the next one says it waits.
        let mut line = String::new();
        for _ in 0..2 {
            line.clear();
            err2.read_line(&mut line).unwrap();
            if line.starts_with("waiting:") {
                break;
            }
        }
        // A new prefix: the lock is on its nearest existing parent, and the message says so.
        let want = if prepare == 0 {
            format!(
                "waiting: another deepep-nix install (PID {}) holds the install lock on {} (it installs into a new \
                 prefix below it, or into it); this install into {} goes on",
                first.id(),
                opt.display(),
                prefix.display()
            )
        } else {
            format!(
                "waiting: another deepep-nix install (PID {}) is installing into {}; this one goes on",
                first.id(),
                prefix.display()
            )
        };
        assert!(line.starts_with(&want), "{case}: {line}");
        let out1 = first.wait_with_output().unwrap();
        assert!(out1.status.success(), "{case}: {}", common::stderr(&out1));
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut err2, &mut rest).unwrap();
        let status2 = second.wait().unwrap();
        if prepare == 2 {
            assert!(status2.success(), "{case}: {rest}");
            assert!(
                rest.contains("removed the earlier install"),
                "{case}: {rest}"
            );
        } else {
            assert!(status2.success(), "{case}: {rest}");
            assert!(
                rest.contains(&format!("already installed: {} holds exactly what", prefix.display()))
                    && !rest.contains("rm -rf")
                    && !rest.contains("os error"),
                "{case}: {rest}"
            );
        }
        assert_eq!(
            std::fs::metadata(prefix.join("lib/zeros")).unwrap().len(),
            128 << 20,
            "{case}"
        );
        assert_file(&prefix, "lib/libnvshmem_host.so.3", b"ELF");
        assert_eq!(
            staging_dirs(&work),
            Vec::<std::path::PathBuf>::new(),
            "{case}"
        );
    }
}

/// Two installs of `whl` (into a new prefix, then an existing empty one) on a tmpfs mounted with
/// `setup` in a user and mount namespace of its own, then `after` (shell, `$1` = the mount).
/// Returns the output and the mount path (with the folders that must outlive it), or None where
/// the kernel does not allow such namespaces.
fn two_installs_on_a_tmpfs(whl: &[u8], setup: &str, after: &str) -> Option<(String, String, PathBuf, [tempfile::TempDir; 2])> {
    let repo = repo_pinning(&good_tar(), whl);
    let files = tempfile::tempdir().unwrap();
    let w = write(files.path(), WHEEL_X86, whl);
    let mnt = files.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let system = if std::env::consts::ARCH == "x86_64" { "" } else { "--system x86_64-linux" };
    let script = format!(
        "set -e; {setup}
         for p in \"$1/new/nvshmem\" \"$1/existing\"; do
           if \"$2\" install --repo \"$3\" --file \"$4\" --prefix \"$p\" {system} >/dev/null 2>\"$1.err\"; then
             echo installed; else echo \"exit $?\"; fi
           cat \"$1.err\" >&2
         done
         {after}"
    );
    let out = in_mount_namespace(
        &script,
        &[mnt.to_str().unwrap(), env!("CARGO_BIN_EXE_deepep-nix"), repo.path().to_str().unwrap(), w.to_str().unwrap()],
    )?;
    assert!(out.status.success(), "{}", common::stderr(&out));
    Some((common::stdout(&out), common::stderr(&out), mnt, [repo, files]))
}

/// `err` names both prefixes of [`two_installs_on_a_tmpfs`] in `text` (`{p}`: the prefix, `{m}`:
/// the mount).
fn names_both_prefixes(err: &str, mnt: &Path, text: &str) {
    for p in [mnt.join("new/nvshmem"), mnt.join("existing")] {
        let want = text.replace("{p}", &p.display().to_string()).replace("{m}", &mnt.display().to_string());
        assert!(err.contains(&want), "{want:?} not in {err}");
    }
}

/// A read-only file system (a real tmpfs remounted read-only, in a user and mount namespace of
/// its own): for a new prefix and an existing one, the error names the prefix, says read-only
/// and gives the fix, not a hidden staging path. Skipped with the reason where the kernel does
/// not allow such namespaces.
#[test]
fn a_read_only_file_system_is_named_with_the_prefix_and_the_fix() {
    let Some((out, err, mnt, _keep)) = two_installs_on_a_tmpfs(
        &good_wheel(),
        "mount -t tmpfs tmpfs \"$1\"; mkdir \"$1/existing\"; mount -o remount,ro \"$1\"",
        "",
    ) else {
        return;
    };
    assert_eq!(out, "exit 2\nexit 2\n", "{err}");
    names_both_prefixes(&err, &mnt, "cannot install into --prefix {p}: the file system mounted at {m} is read-only");
    assert!(
        err.contains("mount -o remount,rw")
            && !err.contains(".deepep-nix-install")
            && !err.contains("chown"),
        "{err}"
    );
}

/// A full file system (a 1 MiB tmpfs, in a namespace of its own) and an archive that unpacks
/// to 3 MB: the error names the prefix, the free space and the fix; nothing is left behind.
#[test]
fn a_full_file_system_is_named_with_the_prefix_and_the_fix() {
    let whl = wheel(&[
        (
            "nvidia/nvshmem/lib/libnvshmem_host.so.3",
            b"ELF host library",
        ),
        ("nvidia/nvshmem/lib/big", &noise(3_000_000)),
    ]);
    let Some((out, err, mnt, _keep)) = two_installs_on_a_tmpfs(
        &whl,
        "mount -t tmpfs -o size=1m tmpfs \"$1\"; mkdir \"$1/existing\"",
        "ls -A \"$1\"; ls -A \"$1/existing\"",
    ) else {
        return;
    };
    // Both refused; the mount holds only the empty existing prefix afterwards.
    assert_eq!(out, "exit 2\nexit 2\nexisting\n", "{err}");
    names_both_prefixes(&err, &mnt, "not enough space to install into --prefix {p}: the file system mounted at {m} has");
    assert!(
        err.contains("no space left on device")
            && err.contains("df -h")
            && !err.contains(".deepep-nix-install"),
        "{err}"
    );
}
