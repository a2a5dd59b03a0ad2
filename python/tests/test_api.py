"""CPU tests of the deepep_kernels wheel: API shape against DeepEP v1.2.1, argument checks,
configs and size hints, and the opt-in deep_ep shim. They need no GPU and no torch."""

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

import deepep_kernels
from deepep_kernels import Buffer, Config, EventOverlap, _native
from deepep_kernels.utils import EventHandle


def params(f):
    return [(p.name, p.default) for p in inspect.signature(f).parameters.values() if p.name != "self"]


E = inspect.Parameter.empty

# The parameter lists of deep_ep v1.2.1 (deep_ep/buffer.py at tag v1.2.1), names and defaults.
DEEPEP_V121 = {
    "__init__": [("group", E), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False), ("num_qps_per_rank", 24),
                 ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False), ("explicitly_destroy", False), ("comm", None)],
    "get_dispatch_layout": [("topk_idx", E), ("num_experts", E), ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "dispatch": [("x", E), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                 ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0),
                 ("config", None), ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": [("x", E), ("handle", E), ("topk_weights", None), ("bias", None), ("config", None), ("previous_event", None),
                ("async_finish", False), ("allocate_on_comm_stream", False)],
    "low_latency_dispatch": [("x", E), ("topk_idx", E), ("num_max_dispatch_tokens_per_rank", E), ("num_experts", E),
                             ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
                             ("round_scale", False), ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("x", E), ("topk_idx", E), ("topk_weights", E), ("handle", E), ("use_logfmt", False), ("zero_copy", False),
                            ("async_finish", False), ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", E), ("hidden", E), ("num_experts", E)],
    "get_next_low_latency_combine_buffer": [("handle", E)],
    "get_local_buffer_tensor": [("dtype", E), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_comm_stream": [],
    "destroy": [],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", E), ("hidden", E), ("num_ranks", E), ("num_experts", E)],
    "get_dispatch_config": [("num_ranks", E)],
    "get_combine_config": [("num_ranks", E)],
    "set_num_sms": [("new_num_sms", E)],
    "is_sm90_compiled": [],
    "capture": [],
}


@pytest.mark.parametrize("name", sorted(DEEPEP_V121))
def test_buffer_methods_have_deepep_names_and_defaults(name):
    assert params(getattr(Buffer, name)) == DEEPEP_V121[name]


def test_static_methods_are_static():
    for name in ["is_sm90_compiled", "set_num_sms", "capture", "get_low_latency_rdma_size_hint", "get_dispatch_config", "get_combine_config"]:
        assert isinstance(inspect.getattr_static(Buffer, name), staticmethod), name


def test_package_exports_and_version():
    assert deepep_kernels.__version__ == _native.__version__ == "0.1.0"
    for name in ["Buffer", "Config", "EventOverlap", "EventHandle"]:
        assert hasattr(deepep_kernels, name)
    assert Buffer.num_sms == 20


def test_cubins_are_sm90_and_linked_against_nvshmem_345():
    assert Buffer.is_sm90_compiled() is True
    # the NVSHMEM device library the wheel's cubins were linked with (pinned toolchain)
    assert _native.nvshmem_device_version() == (3, 4, 5)


def test_config_keeps_deepep_fields_and_checks_them():
    c = Config(24, 6, 256, 6, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (24, 6, 256, 6, 128)
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens"):
        Config(24, 256, 256, 6, 128)
    with pytest.raises(ValueError, match="recv_tokens / 2"):
        Config(24, 6, 256, 100, 128)
    with pytest.raises(ValueError, match="num_sms=-2"):
        Config(-2, 6, 256, 6, 128)
    with pytest.raises(TypeError, match="Config: num_sms must be an int, got float 24.0"):
        Config(24.0, 6, 256, 6, 128)
    with pytest.raises(TypeError, match="num_max_rdma_chunked_recv_tokens must be an int, got bool"):
        Config(24, 6, 256, 6, True)
    # DeepEP accepts 0 SMs and fails at the first launch; refused here at once.
    with pytest.raises(ValueError, match=r"Config: num_sms=0 must be >= 1"):
        Config(0)


def test_size_hints_name_the_bad_argument_and_refuse_absurd_sizes(monkeypatch):
    monkeypatch.delenv("DEEPEP_KERNELS_MAX_TOKENS", raising=False)
    monkeypatch.delenv("DEEPEP_KERNELS_RANKS_PER_HOST", raising=False)
    c = Config(24)
    for hint in (c.get_nvl_buffer_size_hint, c.get_rdma_buffer_size_hint):
        name = hint.__name__
        with pytest.raises(ValueError, match=rf"^{name}: num_ranks=0 must be >= 1$"):
            hint(7168 * 2, 0)
        with pytest.raises(ValueError, match=rf"^{name}: hidden_bytes=-2 must be >= 1$"):
            hint(-2, 16)
        with pytest.raises(TypeError, match=rf"^{name}: hidden_bytes must be an int, got float"):
            hint(14336.0, 16)
        # Numbers past 64 bits: a ValueError naming the inputs, not the native OverflowError.
        with pytest.raises(ValueError, match=rf"^{name}: hidden_bytes={2**70}, num_ranks=16 .* more than 2\^64"):
            hint(2**70, 16)
    with pytest.raises(ValueError, match=r"^get_nvl_buffer_size_hint: num_ranks=12 must be below 8 or a multiple of it"):
        c.get_nvl_buffer_size_hint(7168 * 2, 12)
    # what the kernels themselves refuse is passed on, said by the hint
    with pytest.raises(ValueError, match=r"^get_nvl_buffer_size_hint: intranode mode supports 2, 4 or 8 ranks, got 6"):
        c.get_nvl_buffer_size_hint(7168 * 2, 6)
    # 1e9 tokens per rank: about 9 PB, refused naming the token count and what to lower.
    monkeypatch.setenv("DEEPEP_KERNELS_MAX_TOKENS", str(10**9))
    with pytest.raises(ValueError, match=r"^get_nvl_buffer_size_hint: hidden_bytes=14336, num_ranks=8 and 1000000000 tokens per rank needs (more than 1|[0-9.]+) TiB of buffer, more than any GPU holds"):
        c.get_nvl_buffer_size_hint(7168 * 2, 8)
    with pytest.raises(ValueError, match=r"^get_rdma_buffer_size_hint: .*1000000000.* \(the hints take max_tokens_per_rank from DEEPEP_KERNELS_MAX_TOKENS\)$"):
        c.get_rdma_buffer_size_hint(7168 * 2, 16)


@pytest.mark.parametrize("num_ranks", [2, 4, 8, 16, 24, 32, 64, 128, 144, 160])
def test_dispatch_and_combine_configs_follow_deepep(num_ranks):
    d, c = Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)
    assert d.num_sms == c.num_sms == Buffer.num_sms
    # values of deep_ep v1.2.1's tables
    assert (Buffer.get_dispatch_config(8).num_max_nvl_chunked_send_tokens, Buffer.get_combine_config(8).num_max_nvl_chunked_send_tokens) == (6, 4)


def test_unsupported_rank_count_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"Unsupported number of EP ranks: 3 \(supported: \[2, 4, 8"):
        Buffer.get_dispatch_config(3)
    with pytest.raises(ValueError, match="Unsupported number of EP ranks: 6"):
        Buffer.get_combine_config(6)


