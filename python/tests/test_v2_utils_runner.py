"""CPU tests of the DeepEP 2.x conformance run (issue 38): python/scripts/deepep-conformance.sh on a
DeepEP 2.x tree puts DeepEP's own deep_ep/utils/{refs,math,gate}.py over the shim's in a scratch
copy; python/scripts/deepep-v2-subset.sh extracts tests/ + deep_ep/utils/ of DeepEP 2.1; the
adapter stages all_to_all_single through the CPU (uneven splits, float8 as bytes) and turns
new_group into gloo.

The staging arithmetic is pure Python and always tested. The exchange itself needs torch: it runs
over gloo with 3 processes on CPU tensors (and on CUDA tensors where a GPU is visible) when torch
is installed (the GPU machine's CPU test pass, python/scripts/gpu-run.sh); this repository's CPU
environment has no torch, so there it is skipped with that reason.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import deepep_kernels

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "..", "scripts")
RUNNER = os.path.join(SCRIPTS, "deepep-conformance.sh")
SUBSET = os.path.join(SCRIPTS, "deepep-v2-subset.sh")
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def load_staging():
    path = os.path.join(SCRIPTS, "conformance", "deepep_conformance_staging.py")
    spec = importlib.util.spec_from_file_location("deepep_conformance_staging", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


staging = load_staging()


def test_uneven_splits_are_kept_and_rows_travel_as_bytes():
    # bfloat16 [7, 5]: 10 bytes a row; rank sends 3, 0, 4 rows and receives 1, 2, 0
    assert staging.exchange_plan((3, 5), 2, (7, 5), 2, [1, 2, 0], [3, 0, 4], 3) == ([1, 2, 0], [3, 0, 4], 10)
    # float8 [rows, 3, 4] moves 12 bytes a row; 1-D int32 4 bytes a row
    assert staging.exchange_plan((2, 3, 4), 1, (2, 3, 4), 1, [2, 0], [1, 1], 2) == ([2, 0], [1, 1], 12)
    assert staging.exchange_plan((5,), 4, (5,), 4, [5, 0], [0, 5], 2) == ([5, 0], [0, 5], 4)


def test_no_splits_means_an_even_split():
    assert staging.exchange_plan((6, 2), 8, (6, 2), 8, None, [], 3) == ([2, 2, 2], [2, 2, 2], 16)
    with pytest.raises(ValueError, match="7 rows are not a multiple of the world size 3; pass input_split_sizes"):
        staging.exchange_plan((6, 2), 8, (7, 2), 8, None, None, 3)


@pytest.mark.parametrize("splits,message", [
    ([1, 2], "has 2 entries, one per rank is needed"),
    ([4, -1, 4], "has a negative entry"),
    ([1, 1, 1], "add up to 3 rows, but the input tensor has 7"),
])
def test_bad_splits_are_named(splits, message):
    with pytest.raises(ValueError, match=message):
        staging.exchange_plan((7, 5), 2, (7, 5), 2, [7, 0, 0], splits, 3)


def test_rows_of_different_sizes_are_refused():
    with pytest.raises(ValueError, match="an output row has 8 bytes .* and an input row 10"):
        staging.exchange_plan((3, 4), 2, (3, 5), 2, None, None, 3)


@pytest.mark.skipif(not HAVE_TORCH, reason="the gloo exchange needs torch, which this environment lacks (the GPU machine has it)")
def test_gloo_exchange_through_the_adapter(tmp_path):
    world = 3
    init = tmp_path / "init"
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "conformance_adapter_worker.py"), str(r), str(world), str(init)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out))
    for r, (code, out) in enumerate(outs):
        assert code == 0 and f"ok {r}" in out, f"rank {r} exited {code}:\n{out}"


def fake_tree(root, with_gate=True):
    """A DeepEP 2.x tree in miniature: its refs/math/gate mark their origin, its tests check that
    those (and ours for the rest of deep_ep) are what they import."""
    utils = root / "deep_ep" / "utils"
    utils.mkdir(parents=True)
    for m in ("refs", "math", "gate") if with_gate else ("refs", "math"):
        (utils / f"{m}.py").write_text(f"ORIGIN = 'deepep-tree:{m}'\n")
    (utils / "envs.py").write_text("raise SystemExit('the tree envs.py must never be imported')\n")
    check = textwrap.dedent("""
        import os, sys
        import deep_ep, deepep_kernels
        import deep_ep.utils.refs, deep_ep.utils.math, deep_ep.utils.gate
        for m in ("refs", "math", "gate"):
            assert getattr(deep_ep.utils, m).ORIGIN == "deepep-tree:" + m, m
        assert deep_ep.utils.EventOverlap is deepep_kernels.EventOverlap
        assert deep_ep.__deepep_kernels_shim__
        assert "/deepep-conformance." in deep_ep.__file__, deep_ep.__file__
        print("shim copy", os.path.dirname(os.path.dirname(deep_ep.__file__)))
        print("args", sys.argv[1:])
    """)
    (root / "tests" / "elastic").mkdir(parents=True)
    (root / "tests" / "elastic" / "test_ep.py").write_text(check)
    (root / "tests" / "legacy").mkdir(parents=True)
    (root / "tests" / "legacy" / "test_intranode.py").write_text(check)
    return root


def files_under(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def run_runner(args, tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    env.pop("DEEPEP_KERNELS_SHADOW_DEEP_EP", None)
    ours = os.path.dirname(os.path.dirname(os.path.abspath(deepep_kernels.__file__)))
    return subprocess.run(["bash", RUNNER, "--only", "ours", "--no-mps", "--ours", ours] + args,
                          capture_output=True, text=True, env=env, timeout=300)


def test_runner_puts_the_trees_references_over_ours_in_a_scratch_copy(tmp_path):
    tree = fake_tree(tmp_path / "deepep")
    before = files_under(tree)
    r = run_runner(["--tests", "elastic/test_ep.py test_intranode.py", "--test-args", "--skip-perf-test --do-cpu-sync 0",
                    str(tree), "2", "3"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deep_ep.utils.{refs,math,gate} are DeepEP's own" in r.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    rows = [line.split() for line in summary[1:]]
    assert [(f[0], f[1], f[2], f[3], f[5]) for f in rows] == [
        ("ours", "elastic/test_ep.py", "2", "PASS", "ours-elastic_test_ep-2.log"),
        ("ours", "elastic/test_ep.py", "3", "PASS", "ours-elastic_test_ep-3.log"),
        ("ours", "legacy/test_intranode.py", "2", "PASS", "ours-legacy_test_intranode-2.log"),
        ("ours", "legacy/test_intranode.py", "3", "PASS", "ours-legacy_test_intranode-3.log"),
    ]
    assert all(line.endswith("  --skip-perf-test --do-cpu-sync 0") for line in summary[1:])
    log = (tmp_path / "out" / "ours-elastic_test_ep-3.log").read_text()
    assert "args ['--num-processes', '3', '--skip-perf-test', '--do-cpu-sync', '0']" in log
    copy = [line.split(" ", 2)[2] for line in log.splitlines() if line.startswith("shim copy ")][0]
    assert copy.startswith("/tmp/deepep-conformance.") and not os.path.exists(copy), "the scratch copy outlived the run"
    assert files_under(tree) == before, "the run wrote into the DeepEP tree"


def test_runner_refuses_a_2x_tree_without_its_references(tmp_path):
    tree = fake_tree(tmp_path / "deepep", with_gate=False)
    r = run_runner(["--tests", "elastic/test_ep.py", str(tree), "2"], tmp_path)
    assert r.returncode == 2 and "deep_ep/utils/ has no gate.py" in r.stderr


def test_runner_names_a_missing_test_file(tmp_path):
    tree = fake_tree(tmp_path / "deepep")
    r = run_runner(["--tests", "elastic/test_nope.py", str(tree), "2"], tmp_path)
    assert r.returncode == 2
    assert "neither " + str(tree) + "/tests/elastic/test_nope.py nor " in r.stderr and "deepep-v2-subset.sh" in r.stderr


def deepep_repo():
    for repo in (os.environ.get("DEEPEP_REPO"), "/work/.mirror/deepseek-ai+DeepEP/repo"):
        if repo and subprocess.run(["git", "-C", repo, "cat-file", "-e", "dd758ca^{commit}"], capture_output=True).returncode == 0:
            return repo
    return None


@pytest.mark.skipif(deepep_repo() is None, reason="no DeepEP git repository with commit dd758ca (set DEEPEP_REPO)")
def test_subset_holds_tests_and_utils_of_deepep_2_1(tmp_path):
    out = tmp_path / "deepep-2.1"
    cmd = ["bash", SUBSET, "--repo", deepep_repo(), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    files = files_under(out)
    assert {"tests/elastic/test_ep.py", "tests/legacy/test_intranode.py", "deep_ep/utils/refs.py",
            "deep_ep/utils/math.py", "deep_ep/utils/gate.py", ".deepep-subset"} <= set(files)
    assert all(f.startswith(("tests/", "deep_ep/utils/")) or f == ".deepep-subset" for f in files), files
    assert sum(os.path.getsize(out / f) for f in files) < 300_000
    assert "commit dd758caf451848bd150e1046af3d0a73e5fff38d" in (out / ".deepep-subset").read_text()
    # again: the earlier subset is replaced; another non-empty folder is refused
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep").write_text("x")
    r = subprocess.run(["bash", SUBSET, "--repo", deepep_repo(), str(other)], capture_output=True, text=True)
    assert r.returncode == 2 and "holds no earlier subset" in r.stderr and (other / "keep").exists()
