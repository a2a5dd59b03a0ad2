"""CPU tests of ``deep_ep.utils`` as a package (DeepEP 2.1's layout) and of the shim's DeepEP 2.1
names (issue 38, item 2).

- Every name DeepEP 2.1 (commit dd758ca) imports from ``deep_ep.utils.*`` in its tests
  (tests/elastic/*.py, tests/legacy/*.py, tests/utils/test_gate.py) and its own package exists in
  ours, with DeepEP's parameter names and defaults (read from our sources with ``ast``, so no
  torch is needed; the torch-backed behaviour is checked bit for bit against DeepEP's files in
  tests/gpu/test_v2_utils.py).
- The shim: ``deep_ep.utils`` and its submodules, ``deep_ep.ElasticBuffer`` / ``EPHandle``
  resolved lazily from ``deepep_kernels.elastic`` with a clear ImportError when it is missing,
  V1 names unchanged, importing ``deep_ep`` imports no torch.
- ``EventOverlap``'s DeepEP 2.1 additions (hook after wait, ``release_handle``), with a fake event.
"""

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

import deepep_kernels
from deepep_kernels.utils import EventHandle, EventOverlap
from deepep_kernels.utils import event as event_module

PKG = os.path.dirname(os.path.abspath(deepep_kernels.__file__))
UTILS = os.path.join(PKG, "utils")
SHIM = os.path.join(PKG, "shim")
HAVE_TORCH = importlib.util.find_spec("torch") is not None

# What DeepEP 2.1 (dd758ca) imports from deep_ep.utils.<module>: its tests and deep_ep/buffers/*.py
UPSTREAM_IMPORTS = {
    "envs": ["init_dist", "init_seed", "dist_print", "get_rdma_gbs", "get_global_seed", "get_local_seed",
             "get_physical_domain_size", "get_logical_domain_size", "check_nvlink_connections",
             "check_torch_deterministic", "get_nvlink_gbs", "check_fast_rdma_atomic_support"],
    "math": ["align", "count_bytes", "calc_diff", "per_token_cast_back", "per_token_cast_to_fp8", "safe_div",
             "create_grouped_scores", "inplace_unique", "hash_tensor", "hash_tensors", "ceil_div"],
    "gate": ["get_unbalanced_scores"],
    "refs": ["dispatch", "combine", "generate_pre_combine_data", "ordered_accumulate"],
    "testing": ["bench", "bench_kineto", "flush_l2_cache", "suppress_stdout_stderr", "empty_suppress"],
    "event": ["EventOverlap", "EventHandle"],
}

R = "<required>"
# DeepEP 2.1's parameter lists (name, default) of the functions above, from deep_ep/utils/*.py at dd758ca
UPSTREAM_SIGNATURES = {
    ("envs", "init_dist"): [("local_rank", R), ("num_local_ranks", R), ("seed", 0)],
    ("envs", "init_seed"): [("global_seed", R)],
    ("envs", "dist_print"): [("s", ""), ("once_in_node", False)],
    ("envs", "get_physical_domain_size"): [("group", R)],
    ("envs", "get_logical_domain_size"): [("group", R), ("allow_hybrid_mode", True)],
    ("envs", "get_nvlink_gbs"): [("factor", 0.9)],
    ("math", "calc_diff"): [("x", R), ("y", R)],
    ("math", "align"): [("x", R), ("y", R)],
    ("math", "ceil_div"): [("x", R), ("y", R)],
    ("math", "per_token_cast_to_fp8"): [("x", R)],
    ("math", "per_token_cast_back"): [("x_fp8", R), ("x_scales", R)],
    ("math", "inplace_unique"): [("x", R), ("num_slots", R)],
    ("math", "create_grouped_scores"): [("scores", R), ("group_idx", R), ("num_groups", R)],
    ("gate", "get_unbalanced_scores"): [("num_tokens", R), ("num_experts", R), ("num_ranks", R), ("num_topk", R),
                                        ("ratio", R), ("precise", R)],
    ("refs", "dispatch"): [("x", R), ("topk_idx", R), ("topk_weights", R), ("num_max_tokens_per_rank", R), ("num_experts", R)],
    ("refs", "combine"): [("y", R), ("topk_idx", R), ("num_scaleout_ranks", R), ("num_scaleup_ranks", R), ("num_experts", R),
                          ("bias", R), ("reduce_in_local", R), ("reduce_in_scaleup", R)],
    ("refs", "generate_pre_combine_data"): [("src_token_global_idx", R), ("num_max_tokens_per_rank", R), ("num_topk", R),
                                            ("hidden", R)],
    ("refs", "ordered_accumulate"): [("data", R), ("initial_value", None)],
    ("testing", "bench"): [("fn", R), ("num_warmups", 50), ("num_tests", 50), ("post_fn", None), ("flush_l2", True)],
    ("testing", "bench_kineto"): [("fn", R), ("kernel_names", R), ("num_tests", 30), ("suppress_kineto_output", False),
                                  ("trace_path", None), ("flush_l2", True), ("barrier_comm_profiling", False),
                                  ("num_kernels_per_period", 1), ("barrier", None)],
}


