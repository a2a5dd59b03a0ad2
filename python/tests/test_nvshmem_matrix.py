"""CPU checks of the NVSHMEM release matrix: the runner python/scripts/nvshmem-matrix.sh (its
--help, its refusal of bad arguments, and the record its --dry-run writes) and the pairing data
pkgs/deep-ep/pairings.json against the GPU records in kernels/results/ (no GPU, no torch).

The record format is the project's results-as-data schema 2 (kind "nvshmem-matrix" here); the
rows the runner writes per suite and test are named as in SUITE_ROWS below. A `good` pairing
names the record that shows it (`"record": "kernels/results/<date>-nvshmem-matrix-<release>.json"`)
and that record must show DeepEP's test of every mode the entry claims passing at that release.
Only the entries listed in LEGACY_GOOD (recorded before records existed) may lack `record`."""

import json
import os
import re
import subprocess
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(REPO, "python", "scripts", "nvshmem-matrix.sh")
PAIRINGS = os.path.join(REPO, "pkgs", "deep-ep", "pairings.json")
RELEASES = os.path.join(REPO, "pkgs", "nvshmem", "releases.json")
RESULTS = os.path.join(REPO, "kernels", "results")

KINDS = ("gpu-tests", "conformance", "bench", "nvshmem-matrix")
STATUSES = ("pass", "fail", "skip")
# The runner's suites (--suites) and the result rows each writes into a record
# (python/scripts/nvshmem_matrix.py): our GPU tests (python/tests/gpu) once per rank count, and
# DeepEP v1.2.1's two test files on our package and on DeepEP built against the release; besides
# these, a preflight row (one NVSHMEM per process), the DeepEP build's row, and a row named after
# the suite alone when the conformance script left no summary.
DEEPEP_TESTS = ("test_intranode.py", "test_low_latency.py")
SUITE_ROWS = {
    "ours": ("ours:python/tests/gpu",),
    "conformance": tuple("conformance:" + t for t in DEEPEP_TESTS),
    "deep-ep": tuple("deep-ep:" + t for t in DEEPEP_TESTS),
}
# The DeepEP test file whose passing row shows a mode of a `good` pairing.
MODE_TESTS = {"intranode": "test_intranode.py", "low-latency": "test_low_latency.py", "internode": "test_internode.py"}
# `good` entries recorded before kernels/results existed: (deepep, nvshmem, cudaMajor).
LEGACY_GOOD = {("1.2.1", "3.4.5", "13")}
MODES = ("intranode", "low-latency", "internode")
# hostLimits[].host values deepep-nix doctor applies (generator/src/doctor/deepep.rs, HostCondition)
HOST_CONDITIONS = ("no-rdma-device",)
VERSION = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+$")


def version_key(v):
    return tuple(int(x) for x in v.split("."))


# ---------------------------------------------------------------------------------------------
# Schema 2 of a GPU result record.


def _results_tool():
    """scripts/results.py, the project's one validator of result records."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("results_tool", os.path.join(REPO, "scripts", "results.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# A matrix row: the preflight, the DeepEP build, or a suite's test file, optionally with the
# variables of a --retry-env rerun ("deep-ep+NVSHMEM_REMOTE_TRANSPORT=none:test_low_latency.py").
ROW_NAME = re.compile(r"^(preflight:one-nvshmem-per-process|deep-ep:build|(ours|conformance|deep-ep)"
                      r"(\+[A-Z][A-Z0-9_]*=[^:,]*(,[A-Z][A-Z0-9_]*=[^:,]*)*)?(:(python/tests/gpu|test_intranode\.py|test_low_latency\.py))?)$")


def record_problems(rec, name=None):
    """Every way `rec` (parsed JSON) breaks schema 2 (scripts/results.py's validate, which stops at
    the first problem) or the matrix's row names, as readable lines (empty: valid)."""
    tool = _results_tool()
    path = name or "%s-%s-check.json" % (rec.get("date", "0000-00-00"), rec.get("kind", "unknown")) if isinstance(rec, dict) else "record.json"
    try:
        tool.validate(path, rec)
    except tool.RecordError as e:
        return [str(e)]
    out = []
    if rec["kind"] == "nvshmem-matrix":
        for i, row in enumerate(rec["results"]):
            if not ROW_NAME.match(row["suite"]):
                out.append(f"{path}: results[{i}] suite {row['suite']!r} is not a row the matrix runner writes")
    return out


