#!/usr/bin/env bash
# GPU call A (one H200), session 6:
#  issue 21: the self-contained LL handle (new harness cases ll/combine-*/old-handles-*, every LL
#    case at 2 ranks, the old-handles cases at 8), our Python GPU tests at 2 ranks, DeepEP's
#    test_low_latency.py and test_intranode.py unchanged against ours at 2/4/8 (MPS);
#  issue 23: host_profile.py (where the host time of one LL call goes), one rank.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
L=/tmp/cA; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C /tmp cA; }
el "start $(date -u) rev $(cat $C/REV)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/ours $C/deepep_kernels-*.whl
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
PYTHONPATH=/tmp/ours timeout -k 5 60 python3 $R/python/scripts/host_profile.py --json $L/host_profile.json > $L/host_profile.log 2>&1
el "host_profile rc=$?"; cat $L/host_profile.log; pack
OUT=$L/gpu-ll2 BIN_DIR=$C/bin RANKS=2 TESTS_ARGS="--filter ll/" TESTS_TIMEOUT=150 bash $R/kernels/scripts/gpu-oversub.sh > $L/gpu-ll2.out 2>&1
el "harness ll/ 2 ranks rc=$? $(tail -n 2 $L/gpu-ll2/summary.log 2>/dev/null | tr '\n' ' ')"; pack
OUT=$L/gpu-old8 BIN_DIR=$C/bin RANKS="4 8" TESTS_ARGS="--filter old-handles" TESTS_TIMEOUT=60 bash $R/kernels/scripts/gpu-oversub.sh > $L/gpu-old8.out 2>&1
el "harness old-handles 4+8 ranks rc=$? $(tail -n 2 $L/gpu-old8/summary.log 2>/dev/null | tr '\n' ' ')"; pack
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-p/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-p/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d
PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=2 DEEPEP_TEST_GPUS=1 timeout -k 5 100 python3 -m pytest -v -rs -p no:cacheprovider \
  -k "low_latency or semantics" $R/python/tests/gpu > $L/pytest2.log 2>&1
echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
el "pytest 2 ranks LL+semantics: $(tail -n1 $L/pytest2.log)"; pack
CONF="bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours"
left 330 && OUT=$L/conf $CONF --tests test_low_latency.py --timeout 90 /tmp/DeepEP 2 4 8; el "ours LL conformance done"; pack
left 480 && OUT=$L/conf $CONF --tests test_intranode.py --timeout 60 /tmp/DeepEP 2 4 8; el "ours intranode conformance done"; pack
el "end"
