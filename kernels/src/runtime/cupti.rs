//! Kernel time as DeepEP measures it: GPU start/end timestamps of the kernels themselves, from
//! CUPTI's activity API (DeepEP's benchmarks read the same timestamps through the PyTorch
//! profiler). CUDA events around a launch also count the launch and event overhead (the bench
//! prints it as the "timing floor", ~4 µs on H200), which matters for the ~20 µs low-latency ops.
//!
//! `libcupti.so` is loaded at run time: `DEEPEP_CUPTI_LIB` (a path), else `libcupti.so.13`,
//! `libcupti.so.12`, `libcupti.so` from the loader path (the `nvidia-cuda-cupti` wheel ships
//! `nvidia/cu13/lib/libcupti.so.13`; `kernels/scripts/gpu-sweep.sh` finds it).
//! `DEEPEP_CUPTI=0` turns it off. Without CUPTI the kernel-time columns are simply absent.
//!
//! Only two record kinds are enabled: `CONCURRENT_KERNEL` (does not serialise kernels) and
//! `MEMSET` (to find the L2-flush memsets that separate repetitions). Both record layouts keep
//! `start` at byte 16 and `end` at byte 24 in every CUPTI version since 10.

use crate::error::{EpError, Result};
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

const KIND_MEMSET: u32 = 2;
const KIND_CONCURRENT_KERNEL: u32 = 10;
const FLUSH_FORCED: u32 = 1;
const BUFFER_BYTES: usize = 4 << 20;
const RECORD_ALIGN: usize = 8;

type FnKind = unsafe extern "C" fn(u32) -> i32;
type FnRequest = extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
type FnComplete = extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);
type FnRegister = unsafe extern "C" fn(FnRequest, FnComplete) -> i32;
type FnFlush = unsafe extern "C" fn(u32) -> i32;
type FnNext = unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> i32;

/// One activity record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    pub kind: ActivityKind,
    /// GPU timestamps, nanoseconds.
    pub start: u64,
    pub end: u64,
    /// Memsets: bytes written (0 for kernels).
    pub bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivityKind {
    Kernel,
    Memset,
}

/// The loaded CUPTI activity API.
pub struct KernelTimer {
    _lib: libloading::Library,
    enable: FnKind,
    disable: FnKind,
    flush: FnFlush,
    /// Serialises measurement windows (records are collected process-wide).
    window: Mutex<()>,
}

static NEXT_RECORD: OnceLock<FnNext> = OnceLock::new();
static RECORDS: Mutex<Vec<Activity>> = Mutex::new(Vec::new());
static TIMER: OnceLock<std::result::Result<KernelTimer, String>> = OnceLock::new();

