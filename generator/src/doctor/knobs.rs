//! NVSHMEM runtime knobs from the environment, parsed the way NVSHMEM parses them (sizes with a
//! K/M/G/T suffix, booleans false only when they start with 0/N/n/F/f) and validated against
//! what DeepEP-style kernels need.

use super::host::Host;
use super::facts::{RdmaInfo, Version};
use super::report::{caps, Capability, Check};

/// DeepEP's floor for `NVSHMEM_CUMEM_GRANULARITY` (it sets 512 MiB).
pub const MIN_GRANULARITY: u64 = 256 << 20;
/// NVSHMEM's default `NVSHMEM_QP_DEPTH`.
pub const DEFAULT_QP_DEPTH: i64 = 1024;

/// What the knob checks need besides the environment.
pub struct Context<'a> {
    /// `--max-tokens`: low-latency tokens per rank the user plans.
    pub max_tokens: Option<u32>,
    pub nvshmem_version: Option<Version>,
    pub rdma: &'a RdmaInfo,
    /// `NVSHMEM_*` variables the installed NVSHMEM does not mention (see `nvshmem.rs`).
    pub unknown: &'a [String],
}

/// Every variable this module validates (also the candidates for "did you mean").
const VALIDATED: &[&str] = &[
    "NVSHMEM_BOOTSTRAP",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
    "NVSHMEM_CUDA_PATH",
    "NVSHMEM_CUMEM_GRANULARITY",
    "NVSHMEM_DEBUG",
    "NVSHMEM_DISABLE_NVLS",
    "NVSHMEM_DISABLE_P2P",
    "NVSHMEM_HCA_LIST",
    "NVSHMEM_HCA_PREFIX",
    "NVSHMEM_IBGDA_NIC_HANDLER",
    "NVSHMEM_IBGDA_NUM_RC_PER_PE",
    "NVSHMEM_IB_ENABLE_IBGDA",
    "NVSHMEM_IB_GID_INDEX",
    "NVSHMEM_IB_SL",
    "NVSHMEM_IB_TRAFFIC_CLASS",
    "NVSHMEM_MAX_TEAMS",
    "NVSHMEM_QP_DEPTH",
    "NVSHMEM_REMOTE_TRANSPORT",
    "NVSHMEM_SYMMETRIC_SIZE",
];

/// Levenshtein distance (names are short).
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push(
                (prev[j] + usize::from(ca != *cb))
                    .min(prev[j + 1] + 1)
                    .min(cur[j] + 1),
            );
        }
        prev = cur;
    }
    prev[b.len()]
}

fn unknown_variable(name: &str, version: Option<Version>) -> Check {
    let nvshmem = version.map_or("this NVSHMEM".to_string(), |v| format!("NVSHMEM {v}"));
    let guess = VALIDATED
        .iter()
        .map(|k| (distance(name, k), *k))
        .filter(|(d, _)| *d <= 3)
        .min();
    Check::warn(
        id(name),
        caps::NVSHMEM,
        format!("not read by {nvshmem}: neither libnvshmem_host.so.3 nor its plugins mention it"),
        match guess {
            Some((_, k)) => format!("did you mean {k}? Rename it, or unset {name}"),
            None => {
                format!("check the spelling against the NVSHMEM documentation, or unset {name}")
            }
        },
    )
}

/// NVSHMEM's size syntax: a number with an optional K/M/G/T suffix (powers of 1024); characters
/// after the suffix are ignored, as NVSHMEM does. Negative or missing numbers are invalid.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim_start();
    let num_len = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, rest) = t.split_at(num_len);
    let value: f64 = num.parse().ok()?;
    let shift = match rest.chars().next() {
        None => 0,
        Some('k' | 'K') => 10,
        Some('m' | 'M') => 20,
        Some('g' | 'G') => 30,
        Some('t' | 'T') => 40,
        Some(_) => return None,
    };
    Some((value * (1u64 << shift) as f64).ceil() as u64)
}

/// NVSHMEM's boolean rule: set and starting with 0, N, n, F or f is false; any other value
/// (even empty) is true.
pub fn parse_bool(s: &str) -> bool {
    !matches!(s.chars().next(), Some('0' | 'N' | 'n' | 'F' | 'f'))
}

