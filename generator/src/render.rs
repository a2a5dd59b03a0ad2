//! Renders the lock into Nix data (`pkgs/nvshmem/releases.nix`) with the tera template
//! `generator/templates/releases.nix.tera`, which is compiled into the binary.

use std::collections::HashMap;

use serde_json::Value;
use tera::{Context, Tera};

use crate::error::{Error, Result};
use crate::hash::Sha256;
use crate::lock::Lock;

const TEMPLATE_NAME: &str = "releases.nix.tera";
const TEMPLATE: &str = include_str!("../templates/releases.nix.tera");

/// A Nix literal for a JSON scalar: strings are double-quoted with `"`, `\` and `${`
/// escaped; null, booleans and integers map to themselves.
pub fn nix_literal(v: &Value) -> std::result::Result<String, String> {
    match v {
        Value::Null => Ok("null".into()),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Number(n) if n.is_u64() || n.is_i64() => Ok(n.to_string()),
        Value::String(s) => {
            let mut out = String::with_capacity(s.len() + 2);
            out.push('"');
            let mut chars = s.chars().peekable();
            while let Some(c) = chars.next() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    '$' if chars.peek() == Some(&'{') => out.push_str("\\$"),
                    c => out.push(c),
                }
            }
            out.push('"');
            Ok(out)
        }
        other => Err(format!("cannot write {other} as a Nix scalar")),
    }
}

fn nix_filter(v: &Value, _: &HashMap<String, Value>) -> tera::Result<Value> {
    nix_literal(v).map(Value::String).map_err(tera::Error::msg)
}

/// Renders `releases.nix` for a lock whose serialised bytes are `lock_bytes` (their sha256
/// goes into the header so a stale rendering is recognisable).
pub fn render_releases_nix(lock: &Lock, lock_bytes: &[u8]) -> Result<String> {
    let err = |e: tera::Error| {
        // tera nests the useful message in its source chain.
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg = format!("{msg}: {s}");
            src = s.source();
        }
        Error::Template {
            template: TEMPLATE_NAME.into(),
            msg,
        }
    };
    let mut tera = Tera::default();
    tera.autoescape_on(vec![]);
    tera.register_filter("nix", nix_filter);
    tera.add_raw_template(TEMPLATE_NAME, TEMPLATE)
        .map_err(err)?;
    let mut ctx = Context::new();
    let lock_value = serde_json::to_value(lock).expect("the lock serialises");
    ctx.insert("releases", &lock_value["releases"]);
    ctx.insert("min_version", &lock.min_version);
    ctx.insert("lock_sha256", &Sha256::of_bytes(lock_bytes).to_hex());
    let mut out = tera.render(TEMPLATE_NAME, &ctx).map_err(err)?;
    if !out.ends_with('\n') {
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nix_literals_escape() {
        assert_eq!(
            nix_literal(&json!("a\"b\\c${x}$y")).unwrap(),
            r#""a\"b\\c\${x}$y""#
        );
        assert_eq!(nix_literal(&json!(null)).unwrap(), "null");
        assert_eq!(nix_literal(&json!(190224128u64)).unwrap(), "190224128");
        assert!(nix_literal(&json!([1])).is_err());
    }
}
