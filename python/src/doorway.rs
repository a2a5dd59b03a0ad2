//! The doorway: the tensors a caller passes to a [`crate::Runtime`] method, read as they are
//! (address, real shape, element strides, dtype, device) into [`Arg`]s, which the kernels crate's
//! checks (`deepep_kernels::args`) refuse or accept before anything launches.
//!
//! Two readers, one result:
//! - torch tensors by attribute reads (`data_ptr()`, `shape`, `stride()`, `dtype` compared by
//!   identity with torch's dtype objects, cached once, `is_cuda` / `get_device()`): the default,
//!   a few hundred nanoseconds (python/scripts/host_profile.py times both readers);
//! - DLPack: a `dltensor` / `dltensor_versioned` capsule passed directly, or any object with
//!   `__dlpack__()` (numpy, cupy, JAX, torch too). The capsule is read without being consumed
//!   (its name is left as it is, so its own destructor, or whoever passed it, still frees it per
//!   the DLPack rules), and the data is only used while the caller's object is alive, as with
//!   `data_ptr()`.
//!
//! Each entry point's `parse_*` function is pure (reader + checks over plain state): the
//! `Runtime` methods call it before launching, and [`check_call`] exposes the same functions to
//! the CPU tests, which pass real numpy arrays.

use deepep_kernels::args::{self, Arg, CombineDims, Device, DispatchPlan, LlCombineDims, LlDispatchPlan, Routing};
use deepep_kernels::tensor::DType;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyCapsule, PyDict, PyTuple};
use pyo3::intern;
use std::ffi::c_void;

use crate::py_err;

// --- DLPack (https://dmlc.github.io/dlpack/latest/, dlpack.h) ----------------------------------

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    /// NULL: compact row-major.
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: [u32; 2],
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

fn dl_dtype(code: u8, bits: u8, lanes: u16) -> Result<DType, String> {
    Ok(match (code, bits, lanes) {
        (0, 32, 1) => DType::I32,
        (0, 64, 1) => DType::I64,
        (1, 8, 1) => DType::U8,
        (2, 32, 1) => DType::F32,
        (4, 16, 1) => DType::Bf16,
        (6, 8, 1) => DType::Bool,
        (10, 8, 1) => DType::Fp8E4m3,
        _ => {
            let name = match code {
                0 => format!("int{bits}"),
                1 => format!("uint{bits}"),
                2 => format!("float{bits}"),
                4 => format!("bfloat{bits}"),
                5 => format!("complex{bits}"),
                6 => format!("bool of {bits} bits"),
                7..=17 => {
                    let names = ["float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"];
                    names[(code - 7) as usize].to_string()
                }
                other => format!("DLPack type code {other} of {bits} bits"),
            };
            return Err(if lanes == 1 { name } else { format!("{name}x{lanes}") });
        }
    })
}

fn dl_device(t: i32, id: i32) -> Device {
    match t {
        1 => Device::Cpu,
        2 => Device::Cuda(id.max(0) as usize),
        3 => Device::Other("cuda pinned host memory".into()),
        13 => Device::Other(format!("cuda managed memory (device {id})")),
        other => Device::Other(format!("DLPack device type {other}")),
    }
}

/// # Safety
/// `t` points to a valid `DLTensor` whose shape/strides arrays have `ndim` entries.
unsafe fn read_dltensor(t: &DLTensor) -> Arg {
    let nd = t.ndim.max(0) as usize;
    let shape: Vec<usize> = if nd == 0 { vec![] } else { std::slice::from_raw_parts(t.shape, nd).iter().map(|&s| s.max(0) as usize).collect() };
    let strides: Vec<i64> = if t.strides.is_null() {
        contiguous_strides(&shape)
    } else {
        std::slice::from_raw_parts(t.strides, nd).to_vec()
    };
    Arg {
        dtype: dl_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes),
        shape,
        strides,
        ptr: (t.data as u64).wrapping_add(t.byte_offset),
        device: dl_device(t.device.device_type, t.device.device_id),
    }
}

