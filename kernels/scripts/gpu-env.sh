#!/usr/bin/env bash
# Sourced by gpu-sweep.sh and gpu-oversub.sh: the run-time environment of the deepep-kernels
# binaries on a GPU machine, taken from the Python venv's NVIDIA wheels ($PYTHON, default python3):
# LD_LIBRARY_PATH with the NVSHMEM host library (the version the cubins were linked against, 3.4.5)
# and NCCL, a libnccl.so link for cudarc, CUPTI for kernel timestamps, NVLink multicast off.
# Sets NVS_LIB, NCCL_LIB, DEEPEP_CUPTI_LIB, SHIM (a temporary folder the caller removes).
PYTHON="${PYTHON:-python3}"

# Library directories of the wheels (the NVSHMEM host library must be the version the cubins were
# linked against: 3.4.5).
wheel_lib() {  # module -> its lib/ directory, empty if the wheel is missing
  "$PYTHON" - "$1" <<'PY' 2>/dev/null
import importlib, os, sys
try:
    m = importlib.import_module(sys.argv[1])
except Exception:
    sys.exit(0)
for p in list(getattr(m, "__path__", [])):
    d = os.path.join(p, "lib")
    if os.path.isdir(d):
        print(d)
        break
PY
}
NVS_LIB="$(wheel_lib nvidia.nvshmem)"
NCCL_LIB="$(wheel_lib nvidia.nccl)"
# CUPTI (kernel timestamps for the bench's 'kernel us' column, DeepEP's method): any
# nvidia/*/lib/libcupti.so* of the venv (nvidia-cuda-cupti ships nvidia/cu13/lib/libcupti.so.13).
if [[ -z "${DEEPEP_CUPTI_LIB:-}" ]]; then
  DEEPEP_CUPTI_LIB="$("$PYTHON" - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
except Exception:
    raise SystemExit
for p in list(nvidia.__path__):
    hits = sorted(glob.glob(os.path.join(p, "*", "lib", "libcupti.so*")))
    if hits:
        print(hits[0])
        break
PY
)"
fi
if [[ -n "$DEEPEP_CUPTI_LIB" ]]; then export DEEPEP_CUPTI_LIB; else unset DEEPEP_CUPTI_LIB; fi
[[ -n "$NVS_LIB" ]] || echo "gpu-sweep: warning: nvidia-nvshmem-cu13 not found by $PYTHON; NVSHMEM modes will fail to start" >&2
[[ -n "$NCCL_LIB" ]] || echo "gpu-sweep: warning: nvidia-nccl-cu13 not found by $PYTHON; the NCCL baseline will be missing" >&2

# cudarc looks for libnccl.so (unversioned); the wheel ships only libnccl.so.2.
SHIM="$(mktemp -d)"
if [[ -n "$NCCL_LIB" && -e "$NCCL_LIB/libnccl.so.2" ]]; then
  ln -s "$NCCL_LIB/libnccl.so.2" "$SHIM/libnccl.so"
fi
for d in "$NVS_LIB" "$NCCL_LIB" "$SHIM"; do
  [[ -n "$d" ]] && LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export LD_LIBRARY_PATH
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
export RUST_LOG="${RUST_LOG:-info}"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE   # the binaries launch their own ranks

