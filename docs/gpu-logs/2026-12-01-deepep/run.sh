#!/usr/bin/env bash
# Issue 16 item 4: DeepEP v1.2.1 built the documented way (docs/deepep.md) against the
# NVSHMEM 3.4.5 prefix `deepep-nix install --source pypi` made, on this GPU machine; its tests
# with one process; deepep-nix doctor.
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd)
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}; export PATH=$CUDA_HOME/bin:$PATH
log() { echo "== $*"; }
log "env"; date -u
if python3 -m pip --version >/dev/null 2>&1; then PIP="python3 -m pip"; else PIP="pip --python $(command -v python3)"; fi; echo "pip: $PIP"; $PIP --version
 nvidia-smi -L; nvidia-smi --query-gpu=driver_version,compute_cap --format=csv,noheader
python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])'
TORCH_NVSHMEM=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])'); echo "torch's nvshmem: $TORCH_NVSHMEM"
nvcc --version | tail -2; which ninja c++ g++; c++ --version | head -1
ls /usr/include/infiniband/mlx5dv.h /usr/include/rdma/ib_user_verbs.h 2>&1
python3 -c 'import setuptools, wheel; print("setuptools", setuptools.__version__)' 2>&1 | tail -1
# 1. the prefix: made here by `deepep-nix install --version 3.4.5 --cuda 13 --source pypi --file <wheel>`
#    (verified against the lock), carried without its two largest files; libnvshmem_host.so.3 is
#    taken from this machine's torch wheel after checking it is the same bytes.
P=/tmp/nvshmem-3.4.5; rm -rf $P; mkdir -p $P; tar -C $P -xf $C/nvshmem-prefix.tar
cp "$TORCH_NVSHMEM/lib/libnvshmem_host.so.3" $P/lib/
(cd $P && sha256sum -c <(grep host $C/removed.sha256)) || { echo "host library differs from the wheel's"; exit 1; }
ls -la $P/lib | head -20
cp "$C/deepep-nix" /tmp/deepep-nix; chmod +x /tmp/deepep-nix
log "deepep-nix env --prefix $P"; /tmp/deepep-nix env --prefix $P
eval "$(/tmp/deepep-nix env --prefix $P)"
echo "NVSHMEM_DIR=$NVSHMEM_DIR"
# ninja for torch's extension build (not on this machine; a wheel from PyPI carried in)
$PIP install --no-index --no-deps --target /tmp/tools $C/ninja-*.whl >/dev/null 2>&1; export PATH=/tmp/tools/bin:$PATH; ninja --version
EXTRA=""
[[ -f /usr/include/infiniband/mlx5dv.h ]] || { EXTRA=":$C/ibv"; echo "no rdma-core headers on this machine: using libibverbs-dev 44.0 headers carried in (docs: apt-get install libibverbs-dev)"; }
rm -rf /tmp/DeepEP /tmp/deepep-site; tar -C /tmp -xf $C/DeepEP.tar
log "build DeepEP v1.2.1 ($(cat $C/DeepEP.commit))"
cd /tmp/DeepEP
t0=$(date +%s)
CPATH="$CUDA_HOME/include/cccl$EXTRA${CPATH:+:$CPATH}" TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS=16 \
  timeout -k 5 400 $PIP install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > $OUT/deepep-build.log 2>&1
rc=$?; t1=$(date +%s); echo "build rc=$rc in $((t1-t0)) s"
grep -E "Build summary| > |error|Error|Successfully" $OUT/deepep-build.log | head -30
[[ $rc == 0 ]] || { tail -40 $OUT/deepep-build.log; exit 1; }
ls /tmp/deepep-site
log "doctor --python-site"
/tmp/deepep-nix doctor --python-site /tmp/deepep-site > $OUT/doctor.txt 2>&1; echo "doctor rc=$?"
grep -iE "deepep\.|memlock|container|summary|fail|warn" $OUT/doctor.txt | head -40
/tmp/deepep-nix doctor --python-site /tmp/deepep-site --json > $OUT/doctor.json 2>/dev/null
cd /tmp/DeepEP/tests
export PYTHONPATH=/tmp/deepep-site
python3 -c 'import deep_ep, deep_ep_cpp; print("deep_ep from", deep_ep.__file__)'
log "test_low_latency.py --num-processes 1"
timeout -k 5 150 python3 test_low_latency.py --num-processes 1 > $OUT/test_low_latency.log 2>&1; echo "rc=$?"
grep -vE "^\s*$" $OUT/test_low_latency.log | tail -25 | cut -c1-300
log "test_intranode.py --num-processes 1"
timeout -k 5 150 python3 test_intranode.py --num-processes 1 > $OUT/test_intranode.log 2>&1; echo "rc=$?"
grep -vE "^\s*$" $OUT/test_intranode.log | tail -25 | cut -c1-300
date -u
