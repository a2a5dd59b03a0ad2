//! Benchmark framework of `deepep-bench`: DeepEP's figures and an NCCL all-to-all baseline moving
//! the same bytes, in the same run.
//!
//! Our statistic (columns `med us` / `GB/s`): GB/s over the bytes a rank *receives*, including
//! the tokens it sends to itself (DeepEP's byte count), divided by the **median** time over
//! `--reps` repetitions after `--warmup` runs (CUDA events, L2 flushed before **every**
//! repetition); across ranks the table shows the slowest rank (largest median, smallest GB/s).
//! This is *not* DeepEP's statistic. DeepEP v1.2.1's `tests/utils.py::bench` (used by
//! `test_intranode.py` and by the event-timed "Dispatch + combine" line of `test_low_latency.py`)
//! runs 50 warm-up calls, flushes the L2 **once** (a 256 MB `zero_`), times 50 calls back to back
//! with CUDA events, drops the **first** of those 50 samples and reports the **mean** of the other
//! 49 (and their min/max); `test_intranode.py` prints rank 0 only (`local_rank == 0`),
//! `test_low_latency.py` prints every rank. With `--deepep-stat` every row is also measured that
//! way ([`BenchCtx::time_deepep`], [`deepep_stat`]) and the columns `DeepEP-stat us` /
//! `DeepEP-stat GB/s` show rank 0's figure (JSON: `deepep_stat_us`, `deepep_stat_gbps`, every
//! rank's in `deepep_stat_per_rank`). DeepEP's low-latency per-kernel times come from
//! `bench_kineto` instead (30 calls, no L2 flush, the profiler's average duration of each kernel
//! named `dispatch` / `combine`): compare those with our `kernel us` column, which differs too
//! (median of per-repetition spans from first kernel start to last kernel end, L2 flushed).
//!
//! Every row names the SM count the kernel used. The NCCL baseline is a grouped
//! `ncclSend`/`ncclRecv` all-to-all with exactly the per-peer byte counts of the routing being
//! measured; `ratio` = our GB/s / NCCL GB/s. Low-latency rows also carry the bytes our kernels
//! actually move ([`Moved`], see `bench::low_latency`) with a second NCCL baseline for those.
//!
//! Routing is drawn like DeepEP's benchmarks: every token picks `topk` distinct experts uniformly
//! among `experts` (top-k of i.i.d. random scores); expert `e` lives on rank `e / (experts / world)`.
//! The low-latency mode then masks slots with `-1` as DeepEP's LL test does
//! ([`random::mask_random_slots`], `--ll-masked-slots`, default 10 draws per rank).
//! It is generated from `(seed, rank)` with `reference::random`, so every rank knows every rank's
//! routing without communication.
//!
//! Family modes implement `run(&mut BenchCtx, &[Shape]) -> Result<Vec<Row>>` and measure each op
//! with [`BenchCtx::measure`].

pub mod internode;
pub mod intranode;
pub mod low_latency;

use deepep_kernels::error::{EpError, Result};
use deepep_kernels::reference::random;
use deepep_kernels::runtime::nccl::Nccl;
use deepep_kernels::runtime::cupti;
use deepep_kernels::runtime::timing::{time_op, Event, L2Flush, Stats, TimingOpts};
use deepep_kernels::runtime::{Comm, DeviceBuffer, Gpu, LaunchCfg};
use deepep_kernels::tensor::{DType, Tensor};
use std::collections::HashMap;

/// One benchmark shape (per rank: `tokens` tokens of `hidden` channels, top-`topk` of `experts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Shape {
    pub tokens: usize,
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
}

/// Token counts of the `--sweep` (as in the issue: 128 ... 8192).
pub const SWEEP_TOKENS: &[usize] = &[128, 256, 512, 1024, 2048, 4096, 8192];
/// Hidden sizes of the `--sweep`.
pub const SWEEP_HIDDEN: &[usize] = &[2048, 4096, 7168];

/// Options shared by every mode (from the command line).
#[derive(Debug, Clone)]
pub struct BenchOpts {
    /// `None`: each mode's own default (intranode/internode 4096, low-latency 128).
    pub tokens: Option<usize>,
    pub hidden: usize,
    pub topk: usize,
    /// `--experts`, or 256 when not given (see [`BenchOpts::experts_or`]).
    pub experts: usize,
    /// Whether `--experts` was given on the command line.
    pub experts_explicit: bool,
    pub sweep: bool,
    /// SMs the kernels may use (`None`: each mode's default).
    pub num_sms: Option<u32>,
    pub timing: TimingOpts,
    pub seed: u64,
    /// Fewer repetitions and a smaller sweep (smoke runs).
    pub quick: bool,
    /// Also measure every row with DeepEP's statistic ([`BenchCtx::time_deepep`]).
    pub deepep_stat: bool,
    /// Low-latency mode: `-1` draws per rank ([`random::mask_random_slots`]; DeepEP's LL test: 10).
    pub ll_masked_slots: usize,
    /// Intranode mode: FP8 scales as a column-major `[N, H/128]` view (DeepEP's intranode test).
    pub col_major_scales: bool,
}

/// The command line's defaults: DeepEP's shapes (hidden 7168, top-8 of 256 experts), each mode's
/// own token count and SMs, seed 1, [`TimingOpts::default`], 10 masked low-latency slots.
impl Default for BenchOpts {
    fn default() -> Self {
        BenchOpts {
            tokens: None,
            hidden: 7168,
            topk: 8,
            experts: 256,
            experts_explicit: false,
            sweep: false,
            num_sms: None,
            timing: TimingOpts::default(),
            seed: 1,
            quick: false,
            deepep_stat: false,
            ll_masked_slots: 10,
            col_major_scales: false,
        }
    }
}

impl BenchOpts {
    /// The shapes a mode runs: the sweep, or the single shape with `default_tokens` when
    /// `--tokens` was not given.
    pub fn shapes(&self, default_tokens: usize) -> Vec<Shape> {
        let one = |tokens, hidden| Shape { tokens, hidden, topk: self.topk, experts: self.experts };
        if self.sweep {
            let tokens: Vec<usize> = if self.quick { vec![128, 1024, 4096] } else { SWEEP_TOKENS.to_vec() };
            let mut v = Vec::new();
            for &h in SWEEP_HIDDEN {
                for &t in &tokens {
                    v.push(one(t, h));
                }
            }
            v
        } else {
            vec![one(self.tokens.unwrap_or(default_tokens), self.hidden)]
        }
    }

