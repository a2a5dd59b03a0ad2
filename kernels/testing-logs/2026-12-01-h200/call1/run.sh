#!/usr/bin/env bash
# Diagnostic run 1: reproduce the two findings of issue 13, then the 2-rank suite oversubscribed.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.device-carry/bin/deepep-gpu-tests
source kernels/scripts/gpu-env.sh
export RUST_LOG=warn
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv | tee $OUT/smi.log
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mpsp.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mpsl.XXXX); nvidia-cuda-mps-control -d; }
mps_off() { pkill -9 -f deepep-gpu-tests; sleep 1; echo quit | nvidia-cuda-mps-control; sleep 2; pkill -9 -f nvidia-cuda-mps; cat $CUDA_MPS_LOG_DIRECTORY/* > $OUT/mps-$1.log 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
run() { # tag limit args...
  local tag=$1 lim=$2; shift 2; local t0=$SECONDS
  echo "== $tag: $*" | tee $OUT/$tag.log
  timeout -k 5 $lim "$@" 2>&1 | tee -a $OUT/$tag.log | grep -E "^(ok|FAIL|skip)|passed|error|launcher" | head -60
  echo "== $tag rc=${PIPESTATUS[0]} $((SECONDS-t0)) s" | tee -a $OUT/$tag.log $OUT/summary.log
}
# (a) 8 ranks on one GPU, MPS, whole-GPU grids (what the issue measured) vs share grids
mps_on; DEEPEP_SHARED_GPU_GRIDS=whole DEEPEP_GPU_TIMEOUT_MS=8000 run a-whole-mps 110 $BIN --nproc 8 --ranks-per-gpu 8 --filter intranode/deepep_shape_bf16_cached --case-timeout-s 90; mps_off a-whole
mps_on; DEEPEP_GPU_TIMEOUT_MS=8000 run a-share-mps 90 $BIN --nproc 8 --ranks-per-gpu 8 --filter intranode/deepep_shape --case-timeout-s 80; mps_off a-share
# (b) LL at 2 ranks, MPS, whole-GPU grids
mps_on; DEEPEP_SHARED_GPU_GRIDS=whole DEEPEP_GPU_TIMEOUT_MS=5000 run b-whole-mps 80 $BIN --nproc 2 --ranks-per-gpu 2 --filter ll/bf16/ --case-timeout-s 60; mps_off b-whole
# whole 2-rank suite, share grids, MPS
mps_on; run suite-n2-mps 230 $BIN --nproc 2 --ranks-per-gpu 2 --case-timeout-s 60; mps_off n2
cat $OUT/summary.log
