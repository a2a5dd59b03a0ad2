//! GPU memory: plain device buffers, pinned host-mapped arrays, and IPC buffers whose peer
//! pointers every rank knows.

use super::{check, drv, Comm, Gpu};
use crate::error::{EpError, Result};
use crate::hash::fnv1a;
use cudarc::driver::{result, sys, CudaContext};
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
/// allocation's CUDA IPC handle is all-gathered through [`Comm`] (with the size, GPU and process
/// facts of an `IpcEntry`, which a failed open reports) and each peer's buffer is opened with lazy
/// peer access (NVLink loads/stores from kernels). Collective: every rank creates its `IpcBuffer`s
/// in the same order with the same size.
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
        let mine = IpcEntry::local(gpu, bytes, handle.reserved.map(|c| c as u8));
        let all = comm.all_gather(&mine.encode())?;
        // Every record is read and checked before any handle is opened, so that a refusal leaves
        // nothing open behind it.
        let entries = all.iter().enumerate().map(|(r, m)| IpcEntry::decode(r, m)).collect::<Result<Vec<_>>>()?;
        if let Some((r, theirs)) = entries.iter().enumerate().find(|(_, e)| e.bytes != bytes as u64) {
            return Err(EpError::InvalidArgument(format!(
                "IpcBuffer: rank {r} allocated {} bytes but rank {} allocated {bytes}; every rank must pass the same size (same arguments on every rank?)",
                theirs.bytes,
                gpu.rank()
            )));
        }
        let mut ptrs = Vec::with_capacity(all.len());
        let mut opened = Vec::new();
        for (r, theirs) in entries.iter().enumerate() {
            if r == comm.rank() {
                ptrs.push(local.ptr());
                continue;
            }
            let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
            for (d, s) in h.reserved.iter_mut().zip(&theirs.handle) {
                *d = *s as _;
            }
            let mut p = 0;
            // SAFETY: handle from a peer process; flag 1 = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
            let res = unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, 1) };
            if let Err(e) = check(res, || open_failure_context(gpu.rank(), &mine, r, theirs)) {
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

/// What one rank all-gathers about its part of an [`IpcBuffer`]: the allocation's size and CUDA
/// IPC handle, and where the allocation lives (GPU ordinal and UUID, process id, MPS state), so
/// that a rank that cannot open a peer's handle can say which of the two processes differ.
#[derive(Clone, Debug, PartialEq)]
struct IpcEntry {
    bytes: u64,
    /// The GPU ordinal as this process numbers it (CUDA_VISIBLE_DEVICES applies).
    ordinal: u64,
    /// The GPU's UUID; all zero when the driver could not say.
    uuid: [u8; 16],
    /// Whether this process's context is shared through MPS (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`);
    /// `None` when the driver could not say.
    mps: Option<bool>,
    /// FNV-1a hash of the MPS pipe folder this process would use (`CUDA_MPS_PIPE_DIRECTORY`, else
    /// the driver's default `/tmp/nvidia-mps`): equal hashes mean the same MPS control daemon.
    mps_pipe: u64,
    pid: u32,
    handle: [u8; 64],
}

/// The MPS pipe folder the driver uses when `CUDA_MPS_PIPE_DIRECTORY` is unset.
const DEFAULT_MPS_PIPE: &str = "/tmp/nvidia-mps";

impl IpcEntry {
    /// Encoded size: bytes, ordinal, uuid, mps, mps_pipe, pid, handle.
    const LEN: usize = 8 + 8 + 16 + 1 + 8 + 4 + 64;

    /// This process's entry. The UUID and MPS queries never fail the buffer: they only serve the
    /// error message, so an unanswered query is recorded as unknown. They ask the driver about the
    /// device directly, not through the `CudaContext` methods, which would take (and here lose) an
    /// error the context has recorded for its next call.
    fn local(gpu: &Gpu, bytes: usize, handle: [u8; 64]) -> IpcEntry {
        let dev = gpu.ctx().cu_device();
        let uuid = result::device::get_uuid(dev).map(|u| u.bytes.map(|c| c as u8)).unwrap_or([0; 16]);
        // SAFETY: a device attribute query of a valid device; writes one i32.
        let mps = unsafe { result::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED) }
            .ok()
            .map(|v| v != 0);
        let pipe = std::env::var("CUDA_MPS_PIPE_DIRECTORY").ok().filter(|v| !v.is_empty());
        IpcEntry {
            bytes: bytes as u64,
            ordinal: gpu.ordinal() as u64,
            uuid,
            mps,
            mps_pipe: fnv1a(pipe.as_deref().unwrap_or(DEFAULT_MPS_PIPE).as_bytes()),
            pid: std::process::id(),
            handle,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(Self::LEN);
        m.extend_from_slice(&self.bytes.to_le_bytes());
        m.extend_from_slice(&self.ordinal.to_le_bytes());
        m.extend_from_slice(&self.uuid);
        m.push(match self.mps {
            Some(false) => 0,
            Some(true) => 1,
            None => 2,
        });
        m.extend_from_slice(&self.mps_pipe.to_le_bytes());
        m.extend_from_slice(&self.pid.to_le_bytes());
        m.extend_from_slice(&self.handle);
        m
    }

    /// Rank `r`'s entry from its all-gathered bytes `m`.
    fn decode(r: usize, m: &[u8]) -> Result<IpcEntry> {
        if m.len() != Self::LEN {
            return Err(EpError::InvalidArgument(format!(
                "IpcBuffer: rank {r} sent a {}-byte record where {} bytes were expected: the ranks run different builds of \
                 deepep_kernels; install the same build on every rank",
                m.len(),
                Self::LEN
            )));
        }
        let (bytes, rest) = m.split_at(8);
        let (ordinal, rest) = rest.split_at(8);
        let (uuid, rest) = rest.split_at(16);
        let (mps, rest) = rest.split_at(1);
        let (mps_pipe, rest) = rest.split_at(8);
        let (pid, handle) = rest.split_at(4);
        Ok(IpcEntry {
            bytes: u64::from_le_bytes(bytes.try_into().unwrap()),
            ordinal: u64::from_le_bytes(ordinal.try_into().unwrap()),
            uuid: uuid.try_into().unwrap(),
            mps: match mps[0] {
                0 => Some(false),
                1 => Some(true),
                _ => None,
            },
            mps_pipe: u64::from_le_bytes(mps_pipe.try_into().unwrap()),
            pid: u32::from_le_bytes(pid.try_into().unwrap()),
            handle: handle.try_into().unwrap(),
        })
    }

    fn uuid_known(&self) -> bool {
        self.uuid != [0; 16]
    }

    /// The UUID as nvidia-smi prints it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
    fn uuid_text(&self) -> String {
        let h: String = self.uuid.iter().map(|b| format!("{b:02x}")).collect();
        format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
    }

    fn mps_text(&self) -> &'static str {
        match self.mps {
            Some(true) => "an MPS client",
            Some(false) => "not an MPS client",
            None => "of unknown MPS state",
        }
    }
}

