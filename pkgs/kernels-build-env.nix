# What building the deepep-kernels crate needs from Nix, shared by the Rust package
# (pkgs/deepep-kernels) and the Python extension (pkgs/deepep-kernels-python), which both run
# kernels/build.rs: the one CUDA major check, CUDA_HOME (a toolkit join with bin/nvcc),
# NVSHMEM_DIR (empty = no NVSHMEM kernels) and the library directories the built objects load
# at run time (dlopen searches the loading object's RUNPATH): NVRTC, NCCL and the very NVSHMEM
# the cubins were linked against. libcuda comes from autoAddDriverRunpath in the packages.
{ lib
, symlinkJoin
, cudaPackages
, nvshmem
, # The package name for messages, and the fix to name when the majors differ.
  who
, fix
}:
let
  toolkitMajor = cudaPackages.cudaMajorVersion or "unknown";
  cudaHome = import ./cuda-home.nix {
    inherit lib symlinkJoin cudaPackages;
    name = "deepep-cuda-home-${cudaPackages.cudaMajorMinorVersion or "unknown"}";
  };
in
assert nvshmem == null || nvshmem.cudaMajor == toolkitMajor
  || throw "${who}: NVSHMEM ${nvshmem.version} is the CUDA ${nvshmem.cudaMajor} build but cudaPackages is CUDA ${toolkitMajor}; ${fix}";
{
  inherit cudaHome;
  # kernels/build.rs reads exactly these.
  env = {
    CUDA_HOME = "${cudaHome}";
    NVSHMEM_DIR = if nvshmem == null then "" else "${nvshmem}";
    # nixpkgs' nvcc resolves its default include path from its own package, not from the
    # symlinkJoin; name the joined include/ (cudart, CCCL) explicitly (build.rs appends these).
    DEEPEP_NVCC_FLAGS = "-I${cudaHome}/include";
  };
  runtimeRpath = lib.concatStringsSep ":" (
    [ "${lib.getLib cudaPackages.cuda_nvrtc}/lib" "${lib.getLib cudaPackages.nccl}/lib" ]
    ++ lib.optional (nvshmem != null) "${lib.getLib nvshmem}/lib"
  );
}
