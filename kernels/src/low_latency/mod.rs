//! Low-latency (LL) dispatch and combine over NVSHMEM: fixed capacity `num_max` tokens per rank,
//! double-buffered, no host synchronization inside a call (CUDA-graph friendly), optional receive
//! hook (launch the send half now, the receive half later).
//!
//! Device code: `cuda/nvshmem/low_latency.cu` (protocol in `low_latency.cuh`). Host side here:
//! the symmetric buffer layout ([`LlLayout`], pure and CI-tested), argument checks (contract §4,
//! §8), launches, and the outputs as [`Tensor`] views into the buffer that become invalid when
//! the same half is reused (two calls later), like DeepEP's "at most two LL results alive".
//!
//! Outputs of [`LowLatencyBuffer::dispatch`] on rank d (L = E/R local experts):
//! - `packed_recv_x` `[L, R·num_max, H]` (e4m3 or bf16); rows `[0, packed_recv_count[le])` valid,
//!   each source's rows contiguous at `layout_range` (block order: v2 dispatch ascending source
//!   rank, v1 d, d+1, ..., d-1; callers must not rely on either);
//! - FP8 scales, physical `[L, H/128, R·num_max]` f32 (the column-major view `[L, R·num_max, H/128]`)
//!   or with UE8M0 `[L, H/512, R·num_max]` i32 (four exponent bytes, lowest group lowest);
//! - `packed_recv_count` `[L]` i32, and the [`LlHandle`] (`src_info` `[L, R·num_max]` i32,
//!   `layout_range` `[L, R]` i64 = `(begin << 32) | count`).

pub mod raw;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::nvshmem::knobs::KnobRequest;
use crate::nvshmem::{NvshmemRuntime, SymmetricBuffer};
use crate::error::{EpError, Result};
use crate::runtime::memory::Pod;
use crate::runtime::{Args, Comm, DeviceBuffer, Gpu, Kernel, LaunchCfg};
use cudarc::driver::sys;
use crate::tensor::{DType, Generation, Tensor};
use crate::trace::{PhaseTrace, TracePhase};
use crate::validate;

/// Threads per block (`LL_THREADS` in `low_latency.cuh`).
pub const LL_THREADS: u32 = 512;
/// Warps per block.
pub const LL_WARPS: usize = LL_THREADS as usize / 32;
/// Largest top-k (`LL_MAX_TOPK`).
pub const LL_MAX_TOPK: usize = validate::MAX_TOPK_LOW_LATENCY;
/// Per-warp staging slot of the NVSHMEM put path (`LL_STAGE_BYTES`).
pub const LL_STAGE_BYTES: usize = 2048 + 64;
const PHASE_SEND: i32 = 1;
const PHASE_RECV: i32 = 2;
const ALIGN: usize = 128;

/// Mirror of `LlDispatchArgs` (`low_latency.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LlDispatchArgs {
    pub x: u64,
    pub topk_idx: u64,
    pub buf: u64,
    pub peer_base: u64,
    pub off_x: u64,
    pub off_scale_stage: u64,
    pub off_scales: u64,
    pub off_src_info: u64,
    pub off_src_k: u64,
    pub off_layout_range: u64,
    pub off_recv_count: u64,
    pub off_count_sig: u64,
    pub off_done_sig: u64,
    pub off_epoch: u64,
    pub off_send_slot: u64,
    pub off_stage: u64,
    pub num_tokens: i32,
    pub hidden: i32,
    pub num_topk: i32,
    pub num_experts: i32,
    pub num_ranks: i32,
    pub rank: i32,
    pub num_max: i32,
    pub phases: i32,
    pub use_fp8: i32,
    pub round_scale: i32,
    pub use_ue8m0: i32,
    pub experts_per_block: i32,
}

/// Mirror of `LlCombineArgs` (`low_latency.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LlCombineArgs {
    pub y: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub out: u64,
    pub buf: u64,
    pub peer_base: u64,
    /// Base of the handle's regions below: `buf`, or the handle's own copy ([`LlHandle`]).
    pub hbuf: u64,
    pub off_src_info: u64,
    pub off_src_k: u64,
    pub off_layout_range: u64,
    pub off_recv_count: u64,
    pub off_send_slot: u64,
    pub off_comb_recv: u64,
    pub off_comb_done: u64,
    pub off_comb_ready: u64,
    pub off_epoch: u64,
    pub off_stage: u64,
    pub num_tokens: i32,
    pub hidden: i32,
    pub num_topk: i32,
    pub num_experts: i32,
    pub num_ranks: i32,
    pub rank: i32,
    pub num_max: i32,
    pub phases: i32,
    pub local_experts_per_block: i32,
    pub wait_ready: i32,
    /// 0, or the device address of `u64[LL_TRACE_SLOTS]` phase timestamps.
    pub trace: u64,
}

/// Mirror of `LlDispatch2Args` (`low_latency.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LlDispatch2Args {
    pub x: u64,
    pub topk_idx: u64,
    pub buf: u64,
    pub peer_base: u64,
    pub off_x: u64,
    pub off_scales: u64,
    pub off_src_info: u64,
    pub off_src_k: u64,
    pub off_layout_range: u64,
    pub off_recv_count: u64,
    pub off_epoch: u64,
    pub off_send_slot: u64,
    pub off_tok_stage: u64,
    pub off_tok_flags: u64,
    pub off_ready: u64,
    pub off_tok_slot: u64,
    pub off_ntok: u64,
    pub off_stage: u64,
    pub num_tokens: i32,
    pub hidden: i32,
    pub num_topk: i32,
    pub num_experts: i32,
    pub num_ranks: i32,
    pub rank: i32,
    pub num_max: i32,
    pub phases: i32,
    pub use_fp8: i32,
    pub round_scale: i32,
    pub use_ue8m0: i32,
    pub wait_ready: i32,
    pub stage_stride: i32,
    pub tk_off: i32,
    /// 0, or the device address of `u64[LL_TRACE_SLOTS]` phase timestamps.
    pub trace: u64,
}

/// Mirror of `LlCombine2Args` (`low_latency.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LlCombine2Args {
    pub y: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub out: u64,
    pub buf: u64,
    pub peer_base: u64,
    /// Base of the handle's regions below: `buf`, or the handle's own copy ([`LlHandle`]).
    pub hbuf: u64,
    pub off_send_slot: u64,
    pub off_tok_slot: u64,
    pub off_ntok: u64,
    pub off_part: u64,
    pub off_comb_done: u64,
    pub off_wts: u64,
    pub off_wts_flag: u64,
    pub off_epoch: u64,
    pub off_stage: u64,
    pub num_tokens: i32,
    pub hidden: i32,
    pub num_topk: i32,
    pub num_experts: i32,
    pub num_ranks: i32,
    pub rank: i32,
    pub num_max: i32,
    pub phases: i32,
    /// 1..15: warps per block doing the owner work while the others do the origin work (launches
    /// with both phases); 0: every warp does both, one after the other.
    pub owner_warps: i32,
    pub pad_: i32,
    /// 0, or the device address of `u64[LL_TRACE_SLOTS]` phase timestamps.
    pub trace: u64,
}

const _: () = {
    assert!(std::mem::size_of::<LlCombine2Args>() == 176);
    assert!(std::mem::size_of::<LlDispatch2Args>() == 208);
    assert!(std::mem::size_of::<LlDispatchArgs>() == 176);
    assert!(std::mem::size_of::<LlCombineArgs>() == 184);
};

// SAFETY: repr(C), integers only, no padding.
unsafe impl Pod for LlDispatchArgs {}
unsafe impl Pod for LlCombineArgs {}
unsafe impl Pod for LlDispatch2Args {}
unsafe impl Pod for LlCombine2Args {}

/// Which combine kernel a buffer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CombineVersion {
    /// Every remote (token, expert) row goes back to its origin as bf16; works with v1 dispatch
    /// handles and any number of ranks (43.4 us kernel time at 128 x 7168, top-8 of 288, 2x H200).
    /// Kept: the only combine for v1 handles and above 32 ranks.
    V1,
    /// Owners pre-reduce each origin token's rows with its weights (shipped first) into one f32
    /// partial per (token, owner): half the NVLink bytes, one more flag round trip. Owners start
    /// loading rows at once and acquire each origin's weights flag per warp just before the FMAs
    /// (the weights' round trip overlaps the loads). Default; needs a v2 dispatch handle and at
    /// most 32 ranks (v1 is used for v1 handles and above 32 ranks). Combine v2 (the same
    /// protocol, owners waiting for every origin's weights before any load) was retired: slower
    /// at every measured shape, needed by no case (`docs/architecture.md`, "Kernel variants").
    V3,
}

impl CombineVersion {
    /// `DEEPEP_LL_COMBINE=v1|v3` (default v3).
    pub fn from_env() -> Result<CombineVersion> {
        Self::parse(std::env::var("DEEPEP_LL_COMBINE").ok().as_deref())
    }

    /// The value of `DEEPEP_LL_COMBINE` (`None`: unset).
    pub fn parse(value: Option<&str>) -> Result<CombineVersion> {
        use CombineVersion::*;
        if value.is_some_and(|v| v.trim().eq_ignore_ascii_case("v2")) {
            return Err(EpError::InvalidArgument(
                "DEEPEP_LL_COMBINE=\"v2\": combine v2 was retired (v3 has the same protocol and buffers and is faster at \
                 every measured shape); use v3 (the default: unset DEEPEP_LL_COMBINE) or v1"
                    .into(),
            ));
        }
        env_choice("DEEPEP_LL_COMBINE", value, V3, &[("v1", V1), ("v3", V3)], "use v1 or v3 (default v3)")
    }
}

