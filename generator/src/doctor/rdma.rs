//! Internode prerequisites: InfiniBand/RoCE NICs, user-space verbs device nodes, GPU memory
//! registration (DMA-BUF or `nvidia_peermem`) and GDRCopy (`gdrdrv`, `/dev/gdrdrv`, `libgdrapi`).

use super::elf::{self, native_ident, DynInfo, Resolution};
use super::facts::{DriverInfo, NvshmemInfo, Port, RdmaInfo};
use super::host::{hp, FileKind, Host, HostKind};
use super::modprobe::module_configured;
use super::report::{caps, Check};
use std::path::{Path, PathBuf};

/// Creates `/dev/gdrdrv` with the major gdrdrv registered (it creates no node itself).
const MKNOD: &str =
    "sudo mknod -m 0660 /dev/gdrdrv c $(awk '$2==\"gdrdrv\" {print $1}' /proc/devices) 0";

/// The RDMA user-verbs device nodes (`/dev/infiniband/uverbs*`) the host (or container) has.
pub fn uverbs_nodes(host: &Host) -> Vec<String> {
    host.list_dir(&hp("/dev/infiniband"))
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.starts_with("uverbs"))
        .collect()
}

fn read_field(host: &Host, path: &Path) -> String {
    host.read_text(path)
        .map(|t| t.trim().to_string())
        .unwrap_or_else(|e| format!("unreadable ({e})"))
}

