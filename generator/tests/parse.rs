//! Parsing NVIDIA manifests and PyPI JSON, including malformed input: every error names the
//! document and the problem, and a failing `lock` writes nothing.

mod common;

use deepep_nix::lock::{build, BuildOptions, Inputs};
use deepep_nix::model::{SourceKind, System};
use deepep_nix::nvidia::{parse_manifest, DEFAULT_REDIST_URL};
use deepep_nix::pypi;
use deepep_nix::version::Version;
use serde_json::{json, Value};

const HEX_A: &str = "72a788ef5723a30d8882b193f0a513f454ecaee3ab5a225a5c43db79d433ef66";
const HEX_B: &str = "18f12807c23bc5b270581af1f9bafd540369da783e557171558887623d77842c";

fn manifest() -> Value {
    json!({
        "release_date": "2025-09-06",
        "release_label": "3.4.5",
        "release_product": "nvshmem",
        "libnvshmem": {
            "name": "NVIDIA nvshmem",
            "version": "3.4.5",
            "linux-x86_64": {
                "cuda12": { "relative_path": "libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.4.5_cuda12-archive.tar.xz", "sha256": HEX_A, "md5": "a686a086646288ddaf26f6967238573e", "size": "190224128" },
                "cuda13": { "relative_path": "libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.4.5_cuda13-archive.tar.xz", "sha256": HEX_B }
            },
            "cuda_variant": ["12", "13"],
            "linux-sbsa": {
                "cuda12": { "relative_path": "libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.4.5_cuda12-archive.tar.xz", "sha256": HEX_A }
            },
            "windows-x86_64": { "cuda12": { "relative_path": "x.zip", "sha256": HEX_A } }
        }
    })
}

fn parse(v: &Value) -> Result<deepep_nix::nvidia::Manifest, String> {
    parse_manifest(
        "redistrib_3.4.5.json",
        &serde_json::to_vec(v).unwrap(),
        DEFAULT_REDIST_URL,
    )
    .map_err(|e| e.to_string())
}

fn parse_err(v: &Value) -> String {
    let e = parse(v).expect_err("must be rejected");
    assert!(
        e.contains("redistrib_3.4.5.json"),
        "error names the file: {e}"
    );
    e
}

#[test]
fn manifest_parses_platforms_variants_and_optional_fields() {
    let m = parse(&manifest()).unwrap();
    assert_eq!(m.version.to_string(), "3.4.5");
    assert_eq!(m.release_date.as_deref(), Some("2025-09-06"));
    let keys: Vec<(System, u32, Option<u64>)> = m
        .artifacts
        .iter()
        .map(|a| (a.system, a.cuda, a.size))
        .collect();
    assert_eq!(
        keys,
        [
            (System::Aarch64Linux, 12, None),
            (System::X86_64Linux, 12, Some(190224128)),
            (System::X86_64Linux, 13, None)
        ],
        "windows is skipped, sizes only where given"
    );
    let a = &m.artifacts[1];
    assert_eq!(a.url, format!("{DEFAULT_REDIST_URL}libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.4.5_cuda12-archive.tar.xz"));
    assert_eq!(
        a.filename,
        "libnvshmem-linux-x86_64-3.4.5_cuda12-archive.tar.xz"
    );
}

#[test]
fn manifest_without_cuda_variant_takes_major_from_the_path() {
    let v = json!({ "release_date": "2025-06-26", "libnvshmem": { "version": "3.4.5",
        "linux-x86_64": { "relative_path": "libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.4.5_cuda12-archive.tar.xz", "sha256": HEX_A } } });
    let m = parse(&v).unwrap();
    assert_eq!(m.artifacts[0].cuda, 12);
    let v = json!({ "libnvshmem": { "version": "3.4.5", "linux-x86_64": { "relative_path": "x.tar.xz", "sha256": HEX_A } } });
    assert!(parse_err(&v).contains("cannot tell the CUDA major"));
}

#[test]
fn manifest_missing_keys() {
    let mut v = manifest();
    v.as_object_mut().unwrap().remove("libnvshmem");
    assert!(parse_err(&v).contains("missing key \"libnvshmem\""));
    let mut v = manifest();
    v["libnvshmem"]["linux-x86_64"]["cuda13"]
        .as_object_mut()
        .unwrap()
        .remove("sha256");
    let e = parse_err(&v);
    assert!(
        e.contains("libnvshmem.linux-x86_64.cuda13") && e.contains("missing key \"sha256\""),
        "{e}"
    );
    let mut v = manifest();
    v["libnvshmem"]["linux-sbsa"]["cuda12"]
        .as_object_mut()
        .unwrap()
        .remove("relative_path");
    assert!(parse_err(&v).contains("missing key \"relative_path\""));
}

