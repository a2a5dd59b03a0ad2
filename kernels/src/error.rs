//! Errors of the kernels crate, and the GPU-side diagnostic record that turns a stuck wait
//! into a host error naming rank, phase and channel.

/// Mirror of `EpErrorRecord` in `cuda/common.cuh` (40 bytes, host-mapped, zero = no error).
/// See [`RecordKind`] for the two kinds of record and [`bad_key`] for `bad_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorRecord {
    /// `ERR_*`; [`ERR_WRITING`] while the device fills the other fields.
    pub code: i32,
    pub rank: i32,
    pub phase: i32,
    pub channel: i32,
    /// The rank waited for (timeouts); `num_experts` for [`ERR_BAD_EXPERT_ID`].
    pub peer: i32,
    /// Free-form (e.g. the expected count); `num_topk` for [`ERR_BAD_EXPERT_ID`].
    pub detail: i32,
    pub waited_ns: u64,
    /// [`ERR_BAD_EXPERT_ID`] only: the largest [`bad_key`] any thread found, i.e. the first bad
    /// position and its value.
    pub bad_key: u64,
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

/// [`Diag::flags`] bit: a kernel that records a fatal error then aborts with `trap`, a sticky CUDA
/// error of the context (`EP_DIAG_TRAP`; never for [`ERR_BAD_EXPERT_ID`]). See
/// [`crate::runtime::Gpu::set_trap_on_device_error`].
pub const DIAG_TRAP: i32 = 1;

pub const ERR_NONE: i32 = 0;
pub const ERR_TIMEOUT: i32 = 1;
pub const ERR_BAD_ARGUMENT: i32 = 2;
pub const ERR_ABORTED: i32 = 3;
/// Not fatal: a routing id `< -1` or `>= num_experts` was dropped (treated as -1) and the kernel
/// completed its protocol (`EP_ERR_BAD_EXPERT_ID`).
pub const ERR_BAD_EXPERT_ID: i32 = 4;
/// `code` while the device's winning writer fills in the other fields.
pub const ERR_WRITING: i32 = -1;

/// The two kinds of device record, and what the host does with each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// [`ERR_BAD_EXPERT_ID`]: bad input was dropped, the kernel and its peers completed the call
    /// normally. Reported once (taking the record clears it); the buffer stays usable.
    Argument,
    /// [`ERR_TIMEOUT`] / [`ERR_ABORTED`]: a bounded wait expired (a peer died or stopped calling).
    /// Fatal for the buffer: peers may be mid-call.
    Timeout,
    /// Any other code (a device-side consistency check, e.g. counts that disagree between ranks):
    /// the kernel left its protocol early; fatal for the buffer.
    Fatal,
}

impl RecordKind {
    /// `"argument"`, `"timeout"` or `"fatal"` (the Python binding's `kind`).
    pub fn name(self) -> &'static str {
        match self {
            RecordKind::Argument => "argument",
            RecordKind::Timeout => "timeout",
            RecordKind::Fatal => "fatal",
        }
    }
    /// Whether the buffer that ran the kernel must not be used again.
    pub fn is_fatal(self) -> bool {
        self != RecordKind::Argument
    }
}

/// The packing of a bad id's flat position and value into [`ErrorRecord::bad_key`], exactly as
/// `ep_bad_key` in `cuda/common.cuh` (the one documented place of the formula):
/// `((0xFFFFFFFF - min(pos, 0xFFFFFFFE)) << 32) | (value clamped to i32, as u32)`.
/// Every device thread that finds a bad id does an `atomicMax` of its key, so the smallest
/// position wins; the key is never 0.
pub fn bad_key(pos: u64, value: i64) -> u64 {
    let p = pos.min(0xFFFF_FFFE);
    let v = value.clamp(i32::MIN as i64, i32::MAX as i64) as i32;
    ((0xFFFF_FFFF - p) << 32) | (v as u32 as u64)
}

