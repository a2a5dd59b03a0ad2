# services.deepep: a host set up for DeepEP-style expert-parallel communication over NVSHMEM.
#
# - nvidia driver options for GPU-initiated IBGDA (one `options nvidia` line with
#   NVreg_EnableStreamMemOPs=1 and a single merged NVreg_RegistryDwords) in
#   boot.extraModprobeConfig, which NixOS writes to /etc/modprobe.d/nixos.conf; both initrd
#   flavours copy that file (nixos/modules/system/boot/stage-1.nix, systemd/initrd.nix), so the
#   options also apply when nvidia loads in stage 1;
# - GDRCopy's gdrdrv kernel module, /dev/gdrdrv (udev), libgdrapi on the system;
# - NVSHMEM on the system and its runtime knobs exported (only those that are set);
# - nvidia-persistenced on headless hosts (also in datacenter mode, where NixOS' nvidia.nix
#   defines no unit for it), the fabric manager on NVSwitch (HGX) boards;
# - a boot-time readiness check (deepep-doctor.service: `deepep-nix doctor`, verdict in the
#   journal; a host that is not ready does not fail the boot).
#
# The text this module writes is rendered by ./lib.nix (plain Nix, tested in CI without nixpkgs).
{ config
, lib
, pkgs
, ...
}:
let
  inherit (lib)
    literalExpression
    mkDefault
    mkEnableOption
    mkIf
    mkOption
    optional
    types
    ;

  pure = import ./lib.nix;
  deepepPkgs = import ../pkgs { inherit pkgs; };

  cfg = config.services.deepep;
  features = pure.methodFeatures cfg.ibgda.method;
  knobs = cfg.nvshmem;

  modprobeText = pure.renderModprobeConfig {
    inherit (cfg.ibgda) method registryDwords;
    gdrdrvParams = cfg.gdrcopy.moduleParams;
  };

  gdrdrvNodeScript = pkgs.writeShellScript "gdrdrv-mknod" ''
    PATH=${lib.makeBinPath [ pkgs.coreutils pkgs.gawk ]}
    ${pure.gdrdrvNodeScript { group = cfg.gdrcopy.group; mode = cfg.gdrcopy.deviceMode; }}
  '';

  conflicts = pure.conflictingRegistryDwords cfg.ibgda.registryDwords;

  # Every nvidia driver setting NixOS passes: boot.extraModprobeConfig (this module's line, the
  # user's and nvidia.nix's own) and boot.kernelParams.
  driverSettings = { modprobe = config.boot.extraModprobeConfig; kernelParams = config.boot.kernelParams; };
  # NVreg_RegistryDwords settings, this module's included (at most one may exist).
  dwordsSettings = pure.registryDwordsSettings driverSettings;
  # The user's NVreg_EnableStreamMemOPs values other than the 1 this module writes.
  streamMemOpsContradictions = pure.streamMemOpsContradictions driverSettings;

  # nixos/modules/hardware/video/nvidia.nix: hardware.nvidia.enabled is true with "nvidia" in
  # services.xserver.videoDrivers or with hardware.nvidia.datacenter.enable. With the driver off,
  # hardware.nvidia.open must not be read (its default reads the absent driver's version).
  # (Option paths outside services.deepep are written out in full: checks/module/coverage.nix
  # finds them in this file's text.)
  nvidiaOn = config.hardware.nvidia.enabled;
  openSetting = if nvidiaOn then config.hardware.nvidia.open else null;

  # The kernel-module flavour NixOS actually loads: nvidia.nix puts either the driver's open
  # modules (`package.open`) or the proprietary ones into boot.extraModulePackages, depending on
  # hardware.nvidia.open and, in datacenter mode, on the nixpkgs revision (before nixpkgs PR
  # #511778 it always installed the proprietary ones there). gdrdrv is built for the open
  # flavour (pkgs/gdrcopy/gdrdrv.nix) and DMA-BUF needs it, so both follow this, not the option.
  openPackage = if nvidiaOn then config.hardware.nvidia.package.open or null else null;
  openModulesLoaded = openPackage != null
    && lib.any (p: (p.outPath or null) == openPackage.outPath) config.boot.extraModulePackages;
  flavourProblem =
    if openSetting == null then
      "hardware.nvidia.open is not set (null, its default for drivers >= 560), so NixOS installs the proprietary kernel modules"
    else if openSetting == false then
      "hardware.nvidia.open = false installs the proprietary kernel modules"
    else if openPackage == null then
      "the driver package ${config.hardware.nvidia.package.name or "?"} has no open kernel modules (hardware.nvidia.package.open)"
    else if config.hardware.nvidia.datacenter.enable then
      "hardware.nvidia.open = true, but in datacenter mode (hardware.nvidia.datacenter.enable, set by services.deepep.fabricManager.enable) this nixpkgs installs the proprietary kernel modules of ${config.hardware.nvidia.package.name or "the driver"} anyway (nixpkgs before PR #511778, or a datacenter driver older than 570)"
    else "hardware.nvidia.open = true, but boot.extraModulePackages does not contain the driver's open modules (${openPackage.name or "?"})";

  nvshmemVersion = cfg.nvshmem.package.version or "unknown";

  # nixos/modules/hardware/video/nvidia.nix creates nvidia-persistenced.service only in its X11
  # block (mkIf cfg.nvidiaPersistenced there); its datacenter block runs the fabric manager but
  # no persistenced, so hardware.nvidia.nvidiaPersistenced alone does nothing on an HGX host
  # (docs/nix.md, "Audit against nixpkgs"). In datacenter mode this module defines the same unit
  # with mkDefault: a NixOS revision that defines it there too (at normal priority) wins.
  persistencedInDatacenter = nvidiaOn && config.hardware.nvidia.datacenter.enable && config.hardware.nvidia.nvidiaPersistenced;
  persistencedPackage = if persistencedInDatacenter then config.hardware.nvidia.package.persistenced or null else null;

  doctorProblem = pure.doctorCapabilitiesProblem cfg.doctor.capabilities;

  knobOption = { type, default ? null, description, example ? null }:
    mkOption ({
      type = types.nullOr type;
      inherit default;
      description = description + " Exported system-wide only when not null.";
    } // lib.optionalAttrs (example != null) { inherit example; });
in
{
  options.services.deepep = {
    enable = mkEnableOption "a host configured for DeepEP-style expert-parallel communication (NVSHMEM, IBGDA)";

    ibgda = {
      method = mkOption {
        type = types.enum (lib.attrNames pure.ibgdaMethods);
        default = "driver";
        description = ''
          How NVSHMEM's IBGDA transport drives the NIC.
          - "driver": GPU-initiated; sets `options nvidia NVreg_EnableStreamMemOPs=1
            NVreg_RegistryDwords="PeerMappingOverride=1;"` in /etc/modprobe.d/nixos.conf (also in
            the initrd's copy when nvidia loads in stage 1). The driver reads them when it loads:
            they take effect after a reboot.
          - "gdrcopy": CPU-assisted with the gdrcopy backend; builds and loads gdrdrv, creates
            /dev/gdrdrv and installs libgdrapi.
          - "both": all of the above (NVSHMEM picks the GPU handler when the driver allows it).
          - "none": no driver options and no gdrdrv; NVSHMEM >= 3.4.5 still runs IBGDA with its
            CPU-assisted fallback.
        '';
      };

      registryDwords = mkOption {
        type = types.listOf types.str;
        default = [ ];
        example = [ "RmProfilingAdminOnly=0" ];
        description = ''
          Entries of the nvidia module's NVreg_RegistryDwords, one "Key=Value" per element. Every
          module and the user may add to this list; the entries are joined with ';' into the single
          NVreg_RegistryDwords value this module writes (the driver reads only one). With
          `method = "driver"` or `"both"` this module adds "PeerMappingOverride=1". Do not set
          NVreg_RegistryDwords anywhere else (an `options nvidia` line in boot.extraModprobeConfig,
          `nvidia.NVreg_RegistryDwords=` in boot.kernelParams): that is refused by an assertion, as
          is an NVreg_EnableStreamMemOPs other than 1 there. Only used when the method sets driver
          options.
        '';
      };
    };

    gdrcopy = {
      package = mkOption {
        type = types.package;
        default = deepepPkgs.packages.gdrcopy;
        defaultText = literalExpression "deepep-nix's gdrcopy package";
        description = "GDRCopy library and tools installed on the system (libgdrapi.so.2).";
      };

      kernelModule = mkOption {
        type = types.package;
        default = deepepPkgs.gdrdrvFor config.boot.kernelPackages config.hardware.nvidia.package;
        defaultText = literalExpression "gdrdrv built with config.boot.kernelPackages for config.hardware.nvidia.package";
        description = "The gdrdrv kernel module package; it must match the running kernel and nvidia driver.";
      };

      moduleParams = mkOption {
        type = types.attrsOf (types.oneOf [ types.bool types.int types.str ]);
        default = { };
        example = { use_persistent_mapping = true; };
        description = "gdrdrv module parameters (dbg_enabled, info_enabled, use_persistent_mapping), written as an `options gdrdrv` line.";
      };

      group = mkOption {
        type = types.strMatching "[A-Za-z_][A-Za-z0-9_-]*";
        default = "video";
        description = "Group that owns /dev/gdrdrv; users running NVSHMEM jobs must be in it.";
      };

      deviceMode = mkOption {
        type = types.strMatching "0?[0-7]{3}";
        default = "0660";
        description = "Mode of /dev/gdrdrv (upstream's scripts use 0666).";
      };
    };

    nvshmem = {
      package = mkOption {
        type = types.package;
        default = deepepPkgs.packages.nvshmem;
        defaultText = literalExpression "deepep-nix's nvshmem (3.4.5, CUDA 13)";
        example = literalExpression "inputs.deepep-nix.packages.\${pkgs.system}.nvshmem_3_3_9_cuda12";
        description = "NVSHMEM installed on the system; NVSHMEM_DIR points at it.";
      };

      disableP2P = knobOption {
        type = types.bool;
        description = "NVSHMEM_DISABLE_P2P: do not use NVLink/PCIe peer-to-peer between GPUs of a node.";
      };
      ibEnableIbgda = knobOption {
        type = types.bool;
        description = "NVSHMEM_IB_ENABLE_IBGDA: use the IBGDA (GPUDirect Async) transport.";
      };
      ibgdaNumRcPerPe = knobOption {
        type = types.ints.positive;
        example = 24;
        description = "NVSHMEM_IBGDA_NUM_RC_PER_PE: RC queue pairs per PE (DeepEP low-latency mode uses one per local expert).";
      };
      qpDepth = knobOption {
        type = types.ints.positive;
        default = 1024;
        description = "NVSHMEM_QP_DEPTH (DeepEP's value: 1024).";
      };
      maxTeams = knobOption {
        type = types.ints.positive;
        default = 7;
        description = "NVSHMEM_MAX_TEAMS (DeepEP's value: 7; NVSHMEM 3.7 needs more, see the warning).";
      };
      cumemGranularity = knobOption {
        type = types.ints.positive;
        example = 536870912;
        description = "NVSHMEM_CUMEM_GRANULARITY in bytes; at least 256 MiB (268435456). DeepEP uses 2^29.";
      };
      ibSl = knobOption {
        type = types.ints.between 0 15;
        description = "NVSHMEM_IB_SL: InfiniBand service level.";
      };
    };

    environment = mkOption {
      type = types.attrsOf types.str;
      readOnly = true;
      description = ''
        The variables this module exports system-wide (NVSHMEM_DIR and the knobs that are set).
        Use it for services, which do not see environment.variables:
        `systemd.services.<name>.environment = config.services.deepep.environment;`.
      '';
    };

    doctor = {
      enable = mkOption {
        type = types.bool;
        default = true;
        description = ''
          Check at boot whether the host is ready for the capabilities below: a oneshot unit,
          deepep-doctor.service, runs `deepep-nix doctor` with the environment of
          services.deepep.environment. Its table and verdict go to the journal
          (`journalctl -u deepep-doctor`); a host that is not ready (doctor exits 1) still
          boots and the unit counts as successful. Only with services.deepep.enable.
        '';
      };

      capabilities = mkOption {
        type = types.listOf (types.enum pure.doctorCapabilities);
        default = pure.doctorDefaultCapabilities cfg.ibgda.method;
        defaultText = literalExpression ''
          [ "intranode" "low-latency" ]
          ++ lib.optional (elem ibgda.method [ "driver" "both" ]) "internode-ibgda"
          ++ lib.optional (elem ibgda.method [ "gdrcopy" "both" ]) "internode-cpu-ibgda"'';
        example = [ "intranode" "low-latency" ];
        description = ''
          The capabilities (`deepep-nix doctor --capability`) whose readiness the boot-time check
          reports as its verdict: "intranode", "low-latency" (NVLink), "internode-ibgda"
          (GPU-initiated IBGDA, needs the driver options), "internode-cpu-ibgda" (CPU-assisted
          IBGDA). The default follows ibgda.method; a single-node host with the default method
          "driver" should list only the NVLink ones (or use method "none").
        '';
      };

      package = mkOption {
        type = types.package;
        default = deepepPkgs.packages.deepep-nix;
        defaultText = literalExpression "deepep-nix's deepep-nix package (the CLI)";
        description = "The package whose bin/deepep-nix runs the check.";
      };
    };

    persistenced.enable = mkOption {
      type = types.bool;
      default = true;
      description = ''
        Run nvidia-persistenced (keeps GPUs initialised on headless hosts): sets
        hardware.nvidia.nvidiaPersistenced by default. With the X11 driver NixOS then runs
        nvidia-persistenced.service; in datacenter mode (fabricManager.enable), where NixOS'
        nvidia.nix defines no such unit, this module defines the same one.
      '';
    };

    fabricManager.enable = mkOption {
      type = types.bool;
      default = false;
      description = ''
        NVSwitch systems (HGX 8-GPU boards) need the fabric manager before GPUs can talk over
        NVLink; this enables nixpkgs' datacenter driver (hardware.nvidia.datacenter.enable), which
        runs it. A single-host NVLink pair (no NVSwitch) does not need it.
      '';
    };

    peermem.enable = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Load nvidia_peermem. Only for kernels with MLNX_OFED's peer-memory API (upstream kernels
        lack ib_register_peer_memory_client); otherwise NVSHMEM registers GPU memory with
        DMA-BUF, which needs the open kernel modules.
      '';
    };
  };

  config = lib.mkMerge [
    {
      # Always defined (empty when disabled) so that other modules can refer to it.
      services.deepep.environment = lib.optionalAttrs cfg.enable (
        { NVSHMEM_DIR = "${cfg.nvshmem.package}"; }
        // pure.nvshmemEnv (lib.filterAttrs (n: _: pure.knobVariables ? ${n}) knobs)
      );
    }
    (mkIf cfg.enable {
      services.deepep.ibgda.registryDwords = mkIf features.driverOptions pure.ibgdaRegistryDwords;

      assertions = [
        {
          assertion = nvidiaOn;
          message = ''
            services.deepep needs the nvidia driver, which is not enabled. Enable it with
              services.xserver.videoDrivers = [ "nvidia" ];   # also right on headless hosts
              hardware.nvidia.open = true;
            or, on NVSwitch (HGX) boards, with services.deepep.fabricManager.enable = true (the
            datacenter driver; not together with services.xserver.videoDrivers = [ "nvidia" ],
            which NixOS refuses).'';
        }
        {
          # NixOS writes boot.extraModprobeConfig only with boot.modprobeConfig.enable
          # (nixos/modules/system/boot/modprobe.nix).
          assertion = modprobeText != "" -> config.boot.modprobeConfig.enable;
          message = ''
            services.deepep.ibgda.method = "${cfg.ibgda.method}" writes nvidia/gdrdrv options to
            /etc/modprobe.d/nixos.conf, but boot.modprobeConfig.enable = false makes NixOS write no
            such file. Enable it, or use services.deepep.ibgda.method = "none".'';
        }
        {
          assertion = conflicts == [ ];
          message = ''
            services.deepep.ibgda.registryDwords sets the same key to different values: ${
              lib.concatMapStringsSep "; " (c: "${c.key} = ${lib.concatStringsSep " and " c.values}") conflicts
            }. Keep one value per key (lib.mkForce on the option replaces all definitions).'';
        }
        {
          assertion = features.driverOptions -> dwordsSettings <= 1;
          message = ''
            NVreg_RegistryDwords is set outside services.deepep (an `options nvidia` line in
            boot.extraModprobeConfig or nvidia.NVreg_RegistryDwords= in boot.kernelParams); the
            nvidia driver would see only one of the values. Move the entries into
            services.deepep.ibgda.registryDwords (a list; they are joined with ';').'';
        }
        {
          assertion = features.driverOptions -> streamMemOpsContradictions == [ ];
          message = ''
            NVreg_EnableStreamMemOPs is set to ${
              lib.concatMapStringsSep " and " (c: "${if c.value == null then "(no value)" else c.value} in ${c.where}") streamMemOpsContradictions
            }, but services.deepep.ibgda.method = "${cfg.ibgda.method}" sets NVreg_EnableStreamMemOPs=1
            (GPU-initiated IBGDA needs it); which one the driver takes depends on the order of the
            lines. Remove your setting, or use services.deepep.ibgda.method = "gdrcopy" or "none".'';
        }
        {
          assertion = knobs.cumemGranularity == null || knobs.cumemGranularity >= pure.minCumemGranularity;
          message = "services.deepep.nvshmem.cumemGranularity = ${toString knobs.cumemGranularity} is below 256 MiB; use at least ${toString pure.minCumemGranularity} (DeepEP uses 536870912) or null.";
        }
        {
          assertion = (nvidiaOn && features.gdrcopy) -> openModulesLoaded;
          message = ''
            services.deepep.ibgda.method = "${cfg.ibgda.method}" builds gdrdrv for the open nvidia kernel
            modules, which does not load next to the proprietary ones${
              lib.optionalString pkgs.stdenv.hostPlatform.isAarch64 " (and on aarch64/Grace the proprietary-flavour gdrdrv is not supported)"
            }: ${flavourProblem}. Set hardware.nvidia.open = true (with a driver and nixpkgs that
            install the open modules), or use ibgda.method = "driver".'';
        }
        {
          assertion = (nvidiaOn && cfg.ibgda.method != "none") -> (openModulesLoaded || cfg.peermem.enable);
          message = ''
            IBGDA registers GPU memory with the NIC through DMA-BUF, which needs the open nvidia kernel
            modules: ${flavourProblem}. Set hardware.nvidia.open = true (or, on a MLNX_OFED kernel,
            services.deepep.peermem.enable = true), or services.deepep.ibgda.method = "none".'';
        }
        {
          assertion = cfg.doctor.enable -> doctorProblem == null;
          message = toString doctorProblem;
        }
        {
          assertion = persistencedInDatacenter -> persistencedPackage != null;
          message = ''
            hardware.nvidia.nvidiaPersistenced is on (services.deepep.persistenced.enable sets it) in
            datacenter mode, where this module runs nvidia-persistenced itself, but the driver
            package ${config.hardware.nvidia.package.name or "?"} has no persistenced
            (hardware.nvidia.package.persistenced). Use a driver built with persistenced, or set
            services.deepep.persistenced.enable = false.'';
        }
      ];

      warnings =
        optional (knobs.maxTeams != null && knobs.maxTeams <= 7 && lib.versionAtLeast nvshmemVersion "3.7")
          "services.deepep: NVSHMEM ${nvshmemVersion} with NVSHMEM_MAX_TEAMS=${toString knobs.maxTeams} fails with \"No more teams available\"; set services.deepep.nvshmem.maxTeams to a larger value or null."
        ++ optional (!features.driverOptions && cfg.ibgda.registryDwords != [ ])
          "services.deepep.ibgda.registryDwords is set but ibgda.method = \"${cfg.ibgda.method}\" writes no nvidia options; the dwords are ignored (use method \"driver\" or \"both\").";

      boot.extraModprobeConfig = modprobeText;

      boot.extraModulePackages = optional features.gdrcopy cfg.gdrcopy.kernelModule;
      boot.kernelModules = optional features.gdrcopy "gdrdrv" ++ optional cfg.peermem.enable "nvidia_peermem";

      services.udev.extraRules = mkIf features.gdrcopy (pure.gdrdrvUdevRule gdrdrvNodeScript);

      environment.systemPackages = [ cfg.nvshmem.package ] ++ optional features.gdrcopy cfg.gdrcopy.package;
      environment.variables = cfg.environment;

      # The readiness check. doctor only reads /proc, /sys, /dev, /etc and the NVSHMEM files and
      # runs `nvidia-smi topo -m`; exit 1 (a capability not ready) is a verdict, not a failure of
      # the unit, so it never holds up or fails the boot. Exit 2 (usage error) still fails it.
      systemd.services.deepep-doctor = mkIf cfg.doctor.enable {
        description = "DeepEP readiness check (deepep-nix doctor)";
        wantedBy = [ "multi-user.target" ];
        # gdrdrv and nvidia are loaded by systemd-modules-load; nvidia-persistenced initialises
        # the GPUs and the fabric manager brings up NVSwitch NVLink (when they run).
        after = [ "systemd-modules-load.service" ]
          ++ optional (nvidiaOn && config.hardware.nvidia.nvidiaPersistenced) "nvidia-persistenced.service"
          ++ optional (nvidiaOn && config.hardware.nvidia.datacenter.enable) "nvidia-fabricmanager.service";
        environment = cfg.environment;
        # nvidia-smi (the driver's bin output), for doctor's NVLink check.
        path = optional nvidiaOn (lib.getBin config.hardware.nvidia.package);
        serviceConfig = {
          Type = "oneshot";
          RemainAfterExit = true;
          ExecStart = pure.doctorCommand "${cfg.doctor.package}/bin/deepep-nix" cfg.doctor.capabilities;
          SuccessExitStatus = "0 1";
          # multi-user.target waits for a oneshot it wants; doctor's slowest step is nvidia-smi
          # (15 s limit), so this only bounds the unexpected (oneshots have no limit by default).
          TimeoutStartSec = "2min";
        };
      };

      hardware.nvidia.nvidiaPersistenced = mkIf cfg.persistenced.enable (mkDefault true);
      # The unit nvidia.nix's X11 block would create (same settings), for datacenter mode.
      systemd.services.nvidia-persistenced = mkIf (persistencedPackage != null) (mkDefault {
        description = "NVIDIA Persistence Daemon";
        wantedBy = [ "multi-user.target" ];
        serviceConfig = {
          Type = "forking";
          Restart = "always";
          PIDFile = "/var/run/nvidia-persistenced/nvidia-persistenced.pid";
          ExecStart = "${lib.getBin persistencedPackage}/bin/nvidia-persistenced --verbose";
          ExecStopPost = "${pkgs.coreutils}/bin/rm -rf /var/run/nvidia-persistenced";
        };
      });
      hardware.nvidia.datacenter.enable = mkIf cfg.fabricManager.enable (mkDefault true);
    })
  ];
}
