//! The way out: every output of a `Buffer` call is a torch tensor made here, in one of three ways:
//!
//! - a **view** of device memory (zero-copy) that keeps an owner alive as long as torch's storage:
//!   the arena region of an intranode dispatch, the fixed receive region (views mode), the
//!   low-latency buffer halves (owner-less, cached per half), the local buffer. By default a
//!   DLPack capsule handed to `torch._C._from_dlpack`, whose deleter holds the owner (FP8 as
//!   bytes, then one `.view(dtype)`); with `DEEPEP_KERNELS_DLPACK_VIEWS=0`, `torch.as_tensor` of a
//!   [`RawRange`] (`__cuda_array_interface__`, bytes) and one `.view(dtype)`, the fallback: 6-7 us
//!   more per cached intranode dispatch on an H100 under MPS (record
//!   `2026-12-07-bench-1xh100-host-time-dlpack-views`);
//! - a **fresh tensor** (`torch.empty` on the caller's current stream, or on the comm stream when
//!   the caller's `allocate_on_comm_stream` made it current) that a kernel writes (layout,
//!   combine);
//! - a **copy** into a fresh tensor, queued with `cuMemcpyDtoDAsync` on the comm stream right after
//!   the kernel that wrote the source (intranode outputs without the arena, internode outputs,
//!   which the kernels crate frees stream-ordered after the copies).
//!
//! torch is never imported at module load: the first call that hands out a tensor imports it.

use crate::{cuda, settings};
use cudarc::driver::sys;
use deepep_kernels::tensor::{DType, Tensor};
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyTuple};
use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

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

/// Whether output views are made from DLPack capsules (`DEEPEP_KERNELS_DLPACK_VIEWS`, read once
/// per process, at the first view).
fn dlpack_on() -> PyResult<bool> {
    static ON: OnceLock<Result<bool, String>> = OnceLock::new();
    ON.get_or_init(|| settings::dlpack_views(std::env::var(settings::DLPACK_VIEWS_ENV).ok().as_deref()))
        .clone()
        .map_err(PyValueError::new_err)
}

// --- DLPack (dlpack.h, the legacy unversioned `DLManagedTensor` every torch release reads) ------

/// `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor`.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// `kDLCUDA`.
const DL_CUDA: i32 = 2;
/// The capsule name a producer gives and the one torch renames it to once it owns the tensor.
const DLTENSOR: &CStr = c"dltensor";

/// What one capsule hands torch: the `DLManagedTensor` (first, so that a pointer to it is a
/// pointer to this), the shape and strides it points into, and the owner it keeps alive until
/// torch frees the storage (or the capsule dies unconsumed).
#[repr(C)]
struct Managed {
    tensor: DlManagedTensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    #[allow(dead_code)] // held for its lifetime only
    owner: Option<Py<PyAny>>,
}

/// The `DLManagedTensor` deleter torch calls when the storage goes (maybe without the GIL: the
/// owner's reference is then released by pyo3 the next time a thread holds it).
unsafe extern "C" fn delete_managed(t: *mut DlManagedTensor) {
    if !t.is_null() {
        // SAFETY: `t` is the `Box<Managed>` leaked by `dlpack_view` (its first field), freed once.
        drop(unsafe { Box::from_raw(t.cast::<Managed>()) });
    }
}

/// The capsule's destructor: frees the tensor unless torch consumed it (renamed the capsule).
unsafe extern "C" fn drop_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the GIL on a capsule made by `dlpack_view`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let t = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()).cast::<DlManagedTensor>();
            delete_managed(t);
        }
    }
}

/// `(code, bits)` of a dtype torch reads from DLPack in every release we support; None for FP8
/// (made as bytes and viewed).
fn dl_dtype(d: DType) -> Option<(u8, u8)> {
    match d {
        DType::Bf16 => Some((4, 16)),
        DType::F32 => Some((2, 32)),
        DType::I32 => Some((0, 32)),
        DType::I64 => Some((0, 64)),
        DType::U8 => Some((1, 8)),
        DType::Bool => Some((6, 8)),
        DType::Fp8E4m3 => None,
    }
}

