//! GPU test cases of the intranode family, run by `deepep-gpu-tests` (the runner: `crate::gpu_test`).
//!
//! Every case generates the inputs of ALL ranks from the case seed (`reference::random`), so each
//! rank computes the CPU reference locally, runs layout -> (fresh) dispatch -> [cached dispatch]
//! -> combine on the GPU and compares: layout and dispatch outputs bit for bit, combine within the
//! bound of the exact f64 sum AND bit for bit against the contract's summation order (biases, then
//! ranks ascending, in f32), which the kernel follows. The receive/staging regions and the combine
//! outputs are poisoned before every call. Several rounds per case reuse one `Buffer` (epochs,
//! self-resetting counters).

use deepep_kernels::intranode::{Buffer, CombineArgs, DispatchArgs, DispatchOutput, Layout};
use deepep_kernels::config::Config;
use deepep_kernels::error::EpError;
use super::{Case, CaseResult, Ctx, POISON_U32};
use deepep_kernels::reference::compare::bit_exact;
use deepep_kernels::reference::random::{self, streams, InputSpec};
use deepep_kernels::reference::{self, DispatchOut, Payload, RankInput};
use deepep_kernels::tensor::{DType, Tensor};
use anyhow::{anyhow, bail, Context as _};
use half::bf16;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
enum Tokens {
    /// Per-rank counts from `random::token_counts` (0, 1, max or uniform), at most this many.
    Ragged(usize),
    /// Exactly this many on every rank.
    Fixed(usize),
}

#[derive(Debug, Clone, Copy)]
struct Spec {
    tokens: Tokens,
    hidden: usize,
    topk: usize,
    experts: usize,
    fp8: bool,
    column_major_scales: bool,
    masked: f64,
    alignment: usize,
    biases: usize,
    weights: bool,
    cached: bool,
    rounds: usize,
    config: Config,
    /// Some tokens select one expert twice ([`random::add_duplicate_experts`]).
    duplicates: bool,
}

impl Spec {
    fn new(tokens: Tokens, hidden: usize, topk: usize, experts: usize) -> Spec {
        Spec {
            tokens,
            hidden,
            topk,
            experts,
            fp8: false,
            column_major_scales: false,
            masked: 0.0,
            alignment: 1,
            biases: 0,
            weights: true,
            cached: false,
            rounds: 1,
            config: Config::default(),
            duplicates: false,
        }
    }
    fn fp8(mut self) -> Self {
        self.fp8 = true;
        self
    }
    fn column_major(mut self) -> Self {
        self.column_major_scales = true;
        self
    }
    fn masked(mut self, f: f64) -> Self {
        self.masked = f;
        self
    }
    fn alignment(mut self, a: usize) -> Self {
        self.alignment = a;
        self
    }
    fn biases(mut self, b: usize) -> Self {
        self.biases = b;
        self
    }
    fn no_weights(mut self) -> Self {
        self.weights = false;
        self
    }
    fn cached(mut self) -> Self {
        self.cached = true;
        self
    }
    fn rounds(mut self, r: usize) -> Self {
        self.rounds = r;
        self
    }
    fn config(mut self, c: Config) -> Self {
        self.config = c;
        self
    }
    fn duplicates(mut self) -> Self {
        self.duplicates = true;
        self
    }
}

fn check(r: Result<(), String>) -> CaseResult {
    r.map_err(|m| anyhow!(m))
}

/// Upload a payload: bf16 `[n, h]`, or fp8 bytes + scales (optionally as a column-major view).
fn upload_payload(s: &Arc<cudarc::driver::CudaStream>, p: &Payload, n: usize, h: usize, column_major: bool) -> anyhow::Result<(Tensor, Option<Tensor>)> {
    Ok(match p {
        Payload::Bf16(v) => (Tensor::from_host(s, v, &[n, h])?, None),
        Payload::Fp8 { data, scales } => {
            let x = Tensor::from_host_as(s, DType::Fp8E4m3, data, &[n, h])?;
            let g = h / 128;
            let sc = if column_major {
                let mut t = vec![0f32; scales.len()];
                for row in 0..n {
                    for col in 0..g {
                        t[col * n + row] = scales[row * g + col];
                    }
                }
                Tensor::from_host(s, &t, &[g, n])?.t()?
            } else {
                Tensor::from_host(s, scales, &[n, g])?
            };
            (x, Some(sc))
        }
    })
}

