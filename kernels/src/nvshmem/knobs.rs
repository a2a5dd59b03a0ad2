//! NVSHMEM runtime knobs, set the way DeepEP's `buffer.py` sets them for internode and
//! low-latency buffers — except that a value the user already exported wins, unless it is
//! invalid (then an error says why and what is valid). Everything here is pure logic over an
//! environment map ([`plan`]); [`apply`] writes the result into the process environment
//! (before `nvshmemx_hostlib_init_attr`) and logs the effective values once per process.
//!
//! | variable | our default | user value accepted when |
//! |---|---|---|
//! | `NVSHMEM_DISABLE_P2P` | `0` (`1` if NVLink is not allowed for LL) | boolean |
//! | `NVSHMEM_IB_ENABLE_IBGDA` | `1` | boolean |
//! | `NVSHMEM_IBGDA_NUM_RC_PER_PE` | `num_qps_per_rank` | integer 1..=1024 |
//! | `NVSHMEM_QP_DEPTH` | `max(1024, next_pow2(2·(num_max+1)))` | integer ≥ 2·(num_max+1), ≤ 32768 |
//! | `NVSHMEM_MAX_TEAMS` | `7` | integer 7..=1024 |
//! | `NVSHMEM_CUMEM_GRANULARITY` | `536870912` (512 MiB) | size ≥ 256 MiB, multiple of 2 MiB |
//! | `NVSHMEM_DISABLE_NVLS` | `1` | only `1`: NVLink multicast must stay off on these machines |
//! | `NVSHMEM_DISABLE_MNNVL` | `1` (unset when MNNVL is allowed) | boolean |
//! | `NVSHMEM_BOOTSTRAP` | (unset: our unique-id bootstrap) | `PMI`, `PMI2`, `PMI-2`, `PMIX` → NVSHMEM's PMI bootstrap |
//! | `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME` | `lo` when `MASTER_ADDR` is loopback/unset | any |

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Once;

use super::binding::{Bootstrap, PmiFlavor};
use crate::error::{EpError, Result};

/// Which DeepEP buffer the knobs are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferKind {
    /// Low-latency buffer with `num_max_dispatch_tokens_per_rank`.
    LowLatency { num_max_dispatch_tokens_per_rank: usize },
    /// Internode (normal) buffer.
    Internode,
}

/// Inputs of the knob logic (what DeepEP's `Buffer.__init__` receives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnobRequest {
    pub kind: BufferKind,
    /// `NVSHMEM_IBGDA_NUM_RC_PER_PE` default (DeepEP: `num_qps_per_rank`, 24; its LL test
    /// passes the number of local experts).
    pub num_qps_per_rank: usize,
    /// `allow_nvlink_for_low_latency_mode` (DeepEP default true).
    pub allow_nvlink_for_low_latency: bool,
    /// `allow_mnnvl` (DeepEP default false).
    pub allow_mnnvl: bool,
}

impl KnobRequest {
    pub fn low_latency(num_max_dispatch_tokens_per_rank: usize, num_local_experts: usize) -> Self {
        KnobRequest {
            kind: BufferKind::LowLatency { num_max_dispatch_tokens_per_rank },
            num_qps_per_rank: num_local_experts.max(1),
            allow_nvlink_for_low_latency: true,
            allow_mnnvl: false,
        }
    }
    pub fn internode(num_qps_per_rank: usize) -> Self {
        KnobRequest {
            kind: BufferKind::Internode,
            num_qps_per_rank,
            allow_nvlink_for_low_latency: true,
            allow_mnnvl: false,
        }
    }
}

/// Where an effective value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Exported by the user and valid: kept.
    User,
    /// Set by us (DeepEP's logic).
    Default,
}

/// One effective variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Knob {
    pub name: &'static str,
    /// `None`: leave the variable unset (NVSHMEM's own default).
    pub value: Option<String>,
    pub source: Source,
}

/// The effective knob set plus the bootstrap it implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnobPlan {
    pub knobs: Vec<Knob>,
    pub bootstrap: Bootstrap,
}

impl KnobPlan {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.knobs.iter().find(|k| k.name == name).and_then(|k| k.value.as_deref())
    }
}