/// A whole-string integer (decimal or 0x hex).
pub fn parse_int(s: &str) -> Option<i64> {
    let t = s.trim();
    let (neg, body) = match t.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let v = match body.strip_prefix("0x").or_else(|| body.strip_prefix("0X")) {
        Some(h) => i64::from_str_radix(h, 16).ok()?,
        None if !body.is_empty() && body.bytes().all(|b| b.is_ascii_digit()) => {
            body.parse().ok()?
        }
        None => return None,
    };
    Some(if neg { -v } else { v })
}

fn mib(bytes: u64) -> String {
    if bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} B")
    }
}

/// Checks every known knob that is set, plus the QP depth and RoCE GID index when they matter.
pub fn check(host: &Host, ctx: &Context, out: &mut Vec<Check>) {
    let env = host.env_map();
    for (name, value) in env.range("NVSHMEM_".to_string()..) {
        if !name.starts_with("NVSHMEM_") {
            break;
        }
        if let Some(c) = check_one(host, ctx, name, value) {
            out.push(c);
        } else if ctx.unknown.contains(name) {
            out.push(unknown_variable(name, ctx.nvshmem_version));
        }
    }
    if !env.contains_key("NVSHMEM_QP_DEPTH") {
        out.push(qp_depth(
            ctx,
            DEFAULT_QP_DEPTH,
            "unset, NVSHMEM default 1024",
        ));
    }
    let roce =
        ctx.rdma.usable().next().is_some() && ctx.rdma.usable().all(|p| p.link_layer == "Ethernet");
    if roce && !env.contains_key("NVSHMEM_IB_GID_INDEX") {
        out.push(Check::warn(
            "knob.NVSHMEM_IB_GID_INDEX",
            caps::INTERNODE,
            "unset, and the active RDMA ports are RoCE (link layer Ethernet): NVSHMEM uses GID index 0",
            "export NVSHMEM_IB_GID_INDEX=<RoCE v2 GID index of the port> (list them with show_gids)",
        ));
    }
}

fn id(name: &str) -> String {
    format!("knob.{name}")
}

fn qp_depth(ctx: &Context, depth: i64, source: &str) -> Check {
    let id = id("NVSHMEM_QP_DEPTH");
    match ctx.max_tokens {
        None => Check::skip(
            id,
            caps::NVSHMEM,
            format!("{depth} ({source}); pass --max-tokens N to check it against your low-latency token count"),
        ),
        Some(n) => {
            let need = 2 * (i64::from(n) + 1);
            if depth >= need {
                Check::ok(id, caps::NVSHMEM, format!("{depth} ({source}) >= 2*(max tokens {n} + 1) = {need}"))
            } else {
                Check::fail(
                    id,
                    caps::NVSHMEM,
                    format!("{depth} ({source}) < 2*(max tokens {n} + 1) = {need}: low-latency calls run out of work requests"),
                    format!("export NVSHMEM_QP_DEPTH={}", (need as u64).next_power_of_two()),
                )
            }
        }
    }
}

fn invalid(name: &str, value: &str, needed: &[Capability], expected: &str) -> Check {
    Check::fail(
        id(name),
        needed,
        format!("{value:?} is not {expected}"),
        format!("export {name}=<{expected}>, or unset it to use the default"),
    )
}

