//! `verify`: check files (downloaded or local) against the lock's pinned size and sha256.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::hash::Sha256;
use crate::http::Http;
use crate::lock::{Lock, LockedArtifact};
use crate::model::{SourceKind, System};
use crate::version::Version;

/// A locked artifact with its coordinates.
#[derive(Debug, Clone)]
pub struct Pinned {
    pub version: String,
    pub system: System,
    pub cuda: String,
    pub source: SourceKind,
    pub artifact: LockedArtifact,
}

impl Pinned {
    pub fn describe(&self) -> String {
        format!(
            "{} {} cuda{} {}",
            self.version, self.system, self.cuda, self.source
        )
    }
}

/// Which artifact to pick from the lock.
#[derive(Debug, Clone, Default)]
pub struct Selector {
    pub version: Option<Version>,
    pub system: Option<System>,
    pub cuda: Option<u32>,
    /// `None`: NVIDIA's tarball when pinned, else the PyPI wheel.
    pub source: Option<SourceKind>,
}

/// Every locked artifact with its coordinates, in lock order.
fn all_pinned(lock: &Lock) -> impl Iterator<Item = Pinned> + '_ {
    lock.artifacts().map(|(r, system, cuda, source, a)| Pinned {
        version: r.version.clone(),
        system,
        cuda: cuda.to_string(),
        source,
        artifact: a.clone(),
    })
}

/// All artifacts whose file name is `name`.
pub fn by_filename(lock: &Lock, name: &str) -> Vec<Pinned> {
    all_pinned(lock)
        .filter(|p| p.artifact.filename == name)
        .collect()
}

/// The flags `select` cannot do without that `sel` lacks, for one message naming all of them.
fn missing_flags(sel: &Selector) -> Vec<&'static str> {
    let mut missing = Vec::new();
    if sel.version.is_none() {
        missing.push("--version V");
    }
    if sel.cuda.is_none() {
        missing.push("--cuda 12|13");
    }
    missing
}

/// `--version V and --cuda 12|13 are required`, or `... is required` for one.
fn required(missing: &[&str]) -> String {
    format!(
        "{} {} required",
        missing.join(" and "),
        if missing.len() == 1 { "is" } else { "are" }
    )
}

/// Picks exactly one artifact. `--version` and `--cuda` are required (a missing pair is
/// named in one message); the system defaults to the host's. Errors name what is missing
/// and what exists instead.
pub fn select(lock: &Lock, sel: &Selector) -> Result<Pinned> {
    let (Some(version), Some(cuda)) = (sel.version.as_ref(), sel.cuda) else {
        return Err(Error::Usage(format!(
            "{} (`deepep-nix releases` lists what is locked)",
            required(&missing_flags(sel))
        )));
    };
    let system = match sel.system {
        Some(s) => s,
        None => System::host().ok_or_else(|| {
            Error::Usage(
                "this CPU has no NVSHMEM builds; pass --system x86_64-linux|aarch64-linux".into(),
            )
        })?,
    };
    let release = lock.release(version).ok_or_else(|| {
        let known: Vec<&str> = lock.releases.iter().map(|r| r.version.as_str()).collect();
        Error::Usage(format!(
            "NVSHMEM {version} is not in the lock; locked versions: {}",
            known.join(", ")
        ))
    })?;
    let builds = release.systems.get(&system).and_then(|s| s.get(&cuda.to_string())).ok_or_else(|| {
        Error::Usage(format!(
            "NVSHMEM {version} has no CUDA {cuda} build for {system}; `deepep-nix releases` lists what exists"
        ))
    })?;
    let source = match sel.source {
        Some(s) => s,
        None => builds
            .sources()
            .first()
            .copied()
            .expect("a locked cell has at least one source"),
    };
    let artifact = builds.get(source).ok_or_else(|| {
        let other: Vec<&str> = builds.sources().iter().map(|s| s.as_str()).collect();
        Error::Usage(format!(
            "NVSHMEM {version} {system} CUDA {cuda} has no {source} artifact in the lock; available: --source {}",
            other.join(" | ")
        ))
    })?;
    Ok(Pinned {
        version: release.version.clone(),
        system,
        cuda: cuda.to_string(),
        source,
        artifact: artifact.clone(),
    })
}