def good_record():
    return {
        "schema": 2, "kind": "nvshmem-matrix", "date": "2026-12-03", "commit": "a" * 40,
        "machine": "1x NVIDIA H200", "machine_kind": "1xH200", "command": "python/scripts/nvshmem-matrix.sh --nvshmem /x",
        "nvshmem": "3.8.0", "runs": [{"suite": "python/scripts/nvshmem-matrix.sh", "part": None, "ranks": [2]}],
        "results": [
            {"suite": "deep-ep:build", "ranks": 0, "status": "pass", "seconds": 71.0, "first_error": None, "detail": ""},
            {"suite": "deep-ep:test_intranode.py", "ranks": 2, "status": "pass", "seconds": 40.0, "first_error": None, "detail": ""},
            {"suite": "deep-ep:test_low_latency.py", "ranks": 2, "status": "fail", "seconds": 3.5,
             "first_error": "nvshmem transport init failed", "detail": ""},
        ],
        "figures": [], "notes": "",
    }


def test_the_record_validator_rejects_what_schema_2_does_not_allow():
    assert record_problems(good_record()) == []
    bad = [
        ({"schema": 1}, "field 'schema': is 1"),
        ({"kind": "matrix"}, "field 'kind': is \"matrix\""),
        ({"date": "3 Dec 2026"}, "not a date YYYY-MM-DD"),
        ({"commit": "abc"}, "not a full 40-hex commit"),
        ({"nvshmem": "3.8"}, "not a release like"),
        ({"results": [{"suite": "deep-ep:test_intranode.py", "ranks": "2", "status": "pass", "seconds": 1,
                       "first_error": None, "detail": ""}]}, "results[0].ranks': is \"2\", not a whole number >= 0"),
        ({"results": [{"suite": "deep-ep:test_intranode.py", "ranks": 2, "status": "passed", "seconds": 1,
                       "first_error": None, "detail": ""}]}, "results[0].status': is \"passed\""),
        ({"results": [{"suite": "deep-ep:test_intranode.py", "ranks": 2, "status": "fail", "seconds": 1,
                       "first_error": None, "detail": ""}]}, "is empty for a failed row"),
        ({"results": [{"suite": "tests", "ranks": 2, "status": "pass", "seconds": 1,
                       "first_error": None, "detail": ""}]}, "suite 'tests' is not a row the matrix runner writes"),
        ({"extra": 1}, "field 'extra': unknown field"),
    ]
    for change, expect in bad:
        rec = dict(good_record(), **change)
        problems = record_problems(rec)
        assert any(expect in p for p in problems), (change, problems)
    rec = good_record()
    del rec["nvshmem"]
    assert any("a nvshmem-matrix record names the release" in p for p in record_problems(rec))
    # rows the runner writes, retries included, pass
    rec = good_record()
    rec["results"] = [dict(rec["results"][0], suite=s, ranks=2) for s in (
        "preflight:one-nvshmem-per-process", "ours:python/tests/gpu", "conformance:test_low_latency.py",
        "deep-ep+NVSHMEM_REMOTE_TRANSPORT=none:test_low_latency.py")]
    assert record_problems(rec) == [], record_problems(rec)


# ---------------------------------------------------------------------------------------------
# The pairing data against the release lock and the records.


def lock_releases():
    with open(RELEASES) as f:
        data = json.load(f)
    return {r["version"]: r["systems"] for r in data["releases"]}


