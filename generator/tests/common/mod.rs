//! Test helpers: a real HTTP/1.1 server on 127.0.0.1 serving recorded responses with
//! scripted failures, a temporary repository layout, and running the built binary.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the server does for a path.
#[derive(Clone, Debug)]
pub enum Behaviour {
    /// 200 with this body; honours `Range: bytes=N-` with 206 when `ranges` is set.
    Body { body: Vec<u8>, ranges: bool },
    /// A bare status with a short text body.
    Status(u16),
    /// Answer `status` for the first `n` requests, then behave like `then`.
    FailFirst {
        n: usize,
        status: u16,
        then: Box<Behaviour>,
    },
    /// Sleep before answering (to trigger client timeouts), then behave like `then`.
    Delay {
        delay: Duration,
        then: Box<Behaviour>,
    },
    /// Declare the full length but send only `sent` bytes, then close, for the first `n`
    /// requests; afterwards serve the body properly.
    Truncate {
        body: Vec<u8>,
        sent: usize,
        n: usize,
    },
    /// Declare the full length, send the first `sent` bytes, then go silent for `stall`
    /// (the connection stays open) before closing: a stalled body.
    Stall {
        body: Vec<u8>,
        sent: usize,
        stall: Duration,
    },
}

impl Behaviour {
    pub fn ok(body: impl Into<Vec<u8>>) -> Behaviour {
        Behaviour::Body {
            body: body.into(),
            ranges: true,
        }
    }
}

#[derive(Default)]
struct State {
    routes: HashMap<String, Behaviour>,
    hits: HashMap<String, usize>,
    ranges_seen: Vec<(String, u64)>,
}

/// A loopback HTTP server; stops when dropped (its thread is detached and idles).
pub struct Server {
    pub base: String,
    state: Arc<Mutex<State>>,
}

impl Server {
    pub fn start() -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let base = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let st = st.clone();
                std::thread::spawn(move || {
                    let _ = handle(conn, &st);
                });
            }
        });
        Server { base, state }
    }

    pub fn route(&self, path: &str, b: Behaviour) {
        self.state
            .lock()
            .unwrap()
            .routes
            .insert(path.to_string(), b);
    }

    pub fn hits(&self, path: &str) -> usize {
        *self.state.lock().unwrap().hits.get(path).unwrap_or(&0)
    }

    /// `(path, first byte)` of every request that carried a `Range` header.
    pub fn ranges(&self) -> Vec<(String, u64)> {
        self.state.lock().unwrap().ranges_seen.clone()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        206 => "Partial Content",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

fn respond(
    conn: &mut TcpStream,
    code: u16,
    extra: &str,
    body: &[u8],
    declared: usize,
) -> std::io::Result<()> {
    write!(
        conn,
        "HTTP/1.1 {code} {}\r\nContent-Length: {declared}\r\nConnection: close\r\n{extra}\r\n",
        reason(code)
    )?;
    conn.write_all(body)?;
    conn.flush()
}

fn handle(mut conn: TcpStream, st: &Arc<Mutex<State>>) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .to_string();
    let mut range_from: Option<u64> = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("range: bytes=") {
            range_from = v.trim().trim_end_matches('-').parse().ok();
        }
    }
    let (behaviour, hit) = {
        let mut s = st.lock().unwrap();
        let hit = {
            let h = s.hits.entry(path.clone()).or_insert(0);
            *h += 1;
            *h
        };
        if let Some(r) = range_from {
            s.ranges_seen.push((path.clone(), r));
        }
        (s.routes.get(&path).cloned(), hit)
    };
    let mut b = match behaviour {
        Some(b) => b,
        None => return respond(&mut conn, 404, "", b"not found", 9),
    };
    loop {
        match b {
            Behaviour::Status(code) => return respond(&mut conn, code, "", b"scripted", 8),
            Behaviour::FailFirst { n, status, then } => {
                if hit <= n {
                    return respond(&mut conn, status, "", b"scripted", 8);
                }
                b = *then;
            }
            Behaviour::Delay { delay, then } => {
                std::thread::sleep(delay);
                b = *then;
            }
            Behaviour::Truncate { body, sent, n } => {
                if hit <= n {
                    return respond(&mut conn, 200, "", &body[..sent], body.len());
                }
                b = Behaviour::ok(body);
            }
            Behaviour::Stall { body, sent, stall } => {
                respond(&mut conn, 200, "", &body[..sent], body.len())?;
                std::thread::sleep(stall);
                return Ok(());
            }
            Behaviour::Body { body, ranges } => {
                return match range_from {
                    Some(from) if ranges && (from as usize) < body.len() => {
                        let extra = format!(
                            "Content-Range: bytes {from}-{}/{}\r\n",
                            body.len() - 1,
                            body.len()
                        );
                        respond(
                            &mut conn,
                            206,
                            &extra,
                            &body[from as usize..],
                            body.len() - from as usize,
                        )
                    }
                    Some(_) if ranges => respond(&mut conn, 416, "", b"", 0),
                    _ => respond(&mut conn, 200, "", &body, body.len()),
                };
            }
        }
    }
}

