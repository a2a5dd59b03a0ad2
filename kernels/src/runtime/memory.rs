//! GPU memory: plain device buffers, pinned host-mapped arrays, and IPC buffers whose peer
//! pointers every rank knows.

use super::{check, drv, Comm, Gpu};
use crate::error::{EpError, Result};
use cudarc::driver::{sys, CudaContext};
use std::sync::Arc;

/// Plain-old-data that may be copied to and from the GPU bit for bit and passed as a kernel
/// argument.
///
/// # Safety
/// `Self` must be `repr(C)` (or a primitive) without padding that matters, without pointers to
/// host memory, and valid for every bit pattern the GPU may write.
pub unsafe trait Pod: Copy + Send + Sync + 'static {}
macro_rules! pod {
    ($($t:ty),*) => { $(unsafe impl Pod for $t {})* };
}
pod!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, half::bf16, half::f16);
unsafe impl Pod for crate::error::Diag {}
unsafe impl Pod for crate::error::ErrorRecord {}
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

fn as_bytes<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: T is Pod.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// A `cuMemAlloc` allocation on one GPU, freed on drop.
pub struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

impl DeviceBuffer {
    /// Uninitialised allocation of `bytes` (at least 16 bytes are reserved, so a zero-sized buffer
    /// still has a valid, distinct address). 256-byte aligned.
    pub fn new(gpu: &Gpu, bytes: usize) -> Result<DeviceBuffer> {
        let ctx = gpu.ctx().clone();
        ctx.bind_to_thread().map_err(drv("binding the context"))?;
        let mut ptr = 0;
        // SAFETY: plain allocation.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(16)) }, || {
            format!("rank {}: cuMemAlloc of {bytes} bytes (free GPU memory? other processes on this GPU?)", gpu.rank())
        })?;
        Ok(DeviceBuffer { ptr, bytes, ctx })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice<T: Pod>(gpu: &Gpu, data: &[T]) -> Result<DeviceBuffer> {
        let b = DeviceBuffer::new(gpu, std::mem::size_of_val(data))?;
        b.upload(gpu, data)?;
        Ok(b)
    }

    /// A zero-filled buffer.
    pub fn zeroed(gpu: &Gpu, bytes: usize) -> Result<DeviceBuffer> {
        let b = DeviceBuffer::new(gpu, bytes)?;
        b.fill_u8(gpu, 0)?;
        gpu.sync("zero-fill a new buffer")?;
        Ok(b)
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Device address of byte `offset` (checked against the size).
    pub fn ptr_at(&self, offset: usize) -> Result<u64> {
        if offset > self.bytes {
            return Err(EpError::InvalidArgument(format!("offset {offset} beyond a buffer of {} bytes", self.bytes)));
        }
        Ok(self.ptr + offset as u64)
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn check_len(&self, what: &str, bytes: usize) -> Result<()> {
        if bytes > self.bytes {
            return Err(EpError::InvalidArgument(format!("{what} of {bytes} bytes into a buffer of {} bytes", self.bytes)));
        }
        Ok(())
    }

    /// Copy `data` to the start of the buffer (ordered on the GPU's stream; returns when done).
    pub fn upload<T: Pod>(&self, gpu: &Gpu, data: &[T]) -> Result<()> {
        let b = as_bytes(data);
        self.check_len("upload", b.len())?;
        gpu.copy_htod(self.ptr, b)
    }

    /// Copy the first `n` elements of type `T` back to the host (waits for the GPU's stream).
    pub fn download<T: Pod + Default>(&self, gpu: &Gpu, n: usize) -> Result<Vec<T>> {
        self.check_len("download", n * std::mem::size_of::<T>())?;
        let mut v = vec![T::default(); n];
        // SAFETY: T is Pod; the slice covers exactly v's memory.
        let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, n * std::mem::size_of::<T>()) };
        gpu.copy_dtoh(bytes, self.ptr)?;
        Ok(v)
    }

    /// Every byte = `v` (asynchronous on the GPU's stream).
    pub fn fill_u8(&self, gpu: &Gpu, v: u8) -> Result<()> {
        gpu.memset_u8(self.ptr, v, self.bytes)
    }

    /// Every 32-bit word = `v` (asynchronous on the GPU's stream; the size must be a multiple of 4).
    /// Used to poison outputs before a test run.
    pub fn fill_u32(&self, gpu: &Gpu, v: u32) -> Result<()> {
        if self.bytes % 4 != 0 {
            return Err(EpError::InvalidArgument(format!("fill_u32 on a buffer of {} bytes (not a multiple of 4)", self.bytes)));
        }
        gpu.memset_u32(self.ptr, v, self.bytes / 4)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: we own the allocation.
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// `len` values of `T` in pinned host memory that the GPU reads and writes directly
/// (`cuMemHostAlloc(DEVICEMAP | PORTABLE)`). The host reads with volatile loads, so it sees GPU
/// writes while kernels run (e.g. the diagnostic record or DeepEP-style receive counters).
pub struct HostMapped<T: Pod> {
    host: *mut T,
    dev: u64,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the memory is process-wide pinned memory; accesses are volatile.
unsafe impl<T: Pod> Send for HostMapped<T> {}
unsafe impl<T: Pod> Sync for HostMapped<T> {}

impl<T: Pod> HostMapped<T> {
    /// `len` zero-initialised values.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<HostMapped<T>> {
        ctx.bind_to_thread().map_err(drv("binding the context"))?;
        let bytes = (len * std::mem::size_of::<T>()).max(16);
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: plain pinned allocation.
        check(unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) }, || format!("cuMemHostAlloc of {bytes} bytes"))?;
        // SAFETY: fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut dev = 0;
        // SAFETY: host was allocated with DEVICEMAP.
        let r = check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }, || "cuMemHostGetDevicePointer".into());
        if let Err(e) = r {
            // SAFETY: allocated above.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(HostMapped { host: host as *mut T, dev, len, ctx: ctx.clone() })
    }

    /// The device address (pass it to kernels).
    pub fn dev_ptr(&self) -> u64 {
        self.dev
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The host address of element 0 (for field-wise volatile or atomic access; the GPU writes
    /// this memory concurrently).
    pub fn host_ptr(&self) -> *mut T {
        self.host
    }
    /// Volatile read of element `i`.
    pub fn get(&self, i: usize) -> T {
        assert!(i < self.len, "HostMapped index {i} out of range {}", self.len);
        // SAFETY: in range; volatile because the GPU writes concurrently.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }
    /// Volatile write of element `i`.
    pub fn set(&self, i: usize, v: T) {
        assert!(i < self.len, "HostMapped index {i} out of range {}", self.len);
        // SAFETY: in range.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
    /// Volatile copy of all elements.
    pub fn snapshot(&self) -> Vec<T> {
        (0..self.len).map(|i| self.get(i)).collect()
    }
    /// Set every element to `v`.
    pub fn fill(&self, v: T) {
        for i in 0..self.len {
            self.set(i, v);
        }
    }
}

impl<T: Pod> Drop for HostMapped<T> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc.
            unsafe { sys::cuMemFreeHost(self.host as *mut std::ffi::c_void) };
        }
    }
}

