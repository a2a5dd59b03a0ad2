//! `install` and `env`: unpack a verified NVSHMEM archive (NVIDIA `.tar.xz` or PyPI wheel)
//! into a prefix safely, and print the shell exports that use it.
//!
//! Safety: every entry path must be relative without `..`; symlink and hard-link targets
//! must resolve inside the prefix (following the archive's own symlinks, so a chain of
//! individually harmless links cannot escape); symlinks are created last, so no file is
//! ever written through one. Everything is unpacked into a temporary directory next to the
//! prefix and renamed into place at the end; on any error the prefix is untouched, and
//! parent directories created for a new prefix are removed again.
//!
//! Bounds: the unpacked bytes may be at most [`UNPACKED_RATIO`] times the (verified)
//! archive's size unless the caller raises the bound (`--max-unpacked-size`); a decompression
//! bomb stops at the bound. `--replace` only replaces an earlier install, recognised by
//! [`earlier_install`].

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// Archive formats NVSHMEM ships in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// NVIDIA redist: `libnvshmem-<platform>-<version>_cuda<N>-archive/{bin,include,lib,...}`.
    TarXz,
    /// PyPI wheel: `nvidia/nvshmem/{include,lib}` (plus `.dist-info`, not installed).
    Wheel,
}

impl Format {
    /// From the lock's `format` field or a file name.
    pub fn detect(name: &str) -> Option<Format> {
        if name == "tar.xz" || name.ends_with(".tar.xz") {
            Some(Format::TarXz)
        } else if name == "wheel" || name.ends_with(".whl") {
            Some(Format::Wheel)
        } else {
            None
        }
    }
}

/// The library every NVSHMEM install has.
pub const HOST_LIB: &str = "lib/libnvshmem_host.so.3";
/// The unversioned link wheels lack (linkers look for it with `-lnvshmem_host`).
pub const HOST_LIB_LINK: &str = "lib/libnvshmem_host.so";

/// Wheel subtree that becomes the prefix.
const WHEEL_ROOT: &str = "nvidia/nvshmem/";

/// Default bound on the unpacked size: this many times the archive's size. NVSHMEM wheels
/// unpack to about 1.5 times their size, the `.tar.xz` archives to a few times theirs.
pub const UNPACKED_RATIO: u64 = 16;

/// Top-level entries an NVSHMEM install has (tarball: `bin include lib share`, wheel:
/// `include lib`), besides files named `LICENSE*`. A directory with anything else is not an
/// earlier install, so `--replace` leaves it alone.
pub const INSTALL_ENTRIES: &[&str] = &["bin", "include", "lib", "share"];

/// Options of [`install_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct InstallOptions {
    /// Replace an earlier install in the prefix (see [`earlier_install`]).
    pub replace: bool,
    /// Bound on the unpacked bytes; `None`: [`UNPACKED_RATIO`] times the archive's size.
    pub max_unpacked: Option<u64>,
}

/// What an earlier install held when it was replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replaced {
    /// Top-level entries, directories with a trailing `/`, sorted.
    pub entries: Vec<String>,
    /// Files and symlinks below them.
    pub files: u64,
}

/// The result of [`install_with`].
#[derive(Debug, Clone)]
pub struct Installed {
    pub prefix: PathBuf,
    /// `Some` when an earlier install was replaced.
    pub replaced: Option<Replaced>,
}

fn unsafe_entry(entry: &str, reason: impl Into<String>) -> Error {
    Error::UnsafeArchive {
        entry: entry.to_string(),
        reason: reason.into(),
    }
}

/// Splits an archive path into normal components, refusing absolute paths and `..`.
fn components(entry: &str, path: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(s) => out.push(
                s.to_str()
                    .ok_or_else(|| unsafe_entry(entry, "name is not UTF-8"))?
                    .to_string(),
            ),
            Component::CurDir => {}
            Component::ParentDir => return Err(unsafe_entry(entry, "path contains `..`")),
            Component::RootDir | Component::Prefix(_) => {
                return Err(unsafe_entry(entry, "absolute path"))
            }
        }
    }
    Ok(out)
}

