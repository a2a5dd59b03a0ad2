"""The aarch64 cross build's scripts (issue 40) without building anything: build-wheel.sh
--target aarch64 asks python/scripts/aarch64-toolchain.sh for the NVSHMEM releases the x86_64
wheel serves (and a list or `all` from the lock), and stops with its failure; bad arguments and a
wheel of the wrong CPU are refused naming the fix.

build-wheel.sh runs from a scratch copy (its checkout root is where it lies) with stand-ins for
scripts/install-toolchain.sh (an nvcc and an NVSHMEM prefix that are only files) and for
aarch64-toolchain.sh (records its arguments, then fails), so it stops before maturin."""

import json
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "python", "scripts")

INSTALL_STUB = """#!/usr/bin/env bash
root=$(cd "$(dirname "$0")/.." && pwd)
echo "export CUDA_HOME=$root/cuda NVSHMEM_DIR=$root/nvshmem DEEPEP_NVSHMEM_RELEASES="
"""
A64_STUB = """#!/usr/bin/env bash
root=$(cd "$(dirname "$0")/../.." && pwd)
printf '%s\\n' "$@" > "$root/a64-args"
echo "aarch64-toolchain: error: stand-in" >&2
exit 1
"""


@pytest.fixture
def scratch(tmp_path):
    for d in ("python/scripts", "scripts", "cuda/bin", "nvshmem/lib", "pkgs/nvshmem"):
        os.makedirs(tmp_path / d)
    shutil.copy(os.path.join(SCRIPTS, "build-wheel.sh"), tmp_path / "python" / "scripts")
    shutil.copy(os.path.join(REPO, "pkgs", "nvshmem", "releases.json"), tmp_path / "pkgs" / "nvshmem")
    (tmp_path / "scripts" / "install-toolchain.sh").write_text(INSTALL_STUB)
    (tmp_path / "python" / "scripts" / "aarch64-toolchain.sh").write_text(A64_STUB)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    os.chmod(tmp_path / "cuda" / "bin" / "nvcc", 0o755)
    (tmp_path / "nvshmem" / "lib" / "libnvshmem_device.a").write_text("")
    return tmp_path


def build(scratch, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "NVSHMEM_DIR", "DEEPEP_NVSHMEM_RELEASES")}
    return subprocess.run(["bash", str(scratch / "python" / "scripts" / "build-wheel.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def a64_args(scratch):
    return (scratch / "a64-args").read_text().split()


def test_target_aarch64_serves_the_x86_64_default_releases_and_stops_on_a_toolchain_failure(scratch):
    r = build(scratch, "--target", "aarch64")
    assert r.returncode == 1, r.stderr
    assert "python/scripts/aarch64-toolchain.sh failed" in r.stderr, r.stderr
    assert a64_args(scratch) == ["--nvshmem-releases", "3.4.5,3.3.20"]
    assert not (scratch / "target" / "wheels").exists()


def test_target_aarch64_release_list_and_all(scratch):
    build(scratch, "--target", "aarch64", "--nvshmem-releases", "3.8.0")
    assert a64_args(scratch) == ["--nvshmem-releases", "3.4.5,3.8.0"]
    build(scratch, "--target", "aarch64", "--nvshmem-releases", "all")
    lock = json.load(open(os.path.join(REPO, "pkgs", "nvshmem", "releases.json")))
    want = [r["version"] for r in lock["releases"] if r.get("systems", {}).get("aarch64-linux", {}).get("13", {}).get("pypi")]
    got = a64_args(scratch)[1].split(",")
    assert got[0] == "3.4.5" and sorted(got) == sorted(want) and len(got) == len(set(got)), got


def test_bad_target_is_refused(scratch):
    r = build(scratch, "--target", "riscv64")
    assert r.returncode == 2 and "--target takes x86_64 or aarch64; got 'riscv64'" in r.stderr, r.stderr


def test_toolchain_script_refuses_a_bad_release_list():
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "aarch64-toolchain.sh"), "--nvshmem-releases", "3.4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "versions like 3.4.5,3.3.20; got '3.4'" in r.stderr, r.stderr


def test_qemu_script_refuses_a_wheel_of_another_cpu(tmp_path):
    wheel = tmp_path / "deepep_kernels-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl"
    wheel.write_bytes(b"")
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "aarch64-qemu-test.sh"), str(wheel)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is not an aarch64 deepep_kernels wheel" in r.stderr and "--target aarch64" in r.stderr, r.stderr
