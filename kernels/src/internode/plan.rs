//! Pure (GPU-free) part of the internode mode: limits, the configuration and its validation,
//! the byte layout of the symmetric buffer and of a dispatch handle, and the `#[repr(C)]` mirror
//! of the kernels' parameter block (`cuda/nvshmem/internode.cuh`). Everything here is checked by
//! CPU tests (`kernels/tests/internode.rs`).
//!
//! Topology: `world` ranks form `num_hosts = world / ranks_per_host` hosts; rank
//! `r = host * ranks_per_host + local`. A token goes once per destination host to the rank of
//! that host with the sender's local index (NVSHMEM put with signal), and the destination GPUs
//! of the host pull it from there over NVLink.

use crate::error::{EpError, Result};
use crate::tensor::DType;
use crate::validate;

/// Mirrors of the limits in `internode.cuh` (shared-memory tables and mask widths).
pub const MAX_RANKS: usize = 256;
pub const MAX_HOSTS: usize = 32;
pub const MAX_RANKS_PER_HOST: usize = 8;
pub const MAX_CHANNELS: usize = 32;
/// `world * channels` bound (notify's shared-memory count table).
pub const MAX_RANKS_X_CHANNELS: usize = 4096;
pub const MAX_EXPERTS: usize = 4096;
pub const MAX_TOPK: usize = 32;
/// Threads per block of the dispatch / combine kernels (`EP_INTERNODE_THREADS`).
pub const THREADS: u32 = 512;
/// Threads of the notify kernel (one block).
pub const NOTIFY_THREADS: u32 = 1024;
/// Threads of the barrier kernel (one block).
pub const BARRIER_THREADS: u32 = 256;

fn bad<T>(msg: String) -> Result<T> {
    Err(EpError::InvalidArgument(msg))
}

use crate::common::align_up as align;

/// Row types the internode dispatch moves: `Bf16`, or `Fp8E4m3` with f32 scales `[N, H/128]`.
pub fn elem_bytes(dtype: DType) -> usize {
    dtype.size()
}

/// Scale groups per row (`H/128` for FP8, 0 for BF16).
pub fn num_scales(dtype: DType, hidden: usize) -> usize {
    match dtype {
        DType::Fp8E4m3 => hidden / 128,
        _ => 0,
    }
}

/// Capacities of an [`super::InternodeBuffer`]; identical on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InternodeConfig {
    /// GPUs per host (DeepEP fixes 8). `ranks_per_host = 1` makes every token cross the
    /// inter-host path (NVSHMEM puts), which is how 2 GPUs of one machine test it.
    pub ranks_per_host: usize,
    /// SMs of the dispatch / combine kernels: `num_sms / 2` channels, each one sender (forwarder)
    /// block and one puller (receiver) block. Even, 2..=64.
    pub num_sms: usize,
    /// Largest token count any rank dispatches (slots per source-host region).
    /// At most `32768 · num_sms / 2`.
    pub max_tokens_per_rank: usize,
    /// Largest hidden size.
    pub hidden: usize,
    /// Largest top-k.
    pub max_topk: usize,
    /// Largest number of experts per rank.
    pub max_local_experts: usize,
    /// Write records straight into a remote host's region with NVLink stores when NVSHMEM
    /// reports it load/store-reachable (`nvshmem_ptr`), instead of staging them and issuing an
    /// NVSHMEM put. Only matters when "hosts" share an NVLink domain (e.g. several hosts
    /// emulated on one machine, or multi-node NVLink); across a network it has no effect. Off by
    /// default so that the inter-host path is always the NVSHMEM put.
    pub p2p_direct: bool,
    /// Largest number of rows a rank may receive and combine when `ranks_per_host > 1` (combine
    /// staging; no limit with one GPU per host). `None`: the worst case
    /// `world * max_tokens_per_rank`.
    pub max_recv_tokens: Option<usize>,
}

