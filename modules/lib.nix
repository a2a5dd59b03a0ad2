# Pure helpers for the `services.deepep` NixOS module.
#
# Everything here is plain Nix: no nixpkgs, no `lib`, only builtins. That keeps
# the text the module writes into /etc/modprobe.d/nixos.conf, the udev rule and
# the environment set testable with any Nix (CI uses Debian's Nix 2.8; see
# checks/pure.nix).
let
  inherit (builtins)
    attrNames
    concatMap
    concatStringsSep
    elem
    filter
    foldl'
    head
    isBool
    isInt
    isString
    length
    lessThan
    listToAttrs
    match
    sort
    split
    ;

  # Remove later duplicates, keep first-seen order.
  unique = foldl' (acc: x: if elem x acc then acc else acc ++ [ x ]) [ ];

  # One line of the option set: `name = value` pairs joined by spaces.
  renderValue = v:
    if isBool v then (if v then "1" else "0")
    else if isInt v then toString v
    else if isString v then v
    else throw "deepep: module parameter values must be bool, int or string";

  # Module names: kmod and the kernel treat '-' and '_' alike ("nvidia-uvm" is "nvidia_uvm").
  normaliseModule = builtins.replaceStrings [ "-" ] [ "_" ];

  # The words of one modprobe.d line: runs of non-blanks, where a double-quoted part may hold
  # blanks (`NVreg_RegistryDwords="A=1; B=2"` is one word).
  modprobeWords = line:
    map head (filter builtins.isList (split "(([^[:space:]\"]|\"[^\"]*\")+)" line));

  # `name=value` (quotes anywhere in the word removed, as modprobe does) -> { name; value; };
  # a bare `name` has the value null.
  parseParam = word:
    let
      w = builtins.replaceStrings [ "\"" ] [ "" ] word;
      m = match "([^=]*)=(.*)" w;
    in
    if m == null then { name = w; value = null; } else { name = head m; value = builtins.elemAt m 1; };
