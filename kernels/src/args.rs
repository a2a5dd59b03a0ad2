//! Argument checks of the Python entry points (`deepep_kernels._native.Runtime`), on the
//! tensors as the caller passed them: the Python extension reads each object into an [`Arg`]
//! (address, real shape, element strides, dtype and device) and these functions refuse anything
//! the kernels cannot take, before any launch. They are plain functions of the arguments and of
//! plain state (world size, device, buffer dimensions, the handle's sizes), so they are tested on
//! the CPU (`kernels/tests/args.rs`) and the extension's `check_call` runs them on real arrays.
//!
//! Order inside each entry point: dtype, then rank/shape (against the other arguments and the
//! handle), then contiguity, then device, over all its tensors in that order: a tensor that is
//! right but on the CPU is refused only for its device. (A Python object that is no tensor at all
//! is refused by the reader first, with `TypeError`.) Messages keep the wording users of
//! `deepep_kernels.Buffer` know and name the fix.

use crate::tensor::{DType, TensorInfo};
use crate::{EpError, Result};

/// Where a tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
    /// Another DLPack device (type code and id), e.g. pinned host memory.
    Other(String),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Other(s) => write!(f, "{s}"),
        }
    }
}

/// One tensor argument as the caller passed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arg {
    /// The dtype, or the caller's name of one the kernels do not take (e.g. `torch.float16`).
    pub dtype: std::result::Result<DType, String>,
    pub shape: Vec<usize>,
    /// Element strides as given (negative ones are possible in DLPack).
    pub strides: Vec<i64>,
    /// Address of element 0 (byte offset included).
    pub ptr: u64,
    pub device: Device,
}

impl Arg {
    /// A contiguous tensor of `dtype` and `shape` on `device` at `ptr` (tests, plain callers).
    pub fn contiguous(dtype: DType, shape: &[usize], ptr: u64, device: Device) -> Arg {
        let info = TensorInfo::contiguous(dtype, shape, ptr);
        Arg { dtype: Ok(dtype), shape: shape.to_vec(), strides: info.strides.iter().map(|&s| s as i64).collect(), ptr, device }
    }
    /// The [`TensorInfo`] the kernels take (after the checks: known dtype; negative strides,
    /// refused by the contiguity checks, become 0 here).
    pub fn info(&self) -> TensorInfo {
        TensorInfo {
            dtype: self.dtype.clone().unwrap_or(DType::U8),
            shape: self.shape.clone(),
            strides: self.strides.iter().map(|&s| s.max(0) as usize).collect(),
            ptr: self.ptr,
        }
    }
    fn is_contiguous(&self) -> bool {
        let mut want = 1i64;
        if self.shape.iter().product::<usize>() <= 1 {
            return true;
        }
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != want {
                return false;
            }
            want *= n as i64;
        }
        true
    }
    /// A 2-D tensor whose transpose is contiguous (column-major).
    fn is_column_major(&self) -> bool {
        self.shape.len() == 2 && {
            let t = Arg { shape: vec![self.shape[1], self.shape[0]], strides: vec![self.strides[1], self.strides[0]], ..self.clone() };
            t.is_contiguous()
        }
    }
    fn dtype_name(&self) -> String {
        match &self.dtype {
            Ok(d) => torch_name(*d).to_string(),
            Err(name) => name.clone(),
        }
    }
}

/// torch's name of a dtype (as `str(torch.bfloat16)` prints it), for messages.
pub fn torch_name(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "torch.bfloat16",
        DType::F32 => "torch.float32",
        DType::I32 => "torch.int32",
        DType::I64 => "torch.int64",
        DType::U8 => "torch.uint8",
        DType::Fp8E4m3 => "torch.float8_e4m3fn",
        DType::Bool => "torch.bool",
    }
}

