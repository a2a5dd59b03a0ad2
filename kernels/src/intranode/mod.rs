//! Intranode expert-parallel dispatch/combine over NVLink (CUDA IPC), DeepEP's `Buffer` API.
//!
//! ```text
//! let mut buf = Buffer::new(&gpu, &comm, max_tokens_per_rank, hidden)?;
//! let layout = buf.dispatch_layout(&topk_idx, num_experts)?;                 // counts, no comm
//! let out = buf.dispatch(DispatchArgs::fresh(&x, &layout, &topk_idx, &topk_w))?; // notify + dispatch
//! let y = expert_ffn(&out.recv_x);                                           // user work
//! let comb = buf.combine(CombineArgs::new(&y, &out.handle).weights(&out.recv_topk_weights.unwrap()))?;
//! let again = buf.dispatch(DispatchArgs::cached(&x2, &out.handle))?;         // no CPU sync
//! ```
//!
//! Semantics follow the contract (ordered by source rank, then token; `-1` handling; aligned
//! per-expert counts; unweighted f32 combine with up to two biases). Differences from DeepEP:
//! - **Received tensors are views into the NVLink buffer** (the dispatch kernels write rows at
//!   their final position on the destination, no second copy). By default they lie in the fixed
//!   receive region and stay valid until the next dispatch on the same `Buffer`; using one
//!   afterwards is an error ([`Tensor::check_valid`]). With [`DispatchArgs::owned`] on a buffer
//!   made by [`Buffer::with_arena`], they lie in a region leased from the receive arena
//!   ([`arena`]) and stay valid until the last of them is dropped (the fixed region when the
//!   arena has no room; [`DispatchOutput::lease`] says which). Or copy out with
//!   [`Tensor::to_owned`].
//! - Stream/event: all work runs on the GPU's stream ([`Gpu`]); pass `wait` (a CUDA event the
//!   stream waits for before the first kernel) and get `event` (recorded after the last kernel).
//!   A fresh dispatch blocks the host until notify finished (it must learn the received count,
//!   like DeepEP); cached dispatch and combine never block.
//! - After any error the `Buffer` is poisoned (peers may be mid-call): create a new one.
//! - Every rank must issue the same sequence of calls with the same `Config`.

pub mod arena;
pub mod checks;
pub mod ffi;
pub mod raw;

use crate::config::{BufferLayout, Config, MAX_LOCAL_EXPERTS};
use arena::{recv_sublayout, ArenaLease, RecvArena};
use crate::error::EpError;
use crate::runtime::{Comm, DeviceBuffer, Gpu, HostMapped, IpcBuffer, Kernel, LaunchCfg};
use crate::tensor::{DType, Generation, Tensor, TensorInfo};
use crate::trace::{PhaseTrace, TracePhase};
use crate::Result;
use checks::{CombinePlan, DispatchPlan, HandleInfo, RoutingInfo};
use cudarc::driver::CudaEvent;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Threads of the notify kernel (`kNotifyThreads` in `intranode.cu`).
const NOTIFY_THREADS: u32 = 512;
/// Threads of the layout kernel and experts per expert block (`layout.cu`).
const LAYOUT_THREADS: u32 = 256;
const LAYOUT_EXPERTS_PER_BLOCK: usize = 32;

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Output of [`Buffer::dispatch_layout`] (all on the GPU).
#[derive(Debug, Clone)]
pub struct Layout {
    /// i32 `[R]`: tokens this rank sends to each rank.
    pub num_tokens_per_rank: Tensor,
    /// i32 `[E]`: selections of each expert (a token counts once per expert it selects).
    pub num_tokens_per_expert: Tensor,
    /// bool `[N, R]`.
    pub is_token_in_rank: Tensor,
    pub num_tokens: usize,
    pub num_experts: usize,
}

/// What combine (and a cached dispatch) needs from a dispatch. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Handle {
    buffer: u64,
    /// N: tokens of this rank in the dispatch that made the handle.
    pub num_tokens: usize,
    /// M: rows this rank received.
    pub num_recv_tokens: usize,
    /// K of the fresh dispatch.
    pub num_topk: usize,
    pub num_experts: usize,
    /// `[R][R]`: tokens rank s sends to rank d (row s).
    pub count_matrix: Vec<i32>,
    /// `[L]`: received selections per local expert, aligned up to `expert_alignment`.
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// i32 `[R, R]` on the GPU.
    pub count_matrix_dev: Tensor,
    /// i32 `[N, R]`: position of token t in the stream to rank d, -1 if not sent (DeepEP's
    /// `send_head` without channels).
    pub send_pos: Tensor,
    /// bool `[N, R]` (from the layout).
    pub is_token_in_rank: Tensor,
    /// i32 `[M]`: position of each received row in its source rank's `x` (owned copy).
    pub recv_src_idx: Tensor,
}

impl Handle {
    /// `rank_prefix_matrix[s][d]` = Σ_{s' <= s} count_matrix[s'][d] (DeepEP's layout, inclusive).
    pub fn rank_prefix_matrix(&self, num_ranks: usize) -> Vec<i32> {
        let mut out = vec![0; num_ranks * num_ranks];
        for d in 0..num_ranks {
            let mut acc = 0;
            for s in 0..num_ranks {
                acc += self.count_matrix[s * num_ranks + d];
                out[s * num_ranks + d] = acc;
            }
        }
        out
    }
    fn info(&self) -> HandleInfo {
        HandleInfo { buffer: self.buffer, num_tokens: self.num_tokens, num_recv_tokens: self.num_recv_tokens, num_topk: self.num_topk }
    }
}