in
rec {
  # ---------------------------------------------------------------- IBGDA methods

  # What each `services.deepep.ibgda.method` value turns on.
  #   driverOptions: NVreg_EnableStreamMemOPs=1 + NVreg_RegistryDwords (GPU-initiated NIC handler)
  #   gdrcopy:       build and load gdrdrv, create /dev/gdrdrv, install libgdrapi (CPU-assisted
  #                  NIC handler with the gdrcopy backend)
  ibgdaMethods = {
    driver = { driverOptions = true; gdrcopy = false; };
    gdrcopy = { driverOptions = false; gdrcopy = true; };
    both = { driverOptions = true; gdrcopy = true; };
    none = { driverOptions = false; gdrcopy = false; };
  };

  methodFeatures = method:
    ibgdaMethods.${method} or (throw ''
      services.deepep.ibgda.method = "${method}" is not known; use one of: ${concatStringsSep ", " (map (m: "\"${m}\"") (attrNames ibgdaMethods))}'');

  # The registry dword NVIDIA documents for GPU-initiated IBGDA.
  ibgdaRegistryDwords = [ "PeerMappingOverride=1" ];

  # ---------------------------------------------------------------- registry dwords

  # "Key=Value" -> { key, value }; anything else is refused with the fix.
  parseRegistryDword = d:
    let m = match "[[:space:]]*([A-Za-z0-9_]+)[[:space:]]*=[[:space:]]*([^;\"[:space:]]+)[[:space:]]*" d;
    in
    if m == null then
      throw ''
        services.deepep.ibgda.registryDwords: "${d}" is not of the form "Key=Value" (one dword per list
        element, without ';' or quotes), e.g. "PeerMappingOverride=1".''
    else { key = head m; value = builtins.elemAt m 1; };

  # Keys that are given more than one distinct value, e.g. both "RmFoo=1" and "RmFoo=0":
  # [ { key = "RmFoo"; values = [ "0" "1" ]; } ] (values sorted).
  conflictingRegistryDwords = dwords:
    let
      parsed = map parseRegistryDword dwords;
      keys = unique (map (p: p.key) parsed);
      valuesOf = k: sort lessThan (unique (map (p: p.value) (filter (p: p.key == k) parsed)));
    in
    map (k: { key = k; values = valuesOf k; }) (filter (k: length (valuesOf k) > 1) keys);

  # The one NVreg_RegistryDwords value: normalised entries, duplicates dropped, sorted (so the
  # text does not depend on the order in which modules contribute), joined by ';' with the
  # trailing ';' NVIDIA's documentation uses ("PeerMappingOverride=1;").
  registryDwordsValue = dwords:
    let entries = unique (map (d: let p = parseRegistryDword d; in "${p.key}=${p.value}") dwords);
    in concatStringsSep "" (map (e: e + ";") (sort lessThan entries));

  # ---------------------------------------------------------------- modprobe text

  # `options <module> k=v ...` for an attrset of parameters, or "" when there are none.
  # Parameters are rendered in attribute-name order.
  renderModprobeOptions = module: params:
    let names = attrNames params;
    in
    if names == [ ] then ""
    else "options ${module} ${concatStringsSep " " (map (n: "${n}=${renderValue params.${n}}") names)}";

  # The nvidia driver line. One line carries both parameters: a second `options nvidia` line with
  # NVreg_RegistryDwords would not merge with the first, so everything is rendered here at once.
  #   { enableStreamMemOps = true; registryDwords = [ "PeerMappingOverride=1" ]; }
  #   -> options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"
  renderNvidiaOptions = { enableStreamMemOps ? false, registryDwords ? [ ] }:
    let
      parts =
        (if enableStreamMemOps then [ "NVreg_EnableStreamMemOPs=1" ] else [ ])
        ++ (if registryDwords == [ ] then [ ] else [ "NVreg_RegistryDwords=\"${registryDwordsValue registryDwords}\"" ]);
    in
    if parts == [ ] then "" else "options nvidia ${concatStringsSep " " parts}";

  # All lines the module contributes to boot.extraModprobeConfig (NixOS writes it to
  # /etc/modprobe.d/nixos.conf, which both initrd flavours copy), newline-terminated; "" when
  # nothing applies.
  renderModprobeConfig = { method, registryDwords ? [ ], gdrdrvParams ? { } }:
    let
      features = methodFeatures method;
      lines = filter (l: l != "") [
        (if features.driverOptions then renderNvidiaOptions { enableStreamMemOps = true; inherit registryDwords; } else "")
        (if features.gdrcopy then renderModprobeOptions "gdrdrv" gdrdrvParams else "")
      ];
    in
    concatStringsSep "" (map (l: l + "\n") lines);

  # ---------------------------------------------------------------- reading modprobe.d text

  # The `options` commands of a modprobe.d text (modprobe.d(5)): one command per line, a line
  # ending in '\' continues on the next, lines whose first non-blank is '#' are comments.
  #   "options nvidia-drm modeset=1 fbdev"
  #   -> [ { module = "nvidia_drm"; params = [ { name = "modeset"; value = "1"; } { name = "fbdev"; value = null; } ]; } ]
  modprobeOptions = text:
    let
      joined = builtins.replaceStrings [ "\\\n" ] [ "" ] text;
      lines = filter builtins.isString (split "\n" joined);
      commands = filter (ws: ws != [ ] && match "#.*" (head ws) == null) (map modprobeWords lines);
      options = filter (ws: head ws == "options" && length ws >= 2) commands;
    in
    map
      (ws: {
        module = normaliseModule (builtins.elemAt ws 1);
        params = map parseParam (builtins.genList (i: builtins.elemAt ws (i + 2)) (length ws - 2));
      })
      options;

  # The values a modprobe.d text gives to parameter `param` of kernel module `module`, in order.
  modprobeParamValues = module: param: text:
    concatMap (o: map (p: p.value) (filter (p: p.name == param) o.params))
      (filter (o: o.module == normaliseModule module) (modprobeOptions text));

  # The same for kernel command-line parameters (`module.param=value`, the whole word or the
  # value possibly double-quoted).
  kernelParamValues = module: param: kernelParams:
    concatMap
      (kp:
        let m = match "([^.=]+)\\.([^=]+)=(.*)" (builtins.replaceStrings [ "\"" ] [ "" ] kp);
        in if m != null && normaliseModule (head m) == normaliseModule module && builtins.elemAt m 1 == param then [ (builtins.elemAt m 2) ] else [ ])
      kernelParams;

  # How many places set NVreg_RegistryDwords of the nvidia module (more than one is a conflict:
  # the driver keeps only one of them). Other parameters (NVreg_RegistryDwordsPerDevice),
  # other modules and comments do not count.
  registryDwordsSettings = { modprobe ? "", kernelParams ? [ ] }:
    length (modprobeParamValues "nvidia" "NVreg_RegistryDwords" modprobe)
    + length (kernelParamValues "nvidia" "NVreg_RegistryDwords" kernelParams);

  # NVreg_EnableStreamMemOPs values other than "1" (the value the driver methods write), each as
  # { where; value; }: a user's setting that contradicts the module.
  streamMemOpsContradictions = { modprobe ? "", kernelParams ? [ ] }:
    map (v: { where = "boot.extraModprobeConfig"; value = v; })
      (filter (v: v != "1") (modprobeParamValues "nvidia" "NVreg_EnableStreamMemOPs" modprobe))
    ++ map (v: { where = "boot.kernelParams"; value = v; })
      (filter (v: v != "1") (kernelParamValues "nvidia" "NVreg_EnableStreamMemOPs" kernelParams));

  # ---------------------------------------------------------------- /dev/gdrdrv

  # gdrdrv registers a character device with a dynamic major and creates no device node.
  # This script reads the major from /proc/devices and creates /dev/gdrdrv; it expects
  # awk, mknod, chgrp, chmod and rm on PATH (the module wraps it with a fixed PATH).
  gdrdrvNodeScript = { group, mode }:
    let
      validMode = match "0?[0-7]{3}" mode != null;
    in
    if !validMode then throw "services.deepep.gdrcopy.deviceMode = \"${mode}\" is not an octal mode; use e.g. \"0660\""
    else ''
      set -eu
      major=$(awk '$2 == "gdrdrv" { print $1 }' /proc/devices)
      if [ -z "$major" ]; then
        echo "gdrdrv: no 'gdrdrv' entry in /proc/devices; is the module loaded?" >&2
        exit 1
      fi
      rm -f /dev/gdrdrv
      mknod -m ${mode} /dev/gdrdrv c "$major" 0
      chgrp ${group} /dev/gdrdrv
      chmod ${mode} /dev/gdrdrv
    '';

  # The udev rule that runs the script above when the gdrdrv module appears.
  gdrdrvUdevRule = script:
    ''ACTION=="add", SUBSYSTEM=="module", KERNEL=="gdrdrv", RUN+="${script}"'';

  # ---------------------------------------------------------------- readiness check (doctor)

  # The values of `deepep-nix doctor --capability`, in the order doctor reports them.
  doctorCapabilities = [ "intranode" "low-latency" "internode-ibgda" "internode-cpu-ibgda" ];

  # What a host configured with `ibgda.method` is for: NVLink within the node always, plus the
  # internode path(s) the method prepares. The driver options ("driver", "both") are what
  # GPU-initiated IBGDA needs; gdrdrv ("gdrcopy", "both") is the backend of CPU-assisted IBGDA.
  # "none" prepares neither, so nothing internode is expected of the host (NVSHMEM >= 3.4.5 can
  # still run CPU-assisted IBGDA there; list "internode-cpu-ibgda" explicitly for that).
  doctorDefaultCapabilities = method:
    let features = methodFeatures method;
    in
    [ "intranode" "low-latency" ]
    ++ (if features.driverOptions then [ "internode-ibgda" ] else [ ])
    ++ (if features.gdrcopy then [ "internode-cpu-ibgda" ] else [ ]);

  # null when `capabilities` can be passed to doctor, else the message that says why not and
  # what to do. An empty list is refused: doctor would read it as "all four".
  doctorCapabilitiesProblem = capabilities:
    let unknown = filter (c: !(elem c doctorCapabilities)) capabilities;
    in
    if capabilities == [ ] then
      ''services.deepep.doctor.capabilities is empty (deepep-nix doctor would then require all four); list what this host is for, e.g. [ "intranode" "low-latency" ], or set services.deepep.doctor.enable = false.''
    else if unknown != [ ] then
      "services.deepep.doctor.capabilities: unknown ${concatStringsSep ", " (map (c: "\"${c}\"") unknown)}; use some of: ${concatStringsSep ", " (map (c: "\"${c}\"") doctorCapabilities)}."
    else null;

  # The doctor command line for `exe` (the deepep-nix binary): one `--capability` per
  # capability, each once, in doctorCapabilities order (so the unit does not change with the
  # order in which modules define the list). Every argument is a fixed word, so the line needs
  # no quoting for systemd's ExecStart.
  #   doctorCommand "/bin/deepep-nix" [ "low-latency" "intranode" ]
  #   -> "/bin/deepep-nix doctor --capability intranode --capability low-latency"
  doctorCommand = exe: capabilities:
    let problem = doctorCapabilitiesProblem capabilities;
    in
    if problem != null then throw problem
    else
      concatStringsSep " " ([ exe "doctor" ]
        ++ concatMap (c: [ "--capability" c ]) (filter (c: elem c capabilities) doctorCapabilities));

  # ---------------------------------------------------------------- environment

  # Smallest NVSHMEM_CUMEM_GRANULARITY the module accepts (256 MiB).
  minCumemGranularity = 268435456;

  # Option name -> NVSHMEM variable, in the order they are documented.
  knobVariables = {
    disableP2P = "NVSHMEM_DISABLE_P2P";
    ibEnableIbgda = "NVSHMEM_IB_ENABLE_IBGDA";
    ibgdaNumRcPerPe = "NVSHMEM_IBGDA_NUM_RC_PER_PE";
    qpDepth = "NVSHMEM_QP_DEPTH";
    maxTeams = "NVSHMEM_MAX_TEAMS";
    cumemGranularity = "NVSHMEM_CUMEM_GRANULARITY";
    ibSl = "NVSHMEM_IB_SL";
  };

  # { disableP2P = null; qpDepth = 1024; ... } -> { NVSHMEM_QP_DEPTH = "1024"; ... }
  # Knobs set to null are left out (NVSHMEM's own default applies). Booleans become "1"/"0".
  # Unknown knob names are refused.
  nvshmemEnv = knobs:
    let
      unknown = filter (n: !(knobVariables ? ${n})) (attrNames knobs);
      set = filter (n: knobs.${n} != null) (attrNames knobs);
    in
    if unknown != [ ] then throw "deepep: unknown NVSHMEM knob(s): ${concatStringsSep ", " unknown}"
    else listToAttrs (map (n: { name = knobVariables.${n}; value = renderValue knobs.${n}; }) set);
}
