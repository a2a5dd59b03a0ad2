//! One GPU per rank: context, stream, modules from the embedded cubins, launches, and the
//! diagnostic record that turns a stuck GPU wait into an error naming rank, phase and channel.

use super::memory::{HostMapped, Pod};
use super::{check, drv, Comm};
use crate::cubins::{self, Cubin};
use crate::error::{Diag, EpError, ErrorRecord, RecordKind, Result, ERR_BAD_EXPERT_ID, ERR_NONE, ERR_WRITING};
use cudarc::driver::{sys, CudaContext, CudaStream};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default bound of any single GPU-side wait (`DEEPEP_GPU_TIMEOUT_MS` overrides).
pub const DEFAULT_DEVICE_TIMEOUT: Duration = Duration::from_secs(5);
/// Extra time the host waits beyond the device bound before it declares the GPU stuck
/// (`DEEPEP_HOST_TIMEOUT_S` overrides the whole host bound). Only a backstop: every host wait
/// polls the diagnostic record and returns as soon as a kernel recorded a fatal error, so this
/// margin only matters when no kernel of ours got to wait at all (a stream stuck behind other
/// work, or grids that never started on an oversubscribed GPU).
pub const HOST_TIMEOUT_MARGIN: Duration = Duration::from_secs(5);

/// The GPU of this rank.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    ordinal: usize,
    record: Arc<HostMapped<ErrorRecord>>,
    /// The first expired wait seen on this GPU (sticky: [`Gpu::take_error`] clears the record, not
    /// this). Set, the buffers built on this GPU wait for a peer that is gone: [`Gpu::peer_lost`].
    lost: Mutex<Option<ErrorRecord>>,
    device_timeout_ns: AtomicU64,
    trap_on_error: AtomicBool,
    /// Whether [`Gpu::take_error`] leaves fatal records in place ([`Gpu::set_sticky_errors`]).
    sticky_errors: AtomicBool,
    host_timeout_ns: AtomicU64,
    /// This rank's share of the SMs: all of them with one rank per GPU, `device_sms / K` with
    /// `K` ranks sharing the GPU (see [`ranks_per_gpu`]).
    sm_count: u32,
    device_sms: u32,
    ranks_per_gpu: usize,
    l2_bytes: usize,
    name: String,
    /// Compute capability (major, minor): picks the architecture of the cubins loaded.
    cc: (u32, u32),
    done: sys::CUevent,
    /// Recorded and waited on at once by [`Gpu::stream_wait`].
    join: sys::CUevent,
    modules: Mutex<HashMap<&'static str, Arc<Module>>>,
    /// [`KEEP_COMM_STREAMS_ENV`] when this GPU was made: the stream outlives it ([`comm_stream`]).
    keep_stream: bool,
}

// SAFETY: the raw event is only used with the context bound; CUDA handles are thread-safe.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(rank {}, device {} {}, {} SMs", self.rank, self.ordinal, self.name, self.sm_count)?;
        if self.ranks_per_gpu > 1 {
            write!(f, " of {}, shared by {} ranks", self.device_sms, self.ranks_per_gpu)?;
        }
        write!(f, ")")
    }
}

fn attr(ctx: &CudaContext, a: sys::CUdevice_attribute) -> Result<i32> {
    ctx.attribute(a).map_err(drv("cuDeviceGetAttribute"))
}

