# Evaluates services.deepep inside real NixOS (nixos/lib/eval-config.nix) for every case of
# cases.nix, checking the same expectations as lib-eval.nix (expect.nix), including the text of
# /etc/modprobe.d/nixos.conf. Packages are the module's real defaults. Cases written for another
# host platform (`system`) or for other stand-in arguments (`standIns`, which model other nixpkgs
# revisions) are left out: here the pinned NixOS itself is the truth.
# Returns { <case> = "ok"; } or throws.
{ nixpkgs, system, deepepModule }:
let
  inherit (nixpkgs) lib;
  cases = lib.filter (c: (c.system or system) == system && !(c ? standIns)) (import ./cases.nix);
  check = import ./expect.nix { inherit lib; };

  base = {
    boot.loader.grub.enable = false;
    fileSystems."/" = { device = "/dev/vda"; fsType = "ext4"; };
    system.stateVersion = "25.11";
    nixpkgs.hostPlatform = system;
    nixpkgs.config.allowUnfree = true;
  };

  evalCase = c: (import "${nixpkgs}/nixos/lib/eval-config.nix" {
    inherit system;
    modules = [
      deepepModule
      base
      c.module
    ] ++ lib.optional ((c.nvidia or true) == true) { services.xserver.videoDrivers = [ "nvidia" ]; };
  }).config;
in
lib.listToAttrs (map
  (c:
  let config = evalCase c;
  in lib.nameValuePair c.name (check c config {
    nvshmemDir = "${config.services.deepep.nvshmem.package}";
    gdrdrvPackage = config.services.deepep.gdrcopy.kernelModule;
    doctorPackage = config.services.deepep.doctor.package;
    nixosConf = config.environment.etc."modprobe.d/nixos.conf".text or null;
  }))
  cases)
