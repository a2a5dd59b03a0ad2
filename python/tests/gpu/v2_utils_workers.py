"""Rank body of test_v2_utils_bitwise.py: our ``deepep_kernels.utils.{math,gate,refs}`` against DeepEP
2.1's own ``deep_ep/utils/{math,gate,refs}.py`` on the same inputs, bit for bit.

DeepEP's three files are loaded as the package ``deepep_upstream_utils`` (built by the test in a
temporary folder: copies of those files and an ``envs.py`` that re-exports ours, which is all their
relative imports need). As in DeepEP 2.1's tests (its init_dist), torch's default dtype is
bfloat16 and its default device CUDA while they run.
"""

import contextlib
import importlib
import importlib.util
import os
import sys

import torch
import torch.distributed as dist


def bits(t):
    """A tensor's bytes, so that equal means bit for bit (NaNs, -0.0 and float8 included)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b, what):
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{what}: {type(a)} vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{i}]")
        return
    if a is None or not isinstance(a, torch.Tensor):
        assert a == b, f"{what}: {a!r} vs {b!r}"
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, \
        f"{what}: {a.dtype} {tuple(a.shape)} {a.device} vs {b.dtype} {tuple(b.shape)} {b.device}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ"


def compare(rank, world, group, upstream_root):
    sys.path.insert(0, upstream_root)
    up_math = importlib.import_module("deepep_upstream_utils.math")
    up_gate = importlib.import_module("deepep_upstream_utils.gate")
    up_refs = importlib.import_module("deepep_upstream_utils.refs")
    from deepep_kernels.utils import envs, gate, math, refs

    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    try:
        envs.init_seed(7)  # generate_pre_combine_data reads the global seed (ours, on both sides)
        check_gate(up_gate, gate)
        check_math(up_math, math)
        check_combine(up_refs, refs, world)
        check_dispatch(up_refs, refs, rank, world)
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(old_dtype)


def check_gate(up, ours):
    cases = [(4096, 256, 8, 6, 1.0, False), (4096, 256, 8, 6, 2.0, False), (1000, 64, 4, 8, 1.0, True),
             (4096, 256, 8, 6, 2.0, True), (7, 48, 6, 6, 1.5, True), (1, 16, 2, 2, 1.0, True)]
    for i, case in enumerate(cases):
        torch.manual_seed(100 + i)
        a = up.get_unbalanced_scores(*case)
        torch.manual_seed(100 + i)
        b = ours.get_unbalanced_scores(*case)
        same(a, b, f"get_unbalanced_scores{case}")
    # both sides draw the same amount of random numbers (the generator states after the calls agree)
    torch.manual_seed(1)
    up.get_unbalanced_scores(512, 64, 4, 4, 2.0, True)
    state_up = torch.cuda.get_rng_state()
    torch.manual_seed(1)
    ours.get_unbalanced_scores(512, 64, 4, 4, 2.0, True)
    assert torch.equal(state_up, torch.cuda.get_rng_state()), "gate drew a different amount of random numbers"


def check_math(up, ours):
    g = torch.Generator(device="cuda").manual_seed(3)
    for hidden in (7168, 1000, 128, 1):
        x = torch.randn((129, hidden), dtype=torch.bfloat16, device="cuda", generator=g) * 3
        x[0] = 0  # an all-zero row: the 1e-4 clamp
        a, b = up.per_token_cast_to_fp8(x), ours.per_token_cast_to_fp8(x)
        same(a, b, f"per_token_cast_to_fp8 hidden={hidden}")
        same(up.per_token_cast_back(*a), ours.per_token_cast_back(*b), f"per_token_cast_back hidden={hidden}")
        # UE8M0 scales: four exponent bytes in an int32
        blocks = (hidden + 127) // 128
        ue8m0 = torch.randint(110, 140, (129, (blocks + 3) // 4 * 4), dtype=torch.uint8, device="cuda", generator=g)
        packed = ue8m0.view(torch.int32)
        if blocks % 4 == 0:
            same(up.per_token_cast_back(a[0], packed), ours.per_token_cast_back(a[0], packed), f"per_token_cast_back ue8m0 hidden={hidden}")
    empty = torch.empty((0, 256), dtype=torch.float8_e4m3fn, device="cuda")
    same(up.per_token_cast_back(empty, torch.empty((0, 2), device="cuda", dtype=torch.float32)),
         ours.per_token_cast_back(empty, torch.empty((0, 2), device="cuda", dtype=torch.float32)), "per_token_cast_back empty")
    for slots in (8, 3):
        idx = torch.randint(-1, slots, (200, 6), device="cuda", generator=g)
        a, b = idx.clone(), idx.clone()
        up.inplace_unique(a, slots)
        ours.inplace_unique(b, slots)
        same(a, b, f"inplace_unique slots={slots}")
    x = torch.randn((64, 100), dtype=torch.float32, device="cuda", generator=g)
    y = x + torch.randn((64, 100), dtype=torch.float32, device="cuda", generator=g) * 1e-3
    assert up.calc_diff(x, y) == ours.calc_diff(x, y)
    scores = torch.rand((64, 32), dtype=torch.float32, device="cuda", generator=g)
    group_idx = torch.randint(0, 8, (64, 2), device="cuda", generator=g)
    same(up.create_grouped_scores(scores, group_idx, 8), ours.create_grouped_scores(scores, group_idx, 8), "create_grouped_scores")
    assert up.hash_tensors(x, (y, [scores]), None) == ours.hash_tensors(x, (y, [scores]), None)
    assert up.count_bytes(x, (y, None)) == ours.count_bytes(x, (y, None))
    for a_, b_ in ((7, 3), (8, 4), (0, 5), (1, 128)):
        assert up.align(a_, b_) == ours.align(a_, b_) and up.ceil_div(a_, b_) == ours.ceil_div(a_, b_)
    assert up.safe_div(0, 0) == ours.safe_div(0, 0) == 0


def check_combine(up, ours, world):
    g = torch.Generator(device="cuda").manual_seed(11)
    tokens, hidden, topk = 300, 512, 8
    for scaleout, scaleup, experts in ((1, 8, 64), (2, 4, 64), (1, 6, 48), (1, 2, 256)):
        topk_idx = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:topk] for _ in range(tokens)])
        topk_idx[torch.rand((tokens, topk), device="cuda", generator=g) < 0.2] = -1
        y = (torch.randn((tokens, topk, hidden), device="cuda", generator=g) * 4).to(torch.bfloat16)
        y[topk_idx == -1] = 0
        bias1 = torch.randn((tokens, hidden), device="cuda", generator=g).to(torch.bfloat16)
        bias2 = (torch.randn((tokens, hidden), device="cuda", generator=g) * 10).to(torch.bfloat16)
        for bias in (None, bias1, (bias1, bias2)):
            for recipe in ((False, False), (True, False), (True, True)):
                a = up.combine(y, topk_idx, scaleout, scaleup, experts, bias, *recipe)
                b = ours.combine(y, topk_idx, scaleout, scaleup, experts, bias, *recipe)
                same(a, b, f"combine {scaleout}x{scaleup} experts={experts} bias={type(bias).__name__} recipe={recipe}")
        same(up.ordered_accumulate(y), ours.ordered_accumulate(y), "ordered_accumulate")
        same(up.ordered_accumulate(y, bias1.float()), ours.ordered_accumulate(y, bias1.float()), "ordered_accumulate with a start")
    src = torch.randint(0, world * 1024, (257,), device="cuda", generator=g).to(torch.int32)
    for topk_, hidden_ in ((6, 7168), (8, 100)):
        same(up.generate_pre_combine_data(src, 1024, topk_, hidden_), ours.generate_pre_combine_data(src, 1024, topk_, hidden_),
             f"generate_pre_combine_data topk={topk_} hidden={hidden_}")


def _staging():
    """The conformance adapter's staging module (python/scripts/conformance/), by path."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "conformance",
                        "deepep_conformance_staging.py")
    spec = importlib.util.spec_from_file_location("deepep_conformance_staging", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def all_to_all_through_cpu():
    """``dist.all_to_all_single`` as the conformance run makes it (its adapter's staging): every
    tensor travels through the CPU as rows of bytes, since gloo refuses bfloat16 and float8
    ("Invalid scalar type") and CUDA tensors, and both ``refs.dispatch`` exchange bf16 / fp8 rows
    (their outputs on the default device, CUDA here). Both sides get the same exchange."""
    staging = _staging()
    orig = dist.all_to_all_single

    def exchange(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        assert not async_op, "refs.dispatch exchanges synchronously"
        staging.all_to_all_single_through_cpu(orig, output, input, output_split_sizes, input_split_sizes, group=group)

    dist.all_to_all_single = exchange
    try:
        yield
    finally:
        dist.all_to_all_single = orig


def check_dispatch(up, ours, rank, world):
    # inputs on the CPU; the exchanges go through the CPU as bytes (all_to_all_through_cpu)
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    experts, topk, hidden, max_tokens = 8 * world, 4, 256, 64
    tokens = max_tokens - 3 * rank
    topk_idx = torch.stack([torch.randperm(experts, generator=g, device="cpu")[:topk] for _ in range(tokens)])
    topk_idx[torch.rand((tokens, topk), generator=g, device="cpu") < 0.25] = -1
    weights = torch.rand((tokens, topk), generator=g, device="cpu", dtype=torch.float32)
    x = torch.randn((tokens, hidden), generator=g, device="cpu", dtype=torch.float32).to(torch.bfloat16)
    fp8 = (x.float().clamp(-400, 400).to(torch.float8_e4m3fn),
           torch.rand((tokens, hidden // 128), generator=g, device="cpu", dtype=torch.float32))
    with all_to_all_through_cpu():
        for name, data in (("bf16", x), ("fp8", fp8)):
            a = up.dispatch(data, topk_idx, weights, max_tokens, experts)
            b = ours.dispatch(data, topk_idx, weights, max_tokens, experts)
            same(a, b, f"dispatch {name} rank {rank}")
    dist.barrier()
