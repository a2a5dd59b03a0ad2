//! Host collectives supplied by the caller instead of our TCP rendezvous.
//!
//! A binding that already has a process group (PyTorch's `torch.distributed`) feeds its
//! all-gather to [`Comm::with_exchange`]; every collective of [`Comm`] (`all_gather`,
//! `broadcast`, `barrier`, `end_unit`) is then carried by that one primitive, so the ranks meet
//! through the caller's group and no second rendezvous port is opened. The IPC handles of the
//! intranode buffer and the NVSHMEM unique id travel this way.

use super::comm::{Comm, RankEnv};
use crate::error::{EpError, Result};
use std::sync::Arc;

/// An all-gather over the caller's process group. Every rank calls it in the same order with
/// its own bytes (any length, possibly empty); it returns every rank's bytes, index = rank.
pub trait Exchange: Send + Sync {
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
}

impl Comm {
    /// A [`Comm`] whose collectives run over `exchange` (see the module docs). `rank`/`world`
    /// are this process's place in the caller's group; `local_rank`/`local_world` describe the
    /// host (the intranode buffer needs every rank on one host).
    pub fn with_exchange(rank: usize, world: usize, local_rank: usize, local_world: usize, exchange: Arc<dyn Exchange>) -> Result<Comm> {
        let env = RankEnv { rank, world, local_rank, local_world, master_addr: String::new(), master_port: 0 };
        Comm::from_exchange(env, exchange)
    }
}

/// The result of one collective `op` over an external all-gather.
pub(crate) fn run(ex: &dyn Exchange, rank: usize, world: usize, what: &str, root: Option<usize>, data: &[u8]) -> Result<Vec<Vec<u8>>> {
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
    use std::sync::{Barrier, Mutex};

    /// An in-process all-gather between threads (stands in for a process group).
    struct Threads {
        world: usize,
        slots: Mutex<Vec<Option<Vec<u8>>>>,
        round: Barrier,
        taken: Barrier,
    }
    struct Member(Arc<Threads>, usize);
    impl Exchange for Member {
        fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
            self.0.slots.lock().unwrap()[self.1] = Some(data.to_vec());
            self.0.round.wait();
            let out = self.0.slots.lock().unwrap().iter().map(|s| s.clone().unwrap()).collect();
            self.0.taken.wait();
            Ok(out)
        }
    }

    #[test]
    fn collectives_over_an_external_all_gather() {
        let world = 3;
        let t = Arc::new(Threads { world, slots: Mutex::new(vec![None; world]), round: Barrier::new(world), taken: Barrier::new(world) });
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let comm = Comm::with_exchange(r, t.world, r, t.world, Arc::new(Member(t.clone(), r))).unwrap();
                    assert_eq!((comm.rank(), comm.world()), (r, world));
                    let all = comm.all_gather(&[r as u8; 2]).unwrap();
                    assert_eq!(all, (0..world).map(|s| vec![s as u8; 2]).collect::<Vec<_>>());
                    assert_eq!(comm.broadcast(1, &[r as u8 + 10]).unwrap(), vec![11]);
                    comm.barrier().unwrap();
                    assert_eq!(comm.all_gather_u64(r as u64 * 7).unwrap(), vec![0, 7, 14]);
                    assert!(comm.broadcast(world, &[]).is_err());
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    struct Short;
    impl Exchange for Short {
        fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
            Ok(vec![data.to_vec()])
        }
    }

    #[test]
    fn a_wrong_sized_answer_is_an_error_naming_the_group() {
        let comm = Comm::with_exchange(0, 2, 0, 2, Arc::new(Short)).unwrap();
        let e = comm.all_gather(b"x").unwrap_err().to_string();
        assert!(e.contains("returned 1 contributions") && e.contains("2 ranks"), "{e}");
    }

    #[test]
    fn bad_rank_is_refused() {
        assert!(Comm::with_exchange(2, 2, 0, 2, Arc::new(Short)).is_err());
    }
}