/// The crate's one refusal of a bad argument (`EpError::InvalidArgument`): the Python entry
/// points' checks here, the intranode buffer's (`intranode::checks`), the configuration's
/// (`config`) and the internode buffer's use it.
pub(crate) fn bad<T>(msg: String) -> Result<T> {
    Err(EpError::InvalidArgument(msg))
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// `what` has one of `dtypes` and `ndim` dimensions.
pub fn kind(what: &str, a: &Arg, dtypes: &[DType], ndim: usize) -> Result<()> {
    if !matches!(&a.dtype, Ok(d) if dtypes.contains(d)) {
        let want = if dtypes.len() == 1 {
            torch_name(dtypes[0]).to_string()
        } else {
            format!("one of ({})", dtypes.iter().map(|d| torch_name(*d)).collect::<Vec<_>>().join(", "))
        };
        return bad(format!("{what} must be {want}, got {}", a.dtype_name()));
    }
    if a.shape.len() != ndim {
        return bad(format!("{what} must be {ndim}-D, got shape {}", shape_str(&a.shape)));
    }
    Ok(())
}

/// `what` is contiguous (row-major).
pub fn contiguous(what: &str, a: &Arg) -> Result<()> {
    if !a.is_contiguous() {
        return bad(format!("{what} must be contiguous (shape {}, strides {:?}); call .contiguous() first", shape_str(&a.shape), a.strides));
    }
    Ok(())
}

/// `what` lives on CUDA device `device` (the Buffer's).
pub fn on_device(what: &str, a: &Arg, device: usize) -> Result<()> {
    match &a.device {
        Device::Cuda(d) if *d == device => Ok(()),
        Device::Cuda(d) => bad(format!("{what} is on cuda:{d} but this Buffer uses cuda:{device}; move it with .to('cuda:{device}')")),
        other => bad(format!("{what} must be on a CUDA device (got {other}); move it with .cuda()")),
    }
}

/// Contiguity, then device, of every named tensor (the last two steps of each entry point).
fn placed(args: &[(&str, Option<&Arg>)], device: usize) -> Result<()> {
    for (what, a) in args {
        if let Some(a) = a {
            contiguous(what, a)?;
        }
    }
    for (what, a) in args {
        if let Some(a) = a {
            on_device(what, a, device)?;
        }
    }
    Ok(())
}

/// `DeepEP`'s FP8 scales of `n` tokens of `hidden` channels: f32 `[n, hidden/128]`, row-major or
/// column-major (a `hidden` that is no multiple of 128 is the kernels' FP8 check's to refuse).
/// Returns whether they are column-major.
fn scales(a: &Arg, n: usize, hidden: usize) -> Result<bool> {
    let groups_ok = hidden % 128 != 0 || a.shape.get(1) == Some(&(hidden / 128));
    if !matches!(a.dtype, Ok(DType::F32)) || a.shape.len() != 2 || a.shape[0] != n || !groups_ok {
        return bad(format!("x scales must be float32 [num_tokens={n}, hidden/128={}], got {} {}", hidden / 128, a.dtype_name(), shape_str(&a.shape)));
    }
    Ok(!a.is_contiguous() && a.is_column_major())
}

fn scales_layout(a: &Arg) -> Result<()> {
    if !a.is_contiguous() && !a.is_column_major() {
        return bad(format!("x scales must be row-major or column-major, got strides {:?}", a.strides));
    }
    Ok(())
}

// --- low-latency ------------------------------------------------------------------------------

/// What `low_latency_dispatch` found: tokens, hidden, top-k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlDispatchPlan {
    pub num_tokens: usize,
    pub hidden: usize,
    pub num_topk: usize,
}

