//! Build script of `deepep-kernels`: compiles the CUDA sources into cubins (SASS only) for each
//! GPU architecture of `DEEPEP_CUDA_ARCHS` (default all: sm_90a, sm_100a, sm_103a; `src/arch.rs`)
//! and generates `$OUT_DIR/cubins.rs`, the table that `src/cubins.rs` embeds.
//!
//! - `cuda/*.cu`          -> plain cubins:   `nvcc -cubin`
//! - `cuda/nvshmem/*.cu`  -> NVSHMEM cubins: `nvcc -rdc=true -cubin`,
//!   then `nvlink ... -L. -lnvshmem_device` run in `$NVSHMEM_DIR/lib`
//!
//! Toolkit: `CUDA_HOME` (env), else `<workspace>/.toolchain/nvidia/cu13` (installed by
//! `scripts/install-toolchain.sh`), else `/usr/local/cuda`.
//! NVSHMEM: `NVSHMEM_DIR` (env); unset -> `<workspace>/.toolchain/nvidia/nvshmem` if present;
//! set to the empty string or not found -> a cargo warning and the NVSHMEM cubins are left out.
//! `DEEPEP_NVSHMEM_RELEASES`: more NVSHMEM prefixes (colon separated, each with `include/` and
//! `lib/libnvshmem_device.a`); the NVSHMEM cubins are compiled and linked once per release, and at
//! run time the set matching the process's `libnvshmem_host.so.3` is used (`src/cubins.rs`).
//! `DEEPEP_NVCC_FLAGS`: extra nvcc flags (whitespace separated), e.g. `-lineinfo` or `-G`.
//! `DEEPEP_CUDA_ARCHS`: `all` (the default) or a comma-separated list of `sm_90a`, `sm_100a`,
//! `sm_103a`; every source is compiled (and every NVSHMEM source linked, per release) once per
//! architecture, and at run time the device's compute capability picks the set (`src/cubins.rs`).
//! A developer build for one GPU can name only its architecture (a third of the nvcc time).
//!
//! Cross builds (cargo `--target aarch64-unknown-linux-gnu`, python/scripts/build-wheel.sh
//! `--target aarch64`): nvcc runs on the build machine as always (cubins do not depend on the host
//! CPU), and `nvlink` gets `-cpu-arch=AARCH64`, so that it takes the device code out of an aarch64
//! NVSHMEM's `libnvshmem_device.a` (whose members are aarch64 host objects; an x86_64 nvlink skips
//! them as incompatible otherwise). NVSHMEM_DIR / DEEPEP_NVSHMEM_RELEASES must then be aarch64
//! prefixes: the device code in them differs from the x86_64 wheel's (docs/architecture.md).
//!
//! GPU records: the `machine` field of every `../kernels/results/*.json` record is read, and the
//! architectures whose GPUs it names (`arch::archs_in_machine`) become `RECORDED_ARCHS`: the
//! runtime warns once on a device whose architecture has none (`arch::untested_warning`).
//!
//! ptxas `-v` output is parsed; any register spill in a kernel (or in one of our own device
//! functions) fails the build unless the function is in [`SPILL_ALLOW`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

#[path = "src/cubins/elf.rs"]
#[allow(dead_code)]
mod elf;

#[path = "src/arch.rs"]
#[allow(dead_code)]
mod arch;

use arch::Arch;

/// Functions whose register spills are tolerated: (file stem, function name, why).
/// Keep empty unless a spill is understood and measured harmless; say why in the reason.
const SPILL_ALLOW: &[(&str, &str, &str)] = &[];

/// Resource usage of one function, from `ptxas -v` (and `nvlink -v` for NVSHMEM cubins).
#[derive(Debug, Default, Clone)]
struct Res {
    entry: bool,
    registers: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    smem: u32,
}

struct Built {
    name: String,
    arch: &'static Arch,
    cubin: PathBuf,
    nvshmem: bool,
    /// The NVSHMEM release whose headers and device library went into an NVSHMEM cubin.
    release: Option<(u32, u32, u32)>,
    kernels: Vec<String>,
    res: BTreeMap<String, Res>,
}

/// An NVSHMEM release the cubins are built for: its version and its install folder.
type Release = ((u32, u32, u32), PathBuf);

