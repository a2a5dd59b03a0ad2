#!/usr/bin/env bash
# Run DeepEP's own test files, unchanged, against our deepep_kernels package and against a real
# DeepEP build, several ranks on the GPUs there are (all on one GPU by default), in one command.
#
# Usage: python/scripts/deepep-conformance.sh [options] DEEPEP_SRC NPROC [NPROC...]
#   DEEPEP_SRC  a DeepEP checkout (its tests/ folder is run from there; nothing is copied into the
#               project): v1.2.1 for the V1 API (tests/test_*.py), 2.1 (commit dd758ca) for V2
#               (tests/elastic/test_ep.py) and its V1 tests (tests/legacy/test_*.py); for our
#               package alone tests/ and deep_ep/utils/ of 2.1 suffice, as extracted by
#               python/scripts/deepep-v2-subset.sh (e.g. into gpu-carry/deepep-2.1, git-ignored)
#   NPROC       rank counts (--num-processes of the test files), e.g. 2 4 8
# Options:
#   --ours PATH          our package: a deepep_kernels wheel (installed into a temporary folder)
#                        or a folder that holds deepep_kernels/ (default: the importable one)
#   --deepep-site DIR    a folder holding a built `deep_ep` (with deep_ep_cpp), e.g. the --target of
#                        DeepEP's pip install; without it only our package runs
#   --only ours|deepep   run one library only
#   --tests "A B"        test files under DEEPEP_SRC/tests, e.g. elastic/test_ep.py (default:
#                        "test_intranode.py test_low_latency.py"; a name not in tests/ is looked up
#                        in tests/legacy/, where DeepEP 2.x keeps the V1 tests)
#   --gpus N             GPUs the ranks share, rank r on GPU r % N (default 1)
#   --timeout S          limit per run in seconds (default 600)
#   --no-mps             do not start a private MPS server per run (default: start one when
#                        nvidia-cuda-mps-control exists; spin-waiting kernels of several ranks on one
#                        GPU progress far faster under MPS)
#   --test-args "..."    extra arguments for every test file (e.g. "--num-tokens 1024", or for
#                        elastic/test_ep.py "--skip-perf-test --do-cpu-sync 0")
#   --stop-at REGEX      end a run as passed once its log matches REGEX (extended grep) and no
#                        rank failed, e.g. with --test-args --pressure-test (an endless loop over
#                        seeds, each checked bitwise 20 times) --stop-at 'Testing with seed 2 '
#                        passes after seeds 0 and 1
#   --hosts H            emulate H hosts (default 1): each run launches the test file H times, as
#                        DeepEP's init_dist expects one launch per node (WORLD_SIZE=H, RANK=h, one
#                        MASTER_ADDR/PORT), NPROC ranks each, all on the GPUs here; our package
#                        gets DEEPEP_KERNELS_RANKS_PER_HOST=NPROC, so the group of H*NPROC ranks is
#                        served by its internode mode (test_internode.py needs H >= 2)
#   -h, --help           print this and exit
# DeepEP 2.x trees (those with deep_ep/utils/): our package runs with DeepEP's own
#   deep_ep/utils/{refs,math,gate}.py, the V2 test's bitwise references, put over the shim's in a
#   copy of the shim's deep_ep package in this run's scratch folder (under /tmp, removed at exit);
#   the rest of deep_ep (envs, testing, event, ElasticBuffer, ...) is ours.
# Environment: PYTHON (default python3), OUT (log folder, default ./conformance-logs),
#   RECORD=1 (also write a conformance record of this invocation's runs into $OUT,
#   <date>-conformance-<slug>.json with RECORD_SLUG (default run); a row's suite names the library,
#   the test file and --test-args, e.g. "ours: elastic/test_ep.py --skip-perf-test"; the commit is
#   the checkout's HEAD or RECORD_COMMIT; its command starts with the library's knobs set for the
#   run, e.g. DEEPEP_KERNELS_KEEP_COMM_STREAMS=0; copy it into kernels/results/ and run
#   scripts/results.py: kernels/TESTING.md, "Results as data").
#
# The adapter (python/scripts/conformance/sitecustomize.py) changes only the environment: set_device
# modulo the GPU count, gloo instead of NCCL, CUDA collectives (all_to_all_single too) staged
# through the CPU, float8 as bytes. Each run's full output is in $OUT/<library>-<test>-<nproc>.log
# (a test path's / as _); $OUT/summary.txt has one line per run (its test arguments at the end).
# Exits 1 when a run of our package failed (DeepEP's results are reported only), 2 on bad usage.
set -uo pipefail
invocation="python/scripts/deepep-conformance.sh $*"  # results.py puts the knobs set for the run before it
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
ours="" deepep_site="" only="" tests="test_intranode.py test_low_latency.py" gpus=1 limit=600 mps=1 test_args="" hosts=1 stop_at=""
# the comment block above, up to the first line that is not a comment
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --ours) ours=$2; shift 2 ;;
    --deepep-site) deepep_site=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --tests) tests=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --no-mps) mps=0; shift ;;
    --test-args) test_args=$2; shift 2 ;;
    --hosts) hosts=$2; shift 2 ;;
    --stop-at) stop_at=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --*) echo "deepep-conformance: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { usage >&2; exit 2; }
