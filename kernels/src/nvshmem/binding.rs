//! Hand-written binding of NVSHMEM's host library (`libnvshmem_host.so.3`), loaded at run time.
//!
//! Why by hand and at run time: the NVSHMEM headers are C++-only and version specific, the
//! `nvshmem_init*` entry points are `static inline` wrappers around a host function that lives in
//! `libnvshmem_device.a` (not usable from Rust), and CI must build without NVSHMEM installed.
//! Loaded modules (our cubins) use the host-library entry `nvshmemx_hostlib_init_attr` followed
//! by `nvshmemx_cumodule_init`, exactly like nvshmem4py does.
//!
//! Lifecycle (see `docs/nvshmem.md`):
//! 1. make the rank's CUDA context current (`runtime::Gpu`),
//! 2. [`HostLib::load`] — takes the library already in the process (torch's), else finds one
//!    (`$NVSHMEM_DIR/lib` first, then the loader path), and refuses a release the build has no
//!    cubins for (`crate::cubins::NVSHMEM_RELEASES`),
//! 3. [`Nvshmem::init`] — unique-id bootstrap through our rendezvous (default), or NVSHMEM's own
//!    PMI / PMI-2 / PMIx bootstrap under Slurm ([`Bootstrap`]),
//! 4. [`Nvshmem::register_module`] on every NVSHMEM cubin, [`Nvshmem::alloc`] (collective),
//! 5. teardown in the order NVSHMEM requires: symmetric frees, module finalize, module unload,
//!    `nvshmemx_hostlib_finalize` — enforced by ownership: every [`SymmetricBuffer`] and
//!    [`RegisteredModule`] holds an `Arc<Nvshmem>`, and finalize runs when the last one drops.

use std::ffi::{c_int, c_uint, c_void, OsStr};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::{EpError, Result};
use crate::hash::fnv1a;

/// SONAME of the host library.
pub const HOST_LIB_NAME: &str = "libnvshmem_host.so.3";

/// `NVSHMEMX_INIT_WITH_UNIQUEID` (`1 << 3`) from `host/nvshmemx_api.h`.
pub const INIT_WITH_UNIQUEID: c_uint = 1 << 3;
/// `NVSHMEM_STATUS_IS_INITIALIZED` from `nvshmem_constants.h` (statuses are ordered).
pub const STATUS_IS_INITIALIZED: c_int = 2;
/// `NVSHMEM_TEAM_WORLD` (team handle 0).
pub const TEAM_WORLD: i32 = 0;

// ---- FFI structs (v1 layouts, valid for NVSHMEM 3.3.9 .. 3.8.0) --------------------------

/// Version word of a v1 struct: `(1 << 16) + sizeof(struct)`.
const fn v1_version(size: usize) -> i32 {
    (1 << 16) + size as i32
}

/// `nvshmemx_uniqueid_v1`: 128 opaque bytes (rank 0's bootstrap address inside).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub version: i32,
    pub internal: [u8; 124],
}

/// `nvshmemx_uniqueid_args_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueIdArgs {
    pub version: i32,
    pub id: *mut UniqueId,
    pub myrank: i32,
    pub nranks: i32,
}

/// `nvshmemx_init_args_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct InitArgs {
    pub version: i32,
    pub uid_args: UniqueIdArgs,
    pub content: [u8; 96],
}

/// `nvshmemx_init_attr_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct InitAttr {
    pub version: i32,
    pub mpi_comm: *mut c_void,
    pub args: InitArgs,
}

const _: () = {
    assert!(std::mem::size_of::<UniqueId>() == 128);
    assert!(std::mem::size_of::<UniqueIdArgs>() == 24);
    assert!(std::mem::offset_of!(UniqueIdArgs, id) == 8);
    assert!(std::mem::offset_of!(UniqueIdArgs, myrank) == 16);
    assert!(std::mem::offset_of!(UniqueIdArgs, nranks) == 20);
    assert!(std::mem::size_of::<InitArgs>() == 128);
    assert!(std::mem::offset_of!(InitArgs, uid_args) == 8);
    assert!(std::mem::offset_of!(InitArgs, content) == 32);
    assert!(std::mem::size_of::<InitAttr>() == 144);
    assert!(std::mem::offset_of!(InitAttr, mpi_comm) == 8);
    assert!(std::mem::offset_of!(InitAttr, args) == 16);
};

impl UniqueId {
    /// `NVSHMEMX_UNIQUEID_INITIALIZER`.
    pub fn new() -> Self {
        UniqueId { version: v1_version(std::mem::size_of::<UniqueId>()), internal: [0; 124] }
    }
    /// The 128 bytes exactly as the library wrote them (what rank 0 broadcasts).
    pub fn to_bytes(&self) -> [u8; 128] {
        let mut out = [0u8; 128];
        out[..4].copy_from_slice(&self.version.to_ne_bytes());
        out[4..].copy_from_slice(&self.internal);
        out
    }
    /// Rebuild from the broadcast bytes; anything but 128 bytes is a rendezvous bug.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != 128 {
            return Err(EpError::Nvshmem(format!(
                "unique id from rank 0 has {} bytes, expected 128; all ranks must run the same deepep-kernels binary",
                bytes.len()
            )));
        }
        let mut internal = [0u8; 124];
        internal.copy_from_slice(&bytes[4..]);
        Ok(UniqueId { version: i32::from_ne_bytes(bytes[..4].try_into().unwrap()), internal })
    }
}

