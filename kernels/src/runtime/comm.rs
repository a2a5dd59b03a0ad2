//! Rendezvous and small host-side collectives between the ranks (one process per GPU).
//!
//! Environment (torchrun-compatible): `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default `RANK`),
//! `LOCAL_WORLD_SIZE` (default `WORLD_SIZE`), `MASTER_ADDR` (default `127.0.0.1`), `MASTER_PORT`
//! (default 29500). Rank 0 listens; every other rank connects to it (star topology). Every message
//! is a length-prefixed frame `[op u8][seq u64][len u64][payload]`; the op and sequence number let
//! rank 0 detect ranks that call different collectives. Time limits: `DEEPEP_RDZV_TIMEOUT_S`
//! (joining, default 120 s) and `DEEPEP_COMM_TIMEOUT_S` (each collective, default 600 s); an expired
//! limit is an error that names the rank(s) that did not arrive.

use super::exchange::{self, Exchange};
use crate::error::{EpError, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x4445_4550; // "DEEP"

/// Set once a collective failed because another rank vanished or did not arrive.
static PEER_LOST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a collective of this process failed because another rank closed its connection or
/// did not arrive (this rank is then a victim, not the cause). Binaries exit with
/// [`crate::runtime::launcher::EXIT_PEER_LOST`] in that case so the launcher can name the cause.
pub fn peer_lost() -> bool {
    PEER_LOST.load(std::sync::atomic::Ordering::Relaxed)
}
const DEFAULT_PORT: u16 = 29500;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    AllGather = 1,
    Broadcast = 2,
    Barrier = 3,
    EndUnit = 4,
}

/// Rank 0's answer to a frame whose collective was abandoned (payload: why).
const OP_ABORT: u8 = 0xAB;

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::EndUnit => "end_unit",
        }
    }
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::AllGather,
            2 => Op::Broadcast,
            3 => Op::Barrier,
            4 => Op::EndUnit,
            _ => return None,
        })
    }
}

/// Where and who: the rendezvous parameters of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub local_world: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl RankEnv {
    /// Read the torchrun-style variables. Without `RANK`/`WORLD_SIZE` this is a single process
    /// (rank 0 of 1).
    pub fn from_env() -> Result<RankEnv> {
        let num = |k: &str| crate::runtime::env_num::<usize>(k);
        let rank = num("RANK")?;
        let world = num("WORLD_SIZE")?;
        let (rank, world) = match (rank, world) {
            (Some(r), Some(w)) => (r, w),
            (None, None) => (0, 1),
            _ => {
                return Err(EpError::Rendezvous(
                    "only one of RANK and WORLD_SIZE is set; set both (or neither for a single process)".into(),
                ))
            }
        };
        let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
        let local_world = num("LOCAL_WORLD_SIZE")?.unwrap_or(world);
        let master_addr = std::env::var("MASTER_ADDR").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match std::env::var("MASTER_PORT") {
            Ok(p) if !p.is_empty() => p.parse::<u16>().map_err(|_| {
                EpError::Rendezvous(format!("MASTER_PORT={p:?} is not a port number (1-65535)"))
            })?,
            _ => DEFAULT_PORT,
        };
        let e = RankEnv { rank, world, local_rank, local_world, master_addr, master_port };
        e.validate()?;
        Ok(e)
    }

    fn validate(&self) -> Result<()> {
        if self.world == 0 {
            return Err(EpError::Rendezvous("WORLD_SIZE=0; it must be at least 1".into()));
        }
        if self.rank >= self.world {
            return Err(EpError::Rendezvous(format!(
                "RANK={} is out of range for WORLD_SIZE={} (ranks are 0..{})",
                self.rank,
                self.world,
                self.world - 1
            )));
        }
        if self.local_rank >= self.local_world.max(1) {
            return Err(EpError::Rendezvous(format!(
                "LOCAL_RANK={} is out of range for LOCAL_WORLD_SIZE={}",
                self.local_rank, self.local_world
            )));
        }
        Ok(())
    }
}

