# Configurations of services.deepep and what they must produce. Shared by
#   lib-eval.nix    the module over the NixOS stand-ins (stand-ins.nix), through nixpkgs' real
#                   lib.evalModules (NIXPKGS_LIB) or checks/module/mini-lib.nix (CI)
#   nixos-eval.nix  real NixOS at the pinned nixpkgs (nixos/lib/eval-config.nix; a flake check)
# Package values are set explicitly by lib-eval (stubs); NixOS uses the module's defaults.
#
# expect (every field optional):
#   modprobe        the lines the module adds to boot.extraModprobeConfig (compared as the lines
#                   that carry NVreg_EnableStreamMemOPs / NVreg_RegistryDwords / `options
#                   gdrdrv`); they must also be lines of /etc/modprobe.d/nixos.conf, the file both
#                   initrd flavours copy, with NVreg_RegistryDwords on one line only
#   kernelModules   boot.kernelModules among gdrdrv / nvidia_peermem
#   gdrdrvPackage   whether the gdrdrv package is in boot.extraModulePackages
#   env             exact environment.variables the module sets
#   udevGdrdrv      whether the udev rules contain the gdrdrv rule
#   persistenced    hardware.nvidia.nvidiaPersistenced
#   persistencedUnit  whether nvidia-persistenced.service exists (and then runs the driver's
#                   persistenced with --verbose), whoever defines it: NixOS' nvidia.nix (its X11
#                   block) or the module (datacenter mode, where nvidia.nix defines none)
#   nvidiaModules   lib.getName of the nvidia kernel-module packages in boot.extraModulePackages
#                   (nvidia-open, nvidia-kernel-modules, or nvidia-x11/nvidia-dc: the driver's bin)
#   datacenter      hardware.nvidia.datacenter.enable
#   doctorArgs      the arguments of deepep-doctor.service's ExecStart after the deepep-nix
#                   binary (null: the unit must not exist); a unit that exists is also checked
#                   for its fixed shape (see expect.nix)
#   doctorAfter     deepep-doctor.service's `after`
#   failed          substrings that must each appear in some failed assertion's message
#                   ([] = no assertion may fail); a case that expects failures must still
#                   evaluate (an evaluation error fails the case)
#
# `nvidia` (default true) is how the driver is enabled: true = services.xserver.videoDrivers
# (also right on headless hosts), "datacenter" = through services.deepep.fabricManager (NixOS
# refuses both at once), false = not at all. `standIns` are the arguments of stand-ins.nix
# (lib-eval only), `system` the host platform (lib-eval only; nixos-eval runs the cases of the
# flake's system).
let
  openModules = { hardware.nvidia.open = true; };
  driverLine = ''options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"'';
  cap = c: "--capability ${c}";
  nvlinkCaps = "doctor ${cap "intranode"} ${cap "low-latency"}";
  dmabuf = "DMA-BUF, which needs the open nvidia kernel";
