//! `deepep-nix doctor`: is this host ready for NVSHMEM, IBGDA and our kernels?
//!
//! Every check reads files (below `--root`), the environment and, on the real host,
//! `nvidia-smi`; nothing loads NVSHMEM or touches a GPU. Each finding is a [`Check`] (ok / warn /
//! fail / skip, what was found, the exact fix); each [`Capability`] is ready when none of the
//! checks it needs failed. `docs/doctor.md` lists every check with its sources and fixes.

mod container;
mod deepep;
mod driver;
mod elf;
mod facts;
mod host;
mod knobs;
mod maps;
mod modprobe;
mod nvshmem;
mod rdma;
mod report;
mod stack;

pub use facts::Version;
pub use host::{HostKind, NoTools, SystemTools, ToolOutput, Tools};
pub use report::{Capability, Check, IbgdaMode, Report, Status, Verdict};

use anyhow::{bail, Context as _};
use clap::Args;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Check whether this host is ready for NVSHMEM, IBGDA and the deepep kernels.
///
/// Prints one line per check (ok / warn / fail / skip, what was found and the exact fix), then a
/// verdict per capability. Exit status: 0 when every requested capability is ready, 1 when one
/// is not, 2 on usage errors.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Prints one line per check (ok, warn, fail, skip; what was found; the fix), then a verdict per \
capability. A fail blocks the capabilities that need the check; warn and skip do not.\n\
Exit status: 0 every requested capability is ready, 1 one is not, 2 usage error.\n\
Environment: NVSHMEM_DIR, LD_LIBRARY_PATH, DEEPEP_KERNELS_NVSHMEM_VERSION, the NVSHMEM_* knobs and, for the \
deepep.* checks, TORCH_CUDA_ARCH_LIST are read from the environment doctor runs in; the locked-memory limit \
(memlock) is doctor's own. One NVSHMEM per process (process.nvshmem-maps): --maps FILE (a saved \
/proc/<pid>/maps) or --maps-python PYTHON (with --maps-modules, default deep_ep), or their variables \
DEEPEP_DOCTOR_MAPS / DEEPEP_DOCTOR_MAPS_PYTHON / DEEPEP_DOCTOR_MAPS_MODULES; the expected NVSHMEM comes from \
DEEPEP_DOCTOR_MAPS_EXPECT or --nvshmem-dir."
)]
pub struct DoctorArgs {
    /// Print the report as JSON (checks, verdicts, exit_code) instead of the table.
    #[arg(long)]
    pub json: bool,

    /// NVSHMEM prefix to check (the directory holding lib/libnvshmem_host.so.3).
    /// Default: $NVSHMEM_DIR, else the libnvshmem_host.so.3 the loader finds
    /// (LD_LIBRARY_PATH, /etc/ld.so.conf, system directories).
    #[arg(long, value_name = "DIR")]
    pub nvshmem_dir: Option<PathBuf>,

    /// Read /proc, /sys, /dev and /etc (and every other host path) below DIR instead of /.
    /// With a root other than /, nvidia-smi is not run and NVLink is reported unverified.
    #[arg(long, value_name = "DIR", default_value = "/", value_parser = existing_dir)]
    pub root: PathBuf,

    /// Low-latency tokens per rank you plan to dispatch (num_max_dispatch_tokens_per_rank);
    /// checks NVSHMEM_QP_DEPTH (default 1024) >= 2*(N+1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: Option<u32>,

    /// Capability whose readiness sets the exit status; repeat for several. Default: all four.
    #[arg(long = "capability", value_enum, value_name = "CAP")]
    pub capabilities: Vec<Capability>,

    /// NVSHMEM version the kernels were built against, compared with the host library.
    /// Default: $DEEPEP_KERNELS_NVSHMEM_VERSION; without either the comparison is skipped.
    #[arg(long, value_name = "X.Y.Z", value_parser = parse_version_arg)]
    pub kernels_nvshmem_version: Option<Version>,

    /// Python site-packages directory holding DeepEP's deep_ep_cpp*.so (directly or in a
    /// deep_ep-*.egg), its package metadata and torch; adds the deepep.* checks (the NVSHMEM the
    /// build linked vs the library that would load, torch's own NVSHMEM, known-broken DeepEP x
    /// NVSHMEM pairings, the IBGDA plugin, GPU architectures). Without it they are not run.
    /// Repeat it when DeepEP and torch are in different directories (e.g. pip install --target):
    /// DeepEP (extension, metadata), torch and the nvidia-nvshmem wheel are each taken from the
    /// first DIR that has them.
    #[arg(long, value_name = "DIR")]
    pub python_site: Vec<PathBuf>,

    /// One NVSHMEM per process (check process.nvshmem-maps): a saved /proc/<pid>/maps of a process
    /// that imported torch and the EP extension (cat /proc/<pid>/maps > FILE). Every distinct
    /// libnvshmem_host.so.3 mapped is named; more than one, or another than --nvshmem-dir's, fails.
    #[arg(long, value_name = "FILE", env = "DEEPEP_DOCTOR_MAPS")]
    pub maps: Option<PathBuf>,

    /// The same check on a live process: run PYTHON, import torch and --maps-modules, and read its
    /// own /proc/self/maps (this host only, not with --root).
    #[arg(long, value_name = "PYTHON", env = "DEEPEP_DOCTOR_MAPS_PYTHON")]
    pub maps_python: Option<String>,

