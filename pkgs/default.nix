# This repository's packages for one nixpkgs instance (used by flake.nix for `packages`, by
# the overlay, and by the NixOS module for its defaults).
#
#   nvshmem                          NVSHMEM 3.4.5, CUDA 13, NVIDIA tarball
#   nvshmem_<v>                      release <v> (CUDA 13 where it exists, else 12)
#   nvshmem_<v>_cuda12 / _cuda13     one CUDA major
#   gdrcopy                          libgdrapi + tools; gdrdrv comes from gdrdrvFor / the module
#   deepep-kernels                   kernels + harness (deepep-bench / deepep-gpu-tests) against `nvshmem`
#   deepep-kernels-no-nvshmem        the same without NVSHMEM (DeepEP's DISABLE_NVSHMEM build)
#   deepep-nix                       the CLI
#   deep-ep                          DeepEP 1.2.1 (Python deep_ep) against `nvshmem`, with torch
#                                    from this nixpkgs with CUDA on and NVSHMEM's CUDA major
#   deep-ep-no-nvshmem               the same, intranode only (DeepEP's DISABLE_NVSHMEM build)
#   deepep-kernels-python            our Python package `deepep_kernels` (python/, maturin abi3)
#                                    with the kernels' toolkit and `nvshmem`
#
# `packages` holds only combinations that exist for the host system. `missing` binds every
# absent nvshmem_<v>_cuda<M> to the evaluation error that says what exists; the overlay
# exposes those too, so `pkgs.nvshmem_3_3_9_cuda13` fails with that message instead of being
# an unknown attribute.
#
# Attribute *names* depend only on `system` and the release data, never on `pkgs`: in an overlay
# `pkgs` is the final package set, whose names in turn depend on this set's names (the overlay
# passes `system` from `prev`), so names computed from `pkgs` would recurse forever.
{ pkgs
, system ? pkgs.stdenv.hostPlatform.system
, releases ? import ./nvshmem/releases.nix
,
}:
let
  nvshmemLib = import ./nvshmem/lib.nix;
  deepEpLib = import ./deep-ep/lib.nix;

  # The one CUDA major of the default outputs: the default NVSHMEM (`nvshmem`), the kernels
  # built against it (and with them the dev shells' nvcc and CUDA_HOME and the GPU check's
  # NCCL), gdrcopy's tools. It is chosen here, from pkgs/nvshmem/lib.nix's defaultCudaMajor.
  # callPackage fills a function argument that has a default from the package set when the
  # set has that name (pkgs.cudaPackages: CUDA 12 at many nixpkgs revisions), so `cudaPackages`
  # is always passed explicitly; checks/cuda-major.nix proves the outputs agree.
  cudaMajor = nvshmemLib.defaultCudaMajor;
  cudaPackages = pkgs."cudaPackages_${cudaMajor}" or (throw "deepep-nix: this nixpkgs has no cudaPackages_${cudaMajor} (the CUDA major of the default NVSHMEM, pkgs/nvshmem/lib.nix defaultCudaMajor); use a newer nixpkgs.");

  gdrcopy = pkgs.callPackage ./gdrcopy/package.nix { inherit cudaPackages; };

  mkNvshmem = { version, cudaMajor }:
    pkgs.callPackage ./nvshmem/package.nix {
      inherit releases version cudaMajor gdrcopy;
    };

  nvshmemPackages = builtins.listToAttrs (map
    (p: { inherit (p) name; value = mkNvshmem { inherit (p) version cudaMajor; }; })
    (nvshmemLib.attrPlan releases system));

  # Forcing one of these throws select's message (the derivation is never reached).
  missing = builtins.listToAttrs (map
    (p: {
      inherit (p) name;
      value = nvshmemLib.select {
        inherit releases system;
        inherit (p) version cudaMajor;
      };
    })
    (nvshmemLib.missingAttrPlan releases system));

  nvshmem = nvshmemPackages.nvshmem or (throw "NVSHMEM ${nvshmemLib.defaultVersion} for CUDA ${nvshmemLib.defaultCudaMajor} has no build for ${system} in the release data.");

  # passthru.gpuCheck: runs the GPU tests and a quick benchmark (needs the "cuda" system feature),
  # and checks one NVSHMEM per process in the `python` dev shell's Python (torch + our binding).
  # The same check also as passthru.tests.gpu-suite.gpuCheck, the path nixpkgs' GPU jobs use:
  # nixpkgs' CUDA tests are passthru.tests.<name> (cudaPackages.writeGpuTestPython) whose
  # .gpuCheck has requiredSystemFeatures = [ "cuda" ] ("nix build -f "<nixpkgs>"
  # python3Packages.triton.tests.axpy-cuda.gpuCheck" with programs.nix-required-mounts: comment in
  # nixpkgs pkgs/development/python-modules/triton/default.nix; jobs named like
  # "python3Packages.torch.tests.tester-compileCpu.gpuCheck" in nixpkgs' channel-blocker jobset).
  deepep-kernels =
    let
      base = pkgs.callPackage ./deepep-kernels/package.nix { inherit nvshmem cudaPackages; };
      gpuCheck = pkgs.callPackage ../checks/gpu.nix { deepep-kernels = base; pythonEnv = deepepKernelsPythonEnv; };
    in
    base.overrideAttrs (old: {
      passthru = old.passthru // {
        inherit gpuCheck;
        tests = (old.passthru.tests or { }) // { gpu-suite = { inherit gpuCheck; }; };
      };
    });

  # DeepEP needs torch with CUDA support of NVSHMEM's CUDA major: this nixpkgs with
  # config.cudaSupport = true (pkgsCuda, pkgs/top-level/variants.nix) and that major's CUDA
  # package set as the default one (cudaPackages_<M>.pkgs; nixpkgs manual, "Using
  # cudaPackages.pkgs"). passthru.gpuCheck runs DeepEP's own intranode and low-latency tests.
  deepEpPython = (pkgs.pkgsCuda or pkgs)."cudaPackages_${nvshmem.cudaMajor}".pkgs.python3Packages;
  mkDeepEp = deepEpPython.callPackage ./deep-ep/package.nix;

  # Our Python package (python/) for a Python package set, with exactly the kernels' toolkit
  # (`cudaPackages`, the one CUDA major) and `nvshmem`: packages.deepep-kernels-python (the
  # default python3Packages: it needs no torch to build), the overlay's
  # python3Packages.deepep-kernels (every Python's set) and the `python` dev shell.
  mkDeepepKernelsPython = pythonPackages:
    pythonPackages.callPackage ./deepep-kernels-python/package.nix { inherit nvshmem cudaPackages; };

  # Python with torch of NVSHMEM's CUDA major (CUDA on, the set DeepEP uses above), pytest and
  # deepep_kernels built in that same set: the `python` dev shell (flake.nix).
  #
  # One NVSHMEM per process (./deep-ep/lib.nix oneNvshmemPlan, docs/deepep.md): a torch that
  # links its own NVSHMEM (nixpkgs' torch with withNvshmem: cudaPackages.libnvshmem) maps it at
  # `import torch`, and our binding, loading libnvshmem_host.so.3 by SONAME, would get that copy,
  # not the one its cubins were linked against. Our kernels use NVSHMEM's public API only (no
  # rule of ./deep-ep/pairings.json covers them), so here they are built against torch's
  # NVSHMEM when torch has one: no torch rebuild, one library. Otherwise against `nvshmem`.
  deepepKernelsPythonEnv =
    let
      torch = deepEpPython.torch;
      torchNvshmem = import ./torch-nvshmem.nix torch;
      plan = deepEpLib.oneNvshmemPlan {
        who = "deepep-kernels-python";
        withNvshmem = true;
        ours = nvshmem.version;
        torchNvshmem = if torchNvshmem == null then null else torchNvshmem.version;
      };
      # kernels-build-env.nix compares the NVSHMEM's CUDA major with the toolkit's.
      kernelsNvshmem = if plan.use == "torch" then torchNvshmem // { cudaMajor = torch.cudaPackages.cudaMajorVersion; } else nvshmem;
      torch' = if plan.rebuildTorch then torch.override { withNvshmem = false; } else torch;
      kernelsPy = deepEpPython.callPackage ./deepep-kernels-python/package.nix { nvshmem = kernelsNvshmem; inherit cudaPackages; };
    in
    deepEpPython.python.withPackages (ps: [ torch' ps.pytest ps.numpy kernelsPy ]) // {
      deepepKernels = kernelsPy;
      torch = torch';
      oneNvshmem = plan // { torchNvshmem = if torchNvshmem == null then null else torchNvshmem.version; };
    };
in
{
  packages = nvshmemPackages // {
    deep-ep = mkDeepEp { inherit nvshmem; };
    deep-ep-no-nvshmem = mkDeepEp { nvshmem = null; };
    inherit gdrcopy deepep-kernels;
    deepep-kernels-no-nvshmem = pkgs.callPackage ./deepep-kernels/package.nix {
      nvshmem = null;
      inherit cudaPackages;
    };
    deepep-nix = pkgs.callPackage ./deepep-nix/package.nix { };
    deepep-kernels-python = mkDeepepKernelsPython pkgs.python3Packages;
  };

  inherit missing cudaMajor mkDeepepKernelsPython deepepKernelsPythonEnv;
  # DeepEP for another NVSHMEM and its Python package set: the per-release GPU checks
  # (checks/nvshmem-matrix.nix).
  inherit mkDeepEp deepEpPython;

  # gdrdrv for a kernel package set and nvidia driver (the NixOS module passes its own).
  gdrdrvFor = kernelPackages: nvidia_x11:
    kernelPackages.callPackage ./gdrcopy/gdrdrv.nix { inherit nvidia_x11; };
}