fn check_one(host: &Host, ctx: &Context, name: &str, value: &str) -> Option<Check> {
    let ok = |needed: &[Capability], found: String| Some(Check::ok(id(name), needed, found));
    let fail = |needed: &[Capability], found: String, fix: String| {
        Some(Check::fail(id(name), needed, found, fix))
    };
    let invalid_value =
        |needed: &[Capability], expected: &str| Some(invalid(name, value, needed, expected));
    match name {
        "NVSHMEM_CUMEM_GRANULARITY" => match parse_size(value) {
            None => invalid_value(caps::NVSHMEM, "a size such as 536870912 or 512M"),
            Some(b) if b < MIN_GRANULARITY => fail(
                caps::NVSHMEM,
                format!("{value} = {} < 256 MiB", mib(b)),
                format!("export {name}=536870912 (512 MiB, DeepEP's value; at least 256 MiB)"),
            ),
            Some(b) => ok(caps::NVSHMEM, format!("{value} = {} >= 256 MiB", mib(b))),
        },
        "NVSHMEM_SYMMETRIC_SIZE" => match parse_size(value) {
            None | Some(0) => invalid_value(caps::NVSHMEM, "a non-zero size such as 4G"),
            Some(b) => ok(caps::NVSHMEM, format!("{value} = {b} bytes")),
        },
        "NVSHMEM_QP_DEPTH" => match parse_int(value) {
            Some(d) if d > 0 => Some(qp_depth(ctx, d, "exported")),
            _ => invalid_value(caps::NVSHMEM, "a positive integer such as 1024"),
        },
        "NVSHMEM_MAX_TEAMS" => match parse_int(value) {
            Some(t) if t >= 1 => {
                if t <= 7 && ctx.nvshmem_version.is_some_and(|v| v >= Version(3, 7, 0)) {
                    Some(Check::warn(
                        id(name),
                        caps::NVSHMEM,
                        format!("{t} with NVSHMEM >= 3.7: team creation can fail with \"No more teams available (max = {t})\""),
                        format!("export {name}=8 or more, or use NVSHMEM 3.4.5"),
                    ))
                } else {
                    ok(caps::NVSHMEM, format!("{t}"))
                }
            }
            _ => invalid_value(caps::NVSHMEM, "a positive integer such as 7"),
        },
        "NVSHMEM_DISABLE_P2P" => {
            if parse_bool(value) {
                fail(
                    caps::LOW_LATENCY,
                    format!("{value:?} = true: NVSHMEM will not use NVLink between local GPUs"),
                    format!("unset {name} (or export {name}=0)"),
                )
            } else {
                ok(caps::LOW_LATENCY, format!("{value:?} = false"))
            }
        }
        "NVSHMEM_DISABLE_NVLS" => {
            if parse_bool(value) {
                ok(caps::NVSHMEM, format!("{value:?} = true"))
            } else {
                fail(
                    caps::NVSHMEM,
                    format!("{value:?} = false: NVLink multicast on; our runtime refuses it"),
                    format!("export {name}=1 (or unset it: the launcher sets 1)"),
                )
            }
        }
        "NVSHMEM_IB_ENABLE_IBGDA" => {
            if parse_bool(value) {
                ok(caps::INTERNODE, format!("{value:?} = true"))
            } else {
                fail(caps::INTERNODE, format!("{value:?} = false: IBGDA is off (an exported value overrides the runtime's default of 1)"), format!("export {name}=1 (or unset it)"))
            }
        }
        "NVSHMEM_IBGDA_NIC_HANDLER" => match value.to_ascii_lowercase().as_str() {
            "auto" => ok(caps::INTERNODE, "auto: GPU handler, CPU fallback".into()),
            "gpu" => fail(
                caps::CPU_IBGDA,
                "gpu: forces the GPU handler, so no CPU-assisted fallback".to_string(),
                format!("unset {name} (default auto)"),
            ),
            "cpu" => fail(
                caps::GPU_IBGDA,
                "cpu: forces the CPU-assisted handler".to_string(),
                format!("unset {name} (default auto)"),
            ),
            _ => invalid_value(caps::INTERNODE, "one of auto, gpu, cpu"),
        },
        "NVSHMEM_IBGDA_NUM_RC_PER_PE" | "NVSHMEM_IB_GID_INDEX" | "NVSHMEM_IB_TRAFFIC_CLASS" => {
            match parse_int(value) {
                Some(v) if v >= 0 => ok(caps::INTERNODE, format!("{v}")),
                _ => invalid_value(caps::INTERNODE, "a non-negative integer"),
            }
        }
        "NVSHMEM_IB_SL" => match parse_int(value) {
            Some(v) if (0..=15).contains(&v) => ok(caps::INTERNODE, format!("{v}")),
            _ => invalid_value(caps::INTERNODE, "a service level 0..15"),
        },
        "NVSHMEM_REMOTE_TRANSPORT" => match value.to_ascii_lowercase().as_str() {
            "ibrc" | "ucx" | "libfabric" | "ibdevx" => ok(caps::INTERNODE, value.to_string()),
            "none" => Some(Check::warn(
                id(name),
                caps::INTERNODE,
                "none: NVSHMEM skips its InfiniBand probe (fine on a single host)",
                format!("unset {name} for internode runs"),
            )),
            _ => invalid_value(caps::INTERNODE, "one of ibrc, ucx, libfabric, ibdevx, none"),
        },
        "NVSHMEM_BOOTSTRAP" => match value.to_ascii_uppercase().as_str() {
            "UID" | "PMI" | "MPI" | "SHMEM" | "PLUGIN" | "PMIX" | "PMI2" | "PMI-2" => {
                ok(caps::NVSHMEM, value.to_string())
            }
            _ => invalid_value(
                caps::NVSHMEM,
                "one of UID, PMI, PMI-2, PMIX, MPI, SHMEM, plugin",
            ),
        },
        "NVSHMEM_HCA_LIST" => Some(hca_list(ctx, name, value)),
        "NVSHMEM_HCA_PREFIX" => {
            let hit = ctx.rdma.ports.iter().any(|p| p.device.starts_with(value));
            if hit {
                ok(caps::INTERNODE, format!("{value} matches an RDMA device"))
            } else {
                Some(Check::fail(
                    id(name),
                    caps::INTERNODE,
                    format!("{value:?} matches no device in /sys/class/infiniband"),
                    format!(
                        "export {name}=<prefix of a device in /sys/class/infiniband> or unset it"
                    ),
                ))
            }
        }
        "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" => {
            // A comma list; a leading ^ excludes, = asks for an exact match.
            let names: Vec<&str> = value
                .trim_start_matches('^')
                .split(',')
                .map(|n| n.trim_start_matches('='))
                .collect();
            let present = host
                .list_dir(std::path::Path::new("/sys/class/net"))
                .unwrap_or_default();
            if value.starts_with('^')
                || names
                    .iter()
                    .any(|n| present.iter().any(|p| p.starts_with(n)))
            {
                ok(caps::NVSHMEM, value.to_string())
            } else {
                fail(caps::NVSHMEM, format!("{value:?} matches no network interface in /sys/class/net ({})", present.join(" ")), format!("export {name}=lo for a single host, or the name of an interface all hosts reach each other on"))
            }
        }
        "NVSHMEM_CUDA_PATH" => {
            let dir = std::path::Path::new(value);
            if host.exists(&dir.join("libcuda.so.1")) || host.exists(&dir.join("libcuda.so")) {
                ok(caps::NVSHMEM, format!("{value} has libcuda"))
            } else {
                fail(caps::NVSHMEM, format!("{value} has no libcuda.so.1"), format!("unset {name} or point it at the directory holding the driver's libcuda.so.1"))
            }
        }
        "NVSHMEM_DEBUG" => match value.to_ascii_uppercase().as_str() {
            "" | "VERSION" | "WARN" | "INFO" | "ABORT" | "TRACE" => {
                ok(caps::NVSHMEM, value.to_string())
            }
            _ => Some(Check::warn(
                id(name),
                caps::NVSHMEM,
                format!("{value:?} is not a debug level"),
                format!("export {name}=INFO (or WARN, VERSION, ABORT, TRACE)"),
            )),
        },
        _ => None,
    }
}

