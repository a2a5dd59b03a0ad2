#!/usr/bin/env bash
# Runs every test that needs neither a GPU nor network beyond the package registries:
#   1. installs the pinned CUDA 13.0 pip toolchain + NVSHMEM 3.4.5 wheel into .toolchain/
#   2. cargo clippy of the whole workspace, warnings as errors (in target/clippy, removed after it:
#      no disk on top of the test build), then cargo tests of the whole workspace (generator,
#      doctor, kernels CPU tests, cubin checks, the kernels' harness crate kernels/harness:
#      launcher across processes, bench unit tests)
#   3. the generator's determinism check on the committed files (lock --offline --check) and
#      verify --file on the real wheel
#   4. Nix (scripts/nix-checks.sh): parse, pure evaluation tests, the flake against the stand-in
#      nixpkgs, deadnix, formatter; on Nix >= 2.18 (a new enough Nix on PATH, else Debian 13's 2.26
#      unpacked into target/tools/ by scripts/debian-nix.sh)
#   5. the Python wheel (python/, maturin abi3, dev profile) and its CPU tests with pytest (no torch)
# Prints a final line "total: N passed, M failed" that counts every suite (clippy, cargo tests,
# the two generator checks, each Nix check, pytest) and exits non-zero on any failure. Every
# cargo test binary runs (--no-fail-fast: a failing one does not stop the others); a binary that
# gives no result line (it crashed, or was killed) counts as one failure and is named, and a
# line "not run: ..." lists ignored cargo tests, skipped pytest tests and skipped Nix checks (a
# cargo test that skips itself, printing "skipped: ...", passes and is counted as passed).
# Run as root on Debian, scripts/nix-checks.sh apt-get installs what two Nix checks need and the
# machine lacks (nix-bin, unzip, patchelf, binutils), system-wide; this script names them first.
# DEEPEP_NO_APT=1 installs nothing (those checks are then skipped or use what is there).
#
# --cargo-summary LOG [RC] prints only the cargo part of the summary for a saved `cargo test`
# log (RC: cargo's exit status, default 0) and exits (generator/tests/test_all_summary.rs).
#
# Usage: scripts/test-all.sh [--help | --cargo-summary LOG [RC]]
set -euo pipefail

