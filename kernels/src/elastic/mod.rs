//! DeepEP V2's `ElasticBuffer` dispatch and combine within one NVLink node, over CUDA IPC
//! (`cuda/elastic.cu`; design, buffer layout and memory ordering in `cuda/elastic.cuh`).
//!
//! One [`ElasticBuffer`] per rank: an IPC buffer of the same size on every rank (a control
//! region, then one data region that a dispatch and a combine use in turn), a host-mapped word
//! block for the counts of a CPU-synced dispatch, and the six kernels. The rank context
//! ([`crate::context::RankContext`]) owns it next to the V1 buffers; the Python `ElasticBuffer`
//! (python/deepep_kernels/elastic.py, binding python/src/elastic.rs) calls it.
//!
//! A dispatch is two steps, so that a CPU-synced call can size its outputs in between:
//! [`ElasticBuffer::send`] (plan on a fresh call, then the collective dispatch kernel; with CPU
//! sync it waits, bounded, for the counts) and [`ElasticBuffer::epilogue`] (the received slots
//! into the caller's outputs, and the handle's counts). A combine is [`ElasticBuffer::combine`]
//! (the collective push back, then the origin's reduction in V2's order). The checks of every
//! call are in [`checks`]; they refuse what the kernels cannot do before anything is launched.

pub mod checks;
pub mod ffi;

pub use checks::{CombinePlan, DispatchPlan};

use crate::error::EpError;
use crate::runtime::{Comm, Gpu, HostMapped, IpcBuffer, Kernel, LaunchCfg};
use crate::Result;

/// Ranks one buffer serves (one NVLink node).
pub const MAX_RANKS: usize = 8;
/// Largest top-k (one warp lane per selection).
pub const MAX_TOPK: usize = 32;
/// Most experts in all, and per rank (the epilogue keeps per-expert counts in shared memory).
pub const MAX_EXPERTS: usize = 4096;
pub const MAX_LOCAL_EXPERTS: usize = 2048;
/// Threads per block of the data kernels (`EP_ELASTIC_THREADS`).
pub const THREADS: u32 = 512;
/// DeepEP V2 sizes buffers in multiples of 2 MiB (`get_buffer_size_hint` returns such a size).
pub const SIZE_ALIGNMENT: usize = 2 << 20;

use crate::common::align_up as align;

/// Byte offsets of the control region (see `ElasticArgs` in `cuda/elastic.cuh`) and the data
/// region that follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub off_call_seq: usize,
    pub off_ready: usize,
    pub off_rows_from: usize,
    pub off_comb_from: usize,
    pub off_notify_tok: usize,
    pub off_notify_exp: usize,
    pub off_data: usize,
    pub data_bytes: usize,
}

impl Layout {
    /// Bytes of the control region (counters, flags and the per-expert counts of every source).
    pub const CTRL_BYTES: usize = align(192 + MAX_RANKS * MAX_LOCAL_EXPERTS * 8, 4096);

    /// The layout of a buffer of `total_bytes` (at least [`Layout::CTRL_BYTES`] plus some data).
    pub fn new(total_bytes: usize) -> Result<Layout> {
        if total_bytes <= Self::CTRL_BYTES {
            return Err(EpError::InvalidArgument(format!(
                "ElasticBuffer: num_bytes={total_bytes} leaves no room for data (the control region alone takes {} bytes); \
                 size it with ElasticBuffer.get_buffer_size_hint",
                Self::CTRL_BYTES
            )));
        }
        Ok(Layout {
            off_call_seq: 0,
            off_ready: 16,
            off_rows_from: 48,
            off_comb_from: 80,
            off_notify_tok: 128,
            off_notify_exp: 192,
            off_data: Self::CTRL_BYTES,
            data_bytes: total_bytes - Self::CTRL_BYTES,
        })
    }
}


/// Bytes of one dispatch slot (a token as one destination receives it): the row, its 4-byte
/// scale packs and its metadata (`ep_slot_layout` in `cuda/elastic.cuh`).
pub fn slot_bytes(hidden_bytes: usize, num_sf_packs: usize, num_topk: usize) -> usize {
    align(hidden_bytes, 16) + align(num_sf_packs * 4, 16) + align((3 * num_topk + 2) * 4, 16)
}

