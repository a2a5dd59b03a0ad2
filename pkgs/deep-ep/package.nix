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
#   deep-ep.override { oneNvshmem = "rebuild-torch"; }   see "One NVSHMEM per process" below
#
# Refused at evaluation, each with a message naming the fix (rules in ./lib.nix):
#   - a DeepEP x NVSHMEM pairing that ./pairings.json lists as broken (DeepEP <= 1.2.1 with
#     NVSHMEM >= 3.5.19: RC QP layout), unless `knownFixes` declares the source carries the fix;
#   - CUDA capabilities DeepEP or torch's extension builder cannot build for, given explicitly.
# Marked broken instead (meta.broken, the reasons in passthru.brokenConditions), as nixpkgs' own
# python3Packages.deep-ep is for a torch without CUDA: what the nixpkgs it is built in decides,
# i.e. torch without CUDA, a torch nixpkgs marks broken (e.g. for a CUDA major it predates), and
# torch and NVSHMEM of different CUDA majors (the toolkit is torch's own `cudaPackages`).
#
# One NVSHMEM per process (./lib.nix oneNvshmemPlan, docs/deepep.md): torch built with NVSHMEM
# (nixpkgs' torch with withNvshmem, linking cudaPackages.libnvshmem) maps its
# libnvshmem_host.so.3 at `import torch`, and deep_ep_cpp, which needs that SONAME, then gets
# torch's copy whatever NVSHMEM_DIR it was built with. So with oneNvshmem = "auto" DeepEP is
# built against torch's NVSHMEM when that pairing is not known broken (no rebuild), and else
# against `nvshmem` with torch.override { withNvshmem = false; } (a rebuild of torch: hours).
# "torch" insists on torch's (refusing a broken pairing), "rebuild-torch" on `nvshmem`.
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
  # else cudaPackages.flags.cudaCapabilities, keeping 9.0 and newer that torch's extension
  # builder accepts. A list: exactly these.
  cudaCapabilities ? null
, # "auto" | "torch" | "rebuild-torch": see "One NVSHMEM per process" above.
  oneNvshmem ? "auto"
