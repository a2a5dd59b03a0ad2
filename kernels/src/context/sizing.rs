//! Capacity arithmetic of a rank's buffers: how many tokens the bytes a caller granted hold.

use crate::config::buffer_size_hint;
use crate::internode::{InternodeConfig, SymLayout};
use crate::Result;

/// The internode configuration a caller asks for: `(ranks_per_host, max_tokens, hidden, num_sms,
/// max_topk, max_local_experts)`.
pub type InterDims = (usize, usize, usize, usize, usize, usize);

pub fn inter_config(d: InterDims) -> InternodeConfig {
    let (rph, max_tokens, hidden, num_sms, max_topk, max_local) = d;
    let mut c = InternodeConfig::new(rph, max_tokens, hidden);
    c.num_sms = num_sms;
    c.max_topk = max_topk;
    c.max_local_experts = max_local;
    c
}

/// [`InterDims`] of an internode configuration.
pub fn inter_dims(c: &InternodeConfig) -> InterDims {
    (c.ranks_per_host, c.max_tokens_per_rank, c.hidden, c.num_sms, c.max_topk, c.max_local_experts)
}

/// Bytes of one rank's internode symmetric buffer for `d` (the configuration validated first).
pub fn inter_bytes(world: usize, d: InterDims) -> Result<usize> {
    SymLayout::new(&inter_config(d), world).map(|l| l.total)
}

/// The largest `t >= 1` with `fits(t)` (searched up to 2^24), 0 if none; `fits` is monotone.
fn largest(fits: impl Fn(usize) -> bool) -> usize {
    if !fits(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1usize, 2usize);
    while fits(hi) && hi < (1 << 24) {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid
        } else {
            hi = mid
        }
    }
    lo
}

/// Largest `max_tokens` (of `d`, whose own `max_tokens` is ignored) whose internode buffer is a
/// valid configuration and fits in `bytes`; 0 if none.
pub fn inter_max_tokens(world: usize, d: InterDims, bytes: usize) -> usize {
    largest(|t| inter_bytes(world, (d.0, t, d.2, d.3, d.4, d.5)).map(|b| b <= bytes).unwrap_or(false))
}

/// Largest per-rank token count whose NVLink buffer fits in `bytes` (0 if none).
pub fn intranode_max_tokens(num_ranks: usize, hidden: usize, bytes: usize) -> usize {
    largest(|t| buffer_size_hint(num_ranks, t, hidden).map(|b| b <= bytes).unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_is_the_largest_count_that_fits() {
        let bytes = buffer_size_hint(8, 4096, 7168).unwrap();
        assert_eq!(intranode_max_tokens(8, 7168, bytes), 4096);
        assert_eq!(intranode_max_tokens(8, 7168, bytes - 1), 4095);
        assert_eq!(intranode_max_tokens(8, 7168, 10), 0);
    }

    #[test]
    fn internode_max_tokens_is_the_largest_count_that_fits() {
        let d = (2, 0, 2048, 24, 8, 8);
        let bytes = inter_bytes(8, (2, 300, 2048, 24, 8, 8)).unwrap();
        assert_eq!(inter_max_tokens(8, d, bytes), 300);
        assert_eq!(inter_max_tokens(8, d, bytes - 1), 299);
        assert_eq!(inter_max_tokens(8, d, 10), 0);
        // an invalid configuration (3 ranks per host of 8 ranks) fits nowhere
        assert_eq!(inter_max_tokens(8, (3, 0, 2048, 24, 8, 8), usize::MAX), 0);
        assert!(inter_bytes(8, (3, 16, 2048, 24, 8, 8)).unwrap_err().to_string().contains("divide"));
    }
}
