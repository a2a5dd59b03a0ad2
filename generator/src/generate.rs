//! `lock` and `render`: fetch (or read vendored) upstream metadata, build the lock, render
//! the Nix data, and write or check all files together.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::http::Http;
use crate::lock::{self, BuildOptions, Inputs, Lock};
use crate::model::{SourceKind, CUDA_MAJORS, MAX_METADATA_BYTES};
use crate::output::Plan;
use crate::repo::RepoPaths;
use crate::version::Version;
use crate::{nvidia, pypi, render};

/// Where upstream lives (overridable for mirrors and tests).
#[derive(Debug, Clone)]
pub struct Upstream {
    pub nvidia_url: String,
    pub pypi_url: String,
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            nvidia_url: nvidia::DEFAULT_REDIST_URL.into(),
            pypi_url: pypi::DEFAULT_PYPI_URL.into(),
        }
    }
}

/// Fetches NVIDIA's index and every manifest `>= min`. Returns file name -> raw bytes
/// (vendored verbatim). Each manifest is validated before it is accepted.
pub fn fetch_nvidia(
    http: &Http,
    up: &Upstream,
    min: &Version,
) -> Result<BTreeMap<String, Vec<u8>>> {
    let index_url = nvidia::join_url(&up.nvidia_url, "");
    let index = http.get_bytes(&index_url, MAX_METADATA_BYTES)?;
    let versions: Vec<Version> = nvidia::parse_index(&index_url, &String::from_utf8_lossy(&index))?
        .into_iter()
        .filter(|v| v >= min)
        .collect();
    if versions.is_empty() {
        return Err(Error::upstream(
            index_url,
            format!("the index lists no redistrib_<version>.json >= {min}; check --nvidia-url"),
        ));
    }
    let mut out = BTreeMap::new();
    for v in versions {
        let name = nvidia::manifest_file_name(&v);
        let url = nvidia::join_url(&up.nvidia_url, &name);
        let bytes = http.get_bytes(&url, MAX_METADATA_BYTES)?;
        nvidia::parse_manifest(&name, &bytes, &up.nvidia_url)?;
        out.insert(name, bytes);
    }
    Ok(out)
}

/// Fetches the PyPI JSON of both packages and reduces it to the vendored form.
pub fn fetch_pypi(http: &Http, up: &Upstream) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut out = BTreeMap::new();
    for cuda in CUDA_MAJORS {
        let pkg = pypi::package_name(cuda);
        let url = format!("{}/{pkg}/json", up.pypi_url.trim_end_matches('/'));
        let bytes = http.get_bytes(&url, MAX_METADATA_BYTES)?;
        out.insert(
            pypi::snapshot_file_name(&pkg),
            pypi::reduce(&url, &bytes, cuda)?,
        );
    }
    Ok(out)
}

/// Refreshes `vendored` from upstream for the `live` sources. NVIDIA manifests below `min`
/// stay as vendored; those `>= min` are replaced by what the index lists now.
pub fn refresh_inputs(
    vendored: Inputs,
    live: &[SourceKind],
    http: &Http,
    up: &Upstream,
    min: &Version,
) -> Result<Inputs> {
    let mut inputs = vendored;
    for source in live {
        match source {
            SourceKind::Nvidia => {
                let fresh = fetch_nvidia(http, up, min)?;
                inputs.nvidia.retain(|name, _| {
                    nvidia::version_from_file_name(name).is_some_and(|v| v < *min)
                });
                inputs.nvidia.extend(fresh);
            }
            SourceKind::Pypi => inputs.pypi = fetch_pypi(http, up)?,
        }
    }
    Ok(inputs)
}

/// Builds the full set of files for `inputs`: vendored manifests, lock, rendered Nix. Stale
/// vendored manifests (on disk but not in `inputs`) are deleted.
pub fn plan_lock(repo: &RepoPaths, inputs: &Inputs, opts: &BuildOptions) -> Result<(Plan, Lock)> {
    let lock = lock::build(inputs, opts)?;
    let lock_bytes = lock.to_bytes();
    let nix = render::render_releases_nix(&lock, &lock_bytes)?;
    let mut plan = Plan::default();
    for (dir, files) in [
        (repo.nvidia_dir(), &inputs.nvidia),
        (repo.pypi_dir(), &inputs.pypi),
    ] {
        for (name, bytes) in files {
            plan.write(dir.join(name), bytes.clone());
        }
        if let Ok(rd) = std::fs::read_dir(&dir) {
            let mut stale: Vec<_> = rd
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json") && !files.contains_key(n))
                .collect();
            stale.sort();
            for n in stale {
                plan.delete(dir.join(n));
            }
        }
    }
    plan.write(repo.lock(), lock_bytes);
    plan.write(repo.nix(), nix);
    Ok((plan, lock))
}

/// Plans `render`: the Nix data for the given lock bytes.
pub fn plan_render(repo: &RepoPaths, lock: &Lock, lock_bytes: &[u8]) -> Result<Plan> {
    let mut plan = Plan::default();
    plan.write(repo.nix(), render::render_releases_nix(lock, lock_bytes)?);
    Ok(plan)
}
