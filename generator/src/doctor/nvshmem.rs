//! NVSHMEM checks: where the library is, its version (read from the files, never by loading
//! it), host/device/header agreement, the version our kernels were built against, what the
//! loader would pick by bare name, and whether the bootstrap/transport plugins can load.

use super::elf::{self, native_ident, DynInfo, ElfIdent, Resolution};
pub use super::facts::{NvshmemInfo, Version};
use super::host::{Host, ReadError};
use super::report::{caps, Capability, Check};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// DeepEP's minimum NVSHMEM.
pub const MIN_VERSION: Version = Version(3, 3, 9);
/// First NVSHMEM with CPU-assisted IBGDA (no driver regkeys, no GDRCopy needed).
pub const CPU_IBGDA_VERSION: Version = Version(3, 4, 5);
/// File name of the host library (SONAME).
pub const HOST_LIB: &str = "libnvshmem_host.so.3";
/// Marker printed by the host library at start-up; followed by the version.
const BANNER: &[u8] = b"NVSHMEM v";
/// Local symbol in `libnvshmem_device.a` holding {major, minor, patch} as three 32-bit ints.
const DEVICE_VERSION_SYMBOL: &str = "_ZL27nvshmemi_device_lib_version";

/// Inputs of the NVSHMEM checks that come from the command line.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// `--nvshmem-dir` (host path).
    pub dir: Option<PathBuf>,
    /// `--kernels-nvshmem-version`.
    pub kernels_version: Option<Version>,
}

const INSTALL_FIX: &str = "point NVSHMEM_DIR at an NVSHMEM prefix containing lib/libnvshmem_host.so.3: `nix develop` sets it; without Nix: deepep-nix install --version 3.4.5 --cuda 13 --source pypi --prefix /opt/nvshmem-3.4.5 && eval \"$(deepep-nix env --prefix /opt/nvshmem-3.4.5)\"";

/// Runs every NVSHMEM check.
pub fn check(host: &Host, settings: &Settings, out: &mut Vec<Check>) -> NvshmemInfo {
    let mut info = NvshmemInfo::default();
    let Some((lib_dir, source)) = locate(host, settings, out) else {
        for id in [
            "nvshmem.host-library",
            "nvshmem.device-library",
            "nvshmem.kernels",
            "nvshmem.loader",
            "nvshmem.plugin.bootstrap",
            "nvshmem.plugin.ibgda",
            "nvshmem.plugins",
        ] {
            out.push(Check::skip(
                id,
                caps::NVSHMEM,
                "no NVSHMEM host library to inspect",
            ));
        }
        return info;
    };
    let lib_path = lib_dir.join(HOST_LIB);
    info.lib_dir = Some(lib_dir.clone());

    // Host library: ELF identity and version banner.
    let host_bytes = host.read_bytes(&lib_path, elf::LIB_CAP);
    let host_version = match &host_bytes {
        Err(e) => {
            out.push(Check::fail(
                "nvshmem.host-library",
                caps::NVSHMEM,
                format!("{} {e}", lib_path.display()),
                INSTALL_FIX,
            ));
            None
        }
        Ok(bytes) => host_library(&lib_path, bytes, source, &mut info, out),
    };
    info.version = host_version;

    device_library(host, &lib_dir, host_version, out);
    kernels(host, settings, host_version, out);
    loader(host, &lib_path, host_version, out);
    plugins(host, &lib_dir, &mut info, out);
    if let (Ok(bytes), Some(_)) = (&host_bytes, host_version) {
        info.unknown_env = unknown_variables(host, bytes, &info.plugins);
    }
    info
}

/// Variables named NVSHMEM_* that only build tools read (never the runtime library).
const BUILD_TIME_VARIABLES: &[&str] = &["NVSHMEM_DIR", "NVSHMEM_HOME", "NVSHMEM_PREFIX"];

