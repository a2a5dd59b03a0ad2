//! NVIDIA driver checks: driver loaded and its version, GPUs and device nodes, NVLink peers,
//! and the driver options GPU-initiated IBGDA needs (`EnableStreamMemOPs`,
//! `PeerMappingOverride`), including "configured but not active yet" (reboot pending).

use super::elf::{self, native_ident, DynInfo, Resolution};
use super::facts::{DriverInfo, Gpu};
use super::host::{hp, Host, HostKind, ReadError, ToolOutput};
use super::modprobe::configured_nvidia_options;
use super::report::{caps, Capability, Check};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The modprobe line GPU-initiated IBGDA needs.
pub const MODPROBE_LINE: &str =
    r#"options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;""#;

/// Runs the driver checks; returns what later checks need to know.
pub fn check(host: &Host, kind: &HostKind, out: &mut Vec<Check>) -> DriverInfo {
    let mut info = DriverInfo::default();
    let version_file = hp("/proc/driver/nvidia/version");
    match host.read_text(&version_file) {
        Ok(text) => match parse_version_file(&text) {
            Some((version, open)) => {
                info.version = Some(version.clone());
                info.open_modules = open;
                let flavour = if open { "open kernel modules" } else { "proprietary kernel modules" };
                out.push(Check::ok(
                    "driver",
                    caps::ALL,
                    format!("NVIDIA driver {version} loaded ({flavour}; /proc/driver/nvidia/version)"),
                ));
            }
            None => out.push(Check::fail(
                "driver",
                caps::ALL,
                format!(
                    "/proc/driver/nvidia/version has no \"NVRM version\" line with a version number (first line: {:?})",
                    first_line(&text)
                ),
                "reinstall or reload the NVIDIA driver; the file is written by the nvidia kernel module",
            )),
        },
        Err(ReadError::Missing) if pci_gpus(host).is_empty() => {
            info.no_device = true;
            out.push(Check::fail(
                "driver",
                caps::ALL,
                "no NVIDIA GPU on this host: none on the PCI bus (/sys/bus/pci/devices) and no NVIDIA driver loaded \
                 (/proc/driver/nvidia/version does not exist); the checks that need a GPU are skipped",
                "run deepep-nix doctor on the GPU hosts that will run DeepEP (in a container, pass the GPUs through, e.g. --gpus all)",
            ))
        }
        Err(ReadError::Missing) => out.push(Check::fail(
            "driver",
            caps::ALL,
            format!(
                "NVIDIA driver not loaded (/proc/driver/nvidia/version does not exist){}",
                pci_note(host)
            ),
            kind.fix(
                "enable the driver: hardware.nvidia.datacenter.enable = true; (or services.xserver.videoDrivers = [ \"nvidia\" ];), set hardware.nvidia.open = true; and rebuild",
                "install the NVIDIA driver and load it: sudo modprobe nvidia",
            ),
        )),
        Err(e) => out.push(unreadable("driver", caps::ALL, &version_file, &e)),
    }
    if info.version.is_none() {
        // Every check stays in the report, as a skip saying why.
        let why = if info.no_device {
            "no NVIDIA GPU on this host"
        } else {
            "driver not loaded"
        };
        for (id, needed_by) in [
            ("gpus", caps::ALL),
            ("device-nodes", caps::ALL),
            ("cuda-library", caps::ALL),
            ("nvlink", caps::NVLINK),
        ] {
            out.push(Check::skip(id, needed_by, why));
        }
        return info;
    }

    info.gpus = read_gpus(host);
    let listing = info
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| format!("{i}: {} ({})", g.model, g.bus))
        .collect::<Vec<_>>()
        .join(", ");
    match info.gpus.len() {
        0 => out.push(Check::fail(
            "gpus",
            caps::ALL,
            format!("no GPU in /proc/driver/nvidia/gpus{}", pci_note(host)),
            "check `dmesg | grep -i nvrm` for GPUs the driver rejected (e.g. excluded or fallen off the bus)",
        )),
        1 => out.push(Check::fail(
            "gpus",
            caps::INTRANODE_AND_LL,
            format!("1 GPU ({listing}); intranode and low-latency runs need at least 2 GPUs on this host"),
            "use a host with 2, 4 or 8 NVLink-connected GPUs",
        )),
        n => out.push(Check::ok("gpus", caps::ALL, format!("{n} GPUs: {listing}"))),
    }

    check_device_nodes(host, &info, out);
    check_cuda_library(host, kind, &info, out);
    check_nvlink(host, kind, &info, out);
    info
}