impl Default for UniqueId {
    fn default() -> Self {
        Self::new()
    }
}

impl InitAttr {
    /// `NVSHMEMX_INIT_ATTR_INITIALIZER`: versions set, no MPI communicator, uid args invalid.
    pub fn new() -> Self {
        InitAttr {
            version: v1_version(std::mem::size_of::<InitAttr>()),
            mpi_comm: std::ptr::null_mut(),
            args: InitArgs {
                version: v1_version(std::mem::size_of::<InitArgs>()),
                uid_args: UniqueIdArgs {
                    version: v1_version(std::mem::size_of::<UniqueIdArgs>()),
                    id: std::ptr::null_mut(),
                    myrank: -1,
                    nranks: -1,
                },
                content: [0; 96],
            },
        }
    }
}

impl Default for InitAttr {
    fn default() -> Self {
        Self::new()
    }
}

// ---- version -------------------------------------------------------------------------------

/// An NVSHMEM release version (`major.minor.patch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl Version {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Version { major, minor, patch }
    }
}

impl From<(u32, u32, u32)> for Version {
    fn from(v: (u32, u32, u32)) -> Self {
        Version::new(v.0, v.1, v.2)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The host library must be exactly the release whose `libnvshmem_device.a` was linked into the
/// cubins: NVSHMEM itself only rejects a different major or a newer device minor, but the host
/// copies its own device-state struct into the module, so any other version can corrupt it
/// silently (776 B in 3.4.x, 848 B in 3.8.x).
pub fn check_version(host: Version, host_path: &Path, device: Option<Version>) -> Result<()> {
    match device {
        Some(dev) => check_served(host, host_path, &[dev]),
        None => Ok(()),
    }
}

/// [`check_version`] for a build with NVSHMEM cubins for several releases (`served`, ascending;
/// empty skips the check): the host library must be one of them.
pub fn check_served(host: Version, host_path: &Path, served: &[Version]) -> Result<()> {
    served_mismatch(host, host_path, served, false)
}

fn served_mismatch(host: Version, host_path: &Path, served: &[Version], preloaded: bool) -> Result<()> {
    if served.is_empty() || served.contains(&host) {
        return Ok(());
    }
    let list = served.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ");
    let (what, dev) = if served.len() == 1 {
        (format!("the cubins were linked against the NVSHMEM {} device library", served[0]), format!("NVSHMEM {}", served[0]))
    } else {
        (format!("this build has NVSHMEM cubins for {list} only"), format!("one of the NVSHMEM releases {list}"))
    };
    let origin = if preloaded {
        " It was already loaded in the process (by torch or another extension) before deepep_kernels asked for \
         it, so it is the one NVSHMEM the process can use."
    } else {
        ""
    };
    Err(EpError::Nvshmem(format!(
        "version mismatch: the NVSHMEM host library {} is version {host}, but {what}; the two must be the same \
         release.{origin} Fix: point NVSHMEM_DIR (or LD_LIBRARY_PATH) at the lib/ directory of {dev} (and make \
         sure nothing loads another libnvshmem_host.so.3 into the process first, e.g. torch's \
         nvidia-nvshmem-cu13 wheel), or rebuild deepep-kernels for NVSHMEM {host} (NVSHMEM_DIR or \
         DEEPEP_NVSHMEM_RELEASES naming the NVSHMEM {host} installation)",
        host_path.display()
    )))
}

/// The path of a `libnvshmem_host.so.3` mapped into this process, from `/proc/self/maps`.
pub fn mapped_host_library() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| Path::new(p).file_name().is_some_and(|n| n == HOST_LIB_NAME))
        .map(PathBuf::from)
}

// ---- library loading -------------------------------------------------------------------------

type FnGetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type FnSetAttrUid = unsafe extern "C" fn(c_int, c_int, *const UniqueId, *mut InitAttr) -> c_int;
type FnHostlibInitAttr = unsafe extern "C" fn(c_uint, *mut InitAttr) -> c_int;
type FnVoid = unsafe extern "C" fn();
type FnInt = unsafe extern "C" fn() -> c_int;
type FnModule = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnAlign = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type FnFree = unsafe extern "C" fn(*mut c_void);
type FnPtr = unsafe extern "C" fn(*const c_void, c_int) -> *mut c_void;
type FnOnStream = unsafe extern "C" fn(*mut c_void);
type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int);
type FnTeamInt = unsafe extern "C" fn(i32) -> c_int;

/// Every host symbol the crate uses; all are exported `@@NVSHMEM` by 3.3.9 .. 3.8.0.
pub const SYMBOLS: &[&str] = &[
    "nvshmemx_get_uniqueid",
    "nvshmemx_set_attr_uniqueid_args",
    "nvshmemx_hostlib_init_attr",
    "nvshmemx_hostlib_finalize",
    "nvshmemx_init_status",
    "nvshmemx_cumodule_init",
    "nvshmemx_cumodule_finalize",
    "nvshmemx_culibrary_init",
    "nvshmem_my_pe",
    "nvshmem_n_pes",
    "nvshmem_align",
    "nvshmem_free",
    "nvshmem_ptr",
    "nvshmem_barrier_all",
    "nvshmemx_barrier_all_on_stream",
    "nvshmem_quiet",
    "nvshmemx_vendor_get_version_info",
    "nvshmem_team_my_pe",
    "nvshmem_team_n_pes",
];

