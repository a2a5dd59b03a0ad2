//! The environment settings and tables the `Buffer` reads when it is created: checked here, with
//! the fix in every refusal. Each function takes an optional `environ` mapping (tests pass a
//! dict); without one it reads the process environment (which `os.environ` writes through).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::HashMap;

pub(crate) const RANKS_PER_HOST_ENV: &str = "DEEPEP_KERNELS_RANKS_PER_HOST";
pub(crate) const DISPATCH_VIEWS_ENV: &str = "DEEPEP_KERNELS_DISPATCH_VIEWS";
pub(crate) const RECV_ARENA_ENV: &str = "DEEPEP_KERNELS_RECV_ARENA_BYTES";
pub(crate) const DLPACK_VIEWS_ENV: &str = "DEEPEP_KERNELS_DLPACK_VIEWS";

type Environ = Option<HashMap<String, String>>;

fn var(environ: &Environ, name: &str) -> Option<String> {
    match environ {
        Some(m) => m.get(name).cloned(),
        None => std::env::var(name).ok(),
    }
}

/// Every K consecutive ranks form one (emulated) host: K from `v` (the variable's value), which
/// must be 1..=`max_k` and divide `world`; None when unset or empty.
pub(crate) fn ranks_per_host(v: Option<&str>, world: usize, max_k: usize) -> Result<Option<usize>, String> {
    let Some(v) = v.filter(|v| !v.is_empty()) else { return Ok(None) };
    match v.parse::<usize>() {
        Ok(k) if (1..=max_k).contains(&k) && world % k == 0 => Ok(Some(k)),
        _ => {
            let divisors: Vec<String> = (1..=world.min(max_k)).filter(|d| world % d == 0).map(|d| d.to_string()).collect();
            Err(format!(
                "{RANKS_PER_HOST_ENV}='{v}' must be a number of ranks per host that divides the world size {world} and is at most \
                 {max_k}: use one of [{}], or unset it to group ranks by their real host",
                divisors.join(", ")
            ))
        }
    }
}

/// (number of hosts, ranks per host) of ranks on `hosts` (index = rank), or as `k` ranks per
/// host emulate them. Ranks per host is 0 when the real hosts do not hold equal blocks of
/// consecutive ranks (the internode mode needs them).
pub(crate) fn topology(hosts: &[String], k: Option<usize>) -> (usize, usize) {
    let world = hosts.len();
    if let Some(k) = k {
        return (world / k, k);
    }
    let mut distinct: Vec<&String> = hosts.iter().collect();
    distinct.sort();
    distinct.dedup();
    let num_hosts = distinct.len().max(1);
    let per = world / num_hosts;
    let regular = world % num_hosts == 0
        && per > 0
        && (0..world).all(|r| hosts[r] == hosts[r - r % per])
        && {
            let mut firsts: Vec<&String> = (0..num_hosts).map(|h| &hosts[h * per]).collect();
            firsts.sort();
            firsts.dedup();
            firsts.len() == num_hosts
        };
    (num_hosts, if regular { per } else { 0 })
}

/// The receive arena's bytes from `v`: None for "auto" (unset or empty too), a byte count, or 0.
pub(crate) fn recv_arena(v: Option<&str>) -> Result<Option<usize>, String> {
    match v {
        None | Some("") | Some("auto") => Ok(None),
        Some(v) => v.parse::<usize>().map(Some).map_err(|_| {
            format!(
                "{RECV_ARENA_ENV}='{v}': use a byte count >= 0 or auto (twice the fixed receive region, also when unset); 0: no \
                 arena, dispatch outputs are copied out of the NVLink buffer"
            )
        }),
    }
}

