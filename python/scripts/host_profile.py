#!/usr/bin/env python3
"""Where the host time of one call goes: the ``deep_ep`` API call of our package, and each step
of it alone, timed the way ``bench.py`` times host cost (``perf_counter_ns`` around back-to-back
calls, no synchronisation inside the loop, divided by the calls).

    python3 python/scripts/host_profile.py [--mode ll] [--tokens 128] [--hidden 7168] [--topk 8]
                                            [--experts 288] [--calls 300] [--repeats 5] [--json FILE]
    python3 python/scripts/host_profile.py --mode intranode [--ranks 2] [--tokens 4096] [--topk 8]
                                            [--experts 256] [--num-sms 24] [--calls 50] [--repeats 5]

``--mode ll`` (the default): one rank on GPU 0 (a gloo group of one). Steps:

- ``api dispatch FP8`` / ``api dispatch BF16`` / ``api combine BF16``: ``Buffer.low_latency_*``
  as a user calls it (all steps below together);
- ``read tensor (attributes)`` / ``read tensor (DLPack)``: the native doorway reading one torch
  tensor (address, shape, strides, dtype, device) by attribute reads, the default, or through
  ``__dlpack__()`` (torch's is Python code): the argument checks themselves run in Rust inside
  the native calls below;
- ``torch x.dtype`` ... ``torch x.get_device()``: each attribute read of the attribute reader
  alone, from Python (the extension makes the same calls through the C API);
- ``device error check``: ``check_device_error()`` (the ``@_checked`` prologue; the two
  low-latency calls make it inside their native call);
- ``current stream``: reading torch's current raw stream;
- ``native dispatch FP8, current stream``: the one crossing into Rust as the API makes it
  (the kernel launched directly on the current stream; it returns the cached output views and
  the handle object);
- ``native dispatch FP8, comm stream, no joins``: launched on the comm stream, no stream join;
- ``native dispatch FP8, comm stream + 2 joins``: DeepEP's pattern, the comm stream waits for the
  current one and the current one for the comm stream (event record + stream wait each way; the
  second join is one more crossing);
- ``native combine, ...``: as for dispatch;
- ``cupy launch`` / ``cupy cooperative launch``: an empty kernel of the same grid (the SM count)
  and block (512 threads) launched through cupy, plain and cooperative: the driver's floor.

``--mode intranode``: ``--ranks`` processes on GPU 0 (run it under MPS, as ``bench.py --ranks 2``:
the ranks' kernels wait for each other), the intranode ``Buffer`` of ``bench.py``'s normal ops
(the same inputs: ``--tokens`` x ``--hidden`` BF16 per rank, top-``--topk`` of ``--experts``,
``--num-sms`` SMs). Every rank makes the same calls in the same order. Rows:

- ``api cached BF16`` / ``api cached FP8``: ``Buffer.dispatch(x, handle=...)`` as a user calls it,
  the outputs written into the receive arena (the default);
- ``..., copied``: the same without the arena (the kernel writes the fixed receive region and the
  rows are copied into ``torch.empty`` tensors), as ``DEEPEP_KERNELS_RECV_ARENA_BYTES=0``;
- ``..., views``: the opt-in zero-copy views (``DEEPEP_KERNELS_DISPATCH_VIEWS=1``);
- ``api combine BF16``: ``Buffer.combine`` of the fresh dispatch's rows;
- ``native cached BF16`` / ``FP8`` / ``BF16, copied``: the one crossing into Rust the API makes
  (``Runtime.dispatch``), without the Python around it;
- ``arena_ok``, ``current stream``, ``is_current_stream_capturing``: the Python steps around it;
- ``torch.as_tensor(CAI) + 2 views``: an output view made from a ``__cuda_array_interface__``
  object, as the extension made them until 34c058f (from Python here; it now makes one view
  fewer); ``get_local_buffer_tensor (one view)``: one view as the extension makes them (through
  the API, its Python wrapper included), DLPack by default or ``__cuda_array_interface__`` with
  ``DEEPEP_KERNELS_DLPACK_VIEWS=0``;
- ``driver: ...``: a per-call CUDA event (create, record, destroy) and one stream join, through
  ctypes.

Each of these rows is timed three ways, so that a host cost that only shows when the GPU lags
behind can be told from one that is there on an idle GPU: ``b2b N`` (``N`` back-to-back calls, as
``bench.py``; ``--calls`` and a tenth of it), and ``isolated`` (each call timed alone after a
``torch.cuda.synchronize()``, the GPU idle: the call's own host cost, no queue behind it).

With ``DEEPEP_HOST_TIMING=1`` (set by this script) our runtime also counts the host time spent
inside ``cuLaunchKernelEx``; the ``launch`` column is that time per call.

Each figure is the median over ``--repeats`` loops of its calls (after a warm-up); in the
intranode mode, the slowest rank's. The ``no joins`` rows leave the outputs unordered for the
current stream (a measurement, not a usage). Not a benchmark against anything: it says which
part of our host path costs what, on this machine.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def timed(torch, native, fn, calls, repeats, warmup=30, isolated=False):
    """(median, min, max) host us per call over ``repeats`` loops, and the median us per call
    spent inside cuLaunchKernelEx (our launches only). Back to back, or ``isolated``: each call
    timed alone after ``torch.cuda.synchronize()`` (the GPU idle: the call's own host cost, with
    no queued work behind it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per, launch = [], []
    for _ in range(repeats):
        native.launch_timing(True)
        total = 0
        if isolated:
            for _ in range(calls):
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                fn()
                total += time.perf_counter_ns() - t0
        else:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            total = time.perf_counter_ns() - t0
        _, ns = native.launch_timing(True)
        torch.cuda.synchronize()
        per.append(total / calls / 1e3)
        launch.append(ns / calls / 1e3)
    return statistics.median(per), min(per), max(per), statistics.median(launch)


# Defaults by mode: DeepEP's low-latency test shape; bench.py's normal ops (its --normal-calls)
DEFAULTS = {
    "ll": {"tokens": 128, "hidden": 7168, "topk": 8, "experts": 288, "calls": 300, "repeats": 5, "ranks": 1, "num_sms": 24},
    "intranode": {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "calls": 50, "repeats": 5, "ranks": 2, "num_sms": 24},
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=sorted(DEFAULTS), default="ll")
    # calls per loop and loops of each timing; None: the mode's default
    for name in DEFAULTS["ll"]:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    for name, default in DEFAULTS[a.mode].items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    if a.mode == "ll" and a.ranks != 1:
        p.error("--mode ll runs one rank; --ranks applies to --mode intranode")
    if a.mode == "intranode" and a.ranks < 2:
        p.error(f"--mode intranode needs --ranks >= 2 (got {a.ranks}): the intranode Buffer exchanges rows between ranks")
    if min(a.calls, a.repeats) < 1:
        p.error("--calls and --repeats must be >= 1")
    return a


def main(argv=None):
    a = parse(argv)
    os.environ["DEEPEP_HOST_TIMING"] = "1"  # read at the first launch
    if a.mode == "intranode":
        return intranode_main(a)
    return ll_main(a)


def ll_main(a):
    import torch
    import torch.distributed as dist

    import deepep_kernels
    from deepep_kernels import _native
    from deepep_kernels import buffer as B

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'pg')}", rank=0, world_size=1)
        group = dist.group.WORLD
        n, h, k, e = a.tokens, a.hidden, a.topk, a.experts
        dev = torch.device("cuda", 0)
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(n, h, generator=g).to(torch.bfloat16).to(dev)
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(dev)
        w = torch.rand(n, k, generator=g).to(dev)
        rdma = deepep_kernels.Buffer.get_low_latency_rdma_size_hint(n, h, 1, e)
        buf = deepep_kernels.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=e, explicitly_destroy=True)
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=False)
        y = recv.clone()
        out = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
        rt = buf._rt()
        cur = buf._cur()
        comm = rt.comm_stream()

        def read_attrs():
            _native.read_tensor(x)

        def read_dlpack():
            _native.read_tensor(x, dlpack=True)

        def native_dispatch(mode):
            # mode: "current" (as the API calls it), "comm" (no joins), "joins" (comm + both joins)
            def f():
                wf = cur if mode != "comm" else None
                r = rt.ll_dispatch(x, idx, n, e, True, False, False, False, None, wf, cur if mode == "current" else None)
                if mode == "joins":
                    rt.stream_wait_comm(cur)
                return r
            return f

        def native_combine(mode):
            def f():
                wf = cur if mode != "comm" else None
                rt.ll_combine(y, idx, w, handle, out, False, wf, cur if mode == "current" else None)
                if mode == "joins":
                    rt.stream_wait_comm(cur)
            return f

        floor = []
        try:
            import cupy

            sms = torch.cuda.get_device_properties(0).multi_processor_count
            src = 'extern "C" __global__ void empty_kernel(int* p) { if (p && threadIdx.x == 1024) *p = 0; }'
            plain = cupy.RawKernel(src, "empty_kernel")
            coop = cupy.RawKernel(src, "empty_kernel", enable_cooperative_groups=True)
            nullp = cupy.uint64(0)
            floor = [("cupy launch", lambda: plain((sms,), (512,), (nullp,))),
                     ("cupy cooperative launch", lambda: coop((sms,), (512,), (nullp,)))]
        except Exception as e:  # cupy missing: the rows of our path still say where the time goes
            print(f"(no cupy floor: {type(e).__name__}: {e})", flush=True)

        rows = [
            ("api dispatch FP8", lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=True)),
            ("api dispatch BF16", lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=False)),
            ("api combine BF16", lambda: buf.low_latency_combine(y, idx, w, handle, out=out)),
            ("read tensor (attributes)", read_attrs),
            ("read tensor (DLPack)", read_dlpack),
            ("torch x.dtype", lambda: x.dtype),
            ("torch x.shape", lambda: x.shape),
            ("torch x.is_contiguous()", lambda: x.is_contiguous()),
            ("torch x.data_ptr()", lambda: x.data_ptr()),
            ("torch x.get_device()", lambda: x.get_device()),
            ("device error check", B.check_device_error),
            ("current stream", buf._cur),
            ("native dispatch FP8, current stream", native_dispatch("current")),
            ("native dispatch FP8, comm, no joins", native_dispatch("comm")),
            ("native dispatch FP8, comm + 2 joins", native_dispatch("joins")),
            ("native combine, current stream", native_combine("current")),
            ("native combine, comm, no joins", native_combine("comm")),
            ("native combine, comm + 2 joins", native_combine("joins")),
        ] + floor
        results = []
        print(f"{'step':38s} {'host/call':>10s}  [min-max]       launch/call", flush=True)
        for name, fn in rows:
            med, lo, hi, launch = timed(torch, _native, fn, a.calls, a.repeats)
            results.append({"step": name, "median_us": med, "min_us": lo, "max_us": hi, "launch_us": launch})
            print(f"{name:38s} {med:7.2f} us  [{lo:.2f}-{hi:.2f}]  {launch:6.2f} us", flush=True)
        torch.cuda.synchronize()
        meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "module": deepep_kernels.__file__,
                "shape": f"{n} x {h}, top-{k} of {e}", "calls": a.calls, "repeats": a.repeats, "comm_stream": comm}
        print(json.dumps(meta), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "rows": results}, f, indent=1)
        buf.destroy()
        dist.destroy_process_group()
    return 0


