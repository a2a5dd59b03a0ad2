// Intranode (NVLink, CUDA IPC) notify / dispatch / combine. Design and memory ordering:
// see intranode.cuh (summary) and docs/kernels.md ("Intranode").
//
// Entry points (all take `EpDiag` last):
//   ep_intranode_notify                       grid 1 + R, kNotifyThreads
//   ep_intranode_dispatch_r{2,4,8}            grid num_sms, up to kMaxThreads
//   ep_intranode_combine_r{2,4,8}             grid num_sms, up to kMaxThreads (push + reduce warps)
// There is no separate "cached notify" kernel: with a cached handle the dispatch kernel's own
// ready handshake is all the synchronisation needed (no queues to clear, counters self-reset).
#include <cuda_bf16.h>

#include "intranode.cuh"

#define kNotifyThreads 512
#define kMaxThreads 768
#define kFullMask 0xffffffffu
// 16-byte loads in flight per lane of a combine pusher (one row of 7168 bf16 = 28 per lane).
#define kPushUnroll 7

// =========================================================================================
// notify: count exchange + prefix sums
// =========================================================================================
// Block 0: ready handshake, publish this rank's per-rank counts (to every rank) and its per-expert
// counts (each rank gets the counts of its own local experts), gather everyone's, write the count
// matrix to the handle and, host-mapped, M, the matrix and the aligned per-local-expert counts.
// Block 1 + d: send_pos[t][d] = exclusive prefix over t of is_token_in_rank[t][d] (-1 if not sent).
extern "C" __global__ void __launch_bounds__(kNotifyThreads, 1)
ep_intranode_notify(IntranodeArgs a, NotifyParams p, EpDiag diag) {
    const int tid = threadIdx.x;
    const int R = a.num_ranks, me = a.rank;
    if (blockIdx.x > 0) {
        const int d = blockIdx.x - 1;
        const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
        __shared__ int s_warp[kNotifyThreads / 32];
        int running = 0;
        for (int base = 0; base < p.num_tokens; base += blockDim.x) {
            const int t = base + tid;
            const bool f = t < p.num_tokens && p.is_token_in_rank[static_cast<long>(t) * R + d] != 0;
            const unsigned ballot = __ballot_sync(kFullMask, f);
            const int lane_prefix = __popc(ballot & ((1u << lane) - 1u));
            if (lane == 0) s_warp[warp] = __popc(ballot);
            __syncthreads();
            int warp_offset = 0, block_total = 0;
            for (int w = 0; w < nwarps; ++w) {
                const int c = s_warp[w];
                warp_offset += w < warp ? c : 0;
                block_total += c;
            }
            if (t < p.num_tokens)
                p.send_pos[static_cast<long>(t) * R + d] = f ? running + warp_offset + lane_prefix : -1;
            running += block_total;
            __syncthreads();
        }
        if (tid == 0 && running != p.tokens_per_rank[d])
            ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_NOTIFY, -1, d, running, 0);
        return;
    }

    __shared__ int s_abort;
    __shared__ int s_matrix[EP_INTRANODE_MAX_RANKS * EP_INTRANODE_MAX_RANKS];
    __shared__ int s_expert[EP_INTRANODE_MAX_LOCAL_EXPERTS];
    const int L = p.num_local_experts;
    for (int e = tid; e < L; e += blockDim.x) s_expert[e] = 0;
    if (!ep_ready_handshake(a, diag, EP_PHASE_NOTIFY, &s_abort)) return;

    const int W = R + L;  // values per (source, destination) pair
    const uint64_t tag = static_cast<uint64_t>(a.epoch) << 32;
    // Publish. Every value carries the epoch, so no separate flag (and no ordering) is needed.
    for (int i = tid; i < R * W; i += blockDim.x) {
        const int d = i / W, j = i % W;
        uint64_t* dst;
        uint32_t v;
        if (j < R) {
            dst = ep_at<uint64_t>(a, d, a.off_notify_rank) + me * R + j;
            v = static_cast<uint32_t>(p.tokens_per_rank[j]);
        } else {
            dst = ep_at<uint64_t>(a, d, a.off_notify_expert) +
                  static_cast<long>(me) * a.max_local_experts + (j - R);
            v = static_cast<uint32_t>(p.tokens_per_expert[d * L + (j - R)]);
        }
        st_relaxed_sys_u64(dst, tag | v);
    }
    // Gather what every source published into this rank's buffer.
    for (int i = tid; i < R * W; i += blockDim.x) {
        const int s = i / W, j = i % W;
        const uint64_t* src =
            j < R ? ep_at<uint64_t>(a, me, a.off_notify_rank) + s * R + j
                  : ep_at<uint64_t>(a, me, a.off_notify_expert) +
                        static_cast<long>(s) * a.max_local_experts + (j - R);
        EpWait w(diag);
        uint64_t v;
        bool ok = true;
        while (((v = ld_volatile_u64(src)) & 0xffffffff00000000ull) != tag) {
            if (!w.tick(EP_PHASE_NOTIFY, 0, s, j)) { ok = false; break; }
        }
        if (!ok) { s_abort = 1; break; }
        const int value = static_cast<int>(static_cast<uint32_t>(v));
        if (j < R) s_matrix[s * R + j] = value;
        else atomicAdd(&s_expert[j - R], value);
    }
    __syncthreads();
    if (s_abort) return;

    int32_t* host = p.host_out;
    for (int i = tid; i < R * R; i += blockDim.x) {
        p.count_matrix[i] = s_matrix[i];
        host[2 + i] = s_matrix[i];
    }
    for (int e = tid; e < L; e += blockDim.x) {
        const int c = s_expert[e], al = p.expert_alignment;
        host[2 + R * R + e] = (c + al - 1) / al * al;
    }
    if (tid == 0) {
        int m = 0;
        for (int s = 0; s < R; ++s) m += s_matrix[s * R + me];
        host[1] = m;
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        *reinterpret_cast<volatile int32_t*>(&host[0]) = static_cast<int32_t>(a.epoch);
    }
}