impl InternodeConfig {
    pub fn new(ranks_per_host: usize, max_tokens_per_rank: usize, hidden: usize) -> Self {
        InternodeConfig {
            ranks_per_host,
            num_sms: 24,
            max_tokens_per_rank,
            hidden,
            max_topk: 8,
            max_local_experts: 128,
            p2p_direct: false,
            max_recv_tokens: None,
        }
    }

    pub fn num_channels(&self) -> usize {
        self.num_sms / 2
    }

    pub fn recv_capacity(&self, world: usize) -> usize {
        self.max_recv_tokens
            .unwrap_or(world * self.max_tokens_per_rank)
    }

    /// Check the configuration for `world` ranks (and `device_sms` when known).
    pub fn validate(&self, world: usize, device_sms: Option<usize>) -> Result<()> {
        if world == 0 || world > MAX_RANKS {
            return bad(format!(
                "internode mode supports 1..={MAX_RANKS} ranks, got {world}; run fewer ranks"
            ));
        }
        validate::internode_ranks(world, self.ranks_per_host)?;
        if self.ranks_per_host > MAX_RANKS_PER_HOST {
            return bad(format!(
                "ranks_per_host {} exceeds {MAX_RANKS_PER_HOST} (destination GPUs of a host are an 8-bit mask, like DeepEP's NUM_MAX_NVL_PEERS); group at most 8 GPUs per host",
                self.ranks_per_host
            ));
        }
        let hosts = world / self.ranks_per_host;
        if hosts > MAX_HOSTS {
            return bad(format!(
                "{hosts} hosts ({world} ranks / ranks_per_host {}) exceed {MAX_HOSTS} (hosts are a 32-bit mask); raise ranks_per_host",
                self.ranks_per_host
            ));
        }
        if self.num_sms < 2 || self.num_sms % 2 != 0 || self.num_sms > 2 * MAX_CHANNELS {
            return bad(format!(
                "internode num_sms {} must be even and within 2..={} (num_sms/2 channels, each a sender and a receiver block); DeepEP's default is 24",
                self.num_sms,
                2 * MAX_CHANNELS
            ));
        }
        if let Some(m) = device_sms {
            if self.num_sms > m {
                return bad(format!(
                    "internode num_sms {} exceeds the {m} SMs this rank may use (the GPU's, or its share when several ranks share it); use at most {m}",
                    self.num_sms
                ));
            }
        }
        if world * self.num_channels() > MAX_RANKS_X_CHANNELS {
            return bad(format!(
                "{world} ranks x {} channels exceed the notify table of {MAX_RANKS_X_CHANNELS}; lower num_sms to at most {}",
                self.num_channels(),
                2 * (MAX_RANKS_X_CHANNELS / world)
            ));
        }
        if self.max_tokens_per_rank == 0 || self.max_tokens_per_rank > (1 << 24) {
            return bad(format!(
                "max_tokens_per_rank {} must be within 1..=16777216; set it to the largest token count any rank dispatches",
                self.max_tokens_per_rank
            ));
        }
        // Records of one (host, channel) chunk are published in at most 64 rounds of at most
        // THREADS records (`round_size` in internode.cu).
        let per_channel = self.max_tokens_per_rank.div_ceil(self.num_channels());
        if per_channel > 64 * THREADS as usize {
            return bad(format!(
                "max_tokens_per_rank {} over {} channels gives {per_channel} tokens per channel, more than {}; raise num_sms to at least {}",
                self.max_tokens_per_rank,
                self.num_channels(),
                64 * THREADS,
                2 * self.max_tokens_per_rank.div_ceil(64 * THREADS as usize)
            ));
        }
        validate::hidden(self.hidden, 1)?;
        if self.hidden % 128 != 0 {
            return bad(format!(
                "internode hidden {} must be a multiple of 128 (FP8 scale groups and 16-byte rows); pad the hidden dimension",
                self.hidden
            ));
        }
        if self.max_topk == 0 || self.max_topk > MAX_TOPK {
            return bad(format!(
                "max_topk {} must be within 1..={MAX_TOPK}",
                self.max_topk
            ));
        }
        if self.max_local_experts == 0 || self.max_local_experts > MAX_EXPERTS {
            return bad(format!(
                "max_local_experts {} is out of range; use 1..={MAX_EXPERTS} (experts per rank of the largest model)",
                self.max_local_experts
            ));
        }
        let cap = self.recv_capacity(world);
        if cap == 0 || cap > i32::MAX as usize {
            return bad(format!(
                "max_recv_tokens {cap} must be within 1..={}",
                i32::MAX
            ));
        }
        Ok(())
    }
}

