//! Receive arena: leases of regions inside a rank's own NVLink buffer.
//!
//! The intranode dispatch lets each receiving rank write its received rows straight into a
//! region it leases from a [`RecvArena`] that manages part of its own (IPC-mapped) NVLink
//! buffer. The tensors handed back to the user hold the [`ArenaLease`] (typically through an
//! `Arc`), so the region stays reserved while any of them is alive; dropping the last one drops
//! the lease, which returns the region to the arena.
//!
//! A region holds the received tensors at the offsets given by [`recv_sublayout`]. The arena
//! only deals in byte offsets: it never touches device memory, so it is plain host code that can
//! be tested without a GPU.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Alignment (bytes) of every arena region and of every tensor inside a region.
pub const RECV_ALIGN: usize = 512;

/// Largest multiple of [`RECV_ALIGN`] representable in `usize`; what saturating sizes clamp to.
const MAX_ALIGNED: usize = usize::MAX & !(RECV_ALIGN - 1);

/// Rounds `n` up to a multiple of [`RECV_ALIGN`], `None` on overflow.
fn checked_align_up(n: usize) -> Option<usize> {
    n.checked_add(RECV_ALIGN - 1).map(|v| v & !(RECV_ALIGN - 1))
}

/// Rounds `n` up to a multiple of [`RECV_ALIGN`], saturating at [`MAX_ALIGNED`].
fn saturating_align_up(n: usize) -> usize {
    checked_align_up(n).unwrap_or(MAX_ALIGNED)
}

/// Byte offsets of the received tensors inside one arena region, relative to the region start.
///
/// Computed by [`recv_sublayout`]; `bytes` is the size to [`RecvArena::lease`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecvSublayout {
    /// Offset of the received rows (`rows * row_bytes` bytes); always 0.
    pub x: usize,
    /// Offset of the received `f32` scales (`rows * num_scales * 4` bytes).
    pub scales: usize,
    /// Offset of the received `i64` top-k indices (`rows * num_topk * 8` bytes).
    pub topk_idx: usize,
    /// Offset of the received `f32` top-k weights (`rows * num_topk * 4` bytes).
    pub topk_w: usize,
    /// Total size of the region.
    pub bytes: usize,
}

/// Layout of a receive region for `rows` received rows of `row_bytes` bytes each, with
/// `num_scales` `f32` scales and `num_topk` top-k entries (`i64` index + `f32` weight) per row.
///
/// The tensors follow each other in the order x, scales, top-k indices, top-k weights, each
/// padded to a multiple of [`RECV_ALIGN`]:
///
/// ```text
/// x        = 0
/// scales   = align_up(rows * row_bytes, 512)
/// topk_idx = scales   + align_up(rows * num_scales * 4, 512)
/// topk_w   = topk_idx + align_up(rows * num_topk * 8, 512)
/// bytes    = topk_w   + align_up(rows * num_topk * 4, 512)
/// ```
///
/// This rule is mirrored by `ep_recv_sublayout` in `kernels/cuda/intranode.cuh`: the dispatch
/// kernels locate the tensors on the destination with it, so both must change together.
///
/// Sizes are computed with saturating arithmetic. Realistic inputs (`rows` up to `8 * 65536`,
/// `row_bytes` up to 65536) are far from overflow on a 64-bit host; absurd inputs saturate to a
/// size no arena can lease, so [`RecvArena::lease`] returns `None` for them.
pub fn recv_sublayout(
    rows: usize,
    row_bytes: usize,
    num_scales: usize,
    num_topk: usize,
) -> RecvSublayout {
    // Size of one tensor, padded; saturates instead of wrapping.
    let padded = |per_row: usize, elem_bytes: usize| {
        saturating_align_up(rows.saturating_mul(per_row).saturating_mul(elem_bytes))
    };
    // Sum of two aligned sizes, saturating at an aligned value.
    let add = |a: usize, b: usize| a.saturating_add(b).min(MAX_ALIGNED);
    let x = 0;
    let scales = padded(row_bytes, 1);
    let topk_idx = add(scales, padded(num_scales, 4));
    let topk_w = add(topk_idx, padded(num_topk, 8));
    let bytes = add(topk_w, padded(num_topk, 4));
    RecvSublayout {
        x,
        scales,
        topk_idx,
        topk_w,
        bytes,
    }
}