#[test]
fn manifest_wrong_types() {
    for (path, bad, expect) in [
        (
            &["libnvshmem", "linux-x86_64", "cuda12", "size"][..],
            json!(true),
            "size must be a string or number",
        ),
        (
            &["libnvshmem", "linux-x86_64", "cuda12", "size"][..],
            json!("12 MB"),
            "is not a non-negative integer",
        ),
        (
            &["libnvshmem", "linux-x86_64", "cuda12", "sha256"][..],
            json!(42),
            "expected a string, found a number",
        ),
        (
            &["libnvshmem", "cuda_variant"][..],
            json!("12"),
            "expected an array",
        ),
        (
            &["libnvshmem", "linux-x86_64", "cuda12"][..],
            json!("x"),
            "expected an object, found a string",
        ),
        (
            &["release_date"][..],
            json!("Sept 6"),
            "expected a date YYYY-MM-DD",
        ),
        (
            &["libnvshmem", "version"][..],
            json!([3, 4, 5]),
            "expected a string, found an array",
        ),
    ] {
        let mut v = manifest();
        let mut cur = &mut v;
        for k in &path[..path.len() - 1] {
            cur = &mut cur[*k];
        }
        cur[path[path.len() - 1]] = bad;
        let e = parse_err(&v);
        assert!(e.contains(expect), "{path:?}: {e}");
    }
    let mut v = manifest();
    v["libnvshmem"] = json!([]);
    assert!(parse_err(&v).contains("expected an object, found an array"));
    assert!(
        parse_manifest("redistrib_3.4.5.json", b"{not json", DEFAULT_REDIST_URL)
            .unwrap_err()
            .to_string()
            .contains("not valid JSON")
    );
}

#[test]
fn manifest_unknown_platform_is_an_error_known_others_are_skipped() {
    let mut v = manifest();
    v["libnvshmem"]["linux-riscv64"] =
        json!({ "cuda12": { "relative_path": "a", "sha256": HEX_A } });
    let e = parse_err(&v);
    common::assert_contains_all(
        &e,
        &[
            "linux-riscv64",
            "unknown platform",
            "generator/src/nvidia.rs",
        ],
    );
    let mut v = manifest();
    v["libnvshmem"]["linux-ppc64le"] =
        json!({ "cuda12": { "relative_path": "a", "sha256": HEX_A } });
    assert_eq!(parse(&v).unwrap().artifacts.len(), 3);
}

#[test]
fn manifest_bad_hex_bad_md5_bad_paths_and_variants() {
    let cuda12 = ["libnvshmem", "linux-x86_64", "cuda12"];
    let cases: [(&[&str], Value, &str); 6] = [
        (
            &cuda12,
            json!({ "sha256": "abc123" }),
            "expected 64 hex digits",
        ),
        (&cuda12, json!({ "sha256": "z".repeat(64) }), "sha256 hex"),
        (&cuda12, json!({ "md5": "nope" }), "md5"),
        (
            &cuda12,
            json!({ "relative_path": "../../etc/passwd" }),
            "not a plain relative path",
        ),
        (
            &["libnvshmem"],
            json!({ "cuda_variant": ["12"] }),
            "cuda13 is not listed in cuda_variant",
        ),
        (
            &["libnvshmem"],
            json!({ "version": "3.4.6" }),
            "file name says 3.4.5 but the manifest says 3.4.6",
        ),
    ];
    for (path, change, want) in cases {
        let mut v = manifest();
        let target = path.iter().fold(&mut v, |v, k| &mut v[*k]);
        for (k, val) in change.as_object().unwrap() {
            target[k] = val.clone();
        }
        let err = parse_err(&v);
        assert!(err.contains(want), "{path:?} {change}: {err}");
    }
}

#[test]
fn manifest_huge_sizes_and_documents_are_refused() {
    let mut v = manifest();
    v["libnvshmem"]["linux-x86_64"]["cuda12"]["size"] = json!("999999999999999");
    assert!(parse_err(&v).contains("sanity limit"));
    let mut v = manifest();
    v["libnvshmem"]["padding"] = json!("x".repeat(17 << 20));
    assert!(parse_err(&v).contains("refusing to parse"));
}

// ---- PyPI -----------------------------------------------------------------------------

fn wheel(version: &str, plat: &str, sha: &str) -> Value {
    let filename = format!("nvidia_nvshmem_cu13-{version}-py3-none-{plat}.whl");
    json!({ "filename": filename, "packagetype": "bdist_wheel", "size": 1000, "digests": { "sha256": sha },
            "upload_time_iso_8601": "2025-09-06T00:32:41.564932Z", "url": format!("https://files.pythonhosted.org/packages/aa/bb/cc/{filename}"), "yanked": false })
}