// =========================================================================================
// dispatch: direct stores into the destination's recv region
// =========================================================================================
// Units (token, chunk of its row) are grid-strided over all warps. For each unit a warp reads the chunk
// once (16 B per lane, kUnroll loads in flight) and stores it to every destination rank at
// row = (rows of lower source ranks at that destination) + send_pos[t][d]. Then per block: the units
// written to each peer are added to the peer's dispatch_rows[me] with a system-scope release
// (after a block barrier and a system fence, so every warp's stores are covered). Block 0 then
// waits until dispatch_rows[s] equals the exact count s sends here times chunks, and resets it.
template <int kR, int kUnroll>
__device__ __forceinline__ void dispatch_impl(const IntranodeArgs& a, const DispatchParams& p,
                                              const EpDiag& diag) {
    __shared__ int s_abort;
    __shared__ int s_rows[kR];
    // Per warp: the receive region of destination d for this call (byte offset in d's buffer;
    // 0: the fixed regions). This rank's at kernel start; a peer's once its ready is seen.
    __shared__ uint64_t s_reg[kMaxThreads / 32][kR];
    __shared__ int s_mrows[kR];  // rows destination d receives in this call (its region's size)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int me = a.rank;
    const int64_t row_bytes = p.row_bytes;
    const int K = p.num_topk, S = p.num_scales;
    if (tid < kR) s_rows[tid] = 0;
    if (tid == 0) {
        s_abort = 0;
        ep_trace(a, EP_TRACE_START);
    }
    if (tid < kR) {
        int m = 0;
        for (int s = 0; s < kR; ++s) m += p.count_matrix[s * kR + tid];
        s_mrows[tid] = m;
    }
    if (lane == me) s_reg[warp][me] = p.recv_region;
    // Where part `part` (0 rows, 1 scales, 2 top-k ids, 3 weights) of destination d's outputs
    // starts: in its region for this call (laid out by ep_recv_sublayout), or the fixed regions.
    auto dst_at = [&](int d, int part) -> uint64_t {
        const uint64_t rg = s_reg[warp][d];
        const uint64_t b = a.peer_base[d];
        if (rg == 0)
            return b + (part == 0 ? a.off_recv_x : part == 1 ? a.off_recv_scales : part == 2 ? a.off_recv_topk_idx : a.off_recv_topk_w);
        if (part == 0) return b + rg;
        const EpRecvSub r = ep_recv_sublayout(static_cast<uint64_t>(s_mrows[d]), static_cast<uint64_t>(row_bytes), S, K);
        return b + rg + (part == 1 ? r.scales : part == 2 ? r.topk_idx : r.topk_w);
    };
    // Lane d: first row of this rank's block inside destination d's recv region.
    int base = 0;
    if (lane < kR)
        for (int s = 0; s < me; ++s) base += p.count_matrix[s * kR + lane];
    // (the same for every warp: kept in shared memory, not in kR registers per thread)
    __shared__ int s_dst_base[kR];
    if (warp == 0 && lane < kR) s_dst_base[lane] = base;
    // Tell every peer where this call's rows go here, before announcing the epoch (the release of
    // ready[me] by the same thread covers it; a sender reads it after acquiring that ready).
    if (blockIdx.x == 0 && tid < kR && tid != me)
        st_relaxed_sys_u64(ep_at<uint64_t>(a, tid, a.off_recv_target) + me,
                           (static_cast<uint64_t>(a.epoch) << 32) | (p.recv_region >> 9));
    ep_announce_ready(a);
    __syncthreads();
    // Each warp waits for the peers' ready announcements lazily, right before its first store into
    // a peer: the loads and the own-rank stores of its first unit overlap the handshake.
    bool peers_ready = false;

    const int n16 = static_cast<int>(row_bytes / 16);
    const int64_t L = p.num_local_experts;
    // Work unit = (token, chunk of 32*kUnroll 16-byte words of its row): small, equal units keep
    // the tail short (the last units finish at about the same time on every warp).
    const int chunk16 = 32 * kUnroll;
    const int nchunks = ceil_div(n16, chunk16);
    const int64_t num_units = static_cast<int64_t>(p.num_tokens) * nchunks;
    int sent = 0;  // lane d: units this warp wrote to rank d
    // Roles: with local_warps > 0, warps [0, local_warps) copy only to this rank and the others
    // only to the peers (two pure streams); otherwise every warp copies each unit everywhere.
    const bool split = p.local_warps > 0;
    const bool role_local = split && warp < p.local_warps;
    const bool do_own = !split || role_local;
    const bool do_peers = !split || !role_local;
    const int role_warps = split ? (role_local ? p.local_warps : nwarps - p.local_warps) : nwarps;
    const int role_warp = split && !role_local ? warp - p.local_warps : warp;
    const int64_t gstride = static_cast<int64_t>(gridDim.x) * role_warps;
    bool aborted = false;
    // Bulk-copy staging (use_tma): two chunk buffers per warp in dynamic shared memory.
    extern __shared__ __align__(128) int4 ep_dyn_smem[];
    int4* smem_warp = ep_dyn_smem + static_cast<int64_t>(warp) * 2 * chunk16;
    int tma_buf = 0;

    // Batches of 32 units per warp: lane k first loads the stream positions of the token of unit
    // k (one round trip for 32 units), then the warp walks the units, broadcasting positions.
    for (int64_t batch = blockIdx.x * role_warps + role_warp; batch < num_units && !aborted;
         batch += 32 * gstride) {
        int posk[kR];
        {
            const int64_t uk = batch + lane * gstride;
            const long tk = uk < num_units ? static_cast<long>(uk / nchunks) : -1;
#pragma unroll
            for (int d = 0; d < kR; ++d) posk[d] = tk >= 0 ? __ldg(p.send_pos + tk * kR + d) : -1;
        }
        for (int k = 0; k < 32; ++k) {
            const int64_t unit = batch + k * gstride;
            if (unit >= num_units) break;
            const int t = static_cast<int>(unit / nchunks);
            const int c = static_cast<int>(unit - static_cast<int64_t>(t) * nchunks);

            // Row payload: this unit's chunk, all kUnroll loads in flight, then the stores.
            const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(p.x) +
                                                            static_cast<int64_t>(t) * row_bytes);
            const int i0 = c * chunk16 + lane;
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i0 + 32 * u < n16) v[u] = ld_nc_v4(src + i0 + 32 * u);

            int row[kR];
            int pos = -1;  // lane d < kR: the token's position in the stream to rank d
#pragma unroll
            for (int d = 0; d < kR; ++d) {
                const int pd = __shfl_sync(kFullMask, posk[d], k);
                row[d] = pd >= 0 ? s_dst_base[d] + pd : -1;
                if (lane == d) pos = pd;
            }
            sent += pos >= 0 && do_peers ? 1 : 0;
            // Which destinations this warp serves.
#pragma unroll
            for (int d = 0; d < kR; ++d)
                if (!(d == me ? do_own : do_peers)) row[d] = -1;
            if (!(lane == me ? do_own : do_peers)) pos = -1;

            // Own rank first (no handshake needed: this rank's earlier kernels are complete).
#pragma unroll
            for (int d = 0; d < kR; ++d) {
                if (d != me || row[d] < 0) continue;
                int4* dst = reinterpret_cast<int4*>(dst_at(d, 0) + static_cast<uint64_t>(row[d]) * row_bytes);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (i0 + 32 * u < n16) st_na_v4(dst + i0 + 32 * u, v[u]);
            }
            if (!peers_ready && do_peers) {
                if (!ep_warp_wait_ready(a, diag, EP_PHASE_DISPATCH_SEND)) {
                    if (lane == 0) s_abort = 1;
                    aborted = true;
                    break;
                }
                // Lane d: peer d's region for this call (published before its ready, so visible
                // after this lane's acquire of it). A peer this rank sends nothing to may have
                // moved on to a later call; its slot is not used then.
                bool tag_ok = true;
                if (lane < kR && lane != me) {
                    const uint64_t v = ld_volatile_u64(ep_at<uint64_t>(a, me, a.off_recv_target) + lane);
                    if (static_cast<uint32_t>(v >> 32) == a.epoch) {
                        s_reg[warp][lane] = (v & 0xffffffffull) << 9;
                    } else if (p.count_matrix[me * kR + lane] > 0) {
                        ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_DISPATCH_SEND, blockIdx.x, lane,
                                        static_cast<int>(v >> 32), 0);
                        tag_ok = false;
                    }
                }
                if (!__all_sync(kFullMask, tag_ok)) {
                    if (lane == 0) s_abort = 1;
                    aborted = true;
                    break;
                }
                __syncwarp();
                peers_ready = true;
                if (lane == 0) ep_trace(a, EP_TRACE_READY);
            }
            if (do_peers && p.use_tma) {
                // Stage the chunk in this warp's shared buffer (two, alternating) and let one bulk
                // copy per peer carry it: large NVLink writes instead of 16-byte stores.
                if (lane == 0) ep_bulk_wait_read_1();  // the copy that used this buffer is done reading
                __syncwarp();
                int4* sbuf = smem_warp + tma_buf * chunk16;
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (i0 + 32 * u < n16) sbuf[lane + 32 * u] = v[u];
                ep_fence_proxy_async_smem();
                __syncwarp();
                if (lane == 0) {
                    const uint32_t bytes = static_cast<uint32_t>(min(chunk16, n16 - c * chunk16)) * 16u;
#pragma unroll
                    for (int d = 0; d < kR; ++d) {
                        if (d == me || row[d] < 0) continue;
                        int4* dst = reinterpret_cast<int4*>(dst_at(d, 0) + static_cast<uint64_t>(row[d]) * row_bytes);
                        ep_bulk_store(dst + c * chunk16, sbuf, bytes);
                    }
                    ep_bulk_commit();
                }
                tma_buf ^= 1;
            } else {
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    if (d == me || row[d] < 0) continue;
                    int4* dst = reinterpret_cast<int4*>(dst_at(d, 0) + static_cast<uint64_t>(row[d]) * row_bytes);
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u)
                        if (i0 + 32 * u < n16) st_na_v4(dst + i0 + 32 * u, v[u]);
                }
            }
            if (c != 0) continue;

            // FP8 scales (row-major at the destination).
            for (int g = lane; g < S; g += 32) {
                const float sc = __ldg(p.scales + t * p.scale_row_stride + g * p.scale_col_stride);
#pragma unroll
                for (int d = 0; d < kR; ++d)
                    if (row[d] >= 0)
                        st_na_f32(reinterpret_cast<float*>(dst_at(d, 1)) + static_cast<int64_t>(row[d]) * S + g, sc);
            }

            // Routing metadata (fresh dispatch only): local expert ids, weights, source index.
            if (K > 0) {
                const int64_t e = lane < K ? __ldg(p.topk_idx + static_cast<long>(t) * K + lane) : -1;
                const float wv = lane < K ? __ldg(p.topk_w + static_cast<long>(t) * K + lane) : 0.f;
                // An id that points nowhere (< -1 or >= E) is local to no rank below, i.e. dropped
                // like -1; record it (first position wins) and carry on with the protocol.
                if (ep_bad_expert(e, static_cast<int>(kR * L)))
                    ep_record_bad_expert(diag, EP_PHASE_DISPATCH_SEND, static_cast<uint64_t>(t) * K + lane, e, K,
                                         static_cast<int>(kR * L));
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    if (row[d] < 0 || lane >= K) continue;
                    const int64_t lo = d * L;
                    const bool local = e >= lo && e < lo + L;
                    const int64_t idx = static_cast<int64_t>(row[d]) * K + lane;
                    st_na_s64(reinterpret_cast<int64_t*>(dst_at(d, 2)) + idx, local ? e - lo : -1);
                    st_na_f32(reinterpret_cast<float*>(dst_at(d, 3)) + idx, local ? wv : 0.f);
                }
                if (lane < kR && pos >= 0)
                    st_na_s32(ep_at<int>(a, lane, a.off_recv_src_idx) + base + pos, t);
            }
        }
    }

    // Bulk copies must have completed (writes performed) before the counts are published.
    if (p.use_tma && do_peers && lane == 0) ep_bulk_wait_all();
    __syncwarp();
    if (lane == 0) ep_trace(a, EP_TRACE_SENT);
    // Publish this block's units to every peer.
    if (lane < kR && sent > 0) atomicAdd(&s_rows[lane], sent);
    __syncthreads();
    if (s_abort) return;
    if (tid < kR && tid != me && s_rows[tid] > 0) {
        __threadfence_system();
        atomic_add_release_sys(ep_at<int>(a, tid, a.off_dispatch_rows) + me, s_rows[tid]);
        ep_trace(a, EP_TRACE_PUBLISHED);
    }

    // Receive side: wait until every unit of every peer's rows has landed, then reset the counter.
    if (blockIdx.x == 0 && tid < kR && tid != me) {
        const int expect = p.count_matrix[tid * kR + me] * nchunks;
        int* counter = ep_at<int>(a, me, a.off_dispatch_rows) + tid;
        EpWait w(diag);
        int seen;
        while ((seen = ld_acquire_sys(counter)) != expect) {
            if (seen > expect) {
                ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_DISPATCH_RECV, 0, tid, seen, 0);
                return;
            }
            if (!w.tick(EP_PHASE_DISPATCH_RECV, 0, tid, expect)) return;
        }
        // Nobody adds to this counter again before this rank announces its next epoch, which
        // happens in a later kernel (ordered after this store by kernel completion).
        st_relaxed_sys(counter, 0);
        ep_trace(a, EP_TRACE_RECEIVED);
    }
}