/// Read a DLPack capsule without consuming it.
fn read_capsule(what: &str, cap: &Bound<'_, PyCapsule>) -> PyResult<Arg> {
    let name = cap.name()?.map(|n| n.to_bytes().to_vec()).unwrap_or_default();
    let p = cap.pointer();
    if p.is_null() {
        return Err(PyValueError::new_err(format!("{what}: the DLPack capsule holds no tensor")));
    }
    match name.as_slice() {
        // SAFETY: a capsule named "dltensor" holds a DLManagedTensor (DLPack spec), alive while the
        // capsule is not consumed; we only read it.
        b"dltensor" => Ok(unsafe { read_dltensor(&(*(p as *const DLManagedTensor)).dl_tensor) }),
        // SAFETY: as above for "dltensor_versioned" and DLManagedTensorVersioned.
        b"dltensor_versioned" => Ok(unsafe { read_dltensor(&(*(p as *const DLManagedTensorVersioned)).dl_tensor) }),
        b"used_dltensor" | b"used_dltensor_versioned" => Err(PyValueError::new_err(format!(
            "{what}: this DLPack capsule was already consumed (name {:?}); pass the array itself or a fresh __dlpack__() capsule",
            String::from_utf8_lossy(&name)
        ))),
        other => Err(PyTypeError::new_err(format!("{what}: a capsule named {:?} is not a DLPack tensor; pass a torch.Tensor", String::from_utf8_lossy(other)))),
    }
}

// --- torch by attributes ------------------------------------------------------------------------

struct Torch {
    tensor: Py<PyAny>,
    dtypes: Vec<(Py<PyAny>, DType)>,
    /// `torch.Tensor.is_contiguous` / `.data_ptr` / `.get_device`, called with the tensor as their
    /// argument when it is exactly a `torch.Tensor`: the same C functions as `x.data_ptr()`, without
    /// a bound method object per call (the limited API has no vectorcall of a method by name).
    /// A subclass may override them in Python, so its tensors are asked by name.
    methods: [Py<PyAny>; 3],
}

static TORCH: GILOnceCell<Torch> = GILOnceCell::new();
static SYS_MODULES: GILOnceCell<Py<PyDict>> = GILOnceCell::new();

