//! `deepep-nix doctor` against whole hosts described as directory trees.
//!
//! The trees start from committed fixtures (`tests/data/hosts/<name>`, text files of /proc, /sys,
//! /dev, /etc) and are completed at test time: the NVSHMEM libraries, its plugins and the system
//! libraries they need are real ELF shared objects built with the C compiler (`$CC`, default
//! `cc`) so that the loadability checks parse real dynamic sections. `/dev/gdrdrv` is a symlink to
//! `/dev/null`, a real character device every user can open; the fixtures' `/proc/devices`
//! therefore lists `gdrdrv` with major 1.
//!
//! The one mock: `nvidia-smi topo -m` output is recorded text, because nvidia-smi cannot run on a
//! machine without a GPU.
//!
//! Unreadable files: tests run as root in CI, and root reads a `chmod 000` file anyway, so
//! unreadability is simulated with objects that are not regular files where a file is expected (a
//! FIFO, which would block a naive reader forever, and a directory).

mod common;
#[path = "common/fatbin.rs"]
mod fatbin;

use common::json_check;
use deepep_nix::doctor::{run_with, Capability, DoctorArgs, Report, Status, ToolOutput, Tools};
use fatbin::fatbin;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tempfile::TempDir;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/hosts");

/// `nvidia-smi topo -m` of two H200 joined by 18 NVLinks (escape codes as nvidia-smi prints them).
const TOPO_NV18: &str = "\u{1b}[4m\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\u{1b}[0m\n\
GPU0\t X \tNV18\t0-47\t0\t\tN/A\n\
GPU1\tNV18\t X \t0-47\t0\t\tN/A\n\
\n\
Legend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n  NV#  = Connection traversing a bonded set of # NVLinks\n";

/// Recorded nvidia-smi (see module docs).
struct RecordedSmi(ToolOutput);

impl Tools for RecordedSmi {
    fn nvidia_smi_topo(&self) -> ToolOutput {
        self.0.clone()
    }
}

// ---------------------------------------------------------------------------------------------
// Real ELF files, built once per test process.

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("cannot run {cmd:?}: {e} (doctor tests need a C compiler and ar)")
    });
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Builds a shared object `out` with SONAME `soname`, C source `src`, linked against `needed`
/// (which become its DT_NEEDED entries), with RPATH `$ORIGIN` like NVSHMEM's libraries.
fn shared(out: &Path, soname: &str, src: &str, needed: &[PathBuf]) {
    shared_with_path(
        out,
        soname,
        src,
        needed,
        "-Wl,--disable-new-dtags",
        "${ORIGIN}",
    );
}

/// [`shared`] with a chosen search path: `dtags` `-Wl,--enable-new-dtags` makes it a RUNPATH
/// (what DeepEP's `-Wl,-rpath,$NVSHMEM_DIR/lib` gives with today's toolchains), else an RPATH.
fn shared_with_path(
    out: &Path,
    soname: &str,
    src: &str,
    needed: &[PathBuf],
    dtags: &str,
    path: &str,
) {
    let c = out.with_extension("c");
    std::fs::write(&c, src).unwrap();
    let mut cmd = Command::new(cc());
    cmd.args(["-shared", "-fPIC", "-nostdlib", "-Wl,--no-as-needed", dtags])
        .arg(format!("-Wl,-rpath,{path}"))
        .arg(format!("-Wl,-soname,{soname}"))
        .arg("-o")
        .arg(out)
        .arg(&c)
        .args(needed);
    run_ok(&mut cmd);
    std::fs::remove_file(c).unwrap();
}

/// Prebuilt artifacts shared by all tests.
struct Artifacts {
    dir: TempDir,
    /// Held while an NVSHMEM prefix is looked up or built: tests run in parallel, and a prefix
    /// not built up front is built by the first test that asks for it. Without the lock a
    /// second test saw the half-built prefix (`exists()`), copied it and met a temporary `.c`
    /// file that the builder had just removed (CI, NotFound in `copy_tree`).
    build: std::sync::Mutex<()>,
}

impl Artifacts {
    fn stub(&self, soname: &str) -> PathBuf {
        self.dir.path().join("stubs").join(soname)
    }

    /// An NVSHMEM prefix: host library of `host`, device library and header of `device`,
    /// transport plugins with SONAME suffix `.so.<transport_major>`.
    fn nvshmem(&self, host: &str, device: &str, transport_major: u32) -> PathBuf {
        let _building = self
            .build
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let prefix = self
            .dir
            .path()
            .join(format!("nvshmem-{host}-{device}-{transport_major}"));
        if prefix.exists() {
            return prefix;
        }
        // Built in a staging directory and renamed into place, so that the prefix exists only
        // complete (also if a build panics half-way under the lock).
        let staging = self.dir.path().join(format!(
            ".staging-nvshmem-{host}-{device}-{transport_major}"
        ));
        if staging.exists() {
            std::fs::remove_dir_all(&staging).unwrap();
        }
        self.build_nvshmem(&staging, host, device, transport_major);
        std::fs::rename(&staging, &prefix).unwrap();
        prefix
    }

    fn build_nvshmem(&self, prefix: &Path, host: &str, device: &str, transport_major: u32) {
        let lib = prefix.join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        let libc = self.stub("libc.so.6");
        shared(
            &lib.join("libnvshmem_host.so.3"),
            "libnvshmem_host.so.3",
            &format!(
                "__attribute__((used)) static const char banner[] = \"NVSHMEM v{host}\";\n\
                 __attribute__((used)) static const char *const env_names[] = {{\"\", \"DEBUG_FILE\", \"QP_DEPTH\"}};\n\
                 int nvshmemx_vendor_get_version_info(int *a, int *b, int *c) {{ return 0; }}\n"
            ),
            std::slice::from_ref(&libc),
        );
        shared(
            &lib.join("nvshmem_bootstrap_uid.so.3"),
            "nvshmem_bootstrap_uid.so.3",
            "int uid_boot;\n",
            std::slice::from_ref(&libc),
        );
        shared(
            &lib.join("nvshmem_bootstrap_pmix.so.3"),
            "nvshmem_bootstrap_pmix.so.3",
            "int pmix_boot;\n",
            &[self.stub("libpmix.so.2"), libc.clone()],
        );
        let t = transport_major;
        shared(
            &lib.join(format!("nvshmem_transport_ibgda.so.{t}")),
            &format!("nvshmem_transport_ibgda.so.{t}"),
            "int ibgda;\n",
            &[self.stub("libmlx5.so.1"), libc.clone()],
        );
        shared(
            &lib.join(format!("nvshmem_transport_ibrc.so.{t}")),
            &format!("nvshmem_transport_ibrc.so.{t}"),
            "int ibrc;\n",
            &[libc],
        );

        // Device library: the version lives in a local symbol of a host-side object, as in
        // NVIDIA's libnvshmem_device.a.
        let parts: Vec<&str> = device.split('.').collect();
        let obj_src = lib.join("init_device.c");
        std::fs::write(
            &obj_src,
            format!(
                "__attribute__((used)) static const int v[3] __asm__(\"_ZL27nvshmemi_device_lib_version\") = {{{}, {}, {}}};\nint nvshmemi_device_state_d;\n",
                parts[0], parts[1], parts[2]
            ),
        )
        .unwrap();
        let obj = lib.join("init_device.cu.o");
        run_ok(
            Command::new(cc())
                .args(["-c", "-fPIC", "-o"])
                .arg(&obj)
                .arg(&obj_src),
        );
        run_ok(
            Command::new("ar")
                .arg("rcs")
                .arg(lib.join("libnvshmem_device.a"))
                .arg(&obj),
        );
        std::fs::remove_file(obj).unwrap();
        std::fs::remove_file(obj_src).unwrap();
        let inc = prefix.join("include/non_abi");
        std::fs::create_dir_all(&inc).unwrap();
        std::fs::write(
            inc.join("nvshmem_version.h"),
            format!(
                "#pragma once\n#define NVSHMEM_VENDOR_MAJOR_VERSION {}\n#define NVSHMEM_VENDOR_MINOR_VERSION {}\n#define NVSHMEM_VENDOR_PATCH_VERSION {}\n#define NVSHMEM_VENDOR_PACKAGE_VERSION 0\n",
                parts[0], parts[1], parts[2]
            ),
        )
        .unwrap();
    }
}

fn artifacts() -> &'static Artifacts {
    static A: OnceLock<Artifacts> = OnceLock::new();
    A.get_or_init(|| {
        let a = Artifacts {
            dir: tempfile::tempdir().unwrap(),
            build: std::sync::Mutex::new(()),
        };
        let stubs = a.dir.path().join("stubs");
        std::fs::create_dir_all(&stubs).unwrap();
        for soname in [
            "libc.so.6",
            "libcuda.so.1",
            "libmlx5.so.1",
            "libibverbs.so.1",
            "libgdrapi.so.2",
            "libpmix.so.2",
        ] {
            shared(&stubs.join(soname), soname, "int stub;\n", &[]);
        }
        // Build the prefixes used by the tests up front (tests run in parallel).
        a.nvshmem("3.4.5", "3.4.5", 3);
        a.nvshmem("3.8.0", "3.4.5", 3);
        a.nvshmem("3.8.0", "3.8.0", 7);
        a.nvshmem("3.3.9", "3.3.9", 3);
        a.nvshmem("3.6.5", "3.6.5", 3);
        a
    })
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dst = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &dst);
        } else {
            std::fs::copy(entry.path(), &dst).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A host under test.

struct TestHost {
    root: TempDir,
    env: BTreeMap<String, String>,
    args: DoctorArgs,
    smi: ToolOutput,
}

impl TestHost {
    /// The fixture tree plus NVSHMEM 3.4.5 in /opt/nvshmem, rdma-core in /opt/rdma-core/lib (via
    /// /etc/ld.so.conf.d), libc and libgdrapi in /usr/lib64, `/dev/gdrdrv` -> `/dev/null`.
    fn ibgda() -> TestHost {
        let h = TestHost::bare("ibgda-host");
        h.install_nvshmem("/opt/nvshmem", "3.4.5", "3.4.5", 3);
        h.install_stub("/opt/rdma-core/lib", "libmlx5.so.1");
        h.install_stub("/opt/rdma-core/lib", "libibverbs.so.1");
        h.install_stub("/usr/lib64", "libgdrapi.so.2");
        std::os::unix::fs::symlink("/dev/null", h.path("/dev/gdrdrv")).unwrap();
        let mut h = h;
        for (k, v) in [
            ("NVSHMEM_DIR", "/opt/nvshmem"),
            ("LD_LIBRARY_PATH", "/opt/nvshmem/lib"),
            ("NVSHMEM_IB_ENABLE_IBGDA", "1"),
            ("NVSHMEM_CUMEM_GRANULARITY", "536870912"),
            ("NVSHMEM_DISABLE_NVLS", "1"),
        ] {
            h.env.insert(k.into(), v.into());
        }
        h.args.max_tokens = Some(128);
        h.args.kernels_nvshmem_version = deepep_nix::doctor::Version::parse("3.4.5");
        h
    }

    /// The 2x H200 machine of docs/gpu-toolchain (no InfiniBand, no gdrdrv, driver options off,
    /// NVSHMEM from the pip wheel on LD_LIBRARY_PATH, NVSHMEM_DIR unset).
    fn gpu_machine() -> TestHost {
        let mut h = TestHost::bare("gpu-machine");
        // `nvidia-smi topo -m` as recorded on that machine (GPU run 1).
        h.smi = ToolOutput::Output(
            std::fs::read_to_string(Path::new(FIXTURES).join("gpu-machine.nvidia-smi-topo-m.txt"))
                .unwrap(),
        );
        // Paths and environment as logged by GPU run 1 (env.log): the wheels in torch's venv,
        // the driver libraries mounted at /usr/local/nvidia/lib64.
        let site = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia";
        h.install_nvshmem(&format!("{site}/nvshmem"), "3.4.5", "3.4.5", 3);
        h.remove("/usr/lib64/libcuda.so.1");
        std::fs::create_dir_all(h.path("/usr/local/nvidia/lib64")).unwrap();
        std::fs::rename(
            h.path("/usr/lib64/libcuda.so.580.159.04"),
            h.path("/usr/local/nvidia/lib64/libcuda.so.580.159.04"),
        )
        .unwrap();
        std::os::unix::fs::symlink(
            "libcuda.so.580.159.04",
            h.path("/usr/local/nvidia/lib64/libcuda.so.1"),
        )
        .unwrap();
        for (k, v) in [
            (
                "LD_LIBRARY_PATH",
                format!("{site}/nccl/lib:{site}/nvshmem/lib:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"),
            ),
            ("NCCL_NVLS_ENABLE", "0".into()),
            ("NVSHMEM_DISABLE_NVLS", "1".into()),
        ] {
            h.env.insert(k.into(), v);
        }
        // rdma-core is installed there (the IBGDA plugin loads), PMIx too.
        for lib in ["libmlx5.so.1", "libibverbs.so.1", "libpmix.so.2"] {
            h.install_stub("/usr/lib64", lib);
        }
        h.args.max_tokens = Some(128);
        h.args.kernels_nvshmem_version = deepep_nix::doctor::Version::parse("3.4.5");
        h
    }

    fn bare(fixture: &str) -> TestHost {
        let root = tempfile::tempdir().unwrap();
        copy_tree(&Path::new(FIXTURES).join(fixture), root.path());
        let a = artifacts();
        let h = TestHost {
            args: DoctorArgs {
                json: false,
                nvshmem_dir: None,
                root: root.path().to_path_buf(),
                max_tokens: None,
                capabilities: vec![],
                kernels_nvshmem_version: None,
                python_site: vec![],
                maps: None,
                maps_python: None,
                maps_modules: None,
            },
            root,
            env: BTreeMap::new(),
            smi: ToolOutput::Output(TOPO_NV18.into()),
        };
        std::fs::create_dir_all(h.path("/usr/lib64")).unwrap();
        std::fs::copy(a.stub("libc.so.6"), h.path("/usr/lib64/libc.so.6")).unwrap();
        // The driver's libcuda, versioned like the kernel module of both fixtures.
        std::fs::copy(
            a.stub("libcuda.so.1"),
            h.path("/usr/lib64/libcuda.so.580.159.04"),
        )
        .unwrap();
        std::os::unix::fs::symlink("libcuda.so.580.159.04", h.path("/usr/lib64/libcuda.so.1"))
            .unwrap();
        h
    }

    /// Where a host path lives in the tree.
    fn path(&self, host_path: &str) -> PathBuf {
        self.root.path().join(host_path.trim_start_matches('/'))
    }

    fn install_nvshmem(&self, prefix: &str, host: &str, device: &str, transport_major: u32) {
        copy_tree(
            &artifacts().nvshmem(host, device, transport_major),
            &self.path(prefix),
        );
    }

    fn install_stub(&self, dir: &str, soname: &str) {
        std::fs::create_dir_all(self.path(dir)).unwrap();
        std::fs::copy(artifacts().stub(soname), self.path(dir).join(soname)).unwrap();
    }

    fn write(&self, host_path: &str, text: impl AsRef<[u8]>) {
        let p = self.path(host_path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// `--maps FILE`, FILE holding `text` (a process's `/proc/<pid>/maps`), written into the tree.
    fn with_maps(mut self, text: &str) -> Self {
        self.write("/tmp/process-maps.txt", text);
        self.args.maps = Some(self.path("/tmp/process-maps.txt"));
        self
    }

    fn remove(&self, host_path: &str) {
        let p = self.path(host_path);
        if p.is_dir() && !p.is_symlink() {
            std::fs::remove_dir_all(&p).unwrap();
        } else {
            std::fs::remove_file(&p).unwrap();
        }
    }

    /// Replaces a file with a FIFO (reading it naively would block forever).
    fn fifo(&self, host_path: &str) {
        let p = self.path(host_path);
        let _ = std::fs::remove_file(&p);
        run_ok(Command::new("mkfifo").arg(&p));
    }

    fn env(mut self, k: &str, v: &str) -> Self {
        self.env.insert(k.into(), v.into());
        self
    }

    fn run(&self) -> Report {
        run_with(&self.args, &self.env, &RecordedSmi(self.smi.clone())).unwrap()
    }
}

// ---------------------------------------------------------------------------------------------
// Assertions.

use Capability::*;

/// (capability, ready, blocked_by) for all four capabilities.
fn verdicts(r: &Report) -> Vec<(Capability, bool, Vec<String>)> {
    r.verdicts
        .iter()
        .map(|v| (v.capability, v.ready, v.blocked_by.clone()))
        .collect()
}

/// The expected `verdicts` in report order, given what blocks each capability; a capability
/// with nothing blocking it is expected ready, one with blockers not ready.
fn expect_verdicts(
    intranode: &[&str],
    low_latency: &[&str],
    ibgda: &[&str],
    cpu_ibgda: &[&str],
) -> Vec<(Capability, bool, Vec<String>)> {
    [
        (Intranode, intranode),
        (LowLatency, low_latency),
        (InternodeIbgda, ibgda),
        (InternodeCpuIbgda, cpu_ibgda),
    ]
    .into_iter()
    .map(|(cap, blocked)| v(cap, blocked.is_empty(), blocked))
    .collect()
}

fn v(cap: Capability, ready: bool, blocked: &[&str]) -> (Capability, bool, Vec<String>) {
    (cap, ready, blocked.iter().map(|s| s.to_string()).collect())
}

fn status(r: &Report, id: &str) -> Status {
    r.check(id)
        .unwrap_or_else(|| panic!("no check {id} in\n{}", r.render_text()))
        .status
}

fn found<'a>(r: &'a Report, id: &str) -> &'a str {
    &r.check(id).unwrap().found
}

fn fix<'a>(r: &'a Report, id: &str) -> &'a str {
    r.check(id)
        .unwrap()
        .fix
        .as_deref()
        .unwrap_or_else(|| panic!("{id} has no fix"))
}