fn main() {
    let manifest = PathBuf::from(env("CARGO_MANIFEST_DIR").unwrap());
    let workspace = manifest.parent().unwrap().to_path_buf();
    let out = PathBuf::from(env("OUT_DIR").unwrap());
    let cuda_dir = manifest.join("cuda");

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/cubins/elf.rs");
    println!("cargo:rerun-if-changed=src/arch.rs");
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=results");
    for v in ["CUDA_HOME", "NVSHMEM_DIR", "DEEPEP_NVSHMEM_RELEASES", "DEEPEP_NVCC_FLAGS", "DEEPEP_CUDA_ARCHS"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let archs = match env("DEEPEP_CUDA_ARCHS") {
        None => arch::KNOWN.iter().collect(),
        Some(list) => arch::parse_arch_list(&list).unwrap_or_else(|e| fail(format!("\n\n{e}\n"))),
    };
    let recorded = recorded_archs(&manifest.join("results"));

    let cuda_home = find_cuda_home(&workspace);
    let nvcc = cuda_home.join("bin/nvcc");
    let nvcc_version = nvcc_version(&nvcc, &cuda_home);
    if !nvcc_version.starts_with("13.0.") {
        println!(
            "cargo:warning=nvcc {nvcc_version} from {}: the pinned toolchain is CUDA 13.0 (scripts/install-toolchain.sh); \
             cubins from a newer nvcc may not load on a CUDA 13.0 driver (580)",
            cuda_home.display()
        );
    }
    let nvshmem = find_nvshmem(&workspace);
    let nvshmem_version = nvshmem.as_ref().map(|d| nvshmem_version(d));
    // Every release the NVSHMEM cubins are built for: NVSHMEM_DIR's first (the default), then
    // DEEPEP_NVSHMEM_RELEASES in ascending version order; one prefix per release.
    let releases: Vec<Release> = match (&nvshmem, nvshmem_version) {
        (Some(dir), Some(v)) => extra_releases(dir, v),
        _ => {
            if env("DEEPEP_NVSHMEM_RELEASES").is_some() {
                println!("cargo:warning=DEEPEP_NVSHMEM_RELEASES is ignored: the build has no NVSHMEM (NVSHMEM_DIR empty or not found)");
            }
            Vec::new()
        }
    };

    let plain = list_cu(&cuda_dir);
    let nvs_sources = list_cu(&cuda_dir.join("nvshmem"));
    if nvshmem.is_none() && !nvs_sources.is_empty() {
        println!(
            "cargo:warning=NVSHMEM_DIR not set and no .toolchain/nvidia/nvshmem: the NVSHMEM cubins ({}) are left out; \
             NVSHMEM modes will report that the crate was built without NVSHMEM. Fix: run scripts/install-toolchain.sh \
             or export NVSHMEM_DIR=<nvshmem prefix with include/ and lib/libnvshmem_device.a>",
            nvs_sources.iter().map(|p| stem(p)).collect::<Vec<_>>().join(", ")
        );
    }

    let mut common = vec![
        "-O3".into(),
        "-std=c++17".into(),
        "-Xptxas".into(),
        "-v".into(),
        format!("-I{}", cuda_dir.display()),
    ];
    let cccl = cuda_home.join("include/cccl");
    if cccl.is_dir() {
        common.push(format!("-I{}", cccl.display()));
    }
    if let Ok(extra) = std::env::var("DEEPEP_NVCC_FLAGS") {
        common.extend(extra.split_whitespace().map(String::from));
    }

    let mut jobs: Vec<(PathBuf, Option<Release>, &'static Arch)> = Vec::new();
    for &a in &archs {
        jobs.extend(plain.iter().map(|p| (p.clone(), None, a)));
        for r in &releases {
            jobs.extend(nvs_sources.iter().map(|p| (p.clone(), Some(r.clone()), a)));
        }
    }

    // Compile in parallel: a shared queue drained by up to `available_parallelism` workers. A job
    // whose inputs are unchanged since the last run (its `.key` file) reuses its cubin: a rerun
    // for another release list then compiles only the releases that are new.
    let source_hash = hash_tree(&cuda_dir);
    let cpu = nvlink_cpu_arch();
    let cache_key = |src: &Path, release: Option<&((u32, u32, u32), PathBuf)>, a: &Arch| -> String {
        let mut k = format!("{source_hash} {} {} {cpu} {nvcc_version} {:?}", src.display(), a.name, common);
        if let Some((v, dir)) = release {
            let lib = dir.join("lib/libnvshmem_device.a");
            let meta = std::fs::metadata(&lib).ok();
            let stamp = meta.map(|m| (m.len(), m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())));
            k.push_str(&format!(" {v:?} {} {stamp:?}", std::fs::canonicalize(dir).unwrap_or(dir.clone()).display()));
        }
        k
    };
    let queue = Mutex::new(jobs.into_iter().enumerate().collect::<Vec<_>>());
    let results = Mutex::new(Vec::<(usize, Result<Built, String>)>::new());
    let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).max(1);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let Some((i, (src, release, a))) = queue.lock().unwrap().pop() else { break };
                let key = cache_key(&src, release.as_ref(), a);
                let r = compile(&src, release.as_ref(), a, &cuda_home, &common, &out, &key);
                results.lock().unwrap().push((i, r));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);

    let mut built = Vec::new();
    let mut errors = Vec::new();
    for (_, r) in results {
        match r {
            Ok(b) => built.push(b),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        fail(format!("\n\n{}\n", errors.join("\n\n")));
    }

    let versions: Vec<(u32, u32, u32)> = releases.iter().map(|(v, _)| *v).collect();
    write_table(&out, &built, nvshmem_version, &versions, &nvcc_version, &source_hash, nvshmem.is_some(), &archs, &recorded);
}

