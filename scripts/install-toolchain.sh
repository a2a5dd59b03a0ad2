#!/usr/bin/env bash
# Install the pinned CUDA 13.0 compiler + NVSHMEM 3.4.5 from pip wheels into <repo>/.toolchain
# (git-ignored), for building the deepep-kernels cubins on a machine without a CUDA toolkit or GPU.
#
# Usage: scripts/install-toolchain.sh [--print-env] [--help]
#   (no flag)    download the wheels into .toolchain/wheels/ (skipped when already there), install
#                them into .toolchain/ (skipped when the install stamp matches), then print the
#                environment to export.
#   --print-env  only print the environment lines (fails if the toolchain is not installed).
#
# Typical use:  eval "$(scripts/install-toolchain.sh | grep '^export ')"
#
# The versions must match what the GPU machine runs: NVSHMEM device library linked into the cubins
# == libnvshmem_host.so.3 at run time (3.4.5, torch 2.11's), nvcc 13.0 for the CUDA 13.0 / 580 driver.
# A second NVSHMEM release (3.3.20, the oldest CUDA 13 one) goes into .toolchain/extra/nvshmem-3.3.20
# and is printed as DEEPEP_NVSHMEM_RELEASES, so that every build and test here embeds and checks
# cubins for two releases (kernels/tests/nvshmem_releases.rs, nvshmem_preloaded.rs).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tc="$repo/.toolchain"
wheels="$tc/wheels"
stamp="$tc/.installed"

pins=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-nvshmem-cu13==3.4.5
  # cuobjdump for kernels/tests/cubin_listing.rs (every kernel of every embedded cubin, per
  # architecture and release); PyPI has no 13.0 build of it (the first is 13.2), and 13.2 reads
  # 13.0's cubins. Only bin/cuobjdump, nothing of the 13.0 compiler is replaced.
  nvidia-cuda-cuobjdump==13.2.86
)
extra_release=3.3.20
extra="$tc/extra/nvshmem-$extra_release"

die() { echo "install-toolchain: error: $*" >&2; exit 1; }

print_env() {
  local cu="$tc/nvidia/cu13" nvs="$tc/nvidia/nvshmem" whl
  [[ -x "$cu/bin/nvcc" ]] || die "no nvcc at $cu/bin/nvcc; run scripts/install-toolchain.sh without --print-env first"
  [[ -f "$nvs/lib/libnvshmem_device.a" ]] || die "no NVSHMEM device library at $nvs/lib; run scripts/install-toolchain.sh without --print-env first"
  whl="$(ls "$wheels"/nvidia_nvshmem_cu13-3.4.5-*x86_64*.whl 2>/dev/null | head -n1 || true)"
  [[ -n "$whl" ]] || die "the NVSHMEM 3.4.5 x86_64 wheel is missing from $wheels; run scripts/install-toolchain.sh without --print-env"
  [[ -f "$extra/nvidia/nvshmem/lib/libnvshmem_device.a" ]] || die "no NVSHMEM $extra_release at $extra; run scripts/install-toolchain.sh without --print-env first"
  echo "export CUDA_HOME=$cu NVSHMEM_DIR=$nvs DEEPEP_NVSHMEM_WHEEL=$whl DEEPEP_NVSHMEM_RELEASES=$extra/nvidia/nvshmem"
}

case "${1:-}" in
  --print-env) print_env; exit 0 ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
  "") ;;
  *) die "unknown argument '$1' (use --print-env or --help)" ;;
esac

command -v python3 >/dev/null || die "python3 not found; install Python 3 with pip (e.g. apt-get install python3-pip)"
python3 -m pip --version >/dev/null 2>&1 || die "pip not available for python3; install it (apt-get install python3-pip)"

want="$(printf '%s\n' "${pins[@]}" "nvidia-nvshmem-cu13==$extra_release (extra)")"
mkdir -p "$wheels"

# 1. Download (only wheels that are not already present). Linux x86_64 wheels, whatever the host.
missing=()
for p in "${pins[@]}" "nvidia-nvshmem-cu13==$extra_release"; do
  name="${p%%==*}"; ver="${p##*==}"
  if ! ls "$wheels/${name//-/_}-$ver-"*x86_64*.whl >/dev/null 2>&1; then missing+=("$p"); fi
done
if ((${#missing[@]})); then
  echo "install-toolchain: downloading ${missing[*]} into $wheels" >&2
  # One requirement per call: pip's resolver refuses two versions of one package in one call
  # (nvidia-nvshmem-cu13 3.4.5 and the extra 3.3.20: "ResolutionImpossible").
  for p in "${missing[@]}"; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
      --python-version 3.11 --implementation py --abi none \
      -d "$wheels" "$p" \
      || die "pip download of $p failed; check network access to the Python package index (or copy the wheels into $wheels)"
  done
fi

# 2. Install from the local wheels (idempotent: the stamp records the pin list).
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$tc/nvidia/cu13/bin/nvcc" ]]; then
  echo "install-toolchain: already installed in $tc" >&2
else
  files=()
  for p in "${pins[@]}"; do
    name="${p%%==*}"; ver="${p##*==}"
    f="$(ls "$wheels/${name//-/_}-$ver-"*x86_64*.whl | head -n1)"
    files+=("$f")
  done
  rm -f "$stamp"
  echo "install-toolchain: installing into $tc" >&2
  python3 -m pip install --quiet --no-deps --upgrade --target "$tc" "${files[@]}" \
    || die "pip install into $tc failed"
  rm -rf "$extra"
  python3 -m pip install --quiet --no-deps --target "$extra" "$(ls "$wheels"/nvidia_nvshmem_cu13-$extra_release-*x86_64*.whl | head -n1)" \
    || die "pip install of NVSHMEM $extra_release into $extra failed"
  # The per-architecture bitcode is not needed to link cubins (about 60 MB of disk saved).
  rm -f "$extra"/nvidia/nvshmem/lib/*.bc
  [[ -x "$tc/nvidia/cu13/bin/nvcc" ]] || die "nvcc missing after install ($tc/nvidia/cu13/bin/nvcc)"
  printf '%s\n' "$want" > "$stamp"
fi

"$tc/nvidia/cu13/bin/nvcc" --version | tail -n2 >&2
print_env
