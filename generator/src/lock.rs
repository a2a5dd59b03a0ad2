//! The normalized lock `pkgs/nvshmem/releases.json`: every NVSHMEM release >= the minimum
//! version, per Nix system, per CUDA major, per source (NVIDIA tarball, PyPI wheel), with
//! URL, sha256 hex, SRI hash and size. Built only from upstream metadata; deterministic.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hash::Sha256;
use crate::model::{Artifact, SourceKind, System, CUDA_MAJORS};
use crate::version::Version;
use crate::{nvidia, pypi};

/// Bumped when the lock's shape changes.
pub const SCHEMA_VERSION: u32 = 1;

/// Raw upstream documents the lock is built from, keyed by file name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inputs {
    /// `redistrib_<version>.json` -> bytes.
    pub nvidia: BTreeMap<String, Vec<u8>>,
    /// `nvidia-nvshmem-cu<N>.json` (reduced PyPI JSON) -> bytes.
    pub pypi: BTreeMap<String, Vec<u8>>,
}

/// The lock file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Lock {
    /// Always `deepep-nix lock`: the file is generated, not hand-edited.
    pub generated_by: String,
    /// The upstream documents used, relative to `pkgs/nvshmem/manifests/`, with their sha256.
    pub inputs: Vec<LockInput>,
    pub min_version: String,
    /// Sorted by version, numerically.
    pub releases: Vec<Release>,
    pub schema_version: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockInput {
    pub path: String,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Release {
    /// `nvidia/redistrib_<version>.json` when NVIDIA's manifest for this release is vendored.
    pub nvidia_manifest: Option<String>,
    /// NVIDIA's `release_date`, else the first PyPI upload day; `None` when neither is known.
    pub release_date: Option<String>,
    pub release_date_source: Option<SourceKind>,
    /// system -> CUDA major (`"12"`, `"13"`) -> builds.
    pub systems: BTreeMap<System, BTreeMap<String, Builds>>,
    pub version: String,
}

/// The artifacts of one (release, system, CUDA major).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Builds {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvidia: Option<LockedArtifact>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pypi: Option<LockedArtifact>,
}

impl Builds {
    pub fn get(&self, source: SourceKind) -> Option<&LockedArtifact> {
        match source {
            SourceKind::Nvidia => self.nvidia.as_ref(),
            SourceKind::Pypi => self.pypi.as_ref(),
        }
    }

    fn slot(&mut self, source: SourceKind) -> &mut Option<LockedArtifact> {
        match source {
            SourceKind::Nvidia => &mut self.nvidia,
            SourceKind::Pypi => &mut self.pypi,
        }
    }

    /// Sources present, in `SourceKind::ALL` order.
    pub fn sources(&self) -> Vec<SourceKind> {
        SourceKind::ALL
            .into_iter()
            .filter(|s| self.get(*s).is_some())
            .collect()
    }
}

/// One pinned file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockedArtifact {
    pub filename: String,
    /// `tar.xz` (NVIDIA redist archive) or `wheel` (PyPI).
    pub format: String,
    /// SRI form of `sha256`, for `fetchurl { hash = ...; }`.
    pub hash: String,
    /// Lowercase hex, as upstream publishes it.
    pub sha256: String,
    /// Bytes; `None` where upstream metadata does not record it.
    pub size: Option<u64>,
    pub url: String,
}

impl LockedArtifact {
    fn from_artifact(a: &Artifact) -> LockedArtifact {
        LockedArtifact {
            filename: a.filename.clone(),
            format: match a.source {
                SourceKind::Nvidia => "tar.xz",
                SourceKind::Pypi => "wheel",
            }
            .to_string(),
            hash: a.sha256.to_sri(),
            sha256: a.sha256.to_hex(),
            size: a.size,
            url: a.url.clone(),
        }
    }

    /// The pinned digest, parsed (the lock is validated on load, so this cannot fail for a
    /// loaded lock).
    pub fn digest(&self) -> Result<Sha256> {
        Sha256::from_hex(&self.sha256)
    }
}

/// Options for building a lock.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    pub min_version: Version,
    /// Base URL that NVIDIA's `relative_path` values are appended to.
    pub nvidia_url: String,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            min_version: Version::deepep_min(),
            nvidia_url: nvidia::DEFAULT_REDIST_URL.to_string(),
        }
    }
}