/// Routing of one dispatch call.
#[derive(Debug, Clone, Copy)]
pub enum Routing<'a> {
    /// From a layout of this batch's top-k (runs notify; blocks the host until counts are known).
    Fresh { layout: &'a Layout, topk_idx: &'a Tensor, topk_weights: &'a Tensor, expert_alignment: usize },
    /// From a layout, without top-k (DeepEP's dispatch without `topk_idx`): outputs no top-k ids
    /// or weights; the per-expert counts come from the layout (runs notify like `Fresh`).
    FreshNoTopk { layout: &'a Layout, expert_alignment: usize },
    /// Reuse the routing of an earlier dispatch (same tokens, same destinations); outputs no
    /// top-k, weights or counts (DeepEP's cached mode).
    Cached(&'a Handle),
}

/// Arguments of [`Buffer::dispatch`].
#[derive(Debug, Clone, Copy)]
pub struct DispatchArgs<'a> {
    /// `[N, H]` bf16, or fp8-e4m3 with `scales`.
    pub x: &'a Tensor,
    /// f32 `[N, H/128]` (row-major, or a transposed view of column-major), FP8 only.
    pub scales: Option<&'a Tensor>,
    pub routing: Routing<'a>,
    pub config: Config,
    /// Event the stream waits for before the first kernel.
    pub wait: Option<&'a CudaEvent>,
    /// Write the received rows into a region leased from the buffer's receive arena, so that the
    /// outputs stay valid until they are dropped (not only until the next dispatch); falls back
    /// to the fixed receive region when the arena is absent or full ([`DispatchOutput::lease`]).
    pub owned: bool,
    /// The plan of tensors the caller already checked (the Python entry points:
    /// `crate::args::dispatch`): only the checks against this buffer run then
    /// ([`checks::check_planned`]), so no argument is checked twice.
    pub planned: Option<DispatchPlan>,
}

impl<'a> DispatchArgs<'a> {
    /// Fresh dispatch of bf16 `x` with `expert_alignment` 1 and the default config.
    pub fn fresh(x: &'a Tensor, layout: &'a Layout, topk_idx: &'a Tensor, topk_weights: &'a Tensor) -> Self {
        DispatchArgs { x, scales: None, routing: Routing::Fresh { layout, topk_idx, topk_weights, expert_alignment: 1 }, config: Config::default(), wait: None, owned: false, planned: None }
    }
    /// Fresh dispatch of bf16 `x` routed by `layout` alone (no top-k travels).
    pub fn fresh_without_topk(x: &'a Tensor, layout: &'a Layout) -> Self {
        DispatchArgs { x, scales: None, routing: Routing::FreshNoTopk { layout, expert_alignment: 1 }, config: Config::default(), wait: None, owned: false, planned: None }
    }
    /// Cached dispatch with `handle`.
    pub fn cached(x: &'a Tensor, handle: &'a Handle) -> Self {
        DispatchArgs { x, scales: None, routing: Routing::Cached(handle), config: Config::default(), wait: None, owned: false, planned: None }
    }
    pub fn scales(mut self, scales: &'a Tensor) -> Self {
        self.scales = Some(scales);
        self
    }
    /// See [`DispatchArgs::owned`].
    pub fn owned(mut self, owned: bool) -> Self {
        self.owned = owned;
        self
    }
    /// See [`DispatchArgs::planned`].
    pub fn planned(mut self, plan: DispatchPlan) -> Self {
        self.planned = Some(plan);
        self
    }
    pub fn expert_alignment(mut self, a: usize) -> Self {
        match &mut self.routing {
            Routing::Fresh { expert_alignment, .. } | Routing::FreshNoTopk { expert_alignment, .. } => *expert_alignment = a,
            Routing::Cached(_) => {}
        }
        self
    }
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }
    pub fn wait(mut self, event: &'a CudaEvent) -> Self {
        self.wait = Some(event);
        self
    }
}

/// Result of [`Buffer::dispatch`]. Tensors are views into the NVLink buffer (see module docs).
/// `H` is the handle type: the internode mode reuses this struct with its own handle (and owned
/// tensors).
#[derive(Debug)]
pub struct DispatchOutput<H = Handle> {
    /// `[M, H]`, dtype of `x`.
    pub recv_x: Tensor,
    /// f32 `[M, H/128]` row-major (FP8 only).
    pub recv_scales: Option<Tensor>,
    /// i64 `[M, K]` local expert ids or -1 (fresh dispatch only).
    pub recv_topk_idx: Option<Tensor>,
    /// f32 `[M, K]`, 0 where the id is -1 (fresh dispatch only).
    pub recv_topk_weights: Option<Tensor>,
    /// `[L]` aligned received selections per local expert (fresh dispatch only; empty when cached).
    pub num_recv_tokens_per_expert: Vec<usize>,
    pub handle: H,
    /// The arena region the outputs live in (kept alive by every output tensor too), or None:
    /// they are views of the fixed receive region, valid until the next dispatch.
    pub lease: Option<Arc<ArenaLease>>,
}

