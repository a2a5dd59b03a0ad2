// Internode normal-mode dispatch/combine: the two-hop scheme over NVSHMEM's public device API.
//
// Ranks form hosts of `ranks_per_host` GPUs. Source rank s = (hs, ls) sends each token ONCE per
// destination host hd, to the forwarder f = (hd, ls) (same local index), with
// `nvshmemx_putmem_signal_nbi_block` (any NVSHMEM transport: IBGDA, IBRC, UCX, P2P). The records
// for its own host are written straight into its own receive region. Every destination GPU d of
// host hd then PULLS the records meant for it from the forwarders of its host over NVLink
// (`nvshmem_ptr`; a plain local copy when ranks_per_host == 1). Combine is the reverse: each
// forwarder pulls the rows of its host's ranks over NVLink, sums them in f32, rounds to bf16 and
// puts one partial per (token, host) back to the origin, which sums host partials + biases in f32.
//
// Kernels (all take `EpDiag` last; every wait is bounded by `EpWait`):
//   internode_notify   (1 block)  barrier, count exchange across hosts (stage 1: every rank puts
//                                 its per-channel counts to every rank), prefix sums, host-mapped
//                                 counters, then inside the host (stage 2: output offsets to the
//                                 local forwarders).
//   internode_cached_notify (1 block) seq-tagged all-rank barrier (cached dispatch, combine); named
//                       like DeepEP's cached_notify, the kernel in that place (profiler-based tools find it).
//   internode_dispatch (2C blocks) blocks [0,C): senders of channel c; [C,2C): pullers of channel c.
//   internode_combine  (2C blocks) blocks [0,C): forwarders (reduce + put back); [C,2C): receivers.
//
// Ordering rules used throughout:
//   * control signals (barrier, notify messages) are u64 set to `seq` (strictly increasing per
//     call) and waited for with `>= seq`: no reset, stale values never satisfy a wait;
//   * data signals (`disp_sig`, `comb_sig`: one u64 per (host, channel) chunk) are round
//     BITMASKS: a chunk's records are published in rounds of `round_size()` records (at most 64
//     rounds), each with NVSHMEM_SIGNAL_ADD of its own bit(s) (or a release add on the
//     producer's own memory), as soon as they are written; a consumer waits for the bit of the
//     round it reads. Packing, the inter-host put and the NVLink pull overlap, and nothing
//     assumes that separate puts are delivered in order (each signal covers only its own data,
//     bits are disjoint so the adds commute). Data signals are double-buffered by call parity
//     (the host passes the half of `seq & 1`); each rank zeroes its own half for this call before
//     it tells the others it arrived at the call's barrier: nobody adds for this call before
//     that, a peer still finishing the previous call polls the other half, and every add of the
//     call two back was waited for (hence landed);
//   * a producer makes its data visible with `__threadfence_system()` by every writing thread,
//     `__syncthreads()`, then one release operation (own memory) or an NVSHMEM put-with-signal /
//     signal op (NVSHMEM orders the signal after the data);
//   * a consumer acquires the signal (`ld.acquire.sys`) in one thread, `__syncthreads()` /
//     `__syncwarp()`, then reads the data with volatile (L1-bypassing) loads;
//   * buffer reuse across calls is protected by the barrier at the start of notify / the barrier
//     kernel: when a rank passes it, every rank has finished all kernels of the previous call.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../common.cuh"
#include "internode.cuh"

#define FULL_MASK 0xffffffffu