/// Resolves a symlink target inside the prefix, following symlinks of the archive itself.
/// `at` is the link's own location (components below the prefix). Returns the resolved
/// location, or why it escapes.
pub fn resolve_inside(
    at: &[String],
    target: &str,
    links: &HashMap<Vec<String>, String>,
) -> std::result::Result<Vec<String>, String> {
    if target.starts_with('/') {
        return Err(format!("symlink target {target:?} is absolute"));
    }
    let mut stack: Vec<String> = at[..at.len().saturating_sub(1)].to_vec();
    let mut queue: std::collections::VecDeque<String> =
        target.split('/').map(str::to_string).collect();
    let mut hops = 0;
    while let Some(c) = queue.pop_front() {
        match c.as_str() {
            "" | "." => {}
            ".." => {
                if stack.pop().is_none() {
                    return Err(format!("symlink target {target:?} escapes the prefix"));
                }
            }
            _ => {
                stack.push(c);
                if let Some(t) = links.get(&stack) {
                    hops += 1;
                    if hops > 40 {
                        return Err(format!("symlink target {target:?} loops"));
                    }
                    if t.starts_with('/') {
                        return Err(format!(
                            "symlink target {target:?} goes through an absolute symlink"
                        ));
                    }
                    stack.pop();
                    for part in t.split('/').rev() {
                        queue.push_front(part.to_string());
                    }
                }
            }
        }
    }
    Ok(stack)
}

/// Collects entries into a staging directory.
struct Stager<'a> {
    root: &'a Path,
    /// The archive, named in read errors (not the staging path).
    archive: &'a Path,
    symlinks: Vec<(String, Vec<String>, String)>,
    hardlinks: Vec<(String, Vec<String>, Vec<String>)>,
    /// Bytes written so far and the bound, with how the bound was set (for the message).
    written: u64,
    limit: u64,
    limit_why: String,
}

impl<'a> Stager<'a> {
    fn path_of(&self, rel: &[String]) -> PathBuf {
        rel.iter().fold(self.root.to_path_buf(), |p, c| p.join(c))
    }

    fn dir(&self, rel: &[String]) -> Result<()> {
        let p = self.path_of(rel);
        fs::create_dir_all(&p).map_err(|e| Error::io(&p, e))
    }

    /// Counts `n` more unpacked bytes against the bound.
    fn count(&mut self, entry: &str, n: u64) -> Result<()> {
        self.written += n;
        if self.written > self.limit {
            return Err(unsafe_entry(
                entry,
                format!(
                    "the archive unpacks to more than {} bytes ({}); if you trust it, raise the bound with --max-unpacked-size",
                    self.limit, self.limit_why
                ),
            ));
        }
        Ok(())
    }

    fn file(&mut self, entry: &str, rel: &[String], mode: u32, mut data: impl Read) -> Result<()> {
        use std::io::Write;
        let p = self.path_of(rel);
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let mut f = File::create(&p).map_err(|e| Error::io(&p, e))?;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match data.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(corrupt(self.archive, entry, e)),
            };
            self.count(entry, n as u64)?;
            f.write_all(&buf[..n]).map_err(|e| Error::io(&p, e))?;
        }
        set_mode(&p, if mode & 0o111 != 0 { 0o755 } else { 0o644 })
    }

    /// Validates and creates the deferred links.
    fn finish(mut self) -> Result<()> {
        let map: HashMap<Vec<String>, String> = self
            .symlinks
            .iter()
            .map(|(_, at, t)| (at.clone(), t.clone()))
            .collect();
        for (entry, at, target) in &self.symlinks {
            resolve_inside(at, target, &map).map_err(|r| unsafe_entry(entry, r))?;
        }
        let mut hard_copies = Vec::new();
        for (entry, at, target) in &self.hardlinks {
            let resolved = resolve_inside(&[String::new()], &target.join("/"), &map)
                .map_err(|r| unsafe_entry(entry, r))?;
            let src = self.path_of(&resolved);
            if !src.is_file() {
                return Err(unsafe_entry(
                    entry,
                    format!(
                        "hard link target {:?} is not a file in the archive",
                        target.join("/")
                    ),
                ));
            }
            let dst = self.path_of(at);
            if let Some(parent) = dst.parent() {
                fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
            }
            let len = fs::metadata(&src).map_err(|e| Error::io(&src, e))?.len();
            hard_copies.push((entry.clone(), src, dst, len));
        }
        for (entry, src, dst, len) in hard_copies {
            self.count(&entry, len)?;
            fs::copy(&src, &dst).map_err(|e| Error::io(&dst, e))?;
        }
        for (_, at, target) in &self.symlinks {
            let p = self.path_of(at);
            if let Some(parent) = p.parent() {
                fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
            }
            std::os::unix::fs::symlink(target, &p).map_err(|e| Error::io(&p, e))?;
        }
        Ok(())
    }
}

