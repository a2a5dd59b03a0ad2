// DeepEP V2 (`ElasticBuffer`) plan / dispatch / dispatch epilogue / combine / combine reduce /
// barrier within one NVLink node. Design, buffer layout and memory ordering: elastic.cuh and
// docs/kernels.md ("Elastic (DeepEP V2)").
//
// Entry points (all take `EpDiag` last; every grid is at most this rank's share of the SMs, so the
// spin-waiting blocks of ranks that share a GPU are resident at once):
//   ep_elastic_plan              grid E + R, EP_ELASTIC_THREADS (fresh dispatch; no communication)
//   ep_elastic_dispatch          grid num_sms, EP_ELASTIC_THREADS (collective: one epoch)
//   ep_elastic_dispatch_epilogue grid num_sms, EP_ELASTIC_THREADS (local: waits for the rows)
//   ep_elastic_combine           grid num_sms, EP_ELASTIC_THREADS (collective: one epoch)
//   ep_elastic_combine_reduce    grid num_sms, EP_ELASTIC_THREADS (local: waits for the rows)
//   ep_elastic_barrier           grid 1, 32 threads (collective: one epoch)

#include "elastic.cuh"

#define kElFull 0xffffffffu
// 16-byte words of a row each lane keeps in flight while copying it.
#define kElUnroll 4

// ---- small helpers ------------------------------------------------------------------------------

// Block-wide exclusive prefix of `v` in thread order; `*total` gets the block's sum. All threads of
// the block call it (contains __syncthreads); `s_warp` holds one int per warp.
__device__ __forceinline__ int el_block_prefix(int v, int* s_warp, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kElFull, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s_warp[warp] = x;
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < nwarps; ++w) {
        const int c = s_warp[w];
        before += w < warp ? c : 0;
        sum += c;
    }
    __syncthreads();
    *total = sum;
    return before + x - v;
}

__device__ __forceinline__ int el_align(int v, int a) { return (v + a - 1) / a * a; }

__device__ __forceinline__ uint32_t* el_call_seq(const ElasticArgs& a) {
    return ep_el_at<uint32_t>(a, a.rank, a.off_call_seq);
}

// Thread 0 of every block, after a __syncthreads() that follows the block's last access: true in
// the block that finishes last (every other block has finished all its accesses by then).
__device__ __forceinline__ bool el_last_block(const ElasticArgs& a) {
    __threadfence();
    unsigned* done = el_call_seq(a) + 1;
    const unsigned old = atomicAdd(done, 1u);
    if (old != gridDim.x - 1) return false;
    atomicExch(done, 0u);
    __threadfence();
    return true;
}

// The epoch of a collective kernel: one more than the calls completed so far (read by thread 0).
__device__ __forceinline__ uint32_t el_next_epoch(const ElasticArgs& a) {
    return static_cast<uint32_t>(ld_volatile(reinterpret_cast<const int*>(el_call_seq(a)))) + 1u;
}

// Block 0 announces `epoch` in every peer; every block then waits until every peer announced it
// (after which writing into any peer's data region for this call is allowed). All threads call it.
__device__ __forceinline__ bool el_handshake(const ElasticArgs& a, const EpDiag& diag, uint32_t epoch, int phase,
                                             int* s_abort) {
    const int tid = threadIdx.x, R = a.num_ranks, me = a.rank;
    if (blockIdx.x == 0 && tid < R && tid != me)
        st_release_sys(ep_el_at<int>(a, tid, a.off_ready) + me, static_cast<int>(epoch));
    if (tid < R && tid != me) {
        const int* flag = ep_el_at<int>(a, me, a.off_ready) + tid;
        EpWait w(diag);
        while (!ep_epoch_reached(static_cast<uint32_t>(ld_acquire_sys(flag)), epoch)) {
            if (!w.tick(phase, blockIdx.x, tid, static_cast<int>(epoch))) { *s_abort = 1; break; }
        }
    }
    __syncthreads();
    return *s_abort == 0;
}

// Waits until the counter `ctr` (written by `peer` with release adds) equals `want`; false (error
// recorded) on a timeout or an overshoot. One thread.
__device__ __forceinline__ bool el_wait_count(int* ctr, int want, const EpDiag& diag, int phase, int peer) {
    EpWait w(diag);
    int seen;
    while ((seen = ld_acquire_sys(ctr)) != want) {
        if (seen > want) {
            ep_record_error(diag, EP_ERR_BAD_ARGUMENT, phase, blockIdx.x, peer, seen, 0);
            return false;
        }
        if (!w.tick(phase, blockIdx.x, peer, want)) return false;
    }
    return true;
}