/// Bytes of one record slot: the largest of a BF16 dispatch record, an FP8 dispatch record and
/// a combine record for `hidden` and `topk` (same formulas as `RecLayout` in `internode.cu`).
pub fn record_stride(hidden: usize, topk: usize) -> usize {
    let meta = align(16 + 8 * topk, 16);
    let bf16 = meta + hidden * 2;
    let fp8 = meta + align(4 * (hidden / 128), 16) + hidden;
    let comb = align(4 * topk, 16) + hidden * 2;
    align(bf16.max(fp8).max(comb), 16)
}

/// Bytes of one dispatch record actually used for a call.
pub fn record_bytes(hidden: usize, topk: usize, dtype: DType) -> usize {
    align(16 + 8 * topk, 16) + align(4 * num_scales(dtype, hidden), 16) + hidden * dtype.size()
}

/// Ints of one notify message (per source, destination pair).
pub fn meta_stride(num_channels: usize, max_local_experts: usize) -> usize {
    align(2 * num_channels + max_local_experts, 4)
}

/// Byte offsets inside the symmetric buffer (identical on every rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SymLayout {
    pub world: usize,
    pub ranks_per_host: usize,
    pub num_hosts: usize,
    pub num_channels: usize,
    pub max_tokens: usize,
    pub max_recv: usize,
    pub hidden: usize,
    pub max_topk: usize,
    pub rec_stride: usize,
    pub meta_stride: usize,
    /// [`InternodeConfig::p2p_direct`].
    pub p2p_direct: bool,
    pub bar_sig: usize,
    pub meta_sig: usize,
    pub fwd_sig: usize,
    pub disp_sig: usize,
    pub comb_sig: usize,
    /// End of the signal area (zeroed once at allocation).
    pub signals_end: usize,
    pub meta_send: usize,
    pub meta_recv: usize,
    pub fmeta_send: usize,
    pub fmeta_recv: usize,
    pub rdma_send: usize,
    pub rdma_recv: usize,
    pub comb_in: usize,
    pub comb_in_half: usize,
    pub comb_w: usize,
    /// Floats of one `comb_w` half.
    pub comb_w_half: usize,
    pub total: usize,
}

impl SymLayout {
    pub fn new(cfg: &InternodeConfig, world: usize) -> Result<SymLayout> {
        cfg.validate(world, None)?;
        let p = cfg.ranks_per_host;
        let nh = world / p;
        let c = cfg.num_channels();
        let rec_stride = record_stride(cfg.hidden, cfg.max_topk);
        let ms = meta_stride(c, cfg.max_local_experts);
        let max_recv = cfg.recv_capacity(world);
        let mut off = 0usize;
        let mut take = |bytes: usize| {
            let at = off;
            off = align(off + bytes, 128);
            at
        };
        let bar_sig = take(8 * world);
        let meta_sig = take(8 * world);
        let fwd_sig = take(8 * p);
        // Data signals are double-buffered by call parity (see `InternodeArgs::with_seq`).
        let disp_sig = take(2 * 8 * nh * c);
        let comb_sig = take(2 * 8 * nh * c);
        let signals_end = take(0);
        let meta_send = take(4 * world * ms);
        let meta_recv = take(4 * world * ms);
        let fmeta_send = take(4 * p * nh * c);
        let fmeta_recv = take(4 * p * nh * c);
        let region = nh
            .checked_mul(cfg.max_tokens_per_rank)
            .and_then(|v| v.checked_mul(rec_stride))
            .ok_or_else(|| EpError::InvalidArgument("internode buffer size overflows".into()))?;
        let rdma_send = take(region);
        let rdma_recv = take(region);
        // Combine staging: only read by the other GPUs of a host (a rank's own forwarder reads
        // its combine input directly), so none with one GPU per host.
        let staged_rows = if p > 1 { max_recv } else { 0 };
        let comb_in_half = align(staged_rows * cfg.hidden * 2, 128);
        let comb_in = take(2 * comb_in_half);
        let comb_w_half = align(staged_rows * cfg.max_topk, 32);
        let comb_w = take(2 * comb_w_half * 4);
        let total = take(0);
        Ok(SymLayout {
            world,
            ranks_per_host: p,
            num_hosts: nh,
            num_channels: c,
            max_tokens: cfg.max_tokens_per_rank,
            max_recv,
            hidden: cfg.hidden,
            max_topk: cfg.max_topk,
            rec_stride,
            meta_stride: ms,
            p2p_direct: cfg.p2p_direct,
            bar_sig,
            meta_sig,
            fwd_sig,
            disp_sig,
            comb_sig,
            signals_end,
            meta_send,
            meta_recv,
            fmeta_send,
            fmeta_recv,
            rdma_send,
            rdma_recv,
            comb_in,
            comb_in_half,
            comb_w,
            comb_w_half,
            total,
        })
    }

