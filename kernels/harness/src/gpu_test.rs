//! Collective GPU test cases and their runner (`deepep-gpu-tests`).
//!
//! Every rank runs the same cases in the same order. A case is a function of a [`Ctx`] (the
//! rank's [`Comm`] and [`Gpu`], and a seed); inputs are generated from `(seed, rank)` with
//! `reference::random`, so every rank can compute the CPU reference of all ranks locally. Outputs
//! are poisoned with [`POISON_U32`] before a run ([`Ctx::poisoned`]). After each case the ranks
//! exchange their verdicts; rank 0 prints one line per case and finally exactly
//! `N passed, M failed`.
//!
//! Families register their cases in [`all_cases`] ([`crate::cases::intranode::cases`],
//! [`crate::cases::low_latency::cases`], [`crate::cases::internode::cases`]).

use deepep_kernels::error::{EpError, Phase};
use deepep_kernels::runtime::timing::{time_op, TimingOpts};
use deepep_kernels::runtime::{Comm, DeviceBuffer, Gpu, IpcBuffer, LaunchCfg};
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

/// The result type of a case: any error (its message is reported).
pub type CaseResult = anyhow::Result<()>;

/// Return `Err(Skip(..).into())` from a case that cannot run here (e.g. an optional library is
/// missing). It counts as skipped when every rank skips it, as failed otherwise.
#[derive(Debug)]
pub struct Skip(pub String);

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "skipped: {}", self.0)
    }
}

impl std::error::Error for Skip {}

/// Poison written into outputs before a kernel runs: a NaN as bf16 (0x7FC1) and as f32, an
/// implausible value as i32/i64, so an element the kernel should have written but did not is
/// caught by an exact comparison.
pub const POISON_U32: u32 = 0x7FC1_7FC1;

/// What a case gets.
pub struct Ctx<'a> {
    pub comm: &'a Comm,
    pub gpu: &'a Gpu,
    /// Seed of this case and repetition (the same on every rank).
    pub seed: u64,
    /// Repetition index (`--repeat`).
    pub iteration: usize,
}

impl Ctx<'_> {
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    pub fn world(&self) -> usize {
        self.comm.world()
    }
    /// [`Gpu::fit_sms`] applied to an intranode config: with several ranks per GPU every rank's
    /// grid must fit at once, so cases written for a whole GPU shrink to the rank's share.
    pub fn fit_config(&self, c: deepep_kernels::config::Config) -> deepep_kernels::config::Config {
        deepep_kernels::config::Config { num_sms: self.gpu.fit_sms(c.num_sms), ..c }
    }
    /// A device buffer of `bytes` (rounded up to 4) filled with [`POISON_U32`].
    pub fn poisoned(&self, bytes: usize) -> deepep_kernels::Result<DeviceBuffer> {
        let b = DeviceBuffer::new(self.gpu, bytes.next_multiple_of(4))?;
        b.fill_u32(self.gpu, POISON_U32)?;
        Ok(b)
    }
}

type CaseFn = Box<dyn Fn(&Ctx) -> CaseResult + Send + Sync>;

/// One named collective test case.
pub struct Case {
    pub name: String,
    /// Smallest world size the case makes sense for (smaller worlds skip it).
    pub min_world: usize,
    run: CaseFn,
}

impl Case {
    pub fn new(name: impl Into<String>, run: impl Fn(&Ctx) -> CaseResult + Send + Sync + 'static) -> Case {
        Case { name: name.into(), min_world: 1, run: Box::new(run) }
    }
    pub fn min_world(mut self, n: usize) -> Case {
        self.min_world = n;
        self
    }
}

/// Every registered case, in a fixed order.
pub fn all_cases() -> Vec<Case> {
    let mut v = selftest_cases();
    v.extend(crate::cases::intranode::cases());
    v.extend(crate::cases::low_latency::cases());
    v.extend(crate::cases::internode::cases());
    // Last: it loads CUPTI into the process, which nothing before it should see.
    v.push(cupti_case());
    v
}