/// An environment choice: unset or empty gives `default`, else one of the `choices` by name
/// (ASCII case-insensitive), else an error naming the variable, the value and `help`.
fn env_choice<T: Copy>(var: &str, value: Option<&str>, default: T, choices: &[(&str, T)], help: &str) -> Result<T> {
    match value.map(str::trim) {
        None | Some("") => Ok(default),
        Some(v) => choices
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(v))
            .map(|&(_, t)| t)
            .ok_or_else(|| EpError::InvalidArgument(format!("{var}={v:?}: {help}"))),
    }
}

/// Warps per 16-warp block that do the owner work of combine v3 while the others do the
/// origin work (see [`LowLatencyBuffer::set_combine_owner_warps`]).
pub const DEFAULT_COMBINE_OWNER_WARPS: usize = 8;

/// `DEEPEP_LL_OWNER_WARPS=0..15` (default [`DEFAULT_COMBINE_OWNER_WARPS`]).
pub fn combine_owner_warps_from_env() -> Result<usize> {
    parse_combine_owner_warps(std::env::var("DEEPEP_LL_OWNER_WARPS").ok().as_deref())
}

/// The value of `DEEPEP_LL_OWNER_WARPS` (`None`: unset).
pub fn parse_combine_owner_warps(value: Option<&str>) -> Result<usize> {
    match value.map(str::trim) {
        None | Some("") => Ok(DEFAULT_COMBINE_OWNER_WARPS),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if n < LL_WARPS => Ok(n),
            _ => Err(EpError::InvalidArgument(format!(
                "DEEPEP_LL_OWNER_WARPS={v:?}: use a number of warps from 0 (no split: every warp does the owner \
                 work, then the origin work) to {} (default {DEFAULT_COMBINE_OWNER_WARPS})",
                LL_WARPS - 1
            ))),
        },
    }
}

/// Which dispatch kernel a buffer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchVersion {
    /// One message per (token, expert), written straight into the owner's packed slot (needs a
    /// count exchange).
    V1,
    /// One message per (token, destination rank) into a token staging area; the receiver packs
    /// locally (default; needs at most 32 ranks).
    V2,
}

impl DispatchVersion {
    /// `DEEPEP_LL_DISPATCH=v1|v2` (default v2).
    pub fn from_env() -> Result<DispatchVersion> {
        Self::parse(std::env::var("DEEPEP_LL_DISPATCH").ok().as_deref())
    }

    /// The value of `DEEPEP_LL_DISPATCH` (`None`: unset).
    pub fn parse(value: Option<&str>) -> Result<DispatchVersion> {
        use DispatchVersion::*;
        env_choice("DEEPEP_LL_DISPATCH", value, V2, &[("v1", V1), ("v2", V2)], "use v1 or v2 (default v2)")
    }
}

/// Byte offsets of one dispatch half inside the symmetric buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchRegions {
    pub x: usize,
    pub scale_stage: usize,
    pub scales: usize,
    pub src_info: usize,
    pub src_k: usize,
    pub layout_range: usize,
    pub recv_count: usize,
    pub count_sig: usize,
    pub done_sig: usize,
    pub epoch: usize,
    pub send_slot: usize,
    /// v2: `[R][num_max]` token entries of [`LlLayout::stage_stride`] bytes.
    pub tok_stage: usize,
    /// v2: `[R][grid]` u64 flags.
    pub tok_flags: usize,
    /// v2: `[R]` u64 "dispatch started" flags.
    pub ready: usize,
    /// v2: `[R][num_max][LL_MAX_TOPK]` i32 packed row (`local expert · R·num_max + slot`) of each
    /// (source, token, k) held here, −1 for one held elsewhere.
    pub tok_slot: usize,
    /// v2: `[R]` i32 token count of each source.
    pub ntok: usize,
}

/// Byte offsets of one combine half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombineRegions {
    pub recv: usize,
    pub done: usize,
    pub ready: usize,
    pub epoch: usize,
    /// v2: `[num_max][R][H]` f32 partial rows by owner.
    pub part: usize,
    /// v2: `[R][num_max][LL_MAX_TOPK]` f32 weights of each origin.
    pub wts: usize,
    /// v2: `[R]` u64 weights-arrived flags.
    pub wts_flag: usize,
}

/// The symmetric buffer layout for (ranks, experts, num_max, hidden, grid). Identical on every
/// rank (the allocation is collective and offsets are symmetric).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlLayout {
    pub num_ranks: usize,
    pub num_experts: usize,
    pub num_max: usize,
    pub hidden: usize,
    pub grid: usize,
    pub dispatch: [DispatchRegions; 2],
    pub combine: [CombineRegions; 2],
    pub stage: usize,
    pub total_bytes: usize,
}

struct Cursor(usize);
impl Cursor {
    fn take(&mut self, bytes: usize) -> usize {
        let at = self.0;
        self.0 = (self.0 + bytes).next_multiple_of(ALIGN);
        at
    }
}

impl LlLayout {
    /// Compute the layout; checks the shapes (contract §8) first.
    pub fn new(num_ranks: usize, num_experts: usize, num_max: usize, hidden: usize, grid: usize) -> Result<LlLayout> {
        validate::low_latency_ranks(num_ranks, num_experts)?;
        validate::low_latency_num_max(num_max, num_ranks)?;
        validate::low_latency_hidden(hidden, false, None)?;
        if hidden % 128 != 0 {
            return Err(EpError::InvalidArgument(format!(
                "low-latency hidden size {hidden} must be a multiple of 128 (one FP8 scale per 128 channels); use e.g. {}",
                hidden.next_multiple_of(128)
            )));
        }
        let l = num_experts / num_ranks;
        if l > 1024 {
            return Err(EpError::InvalidArgument(format!(
                "{l} local experts per rank exceed the limit of 1024 (contract §8); use more ranks or fewer experts"
            )));
        }
        if grid == 0 {
            return Err(EpError::InvalidArgument("low-latency grid of 0 blocks; use at least 1 SM".into()));
        }
        let (r, rnm, s, h) = (num_ranks, num_ranks * num_max, hidden / 128, hidden);
        let mut c = Cursor(0);
        let dispatch_half = |c: &mut Cursor| DispatchRegions {
            x: c.take(l * rnm * 2 * h),
            scale_stage: c.take(l * rnm * s * 4),
            scales: c.take(l * s * rnm * 4),
            src_info: c.take(l * rnm * 4),
            src_k: c.take(l * rnm * 4),
            layout_range: c.take(l * r * 8),
            recv_count: c.take(l * 4),
            count_sig: c.take(num_experts * r * 8),
            done_sig: c.take(l * r * 8),
            epoch: c.take(grid * 4),
            send_slot: c.take(num_max * LL_MAX_TOPK * 4),
            tok_stage: c.take(r * num_max * Self::stride_for(h)),
            tok_flags: c.take(r * grid * 8),
            ready: c.take(r * 8),
            tok_slot: c.take(r * num_max * LL_MAX_TOPK * 4),
            ntok: c.take(r * 4),
        };
        let d0 = dispatch_half(&mut c);
        let d1 = dispatch_half(&mut c);
        let combine_half =
            |c: &mut Cursor| CombineRegions {
            recv: c.take(num_max * LL_MAX_TOPK * 2 * h),
            done: c.take(r * grid * 8),
            ready: c.take(r * 8),
            epoch: c.take(grid * 4),
            part: c.take(num_max * r * h * 4),
            wts: c.take(r * num_max * LL_MAX_TOPK * 4),
            wts_flag: c.take(r * 8),
        };
        let c0 = combine_half(&mut c);
        let c1 = combine_half(&mut c);
        let stage = c.take(grid * LL_WARPS * LL_STAGE_BYTES);
        Ok(LlLayout {
            num_ranks,
            num_experts,
            num_max,
            hidden,
            grid,
            dispatch: [d0, d1],
            combine: [c0, c1],
            stage,
            total_bytes: c.0,
        })
    }

    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.num_ranks
    }
    /// Shape of a dispatch's `packed_recv_x`: `[L, R·num_max, H]`.
    pub fn recv_x_shape(&self) -> [usize; 3] {
        [self.num_local_experts(), self.num_ranks * self.num_max, self.hidden]
    }
    /// Dtype and physical shape of an FP8 dispatch's scales: f32 `[L, H/128, R·num_max]`, or with
    /// UE8M0 i32 `[L, H/512, R·num_max]` (four exponent bytes per word).
    pub fn recv_scales_layout(&self, use_ue8m0: bool) -> (DType, [usize; 3]) {
        let (l, rnm, s) = (self.num_local_experts(), self.num_ranks * self.num_max, self.hidden / 128);
        if use_ue8m0 {
            (DType::I32, [l, s / 4, rnm])
        } else {
            (DType::F32, [l, s, rnm])
        }
    }
    /// The dispatch half whose `packed_recv_x` starts at byte offset `off_x` of the buffer.
    pub fn dispatch_half_at(&self, off_x: u64) -> Option<usize> {
        self.dispatch.iter().position(|d| d.x as u64 == off_x)
    }
    /// Experts handled by one block in dispatch (`e % grid == block`).
    pub fn experts_per_block(&self) -> usize {
        self.num_experts.div_ceil(self.grid)
    }
    /// Local experts handled by one block in the receive / combine-send phases.
    pub fn local_experts_per_block(&self) -> usize {
        self.num_local_experts().div_ceil(self.grid)
    }
    /// Byte offset of the top-k ids inside a v2 token entry (data at 0, f32 scales at 2H).
    pub fn tk_off(&self) -> usize {
        Self::tk_off_for(self.hidden)
    }
    fn tk_off_for(h: usize) -> usize {
        2 * h + (h / 128 * 4).next_multiple_of(16)
    }
    fn stride_for(h: usize) -> usize {
        (Self::tk_off_for(h) + LL_MAX_TOPK * 4).next_multiple_of(ALIGN)
    }
    /// Bytes of one v2 token entry.
    pub fn stage_stride(&self) -> usize {
        Self::stride_for(self.hidden)
    }
    /// Dynamic shared memory of the v2 dispatch kernel.
    pub fn dispatch2_smem(&self) -> usize {
        let (lpb, r) = (self.local_experts_per_block(), self.num_ranks);
        (2 * lpb * r + lpb + r + lpb * r * self.num_max) * 4
    }
    /// Dynamic shared memory of the combine kernel: a prefix over local experts + warp sums.
    pub fn combine_smem(&self) -> usize {
        (self.num_local_experts() + 1 + LL_WARPS) * 4
    }
    /// Dynamic shared memory of the dispatch kernel (see the kernel's smem comment).
    pub fn dispatch_smem(&self) -> usize {
        let (epb, lpb) = (self.experts_per_block(), self.local_experts_per_block());
        (2 * epb + epb * self.num_max + lpb * self.num_ranks + lpb) * 4
    }
}