/// Arguments of [`Buffer::combine`] / [`Buffer::combine_into`].
#[derive(Debug, Clone, Copy)]
pub struct CombineArgs<'a> {
    /// bf16 `[M, H]`, rows in the order of the dispatch's `recv_x`.
    pub y: &'a Tensor,
    pub handle: &'a Handle,
    /// f32 `[M, K]` (e.g. `recv_topk_weights`): summed per origin token into `combined_topk_weights`.
    pub topk_weights: Option<&'a Tensor>,
    /// bf16 `[N, H]` added once per token (in f32, before the rank contributions).
    pub bias0: Option<&'a Tensor>,
    pub bias1: Option<&'a Tensor>,
    pub config: Config,
    pub wait: Option<&'a CudaEvent>,
    /// The plan of tensors the caller already checked (the Python entry points:
    /// `crate::args::combine`): only the checks against this buffer run then
    /// ([`checks::check_combine_planned`]).
    pub planned: Option<CombinePlan>,
}

impl<'a> CombineArgs<'a> {
    pub fn new(y: &'a Tensor, handle: &'a Handle) -> Self {
        CombineArgs { y, handle, topk_weights: None, bias0: None, bias1: None, config: Config::default(), wait: None, planned: None }
    }
    /// See [`CombineArgs::planned`].
    pub fn planned(mut self, plan: CombinePlan) -> Self {
        self.planned = Some(plan);
        self
    }
    pub fn weights(mut self, w: &'a Tensor) -> Self {
        self.topk_weights = Some(w);
        self
    }
    pub fn bias(mut self, b0: Option<&'a Tensor>, b1: Option<&'a Tensor>) -> Self {
        self.bias0 = b0;
        self.bias1 = b1;
        self
    }
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }
    pub fn wait(mut self, event: &'a CudaEvent) -> Self {
        self.wait = Some(event);
        self
    }
}

/// Result of [`Buffer::combine`].
#[derive(Debug)]
pub struct CombineOutput {
    /// bf16 `[N, H]` (owned).
    pub combined_x: Tensor,
    /// f32 `[N, K]` when `topk_weights` was given.
    pub combined_topk_weights: Option<Tensor>,
}

/// The per-rank intranode communication buffer (collective: every rank creates it with the same
/// arguments, in the same order relative to other collective allocations).
pub struct Buffer<'g> {
    gpu: &'g Gpu,
    rank: usize,
    num_ranks: usize,
    layout: BufferLayout,
    ipc: Arc<IpcBuffer>,
    host_out: HostMapped<i32>,
    /// Epoch of the last collective kernel (same on every rank).
    epoch: u32,
    /// Bumped whenever a dispatch overwrites the receive region (invalidates old views).
    recv_generation: Arc<AtomicU64>,
    id: u64,
    poisoned: Option<String>,
    device_sms: usize,
    kernels: Kernels,
    /// Phase timestamps of the last dispatch/combine kernel, when tracing is on.
    trace: Option<DeviceBuffer>,
    /// Regions of the buffer that owned dispatch outputs are leased from (None: no arena).
    arena: Option<RecvArena>,
}

/// The intranode phases of a [`PhaseTrace`] and their slots (`EP_TRACE_*` of `intranode.cuh`).
const TRACE_PHASES: [(TracePhase, usize); 4] =
    [(TracePhase::Ready, 1), (TracePhase::Sent, 2), (TracePhase::Published, 3), (TracePhase::Received, 4)];

/// The loaded entry points (looked up once per buffer).
struct Kernels {
    layout: Kernel,
    notify: Kernel,
    dispatch: Kernel,
    combine: Kernel,
}

impl<'g> std::fmt::Debug for Buffer<'g> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "intranode::Buffer(rank {}/{}, {} B, epoch {})", self.rank, self.num_ranks, self.layout.total_bytes, self.epoch)
    }
}