/// `low_latency_dispatch(x, topk_idx, num_max, num_experts, stats)` on `world` ranks: x bf16
/// `[n, hidden]`, topk_idx i64 `[n, k]`, `n <= num_max`, stats (optional) i32 `[local experts]`.
pub fn ll_dispatch(x: &Arg, topk_idx: &Arg, stats: Option<&Arg>, num_max: usize, num_experts: usize, world: usize, device: usize) -> Result<LlDispatchPlan> {
    kind("x", x, &[DType::Bf16], 2)?;
    kind("topk_idx", topk_idx, &[DType::I64], 2)?;
    if let Some(s) = stats {
        kind("cumulative_local_expert_recv_stats", s, &[DType::I32], 1)?;
    }
    let (n, hidden) = (x.shape[0], x.shape[1]);
    if topk_idx.shape[0] != n {
        return bad(format!("topk_idx has {} rows but x has {n}", topk_idx.shape[0]));
    }
    if n > num_max {
        return bad(format!(
            "x has {n} tokens, more than num_max_dispatch_tokens_per_rank={num_max}; dispatch at most {num_max} tokens per call, or size \
             the Buffer for more (num_rdma_bytes from Buffer.get_low_latency_rdma_size_hint with the larger count) and pass that count"
        ));
    }
    let local = num_experts / world.max(1);
    if let Some(s) = stats {
        if s.shape[0] != local {
            return bad(format!("cumulative_local_expert_recv_stats must be [{local}] (local experts), got {}", shape_str(&s.shape)));
        }
    }
    placed(&[("x", Some(x)), ("topk_idx", Some(topk_idx)), ("cumulative_local_expert_recv_stats", stats)], device)?;
    Ok(LlDispatchPlan { num_tokens: n, hidden, num_topk: topk_idx.shape[1] })
}

/// The sizes of a low-latency dispatch that its combine must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlCombineDims {
    pub num_tokens: usize,
    pub num_topk: usize,
    pub hidden: usize,
    pub local_experts: usize,
    /// `ranks * num_max_dispatch_tokens_per_rank`.
    pub rows: usize,
}

/// `low_latency_combine(x, topk_idx, topk_weights, out)` against its handle's dispatch: x (the
/// expert outputs) bf16 `[local_experts, rows, hidden]` as recv_x, topk_idx i64 / topk_weights
/// f32 `[num_tokens, num_topk]` as given to the dispatch, out (optional) bf16 `[num_tokens,
/// hidden]`. `zero_copy`: the buffer `get_next_low_latency_combine_buffer` handed out, which the
/// combine reads instead of x (x then only has to have its shape). The kernel reads and writes by
/// these sizes, so anything else would read or write past a tensor (DeepEP asserts the same).
pub fn ll_combine(x: &Arg, topk_idx: &Arg, topk_weights: &Arg, out: Option<&Arg>, zero_copy: Option<&Arg>, d: LlCombineDims, device: usize) -> Result<()> {
    kind("x", x, &[DType::Bf16], 3)?;
    if let Some(z) = zero_copy {
        kind("the zero-copy combine buffer", z, &[DType::Bf16], 3)?;
    }
    kind("topk_idx", topk_idx, &[DType::I64], 2)?;
    kind("topk_weights", topk_weights, &[DType::F32], 2)?;
    if let Some(o) = out {
        kind("out", o, &[DType::Bf16], 2)?;
    }
    if let Some(z) = zero_copy {
        if z.shape != x.shape {
            return bad(format!(
                "zero_copy=True: x has shape {} but the combine buffer handed out has {}; pass expert outputs of the handle's layout",
                shape_str(&x.shape),
                shape_str(&z.shape)
            ));
        }
    }
    let packed = [d.local_experts, d.rows, d.hidden];
    if x.shape != packed {
        return bad(format!(
            "low_latency_combine: x is {}, but the handle's dispatch packed {} ([local experts, ranks * num_max_dispatch_tokens_per_rank, hidden]): \
             pass the expert outputs in the layout of that dispatch's recv_x",
            shape_str(&x.shape),
            shape_str(&packed)
        ));
    }
    for (name, a) in [("topk_idx", topk_idx), ("topk_weights", topk_weights)] {
        if a.shape != [d.num_tokens, d.num_topk] {
            return bad(format!(
                "low_latency_combine: {name} is {}, but the handle's dispatch had {} tokens with top-{}: pass that dispatch's topk_idx and one \
                 weight per top-k slot ([{}, {}])",
                shape_str(&a.shape),
                d.num_tokens,
                d.num_topk,
                d.num_tokens,
                d.num_topk
            ));
        }
    }
    if let Some(o) = out {
        if o.shape != [d.num_tokens, d.hidden] {
            return bad(format!(
                "low_latency_combine: out is {}, must be [{}, {}] (the dispatch's tokens x hidden)",
                shape_str(&o.shape),
                d.num_tokens,
                d.hidden
            ));
        }
    }
    let read = zero_copy.unwrap_or(x);
    placed(&[("x", Some(read)), ("topk_idx", Some(topk_idx)), ("topk_weights", Some(topk_weights)), ("out", out)], device)
}

