//! PyPI's JSON API (`GET <base>/<package>/json`) for `nvidia-nvshmem-cu12` and
//! `nvidia-nvshmem-cu13`: manylinux x86_64 and aarch64 wheels.
//!
//! The vendored snapshot under `pkgs/nvshmem/manifests/pypi/<package>.json` is a
//! *reduced* form of the API answer ([`reduce`]): same shape (`info.name`,
//! `releases.<version>[]`), only release versions (no `0.0.0a0` placeholders), only
//! manylinux x86_64/aarch64 wheels, and only the fields the lock needs (`digests.{sha256,blake2b_256}`,
//! `filename`, `packagetype`, `size`, `upload_time_iso_8601`, `url`, `yanked`), files sorted
//! by name, keys sorted. Fields that change without a release (`last_serial`, download
//! counts, `info` text) are dropped so the snapshot changes only when PyPI gains files.
//! [`parse`] reads both the raw answer and the reduced form.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};
use crate::hash::Sha256;
use crate::model::{Artifact, SourceKind, System};
use crate::nvidia::{check_date, parse_size, type_name};
use crate::version::Version;

/// Default PyPI JSON API base; the package URL is `<base>/<package>/json`.
pub const DEFAULT_PYPI_URL: &str = "https://pypi.org/pypi";

/// Canonical host of PyPI's files. Its path layout is
/// `packages/<b2[0..2]>/<b2[2..4]>/<b2[4..]>/<filename>` with `b2` the file's BLAKE2b-256.
pub const FILES_HOST: &str = "https://files.pythonhosted.org";

/// The PyPI project that ships NVSHMEM for a CUDA major.
pub fn package_name(cuda: u32) -> String {
    format!("nvidia-nvshmem-cu{cuda}")
}

/// The CUDA major of `nvidia-nvshmem-cu<N>`.
pub fn cuda_of_package(name: &str) -> Option<u32> {
    name.strip_prefix("nvidia-nvshmem-cu")?.parse().ok()
}

/// Vendored snapshot file name for a package.
pub fn snapshot_file_name(package: &str) -> String {
    format!("{package}.json")
}

/// Wheels of one package, parsed.
#[derive(Debug, Clone, Default)]
pub struct PypiPackage {
    pub artifacts: Vec<Artifact>,
    /// Earliest upload date (YYYY-MM-DD) of the locked wheels of each version.
    pub upload_dates: BTreeMap<Version, String>,
}

/// The system a wheel's platform tag targets, or `None` for wheels we do not lock
/// (non-manylinux, other architectures, pure-Python placeholders).
pub fn wheel_system(filename: &str) -> Option<System> {
    let stem = filename.strip_suffix(".whl")?;
    let plat = stem.rsplit('-').next()?;
    let tags: Vec<&str> = plat.split('.').collect();
    let all = |suffix: &str| {
        tags.iter()
            .all(|t| t.starts_with("manylinux") && t.ends_with(suffix))
    };
    if all("_x86_64") {
        Some(System::X86_64Linux)
    } else if all("_aarch64") {
        Some(System::Aarch64Linux)
    } else {
        None
    }
}

/// The canonical `files.pythonhosted.org` URL of a file. PyPI normally answers with absolute
/// URLs, which are kept. Some mirrors answer with relative ones (`../../packages/...`); these
/// are rebuilt from the BLAKE2b-256 digest after checking that the relative URL ends with the
/// same `<b2 path>/<filename>`.
fn canonical_url(
    origin: &str,
    path: &str,
    url: &str,
    filename: &str,
    blake2b: Option<&str>,
) -> Result<String> {
    if url.starts_with("https://") || url.starts_with("http://") {
        return Ok(url.to_string());
    }
    let b2 = blake2b
        .filter(|b| b.len() == 64 && b.bytes().all(|c| c.is_ascii_hexdigit()))
        .ok_or_else(|| {
            Error::upstream(
                origin,
                format!(
                    "{path}: relative url {url:?} and no blake2b_256 digest to rebuild it from"
                ),
            )
        })?;
    let tail = format!("{}/{}/{}/{}", &b2[..2], &b2[2..4], &b2[4..], filename);
    if !url.ends_with(&tail) {
        return Err(Error::upstream(
            origin,
            format!("{path}: relative url {url:?} does not end with {tail:?}"),
        ));
    }
    Ok(format!("{FILES_HOST}/packages/{tail}"))
}

fn file_field<'a>(
    origin: &str,
    path: &str,
    f: &'a Map<String, Value>,
    key: &str,
) -> Result<&'a Value> {
    f.get(key)
        .ok_or_else(|| Error::upstream(origin, format!("{path}: missing key {key:?}")))
}

fn file_str<'a>(origin: &str, path: &str, f: &'a Map<String, Value>, key: &str) -> Result<&'a str> {
    let v = file_field(origin, path, f, key)?;
    v.as_str().ok_or_else(|| {
        Error::upstream(
            origin,
            format!("{path}.{key}: expected a string, found {}", type_name(v)),
        )
    })
}