impl<'g> Buffer<'g> {
    /// Allocate and exchange the NVLink buffer for up to `max_tokens_per_rank` tokens per call
    /// and rows of up to `hidden` channels (bf16 or FP8). Size: [`crate::config::buffer_size_hint`].
    pub fn new(gpu: &'g Gpu, comm: &Comm, max_tokens_per_rank: usize, hidden: usize) -> Result<Buffer<'g>> {
        Self::with_arena(gpu, comm, max_tokens_per_rank, hidden, 0)
    }

    /// [`Buffer::new`] plus a receive arena of `arena_bytes` at the end of the buffer, which
    /// dispatches with [`DispatchArgs::owned`] lease their output regions from.
    pub fn with_arena(gpu: &'g Gpu, comm: &Comm, max_tokens_per_rank: usize, hidden: usize, arena_bytes: usize) -> Result<Buffer<'g>> {
        let num_ranks = comm.world();
        let layout = BufferLayout::with_arena(num_ranks, max_tokens_per_rank, hidden, arena_bytes)?;
        // Fail early (before the collective allocation) if the cubins are missing.
        crate::cubins::require("intranode")?;
        crate::cubins::require("layout")?;
        let ipc = IpcBuffer::new(gpu, comm, layout.total_bytes)?;
        // Every rank has zeroed its buffer before the all-gather inside IpcBuffer::new returned,
        // so nobody can write into a peer's buffer before the peer's zero-fill.
        let host_out = HostMapped::new(gpu.ctx(), 2 + num_ranks * num_ranks + MAX_LOCAL_EXPERTS)?;
        let device_sms = gpu.sm_count() as usize;
        let kernels = Kernels {
            layout: gpu.kernel("layout", "ep_layout")?,
            notify: gpu.kernel("intranode", "ep_intranode_notify")?,
            dispatch: gpu.kernel("intranode", &format!("ep_intranode_dispatch_r{num_ranks}"))?,
            combine: gpu.kernel("intranode", &format!("ep_intranode_combine_r{num_ranks}"))?,
        };
        Ok(Buffer {
            gpu,
            rank: comm.rank(),
            num_ranks,
            ipc: Arc::new(ipc),
            host_out,
            epoch: 0,
            recv_generation: Arc::new(AtomicU64::new(0)),
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            poisoned: None,
            device_sms,
            kernels,
            trace: None,
            arena: (layout.arena_bytes > 0).then(|| RecvArena::new(layout.off_arena, layout.arena_bytes)),
            layout,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }
    pub fn layout(&self) -> &BufferLayout {
        &self.layout
    }
    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Refuse to run after an earlier error, and turn a device error recorded since the last
    /// call (e.g. a timed-out wait of a kernel nobody synchronised yet) into an error now.
    fn check_usable(&mut self) -> Result<()> {
        if let Some(why) = &self.poisoned {
            return Err(EpError::InvalidArgument(format!(
                "this intranode Buffer is unusable after an earlier error ({why}); peers may be mid-call: recreate the Buffer on every rank"
            )));
        }
        match self.gpu.take_error() {
            // a dropped bad expert id: reported once, the buffer stays usable
            Some(e) if e.is_device_argument() => Err(e),
            Some(e) => self.poison(e),
            None => Ok(()),
        }
    }

    /// Record `e` as the reason the buffer is poisoned (GPU-side errors) and return it.
    fn poison<T>(&mut self, e: EpError) -> Result<T> {
        if !matches!(e, EpError::InvalidArgument(_)) || self.poisoned.is_none() {
            self.poisoned = Some(e.to_string());
        }
        Err(e)
    }

    /// Diagnostic hook (GPU tests, `deepep-kernels-harness`): fill this rank's receive and staging regions with the 32-bit word `word`
    /// (stream-ordered, so before the next call's kernels; peers write these regions only after
    /// that call's handshake). Lets tests poison the received views before a dispatch.
    pub fn fill_data_regions(&self, word: u32) -> Result<()> {
        // Not the arena: regions leased there belong to live outputs.
        let start = self.layout.off_recv_x;
        let words = (self.layout.off_arena.min(self.layout.total_bytes) - start) / 4;
        self.gpu.memset_u32(self.ipc.ptr(self.rank) + start as u64, word, words)
    }

    fn args(&self) -> ffi::IntranodeArgs {
        ffi::IntranodeArgs::new(&self.layout, self.rank, self.ipc.ptrs(), self.epoch, self.trace.as_ref().map_or(0, |t| t.ptr()))
    }

    /// Diagnostic hook: record phase timestamps of every dispatch/combine kernel (read the last
    /// one with [`Buffer::last_trace`]). Adds two small memsets per call; off by default.
    pub fn set_tracing(&mut self, on: bool) -> Result<()> {
        self.trace = if on { Some(DeviceBuffer::zeroed(self.gpu, ffi::TRACE_SLOTS * 8)?) } else { None };
        Ok(())
    }

    /// Preset the trace slots before a traced kernel (start: minimum, others: maximum).
    fn reset_trace(&self) -> Result<()> {
        if let Some(t) = &self.trace {
            self.gpu.memset_u8(t.ptr(), 0xff, 8)?;
            self.gpu.memset_u8(t.ptr() + 8, 0, (ffi::TRACE_SLOTS - 1) * 8)?;
        }
        Ok(())
    }

    /// Diagnostic hook: phase times of the last traced kernel (waits for the stream): ready,
    /// sent, published, received (see [`TracePhase`]); `None` when tracing is off.
    pub fn last_trace(&self) -> Result<Option<PhaseTrace>> {
        let Some(t) = &self.trace else { return Ok(None) };
        self.gpu.sync("reading the intranode trace")?;
        let v = t.download::<u64>(self.gpu, ffi::TRACE_SLOTS)?;
        Ok(Some(PhaseTrace::decode(&v, &TRACE_PHASES)))
    }

    fn next_epoch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            // 0 is the value of freshly zeroed flags; never use it as an epoch.
            self.epoch = 1;
        }
    }

    fn wait_event(&self, ev: Option<&CudaEvent>) -> Result<()> {
        if let Some(ev) = ev {
            self.gpu.stream().wait(ev).map_err(|e| EpError::Cuda { context: "stream wait on the caller's event".into(), message: format!("{:?}", e.0) })?;
        }
        Ok(())
    }

    /// An event recorded on this buffer's stream after the work queued so far (e.g. after a
    /// dispatch or combine, for another stream to wait on). The calls record none of their own:
    /// an event per call costs host time that callers ordering by stream do not need.
    pub fn record_event(&self) -> Result<CudaEvent> {
        crate::common::record_event(self.gpu)
    }

    /// Per-rank and per-expert counts and `is_token_in_rank` from `topk_idx` (i64 `[N, K]`).
    /// No communication. Ids outside `[-1, E)` are reported (phase `layout`) at the next sync.
    pub fn dispatch_layout(&mut self, topk_idx: &Tensor, num_experts: usize) -> Result<Layout> {
        self.check_usable()?;
        topk_idx.check_valid()?;
        let plan = checks::check_layout(topk_idx.info(), num_experts, self.num_ranks)?;
        let s = self.gpu.stream();
        let out = Layout {
            num_tokens_per_rank: Tensor::empty(s, DType::I32, &[self.num_ranks])?,
            num_tokens_per_expert: Tensor::empty(s, DType::I32, &[num_experts])?,
            is_token_in_rank: Tensor::empty(s, DType::Bool, &[plan.num_tokens, self.num_ranks])?,
            num_tokens: plan.num_tokens,
            num_experts,
        };
        self.dispatch_layout_into(topk_idx, &out)?;
        Ok(out)
    }

    /// [`Buffer::dispatch_layout`] into caller-provided tensors (`out.num_experts`, `out.num_tokens`
    /// and the three tensors' shapes must match `topk_idx`): i32 `[R]`, i32 `[E]`, bool `[N, R]`.
    pub fn dispatch_layout_into(&mut self, topk_idx: &Tensor, out: &Layout) -> Result<()> {
        self.check_usable()?;
        launch_layout(self.gpu, &self.kernels.layout, topk_idx, out, self.num_ranks)
    }

    /// Dispatch (see module docs). Validates everything before launching anything.
    pub fn dispatch(&mut self, a: DispatchArgs<'_>) -> Result<DispatchOutput> {
        self.check_usable()?;
        a.x.check_valid()?;
        if let Some(s) = a.scales {
            s.check_valid()?;
        }
        let routing_info = match a.routing {
            Routing::Fresh { layout, topk_idx, topk_weights, expert_alignment } => {
                topk_idx.check_valid()?;
                topk_weights.check_valid()?;
                RoutingInfo::Fresh {
                    layout_tokens: layout.num_tokens,
                    num_experts: layout.num_experts,
                    topk_idx: topk_idx.info(),
                    topk_weights: topk_weights.info(),
                    expert_alignment,
                }
            }
            Routing::FreshNoTopk { layout, expert_alignment } => {
                RoutingInfo::FreshNoTopk { layout_tokens: layout.num_tokens, num_experts: layout.num_experts, expert_alignment }
            }
            Routing::Cached(h) => RoutingInfo::Cached { handle_buffer: h.buffer, handle_tokens: h.num_tokens },
        };
        let plan = match a.planned {
            Some(p) => checks::check_planned(&self.layout, self.id, p, a.x.ptr(), a.scales.map(Tensor::ptr), &routing_info, &a.config, Some(self.device_sms))?,
            None => checks::check_dispatch(&self.layout, self.id, a.x.info(), a.scales.map(|s| s.info()), &routing_info, &a.config, Some(self.device_sms))?,
        };
        self.wait_event(a.wait)?;
        let r = match a.routing {
            Routing::Fresh { layout, topk_idx, topk_weights, .. } => self.dispatch_fresh(&a, &plan, layout, Some((topk_idx, topk_weights))),
            Routing::FreshNoTopk { layout, .. } => self.dispatch_fresh(&a, &plan, layout, None),
            Routing::Cached(h) => self.dispatch_cached(&a, &plan, h),
        };
        r.or_else(|e| self.poison(e))
    }

    fn dispatch_fresh(&mut self, a: &DispatchArgs<'_>, plan: &DispatchPlan, layout: &Layout, topk: Option<(&Tensor, &Tensor)>) -> Result<DispatchOutput> {
        let (r, n) = (self.num_ranks, plan.num_tokens);
        let l = plan.num_experts / r;
        let s = self.gpu.stream().clone();
        let send_pos = Tensor::empty(&s, DType::I32, &[n, r])?;
        let count_matrix = Tensor::empty(&s, DType::I32, &[r, r])?;

        // 1. notify: count exchange + prefix sums; the host learns M.
        self.next_epoch();
        self.host_out.set(0, 0);
        let notify = ffi::NotifyParams {
            is_token_in_rank: layout.is_token_in_rank.ptr(),
            tokens_per_rank: layout.num_tokens_per_rank.ptr(),
            tokens_per_expert: layout.num_tokens_per_expert.ptr(),
            send_pos: send_pos.ptr(),
            count_matrix: count_matrix.ptr(),
            host_out: self.host_out.dev_ptr(),
            num_tokens: n as i32,
            num_local_experts: l as i32,
            expert_alignment: plan.expert_alignment as i32,
            pad_: 0,
        };
        let args = self.args();
        self.gpu.launch(&self.kernels.notify, &LaunchCfg::new(1 + r as u32, NOTIFY_THREADS), crate::args![args, notify])?;
        self.gpu.sync("intranode notify")?;
        if self.host_out.get(0) != self.epoch as i32 {
            return Err(EpError::Cuda {
                context: format!("rank {}: intranode notify", self.rank),
                message: "the notify kernel finished without publishing its counts (no device error recorded); rerun with RUST_LOG=debug".into(),
            });
        }
        let m = self.host_out.get(1) as usize;
        let matrix: Vec<i32> = (0..r * r).map(|i| self.host_out.get(2 + i)).collect();
        let per_expert: Vec<usize> = (0..l).map(|e| self.host_out.get(2 + r * r + e) as usize).collect();
        if m > self.layout.recv_capacity() {
            return Err(EpError::InvalidArgument(format!(
                "rank {} would receive {m} rows but the buffer holds {}; some rank dispatched more than max_tokens_per_rank tokens (create every rank's Buffer with the same, large enough capacity)",
                self.rank,
                self.layout.recv_capacity()
            )));
        }

        // 2. dispatch.
        let k = plan.num_topk;
        let kk = if topk.is_some() { k } else { 0 };
        let lease = self.lease(a, plan, m, kk);
        self.launch_dispatch(plan, a, topk.map(|(i, w)| (i, w, l)), &send_pos, &count_matrix, lease.as_ref())?;
        let (recv_x, recv_scales, recv_topk) = self.recv_views(plan, m, kk, lease.as_ref());
        let (recv_topk_idx, recv_topk_weights) = recv_topk.unzip();
        let recv_src_view = self.view(self.layout.off_recv_src_idx, DType::I32, &[m], self.generation());
        let recv_src_idx = recv_src_view.to_owned()?;
        Ok(DispatchOutput {
            recv_x,
            recv_scales,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert: per_expert.clone(),
            handle: Handle {
                buffer: self.id,
                num_tokens: n,
                num_recv_tokens: m,
                num_topk: k,
                num_experts: plan.num_experts,
                count_matrix: matrix,
                num_recv_tokens_per_expert: per_expert,
                count_matrix_dev: count_matrix,
                send_pos,
                is_token_in_rank: layout.is_token_in_rank.clone(),
                recv_src_idx,
            },
            lease,
        })
    }

    fn dispatch_cached(&mut self, a: &DispatchArgs<'_>, plan: &DispatchPlan, h: &Handle) -> Result<DispatchOutput> {
        let lease = self.lease(a, plan, h.num_recv_tokens, 0);
        self.launch_dispatch(plan, a, None, &h.send_pos, &h.count_matrix_dev, lease.as_ref())?;
        let (recv_x, recv_scales, _) = self.recv_views(plan, h.num_recv_tokens, 0, lease.as_ref());
        Ok(DispatchOutput {
            recv_x,
            recv_scales,
            recv_topk_idx: None,
            recv_topk_weights: None,
            num_recv_tokens_per_expert: Vec::new(),
            handle: h.clone(),
            lease,
        })
    }

    /// A region of the arena for `m` received rows with `k` top-k columns, when the call asks for
    /// owned outputs and the arena has room (None: the fixed receive region).
    fn lease(&self, a: &DispatchArgs<'_>, plan: &DispatchPlan, m: usize, k: usize) -> Option<Arc<ArenaLease>> {
        if !a.owned || m == 0 {
            return None;
        }
        let sub = recv_sublayout(m, plan.row_bytes, plan.num_scales, k);
        self.arena.as_ref()?.lease(sub.bytes).map(Arc::new)
    }

    /// The receive arena's (capacity, free bytes, live leases), if the buffer has one.
    pub fn arena_usage(&self) -> Option<(usize, usize, usize)> {
        self.arena.as_ref().map(|a| (a.capacity(), a.free_bytes(), a.outstanding()))
    }

    fn launch_dispatch(
        &mut self,
        plan: &DispatchPlan,
        a: &DispatchArgs<'_>,
        topk: Option<(&Tensor, &Tensor, usize)>,
        send_pos: &Tensor,
        count_matrix: &Tensor,
        lease: Option<&Arc<ArenaLease>>,
    ) -> Result<()> {
        self.next_epoch();
        if lease.is_none() {
            // The fixed receive region is about to be overwritten: invalidate every earlier view.
            self.recv_generation.fetch_add(1, Ordering::AcqRel);
        }
        let p = ffi::DispatchParams {
            x: a.x.ptr(),
            scales: a.scales.map_or(0, |s| s.ptr()),
            topk_idx: topk.map_or(0, |t| t.0.ptr()),
            topk_w: topk.map_or(0, |t| t.1.ptr()),
            send_pos: send_pos.ptr(),
            count_matrix: count_matrix.ptr(),
            row_bytes: plan.row_bytes as i64,
            scale_row_stride: plan.scale_row_stride as i64,
            scale_col_stride: plan.scale_col_stride as i64,
            num_tokens: plan.num_tokens as i32,
            num_scales: plan.num_scales as i32,
            num_topk: if topk.is_some() { plan.num_topk as i32 } else { 0 },
            num_local_experts: topk.map_or(0, |t| t.2 as i32),
            local_warps: a.config.dispatch_local_warps as i32,
            use_tma: a.config.dispatch_tma as i32,
            recv_region: lease.map_or(0, |l| l.offset() as u64),
        };
        self.reset_trace()?;
        let args = self.args();
        let mut cfg = LaunchCfg::new(a.config.num_sms as u32, a.config.dispatch_warps as u32 * 32);
        if a.config.dispatch_tma {
            cfg = cfg.smem(ffi::dispatch_tma_smem(self.num_ranks, a.config.dispatch_warps) as u32);
        }
        self.gpu.launch(&self.kernels.dispatch, &cfg, crate::args![args, p])
    }

    fn generation(&self) -> Option<Generation> {
        Some(Generation {
            counter: self.recv_generation.clone(),
            expected: self.recv_generation.load(Ordering::Acquire),
            overwritten_by: "a later dispatch on the same intranode Buffer",
        })
    }

    fn view(&self, off: usize, dtype: DType, shape: &[usize], generation: Option<Generation>) -> Tensor {
        self.view_in(self.keep(None), off, dtype, shape, generation)
    }

    /// What a view keeps alive: the buffer, and the arena region it lies in.
    fn keep(&self, lease: Option<&Arc<ArenaLease>>) -> Arc<dyn std::any::Any + Send + Sync> {
        match lease {
            Some(l) => Arc::new((self.ipc.clone(), l.clone())),
            None => self.ipc.clone(),
        }
    }

    fn view_in(&self, keep: Arc<dyn std::any::Any + Send + Sync>, off: usize, dtype: DType, shape: &[usize], generation: Option<Generation>) -> Tensor {
        Tensor::view(self.gpu.stream(), keep, self.ipc.ptr(self.rank) + off as u64, dtype, shape, generation)
    }

    /// Views of a dispatch's outputs: the received rows, the FP8 scales, and with `k > 0` the
    /// top-k ids and weights (`[m, k]`); in the call's arena region (valid while any output
    /// lives, laid out by [`recv_sublayout`]), or in the fixed region (valid until the next
    /// dispatch).
    #[allow(clippy::type_complexity)]
    fn recv_views(&self, plan: &DispatchPlan, m: usize, k: usize, lease: Option<&Arc<ArenaLease>>) -> (Tensor, Option<Tensor>, Option<(Tensor, Tensor)>) {
        let lay = &self.layout;
        let (offs, gen) = match lease {
            Some(l) => {
                let sub = recv_sublayout(m, plan.row_bytes, plan.num_scales, k);
                ([sub.x, sub.scales, sub.topk_idx, sub.topk_w].map(|o| l.offset() + o), None)
            }
            None => ([lay.off_recv_x, lay.off_recv_scales, lay.off_recv_topk_idx, lay.off_recv_topk_w], self.generation()),
        };
        let keep = self.keep(lease);
        let view = |i: usize, dtype: DType, shape: &[usize]| self.view_in(keep.clone(), offs[i], dtype, shape, gen.clone());
        let x = view(0, plan.dtype, &[m, plan.hidden]);
        let scales = (plan.num_scales > 0).then(|| view(1, DType::F32, &[m, plan.num_scales]));
        let topk = (k > 0).then(|| (view(2, DType::I64, &[m, k]), view(3, DType::F32, &[m, k])));
        (x, scales, topk)
    }

    /// Combine into new output tensors (see [`Buffer::combine_into`]).
    pub fn combine(&mut self, a: CombineArgs<'_>) -> Result<CombineOutput> {
        self.check_usable()?;
        let s = self.gpu.stream().clone();
        let h = a.y.shape().get(1).copied().unwrap_or(0);
        let out = Tensor::empty(&s, DType::Bf16, &[a.handle.num_tokens, h])?;
        let out_w = match a.topk_weights {
            Some(w) => Some(Tensor::empty(&s, DType::F32, &[a.handle.num_tokens, w.shape().get(1).copied().unwrap_or(0)])?),
            None => None,
        };
        self.combine_into(a, &out, out_w.as_ref())?;
        Ok(CombineOutput { combined_x: out, combined_topk_weights: out_w })
    }

    /// Combine into caller-provided outputs: `out` bf16 `[N, H]`, `out_weights` f32 `[N, K]`
    /// (required iff `topk_weights` is given). For an event after it: [`Buffer::record_event`].
    pub fn combine_into(&mut self, a: CombineArgs<'_>, out: &Tensor, out_weights: Option<&Tensor>) -> Result<()> {
        self.check_usable()?;
        for t in [Some(a.y), a.topk_weights, a.bias0, a.bias1, Some(out), out_weights].into_iter().flatten() {
            t.check_valid()?;
        }
        let plan = match a.planned {
            Some(p) => {
                let tensors: Vec<(&str, &TensorInfo)> = [
                    Some(("y", a.y.info())),
                    a.topk_weights.map(|t| ("combine topk_weights", t.info())),
                    a.bias0.map(|t| ("bias0", t.info())),
                    a.bias1.map(|t| ("bias1", t.info())),
                    Some(("combined_x (output)", out.info())),
                    out_weights.map(|t| ("combined_topk_weights (output)", t.info())),
                ]
                .into_iter()
                .flatten()
                .collect();
                checks::check_combine_planned(&self.layout, self.id, &a.handle.info(), p, &tensors, &a.config, Some(self.device_sms))?
            }
            None => checks::check_combine(
                &self.layout,
                self.id,
                &a.handle.info(),
                a.y.info(),
                a.topk_weights.map(|t| t.info()),
                [a.bias0.map(|t| t.info()), a.bias1.map(|t| t.info())],
                out.info(),
                out_weights.map(|t| t.info()),
                &a.config,
                Some(self.device_sms),
            )?,
        };
        let outs: Vec<(&str, &TensorInfo)> = [Some(("combined_x", out.info())), out_weights.map(|t| ("combined_topk_weights", t.info()))].into_iter().flatten().collect();
        let ins: Vec<(&str, &TensorInfo)> = [Some(("y", a.y.info())), a.topk_weights.map(|t| ("topk_weights", t.info())), a.bias0.map(|t| ("bias0", t.info())), a.bias1.map(|t| ("bias1", t.info()))]
            .into_iter()
            .flatten()
            .collect();
        for (ow, o) in &outs {
            for (iw, i) in &ins {
                checks::check_disjoint(ow, o, iw, i)?;
            }
        }
        self.wait_event(a.wait)?;
        self.launch_combine(&a, &plan, out, out_weights).or_else(|e| self.poison(e))
    }

    fn launch_combine(&mut self, a: &CombineArgs<'_>, plan: &CombinePlan, out: &Tensor, out_weights: Option<&Tensor>) -> Result<()> {
        self.next_epoch();
        let p = ffi::CombineParams {
            y: a.y.ptr(),
            topk_w: if plan.with_weights { a.topk_weights.map_or(0, |t| t.ptr()) } else { 0 },
            bias0: a.bias0.map_or(0, |t| t.ptr()),
            bias1: a.bias1.map_or(0, |t| t.ptr()),
            out: out.ptr(),
            out_w: if plan.with_weights { out_weights.map_or(0, |t| t.ptr()) } else { 0 },
            send_pos: a.handle.send_pos.ptr(),
            count_matrix: a.handle.count_matrix_dev.ptr(),
            hidden: plan.hidden as i32,
            num_topk: plan.num_topk as i32,
            num_tokens: plan.num_tokens as i32,
            push_warps: a.config.combine_push_warps as i32,
            push_rows: a.config.combine_push_rows as i32,
            use_tma: a.config.combine_tma as i32,
        };
        self.reset_trace()?;
        let args = self.args();
        let mut cfg = LaunchCfg::new(a.config.num_sms as u32, a.config.combine_warps as u32 * 32);
        if a.config.combine_tma {
            cfg = cfg.smem(ffi::combine_tma_smem(a.config.combine_push_warps) as u32);
        }
        self.gpu.launch(&self.kernels.combine, &cfg, crate::args![args, p])
    }
}

// SAFETY: repr(C) plain data (u64 / i32 fields only), copied by value into kernel parameters.
unsafe impl crate::runtime::Pod for ffi::IntranodeArgs {}
unsafe impl crate::runtime::Pod for ffi::NotifyParams {}
unsafe impl crate::runtime::Pod for ffi::DispatchParams {}
unsafe impl crate::runtime::Pod for ffi::CombineParams {}

/// The layout kernel alone, without an NVLink buffer (the internode mode has none): DeepEP's
/// `get_dispatch_layout` of `topk_idx` for `num_ranks` ranks into `out` on `gpu`'s stream, ids
/// outside `[-1, E)` dropped and recorded (raised by the next call) as by
/// [`Buffer::dispatch_layout_into`].
pub fn dispatch_layout_on(gpu: &Gpu, topk_idx: &Tensor, out: &Layout, num_ranks: usize) -> Result<()> {
    launch_layout(gpu, &gpu.kernel("layout", "ep_layout")?, topk_idx, out, num_ranks)
}

fn launch_layout(gpu: &Gpu, kernel: &Kernel, topk_idx: &Tensor, out: &Layout, num_ranks: usize) -> Result<()> {
    topk_idx.check_valid()?;
    let num_experts = out.num_experts;
    let plan = checks::check_layout(topk_idx.info(), num_experts, num_ranks)?;
    for (name, t, dtype, shape) in [
        ("num_tokens_per_rank", &out.num_tokens_per_rank, DType::I32, vec![num_ranks]),
        ("num_tokens_per_expert", &out.num_tokens_per_expert, DType::I32, vec![num_experts]),
        ("is_token_in_rank", &out.is_token_in_rank, DType::Bool, vec![plan.num_tokens, num_ranks]),
    ] {
        t.check_valid()?;
        if t.dtype() != dtype || t.shape() != shape.as_slice() || !t.is_contiguous() || out.num_tokens != plan.num_tokens {
            return Err(EpError::InvalidArgument(format!(
                "dispatch_layout_into: {name} must be a contiguous {} tensor of shape {shape:?} for {} tokens, got {} {:?}",
                dtype.name(),
                plan.num_tokens,
                t.dtype().name(),
                t.shape()
            )));
        }
    }
    let (per_rank, per_expert, in_rank) = (&out.num_tokens_per_rank, &out.num_tokens_per_expert, &out.is_token_in_rank);
    let grid = (num_experts.div_ceil(LAYOUT_EXPERTS_PER_BLOCK) + 1) as u32;
    let args = crate::args![
        topk_idx.ptr(),
        plan.num_tokens as i32,
        plan.num_topk as i32,
        num_experts as i32,
        num_ranks as i32,
        per_rank.ptr(),
        per_expert.ptr(),
        in_rank.ptr()
    ];
    gpu.launch(kernel, &LaunchCfg::new(grid, LAYOUT_THREADS), args)
}
