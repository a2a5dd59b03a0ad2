"""GPU test: our ``deepep_kernels.utils.{math,gate,refs}`` give DeepEP 2.1's own results bit for
bit (issue 38 item 2): FP8 casts (float32 and UE8M0 scales), ``inplace_unique``, the test's routing
scores (``get_unbalanced_scores``, precise and bisected), ``combine`` in every reduction recipe
with 0, 1 and 2 biases, ``ordered_accumulate``, ``generate_pre_combine_data``, and ``dispatch``
over the rank group (bf16 and FP8). The conformance run uses DeepEP's files themselves; this test
keeps ours, which our own GPU tests use, equal to them.

Needs DeepEP 2.1's ``deep_ep/utils/`` (a checkout or python/scripts/deepep-v2-subset.sh's folder)
named by ``DEEPEP_V2_SRC``; skipped without it. E.g. on the GPU machine:
``DEEPEP_V2_SRC=$PWD/gpu-carry/deepep-2.1 PYTEST_ARGS="-k v2_utils" python/scripts/gpu-run.sh WHEEL 2``.
"""

import os
import shutil

import pytest

import harness
import v2_utils_workers as w

SRC = os.environ.get("DEEPEP_V2_SRC", "")


@pytest.fixture
def upstream_utils(tmp_path):
    if not SRC:
        pytest.skip("DEEPEP_V2_SRC is not set (a DeepEP 2.1 tree or python/scripts/deepep-v2-subset.sh's folder)")
    utils = os.path.join(SRC, "deep_ep", "utils")
    missing = [m for m in ("refs", "math", "gate") if not os.path.isfile(os.path.join(utils, m + ".py"))]
    if missing:
        pytest.fail(f"DEEPEP_V2_SRC={SRC} has no deep_ep/utils/{missing[0]}.py: point it at DeepEP 2.1 (dd758ca) or its subset")
    pkg = tmp_path / "deepep_upstream_utils"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    # their relative imports: .envs (get_global_seed: ours, so both sides read one seed) and .math
    (pkg / "envs.py").write_text("from deepep_kernels.utils.envs import *  # noqa\nfrom deepep_kernels.utils.envs import get_global_seed  # noqa\n")
    for m in ("refs", "math", "gate"):
        shutil.copy(os.path.join(utils, m + ".py"), pkg / (m + ".py"))
    return str(tmp_path)


def test_utils_match_deepep_2_1_bit_for_bit(upstream_utils):
    harness.run(w.compare, upstream_utils)
