//! The rank context: one owner for everything a rank's `Buffer` holds, what DeepEP's C++
//! `Buffer` is (csrc/deep_ep.hpp): its GPU (primary context, comm stream, error record), the
//! rank's exchange ([`Comm`]), the three V1 buffers (NVLink, internode, low-latency) with their
//! sizes, lifecycle and generations, DeepEP V2's `ElasticBuffer` ([`crate::elastic`]), the
//! stream joins around every launch, the capacity checks and the error records of its kernels.
//!
//! The Python binding (`python/src`) is a thin layer over it: it reads the caller's tensors into
//! [`Arg`]s, the kernels crate's checks (`crate::args`) accept or refuse them, and a
//! [`RankContext`] method sizes, joins and launches; the binding only turns the outputs into torch
//! tensors. The Python `ElasticBuffer` binding (`python/src/elastic.rs`) holds a context of its own
//! whose one buffer is the V2 one. Plain Rust callers can use it the same way with their own
//! [`Exchange`] (the GPU harness still drives the buffers directly).
//!
//! Lifecycle: a buffer is created (collectively) on first use for the sizes a call needs, and
//! re-created when a call needs others; each (re-)creation bumps its generation, so handles and
//! hooks of an older one are refused. [`RankContext::destroy`] releases all of them
//! collectively; after a lost peer (an expired GPU wait) it, and the drop of the context, are
//! local only (see [`RankContext::destroy`]).
//!
//! Errors belong to the context whose kernels recorded them: every kernel writes into the
//! host-mapped record of this context's [`Gpu`], [`RankContext::take_error`] reads only that one,
//! and dropping the context frees it. A new context on the surviving ranks therefore starts clean.

mod events;
mod sizing;

pub use events::{as_stream, Event, Joins, JOIN_EVENTS};
pub use sizing::{inter_bytes, inter_config, inter_dims, inter_max_tokens, intranode_max_tokens, InterDims};

use crate::args::{self as checks, Arg};
use crate::config::{buffer_size_hint, BufferLayout, Config};
use crate::elastic::ElasticBuffer;
use crate::error::{EpError, ErrorRecord, RecordKind};
use crate::internode::{self as inter, InternodeBuffer};
use crate::intranode::checks::CombinePlan;
use crate::intranode::{self, CombineArgs, DispatchArgs, DispatchOutput, Layout};
use crate::low_latency::{LlDispatchOpts, LlDispatchOut, LlHandle, LlHook, LlLayout, LowLatencyBuffer};
use crate::runtime::{Comm, Exchange, Gpu};
use crate::tensor::Tensor;
use crate::Result;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn bad<T>(msg: impl Into<String>) -> Result<T> {
    Err(EpError::InvalidArgument(msg.into()))
}

/// The sizes and mode a `Buffer` was created with (DeepEP's constructor arguments), which bound
/// the buffers the context creates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sizes {
    pub num_nvl_bytes: usize,
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
    /// Ranks per (real or emulated) host of the internode mode (0: not in that mode).
    pub ranks_per_host: usize,
    /// Bytes of the intranode receive arena (None: twice the fixed receive region).
    pub recv_arena: Option<usize>,
}

/// The buffers' generations: bumped whenever a buffer is (re-)created (the low-latency one also
/// when destroyed), so that handles and hooks of an older one are refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Generations {
    pub intra: u64,
    pub inter: u64,
    pub ll: u64,
}

/// The tensors of a normal (intranode) dispatch, read and checked (`crate::args::dispatch`).
#[derive(Debug)]
pub struct NormalDispatch<'a> {
    pub x: &'a Arg,
    pub scales: Option<&'a Arg>,
    pub topk: Option<(&'a Arg, &'a Arg)>,
    /// (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank): a fresh dispatch.
    pub layout: Option<(&'a Arg, &'a Arg, &'a Arg)>,
    /// The handle of a cached dispatch, with the generation it was made at.
    pub cached: Option<(&'a intranode::Handle, u64)>,
    pub expert_alignment: usize,
    pub num_sms: usize,
    /// Write the outputs into a receive-arena region they own (see `DispatchArgs::owned`).
    pub owned: bool,
    /// The padded row count of the outputs (0: the received count).
    pub num_worst_tokens: usize,
    /// What `crate::args::dispatch` found: the buffer then checks only what it alone knows.
    pub plan: crate::args::DispatchPlan,
}

/// One rank's state: see the module documentation. Field order is drop order: the buffers borrow
/// `gpu` and go first.
pub struct RankContext {
    intra: Option<intranode::Buffer<'static>>,
    elastic: Option<ElasticBuffer<'static>>,
    inter: Option<InternodeBuffer<'static>>,
    ll: Option<LowLatencyBuffer<'static>>,
    intra_dims: Option<(usize, usize)>,
    ll_dims: Option<(usize, usize, usize)>,
    comm: Comm,
    id: u64,
    joins: Joins,
    sizes: Sizes,
    generations: Generations,
    /// Shared by the views of the caller's tensors (they own nothing).
    no_owner: Arc<dyn std::any::Any + Send + Sync>,
    gpu: Box<Gpu>,
}

impl std::fmt::Debug for RankContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RankContext(id {}, rank {} of {}, {:?}, {:?})", self.id, self.comm.rank(), self.comm.world(), self.gpu, self.sizes)
    }
}

