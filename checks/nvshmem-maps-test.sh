#!/usr/bin/env bash
# Tests checks/nvshmem-maps.py (the one-NVSHMEM-per-process rule of the deep-ep install check and
# the GPU checks) on real processes, without torch or a GPU: stand-in `torch` and extension
# modules load a shared library named libnvshmem_host.so.3 with ctypes, from one or two
# directories, the way torch and an extension would (by path, by SONAME, or loading and closing
# it again as deepep_kernels._native.nvshmem_host_check does). The library is the real NVSHMEM
# 3.4.5 host library when DEEPEP_NVSHMEM_WHEEL names the wheel (unzip needed), else a copy of the
# system's libz (only the mapped file's name and path matter to the rule; the by-SONAME case
# needs the real one, whose SONAME is libnvshmem_host.so.3).
# Prints one summary line; exits 1 with the failing case.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
check="$here/nvshmem-maps.py"
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/a" "$t/b" "$t/py"

real=""
if [ -n "${DEEPEP_NVSHMEM_WHEEL:-}" ] && command -v unzip >/dev/null 2>&1; then
  unzip -q -o "$DEEPEP_NVSHMEM_WHEEL" 'nvidia/nvshmem/lib/libnvshmem_host.so.3' -d "$t/wheel"
  src="$t/wheel/nvidia/nvshmem/lib/libnvshmem_host.so.3"
  real=1
else
  src=$(python3 -c 'import ctypes.util, os, sys
n = ctypes.util.find_library("z")
for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64", "/usr/lib"):
    p = os.path.join(d, n or "libz.so.1")
    if os.path.exists(p):
        print(os.path.realpath(p)); sys.exit(0)
sys.exit("no libz found")')
fi
cp "$src" "$t/a/libnvshmem_host.so.3"
cp "$src" "$t/b/libnvshmem_host.so.3"

cat >"$t/py/torch.py" <<'PY'
import ctypes, os
if os.environ.get("TORCH_NVSHMEM"):
    _h = ctypes.CDLL(os.environ["TORCH_NVSHMEM"], mode=os.RTLD_GLOBAL)
PY
cat >"$t/py/ext_by_path.py" <<PY
import ctypes, os
_h = ctypes.CDLL("$t/a/libnvshmem_host.so.3", mode=os.RTLD_GLOBAL)
PY
cat >"$t/py/ext_by_soname.py" <<'PY'
import ctypes, os
_h = ctypes.CDLL("libnvshmem_host.so.3", mode=os.RTLD_GLOBAL)
PY
cat >"$t/py/binding.py" <<PY
import ctypes, _ctypes, os
def check():
    h = ctypes.CDLL("$t/a/libnvshmem_host.so.3", mode=os.RTLD_GLOBAL)
    _ctypes.dlclose(h._handle)
    return ("$t/a/libnvshmem_host.so.3", "3.4.5")
PY

n=0
# case NAME WANT(0|1) ENV... -- ARGS...
case_() {
  local name=$1 want=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local rc=0
  env PYTHONPATH="$t/py" "${envs[@]}" python3 "$check" "$@" >"$t/out" 2>&1 || rc=$?
  if { [ "$want" = 0 ] && [ "$rc" != 0 ]; } || { [ "$want" = 1 ] && [ "$rc" = 0 ]; }; then
    echo "nvshmem-maps case '$name': exit $rc, expected $([ "$want" = 0 ] && echo success || echo failure)" >&2
    cat "$t/out" >&2
    exit 1
  fi
  n=$((n + 1))
}
case_ "extension alone" 0 X=1 -- --expect "$t/a" ext_by_path
case_ "extension and torch map the same file" 0 TORCH_NVSHMEM="$t/a/libnvshmem_host.so.3" -- --expect "$t/a" ext_by_path
case_ "torch maps another copy" 1 TORCH_NVSHMEM="$t/b/libnvshmem_host.so.3" -- --expect "$t/a" ext_by_path
case_ "only torch's copy, not the expected one" 1 TORCH_NVSHMEM="$t/b/libnvshmem_host.so.3" -- --expect "$t/a"
case_ "nothing mapped at all" 1 X=1 -- --expect "$t/a"
case_ "binding loads and closes the expected one" 0 X=1 -- --expect "$t/a" --call binding.check binding
case_ "binding next to torch's other copy" 1 TORCH_NVSHMEM="$t/b/libnvshmem_host.so.3" -- --expect "$t/a" --call binding.check binding
case_ "intranode-only: torch's own is the only one" 0 TORCH_NVSHMEM="$t/b/libnvshmem_host.so.3" -- --at-most-one
case_ "intranode-only: two copies" 1 TORCH_NVSHMEM="$t/b/libnvshmem_host.so.3" -- --at-most-one ext_by_path
if [ -n "$real" ]; then
  # The loader hands an extension that needs the SONAME the copy torch loaded, whatever its own
  # search path says: the reason the device code must be built against torch's NVSHMEM.
  case_ "by SONAME next to torch's copy gets torch's" 1 TORCH_NVSHMEM="$t/b/libnvshmem_host.so.3" LD_LIBRARY_PATH="$t/a" -- --expect "$t/a" ext_by_soname
  case_ "by SONAME alone" 0 LD_LIBRARY_PATH="$t/a" -- --expect "$t/a" ext_by_soname
fi
echo "checks/nvshmem-maps.py: $n cases on real processes ($(if [ -n "$real" ]; then echo "NVSHMEM 3.4.5's libnvshmem_host.so.3 from the wheel"; else echo "a libz copy named libnvshmem_host.so.3"; fi))"