/// Builds the lock from upstream documents. Every document is parsed and validated, also
/// those below the minimum version, so malformed input never passes silently.
pub fn build(inputs: &Inputs, opts: &BuildOptions) -> Result<Lock> {
    crate::version::check_min_version(&opts.min_version)?;
    let mut artifacts: BTreeMap<(Version, System, u32, SourceKind), Artifact> = BTreeMap::new();
    let mut add = |a: Artifact| -> Result<()> {
        let k = (a.version.clone(), a.system, a.cuda, a.source);
        if let Some(prev) = artifacts.get(&k) {
            return Err(Error::Duplicate {
                key: a.key(),
                first: prev.origin.clone(),
                second: a.origin.clone(),
            });
        }
        artifacts.insert(k, a);
        Ok(())
    };
    let mut nvidia_dates: BTreeMap<Version, (Option<String>, String)> = BTreeMap::new();
    // Every vendored manifest's version, also below the minimum: two files for one version
    // (`redistrib_3.9.0.json`, `redistrib_3.9.0.0.json`) are refused, naming both.
    let mut nvidia_files: BTreeMap<Version, String> = BTreeMap::new();
    let mut lock_inputs = Vec::new();

    for (name, bytes) in &inputs.nvidia {
        let origin = format!("nvidia/{name}");
        if nvidia::version_from_file_name(name).is_none() {
            return Err(Error::upstream(
                &origin,
                "unexpected file name; NVIDIA manifests are named redistrib_<version>.json",
            ));
        }
        let m = nvidia::parse_manifest(&origin, bytes, &opts.nvidia_url)?;
        if let Some(first) = nvidia_files.insert(m.version.clone(), origin.clone()) {
            return Err(Error::Duplicate {
                key: format!("NVIDIA manifest for {}", m.version),
                first,
                second: origin,
            });
        }
        if m.version < opts.min_version {
            continue;
        }
        if let Some((_, first)) = nvidia_dates.get(&m.version) {
            return Err(Error::Duplicate {
                key: format!("NVIDIA manifest for {}", m.version),
                first: first.clone(),
                second: origin,
            });
        }
        nvidia_dates.insert(m.version.clone(), (m.release_date.clone(), origin.clone()));
        lock_inputs.push(LockInput {
            path: origin,
            sha256: Sha256::of_bytes(bytes).to_hex(),
        });
        m.artifacts.into_iter().try_for_each(&mut add)?;
    }

    let mut pypi_dates: BTreeMap<Version, String> = BTreeMap::new();
    for (name, bytes) in &inputs.pypi {
        let origin = format!("pypi/{name}");
        let cuda = name
            .strip_suffix(".json")
            .and_then(pypi::cuda_of_package)
            .filter(|c| CUDA_MAJORS.contains(c))
            .ok_or_else(|| Error::upstream(&origin, "unexpected file name; PyPI snapshots are named nvidia-nvshmem-cu12.json / -cu13.json"))?;
        let pkg = pypi::parse(&origin, bytes, cuda, &opts.min_version)?;
        for (v, d) in pkg.upload_dates {
            let e = pypi_dates.entry(v).or_insert_with(|| d.clone());
            if d < *e {
                *e = d;
            }
        }
        lock_inputs.push(LockInput {
            path: origin,
            sha256: Sha256::of_bytes(bytes).to_hex(),
        });
        pkg.artifacts.into_iter().try_for_each(&mut add)?;
    }
    lock_inputs.sort_by(|a, b| a.path.cmp(&b.path));

    let mut releases: BTreeMap<Version, Release> = BTreeMap::new();
    for ((version, system, cuda, source), a) in &artifacts {
        let rel = releases.entry(version.clone()).or_insert_with(|| {
            let (nv_date, nv_file) = match nvidia_dates.get(version) {
                Some((d, f)) => (d.clone(), Some(f.clone())),
                None => (None, None),
            };
            let (release_date, release_date_source) = match (nv_date, pypi_dates.get(version)) {
                (Some(d), _) => (Some(d), Some(SourceKind::Nvidia)),
                (None, Some(d)) => (Some(d.clone()), Some(SourceKind::Pypi)),
                (None, None) => (None, None),
            };
            Release {
                nvidia_manifest: nv_file,
                release_date,
                release_date_source,
                systems: BTreeMap::new(),
                version: version.to_string(),
            }
        });
        let builds = rel
            .systems
            .entry(*system)
            .or_default()
            .entry(cuda.to_string())
            .or_default();
        *builds.slot(*source) = Some(LockedArtifact::from_artifact(a));
    }

    Ok(Lock {
        generated_by: "deepep-nix lock".to_string(),
        inputs: lock_inputs,
        min_version: opts.min_version.to_string(),
        releases: releases.into_values().collect(),
        schema_version: SCHEMA_VERSION,
    })
}