// Waits until the tagged notify value at `p` carries `epoch`; returns its count (or -1 on timeout).
__device__ __forceinline__ int el_wait_tagged(const uint64_t* p, uint32_t epoch, const EpDiag& diag, int phase,
                                              int peer, int detail) {
    EpWait w(diag);
    uint64_t v;
    while (static_cast<uint32_t>((v = ld_volatile_u64(p)) >> 32) != epoch) {
        if (!w.tick(phase, blockIdx.x, peer, detail)) return -1;
    }
    return static_cast<int>(static_cast<uint32_t>(v));
}

// Copies `n16` 16-byte words from `src` (read-only input of this kernel) to `dst`, one warp.
__device__ __forceinline__ void el_copy_row_nc(int4* dst, const int4* src, int n16) {
    const int lane = threadIdx.x & 31;
    for (int i0 = lane; i0 < n16; i0 += 32 * kElUnroll) {
        int4 v[kElUnroll];
#pragma unroll
        for (int u = 0; u < kElUnroll; ++u)
            if (i0 + 32 * u < n16) v[u] = ld_nc_v4(src + i0 + 32 * u);
#pragma unroll
        for (int u = 0; u < kElUnroll; ++u)
            if (i0 + 32 * u < n16) st_na_v4(dst + i0 + 32 * u, v[u]);
    }
}

// =================================================================================================
// plan: per-rank and per-expert positions of a fresh dispatch (this rank's tokens only)
// =================================================================================================
// Block e < E: the selections of expert e in flat (token, slot) order -> exp_pos, and their count.
// Block E + d: the tokens that select any expert of rank d, in token order -> dst_slot of those
// slots, the token and selection counts for d; block E (d = 0) also marks the slots without an
// expert (-1, or an id that points nowhere: dropped and recorded) with -1.
extern "C" __global__ void __launch_bounds__(EP_ELASTIC_THREADS, 1)
ep_elastic_plan(ElasticPlanParams p, EpDiag diag) {
    __shared__ int s_warp[EP_ELASTIC_THREADS / 32];
    const int tid = threadIdx.x;
    const int N = p.num_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks, L = E / R;
    if (static_cast<int>(blockIdx.x) < E) {
        const int e = blockIdx.x;
        const int64_t F = static_cast<int64_t>(N) * K;
        int running = 0;
        for (int64_t base = 0; base < F; base += blockDim.x) {
            const int64_t f = base + tid;
            const bool hit = f < F && __ldg(p.topk_idx + f) == e;
            int total;
            const int before = el_block_prefix(hit ? 1 : 0, s_warp, &total);
            if (hit) p.exp_pos[f] = running + before;
            running += total;
        }
        if (tid == 0) p.send_counts[2 * R + e] = running;
        return;
    }
    const int d = blockIdx.x - E;
    int running = 0, entries = 0;
    for (int base = 0; base < N; base += blockDim.x) {
        const int t = base + tid;
        int mine = 0;
        if (t < N) {
            for (int j = 0; j < K; ++j) {
                const int64_t e = __ldg(p.topk_idx + static_cast<int64_t>(t) * K + j);
                if (e >= 0 && e < E) {
                    mine += static_cast<int>(e / L) == d ? 1 : 0;
                } else if (d == 0) {
                    const int64_t f = static_cast<int64_t>(t) * K + j;
                    p.dst_slot[f] = -1;
                    p.exp_pos[f] = -1;
                    if (ep_bad_expert(e, E)) ep_record_bad_expert(diag, EP_PHASE_ELASTIC_PLAN, static_cast<uint64_t>(f), e, K, E);
                }
            }
        }
        int total;
        const int before = el_block_prefix(mine > 0 ? 1 : 0, s_warp, &total);
        if (mine > 0) {
            for (int j = 0; j < K; ++j) {
                const int64_t e = __ldg(p.topk_idx + static_cast<int64_t>(t) * K + j);
                if (e >= 0 && e < E && static_cast<int>(e / L) == d) p.dst_slot[static_cast<int64_t>(t) * K + j] = running + before;
            }
        }
        entries += mine;
        running += total;
    }
    int sum;
    el_block_prefix(entries, s_warp, &sum);
    if (tid == 0) {
        p.send_counts[d] = running;
        p.send_counts[R + d] = sum;
    }
}