/// The context of a failed `cuIpcOpenMemHandle` by rank `rank` (entry `mine`) of rank `peer`'s
/// buffer (entry `theirs`): what the two processes are, and the likely fix for that case.
fn open_failure_context(rank: usize, mine: &IpcEntry, peer: usize, theirs: &IpcEntry) -> String {
    let what = format!("rank {rank}: opening rank {peer}'s IPC buffer");
    let procs = format!(
        "this process (pid {}) is {}, rank {peer}'s (pid {}) is {}",
        mine.pid,
        mine.mps_text(),
        theirs.pid,
        theirs.mps_text()
    );
    let one_gpu_per_rank = "one GPU per rank (check LOCAL_RANK / CUDA_VISIBLE_DEVICES)";
    if !(mine.uuid_known() && theirs.uuid_known()) {
        return format!(
            "{what} (its GPU ordinal {}, ours {}; {procs}); needs peer access between the two GPUs (NVLink/PCIe P2P) and \
             {one_gpu_per_rank}",
            theirs.ordinal, mine.ordinal
        );
    }
    if mine.uuid != theirs.uuid {
        return format!(
            "{what} (its GPU {}, ours {}; {procs}); needs peer access between the two GPUs (NVLink/PCIe P2P; \
             `nvidia-smi topo -p2p r` shows it) and {one_gpu_per_rank}",
            theirs.uuid_text(),
            mine.uuid_text()
        );
    }
    let fix = match (mine.mps, theirs.mps) {
        (Some(a), Some(b)) if a != b => "only one of the two joined MPS: start the MPS control daemon \
             (nvidia-cuda-mps-control -d) before any rank and give every rank the same CUDA_MPS_PIPE_DIRECTORY, or run \
             none of them under MPS"
            .to_string(),
        (Some(true), Some(true)) if mine.mps_pipe != theirs.mps_pipe => "the two use different CUDA_MPS_PIPE_DIRECTORY \
             values, so different MPS servers: give every rank sharing a GPU the same one"
            .to_string(),
        (Some(true), Some(true)) => "both joined the same MPS control daemon; its server log (server.log in \
             CUDA_MPS_LOG_DIRECTORY) tells whether its server restarted or failed a client at this time; or run \
             one GPU per rank"
            .to_string(),
        _ => format!(
            "ranks that share a GPU open each other's memory through CUDA IPC, which needs both processes on this host \
             with a shared IPC and PID namespace (containers: --ipc=host --pid=host); or run {one_gpu_per_rank}"
        ),
    };
    format!("{what} (both on GPU {}; {procs}); {fix}", mine.uuid_text())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(uuid: u8, mps: Option<bool>, pipe: &str, pid: u32) -> IpcEntry {
        IpcEntry {
            bytes: 1 << 30,
            ordinal: 0,
            uuid: if uuid == 0 { [0; 16] } else { [uuid; 16] },
            mps,
            mps_pipe: fnv1a(pipe.as_bytes()),
            pid,
            handle: std::array::from_fn(|i| i as u8 ^ 0x5a),
        }
    }

    #[test]
    fn an_entry_survives_its_encoding() {
        for mps in [Some(true), Some(false), None] {
            let e = IpcEntry { ordinal: 3, ..entry(7, mps, "/tmp/mps-2", 4242) };
            let m = e.encode();
            assert_eq!(m.len(), IpcEntry::LEN);
            assert_eq!(IpcEntry::decode(1, &m).unwrap(), e);
        }
    }

    #[test]
    fn a_record_of_another_size_names_the_rank_and_the_mixed_builds() {
        let mut m = entry(7, Some(true), DEFAULT_MPS_PIPE, 1).encode();
        m.truncate(80); // the record of builds before the MPS fields
        let e = IpcEntry::decode(3, &m).unwrap_err().to_string();
        assert!(e.contains("rank 3 sent a 80-byte record where 109 bytes"), "{e}");
        assert!(e.contains("same build on every rank"), "{e}");
    }

    #[test]
    fn the_uuid_reads_as_nvidia_smi_prints_it() {
        let mut e = entry(0, None, DEFAULT_MPS_PIPE, 1);
        e.uuid = std::array::from_fn(|i| (i as u8) * 17);
        assert_eq!(e.uuid_text(), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

    #[test]
    fn the_failure_names_the_case_and_its_fix() {
        let both = |a: &IpcEntry, b: &IpcEntry| open_failure_context(1, a, 0, b);
        // two GPUs: peer access is the question, as before
        let s = both(&entry(1, Some(false), DEFAULT_MPS_PIPE, 11), &entry(2, Some(false), DEFAULT_MPS_PIPE, 10));
        assert!(s.starts_with("rank 1: opening rank 0's IPC buffer (its GPU GPU-02020202-"), "{s}");
        assert!(s.contains("peer access between the two GPUs"), "{s}");
        // one GPU, only one process under MPS
        let s = both(&entry(1, Some(true), DEFAULT_MPS_PIPE, 11), &entry(1, Some(false), DEFAULT_MPS_PIPE, 10));
        assert!(s.contains("both on GPU GPU-01010101-"), "{s}");
        assert!(s.contains("this process (pid 11) is an MPS client, rank 0's (pid 10) is not an MPS client"), "{s}");
        assert!(s.contains("only one of the two joined MPS"), "{s}");
        assert!(!s.contains("peer access between the two GPUs"), "{s}");
        // one GPU, both under MPS but through different pipe folders
        let s = both(&entry(1, Some(true), "/tmp/a", 11), &entry(1, Some(true), "/tmp/b", 10));
        assert!(s.contains("different CUDA_MPS_PIPE_DIRECTORY values"), "{s}");
        // one GPU, both clients of the same daemon: the server log is the next place to look
        let s = both(&entry(1, Some(true), "/tmp/a", 11), &entry(1, Some(true), "/tmp/a", 10));
        assert!(s.contains("server.log in CUDA_MPS_LOG_DIRECTORY"), "{s}");
        // one GPU without MPS
        let s = both(&entry(1, Some(false), DEFAULT_MPS_PIPE, 11), &entry(1, Some(false), DEFAULT_MPS_PIPE, 10));
        assert!(s.contains("shared IPC and PID namespace"), "{s}");
        // UUIDs unknown: ordinals and the general advice
        let s = both(&entry(0, None, DEFAULT_MPS_PIPE, 11), &entry(1, None, DEFAULT_MPS_PIPE, 10));
        assert!(s.contains("its GPU ordinal 0, ours 0"), "{s}");
        assert!(s.contains("of unknown MPS state"), "{s}");
        assert!(s.contains("one GPU per rank"), "{s}");
    }
}
