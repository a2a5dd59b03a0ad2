//! GPU test cases of the internode (two-hop) family, run by `deepep-gpu-tests`.
//!
//! Every case draws ragged token counts (incl. 0 and 1) and inputs from the case seed, computes
//! the CPU reference of ALL ranks locally (`reference::dispatch`, `reference::combine_internode`),
//! runs dispatch (fresh, then optionally cached) and combine on a fresh [`InternodeBuffer`], and
//! compares: dispatch outputs bit-exact, combine within the reference's rigorous bound AND
//! bit-exact (our kernels sum in the contract's order: biases, then hosts ascending; inside a
//! host, ranks ascending). Outputs are poisoned before every launch. Each case repeats its
//! dispatch/combine several times on the same buffer to catch races and stale-signal bugs.
//!
//! `ranks_per_host = 1` makes every token take the inter-host path (NVSHMEM put + signal);
//! `ranks_per_host = world` keeps everything in one host, exercising the NVLink hop (pull from
//! the forwarder, gather in combine). Both are run.

use deepep_kernels::internode::{
    nvshmem_runtime, CombineArgs, DispatchArgs, DispatchOutput, InternodeBuffer, InternodeConfig,
};
use deepep_kernels::nvshmem::NvshmemRuntime;
use super::{Case, CaseResult, Ctx};
use deepep_kernels::reference::{self, random, Payload};
use deepep_kernels::reference::compare::Bits;
use deepep_kernels::tensor::{DType, Element, Tensor};
use anyhow::{anyhow, bail, Context as _};
use half::bf16;
use std::sync::Arc;

/// Poison byte for fresh outputs: 0x7F7F.. is NaN as e4m3, 3.4e38 as bf16 / f32, and an
/// implausible id as i32 / i64.
const POISON_BYTE: u8 = 0x7F;

fn nvshmem(ctx: &Ctx) -> anyhow::Result<Arc<NvshmemRuntime>> {
    nvshmem_runtime(ctx.gpu, ctx.comm).context("starting NVSHMEM")
}

#[derive(Debug, Clone, Copy)]
struct Spec {
    max_tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    fp8: bool,
    masked: f64,
    cached: bool,
    biases: usize,
    with_weights: bool,
    alignment: usize,
    num_sms: usize,
    /// false: every GPU is its own host (`ranks_per_host = 1`); true: one host of all ranks.
    one_host: bool,
    /// Some(p): hosts of exactly `p` ranks (overrides `one_host`; the case needs `2p` ranks).
    hosts_of: Option<usize>,
    /// Every rank dispatches exactly `max_tokens` (instead of ragged counts incl. 0 and 1).
    full: bool,
    /// `InternodeConfig::p2p_direct`: NVLink stores into reachable remote hosts instead of puts.
    p2p: bool,
    reps: usize,
}

const BASE: Spec = Spec {
    max_tokens: 128,
    hidden: 7168,
    topk: 8,
    experts: 256,
    fp8: false,
    masked: 0.0,
    cached: true,
    biases: 0,
    with_weights: true,
    alignment: 1,
    num_sms: 24,
    one_host: false,
    hosts_of: None,
    full: false,
    p2p: false,
    reps: 3,
};

