#!/usr/bin/env python3
"""The NVSHMEM release matrix, one release per run: our deepep_kernels wheel and DeepEP, each in
processes where that release's libnvshmem_host.so.3 was loaded first.

    python/scripts/nvshmem-matrix.sh --nvshmem DIR --wheel WHEEL_OR_DIR
        [--deep-ep-src DIR | --deep-ep-site DIR] [--suites ours,conformance,deep-ep]
        [--ranks "2 4"] [--record FILE] [--out DIR] [--timeout S] [--no-mps] [--dry-run]

DIR is an NVSHMEM prefix: lib/libnvshmem_host.so.3 with its nvshmem_bootstrap_* and
nvshmem_transport_* plugins beside it, include/ (its version header names the release), and, for
building DeepEP, lib/libnvshmem_device.a and lib/libnvshmem_host.so (what
`deepep-nix install --version V --cuda 13 --source pypi --prefix DIR` makes;
python/scripts/nvshmem-prefixes.sh does it for every pinned release).

Suites (default: every one the inputs allow):
  ours         our GPU tests (python/tests/gpu) at each rank count of --ranks, all ranks on the
               GPUs there are (DEEPEP_TEST_GPUS = min(ranks, GPUs))
  conformance  DeepEP's tests/test_intranode.py and tests/test_low_latency.py, unchanged, on our
               package at 2 ranks (python/scripts/deepep-conformance.sh --only ours); needs the
               DeepEP checkout (--deep-ep-src)
  deep-ep      DeepEP built against DIR (from --deep-ep-src, in a scratch copy; or the build in
               --deep-ep-site) with the same two test files at 2 ranks (deepep-conformance.sh
               --only deepep; time-sliced, as DeepEP's own low-latency kernels need all their
               blocks resident)

Every test process has that release loaded first, as a torch that brings it would: a folder with
`nvidia/nvshmem` (links to DIR's lib/ and include/) comes first on PYTHONPATH, so torch's import
(which loads `nvidia/nvshmem/lib/libnvshmem_host.so.*` by path from the first sys.path entry that
has it) loads DIR's library, and LD_PRELOAD=DIR/lib/libnvshmem_host.so.3 covers anything that asks
for the SONAME before torch. (LD_PRELOAD alone leaves torch 2.11 loading its own wheel's copy by
path as well: two NVSHMEMs in one process.) First a preflight (checks/nvshmem-maps.py) imports torch and our
package, loads the host library through it and requires exactly one libnvshmem_host.so.3 mapped,
the one in DIR; it also reports the releases the wheel serves and times the first load.

--deep-ep-files "A B" limits the deep-ep suite to those test files (default: both).
--retry-env "K=V ..." runs every failed test run once more with those variables added (e.g.
NVSHMEM_REMOTE_TRANSPORT=none on a host without InfiniBand), recorded as its own row
("<suite>+K=V").

--record FILE writes a result record (kernels/results/, schema 2, kind "nvshmem-matrix"): one row
per suite run (suite, ranks, status pass/fail/skip, seconds, first error). --dry-run runs no GPU
work: it checks the inputs, prints the plan and writes a record whose rows are all "skip".
Exit status: 0 when every suite that ran passed, 1 when one failed, 2 on bad arguments.
Environment: PYTHON (default: this interpreter), NVSHMEM_DISABLE_NVLS=1 and NCCL_NVLS_ENABLE=0 are
always set.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HOST_LIB = "libnvshmem_host.so.3"
SUITES = ("ours", "conformance", "deep-ep")
DEEPEP_TESTS = ("test_intranode.py", "test_low_latency.py")


class UsageError(Exception):
    pass


def nvshmem_release(prefix):
    """X.Y.Z from the prefix's version header (include/non_abi/nvshmem_version.h or
    include/nvshmem_version.h)."""
    for rel in ("include/non_abi/nvshmem_version.h", "include/nvshmem_version.h"):
        path = os.path.join(prefix, rel)
        if not os.path.isfile(path):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        parts = []
        for what in ("MAJOR", "MINOR", "PATCH"):
            m = re.search(r"#define\s+NVSHMEM_VENDOR_%s_VERSION\s+(\d+)" % what, text)
            if not m:
                break
            parts.append(m.group(1))
        if len(parts) == 3:
            return ".".join(parts)
    raise UsageError(
        "--nvshmem %s: no NVSHMEM version header (include/non_abi/nvshmem_version.h); pass a complete NVSHMEM "
        "prefix, e.g. one made by `deepep-nix install --version V --cuda 13 --source pypi --prefix DIR`" % prefix
    )


def find_wheel(path):
    if os.path.isdir(path):
        wheels = sorted(f for f in os.listdir(path) if f.startswith("deepep_kernels-") and f.endswith(".whl"))
        if not wheels:
            raise UsageError("--wheel %s: no deepep_kernels-*.whl in that folder; build one with python/scripts/build-wheel.sh" % path)
        return os.path.join(path, wheels[-1])
    if not (os.path.isfile(path) and path.endswith(".whl")):
        raise UsageError("--wheel %s: not a wheel file or a folder holding one" % path)
    return path


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="nvshmem-matrix.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvshmem", required=True, metavar="DIR", help="NVSHMEM prefix of the release to test")
    ap.add_argument("--wheel", metavar="WHEEL_OR_DIR", help="our deepep_kernels wheel (needed by ours and conformance)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--deep-ep-src", metavar="DIR", help="a DeepEP v1.2.1 checkout (its tests/; built against --nvshmem for deep-ep)")
    src.add_argument("--deep-ep-site", metavar="DIR", help="a folder holding a DeepEP build (deep_ep/ + deep_ep_cpp*.so) to test as is")
    ap.add_argument("--deep-ep-tests", metavar="DIR", help="DeepEP's tests/ parent folder when --deep-ep-site is used (default: none; then "
                    "conformance and deep-ep need --deep-ep-src)")
    ap.add_argument("--suites", default="", help="comma-separated subset of %s (default: all the inputs allow)" % ",".join(SUITES))
    ap.add_argument("--deep-ep-files", default=" ".join(DEEPEP_TESTS), help="DeepEP test files of the deep-ep suite (default: both)")
    ap.add_argument("--retry-env", default="", help="'K=V ...': rerun each failed test run once with these variables added")
    ap.add_argument("--ranks", default="2 4", help="rank counts for our GPU tests (default: '2 4')")
    ap.add_argument("--record", metavar="FILE", help="write the result record (schema 2) here")
    ap.add_argument("--out", metavar="DIR", default=os.environ.get("OUT") or os.path.join(os.getcwd(), "matrix-logs"),
                    help="log folder (default: $OUT, else ./matrix-logs)")
    ap.add_argument("--timeout", type=int, default=300, help="limit per test run in seconds (default 300)")
    ap.add_argument("--build-timeout", type=int, default=400, help="limit for building DeepEP in seconds (default 400)")
    ap.add_argument("--no-mps", action="store_true", help="no private MPS server for our tests (default: one per run when "
                    "nvidia-cuda-mps-control exists)")
    ap.add_argument("--dry-run", action="store_true", help="run nothing on a GPU; print the plan, write an all-skip record")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD of the checkout, or the "
                    "REV file beside the checkout's root)")
    ap.add_argument("--machine", default=None, help="machine text to record (default: read from nvidia-smi and torch)")
    a = ap.parse_args(argv)

    prefix = os.path.abspath(a.nvshmem)
    if not os.path.isfile(os.path.join(prefix, "lib", HOST_LIB)):
        raise UsageError("--nvshmem %s has no lib/%s; pass an NVSHMEM prefix (python/scripts/nvshmem-prefixes.sh makes them)" % (prefix, HOST_LIB))
    a.nvshmem = prefix
    a.release = nvshmem_release(prefix)
    try:
        a.rank_list = [int(r) for r in a.ranks.split()]
    except ValueError:
        raise UsageError("--ranks takes rank counts separated by spaces, e.g. '2 4'; got %r" % a.ranks)
    if not a.rank_list or any(r < 2 for r in a.rank_list):
        raise UsageError("--ranks: every rank count must be at least 2; got %r" % a.ranks)
    if a.commit is not None and not re.fullmatch(r"[0-9a-f]{40}", a.commit):
        raise UsageError("--commit takes the full 40-hex commit of the code that runs (git rev-parse HEAD); got %r" % a.commit)
    if a.timeout < 1 or a.build_timeout < 1:
        raise UsageError("--timeout and --build-timeout take seconds >= 1")

    tests_root = a.deep_ep_src or a.deep_ep_tests
    if a.suites:
        wanted = [s.strip() for s in a.suites.split(",") if s.strip()]
        bad = [s for s in wanted if s not in SUITES]
        if bad:
            raise UsageError("--suites: unknown suite(s) %s; choose from %s" % (", ".join(bad), ", ".join(SUITES)))
    else:
        wanted = [s for s in SUITES if (s == "ours" and a.wheel) or (s == "conformance" and a.wheel and tests_root)
                  or (s == "deep-ep" and tests_root and (a.deep_ep_src or a.deep_ep_site))]
        if not wanted:
            raise UsageError("nothing to run: pass --wheel (suite ours), and --deep-ep-src for conformance and deep-ep")
    if any(s in ("ours", "conformance") for s in wanted):
        if not a.wheel:
            raise UsageError("suites ours and conformance need --wheel")
        a.wheel = os.path.abspath(find_wheel(a.wheel))
    if any(s in ("conformance", "deep-ep") for s in wanted):
        if not tests_root or not all(os.path.isfile(os.path.join(tests_root, "tests", t)) for t in DEEPEP_TESTS):
            raise UsageError("suites conformance and deep-ep need a DeepEP checkout with tests/%s: pass --deep-ep-src DIR "
                             "(or --deep-ep-tests DIR with --deep-ep-site)" % " and tests/".join(DEEPEP_TESTS))
        a.tests_root = os.path.abspath(tests_root)
    if "deep-ep" in wanted:
        if a.deep_ep_site and not os.path.isdir(os.path.join(a.deep_ep_site, "deep_ep")):
            raise UsageError("--deep-ep-site %s has no deep_ep/ folder" % a.deep_ep_site)
        if a.deep_ep_src and not os.path.isfile(os.path.join(a.deep_ep_src, "setup.py")):
            raise UsageError("--deep-ep-src %s has no setup.py (a DeepEP checkout is needed to build it)" % a.deep_ep_src)
    a.suite_list = wanted
    a.deep_files = a.deep_ep_files.split()
    if not a.deep_files or any(f not in DEEPEP_TESTS for f in a.deep_files):
        raise UsageError("--deep-ep-files takes some of %s; got %r" % (", ".join(DEEPEP_TESTS), a.deep_ep_files))
    try:
        a.retry = dict(kv.split("=", 1) for kv in a.retry_env.split())
    except ValueError:
        raise UsageError("--retry-env takes 'KEY=VALUE ...'; got %r" % a.retry_env)
    if any(not re.match(r"^[A-Z_][A-Z0-9_]*$", k) for k in a.retry):
        raise UsageError("--retry-env: variable names are upper-case identifiers; got %r" % a.retry_env)
    return a


def first_error(log_path):
    """The first line of a log that names an error (a Python exception line, a failed assertion,
    a CUDA or NVSHMEM error), shortened; None when there is none."""
    try:
        lines = open(log_path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError:
        return None
    # The most specific kinds first: a linker or loader error, an NVSHMEM/CUDA status, then any
    # exception or error line.
    pats = [re.compile(p, re.I) for p in (
        r"multiple definition|undefined (symbol|reference)|cannot find -l",
        r"error status|init failed for transport|CUDA error|DeepEP error",
        r"(^E\s+\w+(Error|Exception)|^\w*(Error|Exception):|AssertionError|FAILED |nvshmem.*(fail|error)|Traceback|TIMEOUT|timed out)")]
    for pat in pats:
        for line in lines:
            if pat.search(line) and "warning" not in line.lower():
                return line.strip()[:300]
    return None


def run_logged(cmd, log, env, timeout, cwd=None):
    """Run cmd (own process group) with output to log; end the group at the limit. Returns
    (exit code or None on timeout, seconds)."""
    start = time.time()
    with open(log, "w") as f:
        f.write("$ %s\n" % " ".join(cmd))
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig in (15, 9):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(3)
            p.wait()
            code = None
            f.write("\nTIMEOUT after %d s\n" % timeout)
    return code, round(time.time() - start, 1)


class Mps:
    """A private MPS server (pipe and log folders of our own), quit at the end."""

    def __init__(self, root, enabled):
        self.env = {}
        if not enabled or shutil.which("nvidia-cuda-mps-control") is None:
            return
        pipe, logd = os.path.join(root, "pipe"), os.path.join(root, "log")
        os.makedirs(pipe, exist_ok=True)
        os.makedirs(logd, exist_ok=True)
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logd}
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **self.env}, check=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.env:
            subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env={**os.environ, **self.env}, check=False)
            time.sleep(1)


def machine_text(py):
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        gpu = []
    try:
        torch = subprocess.run([py, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                               capture_output=True, text=True, timeout=120).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        torch = []
    g = "%dx %s" % (len(gpu), gpu[0].split(",")[0].strip()) if gpu else "no GPU seen"
    drv = " (driver %s)" % gpu[0].split(",")[1].strip() if gpu and "," in gpu[0] else ""
    t = ", CUDA %s, torch %s" % (torch[1], torch[0]) if len(torch) == 2 else ""
    return g + drv + t


def commit_of_checkout():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass
    rev = os.path.join(REPO, "REV")
    return open(rev).read().strip() if os.path.isfile(rev) else None


def gpu_count(py, env):
    try:
        out = subprocess.run([py, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True, text=True,
                             env=env, timeout=120).stdout.strip()
        return int(out or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def pytest_detail(log):
    try:
        tail = open(log, encoding="utf-8", errors="replace").read().splitlines()[-3:]
    except OSError:
        return ""
    for line in reversed(tail):
        m = re.search(r"(\d+ (passed|failed).*?) in [\d.]+s", line)
        if m:
            return m.group(1)
    return ""


def retry_tag(env):
    return ",".join("%s=%s" % kv for kv in sorted(env.items()))


def conformance_rows(summary, suite, lib):
    """Rows from deepep-conformance.sh's summary.txt lines of library `lib`."""
    rows = []
    try:
        lines = open(summary, encoding="utf-8").read().splitlines()
    except OSError:
        return rows
    for line in lines:
        f = line.split()
        if len(f) >= 6 and f[0] == lib:
            status = "pass" if f[3].startswith("PASS") else "fail"
            log = os.path.join(os.path.dirname(summary), f[5])
            rows.append({"suite": "%s:%s" % (suite, f[1]), "ranks": int(f[2]) if f[2].isdigit() else f[2], "status": status,
                         "seconds": float(f[4]), "first_error": None if status == "pass" else (first_error(log) or f[3]),
                         "detail": f[3]})
    return rows