/// NVIDIA GPUs on the PCI bus (`/sys/bus/pci/devices`): (address, bound driver).
pub fn pci_gpus(host: &Host) -> Vec<(String, Option<String>)> {
    let dir = hp("/sys/bus/pci/devices");
    host.list_dir(&dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|dev| {
            let read = |f: &str| host.read_text(&dir.join(dev).join(f)).unwrap_or_default();
            // Vendor NVIDIA; class VGA (0x0300) or 3D controller (0x0302).
            read("vendor").trim() == "0x10de" && {
                let class = read("class");
                class.starts_with("0x0300") || class.starts_with("0x0302")
            }
        })
        .map(|dev| {
            let driver = host.link_name(&dir.join(&dev).join("driver"));
            (dev, driver)
        })
        .collect()
}

/// "; /sys/bus/pci lists 2 NVIDIA GPUs (0000:18:00.0 bound to no driver, ...)" or "".
fn pci_note(host: &Host) -> String {
    let gpus = pci_gpus(host);
    if gpus.is_empty() {
        return String::new();
    }
    let list = gpus
        .iter()
        .map(|(bus, drv)| match drv {
            Some(d) => format!("{bus} bound to {d}"),
            None => format!("{bus} bound to no driver"),
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "; /sys/bus/pci/devices lists {} NVIDIA GPU(s): {list}",
        gpus.len()
    )
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").chars().take(80).collect()
}

/// A check for a file that exists but cannot be read.
pub fn unreadable(
    id: &str,
    needed: &[Capability],
    path: &Path,
    e: &ReadError,
) -> Check {
    Check::fail(
        id,
        needed,
        format!("{} {e}", path.display()),
        format!(
            "make {} a readable file (run doctor as a user that can read it, e.g. with sudo)",
            path.display()
        ),
    )
}

/// `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...`
/// -> ("580.159.04", true).
pub fn parse_version_file(text: &str) -> Option<(String, bool)> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    let version = line.split_whitespace().find(|t| {
        let parts: Vec<&str> = t.split('.').collect();
        parts.len() >= 2
            && parts
                .iter()
                .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    })?;
    Some((version.to_string(), line.contains("Open Kernel Module")))
}

fn read_gpus(host: &Host) -> Vec<Gpu> {
    let dir = hp("/proc/driver/nvidia/gpus");
    let mut gpus = Vec::new();
    for bus in host.list_dir(&dir).unwrap_or_default() {
        let text = host
            .read_text(&dir.join(&bus).join("information"))
            .unwrap_or_default();
        let field = |name: &str| {
            text.lines().find_map(|l| {
                l.split_once(':')
                    .filter(|(k, _)| k.trim() == name)
                    .map(|(_, v)| v.trim().to_string())
            })
        };
        gpus.push(Gpu {
            model: field("Model").unwrap_or_else(|| "unknown model".into()),
            minor: field("Device Minor").and_then(|m| m.parse().ok()),
            bus,
        });
    }
    gpus
}