    /// The expert count: `--experts` when given, else the mode's own default (288 for
    /// low-latency, DeepEP's `test_low_latency.py` default; 256 elsewhere).
    pub fn experts_or(&self, mode_default: usize) -> usize {
        if self.experts_explicit {
            self.experts
        } else {
            mode_default
        }
    }

    /// Reject shapes no mode can run, with the fix.
    pub fn validate(&self, world: usize) -> Result<()> {
        let bad = |m: String| Err(EpError::InvalidArgument(m));
        if self.topk == 0 || self.topk > self.experts {
            return bad(format!("--topk {} must be in 1..=--experts ({})", self.topk, self.experts));
        }
        if self.experts % world != 0 {
            return bad(format!("--experts {} must be a multiple of the rank count {world}", self.experts));
        }
        if self.hidden == 0 || self.hidden % 128 != 0 {
            return bad(format!("--hidden {} must be a positive multiple of 128 (FP8 scales are per 128 channels)", self.hidden));
        }
        if self.timing.reps == 0 {
            return bad("--reps must be at least 1".into());
        }
        Ok(())
    }
}

/// DeepEP-like routing of every rank for one shape.
#[derive(Debug, Clone)]
pub struct Routing {
    pub world: usize,
    pub shape: Shape,
    /// `topk_idx[r]`: rank `r`'s `[tokens, topk]` expert ids.
    pub topk_idx: Vec<Vec<i64>>,
    /// `tokens_to[s][d]`: tokens rank `s` sends to rank `d` (a token goes once to every rank that
    /// holds at least one of its experts; self included).
    pub tokens_to: Vec<Vec<usize>>,
}

/// Stream id of the benchmark routing in `reference::random`.
const ROUTING_STREAM: u64 = 0xBE7C;

impl Routing {
    /// Routing without `-1` slots (DeepEP's intranode test).
    pub fn new(seed: u64, world: usize, shape: Shape) -> Routing {
        Routing::masked(seed, world, shape, 0)
    }

    /// Routing with `masked_draws` random slots per rank set to `-1` after the top-k draw, as
    /// DeepEP's LL test does ([`random::mask_random_slots`]); the unmasked slots are those of
    /// [`Routing::new`] for the same seed.
    pub fn masked(seed: u64, world: usize, shape: Shape, masked_draws: usize) -> Routing {
        let per_rank = shape.experts / world;
        let mut topk_idx = Vec::with_capacity(world);
        let mut tokens_to = vec![vec![0usize; world]; world];
        for (s, row) in tokens_to.iter_mut().enumerate() {
            let mut rng = random::rng(seed, s, ROUTING_STREAM);
            let mut idx = random::topk_idx(&mut rng, shape.tokens, shape.topk, shape.experts, 0.0);
            random::mask_random_slots(&mut rng, &mut idx, shape.tokens, shape.topk, masked_draws);
            for t in 0..shape.tokens {
                let mut hit = vec![false; world];
                for &e in &idx[t * shape.topk..(t + 1) * shape.topk] {
                    if e >= 0 {
                        hit[e as usize / per_rank] = true;
                    }
                }
                for (d, h) in hit.into_iter().enumerate() {
                    row[d] += h as usize;
                }
            }
            topk_idx.push(idx);
        }
        Routing { world, shape, topk_idx, tokens_to }
    }

    /// Tokens rank `r` receives (self included).
    pub fn tokens_received(&self, r: usize) -> usize {
        (0..self.world).map(|s| self.tokens_to[s][r]).sum()
    }

    /// Per-peer bytes for rank `r` when every token carries `bytes_per_token`, in the direction
    /// of a dispatch: (send to each peer, receive from each peer). A combine moves the transpose.
    pub fn dispatch_bytes(&self, r: usize, bytes_per_token: usize) -> (Vec<usize>, Vec<usize>) {
        let send = (0..self.world).map(|d| self.tokens_to[r][d] * bytes_per_token).collect();
        let recv = (0..self.world).map(|s| self.tokens_to[s][r] * bytes_per_token).collect();
        (send, recv)
    }
}

/// Bytes of one token: BF16 `hidden * 2`; FP8 `hidden` + one f32 scale per 128 channels.
pub fn token_bytes(hidden: usize, fp8: bool) -> usize {
    if fp8 {
        hidden + hidden / 128 * 4
    } else {
        hidden * 2
    }
}

/// DeepEP's warm-up calls in `tests/utils.py::bench` (v1.2.1, `num_warmups=50`).
pub const DEEPEP_WARMUP: usize = 50;
/// DeepEP's timed calls in `tests/utils.py::bench` (`num_tests=50`; the first is dropped).
pub const DEEPEP_REPS: usize = 50;
/// Calls per profiler step of DeepEP's `tests/utils.py::bench_kineto` (`num_tests=30`): one
/// unrecorded step of 30 calls, then 30 recorded calls, no L2 flush; the figure is the average
/// duration of each named kernel.
pub const DEEPEP_KINETO_CALLS: usize = 30;
/// Bytes of the memset that separates the calls of [`BenchCtx::kernel_time_deepep`] in the CUPTI
/// records (an odd size no op uses; it is not an L2 flush).
const MARKER_BYTES: usize = 4100;

/// DeepEP's statistic over one rank's per-call times (microseconds, in call order): drop the
/// first sample (`times[1:]`), then mean / min / max of the rest (`mean_us`, `min_us`, `max_us`;
/// `median_us` is the rest's median, which DeepEP does not report). Fewer than two samples give
/// zeros with `reps == 0`.
pub fn deepep_stat(samples: &[f64]) -> Stats {
    Stats::from_samples(samples.get(1..).unwrap_or(&[]).to_vec())
}

/// Bytes a device copy of a dispatch's outputs into owned tensors moves through HBM: each of
/// `recv_tokens` received rows (`token_bytes(hidden, fp8)`: data, and FP8 scales) read once and
/// written once. This is the work DeepEP's timed dispatch includes (it returns fresh tensors)
/// and ours does not (our intranode outputs are views into the NVLink buffer).
pub fn owned_copy_bytes(recv_tokens: usize, hidden: usize, fp8: bool) -> usize {
    2 * recv_tokens * token_bytes(hidden, fp8)
}

