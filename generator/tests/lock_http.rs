//! `lock` and `verify` against a real HTTP server on 127.0.0.1 serving recorded responses:
//! success, 404, 500 then success (retry), timeout, truncated body, and downloads with
//! resume, restart and hash mismatch.

mod common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::{run_in, snapshot, stderr, stdout, Behaviour, Server};

const NET: &[&str] = &["--retries", "3", "--backoff-ms", "10", "--timeout", "2"];

fn committed_manifest(v: &str) -> Vec<u8> {
    std::fs::read(
        common::repo_root().join(format!("pkgs/nvshmem/manifests/nvidia/redistrib_{v}.json")),
    )
    .unwrap()
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name),
    )
    .unwrap()
}

/// A server with NVIDIA's index (3.2.5 below the floor, 3.3.9, 3.4.5) and PyPI answers.
fn upstream() -> Server {
    let s = Server::start();
    let index = r#"<html><body>
<a href="redistrib_3.2.5.json">redistrib_3.2.5.json</a>
<a href="redistrib_3.3.9.json">redistrib_3.3.9.json</a>
<a href="redistrib_3.4.5.json">redistrib_3.4.5.json</a>
<a href="libnvshmem/">libnvshmem/</a>
</body></html>"#;
    s.route("/redist/", Behaviour::ok(index));
    s.route(
        "/redist/redistrib_3.3.9.json",
        Behaviour::ok(committed_manifest("3.3.9")),
    );
    s.route(
        "/redist/redistrib_3.4.5.json",
        Behaviour::ok(committed_manifest("3.4.5")),
    );
    s.route(
        "/pypi/nvidia-nvshmem-cu12/json",
        Behaviour::ok(fixture("pypi-cu12-raw.json")),
    );
    s.route(
        "/pypi/nvidia-nvshmem-cu13/json",
        Behaviour::ok(fixture("pypi-cu13-raw.json")),
    );
    s
}

fn lock_args<'a>(repo: &'a str, nv: &'a str, py: &'a str) -> Vec<&'a str> {
    let mut a = vec!["lock", "--repo", repo, "--nvidia-url", nv, "--pypi-url", py];
    a.extend_from_slice(NET);
    a
}

/// Runs `lock` in `repo` against the server's NVIDIA index and PyPI.
fn run_lock(s: &Server, repo: &Path) -> Output {
    let r = repo.to_str().unwrap();
    run_in(repo, &lock_args(r, &s.url("/redist/"), &s.url("/pypi")))
}

#[test]
fn lock_live_success_writes_vendored_lock_and_nix_deterministically() {
    let s = upstream();
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path().to_str().unwrap();
    let (nv, py) = (s.url("/redist/"), s.url("/pypi"));
    let out = run_in(repo.path(), &lock_args(r, &nv, &py));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        s.hits("/redist/redistrib_3.2.5.json"),
        0,
        "below --min-version: must not be fetched"
    );

    let data = repo.path().join("pkgs/nvshmem");
    // NVIDIA manifests are vendored verbatim.
    assert_eq!(
        std::fs::read(data.join("manifests/nvidia/redistrib_3.4.5.json")).unwrap(),
        committed_manifest("3.4.5")
    );
    // PyPI answers are vendored in reduced form: no placeholder release, canonical URLs.
    let cu13 =
        std::fs::read_to_string(data.join("manifests/pypi/nvidia-nvshmem-cu13.json")).unwrap();
    assert!(!cu13.contains("0.0.0a0") && !cu13.contains("../"), "{cu13}");
    assert!(cu13.contains("https://files.pythonhosted.org/packages/3c/35/a9bf80a609e74e3b000fef598933235c908fcefcef9026042b8e6dfde2a9/"));

    let lock: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("releases.json")).unwrap()).unwrap();
    let versions: Vec<&str> = lock["releases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["version"].as_str().unwrap())
        .collect();
    assert_eq!(versions, ["3.3.9", "3.4.5"]);
    let nv_art = &lock["releases"][1]["systems"]["x86_64-linux"]["13"]["nvidia"];
    assert_eq!(
        nv_art["url"],
        format!("{nv}libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.4.5_cuda13-archive.tar.xz")
    );
    assert_eq!(
        nv_art["hash"],
        "sha256-GPEoB8I7xbJwWBrx+br9VANp2ng+VXFxVYiHYj13hCw="
    );
    let py_art = &lock["releases"][1]["systems"]["x86_64-linux"]["13"]["pypi"];
    assert_eq!(
        py_art["sha256"],
        "290f0a2ee94c9f3687a02502f3b9299a9f9fe826e6d0287ee18482e78d495b80"
    );
    assert_eq!(py_art["size"], 60412546);
    let nix = std::fs::read_to_string(data.join("releases.nix")).unwrap();
    assert!(nix.contains("\"3.4.5\" = {") && nix.contains("deepep-nix render"));

    // Twice gives identical bytes; offline regeneration from the vendored files agrees.
    let before = snapshot(repo.path());
    let again = run_in(repo.path(), &lock_args(r, &nv, &py));
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(snapshot(repo.path()), before);
    let check = run_in(
        repo.path(),
        &[
            "lock",
            "--offline",
            "--check",
            "--repo",
            r,
            "--nvidia-url",
            &nv,
        ],
    );
    assert_eq!(
        check.status.code(),
        Some(0),
        "{}{}",
        stdout(&check),
        stderr(&check)
    );
}

