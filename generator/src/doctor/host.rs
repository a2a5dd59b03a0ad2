//! Read-only access to the host being checked: files below `--root`, the environment map and
//! external tools (`nvidia-smi`).
//!
//! Every path handed to [`Host`] is a *host* path (`/proc/driver/nvidia/params`); it is resolved
//! below the root directory, so tests describe whole hosts as directory trees. Reads never block:
//! anything that is not a regular file (a directory, a FIFO, a socket, a device) is reported as
//! unreadable instead of being opened, and text reads are capped.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::FileTypeExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Largest text file we read (procfs/sysfs/config files are tiny; this only bounds garbage).
const TEXT_CAP: u64 = 4 << 20;

/// Why a host file could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// Nothing exists at the path.
    Missing,
    /// Something exists but is not a regular file (`kind` says what).
    NotAFile(&'static str),
    /// The file exists but reading failed (permission denied, I/O error, too large).
    Io(String),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Missing => write!(f, "does not exist"),
            ReadError::NotAFile(kind) => write!(f, "is {kind}, not a regular file"),
            ReadError::Io(e) => write!(f, "cannot be read: {e}"),
        }
    }
}

/// Result of running an external tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolOutput {
    /// The tool could not be run here (not installed, or not meaningful for this root).
    Unavailable(String),
    /// The tool ran but failed (exit status, timeout); the text says how.
    Failed(String),
    /// Standard output of a successful run.
    Output(String),
}

/// External programs doctor consults. The real implementation runs them; tests substitute
/// recorded output because `nvidia-smi` cannot exist on a machine without a GPU.
pub trait Tools {
    /// Output of `nvidia-smi topo -m` (GPU interconnect matrix).
    fn nvidia_smi_topo(&self) -> ToolOutput;
}

/// Runs the real tools found on `PATH`, each with a time limit.
pub struct SystemTools {
    /// Longest time a tool may run before it is killed.
    pub timeout: Duration,
}

impl Default for SystemTools {
    fn default() -> Self {
        SystemTools {
            timeout: Duration::from_secs(15),
        }
    }
}

impl Tools for SystemTools {
    fn nvidia_smi_topo(&self) -> ToolOutput {
        run_with_timeout("nvidia-smi", &["topo", "-m"], self.timeout)
    }
}

/// Tools for a host that is not the running one (`--root` other than `/`): nothing can run.
pub struct NoTools(pub String);

impl Tools for NoTools {
    fn nvidia_smi_topo(&self) -> ToolOutput {
        ToolOutput::Unavailable(self.0.clone())
    }
}

/// How a program run by [`run_captured`] ended.
pub(crate) enum Ran {
    /// Not on PATH.
    NotFound,
    /// Could not start, was stopped at the timeout, or could not be waited for.
    Failed(String),
    /// Exited: its status, standard output and standard error.
    Exited(std::process::ExitStatus, String, String),
}

/// Runs `program args` with no standard input, capturing both outputs (drained on threads so a
/// chatty program cannot block on a full pipe), killing it after `timeout`.
pub(crate) fn run_captured(program: &str, args: &[&str], timeout: Duration) -> Ran {
    let mut child = match Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ran::NotFound,
        Err(e) => return Ran::Failed(format!("`{program}` could not start: {e}")),
    };
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Ran::Failed(format!(
                    "`{program}` did not finish within {} s and was stopped",
                    timeout.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Ran::Failed(format!("waiting for `{program}` failed: {e}")),
        }
    };
    let stdout = String::from_utf8_lossy(&out.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err.join().unwrap_or_default()).into_owned();
    Ran::Exited(status, stdout, stderr)
}

