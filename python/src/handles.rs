//! The handles the `Buffer` methods return, indexable like DeepEP v1.2.1's handle tuples
//! (`deep_ep/buffer.py`), and the torch views this module makes of device memory.
//!
//! A handle is what combine (or a cached dispatch) takes back: the kernels crate's handle plus
//! the owner checks (`runtime_id`, the buffer generation at the dispatch). Indexing gives the
//! elements our kernels have as torch tensors (made when first indexed, then kept); the channel
//! matrices and send heads of DeepEP's kernels have no equivalent and raise
//! `NotImplementedError` naming the element.
//!
//! Torch is never imported here at module load: the views are made by [`crate::outputs`], once
//! the caller has torch.

use deepep_kernels::internode as inter;
use deepep_kernels::intranode::Handle as IntraHandle;
use deepep_kernels::low_latency::LlHandle;
use deepep_kernels::tensor::Tensor;
use pyo3::exceptions::{PyIndexError, PyNotImplementedError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBool, PyDict, PyInt};

use crate::{outputs, py_err, without_gil};
use deepep_kernels::context;
use deepep_kernels::tensor::DType;

pub(crate) const INTRANODE_ELEMENTS: [&str; 6] =
    ["rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx", "is_token_in_rank", "send_head"];
pub(crate) const INTERNODE_ELEMENTS: [&str; 10] = [
    "is_token_in_rank",
    "rdma_channel_prefix_matrix",
    "gbl_channel_prefix_matrix",
    "recv_rdma_channel_prefix_matrix",
    "recv_rdma_rank_prefix_sum",
    "recv_gbl_channel_prefix_matrix",
    "recv_gbl_rank_prefix_sum",
    "recv_src_meta",
    "send_rdma_head",
    "send_nvl_head",
];
pub(crate) const LL_ELEMENTS: [&str; 5] = ["src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"];

/// The elements our handles have (indexable); the others are DeepEP's channel/ring-buffer state.
const SUPPORTED: [&str; 9] =
    ["rank_prefix_matrix", "recv_src_idx", "is_token_in_rank", "recv_gbl_rank_prefix_sum", "src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"];

/// Python's index rule for an `n`-tuple: `i` in `-n..n`, negative counting from the end.
pub(crate) fn element_index(i: i64, n: usize) -> Option<usize> {
    let n = n as i64;
    (-n..n).contains(&i).then(|| i.rem_euclid(n) as usize)
}

pub(crate) fn index_error(i: i64, elements: &[&str], kind: &str) -> String {
    format!("{kind} handle index {i} out of range (DeepEP's handle is a {}-tuple: {})", elements.len(), elements.join(", "))
}

pub(crate) fn no_channel_message(kind: &str, elements: &[&str], i: usize) -> String {
    let indexable: Vec<String> = elements.iter().enumerate().filter(|(_, e)| SUPPORTED.contains(e)).map(|(j, e)| format!("[{j}] {e}")).collect();
    format!(
        "deepep_kernels does not support {kind} handle element [{i}] ({}): our kernels have no DeepEP channels or ring buffers, so \
         this element has no equivalent; indexable elements: {}",
        elements[i],
        indexable.join(", ")
    )
}

/// The position `i` (a Python int, not a bool) names in a handle of `elements`.
fn handle_index(i: &Bound<'_, PyAny>, elements: &[&str], kind: &str) -> PyResult<usize> {
    if !i.is_instance_of::<PyInt>() || i.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{kind} handle indices must be integers (DeepEP's handle is a {}-tuple), got {}",
            elements.len(),
            i.get_type().name()?
        )));
    }
    let v: i64 = i.extract().unwrap_or(i64::MAX);
    element_index(v, elements.len()).ok_or_else(|| PyIndexError::new_err(index_error(v, elements, kind)))
}

fn no_channel_element(kind: &str, elements: &[&str], i: usize) -> PyErr {
    PyNotImplementedError::new_err(no_channel_message(kind, elements, i))
}

