#!/usr/bin/env bash
# Run the aarch64 wheel's CPU tests (python/tests without tests/gpu) on this x86_64 machine under
# qemu-user, with Debian 12's arm64 CPython 3.11 and PyPI's aarch64 numpy and pytest.
#
# Usage: python/scripts/aarch64-qemu-test.sh [--record] WHEEL [-- PYTEST-ARGS...]
#   WHEEL      a deepep_kernels-*-cp310-abi3-manylinux_*_aarch64.whl
#              (python/scripts/build-wheel.sh --target aarch64 builds one)
#   --record   also write kernels/results/<date>-gpu-tests-aarch64-qemu-cpu-tests.json (schema 2,
#              machine_kind cpu; scripts/results.py new) from pytest's JUnit XML
#   PYTEST-ARGS after `--` go to pytest (e.g. -k settings)
#
# What it sets up (once, in $DEEPEP_AARCH64_DIR or target/tools/aarch64):
# - python/: Debian 12's arm64 python3.11 and the libraries it loads (glibc, libgcc_s, libstdc++,
#   OpenSSL, ...), fetched with apt-get against a private state folder and Debian's signed index
#   (apt checks every .deb), unpacked with dpkg-deb -x: nothing is installed system-wide, and the
#   system's amd64 python3 is untouched.
# - site/: numpy 2.2.6 and pytest 9.2.0 for cp311 manylinux aarch64 (pip install --target
#   --platform), the versions build-wheel.sh --test uses on x86_64.
# Then the wheel is unpacked into its own site folder and pytest runs under
# `qemu-aarch64 -L python/` (Debian's qemu-user; apt-get install qemu-user), through a wrapper
# python/usr/bin/python3-qemu that is also sys.executable (tests start subprocesses with it).
# Left out: tests/test_wheel.py::test_doctor_recognises_the_installed_wheel, which runs this
# machine's x86_64 deepep-nix doctor on the extension (it rightly refuses one for another CPU).
# The x86_64 toolchain's NVSHMEM_DIR / DEEPEP_NVSHMEM_RELEASES (scripts/install-toolchain.sh
# --print-env) are cleared: under qemu the tests would try to load those x86_64 libraries.
# Needs: qemu-aarch64, apt-get, dpkg-deb, python3 with pip, network the first time.
set -euo pipefail
unset NVSHMEM_DIR DEEPEP_NVSHMEM_RELEASES
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=${DEEPEP_AARCH64_DIR:-$repo/target/tools/aarch64}
record=0
wheel=""
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --record) record=1 ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; pytest_args=("$@"); break ;;
    -*) echo "aarch64-qemu-test: unknown option '$1' (use --record, WHEEL, -- PYTEST-ARGS or --help)" >&2; exit 2 ;;
    *) [ -z "$wheel" ] || { echo "aarch64-qemu-test: one wheel only; got '$wheel' and '$1'" >&2; exit 2; }; wheel=$1 ;;
  esac
  shift
done
die() { echo "aarch64-qemu-test: error: $*" >&2; exit 1; }
say() { echo "aarch64-qemu-test: $*" >&2; }
[ -n "$wheel" ] || die "no wheel given. Fix: python/scripts/aarch64-qemu-test.sh target/wheels/deepep_kernels-*_aarch64.whl (python/scripts/build-wheel.sh --target aarch64 builds it)"
[ -f "$wheel" ] || die "no such wheel: $wheel"
case "$(basename "$wheel")" in
  deepep_kernels-*-cp310-abi3-*_aarch64.whl) ;;
  *) die "$(basename "$wheel") is not an aarch64 deepep_kernels wheel (deepep_kernels-*-cp310-abi3-manylinux_*_aarch64.whl). Fix: python/scripts/build-wheel.sh --target aarch64" ;;
esac
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
qemu=$(command -v qemu-aarch64 || command -v qemu-aarch64-static || true)
[ -n "$qemu" ] || die "qemu-aarch64 not found. Fix: apt-get install qemu-user"
for t in apt-get dpkg-deb python3; do command -v "$t" >/dev/null || die "'$t' not found: this needs a Debian-based system with python3"; done