/// The architectures with a GPU record: those whose GPUs the `machine` field of a
/// `results/*.json` record names. A record that is not JSON with a string `machine` stops the
/// build (kernels/results is data the project keeps; scripts/results.py writes it).
fn recorded_archs(dir: &Path) -> Vec<&'static Arch> {
    let mut found: Vec<&'static Arch> = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else { return found };
    let mut files: Vec<PathBuf> = rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "json")).collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| fail(format!("\n\n{}: {e}\n", f.display())));
        let machine = json_string_field(&text, "machine").unwrap_or_else(|| {
            fail(format!(
                "\n\n{}: no \"machine\" string field; every record in kernels/results names the machine it ran on.\nFix: \
                 write records with scripts/results.py new (kernels/TESTING.md, \"Results as data\").\n",
                f.display()
            ))
        });
        for a in arch::archs_in_machine(&machine) {
            if !found.contains(&a) {
                found.push(a);
            }
        }
    }
    arch::KNOWN.iter().filter(|a| found.contains(a)).collect()
}

/// The value of the first top-level-looking `"key": "..."` string member of a JSON text (escapes
/// `\"` and `\\` understood; other escapes kept as written). Enough for the `machine` field of a
/// record without a JSON parser in the build script.
fn json_string_field(text: &str, key: &str) -> Option<String> {
    let pat = format!("\"{key}\"");
    let at = text.find(&pat)? + pat.len();
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start().strip_prefix('"')?;
    let mut out = String::new();
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                '"' => out.push('"'),
                '\\' => out.push('\\'),
                other => {
                    out.push('\\');
                    out.push(other)
                }
            },
            c => out.push(c),
        }
    }
    None
}

/// nvlink's `-cpu-arch` for the crate's target (cargo's `CARGO_CFG_TARGET_ARCH`): the host CPU
/// whose objects hold the NVSHMEM device library's code.
fn nvlink_cpu_arch() -> &'static str {
    match std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("aarch64") => "AARCH64",
        Ok("x86_64") | Err(_) => "X86_64",
        Ok(other) => fail(format!(
            "\n\ndeepep-kernels builds for x86_64 and aarch64 hosts; the target architecture is {other}.\nFix: build for \
             x86_64-unknown-linux-gnu or aarch64-unknown-linux-gnu.\n"
        )),
    }
}

/// Stop the build with `msg` on stderr (cargo shows it; no panic backtrace noise).
fn fail(msg: String) -> ! {
    eprintln!("{msg}");
    std::process::exit(1);
}

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

fn stem(p: &Path) -> String {
    p.file_stem().unwrap().to_string_lossy().into_owned()
}

fn find_cuda_home(workspace: &Path) -> PathBuf {
    let candidates: Vec<(PathBuf, &str)> = match env("CUDA_HOME") {
        Some(h) => vec![(PathBuf::from(h), "CUDA_HOME")],
        None => vec![
            (workspace.join(".toolchain/nvidia/cu13"), "<workspace>/.toolchain/nvidia/cu13"),
            (PathBuf::from("/usr/local/cuda"), "/usr/local/cuda"),
        ],
    };
    for (dir, _) in &candidates {
        if dir.join("bin/nvcc").is_file() {
            return dir.clone();
        }
    }
    let tried = candidates
        .iter()
        .map(|(d, why)| format!("{}/bin/nvcc ({why})", d.display()))
        .collect::<Vec<_>>()
        .join(", ");
    fail(format!(
        "\n\nnvcc not found (tried {tried}).\nFix: run `scripts/install-toolchain.sh` (pinned CUDA 13.0 pip wheels into \
         .toolchain/, no GPU needed) or export CUDA_HOME=<CUDA 13.0 toolkit with bin/nvcc>.\n"
    ));
}

fn find_nvshmem(workspace: &Path) -> Option<PathBuf> {
    let dir = match std::env::var("NVSHMEM_DIR") {
        Ok(v) if v.is_empty() => return None, // explicitly disabled
        Ok(v) => PathBuf::from(v),
        Err(_) => {
            let d = workspace.join(".toolchain/nvidia/nvshmem");
            if !d.is_dir() {
                return None;
            }
            d
        }
    };
    let lib = dir.join("lib/libnvshmem_device.a");
    if !lib.is_file() || !dir.join("include/nvshmem.h").is_file() {
        fail(format!(
            "\n\nNVSHMEM_DIR={} has no include/nvshmem.h or lib/libnvshmem_device.a.\nFix: point NVSHMEM_DIR at an NVSHMEM \
             prefix (e.g. the nvidia-nvshmem-cu13 3.4.5 wheel's nvidia/nvshmem directory; scripts/install-toolchain.sh \
             installs it), or set NVSHMEM_DIR= (empty) to build without the NVSHMEM kernels.\n",
            dir.display()
        ));
    }
    Some(dir)
}