def test_set_num_sms_changes_later_configs_and_refuses_odd():
    old = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        assert Buffer.num_sms == 24 and Buffer.get_dispatch_config(2).num_sms == 24
        with pytest.raises(ValueError, match="must be even"):
            Buffer.set_num_sms(23)
        assert Buffer.num_sms == 24
    finally:
        Buffer.num_sms = old


def test_nvl_size_hint_is_the_kernels_buffer_for_the_default_token_capacity(monkeypatch):
    monkeypatch.delenv("DEEPEP_KERNELS_MAX_TOKENS", raising=False)
    c = Buffer.get_dispatch_config(8)
    hint = c.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert hint == _native.intranode_buffer_bytes(8, 4096, 7168)
    # exactly 4096 tokens fit in that many bytes, one more does not
    assert _native.intranode_max_tokens(8, 7168, hint) == 4096
    monkeypatch.setenv("DEEPEP_KERNELS_MAX_TOKENS", "8192")
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) > hint
    monkeypatch.setenv("DEEPEP_KERNELS_MAX_TOKENS", "lots")
    with pytest.raises(ValueError, match="DEEPEP_KERNELS_MAX_TOKENS='lots' must be a positive token count"):
        c.get_nvl_buffer_size_hint(7168 * 2, 8)


def test_rdma_size_hint_is_zero_within_a_host_and_the_internode_buffer_beyond(monkeypatch):
    monkeypatch.delenv("DEEPEP_KERNELS_RANKS_PER_HOST", raising=False)
    monkeypatch.delenv("DEEPEP_KERNELS_MAX_TOKENS", raising=False)
    c = Buffer.get_dispatch_config(8)
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    # 16 ranks = 2 hosts of 8 (DeepEP's NUM_MAX_NVL_PEERS): our internode symmetric buffer for 4096
    # tokens of hidden 7168, this config's SMs, top-k 32 and 128 experts per rank
    hint = c.get_rdma_buffer_size_hint(7168 * 2, 16)
    assert hint == _native.internode_buffer_bytes(16, 8, 4096, 7168, c.num_sms, 32, 128)
    assert _native.internode_max_tokens(16, 8, 7168, c.num_sms, 32, 128, hint) == 4096
    # a real model's top-k / experts fit at least as many tokens
    assert _native.internode_max_tokens(16, 8, 7168, c.num_sms, 8, 16, hint) >= 4096
    monkeypatch.setenv("DEEPEP_KERNELS_MAX_TOKENS", "8192")
    assert c.get_rdma_buffer_size_hint(7168 * 2, 16) > hint
    monkeypatch.delenv("DEEPEP_KERNELS_MAX_TOKENS")
    with pytest.raises(ValueError, match="12 ranks do not form hosts of 8 GPUs"):
        c.get_rdma_buffer_size_hint(7168 * 2, 12)
    # emulated hosts of 2 ranks: 4 ranks already span two hosts
    monkeypatch.setenv("DEEPEP_KERNELS_RANKS_PER_HOST", "2")
    assert c.get_rdma_buffer_size_hint(2048 * 2, 4) == _native.internode_buffer_bytes(4, 2, 4096, 2048, c.num_sms, 32, 128)
    assert c.get_rdma_buffer_size_hint(2048 * 2, 2) == 0
    with pytest.raises(ValueError, match="even num_sms"):
        Config(7).get_rdma_buffer_size_hint(2048 * 2, 4)


