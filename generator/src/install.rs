//! `install` and `env`: unpack a verified NVSHMEM archive (NVIDIA `.tar.xz` or PyPI wheel)
//! into a prefix safely, and print the shell exports that use it.
//!
//! Safety: every entry path must be relative without `..`; symlink and hard-link targets
//! must resolve inside the prefix (following the archive's own symlinks, so a chain of
//! individually harmless links cannot escape); symlinks are created last, so no file is
//! ever written through one. Everything is unpacked into a staging directory and renamed
//! into place at the end (inside an existing prefix, which is itself never renamed, so mount
//! points and prefixes in unwritable parents work; for a missing one, in its nearest existing
//! parent, so its missing parents appear only together with it); on any error the prefix and
//! its parents are as before. The same install run again is verified and changes nothing.
//! A signal (SIGINT, SIGTERM, SIGHUP) removes them as well, see [`crate::interrupt`].
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
use crate::interrupt::guarded;

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
    /// `Some(n)` when the prefix already held exactly what the archive installs (the same
    /// install run again): nothing was changed; `n` files and links were compared.
    pub unchanged: Option<u64>,
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
        guarded(|| fs::create_dir_all(&p)).map_err(|e| Error::io(&p, e))
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
        // Each step that writes holds the interrupt guard (reading the archive does not), so
        // a signal's cleanup never races with it; see `crate::interrupt`.
        let mut f = guarded(|| {
            if let Some(parent) = p.parent() {
                fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
            }
            File::create(&p).map_err(|e| Error::io(&p, e))
        })?;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match data.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(corrupt(self.archive, entry, e)),
            };
            self.count(entry, n as u64)?;
            guarded(|| f.write_all(&buf[..n])).map_err(|e| Error::io(&p, e))?;
        }
        guarded(|| set_mode(&p, if mode & 0o111 != 0 { 0o755 } else { 0o644 }))
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
                guarded(|| fs::create_dir_all(parent)).map_err(|e| Error::io(parent, e))?;
            }
            let len = fs::metadata(&src).map_err(|e| Error::io(&src, e))?.len();
            hard_copies.push((entry.clone(), src, dst, len));
        }
        for (entry, src, dst, len) in hard_copies {
            self.count(&entry, len)?;
            guarded(|| fs::copy(&src, &dst)).map_err(|e| Error::io(&dst, e))?;
        }
        for (_, at, target) in &self.symlinks {
            let p = self.path_of(at);
            guarded(|| {
                if let Some(parent) = p.parent() {
                    fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
                }
                std::os::unix::fs::symlink(target, &p).map_err(|e| Error::io(&p, e))
            })?;
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
    earlier_install_but(dir, also, &[])
}

/// [`earlier_install`], not looking at the entries named in `ignore` (this install's own
/// staging directory).
fn earlier_install_but(dir: &Path, also: &[String], ignore: &[String]) -> Result<Replaced> {
    let shown = dir.display();
    require_host_lib(dir)?;
    let mut entries = Vec::new();
    let mut foreign = Vec::new();
    let mut files = 0;
    for e in fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if ignore.contains(&name) {
            continue;
        }
        let is_dir = e
            .file_type()
            .map_err(|err| Error::io(e.path(), err))?
            .is_dir();
        files += if is_dir { count_files(&e.path())? } else { 1 };
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
             move those out (or remove the directory yourself) and run again{}",
            foreign.join(", "),
            INSTALL_ENTRIES.join("/, ") + "/",
            leftover_hint(dir, &foreign)
        )));
    }
    entries.sort();
    Ok(Replaced { entries, files })
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

/// Name prefix of the staging directory (beside a new prefix, or inside an existing one).
pub const STAGING_PREFIX: &str = ".deepep-nix-install-";
/// Name prefix of the directory inside the prefix that an earlier install is moved to.
pub const OLD_PREFIX: &str = ".deepep-nix-old-";

/// What an interrupted install may leave behind (when killed with SIGKILL, which cannot be
/// caught), among `names`.
fn leftovers(names: &[String]) -> Vec<&String> {
    names
        .iter()
        .filter(|n| n.starts_with(STAGING_PREFIX) || n.starts_with(OLD_PREFIX))
        .collect()
}

