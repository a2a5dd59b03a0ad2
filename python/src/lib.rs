//! `deepep_kernels._native`: the PyO3 extension under the `deepep_kernels` Python package.
//!
//! The `Runtime` methods take the caller's tensors themselves: [`doorway`] reads each one as it
//! is (address, real shape, strides, dtype, device) and the kernels crate's checks
//! (`deepep_kernels::args`) refuse what the kernels cannot take, before any launch; the kernels
//! then get tensors of the real shapes. The `deep_ep`-compatible API (argument names, return
//! tuples, `torch` allocation of outputs, streams) lives in `python/deepep_kernels/buffer.py`;
//! `python/deepep_kernels/_native.pyi` describes this module. Nothing here links libtorch: torch
//! tensors are read by their attributes, other arrays through DLPack, and the caller's CUDA
//! stream arrives as the raw `CUstream` handle.
//!
//! Streams: every kernel runs on the [`Gpu`]'s own non-blocking stream (DeepEP's "comm stream",
//! exposed as `comm_stream()`); the Python layer orders it against the caller's stream with the
//! event helpers below (`comm_wait_stream`, `stream_wait_comm`, [`Event`]). All of them are
//! legal inside CUDA-graph capture (event record / stream wait join the comm stream into the
//! capture).
//!
//! Context: [`Gpu::new`] retains the device's primary context (cudarc `CudaContext::new` calls
//! `cuDevicePrimaryCtxRetain`), the same context PyTorch uses, so pointers and events are
//! shared with torch without copies.

mod doorway;
mod handles;
mod settings;

use handles::{Handle, InterHandle, LlPyHandle};

use deepep_kernels::args::{self as checks, Arg, CombineDims, LlCombineDims};
use deepep_kernels::config::{buffer_size_hint, BufferLayout, Config};
use deepep_kernels::error::EpError;
use deepep_kernels::internode::{self as inter, InternodeBuffer, InternodeConfig, SymLayout};
use deepep_kernels::intranode::{self, CombineArgs, DispatchArgs, DispatchOutput, Layout};
use deepep_kernels::low_latency::{LlDispatchOpts, LlHook, LlLayout, LowLatencyBuffer};
use deepep_kernels::runtime::{self as rt, Comm, Exchange, Gpu};
use deepep_kernels::tensor::{DType, Tensor};
use cudarc::driver::sys;
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use std::sync::Arc;