impl Gpu {
    /// The GPU of rank `comm.rank()`: device `LOCAL_RANK / K` where `K` is [`ranks_per_gpu`]
    /// (1 unless `DEEPEP_RANKS_PER_GPU` asks several ranks to share each GPU on purpose).
    pub fn from_comm(comm: &Comm) -> Result<Gpu> {
        let k = ranks_per_gpu()?;
        super::require_cuda()?;
        let count = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))? as usize;
        let ordinal = device_for(comm.rank(), comm.local_rank(), comm.local_world(), k, count)?;
        Gpu::with_share(ordinal, comm.rank(), k)
    }

    /// One rank on device `ordinal` (the whole GPU).
    pub fn new(ordinal: usize, rank: usize) -> Result<Gpu> {
        Gpu::with_share(ordinal, rank, 1)
    }

    /// Retain the primary context of device `ordinal` (current on this thread; what NVSHMEM picks
    /// up), create a non-blocking stream and the host-mapped diagnostic record. `ranks_per_gpu`
    /// ranks share the device: [`Gpu::sm_count`] is then this rank's share of the SMs, so that the
    /// spin-waiting grids of all ranks on the GPU fit on it at once.
    pub fn with_share(ordinal: usize, rank: usize, ranks_per_gpu: usize) -> Result<Gpu> {
        super::require_cuda()?;
        let count = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))? as usize;
        if ordinal >= count {
            return Err(EpError::InvalidArgument(format!(
                "rank {rank}: LOCAL_RANK={ordinal} but only {count} GPU(s) are visible; start at most {count} ranks per host \
                 (check --nproc and CUDA_VISIBLE_DEVICES)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("creating the CUDA context"))?;
        // We pass raw pointers everywhere; cudarc's per-slice event tracking is not needed.
        // SAFETY: no cudarc slices are shared between streams by this crate.
        unsafe { ctx.disable_event_tracking() };
        let keep_stream = keep_comm_streams()?;
        let stream = comm_stream(&ctx, ordinal, keep_stream)?;
        let record = Arc::new(HostMapped::<ErrorRecord>::new(&ctx, 1)?);
        register_record(&record);
        let device_sms = attr(&ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let ranks_per_gpu = ranks_per_gpu.max(1);
        let sm_count = if ranks_per_gpu > 1 && whole_grids()? { device_sms } else { sm_share(device_sms, ranks_per_gpu) };
        let l2_bytes = attr(&ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize;
        let name = ctx.name().unwrap_or_else(|_| "?".into());
        let cc_major = attr(&ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32;
        let cc_minor = attr(&ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32;
        let mut done = std::ptr::null_mut();
        // SAFETY: context is current.
        check(unsafe { sys::cuEventCreate(&mut done, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, || "cuEventCreate".into())?;
        let mut join = std::ptr::null_mut();
        // SAFETY: as above.
        check(unsafe { sys::cuEventCreate(&mut join, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, || "cuEventCreate".into())?;
        let dev_ms = super::env_num::<u64>("DEEPEP_GPU_TIMEOUT_MS")?;
        let device_timeout = dev_ms.map(Duration::from_millis).unwrap_or(DEFAULT_DEVICE_TIMEOUT);
        let host_timeout = match super::env_num::<f64>("DEEPEP_HOST_TIMEOUT_S")? {
            Some(s) => Duration::from_secs_f64(s),
            None => device_timeout + HOST_TIMEOUT_MARGIN,
        };
        Ok(Gpu {
            ctx,
            stream,
            rank,
            ordinal,
            record,
            lost: Mutex::new(None),
            device_timeout_ns: AtomicU64::new(device_timeout.as_nanos() as u64),
            trap_on_error: AtomicBool::new(false),
            sticky_errors: AtomicBool::new(false),
            host_timeout_ns: AtomicU64::new(host_timeout.as_nanos() as u64),
            sm_count,
            device_sms,
            ranks_per_gpu,
            l2_bytes,
            name,
            cc: (cc_major, cc_minor),
            done,
            join,
            modules: Mutex::new(HashMap::new()),
            keep_stream,
        })
    }

    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// The SMs this rank may fill with blocks that wait on other ranks: every SM of the GPU with
    /// one rank per GPU, `device SMs / ranks_per_gpu` when several ranks share it.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    /// `num_sms` bounded by [`Gpu::sm_count`] (at least 1): configurations written for a whole GPU
    /// shrink to this rank's share when several ranks share it.
    pub fn fit_sms(&self, num_sms: usize) -> usize {
        num_sms.min(self.sm_count as usize).max(1)
    }
    /// [`Gpu::fit_sms`] for kernels that need an even block count (internode: `num_sms / 2`
    /// channels of a sender and a receiver block), at least 2.
    pub fn fit_sms_even(&self, num_sms: usize) -> usize {
        (self.fit_sms(num_sms) & !1).max(2)
    }
    /// All SMs of the device, whatever the share.
    pub fn device_sm_count(&self) -> u32 {
        self.device_sms
    }
    /// How many ranks share this GPU (1 = the normal, one rank per GPU).
    pub fn ranks_per_gpu(&self) -> usize {
        self.ranks_per_gpu
    }
    /// Whether several ranks share this GPU (timings are then not performance figures, and
    /// NCCL, which refuses two ranks on one GPU, cannot run).
    pub fn oversubscribed(&self) -> bool {
        self.ranks_per_gpu > 1
    }
    pub fn l2_bytes(&self) -> usize {
        self.l2_bytes
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Make this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("binding the CUDA context"))
    }

    /// Bound of any single GPU-side wait (`EpDiag::timeout_ns`).
    pub fn device_timeout(&self) -> Duration {
        Duration::from_nanos(self.device_timeout_ns.load(Ordering::Relaxed))
    }
    /// Change the device wait bound; the host bound becomes `d` + 5 s unless `DEEPEP_HOST_TIMEOUT_S` is set.
    pub fn set_device_timeout(&self, d: Duration) {
        self.device_timeout_ns.store(d.as_nanos() as u64, Ordering::Relaxed);
        if std::env::var_os("DEEPEP_HOST_TIMEOUT_S").is_none() {
            self.host_timeout_ns.store((d + HOST_TIMEOUT_MARGIN).as_nanos() as u64, Ordering::Relaxed);
        }
    }
    pub fn host_timeout(&self) -> Duration {
        Duration::from_nanos(self.host_timeout_ns.load(Ordering::Relaxed))
    }
    pub fn set_host_timeout(&self, d: Duration) {
        self.host_timeout_ns.store(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Whether kernels launched from now on abort with `trap` after recording a fatal error
    /// (default off). Off, a kernel whose bounded wait expires records `{rank, phase, channel,
    /// peer}` and returns, the stream completes, and every read through this crate
    /// ([`crate::tensor::Tensor`], [`Gpu::sync`]) reports the record. On, the record is written
    /// first and then the kernel traps: the context is unusable afterwards (every later CUDA call
    /// fails), which is what a caller that reads outputs without this crate (PyTorch) needs to
    /// never see partial data. A dropped bad expert id ([`RecordKind::Argument`]) never traps.
    pub fn set_trap_on_device_error(&self, on: bool) {
        self.trap_on_error.store(on, Ordering::Relaxed);
    }
    pub fn trap_on_device_error(&self) -> bool {
        self.trap_on_error.load(Ordering::Relaxed)
    }

    /// Whether records stay in place until taken explicitly (default off). Off, [`Gpu::take_error`]
    /// and [`Gpu::sync`] clear every record they report, and the buffers report an argument
    /// record once at their next call and remember a fatal one themselves. On (the Python
    /// binding, which reports the record itself before every call): a fatal record (a timeout, a
    /// failed device check) is reported by every later look ([`pending_device_error`],
    /// [`Gpu::take_error`]) until [`Gpu::clear_error`], and [`Gpu::take_error`] leaves argument
    /// records alone (the binding takes them with [`take_pending_device_error`]), so a buffer
    /// never refuses a call because of one.
    pub fn set_sticky_errors(&self, on: bool) {
        self.sticky_errors.store(on, Ordering::Relaxed);
    }

    /// The diagnostic argument every kernel takes last (appended by [`Gpu::launch`]).
    pub fn diag(&self) -> Diag {
        Diag {
            err: self.record.dev_ptr(),
            timeout_ns: self.device_timeout_ns.load(Ordering::Relaxed),
            rank: self.rank as i32,
            flags: if self.trap_on_error.load(Ordering::Relaxed) { crate::error::DIAG_TRAP } else { 0 },
        }
    }

    /// The current content of the host-mapped error record (all zero = no error).
    pub fn error_record(&self) -> ErrorRecord {
        read_record(&self.record)
    }

    /// Clear the error record (only while no kernel of this rank runs).
    pub fn clear_error(&self) {
        self.record.set(0, ErrorRecord::default());
    }

    /// Take a recorded dropped bad expert id ([`RecordKind::Argument`]): returns it and clears
    /// the record; a fatal record (or none) is left as it is and `None` returned.
    pub fn take_argument_error(&self) -> Option<EpError> {
        take_argument(&self.record)
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.cc
    }

    /// Load (once) the embedded cubin `name` of this device's architecture.
    pub fn module(&self, name: &str) -> Result<Arc<Module>> {
        let mut m = self.modules.lock().unwrap();
        if let Some(x) = m.get(name) {
            return Ok(x.clone());
        }
        let cubin = cubins::require_for_cc(name, self.cc, &format!("rank {}: GPU {} ({})", self.rank, self.ordinal, self.name))?;
        let module = Arc::new(Module::load(self, cubin)?);
        m.insert(cubin.name, module.clone());
        Ok(module)
    }

    /// Kernel `kernel` of the embedded cubin `module` (loads the module once).
    pub fn kernel(&self, module: &str, kernel: &str) -> Result<Kernel> {
        self.module(module)?.kernel(kernel)
    }

    /// Launch `k` on this GPU's stream with `args` followed by [`Gpu::diag`] (every kernel takes
    /// `EpDiag` last). Argument count and sizes are checked against the kernel's parameters.
    pub fn launch(&self, k: &Kernel, cfg: &LaunchCfg, args: Args) -> Result<()> {
        self.launch_in(k, cfg, args, self.cu_stream())
    }

    /// [`Gpu::launch`] (diag appended) on `stream`, a raw stream of this GPU's context.
    pub fn launch_in(&self, k: &Kernel, cfg: &LaunchCfg, mut args: Args, stream: sys::CUstream) -> Result<()> {
        args.push(self.diag());
        self.launch_raw(k, cfg, args, stream)
    }

    /// `waiter` waits for the work queued so far on `waited` (raw streams of this GPU's context;
    /// no host wait; nothing when they are the same stream).
    pub fn stream_wait(&self, waiter: sys::CUstream, waited: sys::CUstream) -> Result<()> {
        if waiter == waited {
            return Ok(());
        }
        self.bind()?;
        self.mark(self.join, waited)?;
        self.wait_mark(waiter, self.join)
    }

    /// A fresh event without timing, for [`Gpu::mark`] / [`Gpu::wait_mark`] (destroyed with
    /// [`Gpu::drop_mark`]).
    pub fn new_mark(&self) -> Result<sys::CUevent> {
        self.bind()?;
        let mut ev = std::ptr::null_mut();
        // SAFETY: context bound; `ev` is a valid out-pointer.
        check(unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, || format!("rank {}: cuEventCreate", self.rank))?;
        Ok(ev)
    }

    /// Record `mark` (from [`Gpu::new_mark`], or the Gpu's own join event) on the raw stream
    /// `stream` of this context: later
    /// waits on it order after the work queued on `stream` so far, even if `stream` is destroyed
    /// in between (the reason to keep an event rather than the stream handle).
    pub(crate) fn mark(&self, mark: sys::CUevent, stream: sys::CUstream) -> Result<()> {
        // SAFETY: our event and a live stream of this context (caller's contract).
        check(unsafe { sys::cuEventRecord(mark, stream) }, || format!("rank {}: cuEventRecord", self.rank))
    }

    /// `waiter` waits for the last [`Gpu::mark`] of `mark`.
    pub(crate) fn wait_mark(&self, waiter: sys::CUstream, mark: sys::CUevent) -> Result<()> {
        self.bind()?;
        // SAFETY: as above.
        check(unsafe { sys::cuStreamWaitEvent(waiter, mark, 0) }, || format!("rank {}: cuStreamWaitEvent", self.rank))
    }

    /// Destroy an event of [`Gpu::new_mark`].
    pub(crate) fn drop_mark(&self, mark: sys::CUevent) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: our event, not used afterwards (caller's contract).
            unsafe { sys::cuEventDestroy_v2(mark) };
        }
    }

    /// Whether the raw stream `stream` of this GPU's context is being captured into a CUDA graph.
    pub(crate) fn capturing(&self, stream: sys::CUstream) -> Result<bool> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream of this context (caller's contract); `status` is a valid out-pointer.
        check(unsafe { sys::cuStreamIsCapturing(stream, &mut status) }, || {
            format!("rank {}: querying a stream's capture status", self.rank)
        })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Asynchronous byte fill on the raw stream `stream` of this GPU's context.
    pub(crate) fn memset_u8_in(&self, dst: u64, v: u8, bytes: usize, stream: sys::CUstream) -> Result<()> {
        self.bind()?;
        // SAFETY: caller guarantees the range.
        check(unsafe { sys::cuMemsetD8Async(dst, v, bytes, stream) }, || format!("rank {}: memset of {bytes} bytes", self.rank))
    }

    /// [`Gpu::launch`] on another stream of this GPU, with `args` used as given (no diag appended).
    pub fn launch_on(&self, k: &Kernel, cfg: &LaunchCfg, args: Args, stream: &CudaStream) -> Result<()> {
        self.launch_raw(k, cfg, args, stream.cu_stream())
    }

    fn launch_raw(&self, k: &Kernel, cfg: &LaunchCfg, mut args: Args, stream: sys::CUstream) -> Result<()> {
        self.bind()?;
        k.check_args(&args)?;
        cfg.validate(self, k)?;
        if cfg.smem > 48 * 1024 {
            k.ensure_dynamic_smem(cfg.smem)?;
        }
        let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::new();
        if cfg.cooperative {
            // SAFETY: zeroed union is valid; we set the member we use.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            a.value.cooperative = 1;
            attrs.push(a);
        }
        if let Some((x, y, z)) = cfg.cluster {
            // SAFETY: as above.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            a.value.clusterDim.x = x;
            a.value.clusterDim.y = y;
            a.value.clusterDim.z = z;
            attrs.push(a);
        }
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid.0,
            gridDimY: cfg.grid.1,
            gridDimZ: cfg.grid.2,
            blockDimX: cfg.block.0,
            blockDimY: cfg.block.1,
            blockDimZ: cfg.block.2,
            sharedMemBytes: cfg.smem,
            hStream: stream,
            attrs: if attrs.is_empty() { std::ptr::null_mut() } else { attrs.as_mut_ptr() },
            numAttrs: attrs.len() as u32,
        };
        let mut ptrs = args.pointers();
        let timed = launch_timing_on();
        let t0 = timed.then(std::time::Instant::now);
        // SAFETY: parameter pointers stay alive (owned by `args`) for the call; sizes checked above.
        let res = unsafe { sys::cuLaunchKernelEx(&lc, k.func, ptrs.as_mut_ptr(), std::ptr::null_mut()) };
        if let Some(t0) = t0 {
            LAUNCH_NS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            LAUNCH_CALLS.fetch_add(1, Ordering::Relaxed);
        }
        check(res, || format!("rank {}: launching {} with {cfg:?}", self.rank, k.name))
    }

    /// Wait for everything queued on this GPU's stream, bounded by the host timeout. A GPU-side
    /// wait that expired (recorded in the diagnostic record) becomes [`EpError::GpuTimeout`] naming
    /// rank, call, phase, channel and peer (the record is cleared so later work can run, unless
    /// [`Gpu::set_sticky_errors`]); a fatal record set while this waits ends the wait at once (one
    /// already set when it starts does not: the stream drains first). A dropped bad expert id is
    /// not an error here (the buffer's next call reports it). No completion within the host bound
    /// without a record becomes [`EpError::HostTimeout`] naming `what`.
    pub fn sync(&self, what: &str) -> Result<()> {
        self.sync_raw(self.cu_stream(), what)
    }

    /// [`Gpu::sync`] for another stream of this GPU.
    pub fn sync_stream(&self, stream: &CudaStream, what: &str) -> Result<()> {
        self.sync_raw(stream.cu_stream(), what)
    }

    fn sync_raw(&self, stream: sys::CUstream, what: &str) -> Result<()> {
        self.bind()?;
        // SAFETY: event and stream belong to this context.
        check(unsafe { sys::cuEventRecord(self.done, stream) }, || format!("rank {}: cuEventRecord ({what})", self.rank))?;
        let start = Instant::now();
        let host_timeout = self.host_timeout();
        // A fatal record that is already there (sticky, reported before) does not end this wait
        // early: a caller about to free memory (a buffer's drop) must wait for the stream to drain.
        let stop_on_record = !self.fatal_recorded();
        let mut nap = Duration::from_micros(2);
        loop {
            // SAFETY: valid event.
            let q = unsafe { sys::cuEventQuery(self.done) };
            match q {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY => {
                    // A fatal record ends the wait at once (the kernel that wrote it gave up, and
                    // its other blocks follow within a few thousand polls); a dropped bad id does
                    // not: that kernel completes its call normally.
                    if stop_on_record {
                        if let Some(e) = self.take_fatal_error() {
                            return Err(e);
                        }
                    }
                    if start.elapsed() > host_timeout {
                        if let Some(e) = self.take_fatal_error() {
                            return Err(e);
                        }
                        let what = if self.oversubscribed() {
                            // No GPU-side wait expired, so no kernel of ours got to wait at all.
                            format!(
                                "{what} [no wait of this rank's kernels expired: with {} ranks per GPU a kernel may never have \
                                 started because the other ranks' blocks fill the GPU; under MPS keep {SHARED_GRIDS_ENV}=share]",
                                self.ranks_per_gpu
                            )
                        } else {
                            what.to_string()
                        };
                        return Err(EpError::HostTimeout { rank: self.rank, what, secs: start.elapsed().as_secs_f64() });
                    }
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(Duration::from_millis(1));
                }
                other => {
                    if let Some(e) = self.take_fatal_error() {
                        return Err(e);
                    }
                    return check(other, || {
                        format!("rank {}: GPU work for '{what}' failed (a sticky error: this process must exit)", self.rank)
                    });
                }
            }
        }
        match self.take_fatal_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// [`Gpu::take_error`] for a fatal record only: an argument record is left alone.
    fn take_fatal_error(&self) -> Option<EpError> {
        if self.fatal_recorded() {
            self.take_error()
        } else {
            None
        }
    }

    /// The first expired bounded wait of this GPU's kernels, if any (from the record as it is now,
    /// or as it was when [`Gpu::take_error`] cleared it). Once set it stays set: the peer that
    /// wait was for is lost to every buffer of this GPU, whose teardown must then be local only
    /// (no barrier, no collective free: they would wait for that peer forever).
    pub fn peer_lost(&self) -> Option<ErrorRecord> {
        self.note_lost(&self.error_record());
        *self.lost.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn note_lost(&self, r: &ErrorRecord) {
        if r.is_timeout() {
            let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
            if lost.is_none() {
                *lost = Some(*r);
            }
        }
    }

    /// Whether the record holds a fatal error (a timeout or a failed device check).
    pub fn fatal_recorded(&self) -> bool {
        self.error_record().kind().is_some_and(RecordKind::is_fatal)
    }

    /// The recorded device error, if any, as an [`EpError`]; clears the record. While
    /// [`Gpu::set_sticky_errors`] is on, a fatal record is reported but kept, and an argument
    /// record is neither reported nor cleared here.
    pub fn take_error(&self) -> Option<EpError> {
        let r = self.error_record();
        self.note_lost(&r);
        let kind = r.kind()?;
        let sticky = self.sticky_errors.load(Ordering::Relaxed);
        if kind == RecordKind::Argument {
            if sticky {
                return None;
            }
            return self.take_argument_error().or_else(|| self.take_error());
        }
        if !sticky {
            self.clear_error();
        }
        r.to_error()
    }

    /// Synchronous host-to-device copy on this GPU's stream.
    pub fn copy_htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: caller guarantees dst has room (DeviceBuffer checks); src lives until the sync below.
        check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const _, src.len(), self.cu_stream()) }, || {
            format!("rank {}: copy of {} bytes to the GPU", self.rank, src.len())
        })?;
        self.sync("host-to-device copy")
    }

    /// Synchronous device-to-host copy on this GPU's stream.
    pub fn copy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.bind()?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: dst lives until the sync below.
        check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut _, src, dst.len(), self.cu_stream()) }, || {
            format!("rank {}: copy of {} bytes from the GPU", self.rank, dst.len())
        })?;
        self.sync("device-to-host copy")
    }

    /// Asynchronous device-to-device copy on this GPU's stream (peer pointers allowed).
    pub fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: caller guarantees both ranges are valid.
        check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.cu_stream()) }, || {
            format!("rank {}: device copy of {bytes} bytes", self.rank)
        })
    }

    /// Whether this GPU's stream is being captured into a CUDA graph (work enqueued now is
    /// recorded, and replayed on every launch of the graph).
    pub fn stream_capturing(&self) -> Result<bool> {
        self.capturing(self.cu_stream())
    }

    /// Asynchronous byte fill on this GPU's stream.
    pub fn memset_u8(&self, dst: u64, v: u8, bytes: usize) -> Result<()> {
        self.memset_u8_in(dst, v, bytes, self.cu_stream())
    }

    /// Asynchronous 32-bit fill of `words` words (`dst` 4-byte aligned) on this GPU's stream.
    pub fn memset_u32(&self, dst: u64, v: u32, words: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: caller guarantees the range.
        check(unsafe { sys::cuMemsetD32Async(dst, v, words, self.cu_stream()) }, || {
            format!("rank {}: memset of {words} words", self.rank)
        })
    }

    /// Enable direct access to every other visible GPU that supports it (already enabled = fine).
    /// IPC buffers do this lazily; call it for pointers obtained elsewhere (e.g. `nvshmem_ptr`).
    pub fn enable_peer_access(&self) -> Result<()> {
        self.bind()?;
        let count = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))? as usize;
        for o in (0..count).filter(|&o| o != self.ordinal) {
            let mut can = 0;
            let mut dev = 0;
            // SAFETY: plain queries.
            unsafe {
                check(sys::cuDeviceGet(&mut dev, o as i32), || format!("cuDeviceGet({o})"))?;
                check(sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), dev), || "cuDeviceCanAccessPeer".into())?;
            }
            if can == 0 {
                continue;
            }
            let mut peer_ctx = std::ptr::null_mut();
            // SAFETY: retains the peer's primary context for the rest of the process (releasing it
            // could destroy it and with it the peer mapping).
            unsafe {
                check(sys::cuDevicePrimaryCtxRetain(&mut peer_ctx, dev), || format!("retaining device {o}'s context"))?;
                let r = sys::cuCtxEnablePeerAccess(peer_ctx, 0);
                if r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                    check(r, || format!("rank {}: enabling peer access {} -> {o}", self.rank, self.ordinal))?;
                }
            }
        }
        Ok(())
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.keep_stream {
            kept_streams().push((self.ordinal, self.stream.clone()));
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: our event.
            unsafe {
                sys::cuEventDestroy_v2(self.done);
                sys::cuEventDestroy_v2(self.join);
            }
        }
    }
}