/// ` (… is what an interrupted install left behind: remove it with `rm -rf …`)` when
/// `names` (entries of `dir`) hold such leftovers, else nothing.
fn leftover_hint(dir: &Path, names: &[String]) -> String {
    let left = leftovers(names);
    if left.is_empty() {
        return String::new();
    }
    let paths: Vec<String> = left
        .iter()
        .map(|n| sh_quote(&dir.join(n).display().to_string()))
        .collect();
    format!(
        " ({} {} what an interrupted install left behind: remove {} with `rm -rf {}`)",
        left.iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        if left.len() == 1 { "is" } else { "are" },
        if left.len() == 1 { "it" } else { "them" },
        paths.join(" ")
    )
}

/// The entries of directory `dir`, by name.
fn names_in(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        out.push(e.file_name().to_string_lossy().into_owned());
    }
    out.sort();
    Ok(out)
}

/// Whether `e` means this user may not write there (permissions, or a read-only mount).
/// (A read-only mount is not this: [`explain_fs_error`] reports it with its own fix.)
fn not_writable(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::PermissionDenied && e.raw_os_error() != Some(libc::EROFS)
}

/// The directory an install into `prefix` locks: the prefix when it is a directory, else its
/// nearest existing ancestor (where the prefix and its missing parents will be created).
/// `None` when that is not a directory (the install then fails with its own message).
fn lock_target(prefix: &Path) -> Option<PathBuf> {
    match fs::symlink_metadata(prefix) {
        Ok(m) if m.is_dir() => return Some(prefix.to_path_buf()),
        Ok(_) => return None,
        Err(_) => {}
    }
    let dir = prefix
        .ancestors()
        .skip(1)
        .find(|d| fs::symlink_metadata(d).is_ok())?;
    fs::metadata(dir)
        .ok()
        .filter(|m| m.is_dir())
        .map(|_| dir.to_path_buf())
}

/// The PID holding an flock on the file with `dev`/`ino`, from /proc/locks.
fn flock_holder(dev: u64, ino: u64) -> Option<u32> {
    let want = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    let locks = fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; waiters have "->" after the number.
        (f.len() >= 6 && f[1] == "FLOCK" && f[5] == want)
            .then(|| f[4].parse().ok())
            .flatten()
    })
}

/// An exclusive advisory lock (flock(2)) on the directory an install writes into, held until
/// dropped. Where the file system has no flock (some network file systems), installs go on
/// unlocked after a warning.
pub struct PrefixLock {
    _dir: Option<File>,
}

impl PrefixLock {
    /// Locks [`lock_target`] of `prefix`, waiting for another holder; `say` gets one line
    /// naming the holder's PID when it has to wait. Re-checks the target after each wait (the
    /// prefix may have been created meanwhile) so that two installs always lock the same
    /// directory.
    pub fn acquire(prefix: &Path, say: &mut dyn FnMut(String)) -> Result<PrefixLock> {
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::io::AsRawFd;
        let mut told = false;
        loop {
            let Some(dir) = lock_target(prefix) else {
                return Ok(PrefixLock { _dir: None });
            };
            let f = File::open(&dir).map_err(|e| Error::io(&dir, e))?;
            let fd = f.as_raw_fd();
            // SAFETY: flock on an open descriptor we own.
            if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    tracing::warn!(
                        "cannot lock {} ({e}); another install into {} at the same time would not be noticed",
                        dir.display(),
                        prefix.display()
                    );
                    return Ok(PrefixLock { _dir: None });
                }
                if !told {
                    let m = f.metadata().map_err(|e| Error::io(&dir, e))?;
                    let who = flock_holder(m.dev(), m.ino())
                        .map_or("another deepep-nix install".to_string(), |pid| {
                            format!("another deepep-nix install (PID {pid})")
                        });
                    say(if dir == prefix {
                        format!(
                            "waiting: {who} is installing into {}; this one goes on when it has finished \
                             (Ctrl-C stops waiting and changes nothing)",
                            prefix.display()
                        )
                    } else {
                        // The prefix does not exist yet: the lock is its nearest existing
                        // ancestor's, which installs of other new prefixes below it take too.
                        format!(
                            "waiting: {who} holds the install lock on {} (it installs into a new prefix below it, \
                             or into it); this install into {} goes on when it has finished \
                             (Ctrl-C stops waiting and changes nothing)",
                            dir.display(),
                            prefix.display()
                        )
                    });
                    told = true;
                }
                loop {
                    // SAFETY: as above; blocking until the holder releases the lock.
                    if unsafe { libc::flock(fd, libc::LOCK_EX) } == 0 {
                        break;
                    }
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(Error::io(&dir, e));
                    }
                }
            }
            if lock_target(prefix).as_deref() == Some(dir.as_path()) {
                return Ok(PrefixLock { _dir: Some(f) });
            }
            // The prefix appeared (or went) while waiting: lock what is there now.
        }
    }
}

