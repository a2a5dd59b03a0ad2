//! Bench mode `intranode`: DeepEP's intranode figures for our NVLink kernels.
//!
//! Per shape (DeepEP-like routing from `bench::Routing`): dispatch BF16 and dispatch FP8 with a
//! cached handle (what DeepEP's `test_intranode.py` times), combine BF16 (no weights, no bias;
//! same byte count as the BF16 dispatch, as DeepEP reports it), and the uncached path
//! `dispatch_layout` + fresh dispatch (notify, CPU sync, dispatch). Each row carries the NCCL
//! all-to-all baseline for the same per-peer bytes (combine: the transposed counts).
//!
//! `dispatch-bf16+copy` / `dispatch-fp8+copy`: the cached dispatch followed, in the same timed
//! repetition, by a device copy of `recv_x` (and, FP8, `recv_scales`) into freshly allocated owned
//! tensors ([`Tensor::to_owned`]). Our outputs are views into the NVLink buffer (valid until the
//! next dispatch); DeepEP returns fresh tensors and copies into them inside its timed window, so
//! these rows are the like-for-like comparison with DeepEP's dispatch figures (same byte count as
//! the plain rows; the copy itself moves [`super::owned_copy_bytes`] through HBM, printed per
//! shape). Cached dispatches return no top-k outputs, here as in DeepEP's timed calls. These
//! rows have no kernel times (CUPTI records kernels, not the copies).
//!
//! `--col-major-scales`: the FP8 dispatch rows take their scales as a column-major `[N, H/128]`
//! view (physical `[H/128, N]`, [`Tensor::t`]), as DeepEP's intranode test passes them; the rows
//! are then named `dispatch-fp8 col-scales` / `dispatch-fp8+copy col-scales`.
//!
//! Configs: `--num-sms` (default 24 blocks) with the default warp split, or several configs via
//! `DEEPEP_INTRANODE_CONFIGS="sms:dispatch_warps:combine_warps:push_warps[:push_rows[:dispatch_local_warps[:tma]]],..."`
//! (e.g. `24:24:24:12,16:24:24:12:1,24:24:24:8:4:8`), each measured in turn (tuning without rebuilding).

use super::{token_bytes, BenchCtx, Row, Shape};
use deepep_kernels::config::Config;
use deepep_kernels::intranode::{Buffer, CombineArgs, DispatchArgs};
use deepep_kernels::tensor::{DType, Tensor};
use deepep_kernels::trace::TracePhase;
use deepep_kernels::{EpError, Result};

const MODE: &str = "intranode";

/// Configs to measure (see module docs).
pub fn configs(num_sms: Option<u32>) -> Result<Vec<Config>> {
    if let Ok(spec) = std::env::var("DEEPEP_INTRANODE_CONFIGS") {
        if !spec.trim().is_empty() {
            return spec.split(',').map(|c| parse_config(c.trim())).collect();
        }
    }
    Ok(vec![Config::with_sms(num_sms.map_or(Config::default().num_sms, |n| n as usize))])
}

/// `sms:dispatch_warps:combine_warps:push_warps[:push_rows[:dispatch_local_warps[:tma]]]`, tma a
/// bit mask: 1 = dispatch, 2 = combine.
pub fn parse_config(s: &str) -> Result<Config> {
    let v: Vec<usize> = s.split(':').map(|x| x.trim().parse::<usize>()).collect::<std::result::Result<_, _>>().map_err(|_| bad_config(s))?;
    if !(4..=7).contains(&v.len()) || v.get(6).is_some_and(|&t| t > 3) {
        return Err(bad_config(s));
    }
    let d = Config::default();
    let c = Config {
        num_sms: v[0],
        dispatch_warps: v[1],
        combine_warps: v[2],
        combine_push_warps: v[3],
        combine_push_rows: v.get(4).copied().unwrap_or(d.combine_push_rows),
        dispatch_local_warps: v.get(5).copied().unwrap_or(d.dispatch_local_warps),
        dispatch_tma: v.get(6).map_or(d.dispatch_tma, |&t| t & 1 == 1),
        combine_tma: v.get(6).map_or(d.combine_tma, |&t| t & 2 == 2),
    };
    c.validate(None)?;
    Ok(c)
}