[[ "$hosts" =~ ^[1-9][0-9]*$ ]] || { echo "deepep-conformance: --hosts takes a number of hosts >= 1, got '$hosts'" >&2; exit 2; }
src=$(cd "$1" 2>/dev/null && pwd) || { echo "deepep-conformance: DEEPEP_SRC '$1' is not a folder" >&2; exit 2; }
shift
nprocs=("$@")
# each test file as a path under tests/ (DeepEP 2.x keeps the V1 tests in tests/legacy/)
test_paths=()
for t in $tests; do
  if [ -f "$src/tests/$t" ]; then test_paths+=("$t")
  elif [ -f "$src/tests/legacy/$t" ]; then test_paths+=("legacy/$t")
  else
    echo "deepep-conformance: neither $src/tests/$t nor $src/tests/legacy/$t exists; point DEEPEP_SRC at a DeepEP checkout" \
      "(v1.2.1 for test_intranode.py / test_low_latency.py, 2.1 for elastic/test_ep.py) or at python/scripts/deepep-v2-subset.sh's folder" >&2
    exit 2
  fi
done
# A DeepEP 2.x tree: its own bitwise references deep_ep/utils/{refs,math,gate}.py are used by our runs
v2_utils=""
if [ -d "$src/deep_ep/utils" ]; then
  for m in refs math gate; do
    [ -f "$src/deep_ep/utils/$m.py" ] || { echo "deepep-conformance: $src/deep_ep/utils/ has no $m.py; a DeepEP 2.x tree (or python/scripts/deepep-v2-subset.sh's folder) holds deep_ep/utils/{refs,math,gate}.py" >&2; exit 2; }
  done
  v2_utils="$src/deep_ep/utils"
fi
case "$only" in ""|ours|deepep) ;; *) echo "deepep-conformance: --only takes ours or deepep" >&2; exit 2 ;; esac
libs=()
[ "$only" != deepep ] && libs+=(ours)
if [ "$only" != ours ]; then
  if [ -n "$deepep_site" ]; then
    [ -d "$deepep_site/deep_ep" ] || { echo "deepep-conformance: no deep_ep/ in --deepep-site $deepep_site" >&2; exit 2; }
    libs+=(deepep)
  elif [ "$only" = deepep ]; then
    echo "deepep-conformance: --only deepep needs --deepep-site" >&2; exit 2
  else
    echo "deepep-conformance: no --deepep-site given: running our package only"
  fi
fi
out=${OUT:-$PWD/conformance-logs}
mkdir -p "$out"
scratch=$(mktemp -d /tmp/deepep-conformance.XXXXXX)
trap 'rm -rf "$scratch"' EXIT

# Our package: a wheel goes into a private --target folder; the shim folder provides `deep_ep`.
ours_path=""
if [[ " ${libs[*]} " == *" ours "* ]]; then
  if [ -n "$ours" ] && [ -f "$ours" ]; then
    "$py" -m pip install -q --no-index --no-deps --target "$scratch/ours" "$ours" || { echo "deepep-conformance: cannot install $ours" >&2; exit 2; }
    ours_path="$scratch/ours"
  elif [ -n "$ours" ]; then
    [ -d "$ours/deepep_kernels" ] || { echo "deepep-conformance: no deepep_kernels/ in --ours $ours" >&2; exit 2; }
    ours_path=$(cd "$ours" && pwd)
  fi
  # from the scratch folder: `python -m` puts the working folder first on sys.path, and in python/
  # that is the source tree (no built extension), not the package under test
  shim=$(cd "$scratch" && PYTHONPATH="$ours_path${PYTHONPATH:+:$PYTHONPATH}" "$py" -m deepep_kernels.shim) || { echo "deepep-conformance: deepep_kernels is not importable (pass --ours)" >&2; exit 2; }
  if [ -n "$v2_utils" ]; then
    # A copy of the shim's deep_ep package with DeepEP's refs/math/gate over ours (the copy keeps
    # the shim's marker, so the shim does not take it for a real DeepEP); only in this scratch folder.
    mkdir -p "$scratch/shim-v2"
    cp -R "$shim/deep_ep" "$scratch/shim-v2/" || { echo "deepep-conformance: cannot copy $shim/deep_ep" >&2; exit 2; }
    rm -rf "$scratch/shim-v2/deep_ep/__pycache__" "$scratch/shim-v2/deep_ep/utils/__pycache__"
    for m in refs math gate; do cp "$v2_utils/$m.py" "$scratch/shim-v2/deep_ep/utils/$m.py" || exit 2; done
    shim="$scratch/shim-v2"
    echo "deepep-conformance: DeepEP 2.x tree: deep_ep.utils.{refs,math,gate} are DeepEP's own ($v2_utils), the rest of deep_ep is ours"
  fi
