# Package stubs for one system. stdenv.mkDerivation returns a derivation that builds nothing
# but whose inputs include every string, path and derivation attribute of the real call, so
# evaluating its drvPath evaluates those (e.g. fetchurl of a pinned artifact, which checks the
# hash). passthru, meta and finalAttrs.finalPackage behave as in nixpkgs; `.override` and
# `.overrideAttrs` exist.
#
# CUDA/Python (for pkgs/deep-ep): `cudaMajor` picks the default `cudaPackages`, `cudaSupport`
# stands for config.cudaSupport; `pkgsCuda` and `cudaPackages_<M>.pkgs` are the variants nixpkgs
# documents, and python3Packages.torch carries the passthru nixpkgs' torch has (cudaSupport,
# cudaPackages, cudaCapabilities, brokenConditions; the capabilities here are made up).
#
# `torch` picks which nixpkgs torch is modelled (docs/nix.md, "Audit against nixpkgs"):
#   version        "2.13.0" (torch/source/default.nix at 7dec1fd5) by default
#   withNvshmem    whether the recipe has the withNvshmem argument (default true, as at 7dec1fd5:
#                  withNvshmem ? cudaSupport && libnvshmem available, env.USE_NVSHMEM, libnvshmem
#                  among the build inputs; false = torch from before nixpkgs PR #508278)
#   cudaMajors     the CUDA majors it builds for (brokenConditions "Unsupported CUDA version"
#                  otherwise; 6b516b42, torch 2.9.1, has [ "11" "12" ])
#   narrowedCapabilities  torch.cudaCapabilities = nixpkgs' list filtered to torch's extension
#                  allowlist (6b516b42) instead of the whole list (7dec1fd5)
# CUDA sets: CUDA 13 has `cccl` (pname cccl from 13.3, packages/cccl.nix) and `cuda_cccl` is an
# alias there (here one that throws, so that the flake is shown not to use it), plus `cuda_crt`;
# every set has `libnvshmem` (nixpkgs' source build, version "3.6.5-0", one output).
{ system, cudaMajor ? "12", cudaSupport ? false, torch ? { } }:
let
  lib = import ./lib.nix;
  inherit (builtins) functionArgs intersectAttrs isAttrs isFunction isPath isString mapAttrs removeAttrs;

  isDrv = v: isAttrs v && (v.type or null) == "derivation";

  mkDerivation = argsOrFn:
    let
      attrsFor = final: if isFunction argsOrFn then argsOrFn final else argsOrFn;
      attrs = attrsFor (attrs // { finalPackage = result; });
      name = attrs.name or "${attrs.pname}-${attrs.version}";
      flat = lib.filterAttrs (n: _: !(lib.hasPrefix "__" n))
        (removeAttrs attrs [ "name" "system" "builder" "args" "outputs" "passthru" "meta" "env" "passAsFile" ] // (attrs.env or { }));
      # mapAttrs keeps this lazy: a value is looked at only when the drvPath is wanted.
      inputs = mapAttrs (_: v: if isString v || isPath v || isDrv v then toString v else "") flat;
      drv = derivation (inputs // {
        inherit name system;
        builder = "/bin/sh";
        args = [ "-c" "echo stub; exit 1" ];
        outputs = attrs.outputs or [ "out" ];
      });
      # The call's own attributes stay readable with their real values (e.g. `.src.url`).
      result = drv // removeAttrs attrs [ "outputs" "passthru" "finalPackage" ] // (attrs.passthru or { }) // {
        meta = attrs.meta or { };
        overrideAttrs = f: mkDerivation (final: let a = attrsFor final; in a // (if isFunction (f a) then f a a else f a));
      };
    in
    result;

  stub = name: mkDerivation { inherit name; };
  multi = name: outputs: mkDerivation { inherit name outputs; };

  callPackageWith = autoArgs: fn: args:
    let
      f = if isFunction fn then fn else import fn;
      auto = intersectAttrs (functionArgs f) autoArgs;
      r = f (auto // args);
    in
    if isAttrs r then r // { override = newArgs: callPackageWith autoArgs fn (args // (if isFunction newArgs then newArgs (auto // args) else newArgs)); }
    else r;

  torchArgs = { version = "2.13.0"; withNvshmem = true; cudaMajors = [ "11" "12" "13" ]; narrowedCapabilities = false; } // torch;

  cudaSet = major: {
    cudaMajorVersion = major;
    cudaMajorMinorVersion = "${major}.0";
    flags.cudaCapabilities = [ "7.5" "8.0" "8.6" "8.9" "9.0" "10.0" "10.3" "11.0" "12.0" "12.1" ];
    backendStdenv = pkgs.stdenv;
    pkgs = import ./pkgs.nix { inherit system cudaSupport torch; cudaMajor = major; };
    libnvshmem = mkDerivation { pname = "libnvshmem"; version = "3.6.5-0"; name = "cuda${major}-libnvshmem-3.6.5-0"; };
    libcublas = multi "libcublas-${major}" [ "out" "lib" "dev" "include" ];
    libcusolver = multi "libcusolver-${major}" [ "out" "lib" "dev" "include" ];
    libcusparse = multi "libcusparse-${major}" [ "out" "lib" "dev" "include" ];
    cuda_nvcc = multi "cuda_nvcc-${major}" [ "out" "bin" "dev" "include" ];
    cuda_cudart = multi "cuda_cudart-${major}" [ "out" "lib" "dev" "include" "stubs" ];
    cuda_cccl = stub "cuda_cccl-${major}";
    cuda_nvrtc = multi "cuda_nvrtc-${major}" [ "out" "lib" ];
    nccl = multi "nccl-cuda${major}" [ "out" "dev" ];
  } // lib.optionalAttrs (major == "13") {
    # nvcc's crt headers, a package of their own from CUDA 13 on.
    cuda_crt = multi "cuda_crt-${major}" [ "out" "include" ];
    cccl = stub "cccl-${major}";
    cuda_cccl = throw "stub nixpkgs: cudaPackages_13.cuda_cccl is an alias of cudaPackages_13.cccl (nixpkgs warns); use cccl";
  };

  fakeHash = "sha256-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

  kernel = stub "linux-6.12.0" // { version = "6.12.0"; modDirVersion = "6.12.0"; dev = stub "linux-dev"; moduleBuildDependencies = [ ]; makeFlags = [ ]; };

  pkgs = {
    inherit lib system;
    stdenv = {
      inherit mkDerivation;
      hostPlatform = { inherit system; isAarch64 = system == "aarch64-linux"; };
      cc.cc = multi "gcc" [ "out" "lib" ];
    };
    callPackage = callPackageWith pkgs;

    # Real fixed-output derivations: evaluating them checks the URL and the hash's syntax.
    fetchurl = { url, hash, name ? baseNameOf url }: import <nix/fetchurl.nix> { inherit url hash name; };
    fetchFromGitHub = { owner, repo, tag ? null, rev ? null, hash }:
      assert tag != null || rev != null;
      derivation {
        name = "source";
        inherit system;
        builder = "/bin/sh";
        url = "https://github.com/${owner}/${repo}/archive/${if tag != null then tag else rev}.tar.gz";
        outputHashMode = "recursive";
        outputHash = hash;
      };

    runCommand = name: env: buildCommand: mkDerivation (env // { inherit name buildCommand; });
    symlinkJoin = { name, paths }: mkDerivation { inherit name; paths = toString paths; };
    # As nixpkgs' mkShell: `packages` go to nativeBuildInputs.
    mkShell = attrs: mkDerivation (removeAttrs attrs [ "packages" ] // {
      name = attrs.name or "nix-shell";
      nativeBuildInputs = (attrs.packages or [ ]) ++ (attrs.nativeBuildInputs or [ ]);
    });
    writeShellScript = name: text: mkDerivation { inherit name text; };
    rustPlatform = {
      buildRustPackage = attrs:
        assert builtins.pathExists attrs.cargoLock.lockFile;
        mkDerivation (removeAttrs attrs [ "cargoLock" ]);
      # nixpkgs pkgs/build-support/rust/import-cargo-lock.nix: "cargo-vendor-dir", the vendored
      # crates of `lockFile`, with passthru.lockFile (the real one also takes outputHashes for
      # git sources and parses the lock; here it is only read).
      importCargoLock = { lockFile, ... }:
        mkDerivation { name = "cargo-vendor-dir"; lockFileContents = builtins.readFile lockFile; passthru = { inherit lockFile; }; };
      # nixpkgs pkgs/build-support/rust/hooks/default.nix (setup hooks).
      cargoSetupHook = stub "cargo-setup-hook.sh";
      maturinBuildHook = stub "maturin-build-hook.sh";
    };

    cudaPackages_12 = cudaSet "12";
    cudaPackages_13 = cudaSet "13";
    cudaPackages = pkgs."cudaPackages_${cudaMajor}";
    pkgsCuda = import ./pkgs.nix { inherit system cudaMajor torch; cudaSupport = true; };

    pythonPackagesExtensions = [ ];
    python3Packages = python3Packages;

    linuxPackages = {
      inherit kernel;
      callPackage = callPackageWith (pkgs // { inherit kernel; kernelModuleMakeFlags = [ ]; });
      nvidiaPackages.production = stub "nvidia-x11-580.95.05" // {
        version = "580.95.05";
        open = mkDerivation {
          pname = "nvidia-open";
          version = "580.95.05";
          src = pkgs.fetchFromGitHub { owner = "NVIDIA"; repo = "open-gpu-kernel-modules"; rev = "580.95.05"; hash = fakeHash; };
        };
      };
    };
  } // lib.genAttrs [
    "autoPatchelfHook"
    "autoAddDriverRunpath"
    "unzip"
    "binutils"
    "which"
    "kmod"
    "coreutils"
    "gawk"
    "rustc"
    "cargo"
    "clippy"
    "rustfmt"
    "nixpkgs-fmt"
    "ninja"
  ]
    stub // {
    rdma-core = multi "rdma-core" [ "out" "lib" "dev" ];
  };

  # buildPythonPackage: mkDerivation, overridable like nixpkgs' (`.override { stdenv; }`).
  python3Packages = {
    callPackage = callPackageWith (pkgs // python3Packages);
    buildPythonPackage = { __functor = _: mkDerivation; override = _: python3Packages.buildPythonPackage; };
    python = stub "python3-3.12" // {
      # nixpkgs' python passthru: the interpreter's path, the site-packages directory.
      interpreter = "${stub "python3-3.12"}/bin/python3.12";
      sitePackages = "lib/python3.12/site-packages";
      withPackages = f: mkDerivation { name = "python3-3.12-env"; paths = toString (f python3Packages); };
    };
    torch = mkTorch { withNvshmem = torchArgs.withNvshmem && cudaSupport; };
    # nixpkgs pkgs/development/interpreters/python/hooks/default.nix
    pytestCheckHook = stub "pytest-check-hook";
  } // lib.genAttrs [ "setuptools" "numpy" "pybind11" "pytest" ] (n: stub "python3.12-${n}");
  # nixpkgs' torch (pkgs/development/python-modules/torch/source/default.nix) as far as the flake
  # reads it; `.override { withNvshmem = false; }` exists only where the recipe has the argument.
  mkTorch = { withNvshmem }:
    let
      cuda = pkgs.cudaPackages;
      supported = builtins.elem cuda.cudaMajorVersion torchArgs.cudaMajors;
      brokenConditions = { "Unsupported CUDA version" = cudaSupport && !supported; };
      narrowed = builtins.filter (c: builtins.elem c [ "7.5" "8.0" "8.6" "8.9" "9.0" "10.0" "10.3" "12.0" "12.1" ]) cuda.flags.cudaCapabilities;
    in
    mkDerivation
      {
        name = "python3.12-torch-${torchArgs.version}";
        inherit (torchArgs) version;
        USE_NVSHMEM = if withNvshmem then "1" else "0";
        buildInputs = lib.optional withNvshmem cuda.libnvshmem;
        passthru = {
          inherit cudaSupport brokenConditions;
          cudaPackages = cuda;
          cudaCapabilities = if !cudaSupport then [ ] else if torchArgs.narrowedCapabilities then narrowed else cuda.flags.cudaCapabilities;
        } // lib.optionalAttrs torchArgs.withNvshmem {
          # With structured attrs nixpkgs keeps `env` on the derivation.
          env.USE_NVSHMEM = if withNvshmem then "1" else "0";
        };
        meta.broken = builtins.any (x: x) (builtins.attrValues brokenConditions);
      } // {
      override = args:
        if args ? withNvshmem && !torchArgs.withNvshmem
        then throw "stub nixpkgs: torch ${torchArgs.version} called with unexpected argument 'withNvshmem'"
        else mkTorch { withNvshmem = args.withNvshmem or withNvshmem; };
    };
in
pkgs