/// A loaded embedded cubin. The raw `CUmodule` is exposed for `nvshmemx_cumodule_init`.
pub struct Module {
    cubin: &'static Cubin,
    raw: sys::CUmodule,
    ctx: Arc<CudaContext>,
}

// SAFETY: CUDA module handles are usable from any thread with the context bound.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    fn load(gpu: &Gpu, cubin: &'static Cubin) -> Result<Module> {
        gpu.bind()?;
        let mut raw = std::ptr::null_mut();
        // cuModuleLoadData wants the image suitably aligned; copy into an 8-byte aligned buffer.
        let mut image = vec![0u64; cubin.bytes.len().div_ceil(8)];
        // SAFETY: image has at least bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(cubin.bytes.as_ptr(), image.as_mut_ptr() as *mut u8, cubin.bytes.len()) };
        // SAFETY: a complete cubin image.
        check(unsafe { sys::cuModuleLoadData(&mut raw, image.as_ptr() as *const _) }, || {
            format!(
                "rank {}: loading cubin '{}' ({} for {}, nvcc {}) on {}; the driver must be >= CUDA 13.0 (580)",
                gpu.rank(),
                cubin.name,
                if cubin.nvshmem { "NVSHMEM" } else { "plain" },
                cubin.arch,
                cubins::NVCC_VERSION,
                gpu.name()
            )
        })?;
        Ok(Module { cubin, raw, ctx: gpu.ctx().clone() })
    }

    pub fn name(&self) -> &'static str {
        self.cubin.name
    }
    pub fn cubin(&self) -> &'static Cubin {
        self.cubin
    }
    /// The raw module handle (e.g. for `nvshmemx_cumodule_init` / `nvshmemx_cumodule_finalize`).
    pub fn raw(&self) -> sys::CUmodule {
        self.raw
    }

    /// The entry point `name` (must be one of the cubin's `extern "C" __global__` kernels).
    pub fn kernel(self: &Arc<Self>, name: &str) -> Result<Kernel> {
        if !self.cubin.kernels.contains(&name) {
            return Err(EpError::InvalidArgument(format!(
                "cubin '{}' has no kernel '{name}'; its kernels are {:?}",
                self.cubin.name, self.cubin.kernels
            )));
        }
        self.ctx.bind_to_thread().map_err(drv("binding the CUDA context"))?;
        let mut func = std::ptr::null_mut();
        let cname = std::ffi::CString::new(name).unwrap();
        // SAFETY: module is loaded; name is NUL-terminated.
        check(unsafe { sys::cuModuleGetFunction(&mut func, self.raw, cname.as_ptr()) }, || {
            format!("cuModuleGetFunction({name}) in '{}'", self.cubin.name)
        })?;
        // Parameter layout (CUDA >= 12.4 drivers); unknown = no argument check.
        let mut params = Vec::new();
        loop {
            let (mut off, mut size) = (0usize, 0usize);
            // SAFETY: index beyond the last parameter returns an error, which ends the loop.
            let r = unsafe { sys::cuFuncGetParamInfo(func, params.len(), &mut off, &mut size) };
            if r != sys::CUresult::CUDA_SUCCESS {
                break;
            }
            params.push(size);
        }
        let params = if params.is_empty() { None } else { Some(params) };
        // Images linked by nvlink (NVSHMEM) record only the total; the driver may then not know
        // the sizes either, so keep the total for a coarser check.
        let param_total = self.cubin.params(name).ok().and_then(|p| p.total);
        Ok(Kernel { name: name.to_string(), func, params, param_total, module: self.clone(), dyn_smem: Arc::new(AtomicU32::new(48 * 1024)), occupancy: Arc::default() })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded by us; NVSHMEM users must call nvshmemx_cumodule_finalize first.
            unsafe { sys::cuModuleUnload(self.raw) };
        }
    }
}

