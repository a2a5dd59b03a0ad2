//! NVIDIA's NVSHMEM redist: the index page and `redistrib_<version>.json` manifests.
//!
//! Schema (shared by every NVIDIA redist): top level `release_date`, `release_label`,
//! `release_product`, and one object per package (NVSHMEM has `libnvshmem`). A package holds
//! string metadata, an optional `cuda_variant` list and one object per platform. With
//! `cuda_variant`, a platform maps `cuda<major>` to a leaf; without it the platform *is* the
//! leaf, or (accepted as unambiguous) maps `cuda<major>` keys to leaves. A leaf is
//! `{relative_path, sha256, md5?, size?}` with `size` a decimal string. Key order carries no
//! meaning; a key twice in one object is an error; unknown scalar keys are tolerated.

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::hash::Sha256;
use crate::model::{Artifact, SourceKind, System, CUDA_MAJORS, MAX_ARTIFACT_SIZE};
use crate::version::Version;

/// Default base of NVIDIA's NVSHMEM redist; manifests' `relative_path` is appended to it.
pub const DEFAULT_REDIST_URL: &str =
    "https://developer.download.nvidia.com/compute/nvshmem/redist/";

/// The package key inside NVSHMEM manifests.
const PACKAGE: &str = "libnvshmem";

/// Platform keys seen in NVIDIA redists that NVSHMEM does not ship for our systems; skipped.
const UNSUPPORTED_PLATFORMS: &[&str] = &[
    "linux-aarch64",
    "linux-ppc64le",
    "windows-x86_64",
    "linux-all",
    "source",
];

/// A parsed manifest: one release.
#[derive(Debug, Clone)]
pub struct Manifest {
    pub version: Version,
    pub release_date: Option<String>,
    pub artifacts: Vec<Artifact>,
}

/// `redistrib_<version>.json`.
pub fn manifest_file_name(version: &Version) -> String {
    format!("redistrib_{version}.json")
}

/// The version in a manifest file name, if it has the `redistrib_<version>.json` shape.
pub fn version_from_file_name(name: &str) -> Option<Version> {
    name.strip_prefix("redistrib_")?
        .strip_suffix(".json")?
        .parse()
        .ok()
}

/// Joins a base URL and a relative path with exactly one slash.
pub fn join_url(base: &str, rel: &str) -> String {
    format!(
        "{}/{}",
        base.trim_end_matches('/'),
        rel.trim_start_matches('/')
    )
}

/// Versions listed on the redist index page (links to `redistrib_<version>.json`), sorted.
/// Names that are not plain release versions are ignored. Two names for one version
/// (`redistrib_3.9.0.json` and `redistrib_3.9.0.0.json`) are refused, naming both: which
/// one is meant cannot be told. `origin` names the index in errors.
pub fn parse_index(origin: &str, html: &str) -> Result<Vec<Version>> {
    let mut found: std::collections::BTreeMap<Version, String> = Default::default();
    let mut rest = html;
    while let Some(pos) = rest.find("redistrib_") {
        let tail = &rest[pos + "redistrib_".len()..];
        let end = tail
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(tail.len());
        let candidate = &tail[..end];
        if let Some(ver) = candidate
            .strip_suffix('.')
            .filter(|_| tail[end..].starts_with("json"))
        {
            if let Ok(v) = ver.parse::<Version>() {
                match found.get(&v) {
                    Some(first) if first != v.as_str() => {
                        return Err(Error::Duplicate {
                            key: format!("NVSHMEM {first} in the index"),
                            first: format!("{origin} (redistrib_{first}.json)"),
                            second: format!("{origin} (redistrib_{ver}.json)"),
                        })
                    }
                    Some(_) => {}
                    None => {
                        found.insert(v, ver.to_string());
                    }
                }
            }
        }
        rest = tail;
    }
    Ok(found.into_keys().collect())
}

fn obj<'a>(origin: &str, path: &str, v: &'a Value) -> Result<&'a Map<String, Value>> {
    v.as_object().ok_or_else(|| {
        Error::upstream(
            origin,
            format!("{path}: expected an object, found {}", type_name(v)),
        )
    })
}

fn opt_str<'a>(
    origin: &str,
    path: &str,
    m: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(Error::upstream(
            origin,
            format!(
                "{path}.{key}: expected a string, found {}",
                type_name(other)
            ),
        )),
    }
}

fn req_str<'a>(origin: &str, path: &str, m: &'a Map<String, Value>, key: &str) -> Result<&'a str> {
    opt_str(origin, path, m, key)?
        .ok_or_else(|| Error::upstream(origin, format!("{path}: missing key {key:?}")))
}

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Checks `YYYY-MM-DD`.
pub(crate) fn check_date(origin: &str, path: &str, s: &str) -> Result<()> {
    let b = s.as_bytes();
    let ok = b.len() == 10
        && b[4] == b'-'
        && b[7] == b'-'
        && b.iter()
            .enumerate()
            .all(|(i, c)| i == 4 || i == 7 || c.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(Error::upstream(
            origin,
            format!("{path}: expected a date YYYY-MM-DD, found {s:?}"),
        ))
    }
}

