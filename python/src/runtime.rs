//! `Runtime`: the binding of one [`RankContext`] (kernels/src/context), which owns the rank's
//! state. Each `Buffer` call is one call here: it raises what this Buffer's kernels recorded,
//! reads the caller's tensors ([`doorway`]; the kernels crate's checks accept or refuse them),
//! joins the comm stream after the caller's stream or event, launches through the context, makes
//! every output a torch tensor ([`outputs`]) and joins back (or records the event the caller's
//! `async_finish` asks for). `python/deepep_kernels/buffer.py` keeps DeepEP's signatures and the
//! torch-side stream bookkeeping (`record_stream`, `EventOverlap`).

use crate::handles::{Handle, InterHandle, LlPyHandle};
use crate::outputs;
use crate::{context_error, doorway, py_err, recorded_error, without_gil, Event, PyExchange};
use deepep_kernels::args::{Arg, CombineDims, Device, LlCombineDims};
use deepep_kernels::context::{self, NormalDispatch, RankContext, Sizes};
use deepep_kernels::intranode::DispatchOutput;
use deepep_kernels::low_latency::LlDispatchOpts;
use deepep_kernels::tensor::{DType, Tensor};
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::sync::Arc;

/// What a normal-mode dispatch returns: `(recv_x, recv_x_scales, recv_topk_idx,
/// recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)`; the last five are None
/// for a cached dispatch, the event is None without `async_finish`.
type DispatchResult = (Py<PyAny>, Option<Py<PyAny>>, Option<Py<PyAny>>, Option<Py<PyAny>>, Option<Vec<usize>>, Option<Py<PyAny>>, Option<Event>);
/// What a combine returns: `(combined_x, combined_topk_weights, event)`.
type CombineResult = (Py<PyAny>, Option<Py<PyAny>>, Option<Event>);
/// What `get_dispatch_layout` returns: `(num_tokens_per_rank, num_tokens_per_expert,
/// is_token_in_rank, event, whether the layout kernel ran)`.
type LayoutResult = (Py<PyAny>, Py<PyAny>, Py<PyAny>, Option<Event>, bool);
/// What `ll_dispatch` returns: `(recv_x, recv_scales or None, recv_count, handle, hook)`.
type LlDispatchResult = (Py<PyAny>, Py<PyAny>, Py<PyAny>, LlPyHandle, Option<NativeHook>);

/// The receive half of a low-latency call made with `return_recv_hook` (launch once).
#[pyclass(module = "deepep_kernels._native")]
pub struct NativeHook {
    hook: Option<deepep_kernels::low_latency::LlHook>,
    runtime_id: u64,
    /// The low-latency buffer's generation at the call: a re-created or destroyed buffer refuses it.
    generation: u64,
}

/// Keeps the memory of views alive: an intranode dispatch's arena lease (or, in the views mode,
/// its outputs until the next dispatch).
#[pyclass(module = "deepep_kernels._native", frozen)]
pub struct Keep {
    _out: DispatchOutput,
}

crate::thread_safe!(NativeHook, Keep);

/// A caller's tensor as an [`Arg`] of this device (for outputs made here).
fn arg_of(t: &Bound<'_, PyAny>, dtype: DType, shape: &[usize], device: usize) -> PyResult<Arg> {
    Ok(Arg::contiguous(dtype, shape, t.call_method0("data_ptr")?.extract()?, Device::Cuda(device)))
}

/// One rank's Buffer state: the rank context plus the torch views of the low-latency outputs.
#[pyclass(module = "deepep_kernels._native")]
pub struct Runtime {
    ctx: RankContext,
    /// Torch views of the low-latency outputs by (packed_recv_x address, FP8, UE8M0), made once per
    /// buffer half and format; valid for the low-latency generation `ll_views_generation`.
    ll_views: std::collections::HashMap<(u64, bool, bool), [Py<PyAny>; 3]>,
    ll_views_generation: u64,
}

