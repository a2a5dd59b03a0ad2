#!/usr/bin/env bash
# Build the deepep_kernels wheel (PyO3 + maturin, abi3 for CPython >= 3.10, x86_64 or aarch64)
# and, optionally, install it into a test venv and run the CPU tests.
#
# Usage: python/scripts/build-wheel.sh [--release|--dev] [--target x86_64|aarch64] [--nvshmem-releases LIST] [--test] [--help]
#   --release  optimized build (the default; what the GPU machine should run); reproducible:
#              the same bytes from any checkout path of one commit (check-reproducible.sh)
#   --dev      debug profile (reuses the `cargo test` build of deepep-kernels; CI uses it), written
#              to target/wheels-dev/ so that it never stands in for a release wheel
#   --nvshmem-releases LIST
#              NVSHMEM releases to embed cubins for besides NVSHMEM_DIR's: `all` (every CUDA 13
#              release of the lock, 3.3.20 to 3.8.0: the wheel to publish), a comma-separated
#              list (3.3.20,3.8.0), or `none` (the default: NVSHMEM_DIR's release only, unless
#              DEEPEP_NVSHMEM_RELEASES names prefixes). Each is installed into .toolchain/nvshmem/
#              with python/scripts/nvshmem-prefixes.sh (deepep-nix install --source pypi) first.
#   --target aarch64
#              cross-build the aarch64-linux wheel (Grace: GH200, GB200, GB300) on this x86_64
#              machine: python/scripts/aarch64-toolchain.sh sets up Rust's aarch64 target, Debian's
#              cross gcc and aarch64 NVSHMEM prefixes (NVSHMEM_DIR / DEEPEP_NVSHMEM_RELEASES then
#              name those; `none` serves 3.4.5 and 3.3.20 like the x86_64 default); nvcc is the
#              x86_64 one. `x86_64` (the default) builds for this machine.
#   --test     also install the wheel into target/pyvenv and run python/tests (no GPU, no torch);
#              with --target aarch64: under qemu-user (python/scripts/aarch64-qemu-test.sh)
#
# Needs: python3 with venv, a C compiler, network to PyPI the first time. The pinned CUDA 13.0 /
# NVSHMEM 3.4.5 pip toolchain is installed into .toolchain/ first when missing
# (scripts/install-toolchain.sh; CUDA_HOME / NVSHMEM_DIR, when set, are used instead); maturin and
# pytest and numpy (the CPU tests pass real arrays to the native checks through DLPack) at pinned
# versions go into target/pyvenv. No torch, no libtorch, no GPU.
# Output: target/wheels/deepep_kernels-<version>-cp310-abi3-manylinux_*_<x86_64|aarch64>.whl
# (--dev: target/wheels-dev/)
# (stripped; building one architecture leaves the other's wheel in place)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
profile=(--release)
release=1
run_tests=0
nvs_releases=none
arch=x86_64
while [ $# -gt 0 ]; do
  case "$1" in
    --release) profile=(--release); release=1 ;;
    --dev) profile=(--profile dev); release=0 ;;
    --test) run_tests=1 ;;
    --nvshmem-releases)
      [ $# -ge 2 ] || { echo "build-wheel: --nvshmem-releases needs all, none or a comma-separated list like 3.3.20,3.8.0" >&2; exit 2; }
      nvs_releases=$2; shift ;;
    --target)
      [ $# -ge 2 ] || { echo "build-wheel: --target needs x86_64 or aarch64" >&2; exit 2; }
      case "$2" in
        x86_64|x86_64-unknown-linux-gnu) arch=x86_64 ;;
        aarch64|arm64|aarch64-unknown-linux-gnu) arch=aarch64 ;;
        *) echo "build-wheel: --target takes x86_64 or aarch64; got '$2'" >&2; exit 2 ;;
      esac
      shift ;;
    -h|--help) sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-wheel: unknown argument '$1' (use --release, --dev, --target ARCH, --nvshmem-releases LIST, --test or --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$nvs_releases" in
  all|none) ;;
  *) [[ "$nvs_releases" =~ ^[0-9]+\.[0-9]+\.[0-9]+(,[0-9]+\.[0-9]+\.[0-9]+)*$ ]] \
       || { echo "build-wheel: --nvshmem-releases takes all, none or versions like 3.3.20,3.8.0; got '$nvs_releases'" >&2; exit 2; } ;;
esac
die() { echo "build-wheel: error: $*" >&2; exit 1; }
cd "$repo"

