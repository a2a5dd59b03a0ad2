#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.device-carry/whl
mps_on()  { export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mpsp.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mpsl.XXXX); nvidia-cuda-mps-control -d; }
mps_off() { pkill -9 -f "pytest|bench.py|multiprocessing" 2>/dev/null; sleep 1; echo quit | nvidia-cuda-mps-control; sleep 2; pkill -9 -f nvidia-cuda-mps 2>/dev/null; }
for r in ${RANKS:-8 2 4}; do
  mps_on
  echo "== n$r"
  OUT=$OUT/n$r DEEPEP_TEST_TIMEOUT_S=${LIM:-200} SKIP_CPU_EXAMPLE=$([ $r = 2 ] && echo 0 || echo 1) bash python/scripts/gpu-run.sh $W $r > /dev/null 2>&1
  grep -E "PASSED|FAILED|SKIPPED|passed|failed" $OUT/n$r/gpu-ranks$r.log | cut -c1-200 | tail -5
  grep -E "AssertionError|DeviceError|Error:|rank 0: torch said" $OUT/n$r/gpu-ranks$r.log | sort | uniq -c | sort -rn | head -6 | cut -c1-600
  [ $r = 2 ] && tail -8 $OUT/n$r/summary.txt
  mps_off
done
