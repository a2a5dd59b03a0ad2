"""GPU tests of DeepEP 2.1's ``ElasticBuffer`` as its callers use it (issue 38, "the callers' call
sequences"): SGLang, vLLM and Megatron-LM, each with the arguments, the order of calls and the
handle fields its own source uses, through the ``deep_ep`` shim, checked bit for bit against
references that never use our kernels (v2_callers_workers.py names the caller files and commits):

- SGLang: prefill plain with CPU sync (FP8, TMA-aligned column-major scales, an idle rank padded
  with one dummy token); decode expanded without CPU sync, captured in a CUDA graph and replayed
  with new tokens and routing;
- vLLM: decode plain without CPU sync with a per-call power-of-2 ``num_max_tokens_per_rank``,
  ``recv_topk_idx`` rewritten in place and an async combine; prefill expanded with CPU sync;
- Megatron-LM: plain with CPU sync inside autograd (the combine is the dispatch's backward, a
  cached dispatch the combine's backward), synchronous and with ``async_finish``;
- the V1 ``Buffer`` and an ``ElasticBuffer`` side by side in one process on one group.

At DEEPEP_TEST_RANKS ranks (default 2) on DEEPEP_TEST_GPUS GPUs (harness.py; 4 and 8 ranks on one
GPU run oversubscribed through a gloo group). Run by python/scripts/gpu-run.sh, e.g. only these:
``DEEPEP_TEST_GPUS=1 MPS=1 PYTEST_ARGS="-k v2_callers" python/scripts/gpu-run.sh WHEEL 2 4``.
The ``test_helpers_*`` tests check the CPU helpers the references are built from (no GPU used).
"""

import pytest
import torch

import harness
import v2_callers_workers as w


# ---------------------------------------------------------------------------------------------
# The callers' sequences (one process per rank)
# ---------------------------------------------------------------------------------------------

def test_v2_callers_sglang_prefill_with_cpu_sync_and_decode_captured_in_a_cuda_graph():
    harness.run(w.sglang)


def test_v2_callers_vllm_decode_with_pow2_cap_without_sync_and_expanded_prefill():
    harness.run(w.vllm)


def test_v2_callers_megatron_dispatch_and_combine_under_autograd():
    harness.run(w.megatron)


def test_v2_callers_v1_buffer_and_elastic_buffer_side_by_side():
    harness.run(w.v1_and_v2_side_by_side)


# ---------------------------------------------------------------------------------------------
# The CPU helpers of the references (no GPU, no process group)
# ---------------------------------------------------------------------------------------------

def test_helpers_pow2_bucket_is_vllms_next_power_of_two():
    assert [w.pow2_bucket(n) for n in (0, 1, 2, 3, 5, 13, 16, 17, 8192)] == [1, 1, 2, 4, 8, 16, 16, 32, 8192]


def test_helpers_worst_case_rows_follow_deepeps_allocation_without_cpu_sync():
    assert w.worst_case_rows(2, 128, False) == 256
    # 2 * 128 * min(8, 16) + 127 * 16 = 4080, aligned to 128
    assert w.worst_case_rows(2, 128, True, alignment=128) == 4096
    assert w.worst_case_rows(4, 16, True, num_topk=8, local_experts=4, alignment=1) == 4 * 16 * 4


def test_helpers_expert_psums_starts_and_row_experts():
    counts = torch.tensor([2, 0, 3])
    assert w.expected_expert_psum(counts, 4, expanded=False).tolist() == [4, 4, 8]
    psum = w.expected_expert_psum(counts, 4, expanded=True)
    assert psum.tolist() == [2, 4, 7]
    assert w.expanded_starts(psum, 4).tolist() == [0, 4, 4]
    expert, real = w.expanded_row_experts(12, psum, 4, torch.device("cpu"))
    assert expert.tolist() == [0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2]
    assert real.tolist() == [True, True, False, False, True, True, True] + [False] * 5


def test_helpers_reference_receive_orders_rows_by_source_global_index():
    # 2 ranks, 2 local experts each (experts 0-1 on rank 0, 2-3 on rank 1), top-2
    def inp(x_rows, idx, wts):
        return dict(x=torch.tensor(x_rows, dtype=torch.bfloat16), idx=torch.tensor(idx, dtype=torch.int64),
                    w=torch.tensor(wts, dtype=torch.float32), sf=None)

    inputs = [inp([[1.0], [2.0], [3.0]], [[2, 0], [0, 1], [-1, 3]], [[0.5, 0.25], [0.75, 0.125], [0.0, 1.0]]),
              inp([[4.0], [5.0]], [[3, 2], [1, -1]], [[0.5, 0.5], [1.0, 0.0]])]
    ref = w.reference_receive(inputs, rank=1, world=2, num_max_tokens_per_rank=8, local_experts=2)
    # rank 1 gets rank 0's tokens 0 and 2 and rank 1's token 0, by global index s * 8 + t
    assert ref["gidx"].tolist() == [0, 2, 8]
    assert ref["src"] == [(0, 0), (0, 2), (1, 0)]
    assert ref["x"].flatten().tolist() == [1.0, 3.0, 4.0]
    assert ref["idx"].tolist() == [[0, -1], [-1, 1], [1, 0]]
    assert ref["w"].tolist() == [[0.5, 0.0], [0.0, 1.0], [0.5, 0.5]]
    assert ref["per_source"] == [2, 1]
    assert ref["per_expert"].tolist() == [2, 2]
    empty = w.reference_receive([inputs[1], inputs[1]], rank=0, world=2, num_max_tokens_per_rank=8, local_experts=1)
    assert empty["gidx"].numel() == 0 and tuple(empty["x"].shape) == (0, 1) and empty["per_source"] == [0, 0]


def test_helpers_rank_rows_reference_sums_one_row_per_destination_rank():
    from deepep_kernels.utils.refs import combine as ref_combine

    local = w.LOCAL_EXPERTS
    idx = torch.tensor([[0, 1, local, -1, -1, -1, -1, -1],  # ranks 0 (twice) and 1
                        [local + 1, -1, -1, -1, -1, -1, -1, -1],  # rank 1 only
                        [-1] * 8], dtype=torch.int64)  # nowhere
    rows = [torch.full((3, 4), 1.0, dtype=torch.bfloat16), torch.full((3, 4), 2.0, dtype=torch.bfloat16)]
    out = w.rank_rows_reference(rows, idx, 2, 2 * local, ref_combine)
    assert out[:, 0].tolist() == [3.0, 2.0, 0.0]


def test_helpers_same_compares_bits_and_names_the_first_difference():
    w.same("equal", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError, match="row 1 differs"):
        w.same("sign of zero", torch.tensor([[1.0], [0.0]]), torch.tensor([[1.0], [-0.0]]))
    with pytest.raises(AssertionError, match="shape"):
        w.same("shape", torch.zeros(2), torch.zeros(3))
    with pytest.raises(AssertionError, match="dtype"):
        w.same("dtype", torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_helpers_tma_column_major_scales_keep_values_with_aligned_strides():
    scales = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    view = w.tma_col_major(scales)
    assert view.stride() == (1, 8) and torch.equal(view, scales)


def test_helpers_fp8_cast_round_trips_within_its_precision():
    x = torch.randn(3, 2 * w.FP8_BLOCK, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    values, scales = w.quantize_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and tuple(scales.shape) == (3, 2)
    back = w.dequantize(values, scales)
    assert (back.float() - x.float()).abs().max() <= 0.07 * x.float().abs().max()
    assert w.as_bytes(values).dtype == torch.uint8 and w.as_bytes(x) is x
