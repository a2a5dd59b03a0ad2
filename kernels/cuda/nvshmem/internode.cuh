// Internode (two-hop) dispatch/combine: parameter block shared by every kernel of
// `internode.cu`, mirrored field by field by `deepep_kernels::internode::InternodeArgs`.
//
// Topology: `world` ranks grouped into `num_hosts` hosts of `ranks_per_host` GPUs;
// rank r = host * ranks_per_host + local. A token travels once per destination HOST, to the
// "forwarder" on that host with the sender's local index (NVSHMEM put + signal), and the
// destination GPUs of that host pull it over NVLink (`nvshmem_ptr`).
//
// Memory kinds behind the pointers:
//   [sym]    NVSHMEM symmetric heap (same offset on every PE),
//   [handle] ordinary device memory owned by the dispatch handle of THIS rank,
//   [host]   host-mapped pinned memory (CPU polls it after notify),
//   [user]   caller tensors.
#pragma once
#include <stdint.h>

#define EP_INTERNODE_MAX_RANKS 256          // rank masks / count tables
#define EP_INTERNODE_MAX_HOSTS 32           // host masks fit one u32
#define EP_INTERNODE_MAX_RANKS_PER_HOST 8   // local masks fit one u8
#define EP_INTERNODE_MAX_CHANNELS 32
#define EP_INTERNODE_MAX_RC 4096            // world * channels (notify shared-memory table)
#define EP_INTERNODE_MAX_EXPERTS 4096
#define EP_INTERNODE_MAX_TOPK 32

struct InternodeArgs {
    // ---- topology and shapes (identical on every rank except rank/my_host/my_local/num_tokens)
    int32_t rank, world, ranks_per_host, num_hosts;
    int32_t my_host, my_local, num_channels, num_experts;
    int32_t num_tokens;        // N: tokens of this rank (dispatch input / combine output rows)
    int32_t hidden;            // H
    int32_t topk;              // K
    int32_t elem_bytes;        // bytes per element of x / recv_x (2 = bf16, 1 = fp8 e4m3)
    int32_t num_scales;        // S = H/128 for FP8, 0 for BF16
    int32_t max_tokens;        // slots per source-host region (capacity of N on every rank)
    int32_t max_recv;          // rows of one combine staging half (capacity of M)
    int32_t rec_stride;        // bytes of one record slot in the RDMA regions (multiple of 16)
    int32_t meta_stride;       // ints per (src, dst) notify message
    int32_t expert_alignment;
    int32_t num_recv;          // M (dispatch, combine)
    int32_t comb_parity;       // which combine staging half this combine uses (0/1)
    int32_t p2p_direct;        // 1: write records straight into a remote host's region when it is
                               //    load/store-reachable (nvshmem_ptr), instead of staging + put
    int32_t pad0_;
    uint64_t seq;              // strictly increasing per collective call, same on every rank

    // ---- [sym] signals (u64, zeroed once at allocation; compared with >= seq)
    uint64_t* bar_sig;         // [world]          barrier arrival of each rank
    uint64_t* meta_sig;        // [world]          notify stage 1 message from each rank
    uint64_t* fwd_sig;         // [ranks_per_host] notify stage 2 message from each local peer
    uint64_t* disp_sig;        // [num_hosts][C]   dispatch chunk (source host, channel) landed here
    uint64_t* comb_sig;        // [num_hosts][C]   combine chunk (forwarder host, channel) landed here
    // ---- [sym] notify messages
    int32_t* meta_send;        // [world][meta_stride]
    int32_t* meta_recv;        // [world][meta_stride]
    int32_t* fmeta_send;       // [ranks_per_host][num_hosts*C]
    int32_t* fmeta_recv;       // [ranks_per_host][num_hosts*C]
    // ---- [sym] record regions: [num_hosts][max_tokens][rec_stride]
    uint8_t* rdma_send;        // staging of records bound for host h (index = destination host)
    uint8_t* rdma_recv;        // records that arrived from host h (index = source host)
    // ---- [sym] combine staging (double-buffered by comb_parity)
    uint8_t* comb_in;          // [2][max_recv][H] bf16 rows (copy of the combine input)
    float* comb_w;             // [2][max_recv][K]  (copy of the combine top-k weights)
    int64_t comb_in_half;      // bytes of one comb_in half
    int64_t comb_w_half;       // floats of one comb_w half

    // ---- [handle] (written by notify / dispatch, read by dispatch / combine)
    int32_t* send_slot;        // [N][num_hosts] slot of token t in host h's region, -1 if none
    uint8_t* send_lmask;       // [N][num_hosts] destination GPUs (local indices) of t on host h
    int32_t* send_off;         // [num_hosts][C+1] prefix of this rank's records per host over channels
    int32_t* recv_off;         // [world][C+1] output row offsets for (source, channel)
    int32_t* rdma_off;         // [world][C+1] record offsets of (source, channel) in the forwarder region
    int32_t* fwd_base;         // [num_hosts][C][ranks_per_host] output row base at each local peer
                               //   for chunk (source = (host, my_local), channel)
    uint8_t* fwd_mask;         // [num_hosts][max_tokens] local destination mask of each record
                               //   this rank forwards (written by dispatch, read by combine)
    // ---- [host] counters: [0] = seq (low 31 bits) when ready, [1] = M, [2 + e] = aligned count
    int32_t* host_counters;

    // ---- [user] tensors
    const uint8_t* x;          // [N][H] elem_bytes
    const float* x_scales;     // [N][S] row-major (FP8 only)
    const int64_t* topk_idx;   // [N][K]
    const float* topk_weights; // [N][K] (may be null in dispatch: weights 0)
    uint8_t* recv_x;           // [M][H]
    float* recv_scales;        // [M][S]
    int64_t* recv_topk_idx;    // [M][K] local expert ids, -1 elsewhere
    float* recv_topk_weights;  // [M][K]
    int32_t* recv_src_idx;     // [M]
    const uint16_t* comb_bias0;  // [N][H] bf16 or null
    const uint16_t* comb_bias1;  // [N][H] bf16 or null
    uint16_t* combined_x;      // [N][H] bf16
    float* combined_w;         // [N][K] or null (then comb_w is not read)
    const uint8_t* comb_y;     // [M][H] bf16 combine input of this rank (read directly for own rows)
    const float* comb_yw;      // [M][K] combine weights of this rank (null when combined_w is null)
};

// Keep in sync with the Rust mirror (asserted there too).
static_assert(sizeof(InternodeArgs) == 400, "InternodeArgs layout changed: update kernels/src/internode/plan.rs");
