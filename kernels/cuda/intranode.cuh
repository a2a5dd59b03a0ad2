// Intranode (NVLink, CUDA IPC) dispatch/combine: argument structs shared with the Rust host
// (`deepep_kernels::intranode::ffi`, size-checked there) and address helpers for the per-rank
// NVLink buffer.
//
// Design summary (details: docs/kernels.md, "Intranode"):
// - Every rank owns one IPC buffer with the SAME layout (byte offsets in `IntranodeArgs`):
//     ctrl:   ready[R] i32 | dispatch_rows[R] i32 | notify_rank[R][R] u64 | notify_expert[R][Lmax] u64
//             | stage_flag[R-1][max_tokens] i32
//     recv:   recv_x [R*max_tokens][row]  | recv_scales | recv_topk_idx i64 | recv_topk_w f32 | recv_src_idx i32
//     stage:  stage_x [R-1][max_tokens][hidden bf16] | stage_w [R-1][max_tokens][Kmax] f32
// - Dispatch: senders store token rows DIRECTLY at their final row in the destination's recv
//   region (row = rank prefix of the source + position of the token in the source->dest stream),
//   then add the number of (row, chunk) units they wrote to `dispatch_rows[src]` on the
//   destination with a system-scope release. The destination waits until that counter equals the
//   exact expected count (rows x chunks per row) and resets it (no ring queue, no second copy).
// - Combine: every rank pushes the y rows it received from origin s back into s's staging slot,
//   at the same position j the token had in the s->rank stream, and (after one system fence per
//   `push_rows` rows) stores a per-row flag (epoch).
//   The origin reduces token by token (f32, biases first, then ranks ascending), waiting on the
//   per-row flags, overlapped with the pushes of the same kernel.
// - Reuse without host re-zeroing: each collective call carries an epoch (host counter, the same on
//   every rank). At kernel start a rank announces `ready[me] = epoch` in every peer's buffer; nobody
//   writes into a peer's buffer for call e before seeing that peer's ready >= e. Flags compare against
//   the epoch; tagged notify values carry the epoch in their upper 32 bits.
#pragma once
#include "common.cuh"

#define EP_INTRANODE_MAX_RANKS 8
#define EP_INTRANODE_MAX_TOPK 32
#define EP_INTRANODE_MAX_LOCAL_EXPERTS 1024

// Mirrored by `IntranodeArgs` in kernels/src/intranode/ffi.rs (size 216 bytes).
struct IntranodeArgs {
    uint64_t peer_base[EP_INTRANODE_MAX_RANKS];  // every rank's buffer, as mapped in this process
    uint64_t off_ready;          // i32[R]: ready[s] = last epoch announced by rank s
    uint64_t off_dispatch_rows;  // i32[R]: units received from s in the running dispatch (reset by receiver)
    uint64_t off_notify_rank;    // u64[R][R]: from source s: (epoch << 32) | tokens s sends to rank j
    uint64_t off_notify_expert;  // u64[R][max_local_experts]: from s: tagged count for my local expert
    uint64_t off_stage_flag;     // i32[R-1][max_tokens]: epoch when staged row j of slot q landed
    uint64_t off_recv_x;         // recv rows, compact [M][row_bytes]
    uint64_t off_recv_scales;    // f32 [M][S]
    uint64_t off_recv_topk_idx;  // i64 [M][K]
    uint64_t off_recv_topk_w;    // f32 [M][K]
    uint64_t off_recv_src_idx;   // i32 [M]
    uint64_t off_stage_x;        // bf16 [R-1][max_tokens][hidden], slot stride `stage_x_slot_bytes`
    uint64_t off_stage_w;        // f32 [R-1][max_tokens][K], slot stride `stage_w_slot_bytes`
    uint64_t stage_x_slot_bytes;
    uint64_t stage_w_slot_bytes;
    uint64_t trace;              // 0, or u64[EP_TRACE_SLOTS] of phase timestamps (bench diagnostics)
    uint64_t off_recv_target;    // u64[R]: from rank s, (epoch << 32) | (region >> 9): where s's dispatch
                                 // `epoch` wants its received rows (0: the fixed off_recv_* regions)
    int32_t rank;
    int32_t num_ranks;
    int32_t max_tokens;          // per rank (capacity the buffer was sized for)
    int32_t max_local_experts;
    uint32_t epoch;              // this call's epoch (>= 1, +1 per collective call, same on all ranks)
    int32_t pad_;
};

