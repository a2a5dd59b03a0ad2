//! A small typed device tensor: an owned allocation or a view into a longer-lived buffer (e.g. the
//! intranode NVLink buffer), with shape, element strides and dtype, plus upload/download helpers.
//!
//! Views into a communication buffer carry a *generation* token: the buffer bumps its generation
//! when it overwrites the region (e.g. the next dispatch), and any later use of the stale view
//! ([`Tensor::check_valid`], downloads, passing it to a kernel) fails with an error that says to
//! copy the data out ([`Tensor::to_owned`]) before the next call.

use crate::{EpError, Result};
use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Element type of a [`Tensor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    Bf16,
    F32,
    I32,
    I64,
    /// Raw bytes.
    U8,
    /// FP8 e4m3 bytes (stored as `u8` on the host).
    Fp8E4m3,
    /// One byte per value, 0 or 1.
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
            DType::U8 | DType::Fp8E4m3 | DType::Bool => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Fp8E4m3 => "fp8-e4m3",
            DType::Bool => "bool",
        }
    }
}

/// Host element types that map to a [`DType`] (`u8` maps to [`DType::U8`]; use
/// [`Tensor::from_host_as`] for FP8 or bool bytes).
pub trait Element: Copy + Default + Send + Sync + 'static {
    const DTYPE: DType;
}
impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// Shape, strides, dtype and address of a tensor: everything the argument checks need. Plain
/// data, so the checks can be tested without a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Element strides.
    pub strides: Vec<usize>,
    /// Device address of element 0.
    pub ptr: u64,
}

impl TensorInfo {
    /// A contiguous row-major tensor at `ptr`.
    pub fn contiguous(dtype: DType, shape: &[usize], ptr: u64) -> Self {
        TensorInfo { dtype, shape: shape.to_vec(), strides: contiguous_strides(shape), ptr }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_contiguous(&self) -> bool {
        self.numel() <= 1 || self.strides == contiguous_strides(&self.shape)
    }
    /// `[a, b, c]` for messages.
    pub fn shape_str(&self) -> String {
        format!("{:?}", self.shape)
    }
}

/// Row-major element strides of `shape`, as torch's `stride()` gives them for a contiguous tensor
/// (a zero-size dimension counts as 1, so a stride is never 0).
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// Generation token of a view: valid while `counter` still equals `expected`.
#[derive(Clone)]
pub struct Generation {
    pub counter: Arc<AtomicU64>,
    pub expected: u64,
    /// What overwrites the region, for the error message (e.g. "the next dispatch on this Buffer").
    pub overwritten_by: &'static str,
}

// The `Arc`s below are held only to keep the memory alive while any tensor refers to it.
#[derive(Clone)]
#[allow(dead_code)]
enum Storage {
    /// Owned allocation (freed stream-ordered when the last clone drops).
    Owned(Arc<CudaSlice<u8>>),
    /// Memory owned by someone else, kept alive by `keep`.
    View { keep: Arc<dyn Any + Send + Sync>, generation: Option<Generation> },
}

/// A device tensor (see the module docs). Cloning is cheap and shares the memory.
#[derive(Clone)]
pub struct Tensor {
    storage: Storage,
    stream: Arc<CudaStream>,
    info: TensorInfo,
    /// Bytes spanned from `info.ptr` (for copies and bounds).
    span_bytes: usize,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {:?} @ {:#x}{})", self.info.dtype.name(), self.info.shape, self.info.ptr,
               if matches!(self.storage, Storage::View { .. }) { ", view" } else { "" })
    }
}

fn cuda(context: &str, res: sys::CUresult) -> Result<()> {
    crate::runtime::check(res, || context.to_string())
}

fn span_of(shape: &[usize], strides: &[usize], elem: usize) -> usize {
    if shape.contains(&0) {
        return 0;
    }
    (shape.iter().zip(strides).map(|(&s, &st)| (s - 1) * st).sum::<usize>() + 1) * elem
}

impl Tensor {
    /// Allocate an uninitialised contiguous tensor on `stream` (stream-ordered allocation).
    pub fn empty(stream: &Arc<CudaStream>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        // SAFETY: the memory is uninitialised bytes; callers fill it before reading.
        let slice = unsafe { stream.alloc::<u8>(bytes.max(1)) }
            .map_err(|e| EpError::Cuda { context: format!("allocating {bytes} B for a {} tensor {shape:?}", dtype.name()), message: format!("{:?}", e.0) })?;
        let ptr = {
            let (p, _sync) = slice.device_ptr(stream);
            p
        };
        Ok(Tensor {
            storage: Storage::Owned(Arc::new(slice)),
            stream: stream.clone(),
            info: TensorInfo::contiguous(dtype, shape, ptr),
            span_bytes: bytes,
        })
    }

    /// Allocate a contiguous tensor filled with zero bytes.
    pub fn zeros(stream: &Arc<CudaStream>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let t = Tensor::empty(stream, dtype, shape)?;
        t.fill_bytes(0)?;
        Ok(t)
    }

    /// Upload `data` as a contiguous tensor of `shape` (dtype from `T`).
    pub fn from_host<T: Element>(stream: &Arc<CudaStream>, data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_host_as(stream, T::DTYPE, data, shape)
    }

    /// Upload `data` as `dtype` (same element size as `T`), e.g. FP8 or bool bytes from `u8`.
    pub fn from_host_as<T: Element>(stream: &Arc<CudaStream>, dtype: DType, data: &[T], shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if data.len() != n || std::mem::size_of::<T>() != dtype.size() {
            return Err(EpError::InvalidArgument(format!(
                "upload: {} host values of {} B for a {} tensor of shape {shape:?} ({n} values of {} B); pass exactly one value per element",
                data.len(),
                std::mem::size_of::<T>(),
                dtype.name(),
                dtype.size()
            )));
        }
        let t = Tensor::empty(stream, dtype, shape)?;
        if n > 0 {
            // SAFETY: `data` is n*size bytes; the destination was allocated with that size.
            unsafe {
                cuda("upload (cuMemcpyHtoDAsync)", sys::cuMemcpyHtoDAsync_v2(t.info.ptr, data.as_ptr().cast(), t.span_bytes, stream.cu_stream()))?;
            }
            t.sync("upload")?;
        }
        Ok(t)
    }

    /// A view of memory owned by `keep` (e.g. an IPC buffer): `ptr` is the device address of
    /// element 0, contiguous `shape`. With a `generation`, the view becomes invalid once the owner
    /// bumps the counter.
    pub fn view(stream: &Arc<CudaStream>, keep: Arc<dyn Any + Send + Sync>, ptr: u64, dtype: DType, shape: &[usize], generation: Option<Generation>) -> Tensor {
        let info = TensorInfo::contiguous(dtype, shape, ptr);
        let span_bytes = info.numel() * dtype.size();
        Tensor { storage: Storage::View { keep, generation }, stream: stream.clone(), info, span_bytes }
    }

    /// A view of memory owned by someone else, described by `info` as the caller's tensor is
    /// (real shape and element strides, e.g. a column-major view): the doorway of the Python
    /// extension builds the kernels' tensors this way from the tensors passed in.
    pub fn view_info(stream: &Arc<CudaStream>, keep: Arc<dyn Any + Send + Sync>, info: TensorInfo) -> Tensor {
        let span_bytes = span_of(&info.shape, &info.strides, info.dtype.size());
        Tensor { storage: Storage::View { keep, generation: None }, stream: stream.clone(), info, span_bytes }
    }

    pub fn info(&self) -> &TensorInfo {
        &self.info
    }
    pub fn dtype(&self) -> DType {
        self.info.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.info.shape
    }
    pub fn numel(&self) -> usize {
        self.info.numel()
    }
    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.info.ptr
    }
    pub fn is_contiguous(&self) -> bool {
        self.info.is_contiguous()
    }
    pub fn is_view(&self) -> bool {
        matches!(self.storage, Storage::View { .. })
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Transposed view of a 2-D tensor (shares memory), e.g. column-major FP8 scales:
    /// upload `[S, N]` and pass `.t()` as `[N, S]`.
    pub fn t(&self) -> Result<Tensor> {
        if self.info.shape.len() != 2 {
            return Err(EpError::InvalidArgument(format!("t(): tensor has shape {:?}; only 2-D tensors can be transposed", self.info.shape)));
        }
        let mut t = self.clone();
        t.info.shape.swap(0, 1);
        t.info.strides.swap(0, 1);
        Ok(t)
    }

    /// The current value of this view's generation counter (None without a generation token):
    /// owners that retire their memory for good may store a sentinel there, which this reads.
    pub fn generation_now(&self) -> Option<u64> {
        match &self.storage {
            Storage::View { generation: Some(g), .. } => Some(g.counter.load(Ordering::Acquire)),
            _ => None,
        }
    }

    /// Error if this is a view its owner has overwritten since it was created.
    pub fn check_valid(&self) -> Result<()> {
        if let Storage::View { generation: Some(g), .. } = &self.storage {
            let now = g.counter.load(Ordering::Acquire);
            if now != g.expected {
                return Err(EpError::InvalidArgument(format!(
                    "this {} tensor {:?} is a view into a communication buffer that {} has overwritten; copy it out with Tensor::to_owned() before the next call if you need it longer",
                    self.info.dtype.name(),
                    self.info.shape,
                    g.overwritten_by
                )));
            }
        }
        Ok(())
    }

    /// Wait for the stream, then refuse if a kernel recorded a fatal error (an expired GPU wait
    /// leaves its outputs incomplete while the stream itself completes without a CUDA error). The
    /// wait polls the records and returns such an error as soon as it is recorded. A dropped bad
    /// expert id does not stop a download (the outputs are complete, without that selection); the
    /// buffer's next call reports it.
    fn sync(&self, what: &str) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(|e| EpError::Cuda { context: format!("{what}: binding the context"), message: format!("{:?}", e.0) })?;
        let mut nap = std::time::Duration::from_micros(2);
        loop {
            // SAFETY: a live stream (held by this tensor) of the bound context.
            match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY => {
                    if let Some(e) = crate::runtime::gpu::pending_fatal_error() {
                        return Err(e);
                    }
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(std::time::Duration::from_millis(1));
                }
                other => {
                    if let Some(e) = crate::runtime::gpu::pending_fatal_error() {
                        return Err(e);
                    }
                    return cuda(&format!("{what}: stream synchronize"), other);
                }
            }
        }
        match crate::runtime::gpu::pending_fatal_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Set every byte (stream-ordered, asynchronous), e.g. to poison outputs before a test.
    pub fn fill_bytes(&self, byte: u8) -> Result<()> {
        self.check_valid()?;
        if !self.is_contiguous() {
            return Err(EpError::InvalidArgument("fill_bytes: tensor is not contiguous; fill the underlying contiguous tensor".into()));
        }
        if self.span_bytes > 0 {
            // SAFETY: the range lies inside the allocation this tensor describes.
            unsafe { cuda("fill (cuMemsetD8Async)", sys::cuMemsetD8Async(self.info.ptr, byte, self.span_bytes, self.stream.cu_stream()))? };
        }
        Ok(())
    }

    /// Download a contiguous tensor (waits for the stream).
    pub fn to_host<T: Element>(&self) -> Result<Vec<T>> {
        self.check_valid()?;
        if std::mem::size_of::<T>() != self.info.dtype.size() {
            return Err(EpError::InvalidArgument(format!(
                "download: {} tensor has {} B elements, the host type has {} B; use a host type of the same size",
                self.info.dtype.name(),
                self.info.dtype.size(),
                std::mem::size_of::<T>()
            )));
        }
        if !self.is_contiguous() {
            return Err(EpError::InvalidArgument("download: tensor is not contiguous (a transposed view); download the underlying tensor".into()));
        }
        let mut out = vec![T::default(); self.numel()];
        if !out.is_empty() {
            // SAFETY: `out` has exactly span_bytes bytes; the source range is inside the tensor.
            unsafe {
                cuda("download (cuMemcpyDtoHAsync)", sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), self.info.ptr, self.span_bytes, self.stream.cu_stream()))?;
            }
        }
        self.sync("download")?;
        self.check_valid()?;
        Ok(out)
    }

    /// Copy into a new owned contiguous tensor (stream-ordered). Use it to keep a view of a
    /// communication buffer beyond the next call.
    pub fn to_owned(&self) -> Result<Tensor> {
        self.check_valid()?;
        if !self.is_contiguous() {
            return Err(EpError::InvalidArgument("to_owned: tensor is not contiguous; copy the underlying tensor".into()));
        }
        let t = Tensor::empty(&self.stream, self.info.dtype, &self.info.shape)?;
        self.copy_to(&t)?;
        Ok(t)
    }

    /// Device-to-device copy of the whole tensor into `dst` (same dtype, shape, both contiguous).
    pub fn copy_to(&self, dst: &Tensor) -> Result<()> {
        self.check_valid()?;
        dst.check_valid()?;
        if dst.info.dtype != self.info.dtype || dst.info.shape != self.info.shape || !self.is_contiguous() || !dst.is_contiguous() {
            return Err(EpError::InvalidArgument(format!(
                "copy_to: source {} {:?} and destination {} {:?} differ (or one is not contiguous); pass tensors of the same dtype and shape",
                self.info.dtype.name(),
                self.info.shape,
                dst.info.dtype.name(),
                dst.info.shape
            )));
        }
        if self.span_bytes > 0 {
            // SAFETY: both ranges are inside their tensors and have the same length.
            unsafe { cuda("device copy (cuMemcpyDtoDAsync)", sys::cuMemcpyDtoDAsync_v2(dst.info.ptr, self.info.ptr, self.span_bytes, self.stream.cu_stream()))? };
        }
        Ok(())
    }

    /// Bytes spanned by the tensor's elements.
    pub fn span_bytes(&self) -> usize {
        span_of(&self.info.shape, &self.info.strides, self.info.dtype.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_strides_and_contiguity() {
        let i = TensorInfo::contiguous(DType::F32, &[4, 3], 256);
        assert_eq!(i.strides, vec![3, 1]);
        assert!(i.is_contiguous());
        let t = TensorInfo { shape: vec![3, 4], strides: vec![1, 3], ..i.clone() };
        assert!(!t.is_contiguous());
        assert_eq!(span_of(&t.shape, &t.strides, 4), 48);
        assert_eq!(span_of(&[0, 5], &[5, 1], 2), 0);
        assert!(TensorInfo::contiguous(DType::I64, &[1, 1], 0).is_contiguous());
    }

    #[test]
    fn dtype_sizes() {
        assert_eq!(DType::Bf16.size(), 2);
        assert_eq!(DType::Fp8E4m3.size(), 1);
        assert_eq!(DType::I64.size(), 8);
        assert_eq!(<bf16 as Element>::DTYPE, DType::Bf16);
    }
}
