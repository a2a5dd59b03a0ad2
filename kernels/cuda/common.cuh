// Shared device-side helpers for every deepep-kernels cubin.
//
// Contents: the diagnostic record that turns a stuck wait into a host error (rank, phase,
// channel, peer), explicit-ordering PTX loads/stores, and the global nanosecond timer.
// Every kernel takes an `EpDiag` by value as its LAST argument.
#pragma once
#include <stdint.h>

// ---- diagnostics -------------------------------------------------------------------------
// Layout mirrored by `deepep_kernels::error::ErrorRecord` (32 bytes). Lives in host-mapped
// pinned memory; all zero means "no error".
struct EpErrorRecord {
    int32_t code;      // EP_ERR_*
    int32_t rank;      // rank that detected the problem
    int32_t phase;     // EP_PHASE_*
    int32_t channel;   // channel / block index, -1 if not applicable
    int32_t peer;      // rank being waited for, -1 if not applicable
    int32_t detail;    // free-form (e.g. expected count)
    uint64_t waited_ns;
};

// Passed by value (24 bytes) as the last kernel argument.
struct EpDiag {
    EpErrorRecord* err;     // device pointer of the host-mapped record (never null)
    uint64_t timeout_ns;    // bound for any single wait
    int32_t rank;
    int32_t flags;          // EP_DIAG_* bits
};

// After recording an error, abort the kernel with `trap` (a sticky CUDA error of this context),
// so that no later CUDA call of the process, e.g. a PyTorch read of an output this kernel did not
// finish, can succeed. Set by the Python binding (its users read outputs through torch, which
// never looks at the record); the Rust API checks the record on every read instead.
#define EP_DIAG_TRAP 1

#define EP_ERR_NONE 0
#define EP_ERR_TIMEOUT 1
#define EP_ERR_BAD_ARGUMENT 2
#define EP_ERR_ABORTED 3  // another block already recorded an error; this one gave up

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

__device__ __forceinline__ uint64_t ep_globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Has any block (of any kernel on this rank) already recorded an error?
__device__ __forceinline__ bool ep_aborted(const EpDiag& d) {
    return *reinterpret_cast<volatile int32_t*>(&d.err->code) != EP_ERR_NONE;
}

// Record an error once (first writer wins) and make it visible to the host. Not inlined: the
// error path stays out of the hot loops' register allocation (inlined, with the trap, it made
// the intranode combine spill).
static __device__ __noinline__ void ep_record_error(const EpDiag& d, int32_t code, int32_t phase,
                                                int32_t channel, int32_t peer, int32_t detail,
                                                uint64_t waited_ns) {
    if (atomicCAS(reinterpret_cast<int32_t*>(&d.err->code), 0, -1) == 0) {
        d.err->rank = d.rank;
        d.err->phase = phase;
        d.err->channel = channel;
        d.err->peer = peer;
        d.err->detail = detail;
        d.err->waited_ns = waited_ns;
        __threadfence_system();
        *reinterpret_cast<volatile int32_t*>(&d.err->code) = code;
        __threadfence_system();
        if (d.flags & EP_DIAG_TRAP) __trap();
    }
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
