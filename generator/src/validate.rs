//! The one place where strings from upstream metadata are checked before they reach a path,
//! a URL or a Nix file, shared by the NVIDIA and PyPI parsers (and the lock loader).
//!
//! Rules (see docs/generator.md, "Validation"):
//! - A file name (the lock's `filename`, used as the download name and as the `name` of
//!   `fetchurl` in `package.nix`) is 1 to 255 characters from `A-Za-z0-9._+-`, and does not
//!   start with `.` or `-`. Every NVSHMEM tarball and wheel name fits; nothing that needs
//!   quoting or percent-decoding does.
//! - A relative path (NVIDIA's `relative_path`) and the path of a URL are checked segment by
//!   segment *after percent-decoding*: no empty, `.` or `..` segment, no `/` or `\` hidden
//!   as `%2F`/`%5C`, no control characters, and no `%` left after one decoding (double
//!   encoding such as `%252e`). A relative path must not start with `/`.
//! - A URL is `http://` or `https://`, a host, and a path whose last segment is the file
//!   name; only the characters of RFC 3986 that need no quoting in Nix (no quotes, `\`,
//!   `$`, spaces) are allowed, and no query or fragment.
//! - A JSON document must not hold the same key twice in one object (serde_json would keep
//!   the last silently); the error names both lines.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::model::{Artifact, SourceKind};

/// Checks a file name; `Err` carries the reason.
pub fn file_name(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a plain file name (1-255 characters from A-Za-z0-9._+-, not starting with . or -)"
        ))
    }
}

/// Decodes `%XX` escapes once. `Err` for a `%` not followed by two hex digits or for bytes
/// that are not UTF-8.
pub fn percent_decode(s: &str) -> std::result::Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("{s:?} has a `%` that is not followed by two hex digits"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} does not percent-decode to UTF-8"))
}

/// Checks one `/`-separated segment of a path, raw and decoded.
fn segment(whole: &str, raw: &str) -> std::result::Result<String, String> {
    let decoded = percent_decode(raw)?;
    let why = if raw.is_empty() {
        Some("an empty segment (`//`)")
    } else if decoded == "." || decoded == ".." {
        Some("a `.` or `..` segment (after percent-decoding)")
    } else if decoded.contains('/') || decoded.contains('\\') {
        Some("a `/` or `\\` hidden by percent-encoding")
    } else if decoded.contains('%') {
        Some("a `%` left after percent-decoding (double encoding)")
    } else if decoded.chars().any(char::is_control) {
        Some("a control character")
    } else {
        None
    };
    match why {
        Some(w) => Err(format!("{whole:?} has {w}")),
        None => Ok(decoded),
    }
}

/// Checks a path relative to a base URL (NVIDIA's `relative_path`). Returns its decoded last
/// segment (the file name).
pub fn relative_path(rel: &str) -> std::result::Result<String, String> {
    if rel.is_empty() || rel.starts_with('/') {
        return Err(format!("{rel:?} is not a relative path"));
    }
    if let Some(c) = rel.chars().find(|c| matches!(c, '\\' | '?' | '#')) {
        return Err(format!("{rel:?} contains {c:?}"));
    }
    let mut last = String::new();
    for raw in rel.split('/') {
        last = segment(rel, raw)?;
    }
    Ok(last)
}

/// Characters allowed in a URL: RFC 3986 unreserved and the reserved ones that need no
/// quoting in a Nix string or a shell word, plus `%` for escapes.
fn url_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~:/@!&()*+,;=%".contains(&b)
}

/// Checks a download URL whose last path segment must be `filename`.
pub fn url(url: &str, filename: &str) -> std::result::Result<(), String> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| format!("{url:?} is not an http:// or https:// URL"))?;
    if let Some(c) = url.bytes().find(|b| !url_char(*b)) {
        return Err(format!(
            "{url:?} contains {:?}; URLs may hold only A-Za-z0-9 and -._~:/@!&()*+,;=% (no query, fragment, quotes, `$` or spaces)",
            c as char
        ));
    }
    let (host, path) = rest
        .split_once('/')
        .ok_or_else(|| format!("{url:?} has no path"))?;
    if host.is_empty() || host.contains('%') || host.contains('@') {
        return Err(format!("{url:?} has no plain host"));
    }
    let mut last = String::new();
    for raw in path.split('/') {
        last = segment(url, raw)?;
    }
    if last != filename {
        return Err(format!(
            "{url:?} does not end with the file name {filename:?}"
        ));
    }
    Ok(())
}

/// Checks the strings of an artifact that reach paths, URLs and the Nix data. `path` is the
/// JSON path of the entry in `origin`.
pub fn artifact(origin: &str, path: &str, a: &Artifact) -> Result<()> {
    // NVIDIA's file name and URL come from `relative_path`; PyPI's are fields of their own.
    let (name_field, url_field) = match a.source {
        SourceKind::Nvidia => (
            "relative_path (its file name)",
            "relative_path (the URL it makes)",
        ),
        SourceKind::Pypi => ("filename", "url"),
    };
    file_name(&a.filename)
        .map_err(|e| Error::upstream(origin, format!("{path}.{name_field}: {e}")))?;
    url(&a.url, &a.filename)
        .map_err(|e| Error::upstream(origin, format!("{path}.{url_field}: {e}")))
}

/// One open object or array while scanning for duplicate keys.
struct Frame {
    /// `None` for an array.
    keys: Option<HashMap<String, usize>>,
    /// The JSON path of this container.
    path: String,
    /// The key whose value comes next (objects), or the element index (arrays).
    current: String,
    index: usize,
    expect_key: bool,
}

