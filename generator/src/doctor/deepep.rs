//! DeepEP checks (`--python-site DIR`, repeatable): what a built `deep_ep_cpp*.so` records (the NVSHMEM
//! device library linked into it, the host library it needs and where it looks for it, its GPU
//! code), which NVSHMEM host library would load for it, torch's own NVSHMEM, the DeepEP x NVSHMEM
//! pairings known to break (`pkgs/deep-ep/pairings.json`, shared with the Nix package), the IBGDA plugin next to that host library, and the GPUs' compute
//! capability against the build's architectures. Nothing is imported or loaded.

use super::elf::{self, native_ident, DynInfo, Resolution};
use super::facts::{DriverInfo, NvshmemInfo, RdmaInfo, Version};
use super::host::Host;
use super::nvshmem::{self, banner_versions, HOST_LIB};
use super::report::{caps, Capability, Check};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod kernels;

/// `pkgs/deep-ep/pairings.json`: the DeepEP x NVSHMEM pairings known to break. The same file is
/// the Nix package's data (`pkgs/deep-ep/lib.nix` reads it with `builtins.fromJSON`), so the
/// doctor and the evaluation-time refusal apply the same rules.
pub const PAIRINGS_JSON: &str = include_str!("../../../pkgs/deep-ep/pairings.json");

/// An inclusive version range; an absent bound is open (`atLeast` / `atMost` in the JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub at_least: Option<Version>,
    pub at_most: Option<Version>,
}

impl Range {
    pub fn contains(&self, v: Version) -> bool {
        self.at_least.map_or(true, |lo| v >= lo) && self.at_most.map_or(true, |hi| v <= hi)
    }
}

/// A commit after which builds of DeepEP `deepep` have a rule's fix (while still calling
/// themselves `deepep`): a build that records a revision gets a warning, not a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedAfter {
    pub deepep: Version,
    pub commit: String,
    /// Which builds these are, e.g. "builds of DeepEP's v1 branch after PR #564".
    pub builds: String,
}

/// A known-broken pairing rule (an entry of `broken` in the JSON), with the doctor's texts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub id: String,
    pub deepep: Range,
    pub nvshmem: Range,
    /// The capabilities it breaks, from the rule's `modes`, in report order.
    pub breaks: Vec<Capability>,
    /// What is wrong (`doctor.found`), after "DeepEP X with NVSHMEM Y (where): ".
    pub found: String,
    pub fix: String,
    pub fixed_after: Option<FixedAfter>,
}

#[derive(Deserialize)]
struct RawPairings {
    broken: Vec<RawRule>,
    #[serde(rename = "hostLimits", default)]
    host_limits: Vec<RawRule>,
}

/// The host a `hostLimits` entry applies to (its `host` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCondition {
    /// `"no-rdma-device"`: no InfiniBand/RoCE device in `/sys/class/infiniband`.
    NoRdmaDevice,
}

impl HostCondition {
    fn parse(s: &str) -> Option<HostCondition> {
        match s {
            "no-rdma-device" => Some(HostCondition::NoRdmaDevice),
            _ => None,
        }
    }

    /// Whether this host (what the NIC checks found) is one the limit applies to.
    pub fn holds(self, rdma: &RdmaInfo) -> bool {
        match self {
            HostCondition::NoRdmaDevice => rdma.ports.is_empty(),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            HostCondition::NoRdmaDevice => "a host without an InfiniBand/RoCE device",
        }
    }
}

/// A `hostLimits` entry: a pairing that fails on some hosts only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLimit {
    pub rule: Rule,
    pub host: HostCondition,
}

