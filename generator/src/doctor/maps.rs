//! `process.nvshmem-maps`: one NVSHMEM per process, judged from a process's `/proc/<pid>/maps`.
//!
//! torch built with NVSHMEM maps its `libnvshmem_host.so.3` at `import torch`. An extension that
//! needs that SONAME (DeepEP's `deep_ep_cpp`, or our binding loading it by name) then gets the
//! copy already loaded, whatever it was built with; one loaded by path from another directory is
//! a second copy with state of its own. Either way the device code and the host library can
//! disagree. The rule: a process that imported torch and the extension maps exactly one
//! `libnvshmem_host.so*`, and it is the one the device code was built with.
//!
//! The input, from doctor's environment (doctor's options are fixed by its argument struct; these
//! follow `DEEPEP_KERNELS_NVSHMEM_VERSION` in coming from the environment):
//!   - `DEEPEP_DOCTOR_MAPS=FILE`: a saved `/proc/<pid>/maps` text (a file on this machine, not
//!     below `--root`), e.g. `cat /proc/$(pgrep -f train.py)/maps > maps.txt`;
//!   - `DEEPEP_DOCTOR_MAPS_PYTHON=PYTHON` (real host only): runs
//!     `PYTHON -c '<import torch, then each module>'` and reads that process's own maps;
//!     `DEEPEP_DOCTOR_MAPS_MODULES` names the modules (space- or comma-separated; default
//!     `deep_ep`). For `deepep_kernels` the host library is loaded through
//!     `deepep_kernels._native.nvshmem_host_check()`, which closes it again: the path it reports
//!     is judged when no copy stays mapped;
//!   - the expected NVSHMEM: `DEEPEP_DOCTOR_MAPS_EXPECT=DIR` (its `lib/` directory, or the prefix
//!     holding `lib/`), else `--nvshmem-dir` when given. Without either, only the count is judged.
//!
//! The same rule as `checks/nvshmem-maps.py` (the Nix install and GPU checks).

use super::host::Ran;
use super::report::{caps, Check, Status};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const ENV_MAPS: &str = "DEEPEP_DOCTOR_MAPS";
pub const ENV_PYTHON: &str = "DEEPEP_DOCTOR_MAPS_PYTHON";
pub const ENV_MODULES: &str = "DEEPEP_DOCTOR_MAPS_MODULES";
pub const ENV_EXPECT: &str = "DEEPEP_DOCTOR_MAPS_EXPECT";

const ID: &str = "process.nvshmem-maps";
/// Lines the Python probe prints before the maps text: a path an imported module loaded itself.
const LOADED_MARKER: &str = "#deepep-nix-loaded ";
/// torch's import alone can take tens of seconds on a cold page cache.
const PYTHON_TIMEOUT: Duration = Duration::from_secs(180);

const PROBE: &str = r##"import importlib, sys
import torch
loaded = []
for name in sys.argv[1:]:
    importlib.import_module(name)
    if name == "deepep_kernels":
        loaded.append(importlib.import_module("deepep_kernels._native").nvshmem_host_check()[0])
for path in loaded:
    print("#deepep-nix-loaded " + path)
sys.stdout.write(open("/proc/self/maps").read())
"##;

const FIX: &str = "one NVSHMEM per process: build the extension against the NVSHMEM torch loads, or use a torch \
built without NVSHMEM (Nix: pkgs/deep-ep's oneNvshmem, the default \"auto\" picks one; pip: the nvidia-nvshmem wheel \
torch depends on as NVSHMEM_DIR when building DeepEP), and do not point NVSHMEM_DIR at another NVSHMEM at run time \
(docs/deepep.md, \"One NVSHMEM per process\")";

/// The distinct mapped files whose name starts with `libnvshmem_host.so`, in first-seen order
/// (the kernel shows each mapped file by its real path; a file replaced on disk gets " (deleted)").
pub fn nvshmem_host_paths(maps: &str) -> Vec<String> {
    mapped_paths(maps, |name| name.starts_with("libnvshmem_host.so"))
}

/// The distinct mapped files whose name starts with `libnccl` and holds `.so`, in first-seen
/// order (torch's `libnccl.so.2` from the nvidia-nccl wheel, and any other copy).
pub fn nccl_paths(maps: &str) -> Vec<String> {
    mapped_paths(maps, |name| {
        name.starts_with("libnccl") && name.contains(".so")
    })
}