/// The releases to build the NVSHMEM cubins for: `dir` (NVSHMEM_DIR, version `v`) first, then
/// each prefix of `DEEPEP_NVSHMEM_RELEASES` (colon separated) in ascending version order. A prefix
/// without headers or device library, or two prefixes of one release, stop the build.
fn extra_releases(dir: &Path, v: (u32, u32, u32)) -> Vec<Release> {
    let mut out = vec![(v, dir.to_path_buf())];
    let Some(list) = env("DEEPEP_NVSHMEM_RELEASES") else { return out };
    let mut extra: Vec<((u32, u32, u32), PathBuf)> = Vec::new();
    for p in list.split(':').filter(|p| !p.is_empty()) {
        let d = PathBuf::from(p);
        if !d.join("lib/libnvshmem_device.a").is_file() || !d.join("include/nvshmem.h").is_file() {
            fail(format!(
                "\n\nDEEPEP_NVSHMEM_RELEASES names {}, which has no include/nvshmem.h or lib/libnvshmem_device.a.\nFix: list \
                 NVSHMEM prefixes there (colon separated), e.g. the ones `deepep-nix install --version V --cuda 13 --source pypi \
                 --prefix DIR` makes (python/scripts/nvshmem-prefixes.sh installs every pinned CUDA 13 release).\n",
                d.display()
            ));
        }
        let rv = nvshmem_version(&d);
        if let Some((_, other)) = out.iter().chain(extra.iter()).find(|(x, _)| *x == rv) {
            // The same release twice (e.g. NVSHMEM_DIR and a prefix of the same wheel): fine when
            // the device libraries are the same bytes, else it is ambiguous which to link.
            let same = std::fs::read(other.join("lib/libnvshmem_device.a")).ok() == std::fs::read(d.join("lib/libnvshmem_device.a")).ok();
            if !same {
                fail(format!(
                    "\n\nNVSHMEM {}.{}.{} is given twice with different device libraries: {} and {}.\nFix: list each release \
                     once in DEEPEP_NVSHMEM_RELEASES (NVSHMEM_DIR counts as one).\n",
                    rv.0,
                    rv.1,
                    rv.2,
                    other.display(),
                    d.display()
                ));
            }
            continue;
        }
        println!("cargo:rerun-if-changed={}", d.join("lib/libnvshmem_device.a").display());
        extra.push((rv, d));
    }
    extra.sort();
    out.extend(extra);
    out
}

fn nvcc_version(nvcc: &Path, cuda_home: &Path) -> String {
    let o = Command::new(nvcc).arg("--version").output().unwrap_or_else(|e| {
        fail(format!("\n\ncannot run {}: {e}\nFix: check CUDA_HOME={} (or run scripts/install-toolchain.sh)\n", nvcc.display(), cuda_home.display()))
    });
    let text = String::from_utf8_lossy(&o.stdout);
    // "Cuda compilation tools, release 13.0, V13.0.88"
    text.lines()
        .find_map(|l| l.split(", V").nth(1))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| fail(format!("\n\ncannot parse `{} --version` output:\n{text}\n", nvcc.display())))
}

fn nvshmem_version(dir: &Path) -> (u32, u32, u32) {
    let candidates = [dir.join("include/non_abi/nvshmem_version.h"), dir.join("include/nvshmem_version.h")];
    for f in &candidates {
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        let get = |what: &str| -> Option<u32> {
            let key = format!("NVSHMEM_VENDOR_{what}_VERSION");
            text.lines().find_map(|l| {
                let mut it = l.split_whitespace();
                (it.next() == Some("#define") && it.next() == Some(key.as_str()))
                    .then(|| it.next()?.parse().ok())
                    .flatten()
            })
        };
        if let (Some(a), Some(b), Some(c)) = (get("MAJOR"), get("MINOR"), get("PATCH")) {
            return (a, b, c);
        }
    }
    fail(format!(
        "\n\ncannot find NVSHMEM_VENDOR_{{MAJOR,MINOR,PATCH}}_VERSION in {}.\nFix: NVSHMEM_DIR must be a complete NVSHMEM \
         prefix (>= 3.x, with include/non_abi/nvshmem_version.h).\n",
        candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" or ")
    ));
}

fn list_cu(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else { return vec![] };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    v.sort();
    v
}