/// Python exception for a crate error: bad arguments are `ValueError`, unsupported requests
/// `NotImplementedError`, everything else (CUDA, NVSHMEM, timeouts, rendezvous) `RuntimeError`.
pub(crate) fn py_err(e: EpError) -> PyErr {
    match e {
        EpError::InvalidArgument(m) => PyValueError::new_err(m),
        EpError::Unsupported(m) => PyNotImplementedError::new_err(m),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

fn cuda(res: sys::CUresult, what: &str) -> PyResult<()> {
    rt::check(res, || what.to_string()).map_err(py_err)
}

/// Runs `f` with the GIL released. The closure stays on this thread (PyO3 runs it
/// synchronously); the wrapper only lifts the `Send` bound that CUDA handle types lack.
fn without_gil<T, F: FnOnce() -> T>(py: Python<'_>, f: F) -> T {
    struct AssertSend<V>(V);
    // SAFETY: `allow_threads` runs the closure on the calling thread before returning, so
    // neither the closure nor its result ever moves to another thread.
    unsafe impl<V> Send for AssertSend<V> {}
    let w = AssertSend(f);
    let out = py.allow_threads(move || {
        let w = w;
        AssertSend((w.0)())
    });
    out.0
}


/// A CUDA event in the current (primary) context. `EventOverlap.event` holds one.
#[pyclass(module = "deepep_kernels._native")]
struct Event {
    raw: sys::CUevent,
}
// SAFETY: CUDA event handles may be used from any thread of the process.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    fn create() -> PyResult<Event> {
        rt::require_cuda().map_err(py_err)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the caller's (torch's primary) context is current.
        cuda(unsafe { sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
        Ok(Event { raw })
    }
    fn record_raw(&self, stream: sys::CUstream) -> PyResult<()> {
        // SAFETY: valid event; `stream` is a live stream of this context (caller's contract).
        cuda(unsafe { sys::cuEventRecord(self.raw, stream) }, "cuEventRecord")
    }
    fn wait_raw(&self, stream: sys::CUstream) -> PyResult<()> {
        // SAFETY: as above.
        cuda(unsafe { sys::cuStreamWaitEvent(stream, self.raw, 0) }, "cuStreamWaitEvent")
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

fn as_stream(s: u64) -> sys::CUstream {
    s as usize as sys::CUstream
}

#[pymethods]
impl Event {
    /// A new event recorded on the raw stream handle `stream`.
    #[staticmethod]
    fn recorded_on(stream: u64) -> PyResult<Event> {
        let e = Event::create()?;
        e.record_raw(as_stream(stream))?;
        Ok(e)
    }
    /// Make `stream` wait for this event (no host wait).
    fn wait_on(&self, stream: u64) -> PyResult<()> {
        self.wait_raw(as_stream(stream))
    }
    /// Block the host until the event completed (GIL released).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let raw = self.raw as usize;
        // SAFETY: valid event.
        let res = without_gil(py, || unsafe { sys::cuEventSynchronize(raw as sys::CUevent) });
        cuda(res, "cuEventSynchronize")
    }
    /// Whether the work before the event has completed.
    fn query(&self) -> bool {
        // SAFETY: valid event.
        unsafe { sys::cuEventQuery(self.raw) == sys::CUresult::CUDA_SUCCESS }
    }
}

/// The caller's all-gather (`torch.distributed.all_gather_object` over the Buffer's group):
/// a Python callable `f(bytes) -> list[bytes]`.
struct PyExchange {
    f: Py<PyAny>,
}

impl Exchange for PyExchange {
    fn all_gather(&self, data: &[u8]) -> deepep_kernels::Result<Vec<Vec<u8>>> {
        Python::with_gil(|py| {
            let out = self
                .f
                .call1(py, (PyBytes::new(py, data),))
                .map_err(|e| EpError::Rendezvous(format!("the process group's all_gather failed: {e}")))?;
            let list = out.bind(py).downcast::<PyList>().map_err(|_| EpError::Rendezvous("the all_gather callable must return a list of bytes".into()))?.clone();
            list.iter()
                .map(|item| item.extract::<Vec<u8>>().map_err(|_| EpError::Rendezvous("the all_gather callable returned a non-bytes element".into())))
                .collect()
        })
    }
}

/// Views of one intranode dispatch's outputs in the NVLink buffer: in an arena region while this
/// object lives (`in_arena`), else in the fixed receive region until the next dispatch.
#[pyclass(module = "deepep_kernels._native")]
struct NativeDispatch {
    out: DispatchOutput,
    runtime_id: u64,
    generation: u64,
    num_rows: usize,
    device: usize,
}

#[pymethods]
impl NativeDispatch {
    #[getter]
    fn num_recv_tokens(&self) -> usize {
        self.out.recv_x.shape()[0]
    }
    /// Whether the outputs live in a region of the receive arena (valid while this object
    /// lives), rather than the fixed receive region (valid until the next dispatch).
    #[getter]
    fn in_arena(&self) -> bool {
        self.out.lease.is_some()
    }
    #[getter]
    fn recv_x_ptr(&self) -> u64 {
        self.out.recv_x.ptr()
    }
    /// (ptr, num_scales) of the f32 row-major `[M, S]` received scales (FP8 only).
    #[getter]
    fn recv_scales(&self) -> Option<(u64, usize)> {
        self.out.recv_scales.as_ref().map(|t| (t.ptr(), t.shape()[1]))
    }
    #[getter]
    fn recv_topk_idx_ptr(&self) -> Option<u64> {
        self.out.recv_topk_idx.as_ref().map(Tensor::ptr)
    }
    #[getter]
    fn recv_topk_weights_ptr(&self) -> Option<u64> {
        self.out.recv_topk_weights.as_ref().map(Tensor::ptr)
    }
    #[getter]
    fn num_recv_tokens_per_expert(&self) -> Vec<usize> {
        self.out.num_recv_tokens_per_expert.clone()
    }
    /// The dispatch's handle, keeping `is_token_in_rank` (the caller's layout tensor, which the
    /// combine reads) alive.
    fn handle(&self, is_token_in_rank: Py<PyAny>) -> Handle {
        let hidden = self.out.recv_x.shape()[1];
        Handle::new(self.out.handle.clone(), self.runtime_id, self.generation, self.num_rows, hidden, self.device, is_token_in_rank)
    }
}

/// The receive half of a low-latency call made with `return_recv_hook` (launch once).
#[pyclass(module = "deepep_kernels._native")]
struct NativeHook {
    hook: Option<LlHook>,
    runtime_id: u64,
    /// The low-latency buffer's generation at the call: a re-created or destroyed buffer refuses it.
    generation: u64,
}

/// One internode dispatch's outputs: tensors owned by the kernels crate (stream-ordered
/// allocations on the comm stream, freed stream-ordered there when this object drops). The
/// Python layer copies them into torch tensors on the comm stream, then drops this object.
#[pyclass(module = "deepep_kernels._native")]
struct NativeInterDispatch {
    out: inter::DispatchOutput,
    runtime_id: u64,
    generation: u64,
    device: usize,
}

#[pymethods]
impl NativeInterDispatch {
    #[getter]
    fn num_recv_tokens(&self) -> usize {
        self.out.recv_x.shape()[0]
    }
    #[getter]
    fn recv_x_ptr(&self) -> u64 {
        self.out.recv_x.ptr()
    }
    /// (ptr, num_scales) of the f32 row-major `[M, S]` received scales (FP8 only).
    #[getter]
    fn recv_scales(&self) -> Option<(u64, usize)> {
        self.out.recv_scales.as_ref().map(|t| (t.ptr(), t.shape()[1]))
    }
    #[getter]
    fn recv_topk_idx_ptr(&self) -> Option<u64> {
        self.out.recv_topk_idx.as_ref().map(Tensor::ptr)
    }
    #[getter]
    fn recv_topk_weights_ptr(&self) -> Option<u64> {
        self.out.recv_topk_weights.as_ref().map(Tensor::ptr)
    }
    #[getter]
    fn num_recv_tokens_per_expert(&self) -> Vec<usize> {
        self.out.num_recv_tokens_per_expert.clone()
    }
    /// The dispatch's handle, keeping `is_token_in_rank` (the caller's) alive.
    fn handle(&self, is_token_in_rank: Py<PyAny>) -> InterHandle {
        InterHandle::new(self.out.handle.clone(), self.runtime_id, self.generation, self.device, is_token_in_rank)
    }
}

/// One internode combine's outputs (owned by the kernels crate, copied out like the dispatch's).
#[pyclass(module = "deepep_kernels._native")]
struct NativeInterCombine {
    out: intranode::CombineOutput,
}

#[pymethods]
impl NativeInterCombine {
    #[getter]
    fn combined_x_ptr(&self) -> u64 {
        self.out.combined_x.ptr()
    }
    #[getter]
    fn combined_topk_weights_ptr(&self) -> Option<u64> {
        self.out.combined_topk_weights.as_ref().map(Tensor::ptr)
    }
}

// Thread safety of the classes below. PyTorch calls into the Buffer from other threads than the
// one that created it (autograd runs backward passes, e.g. Megatron's combine in
// FusedDispatch.backward, on its device threads), so the classes cannot be `unsendable`.
// SAFETY: PyO3 serialises access to each object (a `&mut self` method holds an exclusive borrow
// for its whole duration, also while the GIL is released, and a concurrent call gets a
// "already borrowed" error instead of running); the CUDA handles inside are valid on any thread
// of the process: every launch binds the primary context first (`Gpu::launch`), and the event
// and stream calls here run where torch has made that same primary context current.
macro_rules! thread_safe {
    ($($t:ty),*) => { $(unsafe impl Send for $t {} unsafe impl Sync for $t {})* };
}
thread_safe!(Handle, NativeDispatch, LlPyHandle, NativeHook, InterHandle, NativeInterDispatch, NativeInterCombine, Runtime);

static NEXT_RUNTIME: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One rank's buffers. Field order is drop order: the buffers borrow `gpu` and go first.
#[pyclass(module = "deepep_kernels._native")]
struct Runtime {
    intra: Option<intranode::Buffer<'static>>,
    /// The internode (two-hop) buffer, for a group that spans hosts (or emulates hosts).
    inter: Option<InternodeBuffer<'static>>,
    intra_dims: Option<(usize, usize)>,
    ll: Option<LowLatencyBuffer<'static>>,
    ll_dims: Option<(usize, usize, usize)>,
    comm: Comm,
    id: u64,
    /// Events reused for the stream joins (no create/destroy per call, nothing destroyed while a
    /// CUDA graph is being captured right after it was recorded).
    joins: Vec<Event>,
    next_join: usize,
    /// The Buffer's `num_nvl_bytes`, `num_rdma_bytes` and `low_latency_mode` (`set_buffer_sizes`).
    num_nvl_bytes: usize,
    num_rdma_bytes: usize,
    low_latency_mode: bool,
    /// Torch views of the low-latency outputs by (packed_recv_x address, FP8, UE8M0): see
    /// `Runtime::ll_views`; emptied whenever the low-latency buffer goes.
    ll_view_cache: std::collections::HashMap<(u64, bool, bool), [Py<PyAny>; 3]>,
    /// Bumped whenever the NVLink buffer is (re-)created / the low-latency buffer is re-created
    /// or destroyed: handles and hooks of an older generation are refused.
    intra_generation: u64,
    inter_generation: u64,
    ll_generation: u64,
    /// Ranks per (real or emulated) host of the internode mode (0: not in that mode).
    ranks_per_host: usize,
    /// Bytes of the intranode receive arena (None: twice the fixed receive region).
    recv_arena: Option<usize>,
    /// Shared by the views of the caller's tensors (they own nothing).
    no_owner: Arc<dyn std::any::Any + Send + Sync>,
    gpu: Box<Gpu>,
}

/// A kernels-crate view of a caller's tensor as the doorway read it (real shape and strides).
fn view(gpu: &Gpu, keep: &Arc<dyn std::any::Any + Send + Sync>, a: &Arg) -> Tensor {
    Tensor::view_info(gpu.stream(), keep.clone(), a.info())
}

/// The first `rows` rows of a caller's tensor (a prefix of its first dimension).
fn rows_of(gpu: &Gpu, keep: &Arc<dyn std::any::Any + Send + Sync>, a: &Arg, rows: usize) -> Tensor {
    let mut info = a.info();
    info.shape[0] = rows.min(info.shape[0]);
    Tensor::view_info(gpu.stream(), keep.clone(), info)
}


/// What `Runtime::ll_dispatch` returns: `(recv_x, recv_scales or None, recv_count, handle, hook)`.
type LlDispatchResult = (Py<PyAny>, Py<PyAny>, Py<PyAny>, LlPyHandle, Option<NativeHook>);

/// The internode configuration the Python layer asks for: `(ranks_per_host, max_tokens, hidden,
/// num_sms, max_topk, max_local_experts)`.
type InterDims = (usize, usize, usize, usize, usize, usize);

fn inter_config(d: InterDims) -> InternodeConfig {
    let (rph, max_tokens, hidden, num_sms, max_topk, max_local) = d;
    let mut c = InternodeConfig::new(rph, max_tokens, hidden);
    c.num_sms = num_sms;
    c.max_topk = max_topk;
    c.max_local_experts = max_local;
    c
}

/// Bytes of one rank's internode symmetric buffer for `d` (the configuration validated first).
fn inter_bytes(world: usize, d: InterDims) -> deepep_kernels::Result<usize> {
    SymLayout::new(&inter_config(d), world).map(|l| l.total)
}

/// Largest `max_tokens` (of `d`, whose own `max_tokens` is ignored) whose internode buffer is a
/// valid configuration and fits in `bytes`; 0 if none.
fn inter_max_tokens(world: usize, d: InterDims, bytes: usize) -> usize {
    let fits = |t: usize| inter_bytes(world, (d.0, t, d.2, d.3, d.4, d.5)).map(|b| b <= bytes).unwrap_or(false);
    if !fits(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1usize, 2usize);
    while fits(hi) && hi < (1 << 24) {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid
        } else {
            hi = mid
        }
    }
    lo
}

/// Size of the [`Runtime`]'s join-event ring.
const JOIN_EVENTS: usize = 8;

impl Runtime {
    /// The low-latency buffer is going (re-created, destroyed or abandoned): forget its sizes, bump
    /// its generation (older handles and hooks are refused) and drop the cached output views.
    fn retire_ll(&mut self) {
        self.ll_dims = None;
        self.ll_generation += 1;
        self.ll_view_cache.clear();
    }

    /// Torch views `[recv_x, recv_scales (None for BF16), recv_count]` of the outputs of the
    /// low-latency dispatch whose `packed_recv_x` is at `recv_x`, made once per buffer half and
    /// format (outside any CUDA-graph capture when warmed up) and cached. They own nothing: the
    /// memory lives as long as the low-latency buffer, whose re-creation or destroy drops the
    /// cache (`retire_ll`), so no view can delay the collective free of the symmetric memory.
    fn ll_views(&mut self, py: Python<'_>, recv_x: u64, use_fp8: bool, use_ue8m0: bool) -> PyResult<[Py<PyAny>; 3]> {
        if let Some(v) = self.ll_view_cache.get(&(recv_x, use_fp8, use_ue8m0)) {
            return Ok([v[0].clone_ref(py), v[1].clone_ref(py), v[2].clone_ref(py)]);
        }
        let device = self.device_index();
        let ll = self.ll()?;
        let (base, _) = ll.local_buffer();
        let lay = ll.layout();
        let half = recv_x
            .checked_sub(base)
            .and_then(|off| lay.dispatch_half_at(off))
            .ok_or_else(|| PyRuntimeError::new_err(format!("{recv_x:#x} is not the packed_recv_x of a low-latency dispatch on this Buffer")))?;
        let d = &lay.dispatch[half];
        let name = |n: &str| pyo3::types::PyString::new(py, n).into_any();
        let shape = lay.recv_x_shape().to_vec();
        let x = handles::torch_view(py, recv_x, &name(if use_fp8 { "float8_e4m3fn" } else { "bfloat16" }), &shape, None, device)?;
        let scales = if use_fp8 {
            let (dtype, sshape) = lay.recv_scales_layout(use_ue8m0);
            let phys = handles::torch_view(py, base + d.scales as u64, &name(if dtype == DType::I32 { "int32" } else { "float32" }), &sshape, None, device)?;
            // [L, R*num_max, S] with the last two dims column-major, as DeepEP
            phys.call_method1("transpose", (1, 2))?.unbind()
        } else {
            py.None()
        };
        let count = handles::torch_view(py, base + d.recv_count as u64, &name("int32"), &shape[..1], None, device)?;
        let v = [x.unbind(), scales, count.unbind()];
        let out = [v[0].clone_ref(py), v[1].clone_ref(py), v[2].clone_ref(py)];
        self.ll_view_cache.insert((recv_x, use_fp8, use_ue8m0), v);
        Ok(out)
    }

    /// Make this rank's (primary) context current on the calling thread: PyTorch may call from
    /// threads where no CUDA call ran yet.
    fn bind(&self) -> PyResult<()> {
        self.gpu.bind().map_err(py_err)
    }
    fn join_event(&mut self) -> &Event {
        self.next_join = (self.next_join + 1) % self.joins.len();
        &self.joins[self.next_join]
    }
    fn gpu_static(&self) -> &'static Gpu {
        // SAFETY: `gpu` is boxed (stable address), never replaced, and dropped after every
        // buffer that borrows it (field order of `Runtime`).
        unsafe { &*(self.gpu.as_ref() as *const Gpu) }
    }
    fn intra(&mut self) -> PyResult<&mut intranode::Buffer<'static>> {
        self.intra.as_mut().ok_or_else(|| PyRuntimeError::new_err("the intranode buffer is not created (destroyed, or num_nvl_bytes was 0)"))
    }
    fn inter(&mut self) -> PyResult<&mut InternodeBuffer<'static>> {
        self.inter.as_mut().ok_or_else(|| PyRuntimeError::new_err("the internode buffer is not created (destroyed, or the group is within one host)"))
    }
    fn ll(&mut self) -> PyResult<&mut LowLatencyBuffer<'static>> {
        self.ll.as_mut().ok_or_else(|| PyRuntimeError::new_err("the low-latency buffer is not created (destroyed, or low_latency_mode was off)"))
    }
    /// `num_sms` as given with one rank per GPU; with several ranks sharing the GPU (testing),
    /// at most this rank's share of the SMs, so every rank's waiting blocks fit at once.
    fn fit_sms(&self, num_sms: usize) -> usize {
        if self.gpu.oversubscribed() {
            self.gpu.fit_sms(num_sms)
        } else {
            num_sms
        }
    }
    /// The comm stream waits for the work queued so far on `stream` (a raw `CUstream`, 0 being
    /// the legacy default stream; None = no join).
    fn join_from(&mut self, stream: Option<u64>) -> PyResult<()> {
        let Some(stream) = stream else { return Ok(()) };
        let comm = self.gpu.cu_stream();
        let e = self.join_event();
        e.record_raw(as_stream(stream))?;
        e.wait_raw(comm)
    }
    /// `stream` waits for the work queued so far on the comm stream (None = no join).
    fn join_to(&mut self, stream: Option<u64>) -> PyResult<()> {
        let Some(stream) = stream else { return Ok(()) };
        let comm = self.gpu.cu_stream();
        let e = self.join_event();
        e.record_raw(comm)?;
        e.wait_raw(as_stream(stream))
    }
    /// Where the next low-latency call launches: on `wait_for` itself when the caller joins both
    /// ways with that one stream (returns true: no event joins needed), else on the comm stream
    /// after it waited for `wait_for` (returns false: the caller joins `join_back` afterwards).
    fn ll_stream(&mut self, wait_for: Option<u64>, join_back: Option<u64>) -> PyResult<bool> {
        let direct = wait_for.is_some() && wait_for == join_back;
        if !direct {
            self.join_from(wait_for)?;
        }
        let ll = self.ll()?;
        ll.set_stream(if direct { wait_for.map(as_stream) } else { None });
        Ok(direct)
    }
    fn device_index(&self) -> usize {
        self.gpu.ordinal()
    }
    /// The low-latency buffer for these sizes, created (collectively) when it is missing or was
    /// created for others: the size check against `num_rdma_bytes` first, then the creation.
    fn ensure_ll(&mut self, py: Python<'_>, num_max: usize, hidden: usize, num_experts: usize) -> PyResult<()> {
        if self.ll.is_some() && self.ll_dims == Some((num_max, hidden, num_experts)) {
            return Ok(());
        }
        if !self.low_latency_mode {
            return Err(PyValueError::new_err("low-latency calls need Buffer(..., low_latency_mode=True)"));
        }
        let world = self.comm.world();
        let need = LlLayout::new(world, num_experts, num_max, hidden, self.gpu.sm_count() as usize).map_err(py_err)?.total_bytes;
        checks::ll_capacity(need, self.num_rdma_bytes, num_max, hidden, num_experts, world).map_err(py_err)?;
        self.ll_create(py, num_max, hidden, num_experts)
    }
    /// The NVLink buffer for rows of `hidden`: created (collectively: every rank dispatches the
    /// same hidden) for the most tokens `num_nvl_bytes` holds, when missing or made for another
    /// hidden.
    fn ensure_intra(&mut self, py: Python<'_>, hidden: usize) -> PyResult<()> {
        if self.intra.is_some() && matches!(self.intra_dims, Some((_, h)) if h == hidden) {
            return Ok(());
        }
        let world = self.comm.world();
        let max_tokens = intranode_max_tokens(world, hidden, self.num_nvl_bytes);
        if max_tokens == 0 {
            let need = buffer_size_hint(world, 1, hidden).map_err(py_err)?;
            return Err(PyValueError::new_err(format!(
                "num_nvl_bytes={} cannot hold one token of hidden {hidden} for {world} ranks (needs >= {need}); size it with Config.get_nvl_buffer_size_hint",
                self.num_nvl_bytes
            )));
        }
        self.intranode_create(py, max_tokens, hidden, self.recv_arena)
    }
    /// The internode buffer for a fresh dispatch of rows of `hidden`, top-`topk` and
    /// `local_experts` experts per rank on `num_sms` SMs: created (collectively) when missing, or
    /// re-created when this dispatch needs a larger hidden / top-k / experts per rank or another
    /// SM count. Its token capacity is the most the Buffer's memory holds: num_rdma_bytes +
    /// num_nvl_bytes (DeepEP keeps a ring buffer of num_nvl_bytes for the NVLink hop; ours runs
    /// that hop inside the symmetric buffer, so the memory granted for it goes there too).
    fn ensure_inter(&mut self, py: Python<'_>, hidden: usize, topk: usize, local_experts: usize, num_sms: usize) -> PyResult<()> {
        let max_topk = inter::plan::MAX_TOPK;
        if topk > max_topk {
            return Err(PyValueError::new_err(format!("top-k {topk} exceeds the internode kernels' limit of {max_topk}; route each token to at most {max_topk} experts")));
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
        let (rph, bytes) = (self.ranks_per_host, self.num_rdma_bytes + self.num_nvl_bytes);
        let cap = inter_max_tokens(world, (rph, 0, hidden, sms, topk, local_experts), bytes);
        if cap == 0 {
            let need = inter_bytes(world, (rph, 1, hidden, sms, topk, local_experts)).map_err(py_err)?;
            return Err(PyValueError::new_err(format!(
                "num_rdma_bytes + num_nvl_bytes = {bytes} cannot hold one token of hidden {hidden} (top-k {topk}, {local_experts} experts per \
                 rank) for {world} ranks in hosts of {rph} (needs >= {need}); size num_rdma_bytes with Config.get_rdma_buffer_size_hint"
            )));
        }
        self.internode_create(py, (rph, cap, hidden, sms, topk, local_experts))?;
        self.inter_generation += 1;
        Ok(())
    }
    /// `n` tokens fit the internode buffer.
    fn inter_capacity(&self, n: usize) -> PyResult<()> {
        let c = *self.inter.as_ref().ok_or_else(|| PyRuntimeError::new_err("the internode buffer is not created (destroyed, or the group is within one host)"))?.config();
        if n > c.max_tokens_per_rank {
            let world = self.comm.world();
            let need = inter_bytes(world, (c.ranks_per_host, n, c.hidden, c.num_sms, c.max_topk, c.max_local_experts)).unwrap_or(0);
            return Err(PyValueError::new_err(format!(
                "dispatch of {n} tokens: num_rdma_bytes + num_nvl_bytes = {} holds {} tokens of hidden {} per rank on {world} ranks in hosts \
                 of {}; create the Buffer with num_rdma_bytes + num_nvl_bytes >= {need} (or set DEEPEP_KERNELS_MAX_TOKENS >= {n} before \
                 sizing num_rdma_bytes with Config.get_rdma_buffer_size_hint)",
                self.num_rdma_bytes + self.num_nvl_bytes,
                c.max_tokens_per_rank,
                c.hidden,
                c.ranks_per_host
            )));
        }
        Ok(())
    }
    fn check_owner(&self, id: u64, what: &str) -> PyResult<()> {
        if id != self.id {
            return Err(PyValueError::new_err(format!("this {what} comes from another Buffer; pass the handle of a dispatch on this Buffer")));
        }
        Ok(())
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
        let gpu = Box::new(Gpu::with_share(device, rank, ranks_per_gpu).map_err(py_err)?);
        // Device errors come back through the host-mapped record, which buffer.py reports before
        // every call (check_device_error); the context survives. DEEPEP_KERNELS_TRAP_ON_ERROR=1
        // makes a fatal record trap instead (the context is lost; docs/python.md).
        gpu.set_trap_on_device_error(trap_on_error_env()?);
        gpu.set_sticky_errors(true);
        let comm = Comm::with_exchange(rank, world, local_rank, local_world, Arc::new(PyExchange { f: all_gather })).map_err(py_err)?;
        let id = NEXT_RUNTIME.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let joins = (0..JOIN_EVENTS).map(|_| Event::create()).collect::<PyResult<Vec<_>>>()?;
        Ok(Runtime {
            intra: None,
            inter: None,
            intra_dims: None,
            ll: None,
            ll_dims: None,
            comm,
            id,
            joins,
            next_join: 0,
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: false,
            ll_view_cache: Default::default(),
            intra_generation: 0,
            inter_generation: 0,
            ll_generation: 0,
            ranks_per_host: 0,
            recv_arena: None,
            no_owner: Arc::new(()),
            gpu,
        })
    }

    /// The Buffer's sizes and mode, for the capacity checks.
    /// `ranks_per_host`: the internode mode's hosts (0 within one host); `recv_arena_bytes`: the
    /// intranode receive arena (None: twice the fixed receive region).
    #[pyo3(signature = (num_nvl_bytes, num_rdma_bytes, low_latency_mode, ranks_per_host = 0, recv_arena_bytes = None))]
    fn set_buffer_sizes(&mut self, num_nvl_bytes: usize, num_rdma_bytes: usize, low_latency_mode: bool, ranks_per_host: usize, recv_arena_bytes: Option<usize>) {
        self.ranks_per_host = ranks_per_host;
        self.recv_arena = recv_arena_bytes;
        self.num_nvl_bytes = num_nvl_bytes;
        self.num_rdma_bytes = num_rdma_bytes;
        self.low_latency_mode = low_latency_mode;
    }
    /// Generation of the NVLink buffer (bumped by each `intranode_create`).
    #[getter]
    fn intranode_generation(&self) -> u64 {
        self.intra_generation
    }

    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    #[getter]
    fn world(&self) -> usize {
        self.comm.world()
    }
    #[getter]
    fn device(&self) -> usize {
        self.gpu.ordinal()
    }
    #[getter]
    fn sm_count(&self) -> u32 {
        self.gpu.sm_count()
    }
    /// Raw handle of the comm stream (wrap with `torch.cuda.ExternalStream`).
    fn comm_stream(&self) -> u64 {
        self.gpu.cu_stream() as usize as u64
    }
    /// The comm stream waits for the work queued so far on `stream`.
    fn comm_wait_stream(&mut self, stream: u64) -> PyResult<()> {
        self.bind()?;
        self.join_from(Some(stream))
    }
    /// `stream` waits for the work queued so far on the comm stream.
    fn stream_wait_comm(&mut self, stream: u64) -> PyResult<()> {
        self.bind()?;
        self.join_to(Some(stream))
    }
    /// The comm stream waits for `event`.
    fn comm_wait_event(&self, event: &Event) -> PyResult<()> {
        self.bind()?;
        event.wait_raw(self.gpu.cu_stream())
    }
    /// An event recorded on the comm stream now.
    fn record_comm(&self) -> PyResult<Event> {
        self.bind()?;
        Event::recorded_on(self.comm_stream())
    }

    /// Create (collectively) the NVLink buffer for up to `max_tokens` tokens per rank and rows of
    /// up to `hidden` channels, plus a receive arena of `arena_bytes` for owned dispatch outputs
    /// (None: twice the fixed receive region, two worst-case dispatches); replaces an earlier one.
    #[pyo3(signature = (max_tokens, hidden, arena_bytes=None))]
    fn intranode_create(&mut self, py: Python<'_>, max_tokens: usize, hidden: usize, arena_bytes: Option<usize>) -> PyResult<()> {
        self.bind()?;
        self.intra = None;
        self.intra_dims = None;
        let gpu = self.gpu_static();
        let comm = &self.comm;
        let arena = match arena_bytes {
            Some(b) => b,
            None => 2 * BufferLayout::new(comm.world(), max_tokens, hidden).map_err(py_err)?.recv_region_bytes(),
        };
        let b = without_gil(py, || intranode::Buffer::with_arena(gpu, comm, max_tokens, hidden, arena)).map_err(py_err)?;
        self.intra = Some(b);
        self.intra_dims = Some((max_tokens, hidden));
        self.intra_generation += 1;
        Ok(())
    }
    /// The NVLink buffer for rows of `hidden` (see `dispatch`), e.g. before the first layout.
    fn intranode_ensure(&mut self, py: Python<'_>, hidden: usize) -> PyResult<()> {
        self.bind()?;
        self.ensure_intra(py, hidden)
    }
    /// (max_tokens, hidden) of the NVLink buffer, if created.
    fn intranode_dims(&self) -> Option<(usize, usize)> {
        self.intra_dims
    }
    /// The receive arena's (capacity, free bytes, live leases), if the NVLink buffer has one.
    fn arena_usage(&self) -> Option<(usize, usize, usize)> {
        self.intra.as_ref().and_then(|b| b.arena_usage())
    }

    /// DeepEP's layout of `topk_idx` (i64 `[n, k]`) into the caller's `num_tokens_per_rank` (i32
    /// `[R]`), `num_tokens_per_expert` (i32 `[E]`) and `is_token_in_rank` (bool `[n, R]`) by the
    /// layout kernel on the comm stream; ids that point nowhere are dropped and recorded (raised by
    /// the next call). Returns False, having launched nothing, in the internode mode when the
    /// layout kernel cannot serve the group (it counts for 2, 4 or 8 ranks with at most
    /// `MAX_LOCAL_EXPERTS` local experts): the caller computes the layout then; `use_kernel=False`
    /// asks for that in any group (after the same checks), so tests can run the caller's path.
    #[pyo3(signature = (topk_idx, num_experts, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, use_kernel = true))]
    fn get_dispatch_layout(&mut self, topk_idx: &Bound<'_, PyAny>, num_experts: usize, num_tokens_per_rank: &Bound<'_, PyAny>, num_tokens_per_expert: &Bound<'_, PyAny>, is_token_in_rank: &Bound<'_, PyAny>, use_kernel: bool) -> PyResult<bool> {
        let r = self.comm.world();
        let a = doorway::parse_dispatch_layout(topk_idx, (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank), num_experts, r, self.device_index())?;
        let kernel_serves = deepep_kernels::validate::intranode_ranks(r).is_ok() && num_experts / r <= deepep_kernels::config::MAX_LOCAL_EXPERTS;
        if self.intra.is_none() && !(kernel_serves && use_kernel) {
            // the checks the layout kernel's launch would make of num_experts, for the caller's path
            deepep_kernels::validate::experts(num_experts, r).map_err(py_err)?;
            return Ok(false);
        }
        self.bind()?;
        let gpu = self.gpu_static();
        let keep = self.no_owner.clone();
        let t = view(gpu, &keep, &a.topk_idx);
        // the caller's torch tensors: the kernel writes them directly (no allocation, no copy)
        let layout = Layout {
            num_tokens_per_rank: view(gpu, &keep, &a.per_rank),
            num_tokens_per_expert: view(gpu, &keep, &a.per_expert),
            is_token_in_rank: view(gpu, &keep, &a.in_rank),
            num_tokens: a.topk_idx.shape[0],
            num_experts,
        };
        match self.intra.as_mut() {
            Some(b) => b.dispatch_layout_into(&t, &layout),
            // the internode mode has no NVLink buffer: the layout kernel alone
            None => intranode::dispatch_layout_on(gpu, &t, &layout, r),
        }
        .map_err(py_err)?;
        Ok(true)
    }

    /// Intranode dispatch on the comm stream of `x` (bf16 `[n, hidden]`, or float8_e4m3fn with
    /// `scales` f32 `[n, hidden/128]`, row- or column-major): fresh with the layout tensors of
    /// `get_dispatch_layout` (and `topk_idx` / `topk_weights` `[n, k]`, or neither), or cached
    /// with a `handle`. The NVLink buffer is (re-)created for `x`'s hidden first when needed
    /// (collective). A fresh dispatch blocks the host (GIL released) until the received counts
    /// are known, like DeepEP without `num_worst_tokens`; `num_worst_tokens` (fresh only) is the
    /// row count of the caller's padded outputs and must cover what this rank received.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, handle, expert_alignment, num_sms, owned=false, num_worst_tokens=0))]
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
        handle: Option<PyRef<'_, Handle>>,
        expert_alignment: usize,
        num_sms: usize,
        owned: bool,
        num_worst_tokens: usize,
    ) -> PyResult<NativeDispatch> {
        let r = self.comm.world();
        let topk = match (topk_idx, topk_weights) {
            (Some(i), Some(w)) => Some((i, w)),
            (None, None) => None,
            _ => return Err(PyValueError::new_err("pass topk_idx and topk_weights together (or neither: a dispatch without top-k, as in DeepEP)")),
        };
        let layout = match (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, handle.as_ref()) {
            (Some(pr), Some(pe), Some(ir), None) => Some((pr, pe, ir)),
            (None, None, None, Some(_)) => {
                if topk.is_some() {
                    return Err(PyValueError::new_err("a cached dispatch (handle given) takes no topk_idx / topk_weights"));
                }
                if num_worst_tokens > 0 {
                    return Err(PyValueError::new_err("num_worst_tokens applies to a fresh dispatch (with topk_idx), not a cached one"));
                }
                None
            }
            (_, _, _, None) => {
                return Err(PyValueError::new_err("a fresh dispatch needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert (from get_dispatch_layout)"))
            }
            _ => return Err(PyValueError::new_err("dispatch needs either the layout tensors (fresh) or a handle (cached), not both")),
        };
        let a = doorway::parse_dispatch(x, scales, topk, layout, r, self.device_index())?;
        let (n, h) = (a.plan.num_tokens, a.plan.hidden);
        if let Some(hd) = handle.as_ref() {
            self.check_owner(hd.runtime_id, "handle")?;
        }
        self.bind()?;
        // the buffer for this hidden first (a re-creation makes older handles stale), then the handle
        self.ensure_intra(py, h)?;
        if let Some(hd) = handle.as_ref() {
            checks::normal_generation(hd.generation, self.intra_generation, false).map_err(py_err)?;
        }
        let (max_tokens, _) = self.intra_dims.ok_or_else(|| PyRuntimeError::new_err("the intranode buffer is not created (destroyed, or num_nvl_bytes was 0)"))?;
        let need = buffer_size_hint(r, n.max(1), h).unwrap_or(0);
        checks::nvl_capacity(n, max_tokens, h, r, self.num_nvl_bytes, need).map_err(py_err)?;
        let gpu = self.gpu_static();
        let keep = self.no_owner.clone();
        let xt = view(gpu, &keep, &a.x);
        let st = a.scales.as_ref().map(|s| view(gpu, &keep, s));
        let config = Config::with_sms(self.fit_sms(num_sms));
        let id = self.id;
        let generation = self.intra_generation;
        let out = match (&a.layout, handle) {
            (Some((pr, pe, ir)), None) => {
                let e = pe.shape[0];
                let lay = Layout {
                    num_tokens_per_rank: view(gpu, &keep, pr),
                    num_tokens_per_expert: view(gpu, &keep, pe),
                    is_token_in_rank: view(gpu, &keep, ir),
                    num_tokens: n,
                    num_experts: e,
                };
                let tk = a.topk.as_ref().map(|(i, w)| (view(gpu, &keep, i), view(gpu, &keep, w)));
                let mut args = match tk.as_ref() {
                    Some((idx, w)) => DispatchArgs::fresh(&xt, &lay, idx, w),
                    // DeepEP's dispatch without top-k: rows go by is_token_in_rank alone
                    None => DispatchArgs::fresh_without_topk(&xt, &lay),
                }
                .expert_alignment(expert_alignment)
                .config(config)
                .owned(owned);
                if let Some(s) = st.as_ref() {
                    args = args.scales(s);
                }
                let buf = self.intra()?;
                without_gil(py, || buf.dispatch(args)).map_err(py_err)?
            }
            (None, Some(hd)) => {
                let mut args = DispatchArgs::cached(&xt, &hd.inner).config(config).owned(owned);
                if let Some(s) = st.as_ref() {
                    args = args.scales(s);
                }
                let buf = self.intra()?;
                without_gil(py, || buf.dispatch(args)).map_err(py_err)?
            }
            _ => unreachable!("layout xor handle was matched above"),
        };
        let m = out.recv_x.shape()[0];
        if num_worst_tokens > 0 && m > num_worst_tokens {
            return Err(PyValueError::new_err(format!(
                "num_worst_tokens={num_worst_tokens} but this rank received {m} tokens; raise num_worst_tokens (at most num_ranks * num_tokens)"
            )));
        }
        Ok(NativeDispatch { out, runtime_id: id, generation, num_rows: if num_worst_tokens > 0 { num_worst_tokens } else { m }, device: self.device_index() })
    }

    /// Intranode combine of bf16 `x` (`[rows, hidden]`, rows as the handle's dispatch produced;
    /// padding rows past the received count take no part) into the caller's `out` (bf16
    /// `[N, hidden]`) and, with `topk_weights` (f32, one row per dispatched row), `out_weights`
    /// (f32 `[N, k]`), on the comm stream. `bias`: None, a tensor or a pair (bf16 `[N, hidden]`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, handle, topk_weights, bias, out, out_weights, num_sms))]
    fn combine(
        &mut self,
        x: &Bound<'_, PyAny>,
        handle: PyRef<'_, Handle>,
        topk_weights: Option<&Bound<'_, PyAny>>,
        bias: Option<&Bound<'_, PyAny>>,
        out: &Bound<'_, PyAny>,
        out_weights: Option<&Bound<'_, PyAny>>,
        num_sms: usize,
    ) -> PyResult<()> {
        let d = CombineDims { num_tokens: handle.inner.num_tokens, num_recv_tokens: handle.inner.num_recv_tokens, num_rows: handle.num_rows, hidden: None };
        let a = doorway::parse_combine(x, topk_weights, bias, out, out_weights, d, self.device_index())?;
        self.check_owner(handle.runtime_id, "handle")?;
        checks::normal_generation(handle.generation, self.intra_generation, false).map_err(py_err)?;
        self.bind()?;
        let gpu = self.gpu_static();
        let keep = self.no_owner.clone();
        // rows past the received count (num_worst_tokens padding) take no part, as in DeepEP
        let m = handle.inner.num_recv_tokens;
        let yt = rows_of(gpu, &keep, &a.x, m);
        let wt = a.topk_weights.as_ref().map(|w| rows_of(gpu, &keep, w, m));
        let b0 = a.bias[0].as_ref().map(|b| view(gpu, &keep, b));
        let b1 = a.bias[1].as_ref().map(|b| view(gpu, &keep, b));
        let ot = view(gpu, &keep, a.out.as_ref().expect("parse_combine reads out"));
        let owt = a.out_weights.as_ref().map(|o| view(gpu, &keep, o));
        let mut args = CombineArgs::new(&yt, &handle.inner).bias(b0.as_ref(), b1.as_ref()).config(Config::with_sms(self.fit_sms(num_sms)));
        if let Some(w) = wt.as_ref() {
            args = args.weights(w);
        }
        self.intra()?.combine_into(args, &ot, owt.as_ref()).map_err(py_err)?;
        Ok(())
    }

    /// Create (collectively) the internode buffer for `dims` = (ranks_per_host, max_tokens,
    /// hidden, num_sms, max_topk, max_local_experts), starting NVSHMEM on first use; replaces an
    /// earlier one (after every rank finished its work on it). `num_sms` is clamped to this
    /// rank's even share of the SMs ([`Gpu::fit_sms_even`]). Returns the configuration used.
    fn internode_create(&mut self, py: Python<'_>, dims: InterDims) -> PyResult<InterDims> {
        self.bind()?;
        let gpu = self.gpu_static();
        let comm = &self.comm;
        if let Some(old) = self.inter.take() {
            // peers may still read this rank's symmetric memory until they finished their kernels
            without_gil(py, move || -> deepep_kernels::Result<()> {
                gpu.sync("re-creating the internode buffer")?;
                comm.barrier()?;
                drop(old);
                Ok(())
            })
            .map_err(py_err)?;
        }
        let mut cfg = inter_config(dims);
        cfg.num_sms = gpu.fit_sms_even(cfg.num_sms);
        let b = without_gil(py, || -> deepep_kernels::Result<InternodeBuffer<'static>> {
            let nv = inter::nvshmem_runtime(gpu, comm)?;
            InternodeBuffer::new(gpu, comm, &nv, cfg)
        })
        .map_err(py_err)?;
        self.inter = Some(b);
        Ok((cfg.ranks_per_host, cfg.max_tokens_per_rank, cfg.hidden, cfg.num_sms, cfg.max_topk, cfg.max_local_experts))
    }
    /// The internode buffer's configuration (as [`Runtime::internode_create`] returns it).
    fn internode_dims(&self) -> Option<InterDims> {
        self.inter.as_ref().map(|b| {
            let c = b.config();
            (c.ranks_per_host, c.max_tokens_per_rank, c.hidden, c.num_sms, c.max_topk, c.max_local_experts)
        })
    }
    /// The SM count an internode buffer created with `num_sms` would use on this rank.
    fn internode_fit_sms(&self, num_sms: usize) -> usize {
        self.gpu.fit_sms_even(num_sms)
    }

    /// Internode dispatch on the comm stream of `x` (bf16 `[n, hidden]`, or float8_e4m3fn with
    /// row-major `scales` f32 `[n, hidden/128]`): fresh with `topk_idx` / `topk_weights` `[n, k]`
    /// and the layout tensors of `get_dispatch_layout` (checked; the notify kernel recomputes the
    /// routing from `topk_idx`), creating or growing the internode buffer first (collective), or
    /// cached with a `handle`. A fresh dispatch blocks the host (GIL released) until the notify
    /// kernel published the received counts, like DeepEP's internode dispatch.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, handle, expert_alignment, num_sms))]
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
        handle: Option<PyRef<'_, InterHandle>>,
        expert_alignment: usize,
        num_sms: usize,
    ) -> PyResult<NativeInterDispatch> {
        let (world, rph) = (self.comm.world(), self.ranks_per_host.max(1));
        let layout = match (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, handle.as_ref()) {
            (Some(pr), Some(ph), Some(pe), Some(ir), None) => Some((pr, ph, pe, ir)),
            (None, None, None, None, Some(_)) => {
                if topk_idx.is_some() || topk_weights.is_some() {
                    return Err(PyValueError::new_err("a cached dispatch (handle given) takes no topk_idx / topk_weights"));
                }
                None
            }
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
        let a = doorway::parse_internode_dispatch(x, scales, topk, layout, world, world / rph, self.device_index())?;
        let (n, h) = (a.plan.num_tokens, a.plan.hidden);
        if a.plan.scales_column_major == Some(true) {
            return Err(PyValueError::new_err("the internode kernels read row-major x scales; pass x_scales.contiguous()"));
        }
        self.bind()?;
        let id = self.id;
        let out = match handle {
            None => {
                let (k, e) = (a.plan.num_topk.unwrap_or(0), a.plan.num_experts.unwrap_or(0));
                if layout.is_some() && a.topk.is_none() {
                    return Err(PyValueError::new_err("the internode kernels route by top-k ids: pass topk_idx and topk_weights"));
                }
                self.ensure_inter(py, h, k, e / world, num_sms)?;
                self.inter_capacity(n)?;
                let gpu = self.gpu_static();
                let keep = self.no_owner.clone();
                let xt = view(gpu, &keep, &a.x);
                let st = a.scales.as_ref().map(|s| view(gpu, &keep, s));
                let (ia, wa) = a.topk.as_ref().expect("checked above");
                let (idx, w) = (view(gpu, &keep, ia), view(gpu, &keep, wa));
                let mut args = inter::DispatchArgs::fresh(&xt, &idx, &w, e).expert_alignment(expert_alignment);
                if let Some(s) = st.as_ref() {
                    args = args.scales(s);
                }
                let buf = self.inter()?;
                without_gil(py, || buf.dispatch(args)).map_err(py_err)?
            }
            Some(hd) => {
                self.check_owner(hd.runtime_id, "handle")?;
                checks::normal_generation(hd.generation, self.inter_generation, true).map_err(py_err)?;
                self.inter_capacity(n)?;
                let gpu = self.gpu_static();
                let keep = self.no_owner.clone();
                let xt = view(gpu, &keep, &a.x);
                let st = a.scales.as_ref().map(|s| view(gpu, &keep, s));
                let mut args = inter::DispatchArgs::cached(&xt, &hd.inner);
                if let Some(s) = st.as_ref() {
                    args = args.scales(s);
                }
                let buf = self.inter()?;
                without_gil(py, || buf.dispatch(args)).map_err(py_err)?
            }
        };
        Ok(NativeInterDispatch { out, runtime_id: id, generation: self.inter_generation, device: self.device_index() })
    }

    /// Internode combine of bf16 `x` (`[m, hidden]`, rows in the order and width of the
    /// dispatch's `recv_x`) with optional `topk_weights` (f32 `[m, k]`) and `bias` (None, a tensor
    /// or a pair; bf16 `[N, hidden]`), on the comm stream. Never blocks the host.
    #[pyo3(signature = (x, handle, topk_weights, bias))]
    fn internode_combine(&mut self, x: &Bound<'_, PyAny>, handle: PyRef<'_, InterHandle>, topk_weights: Option<&Bound<'_, PyAny>>, bias: Option<&Bound<'_, PyAny>>) -> PyResult<NativeInterCombine> {
        let d = CombineDims { num_tokens: handle.inner.num_tokens, num_recv_tokens: handle.inner.num_recv_tokens, num_rows: handle.inner.num_recv_tokens, hidden: Some(handle.inner.hidden) };
        let a = doorway::parse_combine_no_out(x, topk_weights, bias, d, self.device_index())?;
        self.check_owner(handle.runtime_id, "handle")?;
        checks::normal_generation(handle.generation, self.inter_generation, true).map_err(py_err)?;
        self.bind()?;
        let gpu = self.gpu_static();
        let keep = self.no_owner.clone();
        let yt = view(gpu, &keep, &a.x);
        let wt = a.topk_weights.as_ref().map(|w| view(gpu, &keep, w));
        let b0 = a.bias[0].as_ref().map(|b| view(gpu, &keep, b));
        let b1 = a.bias[1].as_ref().map(|b| view(gpu, &keep, b));
        let mut args = inter::CombineArgs::new(&yt, &handle.inner).bias(b0.as_ref(), b1.as_ref());
        if let Some(w) = wt.as_ref() {
            args = args.weights(w);
        }
        let out = self.inter()?.combine(args).map_err(py_err)?;
        Ok(NativeInterCombine { out })
    }

    /// Create (collectively) the low-latency buffer; replaces an earlier one.
    fn ll_create(&mut self, py: Python<'_>, num_max: usize, hidden: usize, num_experts: usize) -> PyResult<()> {
        self.bind()?;
        if let Some(old) = self.ll.take() {
            without_gil(py, move || drop(old));
        }
        self.retire_ll();
        let gpu = self.gpu_static();
        let comm = &self.comm;
        let b = without_gil(py, || LowLatencyBuffer::new(gpu, comm, num_max, hidden, num_experts, None)).map_err(py_err)?;
        self.ll = Some(b);
        self.ll_dims = Some((num_max, hidden, num_experts));
        Ok(())
    }
    /// The low-latency buffer for these sizes (`clean_low_latency_buffer`): created, collectively,
    /// when missing or created for other sizes, after the size check against `num_rdma_bytes`.
    fn ll_ensure(&mut self, py: Python<'_>, num_max: usize, hidden: usize, num_experts: usize) -> PyResult<()> {
        self.bind()?;
        self.ensure_ll(py, num_max, hidden, num_experts)
    }
    /// Generation of the low-latency buffer (bumped by each re-creation and by `destroy`).
    #[getter]
    fn ll_generation(&self) -> u64 {
        self.ll_generation
    }
    /// (num_max_dispatch_tokens_per_rank, hidden, num_experts) of the low-latency buffer.
    fn ll_dims(&self) -> Option<(usize, usize, usize)> {
        self.ll_dims
    }

    /// Low-latency dispatch of bf16 `x` (`[n, hidden]`, `n <= num_max`) by `topk_idx` (i64
    /// `[n, k]`), creating the low-latency buffer for (num_max, hidden, num_experts) first when
    /// needed (collective). No host wait. In the same call (one crossing from Python), the joins
    /// DeepEP makes around its launch on the comm stream: the kernel runs after the work queued on
    /// `wait_for` and `join_back` waits for it (raw streams; None = no join). When both are the
    /// same stream the kernel is simply launched on that stream (the same order, no event joins);
    /// otherwise on the comm stream between the two joins. Low-latency calls stay ordered among
    /// themselves whichever stream each ran on (`LowLatencyBuffer::set_stream`). `stats` (i32
    /// `[local experts]`) is only checked here; the caller adds the counts. A device error a
    /// kernel recorded is raised first (`check_device_error`). Returns `(recv_x, recv_scales,
    /// recv_count, handle, hook)`: the outputs are torch views of fixed places of the dispatch's
    /// buffer half, made once per half and format and cached until the buffer is destroyed or
    /// re-created (they keep nothing alive); `recv_scales` is None for BF16.
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
        check_device_error(py)?;
        let a = doorway::parse_ll_dispatch(x, topk_idx, stats, num_max, num_experts, self.comm.world(), self.device_index())?;
        self.bind()?;
        self.ensure_ll(py, num_max, a.plan.hidden, num_experts)?;
        let direct = self.ll_stream(wait_for, join_back)?;
        let gpu = self.gpu_static();
        let (id, generation, device) = (self.id, self.ll_generation, self.device_index());
        let xt = view(gpu, &self.no_owner, &a.x);
        let it = view(gpu, &self.no_owner, &a.topk_idx);
        let opts = LlDispatchOpts { use_fp8, round_scale, use_ue8m0, return_hook };
        let out = self.ll()?.dispatch(&xt, &it, opts).map_err(py_err)?;
        if !direct {
            self.join_to(join_back)?;
        }
        let [recv_x, recv_scales, recv_count] = self.ll_views(py, out.packed_recv_x.ptr(), use_fp8, use_ue8m0 && use_fp8)?;
        Ok((
            recv_x,
            recv_scales,
            recv_count,
            LlPyHandle::new(out.handle, id, generation, num_max, num_experts, device),
            out.hook.map(|h| NativeHook { hook: Some(h), runtime_id: id, generation }),
        ))
    }

    /// Low-latency combine of bf16 `x` (`[L, R·num_max, hidden]`; with `zero_copy`, the buffer
    /// `get_next_low_latency_combine_buffer` handed out is read instead and x only has to have its
    /// shape) into the caller's bf16 `out` (`[n, hidden]`) with this rank's `topk_idx` /
    /// `topk_weights` (`[n, k]`), on the comm stream; `handle` None: its buffer was released
    /// (refused); `wait_for` / `join_back` as for `ll_dispatch`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, topk_idx, topk_weights, handle, out, return_hook, wait_for = None, join_back = None, zero_copy = None))]
    fn ll_combine(
        &mut self,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        handle: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        return_hook: bool,
        wait_for: Option<u64>,
        join_back: Option<u64>,
        zero_copy: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<NativeHook>> {
        check_device_error(handle.py())?;
        let handle = handle.downcast::<LlPyHandle>().map_err(|_| {
            PyTypeError::new_err(format!("handle must come from low_latency_dispatch on this Buffer, got {}", handle.get_type().name().map(|n| n.to_string()).unwrap_or_default()))
        })?;
        let handle = handle.get();
        self.check_owner(handle.runtime_id, "low-latency handle")?;
        checks::ll_generation(handle.generation, self.ll_generation, "handle").map_err(py_err)?;
        let (l, rows) = {
            let lay = self.ll()?.layout();
            (lay.num_local_experts(), lay.num_ranks * lay.num_max)
        };
        let d = LlCombineDims { num_tokens: handle.inner.num_tokens, num_topk: handle.inner.num_topk, hidden: handle.inner.hidden, local_experts: l, rows };
        let a = doorway::parse_ll_combine(x, topk_idx, topk_weights, Some(out), zero_copy, d, self.device_index())?;
        self.bind()?;
        let direct = self.ll_stream(wait_for, join_back)?;
        let gpu = self.gpu_static();
        let (id, generation) = (self.id, self.ll_generation);
        let yt = view(gpu, &self.no_owner, &a.x);
        let it = view(gpu, &self.no_owner, &a.topk_idx);
        let wt = view(gpu, &self.no_owner, &a.topk_weights);
        let ot = view(gpu, &self.no_owner, a.out.as_ref().expect("out is required here"));
        let r = self.ll()?.combine_into(&yt, &it, &wt, &handle.inner, &ot, return_hook).map_err(py_err)?;
        if !direct {
            self.join_to(join_back)?;
        }
        Ok(r.hook.map(|h| NativeHook { hook: Some(h), runtime_id: id, generation }))
    }

    /// Launch the receive half of a hooked low-latency call on the comm stream (once);
    /// `wait_for` / `join_back` as for `ll_dispatch`.
    #[pyo3(signature = (hook, wait_for = None, join_back = None))]
    fn ll_recv(&mut self, mut hook: PyRefMut<'_, NativeHook>, wait_for: Option<u64>, join_back: Option<u64>) -> PyResult<()> {
        self.bind()?;
        self.check_owner(hook.runtime_id, "hook")?;
        checks::ll_generation(hook.generation, self.ll_generation, "hook").map_err(py_err)?;
        let h = hook.hook.take().ok_or_else(|| PyRuntimeError::new_err("this receive hook was already called; each hook runs once"))?;
        let direct = self.ll_stream(wait_for, join_back)?;
        self.ll()?.recv(h).map_err(py_err)?;
        if direct {
            Ok(())
        } else {
            self.join_to(join_back)
        }
    }

    /// The comm stream waits for every low-latency call so far (which may have run on the
    /// callers' streams: see `ll_dispatch`), e.g. before the caller records or waits on it.
    fn comm_after_ll(&mut self) -> PyResult<()> {
        self.bind()?;
        let comm = self.gpu.cu_stream();
        match self.ll.as_ref() {
            Some(ll) => ll.order_after_calls(comm).map_err(py_err),
            None => Ok(()),
        }
    }

    /// The part of the local NVLink buffer (`rdma=False`) or symmetric buffer from byte `offset`
    /// as elements of `elem_bytes`: `(device address, element count)`, the count being all that
    /// fits, or the product of `shape` when given (refused when it does not fit).
    #[pyo3(signature = (rdma, offset = 0, elem_bytes = 1, shape = None))]
    fn local_buffer(&self, rdma: bool, offset: i64, elem_bytes: usize, shape: Option<Vec<usize>>) -> PyResult<(u64, usize)> {
        let (ptr, nbytes) = if rdma {
            self.ll.as_ref().map(|b| b.local_buffer()).ok_or_else(|| PyRuntimeError::new_err("no low-latency (RDMA) buffer: create the Buffer with low_latency_mode=True and run clean_low_latency_buffer or a low-latency dispatch first"))?
        } else {
            self.intra.as_ref().map(|b| b.local_buffer()).ok_or_else(|| PyRuntimeError::new_err("no NVLink buffer: create the Buffer with num_nvl_bytes > 0 and run a dispatch first"))?
        };
        if offset < 0 || offset as u64 > nbytes as u64 {
            return Err(PyValueError::new_err(format!("offset {offset} is outside the {nbytes}-byte buffer")));
        }
        let off = offset as usize;
        let fits = (nbytes - off) / elem_bytes.max(1);
        let count = match shape {
            Some(s) => {
                let numel: usize = s.iter().product();
                if numel > fits {
                    return Err(PyValueError::new_err(format!("size {s:?} needs {numel} elements but the buffer holds {fits} from offset {offset}")));
                }
                numel
            }
            None => fits,
        };
        Ok((ptr + off as u64, count))
    }

    /// Wait for the comm stream (GIL released).
    fn synchronize(&mut self, py: Python<'_>) -> PyResult<()> {
        self.comm_after_ll()?;
        let gpu = self.gpu_static();
        without_gil(py, || gpu.sync("deepep_kernels Runtime.synchronize")).map_err(py_err)
    }

    /// Release the buffers (collective: the low-latency buffer's drop and NVSHMEM finalize
    /// synchronize all ranks). After a peer was lost (a bounded GPU wait expired: `peer_lost`),
    /// local only: the NVLink buffer is freed here, the NVSHMEM buffers and NVSHMEM itself are
    /// left allocated (their frees and finalize wait for every PE, the lost one included), and
    /// NVSHMEM refuses to start again in this process; no barrier with the other ranks.
    fn destroy(&mut self, py: Python<'_>) -> PyResult<()> {
        self.bind()?;
        if let Some(lost) = self.gpu.peer_lost() {
            return self.destroy_local(py, lost);
        }
        let gpu = self.gpu_static();
        let had_nvshmem = self.ll.is_some() || self.inter.is_some();
        let intra = self.intra.take();
        let inter = self.inter.take();
        let ll = self.ll.take();
        self.intra_dims = None;
        self.retire_ll();
        let comm = &self.comm;
        without_gil(py, move || -> deepep_kernels::Result<()> {
            gpu.sync("destroying the buffers")?;
            // every rank finished before the collective frees of the symmetric buffers
            comm.barrier()?;
            drop(intra);
            drop(inter);
            drop(ll);
            if had_nvshmem {
                deepep_kernels::nvshmem::finalize();
            }
            comm.barrier()
        })
        .map_err(py_err)
    }
}

