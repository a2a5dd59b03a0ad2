//! What the checks found that later checks read: versions, the running driver and its GPUs, the
//! NVSHMEM that was checked, the RDMA ports. The checks that find them (`driver`, `nvshmem`,
//! `rdma`) and the ones that read them (`rdma`, `knobs`, `deepep`, the verdict) all import this
//! module, not each other.

use super::elf::{DynInfo, ElfIdent};
use std::fmt;
use std::path::PathBuf;

/// A release version `major.minor.patch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// Parses exactly `X.Y.Z`.
    pub fn parse(s: &str) -> Option<Version> {
        let mut it = s.trim().split('.').map(|p| {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                None
            } else {
                p.parse::<u32>().ok()
            }
        });
        let v = Version(it.next()??, it.next()??, it.next()??);
        it.next().is_none().then_some(v)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// What the running driver reports.
#[derive(Debug, Clone, Default)]
pub struct DriverInfo {
    /// Driver version (e.g. "580.159.04"), `None` when the driver is not loaded.
    pub version: Option<String>,
    /// Open GPU kernel modules (needed for DMA-BUF memory registration).
    pub open_modules: bool,
    /// GPUs from `/proc/driver/nvidia/gpus`.
    pub gpus: Vec<Gpu>,
    /// No driver loaded and no NVIDIA GPU on the PCI bus: the GPU checks do not apply here.
    pub no_device: bool,
}

#[derive(Debug, Clone)]
pub struct Gpu {
    pub bus: String,
    pub model: String,
    pub minor: Option<u32>,
}

/// What later checks need to know.
#[derive(Debug, Clone, Default)]
pub struct NvshmemInfo {
    pub version: Option<Version>,
    pub ident: Option<ElfIdent>,
    pub lib_dir: Option<PathBuf>,
    /// Plugin files (host paths) found next to the host library.
    pub plugins: Vec<PathBuf>,
    /// `NVSHMEM_*` environment variables this NVSHMEM does not read.
    pub unknown_env: Vec<String>,
    /// Dynamic section of the host library (its RUNPATH is searched for what it `dlopen`s).
    pub host_dyn: Option<DynInfo>,
}

/// One RDMA port.
#[derive(Debug, Clone)]
pub struct Port {
    pub device: String,
    pub port: String,
    pub state: String,
    pub link_layer: String,
    pub mlx5: bool,
}

impl Port {
    pub fn active(&self) -> bool {
        self.state.ends_with("ACTIVE")
    }
}

/// What the NIC checks found.
#[derive(Debug, Clone, Default)]
pub struct RdmaInfo {
    pub ports: Vec<Port>,
}

impl RdmaInfo {
    /// Active ports of mlx5 NICs (the only ones IBGDA drives).
    pub fn usable(&self) -> impl Iterator<Item = &Port> {
        self.ports.iter().filter(|p| p.mlx5 && p.active())
    }
}