/// Resolved entry points. Plain function pointers: valid as long as the owning
/// [`libloading::Library`] in [`HostLib`] is alive (it is never unloaded before them).
#[derive(Clone, Copy)]
struct Api {
    get_uniqueid: FnGetUniqueId,
    set_attr_uniqueid_args: FnSetAttrUid,
    hostlib_init_attr: FnHostlibInitAttr,
    hostlib_finalize: FnVoid,
    init_status: FnInt,
    cumodule_init: FnModule,
    cumodule_finalize: FnModule,
    culibrary_init: FnModule,
    my_pe: FnInt,
    n_pes: FnInt,
    align: FnAlign,
    free: FnFree,
    ptr: FnPtr,
    barrier_all: FnVoid,
    barrier_all_on_stream: FnOnStream,
    quiet: FnVoid,
    vendor_get_version_info: FnVersion,
    team_my_pe: FnTeamInt,
    team_n_pes: FnTeamInt,
}

/// The loaded `libnvshmem_host.so.3`.
pub struct HostLib {
    api: Api,
    path: PathBuf,
    version: Version,
    // Last field: dropped after everything that could call into it.
    _lib: libloading::Library,
}

impl fmt::Debug for HostLib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostLib").field("path", &self.path).field("version", &self.version).finish()
    }
}

/// Where to look for the host library, in order: `$NVSHMEM_DIR/lib/libnvshmem_host.so.3` when
/// `NVSHMEM_DIR` is set, then the bare SONAME (the dynamic loader's search path:
/// `LD_LIBRARY_PATH`, RUNPATH, system directories).
pub fn candidates(nvshmem_dir: Option<&OsStr>) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(dir) = nvshmem_dir.filter(|d| !d.is_empty()) {
        v.push(Path::new(dir).join("lib").join(HOST_LIB_NAME));
    }
    v.push(PathBuf::from(HOST_LIB_NAME));
    v
}

/// `Dl_info` of glibc's `<dlfcn.h>`.
#[repr(C)]
struct DlInfo {
    dli_fname: *const std::ffi::c_char,
    dli_fbase: *mut c_void,
    dli_sname: *const std::ffi::c_char,
    dli_saddr: *mut c_void,
}

extern "C" {
    fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
}