impl Runtime {
    /// [`Runtime::destroy`] after `lost` (an expired wait): no collective step at all.
    fn destroy_local(&mut self, py: Python<'_>, lost: deepep_kernels::error::ErrorRecord) -> PyResult<()> {
        let gpu = self.gpu_static();
        let intra = self.intra.take();
        self.abandon_nvshmem_buffers(&lost);
        self.intra_dims = None;
        self.retire_ll();
        // every kernel of this rank ends within its wait bound; then the NVLink buffer is ours alone
        let synced = without_gil(py, || gpu.sync("destroying the buffers after a lost peer"));
        drop(intra);
        gpu.clear_error();
        match synced {
            Err(e) if !matches!(e, EpError::GpuTimeout { .. }) => Err(py_err(e)),
            _ => Ok(()),
        }
    }

    /// Give the full NVSHMEM world up in this process, then drop the low-latency buffer without
    /// any collective step (its symmetric memory is kept for a low-latency buffer of the surviving
    /// ranks) and leak the internode one (its drop frees collectively).
    fn abandon_nvshmem_buffers(&mut self, lost: &deepep_kernels::error::ErrorRecord) {
        let ll = self.ll.take();
        let inter = self.inter.take();
        if ll.is_some() || inter.is_some() {
            deepep_kernels::nvshmem::abandon(&format!("rank {} lost rank {} while its buffers were in use", lost.rank, lost.peer));
            drop(ll);
            std::mem::forget(inter);
        }
    }
}