/// Dispatch options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LlDispatchOpts {
    /// Cast to FP8 e4m3 with per-128-channel scales (else bf16 rows).
    pub use_fp8: bool,
    /// Power-of-two scales.
    pub round_scale: bool,
    /// UE8M0 scales packed four per int32 (needs `round_scale`).
    pub use_ue8m0: bool,
    /// Launch only the send half now; the returned hook launches the receive half.
    pub return_hook: bool,
}

/// The symbol of the low-latency entry point `ll::{name}(const {args} a, EpDiag diag)` in the
/// cubin: its Itanium C++ mangling (`_ZN2ll<len><name>E<len><args>6EpDiag`; a top-level `const`
/// does not enter the mangled name). The entry points have C++ names so that profilers show
/// `ll::dispatch*` / `ll::combine*`, the names DeepEP's tests look for.
pub fn ll_entry(name: &str, args: &str) -> String {
    format!("_ZN2ll{}{name}E{}{args}6EpDiag", name.len(), args.len())
}

/// Where a combine reads its dispatch's routing: a base address and the regions' offsets from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HandleRegions {
    base: u64,
    src_info: usize,
    src_k: usize,
    layout_range: usize,
    recv_count: usize,
    send_slot: usize,
    tok_slot: usize,
    ntok: usize,
}

impl HandleRegions {
    /// The regions in the dispatch half `d` of the symmetric buffer at `base`.
    fn in_half(base: u64, d: &DispatchRegions) -> HandleRegions {
        HandleRegions {
            base,
            src_info: d.src_info,
            src_k: d.src_k,
            layout_range: d.layout_range,
            recv_count: d.recv_count,
            send_slot: d.send_slot,
            tok_slot: d.tok_slot,
            ntok: d.ntok,
        }
    }
}

/// A handle's own copy of its dispatch's routing, made (stream-ordered) just before a later
/// dispatch reuses the half: two contiguous spans of the half, `[src_info, send_slot end)` and
/// `[tok_slot, ntok end)`. Every byte a combine or `src_info` / `layout_range` reads there is
/// written by this rank's own dispatch kernel (v1 peers write `src_info` / `src_k` too, but only
/// after this rank started the dispatch that uses the half), so the copy is complete.
struct HandleCopy {
    mem: Tensor,
    regions: HandleRegions,
}

/// Set once, when a later dispatch reuses the handle's half while the handle is alive.
type CopyCell = std::sync::OnceLock<Arc<HandleCopy>>;

/// What combine needs from its dispatch. Self-contained as in DeepEP: while the handle is alive,
/// the dispatch that reuses its half first copies the routing it needs (a few hundred KiB at
/// most, only then), so combining or indexing an older handle keeps working.
#[derive(Clone)]
pub struct LlHandle {
    half: usize,
    generation: u64,
    version: DispatchVersion,
    pub num_tokens: usize,
    pub num_topk: usize,
    pub hidden: usize,
    /// Views of `src_info` / `layout_range` in the half (valid until it is reused). They do not
    /// keep the symmetric memory: a handle may outlive its buffer (whose drop is collective), and
    /// then refuses ([`LlHandle::buffer_released`]).
    src_info: Tensor,
    layout_range: Tensor,
    copy: Arc<CopyCell>,
}

impl LlHandle {
    /// `[L, R·num_max]` i32: source token position of each packed row (in the dispatch's half,
    /// or in the handle's own copy once the half was reused).
    pub fn src_info(&self) -> Tensor {
        self.own_view(&self.src_info, |r| r.src_info)
    }
    /// `[L, R]` i64: `(begin << 32) | count` of each source's rows (as [`LlHandle::src_info`]).
    pub fn layout_range(&self) -> Tensor {
        self.own_view(&self.layout_range, |r| r.layout_range)
    }
    /// Whether the buffer of this handle's dispatch was dropped (destroyed or re-created) and the
    /// handle holds no copy of its routing: its `src_info` / `layout_range` are then gone.
    pub fn buffer_released(&self) -> bool {
        // the views' generation counter is the half's, which the buffer's drop sets to RELEASED
        self.copy.get().is_none() && self.src_info.generation_now() == Some(RELEASED)
    }
    /// Whether the handle reads its own copy (a later dispatch reused its half).
    pub fn is_copied(&self) -> bool {
        self.copy.get().is_some()
    }
    /// The handle's own copy, if one was made: its memory (freed stream-ordered on the stream
    /// of [`Tensor::stream`] when the last handle clone drops).
    pub fn copy_memory(&self) -> Option<&Tensor> {
        self.copy.get().map(|c| &c.mem)
    }
    fn own_view(&self, in_half: &Tensor, off: impl Fn(&HandleRegions) -> usize) -> Tensor {
        match self.copy.get() {
            None => in_half.clone(),
            Some(c) => {
                let keep: Arc<dyn std::any::Any + Send + Sync> = c.clone();
                Tensor::view(c.mem.stream(), keep, c.regions.base + off(&c.regions) as u64, in_half.dtype(), in_half.shape(), None)
            }
        }
    }
}

impl std::fmt::Debug for LlHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LlHandle(half {}, {} tokens, top-{}, hidden {})", self.half, self.num_tokens, self.num_topk, self.hidden)
    }
}

/// The receive half of a call made with `return_hook`: launch it with [`LowLatencyBuffer::recv`].
#[derive(Debug)]
pub enum LlHook {
    Dispatch(LlDispatchArgs),
    Dispatch2(LlDispatch2Args),
    Combine(LlCombineArgs),
    Combine3(LlCombine2Args),
}

/// Result of [`LowLatencyBuffer::dispatch`].
pub struct LlDispatchOut {
    pub packed_recv_x: Tensor,
    /// FP8 only: f32 `[L, H/128, R·num_max]` or UE8M0 i32 `[L, H/512, R·num_max]` (physical layout).
    pub packed_recv_x_scales: Option<Tensor>,
    pub packed_recv_count: Tensor,
    pub handle: LlHandle,
    pub hook: Option<LlHook>,
}

/// Result of [`LowLatencyBuffer::combine`].
pub struct LlCombineOut {
    /// `[N, H]` bf16.
    pub combined_x: Tensor,
    pub hook: Option<LlHook>,
}

/// The LL buffer of one rank. Creation, dispatch, combine and drop are collective: every rank
/// makes the same calls in the same order.
pub struct LowLatencyBuffer<'g> {
    gpu: &'g Gpu,
    rank: usize,
    layout: LlLayout,
    shared: Arc<Shared>,
    peer_table: DeviceBuffer,
    all_p2p: bool,
    dispatch_kernel: Kernel,
    dispatch2_kernel: Kernel,
    combine_kernel: Kernel,
    combine3_kernel: Kernel,
    version: DispatchVersion,
    combine_version: CombineVersion,
    combine_owner_warps: usize,
    /// Whether one of the last two dispatches deferred its receive half (v2 then waits for every
    /// destination to have started the next dispatch before writing into it).
    dispatch_hooked: [bool; 2],
    dispatch_calls: u64,
    combine_calls: u64,
    /// Whether one of the last two combines deferred its receive half (hook): the next combine
    /// then waits for every origin to have started it before writing into its buffer.
    combine_hooked: [bool; 2],
    generations: [Arc<AtomicU64>; 2],
    /// The owner of the handles' views, which do not keep the symmetric memory.
    no_owner: Arc<dyn std::any::Any + Send + Sync>,
    /// The handle of the latest dispatch into each half (weakly): the next dispatch into the half
    /// copies its routing first if it is still alive.
    live: [std::sync::Weak<CopyCell>; 2],
    /// Whether the latest dispatch into each half deferred its receive half and the hook has not
    /// run yet (its routing is then incomplete and cannot be copied).
    recv_pending: [bool; 2],
    /// Raw stream the calls launch on ([`LowLatencyBuffer::set_stream`]; None: the Gpu's stream;
    /// Some(0) is the legacy default stream, torch's default), the stream of the last launch, and
    /// an event recorded after each launch (calls stay ordered across streams through the event,
    /// never through the old stream's handle, which its owner may have destroyed since), and
    /// whether that launch was captured into a CUDA graph.
    stream: Option<u64>,
    last: u64,
    last_mark: sys::CUevent,
    last_captured: bool,
    /// The last launch is not marked yet: its stream lives as long as the buffer (the legacy
    /// default stream, torch's default, or the Gpu's own), so the event is recorded there only
    /// when a call on another stream needs it (one event record less per call on one stream).
    mark_pending: AtomicBool,
    /// Phase timestamps of the last combine kernel, when tracing is on.
    trace: Option<DeviceBuffer>,
    /// Set when a kernel of this rank recorded a GPU-side error: the outputs of that call are
    /// incomplete and peers may be mid-call, so every later call is refused.
    poisoned: std::sync::Mutex<Option<String>>,
}