/// `NVSHMEM_*` variables of the environment that neither the host library nor any plugin
/// mentions. NVSHMEM stores its variable names as NUL-terminated strings, without the prefix in
/// the host library (`CUMEM_GRANULARITY`) and with or without it in plugins; a name found in
/// none of them is not read by this NVSHMEM (usually a typo).
fn unknown_variables(host: &Host, host_lib: &[u8], plugins: &[PathBuf]) -> Vec<String> {
    let names: Vec<&String> = host
        .env_map()
        .keys()
        .filter(|k| k.starts_with("NVSHMEM_") && !BUILD_TIME_VARIABLES.contains(&k.as_str()))
        .collect();
    if names.is_empty() {
        return Vec::new();
    }
    let plugin_bytes: Vec<Vec<u8>> = plugins
        .iter()
        .filter_map(|p| host.read_bytes(p, elf::LIB_CAP).ok())
        .collect();
    let blobs: Vec<&[u8]> = std::iter::once(host_lib)
        .chain(plugin_bytes.iter().map(Vec::as_slice))
        .collect();
    let mentioned = |needle: &str| {
        let pattern = [b"\0".as_slice(), needle.as_bytes(), b"\0"].concat();
        blobs.iter().any(|b| find(b, &pattern).is_some())
    };
    names
        .into_iter()
        .filter(|n| !mentioned(n) && !mentioned(&n["NVSHMEM_".len()..]))
        .cloned()
        .collect()
}

/// Finds the library directory: `--nvshmem-dir`, else `NVSHMEM_DIR`, else the loader path.
fn locate(host: &Host, settings: &Settings, out: &mut Vec<Check>) -> Option<(PathBuf, String)> {
    let (prefix, source) = match (
        &settings.dir,
        host.env("NVSHMEM_DIR").filter(|v| !v.is_empty()),
    ) {
        (Some(d), _) => (d.clone(), "--nvshmem-dir".to_string()),
        (None, Some(e)) => {
            if let Some(first) = fish_eval_garbage(e) {
                out.push(Check::fail(
                    "nvshmem.dir",
                    caps::NVSHMEM,
                    format!(
                        "NVSHMEM_DIR holds several words ({:?}): the output of `deepep-nix env --shell fish` went through fish's \
                         `eval (...)`, which joins its lines into one `set`",
                        e.chars().take(80).collect::<String>()
                    ),
                    format!(
                        "set -e NVSHMEM_DIR; deepep-nix env --prefix {first} --shell fish | source (and open a new fish for a clean LD_LIBRARY_PATH and PATH)"
                    ),
                ));
                return None;
            }
            if !e.starts_with('/') {
                out.push(Check::fail(
                    "nvshmem.dir",
                    caps::NVSHMEM,
                    format!("NVSHMEM_DIR={e} is not an absolute path"),
                    "export NVSHMEM_DIR as an absolute path (export NVSHMEM_DIR=$(realpath <prefix>))",
                ));
                return None;
            }
            (PathBuf::from(e), "NVSHMEM_DIR".to_string())
        }
        (None, None) => {
            let pseudo = DynInfo::bare(native_ident());
            return match elf::resolve(host, HOST_LIB, Path::new("/"), &pseudo) {
                Resolution::Found(p) => {
                    let dir = p.parent().map(Path::to_path_buf).unwrap_or_default();
                    out.push(Check::ok(
                        "nvshmem.dir",
                        caps::NVSHMEM,
                        format!(
                            "NVSHMEM_DIR not set; {HOST_LIB} found on the loader path in {}",
                            dir.display()
                        ),
                    ));
                    Some((dir, "the loader path".into()))
                }
                Resolution::Missing { .. } => {
                    out.push(Check::fail(
                        "nvshmem.dir",
                        caps::NVSHMEM,
                        format!("NVSHMEM_DIR is not set and {HOST_LIB} is not on the loader path (LD_LIBRARY_PATH, /etc/ld.so.conf, system directories)"),
                        INSTALL_FIX,
                    ));
                    None
                }
            };
        }
    };
    let lib_dir = prefix.join("lib");
    if host.exists(&lib_dir.join(HOST_LIB)) {
        out.push(Check::ok(
            "nvshmem.dir",
            caps::NVSHMEM,
            format!("{} (from {source})", prefix.display()),
        ));
        return Some((lib_dir, source));
    }
    let found = if host.exists(&prefix.join(HOST_LIB)) {
        let parent = prefix
            .parent()
            .unwrap_or(Path::new("/"))
            .display()
            .to_string();
        out.push(Check::fail(
            "nvshmem.dir",
            caps::NVSHMEM,
            format!("{} (from {source}) is the lib/ directory itself; NVSHMEM_DIR must be the prefix above it", prefix.display()),
            format!("export NVSHMEM_DIR={parent}"),
        ));
        return None;
    } else if !host.exists(&prefix) {
        format!("{} (from {source}) does not exist", prefix.display())
    } else {
        format!("{} (from {source}) has no lib/{HOST_LIB}", prefix.display())
    };
    out.push(Check::fail(
        "nvshmem.dir",
        caps::NVSHMEM,
        found,
        INSTALL_FIX,
    ));
    None
}

