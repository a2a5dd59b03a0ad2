//! Command-line interface (clap derive). Each subcommand's logic lives in a library module;
//! this file parses arguments, picks data locations and prints results.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::error::{Error, Result};
use crate::generate::{self, Upstream};
use crate::http::{Http, HttpConfig};
use crate::lock::BuildOptions;
use crate::model::SourceKind;
use crate::output::{has_drift, FileStatus, Plan};
use crate::repo::{self, RepoPaths};
use crate::version::{self, Version};

/// Writes to stdout; a closed pipe (`deepep-nix releases | head`) ends the process quietly
/// instead of panicking like `print!` does.
fn write_stdout(args: std::fmt::Arguments) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|_| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {e}");
        std::process::exit(1);
    }
}

macro_rules! out {
    ($($t:tt)*) => { write_stdout(format_args!($($t)*)) };
}

macro_rules! outln {
    ($($t:tt)*) => { write_stdout(format_args!("{}\n", format_args!($($t)*))) };
}

const AFTER_HELP: &str = "\
Data location: --repo DIR (or DEEPEP_NIX_REPO) names the checkout; otherwise the nearest directory \
at or above the current one that contains pkgs/nvshmem is used; otherwise the NVSHMEM snapshot \
embedded in this binary is read (commands that write then need --repo). Inside a checkout, data \
missing on disk falls back to the embedded snapshot.

Exit codes: 0 success, 1 failure (or drift with --check), 2 verification failure or usage error.";

/// Pin NVIDIA NVSHMEM releases (>= 3.3.9, as DeepEP requires) from upstream, render them as
/// Nix data, verify and install releases, and check a host.
#[derive(Debug, Parser)]
#[command(name = "deepep-nix", version, after_help = AFTER_HELP)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Resolve releases from upstream (or the vendored snapshot) and write the vendored
    /// manifests, the lock pkgs/nvshmem/releases.json and the rendered releases.nix.
    Lock(LockArgs),
    /// Render pkgs/nvshmem/releases.nix from the lock (tera template, compiled in).
    Render(RenderArgs),
    /// List the locked releases per system and CUDA major, marking gaps.
    Releases(ReleasesArgs),
    /// Download pinned artifacts (or take local files with --file) and check their size and
    /// sha256 against the lock.
    Verify(VerifyArgs),
    /// Print a file's sha256 as hex, Nix base-32 and SRI, or a directory's NAR hash.
    Hash(HashArgs),
    /// Download, verify and unpack a release into a prefix; print the shell exports.
    Install(InstallArgs),
    /// Print the shell exports for an existing install (NVSHMEM_DIR, LD_LIBRARY_PATH, PATH).
    Env(EnvArgs),
    /// Check this host for what DeepEP-style EP needs (GPU, driver, NVSHMEM, IBGDA, gdrdrv).
    Doctor(crate::doctor::DoctorArgs),
}

/// Where the checkout is.
#[derive(Debug, Clone, Args)]
pub struct RepoArgs {
    /// Repository checkout to use. Default: the nearest directory at or above the
    /// current one that contains pkgs/nvshmem; without one, read-only commands use the
    /// snapshot embedded in this binary and writing commands need this option.
    #[arg(long, env = "DEEPEP_NIX_REPO", value_name = "DIR")]
    pub repo: Option<PathBuf>,
}

/// Where upstream metadata lives (only `lock` reads it; `verify`/`install` use the URLs in
/// the lock).
#[derive(Debug, Clone, Args)]
pub struct UpstreamArgs {
    /// Base URL of NVIDIA's NVSHMEM redist (index page, redistrib_<version>.json, and the
    /// base that manifests' relative_path is appended to in the lock).
    #[arg(long, env = "DEEPEP_NIX_NVIDIA_URL", default_value = crate::nvidia::DEFAULT_REDIST_URL, value_name = "URL")]
    pub nvidia_url: String,
    /// Base URL of PyPI's JSON API (<URL>/<package>/json).
    #[arg(long, env = "DEEPEP_NIX_PYPI_URL", default_value = crate::pypi::DEFAULT_PYPI_URL, value_name = "URL")]
    pub pypi_url: String,
}