/// `libcuda.so.1` on the loader path, and of the same version as the kernel module (after a
/// driver upgrade without reboot the two differ and CUDA fails with "driver/library version
/// mismatch").
fn check_cuda_library(host: &Host, kind: &HostKind, info: &DriverInfo, out: &mut Vec<Check>) {
    let pseudo = DynInfo::bare(native_ident());
    let id = "cuda-library";
    match elf::resolve(host, "libcuda.so.1", Path::new("/"), &pseudo) {
        Resolution::Missing { skipped } => out.push(Check::fail(
            id,
            caps::ALL,
            format!(
                "libcuda.so.1 is not on the loader path (LD_LIBRARY_PATH, /etc/ld.so.conf, system directories){}",
                if skipped.is_empty() { String::new() } else { format!("; skipped: {}", skipped.join("; ")) }
            ),
            kind.fix(
                "enable the driver through hardware.nvidia (it provides /run/opengl-driver/lib)",
                "install the driver's user-space libraries (libcuda.so.1 ships with the NVIDIA driver, e.g. libnvidia-compute-<version> on Ubuntu), or add their directory to LD_LIBRARY_PATH; in containers use the NVIDIA container toolkit (--gpus)",
            ),
        )),
        Resolution::Found(path) => {
            // libcuda.so.1 -> libcuda.so.<driver version>
            let target = std::fs::canonicalize(host.real(&path))
                .ok()
                .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()));
            let lib_version = target.as_deref().and_then(|t| t.strip_prefix("libcuda.so."))
                // A driver version (branch number first, e.g. 580.159.04), not e.g. `1.1`.
                .filter(|v| v.split('.').next().and_then(|b| b.parse::<u32>().ok()).is_some_and(|b| b >= 100));
            match (lib_version, info.version.as_deref()) {
                // CUDA forward compatibility (cuda-compat in .../compat/) differs on purpose.
                (Some(lv), Some(kv)) if lv != kv && path.to_string_lossy().contains("/compat") => out.push(Check::warn(
                    id,
                    caps::ALL,
                    format!("{} is the CUDA forward-compatibility driver {lv} on kernel module {kv}", path.display()),
                    "fine on data-center GPUs with a matching cuda-compat package; otherwise take the compat directory off LD_LIBRARY_PATH",
                )),
                (Some(lv), Some(kv)) if lv != kv => out.push(Check::fail(
                    id,
                    caps::ALL,
                    format!("{} is user-space driver {lv}, the loaded kernel module is {kv}: CUDA fails with a driver/library version mismatch", path.display()),
                    "reboot (or unload and reload the nvidia kernel modules) so the module matches the installed driver libraries",
                )),
                (Some(lv), _) => out.push(Check::ok(id, caps::ALL, format!("{} (driver {lv})", path.display()))),
                (None, _) => out.push(Check::ok(id, caps::ALL, format!("{}", path.display()))),
            }
        }
    }
}

fn check_device_nodes(host: &Host, info: &DriverInfo, out: &mut Vec<Check>) {
    let mut nodes = vec![
        PathBuf::from("/dev/nvidiactl"),
        PathBuf::from("/dev/nvidia-uvm"),
    ];
    nodes.extend(
        info.gpus
            .iter()
            .filter_map(|g| g.minor)
            .map(|m| PathBuf::from(format!("/dev/nvidia{m}"))),
    );
    let missing: Vec<String> = nodes
        .iter()
        .filter(|n| !host.exists(n))
        .map(|n| n.display().to_string())
        .collect();
    if missing.is_empty() {
        let names: Vec<String> = nodes.iter().map(|n| n.display().to_string()).collect();
        out.push(Check::ok(
            "device-nodes",
            caps::ALL,
            format!("present: {}", names.join(" ")),
        ));
    } else {
        out.push(Check::fail(
            "device-nodes",
            caps::ALL,
            format!("missing: {}", missing.join(" ")),
            "create them: sudo nvidia-modprobe -u -c=0 (nvidia-uvm is loaded on first CUDA use by root; in containers pass the devices through)",
        ));
    }
}

/// One GPU-to-GPU link from `nvidia-smi topo -m`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub a: usize,
    pub b: usize,
    /// Matrix entry: `NV18`, `SYS`, `PHB`, ...
    pub kind: String,
}

impl Link {
    pub fn nvlink(&self) -> bool {
        self.kind
            .strip_prefix("NV")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    }
}