/// What an artifact's file name says about it. NVIDIA names its archives
/// `libnvshmem-<platform>-<version>_cuda<N>-archive.tar.xz`, PyPI its wheels
/// `nvidia_nvshmem_cu<N>-<version>-<python>-<abi>-<platform>.whl`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameFacts {
    /// From the extension: `.tar.xz` is NVIDIA's, `.whl` PyPI's.
    pub source: SourceKind,
    pub version: Option<Version>,
    pub cuda: Option<u32>,
    pub system: Option<System>,
}

impl NameFacts {
    /// Whether the name says which release and CUDA major it is.
    pub fn names_a_release(&self) -> bool {
        self.version.is_some() && self.cuda.is_some()
    }

    /// `3.4.6 x86_64-linux cuda13 pypi`, leaving out what the name does not say.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(v) = &self.version {
            parts.push(v.to_string());
        }
        if let Some(s) = self.system {
            parts.push(s.to_string());
        }
        if let Some(c) = self.cuda {
            parts.push(format!("cuda{c}"));
        }
        parts.push(self.source.to_string());
        parts.join(" ")
    }

    /// How many of cuda, system (when known) and source `p` differs in.
    fn distance(&self, p: &Pinned) -> usize {
        usize::from(self.cuda.map(|c| c.to_string()) != Some(p.cuda.clone()))
            + usize::from(self.system.is_some_and(|s| s != p.system))
            + usize::from(self.source != p.source)
    }
}

/// Reads the release, CUDA major, system and source from an NVIDIA tarball's or a PyPI
/// wheel's file name; `None` when the name is neither `.tar.xz` nor `.whl`. Parts the name
/// does not have in the expected shape stay `None`.
pub fn facts_from_name(name: &str) -> Option<NameFacts> {
    if let Some(stem) = name.strip_suffix(".whl") {
        let mut parts = stem.split('-');
        let dist = parts
            .next()
            .unwrap_or("")
            .replace('_', "-")
            .to_ascii_lowercase();
        return Some(NameFacts {
            source: SourceKind::Pypi,
            version: parts.next().and_then(|v| v.parse().ok()),
            cuda: crate::pypi::cuda_of_package(&dist),
            system: crate::pypi::wheel_system(name),
        });
    }
    let stem = name.strip_suffix(".tar.xz")?;
    let core = stem
        .strip_prefix("libnvshmem-")
        .and_then(|s| s.strip_suffix("-archive"));
    let (platform, version) = core
        .and_then(|c| c.rsplit_once("_cuda"))
        .and_then(|(platform_version, _)| platform_version.rsplit_once('-'))
        .unzip();
    Some(NameFacts {
        source: SourceKind::Nvidia,
        version: version.and_then(|v| v.parse().ok()),
        cuda: core.and_then(crate::nvidia::cuda_from_path),
        system: platform.and_then(|p| p.parse().ok()),
    })
}

impl Selector {
    /// The flags given that `p` does not match, as `--cuda 12` (the caller names `p`).
    fn disagreements(&self, p: &Pinned) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(v) = self
            .version
            .as_ref()
            .filter(|v| Some(*v) != p.version.parse::<Version>().ok().as_ref())
        {
            out.push(format!("--version {v}"));
        }
        if let Some(c) = self.cuda.filter(|c| c.to_string() != p.cuda) {
            out.push(format!("--cuda {c}"));
        }
        if let Some(s) = self.system.filter(|s| *s != p.system) {
            out.push(format!("--system {s}"));
        }
        if let Some(s) = self.source.filter(|s| *s != p.source) {
            out.push(format!("--source {s}"));
        }
        out
    }

    /// These flags, with what they leave open taken from `p`.
    fn or_from(&self, p: &Pinned) -> Selector {
        Selector {
            version: self.version.clone().or_else(|| p.version.parse().ok()),
            system: self.system.or(Some(p.system)),
            cuda: self.cuda.or_else(|| p.cuda.parse().ok()),
            source: self.source.or(Some(p.source)),
        }
    }
}