/// A read error inside an archive (truncated or corrupt), naming the archive and the entry
/// (or `(first header)` / `(next header)` between entries).
fn corrupt(archive: &Path, entry: &str, e: io::Error) -> Error {
    let at = if entry.starts_with('(') {
        format!(
            "reading the {}",
            entry.trim_matches(|c| c == '(' || c == ')')
        )
    } else {
        format!("reading entry {entry:?}")
    };
    Error::io(
        archive,
        io::Error::new(
            e.kind(),
            format!("truncated or corrupt archive ({at}): {e}"),
        ),
    )
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(|e| Error::io(path, e))
}

/// Unpacks an NVIDIA redist `.tar.xz`, stripping its `*-archive/` top-level directory.
fn unpack_tar_xz(archive: &Path, stage: &mut Stager) -> Result<()> {
    let f = File::open(archive).map_err(|e| Error::io(archive, e))?;
    let mut tar = tar::Archive::new(xz2::read::XzDecoder::new(io::BufReader::new(f)));
    let mut top: Option<String> = None;
    let entries = tar
        .entries()
        .map_err(|e| corrupt(archive, "(first header)", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| corrupt(archive, "(next header)", e))?;
        let raw = entry
            .path()
            .map_err(|e| Error::io(archive, e))?
            .into_owned();
        let name = raw.display().to_string();
        let mut comps = components(&name, &raw)?;
        if comps.is_empty() {
            continue;
        }
        // The first entry decides whether there is a `*-archive/` directory to strip.
        let top_dir = top.get_or_insert_with(|| {
            if comps[0].ends_with("-archive") {
                comps[0].clone()
            } else {
                String::new()
            }
        });
        if !top_dir.is_empty() {
            if comps[0] != *top_dir {
                return Err(unsafe_entry(
                    &name,
                    format!("outside the archive's top-level directory {top_dir}/"),
                ));
            }
            comps.remove(0);
            if comps.is_empty() {
                continue;
            }
        }
        let kind = entry.header().entry_type();
        let link_name = || -> Result<String> {
            let l = entry
                .link_name()
                .map_err(|e| Error::io(archive, e))?
                .ok_or_else(|| unsafe_entry(&name, "link without a target"))?;
            Ok(l.to_str()
                .ok_or_else(|| unsafe_entry(&name, "link target is not UTF-8"))?
                .to_string())
        };
        match kind {
            tar::EntryType::Directory => stage.dir(&comps)?,
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let mode = entry.header().mode().unwrap_or(0o644);
                stage.file(&name, &comps, mode, entry)?
            }
            tar::EntryType::Symlink => {
                let target = link_name()?;
                stage.symlinks.push((name, comps, target));
            }
            tar::EntryType::Link => {
                let target = link_name()?;
                let mut t = components(&name, Path::new(&target))?;
                if !top.as_deref().unwrap_or("").is_empty() && t.first().map(String::as_str) == top.as_deref() {
                    t.remove(0);
                }
                stage.hardlinks.push((name, comps, t));
            }
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader | tar::EntryType::GNULongName | tar::EntryType::GNULongLink => {}
            other => return Err(unsafe_entry(&name, format!("unsupported entry type {other:?} (devices and FIFOs are never part of NVSHMEM)"))),
        }
    }
    Ok(())
}

