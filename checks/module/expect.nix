# Compares one evaluated configuration with a case of cases.nix; used by lib-eval.nix and
# nixos-eval.nix so both check exactly the same things.
#   check case config { nvshmemDir; gdrdrvPackage; doctorPackage; nixosConf; }  ->  "ok" or throw
# nixosConf is the text of /etc/modprobe.d/nixos.conf (the file both initrd flavours copy).
# The module's own contribution is isolated where NixOS adds text of its own (nvidia.nix's
# softdep line, blacklists): modprobe lines are compared as the lines that carry what the module
# writes.
{ lib }:
c: config: { nvshmemDir, gdrdrvPackage, doctorPackage, nixosConf }:
let
  e = c.expect;
  enabled = config.services.deepep.enable;
  fail = field: want: got:
    throw "module case '${c.name}': ${field}: expected ${builtins.toJSON want}, got ${builtins.toJSON got}";
  same = field: want: got: if want == got then true else fail field want got;
  opt = field: got: if e ? ${field} then same field e.${field} got else true;

  # The lines that carry what the module writes (its nvidia line has NVreg_EnableStreamMemOPs=1).
  ours = text: lib.filter (l: (lib.hasPrefix "options nvidia " l && lib.hasInfix "NVreg_EnableStreamMemOPs=1" l) || lib.hasPrefix "options gdrdrv " l)
    (lib.splitString "\n" text);
  modprobeOpt = field: got:
    if !(e ? ${field}) then true
    else same field (ours e.${field}) (ours got);

  # nixos.conf has the module's lines (and NVreg_RegistryDwords on one line only).
  confLines = if nixosConf == null then [ ] else lib.splitString "\n" nixosConf;
  nixosConfOk =
    if !(e ? modprobe) then true
    else if nixosConf == null then (if ours e.modprobe == [ ] then true else fail "/etc/modprobe.d/nixos.conf" "the module's lines" null)
    else lib.all (l: lib.elem l confLines || fail "/etc/modprobe.d/nixos.conf line" l nixosConf) (ours e.modprobe)
      && (if lib.any (lib.hasInfix "NVreg_RegistryDwords") (ours e.modprobe)
    then
      same "`options nvidia` lines of nixos.conf with NVreg_RegistryDwords=" 1
        (lib.length (lib.filter (l: lib.hasPrefix "options nvidia " l && builtins.match ".*[[:space:]]\"?NVreg_RegistryDwords=.*" l != null) confLines))
    else true);

  # The boot-time check (deepep-doctor.service). Whatever the case, a unit that exists has the
  # fixed shape: started by multi-user.target, oneshot, remains active, exit 1 (not ready) is
  # success, bounded start time, the module's environment (NixOS adds PATH from `path`), nvidia-smi on its path,
  # and runs our package's deepep-nix. The case gives the arguments and the ordering.
  doctorUnit = config.systemd.services.deepep-doctor or null;
  doctorExe = "${doctorPackage}/bin/deepep-nix";
  doctorShapeOk = u: lib.all (x: x) [
    (same "deepep-doctor wantedBy" [ "multi-user.target" ] u.wantedBy)
    (same "deepep-doctor Type" "oneshot" u.serviceConfig.Type)
    (same "deepep-doctor RemainAfterExit" true u.serviceConfig.RemainAfterExit)
    (same "deepep-doctor SuccessExitStatus" "0 1" u.serviceConfig.SuccessExitStatus)
    (same "deepep-doctor TimeoutStartSec" "2min" u.serviceConfig.TimeoutStartSec)
    (same "deepep-doctor environment" config.services.deepep.environment (builtins.removeAttrs u.environment [ "PATH" ]))
    (same "deepep-doctor has the driver's bin output (nvidia-smi) on its path" true
      (lib.elem (lib.getBin config.hardware.nvidia.package) u.path))
  ];
  doctorOk =
    if !(e ? doctorArgs) then true
    else if e.doctorArgs == null then same "deepep-doctor unit" null doctorUnit
    else if doctorUnit == null then fail "deepep-doctor unit" "a unit" null
    else doctorShapeOk doctorUnit
      && same "deepep-doctor ExecStart" "${doctorExe} ${e.doctorArgs}" doctorUnit.serviceConfig.ExecStart
      && opt "doctorAfter" doctorUnit.after;

  failedMessages = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
  failedOk =
    if !(e ? failed) then true
    else if e.failed == [ ] then same "failed assertions" [ ] failedMessages
    else lib.all (s: lib.any (m: lib.hasInfix s m) failedMessages || fail "failed assertion containing" s failedMessages) e.failed;

  # Everything else is only meaningful for configurations that evaluate without failures.
  valuesOk = lib.all (x: x) [
    (modprobeOpt "modprobe" config.boot.extraModprobeConfig)
    nixosConfOk
    (opt "kernelModules" (lib.filter (m: lib.elem m [ "gdrdrv" "nvidia_peermem" ]) config.boot.kernelModules))
    (opt "gdrdrvPackage" (lib.elem gdrdrvPackage config.boot.extraModulePackages))
    (opt "env" (builtins.removeAttrs config.services.deepep.environment [ "NVSHMEM_DIR" ]))
    (same "NVSHMEM_DIR" (if enabled then nvshmemDir else null) (config.environment.variables.NVSHMEM_DIR or null))
    (if enabled && e ? env then
      same "environment.variables" (e.env // { NVSHMEM_DIR = nvshmemDir; })
        (lib.filterAttrs (n: _: lib.hasPrefix "NVSHMEM_" n) config.environment.variables) else true)
    (opt "udevGdrdrv" (lib.hasInfix ''KERNEL=="gdrdrv"'' config.services.udev.extraRules))
    (opt "persistenced" config.hardware.nvidia.nvidiaPersistenced)
    (if !(e ? persistencedUnit) then true
    else
      let u = config.systemd.services.nvidia-persistenced or null;
      in same "nvidia-persistenced.service exists" e.persistencedUnit (u != null)
        && (u == null || same "nvidia-persistenced.service ExecStart"
        "${lib.getBin config.hardware.nvidia.package.persistenced}/bin/nvidia-persistenced --verbose"
        u.serviceConfig.ExecStart))
    (opt "nvidiaModules" (lib.filter (n: lib.elem n [ "nvidia-open" "nvidia-kernel-modules" "nvidia-x11" "nvidia-dc" ]) (map lib.getName config.boot.extraModulePackages)))
    (opt "datacenter" config.hardware.nvidia.datacenter.enable)
    doctorOk
  ];
in
if failedOk && (e.failed or [ ] != [ ] || valuesOk) then "ok" else throw "module case '${c.name}': unreachable"
