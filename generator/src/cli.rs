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
    /// Check this host for what DeepEP-style EP needs (GPU, driver, NVSHMEM, IBGDA, gdrdrv).
    Doctor(crate::doctor::DoctorArgs),
}

/// Where the checkout is.
#[derive(Debug, Clone, Args)]
pub struct RepoArgs {
    /// Repository checkout to read and write (see "Data location" below).
    #[arg(long, env = "DEEPEP_NIX_REPO", value_name = "DIR")]
    pub repo: Option<PathBuf>,
}

/// Network settings shared by the commands that download.
#[derive(Debug, Clone, Args)]
pub struct NetArgs {
    /// Base URL of NVIDIA's NVSHMEM redist (index page, redistrib_<version>.json, and the
    /// base that manifests' relative_path is appended to in the lock).
    #[arg(long, env = "DEEPEP_NIX_NVIDIA_URL", default_value = crate::nvidia::DEFAULT_REDIST_URL, value_name = "URL")]
    pub nvidia_url: String,
    /// Base URL of PyPI's JSON API (<URL>/<package>/json).
    #[arg(long, env = "DEEPEP_NIX_PYPI_URL", default_value = crate::pypi::DEFAULT_PYPI_URL, value_name = "URL")]
    pub pypi_url: String,
    /// Seconds to wait for a connection, for response headers, or for the next body bytes.
    #[arg(long, default_value_t = 30, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// Attempts per request; failed attempts back off exponentially (0.5 s, 1 s, 2 s, ...).
    #[arg(long, default_value_t = 4, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10))]
    pub retries: u32,
    /// First backoff delay in milliseconds (doubles after each failed attempt).
    #[arg(long, default_value_t = 500, value_name = "MS", hide = true)]
    pub backoff_ms: u64,
}

impl NetArgs {
    pub fn upstream(&self) -> Upstream {
        Upstream { nvidia_url: self.nvidia_url.clone(), pypi_url: self.pypi_url.clone() }
    }

    pub fn http(&self, progress: bool) -> Result<Http> {
        Http::new(HttpConfig {
            timeout: Duration::from_secs(self.timeout),
            attempts: self.retries,
            backoff: Duration::from_millis(self.backoff_ms),
            progress,
        })
    }
}

#[derive(Debug, Clone, Args)]
pub struct LockArgs {
    #[command(flatten)]
    pub repo: RepoArgs,
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

/// Prints statuses; with `check`, reports drift on stderr and returns exit code 1.
fn finish(statuses: &[FileStatus], check: bool, fix: &str) -> i32 {
    for s in statuses {
        println!("{s}");
    }
    if check && has_drift(statuses) {
        let n = statuses.iter().filter(|s| s.status != crate::output::Status::Unchanged).count();
        eprintln!("drift: {n} file(s) differ from what `{fix}` would write; run it and commit the result");
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
    let statuses = if check { plan.statuses()? } else { plan.apply()? };
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
        let live = if args.sources.is_empty() { SourceKind::ALL.to_vec() } else { args.sources.clone() };
        generate::refresh_inputs(vendored, &live, &args.net.http(false)?, &args.net.upstream(), &min)?
    };
    let opts = BuildOptions { min_version: min, nvidia_url: args.net.nvidia_url.clone() };
    let (plan, lock) = generate::plan_lock(&repo, &inputs, &opts)?;
    let code = run_plan(&plan, args.check, "deepep-nix lock")?;
    if !args.check {
        println!("locked {} releases ({} to {})", lock.releases.len(),
            lock.releases.first().map_or("-", |r| &r.version), lock.releases.last().map_or("-", |r| &r.version));
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
            return Err(Error::Usage("--check compares a file; it cannot be combined with --output -".into()));
        }
        print!("{}", crate::render::render_releases_nix(&lock, &bytes)?);
        return Ok(0);
    }
    let mut plan = Plan::default();
    plan.write(target, crate::render::render_releases_nix(&lock, &bytes)?);
    run_plan(&plan, args.check, "deepep-nix render")
}

/// Runs a parsed command line; returns the process exit code.
pub fn run(cli: &Cli) -> anyhow::Result<i32> {
    Ok(match &cli.command {
        Command::Lock(a) => lock(a)?,
        Command::Render(a) => render(a)?,
        Command::Doctor(a) => crate::doctor::run(a)?,
    })
}
