"""``deep_ep.utils.refs``: the torch references that DeepEP 2.1's V2 test compares
``ElasticBuffer`` against bit for bit, written for deepep_kernels.

- ``dispatch``: every token goes to each rank that holds one of its experts, through
  ``torch.distributed.all_to_all_single`` (the default group); rows arrive grouped by source rank,
  in source token order.
- ``generate_pre_combine_data``: deterministic expert outputs from a token's global index.
- ``ordered_accumulate``: a float32 sum over the top-k slots in slot order.
- ``combine``: the V2 reduction order: slots are first summed within their rank (and, with
  ``reduce_in_scaleup``, within their scale-up domain), each partial sum rounded to the data's
  dtype, then everything with the bias in slot order.

The results equal DeepEP's own ``deep_ep/utils/refs.py`` (commit dd758ca) bit for bit on the
same inputs: the same float32 additions in the same order, the same roundings
(python/tests/gpu/test_v2_utils_bitwise.py checks it).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .envs import get_global_seed
from .math import ceil_div

__all__ = ["dispatch", "generate_pre_combine_data", "ordered_accumulate", "combine"]

# the prime that scatters token seeds in generate_pre_combine_data
_SEED_PRIME = 131071


def _rows(t: Optional[torch.Tensor], index: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t is None else t[index]


def _cat(parts: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    return None if parts[0] is None else torch.cat(list(parts), dim=0)


def dispatch(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
             topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
             num_max_tokens_per_rank: int, num_experts: int):
    """Reference dispatch (not expanded) over the default process group.

    ``x``: ``[num_tokens, hidden]``, or FP8 ``(values [num_tokens, hidden], scales [num_tokens,
    ceil(hidden / 128)])``; ``topk_idx``, ``topk_weights``: ``[num_tokens, num_topk]`` (-1: no
    expert); ``num_max_tokens_per_rank``: DeepEP's, as source token indices are global:
    ``src_rank * num_max_tokens_per_rank + local index``; ``num_experts``: in all ranks, a multiple
    of the world size.

    Returns ``(recv_x, recv_topk_idx, recv_topk_weights, recv_src_token_idx,
    num_recv_tokens_per_rank)``: the received rows grouped by source rank in source token order
    (``recv_x`` an FP8 pair when ``x`` was), ``recv_topk_idx`` as this rank's local expert ids
    (-1 for experts elsewhere), the weights as sent (all of the token's slots), int32 global source
    indices, and int32 ``[world]`` counts (on torch's default device).
    """
    rank = dist.get_rank()
    num_ranks = dist.get_world_size()
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts = {num_experts} is not a multiple of the world size {num_ranks}")
    experts_per_rank = num_experts // num_ranks

    use_fp8 = isinstance(x, tuple)
    x, sf = x if use_fp8 else (x, None)
    num_tokens, hidden = x.size()
    if topk_idx.size(0) != num_tokens:
        raise ValueError(f"topk_idx has {topk_idx.size(0)} rows, x has {num_tokens}")
    num_topk = topk_idx.size(1)
    if sf is not None and tuple(sf.shape) != (num_tokens, ceil_div(hidden, 128)):
        raise ValueError(f"FP8 scales have shape {tuple(sf.shape)}, expected [{num_tokens}, {ceil_div(hidden, 128)}] (one per 128 columns)")
    if topk_weights is not None and tuple(topk_weights.shape) != (num_tokens, num_topk):
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected topk_idx's {(num_tokens, num_topk)}")

    # What goes to each destination rank: its tokens in token order, their expert ids outside the
    # destination's range replaced by -1.
    send = {"x": [], "sf": [], "idx": [], "weights": [], "src": []}
    send_counts: List[int] = []
    for dst in range(num_ranks):
        first, end = dst * experts_per_rank, (dst + 1) * experts_per_rank
        tokens = ((first <= topk_idx) & (topk_idx < end)).any(dim=1).nonzero(as_tuple=True)[0]
        ids = topk_idx[tokens]
        send["x"].append(x[tokens])
        send["sf"].append(_rows(sf, tokens))
        send["idx"].append(torch.where((first <= ids) & (ids < end), ids, torch.full_like(ids, -1)))
        send["weights"].append(_rows(topk_weights, tokens))
        send["src"].append(tokens)
        send_counts.append(tokens.numel())
    send_src = torch.cat(send["src"], dim=0).to(torch.int) + rank * num_max_tokens_per_rank

    counts_out = torch.tensor(send_counts, dtype=torch.int, device=x.device)
    counts_in = torch.empty((num_ranks,), dtype=torch.int, device=x.device)
    dist.all_to_all_single(counts_in, counts_out)
    recv_counts = counts_in.tolist()
    num_recv = sum(recv_counts)

    def exchange(parts, width, dtype):
        if parts[0] is None:
            return None
        out = torch.empty((num_recv,) + tuple(width), dtype=dtype, device=x.device)
        dist.all_to_all_single(out, _cat(parts), recv_counts, send_counts)
        return out

    recv_x = exchange(send["x"], (hidden,), x.dtype)
    recv_sf = exchange(send["sf"], (sf.size(1),), sf.dtype) if use_fp8 else None
    recv_idx = exchange(send["idx"], (num_topk,), topk_idx.dtype)
    recv_weights = exchange(send["weights"], (num_topk,), topk_weights.dtype) if topk_weights is not None else None
    recv_src = torch.empty((num_recv,), dtype=torch.int, device=x.device)
    dist.all_to_all_single(recv_src, send_src, recv_counts, send_counts)

    # this rank's experts as local ids
    first = rank * experts_per_rank
    mine = (first <= recv_idx) & (recv_idx < first + experts_per_rank)
    recv_idx = (recv_idx - first).masked_fill_(~mine, -1)

    return ((recv_x, recv_sf) if use_fp8 else recv_x, recv_idx, recv_weights, recv_src,
            torch.tensor(recv_counts, dtype=torch.int))


def generate_pre_combine_data(src_token_global_idx: torch.Tensor,
                              num_max_tokens_per_rank: int, num_topk: int, hidden: int) -> torch.Tensor:
    """bfloat16 ``[num_tokens, num_topk, hidden]``: for token ``i``'s slot ``j`` and column ``k``,
    ``sin((s * 131071 % m + 1) / m * (k + 1) + sin(global seed))`` with
    ``s = src_token_global_idx[i] * num_topk + j`` and ``m = world size * num_max_tokens_per_rank *
    num_topk`` (float32 arithmetic, one op at a time, as torch evaluates it)."""
    device = src_token_global_idx.device
    seeds = src_token_global_idx.unsqueeze(1) * num_topk + torch.arange(num_topk, device=device).unsqueeze(0)
    max_seed = dist.get_world_size() * num_max_tokens_per_rank * num_topk
    phase = ((seeds * _SEED_PRIME % max_seed).float() + 1) / max_seed
    columns = torch.arange(1, hidden + 1, device=device, dtype=torch.float32).broadcast_to(1, 1, hidden)
    return torch.sin(phase.unsqueeze(-1) * columns + math.sin(float(get_global_seed()))).to(torch.bfloat16)


def ordered_accumulate(data: torch.Tensor, initial_value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``data [num_tokens, num_topk, hidden]`` summed over the slots in slot order, onto
    ``initial_value [num_tokens, hidden]`` (a copy; float32 zeros without it), each slot widened to
    float32 before it is added; the result in ``data``'s dtype."""
    if initial_value is None:
        total = torch.zeros((data.shape[0], data.shape[2]), dtype=torch.float32, device=data.device)
    else:
        total = initial_value.clone()
    for slot in range(data.shape[1]):
        total += data[:, slot, :].float()
    return total.to(data.dtype)


def _reduce_within_groups(data: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per token, the slots of one group (equal ``group`` ids, -1 included) summed in slot order
    in float32 from +0.0, rounded to ``data``'s dtype and put in the group's last slot; the other
    slots of the group become +0.0."""
    num_topk = data.shape[1]
    # same[t, i, j]: slots i and j of token t are in one group
    same = group.unsqueeze(2) == group.unsqueeze(1)
    later = torch.ones((num_topk, num_topk), dtype=torch.bool, device=data.device).tril(-1)  # [i, j]: i > j
    is_last = ~(same & later).any(dim=1)  # [t, j]
    out = torch.empty_like(data)
    zero = torch.zeros((), dtype=data.dtype, device=data.device)
    for j in range(num_topk):
        # the group's slots up to j, in order; slots outside the group add +0.0, which leaves the
        # sum unchanged (a sum from +0.0 is never -0.0), so the float32 additions are the same
        # as adding the group's slots alone
        partial = torch.zeros((data.shape[0], data.shape[2]), dtype=torch.float32, device=data.device)
        for i in range(j + 1):
            partial += torch.where(same[:, i, j].unsqueeze(-1), data[:, i, :].float(), 0.0)
        out[:, j, :] = torch.where(is_last[:, j].unsqueeze(-1), partial.to(data.dtype), zero)
    return out


def combine(y: torch.Tensor, topk_idx: torch.Tensor,
            num_scaleout_ranks: int, num_scaleup_ranks: int, num_experts: int,
            bias: Optional[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor]],
            reduce_in_local: bool, reduce_in_scaleup: bool) -> torch.Tensor:
    """Reference combine of ``y [num_tokens, num_topk, hidden]`` (slot ``j`` is the output of
    expert ``topk_idx[:, j]``) into ``[num_tokens, hidden]``, in V2's reduction order:

    - ``reduce_in_local``: first the slots on one rank are summed (float32, slot order) and
      rounded to ``y``'s dtype, in the rank's last slot;
    - ``reduce_in_scaleup`` (needs ``reduce_in_local``): then those partial sums within each
      scale-up domain of ``num_scaleup_ranks`` ranks, the same way;
    - last, all slots in slot order onto the bias in float32 (``ordered_accumulate``): no bias,
      one tensor, or two (added to each other in float32 first).

    ``(False, False)`` is V2's combine without ``allow_multiple_reduction``; ``(True, False)`` its
    plain combine; ``(True, True)`` its hybrid one. With one scale-out rank, ``(True, True)`` and
    ``(True, False)`` still differ: the extra rounding step.
    """
    if reduce_in_scaleup and not reduce_in_local:
        raise ValueError("reduce_in_scaleup needs reduce_in_local (the scale-up reduction sums the per-rank partial sums)")
    experts_per_rank = num_experts // (num_scaleout_ranks * num_scaleup_ranks)
    if reduce_in_local:
        y = _reduce_within_groups(y, topk_idx // experts_per_rank)
    if reduce_in_scaleup:
        y = _reduce_within_groups(y, topk_idx // (experts_per_rank * num_scaleup_ranks))
    if isinstance(bias, (tuple, list)):
        first, second = bias
        bias_sum = first.float() + second.float()
    else:
        bias_sum = None if bias is None else bias.float()
    return ordered_accumulate(y, bias_sum)
