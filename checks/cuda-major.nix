# The CUDA major of every default output that has one is the one pkgs/default.nix chose
# (`cudaMajor`, from pkgs/nvshmem/lib.nix defaultCudaMajor): NVSHMEM, the kernels' toolkit,
# the dev shells' nvcc, the GPU check's NCCL, gdrcopy's tools, the Python package (and the
# `python` dev shell's build of it); and every package that carries
# both an NVSHMEM and a toolkit has them of one major. Pure evaluation (a flake check, and
# scripts/nix-checks.sh runs it with the stub nixpkgs, where pkgs.cudaPackages is CUDA 12 as in
# many nixpkgs revisions). Returns the compared values, or throws naming each disagreement.
{ pkgs, cudaMajor, packages, devShells, gpuChecks }:
let
  inherit (builtins) any attrNames concatStringsSep filter map;
  optionals = cond: xs: if cond then xs else [ ];
  toolkit = pkgs."cudaPackages_${cudaMajor}";
  majorOf = cudaPackages: cudaPackages.cudaMajorVersion or "unknown";
  # A package is compared by its store path (two toolkits' nvcc/NCCL are different paths).
  isPkg = want: p: (p.outPath or null) == want.outPath;
  shellNvcc = shell: if any (isPkg toolkit.cuda_nvcc) (shell.nativeBuildInputs or [ ]) then cudaMajor else "not ${cudaMajor} (no cudaPackages_${cudaMajor}.cuda_nvcc among its packages)";

  rows = [
    { what = "packages.nvshmem"; got = packages.nvshmem.cudaMajor; }
    { what = "packages.deepep-kernels (toolkit)"; got = majorOf packages.deepep-kernels.cudaPackages; }
    { what = "packages.deepep-kernels (its NVSHMEM)"; got = packages.deepep-kernels.nvshmem.cudaMajor; }
    { what = "packages.deepep-kernels-no-nvshmem (toolkit)"; got = majorOf packages.deepep-kernels-no-nvshmem.cudaPackages; }
    { what = "packages.gdrcopy (toolkit)"; got = majorOf packages.gdrcopy.cudaPackages; }
    { what = "devShells.default (nvcc)"; got = shellNvcc devShells.default; }
    { what = "devShells.no-nvshmem (nvcc)"; got = shellNvcc devShells.no-nvshmem; }
    { what = "gpuChecks.kernels (NCCL)"; got = if isPkg toolkit.nccl gpuChecks.kernels.nccl then cudaMajor else "not ${cudaMajor} (not cudaPackages_${cudaMajor}.nccl)"; }
    # The Python package builds the kernels crate again (maturin): same toolkit, same NVSHMEM.
    { what = "packages.deepep-kernels-python (toolkit)"; got = majorOf packages.deepep-kernels-python.cudaPackages; }
    { what = "packages.deepep-kernels-python (nvcc)"; got = if isPkg toolkit.cuda_nvcc packages.deepep-kernels-python.cudaPackages.cuda_nvcc then cudaMajor else "not ${cudaMajor} (not cudaPackages_${cudaMajor}.cuda_nvcc)"; }
    { what = "packages.deepep-kernels-python (its NVSHMEM)"; got = if isPkg packages.deepep-kernels.nvshmem packages.deepep-kernels-python.nvshmem then packages.deepep-kernels-python.nvshmem.cudaMajor else "not packages.deepep-kernels' NVSHMEM"; }
  ]
  ++ optionals (devShells ? python) [
    { what = "devShells.python (deepep_kernels toolkit)"; got = majorOf devShells.python.deepepKernels.cudaPackages; }
    { what = "devShells.python (torch)"; got = if devShells.python.torch.cudaSupport or false then majorOf devShells.python.torch.cudaPackages else "no CUDA"; }
  ]
  # Any other package with both (e.g. a later Python package): its own NVSHMEM and toolkit agree.
  ++ map (n: { what = "packages.${n} (toolkit vs its NVSHMEM ${packages.${n}.nvshmem.cudaMajor})"; got = majorOf packages.${n}.cudaPackages; want = packages.${n}.nvshmem.cudaMajor; })
    (filter (n: (packages.${n}.nvshmem or null) != null && packages.${n} ? cudaPackages && (packages.${n}.nvshmem ? cudaMajor)) (attrNames packages));

  wrong = filter (r: r.got != (r.want or cudaMajor)) rows;
in
if wrong == [ ] then map (r: "${r.what}: CUDA ${r.got}") rows
else throw "CUDA majors disagree (chosen: ${cudaMajor}, pkgs/default.nix):\n  ${concatStringsSep "\n  " (map (r: "${r.what}: ${r.got}, expected ${r.want or cudaMajor}") wrong)}"