fn pypi_doc(releases: Value) -> Value {
    json!({ "info": { "name": "nvidia-nvshmem-cu13" }, "releases": releases })
}

fn pypi_parse(v: &Value) -> Result<pypi::PypiPackage, String> {
    pypi::parse(
        "pypi/nvidia-nvshmem-cu13.json",
        &serde_json::to_vec(v).unwrap(),
        13,
        &Version::deepep_min(),
    )
    .map_err(|e| e.to_string())
}

#[test]
fn pypi_real_recorded_answer_parses_and_reduces() {
    let raw = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/pypi-cu13-raw.json"),
    )
    .unwrap();
    let pkg = pypi::parse("raw", &raw, 13, &Version::deepep_min()).unwrap();
    let names: Vec<String> = pkg
        .artifacts
        .iter()
        .map(|a| format!("{} {}", a.version, a.system))
        .collect();
    assert_eq!(
        names,
        ["3.4.5 aarch64-linux", "3.4.5 x86_64-linux"],
        "0.0.0a0 placeholder skipped"
    );
    assert_eq!(
        pkg.upload_dates[&"3.4.5".parse::<Version>().unwrap()],
        "2025-09-06"
    );
    let reduced = pypi::reduce("raw", &raw, 13).unwrap();
    let again = pypi::reduce("reduced", &reduced, 13).unwrap();
    assert_eq!(reduced, again, "reducing is idempotent");
    let from_reduced = pypi::parse("reduced", &reduced, 13, &Version::deepep_min()).unwrap();
    assert_eq!(
        from_reduced
            .artifacts
            .iter()
            .map(|a| (&a.url, a.sha256))
            .collect::<Vec<_>>(),
        pkg.artifacts
            .iter()
            .map(|a| (&a.url, a.sha256))
            .collect::<Vec<_>>()
    );
}

#[test]
fn pypi_skips_yanked_non_wheels_and_foreign_platforms() {
    let mut yanked = wheel("3.4.5", "manylinux2014_aarch64", HEX_B);
    yanked["yanked"] = json!(true);
    let sdist = json!({ "filename": "nvidia_nvshmem_cu13-3.4.5.tar.gz", "packagetype": "sdist" });
    let doc = pypi_doc(
        json!({ "3.4.5": [wheel("3.4.5", "manylinux2014_x86_64", HEX_A), yanked, sdist, wheel("3.4.5", "win_amd64", HEX_A)],
                               "3.2.5": [wheel("3.2.5", "manylinux2014_x86_64", HEX_A)], "0.0.0a0": [] }),
    );
    let pkg = pypi_parse(&doc).unwrap();
    assert_eq!(pkg.artifacts.len(), 1);
    assert_eq!(
        (pkg.artifacts[0].system, pkg.artifacts[0].source),
        (System::X86_64Linux, SourceKind::Pypi)
    );
}

#[test]
fn pypi_malformed_input() {
    let cases: Vec<(Value, &str)> = vec![
        (json!({ "info": {} }), "missing key \"releases\""),
        (
            json!({ "releases": [] }),
            "releases: expected an object, found an array",
        ),
        (
            pypi_doc(json!({ "3.4.5": {} })),
            "releases.3.4.5: expected an array of files",
        ),
        (
            pypi_doc(json!({ "3.4.5": [ { "packagetype": "bdist_wheel" } ] })),
            "missing key \"filename\"",
        ),
        (
            pypi_doc(json!({ "3.4.5": [ { "filename": 7, "packagetype": "bdist_wheel" } ] })),
            "filename: expected a string, found a number",
        ),
        (
            json!({ "info": { "name": "numpy" }, "releases": {} }),
            "expected \"nvidia-nvshmem-cu13\"",
        ),
        (json!([1, 2]), "expected an object, found an array"),
    ];
    for (doc, expect) in cases {
        let e = pypi_parse(&doc).expect_err(expect);
        assert!(
            e.contains(expect) && e.contains("pypi/nvidia-nvshmem-cu13.json"),
            "{expect}: {e}"
        );
    }
    let mut w = wheel("3.4.5", "manylinux2014_x86_64", HEX_A);
    w.as_object_mut().unwrap().remove("digests");
    assert!(pypi_parse(&pypi_doc(json!({ "3.4.5": [w] })))
        .unwrap_err()
        .contains("missing key \"digests\""));
    let w = wheel("3.4.5", "manylinux2014_x86_64", "not-hex");
    assert!(pypi_parse(&pypi_doc(json!({ "3.4.5": [w] })))
        .unwrap_err()
        .contains("sha256 hex"));
    let mut w = wheel("3.4.5", "manylinux2014_x86_64", HEX_A);
    w["size"] = json!(-5);
    assert!(pypi_parse(&pypi_doc(json!({ "3.4.5": [w] })))
        .unwrap_err()
        .contains("not a non-negative integer"));
    let mut w = wheel("3.4.5", "manylinux2014_x86_64", HEX_A);
    w["size"] = json!(1u64 << 40);
    assert!(pypi_parse(&pypi_doc(json!({ "3.4.5": [w] })))
        .unwrap_err()
        .contains("sanity limit"));
    let w = wheel("3.4.6", "manylinux2014_x86_64", HEX_A);
    assert!(pypi_parse(&pypi_doc(json!({ "3.4.5": [w] })))
        .unwrap_err()
        .contains("is not a wheel of version 3.4.5"));
    let huge = vec![b' '; 17 << 20];
    assert!(pypi::parse("big", &huge, 13, &Version::deepep_min())
        .unwrap_err()
        .to_string()
        .contains("refusing to parse"));
}