/// `LL_TRACE_SLOTS` of `low_latency.cuh`.
pub const LL_TRACE_SLOTS: usize = 8;

/// The low-latency phases of a [`PhaseTrace`] and their slots (`LL_TRACE_*` of
/// `low_latency.cuh`).
const LL_TRACE_PHASES: [(TracePhase, usize); 5] = [
    (TracePhase::Sent, 1),
    (TracePhase::Local, 2),
    (TracePhase::WaitedFirst, 3),
    (TracePhase::Waited, 4),
    (TracePhase::End, 5),
];

/// Keeps the symmetric memory (and NVSHMEM) alive while views of it exist.
struct Shared {
    /// Freed through [`crate::nvshmem::release_symmetric`] (kept for the surviving ranks after a
    /// lost peer, since `nvshmem_free` would wait for that peer).
    sym: std::mem::ManuallyDrop<SymmetricBuffer>,
    _rt: Arc<NvshmemRuntime>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: `sym` is taken once, here, and never used again.
        let sym = unsafe { std::mem::ManuallyDrop::take(&mut self.sym) };
        crate::nvshmem::release_symmetric(sym);
    }
}

/// How the LL kernels reach other ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlTransport {
    /// NVLink loads/stores to every peer `nvshmem_ptr` maps, NVSHMEM puts to the others.
    Auto,
    /// NVSHMEM puts and signals to every other rank even when it is mapped (the kernels that
    /// run across hosts over IBGDA; on one host NVSHMEM carries them over its P2P transport).
    Put,
}

impl LlTransport {
    /// `DEEPEP_LL_TRANSPORT=auto|put` (default auto).
    pub fn from_env() -> Result<LlTransport> {
        Self::parse(std::env::var("DEEPEP_LL_TRANSPORT").ok().as_deref())
    }

    /// The value of `DEEPEP_LL_TRANSPORT` (`None`: unset).
    pub fn parse(value: Option<&str>) -> Result<LlTransport> {
        env_choice(
            "DEEPEP_LL_TRANSPORT",
            value,
            LlTransport::Auto,
            &[("auto", LlTransport::Auto), ("put", LlTransport::Put)],
            "use auto (NVLink stores where mapped, NVSHMEM puts elsewhere) or put (NVSHMEM puts to every other rank)",
        )
    }
}

