# Declarations of the NixOS options services.deepep reads or sets, with the types NixOS gives
# them, so lib-eval.nix can run the module through nixpkgs' lib.evalModules without the rest of
# NixOS. `nvidiaEnabled` stands in for NixOS' read-only hardware.nvidia.enabled.
{ nvidiaEnabled }:
{ lib, ... }:
let
  inherit (lib) mkOption types;
  opt = type: default: mkOption { inherit type default; };
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
    environment = {
      systemPackages = opt (types.listOf types.package) [ ];
      variables = opt (types.attrsOf types.str) { };
    };
    hardware.nvidia = {
      enabled = mkOption { type = types.bool; default = nvidiaEnabled; readOnly = true; };
      open = opt types.bool false;
      package = opt types.raw { version = "580.95.05"; };
      nvidiaPersistenced = opt types.bool false;
      datacenter.enable = opt types.bool false;
    };
  };
}
