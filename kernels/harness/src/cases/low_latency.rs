//! GPU test cases of the low-latency kernels against the CPU reference (`reference::low_latency`).
//!
//! Every round: ragged token counts (0, 1, num_max or random) and inputs from `(seed, rank)`, so
//! every rank computes the reference of all ranks locally; dispatch (optionally through the
//! receive hook), download, check counts / layout / src_info / payload / scales as multisets per
//! (local expert, source); then combine with expert outputs `y` that are a pure function of
//! `(seed, owner, local expert, source, token)` (unused rows are NaN, so reading one is caught),
//! and check the weighted sum against the bounded reference. All collective GPU work of a round
//! happens before any check can fail, so a failing rank never leaves its peers waiting.

use half::bf16;

use deepep_kernels::nvshmem::binding::{self, HostLib, Version};
use deepep_kernels::low_latency::{CombineVersion, DispatchVersion, LlDispatchOpts, LlDispatchOut, LlTransport, LowLatencyBuffer};
use super::{Case, CaseResult, Ctx};
use deepep_kernels::reference::low_latency::{LlPacked, LlScalesView};
use deepep_kernels::reference::random::{self, InputSpec};
use deepep_kernels::reference::{ll_combine, ll_dispatch, LlOptions, Payload, RankInput};
use deepep_kernels::tensor::Tensor;

/// One LL configuration.
#[derive(Debug, Clone, Copy)]
struct Shape {
    num_max: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
}

/// Mode of one round.
#[derive(Debug, Clone, Copy)]
struct Mode {
    opts: LlOptions,
    hook: bool,
}

const BF16: Mode = Mode { opts: LlOptions::BF16, hook: false };
const FP8: Mode = Mode { opts: LlOptions::FP8, hook: false };
const FP8_ROUND: Mode = Mode { opts: LlOptions { use_fp8: true, round_scale: true, use_ue8m0: false }, hook: false };
const FP8_UE8M0: Mode = Mode { opts: LlOptions { use_fp8: true, round_scale: true, use_ue8m0: true }, hook: false };

fn mode_name(m: Mode) -> String {
    let base = match (m.opts.use_fp8, m.opts.round_scale, m.opts.use_ue8m0) {
        (false, _, _) => "bf16",
        (true, false, _) => "fp8",
        (true, true, false) => "fp8-round",
        (true, true, true) => "fp8-ue8m0",
    };
    if m.hook { format!("{base}+hook") } else { base.to_string() }
}