/// Mutable arena state, behind the mutex.
#[derive(Debug)]
struct ArenaState {
    /// Free ranges as `(offset, len)`, sorted by offset, non-empty, never overlapping nor
    /// adjacent (adjacent ranges are coalesced on free).
    free: Vec<(usize, usize)>,
    /// Number of live leases.
    outstanding: usize,
}

/// Shared part of an arena: what the handles and the leases point to.
#[derive(Debug)]
struct ArenaShared {
    start: usize,
    capacity: usize,
    state: Mutex<ArenaState>,
}

impl ArenaShared {
    /// Locks the state. A poisoned mutex is recovered: every critical section leaves the free
    /// list consistent before anything that could panic, so the data is still valid.
    fn lock(&self) -> MutexGuard<'_, ArenaState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// First-fit allocator of [`RECV_ALIGN`]-aligned byte ranges inside a fixed window
/// `[start, start + capacity)` of a rank's NVLink buffer.
///
/// The receiving side of the intranode dispatch leases one region per dispatch (sized by
/// [`recv_sublayout`]) and writes the received tensors into it; the region returns to the arena
/// when its [`ArenaLease`] drops. Handles are cheap to clone and share one state; leases keep
/// that state alive on their own, so they may outlive every `RecvArena` handle.
#[derive(Clone)]
pub struct RecvArena {
    shared: Arc<ArenaShared>,
}

impl RecvArena {
    /// An arena managing the byte offsets `[start, start + bytes)`, all free.
    ///
    /// `bytes` is rounded down to a multiple of [`RECV_ALIGN`] (this is [`capacity`]).
    ///
    /// # Panics
    ///
    /// If `start` is not a multiple of [`RECV_ALIGN`] or `start + bytes` overflows `usize`.
    ///
    /// [`capacity`]: RecvArena::capacity
    pub fn new(start: usize, bytes: usize) -> RecvArena {
        assert!(
            start % RECV_ALIGN == 0,
            "RecvArena start {start} is not a multiple of {RECV_ALIGN}"
        );
        assert!(
            start.checked_add(bytes).is_some(),
            "RecvArena window [{start}, {start} + {bytes}) overflows usize"
        );
        let capacity = bytes & !(RECV_ALIGN - 1);
        let free = if capacity == 0 {
            Vec::new()
        } else {
            vec![(start, capacity)]
        };
        RecvArena {
            shared: Arc::new(ArenaShared {
                start,
                capacity,
                state: Mutex::new(ArenaState {
                    free,
                    outstanding: 0,
                }),
            }),
        }
    }

    /// Leases `bytes` bytes (rounded up to a multiple of [`RECV_ALIGN`]) from the lowest free
    /// range large enough (first fit).
    ///
    /// Returns `None` when `bytes == 0` or no free range is large enough; never panics.
    pub fn lease(&self, bytes: usize) -> Option<ArenaLease> {
        if bytes == 0 {
            return None;
        }
        let size = checked_align_up(bytes)?;
        let mut state = self.shared.lock();
        let idx = state.free.iter().position(|&(_, len)| len >= size)?;
        let (offset, len) = state.free[idx];
        if len == size {
            state.free.remove(idx);
        } else {
            state.free[idx] = (offset + size, len - size);
        }
        state.outstanding += 1;
        drop(state);
        Some(ArenaLease {
            shared: Arc::clone(&self.shared),
            offset,
            bytes: size,
        })
    }

    /// Bytes currently free (not necessarily contiguous).
    pub fn free_bytes(&self) -> usize {
        self.shared.lock().free.iter().map(|&(_, len)| len).sum()
    }

    /// Bytes managed by the arena (the `bytes` given to [`RecvArena::new`], rounded down to a
    /// multiple of [`RECV_ALIGN`]).
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// Number of live leases.
    pub fn outstanding(&self) -> usize {
        self.shared.lock().outstanding
    }
}

impl fmt::Debug for RecvArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("RecvArena")
            .field("start", &self.shared.start)
            .field("capacity", &self.shared.capacity)
            .field("free", &state.free)
            .field("outstanding", &state.outstanding)
            .finish()
    }
}

/// A region `[offset, offset + bytes)` leased from a [`RecvArena`]; dropping it returns the
/// region to the arena (coalescing it with adjacent free ranges).
///
/// The received tensors of one dispatch share one lease (e.g. through an `Arc<ArenaLease>`), so
/// the region is reused only after the last of them is gone. It may be dropped on any thread.
#[must_use = "the region returns to the arena as soon as the lease is dropped"]
pub struct ArenaLease {
    shared: Arc<ArenaShared>,
    offset: usize,
    bytes: usize,
}