impl UpstreamArgs {
    pub fn upstream(&self) -> Upstream {
        Upstream {
            nvidia_url: self.nvidia_url.clone(),
            pypi_url: self.pypi_url.clone(),
        }
    }
}

/// Network settings shared by the commands that download.
#[derive(Debug, Clone, Args)]
pub struct NetArgs {
    /// Seconds to wait for a connection, for response headers, or for the next body bytes.
    #[arg(long, default_value_t = 30, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// Retries after a failed attempt (connection error, timeout, truncated body, HTTP 5xx/429),
    /// backing off exponentially (0.5 s, 1 s, 2 s, ...). Other HTTP errors are not retried.
    #[arg(long, default_value_t = 3, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=10))]
    pub retries: u32,
    /// First backoff delay in milliseconds (doubles after each failed attempt).
    #[arg(long, default_value_t = 500, value_name = "MS", hide = true)]
    pub backoff_ms: u64,
}

impl NetArgs {
    /// `not_found_hint` says what to do about a 4xx answer, naming only the command's flags.
    pub fn http(&self, progress: bool, not_found_hint: &str) -> Result<Http> {
        Http::new(HttpConfig {
            timeout: Duration::from_secs(self.timeout),
            attempts: self.retries + 1,
            backoff: Duration::from_millis(self.backoff_ms),
            progress,
            not_found_hint: not_found_hint.to_string(),
        })
    }
}

#[derive(Debug, Clone, Args)]
pub struct LockArgs {
    #[command(flatten)]
    pub repo: RepoArgs,
    #[command(flatten)]
    pub upstream: UpstreamArgs,
    #[command(flatten)]
    pub net: NetArgs,
    /// Oldest release to lock. Versions below 3.3.9 are refused: DeepEP requires NVSHMEM >= 3.3.9.
    #[arg(long, default_value = version::DEEPEP_MIN_NVSHMEM, value_name = "VERSION")]
    pub min_version: String,
    /// Sources to fetch live (repeatable; default: both). Sources not fetched are read from
    /// the vendored snapshot. Ignored with --offline.
    #[arg(long = "source", value_enum, value_name = "SOURCE")]
    pub sources: Vec<SourceKind>,
    /// Use the vendored manifests only; no network.
    #[arg(long)]
    pub offline: bool,
    /// Write nothing; print which files would change and exit 1 if any would.
    #[arg(long)]
    pub check: bool,
}