/// A deterministic pseudo-random bf16 expert output row for (owner, local expert, source, token).
fn y_row(seed: u64, owner: usize, le: usize, src: usize, t: usize, h: usize) -> Vec<bf16> {
    let mut z = seed ^ (owner as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (le as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (src as u64).wrapping_mul(0x1656_67B1_9E37_79F9) ^ (t as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (0..h)
        .map(|_| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^= x >> 31;
            // Uniform in [-2, 2) with 16 significant bits, then rounded to bf16.
            let v = ((x >> 48) as f32 / 65536.0 - 0.5) * 4.0;
            bf16::from_f32(v)
        })
        .collect()
}

fn bytes_of_bf16(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// Everything one round downloads from the GPU.
struct Downloaded {
    x: Vec<u8>,
    scales_f32: Vec<f32>,
    scales_i32: Vec<i32>,
    count: Vec<i32>,
    src_info: Vec<i32>,
    layout_range: Vec<i64>,
}

/// Inputs of one round: every rank's reference inputs and this rank's tensors.
struct Round {
    seed: u64,
    tokens: Vec<usize>,
    inputs: Vec<RankInput>,
    x: Tensor,
    topk: Tensor,
    weights: Tensor,
}

fn make_round(c: &Ctx, shape: Shape, seed: u64, masked: f64) -> anyhow::Result<Round> {
    let tokens = random::token_counts(seed, c.world(), shape.num_max);
    make_round_with(c, shape, seed, masked, tokens)
}

/// A round with the given token count per rank.
fn make_round_with(c: &Ctx, shape: Shape, seed: u64, masked: f64, tokens: Vec<usize>) -> anyhow::Result<Round> {
    make_round_full(c, shape, seed, masked, tokens, false)
}

/// [`make_round_with`], optionally with duplicate expert ids in some tokens' top-k.
fn make_round_full(c: &Ctx, shape: Shape, seed: u64, masked: f64, tokens: Vec<usize>, duplicates: bool) -> anyhow::Result<Round> {
    let Shape { hidden: h, topk: k, experts: e, .. } = shape;
    let spec = InputSpec { num_tokens: 0, hidden: h, num_topk: k, num_experts: e, fp8: false, masked_fraction: masked };
    let mut inputs: Vec<RankInput> = random::all_inputs(seed, &tokens, &spec);
    if duplicates {
        random::add_duplicate_experts(&mut inputs);
    }
    let mine = &inputs[c.rank()];
    let n = mine.n;
    let Payload::Bf16(xh) = &mine.x else { anyhow::bail!("reference inputs must be bf16") };
    let stream = c.gpu.stream();
    let x = Tensor::from_host(stream, xh, &[n, h])?;
    let topk = Tensor::from_host(stream, &mine.topk_idx, &[n, k])?;
    let weights = Tensor::from_host(stream, &mine.topk_weights, &[n, k])?;
    Ok(Round { seed, tokens, inputs, x, topk, weights })
}

fn dispatch_opts(mode: Mode) -> LlDispatchOpts {
    LlDispatchOpts { use_fp8: mode.opts.use_fp8, round_scale: mode.opts.round_scale, use_ue8m0: mode.opts.use_ue8m0, return_hook: mode.hook }
}

/// Download a dispatch result (after the stream was synchronized).
fn download(out: &LlDispatchOut, mode: Mode) -> anyhow::Result<Downloaded> {
    Ok(Downloaded {
        x: match mode.opts.use_fp8 {
            // e4m3 bytes download through the 1-byte host type u8.
            true => out.packed_recv_x.to_host::<u8>()?,
            false => bytes_of_bf16(&out.packed_recv_x.to_host::<bf16>()?),
        },
        scales_f32: match (&out.packed_recv_x_scales, mode.opts.use_ue8m0) {
            (Some(s), false) => s.to_host::<f32>()?,
            _ => Vec::new(),
        },
        scales_i32: match (&out.packed_recv_x_scales, mode.opts.use_ue8m0) {
            (Some(s), true) => s.to_host::<i32>()?,
            _ => Vec::new(),
        },
        count: out.packed_recv_count.to_host::<i32>()?,
        src_info: out.handle.src_info().to_host::<i32>()?,
        layout_range: out.handle.layout_range().to_host::<i64>()?,
    })
}

/// Expert outputs `y` in the packed layout of `got`: valid rows from (source, token), others
/// NaN (never read by a correct combine). Never fails on a wrong layout (checked later).
fn build_y(c: &Ctx, shape: Shape, seed: u64, got: &Downloaded) -> anyhow::Result<Tensor> {
    let (r, me, h) = (c.world(), c.rank(), shape.hidden);
    let (l, rnm) = (shape.experts / r, r * shape.num_max);
    let mut y = vec![bf16::from_bits(0x7FC1); l * rnm * h];
    for le in 0..l {
        for s in 0..r {
            let v = got.layout_range.get(le * r + s).copied().unwrap_or(0);
            let (bg, cnt) = ((v >> 32) as usize, (v & 0xffff_ffff) as usize);
            for slot in bg..(bg + cnt).min(rnm) {
                let t = got.src_info.get(le * rnm + slot).copied().unwrap_or(-1);
                if t >= 0 {
                    y[(le * rnm + slot) * h..(le * rnm + slot + 1) * h].copy_from_slice(&y_row(seed, me, le, s, t as usize, h));
                }
            }
        }
    }
    Ok(Tensor::from_host(c.gpu.stream(), &y, &[l, rnm, h])?)
}

/// Check a downloaded dispatch and combine of `rd` against the reference (expert outputs from
/// [`y_row`], as [`build_y`] wrote them).
fn check(c: &Ctx, shape: Shape, mode: Mode, rd: &Round, got: &Downloaded, combined: &[bf16]) -> CaseResult {
    let h = shape.hidden;
    check_with(c, shape, mode, rd, got, combined, &|owner, le, s, t| y_row(rd.seed, owner, le, s, t, h))
}

/// [`check`] with the expert output row of (owner, local expert, source, token) given by `y_of`.
#[allow(clippy::type_complexity)]
fn check_with(
    c: &Ctx,
    shape: Shape,
    mode: Mode,
    rd: &Round,
    got: &Downloaded,
    combined: &[bf16],
    y_of: &dyn Fn(usize, usize, usize, usize) -> Vec<bf16>,
) -> CaseResult {
    let (r, me) = (c.world(), c.rank());
    let Shape { num_max, hidden: h, experts: e, .. } = shape;
    let l = e / r;
    let tokens = &rd.tokens;
    let want = ll_dispatch(&rd.inputs, e, num_max, mode.opts, None)?;
    let scales = match (mode.opts.use_fp8, mode.opts.use_ue8m0) {
        (false, _) => LlScalesView::None,
        (true, false) => LlScalesView::F32(&got.scales_f32),
        (true, true) => LlScalesView::Ue8m0(&got.scales_i32),
    };
    let packed = LlPacked {
        num_ranks: r,
        num_local_experts: l,
        num_max,
        hidden: h,
        opts: mode.opts,
        x: &got.x,
        scales,
        count: &got.count,
        src_info: &got.src_info,
        layout_range: &got.layout_range,
    };
    packed.check(&want[me]).map_err(|m| anyhow::anyhow!("dispatch ({}, tokens {tokens:?}): {m}", mode_name(mode)))?;
    // Rows of every selection of every origin (the reference covers all ranks).
    let mut rows = std::collections::HashMap::new();
    for (s, inp) in rd.inputs.iter().enumerate() {
        for t in 0..inp.n {
            for j in 0..inp.k {
                let ex = inp.topk_idx[t * inp.k + j];
                if ex >= 0 {
                    let (owner, le) = (ex as usize / l, ex as usize % l);
                    rows.entry((owner, le, s, t)).or_insert_with(|| y_of(owner, le, s, t));
                }
            }
        }
    }
    let want_c = ll_combine(&rd.inputs, e, None, |owner, le, s, t| rows.get(&(owner, le, s, t)).map(|v| v.as_slice()))?;
    want_c[me]
        .combined_x
        .check("combined_x", combined)
        .map_err(|m| anyhow::anyhow!("combine ({}, tokens {tokens:?}): {m}", mode_name(mode)))?;
    Ok(())
}

/// One dispatch + combine round on `buf`; returns the first mismatch as an error. All
/// collective GPU work happens before any check.
fn round(c: &Ctx, buf: &mut LowLatencyBuffer, shape: Shape, mode: Mode, seed: u64, masked: f64) -> CaseResult {
    let rd = make_round(c, shape, seed, masked)?;
    round_with(c, buf, shape, mode, &rd)
}

/// Poison every rank's dispatch outputs, then meet, so a count, range or row the kernels should
/// have written but did not (e.g. a zero count or an empty range) shows as poison.
fn poison_outputs(c: &Ctx, buf: &LowLatencyBuffer) -> CaseResult {
    buf.fill_outputs(super::POISON_U32)?;
    c.gpu.sync("poisoning the LL outputs")?;
    c.comm.barrier()?;
    Ok(())
}

/// A combine output tensor filled with poison (the kernel must write every element).
fn poisoned_out(c: &Ctx, n: usize, h: usize) -> anyhow::Result<Tensor> {
    let out = Tensor::empty(c.gpu.stream(), deepep_kernels::tensor::DType::Bf16, &[n, h])?;
    out.fill_bytes(0x7F)?;
    Ok(out)
}

fn round_with(c: &Ctx, buf: &mut LowLatencyBuffer, shape: Shape, mode: Mode, rd: &Round) -> CaseResult {
    poison_outputs(c, buf)?;
    let mut out = buf.dispatch(&rd.x, &rd.topk, dispatch_opts(mode))?;
    if let Some(hook) = out.hook.take() {
        buf.recv(hook)?;
    }
    c.gpu.sync("LL dispatch")?;
    let got = download(&out, mode)?;
    let y = build_y(c, shape, rd.seed, &got)?;
    let dest = poisoned_out(c, rd.x.shape()[0], shape.hidden)?;
    let mut comb = buf.combine_into(&y, &rd.topk, &rd.weights, &out.handle, &dest, mode.hook)?;
    if let Some(hook) = comb.hook.take() {
        buf.recv(hook)?;
    }
    c.gpu.sync("LL combine")?;
    let combined = comb.combined_x.to_host::<bf16>()?;
    check(c, shape, mode, rd, &got, &combined)
}

/// Two micro-batches overlapped through hooks: send A, send B, recv A, recv B for dispatch and
/// for combine (the pattern that needs both halves and the combine ready flags).
fn overlap_round(c: &Ctx, buf: &mut LowLatencyBuffer, shape: Shape, mode: Mode, seed: u64) -> CaseResult {
    let mode = Mode { hook: true, ..mode };
    let a = make_round(c, shape, seed, 0.1)?;
    let b = make_round(c, shape, seed ^ 0x5555_5555, 0.1)?;
    let mut da = buf.dispatch(&a.x, &a.topk, dispatch_opts(mode))?;
    let mut db = buf.dispatch(&b.x, &b.topk, dispatch_opts(mode))?;
    buf.recv(da.hook.take().expect("hook"))?;
    buf.recv(db.hook.take().expect("hook"))?;
    c.gpu.sync("LL overlapped dispatches")?;
    let (ga, gb) = (download(&da, mode)?, download(&db, mode)?);
    let (ya, yb) = (build_y(c, shape, a.seed, &ga)?, build_y(c, shape, b.seed, &gb)?);
    let mut ca = buf.combine(&ya, &a.topk, &a.weights, &da.handle, true)?;
    let mut cb = buf.combine(&yb, &b.topk, &b.weights, &db.handle, true)?;
    buf.recv(ca.hook.take().expect("hook"))?;
    buf.recv(cb.hook.take().expect("hook"))?;
    c.gpu.sync("LL overlapped combines")?;
    let (oa, ob) = (ca.combined_x.to_host::<bf16>()?, cb.combined_x.to_host::<bf16>()?);
    check(c, shape, mode, &a, &ga, &oa).map_err(|e| anyhow::anyhow!("micro-batch A: {e}"))?;
    check(c, shape, mode, &b, &gb, &ob).map_err(|e| anyhow::anyhow!("micro-batch B: {e}"))
}

fn shape_case(name: &str, shape: Shape, modes: &'static [Mode], rounds: usize) -> Case {
    version_case(name, DispatchVersion::V2, shape, modes, rounds)
}

/// A case on one buffer with the given dispatch kernel version (`ll/v1/...` for v1).
fn version_case(name: &str, version: DispatchVersion, shape: Shape, modes: &'static [Mode], rounds: usize) -> Case {
    let prefix = if version == DispatchVersion::V1 { "ll/v1" } else { "ll" };
    Case::new(format!("{prefix}/{name}"), move |c| {
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, shape.num_max, shape.hidden, shape.experts, None)?;
        buf.set_dispatch_version(version)?;
        for i in 0..rounds {
            let mode = modes[i % modes.len()];
            round(c, &mut buf, shape, mode, c.seed.wrapping_add(i as u64 * 0x1000_0001), 0.1)?;
        }
        Ok(())
    })
    .min_world(1)
}

const ALL_MODES: &[Mode] = &[
    BF16,
    FP8,
    FP8_ROUND,
    FP8_UE8M0,
    Mode { opts: LlOptions::FP8, hook: true },
    Mode { opts: LlOptions::BF16, hook: true },
];

const BF16_MODES: &[Mode] = &[BF16, Mode { opts: LlOptions::BF16, hook: true }];

/// Rounds with no tokens anywhere, then with no tokens on some ranks only (every rank's counts,
/// ranges and combine output must still be written: the outputs are poisoned before each round).
fn zero_tokens_case(shape: Shape) -> Case {
    Case::new(format!("ll/zero-tokens/{}x{}of{}", shape.hidden, shape.topk, shape.experts), move |c| {
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, shape.num_max, shape.hidden, shape.experts, None)?;
        let w = c.world();
        let patterns: [Vec<usize>; 3] = [
            vec![0; w],
            (0..w).map(|r| if r % 2 == 0 { 0 } else { shape.num_max }).collect(),
            (0..w).map(|r| if r == w - 1 { 1 } else { 0 }).collect(),
        ];
        for (i, tokens) in patterns.into_iter().enumerate() {
            let rd = make_round_full(c, shape, c.seed.wrapping_add(i as u64), 0.0, tokens, false)?;
            for mode in [BF16, FP8] {
                round_with(c, &mut buf, shape, mode, &rd)?;
            }
        }
        Ok(())
    })
    .min_world(1)
}

/// Some tokens select one expert twice in their top-k.
fn duplicates_case(shape: Shape) -> Case {
    Case::new(format!("ll/duplicate-experts/{}x{}of{}", shape.hidden, shape.topk, shape.experts), move |c| {
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, shape.num_max, shape.hidden, shape.experts, None)?;
        for (i, mode) in [BF16, FP8, Mode { opts: LlOptions::BF16, hook: true }].into_iter().enumerate() {
            let seed = c.seed.wrapping_add(i as u64 * 0x1000_0001);
            let tokens = random::token_counts(seed, c.world(), shape.num_max);
            let rd = make_round_full(c, shape, seed, 0.1, tokens, true)?;
            round_with(c, &mut buf, shape, mode, &rd)?;
        }
        Ok(())
    })
    .min_world(1)
}

