// Low-latency dispatch / combine over NVSHMEM (NVLink stores when reachable, NVSHMEM puts
// otherwise). Layout, protocol and ordering rules: see low_latency.cuh and docs/nvshmem.md.
//
// Grid: G blocks x LL_THREADS (512) threads, cooperative launch (blocks of the fused send+recv kernels wait
// for flags written by other blocks of the same grid, so all blocks must be co-resident). G is
// the same on every rank (the host takes the minimum SM count over ranks).
//
// Ordering rules:
//   * every flag is a u64 `(seq << 32) | payload` written once per call (st.release.sys, or
//     nvshmemx_signal_op after nvshmem_quiet on the put path) and polled with ld.acquire.sys
//     until its tag equals this call's `seq` (no resets, stale values never match);
//   * a producer block: every warp stores its rows, `__syncthreads()`, then one thread per flag
//     does a release store (st.release.sys is cumulative over the block's writes ordered before
//     it by the barrier; the put path adds nvshmem_quiet per warp and a system fence);
//   * a consumer: one thread acquires a flag, `__syncthreads()`, then the block reads the data
//     with L1-bypassing loads (ld.volatile / ld.global.cg).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../common.cuh"
#include "low_latency.cuh"

namespace {

__device__ __forceinline__ uint64_t ll_tag(uint32_t seq, uint32_t payload) {
    return (static_cast<uint64_t>(seq) << 32) | payload;
}

// Write a tagged flag at byte offset `off` of `pe`'s buffer.
template <bool kPut>
__device__ __forceinline__ void ll_signal(uint8_t* buf, const uint64_t* peer_base, int pe, uint64_t off,
                                          uint64_t value) {
    const uint64_t peer = peer_base[pe];
    if (!kPut || peer != 0) {
        st_release_sys_u64(reinterpret_cast<uint64_t*>(peer + off), value);
    } else {
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(buf + off), value, NVSHMEM_SIGNAL_SET, pe);
    }
}

// Write one int at byte offset `off` of `pe`'s buffer (ordered before the next flag by the
// producer protocol).
template <bool kPut>
__device__ __forceinline__ void ll_put_int(uint8_t* buf, const uint64_t* peer_base, int pe, uint64_t off, int v) {
    const uint64_t peer = peer_base[pe];
    if (!kPut || peer != 0) {
        *reinterpret_cast<volatile int*>(peer + off) = v;
    } else {
        nvshmem_int_p(reinterpret_cast<int*>(buf + off), v, pe);
    }
}

// Poll a local tagged flag until its tag is `seq`; false on timeout / abort (recorded).
__device__ __forceinline__ bool ll_wait_tag(const uint8_t* buf, uint64_t off, uint32_t seq, uint32_t* payload,
                                            const EpDiag& diag, int phase, int channel, int peer) {
    const uint64_t* p = reinterpret_cast<const uint64_t*>(buf + off);
    EpWait w(diag);
    uint32_t nap = 32;
    while (true) {
        const uint64_t v = ld_acquire_sys_u64(p);
        if (static_cast<uint32_t>(v >> 32) == seq) {
            *payload = static_cast<uint32_t>(v);
            return true;
        }
        if (!w.tick(phase, channel, peer)) return false;
        // Back off: thousands of pollers must not steal L2 bandwidth from the data they wait for.
        __nanosleep(nap);
        nap = min(nap * 2, 256u);
    }
}

__device__ __forceinline__ void st_v2(void* p, uint32_t a, uint32_t b) {
    asm volatile("st.global.L1::no_allocate.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ void bf16x8_to_f32(const int4& v, float (&f)[8]) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// FP8 e4m3 of two floats, x in the low byte (cvt.rn.satfinite.e4m3x2.f32).
__device__ __forceinline__ uint32_t fp8x2(float x, float y) {
    return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3));
}

// DeepEP's LL scale arithmetic (bit-exact with reference::fp8): returns (scale, scale_inv).
__device__ __forceinline__ void ll_group_scale(float amax, bool round_scale, float& scale, float& scale_inv) {
    if (round_scale) {
        const uint32_t bits = __float_as_uint(__fmul_rn(amax, 1.0f / 448.0f));
        const int e = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0u ? 1 : 0);
        scale = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
        scale_inv = __uint_as_float(static_cast<uint32_t>(127 + e) << 23);
    } else {
        scale = __fdiv_rn(448.0f, amax);
        scale_inv = __fmul_rn(amax, 1.0f / 448.0f);
    }
}

// 8-byte read-only load (four bf16 channels), non-coherent path, no L1 allocation.
__device__ __forceinline__ uint2 ld_nc_v2(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ void bf16x4_to_f32(const uint2& v, float* f) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xffff0000u);
}

__device__ __forceinline__ uint2 f32x4_to_bf16(const float* f) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(f[0], f[1]);
    const __nv_bfloat162 q = __floats2bfloat162_rn(f[2], f[3]);
    return make_uint2(*reinterpret_cast<const uint32_t*>(&p), *reinterpret_cast<const uint32_t*>(&q));
}

// Phase timestamps for diagnostics (`trace` = 0: off). Slot LL_TRACE_START keeps the minimum,
// the others the maximum over the threads that reach them; the host presets the slots.
__device__ __forceinline__ void ll_trace(uint64_t trace, int slot) {
    if (trace == 0) return;
    unsigned long long* p = reinterpret_cast<unsigned long long*>(trace) + slot;
    const unsigned long long now = ep_globaltimer();
    if (slot == LL_TRACE_START || slot == LL_TRACE_WAITED_FIRST) atomicMin(p, now);
    else atomicMax(p, now);
}

__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Warp-wide wait until the flags [0, n) at `off` (u64, index j = rank * G + block) of every rank
// other than `me` carry `seq`. Lanes poll up to 8 flags each with independent relaxed loads per
// round (one round trip when they are already set), then an acquire fence. Warp-uniform result;
// false on timeout (recorded).
__device__ __forceinline__ bool ll_warp_wait_all(const uint8_t* buf, uint64_t off, int n, int G, int me, uint32_t seq,
                                                 const EpDiag& diag, int lane) {
    const uint64_t* f = reinterpret_cast<const uint64_t*>(buf + off);
    for (int base = 0; base < n; base += 32 * 8) {
        EpWait w(diag);
        while (true) {
            bool all = true;
            int missing = -1;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int j = base + lane + 32 * i;
                if (j < n && j / G != me) {
                    const bool ok = static_cast<uint32_t>(ld_relaxed_sys_u64(f + j) >> 32) == seq;
                    if (!ok && missing < 0) missing = j;
                    all &= ok;
                }
            }
            if (__all_sync(0xffffffffu, all)) break;
            const bool timed_out = !w.tick(EP_PHASE_LL_COMBINE_RECV, missing >= 0 ? missing % G : -1, missing >= 0 ? missing / G : -1);
            if (__any_sync(0xffffffffu, timed_out)) return false;
            __nanosleep(256);  // back off (see ll_wait_tag)
        }
    }
    fence_acq_rel_sys();
    __syncwarp();
    return true;
}

// Producer-side fence before the barrier that precedes a flag. NVLink path: none needed — the
// flag is a st.release.sys by one thread after __syncthreads(), and release is cumulative over
// the writes of the block that the barrier ordered before it (the CUTLASS / DeepEP publication
// pattern). Put path: a system fence after nvshmem_quiet, to be conservative.
template <bool kPut>
__device__ __forceinline__ void ll_publish_fence() {
    if (kPut) __threadfence_system();
}

// The NVSHMEM put path lives in non-inlined helpers so that the ABI call does not force the
// hot loop's live values into local memory. Their only "spill" in ptxas -v is the call ABI
// saving two registers around the NVSHMEM library call; like the library's own functions they
// carry "nvshmem" in their name, which build.rs's spill check treats as library code.
__device__ __noinline__ void ll_nvshmem_put_warp(void* sym_dst, const void* src, int bytes, int pe) {
    nvshmemx_putmem_warp(sym_dst, src, static_cast<size_t>(bytes), pe);
}
__device__ __noinline__ void ll_nvshmem_quiet() { nvshmem_quiet(); }

}  // namespace

