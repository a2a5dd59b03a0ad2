//! Launch configuration of the intranode kernels and the size formula of their NVLink buffer.
//!
//! The buffer layout is the contract between the host and `cuda/intranode.cuh`: every rank
//! allocates the same [`BufferLayout`] (same rank count, token capacity and hidden capacity), so
//! a byte offset computed here is valid in every peer's buffer.

use crate::validate;
use crate::{EpError, Result};

/// Largest top-k the intranode kernels handle (one lane per top-k slot).
pub const MAX_TOPK: usize = validate::MAX_TOPK_NORMAL;
/// Largest number of local experts per rank (shared-memory table of the notify kernel).
pub const MAX_LOCAL_EXPERTS: usize = 1024;
/// Most threads per block the dispatch/combine kernels are compiled for (`__launch_bounds__`).
pub const MAX_WARPS_PER_BLOCK: usize = 24;
/// FP8 scale group (channels per f32 scale).
pub const FP8_GROUP: usize = 128;

/// How the dispatch and combine kernels are launched. Must be identical on every rank of a
/// collective call (like DeepEP's `Config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Thread blocks (one per SM) of the dispatch and combine kernels. Any value >= 1; unlike
    /// DeepEP it need not be even (there are no sender/receiver block pairs).
    pub num_sms: usize,
    /// Warps per dispatch block, 1..=24.
    pub dispatch_warps: usize,
    /// 0: every dispatch warp copies each unit to all its destinations. k > 0: k warps per block
    /// copy only to this rank and the other `dispatch_warps - k` only to the peers.
    pub dispatch_local_warps: usize,
    /// Experimental: peer copies of dispatch go through shared memory and bulk copies
    /// (`cp.async.bulk`, one per chunk and peer) instead of 16-byte stores. Off by default.
    pub dispatch_tma: bool,
    /// Warps per combine block, 2..=24.
    pub combine_warps: usize,
    /// Of the combine warps, how many push rows to their origin rank (the rest reduce);
    /// 1..combine_warps.
    pub combine_push_warps: usize,
    /// Rows a combine pusher writes per system-scope fence (then one flag per row), 1..=16.
    pub combine_push_rows: usize,
    /// Experimental: combine pushers copy through shared memory and bulk copies. Off by default.
    pub combine_tma: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            num_sms: 24,
            dispatch_warps: 24,
            dispatch_local_warps: 0,
            dispatch_tma: false,
            combine_warps: 24,
            combine_push_warps: 8,
            combine_push_rows: 1,
            combine_tma: false,
        }
    }
}

impl Config {
    /// A config with `num_sms` blocks and the default warp split.
    pub fn with_sms(num_sms: usize) -> Self {
        Config { num_sms, ..Config::default() }
    }

    /// Check the values; `device_sms` (the GPU's SM count, when known) bounds `num_sms`.
    pub fn validate(&self, device_sms: Option<usize>) -> Result<()> {
        if self.num_sms == 0 {
            return bad("config.num_sms is 0; use at least 1 (24 matches DeepEP's default test setting)".into());
        }
        if let Some(m) = device_sms {
            if self.num_sms > m {
                return bad(format!(
                    "config.num_sms {} exceeds the {m} SMs this rank may use (all of the GPU's, or its share when several ranks share \
                     the GPU); use at most {m}",
                    self.num_sms
                ));
            }
        }
        if self.dispatch_warps == 0 || self.dispatch_warps > MAX_WARPS_PER_BLOCK {
            return bad(format!(
                "config.dispatch_warps {} is outside 1..={MAX_WARPS_PER_BLOCK} (the kernels are compiled for at most {} threads per block); pick a value in that range",
                self.dispatch_warps,
                MAX_WARPS_PER_BLOCK * 32
            ));
        }
        if self.dispatch_local_warps >= self.dispatch_warps {
            return bad(format!(
                "config.dispatch_local_warps {} must be below dispatch_warps {} (some warps must copy to the peers); use 0 to let every warp copy everywhere",
                self.dispatch_local_warps, self.dispatch_warps
            ));
        }
        if self.combine_warps < 2 || self.combine_warps > MAX_WARPS_PER_BLOCK {
            return bad(format!(
                "config.combine_warps {} is outside 2..={MAX_WARPS_PER_BLOCK} (at least one pushing and one reducing warp); pick a value in that range",
                self.combine_warps
            ));
        }
        if self.combine_push_warps == 0 || self.combine_push_warps >= self.combine_warps {
            return bad(format!(
                "config.combine_push_warps {} must be in 1..{} (combine_warps {}): combine needs both pushing and reducing warps; e.g. use a third of combine_warps (the default is 8 of 24)",
                self.combine_push_warps, self.combine_warps, self.combine_warps
            ));
        }
        if self.combine_push_rows == 0 || self.combine_push_rows > 16 {
            return bad(format!(
                "config.combine_push_rows {} is outside 1..=16 (rows a combine pusher writes per system fence); use e.g. 1 (the default)",
                self.combine_push_rows
            ));
        }
        Ok(())
    }
}