fn run(cmd: &mut Command, what: &str) -> Result<String, String> {
    let o = cmd.output().map_err(|e| format!("{what}: cannot run {:?}: {e}", cmd.get_program()))?;
    let log = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if !o.status.success() {
        return Err(format!("{what} failed ({}):\n{cmd:?}\n{log}", o.status));
    }
    Ok(log)
}

fn compile(
    src: &Path,
    release: Option<&((u32, u32, u32), PathBuf)>,
    arch: &'static Arch,
    cuda_home: &Path,
    common: &[String],
    out: &Path,
    key: &str,
) -> Result<Built, String> {
    let is_nvs = release.is_some();
    let name = stem(src);
    let source = std::fs::read_to_string(src).map_err(|e| format!("{}: {e}", src.display()))?;
    let kernels = parse_kernels(&source);
    // One file per (source, release, architecture): `low_latency.nvshmem-3.8.0.sm_100a.cubin`.
    let file = match release {
        Some(((a, b, c), _)) => format!("{name}.nvshmem-{a}.{b}.{c}.{}", arch.name),
        None => format!("{name}.{}", arch.name),
    };
    let compute = arch.name.replacen("sm_", "compute_", 1);
    let gencode = format!("-gencode=arch={compute},code={}", arch.name);
    let cubin = out.join(format!("{file}.cubin"));
    let nvcc = cuda_home.join("bin/nvcc");
    // The front end (cicc) names internal-linkage device symbols `_INTERNAL_<hash of the source's
    // absolute path>_...`, so the cubins would differ between checkouts; give it the path
    // relative to the workspace instead (reproducible wheels, python/scripts/check-reproducible.sh).
    let stable_name = format!(
        "kernels/cuda/{}{}",
        if is_nvs { "nvshmem/" } else { "" },
        src.file_name().unwrap().to_string_lossy()
    );
    let stable = ["-Xcicc", "--orig_src_path_name", "-Xcicc", stable_name.as_str()];
    let key_file = out.join(format!("{file}.key"));
    let (ptxas_log, nvlink_log) = (out.join(format!("{file}.ptxas.log")), out.join(format!("{file}.nvlink.log")));
    let cached = std::fs::read_to_string(&key_file).is_ok_and(|k| k == key) && cubin.is_file();
    let _ = std::fs::remove_file(&key_file);
    let log;
    let mut res;
    if cached {
        log = std::fs::read_to_string(&ptxas_log).map_err(|e| format!("{}: {e}", ptxas_log.display()))?;
        res = parse_ptxas(&log);
        if is_nvs {
            let link_log = std::fs::read_to_string(&nvlink_log).map_err(|e| format!("{}: {e}", nvlink_log.display()))?;
            merge_nvlink(&link_log, &mut res);
        }
    } else if !is_nvs {
        log = run(
            Command::new(&nvcc).arg(&gencode).args(common).args(stable).arg("-cubin").arg("-o").arg(&cubin).arg(src),
            &format!("nvcc {}", src.display()),
        )?;
        res = parse_ptxas(&log);
    } else {
        let nvs = &release.unwrap().1;
        let rdc = out.join(format!("{file}.rdc.cubin"));
        log = run(
            Command::new(&nvcc)
                .arg(&gencode)
                .args(common)
                .arg(format!("-I{}", src.parent().unwrap().display()))
                .arg(format!("-I{}", nvs.join("include").display()))
                .args(stable)
                .args(["-rdc=true", "-cubin", "-o"])
                .arg(&rdc)
                .arg(src),
            &format!("nvcc -rdc {}", src.display()),
        )?;
        res = parse_ptxas(&log);
        // nvlink records its options (with the -L directory) in the cubin: it runs in the
        // library's directory with `-L.`, so the cubin bytes do not depend on where NVSHMEM or
        // the checkout is (reproducible wheels, python/scripts/check-reproducible.sh).
        let link_log = run(
            Command::new(std::path::absolute(cuda_home.join("bin/nvlink")).map_err(|e| format!("nvlink: {e}"))?)
                .current_dir(nvs.join("lib"))
                .args(["-v", &format!("-arch={}", arch.name)])
                // only for a cross build: nvlink records its options in the cubin, and the x86_64
                // cubins stay the bytes they were
                .args((nvlink_cpu_arch() != "X86_64").then(|| format!("-cpu-arch={}", nvlink_cpu_arch())))
                .arg(&rdc)
                .args(["-L.", "-lnvshmem_device", "-o"])
                .arg(&cubin),
            &format!("nvlink {}", rdc.display()),
        )
        .map_err(|e| {
            format!(
                "{e}\nIf nvlink skipped libnvshmem_device.a as incompatible: its members are host objects of one CPU \
                 architecture, and this build links for {} (the cargo target). Fix: point NVSHMEM_DIR and \
                 DEEPEP_NVSHMEM_RELEASES at NVSHMEM prefixes of that architecture (python/scripts/build-wheel.sh --target \
                 aarch64 installs them).",
                nvlink_cpu_arch()
            )
        })?;
        merge_nvlink(&link_log, &mut res);
        let _ = std::fs::write(&nvlink_log, &link_log);
    }
    if !cached {
        let _ = std::fs::write(&ptxas_log, &log);
    }

    // Spill check.
    let mut spills = Vec::new();
    for (f, r) in &res {
        let ours = r.entry || !f.contains("nvshmem");
        let allowed = SPILL_ALLOW.iter().any(|(file, func, _)| *file == name && func == f);
        if ours && !allowed && (r.spill_stores > 0 || r.spill_loads > 0) {
            spills.push(format!(
                "  {f}: {} bytes spill stores, {} bytes spill loads ({} registers)",
                r.spill_stores, r.spill_loads, r.registers
            ));
        }
    }
    if !spills.is_empty() {
        return Err(format!(
            "register spills in {} ({file}, ptxas -v):\n{}\nFix: reduce register pressure (fewer live values, smaller unroll, \
             __launch_bounds__ with a lower block size), or if the spill is measured harmless add the function to \
             SPILL_ALLOW in kernels/build.rs with the reason.",
            src.display(),
            spills.join("\n")
        ));
    }

    // Every parsed extern "C" __global__ name must be in the cubin.
    let bytes = std::fs::read(&cubin).map_err(|e| format!("{}: {e}", cubin.display()))?;
    let syms = elf::global_functions(&bytes).map_err(|e| format!("{}: {e}", cubin.display()))?;
    let missing: Vec<_> = kernels.iter().filter(|k| !syms.contains(k)).collect();
    if !missing.is_empty() {
        return Err(format!("{}: kernels {missing:?} parsed from the source are not in the cubin symbols {syms:?}", src.display()));
    }
    let _ = std::fs::write(&key_file, key);
    Ok(Built { name, arch, cubin, nvshmem: is_nvs, release: release.map(|(v, _)| *v), kernels, res })
}