impl LowLatencyBuffer<'_> {
    /// Create the buffer (collective). `num_sms` bounds the grid (default: every SM; the minimum
    /// over ranks is used so that all ranks run the same grid). The transport comes from
    /// `DEEPEP_LL_TRANSPORT` (default [`LlTransport::Auto`]).
    pub fn new<'g>(
        gpu: &'g Gpu,
        comm: &Comm,
        num_max: usize,
        hidden: usize,
        num_experts: usize,
        num_sms: Option<usize>,
    ) -> Result<LowLatencyBuffer<'g>> {
        Self::with_transport(gpu, comm, num_max, hidden, num_experts, num_sms, LlTransport::from_env()?)
    }

    /// [`LowLatencyBuffer::new`] with an explicit transport (collective: every rank must pass
    /// the same).
    pub fn with_transport<'g>(
        gpu: &'g Gpu,
        comm: &Comm,
        num_max: usize,
        hidden: usize,
        num_experts: usize,
        num_sms: Option<usize>,
        transport: LlTransport,
    ) -> Result<LowLatencyBuffer<'g>> {
        let r = comm.world();
        validate::low_latency_ranks(r, num_experts)?;
        // After a lost peer (nvshmem::abandon) the surviving ranks reuse NVSHMEM's world and the
        // symmetric memory kept from before: every rank of the group must be in that state.
        let survivors = comm.all_gather_u64(crate::nvshmem::survivors_only() as u64)?;
        if survivors.iter().any(|&s| s != survivors[0]) {
            let lost: Vec<usize> = (0..r).filter(|&i| survivors[i] != 0).collect();
            return Err(EpError::InvalidArgument(format!(
                "ranks {lost:?} of this group lost a peer earlier and the others did not, so they cannot share one NVSHMEM \
                 world; build the low-latency Buffer from processes that were all in the lost group, or all new"
            )));
        }
        let sms = gpu.sm_count() as usize;
        if let Some(n) = num_sms {
            if n == 0 || n > sms {
                return Err(EpError::InvalidArgument(format!(
                    "num_sms {n} for the low-latency kernels: this GPU has {sms} SMs; use 1..={sms}"
                )));
            }
        }
        let want = num_sms.unwrap_or(sms) as u64;
        let grid = comm.all_gather_u64(want)?.into_iter().min().unwrap_or(want) as usize;
        let layout = LlLayout::new(r, num_experts, num_max, hidden, grid)?;
        validate::capacity(
            "low-latency dispatch shared memory (bytes)",
            layout.dispatch_smem().max(layout.dispatch2_smem()),
            200 * 1024,
            "use fewer experts per SM (more SMs) or a smaller num_max",
        )?;
        let me = comm.rank();
        let (rt, sym, pes) = if survivors[0] != 0 {
            // every old kernel of every rank is done before anyone zeroes reused memory
            gpu.sync("before reusing the low-latency memory of a lost group")?;
            comm.barrier()?;
            let (rt, sym) = crate::nvshmem::survivor_world(layout.total_bytes)?
                .ok_or_else(|| EpError::Nvshmem("NVSHMEM's surviving world disappeared".into()))?;
            let pes: Vec<usize> = comm.all_gather_u64(rt.nv().my_pe() as u64)?.into_iter().map(|p| p as usize).collect();
            (rt, sym, pes)
        } else {
            let rt = crate::nvshmem::runtime(gpu, comm, &KnobRequest::low_latency(num_max, num_experts / r))?;
            let sym = rt.nv().clone().alloc(layout.total_bytes, ALIGN)?;
            (rt, sym, (0..r).collect())
        };
        let module = rt.module(gpu, "low_latency")?;
        gpu.memset_u8(sym.ptr(), 0, layout.total_bytes)?;
        gpu.sync("zeroing the low-latency buffer")?;
        if survivors[0] != 0 {
            comm.barrier()?;
        } else {
            rt.nv().barrier_all();
        }
        // rank i of this group is NVSHMEM PE pes[i] (the identity, except for the surviving ranks
        // of a lost group, which keep their PEs of the first world)
        let peers: Vec<u64> = (0..r)
            .map(|i| if transport == LlTransport::Put && i != me { 0 } else { sym.peer_ptr(pes[i]).unwrap_or(0) })
            .collect();
        let all_p2p = peers.iter().all(|&p| p != 0);
        if survivors[0] != 0 && !all_p2p {
            return Err(EpError::Unsupported(format!(
                "a low-latency buffer of the surviving ranks needs every peer reachable over NVLink (NVSHMEM puts address the \
                 PEs of the first world, whose numbering the survivors no longer share); PEs {pes:?}, mapped {:?}; start new \
                 processes for this group",
                peers.iter().map(|&p| p != 0).collect::<Vec<_>>()
            )));
        }
        tracing::info!(
            rank = comm.rank(),
            bytes = layout.total_bytes,
            grid,
            all_p2p,
            "low-latency buffer: {:.1} MiB symmetric, {} peers over NVLink",
            layout.total_bytes as f64 / (1 << 20) as f64,
            peers.iter().filter(|&&p| p != 0).count()
        );
        let peer_table = DeviceBuffer::from_slice(gpu, &peers)?;
        let suffix = if all_p2p { "p2p" } else { "put" };
        let dispatch_kernel = module.kernel(&ll_entry(&format!("dispatch_{suffix}"), "LlDispatchArgs"))?;
        let dispatch2_kernel = module.kernel(&ll_entry(&format!("dispatch2_{suffix}"), "LlDispatch2Args"))?;
        let combine3_kernel = module.kernel(&ll_entry(&format!("combine3_{suffix}"), "LlCombine2Args"))?;
        let combine_version = if r > 32 { CombineVersion::V1 } else { CombineVersion::from_env()? };
        let mut version = DispatchVersion::from_env()?;
        if r > 32 {
            version = DispatchVersion::V1;
        }
        let combine_kernel = module.kernel(&ll_entry(&format!("combine_{suffix}"), "LlCombineArgs"))?;
        Ok(LowLatencyBuffer {
            gpu,
            rank: comm.rank(),
            layout,
            shared: Arc::new(Shared { sym: std::mem::ManuallyDrop::new(sym), _rt: rt }),
            peer_table,
            all_p2p,
            dispatch_kernel,
            dispatch2_kernel,
            combine_kernel,
            combine3_kernel,
            version,
            combine_version,
            combine_owner_warps: combine_owner_warps_from_env()?,
            dispatch_hooked: [false; 2],
            dispatch_calls: 0,
            combine_calls: 0,
            combine_hooked: [false; 2],
            generations: [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))],
            no_owner: Arc::new(()),
            live: [std::sync::Weak::new(), std::sync::Weak::new()],
            recv_pending: [false; 2],
            stream: None,
            last: gpu.cu_stream() as u64,
            last_mark: gpu.new_mark()?,
            last_captured: false,
            mark_pending: AtomicBool::new(false),
            trace: None,
            poisoned: std::sync::Mutex::new(None),
        })
    }

    /// Refuse a call after a recorded GPU-side error (an expired wait returns without a CUDA
    /// error, so the record is the only trace of it): the first call after it returns that error,
    /// every later one says the buffer is unusable.
    fn check_usable(&self) -> Result<()> {
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = p.as_ref() {
            return Err(EpError::InvalidArgument(format!(
                "this low-latency buffer is unusable after an earlier GPU error ({why}); peers may be mid-call: recreate it on every rank"
            )));
        }
        if let Some(e) = self.gpu.take_error() {
            // a dropped bad expert id is reported once and leaves the buffer usable
            if !e.is_device_argument() {
                *p = Some(e.to_string());
            }
            return Err(e);
        }
        Ok(())
    }

    pub fn layout(&self) -> &LlLayout {
        &self.layout
    }
    /// Whether every peer is reached by NVLink stores (else NVSHMEM puts are used for some).
    pub fn all_p2p(&self) -> bool {
        self.all_p2p
    }
    pub fn grid(&self) -> usize {
        self.layout.grid
    }
    pub fn dispatch_version(&self) -> DispatchVersion {
        self.version
    }
    pub fn combine_version(&self) -> CombineVersion {
        self.combine_version
    }
    pub fn combine_owner_warps(&self) -> usize {
        self.combine_owner_warps
    }
    /// Combine v3: how many of the 16 warps of each block compute and send the partial rows of
    /// other origins while the other warps reduce this rank's tokens at the same time (1..15), or
    /// 0 for no split (every warp first sends, then reduces). Only launches with both halves split
    /// (a hook's send and receive kernels use every warp). Collective: every rank must choose the
    /// same.
    pub fn set_combine_owner_warps(&mut self, n: usize) -> Result<()> {
        if n >= LL_WARPS {
            return Err(EpError::InvalidArgument(format!(
                "low-latency combine owner warps {n}: use 0 (no split) to {} warps of the {LL_WARPS} per block",
                LL_WARPS - 1
            )));
        }
        self.combine_owner_warps = n;
        Ok(())
    }
    /// Diagnostic hook: record phase timestamps of every combine and v2 dispatch kernel (read the
    /// last one with [`LowLatencyBuffer::last_trace`]). Adds three small memsets per call; off by
    /// default.
    pub fn set_tracing(&mut self, on: bool) -> Result<()> {
        self.trace = if on { Some(DeviceBuffer::zeroed(self.gpu, LL_TRACE_SLOTS * 8)?) } else { None };
        Ok(())
    }

    /// Preset the trace slots before a traced kernel (start and first-wait: minimum, others: maximum).
    fn reset_trace(&self, s: sys::CUstream) -> Result<()> {
        if let Some(t) = &self.trace {
            self.gpu.memset_u8_in(t.ptr(), 0xff, 8, s)?;
            self.gpu.memset_u8_in(t.ptr() + 8, 0, (LL_TRACE_SLOTS - 1) * 8, s)?;
            self.gpu.memset_u8_in(t.ptr() + 3 * 8, 0xff, 8, s)?;
        }
        Ok(())
    }

    /// Diagnostic hook: phase times of the last traced combine or v2 dispatch (waits for the
    /// stream): sent, local, waited_first, waited, end (see [`TracePhase`]); `None` when tracing
    /// is off.
    pub fn last_trace(&self) -> Result<Option<PhaseTrace>> {
        let Some(t) = &self.trace else { return Ok(None) };
        self.order_after_calls(self.gpu.cu_stream())?;
        self.gpu.sync("reading the low-latency trace")?;
        let v = t.download::<u64>(self.gpu, LL_TRACE_SLOTS)?;
        Ok(Some(PhaseTrace::decode(&v, &LL_TRACE_PHASES)))
    }

    /// Choose the combine kernel (collective). v3 is used only with handles of v2 dispatches
    /// (v1 otherwise) and needs at most 32 ranks.
    pub fn set_combine_version(&mut self, v: CombineVersion) -> Result<()> {
        if v != CombineVersion::V1 && self.layout.num_ranks > 32 {
            return Err(EpError::Unsupported(format!(
                "low-latency combine {v:?} supports at most 32 ranks, this buffer has {}; use v1",
                self.layout.num_ranks
            )));
        }
        self.combine_version = v;
        Ok(())
    }
    /// Choose the dispatch kernel (collective: every rank must choose the same). v2 needs at
    /// most 32 ranks.
    pub fn set_dispatch_version(&mut self, v: DispatchVersion) -> Result<()> {
        if v == DispatchVersion::V2 && self.layout.num_ranks > 32 {
            return Err(EpError::Unsupported(format!(
                "low-latency dispatch v2 supports at most 32 ranks, this buffer has {}; use v1",
                self.layout.num_ranks
            )));
        }
        self.version = v;
        Ok(())
    }

    fn base(&self) -> u64 {
        self.shared.sym.ptr()
    }

    /// Diagnostic hook (GPU tests, `deepep-kernels-harness`): fill this rank's dispatch output regions of both halves (received rows,
    /// scales, source info, layout ranges, counts) with the 32-bit word `word`, ordered on this
    /// rank's stream. Peers write into them during their next dispatch: every rank must call this,
    /// synchronize, and meet the others (a barrier) before any rank dispatches again.
    pub fn fill_outputs(&self, word: u32) -> Result<()> {
        self.order_after_calls(self.gpu.cu_stream())?;
        let lay = &self.layout;
        let (l, r, rnm, h, s) = (lay.num_local_experts(), lay.num_ranks, lay.num_ranks * lay.num_max, lay.hidden, lay.hidden / 128);
        for d in &lay.dispatch {
            for (off, bytes) in [(d.x, l * rnm * 2 * h), (d.scales, l * s * rnm * 4), (d.src_info, l * rnm * 4), (d.layout_range, l * r * 8), (d.recv_count, l * 4)] {
                self.gpu.memset_u32(self.base() + off as u64, word, bytes / 4)?;
            }
        }
        Ok(())
    }

    fn view(&self, off: usize, dtype: DType, shape: &[usize], half: usize, generation: u64) -> Tensor {
        self.view_kept(self.shared.clone(), off, dtype, shape, half, generation)
    }

    /// [`LowLatencyBuffer::view`] keeping `keep` alive instead of the symmetric memory.
    fn view_kept(&self, keep: Arc<dyn std::any::Any + Send + Sync>, off: usize, dtype: DType, shape: &[usize], half: usize, generation: u64) -> Tensor {
        Tensor::view(
            self.gpu.stream(),
            keep,
            self.base() + off as u64,
            dtype,
            shape,
            Some(Generation {
                counter: self.generations[half].clone(),
                expected: generation,
                overwritten_by: "a later low-latency dispatch on this buffer (only the two most recent stay valid)",
            }),
        )
    }

    /// Before a dispatch into `half`: if the handle of the previous dispatch into it is still
    /// alive, give it its own copy of the routing (stream-ordered, before the launch). Not inside a
    /// CUDA graph capture (the copy would be replayed over it on every replay), and not while that
    /// dispatch's receive hook is pending (its routing is incomplete); combine then refuses it.
    fn keep_live_handle(&mut self, half: usize, s: sys::CUstream) -> Result<()> {
        let Some(cell) = std::mem::take(&mut self.live[half]).upgrade() else { return Ok(()) };
        if self.recv_pending[half] || cell.get().is_some() || self.gpu.capturing(s)? {
            return Ok(());
        }
        let d = &self.layout.dispatch[half];
        let spans = [(d.src_info, d.send_slot + self.layout.num_max * LL_MAX_TOPK * 4), (d.tok_slot, d.ntok + self.layout.num_ranks * 4)];
        let len0 = (spans[0].1 - spans[0].0).next_multiple_of(ALIGN);
        let total = len0 + (spans[1].1 - spans[1].0);
        // The copy lives on the Gpu's stream (its stream-ordered free too): that stream waits for
        // the calls so far, copies, and the launch stream waits for the copy.
        let own = self.gpu.cu_stream();
        self.gpu.stream_wait(own, s)?;
        let mem = Tensor::empty(self.gpu.stream(), DType::U8, &[total])?;
        self.gpu.copy_dtod(mem.ptr(), self.base() + spans[0].0 as u64, spans[0].1 - spans[0].0)?;
        self.gpu.copy_dtod(mem.ptr() + len0 as u64, self.base() + spans[1].0 as u64, spans[1].1 - spans[1].0)?;
        self.gpu.stream_wait(s, own)?;
        let regions = HandleRegions {
            base: mem.ptr(),
            src_info: 0,
            src_k: d.src_k - d.src_info,
            layout_range: d.layout_range - d.src_info,
            recv_count: d.recv_count - d.src_info,
            send_slot: d.send_slot - d.src_info,
            tok_slot: len0,
            ntok: len0 + (d.ntok - d.tok_slot),
        };
        let _ = cell.set(Arc::new(HandleCopy { mem, regions }));
        Ok(())
    }

    /// Launch the following calls on the raw stream `stream` of this GPU's context (None: the
    /// Gpu's own stream, the default). Calls stay ordered among themselves whichever stream each
    /// uses: a call on another stream than the previous call's first makes its stream wait for
    /// that one (not across the boundary of a CUDA graph capture, where such a wait is invalid).
    pub fn set_stream(&mut self, stream: Option<sys::CUstream>) {
        self.stream = stream.map(|s| s as u64);
    }

    /// `waiter` (a raw stream of this GPU's context) waits for every call made so far, whichever
    /// stream it ran on (e.g. the Gpu's stream before a host sync of it).
    pub fn order_after_calls(&self, waiter: sys::CUstream) -> Result<()> {
        if waiter as u64 == self.last || self.gpu.capturing(waiter)? != self.last_captured {
            return Ok(());
        }
        self.flush_mark()?;
        self.gpu.wait_mark(waiter, self.last_mark)
    }

    /// Record the last launch's pending mark on its stream (see `mark_pending`).
    fn flush_mark(&self) -> Result<()> {
        if self.mark_pending.swap(false, Ordering::Relaxed) {
            self.gpu.bind()?;
            self.gpu.mark(self.last_mark, self.last as sys::CUstream)?;
        }
        Ok(())
    }

    /// Whether `s` lives as long as this buffer whoever made the call: the legacy default stream
    /// (0, or `CU_STREAM_LEGACY`) or the Gpu's own. (Not the per-thread default stream, which
    /// is another stream on another thread, nor a caller's stream, which its owner may destroy.)
    fn outlives_calls(&self, s: sys::CUstream) -> bool {
        matches!(s as u64, 0 | 1) || s == self.gpu.cu_stream()
    }

    /// The stream of this call, after ordering it behind the previous call. A capturing stream
    /// may not wait for work outside its capture (nor the reverse): across that boundary the
    /// caller orders the calls (torch synchronises before a capture).
    fn enter(&mut self) -> Result<sys::CUstream> {
        let s = launch_stream(self.stream, self.gpu.cu_stream() as u64) as sys::CUstream;
        let captured = self.gpu.capturing(s)?;
        if s as u64 != self.last {
            if captured == self.last_captured {
                self.flush_mark()?;
                self.gpu.wait_mark(s, self.last_mark)?;
            } else {
                // across a capture's boundary the caller orders the calls (no record on the old
                // stream: on the legacy one it would break a capture in global mode)
                self.mark_pending.store(false, Ordering::Relaxed);
            }
        }
        self.last = s as u64;
        self.last_captured = captured;
        Ok(s)
    }

    /// Launch one of our kernels on `s` (from [`LowLatencyBuffer::enter`]) and mark it: the next
    /// call on another stream waits for that mark.
    fn go(&self, k: &Kernel, smem: usize, args: Args, s: sys::CUstream) -> Result<()> {
        self.gpu.launch_in(k, &self.launch_cfg(smem), args, s)?;
        if !self.last_captured && self.outlives_calls(s) {
            self.mark_pending.store(true, Ordering::Relaxed);
            return Ok(());
        }
        self.mark_pending.store(false, Ordering::Relaxed);
        self.gpu.mark(self.last_mark, s)
    }

    fn launch_cfg(&self, smem: usize) -> LaunchCfg {
        LaunchCfg::new(self.layout.grid as u32, LL_THREADS).smem(smem as u32).cooperative(true)
    }

    /// LL dispatch of `x` (bf16 `[N, H]`, N ≤ num_max) routed by `topk_idx` (i64 `[N, K]`,
    /// K ≤ 11, −1 = unused, no expert twice in a row). See the module docs for the outputs.
    pub fn dispatch(&mut self, x: &Tensor, topk_idx: &Tensor, opts: LlDispatchOpts) -> Result<LlDispatchOut> {
        self.check_usable()?;
        let (n, k) = check_tokens(x, topk_idx, &self.layout)?;
        validate::low_latency_hidden(self.layout.hidden, opts.use_fp8, None)?;
        if opts.use_fp8 {
            validate::fp8_flags(opts.round_scale, opts.use_ue8m0)?;
        } else if opts.round_scale || opts.use_ue8m0 {
            return Err(EpError::InvalidArgument(
                "round_scale / use_ue8m0 only apply to FP8 dispatch; set use_fp8 or clear them".into(),
            ));
        }
        // Every check passed: the next dispatch goes into this half.
        let stream = self.enter()?;
        let half = (self.dispatch_calls % 2) as usize;
        self.keep_live_handle(half, stream)?;
        let lay = &self.layout;
        self.dispatch_calls += 1;
        let generation = self.generations[half].fetch_add(1, Ordering::AcqRel) + 1;
        let d = lay.dispatch[half];
        let args = LlDispatchArgs {
            x: x.ptr(),
            topk_idx: topk_idx.ptr(),
            buf: self.base(),
            peer_base: self.peer_table.ptr(),
            off_x: d.x as u64,
            off_scale_stage: d.scale_stage as u64,
            off_scales: d.scales as u64,
            off_src_info: d.src_info as u64,
            off_src_k: d.src_k as u64,
            off_layout_range: d.layout_range as u64,
            off_recv_count: d.recv_count as u64,
            off_count_sig: d.count_sig as u64,
            off_done_sig: d.done_sig as u64,
            off_epoch: d.epoch as u64,
            off_send_slot: d.send_slot as u64,
            off_stage: lay.stage as u64,
            num_tokens: n as i32,
            hidden: lay.hidden as i32,
            num_topk: k as i32,
            num_experts: lay.num_experts as i32,
            num_ranks: lay.num_ranks as i32,
            rank: self.rank as i32,
            num_max: lay.num_max as i32,
            phases: if opts.return_hook { PHASE_SEND } else { PHASE_SEND | PHASE_RECV },
            use_fp8: opts.use_fp8 as i32,
            round_scale: opts.round_scale as i32,
            use_ue8m0: opts.use_ue8m0 as i32,
            experts_per_block: lay.experts_per_block() as i32,
        };
        let hook = match self.version {
            DispatchVersion::V1 => {
                self.go(&self.dispatch_kernel, lay.dispatch_smem(), Args::new().arg(args), stream)?;
                LlHook::Dispatch(LlDispatchArgs { phases: PHASE_RECV, ..args })
            }
            DispatchVersion::V2 => {
                let a2 = LlDispatch2Args {
                    x: args.x,
                    topk_idx: args.topk_idx,
                    buf: args.buf,
                    peer_base: args.peer_base,
                    off_x: args.off_x,
                    off_scales: args.off_scales,
                    off_src_info: args.off_src_info,
                    off_src_k: args.off_src_k,
                    off_layout_range: args.off_layout_range,
                    off_recv_count: args.off_recv_count,
                    off_epoch: args.off_epoch,
                    off_send_slot: args.off_send_slot,
                    off_tok_stage: d.tok_stage as u64,
                    off_tok_flags: d.tok_flags as u64,
                    off_ready: d.ready as u64,
                    off_tok_slot: d.tok_slot as u64,
                    off_ntok: d.ntok as u64,
                    off_stage: args.off_stage,
                    num_tokens: args.num_tokens,
                    hidden: args.hidden,
                    num_topk: args.num_topk,
                    num_experts: args.num_experts,
                    num_ranks: args.num_ranks,
                    rank: args.rank,
                    num_max: args.num_max,
                    phases: args.phases,
                    use_fp8: args.use_fp8,
                    round_scale: args.round_scale,
                    use_ue8m0: args.use_ue8m0,
                    wait_ready: self.dispatch_hooked.iter().any(|&h| h) as i32,
                    stage_stride: lay.stage_stride() as i32,
                    tk_off: lay.tk_off() as i32,
                    trace: self.trace.as_ref().map_or(0, |t| t.ptr()),
                };
                self.reset_trace(stream)?;
                self.go(&self.dispatch2_kernel, lay.dispatch2_smem(), Args::new().arg(a2), stream)?;
                LlHook::Dispatch2(LlDispatch2Args { phases: PHASE_RECV, ..a2 })
            }
        };
        self.dispatch_hooked = [self.dispatch_hooked[1], opts.return_hook];
        let (l, rnm, h) = (lay.num_local_experts(), lay.num_ranks * lay.num_max, lay.hidden);
        let x_dtype = if opts.use_fp8 { DType::Fp8E4m3 } else { DType::Bf16 };
        let packed_recv_x = self.view(d.x, x_dtype, &lay.recv_x_shape(), half, generation);
        let packed_recv_x_scales = opts.use_fp8.then(|| {
            let (dtype, shape) = lay.recv_scales_layout(opts.use_ue8m0);
            self.view(d.scales, dtype, &shape, half, generation)
        });
        let copy = Arc::new(CopyCell::new());
        let handle = LlHandle {
            half,
            generation,
            version: self.version,
            num_tokens: n,
            num_topk: k,
            hidden: h,
            src_info: self.view_kept(self.no_owner.clone(), d.src_info, DType::I32, &[l, rnm], half, generation),
            layout_range: self.view_kept(self.no_owner.clone(), d.layout_range, DType::I64, &[l, lay.num_ranks], half, generation),
            copy: copy.clone(),
        };
        self.live[half] = Arc::downgrade(&copy);
        self.recv_pending[half] = opts.return_hook;
        Ok(LlDispatchOut {
            packed_recv_x,
            packed_recv_x_scales,
            packed_recv_count: self.view(d.recv_count, DType::I32, &[l], half, generation),
            handle,
            hook: opts.return_hook.then_some(hook),
        })
    }

    /// LL combine: `y` bf16 `[L, R·num_max, H]` (rows aligned with the dispatch output of
    /// `handle`), this rank's original `topk_idx` / `topk_weights` `[N, K]` as given to that
    /// dispatch. Returns `out[t] = bf16(Σ_k w[t,k] · y_owner[row of (t,k)])` (f32 accumulation).
    pub fn combine(
        &mut self,
        y: &Tensor,
        topk_idx: &Tensor,
        topk_weights: &Tensor,
        handle: &LlHandle,
        return_hook: bool,
    ) -> Result<LlCombineOut> {
        let out = Tensor::empty(self.gpu.stream(), DType::Bf16, &[handle.num_tokens, self.layout.hidden])?;
        self.combine_into(y, topk_idx, topk_weights, handle, &out, return_hook)
    }

    /// [`LowLatencyBuffer::combine`] into a caller-provided bf16 `[N, H]` tensor (no allocation
    /// per call, e.g. inside a captured CUDA graph).
    pub fn combine_into(
        &mut self,
        y: &Tensor,
        topk_idx: &Tensor,
        topk_weights: &Tensor,
        handle: &LlHandle,
        out: &Tensor,
        return_hook: bool,
    ) -> Result<LlCombineOut> {
        self.check_usable()?;
        let stream = self.enter()?;
        let lay = &self.layout;
        let hr = if self.generations[handle.half].load(Ordering::Acquire) == handle.generation {
            HandleRegions::in_half(self.base(), &lay.dispatch[handle.half])
        } else if let Some(c) = handle.copy.get() {
            c.regions
        } else {
            return Err(EpError::InvalidArgument(
                "LL combine: the handle's dispatch half was reused by a later dispatch before its routing could be kept \
                 (that dispatch ran inside a CUDA graph capture, or the handle's receive hook had not run yet); combine \
                 before dispatching twice more, or call the hook first"
                    .into(),
            ));
        };
        let (l, rnm, h) = (lay.num_local_experts(), lay.num_ranks * lay.num_max, lay.hidden);
        expect("y", y, DType::Bf16, &[l, rnm, h], "the expert outputs in the dispatch's packed layout")?;
        let (n, k) = (handle.num_tokens, handle.num_topk);
        expect("topk_idx", topk_idx, DType::I64, &[n, k], "the same top-k ids as passed to the dispatch")?;
        expect("topk_weights", topk_weights, DType::F32, &[n, k], "one gate weight per top-k slot")?;
        expect("out", out, DType::Bf16, &[n, h], "the combined tokens of this rank")?;
        let half = (self.combine_calls % 2) as usize;
        self.combine_calls += 1;
        let c = lay.combine[half];
        let args = LlCombineArgs {
            y: y.ptr(),
            topk_idx: topk_idx.ptr(),
            topk_weights: topk_weights.ptr(),
            out: out.ptr(),
            buf: self.base(),
            peer_base: self.peer_table.ptr(),
            hbuf: hr.base,
            off_src_info: hr.src_info as u64,
            off_src_k: hr.src_k as u64,
            off_layout_range: hr.layout_range as u64,
            off_recv_count: hr.recv_count as u64,
            off_send_slot: hr.send_slot as u64,
            off_comb_recv: c.recv as u64,
            off_comb_done: c.done as u64,
            off_comb_ready: c.ready as u64,
            off_epoch: c.epoch as u64,
            off_stage: lay.stage as u64,
            num_tokens: n as i32,
            hidden: h as i32,
            num_topk: k as i32,
            num_experts: lay.num_experts as i32,
            num_ranks: lay.num_ranks as i32,
            rank: self.rank as i32,
            num_max: lay.num_max as i32,
            phases: if return_hook { PHASE_SEND } else { PHASE_SEND | PHASE_RECV },
            local_experts_per_block: lay.local_experts_per_block() as i32,
            wait_ready: self.combine_hooked.iter().any(|&h| h) as i32,
            trace: self.trace.as_ref().map_or(0, |t| t.ptr()),
        };
        self.reset_trace(stream)?;
        self.combine_hooked = [self.combine_hooked[1], return_hook];
        let use_v3 = self.combine_version == CombineVersion::V3 && handle.version == DispatchVersion::V2;
        let hook = if use_v3 {
            let a2 = LlCombine2Args {
                y: args.y,
                topk_idx: args.topk_idx,
                topk_weights: args.topk_weights,
                out: args.out,
                buf: args.buf,
                peer_base: args.peer_base,
                hbuf: hr.base,
                off_send_slot: hr.send_slot as u64,
                off_tok_slot: hr.tok_slot as u64,
                off_ntok: hr.ntok as u64,
                off_part: c.part as u64,
                off_comb_done: c.done as u64,
                off_wts: c.wts as u64,
                off_wts_flag: c.wts_flag as u64,
                off_epoch: c.epoch as u64,
                off_stage: lay.stage as u64,
                num_tokens: args.num_tokens,
                hidden: args.hidden,
                num_topk: args.num_topk,
                num_experts: args.num_experts,
                num_ranks: args.num_ranks,
                rank: args.rank,
                num_max: args.num_max,
                phases: args.phases,
                owner_warps: self.combine_owner_warps as i32,
                pad_: 0,
                trace: args.trace,
            };
            let recv_half = LlCombine2Args { phases: PHASE_RECV, ..a2 };
            self.go(&self.combine3_kernel, combine2_smem(&a2), Args::new().arg(a2), stream)?;
            LlHook::Combine3(recv_half)
        } else {
            self.go(&self.combine_kernel, lay.combine_smem(), Args::new().arg(args), stream)?;
            LlHook::Combine(LlCombineArgs { phases: PHASE_RECV, ..args })
        };
        if handle.copy.get().is_some() {
            // The handle's copy is freed stream-ordered on the Gpu's stream: after this read.
            self.gpu.stream_wait(self.gpu.cu_stream(), stream)?;
        }
        Ok(LlCombineOut { combined_x: out.clone(), hook: return_hook.then_some(hook) })
    }

    /// Launch the receive half of a call made with a hook (in call order per kind).
    pub fn recv(&mut self, hook: LlHook) -> Result<()> {
        self.check_usable()?;
        let off_x = match &hook {
            LlHook::Dispatch(a) => Some(a.off_x),
            LlHook::Dispatch2(a) => Some(a.off_x),
            _ => None,
        };
        if let Some(half) = off_x.and_then(|x| self.layout.dispatch_half_at(x)) {
            self.recv_pending[half] = false;
        }
        let s = self.enter()?;
        match hook {
            LlHook::Dispatch(a) => {
                self.go(&self.dispatch_kernel, self.layout.dispatch_smem(), Args::new().arg(a), s)
            }
            LlHook::Dispatch2(a) => {
                self.go(&self.dispatch2_kernel, self.layout.dispatch2_smem(), Args::new().arg(a), s)
            }
            LlHook::Combine3(a) => self.go(&self.combine3_kernel, combine2_smem(&a), Args::new().arg(a), s),
            LlHook::Combine(a) => self.go(&self.combine_kernel, self.layout.combine_smem(), Args::new().arg(a), s),
        }
    }
}