,
}:
let
  deepEpLib = import ./lib.nix;

  # torch's CUDA package set (passthru of nixpkgs' torch: pkgs/development/python-modules/
  # torch/source/default.nix exposes cudaSupport, cudaPackages, cudaCapabilities and
  # brokenConditions).
  torchCudaSupport = torch.cudaSupport or false;
  cudaPackages = torch.cudaPackages;

  # The NVSHMEM the given torch links (nixpkgs' torch with withNvshmem), or null.
  torchNvshmem = import ../torch-nvshmem.nix torch;

  oneNvshmemPlan = deepEpLib.oneNvshmemPlan {
    who = "deep-ep";
    inherit withNvshmem;
    mode = oneNvshmem;
    ours = if nvshmem == null then null else nvshmem.version;
    torchNvshmem = if torchNvshmem == null then null else torchNvshmem.version;
    torchPairing = if torchNvshmem == null then "untested" else deepEpLib.pairingStatus { deepep = version; nvshmem = torchNvshmem.version; inherit knownFixes; };
    torchProblem = if torchNvshmem == null then null else deepEpLib.pairingProblem { deepep = version; nvshmem = torchNvshmem.version; inherit knownFixes; };
  };

  # The torch this DeepEP is built with and runs with, and the NVSHMEM its extension links.
  torch' = if oneNvshmemPlan.rebuildTorch then torch.override { withNvshmem = false; } else torch;
  nvshmem' =
    if oneNvshmemPlan.use == "torch" then torchNvshmem
    else if oneNvshmemPlan.use == "ours" then nvshmem
    else null;
  nvshmemVersion = if nvshmem' == null then null else deepEpLib.releaseVersion nvshmem'.version;
  nvshmemLibDir = if nvshmem' == null then null else "${lib.getLib nvshmem'}/lib";

  # nixpkgs' CUDA capabilities: cudaPackages.flags.cudaCapabilities is config.cudaCapabilities,
  # or the per-CUDA-release defaults when that is unset (flags: pkgs/top-level/cuda-packages.nix
  # and the cuda-modules flags file it imports); torch.cudaCapabilities is torch's (the part torch
  # supports up to torch 2.9 in nixpkgs, the whole list since; see ./lib.nix
  # torchExtensionArches). Same source as nixpkgs' colmap, transformer-engine, flashinfer use.
  nixpkgsCapabilities =
    let fromTorch = torch.cudaCapabilities or [ ];
    in if fromTorch != [ ] then fromTorch else cudaPackages.flags.cudaCapabilities;

  arch = deepEpLib.archPlan {
    capabilities = if cudaCapabilities == null then nixpkgsCapabilities else cudaCapabilities;
    fromNixpkgs = cudaCapabilities == null;
    accepted = deepEpLib.torchAcceptedArches (torch.version or null);
    inherit withNvshmem;
  };

  # What the nixpkgs this is built in decided (meta.broken, see the header).
  brokenConditions = deepEpLib.brokenConditions {
    inherit torchCudaSupport;
    torchCudaMajor = if torchCudaSupport then cudaPackages.cudaMajorVersion else null;
    torchVersion = torch.version or "?";
    torchBroken =
      let conditions = lib.attrNames (lib.filterAttrs (_: c: c) (torch.brokenConditions or { }));
      in if conditions != [ ] then conditions else lib.optional (torch.meta.broken or false) "meta.broken";
    nvshmemVersion = if oneNvshmemPlan.use == "ours" && nvshmem != null then nvshmem.version else null;
    nvshmemCudaMajor = if oneNvshmemPlan.use == "ours" && nvshmem != null then nvshmem.cudaMajor else null;
  };

  problems = lib.filter (p: p != null) ([
    (if withNvshmem && nvshmem == null then "deep-ep: withNvshmem = true needs nvshmem = <an NVSHMEM package of this repository>." else null)
    (if src == null then deepEpLib.sourceProblem version else null)
    (deepEpLib.knownFixesProblem { inherit knownFixes; customSource = src != null || patches != [ ]; })
    oneNvshmemPlan.problem
  ] ++ lib.optionals (oneNvshmemPlan.use == "ours" && nvshmem != null) [
    (deepEpLib.pairingProblem { deepep = version; nvshmem = nvshmem.version; inherit knownFixes; })
  ] ++ lib.optionals (torchCudaSupport && brokenConditions == { }) [ arch.problem ]);

  pinned = deepEpLib.sourceFor version;

  # CUDA_HOME for torch.utils.cpp_extension: nvcc, the CUDA headers the extension and torch's
  # ATen/cuda headers include (cudart, CCCL, cuBLAS, cuSOLVER, cuSPARSE) and libcudart. With
  # CUDA 13, nvcc's crt headers are a package of their own (cuda_crt) and CCCL may sit under
  # include/cccl (see preBuild).
  # CCCL is `cccl` where the set has it (CUDA 13.3 renamed it; cuda_cccl is then an alias), and
  # cuda_crt comes first so that include/crt is a real directory of the join (../cuda-home.nix).
  cudaHome = symlinkJoin {
    name = "deep-ep-cuda-home-${cudaPackages.cudaMajorMinorVersion or cudaPackages.cudaMajorVersion}";
    paths = lib.optional (cudaPackages ? cuda_crt) (lib.getInclude cudaPackages.cuda_crt)
      ++ (with cudaPackages; [
      (lib.getBin cuda_nvcc)
      (lib.getInclude cuda_nvcc)
      (lib.getInclude cuda_cudart)
      (lib.getLib cuda_cudart)
      (lib.getInclude (cudaPackages.cccl or cuda_cccl))
      (lib.getInclude libcublas)
      (lib.getInclude libcusolver)
      (lib.getInclude libcusparse)
    ]);
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

    build-system = [ setuptools torch' ];
    dependencies = [ torch' ];

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
      NVSHMEM_DIR = "${nvshmem'}";
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
      # torch.utils.cpp_extension checks TORCH_CUDA_ARCH_LIST against its own allowlist
      # (./lib.nix torchExtensionArches is what was read, not necessarily this torch): ask this
      # torch now, before the first compiler runs.
      ${python.pythonOnBuildForHost.interpreter or python.interpreter} ${./check-arch-list.py}
    '';

    # Importing deep_ep loads deep_ep_cpp, torch and (with NVSHMEM) libnvshmem_host.so.3; none of
    # them needs the driver to load.
    pythonImportsCheck = [ "deep_ep" ];

    # The extension was built the way this derivation says: with NVSHMEM, it needs
    # libnvshmem_host from exactly the NVSHMEM it was built with (RUNPATH) and contains the
    # internode/low-latency kernels; without, neither. And one NVSHMEM per process: after
    # `import torch, deep_ep` exactly that one libnvshmem_host.so.3 is mapped
    # (../../checks/nvshmem-maps.py reads /proc/self/maps; no GPU needed).
    doInstallCheck = true;
    nativeInstallCheckInputs = [ binutils ];
    postInstallCheck = ''
      so=$(find "$out" -name 'deep_ep_cpp*.so' | head -n 1)
      if [ -z "$so" ]; then echo "deep-ep: no deep_ep_cpp extension in $out" >&2; exit 1; fi
      dyn=$(readelf -d "$so")
      syms=$(readelf -sW --dyn-syms "$so")
      ${if withNvshmem then ''
        echo "$dyn" | grep -q 'NEEDED.*libnvshmem_host' || { echo "deep-ep: $so does not link libnvshmem_host" >&2; exit 1; }
        echo "$dyn" | grep -q 'R.*PATH.*${nvshmem'}/lib' || { echo "deep-ep: $so has no RUNPATH to ${nvshmem'}/lib" >&2; exit 1; }
        echo "$syms" | grep -q 'internode_ll' || { echo "deep-ep: $so has no low-latency kernels" >&2; exit 1; }
        (cd / && PYTHONPATH="$out/${python.sitePackages}''${PYTHONPATH:+:$PYTHONPATH}" \
          ${python.interpreter} ${../../checks/nvshmem-maps.py} --expect ${nvshmemLibDir} deep_ep)
      '' else ''
        if echo "$dyn" | grep -q 'libnvshmem'; then echo "deep-ep: $so links NVSHMEM in the intranode-only build" >&2; exit 1; fi
        if echo "$syms" | grep -q 'internode_ll'; then echo "deep-ep: $so has low-latency kernels in the intranode-only build" >&2; exit 1; fi
        (cd / && PYTHONPATH="$out/${python.sitePackages}''${PYTHONPATH:+:$PYTHONPATH}" \
          ${python.interpreter} ${../../checks/nvshmem-maps.py} --at-most-one deep_ep)
      ''}
    '';

    passthru = {
      inherit withNvshmem cudaPackages cudaHome knownFixes brokenConditions;
      # The NVSHMEM the extension links and its process loads (this repository's `nvshmem`, or
      # torch's cudaPackages.libnvshmem under oneNvshmem), its lib/ directory, and the plan.
      nvshmem = nvshmem';
      inherit nvshmemLibDir;
      oneNvshmem = oneNvshmemPlan // { mode = oneNvshmem; torchNvshmem = if torchNvshmem == null then null else torchNvshmem.version; };
      torch = torch';
      torchCudaArchList = arch.archList;
      droppedCudaCapabilities = arch.dropped;
      pairing = if withNvshmem then deepEpLib.pairingStatus { deepep = version; nvshmem = nvshmemVersion; inherit knownFixes; } else "no-nvshmem";
      # Python with torch, numpy (DeepEP's tests) and this DeepEP: the dev shell and GPU check.
      pythonEnv = python.withPackages (_: [ torch' numpy finalAttrs.finalPackage ]);
      # DeepEP's tests/test_intranode.py (and test_low_latency.py with NVSHMEM) on the builder's
      # GPUs; needs the "cuda" system feature (checks/deep-ep-gpu.nix).
      gpuCheck = import ../../checks/deep-ep-gpu.nix { inherit lib runCommand; deep-ep = finalAttrs.finalPackage; };
      # The same as passthru.tests.deepep-tests.gpuCheck, nixpkgs' path for GPU checks
      # (passthru.tests.<name>.gpuCheck with requiredSystemFeatures = [ "cuda" ]; pkgs/default.nix
      # cites where nixpkgs does this).
      tests.deepep-tests.gpuCheck = finalAttrs.finalPackage.gpuCheck;
    };

    meta = {
      description = "DeepEP expert-parallel communication library${if withNvshmem then " (NVSHMEM ${nvshmemVersion})" else " (intranode only, without NVSHMEM)"}";
      homepage = "https://github.com/deepseek-ai/DeepEP";
      license = lib.licenses.mit;
      platforms = [ "x86_64-linux" "aarch64-linux" ];
      broken = brokenConditions != { };
    };
  })