/// The registered cases.
pub fn cases() -> Vec<Case> {
    let mut specs: Vec<(&str, Spec)> = vec![
        ("bf16 h7168 k8 e256", BASE),
        ("fp8 h7168 k8 e256", Spec { fp8: true, ..BASE }),
        (
            "bf16 h2048 k1 e16 bias1",
            Spec {
                hidden: 2048,
                topk: 1,
                experts: 16,
                biases: 1,
                max_tokens: 64,
                ..BASE
            },
        ),
        (
            "fp8 h4096 k6 e64 masked",
            Spec {
                hidden: 4096,
                topk: 6,
                experts: 64,
                fp8: true,
                masked: 0.1,
                ..BASE
            },
        ),
        (
            "bf16 h4096 k6 e128 align4 bias2",
            Spec {
                hidden: 4096,
                topk: 6,
                experts: 128,
                alignment: 4,
                biases: 2,
                ..BASE
            },
        ),
        (
            "bf16 h7168 k8 e256 tokens<=1",
            Spec {
                max_tokens: 1,
                reps: 4,
                ..BASE
            },
        ),
        (
            "bf16 h2048 k8 e32 sms2",
            Spec {
                hidden: 2048,
                experts: 32,
                num_sms: 2,
                max_tokens: 200,
                ..BASE
            },
        ),
        (
            "bf16 h2048 k6 e64 sms64 no-weights",
            Spec {
                hidden: 2048,
                topk: 6,
                experts: 64,
                num_sms: 64,
                with_weights: false,
                ..BASE
            },
        ),
        (
            "bf16 h7168 k8 e256 4096 tokens",
            Spec {
                max_tokens: 4096,
                reps: 2,
                biases: 1,
                full: true,
                ..BASE
            },
        ),
        (
            "fp8 h7168 k8 e256 1024 tokens",
            Spec {
                fp8: true,
                max_tokens: 1024,
                full: true,
                ..BASE
            },
        ),
        (
            "fp8 h7168 k8 e256 race x20",
            Spec {
                fp8: true,
                masked: 0.05,
                max_tokens: 512,
                reps: 20,
                ..BASE
            },
        ),
        (
            "bf16 h7168 k8 e256 bias2 p2p-direct",
            Spec {
                p2p: true,
                biases: 2,
                ..BASE
            },
        ),
        (
            "fp8 h4096 k6 e64 masked race x10 p2p-direct",
            Spec {
                p2p: true,
                fp8: true,
                hidden: 4096,
                topk: 6,
                experts: 64,
                masked: 0.1,
                max_tokens: 512,
                reps: 10,
                ..BASE
            },
        ),
        (
            "bf16 h7168 k8 e256 1024 tokens p2p-direct",
            Spec {
                p2p: true,
                max_tokens: 1024,
                full: true,
                ..BASE
            },
        ),
    ];
    let one_host: Vec<(String, Spec)> = specs
        .iter()
        // One host has no remote host: skip the big case and the p2p-direct ones (no effect).
        .filter(|(n, s)| !n.contains("4096 tokens") && !s.p2p)
        .map(|(n, s)| {
            (
                format!("{n} one-host"),
                Spec {
                    one_host: true,
                    ..*s
                },
            )
        })
        .collect();
    // Several ranks per host and several hosts: both hops with more than one local rank.
    let mut hosts: Vec<(String, Spec)> = Vec::new();
    for p in [2usize, 4] {
        for (n, s) in specs.iter().filter(|(n, _)| {
            *n == "bf16 h7168 k8 e256" || *n == "fp8 h4096 k6 e64 masked" || *n == "bf16 h4096 k6 e128 align4 bias2"
        }) {
            hosts.push((format!("{n} hosts-of-{p}"), Spec { hosts_of: Some(p), ..*s }));
        }
    }
    let mut out: Vec<Case> = specs
        .drain(..)
        .map(|(n, s)| case(format!("internode {n} 2-hop"), s))
        .collect();
    out.extend(hosts.into_iter().map(|(n, s)| {
        let min = 2 * s.hosts_of.unwrap_or(1);
        case(format!("internode {n}"), s).min_world(min)
    }));
    out.extend(
        one_host
            .into_iter()
            .map(|(n, s)| case(format!("internode {n}"), s)),
    );
    for one_host in [false, true] {
        let name = if one_host { "one-host" } else { "2-hop" };
        out.push(
            Case::new(
                format!("internode back-to-back x30 no host sync {name}"),
                move |ctx| back_to_back(ctx, one_host),
            )
            .min_world(2),
        );
    }
    out.push(Case::new("internode rejects bad arguments", bad_arguments).min_world(2));
    out.push(
        Case::new(
            "internode timeout names rank and phase",
            timeout_names_phase,
        )
        .min_world(2),
    );
    out
}

fn case(name: String, spec: Spec) -> Case {
    Case::new(name, move |ctx| run(ctx, &spec)).min_world(2)
}

fn upload_payload(
    stream: &Arc<cudarc::driver::CudaStream>,
    p: &Payload,
    n: usize,
    h: usize,
) -> anyhow::Result<(Tensor, Option<Tensor>)> {
    Ok(match p {
        Payload::Bf16(v) => (Tensor::from_host(stream, v, &[n, h])?, None),
        Payload::Fp8 { data, scales } => (
            Tensor::from_host_as(stream, DType::Fp8E4m3, data, &[n, h])?,
            Some(Tensor::from_host(stream, scales, &[n, h / 128])?),
        ),
    })
}

