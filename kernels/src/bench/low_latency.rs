//! Bench mode `low-latency`: DeepEP's low-latency figures (`tests/test_low_latency.py`) for our
//! LL kernels, with the NCCL all-to-all moving the same per-peer bytes in the same run.
//!
//! Per shape (DeepEP-like routing from `bench::Routing`, default 128 tokens x 7168, top-8 of the
//! `--experts` experts; DeepEP's LL test uses 288):
//! - `dispatch-fp8`: bytes = this rank's valid selections x (H + 4·H/128 + 16) (DeepEP's FP8
//!   message), `dispatch-bf16`: selections x 2H (the buffer's dispatch version, v2 by default;
//!   `dispatch-fp8-v1`: the v1 kernel for comparison);
//! - `combine-bf16`: selections x 2H (weighted combine of the previous dispatch's layout; the
//!   buffer's combine version, v3 by default; `combine-bf16-v1` / `-v2` / `-v3`: the other kernels);
//! - `combine-bf16-v3[wN]`: combine v3 with N owner warps per block, for each N in
//!   `DEEPEP_LL_OWNER_WARPS_SWEEP` (tuning; unset: no such rows);
//! - after each combine row a `trace` line: phase times of one traced call (owners done sending,
//!   origin's own terms done, every peer's data seen by the first / last warp, end);
//! - `dispatch+combine`: FP8 dispatch followed by combine; bytes = selections x (FP8 message + 2H);
//! - `dispatch-fp8 x10` / `combine-bf16 x10`: ten calls back to back per timed repetition (no L2
//!   flush in between), so launch and measurement overhead are amortized: time / 10 is the
//!   steady-state cost of one call.
//!
//! Every selection is a message (no per-rank dedup), so the NCCL baseline sends each rank
//! selections x message bytes to the owner of each selected expert (combine: the transpose).
//! `--sweep` runs 32, 128 and 256 tokens. The SM count shown is the LL grid (all SMs unless
//! `--num-sms`).

use super::{BenchCtx, Row, Shape};
use crate::nvshmem::low_latency::{CombineVersion, DispatchVersion, LlDispatchOpts, LlTrace, LowLatencyBuffer};
use crate::tensor::{DType, Tensor};
use crate::Result;

const MODE: &str = "low-latency";
/// Token counts of `--sweep` in this mode.
pub const SWEEP_TOKENS: &[usize] = &[32, 128, 256];
/// Default tokens per rank (DeepEP's LL test).
pub const DEFAULT_TOKENS: usize = 128;
/// Calls per timed repetition of the `x10` rows.
const REPEAT: usize = 10;

/// DeepEP's LL FP8 message bytes per selection.
pub fn fp8_message_bytes(hidden: usize) -> usize {
    hidden + 4 * hidden / 128 + 16
}

/// `sel[s][d]`: valid selections of rank `s` whose expert lives on rank `d`.
pub fn selections(topk_idx: &[Vec<i64>], experts: usize) -> Vec<Vec<usize>> {
    let world = topk_idx.len();
    let per_rank = experts / world;
    topk_idx
        .iter()
        .map(|idx| {
            let mut row = vec![0usize; world];
            for &e in idx.iter().filter(|&&e| e >= 0) {
                row[e as usize / per_rank] += 1;
            }
            row
        })
        .collect()
}

/// `DEEPEP_LL_OWNER_WARPS_SWEEP`: comma-separated owner-warp counts to time combine v3 with (tuning).
fn owner_warps_sweep() -> Result<Vec<usize>> {
    std::env::var("DEEPEP_LL_OWNER_WARPS_SWEEP").map_or(Ok(Vec::new()), |v| parse_owner_warps_sweep(&v))
}

fn parse_owner_warps_sweep(v: &str) -> Result<Vec<usize>> {
    v.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| match x.parse::<usize>() {
            Ok(n) if n < crate::nvshmem::low_latency::LL_WARPS => Ok(n),
            _ => Err(crate::EpError::InvalidArgument(format!(
                "DEEPEP_LL_OWNER_WARPS_SWEEP={v:?}: {x:?} is not an owner-warp count from 0 to 15; use e.g. 0,4,8,12"
            ))),
        })
        .collect()
}