/// Whether intranode dispatch returns views of the NVLink buffer ("1") or owned tensors ("0",
/// unset).
pub(crate) fn dispatch_views(v: Option<&str>) -> Result<bool, String> {
    match v {
        None | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(format!(
            "{DISPATCH_VIEWS_ENV}='{v}': use 1 (dispatch outputs are views of the NVLink buffer, valid until the next dispatch on \
             the Buffer) or 0 (torch-owned copies, DeepEP's semantics; the default)"
        )),
    }
}

/// Whether output views are made from DLPack capsules ("1", unset: the default) or from
/// `__cuda_array_interface__` objects ("0": the fallback, 6-7 us more per cached dispatch).
pub(crate) fn dlpack_views(v: Option<&str>) -> Result<bool, String> {
    match v {
        Some("0") => Ok(false),
        None | Some("1") => Ok(true),
        Some(v) => Err(format!(
            "{DLPACK_VIEWS_ENV}='{v}': use 1 (output views made from DLPack capsules; the default) or 0 \
             (from __cuda_array_interface__ objects)"
        )),
    }
}

/// DeepEP v1.2.1's `get_dispatch_config` / `get_combine_config` tables (`deep_ep/buffer.py`):
/// `(num_ranks, (nvl_chunk_send, nvl_chunk_recv, rdma_chunk_send, rdma_chunk_recv))`.
const DISPATCH_CONFIGS: [(usize, [usize; 4]); 10] = [
    (2, [24, 256, 6, 128]),
    (4, [6, 256, 6, 128]),
    (8, [6, 256, 6, 128]),
    (16, [36, 288, 20, 128]),
    (24, [8, 288, 32, 128]),
    (32, [32, 288, 32, 128]),
    (64, [20, 288, 28, 128]),
    (128, [20, 560, 32, 128]),
    (144, [32, 720, 12, 128]),
    (160, [28, 720, 12, 128]),
];
const COMBINE_CONFIGS: [(usize, [usize; 4]); 10] = [
    (2, [10, 256, 6, 128]),
    (4, [9, 256, 6, 128]),
    (8, [4, 256, 6, 128]),
    (16, [4, 288, 12, 128]),
    (24, [1, 288, 8, 128]),
    (32, [1, 288, 8, 128]),
    (64, [1, 288, 20, 128]),
    (128, [1, 560, 12, 128]),
    (144, [2, 720, 8, 128]),
    (160, [2, 720, 8, 128]),
];

pub(crate) fn config_row(combine: bool, num_ranks: usize) -> Result<[usize; 4], String> {
    let table = if combine { &COMBINE_CONFIGS } else { &DISPATCH_CONFIGS };
    table.iter().find(|(r, _)| *r == num_ranks).map(|(_, c)| *c).ok_or_else(|| {
        let supported: Vec<String> = table.iter().map(|(r, _)| r.to_string()).collect();
        format!("Unsupported number of EP ranks: {num_ranks} (supported: [{}])", supported.join(", "))
    })
}

/// Where a group's ranks run, from every rank's (host name, CUDA device) (index = rank).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct GroupLayout {
    pub num_hosts: usize,
    /// 0 when the real hosts do not hold equal blocks of consecutive ranks.
    pub ranks_per_host: usize,
    /// Whether the normal mode runs the internode (two-hop) family: the group spans hosts and the
    /// Buffer asked for it (`internode_wanted`: not low-latency, `num_rdma_bytes > 0`).
    pub internode: bool,
    /// This rank's index among the ranks of its (real) host, and their number.
    pub local_rank: usize,
    pub local_world: usize,
    /// The most ranks sharing one GPU (several ranks on one GPU: testing).
    pub ranks_per_gpu: usize,
}