# 1. Debian 12's arm64 CPython, unpacked.
root=$dir/python
pkgs=(libc6 libgcc-s1 libstdc++6 zlib1g libexpat1 libssl3 libffi8 libbz2-1.0 liblzma5 libuuid1
  libcrypt1 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libpython3.11-minimal libpython3.11-stdlib python3.11-minimal)
if [ ! -f "$root/.complete" ]; then
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  [ -r "$keyring" ] || die "$keyring missing: apt-get install debian-archive-keyring"
  mirror=${DEEPEP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
  security=${DEEPEP_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
  rm -rf "$root"
  apt_dir=$dir/python-apt
  rm -rf "$apt_dir"
  mkdir -p "$apt_dir"/{lists/partial,archives/partial,etc/apt.conf.d,etc/preferences.d,etc/sources.list.d,debs} "$root"
  {
    echo "deb [arch=arm64 signed-by=$keyring] $mirror bookworm main"
    echo "deb [arch=arm64 signed-by=$keyring] $mirror bookworm-updates main"
    echo "deb [arch=arm64 signed-by=$keyring] $security bookworm-security main"
  } >"$apt_dir/etc/sources.list"
  : >"$apt_dir/status"
  apt_opts=(-o "Dir::Etc=$apt_dir/etc" -o "Dir::State=$apt_dir" -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir" -o "Dir::Cache::archives=$apt_dir/archives" -o "Dir::State::status=$apt_dir/status"
    -o APT::Architecture=arm64 -o APT::Architectures::=arm64 -o Debug::NoLocking=1)
  if [ "$(id -u)" = 0 ]; then apt_opts+=(-o APT::Sandbox::User=root); fi
  say "reading Debian 12's arm64 package index ($mirror, $security; signed) ..."
  apt-get "${apt_opts[@]}" update -qq >"$apt_dir/update.log" 2>&1 \
    || { cat "$apt_dir/update.log" >&2; die "could not read Debian 12's package index (network? DEEPEP_DEBIAN_MIRROR names another mirror)"; }
  say "downloading ${pkgs[*]} (arm64) ..."
  (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" download -qq "${pkgs[@]}" >"$apt_dir/download.log" 2>&1) \
    || { cat "$apt_dir/download.log" >&2; die "apt-get download from Debian 12 failed (above)"; }
  for d in "$apt_dir/debs"/*.deb; do dpkg-deb -x "$d" "$root"; done
  ls "$apt_dir/debs" | sed 's/_arm64\.deb$//' >"$root/debs.txt"
  rm -rf "$apt_dir" "$root/usr/share/doc" "$root/usr/share/man"
  "$qemu" -L "$root" "$root/usr/bin/python3.11" -c 'import ssl, ctypes, platform; print(platform.machine(), platform.python_version())' \
    >"$root/.check" 2>&1 || { cat "$root/.check" >&2; die "the unpacked arm64 python3.11 does not start under $qemu (above)"; }
  mv "$root/.check" "$root/.complete"
fi
# sys.executable is this wrapper (qemu's -0 sets argv[0], from which CPython takes it), so tests
# that start `sys.executable` in a subprocess run arm64 Python too, without binfmt_misc.
printf '#!/bin/sh\nexec "%s" -L "%s" -0 "$0" "%s" "$@"\n' "$qemu" "$root" "$root/usr/bin/python3.11" >"$root/usr/bin/python3-qemu"
chmod +x "$root/usr/bin/python3-qemu"
py=("$root/usr/bin/python3-qemu")
say "$(cat "$root/.complete") under $("$qemu" --version | head -n1)"

# 2. numpy + pytest for cp311 aarch64.
site=$dir/site
if [ ! -f "$site/.complete" ]; then
  rm -rf "$site"
  say "pip install --target $site --platform manylinux2014_aarch64: numpy==2.2.6 pytest==9.2.0 ..."
  python3 -m pip install --quiet --no-compile --target "$site" --only-binary=:all: --implementation cp --python-version 3.11 \
    --abi cp311 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 --platform any numpy==2.2.6 pytest==9.2.0 \
    || die "pip install of numpy/pytest for aarch64 failed (above)"
  touch "$site/.complete"
fi

# 3. The wheel, unpacked (a wheel is a zip; an abi3 wheel has nothing to compile).
whl_site=$dir/wheel-site
rm -rf "$whl_site"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$whl_site"
file_of=$(find "$whl_site/deepep_kernels" -name '_native*.so' 2>/dev/null | head -n1 || true)
[ -n "$file_of" ] || die "$wheel has no deepep_kernels/_native*.so"

# 4. pytest under qemu, from python/ (its conftest keeps the source tree off sys.path; the
#    unpacked wheel comes first on PYTHONPATH).
junit=$dir/junit.xml
rm -f "$junit"
say "pytest under qemu: python/tests (not tests/gpu) against $(basename "$wheel")"
start=$(date +%s)
start_hm=$(date -u +%H:%M)
set +e
# Left out: the doctor test runs this machine's (x86_64) deepep-nix on the installed extension,
# which it rightly refuses as one for another machine (deepep-kernels.package); the doctor's
# architecture check has its own tests (generator/tests/doctor.rs).
# PYTHON: the scripts the tests start (python/scripts/deepep-conformance.sh) run arm64 Python too.
(cd "$repo/python" && PYTHONPATH="$whl_site:$site" PYTHON="${py[0]}" PYTHONDONTWRITEBYTECODE=1 DEEPEP_KERNELS_WHEEL="$wheel" \
  "${py[@]}" -m pytest -q -rs -p no:cacheprovider --junitxml="$junit" tests --ignore=tests/gpu \
  --deselect tests/test_wheel.py::test_doctor_recognises_the_installed_wheel "${pytest_args[@]}")
rc=$?
set -e
say "pytest exit $rc after $(($(date +%s) - start)) s"
if [ "$record" = 1 ]; then
  [ -f "$junit" ] || die "pytest wrote no JUnit XML; nothing to record"
  # One row: passed/failed/skipped counts and the first failure from pytest's JUnit XML.
  row=$(python3 - "$junit" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = sum(int(s.get("tests", 0)) for s in suites)
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skip = sum(int(s.get("skipped", 0)) for s in suites)
secs = sum(float(s.get("time", 0)) for s in suites)
first = ""
for case in root.iter("testcase"):
    for f in list(case.findall("failure")) + list(case.findall("error")):
        first = f"{case.get('classname')}.{case.get('name')}: {(f.get('message') or '').splitlines()[0] if f.get('message') else ''}"[:240]
        break
    if first:
        break
status = "fail" if bad or n == 0 else "pass"
counts = f"{n - bad - skip} passed, {bad} failed, {skip} skipped"
# a fail row's detail is its first error (scripts/results.py): the counts go in front of it
detail = f"{counts}; first: {first}" if status == "fail" else counts
print(f"python/tests (aarch64 wheel, qemu-user):0:{status}:{secs:.1f}:{detail if n else 'no tests ran'}")
PY
  ) || die "cannot read $junit"
  python3 "$repo/scripts/results.py" new --kind gpu-tests --slug aarch64-qemu-cpu-tests --commit "$(git -C "$repo" rev-parse HEAD)" \
    --machine "x86_64 build host, $("$qemu" --version | head -n1), Debian 12 arm64 CPython $(cut -d' ' -f2 "$root/.complete"), no GPU" \
    --machine-kind cpu --time "$start_hm" --command "python/scripts/aarch64-qemu-test.sh --record $(basename "$wheel")" --result "$row" \
    --notes "The aarch64 wheel ($(basename "$wheel"), $(stat -c %s "$wheel") bytes) built by python/scripts/build-wheel.sh --target aarch64; its CPU tests (python/tests without tests/gpu) under qemu-user. No GPU: no kernel ran." \
    || die "scripts/results.py could not write the record (above)"
fi
exit $rc
