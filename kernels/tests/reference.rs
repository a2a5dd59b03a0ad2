//! CI tests of the CPU reference (no GPU). Properties are checked over many random seeds with
//! checks recomputed from first principles in the test, not by calling the function under test.

use deepep_kernels::reference::compare::{bit_exact, calc_diff, Bounded};
use deepep_kernels::reference::fp8::{self, cast_per_token, e4m3_decode, e4m3_encode, Scales};
use deepep_kernels::reference::layout::{channel_range, layout, rank_prefix_matrix, recv_channel_prefix_matrix};
use deepep_kernels::reference::low_latency::{ll_combine, ll_combine_packed, ll_dispatch, LlOptions, LlPacked, LlRowScales, LlScalesView};
use deepep_kernels::reference::normal::{combine, combine_internode, dispatch, CombineArgs};
use deepep_kernels::reference::numeric::{bf16_from_bytes, bf16_rn, ulp_bf16};
use deepep_kernels::reference::random::{self, InputSpec};
use deepep_kernels::reference::{Payload, RankInput};
use half::bf16;
use rand::seq::SliceRandom;
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet, HashMap};

// ---------------------------------------------------------------------------------------------
// FP8 e4m3
// ---------------------------------------------------------------------------------------------

/// e4m3 value of a finite code, written from the OCP table (independent of the crate's decoder).
fn e4m3_table(code: u8) -> f64 {
    let s = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code >> 3) & 0xf) as i32;
    let m = (code & 7) as f64;
    s * if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) }
}

/// Nearest finite e4m3 code by exhaustive search; ties go to the even code; beyond 448 saturate.
fn e4m3_nearest(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = (x as f64).abs();
    if a >= 448.0 {
        return 0x7e | sign;
    }
    let mut best = 0u8;
    let mut best_d = f64::INFINITY;
    for c in 0u8..=0x7e {
        let d = (e4m3_table(c) - a).abs();
        if d < best_d || (d == best_d && c % 2 == 0) {
            best = c;
            best_d = d;
        }
    }
    best | sign
}

#[test]
fn e4m3_hand_computed_bit_patterns() {
    let cases: &[(f32, u8, &str)] = &[
        (0.0, 0x00, "zero"),
        (-0.0, 0x80, "negative zero keeps its sign"),
        (1.0, 0x38, "one: exponent 7"),
        (-2.0, 0xc0, "minus two"),
        (0.3, 0x2a, "0.3 -> 1.25 * 2^-2 = 0.3125"),
        (240.0, 0x77, "1.875 * 2^7"),
        (448.0, 0x7e, "max finite"),
        (449.0, 0x7e, "saturates"),
        (464.0, 0x7e, "448 + half ulp ties to even (448)"),
        (1000.0, 0x7e, "saturates"),
        (-1.0e9, 0xfe, "negative saturation"),
        (f32::INFINITY, 0x7e, "+inf saturates (satfinite)"),
        (f32::NEG_INFINITY, 0xfe, "-inf saturates"),
        (f32::NAN, 0x7f, "NaN"),
        (0.015625, 0x08, "2^-6 smallest normal"),
        (0.001953125, 0x01, "2^-9 smallest subnormal"),
        (0.0009765625, 0x00, "2^-10 ties to even zero"),
        (0.0009766, 0x01, "just above 2^-10 rounds up"),
        (3.0 * 0.0009765625, 0x02, "1.5 * 2^-9 ties to even (2)"),
        (5.0 * 0.0009765625, 0x02, "2.5 * 2^-9 ties to even (2)"),
        (7.5 * 0.001953125, 0x08, "7.5 * 2^-9 ties up into the smallest normal"),
        (1.0625, 0x38, "1 + 1/16 ties to even (1.0)"),
        (1.1875, 0x3a, "1 + 3/16 ties to even (1.25)"),
        (1.9375, 0x40, "1.9375 ties to even and carries into the exponent (2.0)"),
        (21.0, 0x5a, "21 ties between 20 and 22 -> 20"),
        (-0.0001, 0x80, "underflow to negative zero"),
    ];
    for &(x, want, why) in cases {
        assert_eq!(e4m3_encode(x), want, "e4m3_encode({x:e}) [{why}]");
    }
    assert_eq!(e4m3_encode(-f32::NAN), 0x7f, "any NaN becomes the canonical 0x7f, like cuda_fp8.hpp");
    assert_eq!(e4m3_encode(f32::from_bits(0xff80_0001)), 0x7f);
}

#[test]
fn e4m3_decode_matches_table_and_round_trips() {
    for c in 0u8..=255 {
        if c & 0x7f == 0x7f {
            assert!(e4m3_decode(c).is_nan());
            continue;
        }
        assert_eq!(e4m3_decode(c) as f64, e4m3_table(c), "code {c:#x}");
        assert_eq!(e4m3_encode(e4m3_decode(c)), c, "round trip of code {c:#x}");
    }
}

#[test]
fn e4m3_encode_is_nearest_even_on_midpoints_and_random_values() {
    // every midpoint between adjacent codes, and its f32 neighbours
    for c in 0u8..0x7e {
        let mid = ((e4m3_table(c) + e4m3_table(c + 1)) / 2.0) as f32;
        for x in [mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
            assert_eq!(e4m3_encode(x), e4m3_nearest(x), "x = {x:e}");
            assert_eq!(e4m3_encode(-x), e4m3_nearest(-x), "x = {:e}", -x);
        }
    }
    let mut rng = random::rng(7, 0, 99);
    for _ in 0..50_000 {
        let x = f32::from_bits(rng.random::<u32>() & 0x7fff_ffff);
        if x.is_nan() {
            continue;
        }
        let x = if x > 1e3 { x / 1e30 } else { x };
        assert_eq!(e4m3_encode(x), e4m3_nearest(x), "x = {x:e}");
    }
}

fn bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16_rn(x)).collect()
}

#[test]
fn fp8_cast_hand_computed_group() {
    // amax 896: scale_inv = 896 * fl(1/448) = 2.0 exactly, scale = 448/896 = 0.5
    let mut x = vec![0.0f32; 128];
    x[0] = 896.0;
    x[1] = -896.0;
    x[2] = 1.0; // 0.5 -> 0x30
    x[3] = 3.0; // 1.5 -> 0x3c
    x[4] = 42.0; // 21 -> ties to 20 -> 0x5a
    let (q, s) = cast_per_token(&bf(&x), 1, 128, false, false).unwrap();
    assert_eq!(s, Scales::F32(vec![2.0]));
    assert_eq!(&q[..6], &[0x7e, 0xfe, 0x30, 0x3c, 0x5a, 0x00]);
    assert!(q[6..].iter().all(|&b| b == 0));
}

#[test]
fn fp8_cast_uses_deepep_scale_arithmetic() {
    // scale_inv = amax * fl(1/448), not amax / 448: they differ for amax = 1.015625
    let mut x = vec![0.0f32; 128];
    x[0] = 1.015625;
    let (_, s) = cast_per_token(&bf(&x), 1, 128, false, false).unwrap();
    assert_eq!(s, Scales::F32(vec![f32::from_bits(0x3b14_924a)]));
    assert_ne!(0x3b14_924a, (1.015625f32 / 448.0).to_bits());
    // scale = 448 / amax, not 1 / scale_inv: with amax 1.0, x = 2^-16 lands exactly on the
    // midpoint 3.5 * 2^-9 (ties to even: 4 * 2^-9 = code 0x04); 1/scale_inv is 1 ulp below 448 and
    // would give 0x03.
    x[0] = 1.0;
    x[1] = 2f32.powi(-16);
    let (q, s) = cast_per_token(&bf(&x), 1, 128, false, false).unwrap();
    assert_eq!(s, Scales::F32(vec![f32::from_bits(0x3b12_4925)]));
    assert_eq!(q[0], 0x7e);
    assert_eq!(q[1], 0x04);
    assert_eq!(e4m3_encode(2f32.powi(-16) * (1.0 / f32::from_bits(0x3b12_4925))), 0x03);
}