/// The LL cases registered with `deepep-gpu-tests`.
pub fn cases() -> Vec<Case> {
    let deepep = Shape { num_max: 128, hidden: 7168, topk: 8, experts: 288 };
    let mut v = vec![
        Case::new("ll/host_library_matches_cubins", |_c| {
            // The library NVSHMEM would load here must be the one the cubins were linked with,
            // and a missing library must give the documented message.
            let served = deepep_kernels::nvshmem::served_releases()?;
            let lib = HostLib::load(&served)?;
            anyhow::ensure!(served.contains(&lib.version()), "host {} vs cubins for {served:?}", lib.version());
            let v = deepep_kernels::cubins::NVSHMEM_VERSION.ok_or_else(|| anyhow::anyhow!("built without NVSHMEM"))?;
            let e = HostLib::load_from(&[std::path::PathBuf::from("/nonexistent/lib/libnvshmem_host.so.3")], &[])
                .unwrap_err()
                .to_string();
            anyhow::ensure!(e.contains("cannot load the NVSHMEM host library") && e.contains("NVSHMEM_DIR"), "{e}");
            let other = Version::new(v.0, v.1 + 1, 0);
            let e = binding::check_version(lib.version(), lib.path(), Some(other)).unwrap_err().to_string();
            anyhow::ensure!(e.contains("version mismatch") && e.contains(&other.to_string()), "{e}");
            Ok(())
        }),
        shape_case("bf16/7168x8of288", deepep, &[BF16], 2),
        shape_case("fp8/7168x8of288", deepep, &[FP8], 2),
        shape_case("fp8-round/7168x8of288", deepep, &[FP8_ROUND], 2),
        shape_case("fp8-ue8m0/7168x8of288", deepep, &[FP8_UE8M0], 2),
        shape_case("hook/7168x8of288", deepep, &[Mode { opts: LlOptions::FP8, hook: true }, Mode { opts: LlOptions::BF16, hook: true }], 2),
        shape_case("shapes/2048x1of16", Shape { num_max: 256, hidden: 2048, topk: 1, experts: 16 }, ALL_MODES, 6),
        shape_case("shapes/4096x9of64", Shape { num_max: 256, hidden: 4096, topk: 9, experts: 64 }, ALL_MODES, 6),
        shape_case("shapes/7168x4of256", Shape { num_max: 32, hidden: 7168, topk: 4, experts: 256 }, ALL_MODES, 6),
        shape_case("shapes/2048x6of32-nm2", Shape { num_max: 2, hidden: 2048, topk: 6, experts: 32 }, ALL_MODES, 6),
        shape_case("shapes/4096x3of128", Shape { num_max: 64, hidden: 4096, topk: 3, experts: 128 }, ALL_MODES, 6),
        shape_case("repeat/7168x8of288x40", deepep, ALL_MODES, 40),
        // A hidden size with a half 256-channel unit at the end (BF16 only: FP8 needs H % 512).
        shape_case("shapes/1152x5of32-bf16", Shape { num_max: 64, hidden: 1152, topk: 5, experts: 32 }, BF16_MODES, 4),
        overlap_case(DispatchVersion::V2),
        graph_case(),
        combine_overlap_case(CombineVersion::V1),
        overlap_case(DispatchVersion::V1),
        version_case("fp8/7168x8of288", DispatchVersion::V1, deepep, &[FP8, FP8_UE8M0], 2),
        combine_deepep_case(CombineVersion::V1, deepep),
        // Combine v3 with other owner/origin warp splits: none (every warp sends, then reduces),
        // few and many owner warps, and a small grid where each origin warp loops over several
        // batches of units.
        split_case(0, None, deepep),
        split_case(2, None, deepep),
        split_case(15, None, deepep),
        split_case(6, Some(6), Shape { num_max: 128, hidden: 4096, topk: 8, experts: 64 }),
        put_case("dispatch-v2-combine-v3", DispatchVersion::V2, CombineVersion::V3, deepep),
        // Was dispatch-v2-combine-v2 at this shape until combine v2 was retired: the same
        // (pre-reducing) protocol over puts now runs on v3, so put mode keeps a second shape.
        put_case("dispatch-v2-combine-v3", DispatchVersion::V2, CombineVersion::V3, Shape { num_max: 64, hidden: 2048, topk: 6, experts: 32 }),
        put_case("dispatch-v1-combine-v1", DispatchVersion::V1, CombineVersion::V1, Shape { num_max: 64, hidden: 4096, topk: 9, experts: 64 }),
        version_case("shapes/4096x9of64", DispatchVersion::V1, Shape { num_max: 256, hidden: 4096, topk: 9, experts: 64 }, ALL_MODES, 6),
        version_case("repeat/7168x8of288x12", DispatchVersion::V1, deepep, ALL_MODES, 12),
    ];
    v.push(old_handles_case(DispatchVersion::V2, CombineVersion::V3));
    v.push(old_handles_case(DispatchVersion::V2, CombineVersion::V1));
    v.push(old_handles_case(DispatchVersion::V1, CombineVersion::V1));
    v.push(zero_tokens_case(Shape { num_max: 64, hidden: 2048, topk: 8, experts: 64 }));
    v.push(duplicates_case(Shape { num_max: 128, hidden: 4096, topk: 8, experts: 64 }));
    v
}