extern "C" fn buffer_requested(buf: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: CUPTI passes valid out-pointers; the layout is non-zero-sized.
    unsafe {
        let p = std::alloc::alloc(std::alloc::Layout::from_size_align_unchecked(BUFFER_BYTES, RECORD_ALIGN));
        *buf = p;
        *size = if p.is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

extern "C" fn buffer_completed(_ctx: *mut c_void, _stream: u32, buf: *mut u8, _size: usize, valid: usize) {
    if buf.is_null() {
        return;
    }
    if let Some(next) = NEXT_RECORD.get() {
        let mut out = RECORDS.lock().unwrap_or_else(|e| e.into_inner());
        let mut rec: *mut u8 = std::ptr::null_mut();
        // SAFETY: CUPTI fills `buf` with `valid` bytes of records; each record is at least 32
        // bytes for the two kinds we read.
        unsafe {
            while next(buf, valid, &mut rec) == 0 && !rec.is_null() {
                if let Some(a) = parse_record(std::slice::from_raw_parts(rec, 32)) {
                    out.push(a);
                }
            }
        }
    }
    // SAFETY: allocated by buffer_requested with this layout.
    unsafe { std::alloc::dealloc(buf, std::alloc::Layout::from_size_align_unchecked(BUFFER_BYTES, RECORD_ALIGN)) };
}

/// Decode the common prefix of a kernel or memset record (other kinds: `None`).
pub fn parse_record(r: &[u8]) -> Option<Activity> {
    let u32_at = |o: usize| u32::from_le_bytes(r[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(r[o..o + 8].try_into().unwrap());
    let kind = match u32_at(0) {
        KIND_CONCURRENT_KERNEL => ActivityKind::Kernel,
        KIND_MEMSET => ActivityKind::Memset,
        _ => return None,
    };
    let bytes = if kind == ActivityKind::Memset { u64_at(8) } else { 0 };
    Some(Activity { kind, start: u64_at(16), end: u64_at(24), bytes })
}

fn load() -> std::result::Result<KernelTimer, String> {
    if std::env::var("DEEPEP_CUPTI").is_ok_and(|v| v == "0") {
        return Err("disabled by DEEPEP_CUPTI=0".into());
    }
    let names: Vec<String> = match std::env::var("DEEPEP_CUPTI_LIB") {
        Ok(p) if !p.is_empty() => vec![p],
        _ => ["libcupti.so.13", "libcupti.so.12", "libcupti.so"].iter().map(|s| s.to_string()).collect(),
    };
    let mut errs = Vec::new();
    for n in &names {
        // SAFETY: loading CUPTI runs no initialisers with preconditions.
        match unsafe { libloading::Library::new(n) } {
            Ok(lib) => return bind(lib).map_err(|e| format!("{n}: {e}")),
            Err(e) => errs.push(format!("{n}: {e}")),
        }
    }
    Err(format!("CUPTI not found ({}); set DEEPEP_CUPTI_LIB=<path to libcupti.so.13>", errs.join("; ")))
}

fn bind(lib: libloading::Library) -> std::result::Result<KernelTimer, String> {
    // SAFETY: signatures as declared in cupti_activity.h (CUDA 12/13).
    unsafe {
        let sym = |name: &[u8]| -> std::result::Result<*const c_void, String> {
            lib.get::<*const c_void>(name).map(|s| *s).map_err(|e| e.to_string())
        };
        let enable: FnKind = std::mem::transmute(sym(b"cuptiActivityEnable\0")?);
        let disable: FnKind = std::mem::transmute(sym(b"cuptiActivityDisable\0")?);
        let flush: FnFlush = std::mem::transmute(sym(b"cuptiActivityFlushAll\0")?);
        let next: FnNext = std::mem::transmute(sym(b"cuptiActivityGetNextRecord\0")?);
        let register: FnRegister = std::mem::transmute(sym(b"cuptiActivityRegisterCallbacks\0")?);
        let _ = NEXT_RECORD.set(next);
        let rc = register(buffer_requested, buffer_completed);
        if rc != 0 {
            return Err(format!("cuptiActivityRegisterCallbacks returned {rc}"));
        }
        Ok(KernelTimer { _lib: lib, enable, disable, flush, window: Mutex::new(()) })
    }
}

/// The process-wide kernel timer, or why there is none (loaded once).
pub fn kernel_timer() -> std::result::Result<&'static KernelTimer, &'static str> {
    TIMER.get_or_init(load).as_ref().map_err(|e| e.as_str())
}

impl KernelTimer {
    /// Record the activities of everything `work` enqueues and waits for. `work` must finish its
    /// GPU work (synchronise) before returning.
    pub fn record(&self, work: impl FnOnce() -> Result<()>) -> Result<Vec<Activity>> {
        let _w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let cupti = |what: &str, rc: i32| {
            if rc == 0 {
                Ok(())
            } else {
                Err(EpError::Unsupported(format!("CUPTI {what} returned {rc}")))
            }
        };
        // SAFETY: plain CUPTI calls.
        unsafe {
            (self.flush)(FLUSH_FORCED);
        }
        RECORDS.lock().unwrap_or_else(|e| e.into_inner()).clear();
        // SAFETY: as above.
        unsafe {
            cupti("cuptiActivityEnable(CONCURRENT_KERNEL)", (self.enable)(KIND_CONCURRENT_KERNEL))?;
            cupti("cuptiActivityEnable(MEMSET)", (self.enable)(KIND_MEMSET))?;
        }
        let r = work();
        // SAFETY: as above.
        unsafe {
            (self.disable)(KIND_CONCURRENT_KERNEL);
            (self.disable)(KIND_MEMSET);
            cupti("cuptiActivityFlushAll", (self.flush)(FLUSH_FORCED))?;
        }
        r?;
        Ok(std::mem::take(&mut *RECORDS.lock().unwrap_or_else(|e| e.into_inner())))
    }
}

/// Split `acts` into repetitions at the L2-flush memsets (those of exactly `flush_bytes`) and
/// return, per repetition, the span from the first kernel start to the last kernel end in
/// microseconds. `None` unless exactly `reps` repetitions each contain a kernel.
pub fn spans_per_rep(acts: &[Activity], flush_bytes: u64, reps: usize) -> Option<Vec<f64>> {
    let mut v: Vec<&Activity> = acts.iter().collect();
    v.sort_by_key(|a| a.start);
    let mut spans: Vec<Option<(u64, u64)>> = Vec::new();
    for a in v {
        match a.kind {
            ActivityKind::Memset if a.bytes == flush_bytes => spans.push(None),
            ActivityKind::Kernel => {
                let cur = spans.last_mut()?; // a kernel before the first flush: not ours
                *cur = Some(match *cur {
                    None => (a.start, a.end),
                    Some((s, e)) => (s.min(a.start), e.max(a.end)),
                });
            }
            ActivityKind::Memset => {}
        }
    }
    if spans.len() != reps {
        return None;
    }
    spans.into_iter().map(|s| s.map(|(s, e)| e.saturating_sub(s) as f64 / 1e3)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kind: u32, bytes: u64, start: u64, end: u64) -> Vec<u8> {
        let mut r = vec![0u8; 32];
        r[0..4].copy_from_slice(&kind.to_le_bytes());
        r[8..16].copy_from_slice(&bytes.to_le_bytes());
        r[16..24].copy_from_slice(&start.to_le_bytes());
        r[24..32].copy_from_slice(&end.to_le_bytes());
        r
    }

    #[test]
    fn records_decode_and_split_at_flushes() {
        let f = 1 << 27;
        let acts: Vec<Activity> = [
            rec(KIND_MEMSET, f, 0, 100),
            rec(KIND_CONCURRENT_KERNEL, 0, 110, 150),
            rec(KIND_MEMSET, 64, 150, 155), // the op's own small memset
            rec(KIND_CONCURRENT_KERNEL, 0, 160, 400),
            rec(KIND_MEMSET, f, 500, 600),
            rec(KIND_CONCURRENT_KERNEL, 0, 1600, 2100),
            rec(1, 0, 0, 0), // memcpy: ignored
        ]
        .iter()
        .filter_map(|r| parse_record(r))
        .collect();
        assert_eq!(acts.len(), 6);
        assert_eq!(acts[2], Activity { kind: ActivityKind::Memset, start: 150, end: 155, bytes: 64 });
        assert_eq!(spans_per_rep(&acts, f, 2), Some(vec![0.29, 0.5]));
        assert_eq!(spans_per_rep(&acts, f, 3), None);
        // a repetition without a kernel is not a measurement
        let mut no_kernel = acts.clone();
        no_kernel.retain(|a| a.start < 1000);
        assert_eq!(spans_per_rep(&no_kernel, f, 2), None);
    }

    /// The pip wheel's libcupti resolves every symbol we bind (CPU only: nothing is enabled).
    /// Skips when no libcupti is installed here (`DEEPEP_CUPTI_LIB` names one explicitly).
    #[test]
    fn binds_against_libcupti_when_present() {
        let Ok(path) = std::env::var("DEEPEP_CUPTI_LIB") else {
            eprintln!("skipped: DEEPEP_CUPTI_LIB not set");
            return;
        };
        // SAFETY: loading the library only.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        assert!(bind(lib).is_ok());
    }
}