/// The mount point of the file system holding existing path `p`: the highest ancestor on the
/// same device.
fn mount_point(p: &Path) -> PathBuf {
    use std::os::unix::fs::MetadataExt;
    let Ok(dev) = fs::metadata(p).map(|m| m.dev()) else {
        return p.to_path_buf();
    };
    let mut top = p.to_path_buf();
    for a in p.ancestors().skip(1) {
        match fs::metadata(a) {
            Ok(m) if m.dev() == dev => top = a.to_path_buf(),
            _ => break,
        }
    }
    top
}

/// Free bytes for unprivileged users on the file system holding existing path `p`.
fn free_bytes(p: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a zeroed struct to fill.
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// A full or read-only file system, wherever in the install it was hit (often in the hidden
/// staging directory), said about the prefix, with the fix. Other errors pass unchanged.
fn explain_fs_error(e: Error, prefix: &Path) -> Error {
    let Error::Io { source, .. } = &e else {
        return e;
    };
    // tempfile wraps its errors (no raw code then); their kind still says it. (Compared by
    // name: these kinds are newer than the crate's minimum Rust.)
    let code = source
        .raw_os_error()
        .or_else(|| match format!("{:?}", source.kind()).as_str() {
            "StorageFull" => Some(libc::ENOSPC),
            "QuotaExceeded" => Some(libc::EDQUOT),
            "ReadOnlyFilesystem" => Some(libc::EROFS),
            _ => None,
        });
    let at = prefix
        .ancestors()
        .find(|d| fs::symlink_metadata(d).is_ok())
        .unwrap_or(Path::new("/"));
    let mount = mount_point(at);
    let shown = prefix.display();
    match code {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
            let free = free_bytes(at).map_or("too little".to_string(), |b| {
                format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
            });
            Error::Usage(format!(
                "not enough space to install into --prefix {shown}: the file system mounted at {} has {free} free \
                 ({}); nothing was installed and the partial files were removed. Free space there (`df -h {}`), \
                 or pick a --prefix on a file system with more room",
                mount.display(),
                if code == Some(libc::EDQUOT) { "disk quota exceeded" } else { "no space left on device" },
                sh_quote(&at.display().to_string()),
            ))
        }
        Some(libc::EROFS) => Error::Usage(format!(
            "cannot install into --prefix {shown}: the file system mounted at {} is read-only; nothing was installed. \
             Pick a --prefix on a writable file system, or remount it read-write (`sudo mount -o remount,rw {}`) and run again",
            mount.display(),
            sh_quote(&mount.display().to_string()),
        )),
        _ => e,
    }
}

/// The error without the random staging path tempfile appends (`… at path "…"`), which
/// says nothing to the user.
fn os_error(e: io::Error) -> io::Error {
    if e.raw_os_error().is_some() {
        return e;
    }
    let text = e.to_string();
    match text.split_once(" at path ") {
        Some((msg, _)) => io::Error::new(e.kind(), msg.to_string()),
        None => e,
    }
}

/// Unpacks `archive` into `prefix`. `prefix` must not exist or be an empty directory, unless
/// `opts.replace` is set and it holds an earlier install ([`earlier_install`]); that one is
/// swapped out only after the new tree is complete. Adds
/// `lib/libnvshmem_host.so -> libnvshmem_host.so.3` when missing.
///
/// Where it stages: a prefix that exists (empty, or an earlier install) is never renamed or
/// removed; the archive is unpacked into a staging directory inside it, whose entries are
/// then renamed into place (an earlier install's entries first into a directory beside
/// them), all or none: a failed rename moves back what was moved. So a mount point works,
/// and so does a prefix whose parent the user may not write; the directory keeps its owner,
/// mode and inode. A missing prefix is staged beside itself in its parent (created as
/// needed) and renamed into place in one step.
///
/// On error the prefix is as before, and parent directories created for it are removed
/// again. The steps are registered with [`crate::interrupt`], so a signal handled there
/// removes the staging directory and those parents too.
///
/// Concurrent installs: the whole install holds an exclusive lock ([`PrefixLock`]) on the
/// prefix directory, or, while the prefix does not exist yet, on its nearest existing
/// ancestor. A second install into the same prefix waits for the first (saying so once, with
/// the first one's PID) and then sees the first one's result; it never takes the first one's
/// staging directory for a leftover.
///
/// A read-only or full file system is reported naming the prefix and the fix, not the
/// staging path where the write failed.
pub fn install_with(
    archive: &Path,
    format: Format,
    prefix: &Path,
    opts: InstallOptions,
) -> Result<Installed> {
    let prefix = absolute(prefix)?;
    let _lock = PrefixLock::acquire(&prefix, &mut |msg| eprintln!("{msg}"))?;
    install_locked(archive, format, &prefix, opts).map_err(|e| explain_fs_error(e, &prefix))
}

