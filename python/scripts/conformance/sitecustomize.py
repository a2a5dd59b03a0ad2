"""Environment-only adapter for running DeepEP's own test files unchanged with several ranks on
one GPU (python/scripts/deepep-conformance.sh puts this folder first on PYTHONPATH, so every
Python process of the run, the spawned ranks too, imports it at start-up).

It changes the environment, never the tests or the library under test:

- ``torch.cuda.set_device(i)`` selects GPU ``i % DEEPEP_CONFORMANCE_GPUS`` (default: all visible),
  so ranks 0..N-1 share the GPUs there are (several ranks per GPU on purpose).
- ``torch.distributed.init_process_group`` uses gloo instead of NCCL (NCCL refuses two ranks on
  one GPU) and drops ``device_id`` (NCCL-only eager init; DeepEP 2.1's init_dist passes
  ``cuda:<local rank>``, which need not exist with more ranks than GPUs, and a bound device would
  make gloo's barrier use it). ``new_group`` makes gloo groups too (a backend or NCCL options
  asked for are dropped), so ``group.barrier()`` and the collectives below work on them.
- Collectives on CUDA tensors (all_reduce, all_gather, all_gather_into_tensor, broadcast,
  all_to_all_single) run through the CPU: copied to host, exchanged by gloo, copied back. float8
  tensors travel as their bytes (torch 2.11's gloo rejects float8 and cannot unpickle it);
  all_to_all_single moves every tensor as rows of bytes with the caller's (uneven) row splits
  (deepep_conformance_staging.py beside this file). Staging tensors name their device and dtype,
  so ``torch.set_default_device('cuda')`` / ``set_default_dtype(torch.bfloat16)`` (DeepEP 2.1's
  init_dist) do not reach them.

Active only when DEEPEP_CONFORMANCE_ADAPTER=1; otherwise it does nothing. If another
sitecustomize exists further down sys.path, it is still run first.
"""

import importlib.util
import os
import sys


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for p in sys.path:
        if not p or os.path.abspath(p) == here:
            continue
        cand = os.path.join(p, "sitecustomize.py")
        if os.path.isfile(cand):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", cand)
            mod = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(mod)
            except Exception as e:  # pragma: no cover - the shadowed file is the machine's
                print(f"[conformance adapter] the machine's {cand} failed: {e}", file=sys.stderr)
            return


def _install() -> None:
    import functools

    import torch
    import torch.distributed as dist

    import deepep_conformance_staging as staging

    gpus = int(os.environ.get("DEEPEP_CONFORMANCE_GPUS", "0")) or max(1, torch.cuda.device_count())
    orig_set_device = torch.cuda.set_device

    def set_device(device):
        idx = device.index if isinstance(device, torch.device) else device
        if isinstance(idx, int):
            return orig_set_device(idx % gpus)
        return orig_set_device(device)

    torch.cuda.set_device = set_device

    orig_init = dist.init_process_group

    # functools.wraps keeps the signature, so callers that look for `device_id` in it (DeepEP
    # 2.1's init_dist) still pass it, and it is dropped here
    @functools.wraps(orig_init)
    def init_process_group(*args, **kwargs):
        kwargs.pop("device_id", None)
        if args:
            args = ("gloo",) + tuple(args[1:])
        else:
            kwargs["backend"] = "gloo"
        return orig_init(*args, **kwargs)

    dist.init_process_group = init_process_group

    orig_new_group = dist.new_group

    @functools.wraps(orig_new_group)
    def new_group(*args, **kwargs):
        # new_group(ranks=None, timeout=None, backend=None, pg_options=None, ...): the default
        # group's backend (gloo), never NCCL or its options
        args = list(args)
        if len(args) > 2:
            args[2] = None
        if len(args) > 3:
            args[3] = None
        for key in ("backend", "pg_options", "device_id"):
            kwargs.pop(key, None)
        return orig_new_group(*args, **kwargs)

    dist.new_group = new_group

    fp8 = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None)

    def to_host(t):
        """A host copy of ``t`` to exchange (float8 as its bytes)."""
        host = t.detach().contiguous().cpu()
        return host.view(torch.uint8) if t.dtype in fp8 else host

    def write_back(t, h):
        """Copy the exchanged host tensor ``h`` (bytes for float8) into ``t`` on its device."""
        if t.dtype in fp8:
            h = h.view(t.dtype)
        t.copy_(h.reshape(t.shape).to(t.device))

    orig_all_reduce = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not tensor.is_cuda:
            return orig_all_reduce(tensor, op=op, group=group, async_op=async_op)
        host = to_host(tensor)
        orig_all_reduce(host, op=op, group=group)
        write_back(tensor, host)
        return _done(async_op)

    orig_all_gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not tensor.is_cuda:
            return orig_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        host = to_host(tensor)
        outs = [torch.empty_like(host) for _ in tensor_list]
        orig_all_gather(outs, host, group=group)
        for t, h in zip(tensor_list, outs):
            write_back(t, h)
        return _done(async_op)

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        host = to_host(input_tensor)
        n = dist.get_world_size(group)
        outs = [torch.empty_like(host) for _ in range(n)]
        orig_all_gather(outs, host, group=group)
        write_back(output_tensor, torch.cat([o.reshape(-1) for o in outs]))
        return _done(async_op)

    orig_broadcast = dist.broadcast

    def broadcast(tensor, src=None, group=None, async_op=False, **kw):
        if not tensor.is_cuda:
            return orig_broadcast(tensor, src=src, group=group, async_op=async_op, **kw)
        host = to_host(tensor)
        orig_broadcast(host, src=src, group=group, **kw)
        write_back(tensor, host)
        return _done(async_op)

    orig_all_to_all_single = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if not (output.is_cuda or input.is_cuda):
            return orig_all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        staging.all_to_all_single_through_cpu(orig_all_to_all_single, output, input, output_split_sizes, input_split_sizes,
                                              group=group)
        return _done(async_op)

    class _Done:
        def wait(self, *a, **k):
            return True

        def is_completed(self):
            return True

    def _done(async_op):
        return _Done() if async_op else None

    dist.all_reduce = all_reduce
    dist.all_gather = all_gather
    dist.all_gather_into_tensor = all_gather_into_tensor
    dist.broadcast = broadcast
    dist.all_to_all_single = all_to_all_single
    print(f"[conformance adapter] pid {os.getpid()}: set_device mod {gpus}, gloo, CUDA collectives (all_to_all_single too) through the CPU",
          file=sys.stderr, flush=True)


_run_shadowed_sitecustomize()
if os.environ.get("DEEPEP_CONFORMANCE_ADAPTER") == "1":
    _install()