/// `NVSHMEM_DIR` as fish leaves it after `eval (deepep-nix env --prefix P --shell fish)`: fish
/// joins the three lines into one `set -gx NVSHMEM_DIR 'P' set -gx LD_LIBRARY_PATH ...` and
/// exports the list joined with spaces. Returns P (the first word) for such a value.
fn fish_eval_garbage(value: &str) -> Option<&str> {
    let mut words = value.split_whitespace();
    let first = words.next()?;
    let rest: Vec<&str> = words.collect();
    (rest.first() == Some(&"set") && rest.contains(&"LD_LIBRARY_PATH")).then_some(first)
}

/// All distinct `NVSHMEM vX.Y.Z` banners in a file.
pub fn banner_versions(bytes: &[u8]) -> Vec<Version> {
    let mut found = Vec::new();
    let mut i = 0;
    while let Some(pos) = find(&bytes[i..], BANNER) {
        let start = i + pos + BANNER.len();
        let end = bytes[start..]
            .iter()
            .position(|b| !(b.is_ascii_digit() || *b == b'.'))
            .map_or(bytes.len(), |p| start + p);
        // The banner is a C string: the version must end at a NUL.
        if bytes.get(end) == Some(&0) {
            if let Some(v) = std::str::from_utf8(&bytes[start..end])
                .ok()
                .and_then(Version::parse)
            {
                if !found.contains(&v) {
                    found.push(v);
                }
            }
        }
        i = start;
    }
    found
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let first = needle[0];
    let mut i = 0;
    while i + needle.len() <= hay.len() {
        match hay[i..].iter().position(|&b| b == first) {
            None => return None,
            Some(p) => {
                i += p;
                if hay[i..].starts_with(needle) {
                    return Some(i);
                }
                i += 1;
            }
        }
    }
    None
}

fn host_library(
    lib: &Path,
    bytes: &[u8],
    source: String,
    info: &mut NvshmemInfo,
    out: &mut Vec<Check>,
) -> Option<Version> {
    let id = "nvshmem.host-library";
    // Not a usable host library: a failed check with the fix, and nothing more to read from it.
    let refuse = |out: &mut Vec<Check>, found: String, fix: &str| {
        out.push(Check::fail(id, caps::NVSHMEM, found, fix));
        None
    };
    let dynamic = match elf::parse_dyn(bytes) {
        Ok(d) => d,
        Err(e) => return refuse(out, format!("{}: {e}", lib.display()), INSTALL_FIX),
    };
    info.ident = Some(dynamic.ident);
    info.host_dyn = Some(dynamic.clone());
    if dynamic.ident != native_ident() {
        let found = format!(
            "{} is {}, this host runs {}",
            lib.display(),
            dynamic.ident.describe(),
            native_ident().describe()
        );
        return refuse(
            out,
            found,
            "install the NVSHMEM build for this architecture (x86_64-linux or aarch64-linux/sbsa)",
        );
    }
    let version = match banner_versions(bytes).as_slice() {
        [v] => *v,
        [] => {
            let found = format!("{}: no \"NVSHMEM vX.Y.Z\" version banner; not an NVSHMEM host library or a damaged copy", lib.display());
            return refuse(out, found, INSTALL_FIX);
        }
        many => {
            let list = many
                .iter()
                .map(Version::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            let found = format!(
                "{}: several version banners ({list}); cannot tell which release this is",
                lib.display()
            );
            return refuse(out, found, INSTALL_FIX);
        }
    };
    if version < MIN_VERSION {
        out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!("NVSHMEM {version} ({}); DeepEP-style kernels need >= {MIN_VERSION}", lib.display()),
            "use NVSHMEM 3.4.5 (the flake's default nvshmem package, or deepep-nix install --version 3.4.5 --cuda 13 --source pypi --prefix /opt/nvshmem-3.4.5) and rebuild the kernels against it",
        ));
        return Some(version);
    }
    out.push(Check::ok(
        id,
        caps::NVSHMEM,
        format!(
            "NVSHMEM {version} ({}, {}, via {source})",
            lib.display(),
            dynamic.ident.describe()
        ),
    ));
    let cpu = "nvshmem.cpu-assisted-ibgda";
    if version >= CPU_IBGDA_VERSION {
        out.push(Check::ok(
            cpu,
            caps::CPU_IBGDA,
            format!("NVSHMEM {version} >= {CPU_IBGDA_VERSION} has CPU-assisted IBGDA"),
        ));
    } else {
        out.push(Check::fail(
            cpu,
            caps::CPU_IBGDA,
            format!("NVSHMEM {version} < {CPU_IBGDA_VERSION}: no CPU-assisted IBGDA (GPU-initiated only)"),
            "use NVSHMEM >= 3.4.5, or enable GPU-initiated IBGDA (driver options, see params.*)",
        ));
    }
    Some(version)
}