/// Asserts the exact `found` and `fix` texts of check `id`.
fn assert_found_and_fix(r: &Report, id: &str, want_found: &str, want_fix: &str) {
    assert_eq!(found(r, id), want_found, "{id}");
    assert_eq!(fix(r, id), want_fix, "{id}");
}

/// Every check id with its status, for exact comparisons.
fn statuses(r: &Report) -> Vec<(String, Status)> {
    r.checks.iter().map(|c| (c.id.clone(), c.status)).collect()
}

fn all_ready() -> Vec<(Capability, bool, Vec<String>)> {
    expect_verdicts(&[], &[], &[], &[])
}

/// The driver's stream-memops and peer-mapping options block GPU-initiated IBGDA, nothing else.
fn only_params_block_ibgda() -> Vec<(Capability, bool, Vec<String>)> {
    expect_verdicts(
        &[],
        &[],
        &["params.stream-memops", "params.peer-mapping"],
        &[],
    )
}

// ---------------------------------------------------------------------------------------------
// Hosts.

#[test]
fn correctly_configured_ibgda_host_is_ready_for_everything() {
    let r = TestHost::ibgda().run();
    let text = r.render_text();
    assert_eq!(verdicts(&r), all_ready(), "{text}");
    assert_eq!(r.exit_code, 0);
    use Status::Ok as O;
    let expected: Vec<(String, Status)> = [
        ("driver", O),
        ("gpus", O),
        ("device-nodes", O),
        ("cuda-library", O),
        ("nvlink", O),
        ("params.stream-memops", O),
        ("params.peer-mapping", O),
        ("infiniband", O),
        ("infiniband.uverbs", O),
        ("memory-registration", O),
        ("gdrcopy", O),
        ("nvshmem.dir", O),
        ("nvshmem.host-library", O),
        ("nvshmem.cpu-assisted-ibgda", O),
        ("nvshmem.device-library", O),
        ("nvshmem.kernels", O),
        ("nvshmem.loader", O),
        ("nvshmem.plugin.bootstrap", O),
        ("nvshmem.plugin.ibgda", O),
        ("nvshmem.plugins", O),
        ("knob.NVSHMEM_CUMEM_GRANULARITY", O),
        ("knob.NVSHMEM_DISABLE_NVLS", O),
        ("knob.NVSHMEM_IB_ENABLE_IBGDA", O),
        ("knob.NVSHMEM_QP_DEPTH", O),
    ]
    .into_iter()
    .map(|(i, s)| (i.to_string(), s))
    .collect();
    assert_eq!(statuses(&r), expected, "{text}");
    assert!(
        found(&r, "driver").contains("580.159.04 loaded (open kernel modules"),
        "{text}"
    );
    assert!(found(&r, "nvlink").contains("GPU0-GPU1 NV18"));
    assert!(found(&r, "nvshmem.host-library")
        .starts_with("NVSHMEM 3.4.5 (/opt/nvshmem/lib/libnvshmem_host.so.3"));
    assert!(
        found(&r, "gdrcopy").contains("/dev/gdrdrv (char 1:3) opens read-write"),
        "{text}"
    );
    assert!(found(&r, "gdrcopy").contains("libgdrapi.so.2 at /usr/lib64/libgdrapi.so.2"));
    assert!(found(&r, "memory-registration").contains("DMA-BUF available"));
    // rdma-core found through /etc/ld.so.conf -> ld.so.conf.d/rdma-core.conf
    assert!(
        found(&r, "nvshmem.plugin.ibgda").contains("3 libraries resolve"),
        "{text}"
    );
    // pmix needs libpmix, which this host lacks: reported, but unused, so not a failure.
    assert!(found(&r, "nvshmem.plugins")
        .contains("nvshmem_bootstrap_pmix.so.3 not loadable (missing libpmix.so.2), unused"));
    assert!(found(&r, "knob.NVSHMEM_QP_DEPTH")
        .contains("1024 (unset, NVSHMEM default 1024) >= 2*(max tokens 128 + 1) = 258"));
}

#[test]
fn driver_options_configured_but_not_rebooted() {
    let h = TestHost::ibgda();
    let params = std::fs::read_to_string(h.path("/proc/driver/nvidia/params")).unwrap();
    h.write(
        "/proc/driver/nvidia/params",
        params
            .replace("EnableStreamMemOPs: 1", "EnableStreamMemOPs: 0")
            .replace("\"PeerMappingOverride=1;\"", "\"\""),
    );
    let r = h.run();
    assert_eq!(verdicts(&r), only_params_block_ibgda());
    assert_eq!(r.exit_code, 1);
    for id in ["params.stream-memops", "params.peer-mapping"] {
        assert_eq!(status(&r, id), Status::Fail);
        assert!(
            found(&r, id).contains("but /etc/modprobe.d/nvidia-ibgda.conf sets it: reboot pending"),
            "{}",
            found(&r, id)
        );
        assert!(
            fix(&r, id).starts_with("reboot, or reload the nvidia module"),
            "{}",
            fix(&r, id)
        );
    }
    // Only the CPU-assisted capability requested: ready.
    let mut h = h;
    h.args.capabilities = vec![InternodeCpuIbgda, Intranode];
    assert_eq!(h.run().exit_code, 0);
}

#[test]
fn driver_options_missing_everywhere_give_the_modprobe_line_or_the_nixos_option() {
    let h = TestHost::ibgda();
    h.remove("/etc/modprobe.d/nvidia-ibgda.conf");
    let params = std::fs::read_to_string(h.path("/proc/driver/nvidia/params")).unwrap();
    h.write(
        "/proc/driver/nvidia/params",
        params.replace("EnableStreamMemOPs: 1", "EnableStreamMemOPs: 0"),
    );
    let r = h.run();
    assert_eq!(status(&r, "params.stream-memops"), Status::Fail);
    assert_eq!(status(&r, "params.peer-mapping"), Status::Warn);
    assert_eq!(
        fix(&r, "params.stream-memops"),
        "add this line to /etc/modprobe.d/nvidia-ibgda.conf:\n  options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords=\"PeerMappingOverride=1;\"\nthen sudo update-initramfs -u (Debian/Ubuntu) or sudo dracut -f (RHEL), and reboot"
    );
    // The same host on NixOS: the fix is the module option.
    h.write("/etc/os-release", "NAME=NixOS\nID=nixos\n");
    let r = h.run();
    assert!(
        fix(&r, "params.stream-memops").starts_with("set services.deepep.enable = true;"),
        "{}",
        fix(&r, "params.stream-memops")
    );
    // Kernel command line counts as configuration too.
    h.write(
        "/proc/cmdline",
        "root=/dev/sda1 nvidia.NVreg_EnableStreamMemOPs=1\n",
    );
    let r = h.run();
    assert!(found(&r, "params.stream-memops").contains("but /proc/cmdline sets it: reboot pending"));
}

#[test]
fn driver_options_active_but_not_persistent() {
    // Someone loaded the module by hand with the options: works now, gone after a reboot.
    let h = TestHost::ibgda();
    h.remove("/etc/modprobe.d/nvidia-ibgda.conf");
    let r = h.run();
    assert_eq!(status(&r, "params.stream-memops"), Status::Warn);
    assert_eq!(
        found(&r, "params.peer-mapping"),
        "RegistryDwords: \"PeerMappingOverride=1;\" (/proc/driver/nvidia/params), but nothing in \
         modprobe.d or the kernel command line sets it: lost at the next boot"
    );
    assert_eq!(verdicts(&r), all_ready());
    assert_eq!(
        r.verdict(InternodeIbgda).warnings,
        vec![
            "params.stream-memops".to_string(),
            "params.peer-mapping".to_string()
        ]
    );
    assert_eq!(r.exit_code, 0);
}

#[test]
fn gdrdrv_missing_on_a_host_configured_for_it() {
    let h = TestHost::ibgda();
    h.remove("/sys/module/gdrdrv");
    h.remove("/dev/gdrdrv");
    let r = h.run();
    assert_eq!(verdicts(&r), expect_verdicts(&[], &[], &[], &["gdrcopy"]));
    assert_eq!(r.exit_code, 1);
    assert!(found(&r, "gdrcopy").contains("gdrdrv module not loaded"));
    assert!(found(&r, "gdrcopy").contains("/etc/modules-load.d/gdrdrv.conf configures gdrdrv"));
    let f = fix(&r, "gdrcopy");
    assert!(f.contains("sudo modprobe gdrdrv"), "{f}");
    assert!(
        f.contains(
            "sudo mknod -m 0660 /dev/gdrdrv c $(awk '$2==\"gdrdrv\" {print $1}' /proc/devices) 0"
        ),
        "{f}"
    );

    let mut h = h;
    h.args.capabilities = vec![InternodeIbgda];
    assert_eq!(
        h.run().exit_code,
        0,
        "GPU-initiated IBGDA does not need GDRCopy"
    );

    // Nothing of GDRCopy and no intent: only a warning, every capability ready.
    h.args.capabilities = vec![];
    h.remove("/etc/modules-load.d/gdrdrv.conf");
    h.remove("/usr/lib64/libgdrapi.so.2");
    let r = h.run();
    assert_eq!(status(&r, "gdrcopy"), Status::Warn);
    assert_eq!(verdicts(&r), all_ready());
    assert_eq!(
        r.verdict(InternodeCpuIbgda).warnings,
        vec!["gdrcopy".to_string()]
    );
    assert_eq!(r.exit_code, 0);
}

#[test]
fn libgdrapi_found_through_the_nvshmem_runpath() {
    // NixOS-style: libgdrapi only where NVSHMEM's RUNPATH ($ORIGIN here) points, not on the
    // system loader path. NVSHMEM dlopens it from there, so it counts.
    let h = TestHost::ibgda();
    h.remove("/usr/lib64/libgdrapi.so.2");
    h.install_stub("/opt/nvshmem/lib", "libgdrapi.so.2");
    let r = h.run();
    assert_eq!(status(&r, "gdrcopy"), Status::Ok, "{}", r.render_text());
    assert!(found(&r, "gdrcopy").ends_with("libgdrapi.so.2 at /opt/nvshmem/lib/libgdrapi.so.2"));
}

#[test]
fn gdrdrv_device_node_stale_or_wrong_kind() {
    let h = TestHost::ibgda();
    // The module registered another major than the node carries (node from an earlier boot).
    let devices = std::fs::read_to_string(h.path("/proc/devices")).unwrap();
    h.write("/proc/devices", devices.replace("  1 gdrdrv", "511 gdrdrv"));
    let r = h.run();
    assert_eq!(status(&r, "gdrcopy"), Status::Fail);
    assert!(
        found(&r, "gdrcopy")
            .contains("/dev/gdrdrv has major 1 but the loaded gdrdrv registered major 511"),
        "{}",
        found(&r, "gdrcopy")
    );
    assert!(fix(&r, "gdrcopy").starts_with("sudo rm /dev/gdrdrv && sudo mknod"));
    // A regular file where the device node should be.
    h.write("/proc/devices", devices);
    h.remove("/dev/gdrdrv");
    h.write("/dev/gdrdrv", "");
    let r = h.run();
    assert!(found(&r, "gdrcopy").contains("/dev/gdrdrv is a regular file, not a character device"));
    assert_eq!(
        r.verdict(InternodeCpuIbgda).blocked_by,
        vec!["gdrcopy".to_string()]
    );
}

#[test]
fn host_without_infiniband() {
    let h = TestHost::ibgda();
    h.remove("/sys/class/infiniband");
    h.remove("/dev/infiniband");
    let r = h.run();
    assert_eq!(
        verdicts(&r),
        expect_verdicts(&[], &[], &["infiniband"], &["infiniband"])
    );
    assert_eq!(
        found(&r, "infiniband"),
        "no InfiniBand/RoCE device in /sys/class/infiniband"
    );
    assert_eq!(status(&r, "infiniband.uverbs"), Status::Skip);
    assert_eq!(r.exit_code, 1);
    let mut h = h;
    h.args.capabilities = vec![Intranode, LowLatency];
    assert_eq!(h.run().exit_code, 0);
}

#[test]
fn infiniband_port_down_roce_and_containers() {
    let h = TestHost::ibgda();
    h.write("/sys/class/infiniband/mlx5_0/ports/1/state", "1: DOWN\n");
    let r = h.run();
    assert_eq!(
        found(&r, "infiniband"),
        "no ACTIVE port on an mlx5 NIC: mlx5_0 port 1: 1: DOWN, InfiniBand"
    );
    assert_eq!(
        r.verdict(InternodeIbgda).blocked_by,
        vec!["infiniband".to_string()]
    );

    // RoCE without a GID index: works with a warning.
    h.write("/sys/class/infiniband/mlx5_0/ports/1/state", "4: ACTIVE\n");
    h.write(
        "/sys/class/infiniband/mlx5_0/ports/1/link_layer",
        "Ethernet\n",
    );
    let r = h.run();
    assert_eq!(status(&r, "knob.NVSHMEM_IB_GID_INDEX"), Status::Warn);
    assert_eq!(r.exit_code, 0);

    // A container without the verbs device nodes.
    h.remove("/dev/infiniband/uverbs0");
    let r = h.run();
    assert_eq!(status(&r, "infiniband.uverbs"), Status::Fail);
    assert!(fix(&r, "infiniband.uverbs").contains("--device=/dev/infiniband"));
}

#[test]
fn mismatched_nvshmem_libraries() {
    // Host library 3.8.0 with the 3.4.5 device library and headers left in place, and a
    // transport plugin from 3.8.0 (.so.7) next to the 3.4.5 ones (.so.3).
    let h = TestHost::ibgda();
    h.remove("/opt/nvshmem");
    h.install_nvshmem("/opt/nvshmem", "3.8.0", "3.4.5", 3);
    let extra = artifacts()
        .nvshmem("3.8.0", "3.8.0", 7)
        .join("lib/nvshmem_transport_ibrc.so.7");
    std::fs::copy(
        extra,
        h.path("/opt/nvshmem/lib/nvshmem_transport_ibrc.so.7"),
    )
    .unwrap();
    let r = h.run();
    let text = r.render_text();
    let nvshmem_fail = [
        "nvshmem.device-library",
        "nvshmem.kernels",
        "nvshmem.plugins",
    ];
    assert_eq!(
        verdicts(&r),
        expect_verdicts(&[], &nvshmem_fail, &nvshmem_fail, &nvshmem_fail),
        "{text}"
    );
    assert_eq!(
        found(&r, "nvshmem.device-library"),
        "mixed NVSHMEM installation: host library 3.8.0, but 3.4.5 (/opt/nvshmem/lib/libnvshmem_device.a), 3.4.5 (/opt/nvshmem/include/non_abi/nvshmem_version.h)"
    );
    assert!(found(&r, "nvshmem.kernels").starts_with(
        "kernels built against NVSHMEM 3.4.5 (--kernels-nvshmem-version), host library is 3.8.0"
    ));
    assert!(
        found(&r, "nvshmem.plugins").starts_with(
            "transport plugins of different releases in /opt/nvshmem/lib (.so.3, .so.7)"
        ),
        "{text}"
    );
    assert_eq!(r.exit_code, 1);
}

#[test]
fn loader_would_pick_another_nvshmem() {
    // The checked prefix is fine (3.4.5) but NVSHMEM_DIR points at a stale 3.8.0 copy.
    let h = TestHost::ibgda();
    h.install_nvshmem("/opt/nvshmem-old", "3.8.0", "3.8.0", 7);
    let mut h = h.env("NVSHMEM_DIR", "/opt/nvshmem-old");
    h.args.nvshmem_dir = Some("/opt/nvshmem".into());
    let r = h.run();
    assert_eq!(status(&r, "nvshmem.loader"), Status::Fail);
    assert_found_and_fix(
        &r,
        "nvshmem.loader",
        "programs would load /opt/nvshmem-old/lib/libnvshmem_host.so.3 (NVSHMEM 3.8.0) instead of the checked /opt/nvshmem/lib/libnvshmem_host.so.3 (NVSHMEM 3.4.5)",
        "export NVSHMEM_DIR=/opt/nvshmem LD_LIBRARY_PATH=/opt/nvshmem/lib:$LD_LIBRARY_PATH",
    );
    assert_eq!(
        r.verdict(LowLatency).blocked_by,
        vec!["nvshmem.loader".to_string()]
    );

    // NVSHMEM_DIR right, but another copy first on LD_LIBRARY_PATH: our binaries are fine,
    // programs loading by bare name are not -> warning.
    let h = h
        .env("NVSHMEM_DIR", "/opt/nvshmem")
        .env("LD_LIBRARY_PATH", "/opt/nvshmem-old/lib:/opt/nvshmem/lib");
    let r = h.run();
    assert_eq!(status(&r, "nvshmem.loader"), Status::Warn);
    assert!(found(&r, "nvshmem.loader")
        .contains("get /opt/nvshmem-old/lib/libnvshmem_host.so.3 (NVSHMEM 3.8.0)"));
    assert_eq!(r.exit_code, 0);
}