/// Runner options.
#[derive(Debug, Clone, Default)]
pub struct RunOpts {
    pub seed: u64,
    pub filter: Option<String>,
    pub repeat: usize,
    /// Host bound of one case; `None`: `DEEPEP_CASE_TIMEOUT_S` or [`DEFAULT_CASE_TIMEOUT`].
    pub case_timeout: Option<Duration>,
}

/// Totals of a run (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Totals {
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
}

impl Totals {
    /// The final line, exactly `N passed, M failed`.
    pub fn summary(&self) -> String {
        format!("{} passed, {} failed", self.passed, self.failed)
    }
}

fn case_seed(seed: u64, name: &str, iteration: usize) -> u64 {
    // FNV-1a of the name, mixed with the run seed and the repetition.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    seed ^ h.rotate_left(17) ^ (iteration as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Verdict of one rank for one case: `ok`, or an error message; `fatal` when this rank's GPU
/// context is unusable afterwards (remaining cases are not run).
struct Verdict {
    ok: bool,
    fatal: bool,
    skipped: bool,
    msg: String,
}

impl Verdict {
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![self.ok as u8, self.fatal as u8, self.skipped as u8];
        v.extend_from_slice(self.msg.as_bytes());
        v
    }
    fn decode(b: &[u8]) -> Verdict {
        Verdict { ok: b[0] != 0, fatal: b[1] != 0, skipped: b[2] != 0, msg: String::from_utf8_lossy(&b[3..]).into_owned() }
    }
}

/// Default bound of one case on the host (`DEEPEP_CASE_TIMEOUT_S` overrides).
pub const DEFAULT_CASE_TIMEOUT: Duration = Duration::from_secs(120);

/// What the watchdog knows about the run.
struct Progress {
    case: Option<(String, Instant)>,
    passed: usize,
    failed: usize,
    /// Case runs not started yet (excluding the current one).
    remaining: usize,
}

/// Exit code of a rank whose case exceeded the host bound.
pub const EXIT_CASE_HUNG: i32 = 5;

/// A thread that ends the process when one case runs longer than `limit` on the host (a hang
/// that no GPU-side timeout catches, e.g. a host-side NVSHMEM barrier nobody else reaches). It
/// names the case and, on rank 0, still emits the final `N passed, M failed` line (the hung case
/// and the ones not run count as failed).
fn spawn_watchdog(rank: usize, limit: Duration, progress: std::sync::Arc<std::sync::Mutex<Progress>>) {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(500));
        let p = progress.lock().unwrap();
        if let Some((name, since)) = &p.case {
            if since.elapsed() > limit {
                eprintln!(
                    "rank {rank}: case {name} still running after {:.0} s (DEEPEP_CASE_TIMEOUT_S); it hangs on the host, stopping",
                    limit.as_secs_f64()
                );
                if rank == 0 {
                    println!("FAIL {name}: hung for more than {:.0} s on the host", limit.as_secs_f64());
                    let t = Totals { passed: p.passed, failed: p.failed + 1 + p.remaining, skipped: 0 };
                    deepep_kernels::runtime::launcher::final_line(0, &t.summary());
                }
                std::process::exit(EXIT_CASE_HUNG);
            }
        }
    });
}

