// DeepEP V2 (`ElasticBuffer`) dispatch/combine within one NVLink node (CUDA IPC): argument structs
// shared with the Rust host (`deepep_kernels::elastic::ffi`, size-checked there) and the layout of
// the per-rank buffer.
//
// Design summary (details: docs/kernels.md, "Elastic (DeepEP V2)"):
// - Every rank owns one IPC buffer with the SAME layout: a control region at fixed offsets, then
//   one data region that a dispatch and a combine use in turn (each call lays it out for its own
//   sizes; all ranks pass the same sizes, as DeepEP requires).
//     ctrl: call_seq u32 | blocks_done u32 | ready[8] i32 | rows_from[8] i32 | comb_from[8] i32
//           | notify_tok[8] u64 | notify_exp[8][max_local_experts] u64
//     data (dispatch): slot (s, i) = token i of the tokens source s sends here, [R][T] slots of
//           `token_bytes`: payload | 4-byte scale packs | meta (local ids[K] i32, per-source
//           expert positions[K] i32, weights[K] f32, source token index i32, combine slot i32)
//     data (combine):  rows (t, c) bf16 [T][nslots][hidden] | weights f32 [T][K]
// - Epochs live on the device (graph-safe): every collective kernel reads call_seq at start, runs
//   call `epoch = call_seq + 1`, and its last block to finish stores call_seq = epoch. A CUDA graph
//   replay therefore runs a new epoch every time, like an eager call.
// - Handshake: a collective kernel announces ready[me] = epoch in every peer and writes into a
//   peer only after seeing that peer's ready >= epoch: the peer's earlier kernels (the readers of
//   its data region) have completed.
// - Dispatch: a plan kernel (fresh calls only, no communication) gives every (token, slot) its
//   position in the stream to its rank (`dst_slot`) and among this rank's selections of its expert
//   (`exp_pos`), and the per-rank and per-expert counts. The dispatch kernel pushes the counts
//   (tagged with the epoch) and every token once per destination rank into slot (me, dst_slot),
//   then adds the rows it wrote to the destination's rows_from[me] (release). The epilogue kernel
//   (receiver) waits until rows_from[s] equals what s announced, then copies the slots into the
//   caller's outputs: rows grouped by source rank, ascending source token (so sorted by the
//   source's global token index: deterministic by construction), expanded rows grouped by local
//   expert in the same order. No host round trip is needed; a CPU-synced call only waits for the
//   counts (host-mapped) to size its outputs.
// - Combine: each rank pushes, for every row it received, one bf16 row back to the origin: the
//   row itself (plain), the f32 sum of the token's rows of its local experts in ascending top-k
//   slot, rounded once (expanded, `per_rank`), or each expert row alone (expanded, single
//   reduction). The origin reduces in f32: bias0 + bias1, then the rows in ascending top-k slot
//   order (a rank's partial sits at the LAST slot of that rank), one rounding: DeepEP V2's order.
#pragma once
#include "common.cuh"

#define EP_ELASTIC_MAX_RANKS 8
#define EP_ELASTIC_MAX_TOPK 32
#define EP_ELASTIC_MAX_EXPERTS 4096
#define EP_ELASTIC_THREADS 512

// Mirrored by `ElasticArgs` in kernels/src/elastic/ffi.rs (size 144 bytes).
struct ElasticArgs {
    uint64_t peer_base[EP_ELASTIC_MAX_RANKS];  // every rank's buffer, as mapped in this process
    uint64_t off_call_seq;     // u32 (own): epochs completed; u32 right after it: blocks_done
    uint64_t off_ready;        // i32[8]: ready[s] = last epoch rank s entered
    uint64_t off_rows_from;    // i32[8]: dispatch rows rank s wrote here in the running call
    uint64_t off_comb_from;    // i32[8]: combine rows rank s pushed here in the running call
    uint64_t off_notify_tok;   // u64[8]: from s: (epoch << 32) | tokens s sends here
    uint64_t off_notify_exp;   // u64[8][max_local_experts]: from s: (epoch << 32) | its selections of my local expert l
    uint64_t off_data;         // the data region
    uint64_t data_bytes;       // its size
    int32_t rank;
    int32_t num_ranks;
    int32_t max_local_experts;
    int32_t pad_;
};

// Mirrored by `ElasticPlanParams` (size 48 bytes). Grid: num_experts + num_ranks blocks.
struct ElasticPlanParams {
    const int64_t* topk_idx;   // [N][K]
    int32_t* dst_slot;         // out [N][K]: position of token t in the stream to rank(topk[t][j]); -1 for no expert
    int32_t* exp_pos;          // out [N][K]: position of (t, j) among this rank's selections of expert topk[t][j]; -1
    int32_t* send_counts;      // out [2R + E]: tokens to each rank, selections on each rank, selections of each expert
    int32_t num_tokens;        // N
    int32_t num_topk;          // K
    int32_t num_experts;       // E
    int32_t num_ranks;         // R
};

