# GPU check: the kernels' GPU tests and a quick benchmark, two ranks on one host, against the
# NVSHMEM the kernels were built with. Needs a builder with the "cuda" system feature, which
# programs.nix-required-mounts turns into access to the GPU (/dev/nvidia*, the driver, and
# /sys if configured; see docs/nix.md). Kept out of `checks` so that `nix flake check` on
# CPU-only builders does not try to build it; exposed as `gpuChecks` and as
# deepep-kernels.gpuCheck.
{ lib
, runCommand
, deepep-kernels
,
}:
let
  inherit (deepep-kernels) nvshmem cudaPackages;
  sandbox = import ./gpu-sandbox.nix;
in
runCommand "deepep-kernels-gpu-check-${deepep-kernels.version}"
  (sandbox.env // {
    requiredSystemFeatures = [ "cuda" ];
    nativeBuildInputs = [ deepep-kernels ];
    NVSHMEM_DIR = "${nvshmem}";
    LD_LIBRARY_PATH = lib.makeLibraryPath [ (lib.getLib nvshmem) (lib.getLib cudaPackages.nccl) ] + ":/run/opengl-driver/lib";
    # The NCCL on LD_LIBRARY_PATH (the kernels' toolkit's; checks/cuda-major.nix compares it).
    passthru = { inherit deepep-kernels; inherit (cudaPackages) nccl; };
  })
  ''
    set -euo pipefail
    mkdir -p "$out"
    ${sandbox.requireGpu}
    echo "== deepep-gpu-tests --nproc 2" | tee "$out/gpu-tests.log"
    deepep-gpu-tests --nproc 2 2>&1 | tee -a "$out/gpu-tests.log"
    echo "== deepep-bench --nproc 2 --quick" | tee "$out/bench.log"
    deepep-bench --nproc 2 --quick 2>&1 | tee -a "$out/bench.log"
  ''