fn hca_list(ctx: &Context, name: &str, value: &str) -> Check {
    let devices: Vec<&str> = ctx.rdma.ports.iter().map(|p| p.device.as_str()).collect();
    let unknown: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty() && !e.starts_with('^'))
        .map(|e| e.trim_start_matches('=').split(':').next().unwrap_or(e))
        .filter(|d| !devices.contains(d))
        .collect();
    if unknown.is_empty() {
        Check::ok(id(name), caps::INTERNODE, value.to_string())
    } else {
        Check::fail(
            id(name),
            caps::INTERNODE,
            format!("names devices that do not exist: {} (present: {})", unknown.join(", "), devices.join(", ")),
            format!("export {name}=<device>:<port>,... using names from /sys/class/infiniband, or unset it"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_nvshmem() {
        assert_eq!(parse_size("536870912"), Some(536870912));
        assert_eq!(parse_size("512M"), Some(512 << 20));
        assert_eq!(parse_size("4G"), Some(4 << 30));
        assert_eq!(parse_size("0.5k"), Some(512));
        assert_eq!(parse_size("20kk"), Some(20 << 10));
        assert_eq!(parse_size("12X"), None);
        assert_eq!(parse_size("abc"), None);
        assert_eq!(parse_size("-1G"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn bools_follow_nvshmem() {
        for f in ["0", "no", "false", "N", "F"] {
            assert!(!parse_bool(f), "{f}");
        }
        for t in ["1", "yes", "true", "", "on", "off"] {
            assert!(parse_bool(t), "{t}");
        }
    }

    #[test]
    fn ints_are_whole_strings() {
        assert_eq!(parse_int("1024"), Some(1024));
        assert_eq!(parse_int("0x400"), Some(1024));
        assert_eq!(parse_int("-3"), Some(-3));
        assert_eq!(parse_int("10k"), None);
        assert_eq!(parse_int(""), None);
    }
}