/// Inverse of [`bad_key`]: `(flat position, value clamped to i32)`; `None` for 0 (no key).
pub fn decode_bad_key(key: u64) -> Option<(u64, i32)> {
    if key == 0 {
        return None;
    }
    Some((0xFFFF_FFFF - (key >> 32), key as u32 as i32))
}

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
    ElasticPlan = 18,
    ElasticDispatchSend = 19,
    ElasticDispatchRecv = 20,
    ElasticCombineSend = 21,
    ElasticCombineRecv = 22,
    ElasticBarrier = 23,
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
            18 => ElasticPlan,
            19 => ElasticDispatchSend,
            20 => ElasticDispatchRecv,
            21 => ElasticCombineSend,
            22 => ElasticCombineRecv,
            23 => ElasticBarrier,
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
            ElasticPlan => "elastic dispatch/plan",
            ElasticDispatchSend => "elastic dispatch/send",
            ElasticDispatchRecv => "elastic dispatch/recv",
            ElasticCombineSend => "elastic combine/send",
            ElasticCombineRecv => "elastic combine/recv",
            ElasticBarrier => "elastic barrier",
        }
    }
    /// The `Buffer` call (Python names) whose kernel runs this phase.
    pub fn call(self) -> &'static str {
        use Phase::*;
        match self {
            Layout => "get_dispatch_layout",
            Notify | DispatchSend | DispatchRecv | CachedNotify => "dispatch",
            CombinePrep | CombineSend | CombineRecv => "combine",
            Barrier => "internode dispatch or combine",
            LlDispatchSend | LlDispatchRecv => "low_latency_dispatch",
            LlCombineSend | LlCombineRecv => "low_latency_combine",
            InternodeNotify | InternodeDispatch => "internode dispatch",
            InternodeForward | InternodeCombine => "internode combine",
            ElasticPlan | ElasticDispatchSend | ElasticDispatchRecv => "ElasticBuffer.dispatch",
            ElasticCombineSend | ElasticCombineRecv => "ElasticBuffer.combine",
            ElasticBarrier => "ElasticBuffer.barrier",
        }
    }
}

/// Every error the crate reports. Messages name the problem and the fix.
#[derive(Debug, thiserror::Error)]
pub enum EpError {
    /// Bad arguments, found before any launch.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A GPU-side wait exceeded its bound. `peer` < 0: the wait was not for one known rank.
    #[error("{}", timeout_message(*.rank, .call, .phase, *.channel, *.peer, *.waited_ms))]
    GpuTimeout { rank: i32, call: String, phase: String, channel: i32, peer: i32, waited_ms: f64 },
    /// A routing id that points nowhere, found on the GPU: the kernel dropped that selection (as
    /// -1) and completed the call. Not fatal: the buffer stays usable. `value` is clamped to the
    /// i32 range (`i32::MAX` means "that or more", `i32::MIN` "that or less").
    #[error("{}", bad_expert_message(*.rank, .call, *.token, *.slot, *.value, *.num_experts))]
    BadExpertId { rank: i32, call: String, token: u64, slot: u64, value: i32, num_experts: i32 },
    /// Any other device-side check that failed (the kernel left its protocol early; fatal).
    #[error("{0}")]
    DeviceCheck(String),
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

impl EpError {
    /// A device record that does not make the buffer unusable ([`EpError::BadExpertId`]).
    pub fn is_device_argument(&self) -> bool {
        matches!(self, EpError::BadExpertId { .. })
    }
}

fn timeout_message(rank: i32, call: &str, phase: &str, channel: i32, peer: i32, waited_ms: f64) -> String {
    let whom = if peer >= 0 { format!("rank {peer}") } else { "another rank".to_string() };
    let chan = if channel >= 0 { format!(", channel {channel}") } else { String::new() };
    let culprit = if peer >= 0 { format!("rank {peer}") } else { "a peer rank".to_string() };
    format!(
        "rank {rank}: {call} waited {:.1} s for {whom} (phase {phase}{chan}); {culprit} probably died, stopped calling, or called \
         with different arguments; this Buffer cannot be used again: call destroy() and create a new Buffer on the ranks that remain \
         (DEEPEP_GPU_TIMEOUT_MS sets the bound)",
        waited_ms / 1e3
    )
}

fn bad_expert_message(rank: i32, call: &str, token: u64, slot: u64, value: i32, num_experts: i32) -> String {
    let shown = match value {
        i32::MAX => format!("{value} or more"),
        i32::MIN => format!("{value} or less"),
        v => v.to_string(),
    };
    format!(
        "rank {rank}: topk_idx[{token}, {slot}] = {shown} in {call} is not an expert id: ids must be -1 (no expert) or in \
         [0, {num_experts}); the kernel dropped that selection (and any other bad one; this is the first) and nothing else; \
         fix the router output (or mask it to -1)"
    )
}

impl ErrorRecord {
    /// Whether this record is a bounded wait that expired (here or in another block of the same
    /// rank): the peer it waited for is lost to this rank's buffers, which cannot be used again.
    pub fn is_timeout(&self) -> bool {
        self.kind() == Some(RecordKind::Timeout)
    }

