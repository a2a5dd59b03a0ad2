# Evaluates modules/deepep.nix with nixpkgs' lib.evalModules over stub declarations of the NixOS
# options it touches (stub-nixos.nix) and checks every case of cases.nix. Needs nixpkgs' `lib`
# only (e.g. the nix-community/nixpkgs.lib repository):
#   nix-instantiate --eval --strict --json checks/module/lib-eval.nix --arg lib 'import <path>/lib'
# Returns { <case> = "ok"; } or throws naming the case, the field, what was expected and got.
{ lib }:
let
  cases = import ./cases.nix;

  stubDrv = name: extra:
    derivation { inherit name; system = "x86_64-linux"; builder = "/bin/sh"; } // extra;

  # Packages the module would otherwise take from nixpkgs (not available here).
  packages = {
    services.deepep.nvshmem.package = stubDrv "libnvshmem-3.4.5" { version = "3.4.5"; };
    services.deepep.gdrcopy.package = stubDrv "gdrcopy-2.6" { };
    services.deepep.gdrcopy.kernelModule = stubDrv "gdrdrv-2.6" { };
    services.deepep.doctor.package = stubDrv "deepep-nix-0.1.0" { };
  };

  pkgs = {
    writeShellScript = name: _text: "/stub/${name}";
    coreutils = stubDrv "coreutils" { };
    gawk = stubDrv "gawk" { };
    stdenv.hostPlatform.isAarch64 = false;
  };

  evalCase = c: lib.evalModules {
    modules = [
      ../../modules/deepep.nix
      (import ./stub-nixos.nix { nvidiaEnabled = (c.nvidia or true) != false; })
      packages
      c.module
      { _module.args.pkgs = pkgs; }
    ];
  };

  check = import ./expect.nix { inherit lib; };
in
lib.listToAttrs (map
  (c: lib.nameValuePair c.name (check c (evalCase c).config {
    nvshmemDir = "${packages.services.deepep.nvshmem.package}";
    gdrdrvPackage = packages.services.deepep.gdrcopy.kernelModule;
    doctorPackage = packages.services.deepep.doctor.package;
  }))
  cases)