/// `a (b)`, `a (b), c (d)`: artifacts with their file names, for messages.
fn list(pinned: &[Pinned]) -> String {
    pinned
        .iter()
        .map(|p| format!("{} ({})", p.describe(), p.artifact.filename))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The locked artifacts nearest to what a file name says: of the same release when it is
/// locked, else of the nearest locked releases below and above; per release those that
/// differ in the fewest of CUDA major, system and source (at most four).
pub fn nearest(lock: &Lock, facts: &NameFacts) -> Vec<Pinned> {
    let Some(wanted) = facts.version.as_ref() else {
        return Vec::new();
    };
    let versions: Vec<Version> = lock
        .releases
        .iter()
        .filter_map(|r| r.version.parse().ok())
        .collect();
    let chosen: Vec<&Version> = if versions.contains(wanted) {
        vec![wanted]
    } else {
        let below = versions.iter().filter(|v| *v < wanted).max();
        let above = versions.iter().filter(|v| *v > wanted).min();
        below.into_iter().chain(above).collect()
    };
    let mut out = Vec::new();
    for v in chosen {
        let mut of_v: Vec<Pinned> = all_pinned(lock)
            .filter(|p| p.version.parse::<Version>().ok().as_ref() == Some(v))
            .collect();
        of_v.sort_by_key(|p| facts.distance(p));
        let best = of_v.first().map(|p| facts.distance(p));
        out.extend(
            of_v.into_iter()
                .take_while(|p| Some(facts.distance(p)) == best)
                .take(4),
        );
    }
    out
}

/// Which lock entry the local file `file` is (`verify --file`, `install --file`).
///
/// A file whose name the lock pins is that artifact: the flags in `sel` may only repeat what
/// the name says, and one that contradicts it is an error naming both. A name the lock does
/// not have but that says which release it is (an NVIDIA tarball's or a wheel's name) is an
/// error listing the nearest locked artifacts. Any other name (a renamed copy) needs
/// `--version` and `--cuda`; its extension gives the source (`.whl`: pypi, `.tar.xz`:
/// nvidia) unless `--source` is given, which must then agree with it.
pub fn resolve_file(lock: &Lock, sel: &Selector, file: &Path) -> Result<Pinned> {
    let shown = file.display();
    match std::fs::metadata(file) {
        Ok(m) if m.is_file() => {}
        Ok(_) => {
            return Err(Error::Usage(format!(
            "--file {shown} is not a regular file; pass the downloaded archive (.tar.xz or .whl)"
        )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::Usage(format!("--file {shown}: no such file")))
        }
        Err(e) => return Err(Error::io(file, e)),
    }
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let hits = by_filename(lock, &name);
    if !hits.is_empty() {
        let (mut agree, disagree): (Vec<Pinned>, Vec<Pinned>) = hits
            .into_iter()
            .partition(|p| sel.disagreements(p).is_empty());
        return match agree.len() {
            1 => Ok(agree.remove(0)),
            0 => {
                let p = &disagree[0];
                let flags = sel.disagreements(p);
                let (it, says, they) = if flags.len() == 1 {
                    ("it", "says", "it names")
                } else {
                    ("them", "say", "they name")
                };
                let other = select(lock, &sel.or_from(p))
                    .map(|o| format!(", or pass the file {they}: {}", o.artifact.filename))
                    .unwrap_or_default();
                Err(Error::Usage(format!(
                    "--file {name} is the lock's {} artifact, but {} {says} otherwise; \
                     leave {it} out (the file name says which release it is){other}",
                    p.describe(),
                    flags.join(" ")
                )))
            }
            n => Err(Error::Usage(format!(
                "{n} lock entries are named {name:?}: {}; pass --version/--cuda/--system/--source to pick one",
                list(&agree)
            ))),
        };
    }
    let facts = facts_from_name(&name);
    if let Some(f) = facts.as_ref().filter(|f| f.names_a_release()) {
        let near = nearest(lock, f);
        let near = if near.is_empty() {
            "none (the lock is empty)".to_string()
        } else {
            list(&near)
        };
        let newest = lock
            .releases
            .iter()
            .filter_map(|r| r.version.parse::<Version>().ok())
            .max();
        let refresh = match (&f.version, newest) {
            (Some(v), Some(n)) if *v > n => format!(
                ", or refresh the lock with `deepep-nix lock` ({v} is newer than its newest release, {n})"
            ),
            _ => String::new(),
        };
        return Err(Error::Usage(format!(
            "--file {name}: the lock has no artifact of this name (the name says {}); \
             nearest locked artifacts: {near}; use one of those{refresh}",
            f.describe()
        )));
    }
    let mut sel = sel.clone();
    if let Some(f) = &facts {
        match sel.source {
            Some(s) if s != f.source => {
                let (what, ext) = match f.source {
                    SourceKind::Pypi => ("a wheel", ".whl"),
                    SourceKind::Nvidia => ("a tarball", ".tar.xz"),
                };
                return Err(Error::Usage(format!(
                    "--source {s}, but --file {name} is {what} ({ext}), which is what --source {} pins; \
                     leave --source out (the extension says it) or pass the {s} file",
                    f.source
                )));
            }
            _ => sel.source = Some(f.source),
        }
    }
    let missing = missing_flags(&sel);
    if !missing.is_empty() {
        return Err(Error::Usage(format!(
            "--file {name}: the lock has no file of this name and the name does not say which release it is, \
             so {} (`deepep-nix releases` lists what is locked); or give the file its original name",
            required(&missing)
        )));
    }
    select(lock, &sel)
}

/// What to do with a file that fails verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMismatch {
    /// Downloaded by us: remove it.
    Delete,
    /// The user's own file (`--file`): leave it, say so.
    Keep,
}

/// Checks a file's size (when pinned) and sha256 against the lock. On mismatch the error
/// names expected and actual values; with [`OnMismatch::Delete`] the file is removed first.
pub fn check_file(path: &Path, pinned: &LockedArtifact, on_mismatch: OnMismatch) -> Result<Sha256> {
    let fail = |what: &'static str, expected: String, actual: String| {
        let disposition = match on_mismatch {
            OnMismatch::Delete => match std::fs::remove_file(path) {
                Ok(()) => "the file was deleted".to_string(),
                Err(e) => format!("deleting the file failed ({e}); delete it by hand"),
            },
            OnMismatch::Keep => "the file was left in place; do not use it".to_string(),
        };
        Error::Verify {
            file: path.to_path_buf(),
            what,
            expected,
            actual,
            disposition,
        }
    };
    let actual_size = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .len();
    if let Some(expected) = pinned.size {
        if expected != actual_size {
            return Err(fail(
                "size",
                format!("{expected} bytes"),
                format!("{actual_size} bytes"),
            ));
        }
    }
    let expected = pinned.digest()?;
    let (actual, _) = Sha256::of_file(path)?;
    if actual != expected {
        return Err(fail(
            "sha256",
            format!("{} ({})", expected.to_hex(), expected.to_sri()),
            format!("{} ({})", actual.to_hex(), actual.to_sri()),
        ));
    }
    Ok(actual)
}