/// The path of the loaded object that holds `addr` (`dladdr`), if the loader knows it.
fn file_of(addr: *const c_void) -> Option<PathBuf> {
    let mut info = DlInfo { dli_fname: std::ptr::null(), dli_fbase: std::ptr::null_mut(), dli_sname: std::ptr::null(), dli_saddr: std::ptr::null_mut() };
    // SAFETY: dladdr only reads the loader's tables and fills `info`; dli_fname points into them.
    if unsafe { dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    let p = PathBuf::from(OsStr::from_bytes(name.to_bytes()));
    (p.components().count() > 1).then_some(p)
}

/// `RTLD_NOLOAD` of glibc (`<dlfcn.h>`, the same value on x86_64 and aarch64): only return a
/// library that is already loaded.
const RTLD_NOLOAD: c_int = 0x0004;

impl HostLib {
    /// The host library for this process, checked against the releases the cubins serve
    /// (`served`, e.g. `crate::cubins::NVSHMEM_RELEASES`; empty skips the check, used only by
    /// the symbol-resolution tests). One NVSHMEM per process: a `libnvshmem_host.so.3` already
    /// loaded (by torch, or any library that needs it by SONAME) is the one every later
    /// `dlopen` of the SONAME gets, so it is used as is; loading another copy by path would give
    /// the process two NVSHMEMs with state of their own. Otherwise the default [`candidates`].
    pub fn load(served: &[Version]) -> Result<HostLib> {
        if let Some(lib) = Self::already_loaded()? {
            served_mismatch(lib.version, &lib.path, served, true)?;
            return Ok(lib);
        }
        let dir = std::env::var_os("NVSHMEM_DIR");
        Self::load_from(&candidates(dir.as_deref()), served)
    }

    /// The `libnvshmem_host.so.3` already loaded in this process, if any (`dlopen` of the SONAME
    /// with `RTLD_NOLOAD`: the loader matches the SONAME of loaded objects, whatever path they
    /// came from). Its path comes from `/proc/self/maps`.
    pub fn already_loaded() -> Result<Option<HostLib>> {
        let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL | RTLD_NOLOAD;
        // SAFETY: RTLD_NOLOAD loads nothing new; it returns another reference to a library that
        // is already loaded and initialized.
        match unsafe { libloading::os::unix::Library::open(Some(HOST_LIB_NAME), flags) } {
            Ok(lib) => {
                let mut host = Self::from_library(lib.into(), PathBuf::from(HOST_LIB_NAME))?;
                // The file the handle's code lives in (two copies may be mapped; /proc/self/maps
                // alone cannot say which one the SONAME gives).
                host.path = file_of(host.api.vendor_get_version_info as *const c_void)
                    .or_else(mapped_host_library)
                    .unwrap_or_else(|| PathBuf::from(HOST_LIB_NAME));
                Ok(Some(host))
            }
            Err(_) => Ok(None),
        }
    }

    /// Try each candidate in order; the first that loads is used (later ones are not tried,
    /// so a wrong library found first is reported, never silently skipped).
    pub fn load_from(cands: &[PathBuf], served: &[Version]) -> Result<HostLib> {
        let mut tried = Vec::new();
        for cand in cands {
            // A path with a directory that does not exist is a plain miss; try the next one.
            if cand.components().count() > 1 && !cand.exists() {
                tried.push(format!("{}: no such file", cand.display()));
                continue;
            }
            // SAFETY: loading NVSHMEM runs its (trusted) ELF constructors; RTLD_GLOBAL so that
            // its bootstrap/transport plugins resolve back into it, RTLD_NOW to fail here rather
            // than at a later call.
            let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
            match unsafe { libloading::os::unix::Library::open(Some(cand.as_os_str()), flags) } {
                Ok(lib) => {
                    let lib: libloading::Library = lib.into();
                    let host = Self::from_library(lib, cand.clone())?;
                    check_served(host.version, &host.path, served)?;
                    return Ok(host);
                }
                Err(e) => tried.push(format!("{}: {e}", cand.display())),
            }
        }
        Err(EpError::Nvshmem(format!(
            "cannot load the NVSHMEM host library {HOST_LIB_NAME} (tried: {}). Fix: set NVSHMEM_DIR to \
             the NVSHMEM installation (the directory with lib/{HOST_LIB_NAME} and its \
             nvshmem_bootstrap_*/nvshmem_transport_* plugins), or put that lib/ directory on \
             LD_LIBRARY_PATH (pip wheel: python3 -c 'import nvidia.nvshmem as m, os; \
             print(os.path.join(list(m.__path__)[0], \"lib\"))')",
            tried.join("; ")
        )))
    }

    fn from_library(lib: libloading::Library, path: PathBuf) -> Result<HostLib> {
        fn sym<T: Copy>(lib: &libloading::Library, path: &Path, name: &str) -> Result<T> {
            // SAFETY: the type T is the C signature from NVSHMEM's headers for `name`.
            unsafe {
                lib.get::<T>(name.as_bytes()).map(|s| *s).map_err(|e| {
                    EpError::Nvshmem(format!(
                        "{} lacks symbol {name} ({e}); it is not a usable NVSHMEM >= 3.3.9 host library. \
                         Fix: point NVSHMEM_DIR at a complete NVSHMEM installation of the version the \
                         cubins were built with",
                        path.display()
                    ))
                })
            }
        }
        let p = path.as_path();
        let api = Api {
            get_uniqueid: sym(&lib, p, "nvshmemx_get_uniqueid")?,
            set_attr_uniqueid_args: sym(&lib, p, "nvshmemx_set_attr_uniqueid_args")?,
            hostlib_init_attr: sym(&lib, p, "nvshmemx_hostlib_init_attr")?,
            hostlib_finalize: sym(&lib, p, "nvshmemx_hostlib_finalize")?,
            init_status: sym(&lib, p, "nvshmemx_init_status")?,
            cumodule_init: sym(&lib, p, "nvshmemx_cumodule_init")?,
            cumodule_finalize: sym(&lib, p, "nvshmemx_cumodule_finalize")?,
            culibrary_init: sym(&lib, p, "nvshmemx_culibrary_init")?,
            my_pe: sym(&lib, p, "nvshmem_my_pe")?,
            n_pes: sym(&lib, p, "nvshmem_n_pes")?,
            align: sym(&lib, p, "nvshmem_align")?,
            free: sym(&lib, p, "nvshmem_free")?,
            ptr: sym(&lib, p, "nvshmem_ptr")?,
            barrier_all: sym(&lib, p, "nvshmem_barrier_all")?,
            barrier_all_on_stream: sym(&lib, p, "nvshmemx_barrier_all_on_stream")?,
            quiet: sym(&lib, p, "nvshmem_quiet")?,
            vendor_get_version_info: sym(&lib, p, "nvshmemx_vendor_get_version_info")?,
            team_my_pe: sym(&lib, p, "nvshmem_team_my_pe")?,
            team_n_pes: sym(&lib, p, "nvshmem_team_n_pes")?,
        };
        let (mut ma, mut mi, mut pa) = (0, 0, 0);
        // SAFETY: writes three ints; callable before init.
        unsafe { (api.vendor_get_version_info)(&mut ma, &mut mi, &mut pa) };
        let version = Version::new(ma as u32, mi as u32, pa as u32);
        Ok(HostLib { api, path, version, _lib: lib })
    }

    /// Path the library was loaded from (a bare SONAME when found through the loader path).
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// `nvshmemx_vendor_get_version_info`.
    pub fn version(&self) -> Version {
        self.version
    }
    /// `nvshmemx_init_status` (0 = not initialized, 2 = initialized).
    pub fn init_status(&self) -> i32 {
        // SAFETY: no preconditions.
        unsafe { (self.api.init_status)() }
    }
}

// ---- bootstrap -------------------------------------------------------------------------------

/// How the PEs find each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bootstrap {
    /// Rank 0 creates a unique id, our rendezvous (torchrun-style `MASTER_ADDR`/`MASTER_PORT`,
    /// or the project's launcher) broadcasts it. The default; needs no MPI and no PMI.
    UniqueId,
    /// NVSHMEM's own PMI bootstrap (`NVSHMEM_BOOTSTRAP=PMI`, flavour in
    /// `NVSHMEM_BOOTSTRAP_PMI`), e.g. under Slurm `srun --mpi=pmi2` / `--mpi=pmix`.
    Pmi(PmiFlavor),
}

/// Which PMI wire-up NVSHMEM's PMI bootstrap plugin uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PmiFlavor {
    /// `nvshmem_bootstrap_pmi.so.3` (PMI-1, e.g. Hydra).
    Pmi1,
    /// `nvshmem_bootstrap_pmi2.so.3` (Slurm `--mpi=pmi2`).
    Pmi2,
    /// `nvshmem_bootstrap_pmix.so.3` (Slurm `--mpi=pmix`, OpenMPI's prterun); needs `libpmix.so.2`.
    Pmix,
}