/// torch's classes and dtype objects, once torch is imported by the caller (never imported here;
/// until then, one dictionary lookup in `sys.modules` per call).
fn torch(py: Python<'_>) -> Option<&'static Torch> {
    if let Some(t) = TORCH.get(py) {
        return Some(t);
    }
    let modules = SYS_MODULES
        .get_or_try_init(py, || -> PyResult<Py<PyDict>> { Ok(py.import("sys")?.getattr("modules")?.downcast_into::<PyDict>()?.unbind()) })
        .ok()?;
    let m = modules.bind(py).get_item("torch").ok()??;
    let mut dtypes = Vec::new();
    for (name, d) in [("bfloat16", DType::Bf16), ("float32", DType::F32), ("int32", DType::I32), ("int64", DType::I64), ("uint8", DType::U8), ("float8_e4m3fn", DType::Fp8E4m3), ("bool", DType::Bool)] {
        if let Ok(o) = m.getattr(name) {
            dtypes.push((o.unbind(), d));
        }
    }
    let tensor = m.getattr("Tensor").ok()?;
    let method = |name: &str| tensor.getattr(name).ok().map(Bound::unbind);
    let methods = [method("is_contiguous")?, method("data_ptr")?, method("get_device")?];
    let t = Torch { tensor: tensor.unbind(), dtypes, methods };
    let _ = TORCH.set(py, t);
    TORCH.get(py)
}

/// `tensor::contiguous_strides` as the signed strides of an [`Arg`] (same allocation).
fn contiguous_strides(shape: &[usize]) -> Vec<i64> {
    deepep_kernels::tensor::contiguous_strides(shape).into_iter().map(|s| s as i64).collect()
}

/// The integers of a tuple (torch.Size is one), read item by item (no sequence protocol).
fn ints(o: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    match o.downcast::<PyTuple>() {
        Ok(t) => t.iter().map(|v| v.extract::<i64>()).collect(),
        Err(_) => o.extract(),
    }
}

fn read_torch<'py>(py: Python<'py>, t: &Torch, obj: &Bound<'py, PyAny>, exact: bool) -> PyResult<Arg> {
    // is_contiguous(), data_ptr(), get_device() of `obj`
    let call = |i: usize, name: &Bound<'py, pyo3::types::PyString>| -> PyResult<Bound<'py, PyAny>> {
        if exact {
            t.methods[i].bind(py).call1((obj,))
        } else {
            obj.call_method0(name)
        }
    };
    let dt = obj.getattr(intern!(py, "dtype"))?;
    let dtype = match t.dtypes.iter().find(|(o, _)| o.bind(py).is(&dt)) {
        Some((_, d)) => Ok(*d),
        None => Err(dt.str()?.to_string()),
    };
    let shape: Vec<usize> = ints(&obj.getattr(intern!(py, "shape"))?)?.into_iter().map(|v| v.max(0) as usize).collect();
    // The common case costs one boolean call: strides are read (a tuple built by torch) only for
    // a tensor that is not contiguous, whose strides the checks then name.
    let strides = if call(0, intern!(py, "is_contiguous"))?.is_truthy()? {
        contiguous_strides(&shape)
    } else {
        ints(&obj.call_method0(intern!(py, "stride"))?)?
    };
    let ptr: u64 = call(1, intern!(py, "data_ptr"))?.extract()?;
    // get_device(): the CUDA ordinal, -1 for CPU (and meta) tensors: one call instead of is_cuda +
    // get_device. (Other accelerators' tensors, which also answer an ordinal, do not exist in a
    // process with a CUDA Buffer.) The device's name is read only on the refusal path.
    let device = match call(2, intern!(py, "get_device"))?.extract::<i64>()? {
        d if d >= 0 => Device::Cuda(d as usize),
        _ => match obj.getattr(intern!(py, "device"))?.str()?.to_string() {
            d if d == "cpu" => Device::Cpu,
            d => Device::Other(d),
        },
    };
    Ok(Arg { dtype, shape, strides, ptr, device })
}

/// Which reader [`read`] uses for torch tensors (host_profile.py measures both).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Attributes,
    DLPack,
}

/// One tensor argument named `what` (for messages): a torch tensor, any `__dlpack__` exporter, or
/// a DLPack capsule. Anything else is a `TypeError`.
pub fn read_with(what: &str, obj: &Bound<'_, PyAny>, path: Path) -> PyResult<Arg> {
    let py = obj.py();
    if path == Path::Attributes {
        if let Some(t) = torch(py) {
            // exactly torch.Tensor (a pointer comparison), else a subclass (nn.Parameter, ...)
            if obj.get_type().is(t.tensor.bind(py)) {
                return read_torch(py, t, obj, true);
            }
            if obj.is_instance(t.tensor.bind(py))? {
                return read_torch(py, t, obj, false);
            }
        }
    }
    if let Ok(cap) = obj.downcast::<PyCapsule>() {
        return read_capsule(what, cap);
    }
    if obj.hasattr(intern!(py, "__dlpack__"))? {
        let cap = obj.call_method0(intern!(py, "__dlpack__"))?;
        let cap = cap.downcast::<PyCapsule>().map_err(|_| PyTypeError::new_err(format!("{what}: __dlpack__() did not return a capsule")))?;
        return read_capsule(what, cap);
    }
    Err(PyTypeError::new_err(format!("{what} must be a torch.Tensor, got {}", obj.get_type().name()?)))
}

