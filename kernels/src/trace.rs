//! One phase-trace type for every kernel family (a diagnostic hook: the bench prints it, the
//! kernels' results never depend on it).
//!
//! A traced kernel writes `%globaltimer` nanoseconds into a small device array (`u64` slots):
//! slot 0 is the time the first block entered (preset to the maximum, lowered with `atomicMin`),
//! the other slots are phase ends (preset to 0 and raised with `atomicMax`, or for a "first ..."
//! phase preset to the maximum and lowered). Each family decodes its slots into a
//! [`PhaseTrace`]: the phases it records, in kernel order, each in microseconds after slot 0 or
//! `None` when the phase was not reached (e.g. nothing to publish). The phases a family records
//! and what they mean:
//!
//! | family | `last_trace()` of | phases (slot) |
//! |---|---|---|
//! | intranode (`EP_TRACE_*`, `cuda/intranode.cuh`) | [`crate::intranode::Buffer`] | [`Ready`](TracePhase::Ready) (1), [`Sent`](TracePhase::Sent) (2), [`Published`](TracePhase::Published) (3), [`Received`](TracePhase::Received) (4) |
//! | low-latency (`LL_TRACE_*`, `cuda/nvshmem/low_latency.cuh`) | [`crate::low_latency::LowLatencyBuffer`] | [`Sent`](TracePhase::Sent) (1), [`Local`](TracePhase::Local) (2), [`WaitedFirst`](TracePhase::WaitedFirst) (3), [`Waited`](TracePhase::Waited) (4), [`End`](TracePhase::End) (5) |
//! | internode (`cuda/nvshmem/internode.cu`) | — | its kernels record no phase times (no trace slots in the device code) |

/// One phase of a traced kernel. The meaning per family is on each variant; a family that does
/// not record a phase never reports it ([`PhaseTrace::get`] gives `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TracePhase {
    /// Intranode: the last block finished the ready handshake.
    Ready,
    /// Intranode dispatch: the last warp issued its last data store; intranode combine: the last
    /// pusher finished. Low-latency combine: the last block finished sending its rows (v1) or
    /// partial rows (v3) to the origins; low-latency dispatch (v2): the last block staged its
    /// tokens everywhere and flagged them.
    Sent,
    /// Intranode dispatch: the last block published its unit counts to the peers.
    Published,
    /// Intranode dispatch: every peer's data arrived; intranode combine: the last reducer finished.
    Received,
    /// Low-latency combine: the last warp finished the own-expert terms of its first units
    /// (before its first wait); low-latency dispatch: the last block binned the received
    /// selections and wrote its layout.
    Local,
    /// Low-latency: the first warp (combine) or block (dispatch) that saw every peer block's flag.
    WaitedFirst,
    /// Low-latency: the last warp (combine) or block (dispatch) that saw every peer block's flag.
    Waited,
    /// Low-latency: the last warp finished.
    End,
}

impl TracePhase {
    /// Lower-case name, as printed by [`PhaseTrace`]'s `Display`.
    pub fn name(self) -> &'static str {
        match self {
            TracePhase::Ready => "ready",
            TracePhase::Sent => "sent",
            TracePhase::Published => "published",
            TracePhase::Received => "received",
            TracePhase::Local => "local",
            TracePhase::WaitedFirst => "waited_first",
            TracePhase::Waited => "waited",
            TracePhase::End => "end",
        }
    }
}

/// Phase times of the last traced kernel of one rank, in microseconds after its first block
/// started (`%globaltimer`, about 1 us resolution). Returned by every family's `last_trace()`.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTrace {
    phases: Vec<(TracePhase, Option<f64>)>,
}

impl PhaseTrace {
    /// Decode raw trace slots: `slots[0]` is the start (`u64::MAX`: the kernel never started),
    /// `map` names the slot of each recorded phase in kernel order. A phase slot still at its
    /// preset (0 or `u64::MAX`) or before the start reads as `None`. A slot index outside
    /// `slots` also reads as `None`.
    pub fn decode(slots: &[u64], map: &[(TracePhase, usize)]) -> PhaseTrace {
        let start = slots.first().copied().unwrap_or(u64::MAX);
        let at = |i: usize| {
            let v = *slots.get(i)?;
            (start != u64::MAX && v != 0 && v != u64::MAX && v >= start).then(|| (v - start) as f64 / 1e3)
        };
        PhaseTrace { phases: map.iter().map(|&(p, i)| (p, at(i))).collect() }
    }

    /// The time of `phase`, `None` when it was not reached or this family does not record it.
    pub fn get(&self, phase: TracePhase) -> Option<f64> {
        self.phases.iter().find(|(p, _)| *p == phase).and_then(|(_, t)| *t)
    }

    /// Every phase this family records, in kernel order, with its time (`None`: not reached).
    pub fn phases(&self) -> &[(TracePhase, Option<f64>)] {
        &self.phases
    }
}

impl std::fmt::Display for PhaseTrace {
    /// `ready 1.0 us, sent 5.3 us, published - us, ...` (`-`: not reached).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (p, t)) in self.phases.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match t {
                Some(t) => write!(f, "{} {t:.1} us", p.name())?,
                None => write!(f, "{} - us", p.name())?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TracePhase::*;

    #[test]
    fn decodes_relative_microseconds_and_unreached_phases() {
        // start 1_000_000 ns; slot 1 2.5 us later; slot 2 never reached (0); slot 3 still at its
        // "first" preset (MAX); slot 4 before the start (stale): unreached.
        let slots = [1_000_000, 1_002_500, 0, u64::MAX, 999_000, 1_010_000, 0, 0];
        let t = PhaseTrace::decode(&slots, &[(Sent, 1), (Local, 2), (WaitedFirst, 3), (Waited, 4), (End, 5)]);
        assert_eq!(t.get(Sent), Some(2.5));
        assert_eq!(t.get(Local), None);
        assert_eq!(t.get(WaitedFirst), None);
        assert_eq!(t.get(Waited), None);
        assert_eq!(t.get(End), Some(10.0));
        // A phase this family does not record.
        assert_eq!(t.get(Ready), None);
        assert_eq!(t.phases().len(), 5);
        assert_eq!(t.to_string(), "sent 2.5 us, local - us, waited_first - us, waited - us, end 10.0 us");
    }

    #[test]
    fn kernel_that_never_started_has_no_phase() {
        let slots = [u64::MAX, 5, 6, 7, 8];
        let t = PhaseTrace::decode(&slots, &[(Ready, 1), (Sent, 2), (Published, 3), (Received, 4), (End, 9)]);
        assert!(t.phases().iter().all(|(_, v)| v.is_none()), "{t:?}");
    }
}