impl Bootstrap {
    /// The NVSHMEM plugin this bootstrap loads (from the host library's directory, then the
    /// loader path).
    pub fn plugin(self) -> &'static str {
        match self {
            Bootstrap::UniqueId => "nvshmem_bootstrap_uid.so.3",
            Bootstrap::Pmi(PmiFlavor::Pmi1) => "nvshmem_bootstrap_pmi.so.3",
            Bootstrap::Pmi(PmiFlavor::Pmi2) => "nvshmem_bootstrap_pmi2.so.3",
            Bootstrap::Pmi(PmiFlavor::Pmix) => "nvshmem_bootstrap_pmix.so.3",
        }
    }
}

/// Check that NVSHMEM will be able to load its bootstrap `plugin`: next to `host_lib` (its RPATH
/// is `$ORIGIN`), or anywhere the dynamic loader finds it. NVSHMEM 3.4.5 does not return an
/// error when the plugin is missing: `nvshmemx_get_uniqueid` prints "Bootstrap unable to load"
/// and then aborts the process (double free), so this runs first.
pub fn check_bootstrap_plugin(host_lib: &Path, plugin: &str) -> Result<()> {
    if host_lib.parent().is_some_and(|d| d.join(plugin).is_file()) {
        return Ok(());
    }
    // SAFETY: loads NVSHMEM's plugin by name (no initializer with effects beyond its own
    // symbols); unloaded again at once.
    match unsafe { libloading::Library::new(plugin) } {
        Ok(_) => Ok(()),
        Err(e) => Err(EpError::Nvshmem(format!(
            "NVSHMEM's bootstrap plugin {plugin} is neither next to {} nor on the loader path ({e}); NVSHMEM would \
             abort the process while starting. Fix: keep the nvshmem_bootstrap_*.so.3 and nvshmem_transport_*.so.3 \
             plugins in the same lib/ directory as libnvshmem_host.so.3 (as the pip wheel and the Nix package ship \
             them), or put their directory on LD_LIBRARY_PATH",
            host_lib.display()
        ))),
    }
}

impl PmiFlavor {
    /// The value NVSHMEM expects in `NVSHMEM_BOOTSTRAP_PMI`.
    pub fn nvshmem_name(self) -> &'static str {
        match self {
            PmiFlavor::Pmi1 => "PMI",
            PmiFlavor::Pmi2 => "PMI-2",
            PmiFlavor::Pmix => "PMIX",
        }
    }
}

/// What [`Nvshmem::init`] needs from the rendezvous (implemented by `runtime::Comm`).
pub trait UidExchange {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Everyone receives `root`'s bytes (other ranks' `bytes` are ignored).
    fn broadcast(&self, root: usize, bytes: &[u8]) -> Result<Vec<u8>>;
}

// ---- the initialized runtime ---------------------------------------------------------------

/// Only one NVSHMEM runtime per process (NVSHMEM state is process-global).
static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// An initialized NVSHMEM runtime. Share it as `Arc<Nvshmem>`; `nvshmemx_hostlib_finalize`
/// runs when the last holder (buffers, registered modules) is dropped.
#[derive(Debug)]
pub struct Nvshmem {
    lib: HostLib,
    my_pe: usize,
    n_pes: usize,
    bootstrap: Bootstrap,
}

impl Nvshmem {
    /// Initialize NVSHMEM on this process. The rank's CUDA context must already be current on
    /// the calling thread (NVSHMEM binds to the current device). Collective over all ranks.
    ///
    /// With [`Bootstrap::UniqueId`] the rank and world size come from `rdv`; with
    /// [`Bootstrap::Pmi`] NVSHMEM gets them from PMI and they are checked against `rdv`.
    /// The bootstrap environment (`NVSHMEM_BOOTSTRAP*`) must already be set up, see
    /// `knobs::apply`.
    pub fn init(lib: HostLib, rdv: &dyn UidExchange, bootstrap: Bootstrap) -> Result<Arc<Nvshmem>> {
        if INITIALIZED.swap(true, Ordering::SeqCst) {
            return Err(EpError::Nvshmem(
                "NVSHMEM is already initialized in this process; create one Nvshmem and share the Arc".into(),
            ));
        }
        let r = Self::init_inner(lib, rdv, bootstrap);
        if r.is_err() {
            INITIALIZED.store(false, Ordering::SeqCst);
        }
        r
    }

