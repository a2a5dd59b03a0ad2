//! Generic argument checks run on the host before any launch. Each returns
//! [`EpError::InvalidArgument`] with a message that names the problem and the fix.
//!
//! Limits (contract §8) and the decisions taken here:
//! - intranode: 2, 4 or 8 ranks (kernels are specialised on the rank count);
//! - low-latency: any rank count with `E % R == 0`;
//! - internode: `ranks_per_node` divides `R` (our kernels take it as a parameter; DeepEP fixes 8);
//! - top-k `K <= 32` (normal) / `K <= 11` (LL), passed as a bound ([`MAX_TOPK_NORMAL`],
//!   [`MAX_TOPK_LOW_LATENCY`]);
//! - rows of `hidden * elem_size` bytes must be a multiple of 16 (int4 / TMA granularity);
//! - FP8 needs `H % 128 == 0` (one scale per 128 channels); LL FP8 needs `H % 512 == 0` in all
//!   cases (not only with UE8M0): the contract fixes it so that the f32 and UE8M0 scale layouts
//!   (four groups per int32) cover the same shapes, and every H of DeepEP's LL template set
//!   satisfies it.

use crate::{EpError, Result};

/// Largest top-k of the normal kernels.
pub const MAX_TOPK_NORMAL: usize = 32;
/// Largest top-k of the low-latency kernels.
pub const MAX_TOPK_LOW_LATENCY: usize = 11;
/// Rank counts the intranode kernels support.
pub const INTRANODE_RANKS: [usize; 3] = [2, 4, 8];

fn bad(msg: String) -> Result<()> {
    Err(EpError::InvalidArgument(msg))
}

/// Intranode rank count in {2, 4, 8}.
pub fn intranode_ranks(num_ranks: usize) -> Result<()> {
    if INTRANODE_RANKS.contains(&num_ranks) {
        return Ok(());
    }
    bad(format!("intranode mode supports 2, 4 or 8 ranks, got {num_ranks}; launch with --nproc 2, 4 or 8 (one process per GPU of one node)"))
}

/// `num_experts > 0` and divisible by `num_ranks > 0`.
pub fn experts(num_experts: usize, num_ranks: usize) -> Result<()> {
    if num_ranks == 0 {
        return bad("rank count is 0; run at least one rank".into());
    }
    if num_experts == 0 || num_experts % num_ranks != 0 {
        let up = num_experts.div_ceil(num_ranks).max(1) * num_ranks;
        return bad(format!(
            "{num_experts} experts cannot be split evenly over {num_ranks} ranks; use a multiple of {num_ranks} experts (e.g. {up})"
        ));
    }
    Ok(())
}

/// Low-latency: any rank count with `E % R == 0`.
pub fn low_latency_ranks(num_ranks: usize, num_experts: usize) -> Result<()> {
    experts(num_experts, num_ranks)
}

/// Internode: `ranks_per_node >= 1` divides `num_ranks`.
pub fn internode_ranks(num_ranks: usize, ranks_per_node: usize) -> Result<()> {
    if ranks_per_node == 0 || num_ranks == 0 || num_ranks % ranks_per_node != 0 {
        return bad(format!(
            "internode mode needs ranks_per_node to divide the rank count, got {num_ranks} ranks with ranks_per_node {ranks_per_node}; set ranks_per_node to the number of GPUs per host (a divisor of {num_ranks})"
        ));
    }
    Ok(())
}

/// `1 <= k <= max_topk`.
pub fn num_topk(k: usize, max_topk: usize) -> Result<()> {
    if k == 0 || k > max_topk {
        return bad(format!("top-k {k} is outside 1..={max_topk} supported by this mode; route each token to between 1 and {max_topk} experts"));
    }
    Ok(())
}

/// A host buffer holds `expected` elements (shape `shape`).
pub fn buffer_len(what: &str, len: usize, expected: usize, shape: &str) -> Result<()> {
    if len != expected {
        return bad(format!("{what} has {len} elements but its shape must be {shape} = {expected} elements; pass a buffer of exactly that shape"));
    }
    Ok(())
}

/// `topk_idx` is `[n, k]` with every id in `[-1, num_experts)`.
pub fn topk_idx(topk_idx: &[i64], n: usize, k: usize, num_experts: usize) -> Result<()> {
    buffer_len("topk_idx", topk_idx.len(), n * k, &format!("[{n}, {k}]"))?;
    if let Some(i) = topk_idx.iter().position(|&e| e < -1 || e >= num_experts as i64) {
        return bad(format!(
            "topk_idx[{}, {}] = {} is outside [-1, {num_experts}); pass expert ids in 0..{num_experts}, or -1 for an unused slot",
            i / k.max(1),
            i % k.max(1),
            topk_idx[i]
        ));
    }
    Ok(())
}

/// `topk_weights` is `[n, k]` and finite.
pub fn topk_weights(w: &[f32], n: usize, k: usize) -> Result<()> {
    buffer_len("topk_weights", w.len(), n * k, &format!("[{n}, {k}]"))?;
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return bad(format!("topk_weights[{}, {}] = {} is not finite; pass finite gate weights", i / k.max(1), i % k.max(1), w[i]));
    }
    Ok(())
}