/// The distinct absolute paths of `maps` whose file name satisfies `want`.
fn mapped_paths(maps: &str, want: impl Fn(&str) -> bool) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    for line in maps.lines() {
        if line.starts_with(LOADED_MARKER) {
            continue;
        }
        let mut rest = line.trim_start();
        for _ in 0..5 {
            rest = match rest.find(char::is_whitespace) {
                Some(i) => rest[i..].trim_start(),
                None => "",
            };
        }
        let path = rest.trim_end();
        let path = path.strip_suffix(" (deleted)").unwrap_or(path);
        let name = path.rsplit('/').next().unwrap_or(path);
        if path.starts_with('/') && want(name) && !seen.iter().any(|p| p == path) {
            seen.push(path.to_string());
        }
    }
    seen
}

const NCCL_ID: &str = "process.nccl-maps";

/// `process.nccl-maps`: the NCCL libraries mapped in the same process. DeepEP V2's import
/// (`deep_ep/__init__.py`, `check_nccl_so`, DeepEP 2.1) asserts that every mapped `libnccl` is
/// one file ("Duplicate NCCL runtime found in the current system") and that it is the file of
/// the nvidia-nccl wheel it was built against.
pub fn judge_nccl(origin: &str, maps: &str) -> Check {
    let paths = nccl_paths(maps);
    match paths.len() {
        0 => Check::skip(NCCL_ID, caps::ALL, format!("{origin}: no libnccl mapped (torch loads NCCL at import when it was built with it)")),
        1 => Check::ok(NCCL_ID, caps::ALL, format!("{origin}: one NCCL mapped: {}", paths[0])),
        n => Check::fail(
            NCCL_ID,
            caps::ALL,
            format!(
                "{origin}: {n} different libnccl mapped in one process: {}; DeepEP V2's import refuses this (\"Duplicate NCCL runtime found\"), and two NCCLs in one process share symbol names",
                paths.join(", ")
            ),
            "one NCCL per process: keep only the nvidia-nccl wheel torch depends on (pip list | grep nccl; pip uninstall the other nvidia-nccl-cu* or remove the other libnccl's directory from LD_LIBRARY_PATH); DeepEP V2 needs it at >= 2.30.4: pip install \"nvidia-nccl-cu13>=2.30.4\" --no-deps",
        ),
    }
}

/// Paths the probe reported as loaded by an imported module (`#deepep-nix-loaded PATH` lines).
fn loaded_paths(maps: &str) -> Vec<String> {
    maps.lines()
        .filter_map(|l| l.strip_prefix(LOADED_MARKER))
        .map(|p| p.trim().to_string())
        .collect()
}

