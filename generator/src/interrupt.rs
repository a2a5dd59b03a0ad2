//! Undoing what `install` has created when a signal ends the process.
//!
//! `install` registers what it creates before it creates it (the staging directory, parent
//! directories of a new prefix, the directory an earlier install is moved to) and forgets it
//! once it is published or removed. [`undo_on_signal`] starts a thread that, on SIGINT,
//! SIGTERM or SIGHUP, removes everything still registered and then ends the process with
//! that signal, as the default action would have (so a shell sees "killed by SIGINT"). A
//! signal ignored when the process started (SIGHUP under `nohup`) stays ignored.
//!
//! Every file-system step of `install` holds a [`Guard`] while it runs; the signal thread
//! takes the same guard before undoing, so it never removes a directory that the install is
//! about to write into again, and never interrupts the publishing renames halfway (they hold
//! the guard until all are done or rolled back). Without [`undo_on_signal`] (the library
//! used in-process, as the tests do) registrations cost a lock and nothing else.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

/// Something to undo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Undo {
    /// A directory tree this process created: removed with everything in it.
    Tree(PathBuf),
    /// A directory this process created: removed if it is empty.
    EmptyDir(PathBuf),
}

impl Undo {
    fn run(&self) {
        match self {
            Undo::Tree(p) => {
                let _ = std::fs::remove_dir_all(p);
            }
            Undo::EmptyDir(p) => {
                let _ = std::fs::remove_dir(p);
            }
        }
    }
}

#[derive(Debug, Default)]
struct Pending {
    next: u64,
    items: Vec<(u64, Undo)>,
}

static PENDING: Mutex<Pending> = Mutex::new(Pending {
    next: 0,
    items: Vec::new(),
});

/// Holds off the signal cleanup: while one is held, a signal's cleanup waits.
pub struct Guard(MutexGuard<'static, Pending>);

/// What [`Guard::register`] returns; hand it to [`Guard::forget`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "forget the registration once the thing is published or removed"]
pub struct Ticket(u64);

/// Takes the guard (waiting while a signal's cleanup runs: that one ends the process).
pub fn guard() -> Guard {
    Guard(PENDING.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Runs `f` holding the guard.
pub fn guarded<T>(f: impl FnOnce() -> T) -> T {
    let _g = guard();
    f()
}

impl Guard {
    /// Registers `undo`, to run if a signal ends the process before it is forgotten.
    pub fn register(&mut self, undo: Undo) -> Ticket {
        let id = self.0.next;
        self.0.next += 1;
        self.0.items.push((id, undo));
        Ticket(id)
    }

    /// Drops a registration (the thing was published, or removed already).
    pub fn forget(&mut self, t: Ticket) {
        self.0.items.retain(|(id, _)| *id != t.0);
    }

    /// Runs every registration, newest first, and drops them.
    fn undo_all(&mut self) {
        run_newest_first(&mut self.0.items);
    }
}

fn run_newest_first(items: &mut Vec<(u64, Undo)>) {
    while let Some((_, undo)) = items.pop() {
        undo.run();
    }
}

/// Signals this process ignores (`SigIgn` of `/proc/self/status`), as under `nohup`; empty
/// where that cannot be read.
fn ignored() -> Vec<i32> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .unwrap_or(0);
    (1..=64).filter(|s| mask & (1u64 << (s - 1)) != 0).collect()
}

/// Starts the thread that undoes the registrations on SIGINT, SIGTERM and SIGHUP and then
/// ends the process with the signal. A signal the process was started ignoring (SIGHUP
/// under `nohup`) stays ignored. Call once, before the first registration.
pub fn undo_on_signal() -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let ignored = ignored();
    let wanted: Vec<i32> = [SIGINT, SIGTERM, SIGHUP]
        .into_iter()
        .filter(|s| !ignored.contains(s))
        .collect();
    let mut signals = signal_hook::iterator::Signals::new(wanted)?;
    std::thread::Builder::new()
        .name("undo-on-signal".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                let mut g = guard();
                g.undo_all();
                // Die of the signal itself (the default action); exit only if that fails.
                let _ = signal_hook::low_level::emulate_default_handler(sig);
                std::process::exit(128 + sig);
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undo_runs_newest_first_and_forgotten_ones_not_at_all() {
        let t = tempfile::tempdir().unwrap();
        let parent = t.path().join("new");
        let tree = parent.join("staging");
        let kept = t.path().join("published");
        std::fs::create_dir_all(tree.join("lib")).unwrap();
        std::fs::write(tree.join("lib/x"), "x").unwrap();
        std::fs::create_dir(&kept).unwrap();
        let mut g = guard();
        // Registered parent first, then what is inside it: undoing newest first empties the
        // parent before it is removed.
        let a = g.register(Undo::EmptyDir(parent.clone()));
        let b = g.register(Undo::Tree(tree.clone()));
        let c = g.register(Undo::Tree(kept.clone()));
        let forgotten = c.0;
        g.forget(c);
        assert!(!g.0.items.iter().any(|(id, _)| *id == forgotten));
        // Only this test's registrations run (other tests in this process may hold some).
        let ids = [a.0, b.0];
        let mut mine: Vec<(u64, Undo)> =
            g.0.items
                .iter()
                .filter(|(id, _)| ids.contains(id))
                .cloned()
                .collect();
        assert_eq!(mine.len(), 2);
        g.0.items.retain(|(id, _)| !ids.contains(id));
        run_newest_first(&mut mine);
        drop(g);
        assert!(!parent.exists());
        assert!(kept.exists());
    }
}
