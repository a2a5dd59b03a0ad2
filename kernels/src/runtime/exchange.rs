//! Host collectives supplied by the caller instead of our TCP rendezvous.
//!
//! A binding that already has a process group (PyTorch's `torch.distributed`) feeds its
//! all-gather to [`Comm::with_exchange`](super::comm::Comm::with_exchange); every collective of
//! the `Comm` (`all_gather`, `broadcast`, `barrier`, `end_unit`) is then carried by that one
//! primitive ([`collective`]), so the ranks meet through the caller's group and no second
//! rendezvous port is opened. The IPC handles of the intranode buffer and the NVSHMEM unique id
//! travel this way. This module knows nothing of `Comm`: `comm.rs` uses it, not the other way round.

use crate::error::{EpError, Result};

/// An all-gather over the caller's process group. Every rank calls it in the same order with
/// its own bytes (any length, possibly empty); it returns every rank's bytes, index = rank.
pub trait Exchange: Send + Sync {
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
}

/// One collective named `what` over an external all-gather: every rank's `data` (index = rank),
/// or with `root` only the root's (a broadcast; the other ranks contribute nothing).
pub(crate) fn collective(ex: &dyn Exchange, rank: usize, world: usize, what: &str, root: Option<usize>, data: &[u8]) -> Result<Vec<Vec<u8>>> {
    // Non-root ranks of a broadcast contribute nothing.
    let mine = match root {
        Some(r) if r != rank => &[][..],
        _ => data,
    };
    let parts = ex.all_gather(mine)?;
    if parts.len() != world {
        return Err(EpError::Rendezvous(format!(
            "rank {rank}: the external exchange returned {} contributions for {what} but the group has {world} ranks; \
             pass the process group the buffer was created with",
            parts.len()
        )));
    }
    match root {
        Some(r) => Ok(vec![parts[r].clone()]),
        None => Ok(parts),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Answers every all-gather with `answer`, remembering what this rank contributed.
    struct Canned {
        answer: Vec<Vec<u8>>,
        sent: Mutex<Vec<Vec<u8>>>,
    }
    impl Exchange for Canned {
        fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
            self.sent.lock().unwrap().push(data.to_vec());
            Ok(self.answer.clone())
        }
    }
    fn canned(answer: &[&[u8]]) -> Canned {
        Canned { answer: answer.iter().map(|a| a.to_vec()).collect(), sent: Mutex::new(Vec::new()) }
    }

    #[test]
    fn an_all_gather_returns_every_rank_and_a_broadcast_the_root_only() {
        let ex = canned(&[b"r0", b"r1", b"r2"]);
        assert_eq!(collective(&ex, 1, 3, "all_gather", None, b"r1").unwrap(), vec![b"r0".to_vec(), b"r1".to_vec(), b"r2".to_vec()]);
        assert_eq!(collective(&ex, 1, 3, "broadcast", Some(2), b"ignored").unwrap(), vec![b"r2".to_vec()]);
        assert_eq!(collective(&ex, 2, 3, "broadcast", Some(2), b"mine").unwrap(), vec![b"r2".to_vec()]);
        // a non-root rank of a broadcast sends nothing; the root and an all-gather send their data
        assert_eq!(*ex.sent.lock().unwrap(), vec![b"r1".to_vec(), Vec::new(), b"mine".to_vec()]);
    }

    #[test]
    fn a_wrong_sized_answer_is_an_error_naming_the_group() {
        let e = collective(&canned(&[b"x"]), 0, 2, "all_gather", None, b"x").unwrap_err().to_string();
        assert!(e.contains("returned 1 contributions for all_gather") && e.contains("2 ranks"), "{e}");
    }
}
