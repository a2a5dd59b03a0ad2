#!/usr/bin/env bash
# GPU call 4 (one H200), session 7, the last of the session's budget; wheel of the REV below:
#  regression: our Python intranode GPU test at 2/4/8 (the arena test fixed after call 3), bench.py
#    intranode at 2 ranks (owned / zero-copy ratio, NOT PERFORMANCE);
#  issue 21: DeepEP v1.2.1 (9af0e0d) built here, its own test_low_latency.py at 2/4/8 (time-sliced)
#    and test_intranode.py at 2/4 (MPS), the same session as ours (calls 2 and 3); if time is
#    left, its test_intranode.py at 8 time-sliced.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
L=/tmp/s7c4; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C /tmp s7c4; }
el "start $(date -u) rev $(cat $C/REV)"
rm -rf /tmp/ours; python3 -m pip install -q --no-index --no-deps --target /tmp/ours $C/deepep_kernels-*.whl
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
# DeepEP's build first (CPU only), in the background while our GPU tests run
TN=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])'); P=/tmp/nvshmem; mkdir -p $P/lib
cp -rs $TN/include $P/ 2>/dev/null; for f in $TN/lib/*; do ln -sf $f $P/lib/; done; ln -sf libnvshmem_host.so.3 $P/lib/libnvshmem_host.so
python3 -m pip install -q --no-index --no-deps --target /tmp/tools $C/ninja-*.whl; export PATH=/tmp/tools/bin:$PATH
( cd /tmp/DeepEP && NVSHMEM_DIR=$P CPATH="$CUDA_HOME/include/cccl:$C/ibv" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 \
  timeout -k 5 240 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > $L/deepep-build.log 2>&1; echo "rc=$?" >> $L/deepep-build.log ) &
BPID=$!
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-$1/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-$1/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d; }
mps_off() { echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
for n in 2 4 8; do
  mps_on p$n
  PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=$n DEEPEP_TEST_GPUS=1 timeout -k 5 80 python3 -m pytest -v -rs -p no:cacheprovider -k "test_intranode" \
    $R/python/tests/gpu > $L/pytest$n.log 2>&1
  el "pytest $n ranks intranode rc=$?: $(tail -n1 $L/pytest$n.log)"; mps_off; pack
done
grep -h -A12 "^E  " $L/pytest*.log | head -30
mps_on b2
PYTHONPATH=/tmp/ours timeout -k 5 90 python3 $R/python/scripts/bench.py --ranks 2 --gpus 1 --mode intranode --json $L/bench-intra-2.json > $L/bench-intra-2.log 2>&1
el "bench intranode 2 ranks rc=$?"; mps_off; pack
tail -n 13 $L/bench-intra-2.log
wait $BPID; el "DeepEP build $(tail -n1 $L/deepep-build.log)"
export LD_LIBRARY_PATH=$P/lib:${LD_LIBRARY_PATH:-}
DE="bash $R/python/scripts/deepep-conformance.sh --deepep-site /tmp/deepep-site --only deepep"
OUT=$L/conf $DE --no-mps --tests test_low_latency.py --timeout 100 /tmp/DeepEP 2 4 8; el "DeepEP LL done"; pack
OUT=$L/conf $DE --tests test_intranode.py --timeout 45 /tmp/DeepEP 2 4; el "DeepEP intranode 2/4 done"; pack
left 360 && { OUT=$L/conf8 $DE --no-mps --tests test_intranode.py --timeout $(( 420 - ($(date +%s) - T0) )) /tmp/DeepEP 8; el "DeepEP intranode 8 time-sliced done"; pack; }
cat $L/conf/summary.txt $L/conf8/summary.txt 2>/dev/null
el "end"; pack
