#!/usr/bin/env bash
# Several ranks per GPU, on purpose: the 4- and 8-rank code paths on a machine with 1 or 2 GPUs.
# For each rank count N in $RANKS it runs `deepep-gpu-tests --nproc N --ranks-per-gpu K` with
# K = N / (visible GPUs), each run under its own MPS server (or time-sliced with MPS=0), each with a
# time limit, logs under $OUT. Correctness only: timings taken this way are not performance.
#
#   kernels/scripts/gpu-oversub.sh              # from the repo root, binaries in ./target/release
#
# Environment knobs:
#   OUT            output folder (default ./gpu-out); logs: env.log, tests-n<N>.log, mps-n<N>.log, summary.log
#   BIN_DIR        where deepep-gpu-tests is (default ./target/release)
#   PYTHON         the venv's python3 (default python3); it must have nvidia-nvshmem-cu13
#   RANKS          rank counts to run (default "2 4 8"); each must be a multiple of the GPU count
#   GPUS           GPUs to use (default: all that nvidia-smi lists)
#   MPS            1 (default): a private MPS server per rank count, so ranks' kernels run side by side;
#                  0: no MPS, the ranks' contexts are time-sliced (slower; each handshake waits for a slice)
#   TESTS_ARGS     extra arguments for deepep-gpu-tests (e.g. "--filter intranode")
#   TESTS_TIMEOUT  seconds per rank count (default 600)
# Every rank sizes its grids to its share of the SMs (SMs / K; DEEPEP_SHARED_GPU_GRIDS=share, the
# default), so the waiting blocks of all ranks fit on the GPU at once: required under MPS.
# DEEPEP_SHARED_GPU_GRIDS=whole keeps whole-GPU grids: correct only time-sliced (MPS=0).
# The MPS server is always stopped (also on failure or time-out), and leftover ranks are killed
# first, so a hung client cannot leave a broken server behind for the next run.
# Exit code: 0 when every rank count passed, else 1.
set -uo pipefail

OUT="${OUT:-./gpu-out}"
BIN_DIR="${BIN_DIR:-./target/release}"
RANKS="${RANKS:-2 4 8}"
MPS="${MPS:-1}"
TESTS_ARGS="${TESTS_ARGS:-}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-600}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BIN="$BIN_DIR/deepep-gpu-tests"
die() { echo "gpu-oversub: error: $*" | tee -a "$OUT/summary.log" >&2; exit 1; }
[[ -x "$BIN" ]] || die "$BIN not found; build with 'cargo build --release -p deepep-kernels-harness' and copy it (or set BIN_DIR)"

# shellcheck source=kernels/scripts/gpu-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu-env.sh"
GPUS="${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)}"
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || die "no GPU found (nvidia-smi lists none); set GPUS"
if [[ "$MPS" == 1 ]] && ! command -v nvidia-cuda-mps-control >/dev/null; then
  die "MPS=1 but nvidia-cuda-mps-control is not on PATH; install it or run time-sliced with MPS=0"
fi

MPS_PIPE="" MPS_LOG=""
kill_ranks() {  # ranks left behind by a killed launcher would keep their MPS client alive
  pkill -9 -f "$BIN" 2>/dev/null
  sleep 1
}
mps_start() {
  MPS_PIPE="$(mktemp -d /tmp/deepep-mps-pipe.XXXXXX)" MPS_LOG="$(mktemp -d /tmp/deepep-mps-log.XXXXXX)"
  export CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" CUDA_MPS_LOG_DIRECTORY="$MPS_LOG"
  nvidia-cuda-mps-control -d || return 1
}
mps_stop() {  # tag
  [[ -n "$MPS_PIPE" ]] || return 0
  kill_ranks
  echo quit | CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" nvidia-cuda-mps-control >/dev/null 2>&1
  for _ in $(seq 1 20); do
    pgrep -f "nvidia-cuda-mps-(control|server)" >/dev/null || break
    sleep 0.5
  done
  if pgrep -f "nvidia-cuda-mps-(control|server)" >/dev/null; then
    echo "gpu-oversub: MPS did not quit within 10 s; killing it" | tee -a "$OUT/summary.log"
    pkill -9 -f "nvidia-cuda-mps-(control|server)"
  fi
  cat "$MPS_LOG"/* > "$OUT/mps-$1.log" 2>/dev/null
  rm -rf "$MPS_PIPE" "$MPS_LOG"
  MPS_PIPE="" MPS_LOG=""
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap 'mps_stop exit; rm -rf "$SHIM"' EXIT

{
  echo "date: $(date -u +%FT%TZ)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed files"
  echo "GPUs: $GPUS; MPS=$MPS; RANKS=$RANKS; DEEPEP_SHARED_GPU_GRIDS=${DEEPEP_SHARED_GPU_GRIDS:-share}"
  echo "NVSHMEM lib: ${NVS_LIB:-missing}"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_mode --format=csv
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

: > "$OUT/summary.log"
failed=()
for n in $RANKS; do
  if (( n % GPUS != 0 )); then
    echo "tests-n$n: skipped ($n ranks do not divide over $GPUS GPUs)" | tee -a "$OUT/summary.log"
    continue
  fi
  k=$(( n / GPUS ))
  log="$OUT/tests-n$n.log"
  if [[ "$MPS" == 1 ]]; then
    mps_start || { echo "tests-n$n: MPS did not start" | tee -a "$OUT/summary.log"; failed+=("n$n"); continue; }
  fi
  echo "== $n ranks, $k per GPU, MPS=$MPS (limit ${TESTS_TIMEOUT}s)" | tee "$log"
  t0=$SECONDS
  # shellcheck disable=SC2086  # TESTS_ARGS is a word list on purpose
  timeout -k 15 "$TESTS_TIMEOUT" "$BIN" --nproc "$n" --ranks-per-gpu "$k" $TESTS_ARGS 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  [[ "$MPS" == 1 ]] && mps_stop "n$n"
  kill_ranks
  msg="tests-n$n: exit $rc after $((SECONDS - t0)) s; $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -1)"
  [[ $rc -eq 124 || $rc -eq 137 ]] && msg="$msg (TIME LIMIT ${TESTS_TIMEOUT}s reached)"
  echo "$msg" | tee -a "$OUT/summary.log"
  [[ $rc -eq 0 ]] || failed+=("n$n")
done

echo "== summary"; cat "$OUT/summary.log"
if ((${#failed[@]})); then
  echo "gpu-oversub: failed: ${failed[*]}"
  exit 1
fi
echo "gpu-oversub: all rank counts passed"
