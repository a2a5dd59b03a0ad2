#!/usr/bin/env bash
# GPU call 2 (issue 21): after the build.rs fix for C++-named LL entry points: DeepEP v1.2.1's
# test_low_latency.py unchanged against our wheel at 2/4/8 ranks on GPU 0; our Python GPU tests
# at 2, 4 and 8 ranks under MPS.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
el "start $(date -u) rev $(cat $C/REV)"
WHEEL=$(ls $C/deepep_kernels-*.whl | head -n1); echo "wheel: $WHEEL"
python3 -m pip install -q --no-index --no-deps --target /tmp/ours "$WHEEL" || exit 1
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
CONF="bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours"
for n in 2 4 8; do left 300 && OUT=$OUT/conf $CONF --tests test_low_latency.py --timeout 90 /tmp/DeepEP $n; done; el "LL done"
for n in 2 4 8; do
  left 480 || break
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-py$n/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-py$n/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  OUT=$OUT/py$n DEEPEP_TEST_TIMEOUT_S=100 SKIP_CPU_EXAMPLE=1 DEEPEP_TEST_GPUS=1 bash $R/python/scripts/gpu-run.sh "$WHEEL" $n > /dev/null 2>&1
  echo quit | nvidia-cuda-mps-control; sleep 1
  el "pytest $n ranks: $(tail -n1 $OUT/py$n/gpu-ranks$n.log)"
  grep -E "^FAILED|Error" $OUT/py$n/gpu-ranks$n.log | head -5 | cut -c1-300
  rm -f $OUT/py$n/pip.log $OUT/py$n/summary.txt
done
el "end"
