//! The software stack against the host: the driver branch against the CUDA major version of
//! torch, NVSHMEM and our wheel (`driver.cuda-branch`), and, for DeepEP V2, the NCCL it needs
//! (`deepep.nccl`). Only files are read (`torch/version.py`, the wheels' `*.dist-info`
//! directories, the driver's version); nothing is imported.
//!
//! Driver branches: a CUDA major runs on every driver of its minimum branch or newer (minor
//! version compatibility): CUDA 13.x needs >= 580, 12.x >= 525, 11.x >= 450 (NVIDIA, "CUDA
//! Compatibility", Minor Version Compatibility, Table 1,
//! <https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html>).
//!
//! NCCL: DeepEP 2.1's README asks for "NCCL 2.30.4 and above" (its GIN backend), installed as
//! `pip install "nvidia-nccl-cu13>=2.30.4" --no-deps`; its import (`deep_ep/__init__.py`,
//! `check_nccl_so`, DeepEP dd758ca) asserts that every `libnccl` mapped in the process is one
//! file and that it equals the one of the `nvidia-nccl` wheel it finds (`utils/find_pkgs.py`:
//! `EP_NCCL_ROOT_DIR`, `NCCL_DIR`, else the distribution `nvidia-nccl*` earliest on `sys.path`);
//! `EP_SUPPRESS_NCCL_CHECK=1` skips that check.

use super::facts::{DriverInfo, NvshmemInfo, Version};
use super::host::Host;
use super::report::{caps, Check};
use std::path::{Path, PathBuf};

/// The lowest driver branch of each CUDA major (see the module docs).
pub const MIN_BRANCH: &[(u32, u32)] = &[(13, 580), (12, 525), (11, 450)];

/// The newest CUDA major a driver branch runs, `None` below every known minimum.
pub fn newest_cuda_major(branch: u32) -> Option<u32> {
    MIN_BRANCH
        .iter()
        .find(|(_, min)| branch >= *min)
        .map(|(major, _)| *major)
}

/// `580.159.04` -> 580.
pub fn driver_branch(version: &str) -> Option<u32> {
    version.split('.').next()?.trim().parse().ok()
}

/// `cuda = '13.0'` (or `cuda: Optional[str] = '13.0'`) of `torch/version.py` -> ("13.0", 13);
/// `cuda = None` (a CPU or ROCm build) -> None.
pub fn torch_cuda(version_py: &str) -> Option<(String, u32)> {
    version_py.lines().find_map(|l| {
        let l = l.trim();
        let rest = l.strip_prefix("cuda")?;
        let (lhs, rhs) = rest.split_once('=')?;
        if !(lhs.trim().is_empty() || lhs.trim_start().starts_with(':')) {
            return None;
        }
        let v = rhs.trim().trim_matches(|c| c == '\'' || c == '"');
        let major = v.split('.').next()?.parse().ok()?;
        Some((v.to_string(), major))
    })
}

/// `nvidia_nvshmem_cu13-3.4.5.dist-info` with `dist` = `nvidia_nvshmem` -> (13, "3.4.5").
pub fn wheel_dist_info(name: &str, dist: &str) -> Option<(u32, String)> {
    let rest = name.strip_prefix(dist)?.strip_prefix("_cu")?;
    let rest = rest.strip_suffix(".dist-info")?;
    let (major, version) = rest.split_once('-')?;
    Some((major.parse().ok()?, version.to_string()))
}

/// The first `<dist>_cuNN-<version>.dist-info` in `site`: (its path, CUDA major, version).
fn find_wheel(host: &Host, site: &Path, dist: &str) -> Option<(PathBuf, u32, String)> {
    let mut names = host.list_dir(site).ok()?;
    names.sort();
    names.iter().find_map(|n| {
        wheel_dist_info(n, dist).map(|(major, version)| (site.join(n), major, version))
    })
}

/// One part of the stack and the CUDA major it was built for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// e.g. "torch 2.11.0+cu130 (CUDA 13.0, <site>/torch/version.py)".
    pub what: String,
    pub cuda_major: u32,
}

/// The parts found in `sites` (torch, the nvidia-nvshmem wheel, our `deepep_kernels`) and next to
/// the NVSHMEM checked above (a wheel's `nvidia/nvshmem` prefix has its dist-info two levels up).
pub fn parts(host: &Host, sites: &[PathBuf], checked: &NvshmemInfo) -> Vec<Part> {
    let mut out = Vec::new();
    if let Some(site) = sites
        .iter()
        .find(|s| host.exists(&s.join("torch/version.py")))
    {
        let file = site.join("torch/version.py");
        if let Some((cuda, major)) = host.read_text(&file).ok().as_deref().and_then(torch_cuda) {
            out.push(Part {
                what: format!("torch (CUDA {cuda}, {})", file.display()),
                cuda_major: major,
            });
        }
    }
    let wheel_site = checked
        .lib_dir
        .as_deref()
        .filter(|d| d.ends_with("nvidia/nvshmem/lib"))
        .and_then(|d| d.parent()?.parent()?.parent())
        .map(Path::to_path_buf);
    if let Some((file, major, version)) = sites
        .iter()
        .chain(wheel_site.iter())
        .find_map(|s| find_wheel(host, s, "nvidia_nvshmem"))
    {
        out.push(Part {
            what: format!(
                "NVSHMEM {version} (nvidia-nvshmem-cu{major}, {})",
                file.display()
            ),
            cuda_major: major,
        });
    }
    if let Some(site) = sites
        .iter()
        .find(|s| super::deepep::has_our_package(host, s))
    {
        out.push(Part {
            what: format!(
                "deepep_kernels ({}: its cubins come from nvcc 13.0, the extension binds the CUDA 13.0 driver API)",
                site.join("deepep_kernels").display()
            ),
            cuda_major: 13,
        });
    }
    out
}