#[derive(Debug, Clone, Args)]
pub struct RenderArgs {
    #[command(flatten)]
    pub repo: RepoArgs,
    /// Write the Nix data here instead of <repo>/pkgs/nvshmem/releases.nix; `-` prints it.
    /// Without a checkout the default is `-`.
    #[arg(long, short, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Write nothing; exit 1 if releases.nix is not what the lock renders to.
    #[arg(long)]
    pub check: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ReleasesArgs {
    #[command(flatten)]
    pub repo: RepoArgs,
    /// Print JSON (every cell with its sources, gap and artifacts) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Only the table and the gaps, without the list of artifacts (SRI hash, size, file name).
    #[arg(long)]
    pub brief: bool,
}

/// Which locked artifact: shared by `verify` and `install`.
#[derive(Debug, Clone, Args)]
pub struct SelectArgs {
    /// NVSHMEM release, e.g. 3.4.5 (with --file: read from the file name).
    #[arg(long = "version", value_name = "VERSION")]
    pub nvshmem_version: Option<String>,
    /// CUDA major: 12 or 13 (with --file: read from the file name).
    #[arg(long, value_parser = ["12", "13"])]
    pub cuda: Option<String>,
    /// Nix system [default: with --file, what its name says; else this machine's].
    #[arg(long, value_parser = ["x86_64-linux", "aarch64-linux"])]
    pub system: Option<String>,
    /// Artifact source [default: with --file, what its name or extension says; else nvidia
    /// when the lock pins it, else pypi].
    #[arg(long, value_enum)]
    pub source: Option<SourceKind>,
}

impl SelectArgs {
    fn selector(&self) -> Result<crate::verify::Selector> {
        Ok(crate::verify::Selector {
            version: self
                .nvshmem_version
                .as_deref()
                .map(str::parse)
                .transpose()?,
            system: self.system.as_deref().map(str::parse).transpose()?,
            cuda: self
                .cuda
                .as_deref()
                .map(|c| c.parse().expect("validated by clap")),
            source: self.source,
        })
    }
}

/// The lock, the artifact of it and how to download it: shared by `verify` and `install`.
#[derive(Debug, Clone, Args)]
pub struct PinnedArgs {
    #[command(flatten)]
    pub repo: RepoArgs,
    #[command(flatten)]
    pub net: NetArgs,
    #[command(flatten)]
    pub select: SelectArgs,
}

impl PinnedArgs {
    /// The lock (the checkout's, else the snapshot embedded in this binary) and the selector the
    /// flags give.
    fn lock_and_selector(&self) -> Result<(crate::lock::Lock, crate::verify::Selector)> {
        let found = repo::find_repo(self.repo.repo.as_deref())?;
        let (lock, _, _) = repo::read_lock(found.as_ref())?;
        Ok((lock, self.select.selector()?))
    }
}

#[derive(Debug, Clone, Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub pinned: PinnedArgs,
    /// Local file to verify instead of downloading (repeatable). Its lock entry is found by
    /// its file name; --version/--cuda/--system/--source, if given, must agree with the name.
    /// A file the lock does not name needs --version and --cuda (its extension gives the
    /// source). A local file that fails is left in place.
    #[arg(long = "file", value_name = "PATH")]
    pub files: Vec<PathBuf>,
    /// Directory to download into (resumes <name>.part; a file that fails is deleted).
    #[arg(long, default_value = ".", value_name = "DIR")]
    pub dest: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct HashArgs {
    /// Files (flat sha256) or directories (NAR sha256, as `nix hash path` / fetchzip).
    #[arg(required_unless_present = "convert", value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    /// Convert a sha256 given as hex, Nix base-32 or SRI into all three forms.
    #[arg(long, value_name = "HASH", conflicts_with = "paths")]
    pub convert: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct InstallArgs {
    #[command(flatten)]
    pub pinned: PinnedArgs,
    /// Install into this directory (must not exist or be empty, unless --replace); missing
    /// parents are created, and removed again if the install fails or is interrupted. An
    /// existing directory (a mount point, or one in a parent you cannot write) is kept and
    /// filled from a staging directory inside it; nothing is written beside it.
    #[arg(long, value_name = "DIR")]
    pub prefix: PathBuf,
    /// Use this local archive (.tar.xz or .whl) instead of downloading. As with `verify
    /// --file`, its release, CUDA major, system and source are read from its file name (flags
    /// given must agree), and it is verified against that artifact's pinned hash first. A
    /// build for another system than this machine's needs --system.
    #[arg(long, value_name = "PATH")]
    pub file: Option<PathBuf>,
    /// Download cache [default: $XDG_CACHE_HOME/deepep-nix or ~/.cache/deepep-nix].
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// Replace an earlier NVSHMEM install in --prefix (a directory with
    /// lib/libnvshmem_host.so.3 and at its top only bin/ include/ lib/ share/, LICENSE*
    /// files and what the archive has at its top), swapped only after the new tree is
    /// complete; says what it removed. Anything else is refused.
    #[arg(long)]
    pub replace: bool,
    /// Bound on the unpacked size (bytes, or with K/M/G/T: powers of 1024)
    /// [default: 16 times the archive's size].
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub max_unpacked_size: Option<u64>,
    /// Syntax of the printed exports.
    #[arg(long, value_enum, default_value = "sh")]
    pub shell: crate::install::Shell,
}

#[derive(Debug, Clone, Args)]
pub struct EnvArgs {
    /// An install made by `deepep-nix install`.
    #[arg(long, value_name = "DIR")]
    pub prefix: PathBuf,
    /// Syntax of the exports.
    #[arg(long, value_enum, default_value = "sh")]
    pub shell: crate::install::Shell,
}

/// Prints statuses; with `check`, reports drift on stderr and returns exit code 1.
fn finish(statuses: &[FileStatus], check: bool, fix: &str) -> i32 {
    for s in statuses {
        outln!("{s}");
    }
    if check && has_drift(statuses) {
        let n = statuses
            .iter()
            .filter(|s| s.status != crate::output::Status::Unchanged)
            .count();
        eprintln!(
            "drift: {n} file(s) differ from what `{fix}` would write; run it and commit the result"
        );
        1
    } else {
        0
    }
}

fn writable_repo(args: &RepoArgs) -> Result<RepoPaths> {
    repo::find_repo(args.repo.as_deref())?.ok_or_else(|| {
        Error::Usage("no checkout found (no pkgs/nvshmem at or above the current directory); run inside the repository or pass --repo DIR".into())
    })
}

fn run_plan(plan: &Plan, check: bool, fix: &str) -> Result<i32> {
    let statuses = if check {
        plan.statuses()?
    } else {
        plan.apply()?
    };
    Ok(finish(&statuses, check, fix))
}

pub fn lock(args: &LockArgs) -> Result<i32> {
    let min: Version = args.min_version.parse()?;
    version::check_min_version(&min)?;
    let repo = writable_repo(&args.repo)?;
    let (vendored, origin) = repo::read_inputs(Some(&repo))?;
    tracing::info!("vendored manifests from {origin}");
    let inputs = if args.offline {
        vendored
    } else {
        let live = if args.sources.is_empty() {
            SourceKind::ALL.to_vec()
        } else {
            args.sources.clone()
        };
        generate::refresh_inputs(
            vendored,
            &live,
            &args.net.http(
                false,
                "check the version and the base URL (--nvidia-url / --pypi-url)",
            )?,
            &args.upstream.upstream(),
            &min,
        )
        .map_err(|e| lock_pypi_hint(e, &args.upstream.nvidia_url, &live))?
    };
    let opts = BuildOptions {
        min_version: min,
        nvidia_url: args.upstream.nvidia_url.clone(),
    };
    let (plan, lock) = generate::plan_lock(&repo, &inputs, &opts)?;
    let fix = if args.offline {
        "deepep-nix lock --offline"
    } else {
        "deepep-nix lock"
    };
    let code = run_plan(&plan, args.check, fix)?;
    if !args.check {
        outln!(
            "locked {} releases ({} to {})",
            lock.releases.len(),
            lock.releases.first().map_or("-", |r| &r.version),
            lock.releases.last().map_or("-", |r| &r.version)
        );
    }
    Ok(code)
}

pub fn render(args: &RenderArgs) -> Result<i32> {
    let found = repo::find_repo(args.repo.repo.as_deref())?;
    let (lock, bytes, origin) = repo::read_lock(found.as_ref())?;
    tracing::info!("lock from {origin}");
    let target = match (&args.output, &found) {
        (Some(p), _) => p.clone(),
        (None, Some(r)) => r.nix(),
        (None, None) => PathBuf::from("-"),
    };
    if target.as_os_str() == "-" {
        if args.check {
            return Err(Error::Usage(
                "--check compares a file; it cannot be combined with --output -".into(),
            ));
        }
        out!("{}", crate::render::render_releases_nix(&lock, &bytes)?);
        return Ok(0);
    }
    let mut plan = Plan::default();
    plan.write(target, crate::render::render_releases_nix(&lock, &bytes)?);
    run_plan(&plan, args.check, "deepep-nix render")
}

pub fn releases(args: &ReleasesArgs) -> Result<i32> {
    let found = repo::find_repo(args.repo.repo.as_deref())?;
    let (lock, _, origin) = repo::read_lock(found.as_ref())?;
    let rows = crate::releases::rows(&lock);
    if args.json {
        let doc = serde_json::json!({ "lock": origin.to_string(), "releases": rows });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("serialisable")
        );
    } else {
        outln!("lock: {origin}\n");
        out!("{}", crate::releases::table(&rows, !args.brief));
    }
    Ok(0)
}

fn print_json(v: &serde_json::Value) {
    outln!("{}", serde_json::to_string_pretty(v).expect("serialisable"));
}

pub fn verify(args: &VerifyArgs) -> Result<i32> {
    use crate::verify::{self as v, OnMismatch};
    let (lock, sel) = args.pinned.lock_and_selector()?;
    let mut report = Vec::new();
    if args.files.is_empty() {
        let pinned = v::select(&lock, &sel)?;
        let http = args.pinned.net.http(true, PINNED_URL_HINT)?;
        let path = v::fetch_verified(&http, &pinned, &args.dest)
            .map_err(|e| verify_pypi_hint(e, &lock, &pinned, args))?;
        report.push((pinned, path));
    } else {
        for file in &args.files {
            let pinned = v::resolve_file(&lock, &sel, file)?;
            v::check_file(file, &pinned.artifact, OnMismatch::Keep)?;
            report.push((pinned, file.clone()));
        }
    }
    if args.json {
        let items: Vec<_> = report.iter().map(|(p, path)| serde_json::json!({
            "path": path, "version": p.version, "system": p.system, "cuda": p.cuda, "source": p.source,
            "sha256": p.artifact.sha256, "hash": p.artifact.hash, "size": p.artifact.size, "ok": true,
        })).collect();
        print_json(&serde_json::Value::Array(items));
    } else {
        for (p, path) in &report {
            outln!(
                "OK {} ({}; sha256 {})",
                path.display(),
                p.describe(),
                p.artifact.sha256
            );
        }
    }
    Ok(0)
}

/// What a non-regular file is, for messages.
fn file_kind(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_dir() {
        "a symlink to a directory (pass the directory itself for its NAR hash)"
    } else {
        "not a regular file"
    }
}

pub fn hash(args: &HashArgs) -> Result<i32> {
    use crate::hash::Sha256;
    let mut items = Vec::new();
    if let Some(h) = &args.convert {
        let d = Sha256::parse_any(h).map_err(|e| Error::Usage(format!("--convert: {e}")))?;
        items.push(serde_json::json!({ "input": h, "kind": "hash", "hex": d.to_hex(), "nix32": d.to_nix32(), "sri": d.to_sri() }));
    }
    for p in &args.paths {
        let meta = std::fs::symlink_metadata(p).map_err(|e| Error::io(p, e))?;
        if !meta.is_dir() {
            // Only regular files are read: opening a FIFO would block forever, a device
            // has no meaningful digest. Symlinks are followed to their target.
            let target = std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
            if !target.is_file() {
                return Err(Error::Usage(format!(
                    "{}: is {}; hash takes regular files (flat sha256) and directories (NAR sha256)",
                    p.display(),
                    file_kind(&target)
                )));
            }
        }
        if meta.is_dir() {
            let d = Sha256::of_nar(p)?;
            items.push(serde_json::json!({ "path": p, "kind": "nar", "hex": d.to_hex(), "nix32": d.to_nix32(), "sri": d.to_sri() }));
        } else {
            let (d, size) = Sha256::of_file(p)?;
            items.push(serde_json::json!({ "path": p, "kind": "file", "size": size, "hex": d.to_hex(), "nix32": d.to_nix32(), "sri": d.to_sri() }));
        }
    }
    if args.json {
        print_json(&serde_json::Value::Array(items));
        return Ok(0);
    }
    for it in &items {
        let title = match it["kind"].as_str() {
            Some("nar") => format!(
                "{} (directory: NAR hash, for fetchzip / nix hash path)",
                it["path"].as_str().unwrap_or("")
            ),
            Some("file") => format!(
                "{} (file, {} bytes: flat hash, for fetchurl)",
                it["path"].as_str().unwrap_or(""),
                it["size"]
            ),
            _ => it["input"].as_str().unwrap_or("").to_string(),
        };
        outln!("{title}");
        for (label, key) in [("hex  ", "hex"), ("nix32", "nix32"), ("SRI  ", "sri")] {
            outln!("  {label} {}", it[key].as_str().unwrap_or(""));
        }
    }
    Ok(0)
}

/// What to do when a URL pinned in the lock does not answer (`verify`, `install`).
const PINNED_URL_HINT: &str =
    "the lock pins this URL (pkgs/nvshmem/releases.json); if the file moved, \
     refresh the lock with `deepep-nix lock`, or pass --file with a copy you already have";

/// Parses a byte count: digits with an optional K, M, G or T suffix (powers of 1024).
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => {
                    return Err(format!(
                        "{s:?}: unknown unit {c:?}; use K, M, G or T (powers of 1024)"
                    ))
                }
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?} is not a size: give bytes, or a number with K, M, G or T"))
}