namespace {

__device__ __forceinline__ int align16(int v) { return (v + 15) & ~15; }

// Exclusive prefix of a per-thread flag over the whole block; `total` = number of set flags.
// Must be called by every thread of the block (contains two __syncthreads). `scratch` >= 32 ints.
__device__ __forceinline__ int block_excl_scan(bool flag, int* scratch, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const unsigned b = __ballot_sync(FULL_MASK, flag);
    if (lane == 0) scratch[warp] = __popc(b);
    __syncthreads();
    int off = 0, tot = 0;
    for (int i = 0; i < nw; ++i) {
        const int v = scratch[i];
        if (i < warp) off += v;
        tot += v;
    }
    __syncthreads();
    total = tot;
    return off + __popc(b & ((1u << lane) - 1u));
}

// Wait (one thread) until a u64 signal reaches `seq`. Returns false on timeout/abort.
__device__ __forceinline__ bool wait_signal(const EpDiag& diag, const uint64_t* sig, uint64_t seq,
                                            int phase, int channel, int peer) {
    EpWait w(diag);
    while (ld_acquire_sys_u64(sig) < seq) {
        if (!w.tick(phase, channel, peer)) return false;
    }
    return true;
}

// Wait (one thread) until bit `bit` of a round bitmask is set. Returns false on timeout/abort.
__device__ __forceinline__ bool wait_bit(const EpDiag& diag, const uint64_t* sig, int bit, int phase, int channel,
                                         int peer) {
    EpWait w(diag);
    while (((ld_acquire_sys_u64(sig) >> bit) & 1ull) == 0ull) {
        if (!w.tick(phase, channel, peer, bit)) return false;
    }
    return true;
}

// Records per publication round: a chunk holds at most ceil(max_tokens / C) records, so at most
// 64 rounds (one bit each). Host validation keeps it <= the 512 threads of a block.
__device__ __forceinline__ int round_size(const InternodeArgs& a) {
    return max(32, ceil_div(ceil_div(a.max_tokens, a.num_channels), 64));
}

// Bits [r0, r1) of a round bitmask.
__device__ __forceinline__ uint64_t round_bits(int r0, int r1) {
    const uint64_t hi = r1 >= 64 ? ~0ull : ((1ull << r1) - 1ull);
    return hi & ~((1ull << r0) - 1ull);
}

__device__ __forceinline__ void red_add_release_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Channel c owns tokens [min(c*ceil(N/C), N), min((c+1)*ceil(N/C), N)).
__device__ __forceinline__ void channel_range(int n, int C, int c, int& t0, int& t1) {
    const int per = ceil_div(n, C);
    t0 = min(c * per, n);
    t1 = min((c + 1) * per, n);
}

// Record layout inside a dispatch slot (all offsets multiples of 16 where data follows):
//   [0] i32 src token index, [4] u32 local destination mask, [8..16) reserved,
//   [16] i32 topk ids [K] (global), [16+4K] f32 weights [K], [align16(16+8K)] f32 scales [S],
//   [.. + align16(4S)] payload H*elem bytes.
struct RecLayout {
    int idx_off, w_off, sc_off, data_off, row_bytes;
    __device__ __forceinline__ RecLayout(const InternodeArgs& a) {
        idx_off = 16;
        w_off = 16 + 4 * a.topk;
        sc_off = align16(16 + 8 * a.topk);
        data_off = sc_off + align16(4 * a.num_scales);
        row_bytes = a.hidden * a.elem_bytes;
    }
};
// Combine record: [0] f32 weight sums [K], [align16(4K)] bf16 partial row [H].
__device__ __forceinline__ int comb_data_off(const InternodeArgs& a) { return align16(4 * a.topk); }

__device__ __forceinline__ uint8_t* region(uint8_t* base, const InternodeArgs& a, int host, int slot) {
    return base + ((size_t)host * a.max_tokens + slot) * (size_t)a.rec_stride;
}

// Whether an earlier call recorded an error (a failed barrier), agreed on by the whole block
// through *s_flag: then this call must not write into peers.
__device__ __forceinline__ bool block_aborted(const EpDiag& diag, int* s_flag) {
    if (threadIdx.x == 0) *s_flag = ep_aborted(diag) ? 1 : 0;
    __syncthreads();
    return *s_flag != 0;
}

// Seq-tagged barrier over all ranks, executed by one block; on return every rank has at least
// entered the same call (so it finished all kernels of the previous one) and has zeroed its data
// counters for this call. Returns false (all threads) on timeout.
__device__ __forceinline__ bool all_rank_barrier(const InternodeArgs& a, const EpDiag& diag, int* s_fail) {
    const int tid = threadIdx.x;
    if (tid == 0) *s_fail = 0;
    // This call's data counters start at 0 (see the ordering rules at the top).
    for (int i = tid; i < a.num_hosts * a.num_channels; i += blockDim.x) {
        a.disp_sig[i] = 0;
        a.comb_sig[i] = 0;
    }
    __threadfence_system();
    __syncthreads();
    for (int p = tid; p < a.world; p += blockDim.x)
        nvshmemx_signal_op(a.bar_sig + a.rank, a.seq, NVSHMEM_SIGNAL_SET, p);
    for (int p = tid; p < a.world; p += blockDim.x)
        if (!wait_signal(diag, a.bar_sig + p, a.seq, EP_PHASE_BARRIER, -1, p)) *s_fail = 1;
    __syncthreads();
    return *s_fail == 0;
}

// Base of `rdma_recv` on the rank with this rank's local index on host h, when records may be
// written there directly (p2p_direct and load/store-reachable), else null (stage + put).
// Executed by threads [0, NH) of the block into s_remote.
__device__ __forceinline__ void remote_bases(const InternodeArgs& a, uint8_t** s_remote) {
    const int h = threadIdx.x;
    if (h < a.num_hosts) {
        uint8_t* p = nullptr;
        if (a.p2p_direct && h != a.my_host)
            p = reinterpret_cast<uint8_t*>(nvshmem_ptr(a.rdma_recv, h * a.ranks_per_host + a.my_local));
        s_remote[h] = p;
    }
}

// Publish `bits` of a data signal on `pe` after this block's direct (NVLink) stores: every
// writer fenced and the block synced before; thread 0 fences again (release) and adds.
__device__ __forceinline__ void signal_after_stores(uint64_t* sig, uint64_t bits, int pe) {
    if (threadIdx.x == 0) {
        __threadfence_system();
        nvshmemx_signal_op(sig, bits, NVSHMEM_SIGNAL_ADD, pe);
    }
}

// 16 B loads a lane keeps in flight in the dispatch copies (latency-bound: more = faster).
#define EP_COPY_DEPTH 8

// Bulk copy of `bytes` (multiple of 16) by one warp with EP_COPY_DEPTH x 16 B loads in flight per lane.
// kPeerSrc: the source may have been written by another GPU (volatile, L1-bypassing loads);
// otherwise it is read-only input of this kernel (non-coherent path).
template <bool kPeerSrc>
__device__ __forceinline__ int4 load16(const int4* p) {
    return kPeerSrc ? ld_volatile_v4(p) : ld_nc_v4(p);
}
template <bool kPeerSrc>
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
    constexpr int kDepth = EP_COPY_DEPTH;
    const int n = bytes / 16;
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    int i = lane;
    for (; i + 32 * (kDepth - 1) < n; i += 32 * kDepth) {
        int4 v[kDepth];
#pragma unroll
        for (int u = 0; u < kDepth; ++u) v[u] = load16<kPeerSrc>(s + i + 32 * u);
#pragma unroll
        for (int u = 0; u < kDepth; ++u) st_na_v4(d + i + 32 * u, v[u]);
    }
    for (; i < n; i += 32) st_na_v4(d + i, load16<kPeerSrc>(s + i));
}