    /// Modules --maps-python imports after torch (space- or comma-separated; default deep_ep).
    #[arg(
        long,
        value_name = "MODULES",
        env = "DEEPEP_DOCTOR_MAPS_MODULES",
        requires = "maps_python"
    )]
    pub maps_modules: Option<String>,
}

fn existing_dir(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.is_dir() {
        Ok(p)
    } else {
        Err(format!(
            "{s} is not a directory; --root must name an existing directory (default /)"
        ))
    }
}

fn parse_version_arg(s: &str) -> Result<Version, String> {
    Version::parse(s)
        .ok_or_else(|| format!("{s:?} is not a version of the form X.Y.Z (e.g. 3.4.5)"))
}

/// The CLI entry point: checks the host, prints the report, returns the exit status.
pub fn run(args: &DoctorArgs) -> anyhow::Result<i32> {
    let env: BTreeMap<String, String> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    let mut args = args.clone();
    let is_real_root = std::fs::canonicalize(&args.root)
        .map(|p| p == Path::new("/"))
        .unwrap_or(false);
    if let Some(dir) = &args.nvshmem_dir {
        if dir.is_relative() && is_real_root {
            args.nvshmem_dir = Some(std::env::current_dir()?.join(dir));
        }
    }
    if is_real_root {
        let cwd = std::env::current_dir()?;
        for dir in args.python_site.iter_mut() {
            if dir.is_relative() {
                *dir = cwd.join(&*dir);
            }
        }
    }
    let report = if is_real_root {
        run_with(&args, &env, &SystemTools::default())?
    } else {
        run_with(
            &args,
            &env,
            &NoTools("not run: --root describes another host".into()),
        )?
    };
    let text = if args.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        report.render_text()
    };
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(text.as_bytes())
        .context("writing the report to stdout")?;
    stdout.flush().context("writing the report to stdout")?;
    Ok(report.exit_code)
}

/// Checks the host below `args.root` with the given environment and tools.
pub fn run_with(
    args: &DoctorArgs,
    env: &BTreeMap<String, String>,
    tools: &dyn Tools,
) -> anyhow::Result<Report> {
    if !args.root.is_dir() {
        bail!(
            "{} is not a directory; --root must name an existing directory",
            args.root.display()
        );
    }
    let host = host::Host::new(&args.root, env, tools);
    let kind = HostKind::detect(&host);
    let mut checks = Vec::new();

    let driver_info = driver::check(&host, &kind, &mut checks);
    driver::check_params(&host, &kind, &driver_info, &mut checks);
    let rdma_info = rdma::check_nics(&host, &kind, &mut checks);
    rdma::check_memory_registration(&host, &kind, &driver_info, &mut checks);
    let settings = nvshmem::Settings {
        dir: args.nvshmem_dir.clone(),
        kernels_version: args.kernels_nvshmem_version,
    };
    let mut nvshmem_checks = Vec::new();
    let nvshmem_info = nvshmem::check(&host, &settings, &mut nvshmem_checks);
    if driver_info.no_device {
        // GDRCopy's gdrdrv pins GPU memory: nothing to check (or to fix) without a GPU.
        checks.push(report::Check::skip(
            "gdrcopy",
            report::caps::CPU_IBGDA,
            "no NVIDIA GPU on this host",
        ));
    } else {
        rdma::check_gdrcopy(&host, &kind, &nvshmem_info, &mut checks);
    }
    checks.append(&mut nvshmem_checks);
    let ctx = knobs::Context {
        max_tokens: args.max_tokens,
        nvshmem_version: nvshmem_info.version,
        rdma: &rdma_info,
        unknown: &nvshmem_info.unknown_env,
    };
    knobs::check(&host, &ctx, &mut checks);
    container::check(&host, &kind, &mut checks);
    let real_host = std::fs::canonicalize(&args.root).is_ok_and(|p| p == Path::new("/"));
    // the flags (or their environment variables, which clap reads) reach the check through the
    // same names as the environment it is tested with
    let mut maps_env = env.clone();
    for (key, value) in [
        (
            maps::ENV_MAPS,
            args.maps.as_ref().map(|p| p.display().to_string()),
        ),
        (maps::ENV_PYTHON, args.maps_python.clone()),
        (maps::ENV_MODULES, args.maps_modules.clone()),
    ] {
        if let Some(v) = value {
            maps_env.insert(key.to_string(), v);
        }
    }
    maps::check(
        &maps_env,
        args.nvshmem_dir.as_deref(),
        real_host,
        &mut checks,
    );
    // driver.cuda-branch: with --python-site, or when the NVSHMEM checked is a wheel's
    let parts = stack::parts(&host, &args.python_site, &nvshmem_info);
    if !args.python_site.is_empty() || !parts.is_empty() {
        stack::check_driver_branch(&driver_info, &parts, &mut checks);
    }
    if !args.python_site.is_empty() {
        if let Some(raw) = deepep::v2_release(&host, &args.python_site) {
            stack::check_nccl(&host, &args.python_site, &raw, &mut checks);
        }
        deepep::check(
            &host,
            &args.python_site,
            &driver_info,
            &nvshmem_info,
            &rdma_info,
            &mut checks,
        );
    }

    let requested: Vec<Capability> = if args.capabilities.is_empty() {
        Capability::ALL.to_vec()
    } else {
        args.capabilities.clone()
    };
    Ok(Report::new(
        args.root.display().to_string(),
        checks,
        &requested,
    ))
}
