# DeepEP (deepseek-ai/DeepEP, the `deep_ep` Python package with its `deep_ep_cpp` CUDA
# extension) built from the pinned upstream release against this repository's NVSHMEM package.
# Called from a python3Packages scope (python3Packages.callPackage):
#
#   deep-ep                                        DeepEP 1.2.1 + `nvshmem` (3.4.5): intranode,
#                                                  internode and low-latency kernels
#   deep-ep.override { withNvshmem = false; }      intranode only (DeepEP's DISABLE_NVSHMEM
#                                                  build: setup.py takes that path when
#                                                  NVSHMEM_DIR is unset and no nvidia.nvshmem
#                                                  module is importable)
#   deep-ep.override { nvshmem = nvshmem_3_3_24; } another NVSHMEM of torch's CUDA major
#   deep-ep.override { cudaCapabilities = [ "9.0a" ]; }
#
# Refused at evaluation, each with a message naming the fix (rules in ./lib.nix):
#   - a DeepEP x NVSHMEM pairing that ./pairings.json lists as broken (DeepEP <= 1.2.1 with
#     NVSHMEM >= 3.5.19: RC QP layout), unless `knownFixes` declares the source carries the fix;
#   - torch without CUDA, or torch and NVSHMEM of different CUDA majors (the CUDA toolkit used
#     here is torch's own `cudaPackages`, so all three share one major);
#   - CUDA capabilities DeepEP cannot build for.
#
# What DeepEP v1.2.1's setup.py reads (its only build interface): NVSHMEM_DIR (include/, lib/
# with libnvshmem_host.so and libnvshmem_device.a; also added to the extension's RPATH),
# TORCH_CUDA_ARCH_LIST, DISABLE_SM90_FEATURES, DISABLE_AGGRESSIVE_PTX_INSTRS (left at its
# default, 1), and torch.utils.cpp_extension reads CUDA_HOME and MAX_JOBS.
{ lib
, buildPythonPackage
, fetchFromGitHub
, symlinkJoin
, runCommand
, python
, setuptools
, torch
, numpy
, pybind11
, ninja
, rdma-core
, binutils
, # This repository's NVSHMEM package (pkgs/nvshmem); null = without NVSHMEM.
  nvshmem ? null
, withNvshmem ? nvshmem != null
, version ? (import ./lib.nix).defaultVersion
, # null: the pinned release of `version` (./pairings.json `sources`).
  src ? null
, # Patches applied to the source (e.g. DeepEP PR #696 for the RC QP layout).
  patches ? [ ]
, # Ids of ./pairings.json `broken` rules that `src`/`patches` are known to fix.
  knownFixes ? [ ]
, # null: torch.cudaCapabilities (nixpkgs' configured capabilities that torch supports) or
  # else cudaPackages.flags.cudaCapabilities, keeping 9.0 and newer. A list: exactly these.
  cudaCapabilities ? null
,
}:
let
  deepEpLib = import ./lib.nix;

  # torch's CUDA package set (passthru of nixpkgs' torch: pkgs/development/python-modules/
  # torch/source/default.nix exposes cudaSupport, cudaPackages and cudaCapabilities).
  torchCudaSupport = torch.cudaSupport or false;
  cudaPackages = torch.cudaPackages;

  # nixpkgs' CUDA capabilities: cudaPackages.flags.cudaCapabilities is config.cudaCapabilities,
  # or the per-CUDA-release defaults when that is unset (flags: pkgs/top-level/cuda-packages.nix
  # and the cuda-modules flags file it imports); torch.cudaCapabilities is the part torch
  # supports. Same source as nixpkgs' colmap, transformer-engine, flashinfer use.
  nixpkgsCapabilities =
    let fromTorch = torch.cudaCapabilities or [ ];
    in if fromTorch != [ ] then fromTorch else cudaPackages.flags.cudaCapabilities;

  arch = deepEpLib.archPlan {
    capabilities = if cudaCapabilities == null then nixpkgsCapabilities else cudaCapabilities;
    fromNixpkgs = cudaCapabilities == null;
    inherit withNvshmem;
  };

  problems = lib.filter (p: p != null) ([
    (if withNvshmem && nvshmem == null then "deep-ep: withNvshmem = true needs nvshmem = <an NVSHMEM package of this repository>." else null)
    (if src == null then deepEpLib.sourceProblem version else null)
    (deepEpLib.knownFixesProblem { inherit knownFixes; customSource = src != null || patches != [ ]; })
    (deepEpLib.cudaProblem {
      inherit torchCudaSupport;
      torchCudaMajor = if torchCudaSupport then cudaPackages.cudaMajorVersion else null;
      nvshmemVersion = if withNvshmem && nvshmem != null then nvshmem.version else null;
      nvshmemCudaMajor = if withNvshmem && nvshmem != null then nvshmem.cudaMajor else null;
    })
  ] ++ lib.optionals (withNvshmem && nvshmem != null) [
    (deepEpLib.pairingProblem { deepep = version; nvshmem = nvshmem.version; inherit knownFixes; })
  ] ++ lib.optionals torchCudaSupport [ arch.problem ]);

  pinned = deepEpLib.sourceFor version;

  # CUDA_HOME for torch.utils.cpp_extension: nvcc, the CUDA headers the extension and torch's
  # ATen/cuda headers include (cudart, CCCL, cuBLAS, cuSOLVER, cuSPARSE) and libcudart. With
  # CUDA 13, nvcc's crt headers are a package of their own (cuda_crt) and CCCL may sit under
  # include/cccl (see preBuild).
  cudaHome = symlinkJoin {
    name = "deep-ep-cuda-home-${cudaPackages.cudaMajorMinorVersion or cudaPackages.cudaMajorVersion}";
    paths = with cudaPackages; [
      (lib.getBin cuda_nvcc)
      (lib.getInclude cuda_nvcc)
      (lib.getInclude cuda_cudart)
      (lib.getLib cuda_cudart)
      (lib.getInclude cuda_cccl)
      (lib.getInclude libcublas)
      (lib.getInclude libcusolver)
      (lib.getInclude libcusparse)
    ] ++ lib.optional (cudaPackages ? cuda_crt) (lib.getInclude cudaPackages.cuda_crt);
  };

  pname = "deep-ep" + lib.optionalString (!withNvshmem) "-no-nvshmem";