/// Unpacks `nvidia/nvshmem/**` of a wheel into the prefix root; other members are skipped.
fn unpack_wheel(archive: &Path, stage: &mut Stager) -> Result<()> {
    let f = File::open(archive).map_err(|e| Error::io(archive, e))?;
    let mut zip = zip::ZipArchive::new(io::BufReader::new(f)).map_err(|e| {
        Error::io(
            archive,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not a wheel (zip): {e}"),
            ),
        )
    })?;
    for i in 0..zip.len() {
        let mut file = zip.by_index(i).map_err(|e| {
            Error::io(
                archive,
                io::Error::new(io::ErrorKind::InvalidData, e.to_string()),
            )
        })?;
        let name = file.name().to_string();
        let comps = components(&name, Path::new(&name))?;
        if !name.starts_with(WHEEL_ROOT) {
            continue; // .dist-info, nvidia/__init__.py, ...
        }
        // `nvidia/nvshmem/<rest>` -> `<rest>` (the prefix guarantees two leading components).
        let comps: Vec<String> = comps[2..].to_vec();
        if comps.is_empty() {
            continue;
        }
        let mode = file.unix_mode().unwrap_or(0o644);
        if mode & 0o170000 == 0o120000 {
            let mut target = String::new();
            (&mut file)
                .take(4096)
                .read_to_string(&mut target)
                .map_err(|e| corrupt(archive, &name, e))?;
            stage.symlinks.push((name, comps, target));
        } else if file.is_dir() {
            stage.dir(&comps)?;
        } else {
            stage.file(&name, &comps, mode, &mut file)?;
        }
    }
    Ok(())
}

/// Unpacks `archive` into `prefix` with the default bound; see [`install_with`].
pub fn install(archive: &Path, format: Format, prefix: &Path, replace: bool) -> Result<PathBuf> {
    install_with(
        archive,
        format,
        prefix,
        InstallOptions {
            replace,
            max_unpacked: None,
        },
    )
    .map(|i| i.prefix)
}

/// Refuses `--replace` early for a directory without `lib/libnvshmem_host.so.3`.
fn require_host_lib(dir: &Path) -> Result<()> {
    if fs::symlink_metadata(dir.join(HOST_LIB)).is_err() {
        return Err(Error::Usage(format!(
            "--prefix {} is not an earlier NVSHMEM install (it has no {HOST_LIB}), so --replace does not remove it; \
             pick a new directory, or remove it yourself if you mean to",
            dir.display()
        )));
    }
    Ok(())
}

/// Whether `dir` (an existing directory) holds an earlier NVSHMEM install that `--replace`
/// may remove: it has `lib/libnvshmem_host.so.3` (what every install has, and what `env`
/// checks), and nothing at the top but [`INSTALL_ENTRIES`], `LICENSE*` files and the
/// top-level entries of the archive being installed (`also`). Returns what it holds;
/// otherwise a usage error naming what is missing or foreign, and the fix.
pub fn earlier_install(dir: &Path, also: &[String]) -> Result<Replaced> {
    let shown = dir.display();
    require_host_lib(dir)?;
    let mut entries = Vec::new();
    let mut foreign = Vec::new();
    for e in fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let is_dir = e
            .file_type()
            .map_err(|err| Error::io(e.path(), err))?
            .is_dir();
        if (is_dir && INSTALL_ENTRIES.contains(&name.as_str()))
            || (!is_dir && name.to_ascii_lowercase().starts_with("license"))
            || also.contains(&name)
        {
            entries.push(if is_dir { format!("{name}/") } else { name });
        } else {
            foreign.push(name);
        }
    }
    if !foreign.is_empty() {
        foreign.sort();
        return Err(Error::Usage(format!(
            "--prefix {shown} is not an earlier NVSHMEM install: it also holds {}, which NVSHMEM does not install \
             (an install has only {}, LICENSE* files and what this archive has at its top), so --replace does not remove it; \
             move those out (or remove the directory yourself) and run again",
            foreign.join(", "),
            INSTALL_ENTRIES.join("/, ") + "/"
        )));
    }
    entries.sort();
    Ok(Replaced {
        entries,
        files: count_files(dir)?,
    })
}

/// Non-directory entries below `dir` (symlinks are not followed).
fn count_files(dir: &Path) -> Result<u64> {
    let mut n = 0;
    for e in fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        if e.file_type()
            .map_err(|err| Error::io(e.path(), err))?
            .is_dir()
        {
            n += count_files(&e.path())?;
        } else {
            n += 1;
        }
    }
    Ok(n)
}