fn poisoned(c: &Ctx, dtype: DType, shape: &[usize]) -> anyhow::Result<Tensor> {
    let t = Tensor::empty(c.gpu.stream(), dtype, shape)?;
    let bytes = t.numel() * dtype.size();
    if bytes > 0 {
        c.gpu.memset_u32(t.ptr(), POISON_U32, bytes / 4)?;
    }
    Ok(t)
}

/// Compare received rows (and scales) with the reference payload.
fn check_payload(what: &str, recv_x: &Tensor, recv_scales: Option<&Tensor>, want: &Payload, h: usize) -> CaseResult {
    match want {
        Payload::Bf16(v) => check(bit_exact(&format!("{what} recv_x"), &recv_x.to_host::<bf16>()?, v, h)),
        Payload::Fp8 { data, scales } => {
            check(bit_exact(&format!("{what} recv_x (fp8)"), &recv_x.to_host::<u8>()?, data, h))?;
            let s = recv_scales.ok_or_else(|| anyhow!("{what}: fp8 dispatch returned no recv_scales"))?;
            check(bit_exact(&format!("{what} recv_scales"), &s.to_host::<f32>()?, scales, h / 128))
        }
    }
}

fn check_dispatch(out: &DispatchOutput, want: &DispatchOut, me: usize, r: usize, k: usize, h: usize) -> CaseResult {
    let m = want.num_recv_tokens;
    if out.handle.num_recv_tokens != m {
        bail!("rank {me} received {} rows, expected {m}", out.handle.num_recv_tokens);
    }
    check_payload("fresh dispatch", &out.recv_x, out.recv_scales.as_ref(), &want.recv_x, h)?;
    let idx = out.recv_topk_idx.as_ref().ok_or_else(|| anyhow!("fresh dispatch returned no recv_topk_idx"))?;
    check(bit_exact("recv_topk_idx", &idx.to_host::<i64>()?, &want.recv_topk_idx, k))?;
    let w = out.recv_topk_weights.as_ref().ok_or_else(|| anyhow!("fresh dispatch returned no recv_topk_weights"))?;
    check(bit_exact("recv_topk_weights", &w.to_host::<f32>()?, &want.recv_topk_weights, k))?;
    check(bit_exact("recv_src_idx", &out.handle.recv_src_idx.to_host::<i32>()?, &want.recv_src_idx, 1))?;
    if out.num_recv_tokens_per_expert != want.num_recv_tokens_per_expert {
        bail!("num_recv_tokens_per_expert {:?}, expected {:?}", out.num_recv_tokens_per_expert, want.num_recv_tokens_per_expert);
    }
    let prefix = out.handle.rank_prefix_matrix(r);
    let column: Vec<i32> = (0..r).map(|s| prefix[s * r + me]).collect();
    if column != want.rank_prefix {
        bail!("rank_prefix_matrix column {column:?}, expected {:?}", want.rank_prefix);
    }
    Ok(())
}

fn inputs_for(seed: u64, counts: &[usize], s: &Spec) -> Vec<RankInput> {
    let spec = InputSpec { num_tokens: 0, hidden: s.hidden, num_topk: s.topk, num_experts: s.experts, fp8: s.fp8, masked_fraction: s.masked };
    let mut inputs = random::all_inputs(seed, counts, &spec);
    if s.duplicates {
        random::add_duplicate_experts(&mut inputs);
    }
    inputs
}

