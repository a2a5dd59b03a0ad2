//! The way out: every output of a `Buffer` call is a torch tensor made here, in one of three ways:
//!
//! - a **view** of device memory (`torch.as_tensor` of a [`RawRange`], zero-copy) that keeps an
//!   owner alive: the arena region of an intranode dispatch, the fixed receive region (views
//!   mode), the low-latency buffer halves (owner-less, cached per half), the local buffer;
//! - a **fresh tensor** (`torch.empty` on the caller's current stream, or on the comm stream when
//!   the caller's `allocate_on_comm_stream` made it current) that a kernel writes (layout,
//!   combine);
//! - a **copy** into a fresh tensor, queued with `cuMemcpyDtoDAsync` on the comm stream right after
//!   the kernel that wrote the source (intranode outputs without the arena, internode outputs,
//!   which the kernels crate frees stream-ordered after the copies).
//!
//! torch is never imported at module load: the first call that hands out a tensor imports it.

use crate::cuda;
use cudarc::driver::sys;
use deepep_kernels::tensor::{DType, Tensor};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyTuple};

/// Device memory at `ptr` as `__cuda_array_interface__` (bytes), for `torch.as_tensor`, which
/// keeps this object (and so `owner`) alive as long as the tensor.
#[pyclass(module = "deepep_kernels._native", frozen)]
pub struct RawRange {
    ptr: u64,
    /// Bytes as a C-contiguous `u8` shape: the tensor's shape with the last dimension in bytes, so
    /// that one `.view(dtype)` gives the tensor.
    shape: Vec<usize>,
    #[allow(dead_code)] // held for its lifetime only
    owner: Option<Py<PyAny>>,
}

#[pymethods]
impl RawRange {
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        Ok(d)
    }
}

/// torch and the objects every output needs, looked up once per process.
pub(crate) struct Torch {
    pub module: Py<PyModule>,
    empty: Py<PyAny>,
    as_tensor: Py<PyAny>,
    dtypes: [Py<PyAny>; 7],
}

static TORCH: GILOnceCell<Torch> = GILOnceCell::new();

const DTYPE_ORDER: [DType; 7] = [DType::Bf16, DType::F32, DType::I32, DType::I64, DType::U8, DType::Fp8E4m3, DType::Bool];

fn torch_name(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "bfloat16",
        DType::F32 => "float32",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::U8 => "uint8",
        DType::Fp8E4m3 => "float8_e4m3fn",
        DType::Bool => "bool",
    }
}

/// torch (imported on first use: only paths that hand out tensors get here).
pub(crate) fn torch(py: Python<'_>) -> PyResult<&Torch> {
    TORCH.get_or_try_init(py, || -> PyResult<Torch> {
        let m = py.import("torch")?;
        let dt = |d: DType| -> PyResult<Py<PyAny>> { Ok(m.getattr(torch_name(d))?.unbind()) };
        Ok(Torch {
            empty: m.getattr("empty")?.unbind(),
            as_tensor: m.getattr("as_tensor")?.unbind(),
            dtypes: [dt(DTYPE_ORDER[0])?, dt(DTYPE_ORDER[1])?, dt(DTYPE_ORDER[2])?, dt(DTYPE_ORDER[3])?, dt(DTYPE_ORDER[4])?, dt(DTYPE_ORDER[5])?, dt(DTYPE_ORDER[6])?],
            module: m.unbind(),
        })
    })
}

impl Torch {
    pub(crate) fn dtype<'py>(&self, py: Python<'py>, d: DType) -> &Bound<'py, PyAny> {
        let i = DTYPE_ORDER.iter().position(|x| *x == d).expect("every DType is listed");
        self.dtypes[i].bind(py)
    }
}

/// The torch device object of CUDA device `index`, cached per device.
fn device(py: Python<'_>, index: usize) -> PyResult<Bound<'_, PyAny>> {
    static DEVICES: GILOnceCell<Py<PyDict>> = GILOnceCell::new();
    let cache = DEVICES.get_or_init(py, || PyDict::new(py).unbind()).bind(py);
    if let Some(d) = cache.get_item(index)? {
        return Ok(d);
    }
    let d = torch(py)?.module.bind(py).getattr("device")?.call1(("cuda", index))?;
    cache.set_item(index, &d)?;
    Ok(d)
}

/// A fresh `torch.empty(shape, dtype, device=cuda:index)` on the current stream.
pub(crate) fn empty<'py>(py: Python<'py>, dtype: DType, shape: &[usize], index: usize) -> PyResult<Bound<'py, PyAny>> {
    let t = torch(py)?;
    let kw = PyDict::new(py);
    kw.set_item("dtype", t.dtype(py, dtype))?;
    kw.set_item("device", device(py, index)?)?;
    t.empty.bind(py).call((PyTuple::new(py, shape)?,), Some(&kw))
}

