"""``deep_ep.utils.gate``: routing scores with a chosen imbalance, for DeepEP 2.1's tests,
written for deepep_kernels.

``get_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, precise)`` returns
float32 scores ``[num_tokens, num_experts]`` whose top-k send rank 0 about ``ratio`` times the
tokens of any other rank. With the same torch seed it returns DeepEP's scores bit for bit: the
random draws (``torch.rand`` in torch's default dtype, ``uniform_``, ``randperm``) happen in
DeepEP's order and shapes. The generators run on ``device`` (CUDA, as DeepEP's, by default).
"""

from __future__ import annotations

import torch

__all__ = [
    "get_unbalanced_scores", "get_precise_unbalanced_scores", "get_random_unbalanced_scores", "generate_rank_count",
    "generate_topk_idx", "get_scores_by_factor", "map_unbalanced_ratio_to_factor",
]


def generate_topk_idx(rank_count: torch.Tensor, num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                      *, device="cuda") -> torch.Tensor:
    """Expert ids ``[num_tokens, num_topk]`` from ``rank_count [num_tokens, num_ranks]`` (how many
    of a token's experts sit on each rank; each row sums to ``num_topk``): for each rank, that many
    of its experts, drawn at random without repetition, ranks in ascending order."""
    if tuple(rank_count.shape) != (num_tokens, num_ranks):
        raise ValueError(f"rank_count has shape {tuple(rank_count.shape)}, expected [num_tokens, num_ranks] = [{num_tokens}, {num_ranks}]")
    row_sums = rank_count.sum(dim=1)
    if not torch.equal(row_sums, torch.full_like(row_sums, num_topk)):
        raise ValueError(f"every row of rank_count must sum to num_topk = {num_topk}")
    per_rank = num_experts // num_ranks
    shape = (num_tokens, num_ranks, per_rank)
    experts = torch.arange(num_experts, device=device).view(1, num_ranks, per_rank).expand(*shape)
    # a random order of each rank's experts, per token
    order = torch.argsort(torch.rand(*shape, device=device), dim=-1)
    shuffled = torch.gather(experts, 2, order)
    position = torch.arange(per_rank, device=device).view(1, 1, per_rank).expand(*shape)
    taken = position < rank_count.unsqueeze(2).expand(*shape)
    return shuffled[taken].view(num_tokens, num_topk)