in
if problems != [ ] then throw (lib.concatStringsSep "\n\n" problems)
else
# nvcc needs a host compiler it supports; nixpkgs' CUDA packages build with backendStdenv
# (and nixpkgs' buildPythonPackage takes `stdenv` through .override).
  (buildPythonPackage.override { stdenv = cudaPackages.backendStdenv; }) (finalAttrs: {
    inherit pname version;
    pyproject = true;

    src =
      if src != null then src
      else fetchFromGitHub { inherit (pinned) owner repo tag hash; };
    inherit patches;

    build-system = [ setuptools torch ];
    dependencies = [ torch ];

    nativeBuildInputs = [ cudaPackages.cuda_nvcc ninja ];
    buildInputs = [ pybind11 ] ++ lib.optional withNvshmem (lib.getDev rdma-core);

    # ninja is for torch.utils.cpp_extension, not a build system of its own here.
    dontUseNinjaBuild = true;
    dontUseNinjaInstall = true;
    dontUseNinjaCheck = true;

    env = {
      CUDA_HOME = "${cudaHome}";
      TORCH_CUDA_ARCH_LIST = arch.archList;
      DISABLE_SM90_FEATURES = if arch.disableSm90Features then "1" else "0";
    } // lib.optionalAttrs withNvshmem {
      NVSHMEM_DIR = "${nvshmem}";
    };

    preBuild = ''
      export MAX_JOBS="$NIX_BUILD_CORES"
      ${lib.optionalString (!withNvshmem) ''
        # DeepEP's setup.py builds without NVSHMEM only when NVSHMEM_DIR is unset (an empty value
        # fails its path check) and no nvidia.nvshmem module is importable.
        unset NVSHMEM_DIR
      ''}
      # CUDA 13 moved CCCL (cuda/std, cub, thrust) under include/cccl; NVSHMEM's headers and
      # cuda_fp16/bf16 need cuda/std (DeepEP issues #476, #568).
      if [ -d "$CUDA_HOME/include/cccl" ]; then
        export NVCC_APPEND_FLAGS="''${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-I$CUDA_HOME/include/cccl"
        export CPLUS_INCLUDE_PATH="$CUDA_HOME/include/cccl''${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
      fi
    '';

    # Importing deep_ep loads deep_ep_cpp, torch and (with NVSHMEM) libnvshmem_host.so.3; none of
    # them needs the driver to load.
    pythonImportsCheck = [ "deep_ep" ];

    # The extension was built the way this derivation says: with NVSHMEM, it needs
    # libnvshmem_host from exactly `nvshmem` (RUNPATH) and contains the internode/low-latency
    # kernels; without, neither.
    doInstallCheck = true;
    nativeInstallCheckInputs = [ binutils ];
    postInstallCheck = ''
      so=$(find "$out" -name 'deep_ep_cpp*.so' | head -n 1)
      if [ -z "$so" ]; then echo "deep-ep: no deep_ep_cpp extension in $out" >&2; exit 1; fi
      dyn=$(readelf -d "$so")
      syms=$(readelf -sW --dyn-syms "$so")
      ${if withNvshmem then ''
        echo "$dyn" | grep -q 'NEEDED.*libnvshmem_host' || { echo "deep-ep: $so does not link libnvshmem_host" >&2; exit 1; }
        echo "$dyn" | grep -q 'R.*PATH.*${nvshmem}/lib' || { echo "deep-ep: $so has no RUNPATH to ${nvshmem}/lib" >&2; exit 1; }
        echo "$syms" | grep -q 'internode_ll' || { echo "deep-ep: $so has no low-latency kernels" >&2; exit 1; }
      '' else ''
        if echo "$dyn" | grep -q 'libnvshmem'; then echo "deep-ep: $so links NVSHMEM in the intranode-only build" >&2; exit 1; fi
        if echo "$syms" | grep -q 'internode_ll'; then echo "deep-ep: $so has low-latency kernels in the intranode-only build" >&2; exit 1; fi
      ''}
    '';

    passthru = {
      inherit withNvshmem cudaPackages cudaHome knownFixes;
      nvshmem = if withNvshmem then nvshmem else null;
      torchCudaArchList = arch.archList;
      droppedCudaCapabilities = arch.dropped;
      pairing = if withNvshmem then deepEpLib.pairingStatus { deepep = version; nvshmem = nvshmem.version; inherit knownFixes; } else "no-nvshmem";
      # Python with torch, numpy (DeepEP's tests) and this DeepEP: the dev shell and GPU check.
      pythonEnv = python.withPackages (_: [ torch numpy finalAttrs.finalPackage ]);
      # DeepEP's tests/test_intranode.py (and test_low_latency.py with NVSHMEM) on the builder's
      # GPUs; needs the "cuda" system feature (checks/deep-ep-gpu.nix).
      gpuCheck = import ../../checks/deep-ep-gpu.nix { inherit lib runCommand; deep-ep = finalAttrs.finalPackage; };
    };

    meta = {
      description = "DeepEP expert-parallel communication library${if withNvshmem then " (NVSHMEM ${nvshmem.version})" else " (intranode only, without NVSHMEM)"}";
      homepage = "https://github.com/deepseek-ai/DeepEP";
      license = lib.licenses.mit;
      platforms = [ "x86_64-linux" "aarch64-linux" ];
    };
  })
