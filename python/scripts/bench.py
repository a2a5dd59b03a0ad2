#!/usr/bin/env python3
"""Time deepep_kernels through its Python API the way DeepEP's tests time DeepEP.

Usage (GPU machine, the wheel on PYTHONPATH or installed):
    python3 python/scripts/bench.py [--ranks 2] [--gpus N] [--mode intranode|ll|all]
        [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256] [--num-sms 24]
        [--ll-tokens 128] [--ll-experts 288] [--reps 30] [--warmup 5] [--no-profile]

Per op: the median of ``--reps`` repetitions after ``--warmup`` warm-ups, CUDA events around each
call on the current stream (so the binding, the stream joins and, for dispatch, the copy of the
outputs into torch-owned tensors are inside), the L2 flushed between repetitions, the slowest
rank; GB/s over the bytes each rank receives (DeepEP's "NVL GB/s": received rows x hidden x 2,
FP8 x (1 + 4/128) / 2, combine the same bytes as dispatch; LL: DeepEP's LL byte counts). With the
torch profiler (default on) the kernel time per call is also printed: the sum of the CUDA kernel
and memcpy durations of one repetition. Compare with the Rust figures of the same shapes in
kernels/BENCHMARKS.md (``deepep-bench``, whose outputs stay in the NVLink buffer: the zero-copy
figure). Ranks exchange through a gloo group; rank r uses GPU ``r * gpus // ranks``.
"""

import argparse
import os
import statistics
import sys
import tempfile


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible, at most --ranks)")
    p.add_argument("--mode", choices=["intranode", "ll", "all"], default="all")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--ll-experts", type=int, default=288)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-profile", action="store_true")
    return p.parse_args()


def time_op(torch, fn, reps, warmup, flush):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def kernel_us(torch, fn, profile):
    if not profile:
        return float("nan")
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in p.events():
        if e.device_type.name == "CUDA":
            total += e.device_time if hasattr(e, "device_time") else e.cuda_time
    return total


