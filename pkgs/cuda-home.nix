# A CUDA toolkit root from nixpkgs' split CUDA packages, in the layout build systems expect
# under CUDA_HOME (kernels/build.rs) or CUDA=... (gdrcopy's Makefiles): bin/nvcc, include/
# (nvcc's crt headers, cudart, CCCL), lib/ (cudart) and lib/stubs/libcuda.so. Headers live in
# the `include` output of current nixpkgs CUDA packages (lib.getInclude falls back to dev/out).
{ lib
, symlinkJoin
, cudaPackages
, name
,
}:
symlinkJoin {
  inherit name;
  paths = with cudaPackages; [
    (lib.getBin cuda_nvcc)
    (lib.getInclude cuda_nvcc)
    (lib.getInclude cuda_cudart)
    (lib.getLib cuda_cudart)
    (lib.getOutput "stubs" cuda_cudart)
    (lib.getInclude cuda_cccl)
  ];
}