// Mirrored by `ElasticDispatchParams` (size 120 bytes).
struct ElasticDispatchParams {
    const void* x;             // [N][hidden_bytes]
    const uint32_t* sf;        // 4-byte scale packs: (t, g) at sf[t * sf_token_stride + g * sf_pack_stride]; null: none
    const int64_t* topk_idx;   // [N][K] (a cached call: the handle's)
    const float* topk_w;       // [N][K] or null
    const int32_t* dst_slot;   // [N][K] (plan output or the handle's)
    const int32_t* exp_pos;    // [N][K]
    const int32_t* send_counts;  // [2R + E]
    int64_t* topk_copy;        // [N][K] or null: the handle's copy of topk_idx
    int32_t* host_out;         // host-mapped or null: [1] = M, [2 + l] = selections of local expert l, then [0] = 1
    int64_t sf_token_stride;   // elements
    int64_t sf_pack_stride;    // elements
    int32_t num_tokens;        // N
    int32_t hidden_bytes;      // multiple of 16
    int32_t num_sf_packs;      // S (0 without scales)
    int32_t num_topk;          // K
    int32_t num_experts;       // E
    int32_t max_tokens;        // T of this call (slots per source)
    int32_t fresh;             // 1: push the counts (a fresh call); 0: cached
    int32_t pad_;
};

// Mirrored by `ElasticEpilogueParams` (size 136 bytes).
struct ElasticEpilogueParams {
    void* recv_x;              // [recv_rows][hidden_bytes]
    uint32_t* recv_sf;         // (r, g) at recv_sf[r * sf_row_stride + g * sf_pack_stride], or null
    int64_t* recv_topk_idx;    // [recv_rows][K] (plain layout) or null (expanded)
    float* recv_w;             // plain: [recv_rows][K]; expanded: [recv_rows]; or null
    int32_t* meta;             // [meta_rows][K + 2]: written by a fresh call, read by a cached one
    int32_t* psum_rank;        // [R] inclusive prefix of rows per source (fresh: out; cached: in)
    int32_t* psum_expert;      // [L] (fresh: out; cached: in): see the V2 docs of EPHandle
    int32_t* unaligned;        // [L] selections of each local expert (fresh: out; cached: in)
    int32_t* stats;            // [L] or null: += selections of each local expert (fresh only)
    int64_t sf_row_stride;
    int64_t sf_pack_stride;
    int32_t recv_rows;         // rows of recv_x (and recv_sf, recv_topk_idx, recv_w)
    int32_t meta_rows;         // rows of meta
    int32_t num_local_experts; // L
    int32_t expert_alignment;  // >= 1
    int32_t hidden_bytes;
    int32_t num_sf_packs;
    int32_t num_topk;
    int32_t max_tokens;        // T of the dispatch
    int32_t expand;            // 1: expanded layout
    int32_t fresh;             // 1: counts from the peers, meta written; 0: cached (from the handle)
    int32_t zero_padding;      // expanded only: zero the alignment gaps
    int32_t pad_;
};

// Mirrored by `ElasticCombineParams` (size 64 bytes).
struct ElasticCombineParams {
    const uint16_t* x;         // bf16 [x_rows][hidden]
    const float* topk_w;       // plain: [x_rows][K]; expanded: [x_rows]; or null
    const int32_t* meta;       // [meta_rows][K + 2] (the handle's)
    const int32_t* psum_rank;  // [R] (the handle's)
    int32_t x_rows;
    int32_t meta_rows;
    int32_t hidden;            // bf16 elements, multiple of 8
    int32_t num_topk;
    int32_t max_tokens;        // T of the dispatch
    int32_t expand;            // 1: x is in the expanded layout
    int32_t per_rank;          // 1: one partial per (token, rank); 0: one row per (token, slot)
    int32_t nslots;            // rows per token in the origin's combine region
};

// Mirrored by `ElasticReduceParams` (size 80 bytes).
struct ElasticReduceParams {
    uint16_t* out;             // bf16 [N][hidden]
    float* out_w;              // [N][K] or null
    const uint16_t* bias0;     // bf16 [N][hidden] or null
    const uint16_t* bias1;     // bf16 [N][hidden] or null
    const int64_t* topk_idx;   // [N][K] (the handle's)
    const int32_t* send_counts;  // [2R + E] (the handle's)
    int32_t num_tokens;
    int32_t hidden;
    int32_t num_topk;
    int32_t num_experts;
    int32_t per_rank;
    int32_t nslots;
    int32_t max_tokens;        // T of the dispatch (rows of the combine region per slot)
    int32_t pad_;
};

static_assert(sizeof(ElasticArgs) == 144, "ElasticArgs layout");
static_assert(sizeof(ElasticPlanParams) == 48, "ElasticPlanParams layout");
static_assert(sizeof(ElasticDispatchParams) == 120, "ElasticDispatchParams layout");
static_assert(sizeof(ElasticEpilogueParams) == 136, "ElasticEpilogueParams layout");
static_assert(sizeof(ElasticCombineParams) == 64, "ElasticCombineParams layout");
static_assert(sizeof(ElasticReduceParams) == 80, "ElasticReduceParams layout");

// ---- slot layouts (mirrored by `elastic::layout` in Rust: keep in sync) -------------------------
__device__ __forceinline__ int64_t ep_align16(int64_t v) { return (v + 15) & ~int64_t(15); }
// Byte offsets inside one dispatch slot.
struct EpSlot {
    int64_t sf, meta, bytes;
};
__device__ __forceinline__ EpSlot ep_slot_layout(int hidden_bytes, int num_sf_packs, int num_topk) {
    EpSlot s;
    s.sf = ep_align16(hidden_bytes);
    s.meta = s.sf + ep_align16(static_cast<int64_t>(num_sf_packs) * 4);
    s.bytes = s.meta + ep_align16(static_cast<int64_t>(3 * num_topk + 2) * 4);
    return s;
}

template <typename T>
__device__ __forceinline__ T* ep_el_at(const ElasticArgs& a, int rank, uint64_t off) {
    return reinterpret_cast<T*>(a.peer_base[rank] + off);
}