impl Runtime {
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        context_error(py, &self.ctx).map_or(Ok(()), Err)
    }
    fn end(&mut self, async_finish: bool, stream: u64) -> PyResult<Option<Event>> {
        Ok(self.ctx.end(async_finish, Some(stream)).map_err(py_err)?.map(Event::from))
    }
    /// Torch views `[recv_x, recv_scales (None for BF16), recv_count]` of the outputs of the
    /// low-latency dispatch whose `packed_recv_x` is at `recv_x`, made once per buffer half and
    /// format and cached. They own nothing: the memory lives as long as the low-latency buffer,
    /// whose re-creation or destroy (a new generation) drops the cache, so no view can delay the
    /// collective free of the symmetric memory.
    fn ll_views(&mut self, py: Python<'_>, recv_x: u64, use_fp8: bool, use_ue8m0: bool) -> PyResult<[Py<PyAny>; 3]> {
        let generation = self.ctx.generations().ll;
        if self.ll_views_generation != generation {
            self.ll_views.clear();
            self.ll_views_generation = generation;
        }
        if let Some(v) = self.ll_views.get(&(recv_x, use_fp8, use_ue8m0)) {
            return Ok([v[0].clone_ref(py), v[1].clone_ref(py), v[2].clone_ref(py)]);
        }
        let device = self.ctx.device();
        let ll = self.ctx.ll().ok_or_else(|| PyRuntimeError::new_err("the low-latency buffer is not created"))?;
        let (base, _) = ll.local_buffer();
        let lay = ll.layout();
        let half = recv_x
            .checked_sub(base)
            .and_then(|off| lay.dispatch_half_at(off))
            .ok_or_else(|| PyRuntimeError::new_err(format!("{recv_x:#x} is not the packed_recv_x of a low-latency dispatch on this Buffer")))?;
        let d = &lay.dispatch[half];
        let shape = lay.recv_x_shape().to_vec();
        let x = outputs::view(py, recv_x, if use_fp8 { DType::Fp8E4m3 } else { DType::Bf16 }, &shape, None, device)?;
        let scales = if use_fp8 {
            let (dtype, sshape) = lay.recv_scales_layout(use_ue8m0);
            let phys = outputs::view(py, base + d.scales as u64, dtype, &sshape, None, device)?;
            // [L, R*num_max, S] with the last two dims column-major, as DeepEP
            phys.call_method1("transpose", (1, 2))?.unbind()
        } else {
            py.None()
        };
        let count = outputs::view(py, base + d.recv_count as u64, DType::I32, &shape[..1], None, device)?;
        let v = [x.unbind(), scales, count.unbind()];
        let out = [v[0].clone_ref(py), v[1].clone_ref(py), v[2].clone_ref(py)];
        self.ll_views.insert((recv_x, use_fp8, use_ue8m0), v);
        Ok(out)
    }
    /// The outputs of an intranode dispatch as torch tensors: views of its arena region or of the
    /// fixed receive region (`views`), which keep `out` alive, or copies queued on the comm stream
    /// padded to `rows` (ids -1 and weights 0 in the padding, as DeepEP).
    #[allow(clippy::type_complexity)]
    fn intra_outputs(&self, py: Python<'_>, out: DispatchOutput, rows: usize, views: bool) -> PyResult<(Py<PyAny>, Option<Py<PyAny>>, Option<Py<PyAny>>, Option<Py<PyAny>>)> {
        let dev = self.ctx.device();
        let m = out.recv_x.shape()[0];
        if views || out.lease.is_some() {
            if rows != m {
                return Err(PyNotImplementedError::new_err(format!(
                    "deepep_kernels does not support num_worst_tokens with {}=1: views of the NVLink buffer cannot be padded to the \
                     worst-case row count; unset it for this call's Buffer",
                    crate::settings::DISPATCH_VIEWS_ENV
                )));
            }
            let parts = [Some(out.recv_x.clone()), out.recv_scales.clone(), out.recv_topk_idx.clone(), out.recv_topk_weights.clone()];
            let owner: Py<PyAny> = Py::new(py, Keep { _out: out })?.into_any();
            let v = |t: &Option<Tensor>| -> PyResult<Option<Py<PyAny>>> { t.as_ref().map(|t| outputs::view_of(py, t, &owner, dev).map(Bound::unbind)).transpose() };
            return Ok((v(&parts[0])?.expect("recv_x"), v(&parts[1])?, v(&parts[2])?, v(&parts[3])?));
        }
        self.copies(py, [Some(&out.recv_x), out.recv_scales.as_ref(), out.recv_topk_idx.as_ref(), out.recv_topk_weights.as_ref()], rows)
    }
    /// Torch-owned copies (queued on the comm stream) of `[x, scales, idx, weights]`, padded to `rows`.
    #[allow(clippy::type_complexity)]
    fn copies(&self, py: Python<'_>, t: [Option<&Tensor>; 4], rows: usize) -> PyResult<(Py<PyAny>, Option<Py<PyAny>>, Option<Py<PyAny>>, Option<Py<PyAny>>)> {
        let (dev, s) = (self.ctx.device(), self.ctx.gpu().cu_stream());
        let c = |t: Option<&Tensor>, pad: Option<u8>| -> PyResult<Option<Py<PyAny>>> { t.map(|t| outputs::copy_out(py, t, rows, pad, s, dev).map(Bound::unbind)).transpose() };
        Ok((c(t[0], None)?.expect("recv_x"), c(t[1], None)?, c(t[2], Some(0xff))?, c(t[3], Some(0))?))
    }
}

#[pymethods]
impl Runtime {
    /// Bind `device` (torch's current device ordinal) for `rank` of `world` and use `all_gather`
    /// (a `bytes -> list[bytes]` callable over the caller's process group) for every exchange.
    /// `ranks_per_gpu` ranks share the device (1 normally): grids use this rank's share of SMs.
    #[new]
    #[pyo3(signature = (device, rank, world, local_rank, local_world, all_gather, ranks_per_gpu = 1))]
    fn new(device: usize, rank: usize, world: usize, local_rank: usize, local_world: usize, all_gather: Py<PyAny>, ranks_per_gpu: usize) -> PyResult<Runtime> {
        // Device errors come back through this context's host-mapped record, which every call
        // reports first; the context survives. DEEPEP_KERNELS_TRAP_ON_ERROR=1 makes a fatal record
        // trap instead (the context is lost; docs/python.md).
        let trap = context::parse_trap_env(std::env::var("DEEPEP_KERNELS_TRAP_ON_ERROR").ok().as_deref()).map_err(PyValueError::new_err)?;
        let ctx = RankContext::new(device, rank, world, local_rank, local_world, Arc::new(PyExchange { f: all_gather }), ranks_per_gpu, trap).map_err(py_err)?;
        Ok(Runtime { ctx, ll_views: Default::default(), ll_views_generation: 0 })
    }

