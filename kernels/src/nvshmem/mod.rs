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
            "NVSHMEM cannot start again in this process: {why}. NVSHMEM 3.x cannot leave a PE out (nvshmem_finalize begins \
             with a barrier over every PE and a second init reuses the first world), so the internode mode needs new \
             processes; low-latency buffers of the surviving ranks (in the memory the lost Buffer used) and normal-mode \
             Buffers within one host (NVLink, CUDA IPC) work in this one"
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

/// NVSHMEM after a lost PE ([`abandon`]): the runtime is kept, never finalized, and serves only
/// low-latency buffers of the surviving ranks, in symmetric memory kept from before the loss.
struct Survivors {
    rt: Arc<NvshmemRuntime>,
    /// Symmetric allocations of dropped low-latency buffers (`nvshmem_free` is collective over
    /// every PE, the lost one included, so they are kept for reuse instead).
    spare: Vec<SymmetricBuffer>,
}

static SURVIVORS: Mutex<Option<Survivors>> = Mutex::new(None);

/// Give the full NVSHMEM world up in this process after a peer was lost (`why` says which and
/// where). Nothing is finalized (finalize starts with a barrier over every PE and would wait for
/// the lost one forever) and nothing collective runs again: [`runtime`] refuses from now on
/// (internode buffers need the whole world), while low-latency buffers of the surviving ranks
/// reuse the runtime and the symmetric memory of the buffers dropped since
/// ([`survivor_world`]). Local only: no other rank takes part.
pub fn abandon(why: &str) {
    let rt = RUNTIME.lock().unwrap_or_else(|e| e.into_inner()).take();
    {
        let mut a = ABANDONED.lock().unwrap_or_else(|e| e.into_inner());
        if a.is_none() {
            *a = Some(why.to_string());
        }
    }
    let mut s = SURVIVORS.lock().unwrap_or_else(|e| e.into_inner());
    if let (None, Some(rt)) = (s.as_ref(), rt) {
        *s = Some(Survivors { rt, spare: Vec::new() });
    }
    tracing::warn!("NVSHMEM world abandoned in this process (not finalized): {why}");
}

/// Why the full NVSHMEM world was given up in this process ([`abandon`]), if it was.
pub fn abandoned() -> Option<String> {
    ABANDONED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Keep `sym` for a later low-latency buffer of the surviving ranks (after [`abandon`]); freed
/// normally (collectively) when NVSHMEM was not abandoned.
pub(crate) fn release_symmetric(sym: SymmetricBuffer) {
    let mut s = SURVIVORS.lock().unwrap_or_else(|e| e.into_inner());
    match s.as_mut() {
        Some(w) => w.spare.push(sym),
        None if abandoned().is_some() => std::mem::forget(sym),
        None => drop(sym),
    }
}

/// The runtime and a kept symmetric allocation of at least `bytes` for a low-latency buffer of
/// the surviving ranks, or None when NVSHMEM was not abandoned in this process.
pub(crate) fn survivor_world(bytes: usize) -> Result<Option<(Arc<NvshmemRuntime>, SymmetricBuffer)>> {
    let mut s = SURVIVORS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(w) = s.as_mut() else {
        return match abandoned() {
            Some(why) => Err(EpError::Nvshmem(format!(
                "NVSHMEM cannot start again in this process: {why}, before NVSHMEM had started here; start new processes"
            ))),
            None => Ok(None),
        };
    };
    let kept: Vec<usize> = w.spare.iter().map(|b| b.len()).collect();
    let Some(i) = w.spare.iter().position(|b| b.len() >= bytes) else {
        let why = abandoned().unwrap_or_default();
        return Err(EpError::Nvshmem(format!(
            "a low-latency buffer of {bytes} bytes for the surviving ranks does not fit the symmetric memory kept from before \
             the loss ({why}; kept: {kept:?} bytes; NVSHMEM cannot allocate without the lost PE); use a num_max, hidden and \
             expert count whose buffer is no larger than the lost Buffer's, and drop every tensor of the lost Buffer's \
             low-latency calls first (they keep its memory)"
        )));
    };
    Ok(Some((w.rt.clone(), w.spare.swap_remove(i))))
}

/// Whether NVSHMEM serves only the surviving ranks of a lost world in this process ([`abandon`]).
pub fn survivors_only() -> bool {
    ABANDONED.lock().unwrap_or_else(|e| e.into_inner()).is_some()
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
