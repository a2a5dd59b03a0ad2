//! Raw access to the low-latency symmetric buffer for bindings (DeepEP's
//! `get_local_buffer_tensor(use_rdma_buffer=True)`).

use super::LowLatencyBuffer;

impl LowLatencyBuffer<'_> {
    /// Device address and size in bytes of this rank's symmetric (NVSHMEM) buffer.
    pub fn local_buffer(&self) -> (u64, usize) {
        (self.shared.sym.ptr(), self.layout.total_bytes)
    }
}
