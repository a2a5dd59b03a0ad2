//! Process limits and container plumbing that InfiniBand needs: `RLIMIT_MEMLOCK` (verbs
//! registrations pin pages against it unless the process has `CAP_IPC_LOCK`) and, inside a container, the device nodes the host must pass in
//! (`/dev/infiniband/uverbs*`, `/dev/gdrdrv`).
//!
//! Both checks are added only when their input exists: `memlock` when `/proc/self/limits` can be
//! read below the root (always on a real host: it is doctor's own limit, inherited from the shell
//! or unit that started it), `container.devices` when the root is a container (`/.dockerenv`,
//! `/run/.containerenv`, or `container=` in the environment).

use super::host::{hp, Host, HostKind};
use super::report::{caps, Check};

/// At or below this soft limit libibverbs itself warns at start-up that the limit "will severely
/// limit memory registrations" (rdma-core `libibverbs/init.c`, `check_memlock_limit`): a fail.
/// Any other finite limit is a warning.
pub const MEMLOCK_FAIL_AT_OR_BELOW: u64 = 32768;
/// `CAP_IPC_LOCK`: a process holding it may lock memory beyond `RLIMIT_MEMLOCK`.
const CAP_IPC_LOCK: u32 = 14;

/// Whether `CapEff` of `/proc/<pid>/status` text has `CAP_IPC_LOCK`.
pub fn has_ipc_lock(status: &str) -> Option<bool> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    let caps = u64::from_str_radix(hex, 16).ok()?;
    Some(caps & (1 << CAP_IPC_LOCK) != 0)
}

/// `Max locked memory` soft and hard limits from `/proc/<pid>/limits` text (`None` = unlimited).
pub fn parse_memlock(limits: &str) -> Option<(Option<u64>, Option<u64>)> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let rest = line["Max locked memory".len()..].split_whitespace();
    let mut vals = rest.take(2).map(|v| {
        if v == "unlimited" {
            Some(None)
        } else {
            v.parse::<u64>().ok().map(Some)
        }
    });
    Some((vals.next()??, vals.next()??))
}

fn human(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, size) in UNITS {
        if bytes >= size && bytes % size == 0 {
            return format!("{} {name}", bytes / size);
        }
    }
    format!("{bytes} bytes")
}

fn limit(v: Option<u64>) -> String {
    v.map_or("unlimited".into(), human)
}

/// Whether the root describes a container (what the markers of Docker, Podman and systemd say).
pub fn in_container(host: &Host) -> Option<String> {
    for marker in ["/.dockerenv", "/run/.containerenv"] {
        if host.exists(&hp(marker)) {
            return Some(marker.to_string());
        }
    }
    host.env("container")
        .filter(|v| !v.is_empty())
        .map(|v| format!("container={v} in the environment"))
}

/// `memlock` and `container.devices`.
pub fn check(host: &Host, kind: &HostKind, out: &mut Vec<Check>) {
    let container = in_container(host);
    memlock(host, kind, container.is_some(), out);
    if let Some(marker) = &container {
        devices(host, marker, out);
    }
}

fn memlock(host: &Host, kind: &HostKind, container: bool, out: &mut Vec<Check>) {
    let id = "memlock";
    let Ok(text) = host.read_text(&hp("/proc/self/limits")) else {
        return;
    };
    let Some((soft, hard)) = parse_memlock(&text) else {
        out.push(Check::skip(
            id,
            caps::INTERNODE,
            "/proc/self/limits has no readable \"Max locked memory\" line",
        ));
        return;
    };
    let found = format!(
        "locked-memory limit (ulimit -l): soft {}, hard {} (/proc/self/limits)",
        limit(soft),
        limit(hard)
    );
    let fix = if container {
        "start the container with --ulimit memlock=-1 (docker/podman run), or raise the runtime's default (e.g. dockerd --default-ulimit memlock=-1); in Kubernetes the node's container runtime sets it".to_string()
    } else {
        kind.fix(
            "security.pam.loginLimits = [ { domain = \"*\"; type = \"-\"; item = \"memlock\"; value = \"unlimited\"; } ]; for login shells, and serviceConfig.LimitMEMLOCK = \"infinity\"; for systemd services",
            "add `* - memlock unlimited` to /etc/security/limits.d/memlock.conf and log in again; for a systemd service set LimitMEMLOCK=infinity",
        )
    };
    let ipc_lock = host
        .read_text(&hp("/proc/self/status"))
        .ok()
        .and_then(|t| has_ipc_lock(&t))
        .unwrap_or(false);
    match soft {
        None => out.push(Check::ok(id, caps::INTERNODE, found)),
        Some(_) if ipc_lock => out.push(Check::ok(
            id,
            caps::INTERNODE,
            format!("{found}; does not apply: the process has CAP_IPC_LOCK (CapEff in /proc/self/status)"),
        )),
        Some(b) if b <= MEMLOCK_FAIL_AT_OR_BELOW => out.push(Check::fail(
            id,
            caps::INTERNODE,
            format!("{found}: InfiniBand memory registrations pin pages against this limit; libibverbs warns that a limit of {} or less \"will severely limit memory registrations\"", human(MEMLOCK_FAIL_AT_OR_BELOW)),
            fix,
        )),
        Some(_) => out.push(Check::warn(
            id,
            caps::INTERNODE,
            format!("{found}: InfiniBand memory registrations pin pages against this limit; container and MPI/NCCL setups for RDMA use unlimited"),
            fix,
        )),
    }
}