/// Phase times of one combine or v2 dispatch (diagnostics): each try runs `op` untraced (it lines the ranks up:
/// a combine waits for its peers) and then traced; prints the try that finished soonest after its
/// own start. Collective like `op`.
fn traced(buf: &mut LowLatencyBuffer, name: &str, shape: Shape, op: &mut dyn FnMut(&mut LowLatencyBuffer) -> Result<()>) -> Result<()> {
    let mut best: Option<LlTrace> = None;
    for _ in 0..5 {
        op(buf)?;
        buf.set_tracing(true)?;
        let r = op(buf).and_then(|_| buf.last_trace());
        buf.set_tracing(false)?;
        if let Some(t) = r? {
            if best.map_or(true, |b| t.end_us.unwrap_or(f64::MAX) < b.end_us.unwrap_or(f64::MAX)) {
                best = Some(t);
            }
        }
    }
    if let Some(t) = best {
        let f = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.1}"));
        if name.starts_with("dispatch") {
            println!(
                "trace {name} {}x{}: sent {} us, every source's flags seen {}..{} us (first..last block), binned {} us, end {} us",
                shape.tokens,
                shape.hidden,
                f(t.sent_us),
                f(t.waited_first_us),
                f(t.waited_us),
                f(t.local_us),
                f(t.end_us)
            );
            return Ok(());
        }
        println!(
            "trace {name} {}x{}: sent {} us, own terms {} us, peers' data seen {}..{} us, end {} us",
            shape.tokens,
            shape.hidden,
            f(t.sent_us),
            f(t.local_us),
            f(t.waited_first_us),
            f(t.waited_us),
            f(t.end_us)
        );
    }
    Ok(())
}

/// The shapes of this mode: `--sweep` gives 32/128/256 tokens at `--hidden`.
pub fn shapes(ctx: &BenchCtx) -> Vec<Shape> {
    let o = &ctx.opts;
    if o.sweep {
        SWEEP_TOKENS.iter().map(|&tokens| Shape { tokens, hidden: o.hidden, topk: o.topk, experts: o.experts }).collect()
    } else {
        vec![Shape { tokens: o.tokens.unwrap_or(DEFAULT_TOKENS), hidden: o.hidden, topk: o.topk, experts: o.experts }]
    }
}

fn filled(ctx: &BenchCtx, dtype: DType, shape: &[usize], word: u32) -> Result<Tensor> {
    let t = Tensor::empty(ctx.gpu.stream(), dtype, shape)?;
    let bytes = t.numel() * dtype.size();
    if bytes >= 4 {
        ctx.gpu.memset_u32(t.ptr(), word, bytes / 4)?;
    }
    Ok(t)
}

