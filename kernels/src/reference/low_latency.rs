//! Low-latency (LL) dispatch and combine (§7 "LL dispatch", "LL combine").
//!
//! LL dispatch sends every `(t, k)` selection separately (no per-rank dedup, `-1` not sent) into
//! a packed per-local-expert output `[L, R·num_max, H]`. Each source rank owns one contiguous slot
//! block per local expert, but block order and order inside a block are nondeterministic, so the
//! reference is a multiset per (local expert, source rank), and [`LlPacked::check`] verifies a
//! GPU result against it: counts, `layout_range`, block contiguity, `src_info`, payload bytes and
//! scales.

use super::compare::{Bounded, CheckResult};
use super::fp8::{quantize_rows, ue8m0_byte, GROUP, UE8M0_PER_I32};
use super::normal::CombineOut;
use super::numeric::{bf16_rn, bf16_sum_bound, bf16_to_bytes};
use super::{Payload, RankInput};
use crate::{validate, EpError, Result};
use half::bf16;
use std::collections::HashMap;

/// LL dispatch payload options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LlOptions {
    /// Cast to FP8 e4m3 with per-128-channel scales (else the bf16 rows are copied).
    pub use_fp8: bool,
    /// Power-of-two scales (see [`super::fp8`]).
    pub round_scale: bool,
    /// Scales as UE8M0 bytes packed four per int32 (requires `round_scale`).
    pub use_ue8m0: bool,
}

impl LlOptions {
    pub const BF16: LlOptions = LlOptions { use_fp8: false, round_scale: false, use_ue8m0: false };
    pub const FP8: LlOptions = LlOptions { use_fp8: true, round_scale: false, use_ue8m0: false };
    /// Bytes of one packed row: `H` (FP8) or `2H` (bf16).
    pub fn row_bytes(&self, hidden: usize) -> usize {
        if self.use_fp8 { hidden } else { 2 * hidden }
    }
}

/// Scales of one received row.
#[derive(Debug, Clone, PartialEq)]
pub enum LlRowScales {
    None,
    /// `[H/128]` f32 `scale_inv`.
    F32(Vec<f32>),
    /// `[H/128]` UE8M0 bytes.
    Ue8m0(Vec<u8>),
}

/// One received selection.
#[derive(Debug, Clone, PartialEq)]
pub struct LlEntry {
    pub src_rank: usize,
    /// Position of the token in its source rank's `x` (what `src_info` holds).
    pub src_token: usize,
    /// The packed row as bytes (e4m3 bytes, or bf16 little-endian).
    pub x: Vec<u8>,
    pub scales: LlRowScales,
}

/// What one local expert receives.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LlExpertRecv {
    /// `[R]`: selections received from each source rank (0 for masked sources).
    pub per_source: Vec<usize>,
    /// All selections, ordered by (source rank, source token) — the GPU order is arbitrary.
    pub entries: Vec<LlEntry>,
}

impl LlExpertRecv {
    pub fn count(&self) -> usize {
        self.entries.len()
    }
}

/// What one rank receives from an LL dispatch.
#[derive(Debug, Clone, PartialEq)]
pub struct LlDispatchOut {
    /// `[L]`.
    pub experts: Vec<LlExpertRecv>,
}

impl LlDispatchOut {
    /// Expected `packed_recv_count` `[L]`.
    pub fn packed_recv_count(&self) -> Vec<i32> {
        self.experts.iter().map(|e| e.count() as i32).collect()
    }
}

fn is_masked(mask: Option<&[bool]>, r: usize) -> bool {
    mask.is_some_and(|m| m.get(r).copied().unwrap_or(false))
}