/// Data bytes a dispatch of `max_tokens` tokens per rank needs on every rank.
pub fn dispatch_bytes(num_ranks: usize, max_tokens: usize, hidden_bytes: usize, num_sf_packs: usize, num_topk: usize) -> usize {
    num_ranks * max_tokens * slot_bytes(hidden_bytes, num_sf_packs, num_topk)
}

/// Data bytes a combine of rows of `hidden` (bf16) needs on every rank: `num_topk` rows per
/// token it dispatched, then the weights.
pub fn combine_bytes(max_tokens: usize, hidden: usize, num_topk: usize) -> usize {
    align(max_tokens * num_topk * hidden * 2, 16) + max_tokens * num_topk * 4
}

/// The top-k the size hint assumes when the caller gives none (DeepEP allows `num_topk=0`, sizing
/// by the number of ranks): the larger of the group size and 8.
pub fn default_topk(num_ranks: usize) -> usize {
    num_ranks.max(8)
}

/// DeepEP V2's `get_buffer_size_hint` for this implementation: the control region plus the
/// larger of a BF16 (or FP8, with its scale packs) dispatch and a combine of `max_tokens` tokens
/// per rank of `hidden` channels and top-`num_topk` (0: [`default_topk`]), rounded up to 2 MiB.
pub fn size_hint(num_ranks: usize, max_tokens: usize, hidden: usize, num_topk: usize, use_fp8: bool) -> Result<usize> {
    if num_ranks == 0 || num_ranks > MAX_RANKS {
        return Err(EpError::Unsupported(format!(
            "ElasticBuffer over {num_ranks} ranks: deepep_kernels serves groups of 1 to {MAX_RANKS} ranks within one NVLink node"
        )));
    }
    let k = if num_topk == 0 { default_topk(num_ranks) } else { num_topk };
    if k > MAX_TOPK {
        return Err(EpError::InvalidArgument(format!("num_topk={k} exceeds the elastic kernels' limit of {MAX_TOPK}")));
    }
    let max_tokens = max_tokens.max(1);
    let bf16 = dispatch_bytes(num_ranks, max_tokens, hidden * 2, 0, k);
    let fp8 = if use_fp8 { dispatch_bytes(num_ranks, max_tokens, hidden, hidden.div_ceil(128), k) } else { 0 };
    let data = bf16.max(fp8).max(combine_bytes(max_tokens, hidden, k));
    Ok(align(Layout::CTRL_BYTES + data, SIZE_ALIGNMENT))
}

/// The counts a CPU-synced dispatch learns before its outputs are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counts {
    /// Tokens this rank receives (rows of the plain layout).
    pub num_recv_tokens: usize,
    /// Selections of each local expert.
    pub per_expert: Vec<usize>,
}

/// Device addresses of what a dispatch writes besides its outputs (the handle's tensors).
#[derive(Debug, Clone, Copy, Default)]
pub struct SendPtrs {
    /// i32 `[2 * N * K + 2 * R + E]`: `dst_slot [N][K]`, `exp_pos [N][K]`, `send_counts [2R + E]`
    /// (written by a fresh call, read by a cached call and by combine).
    pub plan: u64,
    /// i64 `[N][K]`: the handle's copy of `topk_idx` (0: none).
    pub topk_copy: u64,
}

/// Device addresses of a dispatch's outputs and of the handle's count tensors.
#[derive(Debug, Clone, Copy, Default)]
pub struct EpiloguePtrs {
    pub recv_x: u64,
    pub recv_sf: u64,
    pub sf_row_stride: i64,
    pub sf_pack_stride: i64,
    pub recv_topk_idx: u64,
    pub recv_w: u64,
    /// i32 `[meta_rows][K + 2]`.
    pub meta: u64,
    pub psum_rank: u64,
    pub psum_expert: u64,
    pub unaligned: u64,
    pub stats: u64,
    pub recv_rows: usize,
    pub meta_rows: usize,
}

struct Kernels {
    plan: Kernel,
    dispatch: Kernel,
    epilogue: Kernel,
    combine: Kernel,
    reduce: Kernel,
    barrier: Kernel,
}