def pairing_problems(pairings, releases, repo):
    """Every problem of `pairings` (parsed pkgs/deep-ep/pairings.json) against the lock's
    `releases` ({version: systems}) and the records under `repo`, as readable lines."""
    out = []

    def parse_range(where, r):
        if not isinstance(r, dict) or not r or set(r) - {"atLeast", "atMost"}:
            out.append(f"{where}: a range is an object of atLeast and/or atMost, got {r!r}")
            return None
        for k, v in r.items():
            if not isinstance(v, str) or not VERSION.match(v):
                out.append(f"{where}.{k}: {v!r} is not a version X.Y.Z")
                return None
        lo, hi = r.get("atLeast"), r.get("atMost")
        if lo and hi and version_key(lo) > version_key(hi):
            out.append(f"{where}: atLeast {lo} is above atMost {hi}, so it covers nothing")
        return (lo, hi)

    def covers(rng, v):
        lo, hi = rng
        return (lo is None or version_key(v) >= version_key(lo)) and (hi is None or version_key(v) <= version_key(hi))

    rules = []
    ids = set()
    for i, rule in enumerate(pairings.get("broken", [])):
        rid = rule.get("id") or f"broken[{i}]"
        if rid in ids:
            out.append(f"broken rule {rid}: id is not unique")
        ids.add(rid)
        d = parse_range(f"broken rule {rid}: deepep", rule.get("deepep"))
        n = parse_range(f"broken rule {rid}: nvshmem", rule.get("nvshmem"))
        modes = rule.get("modes") or []
        if not modes or any(m not in MODES for m in modes):
            out.append(f"broken rule {rid}: modes {modes!r} must be a non-empty list of {MODES}")
        if d and n:
            rules.append((rid, d, n, set(modes)))
    # hostLimits: the same fields plus `host` (the hosts it applies to; the doctor's
    # deepep.host-limits applies them, the Nix package does not); their ranges must parse, the
    # host must be one the doctor knows, and their sources must exist when they are records.
    for i, rule in enumerate(pairings.get("hostLimits", [])):
        rid = rule.get("id") or f"hostLimits[{i}]"
        parse_range(f"host limit {rid}: deepep", rule.get("deepep"))
        parse_range(f"host limit {rid}: nvshmem", rule.get("nvshmem"))
        if rule.get("host") not in HOST_CONDITIONS:
            out.append(f"host limit {rid}: host {rule.get('host')!r} must be one of {HOST_CONDITIONS}")
        for src in rule.get("sources", []):
            if src.startswith("kernels/results/") and not os.path.exists(os.path.join(repo, src.split()[0])):
                out.append(f"host limit {rid}: source {src} does not exist")

    for i, g in enumerate(pairings.get("good", [])):
        dv, nv, cuda = g.get("deepep"), g.get("nvshmem"), g.get("cudaMajor")
        where = f"good[{i}] (DeepEP {dv} x NVSHMEM {nv}, CUDA {cuda})"
        if not (isinstance(dv, str) and VERSION.match(dv)):
            out.append(f"{where}: deepep {dv!r} is not a version X.Y.Z")
        if nv not in releases:
            out.append(f"{where}: NVSHMEM {nv} is not a release in pkgs/nvshmem/releases.json ({', '.join(sorted(releases, key=version_key))})")
        elif not any(cuda in majors for majors in releases[nv].values()):
            out.append(f"{where}: NVSHMEM {nv} has no CUDA {cuda} build in pkgs/nvshmem/releases.json")
        modes = g.get("modes") or []
        if not modes or any(m not in MODES for m in modes):
            out.append(f"{where}: modes {modes!r} must be a non-empty list of {MODES}")
        for rid, d, n, broken_modes in rules:
            if isinstance(dv, str) and isinstance(nv, str) and VERSION.match(dv) and VERSION.match(nv) \
                    and covers(d, dv) and covers(n, nv) and broken_modes & set(modes):
                out.append(f"{where}: claims {sorted(broken_modes & set(modes))}, which broken rule {rid} refuses; "
                           f"narrow the rule's modes or ranges (pkgs/deep-ep/pairings.json) or drop the claim")
        if "record" not in g:
            if (dv, nv, cuda) not in LEGACY_GOOD:
                out.append(f"{where}: no \"record\": name its evidence, e.g. \"record\": "
                           f"\"kernels/results/<date>-nvshmem-matrix-{nv}.json\" (python/scripts/nvshmem-matrix.sh --record)")
            continue
        path = g["record"]
        if not isinstance(path, str) or not re.fullmatch(r"kernels/results/[0-9]{4}-[0-9]{2}-[0-9]{2}-nvshmem-matrix-[A-Za-z0-9._-]+\.json", path):
            out.append(f"{where}: record {path!r} is not kernels/results/<YYYY-MM-DD>-nvshmem-matrix-<slug>.json")
            continue
        full = os.path.join(repo, path)
        if not os.path.isfile(full):
            out.append(f"{where}: record {path} does not exist")
            continue
        try:
            with open(full) as f:
                rec = json.load(f)
        except ValueError as e:
            out.append(f"{where}: record {path} is not JSON: {e}")
            continue
        problems = record_problems(rec, path)
        if problems:
            out.extend(f"{where}: {p}" for p in problems)
            continue
        if rec["kind"] != "nvshmem-matrix":
            out.append(f"{where}: record {path} has kind {rec['kind']!r}, expected 'nvshmem-matrix'")
        if rec.get("nvshmem") != nv:
            out.append(f"{where}: record {path} ran NVSHMEM {rec.get('nvshmem')}, the entry claims {nv}")
        for m in modes:
            want = "deep-ep:" + MODE_TESTS.get(m, "?")
            rows = [r for r in rec["results"] if r["suite"] == want]
            if not rows:
                out.append(f"{where}: mode {m} claimed, but record {path} has no {want} row")
            elif not any(r["status"] == "pass" for r in rows) or any(r["status"] == "fail" for r in rows):
                out.append(f"{where}: mode {m} claimed, but {want} did not pass in record {path} "
                           f"({', '.join(r['status'] + ' at ' + str(r['ranks']) + ' ranks' for r in rows)})")
    return out


