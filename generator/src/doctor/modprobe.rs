//! modprobe configuration as modprobe reads it: the `*.conf` files of the modprobe.d directories
//! (name order, an earlier directory hides a later one's file of the same name), logical lines,
//! quoted words; `options nvidia ...` with `nvidia.X=Y` from the kernel command line; and whether
//! a module is configured to load at boot.

use super::host::{hp, Host};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Options for the `nvidia` module from modprobe configuration and the kernel command line.
#[derive(Debug, Default)]
pub struct ConfiguredOptions {
    /// parameter -> (value, where it was set)
    pub params: BTreeMap<String, (String, String)>,
}

/// Directories modprobe reads `*.conf` from, in priority order.
const MODPROBE_DIRS: &[&str] = &[
    "/etc/modprobe.d",
    "/run/modprobe.d",
    "/usr/local/lib/modprobe.d",
    "/usr/lib/modprobe.d",
    "/lib/modprobe.d",
];

/// Every modprobe configuration file, as (file name, host path), in the order modprobe applies
/// them (sorted by name; a name in an earlier directory hides the same name in later ones).
pub fn modprobe_files(host: &Host) -> Vec<PathBuf> {
    let mut by_name: BTreeMap<String, PathBuf> = BTreeMap::new();
    for dir in MODPROBE_DIRS {
        for name in host.list_dir(Path::new(dir)).unwrap_or_default() {
            if name.ends_with(".conf") {
                by_name
                    .entry(name.clone())
                    .or_insert_with(|| Path::new(dir).join(&name));
            }
        }
    }
    by_name.into_values().collect()
}

/// Splits a modprobe line into words, honouring double quotes (which are removed).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut any) = (false, false);
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// Logical lines of a modprobe file (comments dropped, `\` continuations joined).
fn logical_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for raw in text.lines() {
        let line = raw.trim_end();
        if let Some(body) = line.strip_suffix('\\') {
            cur.push_str(body);
            cur.push(' ');
            continue;
        }
        cur.push_str(line);
        let l = std::mem::take(&mut cur);
        if !l.trim_start().starts_with('#') && !l.trim().is_empty() {
            out.push(l);
        }
    }
    out
}

/// Collects `options nvidia ...` from modprobe files and `nvidia.X=Y` from `/proc/cmdline`.
pub fn configured_nvidia_options(host: &Host) -> ConfiguredOptions {
    let mut conf = ConfiguredOptions::default();
    for file in modprobe_files(host) {
        let Ok(text) = host.read_text(&file) else {
            continue;
        };
        for line in logical_lines(&text) {
            let w = words(&line);
            if w.len() >= 2 && w[0] == "options" && w[1].replace('-', "_") == "nvidia" {
                for kv in &w[2..] {
                    if let Some((k, v)) = kv.split_once('=') {
                        conf.params
                            .insert(k.to_string(), (v.to_string(), file.display().to_string()));
                    }
                }
            }
        }
    }
    if let Ok(cmdline) = host.read_text(&hp("/proc/cmdline")) {
        for w in words(&cmdline) {
            if let Some(kv) = w.strip_prefix("nvidia.") {
                if let Some((k, v)) = kv.split_once('=') {
                    conf.params
                        .insert(k.to_string(), (v.to_string(), "/proc/cmdline".into()));
                }
            }
        }
    }
    conf
}

/// Lists modules a host is configured to load at boot or to configure (`/etc/modules-load.d`,
/// `/etc/modules`, modprobe `options`/`install` lines): used to tell "not wanted" from "broken".
pub fn module_configured(host: &Host, module: &str) -> Option<String> {
    for dir in [
        "/etc/modules-load.d",
        "/run/modules-load.d",
        "/usr/lib/modules-load.d",
    ] {
        for name in host.list_dir(Path::new(dir)).unwrap_or_default() {
            let path = Path::new(dir).join(&name);
            let text = host.read_text(&path).unwrap_or_default();
            if text
                .lines()
                .any(|l| l.split('#').next().unwrap_or("").trim() == module)
            {
                return Some(path.display().to_string());
            }
        }
    }
    let text = host.read_text(&hp("/etc/modules")).unwrap_or_default();
    if text
        .lines()
        .any(|l| l.split('#').next().unwrap_or("").trim() == module)
    {
        return Some("/etc/modules".into());
    }
    for file in modprobe_files(host) {
        let text = host.read_text(&file).unwrap_or_default();
        for line in logical_lines(&text) {
            let w = words(&line);
            if w.len() >= 2
                && matches!(w[0].as_str(), "options" | "install" | "softdep")
                && w[1] == module
            {
                return Some(file.display().to_string());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modprobe_words_and_logical_lines() {
        assert_eq!(
            words(
                r#"options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;""#
            ),
            vec![
                "options",
                "nvidia",
                "NVreg_EnableStreamMemOPs=1",
                "NVreg_RegistryDwords=PeerMappingOverride=1;"
            ]
        );
        assert_eq!(
            logical_lines("# c\noptions nvidia \\\n  A=1\n\n"),
            vec!["options nvidia    A=1"]
        );
    }
}