// ---- dispatch ------------------------------------------------------------------------------
// Dynamic shared memory (int32): cnt[epb] | begin[epb] | list[epb * NM] | recv counts[lpb * R] | totals[lpb]
template <bool kPut>
__device__ __forceinline__ void ll_dispatch_impl(const LlDispatchArgs& a, const EpDiag& diag) {
    extern __shared__ int smem[];
    __shared__ int s_fail;
    const int b = blockIdx.x, G = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int R = a.num_ranks, E = a.num_experts, L = E / R, NM = a.num_max, K = a.num_topk, H = a.hidden;
    const int N = a.num_tokens, RNM = R * NM, S = H / 128, me = a.rank;
    // Peer table in shared memory (loaded while the first global loads are in flight).
    __shared__ uint64_t s_peer_buf[32];
    const uint64_t* peers = a.peer_base;
    if (R <= 32) {
        if (tid < R) s_peer_buf[tid] = a.peer_base[tid];
        peers = s_peer_buf;
    }
    const int epb = a.experts_per_block, lpb = (L + G - 1) / G;
    const int row_bytes = a.use_fp8 ? H : 2 * H;
    int* cnt = smem;
    int* begin = smem + epb;
    int* list = smem + 2 * epb;
    int* rc = list + epb * NM;
    int* totals = rc + lpb * R;
    uint32_t* epoch = reinterpret_cast<uint32_t*>(a.buf + a.off_epoch);
    const uint32_t seq = (a.phases & LL_PHASE_SEND) ? *reinterpret_cast<volatile uint32_t*>(&epoch[b]) + 1u
                                                    : *reinterpret_cast<volatile uint32_t*>(&epoch[b]);
    if (tid == 0) s_fail = 0;

    if (a.phases & LL_PHASE_SEND) {
        for (int i = tid; i < epb; i += LL_THREADS) {
            cnt[i] = 0;
            begin[i] = 0;
        }
        __syncthreads();
        // Bin this rank's selections of the block's experts (e % G == b); order inside an expert
        // is arbitrary (contract: compare as multisets).
        // An id that points nowhere (< -1 or >= E) is binned by no block (dropped, like -1);
        // block 0 records it (first position wins) and every block carries on.
        for (int i = tid; i < N * K; i += LL_THREADS) {
            const int64_t e = a.topk_idx[i];
            if (e >= 0 && e < E) {
                if (static_cast<int>(e % G) == b) {
                    const int ei = static_cast<int>(e / G);
                    const int p = atomicAdd(&cnt[ei], 1);
                    if (p < NM) list[ei * NM + p] = i;
                }
            } else if (e != -1 && b == 0) {  // valid ids pay nothing for this check
                ep_record_bad_expert(diag, EP_PHASE_LL_DISPATCH_SEND, static_cast<uint64_t>(i), e, K, E);
            }
        }
        __syncthreads();
        // Send each count to the ranks that come after us in the owner's packing order (they
        // need it for their begin; the owner itself gets it with the done flag). Every such
        // write is waited for by its recipient, so none is in flight when a call completes.
        for (int j = tid; j < epb * R; j += LL_THREADS) {
            const int ei = j / R, r = j % R, e = b + ei * G;
            if (e >= E) continue;
            int c = cnt[ei];
            if (c > NM) {
                // More selections of one expert than num_max tokens: duplicate expert ids in a row.
                if (r == 0) ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_LL_DISPATCH_SEND, b, -1, c, 0);
                c = NM;
            }
            const int d = e / L;
            if ((r - d + R) % R > (me - d + R) % R)
                ll_signal<kPut>(a.buf, peers, r, a.off_count_sig + (static_cast<uint64_t>(e) * R + me) * 8,
                                ll_tag(seq, static_cast<uint32_t>(c)));
        }

        const int nseg = (H + LL_DISPATCH_SEG - 1) / LL_DISPATCH_SEG;
        uint8_t* stage = a.buf + a.off_stage + (static_cast<uint64_t>(b) * LL_WARPS + warp) * LL_STAGE_BYTES;
        bool did_put = false;
        // The owner d packs its sources in the order d, d+1, ..., d-1 (itself first). Our block
        // for an expert of owner d therefore starts after the counts of the sources before us.
        // Pass 0: experts we own (slot 0, no wait).
        // Pass 1: the others, once the counts of the sources before us arrived (they broadcast
        //         them first thing, so the wait is usually over by now). Waiting for the owner's
        //         count also means the owner has started this call, i.e. it is done with the
        //         previous user of this half (that is what makes two halves enough, even with
        //         receive hooks deferred past the next send).
        for (int pass = 0; pass < 2; ++pass) {
            if (pass == 1) {
                for (int ei = tid; ei < epb; ei += LL_THREADS) {
                    const int e = b + ei * G;
                    if (e >= E) continue;
                    const int d = e / L;
                    const int pos = (me - d + R) % R;
                    if (pos == 0) continue;
                    int sum = 0;
                    for (int j = 0; j < pos; ++j) {
                        const int src = (d + j) % R;
                        uint32_t c = 0;
                        if (!ll_wait_tag(a.buf, a.off_count_sig + (static_cast<uint64_t>(e) * R + src) * 8, seq, &c, diag,
                                         EP_PHASE_LL_DISPATCH_SEND, b, src)) {
                            s_fail = 1;
                            break;
                        }
                        sum += static_cast<int>(c);
                    }
                    begin[ei] = sum;
                }
                __syncthreads();
                if (s_fail) break;
            }
            int total = 0;
            for (int ei = 0; ei < epb; ++ei) {
                const int e = b + ei * G;
                if (e < E && ((e / L == me) == (pass == 0))) total += min(cnt[ei], NM) * nseg;
            }
            for (int u = warp; u < total; u += LL_WARPS) {
                // unit -> (expert, row, segment)
                int rest = u, ei = 0;
                for (;; ++ei) {
                    const int e = b + ei * G;
                    if (e < E && ((e / L == me) == (pass == 0))) {
                        const int n = min(cnt[ei], NM) * nseg;
                        if (rest < n) break;
                        rest -= n;
                    }
                }
                const int i = rest / nseg, seg = rest % nseg;
                const int e = b + ei * G, d = e / L, le = e % L;
                const int sel = list[ei * NM + i];
                const int t = sel / K, k = sel % K;
                const int slot = begin[ei] + i;
                const uint64_t peer = peers[d];
                const bool direct = !kPut || peer != 0;  // !kPut: the host checked every peer is reachable
                const uint64_t row_off = a.off_x + (static_cast<uint64_t>(le) * RNM + slot) * row_bytes;
                if (seg == 0 && lane == 0) {
                    const uint64_t idx = (static_cast<uint64_t>(le) * RNM + slot) * 4;
                    ll_put_int<kPut>(a.buf, peers, d, a.off_src_info + idx, t);
                    ll_put_int<kPut>(a.buf, peers, d, a.off_src_k + idx, k);
                    reinterpret_cast<int*>(a.buf + a.off_send_slot)[t * LL_MAX_TOPK + k] = slot;
                }
                const uint8_t* xrow = static_cast<const uint8_t*>(a.x) + static_cast<uint64_t>(t) * H * 2;
                const int c0 = seg * LL_DISPATCH_SEG;
                const int nch = min(LL_DISPATCH_SEG, H - c0);
                if (a.use_fp8) {
                    // 4 iterations of 256 channels; lanes 0-15 one group of 128, lanes 16-31 the next.
                    const int nit = nch / 256;  // 2 or 4 (H % 512 == 0)
                    uint8_t* dst = direct ? reinterpret_cast<uint8_t*>(peer + row_off + c0) : stage;
                    // NVLink kernel: all four loads in flight first. Put kernel: one at a time (its
                    // library calls leave fewer registers; keeps it free of spills).
                    int4 v[4];
                    if (!kPut) {
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            if (j < nit) v[j] = ld_nc_v4(reinterpret_cast<const int4*>(xrow + (c0 + j * 256 + lane * 8) * 2));
                    }
                    float my_scale = 0.f;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if (j >= nit) break;
                        if (kPut) v[j] = ld_nc_v4(reinterpret_cast<const int4*>(xrow + (c0 + j * 256 + lane * 8) * 2));
                        float f[8];
                        bf16x8_to_f32(v[j], f);
                        float amax = 0.f;
#pragma unroll
                        for (int q = 0; q < 8; ++q) amax = fmaxf(amax, fabsf(f[q]));
#pragma unroll
                        for (int m = 8; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
                        amax = fmaxf(amax, 1e-4f);
                        float scale, scale_inv;
                        ll_group_scale(amax, a.round_scale != 0, scale, scale_inv);
                        const uint32_t lo = fp8x2(__fmul_rn(f[0], scale), __fmul_rn(f[1], scale)) |
                                            (fp8x2(__fmul_rn(f[2], scale), __fmul_rn(f[3], scale)) << 16);
                        const uint32_t hi = fp8x2(__fmul_rn(f[4], scale), __fmul_rn(f[5], scale)) |
                                            (fp8x2(__fmul_rn(f[6], scale), __fmul_rn(f[7], scale)) << 16);
                        st_v2(dst + j * 256 + lane * 8, lo, hi);
                        const float s_lo = __shfl_sync(0xffffffffu, scale_inv, 0);
                        const float s_hi = __shfl_sync(0xffffffffu, scale_inv, 16);
                        if (lane == 2 * j) my_scale = s_lo;
                        if (lane == 2 * j + 1) my_scale = s_hi;
                    }
                    const uint64_t sc_off =
                        a.off_scale_stage + ((static_cast<uint64_t>(le) * RNM + slot) * S + c0 / 128) * 4;
                    if (direct) {
                        if (lane < 2 * nit) reinterpret_cast<float*>(peer + sc_off)[lane] = my_scale;
                    } else {
                        if (lane < 2 * nit) reinterpret_cast<float*>(stage + LL_COMBINE_SEG_BYTES)[lane] = my_scale;
                        __syncwarp();
                        ll_nvshmem_put_warp(a.buf + row_off + c0, stage, nch, d);
                        ll_nvshmem_put_warp(a.buf + sc_off, stage + LL_COMBINE_SEG_BYTES, 2 * nit * 4, d);
                        did_put = true;
                    }
                } else {
                    const int nbytes = nch * 2;
                    uint8_t* dst = direct ? reinterpret_cast<uint8_t*>(peer + row_off + c0 * 2) : stage;
                    int4 v[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int off = j * 512 + lane * 16;
                        if (off < nbytes) v[j] = ld_nc_v4(reinterpret_cast<const int4*>(xrow + c0 * 2 + off));
                    }
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int off = j * 512 + lane * 16;
                        if (off < nbytes) st_na_v4(reinterpret_cast<int4*>(dst + off), v[j]);
                    }
                    if (!direct) {
                        __syncwarp();
                        ll_nvshmem_put_warp(a.buf + row_off + c0 * 2, stage, nbytes, d);
                        did_put = true;
                    }
                }
            }
        }
        if (kPut && did_put && lane == 0) ll_nvshmem_quiet();
        ll_publish_fence<kPut>();
        __syncthreads();
        if (!s_fail) {
            // Rows of (expert, this source) are complete: tell the owner.
            for (int ei = tid; ei < epb; ei += LL_THREADS) {
                const int e = b + ei * G;
                if (e >= E) continue;
                const int d = e / L, le = e % L;
                ll_publish_fence<kPut>();
                ll_signal<kPut>(a.buf, peers, d, a.off_done_sig + (static_cast<uint64_t>(le) * R + me) * 8,
                          ll_tag(seq, static_cast<uint32_t>(min(cnt[ei], NM))));
            }
        }
        if (tid == 0) epoch[b] = seq;
    }

    if (a.phases & LL_PHASE_RECV) {
        __syncthreads();
        if (s_fail) return;
        for (int j = tid; j < lpb * R; j += LL_THREADS) {
            const int li = j / R, s = j % R, le = b + li * G;
            if (le >= L) continue;
            uint32_t c = 0;
            if (!ll_wait_tag(a.buf, a.off_done_sig + (static_cast<uint64_t>(le) * R + s) * 8, seq, &c, diag,
                             EP_PHASE_LL_DISPATCH_RECV, le, s)) {
                s_fail = 1;
                c = 0;
            }
            rc[j] = static_cast<int>(c);
        }
        __syncthreads();
        if (s_fail) return;
        int64_t* layout_range = reinterpret_cast<int64_t*>(a.buf + a.off_layout_range);
        int* recv_count = reinterpret_cast<int*>(a.buf + a.off_recv_count);
        for (int li = tid; li < lpb; li += LL_THREADS) {
            const int le = b + li * G;
            if (le >= L) continue;
            int total = 0;
            // Block order of the owner: me, me+1, ..., me-1 (what the senders assumed).
            for (int j = 0; j < R; ++j) {
                const int s = (me + j) % R;
                const int c = rc[li * R + s];
                layout_range[le * R + s] = (static_cast<int64_t>(total) << 32) | static_cast<uint32_t>(c);
                total += c;
            }
            recv_count[le] = total;
            totals[li] = total;
        }
        __syncthreads();
        if (a.use_fp8) {
            // Transpose the staged per-row scales into the column-major output.
            const float* stage_sc = reinterpret_cast<const float*>(a.buf + a.off_scale_stage);
            const int groups = a.use_ue8m0 ? S / 4 : S;
            for (int li = 0; li < lpb; ++li) {
                const int le = b + li * G;
                if (le >= L) break;
                const int rows = totals[li];
                for (int idx = tid; idx < rows * groups; idx += LL_THREADS) {
                    const int g = idx / rows, row = idx % rows;
                    const float* src = stage_sc + (static_cast<uint64_t>(le) * RNM + row) * S;
                    if (a.use_ue8m0) {
                        uint32_t packed = 0;
#pragma unroll
                        for (int q = 0; q < 4; ++q)
                            packed |= ((__float_as_uint(__ldcg(src + 4 * g + q)) >> 23) & 0xffu) << (8 * q);
                        reinterpret_cast<uint32_t*>(a.buf + a.off_scales)[(static_cast<uint64_t>(le) * groups + g) * RNM + row] =
                            packed;
                    } else {
                        reinterpret_cast<float*>(a.buf + a.off_scales)[(static_cast<uint64_t>(le) * groups + g) * RNM + row] =
                            __ldcg(src + g);
                    }
                }
            }
        }
    }
}

