"""Tests of scripts/results.py (GPU results as data): the repository's own records are valid and
every doc's rendered tables match them (the CI check), a bad record is refused with a message
naming the file, the field and the fix, tables render as documented, and --check catches drift.
Real files in temporary repositories; nothing is mocked."""

import json
import os
import runpy
import subprocess
import sys
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(REPO, "scripts", "results.py")
COMMIT = "4cbe359ae4f753015bd818f75016fd31add7d415"


# the script's functions, without running its main (run_path sets another __name__)
results = types.SimpleNamespace(**runpy.run_path(SCRIPT))


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def record(kind="gpu-tests", date="2026-12-03", **over):
    r = {"schema": 1, "kind": kind, "date": date, "commit": COMMIT,
         "machine": "1x NVIDIA H200 (driver 580.159.04), CUDA 13.0", "command": "kernels/scripts/gpu-oversub.sh",
         "results": [{"suite": "deepep-gpu-tests", "ranks": 2, "status": "pass", "seconds": 41.2,
                      "first_error": None, "detail": "37 passed"}],
         "figures": [], "notes": ""}
    r.update(over)
    return r


def repo(tmp_path, records, doc):
    """A repository with kernels/results/<name>.json for each (name, record) and kernels/DOC.md."""
    d = tmp_path / "repo"
    (d / "kernels" / "results").mkdir(parents=True)
    for name, rec in records:
        (d / "kernels" / "results" / name).write_text(json.dumps(rec) if not isinstance(rec, str) else rec)
    (d / "kernels" / "DOC.md").write_text(doc)
    return d


def test_the_repository_records_are_valid_and_the_docs_match_them():
    p = run("--check")
    assert p.returncode == 0, p.stderr
    assert "every doc's tables match the records" in p.stdout
    names = os.listdir(os.path.join(REPO, "kernels", "results"))
    assert any(n.endswith(".json") for n in names)
    # each reference doc renders from the records: it holds marker blocks, and at least one row
    for doc in ("kernels/TESTING.md", "kernels/BENCHMARKS.md"):
        with open(os.path.join(REPO, doc)) as f:
            text = f.read()
        assert "<!-- results:table" in text and ("Provenance: commit `" in text or "- [1] commit `" in text)


@pytest.mark.parametrize("change, field, fix", [
    (lambda r: r.pop("machine"), "'machine': missing", "add \"machine\""),
    (lambda r: r.update(commit="4cbe359"), "'commit'", "git rev-parse HEAD"),
    (lambda r: r.update(kind="benchmark"), "'kind'", "use one of gpu-tests, conformance, bench, nvshmem-matrix"),
    (lambda r: r.update(date="2026-13-01"), "'date'", "YYYY-MM-DD"),
    (lambda r: r.update(extra=1), "'extra': unknown field", "remove it"),
    (lambda r: r["results"][0].update(status="passed"), "'results[0].status'", "use one of pass, fail, skip"),
    (lambda r: r["results"][0].update(status="fail"), "'results[0].first_error'", "quote the first error line"),
    (lambda r: r["results"][0].update(ranks=-1), "'results[0].ranks'", "write the number of ranks"),
    (lambda r: r.update(figures=[{"name": "x", "value": "12", "unit": "us", "baseline": None,
                                  "baseline_value": None, "note": ""}]), "'figures[0].value'", "write the measured number"),
    (lambda r: r.update(figures=[{"name": "x", "value": 1.0, "unit": "us", "baseline": "NCCL",
                                  "baseline_value": None, "note": ""}]), "'figures[0].baseline_value'", "set both or neither"),
])
def test_a_bad_record_is_refused_naming_file_field_and_fix(tmp_path, change, field, fix):
    rec = record()
    change(rec)
    path = tmp_path / "2026-12-03-gpu-tests-h200.json"
    path.write_text(json.dumps(rec))
    p = run("validate", str(path))
    assert p.returncode == 1
    assert str(path) in p.stderr and field in p.stderr and "fix: " in p.stderr and fix in p.stderr, p.stderr


def test_the_file_name_must_carry_the_records_date_and_kind(tmp_path):
    path = tmp_path / "2026-12-04-bench-h200.json"
    path.write_text(json.dumps(record()))
    p = run("validate", str(path))
    assert p.returncode == 1
    assert "does not match the record's date and kind" in p.stderr and "2026-12-03-gpu-tests-<slug>.json" in p.stderr