/// Parses the GPU block of `nvidia-smi topo -m`: returns the number of GPUs and the links of
/// every GPU pair (a < b).
pub fn parse_topo(text: &str) -> Result<(usize, Vec<Link>), String> {
    let clean = strip_ansi(text);
    let mut lines = clean.lines();
    let header = lines
        .by_ref()
        .find(|l| l.split_whitespace().any(|t| t == "GPU0"))
        .ok_or("no header line with GPU0")?;
    // Device columns come first (GPUn, NICn); the rest are affinity columns.
    let columns: Vec<&str> = header
        .split_whitespace()
        .take_while(|t| is_dev(t, "GPU") || is_dev(t, "NIC") || is_dev(t, "mlx5_"))
        .collect();
    let gpu_cols: Vec<usize> = (0..columns.len())
        .filter(|&i| is_dev(columns[i], "GPU"))
        .collect();
    let mut rows: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for line in lines {
        let mut tokens = line.split_whitespace();
        let Some(name) = tokens.next() else { continue };
        if let Some(idx) = name
            .strip_prefix("GPU")
            .and_then(|n| n.parse::<usize>().ok())
        {
            let cells: Vec<String> = tokens.take(columns.len()).map(str::to_owned).collect();
            if cells.len() < columns.len() {
                return Err(format!(
                    "row {name} has {} cells, expected {}",
                    cells.len(),
                    columns.len()
                ));
            }
            rows.insert(idx, cells);
        }
    }
    let n = gpu_cols.len();
    if n == 0 || rows.len() != n {
        return Err(format!("{n} GPU columns but {} GPU rows", rows.len()));
    }
    let mut links = Vec::new();
    for a in 0..n {
        for b in (a + 1)..n {
            let row = rows.get(&a).ok_or(format!("no row GPU{a}"))?;
            links.push(Link {
                a,
                b,
                kind: row[gpu_cols[b]].clone(),
            });
        }
    }
    Ok((n, links))
}