// SAFETY: the CUDA handles inside are valid on any thread of the process (every launch binds the
// primary context first); callers serialise access (`&mut self` for every state change).
unsafe impl Send for RankContext {}
unsafe impl Sync for RankContext {}

impl RankContext {
    /// Rank `rank` of `world` on CUDA device `device` (`ranks_per_gpu` ranks share it: grids use
    /// this rank's share of the SMs), exchanging through `exchange`. Its kernels record errors in
    /// this context's own record, which later calls report ([`RankContext::take_error`]) and which
    /// stays until the context is dropped or destroyed; `trap_on_error` makes a fatal record trap
    /// instead (the CUDA context is then lost).
    #[allow(clippy::too_many_arguments)]
    pub fn new(device: usize, rank: usize, world: usize, local_rank: usize, local_world: usize, exchange: Arc<dyn Exchange>, ranks_per_gpu: usize, trap_on_error: bool) -> Result<RankContext> {
        let gpu = Box::new(Gpu::with_share(device, rank, ranks_per_gpu)?);
        gpu.set_trap_on_device_error(trap_on_error);
        gpu.set_sticky_errors(true);
        let comm = Comm::with_exchange(rank, world, local_rank, local_world, exchange)?;
        Ok(RankContext {
            intra: None,
            elastic: None,
            inter: None,
            ll: None,
            intra_dims: None,
            ll_dims: None,
            comm,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            joins: Joins::new()?,
            sizes: Sizes::default(),
            generations: Generations::default(),
            no_owner: Arc::new(()),
            gpu,
        })
    }