impl Drop for Runtime {
    /// A Runtime dropped without `destroy()` after a lost peer must not run the collective drops of
    /// its NVSHMEM buffers (they would wait for that peer forever).
    fn drop(&mut self) {
        if let Some(lost) = self.gpu.peer_lost() {
            self.abandon_nvshmem_buffers(&lost);
        }
    }
}

/// `(launches, nanoseconds)` this process spent inside `cuLaunchKernelEx` since the last reset
/// (`reset` zeroes them after reading); counted only with `DEEPEP_HOST_TIMING=1` in the environment
/// before the first launch (python/scripts/host_profile.py).
#[pyfunction]
#[pyo3(signature = (reset = false))]
fn launch_timing(reset: bool) -> (u64, u64) {
    rt::gpu::launch_timing(reset)
}

/// Bytes of one rank's NVLink buffer for `max_tokens` tokens of `hidden` channels.
#[pyfunction]
fn intranode_buffer_bytes(num_ranks: usize, max_tokens: usize, hidden: usize) -> PyResult<usize> {
    buffer_size_hint(num_ranks, max_tokens, hidden).map_err(py_err)
}

/// Largest per-rank token count whose NVLink buffer fits in `bytes` (0 if none).
#[pyfunction]
fn intranode_max_tokens(num_ranks: usize, hidden: usize, bytes: usize) -> usize {
    let fits = |t: usize| buffer_size_hint(num_ranks, t, hidden).map(|b| b <= bytes).unwrap_or(false);
    if !fits(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1usize, 1usize);
    while fits(hi) && hi < (1 << 24) {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid
        } else {
            hi = mid
        }
    }
    lo
}

