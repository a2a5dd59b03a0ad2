"""CPU tests of DeepEP V2's API (deepep_kernels.elastic): the signatures and defaults DeepEP 2.1
callers use, the size hint, and the refusals that need no GPU. The calls themselves run on the GPU
(python/tests/gpu/test_v2_callers.py; DeepEP 2.1's own tests/elastic/test_ep.py through
python/scripts/deepep-conformance.sh)."""

import inspect

import pytest

from deepep_kernels import _native
from deepep_kernels.elastic import ElasticBuffer, EPHandle

# DeepEP 2.1 (deepseek-ai/DeepEP dd758ca, deep_ep/buffers/elastic.py): parameter names and defaults
# of the methods callers use (SGLang's DeepEPv2Buffer, vLLM's DeepEPV2All2AllManager, Megatron's
# fused_a2a V2 path pass them by keyword).
DEEPEP_21 = {
    "__init__": [("group", inspect.Parameter.empty), ("num_bytes", None), ("num_cpu_bytes", 0), ("num_max_tokens_per_rank", 0),
                 ("hidden", 0), ("num_topk", 0), ("use_fp8_dispatch", False), ("deterministic", False), ("allow_hybrid_mode", True),
                 ("allow_multiple_reduction", True), ("prefer_overlap_with_compute", True), ("sl_idx", 3), ("num_allocated_qps", 0),
                 ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100), ("explicitly_destroy", False)],
    "dispatch": [("x", inspect.Parameter.empty), ("topk_idx", None), ("topk_weights", None), ("cumulative_local_expert_recv_stats", None),
                 ("num_experts", None), ("num_max_tokens_per_rank", None), ("expert_alignment", None), ("num_sms", 0), ("num_qps", 0),
                 ("previous_event", None), ("previous_event_before_epilogue", None), ("async_with_compute_stream", False),
                 ("allocate_on_comm_stream", False), ("handle", None), ("do_handle_copy", True), ("do_cpu_sync", None),
                 ("do_expand", False), ("do_zero_padding", False), ("use_tma_aligned_col_major_sf", False)],
    "combine": [("x", inspect.Parameter.empty), ("handle", inspect.Parameter.empty), ("topk_weights", None), ("bias", None),
                ("num_sms", 0), ("num_qps", 0), ("previous_event", None), ("previous_event_before_epilogue", None),
                ("async_with_compute_stream", False), ("allocate_on_comm_stream", False)],
    "barrier": [("use_comm_stream", True), ("with_cpu_sync", False), ("sequential", True)],
    "get_buffer_size_hint": [("group", inspect.Parameter.empty), ("num_max_tokens_per_rank", inspect.Parameter.empty),
                             ("hidden", inspect.Parameter.empty), ("num_topk", 0), ("use_fp8_dispatch", False),
                             ("allow_hybrid_mode", True), ("allow_multiple_reduction", True)],
}


@pytest.mark.parametrize("name", sorted(DEEPEP_21))
def test_methods_have_deepep_21_names_and_defaults(name):
    params = [(p.name, p.default) for p in inspect.signature(getattr(ElasticBuffer, name)).parameters.values() if p.name != "self"]
    assert params == DEEPEP_21[name]


def test_the_handle_takes_deepep_21_fields_in_order():
    names = [p for p in inspect.signature(EPHandle.__init__).parameters if p != "self"]
    assert names == ["do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms", "topk_idx", "num_recv_tokens",
                     "num_expanded_tokens", "num_recv_tokens_per_expert_list", "psum_num_recv_tokens_per_scaleup_rank",
                     "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert", "recv_src_metadata",
                     "dst_buffer_slot_idx", "token_metadata_at_forward", "channel_linked_list"]
    with pytest.raises(ValueError, match="topk_idx"):
        EPHandle(False, 8, 1, 16, 2, None, 0, 0, [], None, None, None, None, None, None, None)


def test_statics_are_static():
    for name in ("get_buffer_size_hint", "capture", "get_engram_storage_size_hint", "get_pp_buffer_size_hint"):
        assert isinstance(inspect.getattr_static(ElasticBuffer, name), staticmethod), name


def test_every_public_method_is_documented():
    for name, fn in inspect.getmembers(ElasticBuffer, inspect.isfunction):
        if not name.startswith("_") and not name.startswith(("engram_", "pp_", "agrs_", "get_engram", "get_pp", "get_agrs")) \
                and name not in ("create_agrs_session", "destroy_agrs_session", "all_gather"):
            assert fn.__doc__ and fn.__doc__.strip(), name


def test_size_hint_is_2mib_aligned_grows_and_names_what_is_out_of_range():
    small = _native.elastic_buffer_size_hint(2, 128, 1024, 4, False)
    assert small % (2 << 20) == 0
    assert _native.elastic_buffer_size_hint(2, 4096, 1024, 4, False) > small
    assert _native.elastic_buffer_size_hint(8, 4096, 7168, 6, True) >= 8 * 4096 * (7168 * 2 + 80)
    # num_topk=0 sizes for max(ranks, 8) rows per token, so later top-k up to 8 fits
    assert _native.elastic_buffer_size_hint(2, 512, 1024, 0, False) == _native.elastic_buffer_size_hint(2, 512, 1024, 8, False)
    with pytest.raises(NotImplementedError, match="1 to 8 ranks"):
        _native.elastic_buffer_size_hint(9, 128, 1024, 4, False)
    with pytest.raises(ValueError, match="num_topk=33"):
        _native.elastic_buffer_size_hint(2, 128, 1024, 33, False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_cpu_bytes=2 << 20), "CPU buffer"),
    (dict(num_allocated_qps=17), "RDMA queue pairs"),
    (dict(sl_idx=16), "service level"),
])
def test_what_one_node_cannot_offer_is_refused_before_any_gpu_work(kwargs, match):
    # `group` is never touched: the refusal comes first (no torch, no process group needed)
    with pytest.raises((NotImplementedError, ValueError), match=match):
        ElasticBuffer(object(), **kwargs)


@pytest.mark.parametrize("call, feature", [
    (lambda: ElasticBuffer.get_engram_storage_size_hint(1024, 128), "Engram"),
    (lambda: ElasticBuffer.get_pp_buffer_size_hint(1 << 20, 2), "pipeline-parallel"),
    (lambda: ElasticBuffer.get_agrs_buffer_size_hint(None, 1 << 20), "AGRS"),
    (lambda: ElasticBuffer.engram_write(None, None), "Engram"),
    (lambda: ElasticBuffer.pp_send(None, None, 1), "pipeline-parallel"),
    (lambda: ElasticBuffer.all_gather(None, None), "AGRS"),
])
def test_engram_pp_and_agrs_are_refused_naming_the_feature_and_the_alternative(call, feature):
    with pytest.raises(NotImplementedError, match=feature) as e:
        call()
    assert "use " in str(e.value)


def test_one_node_domain_sizes_and_no_qps():
    b = ElasticBuffer.__new__(ElasticBuffer)
    b.num_ranks = 6
    assert b.get_physical_domain_size() == (1, 6)
    assert b.get_logical_domain_size() == (1, 6)
    assert b.get_theoretical_num_qps(24) == 0

