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
# Arguments model what differs between nixpkgs revisions around the pin (docs/nix.md, "Audit
# against nixpkgs"); cases set them through `standIns` (lib-eval only: the real-NixOS
# evaluation has the pinned revision's answer):
#   datacenterHonoursOpen     whether nvidia.nix installs the open kernel modules in datacenter
#                             mode when hardware.nvidia.open = true. nixpkgs before PR #511778
#                             (merged 2026, "dc_5{7,8,9}0: add open kernel modules") always
#                             installed the proprietary ones there; the cases run both.
#   closedModules             the driver attribute holding the proprietary kernel modules:
#                             "mod" (a derivation of its own, pname "nvidia-kernel-modules",
#                             since nixpkgs PR #498612; nixos-26.05 nvidia.nix installs
#                             `if useOpenModules then [ nvidia_x11.open ] else [ nvidia_x11.mod ]`)
#                             or "bin" (the driver's bin output, before).
#   persistencedInDatacenter  whether nvidia.nix defines nvidia-persistenced.service in its
#                             datacenter block too. Every nvidia.nix read (2023 to 2026) defines it
#                             only in the X11 block (`lib.mkIf cfg.nvidiaPersistenced` among the
#                             X11 block's systemd.services), hence false; true models a revision
#                             that moved it.
{ datacenterHonoursOpen ? true, closedModules ? "mod", persistencedInDatacenter ? false }:
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

  # nixos/modules/system/boot/modprobe.nix: the options, and the files it writes under
  # boot.modprobeConfig.enable: /etc/modprobe.d/nixos.conf from them (blacklist lines, then
  # boot.extraModprobeConfig), ubuntu.conf (Ubuntu's module blacklist, under
  # boot.modprobeConfig.useUbuntuModuleBlacklist) and debian.conf (Debian's aliases); the
  # systemd.conf it links from systemd's package is left out (it reads systemd.package, which
  # nothing here declares). Both initrd flavours copy nixos.conf (nixos/modules/system/boot/
  # stage-1.nix, systemd/initrd.nix); the other files stay out of the initrd.
  {
    mirrors = "nixos/modules/system/boot/modprobe.nix";
    module = { config, lib, pkgs, ... }: {
      options.boot = {
        modprobeConfig.enable = lib.mkEnableOption "modprobe config. This is useful for systems like containers which do not require a kernel" // { default = true; };
        modprobeConfig.useUbuntuModuleBlacklist = lib.mkEnableOption "Ubuntu distro's module blacklist" // { default = true; };
        blacklistedKernelModules = lib.mkOption { type = lib.types.listOf lib.types.str; default = [ ]; };
        extraModprobeConfig = lib.mkOption { type = lib.types.lines; default = ""; };
      };
      config = lib.mkIf config.boot.modprobeConfig.enable {
        environment.etc."modprobe.d/ubuntu.conf" = lib.mkIf config.boot.modprobeConfig.useUbuntuModuleBlacklist {
          source = "${pkgs.kmod-blacklist-ubuntu}/modprobe.conf";
        };
        environment.etc."modprobe.d/nixos.conf".text = ''
          ${lib.concatStringsSep "" (map (name: "blacklist ${name}\n") config.boot.blacklistedKernelModules)}
          ${config.boot.extraModprobeConfig}
        '';
        environment.etc."modprobe.d/debian.conf".source = pkgs.kmod-debian-aliases;
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

  # nixos/modules/system/etc/etc.nix (`text` and `source` of environment.etc.<name>; in NixOS
  # `source` is a path that `text` defaults into; its `mode`, ... are not read here)
  {
    mirrors = "nixos/modules/system/etc/etc.nix";
    module = { lib, ... }: {
      options.environment.etc = lib.mkOption {
        type = lib.types.attrsOf (lib.types.submodule {
          options.text = lib.mkOption { type = lib.types.nullOr lib.types.lines; default = null; };
          options.source = lib.mkOption { type = lib.types.nullOr lib.types.path; default = null; };
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
  # was expected"); the kernel modules it installs are `package.open` or the proprietary ones
  # (`closedModules`); nvidia-persistenced.service exists in the X11 block only
  # (`persistencedInDatacenter`), nvidia-fabricmanager.service in the datacenter block.
  {
    mirrors = "nixos/modules/hardware/video/nvidia.nix";
    module = { config, lib, ... }:
      let
        cfg = config.hardware.nvidia;
        nvidiaEnabled = lib.elem "nvidia" config.services.xserver.videoDrivers;
        nvidia_x11 = if nvidiaEnabled || cfg.datacenter.enable then cfg.package else null;
        useOpenModules = cfg.open == true;
        modulePackages = openAllowed: if openAllowed && useOpenModules then [ nvidia_x11.open ] else [ nvidia_x11.${closedModules} ];
        # The X11 block's unit (lib.getExe nvidia_x11.persistenced there).
        persistencedUnit = lib.mkIf cfg.nvidiaPersistenced {
          description = "NVIDIA Persistence Daemon";
          wantedBy = [ "multi-user.target" ];
          serviceConfig = {
            Type = "forking";
            Restart = "always";
            PIDFile = "/var/run/nvidia-persistenced/nvidia-persistenced.pid";
            ExecStart = "${lib.getBin nvidia_x11.persistenced}/bin/nvidia-persistenced --verbose";
            ExecStopPost = "/stub/coreutils/bin/rm -rf /var/run/nvidia-persistenced";
          };
        };
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
            systemd.services.nvidia-persistenced = persistencedUnit;
            boot.extraModulePackages = modulePackages true;
            # (nvidia, nvidia_modeset, nvidia_drm are added only with services.xserver.enable,
            # which the module neither sets nor reads; left out here.)
            boot.kernelModules = lib.optional useOpenModules "nvidia_uvm";
            boot.kernelParams = lib.optional useOpenModules "nvidia.NVreg_OpenRmEnableUnsupportedGpus=1";
          })
          (lib.mkIf cfg.datacenter.enable {
            systemd.services.nvidia-fabricmanager = {
              description = "Start NVIDIA NVLink Management";
              wantedBy = [ "multi-user.target" ];
              serviceConfig.Type = "forking";
            };
            systemd.services.nvidia-persistenced = lib.mkIf persistencedInDatacenter persistencedUnit;
            boot.extraModulePackages = modulePackages datacenterHonoursOpen;
            boot.kernelModules = lib.optional (datacenterHonoursOpen && useOpenModules) "nvidia_uvm";
          })
        ]);
      };
  }
]