#[test]
fn nvshmem_dir_mistakes_are_explained() {
    let h = TestHost::ibgda().env("NVSHMEM_DIR", "/opt/nvshmem/lib");
    let r = h.run();
    assert_eq!(status(&r, "nvshmem.dir"), Status::Fail);
    assert_eq!(fix(&r, "nvshmem.dir"), "export NVSHMEM_DIR=/opt/nvshmem");
    assert_eq!(status(&r, "nvshmem.host-library"), Status::Skip);
    assert!(r.verdict(Intranode).ready);
    assert_eq!(
        r.verdict(LowLatency).blocked_by,
        vec!["nvshmem.dir".to_string()]
    );

    let r = TestHost::ibgda()
        .env("NVSHMEM_DIR", "/nowhere")
        .env("LD_LIBRARY_PATH", "")
        .run();
    assert_eq!(
        found(&r, "nvshmem.dir"),
        "/nowhere (from NVSHMEM_DIR) does not exist"
    );
    // The install it advises takes PyPI's wheel, which works where NVIDIA's host is not reachable.
    assert!(
        fix(&r, "nvshmem.dir").contains(
            "deepep-nix install --version 3.4.5 --cuda 13 --source pypi --prefix /opt/nvshmem-3.4.5"
        ),
        "{}",
        fix(&r, "nvshmem.dir")
    );

    let r = TestHost::ibgda().env("NVSHMEM_DIR", "relative/dir").run();
    assert_eq!(
        found(&r, "nvshmem.dir"),
        "NVSHMEM_DIR=relative/dir is not an absolute path"
    );

    // fish's `eval (deepep-nix env --prefix /opt/nvshmem --shell fish)`: the three lines joined
    // into one `set`, NVSHMEM_DIR exported as every word of them.
    let garbage = "/opt/nvshmem set -gx LD_LIBRARY_PATH /lib /usr/lib set -gx PATH /bin /usr/bin";
    let r = TestHost::ibgda().env("NVSHMEM_DIR", garbage).run();
    assert_eq!(status(&r, "nvshmem.dir"), Status::Fail);
    assert!(
        found(&r, "nvshmem.dir")
            .contains("fish's `eval (...)`, which joins its lines into one `set`"),
        "{}",
        found(&r, "nvshmem.dir")
    );
    assert_eq!(
        fix(&r, "nvshmem.dir"),
        "set -e NVSHMEM_DIR; deepep-nix env --prefix /opt/nvshmem --shell fish | source (and open a new fish for a clean LD_LIBRARY_PATH and PATH)"
    );
    // A directory name with a space is not taken for that.
    let r = TestHost::ibgda()
        .env("NVSHMEM_DIR", "/opt/my nvshmem")
        .run();
    assert!(
        found(&r, "nvshmem.dir").contains("does not exist"),
        "{}",
        found(&r, "nvshmem.dir")
    );

    // Too old for DeepEP and for CPU-assisted IBGDA.
    let h = TestHost::ibgda();
    h.remove("/opt/nvshmem");
    h.install_nvshmem("/opt/nvshmem", "3.3.9", "3.3.9", 3);
    let mut h = h;
    h.args.kernels_nvshmem_version = None;
    let r = h.run();
    assert_eq!(
        found(&r, "nvshmem.host-library"),
        "NVSHMEM 3.3.9 (/opt/nvshmem/lib/libnvshmem_host.so.3, ELF64 x86-64, via NVSHMEM_DIR)"
            .replace("x86-64", native_arch())
    );
    assert_eq!(status(&r, "nvshmem.cpu-assisted-ibgda"), Status::Fail);
    assert_eq!(status(&r, "nvshmem.kernels"), Status::Skip);
    assert_eq!(
        r.verdict(InternodeCpuIbgda).blocked_by,
        vec!["nvshmem.cpu-assisted-ibgda".to_string()]
    );
    assert!(r.verdict(InternodeIbgda).ready);
}

fn native_arch() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "aarch64"
    } else {
        "x86-64"
    }
}

#[test]
fn unreadable_files_are_reported_without_hanging() {
    let h = TestHost::ibgda();
    // A FIFO where the params file should be: opening it would block until a writer appears.
    h.fifo("/proc/driver/nvidia/params");
    // A directory where the host library should be.
    h.remove("/opt/nvshmem/lib/libnvshmem_host.so.3");
    std::fs::create_dir(h.path("/opt/nvshmem/lib/libnvshmem_host.so.3")).unwrap();
    // A directory where an InfiniBand port state should be.
    h.remove("/sys/class/infiniband/mlx5_0/ports/1/state");
    std::fs::create_dir(h.path("/sys/class/infiniband/mlx5_0/ports/1/state")).unwrap();
    let r = h.run();
    let text = r.render_text();
    assert_eq!(
        found(&r, "params.stream-memops"),
        "/proc/driver/nvidia/params is a FIFO, not a regular file"
    );
    assert_eq!(status(&r, "params.peer-mapping"), Status::Fail);
    assert_eq!(
        found(&r, "nvshmem.host-library"),
        "/opt/nvshmem/lib/libnvshmem_host.so.3 is a directory, not a regular file"
    );
    assert!(
        found(&r, "infiniband")
            .contains("mlx5_0 port 1: unreadable (is a directory, not a regular file)"),
        "{text}"
    );
    assert_eq!(
        verdicts(&r),
        expect_verdicts(
            &[],
            &["nvshmem.host-library", "nvshmem.loader"],
            &[
                "params.stream-memops",
                "params.peer-mapping",
                "infiniband",
                "nvshmem.host-library",
                "nvshmem.loader"
            ],
            &["infiniband", "nvshmem.host-library", "nvshmem.loader"]
        ),
        "{text}"
    );
    assert_eq!(r.exit_code, 1);
}

#[test]
fn garbage_in_params() {
    let h = TestHost::ibgda();
    // Binary junk: no "Name: value" lines at all.
    h.write(
        "/proc/driver/nvidia/params",
        [0xffu8, 0x00, 0x13, 0x37, b'\n', 0xfe, b':', 0x01],
    );
    let r = h.run();
    assert_eq!(
        found(&r, "params.stream-memops"),
        "/proc/driver/nvidia/params has no \"Name: value\" lines; cannot find EnableStreamMemOPs"
    );
    assert_eq!(verdicts(&r), only_params_block_ibgda());
    assert_eq!(r.exit_code, 1);

    // Plausible lines with impossible values.
    h.write(
        "/proc/driver/nvidia/params",
        "EnableStreamMemOPs: banana\nRegistryDwords: PeerMappingOverride=1;\n",
    );
    let r = h.run();
    assert_eq!(
        found(&r, "params.stream-memops"),
        "EnableStreamMemOPs has the value \"banana\", not a number"
    );
    assert_eq!(
        found(&r, "params.peer-mapping"),
        "RegistryDwords has the value \"PeerMappingOverride=1;\", not a quoted string"
    );

    // Entries missing.
    h.write(
        "/proc/driver/nvidia/params",
        "ResmanDebugLevel: 4294967295\nRmMsg: \"\"\n",
    );
    let r = h.run();
    assert_eq!(
        found(&r, "params.peer-mapping"),
        "RegistryDwords is not listed in /proc/driver/nvidia/params (2 other entries)"
    );

    // Garbage in the version file: driver unusable, everything blocked.
    h.write("/proc/driver/nvidia/version", "\u{0}\u{1}garbage\n");
    let r = h.run();
    assert_eq!(status(&r, "driver"), Status::Fail);
    assert!(r
        .verdicts
        .iter()
        .all(|v| !v.ready && v.blocked_by.contains(&"driver".to_string())));
}

