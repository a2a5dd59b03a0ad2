#!/usr/bin/env python3
"""Where the host time of one low-latency call goes: the ``deep_ep`` API call of our package,
and each step of it alone, timed the way ``bench.py`` times host cost (``perf_counter_ns``
around back-to-back calls, no synchronisation inside the loop, divided by the calls).

    python3 python/scripts/host_profile.py [--tokens 128] [--hidden 7168] [--topk 8] [--experts 288]
                                            [--calls 300] [--repeats 5] [--json FILE]

One rank on GPU 0 (a gloo group of one). Steps:

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

With ``DEEPEP_HOST_TIMING=1`` (set by this script) our runtime also counts the host time spent
inside ``cuLaunchKernelEx``; the ``launch`` column is that time per call.

Each figure is the median over ``--repeats`` loops of ``--calls`` calls (after a warm-up); the
``no joins`` rows leave the outputs unordered for the current stream (a measurement, not a
usage). Not a benchmark against anything: it says which
part of our host path costs what, on this machine.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def timed(torch, native, fn, calls, repeats, warmup=30):
    """(median, min, max) host us per call over ``repeats`` loops, and the median us per call
    spent inside cuLaunchKernelEx (our launches only)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per, launch = [], []
    for _ in range(repeats):
        native.launch_timing(True)
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter_ns()
        _, ns = native.launch_timing(True)
        torch.cuda.synchronize()
        per.append((t1 - t0) / calls / 1e3)
        launch.append(ns / calls / 1e3)
    return statistics.median(per), min(per), max(per), statistics.median(launch)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # DeepEP's low-latency test shape; calls per loop and loops of each timing
    for name, default in (("tokens", 128), ("hidden", 7168), ("topk", 8), ("experts", 288), ("calls", 300), ("repeats", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    os.environ["DEEPEP_HOST_TIMING"] = "1"  # read at the first launch
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


if __name__ == "__main__":
    sys.exit(main())