/// The fields the doctor reads; `why`, `fix` and `sources` are the Nix refusal's and ignored.
#[derive(Deserialize)]
struct RawRule {
    id: String,
    deepep: RawRange,
    nvshmem: RawRange,
    modes: Vec<String>,
    doctor: RawDoctor,
    #[serde(rename = "fixedAfter")]
    fixed_after: Option<RawFixedAfter>,
    /// `hostLimits` only: the host it applies to ([`HostCondition`]).
    host: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRange {
    #[serde(rename = "atLeast")]
    at_least: Option<String>,
    #[serde(rename = "atMost")]
    at_most: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDoctor {
    found: String,
    fix: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFixedAfter {
    deepep: String,
    commit: String,
    builds: String,
}

/// Parses the pairing data (the text of `pkgs/deep-ep/pairings.json`) into the rules the
/// `deepep.pairing` check applies. Errors name the rule and field and what is expected.
pub fn parse_pairings(text: &str) -> Result<Vec<Rule>, String> {
    let raw: RawPairings = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if let Some(r) = raw.broken.iter().find(|r| r.host.is_some()) {
        return Err(format!(
            "rule {:?}: `host` belongs in hostLimits (a broken rule applies to every host)",
            r.id
        ));
    }
    parse_rules(raw.broken)
}

/// Parses the `hostLimits` entries (the fields of `broken` plus `host`, a [`HostCondition`]).
pub fn parse_host_limits(text: &str) -> Result<Vec<HostLimit>, String> {
    let raw: RawPairings = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let hosts: Vec<Option<String>> = raw.host_limits.iter().map(|r| r.host.clone()).collect();
    let ids: Vec<String> = raw.host_limits.iter().map(|r| r.id.clone()).collect();
    let rules = parse_rules(raw.host_limits)?;
    rules
        .into_iter()
        .zip(hosts.iter().zip(&ids))
        .map(|(rule, (host, id))| match host.as_deref().map(|h| (h, HostCondition::parse(h))) {
            Some((_, Some(host))) => Ok(HostLimit { rule, host }),
            Some((h, None)) => Err(format!(
                "host limit {id:?}: unknown host {h:?}; use \"no-rdma-device\""
            )),
            None => Err(format!(
                "host limit {id:?}: missing field `host` (the hosts it applies to, e.g. \"no-rdma-device\")"
            )),
        })
        .collect()
}

fn parse_rules(raw: Vec<RawRule>) -> Result<Vec<Rule>, String> {
    let mut rules: Vec<Rule> = Vec::new();
    for r in raw {
        let id = r.id.clone();
        let version = |field: &str, v: &str| {
            Version::parse(v)
                .ok_or_else(|| format!("rule {id:?}: {field} {v:?} is not a version X.Y.Z"))
        };
        let range = |name: &str, raw: &RawRange| -> Result<Range, String> {
            if raw.at_least.is_none() && raw.at_most.is_none() {
                return Err(format!(
                    "rule {id:?}: {name} is an empty range; give atLeast and/or atMost"
                ));
            }
            Ok(Range {
                at_least: raw
                    .at_least
                    .as_deref()
                    .map(|v| version(&format!("{name}.atLeast"), v))
                    .transpose()?,
                at_most: raw
                    .at_most
                    .as_deref()
                    .map(|v| version(&format!("{name}.atMost"), v))
                    .transpose()?,
            })
        };
        if id.is_empty() || rules.iter().any(|x| x.id == id) {
            return Err(format!("rule id {id:?} is empty or not unique"));
        }
        let mut breaks = Vec::new();
        for m in &r.modes {
            let caps: &[Capability] = match m.as_str() {
                "intranode" => &[Capability::Intranode],
                "low-latency" => caps::LOW_LATENCY,
                "internode" => caps::INTERNODE,
                other => {
                    return Err(format!(
                        "rule {id:?}: unknown mode {other:?}; use \"intranode\", \"low-latency\" or \"internode\""
                    ))
                }
            };
            breaks.extend_from_slice(caps);
        }
        let breaks: Vec<Capability> = caps::ALL
            .iter()
            .copied()
            .filter(|c| breaks.contains(c))
            .collect();
        if breaks.is_empty() {
            return Err(format!("rule {id:?}: modes is empty"));
        }
        if r.doctor.found.trim().is_empty() || r.doctor.fix.trim().is_empty() {
            return Err(format!(
                "rule {id:?}: doctor.found and doctor.fix must not be empty"
            ));
        }
        let fixed_after = match r.fixed_after {
            None => None,
            Some(f) => Some(FixedAfter {
                deepep: version("fixedAfter.deepep", &f.deepep)?,
                commit: f.commit,
                builds: f.builds,
            }),
        };
        rules.push(Rule {
            deepep: range("deepep", &r.deepep)?,
            nvshmem: range("nvshmem", &r.nvshmem)?,
            id,
            breaks,
            found: r.doctor.found,
            fix: r.doctor.fix,
            fixed_after,
        });
    }
    Ok(rules)
}

/// The embedded rules, parsed once (unit tests make sure they parse).
fn pairing_rules() -> &'static Result<Vec<Rule>, String> {
    static RULES: OnceLock<Result<Vec<Rule>, String>> = OnceLock::new();
    RULES.get_or_init(|| parse_pairings(PAIRINGS_JSON))
}

/// The embedded host limits, parsed once.
fn host_limits() -> &'static Result<Vec<HostLimit>, String> {
    static LIMITS: OnceLock<Result<Vec<HostLimit>, String>> = OnceLock::new();
    LIMITS.get_or_init(|| parse_host_limits(PAIRINGS_JSON))
}

/// The failure of check `id` when `what` (the pairing rules or the host limits) built into this
/// binary from `pkgs/deep-ep/pairings.json` does not parse.
fn invalid_pairings_json(id: &str, what: &str, e: &str) -> Check {
    Check::fail(
        id,
        caps::NVSHMEM,
        format!("the {what} built into this deepep-nix (pkgs/deep-ep/pairings.json) are invalid: {e}"),
        "fix pkgs/deep-ep/pairings.json (cargo test -p deepep-nix pairing_data names the problem) and rebuild deepep-nix",
    )
}

/// The `deepep.host-limits` check: the `hostLimits` of `pkgs/deep-ep/pairings.json` that cover
/// DeepEP `dv` and one of the NVSHMEM versions in play, applied to this host (`rdma`). A limit
/// that holds here is a warning for the modes it breaks (the same build works on other hosts).
pub fn host_limit_check(
    limits: &[HostLimit],
    raw: &str,
    dv: Version,
    in_play: &[(Version, String)],
    rdma: &RdmaInfo,
) -> Check {
    const ID: &str = "deepep.host-limits";
    let mut order: Vec<&(Version, String)> = in_play.iter().collect();
    order.sort_by_key(|x| std::cmp::Reverse(x.0));
    let covering: Vec<(&HostLimit, Version, &str)> = limits
        .iter()
        .filter(|l| l.rule.deepep.contains(dv))
        .filter_map(|l| {
            order
                .iter()
                .find(|(nv, _)| l.rule.nvshmem.contains(*nv))
                .map(|(nv, what)| (l, *nv, what.as_str()))
        })
        .collect();
    let versions = order
        .iter()
        .map(|(v, what)| format!("{v} ({what})"))
        .collect::<Vec<_>>()
        .join(", ");
    if let Some((l, nv, what)) = covering.iter().find(|(l, _, _)| l.host.holds(rdma)) {
        return Check::warn(
            ID,
            &l.rule.breaks,
            format!(
                "DeepEP {raw} with NVSHMEM {nv} ({what}) on {} (none in /sys/class/infiniband): {} [pairings.json hostLimits {}]",
                l.host.describe(),
                l.rule.found,
                l.rule.id
            ),
            l.rule.fix.clone(),
        );
    }
    match covering.first() {
        Some((l, nv, _)) => Check::ok(
            ID,
            caps::NVSHMEM,
            format!(
                "DeepEP {raw} with NVSHMEM {nv}: host limit {} applies to {} only; this host has {} RDMA port(s)",
                l.rule.id,
                l.host.describe(),
                rdma.ports.len()
            ),
        ),
        None => Check::ok(
            ID,
            caps::NVSHMEM,
            format!("DeepEP {raw} with NVSHMEM {versions}: no host limit of pairings.json covers it"),
        ),
    }
}

/// The DeepEP release installed in `sites` when it is V2 (2.x): V2 needs NCCL (its GIN
/// backend) and checks at import which libnccl is mapped, so the doctor runs the NCCL check
/// (`deepep.nccl`, which the doctor's stack module makes) for it.
pub fn v2_release(host: &Host, sites: &[PathBuf]) -> Option<String> {
    let (raw, _) = sites.iter().find_map(|s| find_version(host, s, "deep_ep-"))?;
    parse_deepep_version(&raw)
        .is_some_and(|(v, _)| v >= Version(2, 0, 0))
        .then_some(raw)
}

/// Whether `site` holds our `deepep_kernels` package (with its extension).
pub(super) fn has_our_package(host: &Host, site: &Path) -> bool {
    kernels::find(host, site).is_some()
}

/// The `deepep.pairing` check for DeepEP `raw` (parsed: `dv`, local version label `local`) and
/// the NVSHMEM versions in play (version, where it comes from; not empty). The newest version
/// is looked at first (among equals the first listed); the first that a rule covers decides.
pub fn pairing_check(
    rules: &[Rule],
    raw: &str,
    dv: Version,
    local: Option<&str>,
    in_play: &[(Version, String)],
) -> Check {
    const ID: &str = "deepep.pairing";
    let mut order: Vec<&(Version, String)> = in_play.iter().collect();
    order.sort_by_key(|x| std::cmp::Reverse(x.0));
    let hit = order.iter().find_map(|(nv, what)| {
        rules
            .iter()
            .find(|r| r.deepep.contains(dv) && r.nvshmem.contains(*nv))
            .map(|r| (*nv, what, r))
    });
    let Some((nv, what, rule)) = hit else {
        let (nv, what) = order
            .first()
            .map_or((Version(0, 0, 0), ""), |x| (x.0, x.1.as_str()));
        return Check::ok(
            ID,
            caps::NVSHMEM,
            format!("DeepEP {raw} with NVSHMEM {nv} ({what}): not a known-broken pairing"),
        );
    };
    let found = format!("DeepEP {raw} with NVSHMEM {nv} ({what}): {}", rule.found);
    match (local, &rule.fixed_after) {
        (Some(rev), Some(f)) if f.deepep == dv => Check::warn(
            ID,
            &rule.breaks,
            format!(
                "{found}. Revision {rev}: {} (commit {}) have the fix and the same version {dv}, the v{dv} tag does not",
                f.builds, f.commit
            ),
            format!(
                "check in the DeepEP checkout: git merge-base --is-ancestor {} {rev} && echo fixed; if not fixed: {}",
                f.commit, rule.fix
            ),
        ),
        _ => Check::fail(ID, &rule.breaks, found, rule.fix.clone()),
    }
}

/// Fat binary header magic (`.nv_fatbin` section of CUDA objects).
const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// A GPU code image in a fat binary: cubin (`sm_XY`) or PTX (`compute_XY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Image {
    Cubin(u32, u32),
    Ptx(u32, u32),
}

impl Image {
    fn name(self) -> String {
        match self {
            Image::Cubin(a, b) => format!("sm_{a}{b}"),
            Image::Ptx(a, b) => format!("compute_{a}{b} (PTX)"),
        }
    }

    /// Whether a GPU of compute capability `cc` can run this image: a cubin runs on GPUs of
    /// its major version and an equal or higher minor; PTX is compiled for any equal or newer
    /// GPU by the driver.
    fn runs_on(self, cc: (u32, u32)) -> bool {
        match self {
            Image::Cubin(a, b) => cc.0 == a && cc.1 >= b,
            Image::Ptx(a, b) => cc >= (a, b),
        }
    }
}