// Round to nearest even (NaN kept quiet), same as __float2bfloat16_rn.
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
__device__ __forceinline__ void acc_bf16x8(float* acc, const int4& v) {
    const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += __uint_as_float(w[i] << 16);
        acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = (uint32_t)f32_to_bf16(acc[2 * i]) | ((uint32_t)f32_to_bf16(acc[2 * i + 1]) << 16);
    return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
}

// A lane's group of EP_COMB_COLS 16-byte columns of a bf16 row: column q = qb + u*32 + lane.
#define EP_COMB_COLS 6
struct ColAcc {
    float v[EP_COMB_COLS][8];
    __device__ __forceinline__ ColAcc() {
#pragma unroll
        for (int u = 0; u < EP_COMB_COLS; ++u)
#pragma unroll
            for (int e = 0; e < 8; ++e) v[u][e] = 0.0f;
    }
    // Add the group of `row` (all loads first: EP_COMB_COLS in flight). kPeerSrc: see load16.
    template <bool kPeerSrc>
    __device__ __forceinline__ void add(const int4* row, int qb, int nvec, int lane) {
        int4 x[EP_COMB_COLS];
#pragma unroll
        for (int u = 0; u < EP_COMB_COLS; ++u) {
            const int q = qb + u * 32 + lane;
            x[u] = q < nvec ? load16<kPeerSrc>(row + q) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < EP_COMB_COLS; ++u) acc_bf16x8(v[u], x[u]);
    }
    // Round to bf16 and store the group into `row`.
    __device__ __forceinline__ void store(int4* row, int qb, int nvec, int lane) const {
#pragma unroll
        for (int u = 0; u < EP_COMB_COLS; ++u) {
            const int q = qb + u * 32 + lane;
            if (q < nvec) st_na_v4(row + q, pack_bf16x8(v[u]));
        }
    }
};

}  // namespace

