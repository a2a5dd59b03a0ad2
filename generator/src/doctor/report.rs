//! The doctor's result: one [`Check`] per finding, one [`Verdict`] per capability.

use serde::Serialize;
use std::fmt::Write as _;

/// What a user wants to run on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Capability {
    /// Intranode dispatch/combine over NVLink (CUDA IPC, no NVSHMEM).
    Intranode,
    /// Low-latency dispatch/combine over NVLink through NVSHMEM P2P.
    LowLatency,
    /// Internode over InfiniBand with GPU-initiated IBGDA (the GPU rings the NIC doorbell).
    InternodeIbgda,
    /// Internode over InfiniBand with CPU-assisted IBGDA (NVSHMEM >= 3.4.5).
    InternodeCpuIbgda,
}

impl Capability {
    pub const ALL: [Capability; 4] = [
        Capability::Intranode,
        Capability::LowLatency,
        Capability::InternodeIbgda,
        Capability::InternodeCpuIbgda,
    ];

    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Capability::Intranode => "intranode",
            Capability::LowLatency => "low-latency",
            Capability::InternodeIbgda => "internode-ibgda",
            Capability::InternodeCpuIbgda => "internode-cpu-ibgda",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Capability::Intranode => "intranode over NVLink",
            Capability::LowLatency => "low-latency over NVLink (NVSHMEM)",
            Capability::InternodeIbgda => "internode, GPU-initiated IBGDA",
            Capability::InternodeCpuIbgda => "internode, CPU-assisted IBGDA",
        }
    }
}

/// Shorthands for the capability sets checks declare.
pub mod caps {
    use super::Capability::{self, *};
    pub const ALL: &[Capability] = &[Intranode, LowLatency, InternodeIbgda, InternodeCpuIbgda];
    /// Everything that runs on NVLink between local GPUs (internode's first hop included).
    pub const NVLINK: &[Capability] = ALL;
    /// Everything that loads NVSHMEM.
    pub const NVSHMEM: &[Capability] = &[LowLatency, InternodeIbgda, InternodeCpuIbgda];
    /// Everything that crosses hosts over InfiniBand.
    pub const INTERNODE: &[Capability] = &[InternodeIbgda, InternodeCpuIbgda];
    pub const GPU_IBGDA: &[Capability] = &[InternodeIbgda];
    pub const CPU_IBGDA: &[Capability] = &[InternodeCpuIbgda];
    pub const LOW_LATENCY: &[Capability] = &[LowLatency];
    pub const INTRANODE_AND_LL: &[Capability] = &[Intranode, LowLatency];
}

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// As required.
    Ok,
    /// Works, but slower or fragile; does not block a capability.
    Warn,
    /// Blocks every capability in `needed_by`.
    Fail,
    /// Not checked (unknown input or not applicable); does not block.
    Skip,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
            Status::Skip => "skip",
        }
    }
}

/// One finding: what was checked, what was found, and how to fix it.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Stable identifier (`driver`, `params.stream-memops`, `knob.NVSHMEM_QP_DEPTH`, ...).
    pub id: String,
    pub status: Status,
    /// What was found, with the source it came from.
    pub found: String,
    /// The exact fix (NixOS option, modprobe line, command); present unless the status is ok.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// Capabilities this check matters for; a `fail` makes them not ready.
    pub needed_by: Vec<Capability>,
}

