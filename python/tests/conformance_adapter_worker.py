"""One rank of test_v2_utils_runner.py's gloo test of the conformance adapter
(python/scripts/conformance/sitecustomize.py and deepep_conformance_staging.py), on CPU tensors,
and on CUDA tensors too where a GPU is visible.

Usage: python conformance_adapter_worker.py RANK WORLD INIT_FILE
"""

import importlib.util
import inspect
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
CONFORMANCE = os.path.join(HERE, "..", "scripts", "conformance")


def load_adapter():
    sys.path.insert(0, CONFORMANCE)  # sitecustomize imports deepep_conformance_staging from there
    os.environ["DEEPEP_CONFORMANCE_ADAPTER"] = "1"
    spec = importlib.util.spec_from_file_location("conformance_sitecustomize", os.path.join(CONFORMANCE, "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import deepep_conformance_staging

    return deepep_conformance_staging


def splits(world):
    """rows[src][dst] sent from src to dst: uneven, zeros included."""
    return [[(src * 2 + dst) % 3 for dst in range(world)] for src in range(world)]


def rows_for(src, dst, count, width):
    """Distinct values per (src, dst, row, column), exact in bfloat16 and float8_e4m3fn bytes."""
    base = torch.arange(count * width, dtype=torch.float32, device="cpu").reshape(count, width)
    return base + 16 * (src * 4 + dst) if width else base


def check_exchange(rank, world, device, exchange, label):
    s = splits(world)
    in_splits = s[rank]
    out_splits = [s[src][rank] for src in range(world)]
    for dtype, width in ((torch.bfloat16, 5), (torch.float8_e4m3fn, 3), (torch.int32, 0)):
        if width:
            send = torch.cat([rows_for(rank, dst, s[rank][dst], width) for dst in range(world)]).to(dtype)
            want = torch.cat([rows_for(src, rank, s[src][rank], width) for src in range(world)]).to(dtype)
            out = torch.zeros((sum(out_splits), width), dtype=torch.float32, device="cpu").to(dtype)
        else:  # 1-D rows
            send = torch.cat([torch.full((s[rank][dst],), rank * 100 + dst, dtype=dtype, device="cpu") for dst in range(world)])
            want = torch.cat([torch.full((s[src][rank],), src * 100 + rank, dtype=dtype, device="cpu") for src in range(world)])
            out = torch.full((sum(out_splits),), -1, dtype=dtype, device="cpu")
        send, out = send.to(device), out.to(device)
        exchange(out, send, out_splits, in_splits)
        got, exp = out.cpu(), want
        if dtype == torch.float8_e4m3fn:
            got, exp = got.view(torch.uint8), exp.view(torch.uint8)
        assert torch.equal(got, exp), f"{label} {dtype} rank {rank}: got {got.tolist()} want {exp.tolist()}"
    # no splits: an even split of the rows
    even = torch.arange(world * 2 * 2, dtype=torch.int64, device="cpu").reshape(world * 2, 2) + 1000 * rank
    dev_out = torch.empty_like(even).to(device)
    exchange(dev_out, even.to(device), None, None)
    want = torch.cat([torch.arange(world * 2 * 2, dtype=torch.int64, device="cpu").reshape(world * 2, 2)[2 * rank:2 * rank + 2] + 1000 * src
                      for src in range(world)])
    assert torch.equal(dev_out.cpu(), want), f"{label} even split rank {rank}"


def main():
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    staging = load_adapter()
    # DeepEP 2.1's init_dist looks for device_id in the signature and passes a CUDA device that need
    # not exist (more ranks than GPUs): the adapter keeps the signature and drops the argument
    assert "device_id" in inspect.signature(dist.init_process_group).parameters
    dist.init_process_group(backend="nccl", init_method=f"file://{init_file}", world_size=world, rank=rank,
                            device_id=torch.device("cuda:7"))
    assert dist.get_backend() == "gloo", dist.get_backend()
    # new_group asked for NCCL (with options) gives a gloo group that works
    group = dist.new_group(list(range(world)), backend="nccl")
    dist.barrier(group=group)
    t = torch.tensor([rank + 1.0], device="cpu")
    dist.all_reduce(t, group=group)
    assert t.item() == world * (world + 1) / 2

    def through_cpu(out, inp, out_splits, in_splits):
        staging.all_to_all_single_through_cpu(dist.all_to_all_single, out, inp, out_splits, in_splits, group=group)

    check_exchange(rank, world, "cpu", through_cpu, "staged")
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)  # the adapter maps it onto the GPUs there are
        # the adapter's all_to_all_single on CUDA tensors (what DeepEP's refs.dispatch calls)
        check_exchange(rank, world, "cuda", lambda o, i, os_, is_: dist.all_to_all_single(o, i, os_, is_), "adapter on CUDA")
        torch.set_default_device("cuda")  # DeepEP 2.1's init_dist does this; staging must not follow it
        check_exchange(rank, world, "cuda", lambda o, i, os_, is_: dist.all_to_all_single(o, i, os_, is_), "default device cuda")
    dist.destroy_process_group()
    print(f"ok {rank}", flush=True)


if __name__ == "__main__":
    main()
