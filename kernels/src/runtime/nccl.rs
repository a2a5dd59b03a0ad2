//! NCCL baseline: a communicator bootstrapped through [`Comm`] and an all-to-all with per-peer
//! byte counts made of grouped `ncclSend`/`ncclRecv` (what `torch.distributed.all_to_all_single`
//! does). `libnccl.so` is loaded at run time; the `nvidia-nccl-cu13` wheel ships only
//! `libnccl.so.2`, so a `libnccl.so -> libnccl.so.2` symlink must be on `LD_LIBRARY_PATH`
//! (`kernels/scripts/gpu-sweep.sh` creates one).

use super::{Comm, Gpu};
use crate::error::{EpError, Result};
use cudarc::nccl::{result, sys};

/// One NCCL communicator over all ranks of a [`Comm`], on the rank's [`Gpu`].
pub struct Nccl {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
}

// SAFETY: NCCL communicators may be used from any thread (one at a time; we take &self only for
// operations enqueued under the caller's exclusive use).
unsafe impl Send for Nccl {}

fn err(context: &str, e: result::NcclError) -> EpError {
    // SAFETY: ncclGetErrorString returns a static string.
    let msg = unsafe {
        let p = sys::ncclGetErrorString(e.0);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    EpError::Nccl { context: context.to_string(), message: format!("{:?}: {msg}", e.0) }
}

/// Whether `libnccl.so` can be loaded.
pub fn nccl_available() -> bool {
    // SAFETY: only dlopen()s the library.
    unsafe { sys::is_culib_present() }
}

impl Nccl {
    /// Collective: rank 0 creates the unique id, [`Comm::broadcast`] ships it, every rank joins.
    pub fn new(gpu: &Gpu, comm: &Comm) -> Result<Nccl> {
        if !nccl_available() {
            return Err(EpError::Nccl {
                context: "loading NCCL".into(),
                message: "libnccl.so not found on the loader path; install nvidia-nccl-cu13 and put a libnccl.so -> libnccl.so.2 \
                          symlink on LD_LIBRARY_PATH (kernels/scripts/gpu-sweep.sh does this)"
                    .into(),
            });
        }
        gpu.bind()?;
        let id = if comm.rank() == 0 {
            let id = result::get_uniqueid().map_err(|e| err("ncclGetUniqueId", e))?;
            id.internal.iter().map(|&c| c as u8).collect::<Vec<u8>>()
        } else {
            vec![0u8; 128]
        };
        let id = comm.broadcast(0, &id)?;
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(&id) {
            *d = *s as _;
        }
        let mut c = std::ptr::null_mut();
        // SAFETY: valid out-pointer and id.
        unsafe { result::comm_init_rank(&mut c, comm.world() as i32, uid, comm.rank() as i32) }
            .map_err(|e| err(&format!("ncclCommInitRank (rank {} of {})", comm.rank(), comm.world()), e))?;
        Ok(Nccl { comm: c, rank: comm.rank(), world: comm.world() })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// Enqueue on `gpu`'s stream: send `send_bytes[p]` bytes starting at `send + send_off[p]` to
    /// every rank `p` (self included) and receive `recv_bytes[p]` bytes at `recv + recv_off[p]`,
    /// where the offsets are the exclusive prefix sums of the counts (packed per peer).
    pub fn all_to_all_bytes(&self, gpu: &Gpu, send: u64, send_bytes: &[usize], recv: u64, recv_bytes: &[usize]) -> Result<()> {
        if send_bytes.len() != self.world || recv_bytes.len() != self.world {
            return Err(EpError::InvalidArgument(format!(
                "NCCL all-to-all needs {} per-peer counts, got {} send / {} recv",
                self.world,
                send_bytes.len(),
                recv_bytes.len()
            )));
        }
        gpu.bind()?;
        let stream = gpu.cu_stream() as sys::cudaStream_t;
        result::group_start().map_err(|e| err("ncclGroupStart", e))?;
        let (mut so, mut ro) = (0u64, 0u64);
        let mut first_err = None;
        for p in 0..self.world {
            // SAFETY: the caller's buffers cover the packed ranges.
            unsafe {
                if send_bytes[p] > 0 {
                    if let Err(e) = result::send((send + so) as *const _, send_bytes[p], sys::ncclDataType_t::ncclUint8, p as i32, self.comm, stream) {
                        first_err.get_or_insert(err(&format!("ncclSend to rank {p}"), e));
                    }
                }
                if recv_bytes[p] > 0 {
                    if let Err(e) = result::recv((recv + ro) as *mut _, recv_bytes[p], sys::ncclDataType_t::ncclUint8, p as i32, self.comm, stream) {
                        first_err.get_or_insert(err(&format!("ncclRecv from rank {p}"), e));
                    }
                }
            }
            so += send_bytes[p] as u64;
            ro += recv_bytes[p] as u64;
        }
        let end = result::group_end().map_err(|e| err("ncclGroupEnd", e));
        match first_err {
            Some(e) => Err(e),
            None => end.map(|_| ()),
        }
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: our communicator; destroy (not abort) after the caller synchronised.
        unsafe {
            let _ = result::comm_destroy(self.comm);
        }
    }
}