/// Parse `ptxas -v` output into per-function resources.
fn parse_ptxas(log: &str) -> BTreeMap<String, Res> {
    let mut m: BTreeMap<String, Res> = BTreeMap::new();
    let mut cur: Option<String> = None;
    let num_before = |l: &str, key: &str| -> Option<u32> {
        let i = l.find(key)?;
        l[..i].split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty())?.parse().ok()
    };
    for line in log.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("ptxas info    : Compiling entry function '") {
            let f = rest.split('\'').next().unwrap_or("").to_string();
            m.entry(f.clone()).or_default().entry = true;
            cur = Some(f);
        } else if let Some(f) = l.strip_prefix("ptxas info    : Function properties for ") {
            let f = f.trim().to_string();
            m.entry(f.clone()).or_default();
            cur = Some(f);
        } else if l.contains("bytes spill stores") {
            if let Some(r) = cur.as_ref().and_then(|f| m.get_mut(f)) {
                r.stack = num_before(l, "bytes stack frame").unwrap_or(0);
                r.spill_stores = num_before(l, "bytes spill stores").unwrap_or(0);
                r.spill_loads = num_before(l, "bytes spill loads").unwrap_or(0);
            }
        } else if l.starts_with("ptxas info    : Used ") {
            if let Some(r) = cur.as_ref().and_then(|f| m.get_mut(f)) {
                r.registers = num_before(l, "registers").unwrap_or(0);
                r.smem = num_before(l, "bytes smem").unwrap_or(0);
            }
        }
    }
    m
}

/// Fold `nvlink -v` final properties (registers / stack after linking the device library) in.
fn merge_nvlink(log: &str, m: &mut BTreeMap<String, Res>) {
    let mut cur: Option<String> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for '").nth(1) {
            cur = rest.split('\'').next().map(String::from);
        } else if let (Some(f), true) = (&cur, line.contains("registers")) {
            let field = |key: &str| -> Option<u32> {
                line.split(',').find(|p| p.contains(key))?.split_whitespace().find_map(|w| w.parse().ok())
            };
            if let Some(r) = m.get_mut(f) {
                r.registers = field("registers").unwrap_or(r.registers);
                r.stack = field("stack").unwrap_or(r.stack);
            }
            cur = None;
        }
    }
}

/// What an open brace of a CUDA source opened (for [`parse_kernels`]).
#[derive(Clone)]
enum Brace {
    ExternC,
    Namespace(String),
    Other,
}

