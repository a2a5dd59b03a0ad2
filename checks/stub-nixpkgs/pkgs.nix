# Package stubs for one system. stdenv.mkDerivation returns a derivation that builds nothing
# but whose inputs include every string, path and derivation attribute of the real call, so
# evaluating its drvPath evaluates those (e.g. fetchurl of a pinned artifact, which checks the
# hash). passthru, meta and finalAttrs.finalPackage behave as in nixpkgs; `.override` and
# `.overrideAttrs` exist.
#
# CUDA/Python (for pkgs/deep-ep): `cudaMajor` picks the default `cudaPackages`, `cudaSupport`
# stands for config.cudaSupport; `pkgsCuda` and `cudaPackages_<M>.pkgs` are the variants nixpkgs
# documents, and python3Packages.torch carries the passthru nixpkgs' torch has (cudaSupport,
# cudaPackages, cudaCapabilities: the capabilities here are made up).
{ system, cudaMajor ? "12", cudaSupport ? false }:
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

  cudaSet = major: {
    cudaMajorVersion = major;
    cudaMajorMinorVersion = "${major}.0";
    flags.cudaCapabilities = [ "7.5" "8.0" "9.0" "10.0" ];
    backendStdenv = pkgs.stdenv;
    pkgs = import ./pkgs.nix { inherit system cudaSupport; cudaMajor = major; };
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
    pkgsCuda = import ./pkgs.nix { inherit system cudaMajor; cudaSupport = true; };

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
      # nixpkgs' python passthru: the interpreter's path.
      interpreter = "${stub "python3-3.12"}/bin/python3.12";
      withPackages = f: mkDerivation { name = "python3-3.12-env"; paths = toString (f python3Packages); };
    };
    torch = stub "python3.12-torch-2.9.0" // {
      inherit cudaSupport;
      inherit (pkgs) cudaPackages;
      cudaCapabilities = if cudaSupport then [ "8.0" "9.0" "10.0" ] else [ ];
    };
    # nixpkgs pkgs/development/interpreters/python/hooks/default.nix
    pytestCheckHook = stub "pytest-check-hook";
  } // lib.genAttrs [ "setuptools" "numpy" "pybind11" "pytest" ] (n: stub "python3.12-${n}");
in
pkgs