def test_ranks_per_host_setting_is_validated_naming_the_fix():
    from deepep_kernels.buffer import RANKS_PER_HOST_ENV, ranks_per_host_from_env

    assert RANKS_PER_HOST_ENV == "DEEPEP_KERNELS_RANKS_PER_HOST"
    assert ranks_per_host_from_env(8, {}) is None
    assert ranks_per_host_from_env(8, {RANKS_PER_HOST_ENV: "4"}) == 4
    assert ranks_per_host_from_env(2, {RANKS_PER_HOST_ENV: "1"}) == 1
    for bad in ("3", "0", "-2", "two", "16"):
        with pytest.raises(ValueError, match=rf"DEEPEP_KERNELS_RANKS_PER_HOST='{bad}' must be a number of ranks per host that divides "
                                             r"the world size 8 and is at most 8: use one of \[1, 2, 4, 8\], or unset it"):
            ranks_per_host_from_env(8, {RANKS_PER_HOST_ENV: bad})


def test_host_topology_from_real_hosts_and_the_emulation():
    from deepep_kernels.buffer import RANKS_PER_HOST_ENV
    host_topology = _native.host_topology

    assert host_topology(["a"] * 4, {}) == (1, 4)
    assert host_topology(["a", "a", "b", "b"], {}) == (2, 2)
    # interleaved or unequal hosts: no ranks_per_host (the internode mode refuses them)
    assert host_topology(["a", "b", "a", "b"], {}) == (2, 0)
    assert host_topology(["a", "a", "a", "b"], {}) == (2, 0)
    # the emulation splits one real host into K-rank hosts
    assert host_topology(["a"] * 8, {RANKS_PER_HOST_ENV: "2"}) == (4, 2)
    assert host_topology(["a"] * 2, {RANKS_PER_HOST_ENV: "1"}) == (2, 1)
    with pytest.raises(ValueError, match="divides the world size 4"):
        host_topology(["a"] * 4, {RANKS_PER_HOST_ENV: "3"})


def test_num_tokens_per_rdma_rank_only_in_the_internode_mode():
    # A Buffer made without __init__ (no group/GPU here): these checks come before torch.
    b = Buffer.__new__(Buffer)
    b._internode = False
    with pytest.raises(NotImplementedError, match="num_tokens_per_rdma_rank in a Buffer whose group is within one host"):
        b.dispatch(None, num_tokens_per_rdma_rank=object())
    b._internode = True
    with pytest.raises(NotImplementedError, match="num_worst_tokens in the internode mode"):
        b.dispatch(None, num_tokens_per_rdma_rank=object(), num_worst_tokens=64)


def test_internode_buffer_size_helpers_invert_each_other_and_name_bad_configs():
    for world, rph in ((2, 1), (4, 2), (8, 4), (16, 8)):
        b = _native.internode_buffer_bytes(world, rph, 300, 2048, 24, 8, 8)
        assert _native.internode_max_tokens(world, rph, 2048, 24, 8, 8, b) == 300
        assert _native.internode_max_tokens(world, rph, 2048, 24, 8, 8, b - 1) == 299
    # fewer channels (an oversubscribed rank's share of the SMs) never need more bytes
    assert _native.internode_buffer_bytes(8, 2, 256, 2048, 8, 4, 4) <= _native.internode_buffer_bytes(8, 2, 256, 2048, 24, 4, 4)
    with pytest.raises(ValueError, match="multiple of 128"):
        _native.internode_buffer_bytes(4, 2, 16, 2000, 24, 8, 8)
    with pytest.raises(ValueError, match="even"):
        _native.internode_buffer_bytes(4, 2, 16, 2048, 7, 8, 8)
    assert _native.internode_limits() == (8, 32, 4096)


def test_low_latency_size_hint_grows_with_tokens_and_rejects_bad_shapes():
    a = Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    b = Buffer.get_low_latency_rdma_size_hint(256, 7168, 8, 256)
    assert 0 < a < b
    with pytest.raises(ValueError):
        Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 250)  # experts not divisible by ranks


def test_buffer_constructor_checks_come_before_torch():
    with pytest.raises(ValueError, match="Either 'group' or 'comm' must be provided"):
        Buffer(None)
    with pytest.raises(ValueError, match="num_nvl_bytes=-1"):
        Buffer(None, num_nvl_bytes=-1)
    with pytest.raises(ValueError, match="num_qps_per_rank=0"):
        Buffer(None, low_latency_mode=True, num_qps_per_rank=0)


def test_low_latency_flags_become_deepeps_nvshmem_variables():
    nvshmem_env = _native.nvshmem_env

    # vLLM passes allow_mnnvl=True; DeepEP then leaves MNNVL detection on
    assert nvshmem_env(24, True, True, {}) == {"NVSHMEM_DISABLE_P2P": "0", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "24", "NVSHMEM_DISABLE_MNNVL": "0"}
    assert nvshmem_env(24, True, True, {"NVSHMEM_DISABLE_MNNVL": "1"}) == {"NVSHMEM_DISABLE_P2P": "0", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "24"}
    assert nvshmem_env(9, False, False, {"NVSHMEM_DISABLE_MNNVL": "0"}) == {
        "NVSHMEM_DISABLE_P2P": "1", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "9", "NVSHMEM_DISABLE_MNNVL": "1"}


def test_unsupported_low_latency_options_raise_not_implemented_naming_them():
    # A Buffer made without __init__ (no group/GPU here): these checks run before any state or
    # torch is touched, so the real methods are exercised.
    b = Buffer.__new__(Buffer)
    with pytest.raises(NotImplementedError, match="use_logfmt=True"):
        b.low_latency_combine(None, None, None, None, use_logfmt=True)
    with pytest.raises(NotImplementedError, match="combine_wait_recv_cost_stats"):
        b.low_latency_combine(None, None, None, None, combine_wait_recv_cost_stats=object())
    with pytest.raises(NotImplementedError, match="dispatch_wait_recv_cost_stats"):
        b.low_latency_dispatch(None, None, 128, 256, dispatch_wait_recv_cost_stats=object())