/// `#define NVSHMEM_VENDOR_{MAJOR,MINOR,PATCH}_VERSION n` from `nvshmem_version.h`.
pub fn header_version(text: &str) -> Option<Version> {
    let mut defs = BTreeMap::new();
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() >= 3 && w[0] == "#define" {
            defs.insert(w[1], w[2]);
        }
    }
    let get = |k: &str| defs.get(k).and_then(|v| v.parse::<u32>().ok());
    Some(Version(
        get("NVSHMEM_VENDOR_MAJOR_VERSION")?,
        get("NVSHMEM_VENDOR_MINOR_VERSION")?,
        get("NVSHMEM_VENDOR_PATCH_VERSION")?,
    ))
}

/// Version stored in `libnvshmem_device.a` (symbol [`DEVICE_VERSION_SYMBOL`] of its host-side
/// objects: three 32-bit ints).
pub fn device_archive_version(bytes: &[u8]) -> Result<Option<Version>, String> {
    use object::read::archive::ArchiveFile;
    let archive = ArchiveFile::parse(bytes).map_err(|e| format!("not an ar archive: {e}"))?;
    for member in archive.members() {
        let member = member.map_err(|e| format!("bad archive member: {e}"))?;
        let Ok(data) = member.data(bytes) else {
            continue;
        };
        let Ok(obj) = object::File::parse(data) else {
            continue;
        };
        if let Some(v) = object_device_version(&obj)? {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

/// Version stored by [`DEVICE_VERSION_SYMBOL`] in one object file, or in a shared object that
/// linked `libnvshmem_device.a` (DeepEP's `deep_ep_cpp*.so` keeps the local symbol in its
/// `.symtab` unless stripped).
pub fn object_device_version(obj: &object::File) -> Result<Option<Version>, String> {
    use object::{Endianness, Object, ObjectSection, ObjectSymbol};
    for sym in obj.symbols() {
        if sym.name() != Ok(DEVICE_VERSION_SYMBOL) {
            continue;
        }
        let Some(section) = sym
            .section_index()
            .and_then(|i| obj.section_by_index(i).ok())
        else {
            continue;
        };
        let Ok(sdata) = section.data() else { continue };
        // In a relocatable object the value is an offset into the section; in a linked object
        // it is an address.
        let off = sym
            .address()
            .checked_sub(section.address())
            .and_then(|o| usize::try_from(o).ok())
            .ok_or("symbol offset out of range")?;
        let Some(raw) = sdata.get(off..off + 12) else {
            return Err(format!("{DEVICE_VERSION_SYMBOL} lies outside its section"));
        };
        let endian = if obj.is_little_endian() {
            Endianness::Little
        } else {
            Endianness::Big
        };
        let word = |i: usize| {
            let b = [raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]];
            match endian {
                Endianness::Little => u32::from_le_bytes(b),
                Endianness::Big => u32::from_be_bytes(b),
            }
        };
        return Ok(Some(Version(word(0), word(1), word(2))));
    }
    Ok(None)
}

fn device_library(
    host: &Host,
    lib_dir: &Path,
    host_version: Option<Version>,
    out: &mut Vec<Check>,
) {
    let id = "nvshmem.device-library";
    let prefix = lib_dir.parent().unwrap_or(Path::new("/"));
    let archive_path = lib_dir.join("libnvshmem_device.a");
    let header_path = prefix.join("include/non_abi/nvshmem_version.h");
    let mut parts: Vec<(String, Version)> = Vec::new();
    let mut problems = Vec::new();
    match host.read_bytes(&archive_path, elf::LIB_CAP) {
        Ok(bytes) => match device_archive_version(&bytes) {
            Ok(Some(v)) => parts.push((archive_path.display().to_string(), v)),
            Ok(None) => problems.push(format!(
                "{}: no {DEVICE_VERSION_SYMBOL} symbol",
                archive_path.display()
            )),
            Err(e) => problems.push(format!("{}: {e}", archive_path.display())),
        },
        Err(ReadError::Missing) => {}
        Err(e) => problems.push(format!("{} {e}", archive_path.display())),
    }
    match host.read_text(&header_path) {
        Ok(text) => match header_version(&text) {
            Some(v) => parts.push((header_path.display().to_string(), v)),
            None => problems.push(format!(
                "{}: no NVSHMEM_VENDOR_*_VERSION defines",
                header_path.display()
            )),
        },
        Err(ReadError::Missing) => {}
        Err(e) => problems.push(format!("{} {e}", header_path.display())),
    }
    let listing = parts
        .iter()
        .map(|(p, v)| format!("{v} ({p})"))
        .collect::<Vec<_>>()
        .join(", ");
    let Some(hv) = host_version else {
        out.push(Check::skip(
            id,
            caps::NVSHMEM,
            format!("host library version unknown; found {listing}"),
        ));
        return;
    };
    let mismatched: Vec<&(String, Version)> = parts.iter().filter(|(_, v)| *v != hv).collect();
    if !mismatched.is_empty() {
        out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!("mixed NVSHMEM installation: host library {hv}, but {listing}"),
            "never mix lib/ and include/ of different NVSHMEM releases: install one release into a fresh prefix (deepep-nix install --version <v> --cuda 13 --prefix <new dir>, or the flake's nvshmem package) and point NVSHMEM_DIR at it",
        ));
    } else if !problems.is_empty() {
        out.push(Check::fail(
            id,
            caps::NVSHMEM,
            problems.join("; "),
            "reinstall NVSHMEM into a fresh prefix; the device library or headers are damaged",
        ));
    } else if parts.is_empty() {
        out.push(Check::skip(
            id,
            caps::NVSHMEM,
            "no libnvshmem_device.a and no include/ (runtime-only install): nothing to compare",
        ));
    } else {
        out.push(Check::ok(
            id,
            caps::NVSHMEM,
            format!("matches the host library: {listing}"),
        ));
    }
}