def load_pairings():
    with open(PAIRINGS) as f:
        return json.load(f)


def test_pairings_json_good_entries_are_shown_by_their_records_and_broken_ranges_parse():
    problems = pairing_problems(load_pairings(), lock_releases(), REPO)
    assert problems == [], "\n".join(problems)


def results_dir_problems(results):
    """Every record file in `results` (kernels/results/) that breaks schema 2 or is not named
    <YYYY-MM-DD>-<kind>-<slug>.json after its own date and kind."""
    problems = []
    for name in sorted(os.listdir(results)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(results, name)) as f:
                rec = json.load(f)
        except ValueError as e:
            problems.append(f"{name}: not JSON: {e}")
            continue
        # scripts/results.py's validate also checks the name against the record's date and kind
        problems += [name + ": " + p for p in record_problems(rec, name)]
    return problems


def test_every_record_in_kernels_results_is_schema_2_and_named_after_its_content():
    if not os.path.isdir(RESULTS):
        pytest.skip("no kernels/results/ in this checkout yet")
    problems = results_dir_problems(RESULTS)
    assert problems == [], "\n".join(problems)


def test_the_results_folder_check_finds_misnamed_and_invalid_records(tmp_path):
    rec = good_record()
    (tmp_path / "2026-12-03-nvshmem-matrix-3.8.0.json").write_text(json.dumps(rec))
    assert results_dir_problems(str(tmp_path)) == []
    (tmp_path / "2026-12-04-nvshmem-matrix-3.8.0.json").write_text(json.dumps(rec))
    (tmp_path / "2026-12-03-bench-3.8.0.json").write_text(json.dumps(rec))
    (tmp_path / "2026-12-03-nvshmem-matrix-.json").write_text(json.dumps(rec))
    (tmp_path / "2026-12-03-nvshmem-matrix-x.json").write_text(json.dumps(dict(rec, schema=1)))
    (tmp_path / "2026-12-03-nvshmem-matrix-y.json").write_text("{")
    problems = results_dir_problems(str(tmp_path))
    for name, expect in [("2026-12-04-nvshmem-matrix-3.8.0.json", "does not match the record's date and kind"),
                         ("2026-12-03-bench-3.8.0.json", "does not match the record's date and kind"),
                         ("2026-12-03-nvshmem-matrix-.json", "file name"),
                         ("2026-12-03-nvshmem-matrix-x.json", "field 'schema': is 1"),
                         ("2026-12-03-nvshmem-matrix-y.json", "not JSON")]:
        assert any(p.startswith(name + ":") and expect in p for p in problems), (name, problems)
    assert len(problems) == 5, problems