impl ArenaLease {
    /// Absolute byte offset of the region in the buffer (at least the arena's `start`), a
    /// multiple of [`RECV_ALIGN`].
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Size of the region in bytes: the requested size rounded up to [`RECV_ALIGN`].
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl fmt::Debug for ArenaLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaLease")
            .field("offset", &self.offset)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for ArenaLease {
    fn drop(&mut self) {
        let (offset, len) = (self.offset, self.bytes);
        let end = offset + len;
        let mut state = self.shared.lock();
        let free = &mut state.free;
        // Index of the first free range after this one.
        let idx = free.partition_point(|&(o, _)| o < offset);
        debug_assert!(idx == 0 || free[idx - 1].0 + free[idx - 1].1 <= offset);
        debug_assert!(idx == free.len() || end <= free[idx].0);
        let merge_prev = idx > 0 && free[idx - 1].0 + free[idx - 1].1 == offset;
        let merge_next = idx < free.len() && free[idx].0 == end;
        match (merge_prev, merge_next) {
            (true, true) => {
                let (_, next_len) = free.remove(idx);
                free[idx - 1].1 += len + next_len;
            }
            (true, false) => free[idx - 1].1 += len,
            (false, true) => free[idx] = (offset, free[idx].1 + len),
            (false, false) => free.insert(idx, (offset, len)),
        }
        state.outstanding -= 1;
    }
}

// The lease travels with the Python tensors, which may be dropped on any thread.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<RecvArena>();
    assert_send_sync::<ArenaLease>();
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks the invariant of every sublayout: aligned, ordered, large enough.
    fn check_aligned(l: &RecvSublayout) {
        for off in [l.x, l.scales, l.topk_idx, l.topk_w, l.bytes] {
            assert_eq!(off % RECV_ALIGN, 0, "{l:?}");
        }
        assert!(l.x <= l.scales && l.scales <= l.topk_idx);
        assert!(l.topk_idx <= l.topk_w && l.topk_w <= l.bytes);
    }

    #[test]
    fn sublayout_bf16() {
        // 8160 rows of 7168 BF16 = 14336 bytes; no scales; 8 top-k.
        let l = recv_sublayout(8160, 14336, 0, 8);
        check_aligned(&l);
        // x: 8160 * 14336 = 116_981_760 (= 228_480 * 512).
        // scales: 0 bytes. topk_idx: 8160 * 8 * 8 = 522_240. topk_w: 8160 * 8 * 4 = 261_120.
        assert_eq!(
            l,
            RecvSublayout {
                x: 0,
                scales: 116_981_760,
                topk_idx: 116_981_760,
                topk_w: 117_504_000,
                bytes: 117_765_120,
            }
        );
    }

    #[test]
    fn sublayout_fp8() {
        // 8160 rows of 7168 FP8 bytes; 56 f32 scales; 8 top-k.
        let l = recv_sublayout(8160, 7168, 56, 8);
        check_aligned(&l);
        // x: 8160 * 7168 = 58_490_880. scales: 8160 * 56 * 4 = 1_827_840.
        // topk_idx: 522_240. topk_w: 261_120.
        assert_eq!(
            l,
            RecvSublayout {
                x: 0,
                scales: 58_490_880,
                topk_idx: 60_318_720,
                topk_w: 60_840_960,
                bytes: 61_102_080,
            }
        );
    }

    #[test]
    fn sublayout_pads_each_tensor() {
        // x: 300 -> 512; scales: 12 -> 512; topk_idx: 72 -> 512; topk_w: 36 -> 512.
        let l = recv_sublayout(3, 100, 1, 3);
        check_aligned(&l);
        assert_eq!(
            (l.x, l.scales, l.topk_idx, l.topk_w, l.bytes),
            (0, 512, 1024, 1536, 2048)
        );
        // Nothing received: an empty region (the arena refuses to lease 0 bytes).
        assert_eq!(recv_sublayout(0, 14336, 56, 8).bytes, 0);
        // Largest supported case does not saturate.
        let big = recv_sublayout(8 * 65536, 65536, 65536 / 128, 8);
        check_aligned(&big);
        assert_eq!(big.scales, 8 * 65536 * 65536);
        // Absurd sizes saturate instead of wrapping, and cannot be leased.
        let huge = recv_sublayout(usize::MAX, 2, 1, 1);
        check_aligned(&huge);
        assert_eq!(huge.bytes, MAX_ALIGNED);
        assert!(RecvArena::new(0, 1 << 20).lease(huge.bytes).is_none());
    }

