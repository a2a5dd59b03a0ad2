//! `--nproc N`: spawn N ranks of the current executable on this host (one per GPU).
//!
//! Each child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`
//! and a free `MASTER_PORT`, plus `NVSHMEM_DISABLE_NVLS=1` and `NCCL_NVLS_ENABLE=0` (NVLink
//! multicast stays off on our machines). Its output lines are prefixed with `[rank i] `. When any
//! rank fails, the others get a grace period (`DEEPEP_LAUNCH_GRACE_S`, default 15 s) and are then
//! killed; the launcher reports which rank failed first and how, and returns an error.
//!
//! A binary runs as a rank (not as a launcher) whenever `RANK` is set in its environment, so the
//! children, torchrun and Slurm wrappers never launch recursively.
//!
//! Rank 0 may hand the launcher one final line ([`final_line`]), printed unprefixed after all ranks
//! exited, e.g. the `N passed, M failed` summary of `deepep-gpu-tests`.

use crate::error::{EpError, Result};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Exit code of a rank that stopped because another rank vanished (see
/// [`super::comm::peer_lost`]); the launcher then looks for the cause elsewhere.
pub const EXIT_PEER_LOST: u8 = 4;

/// The exit code for a rank that fails with an error: [`EXIT_PEER_LOST`] when a peer vanished,
/// else `code`.
pub fn error_exit_code(code: u8) -> u8 {
    if super::comm::peer_lost() {
        EXIT_PEER_LOST
    } else {
        code
    }
}

/// Env var through which rank 0 hands its final line to the launcher (a file path).
pub const FINAL_LINE_ENV: &str = "DEEPEP_LAUNCHER_FINAL_LINE";

/// Whether this process is a rank started by a launcher (ours, torchrun, Slurm wrapper).
pub fn is_rank_process() -> bool {
    std::env::var_os("RANK").is_some()
}

/// Print `line` as the last line of the run: under our launcher, rank 0 passes it to the launcher
/// (which prints it unprefixed after every rank exited); otherwise it is printed directly.
pub fn final_line(rank: usize, line: &str) {
    if rank != 0 {
        return;
    }
    if let Some(path) = std::env::var_os(FINAL_LINE_ENV) {
        if std::fs::write(&path, format!("{line}\n")).is_ok() {
            return;
        }
    }
    println!("{line}");
}

/// How one rank ended.
#[derive(Debug, Clone)]
pub struct RankExit {
    pub rank: usize,
    pub status: Option<ExitStatus>,
    /// Killed by the launcher after another rank failed.
    pub killed: bool,
}

fn describe(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(c) = status.code() {
        format!("exited with code {c}")
    } else if let Some(sig) = status.signal() {
        let name = match sig {
            6 => " (SIGABRT)",
            9 => " (SIGKILL)",
            11 => " (SIGSEGV)",
            15 => " (SIGTERM)",
            7 => " (SIGBUS)",
            _ => "",
        };
        format!("was killed by signal {sig}{name}")
    } else {
        format!("ended with {status}")
    }
}

/// Spawn `nproc` ranks of the current executable with `args`, wait for all, report failures.
/// Returns `Ok(())` only when every rank exited with code 0.
pub fn launch(nproc: usize, args: &[String]) -> Result<()> {
    let exe = std::env::current_exe()?;
    launch_program(&exe, nproc, args)
}

/// Like [`launch`] for an explicit program.
pub fn launch_program(program: &std::path::Path, nproc: usize, args: &[String]) -> Result<()> {
    if nproc == 0 {
        return Err(EpError::InvalidArgument("--nproc must be at least 1".into()));
    }
    let grace = Duration::from_secs_f64(crate::runtime::env_num::<f64>("DEEPEP_LAUNCH_GRACE_S")?.unwrap_or(15.0));
    let port = super::comm::free_port()?;
    let final_file = std::env::temp_dir().join(format!("deepep-final-{}-{port}", std::process::id()));
    let _ = std::fs::remove_file(&final_file);

    // One waiter thread per child reports (rank, status) the moment it exits, so the first
    // failure is identified by time, not by polling order.
    let (tx, rx) = std::sync::mpsc::channel::<(usize, std::io::Result<ExitStatus>)>();
    let mut pids: Vec<u32> = Vec::with_capacity(nproc);
    let mut pumps = Vec::new();
    for rank in 0..nproc {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("NVSHMEM_DISABLE_NVLS", "1")
            .env("NCCL_NVLS_ENABLE", "0")
            .env(FINAL_LINE_ENV, &final_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child: Child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for &pid in &pids {
                    kill_pid(pid);
                }
                return Err(EpError::Io(std::io::Error::new(e.kind(), format!("spawning rank {rank} ({}): {e}", program.display()))));
            }
        };
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        pumps.push(std::thread::spawn(move || pump(out, rank, false)));
        pumps.push(std::thread::spawn(move || pump(err, rank, true)));
        pids.push(child.id());
        let tx = tx.clone();
        std::thread::spawn(move || {
            let st = child.wait();
            let _ = tx.send((rank, st));
        });
    }
    drop(tx);

    let mut exits: Vec<Option<RankExit>> = vec![None; nproc];
    let mut killed = vec![false; nproc];
    let mut first_failure: Option<(usize, String, Instant)> = None;
    while exits.iter().any(Option::is_none) {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok((rank, st)) => {
                let st = st.ok();
                let ok = st.is_some_and(|s| s.success());
                if !ok && first_failure.is_none() && !killed[rank] {
                    let how = st.as_ref().map(describe).unwrap_or_else(|| "ended in an unknown way".into());
                    eprintln!("launcher: rank {rank} {how}; waiting up to {:.0} s for the other ranks", grace.as_secs_f64());
                    first_failure = Some((rank, how, Instant::now()));
                }
                exits[rank] = Some(RankExit { rank, status: st, killed: killed[rank] });
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if let Some((_, _, t)) = &first_failure {
            if t.elapsed() >= grace {
                for rank in 0..nproc {
                    if exits[rank].is_none() && !killed[rank] {
                        eprintln!("launcher: killing rank {rank} (still running {:.0} s after the first failure)", grace.as_secs_f64());
                        kill_pid(pids[rank]);
                        killed[rank] = true;
                    }
                }
            }
        }
    }
    for p in pumps {
        let _ = p.join();
    }
    let final_text = std::fs::read_to_string(&final_file).ok();
    let _ = std::fs::remove_file(&final_file);

    if let Some(t) = final_text {
        print!("{t}");
        let _ = std::io::stdout().flush();
    }
    if first_failure.is_none() {
        return Ok(());
    }
    let exits: Vec<RankExit> = exits.into_iter().flatten().collect();
    Err(EpError::Launch(failure_report(nproc, &exits)))
}

/// Name the cause: ranks that failed on their own (not killed, not [`EXIT_PEER_LOST`]) first.
fn failure_report(nproc: usize, exits: &[RankExit]) -> String {
    let failed: Vec<&RankExit> = exits.iter().filter(|e| !e.status.is_some_and(|s| s.success())).collect();
    let is_victim = |e: &RankExit| e.killed || e.status.and_then(|s| s.code()) == Some(EXIT_PEER_LOST as i32);
    let causes: Vec<String> = failed
        .iter()
        .filter(|e| !is_victim(e))
        .map(|e| format!("rank {} {}", e.rank, e.status.as_ref().map(describe).unwrap_or_else(|| "ended in an unknown way".into())))
        .collect();
    let victims: Vec<String> = failed
        .iter()
        .filter(|e| is_victim(e))
        .map(|e| if e.killed { format!("rank {} (killed by the launcher)", e.rank) } else { format!("rank {} (a peer vanished)", e.rank) })
        .collect();
    let mut msg = format!("{} of {nproc} ranks failed", failed.len());
    if !causes.is_empty() {
        msg.push_str(&format!(": {}", causes.join("; ")));
    }
    if !victims.is_empty() {
        msg.push_str(&format!("; stopped as a consequence: {}", victims.join(", ")));
    }
    msg
}

fn kill_pid(pid: u32) {
    extern "C" {
        fn kill(pid: i32, sig: i32) -> i32;
    }
    // SAFETY: sends SIGKILL to a child we spawned (its pid is not reused before we reap it).
    unsafe { kill(pid as i32, 9) };
}

fn pump(r: impl std::io::Read, rank: usize, is_err: bool) {
    let mut r = BufReader::new(r);
    let mut line = Vec::new();
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                let text = text.trim_end_matches('\n');
                if is_err {
                    let mut e = std::io::stderr().lock();
                    let _ = writeln!(e, "[rank {rank}] {text}");
                } else {
                    let mut o = std::io::stdout().lock();
                    let _ = writeln!(o, "[rank {rank}] {text}");
                }
            }
        }
    }
}