fn kernels(host: &Host, settings: &Settings, host_version: Option<Version>, out: &mut Vec<Check>) {
    let id = "nvshmem.kernels";
    let (kv, source) = match (
        settings.kernels_version,
        host.env("DEEPEP_KERNELS_NVSHMEM_VERSION"),
    ) {
        (Some(v), _) => (v, "--kernels-nvshmem-version"),
        (None, Some(raw)) => match Version::parse(raw) {
            Some(v) => (v, "DEEPEP_KERNELS_NVSHMEM_VERSION"),
            None => {
                out.push(Check::fail(
                    id,
                    caps::NVSHMEM,
                    format!("DEEPEP_KERNELS_NVSHMEM_VERSION={raw:?} is not a version X.Y.Z"),
                    "set it to the NVSHMEM version the kernels were built against, e.g. DEEPEP_KERNELS_NVSHMEM_VERSION=3.4.5, or unset it",
                ));
                return;
            }
        },
        (None, None) => {
            out.push(Check::skip(
                id,
                caps::NVSHMEM,
                "unknown: pass --kernels-nvshmem-version X.Y.Z (or set DEEPEP_KERNELS_NVSHMEM_VERSION) to compare",
            ));
            return;
        }
    };
    match host_version {
        None => out.push(Check::skip(id, caps::NVSHMEM, format!("kernels built against {kv} ({source}); host library version unknown"))),
        Some(hv) if hv == kv => {
            out.push(Check::ok(id, caps::NVSHMEM, format!("kernels built against {kv} ({source}) = host library {hv}")))
        }
        Some(hv) => out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!("kernels built against NVSHMEM {kv} ({source}), host library is {hv}: the host copies its own device state into the kernels' module, so the versions must be equal"),
            format!("point NVSHMEM_DIR at NVSHMEM {kv}, or rebuild the kernels against this one (NVSHMEM_DIR=<this prefix> cargo build --release -p deepep-kernels-harness)"),
        )),
    }
}

