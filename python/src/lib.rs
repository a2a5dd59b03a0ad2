//! `deepep_kernels._native`: the PyO3 extension under the `deepep_kernels` Python package, a thin
//! binding of the kernels crate's rank context (`deepep_kernels::context::RankContext`).
//!
//! - [`runtime`]: `Runtime`, one per `Buffer`: each Buffer call is one call into it (checks,
//!   stream joins, launch, outputs, join back), over a `RankContext`, which owns the rank's state.
//! - [`doorway`]: the caller's tensors read as they are (address, real shape, strides, dtype,
//!   device) into the kernels crate's `Arg`s, which its checks (`deepep_kernels::args`) accept or
//!   refuse before any launch.
//! - [`outputs`]: every output as a torch tensor made here (views, fresh tensors, async copies).
//! - [`elastic`]: `ElasticRuntime`, the binding of DeepEP V2's `ElasticBuffer` (its own rank
//!   context with a `kernels::elastic` buffer).
//! - [`handles`]: the handles, indexable like DeepEP's tuples; [`config`]: DeepEP's native
//!   `Config`; [`settings`]: the environment settings and group layout, checked here.
//!
//! `python/deepep_kernels/buffer.py` keeps DeepEP's signatures; `_native.pyi` describes this
//! module. Nothing here links libtorch: torch tensors are read by their attributes, other arrays
//! through DLPack, and the caller's CUDA stream arrives as the raw `CUstream` handle.
//!
//! Streams: every kernel runs on the rank's own non-blocking stream (DeepEP's "comm stream",
//! `comm_stream()`), joined with the caller's stream or event inside each call (event record /
//! stream wait, legal inside CUDA-graph capture). Context: the GPU's primary context, the one
//! PyTorch uses, so pointers and events are shared with torch without copies.

mod config;
mod doorway;
mod elastic;
mod handles;
mod outputs;
mod runtime;
mod settings;

use deepep_kernels::config::buffer_size_hint;
use deepep_kernels::context;
use deepep_kernels::error::EpError;
use deepep_kernels::internode as inter;
use deepep_kernels::low_latency::LlLayout;
use deepep_kernels::runtime::{self as rt, Comm, Exchange};
use cudarc::driver::sys;
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use std::sync::Arc;

// Thread safety of the classes holding kernels-crate objects: PyTorch calls into the Buffer from
// other threads than the one that created it (autograd runs backward passes on its device
// threads), so they cannot be `unsendable`.
// SAFETY: PyO3 serialises access to each object; the CUDA handles inside are valid on any thread
// of the process (every launch binds the primary context first).
macro_rules! thread_safe {
    ($($t:ty),*) => { $(unsafe impl Send for $t {} unsafe impl Sync for $t {})* };
}
pub(crate) use thread_safe;