/// One rank's V2 buffer: see the module documentation.
pub struct ElasticBuffer<'g> {
    gpu: &'g Gpu,
    rank: usize,
    num_ranks: usize,
    ipc: IpcBuffer,
    layout: Layout,
    /// `[0]` flag, `[1]` tokens received, `[2 + l]` selections of local expert `l`.
    host_out: HostMapped<i32>,
    kernels: Kernels,
}

impl std::fmt::Debug for ElasticBuffer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ElasticBuffer(rank {} of {}, {} data bytes)", self.rank, self.num_ranks, self.layout.data_bytes)
    }
}

impl<'g> ElasticBuffer<'g> {
    /// Create (collectively: every rank passes the same `total_bytes`) the buffer of `comm`'s
    /// group on `gpu`.
    pub fn new(gpu: &'g Gpu, comm: &Comm, total_bytes: usize) -> Result<ElasticBuffer<'g>> {
        let num_ranks = comm.world();
        if num_ranks > MAX_RANKS {
            return Err(EpError::Unsupported(format!(
                "ElasticBuffer over {num_ranks} ranks: deepep_kernels serves one NVLink node of up to {MAX_RANKS} ranks; \
                 for more ranks or several hosts use DeepEP 2.x itself (its hybrid RDMA mode) or deepep_kernels' V1 Buffer \
                 (internode mode)"
            )));
        }
        let layout = Layout::new(total_bytes)?;
        crate::cubins::require("elastic")?;
        let kernels = Kernels {
            plan: gpu.kernel("elastic", "ep_elastic_plan")?,
            dispatch: gpu.kernel("elastic", "ep_elastic_dispatch")?,
            epilogue: gpu.kernel("elastic", "ep_elastic_dispatch_epilogue")?,
            combine: gpu.kernel("elastic", "ep_elastic_combine")?,
            reduce: gpu.kernel("elastic", "ep_elastic_combine_reduce")?,
            barrier: gpu.kernel("elastic", "ep_elastic_barrier")?,
        };
        // zero-filled on every rank before the all-gather inside returns: no peer writes earlier
        let ipc = IpcBuffer::new(gpu, comm, total_bytes)?;
        let host_out = HostMapped::new(gpu.ctx(), 2 + MAX_LOCAL_EXPERTS)?;
        Ok(ElasticBuffer { gpu, rank: comm.rank(), num_ranks, ipc, layout, host_out, kernels })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Total bytes of this rank's buffer.
    pub fn num_bytes(&self) -> usize {
        self.ipc.bytes()
    }

    fn args(&self) -> ffi::ElasticArgs {
        let mut peer_base = [0u64; MAX_RANKS];
        peer_base[..self.num_ranks].copy_from_slice(self.ipc.ptrs());
        let l = &self.layout;
        ffi::ElasticArgs {
            peer_base,
            off_call_seq: l.off_call_seq as u64,
            off_ready: l.off_ready as u64,
            off_rows_from: l.off_rows_from as u64,
            off_comb_from: l.off_comb_from as u64,
            off_notify_tok: l.off_notify_tok as u64,
            off_notify_exp: l.off_notify_exp as u64,
            off_data: l.off_data as u64,
            data_bytes: l.data_bytes as u64,
            rank: self.rank as i32,
            num_ranks: self.num_ranks as i32,
            max_local_experts: MAX_LOCAL_EXPERTS as i32,
            pad_: 0,
        }
    }

    /// The grid of the data kernels: `num_sms`, at most this rank's SMs (the whole GPU, or its share
    /// when several ranks share it: their spinning blocks must all be resident; `Gpu::fit_sms`).
    fn grid(&self, num_sms: usize) -> u32 {
        self.gpu.fit_sms(num_sms) as u32
    }

    /// Launch a fresh call's plan (no communication) and the collective dispatch kernel; with
    /// `plan.cpu_sync`, wait (bounded by the GPU's host timeout) for them and return the counts.
    pub fn send(&mut self, plan: &DispatchPlan, ptrs: SendPtrs) -> Result<Option<Counts>> {
        let (n, k, r) = (plan.num_tokens, plan.num_topk, self.num_ranks);
        let nk = (n * k) as u64 * 4;
        let dst_slot = ptrs.plan;
        let exp_pos = ptrs.plan + nk;
        let send_counts = ptrs.plan + 2 * nk;
        if plan.fresh {
            let p = ffi::PlanParams {
                topk_idx: plan.topk_idx,
                dst_slot,
                exp_pos,
                send_counts,
                num_tokens: n as i32,
                num_topk: k as i32,
                num_experts: plan.num_experts as i32,
                num_ranks: r as i32,
            };
            self.gpu.launch(&self.kernels.plan, &LaunchCfg::new((plan.num_experts + r) as u32, THREADS), crate::args![p])?;
        }
        if plan.cpu_sync {
            self.host_out.set(0, 0);
        }
        let p = ffi::DispatchParams {
            x: plan.x,
            sf: plan.sf,
            topk_idx: plan.topk_idx,
            topk_w: plan.topk_w,
            dst_slot,
            exp_pos,
            send_counts,
            topk_copy: ptrs.topk_copy,
            host_out: if plan.cpu_sync { self.host_out.dev_ptr() } else { 0 },
            sf_token_stride: plan.sf_token_stride,
            sf_pack_stride: plan.sf_pack_stride,
            num_tokens: n as i32,
            hidden_bytes: plan.hidden_bytes as i32,
            num_sf_packs: plan.num_sf_packs as i32,
            num_topk: k as i32,
            num_experts: plan.num_experts as i32,
            max_tokens: plan.max_tokens as i32,
            fresh: plan.fresh as i32,
            pad_: 0,
        };
        let args = self.args();
        self.gpu.launch(&self.kernels.dispatch, &LaunchCfg::new(self.grid(plan.num_sms), THREADS), crate::args![args, p])?;
        if !plan.cpu_sync {
            return Ok(None);
        }
        self.gpu.sync("ElasticBuffer.dispatch (CPU sync: the received counts)")?;
        if self.host_out.get(0) != 1 {
            return Err(EpError::Cuda {
                context: format!("rank {}: ElasticBuffer.dispatch", self.rank),
                message: "the dispatch kernel finished without publishing the received counts (no device error recorded)".into(),
            });
        }
        let l = plan.num_local_experts;
        Ok(Some(Counts {
            num_recv_tokens: self.host_out.get(1).max(0) as usize,
            per_expert: (0..l).map(|e| self.host_out.get(2 + e).max(0) as usize).collect(),
        }))
    }

    /// Launch the epilogue: the received slots into the outputs at `out` (sized by
    /// [`DispatchPlan::output_rows`]), and, on a fresh call, the handle's counts and metadata.
    pub fn epilogue(&mut self, plan: &DispatchPlan, out: EpiloguePtrs) -> Result<()> {
        let p = ffi::EpilogueParams {
            recv_x: out.recv_x,
            recv_sf: out.recv_sf,
            recv_topk_idx: out.recv_topk_idx,
            recv_w: out.recv_w,
            meta: out.meta,
            psum_rank: out.psum_rank,
            psum_expert: out.psum_expert,
            unaligned: out.unaligned,
            stats: out.stats,
            sf_row_stride: out.sf_row_stride,
            sf_pack_stride: out.sf_pack_stride,
            recv_rows: out.recv_rows as i32,
            meta_rows: out.meta_rows as i32,
            num_local_experts: plan.num_local_experts as i32,
            expert_alignment: plan.expert_alignment as i32,
            hidden_bytes: plan.hidden_bytes as i32,
            num_sf_packs: plan.num_sf_packs as i32,
            num_topk: plan.num_topk as i32,
            max_tokens: plan.max_tokens as i32,
            expand: plan.expand as i32,
            fresh: plan.fresh as i32,
            zero_padding: plan.zero_padding as i32,
            pad_: 0,
        };
        let args = self.args();
        self.gpu.launch(&self.kernels.epilogue, &LaunchCfg::new(self.grid(plan.num_sms), THREADS), crate::args![args, p])
    }

    /// Combine: every row of `plan.x` back to its origin (collective), then the origin's
    /// reduction into `out` (bf16 `[N][hidden]`) and `out_w` (f32 `[N][K]`, 0: none).
    pub fn combine(&mut self, plan: &CombinePlan, out: u64, out_w: u64) -> Result<()> {
        let args = self.args();
        let grid = LaunchCfg::new(self.grid(plan.num_sms), THREADS);
        let c = ffi::CombineParams {
            x: plan.x,
            topk_w: plan.topk_w,
            meta: plan.meta,
            psum_rank: plan.psum_rank,
            x_rows: plan.x_rows as i32,
            meta_rows: plan.meta_rows as i32,
            hidden: plan.hidden as i32,
            num_topk: plan.num_topk as i32,
            max_tokens: plan.max_tokens as i32,
            expand: plan.expand as i32,
            per_rank: plan.per_rank as i32,
            nslots: plan.num_topk as i32,
        };
        self.gpu.launch(&self.kernels.combine, &grid, crate::args![args, c])?;
        let r = ffi::ReduceParams {
            out,
            out_w,
            bias0: plan.bias[0],
            bias1: plan.bias[1],
            topk_idx: plan.topk_idx,
            send_counts: plan.send_counts,
            num_tokens: plan.num_tokens as i32,
            hidden: plan.hidden as i32,
            num_topk: plan.num_topk as i32,
            num_experts: plan.num_experts as i32,
            per_rank: plan.per_rank as i32,
            nslots: plan.num_topk as i32,
            max_tokens: plan.max_tokens as i32,
            pad_: 0,
        };
        self.gpu.launch(&self.kernels.reduce, &grid, crate::args![args, r])
    }

    /// A collective barrier on `stream` (raw handle of this GPU's context; 0: the comm stream).
    pub fn barrier(&mut self, stream: u64) -> Result<()> {
        let args = self.args();
        let cfg = LaunchCfg::new(1, 32);
        if stream == 0 {
            self.gpu.launch(&self.kernels.barrier, &cfg, crate::args![args])
        } else {
            self.gpu.launch_in(&self.kernels.barrier, &cfg, crate::args![args], stream as usize as cudarc::driver::sys::CUstream)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_bytes_match_the_kernel_layout() {
        // hidden 7168 bf16, no scales, top-6: row 14336, meta (3*6+2)*4 = 80
        assert_eq!(slot_bytes(14336, 0, 6), 14336 + 80);
        // FP8 hidden 7168 with 56 scale packs: 7168 + 224 + 80
        assert_eq!(slot_bytes(7168, 56, 6), 7168 + 224 + 80);
        // unaligned pieces are rounded up to 16 bytes each
        assert_eq!(slot_bytes(16, 1, 1), 16 + 16 + 32);
    }

    #[test]
    fn size_hint_covers_dispatch_and_combine_and_is_2mib_aligned() {
        let h = size_hint(8, 4096, 7168, 6, true).unwrap();
        assert_eq!(h % SIZE_ALIGNMENT, 0);
        assert!(h >= Layout::CTRL_BYTES + dispatch_bytes(8, 4096, 14336, 0, 6));
        assert!(h >= Layout::CTRL_BYTES + combine_bytes(4096, 7168, 6));
        // no top-k: sized for the default, which is at least the group size
        let h0 = size_hint(2, 128, 512, 0, false).unwrap();
        assert!(h0 >= Layout::CTRL_BYTES + combine_bytes(128, 512, default_topk(2)));
        assert!(size_hint(9, 1, 128, 1, false).is_err());
        assert!(size_hint(2, 1, 128, 33, false).is_err());
    }

    #[test]
    fn layout_refuses_a_buffer_without_data_room() {
        assert!(Layout::new(Layout::CTRL_BYTES).is_err());
        let l = Layout::new(Layout::CTRL_BYTES + 4096).unwrap();
        assert_eq!(l.data_bytes, 4096);
        assert_eq!(l.off_data % 4096, 0);
        // the per-expert notify words of every source fit before the data
        assert!(l.off_notify_exp + MAX_RANKS * MAX_LOCAL_EXPERTS * 8 <= l.off_data);
    }
}
