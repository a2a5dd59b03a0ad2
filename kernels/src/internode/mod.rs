//! Internode normal-mode dispatch/combine: DeepEP's two-hop scheme over NVSHMEM's public device
//! API (`cuda/nvshmem/internode.cu`). Design, ordering and limits: `docs/internode.md`.
//!
//! ```text
//! let rt = nvshmem_runtime(&gpu, &comm)?;                                 // once per process
//! let mut buf = InternodeBuffer::new(&gpu, &comm, &rt, InternodeConfig::new(ranks_per_host, max_tokens, hidden))?;
//! let out = buf.dispatch(DispatchArgs::fresh(&x, &topk_idx, &topk_w, num_experts))?;   // notify + dispatch
//! let y = expert_ffn(&out.recv_x);
//! let comb = buf.combine(CombineArgs::new(&y, &out.handle).weights(out.recv_topk_weights.as_ref().unwrap()))?;
//! let again = buf.dispatch(DispatchArgs::cached(&x2, &out.handle))?;     // no CPU sync
//! ```
//!
//! The API mirrors the intranode `Buffer` (same argument builders, output fields, stream/event
//! handling, poisoning after an error). Differences: routing comes straight from `topk_idx` (the
//! notify kernel computes the layout itself), the received tensors are owned (not views), and
//! the channel count (`num_sms / 2`) is fixed per buffer because handles store per-channel
//! offsets. Every rank must issue the same sequence of calls.
//!
//! - [`plan`]: limits, [`InternodeConfig`] and its validation, buffer/handle layouts and the
//!   kernels' parameter block (pure, CPU-tested).

pub mod plan;

pub use plan::{InternodeArgs, InternodeConfig, SymLayout};

use crate::common::{record_event, wait_event, Poison};
use crate::cubins;
use crate::error::EpError;
use crate::nvshmem::binding::SymmetricBuffer;
use crate::nvshmem::knobs::KnobRequest;
use crate::nvshmem::NvshmemRuntime;
use crate::runtime::{Comm, Gpu, HostMapped, Kernel, LaunchCfg};
use crate::tensor::{DType, Tensor, TensorInfo};
use crate::Result;
use cudarc::driver::CudaEvent;
use plan::{HandleLayout, BARRIER_THREADS, NOTIFY_THREADS, THREADS};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

// SAFETY: repr(C), only integer fields, copied by value into the kernel parameter.
unsafe impl crate::runtime::Pod for InternodeArgs {}

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

use crate::args::bad;

// ---- NVSHMEM start-up ------------------------------------------------------------------------

/// The process' NVSHMEM runtime (see [`crate::nvshmem::runtime`]), started with DeepEP's
/// internode knobs (24 QPs per PE; user-exported values win) if this is the first NVSHMEM user
/// of the process. Collective: every rank calls it at the same point.
pub fn nvshmem_runtime(gpu: &Gpu, comm: &Comm) -> Result<Arc<NvshmemRuntime>> {
    crate::nvshmem::runtime(gpu, comm, &KnobRequest::internode(24))
}

// ---- API types (mirroring the intranode ones) ----------------------------------------------

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
    /// H of the dispatched rows (combine takes rows of the same width).
    pub hidden: usize,
    /// `[L]`: received selections per local expert, aligned up to `expert_alignment`.
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// Device arrays (`send_slot`, `send_lmask`, `send_off`, `recv_off`, `rdma_off`, `fwd_base`,
    /// `fwd_mask`; see [`HandleLayout`]).
    storage: Tensor,
    layout: HandleLayout,
    /// i32 `[M]`: position of each received row in its source rank's `x`.
    pub recv_src_idx: Tensor,
}

