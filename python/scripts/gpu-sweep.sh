#!/usr/bin/env bash
# Several GPU checks of the Python package in one device call, in the order given, each under its
# own time limit. Logs go to a scratch folder that is packed into $OUT/logs.tgz (with
# $OUT/summary.txt) after every job, so a call that hits its limit still brings back every job
# that finished. Each conformance and gpu-tests job writes a record (RECORD=1) into its log folder.
#
# Usage: python/scripts/gpu-sweep.sh JOB[:LIMIT_S] ... | --help
# Jobs (LIMIT_S: seconds for each run inside the job; the default is in brackets):
#   info              nvidia-smi, torch, the wheel
#   gpu-tests-N       python/tests/gpu at N ranks on one GPU under MPS (gpu-run.sh) [300]
#   v1-N[_N...]       DeepEP v1.2.1's test_intranode.py + test_low_latency.py at N ranks [120]
#   internode16       DeepEP v1.2.1's test_internode.py, 2 emulated hosts x 8 ranks (an H200) [240]
#   v2-N              DeepEP 2.1's elastic/test_ep.py --skip-perf-test at N ranks [200]; where
#                     the test's 256 experts do not divide among N ranks, --num-experts is the
#                     first of 256 + 32k that does (288 at 3 and 6 ranks)
#   v2-variants-N     the same with each of --do-cpu-sync 0, --allow-multiple-reduction 0,
#                     --deterministic, --masked-ratio 0.2, --num-tokens 1024, at N ranks [150];
#                     V2_VARIANTS='--deterministic|--num-tokens 1024' runs only those
#   deepep-build      DeepEP v1.2.1 built into /tmp/deepep-site against torch's NVSHMEM wheel [200]
#   bench-ll          bench.py --ranks 1 --mode ll --compare-deep-ep /tmp/deepep-site --rounds R [200]
#   bench-2           bench.py --ranks 2 --mode intranode --compare-deep-ep /tmp/deepep-site --rounds R,
#                     under MPS [300] (the low-latency ops are bench-ll's: under MPS DeepEP's LL
#                     grids of two ranks cannot all be resident on one GPU)
#   host-profile      host_profile.py, three runs [60 each]
#   host-profile-2    host_profile.py --mode intranode --ranks 2, under MPS [120]
#   bench-v2          bench.py --mode v2 --ranks 2 --rounds R, under MPS [300]
# A job written big:JOB runs only on a GPU of more than 100 GB (an H200), small:JOB only on a
# smaller one (an H100): one command line serves whichever machine comes.
# Each job's end line in summary.txt gives its exit status and the most GPU memory in use while it
# ran (all processes on GPU 0, from nvidia-smi every 2 s; "peak ? MiB" where nvidia-smi gives
# nothing): how near a job came to the card's limit, e.g. whether internode16 fits an H100.
# Environment: OUT (the folder that comes back; required), WHEEL (default: the one
# target/wheels/*x86_64*.whl), DEEPEP_V1 (default gpu-carry/deep-ep-v1.2.1: `git archive v1.2.1`
# of DeepEP), DEEPEP_V2 (default gpu-carry/deepep-2.1: python/scripts/deepep-v2-subset.sh),
# RECORD_COMMIT (the full commit the wheel was built from; default: the checkout's HEAD, which a
# copy without .git lacks), SCRATCH (default /tmp/gpu-sweep), BENCH_ROUNDS (R of the bench jobs;
# default 3). NVSHMEM_DISABLE_NVLS=1, NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are
# always set; any other variable (DEEPEP_KERNELS_KEEP_COMM_STREAMS=1, ...) passes through to the
# runs.
# The timing jobs (bench-*, host-profile*) refuse a dev-profile wheel (build-wheel.sh --dev writes
# one to target/wheels-dev; WHEEL can still name it).
# Exits 0 once every job ran (read summary.txt for each one's status), 2 on bad usage.
set -uo pipefail
usage() { sed -n '2,/^# Exits/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
[ -n "${OUT:-}" ] || { echo "gpu-sweep: set OUT (the folder that comes back)" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo" || exit 2
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
wheel=${WHEEL:-$(ls target/wheels/*x86_64*.whl 2>/dev/null | head -1)}
v1=${DEEPEP_V1:-gpu-carry/deep-ep-v1.2.1}
v2=${DEEPEP_V2:-gpu-carry/deepep-2.1}
commit=${RECORD_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
scratch=${SCRATCH:-/tmp/gpu-sweep}
mkdir -p "$scratch" "$OUT"
t0=$(date +%s)
note() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$scratch/summary.txt"; }
pack() { cp "$scratch/summary.txt" "$OUT/" 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$scratch" . 2>/dev/null; }
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=/tmp/gpu-sweep-mps-$1 CUDA_MPS_LOG_DIRECTORY=/tmp/gpu-sweep-mpslog-$1
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" && nvidia-cuda-mps-control -d; }
mps_off() { echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
timed_site() { # sets site: our wheel in a --target folder of its own (by its hash: two sweeps in
  # one call may test two wheels), installed once by the pip of the Python that has torch; false,
  # with a note, for a dev-profile wheel (build-wheel.sh --dev, in target/wheels-dev, which WHEEL can
  # name), which the timing jobs refuse
  site=/tmp/gpu-sweep-ours-$(sha256sum "$wheel" | cut -c1-12)
  [ -d "$site/deepep_kernels" ] \
    || python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel" >"$scratch/pip.log" 2>&1
  PYTHONPATH=$site python3 -c 'import sys, deepep_kernels._native as n; sys.exit(1 if n.DEBUG_BUILD else 0)' && return 0
  note "refused $job: $wheel is a dev-profile build; build python/scripts/build-wheel.sh --release for timings"; return 1; }
conf() { # SLUG LIMIT ARGS...: one deepep-conformance.sh run of our wheel, with a record
  local slug=$1 limit=$2; shift 2
  OUT=$scratch/$slug RECORD=1 RECORD_SLUG=$slug RECORD_COMMIT=$commit \
    python/scripts/deepep-conformance.sh --ours "$wheel" --only ours --timeout "$limit" "$@"
}
gpu_mib() { nvidia-smi --query-gpu="$1" --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9; }  # GPU 0's FIELD in MiB, or nothing
watcher=
watch_kill() { if [ -n "$watcher" ]; then kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null; watcher=; fi; }
watch_stop() { # stops the memory watcher; sets peak: the most MiB in use it saw, with one last sample (or "?")
  watch_kill; local u; u=$(gpu_mib memory.used); peak=$(cat "$scratch/peak-mib" 2>/dev/null)
  if [ -n "$u" ] && [ "${peak:-0}" -lt "$u" ]; then peak=$u; fi
  peak=${peak:-?}; }
watch_start() { # samples GPU 0's memory in use every 2 s into $scratch/peak-mib (the largest seen)
  watch_kill; rm -f "$scratch/peak-mib"
  ( p=0; while :; do u=$(gpu_mib memory.used); if [ -n "$u" ] && [ "$u" -gt "$p" ]; then p=$u; echo "$p" >"$scratch/peak-mib"; fi; sleep 2; done ) &
  watcher=$!; }
trap watch_kill EXIT
v2_experts() { # N: ' --num-experts E' where the test's default 256 experts do not divide among N ranks
  local e=256; while (( e % $1 )); do e=$((e + 32)); done; [ $e = 256 ] || echo -n " --num-experts $e"; }
[ -n "$wheel" ] && [ -f "$wheel" ] || { echo "gpu-sweep: no wheel (build it: python/scripts/build-wheel.sh --release, or set WHEEL)" >&2; exit 2; }
mem=$(gpu_mib memory.total)
big=0; [ "${mem:-0}" -gt 100000 ] 2>/dev/null && big=1
note "GPU memory ${mem:-?} MiB (big=$big), wheel $wheel, commit ${commit:-unknown}"
for spec in "$@"; do
  case $spec in
    big:*) spec=${spec#big:}; [ $big = 1 ] || { note "skip $spec (not more than 100 GB)"; continue; } ;;
    small:*) spec=${spec#small:}; [ $big = 0 ] || { note "skip $spec (more than 100 GB)"; continue; } ;;
  esac
  job=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=
  note "start $job"
  watch_start
  case $job in
    info) { nvidia-smi; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'; ls -l "$wheel"; } >"$scratch/info.txt" 2>&1 ;;
    gpu-tests-*) n=${job#gpu-tests-}
      OUT=$scratch/gpu-tests-$n MPS=1 RECORD=1 RECORD_SLUG=gpu-tests-$n RECORD_COMMIT=$commit SKIP_CPU_EXAMPLE=1 \
        DEEPEP_TEST_GPUS=1 DEEPEP_TEST_TIMEOUT_S=${limit:-300} DEEPEP_V2_SRC=$PWD/$v2 python/scripts/gpu-run.sh "$wheel" "$n" ;;
    v1-*) n=${job#v1-}; conf "v1-$n" "${limit:-120}" "$v1" ${n//_/ } ;;
    internode16) conf internode-16 "${limit:-240}" --tests test_internode.py --hosts 2 "$v1" 8 ;;
    v2-variants-*) n=${job#v2-variants-}
      IFS='|' read -r -a variants <<<"${V2_VARIANTS:---do-cpu-sync 0|--allow-multiple-reduction 0|--deterministic|--masked-ratio 0.2|--num-tokens 1024}"
      for a in "${variants[@]}"; do
        conf "v2-$n-$(echo "$a" | tr -d ' .-')" "${limit:-150}" --tests elastic/test_ep.py --test-args "--skip-perf-test$(v2_experts "$n") $a" "$v2" "$n"
        note "  $a at $n ranks: exit $?"; pack
      done ;;
    v2-*) n=${job#v2-}; conf "v2-$n" "${limit:-200}" --tests elastic/test_ep.py --test-args "--skip-perf-test$(v2_experts "$n")" "$v2" "$n" ;;
    deepep-build) ( cd "$v1" && CPATH="${CUDA_HOME:-/usr/local/cuda}/include/cccl" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
        timeout "${limit:-200}" python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/deepep-site . ) \
        >"$scratch/deepep-build.log" 2>&1 ;;
    bench-ll) timed_site || continue; PYTHONPATH=$site timeout "${limit:-200}" python3 python/scripts/bench.py --ranks 1 --mode ll \
        --compare-deep-ep /tmp/deepep-site --rounds "${BENCH_ROUNDS:-3}" --json "$scratch/bench-ll.json" >"$scratch/bench-ll.log" 2>&1 ;;
    bench-2) timed_site || continue; mps_on b2; PYTHONPATH=$site timeout "${limit:-300}" python3 python/scripts/bench.py --ranks 2 \
        --mode intranode --compare-deep-ep /tmp/deepep-site --rounds "${BENCH_ROUNDS:-3}" --json "$scratch/bench-2.json" >"$scratch/bench-2.log" 2>&1; rc=$?; mps_off; (exit $rc) ;;
    host-profile) timed_site || continue; rc=0; for i in 1 2 3; do PYTHONPATH=$site timeout "${limit:-60}" python3 python/scripts/host_profile.py \
        --json "$scratch/host-profile-$i.json" >"$scratch/host-profile-$i.log" 2>&1 || rc=$?; done; (exit $rc) ;;
    host-profile-2) timed_site || continue; mps_on hp2; PYTHONPATH=$site timeout "${limit:-120}" python3 python/scripts/host_profile.py \
        --mode intranode --ranks 2 --json "$scratch/host-profile-2.json" >"$scratch/host-profile-2.log" 2>&1; rc=$?; mps_off; (exit $rc) ;;
    bench-v2) timed_site || continue; mps_on bv2; PYTHONPATH=$site timeout "${limit:-300}" python3 python/scripts/bench.py --mode v2 --ranks 2 \
        --rounds "${BENCH_ROUNDS:-3}" --json "$scratch/bench-v2.json" >"$scratch/bench-v2.log" 2>&1; rc=$?; mps_off; (exit $rc) ;;
    *) note "unknown job '$job' (see --help)"; continue ;;
  esac
  rc=$?; watch_stop
  note "end $job: exit $rc, peak $peak MiB of ${mem:-?} MiB GPU memory in use"
  pack
done
note "all done"
pack