def test_event_overlap_without_event():
    e = EventOverlap()
    with e:
        pass  # no event: exiting does nothing, as in DeepEP
    with pytest.raises(RuntimeError, match="no event"):
        e.current_stream_wait()
    assert EventOverlap(None, (1, 2)).extra_tensors == (1, 2)


@pytest.mark.skipif(_native.cuda_available(), reason="checks the error without an NVIDIA driver")
def test_cuda_calls_without_a_driver_fail_cleanly():
    with pytest.raises(RuntimeError, match="(?i)cuda|driver"):
        _native.Event.recorded_on(0)
    with pytest.raises(RuntimeError, match="(?i)cuda|driver"):
        _native.Runtime(0, 0, 1, 0, 1, lambda b: [b])


def test_intranode_max_tokens_inverts_the_buffer_size():
    for r, h in [(2, 4096), (4, 7168), (8, 2048)]:
        for t in [1, 100, 4096]:
            bytes_ = _native.intranode_buffer_bytes(r, t, h)
            assert _native.intranode_max_tokens(r, h, bytes_) == t
    assert _native.intranode_max_tokens(8, 7168, 100) == 0


# --- the opt-in deep_ep shim -----------------------------------------------------------------

# Where the installed deepep_kernels lives (a venv's site-packages, or a pip --target folder on
# PYTHONPATH on the GPU machine): child interpreters get only that, plus what a test adds.
PKG_SITE = os.path.dirname(os.path.dirname(os.path.abspath(deepep_kernels.__file__)))


def run_py(code, env_extra=None, cwd="/"):
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_SITE
    env.pop("DEEPEP_KERNELS_SHADOW_DEEP_EP", None)
    env_extra = dict(env_extra or {})
    if "PYTHONPATH" in env_extra:
        env_extra["PYTHONPATH"] += os.pathsep + PKG_SITE
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd, capture_output=True, text=True)


def shim_path():
    # cwd outside the source tree so that the installed package answers
    out = subprocess.run([sys.executable, "-m", "deepep_kernels.shim"], capture_output=True, text=True, check=True, cwd="/",
                         env=dict(os.environ, PYTHONPATH=PKG_SITE))
    return out.stdout.strip()


def test_shim_main_help_prints_usage_and_refuses_unknown_arguments():
    run = lambda *a: subprocess.run([sys.executable, "-m", "deepep_kernels.shim", *a], capture_output=True, text=True, cwd="/",
                                    env=dict(os.environ, PYTHONPATH=PKG_SITE))
    for flag in ("--help", "-h"):
        r = run(flag)
        assert r.returncode == 0 and r.stdout.startswith("usage: python -m deepep_kernels.shim [--help]"), r
        assert 'export PYTHONPATH="$(python -m deepep_kernels.shim)' in r.stdout and not r.stderr
    r = run("--path")
    assert r.returncode == 2 and "unknown argument '--path'" in r.stderr and not r.stdout, r
    assert os.path.isdir(os.path.join(shim_path(), "deep_ep"))


def real_deepep_installed():
    return run_py("import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('deep_ep') else 1)", cwd="/").returncode == 0


@pytest.mark.skipif(real_deepep_installed(), reason="a real DeepEP is installed in this environment")
def test_deep_ep_is_not_importable_without_opting_in(tmp_path):
    r = run_py("import deep_ep", cwd=tmp_path)
    assert r.returncode != 0 and "No module named 'deep_ep'" in r.stderr


