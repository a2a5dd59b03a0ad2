"""``deep_ep.utils.math``: the arithmetic helpers of DeepEP 2.1's tests and programs, written
for deepep_kernels.

The FP8 casts give DeepEP's bits: per 128-column block of a row, the scale is the block's
absolute maximum (at least 1e-4) over 448, values are multiplied by ``448.0 / amax`` (torch
computes that as ``amax.reciprocal() * 448.0``) and rounded to ``float8_e4m3fn``. Like DeepEP's,
they run through ``torch.compile(dynamic=True)`` (compiled at the first call), so their roundings
are the compiled kernels' on both sides.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Tuple

import torch

__all__ = [
    "calc_diff", "safe_div", "ceil_div", "align", "per_token_cast_to_fp8", "per_token_cast_back", "inplace_unique",
    "create_grouped_scores", "hash_tensor", "hash_tensors", "count_bytes",
]

# columns per FP8 scale
_BLOCK = 128
# the largest finite float8_e4m3fn value
_FP8_MAX = 448.0


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2 * sum(a * b) / sum(a * a + b * b)`` with ``a = x + 1``, ``b = y + 1`` in float64:
    0 for equal tensors, growing with their difference."""
    a = x.double() + 1
    b = y.double() + 1
    similarity = 2 * (a * b).sum() / (a * a + b * b).sum()
    return (1 - similarity).item()


def safe_div(a, b) -> float:
    """``a / b``, but ``0 / 0`` is 0 (another division by zero still raises)."""
    try:
        return a / b
    except ZeroDivisionError:
        if a == 0:
            return 0
        raise


def ceil_div(x: int, y: int) -> int:
    """``x / y`` rounded up (integers)."""
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y``."""
    return ceil_div(x, y) * y


def _compiled_on_first_call(fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=True)``, made at the first call (importing this module stays
    cheap)."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args, **kwargs)

    return call


def _blocks_of_128(x: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``x [m, n]`` zero-padded to a multiple of 128 columns, as ``[m, blocks, 128]``, and ``n``."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor [tokens, hidden], got shape {tuple(x.shape)}")
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x, (0, align(cols, _BLOCK) - cols), mode="constant", value=0)
    return padded.view(rows, -1, _BLOCK), cols


@_compiled_on_first_call
def per_token_cast_to_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [m, n]`` (bfloat16) -> ``(float8_e4m3fn [m, n], float32 scales [m, ceil(n / 128)])``,
    one scale per row and 128-column block; ``per_token_cast_back`` inverts it."""
    blocks, cols = _blocks_of_128(x)
    rows = x.shape[0]
    amax = blocks.abs().float().amax(dim=2).view(rows, -1).clamp(1e-4)
    scaled = blocks * (_FP8_MAX / amax.unsqueeze(2))
    values = scaled.to(torch.float8_e4m3fn).view(rows, -1)[:, :cols].contiguous()
    return values, (amax / _FP8_MAX).view(rows, -1)


@_compiled_on_first_call
def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """FP8 values ``[m, n]`` and their scales -> bfloat16 ``[m, n]``. The scales are float32
    ``[m, ceil(n / 128)]``, or int32 holding four UE8M0 exponent bytes each (scale
    ``2 ** (byte - 127)``)."""
    if x_fp8.numel() == 0:
        return x_fp8.to(torch.bfloat16)
    blocks, cols = _blocks_of_128(x_fp8)
    rows = x_fp8.shape[0]
    if x_scales.dtype == torch.int:
        # one exponent byte per block: its bits are the exponent field of a float32
        x_scales = (x_scales.view(dtype=torch.uint8).to(torch.int) << 23).view(dtype=torch.float)
    widened = blocks.to(torch.float32)
    restored = widened * x_scales.view(rows, -1, 1)
    return restored.view(rows, -1).to(torch.bfloat16)[:, :cols].contiguous()


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Rewrite each row of ``x [rows, k]`` (values in ``[0, num_slots)`` or negative) as its
    distinct non-negative values in descending order, then -1; only the first
    ``min(num_slots, k)`` columns can hold values."""
    if x.dim() != 2:
        raise ValueError(f"inplace_unique expects a 2-D tensor, got shape {tuple(x.shape)}")
    rows = x.size(0)
    present = torch.zeros((rows, num_slots + 1), dtype=torch.bool, device=x.device)
    # negative entries land in the extra last column, which is dropped
    present.scatter_(1, x.masked_fill(x < 0, num_slots), True)
    slot_ids = torch.arange(num_slots, dtype=x.dtype, device=x.device).expand(rows, num_slots)
    found = torch.where(present[:, :num_slots], slot_ids, torch.full_like(slot_ids, -1))
    descending = torch.sort(found, dim=1, descending=True).values
    width = min(num_slots, x.size(1))
    x.fill_(-1)
    x[:, :width] = descending[:, :width]


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``scores [tokens, experts]`` with the experts split into ``num_groups`` equal groups: the
    scores of the groups a token did not select (``group_idx [tokens, g]``) multiplied by 0."""
    num_tokens, num_experts = scores.shape
    selected = torch.zeros((num_tokens, num_groups), dtype=torch.bool, device=scores.device)
    selected.scatter_(1, group_idx, True)
    grouped = scores.view(num_tokens, num_groups, -1)
    return (grouped * selected.unsqueeze(-1).expand_as(grouped)).view(num_tokens, num_experts)


def hash_tensor(t: torch.Tensor) -> int:
    """The sum of ``t``'s bytes read as int32 words (a cheap bitwise fingerprint)."""
    return t.view(torch.int).sum().item()


def hash_tensors(*tensors: Any) -> int:
    """XOR of ``hash_tensor`` over the tensors (nested tuples and lists too; other values are
    skipped)."""
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif isinstance(t, torch.Tensor):
            value ^= hash_tensor(t)
    return value


def count_bytes(*tensors: Any) -> int:
    """Bytes held by the tensors (nested tuples and lists too; ``None`` counts 0)."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total