    /// Named `(offset, bytes)` ranges, for overlap checks and logs.
    pub fn ranges(&self) -> Vec<(&'static str, usize, usize)> {
        let (w, p, nh, c) = (
            self.world,
            self.ranks_per_host,
            self.num_hosts,
            self.num_channels,
        );
        let region = nh * self.max_tokens * self.rec_stride;
        vec![
            ("bar_sig", self.bar_sig, 8 * w),
            ("meta_sig", self.meta_sig, 8 * w),
            ("fwd_sig", self.fwd_sig, 8 * p),
            ("disp_sig", self.disp_sig, 2 * 8 * nh * c),
            ("comb_sig", self.comb_sig, 2 * 8 * nh * c),
            ("meta_send", self.meta_send, 4 * w * self.meta_stride),
            ("meta_recv", self.meta_recv, 4 * w * self.meta_stride),
            ("fmeta_send", self.fmeta_send, 4 * p * nh * c),
            ("fmeta_recv", self.fmeta_recv, 4 * p * nh * c),
            ("rdma_send", self.rdma_send, region),
            ("rdma_recv", self.rdma_recv, region),
            ("comb_in", self.comb_in, 2 * self.comb_in_half),
            ("comb_w", self.comb_w, 8 * self.comb_w_half),
        ]
    }
}

/// Byte offsets inside one dispatch handle's device allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandleLayout {
    pub send_slot: usize,
    pub send_lmask: usize,
    pub send_off: usize,
    pub recv_off: usize,
    /// End of `recv_off`'s `[world][C+1]` i32 entries (the next array starts 128-byte aligned
    /// after it, so `rdma_off` is not the end).
    pub recv_off_end: usize,
    pub rdma_off: usize,
    pub fwd_base: usize,
    pub fwd_mask: usize,
    pub total: usize,
}

impl HandleLayout {
    pub fn new(sym: &SymLayout, num_tokens: usize) -> HandleLayout {
        let (w, p, nh, c) = (
            sym.world,
            sym.ranks_per_host,
            sym.num_hosts,
            sym.num_channels,
        );
        let mut off = 0usize;
        let mut take = |bytes: usize| {
            let at = off;
            off = align(off + bytes.max(1), 128);
            at
        };
        let send_slot = take(4 * num_tokens * nh);
        let send_lmask = take(num_tokens * nh);
        let send_off = take(4 * nh * (c + 1));
        let recv_off = take(4 * w * (c + 1));
        let recv_off_end = recv_off + 4 * w * (c + 1);
        let rdma_off = take(4 * w * (c + 1));
        let fwd_base = take(4 * nh * c * p);
        let fwd_mask = take(nh * sym.max_tokens);
        let total = take(0);
        HandleLayout {
            send_slot,
            send_lmask,
            send_off,
            recv_off,
            recv_off_end,
            rdma_off,
            fwd_base,
            fwd_mask,
            total,
        }
    }
}

