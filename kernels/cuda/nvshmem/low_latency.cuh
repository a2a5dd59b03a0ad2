// Low-latency (LL) dispatch / combine: argument structs shared with the Rust host
// (`kernels/src/low_latency/mod.rs` mirrors them field by field, with size asserts).
//
// Design (see docs/nvshmem.md, "Low-latency kernels"):
// - One symmetric buffer per rank, split into two halves for dispatch and two for combine; the
//   host alternates halves per call of each kind (at most two results alive, as in DeepEP).
// - No signal ever needs cleaning: every flag is a u64 tagged with the per-half call number
//   `seq` (high 32 bits) and a payload (low 32 bits). `seq` is kept per block in an "epoch" word
//   of the half, so replaying a captured CUDA graph keeps counting correctly.
// - Dispatch writes every selection straight into its final packed slot on the owner: each
//   source broadcasts its per-expert counts first; the owner d packs sources in the order
//   d, d+1, ..., d-1 (itself first, so its own rows need no wait), and a remote source waits only
//   for the counts of the sources before it (which includes the owner: a peer never writes into
//   a half before its owner has started the call that uses it). The receiver never copies rows;
//   it only waits for per-(expert, source) done flags, writes counts / layout ranges and
//   transposes the FP8 scales (staged contiguously per row by the sender) into the column-major
//   output.
// - Combine sends each remote expert row back to `comb_recv[token][topk slot]` on the origin;
//   rows of experts owned by the origin itself are read in place from the caller's `y`. Every
//   origin announces "combine started" (ready flag); when an earlier combine deferred its receive
//   half (hook), owners wait for it before writing, so a deferred receive is never overwritten.
// - NVLink peers (nvshmem_ptr != 0) get plain 16-byte stores + st.release.sys flags; other peers
//   get nvshmemx_putmem_warp from a per-warp staging slot + quiet + nvshmemx_signal_op.
#pragma once
#include <stdint.h>

#define LL_PHASE_SEND 1
#define LL_PHASE_RECV 2

#define LL_THREADS 512
#define LL_WARPS (LL_THREADS / 32)
// Channels per dispatch work unit (FP8: 4 iterations of 256 channels; 8 scale groups).
#define LL_DISPATCH_SEG 1024
// Bytes per combine-send work unit (bf16: 1024 channels).
#define LL_COMBINE_SEG_BYTES 2048
// Channels per combine-reduce work unit (one iteration: 32 lanes x 8 channels).
#define LL_REDUCE_SEG 256
// Largest top-k (contract: <= 11 for LL).
#define LL_MAX_TOPK 11
// Per-warp staging slot for the non-NVLink (NVSHMEM put) path: one unit of data + its scales.
#define LL_STAGE_BYTES (LL_COMBINE_SEG_BYTES + 64)

// Combine phase timestamps (%globaltimer ns; `trace` argument, decoded into a `trace::PhaseTrace` by `LowLatencyBuffer::last_trace`).
#define LL_TRACE_START 0         // first block entered the kernel (minimum)
#define LL_TRACE_SENT 1          // last block finished its send / owner units (maximum)
#define LL_TRACE_LOCAL 2         // last warp finished the origin's own-expert terms (maximum)
#define LL_TRACE_WAITED_FIRST 3  // first warp saw every peer's data (minimum)
#define LL_TRACE_WAITED 4        // last warp saw every peer's data (maximum)
#define LL_TRACE_END 5           // last warp finished (maximum)
// Dispatch v2 uses: START, SENT (last block flagged its tokens), WAITED_FIRST / WAITED (first /
// last block saw every source's flags), LOCAL (last block binned and wrote its layout), END.
#define LL_TRACE_SLOTS 8