/// Traffic of one low-latency op: `matrix[from][to]` bytes written by rank `from` into rank
/// `to`'s buffers (self included), and `own[r]` the bytes attributed to rank `r`'s own tokens
/// (DeepEP's convention for its LL figures: dispatch = what `r` sends, combine = what `r`'s
/// tokens bring back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Traffic {
    pub matrix: Vec<Vec<usize>>,
    pub own: Vec<usize>,
}

impl Traffic {
    /// Rank `r`'s per-peer (send, receive) byte counts, for the NCCL all-to-all.
    pub fn peers(&self, r: usize) -> (Vec<usize>, Vec<usize>) {
        (self.matrix[r].clone(), self.matrix.iter().map(|row| row[r]).collect())
    }
    /// Every count times `f` (rows of `f` calls per repetition).
    pub fn times(&self, f: usize) -> Traffic {
        Traffic { matrix: self.matrix.iter().map(|r| r.iter().map(|b| b * f).collect()).collect(), own: self.own.iter().map(|b| b * f).collect() }
    }
    /// Element-wise sum (dispatch followed by combine).
    pub fn plus(&self, o: &Traffic) -> Traffic {
        let add = |a: &[usize], b: &[usize]| a.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<_>>();
        Traffic { matrix: self.matrix.iter().zip(&o.matrix).map(|(a, b)| add(a, b)).collect(), own: add(&self.own, &o.own) }
    }
}

/// The bytes our kernels actually move for a row, next to its DeepEP-equivalent bytes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Moved {
    /// Bytes of the rank with the smallest GB/s (see [`Traffic::own`]).
    pub bytes: usize,
    /// Smallest per-rank GB/s over the row's median times.
    pub gbps: f64,
    /// NCCL all-to-all moving exactly these per-peer bytes (`None` without NCCL).
    pub nccl_us: Option<f64>,
    pub nccl_gbps: Option<f64>,
    /// `gbps / nccl_gbps`.
    pub ratio: Option<f64>,
}

/// One measured operation (one table row / JSON object).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub mode: String,
    pub op: String,
    pub shape: Shape,
    pub num_sms: u32,
    /// Bytes received by the slowest rank (the one the figures are for).
    pub recv_bytes: usize,
    /// Median time of the slowest rank, microseconds.
    pub us: f64,
    /// Smallest per-rank GB/s (received bytes / median).
    pub gbps: f64,
    pub nccl_us: Option<f64>,
    pub nccl_gbps: Option<f64>,
    /// `gbps / nccl_gbps`.
    pub ratio: Option<f64>,
    /// Every rank's timing.
    pub per_rank: Vec<Stats>,
    /// Kernel time (CUPTI: first kernel start to last kernel end per repetition, median, slowest
    /// rank), as DeepEP's profiler-based figures; `None` without CUPTI.
    pub kernel_us: Option<f64>,
    /// GB/s over `kernel_us` (smallest over ranks).
    pub kernel_gbps: Option<f64>,
    /// `--deepep-stat`: DeepEP's statistic ([`deepep_stat`]: 50 warm-up, L2 flushed once, mean
    /// of calls 2..50) for rank 0, the rank `test_intranode.py` prints.
    pub deepep_stat_us: Option<f64>,
    /// Rank 0's bytes / `deepep_stat_us`.
    pub deepep_stat_gbps: Option<f64>,
    /// Every rank's DeepEP-statistic summary (`mean_us` is the figure; empty without the flag).
    pub deepep_stat_per_rank: Vec<Stats>,
    /// `--deepep-stat` with CUPTI: kernel time the way DeepEP's `bench_kineto` takes it (30
    /// unrecorded calls, then the mean over 30 back-to-back calls, no L2 flush) for rank 0. For
    /// an op of one kernel (LL dispatch, LL combine) that is DeepEP's per-kernel figure; for
    /// several kernels it spans first start to last end of each call.
    pub deepep_kernel_us: Option<f64>,
    /// Every rank's (`mean_us`; empty when not measured).
    pub deepep_kernel_per_rank: Vec<Stats>,
    /// Low-latency rows: the bytes actually moved and their NCCL baseline (`recv_bytes`, `gbps`
    /// and `nccl_*` above count DeepEP's per-selection bytes).
    pub moved: Option<Moved>,
}

impl Row {
    /// A row of our figures alone: no NCCL baseline, kernel time, DeepEP statistic or moved bytes
    /// (set those with struct update syntax).
    pub fn new(mode: &str, op: impl Into<String>, shape: Shape, num_sms: u32, recv_bytes: usize, us: f64, gbps: f64) -> Row {
        Row {
            mode: mode.into(),
            op: op.into(),
            shape,
            num_sms,
            recv_bytes,
            us,
            gbps,
            nccl_us: None,
            nccl_gbps: None,
            ratio: None,
            per_rank: Vec::new(),
            kernel_us: None,
            kernel_gbps: None,
            deepep_stat_us: None,
            deepep_stat_gbps: None,
            deepep_stat_per_rank: Vec::new(),
            deepep_kernel_us: None,
            deepep_kernel_per_rank: Vec::new(),
            moved: None,
        }
    }
}

/// What a mode gets: the rank's communicator and GPU, an L2 flush buffer, the NCCL baseline.
pub struct BenchCtx<'a> {
    pub comm: &'a Comm,
    pub gpu: &'a Gpu,
    pub opts: BenchOpts,
    flush: L2Flush,
    nccl: Option<Nccl>,
    nccl_error: Option<String>,
    /// NCCL results per (send, recv) byte counts, so repeated layouts are measured once.
    nccl_cache: HashMap<(Vec<usize>, Vec<usize>), (f64, f64)>,
    /// Median time of an empty kernel measured the same way (slowest rank): the floor that
    /// event timing adds to every figure (DeepEP's profiler-based kernel times do not have it).
    pub floor_us: f64,
    /// Why kernel times (CUPTI) are not measured, if they are not (same on every rank).
    pub kernel_timer_error: Option<String>,
}