impl Handle {
    /// Download `recv_off` (`[R][C+1]` output row offsets per source rank and channel; exactly
    /// `R·(C+1)` values, without the alignment padding that follows them in the handle's storage).
    pub fn recv_offsets(&self) -> Result<Vec<i32>> {
        let all: Vec<u8> = self.storage.to_host()?;
        Ok(all[self.layout.recv_off..self.layout.recv_off_end]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }
}

/// Routing of one dispatch call.
#[derive(Debug, Clone, Copy)]
pub enum Routing<'a> {
    /// From this batch's top-k (runs notify; blocks the host until the counts are known).
    Fresh {
        topk_idx: &'a Tensor,
        topk_weights: Option<&'a Tensor>,
        num_experts: usize,
        expert_alignment: usize,
    },
    /// Reuse an earlier dispatch's routing (same tokens, same destinations): no top-k, weights
    /// or counts in the output (DeepEP's cached mode), no CPU sync.
    Cached(&'a Handle),
}

/// Arguments of [`InternodeBuffer::dispatch`].
#[derive(Debug, Clone, Copy)]
pub struct DispatchArgs<'a> {
    /// `[N, H]` bf16, or fp8-e4m3 with `scales`.
    pub x: &'a Tensor,
    /// f32 `[N, H/128]` row-major, FP8 only.
    pub scales: Option<&'a Tensor>,
    pub routing: Routing<'a>,
    /// Event the stream waits for before the first kernel.
    pub wait: Option<&'a CudaEvent>,
}

impl<'a> DispatchArgs<'a> {
    /// Fresh dispatch of `x` with `expert_alignment` 1.
    pub fn fresh(
        x: &'a Tensor,
        topk_idx: &'a Tensor,
        topk_weights: &'a Tensor,
        num_experts: usize,
    ) -> Self {
        DispatchArgs {
            x,
            scales: None,
            routing: Routing::Fresh {
                topk_idx,
                topk_weights: Some(topk_weights),
                num_experts,
                expert_alignment: 1,
            },
            wait: None,
        }
    }
    /// Cached dispatch with `handle`.
    pub fn cached(x: &'a Tensor, handle: &'a Handle) -> Self {
        DispatchArgs {
            x,
            scales: None,
            routing: Routing::Cached(handle),
            wait: None,
        }
    }
    pub fn scales(mut self, scales: &'a Tensor) -> Self {
        self.scales = Some(scales);
        self
    }
    pub fn expert_alignment(mut self, a: usize) -> Self {
        if let Routing::Fresh {
            expert_alignment, ..
        } = &mut self.routing
        {
            *expert_alignment = a;
        }
        self
    }
    pub fn wait(mut self, event: &'a CudaEvent) -> Self {
        self.wait = Some(event);
        self
    }
}

/// Result of [`InternodeBuffer::dispatch`]: the intranode output struct with the internode
/// [`Handle`]; the tensors are owned (not views into a communication buffer).
pub type DispatchOutput = crate::intranode::DispatchOutput<Handle>;

/// Arguments of [`InternodeBuffer::combine`].
#[derive(Debug, Clone, Copy)]
pub struct CombineArgs<'a> {
    /// bf16 `[M, H]`, rows in the order of the dispatch's `recv_x`.
    pub y: &'a Tensor,
    pub handle: &'a Handle,
    /// f32 `[M, K]` (e.g. `recv_topk_weights`): summed per origin token into `combined_topk_weights`.
    pub topk_weights: Option<&'a Tensor>,
    /// bf16 `[N, H]` added once per token (in f32, before the host partials).
    pub bias0: Option<&'a Tensor>,
    pub bias1: Option<&'a Tensor>,
    pub wait: Option<&'a CudaEvent>,
}

impl<'a> CombineArgs<'a> {
    pub fn new(y: &'a Tensor, handle: &'a Handle) -> Self {
        CombineArgs {
            y,
            handle,
            topk_weights: None,
            bias0: None,
            bias1: None,
            wait: None,
        }
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
    pub fn wait(mut self, event: &'a CudaEvent) -> Self {
        self.wait = Some(event);
        self
    }
}

/// Result of [`InternodeBuffer::combine`] (the same struct as the intranode mode's).
pub use crate::intranode::CombineOutput;

struct Kernels {
    notify: Kernel,
    cached_notify: Kernel,
    dispatch: Kernel,
    combine: Kernel,
}

/// The per-rank internode buffer (collective: every rank creates it with the same config, in
/// the same order relative to other symmetric allocations, and drops it in the same order).
pub struct InternodeBuffer<'g> {
    gpu: &'g Gpu,
    rank: usize,
    world: usize,
    cfg: InternodeConfig,
    sym_layout: SymLayout,
    // Field order = drop order: the symmetric buffer goes before the NVSHMEM runtime.
    sym: SymmetricBuffer,
    _rt: Arc<NvshmemRuntime>,
    counters: HostMapped<i32>,
    kernels: Kernels,
    /// Sequence number of the last collective kernel (same on every rank; signals compare >=).
    seq: u64,
    /// Combines issued so far (selects the staging half).
    combines: u64,
    id: u64,
    poisoned: Poison,
    /// Fill every freshly allocated output with this byte before the kernel runs (tests).
    output_poison: Option<u8>,
}