/// Bytes of one rank's internode symmetric buffer for `world` ranks in hosts of
/// `ranks_per_host`, `max_tokens` per rank, rows of `hidden`, `num_sms` (even), `max_topk` and
/// `max_local_experts`. ValueError names what is out of range.
#[pyfunction]
fn internode_buffer_bytes(world: usize, ranks_per_host: usize, max_tokens: usize, hidden: usize, num_sms: usize, max_topk: usize, max_local_experts: usize) -> PyResult<usize> {
    inter_bytes(world, (ranks_per_host, max_tokens, hidden, num_sms, max_topk, max_local_experts)).map_err(py_err)
}

/// Largest per-rank token count whose internode buffer fits in `bytes` (0 if none).
#[pyfunction]
fn internode_max_tokens(world: usize, ranks_per_host: usize, hidden: usize, num_sms: usize, max_topk: usize, max_local_experts: usize, bytes: usize) -> usize {
    inter_max_tokens(world, (ranks_per_host, 0, hidden, num_sms, max_topk, max_local_experts), bytes)
}

/// (max ranks per host, max top-k, max experts) of the internode kernels.
#[pyfunction]
fn internode_limits() -> (usize, usize, usize) {
    (inter::plan::MAX_RANKS_PER_HOST, inter::plan::MAX_TOPK, inter::plan::MAX_EXPERTS)
}

