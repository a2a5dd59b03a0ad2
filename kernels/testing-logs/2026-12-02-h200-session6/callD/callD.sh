#!/usr/bin/env bash
# GPU call D (one H200), session 6, the last of the session's budget:
#  issue 23: host_profile.py and bench.py --compare-deep-ep (one rank, LL) with LL calls launched
#    directly on the caller's stream (514f131);
#  regression: our Python GPU tests at 2 ranks (all), DeepEP's test_low_latency.py against ours at
#    2 ranks (it alternates async calls on the comm stream and hooks on the current stream);
#  issue 21: --disable-nvlink message; test_internode.py as 2 emulated hosts x 8 ranks, with the
#    internode buffer sized from num_rdma_bytes + num_nvl_bytes.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
L=/tmp/cD; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C /tmp cD; }
el "start $(date -u) rev $(cat $C/REV)"
rm -rf /tmp/ours; python3 -m pip install -q --no-index --no-deps --target /tmp/ours $C/deepep_kernels-*.whl
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
PYTHONPATH=/tmp/ours timeout -k 5 60 python3 $R/python/scripts/host_profile.py --json $L/host_profile.json > $L/host_profile.log 2>&1
el "host_profile rc=$?"; grep -v "^/dvs" $L/host_profile.log; pack
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-p/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-p/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d
PYTHONPATH=/tmp/ours DEEPEP_TEST_RANKS=2 DEEPEP_TEST_GPUS=1 timeout -k 5 110 python3 -m pytest -v -rs -p no:cacheprovider \
  $R/python/tests/gpu > $L/pytest2.log 2>&1
echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
el "pytest 2 ranks (all): $(tail -n1 $L/pytest2.log)"; pack
OURS="bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours"
OUT=$L/conf $OURS --tests test_low_latency.py --timeout 60 /tmp/DeepEP 2; pack
OUT=$L/nonvl $OURS --tests test_low_latency.py --test-args "--disable-nvlink" --timeout 30 /tmp/DeepEP 2; el "nonvl done"; pack
grep -m1 "NVSHMEM_DISABLE_P2P" $L/nonvl/*.log | cut -c1-400
TN=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])'); P=/tmp/nvshmem; mkdir -p $P/lib
cp -rs $TN/include $P/ 2>/dev/null; for f in $TN/lib/*; do ln -sf $f $P/lib/; done; ln -sf libnvshmem_host.so.3 $P/lib/libnvshmem_host.so
if [ ! -d /tmp/deepep-site/deep_ep ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools $C/ninja-*.whl; export PATH=/tmp/tools/bin:$PATH
  ( cd /tmp/DeepEP && NVSHMEM_DIR=$P CPATH="$CUDA_HOME/include/cccl:$C/ibv" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    timeout -k 5 200 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > $L/deepep-build.log 2>&1 )
  el "DeepEP build rc=$?"
fi
export LD_LIBRARY_PATH=$P/lib:${LD_LIBRARY_PATH:-}
PYTHONPATH=/tmp/ours timeout -k 5 130 python3 $R/python/scripts/bench.py --ranks 1 --mode ll --compare-deep-ep /tmp/deepep-site --rounds 2 \
  --json $L/compare-ll-1.json > $L/bench.log 2>&1; el "bench rc=$?"; pack
grep "^| LL" $L/bench.log
left 240 && { OUT=$L/internode $OURS --tests test_internode.py --hosts 2 --timeout $(( 350 - ($(date +%s) - T0) )) /tmp/DeepEP 8; el "internode 2x8 done"; pack; }
grep -a "passed\|\[tuning\]\|Error" $L/internode/*.log | tail -n 12 | cut -c1-300
el "end"