/// Run `cases` (filtered) `opts.repeat` times each. Collective. Rank 0 prints the per-case lines.
pub fn run_cases(comm: &Comm, gpu: &Gpu, cases: &[Case], opts: &RunOpts) -> deepep_kernels::Result<Totals> {
    let mut t = Totals::default();
    let selected: Vec<&Case> = cases.iter().filter(|c| opts.filter.as_deref().map_or(true, |f| c.name.contains(f))).collect();
    let me = comm.rank();
    let limit = match opts.case_timeout {
        Some(d) => d,
        None => deepep_kernels::runtime::env_num::<f64>("DEEPEP_CASE_TIMEOUT_S")?.map(Duration::from_secs_f64).unwrap_or(DEFAULT_CASE_TIMEOUT),
    };
    let progress = std::sync::Arc::new(std::sync::Mutex::new(Progress {
        case: None,
        passed: 0,
        failed: 0,
        remaining: selected.len() * opts.repeat.max(1),
    }));
    spawn_watchdog(me, limit, progress.clone());
    let say = |s: String| {
        if me == 0 {
            println!("{s}");
        }
    };
    let mut dead = false;
    for c in &selected {
        for it in 0..opts.repeat.max(1) {
            let label = if opts.repeat > 1 { format!("{} #{it}", c.name) } else { c.name.clone() };
            if comm.world() < c.min_world {
                say(format!("skip {label} (needs {} ranks)", c.min_world));
                t.skipped += 1;
                progress.lock().unwrap().remaining -= 1;
                continue;
            }
            if dead {
                say(format!("FAIL {label}: not run (a rank's GPU context failed earlier)"));
                t.failed += 1;
                progress.lock().unwrap().remaining -= 1;
                continue;
            }
            gpu.clear_error();
            let ctx = Ctx { comm, gpu, seed: case_seed(opts.seed, &c.name, it), iteration: it };
            let start = Instant::now();
            {
                let mut p = progress.lock().unwrap();
                p.case = Some((label.clone(), start));
                p.remaining = p.remaining.saturating_sub(1);
                (p.passed, p.failed) = (t.passed, t.failed);
            }
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| (c.run)(&ctx)));
            let mut v = match r {
                Ok(Ok(())) => Verdict { ok: true, fatal: false, skipped: false, msg: String::new() },
                Ok(Err(e)) => match e.downcast_ref::<Skip>() {
                    Some(s) => Verdict { ok: false, fatal: false, skipped: true, msg: s.0.clone() },
                    None => Verdict { ok: false, fatal: false, skipped: false, msg: format!("{e:#}") },
                },
                Err(p) => {
                    let m = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                    Verdict { ok: false, fatal: false, skipped: false, msg: format!("panicked: {}", m.unwrap_or_default()) }
                }
            };
            // Drain this rank's GPU work; a broken context makes the rest pointless.
            match gpu.sync(&format!("end of case {}", c.name)) {
                Ok(()) => {}
                Err(e @ EpError::Cuda { .. }) => {
                    v.fatal = true;
                    if v.ok {
                        v.ok = false;
                        v.msg = e.to_string();
                    }
                }
                Err(e) => {
                    if v.ok {
                        v.ok = false;
                        v.msg = e.to_string();
                    }
                }
            }
            // end_unit also releases ranks still blocked in one of the case's collectives.
            let all: Vec<Verdict> = comm.end_unit(&v.encode())?.iter().map(|b| Verdict::decode(b)).collect();
            let ms = start.elapsed().as_secs_f64() * 1e3;
            if all.iter().all(|v| v.ok) {
                t.passed += 1;
                say(format!("ok   {label} ({ms:.1} ms)"));
            } else if all.iter().all(|v| v.skipped) {
                t.skipped += 1;
                say(format!("skip {label} ({})", all[0].msg));
            } else {
                t.failed += 1;
                let why: Vec<String> = all.iter().enumerate().filter(|(_, v)| !v.ok).map(|(r, v)| format!("rank {r}: {}", v.msg)).collect();
                say(format!("FAIL {label} ({ms:.1} ms, seed {}): {}", opts.seed, why.join(" | ")));
            }
            dead |= all.iter().any(|v| v.fatal);
            progress.lock().unwrap().case = None;
        }
    }
    Ok(t)
}

// ---- selftest cases: the runtime itself -----------------------------------------------------

