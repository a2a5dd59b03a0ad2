#!/usr/bin/env bash
# GPU call 1 (one H200), session 7, wheel of branch direct2 (LL calls launched on the caller's
# stream, ordered across streams through an event):
#  issue 23: host_profile.py (one rank);
#  regression + issue 21: our Python GPU tests (all) at 2, 4 and 8 ranks under MPS (incl. the
#    internode handle[-4] and no-top-k checks, cross-stream and destroyed-stream LL ordering);
#    DeepEP's test_internode.py against ours as 2 emulated hosts x 8 ranks.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
L=/tmp/s7c1; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C /tmp s7c1; }
el "start $(date -u) rev $(cat $C/REV)"
rm -rf /tmp/ours; python3 -m pip install -q --no-index --no-deps --target /tmp/ours $C/deepep_kernels-*.whl
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
PYTHONPATH=/tmp/ours timeout -k 5 60 python3 $R/python/scripts/host_profile.py --json $L/host_profile.json > $L/host_profile.log 2>&1
el "host_profile rc=$?"; grep -v "^/dvs" $L/host_profile.log; pack
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-$1/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-$1/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d; }
mps_off() { echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
for n in 2 4 8; do
  lim=$(( n == 2 ? 120 : 150 ))
  left $(( 560 - lim )) || { el "skip pytest $n"; continue; }
  mps_on p$n
  PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=$n DEEPEP_TEST_GPUS=1 timeout -k 5 $lim python3 -m pytest -v -rs -p no:cacheprovider \
    $R/python/tests/gpu > $L/pytest$n.log 2>&1
  el "pytest $n ranks rc=$?: $(tail -n1 $L/pytest$n.log)"
  mps_off; pack
done
OURS="bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours"
left 450 && { OUT=$L/internode $OURS --tests test_internode.py --hosts 2 --timeout $(( 560 - ($(date +%s) - T0) )) /tmp/DeepEP 8; el "internode 2x8 done"; pack; }
grep -a "passed\|\[tuning\]\|Error\|PASS\|FAIL" $L/internode/*.log 2>/dev/null | tail -n 12 | cut -c1-300
el "end"; pack