/// `parent.child`, `parent[i]`, or `child` at the top.
fn join_path(parent: &str, child: &str) -> String {
    if parent.is_empty() || child.starts_with('[') {
        format!("{parent}{child}")
    } else {
        format!("{parent}.{child}")
    }
}

/// Parses an upstream JSON document (`what`: e.g. "manifest", for the size message): at most
/// `MAX_METADATA_BYTES`, valid JSON, no object with a key twice.
pub fn json_document(origin: &str, bytes: &[u8], what: &str) -> Result<serde_json::Value> {
    use crate::model::MAX_METADATA_BYTES;
    if bytes.len() > MAX_METADATA_BYTES {
        return Err(Error::upstream(
            origin,
            format!(
                "{} bytes is larger than any {what} ({MAX_METADATA_BYTES} bytes limit); refusing to parse",
                bytes.len()
            ),
        ));
    }
    let root = serde_json::from_slice(bytes)
        .map_err(|e| Error::upstream(origin, format!("not valid JSON: {e}")))?;
    no_duplicate_keys(origin, bytes)?;
    Ok(root)
}

/// Refuses a JSON document (already known to parse) in which one object holds the same key
/// twice, naming the key's JSON path and both lines. Keys are compared after JSON decoding,
/// so `"3.4.5"` and `"3\u002e4.5"` are the same key.
pub fn no_duplicate_keys(origin: &str, bytes: &[u8]) -> Result<()> {
    let mut stack: Vec<Frame> = Vec::new();
    let mut line = 1usize;
    let mut i = 0;
    let child_path = |stack: &[Frame]| -> String {
        stack
            .last()
            .map_or_else(String::new, |f| join_path(&f.path, &f.current))
    };
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => line += 1,
            b'{' | b'[' => {
                let path = child_path(&stack);
                let is_obj = bytes[i] == b'{';
                stack.push(Frame {
                    keys: is_obj.then(HashMap::new),
                    path,
                    current: if is_obj { String::new() } else { "[0]".into() },
                    index: 0,
                    expect_key: is_obj,
                });
            }
            b'}' | b']' => {
                stack.pop();
            }
            b',' => {
                if let Some(f) = stack.last_mut() {
                    if f.keys.is_some() {
                        f.expect_key = true;
                    } else {
                        f.index += 1;
                        f.current = format!("[{}]", f.index);
                    }
                }
            }
            b'"' => {
                let start = i;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                let raw = &bytes[start..=i.min(bytes.len() - 1)];
                if let Some(f) = stack.last_mut() {
                    if f.expect_key {
                        let key: String = serde_json::from_slice(raw).map_err(|e| {
                            Error::upstream(origin, format!("line {line}: bad key: {e}"))
                        })?;
                        f.expect_key = false;
                        let keys = f.keys.as_mut().expect("objects have keys");
                        let shown = join_path(&f.path, &key);
                        if let Some(first) = keys.get(&key) {
                            return Err(Error::Duplicate {
                                key: format!("key {shown:?}"),
                                first: format!("{origin} line {first}"),
                                second: format!("{origin} line {line}"),
                            });
                        }
                        keys.insert(key.clone(), line);
                        f.current = key;
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_checked_after_decoding() {
        assert!(relative_path("libnvshmem/linux-x86_64/a_cuda12-archive.tar.xz").is_ok());
        for bad in [
            "a/%2e%2e/b",
            "a/%2E./b",
            "a%2F..%2Fb",
            "a/%252e%252e/b",
            "a//b",
            "/a",
            "a/./b",
            "a/%zz",
            "a/b?x",
            "a\\b",
            "a/%00",
        ] {
            assert!(relative_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn urls_and_file_names() {
        let f = "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
        assert!(file_name(f).is_ok());
        assert!(url(
            &format!("https://files.pythonhosted.org/packages/3c/35/ab/{f}"),
            f
        )
        .is_ok());
        assert!(url(&format!("http://127.0.0.1:8080/files/{f}"), f).is_ok());
        for bad in ["../x.whl", ".x", "-x", "a b", "x${y}", "a\"b", ""] {
            assert!(file_name(bad).is_err(), "{bad}");
        }
        for bad in [
            format!("https://h/%2e%2e/{f}"),
            format!("ftp://h/{f}"),
            format!("https://h/x/{f}?a=1"),
            format!("https://h/${{x}}/{f}"),
            "https://h/other.whl".to_string(),
            format!("https:///{f}"),
        ] {
            assert!(url(&bad, f).is_err(), "{bad}");
        }
    }

    #[test]
    fn duplicate_keys_are_found_with_lines() {
        let ok = br#"{"a": {"b": 1, "c": [ {"b": 2}, {"b": 3} ]}, "b": "a"}"#;
        assert!(no_duplicate_keys("t", ok).is_ok());
        let dup = b"{\"a\": {\n\"x\": 1,\n\"y\": \"x\",\n\"x\": 2}}";
        let e = no_duplicate_keys("t", dup).unwrap_err().to_string();
        assert!(
            e.contains("\"a.x\"") && e.contains("t line 2") && e.contains("t line 4"),
            "{e}"
        );
        let esc = br#"{"r": {"3.4.5": [], "3\u002e4.5": []}}"#;
        assert!(no_duplicate_keys("t", esc).is_err());
        let arr = br#"{"r": [{"k": 1}, {"k": {"z": 1, "z": 2}}]}"#;
        let e = no_duplicate_keys("t", arr).unwrap_err().to_string();
        assert!(e.contains("r[1].k.z"), "{e}");
    }
}