fn check(what: &str, r: Result<(), String>) -> anyhow::Result<()> {
    r.map_err(|e| anyhow!("{what}: {e}"))
}

/// The output `name` (an error when it is missing) against `want` bit for bit, rows of `cols`.
fn check_exact<T: Element + Bits>(what: &str, name: &str, got: Option<&Tensor>, want: &[T], cols: usize) -> CaseResult {
    let got: Vec<T> = got.ok_or_else(|| anyhow!("{what}: no {name}"))?.to_host()?;
    check(what, reference::compare::bit_exact(name, &got, want, cols))
}

/// The ranks of a host when the whole world should be one host: the largest divisor of the world
/// that fits a host (all of it for <= 8 ranks).
fn one_host_ranks(world: usize) -> usize {
    (1..=deepep_kernels::internode::plan::MAX_RANKS_PER_HOST.min(world)).rev().find(|p| world % p == 0).unwrap_or(1)
}

/// Every rank's combine input `y` (`[num_recv_tokens, h]` of its dispatch), so each rank can
/// compute the reference of all.
fn combine_inputs(seed: u64, expected: &[reference::normal::DispatchOut], h: usize) -> Vec<Vec<bf16>> {
    (0..expected.len()).map(|d| random::combine_rows(seed, d, random::streams::COMBINE_Y, expected[d].num_recv_tokens, h)).collect()
}

