"""Spawns the ranks of one GPU test with torch.multiprocessing and a gloo process group.

Rank count: ``DEEPEP_TEST_RANKS`` (default 2). GPUs used: ``DEEPEP_TEST_GPUS`` (default: all
visible, at most the rank count); rank r runs on GPU ``r * gpus // ranks``, so 4 or 8 ranks with
``DEEPEP_TEST_GPUS=1`` share one GPU (oversubscribed). The exchanges of the Buffer go through the
gloo group (NCCL refuses two ranks on one GPU); the group is initialised from a file, so the test
opens no port of its own.
"""

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def num_ranks() -> int:
    return int(os.environ.get("DEEPEP_TEST_RANKS", "2"))


def num_gpus(ranks: int) -> int:
    n = int(os.environ.get("DEEPEP_TEST_GPUS", "0")) or torch.cuda.device_count()
    return max(1, min(n, ranks, torch.cuda.device_count()))


def _entry(rank, world, gpus, init_file, fn, args):
    dev = rank * gpus // world
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, dist.group.WORLD, *args)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run(fn, *args, world=None):
    """Run ``fn(rank, world, group, *args)`` on every rank; raises if any rank failed."""
    world = world or num_ranks()
    gpus = num_gpus(world)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, gpus, os.path.join(d, "pg"), fn, args), nprocs=world, join=True)


def gather(group, obj):
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group)
    return out