struct Links {
    /// Rank 0: one stream per rank (index = rank, `None` for itself). Others: only index 0.
    peers: Vec<Option<TcpStream>>,
    seq: u64,
    /// Rank 0: `end_unit` contributions of ranks that left the current unit early.
    early: Vec<Option<Vec<u8>>>,
}

/// The rendezvous of all ranks and the host collectives over it. All methods are collective:
/// every rank must call the same sequence of them.
pub struct Comm {
    env: RankEnv,
    timeout: Duration,
    links: Mutex<Links>,
    /// Set by [`Comm::with_exchange`]: the caller's all-gather carries every collective.
    external: Option<Arc<dyn Exchange>>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {})", self.env.rank, self.env.world)
    }
}

fn timeout_env(name: &str, default_s: f64) -> Result<Duration> {
    let s = crate::runtime::env_num::<f64>(name)?.unwrap_or(default_s);
    if !(s > 0.0 && s.is_finite()) {
        return Err(EpError::InvalidArgument(format!("{name}={s} must be a positive number of seconds")));
    }
    Ok(Duration::from_secs_f64(s))
}

impl Comm {
    /// Join the rendezvous described by the environment (see the module docs).
    pub fn from_env() -> Result<Comm> {
        let env = RankEnv::from_env()?;
        Comm::connect(env, timeout_env("DEEPEP_RDZV_TIMEOUT_S", 120.0)?, timeout_env("DEEPEP_COMM_TIMEOUT_S", 600.0)?)
    }

    /// A world of one (no network).
    pub fn single() -> Comm {
        let env = RankEnv { rank: 0, world: 1, local_rank: 0, local_world: 1, master_addr: "127.0.0.1".into(), master_port: 0 };
        Comm { env, timeout: Duration::from_secs(1), links: Mutex::new(Links { peers: vec![None], seq: 0, early: vec![None] }), external: None }
    }

    /// Join explicitly: `join_timeout` bounds the whole rendezvous, `op_timeout` each collective.
    pub fn connect(env: RankEnv, join_timeout: Duration, op_timeout: Duration) -> Result<Comm> {
        env.validate()?;
        if env.world == 1 {
            let mut c = Comm::single();
            c.env = env;
            c.timeout = op_timeout;
            return Ok(c);
        }
        let deadline = Instant::now() + join_timeout;
        let peers = if env.rank == 0 { Self::serve(&env, deadline)? } else { Self::join(&env, deadline)? };
        for s in peers.iter().flatten() {
            s.set_nodelay(true).ok();
        }
        let early = vec![None; env.world];
        Ok(Comm { env, timeout: op_timeout, links: Mutex::new(Links { peers, seq: 0, early }), external: None })
    }

    /// A [`Comm`] whose collectives run over `exchange`, the caller's all-gather (a binding's
    /// process group; see [`super::exchange`]). `rank`/`world` are this process's place in the
    /// caller's group; `local_rank`/`local_world` describe the host (the intranode buffer needs
    /// every rank on one host).
    pub fn with_exchange(rank: usize, world: usize, local_rank: usize, local_world: usize, exchange: Arc<dyn Exchange>) -> Result<Comm> {
        let env = RankEnv { rank, world, local_rank, local_world, master_addr: String::new(), master_port: 0 };
        env.validate()?;
        let mut c = Comm::single();
        c.env = env;
        c.external = Some(exchange);
        Ok(c)
    }

    fn where_(env: &RankEnv) -> String {
        format!("{}:{}", env.master_addr, env.master_port)
    }