/// Runs `lock` in a repository holding the committed data and asserts it fails (exit 1) and
/// leaves every file as it was.
fn lock_fails_writing_nothing(s: &Server) -> Output {
    let repo = common::temp_repo_with_committed_data();
    let before = snapshot(repo.path());
    let out = run_lock(s, repo.path());
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(snapshot(repo.path()), before);
    out
}

/// `lock` against `s` fails, writes nothing, and its stderr names every one of `needles`.
fn lock_fails_naming(s: &Server, needles: &[&str]) {
    common::assert_contains_all(&stderr(&lock_fails_writing_nothing(s)), needles);
}

#[test]
fn lock_404_fails_naming_the_url_and_writes_nothing() {
    let s = upstream();
    s.route("/redist/redistrib_3.4.5.json", Behaviour::Status(404));
    lock_fails_naming(&s, &["404", "redistrib_3.4.5.json"]);
    assert_eq!(
        s.hits("/redist/redistrib_3.4.5.json"),
        1,
        "404 is not retried"
    );
}

#[test]
fn lock_retries_500_then_succeeds() {
    let s = upstream();
    s.route(
        "/redist/redistrib_3.3.9.json",
        Behaviour::FailFirst {
            n: 2,
            status: 500,
            then: Box::new(Behaviour::ok(committed_manifest("3.3.9"))),
        },
    );
    let repo = tempfile::tempdir().unwrap();
    let out = run_lock(&s, repo.path());
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(s.hits("/redist/redistrib_3.3.9.json"), 3);
    assert!(
        stderr(&out).contains("500"),
        "retries are logged: {}",
        stderr(&out)
    );
    assert!(repo
        .path()
        .join("pkgs/nvshmem/manifests/nvidia/redistrib_3.3.9.json")
        .is_file());
}

#[test]
fn lock_gives_up_after_repeated_500() {
    let s = upstream();
    s.route("/pypi/nvidia-nvshmem-cu13/json", Behaviour::Status(503));
    let out = lock_fails_writing_nothing(&s);
    assert!(
        stderr(&out).contains("gave up after 4 attempts"),
        "--retries 3: {}",
        stderr(&out)
    );
    assert_eq!(s.hits("/pypi/nvidia-nvshmem-cu13/json"), 4);
}

