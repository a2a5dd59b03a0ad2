//! The checks of `ElasticBuffer.dispatch` and `.combine`: every tensor's dtype, shape, layout and
//! device, the routing dimensions and the buffer's capacity, before anything is launched. They
//! turn the caller's [`Arg`]s into the plan the kernels take ([`DispatchPlan`], [`CombinePlan`]),
//! and say what sizes the outputs get ([`DispatchPlan::output_rows`]).

use super::{combine_bytes, dispatch_bytes, Counts, MAX_EXPERTS, MAX_LOCAL_EXPERTS, MAX_TOPK};
use crate::args::{bad, contiguous, kind, on_device, Arg};
use crate::tensor::DType;
use crate::Result;

use crate::common::align_up as align;

/// Elements of the handle's plan tensor (i32): `dst_slot [N][K]`, `exp_pos [N][K]`,
/// `send_counts [2R + E]`.
pub fn plan_len(num_tokens: usize, num_topk: usize, num_ranks: usize, num_experts: usize) -> usize {
    2 * num_tokens * num_topk + 2 * num_ranks + num_experts
}

/// The handle tensors a cached dispatch reuses.
#[derive(Debug, Clone, Copy)]
pub struct CachedHandle<'a> {
    /// i32 plan ([`plan_len`]).
    pub plan: &'a Arg,
    /// i32 `[R]`, `[L]`, `[L]`.
    pub psum_rank: &'a Arg,
    pub psum_expert: &'a Arg,
    pub unaligned: &'a Arg,
    /// i32 `[rows][K + 2]` (`recv_src_metadata`).
    pub meta: &'a Arg,
    /// Whether the handle's dispatch used the expanded layout.
    pub expand: bool,
    /// Rows of the outputs of the handle's dispatch (plain / expanded layout).
    pub recv_rows: usize,
}

/// One dispatch as the caller asked for it (the tensors as read, the handle's for a cached call).
#[derive(Debug, Clone, Copy)]
pub struct DispatchRequest<'a> {
    pub x: &'a Arg,
    pub sf: Option<&'a Arg>,
    /// The caller's (fresh) or the handle's (cached) `topk_idx`.
    pub topk_idx: &'a Arg,
    pub topk_weights: Option<&'a Arg>,
    pub stats: Option<&'a Arg>,
    pub cached: Option<CachedHandle<'a>>,
    pub num_experts: usize,
    pub max_tokens: usize,
    pub expert_alignment: usize,
    pub num_sms: usize,
    pub expand: bool,
    pub zero_padding: bool,
    pub cpu_sync: bool,
}

/// A checked dispatch, as the kernels take it (addresses as `u64`, 0 = none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchPlan {
    pub x: u64,
    pub x_dtype: DType,
    pub sf: u64,
    pub sf_dtype: Option<DType>,
    pub sf_token_stride: i64,
    pub sf_pack_stride: i64,
    pub num_sf_packs: usize,
    pub topk_idx: u64,
    pub topk_w: u64,
    pub stats: u64,
    pub num_tokens: usize,
    pub hidden: usize,
    pub hidden_bytes: usize,
    pub num_topk: usize,
    pub num_experts: usize,
    pub num_ranks: usize,
    pub num_local_experts: usize,
    pub max_tokens: usize,
    pub expert_alignment: usize,
    pub num_sms: usize,
    pub expand: bool,
    pub zero_padding: bool,
    pub cpu_sync: bool,
    pub fresh: bool,
    /// A cached call: the handle's output rows.
    pub cached_rows: Option<usize>,
}

/// Output sizes of a dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputRows {
    /// Rows of `recv_x` (and of the scales, top-k ids and weights).
    pub recv_rows: usize,
    /// Rows of `recv_src_metadata` (one per received token).
    pub meta_rows: usize,
    /// Tokens received (exact with CPU sync, else the worst case).
    pub num_recv_tokens: usize,
    /// Rows of the expanded layout (exact with CPU sync, else the worst case; 0 when plain).
    pub num_expanded_tokens: usize,
    /// With CPU sync: each local expert's count padded to the alignment (DeepEP's
    /// `num_recv_tokens_per_expert_list`); empty without.
    pub per_expert_aligned: Vec<usize>,
}

