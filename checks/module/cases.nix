# Configurations of services.deepep and what they must produce. Shared by
#   lib-eval.nix    nixpkgs' lib.evalModules with stub declarations of the NixOS options the
#                   module sets (needs only nixpkgs' lib)
#   nixos-eval.nix  real NixOS (nixos/lib/eval-config.nix; a flake check)
# `packages` are the package values the case sets explicitly (lib-eval passes stubs; NixOS uses
# the module's defaults when a case leaves them out).
#
# expect (every field optional):
#   modprobe        exact text the module adds to boot.extraModprobeConfig
#   initrdModprobe  exact text it adds to boot.initrd.extraModprobeConfig
#   kernelModules   boot.kernelModules (the module's contribution; the cases add none of their own)
#   gdrdrvPackage   whether the gdrdrv package is in boot.extraModulePackages
#   env             exact environment.variables the module sets
#   udevGdrdrv      whether the udev rules contain the gdrdrv rule
#   persistenced    hardware.nvidia.nvidiaPersistenced
#   datacenter      hardware.nvidia.datacenter.enable
#   doctorArgs      the arguments of deepep-doctor.service's ExecStart after the deepep-nix
#                   binary (null: the unit must not exist); a unit that exists is also checked
#                   for its fixed shape (see expect.nix)
#   doctorAfter     deepep-doctor.service's `after`
#   failed          substrings that must each appear in some failed assertion's message
#                   ([] = no assertion may fail)
#
# `nvidia` (default true) is how the driver is enabled: true = services.xserver.videoDrivers
# (also right on headless hosts), "datacenter" = through services.deepep.fabricManager (NixOS
# refuses both at once), false = not at all.
let
  nvidiaOn = { hardware.nvidia.open = true; };
  driverLine = ''options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"'';
  cap = c: "--capability ${c}";
  nvlinkCaps = "doctor ${cap "intranode"} ${cap "low-latency"}";
in
[
  {
    name = "default";
    module = nvidiaOn // { services.deepep.enable = true; };
    expect = {
      modprobe = driverLine + "\n";
      initrdModprobe = "";
      kernelModules = [ ];
      gdrdrvPackage = false;
      env = { NVSHMEM_QP_DEPTH = "1024"; NVSHMEM_MAX_TEAMS = "7"; };
      udevGdrdrv = false;
      persistenced = true;
      datacenter = false;
      doctorArgs = "${nvlinkCaps} ${cap "internode-ibgda"}";
      doctorAfter = [ "systemd-modules-load.service" "nvidia-persistenced.service" ];
      failed = [ ];
    };
  }
  {
    name = "both-merged-dwords-initrd";
    nvidia = "datacenter";
    module = {
      imports = [
        # Another module adding its own dword: merged, never a second line.
        { services.deepep.ibgda.registryDwords = [ "RmProfilingAdminOnly=0" ]; }
      ];
      hardware.nvidia.open = true;
      boot.initrd.kernelModules = [ "nvidia" ];
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
      initrdModprobe = ''
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
      datacenter = true;
      doctorArgs = "${nvlinkCaps} ${cap "internode-ibgda"} ${cap "internode-cpu-ibgda"}";
      doctorAfter = [ "systemd-modules-load.service" "nvidia-fabricmanager.service" ];
      failed = [ ];
    };
  }
  {
    name = "gdrcopy-only";
    module = nvidiaOn // {
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
    module = { services.deepep = { enable = true; ibgda.method = "none"; }; };
    expect = {
      modprobe = "";
      initrdModprobe = "";
      kernelModules = [ ];
      gdrdrvPackage = false;
      udevGdrdrv = false;
      doctorArgs = nvlinkCaps;
      failed = [ ];
    };
  }
  {
    name = "disabled";
    module = { services.deepep.ibgda.method = "both"; };
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
    # Capabilities from two modules, out of order and repeated: each once, in doctor's order;
    # the ordering follows persistenced (off here).
    name = "doctor-capabilities-merged";
    module = nvidiaOn // {
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
    module = nvidiaOn // { services.deepep = { enable = true; doctor.enable = false; }; };
    expect = { doctorArgs = null; failed = [ ]; };
  }
  {
    name = "doctor-no-capabilities";
    module = nvidiaOn // { services.deepep = { enable = true; doctor.capabilities = [ ]; }; };
    expect.failed = [ "services.deepep.doctor.capabilities is empty" "services.deepep.doctor.enable = false" ];
  }
  {
    name = "conflicting-dwords";
    module = nvidiaOn // {
      services.deepep = {
        enable = true;
        ibgda.registryDwords = [ "PeerMappingOverride=0" ];
      };
    };
    expect.failed = [ "PeerMappingOverride = 0 and 1" ];
  }
  {
    name = "dwords-set-elsewhere";
    module = nvidiaOn // {
      boot.extraModprobeConfig = ''options nvidia NVreg_RegistryDwords="RmFoo=1;"'';
      services.deepep.enable = true;
    };
    expect.failed = [ "Move the entries" ];
  }
  {
    name = "granularity-too-small";
    module = nvidiaOn // {
      services.deepep = { enable = true; nvshmem.cumemGranularity = 1048576; };
    };
    expect.failed = [ "below 256 MiB" ];
  }
  {
    name = "gdrcopy-needs-open-modules";
    module = {
      hardware.nvidia.open = false;
      services.deepep = { enable = true; ibgda.method = "gdrcopy"; };
    };
    expect.failed = [ "Set hardware.nvidia.open = true" "DMA-BUF" ];
  }
  {
    name = "no-nvidia-driver";
    nvidia = false;
    module = nvidiaOn // { services.deepep.enable = true; };
    expect.failed = [ "needs the nvidia driver" ];
  }
]
