#!/usr/bin/env bash
# Run CI exactly as a fresh CI machine would: a fresh clone of the committed HEAD (uncommitted
# changes are not in it), empty cargo and pip caches, then `CI=true bash .ci/run`.
#
# Usage: scripts/ci-fresh.sh [--keep] [--help]
#   --keep   leave the scratch folder (clone, CARGO_HOME, PIP_CACHE_DIR, log) for inspection
#
# A warm cache hides missing steps (a crate that only an earlier build downloaded, a wheel that
# only an earlier session installed); this is the way to see what CI will see. The rustup
# toolchain itself (RUSTUP_HOME) is kept: CI machines have it. Takes about as long as CI with
# empty caches (downloads the crates, the CUDA pip toolchain, Debian 13's Nix into target/tools/
# and the pinned deadnix/nixpkgs-fmt builds).
# Prints the elapsed time and the scratch folder's largest size (sampled every 5 s: the clone with
# target/ and .toolchain/, CARGO_HOME, the pip cache; not /nix) and exits with .ci/run's status.
set -euo pipefail
keep=0
for a in "$@"; do
  case "$a" in
    --keep) keep=1 ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "ci-fresh: unknown argument '$a' (use --keep or --help)" >&2; exit 2 ;;
  esac
done
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/deepep-ci-fresh.XXXXXX")
sampler=
cleanup() {
  if [ -n "$sampler" ]; then kill "$sampler" 2>/dev/null || true; fi
  if [ "$keep" = 1 ]; then echo "ci-fresh: kept $scratch"; else rm -rf "$scratch"; fi; }
trap cleanup EXIT
git clone --quiet "$repo" "$scratch/main"
# CI lays shared/ beside the clone; copy it when this checkout has one beside it.
if [ -d "$repo/../shared" ]; then cp -r "$repo/../shared" "$scratch/shared"; fi
mkdir -p "$scratch/cargo-home" "$scratch/pip-cache"
echo "ci-fresh: $(git -C "$scratch/main" rev-parse --short HEAD) in $scratch/main, CARGO_HOME and PIP_CACHE_DIR empty"
start=$(date +%s)
# Disk use over the run (CI machines have run out of disk): the largest of samples every 5 s.
(peak=0; while :; do
   mb=$(du -sm "$scratch" 2>/dev/null | cut -f1); mb=${mb:-0}
   if [ "$mb" -gt "$peak" ]; then peak=$mb; echo "$peak" > "$scratch/peak-mb"; fi
   sleep 5
 done) &
sampler=$!
set +e
(cd "$scratch/main" && env CARGO_HOME="$scratch/cargo-home" PIP_CACHE_DIR="$scratch/pip-cache" CI=true \
  bash .ci/run 2>&1) | tee "$scratch/ci.log"
rc=${PIPESTATUS[0]}
set -e
kill "$sampler" 2>/dev/null || true
wait "$sampler" 2>/dev/null || true
sampler=
echo "ci-fresh: .ci/run exited $rc after $(( $(date +%s) - start )) s;" \
  "scratch folder at most $(cat "$scratch/peak-mb" 2>/dev/null || echo '?') MB (sampled every 5 s)"
exit "$rc"