// ---- combine -------------------------------------------------------------------------------
// Dynamic shared memory (int32): pre[L + 1] | warp sums[LL_WARPS]
template <bool kPut>
__device__ __forceinline__ void ll_combine_impl(const LlCombineArgs& a, const EpDiag& diag) {
    extern __shared__ int smem[];
    __shared__ int s_fail;
    const int b = blockIdx.x, G = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int R = a.num_ranks, E = a.num_experts, L = E / R, NM = a.num_max, K = a.num_topk, H = a.hidden;
    const int N = a.num_tokens, RNM = R * NM, me = a.rank;
    if (tid == 0) ll_trace(a.trace, LL_TRACE_START);
    // Peer table in shared memory (loaded while the first global loads are in flight).
    __shared__ uint64_t s_peer_buf[32];
    const uint64_t* peers = a.peer_base;
    if (R <= 32) {
        if (tid < R) s_peer_buf[tid] = a.peer_base[tid];
        peers = s_peer_buf;
    }
    uint32_t* epoch = reinterpret_cast<uint32_t*>(a.buf + a.off_epoch);
    const uint32_t seq = (a.phases & LL_PHASE_SEND) ? *reinterpret_cast<volatile uint32_t*>(&epoch[b]) + 1u
                                                    : *reinterpret_cast<volatile uint32_t*>(&epoch[b]);
    if (tid == 0) s_fail = 0;
    __syncthreads();
    const uint8_t* y = static_cast<const uint8_t*>(a.y);

    if (a.phases & LL_PHASE_SEND) {
        // Owner side: send every row received from another rank back to its origin's
        // comb_recv[token][topk slot]. Rows of our own tokens stay where they are.
        const int* recv_count = reinterpret_cast<const int*>(a.hbuf + a.off_recv_count);
        const int64_t* layout_range = reinterpret_cast<const int64_t*>(a.hbuf + a.off_layout_range);
        const int* src_info = reinterpret_cast<const int*>(a.hbuf + a.off_src_info);
        const int* src_k = reinterpret_cast<const int*>(a.hbuf + a.off_src_k);
        const int row_bytes = 2 * H;
        const int nseg = (row_bytes + LL_COMBINE_SEG_BYTES - 1) / LL_COMBINE_SEG_BYTES;
        uint8_t* stage = a.buf + a.off_stage + (static_cast<uint64_t>(b) * LL_WARPS + warp) * LL_STAGE_BYTES;
        bool did_put = false;
        // Announce that this rank (as an origin) has started the call.
        if (b == 0) {
            for (int r = tid; r < R; r += LL_THREADS)
                if (r != me) ll_signal<kPut>(a.buf, peers, r, a.off_comb_ready + static_cast<uint64_t>(me) * 8, ll_tag(seq, 0));
        }
        if (a.wait_ready) {
            for (int r = tid; r < R; r += LL_THREADS) {
                uint32_t unused = 0;
                if (r != me && !ll_wait_tag(a.buf, a.off_comb_ready + static_cast<uint64_t>(r) * 8, seq, &unused, diag,
                                            EP_PHASE_LL_COMBINE_SEND, b, r))
                    s_fail = 1;
            }
        }
        // Rows from other ranks, spread over the whole grid (balanced whatever the expert
        // counts): pre[le] = remote rows of local experts < le (block-wide exclusive scan).
        int* pre = smem;  // [L + 1]
        int* warp_sums = smem + L + 1;  // [LL_WARPS]
        {
            int v[2] = {0, 0};
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int le = 2 * tid + q;
                if (le < L) v[q] = recv_count[le] - static_cast<int>(layout_range[le * R + me] & 0xffffffff);
            }
            int x = v[0] + v[1];
#pragma unroll
            for (int m = 1; m < 32; m <<= 1) {
                const int y2 = __shfl_up_sync(0xffffffffu, x, m);
                if (lane >= m) x += y2;
            }
            if (lane == 31) warp_sums[warp] = x;
            __syncthreads();
            if (warp == 0) {
                int w = lane < LL_WARPS ? warp_sums[lane] : 0;
#pragma unroll
                for (int m = 1; m < 32; m <<= 1) {
                    const int y2 = __shfl_up_sync(0xffffffffu, w, m);
                    if (lane >= m) w += y2;
                }
                if (lane < LL_WARPS) warp_sums[lane] = w;  // inclusive
            }
            __syncthreads();
            const int excl = x - v[0] - v[1] + (warp > 0 ? warp_sums[warp - 1] : 0);
            if (2 * tid < L) pre[2 * tid] = excl;
            if (2 * tid + 1 < L) pre[2 * tid + 1] = excl + v[0];
            if (tid == 0) pre[L] = warp_sums[LL_WARPS - 1];
            __syncthreads();
        }
        const int total = s_fail ? 0 : pre[L] * nseg;
        for (int u = b * LL_WARPS + warp; u < total; u += G * LL_WARPS) {
            const int row = u / nseg, seg = u % nseg;
            // local expert: the last le with pre[le] <= row
            int lo = 0, hi = L - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (pre[mid] <= row) lo = mid; else hi = mid - 1;
            }
            const int le = lo;
            const int64_t own = layout_range[le * R + me];
            const int own_begin = static_cast<int>(own >> 32), own_cnt = static_cast<int>(own & 0xffffffff);
            const int jr = row - pre[le];
            const int j = jr < own_begin ? jr : jr + own_cnt;  // skip our own block
            int s = -1;
            for (int r = 0; r < R; ++r) {
                const int64_t v = layout_range[le * R + r];
                const int bg = static_cast<int>(v >> 32), c = static_cast<int>(v & 0xffffffff);
                if (j >= bg && j < bg + c) s = r;
            }
            if (s < 0 || s == me) continue;
            const uint64_t slot = static_cast<uint64_t>(le) * RNM + j;
            const int t = src_info[slot], k = src_k[slot];
            const int off0 = seg * LL_COMBINE_SEG_BYTES;
            const int nbytes = min(LL_COMBINE_SEG_BYTES, row_bytes - off0);
            const uint8_t* src = y + slot * row_bytes + off0;
            const uint64_t dst_off =
                a.off_comb_recv + (static_cast<uint64_t>(t) * LL_MAX_TOPK + k) * row_bytes + off0;
            const uint64_t peer = peers[s];
            const bool direct = !kPut || peer != 0;
            uint8_t* dst = direct ? reinterpret_cast<uint8_t*>(peer + dst_off) : stage;
            int4 v[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int off = q * 512 + lane * 16;
                if (off < nbytes) v[q] = ld_nc_v4(reinterpret_cast<const int4*>(src + off));
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int off = q * 512 + lane * 16;
                if (off < nbytes) st_na_v4(reinterpret_cast<int4*>(dst + off), v[q]);
            }
            if (!direct) {
                __syncwarp();
                ll_nvshmem_put_warp(a.buf + dst_off, stage, nbytes, s);
                did_put = true;
            }
        }
        if (kPut && did_put && lane == 0) ll_nvshmem_quiet();
        ll_publish_fence<kPut>();
        __syncthreads();
        if (tid == 0) ll_trace(a.trace, LL_TRACE_SENT);
        for (int r = tid; r < R; r += LL_THREADS) {
            if (r == me) continue;
            ll_publish_fence<kPut>();
            ll_signal<kPut>(a.buf, peers, r, a.off_comb_done + (static_cast<uint64_t>(me) * G + b) * 8, ll_tag(seq, 0));
        }
        if (tid == 0) epoch[b] = seq;
    }

    if (a.phases & LL_PHASE_RECV) {
        __syncthreads();
        // Origin side. Each warp first sums the terms of experts we own (read in place from y,
        // while the remote rows are still arriving), then waits once for every block of every
        // other rank, then adds the remote terms. Any summation order is within the reference's
        // bound; the result is rounded to bf16 once.
        const int* send_slot = reinterpret_cast<const int*>(a.hbuf + a.off_send_slot);
        const uint8_t* comb_recv = a.buf + a.off_comb_recv;
        const int nseg = (H + LL_REDUCE_SEG - 1) / LL_REDUCE_SEG;
        bool ready = false;
        for (int u = b * LL_WARPS + warp; u < N * nseg; u += G * LL_WARPS) {
            const int t = u / nseg, c0 = (u % nseg) * LL_REDUCE_SEG + lane * 8;
            const bool active = c0 < H;
            float acc[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] = 0.f;
            for (int pass = 0; pass < 2; ++pass) {
                if (pass == 1 && !ready) {
                    if (lane == 0) ll_trace(a.trace, LL_TRACE_LOCAL);
                    if (!ll_warp_wait_all(a.buf, a.off_comb_done, R * G, G, me, seq, diag, lane)) {
                        s_fail = 1;
                        return;
                    }
                    if (lane == 0) {
                        ll_trace(a.trace, LL_TRACE_WAITED_FIRST);
                        ll_trace(a.trace, LL_TRACE_WAITED);
                    }
                    ready = true;
                }
                if (!active) continue;
                // All loads of this pass first (independent, in flight together), then the FMAs.
                int4 v[LL_MAX_TOPK];
                float w[LL_MAX_TOPK];
#pragma unroll
                for (int k = 0; k < LL_MAX_TOPK; ++k) {
                    w[k] = 0.f;
                    if (k >= K) continue;
                    const int64_t e = a.topk_idx[t * K + k];
                    if (e < 0 || e >= E) continue;  // -1, or an id dispatch dropped (and recorded)
                    const int d = static_cast<int>(e / L), le = static_cast<int>(e % L);
                    if ((d == me) != (pass == 0)) continue;
                    w[k] = a.topk_weights[t * K + k];
                    if (d == me) {
                        const uint64_t row = static_cast<uint64_t>(le) * RNM + send_slot[t * LL_MAX_TOPK + k];
                        v[k] = ld_nc_v4(reinterpret_cast<const int4*>(y + (row * H + c0) * 2));
                    } else {
                        v[k] = ld_volatile_v4(reinterpret_cast<const int4*>(
                            comb_recv + ((static_cast<uint64_t>(t) * LL_MAX_TOPK + k) * H + c0) * 2));
                    }
                }
#pragma unroll
                for (int k = 0; k < LL_MAX_TOPK; ++k) {
                    if (w[k] == 0.f) continue;  // unused slot (a real weight of 0 adds nothing either)
                    float f[8];
                    bf16x8_to_f32(v[k], f);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[q] = __fmaf_rn(f[q], w[k], acc[q]);
                }
            }
            if (!active) continue;
            uint32_t o[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const __nv_bfloat162 p = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
                o[q] = *reinterpret_cast<const uint32_t*>(&p);
            }
            *reinterpret_cast<int4*>(static_cast<uint8_t*>(a.out) + (static_cast<uint64_t>(t) * H + c0) * 2) =
                make_int4(static_cast<int>(o[0]), static_cast<int>(o[1]), static_cast<int>(o[2]), static_cast<int>(o[3]));
        }
        if (lane == 0) ll_trace(a.trace, LL_TRACE_END);
    }
}