    fn init_inner(lib: HostLib, rdv: &dyn UidExchange, bootstrap: Bootstrap) -> Result<Arc<Nvshmem>> {
        let (rank, world) = (rdv.rank(), rdv.world());
        let api = lib.api;
        let plugin = check_bootstrap_plugin(&lib.path, bootstrap.plugin()).map_err(|e| match e {
            EpError::Nvshmem(m) => EpError::Nvshmem(format!("rank {rank}: {m}")),
            other => other,
        });
        if bootstrap == Bootstrap::UniqueId && plugin.is_err() {
            // Take part in the unique-id broadcast below (rank 0 sends nothing, so the other ranks
            // stop with "rank 0 could not create the NVSHMEM unique id"). Ranks normally share one
            // installation and fail alike; a lone rank without the plugin leaves the others to
            // NVSHMEM's own bootstrap timeout.
            let _ = rdv.broadcast(0, &[]);
        }
        plugin?;
        match bootstrap {
            Bootstrap::UniqueId => {
                let mut uid = Box::new(UniqueId::new());
                if rank == 0 {
                    // SAFETY: writes 128 bytes into `uid`.
                    let rc = unsafe { (api.get_uniqueid)(&mut *uid) };
                    if rc != 0 {
                        let _ = rdv.broadcast(0, &[]);
                        return Err(EpError::Nvshmem(format!(
                            "rank 0: nvshmemx_get_uniqueid failed with {rc}; usually the UID bootstrap plugin \
                             nvshmem_bootstrap_uid.so.3 is missing next to {} or no usable network interface was \
                             found. Fix: keep the plugins in the same lib/ directory, set \
                             NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME (e.g. lo for one host), rerun with NVSHMEM_DEBUG=INFO",
                            lib.path.display()
                        )));
                    }
                }
                let bytes = rdv.broadcast(0, &uid.to_bytes())?;
                if bytes.is_empty() {
                    return Err(EpError::Nvshmem(format!(
                        "rank {rank}: rank 0 could not create the NVSHMEM unique id (see rank 0's error)"
                    )));
                }
                *uid = UniqueId::from_bytes(&bytes)?;
                tracing::debug!(rank, world, uid_hash = format!("{:016x}", fnv1a(&bytes)), "NVSHMEM unique id");
                let mut attr = InitAttr::new();
                // SAFETY: stores a pointer to `uid` in `attr`; `uid` (boxed) outlives init below.
                let rc = unsafe { (api.set_attr_uniqueid_args)(rank as c_int, world as c_int, &*uid, &mut attr) };
                if rc != 0 {
                    return Err(EpError::Nvshmem(format!(
                        "rank {rank}: nvshmemx_set_attr_uniqueid_args({rank}, {world}) failed with {rc}"
                    )));
                }
                // SAFETY: attr is a valid v1 attr pointing at `uid`.
                let rc = unsafe { (api.hostlib_init_attr)(INIT_WITH_UNIQUEID, &mut attr) };
                drop(uid);
                if rc != 0 {
                    return Err(init_failed(rank, rc, &lib.path, "unique-id"));
                }
            }
            Bootstrap::Pmi(flavor) => {
                let mut attr = InitAttr::new();
                // SAFETY: flags 0 selects the bootstrap named by NVSHMEM_BOOTSTRAP (set to PMI).
                let rc = unsafe { (api.hostlib_init_attr)(0, &mut attr) };
                if rc != 0 {
                    return Err(init_failed(rank, rc, &lib.path, flavor.nvshmem_name()));
                }
            }
        }
        let status = unsafe { (api.init_status)() };
        // SAFETY (above and below): plain queries after a successful init.
        let (my_pe, n_pes) = unsafe { ((api.my_pe)() as usize, (api.n_pes)() as usize) };
        let nv = Arc::new(Nvshmem { lib, my_pe, n_pes, bootstrap });
        if status < STATUS_IS_INITIALIZED {
            return Err(EpError::Nvshmem(format!(
                "rank {rank}: nvshmemx_hostlib_init_attr returned 0 but nvshmemx_init_status() = {status}. {}Rerun with NVSHMEM_DEBUG=INFO",
                p2p_off_hint(std::env::var("NVSHMEM_DISABLE_P2P").ok().as_deref())
            )));
        }
        if my_pe != rank || n_pes != world {
            return Err(EpError::Nvshmem(format!(
                "NVSHMEM placed this process at PE {my_pe} of {n_pes}, but the rendezvous says rank {rank} of {world}. \
                 Fix: under Slurm/PMI make RANK/WORLD_SIZE agree with the PMI rank (e.g. RANK=$SLURM_PROCID \
                 WORLD_SIZE=$SLURM_NTASKS), or use the default unique-id bootstrap (unset NVSHMEM_BOOTSTRAP)"
            )));
        }
        tracing::info!(
            pe = my_pe,
            n_pes,
            version = %nv.lib.version,
            lib = %nv.lib.path.display(),
            bootstrap = ?bootstrap,
            "NVSHMEM initialized"
        );
        Ok(nv)
    }

    pub fn my_pe(&self) -> usize {
        self.my_pe
    }
    pub fn n_pes(&self) -> usize {
        self.n_pes
    }
    pub fn bootstrap(&self) -> Bootstrap {
        self.bootstrap
    }
    pub fn version(&self) -> Version {
        self.lib.version
    }
    pub fn lib_path(&self) -> &Path {
        &self.lib.path
    }

