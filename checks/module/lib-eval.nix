# Evaluates modules/deepep.nix over the NixOS stand-ins (stand-ins.nix) for every case of
# cases.nix and checks the results (expect.nix). `lib` is either nixpkgs' real lib (its
# lib.evalModules) or checks/module/mini-lib.nix (CI, where nixpkgs cannot be had):
#   nix-instantiate --eval --strict --json checks/module/lib-eval.nix --arg lib 'import <nixpkgs>/lib'
#   nix-instantiate --eval --strict --json checks/module/lib-eval.nix --arg lib 'import ./checks/module/mini-lib.nix'
# Returns { <case> = "ok"; } or throws naming the case, the field, what was expected and got.
{ lib }:
let
  cases = import ./cases.nix;

  stubDrv = name: extra:
    derivation { inherit name; system = "x86_64-linux"; builder = "/bin/sh"; outputs = extra.outputs or [ "out" ]; } // removeAttrs extra [ "outputs" ];

  # Packages the module would otherwise take from nixpkgs (not available here).
  packages = {
    services.deepep.nvshmem.package = stubDrv "libnvshmem-3.4.5" { version = "3.4.5"; };
    services.deepep.gdrcopy.package = stubDrv "gdrcopy-2.6" { };
    services.deepep.gdrcopy.kernelModule = stubDrv "gdrdrv-2.6" { };
    services.deepep.doctor.package = stubDrv "deepep-nix-0.1.0" { };
  };

  # A driver as pkgs/os-specific/linux/nvidia-x11/generic.nix builds it: outputs out and bin
  # (nvidia-smi; the proprietary kernel modules before nixpkgs PR #498612), passthru.open (the
  # open kernel modules, pname "nvidia-open") and passthru.mod (the proprietary ones since PR
  # #498612: kernel-modules.nix, pname "nvidia-kernel-modules"), passthru.persistenced
  # (persistenced.nix, pname "nvidia-persistenced"; null for a driver built without it). pname
  # "nvidia-x11", or "nvidia-dc" for the datacenter drivers (which also carry
  # passthru.fabricmanager, pname "fabricmanager").
  driver = pname: version: extra:
    stubDrv "${pname}-${version}-6.12.0" ({ inherit pname version; outputs = [ "out" "bin" ]; } // removeAttrs extra [ "persistenced" ]) // {
      open = stubDrv "nvidia-open-${version}-6.12.0" { pname = "nvidia-open"; inherit version; };
      mod = stubDrv "nvidia-kernel-modules-${version}-6.12.0" { pname = "nvidia-kernel-modules"; inherit version; };
      persistenced = extra.persistenced or (stubDrv "nvidia-persistenced-${version}" { pname = "nvidia-persistenced"; inherit version; });
    };

  pkgsFor = system: {
    writeShellScript = name: _text: "/stub/${name}";
    coreutils = stubDrv "coreutils" { };
    gawk = stubDrv "gawk" { };
    kmod-blacklist-ubuntu = stubDrv "kmod-blacklist-ubuntu" { };
    kmod-debian-aliases = stubDrv "kmod-debian-aliases" { };
    stdenv.hostPlatform = { inherit system; isAarch64 = system == "aarch64-linux"; };
    linuxPackages.nvidiaPackages = rec {
      stable = driver "nvidia-x11" "580.95.05" { };
      dc = driver "nvidia-dc" "580.95.05" { inherit fabricmanager; };
      # A datacenter driver built without persistenced (usePersistenced = false).
      dcWithoutPersistenced = driver "nvidia-dc" "580.95.05" { inherit fabricmanager; persistenced = null; };
      fabricmanager = stubDrv "fabricmanager-580.95.05" { pname = "fabricmanager"; };
    };
  };

  evalCase = c: lib.evalModules {
    modules = map (s: s.module) (import ./stand-ins.nix (c.standIns or { }))
      ++ [
      ../../modules/deepep.nix
      packages
      c.module
    ] ++ lib.optional ((c.nvidia or true) == true) { services.xserver.videoDrivers = [ "nvidia" ]; };
    specialArgs.pkgs = pkgsFor (c.system or "x86_64-linux");
  };

  check = import ./expect.nix { inherit lib; };
in
lib.listToAttrs (map
  (c:
  let config = (evalCase c).config;
  in lib.nameValuePair c.name (check c config {
    nvshmemDir = "${packages.services.deepep.nvshmem.package}";
    gdrdrvPackage = packages.services.deepep.gdrcopy.kernelModule;
    doctorPackage = packages.services.deepep.doctor.package;
    nixosConf = config.environment.etc."modprobe.d/nixos.conf".text or null;
  }))
  cases)