pub fn read(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Arg> {
    read_with(what, obj, Path::Attributes)
}

pub(crate) fn read_opt(what: &str, obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Arg>> {
    match obj {
        Some(o) if !o.is_none() => Ok(Some(read(what, o)?)),
        _ => Ok(None),
    }
}

// --- the entry points' parse functions ----------------------------------------------------------

pub struct LlDispatchArgs {
    pub x: Arg,
    pub topk_idx: Arg,
    pub plan: LlDispatchPlan,
}

pub fn parse_ll_dispatch(x: &Bound<'_, PyAny>, topk_idx: &Bound<'_, PyAny>, stats: Option<&Bound<'_, PyAny>>, num_max: usize, num_experts: usize, world: usize, device: usize) -> PyResult<LlDispatchArgs> {
    let x = read("x", x)?;
    let topk_idx = read("topk_idx", topk_idx)?;
    let stats = read_opt("cumulative_local_expert_recv_stats", stats)?;
    let plan = args::ll_dispatch(&x, &topk_idx, stats.as_ref(), num_max, num_experts, world, device).map_err(py_err)?;
    Ok(LlDispatchArgs { x, topk_idx, plan })
}

pub struct LlCombineArgs {
    /// The expert outputs the kernel reads (the zero-copy buffer when one was given).
    pub x: Arg,
    pub topk_idx: Arg,
    pub topk_weights: Arg,
    pub out: Option<Arg>,
}

#[allow(clippy::too_many_arguments)]
pub fn parse_ll_combine(x: &Bound<'_, PyAny>, topk_idx: &Bound<'_, PyAny>, topk_weights: &Bound<'_, PyAny>, out: Option<&Bound<'_, PyAny>>, zero_copy: Option<&Bound<'_, PyAny>>, d: LlCombineDims, device: usize) -> PyResult<LlCombineArgs> {
    let x = read("x", x)?;
    let zero_copy = read_opt("the zero-copy combine buffer", zero_copy)?;
    let topk_idx = read("topk_idx", topk_idx)?;
    let topk_weights = read("topk_weights", topk_weights)?;
    let out = read_opt("out", out)?;
    args::ll_combine(&x, &topk_idx, &topk_weights, out.as_ref(), zero_copy.as_ref(), d, device).map_err(py_err)?;
    Ok(LlCombineArgs { x: zero_copy.unwrap_or(x), topk_idx, topk_weights, out })
}

pub struct LayoutArgs {
    pub topk_idx: Arg,
    pub per_rank: Arg,
    pub per_expert: Arg,
    pub in_rank: Arg,
}

pub fn parse_dispatch_layout(topk_idx: &Bound<'_, PyAny>, out: (&Bound<'_, PyAny>, &Bound<'_, PyAny>, &Bound<'_, PyAny>), num_experts: usize, world: usize, device: usize) -> PyResult<LayoutArgs> {
    let a = LayoutArgs {
        topk_idx: read("topk_idx", topk_idx)?,
        per_rank: read("num_tokens_per_rank", out.0)?,
        per_expert: read("num_tokens_per_expert", out.1)?,
        in_rank: read("is_token_in_rank", out.2)?,
    };
    args::dispatch_layout(&a.topk_idx, &a.per_rank, &a.per_expert, &a.in_rank, num_experts, world, device).map_err(py_err)?;
    Ok(a)
}

pub struct DispatchArgsIn {
    pub x: Arg,
    pub scales: Option<Arg>,
    pub topk: Option<(Arg, Arg)>,
    /// num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank (fresh dispatch).
    pub layout: Option<(Arg, Arg, Arg)>,
    pub plan: DispatchPlan,
}

/// A dispatch's `x`, its FP8 scales and its (topk_idx, topk_weights), each read as it is.
#[allow(clippy::type_complexity)]
fn read_x_topk<'py>(x: &Bound<'py, PyAny>, scales: Option<&Bound<'py, PyAny>>, topk: Option<(&Bound<'py, PyAny>, &Bound<'py, PyAny>)>) -> PyResult<(Arg, Option<Arg>, Option<(Arg, Arg)>)> {
    let (x, scales) = (read("x", x)?, read_opt("x scales", scales)?);
    let topk = match topk {
        Some((i, w)) => Some((read("topk_idx", i)?, read("topk_weights", w)?)),
        None => None,
    };
    Ok((x, scales, topk))
}

