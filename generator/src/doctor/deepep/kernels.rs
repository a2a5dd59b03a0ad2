//! `deepep-kernels.*`: this project's DeepEP-compatible Python package `deepep_kernels`
//! (`python/`, docs/python.md) in a `--python-site` directory: its version, the NVSHMEM its cubins
//! were linked against, the NVSHMEM host library it would load, torch's own NVSHMEM, the IBGDA
//! plugin and the GPUs against its cubins' architectures. Nothing is imported or loaded.
//!
//! What the installed package records: the extension `deepep_kernels/_native*.so` embeds its
//! cubins (kernels/build.rs, `include_bytes!`); each NVSHMEM cubin is `nvlink`ed with
//! `libnvshmem_device.a`, whose device variable `nvshmemi_device_lib_version_d` holds
//! {major, minor, patch} (the value NVSHMEM itself compares with its host library). The cubins'
//! ELF header holds the SM architecture. These survive stripping (they are data of the host
//! library, not its symbols), so nothing besides the wheel's own files is needed.
//!
//! Which host library it loads (`prepare_nvshmem` in python/src/settings.rs, then
//! `HostLib::load` in kernels/src/nvshmem/binding.rs): `$NVSHMEM_DIR/lib/libnvshmem_host.so.3`
//! when `NVSHMEM_DIR` is set and non-empty; with it unset, the `nvidia-nvshmem` wheel Python
//! imports first (`nvidia/nvshmem` in the first site directory that has it); otherwise
//! `libnvshmem_host.so.3` through the loader (the extension's RUNPATH, `LD_LIBRARY_PATH`, system
//! directories). The host library must be exactly the version the cubins were linked against.
//!
//! A build names the NVSHMEM releases it serves (cubins linked against each release's device
//! library: NVSHMEM_DIR's and those of `DEEPEP_NVSHMEM_RELEASES`) in its extension: the ASCII
//! marker `DEEPEP_KERNELS_NVSHMEM_RELEASES=<X.Y.Z,...>;` (ascending, once; empty list without
//! NVSHMEM kernels), the list `deepep_kernels._native.nvshmem_releases()` returns. Such a build uses the
//! `libnvshmem_host.so.3` already loaded in the process (torch's, when torch has
//! `torch/lib/libtorch_nvshmem.so`), else `$NVSHMEM_DIR/lib`, else the nvidia-nvshmem wheel, else
//! the loader's search path, and works with any release it serves. A build from before the
//! marker serves exactly the one release its cubins were linked against.

use super::super::elf::{self, native_ident, Resolution};
use super::super::facts::{DriverInfo, NvshmemInfo, Version};
use super::super::host::Host;
use super::super::nvshmem::HOST_LIB;
use super::super::report::{caps, Check};
use super::{
    arch_check, find_version, first_site, ibgda_plugin_check, list_sites, show, torch_check,
    version_at, Image, TorchNvshmem, TorchSubject,
};
use std::path::{Path, PathBuf};

mod untested;

const PACKAGE: &str = "deepep_kernels";
/// `e_machine` of CUDA ELF images.
const EM_CUDA: u16 = 190;
/// The device variable of `libnvshmem_device.a` holding {major, minor, patch} as three i32.
const DEVICE_VERSION_VAR: &[u8] = b"nvshmemi_device_lib_version_d";
/// The marker of a build that serves several NVSHMEM releases: `<MARKER><X.Y.Z,...>;`.
pub const RELEASES_MARKER: &str = "DEEPEP_KERNELS_NVSHMEM_RELEASES=";

/// The NVSHMEM releases a build serves, from its `DEEPEP_KERNELS_NVSHMEM_RELEASES=...;` marker:
/// `Ok(None)` without a marker (a build that serves the one release of its cubins), `Err` for a
/// marker that is malformed, not ascending or present twice with different lists. An occurrence
/// of the prefix not followed by `<digits, dots and commas>;` (e.g. the prefix alone as a
/// string the extension uses itself) is not a marker.
pub fn served_releases(bytes: &[u8]) -> Result<Option<Vec<Version>>, String> {
    let prefix = RELEASES_MARKER.as_bytes();
    let mut found: Option<Vec<Version>> = None;
    let mut at = 0usize;
    while let Some(pos) = find_bytes(&bytes[at..], prefix) {
        let start = at + pos + prefix.len();
        at = start;
        let rest = &bytes[start..];
        let len = rest
            .iter()
            .position(|b| !(b.is_ascii_digit() || *b == b'.' || *b == b','))
            .unwrap_or(rest.len());
        if len == 0 || rest.get(len) != Some(&b';') {
            continue;
        }
        let text = std::str::from_utf8(&rest[..len]).unwrap_or_default();
        let mut list = Vec::new();
        for item in text.split(',') {
            let v = Version::parse(item).ok_or_else(|| {
                format!("{RELEASES_MARKER}{text}; names {item:?}, not a release X.Y.Z")
            })?;
            if list.last().is_some_and(|last: &Version| *last >= v) {
                return Err(format!(
                    "{RELEASES_MARKER}{text}; is not in ascending order without repeats"
                ));
            }
            list.push(v);
        }
        match &found {
            Some(prev) if *prev != list => {
                return Err(format!(
                    "the extension holds two different markers, {RELEASES_MARKER}{}; and {RELEASES_MARKER}{text};",
                    prev.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",")
                ))
            }
            _ => found = Some(list),
        }
    }
    Ok(found)
}