/// Parses a size given as a decimal string (NVIDIA) or a number, bounded by
/// [`MAX_ARTIFACT_SIZE`].
pub(crate) fn parse_size(origin: &str, path: &str, v: &Value) -> Result<u64> {
    let n = match v {
        Value::String(s) => s.parse::<u64>().map_err(|_| {
            Error::upstream(
                origin,
                format!("{path}: size {s:?} is not a non-negative integer"),
            )
        })?,
        Value::Number(n) => n.as_u64().ok_or_else(|| {
            Error::upstream(
                origin,
                format!("{path}: size {n} is not a non-negative integer"),
            )
        })?,
        other => {
            return Err(Error::upstream(
                origin,
                format!(
                    "{path}: size must be a string or number, found {}",
                    type_name(other)
                ),
            ))
        }
    };
    if n > MAX_ARTIFACT_SIZE {
        return Err(Error::upstream(
            origin,
            format!("{path}: size {n} bytes exceeds the sanity limit of {MAX_ARTIFACT_SIZE} bytes; the metadata is corrupt"),
        ));
    }
    Ok(n)
}

/// Rejects relative paths that are absolute or climb out of the redist directory, also when
/// percent-encoded ([`crate::validate::relative_path`]); returns the file name.
fn check_relative_path(origin: &str, path: &str, rel: &str) -> Result<String> {
    crate::validate::relative_path(rel).map_err(|e| {
        Error::upstream(
            origin,
            format!("{path}.relative_path is not a plain relative path: {e}; it must stay below the redist base URL"),
        )
    })
}

/// The major of a `cuda<major>` key.
fn cuda_key(k: &str) -> Option<u32> {
    k.strip_prefix("cuda")
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse().ok())
}