// Mirrored by `NotifyParams` (size 64 bytes).
struct NotifyParams {
    const uint8_t* is_token_in_rank;    // [N][R] bool
    const int32_t* tokens_per_rank;     // [R]
    const int32_t* tokens_per_expert;   // [E] = [R * L]
    int32_t* send_pos;                  // out [N][R]: position of token t in the stream to rank d, -1 if not sent
    int32_t* count_matrix;              // out [R][R] (device): tokens rank s sends to rank d
    int32_t* host_out;                  // out, host-mapped: [0]=epoch when done, [1]=M, [2..2+R*R]=matrix, then [L] aligned counts
    int32_t num_tokens;                 // N
    int32_t num_local_experts;          // L
    int32_t expert_alignment;
    int32_t pad_;
};

// Mirrored by `DispatchParams` (size 104 bytes).
struct DispatchParams {
    const void* x;                      // [N][row_bytes] (bf16 or e4m3 bytes)
    const float* scales;                // FP8 only: element (t, g) at scales[t*scale_row_stride + g*scale_col_stride]; null for BF16
    const int64_t* topk_idx;            // [N][K]; null in cached mode
    const float* topk_w;                // [N][K]; null in cached mode
    const int32_t* send_pos;            // [N][R]
    const int32_t* count_matrix;        // [R][R] (device)
    int64_t row_bytes;                  // multiple of 16
    int64_t scale_row_stride;           // elements
    int64_t scale_col_stride;           // elements
    int32_t num_tokens;                 // N
    int32_t num_scales;                 // S (0 for BF16)
    int32_t num_topk;                   // K (0 in cached mode: no top-k / src_idx written)
    int32_t num_local_experts;          // L
    int32_t local_warps;                // 0: every warp copies everywhere; k: k warps per block copy to this rank only
    int32_t use_tma;                    // 1: peer copies via smem + cp.async.bulk (dynamic smem: 2 chunks per warp)
    uint64_t recv_region;               // this rank's receive region for this call: byte offset in its buffer
                                        // (a multiple of 512, laid out by ep_recv_sublayout), or 0: the fixed
                                        // off_recv_x / scales / topk regions
};

// Mirrored by `CombineParams` (size 88 bytes).
struct CombineParams {
    const uint16_t* y;                  // bf16 [M][H], rows in dispatch-output order
    const float* topk_w;                // [M][K] or null
    const uint16_t* bias0;              // bf16 [N][H] or null
    const uint16_t* bias1;              // bf16 [N][H] or null
    uint16_t* out;                      // bf16 [N][H]
    float* out_w;                       // [N][K] or null (null iff topk_w null)
    const int32_t* send_pos;            // [N][R] (handle)
    const int32_t* count_matrix;        // [R][R] (handle)
    int32_t hidden;                     // H (H*2 % 16 == 0)
    int32_t num_topk;                   // K
    int32_t num_tokens;                 // N (this rank's original token count)
    int32_t push_warps;                 // warps per block that push; the others reduce
    int32_t push_rows;                  // rows a pusher writes per system fence (>= 1)
    int32_t use_tma;                    // 1: pushers copy via smem + cp.async.bulk (dynamic smem: 2 chunks per push warp)
};

static_assert(sizeof(IntranodeArgs) == 216, "IntranodeArgs layout");
static_assert(sizeof(NotifyParams) == 64, "NotifyParams layout");
static_assert(sizeof(DispatchParams) == 104, "DispatchParams layout");
static_assert(sizeof(CombineParams) == 88, "CombineParams layout");

// ---- address helpers ---------------------------------------------------------------------
// Where the parts of one dispatch's outputs sit inside a receive region of `rows` rows (byte
// offsets from the region's start, each part 512-byte aligned). Mirrored by `recv_sublayout` in
// kernels/src/intranode/arena.rs (keep in sync).
struct EpRecvSub {
    uint64_t x, scales, topk_idx, topk_w;
};
__device__ __forceinline__ uint64_t ep_align512(uint64_t v) { return (v + 511) & ~uint64_t(511); }
__device__ __forceinline__ EpRecvSub ep_recv_sublayout(uint64_t rows, uint64_t row_bytes, int num_scales, int num_topk) {
    EpRecvSub r;
    r.x = 0;
    r.scales = ep_align512(rows * row_bytes);
    r.topk_idx = r.scales + ep_align512(rows * static_cast<uint64_t>(num_scales) * 4);
    r.topk_w = r.topk_idx + ep_align512(rows * static_cast<uint64_t>(num_topk) * 8);
    return r;
}

template <typename T>
__device__ __forceinline__ T* ep_at(const IntranodeArgs& a, int rank, uint64_t off) {
    return reinterpret_cast<T*>(a.peer_base[rank] + off);
}
// Staging slot (at owner rank `owner`) holding rows that came from rank `src` (src != owner).
__device__ __forceinline__ int ep_stage_slot(int src, int owner, int num_ranks) {
    return (src - owner - 1 + num_ranks) % num_ranks;
}

