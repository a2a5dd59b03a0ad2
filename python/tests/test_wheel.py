"""The wheel file itself, as python/scripts/build-wheel.sh built it (it passes the path as
DEEPEP_KERNELS_WHEEL): no absolute path of the checkout or of the CUDA/NVSHMEM toolchain in any
member, an extension without debug sections or symbol table, zip times from SOURCE_DATE_EPOCH
(the commit's time), no SBOM with a random serial number; and `deepep-nix doctor --python-site`
names the installed wheel. These are the cheap parts of python/scripts/check-reproducible.sh
(two full release builds from two clones), which CI cannot afford. No GPU, no torch."""

import glob
import json
import os
import subprocess
import time
import zipfile

import pytest

import deepep_kernels
from deepep_kernels import _native

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _missing(why):
    # In CI a missing input is a failure, not a skip that would pass silently.
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def wheel():
    path = os.environ.get("DEEPEP_KERNELS_WHEEL")
    if not path:
        found = sorted(glob.glob(os.path.join(REPO, "target", "wheels*", "deepep_kernels-*.whl")))
        if not found:
            _missing("no wheel: run python/scripts/build-wheel.sh --test (it sets DEEPEP_KERNELS_WHEEL)")
        path = found[-1]
    with zipfile.ZipFile(path) as z:
        yield z


def _native_member(z):
    names = [n for n in z.namelist() if n.startswith("deepep_kernels/_native") and ".so" in n]
    assert len(names) == 1, names
    return names[0]


def test_no_absolute_build_path_in_any_member(wheel):
    # Before: the extension held the checkout's path in its debug info and, through nvlink's
    # recorded options, in the NVSHMEM cubins (-L <checkout>/.toolchain/nvidia/nvshmem/lib); the
    # SBOM held path+file://<checkout>/python.
    needles = {REPO, os.path.realpath(REPO)}
    for var in ("CUDA_HOME", "NVSHMEM_DIR", "CARGO_TARGET_DIR"):
        v = os.environ.get(var)
        if v and os.path.isabs(v):
            needles |= {v.rstrip("/"), os.path.realpath(v)}
    for v in os.environ.get("DEEPEP_NVSHMEM_RELEASES", "").split(":"):  # the other releases' prefixes
        if v and os.path.isabs(v):
            needles |= {v.rstrip("/"), os.path.realpath(v)}
    needles = sorted(n for n in needles if len(n) >= 5)  # a shorter path could match by chance
    assert needles
    found = []
    for info in wheel.infolist():
        data = wheel.read(info)
        for n in needles:
            at = data.find(n.encode())
            if at >= 0:
                found.append(f"{info.filename}: {data[max(0, at - 40):at + len(n) + 40]!r}")
    assert not found, "absolute build paths in the wheel:\n" + "\n".join(found)


def _section_names(elf):
    """Section names of a 64-bit little-endian ELF file."""
    assert elf[:6] == b"\x7fELF\x02\x01", "not a 64-bit little-endian ELF file"
    shoff = int.from_bytes(elf[40:48], "little")
    shentsize = int.from_bytes(elf[58:60], "little")
    shnum = int.from_bytes(elf[60:62], "little")
    shstrndx = int.from_bytes(elf[62:64], "little")

    def header(i):
        h = elf[shoff + i * shentsize: shoff + (i + 1) * shentsize]
        return int.from_bytes(h[0:4], "little"), int.from_bytes(h[24:32], "little"), int.from_bytes(h[32:40], "little")

    _, stroff, strsize = header(shstrndx)
    strtab = elf[stroff:stroff + strsize]
    names = []
    for i in range(shnum):
        name = header(i)[0]
        names.append(strtab[name:strtab.index(b"\0", name)].decode())
    return names


def test_extension_is_stripped(wheel):
    # Before: 21 MB with .debug_info/.debug_line/.debug_str... (the release profile has debug = 1).
    member = _native_member(wheel)
    elf = wheel.read(member)
    names = _section_names(elf)
    assert ".text" in names and ".dynsym" in names, names
    debug = [n for n in names if n.startswith((".debug", ".zdebug")) or n == ".symtab"]
    assert not debug, f"{member} ({len(elf)} bytes) is not stripped: {debug}"


def test_no_sbom_with_random_id_or_build_time(wheel):
    # maturin's Rust SBOM has a random serialNumber, the build time and the checkout's path:
    # pyproject.toml turns it off ([tool.maturin.sbom] rust = false).
    sboms = [n for n in wheel.namelist() if "/sboms/" in n]
    assert not sboms, sboms


def test_zip_times_are_the_commits(wheel):
    times = {i.date_time for i in wheel.infolist()}
    assert len(times) == 1, f"entries carry different times: {sorted(times)}"
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if not epoch:
        try:
            epoch = subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%ct"], capture_output=True, text=True,
                                   check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            pytest.skip("not a git checkout: the wheel's times come from SOURCE_DATE_EPOCH when set (else 1980-01-01)")
    want = time.gmtime(int(epoch))[:6]
    want = want[:5] + (want[5] - want[5] % 2,)  # zip stores seconds / 2
    assert times == {want}, f"zip times {times}, SOURCE_DATE_EPOCH / commit time {want}"


def _deepep_nix():
    explicit = os.environ.get("DEEPEP_NIX")
    if explicit:
        return explicit
    for profile in ("debug", "release"):
        p = os.path.join(REPO, "target", profile, "deepep-nix")
        if os.access(p, os.X_OK):
            return p
    _missing("no deepep-nix binary in target/debug or target/release (cargo build -p deepep-nix) and DEEPEP_NIX unset")


def test_doctor_recognises_the_installed_wheel():
    # Before: `doctor --python-site <site with deepep_kernels>` failed deepep.extension with "no
    # deep_ep_cpp*.so ..., build DeepEP ...", blocking every capability.
    site = os.path.dirname(os.path.dirname(os.path.abspath(deepep_kernels.__file__)))
    out = subprocess.run([_deepep_nix(), "doctor", "--json", "--python-site", site], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode in (0, 1), out.stderr  # 1: not ready (no GPU here)
    checks = {c["id"]: c for c in json.loads(out.stdout)["checks"]}
    pkg = checks["deepep-kernels.package"]
    assert pkg["status"] == "ok", pkg
    assert f"deepep_kernels {deepep_kernels.__version__} (" in pkg["found"], pkg["found"]
    linked = _native.nvshmem_device_version()
    served = _native.nvshmem_releases()
    if linked is None:
        assert "built without NVSHMEM kernels" in pkg["found"], pkg["found"]
    else:
        # The releases marker read from the extension's bytes, and the NVSHMEM device library
        # version found in the cubins of each release: the same list as the module's own.
        listed = ", ".join(served)
        assert f"serves NVSHMEM {listed} (DEEPEP_KERNELS_NVSHMEM_RELEASES= in the extension; cubins linked " \
               f"against NVSHMEM {listed})" in pkg["found"], pkg["found"]
    assert "GPU code sm_90 " in pkg["found"], pkg["found"]
    assert checks["deepep.extension"]["status"] == "skip", checks["deepep.extension"]
    nvshmem_dir = os.environ.get("NVSHMEM_DIR")
    if linked is not None and nvshmem_dir:
        # build-wheel.sh runs the tests with the NVSHMEM the wheel was built against.
        nv = checks["deepep-kernels.nvshmem"]
        assert nv["status"] == "ok", nv
        assert "from NVSHMEM_DIR" in nv["found"], nv["found"]
