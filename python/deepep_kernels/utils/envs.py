"""``deep_ep.utils.envs``: process-group set-up, seeds and environment probes of DeepEP 2.1's
tests and programs, written for deepep_kernels.

The seeds live here: ``init_seed(s)`` makes ``get_global_seed() == s`` and
``get_local_seed() == s + rank`` and seeds torch and ``random`` with the local one;
``deep_ep.utils.refs.generate_pre_combine_data`` reads the global one (DeepEP's own ``refs.py``
too, when the conformance runner puts it over ours: it imports ``get_global_seed`` from here).
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import re
import subprocess
from typing import Any, Optional, Tuple

_local_rank: Optional[int] = None
_local_seed = 0
_global_seed = 0

# The NIC the RDMA probes ask about (DeepEP's EP_NIC_NAME).
_NIC_NAME = os.environ.get("EP_NIC_NAME", "mlx5_0")

__all__ = [
    "init_dist", "init_seed", "get_global_seed", "get_local_seed", "dist_print",
    "get_physical_domain_size", "get_logical_domain_size", "check_nvlink_connections", "check_torch_deterministic",
    "get_nvlink_gbs", "get_rdma_gbs", "check_fast_rdma_atomic_support",
]


def init_seed(global_seed: int) -> None:
    """Seed this rank: the global seed is ``global_seed``, the local one ``global_seed + rank``;
    torch's and ``random``'s generators get the local one."""
    import torch
    import torch.distributed as dist

    global _local_seed, _global_seed
    _global_seed = global_seed
    _local_seed = global_seed + dist.get_rank()
    torch.manual_seed(_local_seed)
    random.seed(_local_seed)


def get_local_seed() -> int:
    """The seed of this rank (``init_seed``'s global seed + rank; 0 before ``init_seed``)."""
    return _local_seed


def get_global_seed() -> int:
    """The seed shared by all ranks (the last ``init_seed`` argument; 0 before ``init_seed``)."""
    return _global_seed


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Print ``s`` on every rank (or, with ``once_in_node``, on local rank 0 only), then wait for
    all ranks (``dist.barrier()``). Needs ``init_dist`` first."""
    import torch.distributed as dist

    if _local_rank is None:
        raise RuntimeError("dist_print needs init_dist(local_rank, num_local_ranks) first (it prints once per node by the local rank)")
    if not once_in_node or _local_rank == 0:
        print(s, flush=True)
    dist.barrier()


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> Tuple[int, int, Any]:
    """Join the process group of DeepEP's tests and return ``(rank, world_size, group)``.

    Reads ``MASTER_ADDR`` (default 127.0.0.1) and ``MASTER_PORT`` (default 8361), and DeepEP's
    per-node launch variables ``WORLD_SIZE`` (number of nodes, default 1) and ``RANK`` (this node,
    default 0): the rank is ``RANK * num_local_ranks + local_rank`` of
    ``WORLD_SIZE * num_local_ranks``. Initializes an NCCL group over TCP (with ``device_id`` where
    torch takes it), then makes bfloat16 torch's default dtype and CUDA its default device, selects
    GPU ``local_rank``, calls ``init_seed(seed)``, and returns a new group of all ranks.
    """
    import torch
    import torch.distributed as dist

    global _local_rank
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "8361"))
    num_nodes = int(os.environ.get("WORLD_SIZE", "1"))
    node_rank = int(os.environ.get("RANK", "0"))
    _local_rank = local_rank

    kwargs = dict(backend="nccl", init_method=f"tcp://{addr}:{port}", world_size=num_nodes * num_local_ranks,
                  rank=node_rank * num_local_ranks + local_rank)
    if "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = torch.device(f"cuda:{local_rank}")
    dist.init_process_group(**kwargs)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    torch.cuda.set_device(local_rank)
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_nodes * num_local_ranks)))


def get_physical_domain_size(group: Any) -> Tuple[int, int]:
    """``(RDMA ranks, NVLink ranks)`` of ``group``: deepep_kernels' V2 API serves one NVLink node,
    so ``(1, group.size())``."""
    return 1, group.size()


def get_logical_domain_size(group: Any, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """``(scale-out ranks, scale-up ranks)`` of ``group``: one NVLink node, so ``(1, group.size())``
    whatever ``allow_hybrid_mode`` says (there is no scale-out domain to be hybrid across)."""
    return 1, group.size()


def check_nvlink_connections(group: Any) -> None:
    """Refuse a group of PCIe GPUs (e.g. A100 PCIe, NVLink-bridged in pairs at most) unless it
    has at most 2 ranks whose GPUs are NVLink peers (asked through ``pynvml``)."""
    import torch
    import torch.distributed as dist

    if "PCIE" not in torch.cuda.get_device_name():
        return
    if group.size() > 2:
        raise RuntimeError(f"a group of {group.size()} PCIe GPUs: PCIe GPUs have NVLink to one peer at most, so use at most 2 ranks")
    import pynvml

    pynvml.nvmlInit()
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7").strip(",").split(",")
        mine = int(visible[torch.cuda.current_device()])
        physical = [0] * group.size()
        dist.all_gather_object(physical, mine, group)
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in physical]
        for a in range(len(handles)):
            for b in range(a + 1, len(handles)):
                status = pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                if status != pynvml.NVML_P2P_STATUS_OK:
                    raise RuntimeError(f"GPU {physical[a]} and GPU {physical[b]} are not connected through NVLink")
    finally:
        pynvml.nvmlShutdown()


def check_torch_deterministic() -> None:
    """Refuse torch's deterministic algorithms together with ``fill_uninitialized_memory``: then
    every ``torch.empty`` launches a fill kernel that can overlap the communication streams."""
    import torch

    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        raise RuntimeError("torch.use_deterministic_algorithms(True) with torch.utils.deterministic.fill_uninitialized_memory = True "
                           "fills every torch.empty on the current stream; set fill_uninitialized_memory = False")


def _run(cmd) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


@functools.lru_cache()
def get_nvlink_gbs(factor: float = 0.9) -> float:
    """The first GPU's NVLink bandwidth in GB/s (the sum of its links in ``nvidia-smi nvlink -s``)
    times ``factor``; 0 (with a message) when it cannot be read."""
    try:
        text = _run(["nvidia-smi", "nvlink", "-s"])
        first_gpu = re.split(r"^GPU \d+:", text, flags=re.MULTILINE)
        if len(first_gpu) < 2:
            raise ValueError("no 'GPU n:' block in the output")
        links = [float(v) for v in re.findall(r"Link \d+:\s*([\d.]+) GB/s", first_gpu[1])]
        if not links:
            raise ValueError("no 'Link n: x GB/s' lines for the first GPU")
        return sum(links) * factor
    except Exception as e:  # noqa: BLE001 - a probe: report and go on
        print(f"Failed to get NVLink connection speed: {e}")
        return 0


def _ibstat_block(nic_name: str) -> str:
    text = _run(["ibstat"])
    m = re.search(rf"CA '{re.escape(nic_name)}'(.*?)(?=^CA '|\Z)", text, re.DOTALL | re.MULTILINE)
    if not m:
        raise ValueError(f"no CA '{nic_name}' in ibstat")
    return m.group(1)


@functools.lru_cache()
def check_fast_rdma_atomic_support(nic_name: str = _NIC_NAME) -> bool:
    """Whether ``nic_name`` is a ConnectX-8 (``CA type: MT4131``, fast RDMA atomics); False when
    ``ibstat`` cannot tell."""
    try:
        m = re.search(r"CA type:\s*(\S+)", _ibstat_block(nic_name))
        return bool(m) and m.group(1) == "MT4131"
    except Exception:  # noqa: BLE001 - a probe
        return False


@functools.lru_cache()
def get_rdma_gbs(nic_name: str = _NIC_NAME) -> float:
    """``nic_name``'s first port rate from ``ibstat`` in GB/s (Gb/s / 8); 0 (with a message) when
    it cannot be read."""
    try:
        m = re.search(r"Port \d+:.*?Rate:\s*(\d+)", _ibstat_block(nic_name), re.DOTALL)
        if not m:
            raise ValueError(f"no port rate of {nic_name} in ibstat")
        return int(m.group(1)) / 8
    except Exception as e:  # noqa: BLE001 - a probe
        print(f"Failed to get RDMA connection speed: {e}")
        return 0