// =================================================================================================
// notify: one block of 1024 threads.
// =================================================================================================
extern "C" __global__ void __launch_bounds__(1024, 1)
internode_notify(InternodeArgs a, EpDiag diag) {
    __shared__ int s_cnt[EP_INTERNODE_MAX_RC];                                   // [world][C]
    __shared__ int s_ecnt[EP_INTERNODE_MAX_EXPERTS];                             // [E]
    __shared__ int s_hoff[EP_INTERNODE_MAX_HOSTS * (EP_INTERNODE_MAX_CHANNELS + 1)];
    __shared__ int s_run[EP_INTERNODE_MAX_HOSTS];
    __shared__ int s_scan[32];
    __shared__ int s_rank_pre[EP_INTERNODE_MAX_RANKS + 1];
    __shared__ int s_fail;

    const int tid = threadIdx.x, NT = blockDim.x;
    const int R = a.world, P = a.ranks_per_host, NH = a.num_hosts, C = a.num_channels;
    const int E = a.num_experts, L = E / R, K = a.topk, N = a.num_tokens;
    const int ms = a.meta_stride;

    for (int i = tid; i < R * C; i += NT) s_cnt[i] = 0;
    for (int i = tid; i < E; i += NT) s_ecnt[i] = 0;
    if (tid < NH) s_run[tid] = 0;

    // Barrier: every rank finished the previous call, so the notify buffers are free.
    if (!all_rank_barrier(a, diag, &s_fail)) return;

    // ---- stage 0: count, and give every token its slot in each destination host's region.
    for (int c = 0; c < C; ++c) {
        int t0, t1;
        channel_range(N, C, c, t0, t1);
        if (tid < NH) s_hoff[tid * (C + 1) + c] = s_run[tid];
        __syncthreads();
        for (int base = t0; base < t1; base += NT) {
            const int t = base + tid;
            const bool valid = t < t1;
            uint32_t hostmask = 0;
            if (valid) {
                const int64_t* row = a.topk_idx + (size_t)t * K;
                for (int k = 0; k < K; ++k) {
                    const int64_t e = row[k];
                    if (e < 0 || e >= E) {
                        // -1, or an id that points nowhere: dropped (counted nowhere, sent nowhere,
                        // and the sender writes -1 in its record); the latter is recorded.
                        if (e != -1)
                            ep_record_bad_expert(diag, EP_PHASE_INTERNODE_NOTIFY, (uint64_t)t * K + k, e, K, E);
                        continue;
                    }
                    atomicAdd(&s_ecnt[e], 1);
                    const int r = (int)(e / L);
                    bool dup = false;
                    for (int k2 = 0; k2 < k; ++k2) {
                        const int64_t e2 = row[k2];
                        if (e2 >= 0 && e2 < E && (int)(e2 / L) == r) { dup = true; break; }
                    }
                    if (!dup) {
                        atomicAdd(&s_cnt[r * C + c], 1);
                        hostmask |= 1u << (r / P);
                    }
                }
            }
            for (int h = 0; h < NH; ++h) {
                const bool flag = valid && ((hostmask >> h) & 1u);
                int total;
                const int pre = block_excl_scan(flag, s_scan, total);
                if (valid) {
                    int slot = -1;
                    uint32_t lmask = 0;
                    if (flag) {
                        slot = s_run[h] + pre;
                        const int64_t* row = a.topk_idx + (size_t)t * K;
                        for (int k = 0; k < K; ++k) {
                            const int64_t e = row[k];
                            if (e < 0 || e >= E) continue;
                            const int r = (int)(e / L);
                            if (r / P == h) lmask |= 1u << (r % P);
                        }
                    }
                    a.send_slot[(size_t)t * NH + h] = slot;
                    a.send_lmask[(size_t)t * NH + h] = (uint8_t)lmask;
                }
                __syncthreads();  // everyone read s_run[h]
                if (tid == 0) s_run[h] += total;
                __syncthreads();
            }
        }
    }
    if (tid < NH) s_hoff[tid * (C + 1) + C] = s_run[tid];
    __syncthreads();
    for (int i = tid; i < NH * (C + 1); i += NT) a.send_off[i] = s_hoff[i];

    // ---- stage 1: message to every rank d: cnt[d][c] (C), records to d's host per channel (C),
    //      this rank's token count per expert of d (L).
    for (int i = tid; i < R * ms; i += NT) {
        const int d = i / ms, j = i - d * ms;
        int v = 0;
        if (j < C) v = s_cnt[d * C + j];
        else if (j < 2 * C) {
            const int h = d / P, c = j - C;
            v = s_hoff[h * (C + 1) + c + 1] - s_hoff[h * (C + 1) + c];
        } else if (j < 2 * C + L) v = s_ecnt[d * L + (j - 2 * C)];
        a.meta_send[i] = v;
    }
    __threadfence_system();
    __syncthreads();
    {
        const int warp = tid >> 5, nw = NT >> 5;
        for (int d = warp; d < R; d += nw)
            nvshmemx_putmem_signal_nbi_warp(a.meta_recv + (size_t)a.rank * ms, a.meta_send + (size_t)d * ms,
                                            (size_t)ms * sizeof(int32_t), a.meta_sig + a.rank, a.seq,
                                            NVSHMEM_SIGNAL_SET, d);
    }
    for (int s = tid; s < R; s += NT)
        if (!wait_signal(diag, a.meta_sig + s, a.seq, EP_PHASE_INTERNODE_NOTIFY, -1, s)) s_fail = 1;
    __syncthreads();
    if (s_fail) return;

    // ---- prefix sums over sources (rank order) and channels.
    if (tid == 0) {
        int run = 0;
        for (int s = 0; s < R; ++s) {
            s_rank_pre[s] = run;
            for (int c = 0; c < C; ++c) run += ld_volatile(a.meta_recv + (size_t)s * ms + c);
        }
        s_rank_pre[R] = run;
    }
    __syncthreads();
    for (int s = tid; s < R; s += NT) {
        const int32_t* m = a.meta_recv + (size_t)s * ms;
        int run = s_rank_pre[s], hrun = 0;
        for (int c = 0; c < C; ++c) {
            a.recv_off[s * (C + 1) + c] = run;
            a.rdma_off[s * (C + 1) + c] = hrun;
            run += ld_volatile(m + c);
            hrun += ld_volatile(m + C + c);
        }
        a.recv_off[s * (C + 1) + C] = run;
        a.rdma_off[s * (C + 1) + C] = hrun;
    }
    for (int le = tid; le < L; le += NT) {
        int sum = 0;
        for (int s = 0; s < R; ++s) sum += ld_volatile(a.meta_recv + (size_t)s * ms + 2 * C + le);
        const int al = a.expert_alignment;
        a.host_counters[2 + le] = (sum + al - 1) / al * al;
    }
    if (tid == 0) a.host_counters[1] = s_rank_pre[R];
    __threadfence_system();
    __syncthreads();
    if (tid == 0)
        *reinterpret_cast<volatile int32_t*>(a.host_counters) = (int32_t)(a.seq & 0x7fffffffu);

    // ---- stage 2 (inside the host): tell local peer ld where my rows of sources (hs, ld) start,
    //      so that it can gather them in combine.
    const int nhc = NH * C;
    for (int i = tid; i < P * nhc; i += NT) {
        const int ld = i / nhc, j = i - ld * nhc, hs = j / C, c = j - hs * C;
        const int s = hs * P + ld;
        a.fmeta_send[i] = a.recv_off[s * (C + 1) + c];
    }
    __threadfence_system();
    __syncthreads();
    {
        const int warp = tid >> 5;
        if (warp < P)
            nvshmemx_putmem_signal_nbi_warp(a.fmeta_recv + (size_t)a.my_local * nhc,
                                            a.fmeta_send + (size_t)warp * nhc, (size_t)nhc * sizeof(int32_t),
                                            a.fwd_sig + a.my_local, a.seq, NVSHMEM_SIGNAL_SET,
                                            a.my_host * P + warp);
    }
    if (tid < P && !wait_signal(diag, a.fwd_sig + tid, a.seq, EP_PHASE_INTERNODE_NOTIFY, -2,
                                a.my_host * P + tid))
        s_fail = 1;
    __syncthreads();
    if (s_fail) return;
    for (int i = tid; i < P * nhc; i += NT) {
        const int ld = i / nhc, j = i - ld * nhc;  // j = hs * C + c
        a.fwd_base[j * P + ld] = ld_volatile(a.fmeta_recv + i);
    }
}

// =================================================================================================
// barrier: one block (>= world threads preferred).
// =================================================================================================
extern "C" __global__ void __launch_bounds__(256, 1)
internode_cached_notify(InternodeArgs a, EpDiag diag) {
    __shared__ int s_fail;
    all_rank_barrier(a, diag, &s_fail);
}