impl<'a> BenchCtx<'a> {
    /// Collective. NCCL failing to start is not fatal: rows then have no baseline and the
    /// reason is kept in [`BenchCtx::nccl_error`].
    pub fn new(comm: &'a Comm, gpu: &'a Gpu, opts: BenchOpts) -> Result<BenchCtx<'a>> {
        let flush = L2Flush::new(gpu)?;
        let (nccl, nccl_error) = if gpu.oversubscribed() {
            // NCCL refuses two ranks on one GPU ("Duplicate GPU", ncclInvalidUsage).
            (None, Some(format!("skipped: {} ranks share each GPU and NCCL needs one GPU per rank", gpu.ranks_per_gpu())))
        } else {
            match Nccl::new(gpu, comm) {
                Ok(n) => (Some(n), None),
                Err(e) => (None, Some(e.to_string())),
            }
        };
        // All ranks must agree on whether NCCL is there (the baseline is collective).
        let ok = comm.all_gather(&[nccl.is_some() as u8])?.iter().all(|v| v[0] == 1);
        let (nccl, nccl_error) = if ok { (nccl, None) } else { (None, nccl_error.or(Some("NCCL failed on another rank".into()))) };
        let empty = gpu.kernel("selftest", "ep_selftest_spin")?;
        let floor = time_op(gpu, comm, opts.timing, Some(&flush), || gpu.launch(&empty, &LaunchCfg::new(1, 32), deepep_kernels::args![0u64]))?
            .gather(comm)?;
        let floor_us = floor.iter().map(|s| s.median_us).fold(0.0, f64::max);
        let local = cupti::kernel_timer().err().map(String::from);
        let all = comm.all_gather(local.as_deref().unwrap_or("").as_bytes())?;
        let kernel_timer_error = all
            .iter()
            .enumerate()
            .find(|(_, m)| !m.is_empty())
            .map(|(r, m)| format!("rank {r}: {}", String::from_utf8_lossy(m)));
        Ok(BenchCtx { comm, gpu, opts, flush, nccl, nccl_error, nccl_cache: HashMap::new(), floor_us, kernel_timer_error })
    }

    /// Why the NCCL baseline is missing, if it is.
    pub fn nccl_error(&self) -> Option<&str> {
        self.nccl_error.as_deref()
    }

    /// Routing of `shape` for this run's seed.
    pub fn routing(&self, shape: Shape) -> Routing {
        Routing::new(self.opts.seed, self.comm.world(), shape)
    }

    /// Time `op` (collective; it enqueues GPU work on the rank's stream) with the run's
    /// repetition settings. Returns every rank's stats.
    pub fn time(&self, op: impl FnMut() -> Result<()>) -> Result<Vec<Stats>> {
        time_op(self.gpu, self.comm, self.opts.timing, Some(&self.flush), op)?.gather(self.comm)
    }

    /// Kernel times of `op` (collective): `reps` repetitions, each after an L2 flush, recorded
    /// with CUPTI; every rank's stats, or `None` when CUPTI is off or a rank could not split its
    /// records into repetitions.
    pub fn kernel_time(&self, mut op: impl FnMut() -> Result<()>) -> Result<Option<Vec<Stats>>> {
        if self.kernel_timer_error.is_some() {
            return Ok(None);
        }
        let timer = cupti::kernel_timer().map_err(|e| EpError::Unsupported(e.to_string()))?;
        let (gpu, reps) = (self.gpu, self.opts.timing.reps);
        self.gpu.sync("before kernel timing")?;
        self.comm.barrier()?;
        let recorded = timer.record(|| {
            for _ in 0..reps {
                self.flush.flush(gpu)?;
                op()?;
            }
            gpu.sync("kernel-timed repetitions")
        });
        // A failure here only costs the kernel-time column; the ranks agree below.
        let spans = match recorded {
            Ok(acts) => {
                let s = cupti::spans_per_rep(&acts, self.flush.bytes() as u64, reps);
                if s.is_none() {
                    tracing::warn!("kernel timing: {} activity records could not be split into {reps} repetitions", acts.len());
                }
                s
            }
            Err(e) => {
                tracing::warn!("kernel timing failed: {e}");
                self.gpu.sync("after failed kernel timing").ok();
                None
            }
        };
        let ok = self.comm.all_gather(&[spans.is_some() as u8])?.iter().all(|v| v[0] == 1);
        if !ok {
            return Ok(None);
        }
        Ok(Some(Stats::from_samples(spans.unwrap()).gather(self.comm)?))
    }

    /// Waits for this rank's GPU work, then for every rank (collective; `what` names the point in
    /// an error). Afterwards no peer reads or writes this rank's buffers any more, so they may be
    /// reused for the next shape or freed (the free is collective too).
    pub fn settle(&self, what: &str) -> Result<()> {
        self.gpu.sync(what)?;
        self.comm.barrier()
    }

    /// [`BenchCtx::settle`], then frees `buf` (collective).
    pub fn free<B>(&self, what: &str, buf: B) -> Result<()> {
        self.settle(what)?;
        drop(buf);
        Ok(())
    }

    /// A tensor on this rank's stream with every 32-bit word set to `word` (inputs whose values
    /// do not matter to the timing: 0x3f80_3f80 is 1.0 in bf16, 0x3f80_0000 1.0 in f32).
    pub fn filled(&self, dtype: DType, shape: &[usize], word: u32) -> Result<Tensor> {
        let t = Tensor::empty(self.gpu.stream(), dtype, shape)?;
        let bytes = t.numel() * dtype.size();
        if bytes >= 4 {
            self.gpu.memset_u32(t.ptr(), word, bytes / 4)?;
        }
        Ok(t)
    }

    /// Measure one operation and its NCCL baseline. `recv_bytes[r]` is what rank `r` receives
    /// (the figure's numerator); `send_to` / `recv_from` are this rank's per-peer byte counts
    /// for the NCCL all-to-all moving the same bytes (pass the transposed counts for a combine).
    #[allow(clippy::too_many_arguments)]
    pub fn measure(
        &mut self,
        mode: &str,
        op_name: &str,
        shape: Shape,
        num_sms: u32,
        recv_bytes: &[usize],
        send_to: &[usize],
        recv_from: &[usize],
        op: impl FnMut() -> Result<()>,
    ) -> Result<Row> {
        let mut op = op;
        let per_rank = self.time(&mut op)?;
        let (us, gbps, slow) = figures(&per_rank, recv_bytes);
        let kernel = self.kernel_time(&mut op)?.map(|k| figures(&k, recv_bytes));
        let deepep = if self.opts.deepep_stat { self.time_deepep(&mut op)? } else { Vec::new() };
        let (deepep_stat_us, deepep_stat_gbps) = match deepep.first() {
            Some(s) if s.reps > 0 => (Some(s.mean_us), Some(gbps_of(recv_bytes[0], s.mean_us))),
            _ => (None, None),
        };
        let deepep_kernel = if self.opts.deepep_stat { self.kernel_time_deepep(&mut op)?.unwrap_or_default() } else { Vec::new() };
        let nccl = self.nccl_baseline(send_to, recv_from)?;
        Ok(Row {
            nccl_us: nccl.map(|n| n.0),
            nccl_gbps: nccl.map(|n| n.1),
            ratio: nccl.map(|n| gbps / n.1),
            per_rank,
            kernel_us: kernel.map(|k| k.0),
            kernel_gbps: kernel.map(|k| k.1),
            deepep_stat_us,
            deepep_stat_gbps,
            deepep_stat_per_rank: deepep,
            deepep_kernel_us: deepep_kernel.first().map(|s| s.mean_us),
            deepep_kernel_per_rank: deepep_kernel,
            ..Row::new(mode, op_name, shape, num_sms, recv_bytes[slow], us, gbps)
        })
    }

    /// Kernel time of `op` the way DeepEP's `bench_kineto` measures it (collective): 30 calls
    /// (DeepEP's unrecorded profiler step), a sync and barrier (DeepEP: a large matmul and an
    /// all-reduce), then 30 calls recorded with CUPTI, back to back without L2 flushes, each
    /// preceded by a tiny marker memset that only separates the calls in the records. Every
    /// rank's stats of the per-call kernel spans (`mean_us` is DeepEP's figure), or `None` when
    /// CUPTI is off or a rank could not split its records.
    pub fn kernel_time_deepep(&self, mut op: impl FnMut() -> Result<()>) -> Result<Option<Vec<Stats>>> {
        if self.kernel_timer_error.is_some() {
            return Ok(None);
        }
        let timer = cupti::kernel_timer().map_err(|e| EpError::Unsupported(e.to_string()))?;
        let gpu = self.gpu;
        let marker = DeviceBuffer::new(gpu, MARKER_BYTES)?;
        for _ in 0..DEEPEP_KINETO_CALLS {
            op()?;
        }
        gpu.sync("before DeepEP-style kernel timing")?;
        self.comm.barrier()?;
        let recorded = timer.record(|| {
            for _ in 0..DEEPEP_KINETO_CALLS {
                marker.fill_u32(gpu, 0)?;
                op()?;
            }
            gpu.sync("DeepEP-style kernel-timed calls")
        });
        let spans = match recorded {
            Ok(acts) => cupti::spans_per_rep(&acts, MARKER_BYTES as u64, DEEPEP_KINETO_CALLS),
            Err(e) => {
                tracing::warn!("DeepEP-style kernel timing failed: {e}");
                gpu.sync("after failed kernel timing").ok();
                None
            }
        };
        let ok = self.comm.all_gather(&[spans.is_some() as u8])?.iter().all(|v| v[0] == 1);
        if !ok {
            return Ok(None);
        }
        Ok(Some(Stats::from_samples(spans.unwrap()).gather(self.comm)?))
    }

    /// Time `op` the way DeepEP v1.2.1's `tests/utils.py::bench` does (collective): after a
    /// barrier, [`DEEPEP_WARMUP`] untimed calls, one L2 flush, then [`DEEPEP_REPS`] calls back to
    /// back, each bracketed by CUDA events with no flush in between; every rank's
    /// [`deepep_stat`] (first call dropped, mean of the rest). Differences that remain: our flush
    /// buffer is `max(2 x L2, 64 MB)` instead of 256 MB, and ours is one Rust call per op where
    /// DeepEP's includes its Python wrapper (and, intranode, allocating the output tensors).
    pub fn time_deepep(&self, mut op: impl FnMut() -> Result<()>) -> Result<Vec<Stats>> {
        let gpu = self.gpu;
        gpu.sync("before DeepEP-statistic timing")?;
        self.comm.barrier()?;
        for _ in 0..DEEPEP_WARMUP {
            op()?;
        }
        self.flush.flush(gpu)?;
        let events: Vec<(Event, Event)> = (0..DEEPEP_REPS).map(|_| Ok((Event::new(gpu)?, Event::new(gpu)?))).collect::<Result<_>>()?;
        for (a, b) in &events {
            a.record(gpu)?;
            op()?;
            b.record(gpu)?;
        }
        gpu.sync("DeepEP-statistic repetitions")?;
        let samples = events.iter().map(|(a, b)| Ok(a.elapsed_ms(b)? as f64 * 1e3)).collect::<Result<Vec<f64>>>()?;
        deepep_stat(&samples).gather(self.comm)
    }

    /// Attach the bytes actually moved (`moved`) to a row measured with [`BenchCtx::measure`]:
    /// GB/s over the row's per-rank medians and an NCCL all-to-all moving `moved`'s per-peer
    /// bytes (collective).
    pub fn attach_moved(&mut self, row: &mut Row, moved: &Traffic) -> Result<()> {
        let (_, gbps, slow) = figures(&row.per_rank, &moved.own);
        let (send, recv) = moved.peers(self.comm.rank());
        let nccl = self.nccl_baseline(&send, &recv)?;
        row.moved = Some(Moved {
            bytes: moved.own[slow],
            gbps,
            nccl_us: nccl.map(|n| n.0),
            nccl_gbps: nccl.map(|n| n.1),
            ratio: nccl.map(|n| gbps / n.1),
        });
        Ok(())
    }

    /// NCCL all-to-all with this rank's per-peer byte counts: (slowest median us, smallest GB/s
    /// over received bytes). `None` when NCCL is not available.
    pub fn nccl_baseline(&mut self, send_to: &[usize], recv_from: &[usize]) -> Result<Option<(f64, f64)>> {
        if self.nccl.is_none() {
            return Ok(None);
        }
        let key = (send_to.to_vec(), recv_from.to_vec());
        // Every rank must take the same branch: cache hits are agreed collectively.
        let hit = self.nccl_cache.get(&key).copied();
        let all_hit = self.comm.all_gather(&[hit.is_some() as u8])?.iter().all(|v| v[0] == 1);
        if let (true, Some(h)) = (all_hit, hit) {
            return Ok(Some(h));
        }
        let send_total: usize = send_to.iter().sum();
        let recv_total: usize = recv_from.iter().sum();
        let sbuf = DeviceBuffer::new(self.gpu, send_total)?;
        sbuf.fill_u8(self.gpu, 0x5A)?;
        let rbuf = DeviceBuffer::new(self.gpu, recv_total)?;
        let gpu = self.gpu;
        let nccl = self.nccl.as_ref().unwrap();
        let stats = time_op(gpu, self.comm, self.opts.timing, Some(&self.flush), || {
            nccl.all_to_all_bytes(gpu, sbuf.ptr(), send_to, rbuf.ptr(), recv_from)
        })?
        .gather(self.comm)?;
        let recv_all: Vec<usize> = self.comm.all_gather_u64(recv_total as u64)?.into_iter().map(|v| v as usize).collect();
        let (us, gbps, _) = figures(&stats, &recv_all);
        self.nccl_cache.insert(key, (us, gbps));
        Ok(Some((us, gbps)))
    }
}