fn install_locked(
    archive: &Path,
    format: Format,
    prefix: &Path,
    opts: InstallOptions,
) -> Result<Installed> {
    let prefix = prefix.to_path_buf();
    let shown = prefix.display();
    // `None`: missing; `Some(occupied)`: an existing directory, holding an earlier install.
    let existing = match fs::symlink_metadata(&prefix) {
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
            let names = names_in(&prefix)?;
            if names.is_empty() {
                Some(false)
            } else if !opts.replace {
                let refusal = |why: String| {
                    Error::Usage(format!(
                        "--prefix {shown} exists and is not empty{}{why}; pick a new directory, or pass --replace if it holds an earlier NVSHMEM install",
                        leftover_hint(&prefix, &names)
                    ))
                };
                if fs::symlink_metadata(prefix.join(HOST_LIB)).is_err() {
                    return Err(refusal(String::new()));
                }
                // An install: the same one run again is verified and changes nothing.
                return match same_install(archive, format, &prefix, unpack_limit(archive, opts)?) {
                    Ok(Ok(files)) => Ok(Installed {
                        prefix,
                        replaced: None,
                        unchanged: Some(files),
                    }),
                    Ok(Err(difference)) => Err(refusal(format!(
                        " and holds another NVSHMEM install than this archive ({difference})"
                    ))),
                    Err(e) => Err(refusal(format!(
                        " (comparing it with this archive failed: {e})"
                    ))),
                };
            } else {
                require_host_lib(&prefix)?;
                Some(true)
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            // A part of the path is a file (`--prefix /tmp/notes.txt/pfx`).
            let file = prefix
                .ancestors()
                .skip(1)
                .find(|d| fs::symlink_metadata(d).is_ok())
                .unwrap_or(Path::new("/"));
            return Err(Error::Usage(format!(
                "--prefix {shown} is below {}, which is a file, not a directory; pick a prefix whose existing parts are \
                 directories (a missing prefix and its missing parents are created)",
                file.display()
            )));
        }
        Err(e) => return Err(Error::io(&prefix, e)),
    };
    let limit = unpack_limit(archive, opts)?;
    let replaced = match existing {
        None => install_new(archive, format, &prefix, limit).map(|()| None),
        Some(occupied) => install_existing(archive, format, &prefix, occupied, limit),
    }?;
    Ok(Installed {
        prefix,
        replaced,
        unchanged: None,
    })
}

/// The bound on the unpacked bytes and where it comes from (for the message).
fn unpack_limit(archive: &Path, opts: InstallOptions) -> Result<(u64, String)> {
    Ok(match opts.max_unpacked {
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
    })
}

/// Whether `prefix` holds exactly what `archive` installs: the archive is unpacked into a
/// temporary directory (the prefix is not written) and the two trees are compared: the same
/// names, kinds, file contents and permission bits, link targets. `Ok(Ok(n))`: identical, `n`
/// files and links compared; `Ok(Err(what))`: the first difference.
fn same_install(
    archive: &Path,
    format: Format,
    prefix: &Path,
    limit: (u64, String),
) -> Result<std::result::Result<u64, String>> {
    use crate::interrupt::{guard, Undo};
    let (fresh, ticket) = {
        let mut g = guard();
        let fresh = tempfile::tempdir().map_err(|e| Error::io(std::env::temp_dir(), e))?;
        let ticket = g.register(Undo::Tree(fresh.path().to_path_buf()));
        (fresh, ticket)
    };
    let result = unpack_into(archive, format, fresh.path(), limit).map(|()| {
        let mut files = 0;
        same_tree(fresh.path(), prefix, Path::new(""), &mut files).map(|()| files)
    });
    forget_all(vec![ticket], || drop(fresh));
    result
}