    /// The Buffer's sizes and mode, for the capacity checks. `ranks_per_host`: the internode
    /// mode's hosts (0 within one host); `recv_arena_bytes`: the intranode receive arena (None:
    /// twice the fixed receive region).
    #[pyo3(signature = (num_nvl_bytes, num_rdma_bytes, low_latency_mode, ranks_per_host = 0, recv_arena_bytes = None))]
    fn set_buffer_sizes(&mut self, num_nvl_bytes: usize, num_rdma_bytes: usize, low_latency_mode: bool, ranks_per_host: usize, recv_arena_bytes: Option<usize>) {
        self.ctx.set_sizes(Sizes { num_nvl_bytes, num_rdma_bytes, low_latency_mode, ranks_per_host, recv_arena: recv_arena_bytes });
    }
    #[getter]
    fn rank(&self) -> usize {
        self.ctx.rank()
    }
    #[getter]
    fn world(&self) -> usize {
        self.ctx.world()
    }
    #[getter]
    fn device(&self) -> usize {
        self.ctx.device()
    }
    #[getter]
    fn sm_count(&self) -> u32 {
        self.ctx.gpu().sm_count()
    }
    /// Generation of the NVLink buffer (bumped by each creation).
    #[getter]
    fn intranode_generation(&self) -> u64 {
        self.ctx.generations().intra
    }
    /// Generation of the low-latency buffer (bumped by each re-creation and by `destroy`).
    #[getter]
    fn ll_generation(&self) -> u64 {
        self.ctx.generations().ll
    }
    /// Raw handle of the comm stream (wrap with `torch.cuda.ExternalStream`).
    fn comm_stream(&self) -> u64 {
        self.ctx.comm_stream()
    }

    /// Raise what this Buffer's kernels recorded, if anything: `DeviceArgumentError` once (the
    /// record is cleared), `PeerTimeoutError` or `DeviceError` every time until the Buffer is
    /// destroyed or dropped. Records of other Buffers are not looked at.
    fn check_error(&self, py: Python<'_>) -> PyResult<()> {
        self.check(py)
    }
    /// The exception a call that failed should raise instead, when this Buffer holds a fatal
    /// record (a host wait that ended because a kernel timed out); None otherwise.
    fn recorded_cause(&self, py: Python<'_>) -> Option<PyErr> {
        self.ctx.fatal_error().map(|e| recorded_error(py, crate::fatal_kind(&e), e.to_string()))
    }

    /// The comm stream waits for the work queued so far on `stream`.
    fn comm_wait_stream(&mut self, stream: u64) -> PyResult<()> {
        self.ctx.bind().and_then(|_| self.ctx.join_from(Some(stream))).map_err(py_err)
    }
    /// `stream` waits for the work queued so far on the comm stream.
    fn stream_wait_comm(&mut self, stream: u64) -> PyResult<()> {
        self.ctx.bind().and_then(|_| self.ctx.join_to(Some(stream))).map_err(py_err)
    }
    /// The end of a call whose last work the caller queued on the comm stream itself: with
    /// `async_finish` an event recorded on the comm stream, else `stream` waits for it (None).
    fn end_call(&mut self, async_finish: bool, stream: u64) -> PyResult<Option<Event>> {
        self.ctx.bind().map_err(py_err)?;
        self.end(async_finish, stream)
    }
    /// The comm stream waits for every low-latency call so far (which may have run on the
    /// callers' streams), e.g. before the caller records or waits on it.
    fn comm_after_ll(&self) -> PyResult<()> {
        self.ctx.bind().and_then(|_| self.ctx.comm_after_ll()).map_err(py_err)
    }

    /// Create (collectively) the NVLink buffer for up to `max_tokens` tokens per rank and rows of
    /// up to `hidden` channels (receive arena: `arena_bytes`, None: twice the receive region).
    #[pyo3(signature = (max_tokens, hidden, arena_bytes=None))]
    fn intranode_create(&mut self, py: Python<'_>, max_tokens: usize, hidden: usize, arena_bytes: Option<usize>) -> PyResult<()> {
        let ctx = &mut self.ctx;
        without_gil(py, || ctx.intranode_create(max_tokens, hidden, arena_bytes)).map_err(py_err)
    }
    /// The NVLink buffer for rows of `hidden` (created collectively when missing or made for another).
    fn intranode_ensure(&mut self, py: Python<'_>, hidden: usize) -> PyResult<()> {
        let ctx = &mut self.ctx;
        without_gil(py, || ctx.bind().and_then(|_| ctx.ensure_intra(hidden))).map_err(py_err)
    }
    /// (max_tokens, hidden) of the NVLink buffer, if created.
    fn intranode_dims(&self) -> Option<(usize, usize)> {
        self.ctx.intra_dims()
    }
    /// The receive arena's (capacity, free bytes, live leases), if the NVLink buffer has one.
    fn arena_usage(&self) -> Option<(usize, usize, usize)> {
        self.ctx.arena_usage()
    }
    /// Create (collectively) the internode buffer for `dims` = (ranks_per_host, max_tokens,
    /// hidden, num_sms, max_topk, max_local_experts); returns the configuration used.
    fn internode_create(&mut self, py: Python<'_>, dims: context::InterDims) -> PyResult<context::InterDims> {
        let ctx = &mut self.ctx;
        without_gil(py, || ctx.internode_create(dims)).map_err(py_err)
    }
    /// The internode buffer's configuration (as `internode_create` returns it).
    fn internode_dims(&self) -> Option<context::InterDims> {
        self.ctx.inter_dims()
    }
    /// The SM count an internode buffer created with `num_sms` would use on this rank.
    fn internode_fit_sms(&self, num_sms: usize) -> usize {
        self.ctx.inter_fit_sms(num_sms)
    }
    /// Create (collectively) the low-latency buffer; replaces an earlier one.
    fn ll_create(&mut self, py: Python<'_>, num_max: usize, hidden: usize, num_experts: usize) -> PyResult<()> {
        let ctx = &mut self.ctx;
        without_gil(py, || ctx.ll_create(num_max, hidden, num_experts)).map_err(py_err)
    }
    /// The low-latency buffer for these sizes (`clean_low_latency_buffer`), created collectively
    /// when missing or made for others, after the size check against `num_rdma_bytes`.
    fn ll_ensure(&mut self, py: Python<'_>, num_max: usize, hidden: usize, num_experts: usize) -> PyResult<()> {
        let ctx = &mut self.ctx;
        without_gil(py, || ctx.bind().and_then(|_| ctx.ensure_ll(num_max, hidden, num_experts))).map_err(py_err)
    }
    /// (num_max_dispatch_tokens_per_rank, hidden, num_experts) of the low-latency buffer.
    fn ll_dims(&self) -> Option<(usize, usize, usize)> {
        self.ctx.ll_dims()
    }