/// A torch tensor of `dtype` (a torch dtype object) and `shape` over device memory at `ptr` on
/// CUDA device `index`, keeping `owner` alive (zero-copy; an empty tensor when it has no
/// elements).
pub(crate) fn view_as<'py>(py: Python<'py>, ptr: u64, dtype: &Bound<'py, PyAny>, shape: &[usize], owner: Option<Py<PyAny>>, index: usize) -> PyResult<Bound<'py, PyAny>> {
    let elem: usize = dtype.getattr("itemsize")?.extract()?;
    view_sized(py, ptr, dtype, elem, shape, owner, index)
}

/// [`view_as`] with the dtype's element size given (`elem` bytes).
fn view_sized<'py>(py: Python<'py>, ptr: u64, dtype: &Bound<'py, PyAny>, elem: usize, shape: &[usize], owner: Option<Py<PyAny>>, index: usize) -> PyResult<Bound<'py, PyAny>> {
    let t = torch(py)?;
    let nbytes = shape.iter().product::<usize>() * elem;
    let kw = PyDict::new(py);
    kw.set_item("device", device(py, index)?)?;
    if nbytes == 0 {
        kw.set_item("dtype", dtype)?;
        return t.empty.bind(py).call((PyTuple::new(py, shape)?,), Some(&kw));
    }
    // u8 of the tensor's shape with its last dimension in bytes: one view to the dtype (a scalar
    // shape is one element)
    let mut bytes_shape = if shape.is_empty() { vec![1] } else { shape.to_vec() };
    *bytes_shape.last_mut().expect("at least one dimension") *= elem;
    let raw = Bound::new(py, RawRange { ptr, shape: bytes_shape, owner })?;
    let v = t.as_tensor.bind(py).call((raw,), Some(&kw))?.call_method1("view", (dtype,))?;
    if shape.is_empty() {
        return v.call_method1("view", (PyTuple::empty(py),));
    }
    Ok(v)
}

/// [`view_as`] of a kernels-crate dtype.
pub(crate) fn view<'py>(py: Python<'py>, ptr: u64, dtype: DType, shape: &[usize], owner: Option<Py<PyAny>>, index: usize) -> PyResult<Bound<'py, PyAny>> {
    let dt = torch(py)?.dtype(py, dtype).clone();
    view_sized(py, ptr, &dt, dtype.size(), shape, owner, index)
}

/// A view of a kernels-crate tensor, keeping `owner` alive.
pub(crate) fn view_of<'py>(py: Python<'py>, t: &Tensor, owner: &Py<PyAny>, index: usize) -> PyResult<Bound<'py, PyAny>> {
    view(py, t.ptr(), t.dtype(), t.shape(), Some(owner.clone_ref(py)), index)
}

/// `data_ptr()` of a torch tensor.
fn data_ptr(t: &Bound<'_, PyAny>) -> PyResult<u64> {
    t.call_method0("data_ptr")?.extract()
}

/// A fresh tensor of `rows` rows (>= the source's) with `src`'s dtype and row shape, whose first
/// rows get a copy of `src` queued on `stream` (the comm stream, right after the kernel that
/// wrote `src`). `pad`: bytes to set the padding rows to (None: left as allocated).
pub(crate) fn copy_out<'py>(py: Python<'py>, src: &Tensor, rows: usize, pad: Option<u8>, stream: sys::CUstream, index: usize) -> PyResult<Bound<'py, PyAny>> {
    let mut shape = src.shape().to_vec();
    let m = shape[0];
    shape[0] = rows.max(m);
    let out = empty(py, src.dtype(), &shape, index)?;
    let row_bytes = shape[1..].iter().product::<usize>() * src.dtype().size();
    let dst = data_ptr(&out)?;
    if m > 0 && row_bytes > 0 {
        if !src.is_contiguous() {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(format!("internal: output {:?} to copy out is not contiguous", src.shape())));
        }
        // SAFETY: both ranges are device memory of `m * row_bytes` bytes in this context; the
        // destination is a fresh torch tensor, the source lives until the copy ran (the caller
        // keeps it alive or frees it stream-ordered on `stream`).
        cuda(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src.ptr(), m * row_bytes, stream) }, "cuMemcpyDtoDAsync (dispatch outputs)")?;
    }
    if let Some(byte) = pad {
        let tail = (shape[0] - m) * row_bytes;
        if tail > 0 {
            // SAFETY: the padding rows of the fresh tensor.
            cuda(unsafe { sys::cuMemsetD8Async(dst + (m * row_bytes) as u64, byte, tail, stream) }, "cuMemsetD8Async (padding rows)")?;
        }
    }
    Ok(out)
}