def test_the_pairing_check_finds_what_is_wrong(tmp_path):
    """pairing_problems against edited copies of the data: each mistake is named."""
    releases = lock_releases()
    (tmp_path / "kernels" / "results").mkdir(parents=True)
    rec_path = "kernels/results/2026-12-03-nvshmem-matrix-3.8.0.json"
    rec = good_record()
    (tmp_path / rec_path).write_text(json.dumps(rec))
    base = load_pairings()
    # Today's rules and the legacy 3.4.5 entry (no record) give no problem; the entries with
    # records are checked against the real folder by the test above.
    base["good"] = [g for g in base["good"] if "record" not in g]
    base.pop("hostLimits", None)
    assert pairing_problems(base, releases, str(tmp_path)) == []

    def with_good(entry, broken=None):
        p = json.loads(json.dumps(base))
        p["good"].append(entry)
        if broken is not None:
            p["broken"] = broken
        return pairing_problems(p, releases, str(tmp_path))

    entry = {"deepep": "1.2.1", "nvshmem": "3.8.0", "cudaMajor": "13", "modes": ["intranode"],
             "evidence": "x", "source": "x", "record": rec_path}
    # 3.8.0 intranode: shown by the record, and the RC-QP rule covers only internode and
    # low-latency.
    assert with_good(entry) == []
    # low-latency failed in the record, and the 3.5.19 rule refuses it anyway.
    problems = with_good(dict(entry, modes=["intranode", "low-latency"]))
    assert any("mode low-latency claimed, but deep-ep:test_low_latency.py did not pass" in p for p in problems), problems
    assert any("which broken rule rc-qp-layout-3.5.19 refuses" in p for p in problems), problems
    # A missing record field (not the legacy entry), a missing file, a release not in the lock,
    # a record of another release.
    no_record = {k: v for k, v in entry.items() if k != "record"}
    assert any('no "record"' in p for p in with_good(no_record))
    assert any("does not exist" in p for p in with_good(dict(entry, record="kernels/results/2026-12-04-nvshmem-matrix-3.8.0.json")))
    assert any("is not kernels/results/" in p for p in with_good(dict(entry, record="results/3.8.0.json")))
    assert any("is not a release in pkgs/nvshmem/releases.json" in p for p in with_good(dict(entry, nvshmem="3.9.9")))
    assert any("ran NVSHMEM 3.8.0, the entry claims 3.7.1" in p for p in with_good(dict(entry, nvshmem="3.7.1")))
    assert any("has no CUDA 11 build" in p for p in with_good(dict(entry, cudaMajor="11")))
    # Broken rules: ranges that do not parse.
    rule = dict(base["broken"][0])
    for rng, expect in [({"atLeast": "3.5"}, "'3.5' is not a version"), ({}, "a range is an object"),
                        ({"atleast": "3.5.19"}, "a range is an object"),
                        ({"atLeast": "3.8.0", "atMost": "3.5.19"}, "covers nothing")]:
        problems = pairing_problems(dict(base, broken=[dict(rule, nvshmem=rng)]), releases, str(tmp_path))
        assert any(expect in p for p in problems), (rng, problems)
    # Host limits: the host condition must be one the doctor applies.
    limit = dict(load_pairings()["hostLimits"][0], sources=[])
    assert pairing_problems(dict(base, hostLimits=[limit]), releases, str(tmp_path)) == []
    for host in (None, "no-infiniband"):
        bad = {k: v for k, v in limit.items() if k != "host"} if host is None else dict(limit, host=host)
        problems = pairing_problems(dict(base, hostLimits=[bad]), releases, str(tmp_path))
        assert any(f"host {host!r} must be one of" in p for p in problems), (host, problems)


# ---------------------------------------------------------------------------------------------
# The runner.