/// A buffer of the same size on every rank whose address every rank can use: the local
/// allocation's CUDA IPC handle is all-gathered through [`Comm`] and each peer's buffer is opened
/// with lazy peer access (NVLink loads/stores from kernels). Collective: every rank creates its
/// `IpcBuffer`s in the same order with the same size.
pub struct IpcBuffer {
    local: DeviceBuffer,
    ptrs: Vec<u64>,
    rank: usize,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for IpcBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcBuffer(rank {}, {} bytes, ptrs {:x?})", self.rank, self.local.bytes, self.ptrs)
    }
}

impl IpcBuffer {
    /// Allocate `bytes` on every rank (zero-filled) and open every peer's allocation.
    pub fn new(gpu: &Gpu, comm: &Comm, bytes: usize) -> Result<IpcBuffer> {
        let local = DeviceBuffer::zeroed(gpu, bytes)?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: local is a cuMemAlloc allocation.
        check(unsafe { sys::cuIpcGetMemHandle(&mut handle, local.ptr()) }, || format!("rank {}: cuIpcGetMemHandle", gpu.rank()))?;
        let mut msg = Vec::with_capacity(80);
        msg.extend_from_slice(&(bytes as u64).to_le_bytes());
        msg.extend_from_slice(&(gpu.ordinal() as u64).to_le_bytes());
        msg.extend(handle.reserved.iter().map(|&c| c as u8));
        let all = comm.all_gather(&msg)?;
        let mut ptrs = Vec::with_capacity(all.len());
        let mut opened = Vec::new();
        for (r, m) in all.iter().enumerate() {
            let their_bytes = u64::from_le_bytes(m[0..8].try_into().unwrap()) as usize;
            let their_dev = u64::from_le_bytes(m[8..16].try_into().unwrap());
            if their_bytes != bytes {
                return Err(EpError::InvalidArgument(format!(
                    "IpcBuffer: rank {r} allocated {their_bytes} bytes but rank {} allocated {bytes}; every rank must pass the same size (same arguments on every rank?)",
                    gpu.rank()
                )));
            }
            if r == comm.rank() {
                ptrs.push(local.ptr());
                continue;
            }
            let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
            for (d, s) in h.reserved.iter_mut().zip(&m[16..80]) {
                *d = *s as _;
            }
            let mut p = 0;
            // SAFETY: handle from a peer process; flag 1 = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
            let res = unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, 1) };
            if let Err(e) = check(res, || {
                format!(
                    "rank {}: opening rank {r}'s IPC buffer (its GPU ordinal {their_dev}, ours {}); needs peer access between the \
                     two GPUs (NVLink/PCIe P2P) and one GPU per rank (check LOCAL_RANK / CUDA_VISIBLE_DEVICES)",
                    gpu.rank(),
                    gpu.ordinal()
                )
            }) {
                for q in opened {
                    // SAFETY: opened above.
                    unsafe { sys::cuIpcCloseMemHandle(q) };
                }
                return Err(e);
            }
            opened.push(p);
            ptrs.push(p);
        }
        Ok(IpcBuffer { local, ptrs, rank: comm.rank(), ctx: gpu.ctx().clone() })
    }

    /// Address of rank `r`'s buffer, valid on this GPU.
    pub fn ptr(&self, r: usize) -> u64 {
        self.ptrs[r]
    }
    /// All ranks' addresses, index = rank.
    pub fn ptrs(&self) -> &[u64] {
        &self.ptrs
    }
    /// This rank's own allocation.
    pub fn local(&self) -> &DeviceBuffer {
        &self.local
    }
    pub fn bytes(&self) -> usize {
        self.local.bytes
    }
    /// The peer address table as a device array of `u64` (for kernels taking `void** ptrs`).
    pub fn ptr_table(&self, gpu: &Gpu) -> Result<DeviceBuffer> {
        DeviceBuffer::from_slice(gpu, &self.ptrs)
    }
}

impl Drop for IpcBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            for (r, &p) in self.ptrs.iter().enumerate() {
                if r != self.rank {
                    // SAFETY: opened in new().
                    unsafe { sys::cuIpcCloseMemHandle(p) };
                }
            }
        }
    }
}