/// Shared input checks of LL dispatch/combine.
fn check_ll_inputs(inputs: &[RankInput], num_experts: usize, mask: Option<&[bool]>) -> Result<()> {
    let r = inputs.len();
    validate::low_latency_ranks(r, num_experts)?;
    if let Some(m) = mask {
        if m.len() != r {
            return Err(EpError::InvalidArgument(format!("LL mask has {} entries for {r} ranks; pass one flag per rank (true = masked)", m.len())));
        }
    }
    for (s, inp) in inputs.iter().enumerate() {
        if inp.hidden != inputs[0].hidden || inp.k != inputs[0].k {
            return Err(EpError::InvalidArgument(format!(
                "rank {s} has hidden {} / top-k {} but rank 0 has {} / {}; all ranks must use the same hidden size and top-k",
                inp.hidden, inp.k, inputs[0].hidden, inputs[0].k
            )));
        }
        if inp.x.is_fp8() {
            return Err(EpError::InvalidArgument(format!("rank {s}: LL inputs must be bf16 (the FP8 cast is fused into LL dispatch); pass Payload::Bf16")));
        }
        inp.validate(num_experts, validate::MAX_TOPK_LOW_LATENCY)?;
    }
    Ok(())
}

/// LL dispatch reference: per destination rank, per local expert, the multiset of selections.
/// `mask[s] == true` marks source rank `s` as masked (it sends nothing). FP8 rows are cast once
/// per source token with [`super::fp8`]'s arithmetic and copied to every selected expert.
pub fn ll_dispatch(inputs: &[RankInput], num_experts: usize, num_max: usize, opts: LlOptions, mask: Option<&[bool]>) -> Result<Vec<LlDispatchOut>> {
    check_ll_inputs(inputs, num_experts, mask)?;
    let r = inputs.len();
    let l = num_experts / r;
    let h = inputs[0].hidden;
    validate::low_latency_num_max(num_max, r)?;
    validate::low_latency_hidden(h, opts.use_fp8, None)?;
    if opts.use_fp8 {
        validate::fp8_flags(opts.round_scale, opts.use_ue8m0)?;
    }
    let mut outs: Vec<LlDispatchOut> = (0..r)
        .map(|_| LlDispatchOut { experts: (0..l).map(|_| LlExpertRecv { per_source: vec![0; r], entries: Vec::new() }).collect() })
        .collect();
    for (s, inp) in inputs.iter().enumerate() {
        validate::tokens_within(inp.n, num_max, "LL dispatch")?;
        if is_masked(mask, s) {
            continue;
        }
        let Payload::Bf16(x) = &inp.x else { unreachable!("checked above") };
        let q = opts.use_fp8.then(|| quantize_rows(x, inp.n, h, opts.round_scale));
        let g = h / GROUP;
        for t in 0..inp.n {
            let (row, scales) = match &q {
                None => (bf16_to_bytes(&x[t * h..(t + 1) * h]), LlRowScales::None),
                Some(q) => {
                    let si = &q.scale_inv[t * g..(t + 1) * g];
                    let sc = if opts.use_ue8m0 { LlRowScales::Ue8m0(si.iter().map(|&v| ue8m0_byte(v)).collect()) } else { LlRowScales::F32(si.to_vec()) };
                    (q.data[t * h..(t + 1) * h].to_vec(), sc)
                }
            };
            for &e in &inp.topk_idx[t * inp.k..(t + 1) * inp.k] {
                if e < 0 {
                    continue;
                }
                let (owner, le) = (e as usize / l, e as usize % l);
                let exp = &mut outs[owner].experts[le];
                exp.per_source[s] += 1;
                exp.entries.push(LlEntry { src_rank: s, src_token: t, x: row.clone(), scales: scales.clone() });
            }
        }
    }
    Ok(outs)
}

/// GPU scales of a packed LL output.
#[derive(Debug, Clone, Copy)]
pub enum LlScalesView<'a> {
    None,
    /// Physical `[L, H/128, R·num_max]` f32 (the column-major view `[L, R·num_max, H/128]`).
    F32(&'a [f32]),
    /// Physical `[L, H/512, R·num_max]` int32, four UE8M0 bytes each, lowest group in the lowest byte.
    Ue8m0(&'a [i32]),
}

/// A GPU LL dispatch result of one rank, downloaded to the host.
#[derive(Debug, Clone, Copy)]
pub struct LlPacked<'a> {
    pub num_ranks: usize,
    pub num_local_experts: usize,
    pub num_max: usize,
    pub hidden: usize,
    pub opts: LlOptions,
    /// `packed_recv_x` `[L, R·num_max, row_bytes]` as bytes (e4m3, or bf16 little-endian).
    pub x: &'a [u8],
    pub scales: LlScalesView<'a>,
    /// `packed_recv_count` `[L]`.
    pub count: &'a [i32],
    /// `packed_recv_src_info` `[L, R·num_max]`.
    pub src_info: &'a [i32],
    /// `packed_recv_layout_range` `[L, R]`: `(begin << 32) | count`.
    pub layout_range: &'a [i64],
}