    /// DeepEP's `get_dispatch_layout` in one call: after the joins of `previous_event` / `stream`,
    /// the layout kernel writes fresh `num_tokens_per_rank` (i32 `[R]`), `num_tokens_per_expert`
    /// (i32 `[E]`) and `is_token_in_rank` (bool `[n, R]`) on the comm stream; ids that point nowhere
    /// are dropped and recorded (raised by the next call). Returns `(per_rank, per_expert, in_rank,
    /// event, kernel)`. `kernel` is False, nothing launched, where the layout kernel cannot serve
    /// the group (the internode mode of more than 8 ranks), or `use_kernel` is off: the caller
    /// fills the tensors then and ends the call with `end_call`; so does a caller passing
    /// `defer_end`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (topk_idx, num_experts, previous_event, async_finish, stream, use_kernel = true, defer_end = false))]
    fn get_dispatch_layout(&mut self, py: Python<'_>, topk_idx: &Bound<'_, PyAny>, num_experts: usize, previous_event: Option<PyRef<'_, Event>>, async_finish: bool, stream: u64, use_kernel: bool, defer_end: bool) -> PyResult<LayoutResult> {
        self.check(py)?;
        let (r, dev) = (self.ctx.world(), self.ctx.device());
        let n = doorway::read("topk_idx", topk_idx)?.shape.first().copied().unwrap_or(0);
        self.ctx.bind().map_err(py_err)?;
        self.ctx.begin(previous_event.as_deref().map(|e| &e.inner), Some(stream)).map_err(py_err)?;
        let per_rank = outputs::empty(py, DType::I32, &[r], dev)?;
        let per_expert = outputs::empty(py, DType::I32, &[num_experts], dev)?;
        let in_rank = outputs::empty(py, DType::Bool, &[n, r], dev)?;
        let a = doorway::parse_dispatch_layout(topk_idx, (&per_rank, &per_expert, &in_rank), num_experts, r, dev)?;
        let ran = self.ctx.layout(&a.topk_idx, &a.per_rank, &a.per_expert, &a.in_rank, num_experts, use_kernel).map_err(py_err)?;
        let ev = if ran && !defer_end { self.end(async_finish, stream)? } else { None };
        Ok((per_rank.unbind(), per_expert.unbind(), in_rank.unbind(), ev, ran))
    }