// ---- dispatch v2 (see low_latency.cuh) ---------------------------------------------------------
// Receive side of dispatch v2: copy the packed rows of this block's local experts from the token
// staging area (and, for FP8, transpose the row's scales), kBatch units (2 KiB of a row) per warp
// at a time: every unit's slot is resolved and all their loads (rows, and the scales of a row's
// first unit) are in flight before any store.
template <int kBatch>
__device__ __forceinline__ void ll_dispatch2_copy(const LlDispatch2Args& a, const uint8_t* stage_base, const int* totals,
                                                  const int* begin, const int* list, int b, int G, int nseg, int units,
                                                  int row_bytes, int groups, uint64_t stride, int warp, int lane) {
    const int R = a.num_ranks, NM = a.num_max, K = a.num_topk, H = a.hidden, RNM = R * NM, S = H / 128, me = a.rank;
    for (int u0 = warp; u0 < units; u0 += LL_WARPS * kBatch) {
        int4 v[kBatch][4];
        float sc_v[kBatch][2];
        uint8_t* dst[kBatch];
        int nbytes[kBatch], meta_le[kBatch], meta_slot[kBatch], meta_sel[kBatch], meta_s[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const int u = u0 + i * LL_WARPS;
            nbytes[i] = 0;
            meta_le[i] = -1;
            if (u >= units) continue;
            int rest = u, li = 0;
            for (;; ++li) {
                const int n = totals[li] * nseg;
                if (rest < n) break;
                rest -= n;
            }
            const int slot = rest / nseg, seg = rest % nseg;
            const int le = b + li * G;
            int s = 0;
            while (s + 1 < R && begin[li * R + s + 1] <= slot) ++s;
            const int sel = list[(li * R + s) * NM + (slot - begin[li * R + s])];
            const int t = sel / K;
            const uint8_t* entry = stage_base + (static_cast<uint64_t>(s) * NM + t) * stride;
            const int off0 = seg * LL_COPY_SEG_BYTES;
            nbytes[i] = min(LL_COPY_SEG_BYTES, row_bytes - off0);
            dst[i] = a.buf + a.off_x + (static_cast<uint64_t>(le) * RNM + slot) * row_bytes + off0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int off = q * 512 + lane * 16;
                if (off < nbytes[i]) v[i][q] = ld_volatile_v4(reinterpret_cast<const int4*>(entry + off0 + off));
            }
            if (seg == 0) {
                meta_le[i] = le;
                meta_slot[i] = slot;
                meta_sel[i] = sel;
                meta_s[i] = s;
                if (a.use_fp8) {
                    // Up to 2 scale words per lane (S <= 64 groups: H <= 8192).
                    const float* sc = reinterpret_cast<const float*>(entry + 2 * static_cast<uint64_t>(H));
#pragma unroll
                    for (int w = 0; w < 2; ++w) {
                        const int g = lane + 32 * w;
                        sc_v[i][w] = g < S ? __ldcg(sc + g) : 0.f;
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int off = q * 512 + lane * 16;
                if (off < nbytes[i]) *reinterpret_cast<int4*>(dst[i] + off) = v[i][q];
            }
            const int le = meta_le[i];
            if (le < 0) continue;  // not the first unit of a row (warp-uniform)
            const int slot = meta_slot[i], t = meta_sel[i] / K, k = meta_sel[i] % K, s = meta_s[i];
            const uint64_t idx = static_cast<uint64_t>(le) * RNM + slot;
            if (lane == 0) {
                reinterpret_cast<int*>(a.buf + a.off_src_info)[idx] = t;
                reinterpret_cast<int*>(a.buf + a.off_src_k)[idx] = k;
                if (s == me) reinterpret_cast<int*>(a.buf + a.off_send_slot)[t * LL_MAX_TOPK + k] = slot;
                reinterpret_cast<int*>(a.buf + a.off_tok_slot)[(static_cast<uint64_t>(s) * NM + t) * LL_MAX_TOPK + k] = static_cast<int>(idx);
            }
            if (a.use_fp8) {
                if (a.use_ue8m0) {
                    // Group g of 4 scales packs the exponent bytes of scales 4g..4g+3 (lowest first):
                    // gather them from the lanes that hold them (scale j sits in lane j % 32, word j / 32).
                    for (int g = 0; g < groups; g += 32) {
                        uint32_t packed = 0;
#pragma unroll
                        for (int q = 0; q < 4; ++q) {
                            const int j = 4 * (g + lane) + q;
                            const float x0 = __shfl_sync(0xffffffffu, sc_v[i][0], j & 31);
                            const float x1 = __shfl_sync(0xffffffffu, sc_v[i][1], j & 31);
                            const float x = (j >> 5) == 0 ? x0 : x1;
                            packed |= ((__float_as_uint(x) >> 23) & 0xffu) << (8 * q);
                        }
                        if (g + lane < groups)
                            reinterpret_cast<uint32_t*>(a.buf + a.off_scales)[(static_cast<uint64_t>(le) * groups + g + lane) * RNM + slot] = packed;
                    }
                } else {
#pragma unroll
                    for (int w = 0; w < 2; ++w) {
                        const int g = lane + 32 * w;
                        if (g < groups)
                            reinterpret_cast<float*>(a.buf + a.off_scales)[(static_cast<uint64_t>(le) * groups + g) * RNM + slot] = sc_v[i][w];
                    }
                }
            }
        }
    }
}

// Dynamic shared memory (int32): cnt[lpb*R] | begin[lpb*R] | totals[lpb] | ntok[R] | list[lpb*R*NM]
template <bool kPut>
__device__ __forceinline__ void ll_dispatch2_impl(const LlDispatch2Args& a, const EpDiag& diag) {
    extern __shared__ int smem[];
    __shared__ int s_fail;
    const int b = blockIdx.x, G = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int R = a.num_ranks, E = a.num_experts, L = E / R, NM = a.num_max, K = a.num_topk, H = a.hidden;
    const int N = a.num_tokens, RNM = R * NM, S = H / 128, me = a.rank;
    if (tid == 0) ll_trace(a.trace, LL_TRACE_START);
    // Peer table in shared memory (loaded while the first global loads are in flight).
    __shared__ uint64_t s_peer_buf[32];
    const uint64_t* peers = a.peer_base;
    if (R <= 32) {
        if (tid < R) s_peer_buf[tid] = a.peer_base[tid];
        peers = s_peer_buf;
    }
    const int lpb = (L + G - 1) / G;
    const int row_bytes = a.use_fp8 ? H : 2 * H;
    const uint64_t stride = static_cast<uint64_t>(a.stage_stride);
    uint32_t* epoch = reinterpret_cast<uint32_t*>(a.buf + a.off_epoch);
    const uint32_t seq = (a.phases & LL_PHASE_SEND) ? *reinterpret_cast<volatile uint32_t*>(&epoch[b]) + 1u
                                                    : *reinterpret_cast<volatile uint32_t*>(&epoch[b]);
    if (tid == 0) s_fail = 0;
    __syncthreads();

    if (a.phases & LL_PHASE_SEND) {
        // Announce the call; when an earlier dispatch deferred its receive half, wait until each
        // destination has started this call (so its deferred receive is done) before writing.
        if (b == 0) {
            for (int r = tid; r < R; r += LL_THREADS)
                if (r != me) ll_signal<kPut>(a.buf, peers, r, a.off_ready + static_cast<uint64_t>(me) * 8, ll_tag(seq, 0));
        }
        if (a.wait_ready) {
            for (int r = tid; r < R; r += LL_THREADS) {
                uint32_t unused = 0;
                if (r != me && !ll_wait_tag(a.buf, a.off_ready + static_cast<uint64_t>(r) * 8, seq, &unused, diag,
                                            EP_PHASE_LL_DISPATCH_SEND, b, r))
                    s_fail = 1;
            }
            __syncthreads();
        }
        const int nseg = (H + LL_DISPATCH_SEG - 1) / LL_DISPATCH_SEG;
        uint8_t* wstage = a.buf + a.off_stage + (static_cast<uint64_t>(b) * LL_WARPS + warp) * LL_STAGE_BYTES;
        bool did_put = false;
        const int total = s_fail ? 0 : N * nseg;
        for (int u = b * LL_WARPS + warp; u < total; u += G * LL_WARPS) {
            const int t = u / nseg, seg = u % nseg;
            const uint8_t* xrow = static_cast<const uint8_t*>(a.x) + static_cast<uint64_t>(t) * H * 2;
            const int c0 = seg * LL_DISPATCH_SEG;
            const int nch = min(LL_DISPATCH_SEG, H - c0);
            // The token's channels first (independent of the routing, so both loads overlap).
            int4 v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j * 256 + lane * 8 < nch) v[j] = ld_nc_v4(reinterpret_cast<const int4*>(xrow + (c0 + j * 256 + lane * 8) * 2));
            // Destination ranks of this token (R <= 32, checked by the host).
            int e_lane = -1;
            if (lane < K) {
                const int64_t e = a.topk_idx[t * K + lane];
                if (e >= 0 && e < E) e_lane = static_cast<int>(e);
                // An id that points nowhere is sent as -1 (dropped); recorded once per token.
                else if (e != -1 && seg == 0)
                    ep_record_bad_expert(diag, EP_PHASE_LL_DISPATCH_SEND, static_cast<uint64_t>(t) * K + lane, e, K, E);
            }
            const uint32_t dest = __reduce_or_sync(0xffffffffu, e_lane >= 0 ? (1u << (e_lane / L)) : 0u);
            const uint64_t entry = a.off_tok_stage + (static_cast<uint64_t>(me) * NM + t) * stride;
            if (seg == 0 && lane < K) {
                // The token's top-k ids, for the receivers' binning: to every rank, so that no
                // receiver ever bins a stale entry of a token that was not sent to it.
                for (int r = 0; r < R; ++r) {
                    const uint64_t off = entry + a.tk_off + lane * 4;
                    if (!kPut || peers[r] != 0) *reinterpret_cast<int*>(peers[r] + off) = e_lane;
                    else nvshmem_int_p(reinterpret_cast<int*>(a.buf + off), e_lane, r);
                }
            }
            if (a.use_fp8) {
                const int nit = nch / 256;
                uint32_t lo[4], hi[4];
                float my_scale = 0.f;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    lo[j] = hi[j] = 0;
                    if (j >= nit) continue;
                    float f[8];
                    bf16x8_to_f32(v[j], f);
                    float amax = 0.f;
#pragma unroll
                    for (int q = 0; q < 8; ++q) amax = fmaxf(amax, fabsf(f[q]));
#pragma unroll
                    for (int m = 8; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
                    amax = fmaxf(amax, 1e-4f);
                    float scale, scale_inv;
                    ll_group_scale(amax, a.round_scale != 0, scale, scale_inv);
                    lo[j] = fp8x2(__fmul_rn(f[0], scale), __fmul_rn(f[1], scale)) |
                            (fp8x2(__fmul_rn(f[2], scale), __fmul_rn(f[3], scale)) << 16);
                    hi[j] = fp8x2(__fmul_rn(f[4], scale), __fmul_rn(f[5], scale)) |
                            (fp8x2(__fmul_rn(f[6], scale), __fmul_rn(f[7], scale)) << 16);
                    const float s_lo = __shfl_sync(0xffffffffu, scale_inv, 0);
                    const float s_hi = __shfl_sync(0xffffffffu, scale_inv, 16);
                    if (lane == 2 * j) my_scale = s_lo;
                    if (lane == 2 * j + 1) my_scale = s_hi;
                }
                const uint64_t d_off = entry + c0;
                const uint64_t s_off = entry + 2 * static_cast<uint64_t>(H) + (c0 / 128) * 4;
                for (uint32_t m = dest; m != 0; m &= m - 1) {
                    const int r = __ffs(m) - 1;
                    const uint64_t peer = peers[r];
                    const bool direct = !kPut || peer != 0;
                    uint8_t* dst = direct ? reinterpret_cast<uint8_t*>(peer + d_off) : wstage;
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (j < nit) st_v2(dst + j * 256 + lane * 8, lo[j], hi[j]);
                    float* sdst = direct ? reinterpret_cast<float*>(peer + s_off) : reinterpret_cast<float*>(wstage + LL_COMBINE_SEG_BYTES);
                    if (lane < 2 * nit) sdst[lane] = my_scale;
                    if (!direct) {
                        __syncwarp();
                        ll_nvshmem_put_warp(a.buf + d_off, wstage, nch, r);
                        ll_nvshmem_put_warp(a.buf + s_off, wstage + LL_COMBINE_SEG_BYTES, 2 * nit * 4, r);
                        did_put = true;
                    }
                }
            } else {
                const int nbytes = nch * 2;
                const uint64_t d_off = entry + c0 * 2;
                for (uint32_t m = dest; m != 0; m &= m - 1) {
                    const int r = __ffs(m) - 1;
                    const uint64_t peer = peers[r];
                    const bool direct = !kPut || peer != 0;
                    uint8_t* dst = direct ? reinterpret_cast<uint8_t*>(peer + d_off) : wstage;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int off = j * 512 + lane * 16;
                        if (off < nbytes) st_na_v4(reinterpret_cast<int4*>(dst + off), v[j]);
                    }
                    if (!direct) {
                        __syncwarp();
                        ll_nvshmem_put_warp(a.buf + d_off, wstage, nbytes, r);
                        did_put = true;
                    }
                }
            }
        }
        if (kPut && did_put && lane == 0) ll_nvshmem_quiet();
        ll_publish_fence<kPut>();
        __syncthreads();
        if (!s_fail) {
            // This block's tokens are staged everywhere they go: flag every rank (with N, so the
            // receiver knows how many tokens to scan).
            for (int r = tid; r < R; r += LL_THREADS) {
                ll_publish_fence<kPut>();
                ll_signal<kPut>(a.buf, peers, r, a.off_tok_flags + (static_cast<uint64_t>(me) * G + b) * 8,
                                ll_tag(seq, static_cast<uint32_t>(N)));
            }
        }
        if (tid == 0) {
            epoch[b] = seq;
            ll_trace(a.trace, LL_TRACE_SENT);
        }
    }

    if (a.phases & LL_PHASE_RECV) {
        __syncthreads();
        if (s_fail) return;
        int* cnt = smem;
        int* begin = cnt + lpb * R;
        int* totals = begin + lpb * R;
        int* ntok = totals + lpb;
        int* list = ntok + R;
        for (int j = tid; j < lpb * R; j += LL_THREADS) cnt[j] = 0;
        // Wait for every block of every source; the payload is the source's token count.
        for (int j = tid; j < R * G; j += LL_THREADS) {
            uint32_t n = 0;
            if (!ll_wait_tag(a.buf, a.off_tok_flags + static_cast<uint64_t>(j) * 8, seq, &n, diag, EP_PHASE_LL_DISPATCH_RECV,
                             j % G, j / G)) {
                s_fail = 1;
            }
            if (j % G == 0) {
                ntok[j / G] = static_cast<int>(n);
                if (b == 0) reinterpret_cast<int*>(a.buf + a.off_ntok)[j / G] = static_cast<int>(n);
            }
        }
        __syncthreads();
        if (s_fail) return;
        if (tid == 0) {
            ll_trace(a.trace, LL_TRACE_WAITED_FIRST);
            ll_trace(a.trace, LL_TRACE_WAITED);
        }
        // Bin the staged selections of this block's local experts (le % G == b). Entries are
        // indexed i = (s * NM + t) * K + k over every source; each thread loads 8 of them at once
        // (independent loads in flight), then bins them.
        const uint8_t* stage_base = a.buf + a.off_tok_stage;
        const int nentries = R * NM * K;
        for (int i0 = tid; i0 < nentries; i0 += 8 * LL_THREADS) {
            int ev[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int i = i0 + q * LL_THREADS;
                ev[q] = -1;
                if (i >= nentries) continue;
                const int s = i / (NM * K), t = (i / K) % NM, k = i % K;
                if (t >= min(ntok[s], NM)) continue;
                ev[q] = __ldcg(reinterpret_cast<const int*>(stage_base + (static_cast<uint64_t>(s) * NM + t) * stride + a.tk_off) + k);
            }
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int i = i0 + q * LL_THREADS;
                const int e = ev[q];
                const int le = e - me * L;
                const int s = i / (NM * K), t = (i / K) % NM, k = i % K;
                if (e >= 0 && le >= 0 && le < L) {
                    if (le % G == b) {
                        const int li = le / G;
                        const int p = atomicAdd(&cnt[li * R + s], 1);
                        if (p < NM) list[(li * R + s) * NM + p] = t * K + k;
                    }
                } else if (i < nentries && t < min(ntok[s], NM) && i % G == b) {
                    // Held elsewhere (or unused): -1 in tok_slot, so that combine needs no staged
                    // top-k id (peers overwrite the staging in their next dispatch into this half).
                    reinterpret_cast<int*>(a.buf + a.off_tok_slot)[(static_cast<uint64_t>(s) * NM + t) * LL_MAX_TOPK + k] = -1;
                }
            }
        }
        __syncthreads();
        int64_t* layout_range = reinterpret_cast<int64_t*>(a.buf + a.off_layout_range);
        int* recv_count = reinterpret_cast<int*>(a.buf + a.off_recv_count);
        for (int li = tid; li < lpb; li += LL_THREADS) {
            const int le = b + li * G;
            if (le >= L) continue;
            int total = 0;
            for (int s = 0; s < R; ++s) {
                int c = cnt[li * R + s];
                if (c > NM) {
                    ep_record_error(diag, EP_ERR_BAD_ARGUMENT, EP_PHASE_LL_DISPATCH_RECV, le, s, c, 0);
                    c = NM;
                    cnt[li * R + s] = NM;
                }
                begin[li * R + s] = total;
                layout_range[le * R + s] = (static_cast<int64_t>(total) << 32) | static_cast<uint32_t>(c);
                total += c;
            }
            recv_count[le] = total;
            totals[li] = total;
        }
        __syncthreads();
        if (tid == 0) ll_trace(a.trace, LL_TRACE_LOCAL);
        // Copy rows from the staging area into their packed slots (local memory only).
        const int nseg = (row_bytes + LL_COPY_SEG_BYTES - 1) / LL_COPY_SEG_BYTES;
        int units = 0;
        for (int li = 0; li < lpb; ++li)
            if (b + li * G < L) units += totals[li] * nseg;
        const int groups = a.use_ue8m0 ? S / 4 : S;
        // FP8 rows: LL_COPY_BATCH units per warp at a time. BF16 rows (twice the bytes) measured
        // slower that way (run S2-D: 25.2 vs 24.1 us at 128 tokens) and copy one at a time.
        if (a.use_fp8)
            ll_dispatch2_copy<LL_COPY_BATCH>(a, stage_base, totals, begin, list, b, G, nseg, units, row_bytes, groups, stride, warp, lane);
        else
            ll_dispatch2_copy<1>(a, stage_base, totals, begin, list, b, G, nseg, units, row_bytes, groups, stride, warp, lane);
        if (lane == 0) ll_trace(a.trace, LL_TRACE_END);
    }
}