/// Bytes of one rank's low-latency symmetric buffer (`grid`: SMs the kernels use).
#[pyfunction]
fn ll_buffer_bytes(num_ranks: usize, num_experts: usize, num_max: usize, hidden: usize, grid: usize) -> PyResult<usize> {
    LlLayout::new(num_ranks, num_experts, num_max, hidden, grid).map(|l| l.total_bytes).map_err(py_err)
}

/// Whether the embedded sm_90a cubins of the intranode and low-latency kernels are present.
#[pyfunction]
fn is_sm90_compiled() -> bool {
    deepep_kernels::cubins::get("intranode").is_some() && deepep_kernels::cubins::get("layout").is_some()
}

/// NVSHMEM release whose device code the NVSHMEM kernels use in this process: the release of the
/// host library once one was loaded (`nvshmem_host_check`, a low-latency or internode Buffer),
/// else the build's default release; None without NVSHMEM kernels.
#[pyfunction]
fn nvshmem_device_version() -> Option<(u32, u32, u32)> {
    deepep_kernels::cubins::nvshmem_release()
}

/// The NVSHMEM releases this build has cubins for ("3.3.20", ...; ascending), read from the
/// releases marker embedded in the extension (which tools such as `deepep-nix doctor` read from
/// the file). Empty without NVSHMEM kernels.
#[pyfunction]
fn nvshmem_releases() -> Vec<String> {
    deepep_kernels::cubins::releases_from_marker()
}