/// DeepEP's `Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)` (csrc/config.hpp of
/// DeepEP v1.2.1): the SM count our kernels use plus DeepEP's four ring-buffer chunk sizes, which
/// our kernels (no ring buffers) keep only to check and report them. The Python `Config` is this
/// struct ([`DeepEpConfig::new`] checks it, naming the argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeepEpConfig {
    pub num_sms: usize,
    pub num_max_nvl_chunked_send_tokens: usize,
    pub num_max_nvl_chunked_recv_tokens: usize,
    pub num_max_rdma_chunked_send_tokens: usize,
    pub num_max_rdma_chunked_recv_tokens: usize,
}

impl DeepEpConfig {
    /// The names of the five values, in constructor order.
    pub const FIELDS: [&'static str; 5] = [
        "num_sms",
        "num_max_nvl_chunked_send_tokens",
        "num_max_nvl_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens",
        "num_max_rdma_chunked_recv_tokens",
    ];

    /// DeepEP's constructor checks, each naming the values: `num_sms >= 1` (DeepEP accepts 0 and
    /// fails at the first launch), `0 < nvl_send < nvl_recv`, `0 < rdma_send < rdma_recv` and
    /// `rdma_send <= rdma_recv / 2` (DeepEP's lazy head update rule).
    pub fn new(v: [i64; 5]) -> Result<DeepEpConfig> {
        let [sms, nvl_send, nvl_recv, rdma_send, rdma_recv] = v;
        if sms < 1 {
            return bad(format!("Config: num_sms={sms} must be >= 1 (the thread blocks of dispatch and combine)"));
        }
        if !(0 < nvl_send && nvl_send < nvl_recv) {
            return bad(format!(
                "Config: need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, got {nvl_send} and {nvl_recv}"
            ));
        }
        if !(0 < rdma_send && rdma_send < rdma_recv) {
            return bad(format!(
                "Config: need 0 < num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens, got {rdma_send} and {rdma_recv}"
            ));
        }
        if rdma_send > rdma_recv / 2 {
            return bad(format!(
                "Config: num_max_rdma_chunked_send_tokens must be <= num_max_rdma_chunked_recv_tokens / 2, got {rdma_send} and {rdma_recv}"
            ));
        }
        let u = |x: i64| x as usize; // all positive here
        Ok(DeepEpConfig {
            num_sms: u(sms),
            num_max_nvl_chunked_send_tokens: u(nvl_send),
            num_max_nvl_chunked_recv_tokens: u(nvl_recv),
            num_max_rdma_chunked_send_tokens: u(rdma_send),
            num_max_rdma_chunked_recv_tokens: u(rdma_recv),
        })
    }

    /// The five values in constructor order.
    pub fn values(&self) -> [usize; 5] {
        [
            self.num_sms,
            self.num_max_nvl_chunked_send_tokens,
            self.num_max_nvl_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens,
            self.num_max_rdma_chunked_recv_tokens,
        ]
    }
}