fn run(c: &Ctx, s: &Spec) -> CaseResult {
    let (r, me) = (c.world(), c.rank());
    let counts = match s.tokens {
        Tokens::Ragged(m) => random::token_counts(c.seed, r, m),
        Tokens::Fixed(n) => vec![n; r],
    };
    let capacity = match s.tokens {
        Tokens::Ragged(m) | Tokens::Fixed(m) => m.max(1),
    };
    let (h, k, e) = (s.hidden, s.topk, s.experts);
    let stream = c.gpu.stream().clone();
    let mut buf = Buffer::new(c.gpu, c.comm, capacity, h)?;
    let result = (|| -> CaseResult {
        for round in 0..s.rounds {
            let seed = c.seed ^ (round as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let inputs = inputs_for(seed, &counts, s);
            let want = reference::dispatch(&inputs, e, s.alignment)?;
            let mine = &inputs[me];
            let n = mine.n;
            let (x, scales) = upload_payload(&stream, &mine.x, n, h, s.column_major_scales)?;
            let idx = Tensor::from_host(&stream, &mine.topk_idx, &[n, k])?;
            let w = Tensor::from_host(&stream, &mine.topk_weights, &[n, k])?;

            // Layout (no communication).
            // Outputs poisoned first: a count or flag the kernel should have written shows as poison.
            let lay = Layout {
                num_tokens_per_rank: poisoned(c, DType::I32, &[r])?,
                num_tokens_per_expert: poisoned(c, DType::I32, &[e])?,
                is_token_in_rank: poisoned(c, DType::Bool, &[n, r])?,
                num_tokens: n,
                num_experts: e,
            };
            buf.dispatch_layout_into(&idx, &lay)?;
            let lref = reference::layout(&mine.topk_idx, n, k, e, r)?;
            check(bit_exact("num_tokens_per_rank", &lay.num_tokens_per_rank.to_host::<i32>()?, &lref.num_tokens_per_rank, r))?;
            check(bit_exact("num_tokens_per_expert", &lay.num_tokens_per_expert.to_host::<i32>()?, &lref.num_tokens_per_expert, e))?;
            let in_rank: Vec<u8> = lref.is_token_in_rank.iter().map(|&b| b as u8).collect();
            check(bit_exact("is_token_in_rank", &lay.is_token_in_rank.to_host::<u8>()?, &in_rank, r))?;

            // Fresh dispatch.
            buf.fill_data_regions(POISON_U32)?;
            c.comm.barrier()?; // ranks differ in CPU time; start the collective together
            let mut args = DispatchArgs::fresh(&x, &lay, &idx, &w).expert_alignment(s.alignment).config(c.fit_config(s.config));
            if let Some(sc) = &scales {
                args = args.scales(sc);
            }
            let out = buf.dispatch(args).context(format!("round {round}: fresh dispatch"))?;
            check_dispatch(&out, &want[me], me, r, k, h).context(format!("round {round}"))?;

            // Cached dispatch of new values along the same routing.
            if s.cached {
                let mut inputs2 = inputs.clone();
                let fresh_x = inputs_for(seed ^ 0x5bd1_e995, &counts, s);
                for (dst, src) in inputs2.iter_mut().zip(fresh_x) {
                    dst.x = src.x;
                }
                let want2 = reference::dispatch(&inputs2, e, s.alignment)?;
                let (x2, scales2) = upload_payload(&stream, &inputs2[me].x, n, h, s.column_major_scales)?;
                buf.fill_data_regions(POISON_U32)?;
                c.comm.barrier()?;
                let mut args = DispatchArgs::cached(&x2, &out.handle).config(c.fit_config(s.config));
                if let Some(sc) = &scales2 {
                    args = args.scales(sc);
                }
                let out2 = buf.dispatch(args).context(format!("round {round}: cached dispatch"))?;
                if out2.recv_topk_idx.is_some() || !out2.num_recv_tokens_per_expert.is_empty() {
                    bail!("cached dispatch returned top-k outputs; it must return only recv_x (and scales)");
                }
                check_payload("cached dispatch", &out2.recv_x, out2.recv_scales.as_ref(), &want2[me].recv_x, h).context(format!("round {round}"))?;
                // The first dispatch's views were overwritten: using one must fail, not read garbage.
                match out.recv_x.to_host::<u8>() {
                    Err(EpError::InvalidArgument(m)) if m.contains("to_owned") => {}
                    other => bail!("a stale recv_x view after a later dispatch gave {other:?}; expected an error naming Tensor::to_owned"),
                }
            }

            // Combine: random y per rank (aligned with its received rows), optional weights/biases.
            let ys: Vec<Vec<bf16>> = (0..r).map(|d| random::combine_rows(seed, d, streams::COMBINE_Y, want[d].num_recv_tokens, h)).collect();
            let wts: Vec<Vec<f32>> = want.iter().map(|o| o.recv_topk_weights.clone()).collect();
            let bias = |stream_id: u64| -> Vec<Vec<bf16>> { (0..r).map(|q| random::combine_rows(seed, q, stream_id, counts[q], h)).collect() };
            let b0 = (s.biases >= 1).then(|| bias(streams::BIAS0));
            let b1 = (s.biases >= 2).then(|| bias(streams::BIAS1));
            let cexp = reference::combine(
                &want,
                &inputs,
                reference::normal::CombineArgs { y: &ys, topk_weights: s.weights.then_some(&wts[..]), bias0: b0.as_deref(), bias1: b1.as_deref() },
            )?;
            let m = want[me].num_recv_tokens;
            let y = Tensor::from_host(&stream, &ys[me], &[m, h])?;
            let wt = if s.weights { Some(Tensor::from_host(&stream, &wts[me], &[m, k])?) } else { None };
            let bt0 = match &b0 {
                Some(b) => Some(Tensor::from_host(&stream, &b[me], &[n, h])?),
                None => None,
            };
            let bt1 = match &b1 {
                Some(b) => Some(Tensor::from_host(&stream, &b[me], &[n, h])?),
                None => None,
            };
            let out_x = poisoned(c, DType::Bf16, &[n, h])?;
            let out_w = if s.weights { Some(poisoned(c, DType::F32, &[n, k])?) } else { None };
            c.comm.barrier()?;
            let mut cargs = CombineArgs::new(&y, &out.handle).bias(bt0.as_ref(), bt1.as_ref()).config(c.fit_config(s.config));
            if let Some(wt) = &wt {
                cargs = cargs.weights(wt);
            }
            buf.combine_into(cargs, &out_x, out_w.as_ref()).context(format!("round {round}: combine"))?;
            c.gpu.sync("intranode combine")?;
            let got = out_x.to_host::<bf16>()?;
            let ce = &cexp[me];
            check(ce.combined_x.check("combined_x", &got)).context(format!("round {round}"))?;
            check(ce.combined_x.check_bit_exact("combined_x (contract summation order)", &got)).context(format!("round {round}"))?;
            if let (Some(ow), Some(cw)) = (&out_w, &ce.combined_topk_weights) {
                let gw = ow.to_host::<f32>()?;
                check(cw.check("combined_topk_weights", &gw)).context(format!("round {round}"))?;
            }
        }
        Ok(())
    })();
    c.free_then("intranode case teardown", buf, result)
}

fn case(name: &str, s: Spec) -> Case {
    Case::new(format!("intranode/{name}"), move |c| run(c, &s)).min_world(2)
}

/// A rank that never joins the collective: the others must fail with a GPU timeout naming the
/// phase and the missing peer, and refuse further calls on the poisoned buffer.
fn peer_missing_times_out(c: &Ctx) -> CaseResult {
    let mut buf = Buffer::new(c.gpu, c.comm, 64, 2048)?;
    let result = (|| -> CaseResult {
        if c.rank() != 0 {
            return Ok(());
        }
        let s = Spec::new(Tokens::Fixed(64), 2048, 4, 16);
        let inputs = inputs_for(c.seed, &[64], &s);
        let stream = c.gpu.stream().clone();
        let (x, _) = upload_payload(&stream, &inputs[0].x, 64, 2048, false)?;
        let idx = Tensor::from_host(&stream, &inputs[0].topk_idx, &[64, 4])?;
        let w = Tensor::from_host(&stream, &inputs[0].topk_weights, &[64, 4])?;
        let lay = buf.dispatch_layout(&idx, 16)?;
        let old = c.gpu.device_timeout();
        c.gpu.set_device_timeout(Duration::from_millis(200));
        let r = buf.dispatch(DispatchArgs::fresh(&x, &lay, &idx, &w).config(c.fit_config(Config::default())));
        c.gpu.set_device_timeout(old);
        match r {
            Err(EpError::GpuTimeout { rank, phase, peer, .. }) => {
                if rank != 0 || phase != "notify" || peer <= 0 {
                    bail!("timeout names rank {rank}, phase {phase}, peer {peer}; expected rank 0, phase notify, a peer > 0");
                }
            }
            other => bail!("dispatch without peers returned {other:?}; expected a GPU timeout"),
        }
        match buf.dispatch(DispatchArgs::fresh(&x, &lay, &idx, &w).config(c.fit_config(Config::default()))) {
            Err(EpError::InvalidArgument(m)) if m.contains("recreate") => Ok(()),
            other => bail!("a poisoned buffer accepted another dispatch: {other:?}"),
        }
    })();
    c.free_then("teardown", buf, result)
}

/// An expert id outside `[-1, E)` is dropped and reported by the layout kernel (device-side
/// check, not fatal): the stream completes without error, the record names the first bad
/// position and its value, and the buffer keeps working.
fn layout_bad_expert_id(c: &Ctx) -> CaseResult {
    let mut buf = Buffer::new(c.gpu, c.comm, 16, 128)?;
    let result = (|| -> CaseResult {
        let e = 8 * c.world();
        let mut ids = vec![0i64; 16 * 2];
        ids[13] = e as i64; // token 6, slot 1
        ids[20] = -2; // token 10, slot 0: a later bad id; the first one is reported
        let idx = Tensor::from_host(c.gpu.stream(), &ids, &[16, 2])?;
        let lay = buf.dispatch_layout(&idx, e)?;
        c.gpu.sync("layout with a bad id")?;
        match c.gpu.take_error() {
            Some(EpError::BadExpertId { token: 6, slot: 1, value, num_experts, ref call, .. })
                if value == e as i32 && num_experts == e as i32 && call == "get_dispatch_layout" => {}
            other => bail!("a bad expert id gave {other:?}; expected BadExpertId at topk_idx[6, 1] in get_dispatch_layout"),
        }
        if c.gpu.error_record().code != 0 {
            bail!("taking the argument record did not clear it: {:?}", c.gpu.error_record());
        }
        // Dropped, i.e. counted like -1: token 6 has expert 0 only, token 10 expert 0 only.
        let per_expert = lay.num_tokens_per_expert.to_host::<i32>()?;
        if per_expert[0] != 30 || per_expert.iter().sum::<i32>() != 30 {
            bail!("tokens per expert {per_expert:?}: expected 30 selections of expert 0 (32 minus the two bad ids, dropped)");
        }
        // The buffer stays usable: a clean layout runs and reports nothing.
        let clean = Tensor::from_host(c.gpu.stream(), &vec![0i64; 32], &[16, 2])?;
        buf.dispatch_layout(&clean, e)?;
        c.gpu.sync("layout after a bad id")?;
        if let Some(err) = c.gpu.take_error() {
            bail!("a clean layout after a bad one reported {err}");
        }
        Ok(())
    })();
    c.free_then("bad expert id case end", buf, result)
}

/// The intranode cases, in a fixed order.
pub fn cases() -> Vec<Case> {
    let odd = Config { num_sms: 5, dispatch_warps: 7, combine_warps: 7, combine_push_warps: 3, combine_push_rows: 3, ..Config::default() };
    let tiny = Config { num_sms: 1, dispatch_warps: 1, combine_warps: 2, combine_push_warps: 1, combine_push_rows: 1, ..Config::default() };
    let wide = Config { num_sms: 32, dispatch_warps: 16, combine_warps: 24, combine_push_warps: 16, combine_push_rows: 4, ..Config::default() };
    let split = Config { num_sms: 12, dispatch_warps: 20, dispatch_local_warps: 6, ..Config::default() };
    let mut v = vec![
        case("deepep_shape_bf16_cached", Spec::new(Tokens::Fixed(4096), 7168, 8, 256).cached()),
        case("deepep_shape_fp8_cached", Spec::new(Tokens::Fixed(4096), 7168, 8, 256).fp8().cached()),
        case("ragged_bf16_h2048_k1_e16_masked", Spec::new(Tokens::Ragged(300), 2048, 1, 16).masked(0.3).biases(1).rounds(2)),
        case("ragged_fp8_h4096_k6_e64_colmajor_align128", Spec::new(Tokens::Ragged(512), 4096, 6, 64).fp8().column_major().alignment(128).biases(2).cached()),
        case("ragged_bf16_h7168_k8_e256_two_biases", Spec::new(Tokens::Ragged(1024), 7168, 8, 256).masked(0.1).biases(2).cached().rounds(2)),
        case("ragged_bf16_h4096_k6_e128_no_weights", Spec::new(Tokens::Ragged(777), 4096, 6, 128).no_weights().biases(1)),
        case("topk32_h2048_e256", Spec::new(Tokens::Ragged(200), 2048, 32, 256).masked(0.2)),
        case("one_token_each_h7168", Spec::new(Tokens::Fixed(1), 7168, 8, 128).biases(2).cached()),
        case("zero_tokens_everywhere", Spec::new(Tokens::Fixed(0), 2048, 8, 16).cached()),
        case("fp8_tokens_8192_h4096", Spec::new(Tokens::Fixed(8192), 4096, 8, 256).fp8().cached()),
        case("odd_config_5sms_7warps", Spec::new(Tokens::Ragged(700), 4096, 8, 64).biases(1).cached().config(odd)),
        case("single_block_single_warp", Spec::new(Tokens::Ragged(150), 2048, 4, 32).biases(1).cached().config(tiny)),
        case("reuse_six_rounds", Spec::new(Tokens::Ragged(256), 4096, 8, 64).masked(0.05).cached().rounds(6)),
        case("wide_config_32sms_push4", Spec::new(Tokens::Ragged(2048), 7168, 8, 256).biases(1).cached().rounds(2).config(wide)),
        case("hidden_1160_bf16_multiple_of_8_not_128", Spec::new(Tokens::Ragged(600), 1160, 8, 64).biases(1).cached().rounds(2)),
        case("duplicate_experts_in_topk_bf16", Spec::new(Tokens::Ragged(800), 2048, 8, 64).duplicates().masked(0.05).cached().rounds(2)),
        case("duplicate_experts_in_topk_fp8", Spec::new(Tokens::Ragged(500), 4096, 6, 32).fp8().duplicates().cached()),
        case("odd_hidden_2176_bf16_two_biases", Spec::new(Tokens::Ragged(640), 2176, 8, 32).biases(2).cached().rounds(2)),
        case("split_dispatch_roles_fp8", Spec::new(Tokens::Ragged(1500), 4096, 8, 64).fp8().masked(0.1).cached().rounds(2).config(split)),
        Case::new("intranode/layout_bad_expert_id_reported", layout_bad_expert_id).min_world(2),
        Case::new("intranode/peer_missing_times_out", peer_missing_times_out).min_world(2),
    ];
    // The experimental bulk-copy dispatch is only registered on request: a fault in it would be a
    // sticky CUDA error that ends every later case of the run.
    if std::env::var("DEEPEP_TEST_INTRANODE_TMA").is_ok_and(|v| v == "1") {
        let tma = Config { dispatch_tma: true, combine_tma: true, ..Config::default() };
        let tma_split = Config { dispatch_tma: true, combine_tma: true, dispatch_local_warps: 8, num_sms: 7, combine_push_warps: 5, combine_push_rows: 3, ..Config::default() };
        v.push(case("tma_dispatch_bf16_ragged", Spec::new(Tokens::Ragged(3000), 7168, 8, 256).masked(0.05).cached().rounds(2).config(tma)));
        v.push(case("tma_dispatch_fp8_h2176_split", Spec::new(Tokens::Ragged(900), 2176, 6, 64).fp8().biases(1).cached().rounds(2).config(tma_split)));
        v.push(case("tma_bf16_h2176_odd_rows", Spec::new(Tokens::Ragged(700), 2176, 8, 32).biases(2).rounds(2).config(tma_split)));
    }
    v
}