/// A kernel entry point of a loaded [`Module`].
#[derive(Clone)]
pub struct Kernel {
    name: String,
    func: sys::CUfunction,
    /// Parameter sizes from `cuFuncGetParamInfo` (None when the driver cannot tell).
    params: Option<Vec<usize>>,
    /// Total parameter bytes recorded in the cubin.
    param_total: Option<usize>,
    module: Arc<Module>,
    dyn_smem: Arc<AtomicU32>,
    /// `cuOccupancyMaxActiveBlocksPerMultiprocessor` results by (block threads, dynamic smem):
    /// a cooperative launch checks the grid against it every call, and the driver query costs
    /// microseconds of host time per launch while the answer never changes for a kernel.
    occupancy: Arc<std::sync::Mutex<Vec<OccupancyEntry>>>,
}

/// ((block threads, dynamic smem bytes), blocks per SM) of one occupancy query.
type OccupancyEntry = ((u32, u32), u32);

// SAFETY: CUfunction handles are usable from any thread with the context bound.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({}::{})", self.module.name(), self.name)
    }
}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn raw(&self) -> sys::CUfunction {
        self.func
    }
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }
    /// Parameter sizes in bytes, when the driver reports them.
    pub fn param_sizes(&self) -> Option<&[usize]> {
        self.params.as_deref()
    }

    fn check_args(&self, args: &Args) -> Result<()> {
        let Some(p) = &self.params else {
            let end = args.packed_size();
            return match self.param_total {
                Some(t) if t != end => Err(EpError::InvalidArgument(format!(
                    "kernel {}: takes {t} bytes of parameters but the launch passes {end} (sizes {:?}; the EpDiag is appended \
                     automatically by Gpu::launch); fix the argument list or the #[repr(C)] mirror of the parameter struct",
                    self.name,
                    args.slots.iter().map(|s| s.1).collect::<Vec<_>>()
                ))),
                _ => Ok(()),
            };
        };
        let got: Vec<usize> = args.slots.iter().map(|s| s.1).collect();
        if got.len() != p.len() || got.iter().zip(p).any(|(a, b)| a != b) {
            return Err(EpError::InvalidArgument(format!(
                "kernel {}: parameter sizes {:?} but the launch passes {:?} (the EpDiag is appended automatically by Gpu::launch); \
                 fix the argument list to match the kernel signature",
                self.name, p, got
            )));
        }
        Ok(())
    }

    fn ensure_dynamic_smem(&self, bytes: u32) -> Result<()> {
        if self.dyn_smem.load(Ordering::Relaxed) >= bytes {
            return Ok(());
        }
        // SAFETY: valid function handle.
        check(
            unsafe {
                sys::cuFuncSetAttribute(
                    self.func,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            },
            || format!("kernel {}: allowing {bytes} bytes of dynamic shared memory (H200 max is 227 KiB per block)", self.name),
        )?;
        self.dyn_smem.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// How many blocks of `block_threads` threads with `smem` dynamic shared bytes fit on one SM.
    pub fn max_blocks_per_sm(&self, block_threads: u32, smem: u32) -> Result<u32> {
        let key = (block_threads, smem);
        if let Some(&(_, n)) = self.occupancy.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|(k, _)| *k == key) {
            return Ok(n);
        }
        if smem > 48 * 1024 {
            self.ensure_dynamic_smem(smem)?;
        }
        let mut n = 0;
        // SAFETY: valid function handle.
        check(unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.func, block_threads as i32, smem as usize) }, || {
            format!("occupancy of {}", self.name)
        })?;
        self.occupancy.lock().unwrap_or_else(|p| p.into_inner()).push((key, n as u32));
        Ok(n as u32)
    }
}