/// Per-call checks of a dispatch against the buffer (before any launch).
pub fn check_dispatch(
    sym: &SymLayout,
    num_tokens: usize,
    hidden: usize,
    topk: usize,
    num_experts: usize,
    dtype: DType,
    max_local_experts: usize,
) -> Result<()> {
    if num_tokens > sym.max_tokens {
        return bad(format!(
            "internode dispatch of {num_tokens} tokens exceeds the buffer's max_tokens_per_rank {}; create the InternodeBuffer with max_tokens_per_rank >= {num_tokens}",
            sym.max_tokens
        ));
    }
    if hidden > sym.hidden || hidden % 128 != 0 || hidden == 0 {
        return bad(format!(
            "internode dispatch with hidden {hidden}, but the buffer takes positive multiples of 128 up to {}; create the buffer with hidden >= {hidden} (and pad rows to a multiple of 128)",
            sym.hidden
        ));
    }
    validate::num_topk(topk, sym.max_topk.min(MAX_TOPK))?;
    validate::experts(num_experts, sym.world)?;
    if num_experts > MAX_EXPERTS {
        return bad(format!(
            "{num_experts} experts exceed the internode limit of {MAX_EXPERTS}; use fewer experts"
        ));
    }
    let local = num_experts / sym.world;
    if local > max_local_experts {
        return bad(format!(
            "{local} experts per rank exceed the buffer's max_local_experts {max_local_experts}; create the buffer with max_local_experts >= {local}"
        ));
    }
    if !matches!(dtype, DType::Bf16 | DType::Fp8E4m3) {
        return bad(format!(
            "internode dispatch moves bf16 or fp8-e4m3 rows, got {}; convert x first",
            dtype.name()
        ));
    }
    validate::hidden(hidden, dtype.size())?;
    if record_bytes(hidden, topk, dtype) > sym.rec_stride {
        return bad(format!(
            "a record of hidden {hidden} / top-k {topk} needs {} B but the buffer's slot has {} B; create the buffer with max_topk >= {topk}",
            record_bytes(hidden, topk, dtype),
            sym.rec_stride
        ));
    }
    Ok(())
}

/// Mirror of `InternodeArgs` (`cuda/nvshmem/internode.cuh`). Pointers are device addresses.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InternodeArgs {
    pub rank: i32,
    pub world: i32,
    pub ranks_per_host: i32,
    pub num_hosts: i32,
    pub my_host: i32,
    pub my_local: i32,
    pub num_channels: i32,
    pub num_experts: i32,
    pub num_tokens: i32,
    pub hidden: i32,
    pub topk: i32,
    pub elem_bytes: i32,
    pub num_scales: i32,
    pub max_tokens: i32,
    pub max_recv: i32,
    pub rec_stride: i32,
    pub meta_stride: i32,
    pub expert_alignment: i32,
    pub num_recv: i32,
    pub comb_parity: i32,
    pub p2p_direct: i32,
    pub pad0_: i32,
    pub seq: u64,
    pub bar_sig: u64,
    pub meta_sig: u64,
    pub fwd_sig: u64,
    pub disp_sig: u64,
    pub comb_sig: u64,
    pub meta_send: u64,
    pub meta_recv: u64,
    pub fmeta_send: u64,
    pub fmeta_recv: u64,
    pub rdma_send: u64,
    pub rdma_recv: u64,
    pub comb_in: u64,
    pub comb_w: u64,
    pub comb_in_half: i64,
    pub comb_w_half: i64,
    pub send_slot: u64,
    pub send_lmask: u64,
    pub send_off: u64,
    pub recv_off: u64,
    pub rdma_off: u64,
    pub fwd_base: u64,
    pub fwd_mask: u64,
    pub host_counters: u64,
    pub x: u64,
    pub x_scales: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub recv_x: u64,
    pub recv_scales: u64,
    pub recv_topk_idx: u64,
    pub recv_topk_weights: u64,
    pub recv_src_idx: u64,
    pub comb_bias0: u64,
    pub comb_bias1: u64,
    pub combined_x: u64,
    pub combined_w: u64,
    pub comb_y: u64,
    pub comb_yw: u64,
}