fn bad_config(s: &str) -> EpError {
    EpError::InvalidArgument(format!(
        "DEEPEP_INTRANODE_CONFIGS entry {s:?} is not sms:dispatch_warps:combine_warps:push_warps[:push_rows[:dispatch_local_warps[:tma]]] (four to seven integers, tma a mask 0..=3: 1 dispatch, 2 combine; e.g. 24:24:24:12 or 24:24:24:12:2:8:3)"
    ))
}

/// Physical shape of the FP8 scales for `n` tokens and `groups = H/128` groups: row-major
/// `[n, groups]`, or column-major: `[groups, n]`, passed to the kernels transposed as `[n, groups]`.
pub fn scales_alloc_shape(n: usize, groups: usize, col_major: bool) -> [usize; 2] {
    if col_major {
        [groups, n]
    } else {
        [n, groups]
    }
}

/// Op name of an FP8 row with the scale layout appended when it is column-major.
pub fn fp8_op_name(base: &str, col_major: bool) -> String {
    if col_major {
        format!("{base} col-scales")
    } else {
        base.to_string()
    }
}

/// Run `op` once more with phase tracing and print this rank's phase times (diagnostics for
/// tuning: handshake, streaming, publish, receive). `remote_bytes`: bytes this rank sends to (or,
/// for combine, pushes back to) one peer, for the streaming rate. Collective like `op`.
fn traced(buf: &mut Buffer, name: &str, shape: Shape, remote_bytes: usize, op: &mut dyn FnMut(&mut Buffer) -> Result<()>) -> Result<()> {
    buf.set_tracing(true)?;
    let r = op(buf).and_then(|_| buf.last_trace());
    buf.set_tracing(false)?;
    if let Some(t) = r? {
        let f = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.1}"));
        let (ready, sent) = (t.get(TracePhase::Ready), t.get(TracePhase::Sent));
        let rate = match (ready, sent) {
            (Some(a), Some(b)) if b > a => format!("{:.1}", remote_bytes as f64 / ((b - a) * 1e-6) / 1e9),
            _ => "-".into(),
        };
        println!(
            "trace {name} {}x{}: ready {} us, sent {} us, published {} us, received/reduced {} us; one peer's bytes / (sent - ready) = {rate} GB/s",
            shape.tokens,
            shape.hidden,
            f(ready),
            f(sent),
            f(t.get(TracePhase::Published)),
            f(t.get(TracePhase::Received))
        );
    }
    Ok(())
}

fn op_name(base: &str, cfg: &Config, many: bool) -> String {
    if many {
        format!(
            "{base}[{}:{}:{}:{}:{}:{}:{}]",
            cfg.num_sms,
            cfg.dispatch_warps,
            cfg.combine_warps,
            cfg.combine_push_warps,
            cfg.combine_push_rows,
            cfg.dispatch_local_warps,
            cfg.dispatch_tma as u8 | (cfg.combine_tma as u8) << 1
        )
    } else {
        base.to_string()
    }
}