/// `3.3.20, 3.4.5, 3.8.0`.
fn list_versions(vs: &[Version]) -> String {
    vs.iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `deepep_kernels` found in a site directory.
pub(super) struct Package {
    /// `<site>/deepep_kernels`.
    pub dir: PathBuf,
    /// The extension, `<site>/deepep_kernels/_native*.so`.
    native: PathBuf,
}

/// `deepep_kernels/` with a `_native*.so` in `site`.
pub(super) fn find(host: &Host, site: &Path) -> Option<Package> {
    let dir = site.join(PACKAGE);
    let names = host.list_dir(&dir).ok()?;
    let native = names
        .iter()
        .find(|n| n.starts_with("_native") && n.contains(".so"))?;
    Some(Package {
        native: dir.join(native),
        dir,
    })
}

/// What the embedded cubins record.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Cubins {
    /// How many CUDA ELF images were found.
    pub count: usize,
    /// Their SM architectures, as images (sorted, deduplicated).
    pub images: Vec<Image>,
    /// The NVSHMEM device library versions linked into them (sorted, deduplicated; empty: no
    /// NVSHMEM cubin).
    pub nvshmem: Vec<Version>,
}

impl Cubins {
    /// The architectures of the images, as the package check says them.
    fn gpu_text(&self) -> String {
        if self.images.is_empty() {
            return "no GPU code found (no embedded cubin)".to_string();
        }
        self.images.iter().map(|i| i.name()).collect::<Vec<_>>().join(" ")
    }
}

/// The CUDA ELF images (cubins) embedded in `bytes` (a host binary) and what they record. An
/// image is a 64-bit little-endian ELF header with `e_machine` EM_CUDA; it extends to the end of
/// its section or program header table. Anything malformed is skipped.
pub fn embedded_cubins(bytes: &[u8]) -> Cubins {
    let mut out = Cubins::default();
    let mut at = 0usize;
    while let Some(pos) = find_bytes(&bytes[at..], b"\x7fELF\x02\x01") {
        let start = at + pos;
        let image = &bytes[start..];
        match cubin_extent(image) {
            Some(len) => {
                let cubin = &image[..len.min(image.len())];
                out.count += 1;
                if let Some(img) = cubin_arch(cubin) {
                    out.images.push(img);
                }
                if let Some(v) = cubin_nvshmem_version(cubin) {
                    out.nvshmem.push(v);
                }
                at = start + len.max(4).min(image.len());
            }
            None => at = start + 4,
        }
        if at >= bytes.len() {
            break;
        }
    }
    out.images.sort();
    out.images.dedup();
    out.nvshmem.sort();
    out.nvshmem.dedup();
    out
}