fn default_cache() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("deepep-nix")
}

/// `s` as one shell word: as is when it holds only characters no shell treats specially,
/// else single-quoted.
fn sh_word(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+,:@%=".contains(&b))
    {
        s.to_string()
    } else {
        crate::install::sh_quote(s)
    }
}

/// A download of NVIDIA's tarball that failed for want of an answer (NVIDIA's host is not
/// reachable from every network): when the lock pins the same release's PyPI wheel, the error
/// gets the command `cmd` makes for that wheel (`what`: what it does with it).
fn with_pypi_alternative(
    e: Error,
    lock: &crate::lock::Lock,
    pinned: &crate::verify::Pinned,
    what: &str,
    cmd: impl FnOnce(&crate::verify::Pinned) -> String,
) -> Error {
    let Error::Http { url, msg } = e else {
        return e;
    };
    let wheel = crate::verify::select(lock, &crate::verify::Selector { source: Some(SourceKind::Pypi), ..sel_of(pinned) });
    match (pinned.source, wheel) {
        (SourceKind::Nvidia, Ok(w)) => Error::Http {
            url,
            msg: format!("{msg}; the lock also pins this release's PyPI wheel ({}), which {what}: `{}`", w.artifact.filename, cmd(&w)),
        },
        _ => Error::Http { url, msg },
    }
}