pub(crate) fn group_layout_of(places: &[(String, usize)], rank: usize, k: Option<usize>, internode_wanted: bool) -> Result<GroupLayout, String> {
    let me = &places.get(rank).ok_or_else(|| format!("rank {rank} of a group of {} ranks", places.len()))?.0;
    let hosts: Vec<String> = places.iter().map(|(h, _)| h.clone()).collect();
    let (num_hosts, ranks_per_host) = topology(&hosts, k);
    let internode = num_hosts > 1 && internode_wanted;
    if internode && ranks_per_host == 0 {
        return Err(format!(
            "the group spans {num_hosts} hosts with unequal or interleaved ranks ({hosts:?}); the internode mode needs every host to \
             hold the same number of consecutive ranks: launch the ranks host by host (rank = host * ranks_per_host + local rank), \
             or set {RANKS_PER_HOST_ENV}"
        ));
    }
    let local: Vec<usize> = (0..places.len()).filter(|&r| &places[r].0 == me).collect();
    let local_rank = local.iter().position(|&r| r == rank).unwrap_or(0);
    let ranks_per_gpu = places.iter().map(|p| places.iter().filter(|q| *q == p).count()).max().unwrap_or(1);
    Ok(GroupLayout { num_hosts, ranks_per_host, internode, local_rank, local_world: local.len(), ranks_per_gpu })
}

/// Tokens rank `rank` receives per local expert from every rank's per-expert counts
/// (`all_counts[source][expert]`), each rounded up to `alignment`.
pub(crate) fn recv_counts(all_counts: &[Vec<i64>], rank: usize, alignment: usize) -> Result<Vec<i64>, String> {
    let world = all_counts.len();
    let experts = all_counts.first().map_or(0, Vec::len);
    if world == 0 || experts % world != 0 || all_counts.iter().any(|c| c.len() != experts) || alignment == 0 || rank >= world {
        return Err(format!("per-expert counts of {world} ranks ({experts} experts each, alignment {alignment}) for rank {rank}: every rank must pass num_tokens_per_expert of the same num_experts, a multiple of the ranks"));
    }
    let local = experts / world;
    let a = alignment as i64;
    Ok((rank * local..(rank + 1) * local).map(|e| (all_counts.iter().map(|c| c[e]).sum::<i64>() + a - 1) / a * a).collect())
}

// --- the Python functions ----------------------------------------------------------------------

/// `DEEPEP_KERNELS_RANKS_PER_HOST` as an int (None when unset): every K consecutive ranks form
/// one (emulated) host. K must be 1..8 and divide the world size.
#[pyfunction]
#[pyo3(signature = (world, environ = None))]
pub(crate) fn ranks_per_host_from_env(world: usize, environ: Environ) -> PyResult<Option<usize>> {
    let max_k = deepep_kernels::internode::plan::MAX_RANKS_PER_HOST;
    ranks_per_host(var(&environ, RANKS_PER_HOST_ENV).as_deref(), world, max_k).map_err(PyValueError::new_err)
}

/// (number of hosts, ranks per host) of ranks whose host names are `hosts` (index = rank), or as
/// `DEEPEP_KERNELS_RANKS_PER_HOST` emulates them. Ranks per host is 0 when the real hosts do not
/// hold equal blocks of consecutive ranks (the internode mode needs them).
#[pyfunction]
#[pyo3(signature = (hosts, environ = None))]
pub(crate) fn host_topology(hosts: Vec<String>, environ: Environ) -> PyResult<(usize, usize)> {
    let k = ranks_per_host_from_env(hosts.len(), environ)?;
    Ok(topology(&hosts, k))
}

/// Bytes of the receive arena from `DEEPEP_KERNELS_RECV_ARENA_BYTES`: None for "auto" (unset or
/// empty too; the Runtime then takes twice the fixed receive region), a byte count, or 0 (no arena).
#[pyfunction]
#[pyo3(signature = (environ = None))]
pub(crate) fn recv_arena_from_env(environ: Environ) -> PyResult<Option<usize>> {
    recv_arena(var(&environ, RECV_ARENA_ENV).as_deref()).map_err(PyValueError::new_err)
}