fn find_bytes(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn u16_at(d: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        d.get(o..o.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn u32_at(d: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        d.get(o..o.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(d: &[u8], o: usize) -> Option<usize> {
    usize::try_from(u64::from_le_bytes(
        d.get(o..o.checked_add(8)?)?.try_into().ok()?,
    ))
    .ok()
}

/// The length of the CUDA ELF image starting at `d[0]`, or `None` if it is not one.
fn cubin_extent(d: &[u8]) -> Option<usize> {
    if u16_at(d, 18)? != EM_CUDA {
        return None;
    }
    let (phoff, shoff) = (u64_at(d, 32)?, u64_at(d, 40)?);
    let (phentsize, phnum) = (usize::from(u16_at(d, 54)?), usize::from(u16_at(d, 56)?));
    let (shentsize, shnum) = (usize::from(u16_at(d, 58)?), usize::from(u16_at(d, 60)?));
    let end = |off: usize, n: usize, size: usize| off.checked_add(n.checked_mul(size)?);
    let len = end(shoff, shnum, shentsize)?.max(end(phoff, phnum, phentsize)?);
    (len >= 64).then_some(len)
}

/// The SM architecture in a cubin's `e_flags`: bits 8-15 from ELF ABI version 8 on (CUDA 13's
/// nvcc writes 0x5a = 90 there for sm_90a), bits 0-7 before.
fn cubin_arch(d: &[u8]) -> Option<Image> {
    let flags = u32_at(d, 48)?;
    let abi = *d.get(8)?;
    let sm = if abi >= 8 {
        (flags >> 8) & 0xff
    } else {
        flags & 0xff
    };
    (sm >= 10).then_some(Image::Cubin(sm / 10, sm % 10))
}

/// The value of `nvshmemi_device_lib_version_d` in a cubin: find it in the symbol table
/// (SHT_SYMTAB and its string table), read three little-endian i32 from its section.
fn cubin_nvshmem_version(d: &[u8]) -> Option<Version> {
    let shoff = u64_at(d, 40)?;
    let shentsize = usize::from(u16_at(d, 58)?);
    let shnum = usize::from(u16_at(d, 60)?);
    if shentsize < 64 {
        return None;
    }
    // (type, addr, offset, size, link, entsize) of section i
    let section = |i: usize| -> Option<(u32, usize, usize, usize, usize, usize)> {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        Some((
            u32_at(d, h + 4)?,
            u64_at(d, h + 16)?,
            u64_at(d, h + 24)?,
            u64_at(d, h + 32)?,
            u32_at(d, h + 40)? as usize,
            u64_at(d, h + 56)?,
        ))
    };
    for i in 0..shnum {
        let Some((2, _, off, size, link, entsize)) = section(i) else {
            continue;
        };
        let (_, _, stroff, strsize, _, _) = section(link)?;
        let strtab = d.get(stroff..stroff.checked_add(strsize)?)?;
        let entsize = if entsize >= 24 { entsize } else { 24 };
        let count = size / entsize;
        for k in 0..count {
            let e = off.checked_add(k.checked_mul(entsize)?)?;
            let name_off = u32_at(d, e)? as usize;
            let name = strtab.get(name_off..)?;
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            if name != DEVICE_VERSION_VAR {
                continue;
            }
            let shndx = usize::from(u16_at(d, e + 6)?);
            let value = u64_at(d, e + 8)?;
            let (_, addr, soff, ssize, _, _) = section(shndx)?;
            let rel = value.checked_sub(addr)?;
            if rel.checked_add(12)? > ssize {
                return None;
            }
            let at = soff.checked_add(rel)?;
            let word = |j: usize| u32_at(d, at + 4 * j);
            return Some(Version(word(0)?, word(1)?, word(2)?));
        }
    }
    None
}

/// Where the package's NVSHMEM host library comes from, for messages.
enum Source {
    /// `NVSHMEM_DIR`.
    Dir,
    /// The nvidia-nvshmem wheel in this site directory, used when NVSHMEM_DIR is unset.
    Wheel(PathBuf),
    /// The loader (RUNPATH, LD_LIBRARY_PATH, system directories), and why.
    Loader(String),
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Dir => "NVSHMEM_DIR".into(),
            Source::Wheel(site) => format!(
                "the nvidia-nvshmem wheel in {}, which {PACKAGE} uses when NVSHMEM_DIR is unset",
                site.display()
            ),
            Source::Loader(why) => format!("the loader's search path, as {why}"),
        }
    }
}

/// The `deepep-kernels.*` checks for the package `pkg`.
pub(super) fn check(
    host: &Host,
    sites: &[PathBuf],
    pkg: &Package,
    torch: &TorchNvshmem,
    driver: &DriverInfo,
    checked: &NvshmemInfo,
    out: &mut Vec<Check>,
) {
    let build_fix = "rebuild and reinstall the wheel: python/scripts/build-wheel.sh && pip install --force-reinstall --no-deps target/wheels/deepep_kernels-*.whl (docs/python.md)";
    let version = sites
        .iter()
        .find_map(|s| find_version(host, s, &format!("{PACKAGE}-")));
    let version_text = match &version {
        Some((v, file)) => format!("{PACKAGE} {v} ({})", file.display()),
        None => format!("{PACKAGE} of unknown version (no {PACKAGE}-*.dist-info metadata)"),
    };

    // deepep-kernels.package
    let id = "deepep-kernels.package";
    let read = host
        .read_bytes(&pkg.native, elf::LIB_CAP)
        .map_err(|e| format!("{} {e}", pkg.native.display()))
        .and_then(|b| {
            let d = elf::parse_dyn(&b).map_err(|e| format!("{}: {e}", pkg.native.display()))?;
            Ok((d, embedded_cubins(&b), served_releases(&b)))
        });
    let (dynamic, cubins, served) = match read {
        Err(e) => {
            out.push(Check::fail(id, caps::ALL, e, build_fix));
            return skip_rest(out, "the extension is unreadable");
        }
        Ok((d, _, _)) if d.ident != native_ident() => {
            out.push(Check::fail(
                id,
                caps::ALL,
                format!(
                    "{} is {}, this host runs {}",
                    pkg.native.display(),
                    d.ident.describe(),
                    native_ident().describe()
                ),
                build_fix,
            ));
            return skip_rest(out, "the extension is for another machine");
        }
        Ok(x) => x,
    };
    untested::check(host, &pkg.native, driver, out); // deepep-kernels.arch-record (kernels/untested.rs)
    // A build with the releases marker: its own package text, host library and torch checks.
    if let Some(served) = match &served {
        Ok(m) => m.clone(),
        Err(e) => {
            out.push(Check::fail(
                id,
                caps::ALL,
                format!(
                    "{}: {version_text}; its NVSHMEM releases marker is unreadable: {e}",
                    pkg.native.display()
                ),
                build_fix,
            ));
            return skip_rest(out, "the build's NVSHMEM releases are unknown");
        }
    } {
        let multi = Multi {
            host,
            sites,
            pkg,
            torch,
            dynamic: &dynamic,
            served: &served,
        };
        return multi.check(&version_text, &cubins, driver, checked, build_fix, out);
    }
    let built_for = match cubins.nvshmem.as_slice() {
        [v] => Some(*v),
        _ => None,
    };
    let nvshmem_text = match cubins.nvshmem.as_slice() {
        [] => "built without NVSHMEM kernels (intranode only)".to_string(),
        [v] => format!("built for NVSHMEM {v} (the device library linked into its cubins)"),
        many => format!(
            "its cubins are linked against several NVSHMEM versions ({})",
            many.iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let gpu_text = cubins.gpu_text();
    let found = format!(
        "{}: {version_text}, this project's deep_ep-compatible package; {nvshmem_text}; GPU code {gpu_text} ({} cubins)",
        pkg.native.display(),
        cubins.count
    );
    if cubins.nvshmem.len() > 1 || cubins.images.is_empty() {
        out.push(Check::fail(id, caps::ALL, found, build_fix));
    } else {
        out.push(Check::ok(id, caps::ALL, found));
    }

    // deepep-kernels.nvshmem: the host library it would load.
    let id = "deepep-kernels.nvshmem";
    let native_dir = pkg.native.parent().unwrap_or(Path::new("/"));
    let env_dir = host.env("NVSHMEM_DIR").filter(|d| !d.is_empty());
    let wheel_site = first_site(sites, |s| {
        host.exists(&s.join("nvidia/nvshmem/lib").join(HOST_LIB))
    });
    let (resolved, source) = match (env_dir, wheel_site) {
        (Some(d), _) if host.exists(&Path::new(d).join("lib").join(HOST_LIB)) => {
            (Ok(Path::new(d).join("lib").join(HOST_LIB)), Source::Dir)
        }
        (Some(d), _) => (
            resolve(host, native_dir, &dynamic),
            Source::Loader(format!("NVSHMEM_DIR={d} has no lib/{HOST_LIB}")),
        ),
        (None, Some(site)) => (
            Ok(site.join("nvidia/nvshmem/lib").join(HOST_LIB)),
            Source::Wheel(site.to_path_buf()),
        ),
        (None, None) => (
            resolve(host, native_dir, &dynamic),
            Source::Loader(format!(
                "NVSHMEM_DIR is unset and no nvidia-nvshmem wheel is in {}",
                list_sites(sites)
            )),
        ),
    };
    let install_fix = |v: Version| {
        format!(
            "deepep-nix install --version {v} --cuda 13 --source pypi --prefix <dir> and export NVSHMEM_DIR=<dir> (or pip install nvidia-nvshmem-cu13=={v} into this environment)"
        )
    };
    let mut loads: Option<PathBuf> = None;
    match (built_for, &resolved) {
        (None, _) if cubins.nvshmem.is_empty() => out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!("{} was built without NVSHMEM kernels: low-latency and internode are compiled out", pkg.native.display()),
            "rebuild the wheel with NVSHMEM: python/scripts/build-wheel.sh (it uses the pinned NVSHMEM 3.4.5 unless NVSHMEM_DIR names another)",
        )),
        (None, _) => out.push(Check::skip(id, caps::NVSHMEM, "the NVSHMEM version of the build is ambiguous (see deepep-kernels.package)")),
        (Some(b), Err(skipped)) => out.push(Check::fail(
            id,
            caps::NVSHMEM,
            format!(
                "{HOST_LIB} not found for {PACKAGE} in {}{skipped}: a low-latency or internode Buffer cannot start",
                source.describe()
            ),
            install_fix(b),
        )),
        (Some(b), Ok(p)) => {
            loads = Some(p.clone());
            let hv = version_at(host, p);
            let from = format!("{}, from {}", p.display(), source.describe());
            match hv {
                Some(hv) if hv == b => out.push(Check::ok(
                    id,
                    caps::NVSHMEM,
                    format!("loads NVSHMEM {hv} ({from}) = the NVSHMEM its cubins were linked against"),
                )),
                Some(hv) => {
                    let prefix = p.parent().and_then(Path::parent).unwrap_or(Path::new("/"));
                    out.push(Check::fail(
                        id,
                        caps::NVSHMEM,
                        format!(
                            "built for NVSHMEM {b}, but would load host library {hv} ({from}): creating a low-latency or internode Buffer raises RuntimeError (the versions must be equal)"
                        ),
                        format!(
                            "{}; or rebuild the wheel against NVSHMEM {hv}: NVSHMEM_DIR={} python/scripts/build-wheel.sh",
                            install_fix(b),
                            prefix.display()
                        ),
                    ));
                }
                None => out.push(Check::warn(
                    id,
                    caps::NVSHMEM,
                    format!("loads {from}, NVSHMEM {}: cannot compare with the build's {b}", show(None)),
                    "check in the Python environment: python3 -c 'import deepep_kernels._native as n; print(n.nvshmem_host_check())'",
                )),
            }
        }
    }

    // deepep-kernels.torch-nvshmem
    let reference = built_for.map(|v| v.to_string()).unwrap_or_default();
    let fix = |wheel_prefix: &Path| {
        format!(
            "use one NVSHMEM: rebuild the wheel against torch's copy (NVSHMEM_DIR={} python/scripts/build-wheel.sh) and leave NVSHMEM_DIR unset at run time, or install the nvidia-nvshmem-cu13 wheel of NVSHMEM {reference} into torch's environment if that torch works with it",
            wheel_prefix.display()
        )
    };
    let subject = TorchSubject {
        id: "deepep-kernels.torch-nvshmem",
        build: "deepep_kernels' build",
        clash: "once torch has loaded its copy, a second NVSHMEM host library of another version in the same process is not supported",
        wheel_only: "deepep_kernels uses that wheel when NVSHMEM_DIR is unset (deepep-kernels.nvshmem)",
        fix: &fix,
    };
    torch_check(sites, torch, built_for, checked, &subject, out);

    // deepep-kernels.ibgda-plugin, deepep-kernels.arch
    plugin_and_arch_checks(host, loads.as_deref(), &cubins.images, driver, out);
}

/// `deepep-kernels.ibgda-plugin` (the IBGDA transport beside the host library that `loads`) and
/// `deepep-kernels.arch` (the embedded cubins' GPU architecture), for either kind of build.
fn plugin_and_arch_checks(host: &Host, loads: Option<&Path>, images: &[Image], driver: &DriverInfo, out: &mut Vec<Check>) {
    ibgda_plugin_check(host, "deepep-kernels.ibgda-plugin", PACKAGE, loads, out);
    arch_check(
        "deepep-kernels.arch",
        images,
        "deepep_kernels' embedded cubins",
        "no embedded cubin to read the GPU architecture from",
        driver,
        &|_| {
            "a default build of deepep_kernels has cubins for compute capability 9.0, 10.0 and 10.3 (sm_90a, sm_100a, sm_103a: Hopper, Blackwell, Blackwell Ultra); for such GPUs rebuild the wheel with DEEPEP_CUDA_ARCHS unset (python/scripts/build-wheel.sh), for others use upstream DeepEP built for them (docs/deepep.md)".to_string()
        },
        out,
    );
}

/// A build with the `DEEPEP_KERNELS_NVSHMEM_RELEASES` marker and what it is checked against.
struct Multi<'a> {
    host: &'a Host<'a>,
    sites: &'a [PathBuf],
    pkg: &'a Package,
    torch: &'a TorchNvshmem,
    dynamic: &'a elf::DynInfo,
    /// The releases it serves (ascending, not empty).
    served: &'a [Version],
}

impl Multi<'_> {
    fn check(
        &self,
        version_text: &str,
        cubins: &Cubins,
        driver: &DriverInfo,
        checked: &NvshmemInfo,
        build_fix: &str,
        out: &mut Vec<Check>,
    ) {
        let native = self.pkg.native.display();
        let served = list_versions(self.served);
        let gpu_text = cubins.gpu_text();
        // deepep-kernels.package: the marker against the device libraries linked into the
        // cubins (when they are readable: none found is not a contradiction).
        let id = "deepep-kernels.package";
        let linked = if cubins.nvshmem.is_empty() {
            "no NVSHMEM device library version readable in its cubins".to_string()
        } else {
            format!(
                "cubins linked against NVSHMEM {}",
                list_versions(&cubins.nvshmem)
            )
        };
        let found = format!(
            "{native}: {version_text}, this project's deep_ep-compatible package; serves NVSHMEM {served} \
             ({RELEASES_MARKER} in the extension; {linked}); GPU code {gpu_text} ({} cubins)",
            cubins.count
        );
        if !cubins.nvshmem.is_empty() && cubins.nvshmem != self.served {
            out.push(Check::fail(
                id,
                caps::ALL,
                format!(
                    "{found}: the marker and the cubins disagree, so the build is inconsistent"
                ),
                build_fix,
            ));
        } else if cubins.images.is_empty() {
            out.push(Check::fail(id, caps::ALL, found, build_fix));
        } else {
            out.push(Check::ok(id, caps::ALL, found));
        }

        // deepep-kernels.nvshmem: the host library the process has or the package would load.
        let loads = self.nvshmem_check(out);

        // deepep-kernels.torch-nvshmem: torch's NVSHMEM against the releases served.
        self.torch_check(checked, out);

        plugin_and_arch_checks(self.host, loads.as_deref(), &cubins.images, driver, out);
    }

    /// The fix for a release `v` (host library at `lib`) this build does not serve; `or` is the
    /// other way out, after "or ".
    fn unserved_fix(&self, v: Version, lib: &Path, or: &str) -> String {
        let prefix = lib
            .parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new("/"));
        format!(
            "install a deepep_kernels wheel built with that release (DEEPEP_NVSHMEM_RELEASES={} python/scripts/build-wheel.sh, \
             then pip install --force-reinstall --no-deps target/wheels/deepep_kernels-*.whl; a CUDA 13 NVSHMEM {v} prefix \
             also comes from deepep-nix install --version {v} --cuda 13 --source pypi --prefix <dir>) or {or}",
            prefix.display()
        )
    }

    /// `deepep-kernels.nvshmem`; returns the host library it would use.
    fn nvshmem_check(&self, out: &mut Vec<Check>) -> Option<PathBuf> {
        let id = "deepep-kernels.nvshmem";
        let host = self.host;
        let served = list_versions(self.served);
        let newest = *self.served.last()?;
        let env_dir = host.env("NVSHMEM_DIR").filter(|d| !d.is_empty());
        let wheel_site = first_site(self.sites, |s| {
            host.exists(&s.join("nvidia/nvshmem/lib").join(HOST_LIB))
        });
        // (library, where it comes from, the other way out of a mismatch)
        let (lib, from, or): (Result<PathBuf, String>, String, String) =
            match (&self.torch.torch_lib, &self.torch.host_lib, env_dir, wheel_site) {
                (Some(tl), Some(hl), _, _) => (
                    Ok(hl.clone()),
                    format!(
                        "torch's copy: {} loads it first, and {PACKAGE} uses the NVSHMEM already loaded in the process",
                        tl.display()
                    ),
                    "a torch whose NVSHMEM is one of those".to_string(),
                ),
                (_, _, Some(d), _) if host.exists(&Path::new(d).join("lib").join(HOST_LIB)) => (
                    Ok(Path::new(d).join("lib").join(HOST_LIB)),
                    "from NVSHMEM_DIR, as nothing in the process loaded NVSHMEM first".to_string(),
                    format!(
                        "point NVSHMEM_DIR at a release it serves (deepep-nix install --version {newest} --cuda 13 --source pypi --prefix <dir>)"
                    ),
                ),
                (_, _, d, Some(site)) => (
                    Ok(site.join("nvidia/nvshmem/lib").join(HOST_LIB)),
                    format!(
                        "from the nvidia-nvshmem wheel in {}, as nothing loaded NVSHMEM first and NVSHMEM_DIR {}",
                        site.display(),
                        match d {
                            Some(d) => format!("={d} has no lib/{HOST_LIB}"),
                            None => "is unset".into(),
                        }
                    ),
                    format!("pip install nvidia-nvshmem-cu13=={newest} into this environment"),
                ),
                (_, _, d, None) => (
                    resolve(host, self.pkg.native.parent().unwrap_or(Path::new("/")), self.dynamic),
                    format!(
                        "from the loader's search path, as nothing loaded NVSHMEM first, NVSHMEM_DIR {} and no nvidia-nvshmem wheel is in {}",
                        match d {
                            Some(d) => format!("={d} has no lib/{HOST_LIB}"),
                            None => "is unset".into(),
                        },
                        list_sites(self.sites)
                    ),
                    format!(
                        "put one it serves first (deepep-nix install --version {newest} --cuda 13 --source pypi --prefix <dir> and export NVSHMEM_DIR=<dir>)"
                    ),
                ),
            };
        match lib {
            Err(skipped) => {
                out.push(Check::fail(
                    id,
                    caps::NVSHMEM,
                    format!(
                        "{HOST_LIB} not found for {PACKAGE} ({from}){skipped}: a low-latency or internode Buffer cannot start"
                    ),
                    format!(
                        "deepep-nix install --version {newest} --cuda 13 --source pypi --prefix <dir> and export NVSHMEM_DIR=<dir> \
                         (or pip install nvidia-nvshmem-cu13=={newest} into this environment); this build serves NVSHMEM {served}"
                    ),
                ));
                None
            }
            Ok(p) => {
                match version_at(host, &p) {
                    Some(hv) if self.served.contains(&hv) => out.push(Check::ok(
                        id,
                        caps::NVSHMEM,
                        format!(
                            "loads NVSHMEM {hv} ({}, {from}), one of the releases this build serves ({served})",
                            p.display()
                        ),
                    )),
                    Some(hv) => out.push(Check::fail(
                        id,
                        caps::NVSHMEM,
                        format!(
                            "this deepep_kernels build serves NVSHMEM {served}; it would load {hv} ({}, {from}): \
                             creating a low-latency or internode Buffer raises RuntimeError naming the releases it serves",
                            p.display()
                        ),
                        self.unserved_fix(hv, &p, &or),
                    )),
                    None => out.push(Check::warn(
                        id,
                        caps::NVSHMEM,
                        format!(
                            "loads {} ({from}), NVSHMEM {}: cannot compare with the releases this build serves ({served})",
                            p.display(),
                            show(None)
                        ),
                        "check in the Python environment: python3 -c 'import deepep_kernels._native as n; print(n.nvshmem_host_check())'",
                    )),
                }
                Some(p)
            }
        }
    }

    /// `deepep-kernels.torch-nvshmem`: the NVSHMEM torch brings is one of the served releases.
    fn torch_check(&self, checked: &NvshmemInfo, out: &mut Vec<Check>) {
        let id = "deepep-kernels.torch-nvshmem";
        let served = list_versions(self.served);
        let (Some(tv), Some(hl)) = (self.torch.version, &self.torch.host_lib) else {
            // No torch, no NVSHMEM in torch, or one of unknown version: the shared check says
            // which (none of its mismatch cases applies without a version).
            let fix = |p: &Path| {
                format!(
                    "install an NVSHMEM this build serves ({served}) where torch finds it: {}",
                    p.display()
                )
            };
            let subject = TorchSubject {
                id,
                build: "deepep_kernels' build",
                clash: "",
                wheel_only: "",
                fix: &fix,
            };
            return torch_check(
                self.sites,
                self.torch,
                None,
                &NvshmemInfo {
                    version: None,
                    ..checked.clone()
                },
                &subject,
                out,
            );
        };
        match &self.torch.torch_lib {
            Some(tl) if self.served.contains(&tv) => out.push(Check::ok(
                id,
                caps::NVSHMEM,
                format!(
                    "torch loads NVSHMEM {tv} ({}, needed by {}), one of the releases deepep_kernels serves ({served}); \
                     it uses that copy",
                    hl.display(),
                    tl.display()
                ),
            )),
            Some(tl) => out.push(Check::fail(
                id,
                caps::NVSHMEM,
                format!(
                    "this deepep_kernels build serves NVSHMEM {served}; torch loads {tv} ({}, needed by {}): \
                     a low-latency or internode Buffer refuses it",
                    hl.display(),
                    tl.display()
                ),
                self.unserved_fix(tv, hl, "a torch whose NVSHMEM is one of those"),
            )),
            None if self.served.contains(&tv) => out.push(Check::ok(
                id,
                caps::NVSHMEM,
                format!(
                    "torch has no lib/libtorch_nvshmem.so; the nvidia-nvshmem wheel holds NVSHMEM {tv} ({}), \
                     one of the releases deepep_kernels serves ({served})",
                    hl.display()
                ),
            )),
            None => out.push(Check::warn(
                id,
                caps::NVSHMEM,
                format!(
                    "torch has no lib/libtorch_nvshmem.so; the nvidia-nvshmem wheel holds NVSHMEM {tv} ({}), which this \
                     deepep_kernels build does not serve ({served}): it uses that wheel when nothing loaded NVSHMEM first \
                     and NVSHMEM_DIR is unset",
                    hl.display()
                ),
                self.unserved_fix(tv, hl, &format!(
                    "pip install nvidia-nvshmem-cu13=={} into this environment",
                    self.served.last().map(|v| v.to_string()).unwrap_or_default()
                )),
            )),
        }
    }
}