#[test]
fn pypi_duplicate_versions_and_wheels() {
    let doc = pypi_doc(
        json!({ "3.4.5": [wheel("3.4.5", "manylinux2014_x86_64", HEX_A)], "3.4.5.0": [wheel("3.4.5.0", "manylinux2014_x86_64", HEX_A)] }),
    );
    let e = pypi_parse(&doc).unwrap_err();
    assert!(e.contains("duplicate") && e.contains("3.4.5.0"), "{e}");
    let doc = pypi_doc(
        json!({ "3.4.5": [wheel("3.4.5", "manylinux2014_x86_64", HEX_A), wheel("3.4.5", "manylinux_2_28_x86_64", HEX_B)] }),
    );
    let e = pypi_parse(&doc).unwrap_err();
    common::assert_contains_all(
        &e,
        &[
            "duplicate entry for 3.4.5 x86_64-linux cuda13 pypi",
            "manylinux_2_28",
        ],
    );
}

// ---- lock over several documents -------------------------------------------------------

#[test]
fn duplicate_nvidia_versions_are_refused() {
    let mut inputs = Inputs::default();
    let bytes = serde_json::to_vec(&manifest()).unwrap();
    inputs
        .nvidia
        .insert("redistrib_3.4.5.json".into(), bytes.clone());
    let mut other = manifest();
    other["libnvshmem"]["version"] = json!("3.4.5.0");
    inputs.nvidia.insert(
        "redistrib_3.4.5.0.json".into(),
        serde_json::to_vec(&other).unwrap(),
    );
    let e = build(&inputs, &BuildOptions::default())
        .unwrap_err()
        .to_string();
    common::assert_contains_all(
        &e,
        &[
            "duplicate",
            "redistrib_3.4.5.0.json",
            "redistrib_3.4.5.json",
        ],
    );
}

#[test]
fn lock_below_deepep_floor_is_refused() {
    let opts = BuildOptions {
        min_version: "3.2.5".parse().unwrap(),
        ..BuildOptions::default()
    };
    let e = build(&Inputs::default(), &opts).unwrap_err().to_string();
    assert!(e.contains("DeepEP") && e.contains("3.3.9"), "{e}");
    let repo = common::temp_repo_with_committed_data();
    let out = common::run_in(
        repo.path(),
        &["lock", "--offline", "--min-version", "3.2.5"],
    );
    assert_eq!(out.status.code(), Some(2));
    common::assert_stderr_contains(&out, "DeepEP requires");
}

#[test]
fn malformed_vendored_manifest_fails_lock_and_writes_nothing() {
    let repo = common::temp_repo_with_committed_data();
    let bad = repo
        .path()
        .join("pkgs/nvshmem/manifests/nvidia/redistrib_3.5.19.json");
    let text = std::fs::read_to_string(&bad)
        .unwrap()
        .replace("\"sha256\": \"fba5", "\"sha256\": \"XYZ5");
    std::fs::write(&bad, text).unwrap();
    let before = common::snapshot(repo.path());
    let out = common::run_in(repo.path(), &["lock", "--offline"]);
    assert_eq!(out.status.code(), Some(1));
    let err = common::stderr(&out);
    assert!(
        err.contains("redistrib_3.5.19.json") && err.contains("sha256"),
        "{err}"
    );
    assert_eq!(common::snapshot(repo.path()), before, "nothing written");
    let leftovers: Vec<_> = std::fs::read_dir(repo.path().join("pkgs/nvshmem"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".deepep-nix"))
        .collect();
    assert!(leftovers.is_empty());
}
