//! Errors of the kernels crate, and the GPU-side diagnostic record that turns a stuck wait
//! into a host error naming rank, phase and channel.

/// Mirror of `EpErrorRecord` in `cuda/common.cuh` (32 bytes, host-mapped, zero = no error).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorRecord {
    pub code: i32,
    pub rank: i32,
    pub phase: i32,
    pub channel: i32,
    pub peer: i32,
    pub detail: i32,
    pub waited_ns: u64,
}

/// Mirror of `EpDiag` in `cuda/common.cuh`: passed by value as the last argument of every kernel.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Diag {
    /// Device pointer of the host-mapped [`ErrorRecord`].
    pub err: u64,
    /// Bound for any single GPU-side wait, in nanoseconds.
    pub timeout_ns: u64,
    pub rank: i32,
    /// `DIAG_*` bits (`EP_DIAG_*`).
    pub flags: i32,
}

/// [`Diag::flags`] bit: a kernel that records an error then aborts with `trap`, a sticky CUDA
/// error of the context (`EP_DIAG_TRAP`). See [`crate::runtime::Gpu::set_trap_on_device_error`].
pub const DIAG_TRAP: i32 = 1;

pub const ERR_NONE: i32 = 0;
pub const ERR_TIMEOUT: i32 = 1;
pub const ERR_BAD_ARGUMENT: i32 = 2;
pub const ERR_ABORTED: i32 = 3;

/// Kernel phases; numbering matches `EP_PHASE_*` in `cuda/common.cuh`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Phase {
    Layout = 1,
    Notify = 2,
    DispatchSend = 3,
    DispatchRecv = 4,
    CachedNotify = 5,
    CombinePrep = 6,
    CombineSend = 7,
    CombineRecv = 8,
    Barrier = 9,
    LlDispatchSend = 10,
    LlDispatchRecv = 11,
    LlCombineSend = 12,
    LlCombineRecv = 13,
    InternodeNotify = 14,
    InternodeDispatch = 15,
    InternodeForward = 16,
    InternodeCombine = 17,
}

impl Phase {
    pub fn from_i32(v: i32) -> Option<Phase> {
        use Phase::*;
        Some(match v {
            1 => Layout,
            2 => Notify,
            3 => DispatchSend,
            4 => DispatchRecv,
            5 => CachedNotify,
            6 => CombinePrep,
            7 => CombineSend,
            8 => CombineRecv,
            9 => Barrier,
            10 => LlDispatchSend,
            11 => LlDispatchRecv,
            12 => LlCombineSend,
            13 => LlCombineRecv,
            14 => InternodeNotify,
            15 => InternodeDispatch,
            16 => InternodeForward,
            17 => InternodeCombine,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        use Phase::*;
        match self {
            Layout => "layout",
            Notify => "notify",
            DispatchSend => "dispatch/send",
            DispatchRecv => "dispatch/recv",
            CachedNotify => "cached-notify",
            CombinePrep => "combine/prep",
            CombineSend => "combine/send",
            CombineRecv => "combine/recv",
            Barrier => "barrier",
            LlDispatchSend => "low-latency dispatch/send",
            LlDispatchRecv => "low-latency dispatch/recv",
            LlCombineSend => "low-latency combine/send",
            LlCombineRecv => "low-latency combine/recv",
            InternodeNotify => "internode notify",
            InternodeDispatch => "internode dispatch",
            InternodeForward => "internode forward",
            InternodeCombine => "internode combine",
        }
    }
}

/// Every error the crate reports. Messages name the problem and the fix.
#[derive(Debug, thiserror::Error)]
pub enum EpError {
    /// Bad arguments, found before any launch.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A GPU-side wait exceeded its bound.
    #[error("rank {rank}: GPU wait timed out in phase '{phase}' (channel {channel}, waiting for rank {peer}) after {waited_ms:.1} ms; a peer rank probably died, was launched with different arguments, or is not running this collective; rerun with RUST_LOG=debug on every rank")]
    GpuTimeout { rank: i32, phase: String, channel: i32, peer: i32, waited_ms: f64 },
    /// The host gave up waiting for the stream.
    #[error("rank {rank}: host timed out after {secs:.1} s waiting for '{what}' to finish on the GPU; no device-side error was recorded")]
    HostTimeout { rank: usize, what: String, secs: f64 },
    #[error("CUDA error in {context}: {message}")]
    Cuda { context: String, message: String },
    #[error("NCCL error in {context}: {message}")]
    Nccl { context: String, message: String },
    #[error("NVSHMEM: {0}")]
    Nvshmem(String),
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A rank started by the launcher failed (the message names which and how).
    #[error("launcher: {0}")]
    Launch(String),
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = EpError> = std::result::Result<T, E>;

impl ErrorRecord {
    /// Whether this record is a bounded wait that expired (here or in another block of the same
    /// rank): the peer it waited for is lost to this rank's buffers, which cannot be used again.
    pub fn is_timeout(&self) -> bool {
        self.code == ERR_TIMEOUT || self.code == ERR_ABORTED
    }

    /// Turn a recorded device error into an [`EpError`]; `None` when the record is clear.
    pub fn to_error(&self) -> Option<EpError> {
        if self.code == ERR_NONE {
            return None;
        }
        let phase = Phase::from_i32(self.phase)
            .map(|p| p.name().to_string())
            .unwrap_or_else(|| format!("unknown phase {}", self.phase));
        Some(match self.code {
            ERR_TIMEOUT | ERR_ABORTED => EpError::GpuTimeout {
                rank: self.rank,
                phase,
                channel: self.channel,
                peer: self.peer,
                waited_ms: self.waited_ns as f64 / 1e6,
            },
            _ => EpError::InvalidArgument(format!(
                "rank {}: device-side check failed in phase '{}' (channel {}, detail {})",
                self.rank, phase, self.channel, self.detail
            )),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn ffi_sizes_match_cuda_header() {
        assert_eq!(std::mem::size_of::<ErrorRecord>(), 32);
        assert_eq!(std::mem::size_of::<Diag>(), 24);
    }
    #[test]
    fn timeout_record_names_rank_phase_channel() {
        let r = ErrorRecord { code: ERR_TIMEOUT, rank: 1, phase: 4, channel: 7, peer: 0, detail: 0, waited_ns: 2_000_000_000 };
        let msg = r.to_error().unwrap().to_string();
        assert!(msg.contains("rank 1") && msg.contains("dispatch/recv") && msg.contains("channel 7"), "{msg}");
        assert!(ErrorRecord::default().to_error().is_none());
    }
}