/// The word `ep_selftest_pattern` writes at index `i` for `(seed, sender)` (mirror of
/// `ep_pattern` in `cuda/selftest.cu`).
pub fn selftest_pattern(seed: u32, sender: u32, i: u64) -> u32 {
    let mut x = ((seed as u64) << 32) ^ (sender as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    x as u32
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> CaseResult {
    if cond {
        Ok(())
    } else {
        Err(anyhow::anyhow!(msg()))
    }
}

fn first_mismatch(got: &[u32], want: impl Fn(usize) -> u32) -> Option<(usize, u32, u32)> {
    got.iter().enumerate().find(|(i, &g)| g != want(*i)).map(|(i, &g)| (i, g, want(i)))
}

fn selftest_cases() -> Vec<Case> {
    vec![
        Case::new("selftest/launch_checks_arguments", |c| {
            let k = c.gpu.kernel("selftest", "ep_fill_u32")?;
            ensure(k.param_sizes() == Some(&[8, 8, 4, 24][..]), || format!("ep_fill_u32 parameter sizes {:?}", k.param_sizes()))?;
            let e = c.gpu.launch(&k, &LaunchCfg::new(1, 32), deepep_kernels::args![0u64, 0u64]).unwrap_err().to_string();
            ensure(e.contains("ep_fill_u32") && e.contains("parameter sizes"), || format!("unexpected error: {e}"))?;
            let e = c.gpu.launch(&k, &LaunchCfg::new(1, 2048), deepep_kernels::args![0u64, 0u64, 0u32]).unwrap_err().to_string();
            ensure(e.contains("2048 threads"), || format!("unexpected error: {e}"))?;
            let e = c.gpu.kernel("selftest", "no_such_kernel").unwrap_err().to_string();
            ensure(e.contains("ep_copy_16"), || format!("unexpected error: {e}"))
        }),
        Case::new("selftest/fill_and_copy", |c| {
            let n = 1_000_003usize; // words; not a multiple of the block size
            let src: Vec<u32> = (0..n as u64).map(|i| selftest_pattern(c.seed as u32, 99, i)).collect();
            let a = DeviceBuffer::from_slice(c.gpu, &src)?;
            let b = c.poisoned(n * 4)?;
            let n16 = (n * 4 / 16) as u64;
            let copy = c.gpu.kernel("selftest", "ep_copy_16")?;
            c.gpu.launch(&copy, &LaunchCfg::new(264, 256), deepep_kernels::args![a.ptr(), b.ptr(), n16])?;
            c.gpu.sync("ep_copy_16")?;
            let got = b.download::<u32>(c.gpu, n)?;
            let whole = n16 as usize * 4;
            if let Some((i, g, w)) = first_mismatch(&got, |i| if i < whole { src[i] } else { crate::gpu_test::POISON_U32 }) {
                anyhow::bail!("copy: word {i} is {g:#x}, expected {w:#x}");
            }
            // Plain, cooperative and cluster launches exercise cuLaunchKernelEx's attribute paths.
            let fill = c.gpu.kernel("selftest", "ep_fill_u32")?;
            let sms = c.gpu.sm_count();
            let cfgs = [
                ("plain", LaunchCfg::new(sms, 256)),
                ("cooperative", LaunchCfg::new(2 * sms, 128).cooperative(true)),
                ("cluster 2x1x1", LaunchCfg::new(2 * sms, 128).cluster(2, 1, 1)),
            ];
            for (k, (what, cfg)) in cfgs.iter().enumerate() {
                let v = 0x1234_5670u32 + k as u32;
                c.gpu.launch(&fill, cfg, deepep_kernels::args![b.ptr(), n as u64, v])?;
                c.gpu.sync(what)?;
                let got = b.download::<u32>(c.gpu, n)?;
                if let Some((i, g, _)) = first_mismatch(&got, |_| v) {
                    anyhow::bail!("{what} fill: word {i} is {g:#x}, expected {v:#x}");
                }
            }
            // A cooperative grid larger than what fits at once is refused before launch.
            let e = c.gpu.launch(&fill, &LaunchCfg::new(10_000 * sms, 1024).cooperative(true), deepep_kernels::args![b.ptr(), 0u64, 0u32]);
            ensure(e.as_ref().is_err_and(|e| e.to_string().contains("cooperative launch")), || format!("oversized cooperative launch: {e:?}"))
        }),
        Case::new("selftest/ipc_all_to_all_stores", |c| {
            // Every rank writes its pattern into slot `rank` of every rank's IPC buffer over NVLink.
            let n = 262_147usize;
            let w = c.world();
            let ipc = IpcBuffer::new(c.gpu, c.comm, w * n * 4)?;
            ipc.local().fill_u32(c.gpu, POISON_U32)?;
            c.gpu.sync("poison")?;
            c.comm.barrier()?;
            let k = c.gpu.kernel("selftest", "ep_selftest_pattern")?;
            for p in 0..w {
                let dst = ipc.ptr(p) + (c.rank() * n * 4) as u64;
                c.gpu.launch(&k, &LaunchCfg::new(132, 256), deepep_kernels::args![dst, n as u64, c.seed as u32, c.rank() as i32])?;
            }
            c.gpu.sync("pattern stores to peers")?;
            c.comm.barrier()?;
            let got = ipc.local().download::<u32>(c.gpu, w * n)?;
            for s in 0..w {
                if let Some((i, g, want)) = first_mismatch(&got[s * n..(s + 1) * n], |i| selftest_pattern(c.seed as u32, s as u32, i as u64)) {
                    anyhow::bail!("slot of sender rank {s}: word {i} is {g:#x}, expected {want:#x}");
                }
            }
            c.comm.barrier()?; // peers are done reading our buffer before it is freed
            Ok(())
        }),
        Case::new("selftest/put_signal_wait_ring", |c| {
            // Ring: payload + release flag to the next rank; acquire-wait on our flag, copy out.
            let (w, me) = (c.world(), c.rank());
            let n16 = 65_536usize; // 1 MiB
            let flag_bytes = 256usize;
            let ipc = IpcBuffer::new(c.gpu, c.comm, flag_bytes + n16 * 16)?;
            let payload: Vec<u32> = (0..(n16 * 4) as u64).map(|i| selftest_pattern(c.seed as u32, me as u32, i)).collect();
            let src = DeviceBuffer::from_slice(c.gpu, &payload)?;
            let out = c.poisoned(n16 * 16)?;
            let value = ((c.seed as u32) & 0x3FFF_FFFF) | 1;
            c.comm.barrier()?;
            let next = (me + 1) % w;
            let prev = (me + w - 1) % w;
            let put = c.gpu.kernel("selftest", "ep_selftest_put_signal")?;
            let wait = c.gpu.kernel("selftest", "ep_selftest_wait_copy")?;
            let peer = ipc.ptr(next);
            c.gpu.launch(&put, &LaunchCfg::new(1, 1024), deepep_kernels::args![src.ptr(), peer + flag_bytes as u64, n16 as u64, peer, value as i32])?;
            let mine = ipc.ptr(me);
            c.gpu.launch(
                &wait,
                &LaunchCfg::new(1, 1024),
                deepep_kernels::args![mine, value as i32, mine + flag_bytes as u64, out.ptr(), n16 as u64, Phase::Barrier as i32, prev as i32],
            )?;
            c.gpu.sync("put/signal/wait ring")?;
            let got = out.download::<u32>(c.gpu, n16 * 4)?;
            if let Some((i, g, want)) = first_mismatch(&got, |i| selftest_pattern(c.seed as u32, prev as u32, i as u64)) {
                anyhow::bail!("payload from rank {prev}: word {i} is {g:#x}, expected {want:#x}");
            }
            c.comm.barrier()?;
            Ok(())
        }),
        Case::new("selftest/gpu_wait_timeout_names_rank_phase", |c| {
            // A wait on a flag nobody sets must end in EpError::GpuTimeout naming rank and phase,
            // not hang; afterwards the GPU is usable again.
            let flag = DeviceBuffer::zeroed(c.gpu, 16)?;
            let out = c.poisoned(16)?;
            let k = c.gpu.kernel("selftest", "ep_selftest_wait_copy")?;
            let old = c.gpu.device_timeout();
            c.gpu.set_device_timeout(Duration::from_millis(50));
            let peer = ((c.rank() + 1) % c.world()) as i32;
            let launched = c.gpu.launch(
                &k,
                &LaunchCfg::new(3, 64),
                deepep_kernels::args![flag.ptr(), 1i32, flag.ptr(), out.ptr(), 1u64, Phase::DispatchRecv as i32, peer],
            );
            let t0 = Instant::now();
            let r = launched.map_err(anyhow::Error::from).and_then(|_| c.gpu.sync("wait that must time out").map_err(Into::into));
            c.gpu.set_device_timeout(old);
            let secs = t0.elapsed().as_secs_f64();
            match r {
                Err(e) => match e.downcast_ref::<EpError>() {
                    Some(EpError::GpuTimeout { rank, phase, channel, peer: p, waited_ms, .. }) => {
                        ensure(*rank == c.rank() as i32, || format!("record names rank {rank}, expected {}", c.rank()))?;
                        ensure(phase == "dispatch/recv", || format!("record names phase {phase}"))?;
                        ensure((0..3).contains(channel) && *p == peer, || format!("channel {channel} peer {p}"))?;
                        ensure(*waited_ms >= 50.0 && secs < 10.0, || format!("waited {waited_ms} ms, host {secs} s"))?;
                        let msg = e.to_string();
                        ensure(msg.contains(&format!("rank {}", c.rank())) && msg.contains("dispatch/recv"), || msg.clone())?;
                    }
                    _ => anyhow::bail!("expected a GPU timeout error, got: {e:#}"),
                },
                Ok(()) => anyhow::bail!("a wait on a flag nobody sets returned without error"),
            }
            ensure(c.gpu.error_record().code == 0, || "error record not cleared".into())?;
            // The copy must not have happened, and the GPU must work again.
            let got = out.download::<u32>(c.gpu, 4)?;
            ensure(got.iter().all(|&x| x == POISON_U32), || format!("timed-out kernel still copied: {got:x?}"))?;
            flag.upload(c.gpu, &[1i32])?;
            c.gpu.launch(&k, &LaunchCfg::new(1, 64), deepep_kernels::args![flag.ptr(), 1i32, flag.ptr(), out.ptr(), 1u64, Phase::DispatchRecv as i32, peer])?;
            c.gpu.sync("wait on a set flag")?;
            Ok(())
        }),
        Case::new("selftest/event_timing_matches_spin", |c| {
            let k = c.gpu.kernel("selftest", "ep_selftest_spin")?;
            let ns = 200_000u64;
            let s = time_op(c.gpu, c.comm, TimingOpts { warmup: 2, reps: 11, flush_l2: true }, None, || {
                c.gpu.launch(&k, &LaunchCfg::new(1, 32), deepep_kernels::args![ns])
            })?;
            ensure(s.reps == 11 && s.median_us >= 195.0 && s.median_us < 400.0, || format!("200 us spin measured {s:?}"))
        }),
        Case::new("selftest/nccl_all_to_all", |c| {
            if c.gpu.oversubscribed() {
                return Err(Skip(format!("{} ranks share each GPU; NCCL needs one GPU per rank", c.gpu.ranks_per_gpu())).into());
            }
            // Per-peer byte counts differ per (sender, receiver); contents are checked exactly.
            let (w, me) = (c.world(), c.rank());
            let count = |s: usize, r: usize| 4096 + 16 * ((s * 7 + r * 13 + (c.seed as usize % 5)) % 97);
            let send_counts: Vec<usize> = (0..w).map(|r| count(me, r)).collect();
            let recv_counts: Vec<usize> = (0..w).map(|s| count(s, me)).collect();
            let mut send = Vec::new();
            for (r, &bytes) in send_counts.iter().enumerate() {
                send.extend((0..bytes / 4).map(|i| selftest_pattern(c.seed as u32, (me * 64 + r) as u32, i as u64)));
            }
            let sbuf = DeviceBuffer::from_slice(c.gpu, &send)?;
            let total: usize = recv_counts.iter().sum();
            let rbuf = c.poisoned(total)?;
            let nccl = deepep_kernels::runtime::nccl::Nccl::new(c.gpu, c.comm)?;
            nccl.all_to_all_bytes(c.gpu, sbuf.ptr(), &send_counts, rbuf.ptr(), &recv_counts)?;
            c.gpu.sync("NCCL all-to-all")?;
            let got = rbuf.download::<u32>(c.gpu, total / 4)?;
            let mut off = 0;
            for (s, &bytes) in recv_counts.iter().enumerate() {
                let n = bytes / 4;
                if let Some((i, g, want)) = first_mismatch(&got[off..off + n], |i| selftest_pattern(c.seed as u32, (s * 64 + me) as u32, i as u64)) {
                    anyhow::bail!("bytes from rank {s}: word {i} is {g:#x}, expected {want:#x}");
                }
                off += n;
            }
            Ok(())
        }),
    ]
}

fn cupti_case() -> Case {
    Case::new("selftest/cupti_kernel_timestamps", |c| {
        // The bench's 'kernel us' path: CUPTI records of two spin kernels per repetition,
        // split at the L2-flush memsets, give spans of about 100 + 50 us.
        let timer = match deepep_kernels::runtime::cupti::kernel_timer() {
            Ok(t) => t,
            Err(e) => return Err(Skip(format!("CUPTI unavailable: {e}")).into()),
        };
        let flush = deepep_kernels::runtime::timing::L2Flush::new(c.gpu)?;
        let k = c.gpu.kernel("selftest", "ep_selftest_spin")?;
        let reps = 5;
        let acts = timer.record(|| {
            for _ in 0..reps {
                flush.flush(c.gpu)?;
                c.gpu.launch(&k, &LaunchCfg::new(1, 32), deepep_kernels::args![100_000u64])?;
                c.gpu.launch(&k, &LaunchCfg::new(1, 32), deepep_kernels::args![50_000u64])?;
            }
            c.gpu.sync("spin kernels under CUPTI")
        })?;
        let kernels = acts.iter().filter(|a| a.kind == deepep_kernels::runtime::cupti::ActivityKind::Kernel).count();
        ensure(kernels == 2 * reps, || format!("{kernels} kernel records for {} launches", 2 * reps))?;
        let spans = deepep_kernels::runtime::cupti::spans_per_rep(&acts, flush.bytes() as u64, reps)
            .ok_or_else(|| anyhow::anyhow!("records not split into {reps} repetitions: {acts:?}"))?;
        ensure(spans.iter().all(|&s| (149.0..400.0).contains(&s)), || format!("spans {spans:?} us, expected ~150"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn case_seeds_differ_by_name_and_iteration() {
        let a = case_seed(1, "x", 0);
        assert_ne!(a, case_seed(1, "y", 0));
        assert_ne!(a, case_seed(1, "x", 1));
        assert_ne!(a, case_seed(2, "x", 0));
        assert_eq!(a, case_seed(1, "x", 0));
    }
    #[test]
    fn summary_line_format() {
        assert_eq!(Totals { passed: 3, failed: 1, skipped: 2 }.summary(), "3 passed, 1 failed");
    }
    #[test]
    fn verdicts_round_trip() {
        let v = Verdict::decode(&Verdict { ok: false, fatal: true, skipped: true, msg: "boom".into() }.encode());
        assert!(!v.ok && v.fatal && v.skipped && v.msg == "boom");
    }
    #[test]
    fn case_names_are_unique() {
        let names: Vec<String> = all_cases().into_iter().map(|c| c.name).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "{names:?}");
    }
}