/// The images of every fat binary in `.nv_fatbin` (header: magic u32, version u16, header size
/// u16, payload size u64; each entry: kind u16 (1 PTX, 2 ELF), u16, header size u32, payload
/// size u64, ..., arch u32 at offset 28 (e.g. 90), as nvcc writes them).
pub fn fatbin_images(section: &[u8]) -> Vec<Image> {
    let u16_at = |d: &[u8], o: usize| d.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |d: &[u8], o: usize| {
        d.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |d: &[u8], o: usize| {
        d.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    };
    let mut images = Vec::new();
    let mut at = 0usize;
    while at + 16 <= section.len() {
        if u32_at(section, at) != Some(FATBIN_MAGIC) {
            at += 8; // headers are 8-byte aligned
            continue;
        }
        let (Some(hsize), Some(size)) = (u16_at(section, at + 6), u64_at(section, at + 8)) else {
            break;
        };
        if hsize < 16 {
            at += 8;
            continue;
        }
        let start = at + usize::from(hsize);
        let end = usize::try_from(size)
            .ok()
            .and_then(|s| start.checked_add(s))
            .map_or(section.len(), |e| e.min(section.len()));
        let mut e = start;
        while e + 32 <= end {
            let (Some(kind), Some(eh), Some(es), Some(arch)) = (
                u16_at(section, e),
                u32_at(section, e + 4),
                u64_at(section, e + 8),
                u32_at(section, e + 28),
            ) else {
                break;
            };
            let (major, minor) = (arch / 10, arch % 10);
            match kind {
                1 => images.push(Image::Ptx(major, minor)),
                2 => images.push(Image::Cubin(major, minor)),
                _ => {}
            }
            let Some(next) = usize::try_from(es)
                .ok()
                .and_then(|s| e.checked_add(eh as usize)?.checked_add(s))
            else {
                break;
            };
            if eh == 0 || next <= e {
                break;
            }
            e = next;
        }
        at = (end.max(at + 16) + 7) & !7;
    }
    images.sort();
    images.dedup();
    images
}

/// Compute capability of an NVIDIA data-centre or workstation GPU from its model name
/// (`/proc/driver/nvidia/gpus/*/information`), or `None` for models not in the table.
pub fn compute_capability(model: &str) -> Option<(u32, u32)> {
    let m = model.to_ascii_uppercase();
    const TABLE: &[(&str, (u32, u32))] = &[
        ("B300", (10, 3)),
        ("B200", (10, 0)),
        ("B100", (10, 0)),
        ("RTX PRO 6000 BLACKWELL", (12, 0)),
        ("RTX 50", (12, 0)),
        ("H200", (9, 0)),
        ("H100", (9, 0)),
        ("H800", (9, 0)),
        ("H20", (9, 0)),
        ("L40", (8, 9)),
        ("L4", (8, 9)),
        ("RTX 40", (8, 9)),
        ("A100", (8, 0)),
        ("A800", (8, 0)),
        ("A30", (8, 0)),
        ("A40", (8, 6)),
        ("A10", (8, 6)),
        ("RTX 30", (8, 6)),
        ("V100", (7, 0)),
        ("T4", (7, 5)),
    ];
    TABLE
        .iter()
        .find(|(k, _)| {
            m.split(|c: char| !c.is_ascii_alphanumeric() && c != ' ')
                .any(|part| part.contains(k))
        })
        .map(|(_, cc)| *cc)
}

/// `TORCH_CUDA_ARCH_LIST` entries (`9.0;10.0`, `9.0 10.0+PTX`, `9.0a`) as images.
pub fn parse_arch_list(s: &str) -> Option<Vec<Image>> {
    let mut out = Vec::new();
    for tok in s.split([';', ' ', ',']).filter(|t| !t.is_empty()) {
        let (arch, ptx) = match tok.strip_suffix("+PTX") {
            Some(a) => (a, true),
            None => (tok, false),
        };
        let arch = arch.trim_end_matches(['a', 'f']);
        let (maj, min) = arch.split_once('.')?;
        let cc = (maj.parse().ok()?, min.parse().ok()?);
        out.push(Image::Cubin(cc.0, cc.1));
        if ptx {
            out.push(Image::Ptx(cc.0, cc.1));
        }
    }
    (!out.is_empty()).then_some(out)
}

/// A GPU: index, model name, compute capability when the model is known.
type GpuCc<'a> = (usize, &'a str, Option<(u32, u32)>);

/// `1.2.1+309785a` -> (1.2.1, Some("309785a")).
pub fn parse_deepep_version(raw: &str) -> Option<(Version, Option<String>)> {
    let (public, local) = match raw.trim().split_once('+') {
        Some((p, l)) => (p, Some(l.to_string())),
        None => (raw.trim(), None),
    };
    Some((Version::parse(public)?, local))
}

/// What the site directory holds.
struct Extension {
    path: PathBuf,
    dynamic: DynInfo,
    /// `_ZL27nvshmemi_device_lib_version` of the linked-in `libnvshmem_device.a`.
    recorded: Result<Option<Version>, String>,
    images: Vec<Image>,
}

/// `deep_ep_cpp*.so` directly in `site` or in a `deep_ep-*.egg` directory of it.
fn find_extension(host: &Host, site: &Path) -> Option<PathBuf> {
    let is_ext = |n: &str| n.starts_with("deep_ep_cpp") && n.contains(".so");
    let names = host.list_dir(site).unwrap_or_default();
    if let Some(n) = names.iter().find(|n| is_ext(n)) {
        return Some(site.join(n));
    }
    names
        .iter()
        .filter(|n| n.starts_with("deep_ep-") && n.ends_with(".egg"))
        .find_map(|egg| {
            host.list_dir(&site.join(egg))
                .unwrap_or_default()
                .into_iter()
                .find(|n| is_ext(n))
                .map(|n| site.join(egg).join(n))
        })
}

/// A distribution's version from its package metadata (`Version:` of a dist-info `METADATA`, an
/// egg-info `PKG-INFO` or an egg's `EGG-INFO/PKG-INFO`) in `site`, with the file it came from;
/// `prefix` is the distribution's directory prefix (`deep_ep-`, `deepep_kernels-`).
fn find_version(host: &Host, site: &Path, prefix: &str) -> Option<(String, PathBuf)> {
    let names = host.list_dir(site).unwrap_or_default();
    for n in names.iter().filter(|n| n.starts_with(prefix)) {
        let candidates = [
            site.join(n).join("METADATA"),
            site.join(n).join("PKG-INFO"),
            site.join(n).join("EGG-INFO/PKG-INFO"),
        ];
        for file in candidates {
            if let Ok(text) = host.read_text(&file) {
                if let Some(v) = text.lines().find_map(|l| l.strip_prefix("Version:")) {
                    return Some((v.trim().to_string(), file));
                }
            }
        }
    }
    None
}

