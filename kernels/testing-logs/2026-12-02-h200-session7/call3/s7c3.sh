#!/usr/bin/env bash
# GPU call 3 (one H200), session 7, wheel 37d71a9 (owned intranode outputs in the receive arena):
#  issue 23: bench.py intranode at 2 ranks on one GPU (owned / zero-copy / copied ratios, NOT
#    PERFORMANCE), bench.py --compare-deep-ep LL at one rank, host_profile.py;
#  regression: our Python GPU tests (all) at 2 ranks, intranode + semantics at 4 and 8; DeepEP's
#    test_intranode.py unchanged against ours at 2/4/8; harness intranode cases at 2 ranks.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
L=/tmp/s7c3; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C /tmp s7c3; }
el "start $(date -u) rev $(cat $C/REV)"
rm -rf /tmp/ours; python3 -m pip install -q --no-index --no-deps --target /tmp/ours $C/deepep_kernels-*.whl
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-$1/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-$1/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d; }
mps_off() { echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
mps_on p2
PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=2 DEEPEP_TEST_GPUS=1 timeout -k 5 120 python3 -m pytest -v -rs -p no:cacheprovider $R/python/tests/gpu > $L/pytest2.log 2>&1
el "pytest 2 ranks rc=$?: $(tail -n1 $L/pytest2.log)"; mps_off; pack
grep -B2 -A25 "^E  " $L/pytest2.log | head -60
mps_on b2
PYTHONPATH=/tmp/ours timeout -k 5 150 python3 $R/python/scripts/bench.py --ranks 2 --gpus 1 --mode intranode --json $L/bench-intra-2.json > $L/bench-intra-2.log 2>&1
el "bench intranode 2 ranks rc=$?"; mps_off; pack
tail -n 16 $L/bench-intra-2.log
for n in 4 8; do
  mps_on p$n
  PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=$n DEEPEP_TEST_GPUS=1 timeout -k 5 100 python3 -m pytest -v -rs -p no:cacheprovider -k "intranode or semantics" \
    $R/python/tests/gpu > $L/pytest$n.log 2>&1
  el "pytest $n ranks intranode+semantics rc=$?: $(tail -n1 $L/pytest$n.log)"; mps_off; pack
done
OURS="bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours"
OUT=$L/conf $OURS --tests test_intranode.py --timeout 60 /tmp/DeepEP 2 4 8; el "ours intranode conformance done"; pack
TN=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])'); P=/tmp/nvshmem; mkdir -p $P/lib
cp -rs $TN/include $P/ 2>/dev/null; for f in $TN/lib/*; do ln -sf $f $P/lib/; done; ln -sf libnvshmem_host.so.3 $P/lib/libnvshmem_host.so
python3 -m pip install -q --no-index --no-deps --target /tmp/tools $C/ninja-*.whl; export PATH=/tmp/tools/bin:$PATH
( cd /tmp/DeepEP && NVSHMEM_DIR=$P CPATH="$CUDA_HOME/include/cccl:$C/ibv" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
  timeout -k 5 200 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > $L/deepep-build.log 2>&1 )
el "DeepEP build rc=$?"
export LD_LIBRARY_PATH=$P/lib:${LD_LIBRARY_PATH:-}
PYTHONPATH=/tmp/ours timeout -k 5 130 python3 $R/python/scripts/bench.py --ranks 1 --mode ll --compare-deep-ep /tmp/deepep-site --rounds 2 \
  --json $L/compare-ll-1.json > $L/bench-ll.log 2>&1; el "bench LL compare rc=$?"; pack
grep "^| LL\|^| op\|^|--" $L/bench-ll.log
PYTHONPATH=/tmp/ours timeout -k 5 60 python3 $R/python/scripts/host_profile.py --json $L/host_profile.json > $L/host_profile.log 2>&1
el "host_profile rc=$?"; grep -v "^/dvs" $L/host_profile.log | head -20; pack
left 500 && { OUT=$L/harness BIN_DIR=$C/bin RANKS=2 TESTS_ARGS="--filter intranode/" TESTS_TIMEOUT=$(( 570 - ($(date +%s) - T0) )) bash $R/kernels/scripts/gpu-oversub.sh > $L/harness.out 2>&1; el "harness intranode 2 rc=$? $(tail -n 2 $L/harness/summary.log 2>/dev/null | tr '\n' ' ')"; }
el "end"; pack