/// Grid, block, dynamic shared memory and launch attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchCfg {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes (> 48 KiB raises the kernel's limit automatically).
    pub smem: u32,
    /// All blocks co-resident (grid-wide sync allowed); checked against occupancy before launch.
    pub cooperative: bool,
    /// Thread-block cluster dimensions (the grid must be divisible by them).
    pub cluster: Option<(u32, u32, u32)>,
}

impl LaunchCfg {
    /// 1-D grid of `grid` blocks of `block` threads.
    pub fn new(grid: u32, block: u32) -> LaunchCfg {
        LaunchCfg { grid: (grid, 1, 1), block: (block, 1, 1), smem: 0, cooperative: false, cluster: None }
    }
    pub fn smem(mut self, bytes: u32) -> Self {
        self.smem = bytes;
        self
    }
    pub fn cooperative(mut self, yes: bool) -> Self {
        self.cooperative = yes;
        self
    }
    pub fn cluster(mut self, x: u32, y: u32, z: u32) -> Self {
        self.cluster = Some((x, y, z));
        self
    }

    fn validate(&self, gpu: &Gpu, k: &Kernel) -> Result<()> {
        let (g, b) = (self.grid, self.block);
        let threads = b.0 as u64 * b.1 as u64 * b.2 as u64;
        let bad = |m: String| Err(EpError::InvalidArgument(format!("kernel {}: {m}", k.name)));
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || threads == 0 {
            return bad(format!("empty launch {self:?}"));
        }
        if threads > 1024 {
            return bad(format!("{threads} threads per block (max 1024)"));
        }
        if let Some(c) = self.cluster {
            if c.0 == 0 || c.1 == 0 || c.2 == 0 || g.0 % c.0 != 0 || g.1 % c.1 != 0 || g.2 % c.2 != 0 {
                return bad(format!("grid {g:?} is not divisible by cluster {c:?}"));
            }
        }
        if self.cooperative {
            let per_sm = k.max_blocks_per_sm(threads as u32, self.smem)?;
            let blocks = g.0 as u64 * g.1 as u64 * g.2 as u64;
            let cap = per_sm as u64 * gpu.sm_count() as u64;
            if blocks > cap {
                return bad(format!(
                    "cooperative launch of {blocks} blocks but only {cap} fit at once ({per_sm} per SM x {} SMs with {threads} threads, {} B smem); use fewer blocks (--num-sms)",
                    gpu.sm_count(),
                    self.smem
                ));
            }
        }
        Ok(())
    }
}