/// Whether two files have the same bytes (read in chunks).
fn same_bytes(a: &Path, b: &Path) -> bool {
    let (Ok(mut fa), Ok(mut fb)) = (File::open(a), File::open(b)) else {
        return false;
    };
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    loop {
        let Ok(n) = fa.read(&mut ba) else {
            return false;
        };
        if n == 0 {
            return fb.read(&mut bb).is_ok_and(|m| m == 0);
        }
        if fb.read_exact(&mut bb[..n]).is_err() || ba[..n] != bb[..n] {
            return false;
        }
    }
}

/// Compares the trees `a` (the archive's) and `b` (the prefix) below `rel`.
fn same_tree(a: &Path, b: &Path, rel: &Path, files: &mut u64) -> std::result::Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let names = |d: &Path| names_in(d).map_err(|e| e.to_string());
    let (na, nb) = (names(&a.join(rel))?, names(&b.join(rel))?);
    if let Some(n) = nb.iter().find(|n| !na.contains(n)) {
        return Err(format!("{} is not in the archive", rel.join(n).display()));
    }
    if let Some(n) = na.iter().find(|n| !nb.contains(n)) {
        return Err(format!("{} is missing", rel.join(n).display()));
    }
    for n in na {
        let r = rel.join(&n);
        let (pa, pb) = (a.join(&r), b.join(&r));
        let meta = |p: &Path| fs::symlink_metadata(p).map_err(|e| format!("{}: {e}", p.display()));
        let (ma, mb) = (meta(&pa)?, meta(&pb)?);
        let differs = |what: &str| Err(format!("{} {what}", r.display()));
        if ma.file_type().is_symlink() || mb.file_type().is_symlink() {
            if fs::read_link(&pa).ok() != fs::read_link(&pb).ok() {
                return differs("is another link");
            }
            *files += 1;
        } else if ma.is_dir() || mb.is_dir() {
            if ma.is_dir() != mb.is_dir() {
                return differs("is of another kind");
            }
            same_tree(a, b, &r, files)?;
        } else {
            if ma.permissions().mode() & 0o7777 != mb.permissions().mode() & 0o7777 {
                return differs("has other permissions");
            }
            if ma.len() != mb.len() || !same_bytes(&pa, &pb) {
                return differs("has other contents");
            }
            *files += 1;
        }
    }
    Ok(())
}

/// Unpacks `archive` into the (empty) directory `root` and completes the tree: links
/// checked and created, `lib/libnvshmem_host.so.3` required, the unversioned link added.
fn unpack_into(
    archive: &Path,
    format: Format,
    root: &Path,
    (limit, limit_why): (u64, String),
) -> Result<()> {
    let mut stage = Stager {
        root,
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
    let host = root.join(HOST_LIB);
    if !host.is_file() {
        return Err(Error::Usage(format!(
            "{} has no {HOST_LIB}; it is not an NVSHMEM archive",
            archive.display()
        )));
    }
    let link = root.join(HOST_LIB_LINK);
    if fs::symlink_metadata(&link).is_err() {
        guarded(|| std::os::unix::fs::symlink("libnvshmem_host.so.3", &link))
            .map_err(|e| Error::io(&link, e))?;
    }
    Ok(())
}

/// Forgets `tickets`; with `also` run first, under the same guard (so a signal sees either
/// the registrations or the result of `also`).
fn forget_all(tickets: Vec<crate::interrupt::Ticket>, also: impl FnOnce()) {
    let mut g = crate::interrupt::guard();
    also();
    for t in tickets {
        g.forget(t);
    }
}

/// The mode a new directory gets from `mkdir` here: 0777 less this process's umask (read from
/// `/proc/self/status`, which does not change it; 022 where that line is missing).
fn mkdir_mode() -> u32 {
    let umask = fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|u| u32::from_str_radix(u.trim(), 8).ok())
        })
        .unwrap_or(0o022);
    0o777 & !umask
}