// ---- combine v3 (see low_latency.cuh; v2 = kLateWts false, retired) ----------------------------
// kLateWts (v3): owners do not wait for the weights before starting; each warp issues its rows'
// loads first and acquires the origin's weights flag only before the FMAs (once per origin per
// warp), so the weights' NVLink round trip overlaps the row loads instead of preceding them.
template <bool kPut, bool kLateWts>
__device__ __forceinline__ void ll_combine2_impl(const LlCombine2Args& a, const EpDiag& diag) {
    __shared__ int s_fail;
    __shared__ int s_ntok[32];
    const int b = blockIdx.x, G = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int R = a.num_ranks, E = a.num_experts, L = E / R, NM = a.num_max, K = a.num_topk, H = a.hidden;
    const int N = a.num_tokens, RNM = R * NM, me = a.rank;
    if (tid == 0) ll_trace(a.trace, LL_TRACE_START);
    // Roles. With both phases in one launch and `owner_warps` in [1, LL_WARPS), warps
    // [0, owner_warps) of every block do the owner work (partials for other origins) while the
    // others do the origin work at the same time (own-expert terms, then the partials as they
    // arrive); otherwise every warp does the owner work, then the origin work.
    const bool do_send = (a.phases & LL_PHASE_SEND) != 0, do_recv = (a.phases & LL_PHASE_RECV) != 0;
    const bool split = do_send && do_recv && a.owner_warps > 0 && a.owner_warps < LL_WARPS;
    const int ow = split ? a.owner_warps : LL_WARPS;                // owner warps per block
    const int rw = split ? LL_WARPS - a.owner_warps : LL_WARPS;     // origin warps per block
    const bool owner_warp = do_send && (!split || warp < ow);
    const bool origin_warp = do_recv && (!split || warp >= ow);
    const int rwarp = split ? warp - ow : warp;
    // Peer table in shared memory (loaded while the first global loads are in flight).
    __shared__ uint64_t s_peer_buf[32];
    const uint64_t* peers = a.peer_base;
    if (R <= 32) {
        if (tid < R) s_peer_buf[tid] = a.peer_base[tid];
        peers = s_peer_buf;
    }
    uint32_t* epoch = reinterpret_cast<uint32_t*>(a.buf + a.off_epoch);
    const uint32_t seq = do_send ? *reinterpret_cast<volatile uint32_t*>(&epoch[b]) + 1u
                                 : *reinterpret_cast<volatile uint32_t*>(&epoch[b]);
    if (tid == 0) s_fail = 0;
    __syncthreads();
    const uint8_t* y = static_cast<const uint8_t*>(a.y);
    const int nseg = (H + LL_REDUCE_SEG - 1) / LL_REDUCE_SEG;

    if (do_send) {
        // Origin role: ship our weights to every other rank, then flag (payload N).
        if (b == 0) {
            for (int i = tid; i < N * K; i += LL_THREADS) {
                const int t = i / K, k = i % K;
                const float w = a.topk_weights[i];
                const uint64_t off = a.off_wts + ((static_cast<uint64_t>(me) * NM + t) * LL_MAX_TOPK + k) * 4;
                for (int r = 0; r < R; ++r) {
                    if (r == me) continue;
                    if (!kPut || peers[r] != 0) *reinterpret_cast<float*>(peers[r] + off) = w;
                    else nvshmem_float_p(reinterpret_cast<float*>(a.buf + off), w, r);
                }
            }
            if (kPut) ll_nvshmem_quiet();
            ll_publish_fence<kPut>();
            __syncthreads();
            for (int r = tid; r < R; r += LL_THREADS)
                if (r != me) ll_signal<kPut>(a.buf, peers, r, a.off_wts_flag + static_cast<uint64_t>(me) * 8,
                                             ll_tag(seq, static_cast<uint32_t>(N)));
        }
        // Owner role: wait for every origin's weights (it has also started this call, so its
        // partial buffer is free).
        const int* ntok_d = reinterpret_cast<const int*>(a.hbuf + a.off_ntok);
        for (int r = tid; r < R; r += LL_THREADS) {
            uint32_t n = 0;
            if (!kLateWts && r != me &&
                !ll_wait_tag(a.buf, a.off_wts_flag + static_cast<uint64_t>(r) * 8, seq, &n, diag, EP_PHASE_LL_COMBINE_SEND, b, r))
                s_fail = 1;
            if (r < 32) s_ntok[r] = (r == me) ? 0 : min(ntok_d[r], NM);
        }
        __syncthreads();
    }
    if (owner_warp) {
        uint32_t wts_seen = 0;  // v3: origins whose weights flag this warp has acquired
        const int* tok_slot = reinterpret_cast<const int*>(a.hbuf + a.off_tok_slot);
        const float* wts = reinterpret_cast<const float*>(a.buf + a.off_wts);
        uint8_t* wstage = a.buf + a.off_stage + (static_cast<uint64_t>(b) * LL_WARPS + warp) * LL_STAGE_BYTES;
        bool did_put = false;
        int total = 0;
        if (!s_fail)
            for (int r = 0; r < R; ++r) total += s_ntok[r] * nseg;
        // Units (origin s, token t, 256 channels) in batches of LL_OWNER_BATCH per warp. Prologue:
        // the routing of the whole batch (the dispatch's packed row of each (s, t, k), -1 for an
        // expert held elsewhere or an unused slot), one (j, k) entry per lane, all loads in
        // flight together, kept in shared memory as the y row of every local term.
        __shared__ int s_orow[LL_WARPS][LL_OWNER_BATCH][LL_MAX_TOPK];
        const int ostep = G * ow;
        for (int u0 = b * ow + warp; u0 < total; u0 += LL_OWNER_BATCH * ostep) {
            const int nb = min(LL_OWNER_BATCH, (total - u0 + ostep - 1) / ostep);
            __syncwarp();
            for (int i = lane; i < nb * K; i += 32) {
                const int j = i / K, k = i % K;
                int rest = u0 + j * ostep, s = 0;
                for (;; ++s) {
                    const int n = s_ntok[s] * nseg;
                    if (rest < n) break;
                    rest -= n;
                }
                const uint64_t tok = static_cast<uint64_t>(s) * NM + rest / nseg;
                s_orow[warp][j][k] = tok_slot[tok * LL_MAX_TOPK + k];
            }
            __syncwarp();
            for (int j = 0; j < nb; ++j) {
                int rest = u0 + j * ostep, s = 0;
                for (;; ++s) {
                    const int n = s_ntok[s] * nseg;
                    if (rest < n) break;
                    rest -= n;
                }
                // Lane channels: cA = seg*256 + 4*lane and cB = cA + 128 (four each), so that every
                // store instruction of the warp covers 512 contiguous bytes of the f32 partial row
                // (whole 32-byte sectors over NVLink) and every row load 256 contiguous bytes.
                const int t = rest / nseg, seg0 = (rest % nseg) * LL_REDUCE_SEG;
                const int cA = seg0 + lane * 4, cB = cA + LL_REDUCE_SEG / 2;
                const bool actA = cA < H, actB = cB < H;
                const uint64_t base = (static_cast<uint64_t>(s) * NM + t) * LL_MAX_TOPK;
                uint2 va[LL_MAX_TOPK], vb[LL_MAX_TOPK];
                int nlocal = 0;
#pragma unroll
                for (int k = 0; k < LL_MAX_TOPK; ++k) {
                    if (k >= K) continue;
                    const int row = s_orow[warp][j][k];
                    if (row < 0) continue;
                    ++nlocal;
                    const uint8_t* yrow = y + static_cast<uint64_t>(row) * H * 2;
                    if (actA) va[k] = ld_nc_v2(yrow + cA * 2);
                    if (actB) vb[k] = ld_nc_v2(yrow + cB * 2);
                }
                if (nlocal == 0) continue;  // nothing of this token lives here (warp-uniform)
                if (kLateWts && !(wts_seen & (1u << s))) {
                    // Origin s's weights (and "s has started this call": its partial buffer is
                    // free) while the row loads above are in flight.
                    bool ok = true;
                    if (lane == 0) {
                        uint32_t n = 0;
                        ok = ll_wait_tag(a.buf, a.off_wts_flag + static_cast<uint64_t>(s) * 8, seq, &n, diag,
                                         EP_PHASE_LL_COMBINE_SEND, b, s);
                    }
                    __syncwarp();
                    if (!__shfl_sync(0xffffffffu, ok, 0)) {
                        s_fail = 1;
                        break;
                    }
                    wts_seen |= 1u << s;
                }
                // Lane k holds the weight of top-k slot k (v2 waited for the weights up front).
                const float wl = (lane < K && s_orow[warp][j][lane] >= 0) ? __ldcg(wts + base + lane) : 0.f;
                float acc[8];
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[q] = 0.f;
#pragma unroll
                for (int k = 0; k < LL_MAX_TOPK; ++k) {
                    if (k >= K || s_orow[warp][j][k] < 0) continue;  // warp-uniform
                    const float wk = __shfl_sync(0xffffffffu, wl, k);
                    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    if (actA) bf16x4_to_f32(va[k], f);
                    if (actB) bf16x4_to_f32(vb[k], f + 4);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[q] = __fmaf_rn(f[q], wk, acc[q]);
                }
                const uint64_t d_off = a.off_part + ((static_cast<uint64_t>(t) * R + me) * H + seg0) * 4;
                const uint64_t peer = peers[s];
                const bool direct = !kPut || peer != 0;
                uint8_t* dst = direct ? reinterpret_cast<uint8_t*>(peer + d_off) : wstage;
                if (actA)
                    st_na_v4(reinterpret_cast<int4*>(dst + lane * 16),
                             make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]), __float_as_int(acc[3])));
                if (actB)
                    st_na_v4(reinterpret_cast<int4*>(dst + LL_REDUCE_SEG * 2 + lane * 16),
                             make_int4(__float_as_int(acc[4]), __float_as_int(acc[5]), __float_as_int(acc[6]), __float_as_int(acc[7])));
                if (!direct) {
                    __syncwarp();
                    ll_nvshmem_put_warp(a.buf + d_off, wstage, min(LL_REDUCE_SEG, H - seg0) * 4, s);
                    did_put = true;
                }
            }
            if (s_fail) break;
        }
        if (kPut && did_put && lane == 0) ll_nvshmem_quiet();
        if (kLateWts) {
            // Before flagging an origin, this block must know it has started this call, even
            // without a unit for it: a hooked earlier combine of the origin may still be polling
            // the previous tag of this half's flag (v2's block-wide wait up front ensures this).
            for (int r = tid; r < R; r += ow * 32) {
                uint32_t n = 0;
                if (r != me &&
                    !ll_wait_tag(a.buf, a.off_wts_flag + static_cast<uint64_t>(r) * 8, seq, &n, diag, EP_PHASE_LL_COMBINE_SEND, b, r))
                    s_fail = 1;
            }
        }
        ll_publish_fence<kPut>();
        // Barrier of the owner warps only (named barrier 1; all warps when not split).
        asm volatile("bar.sync 1, %0;" ::"r"(ow * 32) : "memory");
        if (tid == 0) ll_trace(a.trace, LL_TRACE_SENT);
        for (int r = tid; r < R; r += ow * 32) {
            if (r == me) continue;
            ll_publish_fence<kPut>();
            ll_signal<kPut>(a.buf, peers, r, a.off_comb_done + (static_cast<uint64_t>(me) * G + b) * 8, ll_tag(seq, 0));
        }
        if (tid == 0) epoch[b] = seq;
    }

    if (origin_warp) {
        if (!split) {
            __syncthreads();
            if (s_fail) return;
        }
        // Origin: own experts' terms (read in place) of up to LL_ORIGIN_BATCH units (token, 256
        // channels) per warp, kept in shared memory; then one wait for every owner block; then
        // each owner's partial is added and the row rounded to bf16.
        extern __shared__ float s_acc[];  // [origin warps][LL_ORIGIN_BATCH][8 f32 x 32 lanes]
        __shared__ uint32_t s_owners[LL_WARPS][LL_ORIGIN_BATCH];
        __shared__ int s_rrow[LL_WARPS][LL_ORIGIN_BATCH][LL_MAX_TOPK];
        __shared__ float s_rw[LL_WARPS][LL_ORIGIN_BATCH][LL_MAX_TOPK];
        float* my_acc = s_acc + static_cast<uint64_t>(rwarp) * LL_ORIGIN_BATCH * 256;
        const int* send_slot = reinterpret_cast<const int*>(a.hbuf + a.off_send_slot);
        const float* part = reinterpret_cast<const float*>(a.buf + a.off_part);
        const int units = N * nseg, step = G * rw;
        bool ready = false;
        for (int u0 = b * rw + rwarp; u0 < units; u0 += LL_ORIGIN_BATCH * step) {
            const int nb = min(LL_ORIGIN_BATCH, (units - u0 + step - 1) / step);
            // Prologue: the routing of the whole batch, one (j, k) entry per lane, all loads in
            // flight together: y row of every own-expert term (-1: none), its weight, and the
            // other ranks holding an expert of each unit's token.
            __syncwarp();
            if (lane < nb) s_owners[rwarp][lane] = 0;
            __syncwarp();
            for (int i = lane; i < nb * K; i += 32) {
                const int j = i / K, k = i % K;
                const int t = (u0 + j * step) / nseg;
                const int64_t e = a.topk_idx[t * K + k];
                const float wv = a.topk_weights[t * K + k];
                const int sl = send_slot[t * LL_MAX_TOPK + k];  // valid for our own experts only
                int row = -1;
                if (e >= 0 && e < E) {
                    const int d = static_cast<int>(e / L);
                    if (d == me) row = static_cast<int>(e % L) * RNM + sl;
                    else atomicOr(&s_owners[rwarp][j], 1u << d);
                }
                s_rrow[rwarp][j][k] = row;
                s_rw[rwarp][j][k] = wv;
            }
            __syncwarp();
            uint32_t any_owner = 0;
            for (int j = 0; j < nb; ++j) {
                const int u = u0 + j * step;
                // Same lane channels as the owners' partial rows (see above).
                const int seg0 = (u % nseg) * LL_REDUCE_SEG;
                const int cA = seg0 + lane * 4, cB = cA + LL_REDUCE_SEG / 2;
                const bool actA = cA < H, actB = cB < H;
                uint2 va[LL_MAX_TOPK], vb[LL_MAX_TOPK];
#pragma unroll
                for (int k = 0; k < LL_MAX_TOPK; ++k) {
                    if (k >= K) continue;
                    const int row = s_rrow[rwarp][j][k];
                    if (row < 0) continue;
                    const uint8_t* yrow = y + static_cast<uint64_t>(row) * H * 2;
                    if (actA) va[k] = ld_nc_v2(yrow + cA * 2);
                    if (actB) vb[k] = ld_nc_v2(yrow + cB * 2);
                }
                float acc[8];
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[q] = 0.f;
#pragma unroll
                for (int k = 0; k < LL_MAX_TOPK; ++k) {
                    if (k >= K || s_rrow[rwarp][j][k] < 0) continue;
                    const float wk = s_rw[rwarp][j][k];
                    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    if (actA) bf16x4_to_f32(va[k], f);
                    if (actB) bf16x4_to_f32(vb[k], f + 4);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[q] = __fmaf_rn(f[q], wk, acc[q]);
                }
                float4* sa = reinterpret_cast<float4*>(my_acc + j * 256);
                sa[lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                sa[32 + lane] = make_float4(acc[4], acc[5], acc[6], acc[7]);
                any_owner |= s_owners[rwarp][j];
            }
            if (any_owner != 0 && !ready) {
                if (lane == 0) ll_trace(a.trace, LL_TRACE_LOCAL);
                if (!ll_warp_wait_all(a.buf, a.off_comb_done, R * G, G, me, seq, diag, lane)) {
                    s_fail = 1;
                    return;
                }
                if (lane == 0) {
                    ll_trace(a.trace, LL_TRACE_WAITED_FIRST);
                    ll_trace(a.trace, LL_TRACE_WAITED);
                }
                ready = true;
            }
            __syncwarp();
            // Partials, kPB units at a time (the put kernels have no registers to spare) with their loads in flight together; a unit with
            // several other owners adds them one after the other.
            constexpr int kPB = kPut ? 1 : LL_PART_BATCH;
            for (int j0 = 0; j0 < nb; j0 += kPB) {
                int4 pa[kPB], pb[kPB];
                uint32_t rest[kPB];
#pragma unroll
                for (int i = 0; i < kPB; ++i) {
                    const int j = j0 + i;
                    rest[i] = j < nb ? s_owners[rwarp][j] : 0u;
                }
                while (true) {
                    bool more = false;
#pragma unroll
                    for (int i = 0; i < kPB; ++i) {
                        if (rest[i] == 0) continue;
                        more = true;
                        const int u = u0 + (j0 + i) * step;
                        const int t = u / nseg, cA = (u % nseg) * LL_REDUCE_SEG + lane * 4, cB = cA + LL_REDUCE_SEG / 2;
                        const float* pp = part + (static_cast<uint64_t>(t) * R + (__ffs(rest[i]) - 1)) * H;
                        if (cA < H) pa[i] = ld_volatile_v4(reinterpret_cast<const int4*>(pp + cA));
                        if (cB < H) pb[i] = ld_volatile_v4(reinterpret_cast<const int4*>(pp + cB));
                    }
                    if (!more) break;
#pragma unroll
                    for (int i = 0; i < kPB; ++i) {
                        if (rest[i] == 0) continue;
                        rest[i] &= rest[i] - 1;
                        float4* sa = reinterpret_cast<float4*>(my_acc + (j0 + i) * 256);
                        const float4 x = sa[lane], z = sa[32 + lane];
                        sa[lane] = make_float4(x.x + __int_as_float(pa[i].x), x.y + __int_as_float(pa[i].y),
                                               x.z + __int_as_float(pa[i].z), x.w + __int_as_float(pa[i].w));
                        sa[32 + lane] = make_float4(z.x + __int_as_float(pb[i].x), z.y + __int_as_float(pb[i].y),
                                                    z.z + __int_as_float(pb[i].z), z.w + __int_as_float(pb[i].w));
                    }
                }
            }
            for (int j = 0; j < nb; ++j) {
                const int u = u0 + j * step;
                const int t = u / nseg, cA = (u % nseg) * LL_REDUCE_SEG + lane * 4, cB = cA + LL_REDUCE_SEG / 2;
                const float4* sa = reinterpret_cast<const float4*>(my_acc + j * 256);
                const float4 x = sa[lane], z = sa[32 + lane];
                const float fa[4] = {x.x, x.y, x.z, x.w}, fb[4] = {z.x, z.y, z.z, z.w};
                uint8_t* orow = static_cast<uint8_t*>(a.out) + static_cast<uint64_t>(t) * H * 2;
                if (cA < H) *reinterpret_cast<uint2*>(orow + cA * 2) = f32x4_to_bf16(fa);
                if (cB < H) *reinterpret_cast<uint2*>(orow + cB * 2) = f32x4_to_bf16(fb);
            }
            __syncwarp();
        }
        if (lane == 0) ll_trace(a.trace, LL_TRACE_END);
    }
}