/// What our binaries load: `$NVSHMEM_DIR/lib/libnvshmem_host.so.3` when NVSHMEM_DIR is set,
/// else the loader's pick by bare name. Both must be the library checked above.
fn loader(host: &Host, checked: &Path, checked_version: Option<Version>, out: &mut Vec<Check>) {
    let id = "nvshmem.loader";
    let pseudo = DynInfo::bare(native_ident());
    let bare = match elf::resolve(host, HOST_LIB, Path::new("/"), &pseudo) {
        Resolution::Found(p) => Some(p),
        Resolution::Missing { .. } => None,
    };
    let env_lib = host
        .env("NVSHMEM_DIR")
        .filter(|d| d.starts_with('/'))
        .map(|d| Path::new(d).join("lib").join(HOST_LIB));
    let usable =
        |p: &PathBuf| matches!(elf::read_ident(host, p), Ok(Some(id)) if id == native_ident());
    let runtime = env_lib.clone().filter(usable).or(bare.clone());
    let same = |p: &Path| same_file(host, p, checked);
    let version_of = |p: &Path| -> Option<Version> {
        host.read_bytes(p, elf::LIB_CAP)
            .ok()
            .and_then(|b| banner_versions(&b).into_iter().next())
    };
    let describe = |p: &Path| {
        format!(
            "{} (NVSHMEM {})",
            p.display(),
            version_of(p).map_or("unknown".into(), |v| v.to_string())
        )
    };
    let export = format!(
        "export NVSHMEM_DIR={} LD_LIBRARY_PATH={}:$LD_LIBRARY_PATH",
        checked
            .parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new("/"))
            .display(),
        checked.parent().unwrap_or(Path::new("/")).display()
    );
    match runtime {
        None => out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!("programs would not find {HOST_LIB}: NVSHMEM_DIR is not set and it is not on the loader path"),
            export,
        )),
        Some(rt) if !same(&rt) && version_of(&rt) != checked_version => out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!(
                "programs would load {} instead of the checked {}",
                describe(&rt),
                describe(checked)
            ),
            export,
        )),
        Some(rt) => {
            let via = if env_lib.as_deref() == Some(rt.as_path()) { "NVSHMEM_DIR" } else { "the loader path" };
            match bare.filter(|b| !same(b) && version_of(b) != checked_version) {
                Some(other) => out.push(Check::warn(
                    id,
                    caps::NVSHMEM,
                    format!(
                        "our binaries load {} via {via}, but programs that dlopen {HOST_LIB} by name (torch, nvshmem4py) get {}",
                        rt.display(),
                        describe(&other)
                    ),
                    format!("put the same NVSHMEM first on LD_LIBRARY_PATH: {export}"),
                )),
                None => out.push(Check::ok(id, caps::NVSHMEM, format!("programs load {} (via {via})", rt.display()))),
            }
        }
    }
}

pub(super) fn same_file(host: &Host, a: &Path, b: &Path) -> bool {
    match (
        std::fs::canonicalize(host.real(a)),
        std::fs::canonicalize(host.real(b)),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// Libraries a plugin opens with `dlopen` (invisible in `DT_NEEDED`) that it cannot work without.
fn dlopened(plugin: &str) -> &'static [&'static str] {
    match plugin {
        "nvshmem_transport_ibgda" | "nvshmem_transport_ibdevx" | "nvshmem_transport_ibrc" => {
            &["libibverbs.so.1"]
        }
        _ => &[],
    }
}

/// Why a plugin would not load, or a short description when it would.
fn plugin_loadable(host: &Host, path: &Path, want: Option<ElfIdent>) -> Result<String, String> {
    let bytes = host
        .read_bytes(path, elf::LIB_CAP)
        .map_err(|e| format!("{e}"))?;
    let info = elf::parse_dyn(&bytes)?;
    if let Some(w) = want {
        if info.ident != w {
            return Err(format!(
                "{}, the host library is {}",
                info.ident.describe(),
                w.describe()
            ));
        }
    }
    let name = plugin_name(&path.file_name().unwrap_or_default().to_string_lossy());
    let dir = path.parent().unwrap_or(Path::new("/"));
    let mut missing = Vec::new();
    let deps: Vec<&str> = info
        .needed
        .iter()
        .map(String::as_str)
        .chain(dlopened(&name).iter().copied())
        .collect();
    for dep in &deps {
        if let Resolution::Missing { skipped } = elf::resolve(host, dep, dir, &info) {
            let why = if skipped.is_empty() {
                String::new()
            } else {
                format!(" [skipped: {}]", skipped.join("; "))
            };
            missing.push(format!("{dep}{why}"));
        }
    }
    if missing.is_empty() {
        let n = deps.len();
        let noun = if n == 1 {
            "library resolves"
        } else {
            "libraries resolve"
        };
        Ok(format!("{}, {n} {noun}", info.ident.describe()))
    } else {
        Err(format!("missing {}", missing.join(", ")))
    }
}

/// `nvshmem_transport_ibgda.so.3` -> `nvshmem_transport_ibgda`.
fn plugin_name(file: &str) -> String {
    file.split(".so").next().unwrap_or(file).to_string()
}

/// Fix for a missing plugin dependency.
fn dependency_fix(missing: &str) -> &'static str {
    if missing.contains("libmlx5") || missing.contains("libibverbs") {
        "install rdma-core (Debian/Ubuntu: sudo apt-get install libibverbs1 ibverbs-providers; NixOS: hardware.infiniband.enable = true;, or use the flake's nvshmem package whose RUNPATH has rdma-core)"
    } else {
        "install the library that provides it, or add its directory to LD_LIBRARY_PATH"
    }
}