fn read_extension(host: &Host, path: &Path) -> Result<Extension, String> {
    use object::{Object, ObjectSection};
    let bytes = host
        .read_bytes(path, elf::LIB_CAP)
        .map_err(|e| format!("{} {e}", path.display()))?;
    let dynamic = elf::parse_dyn(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let obj = object::File::parse(&*bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let recorded = nvshmem::object_device_version(&obj);
    let images = obj
        .section_by_name(".nv_fatbin")
        .and_then(|s| s.data().ok())
        .map(fatbin_images)
        .unwrap_or_default();
    Ok(Extension {
        path: path.to_path_buf(),
        dynamic,
        recorded,
        images,
    })
}

fn version_at(host: &Host, p: &Path) -> Option<Version> {
    host.read_bytes(p, elf::LIB_CAP)
        .ok()
        .and_then(|b| banner_versions(&b).into_iter().next())
}

fn show(v: Option<Version>) -> String {
    v.map_or("of unknown version".into(), |v| v.to_string())
}

/// The site directories as a list for messages: `A, B`.
fn list_sites(sites: &[PathBuf]) -> String {
    sites
        .iter()
        .map(|s| s.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The first site (in the order given, as Python searches `sys.path`) for which `has` is true.
fn first_site(sites: &[PathBuf], has: impl Fn(&Path) -> bool) -> Option<&Path> {
    sites.iter().map(PathBuf::as_path).find(|s| has(s))
}

/// torch and its NVSHMEM: `torch/lib/libtorch_nvshmem.so` resolves `libnvshmem_host.so.3`
/// through its RUNPATH (the `nvidia-nvshmem-cu12/cu13` wheel); the wheel may also be there alone.
struct TorchNvshmem {
    /// The site directory holding torch (`torch/__init__.py` or `torch/lib/libtorch_nvshmem.so`),
    /// `None` when no given site has it.
    site: Option<PathBuf>,
    torch_lib: Option<PathBuf>,
    /// The host library torch loads (`torch_lib` found) or, without `torch_lib`, the wheel's.
    host_lib: Option<PathBuf>,
    version: Option<Version>,
    /// `nvidia/nvshmem` of the wheel: in torch's site if there, else the first site with it.
    wheel_prefix: Option<PathBuf>,
}

fn torch_nvshmem(host: &Host, sites: &[PathBuf]) -> TorchNvshmem {
    const TORCH_LIB: &str = "torch/lib/libtorch_nvshmem.so";
    let has_wheel = |s: &Path| host.exists(&s.join("nvidia/nvshmem/lib").join(HOST_LIB));
    let site = first_site(sites, |s| {
        host.exists(&s.join("torch/__init__.py")) || host.exists(&s.join(TORCH_LIB))
    });
    let wheel_prefix = site
        .filter(|s| has_wheel(s))
        .or_else(|| first_site(sites, has_wheel))
        .map(|s| s.join("nvidia/nvshmem"));
    let torch_lib = site.map(|s| s.join(TORCH_LIB)).filter(|p| host.exists(p));
    if let Some(torch_lib) = torch_lib {
        let resolved = host
            .read_bytes(&torch_lib, elf::LIB_CAP)
            .ok()
            .and_then(|b| elf::parse_dyn(&b).ok())
            .and_then(|d| {
                let dir = torch_lib.parent().unwrap_or(Path::new("/"));
                match elf::resolve(host, HOST_LIB, dir, &d) {
                    Resolution::Found(p) => Some(p),
                    Resolution::Missing { .. } => None,
                }
            });
        let version = resolved.as_deref().and_then(|p| version_at(host, p));
        return TorchNvshmem {
            site: site.map(Path::to_path_buf),
            torch_lib: Some(torch_lib),
            host_lib: resolved,
            version,
            wheel_prefix,
        };
    }
    let wheel_lib = wheel_prefix.as_ref().map(|p| p.join("lib").join(HOST_LIB));
    TorchNvshmem {
        site: site.map(Path::to_path_buf),
        torch_lib: None,
        version: wheel_lib.as_deref().and_then(|p| version_at(host, p)),
        host_lib: wheel_lib,
        wheel_prefix,
    }
}

/// The package whose NVSHMEM `torch_check` compares with torch's: the check id and the texts
/// that differ between upstream DeepEP and our `deepep_kernels`.
struct TorchSubject<'a> {
    id: &'a str,
    /// The reference's name, e.g. "DeepEP's build".
    build: &'a str,
    /// Why torch's libtorch_nvshmem.so loading another version is a failure (after ": ").
    clash: &'a str,
    /// What the nvidia-nvshmem wheel alone of another version means (after ": ").
    wheel_only: &'a str,
    /// The fix, given the nvidia-nvshmem wheel's `nvidia/nvshmem` prefix.
    fix: &'a dyn Fn(&Path) -> String,
}

/// Upstream DeepEP's subject for [`torch_check`].
fn deepep_torch_fix(wheel_prefix: &Path) -> String {
    format!(
        "use one NVSHMEM: build DeepEP against torch's copy (unset NVSHMEM_DIR, or NVSHMEM_DIR={}; DeepEP's setup.py also needs lib/libnvshmem_host.so there: ln -s libnvshmem_host.so.3 $NVSHMEM_DIR/lib/libnvshmem_host.so), or install the nvidia-nvshmem-cu13 (cu12 for a CUDA 12 torch) wheel of the version DeepEP was built against",
        wheel_prefix.display()
    )
}

/// `deepep.torch-nvshmem` (or the subject's id): torch's own NVSHMEM vs the one the build
/// recorded, or, when that is unknown (no extension, stripped), the NVSHMEM checked above
/// (`NVSHMEM_DIR`). Only what was seen is claimed: torch in none of `sites` is a warning naming
/// them, never an ok.
fn torch_check(
    sites: &[PathBuf],
    torch: &TorchNvshmem,
    recorded: Option<Version>,
    checked: &NvshmemInfo,
    subject: &TorchSubject,
    out: &mut Vec<Check>,
) {
    let (reference, ref_name) = match (recorded, checked.version) {
        (Some(v), _) => (Some(v), subject.build.to_string()),
        (None, Some(v)) => (
            Some(v),
            "the NVSHMEM checked above (NVSHMEM_DIR)".to_string(),
        ),
        (None, None) => (None, String::new()),
    };
    let torch_id = subject.id;
    let Some(torch_site) = &torch.site else {
        out.push(Check::warn(
            torch_id,
            caps::NVSHMEM,
            format!(
                "torch not found in the --python-site directories searched ({}): its own NVSHMEM (torch/lib/libtorch_nvshmem.so, the nvidia-nvshmem wheel) was not checked",
                list_sites(sites)
            ),
            "pass torch's site-packages too: --python-site $(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')",
        ));
        return;
    };
    let torch_dir = torch_site.join("torch");
    let wheel_prefix = torch
        .wheel_prefix
        .clone()
        .unwrap_or_else(|| torch_site.join("nvidia/nvshmem"));
    let torch_fix = (subject.fix)(&wheel_prefix);
    // Without libtorch_nvshmem.so, what is said about the wheel starts with what torch lacks.
    let no_lib = format!(
        "torch at {} has no lib/libtorch_nvshmem.so; ",
        torch_dir.display()
    );
    match (&torch.torch_lib, &torch.host_lib, torch.version, reference) {
        (None, None, _, _) => out.push(Check::ok(
            torch_id,
            caps::NVSHMEM,
            format!(
                "torch at {} bundles no NVSHMEM (no lib/libtorch_nvshmem.so; no nvidia/nvshmem/lib/{HOST_LIB} in {})",
                torch_dir.display(),
                list_sites(sites)
            ),
        )),
        (Some(tl), None, _, _) => out.push(Check::warn(
            torch_id,
            caps::NVSHMEM,
            format!("{} cannot find {HOST_LIB}: torch's NVSHMEM features would fail to load", tl.display()),
            torch_fix,
        )),
        (tl, Some(hl), Some(tv), Some(rv)) if tv != rv => {
            let tv = Some(tv);
            let by = match tl {
                Some(tl) => format!("{} loads NVSHMEM {} ({})", tl.display(), show(tv), hl.display()),
                None => format!("{no_lib}the nvidia-nvshmem wheel holds NVSHMEM {} ({})", show(tv), hl.display()),
            };
            let msg = format!("{by}; {ref_name} is NVSHMEM {rv}");
            if tl.is_some() {
                out.push(Check::fail(
                    torch_id,
                    caps::NVSHMEM,
                    format!("{msg}: {}", subject.clash),
                    torch_fix,
                ));
            } else {
                out.push(Check::warn(
                    torch_id,
                    caps::NVSHMEM,
                    format!("{msg}: {}", subject.wheel_only),
                    torch_fix,
                ));
            }
        }
        (tl, Some(hl), tv, rv) => out.push(Check::ok(
            torch_id,
            caps::NVSHMEM,
            format!(
                "{} NVSHMEM {} ({}){}",
                if tl.is_some() {
                    "torch loads".to_string()
                } else {
                    format!("{no_lib}the nvidia-nvshmem wheel holds")
                },
                show(tv),
                hl.display(),
                rv.map(|v| format!(" = {ref_name} {v}")).unwrap_or_default()
            ),
        )),
    }
}

/// Runs the DeepEP checks for the Python site directories `sites` (host paths, not empty), in
/// the order given: DeepEP's extension and its metadata, our `deepep_kernels` package, torch and
/// the nvidia-nvshmem wheel are each taken from the first site that has them. Upstream DeepEP
/// gets the `deepep.*` checks, `deepep_kernels` the `deepep-kernels.*` checks (module
/// [`kernels`]); a site with only `deepep_kernels` is not told to build upstream DeepEP.
pub fn check(
    host: &Host,
    sites: &[PathBuf],
    driver: &DriverInfo,
    checked: &NvshmemInfo,
    rdma: &RdmaInfo,
    out: &mut Vec<Check>,
) {
    let torch = torch_nvshmem(host, sites);
    let ext_path = sites.iter().find_map(|s| find_extension(host, s));
    let ours = sites.iter().find_map(|s| kernels::find(host, s));
    match (&ext_path, &ours) {
        (None, Some(pkg)) => out.push(Check::skip(
            "deepep.extension",
            caps::ALL,
            format!(
                "no upstream DeepEP build (deep_ep_cpp*.so) in {}; {} is there: see the deepep-kernels.* checks",
                list_sites(sites),
                pkg.dir.display()
            ),
        )),
        _ => check_upstream(host, sites, ext_path.as_deref(), &torch, driver, checked, rdma, out),
    }
    if let Some(pkg) = &ours {
        kernels::check(host, sites, pkg, &torch, driver, checked, out);
    }
}

/// The `deepep.*` checks of upstream DeepEP's extension at `ext_path` (`None`: not found).
#[allow(clippy::too_many_arguments)] // the host facts the checks read, one caller
fn check_upstream(
    host: &Host,
    sites: &[PathBuf],
    ext_path: Option<&Path>,
    torch: &TorchNvshmem,
    driver: &DriverInfo,
    checked: &NvshmemInfo,
    rdma: &RdmaInfo,
    out: &mut Vec<Check>,
) {
    let version = sites.iter().find_map(|s| find_version(host, s, "deep_ep-"));
    let parsed = version
        .as_ref()
        .and_then(|(raw, _)| parse_deepep_version(raw));
    let build_fix = "build DeepEP against one NVSHMEM (docs/deepep.md): eval \"$(deepep-nix env --prefix <prefix>)\" && CPATH=\"$CUDA_HOME/include/cccl\" pip install --no-build-isolation . (in the DeepEP checkout)";
    let subject = TorchSubject {
        id: "deepep.torch-nvshmem",
        build: "DeepEP's build",
        clash: "once torch has loaded its copy, deep_ep_cpp's libnvshmem_host.so.3 is that copy (same SONAME)",
        wheel_only: "harmless unless that directory comes first on LD_LIBRARY_PATH",
        fix: &deepep_torch_fix,
    };

    // deepep.extension
    let ext = match ext_path.map(|p| read_extension(host, p)) {
        None => {
            out.push(Check::fail(
                "deepep.extension",
                caps::ALL,
                format!("no deep_ep_cpp*.so in {} (nor in a deep_ep-*.egg there)", list_sites(sites)),
                format!("pass --python-site the directory holding deep_ep_cpp*.so (python3 -c 'import deep_ep_cpp; print(deep_ep_cpp.__file__)'), or {build_fix}; or use this project's deep_ep-compatible wheel deepep_kernels (docs/python.md), which needs no DeepEP build"),
            ));
            None
        }
        Some(Err(e)) => {
            out.push(Check::fail("deepep.extension", caps::ALL, e, build_fix));
            None
        }
        Some(Ok(ext)) if ext.dynamic.ident != native_ident() => {
            out.push(Check::fail(
                "deepep.extension",
                caps::ALL,
                format!(
                    "{} is {}, this host runs {}",
                    ext.path.display(),
                    ext.dynamic.ident.describe(),
                    native_ident().describe()
                ),
                build_fix,
            ));
            None
        }
        Some(Ok(ext)) => Some(ext),
    };
    let Some(ext) = ext else {
        out.push(Check::skip(
            "deepep.nvshmem",
            caps::NVSHMEM,
            "no DeepEP extension to inspect",
        ));
        torch_check(sites, torch, None, checked, &subject, out);
        for id in [
            "deepep.pairing",
            "deepep.host-limits",
            "deepep.ibgda-plugin",
            "deepep.arch",
        ] {
            out.push(Check::skip(id, caps::ALL, "no DeepEP extension to inspect"));
        }
        return;
    };
    let needed_host = ext
        .dynamic
        .needed
        .iter()
        .find(|n| n.starts_with("libnvshmem_host"))
        .cloned();
    let version_text = match (&version, &parsed) {
        (Some((raw, file)), Some(_)) => format!("DeepEP {raw} ({})", file.display()),
        (Some((raw, file)), None) => {
            format!("DeepEP version {raw:?} unparsable ({})", file.display())
        }
        (None, _) => "DeepEP version unknown (no deep_ep-*.dist-info/.egg-info metadata)".into(),
    };
    let recorded = ext.recorded.clone().ok().flatten();
    let nvshmem_text = match (&needed_host, &ext.recorded) {
        (None, _) => "built without NVSHMEM (DISABLE_NVSHMEM: intranode only)".to_string(),
        (Some(n), Ok(Some(v))) => format!("NVSHMEM {v} device library linked in, needs {n}"),
        (Some(n), Ok(None)) => format!(
            "needs {n}; the NVSHMEM device library version is not recorded (stripped symbol table)"
        ),
        (Some(n), Err(e)) => format!("needs {n}; NVSHMEM device version unreadable: {e}"),
    };
    let search = if ext.dynamic.search_path.is_empty() {
        "no RPATH/RUNPATH".to_string()
    } else {
        format!(
            "{} {}",
            if ext.dynamic.runpath {
                "RUNPATH"
            } else {
                "RPATH"
            },
            ext.dynamic.search_path.join(":")
        )
    };
    let images = if ext.images.is_empty() {
        "no GPU code found (.nv_fatbin)".to_string()
    } else {
        ext.images
            .iter()
            .map(|i| i.name())
            .collect::<Vec<_>>()
            .join(" ")
    };
    out.push(Check::ok(
        "deepep.extension",
        caps::ALL,
        format!(
            "{}: {version_text}; {nvshmem_text}; {search}; GPU code {images}",
            ext.path.display()
        ),
    ));

    // deepep.nvshmem: the host library that would load for it.
    let ext_dir = ext.path.parent().unwrap_or(Path::new("/")).to_path_buf();
    let mut loads: Option<(PathBuf, Option<Version>)> = None;
    match &needed_host {
        None => out.push(Check::fail(
            "deepep.nvshmem",
            caps::NVSHMEM,
            format!("{} was built without NVSHMEM: low-latency and internode are compiled out", ext.path.display()),
            build_fix,
        )),
        Some(name) => match elf::resolve(host, name, &ext_dir, &ext.dynamic) {
            Resolution::Missing { skipped } => out.push(Check::fail(
                "deepep.nvshmem",
                caps::NVSHMEM,
                format!(
                    "{name} not found for {} ({search}, LD_LIBRARY_PATH, system directories){}",
                    ext.path.display(),
                    if skipped.is_empty() { String::new() } else { format!(" [skipped: {}]", skipped.join("; ")) }
                ),
                format!(
                    "make the NVSHMEM it was built against{} findable: eval \"$(deepep-nix env --prefix <that prefix>)\", or rebuild: {build_fix}",
                    recorded.map(|v| format!(" ({v})")).unwrap_or_default()
                ),
            )),
            Resolution::Found(p) => {
                let hv = version_at(host, &p);
                loads = Some((p.clone(), hv));
                let also = match (&checked.lib_dir, checked.version) {
                    (Some(dir), cv) if !nvshmem::same_file(host, &dir.join(HOST_LIB), &p) => {
                        format!("; the NVSHMEM checked above is {} ({})", show(cv), dir.display())
                    }
                    _ => String::new(),
                };
                match (recorded, hv) {
                    (Some(rv), Some(hv)) if rv != hv => out.push(Check::fail(
                        "deepep.nvshmem",
                        caps::NVSHMEM,
                        format!(
                            "built with the NVSHMEM {rv} device library, but would load host library {hv} ({}){also}: NVSHMEM init aborts with \"device library version does not match\"",
                            p.display()
                        ),
                        format!("put NVSHMEM {rv} first (eval \"$(deepep-nix env --prefix <NVSHMEM {rv} prefix>)\"), or rebuild DeepEP against {}: {build_fix}", p.parent().and_then(Path::parent).unwrap_or(Path::new("/")).display()),
                    )),
                    (Some(rv), Some(_)) => out.push(Check::ok(
                        "deepep.nvshmem",
                        caps::NVSHMEM,
                        format!("loads NVSHMEM {rv} ({}) = the device library it was built with{also}", p.display()),
                    )),
                    (_, hv) => out.push(Check::ok(
                        "deepep.nvshmem",
                        caps::NVSHMEM,
                        format!("loads {} (NVSHMEM {}); the build's device version is not recorded{also}", p.display(), show(hv)),
                    )),
                }
            }
        },
    }

    torch_check(sites, torch, recorded, checked, &subject, out);

    // deepep.pairing: the known-broken pairings of pkgs/deep-ep/pairings.json.
    let pairing_id = "deepep.pairing";
    let mut in_play: Vec<(Version, String)> = Vec::new();
    if let Some(v) = recorded {
        in_play.push((v, "linked device library".into()));
    }
    if let Some((p, Some(v))) = &loads {
        in_play.push((*v, format!("host library {}", p.display())));
    }
    if let (Some(_), Some(v)) = (&torch.torch_lib, torch.version) {
        in_play.push((v, "torch's host library".into()));
    }
    // The DeepEP version as its metadata spells it.
    let raw = version.as_ref().map(|(r, _)| r.as_str()).unwrap_or("");
    match (&parsed, &needed_host, in_play.is_empty(), pairing_rules()) {
        (_, None, _, _) => out.push(Check::skip(
            pairing_id,
            caps::NVSHMEM,
            "built without NVSHMEM",
        )),
        (None, _, _, _) => out.push(Check::skip(
            pairing_id,
            caps::NVSHMEM,
            "DeepEP version unknown (no package metadata next to the extension)",
        )),
        (_, _, true, _) => out.push(Check::skip(
            pairing_id,
            caps::NVSHMEM,
            "NVSHMEM version unknown",
        )),
        (_, _, _, Err(e)) => out.push(invalid_pairings_json(pairing_id, "pairing rules", e)),
        (Some((dv, local)), Some(_), false, Ok(rules)) => {
            out.push(pairing_check(rules, raw, *dv, local.as_deref(), &in_play));
        }
    }

    // deepep.host-limits: the pairings of pkgs/deep-ep/pairings.json that fail on some hosts.
    let limits_id = "deepep.host-limits";
    match (&parsed, &needed_host, in_play.is_empty(), host_limits()) {
        (_, None, _, _) => out.push(Check::skip(limits_id, caps::NVSHMEM, "built without NVSHMEM")),
        (None, _, _, _) | (_, _, true, _) => out.push(Check::skip(
            limits_id,
            caps::NVSHMEM,
            "DeepEP or NVSHMEM version unknown (see deepep.pairing)",
        )),
        (_, _, _, Err(e)) => out.push(invalid_pairings_json(limits_id, "host limits", e)),
        (Some((dv, _)), Some(_), false, Ok(limits)) => {
            out.push(host_limit_check(limits, raw, *dv, &in_play, rdma));
        }
    }

    // deepep.ibgda-plugin: next to the host library DeepEP loads.
    ibgda_plugin_check(
        host,
        "deepep.ibgda-plugin",
        "DeepEP",
        loads.as_ref().map(|(p, _)| p.as_path()),
        out,
    );

    // deepep.arch: GPU compute capabilities vs the build's GPU code.
    let (images, source) = if !ext.images.is_empty() {
        (ext.images.clone(), "deep_ep_cpp's .nv_fatbin".to_string())
    } else if let Some(list) = host.env("TORCH_CUDA_ARCH_LIST") {
        match parse_arch_list(list) {
            Some(i) => (
                i,
                format!("TORCH_CUDA_ARCH_LIST={list} (the extension has no readable GPU code)"),
            ),
            None => (Vec::new(), String::new()),
        }
    } else {
        (Vec::new(), String::new())
    };
    arch_check(
        "deepep.arch",
        &images,
        &source,
        "the build's GPU architectures are unknown (no .nv_fatbin in the extension, TORCH_CUDA_ARCH_LIST unset)",
        driver,
        &|ccs| format!("rebuild DeepEP for these GPUs: TORCH_CUDA_ARCH_LIST=\"{ccs}\" pip install --no-build-isolation . (DeepEP's setup.py defaults to 9.0)"),
        out,
    );
}

/// `<id>` (an ibgda-plugin check): the IBGDA transport plugin next to the NVSHMEM host library
/// `loads` that `who` would load (`None`: none found).
fn ibgda_plugin_check(
    host: &Host,
    id: &str,
    who: &str,
    loads: Option<&Path>,
    out: &mut Vec<Check>,
) {
    match loads {
        None => out.push(Check::skip(
            id,
            caps::INTERNODE,
            format!("no NVSHMEM host library found for {who}"),
        )),
        Some(p) => {
            let dir = p.parent().unwrap_or(Path::new("/"));
            let plugin = host
                .list_dir(dir)
                .unwrap_or_default()
                .into_iter()
                .find(|n| n.starts_with("nvshmem_transport_ibgda.so"));
            match plugin {
                Some(f) => out.push(Check::ok(
                    id,
                    caps::INTERNODE,
                    dir.join(f).display().to_string(),
                )),
                None => out.push(Check::fail(
                    id,
                    caps::INTERNODE,
                    format!("no nvshmem_transport_ibgda.so.* in {} next to the host library {who} loads: that NVSHMEM was built without IBGDA", dir.display()),
                    format!("use an NVSHMEM with IBGDA (NVIDIA's tarball and the nvidia-nvshmem wheels ship it: deepep-nix install), or rebuild NVSHMEM from source with NVSHMEM_IBGDA_SUPPORT=1; then rebuild {who} against it"),
                )),
            }
        }
    }
}

/// `<id>` (an arch check): the GPUs' compute capabilities vs the build's GPU code `images`
/// (read from `source`); `unknown` is the skip text when `images` is empty, `fix` gets the
/// GPUs' capabilities as `9.0;10.0`.
fn arch_check(
    id: &str,
    images: &[Image],
    source: &str,
    unknown: &str,
    driver: &DriverInfo,
    fix: &dyn Fn(&str) -> String,
    out: &mut Vec<Check>,
) {
    let gpus: Vec<GpuCc> = driver
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| (i, g.model.as_str(), compute_capability(&g.model)))
        .collect();
    let known: Vec<&GpuCc> = gpus.iter().filter(|g| g.2.is_some()).collect();
    if images.is_empty() {
        out.push(Check::skip(id, caps::ALL, unknown));
    } else if known.is_empty() {
        out.push(Check::skip(
            id,
            caps::ALL,
            if gpus.is_empty() {
                "no GPU to compare with".to_string()
            } else {
                format!(
                    "compute capability of {} unknown to doctor",
                    gpus.iter().map(|g| g.1).collect::<Vec<_>>().join(", ")
                )
            },
        ));
    } else {
        let names = images
            .iter()
            .map(|i| i.name())
            .collect::<Vec<_>>()
            .join(" ");
        let describe = |g: &GpuCc| {
            let cc = g.2.expect("known");
            format!("GPU {} {} (compute capability {}.{})", g.0, g.1, cc.0, cc.1)
        };
        let bad: Vec<String> = known
            .iter()
            .filter(|g| !images.iter().any(|i| i.runs_on(g.2.expect("known"))))
            .map(|g| describe(g))
            .collect();
        if bad.is_empty() {
            out.push(Check::ok(
                id,
                caps::ALL,
                format!(
                    "{} run {names} ({source})",
                    known
                        .iter()
                        .map(|g| describe(g))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        } else {
            let mut ccs: Vec<String> = known
                .iter()
                .map(|g| {
                    let cc = g.2.expect("known");
                    format!("{}.{}", cc.0, cc.1)
                })
                .collect();
            ccs.sort();
            ccs.dedup();
            out.push(Check::fail(
                id,
                caps::ALL,
                format!(
                    "{} cannot run the build's GPU code {names} ({source})",
                    bad.join(", ")
                ),
                fix(&ccs.join(";")),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::report::Status;
    use super::*;

    #[test]
    fn images_and_compatibility() {
        assert!(Image::Cubin(9, 0).runs_on((9, 0)));
        assert!(!Image::Cubin(9, 0).runs_on((10, 0)));
        assert!(Image::Cubin(8, 0).runs_on((8, 6)));
        assert!(!Image::Cubin(8, 6).runs_on((8, 0)));
        assert!(Image::Ptx(9, 0).runs_on((10, 0)));
        assert!(!Image::Ptx(10, 0).runs_on((9, 0)));
    }

    // `fatbin(&[(kind, arch)])`: the writer `tests/doctor.rs` uses too.
    include!("../../tests/common/fatbin.rs");

    #[test]
    fn fat_binaries_are_read_and_garbage_is_survived() {
        let mut section = fatbin(&[(2, 90), (2, 100)]);
        section.extend(fatbin(&[(2, 90), (1, 100)]));
        assert_eq!(
            fatbin_images(&section),
            vec![Image::Cubin(9, 0), Image::Cubin(10, 0), Image::Ptx(10, 0)]
        );
        // Every truncation and a zero-sized entry header neither panic nor loop.
        for cut in 0..section.len() {
            let _ = fatbin_images(&section[..cut]);
        }
        let mut zero = fatbin(&[(2, 90)]);
        zero[16 + 4..16 + 8].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(fatbin_images(&zero), vec![Image::Cubin(9, 0)]);
        assert!(fatbin_images(b"no fat binary here, just text....").is_empty());
    }

    #[test]
    fn model_names_and_arch_lists() {
        assert_eq!(compute_capability("NVIDIA H200"), Some((9, 0)));
        assert_eq!(compute_capability("NVIDIA H20"), Some((9, 0)));
        assert_eq!(compute_capability("NVIDIA B200"), Some((10, 0)));
        assert_eq!(compute_capability("NVIDIA A100-SXM4-80GB"), Some((8, 0)));
        assert_eq!(compute_capability("NVIDIA A10"), Some((8, 6)));
        assert_eq!(compute_capability("NVIDIA L40S"), Some((8, 9)));
        assert_eq!(compute_capability("Tesla V100-SXM2-32GB"), Some((7, 0)));
        assert_eq!(compute_capability("unknown model"), None);
        assert_eq!(
            parse_arch_list("9.0;10.0+PTX"),
            Some(vec![
                Image::Cubin(9, 0),
                Image::Cubin(10, 0),
                Image::Ptx(10, 0)
            ])
        );
        assert_eq!(
            parse_arch_list("9.0a 10.3"),
            Some(vec![Image::Cubin(9, 0), Image::Cubin(10, 3)])
        );
        assert_eq!(parse_arch_list("Hopper"), None);
        assert_eq!(
            parse_deepep_version("1.2.1+309785a"),
            Some((Version(1, 2, 1), Some("309785a".into())))
        );
        assert_eq!(
            parse_deepep_version("1.2.1"),
            Some((Version(1, 2, 1), None))
        );
    }

    // ---- pkgs/deep-ep/pairings.json: the rules the Nix package refuses are the rules applied here.

    fn v(s: &str) -> Version {
        Version::parse(s).unwrap()
    }

    fn json() -> serde_json::Value {
        serde_json::from_str(PAIRINGS_JSON).unwrap()
    }

    fn rules_of(value: &serde_json::Value) -> Vec<Rule> {
        parse_pairings(&value.to_string()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn linked(nv: &str) -> Vec<(Version, String)> {
        vec![(v(nv), "linked device library".to_string())]
    }

    #[test]
    fn pairing_data_is_the_repositorys_file_and_parses() {
        // The embedded text is the file lib.nix reads (not a copy that could drift).
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../pkgs/deep-ep/pairings.json");
        assert_eq!(PAIRINGS_JSON, std::fs::read_to_string(path).unwrap());
        let rules = pairing_rules().as_ref().unwrap_or_else(|e| panic!("{e}"));
        // Every `broken` entry of the JSON, with its ranges and texts, is a rule here.
        let j = json();
        let entries = j["broken"].as_array().unwrap();
        assert_eq!(rules.len(), entries.len());
        let opt = |x: &serde_json::Value| x.as_str().map(v);
        for (rule, e) in rules.iter().zip(entries) {
            assert_eq!(rule.id, e["id"].as_str().unwrap());
            assert_eq!(rule.deepep.at_least, opt(&e["deepep"]["atLeast"]));
            assert_eq!(rule.deepep.at_most, opt(&e["deepep"]["atMost"]));
            assert_eq!(rule.nvshmem.at_least, opt(&e["nvshmem"]["atLeast"]));
            assert_eq!(rule.nvshmem.at_most, opt(&e["nvshmem"]["atMost"]));
            assert_eq!(rule.found, e["doctor"]["found"].as_str().unwrap());
            assert_eq!(rule.fix, e["doctor"]["fix"].as_str().unwrap());
        }
        // What they say today: DeepEP <= 1.2.1 x NVSHMEM >= 3.5.19 (RC QP layout) and DeepEP
        // 1.2.1 x NVSHMEM <= 3.3.8, both breaking low-latency and internode; from the release
        // matrix, 3.5.19-3.5.21 (no link: every mode). `hostLimits` are not rules.
        let covers = |dv: &str, nv: &str| -> Vec<&str> {
            rules
                .iter()
                .filter(|r| r.deepep.contains(v(dv)) && r.nvshmem.contains(v(nv)))
                .map(|r| r.id.as_str())
                .collect()
        };
        assert_eq!(
            covers("1.2.1", "3.5.19"),
            [
                "rc-qp-layout-3.5.19",
                "ibgda-state-defined-in-host-code-3.5"
            ]
        );
        assert_eq!(covers("1.2.1", "3.5.22"), ["rc-qp-layout-3.5.19"]);
        assert_eq!(covers("1.1.0", "3.8.0"), ["rc-qp-layout-3.5.19"]);
        assert!(covers("1.2.1", "3.5.18").is_empty());
        assert!(covers("1.2.1", "3.4.5").is_empty());
        assert!(covers("1.2.2", "3.6.5").is_empty());
        assert_eq!(covers("1.2.1", "3.3.8"), ["nvshmem-older-than-3.3.9"]);
        assert!(covers("1.2.1", "3.3.9").is_empty());
        for r in rules.iter() {
            let want: &[Capability] = match r.id.as_str() {
                "ibgda-state-defined-in-host-code-3.5" => caps::ALL,
                _ => caps::NVSHMEM,
            };
            assert_eq!(r.breaks, want, "{}", r.id);
        }
        let rc = &rules[0];
        assert_eq!(
            rc.fixed_after,
            Some(FixedAfter {
                deepep: v("1.2.1"),
                commit: "29d31c0".into(),
                builds: "builds of DeepEP's v1 branch after PR #564".into()
            })
        );
    }

    #[test]
    fn pairing_data_edit_changes_the_check() {
        // The same edit as checks/deep-ep-pure.nix `deepEpEditedJsonChangesTheRefusal`: the RC
        // rule's NVSHMEM range moved to 3.6.0 and its fix text changed, through the same parser
        // and check function the doctor uses for the embedded file.
        let before = rules_of(&json());
        let mut j = json();
        let rc = j["broken"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|r| r["id"] == "rc-qp-layout-3.5.19")
            .unwrap();
        rc["nvshmem"] = serde_json::json!({ "atLeast": "3.6.0" });
        rc["doctor"]["fix"] = "EDITED FIX".into();
        let after = rules_of(&j);
        let check =
            |rules: &[Rule], nv: &str| pairing_check(rules, "1.2.1", v("1.2.1"), None, &linked(nv));
        // 3.5.22: covered by the RC rule alone (the 3.5 link rule ends at 3.5.21, the LL rule
        // starts at 3.6.5).
        assert_eq!(check(&before, "3.5.22").status, Status::Fail);
        assert_eq!(check(&after, "3.5.22").status, Status::Ok);
        let c = check(&after, "3.6.0");
        assert_eq!(c.status, Status::Fail);
        assert_eq!(c.fix.as_deref(), Some("EDITED FIX"));
    }

    #[test]
    fn pairing_check_picks_the_newest_version_a_rule_covers() {
        let rules = rules_of(&json());
        let two = |a: &str, b: &str| {
            vec![
                (v(a), "linked device library".to_string()),
                (v(b), "torch's host library".to_string()),
            ]
        };
        let c = pairing_check(&rules, "1.2.1", v("1.2.1"), None, &two("3.4.5", "3.8.0"));
        assert!(
            c.found.starts_with(
                "DeepEP 1.2.1 with NVSHMEM 3.8.0 (torch's host library): DeepEP <= 1.2.1"
            ),
            "{}",
            c.found
        );
        // Newest (3.4.5) is fine, the older linked 3.3.8 is not.
        let c = pairing_check(&rules, "1.2.1", v("1.2.1"), None, &two("3.3.8", "3.4.5"));
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.starts_with("DeepEP 1.2.1 with NVSHMEM 3.3.8 (linked device library): DeepEP 1.2.1 supports upstream NVSHMEM 3.3.9"), "{}", c.found);
        let c = pairing_check(&rules, "1.2.1", v("1.2.1"), None, &two("3.4.5", "3.4.5"));
        assert_eq!(
            c.found,
            "DeepEP 1.2.1 with NVSHMEM 3.4.5 (linked device library): not a known-broken pairing"
        );
        // A local version label: a warning only where the rule names a later fix commit.
        let c = pairing_check(
            &rules,
            "1.2.1+abc",
            v("1.2.1"),
            Some("abc"),
            &linked("3.6.5"),
        );
        assert_eq!(c.status, Status::Warn);
        let c = pairing_check(
            &rules,
            "1.2.1+abc",
            v("1.2.1"),
            Some("abc"),
            &linked("3.3.8"),
        );
        assert_eq!(c.status, Status::Fail);
    }

    #[test]
    fn host_limits_parse_and_apply_to_hosts_without_rdma() {
        let limits = host_limits().as_ref().unwrap_or_else(|e| panic!("{e}"));
        let j = json();
        assert_eq!(limits.len(), j["hostLimits"].as_array().unwrap().len());
        let ll = &limits[0];
        assert_eq!(ll.rule.id, "ll-init-fails-without-infiniband");
        assert_eq!(ll.host, HostCondition::NoRdmaDevice);
        assert_eq!(ll.rule.breaks, caps::LOW_LATENCY);
        assert!(ll.rule.found.contains("num_rc_per_pe >= num_local_experts"));
        let none = RdmaInfo::default();
        let one = RdmaInfo {
            ports: vec![super::super::facts::Port {
                device: "mlx5_0".into(),
                port: "1".into(),
                state: "4: ACTIVE".into(),
                link_layer: "InfiniBand".into(),
                mlx5: true,
            }],
        };
        let c = |nv: &str, rdma: &RdmaInfo| {
            host_limit_check(limits, "1.2.1", v("1.2.1"), &linked(nv), rdma)
        };
        assert_eq!(c("3.6.5", &none).status, Status::Warn);
        assert_eq!(c("3.8.0", &none).needed_by, caps::LOW_LATENCY);
        assert_eq!(c("3.6.5", &one).status, Status::Ok);
        assert_eq!(c("3.4.5", &none).status, Status::Ok);
        assert_eq!(
            host_limit_check(limits, "1.2.2", v("1.2.2"), &linked("3.8.0"), &none).status,
            Status::Ok
        );
        // Errors name the problem.
        let with = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut j = json();
            edit(&mut j);
            (
                parse_host_limits(&j.to_string()),
                parse_pairings(&j.to_string()),
            )
        };
        let (e, _) = with(&|j| j["hostLimits"][0]["host"] = "no-ib".into());
        assert_eq!(
            e.unwrap_err(),
            "host limit \"ll-init-fails-without-infiniband\": unknown host \"no-ib\"; use \"no-rdma-device\""
        );
        let (e, _) = with(&|j| {
            j["hostLimits"][0].as_object_mut().unwrap().remove("host");
        });
        assert!(e.unwrap_err().contains("missing field `host`"));
        let (_, e) = with(&|j| j["broken"][0]["host"] = "no-rdma-device".into());
        assert!(e.unwrap_err().contains("`host` belongs in hostLimits"));
    }

    #[test]
    fn pairing_data_errors_name_the_problem() {
        let with = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut j = json();
            edit(&mut j["broken"][0]);
            parse_pairings(&j.to_string()).unwrap_err()
        };
        // A misspelt bound would leave the range open: refused.
        let e = with(&|r| r["nvshmem"] = serde_json::json!({ "atleast": "3.5.19" }));
        assert!(
            e.contains("unknown field `atleast`") && e.contains("atLeast"),
            "{e}"
        );
        let e = with(&|r| r["nvshmem"] = serde_json::json!({ "atLeast": "3.5" }));
        assert_eq!(
            e,
            "rule \"rc-qp-layout-3.5.19\": nvshmem.atLeast \"3.5\" is not a version X.Y.Z"
        );
        let e = with(&|r| r["deepep"] = serde_json::json!({}));
        assert!(e.contains("deepep is an empty range"), "{e}");
        let e = with(&|r| r["modes"] = serde_json::json!(["inter-node"]));
        assert!(
            e.contains("unknown mode \"inter-node\"; use \"intranode\""),
            "{e}"
        );
        let e = with(&|r| r["doctor"]["fix"] = "".into());
        assert!(
            e.contains("doctor.found and doctor.fix must not be empty"),
            "{e}"
        );
        let e = with(&|r| r["id"] = "nvshmem-older-than-3.3.9".into());
        assert!(e.contains("not unique"), "{e}");
        let e = with(&|r| {
            r.as_object_mut().unwrap().remove("doctor");
        });
        assert!(e.contains("missing field `doctor`"), "{e}");
        assert!(parse_pairings("{").is_err());
    }
}