/// `ll/combine-v1/...` or `ll/combine-v3/...`.
fn combine_case_name(version: CombineVersion, rest: &str) -> String {
    let v = match version {
        CombineVersion::V1 => "v1",
        CombineVersion::V3 => "v3",
    };
    format!("ll/combine-{v}/{rest}")
}

/// Two hooked micro-batches interleaved with plain rounds, on the given combine kernel.
fn combine_overlap_case(version: CombineVersion) -> Case {
    Case::new(combine_case_name(version, "overlap-hooks/4096x8of64"), move |c| {
        let shape = Shape { num_max: 128, hidden: 4096, topk: 8, experts: 64 };
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, shape.num_max, shape.hidden, shape.experts, None)?;
        buf.set_combine_version(version)?;
        for (i, mode) in [FP8, BF16, FP8_UE8M0].into_iter().enumerate() {
            overlap_round(c, &mut buf, shape, mode, c.seed.wrapping_add(i as u64 * 0x5000_000B))?;
            round(c, &mut buf, shape, mode, c.seed.wrapping_add(i as u64 * 0x6000_000D), 0.1)?;
        }
        Ok(())
    })
}

/// Every mode at the DeepEP shape, on the given combine kernel.
fn combine_deepep_case(version: CombineVersion, deepep: Shape) -> Case {
    Case::new(combine_case_name(version, "7168x8of288"), move |c| {
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, deepep.num_max, deepep.hidden, deepep.experts, None)?;
        buf.set_combine_version(version)?;
        for (i, mode) in ALL_MODES.iter().enumerate() {
            round(c, &mut buf, deepep, *mode, c.seed.wrapping_add(i as u64 * 0x4000_0007), 0.1)?;
        }
        Ok(())
    })
}

