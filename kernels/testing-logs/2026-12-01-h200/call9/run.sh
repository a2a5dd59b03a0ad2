#!/usr/bin/env bash
# After the kernels API refactor (issue 14 item 1): the whole Rust GPU suite at 2 ranks on one GPU,
# the Python GPU tests at 2 and 8 ranks (the binding now stands on the refactored API).
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 RUST_LOG=warn
echo "binaries of $(cat .device-carry/bin/REV)"
OUT=$OUT/rust-n2 BIN_DIR=.device-carry/bin RANKS=2 TESTS_TIMEOUT=330 bash kernels/scripts/gpu-oversub.sh > /dev/null 2>&1
echo "== rust n2: $(grep -cE '^\[rank 0\] ok' $OUT/rust-n2/tests-n2.log) ok"
grep -E "^\[rank 0\] (FAIL|skip)|passed|failed" $OUT/rust-n2/tests-n2.log | cut -c1-400 | tail -8
tail -2 $OUT/rust-n2/summary.log
RANKS="2 8" bash .device-carry/py2.sh