impl fmt::Display for KnobPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bootstrap={:?}", self.bootstrap)?;
        for k in &self.knobs {
            let src = match k.source {
                Source::User => "user",
                Source::Default => "deepep",
            };
            match &k.value {
                Some(v) => write!(f, " {}={v} ({src})", k.name)?,
                None => write!(f, " {}=<unset>", k.name)?,
            }
        }
        Ok(())
    }
}

pub const MIN_CUMEM_GRANULARITY: u64 = 256 << 20;
pub const DEEPEP_CUMEM_GRANULARITY: u64 = 512 << 20;
const CUMEM_GRANULE: u64 = 2 << 20;
pub const DEFAULT_QP_DEPTH: u64 = 1024;
pub const MAX_QP_DEPTH: u64 = 32768;
pub const MIN_MAX_TEAMS: u64 = 7;

/// NVSHMEM's boolean syntax (case-insensitive).
fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "y" | "on" => Some(true),
        "0" | "false" | "no" | "n" | "off" => Some(false),
        _ => None,
    }
}

/// NVSHMEM's size syntax: a number with an optional k/m/g/t suffix (powers of 1024).
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mult) = match v.chars().last()? {
        'k' | 'K' => (&v[..v.len() - 1], 1u64 << 10),
        'm' | 'M' => (&v[..v.len() - 1], 1 << 20),
        'g' | 'G' => (&v[..v.len() - 1], 1 << 30),
        't' | 'T' => (&v[..v.len() - 1], 1 << 40),
        _ => (v, 1),
    };
    if num.is_empty() {
        return None;
    }
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult);
    }
    let f: f64 = num.parse().ok()?;
    (f.is_finite() && f >= 0.0).then(|| (f * mult as f64).ceil() as u64)
}

fn invalid(name: &str, value: &str, why: &str, fix: &str) -> EpError {
    EpError::InvalidArgument(format!("{name}={value:?} is invalid: {why}. Fix: {fix}"))
}

/// The QP depth DeepEP requires for LL: one WQE per token and slot, two in flight per token.
pub fn min_qp_depth(num_max_dispatch_tokens_per_rank: usize) -> u64 {
    2 * (num_max_dispatch_tokens_per_rank as u64 + 1)
}

/// Parse the user's bootstrap choice.
pub fn bootstrap_from_env(env: &BTreeMap<String, String>) -> Result<Bootstrap> {
    let Some(b) = env.get("NVSHMEM_BOOTSTRAP").map(|s| s.trim().to_ascii_uppercase()) else {
        return Ok(Bootstrap::UniqueId);
    };
    let flavor_of = |s: &str| match s {
        "PMI" | "PMI1" | "PMI-1" => Some(PmiFlavor::Pmi1),
        "PMI2" | "PMI-2" => Some(PmiFlavor::Pmi2),
        "PMIX" => Some(PmiFlavor::Pmix),
        _ => None,
    };
    match b.as_str() {
        "" | "UID" => Ok(Bootstrap::UniqueId),
        "PMI" => {
            // NVSHMEM's own spelling: flavour in NVSHMEM_BOOTSTRAP_PMI (default PMI-1).
            let fl = env.get("NVSHMEM_BOOTSTRAP_PMI").map(|s| s.trim().to_ascii_uppercase());
            match fl.as_deref() {
                None | Some("") => Ok(Bootstrap::Pmi(PmiFlavor::Pmi1)),
                Some(f) => flavor_of(f).map(Bootstrap::Pmi).ok_or_else(|| {
                    invalid("NVSHMEM_BOOTSTRAP_PMI", f, "unknown PMI flavour", "use PMI, PMI-2 or PMIX")
                }),
            }
        }
        other => match flavor_of(other) {
            Some(f) => Ok(Bootstrap::Pmi(f)),
            None => Err(invalid(
                "NVSHMEM_BOOTSTRAP",
                other,
                "deepep-kernels supports the unique-id bootstrap (unset, or UID) and NVSHMEM's PMI bootstraps; \
                 MPI/SHMEM bootstraps need an MPI communicator we do not have",
                "unset it (torchrun-style MASTER_ADDR/MASTER_PORT rendezvous), or set PMI2 / PMIX under Slurm",
            )),
        },
    }
}

