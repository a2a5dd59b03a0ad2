#!/usr/bin/env bash
# One GPU, one rank (not oversubscribed): low-latency 128 x 7168, top-8 of 288, side by side in one
# run: DeepEP v1.2.1's test_low_latency.py (1 process), deepep-bench (Rust API), bench.py (Python
# API). Then doctor with DeepEP's and torch's sites.
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD; C=$R/.device-carry/deepep
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 RUST_LOG=warn
TORCH_SITE=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
P=/tmp/nvshmem-3.4.5; rm -rf $P; mkdir -p $P; tar -C $P -xf $C/nvshmem-prefix.tar
cp "$TORCH_SITE/nvidia/nvshmem/lib/libnvshmem_host.so.3" $P/lib/
(cd $P && sha256sum -c <(grep host $C/removed.sha256)) || exit 1
cp $C/deepep-nix /tmp/deepep-nix; chmod +x /tmp/deepep-nix
rm -rf /tmp/DeepEP /tmp/deepep-site; tar -C /tmp -xf $C/DeepEP.tar
( eval "$(/tmp/deepep-nix env --prefix $P)"; cd /tmp/DeepEP
  t0=$(date +%s); CPATH="/usr/local/cuda/include/cccl" TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS=16 \
    timeout -k 5 300 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . > $OUT/deepep-build.log 2>&1
  echo "deepep build rc=$? in $(( $(date +%s) - t0 )) s"
  echo "== doctor --python-site DeepEP --python-site torch"
  /tmp/deepep-nix doctor --python-site /tmp/deepep-site --python-site "$TORCH_SITE" > $OUT/doctor-two-sites.txt 2>&1; echo "doctor rc=$?"
  grep -E "deepep\." $OUT/doctor-two-sites.txt | cut -c1-330
  /tmp/deepep-nix doctor --python-site /tmp/deepep-site > $OUT/doctor-one-site.txt 2>&1
  grep -A1 "deepep.torch-nvshmem" $OUT/doctor-one-site.txt | cut -c1-330
  echo "== DeepEP test_low_latency.py --num-processes 1"
  cd /tmp/DeepEP/tests && PYTHONPATH=/tmp/deepep-site timeout -k 5 120 python3 test_low_latency.py --num-processes 1 > $OUT/deepep-ll.log 2>&1; echo "rc=$?"
  grep "rank 0" $OUT/deepep-ll.log )
source kernels/scripts/gpu-env.sh
echo "== deepep-bench --nproc 1 --mode low-latency --deepep-stat"
timeout -k 5 150 .device-carry/bin/deepep-bench --nproc 1 --mode low-latency --deepep-stat > $OUT/rust-ll-1.log 2>&1; echo "rc=$?"
grep -vE "^\s*$" $OUT/rust-ll-1.log | grep -v "IBGDA" | head -40 | cut -c1-260
echo "== bench.py --ranks 1 --mode ll"
site=$(mktemp -d /tmp/bsite.XXXX); python3 -m pip install --no-index --no-deps --target $site .device-carry/whl/*.whl >/dev/null 2>&1
PYTHONPATH=$site timeout -k 5 150 python3 python/scripts/bench.py --ranks 1 --mode ll > $OUT/py-ll-1.log 2>&1; echo "rc=$?"
grep -vE "warn|Warning|IBGDA|^\s*$" $OUT/py-ll-1.log | tail -6 | cut -c1-200
rm -rf $SHIM