// =================================================================================================
// dispatch: counts and token slots into every destination's data region
// =================================================================================================
extern "C" __global__ void __launch_bounds__(EP_ELASTIC_THREADS, 1)
ep_elastic_dispatch(ElasticArgs a, ElasticDispatchParams p, EpDiag diag) {
    __shared__ uint32_t s_epoch;
    __shared__ int s_abort;
    __shared__ int s_cnt[EP_ELASTIC_MAX_RANKS];
    __shared__ int s_m;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int R = a.num_ranks, me = a.rank;
    const int K = p.num_topk, E = p.num_experts, L = E / R, T = p.max_tokens, S = p.num_sf_packs;
    if (tid == 0) {
        s_epoch = el_next_epoch(a);
        s_abort = 0;
        s_m = 0;
    }
    if (tid < EP_ELASTIC_MAX_RANKS) s_cnt[tid] = 0;
    __syncthreads();
    const uint32_t epoch = s_epoch;
    if (!el_handshake(a, diag, epoch, EP_PHASE_ELASTIC_DISPATCH_SEND, &s_abort)) return;

    // Counts (fresh calls): every destination learns how many tokens this rank sends it and how many
    // selections of each of its local experts. Tagged with the epoch: no flag, no ordering needed.
    if (p.fresh && blockIdx.x == 0) {
        const uint64_t tag = static_cast<uint64_t>(epoch) << 32;
        for (int i = tid; i < R * (L + 1); i += blockDim.x) {
            const int d = i / (L + 1), j = i % (L + 1);
            if (j == 0) {
                st_relaxed_sys_u64(ep_el_at<uint64_t>(a, d, a.off_notify_tok) + me,
                                   tag | static_cast<uint32_t>(p.send_counts[d]));
            } else {
                st_relaxed_sys_u64(ep_el_at<uint64_t>(a, d, a.off_notify_exp) + static_cast<int64_t>(me) * a.max_local_experts + (j - 1),
                                   tag | static_cast<uint32_t>(p.send_counts[2 * R + d * L + (j - 1)]));
            }
        }
    }

    // Tokens: a warp per token, once per destination rank, into slot (me, dst_slot) there.
    const EpSlot sl = ep_slot_layout(p.hidden_bytes, S, K);
    const int n16 = p.hidden_bytes / 16;
    const int64_t gstride = static_cast<int64_t>(gridDim.x) * nwarps;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * nwarps + warp; t < p.num_tokens; t += gstride) {
        int64_t e = -1;
        int dj = -1, ds = -1, ep = -1;
        float w = 0.f;
        if (lane < K) {
            e = __ldg(p.topk_idx + t * K + lane);
            if (p.topk_copy != nullptr) p.topk_copy[t * K + lane] = e;
            // an id that points nowhere was recorded by the plan (fresh) and is dropped here like -1
            if (e >= 0 && e < E) {
                dj = static_cast<int>(e / L);
                ds = __ldg(p.dst_slot + t * K + lane);
                ep = __ldg(p.exp_pos + t * K + lane);
            }
            if (p.topk_w != nullptr) w = __ldg(p.topk_w + t * K + lane);
        }
        // The last slot of each rank among the token's selections: V2's combine adds the ranks'
        // partial sums in the order of these slots, so a rank's combine row goes to the slot
        // numbered by how many such last slots come before its own.
        const unsigned same = __match_any_sync(kElFull, dj);
        const unsigned lastmask = __ballot_sync(kElFull, dj >= 0 && (31 - __clz(same)) == lane);
        const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + t * p.hidden_bytes);
        for (int d = 0; d < R; ++d) {
            const unsigned m = __ballot_sync(kElFull, dj == d);
            if (m == 0) continue;
            const int jf = __ffs(m) - 1, jl = 31 - __clz(m);
            const int slot = __shfl_sync(kElFull, ds, jf);
            const int cslot = __popc(lastmask & ((1u << jl) - 1u));
            if (slot < 0 || slot >= T) {
                if (lane == 0) ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_ELASTIC_DISPATCH_SEND, blockIdx.x, d, slot, 0);
                continue;
            }
            char* dst = reinterpret_cast<char*>(a.peer_base[d] + a.off_data) + (static_cast<int64_t>(me) * T + slot) * sl.bytes;
            el_copy_row_nc(reinterpret_cast<int4*>(dst), src, n16);
            if (p.sf != nullptr) {
                for (int g = lane; g < S; g += 32)
                    st_na_s32(reinterpret_cast<int*>(dst + sl.sf) + g,
                              static_cast<int>(__ldg(p.sf + t * p.sf_token_stride + g * p.sf_pack_stride)));
            }
            int* meta = reinterpret_cast<int*>(dst + sl.meta);
            if (lane < K) {
                const bool mine = dj == d;
                st_na_s32(meta + lane, mine ? static_cast<int>(e - static_cast<int64_t>(d) * L) : -1);
                st_na_s32(meta + K + lane, mine ? ep : -1);
                st_na_f32(reinterpret_cast<float*>(meta + 2 * K) + lane, w);
            }
            if (lane == 0) {
                st_na_s32(meta + 3 * K, me * T + static_cast<int>(t));
                st_na_s32(meta + 3 * K + 1, cslot);
                atomicAdd(&s_cnt[d], 1);
            }
        }
    }
    __syncthreads();
    // Publish this block's rows to every destination (the system fence covers every warp's stores).
    if (tid < R && s_cnt[tid] > 0) {
        __threadfence_system();
        atomic_add_release_sys(ep_el_at<int>(a, tid, a.off_rows_from) + me, s_cnt[tid]);
    }

    // A CPU-synced call: block 0 reports what this rank receives (host-mapped), once every source's
    // counts are here, so the host can size the outputs while the rows are still in flight.
    if (p.host_out != nullptr && blockIdx.x == 0) {
        if (tid < R) {
            const int c = el_wait_tagged(ep_el_at<uint64_t>(a, me, a.off_notify_tok) + tid, epoch, diag, EP_PHASE_ELASTIC_DISPATCH_RECV, tid, 0);
            if (c < 0) s_abort = 1;
            else atomicAdd(&s_m, c);
        }
        for (int l = tid; l < L; l += blockDim.x) {
            int c = 0;
            for (int s = 0; s < R; ++s) {
                const int v = el_wait_tagged(ep_el_at<uint64_t>(a, me, a.off_notify_exp) + static_cast<int64_t>(s) * a.max_local_experts + l,
                                             epoch, diag, EP_PHASE_ELASTIC_DISPATCH_RECV, s, l);
                if (v < 0) { s_abort = 1; break; }
                c += v;
            }
            p.host_out[2 + l] = c;
        }
        __syncthreads();
        if (tid == 0 && !s_abort) {
            p.host_out[1] = s_m;
            __threadfence_system();
            *reinterpret_cast<volatile int32_t*>(&p.host_out[0]) = 1;
        }
    }
    __syncthreads();
    if (tid == 0 && el_last_block(a)) atomicExch(el_call_seq(a), epoch);
}