    /// What the host does with this record; `None` when it is clear.
    pub fn kind(&self) -> Option<RecordKind> {
        match self.code {
            ERR_NONE => None,
            ERR_BAD_EXPERT_ID => Some(RecordKind::Argument),
            ERR_TIMEOUT | ERR_ABORTED => Some(RecordKind::Timeout),
            _ => Some(RecordKind::Fatal),
        }
    }

    /// Turn a recorded device error into an [`EpError`]; `None` when the record is clear.
    pub fn to_error(&self) -> Option<EpError> {
        let kind = self.kind()?;
        let phase = Phase::from_i32(self.phase);
        let phase_name = phase.map(|p| p.name().to_string()).unwrap_or_else(|| format!("unknown phase {}", self.phase));
        let call = phase.map(|p| p.call().to_string()).unwrap_or_else(|| "a call".to_string());
        Some(match kind {
            RecordKind::Timeout => EpError::GpuTimeout {
                rank: self.rank,
                call,
                phase: phase_name,
                channel: self.channel,
                peer: self.peer,
                waited_ms: self.waited_ns as f64 / 1e6,
            },
            RecordKind::Argument => {
                let (pos, value) = decode_bad_key(self.bad_key).unwrap_or((u64::MAX, 0));
                let k = self.detail.max(1) as u64;
                let (token, slot) = if pos == u64::MAX { (u64::MAX, 0) } else { (pos / k, pos % k) };
                EpError::BadExpertId { rank: self.rank, call, token, slot, value, num_experts: self.peer }
            }
            RecordKind::Fatal if self.code == ERR_WRITING => EpError::DeviceCheck(format!(
                "rank {}: a kernel of {call} is still writing its error record; the Buffer cannot be used again: call destroy() \
                 and create a new Buffer",
                self.rank
            )),
            RecordKind::Fatal => EpError::DeviceCheck(format!(
                "rank {}: a device-side check failed in {call} (phase '{phase_name}', channel {}, peer {}, detail {}): the ranks \
                 disagree about this call (different arguments or layouts on different ranks, or a layout that does not match \
                 topk_idx); this Buffer cannot be used again: call destroy() and create a new Buffer on every rank",
                self.rank, self.channel, self.peer, self.detail
            )),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn ffi_sizes_match_cuda_header() {
        assert_eq!(std::mem::size_of::<ErrorRecord>(), 40);
        assert_eq!(std::mem::size_of::<Diag>(), 24);
    }

    fn timeout(phase: Phase, channel: i32, peer: i32) -> ErrorRecord {
        ErrorRecord { code: ERR_TIMEOUT, rank: 0, phase: phase as i32, channel, peer, detail: 0, waited_ns: 5_000_000_000, bad_key: 0 }
    }

    #[test]
    fn timeout_record_names_rank_peer_phase_channel_and_call() {
        let r = ErrorRecord { code: ERR_TIMEOUT, rank: 1, phase: 4, channel: 7, peer: 0, detail: 0, waited_ns: 2_000_000_000, bad_key: 0 };
        let msg = r.to_error().unwrap().to_string();
        assert!(msg.starts_with("rank 1: dispatch waited 2.0 s for rank 0 (phase dispatch/recv, channel 7);"), "{msg}");
        assert!(msg.contains("rank 0 probably died") && msg.contains("call destroy() and create a new Buffer"), "{msg}");
        assert!(ErrorRecord::default().to_error().is_none());
        assert_eq!(ErrorRecord::default().kind(), None);
        assert_eq!(r.kind(), Some(RecordKind::Timeout));
        // An aborted record reads as a timeout too.
        assert_eq!(ErrorRecord { code: ERR_ABORTED, ..r }.kind(), Some(RecordKind::Timeout));
    }

    #[test]
    fn every_phase_maps_to_its_call() {
        let want = [
            (Phase::Layout, "get_dispatch_layout"),
            (Phase::Notify, "dispatch"),
            (Phase::DispatchSend, "dispatch"),
            (Phase::DispatchRecv, "dispatch"),
            (Phase::CachedNotify, "dispatch"),
            (Phase::CombinePrep, "combine"),
            (Phase::CombineSend, "combine"),
            (Phase::CombineRecv, "combine"),
            (Phase::Barrier, "internode dispatch or combine"),
            (Phase::LlDispatchSend, "low_latency_dispatch"),
            (Phase::LlDispatchRecv, "low_latency_dispatch"),
            (Phase::LlCombineSend, "low_latency_combine"),
            (Phase::LlCombineRecv, "low_latency_combine"),
            (Phase::InternodeNotify, "internode dispatch"),
            (Phase::InternodeDispatch, "internode dispatch"),
            (Phase::InternodeForward, "internode combine"),
            (Phase::InternodeCombine, "internode combine"),
            (Phase::ElasticPlan, "ElasticBuffer.dispatch"),
            (Phase::ElasticDispatchSend, "ElasticBuffer.dispatch"),
            (Phase::ElasticDispatchRecv, "ElasticBuffer.dispatch"),
            (Phase::ElasticCombineSend, "ElasticBuffer.combine"),
            (Phase::ElasticCombineRecv, "ElasticBuffer.combine"),
            (Phase::ElasticBarrier, "ElasticBuffer.barrier"),
        ];
        // Every phase number the CUDA header defines (1..=23) is covered, once.
        assert_eq!(want.len(), 23);
        for (i, (phase, call)) in want.iter().enumerate() {
            assert_eq!(Phase::from_i32(i as i32 + 1), Some(*phase));
            let msg = timeout(*phase, 3, 2).to_error().unwrap().to_string();
            let head = format!("rank 0: {call} waited 5.0 s for rank 2 (phase {}, channel 3);", phase.name());
            assert!(msg.starts_with(&head), "{msg}\nwanted it to start with: {head}");
        }
        assert_eq!(Phase::from_i32(24), None);
    }

    #[test]
    fn timeout_without_a_known_peer_or_channel() {
        let msg = timeout(Phase::LlCombineRecv, -1, -1).to_error().unwrap().to_string();
        assert!(msg.starts_with("rank 0: low_latency_combine waited 5.0 s for another rank (phase low-latency combine/recv);"), "{msg}");
        assert!(msg.contains("a peer rank probably died"), "{msg}");
    }

    #[test]
    fn bad_key_keeps_the_smallest_position() {
        // The device's atomicMax, simulated: whatever order the threads come in, the maximum key
        // is the smallest position (with its own value).
        let hits: [(u64, i64); 5] = [(900, 7), (37 * 8 + 2, 300), (5000, -2), (37 * 8 + 5, -9), (u32::MAX as u64 + 10, 1)];
        for rot in 0..hits.len() {
            let mut key = 0u64;
            for i in 0..hits.len() {
                let (pos, v) = hits[(i + rot) % hits.len()];
                key = key.max(bad_key(pos, v));
            }
            assert_eq!(decode_bad_key(key), Some((37 * 8 + 2, 300)));
        }
        // Round trips, clamping, and "0 = no key".
        assert_eq!(decode_bad_key(bad_key(0, -2)), Some((0, -2)));
        assert_eq!(decode_bad_key(bad_key(12, 1 << 40)), Some((12, i32::MAX)));
        assert_eq!(decode_bad_key(bad_key(12, -(1 << 40))), Some((12, i32::MIN)));
        assert_eq!(decode_bad_key(bad_key(u64::MAX, 5)), Some((0xFFFF_FFFE, 5)));
        assert_ne!(bad_key(u64::MAX, 0), 0);
        assert_eq!(decode_bad_key(0), None);
        // The exact bits of the documented formula.
        assert_eq!(bad_key(1, -1), (0xFFFF_FFFEu64 << 32) | 0xFFFF_FFFF);
    }

    fn bad_id(phase: Phase, pos: u64, value: i64, k: i32, e: i32) -> ErrorRecord {
        ErrorRecord { code: ERR_BAD_EXPERT_ID, rank: 0, phase: phase as i32, channel: -1, peer: e, detail: k, waited_ns: 0, bad_key: bad_key(pos, value) }
    }

    #[test]
    fn bad_expert_id_names_tensor_position_value_range_call_and_fix() {
        let r = bad_id(Phase::LlDispatchSend, 37 * 8 + 2, 300, 8, 256);
        assert_eq!(r.kind(), Some(RecordKind::Argument));
        assert!(!RecordKind::Argument.is_fatal() && RecordKind::Timeout.is_fatal() && RecordKind::Fatal.is_fatal());
        let e = r.to_error().unwrap();
        assert!(e.is_device_argument());
        assert_eq!(
            e.to_string(),
            "rank 0: topk_idx[37, 2] = 300 in low_latency_dispatch is not an expert id: ids must be -1 (no expert) or in [0, 256); \
             the kernel dropped that selection (and any other bad one; this is the first) and nothing else; fix the router output \
             (or mask it to -1)"
        );
        let calls = [
            (Phase::Layout, "get_dispatch_layout"),
            (Phase::DispatchSend, "dispatch"),
            (Phase::InternodeNotify, "internode dispatch"),
        ];
        for (phase, call) in calls {
            let msg = bad_id(phase, 13, -2, 2, 16).to_error().unwrap().to_string();
            assert!(msg.starts_with(&format!("rank 0: topk_idx[6, 1] = -2 in {call} is not an expert id")), "{msg}");
            assert!(msg.contains("[0, 16)"), "{msg}");
        }
        let msg = bad_id(Phase::Layout, 3, 1 << 40, 4, 16).to_error().unwrap().to_string();
        assert!(msg.contains("topk_idx[0, 3] = 2147483647 or more"), "{msg}");
    }

    #[test]
    fn other_device_checks_are_fatal_and_say_so() {
        let r = ErrorRecord { code: ERR_BAD_ARGUMENT, rank: 2, phase: Phase::Notify as i32, channel: -1, peer: 1, detail: 9, waited_ns: 0, bad_key: 0 };
        assert_eq!(r.kind(), Some(RecordKind::Fatal));
        let e = r.to_error().unwrap();
        assert!(!e.is_device_argument());
        let msg = e.to_string();
        assert!(msg.starts_with("rank 2: a device-side check failed in dispatch (phase 'notify'"), "{msg}");
        assert!(msg.contains("cannot be used again"), "{msg}");
    }
}