fn top_level(origin: &str, bytes: &[u8]) -> Result<Value> {
    let root: Value = crate::validate::json_document(origin, bytes, "PyPI project page")?;
    if !root.is_object() {
        return Err(Error::upstream(
            origin,
            format!(
                "(top level): expected an object, found {}",
                type_name(&root)
            ),
        ));
    }
    Ok(root)
}

fn releases<'a>(origin: &str, root: &'a Value) -> Result<&'a Map<String, Value>> {
    let r = root
        .get("releases")
        .ok_or_else(|| Error::upstream(origin, "missing key \"releases\""))?;
    r.as_object().ok_or_else(|| {
        Error::upstream(
            origin,
            format!("releases: expected an object, found {}", type_name(r)),
        )
    })
}

fn files_of<'a>(origin: &str, ver: &str, v: &'a Value) -> Result<Vec<&'a Map<String, Value>>> {
    let arr = v.as_array().ok_or_else(|| {
        Error::upstream(
            origin,
            format!(
                "releases.{ver}: expected an array of files, found {}",
                type_name(v)
            ),
        )
    })?;
    arr.iter()
        .enumerate()
        .map(|(i, f)| {
            f.as_object().ok_or_else(|| {
                Error::upstream(
                    origin,
                    format!(
                        "releases.{ver}[{i}]: expected an object, found {}",
                        type_name(f)
                    ),
                )
            })
        })
        .collect()
}

/// Parses a PyPI JSON answer (raw or reduced) for `nvidia-nvshmem-cu<cuda>`, keeping
/// non-yanked manylinux x86_64/aarch64 wheels of release versions `>= min`.
pub fn parse(origin: &str, bytes: &[u8], cuda: u32, min: &Version) -> Result<PypiPackage> {
    let root = top_level(origin, bytes)?;
    if let Some(name) = root
        .get("info")
        .and_then(|i| i.get("name"))
        .and_then(Value::as_str)
    {
        let expected = package_name(cuda);
        if name != expected {
            return Err(Error::upstream(
                origin,
                format!("info.name is {name:?}, expected {expected:?}"),
            ));
        }
    }
    let mut out = PypiPackage::default();
    let mut seen_versions: BTreeMap<Version, String> = BTreeMap::new();
    let mut seen: BTreeMap<(Version, System), String> = BTreeMap::new();
    for (ver_text, files) in releases(origin, &root)? {
        let Ok(version) = ver_text.parse::<Version>() else {
            tracing::debug!("{origin}: skipping non-release version {ver_text:?}");
            continue;
        };
        if let Some(prev) = seen_versions.insert(version.clone(), ver_text.clone()) {
            return Err(Error::Duplicate {
                key: format!("{} version {version}", package_name(cuda)),
                first: format!("{origin} releases.{prev}"),
                second: format!("{origin} releases.{ver_text}"),
            });
        }
        let files = files_of(origin, ver_text, files)?;
        if version < *min {
            continue;
        }
        for (i, f) in files.into_iter().enumerate() {
            let path = format!("releases.{ver_text}[{i}]");
            let filename = file_str(origin, &path, f, "filename")?;
            let packagetype = file_str(origin, &path, f, "packagetype")?;
            if packagetype != "bdist_wheel" {
                continue;
            }
            let Some(system) = wheel_system(filename) else {
                continue;
            };
            if f.get("yanked").and_then(Value::as_bool).unwrap_or(false) {
                tracing::info!("{origin}: skipping yanked {filename}");
                continue;
            }
            let wheel_version = filename.split('-').nth(1).unwrap_or("");
            if wheel_version.parse::<Version>().ok().as_ref() != Some(&version) {
                return Err(Error::upstream(
                    origin,
                    format!("{path}: {filename} is not a wheel of version {ver_text}"),
                ));
            }
            let digests = file_field(origin, &path, f, "digests")?;
            let digests = digests.as_object().ok_or_else(|| {
                Error::upstream(
                    origin,
                    format!(
                        "{path}.digests: expected an object, found {}",
                        type_name(digests)
                    ),
                )
            })?;
            let sha_text = file_str(origin, &format!("{path}.digests"), digests, "sha256")?;
            let sha256 = Sha256::from_hex(sha_text)
                .map_err(|e| Error::upstream(origin, format!("{path}.digests.sha256: {e}")))?;
            let size = parse_size(
                origin,
                &format!("{path}.size"),
                file_field(origin, &path, f, "size")?,
            )?;
            let url = file_str(origin, &path, f, "url")?;
            let url = canonical_url(
                origin,
                &path,
                url,
                filename,
                digests.get("blake2b_256").and_then(Value::as_str),
            )?;
            if let Some(upload) = f.get("upload_time_iso_8601").and_then(Value::as_str) {
                let date = upload.get(..10).unwrap_or(upload);
                check_date(origin, &format!("{path}.upload_time_iso_8601"), date)?;
                let entry = out
                    .upload_dates
                    .entry(version.clone())
                    .or_insert_with(|| date.to_string());
                if date < entry.as_str() {
                    *entry = date.to_string();
                }
            }
            if let Some(first) = seen.insert((version.clone(), system), filename.to_string()) {
                return Err(Error::Duplicate {
                    key: format!("{version} {system} cuda{cuda} pypi"),
                    first: format!("{origin}: {first}"),
                    second: format!("{origin}: {filename}"),
                });
            }
            let artifact = Artifact {
                version: version.clone(),
                system,
                cuda,
                source: SourceKind::Pypi,
                url,
                filename: filename.to_string(),
                sha256,
                size: Some(size),
                origin: origin.to_string(),
            };
            crate::validate::artifact(origin, &path, &artifact)?;
            out.artifacts.push(artifact);
        }
    }
    out.artifacts
        .sort_by(|a, b| (&a.version, a.system).cmp(&(&b.version, b.system)));
    Ok(out)
}