/// The tensors of a normal dispatch: `layout` = (num_tokens_per_rank, num_tokens_per_expert,
/// is_token_in_rank), None for a cached dispatch.
pub fn parse_dispatch<'py>(x: &Bound<'py, PyAny>, scales: Option<&Bound<'py, PyAny>>, topk: Option<(&Bound<'py, PyAny>, &Bound<'py, PyAny>)>, layout: Option<(&Bound<'py, PyAny>, &Bound<'py, PyAny>, &Bound<'py, PyAny>)>, world: usize, device: usize) -> PyResult<DispatchArgsIn> {
    let (x, scales, topk) = read_x_topk(x, scales, topk)?;
    let layout = match layout {
        Some((pr, pe, ir)) => Some((read("num_tokens_per_rank", pr)?, read("num_tokens_per_expert", pe)?, read("is_token_in_rank", ir)?)),
        None => None,
    };
    let routing = layout.as_ref().map(|(pr, pe, ir)| Routing { topk: topk.as_ref().map(|(i, w)| (i, w)), per_rank: pr, per_rdma_rank: None, per_expert: pe, in_rank: ir });
    let plan = args::dispatch(&x, scales.as_ref(), routing, world, device).map_err(py_err)?;
    Ok(DispatchArgsIn { x, scales, topk, layout, plan })
}

pub struct CombineArgsIn {
    pub x: Arg,
    pub topk_weights: Option<Arg>,
    pub bias: [Option<Arg>; 2],
}

/// The tensors of an internode dispatch: `layout` = (num_tokens_per_rank,
/// num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank) over `hosts` hosts, None for
/// a cached dispatch.
#[allow(clippy::type_complexity)]
pub fn parse_internode_dispatch<'py>(
    x: &Bound<'py, PyAny>,
    scales: Option<&Bound<'py, PyAny>>,
    topk: Option<(&Bound<'py, PyAny>, &Bound<'py, PyAny>)>,
    layout: Option<(&Bound<'py, PyAny>, &Bound<'py, PyAny>, &Bound<'py, PyAny>, &Bound<'py, PyAny>)>,
    world: usize,
    hosts: usize,
    device: usize,
) -> PyResult<DispatchArgsIn> {
    let (x, scales, topk) = read_x_topk(x, scales, topk)?;
    let layout = match layout {
        Some((pr, ph, pe, ir)) => Some((
            read("num_tokens_per_rank", pr)?,
            read("num_tokens_per_rdma_rank", ph)?,
            read("num_tokens_per_expert", pe)?,
            read("is_token_in_rank", ir)?,
        )),
        None => None,
    };
    let routing = layout.as_ref().map(|(pr, ph, pe, ir)| Routing { topk: topk.as_ref().map(|(i, w)| (i, w)), per_rank: pr, per_rdma_rank: Some((ph, hosts)), per_expert: pe, in_rank: ir });
    let plan = args::dispatch(&x, scales.as_ref(), routing, world, device).map_err(py_err)?;
    Ok(DispatchArgsIn { x, scales, topk, layout: layout.map(|(pr, _, pe, ir)| (pr, pe, ir)), plan })
}

/// DeepEP's `bias`: None, a tensor, or a pair of tensors.
fn unpack_bias<'py>(bias: Option<&Bound<'py, PyAny>>) -> PyResult<[Option<Bound<'py, PyAny>>; 2]> {
    let Some(b) = bias.filter(|b| !b.is_none()) else { return Ok([None, None]) };
    if let Ok(t) = b.downcast::<PyTuple>() {
        if t.len() != 2 {
            return Err(PyValueError::new_err(format!("bias must be a tensor or a pair of tensors, got a {}-tuple", t.len())));
        }
        let f = |o: Bound<'py, PyAny>| if o.is_none() { None } else { Some(o) };
        return Ok([f(t.get_item(0)?), f(t.get_item(1)?)]);
    }
    Ok([Some(b.clone()), None])
}