    // --- plain state ----------------------------------------------------------------------------
    pub fn set_sizes(&mut self, sizes: Sizes) {
        self.sizes = sizes;
    }
    pub fn sizes(&self) -> Sizes {
        self.sizes
    }
    /// Unique per context in this process: handles carry it so another Buffer's are refused.
    pub fn id(&self) -> u64 {
        self.id
    }
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    pub fn world(&self) -> usize {
        self.comm.world()
    }
    pub fn device(&self) -> usize {
        self.gpu.ordinal()
    }
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
    pub fn comm(&self) -> &Comm {
        &self.comm
    }
    pub fn generations(&self) -> Generations {
        self.generations
    }
    /// Raw handle of the comm stream (DeepEP's), on which every kernel runs unless a low-latency
    /// call launches on the caller's stream ([`RankContext::ll_stream`]).
    pub fn comm_stream(&self) -> u64 {
        self.gpu.cu_stream() as usize as u64
    }
    pub fn intra_dims(&self) -> Option<(usize, usize)> {
        self.intra_dims
    }
    pub fn ll_dims(&self) -> Option<(usize, usize, usize)> {
        self.ll_dims
    }
    pub fn inter_dims(&self) -> Option<InterDims> {
        self.inter.as_ref().map(|b| inter_dims(b.config()))
    }
    /// The receive arena's (capacity, free bytes, live leases), if the NVLink buffer has one.
    pub fn arena_usage(&self) -> Option<(usize, usize, usize)> {
        self.intra.as_ref().and_then(|b| b.arena_usage())
    }
    /// The low-latency buffer, if created.
    pub fn ll(&self) -> Option<&LowLatencyBuffer<'static>> {
        self.ll.as_ref()
    }
    /// Make this rank's (primary) context current on the calling thread (PyTorch may call from
    /// threads where no CUDA call ran yet).
    pub fn bind(&self) -> Result<()> {
        self.gpu.bind()
    }
    fn gpu_static(&self) -> &'static Gpu {
        // SAFETY: `gpu` is boxed (stable address), never replaced, and dropped after every buffer
        // that borrows it (field order of `RankContext`).
        unsafe { &*(self.gpu.as_ref() as *const Gpu) }
    }
    /// A kernels-crate view of a caller's tensor as the checks read it (real shape and strides).
    pub fn view(&self, a: &Arg) -> Tensor {
        Tensor::view_info(self.gpu.stream(), self.no_owner.clone(), a.info())
    }
    /// The first `rows` rows of a caller's tensor.
    fn rows_of(&self, a: &Arg, rows: usize) -> Tensor {
        let mut info = a.info();
        info.shape[0] = rows.min(info.shape[0]);
        Tensor::view_info(self.gpu.stream(), self.no_owner.clone(), info)
    }
    /// `num_sms` as given with one rank per GPU; with several ranks sharing the GPU (testing), at
    /// most this rank's share, so every rank's waiting blocks fit at once.
    fn fit_sms(&self, num_sms: usize) -> usize {
        if self.gpu.oversubscribed() {
            self.gpu.fit_sms(num_sms)
        } else {
            num_sms
        }
    }
    /// The SM count an internode buffer created with `num_sms` would use on this rank.
    pub fn inter_fit_sms(&self, num_sms: usize) -> usize {
        self.gpu.fit_sms_even(num_sms)
    }
    /// Refuse a handle / hook made by another context.
    pub fn check_owner(&self, id: u64, what: &str) -> Result<()> {
        if id != self.id {
            return bad(format!("this {what} comes from another Buffer; pass the handle of a dispatch on this Buffer"));
        }
        Ok(())
    }

    // --- errors ---------------------------------------------------------------------------------
    /// What this context's kernels recorded, if anything: an argument record (a routing id that
    /// points nowhere was dropped; the call completed) is taken, so it is reported once; a fatal
    /// one (an expired wait, a failed device check) stays and is reported by every later look
    /// until the context is destroyed or dropped. Records of other contexts are not looked at.
    pub fn take_error(&self) -> Option<(RecordKind, EpError)> {
        let r = self.gpu.error_record();
        let kind = r.kind()?;
        if kind == RecordKind::Argument {
            if let Some(e) = self.gpu.take_argument_error() {
                return Some((kind, e));
            }
            // replaced by a fatal record meanwhile
            let r = self.gpu.error_record();
            return Some((r.kind()?, r.to_error()?));
        }
        Some((kind, r.to_error()?))
    }
    /// This context's fatal record (an expired wait, a failed device check), if any; only looks.
    pub fn fatal_error(&self) -> Option<EpError> {
        let r = self.gpu.error_record();
        r.kind().filter(|k| k.is_fatal()).and_then(|_| r.to_error())
    }

    // --- stream joins ---------------------------------------------------------------------------
    /// The comm stream waits for the work queued so far on `stream` (None: no join).
    pub fn join_from(&mut self, stream: Option<u64>) -> Result<()> {
        let Some(s) = stream else { return Ok(()) };
        let comm = self.comm_stream();
        self.joins.join(comm, s)
    }
    /// `stream` waits for the work queued so far on the comm stream (None: no join).
    pub fn join_to(&mut self, stream: Option<u64>) -> Result<()> {
        let Some(s) = stream else { return Ok(()) };
        let comm = self.comm_stream();
        self.joins.join(s, comm)
    }
    /// The comm stream waits for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        event.wait(self.comm_stream())
    }
    /// An event recorded on the comm stream now.
    pub fn record_comm(&self) -> Result<Event> {
        Event::recorded_on(self.comm_stream())
    }
    /// The caller's joins before a normal-mode call: the comm stream waits for `event` when given,
    /// else for `stream`.
    pub fn begin(&mut self, event: Option<&Event>, stream: Option<u64>) -> Result<()> {
        match event {
            Some(e) => self.wait_event(e),
            None => self.join_from(stream),
        }
    }
    /// The joins after a normal-mode call: with `async_finish`, an event recorded on the comm
    /// stream (returned); else `stream` waits for the comm stream.
    pub fn end(&mut self, async_finish: bool, stream: Option<u64>) -> Result<Option<Event>> {
        if async_finish {
            return self.record_comm().map(Some);
        }
        self.join_to(stream)?;
        Ok(None)
    }
    /// Where the next low-latency call launches: on `wait_for` itself when the caller joins both
    /// ways with that one stream (returns true: no event joins needed), else on the comm stream
    /// after it waited for `wait_for` (returns false: the caller joins `join_back` afterwards).
    pub fn ll_stream(&mut self, wait_for: Option<u64>, join_back: Option<u64>) -> Result<bool> {
        let direct = wait_for.is_some() && wait_for == join_back;
        if !direct {
            self.join_from(wait_for)?;
        }
        self.ll_mut()?.set_stream(if direct { wait_for.map(as_stream) } else { None });
        Ok(direct)
    }
    /// The comm stream waits for every low-latency call so far (which may have run on the
    /// callers' streams), e.g. before the caller records or waits on it.
    pub fn comm_after_ll(&self) -> Result<()> {
        match self.ll.as_ref() {
            Some(ll) => ll.order_after_calls(self.gpu.cu_stream()),
            None => Ok(()),
        }
    }
    /// Wait for the comm stream (and every low-latency call before it).
    pub fn synchronize(&self) -> Result<()> {
        self.comm_after_ll()?;
        self.gpu.sync("deepep_kernels Buffer synchronize")
    }

    // --- buffers: creation and capacity ---------------------------------------------------------
    fn intra_mut(&mut self) -> Result<&mut intranode::Buffer<'static>> {
        self.intra.as_mut().ok_or_else(|| EpError::InvalidArgument("the intranode buffer is not created (destroyed, or num_nvl_bytes was 0)".into()))
    }
    fn inter_mut(&mut self) -> Result<&mut InternodeBuffer<'static>> {
        self.inter.as_mut().ok_or_else(|| EpError::InvalidArgument("the internode buffer is not created (destroyed, or the group is within one host)".into()))
    }
    /// The V2 buffer (DeepEP's `ElasticBuffer`), if created.
    pub fn elastic_mut(&mut self) -> Result<&mut ElasticBuffer<'static>> {
        self.elastic.as_mut().ok_or_else(|| EpError::InvalidArgument("the ElasticBuffer is destroyed; create a new one".into()))
    }
    /// Create (collectively: every rank passes the same `num_bytes`) the V2 buffer; replaces an
    /// earlier one after every rank finished its work on it.
    pub fn elastic_create(&mut self, num_bytes: usize) -> Result<()> {
        self.bind()?;
        let gpu = self.gpu_static();
        if let Some(old) = self.elastic.take() {
            gpu.sync("re-creating the ElasticBuffer")?;
            self.comm.barrier()?;
            drop(old);
        }
        self.elastic = Some(ElasticBuffer::new(gpu, &self.comm, num_bytes)?);
        Ok(())
    }
    fn ll_mut(&mut self) -> Result<&mut LowLatencyBuffer<'static>> {
        self.ll.as_mut().ok_or_else(|| EpError::InvalidArgument("the low-latency buffer is not created (destroyed, or low_latency_mode was off)".into()))
    }

    /// Create (collectively) the NVLink buffer for up to `max_tokens` tokens per rank of up to
    /// `hidden` channels, plus a receive arena of `arena_bytes` (None: twice the fixed receive
    /// region); replaces an earlier one.
    pub fn intranode_create(&mut self, max_tokens: usize, hidden: usize, arena_bytes: Option<usize>) -> Result<()> {
        self.bind()?;
        self.intra = None;
        self.intra_dims = None;
        let arena = match arena_bytes {
            Some(b) => b,
            None => 2 * BufferLayout::new(self.comm.world(), max_tokens, hidden)?.recv_region_bytes(),
        };
        let b = intranode::Buffer::with_arena(self.gpu_static(), &self.comm, max_tokens, hidden, arena)?;
        self.intra = Some(b);
        self.intra_dims = Some((max_tokens, hidden));
        self.generations.intra += 1;
        Ok(())
    }
    /// The NVLink buffer for rows of `hidden`: created (collectively: every rank dispatches the
    /// same hidden) for the most tokens `num_nvl_bytes` holds, when missing or made for another
    /// hidden.
    pub fn ensure_intra(&mut self, hidden: usize) -> Result<()> {
        if self.intra.is_some() && matches!(self.intra_dims, Some((_, h)) if h == hidden) {
            return Ok(());
        }
        let world = self.comm.world();
        let max_tokens = intranode_max_tokens(world, hidden, self.sizes.num_nvl_bytes);
        if max_tokens == 0 {
            let need = buffer_size_hint(world, 1, hidden)?;
            return bad(format!(
                "num_nvl_bytes={} cannot hold one token of hidden {hidden} for {world} ranks (needs >= {need}); size it with Config.get_nvl_buffer_size_hint",
                self.sizes.num_nvl_bytes
            ));
        }
        self.intranode_create(max_tokens, hidden, self.sizes.recv_arena)
    }

    /// Create (collectively) the internode buffer for `dims`, starting NVSHMEM on first use;
    /// replaces an earlier one (after every rank finished its work on it). `num_sms` is clamped to
    /// this rank's even share of the SMs. Returns the configuration used.
    pub fn internode_create(&mut self, dims: InterDims) -> Result<InterDims> {
        self.bind()?;
        let gpu = self.gpu_static();
        if let Some(old) = self.inter.take() {
            // peers may still read this rank's symmetric memory until they finished their kernels
            gpu.sync("re-creating the internode buffer")?;
            self.comm.barrier()?;
            drop(old);
        }
        let mut cfg = inter_config(dims);
        cfg.num_sms = gpu.fit_sms_even(cfg.num_sms);
        let nv = inter::nvshmem_runtime(gpu, &self.comm)?;
        self.inter = Some(InternodeBuffer::new(gpu, &self.comm, &nv, cfg)?);
        Ok(inter_dims(&cfg))
    }
    /// The internode buffer for a fresh dispatch of rows of `hidden`, top-`topk` and
    /// `local_experts` experts per rank on `num_sms` SMs: created (collectively) when missing, or
    /// re-created when this dispatch needs a larger hidden / top-k / experts per rank or another
    /// SM count. Its token capacity is the most the Buffer's memory holds: num_rdma_bytes +
    /// num_nvl_bytes (DeepEP keeps a ring buffer of num_nvl_bytes for the NVLink hop; ours runs
    /// that hop inside the symmetric buffer, so the memory granted for it goes there too).
    pub fn ensure_inter(&mut self, hidden: usize, topk: usize, local_experts: usize, num_sms: usize) -> Result<()> {
        let max_topk = inter::plan::MAX_TOPK;
        if topk > max_topk {
            return bad(format!("top-k {topk} exceeds the internode kernels' limit of {max_topk}; route each token to at most {max_topk} experts"));
        }
        let sms = self.gpu.fit_sms_even(num_sms);
        let (mut hidden, mut topk, mut local_experts) = (hidden, topk, local_experts);
        if let Some(c) = self.inter.as_ref().map(|b| *b.config()) {
            if hidden <= c.hidden && topk <= c.max_topk && local_experts <= c.max_local_experts && sms == c.num_sms {
                return Ok(());
            }
            (hidden, topk, local_experts) = (hidden.max(c.hidden), topk.max(c.max_topk), local_experts.max(c.max_local_experts));
        }
        // A dispatch without top-k routes one slot per rank: size for that from the start, so that
        // it never re-creates the buffer under the handles of earlier dispatches (which DeepEP's
        // fixed buffer keeps valid; a few bytes per token)
        let world = self.comm.world();
        topk = topk.max(world.min(max_topk));
        let (rph, bytes) = (self.sizes.ranks_per_host, self.sizes.num_rdma_bytes + self.sizes.num_nvl_bytes);
        let cap = inter_max_tokens(world, (rph, 0, hidden, sms, topk, local_experts), bytes);
        if cap == 0 {
            let need = inter_bytes(world, (rph, 1, hidden, sms, topk, local_experts))?;
            return bad(format!(
                "num_rdma_bytes + num_nvl_bytes = {bytes} cannot hold one token of hidden {hidden} (top-k {topk}, {local_experts} experts per \
                 rank) for {world} ranks in hosts of {rph} (needs >= {need}); size num_rdma_bytes with Config.get_rdma_buffer_size_hint"
            ));
        }
        self.internode_create((rph, cap, hidden, sms, topk, local_experts))?;
        self.generations.inter += 1;
        Ok(())
    }
    /// `n` tokens fit the internode buffer.
    fn inter_capacity(&self, n: usize) -> Result<()> {
        let c = *self.inter.as_ref().ok_or_else(|| EpError::InvalidArgument("the internode buffer is not created (destroyed, or the group is within one host)".into()))?.config();
        if n > c.max_tokens_per_rank {
            let world = self.comm.world();
            let need = inter_bytes(world, (c.ranks_per_host, n, c.hidden, c.num_sms, c.max_topk, c.max_local_experts)).unwrap_or(0);
            return bad(format!(
                "dispatch of {n} tokens: num_rdma_bytes + num_nvl_bytes = {} holds {} tokens of hidden {} per rank on {world} ranks in hosts \
                 of {}; create the Buffer with num_rdma_bytes + num_nvl_bytes >= {need} (or set DEEPEP_KERNELS_MAX_TOKENS >= {n} before \
                 sizing num_rdma_bytes with Config.get_rdma_buffer_size_hint)",
                self.sizes.num_rdma_bytes + self.sizes.num_nvl_bytes,
                c.max_tokens_per_rank,
                c.hidden,
                c.ranks_per_host
            ));
        }
        Ok(())
    }

    /// The low-latency buffer is going (re-created, destroyed or abandoned): forget its sizes and
    /// bump its generation (older handles and hooks are refused; callers that cache views of its
    /// outputs drop them when the generation changes).
    fn retire_ll(&mut self) {
        self.ll_dims = None;
        self.generations.ll += 1;
    }
    /// Create (collectively) the low-latency buffer; replaces an earlier one.
    pub fn ll_create(&mut self, num_max: usize, hidden: usize, num_experts: usize) -> Result<()> {
        self.bind()?;
        drop(self.ll.take());
        self.retire_ll();
        let b = LowLatencyBuffer::new(self.gpu_static(), &self.comm, num_max, hidden, num_experts, None)?;
        self.ll = Some(b);
        self.ll_dims = Some((num_max, hidden, num_experts));
        Ok(())
    }
    /// The low-latency buffer for these sizes (`clean_low_latency_buffer`): created, collectively,
    /// when missing or created for other sizes, after the size check against `num_rdma_bytes`.
    pub fn ensure_ll(&mut self, num_max: usize, hidden: usize, num_experts: usize) -> Result<()> {
        if self.ll.is_some() && self.ll_dims == Some((num_max, hidden, num_experts)) {
            return Ok(());
        }
        if !self.sizes.low_latency_mode {
            return bad("low-latency calls need Buffer(..., low_latency_mode=True)");
        }
        let world = self.comm.world();
        let need = LlLayout::new(world, num_experts, num_max, hidden, self.gpu.sm_count() as usize)?.total_bytes;
        checks::ll_capacity(need, self.sizes.num_rdma_bytes, num_max, hidden, num_experts, world)?;
        self.ll_create(num_max, hidden, num_experts)
    }

    /// The part of the local NVLink buffer (`rdma=false`) or low-latency symmetric buffer from
    /// byte `offset` as elements of `elem_bytes`: `(device address, element count)`, the count
    /// being all that fits, or `numel` when given (refused when it does not fit).
    pub fn local_buffer(&self, rdma: bool, offset: i64, elem_bytes: usize, numel: Option<usize>) -> Result<(u64, usize)> {
        let (ptr, nbytes) = if rdma {
            self.ll.as_ref().map(|b| b.local_buffer()).ok_or_else(|| {
                EpError::InvalidArgument("no low-latency (RDMA) buffer: create the Buffer with low_latency_mode=True and run clean_low_latency_buffer or a low-latency dispatch first".into())
            })?
        } else {
            self.intra.as_ref().map(|b| b.local_buffer()).ok_or_else(|| EpError::InvalidArgument("no NVLink buffer: create the Buffer with num_nvl_bytes > 0 and run a dispatch first".into()))?
        };
        if offset < 0 || offset as u64 > nbytes as u64 {
            return bad(format!("offset {offset} is outside the {nbytes}-byte buffer"));
        }
        let off = offset as usize;
        let fits = (nbytes - off) / elem_bytes.max(1);
        let count = match numel {
            Some(n) if n > fits => return bad(format!("the requested size needs {n} elements but the buffer holds {fits} from offset {offset}")),
            Some(n) => n,
            None => fits,
        };
        Ok((ptr + off as u64, count))
    }

    // --- launches -------------------------------------------------------------------------------
    /// DeepEP's layout of `topk_idx` (i64 `[n, k]`) into the caller's `per_rank` (i32 `[R]`),
    /// `per_expert` (i32 `[E]`) and `in_rank` (bool `[n, R]`) by the layout kernel on the comm
    /// stream. Returns false, having launched nothing, where the layout kernel cannot serve the
    /// group (the internode mode of more than 8 ranks, or too many local experts) or `use_kernel`
    /// is off: the caller computes the layout then.
    pub fn layout(&mut self, topk_idx: &Arg, per_rank: &Arg, per_expert: &Arg, in_rank: &Arg, num_experts: usize, use_kernel: bool) -> Result<bool> {
        let r = self.comm.world();
        let kernel_serves = crate::validate::intranode_ranks(r).is_ok() && num_experts / r <= crate::config::MAX_LOCAL_EXPERTS;
        if self.intra.is_none() && !(kernel_serves && use_kernel) {
            // the checks the layout kernel's launch would make of num_experts, for the caller's path
            crate::validate::experts(num_experts, r)?;
            return Ok(false);
        }
        self.bind()?;
        let t = self.view(topk_idx);
        let layout = Layout {
            num_tokens_per_rank: self.view(per_rank),
            num_tokens_per_expert: self.view(per_expert),
            is_token_in_rank: self.view(in_rank),
            num_tokens: topk_idx.shape[0],
            num_experts,
        };
        let gpu = self.gpu_static();
        match self.intra.as_mut() {
            Some(b) => b.dispatch_layout_into(&t, &layout),
            // the internode mode has no NVLink buffer: the layout kernel alone
            None => intranode::dispatch_layout_on(gpu, &t, &layout, r),
        }?;
        Ok(true)
    }

    /// Intranode dispatch on the comm stream (see [`NormalDispatch`]); the NVLink buffer is
    /// (re-)created for `x`'s hidden first when needed (collective). A fresh dispatch blocks the
    /// host until the received counts are known, like DeepEP without `num_worst_tokens`.
    pub fn dispatch(&mut self, d: NormalDispatch<'_>) -> Result<DispatchOutput> {
        let r = self.comm.world();
        let (n, h) = (d.x.shape[0], d.x.shape[1]);
        self.bind()?;
        // the buffer for this hidden first (a re-creation makes older handles stale), then the handle
        self.ensure_intra(h)?;
        if let Some((_, generation)) = d.cached {
            checks::normal_generation(generation, self.generations.intra, false)?;
        }
        let (max_tokens, _) = self.intra_dims.ok_or_else(|| EpError::InvalidArgument("the intranode buffer is not created".into()))?;
        let need = buffer_size_hint(r, n.max(1), h).unwrap_or(0);
        checks::nvl_capacity(n, max_tokens, h, r, self.sizes.num_nvl_bytes, need)?;
        let xt = self.view(d.x);
        let st = d.scales.map(|s| self.view(s));
        let config = Config::with_sms(self.fit_sms(d.num_sms));
        let out = match (d.layout, d.cached) {
            (Some((pr, pe, ir)), None) => {
                let lay = Layout {
                    num_tokens_per_rank: self.view(pr),
                    num_tokens_per_expert: self.view(pe),
                    is_token_in_rank: self.view(ir),
                    num_tokens: n,
                    num_experts: pe.shape[0],
                };
                let tk = d.topk.map(|(i, w)| (self.view(i), self.view(w)));
                let mut args = match tk.as_ref() {
                    Some((idx, w)) => DispatchArgs::fresh(&xt, &lay, idx, w),
                    // DeepEP's dispatch without top-k: rows go by is_token_in_rank alone
                    None => DispatchArgs::fresh_without_topk(&xt, &lay),
                }
                .expert_alignment(d.expert_alignment)
                .config(config)
                .owned(d.owned)
                .planned(d.plan);
                if let Some(s) = st.as_ref() {
                    args = args.scales(s);
                }
                self.intra_mut()?.dispatch(args)?
            }
            (None, Some((hd, _))) => {
                let mut args = DispatchArgs::cached(&xt, hd).config(config).owned(d.owned).planned(d.plan);
                if let Some(s) = st.as_ref() {
                    args = args.scales(s);
                }
                self.intra_mut()?.dispatch(args)?
            }
            _ => return bad("dispatch needs either the layout tensors (fresh) or a handle (cached), not both"),
        };
        let m = out.recv_x.shape()[0];
        if d.num_worst_tokens > 0 && m > d.num_worst_tokens {
            return bad(format!(
                "num_worst_tokens={} but this rank received {m} tokens; raise num_worst_tokens (at most num_ranks * num_tokens)",
                d.num_worst_tokens
            ));
        }
        Ok(out)
    }

    /// Intranode combine of bf16 `x` (rows as the handle's dispatch produced; rows past the
    /// received count take no part) into the caller's `out` (and `out_weights` with
    /// `topk_weights`), on the comm stream.
    #[allow(clippy::too_many_arguments)]
    pub fn combine(&mut self, handle: &intranode::Handle, generation: u64, x: &Arg, topk_weights: Option<&Arg>, bias: [Option<&Arg>; 2], out: &Arg, out_weights: Option<&Arg>, num_sms: usize) -> Result<()> {
        checks::normal_generation(generation, self.generations.intra, false)?;
        self.bind()?;
        // rows past the received count (num_worst_tokens padding) take no part, as in DeepEP
        let m = handle.num_recv_tokens;
        let yt = self.rows_of(x, m);
        let wt = topk_weights.map(|w| self.rows_of(w, m));
        let b0 = bias[0].map(|b| self.view(b));
        let b1 = bias[1].map(|b| self.view(b));
        let ot = self.view(out);
        let owt = out_weights.map(|o| self.view(o));
        // the tensors were checked by crate::args::combine: the buffer checks only what it knows
        let plan = CombinePlan {
            num_tokens: handle.num_tokens,
            num_recv_tokens: m,
            hidden: x.shape[1],
            num_topk: topk_weights.map_or(0, |w| w.shape[1]),
            with_weights: topk_weights.is_some(),
        };
        let mut args = CombineArgs::new(&yt, handle).bias(b0.as_ref(), b1.as_ref()).config(Config::with_sms(self.fit_sms(num_sms))).planned(plan);
        if let Some(w) = wt.as_ref() {
            args = args.weights(w);
        }
        self.intra_mut()?.combine_into(args, &ot, owt.as_ref())?;
        Ok(())
    }

    /// Internode dispatch on the comm stream: fresh (`topk` given; the layout was checked by the
    /// caller), creating or growing the internode buffer first (collective), or cached with a
    /// handle of generation `cached.1`. A fresh dispatch blocks the host until the notify kernel
    /// published the received counts, like DeepEP's internode dispatch.
    #[allow(clippy::too_many_arguments)]
    pub fn internode_dispatch(&mut self, x: &Arg, scales: Option<&Arg>, topk: Option<(&Arg, &Arg)>, num_experts: usize, cached: Option<(&inter::Handle, u64)>, expert_alignment: usize, num_sms: usize) -> Result<inter::DispatchOutput> {
        let (n, h) = (x.shape[0], x.shape[1]);
        self.bind()?;
        match cached {
            None => {
                let (ia, wa) = topk.ok_or_else(|| EpError::InvalidArgument("the internode kernels route by top-k ids: pass topk_idx and topk_weights".into()))?;
                let world = self.comm.world();
                self.ensure_inter(h, ia.shape[1], num_experts / world, num_sms)?;
                self.inter_capacity(n)?;
                let (xt, idx, w) = (self.view(x), self.view(ia), self.view(wa));
                let st = scales.map(|s| self.view(s));
                let mut args = inter::DispatchArgs::fresh(&xt, &idx, &w, num_experts).expert_alignment(expert_alignment);
                if let Some(s) = st.as_ref() {
                    args = args.scales(s);
                }
                self.inter_mut()?.dispatch(args)
            }
            Some((hd, generation)) => {
                checks::normal_generation(generation, self.generations.inter, true)?;
                self.inter_capacity(n)?;
                let xt = self.view(x);
                let st = scales.map(|s| self.view(s));
                let mut args = inter::DispatchArgs::cached(&xt, hd);
                if let Some(s) = st.as_ref() {
                    args = args.scales(s);
                }
                self.inter_mut()?.dispatch(args)
            }
        }
    }

    /// Internode combine of bf16 `x` (rows in the order and width of the dispatch's `recv_x`) on
    /// the comm stream. Never blocks the host; the outputs are the kernels crate's.
    pub fn internode_combine(&mut self, handle: &inter::Handle, generation: u64, x: &Arg, topk_weights: Option<&Arg>, bias: [Option<&Arg>; 2]) -> Result<intranode::CombineOutput> {
        checks::normal_generation(generation, self.generations.inter, true)?;
        self.bind()?;
        let yt = self.view(x);
        let wt = topk_weights.map(|w| self.view(w));
        let b0 = bias[0].map(|b| self.view(b));
        let b1 = bias[1].map(|b| self.view(b));
        let mut args = inter::CombineArgs::new(&yt, handle).bias(b0.as_ref(), b1.as_ref());
        if let Some(w) = wt.as_ref() {
            args = args.weights(w);
        }
        self.inter_mut()?.combine(args)
    }

    /// Low-latency dispatch of `x` by `topk_idx`, creating the buffer for (num_max, hidden,
    /// num_experts) first when needed (collective), launched where [`RankContext::ll_stream`]
    /// says, then `join_back` joined. No host wait.
    #[allow(clippy::too_many_arguments)]
    pub fn ll_dispatch(&mut self, x: &Arg, topk_idx: &Arg, num_max: usize, num_experts: usize, opts: LlDispatchOpts, wait_for: Option<u64>, join_back: Option<u64>) -> Result<LlDispatchOut> {
        self.bind()?;
        self.ensure_ll(num_max, x.shape[1], num_experts)?;
        let direct = self.ll_stream(wait_for, join_back)?;
        let (xt, it) = (self.view(x), self.view(topk_idx));
        let out = self.ll_mut()?.dispatch(&xt, &it, opts)?;
        if !direct {
            self.join_to(join_back)?;
        }
        Ok(out)
    }

    /// Low-latency combine of `x` into the caller's `out` with this rank's `topk_idx` /
    /// `topk_weights`; `generation` is the handle's. Returns the receive hook when asked for.
    #[allow(clippy::too_many_arguments)]
    pub fn ll_combine(&mut self, handle: &LlHandle, generation: u64, x: &Arg, topk_idx: &Arg, topk_weights: &Arg, out: &Arg, return_hook: bool, wait_for: Option<u64>, join_back: Option<u64>) -> Result<Option<LlHook>> {
        checks::ll_generation(generation, self.generations.ll, "handle")?;
        self.bind()?;
        let direct = self.ll_stream(wait_for, join_back)?;
        let (yt, it, wt, ot) = (self.view(x), self.view(topk_idx), self.view(topk_weights), self.view(out));
        let r = self.ll_mut()?.combine_into(&yt, &it, &wt, handle, &ot, return_hook)?;
        if !direct {
            self.join_to(join_back)?;
        }
        Ok(r.hook)
    }

    /// Launch the receive half of a hooked low-latency call (of generation `generation`).
    pub fn ll_recv(&mut self, hook: LlHook, generation: u64, wait_for: Option<u64>, join_back: Option<u64>) -> Result<()> {
        self.bind()?;
        checks::ll_generation(generation, self.generations.ll, "hook")?;
        let direct = self.ll_stream(wait_for, join_back)?;
        self.ll_mut()?.recv(hook)?;
        if !direct {
            self.join_to(join_back)?;
        }
        Ok(())
    }

    // --- teardown -------------------------------------------------------------------------------
    /// Release the buffers (collective: the low-latency buffer's drop and NVSHMEM finalize
    /// synchronize all ranks). After a peer was lost (a bounded GPU wait expired), local only: the
    /// NVLink buffer is freed here, the NVSHMEM buffers and NVSHMEM itself are left allocated
    /// (their frees and finalize wait for every PE, the lost one included), and NVSHMEM refuses to
    /// start again in this process; no barrier with the other ranks. The context's error record
    /// is cleared either way.
    pub fn destroy(&mut self) -> Result<()> {
        self.bind()?;
        if let Some(lost) = self.gpu.peer_lost() {
            return self.destroy_local(&lost);
        }
        let gpu = self.gpu_static();
        let had_nvshmem = self.ll.is_some() || self.inter.is_some();
        let (intra, inter, ll) = (self.intra.take(), self.inter.take(), self.ll.take());
        let elastic = self.elastic.take();
        self.intra_dims = None;
        self.retire_ll();
        gpu.sync("destroying the buffers")?;
        // every rank finished before the collective frees of the symmetric buffers
        self.comm.barrier()?;
        drop(intra);
        drop(elastic);
        drop(inter);
        drop(ll);
        if had_nvshmem {
            crate::nvshmem::finalize();
        }
        self.comm.barrier()
    }

    /// [`RankContext::destroy`] after `lost` (an expired wait): no collective step at all.
    fn destroy_local(&mut self, lost: &ErrorRecord) -> Result<()> {
        let intra = self.intra.take();
        let elastic = self.elastic.take();
        self.abandon_nvshmem_buffers(lost);
        self.intra_dims = None;
        self.retire_ll();
        // every kernel of this rank ends within its wait bound; then the NVLink buffer is ours alone
        let synced = self.gpu.sync("destroying the buffers after a lost peer");
        drop(intra);
        drop(elastic);
        self.gpu.clear_error();
        match synced {
            Err(e) if !matches!(e, EpError::GpuTimeout { .. }) => Err(e),
            _ => Ok(()),
        }
    }

    /// Give the full NVSHMEM world up in this process, then drop the low-latency buffer without
    /// any collective step (its symmetric memory is kept for a low-latency buffer of the surviving
    /// ranks) and leak the internode one (its drop frees collectively).
    fn abandon_nvshmem_buffers(&mut self, lost: &ErrorRecord) {
        let ll = self.ll.take();
        let inter = self.inter.take();
        if ll.is_some() || inter.is_some() {
            crate::nvshmem::abandon(&format!("rank {} lost rank {} while its buffers were in use", lost.rank, lost.peer));
            drop(ll);
            std::mem::forget(inter);
        }
    }
}

