"""A MoE layer's token exchange written for DeepEP's ``deep_ep`` API (nothing here names
deepep_kernels). Run it against deepep_kernels through the opt-in shim:

    PYTHONPATH="$(python3 -m deepep_kernels.shim)" torchrun --nproc-per-node 2 python/examples/moe_deep_ep.py

Each rank routes its tokens to top-k experts, dispatches them (normal mode), applies a toy
expert (scale by the local expert id + 1, weighted by the gate), combines, and checks the result
against the same computation done locally; then the same for the low-latency mode. With fewer
GPUs than ranks, ranks share GPUs (rank r on GPU r * gpus // ranks).
"""

import os

import torch
import torch.distributed as dist

from deep_ep import Buffer, EventOverlap
from deep_ep.utils import EventHandle


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank * min(gpus, world) // world)
    # gloo carries the Buffer's exchanges even when ranks share a GPU (NCCL would refuse)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    torch.manual_seed(rank)
    tokens, hidden, topk, experts = 256, 4096, 4, 8 * world
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    scores = torch.randn(tokens, experts, device="cuda")
    gate, topk_idx = scores.softmax(-1).topk(topk, dim=-1)
    topk_weights = gate.float()
    local = experts // world
    want = torch.zeros(tokens, hidden, device="cuda")
    for k in range(topk):
        factor = (topk_idx[:, k] % local + 1).float()[:, None]
        want += topk_weights[:, k : k + 1] * factor * x.float()

    # normal mode (training / prefill)
    hidden_bytes = hidden * 2
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world)))
    buffer = Buffer(group, nvl, 0, explicitly_destroy=True)
    prev = EventOverlap(EventHandle())
    per_rank, per_rdma, per_expert, in_rank, ev = buffer.get_dispatch_layout(topk_idx, experts, previous_event=prev, async_finish=True,
                                                                             allocate_on_comm_stream=True)
    recv_x, recv_idx, recv_w, counts, handle, ev = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=ev, async_finish=True, allocate_on_comm_stream=True)
    ev.current_stream_wait()
    assert sum(counts) == int((recv_idx >= 0).sum())
    # toy experts: each received row times sum_k w_k * (local id + 1) over this rank's selections
    factor = torch.where(recv_idx >= 0, recv_w * (recv_idx + 1).float(), torch.zeros_like(recv_w)).sum(1, keepdim=True)
    y = (recv_x.float() * factor).to(torch.bfloat16)
    combined, _, _ = buffer.combine(y, handle)
    err = (combined.float() - want).abs().max().item() / want.abs().max().item()
    print(f"rank {rank}: normal dispatch {recv_x.shape[0]} rows, combine max rel. error {err:.2e}", flush=True)
    assert err < 2e-2

    # low-latency mode (decode)
    num_max = 128
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max, hidden, world, experts)
    ll = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=local, explicitly_destroy=True)
    recv, recv_count, ll_handle, _, hook = ll.low_latency_dispatch(x[:num_max], topk_idx[:num_max], num_max, experts, use_fp8=False,
                                                                   return_recv_hook=True)
    hook()
    ids = torch.arange(local, device="cuda", dtype=torch.float32)[:, None, None] + 1
    out, _, _ = ll.low_latency_combine((recv.float() * ids).to(torch.bfloat16), topk_idx[:num_max], topk_weights[:num_max], ll_handle)
    err = (out.float() - want[:num_max]).abs().max().item() / want[:num_max].abs().max().item()
    print(f"rank {rank}: low-latency received {recv_count.tolist()}, combine max rel. error {err:.2e}", flush=True)
    assert err < 2e-2
    torch.cuda.synchronize()
    ll.destroy()
    buffer.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
