# Stand-ins for the NixOS modules whose options services.deepep defines or reads, so the module
# can be evaluated without NixOS (CI has no nixpkgs). They are evidence, not assumptions: each
# declares only options that NixOS declares, with NixOS' types and defaults, and adds to the
# shared options what the NixOS module itself adds there (nixos.conf's text, nvidia.nix's own
# modprobe line, module packages, kernel parameters and assertions).
#
# Every entry names the nixpkgs file it mirrors in `mirrors` (checked by checks/module/
# coverage.nix: an entry without it fails CI) and in the comment above it. The declarations
# were read from nixpkgs' nixos-unstable sources of 2025-2026; the pinned rev (flake.lock,
# 83199d0d) is not readable offline, and the real-NixOS evaluation (`nix flake check`,
# checks/module/nixos-eval.nix) runs the same cases against the pinned NixOS itself.
#
# datacenterHonoursOpen: whether nvidia.nix installs the open kernel modules in datacenter mode
# when hardware.nvidia.open = true. nixpkgs before PR #511778 (merged 2026, "dc_5{7,8,9}0: add
# open kernel modules") always installed the proprietary ones there; the cases run both.
{ datacenterHonoursOpen ? true }:
[
  # nixos/modules/misc/assertions.nix
  {
    mirrors = "nixos/modules/misc/assertions.nix";
    module = { lib, ... }: {
      options = {
        assertions = lib.mkOption { type = lib.types.listOf lib.types.unspecified; default = [ ]; };
        warnings = lib.mkOption { type = lib.types.listOf lib.types.str; default = [ ]; };
      };
    };
  }

  # nixos/modules/system/boot/modprobe.nix: the options, and the /etc/modprobe.d/nixos.conf it
  # writes from them (blacklist lines, then boot.extraModprobeConfig). Both initrd flavours copy
  # that same file (nixos/modules/system/boot/stage-1.nix, systemd/initrd.nix).
  {
    mirrors = "nixos/modules/system/boot/modprobe.nix";
    module = { config, lib, ... }: {
      options.boot = {
        modprobeConfig.enable = lib.mkEnableOption "modprobe config. This is useful for systems like containers which do not require a kernel" // { default = true; };
        modprobeConfig.useUbuntuModuleBlacklist = lib.mkEnableOption "Ubuntu distro's module blacklist" // { default = true; };
        blacklistedKernelModules = lib.mkOption { type = lib.types.listOf lib.types.str; default = [ ]; };
        extraModprobeConfig = lib.mkOption { type = lib.types.lines; default = ""; };
      };
      config = lib.mkIf config.boot.modprobeConfig.enable {
        environment.etc."modprobe.d/nixos.conf".text = ''
          ${lib.concatStringsSep "" (map (name: "blacklist ${name}\n") config.boot.blacklistedKernelModules)}
          ${config.boot.extraModprobeConfig}
        '';
      };
    };
  }

  # nixos/modules/system/boot/kernel.nix
  {
    mirrors = "nixos/modules/system/boot/kernel.nix";
    module = { lib, pkgs, ... }: {
      options.boot = {
        kernelPackages = lib.mkOption { type = lib.types.raw; default = pkgs.linuxPackages; };
        kernelParams = lib.mkOption {
          type = lib.types.listOf (lib.types.strMatching ''([^"[:space:]]|"[^"]*")+'');
          default = [ ];
        };
        extraModulePackages = lib.mkOption { type = lib.types.listOf lib.types.package; default = [ ]; };
        kernelModules = lib.mkOption { type = lib.types.listOf lib.types.str; default = [ ]; apply = lib.unique; };
        initrd.kernelModules = lib.mkOption { type = lib.types.listOf lib.types.str; default = [ ]; };
      };
    };
  }

  # nixos/modules/system/etc/etc.nix (only `text` of environment.etc.<name>; its `source`,
  # `mode`, ... are not read here)
  {
    mirrors = "nixos/modules/system/etc/etc.nix";
    module = { lib, ... }: {
      options.environment.etc = lib.mkOption {
        type = lib.types.attrsOf (lib.types.submodule {
          options.text = lib.mkOption { type = lib.types.nullOr lib.types.lines; default = null; };
        });
        default = { };
      };
    };
  }

  # nixos/modules/config/system-path.nix
  {
    mirrors = "nixos/modules/config/system-path.nix";
    module = { lib, ... }: {
      options.environment.systemPackages = lib.mkOption { type = lib.types.listOf lib.types.package; default = [ ]; };
    };
  }

  # nixos/modules/config/shells-environment.nix (environment.variables: lists are joined with ':')
  {
    mirrors = "nixos/modules/config/shells-environment.nix";
    module = { lib, ... }: {
      options.environment.variables = lib.mkOption {
        type = with lib.types; attrsOf (oneOf [ (listOf (oneOf [ int str path ])) int str path ]);
        default = { };
        apply = lib.mapAttrs (_: v: if builtins.isList v then lib.concatStringsSep ":" (map toString v) else toString v);
      };
    };
  }

  # nixos/modules/services/hardware/udev.nix
  {
    mirrors = "nixos/modules/services/hardware/udev.nix";
    module = { lib, ... }: {
      options.services.udev.extraRules = lib.mkOption { type = lib.types.lines; default = ""; };
    };
  }

  # nixos/modules/system/boot/systemd.nix with the unit options of
  # nixos/lib/systemd-unit-options.nix (only those services.deepep sets)
  {
    mirrors = "nixos/modules/system/boot/systemd.nix";
    module = { lib, ... }:
      let
        inherit (lib) mkOption types;
        unitName = types.str;
      in
      {
        options.systemd.services = mkOption {
          type = types.attrsOf (types.submodule {
            options = {
              description = mkOption { type = types.str; default = ""; };
              wantedBy = mkOption { type = types.listOf unitName; default = [ ]; };
              after = mkOption { type = types.listOf unitName; default = [ ]; };
              environment = mkOption { type = types.attrsOf (types.nullOr (types.oneOf [ types.str types.path types.package ])); default = { }; };
              path = mkOption { type = types.listOf (types.oneOf [ types.package types.str ]); default = [ ]; };
              serviceConfig = mkOption { type = types.attrsOf (types.oneOf [ types.bool types.int types.str (types.listOf types.str) ]); default = { }; };
            };
          });
          default = { };
        };
      };
  }

  # nixos/modules/services/x11/xserver.nix
  {
    mirrors = "nixos/modules/services/x11/xserver.nix";
    module = { lib, ... }: {
      options.services.xserver.videoDrivers = lib.mkOption { type = lib.types.listOf lib.types.str; default = [ "modesetting" "fbdev" ]; };
    };
  }

  # nixos/modules/hardware/video/nvidia.nix: the driver is on with "nvidia" in
  # services.xserver.videoDrivers or with hardware.nvidia.datacenter.enable (not both: its own
  # assertion); `open` is nullOr bool, null by default for drivers >= 560, and its default reads
  # the driver's version, so reading it with the driver off fails ("value is null while a set
  # was expected"); the kernel modules it installs are `package.open` or the proprietary ones.
  {
    mirrors = "nixos/modules/hardware/video/nvidia.nix";
    module = { config, lib, ... }:
      let
        cfg = config.hardware.nvidia;
        nvidiaEnabled = lib.elem "nvidia" config.services.xserver.videoDrivers;
        nvidia_x11 = if nvidiaEnabled || cfg.datacenter.enable then cfg.package else null;
        useOpenModules = cfg.open == true;
        modulePackages = openAllowed: if openAllowed && useOpenModules then [ nvidia_x11.open ] else [ nvidia_x11.bin ];
      in
      {
        options.hardware.nvidia = {
          enabled = lib.mkOption { readOnly = true; type = lib.types.bool; default = nvidia_x11 != null; };
          datacenter.enable = lib.mkEnableOption "Data Center drivers for NVIDIA cards on a NVLink topology";
          package = lib.mkOption {
            default = config.boot.kernelPackages.nvidiaPackages.${if cfg.datacenter.enable then "dc" else "stable"};
          };
          open = lib.mkOption {
            type = lib.types.nullOr lib.types.bool;
            default = if lib.versionOlder nvidia_x11.version "560" then false else null;
          };
          nvidiaPersistenced = lib.mkEnableOption "nvidia-persistenced";
        };
        config = lib.mkIf (nvidia_x11 != null) (lib.mkMerge [
          {
            assertions = [
              {
                assertion = !(nvidiaEnabled && cfg.datacenter.enable);
                message = "You cannot configure both X11 and Data Center drivers at the same time.";
              }
              {
                assertion = cfg.open != null || cfg.datacenter.enable;
                message = ''
                  You must configure `hardware.nvidia.open` on NVIDIA driver versions >= 560.
                  It is suggested to use the open source kernel modules on Turing or later GPUs (RTX series, GTX 16xx), and the closed source modules otherwise.
                '';
              }
            ];
            boot.blacklistedKernelModules = [ "nouveau" "nvidiafb" ];
            boot.extraModprobeConfig = ''
              softdep nvidia post: nvidia-uvm
            '';
          }
          (lib.mkIf nvidiaEnabled {
            boot.extraModulePackages = modulePackages true;
            # (nvidia, nvidia_modeset, nvidia_drm are added only with services.xserver.enable,
            # which the module neither sets nor reads; left out here.)
            boot.kernelModules = lib.optional useOpenModules "nvidia_uvm";
            boot.kernelParams = lib.optional useOpenModules "nvidia.NVreg_OpenRmEnableUnsupportedGpus=1";
          })
          (lib.mkIf cfg.datacenter.enable {
            boot.extraModulePackages = modulePackages datacenterHonoursOpen;
            boot.kernelModules = lib.optional (datacenterHonoursOpen && useOpenModules) "nvidia_uvm";
          })
        ]);
      };
  }
]
