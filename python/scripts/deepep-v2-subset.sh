#!/usr/bin/env bash
# Extract the part of DeepEP 2.1 that the V2 conformance run needs from a DeepEP git repository:
# tests/ (elastic/test_ep.py, the legacy V1 tests, ...) and deep_ep/utils/ (the bitwise references
# refs.py, math.py, gate.py that python/scripts/deepep-conformance.sh puts over ours), about 200 KB,
# small enough to carry to a GPU machine. Nothing of DeepEP is copied into this repository: write it
# into an untracked folder such as gpu-carry/deepep-2.1 (gpu-carry/ is in .gitignore).
#
# Usage: python/scripts/deepep-v2-subset.sh [--repo GIT_DIR] [--commit REV] OUTDIR
#   OUTDIR        created (or, when it holds an earlier subset, replaced); must not be another folder
#   --repo DIR    a DeepEP git repository, bare or checked out (default: $DEEPEP_REPO, else
#                 /work/.mirror/deepseek-ai+DeepEP/repo when it exists)
#   --commit REV  the commit to extract (default dd758ca, DeepEP 2.1)
# OUTDIR/.deepep-subset names the full commit and the paths taken. Then, on the GPU machine:
#   python/scripts/deepep-conformance.sh --only ours --tests elastic/test_ep.py \
#     --test-args --skip-perf-test OUTDIR 2 4 8
set -euo pipefail
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
repo=${DEEPEP_REPO:-}
commit=dd758ca
while [ $# -gt 0 ]; do
  case "$1" in
    --repo) repo=${2:?--repo needs a folder}; shift 2 ;;
    --commit) commit=${2:?--commit needs a revision}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --*) echo "deepep-v2-subset: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -eq 1 ] || { usage >&2; exit 2; }
out=$1
if [ -z "$repo" ] && [ -d /work/.mirror/deepseek-ai+DeepEP/repo ]; then repo=/work/.mirror/deepseek-ai+DeepEP/repo; fi
[ -n "$repo" ] || { echo "deepep-v2-subset: no DeepEP repository: pass --repo (a clone of deepseek-ai/DeepEP) or set DEEPEP_REPO" >&2; exit 2; }
git -C "$repo" rev-parse --git-dir >/dev/null 2>&1 || { echo "deepep-v2-subset: --repo $repo is not a git repository" >&2; exit 2; }
full=$(git -C "$repo" rev-parse --verify --quiet "$commit^{commit}") \
  || { echo "deepep-v2-subset: $repo has no commit '$commit' (fetch DeepEP's history, or pass --commit)" >&2; exit 2; }
paths=(tests deep_ep/utils)
for p in "${paths[@]}" tests/elastic/test_ep.py deep_ep/utils/refs.py deep_ep/utils/math.py deep_ep/utils/gate.py; do
  git -C "$repo" cat-file -e "$full:$p" 2>/dev/null \
    || { echo "deepep-v2-subset: commit $full has no $p: not a DeepEP 2.x tree (2.1 is dd758ca)" >&2; exit 2; }
done
if [ -e "$out" ]; then
  [ -d "$out" ] || { echo "deepep-v2-subset: $out exists and is not a folder" >&2; exit 2; }
  if [ -n "$(ls -A "$out")" ]; then
    [ -f "$out/.deepep-subset" ] || { echo "deepep-v2-subset: $out is a non-empty folder that holds no earlier subset; name a new or empty folder" >&2; exit 2; }
    rm -rf "$out"
  fi
fi
mkdir -p "$out"
git -C "$repo" archive "$full" "${paths[@]}" | tar -x -C "$out"
printf 'commit %s\npaths %s\n' "$full" "${paths[*]}" > "$out/.deepep-subset"
echo "deepep-v2-subset: $out ($(du -sk "$out" | cut -f1) KB): ${paths[*]} of DeepEP $full"
