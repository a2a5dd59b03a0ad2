# Evaluates services.deepep inside real NixOS (nixos/lib/eval-config.nix) for every case of
# cases.nix, plus the resulting /etc/modprobe.d/nixos.conf: the module's lines appear in it once,
# and NVreg_RegistryDwords exactly once. Packages are the module's real defaults.
# Returns { <case> = "ok"; } or throws.
{ nixpkgs, system, deepepModule }:
let
  inherit (nixpkgs) lib;
  cases = import ./cases.nix;
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

  nixosConf = config: config.environment.etc."modprobe.d/nixos.conf".text;

  confOk = c: config:
    let
      conf = nixosConf config;
      lines = lib.filter (l: l != "") (lib.splitString "\n" (c.expect.modprobe or ""));
      missing = lib.filter (l: !(lib.hasInfix l conf)) lines;
      dwords = builtins.length (lib.splitString "NVreg_RegistryDwords" conf) - 1;
    in
    if (c.expect.failed or [ ]) != [ ] then true
    else if missing != [ ] then throw "module case '${c.name}': /etc/modprobe.d/nixos.conf lacks ${builtins.toJSON missing}:\n${conf}"
    else if lines != [ ] && lib.hasInfix "NVreg_RegistryDwords" (c.expect.modprobe or "") && dwords != 1 then
      throw "module case '${c.name}': NVreg_RegistryDwords appears ${toString dwords} times in nixos.conf:\n${conf}"
    else true;
in
lib.listToAttrs (map
  (c:
  let config = evalCase c;
  in lib.nameValuePair c.name (
    if confOk c config then
      check c config
      {
        nvshmemDir = "${config.services.deepep.nvshmem.package}";
        gdrdrvPackage = config.services.deepep.gdrcopy.kernelModule;
        doctorPackage = config.services.deepep.doctor.package;
        exactModprobe = false;
      }
    else "unreachable"
  ))
  cases)
