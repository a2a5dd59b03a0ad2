//! Normal-mode dispatch and combine (§7). Intranode and internode dispatch produce identical
//! outputs; combine differs in where bf16 rounding happens.

use super::compare::Bounded;
use super::layout::{layout, rank_prefix, Layout};
use super::numeric::{bf16_rn, bf16_sum_bound, f32_sum_bound, ulp_bf16};
use super::{Payload, RankInput};
use crate::validate;
use crate::Result;
use half::bf16;

/// What destination rank `d` receives from a normal dispatch.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchOut {
    /// `M`: received rows.
    pub num_recv_tokens: usize,
    /// `[M, H]` bit copies of the source rows (FP8 with `[M, H/128]` row-major scales).
    pub recv_x: Payload,
    /// `[M, K]`: local expert id (`global − d·L`) where the global id lives on `d`, else `-1`.
    pub recv_topk_idx: Vec<i64>,
    /// `[M, K]`: the source weight where `recv_topk_idx >= 0`, else `0.0`.
    pub recv_topk_weights: Vec<f32>,
    /// `[M]`: source rank of each row (rows are ordered by source rank, then source position).
    pub recv_src_rank: Vec<i32>,
    /// `[M]`: position of each row in its source rank's `x`.
    pub recv_src_idx: Vec<i32>,
    /// `[L]`: received selections per local expert, aligned up to `expert_alignment`.
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// `[R]`: `rank_prefix_matrix` column of this rank (inclusive prefix over sources).
    pub rank_prefix: Vec<i32>,
}

/// Consistency checks shared by dispatch and combine; returns the per-rank layouts.
fn check_inputs(inputs: &[RankInput], num_experts: usize) -> Result<Vec<Layout>> {
    let r = inputs.len();
    validate::experts(num_experts, r)?;
    let Some(first) = inputs.first() else {
        return Err(crate::EpError::InvalidArgument("no rank inputs given; pass one RankInput per rank".into()));
    };
    for (s, inp) in inputs.iter().enumerate() {
        if inp.hidden != first.hidden || inp.k != first.k || inp.x.is_fp8() != first.x.is_fp8() {
            return Err(crate::EpError::InvalidArgument(format!(
                "rank {s} has hidden {} / top-k {} / fp8 {} but rank 0 has hidden {} / top-k {} / fp8 {}; all ranks must use the same hidden size, top-k and dtype",
                inp.hidden, inp.k, inp.x.is_fp8(), first.hidden, first.k, first.x.is_fp8()
            )));
        }
        inp.validate(num_experts, validate::MAX_TOPK_NORMAL)?;
    }
    inputs.iter().map(|i| layout(&i.topk_idx, i.n, i.k, num_experts, r)).collect()
}

/// Normal dispatch (intranode and internode alike): one [`DispatchOut`] per destination rank.
pub fn dispatch(inputs: &[RankInput], num_experts: usize, expert_alignment: usize) -> Result<Vec<DispatchOut>> {
    dispatch_to(inputs, num_experts, expert_alignment, 0..inputs.len())
}

/// [`dispatch`] for destination rank `d` only.
pub fn dispatch_rank(inputs: &[RankInput], num_experts: usize, expert_alignment: usize, d: usize) -> Result<DispatchOut> {
    if d >= inputs.len() {
        return Err(crate::EpError::InvalidArgument(format!("destination rank {d} but only {} rank inputs; pass a rank below {}", inputs.len(), inputs.len())));
    }
    Ok(dispatch_to(inputs, num_experts, expert_alignment, d..d + 1)?.remove(0))
}

fn dispatch_to(inputs: &[RankInput], num_experts: usize, expert_alignment: usize, dests: std::ops::Range<usize>) -> Result<Vec<DispatchOut>> {
    validate::expert_alignment(expert_alignment)?;
    let layouts = check_inputs(inputs, num_experts)?;
    let r = inputs.len();
    let l = num_experts / r;
    let (h, k) = (inputs[0].hidden, inputs[0].k);
    let mut outs = Vec::with_capacity(dests.len());
    for d in dests {
        let lo = (d * l) as i64;
        let hi = lo + l as i64;
        let mut o = DispatchOut {
            num_recv_tokens: 0,
            recv_x: inputs[0].x.empty_like(),
            recv_topk_idx: Vec::new(),
            recv_topk_weights: Vec::new(),
            recv_src_rank: Vec::new(),
            recv_src_idx: Vec::new(),
            num_recv_tokens_per_expert: Vec::new(),
            rank_prefix: rank_prefix(&layouts, d),
        };
        for (s, inp) in inputs.iter().enumerate() {
            for t in (0..inp.n).filter(|&t| layouts[s].in_rank(t, d)) {
                o.recv_x.push_row_from(&inp.x, t, h);
                for j in 0..k {
                    let e = inp.topk_idx[t * k + j];
                    let local = (lo..hi).contains(&e);
                    o.recv_topk_idx.push(if local { e - lo } else { -1 });
                    o.recv_topk_weights.push(if local { inp.topk_weights[t * k + j] } else { 0.0 });
                }
                o.recv_src_rank.push(s as i32);
                o.recv_src_idx.push(t as i32);
            }
        }
        o.num_recv_tokens = o.recv_src_idx.len();
        o.num_recv_tokens_per_expert = (0..l)
            .map(|e| {
                let c: i32 = layouts.iter().map(|lay| lay.num_tokens_per_expert[d * l + e]).sum();
                (c as usize).div_ceil(expert_alignment) * expert_alignment
            })
            .collect();
        outs.push(o);
    }
    Ok(outs)
}

