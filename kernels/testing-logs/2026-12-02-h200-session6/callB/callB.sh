#!/usr/bin/env bash
# GPU call B (one H200), session 6:
#  issue 23: host_profile.py with this commit's wheel; bench.py --compare-deep-ep, one rank, LL,
#    128 x 7168 top-8 of 288, two rounds (DeepEP v1.2.1 built here, same session);
#  issue 21: DeepEP's own test_low_latency.py against DeepEP 2/4/8 (time-sliced: under MPS its
#    grids of all ranks cannot be resident) and test_intranode.py against DeepEP 2/4 (MPS);
#    regression of this wheel: our LL + semantics GPU tests and LL conformance at 2 ranks.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
L=/tmp/cB; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C /tmp cB; }
el "start $(date -u) rev $(cat $C/REV)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rm -rf /tmp/ours; python3 -m pip install -q --no-index --no-deps --target /tmp/ours $C/deepep_kernels-*.whl
PYTHONPATH=/tmp/ours timeout -k 5 60 python3 $R/python/scripts/host_profile.py --json $L/host_profile.json > $L/host_profile.log 2>&1
el "host_profile rc=$?"; grep -v "^/dvs" $L/host_profile.log; pack
TN=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])'); P=/tmp/nvshmem; mkdir -p $P/lib
cp -rs $TN/include $P/ 2>/dev/null; for f in $TN/lib/*; do ln -sf $f $P/lib/; done; ln -sf libnvshmem_host.so.3 $P/lib/libnvshmem_host.so
python3 -m pip install -q --no-index --no-deps --target /tmp/tools $C/ninja-*.whl; export PATH=/tmp/tools/bin:$PATH
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
if [ ! -d /tmp/deepep-site/deep_ep ]; then
( cd /tmp/DeepEP && NVSHMEM_DIR=$P CPATH="$CUDA_HOME/include/cccl:$C/ibv" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
  timeout -k 5 240 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > $L/deepep-build.log 2>&1 )
fi
el "DeepEP $(cat $C/DeepEP.commit) build rc=$?"
export LD_LIBRARY_PATH=$P/lib:${LD_LIBRARY_PATH:-}
PYTHONPATH=/tmp/ours timeout -k 5 170 python3 $R/python/scripts/bench.py --ranks 1 --mode ll --compare-deep-ep /tmp/deepep-site --rounds 2 \
  --json $L/compare-ll-1.json > $L/bench.log 2>&1; el "bench rc=$?"; pack
tail -24 $L/bench.log
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-p/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-p/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d
PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=2 DEEPEP_TEST_GPUS=1 timeout -k 5 100 python3 -m pytest -v -rs -p no:cacheprovider \
  -k "low_latency or semantics" $R/python/tests/gpu > $L/pytest2.log 2>&1
echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
el "pytest 2 ranks LL+semantics: $(tail -n1 $L/pytest2.log)"; pack
left 330 && OUT=$L/conf bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours --tests test_low_latency.py --timeout 60 /tmp/DeepEP 2
DE="bash $R/python/scripts/deepep-conformance.sh --deepep-site /tmp/deepep-site --only deepep"
left 380 && OUT=$L/conf $DE --no-mps --tests test_low_latency.py --timeout 100 /tmp/DeepEP 2 4 8; el "DeepEP LL done"; pack
left 520 && OUT=$L/conf $DE --tests test_intranode.py --timeout 40 /tmp/DeepEP 2 4; el "DeepEP intranode 2/4 done"; pack
el "end"
