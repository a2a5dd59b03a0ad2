#!/usr/bin/env bash
# Call 3: 4 ranks on one GPU: the internode family and the new LL duplicate case (the 4-rank suite
# of call 2 reached its time limit there); 8 ranks on one GPU: selftest, intranode, internode and
# the LL DeepEP-shape / put / zero-token / duplicate cases. Each invocation under its own MPS server.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.device-carry/bin/deepep-gpu-tests
source kernels/scripts/gpu-env.sh
export RUST_LOG=warn
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mpsp.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mpsl.XXXX); nvidia-cuda-mps-control -d; }
mps_off() { pkill -9 -f deepep-gpu-tests; sleep 1; echo quit | nvidia-cuda-mps-control; sleep 1; pkill -9 -f nvidia-cuda-mps; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
run() { # tag limit n filter
  local tag=$1 lim=$2 n=$3 f=$4; local t0=$SECONDS
  mps_on
  echo "== $tag: $n ranks, --ranks-per-gpu $n, --filter '$f'" > $OUT/$tag.log
  timeout -k 5 $lim $BIN --nproc $n --ranks-per-gpu $n --filter "$f" --case-timeout-s 150 >> $OUT/$tag.log 2>&1
  local rc=$?
  mps_off
  echo "$tag: rc=$rc $((SECONDS-t0)) s: $(grep -E '^[0-9]+ passed, [0-9]+ failed$' $OUT/$tag.log | tail -1)" | tee -a $OUT/summary.log
  grep -E "^\[rank 0\] FAIL" $OUT/$tag.log | cut -c1-500
}
run n4-internode 150 4 "internode"
run n4-ll-dup 40 4 "ll/duplicate"
run n8-selftest 40 8 "selftest/"
run n8-intranode 240 8 "intranode/"
run n8-internode 170 8 "internode"
run n8-ll-bf16 40 8 "ll/bf16/7168x8of288"
run n8-ll-fp8 40 8 "ll/fp8/7168x8of288"
run n8-ll-hook 40 8 "ll/hook/7168x8of288"
run n8-ll-put 40 8 "ll/put/"
run n8-ll-zero 30 8 "ll/zero"
run n8-ll-dup 30 8 "ll/duplicate"
cat $OUT/summary.log
