//! Just enough ELF to answer "would the dynamic loader load this library here?" without loading
//! it: class/machine, `DT_NEEDED`, `DT_SONAME`, `DT_RPATH`/`DT_RUNPATH`, and a search of the
//! directories `ld.so` would look in (below `--root`).

use super::host::{FileKind, Host, ReadError};
use object::elf;
use object::read::elf::{Dyn, FileHeader, SectionHeader};
use object::Endianness;
use std::path::{Path, PathBuf};

/// Largest shared object we parse (NVSHMEM's host library is ~50 MB).
pub const LIB_CAP: u64 = 512 << 20;

/// Identity of an ELF object: only objects of the same class, byte order and machine can be
/// loaded into one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElfIdent {
    pub is_64: bool,
    pub little_endian: bool,
    pub machine: u16,
}

impl ElfIdent {
    /// Reads the identity from the first bytes of a file; `None` if it is not ELF.
    pub fn parse(data: &[u8]) -> Option<ElfIdent> {
        if data.len() < 20 || &data[..4] != b"\x7fELF" {
            return None;
        }
        let is_64 = match data[4] {
            1 => false,
            2 => true,
            _ => return None,
        };
        let little_endian = match data[5] {
            1 => true,
            2 => false,
            _ => return None,
        };
        let m = [data[18], data[19]];
        let machine = if little_endian {
            u16::from_le_bytes(m)
        } else {
            u16::from_be_bytes(m)
        };
        Some(ElfIdent {
            is_64,
            little_endian,
            machine,
        })
    }

    pub fn describe(self) -> String {
        let arch = match self.machine {
            elf::EM_X86_64 => "x86-64",
            elf::EM_AARCH64 => "aarch64",
            elf::EM_386 => "i386",
            elf::EM_ARM => "arm",
            elf::EM_PPC64 => "ppc64",
            other => return format!("ELF{} machine {other}", if self.is_64 { 64 } else { 32 }),
        };
        format!("ELF{} {arch}", if self.is_64 { 64 } else { 32 })
    }

    /// Default library directories of the loader for this identity (glibc, Debian multiarch and
    /// the FHS/Red Hat lib64 layout; NixOS uses RUNPATH and `/run/opengl-driver/lib`).
    fn default_dirs(self) -> &'static [&'static str] {
        match (self.is_64, self.machine) {
            (true, elf::EM_X86_64) => &[
                "/lib/x86_64-linux-gnu",
                "/usr/lib/x86_64-linux-gnu",
                "/lib64",
                "/usr/lib64",
                "/lib",
                "/usr/lib",
                "/run/opengl-driver/lib",
            ],
            (true, elf::EM_AARCH64) => &[
                "/lib/aarch64-linux-gnu",
                "/usr/lib/aarch64-linux-gnu",
                "/lib64",
                "/usr/lib64",
                "/lib",
                "/usr/lib",
                "/run/opengl-driver/lib",
            ],
            _ => &["/lib", "/usr/lib"],
        }
    }
}

/// The dynamic-linking facts of a shared object.
#[derive(Debug, Clone)]
pub struct DynInfo {
    pub ident: ElfIdent,
    pub soname: Option<String>,
    pub needed: Vec<String>,
    /// `DT_RUNPATH` entries, or `DT_RPATH` when there is no RUNPATH.
    pub search_path: Vec<String>,
    /// Whether `search_path` is a RUNPATH (searched after `LD_LIBRARY_PATH`) or an RPATH
    /// (searched before it).
    pub runpath: bool,
}

impl DynInfo {
    /// A program without RPATH/RUNPATH: what a bare-name `dlopen` from our binaries searches.
    pub fn bare(ident: ElfIdent) -> DynInfo {
        DynInfo {
            ident,
            soname: None,
            needed: Vec::new(),
            search_path: Vec::new(),
            runpath: false,
        }
    }
}

/// Parses the dynamic section of an ELF shared object.
pub fn parse_dyn(data: &[u8]) -> Result<DynInfo, String> {
    let ident = ElfIdent::parse(data).ok_or("not an ELF file")?;
    if ident.is_64 {
        parse_dyn_as::<elf::FileHeader64<Endianness>>(data, ident)
    } else {
        parse_dyn_as::<elf::FileHeader32<Endianness>>(data, ident)
    }
}