/// A missing prefix (and perhaps missing parents): the whole new subtree is built in a staging
/// directory in the nearest existing ancestor and renamed into place in one step, so another
/// process sees either nothing or the complete prefix, never a half-made parent (a parent that
/// appeared half-way would move the lock of a second install onto a directory this one does
/// not hold: [`PrefixLock`]). For `--prefix /x/a/b/pfx` with only `/x` existing, the staging
/// directory becomes `/x/a`.
fn install_new(archive: &Path, format: Format, prefix: &Path, limit: (u64, String)) -> Result<()> {
    use crate::interrupt::{guard, Undo};
    if prefix.parent().is_none() {
        return Err(Error::Usage("--prefix must not be /".into()));
    }
    // The highest missing directory of the prefix's path, and the existing one holding it.
    let top = prefix
        .ancestors()
        .take_while(|d| fs::symlink_metadata(d).is_err())
        .last()
        .unwrap_or(prefix)
        .to_path_buf();
    let base = top.parent().unwrap_or(Path::new("/")).to_path_buf();
    let cannot_create = |e: io::Error| {
        if !not_writable(&e) {
            return Error::io(&base, e);
        }
        let e = os_error(e);
        let p = sh_quote(&prefix.display().to_string());
        Error::Usage(format!(
            "cannot create --prefix {}: {} is not writable by you ({e}); create the prefix and make it yours \
             (`sudo mkdir -p {p} && sudo chown \"$USER\" {p}`), then run again (install writes only inside it), \
             or pick a prefix below a directory you can write",
            prefix.display(),
            base.display()
        ))
    };
    let mut tickets = Vec::new();
    let result = (|| {
        let staging = {
            let mut g = guard();
            let staging = tempfile::Builder::new()
                .prefix(STAGING_PREFIX)
                .tempdir_in(&base)
                .map_err(&cannot_create)?;
            tickets.push(g.register(Undo::Tree(staging.path().to_path_buf())));
            staging
        };
        // Where the prefix is inside the staging directory (the staging directory itself
        // when only the prefix is missing).
        let below = prefix.strip_prefix(&top).unwrap_or(Path::new(""));
        let root = staging.path().join(below);
        guarded(|| fs::create_dir_all(&root)).map_err(|e| Error::io(&root, e))?;
        unpack_into(archive, format, &root, limit)?;
        guarded(|| set_mode(&root, 0o755))?;
        if root != staging.path() {
            // It becomes a parent directory the user asked for: the mode mkdir gives.
            guarded(|| set_mode(staging.path(), mkdir_mode()))?;
        }
        // Publish: the staging directory becomes the top missing directory in one rename.
        let _g = guard();
        let staged = staging.keep();
        fs::rename(&staged, &top).map_err(|e| {
            let _ = fs::remove_dir_all(&staged);
            if fs::symlink_metadata(&top).is_ok() {
                // Only where flock is missing (some network file systems): the lock keeps
                // installs apart everywhere else.
                Error::Usage(format!(
                    "{} appeared while this install ran (another process created it; this file system has no \
                     flock to keep installs apart); nothing was installed: run again to see what is there now",
                    top.display()
                ))
            } else {
                Error::io(&top, e)
            }
        })
    })();
    forget_all(tickets, || {});
    result
}