use crate::args::bad;

use crate::common::align_up as align;

/// Byte offsets of the regions of one rank's NVLink buffer (identical on every rank).
///
/// ```text
/// ctrl   ready[R] i32 | dispatch_rows[R] i32 | notify_rank[R][R] u64 | notify_expert[R][1024] u64
///        | stage_flag[R-1][max_tokens] i32
/// recv   recv_x[R*max_tokens][hidden*2 B] | recv_scales f32[R*max_tokens][hidden/128]
///        | recv_topk_idx i64[R*max_tokens][32] | recv_topk_w f32[R*max_tokens][32] | recv_src_idx i32[R*max_tokens]
/// stage  stage_x bf16[R-1][max_tokens][hidden] | stage_w f32[R-1][max_tokens][32]
/// ```
/// Received rows are stored compactly with the actual row size of each call (`[M][row_bytes]`),
/// so one buffer serves any hidden size up to its capacity, BF16 or FP8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferLayout {
    pub num_ranks: usize,
    pub max_tokens: usize,
    pub hidden: usize,
    pub off_ready: usize,
    pub off_dispatch_rows: usize,
    pub off_notify_rank: usize,
    pub off_notify_expert: usize,
    pub off_stage_flag: usize,
    pub off_recv_x: usize,
    pub off_recv_scales: usize,
    pub off_recv_topk_idx: usize,
    pub off_recv_topk_w: usize,
    pub off_recv_src_idx: usize,
    pub off_stage_x: usize,
    pub off_stage_w: usize,
    pub stage_x_slot_bytes: usize,
    pub stage_w_slot_bytes: usize,
    /// u64 `[R]`: per source rank, the receive region its running dispatch asked for.
    pub off_recv_target: usize,
    /// The receive arena (512-aligned; `arena_bytes` may be 0).
    pub off_arena: usize,
    pub arena_bytes: usize,
    pub total_bytes: usize,
}

impl BufferLayout {
    /// Layout for `num_ranks` ranks, up to `max_tokens` tokens per rank per call and rows of up
    /// to `hidden` bf16 channels (FP8 rows up to the same `hidden`).
    pub fn new(num_ranks: usize, max_tokens: usize, hidden: usize) -> Result<Self> {
        Self::with_arena(num_ranks, max_tokens, hidden, 0)
    }

    /// [`BufferLayout::new`] plus a receive arena of `arena_bytes` (rounded down to 512) at the
    /// end: regions a dispatch may write its received rows into instead of the fixed receive
    /// region, so that they can outlive later dispatches (`intranode::arena`).
    pub fn with_arena(num_ranks: usize, max_tokens: usize, hidden: usize, arena_bytes: usize) -> Result<Self> {
        validate::intranode_ranks(num_ranks)?;
        validate::hidden(hidden, 2)?;
        if max_tokens == 0 {
            return Err(EpError::InvalidArgument(
                "max_tokens_per_rank is 0; create the buffer with the largest token count any rank will dispatch (e.g. 4096)".into(),
            ));
        }
        let (r, n, h) = (num_ranks, max_tokens, hidden);
        let rows = r.checked_mul(n).ok_or_else(|| overflow(r, n, h))?;
        let mut off = 0usize;
        let mut region = |bytes: usize| {
            let start = off;
            off = align(off + bytes, 128);
            start
        };
        let off_ready = region(r * 4);
        let off_dispatch_rows = region(r * 4);
        let off_notify_rank = region(r * r * 8);
        let off_notify_expert = region(r * MAX_LOCAL_EXPERTS * 8);
        let off_stage_flag = region((r - 1) * n * 4);
        let off_recv_target = region(r * 8);
        let off_recv_x = region(rows * h * 2);
        let off_recv_scales = region(rows * h.div_ceil(FP8_GROUP) * 4);
        let off_recv_topk_idx = region(rows * MAX_TOPK * 8);
        let off_recv_topk_w = region(rows * MAX_TOPK * 4);
        let off_recv_src_idx = region(rows * 4);
        let stage_x_slot_bytes = align(n * h * 2, 128);
        let stage_w_slot_bytes = align(n * MAX_TOPK * 4, 128);
        let off_stage_x = region((r - 1) * stage_x_slot_bytes);
        let off_stage_w = region((r - 1) * stage_w_slot_bytes);
        let off_arena = align(off, 512);
        let arena_bytes = arena_bytes / 512 * 512;
        let total_bytes = off_arena.checked_add(arena_bytes).ok_or_else(|| overflow(r, n, h))?;
        if total_bytes > (1usize << 40) {
            return Err(overflow(r, n, h));
        }
        Ok(BufferLayout {
            num_ranks,
            max_tokens,
            hidden,
            off_ready,
            off_dispatch_rows,
            off_notify_rank,
            off_notify_expert,
            off_stage_flag,
            off_recv_target,
            off_recv_x,
            off_recv_scales,
            off_recv_topk_idx,
            off_recv_topk_w,
            off_recv_src_idx,
            off_stage_x,
            off_stage_w,
            stage_x_slot_bytes,
            stage_w_slot_bytes,
            off_arena,
            arena_bytes,
            total_bytes,
        })
    }

