# The `deepep_kernels` Python package (python/: PyO3 extension over the kernels crate, built by
# maturin as an abi3 wheel; docs/python.md) with nixpkgs' maturin support. Called from a Python
# package set (pythonPackages.callPackage): pkgs/default.nix `mkDeepepKernelsPython`, used for
# packages.deepep-kernels-python, the overlay's python3Packages.deepep-kernels and the `python`
# dev shell.
#
# With `extraNvshmem` (more releases) the wheel holds cubins for each and serves whichever of
# them the process has loaded (checks/nvshmem-matrix.nix builds one such wheel for every CUDA 13
# release of the lock).
#
# The toolkit and NVSHMEM come exactly as pkgs/deepep-kernels/package.nix gets them: `nvshmem`
# and `cudaPackages` passed by pkgs/default.nix (the one CUDA major of the default outputs; in
# the `python` dev shell the NVSHMEM torch links, if it links one: one NVSHMEM per process),
# CUDA_HOME the same ../cuda-home.nix join, NVSHMEM_DIR the NVSHMEM prefix; kernels/build.rs
# (run again inside maturin's cargo build) reads only those two variables. No torch at build
# time (the wheel links no libtorch); torch is needed at run time and is not a dependency here,
# as in python/pyproject.toml (the `python` dev shell adds a CUDA torch).
#
# nixpkgs pieces used (read in NixOS/nixpkgs as stored in the reference index, recent
# versions; the pinned rev 83199d0's own files were not readable here, see docs/nix.md):
#   - buildPythonPackage { pyproject = true; } : pkgs/development/interpreters/python/
#     mk-python-derivation.nix (pyproject = true <-> format = "pyproject": pypaBuildHook,
#     pypaInstallHook, pythonImportsCheckHook; tests run in installCheckPhase; `env` and other
#     attributes pass through to stdenv.mkDerivation).
#   - rustPlatform.maturinBuildHook : pkgs/build-support/rust/hooks/default.nix and
#     maturin-build-hook.sh (sets buildPhase; runs `maturin build --frozen --release --manylinux
#     off --strip` in $buildAndTestSubdir, then moves ${cargoRoot}/target/wheels/*.whl to dist/).
#   - rustPlatform.cargoSetupHook + cargoDeps = rustPlatform.importCargoLock { lockFile; } :
#     pkgs/build-support/rust/hooks/cargo-setup-hook.sh, pkgs/build-support/rust/
#     import-cargo-lock.nix (vendors the crates of a Cargo.lock; ours has no git sources, so no
#     outputHashes are needed).
#   - pythonImportsCheck : hooks/python-imports-check-hook.sh; pytestCheckHook with
#     disabledTests / disabledTestPaths : hooks/pytest-check-hook.sh.
{ lib
, buildPythonPackage
, rustPlatform
, symlinkJoin
, autoAddDriverRunpath
, pytestCheckHook
, numpy
, python
, binutils
, # This repository's NVSHMEM package (pkgs/nvshmem); null = the kernels without NVSHMEM
  # (kernels/build.rs: empty NVSHMEM_DIR), intranode only.
  nvshmem ? null
, # More NVSHMEM packages of this repository (other releases, the toolkit's CUDA major) to embed
  # cubins for besides `nvshmem`'s: kernels/build.rs's DEEPEP_NVSHMEM_RELEASES. The wheel then
  # serves each of these releases, following the libnvshmem_host.so.3 already in the process
  # (its RUNPATH still names `nvshmem`'s, used when none is loaded).
  extraNvshmem ? [ ]
, # The CUDA toolkit package set; pass it (pkgs/default.nix does): callPackage would fill it
  # from the package set (pkgs.cudaPackages, CUDA 12 at many nixpkgs revisions).
  cudaPackages
,
}:
let
  version = (lib.importTOML ../../Cargo.toml).workspace.package.version;

  # The Cargo workspace (root Cargo.toml/Cargo.lock, generator, kernels) plus python/.
  src = import ../workspace-src.nix { inherit lib; } [ ../../python ];

  # CUDA_HOME, NVSHMEM_DIR, nvcc flags, the one-major check and the run-time library
  # directories: the same as pkgs/deepep-kernels/package.nix.
  # The release the host library reports: nixpkgs' cudaPackages.libnvshmem (which the `python`
  # dev shell may build against, pkgs/default.nix) carries the git tag's "-0" ("3.6.5-0").
  release = if nvshmem == null then null else (import ../deep-ep/lib.nix).releaseVersion nvshmem.version;

  build = import ../kernels-build-env.nix {
    inherit lib symlinkJoin cudaPackages nvshmem;
    who = "deepep-kernels-python";
    fix = "pass cudaPackages = pkgs.cudaPackages_${nvshmem.cudaMajor} (pkgs/default.nix passes the kernels' own), or an NVSHMEM of the toolkit's major.";
  };

  deepEpLib = import ../deep-ep/lib.nix;
  # The releases the wheel serves, ascending (what deepep_kernels._native.nvshmem_releases() must
  # return); checked below before anything is built.
  releases = builtins.sort (a: b: builtins.compareVersions a b < 0)
    (map (p: deepEpLib.releaseVersion p.version) ((lib.optional (nvshmem != null) nvshmem) ++ extraNvshmem));
  repeated = builtins.filter (v: builtins.length (builtins.filter (w: w == v) releases) > 1) releases;
  extraProblems = lib.optional (extraNvshmem != [ ] && nvshmem == null)
    "deepep-kernels-python: extraNvshmem needs nvshmem (the release NVSHMEM_DIR names; the build without NVSHMEM has no NVSHMEM cubins)."
  ++ map (p: "deepep-kernels-python: extraNvshmem holds NVSHMEM ${p.version} for CUDA ${p.cudaMajor}, but the toolkit is CUDA ${cudaPackages.cudaMajorVersion or "unknown"}; use the nvshmem_<v>_cuda${cudaPackages.cudaMajorVersion or "?"} packages.")
    (builtins.filter (p: p.cudaMajor != (cudaPackages.cudaMajorVersion or null)) extraNvshmem)
  ++ lib.optional (repeated != [ ])
    "deepep-kernels-python: NVSHMEM ${builtins.head repeated} is given twice (nvshmem and extraNvshmem hold one package per release).";