/// GB/s of `bytes` in `us` microseconds (0 when `us` is not positive).
pub fn gbps_of(bytes: usize, us: f64) -> f64 {
    if us > 0.0 {
        bytes as f64 / (us * 1e-6) / 1e9
    } else {
        0.0
    }
}

/// From every rank's stats and received bytes: (slowest median us, smallest GB/s, index of the
/// rank with the smallest GB/s) — the convention of every row.
pub fn figures(per_rank: &[Stats], recv_bytes: &[usize]) -> (f64, f64, usize) {
    let us = per_rank.iter().map(|s| s.median_us).fold(0.0, f64::max);
    let mut slow = 0;
    let mut gbps = f64::INFINITY;
    for (r, s) in per_rank.iter().enumerate() {
        let g = if s.median_us > 0.0 { recv_bytes[r] as f64 / (s.median_us * 1e-6) / 1e9 } else { 0.0 };
        if g < gbps {
            gbps = g;
            slow = r;
        }
    }
    (us, if gbps.is_finite() { gbps } else { 0.0 }, slow)
}

/// Mode `nccl`: the baseline alone, for dispatch BF16, dispatch FP8 and combine byte counts of
/// the DeepEP-like routing.
pub fn run_nccl(ctx: &mut BenchCtx, shapes: &[Shape]) -> Result<Vec<Row>> {
    if ctx.nccl.is_none() {
        return Err(EpError::Nccl {
            context: "mode nccl".into(),
            message: ctx.nccl_error.clone().unwrap_or_else(|| "NCCL unavailable".into()),
        });
    }
    let me = ctx.comm.rank();
    let mut rows = Vec::new();
    for &shape in shapes {
        let routing = ctx.routing(shape);
        for (op, fp8, transpose) in [("dispatch-bf16", false, false), ("dispatch-fp8", true, false), ("combine-bf16", false, true)] {
            let tb = token_bytes(shape.hidden, fp8);
            let (mut send, mut recv) = routing.dispatch_bytes(me, tb);
            if transpose {
                // combine: every rank sends back what it received
                std::mem::swap(&mut send, &mut recv);
            }
            let (us, gbps) = ctx.nccl_baseline(&send, &recv)?.unwrap();
            rows.push(Row { nccl_us: Some(us), nccl_gbps: Some(gbps), ratio: Some(1.0), ..Row::new("nccl", op, shape, 0, recv.iter().sum(), us, gbps) });
        }
    }
    Ok(rows)
}