// =================================================================================================
// dispatch epilogue: the received slots into the caller's outputs (receiver side, no communication)
// =================================================================================================
extern "C" __global__ void __launch_bounds__(EP_ELASTIC_THREADS, 1)
ep_elastic_dispatch_epilogue(ElasticArgs a, ElasticEpilogueParams p, EpDiag diag) {
    __shared__ int s_psum[EP_ELASTIC_MAX_RANKS + 1];  // exclusive prefix of rows per source; [R] = M
    __shared__ int s_rows[EP_ELASTIC_MAX_RANKS];
    // expanded: [s * L + l] = rows of expert l that come before source s's (fresh calls)
    __shared__ int s_base[EP_ELASTIC_MAX_EXPERTS];
    __shared__ int s_start[EP_ELASTIC_MAX_EXPERTS / 2];  // [l] first row of expert l
    __shared__ int s_count[EP_ELASTIC_MAX_EXPERTS / 2];  // [l] selections of expert l
    __shared__ int s_warp[EP_ELASTIC_THREADS / 32];
    __shared__ int s_abort;
    __shared__ uint32_t s_epoch;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int R = a.num_ranks, me = a.rank;
    const int K = p.num_topk, L = p.num_local_experts, A = p.expert_alignment, T = p.max_tokens, S = p.num_sf_packs;
    if (tid == 0) {
        s_abort = 0;
        s_epoch = static_cast<uint32_t>(ld_volatile(reinterpret_cast<const int*>(el_call_seq(a))));
    }
    __syncthreads();
    const uint32_t epoch = s_epoch;

    // Rows from every source: announced by the sources (fresh) or kept by the handle (cached).
    if (tid < R) {
        int c;
        if (p.fresh) {
            c = el_wait_tagged(ep_el_at<uint64_t>(a, me, a.off_notify_tok) + tid, epoch, diag, EP_PHASE_ELASTIC_DISPATCH_RECV, tid, 0);
            if (c < 0) s_abort = 1;
        } else {
            c = p.psum_rank[tid] - (tid > 0 ? p.psum_rank[tid - 1] : 0);
        }
        s_rows[tid] = c;
    }
    __syncthreads();
    if (s_abort) return;
    if (tid == 0) {
        int acc = 0;
        for (int s = 0; s < R; ++s) {
            s_psum[s] = acc;
            acc += s_rows[s];
        }
        s_psum[R] = acc;
    }

    // Per local expert: selections, first row (expanded), and per source where its rows start.
    const bool fresh_experts = p.fresh && (p.expand || blockIdx.x == 0);
    if (fresh_experts) {
        for (int i = tid; i < R * L; i += blockDim.x) {
            const int s = i / L, l = i % L;
            const int v = el_wait_tagged(ep_el_at<uint64_t>(a, me, a.off_notify_exp) + static_cast<int64_t>(s) * a.max_local_experts + l,
                                         epoch, diag, EP_PHASE_ELASTIC_DISPATCH_RECV, s, l);
            if (v < 0) s_abort = 1;
            s_base[i] = v;
        }
        __syncthreads();
        if (s_abort) return;
        for (int l = tid; l < L; l += blockDim.x) {
            int acc = 0;
            for (int s = 0; s < R; ++s) {
                const int v = s_base[s * L + l];
                s_base[s * L + l] = acc;
                acc += v;
            }
            s_count[l] = acc;
        }
        __syncthreads();
        // first rows: exclusive prefix of the aligned counts, a contiguous chunk of experts per thread
        const int chunk = (L + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
        const int lo = min(L, tid * chunk), hi = min(L, lo + chunk);
        int sum = 0;
        for (int l = lo; l < hi; ++l) sum += el_align(s_count[l], A);
        int total;
        int acc = el_block_prefix(sum, s_warp, &total);
        for (int l = lo; l < hi; ++l) {
            s_start[l] = acc;
            acc += el_align(s_count[l], A);
        }
    } else if (p.expand) {
        // cached: the handle's counts (psum_expert[l] = first row of l + its selections)
        for (int l = tid; l < L; l += blockDim.x) {
            s_count[l] = p.unaligned[l];
            s_start[l] = p.psum_expert[l] - p.unaligned[l];
        }
    }
    __syncthreads();

    // The handle's counts (fresh calls): block 0.
    if (p.fresh && blockIdx.x == 0) {
        if (tid < R) p.psum_rank[tid] = s_psum[tid + 1];
        for (int l = tid; l < L; l += blockDim.x) {
            const int c = s_count[l];
            p.unaligned[l] = c;
            p.psum_expert[l] = p.expand ? s_start[l] + c : s_start[l] + el_align(c, A);
            if (p.stats != nullptr) p.stats[l] += c;
        }
    }

    // Wait until every source's rows have landed.
    if (tid < R) {
        if (!el_wait_count(ep_el_at<int>(a, me, a.off_rows_from) + tid, s_rows[tid], diag, EP_PHASE_ELASTIC_DISPATCH_RECV, tid))
            s_abort = 1;
    }
    __syncthreads();
    if (s_abort) return;
    const int M = s_psum[R];
    if (M > p.meta_rows || (!p.expand && M > p.recv_rows)) {
        if (tid == 0) ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_ELASTIC_DISPATCH_RECV, blockIdx.x, -1, M, p.recv_rows);
        return;
    }

    const EpSlot sl = ep_slot_layout(p.hidden_bytes, S, K);
    const int n16 = p.hidden_bytes / 16;
    const char* data = reinterpret_cast<const char*>(a.peer_base[me] + a.off_data);
    char* recv_x = static_cast<char*>(p.recv_x);
    const int meta_w = K + 2;
    const int64_t gstride = static_cast<int64_t>(gridDim.x) * nwarps;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * nwarps + warp; i < M; i += gstride) {
        int s = 0;
        while (s + 1 < R && i >= s_psum[s + 1]) ++s;
        const int slot = static_cast<int>(i) - s_psum[s];
        const char* src = data + (static_cast<int64_t>(s) * T + slot) * sl.bytes;
        const int* meta = reinterpret_cast<const int*>(src + sl.meta);
        int li = -1, ep = -1;
        float w = 0.f;
        if (lane < K) {
            li = ld_volatile(meta + lane);
            ep = ld_volatile(meta + K + lane);
            w = ld_volatile_f32(reinterpret_cast<const float*>(meta + 2 * K) + lane);
        }
        int head = 0;
        if (lane < 2) head = ld_volatile(meta + 3 * K + lane);
        const int src_token = __shfl_sync(kElFull, head, 0), cslot = __shfl_sync(kElFull, head, 1);
        const int4* row = reinterpret_cast<const int4*>(src);
        if (p.expand) {
            int pos = -1;
            if (lane < K && li >= 0 && li < L)
                pos = p.fresh ? s_start[li] + s_base[s * L + li] + ep : p.meta[i * meta_w + 2 + lane];
            if (pos >= p.recv_rows) {
                ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_ELASTIC_DISPATCH_RECV, blockIdx.x, -1, pos, p.recv_rows);
                pos = -1;
            }
            const unsigned m = __ballot_sync(kElFull, pos >= 0);
            // the row once from the buffer, to every expanded row of the token
            for (int i0 = 0; i0 < n16; i0 += 32 * kElUnroll) {
                int4 v[kElUnroll];
#pragma unroll
                for (int u = 0; u < kElUnroll; ++u)
                    if (i0 + lane + 32 * u < n16) v[u] = ld_volatile_v4(row + i0 + lane + 32 * u);
                for (unsigned mm = m; mm != 0; mm &= mm - 1) {
                    const int r = __shfl_sync(kElFull, pos, __ffs(mm) - 1);
                    int4* dst = reinterpret_cast<int4*>(recv_x + static_cast<int64_t>(r) * p.hidden_bytes);
#pragma unroll
                    for (int u = 0; u < kElUnroll; ++u)
                        if (i0 + lane + 32 * u < n16) st_na_v4(dst + i0 + lane + 32 * u, v[u]);
                }
            }
            if (p.recv_sf != nullptr) {
                for (unsigned mm = m; mm != 0; mm &= mm - 1) {
                    const int r = __shfl_sync(kElFull, pos, __ffs(mm) - 1);
                    for (int g = lane; g < S; g += 32)
                        p.recv_sf[static_cast<int64_t>(r) * p.sf_row_stride + g * p.sf_pack_stride] =
                            static_cast<uint32_t>(ld_volatile(reinterpret_cast<const int*>(src + sl.sf) + g));
                }
            }
            if (p.recv_w != nullptr && pos >= 0) p.recv_w[pos] = w;
            if (p.fresh && lane < K) p.meta[i * meta_w + 2 + lane] = pos;
        } else {
            int4* dst = reinterpret_cast<int4*>(recv_x + i * p.hidden_bytes);
            for (int i0 = lane; i0 < n16; i0 += 32 * kElUnroll) {
                int4 v[kElUnroll];
#pragma unroll
                for (int u = 0; u < kElUnroll; ++u)
                    if (i0 + 32 * u < n16) v[u] = ld_volatile_v4(row + i0 + 32 * u);
#pragma unroll
                for (int u = 0; u < kElUnroll; ++u)
                    if (i0 + 32 * u < n16) st_na_v4(dst + i0 + 32 * u, v[u]);
            }
            if (p.recv_sf != nullptr) {
                for (int g = lane; g < S; g += 32)
                    p.recv_sf[i * p.sf_row_stride + g * p.sf_pack_stride] =
                        static_cast<uint32_t>(ld_volatile(reinterpret_cast<const int*>(src + sl.sf) + g));
            }
            if (lane < K) {
                if (p.recv_topk_idx != nullptr) p.recv_topk_idx[i * K + lane] = li;
                if (p.recv_w != nullptr) p.recv_w[i * K + lane] = w;
                if (p.fresh) p.meta[i * meta_w + 2 + lane] = li >= 0 ? static_cast<int>(i) : -1;
            }
        }
        if (p.fresh && lane == 0) {
            p.meta[i * meta_w] = src_token;
            p.meta[i * meta_w + 1] = cslot;
        }
    }

    // Zero padding (expanded): the rows between an expert's last row and the next aligned start.
    if (p.expand && p.zero_padding) {
        for (int l = static_cast<int>(blockIdx.x) * nwarps + warp; l < L; l += static_cast<int>(gstride)) {
            const int from = s_start[l] + s_count[l], to = min(s_start[l] + el_align(s_count[l], A), p.recv_rows);
            for (int r = from; r < to; ++r) {
                int4* dst = reinterpret_cast<int4*>(recv_x + static_cast<int64_t>(r) * p.hidden_bytes);
                for (int i0 = lane; i0 < n16; i0 += 32) st_na_v4(dst + i0, make_int4(0, 0, 0, 0));
                if (p.recv_sf != nullptr)
                    for (int g = lane; g < S; g += 32) p.recv_sf[static_cast<int64_t>(r) * p.sf_row_stride + g * p.sf_pack_stride] = 0u;
                if (p.recv_w != nullptr && lane == 0) p.recv_w[r] = 0.f;
            }
        }
    }

    // The last block resets the row counters for the next dispatch (whose senders write only after
    // this rank's next handshake, i.e. after this kernel completed).
    __syncthreads();
    if (tid == 0 && el_last_block(a)) {
        for (int s = 0; s < R; ++s) st_relaxed_sys(ep_el_at<int>(a, me, a.off_rows_from) + s, 0);
    }
}

