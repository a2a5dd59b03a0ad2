//! `deepep-bench`: DeepEP's figures for our kernels and an NCCL all-to-all baseline moving the
//! same bytes, in the same run. One process per GPU; `--nproc N` starts N ranks on this host.

use clap::{Parser, ValueEnum};
use deepep_kernels_harness::bench::{self, BenchCtx, BenchOpts, Row};
use deepep_kernels::runtime::timing::TimingOpts;
use deepep_kernels::runtime::{Comm, Gpu};
use deepep_kernels_harness::ranks::RankOpts;
use deepep_kernels::EpError;
use std::process::ExitCode;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Intranode,
    LowLatency,
    Internode,
    Nccl,
    All,
}

#[derive(Parser, Debug)]
#[command(
    name = "deepep-bench",
    about = "Benchmark the deepep-kernels modes against an NCCL all-to-all moving the same bytes",
    long_about = "Benchmark the deepep-kernels modes against an NCCL all-to-all moving the same bytes.\n\n\
        Byte counts as in DeepEP's tests (GB/s over the bytes each rank receives, its own tokens included; low-latency: \
        the rank's valid selections x message bytes). Our statistic ('med us'): the median over --reps repetitions after \
        --warmup runs (CUDA events, L2 flushed before every repetition), slowest rank. That is NOT DeepEP's statistic: \
        DeepEP's tests/utils.py bench() runs 50 warm-up calls, flushes the L2 once, times 50 calls and reports the mean \
        of calls 2..50, printed by rank 0 (intranode) or by every rank (low-latency); --deepep-stat adds that figure \
        for rank 0 as the 'DeepEP-stat us' / 'DeepEP-stat GB/s' columns (JSON: deepep_stat_us, deepep_stat_per_rank) and \
        'DeepEP-kern us', kernel time as its bench_kineto() takes it (mean over 30 back-to-back calls, no L2 flush). \
        The NCCL baseline is a grouped send/recv all-to-all with the same per-peer byte counts; ratio = GB/s / NCCL \
        GB/s. Low-latency rows are repeated in a second table with the bytes our kernels actually move (dispatch: once \
        per destination rank; combine: one f32 partial row per (token, remote owner rank)) and an NCCL baseline moving \
        those. Intranode '+copy' rows add a device copy of the received rows (and scales) into owned tensors, which \
        DeepEP's timed dispatch includes. Routing: each token picks --topk distinct experts uniformly among --experts; \
        the low-latency mode then sets --ll-masked-slots random slots per rank to -1 (DeepEP's LL test: 10).\n\n\
        With --nproc N (and RANK unset) this starts N ranks of itself on this host; otherwise it is one rank of a job \
        started by torchrun/Slurm (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).\n\n\
        Kernel choices (environment): DEEPEP_LL_DISPATCH=v1|v2 (default v2), DEEPEP_LL_COMBINE=v1|v3 (default v3), \
        DEEPEP_LL_OWNER_WARPS=0..15 (combine v3 owner warps per block, default 8), DEEPEP_LL_TRANSPORT=auto|put \
        (put: NVSHMEM puts to every other rank even over NVLink, the kernels that run across hosts); the low-latency mode also times the \
        other versions and, with DEEPEP_LL_OWNER_WARPS_SWEEP=0,4,8,..., combine v3 with those warp splits, and prints a \
        'trace' line of phase times per combine kernel. DEEPEP_INTRANODE_CONFIGS times other intranode configurations."
)]
struct Cli {
    #[command(flatten)]
    ranks: RankOpts,
    /// What to measure.
    #[arg(long, value_enum, default_value_t = Mode::All)]
    mode: Mode,
    /// Tokens per rank (default: 4096 for intranode/internode/nccl, 128 for low-latency).
    #[arg(long)]
    tokens: Option<usize>,
    /// Hidden size (channels per token).
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    topk: usize,
    /// Total experts, a multiple of the rank count (default: 256; low-latency 288, DeepEP's LL test default).
    #[arg(long)]
    experts: Option<usize>,
    /// Sweep tokens 128..8192 x hidden 2048/4096/7168 instead of one shape (low-latency: tokens
    /// 32/128/256 at --hidden).
    #[arg(long)]
    sweep: bool,
    /// SMs the kernels may use (default: each mode's own).
    #[arg(long)]
    num_sms: Option<u32>,
    /// Timed repetitions of our statistic (median; DeepEP's is fixed at 50, see --deepep-stat).
    #[arg(long, default_value_t = 30)]
    reps: usize,
    /// Untimed warm-up runs of our statistic (DeepEP's: 50).
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Also measure every row with DeepEP's statistic (tests/utils.py bench: 50 warm-up calls, L2
    /// flushed once, 50 timed calls, mean without the first) and, with CUPTI, its kernel time
    /// (bench_kineto: mean over 30 back-to-back calls, no flush); rank 0's figures in the table;
    /// not shortened by --quick. Adds about 160 calls per row.
    #[arg(long)]
    deepep_stat: bool,
    /// Low-latency mode: random top-k slots per rank set to -1 (draws with replacement; DeepEP's
    /// LL test: 10; 0 = no -1 slots).
    #[arg(long, default_value_t = 10, value_name = "N")]
    ll_masked_slots: usize,
    /// Intranode mode: pass FP8 scales as a column-major [tokens, hidden/128] view, as DeepEP's
    /// intranode test does (default: row-major).
    #[arg(long)]
    col_major_scales: bool,
    /// Also write the rows as JSON to this file (rank 0).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Smoke run: 5 repetitions, 1 warm-up, and a 3-point token sweep with --sweep.
    #[arg(long)]
    quick: bool,
    /// Seed of the routing (default: fixed 1, so runs are comparable).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.ranks.init();
    cli.ranks.run("deepep-bench", || rank_main(&cli))
}