/// Load the NVSHMEM host library the low-latency mode would use (the one already loaded in the
/// process, else `$NVSHMEM_DIR/lib`, else the loader's search path), check that this build has
/// cubins for its release, and select them for the process. Returns (path, version); raises
/// RuntimeError naming the releases served and the fix on a mismatch or when it cannot be loaded.
/// No GPU needed.
#[pyfunction]
fn nvshmem_host_check() -> PyResult<(String, String)> {
    if deepep_kernels::cubins::NVSHMEM_RELEASES.is_empty() {
        return Err(PyNotImplementedError::new_err(
            "this wheel was built without NVSHMEM kernels (NVSHMEM_DIR unset at build time); rebuild it with python/scripts/build-wheel.sh",
        ));
    }
    let lib = deepep_kernels::nvshmem::load_host_library().map_err(py_err)?;
    Ok((lib.path().display().to_string(), lib.version().to_string()))
}

/// What [`_exchange_selftest`] gathered: (all-gather of the data, broadcast, all-gather of the ranks).
type ExchangeSelftest = (Vec<Vec<u8>>, Vec<u8>, Vec<u64>);

/// Diagnostic (no GPU): build the [`Comm`] a `Runtime` would use over `all_gather` and run, with
/// the GIL released as in the buffer calls, an all-gather of `data`, a broadcast from rank
/// `world - 1`, a barrier and an all-gather of `rank` as u64. Returns (gathered, broadcast, ranks).
#[pyfunction]
fn _exchange_selftest(py: Python<'_>, rank: usize, world: usize, data: Vec<u8>, all_gather: Py<PyAny>) -> PyResult<ExchangeSelftest> {
    let comm = Comm::with_exchange(rank, world, rank, world, Arc::new(PyExchange { f: all_gather })).map_err(py_err)?;
    without_gil(py, || -> deepep_kernels::Result<_> {
        let all = comm.all_gather(&data)?;
        let b = comm.broadcast(world - 1, &data)?;
        comm.barrier()?;
        let ranks = comm.all_gather_u64(rank as u64)?;
        Ok((all, b, ranks))
    })
    .map_err(py_err)
}