    fn serve(env: &RankEnv, deadline: Instant) -> Result<Vec<Option<TcpStream>>> {
        let loopback = env.master_addr == "localhost" || env.master_addr.starts_with("127.");
        let bind = if loopback { format!("127.0.0.1:{}", env.master_port) } else { format!("0.0.0.0:{}", env.master_port) };
        let listener = TcpListener::bind(&bind).map_err(|e| {
            EpError::Rendezvous(format!(
                "rank 0 cannot listen on {bind}: {e}; pick a free MASTER_PORT (another job may be using {})",
                env.master_port
            ))
        })?;
        listener.set_nonblocking(true)?;
        let mut peers: Vec<Option<TcpStream>> = (0..env.world).map(|_| None).collect();
        let mut joined = 1;
        while joined < env.world {
            match listener.accept() {
                Ok((mut s, addr)) => {
                    s.set_nonblocking(false)?;
                    s.set_read_timeout(Some(Duration::from_secs(10)))?;
                    let mut hello = [0u8; 12];
                    if s.read_exact(&mut hello).is_err() {
                        tracing::warn!("rendezvous: ignoring a connection from {addr} that sent no greeting");
                        continue;
                    }
                    let w = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().unwrap()) as usize;
                    if w(0) != MAGIC as usize {
                        tracing::warn!("rendezvous: ignoring a connection from {addr} with a foreign greeting");
                        continue;
                    }
                    let (world, rank) = (w(4), w(8));
                    if world != env.world {
                        return Err(EpError::Rendezvous(format!(
                            "rank {rank} (from {addr}) has WORLD_SIZE={world} but rank 0 has WORLD_SIZE={}; start every rank with the same WORLD_SIZE",
                            env.world
                        )));
                    }
                    if rank == 0 || rank >= env.world || peers[rank].is_some() {
                        return Err(EpError::Rendezvous(format!(
                            "two processes claim RANK={rank} (second from {addr}); every rank needs a distinct RANK in 1..{}",
                            env.world - 1
                        )));
                    }
                    peers[rank] = Some(s);
                    joined += 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> = (1..env.world).filter(|r| peers[*r].is_none()).collect();
                        return Err(EpError::Rendezvous(format!(
                            "rank 0: ranks {missing:?} of {} did not join at {} in time (DEEPEP_RDZV_TIMEOUT_S); \
                             were they started, with the same MASTER_ADDR/MASTER_PORT?",
                            env.world,
                            Self::where_(env)
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(EpError::Rendezvous(format!("rank 0: accept on {bind} failed: {e}"))),
            }
        }
        // Everyone is here: release them.
        for s in peers.iter_mut().flatten() {
            s.write_all(&MAGIC.to_le_bytes())?;
        }
        Ok(peers)
    }

    fn join(env: &RankEnv, deadline: Instant) -> Result<Vec<Option<TcpStream>>> {
        let addrs: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
            .to_socket_addrs()
            .map_err(|e| EpError::Rendezvous(format!("cannot resolve MASTER_ADDR={}: {e}", env.master_addr)))?
            .collect();
        let mut last_err = String::from("no address");
        let mut stream = None;
        while stream.is_none() {
            for a in &addrs {
                match TcpStream::connect_timeout(a, Duration::from_millis(500)) {
                    Ok(s) => {
                        stream = Some(s);
                        break;
                    }
                    Err(e) => last_err = e.to_string(),
                }
            }
            if stream.is_none() {
                if Instant::now() > deadline {
                    return Err(EpError::Rendezvous(format!(
                        "rank {}: rank 0 is not reachable at {} ({last_err}) within DEEPEP_RDZV_TIMEOUT_S; is rank 0 running \
                         with the same MASTER_ADDR/MASTER_PORT?",
                        env.rank,
                        Self::where_(env)
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let mut s = stream.unwrap();
        let mut hello = Vec::with_capacity(12);
        for v in [MAGIC, env.world as u32, env.rank as u32] {
            hello.extend_from_slice(&v.to_le_bytes());
        }
        s.write_all(&hello)?;
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        s.set_read_timeout(Some(left))?;
        let mut ack = [0u8; 4];
        s.read_exact(&mut ack).map_err(|e| {
            EpError::Rendezvous(format!(
                "rank {}: connected to rank 0 at {} but the rendezvous did not complete ({e}); rank 0 reports which ranks are missing",
                env.rank,
                Self::where_(env)
            ))
        })?;
        if u32::from_le_bytes(ack) != MAGIC {
            return Err(EpError::Rendezvous(format!("rank {}: unexpected answer from {}", env.rank, Self::where_(env))));
        }
        Ok(vec![Some(s)])
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }
    pub fn world(&self) -> usize {
        self.env.world
    }
    pub fn local_rank(&self) -> usize {
        self.env.local_rank
    }
    pub fn local_world(&self) -> usize {
        self.env.local_world
    }
    pub fn env(&self) -> &RankEnv {
        &self.env
    }

    /// Wait until every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.exchange(Op::Barrier, 0, &[]).map(|_| ())
    }

    /// Every rank contributes `data` (any length); everyone gets all contributions, index = rank.
    pub fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.exchange(Op::AllGather, 0, data)
    }

    /// `root`'s `data` to everyone (the other ranks' `data` is ignored).
    pub fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if root >= self.env.world {
            return Err(EpError::InvalidArgument(format!("broadcast root {root} >= world {}", self.env.world)));
        }
        let mut v = self.exchange(Op::Broadcast, root, data)?;
        Ok(v.swap_remove(0))
    }

    /// Convenience: all-gather one `u64` per rank.
    pub fn all_gather_u64(&self, v: u64) -> Result<Vec<u64>> {
        Ok(self.all_gather(&v.to_le_bytes())?.iter().map(|b| u64::from_le_bytes(b[..8].try_into().unwrap())).collect())
    }

    /// End of one unit of collective work (a test case, a benchmark mode): every rank
    /// contributes `data` (e.g. its verdict) and gets everyone's, like [`Comm::all_gather`], but
    /// it also resolves ranks that left the unit early. A rank still blocked in one of the unit's
    /// collectives gets an error from it ("abandoned") so it can reach `end_unit` too, instead of
    /// waiting for a timeout. Afterwards all ranks are in step again.
    pub fn end_unit(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.exchange(Op::EndUnit, 0, data)
    }

    /// The core of every collective: rank 0 is the hub. Every rank sends one frame per
    /// collective; rank 0 answers every frame exactly once (the result, or an abort).
    fn exchange(&self, op: Op, root: usize, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if let Some(ex) = &self.external {
            let root = (op == Op::Broadcast).then_some(root);
            return exchange::collective(ex.as_ref(), self.env.rank, self.env.world, op.name(), root, data);
        }
        let mut links = self.links.lock().unwrap();
        links.seq += 1;
        let seq = links.seq;
        if self.env.world == 1 {
            if op == Op::EndUnit {
                links.seq = 0;
            }
            return Ok(vec![data.to_vec()]);
        }
        let deadline = Instant::now() + self.timeout;
        // Non-root ranks of a broadcast contribute nothing (but still send a frame).
        let data = if op == Op::Broadcast && self.env.rank != root { &[][..] } else { data };
        if self.env.rank == 0 {
            self.hub(&mut links, op, seq, root, data, deadline)
        } else {
            self.spoke(&mut links, op, seq, data, deadline)
        }
    }

    fn abandoned(&self, op: Op, seq: u64, why: &str) -> EpError {
        EpError::Rendezvous(format!("rank {}: {} #{seq} abandoned: {why}", self.env.rank, op.name()))
    }

    #[allow(clippy::needless_range_loop)] // `r` is a rank indexing several per-rank tables
    fn hub(&self, links: &mut Links, op: Op, seq: u64, root: usize, data: &[u8], deadline: Instant) -> Result<Vec<Vec<u8>>> {
        let world = self.env.world;
        if op != Op::EndUnit {
            if let Some(r) = links.early.iter().position(Option::is_some) {
                // Some rank already left this unit: do not start another collective of it.
                return Err(self.abandoned(op, seq, &format!("rank {r} already left this unit of work")));
            }
        }
        let mut parts: Vec<Vec<u8>> = vec![Vec::new(); world];
        parts[0] = data.to_vec();
        let mut answered: Vec<usize> = Vec::new();
        let mut why: Option<String> = None;
        for r in 1..world {
            if op == Op::EndUnit {
                if let Some(p) = links.early[r].take() {
                    parts[r] = p;
                    continue;
                }
            }
            loop {
                let s = links.peers[r].as_mut().unwrap();
                let (rop, rseq, payload) = recv_frame(s, deadline).map_err(|e| self.peer_error(r, op, seq, e))?;
                let theirs = Op::from_u8(rop).map(Op::name).unwrap_or("?");
                if op == Op::EndUnit {
                    if rop == Op::EndUnit as u8 {
                        parts[r] = payload;
                        break;
                    }
                    // Rank r is still inside the unit, blocked in a collective: release it.
                    send_frame(s, OP_ABORT, rseq, b"another rank left this unit of work").map_err(|e| self.peer_error(r, op, seq, e))?;
                    continue;
                }
                if rop == Op::EndUnit as u8 {
                    links.early[r] = Some(payload);
                    why.get_or_insert(format!("rank {r} left this unit of work early"));
                } else if rop != op as u8 || rseq != seq {
                    why.get_or_insert(format!(
                        "rank {r} called {theirs} #{rseq} while rank 0 called {} #{seq}; all ranks must run the same collectives \
                         in the same order (same arguments on every rank?)",
                        op.name()
                    ));
                    answered.push(r);
                } else {
                    parts[r] = payload;
                    answered.push(r);
                }
                break;
            }
        }
        if let Some(why) = why {
            for &r in &answered {
                let s = links.peers[r].as_mut().unwrap();
                send_frame(s, OP_ABORT, seq, why.as_bytes()).map_err(|e| self.peer_error(r, op, seq, e))?;
            }
            return Err(self.abandoned(op, seq, &why));
        }
        let reply: Vec<Vec<u8>> = if op == Op::Broadcast { vec![std::mem::take(&mut parts[root])] } else { parts };
        let mut body = Vec::new();
        for p in &reply {
            body.extend_from_slice(&(p.len() as u64).to_le_bytes());
            body.extend_from_slice(p);
        }
        for r in 1..world {
            let s = links.peers[r].as_mut().unwrap();
            send_frame(s, op as u8, seq, &body).map_err(|e| self.peer_error(r, op, seq, e))?;
        }
        if op == Op::EndUnit {
            links.seq = 0;
        }
        Ok(reply)
    }

    fn spoke(&self, links: &mut Links, op: Op, seq: u64, data: &[u8], deadline: Instant) -> Result<Vec<Vec<u8>>> {
        let me = self.env.rank;
        let s = links.peers[0].as_mut().unwrap();
        send_frame(s, op as u8, seq, data).map_err(|e| self.peer_error(0, op, seq, e))?;
        let (rop, rseq, body) = recv_frame(s, deadline).map_err(|e| self.peer_error(0, op, seq, e))?;
        if rop == OP_ABORT {
            return Err(self.abandoned(op, seq, &String::from_utf8_lossy(&body)));
        }
        if op == Op::EndUnit {
            links.seq = 0;
        }
        if rop != op as u8 || (op != Op::EndUnit && rseq != seq) {
            return Err(EpError::Rendezvous(format!(
                "rank {me}: rank 0 answered op {rop} #{rseq} to {} #{seq}; the ranks ran different collectives",
                op.name()
            )));
        }
        let mut out = Vec::new();
        let mut i = 0;
        while i + 8 <= body.len() {
            let n = u64::from_le_bytes(body[i..i + 8].try_into().unwrap()) as usize;
            out.push(body[i + 8..i + 8 + n].to_vec());
            i += 8 + n;
        }
        Ok(out)
    }

    fn peer_error(&self, peer: usize, op: Op, seq: u64, e: std::io::Error) -> EpError {
        let me = self.env.rank;
        let what = format!("{} #{seq}", op.name());
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) {
            PEER_LOST.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        EpError::Rendezvous(match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                if me == 0 {
                    format!("rank {peer} did not arrive at {what} within {:.0} s (DEEPEP_COMM_TIMEOUT_S); it is stuck or slower than the others", self.timeout.as_secs_f64())
                } else {
                    format!("rank {me}: no answer from rank 0 for {what} within {:.0} s (DEEPEP_COMM_TIMEOUT_S); some rank did not arrive (rank 0 names it)", self.timeout.as_secs_f64())
                }
            }
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
                format!("rank {me}: rank {peer} closed the connection during {what}; that process exited or failed (see its output)")
            }
            _ => format!("rank {me}: talking to rank {peer} during {what}: {e}"),
        })
    }
}

fn send_frame(s: &mut TcpStream, op: u8, seq: u64, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 17];
    head[0] = op;
    head[1..9].copy_from_slice(&seq.to_le_bytes());
    head[9..17].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    s.write_all(&head)?;
    s.write_all(payload)?;
    s.flush()
}

fn read_until(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "deadline"));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed")),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn recv_frame(s: &mut TcpStream, deadline: Instant) -> std::io::Result<(u8, u64, Vec<u8>)> {
    let mut head = [0u8; 17];
    read_until(s, &mut head, deadline)?;
    let seq = u64::from_le_bytes(head[1..9].try_into().unwrap());
    let len = u64::from_le_bytes(head[9..17].try_into().unwrap());
    if len > (1 << 34) {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("frame of {len} bytes is implausible")));
    }
    let mut payload = vec![0u8; len as usize];
    read_until(s, &mut payload, deadline)?;
    Ok((head[0], seq, payload))
}

