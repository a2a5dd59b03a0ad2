//! Argument checks of the intranode API, run on the host before any launch. They work on plain
//! [`TensorInfo`] (shape, strides, dtype, address), so they are tested without a GPU
//! (`kernels/tests/intranode_validation.rs`). Every error names the problem and the fix.

use crate::config::{BufferLayout, Config, FP8_GROUP, MAX_LOCAL_EXPERTS, MAX_TOPK};
use crate::tensor::{DType, TensorInfo};
use crate::validate;
use crate::Result;

pub use crate::args::DispatchPlan;
use crate::args::bad;

/// `t` is a contiguous tensor of `dtype` and exactly `shape`, 16-byte aligned.
pub fn expect_tensor(what: &str, t: &TensorInfo, dtype: DType, shape: &[usize]) -> Result<()> {
    expect_layout(what, t, dtype, shape)?;
    aligned16(what, t)
}

/// `t` is a contiguous tensor of `dtype` and exactly `shape` (its alignment is the launch's
/// check: [`check_planned`], [`check_combine_planned`]).
fn expect_layout(what: &str, t: &TensorInfo, dtype: DType, shape: &[usize]) -> Result<()> {
    if t.dtype != dtype {
        return bad(format!("{what} has dtype {} but must be {}; convert it to {} first", t.dtype.name(), dtype.name(), dtype.name()));
    }
    if t.shape != shape {
        return bad(format!("{what} has shape {:?} but must be {shape:?}; pass a tensor of that shape", t.shape));
    }
    if !t.is_contiguous() {
        return bad(format!("{what} {:?} is not contiguous (strides {:?}); pass a contiguous row-major tensor (Tensor::to_owned copies one)", t.shape, t.strides));
    }
    Ok(())
}

fn aligned16(what: &str, t: &TensorInfo) -> Result<()> {
    if t.numel() > 0 && t.ptr % 16 != 0 {
        return bad(format!("{what} starts at {:#x}, which is not 16-byte aligned (the kernels move 16-byte words); pass a tensor whose data starts on a 16-byte boundary", t.ptr));
    }
    Ok(())
}

/// What [`check_layout`] found: tokens and top-k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutPlan {
    pub num_tokens: usize,
    pub num_topk: usize,
    pub num_experts: usize,
}

/// `dispatch_layout(topk_idx, num_experts)`: `topk_idx` i64 `[N, K]`, `1 <= K <= 32`, experts split
/// evenly over the ranks with at most 1024 per rank. Ids outside `[-1, E)` are caught on the GPU
/// (phase `layout`), since the ids live in device memory.
pub fn check_layout(topk_idx: &TensorInfo, num_experts: usize, num_ranks: usize) -> Result<LayoutPlan> {
    validate::intranode_ranks(num_ranks)?;
    validate::experts(num_experts, num_ranks)?;
    let l = num_experts / num_ranks;
    if l > MAX_LOCAL_EXPERTS {
        return bad(format!(
            "{num_experts} experts over {num_ranks} ranks = {l} local experts per rank, more than the {MAX_LOCAL_EXPERTS} the notify kernel supports; use at most {} experts",
            MAX_LOCAL_EXPERTS * num_ranks
        ));
    }
    if topk_idx.shape.len() != 2 {
        return bad(format!("topk_idx has shape {:?}; it must be 2-D [num_tokens, top_k]", topk_idx.shape));
    }
    let (n, k) = (topk_idx.shape[0], topk_idx.shape[1]);
    validate::num_topk(k, MAX_TOPK)?;
    expect_tensor("topk_idx", topk_idx, DType::I64, &[n, k])?;
    if n > i32::MAX as usize / num_ranks.max(1) {
        return bad(format!("{n} tokens is too many for 32-bit row indices; split the batch"));
    }
    Ok(LayoutPlan { num_tokens: n, num_topk: k, num_experts })
}

/// Routing of a dispatch call, as seen by the checks.
#[derive(Debug, Clone)]
pub enum RoutingInfo<'a> {
    /// Fresh dispatch from a layout: runs notify (count exchange, CPU sync) first.
    Fresh {
        /// Tokens and experts the layout was computed for.
        layout_tokens: usize,
        num_experts: usize,
        topk_idx: &'a TensorInfo,
        topk_weights: &'a TensorInfo,
        expert_alignment: usize,
    },
    /// Fresh dispatch from a layout without top-k (DeepEP's dispatch without `topk_idx`): rows
    /// go to the ranks of `is_token_in_rank`, no top-k ids or weights travel; the per-expert
    /// counts still come from the layout's `num_tokens_per_expert`.
    FreshNoTopk { layout_tokens: usize, num_experts: usize, expert_alignment: usize },
    /// Reuse of a handle from an earlier dispatch on the same buffer.
    Cached { handle_buffer: u64, handle_tokens: usize },
}

