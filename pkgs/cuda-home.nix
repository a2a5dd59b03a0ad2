# A CUDA toolkit root from nixpkgs' split CUDA packages, in the layout build systems expect
# under CUDA_HOME (kernels/build.rs) or CUDA=... (gdrcopy's Makefiles): bin/nvcc, include/
# (nvcc's crt headers, cudart, CCCL), lib/ (cudart) and lib/stubs/libcuda.so. Headers live in
# the `include` output of current nixpkgs CUDA packages (lib.getInclude falls back to dev/out).
#
# Which package holds what depends on the nixpkgs revision (docs/nix.md, "Audit against
# nixpkgs"), so every piece is taken where it exists:
#   - crt/ (host_config.h, which cuda_runtime.h includes): from CUDA 13 on only in `cuda_crt`
#     (nixpkgs pkgs/development/cuda-modules/packages/cuda_cudart.nix: "From CUDA 13.0,
#     crt/host_config.h is in cuda_crt"); later revisions also link nvcc's include/crt to it
#     (cuda_nvcc/package.nix) and build `cuda_crt` for CUDA 12 too. cuda_crt comes first in
#     `paths`, so include/crt is a real directory of the join whichever way nvcc ships it.
#   - CCCL: `cccl` where the set has it (packages/cccl.nix: pname "cccl" from CUDA 13.3, where
#     NVIDIA renamed the redistributable), else `cuda_cccl` (packages/cuda_cccl.nix, older sets).
{ lib
, symlinkJoin
, cudaPackages
, name
,
}:
let
  cccl = cudaPackages.cccl or cudaPackages.cuda_cccl;
in
symlinkJoin {
  inherit name;
  paths = lib.optional (cudaPackages ? cuda_crt) (lib.getInclude cudaPackages.cuda_crt)
    ++ (with cudaPackages; [
    (lib.getBin cuda_nvcc)
    (lib.getInclude cuda_nvcc)
    (lib.getInclude cuda_cudart)
    (lib.getLib cuda_cudart)
    (lib.getOutput "stubs" cuda_cudart)
    (lib.getInclude cccl)
  ]);
}