// Entry points are spelled out (not macro-generated) so the build's source scan finds them.
extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)
ep_intranode_dispatch_r2(IntranodeArgs a, DispatchParams p, EpDiag diag) {
    dispatch_impl<2, 7>(a, p, diag);
}
extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)
ep_intranode_dispatch_r4(IntranodeArgs a, DispatchParams p, EpDiag diag) {
    dispatch_impl<4, 4>(a, p, diag);
}
extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)
ep_intranode_dispatch_r8(IntranodeArgs a, DispatchParams p, EpDiag diag) {
    dispatch_impl<8, 2>(a, p, diag);
}

// =========================================================================================
// combine: push y rows back to their origin's staging slots, reduce at the origin
// =========================================================================================

// Warps [0, push_warps) of every block push; the rest reduce.
//  push: unit u = g*(R-1) + q (q-th peer after me, rows [g*G, g*G+G) that peer sent me), so rows go out in
//        ascending j for all peers at once. Rows -> origin's stage slot for me at row j, weights
//        beside them, then (after __syncwarp) lane 0: one fence.acq_rel.sys and flag = epoch per row.
//  reduce: unit (token t, chunk) of this rank (grid-strided over reduce warps, ascending): lane d acquires the
//        flag of the row rank d staged for t, then the warp sums in f32: bias0, bias1, then ranks
//        ascending (own contribution read from y directly), rounds once to bf16.
template <int kR, int kU>
__device__ __forceinline__ void combine_impl(const IntranodeArgs& a, const CombineParams& p,
                                             const EpDiag& diag) {
    if (threadIdx.x == 0) ep_trace(a, EP_TRACE_START);
    ep_announce_ready(a);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int me = a.rank;
    const int H = p.hidden, K = p.num_topk;
    const int n16 = H / 8;  // 8 bf16 per int4
    const int64_t row_elems = H;
    const int epoch = static_cast<int>(a.epoch);

    // Lane s: rows of y that came from rank s (count) and where they start (offset).
    int cnt = 0, off = 0;
    if (lane < kR) {
        for (int s = 0; s < lane; ++s) off += p.count_matrix[s * kR + me];
        cnt = p.count_matrix[lane * kR + me];
    }

    if (warp < p.push_warps) {
        // Pushers write into the peers' staging slots: wait for their ready announcements first.
        // (Reducers need no handshake: they only read this rank's memory, behind flags.)
        if (!ep_warp_wait_ready(a, diag, EP_PHASE_COMBINE_SEND)) return;
        if (lane == 0) ep_trace(a, EP_TRACE_READY);
        int maxc = (lane < kR && lane != me) ? cnt : 0;
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) maxc = max(maxc, __shfl_xor_sync(kFullMask, maxc, m));
        // Unit = G consecutive rows for one peer: G rows of stores, ONE system fence, G flags.
        const int G = p.push_rows;
        extern __shared__ __align__(128) int4 ep_push_smem[];
        int4* smem_warp = ep_push_smem + static_cast<int64_t>(warp) * 2 * (32 * kPushUnroll);
        int tma_buf = 0;
        const int num_units = (kR - 1) * ceil_div(maxc, G);
        const int stride = gridDim.x * p.push_warps;
        for (int u = blockIdx.x * p.push_warps + warp; u < num_units; u += stride) {
            const int q = u % (kR - 1), j0 = (u / (kR - 1)) * G;
            const int s = (me + 1 + q) % kR;
            const int cnt_s = __shfl_sync(kFullMask, cnt, s);
            const int off_s = __shfl_sync(kFullMask, off, s);
            if (j0 >= cnt_s) continue;
            const int j1 = min(j0 + G, cnt_s);
            const int slot = ep_stage_slot(me, s, kR);
            for (int j = j0; j < j1; ++j) {
                const int4* src = reinterpret_cast<const int4*>(p.y + (off_s + j) * row_elems);
                int4* dst = reinterpret_cast<int4*>(a.peer_base[s] + a.off_stage_x +
                                                    slot * a.stage_x_slot_bytes) +
                            static_cast<int64_t>(j) * n16;
                // Warp-uniform trip count (the bulk path synchronises the warp inside).
                for (int base = 0; base < n16; base += 32 * kPushUnroll) {
                    const int i = base + lane;
                    int4 v[kPushUnroll];
#pragma unroll
                    for (int k = 0; k < kPushUnroll; ++k)
                        if (i + 32 * k < n16) v[k] = ld_nc_v4(src + i + 32 * k);
                    if (p.use_tma) {
                        // Stage the chunk in shared memory (two alternating buffers); lane 0 sends
                        // it with one bulk copy.
                        if (lane == 0) ep_bulk_wait_read_1();
                        __syncwarp();
                        int4* sbuf = smem_warp + tma_buf * (32 * kPushUnroll);
#pragma unroll
                        for (int k = 0; k < kPushUnroll; ++k)
                            if (i + 32 * k < n16) sbuf[lane + 32 * k] = v[k];
                        ep_fence_proxy_async_smem();
                        __syncwarp();
                        if (lane == 0) {
                            const uint32_t bytes = static_cast<uint32_t>(min(32 * kPushUnroll, n16 - base)) * 16u;
                            ep_bulk_store(dst + base, sbuf, bytes);
                            ep_bulk_commit();
                        }
                        tma_buf ^= 1;
                    } else {
#pragma unroll
                        for (int k = 0; k < kPushUnroll; ++k)
                            if (i + 32 * k < n16) st_na_v4(dst + i + 32 * k, v[k]);
                    }
                }
                if (p.topk_w != nullptr && lane < K) {
                    float* wdst = reinterpret_cast<float*>(a.peer_base[s] + a.off_stage_w +
                                                           slot * a.stage_w_slot_bytes);
                    st_na_f32(wdst + static_cast<int64_t>(j) * K + lane,
                              __ldg(p.topk_w + static_cast<int64_t>(off_s + j) * K + lane));
                }
            }
            // Every lane's stores of the G rows, then (lane 0) one fence at system scope and the
            // G flags: a reducer that acquires any of them sees the whole row.
            if (p.use_tma && lane == 0) ep_bulk_wait_all();  // bulk copies complete before the flags
            __syncwarp();
            if (lane == 0) {
                int* flags = ep_at<int>(a, s, a.off_stage_flag) + static_cast<int64_t>(slot) * a.max_tokens;
                fence_acq_rel_sys();
                for (int j = j0; j < j1; ++j) st_relaxed_sys(flags + j, epoch);
            }
        }
        if (lane == 0) ep_trace(a, EP_TRACE_SENT);
        return;
    }

    // Reduce role.
    const int reduce_warps = nwarps - p.push_warps;
    const int off_me = __shfl_sync(kFullMask, off, me);
    // Unit = (token, chunk of 32*kU words of its row): equal small units keep the reduce tail
    // short; the chunk-0 unit also sums the weights.
    const int chunk16 = 32 * kU;
    const int nchunks = ceil_div(n16, chunk16);
    const int64_t num_units = static_cast<int64_t>(p.num_tokens) * nchunks;
    const int64_t rstride = static_cast<int64_t>(gridDim.x) * reduce_warps;
    const int* my_flags = ep_at<int>(a, me, a.off_stage_flag);
    // Batches of 32 units per warp: lane k checks (acquire) whether the staged rows of unit k
    // already landed, all lanes in one round trip; the warp then walks the units, spinning only
    // on those that were not ready in that snapshot (per-unit cost: one data round trip).
    for (int64_t batch = blockIdx.x * reduce_warps + (warp - p.push_warps); batch < num_units;
         batch += 32 * rstride) {
        // Lane k: positions of unit k's token in every rank's stream (kept in registers for up to
        // 4 ranks, so a unit needs no metadata load) and whether its staged rows already landed.
        constexpr bool kKeepPos = kR <= 4;
        int posk[kR];
        bool ready = true;
        {
            const int64_t uk = batch + lane * rstride;
            const long tk = uk < num_units ? static_cast<long>(uk / nchunks) : -1;
#pragma unroll
            for (int d = 0; d < kR; ++d) posk[d] = tk >= 0 ? __ldg(p.send_pos + tk * kR + d) : -1;
#pragma unroll
            for (int d = 0; d < kR; ++d) {
                if (d == me || posk[d] < 0) continue;
                const int* flag = my_flags + static_cast<int64_t>(ep_stage_slot(d, me, kR)) * a.max_tokens + posk[d];
                ready = ready && ld_acquire_sys(flag) == epoch;
            }
        }
        const unsigned ready_mask = __ballot_sync(kFullMask, ready);
        __syncwarp();
        for (int k = 0; k < 32; ++k) {
            const int64_t unit = batch + k * rstride;
            if (unit >= num_units) break;
            const int t = static_cast<int>(unit / nchunks);
            const int c = static_cast<int>(unit - static_cast<int64_t>(t) * nchunks);
            // pds: the token's position in every rank's stream; pos = pds[lane] for lanes < kR.
            int pds[kR];
            int pos = -1;
            if constexpr (kKeepPos) {
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    pds[d] = __shfl_sync(kFullMask, posk[d], k);
                    if (lane == d) pos = pds[d];
                }
            } else {
                pos = lane < kR ? __ldg(p.send_pos + static_cast<long>(t) * kR + lane) : -1;
#pragma unroll
                for (int d = 0; d < kR; ++d) pds[d] = __shfl_sync(kFullMask, pos, d);
            }
            if (((ready_mask >> k) & 1u) == 0u) {
                bool ok = true;
                if (lane < kR && lane != me && pos >= 0) {
                    const int* flag = my_flags + static_cast<int64_t>(ep_stage_slot(lane, me, kR)) * a.max_tokens + pos;
                    EpWait w(diag);
                    while (ld_acquire_sys(flag) != epoch) {
                        if (!w.tick(EP_PHASE_COMBINE_RECV, blockIdx.x, lane, t)) { ok = false; break; }
                    }
                }
                if (__any_sync(kFullMask, !ok)) return;
                __syncwarp();
            }

            const int4* b0 = p.bias0 ? reinterpret_cast<const int4*>(p.bias0 + t * row_elems) : nullptr;
            const int4* b1 = p.bias1 ? reinterpret_cast<const int4*>(p.bias1 + t * row_elems) : nullptr;
            int4* out = reinterpret_cast<int4*>(p.out + t * row_elems);
            {
                const int i = c * chunk16 + lane;
                auto load = [&](int d, int u) -> int4 {
                    if (d == me)
                        return ld_nc_v4(reinterpret_cast<const int4*>(p.y) +
                                        static_cast<int64_t>(off_me + pds[d]) * n16 + i + 32 * u);
                    return ld_volatile_v4(reinterpret_cast<const int4*>(a.peer_base[me] + a.off_stage_x +
                                                                        ep_stage_slot(d, me, kR) * a.stage_x_slot_bytes) +
                                          static_cast<int64_t>(pds[d]) * n16 + i + 32 * u);
                };
                if constexpr (kR <= 4) {
                    // All rank loads in flight first; biases are loaded per group right before use
                    // (registers: kU*kR int4 + one accumulator group).
                    int4 v[kR][kU];
#pragma unroll
                    for (int u = 0; u < kU; ++u) {
                        if (i + 32 * u >= n16) continue;
#pragma unroll
                        for (int d = 0; d < kR; ++d)
                            if (pds[d] >= 0) v[d][u] = load(d, u);
                    }
#pragma unroll
                    for (int u = 0; u < kU; ++u) {
                        if (i + 32 * u >= n16) continue;
                        float acc[8];
#pragma unroll
                        for (int x = 0; x < 8; ++x) acc[x] = 0.f;
                        if (b0) ep_accumulate_bf16x8(acc, ld_nc_v4(b0 + i + 32 * u));
                        if (b1) ep_accumulate_bf16x8(acc, ld_nc_v4(b1 + i + 32 * u));
#pragma unroll
                        for (int d = 0; d < kR; ++d)
                            if (pds[d] >= 0) ep_accumulate_bf16x8(acc, v[d][u]);
                        out[i + 32 * u] = ep_pack_bf16x8(acc);
                    }
                } else {
                    // Many ranks (kU == 1): loads of 4 ranks at a time, summed in rank order.
                    static_assert(kU == 1, "the many-rank path handles one group per lane");
                    if (i < n16) {
                        float acc[8];
#pragma unroll
                        for (int x = 0; x < 8; ++x) acc[x] = 0.f;
                        if (b0) ep_accumulate_bf16x8(acc, ld_nc_v4(b0 + i));
                        if (b1) ep_accumulate_bf16x8(acc, ld_nc_v4(b1 + i));
#pragma unroll
                        for (int g = 0; g < kR; g += 4) {
                            int4 v[4];
#pragma unroll
                            for (int d = g; d < g + 4; ++d)
                                if (pds[d] >= 0) v[d - g] = load(d, 0);
#pragma unroll
                            for (int d = g; d < g + 4; ++d)
                                if (pds[d] >= 0) ep_accumulate_bf16x8(acc, v[d - g]);
                        }
                        out[i] = ep_pack_bf16x8(acc);
                    }
                }
            }

            if (c == 0 && p.out_w != nullptr && lane < K) {
                float sum = 0.f;
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    const int pd = pds[d];
                    if (pd < 0) continue;
                    sum += d == me ? __ldg(p.topk_w + static_cast<int64_t>(off_me + pd) * K + lane)
                                   : ld_volatile_f32(reinterpret_cast<const float*>(
                                                         a.peer_base[me] + a.off_stage_w +
                                                         ep_stage_slot(d, me, kR) * a.stage_w_slot_bytes) +
                                                     static_cast<int64_t>(pd) * K + lane);
                }
                p.out_w[static_cast<int64_t>(t) * K + lane] = sum;
            }
        }
    }
    if (lane == 0) ep_trace(a, EP_TRACE_RECEIVED);
}

extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)
ep_intranode_combine_r2(IntranodeArgs a, CombineParams p, EpDiag diag) {
    combine_impl<2, 4>(a, p, diag);
}
extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)
ep_intranode_combine_r4(IntranodeArgs a, CombineParams p, EpDiag diag) {
    combine_impl<4, 1>(a, p, diag);
}
extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)
ep_intranode_combine_r8(IntranodeArgs a, CombineParams p, EpDiag diag) {
    combine_impl<8, 1>(a, p, diag);
}