#[test]
fn lock_times_out_and_writes_nothing() {
    let s = upstream();
    s.route(
        "/redist/",
        Behaviour::Delay {
            delay: Duration::from_secs(4),
            then: Box::new(Behaviour::ok("")),
        },
    );
    let repo = common::temp_repo_with_committed_data();
    let before = snapshot(repo.path());
    let r = repo.path().to_str().unwrap();
    let t0 = std::time::Instant::now();
    let out = run_in(
        repo.path(),
        &[
            "lock",
            "--repo",
            r,
            "--nvidia-url",
            &s.url("/redist/"),
            "--pypi-url",
            &s.url("/pypi"),
            "--timeout",
            "1",
            "--retries",
            "1",
            "--backoff-ms",
            "10",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("timed out"), "{}", stderr(&out));
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "the timeout bounds the wait: {:?}",
        t0.elapsed()
    );
    assert_eq!(snapshot(repo.path()), before);
}

#[test]
fn lock_retries_truncated_body() {
    let s = upstream();
    let body = committed_manifest("3.4.5");
    s.route(
        "/redist/redistrib_3.4.5.json",
        Behaviour::Truncate {
            sent: body.len() / 2,
            body: body.clone(),
            n: 1,
        },
    );
    let repo = tempfile::tempdir().unwrap();
    let out = run_lock(&s, repo.path());
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(s.hits("/redist/redistrib_3.4.5.json"), 2);
    assert_eq!(
        std::fs::read(
            repo.path()
                .join("pkgs/nvshmem/manifests/nvidia/redistrib_3.4.5.json")
        )
        .unwrap(),
        body
    );
}

#[test]
fn lock_fails_on_persistently_truncated_body() {
    let s = upstream();
    let body = committed_manifest("3.4.5");
    s.route(
        "/redist/redistrib_3.4.5.json",
        Behaviour::Truncate {
            sent: 100,
            body,
            n: 100,
        },
    );
    let out = lock_fails_writing_nothing(&s);
    let err = stderr(&out);
    assert!(
        err.contains("redistrib_3.4.5.json") && (err.contains("truncated") || err.contains("body")),
        "{err}"
    );
}

