# Declarations of the NixOS options services.deepep reads or sets, with the types NixOS gives
# them, so lib-eval.nix can run the module through nixpkgs' lib.evalModules without the rest of
# NixOS. `nvidiaEnabled` stands in for NixOS' read-only hardware.nvidia.enabled.
{ nvidiaEnabled }:
{ lib, ... }:
let
  inherit (lib) mkOption types;
  opt = type: default: mkOption { inherit type default; };

  # The part of NixOS' systemd.services.<name> the module sets, with NixOS' types.
  service = types.submodule {
    options = {
      description = opt types.str "";
      wantedBy = opt (types.listOf types.str) [ ];
      after = opt (types.listOf types.str) [ ];
      environment = opt (types.attrsOf (types.nullOr (types.oneOf [ types.str types.path types.package ]))) { };
      path = opt (types.listOf (types.oneOf [ types.package types.str ])) [ ];
      serviceConfig = opt (types.attrsOf (types.oneOf [ types.bool types.int types.str (types.listOf types.str) ])) { };
    };
  };

  # The driver package: nixpkgs' nvidia_x11 has nvidia-smi in its `bin` output.
  nvidiaPackage = derivation {
    name = "nvidia-x11-580.95.05";
    version = "580.95.05";
    system = "x86_64-linux";
    builder = "/bin/sh";
    outputs = [ "out" "bin" ];
  };
in
{
  options = {
    assertions = opt (types.listOf types.unspecified) [ ];
    warnings = opt (types.listOf types.str) [ ];
    boot = {
      extraModprobeConfig = opt types.lines "";
      initrd.extraModprobeConfig = opt types.lines "";
      initrd.kernelModules = opt (types.listOf types.str) [ ];
      kernelModules = opt (types.listOf types.str) [ ];
      kernelParams = opt (types.listOf types.str) [ ];
      extraModulePackages = opt (types.listOf types.package) [ ];
      kernelPackages = opt types.raw { };
    };
    services.udev.extraRules = opt types.lines "";
    systemd.services = opt (types.attrsOf service) { };
    environment = {
      systemPackages = opt (types.listOf types.package) [ ];
      variables = opt (types.attrsOf types.str) { };
    };
    hardware.nvidia = {
      enabled = mkOption { type = types.bool; default = nvidiaEnabled; readOnly = true; };
      open = opt types.bool false;
      package = opt types.raw nvidiaPackage;
      nvidiaPersistenced = opt types.bool false;
      datacenter.enable = opt types.bool false;
    };
  };
}