    /// Intranode dispatch in one call (DeepEP's `Buffer.dispatch` within one host): the checks of
    /// every tensor, the joins of `previous_event` / `stream`, the NVLink buffer for `x`'s hidden
    /// (created collectively when needed), the launch, the outputs as torch tensors and the join
    /// back (or the event of `async_finish`). Fresh with the layout tensors (and `topk_idx` /
    /// `topk_weights`, or neither) or cached with a `handle`. `arena`: the outputs may be written
    /// into a receive-arena region they own (not under CUDA-graph capture); `views`: the outputs
    /// are views of the fixed receive region, valid until the next dispatch. A fresh dispatch
    /// blocks the host (GIL released) until the received counts are known, like DeepEP without
    /// `num_worst_tokens`, which is the row count of padded outputs.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, handle, expert_alignment, num_sms, num_worst_tokens, previous_event, async_finish, stream, arena = true, views = false))]
    fn dispatch(
        &mut self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        scales: Option<&Bound<'_, PyAny>>,
        topk_idx: Option<&Bound<'_, PyAny>>,
        topk_weights: Option<&Bound<'_, PyAny>>,
        num_tokens_per_rank: Option<&Bound<'_, PyAny>>,
        num_tokens_per_expert: Option<&Bound<'_, PyAny>>,
        is_token_in_rank: Option<&Bound<'_, PyAny>>,
        handle: Option<&Bound<'_, PyAny>>,
        expert_alignment: usize,
        num_sms: usize,
        num_worst_tokens: usize,
        previous_event: Option<PyRef<'_, Event>>,
        async_finish: bool,
        stream: u64,
        arena: bool,
        views: bool,
    ) -> PyResult<DispatchResult> {
        self.check(py)?;
        let (r, dev) = (self.ctx.world(), self.ctx.device());
        let handle = match handle {
            Some(h) => Some(h.downcast::<Handle>().map_err(|_| PyTypeError::new_err(format!("handle must come from a dispatch on this Buffer, got {}", h.get_type().name().map(|n| n.to_string()).unwrap_or_default())))?.get()),
            None => None,
        };
        let topk = match (topk_idx, topk_weights) {
            (Some(i), Some(w)) => Some((i, w)),
            (None, None) => None,
            _ => return Err(PyValueError::new_err("pass topk_idx and topk_weights together (or neither: a dispatch without top-k, as in DeepEP)")),
        };
        let layout = match (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, handle) {
            (Some(pr), Some(pe), Some(ir), None) => Some((pr, pe, ir)),
            (None, None, None, Some(_)) if topk.is_some() => return Err(PyValueError::new_err("a cached dispatch (handle given) takes no topk_idx / topk_weights")),
            (None, None, None, Some(_)) if num_worst_tokens > 0 => return Err(PyValueError::new_err("num_worst_tokens applies to a fresh dispatch (with topk_idx), not a cached one")),
            (None, None, None, Some(_)) => None,
            (_, _, _, None) => return Err(PyValueError::new_err("a fresh dispatch needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert (from get_dispatch_layout)")),
            _ => return Err(PyValueError::new_err("dispatch needs either the layout tensors (fresh) or a handle (cached), not both")),
        };
        let a = doorway::parse_dispatch(x, scales, topk, layout, r, dev)?;
        if let Some(hd) = handle {
            self.ctx.check_owner(hd.runtime_id, "handle").map_err(py_err)?;
        }
        // rows of the outputs: num_worst_tokens (fresh) or the handle's padded rows (cached)
        let padded = match handle {
            Some(hd) if hd.num_rows != hd.inner.num_recv_tokens => hd.num_rows,
            Some(_) => 0,
            None => num_worst_tokens,
        };
        self.ctx.bind().map_err(py_err)?;
        self.ctx.begin(previous_event.as_deref().map(|e| &e.inner), Some(stream)).map_err(py_err)?;
        let d = NormalDispatch {
            x: &a.x,
            scales: a.scales.as_ref(),
            topk: a.topk.as_ref().map(|(i, w)| (i, w)),
            layout: a.layout.as_ref().map(|(pr, pe, ir)| (pr, pe, ir)),
            cached: handle.map(|h| (&h.inner, h.generation)),
            expert_alignment,
            num_sms,
            owned: arena && !views && padded == 0,
            num_worst_tokens,
            plan: a.plan,
        };
        let ctx = &mut self.ctx;
        let out = without_gil(py, || ctx.dispatch(d)).map_err(py_err)?;
        let (m, hidden) = (out.recv_x.shape()[0], out.recv_x.shape()[1]);
        let rows = if padded > 0 { padded } else { m };
        let generation = self.ctx.generations().intra;
        let fresh = handle.is_none().then(|| (out.handle.clone(), out.num_recv_tokens_per_expert.clone()));
        let (recv_x, recv_scales, recv_idx, recv_w) = self.intra_outputs(py, out, rows, views)?;
        let ev = self.end(async_finish, stream)?;
        let Some((h, counts)) = fresh else {
            return Ok((recv_x, recv_scales, None, None, None, None, ev));
        };
        let keep = is_token_in_rank.expect("a fresh dispatch has is_token_in_rank").clone().unbind();
        let handle = Py::new(py, Handle::new(h, self.ctx.id(), generation, rows, hidden, dev, keep))?.into_any();
        let counts = if num_worst_tokens > 0 { vec![] } else { counts };
        Ok((recv_x, recv_scales, recv_idx, recv_w, Some(counts), Some(handle), ev))
    }

    /// Intranode combine in one call: the checks of `x` (bf16 `[rows, hidden]`, rows as the
    /// handle's dispatch produced; padding rows past the received count take no part),
    /// `topk_weights` (f32, one row per dispatched row) and `bias` (None, a tensor or a pair; bf16
    /// `[N, hidden]`) against the handle, the joins, the launch into fresh outputs (bf16 `[N,
    /// hidden]` and f32 `[N, k]`) and the join back (or the event).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, handle, topk_weights, bias, num_sms, previous_event, async_finish, stream))]
    fn combine(&mut self, py: Python<'_>, x: &Bound<'_, PyAny>, handle: PyRef<'_, Handle>, topk_weights: Option<&Bound<'_, PyAny>>, bias: Option<&Bound<'_, PyAny>>, num_sms: usize, previous_event: Option<PyRef<'_, Event>>, async_finish: bool, stream: u64) -> PyResult<CombineResult> {
        self.check(py)?;
        let dev = self.ctx.device();
        let d = CombineDims { num_tokens: handle.inner.num_tokens, num_recv_tokens: handle.inner.num_recv_tokens, num_rows: handle.num_rows, hidden: None };
        let a = doorway::parse_combine_no_out(x, topk_weights, bias, d, dev)?;
        self.ctx.check_owner(handle.runtime_id, "handle").map_err(py_err)?;
        self.ctx.bind().map_err(py_err)?;
        self.ctx.begin(previous_event.as_deref().map(|e| &e.inner), Some(stream)).map_err(py_err)?;
        let (n, hidden) = (handle.inner.num_tokens, a.x.shape[1]);
        let out = outputs::empty(py, DType::Bf16, &[n, hidden], dev)?;
        let k = a.topk_weights.as_ref().map(|w| w.shape[1]);
        let out_w = k.map(|k| outputs::empty(py, DType::F32, &[n, k], dev)).transpose()?;
        let oa = arg_of(&out, DType::Bf16, &[n, hidden], dev)?;
        let owa = match (&out_w, k) {
            (Some(t), Some(k)) => Some(arg_of(t, DType::F32, &[n, k], dev)?),
            _ => None,
        };
        self.ctx
            .combine(&handle.inner, handle.generation, &a.x, a.topk_weights.as_ref(), [a.bias[0].as_ref(), a.bias[1].as_ref()], &oa, owa.as_ref(), num_sms)
            .map_err(py_err)?;
        let ev = self.end(async_finish, stream)?;
        Ok((out.unbind(), out_w.map(Bound::unbind), ev))
    }