class _Raw:
    """``nbytes`` of device memory at ``ptr`` as ``__cuda_array_interface__`` bytes (what the
    extension's ``RawRange`` hands ``torch.as_tensor`` for an output view, 1-D here)."""

    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}


def _driver_rows(torch, cur, comm):
    """Rows of single driver calls through ctypes (plus about 0.3 us of ctypes per call): a CUDA
    event created, recorded and destroyed (what a per-call completion event costs), and one stream
    join (event record on ``cur`` + ``comm`` waits for it), in this process's context."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        print(f"(no driver rows: {e})", flush=True)
        return []
    vp = ctypes.c_void_p
    for name, args in (("cuEventCreate", [ctypes.POINTER(vp), ctypes.c_uint]), ("cuEventRecord", [vp, vp]),
                       ("cuEventDestroy_v2", [vp]), ("cuStreamWaitEvent", [vp, vp, ctypes.c_uint])):
        getattr(cu, name).argtypes = args
    torch.cuda.current_stream()  # the primary context is current in this thread
    cur_s, comm_s = vp(cur), vp(comm)
    join, probe = vp(), vp()
    rcs = [cu.cuEventCreate(ctypes.byref(join), 2), cu.cuEventCreate(ctypes.byref(probe), 2)]  # CU_EVENT_DISABLE_TIMING
    rcs += [cu.cuEventRecord(probe, comm_s), cu.cuEventDestroy_v2(probe), cu.cuEventRecord(join, cur_s), cu.cuStreamWaitEvent(comm_s, join, 0)]
    if any(rcs):  # a call that fails at once would time as fast as nothing
        print(f"(no driver rows: CUresult {rcs})", flush=True)
        return []

    def event_cycle():
        ev = vp()
        cu.cuEventCreate(ctypes.byref(ev), 2)
        cu.cuEventRecord(ev, comm_s)
        cu.cuEventDestroy_v2(ev)

    def stream_join():
        cu.cuEventRecord(join, cur_s)
        cu.cuStreamWaitEvent(comm_s, join, 0)

    return [("driver: event create+record+destroy", event_cycle), ("driver: stream join (record + wait)", stream_join)]


def intranode_main(a):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.spawn(intranode_worker, args=(a.ranks, os.path.join(d, "pg"), a, out), nprocs=a.ranks, join=True)
        with open(out) as f:
            doc = json.load(f)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def intranode_worker(rank, world, init, a, out_path):
    """One rank of ``--mode intranode``: every rank times the same calls in the same order (the
    ranks' kernels wait for each other); rank 0 prints each row (the slowest rank's figures)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench  # the inputs, FP8 cast, configs and Buffer of bench.py's normal ops
    import torch
    import torch.distributed as dist

    import deepep_kernels
    from deepep_kernels import _native

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    group = dist.group.WORLD
    # bench.py's session fields that its normal-ops helpers read
    ses = argparse.Namespace(torch=torch, rank=rank, world=world, group=group, library=bench.LIB_OURS,
                             args=argparse.Namespace(tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts=a.experts, num_sms=a.num_sms))
    x, idx, w = bench.normal_inputs(ses)
    fp8 = bench.cast_fp8(torch, x)
    buf, dcfg, ccfg = bench.v1_buffer(ses, deepep_kernels.Buffer, deepep_kernels.Config)
    lay = buf.get_dispatch_layout(idx, a.experts)
    rx, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                                          topk_idx=idx, topk_weights=w, config=dcfg)
    rt, cur = buf._rt(), buf._cur()

    cached_bf16 = lambda: buf.dispatch(x, handle=handle, config=dcfg)  # noqa: E731
    cached_fp8 = lambda: buf.dispatch(fp8, handle=handle, config=dcfg)  # noqa: E731

    def native_cached(values, scales, arena=True):
        # the crossing Buffer.dispatch makes for a cached dispatch (no event)
        return lambda: rt.dispatch(values, scales, None, None, None, None, None, handle, 1, dcfg.num_sms, 0, None, False, cur, arena, False)

    launching = [
        ("api cached BF16", cached_bf16),
        ("api cached FP8", cached_fp8),
        ("api cached BF16, copied", bench.switched(buf, "_use_arena", False, cached_bf16)),
        ("api cached FP8, copied", bench.switched(buf, "_use_arena", False, cached_fp8)),
        ("api cached BF16, views", bench.switched(buf, "_dispatch_views", True, cached_bf16)),
        ("api combine BF16", lambda: buf.combine(rx, handle, config=ccfg)),
        ("native cached BF16", native_cached(x, None)),
        ("native cached FP8", native_cached(*fp8)),
        ("native cached BF16, copied", native_cached(x, None, arena=False)),
    ]
    host_only = [
        ("arena_ok", buf._arena_ok),
        ("current stream", buf._cur),
        ("is_current_stream_capturing", torch.cuda.is_current_stream_capturing),
        ("torch.as_tensor(CAI) + 2 views", lambda: torch.as_tensor(_Raw(rx.data_ptr(), rx.numel() * 2), device=rx.device)
         .view(torch.bfloat16).view(rx.shape)),
        ("get_local_buffer_tensor (one view)", lambda: buf.get_local_buffer_tensor(torch.bfloat16, (1024, a.hidden))),
    ] + _driver_rows(torch, cur, rt.comm_stream())
    short = max(1, a.calls // 10)
    rows = []
    if rank == 0:
        print(f"{'step':34s} {'timing':10s} {'host/call':>10s}  [min-max]        launch/call", flush=True)
    for name, fn, timings in ([(n, f, ("b2b", "b2b short", "isolated")) for n, f in launching]
                              + [(n, f, ("b2b",)) for n, f in host_only]):
        for how in timings:
            torch.cuda.synchronize()
            dist.barrier(group)
            if how == "isolated":
                med, lo, hi, launch = timed(torch, _native, fn, a.calls, a.repeats, warmup=5, isolated=True)
                label = f"isolated {a.calls}"
            else:
                calls = a.calls if how == "b2b" else short
                med, lo, hi, launch = timed(torch, _native, fn, calls, a.repeats, warmup=min(30, calls))
                label = f"b2b {calls}"
            mine = {"step": name, "timing": label, "median_us": med, "min_us": lo, "max_us": hi, "launch_us": launch}
            every = [None] * world
            dist.all_gather_object(every, mine, group)
            worst = max(every, key=lambda r: r["median_us"])
            row = dict(worst, rank=every.index(worst), per_rank_median_us=[r["median_us"] for r in every])
            rows.append(row)
            if rank == 0:
                print(f"{name:34s} {label:10s} {worst['median_us']:7.2f} us  "
                      f"[{worst['min_us']:.2f}-{worst['max_us']:.2f}]  {worst['launch_us']:6.2f} us", flush=True)
    torch.cuda.synchronize()
    dist.barrier(group)
    m = rx.shape[0]
    meta = {"mode": "intranode", "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "module": deepep_kernels.__file__,
            "ranks": world, "shape": f"{a.tokens} x {a.hidden}, top-{a.topk} of {a.experts}, {dcfg.num_sms} SMs, {m} rows received by rank 0",
            "calls": a.calls, "short_calls": short, "repeats": a.repeats, "arena": rt.arena_usage(),
            "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))}
    if rank == 0:
        print(json.dumps(meta), flush=True)
        with open(out_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f)
    del rx, handle
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