/// Checks of `dispatch(x, scales, routing, config)` against the buffer `layout` (buffer id
/// `buffer_id`); `device_sms` bounds `config.num_sms` when known. The tensors first (what the
/// Python entry points check in `crate::args` instead), then [`check_planned`].
pub fn check_dispatch(
    layout: &BufferLayout,
    buffer_id: u64,
    x: &TensorInfo,
    scales: Option<&TensorInfo>,
    routing: &RoutingInfo<'_>,
    config: &Config,
    device_sms: Option<usize>,
) -> Result<DispatchPlan> {
    if x.shape.len() != 2 {
        return bad(format!("x has shape {:?}; it must be 2-D [num_tokens, hidden]", x.shape));
    }
    let (n, h) = (x.shape[0], x.shape[1]);
    let fp8 = match x.dtype {
        DType::Bf16 => false,
        DType::Fp8E4m3 => true,
        other => return bad(format!("x has dtype {}; dispatch takes bf16, or fp8-e4m3 with f32 scales", other.name())),
    };
    expect_layout("x", x, x.dtype, &[n, h])?;
    let (num_scales, srs, scs) = match (fp8, scales) {
        (false, None) => (0, 0, 0),
        (false, Some(_)) => return bad("scales were given with a bf16 x; scales belong to fp8 input only, drop them or pass x as fp8-e4m3".into()),
        (true, None) => return bad("x is fp8-e4m3 but no scales were given; pass the f32 scales [num_tokens, hidden/128]".into()),
        (true, Some(s)) => {
            validate::fp8_hidden(h, false)?;
            let g = h / FP8_GROUP;
            if s.dtype != DType::F32 || s.shape != [n, g] {
                return bad(format!(
                    "scales are {} {:?} but must be f32 [{n}, {g}] (one per token and 128 channels); row-major or a transposed column-major view both work",
                    s.dtype.name(),
                    s.shape
                ));
            }
            (g, s.strides[0], s.strides[1])
        }
    };
    if let RoutingInfo::Fresh { topk_idx, topk_weights, .. } = routing {
        // topk_idx itself is the layout's tensor: check_planned checks it (check_layout)
        if let [_, k] = topk_idx.shape[..] {
            expect_layout("topk_weights", topk_weights, DType::F32, &[n, k])?;
        }
    }
    let plan = DispatchPlan {
        num_tokens: n,
        hidden: h,
        dtype: x.dtype,
        row_bytes: h * x.dtype.size(),
        num_scales,
        scale_row_stride: srs,
        scale_col_stride: scs,
        scales_column_major: (num_scales > 0).then_some(num_scales > 1 && scs != 1),
        num_topk: 0,
        num_experts: 0,
        expert_alignment: 1,
    };
    check_planned(layout, buffer_id, plan, x.ptr, scales.map(|s| s.ptr), routing, config, device_sms)
}