#[test]
fn gpu_machine_of_the_project() {
    // The 2x H200 machine: no InfiniBand, no gdrdrv, EnableStreamMemOPs 0, NVSHMEM 3.4.5 wheel on
    // LD_LIBRARY_PATH. `gpu-machine.doctor.json` is what the real doctor printed there (GPU run 2,
    // `--kernels-nvshmem-version 3.4.5 --max-tokens 128`); the test tree must give the same
    // statuses and verdicts.
    let h = TestHost::gpu_machine();
    let r = h.run();
    let text = r.render_text();
    let recorded: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(FIXTURES).join("gpu-machine.doctor.json")).unwrap(),
    )
    .unwrap();
    let real_statuses: Vec<(String, String)> = recorded["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap().to_string(),
                c["status"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let ours: Vec<(String, String)> = r
        .checks
        .iter()
        .map(|c| {
            (
                c.id.clone(),
                serde_json::to_value(c.status)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(ours, real_statuses, "{text}");
    assert_eq!(
        serde_json::to_value(&r.verdicts).unwrap(),
        recorded["verdicts"],
        "{text}"
    );
    assert_eq!(r.exit_code, 1);
    assert_eq!(
        verdicts(&r),
        expect_verdicts(
            &[],
            &[],
            &["params.stream-memops", "params.peer-mapping", "infiniband"],
            &["infiniband"]
        )
    );
    assert_eq!(
        found(&r, "params.stream-memops"),
        "EnableStreamMemOPs: 0 (not configured in modprobe.d or the kernel command line)"
    );
    assert!(found(&r, "nvshmem.dir").starts_with(
        "NVSHMEM_DIR not set; libnvshmem_host.so.3 found on the loader path in /opt/torch/.venv/"
    ));
    let mut h = h;
    h.args.capabilities = vec![Intranode, LowLatency];
    assert_eq!(h.run().exit_code, 0);
    // The report of the test tree (docs/doctor.md compares it with the real one).
    if std::env::var_os("DOCTOR_PRINT").is_some() {
        println!("{text}");
    }
}

#[test]
fn nvlink_topology_matters_for_nvlink_capabilities() {
    let mut h = TestHost::ibgda();
    h.smi = ToolOutput::Output(TOPO_NV18.replace("NV18", "SYS"));
    let r = h.run();
    assert_eq!(status(&r, "nvlink"), Status::Fail);
    assert_eq!(
        found(&r, "nvlink"),
        "GPU pairs without NVLink (nvidia-smi topo -m): GPU0-GPU1 SYS"
    );
    assert!(fix(&r, "nvlink").ends_with("sudo systemctl enable --now nvidia-fabricmanager"));
    h.write("/etc/NIXOS", "");
    let r = h.run();
    assert!(fix(&r, "nvlink").ends_with("services.deepep.fabricManager.enable = true;"));
    h.remove("/etc/NIXOS");
    assert!(r
        .verdicts
        .iter()
        .all(|v| v.blocked_by == vec!["nvlink".to_string()]));

    // nvidia-smi missing: NVLink unverified, a warning only.
    h.smi = ToolOutput::Unavailable("`nvidia-smi` is not on PATH".into());
    let r = h.run();
    assert_eq!(status(&r, "nvlink"), Status::Warn);
    assert_eq!(
        found(&r, "nvlink"),
        "NVLink not verified: `nvidia-smi` is not on PATH"
    );
    assert_eq!(r.exit_code, 0);

    // One GPU: intranode and low-latency need two.
    h.remove("/proc/driver/nvidia/gpus/0000:2a:00.0");
    let r = h.run();
    assert_eq!(
        verdicts(&r),
        expect_verdicts(&["gpus"], &["gpus"], &[], &[])
    );
}

#[test]
fn cuda_library_missing_or_from_another_driver() {
    let h = TestHost::ibgda();
    let r = h.run();
    assert_eq!(
        found(&r, "cuda-library"),
        "/usr/lib64/libcuda.so.1 (driver 580.159.04)"
    );
    // Driver packages upgraded, kernel module not reloaded yet.
    h.remove("/usr/lib64/libcuda.so.1");
    std::fs::rename(
        h.path("/usr/lib64/libcuda.so.580.159.04"),
        h.path("/usr/lib64/libcuda.so.580.200.01"),
    )
    .unwrap();
    std::os::unix::fs::symlink("libcuda.so.580.200.01", h.path("/usr/lib64/libcuda.so.1")).unwrap();
    let r = h.run();
    assert_eq!(
        found(&r, "cuda-library"),
        "/usr/lib64/libcuda.so.1 is user-space driver 580.200.01, the loaded kernel module is \
         580.159.04: CUDA fails with a driver/library version mismatch"
    );
    assert!(r
        .verdicts
        .iter()
        .all(|v| v.blocked_by == vec!["cuda-library".to_string()]));
    // The same library as CUDA's forward-compatibility package: a warning, not a failure.
    let compat = "/usr/local/cuda-13.0/compat";
    std::fs::create_dir_all(h.path(compat)).unwrap();
    std::fs::copy(
        h.path("/usr/lib64/libcuda.so.580.200.01"),
        h.path(&format!("{compat}/libcuda.so.580.200.01")),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        "libcuda.so.580.200.01",
        h.path(&format!("{compat}/libcuda.so.1")),
    )
    .unwrap();
    let h = h.env("LD_LIBRARY_PATH", &format!("{compat}:/opt/nvshmem/lib"));
    let r = h.run();
    assert_eq!(
        status(&r, "cuda-library"),
        Status::Warn,
        "{}",
        r.render_text()
    );
    assert_eq!(r.exit_code, 0);
    h.remove(&format!("{compat}/libcuda.so.1"));
    // No libcuda at all.
    h.remove("/usr/lib64/libcuda.so.1");
    let r = h.run();
    assert!(found(&r, "cuda-library").starts_with("libcuda.so.1 is not on the loader path"));
    assert_eq!(r.exit_code, 1);
}

#[test]
fn driver_not_loaded_blocks_everything() {
    let h = TestHost::ibgda();
    h.remove("/proc/driver/nvidia");
    // No NVIDIA device at all (no driver, nothing on the PCI bus): said once, in `driver`, with
    // no modprobe advice; every GPU check is still in the report, skipped with the reason, and
    // gdrcopy's fix is not printed.
    let r = h.run();
    assert_found_and_fix(
        &r,
        "driver",
        "no NVIDIA GPU on this host: none on the PCI bus (/sys/bus/pci/devices) and no NVIDIA driver loaded \
         (/proc/driver/nvidia/version does not exist); the checks that need a GPU are skipped",
        "run deepep-nix doctor on the GPU hosts that will run DeepEP (in a container, pass the GPUs through, e.g. --gpus all)",
    );
    assert!(r.verdicts.iter().all(|v| !v.ready));
    let text = r.render_text();
    let json = serde_json::to_string(&r).unwrap();
    for id in ["gpus", "device-nodes", "cuda-library", "nvlink", "gdrcopy"] {
        assert_eq!(status(&r, id), Status::Skip, "{id}");
        assert_eq!(found(&r, id), "no NVIDIA GPU on this host", "{id}");
        assert!(text.contains(id), "{id} missing from the table:\n{text}");
        assert!(
            json.contains(&format!("\"{id}\"")),
            "{id} missing from the JSON"
        );
    }
    assert_eq!(status(&r, "params.stream-memops"), Status::Skip);
    assert!(
        !text.contains("modprobe nvidia") && !text.contains("gdrdrv"),
        "{text}"
    );
    assert_eq!(
        text.matches("no NVIDIA GPU on this host:").count(),
        1,
        "{text}"
    );

    // The GPUs are on the PCI bus but bound to another driver: say so.
    h.write("/sys/bus/pci/devices/0000:18:00.0/vendor", "0x10de\n");
    h.write("/sys/bus/pci/devices/0000:18:00.0/class", "0x030200\n");
    std::os::unix::fs::symlink(
        "../../../bus/pci/drivers/vfio-pci",
        h.path("/sys/bus/pci/devices/0000:18:00.0/driver"),
    )
    .unwrap();
    h.write("/sys/bus/pci/devices/0000:00:01.0/vendor", "0x8086\n");
    h.write("/sys/bus/pci/devices/0000:00:01.0/class", "0x060400\n");
    let r = h.run();
    assert_eq!(
        found(&r, "driver"),
        "NVIDIA driver not loaded (/proc/driver/nvidia/version does not exist); \
         /sys/bus/pci/devices lists 1 NVIDIA GPU(s): 0000:18:00.0 bound to vfio-pci"
    );
    assert_eq!(found(&r, "gpus"), "driver not loaded");
    assert_eq!(status(&r, "cuda-library"), Status::Skip);
}

#[test]
fn knobs_are_validated_like_nvshmem_parses_them() {
    let mut h = TestHost::ibgda()
        .env("NVSHMEM_CUMEM_GRANULARITY", "128M")
        .env("NVSHMEM_QP_DEPTH", "256")
        .env("NVSHMEM_DISABLE_P2P", "yes")
        .env("NVSHMEM_IB_ENABLE_IBGDA", "false")
        .env("NVSHMEM_IBGDA_NIC_HANDLER", "gpu")
        .env("NVSHMEM_HCA_LIST", "mlx5_0:1,mlx5_9:1")
        .env("NVSHMEM_SYMMETRIC_SIZE", "4X")
        .env("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "enp1s0");
    h.args.max_tokens = Some(128);
    let r = h.run();
    let text = r.render_text();
    // (check, exact `found`, exact `fix` where the test pins one)
    let cases = [
        (
            "knob.NVSHMEM_CUMEM_GRANULARITY",
            "128M = 128 MiB < 256 MiB",
            Some("export NVSHMEM_CUMEM_GRANULARITY=536870912 (512 MiB, DeepEP's value; at least 256 MiB)"),
        ),
        (
            "knob.NVSHMEM_QP_DEPTH",
            "256 (exported) < 2*(max tokens 128 + 1) = 258: low-latency calls run out of work requests",
            Some("export NVSHMEM_QP_DEPTH=512"),
        ),
        (
            "knob.NVSHMEM_SYMMETRIC_SIZE",
            "\"4X\" is not a non-zero size such as 4G",
            None,
        ),
        (
            "knob.NVSHMEM_HCA_LIST",
            "names devices that do not exist: mlx5_9 (present: mlx5_0)",
            None,
        ),
    ];
    for (id, want_found, want_fix) in cases {
        assert_eq!(found(&r, id), want_found, "{id}");
        if let Some(want_fix) = want_fix {
            assert_eq!(fix(&r, id), want_fix, "{id}");
        }
    }
    assert!(found(&r, "knob.NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")
        .contains("matches no network interface in /sys/class/net (ib0 lo)"));
    let nv = [
        "knob.NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
        "knob.NVSHMEM_CUMEM_GRANULARITY",
        "knob.NVSHMEM_QP_DEPTH",
        "knob.NVSHMEM_SYMMETRIC_SIZE",
    ];
    let ll: Vec<&str> = vec![nv[0], nv[1], "knob.NVSHMEM_DISABLE_P2P", nv[2], nv[3]];
    assert_eq!(verdicts(&r)[0], v(Intranode, true, &[]), "{text}");
    assert_eq!(verdicts(&r)[1], v(LowLatency, false, &ll), "{text}");
    let mut gpu: Vec<&str> = vec![
        nv[0],
        nv[1],
        "knob.NVSHMEM_HCA_LIST",
        "knob.NVSHMEM_IB_ENABLE_IBGDA",
        nv[2],
        nv[3],
    ];
    assert_eq!(verdicts(&r)[2], v(InternodeIbgda, false, &gpu), "{text}");
    gpu.insert(3, "knob.NVSHMEM_IBGDA_NIC_HANDLER");
    assert_eq!(verdicts(&r)[3], v(InternodeCpuIbgda, false, &gpu), "{text}");

    // Without --max-tokens the QP depth is only reported.
    h.args.max_tokens = None;
    let r = h.run();
    assert_eq!(status(&r, "knob.NVSHMEM_QP_DEPTH"), Status::Skip);
}

#[test]
fn unknown_nvshmem_variables_are_flagged_as_typos() {
    // The fixture host library names DEBUG_FILE and QP_DEPTH, as NVSHMEM stores its variables.
    let r = TestHost::ibgda()
        .env("NVSHMEM_QP_DEPHT", "2048")
        .env("NVSHMEM_DEBUG_FILE", "/tmp/nvshmem.%h.log")
        .run();
    assert_eq!(status(&r, "knob.NVSHMEM_QP_DEPHT"), Status::Warn);
    assert_found_and_fix(
        &r,
        "knob.NVSHMEM_QP_DEPHT",
        "not read by NVSHMEM 3.4.5: neither libnvshmem_host.so.3 nor its plugins mention it",
        "did you mean NVSHMEM_QP_DEPTH? Rename it, or unset NVSHMEM_QP_DEPHT",
    );
    assert!(
        r.check("knob.NVSHMEM_DEBUG_FILE").is_none(),
        "a variable NVSHMEM reads is not flagged"
    );
    assert!(
        r.check("knob.NVSHMEM_DIR").is_none(),
        "NVSHMEM_DIR is for build tools"
    );
    assert_eq!(r.exit_code, 0, "a warning does not block");
}

#[test]
fn kernels_version_from_environment() {
    let mut h = TestHost::ibgda();
    h.args.kernels_nvshmem_version = None;
    let r = h.run();
    assert_eq!(status(&r, "nvshmem.kernels"), Status::Skip);
    let h = h.env("DEEPEP_KERNELS_NVSHMEM_VERSION", "3.6.5");
    let r = h.run();
    assert!(found(&r, "nvshmem.kernels").starts_with("kernels built against NVSHMEM 3.6.5 (DEEPEP_KERNELS_NVSHMEM_VERSION), host library is 3.4.5"));
    let r = h.env("DEEPEP_KERNELS_NVSHMEM_VERSION", "three").run();
    assert_eq!(
        found(&r, "nvshmem.kernels"),
        "DEEPEP_KERNELS_NVSHMEM_VERSION=\"three\" is not a version X.Y.Z"
    );
}

#[test]
fn json_report_round_trips() {
    let r = TestHost::gpu_machine().run();
    let json: serde_json::Value = serde_json::to_value(&r).unwrap();
    assert_eq!(json["exit_code"], 1);
    let verdicts = json["verdicts"].as_array().unwrap();
    assert_eq!(verdicts[0]["capability"], "intranode");
    assert_eq!(verdicts[0]["ready"], true);
    assert_eq!(verdicts[3]["capability"], "internode-cpu-ibgda");
    assert_eq!(verdicts[3]["blocked_by"], serde_json::json!(["infiniband"]));
    let stream = json_check(&json, "params.stream-memops");
    assert_eq!(stream["status"], "fail");
    assert_eq!(stream["needed_by"], serde_json::json!(["internode-ibgda"]));
    assert!(stream["fix"]
        .as_str()
        .unwrap()
        .contains("NVreg_EnableStreamMemOPs=1"));
}

// ---------------------------------------------------------------------------------------------
// The binary.

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_deepep-nix"))
}

/// `deepep-nix doctor --root ROOT --json` with one `--python-site` per site, in an environment
/// holding only the NVSHMEM prefix `/opt/nvshmem` (NVSHMEM_DIR and LD_LIBRARY_PATH): its exit
/// code and JSON report.
fn doctor_json_with_nvshmem(root: &str, sites: &[&str]) -> (Option<i32>, serde_json::Value) {
    let mut cmd = bin();
    cmd.args(["doctor", "--root", root, "--json"]);
    for s in sites {
        cmd.args(["--python-site", s]);
    }
    let out = cmd
        .env_clear()
        .env("NVSHMEM_DIR", "/opt/nvshmem")
        .env("LD_LIBRARY_PATH", "/opt/nvshmem/lib")
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code(), json)
}

#[test]
fn binary_exit_codes_and_usage_errors() {
    let h = TestHost::gpu_machine();
    let root = h.root.path().to_str().unwrap().to_string();
    let lib = h.env["LD_LIBRARY_PATH"].clone();
    let out = bin()
        .args([
            "doctor",
            "--root",
            &root,
            "--json",
            "--kernels-nvshmem-version",
            "3.4.5",
        ])
        .env_clear()
        .env("LD_LIBRARY_PATH", &lib)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["root"], root);
    // nvidia-smi is not run for another root: NVLink unverified.
    let nvlink = json_check(&json, "nvlink");
    assert_eq!(
        nvlink["found"],
        "NVLink not verified: not run: --root describes another host"
    );

    let out = bin()
        .args([
            "doctor",
            "--root",
            &root,
            "--capability",
            "intranode",
            "--capability",
            "low-latency",
        ])
        .env_clear()
        .env("LD_LIBRARY_PATH", &lib)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("low-latency          ready"), "{text}");
    assert!(text.contains("internode-ibgda      NOT READY"), "{text}");

    for bad in [
        vec!["doctor", "--capability", "everything"],
        vec!["doctor", "--root", "/does/not/exist"],
        vec!["doctor", "--kernels-nvshmem-version", "3.4"],
        vec!["doctor", "--max-tokens", "0"],
    ] {
        let out = bin().args(&bad).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(!out.stderr.is_empty());
    }
    let out = bin()
        .args(["doctor", "--root", "/does/not/exist"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--root must name an existing directory"));
}

// ---------------------------------------------------------------------------------------------
// DeepEP (`--python-site`), locked memory and container devices.
//
// The DeepEP extension is a real ELF shared object built here with the C compiler, shaped like
// the `deep_ep_cpp*.so` DeepEP v1.2.1's setup.py links (`-l:libnvshmem_host.so
// -l:libnvshmem_device.a -Wl,-rpath,$NVSHMEM_DIR/lib`): DT_NEEDED libnvshmem_host.so.3, a
// RUNPATH, the device library's local version symbol, and a `.nv_fatbin` section. The one mock
// is that section's content: fat-binary headers (magic, entry kind, arch; common/fatbin.rs) without
// real GPU code, because a C compiler cannot emit CUDA images. `tests/deepep_build.rs` checks
// the same reader against a real nvcc build linked against the real NVSHMEM wheel.

const SITE: &str = "/opt/venv/lib/python3.12/site-packages";
const EXT: &str = "deep_ep_cpp.cpython-312-x86_64-linux-gnu.so";

impl TestHost {
    /// Puts a DeepEP build into the site directory: the extension (device library `device`
    /// recorded, linked against `link_prefix`'s host library, RUNPATH `runpath`, GPU code
    /// `images`) and, when `version` is given, `deep_ep-<version>.dist-info/METADATA`.
    fn install_deepep(
        &self,
        version: Option<&str>,
        device: Option<&str>,
        link_prefix: &str,
        runpath: &str,
        images: &[(u16, u32)],
    ) {
        let site = self.path(SITE);
        std::fs::create_dir_all(&site).unwrap();
        let mut src = String::from("int deep_ep_cpp_stub;\n");
        if let Some(d) = device {
            let p: Vec<&str> = d.split('.').collect();
            src.push_str(&format!(
                "__attribute__((used)) static const int v[3] __asm__(\"_ZL27nvshmemi_device_lib_version\") = {{{}, {}, {}}};\n",
                p[0], p[1], p[2]
            ));
        }
        if !images.is_empty() {
            let bytes: Vec<String> = fatbin(images).iter().map(|b| b.to_string()).collect();
            src.push_str(&format!(
                "__attribute__((used, section(\".nv_fatbin\"), aligned(8))) static const unsigned char fatbin[] = {{{}}};\n",
                bytes.join(",")
            ));
        }
        let mut needed = vec![artifacts().stub("libc.so.6")];
        if device.is_some() {
            needed.insert(0, self.path(link_prefix).join("lib/libnvshmem_host.so.3"));
        }
        shared_with_path(
            &site.join(EXT),
            EXT,
            &src,
            &needed,
            "-Wl,--enable-new-dtags",
            runpath,
        );
        if let Some(v) = version {
            self.write(
                &format!("{SITE}/deep_ep-{v}.dist-info/METADATA"),
                format!("Metadata-Version: 2.1\nName: deep_ep\nVersion: {v}\n"),
            );
        }
    }

    /// torch with its own NVSHMEM: `torch/lib/libtorch_nvshmem.so` (RPATH
    /// `$ORIGIN/../../nvidia/nvshmem/lib`, as torch's wheels) and the nvidia-nvshmem wheel tree
    /// of version `v` (`None`: the wheel alone, without libtorch_nvshmem).
    fn install_torch(&self, v: &str, with_torch_lib: bool) {
        self.install_torch_in(SITE, v, with_torch_lib);
    }

    /// [`Self::install_torch`] into site directory `site`, with the `torch/__init__.py` every
    /// torch install has.
    fn install_torch_in(&self, site: &str, v: &str, with_torch_lib: bool) {
        self.write(&format!("{site}/torch/__init__.py"), "");
        let wheel = format!("{site}/nvidia/nvshmem");
        self.install_nvshmem(&wheel, v, v, 3);
        if with_torch_lib {
            let lib = self.path(&format!("{site}/torch/lib"));
            std::fs::create_dir_all(&lib).unwrap();
            shared_with_path(
                &lib.join("libtorch_nvshmem.so"),
                "libtorch_nvshmem.so",
                "int torch_nvshmem;\n",
                &[
                    self.path(&format!("{wheel}/lib/libnvshmem_host.so.3")),
                    artifacts().stub("libc.so.6"),
                ],
                "-Wl,--disable-new-dtags",
                "$ORIGIN/../../nvidia/nvshmem/lib",
            );
        }
    }

    fn with_site(mut self) -> Self {
        self.args.python_site = vec![SITE.into()];
        self
    }
}

fn deepep_statuses(r: &Report) -> Vec<(String, Status)> {
    statuses(r)
        .into_iter()
        .filter(|(id, _)| id.starts_with("deepep."))
        .collect()
}

fn ids(list: &[(&str, Status)]) -> Vec<(String, Status)> {
    list.iter().map(|(i, s)| (i.to_string(), *s)).collect()
}

#[test]
fn deepep_built_against_the_loaded_nvshmem_is_ready() {
    let h = TestHost::ibgda().with_site();
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    // torch without NVSHMEM of its own (no libtorch_nvshmem.so, no nvidia-nvshmem wheel).
    h.write(&format!("{SITE}/torch/__init__.py"), "");
    let r = h.run();
    let text = r.render_text();
    use Status::Ok as O;
    assert_eq!(
        deepep_statuses(&r),
        ids(&[
            ("deepep.extension", O),
            ("deepep.nvshmem", O),
            ("deepep.torch-nvshmem", O),
            ("deepep.pairing", O),
            ("deepep.host-limits", O),
            ("deepep.ibgda-plugin", O),
            ("deepep.arch", O),
        ]),
        "{text}"
    );
    assert_eq!(verdicts(&r), all_ready(), "{text}");
    assert_eq!(
        found(&r, "deepep.extension"),
        format!(
            "{SITE}/{EXT}: DeepEP 1.2.1 ({SITE}/deep_ep-1.2.1.dist-info/METADATA); NVSHMEM 3.4.5 \
             device library linked in, needs libnvshmem_host.so.3; RUNPATH /opt/nvshmem/lib; GPU code sm_90"
        )
    );
    assert_eq!(
        found(&r, "deepep.nvshmem"),
        "loads NVSHMEM 3.4.5 (/opt/nvshmem/lib/libnvshmem_host.so.3) = the device library it was built with"
    );
    assert_eq!(
        found(&r, "deepep.pairing"),
        "DeepEP 1.2.1 with NVSHMEM 3.4.5 (linked device library): not a known-broken pairing"
    );
    assert_eq!(
        found(&r, "deepep.arch"),
        "GPU 0 NVIDIA H200 (compute capability 9.0), GPU 1 NVIDIA H200 (compute capability 9.0) \
         run sm_90 (deep_ep_cpp's .nv_fatbin)"
    );
    assert_eq!(
        found(&r, "deepep.ibgda-plugin"),
        "/opt/nvshmem/lib/nvshmem_transport_ibgda.so.3"
    );
    assert_eq!(
        found(&r, "deepep.torch-nvshmem"),
        format!(
            "torch at {SITE}/torch bundles no NVSHMEM (no lib/libtorch_nvshmem.so; \
             no nvidia/nvshmem/lib/libnvshmem_host.so.3 in {SITE})"
        )
    );
    // Without --python-site the report is what it was.
    let mut h = h;
    h.args.python_site = vec![];
    assert!(h.run().checks.iter().all(|c| !c.id.starts_with("deepep.")));
}

#[test]
fn deepep_would_load_another_nvshmem_than_it_was_built_with() {
    // Built against NVSHMEM 3.8.0 (RUNPATH gone: e.g. the build tree was deleted), the loader
    // finds 3.4.5 on LD_LIBRARY_PATH.
    let h = TestHost::ibgda().with_site();
    h.install_nvshmem("/opt/nvshmem-3.8.0", "3.8.0", "3.8.0", 7);
    h.install_deepep(
        Some("1.2.1"),
        Some("3.8.0"),
        "/opt/nvshmem-3.8.0",
        "/build/gone/lib",
        &[(2, 90)],
    );
    h.remove("/opt/nvshmem-3.8.0");
    let r = h.run();
    assert_found_and_fix(
        &r,
        "deepep.nvshmem",
        "built with the NVSHMEM 3.8.0 device library, but would load host library 3.4.5 \
         (/opt/nvshmem/lib/libnvshmem_host.so.3): NVSHMEM init aborts with \"device library version does not match\"",
        "put NVSHMEM 3.8.0 first (eval \"$(deepep-nix env --prefix <NVSHMEM 3.8.0 prefix>)\"), or rebuild DeepEP \
         against /opt/nvshmem: build DeepEP against one NVSHMEM (docs/deepep.md): eval \"$(deepep-nix env --prefix <prefix>)\" \
         && CPATH=\"$CUDA_HOME/include/cccl\" pip install --no-build-isolation . (in the DeepEP checkout)",
    );
    // 3.8.0 is also past the RC layout change for DeepEP 1.2.1.
    let both = ["deepep.nvshmem", "deepep.pairing"];
    assert_eq!(verdicts(&r), expect_verdicts(&[], &both, &both, &both));
    // Nothing at all to load: the loader path has no NVSHMEM either.
    let h = h
        .env("LD_LIBRARY_PATH", "")
        .env("NVSHMEM_DIR", "/opt/nvshmem");
    h.remove("/opt/nvshmem/lib/libnvshmem_host.so.3");
    let r = h.run();
    assert!(found(&r, "deepep.nvshmem").starts_with(&format!(
        "libnvshmem_host.so.3 not found for {SITE}/{EXT} (RUNPATH /build/gone/lib, LD_LIBRARY_PATH, system directories)"
    )));
    assert_eq!(status(&r, "deepep.ibgda-plugin"), Status::Skip);
}

#[test]
fn deepep_built_without_nvshmem_is_intranode_only() {
    let h = TestHost::ibgda().with_site();
    h.install_deepep(Some("1.2.1"), None, "", "/nowhere", &[(2, 90)]);
    let r = h.run();
    assert!(found(&r, "deepep.extension")
        .contains("built without NVSHMEM (DISABLE_NVSHMEM: intranode only)"));
    assert_eq!(status(&r, "deepep.nvshmem"), Status::Fail);
    assert_eq!(status(&r, "deepep.pairing"), Status::Skip);
    assert_eq!(
        verdicts(&r),
        expect_verdicts(
            &[],
            &["deepep.nvshmem"],
            &["deepep.nvshmem"],
            &["deepep.nvshmem"]
        )
    );
}

#[test]
fn torch_bundled_nvshmem_differs_from_deepeps() {
    let h = TestHost::ibgda().with_site();
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    h.install_torch("3.8.0", true);
    let r = h.run();
    let torch_lib = format!("{SITE}/torch/lib/libtorch_nvshmem.so");
    assert_eq!(
        found(&r, "deepep.torch-nvshmem"),
        format!(
            "{torch_lib} loads NVSHMEM 3.8.0 ({SITE}/torch/lib/../../nvidia/nvshmem/lib/libnvshmem_host.so.3); \
             DeepEP's build is NVSHMEM 3.4.5: once torch has loaded its copy, deep_ep_cpp's libnvshmem_host.so.3 \
             is that copy (same SONAME)"
        )
    );
    assert!(fix(&r, "deepep.torch-nvshmem").starts_with(&format!(
        "use one NVSHMEM: build DeepEP against torch's copy (unset NVSHMEM_DIR, or NVSHMEM_DIR={SITE}/nvidia/nvshmem;"
    )));
    let both = ["deepep.torch-nvshmem", "deepep.pairing"];
    assert_eq!(verdicts(&r), expect_verdicts(&[], &both, &both, &both));
    // The newest NVSHMEM in play decides the pairing: torch's 3.8.0 with DeepEP 1.2.1.
    assert_eq!(status(&r, "deepep.pairing"), Status::Fail);
    assert!(found(&r, "deepep.pairing")
        .starts_with("DeepEP 1.2.1 with NVSHMEM 3.8.0 (torch's host library)"));

    // Same version as DeepEP's build: fine.
    let h2 = TestHost::ibgda().with_site();
    h2.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    h2.install_torch("3.4.5", true);
    let r = h2.run();
    assert_eq!(
        found(&r, "deepep.torch-nvshmem"),
        format!(
            "torch loads NVSHMEM 3.4.5 ({SITE}/torch/lib/../../nvidia/nvshmem/lib/libnvshmem_host.so.3) = DeepEP's build 3.4.5"
        )
    );

    // The wheel alone (no libtorch_nvshmem.so) is only loaded if something puts it first.
    h.remove(&torch_lib);
    let r = h.run();
    assert_eq!(status(&r, "deepep.torch-nvshmem"), Status::Warn);
    assert_eq!(
        found(&r, "deepep.torch-nvshmem"),
        format!(
            "torch at {SITE}/torch has no lib/libtorch_nvshmem.so; the nvidia-nvshmem wheel holds NVSHMEM 3.8.0 \
             ({SITE}/nvidia/nvshmem/lib/libnvshmem_host.so.3); DeepEP's build is NVSHMEM 3.4.5: harmless unless \
             that directory comes first on LD_LIBRARY_PATH"
        )
    );

    // No DeepEP extension: torch's NVSHMEM is compared with NVSHMEM_DIR's.
    h.remove(&format!("{SITE}/{EXT}"));
    h2.remove(&format!("{SITE}/{EXT}"));
    h2.install_torch("3.8.0", true);
    let r = h2.run();
    assert_eq!(status(&r, "deepep.extension"), Status::Fail);
    assert!(
        found(&r, "deepep.torch-nvshmem")
            .contains("the NVSHMEM checked above (NVSHMEM_DIR) is NVSHMEM 3.4.5"),
        "{}",
        r.render_text()
    );
    assert_eq!(status(&r, "deepep.torch-nvshmem"), Status::Fail);
}

#[test]
fn deepep_1_2_1_with_nvshmem_3_5_19_or_newer_is_refused() {
    let h = TestHost::ibgda().with_site();
    h.install_nvshmem("/opt/nvshmem-3.6.5", "3.6.5", "3.6.5", 3);
    h.install_deepep(
        Some("1.2.1"),
        Some("3.6.5"),
        "/opt/nvshmem-3.6.5",
        "/opt/nvshmem-3.6.5/lib",
        &[(2, 90)],
    );
    // LD_LIBRARY_PATH is searched before a RUNPATH: with /opt/nvshmem/lib on it, the build
    // would get 3.4.5.
    let r = h.run();
    assert!(found(&r, "deepep.nvshmem").starts_with(
        "built with the NVSHMEM 3.6.5 device library, but would load host library 3.4.5"
    ));
    let h = h.env("LD_LIBRARY_PATH", "");
    let r = h.run();
    assert_found_and_fix(
        &r,
        "deepep.pairing",
        "DeepEP 1.2.1 with NVSHMEM 3.6.5 (linked device library): DeepEP <= 1.2.1 indexes IBGDA RC queue pairs \
         in the layout of NVSHMEM < 3.5.19; from 3.5.19 on, internode and low-latency time out or hit illegal \
         memory accesses (DeepEP #553, #764, PR #564, #696; vLLM PR #58159)",
        "pin NVSHMEM <= 3.4.5 (deepep-nix install --version 3.4.5 ...) and rebuild DeepEP against it, or build a \
         DeepEP that has the fix (PR #564, commit 29d31c0 on the v1 line, or PR #696)",
    );
    assert!(found(&r, "deepep.nvshmem").ends_with(
        "= the device library it was built with; the NVSHMEM checked above is 3.4.5 (/opt/nvshmem/lib)"
    ), "{}", found(&r, "deepep.nvshmem"));
    assert_eq!(
        verdicts(&r),
        expect_verdicts(
            &[],
            &["deepep.pairing"],
            &["deepep.pairing"],
            &["deepep.pairing"]
        )
    );
    // 1.2.1+<revision>: builds of the v1 branch after the fix say 1.2.1 too.
    h.remove(&format!("{SITE}/deep_ep-1.2.1.dist-info"));
    h.write(
        &format!("{SITE}/deep_ep-1.2.1+309785a.dist-info/METADATA"),
        "Name: deep_ep\nVersion: 1.2.1+309785a\n",
    );
    let r = h.run();
    assert_eq!(status(&r, "deepep.pairing"), Status::Warn);
    assert!(fix(&r, "deepep.pairing")
        .starts_with("check in the DeepEP checkout: git merge-base --is-ancestor 29d31c0 309785a"));
    // An egg install (python setup.py install) carries the version in EGG-INFO/PKG-INFO.
    h.remove(&format!("{SITE}/deep_ep-1.2.1+309785a.dist-info"));
    let egg = format!("{SITE}/deep_ep-1.1.0-py3.12-linux-x86_64.egg");
    h.write(&format!("{egg}/EGG-INFO/PKG-INFO"), "Version: 1.1.0\n");
    std::fs::rename(
        h.path(&format!("{SITE}/{EXT}")),
        h.path(&format!("{egg}/{EXT}")),
    )
    .unwrap();
    let r = h.run();
    assert!(found(&r, "deepep.extension").starts_with(&format!("{egg}/{EXT}: DeepEP 1.1.0")));
    assert_eq!(status(&r, "deepep.pairing"), Status::Fail);
    // No metadata: unknown, not guessed.
    h.remove(&format!("{egg}/EGG-INFO"));
    let r = h.run();
    assert_eq!(status(&r, "deepep.pairing"), Status::Skip);
}

/// The doctor applies every known-broken rule of `pkgs/deep-ep/pairings.json`, the file the Nix
/// package's refusal reads (checks/deep-ep-pure.nix asserts that side): read here from the
/// checkout, each rule is tried at its NVSHMEM bound (refused with the rule's doctor texts)
/// and just outside it (accepted), on a real fixture tree.
#[test]
fn deepep_pairing_check_applies_every_rule_of_pairings_json() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../pkgs/deep-ep/pairings.json");
    let data: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rules = data["broken"].as_array().unwrap();
    assert!(!rules.is_empty());
    let step = |v: &str, up: bool| {
        let mut p: Vec<u32> = v.split('.').map(|x| x.parse().unwrap()).collect();
        p[2] = if up { p[2] + 1 } else { p[2] - 1 };
        format!("{}.{}.{}", p[0], p[1], p[2])
    };
    for rule in rules {
        let id = rule["id"].as_str().unwrap();
        let deepep = rule["deepep"]["atMost"]
            .as_str()
            .or(rule["deepep"]["atLeast"].as_str())
            .unwrap();
        let (inside, outside) = match rule["nvshmem"]["atLeast"].as_str() {
            Some(lo) => (lo.to_string(), step(lo, false)),
            None => {
                let hi = rule["nvshmem"]["atMost"].as_str().unwrap();
                (hi.to_string(), step(hi, true))
            }
        };
        for nv in [inside, outside] {
            let h = TestHost::ibgda().with_site();
            let prefix = format!("/opt/nvshmem-{nv}");
            h.install_nvshmem(&prefix, &nv, &nv, 3);
            h.install_deepep(
                Some(deepep),
                Some(&nv),
                &prefix,
                &format!("{prefix}/lib"),
                &[(2, 90)],
            );
            let r = h.env("LD_LIBRARY_PATH", "").run();
            let what = format!("DeepEP {deepep} with NVSHMEM {nv} (linked device library): ");
            // Rules may overlap (3.5.19 is in two): the check names one of those that cover.
            let covering: Vec<&serde_json::Value> = rules
                .iter()
                .filter(|r| covers(&r["deepep"], deepep) && covers(&r["nvshmem"], &nv))
                .collect();
            if covering.is_empty() {
                assert_eq!(
                    found(&r, "deepep.pairing"),
                    format!("{what}not a known-broken pairing"),
                    "{id}"
                );
            } else {
                assert_eq!(status(&r, "deepep.pairing"), Status::Fail, "{id} at {nv}");
                assert!(
                    covering.iter().any(|c| found(&r, "deepep.pairing")
                        == format!("{what}{}", c["doctor"]["found"].as_str().unwrap())
                        && fix(&r, "deepep.pairing") == c["doctor"]["fix"].as_str().unwrap()),
                    "{id} at {nv}: {}",
                    found(&r, "deepep.pairing")
                );
            }
        }
    }
}

/// Whether the pairings.json range `range` (`atLeast` / `atMost`, inclusive) holds version `v`.
fn covers(range: &serde_json::Value, v: &str) -> bool {
    let key = |x: &str| -> Vec<u32> { x.split('.').map(|p| p.parse().unwrap()).collect() };
    range["atLeast"]
        .as_str()
        .map_or(true, |lo| key(v) >= key(lo))
        && range["atMost"]
            .as_str()
            .map_or(true, |hi| key(v) <= key(hi))
}

#[test]
fn deepep_nvshmem_without_the_ibgda_plugin() {
    let h = TestHost::ibgda().with_site();
    h.install_nvshmem("/opt/nvshmem-noibgda", "3.4.5", "3.4.5", 3);
    h.remove("/opt/nvshmem-noibgda/lib/nvshmem_transport_ibgda.so.3");
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem-noibgda",
        "/opt/nvshmem-noibgda/lib",
        &[(2, 90)],
    );
    let r = h.env("LD_LIBRARY_PATH", "").run();
    assert_found_and_fix(
        &r,
        "deepep.ibgda-plugin",
        "no nvshmem_transport_ibgda.so.* in /opt/nvshmem-noibgda/lib next to the host library DeepEP loads: \
         that NVSHMEM was built without IBGDA",
        "use an NVSHMEM with IBGDA (NVIDIA's tarball and the nvidia-nvshmem wheels ship it: deepep-nix install), \
         or rebuild NVSHMEM from source with NVSHMEM_IBGDA_SUPPORT=1; then rebuild DeepEP against it",
    );
    assert_eq!(
        verdicts(&r),
        expect_verdicts(&[], &[], &["deepep.ibgda-plugin"], &["deepep.ibgda-plugin"])
    );
}

#[test]
fn gpu_compute_capability_vs_the_builds_architectures() {
    let h = TestHost::ibgda().with_site();
    for bus in ["0000:18:00.0", "0000:2a:00.0"] {
        let p = format!("/proc/driver/nvidia/gpus/{bus}/information");
        let text = std::fs::read_to_string(h.path(&p)).unwrap();
        h.write(&p, text.replace("NVIDIA H200", "NVIDIA B200"));
    }
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    let r = h.run();
    assert_found_and_fix(
        &r,
        "deepep.arch",
        "GPU 0 NVIDIA B200 (compute capability 10.0), GPU 1 NVIDIA B200 (compute capability 10.0) cannot run \
         the build's GPU code sm_90 (deep_ep_cpp's .nv_fatbin)",
        "rebuild DeepEP for these GPUs: TORCH_CUDA_ARCH_LIST=\"10.0\" pip install --no-build-isolation . \
         (DeepEP's setup.py defaults to 9.0)",
    );
    assert!(r
        .verdicts
        .iter()
        .all(|v| v.blocked_by == vec!["deepep.arch".to_string()]));
    // PTX of an older architecture is compiled by the driver for newer GPUs.
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90), (1, 90)],
    );
    let r = h.run();
    assert_eq!(
        status(&r, "deepep.arch"),
        Status::Ok,
        "{}",
        found(&r, "deepep.arch")
    );
    // No GPU code in the extension: TORCH_CUDA_ARCH_LIST of the build environment is used.
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[],
    );
    let r = h.run();
    assert_eq!(status(&r, "deepep.arch"), Status::Skip);
    let r = h.env("TORCH_CUDA_ARCH_LIST", "9.0;10.0").run();
    assert_eq!(
        found(&r, "deepep.arch"),
        "GPU 0 NVIDIA B200 (compute capability 10.0), GPU 1 NVIDIA B200 (compute capability 10.0) run \
         sm_90 sm_100 (TORCH_CUDA_ARCH_LIST=9.0;10.0 (the extension has no readable GPU code))"
    );
}