/// The table printed by rank 0 (the `op` column as wide as its longest entry). `med us` / `GB/s`
/// are our statistic (median, slowest rank); with `--deepep-stat` three more columns give DeepEP's
/// (`DeepEP-stat us` = mean of calls 2..50 after 50 warm-ups, L2 flushed once; `DeepEP-kern us` =
/// `bench_kineto`'s mean kernel time over 30 calls; both rank 0). Rows
/// with [`Row::moved`] (low-latency) are repeated in a second table of the bytes actually moved.
pub fn format_table(rows: &[Row]) -> String {
    let opw = rows.iter().map(|r| r.op.len()).chain([2]).max().unwrap_or(2);
    let modew = rows.iter().map(|r| r.mode.len()).chain([4]).max().unwrap_or(4);
    let dpe = rows.iter().any(|r| r.deepep_stat_us.is_some());
    let mut s = format!(
        "{:<modew$} {:<opw$} {:>6} {:>6} {:>4} {:>7} {:>4} {:>10} {:>9} {:>10} {:>9} {:>10} {:>9} {:>6}",
        "mode", "op", "tokens", "hidden", "topk", "experts", "SMs", "med us", "GB/s", "kernel us", "kern GB/s", "NCCL us", "NCCL GB/s", "ratio"
    );
    if dpe {
        s.push_str(&format!(" {:>14} {:>16} {:>14}", "DeepEP-stat us", "DeepEP-stat GB/s", "DeepEP-kern us"));
    }
    s.push('\n');
    let opt = |v: Option<f64>, p: usize| v.map(|x| format!("{x:.p$}")).unwrap_or_else(|| "-".into());
    for r in rows {
        s.push_str(&format!(
            "{:<modew$} {:<opw$} {:>6} {:>6} {:>4} {:>7} {:>4} {:>10.1} {:>9.1} {:>10} {:>9} {:>10} {:>9} {:>6}",
            r.mode,
            r.op,
            r.shape.tokens,
            r.shape.hidden,
            r.shape.topk,
            r.shape.experts,
            if r.num_sms == 0 { "-".to_string() } else { r.num_sms.to_string() },
            r.us,
            r.gbps,
            opt(r.kernel_us, 1),
            opt(r.kernel_gbps, 1),
            opt(r.nccl_us, 1),
            opt(r.nccl_gbps, 1),
            opt(r.ratio, 2)
        ));
        if dpe {
            s.push_str(&format!(" {:>14} {:>16} {:>14}", opt(r.deepep_stat_us, 1), opt(r.deepep_stat_gbps, 1), opt(r.deepep_kernel_us, 1)));
        }
        s.push('\n');
    }
    // DeepEP's LL test prints every rank's figures: so do we, for the low-latency rows.
    let per_rank: Vec<&Row> = rows.iter().filter(|r| r.mode == "low-latency" && r.deepep_stat_per_rank.len() > 1).collect();
    if !per_rank.is_empty() {
        s.push_str("\nlow-latency, DeepEP's statistic per rank (its LL test prints every rank): DeepEP-stat us | DeepEP-kern us, rank 0 / rank 1 / ...\n");
        let list = |v: &[Stats]| if v.is_empty() { "-".to_string() } else { v.iter().map(|x| format!("{:.1}", x.mean_us)).collect::<Vec<_>>().join(" / ") };
        for r in per_rank {
            s.push_str(&format!("{} {}: {} | {}\n", r.op, r.shape.tokens, list(&r.deepep_stat_per_rank), list(&r.deepep_kernel_per_rank)));
        }
    }
    let moved: Vec<&Row> = rows.iter().filter(|r| r.moved.is_some()).collect();
    if !moved.is_empty() {
        let opw = moved.iter().map(|r| r.op.len()).chain([2]).max().unwrap_or(2);
        s.push_str("\nlow-latency, bytes actually moved (DeepEP MB / GB/s / NCCL above: per-selection bytes; here: what our kernels write, same med us):\n");
        s.push_str(&format!(
            "{:<opw$} {:>6} {:>10} {:>10} {:>10} {:>9} {:>13} {:>15} {:>11}\n",
            "op", "tokens", "DeepEP MB", "moved MB", "med us", "GB/s", "NCCL(mv) us", "NCCL(mv) GB/s", "ratio(mv)"
        ));
        for r in moved {
            let m = r.moved.unwrap();
            s.push_str(&format!(
                "{:<opw$} {:>6} {:>10.2} {:>10.2} {:>10.1} {:>9.1} {:>13} {:>15} {:>11}\n",
                r.op,
                r.shape.tokens,
                r.recv_bytes as f64 / 1e6,
                m.bytes as f64 / 1e6,
                r.us,
                m.gbps,
                opt(m.nccl_us, 1),
                opt(m.nccl_gbps, 1),
                opt(m.ratio, 2)
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_counts_each_token_once_per_destination_rank() {
        let shape = Shape { tokens: 300, hidden: 128, topk: 8, experts: 64 };
        let r = Routing::new(7, 4, shape);
        for s in 0..4 {
            let idx = &r.topk_idx[s];
            for d in 0..4 {
                let expect = (0..300).filter(|&t| idx[t * 8..t * 8 + 8].iter().any(|&e| e as usize / 16 == d)).count();
                assert_eq!(r.tokens_to[s][d], expect);
            }
            // every token goes somewhere, at most to every rank
            let sent: usize = r.tokens_to[s].iter().sum();
            assert!((300..=1200).contains(&sent));
        }
        // deterministic per seed, different across seeds
        assert_eq!(Routing::new(7, 4, shape).tokens_to, r.tokens_to);
        assert_ne!(Routing::new(8, 4, shape).topk_idx, r.topk_idx);
        let (send, recv) = r.dispatch_bytes(1, 10);
        assert_eq!(send[2], r.tokens_to[1][2] * 10);
        assert_eq!(recv[3], r.tokens_to[3][1] * 10);
        assert_eq!(r.tokens_received(1), (0..4).map(|s| r.tokens_to[s][1]).sum::<usize>());
    }

    #[test]
    fn table_columns_line_up() {
        let shape = Shape { tokens: 4096, hidden: 7168, topk: 8, experts: 256 };
        let row = |op: &str| Row { nccl_us: Some(222.9), kernel_us: Some(180.04), ..Row::new("intranode", op, shape, 24, 1, 213.04, 549.93) };
        let t = format_table(&[row("dispatch-bf16"), row("dispatch-bf16-uncached rdma")]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{t}");
        assert!(lines[1].contains(" 213.0 ") && lines[1].contains(" 549.9 ") && lines[1].contains(" 180.0 ") && lines[1].ends_with("     -"), "{t}");
    }

    #[test]
    fn deepep_stat_drops_only_the_first_call_and_averages_the_rest() {
        // DeepEP: np.array(times)[1:], then np.average / min / max.
        let s = deepep_stat(&[100.0, 4.0, 1.0, 3.0, 2.0]);
        assert_eq!((s.mean_us, s.min_us, s.max_us, s.reps), (2.5, 1.0, 4.0, 4));
        // The slow first call (cold L2 after the single flush) is what gets dropped, nothing else.
        let s = deepep_stat(&[1.0, 50.0, 2.0]);
        assert_eq!((s.mean_us, s.max_us, s.reps), (26.0, 50.0, 2));
        assert_eq!(deepep_stat(&[7.0]).reps, 0);
        assert_eq!(deepep_stat(&[]).reps, 0);
        assert_eq!((DEEPEP_WARMUP, DEEPEP_REPS, DEEPEP_KINETO_CALLS), (50, 50, 30));
        // The call separator is a u32 memset, never mistaken for an L2 flush (>= 64 MB).
        const { assert!(MARKER_BYTES % 4 == 0 && MARKER_BYTES < 64 << 20) };
        assert_eq!(gbps_of(2_000_000, 1000.0), 2.0);
        assert_eq!(gbps_of(1, 0.0), 0.0);
    }

    #[test]
    fn owned_copy_bytes_read_and_write_every_received_row() {
        assert_eq!(owned_copy_bytes(4096, 7168, false), 2 * 4096 * 14336);
        // 2 ranks, 4096 x 7168, top-8 of 256: a rank receives ~8160 rows (117 MB, the row's
        // recv_bytes), so the copy reads ~117 MB and writes ~117 MB.
        let r = Routing::new(1, 2, Shape { tokens: 4096, hidden: 7168, topk: 8, experts: 256 });
        let m = r.tokens_received(0);
        assert!((8100..8192).contains(&m), "{m} rows");
        let mb = owned_copy_bytes(m, 7168, false) as f64 / 1e6;
        assert!((232.0..235.0).contains(&mb), "{mb} MB");
        assert_eq!(owned_copy_bytes(10, 7168, true), 2 * 10 * (7168 + 56 * 4));
        assert_eq!(owned_copy_bytes(0, 7168, true), 0);
    }

    #[test]
    fn traffic_peers_times_and_plus() {
        let t = Traffic { matrix: vec![vec![1, 2], vec![3, 4]], own: vec![3, 7] };
        assert_eq!(t.peers(0), (vec![1, 2], vec![1, 3]));
        assert_eq!(t.peers(1), (vec![3, 4], vec![2, 4]));
        assert_eq!(t.times(10), Traffic { matrix: vec![vec![10, 20], vec![30, 40]], own: vec![30, 70] });
        assert_eq!(t.plus(&t.times(2)), t.times(3));
    }

    #[test]
    fn masked_routing_keeps_the_unmasked_slots_and_skips_minus_one() {
        let shape = Shape { tokens: 128, hidden: 7168, topk: 8, experts: 288 };
        let plain = Routing::new(1, 2, shape);
        let masked = Routing::masked(1, 2, shape, 10);
        for r in 0..2 {
            let (p, m) = (&plain.topk_idx[r], &masked.topk_idx[r]);
            let minus: usize = m.iter().filter(|&&e| e == -1).count();
            assert!((1..=10).contains(&minus), "rank {r}: {minus} masked slots");
            assert!(p.iter().zip(m).all(|(a, b)| b == a || *b == -1));
            assert!(p.iter().all(|&e| e >= 0));
            // tokens_to counts only valid slots: recompute from the masked ids.
            for d in 0..2 {
                let expect = (0..128).filter(|&t| m[t * 8..t * 8 + 8].iter().any(|&e| e >= 0 && e as usize / 144 == d)).count();
                assert_eq!(masked.tokens_to[r][d], expect);
            }
        }
        assert_ne!(plain.topk_idx, masked.topk_idx);
        assert_eq!(Routing::masked(1, 2, shape, 0).topk_idx, plain.topk_idx);
    }

    #[test]
    fn table_names_both_statistics_and_lists_moved_bytes() {
        let shape = Shape { tokens: 128, hidden: 7168, topk: 8, experts: 288 };
        let mut row = Row {
            nccl_us: Some(51.5),
            nccl_gbps: Some(284.9),
            ratio: Some(1.63),
            kernel_us: Some(27.8),
            kernel_gbps: Some(527.3),
            ..Row::new("low-latency", "combine-bf16", shape, 132, 14_680_064, 31.7, 462.9)
        };
        let t = format_table(&[row.clone()]);
        assert!(t.lines().next().unwrap().contains("med us") && !t.contains("DeepEP-stat") && !t.contains("actually moved"), "{t}");
        row.deepep_stat_us = Some(33.25);
        row.deepep_kernel_us = Some(28.04);
        let st = |m: f64| Stats { median_us: m, mean_us: m, min_us: m, max_us: m, reps: 49 };
        row.deepep_stat_per_rank = vec![st(33.25), st(34.0)];
        row.deepep_kernel_per_rank = vec![st(28.04), st(29.0)];
        row.moved = Some(Moved { bytes: 3_700_000, gbps: 116.7, nccl_us: Some(20.0), nccl_gbps: Some(185.0), ratio: Some(0.63) });
        let t = format_table(&[row]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("DeepEP-stat us") && lines[0].contains("DeepEP-stat GB/s") && lines[0].ends_with("DeepEP-kern us"), "{t}");
        assert_eq!(lines[0].len(), lines[1].len(), "{t}");
        assert!(lines[1].contains(" 33.2 ") && lines[1].contains(" - ") && lines[1].ends_with(" 28.0"), "{t}");
        assert!(lines[3].contains("per rank"), "{t}");
        assert_eq!(lines[4], "combine-bf16 128: 33.2 / 34.0 | 28.0 / 29.0", "{t}");
        assert!(lines[6].contains("bytes actually moved"), "{t}");
        assert!(lines[7].contains("moved MB") && lines[7].contains("NCCL(mv) GB/s"), "{t}");
        assert!(lines[8].starts_with("combine-bf16") && lines[8].contains(" 14.68 ") && lines[8].contains(" 3.70 ") && lines[8].contains(" 116.7 ") && lines[8].ends_with(" 0.63"), "{t}");
    }

    #[test]
    fn token_bytes_match_deepep() {
        assert_eq!(token_bytes(7168, false), 14336);
        assert_eq!(token_bytes(7168, true), 7168 + 56 * 4);
    }

    #[test]
    fn figures_pick_the_slowest_rank() {
        let st = |m: f64| Stats { median_us: m, mean_us: m, min_us: m, max_us: m, reps: 1 };
        let (us, gbps, slow) = figures(&[st(100.0), st(200.0)], &[1_000_000, 1_000_000]);
        assert_eq!((us, slow), (200.0, 1));
        assert!((gbps - 5.0).abs() < 1e-9);
    }

    #[test]
    fn shapes_and_validation() {
        let o = BenchOpts::default();
        assert_eq!(o.shapes(4096), vec![Shape { tokens: 4096, hidden: 7168, topk: 8, experts: 256 }]);
        assert_eq!(BenchOpts { sweep: true, ..o.clone() }.shapes(1).len(), SWEEP_TOKENS.len() * SWEEP_HIDDEN.len());
        assert!(o.validate(2).is_ok());
        assert_eq!(o.experts_or(288), 288);
        assert_eq!(o.experts_or(crate::bench::low_latency::DEFAULT_EXPERTS), 288);
        assert_eq!(BenchOpts { experts_explicit: true, ..o.clone() }.experts_or(288), 256);
        let e = BenchOpts { experts: 255, ..o.clone() }.validate(2).unwrap_err().to_string();
        assert!(e.contains("--experts 255"), "{e}");
        let e = BenchOpts { hidden: 100, ..o }.validate(2).unwrap_err().to_string();
        assert!(e.contains("multiple of 128"), "{e}");
    }
}