/// Combine v3 with `owner_warps` owner warps per block (and optionally fewer SMs), every mode.
fn split_case(owner_warps: usize, num_sms: Option<usize>, shape: Shape) -> Case {
    let sms = num_sms.map_or(String::new(), |n| format!("-sms{n}"));
    let name = format!("ll/combine-v3-w{owner_warps}{sms}/{}x{}of{}", shape.hidden, shape.topk, shape.experts);
    Case::new(name, move |c| {
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, shape.num_max, shape.hidden, shape.experts, num_sms)?;
        buf.set_combine_version(CombineVersion::V3)?;
        buf.set_combine_owner_warps(owner_warps)?;
        for (i, mode) in ALL_MODES.iter().enumerate() {
            round(c, &mut buf, shape, *mode, c.seed.wrapping_add(i as u64 * 0x7000_0011), 0.1)?;
        }
        Ok(())
    })
}

/// Replays of a captured CUDA graph holding two (BF16 dispatch, copy, combine) calls, so both
/// halves of the buffer alternate as in eager use. The expert outputs are the dispatched rows
/// themselves (copied inside the graph), so combine must give `Σ_k w·x` of each origin token.
/// Fresh routing, weights and tokens are copied into the captured input tensors before every
/// replay (token counts stay those of the capture); every replay is downloaded first and all are
/// checked against the reference at the end (no rank leaves the collective replays early). An
/// eager round afterwards checks that the buffer's sequence numbers kept counting.
fn graph_case() -> Case {
    Case::new("ll/cuda-graph/2048x8of64", |c| {
        let shape = Shape { num_max: 32, hidden: 2048, topk: 8, experts: 64 };
        let (r, h) = (c.world(), shape.hidden);
        let (l, rnm) = (shape.experts / r, r * shape.num_max);
        let tokens: Vec<usize> = (0..r).map(|i| shape.num_max - (3 * i) % shape.num_max).collect();
        let mode = BF16;
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, shape.num_max, h, shape.experts, None)?;
        let stream = c.gpu.stream().clone();
        let cap = [make_round_with(c, shape, c.seed, 0.1, tokens.clone())?, make_round_with(c, shape, c.seed ^ 0xA5A5, 0.1, tokens.clone())?];
        let n = tokens[c.rank()];
        let ys = [Tensor::empty(&stream, deepep_kernels::tensor::DType::Bf16, &[l, rnm, h])?, Tensor::empty(&stream, deepep_kernels::tensor::DType::Bf16, &[l, rnm, h])?];
        let outs = [Tensor::empty(&stream, deepep_kernels::tensor::DType::Bf16, &[n, h])?, Tensor::empty(&stream, deepep_kernels::tensor::DType::Bf16, &[n, h])?];
        let y_bytes = l * rnm * h * 2;
        // The calls of one replay (also run once eagerly first: lazily set kernel attributes).
        let calls = |buf: &mut LowLatencyBuffer| -> anyhow::Result<Vec<LlDispatchOut>> {
            let mut ds = Vec::new();
            for i in 0..2 {
                let d = buf.dispatch(&cap[i].x, &cap[i].topk, dispatch_opts(mode))?;
                c.gpu.copy_dtod(ys[i].ptr(), d.packed_recv_x.ptr(), y_bytes)?;
                buf.combine_into(&ys[i], &cap[i].topk, &cap[i].weights, &d.handle, &outs[i], false)?;
                ds.push(d);
            }
            Ok(ds)
        };
        calls(&mut buf)?;
        c.gpu.sync("LL eager calls before the capture")?;
        stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| anyhow::anyhow!("begin stream capture: {e:?}"))?;
        let captured = calls(&mut buf);
        let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        let ds = captured?;
        let graph = graph.map_err(|e| anyhow::anyhow!("end stream capture / instantiate: {e:?}"))?.ok_or_else(|| anyhow::anyhow!("empty graph"))?;
        let mut replays = Vec::new();
        for rep in 0..6u64 {
            let fresh = [
                make_round_with(c, shape, c.seed.wrapping_add(0x100 + 2 * rep), 0.1, tokens.clone())?,
                make_round_with(c, shape, c.seed.wrapping_add(0x101 + 2 * rep), 0.1, tokens.clone())?,
            ];
            for i in 0..2 {
                for (dst, src) in [(&cap[i].x, &fresh[i].x), (&cap[i].topk, &fresh[i].topk), (&cap[i].weights, &fresh[i].weights)] {
                    c.gpu.copy_dtod(dst.ptr(), src.ptr(), src.numel() * src.dtype().size())?;
                }
            }
            graph.launch().map_err(|e| anyhow::anyhow!("graph replay {rep}: {e:?}"))?;
            c.gpu.sync("LL graph replay")?;
            let mut got = Vec::new();
            for i in 0..2 {
                got.push((download(&ds[i], mode)?, outs[i].to_host::<bf16>()?));
            }
            replays.push((fresh, got));
        }
        for (rep, (fresh, got)) in replays.iter().enumerate() {
            for i in 0..2 {
                let rd = &fresh[i];
                let x_of = |_owner: usize, _le: usize, s: usize, t: usize| match &rd.inputs[s].x {
                    Payload::Bf16(v) => v[t * h..(t + 1) * h].to_vec(),
                    _ => Vec::new(),
                };
                check_with(c, shape, mode, rd, &got[i].0, &got[i].1, &x_of)
                    .map_err(|e| anyhow::anyhow!("graph replay {rep}, call {i}: {e}"))?;
            }
        }
        drop(graph);
        round(c, &mut buf, shape, FP8, c.seed ^ 0x77, 0.1).map_err(|e| anyhow::anyhow!("eager round after the replays: {e}"))
    })
}