/// `DEEPEP_KERNELS_DISPATCH_VIEWS`: whether intranode dispatch returns views of the NVLink buffer.
#[pyfunction]
#[pyo3(signature = (environ = None))]
pub(crate) fn dispatch_views_from_env(environ: Environ) -> PyResult<bool> {
    dispatch_views(var(&environ, DISPATCH_VIEWS_ENV).as_deref()).map_err(PyValueError::new_err)
}

/// The NVSHMEM variables to set from DeepEP's Buffer arguments in low-latency (and internode) mode.
/// Like DeepEP, P2P and the QP count overwrite the environment and `allow_mnnvl=False` forces
/// `NVSHMEM_DISABLE_MNNVL=1`; `allow_mnnvl=True` leaves an exported value alone (DeepEP leaves
/// NVSHMEM's default, detection on, which is "0" here because the kernels crate would otherwise
/// default it to "1"; its knobs keep exported values, nvshmem/knobs.rs).
#[pyfunction]
#[pyo3(signature = (num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, environ = None))]
pub(crate) fn nvshmem_env(num_qps_per_rank: usize, allow_nvlink_for_low_latency_mode: bool, allow_mnnvl: bool, environ: Environ) -> HashMap<String, String> {
    let mut out = HashMap::new();
    out.insert("NVSHMEM_DISABLE_P2P".to_string(), if allow_nvlink_for_low_latency_mode { "0" } else { "1" }.to_string());
    out.insert("NVSHMEM_IBGDA_NUM_RC_PER_PE".to_string(), num_qps_per_rank.to_string());
    if !allow_mnnvl {
        out.insert("NVSHMEM_DISABLE_MNNVL".to_string(), "1".to_string());
    } else if var(&environ, "NVSHMEM_DISABLE_MNNVL").is_none() {
        out.insert("NVSHMEM_DISABLE_MNNVL".to_string(), "0".to_string());
    }
    out
}

/// Where the ranks of a `Buffer`'s group run, from every rank's `(socket.gethostname(), CUDA
/// device)`: `(num_hosts, ranks_per_host, internode, local_rank, local_world, ranks_per_gpu)`
/// (hosts as `DEEPEP_KERNELS_RANKS_PER_HOST` emulates them, when set). ValueError for an
/// internode group whose hosts do not hold equal blocks of consecutive ranks.
#[pyfunction]
#[pyo3(signature = (places, rank, internode_wanted, environ = None))]
pub(crate) fn group_layout(places: Vec<(String, usize)>, rank: usize, internode_wanted: bool, environ: Environ) -> PyResult<(usize, usize, bool, usize, usize, usize)> {
    let k = ranks_per_host_from_env(places.len(), environ)?;
    let g = group_layout_of(&places, rank, k, internode_wanted).map_err(PyValueError::new_err)?;
    Ok((g.num_hosts, g.ranks_per_host, g.internode, g.local_rank, g.local_world, g.ranks_per_gpu))
}

/// Before NVSHMEM starts (a low-latency or internode `Buffer`): point `NVSHMEM_DIR` at the pip
/// `nvidia-nvshmem-cu13` wheel (torch's) when it is unset, set DeepEP's NVSHMEM variables
/// ([`nvshmem_env`]) in `os.environ`, and check the host library against the cubins' releases
/// (`nvshmem_host_check`: a mismatch is refused now, naming the fix).
#[pyfunction]
pub(crate) fn prepare_nvshmem(py: Python<'_>, num_qps_per_rank: usize, allow_nvlink_for_low_latency_mode: bool, allow_mnnvl: bool) -> PyResult<(String, String)> {
    let environ = py.import("os")?.getattr("environ")?;
    let dir: Option<String> = environ.call_method1("get", ("NVSHMEM_DIR",))?.extract()?;
    if dir.as_deref().map_or(true, str::is_empty) {
        if let Ok(m) = py.import("nvidia.nvshmem") {
            let paths: Vec<String> = m.getattr("__path__").and_then(|p| p.try_iter()?.map(|d| d?.extract()).collect()).unwrap_or_default();
            if let Some(d) = paths.iter().find(|d| std::path::Path::new(d).join("lib/libnvshmem_host.so.3").exists()) {
                environ.set_item("NVSHMEM_DIR", d)?;
            }
        }
    }
    for (k, v) in nvshmem_env(num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, None) {
        environ.set_item(k, v)?;
    }
    crate::nvshmem_host_check()
}