/// Runs `program args`, capturing stdout, killing it after `timeout`.
fn run_with_timeout(program: &str, args: &[&str], timeout: Duration) -> ToolOutput {
    match run_captured(program, args, timeout) {
        Ran::NotFound => ToolOutput::Unavailable(format!("`{program}` is not on PATH")),
        Ran::Failed(m) => ToolOutput::Failed(m.replace(
            &format!("`{program}`"),
            &format!("`{program} {}`", args.join(" ")),
        )),
        Ran::Exited(status, stdout, _) if status.success() => ToolOutput::Output(stdout),
        Ran::Exited(status, stdout, stderr) => {
            let msg = stderr
                .lines()
                .chain(stdout.lines())
                .find(|l| !l.trim().is_empty());
            ToolOutput::Failed(format!(
                "`{program} {}` exited with {status}{}",
                args.join(" "),
                msg.map(|m| format!(": {}", m.trim())).unwrap_or_default()
            ))
        }
    }
}

/// The host under inspection.
pub struct Host<'a> {
    root: PathBuf,
    env: &'a BTreeMap<String, String>,
    tools: &'a dyn Tools,
}

impl<'a> Host<'a> {
    pub fn new(root: &Path, env: &'a BTreeMap<String, String>, tools: &'a dyn Tools) -> Self {
        Host {
            root: root.to_path_buf(),
            env,
            tools,
        }
    }

    pub fn tools(&self) -> &dyn Tools {
        self.tools
    }

    /// Environment variable of the inspected process environment.
    pub fn env(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }

    /// All environment variables (sorted by name).
    pub fn env_map(&self) -> &BTreeMap<String, String> {
        self.env
    }

    /// Where a host path lives on this machine (below the root).
    pub fn real(&self, host_path: &Path) -> PathBuf {
        let mut p = self.root.clone();
        for c in host_path.components() {
            match c {
                Component::Normal(n) => p.push(n),
                // Never climb above the root.
                Component::ParentDir if p != self.root => {
                    p.pop();
                }
                _ => {}
            }
        }
        p
    }

    /// Kind of object at a host path, following symlinks; `None` if nothing is there.
    pub fn kind(&self, host_path: &Path) -> Option<FileKind> {
        fs::metadata(self.real(host_path))
            .ok()
            .map(|m| FileKind::of(&m.file_type()))
    }

    pub fn exists(&self, host_path: &Path) -> bool {
        self.real(host_path).exists()
    }

    pub fn is_dir(&self, host_path: &Path) -> bool {
        self.kind(host_path) == Some(FileKind::Dir)
    }

    /// Reads a (small) text file; invalid UTF-8 is replaced, never an error.
    pub fn read_text(&self, host_path: &Path) -> Result<String, ReadError> {
        let bytes = self.read_bytes(host_path, TEXT_CAP)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Reads a regular file of at most `cap` bytes.
    pub fn read_bytes(&self, host_path: &Path, cap: u64) -> Result<Vec<u8>, ReadError> {
        let real = self.real(host_path);
        let meta = match fs::metadata(&real) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ReadError::Missing),
            Err(e) => return Err(ReadError::Io(e.to_string())),
        };
        let kind = FileKind::of(&meta.file_type());
        if kind != FileKind::File {
            return Err(ReadError::NotAFile(kind.describe()));
        }
        let file = fs::File::open(&real).map_err(|e| ReadError::Io(e.to_string()))?;
        let mut buf = Vec::new();
        // procfs files report size 0, so read up to the cap instead of trusting the length.
        file.take(cap + 1)
            .read_to_end(&mut buf)
            .map_err(|e| ReadError::Io(e.to_string()))?;
        if buf.len() as u64 > cap {
            return Err(ReadError::Io(format!("larger than {cap} bytes")));
        }
        Ok(buf)
    }

    /// Names in a host directory, sorted; missing directory = `ReadError::Missing`.
    pub fn list_dir(&self, host_path: &Path) -> Result<Vec<String>, ReadError> {
        let real = self.real(host_path);
        match fs::metadata(&real) {
            Ok(m) if !m.is_dir() => return Err(ReadError::NotAFile("not a directory")),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ReadError::Missing),
            Err(e) => return Err(ReadError::Io(e.to_string())),
        }
        let rd = fs::read_dir(&real).map_err(|e| ReadError::Io(e.to_string()))?;
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        Ok(names)
    }

    /// Last component of a symlink's target (e.g. the driver name behind `device/driver`).
    pub fn link_name(&self, host_path: &Path) -> Option<String> {
        fs::read_link(self.real(host_path))
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
    }
}

