#!/usr/bin/env bash
# Issue 13 remainder: every LL case at 8 ranks on one H200, and the CUPTI case at 4 and 8 ranks.
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 RUST_LOG=warn BIN_DIR=.device-carry/bin
git_rev=$(cat .device-carry/bin/REV 2>/dev/null); echo "binaries of $git_rev"
OUT=$OUT/n8-ll RANKS=8 TESTS_ARGS="--filter ll/" TESTS_TIMEOUT=440 bash kernels/scripts/gpu-oversub.sh > /dev/null 2>&1
echo "== n8 ll/: $(grep -cE '^\[rank 0\] ok' $OUT/n8-ll/tests-n8.log) ok"
grep -E "^\[rank 0\] (ok|FAIL)|passed|timed out" $OUT/n8-ll/tests-n8.log | cut -c1-300 | tail -40
OUT=$OUT/cupti RANKS="4 8" TESTS_ARGS="--filter selftest/cupti" TESTS_TIMEOUT=90 bash kernels/scripts/gpu-oversub.sh > /dev/null 2>&1
for n in 4 8; do echo "== n$n cupti"; grep -E "^\[rank 0\] (ok|FAIL|skip)|passed" $OUT/cupti/tests-n$n.log | cut -c1-300; done
cat $OUT/cupti/summary.log | tail -4