def runner(*args, cwd=REPO, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}
    return subprocess.run(["bash", RUNNER, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def nvshmem_prefix():
    """A real NVSHMEM prefix: the pinned pip toolchain's (NVSHMEM_DIR of build-wheel.sh, or
    .toolchain/nvidia/nvshmem)."""
    for d in (os.environ.get("NVSHMEM_DIR"), os.path.join(REPO, ".toolchain", "nvidia", "nvshmem")):
        if d and os.path.exists(os.path.join(d, "lib", "libnvshmem_host.so.3")):
            return d
    pytest.skip("no NVSHMEM prefix with lib/libnvshmem_host.so.3 (NVSHMEM_DIR, .toolchain/nvidia/nvshmem): "
                "scripts/install-toolchain.sh installs it")


def nvshmem_release(prefix):
    data = open(os.path.join(prefix, "lib", "libnvshmem_host.so.3"), "rb").read()
    m = re.search(rb"NVSHMEM v([0-9]+\.[0-9]+\.[0-9]+)", data)
    assert m, f"no NVSHMEM version banner in {prefix}/lib/libnvshmem_host.so.3"
    return m.group(1).decode()


def a_wheel(tmp_path):
    """The wheel build-wheel.sh --test built (DEEPEP_KERNELS_WHEEL), else a stand-in zip named
    like one (the dry run installs nothing)."""
    w = os.environ.get("DEEPEP_KERNELS_WHEEL")
    if w and os.path.isfile(w):
        return w
    path = tmp_path / "deepep_kernels-0.1.0-cp310-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("deepep_kernels/__init__.py", "")
    return str(path)


def test_runner_help_names_every_option():
    p = runner("--help")
    assert p.returncode == 0, p.stderr
    text = p.stdout + p.stderr
    for opt in ("--nvshmem", "--wheel", "--deep-ep-src", "--deep-ep-site", "--suites", "--ranks",
                "--record", "--out", "--dry-run"):
        assert opt in text, (opt, text)
    for suite in SUITE_ROWS:
        assert suite in text, (suite, text)


def deep_ep_checkout(tmp_path):
    """A stand-in DeepEP checkout: setup.py and the two test files the runner asks for (the dry
    run only checks that they are there; nothing is built or run)."""
    d = tmp_path / "DeepEP"
    (d / "tests").mkdir(parents=True)
    (d / "setup.py").write_text("raise SystemExit('not to be run by a dry run')\n")
    for t in DEEPEP_TESTS:
        (d / "tests" / t).write_text("raise SystemExit('not to be run by a dry run')\n")
    return str(d)


def test_runner_refuses_bad_arguments_with_a_clear_message(tmp_path):
    prefix = nvshmem_prefix()
    wheel = a_wheel(tmp_path)
    src = deep_ep_checkout(tmp_path)
    ok = ("--nvshmem", prefix, "--wheel", wheel, "--dry-run")
    cases = [
        ((), "--nvshmem"),
        (ok + ("--bogus",), "--bogus"),
        (("--nvshmem", str(tmp_path / "none"), "--wheel", wheel, "--dry-run"), str(tmp_path / "none")),
        (("--nvshmem", prefix, "--wheel", str(tmp_path / "no.whl"), "--dry-run"), str(tmp_path / "no.whl")),
        (ok + ("--suites", "ours,bogus"), "bogus"),
        (ok + ("--ranks", "2 x"), "2 x"),
        (ok + ("--ranks", "1"), "at least 2"),
        (ok + ("--suites", "deep-ep"), "--deep-ep-src"),
        (ok + ("--suites", "conformance", "--deep-ep-src", str(tmp_path)), "tests/test_intranode.py"),
        (ok + ("--deep-ep-src", src, "--deep-ep-site", str(tmp_path)), "--deep-ep-site"),
        (ok + ("--suites", "deep-ep", "--deep-ep-site", str(tmp_path), "--deep-ep-tests", src), "no deep_ep/"),
    ]
    for args, named in cases:
        p = runner(*args)
        assert p.returncode == 2, (args, p.returncode, p.stdout, p.stderr)
        assert named in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr, (args, p.stderr)
        assert not os.path.exists(tmp_path / "matrix-logs" / "record.json")


def test_runner_dry_run_writes_a_valid_record_naming_the_release(tmp_path):
    prefix = nvshmem_prefix()
    release = nvshmem_release(prefix)
    record = tmp_path / "record.json"
    p = runner("--nvshmem", prefix, "--wheel", a_wheel(tmp_path), "--deep-ep-src", deep_ep_checkout(tmp_path),
               "--suites", "ours,conformance,deep-ep", "--ranks", "2 4", "--record", str(record),
               "--out", str(tmp_path / "out"), "--dry-run")
    assert p.returncode == 0, p.stderr
    assert release in p.stdout, p.stdout
    rec = json.loads(record.read_text())
    assert record_problems(rec) == [], record_problems(rec)
    assert rec["kind"] == "nvshmem-matrix"
    assert rec["nvshmem"] == release
    assert "--dry-run" in rec["command"]
    rows = rec["results"]
    assert rows and all(r["status"] == "skip" and r["detail"] == "dry run" for r in rows), rows
    assert {r["suite"] for r in rows} == {n for rows_ in SUITE_ROWS.values() for n in rows_}, rows
    # Our tests at each rank count asked for; DeepEP's test files at 2 ranks.
    assert sorted(r["ranks"] for r in rows if r["suite"] == "ours:python/tests/gpu") == [2, 4], rows
    assert {r["ranks"] for r in rows if not r["suite"].startswith("ours:")} == {2}, rows
    # Nothing of DeepEP was built or run.
    assert not os.path.exists(tmp_path / "out" / "deep-ep-build.log")
    # Without --record: the same plan, no file.
    p = runner("--nvshmem", prefix, "--wheel", a_wheel(tmp_path), "--suites", "ours", "--dry-run",
               "--out", str(tmp_path / "out2"))
    assert p.returncode == 0, p.stderr
    assert "ours:python/tests/gpu" in p.stdout, p.stdout