impl Drop for LowLatencyBuffer<'_> {
    fn drop(&mut self) {
        // Collective: our kernels must be done and every peer past its last call before the
        // symmetric memory is freed (nvshmem_free is collective too).
        if let Err(e) = self.order_after_calls(self.gpu.cu_stream()).and_then(|_| self.gpu.sync("dropping the low-latency buffer")) {
            tracing::warn!("low-latency buffer drop: {e}");
        }
        // After a lost peer (nvshmem::abandon) nothing collective runs: the memory is kept for
        // the surviving ranks (Shared's drop), whose destroy() meets through their own group.
        if !crate::nvshmem::survivors_only() {
            self.shared.sym.nvshmem().barrier_all();
        }
        // every view of a half (the handles' too) is invalid from now on
        for g in &self.generations {
            g.store(RELEASED, Ordering::Release);
        }
        self.gpu.drop_mark(self.last_mark);
    }
}

/// The raw stream a call launches on: the one [`LowLatencyBuffer::set_stream`] chose, else the
/// Gpu's own (`own`). `Some(0)` is the legacy default stream (torch's default stream), a real
/// choice, not "none".
fn launch_stream(chosen: Option<u64>, own: u64) -> u64 {
    chosen.unwrap_or(own)
}

/// The generation of both halves once the buffer is dropped (no dispatch reaches it).
const RELEASED: u64 = u64::MAX;