// =================================================================================================
// dispatch: 2C blocks x 512 threads.
// =================================================================================================
#define EP_INTERNODE_THREADS 512

// Tokens a sender block packs between two publication checks.
#define EP_INTERNODE_SEND_BATCH 32

__device__ __forceinline__ void dispatch_sender(const InternodeArgs& a, const int c, int* s_pub, int* s_end,
                                                uint8_t** s_remote) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int NH = a.num_hosts, K = a.topk, S = a.num_scales, C = a.num_channels;
    const int RS = round_size(a);
    const RecLayout L(a);
    int t0, t1;
    channel_range(a.num_tokens, C, c, t0, t1);
    // Per destination host, relative to the chunk start: records written / published.
    if (tid < NH) s_pub[tid] = s_end[tid] = 0;
    remote_bases(a, s_remote);
    __syncthreads();

    for (int b0 = t0; b0 < t1; b0 += EP_INTERNODE_SEND_BATCH) {
        const int b1 = min(b0 + EP_INTERNODE_SEND_BATCH, t1);
        for (int t = b0 + warp; t < b1; t += nw) {
            // Lane h < NH describes destination host h: its slot, local mask and record address.
            const int slot_l = lane < NH ? a.send_slot[(size_t)t * NH + lane] : -1;
            const uint32_t lm_l = lane < NH ? a.send_lmask[(size_t)t * NH + lane] : 0u;
            // Own host: straight into the own receive region; a reachable remote host (p2p_direct):
            // straight into its receive region; otherwise the staging region for the put.
            uint8_t* rec_l = nullptr;
            if (slot_l >= 0) {
                uint8_t* remote = s_remote[lane];  // null for the own host
                uint8_t* base = lane == a.my_host ? a.rdma_recv : (remote != nullptr ? remote : a.rdma_send);
                rec_l = region(base, a, remote != nullptr ? a.my_host : lane, slot_l);
            }
            const uint32_t dests = __ballot_sync(FULL_MASK, slot_l >= 0);
            if (dests == 0) continue;
            // Metadata (the loop over `dests` is warp-uniform, so full-mask shuffles are safe).
            for (uint32_t m = dests; m; m &= m - 1) {
                const int h = __ffs(m) - 1;
                const uint32_t lm = __shfl_sync(FULL_MASK, lm_l, h);
                uint8_t* rec = reinterpret_cast<uint8_t*>(
                    __shfl_sync(FULL_MASK, reinterpret_cast<unsigned long long>(rec_l), h));
                if (lane == 0) {
                    reinterpret_cast<int32_t*>(rec)[0] = t;
                    reinterpret_cast<uint32_t*>(rec)[1] = lm;
                }
                for (int k = lane; k < K; k += 32) {
                    const int64_t e = a.topk_idx[(size_t)t * K + k];  // bad ids: recorded by notify
                    reinterpret_cast<int32_t*>(rec + L.idx_off)[k] = (e >= 0 && e < a.num_experts) ? (int32_t)e : -1;
                    reinterpret_cast<float*>(rec + L.w_off)[k] =
                        a.topk_weights ? a.topk_weights[(size_t)t * K + k] : 0.0f;
                }
                for (int i = lane; i < S; i += 32)
                    reinterpret_cast<float*>(rec + L.sc_off)[i] = a.x_scales[(size_t)t * S + i];
            }
            // Payload: each 16 B loaded once (EP_COPY_DEPTH per lane in flight), stored to every destination
            // host's record. Loop bounds are warp-uniform (shuffles inside).
            const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * L.row_bytes);
            const int nvec = L.row_bytes / 16;
            for (int ib = 0; ib < nvec; ib += 32 * EP_COPY_DEPTH) {
                int4 v[EP_COPY_DEPTH];
#pragma unroll
                for (int u = 0; u < EP_COPY_DEPTH; ++u) {
                    const int q = ib + u * 32 + lane;
                    v[u] = q < nvec ? ld_nc_v4(src + q) : make_int4(0, 0, 0, 0);
                }
                for (uint32_t m = dests; m; m &= m - 1) {
                    int4* dst = reinterpret_cast<int4*>(
                        reinterpret_cast<uint8_t*>(__shfl_sync(FULL_MASK, reinterpret_cast<unsigned long long>(rec_l),
                                                               __ffs(m) - 1)) +
                        L.data_off);
#pragma unroll
                    for (int u = 0; u < EP_COPY_DEPTH; ++u) {
                        const int q = ib + u * 32 + lane;
                        if (q < nvec) st_na_v4(dst + q, v[u]);
                    }
                }
            }
        }
        // Records written for host h so far: one past the last slot a token up to b1 has there.
        if (tid < NH) {
            for (int t = b1 - 1; t >= b0; --t) {
                const int sl = a.send_slot[(size_t)t * NH + tid];
                if (sl >= 0) {
                    s_end[tid] = sl + 1 - a.send_off[tid * (C + 1) + c];
                    break;
                }
            }
        }
        // Publish every complete round (all remaining records after the last batch): remote hosts
        // through NVSHMEM put + round bits, own host with a release add on the own bitmask
        // (local peers pull from it over NVLink).
        __threadfence_system();
        __syncthreads();
        const bool last = b1 == t1;
        for (int h = 0; h < NH; ++h) {
            const int pub = s_pub[h], end = s_end[h];
            const int hi = last ? end : end / RS * RS;
            if (hi <= pub) continue;
            const uint64_t bits = round_bits(pub / RS, ceil_div(hi, RS));
            const int off = a.send_off[h * (C + 1) + c] + pub;
            uint64_t* sig = a.disp_sig + a.my_host * C + c;
            if (h == a.my_host) {
                if (tid == 0) red_add_release_sys_u64(sig, bits);
            } else if (s_remote[h] != nullptr) {
                signal_after_stores(sig, bits, h * a.ranks_per_host + a.my_local);
            } else {
                nvshmemx_putmem_signal_nbi_block(region(a.rdma_recv, a, a.my_host, off), region(a.rdma_send, a, h, off),
                                                 (size_t)(hi - pub) * a.rec_stride, sig, bits, NVSHMEM_SIGNAL_ADD,
                                                 h * a.ranks_per_host + a.my_local);
            }
        }
        __syncthreads();
        if (tid < NH) s_pub[tid] = last ? s_end[tid] : max(s_pub[tid], s_end[tid] / RS * RS);
    }
    // Complete every put of this call before the kernel ends (the staging region is reused by
    // the next call; the barrier already guarantees it, this keeps the transport's queue short).
    __syncthreads();
    if (tid == 0) nvshmem_quiet();
}