impl Check {
    pub fn new(
        id: impl Into<String>,
        needed_by: &[Capability],
        status: Status,
        found: impl Into<String>,
    ) -> Self {
        Check {
            id: id.into(),
            status,
            found: found.into(),
            fix: None,
            needed_by: needed_by.to_vec(),
        }
    }
    pub fn ok(id: impl Into<String>, needed_by: &[Capability], found: impl Into<String>) -> Self {
        Check::new(id, needed_by, Status::Ok, found)
    }
    pub fn skip(id: impl Into<String>, needed_by: &[Capability], found: impl Into<String>) -> Self {
        Check::new(id, needed_by, Status::Skip, found)
    }
    pub fn warn(
        id: impl Into<String>,
        needed_by: &[Capability],
        found: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Check::new(id, needed_by, Status::Warn, found).with_fix(fix)
    }
    pub fn fail(
        id: impl Into<String>,
        needed_by: &[Capability],
        found: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Check::new(id, needed_by, Status::Fail, found).with_fix(fix)
    }
    pub fn with_fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// Whether one capability is ready.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub capability: Capability,
    pub ready: bool,
    /// Ids of the failed checks that block it.
    pub blocked_by: Vec<String>,
    /// Ids of warnings that concern it.
    pub warnings: Vec<String>,
    /// Whether the user asked about it (`--capability`, default all).
    pub requested: bool,
}

/// Everything doctor found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The root the host was read from.
    pub root: String,
    pub checks: Vec<Check>,
    pub verdicts: Vec<Verdict>,
    /// Which IBGDA mode NVSHMEM will take on this host, in one line.
    pub ibgda: IbgdaMode,
    /// 0 when every requested capability is ready, 1 otherwise.
    pub exit_code: i32,
}

/// The IBGDA mode NVSHMEM takes on this host, from the verdicts of the two internode
/// capabilities: GPU-initiated when its checks pass; else, NVSHMEM >= 3.4.5 falls back by itself
/// to CPU-assisted IBGDA (a CPU thread rings the NIC doorbell; slower, and NVSHMEM does not say
/// so), which needs no driver options and no GDRCopy; else none.
#[derive(Debug, Clone, Serialize)]
pub struct IbgdaMode {
    /// `gpu-initiated`, `cpu-assisted` or `none`.
    pub mode: &'static str,
    /// The line the verdict prints: the mode, why, and what would change it.
    pub summary: String,
}