fn devices(host: &Host, marker: &str, out: &mut Vec<Check>) {
    let id = "container.devices";
    let ib_devices = host
        .list_dir(&hp("/sys/class/infiniband"))
        .unwrap_or_default();
    let uverbs = super::rdma::uverbs_nodes(host);
    let gdrdrv_loaded = host.is_dir(&hp("/sys/module/gdrdrv"));
    let gdrdrv_node = host.exists(&hp("/dev/gdrdrv"));
    let mut have = Vec::new();
    let mut missing = Vec::new();
    if uverbs.is_empty() {
        if !ib_devices.is_empty() {
            missing.push(format!(
                "/dev/infiniband/uverbs* (the host has {})",
                ib_devices.join(" ")
            ));
        }
    } else {
        have.push(format!("/dev/infiniband: {}", uverbs.join(" ")));
    }
    if gdrdrv_node {
        have.push("/dev/gdrdrv".to_string());
    } else if gdrdrv_loaded {
        missing.push("/dev/gdrdrv (the host kernel has gdrdrv loaded)".to_string());
    }
    let what = format!("in a container ({marker})");
    let fix = "pass the devices in: docker/podman run --device=/dev/infiniband --device=/dev/gdrdrv --ulimit memlock=-1 (GPU-initiated IBGDA maps the NIC's doorbells through DEVX and may need --privileged); Kubernetes: an RDMA device plugin or a privileged pod";
    if missing.is_empty() {
        let listing = if have.is_empty() {
            "no RDMA device or gdrdrv on the host side either".to_string()
        } else {
            have.join(", ")
        };
        out.push(Check::ok(id, caps::INTERNODE, format!("{what}: {listing}")));
    } else if uverbs.is_empty() && !ib_devices.is_empty() {
        out.push(Check::fail(
            id,
            caps::INTERNODE,
            format!("{what}, not passed in: {}", missing.join(", ")),
            fix,
        ));
    } else {
        // Only /dev/gdrdrv is missing: CPU-assisted IBGDA falls back to a slower path.
        out.push(Check::warn(
            id,
            caps::CPU_IBGDA,
            format!("{what}, not passed in: {}", missing.join(", ")),
            fix,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_line() {
        let text =
            "Limit                     Soft Limit           Hard Limit           Units     \n\
Max processes             unlimited            unlimited            processes \n\
Max locked memory         8388608              unlimited            bytes     \n";
        assert_eq!(parse_memlock(text), Some((Some(8 << 20), None)));
        assert_eq!(
            parse_memlock("Max locked memory unlimited unlimited bytes\n"),
            Some((None, None))
        );
        assert_eq!(
            parse_memlock("Max locked memory lots unlimited bytes\n"),
            None
        );
        assert_eq!(human(8 << 20), "8 MiB");
        assert_eq!(human(65536), "64 KiB");
        assert_eq!(human(1000), "1000 bytes");
        assert_eq!(has_ipc_lock("CapEff:\t00000000a80425fb\n"), Some(false));
        assert_eq!(has_ipc_lock("CapEff:\t000001ffffffffff\n"), Some(true));
        assert_eq!(has_ipc_lock("CapEff:\t0000000000004000\n"), Some(true));
        assert_eq!(has_ipc_lock("Name: x\n"), None);
    }
}