fn run(ctx: &Ctx, spec: &Spec) -> CaseResult {
    let (rank, world) = (ctx.rank(), ctx.world());
    let Spec {
        hidden: h,
        topk: k,
        experts: e,
        ..
    } = *spec;
    // One host: the largest divisor of the world that fits a host (all of it for <= 8 ranks).
    let rph = if let Some(p) = spec.hosts_of {
        if world % p != 0 {
            return Err(super::Skip(format!("hosts of {p} ranks need a world that is a multiple of {p}, not {world}")).into());
        }
        p
    } else if spec.one_host {
        one_host_ranks(world)
    } else {
        1
    };
    let tokens = if spec.full {
        vec![spec.max_tokens; world]
    } else {
        random::token_counts(ctx.seed, world, spec.max_tokens)
    };
    let ispec = random::InputSpec {
        num_tokens: 0,
        hidden: h,
        num_topk: k,
        num_experts: e,
        fp8: spec.fp8,
        masked_fraction: spec.masked,
    };
    let inputs = random::all_inputs(ctx.seed, &tokens, &ispec);
    let expected = reference::dispatch(&inputs, e, spec.alignment)?;
    // Combine inputs of every rank (for the reference) and this rank's tensors.
    let ys = combine_inputs(ctx.seed, &expected, h);
    let ws: Vec<Vec<f32>> = expected
        .iter()
        .map(|o| o.recv_topk_weights.clone())
        .collect();
    let bias_of = |stream: u64| -> Vec<Vec<bf16>> {
        (0..world)
            .map(|s| random::combine_rows(ctx.seed, s, stream, tokens[s], h))
            .collect()
    };
    let b0 = (spec.biases >= 1).then(|| bias_of(random::streams::BIAS0));
    let b1 = (spec.biases >= 2).then(|| bias_of(random::streams::BIAS1));
    let wc = reference::normal::combine_internode_rank(
        &expected,
        &inputs,
        reference::normal::CombineArgs {
            y: &ys,
            topk_weights: spec.with_weights.then_some(ws.as_slice()),
            bias0: b0.as_deref(),
            bias1: b1.as_deref(),
        },
        rph,
        rank,
    )?;

    let nv = nvshmem(ctx)?;
    let mut cfg = InternodeConfig::new(rph, spec.max_tokens, h);
    cfg.num_sms = ctx.gpu.fit_sms_even(spec.num_sms);
    cfg.max_topk = k;
    cfg.max_local_experts = e / world;
    cfg.p2p_direct = spec.p2p;
    let mut buf = InternodeBuffer::new(ctx.gpu, ctx.comm, &nv, cfg)?;
    buf.set_output_poison(Some(POISON_BYTE));
    let s = ctx.gpu.stream().clone();
    let me = &inputs[rank];
    let n = me.n;
    let (x, scales) = upload_payload(&s, &me.x, n, h)?;
    let topk_idx = Tensor::from_host(&s, &me.topk_idx, &[n, k])?;
    let topk_w = Tensor::from_host(&s, &me.topk_weights, &[n, k])?;
    let y = Tensor::from_host(&s, &ys[rank], &[expected[rank].num_recv_tokens, h])?;
    let bias0 = b0
        .as_ref()
        .map(|b| Tensor::from_host(&s, &b[rank], &[n, h]))
        .transpose()?;
    let bias1 = b1
        .as_ref()
        .map(|b| Tensor::from_host(&s, &b[rank], &[n, h]))
        .transpose()?;
    let want = &expected[rank];
    let m = want.num_recv_tokens;

    let result = (|| -> CaseResult {
        for rep in 0..spec.reps {
            let at = |what: &str| format!("rep {rep}: {what}");
            let args = DispatchArgs::fresh(&x, &topk_idx, &topk_w, e).expert_alignment(spec.alignment);
            let out = dispatch_checked(ctx, &mut buf, args, scales.as_ref(), &at("dispatch"), &want.recv_x)?;
            if out.handle.num_recv_tokens != m {
                bail!(
                    "{}: received {} rows, reference {m}",
                    at("dispatch"),
                    out.handle.num_recv_tokens
                );
            }
            if out.num_recv_tokens_per_expert != want.num_recv_tokens_per_expert {
                bail!(
                    "{}: per-expert counts {:?}, reference {:?}",
                    at("dispatch"),
                    out.num_recv_tokens_per_expert,
                    want.num_recv_tokens_per_expert
                );
            }
            check_exact(&at("dispatch"), "recv_topk_idx", out.recv_topk_idx.as_ref(), &want.recv_topk_idx, k)?;
            check_exact(&at("dispatch"), "recv_topk_weights", out.recv_topk_weights.as_ref(), &want.recv_topk_weights, k)?;
            check_exact(&at("dispatch"), "recv_src_idx", Some(&out.handle.recv_src_idx), &want.recv_src_idx, 1)?;

            if spec.cached {
                dispatch_checked(ctx, &mut buf, DispatchArgs::cached(&x, &out.handle), scales.as_ref(), &at("cached dispatch"), &want.recv_x)?;
            }

            let rw = out.recv_topk_weights.as_ref().unwrap();
            let mut cargs = CombineArgs::new(&y, &out.handle).bias(bias0.as_ref(), bias1.as_ref());
            if spec.with_weights {
                cargs = cargs.weights(rw);
            }
            let comb = buf.combine(cargs).with_context(|| at("combine"))?;
            ctx.gpu
                .sync("internode combine")
                .with_context(|| at("combine"))?;
            let got: Vec<bf16> = comb.combined_x.to_host()?;
            check(&at("combined_x"), wc.combined_x.check("combined_x", &got))?;
            check(
                &at("combined_x (contract order)"),
                wc.combined_x.check_bit_exact("combined_x", &got),
            )?;
            match (&wc.combined_topk_weights, &comb.combined_topk_weights) {
                (Some(want_w), Some(got_w)) => {
                    let got_w: Vec<f32> = got_w.to_host()?;
                    check(
                        &at("combined_topk_weights"),
                        want_w.check("combined_topk_weights", &got_w),
                    )?;
                }
                (None, None) => {}
                (a, b) => bail!(
                    "{}: combined weights expected {} got {}",
                    at("combine"),
                    a.is_some(),
                    b.is_some()
                ),
            }
        }
        Ok(())
    })();
    ctx.free_then("internode case end", buf, result)
}

/// Dispatches `args` (with `scales` for FP8), waits for it and checks the received rows (and
/// scales) against `want`; `what` names the call in errors.
fn dispatch_checked(ctx: &Ctx, buf: &mut InternodeBuffer, args: DispatchArgs, scales: Option<&Tensor>, what: &str, want: &Payload) -> anyhow::Result<DispatchOutput> {
    let args = match scales {
        Some(sc) => args.scales(sc),
        None => args,
    };
    let out = buf.dispatch(args).with_context(|| what.to_string())?;
    ctx.gpu.sync(what).with_context(|| what.to_string())?;
    check_payload(&format!("{what}: recv_x"), &out.recv_x, out.recv_scales.as_ref(), want)?;
    Ok(out)
}