/// `LL_ORIGIN_BATCH` of `low_latency.cuh`.
pub const LL_ORIGIN_BATCH: usize = 8;
// The largest launch (every warp an origin warp) fits H200's 227 KiB of shared memory per block.
const _: () = assert!(LL_WARPS * LL_ORIGIN_BATCH * 256 * 4 + 16 * 1024 <= 227 * 1024);

/// Dynamic shared memory of a combine v3 launch: the origin warps' own-term accumulators
/// (`LL_ORIGIN_BATCH` units of 256 f32 channels per origin warp); none without a receive half.
pub fn combine2_smem(a: &LlCombine2Args) -> usize {
    if a.phases & PHASE_RECV == 0 {
        return 0;
    }
    let split = a.phases & PHASE_SEND != 0 && a.owner_warps > 0 && (a.owner_warps as usize) < LL_WARPS;
    let origin_warps = if split { LL_WARPS - a.owner_warps as usize } else { LL_WARPS };
    origin_warps * LL_ORIGIN_BATCH * 256 * 4
}

fn expect(what: &str, t: &Tensor, dtype: DType, shape: &[usize], meaning: &str) -> Result<()> {
    t.check_valid()?;
    if t.dtype() != dtype || t.shape() != shape || !t.is_contiguous() {
        return Err(EpError::InvalidArgument(format!(
            "LL: {what} must be a contiguous {} tensor of shape {shape:?} ({meaning}), got {} {:?}{}",
            dtype.name(),
            t.dtype().name(),
            t.shape(),
            if t.is_contiguous() { "" } else { " (not contiguous)" }
        )));
    }
    Ok(())
}