/// The NVSHMEM put kernels (`ll_*_put`: what runs across hosts over IBGDA), forced on this host:
/// data to every other rank through `nvshmemx_putmem_warp` from per-warp staging, flags through
/// `nvshmemx_signal_op` after `nvshmem_quiet`, over NVSHMEM's P2P transport. Every mode, then two
/// micro-batches overlapped through hooks.
fn put_case(name: &str, dispatch: DispatchVersion, combine: CombineVersion, shape: Shape) -> Case {
    Case::new(format!("ll/put/{name}/{}x{}of{}", shape.hidden, shape.topk, shape.experts), move |c| {
        let mut buf =
            LowLatencyBuffer::with_transport(c.gpu, c.comm, shape.num_max, shape.hidden, shape.experts, None, LlTransport::Put)?;
        anyhow::ensure!(c.world() == 1 || !buf.all_p2p(), "the put transport selected the NVLink-only kernels");
        buf.set_dispatch_version(dispatch)?;
        buf.set_combine_version(combine)?;
        for (i, mode) in ALL_MODES.iter().enumerate() {
            round(c, &mut buf, shape, *mode, c.seed.wrapping_add(i as u64 * 0x8000_0013), 0.1)?;
        }
        overlap_round(c, &mut buf, shape, FP8, c.seed ^ 0x0F0F)
    })
}

