// Shared device-side helpers for every deepep-kernels cubin.
//
// Contents: the diagnostic record that turns a stuck wait into a host error (rank, phase,
// channel, peer), explicit-ordering PTX loads/stores, and the global nanosecond timer.
// Every kernel takes an `EpDiag` by value as its LAST argument.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

// ---- diagnostics -------------------------------------------------------------------------
// Layout mirrored by `deepep_kernels::error::ErrorRecord` (40 bytes). Lives in host-mapped
// pinned memory; all zero means "no error".
//
// Two kinds of record (`deepep_kernels::error::RecordKind`):
//   * fatal: EP_ERR_TIMEOUT / EP_ERR_BAD_ARGUMENT / EP_ERR_ABORTED. The kernel gave up part of its
//     protocol; blocks that see it (ep_aborted) give up too; the buffer cannot be used again.
//   * EP_ERR_BAD_EXPERT_ID: a routing id that points nowhere (< -1 or >= num_experts) was treated
//     as -1 (dropped) and the kernel ran its protocol to the end. Fields: `peer` = num_experts
//     (valid ids are -1 or [0, peer)), `detail` = num_topk (columns of topk_idx), `channel` = -1,
//     `bad_key` = ep_bad_key(first bad flat position, its value) (see there). A fatal record may
//     replace it (ep_record_error); nothing replaces a fatal record.
struct EpErrorRecord {
    int32_t code;      // EP_ERR_*; -1 while the winning writer fills the other fields
    int32_t rank;      // rank that detected the problem
    int32_t phase;     // EP_PHASE_*
    int32_t channel;   // channel / block index, -1 if not applicable
    int32_t peer;      // rank being waited for, -1 if not applicable (EP_ERR_BAD_EXPERT_ID: num_experts)
    int32_t detail;    // free-form, e.g. the expected count (EP_ERR_BAD_EXPERT_ID: num_topk)
    uint64_t waited_ns;
    uint64_t bad_key;  // EP_ERR_BAD_EXPERT_ID only: atomicMax of ep_bad_key over every bad id seen
};

// Passed by value (24 bytes) as the last kernel argument.
struct EpDiag {
    EpErrorRecord* err;     // device pointer of the host-mapped record (never null)
    uint64_t timeout_ns;    // bound for any single wait
    int32_t rank;
    int32_t flags;          // EP_DIAG_* bits
};

// After recording a fatal error, abort the kernel with `trap` (a sticky CUDA error of this
// context), so that no later CUDA call of the process, e.g. a PyTorch read of an output this
// kernel did not finish, can succeed. Off by default everywhere (the Python binding sets it only
// with DEEPEP_KERNELS_TRAP_ON_ERROR=1); without it the host reports the record at the next call.
// A dropped bad expert id (EP_ERR_BAD_EXPERT_ID) never traps: the kernel completed normally.
#define EP_DIAG_TRAP 1

#define EP_ERR_NONE 0
#define EP_ERR_TIMEOUT 1
#define EP_ERR_BAD_ARGUMENT 2
#define EP_ERR_ABORTED 3  // another block already recorded an error; this one gave up
#define EP_ERR_BAD_EXPERT_ID 4  // not fatal: a routing id < -1 or >= num_experts, dropped

// Phases: keep in sync with `deepep_kernels::error::Phase`.
#define EP_PHASE_LAYOUT 1
#define EP_PHASE_NOTIFY 2
#define EP_PHASE_DISPATCH_SEND 3
#define EP_PHASE_DISPATCH_RECV 4
#define EP_PHASE_CACHED_NOTIFY 5
#define EP_PHASE_COMBINE_PREP 6
#define EP_PHASE_COMBINE_SEND 7
#define EP_PHASE_COMBINE_RECV 8
#define EP_PHASE_BARRIER 9
#define EP_PHASE_LL_DISPATCH_SEND 10
#define EP_PHASE_LL_DISPATCH_RECV 11
#define EP_PHASE_LL_COMBINE_SEND 12
#define EP_PHASE_LL_COMBINE_RECV 13
#define EP_PHASE_INTERNODE_NOTIFY 14
#define EP_PHASE_INTERNODE_DISPATCH 15
#define EP_PHASE_INTERNODE_FORWARD 16
#define EP_PHASE_INTERNODE_COMBINE 17
#define EP_PHASE_ELASTIC_PLAN 18
#define EP_PHASE_ELASTIC_DISPATCH_SEND 19
#define EP_PHASE_ELASTIC_DISPATCH_RECV 20
#define EP_PHASE_ELASTIC_COMBINE_SEND 21
#define EP_PHASE_ELASTIC_COMBINE_RECV 22
#define EP_PHASE_ELASTIC_BARRIER 23

