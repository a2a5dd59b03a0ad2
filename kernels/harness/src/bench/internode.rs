//! Bench mode `internode`: DeepEP's internode figures (`tests/test_internode.py`) for our two-hop
//! NVSHMEM kernels.
//!
//! Per shape (DeepEP-like routing from `bench::Routing`), each op is timed once and reported as
//! two rows:
//! - `<op> rdma`: GB/s over DeepEP's RDMA bytes = #(token, destination host incl. its own) × row
//!   bytes sent by the rank (the inter-host hop);
//! - `<op> nvl`: GB/s over the rows the rank receives (incl. from itself) × row bytes (the NVLink
//!   hop, DeepEP's "NVL" figure and the framework's usual numerator), with the NCCL all-to-all
//!   baseline for the same per-peer bytes and the ratio.
//!
//! Ops: `dispatch-bf16` and `dispatch-fp8` with a cached handle (what DeepEP times), `combine-bf16`
//! (no weights, no bias; same bytes as the BF16 dispatch, DeepEP's convention) and
//! `dispatch-bf16-uncached` (notify with the CPU sync + dispatch).
//!
//! Every op runs twice: through staging + NVSHMEM put (the inter-host path), and with
//! `p2p_direct` (op suffix ` p2p`: NVLink stores straight into a remote host's region, possible
//! only when NVSHMEM reports it load/store-reachable, as on one machine).
//!
//! `DEEPEP_INTERNODE_RANKS_PER_HOST` (default 1) groups the ranks into hosts: with the default,
//! 2 GPUs of one machine act as 2 hosts and every remote token takes the NVSHMEM put path (served
//! over NVLink P2P there: these figures measure the two-hop machinery, not a network). SMs:
//! `--num-sms` (default 24 = 12 channels).

use super::{token_bytes, BenchCtx, Routing, Row, Shape};
use deepep_kernels::internode::{
    nvshmem_runtime, CombineArgs, DispatchArgs, InternodeBuffer, InternodeConfig,
};
use deepep_kernels::runtime::timing::Stats;
use deepep_kernels::tensor::{DType, Tensor};
use deepep_kernels::{EpError, Result};

const MODE: &str = "internode";

/// `DEEPEP_INTERNODE_RANKS_PER_HOST`, default 1.
pub fn ranks_per_host() -> Result<usize> {
    match std::env::var("DEEPEP_INTERNODE_RANKS_PER_HOST") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<usize>().ok().filter(|&p| p > 0).ok_or_else(|| {
            EpError::InvalidArgument(format!(
                "DEEPEP_INTERNODE_RANKS_PER_HOST={v:?} is not a positive integer; set it to the number of GPUs per host (e.g. 8) or unset it"
            ))
        }),
        _ => Ok(1),
    }
}

/// DeepEP's RDMA token count of rank `s`: Σ_t #distinct destination hosts of token t.
pub fn rdma_tokens(routing: &Routing, s: usize, ranks_per_host: usize) -> usize {
    let sh = routing.shape;
    let per_rank = sh.experts / routing.world;
    let idx = &routing.topk_idx[s];
    (0..sh.tokens)
        .map(|t| {
            let mut hosts: Vec<usize> = idx[t * sh.topk..(t + 1) * sh.topk]
                .iter()
                .filter(|&&e| e >= 0)
                .map(|&e| e as usize / per_rank / ranks_per_host)
                .collect();
            hosts.sort_unstable();
            hosts.dedup();
            hosts.len()
        })
        .sum()
}

fn figure(stats: &[Stats], bytes: &[usize]) -> (f64, f64, usize) {
    let us = stats.iter().map(|s| s.median_us).fold(0.0, f64::max);
    let (mut slow, mut gbps) = (0, f64::INFINITY);
    for (r, s) in stats.iter().enumerate() {
        let g = if s.median_us > 0.0 {
            bytes[r] as f64 / (s.median_us * 1e-6) / 1e9
        } else {
            0.0
        };
        if g < gbps {
            gbps = g;
            slow = r;
        }
    }
    (us, if gbps.is_finite() { gbps } else { 0.0 }, slow)
}

/// The bytes of one op: every rank's RDMA and NVLink bytes, and this rank's per-peer send and
/// receive bytes (the NCCL baseline's).
struct LinkBytes {
    rdma: Vec<usize>,
    nvl: Vec<usize>,
    send: Vec<usize>,
    recv: Vec<usize>,
}

impl LinkBytes {
    /// A combine's: the transpose of its dispatch's per-peer counts.
    fn transposed(self) -> LinkBytes {
        LinkBytes { send: self.recv, recv: self.send, ..self }
    }
}

/// Time `op` once and produce its `rdma` and `nvl` rows.
fn measure2(ctx: &mut BenchCtx, op_name: &str, shape: Shape, sms: u32, t: &LinkBytes, op: impl FnMut() -> Result<()>) -> Result<Vec<Row>> {
    let (rdma_bytes, nvl_bytes) = (&t.rdma, &t.nvl);
    let stats = ctx.time(op)?;
    let nccl = ctx.nccl_baseline(&t.send, &t.recv)?;
    let (us, rdma_gbps, rslow) = figure(&stats, rdma_bytes);
    let (_, nvl_gbps, nslow) = figure(&stats, nvl_bytes);
    let row = |suffix: &str, bytes: usize, gbps: f64, with_ratio: bool| Row {
        nccl_us: nccl.map(|n| n.0),
        nccl_gbps: nccl.map(|n| n.1),
        ratio: if with_ratio { nccl.map(|n| gbps / n.1) } else { None },
        per_rank: stats.clone(),
        ..Row::new(MODE, format!("{op_name} {suffix}"), shape, sms, bytes, us, gbps)
    };
    Ok(vec![
        row("rdma", rdma_bytes[rslow], rdma_gbps, false),
        row("nvl", nvl_bytes[nslow], nvl_gbps, true),
    ])
}