/// Kernel arguments, each copied into its own 16-byte-aligned slot.
#[derive(Default)]
pub struct Args {
    /// (storage, size, alignment) per argument.
    slots: Vec<(Box<[u128]>, usize, usize)>,
}

impl Args {
    pub fn new() -> Args {
        Args::default()
    }
    /// Append one argument (by value, like the C++ signature: pass device pointers as `u64`).
    pub fn push<T: Pod>(&mut self, v: T) -> &mut Self {
        let size = std::mem::size_of::<T>();
        assert!(std::mem::align_of::<T>() <= 16, "kernel argument alignment above 16");
        let mut slot = vec![0u128; size.div_ceil(16).max(1)].into_boxed_slice();
        // SAFETY: slot has >= size bytes and T is Pod.
        unsafe { std::ptr::copy_nonoverlapping(&v as *const T as *const u8, slot.as_mut_ptr() as *mut u8, size) };
        self.slots.push((slot, size, std::mem::align_of::<T>()));
        self
    }
    /// Builder form of [`Args::push`].
    pub fn arg<T: Pod>(mut self, v: T) -> Self {
        self.push(v);
        self
    }
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
    /// Bytes the arguments occupy in the parameter buffer (each at its natural alignment).
    fn packed_size(&self) -> usize {
        self.slots.iter().fold(0, |off, s| off.next_multiple_of(s.2) + s.1)
    }
    fn pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        self.slots.iter_mut().map(|s| s.0.as_mut_ptr() as *mut std::ffi::c_void).collect()
    }
}

/// `args![a, b, c]` builds [`Args`] (each value must implement [`Pod`]).
#[macro_export]
macro_rules! args {
    ($($x:expr),* $(,)?) => {{
        #[allow(unused_mut)]
        let mut a = $crate::runtime::Args::new();
        $( a.push($x); )*
        a
    }};
}

/// Diagnostic records of the live [`Gpu`]s of this process, so that code which only holds a stream
/// (e.g. [`crate::tensor::Tensor::to_host`]) can refuse to hand back data that a kernel whose wait
/// expired left incomplete. A bounded wait records its error and returns, so the stream itself
/// completes without a CUDA error: a plain stream sync must never be the last word.
static LIVE_RECORDS: Mutex<Vec<std::sync::Weak<HostMapped<ErrorRecord>>>> = Mutex::new(Vec::new());

fn register_record(r: &Arc<HostMapped<ErrorRecord>>) {
    let mut live = LIVE_RECORDS.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(r));
}

static LAUNCH_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static LAUNCH_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Whether `DEEPEP_HOST_TIMING=1` (read once): every launch then adds the host time spent inside
/// `cuLaunchKernelEx` to process-wide counters ([`launch_timing`]; a diagnostic of the host path,
/// off by default).
fn launch_timing_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DEEPEP_HOST_TIMING").is_ok_and(|v| v == "1"))
}

/// `(launches, nanoseconds)` spent inside `cuLaunchKernelEx` by this process since the last
/// reset (`reset` zeroes them after reading); both 0 unless `DEEPEP_HOST_TIMING=1`.
pub fn launch_timing(reset: bool) -> (u64, u64) {
    if reset {
        (LAUNCH_CALLS.swap(0, Ordering::Relaxed), LAUNCH_NS.swap(0, Ordering::Relaxed))
    } else {
        (LAUNCH_CALLS.load(Ordering::Relaxed), LAUNCH_NS.load(Ordering::Relaxed))
    }
}

/// The first error recorded by a kernel of any live [`Gpu`] of this process and not yet taken by
/// [`Gpu::sync`] / [`Gpu::take_error`]. The record is left in place: the next call into the
/// buffer that ran the kernel still sees it (and poisons that buffer, unless it is an argument
/// record).
pub fn pending_device_error() -> Option<EpError> {
    pending_record(|_| true).and_then(|(_, r)| r.to_error())
}

/// [`pending_device_error`] restricted to fatal records (timeouts, failed device checks).
pub fn pending_fatal_error() -> Option<EpError> {
    pending_record(RecordKind::is_fatal).and_then(|(_, r)| r.to_error())
}

/// The first error recorded by a kernel of any live [`Gpu`] of this process, with its kind. An
/// argument record ([`RecordKind::Argument`]: a bad id was dropped, nothing else happened) is
/// cleared, so it is reported once; a fatal record is left in place (reported again by every
/// later look until the buffer is recreated or [`Gpu::clear_error`]).
pub fn take_pending_device_error() -> Option<(RecordKind, EpError)> {
    let (rec, r) = pending_record(|_| true)?;
    let kind = r.kind()?;
    if kind == RecordKind::Argument {
        return match take_argument(&rec) {
            Some(e) => Some((kind, e)),
            // replaced by a fatal record meanwhile
            None => pending_record(|_| true).and_then(|(_, r)| Some((r.kind()?, r.to_error()?))),
        };
    }
    Some((kind, r.to_error()?))
}

fn pending_record(want: impl Fn(RecordKind) -> bool) -> Option<(Arc<HostMapped<ErrorRecord>>, ErrorRecord)> {
    let live = LIVE_RECORDS.lock().unwrap_or_else(|e| e.into_inner());
    live.iter().filter_map(|w| w.upgrade()).find_map(|rec| {
        let r = read_record(&rec);
        r.kind().is_some_and(&want).then_some((rec, r))
    })
}