/// Slot lookup of a checked LL layout: `(local expert, src rank, src token) -> slot`.
#[derive(Debug, Clone)]
pub struct LlSlotMap {
    /// `[L][R]`: `(begin, count)` of each source's block.
    pub blocks: Vec<Vec<(usize, usize)>>,
    /// Slots of each `(local expert, src rank, src token)`: one per selection, so a token that
    /// selects one expert twice in its top-k holds two slots (DeepEP sends one copy per selection).
    map: HashMap<(usize, usize, usize), Vec<usize>>,
}

impl LlSlotMap {
    /// First slot of `(le, src_rank, src_token)`, if received.
    pub fn slot(&self, le: usize, src_rank: usize, src_token: usize) -> Option<usize> {
        self.slots_of(le, src_rank, src_token).first().copied()
    }
    /// Every slot of `(le, src_rank, src_token)`, ascending (empty if not received).
    pub fn slots_of(&self, le: usize, src_rank: usize, src_token: usize) -> &[usize] {
        self.map.get(&(le, src_rank, src_token)).map_or(&[], |v| v.as_slice())
    }
}

fn len_check(what: &str, got: usize, want: usize) -> CheckResult {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: {got} elements but the layout needs {want}"))
    }
}

impl LlPacked<'_> {
    fn slots_per_expert(&self) -> usize {
        self.num_ranks * self.num_max
    }

    /// Check the layout metadata for internal consistency and build the slot map: every
    /// `count[le]` within capacity, each source block `[begin, begin+cnt)` inside `[0, count[le])`,
    /// blocks disjoint and together covering `[0, count[le])`. A token may hold several slots of
    /// one block (one per selection of that expert); [`LlPacked::check`] counts them.
    #[allow(clippy::needless_range_loop)] // indices are the layout coordinates named in errors
    pub fn slots(&self) -> std::result::Result<LlSlotMap, String> {
        let (l, r, rm) = (self.num_local_experts, self.num_ranks, self.slots_per_expert());
        len_check("packed_recv_count", self.count.len(), l)?;
        len_check("packed_recv_src_info", self.src_info.len(), l * rm)?;
        len_check("packed_recv_layout_range", self.layout_range.len(), l * r)?;
        let mut blocks = vec![vec![(0usize, 0usize); r]; l];
        let mut map = HashMap::new();
        for le in 0..l {
            let count = self.count[le];
            if count < 0 || count as usize > rm {
                return Err(format!("local expert {le}: packed_recv_count {count} outside [0, {rm}] (R·num_max)"));
            }
            let count = count as usize;
            let mut owner = vec![usize::MAX; count];
            let mut total = 0usize;
            for s in 0..r {
                let v = self.layout_range[le * r + s];
                let (begin, cnt) = ((v >> 32) as usize, (v & 0xffff_ffff) as usize);
                if cnt == 0 {
                    continue;
                }
                if begin + cnt > count {
                    return Err(format!("local expert {le}, source rank {s}: layout_range block [{begin}, {}) exceeds packed_recv_count {count}", begin + cnt));
                }
                for slot in begin..begin + cnt {
                    if owner[slot] != usize::MAX {
                        return Err(format!("local expert {le}: slot {slot} claimed by source ranks {} and {s} (overlapping layout_range blocks)", owner[slot]));
                    }
                    owner[slot] = s;
                    let t = self.src_info[le * rm + slot];
                    if t < 0 {
                        return Err(format!("local expert {le}, source rank {s}, slot {slot}: negative src_info {t}"));
                    }
                    map.entry((le, s, t as usize)).or_insert_with(Vec::new).push(slot);
                }
                blocks[le][s] = (begin, cnt);
                total += cnt;
            }
            if total != count {
                return Err(format!("local expert {le}: layout_range blocks hold {total} slots but packed_recv_count is {count}"));
            }
        }
        Ok(LlSlotMap { blocks, map })
    }

    /// Full check of this rank's GPU output against the reference `expected` (see module docs).
    pub fn check(&self, expected: &LlDispatchOut) -> CheckResult {
        let (l, r, rm, h) = (self.num_local_experts, self.num_ranks, self.slots_per_expert(), self.hidden);
        let rb = self.opts.row_bytes(h);
        let g = h / GROUP;
        len_check("packed_recv_x (bytes)", self.x.len(), l * rm * rb)?;
        match self.scales {
            LlScalesView::None => {}
            LlScalesView::F32(s) => len_check("packed_recv_x_scales (f32)", s.len(), l * g * rm)?,
            LlScalesView::Ue8m0(s) => len_check("packed_recv_x_scales (ue8m0 int32)", s.len(), l * (g / UE8M0_PER_I32) * rm)?,
        }
        if expected.experts.len() != l {
            return Err(format!("reference has {} local experts, GPU layout {l}", expected.experts.len()));
        }
        let want_counts = expected.packed_recv_count();
        super::compare::bit_exact("packed_recv_count", self.count, &want_counts, l)?;
        let slots = self.slots()?;
        for (le, exp) in expected.experts.iter().enumerate() {
            for s in 0..r {
                let got = slots.blocks[le][s].1;
                if got != exp.per_source[s] {
                    return Err(format!("local expert {le}: layout_range count from source rank {s} is {got}, expected {}", exp.per_source[s]));
                }
            }
            // The i-th selection of (source, token) for this expert takes the token's i-th slot.
            let mut used: HashMap<(usize, usize), usize> = HashMap::new();
            for en in &exp.entries {
                let nth = used.entry((en.src_rank, en.src_token)).or_insert(0);
                let all = slots.slots_of(le, en.src_rank, en.src_token);
                let Some(&slot) = all.get(*nth) else {
                    return Err(format!(
                        "local expert {le}: token {} of source rank {} holds {} slot(s) in its block (src_info) but selects this expert {} time(s)",
                        en.src_token,
                        en.src_rank,
                        all.len(),
                        exp.entries.iter().filter(|e| e.src_rank == en.src_rank && e.src_token == en.src_token).count()
                    ));
                };
                *nth += 1;
                let base = (le * rm + slot) * rb;
                let got = &self.x[base..base + rb];
                if got != en.x.as_slice() {
                    let i = got.iter().zip(&en.x).position(|(a, b)| a != b).unwrap_or(0);
                    let esz = if self.opts.use_fp8 { 1 } else { 2 };
                    let c = i / esz;
                    return Err(format!(
                        "local expert {le}, source rank {}, token {} (slot {slot}): x differs first at column {c}: got bytes {:02x?}, expected {:02x?}",
                        en.src_rank,
                        en.src_token,
                        &got[c * esz..(c + 1) * esz],
                        &en.x[c * esz..(c + 1) * esz]
                    ));
                }
                for gi in 0..g {
                    let (got_bits, want_bits) = match (&self.scales, &en.scales) {
                        (LlScalesView::F32(s), LlRowScales::F32(w)) => (u64::from(s[(le * g + gi) * rm + slot].to_bits()), u64::from(w[gi].to_bits())),
                        (LlScalesView::Ue8m0(s), LlRowScales::Ue8m0(w)) => {
                            let word = s[(le * (g / UE8M0_PER_I32) + gi / UE8M0_PER_I32) * rm + slot];
                            (u64::from(word.to_le_bytes()[gi % UE8M0_PER_I32]), u64::from(w[gi]))
                        }
                        (LlScalesView::None, LlRowScales::None) => break,
                        _ => return Err("scales: GPU scale format does not match the reference options (f32 / ue8m0 / none)".into()),
                    };
                    if got_bits != want_bits {
                        return Err(format!(
                            "local expert {le}, source rank {}, token {} (slot {slot}): scale of group {gi} has bits {got_bits:#x}, expected {want_bits:#x}",
                            en.src_rank, en.src_token
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// LL combine reference (§7): for each origin rank `s` and token `t`,
/// `out[t] = bf16(Σ_{k asc, topk_idx[t,k] >= 0, owner unmasked} w[t,k] · f32(y))` accumulated in
/// f32 from 0 with one fused multiply-add per term (what nvcc emits for `acc += y * w`), where
/// `y = rows(owner, local_expert, s, t)` is the combine input row of that selection on its owner.
/// The bound covers any order and separate multiply + add roundings (2 f32 ops per term).
/// `mask[r] == true` marks rank `r` as masked: its experts contribute nothing, and its own output
/// has no expectation (an empty [`Bounded`]; skip it when comparing).
pub fn ll_combine<'a, F>(inputs: &[RankInput], num_experts: usize, mask: Option<&[bool]>, rows: F) -> Result<Vec<CombineOut>>
where
    F: Fn(usize, usize, usize, usize) -> Option<&'a [bf16]>,
{
    (0..inputs.len()).map(|s| ll_combine_rank(inputs, num_experts, mask, s, &rows)).collect()
}

/// [`ll_combine`] for origin rank `s` only.
pub fn ll_combine_rank<'a, F>(inputs: &[RankInput], num_experts: usize, mask: Option<&[bool]>, s: usize, rows: F) -> Result<CombineOut>
where
    F: Fn(usize, usize, usize, usize) -> Option<&'a [bf16]>,
{
    check_ll_inputs(inputs, num_experts, mask)?;
    let Some(inp) = inputs.get(s) else {
        return Err(EpError::InvalidArgument(format!("origin rank {s} but only {} rank inputs; pass a rank below {}", inputs.len(), inputs.len())));
    };
    let l = num_experts / inputs.len();
    let (h, k) = (inp.hidden, inp.k);
    let mut x = Bounded::with_capacity(h, if is_masked(mask, s) { 0 } else { inp.n * h });
    if is_masked(mask, s) {
        // A masked origin rank is considered dead: its output is not checked.
        return Ok(CombineOut { combined_x: x, combined_topk_weights: None });
    }
    let mut terms: Vec<(f32, &[bf16])> = Vec::with_capacity(k);
    for t in 0..inp.n {
        terms.clear();
        for j in 0..k {
            let e = inp.topk_idx[t * k + j];
            if e < 0 || is_masked(mask, e as usize / l) {
                continue;
            }
            let (owner, le) = (e as usize / l, e as usize % l);
            let row = rows(owner, le, s, t).ok_or_else(|| {
                EpError::InvalidArgument(format!("LL combine: no input row for token {t} of rank {s} at expert {le} of rank {owner}; the rows callback must cover every dispatched selection"))
            })?;
            if row.len() != h {
                return Err(EpError::InvalidArgument(format!("LL combine: row for token {t} of rank {s} has {} values, expected hidden {h}", row.len())));
            }
            terms.push((inp.topk_weights[t * k + j], row));
        }
        for c in 0..h {
            let (mut acc, mut exact, mut abs) = (0f32, 0f64, 0f64);
            for &(w, row) in &terms {
                let y = row[c].to_f32();
                acc = y.mul_add(w, acc);
                let p = f64::from(y) * f64::from(w); // exact: 8 x 24 significant bits
                exact += p;
                abs += p.abs();
            }
            x.push(bf16_rn(acc), exact, bf16_sum_bound(exact, abs, 2 * terms.len()));
        }
    }
    Ok(CombineOut { combined_x: x, combined_topk_weights: None })
}

/// [`ll_combine`] with the rows taken from each owner's packed combine input `y[owner]`
/// (`[L, R·num_max, H]` bf16) through that owner's checked [`LlSlotMap`].
pub fn ll_combine_packed(inputs: &[RankInput], num_experts: usize, num_max: usize, mask: Option<&[bool]>, slot_maps: &[LlSlotMap], y: &[Vec<bf16>]) -> Result<Vec<CombineOut>> {
    let r = inputs.len();
    let h = inputs.first().map_or(0, |i| i.hidden);
    let rm = r * num_max;
    ll_combine(inputs, num_experts, mask, |owner, le, s, t| {
        let slot = slot_maps.get(owner)?.slot(le, s, t)?;
        y.get(owner)?.get((le * rm + slot) * h..(le * rm + slot + 1) * h)
    })
}