#[test]
fn locked_memory_limit_and_container_devices() {
    let limits = |soft: &str| {
        format!(
            "Limit                     Soft Limit           Hard Limit           Units     \n\
             Max locked memory         {soft:<20} unlimited            bytes     \n"
        )
    };
    let h = TestHost::ibgda();
    // No /proc/self/limits in the tree and no container marker: neither check is added.
    let r = h.run();
    assert!(r.check("memlock").is_none() && r.check("container.devices").is_none());

    h.write("/proc/self/limits", limits("unlimited"));
    let r = h.run();
    assert_eq!(
        found(&r, "memlock"),
        "locked-memory limit (ulimit -l): soft unlimited, hard unlimited (/proc/self/limits)"
    );
    assert_eq!(status(&r, "memlock"), Status::Ok);

    h.write("/proc/self/limits", limits("32768"));
    let r = h.run();
    assert_found_and_fix(
        &r,
        "memlock",
        "locked-memory limit (ulimit -l): soft 32 KiB, hard unlimited (/proc/self/limits): InfiniBand memory \
         registrations pin pages against this limit; libibverbs warns that a limit of 32 KiB or less \
         \"will severely limit memory registrations\"",
        "add `* - memlock unlimited` to /etc/security/limits.d/memlock.conf and log in again; for a systemd \
         service set LimitMEMLOCK=infinity",
    );
    assert_eq!(
        verdicts(&r),
        expect_verdicts(&[], &[], &["memlock"], &["memlock"])
    );
    h.write("/etc/NIXOS", "");
    assert!(fix(&h.run(), "memlock").starts_with("security.pam.loginLimits = [ {"));
    h.remove("/etc/NIXOS");
    // A process with CAP_IPC_LOCK is not bound by the limit.
    h.write(
        "/proc/self/status",
        "Name:\tdeepep-nix\nCapEff:\t0000000000004000\n",
    );
    let r = h.run();
    assert_eq!(status(&r, "memlock"), Status::Ok);
    assert!(found(&r, "memlock")
        .ends_with("does not apply: the process has CAP_IPC_LOCK (CapEff in /proc/self/status)"));
    h.write(
        "/proc/self/status",
        "Name:\tdeepep-nix\nCapEff:\t00000000a80425fb\n",
    );
    assert_eq!(status(&h.run(), "memlock"), Status::Fail);
    // Limited but above libibverbs' warning: a warning.
    h.write("/proc/self/limits", limits("8388608"));
    let r = h.run();
    assert_eq!(status(&r, "memlock"), Status::Warn);
    assert_eq!(
        found(&r, "memlock"),
        "locked-memory limit (ulimit -l): soft 8 MiB, hard unlimited (/proc/self/limits): InfiniBand memory \
         registrations pin pages against this limit; container and MPI/NCCL setups for RDMA use unlimited"
    );
    assert_eq!(r.exit_code, 0);

    // In a container: the limit's fix is the runtime's flag, and the devices are checked.
    h.write("/.dockerenv", "");
    let r = h.run();
    assert!(fix(&r, "memlock").starts_with("start the container with --ulimit memlock=-1"));
    assert_eq!(
        found(&r, "container.devices"),
        "in a container (/.dockerenv): /dev/infiniband: uverbs0, /dev/gdrdrv"
    );
    h.remove("/dev/infiniband");
    h.remove("/dev/gdrdrv");
    let r = h.run();
    assert_eq!(
        found(&r, "container.devices"),
        "in a container (/.dockerenv), not passed in: /dev/infiniband/uverbs* (the host has mlx5_0), \
         /dev/gdrdrv (the host kernel has gdrdrv loaded)"
    );
    assert!(fix(&r, "container.devices").starts_with(
        "pass the devices in: docker/podman run --device=/dev/infiniband --device=/dev/gdrdrv --ulimit memlock=-1"
    ));
    assert_eq!(status(&r, "container.devices"), Status::Fail);
    // Only gdrdrv missing: CPU-assisted IBGDA works without it (a warning).
    std::fs::create_dir_all(h.path("/dev/infiniband")).unwrap();
    h.write("/dev/infiniband/uverbs0", "");
    h.write("/proc/self/limits", limits("unlimited"));
    let r = h.run();
    assert_eq!(status(&r, "container.devices"), Status::Warn);
    // Podman's marker and systemd's `container=` work the same way.
    h.remove("/.dockerenv");
    let h = h.env("container", "podman");
    let r = h.run();
    assert!(found(&r, "container.devices")
        .starts_with("in a container (container=podman in the environment)"));
}

#[test]
fn deepep_checks_in_json_and_from_the_binary() {
    let h = TestHost::ibgda();
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    let root = h.root.path().to_str().unwrap().to_string();
    let (_, json) = doctor_json_with_nvshmem(&root, &[SITE]);
    let get = |id: &str| json_check(&json, id);
    assert_eq!(get("deepep.nvshmem")["status"], "ok");
    assert_eq!(
        get("deepep.pairing")["needed_by"],
        serde_json::json!(["low-latency", "internode-ibgda", "internode-cpu-ibgda"])
    );
    assert_eq!(get("deepep.arch")["status"], "ok");
    // A site without DeepEP: the failure names the fix.
    let out = bin()
        .args(["doctor", "--root", &root, "--json", "--python-site", "/opt"])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ext = json_check(&json, "deepep.extension");
    assert_eq!(ext["status"], "fail");
    assert!(ext["fix"].as_str().unwrap().contains("--python-site"));
}

/// torch's own site-packages on the project's GPU machine (a venv), while DeepEP was installed
/// with `pip install --target` elsewhere (SITE).
const TORCH_SITE: &str = "/opt/torch/.venv/lib/python3.12/site-packages";