/// Run the internode mode over `shapes` (collective).
pub fn run(ctx: &mut BenchCtx, shapes: &[Shape]) -> Result<Vec<Row>> {
    let (me, w) = (ctx.comm.rank(), ctx.comm.world());
    let (comm, gpu) = (ctx.comm, ctx.gpu);
    let rph = ranks_per_host()?;
    // Even (num_sms / 2 channels) and within this rank's share of the GPU when ranks share one.
    let num_sms = ctx.opts.num_sms.map_or(gpu.fit_sms_even(24), |n| n as usize);
    let rt = nvshmem_runtime(gpu, comm)?;
    let mut rows = Vec::new();
    for &shape in shapes {
        for p2p in [false, true] {
            let routing = ctx.routing(shape);
            let (n, h, k) = (shape.tokens, shape.hidden, shape.topk);
            // One buffer per shape, sized for it (the symmetric heap is finite).
            let mut cfg = InternodeConfig::new(rph, n.max(1), h);
            cfg.num_sms = num_sms;
            cfg.max_topk = k;
            cfg.max_local_experts = (shape.experts / w).max(1);
            cfg.p2p_direct = p2p;
            let variant = if p2p { " p2p" } else { "" };
            cfg.max_recv_tokens = Some(
                (0..w)
                    .map(|r| routing.tokens_received(r))
                    .max()
                    .unwrap_or(1)
                    .max(1),
            );
            let mut buf = InternodeBuffer::new(gpu, comm, &rt, cfg)?;
            let stream = gpu.stream().clone();
            let idx = Tensor::from_host(&stream, &routing.topk_idx[me], &[n, k])?;
            let wts = ctx.filled(DType::F32, &[n, k], 0x3e00_0000)?; // 0.125
            let x = ctx.filled(DType::Bf16, &[n, h], 0x3f80_3f80)?; // 1.0
            let x8 = ctx.filled(DType::Fp8E4m3, &[n, h], 0x3838_3838)?; // 1.0 in e4m3
            let sc = ctx.filled(DType::F32, &[n, h / 128], 0x3f80_0000)?;
            comm.barrier()?;
            let first = buf.dispatch(DispatchArgs::fresh(&x, &idx, &wts, shape.experts))?;
            let handle = first.handle.clone();
            drop(first);
            let m = handle.num_recv_tokens;
            let y = ctx.filled(DType::Bf16, &[m, h], 0x3f80_3f80)?;
            gpu.sync("internode bench setup")?;

            let recv_rows: Vec<usize> = (0..w).map(|r| routing.tokens_received(r)).collect();
            let rdma_rows: Vec<usize> = (0..w).map(|r| rdma_tokens(&routing, r, rph)).collect();
            let sms = num_sms as u32;
            // The bytes of a dispatch.
            let traffic = |fp8: bool| {
                let tb = token_bytes(h, fp8);
                let (send, recv) = routing.dispatch_bytes(me, tb);
                LinkBytes { rdma: rdma_rows.iter().map(|r| r * tb).collect(), nvl: recv_rows.iter().map(|r| r * tb).collect(), send, recv }
            };
            for (op, fp8) in [("dispatch-bf16", false), ("dispatch-fp8", true)] {
                rows.extend(measure2(ctx, &format!("{op}{variant}"), shape, sms, &traffic(fp8), || {
                    let a = if fp8 { DispatchArgs::cached(&x8, &handle).scales(&sc) } else { DispatchArgs::cached(&x, &handle) };
                    buf.dispatch(a).map(|_| ())
                })?);
            }
            rows.extend(measure2(ctx, &format!("combine-bf16{variant}"), shape, sms, &traffic(false).transposed(), || {
                buf.combine(CombineArgs::new(&y, &handle)).map(|_| ())
            })?);
            rows.extend(measure2(ctx, &format!("dispatch-bf16-uncached{variant}"), shape, sms, &traffic(false), || {
                buf.dispatch(DispatchArgs::fresh(&x, &idx, &wts, shape.experts)).map(|_| ())
            })?);
            ctx.free("internode bench shape done", buf)?;
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_tokens_count_destination_hosts_once() {
        let shape = Shape {
            tokens: 200,
            hidden: 128,
            topk: 8,
            experts: 64,
        };
        let r = Routing::new(3, 8, shape);
        // One host: every token that goes anywhere counts once.
        let any: usize = (0..200)
            .filter(|&t| r.topk_idx[0][t * 8..t * 8 + 8].iter().any(|&e| e >= 0))
            .count();
        assert_eq!(rdma_tokens(&r, 0, 8), any);
        // One GPU per host: the RDMA count is the per-rank count.
        assert_eq!(rdma_tokens(&r, 0, 1), r.tokens_to[0].iter().sum::<usize>());
        // Two hosts of 4: between the two.
        let two = rdma_tokens(&r, 0, 4);
        assert!(two >= any && two <= 2 * any && two <= r.tokens_to[0].iter().sum::<usize>());
    }
}