/// A torch int32 tensor of `values` on CUDA device `device` (a copy).
fn int32_tensor(py: Python<'_>, values: Vec<i32>, device: usize) -> PyResult<Bound<'_, PyAny>> {
    let t = outputs::torch(py)?;
    let kw = PyDict::new(py);
    kw.set_item("dtype", t.dtype(py, DType::I32))?;
    kw.set_item("device", t.module.bind(py).getattr("device")?.call1(("cuda", device))?)?;
    t.module.bind(py).getattr("tensor")?.call((values,), Some(&kw))
}

/// torch's current raw `CUstream` on `device` (`torch._C._cuda_getCurrentRawStream`).
pub(crate) fn current_stream(py: Python<'_>, device: usize) -> PyResult<u64> {
    static READER: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
    let f = READER.get_or_try_init(py, || -> PyResult<Py<PyAny>> { Ok(outputs::torch(py)?.module.bind(py).getattr("_C")?.getattr("_cuda_getCurrentRawStream")?.unbind()) })?;
    f.bind(py).call1((device,))?.extract()
}

// --- the handles -------------------------------------------------------------------------------

/// The communication handle of an intranode dispatch: pass it to `combine` or to a cached
/// `dispatch`. Indexable like DeepEP's 6-tuple for the elements our kernels have: `[0]`
/// `rank_prefix_matrix` (int32 `[R, R]`: rows `[0]..[i]` summed, the rows rank `j` received from
/// ranks `0..i`), `[3]` `recv_src_idx` (int32 `[M]`) and `[4]` `is_token_in_rank` (bool `[N, R]`);
/// the channel matrices `[1]`, `[2]` and `send_head` `[5]` raise `NotImplementedError`. The handle
/// keeps what it needs alive (the layout's `is_token_in_rank`), so it stays valid after later
/// dispatches, as DeepEP's.
#[pyclass(module = "deepep_kernels._native", frozen, sequence)]
pub struct Handle {
    pub(crate) inner: IntraHandle,
    pub(crate) runtime_id: u64,
    /// The NVLink buffer's generation at the dispatch (a re-created buffer refuses the handle).
    pub(crate) generation: u64,
    /// Rows of the dispatch's outputs: num_worst_tokens when given, else the received count.
    pub(crate) num_rows: usize,
    pub(crate) hidden: usize,
    pub(crate) device: usize,
    /// The caller's `is_token_in_rank` (the kernels read it at combine time).
    pub(crate) keep: Py<PyAny>,
    prefix: GILOnceCell<Py<PyAny>>,
}

impl Handle {
    pub(crate) fn new(inner: IntraHandle, runtime_id: u64, generation: u64, num_rows: usize, hidden: usize, device: usize, keep: Py<PyAny>) -> Handle {
        Handle { inner, runtime_id, generation, num_rows, hidden, device, keep, prefix: GILOnceCell::new() }
    }
}

#[pymethods]
impl Handle {
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }
    #[getter]
    fn num_recv_tokens(&self) -> usize {
        self.inner.num_recv_tokens
    }
    #[getter]
    fn num_topk(&self) -> usize {
        self.inner.num_topk
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts
    }
    /// Rows of the dispatch's outputs (`num_worst_tokens` when given, as in DeepEP).
    #[getter]
    fn num_rows(&self) -> usize {
        self.num_rows
    }
    #[getter]
    fn hidden(&self) -> usize {
        self.hidden
    }
    fn __len__(&self) -> usize {
        INTRANODE_ELEMENTS.len()
    }
    fn __getitem__(slf: &Bound<'_, Self>, i: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let me = slf.get();
        match handle_index(i, &INTRANODE_ELEMENTS, "intranode")? {
            0 => me
                .prefix
                .get_or_try_init(py, || -> PyResult<Py<PyAny>> {
                    let r = (me.inner.count_matrix.len() as f64).sqrt() as usize;
                    Ok(int32_tensor(py, me.inner.rank_prefix_matrix(r), me.device)?.call_method1("view", (r, r))?.unbind())
                })
                .map(|t| t.clone_ref(py)),
            3 => {
                let src = &me.inner.recv_src_idx;
                Ok(outputs::view(py, src.ptr(), DType::I32, &[me.inner.num_recv_tokens], Some(slf.clone().into_any().unbind()), me.device)?.unbind())
            }
            4 => Ok(me.keep.clone_ref(py)),
            i => Err(no_channel_element("intranode", &INTRANODE_ELEMENTS, i)),
        }
    }
    fn __repr__(&self) -> String {
        format!("deepep_kernels.Handle(num_tokens={}, num_recv_tokens={}, hidden={})", self.inner.num_tokens, self.inner.num_recv_tokens, self.hidden)
    }
}

