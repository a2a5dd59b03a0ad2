//! Deterministic inputs from `(seed, rank)`, so that every rank can compute the CPU reference of
//! all ranks locally without exchanging inputs.
//!
//! Streams come from `rand::rngs::StdRng::seed_from_u64(mix(seed, rank, stream))` (`rand` 0.9,
//! ChaCha12). `StdRng`'s algorithm is only stable within a `rand` version: a seed printed by one
//! build reproduces the same inputs with any build that uses the same `rand` 0.9.x, not across a
//! `rand` major upgrade. All ranks run the same binary, so they always agree.

use super::fp8::cast_per_token;
use super::numeric::bf16_rn;
use super::{Payload, RankInput};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// splitmix64 finalizer: a bijective 64-bit mixer.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Independent random stream for `(seed, rank, stream)`. Use distinct `stream` constants for
/// distinct purposes (inputs, combine inputs, biases, ...).
pub fn rng(seed: u64, rank: usize, stream: u64) -> StdRng {
    let mixed = splitmix64(splitmix64(splitmix64(seed) ^ rank as u64) ^ stream.wrapping_mul(0xd6e8_feb8_6659_fd93));
    StdRng::seed_from_u64(mixed)
}

/// Stream ids used by this module (callers may pick any other values for their own streams).
pub mod streams {
    pub const TOKENS: u64 = 1;
    pub const TOPK: u64 = 2;
    pub const VALUES: u64 = 3;
    pub const COUNTS: u64 = 4;
    pub const COMBINE_Y: u64 = 5;
    pub const BIAS0: u64 = 6;
    pub const BIAS1: u64 = 7;
}

/// Shape and options of one rank's random input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputSpec {
    pub num_tokens: usize,
    pub hidden: usize,
    pub num_topk: usize,
    pub num_experts: usize,
    /// Produce `Payload::Fp8` (cast per token with f32 scales, no `round_scale`) instead of bf16.
    pub fp8: bool,
    /// Probability that a `(t, k)` slot is replaced by `-1`.
    pub masked_fraction: f64,
}

/// Four normal-ish f32 values (mean 0, variance 1), each `(u_a + u_b + u_c + u_d − 2)·√3` over
/// four independent 16-bit uniforms in `[0, 1)` split from one 64-bit draw (Irwin-Hall of order 4,
/// bounded by ±3.46): plenty for test data, and several times cheaper than Box-Muller.
fn normal4(rng: &mut StdRng) -> [f32; 4] {
    let mut out = [0f32; 4];
    for o in &mut out {
        let bits: u64 = rng.random();
        let sum: u32 = (0..4).map(|i| ((bits >> (16 * i)) & 0xffff) as u32).sum();
        *o = (sum as f32 / 65536.0 - 2.0) * 3f32.sqrt();
    }
    out
}

/// `rows × cols` bf16 values, normal-ish (see [`normal4`]), with a per-row power-of-two magnitude
/// in `2^-3..=2^3` (so FP8 scale groups see different ranges), never zero (a value that rounds to
/// zero is replaced by `±2^-4` times the row magnitude).
pub fn bf16_rows(rng: &mut StdRng, rows: usize, cols: usize) -> Vec<bf16> {
    let mut out = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let mag = 2f32.powi(rng.random_range(-3..=3));
        for c in (0..cols).step_by(4) {
            let zs = normal4(rng);
            for &z in &zs[..(cols - c).min(4)] {
                let mut v = bf16_rn(z * mag);
                if v.to_f32() == 0.0 {
                    v = bf16_rn(if rng.random::<bool>() { mag / 16.0 } else { -mag / 16.0 });
                }
                out.push(v);
            }
        }
    }
    out
}

/// `[n, k]` top-k ids: per token `k` distinct experts drawn uniformly in random order (what
/// top-k over i.i.d. random scores gives, as in DeepEP's tests); then each slot becomes `-1`
/// with probability `masked_fraction`.
pub fn topk_idx(rng: &mut StdRng, n: usize, k: usize, num_experts: usize, masked_fraction: f64) -> Vec<i64> {
    assert!(k <= num_experts, "top-k {k} larger than the expert count {num_experts}");
    let mut perm: Vec<i64> = (0..num_experts as i64).collect();
    let mut out = Vec::with_capacity(n * k);
    for _ in 0..n {
        for j in 0..k {
            let p = rng.random_range(j..num_experts);
            perm.swap(j, p);
        }
        for &e in &perm[..k] {
            out.push(if masked_fraction > 0.0 && rng.random::<f64>() < masked_fraction { -1 } else { e });
        }
    }
    out
}

/// DeepEP's LL-test routing mask (v1.2.1 `tests/test_low_latency.py`: `for i in range(10):
/// topk_idx[random.randint(0, num_tokens - 1), random.randint(0, num_topk - 1)] = -1`): `draws`
/// times, pick a token uniformly in `0..n`, then a slot uniformly in `0..k`, and set that slot of
/// `idx` (`[n, k]`, row-major) to `-1`. Draws are with replacement, so fewer than `draws` slots
/// may end up masked (a slot drawn twice, or one already `-1`). Same distribution as DeepEP's,
/// not the same numbers (DeepEP draws from Python's `random` seeded with `seed + rank`). Nothing
/// happens when `n` or `k` is 0.
pub fn mask_random_slots(rng: &mut StdRng, idx: &mut [i64], n: usize, k: usize, draws: usize) {
    assert_eq!(idx.len(), n * k, "mask_random_slots: idx has {} entries, expected n * k = {n} * {k}", idx.len());
    if n == 0 || k == 0 {
        return;
    }
    for _ in 0..draws {
        let t = rng.random_range(0..n);
        let j = rng.random_range(0..k);
        idx[t * k + j] = -1;
    }
}