def test_a_valid_record_passes_validation(tmp_path):
    path = tmp_path / "2026-12-03-gpu-tests-h200.json"
    path.write_text(json.dumps(record()))
    p = run("validate", str(path))
    assert p.returncode == 0 and p.stdout.startswith("ok "), p.stderr


def test_an_invalid_record_in_the_tree_fails_the_check(tmp_path):
    bad = record()
    del bad["notes"]
    d = repo(tmp_path, [("2026-12-03-gpu-tests-h200.json", bad)], "no tables\n")
    p = run("--check", "--root", str(d))
    assert p.returncode == 1 and "field 'notes': missing" in p.stderr


def test_rows_render_latest_per_suite_and_ranks_with_provenance(tmp_path):
    old = record(date="2026-12-01", results=[
        {"suite": "deepep-gpu-tests", "ranks": 2, "status": "fail", "seconds": None, "first_error": "case x timed out", "detail": ""},
        {"suite": "deepep-gpu-tests", "ranks": 4, "status": "pass", "seconds": 60, "first_error": None, "detail": "40 passed"},
        {"suite": "python/tests/gpu::t", "ranks": 2, "status": "pass", "seconds": 1, "first_error": None, "detail": ""}])
    new = record(date="2026-12-03", commit="6d560a1e534996c6fb16e057e699f5fdffb37255")
    doc = "# T\n\n<!-- results:table gpu-tests suite=deepep-gpu-tests -->\nstale\n<!-- /results -->\n\nafter\n"
    d = repo(tmp_path, [("2026-12-01-gpu-tests-a.json", old), ("2026-12-03-gpu-tests-b.json", new)], doc)
    p = run("--root", str(d))
    assert p.returncode == 0, p.stderr
    text = (d / "kernels" / "DOC.md").read_text()
    assert "stale" not in text and text.endswith("<!-- /results -->\n\nafter\n")
    rows = [l for l in text.splitlines() if l.startswith("| deepep")]
    # the later record replaces the 2-rank failure; the 4-rank row stays from the older record
    assert rows == ["| deepep-gpu-tests | 2 | PASS | 41.2 | - | 37 passed | [1] |",
                    "| deepep-gpu-tests | 4 | PASS | 60 | - | 40 passed | [2] |"]
    assert "python/tests/gpu::t" not in text  # filtered out by suite=
    assert "- [1] commit `6d560a1`, 2026-12-03, 1x NVIDIA H200 (driver 580.159.04), CUDA 13.0; `kernels/scripts/gpu-oversub.sh` (record [`2026-12-03-gpu-tests-b`](results/2026-12-03-gpu-tests-b.json))" in text
    assert "- [2] commit `4cbe359`, 2026-12-01" in text
    # a second run changes nothing, and --check agrees
    assert run("--root", str(d)).stdout == ""
    assert run("--check", "--root", str(d)).returncode == 0


def test_check_catches_drift_between_a_record_and_its_doc(tmp_path):
    fig = {"name": "LL dispatch FP8, device time", "value": 15.4, "unit": "us", "baseline": "DeepEP v1.2.1, same run",
           "baseline_value": 18.3, "note": ""}
    rec = record(kind="bench", results=[], figures=[fig])
    doc = "<!-- results:table bench record=2026-12-03-bench-h200 -->\n<!-- /results -->\n"
    d = repo(tmp_path, [("2026-12-03-bench-h200.json", rec)], doc)
    assert run("--root", str(d)).returncode == 0
    text = (d / "kernels" / "DOC.md").read_text()
    assert "| LL dispatch FP8, device time | 15.4 us | DeepEP v1.2.1, same run | 18.3 us | 0.84 | - |" in text
    assert "Provenance: commit `4cbe359`, 2026-12-03" in text
    assert run("--check", "--root", str(d)).returncode == 0
    # the figure changes in the record: the doc is now stale and --check says which doc and the fix
    fig["value"] = 14.9
    (d / "kernels" / "results" / "2026-12-03-bench-h200.json").write_text(json.dumps(rec))
    p = run("--check", "--root", str(d))
    assert p.returncode == 1
    assert "kernels/DOC.md: its results tables differ from kernels/results/" in p.stderr
    assert "fix: run scripts/results.py" in p.stderr
    # a hand edit of a rendered table is drift too
    assert run("--root", str(d)).returncode == 0
    (d / "kernels" / "DOC.md").write_text((d / "kernels" / "DOC.md").read_text().replace("14.9 us", "13.0 us"))
    assert run("--check", "--root", str(d)).returncode == 1


