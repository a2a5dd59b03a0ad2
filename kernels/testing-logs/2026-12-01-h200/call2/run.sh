#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.device-carry/bin/deepep-gpu-tests
( source kernels/scripts/gpu-env.sh
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mpsp.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mpsl.XXXX); nvidia-cuda-mps-control -d
  echo "== a-whole-mps (8 ranks, whole-GPU grids under MPS: must now fail with an error, not wrong data)" | tee $OUT/a-whole-mps.log
  DEEPEP_SHARED_GPU_GRIDS=whole DEEPEP_GPU_TIMEOUT_MS=8000 timeout -k 5 60 $BIN --nproc 8 --ranks-per-gpu 8 --filter intranode/deepep_shape_bf16_cached --case-timeout-s 50 >> $OUT/a-whole-mps.log 2>&1
  echo "rc=$?" >> $OUT/a-whole-mps.log
  pkill -9 -f deepep-gpu-tests; sleep 1; echo quit | nvidia-cuda-mps-control; sleep 2; pkill -9 -f nvidia-cuda-mps; rm -rf $SHIM )
grep -E "^\[rank 0\] (FAIL|ok)|rc=" $OUT/a-whole-mps.log | cut -c1-700
BIN_DIR=.device-carry/bin RANKS="2 4" TESTS_TIMEOUT=270 RUST_LOG=warn bash kernels/scripts/gpu-oversub.sh > $OUT/oversub.log 2>&1
grep -E "FAIL|summary|tests-n|passed" $OUT/oversub.log | cut -c1-600