/// A consistent snapshot of a record: the code first (the device writes it last, after a system
/// fence), then the fields. A record still being written (code -1) is re-read for up to 10 ms.
fn read_record(rec: &HostMapped<ErrorRecord>) -> ErrorRecord {
    // SAFETY: the live host-mapped record of `rec`.
    unsafe { read_record_at(rec.host_ptr()) }
}

/// [`read_record`] on a raw record.
///
/// # Safety
/// `base` points to a live, aligned [`ErrorRecord`] (written concurrently only by the GPU).
unsafe fn read_record_at(base: *const ErrorRecord) -> ErrorRecord {
    let code_ptr = std::ptr::addr_of!((*base).code);
    let start = Instant::now();
    loop {
        // volatile: the GPU writes the record concurrently
        let code = std::ptr::read_volatile(code_ptr);
        if code == ERR_NONE {
            return ErrorRecord::default();
        }
        if code != ERR_WRITING || start.elapsed() > Duration::from_millis(10) {
            std::sync::atomic::fence(Ordering::Acquire);
            let r = std::ptr::read_volatile(base);
            if r.code == code {
                return r;
            }
            continue; // changed while reading: read again
        }
        std::hint::spin_loop();
    }
}

/// Clear an argument record and return it; a fatal record (or none) is left in place. `bad_key`
/// is zeroed first, then the code is swapped 4 -> 0 with a host compare-exchange, which fails
/// when the code changed since it was read. Best effort while a kernel still runs: the device
/// side uses device-scope atomics (proven on host-mapped memory; atomicity with the host is not
/// guaranteed over PCIe), so a fatal record written in the same microsecond as this swap could
/// be lost, and a later bad id of the same call may be recorded again (then reported by the next
/// look). Python takes argument records at the start of a call, usually after the kernel ended.
fn take_argument(rec: &HostMapped<ErrorRecord>) -> Option<EpError> {
    // SAFETY: the live host-mapped record of `rec`.
    unsafe { take_argument_at(rec.host_ptr()) }
}

/// [`take_argument`] on a raw record.
///
/// # Safety
/// `base` points to a live, aligned [`ErrorRecord`] whose `code` is only accessed atomically or
/// volatile (the GPU side uses atomics on it).
unsafe fn take_argument_at(base: *mut ErrorRecord) -> Option<EpError> {
    let r = read_record_at(base);
    if r.kind() != Some(RecordKind::Argument) {
        return None;
    }
    std::ptr::write_volatile(std::ptr::addr_of_mut!((*base).bad_key), 0);
    std::sync::atomic::fence(Ordering::SeqCst);
    let code = std::sync::atomic::AtomicI32::from_ptr(std::ptr::addr_of_mut!((*base).code));
    code.compare_exchange(ERR_BAD_EXPERT_ID, ERR_NONE, Ordering::SeqCst, Ordering::SeqCst).ok()?;
    r.to_error()
}

/// Environment variable that lets `K` ranks share each GPU on purpose (set by `--ranks-per-gpu`).
pub const RANKS_PER_GPU_ENV: &str = "DEEPEP_RANKS_PER_GPU";

/// Ranks per GPU asked for by [`RANKS_PER_GPU_ENV`] (default 1: one rank per GPU).
pub fn ranks_per_gpu() -> Result<usize> {
    match super::env_num::<usize>(RANKS_PER_GPU_ENV)? {
        None => Ok(1),
        Some(0) => Err(EpError::InvalidArgument(format!("{RANKS_PER_GPU_ENV}=0; use 1 (one rank per GPU, the default) or more"))),
        Some(k) => Ok(k),
    }
}

/// This rank's share of `device_sms` SMs when `k` ranks share the GPU (at least 1).
pub fn sm_share(device_sms: u32, k: usize) -> u32 {
    (device_sms / k.max(1) as u32).max(1)
}

/// The device ordinal of a rank: `local_rank / k` (ranks 0..k-1 on GPU 0, k..2k-1 on GPU 1, ...).
/// Refuses a host with more local ranks than `k` x `visible` GPUs, naming the settings that fix it.
pub fn device_for(rank: usize, local_rank: usize, local_world: usize, k: usize, visible: usize) -> Result<usize> {
    let k = k.max(1);
    let ordinal = local_rank / k;
    let needed = local_world.div_ceil(k).max(ordinal + 1);
    if needed > visible {
        let msg = if k == 1 {
            format!(
                "rank {rank}: LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world} needs GPU {ordinal}, but only {visible} GPU(s) are \
                 visible; start at most {visible} ranks per host (check --nproc and CUDA_VISIBLE_DEVICES), or let several ranks \
                 share each GPU on purpose for testing with --ranks-per-gpu K ({RANKS_PER_GPU_ENV}=K)"
            )
        } else {
            format!(
                "rank {rank}: {local_world} ranks on this host at {k} per GPU ({RANKS_PER_GPU_ENV}={k}) need {needed} GPU(s), but only \
                 {visible} are visible; raise --ranks-per-gpu to {} or start fewer ranks",
                local_world.div_ceil(visible.max(1))
            )
        };
        return Err(EpError::InvalidArgument(msg));
    }
    Ok(ordinal)
}

/// Environment variable choosing the grids of ranks that share a GPU: `share` (default: each rank
/// sizes its grids to `SMs / K`, so the waiting blocks of all ranks fit at once and the mode works
/// under MPS as well as time-sliced) or `whole` (every rank sizes its grids for the whole GPU, as
/// with one rank per GPU; only correct time-sliced, without MPS, where each context gets the
/// whole GPU in its time slice).
pub const SHARED_GRIDS_ENV: &str = "DEEPEP_SHARED_GPU_GRIDS";

/// `1` (the default): the stream of a dropped [`Gpu`] is kept for the rest of the process (and
/// given to the next `Gpu` of the device once it is idle) instead of being destroyed; `0` destroys
/// it with the `Gpu`. On by default since python/tests/gpu passed with it on an H100 (see
/// docs/python.md, "Knobs").
///
/// Why: the Python facades tie tensors to the comm stream (`record_stream`, as DeepEP does
/// for `async_finish`, and allocations under `allocate_on_comm_stream`), and such a tensor may be
/// freed after its Buffer was destroyed or collected. torch then records an event on the
/// stream (`insert_events` in its caching allocator); had the stream been destroyed, the process
/// would abort ("invalid device context"). DeepEP's comm stream comes from torch's stream pool and
/// is never destroyed either.
pub const KEEP_COMM_STREAMS_ENV: &str = "DEEPEP_KERNELS_KEEP_COMM_STREAMS";

fn keep_comm_streams() -> Result<bool> {
    keep_comm_streams_from(std::env::var(KEEP_COMM_STREAMS_ENV).ok().as_deref())
}

fn keep_comm_streams_from(value: Option<&str>) -> Result<bool> {
    match value.map(str::trim) {
        None | Some("") | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(EpError::InvalidArgument(format!("{KEEP_COMM_STREAMS_ENV}={v:?}: use 1 (the default: keep a Buffer's stream for the next one) or 0 (destroy it with the Buffer)"))),
    }
}