/// [`with_pypi_alternative`] for `install`: the same install from the wheel.
fn suggest_pypi(e: Error, lock: &crate::lock::Lock, pinned: &crate::verify::Pinned, args: &InstallArgs) -> Error {
    with_pypi_alternative(e, lock, pinned, "installs the same NVSHMEM", |w| {
        let mut cmd = format!(
            "deepep-nix install --version {} --cuda {} --system {} --source pypi --prefix {}",
            w.version,
            w.cuda,
            w.system,
            sh_word(&args.prefix.display().to_string())
        );
        if let Some(r) = &args.pinned.repo.repo {
            cmd += &format!(" --repo {}", sh_word(&r.display().to_string()));
        }
        if let Some(c) = &args.cache {
            cmd += &format!(" --cache {}", sh_word(&c.display().to_string()));
        }
        if args.replace {
            cmd += " --replace";
        }
        if args.shell == crate::install::Shell::Fish {
            cmd += " --shell fish";
        }
        cmd
    })
}

/// `lock` failing on NVIDIA's host (not reachable from every network): PyPI's wheels can be
/// refreshed alone, keeping the vendored NVIDIA manifests.
fn lock_pypi_hint(e: Error, nvidia_url: &str, live: &[SourceKind]) -> Error {
    match e {
        Error::Http { url, msg } if url.starts_with(nvidia_url) && live.contains(&SourceKind::Pypi) => Error::Http {
            url,
            msg: format!(
                "{msg}; if NVIDIA's host is not reachable from this network, `deepep-nix lock --source pypi` refreshes \
                 PyPI's wheels alone and keeps the vendored NVIDIA manifests (`deepep-nix lock --offline` uses only those)"
            ),
        },
        e => e,
    }
}