    /// Internode dispatch in one call (the group spans hosts): fresh with `topk_idx` /
    /// `topk_weights` `[n, k]` and the layout tensors (checked; the notify kernel recomputes the
    /// routing from `topk_idx`), creating or growing the internode buffer first (collective), or
    /// cached with a `handle`; outputs copied into torch tensors on the comm stream. A fresh
    /// dispatch blocks the host (GIL released) until the received counts are known, like DeepEP's
    /// internode dispatch. DeepEP's dispatch without top-k passes the routing the caller made from
    /// `is_token_in_rank` and every rank's `num_tokens_per_expert` (`expert_counts`, gathered
    /// through the group): no top-k outputs then, and the counts per local expert come from those.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, handle, expert_alignment, num_sms, previous_event, async_finish, stream, expert_counts = None))]
    fn internode_dispatch(
        &mut self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        scales: Option<&Bound<'_, PyAny>>,
        topk_idx: Option<&Bound<'_, PyAny>>,
        topk_weights: Option<&Bound<'_, PyAny>>,
        num_tokens_per_rank: Option<&Bound<'_, PyAny>>,
        num_tokens_per_rdma_rank: Option<&Bound<'_, PyAny>>,
        num_tokens_per_expert: Option<&Bound<'_, PyAny>>,
        is_token_in_rank: Option<&Bound<'_, PyAny>>,
        handle: Option<&Bound<'_, PyAny>>,
        expert_alignment: usize,
        num_sms: usize,
        previous_event: Option<PyRef<'_, Event>>,
        async_finish: bool,
        stream: u64,
        expert_counts: Option<Vec<Vec<i64>>>,
    ) -> PyResult<DispatchResult> {
        self.check(py)?;
        let (world, dev) = (self.ctx.world(), self.ctx.device());
        let rph = self.ctx.sizes().ranks_per_host.max(1);
        let handle = match handle {
            Some(h) => Some(h.downcast::<InterHandle>().map_err(|_| PyTypeError::new_err(format!("handle must come from a dispatch on this Buffer, got {}", h.get_type().name().map(|n| n.to_string()).unwrap_or_default())))?.get()),
            None => None,
        };
        let layout = match (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, handle) {
            (Some(pr), Some(ph), Some(pe), Some(ir), None) => Some((pr, ph, pe, ir)),
            (None, None, None, None, Some(_)) if topk_idx.is_some() || topk_weights.is_some() => {
                return Err(PyValueError::new_err("a cached dispatch (handle given) takes no topk_idx / topk_weights"))
            }
            (None, None, None, None, Some(_)) => None,
            (_, _, _, _, None) => {
                return Err(PyValueError::new_err(
                    "a fresh internode dispatch needs num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank and num_tokens_per_expert (from get_dispatch_layout)",
                ))
            }
            _ => return Err(PyValueError::new_err("dispatch needs either the layout tensors (fresh) or a handle (cached), not both")),
        };
        let topk = match (topk_idx, topk_weights, layout.is_some()) {
            (Some(i), Some(w), true) => Some((i, w)),
            (None, None, _) => None,
            _ => return Err(PyValueError::new_err("pass topk_idx and topk_weights together (or neither: a dispatch without top-k, as in DeepEP)")),
        };
        let a = doorway::parse_internode_dispatch(x, scales, topk, layout, world, world / rph, dev)?;
        if a.plan.scales_column_major == Some(true) {
            return Err(PyValueError::new_err("the internode kernels read row-major x scales; pass x_scales.contiguous()"));
        }
        if let Some(hd) = handle {
            self.ctx.check_owner(hd.runtime_id, "handle").map_err(py_err)?;
        }
        self.ctx.bind().map_err(py_err)?;
        self.ctx.begin(previous_event.as_deref().map(|e| &e.inner), Some(stream)).map_err(py_err)?;
        let (e, tk) = (a.plan.num_experts, a.topk.as_ref().map(|(i, w)| (i, w)));
        let (xa, sa) = (&a.x, a.scales.as_ref());
        let cached = handle.map(|h| (&h.inner, h.generation));
        let ctx = &mut self.ctx;
        let out = without_gil(py, || ctx.internode_dispatch(xa, sa, tk, e, cached, expert_alignment, num_sms)).map_err(py_err)?;
        let rows = out.recv_x.shape()[0];
        let (ti, tw) = if handle.is_none() && expert_counts.is_none() { (out.recv_topk_idx.as_ref(), out.recv_topk_weights.as_ref()) } else { (None, None) };
        let (recv_x, recv_scales, recv_idx, recv_w) = self.copies(py, [Some(&out.recv_x), out.recv_scales.as_ref(), ti, tw], rows)?;
        let generation = self.ctx.generations().inter;
        let fresh = handle.is_none().then(|| (out.handle.clone(), out.num_recv_tokens_per_expert.clone()));
        drop(out); // its tensors are freed stream-ordered on the comm stream, after the copies
        let ev = self.end(async_finish, stream)?;
        let Some((h, counts)) = fresh else {
            return Ok((recv_x, recv_scales, None, None, None, None, ev));
        };
        let keep = is_token_in_rank.expect("a fresh dispatch has is_token_in_rank").clone().unbind();
        let handle = Py::new(py, InterHandle::new(h, self.ctx.id(), generation, dev, keep))?.into_any();
        let counts = match expert_counts {
            Some(all) => crate::settings::recv_counts(&all, self.ctx.rank(), expert_alignment).map_err(PyValueError::new_err)?.into_iter().map(|c| c as usize).collect(),
            None => counts,
        };
        Ok((recv_x, recv_scales, recv_idx, recv_w, Some(counts), Some(handle), ev))
    }