#[test]
fn torch_in_no_given_site_is_a_warning_not_an_ok() {
    // DeepEP in SITE, torch with its NVSHMEM 3.4.5 in TORCH_SITE; only SITE given: doctor did
    // not see torch and must not claim that torch bundles no NVSHMEM.
    let h = TestHost::ibgda().with_site();
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    h.install_torch_in(TORCH_SITE, "3.4.5", true);
    let r = h.run();
    assert_found_and_fix(
        &r,
        "deepep.torch-nvshmem",
        &format!(
            "torch not found in the --python-site directories searched ({SITE}): \
             its own NVSHMEM (torch/lib/libtorch_nvshmem.so, the nvidia-nvshmem wheel) was not checked"
        ),
        "pass torch's site-packages too: --python-site \
         $(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')",
    );
    assert_eq!(status(&r, "deepep.torch-nvshmem"), Status::Warn);
    // A warning blocks nothing.
    assert_eq!(verdicts(&r), all_ready(), "{}", r.render_text());
}

#[test]
fn deepep_and_torch_in_different_site_directories() {
    // DeepEP in SITE (pip install --target), torch with the nvidia-nvshmem wheel in TORCH_SITE;
    // both given, in either order: each is taken from the site that has it.
    let deepep_in_site = || {
        let h = TestHost::ibgda();
        h.install_deepep(
            Some("1.2.1"),
            Some("3.4.5"),
            "/opt/nvshmem",
            "/opt/nvshmem/lib",
            &[(2, 90)],
        );
        h
    };
    let torch_host =
        format!("{TORCH_SITE}/torch/lib/../../nvidia/nvshmem/lib/libnvshmem_host.so.3");
    let mut h = deepep_in_site();
    h.install_torch_in(TORCH_SITE, "3.4.5", true);
    for order in [[SITE, TORCH_SITE], [TORCH_SITE, SITE]] {
        h.args.python_site = order.iter().map(PathBuf::from).collect();
        let r = h.run();
        let text = r.render_text();
        assert_eq!(status(&r, "deepep.extension"), Status::Ok, "{text}");
        assert_eq!(
            found(&r, "deepep.torch-nvshmem"),
            format!("torch loads NVSHMEM 3.4.5 ({torch_host}) = DeepEP's build 3.4.5"),
            "{order:?}"
        );
        assert_eq!(status(&r, "deepep.torch-nvshmem"), Status::Ok);
        assert_eq!(verdicts(&r), all_ready(), "{text}");
    }

    // torch's NVSHMEM 3.8.0 differs from DeepEP's 3.4.5: fails as with one site, and the fix
    // names the wheel in torch's site.
    let mut h = deepep_in_site();
    h.install_torch_in(TORCH_SITE, "3.8.0", true);
    h.args.python_site = vec![SITE.into(), TORCH_SITE.into()];
    let r = h.run();
    assert_eq!(
        found(&r, "deepep.torch-nvshmem"),
        format!(
            "{TORCH_SITE}/torch/lib/libtorch_nvshmem.so loads NVSHMEM 3.8.0 ({torch_host}); DeepEP's build is \
             NVSHMEM 3.4.5: once torch has loaded its copy, deep_ep_cpp's libnvshmem_host.so.3 is that copy (same SONAME)"
        )
    );
    assert!(
        fix(&r, "deepep.torch-nvshmem").starts_with(&format!(
            "use one NVSHMEM: build DeepEP against torch's copy (unset NVSHMEM_DIR, or NVSHMEM_DIR={TORCH_SITE}/nvidia/nvshmem;"
        )),
        "{}",
        fix(&r, "deepep.torch-nvshmem")
    );
    let both = ["deepep.torch-nvshmem", "deepep.pairing"];
    assert_eq!(verdicts(&r), expect_verdicts(&[], &both, &both, &both));
    assert!(found(&r, "deepep.pairing")
        .starts_with("DeepEP 1.2.1 with NVSHMEM 3.8.0 (torch's host library)"));

    // torch in two given sites: the first one given is the one checked, as Python's sys.path.
    h.install_torch_in(SITE, "3.4.5", true);
    let r = h.run();
    assert_eq!(status(&r, "deepep.torch-nvshmem"), Status::Ok);
    assert!(found(&r, "deepep.torch-nvshmem").contains(&format!("({SITE}/torch/lib/")));
    h.args.python_site = vec![TORCH_SITE.into(), SITE.into()];
    let r = h.run();
    assert_eq!(status(&r, "deepep.torch-nvshmem"), Status::Fail);

    // No DeepEP in any of them: the failure names every directory searched.
    let mut h = TestHost::ibgda();
    h.install_torch_in(TORCH_SITE, "3.4.5", true);
    h.args.python_site = vec![SITE.into(), TORCH_SITE.into()];
    let r = h.run();
    assert_eq!(
        found(&r, "deepep.extension"),
        format!("no deep_ep_cpp*.so in {SITE}, {TORCH_SITE} (nor in a deep_ep-*.egg there)")
    );
}

#[test]
fn several_python_sites_from_the_binary_in_json() {
    let h = TestHost::ibgda();
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    h.install_torch_in(TORCH_SITE, "3.4.5", true);
    let root = h.root.path().to_str().unwrap().to_string();
    let torch_check = |sites: &[&str]| {
        let (code, json) = doctor_json_with_nvshmem(&root, sites);
        (code, json_check(&json, "deepep.torch-nvshmem").clone())
    };
    // Both sites: torch seen and compared.
    let (code, c) = torch_check(&[SITE, TORCH_SITE]);
    assert_eq!(code, Some(0), "{c}");
    assert_eq!(c["status"], "ok");
    assert_eq!(
        c["found"],
        format!(
            "torch loads NVSHMEM 3.4.5 ({TORCH_SITE}/torch/lib/../../nvidia/nvshmem/lib/libnvshmem_host.so.3) \
             = DeepEP's build 3.4.5"
        )
    );
    // DeepEP's site alone: the warning with the sites searched and the fix; warn blocks nothing.
    let (code, c) = torch_check(&[SITE]);
    assert_eq!(code, Some(0), "{c}");
    assert_eq!(c["status"], "warn");
    assert_eq!(
        c["found"],
        format!(
            "torch not found in the --python-site directories searched ({SITE}): its own NVSHMEM \
             (torch/lib/libtorch_nvshmem.so, the nvidia-nvshmem wheel) was not checked"
        )
    );
    assert!(c["fix"]
        .as_str()
        .unwrap()
        .starts_with("pass torch's site-packages too: --python-site $(python3 -c 'import torch"));
    assert_eq!(
        c["needed_by"],
        serde_json::json!(["low-latency", "internode-ibgda", "internode-cpu-ibgda"])
    );
}

// ---------------------------------------------------------------------------------------------
// This project's wheel `deepep_kernels` (python/, docs/python.md) in a `--python-site`.
//
// `deepep_kernels/_native.abi3.so` is a real ELF shared object built here with the C compiler; its
// data holds CUDA ELF images (cubins) laid out as nvlink writes them: ELF ABI version 8, e_flags
// with the SM in bits 8-15, a symbol table whose `nvshmemi_device_lib_version_d` points at
// {major, minor, patch} in `.nv.constant3`. The real extension embeds its cubins the same way
// (`include_bytes!`); python/tests/test_wheel.py runs the doctor on the real installed wheel.

/// A minimal cubin: sections null, .shstrtab, .strtab, .symtab, .nv.constant3; the NVSHMEM
/// device version variable when `nvshmem` is given (an NVSHMEM cubin), sm_`sm`.
fn cuda_elf(sm: u32, nvshmem: Option<(u32, u32, u32)>) -> Vec<u8> {
    let shstr = b"\0.shstrtab\0.strtab\0.symtab\0.nv.constant3\0".to_vec();
    let mut strtab = b"\0kernel_param\0".to_vec();
    let var = strtab.len() as u32;
    strtab.extend_from_slice(b"nvshmemi_device_lib_version_d\0");
    let mut constant = vec![0x55u8; 16];
    let (a, b, c) = nvshmem.unwrap_or((0, 0, 0));
    for w in [a, b, c] {
        constant.extend_from_slice(&w.to_le_bytes());
    }
    let sym = |name: u32, value: u64| {
        let mut e = name.to_le_bytes().to_vec();
        e.extend_from_slice(&[0x11, 0]);
        e.extend_from_slice(&4u16.to_le_bytes()); // .nv.constant3
        e.extend_from_slice(&value.to_le_bytes());
        e.extend_from_slice(&12u64.to_le_bytes());
        e
    };
    let mut symtab = vec![0u8; 24];
    symtab.extend(sym(1, 0));
    if nvshmem.is_some() {
        symtab.extend(sym(var, 16));
    }
    let mut body = Vec::new();
    let mut offsets = Vec::new();
    for part in [&shstr, &strtab, &symtab, &constant] {
        offsets.push(64 + body.len() as u64);
        body.extend_from_slice(part);
        body.resize(body.len().next_multiple_of(8), 0);
    }
    let mut out = vec![0u8; 64];
    out[..9].copy_from_slice(b"\x7fELF\x02\x01\x01\x41\x08");
    out[16..18].copy_from_slice(&2u16.to_le_bytes());
    out[18..20].copy_from_slice(&190u16.to_le_bytes()); // EM_CUDA
    out[40..48].copy_from_slice(&(64 + body.len() as u64).to_le_bytes());
    out[48..52].copy_from_slice(&(0x0600_0004u32 | (sm << 8)).to_le_bytes());
    out[52..54].copy_from_slice(&64u16.to_le_bytes());
    out[58..60].copy_from_slice(&64u16.to_le_bytes());
    out[60..62].copy_from_slice(&5u16.to_le_bytes());
    out.extend(body);
    out.extend([0u8; 64]);
    let lens = [shstr.len(), strtab.len(), symtab.len(), constant.len()];
    for (i, (name, ty, link, entsize)) in [
        (1u32, 3u32, 0u32, 0u64),
        (11, 3, 0, 0),
        (19, 2, 2, 24),
        (27, 1, 0, 0),
    ]
    .into_iter()
    .enumerate()
    {
        let mut s = [0u8; 64];
        s[0..4].copy_from_slice(&name.to_le_bytes());
        s[4..8].copy_from_slice(&ty.to_le_bytes());
        s[24..32].copy_from_slice(&offsets[i].to_le_bytes());
        s[32..40].copy_from_slice(&(lens[i] as u64).to_le_bytes());
        s[40..44].copy_from_slice(&link.to_le_bytes());
        s[56..64].copy_from_slice(&entsize.to_le_bytes());
        out.extend(s);
    }
    out
}

const KSITE: &str = "/opt/venv/lib/python3.12/site-packages";
const NATIVE: &str = "/opt/venv/lib/python3.12/site-packages/deepep_kernels/_native.abi3.so";

impl TestHost {
    /// Installs the deepep_kernels wheel into `KSITE`: the package's Python files, the
    /// extension with three plain sm_`sm` cubins and, with `nvshmem`, two NVSHMEM cubins linked
    /// against that version, and `deepep_kernels-<version>.dist-info/METADATA`.
    fn install_deepep_kernels(&self, version: &str, nvshmem: Option<&str>, sm: u32) {
        let releases: Vec<&str> = nvshmem.into_iter().collect();
        self.install_deepep_kernels_serving(version, &releases, None, sm);
    }

    /// [`Self::install_deepep_kernels`] with two NVSHMEM cubins for each of `releases` and, when
    /// given, `marker` as a C string in the extension's data: what a wheel built with
    /// `DEEPEP_NVSHMEM_RELEASES` holds (`DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.20,3.4.5,3.8.0;`).
    fn install_deepep_kernels_serving(
        &self,
        version: &str,
        releases: &[&str],
        marker: Option<&str>,
        sm: u32,
    ) {
        let dir = format!("{KSITE}/deepep_kernels");
        self.write(&format!("{dir}/__init__.py"), "from . import _native\n");
        self.write(&format!("{dir}/shim/deep_ep/__init__.py"), "");
        let mut blob = b"unaligned".to_vec();
        for _ in 0..3 {
            blob.extend(cuda_elf(sm, None));
        }
        for v in releases {
            let p: Vec<u32> = v.split('.').map(|x| x.parse().unwrap()).collect();
            for _ in 0..2 {
                blob.extend(cuda_elf(sm, Some((p[0], p[1], p[2]))));
            }
        }
        let bytes: Vec<String> = blob.iter().map(|b| b.to_string()).collect();
        let mut src = format!(
            "int PyInit__native;\n__attribute__((used)) static const unsigned char cubins[] = {{{}}};\n",
            bytes.join(",")
        );
        if let Some(m) = marker {
            src.push_str(&format!(
                "__attribute__((used)) static const char releases_marker[] = \"{m}\";\n"
            ));
        }
        shared_with_path(
            &self.path(NATIVE),
            "_native.abi3.so",
            &src,
            &[artifacts().stub("libc.so.6")],
            "-Wl,--enable-new-dtags",
            "",
        );
        self.write(
            &format!("{KSITE}/deepep_kernels-{version}.dist-info/METADATA"),
            format!("Metadata-Version: 2.4\nName: deepep-kernels\nVersion: {version}\n"),
        );
    }
}

fn kernels_statuses(r: &Report) -> Vec<(String, Status)> {
    statuses(r)
        .into_iter()
        .filter(|(id, _)| id.starts_with("deepep"))
        .collect()
}

/// Every check of our wheel ok (no upstream DeepEP build asked for) and every capability ready.
fn assert_wheel_ready(r: &Report, text: &str) {
    use Status::{Ok as O, Skip as S};
    assert_eq!(
        kernels_statuses(r),
        ids(&[
            ("deepep.extension", S),
            ("deepep-kernels.package", O),
            ("deepep-kernels.nvshmem", O),
            ("deepep-kernels.torch-nvshmem", O),
            ("deepep-kernels.ibgda-plugin", O),
            ("deepep-kernels.arch", O),
        ]),
        "{text}"
    );
    assert_eq!(verdicts(r), all_ready(), "{text}");
}

#[test]
fn deepep_kernels_wheel_is_recognised_instead_of_asking_for_a_deepep_build() {
    // The wheel next to torch 3.4.5, NVSHMEM_DIR=/opt/nvshmem (3.4.5): ready, and nothing asks
    // for an upstream DeepEP build (before: "no deep_ep_cpp*.so ... build DeepEP", a failure
    // blocking every capability).
    let h = TestHost::ibgda().with_site();
    h.install_deepep_kernels("0.1.0", Some("3.4.5"), 90);
    h.install_torch_in(KSITE, "3.4.5", true);
    let r = h.run();
    let text = r.render_text();
    assert_wheel_ready(&r, &text);
    assert!(!text.contains("pip install --no-build-isolation"), "{text}");
    assert_eq!(
        found(&r, "deepep.extension"),
        format!(
            "no upstream DeepEP build (deep_ep_cpp*.so) in {KSITE}; {KSITE}/deepep_kernels is there: \
             see the deepep-kernels.* checks"
        )
    );
    assert_eq!(
        found(&r, "deepep-kernels.package"),
        format!(
            "{NATIVE}: deepep_kernels 0.1.0 ({KSITE}/deepep_kernels-0.1.0.dist-info/METADATA), this project's \
             deep_ep-compatible package; built for NVSHMEM 3.4.5 (the device library linked into its cubins); \
             GPU code sm_90 (5 cubins)"
        )
    );
    assert_eq!(
        found(&r, "deepep-kernels.nvshmem"),
        "loads NVSHMEM 3.4.5 (/opt/nvshmem/lib/libnvshmem_host.so.3, from NVSHMEM_DIR) = the NVSHMEM its \
         cubins were linked against"
    );
    assert_eq!(
        found(&r, "deepep-kernels.torch-nvshmem"),
        format!(
            "torch loads NVSHMEM 3.4.5 ({KSITE}/torch/lib/../../nvidia/nvshmem/lib/libnvshmem_host.so.3) \
             = deepep_kernels' build 3.4.5"
        )
    );
    assert_eq!(
        found(&r, "deepep-kernels.arch"),
        "GPU 0 NVIDIA H200 (compute capability 9.0), GPU 1 NVIDIA H200 (compute capability 9.0) run sm_90 \
         (deepep_kernels' embedded cubins)"
    );
    // NVSHMEM_DIR unset: the package takes torch's nvidia-nvshmem wheel, as Buffer does.
    let r = h.env("NVSHMEM_DIR", "").run();
    assert_eq!(
        found(&r, "deepep-kernels.nvshmem"),
        format!(
            "loads NVSHMEM 3.4.5 ({KSITE}/nvidia/nvshmem/lib/libnvshmem_host.so.3, from the nvidia-nvshmem wheel \
             in {KSITE}, which deepep_kernels uses when NVSHMEM_DIR is unset) = the NVSHMEM its cubins were \
             linked against"
        )
    );
    assert_eq!(
        found(&r, "deepep-kernels.ibgda-plugin"),
        format!("{KSITE}/nvidia/nvshmem/lib/nvshmem_transport_ibgda.so.3")
    );
}