    #[test]
    fn new_rounds_capacity_down() {
        let a = RecvArena::new(1024, 5 * RECV_ALIGN + 100);
        assert_eq!(a.capacity(), 5 * RECV_ALIGN);
        assert_eq!(a.free_bytes(), 5 * RECV_ALIGN);
        assert_eq!(a.outstanding(), 0);
        let tiny = RecvArena::new(0, RECV_ALIGN - 1);
        assert_eq!(tiny.capacity(), 0);
        assert!(tiny.lease(1).is_none());
    }

    #[test]
    #[should_panic(expected = "not a multiple")]
    fn new_rejects_unaligned_start() {
        let _ = RecvArena::new(100, 4096);
    }

    #[test]
    fn lease_free_coalesce() {
        let start = 8 * RECV_ALIGN;
        let arena = RecvArena::new(start, 16 * RECV_ALIGN);
        let a = arena.lease(1000).unwrap(); // 2 granules
        let b = arena.lease(3 * RECV_ALIGN).unwrap(); // 3 granules
        let c = arena.lease(1).unwrap(); // 1 granule
        assert_eq!((a.offset(), a.bytes()), (start, 2 * RECV_ALIGN));
        assert_eq!(
            (b.offset(), b.bytes()),
            (start + 2 * RECV_ALIGN, 3 * RECV_ALIGN)
        );
        assert_eq!(
            (c.offset(), c.bytes()),
            (start + 5 * RECV_ALIGN, RECV_ALIGN)
        );
        assert_eq!(arena.outstanding(), 3);
        assert_eq!(arena.free_bytes(), 10 * RECV_ALIGN);

        let (a_off, ab_bytes) = (a.offset(), a.bytes() + b.bytes());
        drop(b);
        drop(a);
        assert_eq!(arena.outstanding(), 1);
        assert_eq!(arena.free_bytes(), 15 * RECV_ALIGN);
        // A and B coalesced into one range at A's offset, which first fit picks.
        let ab = arena.lease(ab_bytes).unwrap();
        assert_eq!((ab.offset(), ab.bytes()), (a_off, ab_bytes));

        // Free everything: one range again, the whole capacity is leasable.
        drop(c);
        drop(ab);
        assert_eq!(arena.free_bytes(), arena.capacity());
        let all = arena.lease(arena.capacity()).unwrap();
        assert_eq!(all.offset(), start);
    }

    #[test]
    fn coalesce_with_next_only() {
        let arena = RecvArena::new(0, 4 * RECV_ALIGN);
        let a = arena.lease(RECV_ALIGN).unwrap();
        let b = arena.lease(RECV_ALIGN).unwrap();
        // Free list: [2, 4). Dropping B merges with the following range only.
        drop(b);
        assert!(arena.lease(4 * RECV_ALIGN).is_none());
        let rest = arena.lease(3 * RECV_ALIGN).unwrap();
        assert_eq!(rest.offset(), RECV_ALIGN);
        drop(a);
    }

    #[test]
    fn full_arena_returns_none() {
        let arena = RecvArena::new(0, 4 * RECV_ALIGN);
        assert!(arena.lease(4 * RECV_ALIGN + 1).is_none());
        let all = arena.lease(4 * RECV_ALIGN).unwrap();
        assert_eq!(arena.free_bytes(), 0);
        assert!(arena.lease(1).is_none());
        assert_eq!(arena.outstanding(), 1);
        drop(all);
        assert!(arena.lease(1).is_some());
    }

    #[test]
    fn zero_and_overflowing_sizes_return_none() {
        let arena = RecvArena::new(0, 4 * RECV_ALIGN);
        assert!(arena.lease(0).is_none());
        assert!(arena.lease(usize::MAX).is_none());
        assert!(arena.lease(usize::MAX - RECV_ALIGN).is_none());
        assert_eq!(arena.outstanding(), 0);
        assert_eq!(arena.free_bytes(), arena.capacity());
    }

    /// Lowest granule index of a run of `n` free granules, if any (first fit on the bitmap).
    fn first_fit(used: &[bool], n: usize) -> Option<usize> {
        let mut run = 0;
        for (i, &u) in used.iter().enumerate() {
            run = if u { 0 } else { run + 1 };
            if run == n {
                return Some(i + 1 - n);
            }
        }
        None
    }