/// Expected combine output of one origin rank.
#[derive(Debug, Clone)]
pub struct CombineOut {
    /// `[N, H]` bf16: value in the contract's summation order, exact f64 sum, and the bound.
    pub combined_x: Bounded<bf16>,
    /// `[N, K]` f32, when combine weights were given.
    pub combined_topk_weights: Option<Bounded<f32>>,
}

/// Inputs of a normal combine, all indexed by rank.
#[derive(Debug, Clone, Copy)]
pub struct CombineArgs<'a> {
    /// Per destination rank `d`: `[M_d, H]` rows aligned with `dispatch[d]`'s received rows.
    pub y: &'a [Vec<bf16>],
    /// Per destination rank `d`: optional `[M_d, K]` weights (usually `recv_topk_weights`).
    pub topk_weights: Option<&'a [Vec<f32>]>,
    /// Per origin rank `s`: optional biases `[N_s, H]`.
    pub bias0: Option<&'a [Vec<bf16>]>,
    pub bias1: Option<&'a [Vec<bf16>]>,
}

/// How the f32 partial sums are grouped before bf16 rounding.
#[derive(Clone, Copy)]
enum Grouping {
    /// One f32 sum: biases, then ranks ascending.
    Flat,
    /// Per node of `ranks_per_node` ranks: f32 sum rounded to bf16; then biases + node partials.
    Nodes(usize),
}

/// Intranode combine (§7) for every origin rank:
/// `out[t] = bf16(f32(b0) + f32(b1) + Σ_{d asc} f32(y_d[pos_d]))`,
/// `combined_topk_weights[t, k] = Σ_{d asc} w_d[pos_d, k]`.
pub fn combine(dispatch: &[DispatchOut], inputs: &[RankInput], args: CombineArgs<'_>) -> Result<Vec<CombineOut>> {
    (0..inputs.len()).map(|s| combine_rank(dispatch, inputs, args, s)).collect()
}

/// [`combine`] for origin rank `s` only (what a GPU test rank needs; saves memory at large shapes).
pub fn combine_rank(dispatch: &[DispatchOut], inputs: &[RankInput], args: CombineArgs<'_>, s: usize) -> Result<CombineOut> {
    combine_impl(dispatch, inputs, args, Grouping::Flat, s)
}

/// Internode combine (§7) for every origin rank: per node of `ranks_per_node` ranks an f32 sum
/// rounded to bf16, then `bf16(f32(b0) + f32(b1) + Σ_{node asc} f32(partial))`. Weights as in
/// [`combine`].
pub fn combine_internode(dispatch: &[DispatchOut], inputs: &[RankInput], args: CombineArgs<'_>, ranks_per_node: usize) -> Result<Vec<CombineOut>> {
    (0..inputs.len()).map(|s| combine_internode_rank(dispatch, inputs, args, ranks_per_node, s)).collect()
}

/// [`combine_internode`] for origin rank `s` only.
pub fn combine_internode_rank(dispatch: &[DispatchOut], inputs: &[RankInput], args: CombineArgs<'_>, ranks_per_node: usize, s: usize) -> Result<CombineOut> {
    validate::internode_ranks(inputs.len(), ranks_per_node)?;
    combine_impl(dispatch, inputs, args, Grouping::Nodes(ranks_per_node), s)
}

fn shape_err(what: &str, rank: usize, got: usize, want: usize) -> crate::EpError {
    crate::EpError::InvalidArgument(format!(
        "combine: {what} of rank {rank} has {got} elements, expected {want}; pass one buffer per rank shaped like that rank's dispatch output / input"
    ))
}