/// The communication handle of an internode dispatch: pass it to `combine` or to a cached
/// `dispatch`. Indexable like DeepEP's 10-tuple for `[0]` `is_token_in_rank` and `[6]` (= `[-4]`)
/// `recv_gbl_rank_prefix_sum` (int32 `[R]`: rows from ranks `0..i`); the other elements (channel
/// matrices, source metadata, send heads) raise `NotImplementedError`.
#[pyclass(module = "deepep_kernels._native", name = "InternodeHandle", frozen, sequence)]
pub struct InterHandle {
    pub(crate) inner: inter::Handle,
    pub(crate) runtime_id: u64,
    /// The internode buffer's generation at the dispatch.
    pub(crate) generation: u64,
    pub(crate) device: usize,
    /// The caller's `is_token_in_rank`.
    pub(crate) keep: Py<PyAny>,
    prefix: GILOnceCell<Py<PyAny>>,
}

impl InterHandle {
    pub(crate) fn new(inner: inter::Handle, runtime_id: u64, generation: u64, device: usize, keep: Py<PyAny>) -> InterHandle {
        InterHandle { inner, runtime_id, generation, device, keep, prefix: GILOnceCell::new() }
    }
}

#[pymethods]
impl InterHandle {
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }
    #[getter]
    fn num_recv_tokens(&self) -> usize {
        self.inner.num_recv_tokens
    }
    #[getter]
    fn num_topk(&self) -> usize {
        self.inner.num_topk
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts
    }
    #[getter]
    fn hidden(&self) -> usize {
        self.inner.hidden
    }
    fn __len__(&self) -> usize {
        INTERNODE_ELEMENTS.len()
    }
    fn __getitem__(slf: &Bound<'_, Self>, i: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let me = slf.get();
        match handle_index(i, &INTERNODE_ELEMENTS, "internode")? {
            0 => Ok(me.keep.clone_ref(py)),
            6 => me
                .prefix
                .get_or_try_init(py, || -> PyResult<Py<PyAny>> {
                    // recv_off is [R][C+1]: the last entry of source i's row is where its rows end,
                    // which is DeepEP's inclusive prefix sum over source ranks (rows grouped by source)
                    let off = without_gil(py, || me.inner.recv_offsets()).map_err(py_err)?;
                    let r: usize = me.keep.bind(py).getattr("shape")?.get_item(1)?.extract()?;
                    let c1 = off.len().checked_div(r).filter(|c1| c1 * r == off.len() && *c1 > 0).ok_or_else(|| {
                        PyValueError::new_err(format!("internode handle: {} receive offsets for {r} ranks (expected a multiple)", off.len()))
                    })?;
                    let sums: Vec<i32> = (0..r).map(|i| off[i * c1 + c1 - 1]).collect();
                    Ok(int32_tensor(py, sums, me.device)?.unbind())
                })
                .map(|t| t.clone_ref(py)),
            i => Err(no_channel_element("internode", &INTERNODE_ELEMENTS, i)),
        }
    }
    fn __repr__(&self) -> String {
        format!("deepep_kernels.InternodeHandle(num_tokens={}, num_recv_tokens={}, hidden={})", self.inner.num_tokens, self.inner.num_recv_tokens, self.inner.hidden)
    }
}