fn plugins(host: &Host, lib_dir: &Path, info: &mut NvshmemInfo, out: &mut Vec<Check>) {
    let files: Vec<String> = host
        .list_dir(lib_dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|n| {
            (n.starts_with("nvshmem_bootstrap_") || n.starts_with("nvshmem_transport_"))
                && n.contains(".so")
        })
        .collect();
    // One file per plugin: prefer the shortest name (`x.so.3` over `x.so.3.0.0`).
    let mut by_plugin: BTreeMap<String, String> = BTreeMap::new();
    for f in &files {
        let e = by_plugin.entry(plugin_name(f)).or_insert_with(|| f.clone());
        if f.len() < e.len() {
            *e = f.clone();
        }
    }
    info.plugins = by_plugin.values().map(|f| lib_dir.join(f)).collect();
    let want = info.ident;

    // Bootstrap: UID by default (our runtime), overridable by env.
    let (boot_name, boot_path) = selected_bootstrap(host, lib_dir, &by_plugin);
    required_plugin(
        host,
        "nvshmem.plugin.bootstrap",
        caps::NVSHMEM,
        &boot_name,
        boot_path,
        want,
        out,
    );
    let ibgda = by_plugin
        .get("nvshmem_transport_ibgda")
        .map(|f| lib_dir.join(f));
    required_plugin(
        host,
        "nvshmem.plugin.ibgda",
        caps::INTERNODE,
        "nvshmem_transport_ibgda",
        ibgda,
        want,
        out,
    );

    // The rest: reported; a failure matters only if the environment selects that plugin.
    let selected = selected_by_env(host);
    let mut lines = Vec::new();
    let mut bad_selected = Vec::new();
    for (name, file) in &by_plugin {
        if name == &boot_name || name == "nvshmem_transport_ibgda" {
            continue;
        }
        match plugin_loadable(host, &lib_dir.join(file), want) {
            Ok(_) => lines.push(format!("{file} loadable")),
            Err(e) => {
                let sel = selected.contains(name);
                lines.push(format!(
                    "{file} not loadable ({e}){}",
                    if sel { "" } else { ", unused" }
                ));
                if sel {
                    bad_selected.push(format!("{file} ({e})"));
                }
            }
        }
    }
    // Transport SONAME majors must agree (.so.3 / .so.5 / .so.7 belong to different releases).
    let mut majors: Vec<String> = files
        .iter()
        .filter(|f| f.starts_with("nvshmem_transport_"))
        .filter_map(|f| {
            f.split(".so.")
                .nth(1)
                .map(|s| s.split('.').next().unwrap_or("").to_string())
        })
        .collect();
    majors.sort();
    majors.dedup();
    let id = "nvshmem.plugins";
    if majors.len() > 1 {
        out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!("transport plugins of different releases in {} (.so.{}): {}", lib_dir.display(), majors.join(", .so."), files.join(" ")),
            "never mix lib/ directories of different NVSHMEM releases: reinstall one release into a fresh prefix",
        ));
    } else if !bad_selected.is_empty() {
        out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!(
                "plugins selected by the environment do not load: {}",
                bad_selected.join("; ")
            ),
            dependency_fix(&bad_selected.join(" ")),
        ));
    } else if lines.is_empty() {
        out.push(Check::skip(id, caps::NVSHMEM, "no other plugins"));
    } else {
        out.push(Check::ok(id, caps::NVSHMEM, lines.join("; ")));
    }
}