# The cargo part of the summary, from cargo's log $1 and exit status $2: FAIL lines for binaries
# without a result and for a failed run without a failing test, then one line
# "cargo test: B test binaries run, P passed, F failed, I ignored".
cargo_summary() {
  local log=$1 rc=$2 passed failed ignored no_result binaries n
  passed=$( (grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed' "$log" || true) | awk '{s+=$4} END {print s+0}')
  failed=$( (grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed' "$log" || true) | awk '{s+=$6} END {print s+0}')
  ignored=$( (grep -Eo 'test result: .* [0-9]+ ignored' "$log" || true) | (grep -Eo '[0-9]+ ignored' || true) | awk '{s+=$1} END {print s+0}')
  # Each "Running <binary>" must end in a "test result:" line; one that does not crashed (or was
  # killed) and its tests are in neither count: one failure each, named.
  no_result=$(awk '/^ +Running /{ if (bin != "") print bin; sub(/^ +Running +/, ""); bin=$0; next }
                   /^test result:/{ bin="" } END { if (bin != "") print bin }' "$log")
  binaries=$(grep -cE '^ +Running ' "$log" || true)
  if [ -n "$no_result" ]; then
    n=$(printf '%s\n' "$no_result" | wc -l)
    echo "FAIL  cargo test: no result from $n of $binaries test binaries (crashed or killed): $(printf '%s; ' "$no_result" | sed 's/; $//')"
    failed=$((failed + n))
  fi
  if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
    echo "FAIL  cargo test exited $rc without a failing test (a build error? see above)"; failed=1
  fi
  echo "cargo test: $binaries test binaries run, $passed passed, $failed failed, $ignored ignored"
}

case "${1:-}" in
  -h|--help) sed -n '2,/^# Usage:/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --cargo-summary)
    [ -f "${2:-}" ] || { echo "test-all: --cargo-summary needs a saved cargo test log (got '${2:-}')" >&2; exit 2; }
    cargo_summary "$2" "${3:-0}"; exit 0 ;;
  "") ;;
  *) echo "test-all: unknown argument '$1' (it takes none; --help prints what it runs)" >&2; exit 2 ;;
esac
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT
step() { printf '\n==> %s\n' "$*"; }

# Disk: CI machines have had little free space (one run stopped with "No space left on device"
# while compiling the tests). A one-off test build needs no incremental cache and no debug info
# (a failing test still prints its panic's file and line; CI sets no RUST_BACKTRACE): target/
# shrinks from 3.0 GB to under 1 GB (README "Requirements"). The build-wheel step's dev build
# inherits both settings, so it still reuses this build's crates.
export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=0
step "free disk space here (df -h .)"
df -h . | tail -n1
# A run from empty caches needs about 2.3 GB (README, measured by scripts/ci-fresh.sh); say so before compiling
# instead of leaving only rustc's "No space left on device" minutes later.
avail_mb=$(df -Pm . | awk 'NR==2 {print $4}')
if [ -n "$avail_mb" ] && [ "$avail_mb" -lt 2400 ]; then
  echo "warning: only ${avail_mb} MB free here; a run from empty caches needs about 2.3 GB" \
    "(target/, .toolchain/, CARGO_HOME, /nix). Free some space or the build may stop with 'No space left on device'" >&2
fi

# Say what a root run installs outside this checkout before anything is installed.
apt_plan=$(DEEPEP_NVSHMEM_WHEEL=planned bash scripts/nix-checks.sh --apt-plan | tr '\n' ' ')
if [ -n "$apt_plan" ]; then
  echo "note: running as root, so the Nix checks will apt-get install, system-wide: ${apt_plan% }" \
    "(nix-bin: Debian 12's Nix 2.8, to show the stand-in nixpkgs refusing it; unzip/patchelf/binutils: the" \
    "NVSHMEM package phases). To install nothing, run as a normal user or with DEEPEP_NO_APT=1 (those checks" \
    "are then skipped or use what is there)." >&2
fi

step "toolchain (pip wheels -> .toolchain/)"
bash scripts/install-toolchain.sh >/dev/null
eval "$(bash scripts/install-toolchain.sh --print-env)"
export CUDA_HOME NVSHMEM_DIR DEEPEP_NVSHMEM_WHEEL
echo "CUDA_HOME=$CUDA_HOME"; echo "NVSHMEM_DIR=$NVSHMEM_DIR"; echo "DEEPEP_NVSHMEM_WHEEL=$DEEPEP_NVSHMEM_WHEEL"

step "cargo fetch --locked (every crate of Cargo.lock, for every platform)"
# cargo test below downloads only this platform's crates; the Nix check of pkgs/workspace-src.nix
# runs `cargo metadata --offline`, which needs every platform's (as Nix's vendoring of Cargo.lock
# does). Fetching the whole lock first makes the run independent of what an earlier build left in
# CARGO_HOME.
cargo fetch --locked

# Each of these steps counts as one test in the total; a failure is counted, not a stop.
gen_passed=0; gen_failed=0
step "cargo clippy --workspace --all-targets -- -D warnings"
if cargo clippy --workspace --all-targets --locked --target-dir target/clippy -- -D warnings; then gen_passed=$((gen_passed + 1)); else
  echo "FAIL  cargo clippy (fix the lints above; a false positive gets an #[allow] with its reason)"; gen_failed=$((gen_failed + 1)); fi
rm -rf target/clippy

step "cargo test --workspace --no-fail-fast"
set +e
cargo test --workspace --all-targets --locked --no-fail-fast 2>&1 | tee "$log_dir/cargo.log"
cargo_rc=${PIPESTATUS[0]}
set -e

step "deepep-nix lock --offline --check (committed Nix data is reproducible)"
if cargo run --quiet --locked -p deepep-nix -- lock --offline --check; then gen_passed=$((gen_passed + 1)); else
  echo "FAIL  deepep-nix lock --offline --check"; gen_failed=$((gen_failed + 1)); fi

step "deepep-nix verify --file (real wheel bytes against the pinned hash)"
if cargo run --quiet --locked -p deepep-nix -- verify --file "$DEEPEP_NVSHMEM_WHEEL"; then gen_passed=$((gen_passed + 1)); else
  echo "FAIL  deepep-nix verify --file"; gen_failed=$((gen_failed + 1)); fi

step "Nix checks"
set +e
bash scripts/nix-checks.sh 2>&1 | tee "$log_dir/nix.log"
nix_rc=${PIPESTATUS[0]}
set -e
# nix-checks.sh ends with "nix checks: N passed, M failed" (also when no usable Nix was found).
nix_summary=$(grep -E '^nix checks: [0-9]+ passed, [0-9]+ failed' "$log_dir/nix.log" | tail -n1 || true)
nix_passed=$(echo "$nix_summary" | awk '{print $3}')
nix_failed=$(echo "$nix_summary" | awk '{print $5}')
nix_passed=${nix_passed:-0}; nix_failed=${nix_failed:-0}
if [ "$nix_rc" -ne 0 ] && [ "$nix_failed" -eq 0 ]; then
  echo "FAIL  scripts/nix-checks.sh exited $nix_rc without its summary line"; nix_failed=1
fi

step "Python wheel (maturin, abi3) + CPU tests (pytest; no GPU, no torch)"
set +e
bash python/scripts/build-wheel.sh --dev --test 2>&1 | tee "$log_dir/py.log"
py_rc=${PIPESTATUS[0]}
set -e

cargo_summary "$log_dir/cargo.log" "$cargo_rc" | tee "$log_dir/cargo-summary.txt"
read -r passed failed ignored < <(sed -n 's/^cargo test: [0-9]* test binaries run, \([0-9]*\) passed, \([0-9]*\) failed, \([0-9]*\) ignored$/\1 \2 \3/p' "$log_dir/cargo-summary.txt")
# pytest's summary line, e.g. "46 passed, 1 skipped in 0.61s" or "2 failed, 44 passed in 0.70s"
py_summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log_dir/py.log" | tail -n1 || true)
py_passed=$(echo "$py_summary" | grep -Eo '[0-9]+ passed' | awk '{print $1}' || true)
py_failed=$( (echo "$py_summary" | grep -Eo '[0-9]+ (failed|error)' || true) | awk '{s+=$1} END {print s+0}')
py_passed=${py_passed:-0}
if [ "$py_rc" -ne 0 ] && [ "$py_failed" -eq 0 ]; then py_failed=1; fi
echo "python: $py_passed passed, $py_failed failed ($py_summary)"
py_skipped=$( (echo "$py_summary" | grep -Eo '[0-9]+ skipped' || true) | awk '{s+=$1} END {print s+0}')
nix_skipped=$(grep -cE '^skip  ' "$log_dir/nix.log" || true)
echo "clippy and generator checks: $gen_passed passed, $gen_failed failed"
echo "nix: $nix_passed passed, $nix_failed failed"
passed=$((passed + gen_passed + nix_passed + py_passed))
failed=$((failed + gen_failed + nix_failed + py_failed))
if [ "$ignored" -gt 0 ] || [ "$py_skipped" -gt 0 ] || [ "$nix_skipped" -gt 0 ]; then
  echo "not run: $ignored cargo tests ignored, $py_skipped pytest tests skipped, $nix_skipped Nix checks skipped (their 'skip' lines are above); none of these is in the total"
fi
echo
echo "total: $passed passed, $failed failed"
[ "$cargo_rc" -eq 0 ] && [ "$nix_rc" -eq 0 ] && [ "$py_rc" -eq 0 ] && [ "$failed" -eq 0 ]