const LL_HANDLE_REUSED: &str = "this low-latency handle's receive half was reused by a later dispatch before its routing \
     could be kept (that dispatch ran inside a CUDA graph capture, or the handle's receive hook had not run yet): index the handle \
     (handle[0], handle[1]) and combine with it before dispatching twice more, or call the hook first";

const LL_HANDLE_RELEASED: &str = "this low-latency handle's buffer was destroyed or re-created; its src_info / layout_range are gone";

/// The handle of a low-latency dispatch: pass it to `low_latency_combine`. Indexable like DeepEP's
/// 5-tuple: `[0]` `src_info` (int32 `[L, R*num_max]`: each received row's token index at its
/// source), `[1]` `layout_range` (int64 `[L, R]`: `begin << 32 | count` of each source's rows),
/// `[2]` num_max_dispatch_tokens_per_rank, `[3]` hidden, `[4]` num_experts. `[0]` and `[1]` are
/// torch-owned copies made when first indexed (they cost nothing when never indexed).
/// Self-contained as in DeepEP: while the handle is alive, the dispatch that reuses its receive
/// half first copies the routing combine needs into the handle, so indexing or combining an older
/// handle works. ValueError only where that copy could not be made: the reusing dispatch ran
/// inside a CUDA graph capture, or this dispatch's receive hook had not run yet (docs/python.md);
/// and once the low-latency buffer was destroyed or re-created (the handle does not keep its
/// memory).
#[pyclass(module = "deepep_kernels._native", name = "LowLatencyHandle", frozen, sequence)]
pub struct LlPyHandle {
    pub(crate) inner: LlHandle,
    pub(crate) runtime_id: u64,
    /// The low-latency buffer's generation at the dispatch.
    pub(crate) generation: u64,
    #[pyo3(get)]
    pub(crate) num_max_dispatch_tokens_per_rank: usize,
    #[pyo3(get)]
    pub(crate) num_experts: usize,
    pub(crate) device: usize,
    copies: [GILOnceCell<Py<PyAny>>; 2],
}

impl LlPyHandle {
    pub(crate) fn new(inner: LlHandle, runtime_id: u64, generation: u64, num_max: usize, num_experts: usize, device: usize) -> LlPyHandle {
        LlPyHandle { inner, runtime_id, generation, num_max_dispatch_tokens_per_rank: num_max, num_experts, device, copies: [GILOnceCell::new(), GILOnceCell::new()] }
    }

    /// (address, shape) of `t`, a routing tensor of this handle, while it is valid.
    fn region(&self, t: Tensor) -> PyResult<(u64, Vec<usize>)> {
        if self.inner.buffer_released() {
            return Err(PyValueError::new_err(LL_HANDLE_RELEASED));
        }
        t.check_valid().map_err(|_| PyValueError::new_err(LL_HANDLE_REUSED))?;
        Ok((t.ptr(), t.shape().to_vec()))
    }

    /// A torch-owned copy of `src_info` (0) or `layout_range` (1), read on the current stream.
    fn copy_of(&self, py: Python<'_>, i: usize) -> PyResult<Py<PyAny>> {
        // in the dispatch's half, or in the handle's own copy once a later dispatch reused the half
        let (ptr, shape) = self.region(if i == 0 { self.inner.src_info() } else { self.inner.layout_range() })?;
        let t = outputs::view(py, ptr, if i == 0 { DType::I32 } else { DType::I64 }, &shape, None, self.device)?.call_method0("clone")?;
        if let Some(m) = self.inner.copy_memory() {
            // the own copy is freed stream-ordered on its stream: order that after this read
            let e = context::Event::recorded_on(current_stream(py, self.device)?).map_err(py_err)?;
            e.wait(m.stream().cu_stream() as usize as u64).map_err(py_err)?;
        }
        Ok(t.unbind())
    }
}