/// Shapes of the dispatch inputs; returns (N, K).
fn check_tokens(x: &Tensor, topk_idx: &Tensor, lay: &LlLayout) -> Result<(usize, usize)> {
    let (n, h) = match x.shape() {
        [n, h] => (*n, *h),
        s => return Err(EpError::InvalidArgument(format!("LL dispatch: x must be 2-D [tokens, hidden], got shape {s:?}"))),
    };
    if h != lay.hidden {
        return Err(EpError::InvalidArgument(format!(
            "LL dispatch: x has hidden {h} but the buffer was created for hidden {}; create a buffer for this hidden size",
            lay.hidden
        )));
    }
    validate::tokens_within(n, lay.num_max, "LL dispatch")?;
    expect("x", x, DType::Bf16, &[n, h], "the tokens of this rank")?;
    let k = match topk_idx.shape() {
        [tn, k] if *tn == n => *k,
        s => {
            return Err(EpError::InvalidArgument(format!(
                "LL dispatch: topk_idx must be [{n}, K] (one row per token of x), got shape {s:?}"
            )))
        }
    };
    validate::num_topk(k, LL_MAX_TOPK)?;
    expect("topk_idx", topk_idx, DType::I64, &[n, k], "global expert ids, -1 = unused")?;
    Ok((n, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_legacy_default_stream_is_a_stream_choice() {
        // torch's default stream is the raw handle 0: choosing it must not fall back to the Gpu's
        // stream (514f131 did, and those calls ran unordered on the comm stream: call D)
        assert_eq!(launch_stream(Some(0), 0x7f00), 0);
        assert_eq!(launch_stream(Some(0x1234), 0x7f00), 0x1234);
        assert_eq!(launch_stream(None, 0x7f00), 0x7f00);
    }

    #[test]
    fn dispatch_version_defaults_to_v2() {
        assert_eq!(DispatchVersion::parse(None).unwrap(), DispatchVersion::V2);
        assert_eq!(DispatchVersion::parse(Some("V1")).unwrap(), DispatchVersion::V1);
        let e = DispatchVersion::parse(Some("v3")).unwrap_err().to_string();
        assert!(e.contains("DEEPEP_LL_DISPATCH=\"v3\"") && e.contains("v1 or v2"), "{e}");
    }

    #[test]
    fn transport_defaults_to_auto_and_refuses_unknown_names() {
        assert_eq!(LlTransport::parse(None).unwrap(), LlTransport::Auto);
        assert_eq!(LlTransport::parse(Some("put")).unwrap(), LlTransport::Put);
        let e = LlTransport::parse(Some("ibgda")).unwrap_err().to_string();
        assert!(e.contains("DEEPEP_LL_TRANSPORT") && e.contains("auto") && e.contains("put"), "{e}");
    }

    #[test]
    fn combine_version_defaults_to_v3_and_refuses_unknown_names() {
        assert_eq!(CombineVersion::parse(None).unwrap(), CombineVersion::V3);
        assert_eq!(CombineVersion::parse(Some(" ")).unwrap(), CombineVersion::V3);
        assert_eq!(CombineVersion::parse(Some("v1")).unwrap(), CombineVersion::V1);
        assert_eq!(CombineVersion::parse(Some("V3")).unwrap(), CombineVersion::V3);
        let e = CombineVersion::parse(Some("v4")).unwrap_err().to_string();
        assert!(e.contains("DEEPEP_LL_COMBINE") && e.contains("v1 or v3"), "{e}");
    }

    #[test]
    fn retired_combine_v2_is_refused_with_the_fix() {
        for v in ["v2", " V2 "] {
            let e = CombineVersion::parse(Some(v)).unwrap_err().to_string();
            assert!(e.contains("DEEPEP_LL_COMBINE") && e.contains("retired") && e.contains("use v3"), "{e}");
        }
    }

    #[test]
    fn owner_warps_default_range_and_errors() {
        assert_eq!(parse_combine_owner_warps(None).unwrap(), DEFAULT_COMBINE_OWNER_WARPS);
        assert_eq!(parse_combine_owner_warps(Some("0")).unwrap(), 0);
        assert_eq!(parse_combine_owner_warps(Some(" 15 ")).unwrap(), 15);
        for bad in ["16", "-1", "eight"] {
            let e = parse_combine_owner_warps(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("DEEPEP_LL_OWNER_WARPS") && e.contains("0 (no split") && e.contains("15"), "{e}");
        }
    }

    #[test]
    fn combine2_smem_covers_the_origin_warps_of_each_launch() {
        let both = LlCombine2Args { phases: PHASE_SEND | PHASE_RECV, owner_warps: 8, ..Default::default() };
        assert_eq!(combine2_smem(&both), 8 * LL_ORIGIN_BATCH * 1024);
        // No split: every warp is an origin warp after its owner work.
        assert_eq!(combine2_smem(&LlCombine2Args { owner_warps: 0, ..both }), 16 * LL_ORIGIN_BATCH * 1024);
        // A hook's receive half uses every warp; its send half needs none.
        assert_eq!(combine2_smem(&LlCombine2Args { phases: PHASE_RECV, ..both }), 16 * LL_ORIGIN_BATCH * 1024);
        assert_eq!(combine2_smem(&LlCombine2Args { phases: PHASE_SEND, ..both }), 0);
    }

    #[test]
    fn output_shapes_and_halves_at_deepeps_shape() {
        // 2 ranks, 288 experts (144 local), 128 tokens, hidden 7168 (56 scale groups)
        let lay = LlLayout::new(2, 288, 128, 7168, 132).unwrap();
        assert_eq!(lay.recv_x_shape(), [144, 256, 7168]);
        assert_eq!(lay.recv_scales_layout(false), (DType::F32, [144, 56, 256]));
        assert_eq!(lay.recv_scales_layout(true), (DType::I32, [144, 14, 256]));
        for (half, d) in lay.dispatch.iter().enumerate() {
            assert_eq!(lay.dispatch_half_at(d.x as u64), Some(half));
            assert_eq!(lay.dispatch_half_at(d.scales as u64), None);
        }
    }

    #[test]
    fn layout_regions_are_aligned_disjoint_and_sized() {
        let lay = LlLayout::new(2, 288, 128, 7168, 132).unwrap();
        assert_eq!(lay.num_local_experts(), 144);
        assert_eq!(lay.experts_per_block(), 3);
        assert_eq!(lay.local_experts_per_block(), 2);
        let d = lay.dispatch[0];
        let mut offs = vec![
            (d.x, 144 * 256 * 2 * 7168),
            (d.scale_stage, 144 * 256 * 56 * 4),
            (d.scales, 144 * 56 * 256 * 4),
            (d.src_info, 144 * 256 * 4),
            (d.src_k, 144 * 256 * 4),
            (d.layout_range, 144 * 2 * 8),
            (d.recv_count, 144 * 4),
            (d.count_sig, 288 * 2 * 8),
            (d.done_sig, 144 * 2 * 8),
            (d.epoch, 132 * 4),
            (d.send_slot, 128 * 11 * 4),
        ];
        let d1 = lay.dispatch[1];
        offs.push((d1.x, 144 * 256 * 2 * 7168));
        offs.push((d1.epoch, 132 * 4));
        for dh in lay.dispatch {
            offs.push((dh.tok_stage, 2 * 128 * lay.stage_stride()));
            offs.push((dh.tok_flags, 2 * 132 * 8));
            offs.push((dh.ready, 2 * 8));
        }
        for dh in lay.dispatch {
            offs.push((dh.tok_slot, 2 * 128 * 11 * 4));
            offs.push((dh.ntok, 2 * 4));
        }
        for c in lay.combine {
            offs.push((c.part, 128 * 2 * 7168 * 4));
            offs.push((c.wts, 2 * 128 * 11 * 4));
            offs.push((c.wts_flag, 2 * 8));
            offs.push((c.recv, 128 * 11 * 2 * 7168));
            offs.push((c.done, 2 * 132 * 8));
            offs.push((c.ready, 2 * 8));
            offs.push((c.epoch, 132 * 4));
        }
        offs.push((lay.stage, 132 * 16 * LL_STAGE_BYTES));
        offs.sort();
        for w in offs.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {w:?}");
        }
        for (o, size) in &offs {
            assert_eq!(o % ALIGN, 0);
            assert!(o + size <= lay.total_bytes);
        }
        // Both dispatch halves have the same shape.
        assert_eq!(d1.x - d.x, d1.epoch - d.epoch);
        // ~1.1 GB for DeepEP's default shape (DeepEP itself needs 2.15 GB).
        assert!(lay.total_bytes < 1_200_000_000, "{}", lay.total_bytes);
    }

    #[test]
    fn layout_refuses_bad_shapes() {
        assert!(LlLayout::new(2, 287, 128, 7168, 132).unwrap_err().to_string().contains("288"));
        assert!(LlLayout::new(2, 288, 0, 7168, 132).is_err());
        assert!(LlLayout::new(2, 288, 128, 7000, 132).unwrap_err().to_string().contains("7040"));
        assert!(LlLayout::new(2, 288, 128, 7168, 0).is_err());
    }

    #[test]
    fn v2_token_entry_holds_row_scales_and_topk() {
        for h in [2048usize, 4096, 7040, 7168] {
            let lay = LlLayout::new(2, 64, 8, h, 4).unwrap();
            assert!(lay.tk_off() >= 2 * h + h / 128 * 4, "{h}");
            assert_eq!(lay.tk_off() % 16, 0);
            assert!(lay.stage_stride() >= lay.tk_off() + LL_MAX_TOPK * 4);
            assert_eq!(lay.stage_stride() % ALIGN, 0);
        }
        let lay = LlLayout::new(2, 288, 128, 7168, 132).unwrap();
        assert_eq!(lay.dispatch2_smem(), (2 * 2 * 2 + 2 + 2 + 2 * 2 * 128) * 4);
    }

    #[test]
    fn dispatch_smem_fits_default_shapes() {
        let lay = LlLayout::new(2, 288, 256, 7168, 132).unwrap();
        assert_eq!(lay.dispatch_smem(), (2 * 3 + 3 * 256 + 2 * 2 + 2) * 4);
    }
}