/// Streams of dropped GPUs, by device ordinal (unless [`KEEP_COMM_STREAMS_ENV`] is `0`). Never destroyed: at
/// most one per `Gpu` that was alive at once, plus any still busy when the next one was made.
static KEPT_STREAMS: Mutex<Vec<(usize, Arc<CudaStream>)>> = Mutex::new(Vec::new());

fn kept_streams() -> std::sync::MutexGuard<'static, Vec<(usize, Arc<CudaStream>)>> {
    KEPT_STREAMS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The stream of a new [`Gpu`] on device `ordinal` (its context current): with `keep`, a kept
/// stream of that device with no work left on it (one still running a kernel of the dropped
/// Buffer, e.g. one timing out on a lost peer, is left alone), else a new non-blocking stream.
fn comm_stream(ctx: &Arc<CudaContext>, ordinal: usize, keep: bool) -> Result<Arc<CudaStream>> {
    if keep {
        let mut kept = kept_streams();
        // SAFETY: a query of a live stream of this device (the pool holds it).
        let idle = |s: &CudaStream| unsafe { sys::cuStreamQuery(s.cu_stream()) } == sys::CUresult::CUDA_SUCCESS;
        if let Some(i) = kept.iter().position(|(o, s)| *o == ordinal && idle(s)) {
            return Ok(kept.swap_remove(i).1);
        }
    }
    ctx.new_stream().map_err(drv("creating a stream"))
}

fn whole_grids() -> Result<bool> {
    match std::env::var(SHARED_GRIDS_ENV).as_deref() {
        Err(_) | Ok("") | Ok("share") => Ok(false),
        Ok("whole") => Ok(true),
        Ok(v) => Err(EpError::InvalidArgument(format!("{SHARED_GRIDS_ENV}={v:?}: use share (the default) or whole"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn keeping_comm_streams_is_on_unless_turned_off_and_a_bad_value_is_named() {
        assert!(keep_comm_streams_from(None).unwrap());
        assert!(keep_comm_streams_from(Some("")).unwrap());
        assert!(keep_comm_streams_from(Some(" 1 ")).unwrap());
        assert!(!keep_comm_streams_from(Some("0")).unwrap());
        let e = keep_comm_streams_from(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("DEEPEP_KERNELS_KEEP_COMM_STREAMS=\"yes\"") && e.contains("use 1"), "{e}");
    }

    #[test]
    fn args_keep_values_and_sizes() {
        let d = Diag { err: 0x1000, timeout_ns: 5, rank: 3, flags: 0 };
        let mut a = crate::args![7u64, 2i32, d];
        assert_eq!(a.slots.iter().map(|s| s.1).collect::<Vec<_>>(), vec![8, 4, 24]);
        assert_eq!(a.packed_size(), 40); // 8 + 4 + pad 4 + 24, as ep_fill_u32's 48 = 8 + 8 + 4 + 4 + 24
        let p = a.pointers();
        // SAFETY: the slots hold exactly these values.
        unsafe {
            assert_eq!(*(p[0] as *const u64), 7);
            assert_eq!(*(p[1] as *const i32), 2);
            assert_eq!((*(p[2] as *const Diag)).rank, 3);
            assert_eq!(p[0] as usize % 16, 0);
        }
    }

    #[test]
    fn an_argument_record_is_taken_once_and_a_fatal_one_is_left() {
        use crate::error::{bad_key, ERR_TIMEOUT};
        // A record in ordinary memory stands in for the host-mapped one (same layout and access).
        let mut rec = Box::new(ErrorRecord {
            code: ERR_BAD_EXPERT_ID,
            rank: 1,
            phase: crate::error::Phase::LlDispatchSend as i32,
            channel: -1,
            peer: 16,
            detail: 4,
            waited_ns: 0,
            bad_key: bad_key(4 * 9 + 3, -7),
        });
        let p: *mut ErrorRecord = &mut *rec;
        // SAFETY: `p` points to the boxed record, alive for the whole test.
        unsafe {
            match take_argument_at(p) {
                Some(EpError::BadExpertId { rank: 1, token: 9, slot: 3, value: -7, num_experts: 16, ref call }) if call == "low_latency_dispatch" => {}
                other => panic!("expected the bad id at [9, 3], got {other:?}"),
            }
            assert_eq!((*p).code, ERR_NONE, "taking it clears the code");
            assert_eq!((*p).bad_key, 0, "and the key, so the next call's smallest position starts fresh");
            assert!(take_argument_at(p).is_none(), "reported once");
            assert_eq!(read_record_at(p), ErrorRecord::default());
            // A timeout is never taken by this path, and stays as it is.
            let timeout = ErrorRecord { code: ERR_TIMEOUT, rank: 0, phase: 4, channel: 2, peer: 1, detail: 0, waited_ns: 5_000_000_000, bad_key: 0 };
            *p = timeout;
            assert!(take_argument_at(p).is_none());
            assert_eq!(read_record_at(p), timeout);
            // A record still being written is read again until it settles (here never: the
            // reader gives up after 10 ms and reports it as it is).
            (*p).code = ERR_WRITING;
            let t = Instant::now();
            assert_eq!(read_record_at(p).code, ERR_WRITING);
            assert!(t.elapsed() >= Duration::from_millis(10));
        }
    }

    #[test]
    fn ranks_map_to_gpus_in_blocks_of_k() {
        // One rank per GPU: rank r on GPU r.
        assert_eq!((0..4).map(|r| device_for(r, r, 4, 1, 4).unwrap()).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        // 8 ranks, 4 per GPU, 2 GPUs: 0-3 on GPU 0, 4-7 on GPU 1.
        assert_eq!((0..8).map(|r| device_for(r, r, 8, 4, 2).unwrap()).collect::<Vec<_>>(), vec![0, 0, 0, 0, 1, 1, 1, 1]);
        // 8 ranks on one GPU.
        assert!((0..8).all(|r| device_for(r, r, 8, 8, 1).unwrap() == 0));
    }

    #[test]
    fn too_many_ranks_are_refused_with_the_fix() {
        // The default (one rank per GPU) keeps refusing a second rank on one GPU, on every rank.
        let e = device_for(0, 0, 2, 1, 1).unwrap_err().to_string();
        assert!(e.contains("only 1 GPU(s)") && e.contains("--ranks-per-gpu"), "{e}");
        let e = device_for(1, 1, 2, 1, 1).unwrap_err().to_string();
        assert!(e.contains("LOCAL_RANK=1"), "{e}");
        // 8 ranks at 2 per GPU need 4 GPUs: name the K that would fit.
        let e = device_for(0, 0, 8, 2, 2).unwrap_err().to_string();
        assert!(e.contains("need 4 GPU(s)") && e.contains("raise --ranks-per-gpu to 4"), "{e}");
    }

    #[test]
    fn sm_share_divides_the_gpu() {
        assert_eq!(sm_share(132, 1), 132);
        assert_eq!(sm_share(132, 2), 66);
        assert_eq!(sm_share(132, 8), 16);
        assert_eq!(sm_share(4, 8), 1);
        // Every rank's grid together fits the GPU.
        for k in 1..=16usize {
            assert!(sm_share(132, k) as usize * k <= 132, "k={k}");
        }
    }
}