#[test]
fn deepep_kernels_built_for_another_nvshmem_than_torch_loads() {
    // torch 2.x with NVSHMEM 3.8.0 (its libtorch_nvshmem.so and wheel), the wheel built for
    // 3.4.5, NVSHMEM_DIR unset: the package would take the 3.8.0 wheel and refuse it.
    let h = TestHost::ibgda().with_site().env("NVSHMEM_DIR", "");
    h.install_deepep_kernels("0.1.0", Some("3.4.5"), 90);
    h.install_torch_in(KSITE, "3.8.0", true);
    let r = h.run();
    let wheel = format!("{KSITE}/nvidia/nvshmem");
    assert_found_and_fix(
        &r,
        "deepep-kernels.nvshmem",
        &format!(
            "built for NVSHMEM 3.4.5, but would load host library 3.8.0 ({wheel}/lib/libnvshmem_host.so.3, from \
             the nvidia-nvshmem wheel in {KSITE}, which deepep_kernels uses when NVSHMEM_DIR is unset): creating a \
             low-latency or internode Buffer raises RuntimeError (the versions must be equal)"
        ),
        &format!(
            "deepep-nix install --version 3.4.5 --cuda 13 --source pypi --prefix <dir> and export NVSHMEM_DIR=<dir> \
             (or pip install nvidia-nvshmem-cu13==3.4.5 into this environment); or rebuild the wheel against NVSHMEM \
             3.8.0: NVSHMEM_DIR={wheel} python/scripts/build-wheel.sh"
        ),
    );
    assert_found_and_fix(
        &r,
        "deepep-kernels.torch-nvshmem",
        &format!(
            "{KSITE}/torch/lib/libtorch_nvshmem.so loads NVSHMEM 3.8.0 ({KSITE}/torch/lib/../../nvidia/nvshmem/lib/\
             libnvshmem_host.so.3); deepep_kernels' build is NVSHMEM 3.4.5: once torch has loaded its copy, a second \
             NVSHMEM host library of another version in the same process is not supported"
        ),
        &format!(
            "use one NVSHMEM: rebuild the wheel against torch's copy (NVSHMEM_DIR={wheel} \
             python/scripts/build-wheel.sh) and leave NVSHMEM_DIR unset at run time, or install the \
             nvidia-nvshmem-cu13 wheel of NVSHMEM 3.4.5 into torch's environment if that torch works with it"
        ),
    );
    let both = ["deepep-kernels.nvshmem", "deepep-kernels.torch-nvshmem"];
    assert_eq!(verdicts(&r), expect_verdicts(&[], &both, &both, &both));
    // A wheel rebuilt against torch's 3.8.0: everything agrees.
    h.install_deepep_kernels("0.1.0", Some("3.8.0"), 90);
    let r = h.run();
    assert_eq!(
        status(&r, "deepep-kernels.nvshmem"),
        Status::Ok,
        "{}",
        r.render_text()
    );
    assert_eq!(status(&r, "deepep-kernels.torch-nvshmem"), Status::Ok);
    assert!(found(&r, "deepep-kernels.package").contains("built for NVSHMEM 3.8.0"));
}

#[test]
fn deepep_kernels_without_nvshmem_anywhere_or_built_without_it() {
    // No NVSHMEM_DIR, no wheel in the site, nothing on the loader's path.
    let h = TestHost::ibgda()
        .with_site()
        .env("NVSHMEM_DIR", "")
        .env("LD_LIBRARY_PATH", "");
    h.install_deepep_kernels("0.1.0", Some("3.4.5"), 90);
    let r = h.run();
    assert_found_and_fix(
        &r,
        "deepep-kernels.nvshmem",
        &format!(
            "libnvshmem_host.so.3 not found for deepep_kernels in the loader's search path, as NVSHMEM_DIR is unset \
             and no nvidia-nvshmem wheel is in {KSITE}: a low-latency or internode Buffer cannot start"
        ),
        "deepep-nix install --version 3.4.5 --cuda 13 --source pypi --prefix <dir> and export NVSHMEM_DIR=<dir> \
         (or pip install nvidia-nvshmem-cu13==3.4.5 into this environment)",
    );
    assert_eq!(status(&r, "deepep-kernels.ibgda-plugin"), Status::Skip);
    // torch is not in the given site: a warning naming it, not an ok.
    assert_eq!(status(&r, "deepep-kernels.torch-nvshmem"), Status::Warn);
    // NVSHMEM_DIR without the library: the loader is tried, and says why.
    let r = h.env("NVSHMEM_DIR", "/opt/empty").run();
    assert!(found(&r, "deepep-kernels.nvshmem").contains(
        "in the loader's search path, as NVSHMEM_DIR=/opt/empty has no lib/libnvshmem_host.so.3"
    ));

    // A wheel built with NVSHMEM_DIR= (no NVSHMEM cubins): intranode only.
    let h = TestHost::ibgda().with_site();
    h.install_deepep_kernels("0.1.0", None, 90);
    let r = h.run();
    assert!(found(&r, "deepep-kernels.package")
        .contains("built without NVSHMEM kernels (intranode only); GPU code sm_90 (3 cubins)"));
    assert_eq!(status(&r, "deepep-kernels.package"), Status::Ok);
    let n = ["deepep-kernels.nvshmem"];
    assert_eq!(verdicts(&r), expect_verdicts(&[], &n, &n, &n));
}

#[test]
fn deepep_kernels_on_non_hopper_gpus_and_next_to_upstream_deepep() {
    let h = TestHost::ibgda().with_site();
    for bus in ["0000:18:00.0", "0000:2a:00.0"] {
        let p = format!("/proc/driver/nvidia/gpus/{bus}/information");
        let text = std::fs::read_to_string(h.path(&p)).unwrap();
        h.write(&p, text.replace("NVIDIA H200", "NVIDIA B200"));
    }
    h.install_deepep_kernels("0.1.0", Some("3.4.5"), 90);
    let r = h.run();
    assert_found_and_fix(
        &r,
        "deepep-kernels.arch",
        "GPU 0 NVIDIA B200 (compute capability 10.0), GPU 1 NVIDIA B200 (compute capability 10.0) cannot run \
         the build's GPU code sm_90 (deepep_kernels' embedded cubins)",
        "a default build of deepep_kernels has cubins for compute capability 9.0, 10.0 and 10.3 (sm_90a, sm_100a, \
         sm_103a: Hopper, Blackwell, Blackwell Ultra); for such GPUs rebuild the wheel with DEEPEP_CUDA_ARCHS unset \
         (python/scripts/build-wheel.sh), for others use upstream DeepEP built for them (docs/deepep.md)",
    );

    // Upstream DeepEP in the same site: both are checked, each under its own ids.
    let h = TestHost::ibgda().with_site();
    h.install_deepep_kernels("0.1.0", Some("3.4.5"), 90);
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    let r = h.run();
    assert_eq!(status(&r, "deepep.extension"), Status::Ok);
    assert_eq!(status(&r, "deepep.pairing"), Status::Ok);
    assert_eq!(status(&r, "deepep-kernels.package"), Status::Ok);
    assert_eq!(verdicts(&r), all_ready(), "{}", r.render_text());

    // Neither: the failure names the way to our wheel too.
    let h = TestHost::ibgda().with_site();
    let r = h.run();
    assert!(fix(&r, "deepep.extension")
        .ends_with("or use this project's deep_ep-compatible wheel deepep_kernels (docs/python.md), which needs no DeepEP build"));
    assert!(r
        .checks
        .iter()
        .all(|c| !c.id.starts_with("deepep-kernels.")));
}

// A wheel that serves several NVSHMEM releases (python/scripts/build-wheel.sh with
// DEEPEP_NVSHMEM_RELEASES): the extension holds `DEEPEP_KERNELS_NVSHMEM_RELEASES=<list>;` and
// cubins linked against each release; it uses the NVSHMEM already loaded in the process (torch's),
// else NVSHMEM_DIR, else the nvidia-nvshmem wheel. The extension here is a real shared object
// built with the C compiler holding that marker string and those cubins (the marker's format is
// the interface the wheel's build writes; no such wheel was available to this test).

const SERVES: &str = "DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.20,3.4.5,3.8.0;";