/// `libnvshmem_host.so.3` through the loader for the extension in `dir` (`Err`: not found, with
/// the skipped candidates as text).
fn resolve(host: &Host, dir: &Path, dynamic: &elf::DynInfo) -> Result<PathBuf, String> {
    match elf::resolve(host, HOST_LIB, dir, dynamic) {
        Resolution::Found(p) => Ok(p),
        Resolution::Missing { skipped } if skipped.is_empty() => Err(String::new()),
        Resolution::Missing { skipped } => Err(format!(" [skipped: {}]", skipped.join("; "))),
    }
}

fn skip_rest(out: &mut Vec<Check>, why: &str) {
    for (id, needed) in [
        ("deepep-kernels.nvshmem", caps::NVSHMEM),
        ("deepep-kernels.torch-nvshmem", caps::NVSHMEM),
        ("deepep-kernels.ibgda-plugin", caps::INTERNODE),
        ("deepep-kernels.arch", caps::ALL),
    ] {
        out.push(Check::skip(id, needed, why));
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal CUDA ELF image as nvlink writes it (header, section headers: null, .shstrtab,
    /// .strtab, .symtab, .nv.constant3), with `nvshmemi_device_lib_version_d` = `version` at
    /// offset 8 of .nv.constant3 when given, ELF ABI version 8 and `e_flags` of sm_`sm`.
    pub fn cubin(sm: u32, version: Option<(u32, u32, u32)>) -> Vec<u8> {
        let shstr = b"\0.shstrtab\0.strtab\0.symtab\0.nv.constant3\0".to_vec();
        let mut strtab = b"\0".to_vec();
        strtab.extend_from_slice(b"other_symbol\0");
        let ver_name = strtab.len() as u32;
        strtab.extend_from_slice(DEVICE_VERSION_VAR);
        strtab.push(0);
        let mut constant = vec![0xEEu8; 8];
        let (a, b, c) = version.unwrap_or((9, 9, 9));
        for w in [a, b, c] {
            constant.extend_from_slice(&w.to_le_bytes());
        }
        let sym = |name: u32, shndx: u16, value: u64| {
            let mut e = Vec::new();
            e.extend_from_slice(&name.to_le_bytes());
            e.push(0x11); // GLOBAL OBJECT
            e.push(0);
            e.extend_from_slice(&shndx.to_le_bytes());
            e.extend_from_slice(&value.to_le_bytes());
            e.extend_from_slice(&12u64.to_le_bytes());
            e
        };
        let mut symtab = vec![0u8; 24];
        symtab.extend(sym(1, 4, 0));
        if version.is_some() {
            symtab.extend(sym(ver_name, 4, 8));
        }
        // Layout: header (64), then the section contents, then the section headers.
        let mut body = Vec::new();
        let mut offsets = Vec::new();
        for part in [&shstr, &strtab, &symtab, &constant] {
            offsets.push(64 + body.len());
            body.extend_from_slice(part);
            while body.len() % 8 != 0 {
                body.push(0);
            }
        }
        let shoff = 64 + body.len();
        let mut h = vec![0u8; 64];
        h[..8].copy_from_slice(b"\x7fELF\x02\x01\x01\x41");
        h[8] = 8; // ELF ABI version
        h[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        h[18..20].copy_from_slice(&EM_CUDA.to_le_bytes());
        h[20..24].copy_from_slice(&1u32.to_le_bytes());
        h[40..48].copy_from_slice(&(shoff as u64).to_le_bytes());
        h[48..52].copy_from_slice(&(0x0600_0004u32 | (sm << 8)).to_le_bytes());
        h[52..54].copy_from_slice(&64u16.to_le_bytes());
        h[58..60].copy_from_slice(&64u16.to_le_bytes());
        h[60..62].copy_from_slice(&5u16.to_le_bytes());
        h[62..64].copy_from_slice(&1u16.to_le_bytes());
        let mut out = h;
        out.extend(body);
        out.extend(vec![0u8; 64]); // null section
        let sections: [(u32, u32, usize, usize, u32, u64); 4] = [
            (1, 3, offsets[0], shstr.len(), 0, 0),
            (9, 3, offsets[1], strtab.len(), 0, 0),
            (19, 2, offsets[2], symtab.len(), 2, 24),
            (27, 1, offsets[3], constant.len(), 0, 0),
        ];
        for (name, ty, off, size, link, entsize) in sections {
            let mut s = vec![0u8; 64];
            s[0..4].copy_from_slice(&name.to_le_bytes());
            s[4..8].copy_from_slice(&ty.to_le_bytes());
            s[24..32].copy_from_slice(&(off as u64).to_le_bytes());
            s[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            s[40..44].copy_from_slice(&link.to_le_bytes());
            s[56..64].copy_from_slice(&entsize.to_le_bytes());
            out.extend(s);
        }
        out
    }

    #[test]
    fn releases_marker_is_read_from_the_bytes() {
        let v = |a, b, c| Version(a, b, c);
        let mut bin = b"\x7fELF prefix alone: DEEPEP_KERNELS_NVSHMEM_RELEASES=\0 ...".to_vec();
        assert_eq!(served_releases(&bin), Ok(None));
        bin.extend(b"\0DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.20,3.4.5,3.8.0;\0tail");
        assert_eq!(
            served_releases(&bin),
            Ok(Some(vec![v(3, 3, 20), v(3, 4, 5), v(3, 8, 0)]))
        );
        // The same list twice is one marker; two lists are an error.
        bin.extend(b"DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.20,3.4.5,3.8.0;");
        assert!(served_releases(&bin).unwrap().is_some());
        bin.extend(b"DEEPEP_KERNELS_NVSHMEM_RELEASES=3.4.5;");
        assert_eq!(
            served_releases(&bin),
            Err("the extension holds two different markers, \
                 DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.20,3.4.5,3.8.0; and DEEPEP_KERNELS_NVSHMEM_RELEASES=3.4.5;"
                .into())
        );
        // Numeric order (3.3.9 < 3.3.20), not text order.
        assert_eq!(
            served_releases(b"DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.9,3.3.20;"),
            Ok(Some(vec![v(3, 3, 9), v(3, 3, 20)]))
        );
        assert!(served_releases(b"DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.20,3.3.9;").is_err());
        assert!(served_releases(b"DEEPEP_KERNELS_NVSHMEM_RELEASES=3.4.5,3.4.5;").is_err());
        assert!(served_releases(b"DEEPEP_KERNELS_NVSHMEM_RELEASES=3.4.5,;").is_err());
        // No terminating `;` (cut off): not a marker.
        assert_eq!(
            served_releases(b"DEEPEP_KERNELS_NVSHMEM_RELEASES=3.4.5"),
            Ok(None)
        );
    }

    #[test]
    fn cubins_embedded_in_a_host_binary_are_read() {
        let mut host = b"\x7fELF\x02\x01\x01\0 a host ELF header (x86_64 is not EM_CUDA)".to_vec();
        host.extend_from_slice(&[0u8; 40]);
        host.extend(b"xyz"); // cubins are not aligned in .rodata
        host.extend(cubin(90, None));
        host.extend(b"padding");
        host.extend(cubin(90, Some((3, 4, 5))));
        host.extend(cubin(90, Some((3, 4, 5))));
        let c = embedded_cubins(&host);
        assert_eq!(c.count, 3);
        assert_eq!(c.images, vec![Image::Cubin(9, 0)]);
        assert_eq!(c.nvshmem, vec![Version(3, 4, 5)]);
        // Two NVSHMEM versions are both reported.
        host.extend(cubin(100, Some((3, 8, 0))));
        let c = embedded_cubins(&host);
        assert_eq!(c.images, vec![Image::Cubin(9, 0), Image::Cubin(10, 0)]);
        assert_eq!(c.nvshmem, vec![Version(3, 4, 5), Version(3, 8, 0)]);
        // Every truncation is survived (no panic, no endless loop).
        let one = cubin(90, Some((3, 4, 5)));
        for cut in 0..one.len() {
            let c = embedded_cubins(&one[..cut]);
            assert!(c.nvshmem.is_empty() || c.nvshmem == vec![Version(3, 4, 5)]);
        }
        assert_eq!(embedded_cubins(b"no ELF here"), Cubins::default());
    }
}