impl<'g> std::fmt::Debug for InternodeBuffer<'g> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "InternodeBuffer(rank {}/{}, {} hosts x {}, {} B symmetric, seq {})",
            self.rank,
            self.world,
            self.sym_layout.num_hosts,
            self.cfg.ranks_per_host,
            self.sym_layout.total,
            self.seq
        )
    }
}

fn expect_2d(
    what: &str,
    t: &TensorInfo,
    dtypes: &[DType],
    rows: usize,
    cols: Option<usize>,
    fix: &str,
) -> Result<usize> {
    let ok_dtype = dtypes.contains(&t.dtype);
    let ok_shape =
        t.shape.len() == 2 && t.shape[0] == rows && cols.map_or(true, |c| t.shape[1] == c);
    if !ok_dtype || !ok_shape || !t.is_contiguous() {
        let want_dt: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        let want_cols = cols.map_or("*".to_string(), |c| c.to_string());
        return bad(format!(
            "internode: {what} is {} {:?}{}, expected {} [{rows}, {want_cols}] contiguous; {fix}",
            t.dtype.name(),
            t.shape,
            if t.is_contiguous() { "" } else { " (strided)" },
            want_dt.join(" or "),
        ));
    }
    Ok(t.shape[1])
}

impl<'g> InternodeBuffer<'g> {
    /// Allocate the symmetric buffer for `cfg` (validated first), check that the ranks of each
    /// host reach each other by loads/stores, and register the kernels with NVSHMEM.
    pub fn new(
        gpu: &'g Gpu,
        comm: &Comm,
        rt: &Arc<NvshmemRuntime>,
        cfg: InternodeConfig,
    ) -> Result<InternodeBuffer<'g>> {
        let nv = rt.nv();
        let (rank, world) = (comm.rank(), comm.world());
        cfg.validate(world, Some(gpu.sm_count() as usize))?;
        if nv.my_pe() != rank || nv.n_pes() != world {
            return bad(format!(
                "NVSHMEM has this process as PE {} of {}, the rendezvous as rank {rank} of {world}; start NVSHMEM with the same ranks (nvshmem_runtime)",
                nv.my_pe(),
                nv.n_pes()
            ));
        }
        // Same configuration everywhere (the layout must be symmetric).
        let mine = format!("{cfg:?}");
        for (r, other) in comm.all_gather(mine.as_bytes())?.iter().enumerate() {
            if other.as_slice() != mine.as_bytes() {
                return bad(format!(
                    "rank {r} created its InternodeBuffer with {} but rank {rank} with {mine}; pass the same configuration on every rank",
                    String::from_utf8_lossy(other)
                ));
            }
        }
        cubins::require("internode")?;
        let sym_layout = SymLayout::new(&cfg, world)?;
        let sym = nv.alloc(sym_layout.total, 128)?;
        // Zero the signals, then make sure every rank did before anyone signals.
        gpu.memset_u8(
            sym.ptr() + sym_layout.bar_sig as u64,
            0,
            sym_layout.signals_end,
        )?;
        gpu.sync("zeroing the internode signals")?;
        nv.barrier_all();
        let p = cfg.ranks_per_host;
        let host0 = rank / p * p;
        for pe in host0..host0 + p {
            if sym.peer_ptr(pe).is_none() {
                return bad(format!(
                    "rank {rank} cannot reach rank {pe} of its host by loads/stores (nvshmem_ptr is null), but ranks_per_host {p} \
                     needs NVLink/P2P between the GPUs of a host; unset NVSHMEM_DISABLE_P2P, check that the GPUs of a host see \
                     each other (nvidia-smi topo -m), or use ranks_per_host 1"
                ));
            }
        }
        // Loaded and registered with NVSHMEM once per process.
        rt.module(gpu, "internode")?;
        let counters = HostMapped::new(gpu.ctx(), 2 + cfg.max_local_experts)?;
        let kernels = Kernels {
            notify: gpu.kernel("internode", "internode_notify")?,
            cached_notify: gpu.kernel("internode", "internode_cached_notify")?,
            dispatch: gpu.kernel("internode", "internode_dispatch")?,
            combine: gpu.kernel("internode", "internode_combine")?,
        };
        tracing::debug!(
            rank,
            world,
            ?cfg,
            bytes = sym_layout.total,
            "internode buffer"
        );
        Ok(InternodeBuffer {
            gpu,
            rank,
            world,
            cfg,
            sym_layout,
            sym,
            _rt: rt.clone(),
            counters,
            kernels,
            seq: 0,
            combines: 0,
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            poisoned: Poison::new(),
            output_poison: None,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn num_ranks(&self) -> usize {
        self.world
    }
    pub fn config(&self) -> &InternodeConfig {
        &self.cfg
    }
    pub fn sym_layout(&self) -> &SymLayout {
        &self.sym_layout
    }
    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }
    /// An event recorded on the GPU's stream after the work queued so far (the calls record none
    /// of their own), as the intranode `Buffer::record_event`.
    pub fn record_event(&self) -> Result<CudaEvent> {
        record_event(self.gpu)
    }

    /// Diagnostic hook (GPU tests, `deepep-kernels-harness`): fill every output tensor with
    /// `byte` before the kernel that writes it runs, so that an element the kernel fails to
    /// write is caught by an exact comparison. Off (`None`) by default.
    pub fn set_output_poison(&mut self, byte: Option<u8>) {
        self.output_poison = byte;
    }

    fn new_output(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let t = Tensor::empty(self.gpu.stream(), dtype, shape)?;
        if let Some(b) = self.output_poison {
            t.fill_bytes(b)?;
        }
        Ok(t)
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn base_args(&self) -> InternodeArgs {
        InternodeArgs::base(&self.sym_layout, self.rank, self.sym.ptr())
    }

    fn grid(&self) -> LaunchCfg {
        // Pullers/receivers wait for other ranks' senders/forwarders: all blocks co-resident.
        LaunchCfg::new(self.cfg.num_sms as u32, THREADS).cooperative(true)
    }

    fn launch_cached_notify(&mut self, args: &InternodeArgs) -> Result<()> {
        self.gpu.launch(
            &self.kernels.cached_notify,
            &LaunchCfg::new(1, BARRIER_THREADS),
            crate::args![*args],
        )
    }

    /// Dispatch (see module docs). Validates everything before launching anything.
    pub fn dispatch(&mut self, a: DispatchArgs<'_>) -> Result<DispatchOutput> {
        self.poisoned.check(self.gpu, "this InternodeBuffer")?;
        a.x.check_valid()?;
        let (n, hidden) = match a.x.shape() {
            [n, h] => (*n, *h),
            s => {
                return bad(format!(
                    "internode: x has shape {s:?}, expected [N, H]; pass a 2-D tensor"
                ))
            }
        };
        let dtype = a.x.dtype();
        let (k, num_experts) = match a.routing {
            Routing::Fresh {
                topk_idx,
                num_experts,
                ..
            } => {
                let k = topk_idx.shape().get(1).copied().unwrap_or(0);
                (k, num_experts)
            }
            Routing::Cached(h) => (0, h.num_experts),
        };
        // A cached dispatch moves no top-k; check the record size for one slot.
        let k_check = if matches!(a.routing, Routing::Cached(_)) {
            1
        } else {
            k
        };
        plan::check_dispatch(
            &self.sym_layout,
            n,
            hidden,
            k_check,
            num_experts,
            dtype,
            self.cfg.max_local_experts,
        )?;
        expect_2d(
            "x",
            a.x.info(),
            &[DType::Bf16, DType::Fp8E4m3],
            n,
            Some(hidden),
            "pass bf16 or fp8-e4m3 rows",
        )?;
        let s_cols = plan::num_scales(dtype, hidden);
        match (dtype, a.scales) {
            (DType::Fp8E4m3, Some(s)) => {
                s.check_valid()?;
                expect_2d(
                    "scales",
                    s.info(),
                    &[DType::F32],
                    n,
                    Some(s_cols),
                    "pass f32 scales [N, H/128] in row-major order",
                )?;
            }
            (DType::Fp8E4m3, None) => {
                return bad(
                    "internode: FP8 x needs scales f32 [N, H/128]; pass .scales(&scales)".into(),
                )
            }
            (_, Some(_)) => {
                return bad(
                    "internode: scales were given for bf16 x; pass scales only with fp8-e4m3 x"
                        .into(),
                )
            }
            _ => {}
        }
        match a.routing {
            Routing::Fresh {
                topk_idx,
                topk_weights,
                expert_alignment,
                ..
            } => {
                topk_idx.check_valid()?;
                expect_2d(
                    "topk_idx",
                    topk_idx.info(),
                    &[DType::I64],
                    n,
                    Some(k),
                    "pass i64 [N, K] expert ids (-1 = unused)",
                )?;
                if let Some(w) = topk_weights {
                    w.check_valid()?;
                    expect_2d(
                        "topk_weights",
                        w.info(),
                        &[DType::F32],
                        n,
                        Some(k),
                        "pass f32 [N, K] weights",
                    )?;
                }
                crate::validate::expert_alignment(expert_alignment)?;
            }
            Routing::Cached(h) => {
                if h.buffer != self.id {
                    return bad("internode: the handle comes from another InternodeBuffer; use the handle of a dispatch on this buffer".into());
                }
                if h.hidden != hidden {
                    return bad(format!(
                        "internode cached dispatch of rows with hidden {hidden} with a handle made for hidden {}; pass rows of the same width",
                        h.hidden
                    ));
                }
                if h.num_tokens != n {
                    return bad(format!(
                        "internode cached dispatch of {n} tokens with a handle made for {} tokens; pass the same tokens (x rows) as the dispatch that made the handle",
                        h.num_tokens
                    ));
                }
            }
        }
        wait_event(self.gpu, a.wait)?;
        let r = match a.routing {
            Routing::Fresh {
                topk_idx,
                topk_weights,
                num_experts,
                expert_alignment,
            } => self.dispatch_fresh(
                &a,
                n,
                hidden,
                k,
                topk_idx,
                topk_weights,
                num_experts,
                expert_alignment,
            ),
            Routing::Cached(h) => self.dispatch_cached(&a, n, hidden, h),
        };
        match r {
            Ok(o) => Ok(o),
            Err(e) => self.poisoned.record(e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn dispatch_fresh(
        &mut self,
        a: &DispatchArgs<'_>,
        n: usize,
        hidden: usize,
        k: usize,
        topk_idx: &Tensor,
        topk_weights: Option<&Tensor>,
        num_experts: usize,
        expert_alignment: usize,
    ) -> Result<DispatchOutput> {
        let s = self.gpu.stream().clone();
        let hl = HandleLayout::new(&self.sym_layout, n);
        let storage = Tensor::empty(&s, DType::U8, &[hl.total])?;
        let seq = self.next_seq();
        let mut args = self.base_args().with_handle(&hl, storage.ptr());
        args = args.with_seq(&self.sym_layout, seq);
        args.num_tokens = n as i32;
        args.topk = k as i32;
        args.num_experts = num_experts as i32;
        args.expert_alignment = expert_alignment as i32;
        args.topk_idx = topk_idx.ptr();
        args.host_counters = self.counters.dev_ptr();
        self.counters.set(0, -1);
        self.gpu.launch(
            &self.kernels.notify,
            &LaunchCfg::new(1, NOTIFY_THREADS),
            crate::args![args],
        )?;
        self.wait_counts(seq)?;
        let m = self.counters.get(1) as usize;
        let l = num_experts / self.world;
        let per_expert: Vec<usize> = (0..l).map(|e| self.counters.get(2 + e) as usize).collect();
        let out = self.launch_dispatch(args, a, n, hidden, m, Some((topk_idx, topk_weights, k)))?;
        let (recv_x, recv_scales, recv_topk, recv_src_idx) = out;
        let (recv_topk_idx, recv_topk_weights) = match recv_topk {
            Some((i, w)) => (Some(i), Some(w)),
            None => (None, None),
        };
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
                num_experts,
                hidden,
                num_recv_tokens_per_expert: per_expert,
                storage,
                layout: hl,
                recv_src_idx,
            },
            lease: None,
        })
    }

    fn dispatch_cached(
        &mut self,
        a: &DispatchArgs<'_>,
        n: usize,
        hidden: usize,
        h: &Handle,
    ) -> Result<DispatchOutput> {
        let seq = self.next_seq();
        let mut args = self.base_args().with_handle(&h.layout, h.storage.ptr());
        args = args.with_seq(&self.sym_layout, seq);
        args.num_tokens = n as i32;
        args.topk = 0;
        args.num_experts = h.num_experts as i32;
        // Buffer reuse: everyone must have finished the previous call (notify does this for a
        // fresh dispatch).
        self.launch_cached_notify(&args)?;
        let (recv_x, recv_scales, _, _) =
            self.launch_dispatch(args, a, n, hidden, h.num_recv_tokens, None)?;
        Ok(DispatchOutput {
            recv_x,
            recv_scales,
            recv_topk_idx: None,
            recv_topk_weights: None,
            num_recv_tokens_per_expert: Vec::new(),
            handle: h.clone(),
            lease: None,
        })
    }

    /// Spin on the host-mapped counters until notify published this call's counts (DeepEP's CPU
    /// handoff: no stream sync, the dispatch launch follows at once; notify's intra-host stage
    /// may still run, the dispatch kernel is ordered after it on the stream). A device-side error
    /// or the host timeout ends the wait with the error of a full stream sync.
    fn wait_counts(&self, seq: u64) -> Result<()> {
        let want = (seq & 0x7fff_ffff) as i32;
        let start = std::time::Instant::now();
        let limit = self.gpu.host_timeout();
        let mut spins = 0u32;
        while self.counters.get(0) != want {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                // A fatal record ends the wait at once (sync returns it without waiting for the
                // stream); a dropped bad id does not (notify completes and publishes).
                if self.gpu.fatal_recorded() || start.elapsed() > limit {
                    self.gpu.sync("internode notify")?;
                    if self.counters.get(0) == want {
                        break;
                    }
                    return Err(EpError::Cuda {
                        context: format!("rank {}: internode notify", self.rank),
                        message: "the notify kernel finished without publishing its counts (no device error recorded); rerun with RUST_LOG=debug".into(),
                    });
                }
                if start.elapsed() > std::time::Duration::from_millis(1) {
                    std::thread::yield_now();
                }
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    #[allow(clippy::type_complexity)]
    fn launch_dispatch(
        &mut self,
        mut args: InternodeArgs,
        a: &DispatchArgs<'_>,
        n: usize,
        hidden: usize,
        m: usize,
        topk: Option<(&Tensor, Option<&Tensor>, usize)>,
    ) -> Result<(Tensor, Option<Tensor>, Option<(Tensor, Tensor)>, Tensor)> {
        let dtype = a.x.dtype();
        let sc = plan::num_scales(dtype, hidden);
        let recv_x = self.new_output(dtype, &[m, hidden])?;
        let recv_scales = if sc > 0 {
            Some(self.new_output(DType::F32, &[m, sc])?)
        } else {
            None
        };
        let recv_src_idx = self.new_output(DType::I32, &[m])?;
        let recv_topk = match topk {
            Some((_, _, k)) => Some((
                self.new_output(DType::I64, &[m, k])?,
                self.new_output(DType::F32, &[m, k])?,
            )),
            None => None,
        };
        args.num_tokens = n as i32;
        args.num_recv = m as i32;
        args.hidden = hidden as i32;
        args.elem_bytes = dtype.size() as i32;
        args.num_scales = sc as i32;
        args.x = a.x.ptr();
        args.x_scales = a.scales.map_or(0, |t| t.ptr());
        if let Some((idx, w, _)) = topk {
            args.topk_idx = idx.ptr();
            args.topk_weights = w.map_or(0, |t| t.ptr());
        }
        args.recv_x = recv_x.ptr();
        args.recv_scales = recv_scales.as_ref().map_or(0, |t| t.ptr());
        args.recv_src_idx = recv_src_idx.ptr();
        if let Some((i, w)) = &recv_topk {
            args.recv_topk_idx = i.ptr();
            args.recv_topk_weights = w.ptr();
        }
        self.gpu
            .launch(&self.kernels.dispatch, &self.grid(), crate::args![args])?;
        Ok((recv_x, recv_scales, recv_topk, recv_src_idx))
    }

    /// Combine into new output tensors: `combined_x` bf16 `[N, H]`, and `combined_topk_weights`
    /// f32 `[N, K]` when `topk_weights` is given. Never blocks the host.
    pub fn combine(&mut self, a: CombineArgs<'_>) -> Result<CombineOutput> {
        self.poisoned.check(self.gpu, "this InternodeBuffer")?;
        let h = a.handle;
        let hidden = h.hidden;
        for t in [Some(a.y), a.topk_weights, a.bias0, a.bias1]
            .into_iter()
            .flatten()
        {
            t.check_valid()?;
        }
        if h.buffer != self.id {
            return bad("internode combine: the handle comes from another InternodeBuffer; use the handle of a dispatch on this buffer".into());
        }
        let (m, n) = (h.num_recv_tokens, h.num_tokens);
        expect_2d(
            "y",
            a.y.info(),
            &[DType::Bf16],
            m,
            Some(hidden),
            "pass bf16 rows aligned with the dispatch's recv_x",
        )?;
        let k = match a.topk_weights {
            Some(w) => {
                let k = expect_2d(
                    "topk_weights",
                    w.info(),
                    &[DType::F32],
                    m,
                    None,
                    "pass f32 [M, K] (e.g. recv_topk_weights)",
                )?;
                if k == 0 || k > self.cfg.max_topk {
                    return bad(format!(
                        "internode combine: topk_weights has {k} columns; the buffer supports 1..={}",
                        self.cfg.max_topk
                    ));
                }
                k
            }
            None => 0,
        };
        for (what, b) in [("bias0", a.bias0), ("bias1", a.bias1)] {
            if let Some(b) = b {
                expect_2d(
                    what,
                    b.info(),
                    &[DType::Bf16],
                    n,
                    Some(hidden),
                    "pass bf16 [N, H] for this rank's tokens",
                )?;
            }
        }
        if self.cfg.ranks_per_host > 1 && m > self.sym_layout.max_recv {
            return bad(format!(
                "internode combine of {m} received rows exceeds the buffer's max_recv_tokens {}; create the buffer with max_recv_tokens >= {m}",
                self.sym_layout.max_recv
            ));
        }
        wait_event(self.gpu, a.wait)?;
        match self.launch_combine(&a, m, n, k) {
            Ok(o) => Ok(o),
            Err(e) => self.poisoned.record(e),
        }
    }

    fn launch_combine(
        &mut self,
        a: &CombineArgs<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<CombineOutput> {
        let hidden = a.handle.hidden;
        let out = self.new_output(DType::Bf16, &[n, hidden])?;
        let out_w = if k > 0 {
            Some(self.new_output(DType::F32, &[n, k])?)
        } else {
            None
        };
        let parity = (self.combines % 2) as usize;
        self.combines += 1;
        let seq = self.next_seq();
        let mut args = self
            .base_args()
            .with_handle(&a.handle.layout, a.handle.storage.ptr());
        args = args.with_seq(&self.sym_layout, seq);
        args.num_tokens = n as i32;
        args.num_recv = m as i32;
        args.hidden = hidden as i32;
        args.topk = k as i32;
        args.num_experts = a.handle.num_experts as i32;
        args.comb_parity = parity as i32;
        // Stage this rank's rows (and weights) where the other forwarders of its host read them
        // (this rank's own forwarder reads `y` directly; with one GPU per host nobody else
        // does). The half alternates per combine; the barrier below orders the copy before any
        // peer read.
        if self.cfg.ranks_per_host > 1 && m > 0 {
            let stage_x = args.comb_in + (parity * self.sym_layout.comb_in_half) as u64;
            self.gpu.copy_dtod(stage_x, a.y.ptr(), m * hidden * 2)?;
            if let Some(w) = a.topk_weights {
                let stage_w = args.comb_w + (parity * self.sym_layout.comb_w_half * 4) as u64;
                self.gpu.copy_dtod(stage_w, w.ptr(), m * k * 4)?;
            }
        }
        args.comb_y = a.y.ptr();
        args.comb_yw = a.topk_weights.map_or(0, |t| t.ptr());
        args.comb_bias0 = a.bias0.map_or(0, |t| t.ptr());
        args.comb_bias1 = a.bias1.map_or(0, |t| t.ptr());
        args.combined_x = out.ptr();
        args.combined_w = out_w.as_ref().map_or(0, |t| t.ptr());
        self.launch_cached_notify(&args)?;
        self.gpu
            .launch(&self.kernels.combine, &self.grid(), crate::args![args])?;
        Ok(CombineOutput {
            combined_x: out,
            combined_topk_weights: out_w,
        })
    }
}