#[test]
fn multi_release_wheel_serves_the_nvshmem_torch_loads() {
    // torch with NVSHMEM 3.8.0, NVSHMEM_DIR=/opt/nvshmem (3.4.5): the process has torch's 3.8.0,
    // which this build serves.
    let h = TestHost::ibgda().with_site();
    h.install_deepep_kernels_serving("0.2.0", &["3.3.20", "3.4.5", "3.8.0"], Some(SERVES), 90);
    h.install_torch_in(KSITE, "3.8.0", true);
    let r = h.run();
    let text = r.render_text();
    assert_wheel_ready(&r, &text);
    assert_eq!(
        found(&r, "deepep-kernels.package"),
        format!(
            "{NATIVE}: deepep_kernels 0.2.0 ({KSITE}/deepep_kernels-0.2.0.dist-info/METADATA), this project's \
             deep_ep-compatible package; serves NVSHMEM 3.3.20, 3.4.5, 3.8.0 (DEEPEP_KERNELS_NVSHMEM_RELEASES= in \
             the extension; cubins linked against NVSHMEM 3.3.20, 3.4.5, 3.8.0); GPU code sm_90 (9 cubins)"
        )
    );
    let torch_lib = format!("{KSITE}/torch/lib/libtorch_nvshmem.so");
    let torch_host = format!("{KSITE}/torch/lib/../../nvidia/nvshmem/lib/libnvshmem_host.so.3");
    assert_eq!(
        found(&r, "deepep-kernels.nvshmem"),
        format!(
            "loads NVSHMEM 3.8.0 ({torch_host}, torch's copy: {torch_lib} loads it first, and deepep_kernels uses \
             the NVSHMEM already loaded in the process), one of the releases this build serves (3.3.20, 3.4.5, 3.8.0)"
        )
    );
    assert_eq!(
        found(&r, "deepep-kernels.torch-nvshmem"),
        format!(
            "torch loads NVSHMEM 3.8.0 ({torch_host}, needed by {torch_lib}), one of the releases deepep_kernels \
             serves (3.3.20, 3.4.5, 3.8.0); it uses that copy"
        )
    );
    // The table shows the same lines.
    assert!(
        text.contains("serves NVSHMEM 3.3.20, 3.4.5, 3.8.0"),
        "{text}"
    );
    // Upstream DeepEP built against 3.4.5 in the same site: our wheel follows torch's 3.8.0, the
    // DeepEP build does not (one release linked in), and its own checks say so.
    h.install_deepep(
        Some("1.2.1"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    let r = h.run();
    assert_eq!(status(&r, "deepep-kernels.torch-nvshmem"), Status::Ok);
    assert_eq!(status(&r, "deepep-kernels.nvshmem"), Status::Ok);
    assert_eq!(status(&r, "deepep.torch-nvshmem"), Status::Fail);
    assert!(
        found(&r, "deepep.torch-nvshmem").contains("DeepEP's build is NVSHMEM 3.4.5"),
        "{}",
        r.render_text()
    );
    h.remove(&format!(
        "{KSITE}/deep_ep_cpp.cpython-312-x86_64-linux-gnu.so"
    ));
    h.remove(&format!("{KSITE}/deep_ep-1.2.1.dist-info"));
    // The same wheel before this change (no marker, one release): torch's 3.8.0 is not its 3.4.5.
    h.install_deepep_kernels("0.1.0", Some("3.4.5"), 90);
    let r = h.run();
    assert_eq!(status(&r, "deepep-kernels.torch-nvshmem"), Status::Fail);
    assert!(found(&r, "deepep-kernels.package").contains("built for NVSHMEM 3.4.5"));
}

#[test]
fn multi_release_wheel_refuses_an_nvshmem_it_does_not_serve_and_names_the_fix() {
    // torch with NVSHMEM 3.7.1, which the build does not serve: both checks fail with the fix,
    // in the table and in the binary's JSON.
    let h = TestHost::ibgda().with_site();
    h.install_deepep_kernels_serving("0.2.0", &["3.3.20", "3.4.5", "3.8.0"], Some(SERVES), 90);
    h.install_torch_in(KSITE, "3.7.1", true);
    let r = h.run();
    let torch_lib = format!("{KSITE}/torch/lib/libtorch_nvshmem.so");
    let torch_host = format!("{KSITE}/torch/lib/../../nvidia/nvshmem/lib/libnvshmem_host.so.3");
    let fix = format!(
        "install a deepep_kernels wheel built with that release (DEEPEP_NVSHMEM_RELEASES={KSITE}/torch/lib/../../nvidia/nvshmem \
         python/scripts/build-wheel.sh, then pip install --force-reinstall --no-deps target/wheels/deepep_kernels-*.whl; \
         a CUDA 13 NVSHMEM 3.7.1 prefix also comes from deepep-nix install --version 3.7.1 --cuda 13 --source pypi \
         --prefix <dir>) or a torch whose NVSHMEM is one of those"
    );
    assert_found_and_fix(
        &r,
        "deepep-kernels.torch-nvshmem",
        &format!(
            "this deepep_kernels build serves NVSHMEM 3.3.20, 3.4.5, 3.8.0; torch loads 3.7.1 ({torch_host}, needed by \
             {torch_lib}): a low-latency or internode Buffer refuses it"
        ),
        &fix,
    );
    assert_found_and_fix(
        &r,
        "deepep-kernels.nvshmem",
        &format!(
            "this deepep_kernels build serves NVSHMEM 3.3.20, 3.4.5, 3.8.0; it would load 3.7.1 ({torch_host}, torch's \
             copy: {torch_lib} loads it first, and deepep_kernels uses the NVSHMEM already loaded in the process): \
             creating a low-latency or internode Buffer raises RuntimeError naming the releases it serves"
        ),
        &fix,
    );
    let both = ["deepep-kernels.nvshmem", "deepep-kernels.torch-nvshmem"];
    assert_eq!(verdicts(&r), expect_verdicts(&[], &both, &both, &both));
    let text = r.render_text();
    assert!(text.contains("torch loads 3.7.1"), "{text}");
    assert!(
        text.contains("or a torch whose NVSHMEM is one of those"),
        "{text}"
    );

    let root = h.root.path().to_str().unwrap().to_string();
    let (code, json) = doctor_json_with_nvshmem(&root, &[KSITE]);
    let c = json_check(&json, "deepep-kernels.torch-nvshmem");
    assert_eq!(c["status"], "fail");
    assert_eq!(c["fix"], fix.as_str());
    assert!(c["found"].as_str().unwrap().starts_with(
        "this deepep_kernels build serves NVSHMEM 3.3.20, 3.4.5, 3.8.0; torch loads 3.7.1"
    ));
    assert_eq!(code, Some(1));

    // A wheel that serves 3.7.1 too: ready.
    h.install_deepep_kernels_serving(
        "0.2.0",
        &["3.3.20", "3.4.5", "3.7.1", "3.8.0"],
        Some("DEEPEP_KERNELS_NVSHMEM_RELEASES=3.3.20,3.4.5,3.7.1,3.8.0;"),
        90,
    );
    let r = h.run();
    assert_eq!(verdicts(&r), all_ready(), "{}", r.render_text());
}

#[test]
fn multi_release_wheel_without_torch_nvshmem_takes_nvshmem_dir_then_the_wheel() {
    // No torch NVSHMEM: NVSHMEM_DIR=/opt/nvshmem (3.4.5) is served.
    let h = TestHost::ibgda().with_site();
    h.install_deepep_kernels_serving("0.2.0", &["3.3.20", "3.4.5", "3.8.0"], Some(SERVES), 90);
    let r = h.run();
    assert_eq!(
        found(&r, "deepep-kernels.nvshmem"),
        "loads NVSHMEM 3.4.5 (/opt/nvshmem/lib/libnvshmem_host.so.3, from NVSHMEM_DIR, as nothing in the process loaded \
         NVSHMEM first), one of the releases this build serves (3.3.20, 3.4.5, 3.8.0)"
    );
    assert_eq!(status(&r, "deepep-kernels.nvshmem"), Status::Ok);
    // torch not in the site: a warning, as for any build.
    assert_eq!(status(&r, "deepep-kernels.torch-nvshmem"), Status::Warn);
    // NVSHMEM_DIR at 3.7.1: refused, the fix points NVSHMEM_DIR at a served release.
    h.install_nvshmem("/opt/nvshmem-3.7.1", "3.7.1", "3.7.1", 3);
    let r = h.env("NVSHMEM_DIR", "/opt/nvshmem-3.7.1").run();
    assert_found_and_fix(
        &r,
        "deepep-kernels.nvshmem",
        "this deepep_kernels build serves NVSHMEM 3.3.20, 3.4.5, 3.8.0; it would load 3.7.1 \
         (/opt/nvshmem-3.7.1/lib/libnvshmem_host.so.3, from NVSHMEM_DIR, as nothing in the process loaded NVSHMEM \
         first): creating a low-latency or internode Buffer raises RuntimeError naming the releases it serves",
        "install a deepep_kernels wheel built with that release (DEEPEP_NVSHMEM_RELEASES=/opt/nvshmem-3.7.1 \
         python/scripts/build-wheel.sh, then pip install --force-reinstall --no-deps target/wheels/deepep_kernels-*.whl; \
         a CUDA 13 NVSHMEM 3.7.1 prefix also comes from deepep-nix install --version 3.7.1 --cuda 13 --source pypi \
         --prefix <dir>) or point NVSHMEM_DIR at a release it serves (deepep-nix install --version 3.8.0 --cuda 13 \
         --source pypi --prefix <dir>)",
    );
    // NVSHMEM_DIR unset, the nvidia-nvshmem wheel (3.8.0, no torch library) in the site: used.
    let h = TestHost::ibgda().with_site().env("NVSHMEM_DIR", "");
    h.install_deepep_kernels_serving("0.2.0", &["3.3.20", "3.4.5", "3.8.0"], Some(SERVES), 90);
    h.install_torch_in(KSITE, "3.8.0", false);
    let r = h.run();
    assert_eq!(
        found(&r, "deepep-kernels.nvshmem"),
        format!(
            "loads NVSHMEM 3.8.0 ({KSITE}/nvidia/nvshmem/lib/libnvshmem_host.so.3, from the nvidia-nvshmem wheel in \
             {KSITE}, as nothing loaded NVSHMEM first and NVSHMEM_DIR is unset), one of the releases this build \
             serves (3.3.20, 3.4.5, 3.8.0)"
        )
    );
    assert_eq!(status(&r, "deepep-kernels.torch-nvshmem"), Status::Ok);
    assert_eq!(verdicts(&r), all_ready(), "{}", r.render_text());
}

#[test]
fn multi_release_marker_that_is_malformed_or_disagrees_with_the_cubins_is_a_failure() {
    let h = TestHost::ibgda().with_site();
    // Not ascending.
    h.install_deepep_kernels_serving(
        "0.2.0",
        &["3.4.5", "3.8.0"],
        Some("DEEPEP_KERNELS_NVSHMEM_RELEASES=3.8.0,3.4.5;"),
        90,
    );
    let r = h.run();
    assert_eq!(status(&r, "deepep-kernels.package"), Status::Fail);
    assert!(found(&r, "deepep-kernels.package").ends_with(
        "its NVSHMEM releases marker is unreadable: DEEPEP_KERNELS_NVSHMEM_RELEASES=3.8.0,3.4.5; is not in ascending \
         order without repeats"
    ));
    assert_eq!(status(&r, "deepep-kernels.nvshmem"), Status::Skip);
    // Not a release.
    h.install_deepep_kernels_serving(
        "0.2.0",
        &["3.4.5"],
        Some("DEEPEP_KERNELS_NVSHMEM_RELEASES=3.4,3.4.5;"),
        90,
    );
    assert!(found(&h.run(), "deepep-kernels.package").ends_with(
        "DEEPEP_KERNELS_NVSHMEM_RELEASES=3.4,3.4.5; names \"3.4\", not a release X.Y.Z"
    ));
    // Marker and cubins disagree (3.8.0 listed, no cubin linked against it).
    h.install_deepep_kernels_serving("0.2.0", &["3.3.20", "3.4.5"], Some(SERVES), 90);
    let r = h.run();
    assert_eq!(status(&r, "deepep-kernels.package"), Status::Fail);
    assert!(found(&r, "deepep-kernels.package").contains(
        "(DEEPEP_KERNELS_NVSHMEM_RELEASES= in the extension; cubins linked against NVSHMEM 3.3.20, 3.4.5)"
    ));
    assert!(found(&r, "deepep-kernels.package")
        .ends_with("the marker and the cubins disagree, so the build is inconsistent"));
    // The prefix alone (no list and `;`) is not a marker: the build is read as a one-release wheel.
    h.install_deepep_kernels_serving(
        "0.1.0",
        &["3.4.5"],
        Some("DEEPEP_KERNELS_NVSHMEM_RELEASES="),
        90,
    );
    let r = h.run();
    assert_eq!(status(&r, "deepep-kernels.package"), Status::Ok);
    assert!(found(&r, "deepep-kernels.package").contains("built for NVSHMEM 3.4.5"));
}

// ---------------------------------------------------------------------------------------------
// One NVSHMEM per process, through the --maps flag (the parser's cases are maps.rs's unit tests).

#[test]
fn maps_flag_names_every_nvshmem_host_library_a_process_mapped() {
    let torchs = "/site/nvidia/nvshmem/lib/libnvshmem_host.so.3";
    let ours = "/opt/nvshmem-3.4.5/lib/libnvshmem_host.so.3";
    let mut h = TestHost::ibgda().with_maps(&format!(
        "7f0000000000-7f0000100000 r-xp 00000000 08:01 11 {torchs}\n\
         7f0000200000-7f0000300000 r-xp 00000000 08:01 12 {ours}\n\
         7f0000400000-7f0000500000 r-xp 00000000 08:01 13 /usr/lib/libc.so.6\n"
    ));
    let r = h.run();
    assert_eq!(
        status(&r, "process.nvshmem-maps"),
        Status::Fail,
        "{}",
        r.render_text()
    );
    let c = r
        .checks
        .iter()
        .find(|c| c.id == "process.nvshmem-maps")
        .unwrap();
    let text = format!("{c:?}");
    assert!(
        text.contains(torchs) && text.contains(ours),
        "both libraries named: {text}"
    );

    // one library: ok
    h = h.with_maps(&format!(
        "7f0000000000-7f0000100000 r-xp 00000000 08:01 11 {torchs}\n"
    ));
    assert_eq!(status(&h.run(), "process.nvshmem-maps"), Status::Ok);
    // without the flag the check is not run
    h.args.maps = None;
    assert!(h
        .run()
        .checks
        .iter()
        .all(|c| c.id != "process.nvshmem-maps"));
}

// ---------------------------------------------------------------------------------------------
// Issue 39: host limits, the driver branch against the CUDA majors, DeepEP V2's NCCL, the IBGDA
// mode line.

/// DeepEP 1.2.1+<rev> (a v1 build with the RC layout fix) against NVSHMEM 3.6.5: on a host
/// without an InfiniBand/RoCE device the `hostLimits` rule of pairings.json warns for
/// low-latency; with one, it does not apply.
#[test]
fn host_limit_warns_for_low_latency_on_a_host_without_rdma() {
    let h = TestHost::ibgda()
        .with_site()
        .env("NVSHMEM_DIR", "/opt/nvshmem-3.6.5")
        .env("LD_LIBRARY_PATH", "/opt/nvshmem-3.6.5/lib");
    h.install_nvshmem("/opt/nvshmem-3.6.5", "3.6.5", "3.6.5", 3);
    h.install_deepep(
        Some("1.2.1+309785a"),
        Some("3.6.5"),
        "/opt/nvshmem-3.6.5",
        "/opt/nvshmem-3.6.5/lib",
        &[(2, 90)],
    );
    h.write(&format!("{SITE}/torch/__init__.py"), "");
    // This host has an mlx5 port: the limit does not apply.
    let r = h.run();
    assert_eq!(
        status(&r, "deepep.host-limits"),
        Status::Ok,
        "{}",
        r.render_text()
    );
    assert_eq!(
        found(&r, "deepep.host-limits"),
        "DeepEP 1.2.1+309785a with NVSHMEM 3.6.5: host limit ll-init-fails-without-infiniband applies to \
         a host without an InfiniBand/RoCE device only; this host has 1 RDMA port(s)"
    );
    // The same build on a host without InfiniBand/RoCE.
    h.remove("/sys/class/infiniband");
    h.remove("/dev/infiniband");
    let r = h.run();
    let text = r.render_text();
    assert_eq!(status(&r, "deepep.host-limits"), Status::Warn, "{text}");
    let c = r.check("deepep.host-limits").unwrap();
    assert_eq!(c.needed_by, vec![LowLatency]);
    assert!(
        c.found.starts_with(
            "DeepEP 1.2.1+309785a with NVSHMEM 3.6.5 (linked device library) on a host without an \
             InfiniBand/RoCE device (none in /sys/class/infiniband): DeepEP <= 1.2.1's low-latency mode fails"
        ),
        "{}",
        c.found
    );
    assert!(
        c.found.contains("num_rc_per_pe >= num_local_experts"),
        "{}",
        c.found
    );
    assert!(c
        .found
        .ends_with("[pairings.json hostLimits ll-init-fails-without-infiniband]"));
    assert_eq!(
        fix(&r, "deepep.host-limits"),
        "use NVSHMEM 3.4.5 for DeepEP on hosts without RDMA NICs (deepep-nix install --version 3.4.5 --cuda 13 \
         --source pypi ...), or deepep_kernels"
    );
    assert!(r
        .verdict(LowLatency)
        .warnings
        .contains(&"deepep.host-limits".to_string()));
    // NVSHMEM 3.4.5: outside the limit's range, on the same host.
    let h = h
        .env("NVSHMEM_DIR", "/opt/nvshmem")
        .env("LD_LIBRARY_PATH", "/opt/nvshmem/lib");
    h.remove(&format!("{SITE}/{EXT}"));
    h.install_deepep(
        Some("1.2.1+309785a"),
        Some("3.4.5"),
        "/opt/nvshmem",
        "/opt/nvshmem/lib",
        &[(2, 90)],
    );
    let r = h.run();
    assert_eq!(
        found(&r, "deepep.host-limits"),
        "DeepEP 1.2.1+309785a with NVSHMEM 3.4.5 (linked device library), 3.4.5 (host library \
         /opt/nvshmem/lib/libnvshmem_host.so.3): no host limit of pairings.json covers it"
    );
}

/// A site with torch for CUDA `cuda` and the nvidia-nvshmem-cu<major> wheel's metadata.
fn install_cuda_stack(h: &TestHost, cuda: &str, nvshmem_major: u32) {
    h.write(
        &format!("{SITE}/torch/version.py"),
        format!("__version__ = '2.11.0'\ndebug = False\ncuda: Optional[str] = '{cuda}'\n"),
    );
    h.write(&format!("{SITE}/torch/__init__.py"), "");
    h.write(
        &format!("{SITE}/nvidia_nvshmem_cu{nvshmem_major}-3.4.5.dist-info/METADATA"),
        "Name: nvidia-nvshmem-cu13\nVersion: 3.4.5\n",
    );
}

fn set_driver(h: &TestHost, version: &str) {
    let text = std::fs::read_to_string(h.path("/proc/driver/nvidia/version")).unwrap();
    h.write(
        "/proc/driver/nvidia/version",
        text.replace("580.159.04", version),
    );
}

#[test]
fn driver_branch_against_the_cuda_major_of_torch_nvshmem_and_our_wheel() {
    let h = TestHost::ibgda().with_site();
    install_cuda_stack(&h, "13.0", 13);
    let r = h.run();
    assert_eq!(
        status(&r, "driver.cuda-branch"),
        Status::Ok,
        "{}",
        r.render_text()
    );
    assert_eq!(
        found(&r, "driver.cuda-branch"),
        format!(
            "driver 580.159.04 (branch R580) runs CUDA <= 13: torch (CUDA 13.0, {SITE}/torch/version.py); \
             NVSHMEM 3.4.5 (nvidia-nvshmem-cu13, {SITE}/nvidia_nvshmem_cu13-3.4.5.dist-info)"
        )
    );
    // An R570 driver: CUDA 12 at most.
    set_driver(&h, "570.124.06");
    let r = h.run();
    assert_eq!(status(&r, "driver.cuda-branch"), Status::Fail);
    assert!(
        found(&r, "driver.cuda-branch").starts_with(
            "driver 570.124.06 (branch R570) runs CUDA <= 12, but CUDA 13 needs the R580 or newer branch: torch (CUDA 13.0"
        ),
        "{}",
        found(&r, "driver.cuda-branch")
    );
    assert!(fix(&r, "driver.cuda-branch")
        .starts_with("install an NVIDIA driver of branch R580 or newer"));
    assert!(r
        .verdict(Intranode)
        .blocked_by
        .contains(&"driver.cuda-branch".to_string()));
    // CUDA 12 builds on the same driver: fine.
    h.remove(&format!("{SITE}/nvidia_nvshmem_cu13-3.4.5.dist-info"));
    install_cuda_stack(&h, "12.8", 12);
    let r = h.run();
    assert_eq!(
        status(&r, "driver.cuda-branch"),
        Status::Ok,
        "{}",
        found(&r, "driver.cuda-branch")
    );
    // Our wheel is CUDA 13 only.
    std::fs::create_dir_all(h.path(&format!("{SITE}/deepep_kernels"))).unwrap();
    h.write(
        &format!("{SITE}/deepep_kernels/_native.abi3.so"),
        "not an ELF",
    );
    let r = h.run();
    assert_eq!(status(&r, "driver.cuda-branch"), Status::Fail);
    assert!(
        found(&r, "driver.cuda-branch").contains("deepep_kernels ("),
        "{}",
        found(&r, "driver.cuda-branch")
    );
    assert!(fix(&r, "driver.cuda-branch").contains("deepep_kernels has CUDA 13 builds only"));
    // Nothing to compare with: skipped, and without --python-site not reported at all.
    let mut h = TestHost::ibgda().with_site();
    assert_eq!(status(&h.run(), "driver.cuda-branch"), Status::Skip);
    h.args.python_site = vec![];
    assert!(h.run().check("driver.cuda-branch").is_none());
}

#[test]
fn deepep_v2_needs_nccl_2_30_4_and_one_libnccl() {
    let h = TestHost::ibgda().with_site();
    h.write(
        &format!("{SITE}/deep_ep-2.1.0.dist-info/METADATA"),
        "Name: deep_ep\nVersion: 2.1.0\n",
    );
    // No NCCL anywhere: DeepEP's import cannot find it.
    let r = h.run();
    assert_eq!(
        status(&r, "deepep.nccl"),
        Status::Fail,
        "{}",
        r.render_text()
    );
    assert!(found(&r, "deepep.nccl").contains("\"Cannot find package: nccl\""));
    // torch's nvidia-nccl wheel at 2.28.9 (what torch 2.11 depends on): too old for V2.
    h.write(&format!("{SITE}/nvidia/nccl/lib/libnccl.so.2"), "");
    h.write(
        &format!("{SITE}/nvidia_nccl_cu13-2.28.9.dist-info/METADATA"),
        "Name: nvidia-nccl-cu13\nVersion: 2.28.9\n",
    );
    let r = h.run();
    assert_found_and_fix(
        &r,
        "deepep.nccl",
        &format!(
            "DeepEP 2.1.0 (V2) uses NCCL 2.28.9 (the nvidia-nccl-cu13 wheel, nvidia_nccl_cu13-2.28.9.dist-info in {SITE}, \
             {SITE}/nvidia/nccl): V2 needs NCCL >= 2.30.4 (DeepEP's README; its GIN backend)"
        ),
        "pip install \"nvidia-nccl-cu13>=2.30.4\" --no-deps (DeepEP's README; pip may downgrade it again when torch \
         is reinstalled); or deepep_kernels' ElasticBuffer does not need NCCL (docs/python.md)",
    );
    assert_eq!(status(&r, "deepep.nccl"), Status::Warn);
    h.remove(&format!("{SITE}/nvidia_nccl_cu13-2.28.9.dist-info"));
    h.write(
        &format!("{SITE}/nvidia_nccl_cu13-2.30.4.dist-info/METADATA"),
        "Name: nvidia-nccl-cu13\nVersion: 2.30.4\n",
    );
    assert_eq!(status(&h.run(), "deepep.nccl"), Status::Ok);
    // EP_NCCL_ROOT_DIR wins, its version read from the library's banner.
    h.write(
        "/opt/nccl/lib/libnccl.so.2.29.1",
        b"\x7fELF...\0NCCL version %s\0NCCL version 2.29.1+cuda13.0\0".as_slice(),
    );
    let h = h.env("EP_NCCL_ROOT_DIR", "/opt/nccl");
    let r = h.run();
    assert_eq!(status(&r, "deepep.nccl"), Status::Warn);
    assert!(
        found(&r, "deepep.nccl").contains("uses NCCL 2.29.1 (EP_NCCL_ROOT_DIR=/opt/nccl"),
        "{}",
        found(&r, "deepep.nccl")
    );
    // DeepEP 1.x: no NCCL check.
    let h = TestHost::ibgda().with_site();
    h.write(
        &format!("{SITE}/deep_ep-1.2.1.dist-info/METADATA"),
        "Version: 1.2.1\n",
    );
    assert!(h.run().check("deepep.nccl").is_none());
}

#[test]
fn two_libnccl_in_one_process_fail_like_deepep_v2s_import() {
    let h = TestHost::ibgda().with_maps(
        "7f00-7f01 r--p 00000000 08:01 12 /venv/site-packages/nvidia/nccl/lib/libnccl.so.2\n\
         7f01-7f02 r--p 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libnccl.so.2.18.3\n\
         7f02-7f03 r--p 00000000 08:01 14 /venv/site-packages/nvidia/nvshmem/lib/libnvshmem_host.so.3\n",
    );
    let r = h.run();
    assert_eq!(status(&r, "process.nvshmem-maps"), Status::Ok);
    assert_eq!(status(&r, "process.nccl-maps"), Status::Fail);
    assert!(found(&r, "process.nccl-maps").contains(
        "2 different libnccl mapped in one process: /venv/site-packages/nvidia/nccl/lib/libnccl.so.2, \
         /usr/lib/x86_64-linux-gnu/libnccl.so.2.18.3"
    ));
    assert!(!r.verdict(Intranode).ready);
    let h = h.with_maps(
        "7f00-7f01 r--p 00000000 08:01 12 /venv/site-packages/nvidia/nccl/lib/libnccl.so.2\n",
    );
    assert_eq!(status(&h.run(), "process.nccl-maps"), Status::Ok);
}

#[test]
fn ibgda_mode_in_one_line() {
    // Everything set up: GPU-initiated.
    let h = TestHost::ibgda();
    let r = h.run();
    assert_eq!(r.ibgda.mode, "gpu-initiated");
    assert!(r.render_text().contains(
        "  ibgda: GPU-initiated (the GPU rings the NIC doorbell; NVSHMEM_IB_ENABLE_IBGDA=1); it would fall back \
         to CPU-assisted if the driver options (params.*) were lost\n"
    ));
    // Driver options active but not persistent: still GPU-initiated, until the next boot.
    h.remove("/etc/modprobe.d/nvidia-ibgda.conf");
    let r = h.run();
    assert_eq!(r.ibgda.mode, "gpu-initiated");
    assert!(
        r.ibgda
            .summary
            .contains("not persistent (params.stream-memops, params.peer-mapping)"),
        "{}",
        r.ibgda.summary
    );
    // Driver options off: NVSHMEM 3.4.5 falls back to CPU-assisted, here with GDRCopy.
    let params = std::fs::read_to_string(h.path("/proc/driver/nvidia/params")).unwrap();
    h.write(
        "/proc/driver/nvidia/params",
        params.replace("EnableStreamMemOPs: 1", "EnableStreamMemOPs: 0"),
    );
    let r = h.run();
    assert_eq!(r.ibgda.mode, "cpu-assisted", "{}", r.render_text());
    assert_eq!(
        r.ibgda.summary,
        "CPU-assisted fallback with GDRCopy (\"NIC handler will be CPU with gdrcopy backend\"): NVSHMEM >= 3.4.5 \
         takes it by itself, slower, and does not say so; GPU-initiated is blocked by params.stream-memops: fix \
         params.stream-memops (their fix lines above) for GPU-initiated"
    );
    // No InfiniBand: no IBGDA at all.
    h.remove("/sys/class/infiniband");
    h.remove("/dev/infiniband");
    let r = h.run();
    assert_eq!(r.ibgda.mode, "none");
    assert!(
        r.ibgda.summary.starts_with("none: internode cannot start"),
        "{}",
        r.ibgda.summary
    );
    assert!(
        r.ibgda.summary.ends_with("fix infiniband first"),
        "{}",
        r.ibgda.summary
    );
    // In JSON too.
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["ibgda"]["mode"], "none");
}