#[pymethods]
impl LlPyHandle {
    /// Tokens this rank dispatched (rows of the combine's output).
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }
    #[getter]
    fn num_topk(&self) -> usize {
        self.inner.num_topk
    }
    #[getter]
    fn hidden(&self) -> usize {
        self.inner.hidden
    }
    fn __len__(&self) -> usize {
        LL_ELEMENTS.len()
    }
    fn __getitem__(&self, py: Python<'_>, i: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        match handle_index(i, &LL_ELEMENTS, "low-latency")? {
            2 => Ok(self.num_max_dispatch_tokens_per_rank.into_pyobject(py)?.into_any().unbind()),
            3 => Ok(self.inner.hidden.into_pyobject(py)?.into_any().unbind()),
            4 => Ok(self.num_experts.into_pyobject(py)?.into_any().unbind()),
            i => self.copies[i].get_or_try_init(py, || self.copy_of(py, i)).map(|t| t.clone_ref(py)),
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "deepep_kernels.LowLatencyHandle(num_tokens={}, num_max_dispatch_tokens_per_rank={}, hidden={}, num_experts={})",
            self.inner.num_tokens, self.num_max_dispatch_tokens_per_rank, self.inner.hidden, self.num_experts
        )
    }
}

// SAFETY: see `runtime::thread_safe` (PyO3 serialises access; CUDA handles are valid on any thread).
crate::thread_safe!(Handle, InterHandle, LlPyHandle);

/// The element names of DeepEP's `kind` handle tuple (`intranode`, `internode`, `low-latency`).
#[pyfunction]
pub(crate) fn handle_elements(kind: &str) -> PyResult<Vec<&'static str>> {
    match kind {
        "intranode" => Ok(INTRANODE_ELEMENTS.to_vec()),
        "internode" => Ok(INTERNODE_ELEMENTS.to_vec()),
        "low-latency" => Ok(LL_ELEMENTS.to_vec()),
        other => Err(PyValueError::new_err(format!("unknown handle kind '{other}': use intranode, internode or low-latency"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_follow_pythons_tuple_rule() {
        assert_eq!(element_index(0, 6), Some(0));
        assert_eq!(element_index(5, 6), Some(5));
        assert_eq!(element_index(-6, 6), Some(0));
        assert_eq!(element_index(-1, 5), Some(4));
        assert_eq!(element_index(6, 6), None);
        assert_eq!(element_index(-7, 6), None);
        assert_eq!(element_index(i64::MAX, 6), None);
        assert_eq!(element_index(i64::MIN, 6), None);
    }

    #[test]
    fn deepeps_tuples_element_by_element() {
        // test_internode.py reads handle[-4] as recv_gbl_rank_prefix_sum
        assert_eq!(INTERNODE_ELEMENTS[element_index(-4, 10).unwrap()], "recv_gbl_rank_prefix_sum");
        assert_eq!(&LL_ELEMENTS[..2], &["src_info", "layout_range"]);
        assert_eq!(INTRANODE_ELEMENTS.len(), 6);
        // every supported element is an element of one of the tuples
        assert!(SUPPORTED.iter().all(|s| INTRANODE_ELEMENTS.contains(s) || INTERNODE_ELEMENTS.contains(s) || LL_ELEMENTS.contains(s)));
    }

    #[test]
    fn messages_name_the_element_and_what_can_be_indexed() {
        let m = no_channel_message("intranode", &INTRANODE_ELEMENTS, 1);
        assert!(m.contains("intranode handle element [1] (channel_prefix_matrix)"), "{m}");
        assert!(m.contains("[0] rank_prefix_matrix, [3] recv_src_idx, [4] is_token_in_rank"), "{m}");
        let m = no_channel_message("internode", &INTERNODE_ELEMENTS, 1);
        assert!(m.contains("[0] is_token_in_rank, [6] recv_gbl_rank_prefix_sum") && m.contains("rdma_channel_prefix_matrix"), "{m}");
        let m = index_error(6, &INTRANODE_ELEMENTS, "intranode");
        assert!(m.contains("index 6 out of range") && m.contains("6-tuple: rank_prefix_matrix, "), "{m}");
    }
}