# 1. The CUDA toolchain, before anything is compiled: a missing nvcc is found (and installed) in
#    the first second, not after minutes of compiling Rust crates.
if [ -z "${CUDA_HOME:-}" ] || [ -z "${NVSHMEM_DIR+set}" ]; then
  if ! tc_env=$(bash scripts/install-toolchain.sh --print-env 2>/dev/null); then
    echo "build-wheel: the pinned CUDA 13.0 / NVSHMEM 3.4.5 toolchain is not in .toolchain/;" \
      "installing it: scripts/install-toolchain.sh (pip wheels, about 350 MB, once)" >&2
    tc_env=$(bash scripts/install-toolchain.sh) \
      || die "scripts/install-toolchain.sh failed (above). Fix that, or export CUDA_HOME=<CUDA 13.0 toolkit> NVSHMEM_DIR=<NVSHMEM 3.4.5 prefix> and run this again"
  fi
  # Only what the caller left unset comes from .toolchain/ (NVSHMEM_DIR= builds without NVSHMEM).
  user_cuda=${CUDA_HOME:-}
  user_nvshmem_set=${NVSHMEM_DIR+set}
  user_nvshmem=${NVSHMEM_DIR:-}
  user_releases_set=${DEEPEP_NVSHMEM_RELEASES+set}
  user_releases=${DEEPEP_NVSHMEM_RELEASES:-}
  eval "$(printf '%s\n' "$tc_env" | grep '^export ')"
  if [ -n "$user_cuda" ]; then CUDA_HOME=$user_cuda; fi
  if [ -n "$user_nvshmem_set" ]; then NVSHMEM_DIR=$user_nvshmem; fi
  # The toolchain's second release (DEEPEP_NVSHMEM_RELEASES) goes with the toolchain's NVSHMEM_DIR only.
  if [ -n "$user_releases_set" ]; then DEEPEP_NVSHMEM_RELEASES=$user_releases
  elif [ -n "$user_nvshmem_set" ]; then DEEPEP_NVSHMEM_RELEASES=""; fi
fi
export CUDA_HOME NVSHMEM_DIR
cargo_target=()
if [ "$arch" = aarch64 ]; then
  [ "$(uname -m)" = x86_64 ] || die "--target aarch64 is a cross build from an x86_64 machine; this is $(uname -m) (build natively without --target)"
  # The aarch64 NVSHMEM prefixes replace the x86_64 toolchain's: nvlink takes the device code out
  # of libnvshmem_device.a's aarch64 host objects (kernels/build.rs). NVSHMEM_DIR is 3.4.5.
  case "$nvs_releases" in
    none) a64=3.4.5,3.3.20 ;;
    all) a64=3.4.5,$(python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); print(",".join(sorted((r["version"] for r in l["releases"] if r.get("systems", {}).get("aarch64-linux", {}).get("13", {}).get("pypi") and r["version"] != "3.4.5"), key=lambda v: tuple(map(int, v.split("."))))))' pkgs/nvshmem/releases.json) ;;
    *) a64=3.4.5,$nvs_releases ;;
  esac
  a64_env=$(bash "$repo/python/scripts/aarch64-toolchain.sh" --nvshmem-releases "$a64") \
    || die "python/scripts/aarch64-toolchain.sh failed (above)"
  eval "$a64_env"
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER CC_aarch64_unknown_linux_gnu NVSHMEM_DIR DEEPEP_NVSHMEM_RELEASES
  nvs_releases=none
  cargo_target=(--target aarch64-unknown-linux-gnu)
fi
[ -x "$CUDA_HOME/bin/nvcc" ] \
  || die "no nvcc at $CUDA_HOME/bin/nvcc (CUDA_HOME=$CUDA_HOME). Fix: unset CUDA_HOME to use the pinned toolchain (this script installs it into .toolchain/), or point CUDA_HOME at a CUDA 13.0 toolkit"
if [ -n "$NVSHMEM_DIR" ] && [ ! -f "$NVSHMEM_DIR/lib/libnvshmem_device.a" ]; then
  die "no lib/libnvshmem_device.a in NVSHMEM_DIR=$NVSHMEM_DIR. Fix: unset NVSHMEM_DIR to use the pinned NVSHMEM 3.4.5 (.toolchain/), point it at an NVSHMEM prefix, or set NVSHMEM_DIR= to build without the NVSHMEM kernels"
fi
echo "build-wheel: CUDA_HOME=$CUDA_HOME NVSHMEM_DIR=${NVSHMEM_DIR:-(empty: no NVSHMEM kernels)}" >&2
if [ "$nvs_releases" != none ]; then
  [ -n "$NVSHMEM_DIR" ] || die "--nvshmem-releases needs NVSHMEM kernels, but NVSHMEM_DIR is empty"
  list=()
  [ "$nvs_releases" = all ] || IFS=, read -r -a list <<< "$nvs_releases"
  line=$(bash "$repo/python/scripts/nvshmem-prefixes.sh" "${list[@]}" | tail -n1) \
    || die "python/scripts/nvshmem-prefixes.sh failed (above); fix that or pass --nvshmem-releases none"
  eval "$line"