/// The release selection the tests pin: `--version 3.4.5 --cuda 13 --system x86_64-linux`.
pub const SELECT_3_4_5: &[&str] = &[
    "--version",
    "3.4.5",
    "--cuda",
    "13",
    "--system",
    "x86_64-linux",
];

/// Runs the built `deepep-nix` with `args` in `cwd`, with network knobs suited to tests
/// (short timeouts and backoff) and no inherited repository or URL overrides.
pub fn run_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deepep-nix"))
        .args(args)
        .current_dir(cwd)
        .env_remove("DEEPEP_NIX_REPO")
        .env_remove("DEEPEP_NIX_NVIDIA_URL")
        .env_remove("DEEPEP_NIX_PYPI_URL")
        .env("DEEPEP_NIX_LOG", "warn")
        .output()
        .expect("run deepep-nix")
}

/// Runs an optional external tool (Nix's, which CI may not have here), asserting it succeeded.
/// When it is not installed: None, after a line saying the test is skipped and what covers it.
pub fn optional_tool(cmd: &mut Command, covered_by: &str) -> Option<Output> {
    let Ok(out) = cmd.output() else {
        let tool = cmd.get_program().to_string_lossy().into_owned();
        eprintln!("skipped: {tool} is not installed ({covered_by})");
        return None;
    };
    assert!(out.status.success(), "{}", stderr(&out));
    Some(out)
}

/// The entry of `version` in the lock (`pkgs/nvshmem/releases.json`) under `repo`.
pub fn locked_release(repo: &Path, version: &str) -> Option<serde_json::Value> {
    let text = std::fs::read(repo.join("pkgs/nvshmem/releases.json")).ok()?;
    let lock: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let releases = lock["releases"].as_array()?;
    releases.iter().find(|r| r["version"] == version).cloned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The repository root (the generator crate's parent).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every file below `dir` with its bytes (symlinks as their target), for before/after checks.
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        let mut entries: Vec<_> = rd.filter_map(|e| e.ok()).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let p = e.path();
            let rel = p.strip_prefix(base).unwrap().to_path_buf();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.file_type().is_symlink() {
                out.push((
                    rel,
                    std::fs::read_link(&p)
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes(),
                ));
            } else if meta.is_dir() {
                out.push((rel.clone(), b"<dir>".to_vec()));
                walk(base, &p, out);
            } else {
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out
}

/// Copies the committed `pkgs/nvshmem` into a fresh temporary repository.
pub fn temp_repo_with_committed_data() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    let src = repo_root().join("pkgs/nvshmem");
    for (rel, bytes) in snapshot(&src) {
        let dst = t.path().join("pkgs/nvshmem").join(&rel);
        if bytes == b"<dir>" {
            std::fs::create_dir_all(&dst).unwrap();
        } else if rel
            .extension()
            .is_some_and(|e| e == "json" || e == "nix" || e == "md")
        {
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::write(&dst, bytes).unwrap();
        }
    }
    t
}

/// Asserts that an error message states each cause once: no `": "`-separated part is
/// immediately repeated (as in `premature eof: premature eof`).
pub fn assert_causes_once(err: &str) {
    for line in err.lines() {
        let parts: Vec<&str> = line.split(": ").collect();
        for w in parts.windows(2) {
            assert_ne!(w[0].trim(), w[1].trim(), "cause printed twice in {line:?}");
        }
    }
}

/// Asserts that the command's stderr contains `needle`, printing the whole stderr if not.
#[track_caller]
pub fn assert_stderr_contains(out: &Output, needle: &str) {
    let err = stderr(out);
    assert!(err.contains(needle), "{needle:?} not in stderr:\n{err}");
}

/// Asserts that `text` contains every one of `needles`, naming the first one missing.
#[track_caller]
pub fn assert_contains_all(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "{needle:?} not in:\n{text}");
    }
}

/// The check `id` of a `deepep-nix doctor --json` report.
#[track_caller]
pub fn json_check<'a>(json: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    json["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {json}"))
}

/// Asserts that the command exited with `code` (printing its stderr if not) and returns its stderr.
#[track_caller]
pub fn assert_exit(out: &Output, code: i32) -> String {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(code), "{err}");
    err
}

/// `--file FILE --prefix PREFIX`: the arguments that install the local archive `file` into
/// `prefix`.
pub fn file_and_prefix<'a>(file: &'a Path, prefix: &'a Path) -> [&'a str; 4] {
    [
        "--file",
        file.to_str().unwrap(),
        "--prefix",
        prefix.to_str().unwrap(),
    ]
}