/// DeepEP's handle is self-contained: four dispatches with different routings, then a combine
/// with each handle, oldest first. Dispatches C and D reuse the halves of A and B while their
/// handles are alive, so A's and B's combines (and their `src_info` / `layout_range`) must read
/// the handles' own copies; every output is checked against the reference, and the routing read
/// back after the reuse must equal the routing downloaded before it.
fn old_handles_case(dispatch: DispatchVersion, combine: CombineVersion) -> Case {
    let v = if dispatch == DispatchVersion::V1 { "v1" } else { "v2" };
    let name = combine_case_name(combine, &format!("old-handles-dispatch-{v}/4096x8of64"));
    Case::new(name, move |c| {
        let shape = Shape { num_max: 64, hidden: 4096, topk: 8, experts: 64 };
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, shape.num_max, shape.hidden, shape.experts, None)?;
        buf.set_dispatch_version(dispatch)?;
        buf.set_combine_version(combine)?;
        for (pass, mode) in [BF16, FP8].into_iter().enumerate() {
            let rounds: Vec<Round> =
                (0..4).map(|i| make_round(c, shape, c.seed.wrapping_add((pass * 4 + i) as u64 * 0x7000_0011), 0.1)).collect::<anyhow::Result<_>>()?;
            let mut outs = Vec::new();
            let mut got = Vec::new();
            for rd in &rounds {
                let out = buf.dispatch(&rd.x, &rd.topk, dispatch_opts(mode))?;
                c.gpu.sync("LL dispatch")?;
                got.push(download(&out, mode)?); // before a later dispatch reuses the half
                outs.push(out);
            }
            for (i, (rd, out)) in rounds.iter().zip(&outs).enumerate() {
                anyhow::ensure!(out.handle.is_copied() == (i < 2), "dispatch {i}: handle copied = {}", out.handle.is_copied());
                let src_info = out.handle.src_info().to_host::<i32>()?;
                let layout_range = out.handle.layout_range().to_host::<i64>()?;
                anyhow::ensure!(src_info == got[i].src_info && layout_range == got[i].layout_range,
                                "dispatch {i}: the handle's routing after two later dispatches differs from before");
                let y = build_y(c, shape, rd.seed, &got[i])?;
                let dest = poisoned_out(c, rd.x.shape()[0], shape.hidden)?;
                let comb = buf.combine_into(&y, &rd.topk, &rd.weights, &out.handle, &dest, false)?;
                c.gpu.sync("LL combine with an older handle")?;
                let combined = comb.combined_x.to_host::<bf16>()?;
                check(c, shape, mode, rd, &got[i], &combined).map_err(|e| anyhow::anyhow!("handle of dispatch {i} of 4: {e}"))?;
            }
        }
        Ok(())
    })
    .min_world(1)
}

