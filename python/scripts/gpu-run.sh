#!/usr/bin/env bash
# Run the deepep_kernels GPU tests on the GPU machine (torch with CUDA and pytest installed there,
# no network, no Rust needed).
#
# Usage: python/scripts/gpu-run.sh WHEEL_OR_DIR [RANKS...] | --help
#   WHEEL_OR_DIR  the deepep_kernels-*-cp310-abi3-*.whl built by python/scripts/build-wheel.sh
#                 (or the folder holding it, e.g. target/wheels)
#   RANKS         rank counts to run (default: 2 4 8). 2 ranks use up to two GPUs; 4 and 8 ranks
#                 run on ONE GPU (oversubscribed; DEEPEP_TEST_GPUS=1), exchanging through gloo.
# Environment: PYTHON (default python3), DEEPEP_TEST_TIMEOUT_S (per rank count, default 300),
#   DEEPEP_BENCH=1 (also run python/scripts/bench.py at 2 ranks into $OUT/bench.log),
#   PYTEST_ARGS (extra pytest arguments for the GPU tests, e.g. "-k intranode"),
#   SKIP_CPU_EXAMPLE=1 (skip the CPU tests and the example after the GPU tests),
#   MPS=1 (each rank count under its own private MPS server, stopped after it: spin-waiting
#   kernels of several ranks on one GPU progress far faster under MPS; default 0, time-sliced),
#   RECORD=1 (also write a gpu-tests record of the GPU tests into $OUT, as deepep-conformance.sh
#   does: RECORD_SLUG, RECORD_COMMIT, the knobs set named in its command; kernels/TESTING.md,
#   "Results as data"),
#   OUT (logs go there; default ./gpu-run-logs). Any variable the kernels read (e.g. the
#   ranks-per-GPU setting of the oversubscribed mode, DEEPEP_GPU_TIMEOUT_MS) passes through.
# The wheel is installed with pip --no-index --no-deps into a fresh --target folder, which is put
# first on PYTHONPATH; the machine's torch is used as is. --help prints this text and exits 0
# (nothing installed, no log folder made); no arguments print it and exit 2.
set -uo pipefail
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "${BASH_SOURCE[0]}"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; -*) echo "gpu-run: unknown option '$1' (the first argument is the wheel or its folder; see --help)" >&2; exit 2 ;; esac
invocation="python/scripts/gpu-run.sh $*"  # results.py puts the knobs set for the run before it
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tests="$here/../tests"
py=${PYTHON:-python3}
[ $# -ge 1 ] || { usage >&2; exit 2; }
src=$1; shift
if [ -d "$src" ]; then
  wheel=$(ls "$src"/deepep_kernels-*-cp310-abi3-*.whl 2>/dev/null | head -n1)
else
  wheel=$src
fi
[ -n "${wheel:-}" ] && [ -f "$wheel" ] || { echo "gpu-run: no deepep_kernels wheel at '$src'; build one with python/scripts/build-wheel.sh" >&2; exit 2; }
ranks=("$@"); [ ${#ranks[@]} -gt 0 ] || ranks=(2 4 8)
out=${OUT:-$PWD/gpu-run-logs}
mkdir -p "$out"
site=$(mktemp -d /tmp/deepep-site.XXXXXX)
echo "gpu-run: installing $wheel into $site" | tee "$out/summary.txt"
"$py" -m pip install --no-index --no-deps --target "$site" "$wheel" >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY' 2>&1 | tee -a "$out/summary.txt"
import torch, deepep_kernels, deepep_kernels._native as n
print("deepep_kernels", deepep_kernels.__version__, "from", deepep_kernels.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("cubins sm90:", n.is_sm90_compiled(), "NVSHMEM device lib:", n.nvshmem_device_version())
PY
timeout_s=${DEEPEP_TEST_TIMEOUT_S:-300}
rc=0
for r in "${ranks[@]}"; do
  if [ "$r" -le 2 ]; then gpus=${DEEPEP_TEST_GPUS:-2}; else gpus=1; fi
  log="$out/gpu-ranks$r.log"
  echo "== $r ranks on $gpus GPU(s), limit ${timeout_s}s -> $log" | tee -a "$out/summary.txt"
  if [ "${MPS:-0}" = 1 ]; then  # a private server: its pipe and log folders are this run's own
    export CUDA_MPS_PIPE_DIRECTORY="$site/mps-$r" CUDA_MPS_LOG_DIRECTORY="$out/mps-ranks$r"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" && nvidia-cuda-mps-control -d \
      || { echo "gpu-run: MPS=1 but the MPS server did not start (nvidia-cuda-mps-control)" >&2; exit 1; }
  fi
  DEEPEP_TEST_RANKS=$r DEEPEP_TEST_GPUS=$gpus timeout -k 10 "$timeout_s" \
    "$py" -m pytest -v -rs -p no:cacheprovider ${PYTEST_ARGS:-} "$tests/gpu" >"$log" 2>&1
  code=$?
  if [ "${MPS:-0}" = 1 ]; then echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; fi
  [ $code -eq 124 ] && echo "   timed out after ${timeout_s}s" | tee -a "$out/summary.txt"
  tail -n 3 "$log" | tee -a "$out/summary.txt"
  [ $code -eq 0 ] || rc=1
done
if [ "${SKIP_CPU_EXAMPLE:-0}" != 1 ]; then
"$py" -m pytest -q -p no:cacheprovider "$tests" --ignore="$tests/gpu" >"$out/cpu-tests.log" 2>&1 || rc=1
echo "cpu tests: $(tail -n1 "$out/cpu-tests.log")" | tee -a "$out/summary.txt"
echo "== example: python/examples/moe_deep_ep.py written for deep_ep, through the shim, 2 ranks -> $out/example.log" | tee -a "$out/summary.txt"
PYTHONPATH="$("$py" -m deepep_kernels.shim):$PYTHONPATH" timeout -k 10 "$timeout_s" \
  "$py" -m torch.distributed.run --standalone --nproc-per-node 2 "$here/../examples/moe_deep_ep.py" >"$out/example.log" 2>&1 || rc=1
grep -E "^rank|Error|error" "$out/example.log" | tail -n 6 | tee -a "$out/summary.txt"
fi
if [ "${DEEPEP_BENCH:-0}" = 1 ]; then
  echo "== bench (2 ranks) -> $out/bench.log" | tee -a "$out/summary.txt"
  timeout -k 10 "$timeout_s" "$py" "$here/bench.py" --ranks 2 >"$out/bench.log" 2>&1 || rc=1
  cat "$out/bench.log" | tail -n 12 | tee -a "$out/summary.txt"
fi
if [ "${RECORD:-0}" = 1 ]; then
  "$py" "$here/../../scripts/results.py" from-pytest "$out"/gpu-ranks*.log --out "$out" --machine auto \
    --commit "${RECORD_COMMIT:-$(git -C "$here" rev-parse HEAD 2>/dev/null)}" --command "$invocation" \
    --slug "${RECORD_SLUG:-run}" || rc=1
fi
rm -rf "$site"
exit $rc