/// A contiguous torch tensor of DLPack dtype `(code, bits)` and `shape` over device memory at `ptr`
/// on CUDA device `index`, keeping `owner` alive as long as torch's storage (zero-copy).
fn dlpack_view<'py>(py: Python<'py>, ptr: u64, (code, bits): (u8, u8), shape: &[usize], owner: Option<Py<PyAny>>, index: usize) -> PyResult<Bound<'py, PyAny>> {
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    let mut m = Box::new(Managed {
        tensor: DlManagedTensor {
            dl_tensor: DlTensor {
                data: ptr as *mut c_void,
                device: DlDevice { device_type: DL_CUDA, device_id: index as i32 },
                ndim: shape.len() as i32,
                dtype: DlDataType { code, bits, lanes: 1 },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_managed),
        },
        shape,
        strides,
        owner,
    });
    // the Vecs' heap buffers do not move with the Box
    m.tensor.dl_tensor.shape = m.shape.as_mut_ptr();
    m.tensor.dl_tensor.strides = m.strides.as_mut_ptr();
    let raw = Box::into_raw(m);
    // SAFETY: `raw` points to a live `Managed` whose first field is the `DLManagedTensor`; the
    // capsule owns it until torch takes it over (then torch calls the deleter) or it dies unused.
    let capsule = unsafe { ffi::PyCapsule_New(raw.cast::<c_void>(), DLTENSOR.as_ptr(), Some(drop_capsule)) };
    if capsule.is_null() {
        // SAFETY: not handed to anyone: free it here.
        unsafe { delete_managed(raw.cast::<DlManagedTensor>()) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference.
    let capsule = unsafe { Bound::from_owned_ptr(py, capsule) };
    // `torch._C._from_dlpack`: a tensor of a `dltensor` capsule, no stream sync (the outputs are
    // ordered by the streams of the call that made them); looked up only when the switch is on
    static FROM_DLPACK: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
    let f = FROM_DLPACK.get_or_try_init(py, || -> PyResult<Py<PyAny>> { Ok(torch(py)?.module.bind(py).getattr("_C")?.getattr("_from_dlpack")?.unbind()) })?;
    f.bind(py).call1((capsule,))
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
    if shape.iter().product::<usize>() * elem == 0 {
        let kw = PyDict::new(py);
        kw.set_item("device", device(py, index)?)?;
        kw.set_item("dtype", dtype)?;
        return torch(py)?.empty.bind(py).call((PyTuple::new(py, shape)?,), Some(&kw));
    }
    // bytes of the tensor's shape with its last dimension in bytes, viewed as the dtype (a scalar
    // shape is one element)
    let mut bytes_shape = if shape.is_empty() { vec![1] } else { shape.to_vec() };
    *bytes_shape.last_mut().expect("at least one dimension") *= elem;
    let bytes = if dlpack_on()? {
        dlpack_view(py, ptr, (1, 8), &bytes_shape, owner, index)?
    } else {
        let kw = PyDict::new(py);
        kw.set_item("device", device(py, index)?)?;
        let raw = Bound::new(py, RawRange { ptr, shape: bytes_shape, owner })?;
        torch(py)?.as_tensor.bind(py).call((raw,), Some(&kw))?
    };
    let v = bytes.call_method1("view", (dtype,))?;
    if shape.is_empty() {
        return v.call_method1("view", (PyTuple::empty(py),));
    }
    Ok(v)
}

/// [`view_as`] of a kernels-crate dtype.
pub(crate) fn view<'py>(py: Python<'py>, ptr: u64, dtype: DType, shape: &[usize], owner: Option<Py<PyAny>>, index: usize) -> PyResult<Bound<'py, PyAny>> {
    match dl_dtype(dtype) {
        Some(code) if shape.iter().product::<usize>() > 0 && dlpack_on()? => dlpack_view(py, ptr, code, shape, owner, index),
        _ => {
            let dt = torch(py)?.dtype(py, dtype).clone();
            view_sized(py, ptr, &dt, dtype.size(), shape, owner, index)
        }
    }
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