/// The checks of a dispatch whose tensors were already checked (`plan`, from [`check_dispatch`]
/// or from the Python entry points' `crate::args::dispatch`): against this buffer and what its
/// launch needs, each made once. `config` and `device_sms` (the launch), the hidden size and token
/// count (the buffer's capacity), the alignment of `x` (16 bytes) and the scales (4 bytes), and
/// the routing: a fresh layout for these tokens with experts split evenly over the ranks (at most
/// 1024 per rank), its top-k and expert alignment; a cached handle of this buffer for as many
/// tokens. Returns `plan` with the routing's top-k, experts and alignment.
#[allow(clippy::too_many_arguments)]
pub fn check_planned(
    layout: &BufferLayout,
    buffer_id: u64,
    mut plan: DispatchPlan,
    x_ptr: u64,
    scales_ptr: Option<u64>,
    routing: &RoutingInfo<'_>,
    config: &Config,
    device_sms: Option<usize>,
) -> Result<DispatchPlan> {
    config.validate(device_sms)?;
    let (n, h) = (plan.num_tokens, plan.hidden);
    validate::hidden(h, plan.dtype.size())?;
    if h > layout.hidden {
        return bad(format!(
            "x has hidden {h} but the buffer was created for hidden <= {}; create the Buffer with hidden >= {h}",
            layout.hidden
        ));
    }
    validate::tokens_within(n, layout.max_tokens, "intranode dispatch")?;
    if n * h > 0 && x_ptr % 16 != 0 {
        return bad(format!("x starts at {x_ptr:#x}, which is not 16-byte aligned (the kernels move 16-byte words); pass a tensor whose data starts on a 16-byte boundary"));
    }
    if plan.dtype == DType::Fp8E4m3 {
        validate::fp8_hidden(h, false)?;
    }
    if let Some(p) = scales_ptr.filter(|p| p % 4 != 0) {
        return bad(format!("scales start at {p:#x}, not 4-byte aligned; pass an f32 tensor"));
    }
    let (num_topk, num_experts, expert_alignment) = match routing {
        RoutingInfo::Fresh { layout_tokens, num_experts, topk_idx, topk_weights, expert_alignment } => {
            if *layout_tokens != n {
                return bad(format!("the layout was computed for {layout_tokens} tokens but x has {n}; call dispatch_layout with this batch's topk_idx"));
            }
            let lp = check_layout(topk_idx, *num_experts, layout.num_ranks)?;
            if lp.num_tokens != n {
                return bad(format!("topk_idx has {} rows but x has {n} tokens; pass one top-k row per token", lp.num_tokens));
            }
            aligned16("topk_weights", topk_weights)?;
            validate::expert_alignment(*expert_alignment)?;
            (lp.num_topk, *num_experts, *expert_alignment)
        }
        RoutingInfo::FreshNoTopk { layout_tokens, num_experts, expert_alignment } => {
            if *layout_tokens != n {
                return bad(format!("the layout was computed for {layout_tokens} tokens but x has {n}; call dispatch_layout with this batch's topk_idx"));
            }
            if *num_experts == 0 || *num_experts % layout.num_ranks != 0 {
                return bad(format!(
                    "the layout counts {num_experts} experts, not a positive multiple of the {} ranks; pass num_tokens_per_expert from dispatch_layout",
                    layout.num_ranks
                ));
            }
            validate::expert_alignment(*expert_alignment)?;
            (0, *num_experts, *expert_alignment)
        }
        RoutingInfo::Cached { handle_buffer, handle_tokens } => {
            if *handle_buffer != buffer_id {
                return bad("the handle comes from a different Buffer; pass the handle returned by a dispatch on this Buffer".into());
            }
            if *handle_tokens != n {
                return bad(format!("the cached handle was made for {handle_tokens} tokens but x has {n}; dispatch with a fresh layout when the routing changes"));
            }
            (0, 0, 1)
        }
    };
    plan.num_topk = num_topk;
    plan.num_experts = num_experts;
    plan.expert_alignment = expert_alignment;
    Ok(plan)
}

/// What [`check_combine`] needs from the handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleInfo {
    pub buffer: u64,
    pub num_tokens: usize,
    pub num_recv_tokens: usize,
    pub num_topk: usize,
}

/// Validated combine shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombinePlan {
    pub num_tokens: usize,
    pub num_recv_tokens: usize,
    pub hidden: usize,
    pub num_topk: usize,
    pub with_weights: bool,
}