/// The entry-point symbols of a CUDA source: the names of its `extern "C" __global__` functions
/// (comments and preprocessor lines ignored; `extern "C" { ... }` blocks understood; attributes
/// such as `__launch_bounds__(..)` skipped), and the Itanium-mangled names of `__global__`
/// functions with C++ linkage inside namespaces (the low-latency entry points live in `ll::`, so
/// profilers show `ll::dispatch*`; their parameters must be plain class types, which is all the
/// mangling here covers).
fn parse_kernels(src: &str) -> Vec<String> {
    let toks = tokenize(src);
    let mut names = Vec::new();
    let mut braces: Vec<Brace> = Vec::new();
    for i in 0..toks.len() {
        let t = toks[i].as_str();
        match t {
            "{" => braces.push(if i >= 2 && toks[i - 2] == "extern" && toks[i - 1] == "\"C\"" {
                Brace::ExternC
            } else if i >= 2 && toks[i - 2] == "namespace" {
                Brace::Namespace(toks[i - 1].clone())
            } else {
                Brace::Other
            }),
            "}" => {
                braces.pop();
            }
            "__global__" => {
                let prefixed = i >= 2 && toks[i - 2] == "extern" && toks[i - 1] == "\"C\"";
                let extern_c = prefixed || braces.iter().any(|b| matches!(b, Brace::ExternC));
                let namespaces: Vec<&str> =
                    braces.iter().filter_map(|b| if let Brace::Namespace(n) = b { Some(n.as_str()) } else { None }).collect();
                if !extern_c && namespaces.is_empty() {
                    continue;
                }
                // Walk to the first identifier followed by "(" that is not a __attribute__.
                let mut j = i + 1;
                while j + 1 < toks.len() {
                    let is_ident = toks[j].chars().next().is_some_and(|c| c.is_alphabetic() || c == '_');
                    if is_ident && toks[j + 1] == "(" {
                        if toks[j].starts_with("__") {
                            // skip the balanced attribute argument list
                            let mut depth = 0;
                            j += 1;
                            loop {
                                match toks[j].as_str() {
                                    "(" => depth += 1,
                                    ")" => depth -= 1,
                                    _ => {}
                                }
                                j += 1;
                                if depth == 0 || j >= toks.len() {
                                    break;
                                }
                            }
                            continue;
                        }
                        if extern_c {
                            names.push(toks[j].clone());
                        } else {
                            names.push(mangle(&namespaces, &toks[j], &param_types(&toks, j + 1)));
                        }
                        break;
                    }
                    j += 1;
                }
            }
            _ => {}
        }
    }
    names
}

/// The parameter types of the list opening at `toks[open] == "("`: each parameter's tokens without
/// `const` and without its name. Panics (a build error naming the fix) on anything but a plain
/// class type.
fn param_types(toks: &[String], open: usize) -> Vec<String> {
    let mut params: Vec<Vec<String>> = vec![Vec::new()];
    let mut depth = 0;
    for t in &toks[open..] {
        match t.as_str() {
            "(" => {
                depth += 1;
                if depth == 1 {
                    continue;
                }
            }
            ")" => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            "," if depth == 1 => {
                params.push(Vec::new());
                continue;
            }
            _ => {}
        }
        params.last_mut().unwrap().push(t.clone());
    }
    params
        .into_iter()
        .filter(|p| !p.is_empty())
        .map(|p| {
            let ty: Vec<&String> = p.iter().filter(|t| t.as_str() != "const").collect();
            let plain = ty.len() == 2 && ty.iter().all(|t| t.chars().all(|c| c.is_alphanumeric() || c == '_'));
            assert!(
                plain,
                "a namespaced __global__ kernel takes parameter `{}`; build.rs mangles only plain class types \
                 (`[const] Type name`): pass a struct by value or give the kernel extern \"C\" linkage",
                p.join(" ")
            );
            ty[0].clone()
        })
        .collect()
}

/// Itanium C++ mangling of `ns1::ns2::name(T1, T2, ...)` for plain class parameter types.
fn mangle(namespaces: &[&str], name: &str, params: &[String]) -> String {
    let mut m = String::from("_ZN");
    for n in namespaces.iter().copied().chain(std::iter::once(name)) {
        m.push_str(&format!("{}{n}", n.len()));
    }
    m.push('E');
    if params.is_empty() {
        m.push('v');
    }
    for p in params {
        m.push_str(&format!("{}{p}", p.len()));
    }
    m
}

