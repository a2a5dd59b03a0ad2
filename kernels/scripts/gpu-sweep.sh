#!/usr/bin/env bash
# The one command to run on the GPU machine (2x H200): environment from the Python venv's NVIDIA
# wheels, topology, then the GPU test suite and the benchmark, each with a time limit, logs in $OUT.
#
#   kernels/scripts/gpu-sweep.sh                # from the repo root, binaries in ./target/release
#
# Environment knobs:
#   OUT             output folder (default ./gpu-out); logs: env.log topo.log gpu-tests.log bench.log bench.json
#   BIN_DIR         where deepep-gpu-tests and deepep-bench are (default ./target/release)
#   PYTHON          the venv's python3 (default python3); it must have nvidia-nvshmem-cu13 and nvidia-nccl-cu13
#   NPROC           ranks = GPUs (default 2)
#   TESTS_ARGS      extra arguments for deepep-gpu-tests (e.g. "--filter intranode --repeat 3")
#   BENCH_ARGS      extra arguments for deepep-bench (e.g. "--mode intranode --sweep"); default "--mode all"
#   TESTS_TIMEOUT   seconds for the test step (default 300)
#   BENCH_TIMEOUT   seconds for the bench step (default 210)
#   SKIP_TESTS=1 / SKIP_BENCH=1 to leave a step out.
# Exit code: 0 when every step succeeded, else 1 (the summary names the failed steps).
set -uo pipefail

OUT="${OUT:-./gpu-out}"
BIN_DIR="${BIN_DIR:-./target/release}"
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-2}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-300}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-210}"
BENCH_ARGS="${BENCH_ARGS:---mode all}"
TESTS_ARGS="${TESTS_ARGS:-}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

die() { echo "gpu-sweep: error: $*" | tee -a "$OUT/summary.log" >&2; exit 1; }

for b in deepep-gpu-tests deepep-bench; do
  [[ -x "$BIN_DIR/$b" ]] || die "$BIN_DIR/$b not found; build on the build machine with 'cargo build --release -p deepep-kernels-harness' and copy target/release/{deepep-gpu-tests,deepep-bench} (or set BIN_DIR)"
done

# shellcheck source=kernels/scripts/gpu-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu-env.sh"
trap 'rm -rf "$SHIM"' EXIT

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed files"
  echo "NVSHMEM lib: ${NVS_LIB:-missing}"
  echo "NCCL lib: ${NCCL_LIB:-missing}"
  echo "CUPTI lib: ${DEEPEP_CUPTI_LIB:-missing}"
  "$PYTHON" -m pip show nvidia-nvshmem-cu13 nvidia-nccl-cu13 2>/dev/null | grep -E '^(Name|Version):'
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  env | grep -E '^(NVSHMEM|NCCL)_' | sort
  ls -la "$BIN_DIR/deepep-gpu-tests" "$BIN_DIR/deepep-bench"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

echo "== nvidia-smi topo -m" | tee "$OUT/topo.log"
{ nvidia-smi topo -m; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; } 2>&1 | tee -a "$OUT/topo.log"

failed=()
step() {  # name timeout command...
  local name="$1" limit="$2"; shift 2
  echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local msg="$name: exit $rc after $((SECONDS - t0)) s"
  [[ $rc -eq 124 || $rc -eq 137 ]] && msg="$msg (TIME LIMIT ${limit}s reached)"
  echo "$msg" | tee -a "$OUT/$name.log" "$OUT/summary.log"
  [[ $rc -eq 0 ]] || failed+=("$name")
}

: > "$OUT/summary.log"
# shellcheck disable=SC2086  # the *_ARGS are word lists on purpose
[[ "${SKIP_TESTS:-0}" == 1 ]] || step gpu-tests "$TESTS_TIMEOUT" "$BIN_DIR/deepep-gpu-tests" --nproc "$NPROC" $TESTS_ARGS
# shellcheck disable=SC2086
[[ "${SKIP_BENCH:-0}" == 1 ]] || step bench "$BENCH_TIMEOUT" "$BIN_DIR/deepep-bench" --nproc "$NPROC" $BENCH_ARGS --json "$OUT/bench.json"

echo "== summary" ; cat "$OUT/summary.log"
if ((${#failed[@]})); then
  echo "gpu-sweep: failed steps: ${failed[*]}"
  exit 1
fi
echo "gpu-sweep: all steps passed"