/// The directory a mapped path lies in, resolved on this machine where it exists.
fn real_dir(path: &str) -> PathBuf {
    let p = Path::new(path);
    let resolved = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    resolved.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// The expected `lib/` directory: DIR itself when it holds the host library, else DIR/lib.
fn expected_dir(dir: &Path) -> PathBuf {
    let lib = if dir.join("libnvshmem_host.so.3").exists()
        || dir.file_name().is_some_and(|n| n == "lib")
    {
        dir.to_path_buf()
    } else {
        dir.join("lib")
    };
    std::fs::canonicalize(&lib).unwrap_or(lib)
}

/// Judges one maps text. `origin` says where it came from (for the report), `expect` is the
/// NVSHMEM the device code was built with (a prefix or its `lib/`), if known.
pub fn judge(origin: &str, maps: &str, expect: Option<&Path>) -> Check {
    let paths = nvshmem_host_paths(maps);
    let loaded = loaded_paths(maps);
    let want = expect.map(expected_dir);
    let want_text = want
        .as_ref()
        .map(|w| {
            format!(
                ", the one the device code was built with being in {}",
                w.display()
            )
        })
        .unwrap_or_default();
    let listing = paths.join(", ");
    match paths.len() {
        0 if loaded.is_empty() => Check::skip(
            ID,
            caps::NVSHMEM,
            format!("{origin}: no libnvshmem_host.so.3 mapped (nothing in that process loaded NVSHMEM){want_text}"),
        ),
        0 => {
            // Loaded and closed again (NVSHMEM's host library is not NODELETE): judge what was
            // reported. A bare SONAME was resolved through the extension's own search path.
            let wrong: Vec<&String> = loaded
                .iter()
                .filter(|p| p.starts_with('/'))
                .filter(|p| want.as_ref().is_some_and(|w| real_dir(p) != *w))
                .collect();
            if wrong.is_empty() {
                Check::ok(
                    ID,
                    caps::NVSHMEM,
                    format!(
                        "{origin}: one NVSHMEM host library at a time: the extension loaded {} and closed it, no other copy is mapped{want_text}",
                        loaded.join(", ")
                    ),
                )
            } else {
                Check::fail(
                    ID,
                    caps::NVSHMEM,
                    format!(
                        "{origin}: the extension loaded {}, not the NVSHMEM host library its device code was built with{want_text}",
                        wrong.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                    ),
                    FIX,
                )
            }
        }
        1 => match &want {
            Some(w) if real_dir(&paths[0]) != *w => Check::fail(
                ID,
                caps::NVSHMEM,
                format!("{origin}: 1 libnvshmem_host.so.3 mapped, {listing}, but not the one the device code was built with (in {})", w.display()),
                FIX,
            ),
            _ => Check::ok(ID, caps::NVSHMEM, format!("{origin}: exactly one libnvshmem_host.so.3 mapped: {listing}{want_text}")),
        },
        n => Check::fail(
            ID,
            caps::NVSHMEM,
            format!("{origin}: {n} different libnvshmem_host.so.3 mapped in one process: {listing}{want_text}"),
            FIX,
        ),
    }
}

/// The modules the probe imports after torch.
fn modules(env: &BTreeMap<String, String>) -> Vec<String> {
    let ms: Vec<String> = env
        .get(ENV_MODULES)
        .map(|s| {
            s.split([' ', ','])
                .filter(|m| !m.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    if ms.is_empty() {
        vec!["deep_ep".to_string()]
    } else {
        ms
    }
}

/// Runs `python -c PROBE modules...` and returns its standard output (markers + maps).
fn run_probe(python: &str, modules: &[String], timeout: Duration) -> Result<String, String> {
    let mut args = vec!["-c", PROBE];
    args.extend(modules.iter().map(String::as_str));
    match super::host::run_captured(python, &args, timeout) {
        Ran::NotFound => Err(format!("`{python}` could not start: not found")),
        Ran::Failed(m) => Err(m),
        Ran::Exited(status, stdout, _) if status.success() => Ok(stdout),
        Ran::Exited(status, _, stderr) => {
            // a Python traceback ends with the error itself
            let last = stderr
                .lines()
                .rfind(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim()
                .to_string();
            Err(format!(
                "`{python} -c 'import torch, {}'` failed ({status}): {last}",
                modules.join(", ")
            ))
        }
    }
}

/// The check, when the environment asks for it (`DEEPEP_DOCTOR_MAPS` / `DEEPEP_DOCTOR_MAPS_PYTHON`).
/// `real_host`: doctor checks the running machine (`--root /`); only then is Python run.
pub fn check(
    env: &BTreeMap<String, String>,
    nvshmem_dir: Option<&Path>,
    real_host: bool,
    out: &mut Vec<Check>,
) {
    let expect: Option<PathBuf> = env
        .get(ENV_EXPECT)
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .or_else(|| nvshmem_dir.map(Path::to_path_buf));
    let mut nccl: Option<Check> = None;
    // Both checks from one maps text: the NVSHMEM check returned, the NCCL one kept for the end.
    let mut judge_both = |origin: &str, text: &str| {
        nccl = Some(judge_nccl(origin, text));
        judge(origin, text, expect.as_deref())
    };
    if let Some(file) = env.get(ENV_MAPS).filter(|s| !s.is_empty()) {
        out.push(match std::fs::read_to_string(file) {
            Ok(text) => judge_both(&format!("{ENV_MAPS}={file}"), &text),
            Err(e) => Check::fail(
                ID,
                caps::NVSHMEM,
                format!("{ENV_MAPS}={file} cannot be read: {e}"),
                "save the maps of the process to check: cat /proc/<pid>/maps > FILE",
            ),
        });
    }
    if let Some(python) = env.get(ENV_PYTHON).filter(|s| !s.is_empty()) {
        let ms = modules(env);
        let origin = format!("`{python}` after import torch, {}", ms.join(", "));
        out.push(if !real_host {
            Check::new(ID, caps::NVSHMEM, Status::Skip, format!("{origin}: not run (--root describes another host)"))
        } else {
            match run_probe(python, &ms, PYTHON_TIMEOUT) {
                Ok(text) => judge_both(&origin, &text),
                Err(e) => Check::fail(
                    ID,
                    caps::NVSHMEM,
                    e,
                    format!("run doctor with {ENV_PYTHON} set to the Python that has torch and the extension (and {ENV_MODULES} naming the modules)"),
                ),
            }
        });
    }
    out.extend(nccl);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    // Sample maps texts: what /proc/<pid>/maps shows for a Python that imported torch and an
    // extension (shortened to the lines that matter plus neighbours of every other kind).
    const PYTHON_HEAD: &str = "\
55d0c2a00000-55d0c2a2a000 r--p 00000000 00:1f 4201 /nix/store/aaa-python3-3.12.8/bin/python3.12
55d0c2c3b000-55d0c2c5c000 rw-p 00000000 00:00 0 [heap]
7f2c10000000-7f2c10021000 rw-p 00000000 00:00 0
7f2c2a000000-7f2c2a400000 r--p 00000000 00:1f 9911 /nix/store/ttt-python3.12-torch-2.13.0-lib/lib/libtorch_cuda.so
";
    const TAIL: &str = "\
7ffd1c5f0000-7ffd1c611000 rw-p 00000000 00:00 0 [stack]
7ffd1c7e5000-7ffd1c7e9000 r--p 00000000 00:00 0 [vvar]
";
    const OURS: &str = "/nix/store/nnn-libnvshmem-3.4.5-lib/lib/libnvshmem_host.so.3";
    /// The NVSHMEM the device code was built with (OURS's prefix).
    const EXPECTED: &str = "/nix/store/nnn-libnvshmem-3.4.5-lib";

    /// `judge` of `text` with EXPECTED as the NVSHMEM to expect.
    fn judge_expecting_ours(text: &str) -> Check {
        judge("sample", text, Some(Path::new(EXPECTED)))
    }
    const TORCHS: &str = "/nix/store/qqq-cuda13-libnvshmem-3.6.5-0/lib/libnvshmem_host.so.3";

    fn lib_lines(path: &str, inode: u32) -> String {
        format!(
            "7f2c30000000-7f2c30200000 r--p 00000000 00:1f {inode} {path}\n\
             7f2c30200000-7f2c32000000 r-xp 00200000 00:1f {inode} {path}\n\
             7f2c32000000-7f2c32100000 rw-p 02000000 00:1f {inode} {path}\n"
        )
    }

    fn maps(libs: &[&str]) -> String {
        let mut s = PYTHON_HEAD.to_string();
        for (i, l) in libs.iter().enumerate() {
            s += &lib_lines(l, 100 + i as u32);
        }
        s + TAIL
    }

    #[test]
    fn nccl_copies_are_counted_like_deepeps_import_check() {
        const WHEEL: &str = "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2";
        const OTHER: &str = "/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.3";
        let c = judge_nccl("maps", &maps(&[WHEEL, OURS]));
        assert_eq!(c.status, Status::Ok);
        assert_eq!(c.found, format!("maps: one NCCL mapped: {WHEEL}"));
        let c = judge_nccl("maps", &maps(&[WHEEL, OTHER]));
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.found.starts_with(&format!(
                "maps: 2 different libnccl mapped in one process: {WHEEL}, {OTHER}"
            )),
            "{}",
            c.found
        );
        assert!(c.fix.unwrap().contains("nvidia-nccl-cu13>=2.30.4"));
        assert_eq!(judge_nccl("maps", &maps(&[OURS])).status, Status::Skip);
        // One file mapped twice is one; a libnccl-net plugin is counted too, as DeepEP's check
        // counts every mapped path holding "libnccl".
        assert_eq!(nccl_paths(&maps(&[WHEEL, WHEEL])), vec![WHEEL.to_string()]);
        let net = "/opt/aws-ofi-nccl/lib/libnccl-net-ofi.so";
        assert_eq!(
            judge_nccl("maps", &maps(&[WHEEL, net])).status,
            Status::Fail
        );
    }

    #[test]
    fn one_library_is_listed_once_whatever_its_segments() {
        assert_eq!(nvshmem_host_paths(&maps(&[OURS])), vec![OURS.to_string()]);
    }

    #[test]
    fn every_distinct_path_is_named_in_order() {
        assert_eq!(
            nvshmem_host_paths(&maps(&[TORCHS, OURS])),
            vec![TORCHS.to_string(), OURS.to_string()]
        );
    }

    #[test]
    fn paths_with_spaces_deleted_files_and_versioned_names() {
        let text = "\
7f00-7f01 r--p 00000000 08:01 12 /opt/my envs/nvidia/nvshmem/lib/libnvshmem_host.so.3
7f01-7f02 r--p 00000000 08:01 13 /opt/old/lib/libnvshmem_host.so.3.4.5 (deleted)
7f02-7f03 r--p 00000000 08:01 14 /opt/other/lib/nvshmem_transport_ibgda.so.3
7f03-7f04 r--p 00000000 08:01 15 /opt/other/lib/libnvshmem_device.a
";
        assert_eq!(
            nvshmem_host_paths(text),
            vec![
                "/opt/my envs/nvidia/nvshmem/lib/libnvshmem_host.so.3",
                "/opt/old/lib/libnvshmem_host.so.3.4.5"
            ]
        );
    }

    #[test]
    fn anonymous_and_special_mappings_are_not_libraries() {
        assert!(nvshmem_host_paths(&maps(&[])).is_empty());
        assert!(nvshmem_host_paths(
            "7f00-7f01 rw-p 00000000 00:00 0 [anon:libnvshmem_host.so.3]\n"
        )
        .is_empty());
    }

    #[test]
    fn exactly_one_is_ok_and_named() {
        let c = judge("sample", &maps(&[OURS]), None);
        assert_eq!(c.status, Status::Ok, "{}", c.found);
        assert!(c.found.contains(OURS), "{}", c.found);
        assert_eq!(c.needed_by, caps::NVSHMEM.to_vec());
    }

    #[test]
    fn two_copies_fail_naming_both() {
        let c = judge("sample", &maps(&[TORCHS, OURS]), None);
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.found.contains("2 different libnvshmem_host.so.3")
                && c.found.contains(OURS)
                && c.found.contains(TORCHS),
            "{}",
            c.found
        );
        assert!(
            c.fix
                .as_deref()
                .unwrap()
                .contains("One NVSHMEM per process"),
            "{:?}",
            c.fix
        );
    }

    #[test]
    fn the_one_mapped_must_be_the_expected_one() {
        let ok = judge_expecting_ours(&maps(&[OURS]));
        assert_eq!(ok.status, Status::Ok, "{}", ok.found);
        let ok_lib = judge(
            "sample",
            &maps(&[OURS]),
            Some(Path::new("/nix/store/nnn-libnvshmem-3.4.5-lib/lib")),
        );
        assert_eq!(ok_lib.status, Status::Ok, "{}", ok_lib.found);
        // torch's copy only: DeepEP got torch's NVSHMEM through the SONAME.
        let bad = judge_expecting_ours(&maps(&[TORCHS]));
        assert_check(&bad, Status::Fail, TORCHS);
        assert_check(
            &bad,
            Status::Fail,
            "not the one the device code was built with",
        );
    }

    #[test]
    fn nothing_mapped_is_a_skip_without_a_report_of_a_load() {
        let c = judge("sample", &maps(&[]), None);
        assert_eq!(c.status, Status::Skip);
    }

    #[test]
    fn a_library_loaded_and_closed_again_is_judged_by_what_was_reported() {
        let ok = format!("{LOADED_MARKER}{OURS}\n{}", maps(&[]));
        assert_eq!(judge_expecting_ours(&ok).status, Status::Ok);
        let soname = format!("{LOADED_MARKER}libnvshmem_host.so.3\n{}", maps(&[]));
        assert_eq!(judge_expecting_ours(&soname).status, Status::Ok);
        let other = format!("{LOADED_MARKER}{TORCHS}\n{}", maps(&[]));
        assert_eq!(judge_expecting_ours(&other).status, Status::Fail);
        // Loaded and closed while torch's other copy stays mapped: the mapped one is judged.
        let beside = format!("{LOADED_MARKER}{OURS}\n{}", maps(&[TORCHS]));
        assert_eq!(judge_expecting_ours(&beside).status, Status::Fail);
    }

    /// Asserts the check's status and that its `found` text contains `needle`.
    #[track_caller]
    fn assert_check(c: &Check, status: Status, needle: &str) {
        assert_eq!(c.status, status, "{}", c.found);
        assert!(c.found.contains(needle), "{needle:?} not in {}", c.found);
    }

    /// What `check` reports with the environment `pairs`.
    fn checks(pairs: &[(&str, &str)], nvshmem_dir: Option<&Path>, real_host: bool) -> Vec<Check> {
        let env: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut out = Vec::new();
        check(&env, nvshmem_dir, real_host, &mut out);
        out
    }

    #[test]
    fn a_maps_file_from_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("maps.txt");
        std::fs::write(&f, maps(&[TORCHS, OURS])).unwrap();
        let out = checks(&[(ENV_MAPS, f.to_str().unwrap())], None, false);
        // process.nvshmem-maps, then process.nccl-maps from the same text (no libnccl there)
        assert_eq!(out.len(), 2);
        assert_eq!((out[1].id.as_str(), out[1].status), (NCCL_ID, Status::Skip));
        assert_eq!(out[0].status, Status::Fail);
        assert!(
            out[0]
                .found
                .starts_with(&format!("{ENV_MAPS}={}", f.display())),
            "{}",
            out[0].found
        );

        let missing = checks(&[(ENV_MAPS, "/nonexistent/maps.txt")], None, true);
        assert_check(&missing[0], Status::Fail, "cannot be read");
    }

    #[test]
    fn nothing_asked_nothing_reported() {
        let out = checks(
            &[("NVSHMEM_DIR", "/opt/nvshmem")],
            Some(Path::new("/opt/nvshmem")),
            true,
        );
        assert!(out.is_empty());
    }

    #[test]
    fn the_expected_nvshmem_comes_from_the_environment_or_nvshmem_dir() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("maps.txt");
        std::fs::write(&f, maps(&[TORCHS])).unwrap();
        let by_env = checks(
            &[(ENV_MAPS, f.to_str().unwrap()), (ENV_EXPECT, EXPECTED)],
            None,
            true,
        );
        assert_eq!(by_env[0].status, Status::Fail);
        let by_dir = checks(
            &[(ENV_MAPS, f.to_str().unwrap())],
            Some(Path::new("/nix/store/qqq-cuda13-libnvshmem-3.6.5-0")),
            true,
        );
        assert_eq!(by_dir[0].status, Status::Ok, "{}", by_dir[0].found);
    }

    /// A stand-in for Python: prints a recorded maps text whatever it is asked (the probe's
    /// arguments are checked separately), or fails like an import error.
    fn fake_python(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("python");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[test]
    fn the_python_probe_output_is_judged() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("maps.txt");
        std::fs::write(&f, maps(&[OURS])).unwrap();
        // The probe gets -c CODE and the modules; the stand-in records them and prints the maps.
        let args_file = dir.path().join("args");
        let py = fake_python(
            dir.path(),
            &format!(
                "printf '%s\\n' \"$1\" \"$3\" \"$4\" > {}; cat {}",
                args_file.display(),
                f.display()
            ),
        );
        let out = checks(
            &[
                (ENV_PYTHON, py.to_str().unwrap()),
                (ENV_MODULES, "deep_ep, deepep_kernels"),
            ],
            None,
            true,
        );
        assert_check(
            &out[0],
            Status::Ok,
            "after import torch, deep_ep, deepep_kernels",
        );
        assert_eq!(
            std::fs::read_to_string(&args_file).unwrap(),
            "-c\ndeep_ep\ndeepep_kernels\n"
        );
    }

    #[test]
    fn a_failing_python_is_a_failure_with_its_last_error_line() {
        let dir = tempfile::tempdir().unwrap();
        let py = fake_python(dir.path(), "echo 'Traceback (most recent call last):' >&2; echo \"ModuleNotFoundError: No module named 'deep_ep'\" >&2; exit 1");
        let out = checks(&[(ENV_PYTHON, py.to_str().unwrap())], None, true);
        assert_check(&out[0], Status::Fail, "No module named 'deep_ep'");
    }

    #[test]
    fn python_is_not_run_for_another_root() {
        let out = checks(&[(ENV_PYTHON, "/nonexistent/python")], None, false);
        assert_eq!(out[0].status, Status::Skip);
    }

    #[test]
    fn the_probe_imports_torch_first_and_prints_maps() {
        assert!(
            PROBE.contains("import torch\n")
                && PROBE.find("import torch").unwrap() < PROBE.find("sys.argv[1:]").unwrap()
        );
        assert!(PROBE.contains("/proc/self/maps") && PROBE.contains(LOADED_MARKER));
    }
}