/// A combine's tensors before its outputs exist (the binding makes them after these checks).
pub fn parse_combine_no_out(x: &Bound<'_, PyAny>, topk_weights: Option<&Bound<'_, PyAny>>, bias: Option<&Bound<'_, PyAny>>, d: CombineDims, device: usize) -> PyResult<CombineArgsIn> {
    let x = read("x", x)?;
    let topk_weights = read_opt("topk_weights", topk_weights)?;
    let [b0, b1] = unpack_bias(bias)?;
    let bias = [read_opt("bias[0]", b0.as_ref())?, read_opt("bias[1]", b1.as_ref())?];
    args::combine(&x, topk_weights.as_ref(), [bias[0].as_ref(), bias[1].as_ref()], None, None, d, device).map_err(py_err)?;
    Ok(CombineArgsIn { x, topk_weights, bias })
}

pub fn parse_combine(x: &Bound<'_, PyAny>, topk_weights: Option<&Bound<'_, PyAny>>, bias: Option<&Bound<'_, PyAny>>, out: &Bound<'_, PyAny>, out_weights: Option<&Bound<'_, PyAny>>, d: CombineDims, device: usize) -> PyResult<CombineArgsIn> {
    let x = read("x", x)?;
    let topk_weights = read_opt("topk_weights", topk_weights)?;
    let [b0, b1] = unpack_bias(bias)?;
    let bias = [read_opt("bias[0]", b0.as_ref())?, read_opt("bias[1]", b1.as_ref())?];
    let out = read("out", out)?;
    let out_weights = read_opt("out_weights", out_weights)?;
    args::combine(&x, topk_weights.as_ref(), [bias[0].as_ref(), bias[1].as_ref()], Some(&out), out_weights.as_ref(), d, device).map_err(py_err)?;
    Ok(CombineArgsIn { x, topk_weights, bias })
}

/// The tensor-taking `Runtime` methods whose argument checks [`check_call`] runs.
pub const CHECKED_METHODS: [&str; 7] = ["ll_dispatch", "ll_combine", "get_dispatch_layout", "dispatch", "combine", "internode_dispatch", "internode_combine"];

fn state_usize(state: &Bound<'_, PyDict>, key: &str) -> PyResult<usize> {
    state
        .get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("check_call: state has no {key:?}")))?
        .extract()
}

fn arg<'a, 'py>(a: &'a [Bound<'py, PyAny>], i: usize) -> Option<&'a Bound<'py, PyAny>> {
    a.get(i).filter(|o| !o.is_none())
}

fn need<'a, 'py>(method: &str, a: &'a [Bound<'py, PyAny>], i: usize) -> PyResult<&'a Bound<'py, PyAny>> {
    a.get(i).ok_or_else(|| PyValueError::new_err(format!("check_call({method:?}): argument {i} missing")))
}