impl Lock {
    /// Deterministic bytes: struct fields in alphabetical order, maps sorted, releases in
    /// numeric version order, 2-space indent, trailing newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut s = serde_json::to_vec_pretty(self).expect("the lock always serialises");
        s.push(b'\n');
        s
    }

    /// Parses and validates a lock file (`origin` names it in errors).
    pub fn from_bytes(origin: &str, bytes: &[u8]) -> Result<Lock> {
        let lock: Lock = serde_json::from_slice(bytes).map_err(|e| {
            Error::upstream(
                origin,
                format!("not a valid lock: {e}; regenerate it with `deepep-nix lock --offline`"),
            )
        })?;
        crate::validate::no_duplicate_keys(origin, bytes)?;
        if lock.schema_version != SCHEMA_VERSION {
            return Err(Error::upstream(
                origin,
                format!("lock schema {} but this deepep-nix reads schema {SCHEMA_VERSION}; regenerate it with `deepep-nix lock --offline`", lock.schema_version),
            ));
        }
        let mut prev: Option<Version> = None;
        for r in &lock.releases {
            let v: Version = r.version.parse()?;
            if prev.as_ref().is_some_and(|p| *p >= v) {
                return Err(Error::upstream(
                    origin,
                    format!("releases are not sorted by version at {v}"),
                ));
            }
            for builds in r.systems.values() {
                for b in builds.values() {
                    for s in b.sources() {
                        let a = b.get(s).expect("listed");
                        let d = Sha256::from_hex(&a.sha256).map_err(|e| {
                            Error::upstream(origin, format!("{} {}: {e}", r.version, a.filename))
                        })?;
                        crate::validate::file_name(&a.filename)
                            .and_then(|_| crate::validate::url(&a.url, &a.filename))
                            .map_err(|e| {
                                Error::upstream(
                                    origin,
                                    format!("{} {}: {e}; regenerate the lock with `deepep-nix lock --offline`", r.version, a.filename),
                                )
                            })?;
                        if d.to_sri() != a.hash {
                            return Err(Error::upstream(
                                origin,
                                format!(
                                    "{} {}: hash {} and sha256 {} disagree (the sha256 as an SRI hash is {}): \
                                     the lock was edited by hand or damaged; restore it (`git checkout -- pkgs/nvshmem/releases.json`) \
                                     or regenerate it from the vendored manifests with `deepep-nix lock --offline`",
                                    r.version,
                                    a.filename,
                                    a.hash,
                                    a.sha256,
                                    d.to_sri()
                                ),
                            ));
                        }
                    }
                }
            }
            prev = Some(v);
        }
        Ok(lock)
    }

    /// The release with this version, if locked.
    pub fn release(&self, version: &Version) -> Option<&Release> {
        self.releases
            .iter()
            .find(|r| r.version.parse::<Version>().ok().as_ref() == Some(version))
    }

    /// All artifacts with their coordinates, in lock order.
    pub fn artifacts(
        &self,
    ) -> impl Iterator<Item = (&Release, System, &str, SourceKind, &LockedArtifact)> {
        self.releases.iter().flat_map(|r| {
            r.systems.iter().flat_map(move |(sys, builds)| {
                builds.iter().flat_map(move |(cuda, b)| {
                    b.sources()
                        .into_iter()
                        .map(move |s| (r, *sys, cuda.as_str(), s, b.get(s).expect("listed")))
                })
            })
        })
    }
}
