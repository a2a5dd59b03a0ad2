// Small kernels of the runtime itself: buffer fill (poisoning), copy, and the cross-GPU
// put/signal/wait pair that exercises IPC pointers, release/acquire flags and the EpWait timeout
// path. Used by `runtime`, `gpu_test` (selftest cases) and the bench framework.
#include "common.cuh"

// dst[i] = value for i < n (32-bit words). Grid-stride.
extern "C" __global__ void ep_fill_u32(uint32_t* dst, uint64_t n, uint32_t value, EpDiag diag) {
    (void)diag;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = value;
}

// dst[i] = src[i] for i < n16 (16-byte units). Grid-stride; dst may be a peer (IPC) pointer.
extern "C" __global__ void ep_copy_16(const int4* src, int4* dst, uint64_t n16, EpDiag diag) {
    (void)diag;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n16; i += (uint64_t)gridDim.x * blockDim.x)
        st_na_v4(dst + i, ld_nc_v4(src + i));
}

// The deterministic word a sender writes at index i (mirrored on the host by
// `gpu_test::selftest_pattern`).
__device__ __forceinline__ uint32_t ep_pattern(uint32_t seed, uint32_t sender, uint64_t i) {
    uint64_t x = ((uint64_t)seed << 32) ^ ((uint64_t)sender * 0x9E3779B97F4A7C15ull) ^ (i * 0xBF58476D1CE4E5B9ull);
    x ^= x >> 31; x *= 0x94D049BB133111EBull; x ^= x >> 29;
    return (uint32_t)x;
}

// dst[i] = ep_pattern(seed, sender, i), i < n. dst may be a peer (IPC) pointer.
extern "C" __global__ void ep_selftest_pattern(uint32_t* dst, uint64_t n, uint32_t seed, int32_t sender, EpDiag diag) {
    (void)diag;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = ep_pattern(seed, (uint32_t)sender, i);
}

// One block: copy n16 x 16 B from src to the peer's buffer dst, then publish `value` in the peer's
// flag with a system-scope release.
extern "C" __global__ void __launch_bounds__(1024, 1)
ep_selftest_put_signal(const int4* src, int4* dst, uint64_t n16, int* flag, int value, EpDiag diag) {
    (void)diag;
    for (uint64_t i = threadIdx.x; i < n16; i += blockDim.x) st_na_v4(dst + i, ld_nc_v4(src + i));
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) st_release_sys(flag, value);
}

// One block: wait (bounded, EpWait) until *flag == expected, then copy n16 x 16 B from src (written
// by the peer) to dst. On timeout the error record names (rank, phase, channel = blockIdx.x, peer)
// and the kernel returns without copying.
extern "C" __global__ void __launch_bounds__(1024, 1)
ep_selftest_wait_copy(const int* flag, int expected, const int4* src, int4* dst, uint64_t n16,
                      int32_t phase, int32_t peer, EpDiag diag) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        EpWait w(diag);
        int good = 1;
        while (ld_acquire_sys(flag) != expected) {
            if (!w.tick(phase, (int32_t)blockIdx.x, peer, expected)) { good = 0; break; }
        }
        ok = good;
    }
    __syncthreads();
    if (!ok) return;
    for (uint64_t i = threadIdx.x; i < n16; i += blockDim.x) dst[i] = ld_volatile_v4(src + i);
}

// Busy-wait `ns` nanoseconds on the global timer (one thread per block does the timing); used to
// check the event-timing path against a known duration.
extern "C" __global__ void ep_selftest_spin(uint64_t ns, EpDiag diag) {
    (void)diag;
    uint64_t t0 = ep_globaltimer();
    while (ep_globaltimer() - t0 < ns) {}
}
