//! Raw access to the local NVLink buffer for bindings (DeepEP's `get_local_buffer_tensor`).

use super::Buffer;

impl Buffer<'_> {
    /// Device address and size in bytes of this rank's own NVLink buffer (the memory its peers
    /// map). Writing into it while a dispatch or combine runs corrupts that call.
    pub fn local_buffer(&self) -> (u64, usize) {
        // Not the receive arena: its regions belong to live dispatch outputs.
        (self.ipc.local().ptr(), self.ipc.bytes().min(self.layout.off_arena))
    }
}