fn combine_impl(dispatch: &[DispatchOut], inputs: &[RankInput], args: CombineArgs<'_>, grouping: Grouping, s: usize) -> Result<CombineOut> {
    let r = inputs.len();
    if dispatch.len() != r || args.y.len() != r || s >= r {
        return Err(crate::EpError::InvalidArgument(format!(
            "combine: {} dispatch outputs and {} y buffers for {r} ranks (origin rank {s}); pass exactly one of each per rank and an origin rank below {r}",
            dispatch.len(),
            args.y.len()
        )));
    }
    let (h, k) = (inputs[0].hidden, inputs[0].k);
    for d in 0..r {
        let m = dispatch[d].num_recv_tokens;
        if args.y[d].len() != m * h {
            return Err(shape_err("y", d, args.y[d].len(), m * h));
        }
        if let Some(w) = args.topk_weights {
            if w.len() != r || w[d].len() != m * k {
                return Err(shape_err("topk_weights", d, w.get(d).map_or(0, Vec::len), m * k));
            }
        }
    }
    let n = inputs[s].n;
    let biases: Vec<&[bf16]> = [args.bias0, args.bias1].into_iter().flatten().map(|b| b.get(s).map_or(&[][..], |v| v.as_slice())).collect();
    if let Some(b) = biases.iter().find(|b| b.len() != n * h) {
        return Err(shape_err("bias", s, b.len(), n * h));
    }
    // pos[d][t] = row of (s, t) in d's received list.
    let mut pos: Vec<Vec<Option<usize>>> = vec![vec![None; n]; r];
    for (d, o) in dispatch.iter().enumerate() {
        for i in (0..o.num_recv_tokens).filter(|&i| o.recv_src_rank[i] as usize == s) {
            pos[d][o.recv_src_idx[i] as usize] = Some(i);
        }
    }
    let mut x = Bounded::with_capacity(h, n * h);
    let mut wts = args.topk_weights.map(|_| Bounded::with_capacity(k, n * k));
    let mut holders: Vec<(usize, usize)> = Vec::with_capacity(r);
    let mut terms: Vec<(usize, f32)> = Vec::with_capacity(r);
    let mut bias_terms: Vec<f32> = Vec::with_capacity(2);
    let mut nodes: Vec<NodePartial> = Vec::with_capacity(r);
    for t in 0..n {
        holders.clear();
        holders.extend((0..r).filter_map(|d| pos[d][t].map(|p| (d, p))));
        for c in 0..h {
            terms.clear();
            terms.extend(holders.iter().map(|&(d, p)| (d, args.y[d][p * h + c].to_f32())));
            bias_terms.clear();
            bias_terms.extend(biases.iter().map(|b| b[t * h + c].to_f32()));
            let (v, exact, bound) = match grouping {
                Grouping::Flat => flat_sum(&bias_terms, terms.iter().map(|&(_, v)| v)),
                Grouping::Nodes(p) => node_sum(&bias_terms, &terms, p, &mut nodes),
            };
            x.push(v, exact, bound);
        }
        if let (Some(w), Some(out)) = (args.topk_weights, wts.as_mut()) {
            for j in 0..k {
                let mut acc = 0f32;
                let (mut exact, mut abs) = (0f64, 0f64);
                for &(d, p) in &holders {
                    let v = w[d][p * k + j];
                    acc += v;
                    exact += f64::from(v);
                    abs += f64::from(v).abs();
                }
                out.push(acc, exact, f32_sum_bound(abs, holders.len().saturating_sub(1)));
            }
        }
    }
    Ok(CombineOut { combined_x: x, combined_topk_weights: wts })
}

/// `bf16(b0 + b1 + Σ terms)` in f32, left to right; with the exact sum and its bound.
fn flat_sum(bias: &[f32], terms: impl Iterator<Item = f32>) -> (bf16, f64, f64) {
    let (mut acc, mut exact, mut abs, mut count) = (0f32, 0f64, 0f64, 0usize);
    for v in bias.iter().copied().chain(terms) {
        acc += v;
        exact += f64::from(v);
        abs += f64::from(v).abs();
        count += 1;
    }
    (bf16_rn(acc), exact, bf16_sum_bound(exact, abs, count.saturating_sub(1)))
}

/// Running f32 sum of the ranks of one node.
struct NodePartial {
    node: usize,
    acc: f32,
    exact: f64,
    abs: f64,
    count: usize,
}

/// Two-stage internode sum (see [`combine_internode`]) with a bound that covers any f32
/// summation order inside each stage and the intermediate bf16 rounding of each node partial.
/// `terms` are `(rank, value)` in ascending rank order; `nodes` is scratch space.
fn node_sum(bias: &[f32], terms: &[(usize, f32)], ranks_per_node: usize, nodes: &mut Vec<NodePartial>) -> (bf16, f64, f64) {
    nodes.clear();
    for &(d, v) in terms {
        let node = d / ranks_per_node;
        if nodes.last().map(|n| n.node) != Some(node) {
            nodes.push(NodePartial { node, acc: 0.0, exact: 0.0, abs: 0.0, count: 0 });
        }
        let n = nodes.last_mut().expect("pushed above");
        n.acc += v;
        n.exact += f64::from(v);
        n.abs += f64::from(v).abs();
        n.count += 1;
    }
    let (mut acc, mut exact, mut outer_abs, mut inner_err) = (0f32, 0f64, 0f64, 0f64);
    for &b in bias {
        acc += b;
        exact += f64::from(b);
        outer_abs += f64::from(b).abs();
    }
    for p in nodes.iter() {
        // A single bf16 term survives the bf16 rounding exactly.
        let err = if p.count <= 1 { 0.0 } else { bf16_sum_bound(p.exact, p.abs, p.count - 1) };
        inner_err += err;
        acc += bf16_rn(p.acc).to_f32();
        exact += p.exact;
        outer_abs += p.exact.abs() + err;
    }
    let outer_ops = (bias.len() + nodes.len()).saturating_sub(1);
    let f32_err = f32_sum_bound(outer_abs, outer_ops);
    let bound = inner_err + f32_err + 0.5 * ulp_bf16(exact.abs() + inner_err + f32_err);
    (bf16_rn(acc), exact, bound)
}