// ---- entry points ----------------------------------------------------------------------------
// `_p2p`: every peer is load/store reachable (nvshmem_ptr != 0 for all ranks): no NVSHMEM device
// call is compiled in. `_put`: generic, peers without a mapping get NVSHMEM puts (IBGDA & co).
// C++ names in namespace `ll` (not extern "C"): profilers show them as `ll::dispatch*(...)` and
// `ll::combine*(...)`, which is what DeepEP's test_low_latency.py (bench_kineto) looks for
// (`::dispatch`, `::combine`). The host loads them by their Itanium-mangled names
// (kernels/src/low_latency/mod.rs, `ll_entry`).
namespace ll {
__global__ void __launch_bounds__(LL_THREADS, 1) dispatch_p2p(const LlDispatchArgs a, EpDiag diag) {
    ll_dispatch_impl<false>(a, diag);
}
__global__ void __launch_bounds__(LL_THREADS, 1) dispatch_put(const LlDispatchArgs a, EpDiag diag) {
    ll_dispatch_impl<true>(a, diag);
}
__global__ void __launch_bounds__(LL_THREADS, 1) combine_p2p(const LlCombineArgs a, EpDiag diag) {
    ll_combine_impl<false>(a, diag);
}
__global__ void __launch_bounds__(LL_THREADS, 1) combine_put(const LlCombineArgs a, EpDiag diag) {
    ll_combine_impl<true>(a, diag);
}
__global__ void __launch_bounds__(LL_THREADS, 1) dispatch2_p2p(const LlDispatch2Args a, EpDiag diag) {
    ll_dispatch2_impl<false>(a, diag);
}
__global__ void __launch_bounds__(LL_THREADS, 1) dispatch2_put(const LlDispatch2Args a, EpDiag diag) {
    ll_dispatch2_impl<true>(a, diag);
}
// Combine v3: the pre-reducing protocol with weights acquired late. Combine v2's entry points
// (ll_combine2_*, kLateWts = false) were retired: v3 is faster at every measured shape and no
// case needs v2 (docs/architecture.md, "Kernel variants"); the template keeps its parameter so
// the kept kernels' code is unchanged.
__global__ void __launch_bounds__(LL_THREADS, 1) combine3_p2p(const LlCombine2Args a, EpDiag diag) {
    ll_combine2_impl<false, true>(a, diag);
}
__global__ void __launch_bounds__(LL_THREADS, 1) combine3_put(const LlCombine2Args a, EpDiag diag) {
    ll_combine2_impl<true, true>(a, diag);
}
}  // namespace ll
