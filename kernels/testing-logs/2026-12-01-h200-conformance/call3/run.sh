#!/usr/bin/env bash
# GPU call 3 (issue 21): DeepEP v1.2.1 built from source against torch's NVSHMEM 3.4.5; its own
# test_low_latency.py and test_intranode.py unchanged against DeepEP at 2/4/8 ranks on GPU 0
# (same runner, same adapter as for our package in calls 1-2); then a check of the 2-rank
# peer_stops_calling failure of call 2 (alone, and after deepep_semantics).
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
el "start $(date -u) rev $(cat $C/REV)"
WHEEL=$(ls $C/deepep_kernels-*.whl | head -n1)
TN=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])'); P=/tmp/nvshmem; mkdir -p $P/lib
cp -rs $TN/include $P/; for f in $TN/lib/*; do ln -sf $f $P/lib/; done; ln -sf libnvshmem_host.so.3 $P/lib/libnvshmem_host.so
echo "NVSHMEM prefix from torch's wheel $TN: $(ls $P/lib | tr '\n' ' ')"
python3 -m pip install -q --no-index --no-deps --target /tmp/tools $C/ninja-*.whl; export PATH=/tmp/tools/bin:$PATH
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
( cd /tmp/DeepEP && NVSHMEM_DIR=$P CPATH="$CUDA_HOME/include/cccl:$C/ibv" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
  timeout -k 5 240 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > $OUT/deepep-build.log 2>&1 )
el "DeepEP $(cat $C/DeepEP.commit) build rc=$?"; ls /tmp/deepep-site
mkdir -p $OUT/logs; export LD_LIBRARY_PATH=$P/lib:${LD_LIBRARY_PATH:-}
CONF="bash $R/python/scripts/deepep-conformance.sh --deepep-site /tmp/deepep-site --only deepep"
for n in 2 4 8; do left 280 && OUT=$OUT/logs $CONF --tests test_low_latency.py --timeout 75 /tmp/DeepEP $n; done; el "LL done"
for n in 2 4 8; do left 430 && OUT=$OUT/logs $CONF --tests test_intranode.py --timeout 100 /tmp/DeepEP $n; done; el "intranode done"
python3 -m pip install -q --no-index --no-deps --target /tmp/ours "$WHEEL"
for k in peer "deepep_semantics or peer"; do
  left 520 || break
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-k/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-k/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  log="$OUT/logs/pytest2-${k// /_}.log"
  PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=2 DEEPEP_TEST_GPUS=1 timeout -k 5 60 python3 -m pytest -v -rs -p no:cacheprovider -k "$k" $R/python/tests/gpu > "$log" 2>&1
  echo quit | nvidia-cuda-mps-control; sleep 1
  el "pytest 2 ranks -k '$k': $(tail -n1 "$log")"
done
(cd $OUT && tar czf logs.tgz logs deepep-build.log && rm -rf logs deepep-build.log)
el "end"