#[test]
fn lock_source_pypi_keeps_vendored_nvidia_manifests() {
    let s = upstream();
    let repo = common::temp_repo_with_committed_data();
    let r = repo.path().to_str().unwrap();
    let (nv, py) = (s.url("/redist/"), s.url("/pypi"));
    let mut args = lock_args(r, &nv, &py);
    args.extend_from_slice(&["--source", "pypi"]);
    let out = run_in(repo.path(), &args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(s.hits("/redist/"), 0, "nvidia is not fetched");
    assert_eq!(s.hits("/pypi/nvidia-nvshmem-cu13/json"), 1);
    let nvidia = repo.path().join("pkgs/nvshmem/manifests/nvidia");
    assert_eq!(
        std::fs::read_dir(nvidia).unwrap().count(),
        8,
        "all vendored NVIDIA manifests kept"
    );
}

// ---- verify: downloads --------------------------------------------------------------

/// A temp repo whose lock pins one x86_64 CUDA 13 wheel served by `s` at `/files/w.whl`.
fn repo_pinning(s: &Server, content: &[u8]) -> tempfile::TempDir {
    use sha2::Digest;
    let repo = tempfile::tempdir().unwrap();
    let dir = repo.path().join("pkgs/nvshmem/manifests/pypi");
    std::fs::create_dir_all(&dir).unwrap();
    let name = "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.whl";
    let doc = serde_json::json!({
        "info": { "name": "nvidia-nvshmem-cu13" },
        "releases": { "3.4.5": [ {
            "digests": { "sha256": hex::encode(sha2::Sha256::digest(content)) },
            "filename": name, "packagetype": "bdist_wheel", "size": content.len(),
            "upload_time_iso_8601": "2025-09-06T00:32:41.564932Z",
            "url": s.url(&format!("/files/{name}")), "yanked": false } ] }
    });
    std::fs::write(
        dir.join("nvidia-nvshmem-cu13.json"),
        serde_json::to_vec_pretty(&doc).unwrap(),
    )
    .unwrap();
    std::fs::create_dir_all(repo.path().join("pkgs/nvshmem/manifests/nvidia")).unwrap();
    let out = run_in(
        repo.path(),
        &["lock", "--offline", "--repo", repo.path().to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    repo
}

const WHEEL_PATH: &str = "/files/nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.whl";
const WHEEL_NAME: &str = "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.whl";

/// Runs `verify` of the 3.4.5 CUDA 13 x86_64 wheel pinned in `repo`, downloading into `dest`.
fn run_verify(repo: &Path, dest: &Path) -> Output {
    let (r, d) = (repo.to_str().unwrap(), dest.to_str().unwrap());
    let mut a = vec!["verify", "--repo", r, "--dest", d];
    a.extend_from_slice(common::SELECT_3_4_5);
    a.extend_from_slice(NET);
    run_in(repo, &a)
}

/// A server answering the wheel's URL with `served`, a repository whose lock pins `pinned`
/// at that URL, and an empty download directory.
fn verify_case(pinned: &[u8], served: Behaviour) -> (Server, tempfile::TempDir, tempfile::TempDir) {
    let s = Server::start();
    s.route(WHEEL_PATH, served);
    let repo = repo_pinning(&s, pinned);
    (s, repo, tempfile::tempdir().unwrap())
}

/// Runs `verify` and asserts it succeeded and left exactly `body` as the wheel in `dest`.
fn verify_downloads(repo: &Path, dest: &Path, body: &[u8]) -> Output {
    let out = run_verify(repo, dest);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read(dest.join(WHEEL_NAME)).unwrap(), body);
    out
}

/// Leaves `bytes` in `dest` as an interrupted download of the wheel.
fn write_partial(dest: &Path, bytes: &[u8]) {
    std::fs::write(dest.join(format!("{WHEEL_NAME}.part")), bytes).unwrap();
}

fn payload() -> Vec<u8> {
    (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect()
}

#[test]
fn verify_downloads_and_checks() {
    let body = payload();
    let (_s, repo, dest) = verify_case(
        &body,
        Behaviour::FailFirst {
            n: 1,
            status: 500,
            then: Box::new(Behaviour::ok(body.clone())),
        },
    );
    let out = verify_downloads(repo.path(), dest.path(), &body);
    assert!(stdout(&out).starts_with("OK "), "{}", stdout(&out));
    assert!(!dest.path().join(format!("{WHEEL_NAME}.part")).exists());
}

#[test]
fn verify_hash_mismatch_deletes_file_and_exits_2() {
    let pinned = payload();
    let mut served = pinned.clone();
    served[1234] ^= 0xff; // same size, different bytes
    let (_s, repo, dest) = verify_case(&pinned, Behaviour::ok(served.clone()));
    let out = run_verify(repo.path(), dest.path());
    let err = common::assert_exit(&out, 2);
    use sha2::Digest;
    let expected = hex::encode(sha2::Sha256::digest(&pinned));
    let actual = hex::encode(sha2::Sha256::digest(&served));
    assert!(
        err.contains(&expected) && err.contains(&actual) && err.contains("deleted"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(dest.path()).unwrap().count(),
        0,
        "no file and no .part left"
    );
}

#[test]
fn verify_resumes_a_partial_download_with_range() {
    let body = payload();
    let (s, repo, dest) = verify_case(&body, Behaviour::ok(body.clone()));
    write_partial(dest.path(), &body[..100_000]);
    verify_downloads(repo.path(), dest.path(), &body);
    assert_eq!(s.ranges(), vec![(WHEEL_PATH.to_string(), 100_000)]);
}

#[test]
fn verify_restarts_when_server_ignores_range() {
    let body = payload();
    let (_s, repo, dest) = verify_case(
        &body,
        Behaviour::Body {
            body: body.clone(),
            ranges: false,
        },
    );
    // A stale partial file with wrong bytes: the full 200 answer must replace it.
    write_partial(dest.path(), &[0u8; 50_000]);
    verify_downloads(repo.path(), dest.path(), &body);
}

#[test]
fn verify_resumes_after_a_dropped_connection() {
    let body = payload();
    let (s, repo, dest) = verify_case(
        &body,
        Behaviour::Truncate {
            body: body.clone(),
            sent: 120_000,
            n: 1,
        },
    );
    verify_downloads(repo.path(), dest.path(), &body);
    assert_eq!(s.hits(WHEEL_PATH), 2);
    assert_eq!(
        s.ranges().len(),
        1,
        "second request resumes: {:?}",
        s.ranges()
    );
}

/// Runs `verify --file file` in `repo`: the lock entry is found by the file's name.
fn verify_local(repo: &Path, file: &Path) -> Output {
    let (r, f) = (repo.to_str().unwrap(), file.to_str().unwrap());
    run_in(repo, &["verify", "--repo", r, "--file", f])
}

#[test]
fn verify_local_file_mismatch_keeps_the_users_file() {
    let s = Server::start();
    let body = payload();
    let repo = repo_pinning(&s, &body);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(WHEEL_NAME);
    std::fs::write(&file, &body[..1000]).unwrap();
    let out = verify_local(repo.path(), &file);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("size mismatch") && err.contains("300000 bytes") && err.contains("1000 bytes"),
        "{err}"
    );
    assert!(file.exists(), "a --file is the user's: not deleted");
    // A file name the lock does not know: usage error naming the fix.
    let other = dir.path().join("other.whl");
    std::fs::write(&other, b"x").unwrap();
    let out = verify_local(repo.path(), &other);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--version"), "{}", stderr(&out));
}

#[test]
fn verify_refuses_a_download_larger_than_pinned() {
    let pinned = payload();
    let mut served = pinned.clone();
    served.extend_from_slice(&[0u8; 70_000]);
    let (_s, repo, dest) = verify_case(&pinned, Behaviour::ok(served));
    let out = run_verify(repo.path(), dest.path());
    common::assert_exit(&out, 2);
    assert!(
        stderr(&out).contains("size mismatch") && stderr(&out).contains("deleted"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read_dir(dest.path()).unwrap().count(), 0);
}

// ---- hostile upstream metadata (issue 12): each is refused, names the problem, writes nothing

const SHA_A: &str = "18f12807c23bc5b270581af1f9bafd540369da783e557171558887623d77842c";
const SHA_B: &str = "c06d44aa15eed01299366509788daf174456d492df94c8a616766c43b819afab";

/// An NVIDIA leaf `{relative_path, sha256, size}` as JSON text.
fn leaf(rel: &str, sha: &str) -> String {
    format!(r#"{{ "relative_path": "{rel}", "sha256": "{sha}", "size": "1000" }}"#)
}

/// NVIDIA's archive path for `version` and a CUDA major on x86_64.
fn archive_path(version: &str, cuda: u32) -> String {
    format!("libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-{version}_cuda{cuda}-archive.tar.xz")
}

/// A manifest in NVIDIA's schema as text (so duplicate keys survive); `platform` is the body
/// of `linux-x86_64`. With `variants`, `cuda_variant` lists 12 and 13.
fn manifest_text(version: &str, variants: bool, platform: &str) -> String {
    let cv = if variants {
        r#""cuda_variant": ["12", "13"],"#
    } else {
        ""
    };
    format!(
        "{{\n\"release_date\": \"2025-09-06\",\n\"release_label\": \"{version}\",\n\"release_product\": \"nvshmem\",\n\
         \"libnvshmem\": {{\n\"name\": \"NVIDIA NVSHMEM\",\n\"version\": \"{version}\",\n{cv}\n\"linux-x86_64\": {{\n{platform}\n}}\n}}\n}}\n"
    )
}

/// A PyPI answer for `nvidia-nvshmem-cu<cuda>` with one 3.4.5 wheel.
fn pypi_doc(cuda: u32, filename: &str, url: &str) -> Vec<u8> {
    serde_json::to_vec_pretty(&serde_json::json!({
        "info": { "name": format!("nvidia-nvshmem-cu{cuda}") },
        "releases": { "3.4.5": [ {
            "digests": { "sha256": SHA_A }, "filename": filename, "packagetype": "bdist_wheel",
            "size": 1000, "upload_time_iso_8601": "2025-09-06T00:00:00Z", "url": url, "yanked": false } ] }
    }))
    .unwrap()
}

#[test]
fn lock_refuses_percent_encoded_traversal_in_paths_and_urls() {
    for rel in [
        "libnvshmem/linux-x86_64/%2e%2e/%2e%2e/%2e%2e/secret/x_cuda13-archive.tar.xz",
        "libnvshmem/linux-x86_64/%2E%2E%2F%2E%2E%2Fsecret%2Fx_cuda13-archive.tar.xz",
        "libnvshmem/linux-x86_64/%252e%252e/x_cuda13-archive.tar.xz",
    ] {
        let s = upstream();
        let m = manifest_text("3.4.5", true, &format!("\"cuda13\": {}", leaf(rel, SHA_A)));
        s.route("/redist/redistrib_3.4.5.json", Behaviour::ok(m));
        let out = lock_fails_writing_nothing(&s);
        let err = stderr(&out);
        assert!(
            err.contains("redistrib_3.4.5.json")
                && err.contains("relative_path")
                && err.contains(rel),
            "{rel}: {err}"
        );
    }
    // The same rule for a PyPI file URL.
    let name = "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.whl";
    let s = upstream();
    s.route(
        "/pypi/nvidia-nvshmem-cu13/json",
        Behaviour::ok(pypi_doc(
            13,
            name,
            &format!("https://files.pythonhosted.org/packages/%2e%2e/%2e%2e/{name}"),
        )),
    );
    lock_fails_naming(&s, &["nvidia-nvshmem-cu13", "url", ".."]);
}

#[test]
fn lock_refuses_a_wheel_filename_that_is_not_a_plain_file_name() {
    let name = "../../../tmp/nvidia_nvshmem_cu12-3.4.5-py3-none-manylinux2014_x86_64.whl";
    let s = upstream();
    s.route(
        "/pypi/nvidia-nvshmem-cu12/json",
        Behaviour::ok(pypi_doc(
            12,
            name,
            "https://files.pythonhosted.org/packages/aa/bb/cc/nvidia_nvshmem_cu12-3.4.5-py3-none-manylinux2014_x86_64.whl",
        )),
    );
    lock_fails_naming(&s, &["filename", name, "plain file name"]);
}

#[test]
fn lock_refuses_an_index_listing_one_version_under_two_names() {
    let s = upstream();
    s.route(
        "/redist/",
        Behaviour::ok(
            r#"<a href="redistrib_3.4.5.json">x</a> <a href="redistrib_3.9.0.json">x</a>
               <a href="redistrib_3.9.0.0.json">x</a>"#,
        ),
    );
    for (name, sha) in [("3.9.0", SHA_A), ("3.9.0.0", SHA_B)] {
        let m = manifest_text(
            "3.9.0",
            true,
            &format!("\"cuda13\": {}", leaf(&archive_path("3.9.0", 13), sha)),
        );
        s.route(&format!("/redist/redistrib_{name}.json"), Behaviour::ok(m));
    }
    lock_fails_naming(
        &s,
        &[
            "duplicate",
            "redistrib_3.9.0.json",
            "redistrib_3.9.0.0.json",
        ],
    );
}

#[test]
fn lock_refuses_duplicate_json_keys_naming_both() {
    let s = upstream();
    let platform = format!(
        "\"cuda12\": {},\n\"cuda13\": {},\n\"cuda13\": {}",
        leaf(&archive_path("3.4.5", 12), SHA_A),
        leaf(&archive_path("3.4.5", 13), SHA_A),
        leaf(&archive_path("3.4.5", 13), SHA_B)
    );
    s.route(
        "/redist/redistrib_3.4.5.json",
        Behaviour::ok(manifest_text("3.4.5", true, &platform)),
    );
    lock_fails_naming(
        &s,
        &[
            "duplicate",
            "libnvshmem.linux-x86_64.cuda13",
            "line 11",
            "line 12",
        ],
    );
    // In a PyPI answer too (a release key twice; JSON escapes do not hide it).
    let one = String::from_utf8(pypi_doc(
        13,
        "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.whl",
        "https://files.pythonhosted.org/packages/aa/bb/cc/nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.whl",
    ))
    .unwrap();
    let releases = one.find("\"3.4.5\"").unwrap();
    let doubled = format!(
        "{}\"3.4.5\": [],\n    \"3\\u002e4.5\"{}",
        &one[..releases],
        &one[releases + "\"3.4.5\"".len()..]
    );
    let s = upstream();
    s.route("/pypi/nvidia-nvshmem-cu13/json", Behaviour::ok(doubled));
    lock_fails_naming(&s, &["duplicate", "releases.3.4.5", "nvidia-nvshmem-cu13"]);
}

#[test]
fn lock_accepts_cuda_keyed_platforms_without_cuda_variant() {
    let s = upstream();
    let platform = format!(
        "\"cuda12\": {},\n\"cuda13\": {}",
        leaf(&archive_path("3.4.5", 12), SHA_A),
        leaf(&archive_path("3.4.5", 13), SHA_B)
    );
    s.route(
        "/redist/redistrib_3.4.5.json",
        Behaviour::ok(manifest_text("3.4.5", false, &platform)),
    );
    let repo = tempfile::tempdir().unwrap();
    let out = run_lock(&s, repo.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let r = common::locked_release(repo.path(), "3.4.5").expect("3.4.5 locked");
    assert_eq!(
        r["systems"]["x86_64-linux"]["12"]["nvidia"]["sha256"],
        SHA_A
    );
    assert_eq!(
        r["systems"]["x86_64-linux"]["13"]["nvidia"]["sha256"],
        SHA_B
    );

    // A platform that is neither a leaf nor keyed by CUDA major: the message says so.
    let s = upstream();
    s.route(
        "/redist/redistrib_3.4.5.json",
        Behaviour::ok(manifest_text(
            "3.4.5",
            false,
            &format!("\"sha256\": \"{SHA_A}\""),
        )),
    );
    lock_fails_naming(
        &s,
        &["libnvshmem.linux-x86_64", "relative_path", "cuda<major>"],
    );
}

#[test]
fn verify_404_hint_names_only_flags_verify_has() {
    let body = payload();
    let (_s, repo, dest) = verify_case(&body, Behaviour::Status(404));
    let out = run_verify(repo.path(), dest.path());
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("404")
            && err.contains("--file")
            && !err.contains("--nvidia-url")
            && !err.contains("--pypi-url"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(dest.path()).unwrap().count(), 0);
}

#[test]
fn verify_reports_a_stalled_body_as_a_timeout() {
    let body = payload();
    let (_s, repo, dest) = verify_case(
        &body,
        Behaviour::Stall {
            body: body.clone(),
            sent: 1000,
            stall: Duration::from_secs(6),
        },
    );
    let (r, d) = (repo.path().to_str().unwrap(), dest.path().to_str().unwrap());
    let mut a = vec![
        "verify",
        "--repo",
        r,
        "--dest",
        d,
        "--timeout",
        "1",
        "--retries",
        "0",
    ];
    a.extend_from_slice(common::SELECT_3_4_5);
    let t0 = std::time::Instant::now();
    let out = run_in(repo.path(), &a);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("timed out") && !err.contains("decoding"),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(!dest.path().join(WHEEL_NAME).exists());
}

#[test]
fn a_hand_edited_lock_with_an_encoded_traversal_is_refused_on_load() {
    let repo = common::temp_repo_with_committed_data();
    let lock = repo.path().join("pkgs/nvshmem/releases.json");
    let text = std::fs::read_to_string(&lock).unwrap();
    let edited = text.replacen(
        "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/",
        "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/%2e%2e/%2e%2e/",
        1,
    );
    assert_ne!(edited, text);
    std::fs::write(&lock, &edited).unwrap();
    let before = snapshot(repo.path());
    let out = run_in(repo.path(), &["releases", "--brief"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    common::assert_contains_all(&err, &["releases.json", "..", "deepep-nix lock --offline"]);
    assert_eq!(snapshot(repo.path()), before);
}

#[test]
fn a_lock_whose_hash_and_sha256_disagree_names_both_and_the_fix() {
    let repo = common::temp_repo_with_committed_data();
    let lock = repo.path().join("pkgs/nvshmem/releases.json");
    let text = std::fs::read_to_string(&lock).unwrap();
    // The first artifact's sha256 (the "inputs" before the releases hash the manifests).
    let releases = &text[text.find("\"releases\"").unwrap()..];
    let at = releases.find("\"sha256\": \"").unwrap() + 11;
    let sha = &releases[at..at + 64];
    let flipped = format!("{}{}", if &sha[..1] == "0" { "1" } else { "0" }, &sha[1..]);
    let edited = text.replacen(sha, &flipped, 1);
    assert_ne!(edited, text);
    std::fs::write(&lock, &edited).unwrap();
    let out = run_in(repo.path(), &["releases", "--brief"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "and sha256 {flipped} disagree (the sha256 as an SRI hash is sha256-"
        )) && err.contains("git checkout -- pkgs/nvshmem/releases.json")
            && err.contains("deepep-nix lock --offline"),
        "{err}"
    );
    // The fix it names works: the lock regenerated from the vendored manifests loads again.
    let out = run_in(repo.path(), &["lock", "--offline"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(run_in(repo.path(), &["releases", "--brief"])
        .status
        .success());
}

#[test]
fn lock_with_nvidia_unreachable_suggests_source_pypi_which_works() {
    let s = upstream();
    let repo = common::temp_repo_with_committed_data();
    let r = repo.path().to_str().unwrap();
    let py = s.url("/pypi");
    // Nothing listens on port 1 of the loopback: NVIDIA's index is refused at once.
    let out = run_in(
        repo.path(),
        &lock_args(r, "http://127.0.0.1:1/redist/", &py),
    );
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    common::assert_contains_all(
        &err,
        &[
            "127.0.0.1:1",
            "`deepep-nix lock --source pypi` refreshes PyPI's wheels alone",
        ],
    );
    let mut a = lock_args(r, "http://127.0.0.1:1/redist/", &py);
    a.extend_from_slice(&["--source", "pypi"]);
    let out = run_in(repo.path(), &a);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn verify_with_nvidia_unreachable_suggests_the_pypi_wheel() {
    let s = Server::start();
    let body = payload();
    s.route(WHEEL_PATH, Behaviour::ok(body.clone()));
    // A lock pinning both: NVIDIA's tarball at an address that refuses, the wheel on `s`.
    let repo = repo_pinning(&s, &body);
    let m = repo.path().join("pkgs/nvshmem/manifests/nvidia");
    let nv = serde_json::json!({ "release_date": "2025-09-06", "release_label": "3.4.5", "release_product": "nvshmem",
        "libnvshmem": { "version": "3.4.5", "cuda_variant": ["13"], "linux-x86_64": { "cuda13": {
            "relative_path": "libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.4.5_cuda13-archive.tar.xz",
            "sha256": "00".repeat(32), "size": "10" } } } });
    std::fs::write(
        m.join("redistrib_3.4.5.json"),
        serde_json::to_vec_pretty(&nv).unwrap(),
    )
    .unwrap();
    let r = repo.path().to_str().unwrap();
    let out = run_in(
        repo.path(),
        &[
            "lock",
            "--offline",
            "--repo",
            r,
            "--nvidia-url",
            "http://127.0.0.1:1/",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let dest = tempfile::tempdir().unwrap();
    let d = dest.path().to_str().unwrap();
    let mut a = vec!["verify", "--repo", r, "--dest", d];
    a.extend_from_slice(common::SELECT_3_4_5);
    a.extend_from_slice(&["--source", "nvidia"]);
    a.extend_from_slice(NET);
    let out = run_in(repo.path(), &a);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    let want = format!("deepep-nix verify --version 3.4.5 --cuda 13 --system x86_64-linux --source pypi --repo {r} --dest {d}");
    assert!(
        err.contains("127.0.0.1:1") && err.contains(&format!("`{want}`")),
        "{err}"
    );
    let words: Vec<&str> = want
        .split_whitespace()
        .skip(1)
        .chain(NET.iter().copied())
        .collect();
    let out = run_in(repo.path(), &words);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read(dest.path().join(WHEEL_NAME)).unwrap(), body);
}