    #[test]
    fn randomized_leases_never_overlap() {
        // Deterministic LCG (Knuth's MMIX constants); top bits are the best ones.
        let mut seed: u64 = 0x5eed_1234_abcd_0001;
        let mut next = move |bound: usize| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 33) as usize) % bound
        };

        let start = 3 * RECV_ALIGN;
        let granules = 64;
        let arena = RecvArena::new(start, granules * RECV_ALIGN + 7);
        let mut used = vec![false; granules];
        let mut live: Vec<ArenaLease> = Vec::new();
        let (mut hits, mut misses) = (0, 0);

        for _ in 0..20_000 {
            if live.is_empty() || next(100) < 55 {
                let req = next(12 * RECV_ALIGN + 1); // 0 ..= 12 granules, mostly unaligned
                let n = req.div_ceil(RECV_ALIGN);
                let expected = if req == 0 { None } else { first_fit(&used, n) };
                match arena.lease(req) {
                    Some(l) => {
                        hits += 1;
                        assert_eq!(l.bytes(), n * RECV_ALIGN);
                        assert_eq!(l.offset() % RECV_ALIGN, 0);
                        assert!(l.offset() >= start);
                        let g = (l.offset() - start) / RECV_ALIGN;
                        assert!(g + n <= granules, "lease past the end");
                        assert_eq!(Some(g), expected, "not the first fit");
                        for u in &mut used[g..g + n] {
                            assert!(!*u, "overlapping lease at granule {g}");
                            *u = true;
                        }
                        live.push(l);
                    }
                    None => {
                        misses += 1;
                        assert_eq!(expected, None, "refused a request that fits");
                    }
                }
            } else {
                let l = live.swap_remove(next(live.len()));
                let g = (l.offset() - start) / RECV_ALIGN;
                let n = l.bytes() / RECV_ALIGN;
                for u in &mut used[g..g + n] {
                    assert!(*u);
                    *u = false;
                }
                drop(l);
            }
            let used_bytes = used.iter().filter(|&&u| u).count() * RECV_ALIGN;
            assert_eq!(arena.free_bytes(), arena.capacity() - used_bytes);
            assert_eq!(arena.outstanding(), live.len());
        }
        // Both outcomes were exercised.
        assert!(hits > 1000 && misses > 100, "hits {hits} misses {misses}");

        live.clear();
        assert_eq!(arena.free_bytes(), arena.capacity());
        assert_eq!(arena.outstanding(), 0);
        // Fully coalesced: the whole window is one range again.
        assert_eq!(arena.lease(arena.capacity()).unwrap().offset(), start);
    }

    #[test]
    fn leases_dropped_on_another_thread() {
        let arena = RecvArena::new(RECV_ALIGN, 32 * RECV_ALIGN);
        let leases: Vec<ArenaLease> = (1..=4)
            .map(|k| arena.lease(k * RECV_ALIGN).unwrap())
            .collect();
        assert_eq!(arena.free_bytes(), 22 * RECV_ALIGN);
        // Dropped on other threads, while the arena handle is cloned and used concurrently.
        let handles: Vec<_> = leases
            .into_iter()
            .map(|l| {
                let arena = arena.clone();
                std::thread::spawn(move || {
                    let extra = arena.lease(RECV_ALIGN);
                    drop(l);
                    drop(extra);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(arena.outstanding(), 0);
        assert_eq!(arena.free_bytes(), arena.capacity());
        assert_eq!(arena.lease(arena.capacity()).unwrap().offset(), RECV_ALIGN);
    }

    #[test]
    fn lease_outlives_arena_handle() {
        let arena = RecvArena::new(0, 4 * RECV_ALIGN);
        let lease = arena.lease(RECV_ALIGN).unwrap();
        let other = arena.clone();
        drop(arena);
        drop(lease);
        assert_eq!(other.free_bytes(), other.capacity());
    }

    #[test]
    fn poisoned_mutex_does_not_panic_in_drop() {
        let arena = RecvArena::new(0, 4 * RECV_ALIGN);
        let lease = arena.lease(RECV_ALIGN).unwrap();
        let shared = Arc::clone(&arena.shared);
        let poisoner = std::thread::spawn(move || {
            let _guard = shared.state.lock().unwrap();
            panic!("poison the arena mutex (expected in this test)");
        });
        assert!(poisoner.join().is_err());
        assert!(arena.shared.state.is_poisoned());
        drop(lease);
        assert_eq!(arena.outstanding(), 0);
        assert_eq!(arena.free_bytes(), arena.capacity());
        assert!(arena.lease(RECV_ALIGN).is_some());
    }
}
