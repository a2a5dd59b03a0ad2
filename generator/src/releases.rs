//! `releases`: what the lock holds, per release, system and CUDA major, with gaps explained.

use serde::Serialize;

use crate::lock::{Lock, LockedArtifact, Release};
use crate::model::{SourceKind, System, CUDA_MAJORS};
use crate::version::Version;

/// One (release, system, CUDA major) cell.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Cell {
    pub system: System,
    pub cuda: u32,
    /// Sources that have a pinned artifact.
    pub sources: Vec<SourceKind>,
    /// Why a source (or everything) is missing; `None` when both sources are pinned.
    pub gap: Option<String>,
    pub artifacts: Vec<ArtifactView>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ArtifactView {
    pub source: SourceKind,
    pub filename: String,
    pub hash: String,
    pub size: Option<u64>,
    pub url: String,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    pub version: String,
    pub release_date: Option<String>,
    pub builds: Vec<Cell>,
}

/// The first version that has any artifact for a CUDA major.
fn first_with_cuda(lock: &Lock, cuda: u32) -> Option<&str> {
    let key = cuda.to_string();
    lock.releases
        .iter()
        .find(|r| r.systems.values().any(|b| b.contains_key(&key)))
        .map(|r| r.version.as_str())
}

fn cell(lock: &Lock, r: &Release, system: System, cuda: u32) -> Cell {
    let builds = r
        .systems
        .get(&system)
        .and_then(|b| b.get(&cuda.to_string()));
    let sources = builds.map(|b| b.sources()).unwrap_or_default();
    let has = |s| sources.contains(&s);
    let no_nvidia = || match &r.nvidia_manifest {
        None => format!("no NVIDIA manifest for {}", r.version),
        Some(m) => format!(
            "{} has no {} cuda{cuda} entry",
            m.rsplit('/').next().unwrap_or(m),
            system.nvidia_platform()
        ),
    };
    let gap = match (has(SourceKind::Nvidia), has(SourceKind::Pypi)) {
        (true, true) => None,
        (true, false) => Some(format!("nvidia only (no PyPI wheel for {system})")),
        (false, true) => Some(format!("pypi only ({})", no_nvidia())),
        (false, false) => Some(match first_with_cuda(lock, cuda) {
            Some(first) if first.parse::<Version>().ok() > r.version.parse::<Version>().ok() => {
                format!("none (first CUDA {cuda} build is {first})")
            }
            _ => format!("none ({}; no PyPI wheel)", no_nvidia()),
        }),
    };
    let artifacts = sources
        .iter()
        .map(|s| {
            let a: &LockedArtifact = builds.and_then(|b| b.get(*s)).expect("listed source");
            ArtifactView {
                source: *s,
                filename: a.filename.clone(),
                hash: a.hash.clone(),
                size: a.size,
                url: a.url.clone(),
            }
        })
        .collect();
    Cell {
        system,
        cuda,
        sources,
        gap,
        artifacts,
    }
}

/// Rows for every locked release, every system and CUDA major.
pub fn rows(lock: &Lock) -> Vec<Row> {
    lock.releases
        .iter()
        .map(|r| Row {
            version: r.version.clone(),
            release_date: r.release_date.clone(),
            builds: System::ALL
                .into_iter()
                .rev() // x86_64 first: the common case
                .flat_map(|s| CUDA_MAJORS.into_iter().map(move |c| (s, c)))
                .map(|(s, c)| cell(lock, r, s, c))
                .collect(),
        })
        .collect()
}

fn sources_text(c: &Cell) -> String {
    let names: Vec<&str> = c.sources.iter().map(|s| s.as_str()).collect();
    if names.is_empty() {
        "-".into()
    } else {
        names.join("+")
    }
}

/// The table: one line per release, one column per system x CUDA major, then the gaps, and
/// with `hashes` one line per artifact.
pub fn table(rows: &[Row], hashes: bool) -> String {
    let Some(first) = rows.first() else {
        return "the lock holds no releases\n".into();
    };
    let mut header = vec!["VERSION".to_string(), "DATE".to_string()];
    header.extend(
        first
            .builds
            .iter()
            .map(|c| format!("{}/cuda{}", c.system, c.cuda)),
    );
    let mut lines: Vec<Vec<String>> = vec![header];
    for r in rows {
        let mut l = vec![
            r.version.clone(),
            r.release_date.clone().unwrap_or_else(|| "unknown".into()),
        ];
        l.extend(r.builds.iter().map(sources_text));
        lines.push(l);
    }
    let widths: Vec<usize> = (0..lines[0].len())
        .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for l in &lines {
        let cells: Vec<String> = l
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    let gaps: Vec<String> = rows
        .iter()
        .flat_map(|r| {
            r.builds.iter().filter_map(move |c| {
                c.gap
                    .as_ref()
                    .map(|g| format!("  {} {} cuda{}: {g}", r.version, c.system, c.cuda))
            })
        })
        .collect();
    if !gaps.is_empty() {
        out.push_str("\ngaps:\n");
        for g in gaps {
            out.push_str(&g);
            out.push('\n');
        }
    }
    if hashes {
        out.push_str("\nartifacts:\n");
        for r in rows {
            for c in &r.builds {
                for a in &c.artifacts {
                    let size = a
                        .size
                        .map_or("size unknown".to_string(), |s| format!("{s} bytes"));
                    out.push_str(&format!(
                        "  {} {} cuda{} {:<6} {} {size} {}\n",
                        r.version,
                        c.system,
                        c.cuda,
                        a.source.as_str(),
                        a.hash,
                        a.filename
                    ));
                }
            }
        }
    }
    out
}