/// Run the low-latency mode (collective). `shapes` = [`shapes`] unless the caller overrides.
pub fn run(ctx: &mut BenchCtx, shapes: &[Shape]) -> Result<Vec<Row>> {
    let (me, w) = (ctx.comm.rank(), ctx.comm.world());
    let (comm, gpu) = (ctx.comm, ctx.gpu);
    let mut rows = Vec::new();
    // One buffer per (hidden, experts); num_max covers the largest token count.
    let num_max = shapes.iter().map(|s| s.tokens).max().unwrap_or(1).max(1).next_multiple_of(4);
    let mut i = 0;
    while i < shapes.len() {
        let (h, e) = (shapes[i].hidden, shapes[i].experts);
        let group: Vec<Shape> = shapes[i..].iter().take_while(|s| s.hidden == h && s.experts == e).copied().collect();
        i += group.len();
        let mut buf = LowLatencyBuffer::new(gpu, comm, num_max, h, e, ctx.opts.num_sms.map(|n| n as usize))?;
        let sms = buf.grid() as u32;
        let l = e / w;
        let rnm = w * num_max;
        for shape in group {
            let routing = ctx.routing(shape);
            let (n, k) = (shape.tokens, shape.topk);
            let stream = gpu.stream().clone();
            let idx = Tensor::from_host(&stream, &routing.topk_idx[me], &[n, k])?;
            let wts = filled(ctx, DType::F32, &[n, k], 0x3e00_0000)?; // 0.125
            let x = filled(ctx, DType::Bf16, &[n, h], 0x3f80_3fc0)?; // 1.5, 1.0
            let y = filled(ctx, DType::Bf16, &[l, rnm, h], 0x3f80_3f80)?;
            let sel = selections(&routing.topk_idx, e);
            let sent: Vec<usize> = sel.iter().map(|r| r.iter().sum()).collect();
            let per_peer = |bytes: usize| -> (Vec<usize>, Vec<usize>) {
                ((0..w).map(|d| sel[me][d] * bytes).collect(), (0..w).map(|s| sel[s][me] * bytes).collect())
            };
            comm.barrier()?;
            // A first dispatch gives combine its layout.
            let first = buf.dispatch(&x, &idx, LlDispatchOpts { use_fp8: true, ..Default::default() })?;
            let handle = first.handle.clone();
            drop(first);
            gpu.sync("low-latency bench setup")?;

            let default_version = buf.dispatch_version();
            for (op, fp8, version) in [
                ("dispatch-fp8", true, default_version),
                ("dispatch-bf16", false, default_version),
                ("dispatch-fp8-v1", true, DispatchVersion::V1),
            ] {
                if op.ends_with("-v1") && default_version == DispatchVersion::V1 {
                    continue;
                }
                buf.set_dispatch_version(version)?;
                let mb = if fp8 { fp8_message_bytes(h) } else { 2 * h };
                let bytes: Vec<usize> = sent.iter().map(|s| s * mb).collect();
                let (send, recv) = per_peer(mb);
                let opts = LlDispatchOpts { use_fp8: fp8, ..Default::default() };
                rows.push(ctx.measure(MODE, op, shape, sms, &bytes, &send, &recv, || buf.dispatch(&x, &idx, opts).map(|_| ()))?);
                if version == DispatchVersion::V2 {
                    traced(&mut buf, op, shape, &mut |b| b.dispatch(&x, &idx, opts).map(|_| ()))?;
                }
            }
            buf.set_dispatch_version(default_version)?;
            // The timing loop dispatched again: refresh the handle for combine.
            let d = buf.dispatch(&x, &idx, LlDispatchOpts { use_fp8: true, ..Default::default() })?;
            let handle2 = d.handle.clone();
            drop((d, handle));
            let cb = 2 * h;
            let bytes: Vec<usize> = sent.iter().map(|s| s * cb).collect();
            let (send, recv) = per_peer(cb);
            let out = Tensor::empty(&stream, DType::Bf16, &[n, h])?;
            rows.push(ctx.measure(MODE, "combine-bf16", shape, sms, &bytes, &recv, &send, || {
                buf.combine_into(&y, &idx, &wts, &handle2, &out, false).map(|_| ())
            })?);
            traced(&mut buf, "combine-bf16", shape, &mut |b| b.combine_into(&y, &idx, &wts, &handle2, &out, false).map(|_| ()))?;
            // The other combine kernels, for comparison.
            let default_combine = buf.combine_version();
            for (other, other_name) in [
                (CombineVersion::V1, "combine-bf16-v1"),
                (CombineVersion::V2, "combine-bf16-v2"),
                (CombineVersion::V3, "combine-bf16-v3"),
            ] {
                if other == default_combine {
                    continue;
                }
                buf.set_combine_version(other)?;
                rows.push(ctx.measure(MODE, other_name, shape, sms, &bytes, &recv, &send, || {
                    buf.combine_into(&y, &idx, &wts, &handle2, &out, false).map(|_| ())
                })?);
                traced(&mut buf, other_name, shape, &mut |b| b.combine_into(&y, &idx, &wts, &handle2, &out, false).map(|_| ()))?;
            }
            buf.set_combine_version(default_combine)?;
            // Tuning: combine v3 with other owner/origin warp splits (`DEEPEP_LL_OWNER_WARPS_SWEEP=0,4,8,...`).
            let default_split = buf.combine_owner_warps();
            for n in owner_warps_sweep()? {
                buf.set_combine_version(CombineVersion::V3)?;
                buf.set_combine_owner_warps(n)?;
                let name = format!("combine-bf16-v3[w{n}]");
                rows.push(ctx.measure(MODE, &name, shape, sms, &bytes, &recv, &send, || {
                    buf.combine_into(&y, &idx, &wts, &handle2, &out, false).map(|_| ())
                })?);
                traced(&mut buf, &name, shape, &mut |b| b.combine_into(&y, &idx, &wts, &handle2, &out, false).map(|_| ()))?;
            }
            buf.set_combine_version(default_combine)?;
            buf.set_combine_owner_warps(default_split)?;
            // Ten calls back to back per timed repetition: launch and measurement overhead
            // amortized (the figure is for all ten calls; divide the time by 10).
            let fb = fp8_message_bytes(h);
            let bytes10: Vec<usize> = sent.iter().map(|s| s * fb * REPEAT).collect();
            let (send10, recv10) = per_peer(fb * REPEAT);
            let opts = LlDispatchOpts { use_fp8: true, ..Default::default() };
            rows.push(ctx.measure(MODE, "dispatch-fp8 x10", shape, sms, &bytes10, &send10, &recv10, || {
                for _ in 0..REPEAT {
                    buf.dispatch(&x, &idx, opts)?;
                }
                Ok(())
            })?);
            let d = buf.dispatch(&x, &idx, opts)?;
            let handle3 = d.handle.clone();
            drop(d);
            let bytes10: Vec<usize> = sent.iter().map(|s| s * cb * REPEAT).collect();
            let (send10, recv10) = per_peer(cb * REPEAT);
            rows.push(ctx.measure(MODE, "combine-bf16 x10", shape, sms, &bytes10, &recv10, &send10, || {
                for _ in 0..REPEAT {
                    buf.combine_into(&y, &idx, &wts, &handle3, &out, false)?;
                }
                Ok(())
            })?);
            let both = fp8_message_bytes(h) + cb;
            let bytes: Vec<usize> = sent.iter().map(|s| s * both).collect();
            let (send, recv) = per_peer(both);
            rows.push(ctx.measure(MODE, "dispatch+combine", shape, sms, &bytes, &send, &recv, || {
                let d = buf.dispatch(&x, &idx, LlDispatchOpts { use_fp8: true, ..Default::default() })?;
                buf.combine_into(&y, &idx, &wts, &d.handle, &out, false).map(|_| ())
            })?);
            gpu.sync("low-latency bench shape done")?;
            comm.barrier()?;
        }
        // Peers must be done with our buffer before it is freed (collective free).
        gpu.sync("low-latency bench teardown")?;
        comm.barrier()?;
        drop(buf);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_warps_sweep_parses_lists_and_names_bad_entries() {
        assert_eq!(parse_owner_warps_sweep("0, 4,8,").unwrap(), vec![0, 4, 8]);
        assert!(parse_owner_warps_sweep("").unwrap().is_empty());
        for bad in ["4,x", "16"] {
            let e = parse_owner_warps_sweep(bad).unwrap_err().to_string();
            assert!(e.contains("DEEPEP_LL_OWNER_WARPS_SWEEP") && e.contains("0 to 15"), "{e}");
        }
    }

    #[test]
    fn message_bytes_match_deepep() {
        assert_eq!(fp8_message_bytes(7168), 7168 + 224 + 16);
    }

    #[test]
    fn selections_count_every_valid_slot_per_owner() {
        // 2 ranks, 4 experts (2 per rank); -1 slots ignored; no dedup.
        let idx = vec![vec![0, 1, 2, -1, 3, 3], vec![-1, -1, 1, 2]];
        assert_eq!(selections(&idx, 4), vec![vec![2, 3], vec![1, 1]]);
    }
}