impl Drop for RankContext {
    /// A context dropped without [`RankContext::destroy`] (DeepEP's default
    /// `explicitly_destroy=False`: the Buffer is garbage-collected) after a lost peer must not run
    /// the collective drops of its NVSHMEM buffers (they would wait for that peer forever): they
    /// are abandoned as `destroy` does, and the NVLink buffer is freed once this rank's kernels
    /// ended. Its error record goes with its GPU, so no later Buffer reports it.
    fn drop(&mut self) {
        if let Some(lost) = self.gpu.peer_lost() {
            if let Err(e) = self.destroy_local(&lost) {
                tracing::warn!("dropping the rank context after a lost peer: {e}");
            }
        }
    }
}

/// `DEEPEP_KERNELS_TRAP_ON_ERROR`: `1` = a kernel that records a fatal error (an expired wait, a
/// failed device check) then traps, so no CUDA call of the process succeeds afterwards; unset,
/// empty or `0` = no trap (the default).
pub fn parse_trap_env(v: Option<&str>) -> std::result::Result<bool, String> {
    match v.map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(format!(
            "DEEPEP_KERNELS_TRAP_ON_ERROR={other:?}: use 1 (a fatal device error traps and the CUDA context is lost) or 0 \
             (the default: the error is raised by the next Buffer call and the context survives)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trap_env_is_opt_in_and_checked() {
        assert!(!parse_trap_env(None).unwrap());
        assert!(!parse_trap_env(Some("")).unwrap());
        assert!(!parse_trap_env(Some("0")).unwrap());
        assert!(parse_trap_env(Some("1")).unwrap());
        let e = parse_trap_env(Some("yes")).unwrap_err();
        assert!(e.contains("DEEPEP_KERNELS_TRAP_ON_ERROR=\"yes\"") && e.contains("use 1"), "{e}");
    }
}
