//! CUDA events in the rank's (primary) context and the stream joins a [`super::RankContext`]
//! makes around its launches: DeepEP's "comm stream waits for the caller's stream" and back.

use crate::runtime::{self as rt};
use crate::Result;
use cudarc::driver::sys;

/// A CUDA event in the current (primary) context, without timing. The Python `EventOverlap.event`
/// holds one; the rank context keeps a ring of them for its stream joins.
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
}

// SAFETY: CUDA event handles may be used from any thread of the process.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

/// A raw `CUstream` from the integer handle torch and the Python layer pass around (0: the legacy
/// default stream).
pub fn as_stream(s: u64) -> sys::CUstream {
    s as usize as sys::CUstream
}

impl Event {
    /// A new event in the current context (the caller's: torch's primary context).
    pub fn new() -> Result<Event> {
        rt::require_cuda()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the caller's (torch's primary) context is current.
        rt::check(unsafe { sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, || "cuEventCreate".into())?;
        Ok(Event { raw })
    }
    /// A new event recorded on `stream`.
    pub fn recorded_on(stream: u64) -> Result<Event> {
        let e = Event::new()?;
        e.record(stream)?;
        Ok(e)
    }
    /// Record the event on the raw stream handle `stream` (a live stream of this context: CUDA
    /// refuses others with an error).
    pub fn record(&self, stream: u64) -> Result<()> {
        // SAFETY: valid event; `stream` is a stream handle of this context (caller's contract).
        rt::check(unsafe { sys::cuEventRecord(self.raw, as_stream(stream)) }, || "cuEventRecord".into())
    }
    /// The raw stream handle `stream` waits for this event (no host wait).
    pub fn wait(&self, stream: u64) -> Result<()> {
        // SAFETY: as above.
        rt::check(unsafe { sys::cuStreamWaitEvent(as_stream(stream), self.raw, 0) }, || "cuStreamWaitEvent".into())
    }
    /// Block the host until the event completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: valid event.
        rt::check(unsafe { sys::cuEventSynchronize(self.raw) }, || "cuEventSynchronize".into())
    }
    /// Whether the work before the event has completed.
    pub fn query(&self) -> bool {
        // SAFETY: valid event.
        unsafe { sys::cuEventQuery(self.raw) == sys::CUresult::CUDA_SUCCESS }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate, destroyed once.
        unsafe {
            sys::cuEventDestroy_v2(self.raw);
        }
    }
}

/// Size of the join-event ring: events are reused (no create/destroy per call, nothing destroyed
/// while a CUDA graph is captured right after it was recorded).
pub const JOIN_EVENTS: usize = 8;

/// The ring of events the stream joins use.
#[derive(Debug)]
pub struct Joins {
    ring: Vec<Event>,
    next: usize,
}

impl Joins {
    pub fn new() -> Result<Joins> {
        Ok(Joins { ring: (0..JOIN_EVENTS).map(|_| Event::new()).collect::<Result<Vec<_>>>()?, next: 0 })
    }
    fn next(&mut self) -> &Event {
        self.next = (self.next + 1) % self.ring.len();
        &self.ring[self.next]
    }
    /// The raw stream `waiter` waits for the work queued so far on the raw stream `on`.
    pub fn join(&mut self, waiter: u64, on: u64) -> Result<()> {
        let e = self.next();
        e.record(on)?;
        e.wait(waiter)
    }
}