/// The low-latency buffer of `need` bytes fits in `num_rdma_bytes`.
pub fn ll_capacity(need: usize, num_rdma_bytes: usize, num_max: usize, hidden: usize, num_experts: usize, world: usize) -> Result<()> {
    if need > num_rdma_bytes {
        return bad(format!(
            "num_rdma_bytes={num_rdma_bytes} is too small for the low-latency buffer of {num_max} tokens, hidden {hidden}, {num_experts} experts \
             on {world} ranks ({need} bytes); size it with \
             Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)"
        ));
    }
    Ok(())
}

/// A handle or hook of low-latency buffer generation `of` used while the buffer is at `now`.
pub fn ll_generation(of: u64, now: u64, what: &str) -> Result<()> {
    if of != now {
        return bad(match what {
            "hook" => "this receive hook's low-latency buffer was destroyed or re-created since its call (clean_low_latency_buffer or a \
                       low-latency call with other sizes, or destroy()); dispatch again"
                .to_string(),
            _ => "this low-latency handle's buffer was destroyed or re-created; dispatch again".to_string(),
        });
    }
    Ok(())
}

// --- intranode / internode normal mode --------------------------------------------------------

/// `get_dispatch_layout(topk_idx)` with the outputs the caller allocated: topk_idx i64 `[n, k]`;
/// num_tokens_per_rank i32 `[world]`, num_tokens_per_expert i32 `[num_experts]`,
/// is_token_in_rank bool `[n, world]`. Returns `(n, k)`.
pub fn dispatch_layout(topk_idx: &Arg, per_rank: &Arg, per_expert: &Arg, in_rank: &Arg, num_experts: usize, world: usize, device: usize) -> Result<(usize, usize)> {
    kind("topk_idx", topk_idx, &[DType::I64], 2)?;
    kind("num_tokens_per_rank", per_rank, &[DType::I32], 1)?;
    kind("num_tokens_per_expert", per_expert, &[DType::I32], 1)?;
    kind("is_token_in_rank", in_rank, &[DType::Bool], 2)?;
    let (n, k) = (topk_idx.shape[0], topk_idx.shape[1]);
    for (name, a, want) in [("num_tokens_per_rank", per_rank, vec![world]), ("num_tokens_per_expert", per_expert, vec![num_experts]), ("is_token_in_rank", in_rank, vec![n, world])] {
        if a.shape != want {
            return bad(format!("{name} must be {} for get_dispatch_layout of these {n} tokens, got {}", shape_str(&want), shape_str(&a.shape)));
        }
    }
    placed(&[("topk_idx", Some(topk_idx)), ("num_tokens_per_rank", Some(per_rank)), ("num_tokens_per_expert", Some(per_expert)), ("is_token_in_rank", Some(in_rank))], device)?;
    Ok((n, k))
}