impl DispatchPlan {
    /// The worst case of the expanded layout: every token of every rank selecting
    /// `min(K, L)` local experts, plus each expert's alignment padding.
    pub fn worst_expanded_rows(&self) -> usize {
        let (r, t, k, l, a) = (self.num_ranks, self.max_tokens, self.num_topk, self.num_local_experts, self.expert_alignment);
        align(r * t * k.min(l) + l * (a - 1), a)
    }

    /// The output sizes: from the counts of a CPU-synced call, the handle (cached), or the worst
    /// case (`num_ranks * max_tokens` tokens; [`DispatchPlan::worst_expanded_rows`]).
    pub fn output_rows(&self, counts: Option<&Counts>) -> OutputRows {
        let worst_tokens = self.num_ranks * self.max_tokens;
        match counts {
            Some(c) => {
                let aligned: Vec<usize> = c.per_expert.iter().map(|&n| align(n, self.expert_alignment)).collect();
                let expanded: usize = aligned.iter().sum();
                OutputRows {
                    recv_rows: if self.expand { expanded } else { c.num_recv_tokens },
                    meta_rows: c.num_recv_tokens,
                    num_recv_tokens: c.num_recv_tokens,
                    num_expanded_tokens: if self.expand { expanded } else { 0 },
                    per_expert_aligned: aligned,
                }
            }
            None => {
                let expanded = if self.expand { self.cached_rows.unwrap_or_else(|| self.worst_expanded_rows()) } else { 0 };
                let plain = if self.expand { worst_tokens } else { self.cached_rows.unwrap_or(worst_tokens) };
                OutputRows {
                    recv_rows: if self.expand { expanded } else { plain },
                    meta_rows: plain,
                    num_recv_tokens: plain,
                    num_expanded_tokens: expanded,
                    per_expert_aligned: Vec::new(),
                }
            }
        }
    }
}

fn expect_i32(what: &str, a: &Arg, shape: &[usize], device: usize) -> Result<()> {
    kind(what, a, &[DType::I32], shape.len())?;
    if a.shape != shape {
        return bad(format!("{what} must have shape {shape:?}, got {:?} (a handle from another dispatch or group?)", a.shape));
    }
    contiguous(what, a)?;
    on_device(what, a, device)
}

/// The handle's `recv_src_metadata`: i32 `[rows, num_topk + 2]`, contiguous, on `device` (a
/// cached dispatch and a combine read it).
fn handle_meta(meta: &Arg, k: usize, device: usize) -> Result<()> {
    kind("handle.recv_src_metadata", meta, &[DType::I32], 2)?;
    if meta.shape[1] != k + 2 {
        return bad(format!("handle.recv_src_metadata must have num_topk + 2 = {} columns, got {:?}", k + 2, meta.shape));
    }
    contiguous("handle.recv_src_metadata", meta)?;
    on_device("handle.recv_src_metadata", meta, device)
}

