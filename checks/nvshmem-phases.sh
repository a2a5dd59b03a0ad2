#!/usr/bin/env bash
# Runs the shell phases of pkgs/nvshmem/package.nix on a real NVSHMEM wheel without nixpkgs:
# the phase texts are taken from the flake evaluated against checks/stub-nixpkgs, then run in
# stdenv's order (unpack, install, autoAddDriverRunpath's stand-in, the hooks preFixup adds),
# and the package's own layout test (passthru.tests.layout) is run on the result.
# Not simulated: autoPatchelf (it needs nixpkgs' libraries) and stdenv's other fixup hooks.
#
#   checks/nvshmem-phases.sh <wheel> [<version>]      (default version: 3.4.5)
#
# Needs nix (flakes), unzip, patchelf (>= 0.14, for --add-rpath), readelf, python3.
set -euo pipefail

wheel=${1:?usage: $0 <nvidia_nvshmem_cu13 wheel> [version]}
version=${2:-3.4.5}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
wheel=$(readlink -f "$wheel")

for tool in unzip patchelf readelf python3; do
  command -v "$tool" >/dev/null || { echo "$0: $tool not found (Debian: apt-get install unzip patchelf binutils python3)" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

attr="nvshmem_$(echo "$version" | tr . _)_cuda13"
(cd "$repo" && nix eval --json \
  --override-input nixpkgs "path:$repo/checks/stub-nixpkgs" --no-write-lock-file \
  ".#packages.x86_64-linux" --apply "ps: let p = ps.$attr.override { source = \"pypi\"; }; in {
    inherit (p) unpackPhase installPhase preFixup extraRunpath;
    test = p.tests.layout.buildCommand;
    inherit (p.tests.layout) expectedRunpath;
    wheel = p.src.name;
  }") >"$work/phases.json" 2>"$work/eval.log" || { cat "$work/eval.log" >&2; exit 1; }

get() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$work/phases.json" "$1"; }

expected_name=$(get wheel)
if [ "$(basename "$wheel")" != "$expected_name" ]; then
  echo "$0: $wheel is not the pinned wheel of $attr ($expected_name)" >&2
  exit 1
fi

# What stdenv provides to the phases.
export NIX_BUILD_TOP="$work"
export src="$wheel"
for o in out lib dev static; do
  mkdir -p "$work/outputs/$o"
  export "$o=$work/outputs/$o"
done
extraRunpath=$(get extraRunpath)
runHook() { :; }
isELF() { [ "$(head -c4 "$1")" = $'\x7fELF' ]; }
postFixupHooks=()

mkdir "$work/build"
cd "$work/build"
eval "$(get unpackPhase)"
eval "$(get installPhase)"
eval "$(get preFixup)"
# autoAddDriverRunpath runs before the hooks preFixup appends.
for so in "$lib"/lib/*.so*; do
  if [ ! -L "$so" ] && isELF "$so"; then patchelf --add-rpath /run/opengl-driver/lib "$so"; fi
done
for hook in "${postFixupHooks[@]}"; do "$hook"; done

# The package's layout test, with the result as its input.
export nvshmem="$out" expectedRunpath
expectedRunpath=$(get expectedRunpath)
out="$work/test-out"
(eval "$(get test)")
[ -e "$out" ] || { echo "layout test did not finish" >&2; exit 1; }
echo "nvshmem $version (pypi) phases: layout test passed; $(ls "$lib/lib" | wc -l) files in lib, $(ls "$static/lib" | wc -l) in static"