fn parse_dyn_as<H: FileHeader<Endian = Endianness>>(
    data: &[u8],
    ident: ElfIdent,
) -> Result<DynInfo, String> {
    let header = H::parse(data).map_err(|e| format!("bad ELF header: {e}"))?;
    let endian = header
        .endian()
        .map_err(|e| format!("bad ELF header: {e}"))?;
    if header.e_type(endian) != elf::ET_DYN {
        return Err("not a shared object (ELF type is not ET_DYN)".into());
    }
    let sections = header
        .sections(endian, data)
        .map_err(|e| format!("bad section table: {e}"))?;
    let mut info = DynInfo::bare(ident);
    let Some(section) = sections
        .iter()
        .find(|s| s.sh_type(endian) == elf::SHT_DYNAMIC)
    else {
        return Err("no dynamic section".into());
    };
    let entries = section
        .data_as_array::<H::Dyn, _>(endian, data)
        .map_err(|e| format!("bad dynamic section: {e}"))?;
    let strings = sections
        .strings(
            endian,
            data,
            object::SectionIndex(section.sh_link(endian) as usize),
        )
        .map_err(|e| format!("bad dynamic string table: {e}"))?;
    let (mut rpath, mut runpath) = (Vec::new(), Vec::new());
    for d in entries {
        let tag = d.tag(endian);
        if tag == elf::DT_NULL {
            break;
        }
        let text = || -> Result<String, String> {
            let off = u32::try_from(d.val(endian))
                .map_err(|_| "string offset out of range".to_string())?;
            strings
                .get(off)
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .map_err(|_| "string offset out of range".to_string())
        };
        match tag {
            t if t == elf::DT_NEEDED => info.needed.push(text()?),
            t if t == elf::DT_SONAME => info.soname = Some(text()?),
            t if t == elf::DT_RPATH => rpath.extend(text()?.split(':').map(str::to_owned)),
            t if t == elf::DT_RUNPATH => runpath.extend(text()?.split(':').map(str::to_owned)),
            _ => {}
        }
    }
    info.runpath = !runpath.is_empty();
    info.search_path = if runpath.is_empty() { rpath } else { runpath };
    info.search_path.retain(|p| !p.is_empty());
    Ok(info)
}

/// Where the loader would find a library, or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// Found a loadable candidate at this host path.
    Found(PathBuf),
    /// Not found; candidates of the wrong kind that were skipped are listed.
    Missing { skipped: Vec<String> },
}

/// Searches library `name` the way `ld.so` does for an object at `origin_dir` with `info`:
/// its RPATH/RUNPATH (with `$ORIGIN`), `LD_LIBRARY_PATH`, `/etc/ld.so.conf` directories and the
/// default directories — all below the host root. Only ELF files of `info.ident` count.
pub fn resolve(host: &Host, name: &str, origin_dir: &Path, info: &DynInfo) -> Resolution {
    let mut skipped = Vec::new();
    for dir in search_dirs(host, origin_dir, info) {
        let candidate = dir.join(name);
        match read_ident(host, &candidate) {
            Err(ReadError::Missing) => {}
            Err(e) => skipped.push(format!("{} {e}", candidate.display())),
            Ok(None) => skipped.push(format!("{} is not an ELF file", candidate.display())),
            Ok(Some(id)) if id == info.ident => return Resolution::Found(candidate),
            Ok(Some(id)) => skipped.push(format!(
                "{} is {}, need {}",
                candidate.display(),
                id.describe(),
                info.ident.describe()
            )),
        }
    }
    Resolution::Missing { skipped }
}

/// ELF identity of the file at a host path (`Ok(None)`: a readable file that is not ELF).
pub fn read_ident(host: &Host, path: &Path) -> Result<Option<ElfIdent>, ReadError> {
    use std::io::Read;
    match host.kind(path) {
        None => return Err(ReadError::Missing),
        Some(FileKind::File) => {}
        Some(kind) => return Err(ReadError::NotAFile(kind.describe())),
    }
    let f = std::fs::File::open(host.real(path)).map_err(|e| ReadError::Io(e.to_string()))?;
    let mut head = Vec::with_capacity(20);
    f.take(20)
        .read_to_end(&mut head)
        .map_err(|e| ReadError::Io(e.to_string()))?;
    Ok(ElfIdent::parse(&head))
}