fi

mps_start() {
  [ "$mps" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1 || return 0
  export CUDA_MPS_PIPE_DIRECTORY="$scratch/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$scratch/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
}
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

port=$((20000 + RANDOM % 20000))
fail=0
printf '%-7s %-26s %5s  %-8s %7s  %s\n' library test nproc result seconds log | tee -a "$out/summary.txt"
for lib in "${libs[@]}"; do
  if [ "$lib" = ours ]; then libpath="$shim${ours_path:+:$ours_path}"; else libpath=$(cd "$deepep_site" && pwd); fi
  for t in "${test_paths[@]}"; do
    for n in "${nprocs[@]}"; do
      tag="$n"
      [ "$hosts" -gt 1 ] && tag="${hosts}x$n"
      t_name=${t%.py}
      log="$out/$lib-${t_name//\//_}-$tag.log"
      port=$((port + 1))
      mps_start
      start=$(date +%s)
      # One launch per emulated host (WORLD_SIZE / RANK are DeepEP's node count and node rank),
      # all in one process group of their own, so that every rank of a run that overruns is
      # ended by its group id. Each launch's output is prefixed with its host in the log.
      per_host=""
      [ "$lib" = ours ] && [ "$hosts" -gt 1 ] && per_host="DEEPEP_KERNELS_RANKS_PER_HOST=$n"
      (cd "$src/tests" && exec env PYTHONPATH="$here/conformance:$libpath${PYTHONPATH:+:$PYTHONPATH}" DEEPEP_CONFORMANCE_ADAPTER=1 \
        DEEPEP_CONFORMANCE_GPUS="$gpus" MASTER_ADDR=127.0.0.1 MASTER_PORT=$port PYTHONUNBUFFERED=1 \
        NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 $per_host \
        setsid bash -c '
          set -o pipefail
          hosts=$1 py=$2 t=$3 n=$4; shift 4
          [ "$hosts" -eq 1 ] && exec "$py" "$t" --num-processes "$n" "$@"
          pids=()
          for h in $(seq 0 $((hosts - 1))); do
            # a subshell per host: waiting on a background pipeline can see only the status of
            # its last command once it was reaped, whatever pipefail says
            (WORLD_SIZE=$hosts RANK=$h "$py" "$t" --num-processes "$n" "$@" 2>&1 | sed -u "s/^/[host $h] /") &
            pids+=($!)
          done
          rc=0
          for p in "${pids[@]}"; do wait "$p" || rc=1; done
          exit $rc' conformance "$hosts" "$py" "$t" "$n" $test_args) >"$log" 2>&1 &
      pid=$!
      result=""
      stop_run() {
        local pgid
        pgid=$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')
        [ -n "$pgid" ] && kill -TERM -- "-$pgid" 2>/dev/null
        sleep 5
        [ -n "$pgid" ] && kill -KILL -- "-$pgid" 2>/dev/null
      }
      while kill -0 "$pid" 2>/dev/null; do
        if [ -n "$stop_at" ] && grep -Eq -- "$stop_at" "$log" 2>/dev/null; then
          # reached: passed unless a rank already failed
          if grep -Eq "Traceback \(most recent call last\)|AssertionError" "$log"; then result="FAIL(stop)"; else result="PASS(stop)"; fi
          stop_run
          break
        fi
        if [ $(( $(date +%s) - start )) -ge "$limit" ]; then
          stop_run
          result=TIMEOUT
          break
        fi
        sleep 2
      done
      wait "$pid"; code=$?
      secs=$(( $(date +%s) - start ))
      [ -z "$result" ] && { [ "$code" -eq 0 ] && result=PASS || result="FAIL($code)"; }
      mps_stop
      printf '%-7s %-26s %5s  %-8s %7s  %s%s\n' "$lib" "$t" "$tag" "$result" "$secs" "$(basename "$log")" "${test_args:+  $test_args}" | tee -a "$out/summary.txt"
      if [ "${result%(stop)}" != PASS ]; then
        grep -E "Error|error|assert|Traceback" "$log" | grep -v "^\[conformance adapter\]" | tail -n 4 | sed 's/^/    /' | tee -a "$out/summary.txt"
        [ "$lib" = ours ] && fail=1
      fi
    done
  done
done
if [ "${RECORD:-0}" = 1 ]; then
  "$py" "$here/../../scripts/results.py" from-conformance "$out/summary.txt" --out "$out" --machine auto \
    --commit "${RECORD_COMMIT:-$(git -C "$here" rev-parse HEAD 2>/dev/null)}" --command "$invocation" \
    --slug "${RECORD_SLUG:-run}" ${test_args:+--test-args="$test_args"} ${stop_at:+--part "stopped at --stop-at $stop_at"} || fail=1
fi
exit $fail
