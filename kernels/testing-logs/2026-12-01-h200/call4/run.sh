#!/usr/bin/env bash
# Call 4: the kernel cases at 8 ranks that call 3 did not reach (the hang test among them) or
# that failed on the SM fit, then the Python package's GPU tests at 2, 4, 8 ranks on one GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.device-carry/bin/deepep-gpu-tests
( source kernels/scripts/gpu-env.sh; rm -rf "$SHIM"
export RUST_LOG=warn
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mpsp.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mpsl.XXXX); nvidia-cuda-mps-control -d; }
mps_off() { pkill -9 -f deepep-gpu-tests; sleep 1; echo quit | nvidia-cuda-mps-control; sleep 1; pkill -9 -f nvidia-cuda-mps; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
run() { local tag=$1 lim=$2 n=$3 f=$4; local t0=$SECONDS; mps_on
  echo "== $tag: $n ranks on one GPU, --filter '$f'" > $OUT/$tag.log
  timeout -k 5 $lim $BIN --nproc $n --ranks-per-gpu $n --filter "$f" --case-timeout-s 60 >> $OUT/$tag.log 2>&1
  local rc=$?; mps_off
  echo "$tag: rc=$rc $((SECONDS-t0)) s: $(grep -E '^[0-9]+ passed, [0-9]+ failed$' $OUT/$tag.log | tail -1)" | tee -a $OUT/summary.log
  grep -E "^\[rank 0\] FAIL" $OUT/$tag.log | cut -c1-400; }
run n8-peer-missing 30 8 "intranode/peer_missing"
run n8-layout-bad 20 8 "intranode/layout_bad"
run n8-split 40 8 "intranode/split"
run n8-internode-b2b 30 8 "internode back-to-back"
run n8-internode-bad 20 8 "internode rejects"
run n8-internode-timeout 20 8 "internode timeout"
run n8-internode-sms64 30 8 "sms64"
run n4-internode-sms64 20 4 "sms64" )
# Python package, under one private MPS server (all ranks of a count share GPU 0).
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mpsp.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mpsl.XXXX)
nvidia-cuda-mps-control -d
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo PYTHONUNBUFFERED=1
DEEPEP_TEST_GPUS=1 DEEPEP_TEST_TIMEOUT_S=60 OUT=$OUT/py timeout -k 5 230 bash python/scripts/gpu-run.sh .device-carry/whl 2 4 8
echo "gpu-run rc=$?" | tee -a $OUT/summary.log
pkill -9 -f "pytest|torch.distributed.run|multiprocessing" ; sleep 1; echo quit | nvidia-cuda-mps-control; sleep 1; pkill -9 -f nvidia-cuda-mps
cat $OUT/summary.log
