//! What a GPU test case is ([`Case`], the [`Ctx`] it gets, [`Skip`], [`POISON_U32`]) and every
//! registered case ([`all_cases`]): the runtime's own checks ([`selftest`]) and the kernel
//! families' cases ([`intranode`], [`low_latency`], [`internode`]), each against the CPU reference
//! of `deepep_kernels::reference`. The runner is [`crate::gpu_test`]; it uses this module, never
//! the other way round.
//!
//! A case is a function of a [`Ctx`] (the rank's [`Comm`] and [`Gpu`], and a seed); inputs are
//! generated from `(seed, rank)` with `reference::random`, so every rank can compute the CPU
//! reference of all ranks locally. Outputs are poisoned with [`POISON_U32`] before a run
//! ([`Ctx::poisoned`]).

pub mod internode;
pub mod intranode;
pub mod low_latency;
pub mod selftest;

use deepep_kernels::runtime::{Comm, DeviceBuffer, Gpu};

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
    /// Ends a case that holds the collective buffer `buf`: waits for this rank's GPU work (its
    /// error is left to `result`, which reports the failure), then for every rank, since peers may
    /// read this rank's buffer until their kernels end (also after a failure); frees `buf` and
    /// returns `result`.
    pub fn free_then<B>(&self, what: &str, buf: B, result: CaseResult) -> CaseResult {
        let _ = self.gpu.sync(what);
        self.comm.barrier()?;
        drop(buf);
        result
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
    /// Runs the case on this rank (the runner catches its panics and exchanges the verdicts).
    pub fn run(&self, ctx: &Ctx) -> CaseResult {
        (self.run)(ctx)
    }
}

/// Every registered case, in a fixed order.
pub fn all_cases() -> Vec<Case> {
    let mut v = selftest::cases();
    v.extend(intranode::cases());
    v.extend(low_latency::cases());
    v.extend(internode::cases());
    // Last: it loads CUPTI into the process, which nothing before it should see.
    v.push(selftest::cupti_case());
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn case_names_are_unique() {
        let names: Vec<String> = all_cases().into_iter().map(|c| c.name).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "{names:?}");
    }
}
