#!/usr/bin/env bash
# Python package on one H200: 8-rank tests (micro-batch B diagnosis), bench at 2 ranks
# (oversubscribed: NOT performance), 2-rank tests incl. the trap test, 4-rank tests.
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.device-carry/whl
mps_on()  { export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mpsp.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mpsl.XXXX); nvidia-cuda-mps-control -d; }
mps_off() { pkill -9 -f "pytest|bench.py|multiprocessing" 2>/dev/null; sleep 1; echo quit | nvidia-cuda-mps-control; sleep 2; pkill -9 -f nvidia-cuda-mps 2>/dev/null; }
step() { # name limit ranks [env...]
  local name=$1 lim=$2 r=$3; shift 3
  mps_on
  echo "== $name"
  env "$@" OUT=$OUT/$name DEEPEP_TEST_TIMEOUT_S=$lim SKIP_CPU_EXAMPLE=1 bash python/scripts/gpu-run.sh $W $r > /dev/null 2>&1
  grep -E "passed|failed|timed out" $OUT/$name/summary.txt | tail -3
  grep -E "AssertionError|DeviceError|Error:|rank 0: torch said" $OUT/$name/gpu-ranks$r.log | sort | uniq -c | sort -rn | head -8 | cut -c1-600
  mps_off
}
step n8 240 8
mps_on
echo "== bench 2 ranks on one GPU under MPS (not performance)"
PYTHONPATH=$(ls -d /tmp/deepep-site.* 2>/dev/null | head -1) true
site=$(mktemp -d /tmp/bsite.XXXX); python3 -m pip install --no-index --no-deps --target $site $W/*.whl >/dev/null 2>&1
PYTHONPATH=$site timeout -k 10 200 python3 python/scripts/bench.py --ranks 2 --gpus 1 --num-sms 24 --reps 20 > $OUT/bench.log 2>&1; echo "rc=$?"
tail -16 $OUT/bench.log | cut -c1-200
mps_off
step n2 120 2
step n4 150 4