/// DeepEP's `num_recv_tokens_per_expert_list` of a dispatch without top-k: tokens `rank` receives
/// per local expert from every rank's `num_tokens_per_expert` (`all_counts[source]`), each rounded
/// up to `alignment`.
#[pyfunction]
pub(crate) fn recv_counts_per_expert(all_counts: Vec<Vec<i64>>, rank: usize, alignment: usize) -> PyResult<Vec<i64>> {
    recv_counts(&all_counts, rank, alignment).map_err(PyValueError::new_err)
}

/// DeepEP's config table row for `num_ranks`: `(nvl_chunk_send, nvl_chunk_recv, rdma_chunk_send,
/// rdma_chunk_recv)` of dispatch (`combine=False`) or combine.
#[pyfunction]
pub(crate) fn deepep_config(combine: bool, num_ranks: usize) -> PyResult<(usize, usize, usize, usize)> {
    let [a, b, c, d] = config_row(combine, num_ranks).map_err(PyValueError::new_err)?;
    Ok((a, b, c, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn ranks_per_host_must_divide_the_world_and_fit_a_host() {
        assert_eq!(ranks_per_host(None, 8, 8), Ok(None));
        assert_eq!(ranks_per_host(Some(""), 8, 8), Ok(None));
        assert_eq!(ranks_per_host(Some("4"), 8, 8), Ok(Some(4)));
        assert_eq!(ranks_per_host(Some("1"), 2, 8), Ok(Some(1)));
        for bad in ["0", "3", "16", "x", "-2", "2.0"] {
            let e = ranks_per_host(Some(bad), 8, 8).unwrap_err();
            assert!(e.contains(&format!("{RANKS_PER_HOST_ENV}='{bad}'")) && e.contains("use one of [1, 2, 4, 8]"), "{e}");
        }
    }

    #[test]
    fn topology_from_real_hosts_and_the_emulation() {
        assert_eq!(topology(&hosts(&["a"; 4]), None), (1, 4));
        assert_eq!(topology(&hosts(&["a", "a", "b", "b"]), None), (2, 2));
        // interleaved or unequal hosts: no internode layout
        assert_eq!(topology(&hosts(&["a", "b", "a", "b"]), None), (2, 0));
        assert_eq!(topology(&hosts(&["a", "a", "a", "b"]), None), (2, 0));
        assert_eq!(topology(&hosts(&["a", "a", "b", "b", "a", "a"]), None), (2, 0));
        assert_eq!(topology(&hosts(&["a"; 8]), Some(2)), (4, 2));
        assert_eq!(topology(&hosts(&["a"; 2]), Some(1)), (2, 1));
    }

    #[test]
    fn group_layout_from_where_the_ranks_run() {
        let places = |v: &[(&str, usize)]| v.iter().map(|(h, d)| (h.to_string(), *d)).collect::<Vec<_>>();
        // two hosts of two GPUs: rank 3 is the second of host b
        let g = group_layout_of(&places(&[("a", 0), ("a", 1), ("b", 0), ("b", 1)]), 3, None, true).unwrap();
        assert_eq!(g, GroupLayout { num_hosts: 2, ranks_per_host: 2, internode: true, local_rank: 1, local_world: 2, ranks_per_gpu: 1 });
        // low-latency (internode not wanted): interleaved hosts are fine
        let p = places(&[("a", 0), ("b", 0), ("a", 1), ("b", 1)]);
        let g = group_layout_of(&p, 2, None, false).unwrap();
        assert_eq!((g.internode, g.ranks_per_host, g.local_rank, g.local_world), (false, 0, 1, 2));
        let e = group_layout_of(&p, 2, None, true).unwrap_err();
        assert!(e.contains("spans 2 hosts with unequal or interleaved ranks") && e.contains(RANKS_PER_HOST_ENV), "{e}");
        // four ranks on one GPU, emulated as two hosts of two
        let g = group_layout_of(&places(&[("a", 0); 4]), 1, Some(2), true).unwrap();
        assert_eq!(g, GroupLayout { num_hosts: 2, ranks_per_host: 2, internode: true, local_rank: 1, local_world: 4, ranks_per_gpu: 4 });
        assert!(group_layout_of(&places(&[("a", 0)]), 1, None, false).is_err());
    }

    #[test]
    fn arena_and_views_settings() {
        assert_eq!(recv_arena(None), Ok(None));
        assert_eq!(recv_arena(Some("")), Ok(None));
        assert_eq!(recv_arena(Some("auto")), Ok(None));
        assert_eq!(recv_arena(Some("0")), Ok(Some(0)));
        assert_eq!(recv_arena(Some("268435456")), Ok(Some(268435456)));
        for bad in ["-1", "1GB", "1e9", "AUTO"] {
            assert!(recv_arena(Some(bad)).unwrap_err().contains(&format!("{RECV_ARENA_ENV}='{bad}': use a byte count >= 0 or auto")));
        }
        assert_eq!(dispatch_views(None), Ok(false));
        assert_eq!(dispatch_views(Some("0")), Ok(false));
        assert_eq!(dispatch_views(Some("1")), Ok(true));
        let e = dispatch_views(Some("yes")).unwrap_err();
        assert!(e.contains("DEEPEP_KERNELS_DISPATCH_VIEWS='yes': use 1") && e.contains("or 0"), "{e}");
        assert_eq!(dlpack_views(None), Ok(true));
        assert_eq!(dlpack_views(Some("0")), Ok(false));
        assert_eq!(dlpack_views(Some("1")), Ok(true));
        let e = dlpack_views(Some("on")).unwrap_err();
        assert!(e.contains("DEEPEP_KERNELS_DLPACK_VIEWS='on': use 1") && e.contains("or 0"), "{e}");
    }

    #[test]
    fn received_counts_per_local_expert() {
        // 2 ranks, 4 experts (2 local each): rank 1 owns experts 2 and 3
        let all = vec![vec![1, 2, 3, 4], vec![10, 20, 30, 40]];
        assert_eq!(recv_counts(&all, 0, 1), Ok(vec![11, 22]));
        assert_eq!(recv_counts(&all, 1, 1), Ok(vec![33, 44]));
        assert_eq!(recv_counts(&all, 1, 16), Ok(vec![48, 48]));
        assert_eq!(recv_counts(&[vec![0, 0]], 0, 128), Ok(vec![0, 0]));
        assert!(recv_counts(&[vec![1, 2, 3], vec![1, 2]], 0, 1).is_err());
        assert!(recv_counts(&[vec![1, 2, 3], vec![1, 2, 3]], 0, 1).unwrap_err().contains("a multiple of the ranks"));
        assert!(recv_counts(&all, 2, 1).is_err());
    }

    #[test]
    fn deepeps_config_tables() {
        assert_eq!(config_row(false, 8), Ok([6, 256, 6, 128]));
        assert_eq!(config_row(true, 2), Ok([10, 256, 6, 128]));
        assert_eq!(config_row(true, 160), Ok([2, 720, 8, 128]));
        let e = config_row(false, 3).unwrap_err();
        assert!(e.starts_with("Unsupported number of EP ranks: 3 (supported: [2, 4, 8, 16, 24, 32, 64, 128, 144, 160])"), "{e}");
    }
}
