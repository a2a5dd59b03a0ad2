#!/usr/bin/env bash
# Pack the runtime subset of an NVSHMEM prefix into one .tar.xz, to carry one release to a GPU
# machine without its per-architecture bitcode (3.8.0's CUDA 13 wheel unpacks to about 257 MB, its
# subset packs to about 48 MB): lib/libnvshmem_host.so.3 (+ the libnvshmem_host.so link DeepEP's
# build wants), every nvshmem_bootstrap_* and nvshmem_transport_* plugin (3.8.0's transports are
# .so.7, older ones .so.3: all are taken), lib/libnvshmem_device.a and include/ (to build DeepEP
# against it), and bin/ when present. No lib/*.bc.
#
# Usage: python/scripts/nvshmem-subset.sh PREFIX OUT.tar.xz | --help
#   The archive holds one folder named after the release (e.g. 3.8.0/lib/...), read from the
#   prefix's include/non_abi/nvshmem_version.h.
#
# --help prints this text and exits 0; wrong arguments print it and exit 2.
set -euo pipefail
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "${BASH_SOURCE[0]}"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
[ $# -eq 2 ] || { usage >&2; exit 2; }
prefix=$(cd "$1" && pwd) || exit 2
out=$2
hdr=$prefix/include/non_abi/nvshmem_version.h
[ -f "$hdr" ] && [ -f "$prefix/lib/libnvshmem_host.so.3" ] \
  || { echo "nvshmem-subset: $prefix is not an NVSHMEM prefix (needs include/non_abi/nvshmem_version.h and lib/libnvshmem_host.so.3)" >&2; exit 2; }
v=$(awk '/#define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION/ {printf "%s%s", sep, $3; sep="."}' "$hdr")
[[ "$v" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "nvshmem-subset: cannot read the release from $hdr" >&2; exit 2; }
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/$v/lib"
cp -a "$prefix/include" "$stage/$v/"
[ -d "$prefix/bin" ] && cp -a "$prefix/bin" "$stage/$v/"
(cd "$prefix/lib" && cp -a libnvshmem_host.so.3 libnvshmem_device.a nvshmem_bootstrap_*.so.* nvshmem_transport_*.so.* "$stage/$v/lib/")
ln -sf libnvshmem_host.so.3 "$stage/$v/lib/libnvshmem_host.so"
tar -C "$stage" --owner=0 --group=0 --sort=name -cf - "$v" | xz -T0 -6 > "$out"
echo "nvshmem-subset: $out ($(stat -c %s "$out") bytes, NVSHMEM $v)"