__device__ __forceinline__ uint64_t ep_globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Has any block (of any kernel on this rank) already recorded a FATAL error (codes 1..3)? A
// dropped bad expert id (code 4) or a record still being written (-1) does not count: a kernel
// that found a bad id keeps running its protocol, so its peers never stall because of it.
__device__ __forceinline__ bool ep_aborted(const EpDiag& d) {
    const int32_t c = *reinterpret_cast<volatile int32_t*>(&d.err->code);
    return static_cast<uint32_t>(c - EP_ERR_TIMEOUT) <= static_cast<uint32_t>(EP_ERR_ABORTED - EP_ERR_TIMEOUT);
}

// The body of ep_record_error (inlined into the two non-inlined recorders, so neither calls the
// other: a nested call made the NVSHMEM builds spill). Device-scope atomics on the host-mapped
// record, as before: only this rank's kernels write it; the host reads `code` first.
__device__ __forceinline__ void ep_record_error_body(const EpDiag& d, int32_t code, int32_t phase, int32_t channel,
                                                     int32_t peer, int32_t detail, uint64_t waited_ns) {
    int32_t* c = reinterpret_cast<int32_t*>(&d.err->code);
    bool won = atomicCAS(c, 0, -1) == 0;
    if (!won && code != EP_ERR_BAD_EXPERT_ID)
        won = atomicCAS(c, EP_ERR_BAD_EXPERT_ID, -1) == EP_ERR_BAD_EXPERT_ID;
    if (won) {
        d.err->rank = d.rank;
        d.err->phase = phase;
        d.err->channel = channel;
        d.err->peer = peer;
        d.err->detail = detail;
        d.err->waited_ns = waited_ns;
        __threadfence_system();
        *reinterpret_cast<volatile int32_t*>(c) = code;
        __threadfence_system();
        if ((d.flags & EP_DIAG_TRAP) && code != EP_ERR_BAD_EXPERT_ID) __trap();
    }
}

// Record an error once (first writer wins; a fatal error also replaces a bad-expert-id record)
// and make it visible to the host. Not inlined: the error path stays out of the hot loops'
// register allocation (inlined, with the trap, it made the intranode combine spill).
static __device__ __noinline__ void ep_record_error(const EpDiag& d, int32_t code, int32_t phase,
                                                int32_t channel, int32_t peer, int32_t detail,
                                                uint64_t waited_ns) {
    ep_record_error_body(d, code, phase, channel, peer, detail, waited_ns);
}

// ---- bad expert ids ----------------------------------------------------------------------------
// THE packing of a bad id's position and value into `EpErrorRecord::bad_key` (mirrored, and
// tested, by `deepep_kernels::error::bad_key`):
//     key = ((0xFFFFFFFF - min(pos, 0xFFFFFFFE)) << 32) | (uint32_t)clamp(value, INT32_MIN, INT32_MAX)
// `pos` is the flat position in topk_idx (token * num_topk + slot). Every thread that finds a bad
// id does an atomicMax of its key, so the SMALLEST position wins whatever the race (ties are the
// same element, same value); the key is never 0 (the position part is at least 1).
__device__ __forceinline__ uint64_t ep_bad_key(uint64_t pos, int64_t value) {
    const uint64_t p = pos < 0xFFFFFFFEull ? pos : 0xFFFFFFFEull;
    const int64_t lo = -2147483648ll, hi = 2147483647ll;
    const int64_t v = value < lo ? lo : (value > hi ? hi : value);
    return ((0xFFFFFFFFull - p) << 32) | static_cast<uint32_t>(static_cast<int32_t>(v));
}

// Is `e` an id that points nowhere (neither -1 nor in [0, num_experts))? One compare: e + 1
// as unsigned is in [0, num_experts] exactly for the valid ids.
__device__ __forceinline__ bool ep_bad_expert(int64_t e, int num_experts) {
    return static_cast<uint64_t>(e + 1) > static_cast<uint64_t>(num_experts);
}