fn check_payload(
    what: &str,
    got_x: &Tensor,
    got_scales: Option<&Tensor>,
    want: &Payload,
) -> anyhow::Result<()> {
    let h = got_x.shape().get(1).copied().unwrap_or(1).max(1);
    match want {
        Payload::Bf16(v) => {
            let g: Vec<bf16> = got_x.to_host()?;
            check(what, reference::compare::bit_exact("recv_x", &g, v, h))
        }
        Payload::Fp8 { data, scales } => {
            let g: Vec<u8> = got_x.to_host()?;
            check(
                what,
                reference::compare::bit_exact("recv_x (fp8)", &g, data, h),
            )?;
            let gs: Vec<f32> = got_scales
                .ok_or_else(|| anyhow!("{what}: no recv_scales for FP8"))?
                .to_host()?;
            check(
                what,
                reference::compare::bit_exact("recv_scales", &gs, scales, h / 128),
            )
        }
    }
}

/// A buffer of one rank per host for `max_tokens` tokens of hidden 2048 and 8 local experts (the
/// cases of bad calls).
fn small_buffer<'g>(ctx: &Ctx<'g>, max_tokens: usize) -> anyhow::Result<InternodeBuffer<'g>> {
    let nv = nvshmem(ctx)?;
    let mut cfg = InternodeConfig::new(1, max_tokens, 2048);
    cfg.num_sms = ctx.gpu.fit_sms_even(cfg.num_sms);
    cfg.max_local_experts = 8;
    Ok(InternodeBuffer::new(ctx.gpu, ctx.comm, &nv, cfg)?)
}

/// Validation happens before any launch, on every rank alike, so no rank is left waiting.
fn bad_arguments(ctx: &Ctx) -> CaseResult {
    let world = ctx.world();
    let mut buf = small_buffer(ctx, 16)?;
    let s = ctx.gpu.stream().clone();
    // (x's dtype, tokens, experts, what is wrong, what the message must name)
    let bad = [
        (DType::Bf16, 17, 8 * world, "17 tokens > capacity 16", "max_tokens_per_rank >= 17"),
        (DType::Fp8E4m3, 4, 8 * world, "fp8 without scales", "scales"),
        (DType::Bf16, 4, 8 * world + 1, "E % R != 0", ""),
    ];
    for (dtype, n, experts, what, needle) in bad {
        let x = Tensor::zeros(&s, dtype, &[n, 2048])?;
        let idx = Tensor::zeros(&s, DType::I64, &[n, 2])?;
        let w = Tensor::zeros(&s, DType::F32, &[n, 2])?;
        let e = buf.dispatch(DispatchArgs::fresh(&x, &idx, &w, experts)).err().ok_or_else(|| anyhow!("{what} accepted"))?.to_string();
        if e.is_empty() || !e.contains(needle) {
            bail!("{what}: unexpected message: {e:?}");
        }
    }
    let x = Tensor::zeros(&s, DType::Bf16, &[4, 2048])?;
    let w = Tensor::zeros(&s, DType::F32, &[4, 2])?;
    // The buffer is still usable after argument errors: a real call succeeds.
    let idx_ok: Vec<i64> = (0..4 * 2).map(|i| (i % (8 * world)) as i64).collect();
    let idx = Tensor::from_host(&s, &idx_ok, &[4, 2])?;
    let out = buf.dispatch(DispatchArgs::fresh(&x, &idx, &w, 8 * world))?;
    ctx.gpu.sync("internode dispatch after argument errors")?;
    let _ = out;
    Ok(())
}