// Byte offsets below are relative to the symmetric buffer base and already point into the half
// selected by the host for this call.
struct LlDispatchArgs {
    const void* x;             // bf16 [N][H]
    const int64_t* topk_idx;   // [N][K]
    uint8_t* buf;              // local base of the symmetric buffer
    const uint64_t* peer_base; // [R] nvshmem_ptr(buf, r) or 0 when r is not load/store reachable
    uint64_t off_x;            // [L][R*NM][row_bytes]   packed_recv_x
    uint64_t off_scale_stage;  // [L][R*NM][S] f32       scale_inv per row, as sent
    uint64_t off_scales;       // [L][S][R*NM] f32 or [L][S/4][R*NM] i32 (ue8m0)
    uint64_t off_src_info;     // [L][R*NM] i32
    uint64_t off_src_k;        // [L][R*NM] i32   top-k slot of the selection at its source
    uint64_t off_layout_range; // [L][R] i64
    uint64_t off_recv_count;   // [L] i32
    uint64_t off_count_sig;    // [E][R] u64 tagged counts (broadcast by every source)
    uint64_t off_done_sig;     // [L][R] u64 tagged counts (rows of (expert, source) written)
    uint64_t off_epoch;        // [G] u32 per-block call counter of this half
    uint64_t off_send_slot;    // [NM][LL_MAX_TOPK] i32 slot of each own selection at its owner
    uint64_t off_stage;        // [G*LL_WARPS][LL_STAGE_BYTES] (not per half)
    int32_t num_tokens, hidden, num_topk, num_experts;
    int32_t num_ranks, rank, num_max, phases;
    int32_t use_fp8, round_scale, use_ue8m0, experts_per_block;
};

struct LlCombineArgs {
    const void* y;               // bf16 [L][R*NM][H]
    const int64_t* topk_idx;     // [N][K] (the origin's, as passed to dispatch)
    const float* topk_weights;   // [N][K]
    void* out;                   // bf16 [N][H]
    uint8_t* buf;
    const uint64_t* peer_base;
    // Handle: regions of the dispatch that produced `y`'s layout, relative to `hbuf`: `buf` (its
    // dispatch half) or the handle's own copy of them, made before a later dispatch reused the half.
    const uint8_t* hbuf;
    uint64_t off_src_info, off_src_k, off_layout_range, off_recv_count, off_send_slot;
    // Combine half.
    uint64_t off_comb_recv;      // [NM][LL_MAX_TOPK][H] bf16
    uint64_t off_comb_done;      // [R][G] u64 tagged (owner rank, owner block)
    uint64_t off_comb_ready;     // [R] u64 tagged: origin r has started this combine
    uint64_t off_epoch;          // [G] u32
    uint64_t off_stage;
    int32_t num_tokens, hidden, num_topk, num_experts;
    int32_t num_ranks, rank, num_max, phases;
    int32_t local_experts_per_block;
    int32_t wait_ready;          // 1: wait for each origin's ready flag before sending to it
                                 // (needed when a previous combine deferred its receive hook)
    uint64_t trace;              // 0, or u64[LL_TRACE_SLOTS] phase timestamps (bench diagnostics)
};

// ---- dispatch v2: one copy per (token, destination rank) ------------------------------------
// The sender casts each token once and writes it (data, scales, its top-k ids) into the token
// staging area `tok_stage[src][token]` of every rank that owns one of its experts (its own rank
// included); a per-block flag per destination carries the token count. The receiver, once every
// block of every source has flagged, bins the staged top-k ids of its experts, packs sources in
// ascending rank order and copies rows locally into the packed output. Remote traffic: one row
// per (token, remote rank) instead of one per (token, expert). No count exchange: every layout
// decision is local to the receiver.
#define LL_COPY_SEG_BYTES 2048
// Copy units (2 KiB of a row) a receiving warp has in flight at once.
#define LL_COPY_BATCH 3