/// Checks of `combine(y, handle, topk_weights, bias0, bias1)` and of the outputs it writes: the
/// tensors first (what the Python entry points check in `crate::args` instead), then
/// [`check_combine_planned`].
#[allow(clippy::too_many_arguments)]
pub fn check_combine(
    layout: &BufferLayout,
    buffer_id: u64,
    handle: &HandleInfo,
    y: &TensorInfo,
    topk_weights: Option<&TensorInfo>,
    biases: [Option<&TensorInfo>; 2],
    out: &TensorInfo,
    out_weights: Option<&TensorInfo>,
    config: &Config,
    device_sms: Option<usize>,
) -> Result<CombinePlan> {
    if y.dtype != DType::Bf16 {
        return bad(format!("combine input y has dtype {}; combine takes bf16 only (cast the expert outputs to bf16)", y.dtype.name()));
    }
    if y.shape.len() != 2 {
        return bad(format!("y has shape {:?}; it must be 2-D [num_recv_tokens, hidden]", y.shape));
    }
    let (m, h) = (y.shape[0], y.shape[1]);
    if m != handle.num_recv_tokens {
        return bad(format!(
            "y has {m} rows but the dispatch received {} tokens; pass one row per received token, in the order of recv_x",
            handle.num_recv_tokens
        ));
    }
    expect_layout("y", y, DType::Bf16, &[m, h])?;
    let n = handle.num_tokens;
    let mut tensors = vec![("y", y)];
    let k = match (topk_weights, out_weights) {
        (None, None) => None,
        (Some(w), Some(ow)) => {
            let k = if handle.num_topk > 0 { handle.num_topk } else { w.shape.get(1).copied().unwrap_or(0) };
            validate::num_topk(k, MAX_TOPK)?;
            expect_layout("combine topk_weights", w, DType::F32, &[m, k])?;
            expect_layout("combined_topk_weights (output)", ow, DType::F32, &[n, k])?;
            tensors.extend([("combine topk_weights", w), ("combined_topk_weights (output)", ow)]);
            Some(k)
        }
        (Some(_), None) => return bad("combine got topk_weights but no output for the combined weights; pass an f32 [num_tokens, top_k] output".into()),
        (None, Some(_)) => return bad("combine got an output for combined weights but no topk_weights; pass the received weights or drop the output".into()),
    };
    let names = ["bias0", "bias1"];
    for (b, name) in biases.iter().zip(names) {
        if let Some(b) = b {
            expect_layout(name, b, DType::Bf16, &[n, h])?;
            tensors.push((name, b));
        }
    }
    expect_layout("combined_x (output)", out, DType::Bf16, &[n, h])?;
    tensors.push(("combined_x (output)", out));
    let plan = CombinePlan { num_tokens: n, num_recv_tokens: m, hidden: h, num_topk: k.unwrap_or(0), with_weights: k.is_some() };
    check_combine_planned(layout, buffer_id, handle, plan, &tensors, config, device_sms)
}

/// The checks of a combine whose tensors were already checked (`plan`, from the Python entry
/// points' `crate::args::combine`): against this buffer and its launch, once. `config`, the
/// handle's buffer and row count, the hidden size (and the buffer's), the top-k, and the 16-byte
/// alignment of every tensor the kernel moves (`tensors`: name and tensor).
pub fn check_combine_planned(
    layout: &BufferLayout,
    buffer_id: u64,
    handle: &HandleInfo,
    plan: CombinePlan,
    tensors: &[(&str, &TensorInfo)],
    config: &Config,
    device_sms: Option<usize>,
) -> Result<CombinePlan> {
    config.validate(device_sms)?;
    if handle.buffer != buffer_id {
        return bad("the handle comes from a different Buffer; combine with the handle of a dispatch on this Buffer".into());
    }
    if plan.num_recv_tokens != handle.num_recv_tokens || plan.num_tokens != handle.num_tokens {
        return bad(format!(
            "the combine plan is for {} received rows and {} tokens but the handle's dispatch has {} and {}; pass one row per received token",
            plan.num_recv_tokens, plan.num_tokens, handle.num_recv_tokens, handle.num_tokens
        ));
    }
    validate::hidden(plan.hidden, 2)?;
    if plan.hidden > layout.hidden {
        return bad(format!(
            "y has hidden {} but the buffer was created for hidden <= {}; create the Buffer with hidden >= {}",
            plan.hidden, layout.hidden, plan.hidden
        ));
    }
    if plan.with_weights {
        validate::num_topk(plan.num_topk, MAX_TOPK)?;
        if handle.num_topk > 0 && plan.num_topk != handle.num_topk {
            return bad(format!(
                "combine topk_weights has shape [{}, {}] but must be [{}, {}] (the dispatch's top-k); pass a tensor of that shape",
                plan.num_recv_tokens, plan.num_topk, plan.num_recv_tokens, handle.num_topk
            ));
        }
    }
    for (what, t) in tensors {
        aligned16(what, t)?;
    }
    Ok(plan)
}

/// Output regions must not overlap inputs the same kernel reads (e.g. combining into `y`).
pub fn check_disjoint(a_what: &str, a: &TensorInfo, b_what: &str, b: &TensorInfo) -> Result<()> {
    let span = |t: &TensorInfo| -> (u64, u64) {
        let bytes = if t.numel() == 0 { 0 } else { (t.shape.iter().zip(&t.strides).map(|(&s, &st)| (s - 1) * st).sum::<usize>() + 1) * t.dtype.size() };
        (t.ptr, t.ptr + bytes as u64)
    };
    let (a0, a1) = span(a);
    let (b0, b1) = span(b);
    if a0 < b1 && b0 < a1 {
        return bad(format!("{a_what} overlaps {b_what} in memory; pass separate tensors"));
    }
    Ok(())
}