def test_no_record_of_a_kind_yet_renders_a_sentence(tmp_path):
    doc = "<!-- results:table nvshmem-matrix -->\n<!-- /results -->\n"
    d = repo(tmp_path, [], doc)
    assert run("--root", str(d)).returncode == 0
    assert "No record yet (nvshmem-matrix records under kernels/results/)." in (d / "kernels" / "DOC.md").read_text()


def test_nvshmem_matrix_rows_per_release_suite_and_ranks(tmp_path):
    rows = lambda st, err: [{"suite": "ours-gpu-tests", "ranks": 2, "status": st, "seconds": 41.2, "first_error": err, "detail": ""}]
    recs = [("2026-12-03-nvshmem-matrix-3.8.0.json", record(kind="nvshmem-matrix", nvshmem="3.8.0", results=rows("fail", "nvshmem_init failed"))),
            ("2026-12-03-nvshmem-matrix-3.4.5.json", record(kind="nvshmem-matrix", nvshmem="3.4.5", results=rows("pass", None))),
            ("2026-12-03-nvshmem-matrix-3.10.0.json", record(kind="nvshmem-matrix", nvshmem="3.10.0", results=rows("pass", None)))]
    d = repo(tmp_path, recs, "<!-- results:table nvshmem-matrix -->\n<!-- /results -->\n")
    assert run("--root", str(d)).returncode == 0, run("--root", str(d)).stderr
    text = (d / "kernels" / "DOC.md").read_text()
    got = [l.split(" | ")[0:4] for l in text.splitlines() if l.startswith("| 3.")]
    # releases sort as versions (3.10.0 after 3.8.0), each release keeps its own row
    assert got == [["| 3.4.5", "ours-gpu-tests", "2", "PASS"], ["| 3.8.0", "ours-gpu-tests", "2", "FAIL"],
                   ["| 3.10.0", "ours-gpu-tests", "2", "PASS"]]
    assert "nvshmem_init failed" in text and ", NVSHMEM 3.8.0;" in text


def test_a_nvshmem_matrix_record_needs_its_release(tmp_path):
    path = tmp_path / "2026-12-03-nvshmem-matrix-x.json"
    path.write_text(json.dumps(record(kind="nvshmem-matrix")))
    p = run("validate", str(path))
    assert p.returncode == 1 and "'nvshmem': missing" in p.stderr


def test_marker_errors_name_the_doc_and_the_fix(tmp_path):
    d = repo(tmp_path, [], "<!-- results:table bench record=nope -->\n<!-- /results -->\n")
    p = run("--check", "--root", str(d))
    assert p.returncode == 1 and "DOC.md: table 'bench record=nope': no record kernels/results/nope.json" in p.stderr
    d2 = repo(tmp_path / "b", [], "<!-- results:table gpu-tests -->\nno end\n")
    p = run("--check", "--root", str(d2))
    assert p.returncode == 1 and "has no '<!-- /results -->' after it" in p.stderr


def test_new_writes_a_valid_record_and_refuses_a_bad_one(tmp_path):
    p = run("new", "--kind", "gpu-tests", "--commit", COMMIT, "--machine", "1x H200", "--command", "x.sh",
            "--date", "2026-12-03", "--slug", "h200", "--out", str(tmp_path),
            "--result", "deepep-gpu-tests:8:pass:41.2:32 passed", "--result", "deepep-gpu-tests:4:fail:-:case y timed out")
    assert p.returncode == 0, p.stderr
    path = tmp_path / "2026-12-03-gpu-tests-h200.json"
    assert p.stdout.strip() == str(path)
    rec = results.validate(str(path))
    assert rec["results"][0] == {"suite": "deepep-gpu-tests", "ranks": 8, "status": "pass", "seconds": 41.2,
                                 "first_error": None, "detail": "32 passed"}
    assert rec["results"][1]["first_error"] == "case y timed out" and rec["results"][1]["seconds"] is None
    p = run("new", "--kind", "gpu-tests", "--commit", "abc", "--machine", "m", "--command", "c", "--out", str(tmp_path))
    assert p.returncode == 1 and "'commit'" in p.stderr
    assert not any(f.name != "2026-12-03-gpu-tests-h200.json" for f in tmp_path.iterdir())