/// A rank that skips a collective call makes the others time out (not hang) with an error that
/// names the rank, the phase and the peer that did not arrive.
fn timeout_names_phase(ctx: &Ctx) -> CaseResult {
    let (rank, world) = (ctx.rank(), ctx.world());
    let mut buf = small_buffer(ctx, 8)?;
    let s = ctx.gpu.stream().clone();
    let x = Tensor::zeros(&s, DType::Bf16, &[8, 2048])?;
    let ids: Vec<i64> = (0..8 * 2).map(|i| (i % (8 * world)) as i64).collect();
    let idx = Tensor::from_host(&s, &ids, &[8, 2])?;
    let w = Tensor::zeros(&s, DType::F32, &[8, 2])?;
    let out = buf.dispatch(DispatchArgs::fresh(&x, &idx, &w, 8 * world))?;
    ctx.gpu.sync("internode dispatch before the timeout test")?;
    let result = if rank == 0 {
        // Rank 0 alone issues a cached dispatch; every other rank skips it.
        let saved = ctx.gpu.device_timeout();
        ctx.gpu
            .set_device_timeout(std::time::Duration::from_millis(300));
        let r = buf
            .dispatch(DispatchArgs::cached(&x, &out.handle))
            .map(|_| ())
            .and_then(|_| ctx.gpu.sync("lonely cached dispatch"));
        ctx.gpu.set_device_timeout(saved);
        match r {
            Ok(()) => Err(anyhow!(
                "a dispatch without its peers completed instead of timing out"
            )),
            Err(e) => {
                let m = e.to_string();
                if m.contains("rank 0") && m.contains("'barrier'") && m.contains("waiting for rank")
                {
                    Ok(())
                } else {
                    Err(anyhow!(
                        "timeout error does not name rank 0, the barrier phase and rank 1: {m}"
                    ))
                }
            }
        }
    } else {
        Ok(())
    };
    ctx.free_then("internode timeout case end", buf, result)
}

/// Calls issued back to back without host synchronisation (like the bench loop), so a rank can be
/// a whole call ahead of its peers: 30 cached dispatches, then a combine, both checked at the end.
/// (A rank that reset a signal its local peer still polled used to hang here.)
fn back_to_back(ctx: &Ctx, one_host: bool) -> CaseResult {
    let (rank, world) = (ctx.rank(), ctx.world());
    let (h, k, e, max_tokens) = (4096usize, 8usize, 64usize, 512usize);
    let rph = if one_host { one_host_ranks(world) } else { 1 };
    let tokens = vec![max_tokens; world];
    let ispec = random::InputSpec { num_tokens: 0, hidden: h, num_topk: k, num_experts: e, fp8: false, masked_fraction: 0.0 };
    let inputs = random::all_inputs(ctx.seed, &tokens, &ispec);
    let expected = reference::dispatch(&inputs, e, 1)?;
    let ys = combine_inputs(ctx.seed, &expected, h);
    let want_comb = reference::normal::combine_internode_rank(
        &expected,
        &inputs,
        reference::normal::CombineArgs {
            y: &ys,
            topk_weights: None,
            bias0: None,
            bias1: None,
        },
        rph,
        rank,
    )?;
    let rt = nvshmem(ctx)?;
    let mut cfg = InternodeConfig::new(rph, max_tokens, h);
    cfg.num_sms = ctx.gpu.fit_sms_even(cfg.num_sms);
    cfg.max_topk = k;
    cfg.max_local_experts = e / world;
    let mut buf = InternodeBuffer::new(ctx.gpu, ctx.comm, &rt, cfg)?;
    buf.set_output_poison(Some(POISON_BYTE));
    let s = ctx.gpu.stream().clone();
    let me = &inputs[rank];
    let (x, _) = upload_payload(&s, &me.x, me.n, h)?;
    let idx = Tensor::from_host(&s, &me.topk_idx, &[me.n, k])?;
    let w = Tensor::from_host(&s, &me.topk_weights, &[me.n, k])?;
    let y = Tensor::from_host(&s, &ys[rank], &[expected[rank].num_recv_tokens, h])?;
    let result = (|| -> CaseResult {
        let first = buf.dispatch(DispatchArgs::fresh(&x, &idx, &w, e))?;
        let mut last = None;
        for _ in 0..30 {
            last = Some(buf.dispatch(DispatchArgs::cached(&x, &first.handle))?);
        }
        let comb = buf.combine(CombineArgs::new(&y, &first.handle))?;
        ctx.gpu.sync("internode back-to-back")?;
        let last = last.unwrap();
        check_payload(
            "last cached dispatch recv_x",
            &last.recv_x,
            None,
            &expected[rank].recv_x,
        )?;
        let got: Vec<bf16> = comb.combined_x.to_host()?;
        check(
            "combined_x",
            want_comb.combined_x.check_bit_exact("combined_x", &got),
        )
    })();
    ctx.free_then("internode back-to-back end", buf, result)
}