/// Two micro-batches overlapped through hooks, interleaved with plain rounds.
fn overlap_case(version: DispatchVersion) -> Case {
    let prefix = if version == DispatchVersion::V1 { "ll/v1" } else { "ll" };
    Case::new(format!("{prefix}/overlap-hooks/4096x8of64"), move |c| {
        let shape = Shape { num_max: 128, hidden: 4096, topk: 8, experts: 64 };
        let mut buf = LowLatencyBuffer::new(c.gpu, c.comm, shape.num_max, shape.hidden, shape.experts, None)?;
        buf.set_dispatch_version(version)?;
        for (i, mode) in [FP8, BF16, FP8_UE8M0, FP8, BF16].into_iter().enumerate() {
            overlap_round(c, &mut buf, shape, mode, c.seed.wrapping_add(i as u64 * 0x2000_0003))?;
            // A plain round in between: the next calls still wait (hooks in the last two).
            round(c, &mut buf, shape, mode, c.seed.wrapping_add(i as u64 * 0x3000_0005), 0.1)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn y_rows_are_deterministic_and_distinct() {
        let a = y_row(1, 0, 3, 1, 7, 256);
        assert_eq!(a, y_row(1, 0, 3, 1, 7, 256));
        assert_ne!(a, y_row(1, 0, 3, 1, 8, 256));
        assert_ne!(a, y_row(1, 1, 3, 1, 7, 256));
        assert!(a.iter().all(|v| v.to_f32().abs() <= 2.0 && v.to_f32().is_finite()));
    }

    #[test]
    fn every_case_has_a_unique_name() {
        let c = cases();
        let mut names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), c.len());
    }
}