/// Check a dispatch on a group of `num_ranks` whose buffers hold `data_bytes` of data on
/// `device`; the plan it returns is what [`super::ElasticBuffer::send`] takes.
pub fn dispatch(req: &DispatchRequest<'_>, num_ranks: usize, data_bytes: usize, device: usize) -> Result<DispatchPlan> {
    let x = req.x;
    kind("x", x, &[DType::Bf16, DType::Fp8E4m3], 2)?;
    contiguous("x", x)?;
    on_device("x", x, device)?;
    let x_dtype = x.dtype.clone().expect("checked by kind");
    let (n, hidden) = (x.shape[0], x.shape[1]);
    let hidden_bytes = hidden * x_dtype.size();
    if hidden_bytes % 16 != 0 {
        return bad(format!("x rows must be a multiple of 16 bytes (hidden={hidden} of {}); pad hidden", crate::args::torch_name(x_dtype)));
    }
    // scale packs: FP8 x only, any strides (4-byte elements)
    let (mut sf_ptr, mut sf_dtype, mut sf_ts, mut sf_ps, mut packs) = (0, None, 0, 0, 0);
    match (x_dtype, req.sf) {
        (DType::Fp8E4m3, None) => return bad("FP8 x needs its scale factors: pass x as (x, sf)".into()),
        (DType::Bf16, Some(_)) => return bad("scale factors come with FP8 x only: pass a bfloat16 x alone, or (float8_e4m3fn x, sf)".into()),
        (_, Some(sf)) => {
            kind("x's scale factors", sf, &[DType::F32, DType::I32], 2)?;
            if sf.shape[0] != n {
                return bad(format!("x's scale factors must have one row per token ({n}), got shape {:?}", sf.shape));
            }
            if sf.strides.iter().any(|&s| s < 0) {
                return bad(format!("x's scale factors have a negative stride ({:?}); pass a tensor with non-negative strides", sf.strides));
            }
            on_device("x's scale factors", sf, device)?;
            (sf_ptr, sf_dtype, sf_ts, sf_ps, packs) = (sf.ptr, sf.dtype.clone().ok(), sf.strides[0], sf.strides[1], sf.shape[1]);
        }
        _ => {}
    }
    let idx = req.topk_idx;
    kind("topk_idx", idx, &[DType::I64], 2)?;
    contiguous("topk_idx", idx)?;
    on_device("topk_idx", idx, device)?;
    if idx.shape[0] != n {
        return bad(format!("topk_idx has {} rows but x has {n} tokens", idx.shape[0]));
    }
    let k = idx.shape[1];
    if k == 0 || k > MAX_TOPK {
        return bad(format!("top-k {k} is outside the elastic kernels' range 1..={MAX_TOPK}"));
    }
    if let Some(w) = req.topk_weights {
        kind("topk_weights", w, &[DType::F32], 2)?;
        if w.shape != idx.shape {
            return bad(format!("topk_weights must have topk_idx's shape {:?}, got {:?}", idx.shape, w.shape));
        }
        contiguous("topk_weights", w)?;
        on_device("topk_weights", w, device)?;
    }
    let e = req.num_experts;
    if e == 0 || e % num_ranks != 0 || e > MAX_EXPERTS {
        return bad(format!(
            "num_experts={e} must be a positive multiple of the group size {num_ranks} and at most {MAX_EXPERTS}"
        ));
    }
    let l = e / num_ranks;
    if l > MAX_LOCAL_EXPERTS {
        return bad(format!("{l} experts per rank exceed the elastic kernels' limit of {MAX_LOCAL_EXPERTS}"));
    }
    if let Some(s) = req.stats {
        expect_i32("cumulative_local_expert_recv_stats", s, &[l], device)?;
    }
    if req.expert_alignment == 0 {
        return bad("expert_alignment must be at least 1".into());
    }
    if req.zero_padding && !req.expand {
        return bad("do_zero_padding needs do_expand=True (only the expanded layout has alignment padding)".into());
    }
    let t = req.max_tokens;
    if t == 0 || n > t {
        return bad(format!(
            "x has {n} tokens but num_max_tokens_per_rank is {t}; pass num_max_tokens_per_rank >= the most tokens any rank dispatches (the same on every rank)"
        ));
    }
    let need = dispatch_bytes(num_ranks, t, hidden_bytes, packs, k);
    if need > data_bytes {
        return bad(format!(
            "this dispatch needs {need} data bytes per rank ({num_ranks} ranks x {t} tokens x {} bytes per token slot) but the buffer has {data_bytes}; \
             create the ElasticBuffer with num_bytes=ElasticBuffer.get_buffer_size_hint(group, {t}, {hidden}, {k}, ...) or pass a smaller num_max_tokens_per_rank",
            super::slot_bytes(hidden_bytes, packs, k)
        ));
    }
    let mut cached_rows = None;
    if let Some(c) = &req.cached {
        if c.expand != req.expand {
            return bad(format!(
                "the handle comes from a dispatch with do_expand={}; a cached dispatch must use the same layout (pass do_expand={})",
                if c.expand { "True" } else { "False" },
                if c.expand { "True" } else { "False" }
            ));
        }
        expect_i32("handle's plan", c.plan, &[plan_len(n, k, num_ranks, e)], device)?;
        expect_i32("handle.psum_num_recv_tokens_per_scaleup_rank", c.psum_rank, &[num_ranks], device)?;
        expect_i32("handle.psum_num_recv_tokens_per_expert", c.psum_expert, &[l], device)?;
        expect_i32("handle.num_unaligned_recv_tokens_per_expert", c.unaligned, &[l], device)?;
        handle_meta(c.meta, k, device)?;
        cached_rows = Some(c.recv_rows);
    }
    Ok(DispatchPlan {
        x: x.ptr,
        x_dtype,
        sf: sf_ptr,
        sf_dtype,
        sf_token_stride: sf_ts,
        sf_pack_stride: sf_ps,
        num_sf_packs: packs,
        topk_idx: idx.ptr,
        topk_w: req.topk_weights.map_or(0, |w| w.ptr),
        stats: req.stats.map_or(0, |s| s.ptr),
        num_tokens: n,
        hidden,
        hidden_bytes,
        num_topk: k,
        num_experts: e,
        num_ranks,
        num_local_experts: l,
        max_tokens: t,
        expert_alignment: req.expert_alignment,
        num_sms: req.num_sms.max(1),
        expand: req.expand,
        zero_padding: req.zero_padding,
        cpu_sync: req.cpu_sync && req.cached.is_none(),
        fresh: req.cached.is_none(),
        cached_rows,
    })
}