/// `/sys/class/infiniband/*/ports/*/{state,link_layer}` and `/dev/infiniband/uverbs*`.
pub fn check_nics(host: &Host, kind: &HostKind, out: &mut Vec<Check>) -> RdmaInfo {
    let class = hp("/sys/class/infiniband");
    let mut info = RdmaInfo::default();
    for dev in host.list_dir(&class).unwrap_or_default() {
        let dir = class.join(&dev);
        let driver = host.link_name(&dir.join("device/driver"));
        let mlx5 = driver
            .as_deref()
            .map_or(dev.starts_with("mlx5"), |d| d.starts_with("mlx5"));
        for port in host.list_dir(&dir.join("ports")).unwrap_or_default() {
            let pdir = dir.join("ports").join(&port);
            info.ports.push(Port {
                device: dev.clone(),
                state: read_field(host, &pdir.join("state")),
                link_layer: read_field(host, &pdir.join("link_layer")),
                port,
                mlx5,
            });
        }
    }
    let listing = info
        .ports
        .iter()
        .map(|p| {
            format!(
                "{} port {}: {}, {}{}",
                p.device,
                p.port,
                p.state,
                p.link_layer,
                if p.mlx5 { "" } else { " (not mlx5)" }
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let load_fix = kind.fix(
        "internode needs a ConnectX (mlx5) RDMA NIC: hardware.infiniband.enable = true; loads its drivers and rdma-core",
        "internode needs a ConnectX (mlx5) RDMA NIC: sudo modprobe mlx5_ib ib_uverbs and install rdma-core (apt-get install rdma-core ibverbs-providers)",
    );
    if info.ports.is_empty() {
        out.push(Check::fail(
            "infiniband",
            caps::INTERNODE,
            "no InfiniBand/RoCE device in /sys/class/infiniband",
            load_fix,
        ));
    } else if info.usable().next().is_none() {
        out.push(Check::fail(
            "infiniband",
            caps::INTERNODE,
            format!("no ACTIVE port on an mlx5 NIC: {listing}"),
            "check cabling and the subnet manager (ibstat; an InfiniBand fabric needs opensm running somewhere); IBGDA drives only mlx5 (ConnectX) NICs",
        ));
    } else {
        out.push(Check::ok("infiniband", caps::INTERNODE, listing));
    }

    if info.ports.is_empty() {
        out.push(Check::skip(
            "infiniband.uverbs",
            caps::INTERNODE,
            "no RDMA device",
        ));
    } else {
        let nodes = uverbs_nodes(host);
        if nodes.is_empty() {
            out.push(Check::fail(
                "infiniband.uverbs",
                caps::INTERNODE,
                "no /dev/infiniband/uverbs* device node: user-space verbs (and NVSHMEM) cannot open the NIC",
                "on a host: sudo modprobe ib_uverbs; in a container: pass the devices (--device=/dev/infiniband) or run privileged (IBGDA needs DEVX UAR access)",
            ));
        } else {
            out.push(Check::ok(
                "infiniband.uverbs",
                caps::INTERNODE,
                format!("/dev/infiniband: {}", nodes.join(" ")),
            ));
        }
    }
    info
}

/// Kernel release from `/proc/sys/kernel/osrelease` as (major, minor).
fn kernel_release(host: &Host) -> Option<(u32, u32, String)> {
    let text = host.read_text(&hp("/proc/sys/kernel/osrelease")).ok()?;
    let rel = text.trim().to_string();
    let mut it = rel.split(|c: char| !c.is_ascii_digit());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor, rel))
}

/// GPU memory registration with the NIC: DMA-BUF (open kernel modules, Linux >= 5.12) or the
/// `nvidia_peermem` peer-memory module.
pub fn check_memory_registration(
    host: &Host,
    kind: &HostKind,
    driver: &DriverInfo,
    out: &mut Vec<Check>,
) {
    const PEERMEM: [&str; 3] = [
        "/sys/kernel/mm/memory_peers/nv_mem/version",
        "/sys/kernel/mm/memory_peers/nvidia-peermem/version",
        "/sys/module/nvidia_peermem/version",
    ];
    let peermem = PEERMEM.iter().find(|p| host.exists(Path::new(p)));
    let kernel = kernel_release(host);
    let dmabuf_kernel = kernel.as_ref().is_some_and(|(a, b, _)| (*a, *b) >= (5, 12));
    let kernel_desc = kernel.as_ref().map_or(
        "unknown kernel (/proc/sys/kernel/osrelease unreadable)".to_string(),
        |k| format!("Linux {}", k.2),
    );
    let modules = if driver.open_modules {
        "open kernel modules"
    } else {
        "proprietary kernel modules"
    };
    if driver.version.is_none() {
        out.push(Check::skip(
            "memory-registration",
            caps::INTERNODE,
            "driver not loaded",
        ));
    } else if driver.open_modules && dmabuf_kernel {
        out.push(Check::ok(
            "memory-registration",
            caps::INTERNODE,
            format!(
                "DMA-BUF available ({modules}, {kernel_desc}){}",
                peermem
                    .map(|p| format!("; nvidia_peermem also present ({p})"))
                    .unwrap_or_default()
            ),
        ));
    } else if let Some(p) = peermem {
        out.push(Check::ok(
            "memory-registration",
            caps::INTERNODE,
            format!("nvidia_peermem loaded ({p}); no DMA-BUF ({modules}, {kernel_desc})"),
        ));
    } else {
        out.push(Check::fail(
            "memory-registration",
            caps::INTERNODE,
            format!("neither DMA-BUF ({modules}, {kernel_desc}; needs open modules and Linux >= 5.12) nor nvidia_peermem: NVSHMEM skips the IB transports"),
            kind.fix(
                "hardware.nvidia.open = true; (DMA-BUF); services.deepep.peermem.enable = true; only on kernels with MLNX_OFED's peer-memory API",
                "switch to the open GPU kernel modules (DMA-BUF, Linux >= 5.12), or with MLNX_OFED: sudo modprobe nvidia_peermem",
            ),
        ));
    }
}

/// GDRCopy: `gdrdrv` module, `/dev/gdrdrv` (character device with the module's major, openable
/// read-write by this user) and `libgdrapi.so.2`. Optional for CPU-assisted IBGDA (NVSHMEM falls
/// back to a slower path), so missing entirely is a warning, but a host configured for it with a
/// piece missing fails: that fallback is exactly the silent slowdown users do not notice.
pub fn check_gdrcopy(host: &Host, kind: &HostKind, nvshmem: &NvshmemInfo, out: &mut Vec<Check>) {
    let loaded = host.is_dir(&hp("/sys/module/gdrdrv"));
    let intent = module_configured(host, "gdrdrv");
    // NVSHMEM dlopens libgdrapi.so.2 from the host library, so its RUNPATH counts ($ORIGIN
    // included); without a host library, search like a program without RUNPATH.
    let (from, origin) = match (&nvshmem.host_dyn, &nvshmem.lib_dir) {
        (Some(d), Some(dir)) => (d.clone(), dir.clone()),
        _ => (DynInfo::bare(native_ident()), PathBuf::from("/")),
    };
    let lib = elf::resolve(host, "libgdrapi.so.2", &origin, &from);

    let mut problems: Vec<(String, String)> = Vec::new(); // (what, fix)
    let nixos_fix =
        "services.deepep.ibgda.method = \"gdrcopy\"; (or \"both\") builds, loads and creates it";
    let mut found = Vec::new();
    if loaded {
        found.push("gdrdrv loaded".to_string());
        match devnode(host) {
            Ok(desc) => found.push(desc),
            Err((what, fix)) => problems.push((what, fix)),
        }
    } else {
        problems.push((
            "gdrdrv module not loaded (/sys/module/gdrdrv missing)".into(),
            kind.fix(
                nixos_fix,
                "sudo modprobe gdrdrv (install GDRCopy's gdrdrv module first)",
            ),
        ));
        if !host.exists(&hp("/dev/gdrdrv")) {
            problems.push((
                "/dev/gdrdrv missing".into(),
                kind.fix(nixos_fix, format!("after loading the module: {MKNOD}")),
            ));
        }
    }
    match &lib {
        Resolution::Found(p) => found.push(format!("libgdrapi.so.2 at {}", p.display())),
        Resolution::Missing { .. } => problems.push((
            "libgdrapi.so.2 not found (NVSHMEM's RUNPATH, the loader path)".into(),
            kind.fix(
                nixos_fix,
                "install GDRCopy's library (libgdrapi.so.2) and add its directory to LD_LIBRARY_PATH",
            ),
        )),
    }
    if problems.is_empty() {
        out.push(Check::ok("gdrcopy", caps::CPU_IBGDA, found.join(", ")));
        return;
    }
    let what = problems
        .iter()
        .map(|(w, _)| w.as_str())
        .collect::<Vec<_>>()
        .join("; ");
    let mut fixes: Vec<&str> = Vec::new();
    for (_, f) in &problems {
        if !fixes.contains(&f.as_str()) {
            fixes.push(f);
        }
    }
    let fix = fixes.join("\n");
    let partial = loaded || matches!(lib, Resolution::Found(_)) || host.exists(&hp("/dev/gdrdrv"));
    match (&intent, partial) {
        (Some(src), _) => out.push(Check::fail(
            "gdrcopy",
            caps::CPU_IBGDA,
            format!("{what}; {src} configures gdrdrv, so NVSHMEM would silently fall back to its slower CPU path"),
            fix,
        )),
        (None, true) => out.push(Check::fail(
            "gdrcopy",
            caps::CPU_IBGDA,
            format!("GDRCopy half installed: {what}"),
            fix,
        )),
        (None, false) => out.push(Check::warn(
            "gdrcopy",
            caps::CPU_IBGDA,
            format!("GDRCopy not set up ({what}); CPU-assisted IBGDA works without it, a little slower"),
            fix,
        )),
    }
}

/// `/dev/gdrdrv` must be a character device with gdrdrv's major (from `/proc/devices`) that this
/// user can open read-write. Ok: a description; Err: (problem, fix).
fn devnode(host: &Host) -> Result<String, (String, String)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let path = hp("/dev/gdrdrv");
    let real = host.real(&path);
    let meta = match std::fs::metadata(&real) {
        Ok(m) => m,
        Err(_) => {
            return Err((
                "/dev/gdrdrv missing (gdrdrv creates no device node itself)".into(),
                MKNOD.into(),
            ))
        }
    };
    if !meta.file_type().is_char_device() {
        let kind = host.kind(&path).unwrap_or(FileKind::Other);
        return Err((
            format!("/dev/gdrdrv is {}, not a character device", kind.describe()),
            format!("sudo rm -rf /dev/gdrdrv && {MKNOD}"),
        ));
    }
    let (major, minor) = dev_numbers(meta.rdev());
    let expected = host.read_text(&hp("/proc/devices")).ok().and_then(|t| {
        t.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            let num = w.next()?.parse::<u32>().ok()?;
            (w.next()? == "gdrdrv").then_some(num)
        })
    });
    match expected {
        Some(m) if m != major => {
            return Err((
                format!("/dev/gdrdrv has major {major} but the loaded gdrdrv registered major {m} (/proc/devices): stale node from an earlier boot"),
                format!("sudo rm /dev/gdrdrv && {MKNOD}"),
            ))
        }
        None => {
            return Err((
                "gdrdrv is not listed in /proc/devices".into(),
                "reload the module: sudo modprobe -r gdrdrv && sudo modprobe gdrdrv".into(),
            ))
        }
        Some(_) => {}
    }
    match std::fs::OpenOptions::new().read(true).write(true).open(&real) {
        Ok(_) => Ok(format!("/dev/gdrdrv (char {major}:{minor}) opens read-write")),
        Err(e) => Err((
            format!("/dev/gdrdrv cannot be opened read-write by this user: {e} (mode {:o}, gid {})", meta.mode() & 0o7777, meta.gid()),
            "add the user to the device's group, or give the node a group your users are in (mode 0660)".into(),
        )),
    }
}

/// Major and minor of a Linux `dev_t` (glibc's encoding).
fn dev_numbers(dev: u64) -> (u32, u32) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}