// =================================================================================================
// combine: every received row (or its expert rows) back to its origin's combine region
// =================================================================================================
extern "C" __global__ void __launch_bounds__(EP_ELASTIC_THREADS, 1)
ep_elastic_combine(ElasticArgs a, ElasticCombineParams p, EpDiag diag) {
    __shared__ uint32_t s_epoch;
    __shared__ int s_abort;
    __shared__ int s_cnt[EP_ELASTIC_MAX_RANKS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int R = a.num_ranks, me = a.rank;
    const int K = p.num_topk, H = p.hidden, T = p.max_tokens, NS = p.nslots;
    if (tid == 0) {
        s_epoch = el_next_epoch(a);
        s_abort = 0;
    }
    if (tid < EP_ELASTIC_MAX_RANKS) s_cnt[tid] = 0;
    __syncthreads();
    const uint32_t epoch = s_epoch;
    if (!el_handshake(a, diag, epoch, EP_PHASE_ELASTIC_COMBINE_SEND, &s_abort)) return;

    const int M = p.psum_rank[R - 1];
    if (M > p.meta_rows || (!p.expand && M > p.x_rows)) {
        if (tid == 0) ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_ELASTIC_COMBINE_SEND, blockIdx.x, -1, M, p.x_rows);
        return;
    }
    const int64_t hb = static_cast<int64_t>(H) * 2;
    const int n16 = static_cast<int>(hb / 16);
    const uint64_t off_w = a.off_data + static_cast<uint64_t>(ep_align16(static_cast<int64_t>(T) * NS * hb));
    const int meta_w = K + 2;
    const int64_t gstride = static_cast<int64_t>(gridDim.x) * nwarps;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * nwarps + warp; i < M; i += gstride) {
        int mv = -1;
        if (lane < meta_w) mv = __ldg(p.meta + i * meta_w + lane);
        const int src_token = __shfl_sync(kElFull, mv, 0), cslot = __shfl_sync(kElFull, mv, 1);
        int c = __shfl_sync(kElFull, mv, (lane + 2) & 31);  // lane j < K: column 2 + j
        if (lane >= K) c = -1;
        const int s = src_token / T, t = src_token % T;
        // rows that point outside the handle's group or past x: a handle that does not belong to
        // this x (recorded; the row is skipped, the origin's reduce then times out naming this rank)
        if (__any_sync(kElFull, src_token < 0 || s >= R || (p.expand && c >= p.x_rows))) {
            if (lane == 0) ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_ELASTIC_COMBINE_SEND, blockIdx.x, s, src_token, 0);
            continue;
        }
        char* region = reinterpret_cast<char*>(a.peer_base[s] + a.off_data);
        float* wdst = reinterpret_cast<float*>(a.peer_base[s] + off_w) + static_cast<int64_t>(t) * K;
        int units;
        if (!p.expand) {
            el_copy_row_nc(reinterpret_cast<int4*>(region + (static_cast<int64_t>(t) * NS + cslot) * hb),
                           reinterpret_cast<const int4*>(p.x + i * H), n16);
            if (p.topk_w != nullptr && c >= 0) st_na_f32(wdst + lane, __ldg(p.topk_w + i * K + lane));
            units = 1;
        } else {
            const unsigned m = __ballot_sync(kElFull, c >= 0);
            if (p.per_rank) {
                // f32 sum of the token's expert rows here, ascending slot, rounded once
                int4* dst = reinterpret_cast<int4*>(region + (static_cast<int64_t>(t) * NS + cslot) * hb);
                for (int q0 = 0; q0 < n16; q0 += 32) {
                    const int q = q0 + lane;
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    for (unsigned mm = m; mm != 0; mm &= mm - 1) {
                        const int r = __shfl_sync(kElFull, c, __ffs(mm) - 1);
                        if (q < n16) ep_accumulate_bf16x8(acc, ld_nc_v4(reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(r) * H) + q));
                    }
                    if (q < n16) st_na_v4(dst + q, ep_pack_bf16x8(acc));
                }
                units = 1;
            } else {
                for (unsigned mm = m; mm != 0; mm &= mm - 1) {
                    const int j = __ffs(mm) - 1;
                    const int r = __shfl_sync(kElFull, c, j);
                    el_copy_row_nc(reinterpret_cast<int4*>(region + (static_cast<int64_t>(t) * NS + j) * hb),
                                   reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(r) * H), n16);
                }
                units = __popc(m);
            }
            if (p.topk_w != nullptr && c >= 0) st_na_f32(wdst + lane, __ldg(p.topk_w + c));
        }
        if (lane == 0) atomicAdd(&s_cnt[s], units);
    }
    __syncthreads();
    if (tid < R && s_cnt[tid] > 0) {
        __threadfence_system();
        atomic_add_release_sys(ep_el_at<int>(a, tid, a.off_comb_from) + me, s_cnt[tid]);
    }
    __syncthreads();
    if (tid == 0 && el_last_block(a)) atomicExch(el_call_seq(a), epoch);
}