    /// Register a loaded NVSHMEM cubin (its `CUmodule`) so its device code can use NVSHMEM.
    /// The module must have been `nvlink`ed with `-lnvshmem_device` of the same version.
    /// `keep_alive` is dropped after `nvshmemx_cumodule_finalize` (pass the owner of the module,
    /// e.g. cudarc's `Arc<CudaModule>`, so the module is unloaded before NVSHMEM finalizes).
    ///
    /// # Safety
    /// `module` must be a valid `CUmodule` of the current context that outlives the
    /// returned registration (ensured by passing its owner as `keep_alive`).
    pub unsafe fn register_module(
        self: &Arc<Self>,
        module: *mut c_void,
        name: &str,
        keep_alive: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<RegisteredModule> {
        let rc = (self.lib.api.cumodule_init)(module);
        if rc != 0 {
            return Err(EpError::Nvshmem(format!(
                "rank {}: nvshmemx_cumodule_init on cubin '{name}' failed with {rc}. Causes: the host library \
                 {} ({}) differs from the device library linked into the cubin (rebuild with the same \
                 NVSHMEM_DIR), or the cubin was not nvlink'ed with -lnvshmem_device",
                self.my_pe,
                self.lib.path.display(),
                self.lib.version
            )));
        }
        Ok(RegisteredModule { nv: self.clone(), module, keep_alive: Some(keep_alive) })
    }

    /// Collective symmetric allocation (`nvshmem_align`): every PE must call it with the same
    /// size, in the same order. Contents are uninitialized.
    pub fn alloc(self: &Arc<Self>, bytes: usize, align: usize) -> Result<SymmetricBuffer> {
        if bytes == 0 || !align.is_power_of_two() {
            return Err(EpError::InvalidArgument(format!(
                "symmetric allocation of {bytes} B aligned to {align}: size must be > 0 and alignment a power of two"
            )));
        }
        // SAFETY: collective call after init.
        let p = unsafe { (self.lib.api.align)(align, bytes) };
        if p.is_null() {
            return Err(EpError::Nvshmem(format!(
                "rank {}: nvshmem_align({align}, {bytes}) returned null ({:.2} GiB). Fix: free GPU memory, raise \
                 NVSHMEM_SYMMETRIC_SIZE / NVSHMEM_MAX_MEMORY_PER_GPU, or lower num_max_dispatch_tokens_per_rank; \
                 every rank must request the same sizes in the same order",
                self.my_pe,
                bytes as f64 / (1u64 << 30) as f64
            )));
        }
        Ok(SymmetricBuffer { nv: self.clone(), ptr: p as u64, bytes })
    }

    /// `nvshmem_ptr`: the address of `local`'s counterpart on `pe` in this process' address
    /// space when `pe` is reachable by loads/stores (NVLink/P2P), else `None`.
    pub fn peer_ptr(&self, local: u64, pe: usize) -> Option<u64> {
        // SAFETY: pure query on a symmetric address.
        let p = unsafe { (self.lib.api.ptr)(local as *const c_void, pe as c_int) };
        (!p.is_null()).then_some(p as u64)
    }

    /// `nvshmem_barrier_all` (host-side, blocking; also quiets outstanding operations).
    pub fn barrier_all(&self) {
        // SAFETY: collective after init.
        unsafe { (self.lib.api.barrier_all)() }
    }

    /// `nvshmemx_barrier_all_on_stream` (enqueued on a raw `CUstream`).
    ///
    /// # Safety
    /// `stream` must be a valid stream of the current context.
    pub unsafe fn barrier_all_on_stream(&self, stream: *mut c_void) {
        (self.lib.api.barrier_all_on_stream)(stream)
    }

    /// `nvshmem_quiet` (host-initiated operations complete).
    pub fn quiet(&self) {
        // SAFETY: no preconditions after init.
        unsafe { (self.lib.api.quiet)() }
    }

    /// `nvshmem_team_my_pe` / `nvshmem_team_n_pes` for a team handle (0 = world).
    pub fn team_pe(&self, team: i32) -> (i32, i32) {
        // SAFETY: queries; an invalid team returns -1.
        unsafe { ((self.lib.api.team_my_pe)(team), (self.lib.api.team_n_pes)(team)) }
    }

    /// `nvshmemx_culibrary_init` for the `CUlibrary` loading route.
    ///
    /// # Safety
    /// `library` must be a valid `CUlibrary`.
    pub unsafe fn culibrary_init(&self, library: *mut c_void) -> Result<()> {
        let rc = (self.lib.api.culibrary_init)(library);
        if rc != 0 {
            return Err(EpError::Nvshmem(format!("nvshmemx_culibrary_init failed with {rc}")));
        }
        Ok(())
    }
}

fn init_failed(rank: usize, rc: c_int, path: &Path, how: &str) -> EpError {
    EpError::Nvshmem(format!(
        "rank {rank}: nvshmemx_hostlib_init_attr ({how} bootstrap) failed with {rc} using {}. {}Check in order: \
         the bootstrap plugin nvshmem_bootstrap_*.so.3 sits next to the host library; every rank runs with the \
         same NVSHMEM and its own GPU current; NVSHMEM_DISABLE_NVLS=1 in every process; for unique-id bootstrap \
         NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME names a reachable interface (lo on one host); then rerun with \
         NVSHMEM_DEBUG=INFO",
        path.display(),
        p2p_off_hint(std::env::var("NVSHMEM_DISABLE_P2P").ok().as_deref())
    ))
}

/// With `NVSHMEM_DISABLE_P2P=1` (what DeepEP's `allow_nvlink_for_low_latency_mode=False` sets),
/// NVSHMEM may reach peers only through a remote transport (IBGDA, IBRC, UCX: RDMA NICs); on a
/// machine without one, init fails ("Unable to initialize any transports"). Names that cause and
/// the fix first; empty otherwise.
fn p2p_off_hint(disable_p2p: Option<&str>) -> &'static str {
    if matches!(disable_p2p, Some("1") | Some("true") | Some("y") | Some("yes")) {
        "NVSHMEM_DISABLE_P2P=1 is set (DeepEP's allow_nvlink_for_low_latency_mode=False, e.g. test_low_latency.py \
         --disable-nvlink): NVSHMEM may then reach other GPUs only through an RDMA transport (IBGDA, IBRC, UCX), which needs \
         InfiniBand/RoCE NICs; without one no transport initialises. Fix: allow NVLink (allow_nvlink_for_low_latency_mode=True, \
         NVSHMEM_DISABLE_P2P unset) or run where RDMA NICs are. Otherwise: "
    } else {
        ""
    }
}