/// The bootstrap plugin our runtime will use: `NVSHMEM_BOOTSTRAP_UID_PLUGIN` / `NVSHMEM_BOOTSTRAP`
/// select others; default UID. Returns (plugin name, path if present).
fn selected_bootstrap(
    host: &Host,
    lib_dir: &Path,
    by_plugin: &BTreeMap<String, String>,
) -> (String, Option<PathBuf>) {
    let name = match host
        .env("NVSHMEM_BOOTSTRAP")
        .map(str::to_ascii_uppercase)
        .as_deref()
    {
        Some("MPI") => "nvshmem_bootstrap_mpi",
        Some("SHMEM") => "nvshmem_bootstrap_shmem",
        Some("PMI") => match host
            .env("NVSHMEM_BOOTSTRAP_PMI")
            .map(str::to_ascii_uppercase)
            .as_deref()
        {
            Some("PMI-2") | Some("PMI2") => "nvshmem_bootstrap_pmi2",
            Some("PMIX") => "nvshmem_bootstrap_pmix",
            _ => "nvshmem_bootstrap_pmi",
        },
        Some("PMI2") | Some("PMI-2") => "nvshmem_bootstrap_pmi2",
        Some("PMIX") => "nvshmem_bootstrap_pmix",
        _ => "nvshmem_bootstrap_uid",
    };
    if name == "nvshmem_bootstrap_uid" {
        if let Some(p) = host
            .env("NVSHMEM_BOOTSTRAP_UID_PLUGIN")
            .filter(|p| p.starts_with('/'))
        {
            return (name.into(), Some(PathBuf::from(p)));
        }
    }
    (name.into(), by_plugin.get(name).map(|f| lib_dir.join(f)))
}

fn selected_by_env(host: &Host) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(t) = host.env("NVSHMEM_REMOTE_TRANSPORT") {
        if t != "none" {
            v.push(format!("nvshmem_transport_{}", t.to_ascii_lowercase()));
        }
    }
    v
}

fn required_plugin(
    host: &Host,
    id: &str,
    needed: &[Capability],
    name: &str,
    path: Option<PathBuf>,
    want: Option<ElfIdent>,
    out: &mut Vec<Check>,
) {
    let Some(path) = path else {
        out.push(Check::fail(
            id,
            needed,
            format!("{name}.so.* not found next to {HOST_LIB}"),
            "reinstall NVSHMEM with its plugins (they must stay in the same lib/ as the host library)",
        ));
        return;
    };
    match plugin_loadable(host, &path, want) {
        Ok(desc) => out.push(Check::ok(
            id,
            needed,
            format!("{} loadable ({desc})", path.display()),
        )),
        Err(e) => out.push(Check::fail(
            id,
            needed,
            format!("{} not loadable: {e}", path.display()),
            dependency_fix(&e),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_order() {
        assert_eq!(Version::parse("3.4.5"), Some(Version(3, 4, 5)));
        assert_eq!(Version::parse("3.4"), None);
        assert_eq!(Version::parse("3.4.5.1"), None);
        assert_eq!(Version::parse("3.x.5"), None);
        assert!(Version(3, 3, 20) > Version(3, 3, 9));
    }

    #[test]
    fn banner_needs_nul_terminated_version() {
        let bytes = b"junk\0NVSHMEM v3.4.5\0NVSHMEM v%s\0NVSHMEM v3.4.5\0NVSHMEM v9.9.9x\0";
        assert_eq!(banner_versions(bytes), vec![Version(3, 4, 5)]);
        assert_eq!(
            banner_versions(b"NVSHMEM v3.3.9\0 NVSHMEM v3.8.0\0"),
            vec![Version(3, 3, 9), Version(3, 8, 0)]
        );
    }

    #[test]
    fn header_defines() {
        let h = "#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 8\n#define NVSHMEM_VENDOR_PATCH_VERSION 0\n";
        assert_eq!(header_version(h), Some(Version(3, 8, 0)));
        assert_eq!(header_version("#define X 1\n"), None);
    }
}