#[test]
fn fp8_cast_amax_margin_on_zero_rows() {
    let x = vec![bf16::ZERO; 256];
    let (q, s) = cast_per_token(&x, 1, 256, false, false).unwrap();
    assert!(q.iter().all(|&b| b == 0));
    let want = 1e-4f32 * (1.0f32 / 448.0);
    assert_eq!(s, Scales::F32(vec![want, want]));
    // round_scale: 1e-4/448 ~ 2^-22.1 -> 2^-22
    let (_, s) = cast_per_token(&x, 1, 256, true, false).unwrap();
    assert_eq!(s, Scales::F32(vec![2f32.powi(-22); 2]));
}

#[test]
fn fp8_round_scale_and_ue8m0() {
    // four groups with amax 1.0, 448, 450, 0.001 -> scale_inv 2^-8, 2^0, 2^1, 2^-18
    let mut x = vec![0.0f32; 512];
    x[0] = 1.0;
    x[128] = 448.0;
    x[256] = -450.0; // exactly representable in bf16
    x[384] = 0.001;
    let (q, s) = cast_per_token(&bf(&x), 1, 512, true, false).unwrap();
    let want = [2f32.powi(-8), 1.0, 2.0, 2f32.powi(-18)];
    assert_eq!(s, Scales::F32(want.to_vec()));
    assert_eq!(q[0], 0x78, "1.0 * 2^8 = 256 -> exponent 15, mantissa 0");
    assert_eq!(q[128], 0x7e);
    assert_eq!(q[256], 0xf6, "-450 / 2 = -225 -> ties? no: nearest -224 = -1.75 * 2^7");
    let (q2, s2) = cast_per_token(&bf(&x), 1, 512, true, true).unwrap();
    assert_eq!(q2, q, "UE8M0 does not change the data");
    let bytes = [127u8 - 8, 127, 128, 127 - 18];
    assert_eq!(s2, Scales::Ue8m0(vec![i32::from_le_bytes(bytes)]));
    assert_eq!(s2.to_f32(), want.to_vec());
}

#[test]
fn fp8_bad_options_are_refused_with_the_fix() {
    let x = vec![bf16::ONE; 256];
    let e = cast_per_token(&x, 1, 256, false, true).unwrap_err().to_string();
    assert!(e.contains("round_scale"), "{e}");
    let e = cast_per_token(&x, 1, 256, true, true).unwrap_err().to_string();
    assert!(e.contains("512"), "{e}");
    let e = cast_per_token(&x[..200], 1, 200, false, false).unwrap_err().to_string();
    assert!(e.contains("128"), "{e}");
}