def generate_rank_count(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                        *, device="cuda") -> torch.Tensor:
    """``[num_tokens, num_ranks]`` int32: how many of each token's ``num_topk`` experts sit on each
    rank, such that rank 0 (the special rank) is chosen by about ``ratio`` times as many tokens as
    each other rank."""
    if ratio < 1.0:
        raise ValueError(f"ratio must be no less than 1.0, got {ratio}")
    per_rank = num_experts // num_ranks
    others = num_ranks - 1

    # how many distinct ranks each token reaches, from a uniform random top-k
    draw = torch.rand(num_tokens, num_experts, device=device)
    _, chosen = torch.topk(draw, num_topk, dim=1, largest=True, sorted=False)
    chosen //= per_rank
    chosen_sorted = torch.sort(chosen, dim=1)[0]
    ranks_reached = (chosen_sorted[:, 1:] != chosen_sorted[:, :-1]).sum(dim=1) + 1
    # at most this many ranks per token keeps the special rank's share reachable
    ranks_reached = torch.clamp(ranks_reached, None, int(others / ratio) + 1)

    total = torch.sum(ranks_reached).item()
    per_other = int(total / (others + ratio))
    special_tokens = total - per_other * others
    special_tokens = min(special_tokens, int(per_other * ratio) + 1)
    # a token that reaches every rank reaches the special one too
    reaches_all = ranks_reached == num_ranks
    num_reaches_all = int(reaches_all.sum().item())
    special_tokens = max(num_reaches_all, special_tokens)

    optional_rows = torch.where(reaches_all == 0)[0]
    optional_rows = optional_rows[torch.randperm(num_tokens - num_reaches_all, device=device)][:special_tokens - num_reaches_all]
    special_rows = torch.cat((torch.where(reaches_all != 0)[0], optional_rows))

    # other ranks in a random cyclic order, fill every slot but each special row's first one
    cycle = (torch.randperm(others, device=device) + 1).repeat(num_tokens * num_topk // others + 1)
    row_starts = torch.cumsum(torch.cat((torch.tensor([0], device=device), ranks_reached)), dim=0)[:-1]
    slots = torch.zeros(num_tokens * num_topk, dtype=torch.long, device=device)
    is_special_slot = torch.zeros(num_tokens * num_topk, dtype=torch.bool, device=device)
    is_special_slot[row_starts[special_rows]] = 1
    other_slots = torch.arange(num_tokens * num_topk, device=device)[is_special_slot != True]  # noqa: E712 - a tensor comparison
    slots[other_slots] = cycle[:len(other_slots)]

    # token t's k-th pick is its (k mod ranks_reached[t])-th slot
    pick = torch.arange(num_topk, device=device).view(1, num_topk) % ranks_reached.view(num_tokens, 1)
    picked_ranks = slots[row_starts.view(num_tokens, 1) + pick]
    picked_ranks = picked_ranks[torch.randperm(num_tokens, device=device)]

    rank_count = torch.zeros((num_tokens, num_ranks), dtype=torch.int32, device=device)
    rank_count.scatter_add_(dim=1, index=picked_ranks, src=torch.ones_like(picked_ranks, dtype=torch.int32))
    return rank_count


def get_precise_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                                  *, device="cuda") -> torch.Tensor:
    """Scores whose top-k follows ``generate_rank_count`` exactly: the chosen experts score in
    ``(0.9, 1.0)``, all others in ``[0, 0.9)``. A constructed distribution, unlike real routing."""
    rank_count = generate_rank_count(num_tokens, num_experts, num_ranks, num_topk, ratio, device=device)
    low = 0.9
    scores = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=device)
    scores.uniform_(to=low)
    chosen = generate_topk_idx(rank_count, num_tokens, num_experts, num_ranks, num_topk, device=device)
    high = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=device)
    high.uniform_(low + 1e-6, 1.0)
    rows = torch.arange(num_tokens, device=device).unsqueeze(1).expand(num_tokens, num_topk)
    scores[rows, chosen] = high
    return scores


def get_scores_by_factor(num_tokens: int, num_experts: int, num_ranks: int, factor: float, *, device="cuda") -> torch.Tensor:
    """float32 scores: rank 0's experts uniform in ``[0, factor)``, all others in ``[0, 1)``."""
    per_rank = num_experts // num_ranks
    scores = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=device)
    scores[:, :per_rank].uniform_(to=factor)
    scores[:, per_rank:].uniform_(to=1)
    return scores


def map_unbalanced_ratio_to_factor(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                                   *, device="cuda") -> float:
    """The ``get_scores_by_factor`` factor (bisected in ``[1, 100]``, 20 steps, each on fresh
    random scores) at which rank 0 is reached by about ``ratio`` times the tokens of the mean
    other rank."""
    low, high = 1.0, 100.0
    per_rank = num_experts // num_ranks
    for _ in range(20):
        mid = (low + high) / 2
        scores = get_scores_by_factor(num_tokens, num_experts, num_ranks, mid, device=device)
        _, chosen = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)
        reached = torch.nn.functional.one_hot(chosen // per_rank, num_ranks).any(dim=1)
        tokens_per_rank = reached.to(torch.float).sum(dim=0)
        if tokens_per_rank[0].item() > tokens_per_rank[1:].mean().item() * ratio:
            high = mid
        else:
            low = mid
    return low


def get_random_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                                 *, device="cuda") -> torch.Tensor:
    """``get_scores_by_factor`` at the factor that gives ``ratio`` (1.0: no imbalance, no search)."""
    factor = 1.0
    if ratio != 1.0:
        factor = map_unbalanced_ratio_to_factor(num_tokens, num_experts, num_ranks, num_topk, ratio, device=device)
    return get_scores_by_factor(num_tokens, num_experts, num_ranks, factor, device=device)


def get_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float, precise: bool,
                          *, device="cuda") -> torch.Tensor:
    """float32 routing scores ``[num_tokens, num_experts]`` whose top-``num_topk`` favours rank 0 by
    ``ratio``: exactly (``precise``: ``get_precise_unbalanced_scores``) or through a bisected
    score factor (``get_random_unbalanced_scores``)."""
    if precise:
        return get_precise_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, device=device)
    return get_random_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, device=device)