def main(argv):
    try:
        a = parse_args(argv)
    except UsageError as e:
        print("nvshmem-matrix: error: %s" % e, file=sys.stderr)
        return 2
    py = os.environ.get("PYTHON") or sys.executable
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    preload = os.path.join(a.nvshmem, "lib", HOST_LIB)
    base_env = dict(os.environ, NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    test_env = dict(base_env, NVSHMEM_DIR=a.nvshmem, LD_PRELOAD=preload,
                    LD_LIBRARY_PATH=os.path.join(a.nvshmem, "lib") + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else ""))
    cmdline = "python/scripts/nvshmem-matrix.sh " + " ".join(argv)
    print("nvshmem-matrix: NVSHMEM %s from %s; suites %s; our tests at ranks %s" % (a.release, a.nvshmem, ",".join(a.suite_list), a.ranks))
    rows, figures, notes = [], [], []

    if a.dry_run:
        for s in a.suite_list:
            if s == "ours":
                rows += [{"suite": "ours:python/tests/gpu", "ranks": r, "status": "skip", "seconds": 0, "first_error": None, "detail": "dry run"} for r in a.rank_list]
            else:
                files = a.deep_files if s == "deep-ep" else DEEPEP_TESTS
                rows += [{"suite": "%s:%s" % (s, t), "ranks": 2, "status": "skip", "seconds": 0, "first_error": None, "detail": "dry run"} for t in files]
        print("plan: preload %s; %s" % (preload, "; ".join("%s %s at %s ranks" % (r["suite"], "", r["ranks"]) for r in rows)))
        write_record(a, rows, figures, cmdline, "dry run: nothing ran on a GPU", machine=a.machine or "dry run (no GPU)")
        return 0

    scratch = tempfile.mkdtemp(prefix="nvshmem-matrix.")
    try:
        # torch loads nvidia/nvshmem/lib/libnvshmem_host.so.* by path from the first sys.path
        # entry that has it: give it this release's, as a torch that brings it would.
        shadow = os.path.join(scratch, "torch-nvshmem")
        pkg = os.path.join(shadow, "nvidia", "nvshmem")
        os.makedirs(os.path.join(pkg, "lib"))
        open(os.path.join(pkg, "__init__.py"), "w").close()
        if os.path.isdir(os.path.join(a.nvshmem, "include")):
            os.symlink(os.path.join(a.nvshmem, "include"), os.path.join(pkg, "include"))
        for f in os.listdir(os.path.join(a.nvshmem, "lib")):
            os.symlink(os.path.join(a.nvshmem, "lib", f), os.path.join(pkg, "lib", f))
        test_env["PYTHONPATH"] = shadow + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
        site = os.path.join(scratch, "ours")
        if a.wheel:
            r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, a.wheel],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout + r.stderr, file=sys.stderr)
                print("nvshmem-matrix: cannot install %s" % a.wheel, file=sys.stderr)
                return 2
        py_env = dict(test_env, PYTHONPATH=site + ":" + test_env["PYTHONPATH"])

        # DeepEP build first, in the background (CPU), while our GPU tests run.
        build = None
        deep_site = a.deep_ep_site
        if "deep-ep" in a.suite_list and a.deep_ep_src:
            deep_site = os.path.join(scratch, "deep-ep-site")
            src_copy = os.path.join(scratch, "DeepEP")
            shutil.copytree(a.deep_ep_src, src_copy, symlinks=True)
            build_prefix = a.nvshmem
            if not os.path.exists(os.path.join(a.nvshmem, "lib", "libnvshmem_host.so")):
                # DeepEP's setup.py links -l:libnvshmem_host.so when NVSHMEM_DIR is set; a pip
                # wheel's prefix has only the .so.3: a prefix of links beside it adds the name.
                build_prefix = os.path.join(scratch, "nvshmem-links")
                os.makedirs(os.path.join(build_prefix, "lib"))
                os.symlink(os.path.join(a.nvshmem, "include"), os.path.join(build_prefix, "include"))
                for f in os.listdir(os.path.join(a.nvshmem, "lib")):
                    os.symlink(os.path.join(a.nvshmem, "lib", f), os.path.join(build_prefix, "lib", f))
                os.symlink(HOST_LIB, os.path.join(build_prefix, "lib", "libnvshmem_host.so"))
            benv = dict(base_env, NVSHMEM_DIR=build_prefix, TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
                        MAX_JOBS=os.environ.get("MAX_JOBS", str(max(1, (os.cpu_count() or 2) - 2))))
            blog = open(os.path.join(out, "deep-ep-build.log"), "w")
            build = (subprocess.Popen([py, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", "--target", deep_site, "."],
                                      cwd=src_copy, env=benv, stdout=blog, stderr=subprocess.STDOUT, start_new_session=True), time.time(), blog)

        if a.wheel:
            # Preflight: one NVSHMEM per process, the release's, loaded first; time the first load.
            log = os.path.join(out, "preflight.log")
            code, secs = run_logged([py, "-c", PREFLIGHT, os.path.join(a.nvshmem, "lib"), os.path.join(REPO, "checks")], log, py_env, 300)
            text = open(log, encoding="utf-8", errors="replace").read()
            m = re.search(r"^PREFLIGHT (\{.*\})$", text, re.M)
            info = json.loads(m.group(1)) if m else {}
            rows.append({"suite": "preflight:one-nvshmem-per-process", "ranks": 1, "status": "pass" if code == 0 else "fail",
                         "seconds": secs, "first_error": None if code == 0 else (first_error(log) or "exit %s" % code),
                         "detail": "host library %s (release %s, cubins %s, %d mapped); wheel serves %s" % (
                             info.get("path", "?"), info.get("version", "?"), info.get("device_version", "?"), len(info.get("mapped", [])),
                             ",".join(info.get("served", [])))})
            if "buffer_error" in info:  # not the check's own result: the record's notes say it
                notes.append("preflight's first low-latency Buffer: " + info["buffer_error"])
            if "load_ms" in info:
                figures.append({"name": "nvshmem_host_check (load host library, select cubins), first call", "value": info["load_ms"],
                                "unit": "ms", "baseline": None, "baseline_value": None, "note": "one process, no GPU work"})
            if "buffer_ms" in info:
                figures.append({"name": "first low-latency Buffer (1 rank: NVSHMEM init, module load + register, symmetric heap)",
                                "value": info["buffer_ms"], "unit": "ms", "baseline": None, "baseline_value": None, "note": ""})

        gpus = gpu_count(py, py_env) if a.wheel else 0
        def ours(r, extra, tag):
            """Our GPU tests at r ranks (a private MPS server unless --no-mps), `extra` variables
            added; the result row, suite name suffixed with `tag`."""
            log = os.path.join(out, "ours-ranks%d%s.log" % (r, "-retry" if extra else ""))
            env = dict(py_env, DEEPEP_TEST_RANKS=str(r), DEEPEP_TEST_GPUS=str(max(1, min(r, gpus))), **extra)
            with Mps(os.path.join(scratch, "mps-ours-%d%s" % (r, "-retry" if extra else "")), not a.no_mps) as mps:
                code, secs = run_logged([py, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", os.path.join(REPO, "python", "tests", "gpu")],
                                        log, dict(env, **mps.env), a.timeout)
            return {"suite": "ours:python/tests/gpu" + tag, "ranks": r, "status": "pass" if code == 0 else "fail", "seconds": secs,
                    "first_error": None if code == 0 else (first_error(log) or ("timeout" if code is None else "exit %s" % code)),
                    "detail": pytest_detail(log)}

        if "ours" in a.suite_list:
            for r in a.rank_list:
                rows.append(ours(r, {}, ""))
                print("  ours, %d ranks: %s (%s s) %s" % (r, rows[-1]["status"], rows[-1]["seconds"], rows[-1]["detail"]))
                if rows[-1]["status"] == "fail" and a.retry:
                    rows.append(ours(r, a.retry, "+" + retry_tag(a.retry)))

        conf = [os.path.join(REPO, "python", "scripts", "deepep-conformance.sh")]

        def conformance(suite, lib, files, extra_args, env_add, tag):
            """One deepep-conformance.sh run of `files` at 2 ranks; rows from its summary."""
            cout = os.path.join(out, tag)
            code, secs = run_logged(["bash"] + conf + extra_args + ["--only", lib, "--tests", " ".join(files), "--timeout", str(a.timeout),
                                                                   a.tests_root, "2"],
                                    os.path.join(out, tag + ".log"), dict(test_env, OUT=cout, PYTHON=py, **env_add), a.timeout * (len(files) + 1))
            got = conformance_rows(os.path.join(cout, "summary.txt"), suite, "ours" if lib == "ours" else "deepep")
            return got or [{"suite": suite, "ranks": 2, "status": "fail", "seconds": secs,
                            "first_error": first_error(os.path.join(out, tag + ".log")) or "exit %s" % code, "detail": ""}]

        def with_retry(suite, lib, files, extra_args, tag):
            got = conformance(suite, lib, files, extra_args, {}, tag)
            failed = [r["suite"].split(":", 1)[1] for r in got if r["status"] == "fail" and ":" in r["suite"]]
            if failed and a.retry:
                got += conformance(suite + "+" + retry_tag(a.retry), lib, failed, extra_args, a.retry, tag + "-retry")
            return got

        if "conformance" in a.suite_list:
            rows += with_retry("conformance", "ours", list(DEEPEP_TESTS), ["--ours", a.wheel], "conformance")

        if "deep-ep" in a.suite_list:
            ok = True
            if build is not None:
                proc, t0, blog = build
                try:
                    bcode = proc.wait(timeout=max(1, a.build_timeout - (time.time() - t0)))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    bcode = None
                blog.close()
                bsecs = round(time.time() - t0, 1)
                blp = os.path.join(out, "deep-ep-build.log")
                ok = bcode == 0
                rows.append({"suite": "deep-ep:build", "ranks": 0, "status": "pass" if ok else "fail", "seconds": bsecs,
                             "first_error": None if ok else (first_error(blp) or ("timeout" if bcode is None else "exit %s" % bcode)),
                             "detail": "DeepEP built against NVSHMEM %s" % a.release})
            if ok:
                # time-sliced: DeepEP's kernels need all their blocks resident (no MPS)
                rows += with_retry("deep-ep", "deepep", a.deep_files, ["--deepep-site", deep_site, "--no-mps"], "deep-ep")
            else:
                rows += [{"suite": "deep-ep:%s" % t, "ranks": 2, "status": "skip", "seconds": 0, "first_error": None, "detail": "DeepEP did not build"} for t in a.deep_files]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    for r in rows:
        print("  %-40s %4s  %-4s %7.1f s  %s" % (r["suite"], r["ranks"], r["status"], r["seconds"], r["first_error"] or r["detail"]))
    write_record(a, rows, figures, cmdline, " ".join(notes), machine=a.machine or machine_text(py))
    return 1 if any(r["status"] == "fail" for r in rows) else 0


# The preflight: runs in a test process (LD_PRELOAD = the release's host library). Imports torch
# first, then our package; loads the host library through it (timed); checks the maps; then, with
# one GPU, creates a one-rank low-latency Buffer (timed: NVSHMEM init, module load and
# registration, the symmetric heap) and destroys it.
PREFLIGHT = r"""
import json, os, subprocess, sys, time
libdir, checks = sys.argv[1], sys.argv[2]
import torch
import deepep_kernels._native as n
served = n.nvshmem_releases()
t0 = time.perf_counter(); path, ver = n.nvshmem_host_check(); load_ms = (time.perf_counter() - t0) * 1e3
sys.path.insert(0, checks)
import importlib.util
spec = importlib.util.spec_from_file_location("maps", os.path.join(checks, "nvshmem-maps.py"))
maps = importlib.util.module_from_spec(spec); spec.loader.exec_module(maps)
libs = maps.mapped_nvshmem_host_libs(open("/proc/self/maps").read())
info = {"path": path, "version": ver, "served": served, "mapped": libs, "load_ms": round(load_ms, 3),
        "device_version": ".".join(map(str, n.nvshmem_device_version() or ()))}
real = os.path.realpath(libdir)
ok = len(libs) == 1 and os.path.dirname(os.path.realpath(libs[0])) == real and ver == info["device_version"]
if ok and torch.cuda.is_available():
    try:
        import torch.distributed as dist
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        torch.cuda.set_device(0)
        from deepep_kernels import Buffer
        t0 = time.perf_counter()
        b = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(128, 7168, 1, 8), low_latency_mode=True, num_qps_per_rank=8, explicitly_destroy=True)
        torch.cuda.synchronize(); info["buffer_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        b.destroy(); dist.destroy_process_group()
    except Exception as e:  # timed only where it works; the suites test the Buffer
        info["buffer_error"] = ("%s: %s" % (type(e).__name__, e))[:300]
print("PREFLIGHT " + json.dumps(info))
if not ok:
    print("one NVSHMEM per process violated or wrong release: %s" % json.dumps(info), file=sys.stderr)
    sys.exit(1)
"""


def write_record(a, rows, figures, cmdline, notes, machine):
    if not a.record:
        return
    # the machine kind as scripts/results.py's machine_kind_of reads it ("1xH200"); "cpu" without a GPU
    gpus = re.match(r"^([1-9]\d*)x\s*(?:NVIDIA\s+)?([A-Z]+\d+[A-Za-z]*)\b", machine)
    rec = {
        "schema": 2,
        "kind": "nvshmem-matrix",
        "date": datetime.date.today().isoformat(),
        "commit": a.commit or commit_of_checkout() or "unknown",
        "machine": machine,
        "machine_kind": "%sx%s" % gpus.groups() if gpus else "cpu",
        "command": cmdline,
        "nvshmem": a.release,
        # one suite (this runner, at the rank counts its rows ran), per release: kernels/TESTING.md
        "runs": [{"suite": "python/scripts/nvshmem-matrix.sh", "part": None,
                  "ranks": sorted({r["ranks"] for r in rows if r["ranks"] >= 2}) or a.rank_list}],
        "results": rows,
        "figures": figures,
        "notes": notes,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.record)), exist_ok=True)
    with open(a.record, "w") as f:
        json.dump(rec, f, indent=2)
        f.write("\n")
    print("record: %s" % a.record)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