/// Run the argument checks of `Runtime.<method>` (the same parse function the method runs before
/// launching) on `args` with plain `state` (world, device, buffer and handle sizes) instead of a
/// live buffer: no GPU needed. See `_native.pyi` for each method's arguments and state keys.
#[pyfunction]
#[pyo3(signature = (method, state, *args))]
pub fn check_call(method: &str, state: &Bound<'_, PyDict>, args: &Bound<'_, PyTuple>) -> PyResult<()> {
    let a: Vec<Bound<'_, PyAny>> = args.iter().collect();
    let device = state_usize(state, "device")?;
    let s = |k: &str| state_usize(state, k);
    match method {
        "ll_dispatch" => {
            parse_ll_dispatch(need(method, &a, 0)?, need(method, &a, 1)?, arg(&a, 2), s("num_max")?, s("num_experts")?, s("world")?, device)?;
        }
        "ll_combine" => {
            let d = LlCombineDims { num_tokens: s("num_tokens")?, num_topk: s("num_topk")?, hidden: s("hidden")?, local_experts: s("local_experts")?, rows: s("rows")? };
            parse_ll_combine(need(method, &a, 0)?, need(method, &a, 1)?, need(method, &a, 2)?, arg(&a, 3), arg(&a, 4), d, device)?;
        }
        "get_dispatch_layout" => {
            parse_dispatch_layout(need(method, &a, 0)?, (need(method, &a, 1)?, need(method, &a, 2)?, need(method, &a, 3)?), s("num_experts")?, s("world")?, device)?;
        }
        "dispatch" => {
            let topk = match (arg(&a, 2), arg(&a, 3)) {
                (Some(i), Some(w)) => Some((i, w)),
                _ => None,
            };
            let layout = match (arg(&a, 4), arg(&a, 5), arg(&a, 6)) {
                (Some(pr), Some(pe), Some(ir)) => Some((pr, pe, ir)),
                _ => None,
            };
            parse_dispatch(need(method, &a, 0)?, arg(&a, 1), topk, layout, s("world")?, device)?;
        }
        "combine" => {
            let d = CombineDims { num_tokens: s("num_tokens")?, num_recv_tokens: s("num_recv_tokens")?, num_rows: s("num_rows")?, hidden: None };
            parse_combine(need(method, &a, 0)?, arg(&a, 1), arg(&a, 2), need(method, &a, 3)?, arg(&a, 4), d, device)?;
        }
        "internode_dispatch" => {
            let topk = match (arg(&a, 2), arg(&a, 3)) {
                (Some(i), Some(w)) => Some((i, w)),
                _ => None,
            };
            let layout = match (arg(&a, 4), arg(&a, 5), arg(&a, 6), arg(&a, 7)) {
                (Some(pr), Some(ph), Some(pe), Some(ir)) => Some((pr, ph, pe, ir)),
                _ => None,
            };
            parse_internode_dispatch(need(method, &a, 0)?, arg(&a, 1), topk, layout, s("world")?, s("hosts")?, device)?;
        }
        "internode_combine" => {
            let d = CombineDims { num_tokens: s("num_tokens")?, num_recv_tokens: s("num_recv_tokens")?, num_rows: s("num_recv_tokens")?, hidden: Some(s("hidden")?) };
            parse_combine_no_out(need(method, &a, 0)?, arg(&a, 1), arg(&a, 2), d, device)?;
        }
        other => {
            return Err(PyValueError::new_err(format!("check_call: unknown method {other:?}; one of {}", CHECKED_METHODS.join(", "))));
        }
    }
    Ok(())
}

/// The tensor-taking `Runtime` methods [`check_call`] knows.
#[pyfunction]
pub fn checked_methods() -> Vec<&'static str> {
    CHECKED_METHODS.to_vec()
}

/// (address, shape, element strides, dtype name, device) as [`read_tensor`] returns them.
type TensorRead = (u64, Vec<usize>, Vec<i64>, String, String);

/// Read `obj` with the attribute reader (`dlpack=False`) or through DLPack and return (address,
/// shape, strides, dtype name, device): the doorway's reader alone, for host_profile.py and tests.
#[pyfunction]
#[pyo3(signature = (obj, dlpack = false))]
pub fn read_tensor(obj: &Bound<'_, PyAny>, dlpack: bool) -> PyResult<TensorRead> {
    let a = read_with("tensor", obj, if dlpack { Path::DLPack } else { Path::Attributes })?;
    let dtype = match &a.dtype {
        Ok(d) => args::torch_name(*d).trim_start_matches("torch.").to_string(),
        Err(n) => n.clone(),
    };
    Ok((a.ptr, a.shape, a.strides, dtype, a.device.to_string()))
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dlpack_dtypes_map_to_kernel_dtypes_or_name_themselves() {
        assert_eq!(dl_dtype(4, 16, 1), Ok(DType::Bf16));
        assert_eq!(dl_dtype(10, 8, 1), Ok(DType::Fp8E4m3));
        assert_eq!(dl_dtype(6, 8, 1), Ok(DType::Bool));
        assert_eq!(dl_dtype(2, 16, 1), Err("float16".to_string()));
        assert_eq!(dl_dtype(12, 8, 1), Err("float8_e5m2".to_string()));
        assert_eq!(dl_dtype(2, 32, 4), Err("float32x4".to_string()));
        assert_eq!(dl_dtype(99, 8, 1), Err("DLPack type code 99 of 8 bits".to_string()));
        assert_eq!(dl_device(2, 3), Device::Cuda(3));
        assert_eq!(dl_device(1, 0), Device::Cpu);
    }
}