impl Drop for Nvshmem {
    fn drop(&mut self) {
        // Every SymmetricBuffer / RegisteredModule holds an Arc, so they are gone by now.
        // SAFETY: finalize after all frees and module finalizations.
        unsafe { (self.lib.api.hostlib_finalize)() };
        INITIALIZED.store(false, Ordering::SeqCst);
        tracing::debug!(pe = self.my_pe, "NVSHMEM finalized");
    }
}

/// A module registered with NVSHMEM; finalized (then `keep_alive` dropped) on drop.
pub struct RegisteredModule {
    nv: Arc<Nvshmem>,
    module: *mut c_void,
    keep_alive: Option<Box<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: a CUmodule handle is usable from any thread of the process.
unsafe impl Send for RegisteredModule {}
unsafe impl Sync for RegisteredModule {}

impl Drop for RegisteredModule {
    fn drop(&mut self) {
        // SAFETY: the module was registered and is still loaded (keep_alive not yet dropped).
        let rc = unsafe { (self.nv.lib.api.cumodule_finalize)(self.module) };
        if rc != 0 {
            tracing::warn!(rc, "nvshmemx_cumodule_finalize failed");
        }
        drop(self.keep_alive.take());
    }
}

/// A symmetric-heap allocation. Freed (collectively!) on drop: all ranks must drop their
/// buffers in the same order.
pub struct SymmetricBuffer {
    nv: Arc<Nvshmem>,
    ptr: u64,
    bytes: usize,
}

impl SymmetricBuffer {
    /// Device address on this PE.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    /// `nvshmem_ptr` of this buffer's start on `pe` (see [`Nvshmem::peer_ptr`]).
    pub fn peer_ptr(&self, pe: usize) -> Option<u64> {
        self.nv.peer_ptr(self.ptr, pe)
    }
    pub fn nvshmem(&self) -> &Arc<Nvshmem> {
        &self.nv
    }
}

impl fmt::Debug for SymmetricBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SymmetricBuffer({:#x}, {} B)", self.ptr, self.bytes)
    }
}

impl Drop for SymmetricBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by nvshmem_align on this runtime; collective free.
        unsafe { (self.nv.lib.api.free)(self.ptr as *mut c_void) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_versions_match_header_initializers() {
        let a = InitAttr::new();
        assert_eq!(a.version, (1 << 16) + 144);
        assert_eq!(a.args.version, (1 << 16) + 128);
        assert_eq!(a.args.uid_args.version, (1 << 16) + 24);
        assert_eq!((a.args.uid_args.myrank, a.args.uid_args.nranks), (-1, -1));
        assert_eq!(UniqueId::new().version, (1 << 16) + 128);
    }

    #[test]
    fn init_errors_name_disabled_p2p_as_the_cause() {
        for on in ["1", "true"] {
            let h = p2p_off_hint(Some(on));
            assert!(h.contains("NVSHMEM_DISABLE_P2P=1") && h.contains("allow_nvlink_for_low_latency_mode=True") && h.contains("NICs"), "{h}");
        }
        for off in [None, Some("0"), Some("")] {
            assert_eq!(p2p_off_hint(off), "");
        }
        // the hint leads the bootstrap checklist only when P2P is off
        let e = init_failed(3, 7, Path::new("/x/libnvshmem_host.so.3"), "unique-id").to_string();
        assert!(e.contains("rank 3") && e.contains("failed with 7") && e.contains("NVSHMEM_DEBUG=INFO"), "{e}");
    }

    #[test]
    fn unique_id_round_trips_and_rejects_short_input() {
        let mut u = UniqueId::new();
        u.internal[0] = 7;
        u.internal[123] = 9;
        let b = u.to_bytes();
        let v = UniqueId::from_bytes(&b).unwrap();
        assert_eq!(v.to_bytes(), b);
        let err = UniqueId::from_bytes(&b[..100]).err().unwrap().to_string();
        assert!(err.contains("100 bytes") && err.contains("128"), "{err}");
    }

    #[test]
    fn candidates_prefer_nvshmem_dir() {
        let c = candidates(Some(OsStr::new("/opt/nvshmem")));
        assert_eq!(c[0], PathBuf::from("/opt/nvshmem/lib/libnvshmem_host.so.3"));
        assert_eq!(c[1], PathBuf::from(HOST_LIB_NAME));
        assert_eq!(candidates(None), vec![PathBuf::from(HOST_LIB_NAME)]);
        assert_eq!(candidates(Some(OsStr::new(""))).len(), 1);
    }

    #[test]
    fn version_mismatch_names_both_versions_and_the_fix() {
        let p = Path::new("/x/libnvshmem_host.so.3");
        assert!(check_version(Version::new(3, 4, 5), p, Some(Version::new(3, 4, 5))).is_ok());
        assert!(check_version(Version::new(3, 4, 5), p, None).is_ok());
        let e = check_version(Version::new(3, 8, 0), p, Some(Version::new(3, 4, 5))).unwrap_err().to_string();
        assert!(e.contains("3.8.0") && e.contains("3.4.5") && e.contains("NVSHMEM_DIR"), "{e}");
    }
}