/// Python exception for a crate error: bad arguments are `ValueError`, unsupported requests
/// `NotImplementedError`, everything else (CUDA, NVSHMEM, timeouts, rendezvous) `RuntimeError`.
pub(crate) fn py_err(e: EpError) -> PyErr {
    match e {
        EpError::InvalidArgument(m) => PyValueError::new_err(m),
        EpError::Unsupported(m) => PyNotImplementedError::new_err(m),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

pub(crate) fn cuda(res: sys::CUresult, what: &str) -> PyResult<()> {
    rt::check(res, || what.to_string()).map_err(py_err)
}

/// Runs `f` with the GIL released. The closure stays on this thread (PyO3 runs it
/// synchronously); the wrapper only lifts the `Send` bound that CUDA handle types lack.
pub(crate) fn without_gil<T, F: FnOnce() -> T>(py: Python<'_>, f: F) -> T {
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

/// A CUDA event in the current (primary) context (`context::Event`). `EventOverlap.event` holds one.
#[pyclass(module = "deepep_kernels._native", frozen)]
pub(crate) struct Event {
    pub(crate) inner: context::Event,
}

impl From<context::Event> for Event {
    fn from(inner: context::Event) -> Event {
        Event { inner }
    }
}

#[pymethods]
impl Event {
    /// A new event recorded on the raw stream handle `stream`.
    #[staticmethod]
    fn recorded_on(stream: u64) -> PyResult<Event> {
        context::Event::recorded_on(stream).map(Event::from).map_err(py_err)
    }
    /// Make `stream` wait for this event (no host wait).
    fn wait_on(&self, stream: u64) -> PyResult<()> {
        self.inner.wait(stream).map_err(py_err)
    }
    /// Block the host until the event completed (GIL released).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let e = &self.inner;
        without_gil(py, || e.synchronize()).map_err(py_err)
    }
    /// Whether the work before the event has completed.
    fn query(&self) -> bool {
        self.inner.query()
    }
}

/// The caller's all-gather (`torch.distributed.all_gather_object` over the Buffer's group):
/// a Python callable `f(bytes) -> list[bytes]`.
pub(crate) struct PyExchange {
    pub(crate) f: Py<PyAny>,
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
    context::intranode_max_tokens(num_ranks, hidden, bytes)
}

/// Bytes of one rank's internode symmetric buffer for `world` ranks in hosts of
/// `ranks_per_host`, `max_tokens` per rank, rows of `hidden`, `num_sms` (even), `max_topk` and
/// `max_local_experts`. ValueError names what is out of range.
#[pyfunction]
fn internode_buffer_bytes(world: usize, ranks_per_host: usize, max_tokens: usize, hidden: usize, num_sms: usize, max_topk: usize, max_local_experts: usize) -> PyResult<usize> {
    context::inter_bytes(world, (ranks_per_host, max_tokens, hidden, num_sms, max_topk, max_local_experts)).map_err(py_err)
}

/// Largest per-rank token count whose internode buffer fits in `bytes` (0 if none).
#[pyfunction]
fn internode_max_tokens(world: usize, ranks_per_host: usize, hidden: usize, num_sms: usize, max_topk: usize, max_local_experts: usize, bytes: usize) -> usize {
    context::inter_max_tokens(world, (ranks_per_host, 0, hidden, num_sms, max_topk, max_local_experts), bytes)
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
pub(crate) fn recorded_error(py: Python<'_>, kind: &str, msg: String) -> PyErr {
    let Some(t) = ERROR_TYPES.get(py) else { return PyRuntimeError::new_err(msg) };
    let i = match kind {
        "argument" => 1,
        "timeout" => 2,
        _ => 0,
    };
    PyErr::from_type(t[i].bind(py).clone(), msg)
}

/// The exception for what `ctx`'s kernels recorded (`RankContext::take_error`: an argument record
/// is taken, a fatal one stays), or None: the first thing each Buffer / ElasticBuffer call raises,
/// and the cause a failed step reports instead of its own error.
pub(crate) fn context_error(py: Python<'_>, ctx: &context::RankContext) -> Option<PyErr> {
    ctx.take_error().map(|(kind, e)| recorded_error(py, kind.name(), e.to_string()))
}

/// Raise what a kernel of any live Buffer of this process recorded, if anything:
/// `DeviceArgumentError` once (the record is cleared), `PeerTimeoutError` or `DeviceError` every
/// time until that Buffer is destroyed or dropped. The Buffer methods look at their own Buffer's
/// record only (`Runtime.check_error`, inside each call); this process-wide look is
/// `deepep_kernels.check_device_error()`.
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
pub(crate) fn fatal_kind(e: &EpError) -> &'static str {
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
    // a dev-profile build (unoptimized): what the timing scripts refuse to measure
    m.add("DEBUG_BUILD", cfg!(debug_assertions))?;
    m.add_class::<runtime::Runtime>()?;
    m.add_class::<outputs::RawRange>()?;
    m.add_class::<elastic::ElasticRuntime>()?;
    m.add_class::<runtime::NativeHook>()?;
    m.add_class::<runtime::Keep>()?;
    m.add_class::<Event>()?;
    m.add_class::<config::Config>()?;
    m.add_class::<handles::Handle>()?;
    m.add_class::<handles::LlPyHandle>()?;
    m.add_class::<handles::InterHandle>()?;
    for f in [
        wrap_pyfunction!(launch_timing, m)?,
        wrap_pyfunction!(intranode_buffer_bytes, m)?,
        wrap_pyfunction!(intranode_max_tokens, m)?,
        wrap_pyfunction!(ll_buffer_bytes, m)?,
        wrap_pyfunction!(internode_buffer_bytes, m)?,
        wrap_pyfunction!(internode_max_tokens, m)?,
        wrap_pyfunction!(internode_limits, m)?,
        wrap_pyfunction!(is_sm90_compiled, m)?,
        wrap_pyfunction!(nvshmem_device_version, m)?,
        wrap_pyfunction!(nvshmem_releases, m)?,
        wrap_pyfunction!(cuda_available, m)?,
        wrap_pyfunction!(nvshmem_host_check, m)?,
        wrap_pyfunction!(_exchange_selftest, m)?,
        wrap_pyfunction!(capture, m)?,
        wrap_pyfunction!(device_error, m)?,
        wrap_pyfunction!(take_device_error, m)?,
        wrap_pyfunction!(check_device_error, m)?,
        wrap_pyfunction!(recorded_cause, m)?,
        wrap_pyfunction!(_register_error_types, m)?,
        wrap_pyfunction!(handles::handle_elements, m)?,
        wrap_pyfunction!(elastic::elastic_buffer_size_hint, m)?,
        wrap_pyfunction!(settings::ranks_per_host_from_env, m)?,
        wrap_pyfunction!(settings::host_topology, m)?,
        wrap_pyfunction!(settings::recv_arena_from_env, m)?,
        wrap_pyfunction!(settings::dispatch_views_from_env, m)?,
        wrap_pyfunction!(settings::nvshmem_env, m)?,
        wrap_pyfunction!(settings::deepep_config, m)?,
        wrap_pyfunction!(settings::group_layout, m)?,
        wrap_pyfunction!(settings::recv_counts_per_expert, m)?,
        wrap_pyfunction!(settings::prepare_nvshmem, m)?,
        wrap_pyfunction!(doorway::check_call, m)?,
        wrap_pyfunction!(doorway::checked_methods, m)?,
        wrap_pyfunction!(doorway::read_tensor, m)?,
    ] {
        m.add_function(f)?;
    }
    m.add("RANKS_PER_HOST_ENV", settings::RANKS_PER_HOST_ENV)?;
    m.add("DISPATCH_VIEWS_ENV", settings::DISPATCH_VIEWS_ENV)?;
    m.add("RECV_ARENA_ENV", settings::RECV_ARENA_ENV)?;
    m.add("DLPACK_VIEWS_ENV", settings::DLPACK_VIEWS_ENV)?;
    m.add("DEFAULT_MAX_TOKENS_ENV", config::DEFAULT_MAX_TOKENS_ENV)?;
    m.add("DEFAULT_MAX_TOKENS", config::DEFAULT_MAX_TOKENS)?;
    m.add("NUM_MAX_NVL_PEERS", config::NUM_MAX_NVL_PEERS)?;
    m.add("INTERNODE_LIMITS", (inter::plan::MAX_RANKS_PER_HOST, inter::plan::MAX_TOPK, inter::plan::MAX_EXPERTS))?;
    Ok(())
}