/// Run one mode (`All` is expanded by the caller).
fn run_mode(mode: Mode, ctx: &mut BenchCtx) -> deepep_kernels::Result<Vec<Row>> {
    match mode {
        Mode::Nccl => {
            let shapes = ctx.opts.shapes(4096);
            bench::run_nccl(ctx, &shapes)
        }
        Mode::Intranode => {
            let shapes = ctx.opts.shapes(4096);
            bench::intranode::run(ctx, &shapes)
        }
        Mode::LowLatency => {
            let shapes = bench::low_latency::shapes(&ctx.opts);
            bench::low_latency::run(ctx, &shapes)
        }
        Mode::Internode => {
            let shapes = ctx.opts.shapes(4096);
            bench::internode::run(ctx, &shapes)
        }
        Mode::All => Err(EpError::InvalidArgument("mode all is expanded before run_mode".into())),
    }
}

fn rank_main(cli: &Cli) -> anyhow::Result<bool> {
    let comm = Comm::from_env()?;
    let gpu = Gpu::from_comm(&comm)?;
    cli.ranks.apply_timeout(&gpu);
    let timing = if cli.quick {
        TimingOpts { warmup: 1, reps: 5, flush_l2: true }
    } else {
        TimingOpts { warmup: cli.warmup, reps: cli.reps, flush_l2: true }
    };
    let opts = BenchOpts {
        tokens: cli.tokens,
        hidden: cli.hidden,
        topk: cli.topk,
        experts: cli.experts.unwrap_or(256),
        experts_explicit: cli.experts.is_some(),
        sweep: cli.sweep,
        num_sms: cli.num_sms,
        timing,
        seed: cli.seed,
        quick: cli.quick,
        deepep_stat: cli.deepep_stat,
        ll_masked_slots: cli.ll_masked_slots,
        col_major_scales: cli.col_major_scales,
    };
    opts.validate(comm.world())?;
    let me = comm.rank();
    if me == 0 {
        println!("{}", deepep_kernels::cubins::manifest());
        println!("{} ranks on {} ({} SMs each); {} warm-up, {} reps, seed {}", comm.world(), gpu.name(), gpu.sm_count(), timing.warmup, timing.reps, cli.seed);
        println!(
            "statistics: 'med us' = median of {} reps after {} warm-up, L2 flushed before each, slowest rank{}",
            timing.reps,
            timing.warmup,
            if cli.deepep_stat {
                format!(
                    "; 'DeepEP-stat us' = DeepEP's tests/utils.py bench(): {} warm-up, L2 flushed once, mean of calls 2..{}, rank 0; \
                     'DeepEP-kern us' = its bench_kineto(): mean kernel span over {} back-to-back calls after {} unrecorded ones, no L2 flush, rank 0",
                    bench::DEEPEP_WARMUP,
                    bench::DEEPEP_REPS,
                    bench::DEEPEP_KINETO_CALLS,
                    bench::DEEPEP_KINETO_CALLS
                )
            } else {
                String::new()
            }
        );
        if gpu.oversubscribed() {
            println!(
                "NOT PERFORMANCE: {} ranks share each GPU ({} of its {} SMs per rank); these timings check that the modes run, \
                 they are not performance figures and must not be reported as such",
                gpu.ranks_per_gpu(),
                gpu.sm_count(),
                gpu.device_sm_count()
            );
        }
    }
    let mut ctx = BenchCtx::new(&comm, &gpu, opts)?;
    if let (0, Some(e)) = (me, ctx.nccl_error()) {
        println!("NCCL baseline unavailable: {e}");
    }
    if me == 0 {
        println!("timing floor: an empty kernel measures {:.1} us the same way (included in every 'us' below)", ctx.floor_us);
        match &ctx.kernel_timer_error {
            None => println!(
                "kernel us: CUPTI kernel timestamps, first kernel start to last kernel end per repetition, L2 flushed before each, median, slowest rank (DeepEP's bench_kineto takes the mean over 30 back-to-back calls without flushes: 'DeepEP-kern us' with --deepep-stat)"
            ),
            Some(e) => println!("kernel us: not measured ({e})"),
        }
    }
    let mut modes: Vec<Mode> = if cli.mode == Mode::All { vec![Mode::Intranode, Mode::LowLatency, Mode::Internode, Mode::Nccl] } else { vec![cli.mode] };
    if cli.mode == Mode::All && gpu.oversubscribed() {
        modes.retain(|&m| m != Mode::Nccl);
        if me == 0 {
            println!("mode nccl skipped: NCCL needs one GPU per rank");
        }
    }
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    for m in modes {
        let r = run_mode(m, &mut ctx);
        // Drain this rank's GPU work and agree on the outcome (end_unit also releases ranks still
        // blocked in one of the mode's collectives when another rank failed early).
        let r = r.and_then(|rows| gpu.sync("end of mode").map(|_| rows));
        let msg = match &r {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        };
        let verdicts = comm.end_unit(msg.as_bytes())?;
        match r {
            Ok(rs) if verdicts.iter().all(|v| v.is_empty()) => rows.extend(rs),
            _ => {
                let why: Vec<String> = verdicts
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| !v.is_empty())
                    .map(|(rank, v)| format!("rank {rank}: {}", String::from_utf8_lossy(v)))
                    .collect();
                if me == 0 {
                    println!("mode {m:?} failed: {}", why.join(" | "));
                }
                errors.push(format!("{m:?}: {}", why.join(" | ")));
            }
        }
    }
    let ctx_floor_us = ctx.floor_us;
    let kernel_timer = ctx.kernel_timer_error.clone().unwrap_or_else(|| "cupti".into());
    drop(ctx);
    if me == 0 {
        print!("{}", bench::format_table(&rows));
        if let Some(path) = &cli.json {
            let doc = serde_json::json!({
                "manifest": deepep_kernels::cubins::manifest(),
                "world": comm.world(),
                "gpu": gpu.name(),
                "sm_count": gpu.sm_count(),
                "ranks_per_gpu": gpu.ranks_per_gpu(),
                "not_performance": gpu.oversubscribed(),
                "seed": cli.seed,
                "warmup": timing.warmup,
                "reps": timing.reps,
                "statistics": {
                    "us": format!("ours: median of {} repetitions after {} warm-up, L2 flushed before each, slowest rank (per_rank: every rank's)", timing.reps, timing.warmup),
                    "deepep_stat_us": if cli.deepep_stat {
                        format!("DeepEP v1.2.1 tests/utils.py bench(): {} warm-up, L2 flushed once, mean of calls 2..{}, rank 0 (deepep_stat_per_rank: every rank's, mean_us)", bench::DEEPEP_WARMUP, bench::DEEPEP_REPS)
                    } else {
                        "not measured (--deepep-stat)".to_string()
                    },
                    "deepep_kernel_us": if cli.deepep_stat {
                        format!("DeepEP v1.2.1 tests/utils.py bench_kineto(): mean CUPTI kernel span per call over {} back-to-back calls after {} unrecorded ones, no L2 flush, rank 0 (deepep_kernel_per_rank: every rank's, mean_us); null without CUPTI and for '+copy' rows", bench::DEEPEP_KINETO_CALLS, bench::DEEPEP_KINETO_CALLS)
                    } else {
                        "not measured (--deepep-stat)".to_string()
                    },
                    "kernel_us": "ours: CUPTI, first kernel start to last kernel end per repetition, L2 flushed before each, median, slowest rank; null for '+copy' rows",
                    "moved": "low-latency: bytes our kernels actually write (flags excluded), GB/s over 'us', NCCL all-to-all moving those bytes; recv_bytes/gbps/nccl_* count DeepEP's per-selection bytes",
                },
                "ll_masked_slots": cli.ll_masked_slots,
                "col_major_scales": cli.col_major_scales,
                "timing_floor_us": ctx_floor_us,
                "kernel_timer": kernel_timer,
                "rows": rows,
                "errors": errors,
            });
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, serde_json::to_string_pretty(&doc)?)?;
            std::fs::rename(&tmp, path)?;
            println!("wrote {}", path.display());
        }
    }
    comm.barrier()?;
    // NVSHMEM (low-latency / internode) tears down once every buffer is gone.
    deepep_kernels::nvshmem::finalize();
    Ok(errors.is_empty())
}