// A bad routing id at flat position `pos` of topk_idx ([*, num_topk]): keep the smallest position
// in `bad_key` (atomicMax, before the record's code is set, so the host never sees the code
// without a key), then record EP_ERR_BAD_EXPERT_ID once. The caller treats the id as -1 and
// carries on. Not inlined (error path).
static __device__ __noinline__ void ep_record_bad_expert(const EpDiag& d, int32_t phase, uint64_t pos, int64_t value,
                                                     int32_t num_topk, int32_t num_experts) {
    atomicMax(reinterpret_cast<unsigned long long*>(&d.err->bad_key),
              static_cast<unsigned long long>(ep_bad_key(pos, value)));
    __threadfence_system();
    if (*reinterpret_cast<volatile int32_t*>(&d.err->code) != EP_ERR_NONE) return;  // already recorded
    ep_record_error_body(d, EP_ERR_BAD_EXPERT_ID, phase, -1, num_experts, num_topk, 0);
}

// A bounded spin. Usage:
//   EpWait w(diag);
//   while (!condition) { if (!w.tick(EP_PHASE_X, channel, peer)) return; }
// `tick` returns false once the bound is exceeded (error recorded) or another block aborted.
struct EpWait {
    uint64_t start;
    uint32_t iters;
    const EpDiag& d;
    __device__ __forceinline__ explicit EpWait(const EpDiag& diag) : start(0), iters(0), d(diag) {}
    __device__ __forceinline__ bool tick(int32_t phase, int32_t channel, int32_t peer,
                                         int32_t detail = 0) {
        // Read the clock only every 64 polls; check the (host-mapped) abort flag every 4096.
        if ((++iters & 63u) != 0u) return true;
        uint64_t now = ep_globaltimer();
        if (start == 0) { start = now; return true; }
        if ((iters & 4095u) == 0u && ep_aborted(d)) return false;
        if (now - start > d.timeout_ns) {
            ep_record_error(d, EP_ERR_TIMEOUT, phase, channel, peer, detail, now - start);
            return false;
        }
        return true;
    }
};

// ---- explicit memory ordering -------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v; asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v; asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
    uint64_t v; asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
    int v; asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int ld_volatile(const int* p) {
    int v; asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int atomic_add_release_sys(int* p, int v) {
    int old; asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory"); return old;
}
__device__ __forceinline__ int atomic_add_relaxed_sys(int* p, int v) {
    int old; asm volatile("atom.add.relaxed.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory"); return old;
}
// 16-byte bulk data: streaming store that does not allocate in L1, plain 16-byte load.
__device__ __forceinline__ void st_na_v4(int4* p, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ int4 ld_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// Read data another GPU wrote (after an acquire on its flag): bypass L1 (volatile).
__device__ __forceinline__ int4 ld_volatile_v4(const int4* p) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// Read-only input that nobody writes during the kernel (our own x): non-coherent path.
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---- more explicit-ordering accesses (intranode and elastic) --------------------------------
// Epoch comparison that survives wrap-around: has `seen` reached `want`?
__device__ __forceinline__ bool ep_epoch_reached(uint32_t seen, uint32_t want) {
    return static_cast<int32_t>(seen - want) >= 0;
}
__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
    uint64_t v; asm volatile("ld.volatile.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_na_f32(float* p, float v) {
    asm volatile("st.global.L1::no_allocate.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void st_na_s32(int* p, int v) {
    asm volatile("st.global.L1::no_allocate.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_na_s64(int64_t* p, int64_t v) {
    asm volatile("st.global.L1::no_allocate.s64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ float ld_volatile_f32(const float* p) {
    float v; asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory"); return v;
}

// ---- bf16 rows in 16-byte words (intranode and elastic combine) --------------------------------
// Add the eight bf16 values of `v` to `acc` in float32.
__device__ __forceinline__ void ep_accumulate_bf16x8(float (&acc)[8], const int4& v) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                           static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += __uint_as_float(w[i] << 16);
        acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
}

// Round eight float32 sums to bf16, to nearest even (as torch's `.to(torch.bfloat16)`).
__device__ __forceinline__ int4 ep_pack_bf16x8(const float (&acc)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);  // .x = low half
        w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                     static_cast<int>(w[3]));
}