fn is_dev(token: &str, prefix: &str) -> bool {
    token
        .strip_prefix(prefix)
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn check_nvlink(host: &Host, kind: &HostKind, info: &DriverInfo, out: &mut Vec<Check>) {
    if info.gpus.len() < 2 {
        out.push(Check::skip(
            "nvlink",
            caps::NVLINK,
            "fewer than 2 GPUs: no NVLink peers to check",
        ));
        return;
    }
    let fabric_fix = kind.fix(
        "run ranks only on GPUs joined by NVLink (CUDA_VISIBLE_DEVICES); on NVSwitch (HGX) boards run the fabric manager: services.deepep.fabricManager.enable = true;",
        "run ranks only on GPUs joined by NVLink (CUDA_VISIBLE_DEVICES); on NVSwitch (HGX) boards start the fabric manager: sudo systemctl enable --now nvidia-fabricmanager",
    );
    match host.tools().nvidia_smi_topo() {
        ToolOutput::Output(text) => match parse_topo(&text) {
            Ok((n, links)) => {
                let desc =
                    links.iter().map(|l| format!("GPU{}-GPU{} {}", l.a, l.b, l.kind)).collect::<Vec<_>>().join(", ");
                let not_nvlink: Vec<&Link> = links.iter().filter(|l| !l.nvlink()).collect();
                if n != info.gpus.len() {
                    out.push(Check::warn(
                        "nvlink",
                        caps::NVLINK,
                        format!("nvidia-smi topo -m shows {n} GPUs, the driver lists {}: {desc}", info.gpus.len()),
                        "check CUDA_VISIBLE_DEVICES and excluded GPUs (nvidia-smi -q)",
                    ));
                } else if not_nvlink.is_empty() {
                    out.push(Check::ok("nvlink", caps::NVLINK, format!("every GPU pair has NVLink (nvidia-smi topo -m): {desc}")));
                } else {
                    out.push(Check::fail(
                        "nvlink",
                        caps::NVLINK,
                        format!("GPU pairs without NVLink (nvidia-smi topo -m): {desc}"),
                        fabric_fix,
                    ));
                }
            }
            Err(e) => out.push(Check::warn(
                "nvlink",
                caps::NVLINK,
                format!("could not parse `nvidia-smi topo -m` output ({e}); NVLink not verified"),
                "run `nvidia-smi topo -m` and check that every GPU pair shows NV<n>",
            )),
        },
        ToolOutput::Unavailable(why) | ToolOutput::Failed(why) => out.push(Check::warn(
            "nvlink",
            caps::NVLINK,
            format!("NVLink not verified: {why}"),
            "run doctor on the host itself with nvidia-smi on PATH (it ships with the driver), or check `nvidia-smi topo -m` by hand",
        )),
    }
}

/// Parsed `/proc/driver/nvidia/params`: `Name: 123` and `Name: "text"` lines.
pub fn parse_params(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(k, _)| !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// Value of `key` in a RegistryDwords string (`"A=1;PeerMappingOverride=1;"`).
pub fn registry_dword(dwords: &str, key: &str) -> Option<String> {
    dwords
        .trim_matches('"')
        .split(';')
        .filter_map(|e| e.split_once('='))
        .find(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim().to_string())
}

/// Parses a decimal or 0x-hex dword.
fn dword(v: &str) -> Option<u64> {
    let v = v.trim();
    match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Checks the two driver options of GPU-initiated IBGDA.
pub fn check_params(host: &Host, kind: &HostKind, info: &DriverInfo, out: &mut Vec<Check>) {
    const IDS: [&str; 2] = ["params.stream-memops", "params.peer-mapping"];
    if info.version.is_none() {
        for id in IDS {
            out.push(Check::skip(id, caps::GPU_IBGDA, "driver not loaded"));
        }
        return;
    }
    let path = hp("/proc/driver/nvidia/params");
    let text = match host.read_text(&path) {
        Ok(t) => t,
        Err(e) => {
            for id in IDS {
                out.push(unreadable(id, caps::GPU_IBGDA, &path, &e));
            }
            return;
        }
    };
    let params = parse_params(&text);
    let conf = configured_nvidia_options(host);

    // EnableStreamMemOPs
    let configured = conf
        .params
        .get("NVreg_EnableStreamMemOPs")
        .map(|(v, src)| (dword(v) == Some(1), src.clone()));
    let running = params.get("EnableStreamMemOPs");
    out.push(match running.map(|v| (v, dword(v))) {
        Some((_, Some(1))) => on(
            kind,
            IDS[0],
            "EnableStreamMemOPs: 1 (/proc/driver/nvidia/params)".into(),
            configured,
        ),
        Some((raw, Some(_))) => option_off(
            kind,
            IDS[0],
            format!("EnableStreamMemOPs: {raw}"),
            configured,
        ),
        Some((raw, None)) => garbage(
            kind,
            IDS[0],
            format!("EnableStreamMemOPs has the value {raw:?}, not a number"),
        ),
        None => garbage(kind, IDS[0], missing_key("EnableStreamMemOPs", &params)),
    });

    // RegistryDwords: PeerMappingOverride=1
    let configured = conf.params.get("NVreg_RegistryDwords").map(|(v, src)| {
        (
            registry_dword(v, "PeerMappingOverride").and_then(|d| dword(&d)) == Some(1),
            src.clone(),
        )
    });
    out.push(match params.get("RegistryDwords") {
        Some(raw) if !(raw.starts_with('"') && raw.ends_with('"') && raw.len() >= 2) => garbage(
            kind,
            IDS[1],
            format!("RegistryDwords has the value {raw:?}, not a quoted string"),
        ),
        Some(raw) => match registry_dword(raw, "PeerMappingOverride") {
            Some(v) if dword(&v) == Some(1) => on(
                kind,
                IDS[1],
                format!("RegistryDwords: {raw} (/proc/driver/nvidia/params)"),
                configured,
            ),
            _ => option_off(
                kind,
                IDS[1],
                format!("RegistryDwords: {raw} has no PeerMappingOverride=1"),
                configured,
            ),
        },
        None => garbage(kind, IDS[1], missing_key("RegistryDwords", &params)),
    });
}

fn missing_key(key: &str, params: &BTreeMap<String, String>) -> String {
    if params.is_empty() {
        format!("/proc/driver/nvidia/params has no \"Name: value\" lines; cannot find {key}")
    } else {
        format!(
            "{key} is not listed in /proc/driver/nvidia/params ({} other entries)",
            params.len()
        )
    }
}

/// The params file does not look like the driver wrote it.
fn garbage(kind: &HostKind, id: &str, found: String) -> Check {
    Check::fail(
        id,
        caps::GPU_IBGDA,
        found,
        format!(
            "/proc/driver/nvidia/params is written by the nvidia module; if it is really this, the driver is too old or broken: update it, then set {}",
            enable_hint(kind)
        ),
    )
}

fn enable_hint(kind: &HostKind) -> String {
    kind.fix(
        "services.deepep.enable = true; (services.deepep.ibgda.method = \"driver\"; or \"both\")",
        format!("`{MODPROBE_LINE}` in /etc/modprobe.d/nvidia-ibgda.conf"),
    )
}

/// The running driver has the option on; warn when no configuration keeps it after a reboot.
fn on(kind: &HostKind, id: &str, found: String, configured: Option<(bool, String)>) -> Check {
    match configured {
        Some((true, src)) => Check::ok(id, caps::GPU_IBGDA, format!("{found}, set by {src}")),
        Some((false, src)) => Check::warn(
            id,
            caps::GPU_IBGDA,
            format!("{found}, but {src} sets the nvidia options without it: lost at the next boot"),
            format!("change the options in {src} to: {MODPROBE_LINE}"),
        ),
        None => Check::warn(
            id,
            caps::GPU_IBGDA,
            format!("{found}, but nothing in modprobe.d or the kernel command line sets it: lost at the next boot"),
            kind.fix(
                "set services.deepep.enable = true; so the option survives reboots",
                format!("persist it: add `{MODPROBE_LINE}` to /etc/modprobe.d/nvidia-ibgda.conf"),
            ),
        ),
    }
}

/// The running driver has the option off; say whether a reboot would fix it.
fn option_off(
    kind: &HostKind,
    id: &str,
    found: String,
    configured: Option<(bool, String)>,
) -> Check {
    match configured {
        Some((true, src)) => Check::fail(
            id,
            caps::GPU_IBGDA,
            format!("{found} in the running driver, but {src} sets it: reboot pending"),
            kind.fix(
                "reboot (the nvidia module reads its options only when it loads; services.deepep writes them to /etc/modprobe.d/nixos.conf, which both NixOS initrd flavours copy, so initrd-loaded drivers get them too)",
                "reboot, or reload the nvidia module: stop all GPU processes, then sudo modprobe -r nvidia_uvm nvidia_drm nvidia_modeset nvidia_peermem gdrdrv nvidia && sudo modprobe nvidia; if nvidia is loaded from the initramfs, run sudo update-initramfs -u (Debian/Ubuntu) or sudo dracut -f (RHEL) first",
            ),
        ),
        Some((false, src)) => Check::fail(
            id,
            caps::GPU_IBGDA,
            format!("{found}; {src} sets the nvidia options without it"),
            format!(
                "change the options in {src} to: {MODPROBE_LINE} (merge other RegistryDwords into the one quoted, ;-separated value: two RegistryDwords settings do not combine), then reboot"
            ),
        ),
        None => Check::fail(
            id,
            caps::GPU_IBGDA,
            format!("{found} (not configured in modprobe.d or the kernel command line)"),
            kind.fix(
                "set services.deepep.enable = true; (default services.deepep.ibgda.method = \"driver\";), then sudo nixos-rebuild boot and reboot",
                format!(
                    "add this line to /etc/modprobe.d/nvidia-ibgda.conf:\n  {MODPROBE_LINE}\nthen sudo update-initramfs -u (Debian/Ubuntu) or sudo dracut -f (RHEL), and reboot"
                ),
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_line_open_and_closed() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16)  Thu Oct 2 2025\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(parse_version_file(open), Some(("580.159.04".into(), true)));
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n";
        assert_eq!(
            parse_version_file(closed),
            Some(("535.104.05".into(), false))
        );
        assert_eq!(parse_version_file("garbage\n"), None);
    }

    #[test]
    fn topo_matrix_with_escape_codes_and_nics() {
        let text = "\u{1b}[4m\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\u{1b}[0m\n\
                    GPU0\t X \tNV18\tSYS\tPIX\t0-47\t0\t\tN/A\n\
                    GPU1\tNV18\t X \tNV4\tSYS\t0-47\t0\t\tN/A\n\
                    GPU2\tSYS\tNV4\t X \tSYS\t48-95\t1\t\tN/A\n\
                    NIC0\tPIX\tSYS\tSYS\t X \n\nLegend:\n  X    = Self\n";
        let (n, links) = parse_topo(text).unwrap();
        assert_eq!(n, 3);
        let kinds: Vec<(usize, usize, &str, bool)> = links
            .iter()
            .map(|l| (l.a, l.b, l.kind.as_str(), l.nvlink()))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (0, 1, "NV18", true),
                (0, 2, "SYS", false),
                (1, 2, "NV4", true)
            ]
        );
        assert!(parse_topo("No devices were found\n").is_err());
    }

    #[test]
    fn registry_dwords() {
        assert_eq!(
            registry_dword(
                "\"RMFoo=0x10;PeerMappingOverride=0x1;\"",
                "PeerMappingOverride"
            ),
            Some("0x1".into())
        );
        assert_eq!(dword("0x1"), Some(1));
        assert_eq!(registry_dword("\"\"", "PeerMappingOverride"), None);
    }
}