fn is_loopback(addr: &str) -> bool {
    let a = addr.trim();
    a.is_empty() || a == "localhost" || a.starts_with("127.") || a == "::1"
}

/// The effective knobs for `req` given the current environment `env`. Pure.
pub fn plan(env: &BTreeMap<String, String>, req: &KnobRequest) -> Result<KnobPlan> {
    let mut knobs = Vec::new();
    let user = |name: &str| env.get(name).map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    let mut push = |name: &'static str, value: Option<String>, source| knobs.push(Knob { name, value, source });

    // Booleans where the user wins.
    let bool_knob = |name: &'static str, default: Option<bool>| -> Result<(Option<String>, Source)> {
        match user(name) {
            Some(v) => match parse_bool(&v) {
                Some(_) => Ok((Some(v), Source::User)),
                None => Err(invalid(name, &v, "not a boolean", "use 0 or 1")),
            },
            None => Ok((default.map(|b| if b { "1" } else { "0" }.to_string()), Source::Default)),
        }
    };
    let (v, s) = bool_knob("NVSHMEM_DISABLE_P2P", Some(!req.allow_nvlink_for_low_latency))?;
    push("NVSHMEM_DISABLE_P2P", v, s);
    let (v, s) = bool_knob("NVSHMEM_IB_ENABLE_IBGDA", Some(true))?;
    push("NVSHMEM_IB_ENABLE_IBGDA", v, s);

    let int_knob = |name: &'static str, default: u64, lo: u64, hi: u64, why: &str| -> Result<(Option<String>, Source)> {
        match user(name) {
            Some(v) => match v.parse::<u64>() {
                Ok(n) if (lo..=hi).contains(&n) => Ok((Some(v), Source::User)),
                Ok(_) => Err(invalid(name, &v, &format!("out of range ({why})"), &format!("use an integer in {lo}..={hi}, or unset it for {default}"))),
                Err(_) => Err(invalid(name, &v, "not an integer", &format!("use an integer in {lo}..={hi}, or unset it for {default}"))),
            },
            None => Ok((Some(default.to_string()), Source::Default)),
        }
    };
    if req.num_qps_per_rank == 0 {
        return Err(EpError::InvalidArgument("num_qps_per_rank must be at least 1".into()));
    }
    let (v, s) = int_knob("NVSHMEM_IBGDA_NUM_RC_PER_PE", req.num_qps_per_rank as u64, 1, 1024, "RC QPs per peer PE")?;
    push("NVSHMEM_IBGDA_NUM_RC_PER_PE", v, s);

    let min_depth = match req.kind {
        BufferKind::LowLatency { num_max_dispatch_tokens_per_rank } => min_qp_depth(num_max_dispatch_tokens_per_rank),
        BufferKind::Internode => 1,
    };
    if min_depth > MAX_QP_DEPTH {
        return Err(EpError::InvalidArgument(format!(
            "num_max_dispatch_tokens_per_rank needs NVSHMEM_QP_DEPTH >= {min_depth}, above the maximum {MAX_QP_DEPTH}; \
             use at most {} tokens per rank",
            MAX_QP_DEPTH / 2 - 1
        )));
    }
    let default_depth = DEFAULT_QP_DEPTH.max(min_depth.next_power_of_two());
    let (v, s) = int_knob(
        "NVSHMEM_QP_DEPTH",
        default_depth,
        min_depth.max(1),
        MAX_QP_DEPTH,
        &format!("the low-latency buffer needs at least 2*(num_max_dispatch_tokens_per_rank+1) = {min_depth} WQEs"),
    )?;
    push("NVSHMEM_QP_DEPTH", v, s);

    let (v, s) = int_knob("NVSHMEM_MAX_TEAMS", MIN_MAX_TEAMS, MIN_MAX_TEAMS, 1024, "NVSHMEM's predefined teams plus one for the kernels")?;
    push("NVSHMEM_MAX_TEAMS", v, s);

    match user("NVSHMEM_CUMEM_GRANULARITY") {
        Some(v) => match parse_size(&v) {
            Some(n) if n >= MIN_CUMEM_GRANULARITY && n % CUMEM_GRANULE == 0 => {
                push("NVSHMEM_CUMEM_GRANULARITY", Some(v), Source::User)
            }
            Some(_) => {
                return Err(invalid(
                    "NVSHMEM_CUMEM_GRANULARITY",
                    &v,
                    "must be at least 256 MiB (268435456) and a multiple of 2 MiB",
                    "use e.g. 536870912 (512 MiB, DeepEP's value) or unset it",
                ))
            }
            None => {
                return Err(invalid(
                    "NVSHMEM_CUMEM_GRANULARITY",
                    &v,
                    "not a size (a number with optional k/m/g/t suffix)",
                    "use e.g. 536870912 or 512m",
                ))
            }
        },
        None => push("NVSHMEM_CUMEM_GRANULARITY", Some(DEEPEP_CUMEM_GRANULARITY.to_string()), Source::Default),
    }

    match user("NVSHMEM_DISABLE_NVLS") {
        Some(v) => match parse_bool(&v) {
            Some(true) => push("NVSHMEM_DISABLE_NVLS", Some(v), Source::User),
            _ => {
                return Err(invalid(
                    "NVSHMEM_DISABLE_NVLS",
                    &v,
                    "NVLink multicast (NVLS) must never be used on this machine class",
                    "unset NVSHMEM_DISABLE_NVLS or set it to 1",
                ))
            }
        },
        None => push("NVSHMEM_DISABLE_NVLS", Some("1".into()), Source::Default),
    }

    let (v, s) = bool_knob("NVSHMEM_DISABLE_MNNVL", (!req.allow_mnnvl).then_some(true))?;
    push("NVSHMEM_DISABLE_MNNVL", v, s);

    let bootstrap = bootstrap_from_env(env)?;
    match bootstrap {
        Bootstrap::UniqueId => {
            if let Some(v) = user("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME") {
                push("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", Some(v), Source::User);
            } else if is_loopback(env.get("MASTER_ADDR").map(String::as_str).unwrap_or("")) {
                push("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", Some("lo".into()), Source::Default);
            }
            // Our rendezvous does the wire-up; a stale PMI choice must not leak into NVSHMEM.
            if user("NVSHMEM_BOOTSTRAP").is_some() {
                push("NVSHMEM_BOOTSTRAP", Some("UID".into()), Source::User);
            }
        }
        Bootstrap::Pmi(flavor) => {
            // NVSHMEM only knows NVSHMEM_BOOTSTRAP=PMI; the flavour goes to NVSHMEM_BOOTSTRAP_PMI.
            push("NVSHMEM_BOOTSTRAP", Some("PMI".into()), Source::User);
            push("NVSHMEM_BOOTSTRAP_PMI", Some(flavor.nvshmem_name().into()), Source::User);
        }
    }
    Ok(KnobPlan { knobs, bootstrap })
}