    /// Internode combine in one call: the checks of `x` (bf16 `[m, hidden]`, rows in the order and
    /// width of the dispatch's `recv_x`), `topk_weights` (f32 `[m, k]`) and `bias` against the
    /// handle, the joins, the launch, copies of the outputs (bf16 `[N, hidden]`, f32 `[N, k]`) into
    /// torch tensors on the comm stream and the join back (or the event). Never blocks the host.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, handle, topk_weights, bias, previous_event, async_finish, stream))]
    fn internode_combine(&mut self, py: Python<'_>, x: &Bound<'_, PyAny>, handle: PyRef<'_, InterHandle>, topk_weights: Option<&Bound<'_, PyAny>>, bias: Option<&Bound<'_, PyAny>>, previous_event: Option<PyRef<'_, Event>>, async_finish: bool, stream: u64) -> PyResult<CombineResult> {
        self.check(py)?;
        let d = CombineDims { num_tokens: handle.inner.num_tokens, num_recv_tokens: handle.inner.num_recv_tokens, num_rows: handle.inner.num_recv_tokens, hidden: Some(handle.inner.hidden) };
        let a = doorway::parse_combine_no_out(x, topk_weights, bias, d, self.ctx.device())?;
        self.ctx.check_owner(handle.runtime_id, "handle").map_err(py_err)?;
        self.ctx.bind().map_err(py_err)?;
        self.ctx.begin(previous_event.as_deref().map(|e| &e.inner), Some(stream)).map_err(py_err)?;
        let out = self.ctx.internode_combine(&handle.inner, handle.generation, &a.x, a.topk_weights.as_ref(), [a.bias[0].as_ref(), a.bias[1].as_ref()]).map_err(py_err)?;
        let n = out.combined_x.shape()[0];
        let (x_out, _, _, w_out) = self.copies(py, [Some(&out.combined_x), None, None, out.combined_topk_weights.as_ref()], n)?;
        drop(out); // freed stream-ordered on the comm stream, after the copies
        let ev = self.end(async_finish, stream)?;
        Ok((x_out, w_out, ev))
    }

    /// Low-latency dispatch of bf16 `x` (`[n, hidden]`, `n <= num_max`) by `topk_idx` (i64
    /// `[n, k]`), creating the low-latency buffer for (num_max, hidden, num_experts) first when
    /// needed (collective). No host wait. In the same call, the joins DeepEP makes around its
    /// launch on the comm stream: the kernel runs after the work queued on `wait_for` and
    /// `join_back` waits for it (raw streams; None = no join). When both are the same stream the
    /// kernel is simply launched on that stream (the same order, no event joins). `stats` (i32
    /// `[local experts]`) is only checked here; the caller adds the counts. A device error this
    /// Buffer's kernels recorded is raised first. Returns `(recv_x, recv_scales, recv_count,
    /// handle, hook)`: the outputs are torch views of fixed places of the dispatch's buffer half,
    /// made once per half and format and cached until the buffer is destroyed or re-created;
    /// `recv_scales` is None for BF16.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, topk_idx, num_max, num_experts, use_fp8, round_scale, use_ue8m0, return_hook, stats = None, wait_for = None, join_back = None))]
    fn ll_dispatch(
        &mut self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        num_max: usize,
        num_experts: usize,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        return_hook: bool,
        stats: Option<&Bound<'_, PyAny>>,
        wait_for: Option<u64>,
        join_back: Option<u64>,
    ) -> PyResult<LlDispatchResult> {
        self.check(py)?;
        let dev = self.ctx.device();
        let a = doorway::parse_ll_dispatch(x, topk_idx, stats, num_max, num_experts, self.ctx.world(), dev)?;
        let opts = LlDispatchOpts { use_fp8, round_scale, use_ue8m0, return_hook };
        let ctx = &mut self.ctx;
        let out = if ctx.ll_dims() == Some((num_max, a.plan.hidden, num_experts)) {
            ctx.ll_dispatch(&a.x, &a.topk_idx, num_max, num_experts, opts, wait_for, join_back)
        } else {
            // the buffer is (re-)created first: collective, without the GIL
            without_gil(py, || ctx.ll_dispatch(&a.x, &a.topk_idx, num_max, num_experts, opts, wait_for, join_back))
        }
        .map_err(py_err)?;
        let (id, generation) = (self.ctx.id(), self.ctx.generations().ll);
        let [recv_x, recv_scales, recv_count] = self.ll_views(py, out.packed_recv_x.ptr(), use_fp8, use_ue8m0 && use_fp8)?;
        Ok((
            recv_x,
            recv_scales,
            recv_count,
            LlPyHandle::new(out.handle, id, generation, num_max, num_experts, dev),
            out.hook.map(|h| NativeHook { hook: Some(h), runtime_id: id, generation }),
        ))
    }

