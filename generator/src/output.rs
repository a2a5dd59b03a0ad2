//! A set of file changes that is checked (`--check`) or applied all together: every file
//! whose bytes change is first written to a temporary file in its destination directory,
//! and only when all of them are written are they renamed into place (each rename is
//! atomic; a failure before the renames leaves every destination untouched). Files whose
//! bytes are already right are left alone.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// One intended change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Write { path: PathBuf, bytes: Vec<u8> },
    Delete { path: PathBuf },
}

/// How a file on disk compares to the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Unchanged,
    Created,
    Deleted,
    /// Lines only in the new / only in the old version, and the first line (1-based) that differs.
    Modified {
        added: usize,
        removed: usize,
        first_line: usize,
    },
}

/// The status of one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStatus {
    pub path: PathBuf,
    pub status: Status,
}

impl fmt::Display for FileStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.path.display();
        match &self.status {
            Status::Unchanged => write!(f, "unchanged  {p}"),
            Status::Created => write!(f, "new        {p}"),
            Status::Deleted => write!(f, "removed    {p}"),
            Status::Modified {
                added,
                removed,
                first_line,
            } => {
                write!(f, "changed    {p} (+{added} -{removed} lines, first difference at line {first_line})")
            }
        }
    }
}

/// Compares two texts line by line: counts of lines only in `new`, only in `old` (as
/// multisets), and the first differing line.
fn line_diff(old: &[u8], new: &[u8]) -> Status {
    let old_s = String::from_utf8_lossy(old);
    let new_s = String::from_utf8_lossy(new);
    let old_lines: Vec<&str> = old_s.split_inclusive('\n').collect();
    let new_lines: Vec<&str> = new_s.split_inclusive('\n').collect();
    let first_line = old_lines
        .iter()
        .zip(&new_lines)
        .take_while(|(a, b)| a == b)
        .count()
        + 1;
    let mut counts: HashMap<&str, isize> = HashMap::new();
    for l in &old_lines {
        *counts.entry(l).or_default() -= 1;
    }
    for l in &new_lines {
        *counts.entry(l).or_default() += 1;
    }
    let added = counts
        .values()
        .filter(|c| **c > 0)
        .map(|c| *c as usize)
        .sum();
    let removed = counts
        .values()
        .filter(|c| **c < 0)
        .map(|c| c.unsigned_abs())
        .sum();
    Status::Modified {
        added,
        removed,
        first_line,
    }
}

/// An ordered set of changes.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub changes: Vec<Change>,
}

impl Plan {
    pub fn write(&mut self, path: impl Into<PathBuf>, bytes: impl Into<Vec<u8>>) {
        self.changes.push(Change::Write {
            path: path.into(),
            bytes: bytes.into(),
        });
    }

    pub fn delete(&mut self, path: impl Into<PathBuf>) {
        self.changes.push(Change::Delete { path: path.into() });
    }

    /// Compares the plan with the disk, writing nothing.
    pub fn statuses(&self) -> Result<Vec<FileStatus>> {
        self.changes
            .iter()
            .map(|c| {
                let (path, status) = match c {
                    Change::Write { path, bytes } => {
                        let status = match std::fs::read(path) {
                            Ok(old) if old == *bytes => Status::Unchanged,
                            Ok(old) => line_diff(&old, bytes),
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Status::Created,
                            Err(e) => return Err(Error::io(path, e)),
                        };
                        (path, status)
                    }
                    Change::Delete { path } => (
                        path,
                        if path.exists() {
                            Status::Deleted
                        } else {
                            Status::Unchanged
                        },
                    ),
                };
                Ok(FileStatus {
                    path: path.clone(),
                    status,
                })
            })
            .collect()
    }

    /// Applies the plan: temp files first, then renames, then deletions. A file whose bytes
    /// would not change is not written at all (its inode and mtime stay, so nothing that
    /// watches it, such as a build script's `rerun-if-changed`, sees a change). On any
    /// failure before the renames, the temp files are removed and nothing on disk has changed.
    pub fn apply(&self) -> Result<Vec<FileStatus>> {
        let statuses = self.statuses()?;
        let mut staged: Vec<(tempfile::NamedTempFile, &Path)> = Vec::new();
        for (c, st) in self.changes.iter().zip(&statuses) {
            if st.status == Status::Unchanged {
                continue;
            }
            if let Change::Write { path, bytes } = c {
                let dir = path.parent().unwrap_or(Path::new("."));
                std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
                let mut tmp = tempfile::Builder::new()
                    .prefix(".deepep-nix-")
                    .tempfile_in(dir)
                    .map_err(|e| Error::io(dir, e))?;
                tmp.write_all(bytes)
                    .and_then(|_| tmp.as_file().sync_all())
                    .map_err(|e| Error::io(tmp.path(), e))?;
                staged.push((tmp, path));
            }
        }
        // Everything is staged (a failure above drops the temp files); now publish.
        for (tmp, path) in staged {
            set_readable(tmp.path())?;
            tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
        }
        for c in &self.changes {
            if let Change::Delete { path } = c {
                match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(Error::io(path, e)),
                }
            }
        }
        Ok(statuses)
    }
}

/// tempfile creates files mode 0600; generated files are ordinary 0644 files.
fn set_readable(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
            .map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// True when any status is a change.
pub fn has_drift(statuses: &[FileStatus]) -> bool {
    statuses.iter().any(|s| s.status != Status::Unchanged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_counts_lines() {
        assert_eq!(
            line_diff(b"a\nb\nc\n", b"a\nx\nc\n"),
            Status::Modified {
                added: 1,
                removed: 1,
                first_line: 2
            }
        );
        assert_eq!(
            line_diff(b"a\n", b"a\nb\n"),
            Status::Modified {
                added: 1,
                removed: 0,
                first_line: 2
            }
        );
    }

    #[test]
    fn apply_writes_all_and_check_sees_no_drift() {
        let d = tempfile::tempdir().unwrap();
        let mut plan = Plan::default();
        plan.write(d.path().join("a/x.json"), "1\n");
        plan.write(d.path().join("b.nix"), "2\n");
        let st = plan.apply().unwrap();
        assert!(st.iter().all(|s| s.status == Status::Created));
        assert_eq!(
            std::fs::read_to_string(d.path().join("a/x.json")).unwrap(),
            "1\n"
        );
        assert!(!has_drift(&plan.statuses().unwrap()));
        // no temp files left behind
        let leftovers: Vec<_> = std::fs::read_dir(d.path().join("a")).unwrap().collect();
        assert_eq!(leftovers.len(), 1);
    }
}