struct LlDispatch2Args {
    const void* x;             // bf16 [N][H]
    const int64_t* topk_idx;   // [N][K]
    uint8_t* buf;
    const uint64_t* peer_base;
    uint64_t off_x, off_scales, off_src_info, off_src_k, off_layout_range, off_recv_count;
    uint64_t off_epoch, off_send_slot;
    uint64_t off_tok_stage;    // [R][NM][stage_stride]: data @0, f32 scales @2H, i32 top-k @tk_off
    uint64_t off_tok_flags;    // [R][G] u64 tagged (source rank, source block), payload = source's N
    uint64_t off_ready;        // [R] u64 tagged: rank r has started this dispatch
    uint64_t off_tok_slot;     // [R][NM][LL_MAX_TOPK] i32 packed row (local expert * R*NM + slot) of
                               // (source, token, k), -1 when the expert is held elsewhere (or k unused)
    uint64_t off_ntok;         // [R] i32 tokens of each source
    uint64_t off_stage;        // per-warp put staging (not per half)
    int32_t num_tokens, hidden, num_topk, num_experts;
    int32_t num_ranks, rank, num_max, phases;
    int32_t use_fp8, round_scale, use_ue8m0, wait_ready;
    int32_t stage_stride, tk_off;
    uint64_t trace;            // 0, or u64[LL_TRACE_SLOTS] phase timestamps (bench diagnostics)
};

// ---- combine v3 (and the retired v2): owners pre-reduce ---------------------------------------
// Every origin first ships its top-k weights to every other rank (block 0) with a flag (which
// also says "this origin has started the call"). Each owner then sums, per (origin token), the
// weighted rows of the experts it holds in f32 and writes one f32 partial row per (token, owner)
// into the origin's `part[token][owner]`; the origin adds its own experts' terms (read in place)
// and the partials, and rounds to bf16 once. Needs a v2 dispatch handle (tok_slot: the packed row of
// each (origin, token, k) held here; ntok; send_slot).
// Combine v3 (`ll_combine3_*`, the default) takes the same arguments and buffers; its owners
// start loading rows at once and acquire each origin's weights flag per warp just before the FMAs
// (the retired v2, whose entry points are gone, waited for every origin's weights before any load).
// Both: with both halves in one launch, warps [0, owner_warps) of a block do the owner work while
// the others do the origin work concurrently; a warp loads the routing of a batch of units (token,
// 256 channels) at once, lane-parallel, into shared memory; origins keep the own-expert terms of
// up to LL_ORIGIN_BATCH units in dynamic shared memory until the owners' flags arrive. Lanes own
// channels 4*lane..+3 and 128+4*lane..+3 of a unit, so each f32 store covers 512 contiguous bytes.
struct LlCombine2Args {
    const void* y;
    const int64_t* topk_idx;
    const float* topk_weights;
    void* out;
    uint8_t* buf;
    const uint64_t* peer_base;
    // Handle, relative to `hbuf` (`buf`, or the handle's own copy, as for LlCombineArgs): regions
    // written only by this rank's own dispatch kernel, so a copy made in stream order before the
    // next dispatch into the half is complete.
    const uint8_t* hbuf;
    uint64_t off_send_slot, off_tok_slot, off_ntok;
    uint64_t off_part;      // [NM][R][H] f32 partials by owner
    uint64_t off_comb_done; // [R][G] u64 tagged
    uint64_t off_wts;       // [R][NM][LL_MAX_TOPK] f32 weights of each origin
    uint64_t off_wts_flag;  // [R] u64 tagged, payload = origin's N
    uint64_t off_epoch;
    uint64_t off_stage;
    int32_t num_tokens, hidden, num_topk, num_experts;
    int32_t num_ranks, rank, num_max, phases;
    int32_t owner_warps;    // 1..LL_WARPS-1: warps per block doing the owner work while the others
                            // do the origin work (send+recv launches only); 0: every warp does both
    int32_t pad_;
    uint64_t trace;         // 0, or u64[LL_TRACE_SLOTS] phase timestamps (bench diagnostics)
};
// Origin units (token, 256 channels) a warp reduces together: own terms of all of them first
// (kept in dynamic shared memory: origin warps x LL_ORIGIN_BATCH x 1 KiB), then one wait.
#define LL_ORIGIN_BATCH 8
// Owner units (origin token, 256 channels) whose routing a warp loads together.
#define LL_OWNER_BATCH 8
// Units whose partial loads an origin warp keeps in flight together.
#define LL_PART_BATCH 1