/// The CUDA major in a redist archive name such as `..._cuda13-archive.tar.xz`.
pub(crate) fn cuda_from_path(rel: &str) -> Option<u32> {
    let pos = rel.rfind("_cuda")?;
    let digits: String = rel[pos + 5..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// Parses one manifest. `origin` names the file in error messages; when it has the
/// `redistrib_<version>.json` shape, the version inside must agree with it.
pub fn parse_manifest(origin: &str, bytes: &[u8], base_url: &str) -> Result<Manifest> {
    let root: Value = crate::validate::json_document(origin, bytes, "manifest")?;
    let top = obj(origin, "(top level)", &root)?;
    let release_date = opt_str(origin, "(top level)", top, "release_date")?.map(str::to_string);
    if let Some(d) = &release_date {
        check_date(origin, "release_date", d)?;
    }
    let label = opt_str(origin, "(top level)", top, "release_label")?;
    let pkg_value = top.get(PACKAGE).ok_or_else(|| {
        Error::upstream(
            origin,
            format!("missing key {PACKAGE:?} (the NVSHMEM package)"),
        )
    })?;
    let pkg = obj(origin, PACKAGE, pkg_value)?;
    let version_text = opt_str(origin, PACKAGE, pkg, "version")?
        .or(label)
        .ok_or_else(|| {
            Error::upstream(
                origin,
                format!("missing key {PACKAGE}.version (and no release_label)"),
            )
        })?;
    let version: Version = version_text.parse().map_err(|_| {
        Error::upstream(
            origin,
            format!("{PACKAGE}.version {version_text:?} is not a release version"),
        )
    })?;
    if let Some(file_version) = origin.rsplit('/').next().and_then(version_from_file_name) {
        if file_version != version {
            return Err(Error::upstream(
                origin,
                format!("file name says {file_version} but the manifest says {version}"),
            ));
        }
    }

    let variants: Option<Vec<u32>> = match pkg.get("cuda_variant") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .map(|i| {
                    i.as_str().and_then(|s| s.parse::<u32>().ok()).ok_or_else(|| {
                        Error::upstream(origin, format!("{PACKAGE}.cuda_variant: expected major numbers as strings, found {i}"))
                    })
                })
                .collect::<Result<_>>()?,
        ),
        Some(other) => {
            return Err(Error::upstream(origin, format!("{PACKAGE}.cuda_variant: expected an array, found {}", type_name(other))))
        }
    };

    let mut artifacts = Vec::new();
    for (key, value) in pkg {
        if !value.is_object() {
            continue; // scalar metadata: name, license, license_path, version, ...
        }
        let system = match key.parse::<System>() {
            Ok(s) if key.starts_with("linux-") => s,
            _ if UNSUPPORTED_PLATFORMS.contains(&key.as_str()) => continue,
            _ => {
                return Err(Error::upstream(
                    origin,
                    format!(
                        "{PACKAGE}.{key}: unknown platform; known are linux-x86_64, linux-sbsa (used) and {} (skipped). \
                         If NVIDIA added a platform, teach generator/src/nvidia.rs about it",
                        UNSUPPORTED_PLATFORMS.join(", ")
                    ),
                ))
            }
        };
        let plat = obj(origin, &format!("{PACKAGE}.{key}"), value)?;
        let mut leaves: Vec<(u32, String, &Map<String, Value>)> = Vec::new();
        // With `cuda_variant` the platform maps cuda<major> to leaves. Without it, a platform
        // holding `relative_path` is itself the leaf; one whose object keys are all
        // cuda<major> is read as keyed by major (unambiguous, so accepted).
        let keyed = variants.is_some()
            || (!plat.contains_key("relative_path")
                && plat.values().any(Value::is_object)
                && plat
                    .iter()
                    .filter(|(_, v)| v.is_object())
                    .all(|(k, _)| cuda_key(k).is_some()));
        if keyed {
            for (vkey, leaf) in plat {
                let path = format!("{PACKAGE}.{key}.{vkey}");
                if variants.is_none() && !leaf.is_object() {
                    continue; // scalar metadata next to the cuda<major> keys
                }
                let major = cuda_key(vkey).ok_or_else(|| {
                    Error::upstream(
                        origin,
                        format!(
                            "{path}: expected keys cuda<major> because cuda_variant is present"
                        ),
                    )
                })?;
                leaves.push((major, path.clone(), obj(origin, &path, leaf)?));
            }
        } else {
            let path = format!("{PACKAGE}.{key}");
            let rel = opt_str(origin, &path, plat, "relative_path")?.ok_or_else(|| {
                let keys: Vec<&str> = plat.keys().map(String::as_str).collect();
                Error::upstream(
                    origin,
                    format!(
                        "{path}: neither a leaf (no \"relative_path\") nor keyed by cuda<major> \
                         (no cuda12/cuda13 objects); found keys {keys:?}"
                    ),
                )
            })?;
            let major = cuda_from_path(rel).ok_or_else(|| {
                Error::upstream(origin, format!("{path}: no cuda_variant and no _cuda<major> in {rel:?}; cannot tell the CUDA major"))
            })?;
            leaves.push((major, path, plat));
        }
        for (major, path, leaf) in leaves {
            if let Some(vs) = &variants {
                if !vs.contains(&major) {
                    return Err(Error::upstream(
                        origin,
                        format!("{path}: cuda{major} is not listed in cuda_variant {vs:?}"),
                    ));
                }
            }
            if !CUDA_MAJORS.contains(&major) {
                tracing::debug!("{origin}: skipping {path} (CUDA {major} is not a target)");
                continue;
            }
            let rel = req_str(origin, &path, leaf, "relative_path")?;
            let filename = check_relative_path(origin, &path, rel)?;
            if let Some(named) = cuda_from_path(&filename).filter(|n| *n != major) {
                return Err(Error::upstream(
                    origin,
                    format!("{path}: the entry is for CUDA {major} but its archive {filename:?} is for CUDA {named}"),
                ));
            }
            let sha_text = req_str(origin, &path, leaf, "sha256")?;
            let sha256 = Sha256::from_hex(sha_text)
                .map_err(|e| Error::upstream(origin, format!("{path}.sha256: {e}")))?;
            if let Some(md5) = opt_str(origin, &path, leaf, "md5")? {
                if md5.len() != 32 || !md5.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(Error::upstream(
                        origin,
                        format!("{path}.md5 {md5:?} is not 32 hex digits"),
                    ));
                }
            }
            let size = leaf
                .get("size")
                .map(|v| parse_size(origin, &format!("{path}.size"), v))
                .transpose()?;
            let artifact = Artifact {
                version: version.clone(),
                system,
                cuda: major,
                source: SourceKind::Nvidia,
                url: join_url(base_url, rel),
                filename,
                sha256,
                size,
                origin: origin.to_string(),
            };
            crate::validate::artifact(origin, &path, &artifact)?;
            artifacts.push(artifact);
        }
    }
    artifacts.sort_by_key(|a| (a.system, a.cuda));
    Ok(Manifest {
        version,
        release_date,
        artifacts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_lists_manifest_versions() {
        let html = r#"<a href="redistrib_3.3.9.json">redistrib_3.3.9.json</a>
            <a href='redistrib_3.10.1.json'>x</a> redistrib_latest.json <a href="redistrib_3.4.5_tar.json">"#;
        let vs: Vec<String> = parse_index("index", html)
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(vs, ["3.3.9", "3.10.1"]);
        let twice =
            r#"<a href="redistrib_3.9.0.json">redistrib_3.9.0.json</a> redistrib_3.9.0.0.json"#;
        let e = parse_index("index", twice).unwrap_err().to_string();
        assert!(
            e.contains("redistrib_3.9.0.json") && e.contains("redistrib_3.9.0.0.json"),
            "{e}"
        );
    }

    #[test]
    fn cuda_major_from_archive_name() {
        assert_eq!(
            cuda_from_path(
                "libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.3.9_cuda12-archive.tar.xz"
            ),
            Some(12)
        );
        assert_eq!(cuda_from_path("libnvshmem-3.3.9-archive.tar.xz"), None);
    }
}
