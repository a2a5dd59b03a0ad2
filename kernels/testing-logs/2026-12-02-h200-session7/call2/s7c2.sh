#!/usr/bin/env bash
# GPU call 2 (one H200), session 7, wheel of branch direct2 at 1ec4c22 (internode_cached_notify,
# internode buffer sized for a dispatch without top-k):
#  regression: our Python GPU tests (all) at 8 ranks, the internode ones at 2 and 4;
#  issue 21: DeepEP's test_low_latency.py and test_intranode.py unchanged against ours at 2/4/8,
#    test_internode.py as 2 emulated hosts x 8 ranks.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
L=/tmp/s7c2; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C /tmp s7c2; }
el "start $(date -u) rev $(cat $C/REV)"
rm -rf /tmp/ours; python3 -m pip install -q --no-index --no-deps --target /tmp/ours $C/deepep_kernels-*.whl
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-$1/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-$1/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d; }
mps_off() { echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
for n in 8 2 4; do
  sel=""; [ $n != 8 ] && sel="-k internode"
  mps_on p$n
  PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=$n DEEPEP_TEST_GPUS=1 timeout -k 5 120 python3 -m pytest -v -rs -p no:cacheprovider $sel \
    $R/python/tests/gpu > $L/pytest$n.log 2>&1
  el "pytest $n ranks $sel rc=$?: $(tail -n1 $L/pytest$n.log)"
  mps_off; pack
done
OURS="bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours"
OUT=$L/conf $OURS --tests test_low_latency.py --timeout 90 /tmp/DeepEP 2 4 8; el "ours LL conformance done"; pack
OUT=$L/conf $OURS --tests test_intranode.py --timeout 60 /tmp/DeepEP 2 4 8; el "ours intranode conformance done"; pack
left 420 && { OUT=$L/internode $OURS --tests test_internode.py --hosts 2 --timeout $(( 575 - ($(date +%s) - T0) )) /tmp/DeepEP 8; el "internode 2x8 done"; pack; }
grep -a "\[tuning\] Best\|Error\|PASS\|FAIL" $L/internode/*.log 2>/dev/null | tail -n 12 | cut -c1-300
grep -a -c "\[tuning\] SMs" $L/internode/*.log 2>/dev/null
el "end"; pack