/// The process environment as a map (non-UTF-8 entries skipped).
pub fn process_env() -> BTreeMap<String, String> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

static LOGGED: Once = Once::new();

/// Compute the plan from the process environment, export it (before NVSHMEM init!) and log the
/// effective values once per process.
pub fn apply(req: &KnobRequest) -> Result<KnobPlan> {
    let plan = plan(&process_env(), req)?;
    for k in &plan.knobs {
        if let Some(v) = &k.value {
            // Single-threaded at this point of start-up in our binaries (before NVSHMEM spawns
            // its threads); edition 2021 keeps set_var safe.
            std::env::set_var(k.name, v);
        }
    }
    LOGGED.call_once(|| tracing::info!("NVSHMEM knobs: {plan}"));
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn sizes_parse_like_nvshmem() {
        assert_eq!(parse_size("536870912"), Some(536870912));
        assert_eq!(parse_size("512m"), Some(512 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("0.5g"), Some(512 << 20));
        assert_eq!(parse_size("abc"), None);
        assert_eq!(parse_size("m"), None);
    }

    #[test]
    fn qp_depth_default_grows_with_num_max() {
        let p = plan(&env(&[]), &KnobRequest::low_latency(128, 144)).unwrap();
        assert_eq!(p.get("NVSHMEM_QP_DEPTH"), Some("1024"));
        let p = plan(&env(&[]), &KnobRequest::low_latency(1000, 8)).unwrap();
        assert_eq!(p.get("NVSHMEM_QP_DEPTH"), Some("2048"));
    }
}