/// A TCP port that is free right now on 127.0.0.1 (for launchers and tests).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(rank: usize, world: usize, port: u16) -> RankEnv {
        RankEnv { rank, world, local_rank: rank, local_world: world, master_addr: "127.0.0.1".into(), master_port: port }
    }

    fn run_world<T: Send + 'static>(world: usize, f: impl Fn(Comm) -> T + Send + Sync + 'static) -> Vec<Result<T>> {
        let port = free_port().unwrap();
        let f = Arc::new(f);
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let f = f.clone();
                std::thread::spawn(move || {
                    Comm::connect(env(r, world, port), Duration::from_secs(10), Duration::from_secs(5)).map(|c| f(c))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_gather_broadcast_barrier_on_four_ranks() {
        let res = run_world(4, |c| {
            let me = c.rank();
            let g = c.all_gather(&vec![me as u8; me + 1]).unwrap();
            let b = c.broadcast(2, format!("from {me}").as_bytes()).unwrap();
            c.barrier().unwrap();
            let n = c.all_gather_u64(100 + me as u64).unwrap();
            (g, b, n)
        });
        for r in res {
            let (g, b, n) = r.unwrap();
            assert_eq!(g, (0..4).map(|i| vec![i as u8; i + 1]).collect::<Vec<_>>());
            assert_eq!(b, b"from 2");
            assert_eq!(n, vec![100, 101, 102, 103]);
        }
    }

    #[test]
    fn missing_rank_is_named_by_rank_0() {
        let port = free_port().unwrap();
        // Only ranks 0 and 1 of 3 start.
        let h1 = std::thread::spawn(move || Comm::connect(env(1, 3, port), Duration::from_millis(800), Duration::from_secs(1)));
        let e = Comm::connect(env(0, 3, port), Duration::from_millis(500), Duration::from_secs(1)).unwrap_err().to_string();
        assert!(e.contains("ranks [2]") && e.contains("did not join"), "{e}");
        let e1 = h1.join().unwrap().unwrap_err().to_string();
        assert!(e1.contains("rank 1"), "{e1}");
    }

    #[test]
    fn rank_that_skips_a_collective_is_named() {
        let res = run_world(3, |c| {
            if c.rank() == 2 {
                // rank 2 never reaches the barrier and then leaves
                std::thread::sleep(Duration::from_millis(200));
                return Ok(());
            }
            c.barrier()
        });
        let e0 = res[0].as_ref().unwrap().as_ref().unwrap_err().to_string();
        assert!(e0.contains("rank 2") && e0.contains("barrier #1"), "{e0}");
        let e1 = res[1].as_ref().unwrap().as_ref().unwrap_err().to_string();
        assert!(e1.contains("rank 1"), "{e1}");
    }

    #[test]
    fn mismatched_collectives_are_detected_and_the_ranks_resync() {
        let res = run_world(2, |c| {
            let r = if c.rank() == 0 { c.barrier().map(|_| ()) } else { c.all_gather(b"x").map(|_| ()) };
            let v = c.end_unit(&[r.is_ok() as u8]).unwrap();
            c.barrier().unwrap(); // in step again
            (r.map_err(|e| e.to_string()), v)
        });
        let (r0, v0) = res[0].as_ref().unwrap();
        let e0 = r0.as_ref().unwrap_err();
        assert!(e0.contains("rank 1 called all_gather") && e0.contains("rank 0 called barrier"), "{e0}");
        let (r1, v1) = res[1].as_ref().unwrap();
        assert!(r1.as_ref().unwrap_err().contains("abandoned"), "{r1:?}");
        assert_eq!(v0, &vec![vec![0u8], vec![0u8]]);
        assert_eq!(v0, v1);
    }

    /// A rank that leaves a unit early (here: skips its collectives) releases the ranks blocked in
    /// them at once, whichever rank it is, and everyone agrees on the verdicts.
    #[test]
    fn early_leaver_releases_blocked_ranks() {
        for leaver in [0usize, 1] {
            let t = std::time::Instant::now();
            let res = run_world(3, move |c| {
                let r = if c.rank() == leaver {
                    Err("left".to_string())
                } else {
                    c.barrier().and_then(|_| c.all_gather(b"data")).map(|_| ()).map_err(|e| e.to_string())
                };
                let verdicts = c.end_unit(&[r.is_ok() as u8]).unwrap();
                let after = c.all_gather(&[c.rank() as u8]).unwrap();
                (r, verdicts, after)
            });
            assert!(t.elapsed() < Duration::from_secs(3), "blocked ranks waited for a timeout");
            // the leaver failed; the others' collectives were abandoned, so they fail too
            let want = vec![vec![0u8]; 3];
            for (rank, x) in res.iter().enumerate() {
                let (r, verdicts, after) = x.as_ref().unwrap();
                if rank != leaver {
                    assert!(r.as_ref().unwrap_err().contains("abandoned"), "leaver {leaver}, rank {rank}: {r:?}");
                }
                assert_eq!(verdicts, &want, "leaver {leaver}");
                assert_eq!(after, &vec![vec![0u8], vec![1u8], vec![2u8]]);
            }
        }
    }

    #[test]
    fn units_that_succeed_everywhere_report_ok() {
        let res = run_world(3, |c| {
            c.barrier().unwrap();
            let b = c.broadcast(1, if c.rank() == 1 { b"root" } else { b"ignored" }).unwrap();
            (b, c.end_unit(&[1]).unwrap())
        });
        for x in res {
            let (b, v) = x.unwrap();
            assert_eq!(b, b"root");
            assert_eq!(v, vec![vec![1u8]; 3]);
        }
    }

    #[test]
    fn bad_environment_is_rejected_with_the_fix() {
        let e = RankEnv { rank: 2, ..env(0, 2, 1) }.validate().unwrap_err().to_string();
        assert!(e.contains("RANK=2") && e.contains("WORLD_SIZE=2"), "{e}");
        let single = Comm::single();
        assert_eq!(single.all_gather(b"ab").unwrap(), vec![b"ab".to_vec()]);
        assert_eq!(single.broadcast(0, b"q").unwrap(), b"q");
    }

    /// An in-process all-gather between threads (stands in for a binding's process group).
    struct Threads {
        world: usize,
        slots: Mutex<Vec<Option<Vec<u8>>>>,
        round: std::sync::Barrier,
        taken: std::sync::Barrier,
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
        let barrier = || std::sync::Barrier::new(world);
        let t = Arc::new(Threads { world, slots: Mutex::new(vec![None; world]), round: barrier(), taken: barrier() });
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

    /// Answers with this rank's bytes only, whatever the group's size.
    struct Alone;
    impl Exchange for Alone {
        fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
            Ok(vec![data.to_vec()])
        }
    }

    #[test]
    fn an_exchange_comm_checks_its_rank_and_the_answers_size() {
        assert!(Comm::with_exchange(2, 2, 0, 2, Arc::new(Alone)).is_err());
        let comm = Comm::with_exchange(0, 2, 0, 2, Arc::new(Alone)).unwrap();
        let e = comm.all_gather(b"x").unwrap_err().to_string();
        assert!(e.contains("returned 1 contributions") && e.contains("2 ranks"), "{e}");
    }
}