fn tokenize(src: &str) -> Vec<String> {
    // Drop preprocessor lines (with continuations) first.
    let mut text = String::new();
    let mut in_pp = false;
    for line in src.lines() {
        let starts_pp = line.trim_start().starts_with('#');
        if starts_pp || in_pp {
            in_pp = line.trim_end().ends_with('\\');
            text.push('\n');
            continue;
        }
        text.push_str(line);
        text.push('\n');
    }
    let c: Vec<char> = text.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < c.len() && !(c[i] == '*' && c[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if ch == '"' || ch == '\'' {
            let start = i;
            i += 1;
            while i < c.len() && c[i] != ch {
                if c[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            toks.push(c[start..i.min(c.len())].iter().collect());
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            toks.push(c[start..i].iter().collect());
        } else {
            if !ch.is_whitespace() {
                toks.push(ch.to_string());
            }
            i += 1;
        }
    }
    toks
}

/// FNV-1a 64 over (relative path, contents) of every file under `cuda/`, sorted by path.
fn hash_tree(dir: &Path) -> String {
    fn walk(d: &Path, out: &mut Vec<PathBuf>) {
        if let Ok(rd) = std::fs::read_dir(d) {
            for e in rd.flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, out);
                } else {
                    out.push(p);
                }
            }
        }
    }
    let mut files = Vec::new();
    walk(dir, &mut files);
    files.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in files {
        feed(f.strip_prefix(dir).unwrap().to_string_lossy().as_bytes());
        feed(&[0]);
        feed(&std::fs::read(&f).unwrap_or_default());
        feed(&[0]);
    }
    format!("{h:016x}")
}

#[allow(clippy::too_many_arguments)]
fn write_table(
    out: &Path,
    built: &[Built],
    nvs: Option<(u32, u32, u32)>,
    releases: &[(u32, u32, u32)],
    nvcc: &str,
    hash: &str,
    nvs_enabled: bool,
    archs: &[&'static Arch],
    recorded: &[&'static Arch],
) {
    let mut s = String::new();
    writeln!(s, "// @generated by kernels/build.rs").unwrap();
    writeln!(s, "pub static CUBINS: &[Cubin] = &[").unwrap();
    for b in built {
        writeln!(s, "    Cubin {{").unwrap();
        writeln!(s, "        name: {:?},", b.name).unwrap();
        writeln!(s, "        arch: {:?},", b.arch.name).unwrap();
        writeln!(s, "        cc: {:?},", b.arch.cc).unwrap();
        writeln!(s, "        bytes: include_bytes!({:?}),", b.cubin.display().to_string()).unwrap();
        writeln!(s, "        nvshmem: {},", b.nvshmem).unwrap();
        writeln!(s, "        nvshmem_release: {:?},", b.release).unwrap();
        writeln!(s, "        kernels: &{:?},", b.kernels).unwrap();
        writeln!(s, "        resources: &[").unwrap();
        for k in &b.kernels {
            let r = b.res.get(k).cloned().unwrap_or_default();
            writeln!(
                s,
                "            KernelResources {{ name: {k:?}, registers: {}, stack_bytes: {}, spill_bytes: {}, static_smem_bytes: {} }},",
                r.registers,
                r.stack,
                r.spill_stores + r.spill_loads,
                r.smem
            )
            .unwrap();
        }
        writeln!(s, "        ],").unwrap();
        writeln!(s, "    }},").unwrap();
    }
    writeln!(s, "];").unwrap();
    writeln!(s, "pub const NVSHMEM_VERSION: Option<(u32, u32, u32)> = {nvs:?};").unwrap();
    writeln!(s, "pub const NVSHMEM_ENABLED: bool = {nvs_enabled};").unwrap();
    let mut sorted = releases.to_vec();
    sorted.sort();
    writeln!(s, "pub const NVSHMEM_RELEASES: &[(u32, u32, u32)] = &{sorted:?};").unwrap();
    // The served releases as one ASCII marker in the binary, for tools that read a built
    // extension's bytes without loading it (deepep-nix doctor).
    let list: Vec<String> = sorted.iter().map(|(a, b, c)| format!("{a}.{b}.{c}")).collect();
    writeln!(s, "pub static RELEASES_MARKER: &str = {:?};", format!("DEEPEP_KERNELS_NVSHMEM_RELEASES={};", list.join(","))).unwrap();
    writeln!(s, "pub const NVCC_VERSION: &str = {nvcc:?};").unwrap();
    let names = |list: &[&'static Arch]| list.iter().map(|a| a.name).collect::<Vec<_>>();
    writeln!(s, "pub const ARCHS: &[&str] = &{:?};", names(archs)).unwrap();
    writeln!(s, "pub const RECORDED_ARCHS: &[&str] = &{:?};", names(recorded)).unwrap();
    // The architectures built and those with a GPU record, as ASCII markers for tools that read
    // the extension's bytes (deepep-nix doctor): `DEEPEP_KERNELS_ARCHS=sm_90a,sm_100a;`.
    writeln!(s, "pub static ARCHS_MARKER: &str = {:?};", format!("DEEPEP_KERNELS_ARCHS={};", names(archs).join(","))).unwrap();
    writeln!(s, "pub static RECORDED_ARCHS_MARKER: &str = {:?};", format!("DEEPEP_KERNELS_RECORDED_ARCHS={};", names(recorded).join(","))).unwrap();
    writeln!(s, "pub const SOURCE_HASH: &str = {hash:?};").unwrap();
    std::fs::write(out.join("cubins.rs"), s).unwrap();
}
