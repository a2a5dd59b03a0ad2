//! NVSHMEM: host binding ([`binding`]), runtime knobs ([`knobs`]) and the process runtime
//! ([`runtime`], [`finalize`], [`NvshmemRuntime`]). The kernel families that run on it are peers
//! of this module: [`crate::low_latency`] and [`crate::internode`].
//!
//! Start-up goes through [`runtime`]: it applies the knobs, loads the host library (refusing a
//! version other than the one the cubins were linked with), initializes NVSHMEM once per process
//! (unique id through our rendezvous, or NVSHMEM's PMI bootstrap under Slurm) and registers each
//! NVSHMEM cubin once. See `docs/nvshmem.md`.

pub mod binding;
pub mod knobs;

pub use binding::{Bootstrap, HostLib, Nvshmem, RegisteredModule, SymmetricBuffer, UidExchange, Version};

use crate::error::{EpError, Result};
use crate::runtime::{Comm, Gpu, Module};
use std::sync::{Arc, Mutex};

impl UidExchange for Comm {
    fn rank(&self) -> usize {
        Comm::rank(self)
    }
    fn world(&self) -> usize {
        Comm::world(self)
    }
    fn broadcast(&self, root: usize, bytes: &[u8]) -> Result<Vec<u8>> {
        Comm::broadcast(self, root, bytes)
    }
}

/// The process-wide NVSHMEM runtime: the initialized library plus the cubins registered with it.
/// Field order is the teardown order: module registrations finalize (and the modules may be
/// unloaded) before the last `Arc<Nvshmem>` runs `nvshmemx_hostlib_finalize`.
pub struct NvshmemRuntime {
    modules: Mutex<Vec<(&'static str, Arc<Module>, RegisteredModule)>>,
    nv: Arc<Nvshmem>,
}

impl std::fmt::Debug for NvshmemRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NvshmemRuntime({:?})", self.nv)
    }
}

static RUNTIME: Mutex<Option<Arc<NvshmemRuntime>>> = Mutex::new(None);
/// Why NVSHMEM cannot start again in this process ([`abandon`]); None while it can.
static ABANDONED: Mutex<Option<String>> = Mutex::new(None);

/// The NVSHMEM runtime of this process, initialized on first use (collective over all ranks of
/// `comm`; every rank must call it at the same point). `req` sets the knobs (first caller wins:
/// NVSHMEM reads them once at init). The GPU of `gpu` is made current first.
pub fn runtime(gpu: &Gpu, comm: &Comm, req: &knobs::KnobRequest) -> Result<Arc<NvshmemRuntime>> {
    let mut g = RUNTIME.lock().unwrap();
    if let Some(why) = ABANDONED.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        return Err(EpError::Nvshmem(format!(
            "NVSHMEM cannot start again in this process: {why}. NVSHMEM 3.x cannot leave a PE out: nvshmem_finalize begins \
             with a barrier over every PE and a second init reuses the first world, so the low-latency and internode modes \
             need new processes; a normal-mode Buffer (NVLink, CUDA IPC) of the surviving ranks works in this one"
        )));
    }
    if let Some(rt) = g.as_ref() {
        return Ok(rt.clone());
    }
    gpu.bind()?;
    let plan = knobs::apply(req)?;
    let lib = load_host_library()?;
    let nv = Nvshmem::init(lib, comm, plan.bootstrap)?;
    let rt = Arc::new(NvshmemRuntime { modules: Mutex::new(Vec::new()), nv });
    *g = Some(rt.clone());
    Ok(rt)
}

/// The releases this build has NVSHMEM cubins for, as [`Version`]s (an error when it has none).
pub fn served_releases() -> Result<Vec<Version>> {
    if crate::cubins::NVSHMEM_RELEASES.is_empty() {
        return Err(EpError::Unsupported(
            "this binary was built without NVSHMEM (NVSHMEM_DIR unset at build time), so it has no NVSHMEM kernels; \
             rebuild with NVSHMEM_DIR=<nvshmem prefix> (scripts/install-toolchain.sh prints it)"
                .into(),
        ));
    }
    Ok(crate::cubins::NVSHMEM_RELEASES.iter().copied().map(Version::from).collect())
}

/// The process's NVSHMEM host library ([`HostLib::load`]: the one already loaded, else
/// `$NVSHMEM_DIR/lib`, else the loader's path), checked against the releases this build serves,
/// and the cubins of its release selected for the process ([`crate::cubins::select_nvshmem_release`]).
/// No GPU needed.
pub fn load_host_library() -> Result<HostLib> {
    let lib = HostLib::load(&served_releases()?)?;
    let v = lib.version();
    crate::cubins::select_nvshmem_release((v.major, v.minor, v.patch))?;
    tracing::info!("NVSHMEM host library {} (release {v}; cubins for {})", lib.path().display(), crate::cubins::releases_text());
    Ok(lib)
}

/// Drop the process-wide handle so that NVSHMEM finalizes once every buffer is gone. Collective:
/// call it on every rank after dropping all NVSHMEM buffers (in the same order everywhere).
pub fn finalize() {
    let rt = RUNTIME.lock().unwrap().take();
    if let Some(rt) = rt {
        if Arc::strong_count(&rt) > 1 {
            tracing::warn!("nvshmem::finalize: NVSHMEM buffers are still alive; NVSHMEM finalizes when the last one drops");
        }
    }
}

/// Give NVSHMEM up in this process after a peer was lost (`why` says which and where): the
/// process-wide handle is leaked, not finalized (finalize starts with a barrier over every PE and
/// would wait for the lost one forever), and [`runtime`] refuses from now on with `why` and the fix.
/// The caller leaks its NVSHMEM buffers too (`std::mem::forget`): their drops are collective.
/// Local only: no other rank takes part.
pub fn abandon(why: &str) {
    let rt = RUNTIME.lock().unwrap_or_else(|e| e.into_inner()).take();
    std::mem::forget(rt);
    let mut a = ABANDONED.lock().unwrap_or_else(|e| e.into_inner());
    if a.is_none() {
        *a = Some(why.to_string());
    }
    tracing::warn!("NVSHMEM abandoned in this process (not finalized): {why}");
}

/// Why NVSHMEM was given up in this process ([`abandon`]), if it was.
pub fn abandoned() -> Option<String> {
    ABANDONED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

impl NvshmemRuntime {
    pub fn nv(&self) -> &Arc<Nvshmem> {
        &self.nv
    }

    /// The embedded NVSHMEM cubin `name`, loaded on `gpu` and registered with NVSHMEM (once).
    pub fn module(&self, gpu: &Gpu, name: &'static str) -> Result<Arc<Module>> {
        let mut m = self.modules.lock().unwrap();
        if let Some((_, module, _)) = m.iter().find(|(n, _, _)| *n == name) {
            return Ok(module.clone());
        }
        let module = gpu.module(name)?;
        if !module.cubin().nvshmem {
            return Err(EpError::InvalidArgument(format!("cubin '{name}' is not an NVSHMEM cubin; load it with Gpu::module")));
        }
        // SAFETY: a loaded module of the current context; its Arc is kept alive by the
        // registration until after nvshmemx_cumodule_finalize.
        let reg = unsafe { self.nv.register_module(module.raw() as *mut _, name, Box::new(module.clone()))? };
        m.push((name, module.clone(), reg));
        Ok(module)
    }
}
