//! `deepep-gpu-tests`: the collective GPU test suite (every kernel family against the CPU
//! reference, plus the runtime's own cases). One process per GPU; `--nproc N` starts N ranks on
//! this host. Rank 0 prints one line per case and finally exactly `N passed, M failed`; the exit
//! code is non-zero when any case failed or any rank died.

use clap::Parser;
use deepep_kernels_harness::cases::all_cases;
use deepep_kernels_harness::gpu_test::{run_cases, RunOpts};
use deepep_kernels_harness::ranks::RankOpts;
use deepep_kernels::runtime::{launcher, Comm, Gpu};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "deepep-gpu-tests",
    about = "Run the deepep-kernels GPU test cases on every rank (one process per GPU)",
    long_about = "Run the deepep-kernels GPU test cases on every rank (one process per GPU).\n\n\
        With --nproc N (and RANK unset) this starts N ranks of itself on this host (MASTER_ADDR=127.0.0.1, a free \
        MASTER_PORT, NVSHMEM_DISABLE_NVLS=1, NCCL_NVLS_ENABLE=0). Without --nproc it is one rank of a job started by \
        torchrun, Slurm or by hand: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.\n\n\
        Rank 0 prints one line per case (ok / FAIL / skip) and finally exactly `N passed, M failed`."
)]
struct Cli {
    #[command(flatten)]
    ranks: RankOpts,
    /// Seed of the random inputs (default: fresh per run, printed by rank 0).
    #[arg(long)]
    seed: Option<u64>,
    /// Run only the cases whose name contains this substring.
    #[arg(long)]
    filter: Option<String>,
    /// Run every selected case this many times (fresh inputs each time).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// List the case names and exit (no GPU needed).
    #[arg(long)]
    list: bool,
    /// Testing the launcher: this rank exits with code 3 right after the rendezvous.
    #[arg(long, hide = true)]
    selftest_fail_rank: Option<usize>,
    /// Testing the launcher: this rank sleeps forever right after the rendezvous.
    #[arg(long, hide = true)]
    selftest_hang_rank: Option<usize>,
    /// Bound of one test case on the host in seconds (default 120, or DEEPEP_CASE_TIMEOUT_S):
    /// a case that hangs longer ends the run naming it.
    #[arg(long)]
    case_timeout_s: Option<f64>,
    /// Testing the rendezvous without a GPU: all-gather the ranks and print them.
    #[arg(long, hide = true)]
    selftest_comm: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.ranks.init();
    if cli.list {
        for c in all_cases() {
            println!("{}", c.name);
        }
        return ExitCode::SUCCESS;
    }
    cli.ranks.run("deepep-gpu-tests", || rank_main(&cli))
}

fn rank_main(cli: &Cli) -> anyhow::Result<bool> {
    let comm = Comm::from_env()?;
    if cli.selftest_fail_rank == Some(comm.rank()) {
        eprintln!("rank {} exits with code 3 as asked by --selftest-fail-rank", comm.rank());
        std::process::exit(3);
    }
    if cli.selftest_hang_rank == Some(comm.rank()) {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
    if cli.selftest_comm {
        let all = comm.all_gather(format!("rank {} of {}", comm.rank(), comm.world()).as_bytes())?;
        let b = comm.broadcast(0, b"hello from rank 0")?;
        comm.barrier()?;
        println!("gathered {:?}; broadcast {:?}", all.iter().map(|v| String::from_utf8_lossy(v).into_owned()).collect::<Vec<_>>(), String::from_utf8_lossy(&b));
        launcher::final_line(comm.rank(), &format!("comm ok: {} ranks", comm.world()));
        return Ok(true);
    }
    // Fresh seed from rank 0 unless given.
    let local_seed = cli.seed.unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        t.as_nanos() as u64 ^ ((std::process::id() as u64) << 32)
    });
    let seed = u64::from_le_bytes(comm.broadcast(0, &local_seed.to_le_bytes())?[..8].try_into()?);
    let gpu = Gpu::from_comm(&comm)?;
    cli.ranks.apply_timeout(&gpu);
    if comm.rank() == 0 {
        println!("{}", deepep_kernels::cubins::manifest());
        println!("{} ranks, GPU 0: {} ({} SMs); seed {seed} (rerun with --seed {seed})", comm.world(), gpu.name(), gpu.device_sm_count());
        if gpu.oversubscribed() {
            println!(
                "oversubscribed: {} ranks per GPU, {} SMs per rank; NCCL cases are skipped (NCCL needs one GPU per rank)",
                gpu.ranks_per_gpu(),
                gpu.sm_count()
            );
        }
    }
    let cases = all_cases();
    let totals = run_cases(&comm, &gpu, &cases, &RunOpts {
        seed,
        filter: cli.filter.clone(),
        repeat: cli.repeat,
        case_timeout: cli.case_timeout_s.map(std::time::Duration::from_secs_f64),
    })?;
    comm.barrier()?;
    drop(cases);
    deepep_kernels::nvshmem::finalize();
    launcher::final_line(comm.rank(), &totals.summary());
    Ok(totals.failed == 0)
}