__device__ __forceinline__ void dispatch_puller(const InternodeArgs& a, const EpDiag& diag, const int c, int* s_scan,
                                                int* s_pos, int* s_fail) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int R = a.world, P = a.ranks_per_host, C = a.num_channels, K = a.topk, S = a.num_scales;
    const int L = a.num_experts / R;
    const int64_t lo = (int64_t)a.rank * L, hi = lo + L;
    const RecLayout RL(a);

    for (int si = 0; si < R; ++si) {
        const int s = (a.rank + si) % R;
        const int hs = s / P, ls = s % P;
        const int f = a.my_host * P + ls;  // forwarder of s on this host
        const bool self_fwd = (f == a.rank);
        const int roff = a.rdma_off[s * (C + 1) + c];
        const int n_rec = a.rdma_off[s * (C + 1) + c + 1] - roff;
        const int out0 = a.recv_off[s * (C + 1) + c];
        const int my_cnt = a.recv_off[s * (C + 1) + c + 1] - out0;
        if (n_rec == 0 || (my_cnt == 0 && !self_fwd)) continue;

        const uint64_t* sig = a.disp_sig + hs * C + c;
        const uint8_t* rbase = region(a.rdma_recv, a, hs, roff);
        if (!self_fwd) {
            sig = reinterpret_cast<const uint64_t*>(nvshmem_ptr(sig, f));
            rbase = reinterpret_cast<const uint8_t*>(nvshmem_ptr(rbase, f));
            if (sig == nullptr || rbase == nullptr) {  // host validation should have caught this
                if (tid == 0)
                    ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_INTERNODE_DISPATCH, c, f, -1, 0);
                return;
            }
        }
        int run = 0;
        const int RS = round_size(a);
        for (int jb = 0; jb < n_rec; jb += RS) {
            // Round jb / RS of the chunk: wait for its bit, then take its records.
            if (tid == 0 && !wait_bit(diag, sig, jb / RS, EP_PHASE_INTERNODE_DISPATCH, c, s)) *s_fail = 1;
            __syncthreads();
            if (*s_fail) return;
            const int cnt_round = min(RS, n_rec - jb);
            const int j = jb + tid;
            uint32_t m = 0;
            if (tid < cnt_round) {
                m = (uint32_t)ld_volatile(reinterpret_cast<const int*>(rbase + (size_t)j * a.rec_stride) + 1);
                if (self_fwd) a.fwd_mask[(size_t)hs * a.max_tokens + roff + j] = (uint8_t)m;
            }
            const bool mine = (m >> a.my_local) & 1u;
            int total;
            const int pre = block_excl_scan(mine, s_scan, total);
            if (mine) s_pos[pre] = j;
            __syncthreads();
            for (int i = warp; i < total; i += nw) {
                const int row = out0 + run + i;
                if (run + i >= my_cnt) break;  // inconsistent counts: reported below
                const uint8_t* rec = rbase + (size_t)s_pos[i] * a.rec_stride;
                if (lane == 0) a.recv_src_idx[row] = ld_volatile(reinterpret_cast<const int*>(rec));
                for (int k = lane; k < K; k += 32) {
                    const int64_t e = ld_volatile(reinterpret_cast<const int*>(rec + RL.idx_off) + k);
                    const bool local = e >= lo && e < hi;
                    const int wbits = ld_volatile(reinterpret_cast<const int*>(rec + RL.w_off) + k);
                    a.recv_topk_idx[(size_t)row * K + k] = local ? e - lo : -1;
                    a.recv_topk_weights[(size_t)row * K + k] = local ? __int_as_float(wbits) : 0.0f;
                }
                for (int q = lane; q < S; q += 32)
                    a.recv_scales[(size_t)row * S + q] =
                        __int_as_float(ld_volatile(reinterpret_cast<const int*>(rec + RL.sc_off) + q));
                warp_copy<true>(a.recv_x + (size_t)row * RL.row_bytes, rec + RL.data_off, RL.row_bytes, lane);
            }
            run += total;
            __syncthreads();
        }
        if (tid == 0 && run != my_cnt)
            ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_INTERNODE_DISPATCH, c, s, run - my_cnt, 0);
    }
}