/// Run the intranode mode over `shapes` (collective).
pub fn run(ctx: &mut BenchCtx, shapes: &[Shape]) -> Result<Vec<Row>> {
    let (me, w) = (ctx.comm.rank(), ctx.comm.world());
    let mut cfgs = configs(ctx.opts.num_sms)?;
    if ctx.opts.num_sms.is_none() {
        // Default configs are written for a whole GPU; with several ranks per GPU each gets its share.
        for c in &mut cfgs {
            c.num_sms = ctx.gpu.fit_sms(c.num_sms);
        }
    }
    let many = cfgs.len() > 1;
    let max_tokens = shapes.iter().map(|s| s.tokens).max().unwrap_or(1).max(1);
    let max_hidden = shapes.iter().map(|s| s.hidden).max().unwrap_or(128);
    let (comm, gpu) = (ctx.comm, ctx.gpu);
    let mut buf = Buffer::new(gpu, comm, max_tokens, max_hidden)?;
    let mut rows = Vec::new();
    for &shape in shapes {
        let routing = ctx.routing(shape);
        let (n, h, k) = (shape.tokens, shape.hidden, shape.topk);
        let stream = gpu.stream().clone();
        let idx = Tensor::from_host(&stream, &routing.topk_idx[me], &[n, k])?;
        let wts = ctx.filled(DType::F32, &[n, k], 0x3e00_0000)?; // 0.125
        let x = ctx.filled(DType::Bf16, &[n, h], 0x3f80_3f80)?; // 1.0
        let x8 = ctx.filled(DType::Fp8E4m3, &[n, h], 0x3838_3838)?; // 1.0 in e4m3
        let col = ctx.opts.col_major_scales;
        let sc_phys = ctx.filled(DType::F32, &scales_alloc_shape(n, h / 128, col), 0x3f80_0000)?;
        let sc = if col { sc_phys.t()? } else { sc_phys };
        let layout = buf.dispatch_layout(&idx, shape.experts)?;
        comm.barrier()?;
        let first = buf.dispatch(DispatchArgs::fresh(&x, &layout, &idx, &wts))?;
        let handle = first.handle.clone();
        drop(first);
        let m = handle.num_recv_tokens;
        let y = ctx.filled(DType::Bf16, &[m, h], 0x3f80_3f80)?;
        let out = Tensor::empty(&stream, DType::Bf16, &[n, h])?;
        gpu.sync("intranode bench setup")?;
        if me == 0 {
            println!(
                "intranode {n}x{h}: an owned copy of rank 0's {m} received rows moves {:.1} MB (BF16) / {:.1} MB (FP8) through HBM (read + write)",
                super::owned_copy_bytes(m, h, false) as f64 / 1e6,
                super::owned_copy_bytes(m, h, true) as f64 / 1e6
            );
        }

        let recv_rows: Vec<usize> = (0..w).map(|r| routing.tokens_received(r)).collect();
        for cfg in &cfgs {
            let sms = cfg.num_sms as u32;
            for (base, fp8) in [("dispatch-bf16", false), ("dispatch-fp8", true)] {
                let tb = token_bytes(h, fp8);
                let recv_bytes: Vec<usize> = recv_rows.iter().map(|r| r * tb).collect();
                let (send, recv) = routing.dispatch_bytes(me, tb);
                let args = || if fp8 { DispatchArgs::cached(&x8, &handle).scales(&sc) } else { DispatchArgs::cached(&x, &handle) };
                let mut op = |b: &mut Buffer| -> Result<()> { b.dispatch(args().config(*cfg)).map(|_| ()) };
                let name = op_name(&if fp8 { fp8_op_name(base, col) } else { base.to_string() }, cfg, many);
                let row = ctx.measure(MODE, &name, shape, sms, &recv_bytes, &send, &recv, || op(&mut buf))?;
                rows.push(row);
                traced(&mut buf, &name, shape, send[1 - me.min(1)], &mut op)?;
                // The same dispatch followed by owned copies of its outputs (DeepEP's timed work).
                let copy_base = format!("{base}+copy");
                let name = op_name(&if fp8 { fp8_op_name(&copy_base, col) } else { copy_base.clone() }, cfg, many);
                let row = ctx.measure(MODE, &name, shape, sms, &recv_bytes, &send, &recv, || {
                    let o = buf.dispatch(args().config(*cfg))?;
                    let owned_x = o.recv_x.to_owned()?;
                    let owned_scales = o.recv_scales.as_ref().map(Tensor::to_owned).transpose()?;
                    drop((owned_x, owned_scales));
                    Ok(())
                })?;
                // CUPTI records kernels and memsets, not the device copies: a kernel time here
                // would be the dispatch's alone.
                let row = Row { kernel_us: None, kernel_gbps: None, deepep_kernel_us: None, deepep_kernel_per_rank: Vec::new(), ..row };
                rows.push(row);
            }
            // Combine: same byte count as the BF16 dispatch (DeepEP's convention); the NCCL
            // baseline moves the transpose of the dispatch counts.
            let tb = token_bytes(h, false);
            let recv_bytes: Vec<usize> = recv_rows.iter().map(|r| r * tb).collect();
            let (send, recv) = routing.dispatch_bytes(me, tb);
            let mut op = |b: &mut Buffer| -> Result<()> { b.combine_into(CombineArgs::new(&y, &handle).config(*cfg), &out, None).map(|_| ()) };
            let name = op_name("combine-bf16", cfg, many);
            let row = ctx.measure(MODE, &name, shape, sms, &recv_bytes, &recv, &send, || op(&mut buf))?;
            rows.push(row);
            traced(&mut buf, &name, shape, recv[1 - me.min(1)], &mut op)?;
        }
        // Uncached: layout + notify (count exchange, CPU sync) + dispatch, default-or-first config.
        let cfg = cfgs[0];
        let tb = token_bytes(h, false);
        let recv_bytes: Vec<usize> = recv_rows.iter().map(|r| r * tb).collect();
        let (send, recv) = routing.dispatch_bytes(me, tb);
        let row = ctx.measure(MODE, &op_name("dispatch-bf16-uncached", &cfg, many), shape, cfg.num_sms as u32, &recv_bytes, &send, &recv, || {
            let lay = buf.dispatch_layout(&idx, shape.experts)?;
            buf.dispatch(DispatchArgs::fresh(&x, &lay, &idx, &wts).config(cfg)).map(|_| ())
        })?;
        rows.push(row);
        ctx.settle("intranode bench shape done")?;
    }
    ctx.free("intranode bench teardown", buf)?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_layouts_and_names() {
        assert_eq!(scales_alloc_shape(4096, 56, false), [4096, 56]);
        assert_eq!(scales_alloc_shape(4096, 56, true), [56, 4096]);
        assert_eq!(fp8_op_name("dispatch-fp8", false), "dispatch-fp8");
        assert_eq!(fp8_op_name("dispatch-fp8+copy", true), "dispatch-fp8+copy col-scales");
    }
    #[test]
    fn parses_configs_and_rejects_bad_ones() {
        assert_eq!(
            parse_config("16:24:24:12").unwrap(),
            Config { num_sms: 16, dispatch_warps: 24, combine_warps: 24, combine_push_warps: 12, combine_push_rows: 1, ..Config::default() }
        );
        assert_eq!(parse_config("16:24:24:12:4").unwrap().combine_push_rows, 4);
        assert_eq!(parse_config("16:24:24:12:4:8").unwrap().dispatch_local_warps, 8);
        let c = parse_config("16:24:24:12:4:8:1").unwrap();
        assert!(c.dispatch_tma && !c.combine_tma);
        let c = parse_config("16:24:24:12:4:8:3").unwrap();
        assert!(c.dispatch_tma && c.combine_tma);
        assert!(parse_config("16:24:24:12:4:8:4").is_err());
        let e = parse_config("16:24:24").unwrap_err().to_string();
        assert!(e.contains("sms:dispatch_warps:combine_warps:push_warps"), "{e}");
        let e = parse_config("16:24:24:24").unwrap_err().to_string();
        assert!(e.contains("combine_push_warps"), "{e}");
        let e = parse_config("a:b:c:d").unwrap_err().to_string();
        assert!(e.contains("four to seven integers"), "{e}");
    }
}