impl IbgdaMode {
    fn from(checks: &[Check], verdicts: &[Verdict]) -> IbgdaMode {
        let v = |cap| {
            verdicts
                .iter()
                .find(|v| v.capability == cap)
                .expect("all capabilities")
        };
        let (gpu, cpu) = (
            v(Capability::InternodeIbgda),
            v(Capability::InternodeCpuIbgda),
        );
        let status = |id: &str| checks.iter().find(|c| c.id == id).map(|c| c.status);
        let gdrcopy = match status("gdrcopy") {
            Some(Status::Ok) => "with GDRCopy (\"NIC handler will be CPU with gdrcopy backend\")",
            _ => "without GDRCopy (a little slower than with it)",
        };
        let only_gpu: Vec<&String> = gpu
            .blocked_by
            .iter()
            .filter(|id| !cpu.blocked_by.contains(id))
            .collect();
        let join = |ids: &[&String]| {
            ids.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if gpu.ready {
            let fragile: Vec<&String> = gpu
                .warnings
                .iter()
                .filter(|id| id.starts_with("params."))
                .collect();
            let change = if fragile.is_empty() {
                "it would fall back to CPU-assisted if the driver options (params.*) were lost"
                    .to_string()
            } else {
                format!("the driver options are not persistent ({}): after a reboot NVSHMEM falls back to CPU-assisted without saying so", join(&fragile))
            };
            IbgdaMode {
                mode: "gpu-initiated",
                summary: format!("GPU-initiated (the GPU rings the NIC doorbell; NVSHMEM_IB_ENABLE_IBGDA=1); {change}"),
            }
        } else if cpu.ready {
            IbgdaMode {
                mode: "cpu-assisted",
                summary: format!(
                    "CPU-assisted fallback {gdrcopy}: NVSHMEM >= 3.4.5 takes it by itself, slower, and does not say so; GPU-initiated is blocked by {}: fix {} (their fix lines above) for GPU-initiated",
                    join(&gpu.blocked_by.iter().collect::<Vec<_>>()),
                    if only_gpu.is_empty() { join(&gpu.blocked_by.iter().collect::<Vec<_>>()) } else { join(&only_gpu) }
                ),
            }
        } else {
            let mut both: Vec<&String> = gpu
                .blocked_by
                .iter()
                .filter(|id| cpu.blocked_by.contains(id))
                .collect();
            if both.is_empty() {
                both = gpu.blocked_by.iter().chain(cpu.blocked_by.iter()).collect();
                both.sort();
                both.dedup();
            }
            IbgdaMode {
                mode: "none",
                summary: format!("none: internode cannot start (GPU-initiated blocked by {}; CPU-assisted by {}); fix {} first",
                    join(&gpu.blocked_by.iter().collect::<Vec<_>>()),
                    join(&cpu.blocked_by.iter().collect::<Vec<_>>()),
                    join(&both)),
            }
        }
    }
}

impl Report {
    /// Derives verdicts and the exit code from the checks.
    pub fn new(root: String, checks: Vec<Check>, requested: &[Capability]) -> Report {
        let verdicts: Vec<Verdict> = Capability::ALL
            .iter()
            .map(|&cap| {
                let concerned = checks.iter().filter(|c| c.needed_by.contains(&cap));
                let (mut blocked_by, mut warnings) = (Vec::new(), Vec::new());
                for c in concerned {
                    match c.status {
                        Status::Fail => blocked_by.push(c.id.clone()),
                        Status::Warn => warnings.push(c.id.clone()),
                        Status::Ok | Status::Skip => {}
                    }
                }
                Verdict {
                    capability: cap,
                    ready: blocked_by.is_empty(),
                    blocked_by,
                    warnings,
                    requested: requested.contains(&cap),
                }
            })
            .collect();
        let exit_code = i32::from(verdicts.iter().any(|v| v.requested && !v.ready));
        let ibgda = IbgdaMode::from(&checks, &verdicts);
        Report {
            root,
            checks,
            verdicts,
            ibgda,
            exit_code,
        }
    }

    /// The check with this id (tests and callers).
    pub fn check(&self, id: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.id == id)
    }

    /// The verdict for a capability.
    pub fn verdict(&self, cap: Capability) -> &Verdict {
        self.verdicts
            .iter()
            .find(|v| v.capability == cap)
            .expect("all capabilities have a verdict")
    }

    /// The human-readable table.
    pub fn render_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "deepep-nix doctor: host at {}", self.root);
        let width = self.checks.iter().map(|c| c.id.len()).max().unwrap_or(0);
        for c in &self.checks {
            let _ = writeln!(s, "{:<4}  {:<width$}  {}", c.status.label(), c.id, c.found);
            if let Some(fix) = &c.fix {
                for (i, line) in fix.lines().enumerate() {
                    let lead = if i == 0 { "fix: " } else { "     " };
                    let _ = writeln!(s, "{:<4}  {:<width$}  {lead}{line}", "", "");
                }
            }
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "verdict:");
        for v in &self.verdicts {
            let state = if v.ready { "ready" } else { "NOT READY" };
            let mut line = format!(
                "  {:<20} {:<9} {}",
                v.capability.name(),
                state,
                v.capability.describe()
            );
            if !v.blocked_by.is_empty() {
                let _ = write!(line, "; blocked by {}", v.blocked_by.join(", "));
            }
            if !v.warnings.is_empty() {
                let _ = write!(line, "; warnings: {}", v.warnings.join(", "));
            }
            if !v.requested {
                line.push_str(" (not requested)");
            }
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s, "  ibgda: {}", self.ibgda.summary);
        let _ = writeln!(
            s,
            "exit {}: {}",
            self.exit_code,
            if self.exit_code == 0 {
                "every requested capability is ready"
            } else {
                "a requested capability is not ready"
            }
        );
        s
    }
}
