#!/usr/bin/env bash
# GPU call 4 (one H200):
#  issue 23: python/scripts/bench.py --compare-deep-ep at ONE rank, low latency, 128 x 7168,
#    top-8 of 288: DeepEP v1.2.1 vs ours side by side in one invocation, once with the wheel before
#    the host-path changes (54e0a59, old/) and once with this commit's wheel;
#  issue 21: DeepEP's test_low_latency.py against DeepEP time-sliced (--no-mps; under MPS its LL
#    grids of all ranks do not fit at once and it never finished in call 3), 2 then 4 ranks;
#  regression check of the new host path: DeepEP's test_low_latency.py against ours at 2 ranks and
#    our LL + semantics GPU tests at 2 ranks.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
el "start $(date -u) rev $(cat $C/REV)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
WHEEL=$(ls $C/deepep_kernels-*.whl | head -n1)
python3 -m pip install -q --no-index --no-deps --target /tmp/ours "$WHEEL"
python3 -m pip install -q --no-index --no-deps --target /tmp/ours-old $C/old/deepep_kernels-*.whl
TN=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])'); P=/tmp/nvshmem; mkdir -p $P/lib
cp -rs $TN/include $P/; for f in $TN/lib/*; do ln -sf $f $P/lib/; done; ln -sf libnvshmem_host.so.3 $P/lib/libnvshmem_host.so
python3 -m pip install -q --no-index --no-deps --target /tmp/tools $C/ninja-*.whl; export PATH=/tmp/tools/bin:$PATH
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
( cd /tmp/DeepEP && NVSHMEM_DIR=$P CPATH="$CUDA_HOME/include/cccl:$C/ibv" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
  timeout -k 5 240 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > /tmp/deepep-build.log 2>&1 )
el "DeepEP $(cat $C/DeepEP.commit) build rc=$?"
export LD_LIBRARY_PATH=$P/lib:${LD_LIBRARY_PATH:-}
mkdir -p /tmp/c4logs; pack() { tar czf $OUT/logs.tgz -C /tmp c4logs; }
B="python3 $R/python/scripts/bench.py --ranks 1 --mode ll --compare-deep-ep /tmp/deepep-site"
PYTHONPATH=/tmp/ours timeout -k 5 150 $B --rounds 2 --json /tmp/c4logs/compare-ll-1-new.json > $OUT/bench-new.log 2>&1; el "bench (new wheel) rc=$?"; pack
tail -22 $OUT/bench-new.log
OUT=/tmp/c4logs bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours --tests test_low_latency.py --timeout 80 /tmp/DeepEP 2
el "ours LL conformance done"; pack
if left 230; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-k/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-k/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=2 DEEPEP_TEST_GPUS=1 timeout -k 5 80 python3 -m pytest -v -rs -p no:cacheprovider \
    -k "low_latency or semantics" $R/python/tests/gpu > /tmp/c4logs/pytest2-ll.log 2>&1
  echo quit | nvidia-cuda-mps-control; sleep 1
  el "pytest 2 ranks LL+semantics: $(tail -n1 /tmp/c4logs/pytest2-ll.log)"; pack
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
CONF="bash $R/python/scripts/deepep-conformance.sh --deepep-site /tmp/deepep-site --only deepep --no-mps"
left 250 && OUT=/tmp/c4logs $CONF --tests test_low_latency.py --timeout 100 /tmp/DeepEP 2; el "DeepEP LL done"; pack
if left 330; then
  PYTHONPATH=/tmp/ours-old timeout -k 5 90 $B --json /tmp/c4logs/compare-ll-1-old.json > $OUT/bench-old.log 2>&1; el "bench (old wheel) rc=$?"
fi
pack
el "end"