const ID: &str = "driver.cuda-branch";

/// `driver.cuda-branch`: the loaded driver's branch against the CUDA major of each part.
pub fn check_driver_branch(driver: &DriverInfo, parts: &[Part], out: &mut Vec<Check>) {
    let Some(version) = driver.version.as_deref() else {
        out.push(Check::skip(ID, caps::ALL, "no NVIDIA driver loaded"));
        return;
    };
    if parts.is_empty() {
        out.push(Check::skip(
            ID,
            caps::ALL,
            format!("driver {version}: no torch, nvidia-nvshmem wheel or deepep_kernels found to compare with (pass --python-site)"),
        ));
        return;
    }
    let Some(branch) = driver_branch(version) else {
        out.push(Check::skip(
            ID,
            caps::ALL,
            format!("driver version {version:?} has no branch number"),
        ));
        return;
    };
    let newest = newest_cuda_major(branch);
    let list = |ps: &[&Part]| {
        ps.iter()
            .map(|p| p.what.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    };
    let too_new: Vec<&Part> = parts
        .iter()
        .filter(|p| newest.map_or(true, |n| p.cuda_major > n))
        .collect();
    let runs = newest.map_or("no CUDA 11 or newer".to_string(), |n| {
        format!("CUDA <= {n}")
    });
    if too_new.is_empty() {
        out.push(Check::ok(
            ID,
            caps::ALL,
            format!(
                "driver {version} (branch R{branch}) runs {runs}: {}",
                list(&parts.iter().collect::<Vec<_>>())
            ),
        ));
        return;
    }
    let need = too_new
        .iter()
        .map(|p| p.cuda_major)
        .max()
        .expect("not empty");
    let min = MIN_BRANCH
        .iter()
        .find(|(m, _)| *m == need)
        .map_or("a newer branch".to_string(), |(_, b)| {
            format!("R{b} or newer")
        });
    let older_builds = if too_new.iter().any(|p| p.what.starts_with("deepep_kernels")) {
        " (deepep_kernels has CUDA 13 builds only)"
    } else {
        ""
    };
    out.push(Check::fail(
        ID,
        caps::ALL,
        format!(
            "driver {version} (branch R{branch}) runs {runs}, but CUDA {need} needs the {min} branch: {} (\"CUDA driver version is insufficient for CUDA runtime version\" at the first CUDA call)",
            list(&too_new)
        ),
        format!(
            "install an NVIDIA driver of branch {min} (NixOS: hardware.nvidia.package = config.boot.kernelPackages.nvidiaPackages.production, or a pinned package of that branch; Ubuntu: sudo apt install nvidia-driver-580-open; then reboot), or use builds for the driver's CUDA {}{older_builds}: e.g. pip install torch --index-url https://download.pytorch.org/whl/cu12<minor> and nvidia-nvshmem-cu12 (deepep-nix install --cuda 12 ...)",
            newest.map_or("release".to_string(), |n| n.to_string())
        ),
    ));
}

/// DeepEP V2's NCCL floor (DeepEP 2.1 README, "NCCL 2.30.4 and above").
pub const V2_NCCL_MIN: Version = Version(2, 30, 4);

/// Where DeepEP V2 finds NCCL: `EP_NCCL_ROOT_DIR`, `NCCL_DIR`, else the first site with an
/// `nvidia_nccl_cuNN-*.dist-info` (its `nvidia/nccl`). Returns (root, version if known, source).
fn nccl_root(host: &Host, sites: &[PathBuf]) -> Option<(PathBuf, Option<Version>, String)> {
    for var in ["EP_NCCL_ROOT_DIR", "NCCL_DIR"] {
        if let Some(dir) = host.env(var).filter(|d| !d.is_empty()) {
            let root = PathBuf::from(dir);
            let version = nccl_banner_version(host, &root.join("lib"));
            return Some((root, version, format!("{var}={dir}")));
        }
    }
    sites.iter().find_map(|s| {
        let (file, major, version) = find_wheel(host, s, "nvidia_nccl")?;
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Some((
            s.join("nvidia/nccl"),
            Version::parse(version.split('+').next().unwrap_or(&version)),
            format!("the nvidia-nccl-cu{major} wheel, {name} in {}", s.display()),
        ))
    })
}

/// `NCCL version X.Y.Z` in a `libnccl.so*` of `lib`, when there is one.
fn nccl_banner_version(host: &Host, lib: &Path) -> Option<Version> {
    let mut names = host.list_dir(lib).ok()?;
    names.sort();
    let name = names.iter().find(|n| n.starts_with("libnccl.so"))?;
    let bytes = host.read_bytes(&lib.join(name), super::elf::LIB_CAP).ok()?;
    nccl_version_in(&bytes)
}

/// The first `NCCL version X.Y.Z` in `bytes` (NCCL's startup banner).
pub fn nccl_version_in(bytes: &[u8]) -> Option<Version> {
    const KEY: &[u8] = b"NCCL version ";
    let mut at = 0;
    while let Some(i) = bytes[at..].windows(KEY.len()).position(|w| w == KEY) {
        let start = at + i + KEY.len();
        let tail: String = bytes[start..]
            .iter()
            .take(16)
            .take_while(|b| b.is_ascii_digit() || **b == b'.')
            .map(|b| *b as char)
            .collect();
        if let Some(v) = Version::parse(tail.trim_end_matches('.')) {
            return Some(v);
        }
        at = start;
    }
    None
}

/// `deepep.nccl` for a DeepEP V2 install (`deepep` is its version text).
pub fn check_nccl(host: &Host, sites: &[PathBuf], deepep: &str, out: &mut Vec<Check>) {
    const ID: &str = "deepep.nccl";
    let ours = "deepep_kernels' ElasticBuffer does not need NCCL (docs/python.md)";
    let install = format!("pip install \"nvidia-nccl-cu13>={V2_NCCL_MIN}\" --no-deps (DeepEP's README; pip may downgrade it again when torch is reinstalled)");
    match nccl_root(host, sites) {
        None => out.push(Check::fail(
            ID,
            caps::ALL,
            format!(
                "DeepEP {deepep} (V2) finds NCCL through EP_NCCL_ROOT_DIR, NCCL_DIR or an nvidia-nccl wheel; none is set or in {}: its import asserts \"Cannot find package: nccl\"",
                sites.iter().map(|s| s.display().to_string()).collect::<Vec<_>>().join(", ")
            ),
            format!("{install}, into the environment of torch; or {ours}"),
        )),
        Some((root, None, source)) => out.push(Check::warn(
            ID,
            caps::ALL,
            format!("DeepEP {deepep} (V2) uses the NCCL in {} ({source}); its version is unknown (no NCCL version banner, no wheel metadata); V2 needs NCCL >= {V2_NCCL_MIN}", root.display()),
            format!("check it: python3 -c 'import torch; print(torch.cuda.nccl.version())'; if older than {V2_NCCL_MIN}: {install}; or {ours}"),
        )),
        Some((root, Some(v), source)) if v < V2_NCCL_MIN => out.push(Check::warn(
            ID,
            caps::ALL,
            format!("DeepEP {deepep} (V2) uses NCCL {v} ({source}, {}): V2 needs NCCL >= {V2_NCCL_MIN} (DeepEP's README; its GIN backend)", root.display()),
            format!("{install}; or {ours}"),
        )),
        Some((root, Some(v), source)) => out.push(Check::ok(
            ID,
            caps::ALL,
            format!("DeepEP {deepep} (V2) uses NCCL {v} ({source}, {}) >= {V2_NCCL_MIN}", root.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branches_and_versions() {
        assert_eq!(driver_branch("580.159.04"), Some(580));
        assert_eq!(driver_branch("garbage"), None);
        assert_eq!(newest_cuda_major(580), Some(13));
        assert_eq!(newest_cuda_major(590), Some(13));
        assert_eq!(newest_cuda_major(579), Some(12));
        assert_eq!(newest_cuda_major(525), Some(12));
        assert_eq!(newest_cuda_major(470), Some(11));
        assert_eq!(newest_cuda_major(418), None);
        assert_eq!(
            torch_cuda("__version__ = '2.11.0+cu130'\ncuda = '13.0'\n"),
            Some(("13.0".into(), 13))
        );
        assert_eq!(
            torch_cuda("cuda: Optional[str] = '12.8'\n"),
            Some(("12.8".into(), 12))
        );
        assert_eq!(torch_cuda("debug = False\ncuda = None\n"), None);
        assert_eq!(torch_cuda("cudnn = '9.1'\n"), None);
        assert_eq!(
            wheel_dist_info("nvidia_nvshmem_cu13-3.4.5.dist-info", "nvidia_nvshmem"),
            Some((13, "3.4.5".into()))
        );
        assert_eq!(
            wheel_dist_info("nvidia_nccl_cu12-2.28.9.dist-info", "nvidia_nccl"),
            Some((12, "2.28.9".into()))
        );
        assert_eq!(
            wheel_dist_info("nvidia_nccl_cu12-2.28.9.dist-info", "nvidia_nvshmem"),
            None
        );
        assert_eq!(
            nccl_version_in(b"\0NCCL version %s\0NCCL version 2.30.4+cuda13.0\0"),
            Some(Version(2, 30, 4))
        );
        assert_eq!(nccl_version_in(b"nothing"), None);
    }
}