/// `hidden > 0` and a row of `hidden * elem_size` bytes is a multiple of 16.
pub fn hidden(hidden: usize, elem_size: usize) -> Result<()> {
    let bytes = hidden * elem_size;
    if hidden == 0 || bytes % 16 != 0 {
        let step = 16 / gcd(16, elem_size.max(1));
        return bad(format!(
            "hidden {hidden} x {elem_size} B = {bytes} B per row is not a positive multiple of 16 B; use a hidden size that is a multiple of {step} for {elem_size}-byte elements"
        ));
    }
    Ok(())
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// FP8 hidden size: multiple of 128 (one scale per 128 channels), 512 with UE8M0 packing.
pub fn fp8_hidden(hidden: usize, ue8m0: bool) -> Result<()> {
    let m = if ue8m0 { 512 } else { 128 };
    if hidden == 0 || hidden % m != 0 {
        let why = if ue8m0 { "UE8M0 packs the scales of 4 groups of 128 channels into one int32" } else { "FP8 uses one scale per 128 channels" };
        return bad(format!("hidden {hidden} is not a positive multiple of {m} ({why}); use a hidden size that is a multiple of {m}"));
    }
    Ok(())
}

/// FP8 scales are f32 `[n, hidden/128]` (and `hidden % 128 == 0`).
pub fn fp8_scales(len: usize, n: usize, hidden: usize) -> Result<()> {
    fp8_hidden(hidden, false)?;
    buffer_len("FP8 scales", len, n * hidden / 128, &format!("[{n}, {}] (one f32 per token and 128 channels, row-major)", hidden / 128))
}

/// `use_ue8m0` requires `round_scale`.
pub fn fp8_flags(round_scale: bool, ue8m0: bool) -> Result<()> {
    if ue8m0 && !round_scale {
        return bad("use_ue8m0 without round_scale: UE8M0 scales hold only powers of two; enable round_scale together with use_ue8m0".into());
    }
    Ok(())
}

/// LL hidden size: positive, 16-byte rows, in `supported` (the instantiated sizes, if given),
/// and `H % 512 == 0` with FP8 (see module docs).
pub fn low_latency_hidden(hidden_size: usize, use_fp8: bool, supported: Option<&[usize]>) -> Result<()> {
    hidden(hidden_size, 2)?;
    if let Some(set) = supported {
        if !set.contains(&hidden_size) {
            return bad(format!("low-latency kernels are built for hidden sizes {set:?}, got {hidden_size}; use one of them (or add it to the kernel instantiations)"));
        }
    }
    if use_fp8 {
        fp8_hidden(hidden_size, true).map_err(|_| {
            EpError::InvalidArgument(format!(
                "low-latency FP8 dispatch needs hidden % 512 == 0 (scales of 4 groups of 128 channels per int32), got {hidden_size}; use a multiple of 512 or dispatch bf16"
            ))
        })?;
    }
    Ok(())
}

/// LL capacity `num_max > 0` with `(R · num_max) % 4 == 0`.
pub fn low_latency_num_max(num_max: usize, num_ranks: usize) -> Result<()> {
    if num_max == 0 || (num_ranks * num_max) % 4 != 0 {
        let sug = (1..=4).map(|i| num_max.max(1) + i - 1).find(|m| (num_ranks * m) % 4 == 0).unwrap_or(4);
        return bad(format!(
            "num_max_dispatch_tokens_per_rank {num_max} with {num_ranks} ranks: need num_max > 0 and (ranks x num_max) % 4 == 0; use e.g. num_max = {sug}"
        ));
    }
    Ok(())
}

/// `n <= capacity` tokens for the mode `what`.
pub fn tokens_within(n: usize, capacity: usize, what: &str) -> Result<()> {
    if n > capacity {
        return bad(format!("{what}: {n} tokens exceed the capacity of {capacity} tokens per rank; create the buffer with a capacity of at least {n} or send fewer tokens per call"));
    }
    Ok(())
}

/// Generic capacity check: `needed <= capacity` of a named resource, with the fix to apply.
pub fn capacity(what: &str, needed: usize, capacity: usize, fix: &str) -> Result<()> {
    if needed > capacity {
        return bad(format!("{what}: need {needed} but the capacity is {capacity}; {fix}"));
    }
    Ok(())
}

/// `expert_alignment >= 1`.
pub fn expert_alignment(a: usize) -> Result<()> {
    if a == 0 {
        return bad("expert_alignment 0: counts are aligned up to a multiple of it; use 1 for no alignment".into());
    }
    Ok(())
}

/// `num_sms` even and > 0 (sender/receiver block pairs), and at most `max_sms` if given.
pub fn num_sms(num_sms: usize, max_sms: Option<usize>) -> Result<()> {
    if num_sms == 0 || num_sms % 2 != 0 {
        let sug = (num_sms + 1) & !1;
        return bad(format!("num_sms {num_sms} must be even and positive (one sender and one receiver block per channel); use e.g. {}", sug.max(2)));
    }
    if let Some(m) = max_sms {
        if num_sms > m {
            return bad(format!("num_sms {num_sms} exceeds the {m} SMs this rank may use (the GPU's, or its share when several ranks share it); use at most {}", m & !1));
        }
    }
    Ok(())
}