/// The routing tensors of a fresh normal-mode dispatch.
#[derive(Debug, Clone, Copy)]
pub struct Routing<'a> {
    /// topk_idx and topk_weights (None: a dispatch without top-k).
    pub topk: Option<(&'a Arg, &'a Arg)>,
    pub per_rank: &'a Arg,
    /// The internode mode's num_tokens_per_rdma_rank and host count.
    pub per_rdma_rank: Option<(&'a Arg, usize)>,
    pub per_expert: &'a Arg,
    pub in_rank: &'a Arg,
}

/// The one plan of a normal-mode dispatch: what its checks found and its launch reads. Made by
/// the entry points' checks ([`dispatch`], from the caller's tensors, before the buffer is known)
/// and by the intranode buffer's (`intranode::checks::check_dispatch`, which adds what only the
/// buffer knows: the routing's expert alignment and the handle).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchPlan {
    pub num_tokens: usize,
    pub hidden: usize,
    /// bf16, or fp8-e4m3 with scales.
    pub dtype: DType,
    /// Bytes of one row of `x`.
    pub row_bytes: usize,
    /// FP8 scale groups per row (0 for bf16).
    pub num_scales: usize,
    /// Element strides of the scales (0 without scales).
    pub scale_row_stride: usize,
    pub scale_col_stride: usize,
    /// Whether the FP8 scales are column-major (None without scales).
    pub scales_column_major: Option<bool>,
    /// Top-k of a fresh dispatch (0: cached, or without top-k).
    pub num_topk: usize,
    /// Experts over all ranks (0: cached).
    pub num_experts: usize,
    /// Received rows per local expert are rounded up to this (1 unless the routing says).
    pub expert_alignment: usize,
}

