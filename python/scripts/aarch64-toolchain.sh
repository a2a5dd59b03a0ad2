#!/usr/bin/env bash
# Make this x86_64 Debian machine able to cross-build the aarch64-linux wheel
# (python/scripts/build-wheel.sh --target aarch64) and print the environment for it.
#
# Usage: python/scripts/aarch64-toolchain.sh [--dir DIR] [--nvshmem-releases LIST] [--print-env] [--help]
#   --dir DIR     where to keep the aarch64 NVSHMEM prefixes (default: $DEEPEP_AARCH64_DIR, else
#                 target/tools/aarch64 in the checkout); complete ones there are reused
#   --nvshmem-releases LIST
#                 NVSHMEM releases to fetch as aarch64 prefixes (comma separated; default
#                 3.4.5,3.3.20: the releases of scripts/install-toolchain.sh, so the aarch64 wheel
#                 serves what the x86_64 one does); the first becomes NVSHMEM_DIR
#   --print-env   only print the environment (fails naming what is missing)
#
# What it sets up, and why:
# 1. Rust's standard library for aarch64-unknown-linux-gnu (`rustup target add`; the host's
#    cargo and rustc compile for it).
# 2. The linker: Debian's gcc-aarch64-linux-gnu with libc6-dev-arm64-cross (apt-get install,
#    needs root; skipped when aarch64-linux-gnu-gcc is on PATH). Debian 12's glibc 2.36 headers,
#    but the extension only needs symbols up to what maturin's manylinux check reports.
# 3. NVSHMEM for aarch64: the nvidia-nvshmem-cu13 aarch64 wheels from PyPI (pip download
#    --platform manylinux2014_aarch64), of which include/ and lib/libnvshmem_device.a are
#    unpacked into DIR/nvshmem/<version>. The members of libnvshmem_device.a are aarch64 host
#    objects that carry the device code, and an x86_64 nvlink skips them unless told
#    -cpu-arch=AARCH64 (kernels/build.rs does so for an aarch64 target); whether the device
#    code itself differs from the x86_64 wheel's: docs/architecture.md.
# nvcc stays the x86_64 pip toolchain of scripts/install-toolchain.sh (cubins do not depend on
# the host CPU).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=${DEEPEP_AARCH64_DIR:-$repo/target/tools/aarch64}
releases=3.4.5,3.3.20
print_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) [ $# -ge 2 ] || { echo "aarch64-toolchain: --dir needs a folder" >&2; exit 2; }; dir=$2; shift ;;
    --nvshmem-releases)
      [ $# -ge 2 ] || { echo "aarch64-toolchain: --nvshmem-releases needs versions like 3.4.5,3.3.20" >&2; exit 2; }
      releases=$2; shift ;;
    --print-env) print_only=1 ;;
    -h|--help) sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "aarch64-toolchain: unknown argument '$1' (use --dir DIR, --nvshmem-releases LIST, --print-env or --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$releases" =~ ^[0-9]+\.[0-9]+\.[0-9]+(,[0-9]+\.[0-9]+\.[0-9]+)*$ ]] \
  || { echo "aarch64-toolchain: --nvshmem-releases takes versions like 3.4.5,3.3.20; got '$releases'" >&2; exit 2; }
IFS=, read -r -a versions <<< "$releases"
die() { echo "aarch64-toolchain: error: $*" >&2; exit 1; }
say() { echo "aarch64-toolchain: $*" >&2; }
target=aarch64-unknown-linux-gnu
have_std() { local d; d=$(rustc --print target-libdir --target "$target" 2>/dev/null) && [ -d "$d" ]; }

print_env() {
  local nvs=() v
  have_std || die "rustc has no $target standard library; run python/scripts/aarch64-toolchain.sh (rustup target add $target)"
  command -v aarch64-linux-gnu-gcc >/dev/null || die "aarch64-linux-gnu-gcc not on PATH; run python/scripts/aarch64-toolchain.sh (apt-get install gcc-aarch64-linux-gnu)"
  for v in "${versions[@]}"; do
    [ -f "$dir/nvshmem/$v/nvidia/nvshmem/lib/libnvshmem_device.a" ] || die "no aarch64 NVSHMEM $v in $dir/nvshmem/$v; run python/scripts/aarch64-toolchain.sh --nvshmem-releases $releases"
    nvs+=("$dir/nvshmem/$v/nvidia/nvshmem")
  done
  local extra
  extra=$(IFS=:; echo "${nvs[*]:1}")
  echo "export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc NVSHMEM_DIR=${nvs[0]} DEEPEP_NVSHMEM_RELEASES=$extra"
}
if [ "$print_only" = 1 ]; then print_env; exit 0; fi