/// The loader's search order for one object, as host paths, without duplicates.
pub fn search_dirs(host: &Host, origin_dir: &Path, info: &DynInfo) -> Vec<PathBuf> {
    let origin = origin_dir.to_string_lossy();
    let own: Vec<PathBuf> = info
        .search_path
        .iter()
        .map(|e| e.replace("${ORIGIN}", &origin).replace("$ORIGIN", &origin))
        .filter(|e| e.starts_with('/'))
        .map(PathBuf::from)
        .collect();
    let env = ld_library_path(host);
    // RPATH is searched before LD_LIBRARY_PATH, RUNPATH after it.
    let (first, second) = if info.runpath { (env, own) } else { (own, env) };
    let mut dirs: Vec<PathBuf> = Vec::new();
    let rest = ld_so_conf_dirs(host)
        .into_iter()
        .chain(info.ident.default_dirs().iter().map(PathBuf::from));
    for dir in first.into_iter().chain(second).chain(rest) {
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

/// Absolute entries of `LD_LIBRARY_PATH` (relative ones depend on the working directory and
/// are ignored, as they would be for a service).
pub fn ld_library_path(host: &Host) -> Vec<PathBuf> {
    host.env("LD_LIBRARY_PATH")
        .map(|v| {
            v.split([':', ';'])
                .filter(|p| p.starts_with('/'))
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default()
}

/// Directories listed by `/etc/ld.so.conf` and the files it includes (one level of globs of
/// the form `dir/*.conf`, which is what distributions use).
pub fn ld_so_conf_dirs(host: &Host) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut files = vec![PathBuf::from("/etc/ld.so.conf")];
    let mut seen = 0;
    while let Some(file) = files.pop() {
        seen += 1;
        if seen > 64 {
            break; // include loops
        }
        let Ok(text) = host.read_text(&file) else {
            continue;
        };
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            if let Some(pattern) = line.strip_prefix("include").map(str::trim) {
                files.extend(expand_conf_glob(host, pattern));
            } else if line.starts_with('/') {
                out.push(PathBuf::from(line));
            }
        }
    }
    out
}

/// Expands `dir/*.suffix` (or a plain file) into sorted host paths.
fn expand_conf_glob(host: &Host, pattern: &str) -> Vec<PathBuf> {
    let path = Path::new(pattern);
    let (Some(dir), Some(file)) = (
        path.parent(),
        path.file_name().map(|f| f.to_string_lossy().into_owned()),
    ) else {
        return Vec::new();
    };
    match file.split_once('*') {
        None => vec![path.to_path_buf()],
        Some((prefix, suffix)) => {
            let mut v: Vec<PathBuf> = host
                .list_dir(dir)
                .unwrap_or_default()
                .into_iter()
                .filter(|n| n.starts_with(prefix) && n.ends_with(suffix))
                .map(|n| dir.join(n))
                .collect();
            // `files` is used as a stack: reverse so they are read in order.
            v.reverse();
            v
        }
    }
}

/// ELF identity of the binary doctor runs as (the host's native libraries).
pub fn native_ident() -> ElfIdent {
    let machine = match std::env::consts::ARCH {
        "aarch64" => object::elf::EM_AARCH64,
        _ => object::elf::EM_X86_64,
    };
    ElfIdent {
        is_64: true,
        little_endian: true,
        machine,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::host::NoTools;
    use std::collections::BTreeMap;

    #[test]
    fn rpath_before_and_runpath_after_ld_library_path() {
        let env = BTreeMap::from([(
            "LD_LIBRARY_PATH".to_string(),
            "/env/lib:relative/lib".to_string(),
        )]);
        let tools = NoTools(String::new());
        let empty = tempfile::tempdir().unwrap();
        let host = Host::new(empty.path(), &env, &tools);
        let ident = ElfIdent {
            is_64: true,
            little_endian: true,
            machine: elf::EM_X86_64,
        };
        let mut info = DynInfo::bare(ident);
        info.search_path = vec![
            "${ORIGIN}".into(),
            "$ORIGIN/../lib64".into(),
            "/opt/x".into(),
        ];
        let dirs = search_dirs(&host, Path::new("/pkg/lib"), &info);
        let head: Vec<&str> = dirs.iter().take(5).map(|d| d.to_str().unwrap()).collect();
        assert_eq!(
            head,
            [
                "/pkg/lib",
                "/pkg/lib/../lib64",
                "/opt/x",
                "/env/lib",
                "/lib/x86_64-linux-gnu"
            ]
        );
        info.runpath = true;
        let dirs = search_dirs(&host, Path::new("/pkg/lib"), &info);
        assert_eq!(dirs[0], Path::new("/env/lib"));
        assert_eq!(dirs[1], Path::new("/pkg/lib"));
        assert!(dirs.contains(&PathBuf::from("/run/opengl-driver/lib")));
    }

    #[test]
    fn ident_rejects_non_elf_and_reads_machine() {
        assert_eq!(ElfIdent::parse(b"#!/bin/sh\n echo hi there"), None);
        let mut h = [0u8; 20];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = 2;
        h[5] = 1;
        h[18..20].copy_from_slice(&elf::EM_AARCH64.to_le_bytes());
        let id = ElfIdent::parse(&h).unwrap();
        assert!(id.is_64 && id.little_endian);
        assert_eq!(id.describe(), "ELF64 aarch64");
    }
}