/// An existing directory (empty, or with an earlier install when `occupied`): stage inside
/// it, then move the entries into place with [`swap`].
fn install_existing(
    archive: &Path,
    format: Format,
    prefix: &Path,
    occupied: bool,
    limit: (u64, String),
) -> Result<Option<Replaced>> {
    use crate::interrupt::{guard, Undo};
    let cannot_write = |e: io::Error| {
        if !not_writable(&e) {
            return Error::io(prefix, e);
        }
        let e = os_error(e);
        let p = sh_quote(&prefix.display().to_string());
        Error::Usage(format!(
            "--prefix {} is not writable by you ({e}); make it yours (`sudo chown \"$USER\" {p}`) or pick a directory you can write",
            prefix.display()
        ))
    };
    let mut tickets = Vec::new();
    let mut keep_old: Option<PathBuf> = None;
    let result = (|| {
        let staging = {
            let mut g = guard();
            let staging = tempfile::Builder::new()
                .prefix(STAGING_PREFIX)
                .tempdir_in(prefix)
                .map_err(cannot_write)?;
            tickets.push(g.register(Undo::Tree(staging.path().to_path_buf())));
            staging
        };
        unpack_into(archive, format, staging.path(), limit)?;
        let staging_name = file_name(staging.path());
        let replaced = if occupied {
            Some(earlier_install_but(
                prefix,
                &names_in(staging.path())?,
                std::slice::from_ref(&staging_name),
            )?)
        } else {
            None
        };
        let old = {
            let mut g = guard();
            let old = if occupied {
                let old = tempfile::Builder::new()
                    .prefix(OLD_PREFIX)
                    .tempdir_in(prefix)
                    .map_err(|e| Error::io(prefix, e))?;
                tickets.push(g.register(Undo::Tree(old.path().to_path_buf())));
                Some(old)
            } else {
                None
            };
            let skip: Vec<String> = std::iter::once(staging_name.clone())
                .chain(old.as_ref().map(|o| file_name(o.path())))
                .collect();
            if let Err((e, stranded)) = swap(
                prefix,
                staging.path(),
                old.as_ref().map(|o| o.path()),
                &skip,
            ) {
                if stranded {
                    // The earlier install is (partly) in `old`: not for a signal to remove.
                    if let Some(t) = tickets.pop() {
                        g.forget(t);
                    }
                    keep_old = old.map(|o| o.keep());
                }
                return Err(e);
            }
            old
        };
        // The new tree is in place: the previous one (moved aside) and the empty staging
        // directory go.
        drop(old);
        drop(staging);
        Ok(replaced)
    })();
    forget_all(tickets, || {});
    match (result, keep_old) {
        (Err(e), Some(old)) => Err(Error::io(
            &old,
            io::Error::other(format!(
                "{e}; moving the earlier install back failed too: its entries are in {}, move them back into {} by hand",
                old.display(),
                prefix.display()
            )),
        )),
        (result, _) => result,
    }
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Moves the entries of `staging` into `prefix`; with `old`, first moves the entries of
/// `prefix` (but those named in `skip`) into `old`. All or nothing: when a rename fails,
/// what was moved is moved back. The error says whether entries of the earlier install
/// could not be moved back (they are then still in `old`).
fn swap(
    prefix: &Path,
    staging: &Path,
    old: Option<&Path>,
    skip: &[String],
) -> std::result::Result<(), (Error, bool)> {
    let mut moved_old: Vec<String> = Vec::new();
    let mut moved_new: Vec<String> = Vec::new();
    let moved = (|| {
        if let Some(old) = old {
            for n in names_in(prefix)? {
                if skip.contains(&n) {
                    continue;
                }
                fs::rename(prefix.join(&n), old.join(&n))
                    .map_err(|e| Error::io(prefix.join(&n), e))?;
                moved_old.push(n);
            }
        }
        for n in names_in(staging)? {
            let to = prefix.join(&n);
            if fs::symlink_metadata(&to).is_ok() {
                return Err(Error::io(
                    &to,
                    io::Error::new(io::ErrorKind::AlreadyExists, "appeared while installing"),
                ));
            }
            fs::rename(staging.join(&n), &to).map_err(|e| Error::io(&to, e))?;
            moved_new.push(n);
        }
        Ok(())
    })();
    let Err(e) = moved else { return Ok(()) };
    for n in moved_new.iter().rev() {
        // Ours alone: removed where it cannot be moved back.
        if fs::rename(prefix.join(n), staging.join(n)).is_err() {
            let p = prefix.join(n);
            let _ = fs::remove_dir_all(&p).or_else(|_| fs::remove_file(&p));
        }
    }
    let mut stranded = false;
    if let Some(old) = old {
        for n in moved_old.iter().rev() {
            stranded |= fs::rename(old.join(n), prefix.join(n)).is_err();
        }
    }
    Err((e, stranded))
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
    /// POSIX sh, bash, zsh, dash, ksh (also accepted by those names, and as posix).
    #[value(aliases = ["posix", "bash", "zsh", "dash", "ksh"])]
    Sh,
    /// fish: load the output with `| source`.
    Fish,
}

/// The line (for stderr) that says how to load [`exports`] of `prefix` into the shell: `eval`
/// for POSIX shells; for fish, `| source`, because fish's `eval (...)` joins the lines of a
/// command substitution into one command (a single `set` of NVSHMEM_DIR to every word of all
/// three lines, without an error).
pub fn load_hint(prefix: &Path, shell: Shell) -> String {
    let p = sh_quote(&prefix.display().to_string());
    match shell {
        Shell::Sh => format!(
            "add it to your shell with the lines below, or: eval \"$(deepep-nix env --prefix {p})\""
        ),
        Shell::Fish => format!(
            "fish: load these lines with `deepep-nix env --prefix {p} --shell fish | source` (not with \
             `eval (...)`: fish joins the lines of a command substitution into one `set`, and NVSHMEM_DIR gets \
             every word of all three)"
        ),
    }
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

/// The release the flake's `nvshmem` is (pkgs/nvshmem/lib.nix `defaultVersion`,
/// `defaultCudaMajor`; a test keeps them equal): the one `env` suggests installing.
pub const DEFAULT_RELEASE: (&str, &str) = ("3.4.5", "13");

/// Checks that `prefix` holds an NVSHMEM install; returns its absolute path.
pub fn check_prefix(prefix: &Path) -> Result<PathBuf> {
    let p = absolute(prefix)?;
    if !p.join(HOST_LIB).is_file() {
        // A directory inside an install (`<install>/lib`, `<install>/include/...`): name the
        // install.
        if let Some(install) = p.ancestors().skip(1).find(|a| a.join(HOST_LIB).is_file()) {
            let inside = p.strip_prefix(install).unwrap_or(&p);
            return Err(Error::Usage(format!(
                "{} is the {}/ directory of the NVSHMEM install in {}; --prefix is the install itself: \
                 `deepep-nix env --prefix {}`",
                p.display(),
                inside.display(),
                install.display(),
                sh_quote(&install.display().to_string())
            )));
        }
        let (v, cuda) = DEFAULT_RELEASE;
        return Err(Error::Usage(format!(
            "{} has no {HOST_LIB}; it is not an NVSHMEM install (create one with \
             `deepep-nix install --version {v} --cuda {cuda} --prefix {}`, the release the flake's nvshmem is; \
             `deepep-nix releases` lists the others, and `--source pypi` takes the PyPI wheel where NVIDIA's host is not reachable)",
            p.display(),
            sh_quote(&p.display().to_string())
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

    /// Every entry below `dir` with its file bytes (directories as `<dir>`).
    fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                if p.is_dir() {
                    out.push((rel, b"<dir>".to_vec()));
                    stack.push(p);
                } else {
                    out.push((rel, fs::read(&p).unwrap()));
                }
            }
        }
        out.sort();
        out
    }

    fn put(dir: &Path, rel: &str, content: &str) {
        let p = dir.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    }

    #[test]
    fn swap_moves_everything_or_nothing() {
        // Without an earlier install: `bin` moves, then `lib` cannot (the prefix has one),
        // so `bin` moves back.
        let t = tempfile::tempdir().unwrap();
        let prefix = t.path().join("p");
        let staging = prefix.join(".s");
        put(&prefix, "lib/mine", "mine");
        put(&staging, "bin/x", "new");
        put(&staging, "lib/y", "new");
        let before = tree(&prefix);
        let (e, stranded) = swap(&prefix, &staging, None, &[".s".into()]).unwrap_err();
        assert!(e.to_string().contains("appeared while installing"), "{e}");
        assert!(!stranded);
        assert_eq!(tree(&prefix), before);
        // With one: its entries move aside first and come back when a later rename fails.
        let t = tempfile::tempdir().unwrap();
        let prefix = t.path().join("p");
        let (staging, old) = (prefix.join(".s"), prefix.join(".o"));
        put(&prefix, "include/old.h", "old");
        put(&prefix, "lib/libnvshmem_host.so.3", "old");
        put(
            &prefix,
            "keep/x",
            "skipped, so it stays and blocks the new keep/",
        );
        put(&staging, "bin/x", "new");
        put(&staging, "keep/y", "new");
        fs::create_dir(&old).unwrap();
        let before = tree(&prefix);
        let skip = [".s".to_string(), ".o".to_string(), "keep".to_string()];
        let (_, stranded) = swap(&prefix, &staging, Some(&old), &skip).unwrap_err();
        assert!(!stranded);
        assert_eq!(tree(&prefix), before);
        // And when nothing is in the way, the earlier install ends up in `old`.
        fs::remove_dir_all(prefix.join("keep")).unwrap();
        swap(&prefix, &staging, Some(&old), &skip).unwrap();
        assert_eq!(fs::read(prefix.join("keep/y")).unwrap(), b"new");
        assert_eq!(fs::read(old.join("include/old.h")).unwrap(), b"old");
        assert!(fs::read_dir(&staging).unwrap().next().is_none());
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
