#!/usr/bin/env bash
# Check that the deepep_kernels wheel is reproducible: build it from two clones of one commit at
# different paths (each with its own .toolchain/ at its own path) and compare the wheels' bytes.
#
# Usage: python/scripts/check-reproducible.sh [--dev] [--keep] [COMMIT]
#   COMMIT  what to clone (default HEAD of this checkout; uncommitted changes are not built)
#   --dev   compare the --dev wheels instead of the release wheels
#   --keep  keep the two clones (printed) instead of deleting them
#
# Takes two full builds (about 4 minutes each on 2 cores for the release wheel). The CUDA/NVSHMEM
# pip wheels are copied from this checkout's .toolchain/wheels/ (installed first if missing), so
# nothing is downloaded twice; cargo's registry ($CARGO_HOME) is shared. Prints both sha256 and
# exits 0 when they are equal; otherwise lists the wheel members that differ and exits 1.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mode=--release
keep=0
commit=HEAD
for a in "$@"; do
  case "$a" in
    --dev) mode=--dev ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "check-reproducible: unknown option '$a' (use --dev, --keep or --help)" >&2; exit 2 ;;
    *) commit=$a ;;
  esac
done
rev=$(git -C "$repo" rev-parse --verify "$commit^{commit}")
bash "$repo/scripts/install-toolchain.sh" >/dev/null
work=$(mktemp -d)
trap 'if [ "$keep" = 0 ]; then rm -rf "$work"; else echo "check-reproducible: kept $work" >&2; fi' EXIT
# Two checkout paths of different lengths and names.
clones=("$work/a/x" "$work/bb/deepep-nix-second-clone")
for c in "${clones[@]}"; do
  mkdir -p "$(dirname "$c")"
  git clone --quiet --no-checkout "$repo" "$c"
  git -C "$c" checkout --quiet --detach "$rev"
  mkdir -p "$c/.toolchain/wheels"
  cp "$repo"/.toolchain/wheels/*.whl "$c/.toolchain/wheels/"
done
sums=()
for c in "${clones[@]}"; do
  echo "check-reproducible: building $mode in $c" >&2
  start=$(date +%s)
  # A clean environment for the toolchain: each clone installs and uses its own .toolchain/.
  (cd "$c" && env -u CUDA_HOME -u NVSHMEM_DIR -u DEEPEP_NVSHMEM_WHEEL -u SOURCE_DATE_EPOCH \
    -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS -u CARGO_TARGET_DIR \
    bash python/scripts/build-wheel.sh "$mode") > "$c.log" 2>&1 \
    || { tail -n 30 "$c.log" >&2; echo "check-reproducible: the build in $c failed (log: $c.log)" >&2; keep=1; exit 1; }
  whl=$(ls "$c"/target/wheels*/deepep_kernels-*.whl)  # a fresh clone: the one wheel built (--dev: wheels-dev/)
  sum=$(sha256sum "$whl" | cut -d' ' -f1)
  sums+=("$sum")
  echo "$sum  $whl ($(stat -c %s "$whl") bytes, built in $(( $(date +%s) - start )) s)"
done
if [ "${sums[0]}" = "${sums[1]}" ]; then
  echo "reproducible: commit $rev, $mode wheel sha256 ${sums[0]} from both clones"
  exit 0
fi
echo "NOT reproducible: commit $rev, $mode wheels differ; members that differ:" >&2
python3 - "${clones[@]}" <<'EOF' >&2
import hashlib, sys, zipfile, glob
zs = [zipfile.ZipFile(glob.glob(c + "/target/wheels*/deepep_kernels-*.whl")[0]) for c in sys.argv[1:]]
infos = [{i.filename: i for i in z.infolist()} for z in zs]
for name in sorted(set(infos[0]) | set(infos[1])):
    a, b = (i.get(name) for i in infos)
    if a is None or b is None:
        print(f"  {name}: only in {'the second' if a is None else 'the first'} wheel")
        continue
    da, db = zs[0].read(a), zs[1].read(b)
    if da != db:
        print(f"  {name}: contents differ ({len(da)} vs {len(db)} bytes)")
    elif (a.date_time, a.external_attr, a.compress_type) != (b.date_time, b.external_attr, b.compress_type):
        print(f"  {name}: zip metadata differs ({a.date_time} {a.external_attr:o} vs {b.date_time} {b.external_attr:o})")
EOF
if [ "$keep" = 0 ]; then echo "(rerun with --keep to compare the clones' files)" >&2; fi
exit 1