/// Unpacks `archive` into `prefix`. `prefix` must not exist or be an empty directory, unless
/// `opts.replace` is set and it holds an earlier install ([`earlier_install`]); that one is
/// swapped out only after the new tree is complete. Adds
/// `lib/libnvshmem_host.so -> libnvshmem_host.so.3` when missing. On error nothing changed:
/// parent directories created for the prefix are removed again.
pub fn install_with(
    archive: &Path,
    format: Format,
    prefix: &Path,
    opts: InstallOptions,
) -> Result<Installed> {
    let prefix = absolute(prefix)?;
    let shown = prefix.display();
    let mut replace_existing = false;
    match fs::symlink_metadata(&prefix) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(Error::Usage(format!(
                "--prefix {shown} is a symlink; pass the directory it points to"
            )))
        }
        Ok(m) if !m.is_dir() => {
            let what = if m.is_file() {
                "a file"
            } else {
                "a special file"
            };
            return Err(Error::Usage(format!(
                "--prefix {shown} is {what}, not a directory; pick a directory path (a missing one is created) or move the file away"
            )));
        }
        Ok(_) => {
            let empty = fs::read_dir(&prefix)
                .map_err(|e| Error::io(&prefix, e))?
                .next()
                .is_none();
            if !empty {
                if !opts.replace {
                    return Err(Error::Usage(format!(
                        "--prefix {shown} exists and is not empty; pick a new directory, or pass --replace if it holds an earlier NVSHMEM install"
                    )));
                }
                require_host_lib(&prefix)?;
                replace_existing = true;
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(&prefix, e)),
    }
    let parent = prefix
        .parent()
        .ok_or_else(|| Error::Usage("--prefix must not be /".into()))?
        .to_path_buf();
    // Ancestors that do not exist yet, deepest first: removed again on failure.
    let created: Vec<PathBuf> = parent
        .ancestors()
        .take_while(|d| fs::symlink_metadata(d).is_err())
        .map(Path::to_path_buf)
        .collect();
    let limit = match opts.max_unpacked {
        Some(n) => (n, "--max-unpacked-size".to_string()),
        None => {
            let size = fs::metadata(archive)
                .map_err(|e| Error::io(archive, e))?
                .len();
            (
                size.saturating_mul(UNPACKED_RATIO),
                format!("{UNPACKED_RATIO} times the archive's {size} bytes"),
            )
        }
    };
    let result = (|| {
        fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
        publish(archive, format, &prefix, &parent, replace_existing, limit)
    })();
    if result.is_err() {
        for d in &created {
            let _ = fs::remove_dir(d);
        }
    }
    result.map(|replaced| Installed { prefix, replaced })
}

/// Unpacks into a staging directory in `parent` and renames it to `prefix`. With
/// `occupied`, the prefix must hold an earlier install ([`earlier_install`], checked against
/// the new tree's top level), which is swapped out and described in the result.
fn publish(
    archive: &Path,
    format: Format,
    prefix: &Path,
    parent: &Path,
    occupied: bool,
    (limit, limit_why): (u64, String),
) -> Result<Option<Replaced>> {
    let staging = tempfile::Builder::new()
        .prefix(".deepep-nix-install-")
        .tempdir_in(parent)
        .map_err(|e| Error::io(parent, e))?;
    let mut stage = Stager {
        root: staging.path(),
        archive,
        symlinks: Vec::new(),
        hardlinks: Vec::new(),
        written: 0,
        limit,
        limit_why,
    };
    match format {
        Format::TarXz => unpack_tar_xz(archive, &mut stage)?,
        Format::Wheel => unpack_wheel(archive, &mut stage)?,
    }
    stage.finish()?;
    let host = staging.path().join(HOST_LIB);
    if !host.is_file() {
        return Err(Error::Usage(format!(
            "{} has no {HOST_LIB}; it is not an NVSHMEM archive",
            archive.display()
        )));
    }
    let link = staging.path().join(HOST_LIB_LINK);
    if fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink("libnvshmem_host.so.3", &link)
            .map_err(|e| Error::io(&link, e))?;
    }
    set_mode(staging.path(), 0o755)?;
    let replaced = if occupied {
        let mut tops = Vec::new();
        for e in fs::read_dir(staging.path()).map_err(|e| Error::io(staging.path(), e))? {
            let e = e.map_err(|e| Error::io(staging.path(), e))?;
            tops.push(e.file_name().to_string_lossy().into_owned());
        }
        Some(earlier_install(prefix, &tops)?)
    } else {
        None
    };
    // Publish: the staging dir becomes the prefix in one rename.
    let staged = staging.keep();
    let result = (|| {
        if prefix.exists() {
            if occupied {
                let old = tempfile::Builder::new()
                    .prefix(".deepep-nix-old-")
                    .tempdir_in(parent)
                    .map_err(|e| Error::io(parent, e))?;
                let old_path = old.path().join("prefix");
                fs::rename(prefix, &old_path).map_err(|e| Error::io(prefix, e))?;
                fs::rename(&staged, prefix).map_err(|e| Error::io(prefix, e))?;
                drop(old); // removes the previous tree
            } else {
                fs::remove_dir(prefix).map_err(|e| Error::io(prefix, e))?;
                fs::rename(&staged, prefix).map_err(|e| Error::io(prefix, e))?;
            }
        } else {
            fs::rename(&staged, prefix).map_err(|e| Error::io(prefix, e))?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&staged);
    }
    result.map(|()| replaced)
}

fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        Ok(std::env::current_dir()
            .map_err(|e| Error::io(".", e))?
            .join(p))
    }
}

/// Shell syntax for [`exports`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Shell {
    /// POSIX sh, bash, zsh.
    Sh,
    /// fish.
    Fish,
}

/// `s` in single quotes for POSIX shells.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn fish_quote(s: &str) -> String {
    format!("'{}'", s.replace('\\', r"\\").replace('\'', r"\'"))
}

/// The environment that makes an install usable (what DeepEP's build and the kernels
/// read): `NVSHMEM_DIR`, `LD_LIBRARY_PATH` with `$NVSHMEM_DIR/lib`, `PATH` with
/// `$NVSHMEM_DIR/bin`.
pub fn exports(prefix: &Path, shell: Shell) -> String {
    let dir = prefix.display().to_string();
    match shell {
        Shell::Sh => format!(
            "export NVSHMEM_DIR={}\n\
             export LD_LIBRARY_PATH=\"$NVSHMEM_DIR/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\"\n\
             export PATH=\"$NVSHMEM_DIR/bin:$PATH\"\n",
            sh_quote(&dir)
        ),
        Shell::Fish => format!(
            "set -gx NVSHMEM_DIR {}\n\
             set -gx LD_LIBRARY_PATH $NVSHMEM_DIR/lib $LD_LIBRARY_PATH\n\
             set -gx PATH $NVSHMEM_DIR/bin $PATH\n",
            fish_quote(&dir)
        ),
    }
}

/// Checks that `prefix` holds an NVSHMEM install; returns its absolute path.
pub fn check_prefix(prefix: &Path) -> Result<PathBuf> {
    let p = absolute(prefix)?;
    if !p.join(HOST_LIB).is_file() {
        return Err(Error::Usage(format!(
            "{} has no {HOST_LIB}; it is not an NVSHMEM install (create one with `deepep-nix install --prefix {}`)",
            p.display(),
            p.display()
        )));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        s.split('/').map(str::to_string).collect()
    }

    #[test]
    fn resolver_follows_archive_links() {
        let mut links = HashMap::new();
        assert_eq!(
            resolve_inside(&v("lib/libx.so"), "libx.so.3", &links).unwrap(),
            v("lib/libx.so.3")
        );
        assert!(resolve_inside(&v("lib/x"), "../../etc/passwd", &links).is_err());
        assert!(resolve_inside(&v("lib/x"), "/etc/passwd", &links).is_err());
        // a/b -> .. is harmless alone (points at the root), but a/b/../x then escapes.
        links.insert(v("a/b"), "..".to_string());
        assert_eq!(
            resolve_inside(&v("a/b"), "..", &links).unwrap(),
            Vec::<String>::new()
        );
        assert!(resolve_inside(&v("t"), "a/b/../x", &links).is_err());
        links.insert(v("loop"), "loop".to_string());
        assert!(resolve_inside(&v("y"), "loop", &links)
            .unwrap_err()
            .contains("loops"));
    }

    #[test]
    fn exports_quote_the_prefix() {
        let e = exports(Path::new("/opt/it's"), Shell::Sh);
        assert!(e.starts_with("export NVSHMEM_DIR='/opt/it'\\''s'\n"), "{e}");
        assert!(e.contains("$NVSHMEM_DIR/lib") && e.contains("$NVSHMEM_DIR/bin"));
        let f = exports(Path::new("/opt/x"), Shell::Fish);
        assert!(f.starts_with("set -gx NVSHMEM_DIR '/opt/x'\n"), "{f}");
    }
}
