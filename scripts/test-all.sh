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
# the two generator checks, each Nix check, pytest) and exits non-zero on any failure.
#
# Usage: scripts/test-all.sh [--help]
set -euo pipefail
for a in "$@"; do
  case "$a" in
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "test-all: unknown argument '$a' (it takes none; --help prints what it runs)" >&2; exit 2 ;;
  esac
done
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
# A run from empty caches needs about 2.2 GB (README "Requirements"); say so before compiling
# instead of leaving only rustc's "No space left on device" minutes later.
avail_mb=$(df -Pm . | awk 'NR==2 {print $4}')
if [ -n "$avail_mb" ] && [ "$avail_mb" -lt 2300 ]; then
  echo "warning: only ${avail_mb} MB free here; a run from empty caches needs about 2.2 GB" \
    "(target/, .toolchain/, CARGO_HOME, /nix). Free some space or the build may stop with 'No space left on device'" >&2
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

step "cargo test --workspace"
set +e
cargo test --workspace --all-targets --locked 2>&1 | tee "$log_dir/cargo.log"
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

passed=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed' "$log_dir/cargo.log" | awk '{s+=$4} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed;' "$log_dir/cargo.log" | awk '{s+=$1} END {print s+0}')
if [ "$cargo_rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
# pytest's summary line, e.g. "46 passed, 1 skipped in 0.61s" or "2 failed, 44 passed in 0.70s"
py_summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log_dir/py.log" | tail -n1 || true)
py_passed=$(echo "$py_summary" | grep -Eo '[0-9]+ passed' | awk '{print $1}' || true)
py_failed=$( (echo "$py_summary" | grep -Eo '[0-9]+ (failed|error)' || true) | awk '{s+=$1} END {print s+0}')
py_passed=${py_passed:-0}
if [ "$py_rc" -ne 0 ] && [ "$py_failed" -eq 0 ]; then py_failed=1; fi
echo "python: $py_passed passed, $py_failed failed ($py_summary)"
echo "clippy and generator checks: $gen_passed passed, $gen_failed failed"
echo "nix: $nix_passed passed, $nix_failed failed"
passed=$((passed + gen_passed + nix_passed + py_passed))
failed=$((failed + gen_failed + nix_failed + py_failed))
echo
echo "total: $passed passed, $failed failed"
[ "$cargo_rc" -eq 0 ] && [ "$nix_rc" -eq 0 ] && [ "$py_rc" -eq 0 ] && [ "$failed" -eq 0 ]
