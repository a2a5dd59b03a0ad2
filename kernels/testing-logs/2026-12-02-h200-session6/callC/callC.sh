#!/usr/bin/env bash
# GPU call C (one H200), session 6, right after call B (DeepEP build reused when still there):
#  issue 21: DeepEP's test_intranode.py against DeepEP at 8 ranks with a longer bound (MPS);
#    our package: the LL pressure test (--pressure-test: seed 0 checked bitwise 20 times, ended
#    once seed 1 starts), --disable-nvlink (ours and DeepEP), test_internode.py as two emulated
#    hosts of 8 ranks (16 processes on one GPU).
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd); R=$(cd "$C/.." && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
L=/tmp/cC; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C /tmp cC; }
el "start $(date -u) rev $(cat $C/REV)"
rm -rf /tmp/ours; python3 -m pip install -q --no-index --no-deps --target /tmp/ours $C/deepep_kernels-*.whl
rm -rf /tmp/DeepEP; tar -C /tmp -xf $C/DeepEP.tar
TN=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])'); P=/tmp/nvshmem; mkdir -p $P/lib
cp -rs $TN/include $P/ 2>/dev/null; for f in $TN/lib/*; do ln -sf $f $P/lib/; done; ln -sf libnvshmem_host.so.3 $P/lib/libnvshmem_host.so
if [ ! -d /tmp/deepep-site/deep_ep ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools $C/ninja-*.whl; export PATH=/tmp/tools/bin:$PATH
  ( cd /tmp/DeepEP && NVSHMEM_DIR=$P CPATH="$CUDA_HOME/include/cccl:$C/ibv" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    timeout -k 5 240 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > $L/deepep-build.log 2>&1 )
  el "DeepEP build rc=$?"
else
  el "DeepEP build from call B reused"
fi
export LD_LIBRARY_PATH=$P/lib:${LD_LIBRARY_PATH:-}
OURS="bash $R/python/scripts/deepep-conformance.sh --ours /tmp/ours --only ours"
DE="bash $R/python/scripts/deepep-conformance.sh --deepep-site /tmp/deepep-site --only deepep"
OUT=$L/pressure $OURS --tests test_low_latency.py --test-args "--pressure-test" --stop-at "Testing with seed 1 " --timeout 130 /tmp/DeepEP 2
el "pressure done: $(grep -c 'Dispatch + combine bandwidth' $L/pressure/ours-test_low_latency-2.log) test_main runs on 2 ranks"; pack
OUT=$L/nonvl $OURS --tests test_low_latency.py --test-args "--disable-nvlink" --timeout 45 /tmp/DeepEP 2; pack
OUT=$L/nonvl $DE --no-mps --tests test_low_latency.py --test-args "--disable-nvlink" --timeout 45 /tmp/DeepEP 2; el "disable-nvlink done"; pack
OUT=$L/internode $OURS --tests test_internode.py --hosts 2 --timeout 100 /tmp/DeepEP 8; el "internode 2x8 done"; pack
OUT=$L/conf $DE --tests test_intranode.py --timeout 200 /tmp/DeepEP 8; el "DeepEP intranode 8 done"; pack
el "end"