/// A normal-mode dispatch of `x` (bf16 `[n, hidden]`, or float8_e4m3fn with `scales` f32
/// `[n, hidden/128]` row- or column-major) with fresh `routing` (None: a cached dispatch) on
/// `world` ranks: topk_idx / topk_weights `[n, k]`, num_tokens_per_rank `[world]`,
/// num_tokens_per_rdma_rank `[hosts]`, is_token_in_rank `[n, world]`, num_tokens_per_expert a
/// multiple of `world`. The kernels read them by these sizes, so a tensor of another batch or
/// group would be read past its end (DeepEP asserts the same).
pub fn dispatch(x: &Arg, scales: Option<&Arg>, routing: Option<Routing<'_>>, world: usize, device: usize) -> Result<DispatchPlan> {
    if scales.is_some() {
        kind("x", x, &[DType::Bf16, DType::Fp8E4m3], 2)?;
        if x.dtype != Ok(DType::Fp8E4m3) {
            return bad("with scales, x must be float8_e4m3fn".into());
        }
    } else if x.dtype != Ok(DType::Bf16) {
        return bad(format!("x must be bfloat16, or a (float8_e4m3fn x, float32 scales) tuple; got {}", x.dtype_name()));
    } else {
        kind("x", x, &[DType::Bf16], 2)?;
    }
    let (n, hidden) = (x.shape[0], x.shape[1]);
    let column_major = scales.map(|s| self::scales(s, n, hidden)).transpose()?;
    let dtype = if scales.is_some() { DType::Fp8E4m3 } else { DType::Bf16 };
    let stride = |i: usize| scales.map_or(0, |s| s.strides[i].max(0) as usize);
    let mut plan = DispatchPlan {
        num_tokens: n,
        hidden,
        dtype,
        row_bytes: hidden * dtype.size(),
        num_scales: scales.map_or(0, |s| s.shape[1]),
        scale_row_stride: stride(0),
        scale_col_stride: stride(1),
        scales_column_major: column_major,
        num_topk: 0,
        num_experts: 0,
        expert_alignment: 1,
    };
    let Some(r) = routing else {
        contiguous("x", x)?;
        if let Some(s) = scales {
            scales_layout(s)?;
        }
        on_device("x", x, device)?;
        if let Some(s) = scales {
            on_device("x scales", s, device)?;
        }
        return Ok(plan);
    };
    if let Some((idx, w)) = r.topk {
        kind("topk_idx", idx, &[DType::I64], 2)?;
        kind("topk_weights", w, &[DType::F32], 2)?;
    }
    kind("num_tokens_per_rank", r.per_rank, &[DType::I32], 1)?;
    if let Some((pr, _)) = r.per_rdma_rank {
        kind("num_tokens_per_rdma_rank", pr, &[DType::I32], 1)?;
    }
    kind("num_tokens_per_expert", r.per_expert, &[DType::I32], 1)?;
    kind("is_token_in_rank", r.in_rank, &[DType::Bool], 2)?;
    let mut want: Vec<(&str, &Arg, Vec<usize>)> = Vec::new();
    if let Some((idx, w)) = r.topk {
        let k = idx.shape[1];
        plan.num_topk = k;
        want.push(("topk_idx", idx, vec![n, k]));
        want.push(("topk_weights", w, vec![n, k]));
    }
    want.push(("num_tokens_per_rank", r.per_rank, vec![world]));
    want.push(("is_token_in_rank", r.in_rank, vec![n, world]));
    if let Some((pr, hosts)) = r.per_rdma_rank {
        want.push(("num_tokens_per_rdma_rank", pr, vec![hosts]));
    }
    for (name, a, shape) in &want {
        if &a.shape != shape {
            let from = if name.starts_with("topk_") { "one row per token of x" } else { "from get_dispatch_layout for these tokens" };
            return bad(format!("{name} must be {} ({from}: {n} tokens), got {}", shape_str(shape), shape_str(&a.shape)));
        }
    }
    let e = r.per_expert.shape[0];
    if world == 0 || e % world != 0 {
        return bad(format!("num_tokens_per_expert has {e} experts, not a multiple of the {world} ranks"));
    }
    plan.num_experts = e;
    if let Some(s) = scales {
        scales_layout(s)?;
    }
    placed(
        &[
            ("x", Some(x)),
            ("topk_idx", r.topk.map(|t| t.0)),
            ("topk_weights", r.topk.map(|t| t.1)),
            ("num_tokens_per_rank", Some(r.per_rank)),
            ("num_tokens_per_rdma_rank", r.per_rdma_rank.map(|p| p.0)),
            ("num_tokens_per_expert", Some(r.per_expert)),
            ("is_token_in_rank", Some(r.in_rank)),
        ],
        device,
    )?;
    if let Some(s) = scales {
        on_device("x scales", s, device)?;
    }
    Ok(plan)
}

/// The sizes of a normal-mode dispatch that its combine must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombineDims {
    /// Tokens of the dispatching rank (rows of the combined output).
    pub num_tokens: usize,
    /// Rows this rank received.
    pub num_recv_tokens: usize,
    /// Rows of the dispatch's outputs (num_worst_tokens when given, else num_recv_tokens).
    pub num_rows: usize,
    /// The dispatch's hidden (None: any; the intranode handle does not fix it).
    pub hidden: Option<usize>,
}

