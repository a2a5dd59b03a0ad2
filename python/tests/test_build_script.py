"""python/scripts/build-wheel.sh deals with the CUDA toolchain before compiling anything: a missing
one is installed (scripts/install-toolchain.sh), a wrong CUDA_HOME / NVSHMEM_DIR stops it at once
with the fix. Before, `--test` on a fresh clone compiled Rust crates for 6 minutes and then failed
with "nvcc not found" (the `--print-env` failure was swallowed by `eval "$(...)"`).

The script runs from a scratch copy (its checkout root is where it lies), with a stand-in
install-toolchain.sh that records its call and points at directories without nvcc, so nothing is
downloaded or compiled; a timeout catches a script that starts building instead."""

import os
import shutil
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STUB = """#!/usr/bin/env bash
# stand-in for scripts/install-toolchain.sh: nothing is installed yet
if [ "${1:-}" = --print-env ]; then echo "install-toolchain: error: no nvcc" >&2; exit 1; fi
root=$(cd "$(dirname "$0")/.." && pwd)
echo called > "$root/install-called"
echo "export CUDA_HOME=$root/no-cuda NVSHMEM_DIR=$root/no-nvshmem DEEPEP_NVSHMEM_WHEEL=none"
"""


@pytest.fixture
def scratch(tmp_path):
    os.makedirs(tmp_path / "python" / "scripts")
    os.makedirs(tmp_path / "scripts")
    shutil.copy(os.path.join(REPO, "python", "scripts", "build-wheel.sh"), tmp_path / "python" / "scripts")
    (tmp_path / "scripts" / "install-toolchain.sh").write_text(STUB)
    return tmp_path


def run(scratch, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "NVSHMEM_DIR")}
    e.update(env)
    start = time.monotonic()
    try:
        p = subprocess.run(["bash", str(scratch / "python" / "scripts" / "build-wheel.sh"), "--dev"], env=e,
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("build-wheel.sh did not stop within 60 s: it started building without a usable nvcc")
    return p, time.monotonic() - start


def test_missing_toolchain_is_installed_before_anything_is_compiled(scratch):
    p, took = run(scratch)
    assert (scratch / "install-called").exists(), p.stderr
    assert "installing it: scripts/install-toolchain.sh" in p.stderr, p.stderr
    # The stand-in "installed" a toolchain without nvcc: stopped at once, naming the fix.
    assert p.returncode == 1, p.stderr
    assert f"no nvcc at {scratch}/no-cuda/bin/nvcc" in p.stderr, p.stderr
    assert took < 10, took
    assert not (scratch / "target").exists(), "nothing may be built or installed before the toolchain check"


def test_wrong_cuda_home_or_nvshmem_dir_stops_at_once(scratch):
    p, took = run(scratch, CUDA_HOME=str(scratch / "nowhere"), NVSHMEM_DIR="")
    assert p.returncode == 1 and took < 10, (p.returncode, took, p.stderr)
    assert "no nvcc at" in p.stderr and "unset CUDA_HOME to use the pinned toolchain" in p.stderr, p.stderr
    assert not (scratch / "install-called").exists()
    # A CUDA_HOME with nvcc but an NVSHMEM_DIR without the device library.
    cuda = scratch / "cuda"
    os.makedirs(cuda / "bin")
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\n")
    os.chmod(cuda / "bin" / "nvcc", 0o755)
    p, took = run(scratch, CUDA_HOME=str(cuda), NVSHMEM_DIR=str(scratch / "nvshmem"))
    assert p.returncode == 1 and took < 10, (p.returncode, took, p.stderr)
    assert f"no lib/libnvshmem_device.a in NVSHMEM_DIR={scratch}/nvshmem" in p.stderr, p.stderr
    assert not (scratch / "target").exists()