/// `sizeof(InternodeArgs)` asserted by `internode.cuh`.
pub const ARGS_SIZE: usize = 400;
const _: () = assert!(std::mem::size_of::<InternodeArgs>() == ARGS_SIZE);

impl InternodeArgs {
    /// Topology and symmetric-buffer fields; per-call fields are filled by the caller.
    pub fn base(sym: &SymLayout, rank: usize, sym_base: u64) -> InternodeArgs {
        let at = |off: usize| sym_base + off as u64;
        InternodeArgs {
            rank: rank as i32,
            world: sym.world as i32,
            ranks_per_host: sym.ranks_per_host as i32,
            num_hosts: sym.num_hosts as i32,
            my_host: (rank / sym.ranks_per_host) as i32,
            my_local: (rank % sym.ranks_per_host) as i32,
            num_channels: sym.num_channels as i32,
            hidden: sym.hidden as i32,
            max_tokens: sym.max_tokens as i32,
            max_recv: sym.max_recv as i32,
            rec_stride: sym.rec_stride as i32,
            meta_stride: sym.meta_stride as i32,
            expert_alignment: 1,
            bar_sig: at(sym.bar_sig),
            meta_sig: at(sym.meta_sig),
            fwd_sig: at(sym.fwd_sig),
            disp_sig: at(sym.disp_sig),
            comb_sig: at(sym.comb_sig),
            meta_send: at(sym.meta_send),
            meta_recv: at(sym.meta_recv),
            fmeta_send: at(sym.fmeta_send),
            fmeta_recv: at(sym.fmeta_recv),
            rdma_send: at(sym.rdma_send),
            rdma_recv: at(sym.rdma_recv),
            comb_in: at(sym.comb_in),
            comb_w: at(sym.comb_w),
            comb_in_half: sym.comb_in_half as i64,
            comb_w_half: sym.comb_w_half as i64,
            p2p_direct: sym.p2p_direct as i32,
            ..Default::default()
        }
    }

    /// Set the call's sequence number and select the data-signal half of its parity. A rank
    /// zeroes the half of the current call when it enters the call's barrier; a peer that is
    /// still finishing the previous call polls the other half, and every peer has finished the
    /// call before that (it passed the previous barrier), so nobody still waits on the half
    /// being zeroed.
    pub fn with_seq(mut self, sym: &SymLayout, seq: u64) -> InternodeArgs {
        let half = ((seq & 1) as usize * 8 * sym.num_hosts * sym.num_channels) as u64;
        self.seq = seq;
        self.disp_sig += half;
        self.comb_sig += half;
        self
    }

    /// Point the handle fields at a handle allocation.
    pub fn with_handle(mut self, h: &HandleLayout, handle_base: u64) -> InternodeArgs {
        let at = |off: usize| handle_base + off as u64;
        self.send_slot = at(h.send_slot);
        self.send_lmask = at(h.send_lmask);
        self.send_off = at(h.send_off);
        self.recv_off = at(h.recv_off);
        self.rdma_off = at(h.rdma_off);
        self.fwd_base = at(h.fwd_base);
        self.fwd_mask = at(h.fwd_mask);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_stride_covers_every_record_kind() {
        for &(h, k) in &[
            (2048usize, 1usize),
            (4096, 6),
            (7168, 8),
            (7168, 32),
            (128, 1),
        ] {
            let s = record_stride(h, k);
            assert_eq!(s % 16, 0);
            assert!(s >= record_bytes(h, k, DType::Bf16));
            assert!(s >= record_bytes(h, k, DType::Fp8E4m3));
            assert!(s >= ((4 * k).div_ceil(16) * 16) + 2 * h);
        }
        // 7168 bf16, top-8: 16 B header + 64 B top-k, then the row.
        assert_eq!(record_bytes(7168, 8, DType::Bf16), 80 + 14336);
        assert_eq!(record_bytes(7168, 8, DType::Fp8E4m3), 80 + 224 + 7168);
    }
}
