//! What `deepep-gpu-tests` and `deepep-bench` share around their ranks: the options that start
//! and place them ([`RankOpts`]), logging, and the exit codes ([`RankOpts::run`]).

use deepep_kernels::runtime::{launcher, Gpu};
use std::process::ExitCode;

/// The options both binaries take to start and place ranks (`#[command(flatten)]`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RankOpts {
    /// Start this many ranks (one per GPU) on this host.
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Let K ranks share each GPU on purpose (rank r uses GPU LOCAL_RANK / K), to test 4- and
    /// 8-rank paths on 1-2 GPUs. Each rank's kernels get 1/K of the SMs so all ranks' waiting
    /// blocks fit at once (under MPS or time-sliced). Also DEEPEP_RANKS_PER_GPU. Not for timings.
    #[arg(long, value_name = "K")]
    pub ranks_per_gpu: Option<usize>,
    /// Bound of any GPU-side wait in milliseconds (default 5000, or DEEPEP_GPU_TIMEOUT_MS).
    #[arg(long)]
    pub timeout_ms: Option<u64>,
}

impl RankOpts {
    /// Exports `--ranks-per-gpu` for [`Gpu::from_comm`] (in this process and in the ranks the
    /// launcher starts) and sends logs to stderr (`RUST_LOG`, default `warn`). Call it first.
    pub fn init(&self) {
        if let Some(k) = self.ranks_per_gpu {
            std::env::set_var(deepep_kernels::runtime::gpu::RANKS_PER_GPU_ENV, k.to_string());
        }
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .with_writer(std::io::stderr)
            .init();
    }

    /// Applies `--timeout-ms` to this rank's GPU.
    pub fn apply_timeout(&self, gpu: &Gpu) {
        if let Some(ms) = self.timeout_ms {
            gpu.set_device_timeout(std::time::Duration::from_millis(ms));
        }
    }

    /// With `--nproc N` in a process that is not a rank yet: starts N ranks of this program and
    /// waits for them (failure when any fails). Otherwise this process is a rank and runs
    /// `rank_main`: `Ok(true)` exits 0, `Ok(false)` (something failed and was reported) exits 1,
    /// an error is printed as `<program>: error: ...` and exits with
    /// [`launcher::error_exit_code`]`(2)`.
    pub fn run(&self, program: &str, rank_main: impl FnOnce() -> anyhow::Result<bool>) -> ExitCode {
        if let (Some(n), false) = (self.nproc, launcher::is_rank_process()) {
            let args: Vec<String> = std::env::args().skip(1).collect();
            return match launcher::launch(n, &args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{program}: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        match rank_main() {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => {
                eprintln!("{program}: error: {e:#}");
                ExitCode::from(launcher::error_exit_code(2))
            }
        }
    }
}