extern "C" __global__ void __launch_bounds__(EP_INTERNODE_THREADS, 1)
internode_dispatch(InternodeArgs a, EpDiag diag) {
    __shared__ int s_scan[32];
    __shared__ int s_pos[EP_INTERNODE_THREADS];
    __shared__ int s_pub[EP_INTERNODE_MAX_HOSTS];
    __shared__ int s_end[EP_INTERNODE_MAX_HOSTS];
    __shared__ uint8_t* s_remote[EP_INTERNODE_MAX_HOSTS];
    __shared__ int s_fail;
    if (block_aborted(diag, &s_fail)) return;
    const int C = a.num_channels;
    if ((int)blockIdx.x < C) dispatch_sender(a, blockIdx.x, s_pub, s_end, s_remote);
    else dispatch_puller(a, diag, blockIdx.x - C, s_scan, s_pos, &s_fail);
}

// =================================================================================================
// combine: 2C blocks x 512 threads. Input rows were copied into comb_in[comb_parity] (and weights
// into comb_w[comb_parity]) by the host before the barrier kernel that precedes this one.
// =================================================================================================
__device__ __forceinline__ void combine_forwarder(const InternodeArgs& a, const EpDiag& diag, const int c, int* s_scan, int* s_rows,
                                  int* s_run, const uint8_t** s_peer_in, const float** s_peer_w, uint8_t** s_remote) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int P = a.ranks_per_host, NH = a.num_hosts, C = a.num_channels, K = a.topk, H = a.hidden;
    const int row_bytes = H * 2;
    const int doff = comb_data_off(a);

    // Rows of the local peers: their staged copies over NVLink; this rank's own rows straight
    // from its combine input.
    if (tid < P) {
        const int pe = a.my_host * P + tid;
        const uint8_t* in = a.comb_in + (size_t)a.comb_parity * a.comb_in_half;
        const float* w = a.comb_w + (size_t)a.comb_parity * a.comb_w_half;
        if (pe == a.rank) {
            s_peer_in[tid] = a.comb_y;
            s_peer_w[tid] = a.comb_yw;
        } else {
            s_peer_in[tid] = reinterpret_cast<const uint8_t*>(nvshmem_ptr(in, pe));
            s_peer_w[tid] = reinterpret_cast<const float*>(nvshmem_ptr(w, pe));
            if (s_peer_in[tid] == nullptr || s_peer_w[tid] == nullptr)  // not NVLink-reachable
                ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_INTERNODE_FORWARD, c, pe, -1, 0);
        }
    }
    remote_bases(a, s_remote);
    __syncthreads();
    if (ep_aborted(diag)) return;  // nobody waits on this block's signals any more than the timeout

    for (int hi = 0; hi < NH; ++hi) {
        const int hs = (a.my_host + hi) % NH;  // origin host; origin rank (hs, my_local)
        const int s = hs * P + a.my_local;
        const int off = a.rdma_off[s * (C + 1) + c];
        const int n = a.rdma_off[s * (C + 1) + c + 1] - off;
        const bool own = hs == a.my_host;
        // Partials go straight into the origin's receive region when it is this rank (own host)
        // or reachable with p2p_direct; otherwise into the staging region for the put.
        uint8_t* dst = own                       ? region(a.rdma_recv, a, a.my_host, off)
                       : s_remote[hs] != nullptr ? region(s_remote[hs], a, a.my_host, off)
                                                 : region(a.rdma_send, a, hs, off);
        uint64_t* sig = a.comb_sig + a.my_host * C + c;
        if (tid < P) s_run[tid] = a.fwd_base[(hs * C + c) * P + tid];
        __syncthreads();
        const int RS = round_size(a);
        for (int jb = 0; jb < n; jb += RS) {
            const int cnt = min(RS, n - jb);
            const int j = jb + tid;
            const uint32_t m = tid < cnt ? a.fwd_mask[(size_t)hs * a.max_tokens + off + j] : 0u;
            for (int ld = 0; ld < P; ++ld) {
                const bool flag = (m >> ld) & 1u;
                int total;
                const int pre = block_excl_scan(flag, s_scan, total);
                s_rows[tid * EP_INTERNODE_MAX_RANKS_PER_HOST + ld] = flag ? s_run[ld] + pre : -1;
                __syncthreads();
                if (tid == 0) s_run[ld] += total;
                // next scan's first __syncthreads orders this update before any later read
            }
            __syncthreads();
            for (int i = warp; i < cnt; i += nw) {
                const int* rows = s_rows + i * EP_INTERNODE_MAX_RANKS_PER_HOST;
                uint8_t* rec = dst + (size_t)(jb + i) * a.rec_stride;
                // EP_COMB_COLS 16 B columns per lane and iteration: that many loads in flight.
                const int nvec = row_bytes / 16;
                int4* out = reinterpret_cast<int4*>(rec + doff);
                for (int qb = 0; qb < nvec; qb += 32 * EP_COMB_COLS) {
                    ColAcc acc;
                    for (int ld = 0; ld < P; ++ld) {  // ascending local rank: the contract's order
                        const int r = rows[ld];
                        if (r < 0) continue;
                        acc.add<true>(reinterpret_cast<const int4*>(s_peer_in[ld] + (size_t)r * row_bytes), qb, nvec, lane);
                    }
                    acc.store(out, qb, nvec, lane);
                }
                if (a.combined_w) {
                    for (int k = lane; k < K; k += 32) {
                        float w = 0.0f;
                        for (int ld = 0; ld < P; ++ld) {
                            const int r = rows[ld];
                            if (r < 0) continue;
                            w += __int_as_float(ld_volatile(reinterpret_cast<const int*>(s_peer_w[ld] + (size_t)r * K + k)));
                        }
                        reinterpret_cast<float*>(rec)[k] = w;
                    }
                }
            }
            // Publish this round's partials to the origin: a counting put (remote host) or a
            // release add on the own counter (the origin is this rank).
            __threadfence_system();
            __syncthreads();
            const uint64_t bit = 1ull << (jb / RS);
            if (own) {
                if (tid == 0) red_add_release_sys_u64(sig, bit);
            } else if (s_remote[hs] != nullptr) {
                signal_after_stores(sig, bit, s);
            } else {
                nvshmemx_putmem_signal_nbi_block(region(a.rdma_recv, a, a.my_host, off + jb),
                                                 dst + (size_t)jb * a.rec_stride, (size_t)cnt * a.rec_stride, sig,
                                                 bit, NVSHMEM_SIGNAL_ADD, s);
            }
            __syncthreads();
        }
    }
    __syncthreads();
    if (tid == 0) nvshmem_quiet();  // see dispatch_sender
}

