#!/usr/bin/env bash
# Build the deepep_kernels wheel (PyO3 + maturin, abi3 for CPython >= 3.9, x86_64) and,
# optionally, install it into a test venv and run the CPU tests.
#
# Usage: python/scripts/build-wheel.sh [--release|--dev] [--test] [--help]
#   --release  optimized build (the default; what the GPU machine should run)
#   --dev      debug profile (reuses the `cargo test` build of deepep-kernels; CI uses it)
#   --test     also install the wheel into target/pyvenv and run python/tests (no GPU, no torch)
#
# Needs: the pinned CUDA/NVSHMEM pip toolchain (scripts/install-toolchain.sh; the cubins are
# built into the extension), python3 with venv, network to PyPI the first time (maturin and
# pytest at pinned versions go into target/pyvenv, which git ignores). No torch, no libtorch.
# Output: target/wheels/deepep_kernels-<version>-cp39-abi3-manylinux_*_x86_64.whl
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
profile=(--release)
run_tests=0
for a in "$@"; do
  case "$a" in
    --release) profile=(--release) ;;
    --dev) profile=(--profile dev) ;;
    --test) run_tests=1 ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-wheel: unknown argument '$a' (use --release, --dev, --test or --help)" >&2; exit 2 ;;
  esac
done
cd "$repo"
venv="$repo/target/pyvenv"
if [ ! -x "$venv/bin/maturin" ] || [ ! -x "$venv/bin/pytest" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet maturin==1.16.0 pytest==9.2.0
fi
if [ -z "${CUDA_HOME:-}" ] || [ -z "${NVSHMEM_DIR:-}" ]; then
  eval "$(bash scripts/install-toolchain.sh --print-env)"
  export CUDA_HOME NVSHMEM_DIR
fi
rm -f "$repo"/target/wheels/deepep_kernels-*.whl
(cd python && "$venv/bin/maturin" build "${profile[@]}" --locked -o "$repo/target/wheels")
wheel=$(ls "$repo"/target/wheels/deepep_kernels-*-cp39-abi3-*.whl)
echo "wheel: $wheel"
if [ "$run_tests" = 1 ]; then
  "$venv/bin/pip" install --quiet --force-reinstall --no-deps "$wheel"
  # from python/ so that pytest finds its config; conftest.py keeps the source tree off sys.path
  (cd python && "$venv/bin/python" -m pytest -q -rs tests --ignore=tests/gpu)
fi
