# GPU check: the kernels' GPU tests and a quick benchmark, two ranks on one host, against the
# NVSHMEM the kernels were built with. Needs a builder with the "cuda" system feature, which
# programs.nix-required-mounts turns into access to the GPU (/dev/nvidia*, the driver, and
# /sys if configured; see docs/nix.md). Kept out of `checks` so that `nix flake check` on
# CPU-only builders does not try to build it; exposed as `gpuChecks` and as
# deepep-kernels.gpuCheck.
#
# With `pythonEnv` (the `python` dev shell's Python: torch + our deepep_kernels binding,
# pkgs/default.nix deepepKernelsPythonEnv) it first checks one NVSHMEM per process: after
# `import torch, deepep_kernels` and loading NVSHMEM's host library through the binding
# (deepep_kernels._native.nvshmem_host_check), /proc/self/maps must show exactly one
# libnvshmem_host.so.3, the one the binding's cubins were linked against (./nvshmem-maps.py).
{ lib
, runCommand
, deepep-kernels
, pythonEnv ? null
,
}:
let
  inherit (deepep-kernels) nvshmem cudaPackages;
  sandbox = import ./gpu-sandbox.nix;
  bindingNvshmem = pythonEnv.deepepKernels.nvshmem;
in
runCommand "deepep-kernels-gpu-check-${deepep-kernels.version}"
  (sandbox.env // {
    requiredSystemFeatures = [ "cuda" ];
    nativeBuildInputs = [ deepep-kernels ];
    NVSHMEM_DIR = "${nvshmem}";
    LD_LIBRARY_PATH = lib.makeLibraryPath [ (lib.getLib nvshmem) (lib.getLib cudaPackages.nccl) ] + ":/run/opengl-driver/lib";
    mapsCheck = ./nvshmem-maps.py;
    python = if pythonEnv == null then "" else "${pythonEnv}/bin/python";
    bindingNvshmemLib = if pythonEnv == null then "" else "${lib.getLib bindingNvshmem}/lib";
    # The NCCL on LD_LIBRARY_PATH (the kernels' toolkit's; checks/cuda-major.nix compares it).
    passthru = { inherit deepep-kernels pythonEnv; inherit (cudaPackages) nccl; };
  })
  ''
    set -euo pipefail
    mkdir -p "$out"
    ${sandbox.requireGpu}
    if [ -n "$python" ]; then
      echo "== one NVSHMEM per process (import torch, deepep_kernels; /proc/self/maps)" | tee "$out/nvshmem-maps.log"
      # The binding would prefer $NVSHMEM_DIR/lib (the kernels' NVSHMEM, set above for the Rust
      # binaries); the dev shell's Python runs without it.
      (unset NVSHMEM_DIR; export LD_LIBRARY_PATH=/run/opengl-driver/lib
       "$python" "$mapsCheck" --expect "$bindingNvshmemLib" \
         --call deepep_kernels._native.nvshmem_host_check deepep_kernels) 2>&1 | tee -a "$out/nvshmem-maps.log"
    fi
    echo "== deepep-gpu-tests --nproc 2" | tee "$out/gpu-tests.log"
    deepep-gpu-tests --nproc 2 2>&1 | tee -a "$out/gpu-tests.log"
    echo "== deepep-bench --nproc 2 --quick" | tee "$out/bench.log"
    deepep-bench --nproc 2 --quick 2>&1 | tee -a "$out/bench.log"
  ''