// =================================================================================================
// combine reduce: the origin sums what came back, in V2's order (origin side, no communication)
// =================================================================================================
extern "C" __global__ void __launch_bounds__(EP_ELASTIC_THREADS, 1)
ep_elastic_combine_reduce(ElasticArgs a, ElasticReduceParams p, EpDiag diag) {
    __shared__ int s_abort;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int R = a.num_ranks, me = a.rank;
    const int K = p.num_topk, H = p.hidden, E = p.num_experts, L = E / R, NS = p.nslots, T = p.max_tokens;
    if (tid == 0) s_abort = 0;
    __syncthreads();
    if (tid < R) {
        const int want = p.per_rank ? p.send_counts[tid] : p.send_counts[R + tid];
        if (!el_wait_count(ep_el_at<int>(a, me, a.off_comb_from) + tid, want, diag, EP_PHASE_ELASTIC_COMBINE_RECV, tid)) s_abort = 1;
    }
    __syncthreads();
    if (s_abort) return;
    const int64_t hb = static_cast<int64_t>(H) * 2;
    const int n16 = static_cast<int>(hb / 16);
    const char* region = reinterpret_cast<const char*>(a.peer_base[me] + a.off_data);
    const float* wsrc = reinterpret_cast<const float*>(region + ep_align16(static_cast<int64_t>(T) * NS * hb));
    const int64_t gstride = static_cast<int64_t>(gridDim.x) * nwarps;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * nwarps + warp; t < p.num_tokens; t += gstride) {
        int dj = -1;
        if (lane < K) {
            const int64_t e = __ldg(p.topk_idx + t * K + lane);
            if (e >= 0 && e < E) dj = static_cast<int>(e / L);
        }
        const unsigned same = __match_any_sync(kElFull, dj);
        const unsigned take = p.per_rank ? __ballot_sync(kElFull, dj >= 0 && (31 - __clz(same)) == lane)
                                         : __ballot_sync(kElFull, dj >= 0);
        const int4* rows = reinterpret_cast<const int4*>(region + t * NS * hb);
        for (int q0 = 0; q0 < n16; q0 += 32) {
            const int q = q0 + lane;
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (q < n16) {
                if (p.bias0 != nullptr) ep_accumulate_bf16x8(acc, ld_nc_v4(reinterpret_cast<const int4*>(p.bias0 + t * H) + q));
                if (p.bias1 != nullptr) ep_accumulate_bf16x8(acc, ld_nc_v4(reinterpret_cast<const int4*>(p.bias1 + t * H) + q));
                int c = 0;
                for (unsigned mm = take; mm != 0; mm &= mm - 1, ++c) {
                    const int slot = p.per_rank ? c : __ffs(mm) - 1;
                    ep_accumulate_bf16x8(acc, ld_volatile_v4(rows + static_cast<int64_t>(slot) * n16 + q));
                }
                st_na_v4(reinterpret_cast<int4*>(p.out + t * H) + q, ep_pack_bf16x8(acc));
            }
        }
        if (p.out_w != nullptr && lane < K) p.out_w[t * K + lane] = dj >= 0 ? ld_volatile_f32(wsrc + t * K + lane) : 0.f;
    }
    __syncthreads();
    if (tid == 0 && el_last_block(a)) {
        for (int s = 0; s < R; ++s) st_relaxed_sys(ep_el_at<int>(a, me, a.off_comb_from) + s, 0);
    }
}

// =================================================================================================
// barrier: every rank of the group reached this point of its comm stream
// =================================================================================================
extern "C" __global__ void __launch_bounds__(32, 1)
ep_elastic_barrier(ElasticArgs a, EpDiag diag) {
    __shared__ int s_abort;
    __shared__ uint32_t s_epoch;
    if (threadIdx.x == 0) {
        s_abort = 0;
        s_epoch = el_next_epoch(a);
    }
    __syncthreads();
    const uint32_t epoch = s_epoch;
    if (!el_handshake(a, diag, epoch, EP_PHASE_ELASTIC_BARRIER, &s_abort)) return;
    if (threadIdx.x == 0) atomicExch(el_call_seq(a), epoch);
}