in
[
  {
    # The README's NixOS example.
    name = "readme-example";
    module = openModules // {
      services.deepep = { enable = true; ibgda.method = "both"; };
    };
    expect = {
      modprobe = driverLine + "\n";
      kernelModules = [ "gdrdrv" ];
      gdrdrvPackage = true;
      udevGdrdrv = true;
      failed = [ ];
    };
  }
  {
    name = "method-driver";
    module = openModules // { services.deepep.enable = true; };
    expect = {
      modprobe = driverLine + "\n";
      kernelModules = [ ];
      gdrdrvPackage = false;
      env = { NVSHMEM_QP_DEPTH = "1024"; NVSHMEM_MAX_TEAMS = "7"; };
      udevGdrdrv = false;
      persistenced = true;
      persistencedUnit = true;
      nvidiaModules = [ "nvidia-open" ];
      datacenter = false;
      doctorArgs = "${nvlinkCaps} ${cap "internode-ibgda"}";
      doctorAfter = [ "systemd-modules-load.service" "nvidia-persistenced.service" ];
      failed = [ ];
    };
  }
  {
    # nvidia loads in stage 1: the options reach it through nixos.conf, which both initrd
    # flavours copy; the module needs (and has) nothing initrd-specific.
    name = "nvidia-in-stage-1";
    module = openModules // {
      boot.initrd.kernelModules = [ "nvidia" ];
      services.deepep.enable = true;
    };
    expect = { modprobe = driverLine + "\n"; failed = [ ]; };
  }
  {
    # HGX: the datacenter driver (fabric manager), open modules, every method's files, a
    # registry dword from another module merged into the one line.
    name = "hgx-fabric-manager-both";
    nvidia = "datacenter";
    module = {
      imports = [
        { services.deepep.ibgda.registryDwords = [ "RmProfilingAdminOnly=0" ]; }
      ];
      hardware.nvidia.open = true;
      services.deepep = {
        enable = true;
        ibgda.method = "both";
        ibgda.registryDwords = [ "PeerMappingOverride=1" ];
        gdrcopy.moduleParams = { use_persistent_mapping = true; };
        nvshmem = {
          ibEnableIbgda = true;
          disableP2P = false;
          ibgdaNumRcPerPe = 24;
          cumemGranularity = 536870912;
          ibSl = 3;
        };
        fabricManager.enable = true;
        persistenced.enable = false;
      };
    };
    expect = {
      modprobe = ''
        options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;RmProfilingAdminOnly=0;"
        options gdrdrv use_persistent_mapping=1
      '';
      kernelModules = [ "gdrdrv" ];
      gdrdrvPackage = true;
      env = {
        NVSHMEM_IB_ENABLE_IBGDA = "1";
        NVSHMEM_DISABLE_P2P = "0";
        NVSHMEM_IBGDA_NUM_RC_PER_PE = "24";
        NVSHMEM_CUMEM_GRANULARITY = "536870912";
        NVSHMEM_IB_SL = "3";
        NVSHMEM_QP_DEPTH = "1024";
        NVSHMEM_MAX_TEAMS = "7";
      };
      udevGdrdrv = true;
      persistenced = false;
      persistencedUnit = false;
      datacenter = true;
      doctorArgs = "${nvlinkCaps} ${cap "internode-ibgda"} ${cap "internode-cpu-ibgda"}";
      doctorAfter = [ "systemd-modules-load.service" "nvidia-fabricmanager.service" ];
      failed = [ ];
    };
  }
  {
    # HGX with persistenced on (the default): NixOS' nvidia.nix runs nvidia-persistenced only in
    # its X11 block, so in datacenter mode the module defines the unit itself; the boot-time
    # check waits for it and the fabric manager.
    name = "hgx-persistenced";
    nvidia = "datacenter";
    module = openModules // {
      services.deepep = { enable = true; fabricManager.enable = true; };
    };
    expect = {
      modprobe = driverLine + "\n";
      persistenced = true;
      persistencedUnit = true;
      nvidiaModules = [ "nvidia-open" ];
      datacenter = true;
      doctorArgs = "${nvlinkCaps} ${cap "internode-ibgda"}";
      doctorAfter = [ "systemd-modules-load.service" "nvidia-persistenced.service" "nvidia-fabricmanager.service" ];
      failed = [ ];
    };
  }
  {
    # A NixOS revision whose datacenter block defines nvidia-persistenced.service too: its
    # definition (normal priority) replaces the module's (mkDefault); still one unit, no conflict.
    name = "hgx-persistenced-defined-by-nixos";
    nvidia = "datacenter";
    standIns.persistencedInDatacenter = true;
    module = openModules // {
      services.deepep = { enable = true; fabricManager.enable = true; };
    };
    expect = { persistencedUnit = true; failed = [ ]; };
  }
  {
    # The user turns persistenced off in NixOS' own option: no unit, whatever the module's default.
    name = "hgx-persistenced-off-in-nixos-option";
    nvidia = "datacenter";
    module = {
      hardware.nvidia = { open = true; nvidiaPersistenced = false; };
      services.deepep = { enable = true; fabricManager.enable = true; };
    };
    expect = { persistenced = false; persistencedUnit = false; doctorAfter = [ "systemd-modules-load.service" "nvidia-fabricmanager.service" ]; failed = [ ]; };
  }
  {
    # A datacenter driver without persistenced: the module's assertion, not an evaluation error.
    # (lib-eval only: the stand-in driver set has such a driver; `standIns` keeps it out of the
    # real-NixOS evaluation.)
    name = "hgx-driver-without-persistenced";
    nvidia = "datacenter";
    standIns = { };
    module = { pkgs, ... }: {
      hardware.nvidia = { open = true; package = pkgs.linuxPackages.nvidiaPackages.dcWithoutPersistenced; };
      services.deepep = { enable = true; fabricManager.enable = true; };
    };
    expect = { persistencedUnit = false; failed = [ "has no persistenced" ]; };
  }
  {
    # Proprietary kernel modules: since nixpkgs PR #498612 a derivation of their own
    # (nvidia_x11.mod, pname "nvidia-kernel-modules", unfree), before it the driver's bin output.
    # Both only over the stand-ins: which one the pin has is the real evaluation's to show.
    name = "proprietary-modules";
    standIns.closedModules = "mod";
    module = { services.deepep = { enable = true; ibgda.method = "none"; }; hardware.nvidia.open = false; };
    expect = { nvidiaModules = [ "nvidia-kernel-modules" ]; failed = [ ]; };
  }
  {
    name = "proprietary-modules-before-the-split";
    standIns.closedModules = "bin";
    module = { services.deepep = { enable = true; ibgda.method = "none"; }; hardware.nvidia.open = false; };
    expect = { nvidiaModules = [ "nvidia-x11" ]; failed = [ ]; };
  }
  {
    # Ubuntu's blacklist off (boot.modprobeConfig.useUbuntuModuleBlacklist = false): NixOS then
    # writes no ubuntu.conf, and the module's line is still in nixos.conf.
    name = "ubuntu-blacklist-off";
    module = openModules // {
      boot.modprobeConfig.useUbuntuModuleBlacklist = false;
      services.deepep.enable = true;
    };
    expect = { modprobe = driverLine + "\n"; failed = [ ]; };
  }
  {
    # The same board with a nixpkgs whose datacenter mode installs the proprietary modules
    # whatever hardware.nvidia.open says (before nixpkgs PR #511778): gdrdrv (open flavour)
    # and DMA-BUF would not work, which the assertions say.
    name = "hgx-datacenter-proprietary-modules";
    nvidia = "datacenter";
    standIns.datacenterHonoursOpen = false;
    module = openModules // {
      services.deepep = { enable = true; ibgda.method = "both"; fabricManager.enable = true; };
    };
    expect.failed = [ "in datacenter mode" "builds gdrdrv for the open nvidia kernel" dmabuf ];
  }
  {
    # The README example plus the fabric manager: NixOS refuses X11 and datacenter drivers
    # together (its own assertion); the docs say to drop services.xserver.videoDrivers.
    name = "hgx-with-xserver-video-driver";
    module = openModules // { services.deepep = { enable = true; fabricManager.enable = true; }; };
    expect.failed = [ "Data Center drivers at the same time" ];
  }
  {
    name = "gdrcopy-only";
    module = openModules // {
      services.deepep = {
        enable = true;
        ibgda.method = "gdrcopy";
        nvshmem.qpDepth = null;
        nvshmem.maxTeams = null;
      };
    };
    expect = {
      modprobe = "";
      kernelModules = [ "gdrdrv" ];
      gdrdrvPackage = true;
      env = { };
      udevGdrdrv = true;
      doctorArgs = "${nvlinkCaps} ${cap "internode-cpu-ibgda"}";
      failed = [ ];
    };
  }
  {
    name = "none";
    module = { services.deepep = { enable = true; ibgda.method = "none"; }; hardware.nvidia.open = false; };
    expect = {
      modprobe = "";
      kernelModules = [ ];
      gdrdrvPackage = false;
      udevGdrdrv = false;
      doctorArgs = nvlinkCaps;
      failed = [ ];
    };
  }
  {
    # Disabled, and no nvidia driver at all: nothing is written, nothing fails.
    name = "disabled";
    nvidia = false;
    module = { services.deepep.enable = false; };
    expect = {
      modprobe = "";
      env = { };
      kernelModules = [ ];
      gdrdrvPackage = false;
      udevGdrdrv = false;
      persistenced = false;
      doctorArgs = null;
      failed = [ ];
    };
  }
  {
    name = "disabled-with-settings";
    module = { services.deepep.ibgda.method = "both"; hardware.nvidia.open = true; };
    expect = { modprobe = ""; kernelModules = [ ]; doctorArgs = null; failed = [ ]; };
  }
  {
    # No nvidia driver: the module's message, not an evaluation error (hardware.nvidia.open's
    # default cannot be read then).
    name = "no-nvidia-driver";
    nvidia = false;
    module = { services.deepep = { enable = true; ibgda.method = "both"; }; };
    expect.failed = [ "needs the nvidia driver" ];
  }
  {
    # hardware.nvidia.open left unset (null for drivers >= 560): NixOS' own assertion and ours,
    # no evaluation error.
    name = "open-unset";
    module = { services.deepep = { enable = true; ibgda.method = "both"; }; };
    expect.failed = [ "hardware.nvidia.open" "hardware.nvidia.open is not set" dmabuf ];
  }
  {
    name = "gdrcopy-needs-open-modules";
    module = {
      hardware.nvidia.open = false;
      services.deepep = { enable = true; ibgda.method = "gdrcopy"; };
    };
    expect.failed = [ "Set hardware.nvidia.open = true" dmabuf "hardware.nvidia.open = false installs the proprietary" ];
  }
  {
    # aarch64 (Grace): the same, with the aarch64 note; the driver method works as on x86_64.
    name = "aarch64-gdrcopy-proprietary";
    system = "aarch64-linux";
    module = {
      hardware.nvidia.open = false;
      services.deepep = { enable = true; ibgda.method = "gdrcopy"; };
    };
    expect.failed = [ "on aarch64/Grace the proprietary-flavour gdrdrv is not supported" ];
  }
  {
    name = "aarch64-driver";
    system = "aarch64-linux";
    module = openModules // { services.deepep.enable = true; };
    expect = { modprobe = driverLine + "\n"; failed = [ ]; };
  }
  {
    # Capabilities from two modules, out of order and repeated: each once, in doctor's order;
    # the ordering follows persistenced (off here).
    name = "doctor-capabilities-merged";
    module = openModules // {
      imports = [{ services.deepep.doctor.capabilities = [ "low-latency" ]; }];
      services.deepep = {
        enable = true;
        persistenced.enable = false;
        doctor.capabilities = [ "internode-cpu-ibgda" "intranode" "low-latency" ];
      };
    };
    expect = {
      doctorArgs = "${nvlinkCaps} ${cap "internode-cpu-ibgda"}";
      doctorAfter = [ "systemd-modules-load.service" ];
      failed = [ ];
    };
  }
  {
    name = "doctor-disabled";
    module = openModules // { services.deepep = { enable = true; doctor.enable = false; }; };
    expect = { doctorArgs = null; failed = [ ]; };
  }
  {
    name = "doctor-no-capabilities";
    module = openModules // { services.deepep = { enable = true; doctor.capabilities = [ ]; }; };
    expect.failed = [ "services.deepep.doctor.capabilities is empty" "services.deepep.doctor.enable = false" ];
  }
  {
    name = "conflicting-dwords";
    module = openModules // {
      services.deepep = {
        enable = true;
        ibgda.registryDwords = [ "PeerMappingOverride=0" ];
      };
    };
    expect.failed = [ "PeerMappingOverride = 0 and 1" ];
  }
  {
    name = "dwords-set-elsewhere";
    module = openModules // {
      boot.extraModprobeConfig = ''options nvidia NVreg_RegistryDwords="RmFoo=1;"'';
      services.deepep.enable = true;
    };
    expect.failed = [ "Move the entries" ];
  }
  {
    name = "dwords-set-in-kernel-params";
    module = openModules // {
      boot.kernelParams = [ ''nvidia.NVreg_RegistryDwords="RmFoo=1;"'' ];
      services.deepep.enable = true;
    };
    expect.failed = [ "Move the entries" ];
  }
  {
    # Neither a different parameter (NVreg_RegistryDwordsPerDevice) nor a comment nor another
    # module's option is a second NVreg_RegistryDwords.
    name = "dwords-lookalikes-accepted";
    module = openModules // {
      boot.extraModprobeConfig = ''
        # NVreg_RegistryDwords comes from services.deepep
        options nvidia NVreg_RegistryDwordsPerDevice="pci=0000:01:00.0;RmFoo=1"
        options nvidia_uvm NVreg_RegistryDwords=whatever
      '';
      services.deepep.enable = true;
    };
    expect = { modprobe = driverLine + "\n"; failed = [ ]; };
  }
  {
    name = "stream-mem-ops-contradiction-modprobe";
    module = openModules // {
      boot.extraModprobeConfig = "options nvidia NVreg_EnableStreamMemOPs=0\n";
      services.deepep.enable = true;
    };
    expect.failed = [ "NVreg_EnableStreamMemOPs is set to 0 in boot.extraModprobeConfig" "sets NVreg_EnableStreamMemOPs=1" ];
  }
  {
    name = "stream-mem-ops-contradiction-kernel-params";
    module = openModules // {
      boot.kernelParams = [ "nvidia.NVreg_EnableStreamMemOPs=0" ];
      services.deepep = { enable = true; ibgda.method = "both"; };
    };
    expect.failed = [ "NVreg_EnableStreamMemOPs is set to 0 in boot.kernelParams" "sets NVreg_EnableStreamMemOPs=1" ];
  }
  {
    # Without driver options (method "none"/"gdrcopy") the user's value stands.
    name = "stream-mem-ops-user-value-without-driver-method";
    module = openModules // {
      boot.kernelParams = [ "nvidia.NVreg_EnableStreamMemOPs=0" ];
      services.deepep = { enable = true; ibgda.method = "gdrcopy"; };
    };
    expect.failed = [ ];
  }
  {
    name = "modprobe-config-disabled";
    module = openModules // {
      boot.modprobeConfig.enable = false;
      services.deepep.enable = true;
    };
    expect.failed = [ "boot.modprobeConfig.enable = false" ];
  }
  {
    name = "granularity-too-small";
    module = openModules // {
      services.deepep = { enable = true; nvshmem.cumemGranularity = 1048576; };
    };
    expect.failed = [ "below 256 MiB" ];
  }
]