// Announce (block 0 only) that this rank entered call `a.epoch`, then wait until every peer did
// the same. After this returns true, writing into any peer's buffer for this call is allowed:
// each peer's previous kernels (the last readers of its regions) have completed.
// Must be called by all threads of the block (contains __syncthreads). Returns false on timeout.
__device__ __forceinline__ bool ep_ready_handshake(const IntranodeArgs& a, const EpDiag& diag,
                                                   int phase, int* s_abort) {
    const int tid = threadIdx.x;
    if (tid == 0) *s_abort = 0;
    if (blockIdx.x == 0 && tid < a.num_ranks && tid != a.rank)
        st_release_sys(ep_at<int>(a, tid, a.off_ready) + a.rank, static_cast<int>(a.epoch));
    __syncthreads();
    if (tid < a.num_ranks && tid != a.rank) {
        const int* flag = ep_at<int>(a, a.rank, a.off_ready) + tid;
        EpWait w(diag);
        while (!ep_epoch_reached(static_cast<uint32_t>(ld_acquire_sys(flag)), a.epoch)) {
            if (!w.tick(phase, blockIdx.x, tid, static_cast<int>(a.epoch))) { *s_abort = 1; break; }
        }
    }
    __syncthreads();
    return *s_abort == 0;
}

// Optional phase timestamps (%globaltimer ns) for diagnostics: slot EP_TRACE_START keeps the
// minimum over callers, every other slot the maximum. The host presets the slots (min: all ones,
// max: zero) before a traced call. Decoded by `intranode::Buffer::last_trace` into a `trace::PhaseTrace`.
#define EP_TRACE_START 0      // first block entered the kernel
#define EP_TRACE_READY 1      // last block finished the ready handshake
#define EP_TRACE_SENT 2       // last warp issued its last data store (dispatch) / pusher finished (combine)
#define EP_TRACE_PUBLISHED 3  // last block published its unit counts (dispatch)
#define EP_TRACE_RECEIVED 4   // all peers' data arrived (dispatch) / last reducer finished (combine)
#define EP_TRACE_SLOTS 8
__device__ __forceinline__ void ep_trace(const IntranodeArgs& a, int slot) {
    if (a.trace == 0) return;
    unsigned long long* p = reinterpret_cast<unsigned long long*>(a.trace) + slot;
    const unsigned long long now = ep_globaltimer();
    if (slot == EP_TRACE_START) atomicMin(p, now);
    else atomicMax(p, now);
}

// Block 0 announces that this rank entered call `a.epoch` (ready[me] = epoch in every peer).
__device__ __forceinline__ void ep_announce_ready(const IntranodeArgs& a) {
    if (blockIdx.x == 0 && threadIdx.x < a.num_ranks && threadIdx.x != a.rank)
        st_release_sys(ep_at<int>(a, threadIdx.x, a.off_ready) + a.rank, static_cast<int>(a.epoch));
}

// Warp-level wait (all 32 lanes call it) until every peer announced `a.epoch`; afterwards this
// warp may write into any peer's buffer for this call. False on timeout (error recorded).
__device__ __forceinline__ bool ep_warp_wait_ready(const IntranodeArgs& a, const EpDiag& diag, int phase) {
    const int lane = threadIdx.x & 31;
    bool ok = true;
    if (lane < a.num_ranks && lane != a.rank) {
        const int* flag = ep_at<int>(a, a.rank, a.off_ready) + lane;
        EpWait w(diag);
        while (!ep_epoch_reached(static_cast<uint32_t>(ld_acquire_sys(flag)), a.epoch)) {
            if (!w.tick(phase, blockIdx.x, lane, static_cast<int>(a.epoch))) { ok = false; break; }
        }
    }
    const bool all = __all_sync(0xffffffffu, ok);
    __syncwarp();
    return all;
}

// ---- bulk (TMA) stores from shared memory ---------------------------------------------------
__device__ __forceinline__ void ep_bulk_store(void* gdst, const void* smem, uint32_t bytes) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(gdst), "r"(s), "r"(bytes) : "memory");
}
__device__ __forceinline__ void ep_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// At most one committed group may still be reading its shared-memory source.
__device__ __forceinline__ void ep_bulk_wait_read_1() { asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); }
// Every committed group complete (its writes performed), then order them before later generic accesses.
__device__ __forceinline__ void ep_bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async;" ::: "memory");
}
// Make this thread's generic shared-memory writes visible to the async (bulk copy) proxy.
__device__ __forceinline__ void ep_fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
