// Dispatch layout: per-rank and per-expert token counts and `is_token_in_rank`, from top-k ids.
// Pure counting on one GPU, no communication. Deterministic (shared-memory counters per block,
// every output element written by exactly one block, so no pre-zeroing is needed).
//
// Grid: ceil(E / kLayoutExpertsPerBlock) "expert" blocks + 1 "rank" block, kLayoutThreads threads.
//   expert block b: counts selections of experts [b*32, b*32+32) over all tokens.
//   rank block:     writes is_token_in_rank[t][r], counts tokens per rank, and checks every id is
//                   -1 or in [0, E). A bad id is dropped (treated as -1: the expert blocks skip it
//                   as well) and recorded as EP_ERR_BAD_EXPERT_ID with its position and value
//                   (ep_record_bad_expert, not fatal: the kernel completes normally).
// A token goes to a rank once, however many of its experts live there (rank = expert / (E/R)).
#include "common.cuh"

#define kLayoutExpertsPerBlock 32
#define kLayoutThreads 256
#define kLayoutMaxRanks 8

extern "C" __global__ void __launch_bounds__(kLayoutThreads, 1)
ep_layout(const int64_t* __restrict__ topk_idx, int32_t num_tokens, int32_t num_topk,
          int32_t num_experts, int32_t num_ranks, int32_t* __restrict__ tokens_per_rank,
          int32_t* __restrict__ tokens_per_expert, uint8_t* __restrict__ is_token_in_rank,
          EpDiag diag) {
    const int num_expert_blocks = ceil_div(num_experts, kLayoutExpertsPerBlock);
    const int tid = threadIdx.x;
    if (static_cast<int>(blockIdx.x) < num_expert_blocks) {
        __shared__ int s_count[kLayoutExpertsPerBlock];
        const int e0 = blockIdx.x * kLayoutExpertsPerBlock;
        if (tid < kLayoutExpertsPerBlock) s_count[tid] = 0;
        __syncthreads();
        const long total = static_cast<long>(num_tokens) * num_topk;
        for (long i = tid; i < total; i += blockDim.x) {
            const int64_t e = __ldg(topk_idx + i);
            if (e >= e0 && e < e0 + kLayoutExpertsPerBlock && e < num_experts)
                atomicAdd(&s_count[e - e0], 1);
        }
        __syncthreads();
        if (tid < kLayoutExpertsPerBlock && e0 + tid < num_experts)
            tokens_per_expert[e0 + tid] = s_count[tid];
        return;
    }

    // Rank block.
    __shared__ int s_rank[kLayoutMaxRanks];
    if (tid < kLayoutMaxRanks) s_rank[tid] = 0;
    __syncthreads();
    const int experts_per_rank = num_experts / num_ranks;
    int my_count[kLayoutMaxRanks];
#pragma unroll
    for (int r = 0; r < kLayoutMaxRanks; ++r) my_count[r] = 0;
    for (int t = tid; t < num_tokens; t += blockDim.x) {
        unsigned mask = 0;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = __ldg(topk_idx + static_cast<long>(t) * num_topk + k);
            if (ep_bad_expert(e, num_experts)) {
                ep_record_bad_expert(diag, EP_PHASE_LAYOUT, static_cast<uint64_t>(t) * num_topk + k, e, num_topk,
                                     num_experts);
                continue;
            }
            if (e >= 0) mask |= 1u << static_cast<int>(e / experts_per_rank);
        }
#pragma unroll
        for (int r = 0; r < kLayoutMaxRanks; ++r) {
            if (r < num_ranks) {
                const bool in = (mask >> r) & 1u;
                is_token_in_rank[static_cast<long>(t) * num_ranks + r] = in ? 1 : 0;
                my_count[r] += in ? 1 : 0;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < kLayoutMaxRanks; ++r)
        if (r < num_ranks && my_count[r] != 0) atomicAdd(&s_rank[r], my_count[r]);
    __syncthreads();
    if (tid < num_ranks) tokens_per_rank[tid] = s_rank[tid];
}