in
if extraProblems != [ ] then throw (lib.concatStringsSep "\n" extraProblems) else
buildPythonPackage {
  # python/pyproject.toml [project] name
  pname = "deepep-kernels" + lib.optionalString (nvshmem == null) "-no-nvshmem";
  inherit version src;
  pyproject = true;

  cargoDeps = rustPlatform.importCargoLock { lockFile = ../../Cargo.lock; };
  # maturin runs in python/ (pyproject.toml, Cargo.toml of the deepep-python crate); the
  # workspace's target/ (and so target/wheels) stays at the root.
  buildAndTestSubdir = "python";

  # cuda_nvcc's setup hook points nvcc at a host compiler it supports (as for the kernels).
  nativeBuildInputs = [
    rustPlatform.cargoSetupHook
    rustPlatform.maturinBuildHook
    cudaPackages.cuda_nvcc
    autoAddDriverRunpath
  ];

  env = build.env // lib.optionalAttrs (extraNvshmem != [ ]) {
    DEEPEP_NVSHMEM_RELEASES = lib.concatMapStringsSep ":" toString extraNvshmem;
  };

  postFixup = ''
    find "$out" -name '*.so' -type f | while read -r so; do
      if isELF "$so"; then
        patchelf --add-rpath "${build.runtimeRpath}" "$so"
      fi
    done
  '';

  # Loads deepep_kernels._native (the Rust extension with the cubins); needs no driver (libcuda
  # is loaded only when a GPU is used).
  pythonImportsCheck = [ "deepep_kernels" ];

  # python/tests: the CPU tests CI runs on the wheel (no GPU, no torch; numpy for the arrays
  # test_doorway.py passes to the native checks).
  nativeCheckInputs = [ pytestCheckHook binutils numpy ];
  preCheck = ''
    cd python
  '';
  disabledTestPaths = [
    # need GPUs and torch (python/scripts/gpu-run.sh)
    "tests/gpu"
  ];
  disabledTests = [
    # Expects the host library to be unfindable with NVSHMEM_DIR pointing elsewhere and an empty
    # LD_LIBRARY_PATH; here the extension's RUNPATH names NVSHMEM's lib/ on purpose, so the
    # SONAME always resolves (postInstallCheck below checks that instead).
    "test_nvshmem_host_library_missing_names_the_fix"
  ];
  # The extension finds exactly `nvshmem`'s host library through its RUNPATH alone (no
  # NVSHMEM_DIR, no LD_LIBRARY_PATH) and it is the release the cubins were linked against
  # (nvshmem_host_check compares it with the device library's version; no GPU needed).
  postInstallCheck = ''
    so=$(find "$out" -name '_native*.so' | head -n 1)
    if [ -z "$so" ]; then echo "deepep-kernels-python: no _native extension in $out" >&2; exit 1; fi
  '' + lib.optionalString (nvshmem != null) ''
    readelf -d "$so" | grep -q 'R.*PATH.*${lib.getLib nvshmem}/lib' \
      || { echo "deepep-kernels-python: $so has no RUNPATH to ${lib.getLib nvshmem}/lib" >&2; exit 1; }
    got=$(cd / && env -u NVSHMEM_DIR LD_LIBRARY_PATH= ${python.interpreter} -c \
      'import deepep_kernels._native as n; print(n.nvshmem_host_check()[1])')
    if [ "$got" != "${release}" ]; then
      echo "deepep-kernels-python: the extension loads NVSHMEM host library $got, expected ${release}" >&2; exit 1
    fi
    served=$(cd / && ${python.interpreter} -c 'import deepep_kernels._native as n; print(",".join(n.nvshmem_releases()))')
    if [ "$served" != "${lib.concatStringsSep "," releases}" ]; then
      echo "deepep-kernels-python: the extension serves NVSHMEM $served, expected ${lib.concatStringsSep "," releases}" >&2; exit 1
    fi
  '';

  passthru = {
    inherit nvshmem extraNvshmem cudaPackages;
    # The NVSHMEM releases the wheel serves, ascending.
    nvshmemReleases = releases;
    inherit (build) cudaHome;
  };

  meta = {
    description = "deep_ep v1.2.1-compatible dispatch/combine for PyTorch over the deepep-nix kernels${lib.optionalString (nvshmem == null) " (without NVSHMEM)"}";
    license = with lib.licenses; [ mit asl20 ];
    platforms = [ "x86_64-linux" "aarch64-linux" ];
  };
}