/// One combine as the caller asked for it, with the handle's tensors.
#[derive(Debug, Clone, Copy)]
pub struct CombineRequest<'a> {
    pub x: &'a Arg,
    pub topk_weights: Option<&'a Arg>,
    pub bias: [Option<&'a Arg>; 2],
    /// The handle's `recv_src_metadata`, `psum_num_recv_tokens_per_scaleup_rank`, `topk_idx`
    /// and plan.
    pub meta: &'a Arg,
    pub psum_rank: &'a Arg,
    pub topk_idx: &'a Arg,
    pub plan: &'a Arg,
    pub num_experts: usize,
    pub max_tokens: usize,
    pub expand: bool,
    pub allow_multiple_reduction: bool,
    pub num_sms: usize,
}

/// A checked combine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CombinePlan {
    pub x: u64,
    pub topk_w: u64,
    pub bias: [u64; 2],
    pub meta: u64,
    pub psum_rank: u64,
    pub topk_idx: u64,
    pub send_counts: u64,
    pub x_rows: usize,
    pub meta_rows: usize,
    pub num_tokens: usize,
    pub hidden: usize,
    pub num_topk: usize,
    pub num_experts: usize,
    pub max_tokens: usize,
    pub expand: bool,
    /// One partial row per (token, rank), summed where the experts are (plain layout, or
    /// expanded with `allow_multiple_reduction`); else one row per (token, selection).
    pub per_rank: bool,
    pub num_sms: usize,
}