fi
export DEEPEP_NVSHMEM_RELEASES=${DEEPEP_NVSHMEM_RELEASES:-}
[ -z "$DEEPEP_NVSHMEM_RELEASES" ] || echo "build-wheel: DEEPEP_NVSHMEM_RELEASES=$DEEPEP_NVSHMEM_RELEASES" >&2

# 2. maturin + pytest + numpy (pinned) in target/pyvenv.
venv="$repo/target/pyvenv"
if [ ! -x "$venv/bin/maturin" ] || [ ! -x "$venv/bin/pytest" ] || ! "$venv/bin/python" -c "import numpy" 2>/dev/null; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || die "python3 -m venv failed; install venv support (apt-get install python3-venv)"
  "$venv/bin/pip" install --quiet maturin==1.16.0 pytest==9.2.0 numpy==2.2.6
fi

# 3. Reproducibility: the wheel's bytes depend on the commit, not on where the checkout is.
#    - Paths rustc embeds (panic locations of crates.io code, files included from OUT_DIR) are
#      remapped: the checkout -> /deepep-nix, $CARGO_HOME -> /cargo. Release: for every crate
#      (CARGO_ENCODED_RUSTFLAGS); dev: for the extension crate only (maturin's rustc arguments),
#      so that CI reuses the `cargo test` build of deepep-kernels (its cubins) instead of
#      compiling everything again; its registry paths then stay, the checkout's do not.
#    - The extension is stripped (pyproject.toml: strip = true; no debug info with paths) and
#      maturin's Rust SBOM (random serial number, build time, checkout path) is off.
#    - Zip entry times: SOURCE_DATE_EPOCH, the commit's time (maturin reads it).
#    - The cubins: kernels/build.rs runs nvlink with -L. (nvlink records its options).
cargo_home=${CARGO_HOME:-$HOME/.cargo}
remaps=()
prefixes=("$repo=/deepep-nix" "$cargo_home=/cargo")
if [ -n "${CARGO_TARGET_DIR:-}" ]; then prefixes+=("$(cd "$CARGO_TARGET_DIR" 2>/dev/null && pwd || echo "$CARGO_TARGET_DIR")=/target"); fi
# rustc applies the last matching --remap-path-prefix: longest (most specific) prefix last.
while IFS= read -r p; do remaps+=("--remap-path-prefix=$p"); done \
  < <(for p in "${prefixes[@]}"; do f=${p%=*}; printf '%d\t%s\n' "${#f}" "$p"; done | sort -n | cut -f2-)
extra_rustc=()
if [ "$release" = 1 ]; then
  if [ -n "${CARGO_ENCODED_RUSTFLAGS:-}" ]; then
    flags=$CARGO_ENCODED_RUSTFLAGS
  else
    # RUSTFLAGS is whitespace-separated; CARGO_ENCODED_RUSTFLAGS (0x1f-separated) takes
    # precedence over it (and over build.rustflags in cargo config files), so the caller's
    # RUSTFLAGS are carried over.
    flags=""
    read -r -a user_flags <<< "${RUSTFLAGS:-}"
    for f in "${user_flags[@]}"; do flags+="${flags:+$'\x1f'}$f"; done
  fi
  for f in "${remaps[@]}"; do flags+="${flags:+$'\x1f'}$f"; done
  export CARGO_ENCODED_RUSTFLAGS="$flags"
else
  extra_rustc=(-- "${remaps[@]}")
fi
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH=$(git -C "$repo" log -1 --format=%ct 2>/dev/null || true)
  if [ -n "$SOURCE_DATE_EPOCH" ]; then export SOURCE_DATE_EPOCH; else unset SOURCE_DATE_EPOCH; fi
fi

# 4. Build.
out_dir=$repo/target/wheels
[ "$release" = 1 ] || out_dir=$repo/target/wheels-dev
rm -f "$out_dir"/deepep_kernels-*-cp310-abi3-*_"$arch".whl
(cd python && "$venv/bin/maturin" build "${profile[@]}" "${cargo_target[@]}" --locked -o "$out_dir" "${extra_rustc[@]}")
wheel=$(ls "$out_dir"/deepep_kernels-*-cp310-abi3-*_"$arch".whl)
echo "wheel: $wheel ($(stat -c %s "$wheel") bytes, sha256 $(sha256sum "$wheel" | cut -d' ' -f1))"
if [ "$run_tests" = 1 ] && [ "$arch" = aarch64 ]; then
  bash "$repo/python/scripts/aarch64-qemu-test.sh" "$wheel"
elif [ "$run_tests" = 1 ]; then
  "$venv/bin/pip" install --quiet --force-reinstall --no-deps "$wheel"
  # from python/ so that pytest finds its config; conftest.py keeps the source tree off sys.path.
  # test_wheel.py inspects the wheel file itself (no checkout path, no debug sections).
  (cd python && DEEPEP_KERNELS_WHEEL="$wheel" "$venv/bin/python" -m pytest -q -rs tests --ignore=tests/gpu)
fi
