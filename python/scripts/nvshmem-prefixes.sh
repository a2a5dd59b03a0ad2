#!/usr/bin/env bash
# Install NVSHMEM releases of the lock (CUDA 13, this machine's system) into one prefix each, with
# our own installer (`deepep-nix install --source pypi`: downloaded, verified against the pinned
# sha256, unpacked safely), for building a deepep_kernels wheel that serves each of them and for
# the release-matrix runner (python/scripts/nvshmem-matrix.sh).
#
# Usage: python/scripts/nvshmem-prefixes.sh [--dest DIR] [--deepep-nix BIN] [--list] [VERSION...]
#   VERSION...       releases to install (default: every CUDA 13 release in pkgs/nvshmem/releases.json,
#                    3.3.20 and later; DeepEP's minimum 3.3.9 has no CUDA 13 build)
#   --dest DIR       where the prefixes go, one DIR/<version> each (default: .toolchain/nvshmem)
#   --deepep-nix BIN the deepep-nix binary (default: target/release/deepep-nix, else
#                    target/debug/deepep-nix, else `cargo run --release -p deepep-nix --`)
#   --list           only print the versions that would be installed
# A prefix that already holds lib/libnvshmem_host.so.3 and lib/libnvshmem_device.a is kept.
# Prints, last, the line to build a wheel for all of them:
#   export DEEPEP_NVSHMEM_RELEASES=DIR/3.3.20:DIR/3.3.24:...
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest=$repo/.toolchain/nvshmem
bin=""
list_only=0
versions=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) dest=${2:?--dest needs a directory}; shift 2 ;;
    --deepep-nix) bin=${2:?--deepep-nix needs a path}; shift 2 ;;
    --list) list_only=1; shift ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "nvshmem-prefixes: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) versions+=("$1"); shift ;;
  esac
done
lock=$repo/pkgs/nvshmem/releases.json
system=$(uname -m)-linux
if [ ${#versions[@]} -eq 0 ]; then
  mapfile -t versions < <(python3 - "$lock" "$system" <<'PY'
import json, sys
lock = json.load(open(sys.argv[1]))
system = sys.argv[2]
out = []
for r in lock["releases"]:
    if r.get("systems", {}).get(system, {}).get("13", {}).get("pypi"):
        out.append(r["version"])
key = lambda v: tuple(int(x) for x in v.split("."))
print("\n".join(sorted(out, key=key)))
PY
)
fi
[ ${#versions[@]} -gt 0 ] || { echo "nvshmem-prefixes: no CUDA 13 release for $system in $lock" >&2; exit 1; }
if [ "$list_only" = 1 ]; then printf '%s\n' "${versions[@]}"; exit 0; fi
if [ -z "$bin" ]; then
  for b in "$repo/target/release/deepep-nix" "$repo/target/debug/deepep-nix"; do
    if [ -x "$b" ]; then bin=$b; break; fi
  done
fi
run_installer() {
  if [ -n "$bin" ]; then "$bin" "$@"; else (cd "$repo" && cargo run --quiet --release --locked -p deepep-nix -- "$@"); fi
}
mkdir -p "$dest"
joined=""
for v in "${versions[@]}"; do
  p=$dest/$v
  if [ -f "$p/lib/libnvshmem_host.so.3" ] && [ -f "$p/lib/libnvshmem_device.a" ]; then
    echo "nvshmem-prefixes: $v already in $p" >&2
  else
    echo "nvshmem-prefixes: installing NVSHMEM $v (cuda13, pypi) into $p" >&2
    run_installer install --repo "$repo" --version "$v" --cuda 13 --source pypi --prefix "$p" >&2
  fi
  joined+="${joined:+:}$p"
done
echo "export DEEPEP_NVSHMEM_RELEASES=$joined"