def test_shim_on_pythonpath_is_deepep_kernels(tmp_path):
    r = run_py("""
        import deep_ep, deepep_kernels
        from deep_ep.utils import EventOverlap, EventHandle
        from deep_ep.buffer import Buffer
        assert deep_ep.Buffer is deepep_kernels.Buffer is Buffer
        assert deep_ep.Config is deepep_kernels.Config
        assert EventOverlap is deepep_kernels.EventOverlap
        print("ok")
    """, {"PYTHONPATH": shim_path()}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def fake_real_deepep(tmp_path):
    # Stands in for a real DeepEP installation (its deep_ep package on sys.path); the shim must
    # refuse to shadow it. Only its presence matters, so it is an empty package.
    site = tmp_path / "site"
    (site / "deep_ep").mkdir(parents=True)
    (site / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    return str(site)


def test_shim_refuses_to_shadow_a_real_deepep(tmp_path):
    site = fake_real_deepep(tmp_path)
    r = run_py("import deep_ep", {"PYTHONPATH": shim_path() + os.pathsep + site}, cwd=tmp_path)
    assert r.returncode != 0
    assert "would shadow a real DeepEP installation" in r.stderr and "DEEPEP_KERNELS_SHADOW_DEEP_EP=1" in r.stderr
    # and the real one stays importable when the shim is not opted in
    r = run_py("import deep_ep; assert deep_ep.REAL", {"PYTHONPATH": site}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_shadowing_on_purpose(tmp_path):
    site = fake_real_deepep(tmp_path)
    r = run_py("import deep_ep, deepep_kernels; assert deep_ep.Buffer is deepep_kernels.Buffer",
               {"PYTHONPATH": shim_path() + os.pathsep + site, "DEEPEP_KERNELS_SHADOW_DEEP_EP": "1"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_install_in_code(tmp_path):
    r = run_py("""
        import deepep_kernels.shim
        deepep_kernels.shim.install()
        import deep_ep, deepep_kernels
        assert deep_ep.Buffer is deepep_kernels.Buffer
    """, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    site = fake_real_deepep(tmp_path)
    r = run_py("import deepep_kernels.shim; deepep_kernels.shim.install()", {"PYTHONPATH": site}, cwd=tmp_path)
    assert r.returncode != 0 and "would shadow a real DeepEP" in r.stderr


def test_nvshmem_host_library_is_the_cubins_release():
    # scripts/test-all.sh exports NVSHMEM_DIR of the pinned pip toolchain (NVSHMEM 3.4.5)
    if not os.environ.get("NVSHMEM_DIR"):
        pytest.skip("NVSHMEM_DIR is not set (the toolchain's NVSHMEM 3.4.5)")
    path, version = _native.nvshmem_host_check()
    assert version == "3.4.5" and path.endswith("libnvshmem_host.so.3"), (path, version)


def _release_of(prefix):
    text = open(os.path.join(prefix, "include", "non_abi", "nvshmem_version.h")).read()
    import re
    return ".".join(re.search(r"#define NVSHMEM_VENDOR_%s_VERSION (\d+)" % k, text).group(1) for k in ("MAJOR", "MINOR", "PATCH"))


def _extra_prefixes():
    return [p for p in os.environ.get("DEEPEP_NVSHMEM_RELEASES", "").split(":") if p]


def test_the_wheel_lists_every_release_it_was_built_for():
    served = _native.nvshmem_releases()
    key = lambda v: tuple(int(x) for x in v.split("."))
    assert served == sorted(served, key=key) and len(set(served)) == len(served), served
    assert "3.4.5" in served, served
    for p in _extra_prefixes():
        assert _release_of(p) in served, (p, served)
    if os.environ.get("CI"):
        # CI builds with the toolchain's second release (scripts/install-toolchain.sh)
        assert len(served) >= 2, served


def test_a_release_loaded_first_is_used_and_picks_its_cubins():
    """What torch does: its NVSHMEM's host library is in the process before ours asks for one. The
    wheel must use that one (not load NVSHMEM_DIR's as a second copy) and choose its cubins; a
    release it has no cubins for is refused naming the releases it serves."""
    others = [p for p in _extra_prefixes() if _release_of(p) != "3.4.5"]
    if not others or not os.environ.get("NVSHMEM_DIR"):
        if os.environ.get("CI"):
            pytest.fail("CI must build with NVSHMEM_DIR and a second release (scripts/install-toolchain.sh)")
        pytest.skip("needs NVSHMEM_DIR and a second release in DEEPEP_NVSHMEM_RELEASES")
    pre = others[0]
    want = _release_of(pre)
    r = run_py(f"""
        import ctypes, os
        ctypes.CDLL({os.path.join(pre, "lib", "libnvshmem_host.so.3")!r}, mode=ctypes.RTLD_GLOBAL)
        import deepep_kernels._native as n
        path, version = n.nvshmem_host_check()
        print(os.path.realpath(path)); print(version); print(n.nvshmem_device_version())
        libs = sorted({{l.split()[5] for l in open("/proc/self/maps") if l.rstrip().endswith("libnvshmem_host.so.3")}})
        print(len(libs))
    """, {"NVSHMEM_DIR": os.environ["NVSHMEM_DIR"]}, cwd="/")
    assert r.returncode == 0, r.stderr
    path, version, dev, nlibs = r.stdout.split("\n")[:4]
    assert path == os.path.realpath(os.path.join(pre, "lib", "libnvshmem_host.so.3")), r.stdout
    assert version == want and dev == str(tuple(int(x) for x in want.split("."))), r.stdout
    assert nlibs == "1", r.stdout


def test_prepare_nvshmem_finds_torchs_pip_nvshmem_and_sets_deepeps_variables(tmp_path):
    # What a low-latency Buffer does before NVSHMEM starts: NVSHMEM_DIR unset, torch's pip wheel
    # (nvidia/nvshmem/lib/libnvshmem_host.so.3) importable. A package laid out like that wheel
    # stands in for it (CI has no torch), its library the toolchain's real one.
    if not os.environ.get("NVSHMEM_DIR"):
        pytest.skip("NVSHMEM_DIR is not set (the toolchain's NVSHMEM 3.4.5)")
    pkg = tmp_path / "site" / "nvidia" / "nvshmem"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    os.symlink(os.path.join(os.environ["NVSHMEM_DIR"], "lib", "libnvshmem_host.so.3"), pkg / "lib" / "libnvshmem_host.so.3")
    r = run_py("""
        import os
        import deepep_kernels._native as n
        path, version = n.prepare_nvshmem(12, False, True)
        print(version, os.environ["NVSHMEM_DIR"], os.environ["NVSHMEM_DISABLE_P2P"], os.environ["NVSHMEM_IBGDA_NUM_RC_PER_PE"],
              os.environ["NVSHMEM_DISABLE_MNNVL"])
    """, {"PYTHONPATH": str(tmp_path / "site"), "NVSHMEM_DIR": "",
          "NVSHMEM_DISABLE_MNNVL": "1"}, cwd="/")
    assert r.returncode == 0, r.stderr
    # allow_mnnvl=True keeps an exported NVSHMEM_DISABLE_MNNVL, as DeepEP leaves NVSHMEM's own
    assert r.stdout.split() == ["3.4.5", str(pkg), "1", "12", "1"], r.stdout


def test_nvshmem_host_library_missing_names_the_fix(tmp_path):
    r = run_py("""
        import deepep_kernels._native as n
        try:
            n.nvshmem_host_check()
        except RuntimeError as e:
            print(e)
    """, {"NVSHMEM_DIR": str(tmp_path), "LD_LIBRARY_PATH": ""}, cwd="/")
    assert r.returncode == 0, r.stderr
    assert "cannot load the NVSHMEM host library" in r.stdout and "set NVSHMEM_DIR" in r.stdout, r.stdout


class ThreadGroup:
    """An all-gather between threads of this process. Stands in for a torch.distributed group
    (no torch here); the code under test is the real extension's exchange path."""

    def __init__(self, world):
        import threading

        self.world = world
        self.slots = [None] * world
        self.round = threading.Barrier(world)
        self.taken = threading.Barrier(world)

    def member(self, rank):
        def all_gather(data):
            assert isinstance(data, bytes)
            self.slots[rank] = data
            self.round.wait(timeout=30)
            out = list(self.slots)
            self.taken.wait(timeout=30)
            return out

        return all_gather


def test_ranks_meet_through_the_callers_all_gather_with_the_gil_released():
    import threading

    world, results, errors = 3, {}, []
    group = ThreadGroup(world)

    def run(r):
        try:
            results[r] = _native._exchange_selftest(r, world, bytes([r]) * (r + 1), group.member(r))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for r in range(world):
        gathered, bcast, ranks = results[r]
        assert gathered == [bytes([s]) * (s + 1) for s in range(world)]
        assert bytes(bcast) == bytes([world - 1]) * world
        assert ranks == list(range(world))


def test_a_failing_all_gather_is_a_runtime_error_naming_it():
    def broken(data):
        raise ConnectionError("peer gone")

    with pytest.raises(RuntimeError, match="the process group's all_gather failed: .*peer gone"):
        _native._exchange_selftest(0, 2, b"x", broken)
    with pytest.raises(RuntimeError, match="must return a list of bytes"):
        _native._exchange_selftest(0, 2, b"x", lambda d: (d, d))
    with pytest.raises(RuntimeError, match="returned 1 contributions"):
        _native._exchange_selftest(0, 2, b"x", lambda d: [d])


def test_no_device_error_is_recorded_without_kernels():
    assert _native.device_error() is None
    assert _native.take_device_error() is None
    assert _native.take_device_error(fatal_only=True) is None
    deepep_kernels.check_device_error()  # does not raise
    assert issubclass(deepep_kernels.DeviceError, RuntimeError)
    # bad input is a ValueError (and a DeviceError); a peer timeout is not
    assert issubclass(deepep_kernels.DeviceArgumentError, deepep_kernels.DeviceError)
    assert issubclass(deepep_kernels.DeviceArgumentError, ValueError)
    assert issubclass(deepep_kernels.PeerTimeoutError, deepep_kernels.DeviceError)
    assert not issubclass(deepep_kernels.PeerTimeoutError, ValueError)


_COMM_METHODS = ["get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
                 "get_next_low_latency_combine_buffer", "clean_low_latency_buffer", "get_local_buffer_tensor"]
_TIMEOUT_MSG = ("rank 0: low_latency_dispatch waited 5.0 s for rank 1 (phase low-latency dispatch/recv, channel 3); rank 1 "
                "probably died, stopped calling, or called with different arguments; this Buffer cannot be used again: call "
                "destroy() and create a new Buffer on the ranks that remain")
_BAD_ID_MSG = ("rank 0: topk_idx[37, 2] = 300 in low_latency_dispatch is not an expert id: ids must be -1 (no expert) or in "
               "[0, 256)")


class _FakeRecord:
    """Stands in for the host-mapped record of one Buffer behind Runtime.check_error and
    Runtime.recorded_cause (a real record needs a GPU kernel: python/tests/gpu/test_errors.py
    covers it), with the same contract: an argument record is raised once and cleared, a timeout
    every time; recorded_cause (the failure path) never returns (or clears) an argument record."""

    def __init__(self, kind, msg):
        self.kind, self.msg = kind, msg

    def _error(self):
        return (deepep_kernels.DeviceArgumentError if self.kind == "argument" else deepep_kernels.PeerTimeoutError)(self.msg)

    def check(self):
        if self.kind is not None:
            e = self._error()
            if self.kind == "argument":
                self.kind = None
            raise e

    def cause(self):
        return None if self.kind in (None, "argument") else self._error()


class _FakeRuntime:
    """A Buffer's native Runtime over a :class:`_FakeRecord`: check_error / recorded_cause look at
    this Buffer's record; every other native call checks the record first (as the real calls do)
    and then fails (no GPU here)."""

    def __init__(self, rec):
        self.rec = rec

    def check_error(self):
        self.rec.check()

    def recorded_cause(self):
        return self.rec.cause()

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.rec.check()
            raise RuntimeError(f"no GPU for Runtime.{name} here")

        return call


def _buffer_with(rec):
    """A Buffer made without __init__ (no group/GPU here) whose own record is ``rec``."""
    buf = object.__new__(Buffer)
    buf._runtime = _FakeRuntime(rec)
    return buf


def test_buffer_calls_raise_the_recorded_timeout_first_and_every_time():
    # Every communication method consults its Buffer's record before anything else, even before
    # argument checks; a timeout stays until the Buffer is destroyed or dropped. (The two
    # low-latency calls check it inside their native call; here that call fails after the check.)
    buf = _buffer_with(_FakeRecord("timeout", _TIMEOUT_MSG))
    for _ in range(2):
        for name in _COMM_METHODS:
            with pytest.raises(deepep_kernels.PeerTimeoutError, match=r"^rank 0: low_latency_dispatch waited 5\.0 s for rank 1 .*destroy\(\)"):
                getattr(buf, name)(*([None] * len(DEEPEP_V121[name])))


def test_a_record_belongs_to_its_buffer():
    # a new Buffer (on the surviving ranks) does not see the timeout its predecessor recorded
    old, new = _buffer_with(_FakeRecord("timeout", _TIMEOUT_MSG)), _buffer_with(_FakeRecord(None, _TIMEOUT_MSG))
    with pytest.raises(deepep_kernels.PeerTimeoutError):
        old.get_dispatch_layout(*([None] * len(DEEPEP_V121["get_dispatch_layout"])))
    with pytest.raises(Exception) as e:
        new.get_dispatch_layout(*([None] * len(DEEPEP_V121["get_dispatch_layout"])))
    assert not isinstance(e.value, deepep_kernels.DeviceError)


def test_a_bad_id_record_is_raised_once_as_a_value_error():
    buf = _buffer_with(_FakeRecord("argument", _BAD_ID_MSG))
    with pytest.raises(deepep_kernels.DeviceArgumentError, match=r"topk_idx\[37, 2\] = 300 in low_latency_dispatch") as e:
        buf.get_dispatch_layout(*([None] * len(DEEPEP_V121["get_dispatch_layout"])))
    assert isinstance(e.value, ValueError)
    # cleared: the next call gets past the record (and fails on its own arguments, not the record)
    with pytest.raises(Exception) as e:
        buf.get_dispatch_layout(*([None] * len(DEEPEP_V121["get_dispatch_layout"])))
    assert not isinstance(e.value, deepep_kernels.DeviceError)


def test_a_call_that_fails_while_a_timeout_is_pending_raises_the_timeout():
    # A host wait inside a call ends when a kernel records a timeout; the call's own error is
    # replaced by the recorded cause (chained), here simulated by a record that appears after the
    # check at the start of the call.
    import deepep_kernels.buffer as b

    rec = _FakeRecord(None, _TIMEOUT_MSG)
    buf = _buffer_with(rec)

    def failing(self):
        rec.kind = "timeout"
        raise RuntimeError("rank 0: host wait ended")

    wrapped = b._checked(failing)
    with pytest.raises(deepep_kernels.PeerTimeoutError, match="waited 5.0 s") as e:
        wrapped(buf)
    assert "host wait ended" in str(e.value.__cause__)
    # without a fatal record the method's own error comes through unchanged
    rec.kind = None
    with pytest.raises(RuntimeError, match="host wait ended"):
        b._checked(lambda self: (_ for _ in ()).throw(RuntimeError("host wait ended")))(buf)


def test_the_native_record_check_raises_nothing_without_kernels():
    # the real functions the fakes above stand in for: no GPU, no record
    assert _native.check_device_error() is None and _native.recorded_cause() is None


def test_dispatch_views_setting_is_checked():
    from deepep_kernels.buffer import DISPATCH_VIEWS_ENV
    _dispatch_views_from_env = _native.dispatch_views_from_env

    assert _dispatch_views_from_env({}) is False
    assert _dispatch_views_from_env({DISPATCH_VIEWS_ENV: "1"}) is True
    assert _dispatch_views_from_env({DISPATCH_VIEWS_ENV: "0"}) is False
    with pytest.raises(ValueError, match=r"DEEPEP_KERNELS_DISPATCH_VIEWS='yes': use 1 .* or 0"):
        _dispatch_views_from_env({DISPATCH_VIEWS_ENV: "yes"})


def test_recv_arena_setting_is_checked():
    from deepep_kernels.buffer import RECV_ARENA_ENV
    _recv_arena_from_env = _native.recv_arena_from_env

    # unset, empty or auto: the binding's default size (None); 0: no arena
    assert _recv_arena_from_env({}) is None and _recv_arena_from_env({RECV_ARENA_ENV: ""}) is None
    assert _recv_arena_from_env({RECV_ARENA_ENV: "0"}) == 0
    assert _recv_arena_from_env({RECV_ARENA_ENV: "auto"}) is None
    assert _recv_arena_from_env({RECV_ARENA_ENV: "268435456"}) == 268435456
    for bad in ("-1", "1GB", "1e9", "AUTO"):
        with pytest.raises(ValueError, match=r"DEEPEP_KERNELS_RECV_ARENA_BYTES='.*': use a byte count >= 0 or auto"):
            _recv_arena_from_env({RECV_ARENA_ENV: bad})


# --- DeepEP handle tuples (deep_ep/buffer.py v1.2.1): element order and index rules ---------------
# The handles are Rust classes (python/src/handles.rs, whose Rust tests cover the index rules and
# messages); a handle itself needs a GPU dispatch (python/tests/gpu/workers.py indexes them).

def test_handles_follow_deepeps_tuple_lengths_and_order():
    els = {k: _native.handle_elements(k) for k in ("intranode", "internode", "low-latency")}
    assert els["intranode"][0] == "rank_prefix_matrix" and len(els["intranode"]) == 6
    # test_internode.py reads handle[-4] as recv_gbl_rank_prefix_sum
    assert els["internode"][-4] == "recv_gbl_rank_prefix_sum" and len(els["internode"]) == 10
    assert els["low-latency"][:2] == ["src_info", "layout_range"] and len(els["low-latency"]) == 5
    with pytest.raises(ValueError, match="unknown handle kind 'normal'"):
        _native.handle_elements("normal")
    # the classes are what buffer.py hands out, and Python cannot make one without a dispatch
    from deepep_kernels import buffer as b

    for name in ("Handle", "InternodeHandle", "LowLatencyHandle"):
        cls = getattr(_native, name)
        assert getattr(b, name) is cls and cls.__module__ == "deepep_kernels._native"
        with pytest.raises(TypeError):
            cls()


CONFORMANCE = os.path.join(os.path.dirname(__file__), "..", "scripts", "deepep-conformance.sh")


def test_conformance_runner_refuses_a_folder_without_deepeps_tests(tmp_path):
    r = subprocess.run(["bash", CONFORMANCE, str(tmp_path), "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "tests/test_intranode.py nor" in r.stderr and "DeepEP checkout" in r.stderr


def test_conformance_runner_help_and_bad_option():
    r = subprocess.run(["bash", CONFORMANCE, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "DEEPEP_SRC NPROC" in r.stdout and "--deepep-site" in r.stdout
    r = subprocess.run(["bash", CONFORMANCE, "--nope", "x", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown option '--nope'" in r.stderr


def test_conformance_runner_launches_one_process_per_emulated_host(tmp_path):
    # --hosts H: DeepEP's init_dist wants one launch per node (WORLD_SIZE = nodes, RANK = node);
    # a stand-in test file (the real ones need GPUs) records what each launch saw
    tests = tmp_path / "src" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_fake.py").write_text(textwrap.dedent("""
        import os, sys
        print("launch", os.environ.get("WORLD_SIZE"), os.environ.get("RANK"), os.environ.get("MASTER_PORT"),
              os.environ.get("DEEPEP_KERNELS_RANKS_PER_HOST"), " ".join(sys.argv[1:]))
        sys.exit(int(os.environ.get("FAKE_FAIL_RANK", "-1") == os.environ.get("RANK")))
    """))
    out = tmp_path / "logs"
    env = dict(os.environ, OUT=str(out))
    ours = os.path.dirname(os.path.dirname(os.path.abspath(deepep_kernels.__file__)))  # the installed package
    cmd = ["bash", CONFORMANCE, "--ours", ours, "--only", "ours", "--no-mps", "--tests", "test_fake.py", "--hosts", "2",
           "--timeout", "60", "--test-args", "--num-tokens 64", str(tmp_path / "src"), "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (out / "ours-test_fake-2x3.log").read_text()
    lines = sorted(l for l in log.splitlines() if "launch" in l)
    assert len(lines) == 2, log
    ports = set()
    for h, line in enumerate(lines):
        assert line.startswith(f"[host {h}] launch "), line
        world, rank, port, per_host, *args = line.split()[3:]
        assert (world, rank, per_host) == ("2", str(h), "3"), line
        assert args == ["--num-processes", "3", "--num-tokens", "64"], line
        ports.add(port)
    assert len(ports) == 1, lines
    assert "PASS" in (out / "summary.txt").read_text()
    # one failing host fails the run
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, FAKE_FAIL_RANK="1"), cwd=tmp_path)
    assert r.returncode == 1 and "FAIL(1)" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["bash", CONFORMANCE, "--hosts", "0", str(tmp_path / "src"), "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "--hosts takes a number of hosts >= 1" in r.stderr


def test_conformance_runner_stops_an_endless_test_at_a_pattern(tmp_path):
    # DeepEP's pressure test loops over seeds forever: --stop-at ends it once a seed is reached,
    # as passed only when nothing failed before
    tests = tmp_path / "src" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_endless.py").write_text(textwrap.dedent("""
        import os, sys, time
        for seed in range(3):
            if seed == 2 and os.environ.get("FAKE_FAIL"):
                print("Traceback (most recent call last):", flush=True)
            print(f"Testing with seed {seed} ...", flush=True)
        time.sleep(120)
    """))
    ours = os.path.dirname(os.path.dirname(os.path.abspath(deepep_kernels.__file__)))
    cmd = ["bash", CONFORMANCE, "--ours", ours, "--only", "ours", "--no-mps", "--tests", "test_endless.py", "--timeout", "100",
           "--stop-at", "Testing with seed 2 ", str(tmp_path / "src"), "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path / "a")), cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and "PASS(stop)" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path / "b"), FAKE_FAIL="1"),
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 1 and "FAIL(stop)" in r.stdout, r.stdout + r.stderr


def test_conformance_adapter_is_inert_unless_enabled(tmp_path):
    # the adapter runs in every Python process of a conformance run; elsewhere it must do nothing
    adapter = os.path.join(os.path.dirname(CONFORMANCE), "conformance")
    env = dict(os.environ, PYTHONPATH=adapter)
    env.pop("DEEPEP_CONFORMANCE_ADAPTER", None)
    r = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "False" and "conformance adapter" not in r.stderr


def test_every_public_buffer_method_is_documented():
    # docstrings as DeepEP's: every public method says what it does; the communication methods
    # give shape and dtype per tensor argument
    public = [n for n, v in vars(Buffer).items() if not n.startswith("_") and callable(getattr(Buffer, n))] + ["__init__"]
    undocumented = [n for n in public if not (getattr(Buffer, n).__doc__ or "").strip()]
    assert not undocumented, undocumented
    for name in ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine"):
        doc = getattr(Buffer, name).__doc__
        assert "Arguments:" in doc and "Returns:" in doc and "torch." in doc and "[num_tokens" in doc, name
    assert (Config.__doc__ or "").strip() and Config.get_nvl_buffer_size_hint.__doc__ and Config.get_rdma_buffer_size_hint.__doc__