/// What a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
    CharDevice,
    BlockDevice,
    Fifo,
    Socket,
    Other,
}

impl FileKind {
    fn of(t: &fs::FileType) -> FileKind {
        if t.is_file() {
            FileKind::File
        } else if t.is_dir() {
            FileKind::Dir
        } else if t.is_char_device() {
            FileKind::CharDevice
        } else if t.is_block_device() {
            FileKind::BlockDevice
        } else if t.is_fifo() {
            FileKind::Fifo
        } else if t.is_socket() {
            FileKind::Socket
        } else {
            FileKind::Other
        }
    }

    /// "a directory", "a FIFO", ...
    pub fn describe(self) -> &'static str {
        match self {
            FileKind::File => "a regular file",
            FileKind::Dir => "a directory",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Fifo => "a FIFO",
            FileKind::Socket => "a socket",
            FileKind::Other => "a special file",
        }
    }
}

/// Host path helper: `hp("/proc/x")`.
pub fn hp(s: &str) -> PathBuf {
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_time_out_and_report_failures() {
        let t = Duration::from_millis(300);
        let start = Instant::now();
        match run_with_timeout("sleep", &["10"], t) {
            ToolOutput::Failed(m) => assert!(m.contains("did not finish within"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the child was not stopped"
        );
        assert_eq!(
            run_with_timeout("deepep-doctor-no-such-tool", &[], t),
            ToolOutput::Unavailable("`deepep-doctor-no-such-tool` is not on PATH".into())
        );
        match run_with_timeout(
            "sh",
            &["-c", "echo boom >&2; exit 3"],
            Duration::from_secs(5),
        ) {
            ToolOutput::Failed(m) => assert!(m.ends_with(": boom"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            run_with_timeout("sh", &["-c", "echo GPU0"], Duration::from_secs(5)),
            ToolOutput::Output("GPU0\n".into())
        );
    }

    #[test]
    fn host_paths_stay_below_the_root() {
        let env = BTreeMap::new();
        let tools = NoTools(String::new());
        let host = Host::new(Path::new("/srv/root"), &env, &tools);
        assert_eq!(
            host.real(Path::new("/proc/cmdline")),
            Path::new("/srv/root/proc/cmdline")
        );
        assert_eq!(
            host.real(Path::new("/../../etc/passwd")),
            Path::new("/srv/root/etc/passwd")
        );
        assert_eq!(host.real(Path::new("/a/../b")), Path::new("/srv/root/b"));
    }
}

/// Facts about the host that change the wording of fixes.
#[derive(Debug, Clone, Default)]
pub struct HostKind {
    /// NixOS: fixes name `services.deepep` / `hardware.*` options instead of files and commands.
    pub nixos: bool,
}

impl HostKind {
    /// The fix text for this kind of host: `nixos` on NixOS (module options), else `other`.
    pub(crate) fn fix(&self, nixos: impl Into<String>, other: impl Into<String>) -> String {
        if self.nixos {
            nixos.into()
        } else {
            other.into()
        }
    }

    pub(crate) fn detect(host: &Host) -> HostKind {
        let os_release = host
            .read_text(Path::new("/etc/os-release"))
            .unwrap_or_default();
        let nixos = host.exists(Path::new("/etc/NIXOS"))
            || os_release
                .lines()
                .any(|l| l.trim() == "ID=nixos" || l.trim() == "ID=\"nixos\"");
        HostKind { nixos }
    }
}