__device__ __forceinline__ void combine_receiver(const InternodeArgs& a, const EpDiag& diag, const int c) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int NH = a.num_hosts, C = a.num_channels, K = a.topk, H = a.hidden;
    const int row_bytes = H * 2;
    const int doff = comb_data_off(a);
    int t0, t1;
    channel_range(a.num_tokens, C, c, t0, t1);

    const int nvec = row_bytes / 16;
    for (int t = t0 + warp; t < t1; t += nw) {
        // Lane h < NH: the partial of host h for token t (slot in region h), if any.
        const int slot_l = lane < NH ? a.send_slot[(size_t)t * NH + lane] : -1;
        const uint8_t* rec_l = slot_l >= 0 ? region(a.rdma_recv, a, lane, slot_l) : nullptr;
        const uint32_t hosts = __ballot_sync(FULL_MASK, slot_l >= 0);
        // Lane h waits until host h's forwarder published the round holding this token's partial;
        // then the warp syncs and reads.
        bool ok = true;
        if (slot_l >= 0) {
            const int rel = slot_l - a.send_off[lane * (C + 1) + c];
            ok = wait_bit(diag, a.comb_sig + lane * C + c, rel / round_size(a), EP_PHASE_INTERNODE_COMBINE, c,
                          lane * a.ranks_per_host + a.my_local);
        }
        if (!__all_sync(FULL_MASK, ok)) return;
        __syncwarp();
        const int4* b0 = a.comb_bias0 ? reinterpret_cast<const int4*>(a.comb_bias0 + (size_t)t * H) : nullptr;
        const int4* b1 = a.comb_bias1 ? reinterpret_cast<const int4*>(a.comb_bias1 + (size_t)t * H) : nullptr;
        int4* out = reinterpret_cast<int4*>(a.combined_x + (size_t)t * H);
        // EP_COMB_COLS 16 B columns per lane and iteration; the loop bounds are warp-uniform
        // (shuffles inside). Order: biases, then hosts ascending (the contract's order).
        for (int qb = 0; qb < nvec; qb += 32 * EP_COMB_COLS) {
            ColAcc acc;
            if (b0) acc.add<false>(b0, qb, nvec, lane);
            if (b1) acc.add<false>(b1, qb, nvec, lane);
            for (uint32_t m = hosts; m; m &= m - 1) {
                const int h = __ffs(m) - 1;
                const int4* rec = reinterpret_cast<const int4*>(reinterpret_cast<const uint8_t*>(
                    __shfl_sync(FULL_MASK, reinterpret_cast<unsigned long long>(rec_l), h)) + doff);
                acc.add<true>(rec, qb, nvec, lane);
            }
            acc.store(out, qb, nvec, lane);
        }
        if (a.combined_w) {
            float w = 0.0f;
            for (uint32_t m = hosts; m; m &= m - 1) {
                const int h = __ffs(m) - 1;
                const uint8_t* rec = reinterpret_cast<const uint8_t*>(
                    __shfl_sync(FULL_MASK, reinterpret_cast<unsigned long long>(rec_l), h));
                if (lane < K) w += __int_as_float(ld_volatile(reinterpret_cast<const int*>(rec) + lane));
            }
            if (lane < K) a.combined_w[(size_t)t * K + lane] = w;
        }
    }
}

extern "C" __global__ void __launch_bounds__(EP_INTERNODE_THREADS, 1)
internode_combine(InternodeArgs a, EpDiag diag) {
    __shared__ int s_scan[32];
    __shared__ int s_rows[EP_INTERNODE_THREADS * EP_INTERNODE_MAX_RANKS_PER_HOST];
    __shared__ int s_run[EP_INTERNODE_MAX_RANKS_PER_HOST];
    __shared__ const uint8_t* s_peer_in[EP_INTERNODE_MAX_RANKS_PER_HOST];
    __shared__ const float* s_peer_w[EP_INTERNODE_MAX_RANKS_PER_HOST];
    __shared__ uint8_t* s_remote[EP_INTERNODE_MAX_HOSTS];
    __shared__ int s_abort;
    if (block_aborted(diag, &s_abort)) return;
    const int C = a.num_channels;
    if ((int)blockIdx.x < C) combine_forwarder(a, diag, blockIdx.x, s_scan, s_rows, s_run, s_peer_in, s_peer_w, s_remote);
    else combine_receiver(a, diag, blockIdx.x - C);
}