PYTEST_LOG = """\
python/tests/gpu/test_gpu.py::test_intranode_layout_dispatch_combine FAILED [ 33%]
python/tests/gpu/test_gpu.py::test_low_latency_dispatch_combine_hooks_graphs PASSED [ 66%]
python/tests/gpu/test_gpu.py::test_peer_that_stops_calling_is_reported_not_partial_rows SKIPPED [100%]

=================================== FAILURES ===================================
____________________ test_intranode_layout_dispatch_combine ____________________
E       torch.multiprocessing.spawn.ProcessRaisedException:
E       -- Process 0 terminated with the following error:
E           assert not all(in_arena), f"the arena never filled"
E       AssertionError: the arena (30971904 bytes) never filled in 32 dispatches of 197 rows
=================== 1 failed, 1 passed, 1 skipped in 32.31s ====================
"""

SUMMARY = """\
library test                   nproc  result   seconds  log
ours    test_low_latency.py        2  PASS          24  ours-test_low_latency-2.log
ours    test_internode.py        2x8  PASS         183  ours-test_internode-2x8.log
deepep  test_intranode.py          8  TIMEOUT      183  deepep-test_intranode-8.log
ours    test_low_latency.py        4  FAIL(1)       10  ours-test_low_latency-4.log
        raise ProcessRaisedException(msg, error_index, failed_process.pid)
    RuntimeError: NVSHMEM: rank 0: no transport. Fix: allow NVLink
"""


def test_a_record_from_the_pytest_logs_of_gpu_run(tmp_path):
    (tmp_path / "gpu-ranks8.log").write_text(PYTEST_LOG)
    p = run("from-pytest", str(tmp_path / "gpu-ranks8.log"), "--commit", COMMIT, "--machine", "1x H200",
            "--command", "python/scripts/gpu-run.sh target/wheels 8", "--date", "2026-12-03", "--slug", "h200",
            "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rec = results.validate(p.stdout.strip())
    assert [(r["suite"], r["ranks"], r["status"], r["first_error"]) for r in rec["results"]] == [
        ("python/tests/gpu::test_intranode_layout_dispatch_combine", 8, "fail",
         "AssertionError: the arena (30971904 bytes) never filled in 32 dispatches of 197 rows"),
        ("python/tests/gpu::test_low_latency_dispatch_combine_hooks_graphs", 8, "pass", None),
        ("python/tests/gpu::test_peer_that_stops_calling_is_reported_not_partial_rows", 8, "skip", None)]
    # a log without test lines is not a record
    (tmp_path / "gpu-ranks2.log").write_text("ImportError: no torch\n")
    p = run("from-pytest", str(tmp_path / "gpu-ranks2.log"), "--commit", COMMIT, "--machine", "m", "--command", "c",
            "--out", str(tmp_path / "none"))
    assert p.returncode == 1 and "no test results in" in p.stderr and not (tmp_path / "none").exists()


def test_a_record_from_the_summary_of_deepep_conformance(tmp_path):
    (tmp_path / "summary.txt").write_text(SUMMARY)
    p = run("from-conformance", str(tmp_path / "summary.txt"), "--commit", COMMIT, "--machine", "1x H200",
            "--command", "python/scripts/deepep-conformance.sh ...", "--date", "2026-12-03", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rec = results.validate(p.stdout.strip())
    assert rec["kind"] == "conformance" and p.stdout.strip().endswith("2026-12-03-conformance-run.json")
    assert [(r["suite"], r["ranks"], r["status"], r["seconds"], r["first_error"]) for r in rec["results"]] == [
        ("ours: test_low_latency.py", 2, "pass", 24.0, None),
        ("ours: test_internode.py, 2 emulated hosts x 8 ranks", 16, "pass", 183.0, None),
        ("DeepEP: test_intranode.py", 8, "fail", 183.0, "TIMEOUT"),
        ("ours: test_low_latency.py", 4, "fail", 10.0, "RuntimeError: NVSHMEM: rank 0: no transport. Fix: allow NVLink")]


def test_the_gpu_scripts_write_records_through_this_tool():
    # RECORD=1 in the two GPU scripts calls these subcommands with the logs they wrote
    for script, sub, logs in (("python/scripts/gpu-run.sh", "from-pytest", '"$out"/gpu-ranks*.log'),
                              ("python/scripts/deepep-conformance.sh", "from-conformance", '"$out/summary.txt"')):
        with open(os.path.join(REPO, script)) as f:
            text = f.read()
        assert f'scripts/results.py" {sub} {logs}' in text, script
        assert 'if [ "${RECORD:-0}" = 1 ]' in text and "RECORD=1" in text.split("set -uo pipefail")[0], script
