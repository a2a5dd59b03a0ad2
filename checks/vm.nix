# NixOS VM test: a machine with services.deepep (method "both") boots, and the files the module
# is responsible for are there: the single nvidia options line in /etc/modprobe.d/nixos.conf,
# the gdrdrv module file of the running kernel, the udev rule and its script, the environment.
# There is no GPU in the VM, so nvidia/gdrdrv do not load; that is not what is tested here, but
# it makes the boot-time readiness check (deepep-doctor.service) report "not ready", which must
# leave the unit successful with the verdict in the journal.
{ pkgs, deepepModule }:
pkgs.testers.runNixOSTest {
  name = "deepep-module";

  nodes.machine = { ... }: {
    imports = [ deepepModule ];
    services.xserver.videoDrivers = [ "nvidia" ];
    hardware.nvidia.open = true;
    services.deepep = {
      enable = true;
      ibgda.method = "both";
      nvshmem.ibEnableIbgda = true;
    };
  };

  testScript = ''
    machine.wait_for_unit("multi-user.target")

    conf = machine.succeed("cat /etc/modprobe.d/nixos.conf")
    line = 'options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"'
    assert line in conf.splitlines(), f"missing {line!r} in nixos.conf:\n{conf}"
    assert conf.count("NVreg_RegistryDwords") == 1, conf

    machine.succeed("test -e /run/current-system/kernel-modules/lib/modules/$(uname -r)/extra/gdrdrv.ko*")
    machine.succeed("modinfo -F version gdrdrv | grep -x 2.6")

    rules = machine.succeed("cat /etc/udev/rules.d/99-local.rules")
    assert 'SUBSYSTEM=="module", KERNEL=="gdrdrv"' in rules, rules
    script = rules.split('KERNEL=="gdrdrv", RUN+="')[1].split('"')[0]
    machine.succeed(f"test -x {script}")
    machine.succeed(f"grep -q 'mknod -m 0660 /dev/gdrdrv' {script}")

    env = machine.succeed("bash -lc 'echo $NVSHMEM_IB_ENABLE_IBGDA $NVSHMEM_QP_DEPTH $NVSHMEM_DIR'").split()
    assert env[0] == "1" and env[1] == "1024" and env[2].startswith("/nix/store/"), env
    machine.succeed("test -e $(bash -lc 'echo $NVSHMEM_DIR')/lib/libnvshmem_host.so.3")

    machine.wait_for_unit("deepep-doctor.service")
    props = machine.succeed("systemctl show deepep-doctor.service -p ActiveState -p Result -p ExecMainStatus")
    for want in ["ActiveState=active", "Result=success", "ExecMainStatus=1"]:
        assert want in props.splitlines(), f"deepep-doctor.service: no {want}:\n{props}"
    unit = machine.succeed("systemctl cat deepep-doctor.service")
    assert "doctor --capability intranode --capability low-latency --capability internode-ibgda --capability internode-cpu-ibgda" in unit, unit
    log = machine.succeed("journalctl -b -u deepep-doctor.service --no-pager")
    assert "verdict:" in log and "NOT READY" in log and "blocked by driver" in log, log
  '';
}
