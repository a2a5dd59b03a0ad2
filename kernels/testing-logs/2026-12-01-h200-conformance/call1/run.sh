#!/usr/bin/env bash
# GPU call 1 (issue 21): DeepEP v1.2.1's test_low_latency.py and test_intranode.py, unchanged,
# against our wheel at 2/4/8 ranks on GPU 0 (python/scripts/deepep-conformance.sh, MPS per run);
# then our own Python GPU tests at 2 ranks (with the new deepep_semantics test).
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
el "start $(date -u) rev $(cat $C/REV)"; nvidia-smi -L
WHEEL=$(ls $C/deepep_kernels-*.whl | head -n1); echo "wheel: $WHEEL"
python3 -m pip install -q --no-index --no-deps --target /tmp/ours "$WHEEL" || exit 1
CONF="bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours"
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
for n in 2 4 8; do left 330 && OUT=$OUT/conf $CONF --tests test_low_latency.py --timeout 80 /tmp/DeepEP $n; done; el "LL done"
for n in 2 4 8; do left 450 && OUT=$OUT/conf $CONF --tests test_intranode.py --timeout 120 /tmp/DeepEP $n; done; el "intranode done"
if left 500; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-py/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-py/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  OUT=$OUT/py DEEPEP_TEST_TIMEOUT_S=80 SKIP_CPU_EXAMPLE=1 DEEPEP_TEST_GPUS=1 bash $R/python/scripts/gpu-run.sh "$WHEEL" 2
  echo quit | nvidia-cuda-mps-control
fi
el "end"