/// `[n, k]` positive weights in `[0.05, 1.05)`.
pub fn topk_weights(rng: &mut StdRng, n: usize, k: usize) -> Vec<f32> {
    (0..n * k).map(|_| 0.05 + rng.random::<f32>()).collect()
}

/// The input of `rank` for `seed`: values, top-k ids (with `-1` slots) and weights.
pub fn rank_input(seed: u64, rank: usize, spec: &InputSpec) -> RankInput {
    let InputSpec { num_tokens: n, hidden: h, num_topk: k, num_experts, fp8, masked_fraction } = *spec;
    let x = bf16_rows(&mut rng(seed, rank, streams::VALUES), n, h);
    let mut r = rng(seed, rank, streams::TOPK);
    let topk_idx = topk_idx(&mut r, n, k, num_experts, masked_fraction);
    let topk_weights = topk_weights(&mut r, n, k);
    let x = if fp8 {
        let (data, scales) = cast_per_token(&x, n, h, false, false).expect("rank_input: fp8 needs hidden % 128 == 0");
        Payload::Fp8 { data, scales: scales.to_f32() }
    } else {
        Payload::Bf16(x)
    };
    RankInput { n, hidden: h, k, x, topk_idx, topk_weights }
}

/// Inputs of all `num_ranks` ranks; `tokens[r]` tokens on rank `r` (see [`token_counts`]).
pub fn all_inputs(seed: u64, tokens: &[usize], spec: &InputSpec) -> Vec<RankInput> {
    tokens.iter().enumerate().map(|(r, &n)| rank_input(seed, r, &InputSpec { num_tokens: n, ..*spec })).collect()
}

/// Ragged token counts per rank, identical on every rank for the same seed: each rank gets 0, 1,
/// `max_tokens`, or a uniform count in `0..=max_tokens` (0 and 1 each with probability 1/8,
/// `max_tokens` with 1/4).
pub fn token_counts(seed: u64, num_ranks: usize, max_tokens: usize) -> Vec<usize> {
    let mut r = rng(seed, usize::MAX, streams::COUNTS);
    (0..num_ranks)
        .map(|_| match r.random_range(0..8u32) {
            0 => 0,
            1 => 1.min(max_tokens),
            2 | 3 => max_tokens,
            _ => r.random_range(0..=max_tokens),
        })
        .collect()
}

/// Random combine inputs `[rows, hidden]` for `rank` (independent of the dispatch inputs).
pub fn combine_rows(seed: u64, rank: usize, stream: u64, rows: usize, hidden: usize) -> Vec<bf16> {
    bf16_rows(&mut rng(seed, rank, stream), rows, hidden)
}

/// Give some tokens a duplicate expert id in their top-k (what a caller may pass: nothing in the
/// contract forbids it): every third token with two or more used slots gets slot 1 = slot 0.
/// The CPU reference defines what a duplicate means; the kernels must agree with it.
pub fn add_duplicate_experts(inputs: &mut [RankInput]) {
    for inp in inputs.iter_mut() {
        if inp.k < 2 {
            continue;
        }
        for t in (0..inp.n).step_by(3) {
            let row = &mut inp.topk_idx[t * inp.k..(t + 1) * inp.k];
            if row[0] >= 0 && row[1] >= 0 {
                row[1] = row[0];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_random_slots_masks_at_most_draws_slots_deterministically() {
        let (n, k) = (128, 8);
        let base = topk_idx(&mut rng(1, 0, 9), n, k, 288, 0.0);
        let masked = |seed: u64, draws: usize| {
            let mut idx = base.clone();
            mask_random_slots(&mut rng(seed, 0, 10), &mut idx, n, k, draws);
            idx
        };
        let m = masked(1, 10);
        let changed: Vec<usize> = (0..n * k).filter(|&i| m[i] != base[i]).collect();
        // With replacement: between 1 and 10 slots, every changed one is -1, the rest untouched.
        assert!((1..=10).contains(&changed.len()), "{} slots masked", changed.len());
        assert!(changed.iter().all(|&i| m[i] == -1));
        assert_eq!(m.iter().filter(|&&e| e == -1).count(), changed.len());
        assert_eq!(masked(1, 10), m, "same rng seed, same mask");
        assert_ne!(masked(2, 10), m, "another seed, another mask");
        assert_eq!(masked(1, 0), base, "0 draws: nothing masked");
        // Every slot of a 1 x 1 routing is masked by one draw; empty shapes are a no-op.
        let mut one = vec![5i64];
        mask_random_slots(&mut rng(1, 0, 10), &mut one, 1, 1, 1);
        assert_eq!(one, vec![-1]);
        let mut empty: Vec<i64> = Vec::new();
        mask_random_slots(&mut rng(1, 0, 10), &mut empty, 0, 8, 10);
        assert!(empty.is_empty());
    }

    #[test]
    fn mask_random_slots_draws_tokens_and_slots_uniformly() {
        // 4 tokens x 2 slots, 8000 single-draw trials: each of the 8 slots is hit ~1000 times.
        let mut hits = [0usize; 8];
        let mut r = rng(3, 0, 11);
        for _ in 0..8000 {
            let mut idx = vec![1i64; 8];
            mask_random_slots(&mut r, &mut idx, 4, 2, 1);
            hits[idx.iter().position(|&e| e == -1).unwrap()] += 1;
        }
        assert!(hits.iter().all(|&h| (850..1150).contains(&h)), "{hits:?}");
    }
}