/// Check a combine (see [`dispatch`] for the arguments).
pub fn combine(req: &CombineRequest<'_>, num_ranks: usize, data_bytes: usize, device: usize) -> Result<CombinePlan> {
    let x = req.x;
    kind("x", x, &[DType::Bf16], 2)?;
    contiguous("x", x)?;
    on_device("x", x, device)?;
    let (rows, hidden) = (x.shape[0], x.shape[1]);
    if hidden % 8 != 0 {
        return bad(format!("x rows must be a multiple of 16 bytes (hidden={hidden} bfloat16); pad hidden"));
    }
    let idx = req.topk_idx;
    kind("handle.topk_idx", idx, &[DType::I64], 2)?;
    let (n, k) = (idx.shape[0], idx.shape[1]);
    let e = req.num_experts;
    expect_i32("handle's plan", req.plan, &[plan_len(n, k, num_ranks, e)], device)?;
    expect_i32("handle.psum_num_recv_tokens_per_scaleup_rank", req.psum_rank, &[num_ranks], device)?;
    handle_meta(req.meta, k, device)?;
    on_device("handle.topk_idx", idx, device)?;
    if let Some(w) = req.topk_weights {
        kind("topk_weights", w, &[DType::F32], if req.expand { 1 } else { 2 })?;
        let want: Vec<usize> = if req.expand { vec![rows] } else { vec![rows, k] };
        if w.shape != want {
            return bad(format!(
                "topk_weights must have shape {want:?} ({}), got {:?}",
                if req.expand { "one weight per expanded row" } else { "x's rows by num_topk" },
                w.shape
            ));
        }
        contiguous("topk_weights", w)?;
        on_device("topk_weights", w, device)?;
    }
    let mut bias = [0u64; 2];
    for (i, b) in req.bias.iter().enumerate() {
        if let Some(b) = b {
            let what = if i == 0 { "bias[0]" } else { "bias[1]" };
            kind(what, b, &[DType::Bf16], 2)?;
            if b.shape != [n, hidden] {
                return bad(format!("{what} must be bfloat16 [num_tokens={n}, hidden={hidden}], got {:?}", b.shape));
            }
            contiguous(what, b)?;
            on_device(what, b, device)?;
            bias[i] = b.ptr;
        }
    }
    let need = combine_bytes(req.max_tokens, hidden, k);
    if need > data_bytes {
        return bad(format!(
            "this combine needs {need} data bytes per rank ({} tokens x top-{k} rows of hidden {hidden}) but the buffer has {data_bytes}; \
             create the ElasticBuffer with num_bytes=ElasticBuffer.get_buffer_size_hint(group, {}, {hidden}, {k}, ...)",
            req.max_tokens, req.max_tokens
        ));
    }
    Ok(CombinePlan {
        x: x.ptr,
        topk_w: req.topk_weights.map_or(0, |w| w.ptr),
        bias,
        meta: req.meta.ptr,
        psum_rank: req.psum_rank.ptr,
        topk_idx: idx.ptr,
        send_counts: req.plan.ptr + (2 * n * k * 4) as u64,
        x_rows: rows,
        meta_rows: req.meta.shape[0],
        num_tokens: n,
        hidden,
        num_topk: k,
        num_experts: e,
        max_tokens: req.max_tokens,
        expand: req.expand,
        per_rank: !req.expand || req.allow_multiple_reduction,
        num_sms: req.num_sms.max(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::Device;

    fn t(dtype: DType, shape: &[usize]) -> Arg {
        Arg::contiguous(dtype, shape, 0x1000, Device::Cuda(0))
    }

    fn req<'a>(x: &'a Arg, idx: &'a Arg) -> DispatchRequest<'a> {
        DispatchRequest {
            x,
            sf: None,
            topk_idx: idx,
            topk_weights: None,
            stats: None,
            cached: None,
            num_experts: 16,
            max_tokens: 64,
            expert_alignment: 1,
            num_sms: 8,
            expand: false,
            zero_padding: false,
            cpu_sync: true,
        }
    }

    #[test]
    fn a_good_dispatch_is_planned_and_sized() {
        let (x, idx) = (t(DType::Bf16, &[10, 256]), t(DType::I64, &[10, 4]));
        let p = dispatch(&req(&x, &idx), 4, 1 << 30, 0).unwrap();
        assert_eq!((p.num_tokens, p.hidden_bytes, p.num_topk, p.num_local_experts), (10, 512, 4, 4));
        let rows = p.output_rows(Some(&Counts { num_recv_tokens: 7, per_expert: vec![3, 0, 5, 1] }));
        assert_eq!((rows.recv_rows, rows.meta_rows), (7, 7));
        assert_eq!(rows.per_expert_aligned, vec![3, 0, 5, 1]);
        // without sync: the worst case
        let rows = p.output_rows(None);
        assert_eq!((rows.recv_rows, rows.meta_rows), (4 * 64, 4 * 64));
        assert!(rows.per_expert_aligned.is_empty());
    }

    #[test]
    fn expanded_rows_are_the_aligned_counts_or_the_worst_case() {
        let (x, idx) = (t(DType::Bf16, &[10, 256]), t(DType::I64, &[10, 4]));
        let mut r = req(&x, &idx);
        r.expand = true;
        r.expert_alignment = 8;
        let p = dispatch(&r, 4, 1 << 30, 0).unwrap();
        let rows = p.output_rows(Some(&Counts { num_recv_tokens: 7, per_expert: vec![3, 0, 9, 1] }));
        assert_eq!((rows.recv_rows, rows.meta_rows, rows.num_expanded_tokens), (8 + 16 + 8, 7, 32)); // aligned 3, 0, 9, 1
        // every token of 4 ranks x 64 selecting min(4, 4) local experts, plus padding
        assert_eq!(p.output_rows(None).recv_rows, align(4 * 64 * 4 + 4 * 7, 8));
    }

    #[test]
    fn bad_dispatches_are_refused_naming_the_fix() {
        let (x, idx) = (t(DType::Bf16, &[10, 256]), t(DType::I64, &[10, 4]));
        let msg = |r: DispatchRequest<'_>, data: usize| dispatch(&r, 4, data, 0).unwrap_err().to_string();
        let mut r = req(&x, &idx);
        r.num_experts = 10;
        assert!(msg(r, 1 << 30).contains("multiple of the group size 4"));
        let mut r = req(&x, &idx);
        r.max_tokens = 5;
        assert!(msg(r, 1 << 30).contains("num_max_tokens_per_rank is 5"));
        assert!(msg(req(&x, &idx), 1000).contains("get_buffer_size_hint"));
        let f = t(DType::F32, &[10, 256]);
        assert!(msg(req(&f, &idx), 1 << 30).contains("x must be one of"));
        let i32_idx = t(DType::I32, &[10, 4]);
        assert!(msg(req(&x, &i32_idx), 1 << 30).contains("topk_idx must be torch.int64"));
        let fp8 = t(DType::Fp8E4m3, &[10, 256]);
        assert!(msg(req(&fp8, &idx), 1 << 30).contains("(x, sf)"));
        let mut r = req(&x, &idx);
        r.zero_padding = true;
        assert!(msg(r, 1 << 30).contains("do_expand=True"));
        let host = Arg::contiguous(DType::Bf16, &[10, 256], 0x1000, Device::Cpu);
        assert!(msg(req(&host, &idx), 1 << 30).contains(".cuda()"));
    }

    #[test]
    fn fp8_scales_of_any_stride_are_taken_as_given() {
        let (x, idx) = (t(DType::Fp8E4m3, &[10, 512]), t(DType::I64, &[10, 4]));
        // column-major [10, 4]
        let sf = Arg { strides: vec![1, 12], ..t(DType::F32, &[10, 4]) };
        let mut r = req(&x, &idx);
        r.sf = Some(&sf);
        let p = dispatch(&r, 4, 1 << 30, 0).unwrap();
        assert_eq!((p.num_sf_packs, p.sf_token_stride, p.sf_pack_stride), (4, 1, 12));
        let short = t(DType::F32, &[9, 4]);
        r.sf = Some(&short);
        assert!(dispatch(&r, 4, 1 << 30, 0).unwrap_err().to_string().contains("one row per token"));
    }

    #[test]
    fn combine_checks_weights_bias_and_capacity() {
        let (x, idx) = (t(DType::Bf16, &[20, 256]), t(DType::I64, &[10, 4]));
        let plan = t(DType::I32, &[plan_len(10, 4, 4, 16)]);
        let (meta, psum) = (t(DType::I32, &[20, 6]), t(DType::I32, &[4]));
        let w = t(DType::F32, &[20, 4]);
        let b = t(DType::Bf16, &[10, 256]);
        let mk = |expand: bool, w: Option<&'static Arg>| -> CombineRequest<'static> {
            let leak = |a: &Arg| -> &'static Arg { Box::leak(Box::new(a.clone())) };
            CombineRequest {
                x: leak(&x),
                topk_weights: w,
                bias: [Some(leak(&b)), None],
                meta: leak(&meta),
                psum_rank: leak(&psum),
                topk_idx: leak(&idx),
                plan: leak(&plan),
                num_experts: 16,
                max_tokens: 64,
                expand,
                allow_multiple_reduction: true,
                num_sms: 4,
            }
        };
        let w: &'static Arg = Box::leak(Box::new(w));
        let p = combine(&mk(false, Some(w)), 4, 1 << 30, 0).unwrap();
        assert!(p.per_rank && p.topk_w != 0 && p.bias[0] != 0 && p.bias[1] == 0);
        assert_eq!(p.send_counts, 0x1000 + 2 * 10 * 4 * 4);
        // expanded weights are one per row
        let e = combine(&mk(true, Some(w)), 4, 1 << 30, 0).unwrap_err().to_string();
        assert!(e.contains("topk_weights must be 1-D"), "{e}");
        let e = combine(&mk(false, None), 4, 100, 0).unwrap_err().to_string();
        assert!(e.contains("get_buffer_size_hint"), "{e}");
        let mut r = mk(true, None);
        r.allow_multiple_reduction = false;
        assert!(!combine(&r, 4, 1 << 30, 0).unwrap().per_rank);
    }
}