    /// Low-latency combine of bf16 `x` (`[L, R·num_max, hidden]`; with `zero_copy`, the buffer
    /// `get_next_low_latency_combine_buffer` handed out is read instead and x only has to have its
    /// shape) into `out` (bf16 `[n, hidden]`; None: a fresh tensor) with this rank's `topk_idx` /
    /// `topk_weights` (`[n, k]`), on the comm stream; `wait_for` / `join_back` as for
    /// `ll_dispatch`. Returns `(out, hook)`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, topk_idx, topk_weights, handle, out, return_hook, wait_for = None, join_back = None, zero_copy = None))]
    fn ll_combine(
        &mut self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        handle: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        return_hook: bool,
        wait_for: Option<u64>,
        join_back: Option<u64>,
        zero_copy: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Py<PyAny>, Option<NativeHook>)> {
        self.check(py)?;
        let handle = handle.downcast::<LlPyHandle>().map_err(|_| {
            PyTypeError::new_err(format!("handle must come from low_latency_dispatch on this Buffer, got {}", handle.get_type().name().map(|n| n.to_string()).unwrap_or_default()))
        })?;
        let handle = handle.get();
        self.ctx.check_owner(handle.runtime_id, "low-latency handle").map_err(py_err)?;
        deepep_kernels::args::ll_generation(handle.generation, self.ctx.generations().ll, "handle").map_err(py_err)?;
        let (l, rows) = {
            let lay = self.ctx.ll().ok_or_else(|| PyRuntimeError::new_err("the low-latency buffer is not created"))?.layout();
            (lay.num_local_experts(), lay.num_ranks * lay.num_max)
        };
        let dev = self.ctx.device();
        let (n, h) = (handle.inner.num_tokens, handle.inner.hidden);
        let d = LlCombineDims { num_tokens: n, num_topk: handle.inner.num_topk, hidden: h, local_experts: l, rows };
        let a = doorway::parse_ll_combine(x, topk_idx, topk_weights, out, zero_copy, d, dev)?;
        let (out, oa) = match (out, a.out) {
            (Some(o), Some(oa)) => (o.clone(), oa),
            // a fresh output, made after the checks (no allocation for refused input) and known
            // without reading it back
            _ => {
                let t = outputs::empty(py, DType::Bf16, &[n, h], dev)?;
                let oa = arg_of(&t, DType::Bf16, &[n, h], dev)?;
                (t, oa)
            }
        };
        let hook = self.ctx.ll_combine(&handle.inner, handle.generation, &a.x, &a.topk_idx, &a.topk_weights, &oa, return_hook, wait_for, join_back).map_err(py_err)?;
        let (id, generation) = (self.ctx.id(), self.ctx.generations().ll);
        Ok((out.unbind(), hook.map(|h| NativeHook { hook: Some(h), runtime_id: id, generation })))
    }

    /// Launch the receive half of a hooked low-latency call (once); `wait_for` / `join_back` as
    /// for `ll_dispatch`.
    #[pyo3(signature = (hook, wait_for = None, join_back = None))]
    fn ll_recv(&mut self, py: Python<'_>, mut hook: PyRefMut<'_, NativeHook>, wait_for: Option<u64>, join_back: Option<u64>) -> PyResult<()> {
        self.check(py)?;
        self.ctx.check_owner(hook.runtime_id, "hook").map_err(py_err)?;
        deepep_kernels::args::ll_generation(hook.generation, self.ctx.generations().ll, "hook").map_err(py_err)?;
        let h = hook.hook.take().ok_or_else(|| PyRuntimeError::new_err("this receive hook was already called; each hook runs once"))?;
        self.ctx.ll_recv(h, hook.generation, wait_for, join_back).map_err(py_err)
    }

    /// This rank's raw NVLink buffer (`rdma=False`) or low-latency symmetric buffer from byte
    /// `offset` as a torch tensor of `dtype`: 1-D with every element that fits, or `shape`
    /// (refused when it does not fit); the view keeps `owner` (the Buffer) alive.
    #[pyo3(signature = (dtype, shape, offset, rdma, owner))]
    fn local_buffer_tensor<'py>(&self, py: Python<'py>, dtype: &Bound<'py, PyAny>, shape: Option<Vec<usize>>, offset: i64, rdma: bool, owner: Py<PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.check(py)?;
        let elem: usize = dtype.getattr("itemsize")?.extract()?;
        let numel = shape.as_ref().map(|s| s.iter().product());
        let (ptr, count) = self.ctx.local_buffer(rdma, offset, elem, numel).map_err(|e| match (e, &shape) {
            (deepep_kernels::EpError::InvalidArgument(m), Some(s)) if m.starts_with("the requested size") => PyValueError::new_err(m.replacen("the requested size", &format!("size {s:?}"), 1)),
            (e, _) => py_err(e),
        })?;
        let shape = shape.unwrap_or_else(|| vec![count]);
        outputs::view_as(py, ptr, dtype, &shape, Some(owner), self.ctx.device())
    }

    /// Wait for the comm stream (GIL released).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let ctx = &self.ctx;
        without_gil(py, || ctx.bind().and_then(|_| ctx.synchronize())).map_err(py_err)
    }

    /// Release the buffers (collective; local only after a lost peer: see `RankContext::destroy`).
    fn destroy(&mut self, py: Python<'_>) -> PyResult<()> {
        self.ll_views.clear();
        let ctx = &mut self.ctx;
        without_gil(py, || ctx.destroy()).map_err(py_err)
    }
}
