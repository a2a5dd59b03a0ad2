//! Pieces shared by the communication buffers (intranode `Buffer`, `InternodeBuffer`, ...): the
//! "unusable after an error" guard, and the caller-event handoff on the rank's stream.

use crate::error::EpError;
use crate::runtime::Gpu;
use crate::Result;
use cudarc::driver::CudaEvent;

/// Once a collective call failed on the GPU (peers may be mid-call), a buffer refuses further
/// calls with the reason; argument errors found before any launch do not poison it.
#[derive(Debug, Default)]
pub struct Poison {
    why: Option<String>,
}

impl Poison {
    pub fn new() -> Poison {
        Poison::default()
    }

    /// Refuse to run after an earlier error, and turn a device error recorded since the last call
    /// (e.g. a timed-out wait of a kernel nobody synchronised yet) into an error now; a dropped
    /// bad expert id ([`EpError::BadExpertId`]) is returned once and does not poison. `what`
    /// names the buffer in the message (e.g. "this InternodeBuffer").
    pub fn check(&mut self, gpu: &Gpu, what: &str) -> Result<()> {
        if let Some(why) = &self.why {
            return Err(EpError::InvalidArgument(format!(
                "{what} is unusable after an earlier error ({why}); peers may be mid-call: recreate it on every rank"
            )));
        }
        match gpu.take_error() {
            // a dropped bad expert id: reported once, the buffer stays usable
            Some(e) if e.is_device_argument() => Err(e),
            Some(e) => self.record(e),
            None => Ok(()),
        }
    }

    /// Record `e` as the reason (the first one wins; argument errors only when nothing else was
    /// recorded) and return it.
    pub fn record<T>(&mut self, e: EpError) -> Result<T> {
        if !matches!(e, EpError::InvalidArgument(_)) || self.why.is_none() {
            self.why = Some(e.to_string());
        }
        Err(e)
    }
}

/// Make the GPU's stream wait for the caller's event (if any) before the next launch.
pub fn wait_event(gpu: &Gpu, ev: Option<&CudaEvent>) -> Result<()> {
    if let Some(ev) = ev {
        gpu.stream().wait(ev).map_err(|e| EpError::Cuda {
            context: "stream wait on the caller's event".into(),
            message: format!("{:?}", e.0),
        })?;
    }
    Ok(())
}

/// An event recorded on the GPU's stream after the work queued so far.
pub fn record_event(gpu: &Gpu) -> Result<CudaEvent> {
    gpu.stream().record_event(None).map_err(|e| EpError::Cuda {
        context: "recording the completion event".into(),
        message: format!("{:?}", e.0),
    })
}

/// `v` rounded up to a multiple of `a` (> 0): the one rounding rule of every buffer layout.
pub const fn align_up(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}