/// [`with_pypi_alternative`] for `verify`: verifying the same release's wheel.
fn verify_pypi_hint(e: Error, lock: &crate::lock::Lock, pinned: &crate::verify::Pinned, args: &VerifyArgs) -> Error {
    with_pypi_alternative(e, lock, pinned, "holds the same NVSHMEM", |w| {
        let mut cmd = format!(
            "deepep-nix verify --version {} --cuda {} --system {} --source pypi",
            w.version, w.cuda, w.system
        );
        if let Some(r) = &args.pinned.repo.repo {
            cmd += &format!(" --repo {}", sh_word(&r.display().to_string()));
        }
        cmd += &format!(" --dest {}", sh_word(&args.dest.display().to_string()));
        cmd
    })
}

/// The selector that picks exactly `p`.
fn sel_of(p: &crate::verify::Pinned) -> crate::verify::Selector {
    crate::verify::Selector {
        version: p.version.parse().ok(),
        system: Some(p.system),
        cuda: p.cuda.parse().ok(),
        source: Some(p.source),
    }
}

pub fn install(args: &InstallArgs) -> Result<i32> {
    use crate::install::{self as inst, Format};
    use crate::verify::{self as v, OnMismatch};
    // Ctrl-C (or SIGTERM, SIGHUP) during the unpacking removes the staging directory and the
    // parent directories created for the prefix before the process ends.
    if let Err(e) = crate::interrupt::undo_on_signal() {
        tracing::warn!(
            "cannot handle signals ({e}); an interrupted install may leave a {}* directory behind",
            inst::STAGING_PREFIX
        );
    }
    let (lock, sel) = args.pinned.lock_and_selector()?;
    let pinned = match &args.file {
        Some(f) => v::resolve_file(&lock, &sel, f)?,
        None => v::select(&lock, &sel)?,
    };
    if let (None, Some(host)) = (sel.system, crate::model::System::host()) {
        if pinned.system != host {
            let sibling = v::select(
                &lock,
                &v::Selector {
                    system: Some(host),
                    ..sel_of(&pinned)
                },
            )
            .map(|o| format!(", or use the {host} file {}", o.artifact.filename))
            .unwrap_or_default();
            return Err(Error::Usage(format!(
                "{} is the {} build, but this machine is {host}; pass --system {} to install it anyway \
                 (for hosts of that kind){sibling}",
                pinned.artifact.filename, pinned.system, pinned.system
            )));
        }
    }
    eprintln!(
        "installing NVSHMEM {} from {}",
        pinned.describe(),
        pinned.artifact.filename
    );
    let archive = match &args.file {
        Some(f) => {
            v::check_file(f, &pinned.artifact, OnMismatch::Keep)?;
            f.clone()
        }
        None => v::fetch_verified(
            &args.pinned.net.http(true, PINNED_URL_HINT)?,
            &pinned,
            &args.cache.clone().unwrap_or_else(default_cache),
        )
        .map_err(|e| suggest_pypi(e, &lock, &pinned, args))?,
    };
    let format = Format::detect(&pinned.artifact.format).ok_or_else(|| {
        Error::upstream(
            "lock",
            format!("unknown artifact format {:?}", pinned.artifact.format),
        )
    })?;
    let done = inst::install_with(
        &archive,
        format,
        &args.prefix,
        inst::InstallOptions {
            replace: args.replace,
            max_unpacked: args.max_unpacked_size,
        },
    )?;
    let prefix = done.prefix;
    if let Some(files) = done.unchanged {
        eprintln!(
            "already installed: {} holds exactly what {} installs ({files} files and links compared); nothing was changed",
            prefix.display(),
            pinned.artifact.filename
        );
    }
    if let Some(r) = &done.replaced {
        eprintln!(
            "removed the earlier install in {}: {} ({} files)",
            prefix.display(),
            r.entries.join(" "),
            r.files
        );
    }
    if done.unchanged.is_none() {
        eprintln!("installed into {}", prefix.display());
    }
    eprintln!("{}", inst::load_hint(&prefix, args.shell));
    out!("{}", inst::exports(&prefix, args.shell));
    Ok(0)
}

pub fn env(args: &EnvArgs) -> Result<i32> {
    let prefix = crate::install::check_prefix(&args.prefix)?;
    if args.shell == crate::install::Shell::Fish {
        eprintln!("{}", crate::install::load_hint(&prefix, args.shell));
    }
    out!("{}", crate::install::exports(&prefix, args.shell));
    Ok(0)
}

/// Runs a parsed command line; returns the process exit code.
pub fn run(cli: &Cli) -> anyhow::Result<i32> {
    Ok(match &cli.command {
        Command::Lock(a) => lock(a)?,
        Command::Render(a) => render(a)?,
        Command::Releases(a) => releases(a)?,
        Command::Verify(a) => verify(a)?,
        Command::Hash(a) => hash(a)?,
        Command::Install(a) => install(a)?,
        Command::Env(a) => env(a)?,
        Command::Doctor(a) => crate::doctor::run(a)?,
    })
}
