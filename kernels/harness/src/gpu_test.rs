//! The collective GPU test runner (`deepep-gpu-tests`).
//!
//! Every rank runs the same cases ([`crate::cases`]) in the same order, each with a seed derived
//! from the run's seed, the case's name and the repetition. After each case the ranks exchange
//! their verdicts; rank 0 prints one line per case and finally exactly `N passed, M failed`.

use crate::cases::{Case, Ctx, Skip};
use deepep_kernels::error::EpError;
use deepep_kernels::hash::fnv1a;
use deepep_kernels::runtime::{Comm, Gpu};
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

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
    seed ^ fnv1a(name.as_bytes()).rotate_left(17) ^ (iteration as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
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
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| c.run(&ctx)));
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
}
