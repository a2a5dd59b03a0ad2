//! Host runtime shared by every kernel family: one process per GPU.
//!
//! - [`comm::Comm`]: rendezvous and small host collectives over TCP (torchrun-compatible env),
//!   or over a caller's all-gather ([`exchange`], e.g. a Python binding's process group).
//! - [`launcher`]: `--nproc N` spawns N ranks of the current binary and reports any rank's failure.
//! - [`gpu::Gpu`]: context for `LOCAL_RANK`, a stream, embedded-cubin modules (raw `CUmodule`
//!   exposed for `nvshmemx_cumodule_init`), `cuLaunchKernelEx` launches with the diagnostic record
//!   appended, and `sync(what)` with a deadline that turns a stuck GPU into an [`EpError`].
//! - [`memory`]: [`memory::DeviceBuffer`], [`memory::HostMapped`], [`memory::IpcBuffer`].
//! - [`nccl`]: NCCL communicator bootstrapped through [`comm::Comm`], grouped send/recv all-to-all.
//! - [`timing`]: CUDA-event timing with warm-up, repetitions and L2 flush.
//!
//! GPU code paths load `libcuda` dynamically (cudarc `dynamic-loading`): call [`cuda_available`]
//! before touching the GPU; every entry point here returns an error instead of panicking when the
//! driver is missing.

pub mod comm;
pub mod cupti;
pub mod exchange;
pub mod gpu;
pub mod launcher;
pub mod memory;
pub mod nccl;
pub mod timing;

pub use comm::Comm;
pub use exchange::Exchange;
pub use gpu::{Args, Gpu, Kernel, LaunchCfg, Module};
pub use memory::{DeviceBuffer, HostMapped, IpcBuffer, Pod};

use crate::error::{EpError, Result};
use cudarc::driver::sys;

/// Whether `libcuda.so` can be loaded (false on machines without an NVIDIA driver).
pub fn cuda_available() -> bool {
    // SAFETY: only dlopen()s the driver library.
    unsafe { sys::is_culib_present() }
}

/// Fail with a clear error when the CUDA driver library cannot be loaded.
pub fn require_cuda() -> Result<()> {
    if cuda_available() {
        Ok(())
    } else {
        Err(EpError::Cuda {
            context: "loading the CUDA driver".into(),
            message: "libcuda.so / libcuda.so.1 not found: this needs an NVIDIA GPU with its driver installed \
                      (the loader path or LD_LIBRARY_PATH must contain libcuda.so.1)"
                .into(),
        })
    }
}

/// Turn a driver result into an [`EpError::Cuda`] naming `context` and the driver's message.
pub fn check(res: sys::CUresult, context: impl FnOnce() -> String) -> Result<()> {
    if res == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null).
    let msg = unsafe {
        if sys::cuGetErrorString(res, &mut s) == sys::CUresult::CUDA_SUCCESS && !s.is_null() {
            std::ffi::CStr::from_ptr(s).to_string_lossy().into_owned()
        } else {
            String::new()
        }
    };
    Err(EpError::Cuda { context: context(), message: format!("{res:?}: {msg}") })
}

/// Map a cudarc driver error.
pub(crate) fn drv(context: &str) -> impl FnOnce(cudarc::driver::DriverError) -> EpError + '_ {
    move |e| EpError::Cuda { context: context.to_string(), message: format!("{:?}", e.0) }
}

/// Read an env var as a number: `None` when unset or blank, an [`EpError::InvalidArgument`]
/// naming the variable and its value when it does not parse. Public for the harness's own
/// settings (`DEEPEP_CASE_TIMEOUT_S`), so they read the same way as the library's.
pub fn env_num<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<T>().map(Some).map_err(|_| {
            EpError::InvalidArgument(format!("environment variable {name}={v:?} is not a valid number; unset it or fix it"))
        }),
        _ => Ok(None),
    }
}