def worker(rank, world, gpus, init, args):
    import torch
    import torch.distributed as dist

    from deepep_kernels import Buffer, Config

    torch.cuda.set_device(rank * gpus // world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    group = dist.group.WORLD
    dev = torch.device("cuda", torch.cuda.current_device())
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    rows = []

    def report(op, shape, us, nbytes, kus):
        all_us = [None] * world
        dist.all_gather_object(all_us, (us, kus), group)
        worst = max(u for u, _ in all_us)
        kworst = max(k for _, k in all_us)
        all_b = [None] * world
        dist.all_gather_object(all_b, nbytes, group)
        gbs = min(b / (u * 1e3) for b, (u, _) in zip(all_b, all_us))
        rows.append(f"{op:<40} {shape:<28} {worst:9.1f} {gbs:9.1f} {kworst:10.1f}")

    if args.mode in ("intranode", "all"):
        torch.manual_seed(rank)
        n, h, k, e = args.tokens, args.hidden, args.topk, args.experts
        nvl = Config(args.num_sms, 6, 256, 6, 128).get_nvl_buffer_size_hint(h * 2, world)
        os.environ.setdefault("DEEPEP_KERNELS_HIDDEN", str(h))
        buf = Buffer(group, nvl, 0, explicitly_destroy=True)
        x = torch.randn(n, h, device=dev).to(torch.bfloat16)
        scores = torch.randn(n, e, device=dev).abs()
        idx = scores.topk(k, dim=1).indices.to(torch.int64)
        w = torch.rand(n, k, device=dev)
        cfg = Config(args.num_sms, 6, 256, 6, 128)
        layout = buf.get_dispatch_layout(idx, e)
        rx, ri, rw, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                    num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=cfg)
        m = rx.shape[0]
        xq = x.to(torch.float8_e4m3fn)
        sc = torch.ones(n, h // 128, device=dev)
        shape = f"{n}x{h} top-{k}/{e} {args.num_sms}SMs"

        def fresh():
            lay = buf.get_dispatch_layout(idx, e)
            buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                         topk_idx=idx, topk_weights=w, config=cfg)

        def views(fn):
            # the opt-in zero-copy mode (DEEPEP_KERNELS_DISPATCH_VIEWS=1), switched on this Buffer
            # for the call: outputs are views of the NVLink buffer, no copy after the kernel
            def run():
                buf._dispatch_views = True
                try:
                    return fn()
                finally:
                    buf._dispatch_views = False
            return run

        cached_bf16 = lambda: buf.dispatch(x, handle=handle, config=cfg)  # noqa: E731
        cached_fp8 = lambda: buf.dispatch((xq, sc), handle=handle, config=cfg)  # noqa: E731
        ops = [
            ("dispatch BF16, cached, owned outputs", cached_bf16, m * h * 2),
            ("dispatch BF16, cached, zero-copy views", views(cached_bf16), m * h * 2),
            ("dispatch FP8, cached, owned outputs", cached_fp8, m * h * (1 + 4 / 128)),
            ("dispatch FP8, cached, zero-copy views", views(cached_fp8), m * h * (1 + 4 / 128)),
            ("combine BF16", lambda: buf.combine(rx, handle, config=cfg), m * h * 2),
            ("dispatch BF16, fresh (layout+notify+sync)", fresh, m * h * 2),
            ("dispatch BF16, fresh, zero-copy views", views(fresh), m * h * 2),
        ]
        for op, fn, nbytes in ops:
            us = time_op(torch, fn, args.reps, args.warmup, flush)
            report("intranode " + op, shape, us, nbytes, kernel_us(torch, fn, not args.no_profile))
        torch.cuda.synchronize()
        buf.destroy()

    if args.mode in ("ll", "all"):
        torch.manual_seed(100 + rank)
        n, h, k, e = args.ll_tokens, args.hidden, args.topk, args.ll_experts
        rdma = Buffer.get_low_latency_rdma_size_hint(n, h, world, e)
        buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=e // world, explicitly_destroy=True)
        x = torch.randn(n, h, device=dev).to(torch.bfloat16)
        idx = torch.randn(n, e, device=dev).abs().topk(k, dim=1).indices.to(torch.int64)
        w = torch.rand(n, k, device=dev)
        (q, s), cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=True)
        recv_sel = int(cnt.sum().item())
        y = torch.randn(e // world, world * n, h, device=dev).to(torch.bfloat16)
        out = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
        shape = f"{n}x{h} top-{k}/{e}"
        sent = int((idx >= 0).sum().item())
        ops = [
            ("dispatch FP8", lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=True), recv_sel * (h + h // 128 * 4 + 16)),
            ("dispatch BF16", lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=False), recv_sel * (2 * h + 16)),
            ("combine BF16", lambda: buf.low_latency_combine(y, idx, w, handle, out=out), sent * h * 2),
        ]
        for op, fn, nbytes in ops:
            if op == "combine BF16":
                # the handle must stay one of the two most recent dispatches
                (q, s), cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=True)
            us = time_op(torch, fn, args.reps, args.warmup, flush)
            report("low-latency " + op, shape, us, nbytes, kernel_us(torch, fn, not args.no_profile))
        torch.cuda.synchronize()
        buf.destroy()

    if rank == 0:
        if gpus < world:
            print(f"NOT PERFORMANCE: {world} ranks share {gpus} GPU(s) (oversubscribed); the ranks compete for the same SMs "
                  "and memory, the 'NVLink' traffic is local memory, and the profiler column may include other ranks' "
                  "kernels. Use the figures only to compare rows of this run with each other.")
        print(f"{'op':<40} {'shape':<28} {'us':>9} {'GB/s':>9} {'kernel us':>10}")
        for r in rows:
            print(r)
        sys.stdout.flush()
    dist.destroy_process_group()


def main():
    args = parse()
    import torch
    import torch.multiprocessing as mp

    gpus = max(1, min(args.gpus or torch.cuda.device_count(), args.ranks, torch.cuda.device_count()))
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args.ranks, gpus, os.path.join(d, "pg"), args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