def module_tree(name):
    with open(os.path.join(UTILS, name + ".py"), encoding="utf-8") as f:
        return ast.parse(f.read())


def top_level(tree):
    """name -> the top-level def/class node (or None for an assignment), and the module's __all__."""
    defs, exported = {}, None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = None
                    if t.id == "__all__":
                        exported = ast.literal_eval(node.value)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                defs[a.asname or a.name] = None
    return defs, exported


def positional_params(fn):
    """(name, default) of the positional parameters; keyword-only ones must have defaults (ours may
    add such, e.g. gate's ``device``)."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    defaults = [R] * (len(names) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    for kw, default in zip(a.kwonlyargs, a.kw_defaults):
        assert default is not None, f"{fn.name}: keyword-only parameter {kw.arg} has no default (DeepEP's callers do not pass it)"
    return list(zip(names, defaults))


@pytest.mark.parametrize("module", sorted(UPSTREAM_IMPORTS))
def test_every_name_deepep_imports_is_defined_and_exported(module):
    defs, exported = top_level(module_tree(module))
    assert exported is not None, f"deepep_kernels/utils/{module}.py has no __all__ (the shim re-exports it with *)"
    for name in UPSTREAM_IMPORTS[module]:
        assert name in defs, f"deep_ep.utils.{module}.{name} (imported by DeepEP 2.1) is not defined in ours"
        assert name in exported, f"deep_ep.utils.{module}.{name} is not in __all__, so the shim's re-export misses it"
    for name in exported:
        assert name in defs, f"__all__ of utils/{module}.py names {name}, which it does not define"


@pytest.mark.parametrize("module,name", sorted(UPSTREAM_SIGNATURES))
def test_parameters_follow_deepep_2_1(module, name):
    defs, _ = top_level(module_tree(module))
    assert positional_params(defs[name]) == UPSTREAM_SIGNATURES[(module, name)]


def test_shim_utils_modules_reexport_ours():
    shim_utils = os.path.join(SHIM, "deep_ep", "utils")
    for module in UPSTREAM_IMPORTS:
        with open(os.path.join(shim_utils, module + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        sources = {(n.module, tuple(a.name for a in n.names)) for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert (f"deepep_kernels.utils.{module}", ("*",)) in sources, f"shim deep_ep/utils/{module}.py does not re-export ours"
        assert (f"deepep_kernels.utils.{module}", ("__all__",)) in sources


def run_py(code, pythonpath=None, cwd=None):
    env = dict(os.environ)
    env.pop("DEEPEP_KERNELS_SHADOW_DEEP_EP", None)
    paths = [p for p in (pythonpath, os.path.dirname(PKG)) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=cwd or "/")


def test_importing_deep_ep_and_its_utils_imports_no_torch():
    r = run_py("""
        import sys
        import deep_ep, deep_ep.utils, deep_ep.utils.event, deepep_kernels
        assert "torch" not in sys.modules, "importing deep_ep imported torch"
        assert deep_ep.__version__ == "2.1.0"
        assert deep_ep.utils.EventHandle is deepep_kernels.utils.EventHandle
        assert deep_ep.utils.event.EventOverlap is deepep_kernels.EventOverlap is deep_ep.EventOverlap
        from deep_ep.buffer import Buffer
        assert Buffer is deep_ep.Buffer is deepep_kernels.Buffer
        import importlib.util
        for m in ("envs", "math", "gate", "refs", "testing"):
            spec = importlib.util.find_spec("deep_ep.utils." + m)
            assert spec is not None and spec.origin.startswith(deep_ep.utils.__path__[0]), m
        assert {"ElasticBuffer", "EPHandle", "topk_idx_t", "get_logical_domain_size"} <= set(dir(deep_ep))
        print("ok")
    """, SHIM)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


@pytest.mark.skipif(not HAVE_TORCH, reason="deep_ep.utils.{envs,math,...} import torch, which this environment lacks")
def test_shim_utils_submodules_are_ours_with_torch():
    r = run_py("""
        import torch, deep_ep, deepep_kernels.utils.math as m, deepep_kernels.utils.envs as e
        import deep_ep.utils.math, deep_ep.utils.envs, deep_ep.utils.gate, deep_ep.utils.refs, deep_ep.utils.testing
        assert deep_ep.utils.math.per_token_cast_to_fp8 is m.per_token_cast_to_fp8
        assert deep_ep.utils.envs.init_dist is e.init_dist and deep_ep.get_logical_domain_size is e.get_logical_domain_size
        assert deep_ep.topk_idx_t is torch.int64
        print("ok")
    """, SHIM)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_elastic_buffer_without_the_v2_module_is_a_clear_import_error():
    # None in sys.modules makes `import deepep_kernels.elastic` fail as if the module were absent
    r = run_py("""
        import sys
        sys.modules["deepep_kernels.elastic"] = None
        import deep_ep
        for name in ("ElasticBuffer", "EPHandle"):
            try:
                getattr(deep_ep, name)
            except ImportError as e:
                print(name, "|", e)
            else:
                raise SystemExit(name + " resolved without deepep_kernels.elastic")
        try:
            from deep_ep import ElasticBuffer
        except ImportError as e:
            print("from-import |", e)
    """, SHIM)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3
    for line in lines:
        assert "is not in this deepep_kernels build: it has no deepep_kernels.elastic module" in line
        assert "deep_ep.Buffer" in line  # what to use instead


def test_elastic_buffer_resolves_from_deepep_kernels_elastic(tmp_path):
    r = run_py("""
        import sys, types
        fake = types.ModuleType("deepep_kernels.elastic")
        class ElasticBuffer: pass
        fake.ElasticBuffer = ElasticBuffer
        sys.modules["deepep_kernels.elastic"] = fake
        import deep_ep
        assert deep_ep.ElasticBuffer is ElasticBuffer
        from deep_ep import ElasticBuffer as again
        assert again is ElasticBuffer
        try:
            deep_ep.EPHandle
        except ImportError as e:
            print(e)
        try:
            deep_ep.NoSuchName
        except AttributeError as e:
            print(e)
    """, SHIM)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert "deepep_kernels.elastic does not define EPHandle" in out[0]
    assert "has no attribute 'NoSuchName'" in out[1]


def test_a_copy_of_the_shim_is_not_taken_for_a_real_deepep(tmp_path):
    # deepep-conformance.sh runs a copy of the shim's deep_ep (DeepEP's refs/math/gate over ours)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(SHIM, "deep_ep"), copy / "deep_ep")
    real = tmp_path / "real"
    (real / "deep_ep").mkdir(parents=True)
    (real / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    r = run_py("""
        import deep_ep, deepep_kernels.shim as s
        assert deep_ep.__file__.startswith(%r), deep_ep.__file__
        assert s.real_deep_ep_locations() == []
        print("ok")
    """ % str(copy), str(copy))
    assert r.returncode == 0, r.stderr
    r = run_py("import deep_ep", str(copy) + os.pathsep + str(real))
    assert r.returncode != 0 and "would shadow a real DeepEP installation at " + str(real / "deep_ep") in r.stderr


def test_v1_names_keep_working():
    assert deepep_kernels.EventHandle is EventHandle is event_module.EventHandle
    assert deepep_kernels.EventOverlap is EventOverlap is event_module.EventOverlap
    # DeepEP v1.2.1's constructor
    assert [p.name for p in inspect.signature(EventOverlap).parameters.values()] == ["event", "extra_tensors"]


class FakeEvent:
    """Stands in for an EventHandle: records the waits."""

    def __init__(self, log):
        self.log = log

    def current_stream_wait(self):
        self.log.append("wait")


def test_event_overlap_runs_the_hook_once_after_the_wait():
    log = []
    overlap = EventOverlap(FakeEvent(log), extra_tensors=("kept",))
    overlap.register_hook_after_wait(lambda: log.append("hook"))
    with pytest.raises(RuntimeError, match="a hook is already registered"):
        overlap.register_hook_after_wait(lambda: None)
    overlap.current_stream_wait()
    assert log == ["wait", "hook"]
    overlap.current_stream_wait()  # the hook ran once; the event stays (no release_handle)
    assert log == ["wait", "hook", "wait"] and overlap.event is not None and overlap.extra_tensors == ("kept",)
    overlap.current_stream_wait(release_handle=True)
    assert overlap.event is None
    with pytest.raises(RuntimeError, match="has no event"):
        overlap.current_stream_wait()
    with pytest.raises(TypeError, match="takes a callable"):
        overlap.register_hook_after_wait("not callable")


def test_event_overlap_with_block_and_release_handle():
    log = []
    overlap = EventOverlap(FakeEvent(log))
    with overlap as same:
        assert same is overlap and log == []
    assert log == ["wait"] and overlap.event is not None
    overlap.register_hook_after_wait(lambda: log.append("hook"))
    with overlap(release_handle=True):
        pass
    assert log == ["wait", "wait", "hook"] and overlap.event is None
    # release_handle applies to that one block only
    overlap.event = FakeEvent(log)
    with overlap:
        pass
    assert overlap.event is not None
    # a synchronous call's EventOverlap(None): leaving the block waits for nothing
    with EventOverlap(None):
        pass