/// `DEEPEP_KERNELS_TRAP_ON_ERROR`: `1` = a kernel that records a fatal error (an expired wait, a
/// failed device check) then traps, so no CUDA call of the process succeeds afterwards (the old
/// behaviour); unset, empty or `0` = no trap (the default).
fn trap_on_error_env() -> PyResult<bool> {
    parse_trap_env(std::env::var("DEEPEP_KERNELS_TRAP_ON_ERROR").ok().as_deref()).map_err(PyValueError::new_err)
}

fn parse_trap_env(v: Option<&str>) -> Result<bool, String> {
    match v.map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(format!(
            "DEEPEP_KERNELS_TRAP_ON_ERROR={other:?}: use 1 (a fatal device error traps and the CUDA context is lost) or 0 \
             (the default: the error is raised by the next Buffer call and the context survives)"
        )),
    }
}

/// The error a kernel of this process recorded and nobody took yet, as text (a dropped bad expert
/// id, an expired GPU wait naming rank, call, phase, channel and peer, or a failed device check);
/// None when no kernel recorded one. Only looks: see `take_device_error`.
#[pyfunction]
fn device_error() -> Option<String> {
    rt::gpu::pending_device_error().map(|e| e.to_string())
}

/// `(kind, message)` of the error a kernel of this process recorded, or None. `kind` is
/// `"argument"` (a routing id that points nowhere was dropped; the call completed normally on
/// every rank; this clears the record, so it is returned once), `"timeout"` (a bounded GPU wait
/// expired: a peer died or stopped calling) or `"fatal"` (another device-side check failed). A
/// timeout or fatal record is kept: it is returned again by every later call until the Buffer is
/// destroyed. With `fatal_only`, an argument record is neither returned nor cleared.
#[pyfunction]
#[pyo3(signature = (fatal_only = false))]
fn take_device_error(fatal_only: bool) -> Option<(String, String)> {
    if fatal_only {
        return rt::gpu::pending_fatal_error().map(|e| (fatal_kind(&e).to_string(), e.to_string()));
    }
    rt::gpu::take_pending_device_error().map(|(kind, e)| (kind.name().to_string(), e.to_string()))
}

/// The Python classes of recorded device errors, `(DeviceError, DeviceArgumentError,
/// PeerTimeoutError)`: `deepep_kernels.buffer` defines them (DeviceArgumentError is also a
/// ValueError) and registers them at import.
static ERROR_TYPES: pyo3::sync::GILOnceCell<[Py<pyo3::types::PyType>; 3]> = pyo3::sync::GILOnceCell::new();

#[pyfunction]
fn _register_error_types(py: Python<'_>, device: Py<pyo3::types::PyType>, argument: Py<pyo3::types::PyType>, timeout: Py<pyo3::types::PyType>) {
    let _ = ERROR_TYPES.set(py, [device, argument, timeout]);
}

/// The exception for a record of `kind` ("argument", "timeout", anything else: fatal).
fn recorded_error(py: Python<'_>, kind: &str, msg: String) -> PyErr {
    let Some(t) = ERROR_TYPES.get(py) else { return PyRuntimeError::new_err(msg) };
    let i = match kind {
        "argument" => 1,
        "timeout" => 2,
        _ => 0,
    };
    PyErr::from_type(t[i].bind(py).clone(), msg)
}

/// Raise what a kernel of this process recorded, if anything: `DeviceArgumentError` once (the
/// record is cleared), `PeerTimeoutError` or `DeviceError` every time until the Buffer is
/// destroyed. Every `Buffer` method calls it first (the two low-latency calls inside their native
/// call). Outputs of an asynchronous call that recorded an error may already have been read by
/// torch before this raises (docs/python.md, "Device-side errors").
#[pyfunction]
fn check_device_error(py: Python<'_>) -> PyResult<()> {
    match rt::gpu::take_pending_device_error() {
        Some((kind, e)) => Err(recorded_error(py, kind.name(), e.to_string())),
        None => Ok(()),
    }
}

/// The exception a call that failed should raise instead, when a fatal record is pending (a host
/// wait that ended because a kernel timed out): `PeerTimeoutError` / `DeviceError`; None otherwise.
#[pyfunction]
fn recorded_cause(py: Python<'_>) -> Option<PyErr> {
    rt::gpu::pending_fatal_error().map(|e| recorded_error(py, fatal_kind(&e), e.to_string()))
}

/// The kind of a fatal record: "timeout" for an expired GPU wait, else "fatal".
fn fatal_kind(e: &EpError) -> &'static str {
    if matches!(e, EpError::GpuTimeout { .. }) {
        "timeout"
    } else {
        "fatal"
    }
}

/// Whether an NVIDIA driver (`libcuda`) can be loaded.
#[pyfunction]
fn cuda_available() -> bool {
    rt::cuda_available()
}

/// An event recorded on the raw stream `stream` (DeepEP's `Buffer.capture()`).
#[pyfunction]
fn capture(stream: u64) -> PyResult<Event> {
    Event::recorded_on(stream)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Runtime>()?;
    m.add_class::<Event>()?;
    m.add_class::<Handle>()?;
    m.add_class::<NativeDispatch>()?;
    m.add_class::<LlPyHandle>()?;
    m.add_function(wrap_pyfunction!(launch_timing, m)?)?;
    m.add_class::<NativeHook>()?;
    m.add_class::<InterHandle>()?;
    m.add_class::<NativeInterDispatch>()?;
    m.add_class::<NativeInterCombine>()?;
    m.add_function(wrap_pyfunction!(intranode_buffer_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(intranode_max_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(ll_buffer_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(internode_buffer_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(internode_max_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(internode_limits, m)?)?;
    m.add_function(wrap_pyfunction!(is_sm90_compiled, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_device_version, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_releases, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_host_check, m)?)?;
    m.add_function(wrap_pyfunction!(_exchange_selftest, m)?)?;
    m.add_function(wrap_pyfunction!(capture, m)?)?;
    m.add_function(wrap_pyfunction!(device_error, m)?)?;
    m.add_function(wrap_pyfunction!(take_device_error, m)?)?;
    m.add_function(wrap_pyfunction!(check_device_error, m)?)?;
    m.add_function(wrap_pyfunction!(recorded_cause, m)?)?;
    m.add_function(wrap_pyfunction!(_register_error_types, m)?)?;
    m.add_function(wrap_pyfunction!(handles::py_view, m)?)?;
    m.add_function(wrap_pyfunction!(handles::handle_elements, m)?)?;
    m.add_class::<handles::RawRange>()?;
    m.add("RANKS_PER_HOST_ENV", settings::RANKS_PER_HOST_ENV)?;
    m.add("DISPATCH_VIEWS_ENV", settings::DISPATCH_VIEWS_ENV)?;
    m.add("RECV_ARENA_ENV", settings::RECV_ARENA_ENV)?;
    m.add_function(wrap_pyfunction!(settings::ranks_per_host_from_env, m)?)?;
    m.add_function(wrap_pyfunction!(settings::host_topology, m)?)?;
    m.add_function(wrap_pyfunction!(settings::recv_arena_from_env, m)?)?;
    m.add_function(wrap_pyfunction!(settings::dispatch_views_from_env, m)?)?;
    m.add_function(wrap_pyfunction!(settings::nvshmem_env, m)?)?;
    m.add_function(wrap_pyfunction!(settings::deepep_config, m)?)?;
    m.add_function(wrap_pyfunction!(settings::group_layout, m)?)?;
    m.add_function(wrap_pyfunction!(settings::recv_counts_per_expert, m)?)?;
    m.add_function(wrap_pyfunction!(settings::prepare_nvshmem, m)?)?;
    m.add_function(wrap_pyfunction!(doorway::check_call, m)?)?;
    m.add_function(wrap_pyfunction!(doorway::checked_methods, m)?)?;
    m.add_function(wrap_pyfunction!(doorway::read_tensor, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_is_the_largest_count_that_fits() {
        let bytes = buffer_size_hint(8, 4096, 7168).unwrap();
        assert_eq!(intranode_max_tokens(8, 7168, bytes), 4096);
        assert_eq!(intranode_max_tokens(8, 7168, bytes - 1), 4095);
        assert_eq!(intranode_max_tokens(8, 7168, 10), 0);
    }

    #[test]
    fn internode_max_tokens_is_the_largest_count_that_fits() {
        let d = (2, 0, 2048, 24, 8, 8);
        let bytes = inter_bytes(8, (2, 300, 2048, 24, 8, 8)).unwrap();
        assert_eq!(inter_max_tokens(8, d, bytes), 300);
        assert_eq!(inter_max_tokens(8, d, bytes - 1), 299);
        assert_eq!(inter_max_tokens(8, d, 10), 0);
        // an invalid configuration (3 ranks per host of 8 ranks) fits nowhere
        assert_eq!(inter_max_tokens(8, (3, 0, 2048, 24, 8, 8), usize::MAX), 0);
        assert!(inter_bytes(8, (3, 16, 2048, 24, 8, 8)).unwrap_err().to_string().contains("divide"));
    }

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
