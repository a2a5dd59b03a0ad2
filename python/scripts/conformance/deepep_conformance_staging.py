"""How the conformance adapter (sitecustomize.py beside this file) stages
``torch.distributed.all_to_all_single`` of CUDA tensors through the CPU over gloo.

Every tensor travels as rows of bytes: ``[rows, ...]`` becomes uint8 ``[rows, row bytes]`` (gloo
exchanges uint8 for any dtype, float8 included; torch 2.11's gloo rejects float8), split by rows
exactly as the caller split its tensor, then is viewed back as the output's dtype and shape. The
split arithmetic is pure Python (``exchange_plan``), so it is tested without torch or a GPU
(python/tests/test_v2_utils_runner.py); ``all_to_all_single_through_cpu`` imports torch when called.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def row_splits(num_rows: int, split_sizes: Optional[Sequence[int]], world_size: int, which: str) -> List[int]:
    """The rows per rank of one side of an exchange: ``split_sizes`` checked against ``num_rows``
    (one entry per rank, non-negative, summing to the tensor's rows), or without them an even split
    (``num_rows`` a multiple of the world size), as ``all_to_all_single`` defines it."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if split_sizes is None or len(split_sizes) == 0:
        if num_rows % world_size != 0:
            raise ValueError(f"all_to_all_single without {which}_split_sizes splits the {which} evenly, "
                             f"but its {num_rows} rows are not a multiple of the world size {world_size}; pass {which}_split_sizes")
        return [num_rows // world_size] * world_size
    splits = [int(s) for s in split_sizes]
    if len(splits) != world_size:
        raise ValueError(f"{which}_split_sizes has {len(splits)} entries, one per rank is needed (world size {world_size})")
    if any(s < 0 for s in splits):
        raise ValueError(f"{which}_split_sizes {splits} has a negative entry")
    if sum(splits) != num_rows:
        raise ValueError(f"{which}_split_sizes {splits} add up to {sum(splits)} rows, but the {which} tensor has {num_rows}")
    return splits


def row_bytes(shape: Sequence[int], itemsize: int) -> Tuple[int, int]:
    """``(rows, bytes per row)`` of a tensor of ``shape`` (dim 0 is the rows; a 0-d tensor is one
    row) and element size ``itemsize``."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return 1, itemsize
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    return shape[0], per_row * itemsize


def exchange_plan(out_shape: Sequence[int], out_itemsize: int, in_shape: Sequence[int], in_itemsize: int,
                  output_split_sizes: Optional[Sequence[int]], input_split_sizes: Optional[Sequence[int]],
                  world_size: int) -> Tuple[List[int], List[int], int]:
    """``(output row splits, input row splits, bytes per row)`` of one ``all_to_all_single``: both
    tensors must have rows of the same size (the exchange moves whole rows)."""
    out_rows, out_row_bytes = row_bytes(out_shape, out_itemsize)
    in_rows, in_row_bytes = row_bytes(in_shape, in_itemsize)
    if out_row_bytes != in_row_bytes:
        raise ValueError(f"all_to_all_single moves whole rows, but an output row has {out_row_bytes} bytes "
                         f"(shape {tuple(out_shape)}) and an input row {in_row_bytes} (shape {tuple(in_shape)})")
    return (row_splits(out_rows, output_split_sizes, world_size, "output"),
            row_splits(in_rows, input_split_sizes, world_size, "input"), in_row_bytes)


def all_to_all_single_through_cpu(exchange, output, input, output_split_sizes=None, input_split_sizes=None,
                                  group=None, world_size: Optional[int] = None) -> None:
    """``all_to_all_single(output, input, ...)`` with the tensors on any device: host byte copies
    go through ``exchange`` (gloo's ``all_to_all_single``, uint8 CPU tensors with row splits), the
    result is written into ``output``. Every staging tensor names its device and dtype, so torch's
    default device and dtype (DeepEP 2.1's init_dist sets CUDA and bfloat16) change nothing."""
    import torch
    import torch.distributed as dist

    world = world_size if world_size is not None else dist.get_world_size(group)
    out_splits, in_splits, width = exchange_plan(output.shape, output.element_size(), input.shape, input.element_size(),
                                                 output_split_sizes, input_split_sizes, world)
    out_rows, in_rows = sum(out_splits), sum(in_splits)
    elems_per_row = width // input.element_size()
    send = input.detach().to(device="cpu").contiguous().reshape(in_rows, elems_per_row).view(torch.uint8)
    recv = torch.empty((out_rows, width), dtype=torch.uint8, device="cpu")
    exchange(recv, send, out_splits, in_splits, group=group)
    received = recv.view(output.dtype).reshape(output.shape)
    with torch.no_grad():
        output.copy_(received)
