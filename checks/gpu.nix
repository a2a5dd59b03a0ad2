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
in
runCommand "deepep-kernels-gpu-check-${deepep-kernels.version}"
{
  requiredSystemFeatures = [ "cuda" ];
  nativeBuildInputs = [ deepep-kernels ];
  # NVLink SHARP multicast is not available in every sandbox/VM; NVSHMEM and NCCL must not try it.
  NVSHMEM_DISABLE_NVLS = "1";
  NCCL_NVLS_ENABLE = "0";
  # The sandbox network is loopback only.
  NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME = "lo";
  NCCL_SOCKET_IFNAME = "lo";
  NVSHMEM_DIR = "${nvshmem}";
  LD_LIBRARY_PATH = lib.makeLibraryPath [ (lib.getLib nvshmem) (lib.getLib cudaPackages.nccl) ] + ":/run/opengl-driver/lib";
  # The NCCL on LD_LIBRARY_PATH (the kernels' toolkit's; checks/cuda-major.nix compares it).
  passthru = { inherit deepep-kernels; inherit (cudaPackages) nccl; };
}
  ''
    set -euo pipefail
    mkdir -p "$out"
    if ! ls /dev/nvidia0 >/dev/null 2>&1; then
      echo "no /dev/nvidia0 in the build sandbox: this builder advertises the 'cuda' feature but does not" >&2
      echo "mount the GPU; see docs/nix.md (programs.nix-required-mounts)." >&2
      exit 1
    fi
    echo "== deepep-gpu-tests --nproc 2" | tee "$out/gpu-tests.log"
    deepep-gpu-tests --nproc 2 2>&1 | tee -a "$out/gpu-tests.log"
    echo "== deepep-bench --nproc 2 --quick" | tee "$out/bench.log"
    deepep-bench --nproc 2 --quick 2>&1 | tee -a "$out/bench.log"
  ''