/// A normal-mode combine of `x` (bf16 `[rows, hidden]`, rows as the handle's dispatch produced)
/// with optional `topk_weights` (f32, one row per dispatched row) and `bias` (bf16 `[num_tokens,
/// hidden]` each) into `out` (bf16 `[num_tokens, hidden]`) and `out_weights` (f32 `[num_tokens,
/// k]`). Returns `(hidden, k)`.
#[allow(clippy::too_many_arguments)]
pub fn combine(x: &Arg, topk_weights: Option<&Arg>, bias: [Option<&Arg>; 2], out: Option<&Arg>, out_weights: Option<&Arg>, d: CombineDims, device: usize) -> Result<(usize, Option<usize>)> {
    kind("x", x, &[DType::Bf16], 2)?;
    if let Some(w) = topk_weights {
        kind("topk_weights", w, &[DType::F32], 2)?;
    }
    for (b, name) in bias.iter().zip(["bias[0]", "bias[1]"]) {
        if let Some(b) = b {
            kind(name, b, &[DType::Bf16], 2)?;
        }
    }
    if let Some(o) = out {
        kind("out", o, &[DType::Bf16], 2)?;
    }
    if let Some(o) = out_weights {
        kind("out_weights", o, &[DType::F32], 2)?;
    }
    let (m, hidden) = (x.shape[0], x.shape[1]);
    match d.hidden {
        Some(h) if m != d.num_recv_tokens || hidden != h => {
            return bad(format!(
                "combine: x is {} but the handle's dispatch received [{}, {h}]; pass the expert outputs in the order and width of recv_x",
                shape_str(&x.shape),
                d.num_recv_tokens
            ))
        }
        None if m != d.num_recv_tokens && m != d.num_rows => {
            return bad(format!(
                "combine: x has {m} rows but the handle's dispatch produced {} ({} received); pass the expert outputs in the order of recv_x",
                d.num_rows, d.num_recv_tokens
            ))
        }
        _ => {}
    }
    let mut k = None;
    if let Some(w) = topk_weights {
        if w.shape[0] != d.num_recv_tokens && w.shape[0] != d.num_rows {
            return bad(format!("topk_weights must have {} rows (one per dispatched row), got {}", d.num_rows, w.shape[0]));
        }
        k = Some(w.shape[1]);
    }
    let n = d.num_tokens;
    for (b, name) in bias.iter().zip(["bias[0]", "bias[1]"]) {
        if let Some(b) = b {
            if b.shape != [n, hidden] {
                return bad(format!("{name} must be [{n}, {hidden}], got {}", shape_str(&b.shape)));
            }
        }
    }
    if let Some(o) = out {
        if o.shape != [n, hidden] {
            return bad(format!("out must be [{n}, {hidden}] (the dispatch's tokens x hidden), got {}", shape_str(&o.shape)));
        }
    }
    if let Some(o) = out_weights {
        match k {
            Some(k) if o.shape == [n, k] => {}
            Some(k) => return bad(format!("out_weights must be [{n}, {k}], got {}", shape_str(&o.shape))),
            None => return bad("combine: out_weights must be given exactly when topk_weights are".into()),
        }
    } else if k.is_some() && out.is_some() {
        return bad("combine: out_weights must be given exactly when topk_weights are".into());
    }
    placed(
        &[("x", Some(x)), ("topk_weights", topk_weights), ("bias[0]", bias[0]), ("bias[1]", bias[1]), ("out", out), ("out_weights", out_weights)],
        device,
    )?;
    Ok((hidden, k))
}

/// A handle of buffer generation `of` used while the NVLink (or internode) buffer is at `now`.
pub fn normal_generation(of: u64, now: u64, internode: bool) -> Result<()> {
    if of != now {
        return bad(if internode {
            "this handle's internode buffer was re-created since (a fresh dispatch with a larger hidden, top-k or expert count, or \
             another Config.num_sms); dispatch fresh again"
                .to_string()
        } else {
            "this handle's NVLink buffer was re-created since (a dispatch with another hidden size); dispatch fresh again".to_string()
        });
    }
    Ok(())
}

/// `n` tokens fit the NVLink buffer sized for `max_tokens` (`need`: the bytes `n` would take).
pub fn nvl_capacity(n: usize, max_tokens: usize, hidden: usize, world: usize, num_nvl_bytes: usize, need: usize) -> Result<()> {
    if n > max_tokens {
        return bad(format!(
            "dispatch of {n} tokens: num_nvl_bytes={num_nvl_bytes} holds {max_tokens} tokens of hidden {hidden} per rank on {world} ranks; \
             create the Buffer with num_nvl_bytes >= {need} (or set DEEPEP_KERNELS_MAX_TOKENS >= {n} before sizing it with \
             Config.get_nvl_buffer_size_hint)"
        ));
    }
    Ok(())
}