/// Reduces a PyPI JSON answer to the vendored form (see the module docs) and serialises it
/// deterministically (sorted keys, 2-space indent, trailing newline). Validates what it keeps.
pub fn reduce(origin: &str, bytes: &[u8], cuda: u32) -> Result<Vec<u8>> {
    // Full validation first (all versions), so a malformed answer never gets vendored.
    parse(origin, bytes, cuda, &"0".parse().expect("valid"))?;
    let root = top_level(origin, bytes)?;
    let mut out_releases = Map::new();
    for (ver, files) in releases(origin, &root)? {
        if ver.parse::<Version>().is_err() {
            continue; // placeholders such as 0.0.0a0
        }
        let mut kept = Vec::new();
        for (i, f) in files_of(origin, ver, files)?.into_iter().enumerate() {
            let path = format!("releases.{ver}[{i}]");
            let filename = file_str(origin, &path, f, "filename")?;
            if wheel_system(filename).is_none() {
                continue; // sdists, other platforms
            }
            let digests = f.get("digests").and_then(Value::as_object);
            let pick = |k: &str| {
                digests
                    .and_then(|d| d.get(k))
                    .cloned()
                    .unwrap_or(Value::Null)
            };
            let mut d = Map::new();
            for k in ["blake2b_256", "sha256"] {
                if !pick(k).is_null() {
                    d.insert(k.to_string(), pick(k));
                }
            }
            let url = file_str(origin, &path, f, "url")?;
            let b2 = digests
                .and_then(|d| d.get("blake2b_256"))
                .and_then(Value::as_str);
            let url = canonical_url(origin, &path, url, filename, b2)?;
            let mut entry = Map::new();
            entry.insert("digests".into(), Value::Object(d));
            entry.insert("filename".into(), json!(filename));
            for k in ["packagetype", "size", "upload_time_iso_8601", "yanked"] {
                if let Some(v) = f.get(k) {
                    entry.insert(k.to_string(), v.clone());
                }
            }
            entry.insert("url".into(), json!(url));
            kept.push(Value::Object(entry));
        }
        kept.sort_by(|a, b| a["filename"].as_str().cmp(&b["filename"].as_str()));
        out_releases.insert(ver.clone(), Value::Array(kept));
    }
    let reduced = json!({ "info": { "name": package_name(cuda) }, "releases": out_releases });
    Ok(to_canonical_json(&reduced))
}

/// Deterministic JSON bytes: keys sorted (serde_json's default map is ordered), 2-space
/// indent, trailing newline.
pub fn to_canonical_json(v: &Value) -> Vec<u8> {
    let mut s = serde_json::to_vec_pretty(v).expect("JSON values always serialise");
    s.push(b'\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_platforms() {
        let x = "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
        assert_eq!(wheel_system(x), Some(System::X86_64Linux));
        assert_eq!(
            wheel_system("nvidia_nvshmem_cu12-3.3.9-py3-none-manylinux_2_29_aarch64.whl"),
            Some(System::Aarch64Linux)
        );
        assert_eq!(
            wheel_system("nvidia_nvshmem_cu13-0.0.0a0-py2.py3-none-any.whl"),
            None
        );
        assert_eq!(wheel_system("x-1.0-py3-none-win_amd64.whl"), None);
        assert_eq!(
            wheel_system("x-1.0-py3-none-musllinux_1_2_x86_64.whl"),
            None
        );
    }

    #[test]
    fn relative_mirror_urls_are_canonicalised() {
        let b2 = "3c35a9bf80a609e74e3b000fef598933235c908fcefcef9026042b8e6dfde2a9";
        let f = "w-1-py3-none-manylinux2014_x86_64.whl";
        let rel = format!("../../packages/packages/3c/35/{}/{f}", &b2[4..]);
        let url = canonical_url("t", "p", &rel, f, Some(b2)).unwrap();
        assert_eq!(
            url,
            format!(
                "https://files.pythonhosted.org/packages/3c/35/{}/{f}",
                &b2[4..]
            )
        );
        assert!(canonical_url("t", "p", "../../elsewhere/x.whl", f, Some(b2)).is_err());
        assert!(canonical_url("t", "p", &rel, f, None).is_err());
    }
}
