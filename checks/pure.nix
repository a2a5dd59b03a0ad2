# Pure evaluation tests: the module's rendering helpers (modules/lib.nix), the NVSHMEM release
# selection (pkgs/nvshmem/lib.nix), the generated release data (pkgs/nvshmem/releases.nix) and
# the DeepEP package rules and pairing data (checks/deep-ep-pure.nix) and the plan of the
# per-release GPU checks (checks/nvshmem-matrix-pure.nix).
# Builtins only, so Debian's Nix 2.8 runs them in CI:
#   nix-instantiate --eval --strict --json checks/pure.nix
# Evaluates to { passed = N; names = [ ... ]; } or throws listing every failing test with what
# was expected and what came out. Tests of error paths use builtins.tryEval (which sees that an
# evaluation failed, not the message); scripts/nix-checks.sh checks the texts of the most
# important messages.
let
  m = import ../modules/lib.nix;
  n = import ../pkgs/nvshmem/lib.nix;
  releases = import ../pkgs/nvshmem/releases.nix;
  license = import ../pkgs/nvshmem/license.nix;
  # Real `deepep-nix doctor --json` output (the project's GPU machine, all four capabilities).
  doctorReport = builtins.fromJSON (builtins.readFile ../generator/tests/data/hosts/gpu-machine.doctor.json);

  inherit (builtins) all any attrNames concatMap concatStringsSep elem filter length match tryEval;

  fails = e: !(tryEval (builtins.deepSeq e e)).success;

  # Every (version, system, cudaMajor, source, artifact) in the data.
  artifacts = concatMap
    (v: concatMap
      (sys: concatMap
        (cuda: map (src: { inherit v sys cuda src; a = releases.${v}.${sys}.${cuda}.${src}; })
          (attrNames releases.${v}.${sys}.${cuda}))
        (attrNames releases.${v}.${sys}))
      (filter (k: k != "releaseDate") (attrNames releases.${v})))
    (attrNames releases);

  badArtifacts = pred: map (x: "${x.v}/${x.sys}/cuda${x.cuda}/${x.src}") (filter (x: !(pred x)) artifacts);

  urlBase = url: let parts = builtins.split "/" url; in builtins.elemAt parts (length parts - 1);

  x86 = "x86_64-linux";
  sel = args: n.select ({ inherit releases; system = x86; } // args);

  tests = {
    # ---- modules/lib.nix: modprobe text
    driverLineIsNvidiasDocumentedLine = {
      expr = m.renderNvidiaOptions { enableStreamMemOps = true; registryDwords = m.ibgdaRegistryDwords; };
      expected = ''options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"'';
    };
    dwordsMergeIntoOneSortedDedupedValue = {
      expr = m.registryDwordsValue [ "RmB=2" "PeerMappingOverride=1" " RmA = 0 " "PeerMappingOverride=1" ];
      expected = "PeerMappingOverride=1;RmA=0;RmB=2;";
    };
    methodDriver = {
      expr = m.renderModprobeConfig { method = "driver"; registryDwords = m.ibgdaRegistryDwords; gdrdrvParams = { use_persistent_mapping = 1; }; };
      expected = ''
        options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"
      '';
    };
    methodGdrcopyWritesNoNvidiaLine = {
      expr = m.renderModprobeConfig { method = "gdrcopy"; registryDwords = m.ibgdaRegistryDwords; gdrdrvParams = { dbg_enabled = false; use_persistent_mapping = true; }; };
      expected = "options gdrdrv dbg_enabled=0 use_persistent_mapping=1\n";
    };
    methodBoth = {
      expr = m.renderModprobeConfig { method = "both"; registryDwords = [ "PeerMappingOverride=1" "RmX=1" ]; gdrdrvParams = { info_enabled = 1; }; };
      expected = ''
        options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;RmX=1;"
        options gdrdrv info_enabled=1
      '';
    };
    methodNoneWritesNothing = {
      expr = m.renderModprobeConfig { method = "none"; registryDwords = m.ibgdaRegistryDwords; gdrdrvParams = { info_enabled = 1; }; };
      expected = "";
    };
    emptyDwordsLeaveOutTheParameter = {
      expr = m.renderNvidiaOptions { enableStreamMemOps = true; registryDwords = [ ]; };
      expected = "options nvidia NVreg_EnableStreamMemOPs=1";
    };
    unknownMethodRefused = { expr = fails (m.methodFeatures "gpu"); expected = true; };
    dwordWithSemicolonRefused = { expr = fails (m.registryDwordsValue [ "A=1;B=2" ]); expected = true; };
    dwordWithQuoteRefused = { expr = fails (m.registryDwordsValue [ ''A="1"'' ]); expected = true; };
    dwordWithoutValueRefused = { expr = fails (m.registryDwordsValue [ "PeerMappingOverride" ]); expected = true; };
    conflictsFound = {
      expr = m.conflictingRegistryDwords [ "A=1" "B=2" "A=0" "B=2" ];
      expected = [{ key = "A"; values = [ "0" "1" ]; }];
    };
    noConflictForRepeatedEqualValues = { expr = m.conflictingRegistryDwords [ "A=1" "A=1" ]; expected = [ ]; };
    registryDwordsSettingsCounted = {
      expr = map (t: m.registryDwordsSettings { modprobe = t; }) [
        ""
        ''options nvidia NVreg_RegistryDwords="A=1;"''
        "options nvidia NVreg_RegistryDwords=\"A=1;\"\noptions nvidia NVreg_RegistryDwords=\"B=1;\"\n"
        # quoted as a whole word, as nvidia.nix writes its own options
        ''options nvidia "NVreg_RegistryDwords=A=1;"''
        # a line continued with '\'
        "options nvidia NVreg_EnableStreamMemOPs=1 \\\n  NVreg_RegistryDwords=A=1\n"
      ];
      expected = [ 0 1 2 1 1 ];
    };
    # Only the parameter NVreg_RegistryDwords of module nvidia in an `options` line counts.
    registryDwordsLookalikesNotCounted = {
      expr = map (t: m.registryDwordsSettings { modprobe = t; }) [
        ''options nvidia NVreg_RegistryDwordsPerDevice="pci=0000:01:00.0;RmFoo=1"''
        "# options nvidia NVreg_RegistryDwords=\"A=1;\""
        "   # NVreg_RegistryDwords is set by services.deepep"
        "options nvidia_uvm NVreg_RegistryDwords=A=1"
        "install nvidia /bin/true NVreg_RegistryDwords=A=1"
        "options nvidia-drm modeset=1"
      ];
      expected = [ 0 0 0 0 0 0 ];
    };
    registryDwordsInKernelParams = {
      expr = map (kp: m.registryDwordsSettings { kernelParams = kp; }) [
        [ ''nvidia.NVreg_RegistryDwords="A=1;"'' ]
        [ ''"nvidia.NVreg_RegistryDwords=A=1; B=2"'' ]
        [ "nvidia.NVreg_RegistryDwordsPerDevice=x" "nvidia_uvm.NVreg_RegistryDwords=x" "NVreg_RegistryDwords=x" ]
      ];
      expected = [ 1 1 0 ];
    };
    modprobeOptionsParsed = {
      expr = m.modprobeOptions "options nvidia-drm modeset=1 fbdev\noptions nvidia NVreg_RegistryDwords=\"A=1; B=2\" \"NVreg_X=3\"\nblacklist nouveau\n";
      expected = [
        { module = "nvidia_drm"; params = [{ name = "modeset"; value = "1"; } { name = "fbdev"; value = null; }]; }
        { module = "nvidia"; params = [{ name = "NVreg_RegistryDwords"; value = "A=1; B=2"; } { name = "NVreg_X"; value = "3"; }]; }
      ];
    };
    streamMemOpsContradictionsFound = {
      expr = m.streamMemOpsContradictions {
        modprobe = "options nvidia NVreg_EnableStreamMemOPs=1\noptions nvidia NVreg_EnableStreamMemOPs=0\noptions nvidia_uvm NVreg_EnableStreamMemOPs=0\n";
        kernelParams = [ "nvidia.NVreg_EnableStreamMemOPs=0" "nvidia.NVreg_EnableStreamMemOPs=1" "quiet" ];
      };
      expected = [
        { where = "boot.extraModprobeConfig"; value = "0"; }
        { where = "boot.kernelParams"; value = "0"; }
      ];
    };

    # ---- modules/lib.nix: udev and environment
    udevRule = {
      expr = m.gdrdrvUdevRule "/nix/store/x-gdrdrv-mknod";
      expected = ''ACTION=="add", SUBSYSTEM=="module", KERNEL=="gdrdrv", RUN+="/nix/store/x-gdrdrv-mknod"'';
    };
    nodeScriptUsesModeAndGroup = {
      expr =
        let s = m.gdrdrvNodeScript { group = "video"; mode = "0660"; };
        in map (re: match re s != null) [
          ".*mknod -m 0660 /dev/gdrdrv c \"\\$major\" 0.*"
          ".*chgrp video /dev/gdrdrv.*"
          ".*\\$2 == \"gdrdrv\".*/proc/devices.*"
        ];
      expected = [ true true true ];
    };
    nodeScriptRefusesBadMode = { expr = fails (m.gdrdrvNodeScript { group = "video"; mode = "rw-rw----"; }); expected = true; };
    envOnlySetKnobs = {
      expr = m.nvshmemEnv { disableP2P = false; ibEnableIbgda = true; qpDepth = 1024; maxTeams = null; ibSl = null; cumemGranularity = 536870912; ibgdaNumRcPerPe = null; };
      expected = { NVSHMEM_DISABLE_P2P = "0"; NVSHMEM_IB_ENABLE_IBGDA = "1"; NVSHMEM_QP_DEPTH = "1024"; NVSHMEM_CUMEM_GRANULARITY = "536870912"; };
    };
    envAllNullIsEmpty = { expr = m.nvshmemEnv { qpDepth = null; maxTeams = null; }; expected = { }; };
    envUnknownKnobRefused = { expr = fails (m.nvshmemEnv { qpdepth = 1; }); expected = true; };
    everyKnobIsAnNvshmemVariable = {
      expr = all (v: match "NVSHMEM_[A-Z0-9_]+" v != null) (map (k: m.knobVariables.${k}) (attrNames m.knobVariables));
      expected = true;
    };
    granularityFloorIs256MiB = { expr = m.minCumemGranularity; expected = 256 * 1024 * 1024; };

    # ---- modules/lib.nix: boot-time readiness check (deepep-nix doctor)
    doctorCapabilitiesAreDoctorsOwn = {
      expr = map (v: v.capability) doctorReport.verdicts;
      expected = m.doctorCapabilities;
    };
    doctorDefaultsFollowTheMethod = {
      expr = map m.doctorDefaultCapabilities [ "driver" "gdrcopy" "both" "none" ];
      expected = [
        [ "intranode" "low-latency" "internode-ibgda" ]
        [ "intranode" "low-latency" "internode-cpu-ibgda" ]
        [ "intranode" "low-latency" "internode-ibgda" "internode-cpu-ibgda" ]
        [ "intranode" "low-latency" ]
      ];
    };
    doctorCommandOnceEachInDoctorsOrder = {
      expr = m.doctorCommand "/nix/store/x-deepep-nix/bin/deepep-nix" [ "internode-cpu-ibgda" "low-latency" "intranode" "low-latency" ];
      expected = "/nix/store/x-deepep-nix/bin/deepep-nix doctor --capability intranode --capability low-latency --capability internode-cpu-ibgda";
    };
    doctorCommandOneCapability = {
      expr = m.doctorCommand "deepep-nix" [ "internode-ibgda" ];
      expected = "deepep-nix doctor --capability internode-ibgda";
    };
    doctorNoProblemWithValidCapabilities = { expr = map m.doctorCapabilitiesProblem [ m.doctorCapabilities [ "low-latency" ] ]; expected = [ null null ]; };
    doctorEmptyCapabilitiesRefused = {
      expr = [ (fails (m.doctorCommand "deepep-nix" [ ])) (match ".*is empty.*doctor.enable = false.*" (m.doctorCapabilitiesProblem [ ]) != null) ];
      expected = [ true true ];
    };
    doctorUnknownCapabilityRefused = {
      expr = [ (fails (m.doctorCommand "deepep-nix" [ "intranode" "nvlink" ])) (m.doctorCapabilitiesProblem [ "intranode" "nvlink" ]) ];
      expected = [ true ''services.deepep.doctor.capabilities: unknown "nvlink"; use some of: "intranode", "low-latency", "internode-ibgda", "internode-cpu-ibgda".'' ];
    };

    # ---- release data
    dataIsNotEmpty = { expr = length artifacts > 20; expected = true; };
    everyArtifactHasHttpsUrl = { expr = badArtifacts (x: match "https://[^ ]+" x.a.url != null); expected = [ ]; };
    everyArtifactHasSriSha256 = {
      expr = badArtifacts (x: match "sha256-[A-Za-z0-9+/]{43}=" x.a.hash != null);
      expected = [ ];
    };
    sizesAreIntsOrNull = { expr = badArtifacts (x: x.a.size == null || (builtins.isInt x.a.size && x.a.size > 0)); expected = [ ]; };
    nvidiaUrlsNameVersionCudaAndPlatform = {
      expr = badArtifacts (x: x.src != "nvidia" || (
        let plat = if x.sys == x86 then "linux-x86_64" else "linux-sbsa";
        in x.a.url == "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/${plat}/libnvshmem-${plat}-${x.v}_cuda${x.cuda}-archive.tar.xz"
      ));
      expected = [ ];
    };
    wheelsMatchTheirFileNames = {
      expr = badArtifacts (x: x.src != "pypi" || (
        urlBase x.a.url == x.a.filename
          && match "nvidia_nvshmem_cu${x.cuda}-${builtins.replaceStrings ["."] ["\\."] x.v}-py3-none-.*(${if x.sys == x86 then "x86_64" else "aarch64"})\\.whl" x.a.filename != null
      ));
      expected = [ ];
    };
    onlySourcesAndSystemsWeKnow = {
      expr = badArtifacts (x: elem x.src n.sources && elem x.sys n.systems && elem x.cuda n.cudaMajors);
      expected = [ ];
    };
    versionsStartAt339AndSortNumerically = {
      expr = let vs = n.versions releases; in [ (builtins.head vs) (builtins.compareVersions "3.3.9" "3.3.20") (elem "3.3.20" vs) ];
      expected = [ "3.3.9" (-1) true ];
    };
    noVersionBelowDeepEPsMinimum = { expr = filter (v: builtins.compareVersions v "3.3.9" < 0) (attrNames releases); expected = [ ]; };
    release339HasNoCuda13Anywhere = { expr = any (sys: releases."3.3.9".${sys} ? "13") n.systems; expected = false; };
    defaultIs345Cuda13FromNvidia = {
      expr = let s = sel { version = n.defaultVersion; cudaMajor = n.defaultCudaMajor; }; in [ s.version s.cudaMajor s.source s.artifact.hash ];
      expected = [ "3.4.5" "13" "nvidia" "sha256-GPEoB8I7xbJwWBrx+br9VANp2ng+VXFxVYiHYj13hCw=" ];
    };

    # ---- selection and attribute names
    select339Cuda13Refused = { expr = fails (sel { version = "3.3.9"; cudaMajor = "13"; }); expected = true; };
    select339DefaultsToCuda12 = { expr = (sel { version = "3.3.9"; }).cudaMajor; expected = "12"; };
    unknownVersionRefused = { expr = fails (sel { version = "3.2.5"; }); expected = true; };
    unknownCudaRefused = { expr = fails (sel { version = "3.4.5"; cudaMajor = "11"; }); expected = true; };
    unknownSourceRefused = { expr = fails (sel { version = "3.4.5"; source = "conda"; }); expected = true; };
    unknownSystemRefused = { expr = fails (n.select { inherit releases; version = "3.4.5"; system = "x86_64-darwin"; }); expected = true; };
    pypiOnlyReleaseRefusesNvidiaSource = {
      expr =
        let pypiOnly = filter (v: (releases.${v}.${x86}."13" or { }) ? pypi && !((releases.${v}.${x86}."13" or { }) ? nvidia)) (n.versions releases);
        in map (v: [ (fails (sel { version = v; cudaMajor = "13"; source = "nvidia"; })) (sel { version = v; cudaMajor = "13"; }).source ]) pypiOnly;
      expected = map (_: [ true "pypi" ]) (filter (v: (releases.${v}.${x86}."13" or { }) ? pypi && !((releases.${v}.${x86}."13" or { }) ? nvidia)) (n.versions releases));
    };
    pypiSourceSelectable = { expr = (sel { version = "3.4.5"; source = "pypi"; }).artifact ? filename; expected = true; };
    attrNamesForBothSystems = {
      expr = map
        (sys:
          let names = map (p: p.name) (n.attrPlan releases sys); in
          [ (elem "nvshmem" names) (elem "nvshmem_3_3_9" names) (elem "nvshmem_3_3_9_cuda12" names) (elem "nvshmem_3_3_9_cuda13" names) (elem "nvshmem_3_4_5_cuda13" names) ])
        n.systems;
      expected = [ [ true true true false true ] [ true true true false true ] ];
    };
    missingAttrsNameTheGap = {
      expr = map (sys: elem "nvshmem_3_3_9_cuda13" (map (p: p.name) (n.missingAttrPlan releases sys))) n.systems;
      expected = [ true true ];
    };
    everyPlannedAttrSelects = {
      expr = filter (p: fails (n.select { inherit releases; system = x86; inherit (p) version cudaMajor; })) (n.attrPlan releases x86);
      expected = [ ];
    };
    everyMissingAttrFails = {
      expr = filter (p: !(fails (n.select { inherit releases; system = x86; inherit (p) version cudaMajor; }))) (n.missingAttrPlan releases x86);
      expected = [ ];
    };
    attrVersion = { expr = n.attrVersion "3.3.20"; expected = "3_3_20"; };
    licenseIsUnfree = { expr = [ license.free license.shortName ]; expected = [ false "NVSHMEM SLA" ]; };
  }
  # DeepEP package rules and DeepEP x NVSHMEM pairing data (pkgs/deep-ep).
  // import ./deep-ep-pure.nix
  # The flake's per-release GPU checks (gpuChecks.<system>."nvshmem-matrix-<v>").
  // import ./nvshmem-matrix-pure.nix;

  results = map (name: { inherit name; t = tests.${name}; }) (attrNames tests);
  failed = filter (r: r.t.expr != r.t.expected) results;
in
if failed == [ ] then { passed = length results; names = map (r: r.name) results; }
else
  throw ("pure tests failed:\n" + concatStringsSep "\n" (map
    (r: "  ${r.name}: expected ${builtins.toJSON r.t.expected}, got ${builtins.toJSON r.t.expr}")
    failed))
