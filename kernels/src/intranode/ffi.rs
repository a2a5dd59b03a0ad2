//! `#[repr(C)]` mirrors of the kernel argument structs in `cuda/intranode.cuh`. Pointers are
//! device addresses as `u64` (0 = null). Sizes are asserted at compile time against the header's
//! own `static_assert`s.

use crate::config::BufferLayout;

/// Mirror of `IntranodeArgs` (216 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IntranodeArgs {
    pub peer_base: [u64; 8],
    pub off_ready: u64,
    pub off_dispatch_rows: u64,
    pub off_notify_rank: u64,
    pub off_notify_expert: u64,
    pub off_stage_flag: u64,
    pub off_recv_x: u64,
    pub off_recv_scales: u64,
    pub off_recv_topk_idx: u64,
    pub off_recv_topk_w: u64,
    pub off_recv_src_idx: u64,
    pub off_stage_x: u64,
    pub off_stage_w: u64,
    pub stage_x_slot_bytes: u64,
    pub stage_w_slot_bytes: u64,
    /// 0, or the device address of `u64[TRACE_SLOTS]` phase timestamps.
    pub trace: u64,
    /// u64 `[R]`: from rank s, `(epoch << 32) | (region >> 9)`, where s's dispatch of that epoch
    /// wants its rows (0: the fixed receive regions).
    pub off_recv_target: u64,
    pub rank: i32,
    pub num_ranks: i32,
    pub max_tokens: i32,
    pub max_local_experts: i32,
    pub epoch: u32,
    pub pad_: i32,
}

/// Mirror of `NotifyParams` (64 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NotifyParams {
    pub is_token_in_rank: u64,
    pub tokens_per_rank: u64,
    pub tokens_per_expert: u64,
    pub send_pos: u64,
    pub count_matrix: u64,
    pub host_out: u64,
    pub num_tokens: i32,
    pub num_local_experts: i32,
    pub expert_alignment: i32,
    pub pad_: i32,
}

/// Mirror of `DispatchParams` (104 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DispatchParams {
    pub x: u64,
    pub scales: u64,
    pub topk_idx: u64,
    pub topk_w: u64,
    pub send_pos: u64,
    pub count_matrix: u64,
    pub row_bytes: i64,
    pub scale_row_stride: i64,
    pub scale_col_stride: i64,
    pub num_tokens: i32,
    pub num_scales: i32,
    pub num_topk: i32,
    pub num_local_experts: i32,
    pub local_warps: i32,
    pub use_tma: i32,
    /// This rank's receive region for the call: byte offset in its buffer (a multiple of
    /// [`super::arena::RECV_ALIGN`], laid out by [`super::arena::recv_sublayout`]), or 0: the
    /// fixed `off_recv_*` regions.
    pub recv_region: u64,
}

/// Mirror of `CombineParams` (88 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CombineParams {
    pub y: u64,
    pub topk_w: u64,
    pub bias0: u64,
    pub bias1: u64,
    pub out: u64,
    pub out_w: u64,
    pub send_pos: u64,
    pub count_matrix: u64,
    pub hidden: i32,
    pub num_topk: i32,
    pub num_tokens: i32,
    pub push_warps: i32,
    pub push_rows: i32,
    pub use_tma: i32,
}

const _: () = assert!(std::mem::size_of::<IntranodeArgs>() == 216);

/// 16-byte words per lane in one dispatch unit, per rank count: the `kUnroll` template argument of
/// `ep_intranode_dispatch_r{2,4,8}` in `intranode.cu` (keep in sync). A unit (chunk) is
/// `32 * unroll * 16` bytes; with `use_tma` each warp stages two chunks in shared memory.
pub fn dispatch_unroll(num_ranks: usize) -> usize {
    match num_ranks {
        2 => 7,
        4 => 4,
        _ => 2,
    }
}

/// Dynamic shared memory of a dispatch launch with `use_tma` (two chunk buffers per warp).
pub fn dispatch_tma_smem(num_ranks: usize, warps: usize) -> usize {
    warps * 2 * 32 * dispatch_unroll(num_ranks) * 16
}

/// 16-byte words per lane in one combine push chunk: `kPushUnroll` in `intranode.cu`.
pub const PUSH_UNROLL: usize = 7;

/// Dynamic shared memory of a combine launch with `use_tma` (two chunk buffers per push warp).
pub fn combine_tma_smem(push_warps: usize) -> usize {
    push_warps * 2 * 32 * PUSH_UNROLL * 16
}

/// `EP_TRACE_SLOTS` of `intranode.cuh`.
pub const TRACE_SLOTS: usize = 8;
const _: () = assert!(std::mem::size_of::<NotifyParams>() == 64);
const _: () = assert!(std::mem::size_of::<DispatchParams>() == 104);
const _: () = assert!(std::mem::size_of::<CombineParams>() == 88);

impl IntranodeArgs {
    /// Arguments for `rank` with every rank's buffer base address (as mapped in this process).
    pub fn new(layout: &BufferLayout, rank: usize, peer_base: &[u64], epoch: u32, trace: u64) -> Self {
        let mut bases = [0u64; 8];
        bases[..peer_base.len()].copy_from_slice(peer_base);
        IntranodeArgs {
            peer_base: bases,
            off_ready: layout.off_ready as u64,
            off_dispatch_rows: layout.off_dispatch_rows as u64,
            off_notify_rank: layout.off_notify_rank as u64,
            off_notify_expert: layout.off_notify_expert as u64,
            off_stage_flag: layout.off_stage_flag as u64,
            off_recv_x: layout.off_recv_x as u64,
            off_recv_scales: layout.off_recv_scales as u64,
            off_recv_topk_idx: layout.off_recv_topk_idx as u64,
            off_recv_topk_w: layout.off_recv_topk_w as u64,
            off_recv_src_idx: layout.off_recv_src_idx as u64,
            off_stage_x: layout.off_stage_x as u64,
            off_stage_w: layout.off_stage_w as u64,
            stage_x_slot_bytes: layout.stage_x_slot_bytes as u64,
            stage_w_slot_bytes: layout.stage_w_slot_bytes as u64,
            trace,
            off_recv_target: layout.off_recv_target as u64,
            rank: rank as i32,
            num_ranks: layout.num_ranks as i32,
            max_tokens: layout.max_tokens as i32,
            max_local_experts: crate::config::MAX_LOCAL_EXPERTS as i32,
            epoch,
            pad_: 0,
        }
    }
}