    /// Rows the receive region holds (every rank may send all its tokens to one rank).
    pub fn recv_capacity(&self) -> usize {
        self.num_ranks * self.max_tokens
    }

    /// Bytes of the fixed receive region (rows, scales, top-k ids and weights at the largest
    /// top-k): the default receive arena is twice this (two worst-case dispatches kept alive).
    pub fn recv_region_bytes(&self) -> usize {
        self.off_recv_src_idx - self.off_recv_x
    }
}

fn overflow(r: usize, n: usize, h: usize) -> EpError {
    EpError::InvalidArgument(format!(
        "an intranode buffer for {r} ranks x {n} tokens x hidden {h} would exceed 1 TiB; lower max_tokens_per_rank or hidden"
    ))
}

/// Bytes of one rank's NVLink buffer (see [`BufferLayout`]); about
/// `(2R - 1) * max_tokens * hidden * 2` plus small metadata.
pub fn buffer_size_hint(num_ranks: usize, max_tokens: usize, hidden: usize) -> Result<usize> {
    Ok(BufferLayout::new(num_ranks, max_tokens, hidden)?.total_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_regions_are_aligned_disjoint_and_sized() {
        let l = BufferLayout::new(2, 4096, 7168).unwrap();
        let offs = [
            l.off_ready,
            l.off_dispatch_rows,
            l.off_notify_rank,
            l.off_notify_expert,
            l.off_stage_flag,
            l.off_recv_x,
            l.off_recv_scales,
            l.off_recv_topk_idx,
            l.off_recv_topk_w,
            l.off_recv_src_idx,
            l.off_stage_x,
            l.off_stage_w,
            l.total_bytes,
        ];
        assert!(offs.windows(2).all(|w| w[0] < w[1]), "{offs:?}");
        assert!(offs.iter().all(|o| o % 128 == 0));
        assert!(l.off_recv_scales - l.off_recv_x >= 2 * 4096 * 7168 * 2);
        assert!(l.off_stage_w - l.off_stage_x >= 4096 * 7168 * 2);
        // ~ (2R-1) * N * H * 2 = 176 MiB plus metadata.
        assert!(l.total_bytes > 3 * 4096 * 7168 * 2 && l.total_bytes < 3 * 4096 * 7168 * 2 + (8 << 20), "{}", l.total_bytes);
    }

    #[test]
    fn receive_arena_follows_the_fixed_layout() {
        let plain = BufferLayout::new(2, 4096, 7168).unwrap();
        assert_eq!((plain.arena_bytes, plain.total_bytes), (0, plain.off_arena));
        let l = BufferLayout::with_arena(2, 4096, 7168, 2 * plain.recv_region_bytes() + 100).unwrap();
        // the same fixed regions, the arena after them, 512-aligned, its size rounded down to 512
        assert_eq!((l.off_recv_x, l.off_stage_w, l.off_arena), (plain.off_recv_x, plain.off_stage_w, plain.off_arena));
        assert!(l.off_arena >= l.off_stage_w + (l.num_ranks - 1) * l.stage_w_slot_bytes && l.off_arena % 512 == 0);
        assert_eq!(l.arena_bytes, (2 * plain.recv_region_bytes() + 100) / 512 * 512);
        assert_eq!(l.total_bytes, l.off_arena + l.arena_bytes);
        // the per-source target slots are a control region before the receive region
        assert!(l.off_recv_target >= l.off_stage_flag && l.off_recv_target + 2 * 8 <= l.off_recv_x);
        // twice the fixed receive region holds two worst-case BF16 dispatches (2 x 4096 rows, top-8)
        let worst = crate::intranode::arena::recv_sublayout(2 * 4096, 7168 * 2, 0, 8).bytes;
        assert!(l.arena_bytes >= 2 * worst, "{} < 2 x {worst}", l.arena_bytes);
    }

    #[test]
    fn layout_rejects_bad_shapes_with_fix() {
        let e = BufferLayout::new(3, 16, 128).unwrap_err().to_string();
        assert!(e.contains("2, 4 or 8"), "{e}");
        let e = BufferLayout::new(2, 0, 128).unwrap_err().to_string();
        assert!(e.contains("max_tokens_per_rank"), "{e}");
        let e = BufferLayout::new(2, 16, 7).unwrap_err().to_string();
        assert!(e.contains("multiple of 8"), "{e}");
    }

    #[test]
    fn deepep_config_checks_like_deepep_and_names_the_values() {
        let c = DeepEpConfig::new([24, 6, 256, 6, 128]).unwrap();
        assert_eq!(c.values(), [24, 6, 256, 6, 128]);
        let e = |v| DeepEpConfig::new(v).unwrap_err().to_string();
        assert!(e([0, 6, 256, 6, 128]).contains("num_sms=0 must be >= 1"));
        assert!(e([24, 256, 256, 6, 128]).contains("got 256 and 256"));
        assert!(e([24, 6, 256, 0, 128]).contains("0 < num_max_rdma_chunked_send_tokens"));
        assert!(e([24, 6, 256, 100, 128]).contains("recv_tokens / 2, got 100 and 128"));
        assert!(DeepEpConfig::new([24, 6, 256, 64, 128]).is_ok());
    }

    #[test]
    fn config_validation_names_the_field() {
        assert!(Config::default().validate(Some(132)).is_ok());
        let e = Config { num_sms: 0, ..Config::default() }.validate(None).unwrap_err().to_string();
        assert!(e.contains("num_sms"), "{e}");
        let e = Config::with_sms(200).validate(Some(132)).unwrap_err().to_string();
        assert!(e.contains("132"), "{e}");
        let e = Config { combine_push_warps: 24, ..Config::default() }.validate(None).unwrap_err().to_string();
        assert!(e.contains("combine_push_warps"), "{e}");
        let e = Config { dispatch_warps: 25, ..Config::default() }.validate(None).unwrap_err().to_string();
        assert!(e.contains("dispatch_warps"), "{e}");
        let e = Config { combine_push_rows: 0, ..Config::default() }.validate(None).unwrap_err().to_string();
        assert!(e.contains("combine_push_rows"), "{e}");
        let e = Config { dispatch_local_warps: 24, ..Config::default() }.validate(None).unwrap_err().to_string();
        assert!(e.contains("dispatch_local_warps"), "{e}");
        // Odd SM counts are fine here (no sender/receiver pairs).
        assert!(Config::with_sms(7).validate(Some(132)).is_ok());
    }
}
