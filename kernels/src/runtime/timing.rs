//! Timing with CUDA events around each repetition, warm-up first, the L2 cache flushed between
//! repetitions (outside the timed region), median over repetitions: our statistic. DeepEP's own
//! (`deepep-bench --deepep-stat`: 50 warm-up calls, one flush, 50 back-to-back calls, mean of all
//! but the first) is computed in `bench/`; `kernels/BENCHMARKS.md` says which figure is which.

use super::memory::DeviceBuffer;
use super::{check, Comm, Gpu};
use crate::error::Result;
use cudarc::driver::sys;

/// A CUDA event with timing enabled.
pub struct Event {
    raw: sys::CUevent,
}

impl Event {
    pub fn new(gpu: &Gpu) -> Result<Event> {
        gpu.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: context bound.
        check(unsafe { sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) }, || "cuEventCreate".into())?;
        Ok(Event { raw })
    }
    /// Record on `gpu`'s stream.
    pub fn record(&self, gpu: &Gpu) -> Result<()> {
        // SAFETY: event and stream of the same context.
        check(unsafe { sys::cuEventRecord(self.raw, gpu.cu_stream()) }, || "cuEventRecord".into())
    }
    /// Milliseconds from `self` to `end` (both complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: both events recorded and complete (caller synchronised).
        check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.raw, end.raw) }, || "cuEventElapsedTime".into())?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: our event.
        unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

/// Scratch buffer of at least twice the L2 size; writing it evicts the L2.
pub struct L2Flush {
    buf: DeviceBuffer,
}

impl L2Flush {
    pub fn new(gpu: &Gpu) -> Result<L2Flush> {
        let bytes = (2 * gpu.l2_bytes()).max(64 << 20).next_multiple_of(4);
        Ok(L2Flush { buf: DeviceBuffer::new(gpu, bytes)? })
    }
    /// Size of the scratch buffer (each flush is one memset of this many bytes).
    pub fn bytes(&self) -> usize {
        self.buf.bytes()
    }
    /// Enqueue the flush on `gpu`'s stream.
    pub fn flush(&self, gpu: &Gpu) -> Result<()> {
        self.buf.fill_u32(gpu, 0)
    }
}

/// Summary of the per-repetition times of one rank, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Stats {
    pub median_us: f64,
    pub mean_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub reps: usize,
}

impl Stats {
    /// From raw samples (microseconds). Empty input gives all zeros.
    pub fn from_samples(mut v: Vec<f64>) -> Stats {
        if v.is_empty() {
            return Stats { median_us: 0.0, mean_us: 0.0, min_us: 0.0, max_us: 0.0, reps: 0 };
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) };
        Stats { median_us: median, mean_us: v.iter().sum::<f64>() / n as f64, min_us: v[0], max_us: v[n - 1], reps: n }
    }

    /// Every rank's stats, index = rank (collective).
    pub fn gather(self, comm: &Comm) -> Result<Vec<Stats>> {
        let mut b = Vec::with_capacity(40);
        for x in [self.median_us, self.mean_us, self.min_us, self.max_us, self.reps as f64] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        Ok(comm
            .all_gather(&b)?
            .iter()
            .map(|m| {
                let f = |i: usize| f64::from_le_bytes(m[i * 8..i * 8 + 8].try_into().unwrap());
                Stats { median_us: f(0), mean_us: f(1), min_us: f(2), max_us: f(3), reps: f(4) as usize }
            })
            .collect())
    }
}

/// Repetition settings.
#[derive(Debug, Clone, Copy)]
pub struct TimingOpts {
    pub warmup: usize,
    pub reps: usize,
    pub flush_l2: bool,
}

impl Default for TimingOpts {
    fn default() -> Self {
        TimingOpts { warmup: 5, reps: 30, flush_l2: true }
    }
}

/// Time `op` (which enqueues GPU work on `gpu`'s stream): a barrier on `comm`, `warmup` untimed
/// runs, then `reps` runs back to back, each preceded by an L2 flush (when enabled) and bracketed
/// by events. Collective ops keep the ranks in step on the GPU, as in DeepEP's benchmarks.
pub fn time_op(gpu: &Gpu, comm: &Comm, opts: TimingOpts, flush: Option<&L2Flush>, mut op: impl FnMut() -> Result<()>) -> Result<Stats> {
    gpu.sync("before timing")?;
    comm.barrier()?;
    for _ in 0..opts.warmup {
        op()?;
    }
    gpu.sync("warm-up")?;
    let events: Vec<(Event, Event)> = (0..opts.reps).map(|_| Ok((Event::new(gpu)?, Event::new(gpu)?))).collect::<Result<_>>()?;
    for (a, b) in &events {
        if let (true, Some(f)) = (opts.flush_l2, flush) {
            f.flush(gpu)?;
        }
        a.record(gpu)?;
        op()?;
        b.record(gpu)?;
    }
    gpu.sync("timed repetitions")?;
    let samples = events.iter().map(|(a, b)| Ok(a.elapsed_ms(b)? as f64 * 1e3)).collect::<Result<Vec<f64>>>()?;
    Ok(Stats::from_samples(samples))
}

#[cfg(test)]
mod tests {
    use super::Stats;
    #[test]
    fn stats_median_mean_min_max() {
        let s = Stats::from_samples(vec![4.0, 1.0, 3.0, 2.0]);
        assert_eq!((s.median_us, s.mean_us, s.min_us, s.max_us, s.reps), (2.5, 2.5, 1.0, 4.0, 4));
        assert_eq!(Stats::from_samples(vec![5.0, 1.0, 9.0]).median_us, 5.0);
        assert_eq!(Stats::from_samples(vec![]).reps, 0);
    }
}