#[test]
fn fp8_dequantize_is_within_half_an_e4m3_ulp() {
    for seed in 0..20u64 {
        let n = 8;
        let h = 512;
        let x = random::bf16_rows(&mut random::rng(seed, 0, 1), n, h);
        for (rs, ue) in [(false, false), (true, false), (true, true)] {
            let (q, s) = cast_per_token(&x, n, h, rs, ue).unwrap();
            let sc = s.to_f32();
            let d = fp8::dequantize(&q, &s, n, h);
            for i in 0..n * h {
                let xi = x[i].to_f64();
                let step = sc[i / 128] as f64;
                // relative half-ulp 2^-4 for normals, absolute 2^-10 * scale in the subnormal range
                let tol = xi.abs() * 2f64.powi(-4) + step * 2f64.powi(-10) + 1e-30;
                assert!((d[i] as f64 - xi).abs() <= tol * 1.0001, "seed {seed} i {i}: x {xi} deq {} scale {step}", d[i]);
            }
            // the group maximum maps to at most 448 and, without round_scale, to 448 itself
            for g in 0..n * h / 128 {
                let amax = x[g * 128..(g + 1) * 128].iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max);
                let qmax = q[g * 128..(g + 1) * 128].iter().map(|&b| e4m3_table(b & 0x7f)).fold(0.0, f64::max);
                if !rs {
                    assert_eq!(qmax, 448.0, "seed {seed} group {g} amax {amax}");
                } else {
                    assert!(qmax <= 448.0 && qmax > 448.0 / 2.0 - 32.0, "seed {seed} group {g}: {qmax}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// random inputs
// ---------------------------------------------------------------------------------------------

fn spec(n: usize, hidden: usize, k: usize, e: usize, fp8: bool, masked: f64) -> InputSpec {
    InputSpec { num_tokens: n, hidden, num_topk: k, num_experts: e, fp8, masked_fraction: masked }
}

#[test]
fn random_inputs_are_deterministic_and_well_formed() {
    let sp = spec(300, 256, 8, 64, false, 0.1);
    let a = random::rank_input(42, 1, &sp);
    assert_eq!(a, random::rank_input(42, 1, &sp), "same (seed, rank) gives the same input");
    assert_ne!(a, random::rank_input(42, 0, &sp), "ranks differ");
    assert_ne!(a, random::rank_input(43, 1, &sp), "seeds differ");
    let Payload::Bf16(x) = &a.x else { panic!() };
    assert!(x.iter().all(|v| v.to_f32() != 0.0 && v.to_f32().is_finite()), "values are never zero");
    let mut masked = 0;
    for t in 0..a.n {
        let ids: Vec<i64> = a.topk_idx[t * 8..(t + 1) * 8].to_vec();
        masked += ids.iter().filter(|&&e| e == -1).count();
        let valid: Vec<i64> = ids.into_iter().filter(|&e| e >= 0).collect();
        assert!(valid.iter().all(|&e| e < 64));
        let set: BTreeSet<i64> = valid.iter().copied().collect();
        assert_eq!(set.len(), valid.len(), "top-k without repetition");
    }
    let frac = masked as f64 / (300.0 * 8.0);
    assert!((0.05..0.15).contains(&frac), "masked fraction {frac}");
    assert!(a.topk_weights.iter().all(|&w| w > 0.0));
    // fp8 inputs are the cast of the same values
    let b = random::rank_input(42, 1, &InputSpec { fp8: true, ..sp });
    let (q, s) = cast_per_token(x, 300, 256, false, false).unwrap();
    assert_eq!(b.x, Payload::Fp8 { data: q, scales: s.to_f32() });
    assert_eq!(b.topk_idx, a.topk_idx);
}

#[test]
fn ragged_token_counts_cover_edge_cases() {
    let mut seen = BTreeSet::new();
    for seed in 0..200 {
        let c = random::token_counts(seed, 4, 100);
        assert_eq!(c, random::token_counts(seed, 4, 100));
        assert!(c.iter().all(|&n| n <= 100));
        seen.extend(c);
    }
    for v in [0, 1, 100] {
        assert!(seen.contains(&v), "count {v} never drawn");
    }
    assert!(seen.len() > 20);
}

// ---------------------------------------------------------------------------------------------
// layout
// ---------------------------------------------------------------------------------------------

/// Ranks of token t, from first principles.
fn ranks_of(inp: &RankInput, t: usize, l: usize) -> BTreeSet<usize> {
    inp.topk_idx[t * inp.k..(t + 1) * inp.k].iter().filter(|&&e| e >= 0).map(|&e| e as usize / l).collect()
}

#[test]
fn layout_counts_and_channel_metadata() {
    for seed in 0..30u64 {
        let r = [2, 4, 8][seed as usize % 3];
        let e = r * [2, 8, 32][(seed / 3) as usize % 3];
        let k = [1, 6, 8][seed as usize % 3].min(e);
        let n = random::token_counts(seed, 1, 200)[0];
        let inp = random::rank_input(seed, 0, &spec(n, 16, k, e, false, 0.15));
        let lay = layout(&inp.topk_idx, n, k, e, r).unwrap();
        let l = e / r;
        let mut per_rank = vec![0; r];
        let mut per_expert = vec![0; e];
        for t in 0..n {
            let rs = ranks_of(&inp, t, l);
            for d in 0..r {
                assert_eq!(lay.in_rank(t, d), rs.contains(&d), "seed {seed} t {t} d {d}");
            }
            for d in rs {
                per_rank[d] += 1;
            }
            for &x in &inp.topk_idx[t * k..(t + 1) * k] {
                if x >= 0 {
                    per_expert[x as usize] += 1;
                }
            }
        }
        assert_eq!(lay.num_tokens_per_rank, per_rank);
        assert_eq!(lay.num_tokens_per_expert, per_expert);
        // nodes of 2 ranks
        if r >= 2 {
            let per_node = lay.num_tokens_per_node(2);
            for (node, &c) in per_node.iter().enumerate() {
                let want = (0..n).filter(|&t| ranks_of(&inp, t, l).iter().any(|&d| d / 2 == node)).count();
                assert_eq!(c as usize, want);
            }
        }
        for c_count in [1usize, 3, 10] {
            let cpm = lay.channel_prefix_matrix(c_count);
            let heads = lay.send_head(c_count);
            for d in 0..r {
                assert_eq!(cpm[d * c_count + c_count - 1], per_rank[d], "last channel column = tokens to d");
                for c in 0..c_count {
                    let (b, en) = channel_range(n, c_count, c);
                    let prev = if c == 0 { 0 } else { cpm[d * c_count + c - 1] };
                    let in_c: Vec<usize> = (b..en).filter(|&t| lay.in_rank(t, d)).collect();
                    assert_eq!((cpm[d * c_count + c] - prev) as usize, in_c.len());
                    for (slot, &t) in in_c.iter().enumerate() {
                        assert_eq!(heads[t * r + d], slot as i32);
                    }
                }
                for t in 0..n {
                    if !lay.in_rank(t, d) {
                        assert_eq!(heads[t * r + d], -1);
                    }
                }
            }
            // channels partition [0, n)
            let mut next = 0;
            for c in 0..c_count {
                let (b, en) = channel_range(n, c_count, c);
                assert_eq!(b, next);
                next = en;
            }
            assert_eq!(next, n);
        }
    }
}

#[test]
fn layout_rejects_bad_ids() {
    let e = layout(&[0, 5, 16, 1], 2, 2, 16, 2).unwrap_err().to_string();
    assert!(e.contains("topk_idx[1, 0] = 16") && e.contains("-1"), "{e}");
    let e = layout(&[0, -2], 1, 2, 16, 2).unwrap_err().to_string();
    assert!(e.contains("-2"), "{e}");
    let e = layout(&[0, 1], 1, 2, 15, 2).unwrap_err().to_string();
    assert!(e.contains("multiple of 2"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// normal dispatch
// ---------------------------------------------------------------------------------------------

struct Case {
    r: usize,
    e: usize,
    k: usize,
    h: usize,
    fp8: bool,
    align: usize,
    inputs: Vec<RankInput>,
}

fn case(seed: u64) -> Case {
    let r = [2, 4, 8][seed as usize % 3];
    let e = r * [2, 4, 32][(seed / 3) as usize % 3];
    let k = [1, 6, 8, 9][(seed / 2) as usize % 4].min(e);
    let h = [128, 256][seed as usize % 2];
    let fp8 = seed % 4 >= 2;
    let align = [1, 4, 128][(seed / 5) as usize % 3];
    let counts = random::token_counts(seed, r, 64);
    let inputs = random::all_inputs(seed, &counts, &spec(0, h, k, e, fp8, 0.1));
    Case { r, e, k, h, fp8, align, inputs }
}

#[test]
fn dispatch_properties_over_random_seeds() {
    for seed in 0..48u64 {
        let c = case(seed);
        let l = c.e / c.r;
        let outs = dispatch(&c.inputs, c.e, c.align).unwrap();
        assert_eq!(outs.len(), c.r);
        let layouts: Vec<_> = c.inputs.iter().map(|i| layout(&i.topk_idx, i.n, i.k, c.e, c.r).unwrap()).collect();
        for (d, o) in outs.iter().enumerate() {
            let ctx = format!("seed {seed} (R {} E {} K {} H {} fp8 {}) dest {d}", c.r, c.e, c.k, c.h, c.fp8);
            // which (s, t) must arrive: from first principles
            let inputs = &c.inputs;
            let want: Vec<(usize, usize)> = (0..c.r)
                .flat_map(|s| (0..inputs[s].n).filter(move |&t| ranks_of(&inputs[s], t, l).contains(&d)).map(move |t| (s, t)))
                .collect();
            let got: Vec<(usize, usize)> = (0..o.num_recv_tokens).map(|i| (o.recv_src_rank[i] as usize, o.recv_src_idx[i] as usize)).collect();
            assert_eq!(got, want, "{ctx}: rows ordered by source rank then token, once per rank");
            assert!(got.windows(2).all(|w| w[0] < w[1]), "{ctx}: strictly increasing (dedup)");
            assert_eq!(o.recv_x.rows(c.h), got.len());
            for (i, &(s, t)) in got.iter().enumerate() {
                let src = &c.inputs[s];
                assert_eq!(o.recv_x.row_bytes(i, c.h), src.x.row_bytes(t, c.h), "{ctx}: row {i} is a bit copy");
                if let (Payload::Fp8 { scales: rs, .. }, Payload::Fp8 { scales: ss, .. }) = (&o.recv_x, &src.x) {
                    let g = c.h / 128;
                    assert_eq!(rs[i * g..(i + 1) * g].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), ss[t * g..(t + 1) * g].iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                }
                for j in 0..c.k {
                    let gid = src.topk_idx[t * c.k + j];
                    let li = o.recv_topk_idx[i * c.k + j];
                    let w = o.recv_topk_weights[i * c.k + j];
                    if gid >= 0 && gid as usize / l == d {
                        assert_eq!(li, gid - (d * l) as i64, "{ctx}: local id");
                        assert!((0..l as i64).contains(&li));
                        assert_eq!(w.to_bits(), src.topk_weights[t * c.k + j].to_bits(), "{ctx}: weight kept");
                    } else {
                        assert_eq!(li, -1, "{ctx}: non-local or -1 slot");
                        assert_eq!(w.to_bits(), 0f32.to_bits(), "{ctx}: weight zeroed (+0.0)");
                    }
                }
            }
            // aligned per-expert counts
            let mut raw_counts = vec![0usize; c.e];
            for &x in c.inputs.iter().flat_map(|inp| inp.topk_idx.iter()) {
                if x >= 0 {
                    raw_counts[x as usize] += 1;
                }
            }
            for le in 0..l {
                let raw = raw_counts[d * l + le];
                let a = o.num_recv_tokens_per_expert[le];
                assert!(a % c.align == 0 && a >= raw && a - raw < c.align, "{ctx}: expert {le} raw {raw} aligned {a} (alignment {})", c.align);
            }
            // rank prefix: inclusive per source
            let mut acc = 0;
            for s in 0..c.r {
                acc += got.iter().filter(|p| p.0 == s).count() as i32;
                assert_eq!(o.rank_prefix[s], acc, "{ctx}: rank_prefix[{s}]");
            }
            // receiver-side channel offsets: exclusive prefix inside each source block
            let cc = 3;
            let rcpm = recv_channel_prefix_matrix(&layouts, d, cc);
            for s in 0..c.r {
                for ch in 0..cc {
                    let (b, _) = channel_range(c.inputs[s].n, cc, ch);
                    let before = got.iter().filter(|p| p.0 == s && p.1 < b).count() as i32;
                    assert_eq!(rcpm[s * cc + ch], before, "{ctx}: recv_channel_prefix[{s}][{ch}]");
                }
            }
        }
        let rpm = rank_prefix_matrix(&layouts);
        for d in 0..c.r {
            assert_eq!(rpm[(c.r - 1) * c.r + d] as usize, outs[d].num_recv_tokens);
        }
    }
}

/// Internode dispatch simulated as two hops (source -> node once, node -> local GPUs), written
/// independently: it must give the same rows as the reference (§7: intranode == internode).
#[test]
fn internode_two_hop_dispatch_equals_reference() {
    for seed in 0..20u64 {
        let c = case(seed);
        let l = c.e / c.r;
        let outs = dispatch(&c.inputs, c.e, 1).unwrap();
        for rpn in (1..=c.r).filter(|p| c.r % p == 0) {
            // hop 1: per (source, node) the tokens that go to any rank of the node, with the rank set
            let mut node_inbox: BTreeMap<usize, Vec<(usize, usize, BTreeSet<usize>)>> = BTreeMap::new();
            for (s, inp) in c.inputs.iter().enumerate() {
                for t in 0..inp.n {
                    let rs = ranks_of(inp, t, l);
                    let nodes: BTreeSet<usize> = rs.iter().map(|d| d / rpn).collect();
                    for node in nodes {
                        node_inbox.entry(node).or_default().push((s, t, rs.iter().copied().filter(|d| d / rpn == node).collect()));
                    }
                }
            }
            // hop 2: forward to local GPUs; receivers order by (source, token)
            let mut recv: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
            for (_, msgs) in node_inbox {
                for (s, t, dests) in msgs {
                    for d in dests {
                        recv.entry(d).or_default().push((s, t));
                    }
                }
            }
            for (d, o) in outs.iter().enumerate() {
                let mut want = recv.remove(&d).unwrap_or_default();
                want.sort();
                let got: Vec<(usize, usize)> = (0..o.num_recv_tokens).map(|i| (o.recv_src_rank[i] as usize, o.recv_src_idx[i] as usize)).collect();
                assert_eq!(got, want, "seed {seed} rpn {rpn} dest {d}");
            }
        }
    }
}

#[test]
fn dispatch_rejects_inconsistent_inputs() {
    let sp = spec(4, 128, 2, 8, false, 0.0);
    let mut inputs = vec![random::rank_input(1, 0, &sp), random::rank_input(1, 1, &InputSpec { hidden: 256, ..sp })];
    let e = dispatch(&inputs, 8, 1).unwrap_err().to_string();
    assert!(e.contains("same hidden"), "{e}");
    inputs[1] = random::rank_input(1, 1, &sp);
    let e = dispatch(&inputs, 8, 0).unwrap_err().to_string();
    assert!(e.contains("expert_alignment"), "{e}");
    inputs[1].topk_idx[3] = 8;
    let e = dispatch(&inputs, 8, 1).unwrap_err().to_string();
    assert!(e.contains("topk_idx[1, 1] = 8"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// normal combine
// ---------------------------------------------------------------------------------------------

/// Emulate a GPU combine that sums the same terms in a different order, optionally in pairs.
fn f32_sum_in_order(terms: &[f32], order: &[usize]) -> f32 {
    order.iter().fold(0f32, |acc, &i| acc + terms[i])
}

#[test]
fn combine_sums_and_bounds_over_random_seeds() {
    for seed in 0..32u64 {
        let c = case(seed);
        if c.fp8 {
            continue; // combine is bf16 only; fp8 cases are covered by dispatch
        }
        let outs = dispatch(&c.inputs, c.e, 1).unwrap();
        let y: Vec<Vec<bf16>> = outs.iter().enumerate().map(|(d, o)| random::combine_rows(seed, d, random::streams::COMBINE_Y, o.num_recv_tokens, c.h)).collect();
        let b0: Vec<Vec<bf16>> = c.inputs.iter().enumerate().map(|(s, i)| random::combine_rows(seed, s, random::streams::BIAS0, i.n, c.h)).collect();
        let b1: Vec<Vec<bf16>> = c.inputs.iter().enumerate().map(|(s, i)| random::combine_rows(seed, s, random::streams::BIAS1, i.n, c.h)).collect();
        let w: Vec<Vec<f32>> = outs.iter().map(|o| o.recv_topk_weights.clone()).collect();
        let with_bias = seed % 2 == 0;
        let args = CombineArgs { y: &y, topk_weights: Some(&w), bias0: with_bias.then_some(&b0[..]), bias1: with_bias.then_some(&b1[..]) };
        let res = combine(&outs, &c.inputs, args).unwrap();
        // position of (s, t) on each destination, from the dispatch rows
        let mut pos: HashMap<(usize, usize, usize), usize> = HashMap::new();
        for (d, o) in outs.iter().enumerate() {
            for i in 0..o.num_recv_tokens {
                pos.insert((d, o.recv_src_rank[i] as usize, o.recv_src_idx[i] as usize), i);
            }
        }
        let mut rng = random::rng(seed, 0, 1234);
        for (s, inp) in c.inputs.iter().enumerate() {
            let out = &res[s];
            assert_eq!(out.combined_x.value.len(), inp.n * c.h);
            for t in 0..inp.n {
                let holders: Vec<(usize, usize)> = (0..c.r).filter_map(|d| pos.get(&(d, s, t)).map(|&p| (d, p))).collect();
                for col in 0..c.h {
                    let mut terms: Vec<f32> = Vec::new();
                    if with_bias {
                        terms.push(b0[s][t * c.h + col].to_f32());
                        terms.push(b1[s][t * c.h + col].to_f32());
                    }
                    terms.extend(holders.iter().map(|&(d, p)| y[d][p * c.h + col].to_f32()));
                    let i = t * c.h + col;
                    // contract order: biases, then ranks ascending
                    let contract = bf16_rn(terms.iter().fold(0f32, |a, &v| a + v));
                    assert_eq!(out.combined_x.value[i].to_bits(), contract.to_bits(), "seed {seed} s {s} t {t} col {col}");
                    let exact: f64 = terms.iter().map(|&v| v as f64).sum();
                    assert!((out.combined_x.exact[i] - exact).abs() <= exact.abs() * 1e-15);
                    // bound is tight: at most a few bf16 ulps of the result's magnitude
                    let abs: f64 = terms.iter().map(|&v| (v as f64).abs()).sum();
                    assert!(out.combined_x.bound[i] <= 0.5 * ulp_bf16(exact) + abs * 1e-6 + 1e-30, "loose bound");
                    // any other order passes the check
                    let mut order: Vec<usize> = (0..terms.len()).collect();
                    order.shuffle(&mut rng);
                    let other = bf16_rn(f32_sum_in_order(&terms, &order));
                    assert!((other.to_f64() - exact).abs() <= out.combined_x.bound[i], "seed {seed}: reordered sum out of bound");
                }
                // weights reconstruct the original ones exactly (non-local slots were zeroed)
                let cw = out.combined_topk_weights.as_ref().unwrap();
                for j in 0..c.k {
                    let want = if inp.topk_idx[t * c.k + j] >= 0 { inp.topk_weights[t * c.k + j] } else { 0.0 };
                    assert_eq!(cw.value[t * c.k + j].to_bits(), want.to_bits(), "seed {seed} weights");
                }
            }
            out.combined_x.check("combined_x", &out.combined_x.value).unwrap();
            out.combined_topk_weights.as_ref().unwrap().check("w", &out.combined_topk_weights.as_ref().unwrap().value).unwrap();
        }
    }
}

#[test]
fn combine_check_rejects_a_wrong_element() {
    let c = case(3);
    let outs = dispatch(&c.inputs, c.e, 1).unwrap();
    let y: Vec<Vec<bf16>> = outs.iter().enumerate().map(|(d, o)| random::combine_rows(9, d, 5, o.num_recv_tokens, c.h)).collect();
    let res = combine(&outs, &c.inputs, CombineArgs { y: &y, topk_weights: None, bias0: None, bias1: None }).unwrap();
    let (s, out) = res.iter().enumerate().find(|(_, o)| o.combined_x.value.iter().any(|v| v.to_f32() != 0.0)).unwrap();
    let mut gpu = out.combined_x.value.clone();
    let i = gpu.iter().position(|v| v.to_f32() != 0.0).unwrap();
    gpu[i] = bf16::from_bits(gpu[i].to_bits() + 2); // two bf16 ulps off
    let e = out.combined_x.check("combined_x", &gpu).unwrap_err();
    let (row, col) = (i / c.h, i % c.h);
    assert!(e.contains(&format!("row {row}, column {col}")) && e.contains("1 of"), "rank {s}: {e}");
    let mut nan = out.combined_x.value.clone();
    nan[i] = bf16::NAN;
    assert!(out.combined_x.check("x", &nan).is_err(), "NaN never passes");
    assert!(out.combined_x.check("x", &gpu[1..]).unwrap_err().contains("length"));
}

#[test]
fn combine_of_dispatched_x_matches_deepep_check() {
    // DeepEP's test: combine(recv_x) / #ranks-per-token ≈ x, calc_diff < 5e-6
    for seed in 0..10u64 {
        let mut c = case(seed);
        if c.fp8 {
            c = case(seed + 100);
            if c.fp8 {
                continue;
            }
        }
        let l = c.e / c.r;
        let outs = dispatch(&c.inputs, c.e, 1).unwrap();
        let y: Vec<Vec<bf16>> = outs.iter().map(|o| if let Payload::Bf16(v) = &o.recv_x { v.clone() } else { unreachable!() }).collect();
        let res = combine(&outs, &c.inputs, CombineArgs { y: &y, topk_weights: None, bias0: None, bias1: None }).unwrap();
        for (s, inp) in c.inputs.iter().enumerate() {
            let Payload::Bf16(x) = &inp.x else { unreachable!() };
            let mut got = Vec::new();
            let mut want = Vec::new();
            for t in 0..inp.n {
                let nr = ranks_of(inp, t, l).len();
                if nr == 0 {
                    continue;
                }
                for col in 0..c.h {
                    got.push(res[s].combined_x.value[t * c.h + col].to_f64() / nr as f64);
                    want.push(x[t * c.h + col].to_f64());
                }
            }
            let diff = calc_diff(&got, &want);
            assert!(diff < 5e-6, "seed {seed} rank {s}: calc_diff {diff}");
        }
    }
}

#[test]
fn internode_combine_rounds_node_partials() {
    for seed in 0..20u64 {
        let c = case(seed);
        if c.fp8 {
            continue;
        }
        let outs = dispatch(&c.inputs, c.e, 1).unwrap();
        let y: Vec<Vec<bf16>> = outs.iter().enumerate().map(|(d, o)| random::combine_rows(seed, d, 11, o.num_recv_tokens, c.h)).collect();
        let b0: Vec<Vec<bf16>> = c.inputs.iter().enumerate().map(|(s, i)| random::combine_rows(seed, s, 12, i.n, c.h)).collect();
        let no_bias = CombineArgs { y: &y, topk_weights: None, bias0: None, bias1: None };
        let bias = CombineArgs { bias0: Some(&b0), ..no_bias };
        // one rank per node: each partial is a single bf16 term, so internode == intranode bitwise
        for args in [no_bias, bias] {
            let intra = combine(&outs, &c.inputs, args).unwrap();
            let inter = combine_internode(&outs, &c.inputs, args, 1).unwrap();
            for s in 0..c.r {
                bit_exact("rpn=1", &inter[s].combined_x.value, &intra[s].combined_x.value, c.h).unwrap();
            }
        }
        // one node holding all ranks, no bias: bf16(bf16(sum)) == bf16(sum)
        let intra = combine(&outs, &c.inputs, no_bias).unwrap();
        let one_node = combine_internode(&outs, &c.inputs, no_bias, c.r).unwrap();
        for s in 0..c.r {
            bit_exact("one node", &one_node[s].combined_x.value, &intra[s].combined_x.value, c.h).unwrap();
        }
        // 2 ranks per node with bias: recompute the two-stage sum independently; its bound must
        // also accept a GPU that sums each stage in reverse order
        if c.r >= 4 {
            let mut pos: HashMap<(usize, usize, usize), usize> = HashMap::new();
            for (d, o) in outs.iter().enumerate() {
                for i in 0..o.num_recv_tokens {
                    pos.insert((d, o.recv_src_rank[i] as usize, o.recv_src_idx[i] as usize), i);
                }
            }
            let res = combine_internode(&outs, &c.inputs, bias, 2).unwrap();
            for (s, inp) in c.inputs.iter().enumerate() {
                for t in 0..inp.n {
                    for col in 0..c.h {
                        let mut partials = Vec::new();
                        let mut partials_rev = Vec::new();
                        for node in 0..c.r / 2 {
                            let terms: Vec<f32> = (node * 2..node * 2 + 2).filter_map(|d| pos.get(&(d, s, t)).map(|&p| y[d][p * c.h + col].to_f32())).collect();
                            if terms.is_empty() {
                                continue;
                            }
                            partials.push(bf16_rn(terms.iter().fold(0f32, |a, &v| a + v)).to_f32());
                            partials_rev.push(bf16_rn(terms.iter().rev().fold(0f32, |a, &v| a + v)).to_f32());
                        }
                        let b = b0[s][t * c.h + col].to_f32();
                        let want = bf16_rn(partials.iter().fold(b, |a, &v| a + v));
                        let i = t * c.h + col;
                        assert_eq!(res[s].combined_x.value[i].to_bits(), want.to_bits(), "seed {seed} s {s} t {t} col {col}");
                        let rev = bf16_rn(partials_rev.iter().rev().fold(0f32, |a, &v| a + v) + b);
                        assert!((rev.to_f64() - res[s].combined_x.exact[i]).abs() <= res[s].combined_x.bound[i]);
                    }
                }
            }
        }
        assert!(combine_internode(&outs, &c.inputs, no_bias, 3.max(c.r + 1)).unwrap_err().to_string().contains("ranks_per_node"));
    }
}

#[test]
fn combine_rejects_misshaped_buffers() {
    let c = case(0);
    let outs = dispatch(&c.inputs, c.e, 1).unwrap();
    let mut y: Vec<Vec<bf16>> = outs.iter().map(|o| vec![bf16::ONE; o.num_recv_tokens * c.h]).collect();
    y[1].push(bf16::ONE);
    let e = combine(&outs, &c.inputs, CombineArgs { y: &y, topk_weights: None, bias0: None, bias1: None }).unwrap_err().to_string();
    assert!(e.contains("y of rank 1") && e.contains("expected"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// low latency
// ---------------------------------------------------------------------------------------------

struct LlCase {
    r: usize,
    e: usize,
    k: usize,
    h: usize,
    num_max: usize,
    opts: LlOptions,
    inputs: Vec<RankInput>,
    mask: Option<Vec<bool>>,
}

fn ll_case(seed: u64) -> LlCase {
    let r = [2, 3, 4, 8][seed as usize % 4];
    let e = r * [2, 9, 36][(seed / 4) as usize % 3];
    let k = [1, 5, 8, 9][(seed / 2) as usize % 4].min(e);
    let h = [512, 1024][seed as usize % 2];
    let num_max = 32;
    let opts = match seed % 4 {
        0 => LlOptions::BF16,
        1 => LlOptions::FP8,
        2 => LlOptions { use_fp8: true, round_scale: true, use_ue8m0: false },
        _ => LlOptions { use_fp8: true, round_scale: true, use_ue8m0: true },
    };
    let counts = random::token_counts(seed, r, num_max);
    let inputs = random::all_inputs(seed, &counts, &spec(0, h, k, e, false, 0.1));
    let mask = (seed % 5 == 4).then(|| (0..r).map(|i| i == 1).collect());
    LlCase { r, e, k, h, num_max, opts, inputs, mask }
}

#[test]
fn ll_dispatch_properties_over_random_seeds() {
    for seed in 0..40u64 {
        let c = ll_case(seed);
        let l = c.e / c.r;
        let outs = ll_dispatch(&c.inputs, c.e, c.num_max, c.opts, c.mask.as_deref()).unwrap();
        for (d, o) in outs.iter().enumerate() {
            assert_eq!(o.experts.len(), l);
            for (le, ex) in o.experts.iter().enumerate() {
                let e = (d * l + le) as i64;
                let ctx = format!("seed {seed} dest {d} expert {le}");
                // every (t, k) selection separately, -1 not sent, masked sources absent
                let mut want: Vec<(usize, usize)> = Vec::new();
                for (s, inp) in c.inputs.iter().enumerate() {
                    if c.mask.as_ref().is_some_and(|m| m[s]) {
                        continue;
                    }
                    for t in 0..inp.n {
                        let hits = inp.topk_idx[t * c.k..(t + 1) * c.k].iter().filter(|&&x| x == e).count();
                        want.extend(std::iter::repeat((s, t)).take(hits));
                    }
                }
                let got: Vec<(usize, usize)> = ex.entries.iter().map(|en| (en.src_rank, en.src_token)).collect();
                assert_eq!(got, want, "{ctx}");
                for s in 0..c.r {
                    assert_eq!(ex.per_source[s], want.iter().filter(|p| p.0 == s).count(), "{ctx}");
                }
                for en in &ex.entries {
                    let Payload::Bf16(x) = &c.inputs[en.src_rank].x else { unreachable!() };
                    let row = &x[en.src_token * c.h..(en.src_token + 1) * c.h];
                    if c.opts.use_fp8 {
                        let (q, s) = cast_per_token(row, 1, c.h, c.opts.round_scale, false).unwrap();
                        assert_eq!(en.x, q, "{ctx}: fp8 row is the per-token cast");
                        let s = s.to_f32();
                        match &en.scales {
                            LlRowScales::F32(v) => {
                                assert!(!c.opts.use_ue8m0);
                                assert_eq!(v, &s);
                            }
                            LlRowScales::Ue8m0(b) => {
                                assert!(c.opts.use_ue8m0);
                                let vals: Vec<f32> = b.iter().map(|&b| fp8::ue8m0_value(b)).collect();
                                assert_eq!(vals, s);
                            }
                            LlRowScales::None => panic!("{ctx}: fp8 without scales"),
                        }
                    } else {
                        assert_eq!(bf16_from_bytes(&en.x), row, "{ctx}: bf16 row copied");
                        assert_eq!(en.scales, LlRowScales::None);
                    }
                }
            }
        }
    }
}

/// A GPU-like packed LL output built from the reference: source blocks in random order, slots
/// shuffled inside each block, unused slots poisoned.
struct FakeLl {
    x: Vec<u8>,
    scales_f32: Vec<f32>,
    scales_ue8m0: Vec<i32>,
    count: Vec<i32>,
    src_info: Vec<i32>,
    layout_range: Vec<i64>,
}

#[allow(clippy::needless_range_loop)]
fn fake_gpu_ll(c: &LlCase, out: &deepep_kernels::reference::LlDispatchOut, seed: u64) -> FakeLl {
    let (r, l, h) = (c.r, c.e / c.r, c.h);
    let rm = r * c.num_max;
    let rb = c.opts.row_bytes(h);
    let g = h / 128;
    let mut f = FakeLl {
        x: vec![0xab; l * rm * rb],
        scales_f32: vec![f32::from_bits(0x7fc0_dead); l * g * rm],
        scales_ue8m0: vec![-1; l * g / 4 * rm],
        count: vec![0; l],
        src_info: vec![-7; l * rm],
        layout_range: vec![0; l * r],
    };
    let mut rng = random::rng(seed, 0, 77);
    for (le, ex) in out.experts.iter().enumerate() {
        let mut order: Vec<usize> = (0..r).collect();
        order.shuffle(&mut rng);
        let mut next = 0usize;
        for s in order {
            let mut entries: Vec<_> = ex.entries.iter().filter(|en| en.src_rank == s).collect();
            entries.shuffle(&mut rng);
            f.layout_range[le * r + s] = ((next as i64) << 32) | entries.len() as i64;
            for en in entries {
                let slot = next;
                next += 1;
                f.x[(le * rm + slot) * rb..(le * rm + slot + 1) * rb].copy_from_slice(&en.x);
                f.src_info[le * rm + slot] = en.src_token as i32;
                match &en.scales {
                    LlRowScales::F32(v) => {
                        for gi in 0..g {
                            f.scales_f32[(le * g + gi) * rm + slot] = v[gi];
                        }
                    }
                    LlRowScales::Ue8m0(b) => {
                        for gi in 0..g {
                            let idx = (le * (g / 4) + gi / 4) * rm + slot;
                            let mut bytes = f.scales_ue8m0[idx].to_le_bytes();
                            bytes[gi % 4] = b[gi];
                            f.scales_ue8m0[idx] = i32::from_le_bytes(bytes);
                        }
                    }
                    LlRowScales::None => {}
                }
            }
        }
        f.count[le] = next as i32;
    }
    f
}

fn view<'a>(c: &LlCase, f: &'a FakeLl) -> LlPacked<'a> {
    LlPacked {
        num_ranks: c.r,
        num_local_experts: c.e / c.r,
        num_max: c.num_max,
        hidden: c.h,
        opts: c.opts,
        x: &f.x,
        scales: if !c.opts.use_fp8 {
            LlScalesView::None
        } else if c.opts.use_ue8m0 {
            LlScalesView::Ue8m0(&f.scales_ue8m0)
        } else {
            LlScalesView::F32(&f.scales_f32)
        },
        count: &f.count,
        src_info: &f.src_info,
        layout_range: &f.layout_range,
    }
}

#[test]
fn ll_packed_checker_accepts_any_order_and_catches_corruption() {
    for seed in 0..24u64 {
        let c = ll_case(seed);
        let outs = ll_dispatch(&c.inputs, c.e, c.num_max, c.opts, c.mask.as_deref()).unwrap();
        for (d, o) in outs.iter().enumerate() {
            let f = fake_gpu_ll(&c, o, seed * 31 + d as u64);
            view(&c, &f).check(o).unwrap_or_else(|e| panic!("seed {seed} dest {d}: {e}"));
            let Some(le) = o.experts.iter().position(|ex| ex.count() >= 2) else { continue };
            let rm = c.r * c.num_max;
            let (s0, (b0, n0)) = f.layout_range[le * c.r..(le + 1) * c.r].iter().enumerate().map(|(s, &v)| (s, ((v >> 32) as usize, (v & 0xffff_ffff) as usize))).find(|x| x.1 .1 > 0).unwrap();
            let bad = |mutate: &dyn Fn(&mut FakeLl), expect: &str| {
                let mut g = FakeLl { x: f.x.clone(), scales_f32: f.scales_f32.clone(), scales_ue8m0: f.scales_ue8m0.clone(), count: f.count.clone(), src_info: f.src_info.clone(), layout_range: f.layout_range.clone() };
                mutate(&mut g);
                let e = view(&c, &g).check(o).expect_err(expect);
                assert!(e.contains(expect), "seed {seed}: expected '{expect}' in: {e}");
            };
            bad(&|g| g.count[le] += 1, "packed_recv_count");
            bad(&|g| g.x[(le * rm + b0) * c.opts.row_bytes(c.h) + 3] ^= 0x10, "x differs");
            bad(&|g| g.src_info[le * rm + b0] = 100_000, &format!("source rank {s0}"));
            bad(&|g| g.layout_range[le * c.r + s0] = ((b0 as i64 + 1) << 32) | n0 as i64, "local expert");
            if c.opts.use_fp8 {
                if c.opts.use_ue8m0 {
                    bad(&|g| g.scales_ue8m0[(le * (c.h / 512)) * rm + b0] ^= 1, "scale of group 0");
                } else {
                    bad(&|g| g.scales_f32[(le * (c.h / 128)) * rm + b0] *= 2.0, "scale of group 0");
                }
            }
        }
    }
}

#[test]
fn ll_combine_weighted_sum_and_bounds() {
    for seed in 0..24u64 {
        let c = ll_case(seed);
        let l = c.e / c.r;
        let mask = c.mask.as_deref();
        let outs = ll_dispatch(&c.inputs, c.e, c.num_max, c.opts, mask).unwrap();
        // combine input = the dispatched rows as bf16 (dequantized for fp8), placed GPU-like
        let rm = c.r * c.num_max;
        let mut maps = Vec::new();
        let mut ys = Vec::new();
        for (d, o) in outs.iter().enumerate() {
            let f = fake_gpu_ll(&c, o, seed + d as u64);
            maps.push(view(&c, &f).slots().unwrap());
            let mut y = vec![bf16::NAN; l * rm * c.h];
            for (le, ex) in o.experts.iter().enumerate() {
                for en in &ex.entries {
                    let slot = maps[d].slot(le, en.src_rank, en.src_token).unwrap();
                    let row: Vec<bf16> = match &en.scales {
                        LlRowScales::None => bf16_from_bytes(&en.x),
                        LlRowScales::F32(s) => fp8::dequantize_bf16(&en.x, &Scales::F32(s.clone()), 1, c.h),
                        LlRowScales::Ue8m0(b) => fp8::dequantize_bf16(&en.x, &Scales::F32(b.iter().map(|&v| fp8::ue8m0_value(v)).collect()), 1, c.h),
                    };
                    y[(le * rm + slot) * c.h..(le * rm + slot + 1) * c.h].copy_from_slice(&row);
                }
            }
            ys.push(y);
        }
        let res = ll_combine_packed(&c.inputs, c.e, c.num_max, mask, &maps, &ys).unwrap();
        for (s, inp) in c.inputs.iter().enumerate() {
            let Payload::Bf16(x) = &inp.x else { unreachable!() };
            let mut got = Vec::new();
            let mut want = Vec::new();
            if mask.is_some_and(|m| m[s]) {
                assert!(res[s].combined_x.value.is_empty(), "masked origin rank has no expectation");
                continue;
            }
            for t in 0..inp.n {
                // independent recomputation: Σ_k w·y over unmasked owners, k ascending, f32 FMA
                let sel: Vec<(f32, usize, usize)> = (0..c.k)
                    .filter_map(|j| {
                        let e = inp.topk_idx[t * c.k + j];
                        (e >= 0 && !mask.is_some_and(|m| m[e as usize / l])).then(|| (inp.topk_weights[t * c.k + j], e as usize / l, e as usize % l))
                    })
                    .collect();
                let wsum: f64 = sel.iter().map(|p| p.0 as f64).sum();
                for col in 0..c.h {
                    let ys_col: Vec<(f32, f32)> = sel
                        .iter()
                        .map(|&(w, o, le)| {
                            let slot = maps[o].slot(le, s, t).unwrap();
                            (w, ys[o][(le * rm + slot) * c.h + col].to_f32())
                        })
                        .collect();
                    let fma = ys_col.iter().fold(0f32, |a, &(w, v)| v.mul_add(w, a));
                    let i = t * c.h + col;
                    assert_eq!(res[s].combined_x.value[i].to_bits(), bf16_rn(fma).to_bits(), "seed {seed} s {s} t {t} col {col}");
                    // a GPU without FMA, summing in reverse, must pass the bound
                    let plain = ys_col.iter().rev().fold(0f32, |a, &(w, v)| a + v * w);
                    assert!((bf16_rn(plain).to_f64() - res[s].combined_x.exact[i]).abs() <= res[s].combined_x.bound[i], "seed {seed}: bound");
                    got.push(res[s].combined_x.value[i].to_f64());
                    want.push(x[i].to_f64() * wsum);
                }
            }
            // DeepEP's tolerance: calc_diff(out, x·Σw) < 1e-5 (bf16), 9e-4 (fp8), skipped for round_scale
            let diff = calc_diff(&got, &want);
            let tol = if !c.opts.use_fp8 { 1e-5 } else { 9e-4 };
            if !c.opts.round_scale {
                assert!(diff < tol, "seed {seed} rank {s}: calc_diff {diff}");
            }
        }
        // a missing row is an error that names the token
        let e = ll_combine(&c.inputs, c.e, mask, |_, _, _, _| None).map(|_| ()).unwrap_err().to_string();
        if c.inputs.iter().any(|i| i.topk_idx.iter().any(|&x| x >= 0)) && mask.is_none() {
            assert!(e.contains("no input row"), "{e}");
        }
    }
}

#[test]
fn ll_dispatch_validates_arguments() {
    let c = ll_case(1);
    let e = ll_dispatch(&c.inputs, c.e, 0, c.opts, None).unwrap_err().to_string();
    assert!(e.contains("num_max"), "{e}");
    let e = ll_dispatch(&c.inputs, c.e, 1, c.opts, None).unwrap_err().to_string();
    assert!(e.contains("tokens exceed the capacity") || e.contains("% 4"), "{e}");
    let e = ll_dispatch(&c.inputs, c.e, c.num_max, LlOptions { use_fp8: true, round_scale: false, use_ue8m0: true }, None).unwrap_err().to_string();
    assert!(e.contains("round_scale"), "{e}");
    let e = ll_dispatch(&c.inputs, c.e + 1, c.num_max, c.opts, None).unwrap_err().to_string();
    assert!(e.contains("experts"), "{e}");
    let sp = spec(4, 256, 2, 8, false, 0.0);
    let inputs: Vec<RankInput> = (0..2).map(|r| random::rank_input(3, r, &sp)).collect();
    let e = ll_dispatch(&inputs, 8, 4, LlOptions::FP8, None).unwrap_err().to_string();
    assert!(e.contains("512"), "{e}");
    let inputs: Vec<RankInput> = (0..2).map(|r| random::rank_input(3, r, &spec(4, 512, 12, 16, false, 0.0))).collect();
    let e = ll_dispatch(&inputs, 16, 4, LlOptions::BF16, None).unwrap_err().to_string();
    assert!(e.contains("1..=11"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// comparators
// ---------------------------------------------------------------------------------------------

#[test]
fn bit_exact_names_first_difference() {
    let want = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let mut got = want.clone();
    assert!(bit_exact("t", &got, &want, 3).is_ok());
    got[4] = 5.5;
    got[5] = 0.0;
    let e = bit_exact("recv_x", &got, &want, 3).unwrap_err();
    assert!(e.starts_with("recv_x: first mismatch at row 1, column 1: got 5.5"), "{e}");
    assert!(e.contains("expected 5.0") && e.contains("2 of 6"), "{e}");
    let e = bit_exact("z", &[-0.0f32], &[0.0f32], 1).unwrap_err();
    assert!(e.contains("0x80000000"), "-0 differs from +0 bitwise: {e}");
    assert!(bit_exact("len", &[1u8, 2], &[1u8], 1).unwrap_err().contains("length"));
    let e = bit_exact("ids", &[0i64, -1, 3], &[0i64, 2, 3], 3).unwrap_err();
    assert!(e.contains("row 0, column 1: got -1"), "{e}");
}

#[test]
fn calc_diff_matches_definition() {
    let x = [1.0f64, 2.0, 3.0];
    assert_eq!(calc_diff(&x, &x), 0.0);
    let y = [1.0f64, 2.0, 4.0];
    // (x+1)=(2,3,4), (y+1)=(2,3,5): 1 - 2*(4+9+20)/((4+9+16)+(4+9+25)) = 1 - 66/67
    assert!((calc_diff(&x, &y) - (1.0 - 66.0 / 67.0)).abs() < 1e-15);
    let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f64(v)).collect();
    assert_eq!(calc_diff(&b, &x), 0.0);
}

#[test]
fn bounded_check_reports_location() {
    let mut b = Bounded::<f32>::new(2);
    for i in 0..4 {
        b.push(i as f32, i as f64, 0.25);
    }
    assert!(b.check("w", &[0.0, 1.2, 2.0, 3.0]).is_ok());
    let e = b.check("w", &[0.0, 1.0, 2.0, 3.5]).unwrap_err();
    assert!(e.contains("row 1, column 1") && e.contains("bound"), "{e}");
    assert!(b.check_bit_exact("w", &[0.0, 1.0, 2.0, 3.0]).is_ok());
}

#[test]
fn per_rank_variants_equal_the_full_computation() {
    for seed in [0u64, 5, 7] {
        let c = case(seed);
        let all = dispatch(&c.inputs, c.e, c.align).unwrap();
        for (d, want) in all.iter().enumerate() {
            assert_eq!(&deepep_kernels::reference::dispatch_rank(&c.inputs, c.e, c.align, d).unwrap(), want);
        }
        assert!(deepep_kernels::reference::dispatch_rank(&c.inputs, c.e, c.align, c.r).is_err());
        if c.fp8 {
            continue;
        }
        let y: Vec<Vec<bf16>> = all.iter().enumerate().map(|(d, o)| random::combine_rows(seed, d, 21, o.num_recv_tokens, c.h)).collect();
        let args = CombineArgs { y: &y, topk_weights: None, bias0: None, bias1: None };
        let full = combine(&all, &c.inputs, args).unwrap();
        let full_inter = combine_internode(&all, &c.inputs, args, 2).unwrap();
        for s in 0..c.r {
            let one = deepep_kernels::reference::combine_rank(&all, &c.inputs, args, s).unwrap();
            assert_eq!(one.combined_x, full[s].combined_x);
            let one = deepep_kernels::reference::combine_internode_rank(&all, &c.inputs, args, 2, s).unwrap();
            assert_eq!(one.combined_x, full_inter[s].combined_x);
        }
    }
}

/// Soundness of the summation bound under stress: terms with wide exponent ranges and
/// cancellation, summed in many orders (sequential permutations and pairwise trees), f32
/// accumulation then one bf16 rounding, must always land within `bf16_sum_bound`; and the bound
/// stays within a couple of bf16 ulps of the result when there is no cancellation.
#[test]
fn summation_bound_is_sound_under_reordering() {
    use deepep_kernels::reference::numeric::bf16_sum_bound;
    let mut rng = random::rng(2024, 0, 5);
    for _ in 0..20_000 {
        let n = rng.random_range(1..=10usize);
        let same_sign = rng.random::<bool>();
        let terms: Vec<f32> = (0..n)
            .map(|_| {
                let m = 1.0 + rng.random::<f32>();
                let e = rng.random_range(-12..=12);
                let s = if same_sign || rng.random::<bool>() { 1.0 } else { -1.0 };
                bf16_rn(s * m * 2f32.powi(e)).to_f32()
            })
            .collect();
        let exact: f64 = terms.iter().map(|&v| v as f64).sum();
        let abs: f64 = terms.iter().map(|&v| (v as f64).abs()).sum();
        let bound = bf16_sum_bound(exact, abs, n - 1);
        let mut order: Vec<usize> = (0..n).collect();
        for _ in 0..6 {
            order.shuffle(&mut rng);
            let seq = bf16_rn(order.iter().fold(0f32, |a, &i| a + terms[i]));
            assert!((seq.to_f64() - exact).abs() <= bound, "terms {terms:?} order {order:?}: {seq} vs {exact} (bound {bound:e})");
            // pairwise tree over the shuffled order
            let mut level: Vec<f32> = order.iter().map(|&i| terms[i]).collect();
            while level.len() > 1 {
                level = level.chunks(2).map(|c| c.iter().sum()).collect();
            }
            let tree = bf16_rn(level[0]);
            assert!((tree.to_f64() - exact).abs() <= bound, "tree: {tree} vs {exact}");
        }
        if same_sign {
            assert!(bound <= 1.01 * ulp_bf16(exact), "bound {bound:e} vs ulp {:e}", ulp_bf16(exact));
        }
    }
}

#[test]
fn ll_packed_checker_counts_duplicate_selections() {
    // A token that selects one expert twice holds two slots of that expert's block (one copy per
    // selection, as DeepEP sends); the checker must accept that and catch a slot given to another
    // token instead.
    let mut checked = 0;
    for seed in 0..24u64 {
        let mut c = ll_case(seed);
        if c.k < 2 {
            continue;
        }
        random::add_duplicate_experts(&mut c.inputs);
        let outs = ll_dispatch(&c.inputs, c.e, c.num_max, c.opts, c.mask.as_deref()).unwrap();
        let rm = c.r * c.num_max;
        for (d, o) in outs.iter().enumerate() {
            let f = fake_gpu_ll(&c, o, seed * 7 + d as u64);
            view(&c, &f).check(o).unwrap_or_else(|e| panic!("seed {seed} dest {d}: {e}"));
            // An expert and source whose block holds a token twice and another token once.
            for (le, ex) in o.experts.iter().enumerate() {
                let mut per: HashMap<(usize, usize), usize> = HashMap::new();
                for en in &ex.entries {
                    *per.entry((en.src_rank, en.src_token)).or_insert(0) += 1;
                }
                let Some((&(s, twice), _)) = per.iter().find(|(_, &n)| n == 2) else { continue };
                let Some((&(_, once), _)) = per.iter().find(|(&(s2, _), &n)| s2 == s && n == 1) else { continue };
                let v = f.layout_range[le * c.r + s];
                let (begin, cnt) = ((v >> 32) as usize, (v & 0xffff_ffff) as usize);
                let slot = (begin..begin + cnt).find(|&sl| f.src_info[le * rm + sl] == twice as i32).unwrap();
                let mut g = FakeLl { x: f.x.clone(), scales_f32: f.scales_f32.clone(), scales_ue8m0: f.scales_ue8m0.clone(), count: f.count.clone(), src_info: f.src_info.clone(), layout_range: f.layout_range.clone() };
                g.src_info[le * rm + slot] = once as i32;
                let e = view(&c, &g).check(o).expect_err("a duplicate's slot given to another token");
                assert!(e.contains("slot(s)") || e.contains("x differs"), "seed {seed}: {e}");
                checked += 1;
                break;
            }
        }
    }
    assert!(checked > 0, "no case had a duplicate selection next to a single one");
}