[ "$(uname -m)" = x86_64 ] || die "this cross build is set up for an x86_64 (amd64) build machine; this is $(uname -m)"
command -v python3 >/dev/null || die "python3 not found (pip downloads the aarch64 NVSHMEM wheels)"

# 1. Rust's standard library for the target (rustup; cargo and rustc stay the host's).
if ! have_std; then
  command -v rustup >/dev/null || die "rustc has no aarch64-unknown-linux-gnu standard library and rustup is not on PATH. Fix: install Rust with rustup (https://rustup.rs), then run this again"
  say "rustup target add $target ..."
  rustup target add "$target" >&2 || die "rustup target add $target failed (above; it downloads from static.rust-lang.org)"
fi

# 2. The cross linker.
mkdir -p "$dir"
if ! command -v aarch64-linux-gnu-gcc >/dev/null; then
  [ "$(id -u)" = 0 ] || die "aarch64-linux-gnu-gcc is missing and installing it needs root: apt-get install gcc-aarch64-linux-gnu"
  say "installing Debian's gcc-aarch64-linux-gnu (apt-get) ..."
  apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross >"$dir/apt-gcc.log" 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross >"$dir/apt-gcc.log" 2>&1; } \
    || { cat "$dir/apt-gcc.log" >&2; die "apt-get install gcc-aarch64-linux-gnu failed (above)"; }
fi

# 3. NVSHMEM aarch64 prefixes from PyPI.
mkdir -p "$dir/nvshmem/wheels"
for v in "${versions[@]}"; do
  prefix=$dir/nvshmem/$v
  [ -f "$prefix/nvidia/nvshmem/lib/libnvshmem_device.a" ] && continue
  if ! ls "$dir/nvshmem/wheels/nvidia_nvshmem_cu13-$v-"*aarch64*.whl >/dev/null 2>&1; then
    say "downloading nvidia-nvshmem-cu13 $v for aarch64 ..."
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 --python-version 3.11 --implementation py --abi none \
      -d "$dir/nvshmem/wheels" "nvidia-nvshmem-cu13==$v" || die "pip download of nvidia-nvshmem-cu13==$v (aarch64) failed"
  fi
  whl=$(ls "$dir/nvshmem/wheels/nvidia_nvshmem_cu13-$v-"*aarch64*.whl | head -n1)
  # The lock (pkgs/nvshmem/releases.json) pins each wheel's name and sha256: pip's choice is
  # checked against it, so the aarch64 wheel links exactly what the Nix side pins.
  python3 - "$repo/pkgs/nvshmem/releases.json" "$v" "$whl" <<'PY' || { rm -f "$whl"; die "nvidia-nvshmem-cu13 $v (aarch64): the downloaded wheel is not the one pinned in pkgs/nvshmem/releases.json (above); it was deleted"; }
import hashlib, json, os, sys
lock, v, whl = sys.argv[1:]
pins = [r["systems"]["aarch64-linux"]["13"]["pypi"] for r in json.load(open(lock))["releases"]
        if r["version"] == v and r.get("systems", {}).get("aarch64-linux", {}).get("13", {}).get("pypi")]
if not pins:
    sys.exit(f"NVSHMEM {v} has no CUDA 13 aarch64 PyPI wheel in {lock}")
pin = pins[0]
got = hashlib.sha256(open(whl, "rb").read()).hexdigest()
if os.path.basename(whl) != pin["filename"] or got != pin["sha256"]:
    sys.exit(f"{os.path.basename(whl)} sha256 {got}; the lock pins {pin['filename']} sha256 {pin['sha256']}")
PY
  rm -rf "$prefix.tmp"
  python3 - "$whl" "$prefix.tmp" <<'PY' || die "unpacking $whl failed"
import sys, zipfile
whl, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if ".." in n.split("/"):
            continue
        if n.startswith("nvidia/nvshmem/include/") or n in ("nvidia/nvshmem/lib/libnvshmem_device.a", "nvidia/nvshmem/lib/libnvshmem_host.so.3"):
            z.extract(n, dest)
PY
  mv "$prefix.tmp" "$prefix"
done
print_env