/// Downloads a pinned artifact into `dest_dir/<filename>` and verifies it. A complete file
/// already there is verified and reused; a partial `<filename>.part` is resumed. Nothing
/// unverified is left under the final name; a file that fails verification is deleted.
pub fn fetch_verified(http: &Http, pinned: &Pinned, dest_dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dest_dir).map_err(|e| Error::io(dest_dir, e))?;
    let a = &pinned.artifact;
    if a.filename.contains('/') || a.filename.starts_with('.') || a.filename.is_empty() {
        return Err(Error::upstream(
            "lock",
            format!(
                "artifact file name {:?} is not a plain file name",
                a.filename
            ),
        ));
    }
    let dest = dest_dir.join(&a.filename);
    if dest.is_file() {
        match check_file(&dest, a, OnMismatch::Delete) {
            Ok(_) => {
                tracing::info!("{} already present and verified", dest.display());
                return Ok(dest);
            }
            Err(e) => tracing::warn!("{e}; downloading again"),
        }
    }
    let part = dest_dir.join(format!("{}.part", a.filename));
    http.download(&a.url, &part, a.size)?;
    check_file(&part, a, OnMismatch::Delete)?;
    std::fs::rename(&part, &dest).map_err(|e| Error::io(&dest, e))?;
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_say_release_cuda_system_and_source() {
        let f = facts_from_name("libnvshmem-linux-sbsa-3.3.20_cuda13-archive.tar.xz").unwrap();
        assert_eq!(f.describe(), "3.3.20 aarch64-linux cuda13 nvidia");
        let f = facts_from_name(
            "nvidia_nvshmem_cu12-3.3.9-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        )
        .unwrap();
        assert_eq!(f.describe(), "3.3.9 x86_64-linux cuda12 pypi");
        // A renamed copy: only the extension speaks.
        let f = facts_from_name("copy.whl").unwrap();
        assert!(!f.names_a_release());
        assert_eq!(f.describe(), "pypi");
        assert!(!facts_from_name("nvshmem.tar.xz").unwrap().names_a_release());
        assert_eq!(facts_from_name("nvshmem.zip"), None);
    }
}
