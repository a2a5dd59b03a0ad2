"""Tests of scripts/results.py (GPU results as data): the repository's own records are valid,
current or cited, and every doc's rendered tables match them (the CI check), a bad record is
refused with a message naming the file, the field and the fix, tables render as documented,
--check catches drift, and the retention rule keeps the latest record per suite and machine kind
(by date, then commit order in git, then time; never by file name) plus the cited ones.
Real files in temporary repositories (git ones where commit order matters); nothing is mocked."""

import json
import os
import re
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


def record_from_log(tmp_path, subcommand, log, text, *args):
    """Writes TEXT to tmp_path/LOG, runs `results.py SUBCOMMAND LOG ARGS... --out tmp_path`, which
    must succeed, and returns the record it wrote (validated) and the path it printed."""
    (tmp_path / log).write_text(text)
    p = run(subcommand, str(tmp_path / log), *args, "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    path = p.stdout.strip()
    return results.validate(path), path


def record(kind="gpu-tests", date="2026-12-03", **over):
    r = {"schema": 2, "kind": kind, "date": date, "commit": COMMIT,
         "machine": "1x NVIDIA H200 (driver 580.159.04), CUDA 13.0", "machine_kind": "1xH200",
         "command": "kernels/scripts/gpu-oversub.sh",
         "runs": [{"suite": "deepep-gpu-tests", "part": None, "ranks": [2]}],
         "results": [{"suite": "deepep-gpu-tests", "ranks": 2, "status": "pass", "seconds": 41.2,
                      "first_error": None, "detail": "37 passed"}],
         "figures": [], "notes": ""}
    r.update(over)
    return r


def git_commits(path, n):
    """A git repository at `path` with n commits in a line; their hashes, oldest first."""
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.org")
    git = ["git", "-C", str(path), "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    out = []
    for i in range(n):
        subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", f"c{i}"], check=True, env=env)
        out.append(subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip())
    return out


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
    assert "every record is valid, current or cited, and every doc's tables match the records" in p.stdout
    # and nothing is left to prune
    p = run("prune")
    assert p.returncode == 0 and ", 0 to remove" in p.stdout, p.stdout + p.stderr
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
    (lambda r: r.update(schema=1), "'schema': is 1", "migrate it: add \"machine_kind\" and \"runs\""),
    (lambda r: r.pop("runs"), "'runs': missing", "add \"runs\""),
    (lambda r: r.update(runs=[]), "'runs': is empty", "name what the command ran"),
    (lambda r: r["runs"][0].update(ranks=[]), "'runs[0].ranks'", "list the rank counts the command ran"),
    (lambda r: r["runs"][0].update(ranks=[2, 2]), "'runs[0].ranks'", "list each rank count once"),
    (lambda r: r["runs"][0].update(part=""), "'runs[0].part'", "null for a whole run"),
    (lambda r: r["runs"][0].pop("part"), "'runs[0].part': missing", "null for part"),
    (lambda r: r.update(runs=[r["runs"][0], dict(r["runs"][0], ranks=[4])]), "'runs[1].suite'", "give each suite one run"),
    (lambda r: r.pop("machine_kind"), "'machine_kind': missing", "add \"machine_kind\""),
    (lambda r: r.update(machine_kind="H200"), "'machine_kind'", "e.g. \"1xH200\""),
    (lambda r: r.update(machine_kind="2xH200"), "but \"machine\" says 1xH200", "write \"1xH200\""),
    (lambda r: r.update(time="25:00"), "'time'", "the UTC time the run started"),
    (lambda r: r["results"][0].update(detail="first Buffer: RuntimeError: destroy() failed"),
     "'results[0].detail': quotes an error in a passing row", "quote the error in \"first_error\""),
    (lambda r: r["results"][0].update(first_error="boom"), "'results[0].first_error': is set for a pass row", "null unless the row failed"),
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
    old = record(date="2026-12-01", runs=[{"suite": "deepep-gpu-tests", "part": None, "ranks": [2, 4]},
                                          {"suite": "python/tests/gpu", "part": None, "ranks": [2]}], results=[
        {"suite": "deepep-gpu-tests", "ranks": 2, "status": "fail", "seconds": None, "first_error": "case x timed out", "detail": ""},
        {"suite": "deepep-gpu-tests", "ranks": 4, "status": "pass", "seconds": 60, "first_error": None, "detail": "40 passed"},
        {"suite": "python/tests/gpu::t", "ranks": 2, "status": "pass", "seconds": 1, "first_error": None, "detail": ""}])
    new = record(date="2026-12-03", commit="6d560a1e534996c6fb16e057e699f5fdffb37255")
    # the latest of all, on another machine kind: its row stands beside the H200's, replacing none
    h100 = record(date="2026-12-04", machine="1x NVIDIA H100 80GB HBM3", machine_kind="1xH100", results=[
        {"suite": "deepep-gpu-tests", "ranks": 2, "status": "skip", "seconds": None, "first_error": None, "detail": "cut off"}])
    doc = "# T\n\n<!-- results:table gpu-tests suite=deepep-gpu-tests -->\nstale\n<!-- /results -->\n\nafter\n"
    d = repo(tmp_path, [("2026-12-01-gpu-tests-a.json", old), ("2026-12-03-gpu-tests-b.json", new),
                        ("2026-12-04-gpu-tests-c.json", h100)], doc)
    p = run("--root", str(d))
    assert p.returncode == 0, p.stderr
    text = (d / "kernels" / "DOC.md").read_text()
    assert "stale" not in text and text.endswith("<!-- /results -->\n\nafter\n")
    rows = [l for l in text.splitlines() if l.startswith("| deepep")]
    # the later record replaces the 2-rank failure; the 4-rank row stays from the older record; the
    # H100's skip does not hide the H200's pass
    assert rows == ["| deepep-gpu-tests | 2 | 1xH100 | SKIP | - | - | cut off | [1] |",
                    "| deepep-gpu-tests | 2 | 1xH200 | PASS | 41.2 | - | 37 passed | [2] |",
                    "| deepep-gpu-tests | 4 | 1xH200 | PASS | 60 | - | 40 passed | [3] |"]
    assert "python/tests/gpu::t" not in text  # filtered out by suite=
    assert "- [2] commit `6d560a1`, 2026-12-03, 1x NVIDIA H200 (driver 580.159.04), CUDA 13.0; `kernels/scripts/gpu-oversub.sh` (record [`2026-12-03-gpu-tests-b`](results/2026-12-03-gpu-tests-b.json))" in text
    assert "- [3] commit `4cbe359`, 2026-12-01" in text
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
    p = check_fails(d)
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
    assert got == [["| 3.4.5", "ours-gpu-tests", "2", "1xH200"], ["| 3.8.0", "ours-gpu-tests", "2", "1xH200"],
                   ["| 3.10.0", "ours-gpu-tests", "2", "1xH200"]]
    assert [l.split(" | ")[4] for l in text.splitlines() if l.startswith("| 3.")] == ["PASS", "FAIL", "PASS"]
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
    p = run("new", "--kind", "gpu-tests", "--commit", COMMIT, "--machine", "1x NVIDIA H200", "--command", "x.sh",
            "--date", "2026-12-03", "--slug", "h200", "--out", str(tmp_path),
            "--result", "deepep-gpu-tests:8:pass:41.2:32 passed", "--result", "deepep-gpu-tests:4:fail:-:case y timed out")
    assert p.returncode == 0, p.stderr
    path = tmp_path / "2026-12-03-gpu-tests-h200.json"
    assert p.stdout.strip() == str(path)
    rec = results.validate(str(path))
    assert rec["results"][0] == {"suite": "deepep-gpu-tests", "ranks": 8, "status": "pass", "seconds": 41.2,
                                 "first_error": None, "detail": "32 passed"}
    # the run is named from the rows; the machine kind from --machine; --date given: no time
    assert rec["runs"] == [{"suite": "deepep-gpu-tests", "part": None, "ranks": [4, 8]}]
    assert rec["machine_kind"] == "1xH200" and "time" not in rec
    assert rec["results"][1]["first_error"] == "case y timed out" and rec["results"][1]["seconds"] is None
    p = run("new", "--kind", "gpu-tests", "--commit", "abc", "--machine", "1x NVIDIA H200", "--command", "c",
            "--suite", "deepep-gpu-tests", "--ranks", "2", "--out", str(tmp_path))
    assert p.returncode == 1 and "'commit'" in p.stderr
    # a record that names nothing it ran, a machine whose kind cannot be read: usage errors naming the fix
    p = run("new", "--kind", "bench", "--commit", COMMIT, "--machine", "1x NVIDIA H200", "--command", "c", "--out", str(tmp_path))
    assert p.returncode == 2 and "names no suite; fix: pass --suite NAME --ranks R" in p.stderr
    p = run("new", "--kind", "bench", "--commit", COMMIT, "--machine", "an H200", "--command", "c", "--suite", "b",
            "--ranks", "1", "--out", str(tmp_path))
    assert p.returncode == 2 and "fix: pass --machine-kind, e.g. 1xH200" in p.stderr
    assert not any(f.name != "2026-12-03-gpu-tests-h200.json" for f in tmp_path.iterdir())


PYTEST_LOG = """\
python/tests/gpu/test_gpu.py::test_intranode_layout_dispatch_combine FAILED [ 33%]
python/tests/gpu/test_gpu.py::test_low_latency_dispatch_combine_hooks_graphs PASSED [ 66%]
python/tests/gpu/test_gpu.py::test_peer_that_stops_calling_is_reported_not_partial_rows SKIPPED [100%]
python/tests/gpu/test_calls.py::test_calls_into_the_extension[intranode] FAILED [  3%]
python/tests/gpu/test_calls.py::test_calls_into_the_extension[low_latency] PASSED [  6%]

=================================== FAILURES ===================================
____________________ test_intranode_layout_dispatch_combine ____________________
E       torch.multiprocessing.spawn.ProcessRaisedException:
E       -- Process 0 terminated with the following error:
E           assert not all(in_arena), f"the arena never filled"
E       AssertionError: the arena (30971904 bytes) never filled in 32 dispatches of 197 rows
___________________ test_calls_into_the_extension[intranode] ___________________
E               torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGSEGV
=================== 2 failed, 2 passed, 1 skipped in 32.31s ====================
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
    rec, _ = record_from_log(tmp_path, "from-pytest", "gpu-ranks8.log", PYTEST_LOG, "--commit", COMMIT,
                             "--machine", "1x NVIDIA H200", "--command", "python/scripts/gpu-run.sh target/wheels 8",
                             "--date", "2026-12-03", "--slug", "h200")
    assert [(r["suite"], r["ranks"], r["status"], r["first_error"]) for r in rec["results"]] == [
        ("python/tests/gpu::test_intranode_layout_dispatch_combine", 8, "fail",
         "AssertionError: the arena (30971904 bytes) never filled in 32 dispatches of 197 rows"),
        ("python/tests/gpu::test_low_latency_dispatch_combine_hooks_graphs", 8, "pass", None),
        ("python/tests/gpu::test_peer_that_stops_calling_is_reported_not_partial_rows", 8, "skip", None),
        # a parametrized test: one row per parameter, each with its own error
        ("python/tests/gpu::test_calls_into_the_extension[intranode]", 8, "fail",
         "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGSEGV"),
        ("python/tests/gpu::test_calls_into_the_extension[low_latency]", 8, "pass", None)]
    assert rec["runs"] == [{"suite": "python/tests/gpu", "part": None, "ranks": [8]}] and rec["machine_kind"] == "1xH200"
    # a log without test lines is not a record
    (tmp_path / "gpu-ranks2.log").write_text("ImportError: no torch\n")
    p = run("from-pytest", str(tmp_path / "gpu-ranks2.log"), "--commit", COMMIT, "--machine", "m", "--machine-kind", "1xH200", "--command", "c",
            "--out", str(tmp_path / "none"))
    assert p.returncode == 1 and "no test results in" in p.stderr and not (tmp_path / "none").exists()


# Shaped like a real failure (2 ranks on one H100, record 2026-12-07-gpu-tests-1xh100-2-ranks-184a354):
# rank 1 failed first and printed its traceback first; torch's spawn reported rank 0, whose
# all_gather then lost its peer. The captured stderr comes after pytest's E lines.
SPAWN_LOG = """\
python/tests/gpu/test_gpu.py::test_deepep_semantics_handles_without_topk_zero_copy FAILED [ 55%]
python/tests/gpu/test_gpu.py::test_peer_that_stops_calling_is_reported_not_partial_rows PASSED [ 58%]

=================================== FAILURES ===================================
_____________ test_deepep_semantics_handles_without_topk_zero_copy _____________
E       torch.multiprocessing.spawn.ProcessRaisedException:
E       -- Process 0 terminated with the following error:
E       RuntimeError: rendezvous: the process group's all_gather failed: Connection closed by peer
/opt/torch/.venv/lib/python3.12/site-packages/torch/multiprocessing/spawn.py:211: ProcessRaisedException
----------------------------- Captured stderr call -----------------------------
Traceback (most recent call last):
  File "/work/main/python/tests/gpu/harness.py", line 33, in _entry
    fn(rank, world, dist.group.WORLD, *args)
RuntimeError: CUDA error in rank 1: opening rank 0's IPC buffer: CUDA_ERROR_NOT_PERMITTED: operation not permitted
Traceback (most recent call last):
  File "/work/main/python/tests/gpu/harness.py", line 33, in _entry
RuntimeError: rendezvous: the process group's all_gather failed: Connection closed by peer
W1207 23:27:06.157000 15564 torch/multiprocessing/spawn.py:165] Terminating process 17937 via signal SIGTERM
------------------------------ Captured log call -------------------------------
WARNING  torch.multiprocessing.spawn:spawn.py:165 Terminating process 17937 via signal SIGTERM
=========================== short test summary info ============================
============= 1 failed, 1 passed in 214.22s (0:03:34) ==============
"""


def test_a_failed_rows_error_is_the_first_ranks_traceback_not_the_one_spawn_reported(tmp_path):
    rec, _ = record_from_log(tmp_path, "from-pytest", "gpu-ranks2.log", SPAWN_LOG, "--commit", COMMIT,
                             "--machine", "1x NVIDIA H100 80GB HBM3", "--command", "python/scripts/gpu-run.sh target/wheels 2",
                             "--date", "2026-12-07")
    assert [(r["suite"], r["status"], r["first_error"]) for r in rec["results"]] == [
        ("python/tests/gpu::test_deepep_semantics_handles_without_topk_zero_copy", "fail",
         "RuntimeError: CUDA error in rank 1: opening rank 0's IPC buffer: CUDA_ERROR_NOT_PERMITTED: operation not permitted"),
        ("python/tests/gpu::test_peer_that_stops_calling_is_reported_not_partial_rows", "pass", None)]


def test_a_record_from_the_summary_of_deepep_conformance(tmp_path):
    rec, path = record_from_log(tmp_path, "from-conformance", "summary.txt", SUMMARY, "--commit", COMMIT,
                                "--machine", "1x NVIDIA H200", "--command", "python/scripts/deepep-conformance.sh ...",
                                "--date", "2026-12-03")
    assert rec["kind"] == "conformance" and path.endswith("2026-12-03-conformance-run.json")
    assert [(r["suite"], r["ranks"], r["status"], r["seconds"], r["first_error"]) for r in rec["results"]] == [
        ("ours: test_low_latency.py", 2, "pass", 24.0, None),
        ("ours: test_internode.py, 2 emulated hosts x 8 ranks", 16, "pass", 183.0, None),
        ("DeepEP: test_intranode.py", 8, "fail", 183.0, "TIMEOUT"),
        ("ours: test_low_latency.py", 4, "fail", 10.0, "RuntimeError: NVSHMEM: rank 0: no transport. Fix: allow NVLink")]
    # one run per test file (and library), with the rank counts it ran at
    assert rec["runs"] == [{"suite": "ours: test_low_latency.py", "part": None, "ranks": [2, 4]},
                           {"suite": "ours: test_internode.py, 2 emulated hosts x 8 ranks", "part": None, "ranks": [16]},
                           {"suite": "DeepEP: test_intranode.py", "part": None, "ranks": [8]}]


def test_the_gpu_scripts_write_records_through_this_tool():
    # RECORD=1 in the two GPU scripts calls these subcommands with the logs they wrote
    for script, sub, logs in (("python/scripts/gpu-run.sh", "from-pytest", '"$out"/gpu-ranks*.log'),
                              ("python/scripts/deepep-conformance.sh", "from-conformance", '"$out/summary.txt"')):
        with open(os.path.join(REPO, script)) as f:
            text = f.read()
        assert f'scripts/results.py" {sub} {logs}' in text, script
        assert 'if [ "${RECORD:-0}" = 1 ]' in text and "RECORD=1" in text.split("set -uo pipefail")[0], script


def test_the_gpu_scripts_name_the_knobs_of_a_run_in_its_record(tmp_path):
    # the record's command must say how the run was made (DEEPEP_KERNELS_KEEP_COMM_STREAMS=0 ...):
    # the scripts pass their bare invocation, and the from-* subcommands they call put the knobs
    # of the environment (the run's, inherited) before it; DEEPEP_TEST_GPUS is the harness's, no knob
    for script, sub, log in (("python/scripts/gpu-run.sh", "from-pytest", "gpu-ranks2.log"),
                             ("python/scripts/deepep-conformance.sh", "from-conformance", "summary.txt")):
        with open(os.path.join(REPO, script)) as f:
            text = f.read()
        assert f'invocation="{script} $*"' in text and '--command "$invocation"' in text, script
        (tmp_path / log).write_text(PYTEST_LOG if sub == "from-pytest" else SUMMARY)
        base = {k: v for k, v in os.environ.items() if not k.startswith("DEEPEP_")}
        for knobs, want in (({"DEEPEP_KERNELS_KEEP_COMM_STREAMS": "0", "DEEPEP_GPU_TIMEOUT_MS": "9000", "DEEPEP_TEST_GPUS": "1"},
                             f"DEEPEP_GPU_TIMEOUT_MS=9000 DEEPEP_KERNELS_KEEP_COMM_STREAMS=0 {script} a b c"),
                            ({"DEEPEP_TEST_GPUS": "1"}, f"{script} a b c")):
            out = tmp_path / f"out-{sub}-{len(knobs)}"
            p = subprocess.run([sys.executable, SCRIPT, sub, str(tmp_path / log), "--commit", COMMIT, "--machine", "1x NVIDIA H200",
                                "--command", f"{script} a b c", "--out", str(out)],
                               env=dict(base, **knobs), capture_output=True, text=True)
            assert p.returncode == 0, p.stderr
            assert results.validate(p.stdout.strip())["command"] == want, (script, knobs)
    # a record written by hand (new) keeps its command as given, whatever this shell has set
    p = subprocess.run([sys.executable, SCRIPT, "new", "--kind", "gpu-tests", "--commit", COMMIT, "--machine", "1x NVIDIA H200",
                        "--command", "c", "--result", "s:2:pass:1", "--out", str(tmp_path / "new")],
                       env=dict(os.environ, DEEPEP_KERNELS_KEEP_COMM_STREAMS="0"), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert results.validate(p.stdout.strip())["command"] == "c"


# ---------------------------------------------------------------------------------------------
# Retention: one current record per (suite, machine kind), plus the cited ones.


def retention_repo(tmp_path, n_commits, records, doc="no tables\n"):
    """A git repository with n commits in a line (their hashes returned) and the records, made by
    `records(commits)` as (file name, record) pairs, under kernels/results/."""
    d = tmp_path / "repo"
    d.mkdir()
    commits = git_commits(d, n_commits)
    (d / "kernels" / "results").mkdir(parents=True)
    for name, rec in records(commits):
        (d / "kernels" / "results" / name).write_text(json.dumps(rec))
    (d / "kernels" / "DOC.md").write_text(doc)
    return d, commits


def check_fails(d):
    """`results.py --check` over the repository d, which must fail; its completed process."""
    p = run("--check", "--root", str(d))
    assert p.returncode == 1, p.stdout + p.stderr
    return p


def python_tests(date, commit, ranks=(2,), part=None, **over):
    rows = [{"suite": "python/tests/gpu::test_x", "ranks": n, "status": "pass", "seconds": None,
             "first_error": None, "detail": f"at {commit[:7]}"} for n in ranks]
    return record(date=date, commit=commit, results=rows,
                  runs=[{"suite": "python/tests/gpu", "part": part, "ranks": list(ranks)}], **over)


def test_the_latest_by_date_then_commit_order_is_current_never_the_file_name(tmp_path):
    # c0 -> c1 -> c2 in git. On 12-03, "a-newer" (c1) sorts before "z-older" (c0) by name but is
    # later in history; "0-early" is dated 12-02 although its commit c2 is the newest: date first.
    d, c = retention_repo(tmp_path, 3, lambda c: [
        ("2026-12-03-gpu-tests-z-older.json", python_tests("2026-12-03", c[0])),
        ("2026-12-03-gpu-tests-a-newer.json", python_tests("2026-12-03", c[1])),
        ("2026-12-02-gpu-tests-0-early.json", python_tests("2026-12-02", c[2]))],
        doc="<!-- results:table gpu-tests -->\n<!-- /results -->\n")
    p = run("prune", "--root", str(d))
    assert p.returncode == 0, p.stderr
    assert "remove kernels/results/2026-12-03-gpu-tests-z-older.json: not current (2026-12-03-gpu-tests-a-newer is later " \
           "for gpu-tests 'python/tests/gpu' at 2 ranks on 1xH200) and cited nowhere" in p.stdout, p.stdout
    assert "remove kernels/results/2026-12-02-gpu-tests-0-early.json" in p.stdout
    assert "remove kernels/results/2026-12-03-gpu-tests-a-newer.json" not in p.stdout
    assert "1 of 3 records kept (current or cited), 2 to remove" in p.stdout
    # the rendered table takes its row from the current record only
    assert run("--root", str(d)).returncode == 0
    text = (d / "kernels" / "DOC.md").read_text()
    assert f"| python/tests/gpu::test_x | 2 | 1xH200 | PASS | - | - | at {c[1][:7]} | [1] |" in text, text
    assert "z-older" not in text and "0-early" not in text


def test_check_names_a_record_neither_current_nor_cited_and_the_fix(tmp_path):
    d, c = retention_repo(tmp_path, 2, lambda c: [
        ("2026-12-03-gpu-tests-old.json", python_tests("2026-12-03", c[0])),
        ("2026-12-03-gpu-tests-new.json", python_tests("2026-12-03", c[1]))])
    p = check_fails(d)
    assert ("kernels/results/2026-12-03-gpu-tests-old.json: neither current (2026-12-03-gpu-tests-new is later for "
            "gpu-tests 'python/tests/gpu' at 2 ranks on 1xH200) nor cited by a doc; fix: scripts/results.py prune --apply "
            "(git keeps it), or cite it in a doc") in p.stderr, p.stderr
    assert "2026-12-03-gpu-tests-new.json: neither" not in p.stderr
    # rendering still works and says what to prune, without failing
    p = run("--root", str(d))
    assert p.returncode == 0 and "note: kernels/results/2026-12-03-gpu-tests-old.json: neither current" in p.stderr


def test_a_cited_old_record_stays_and_a_rendered_link_is_no_citation(tmp_path):
    d, c = retention_repo(tmp_path, 2, lambda c: [
        ("2026-12-03-gpu-tests-old.json", python_tests("2026-12-03", c[0])),
        ("2026-12-03-gpu-tests-new.json", python_tests("2026-12-03", c[1]))],
        # the old record named only inside a rendered table (a stale provenance link)
        doc="<!-- results:table gpu-tests -->\n- [1] (record [`x`](results/2026-12-03-gpu-tests-old.json))\n<!-- /results -->\n")
    p = run("--check", "--root", str(d))
    assert p.returncode == 1 and "2026-12-03-gpu-tests-old.json: neither current" in p.stderr, p.stderr
    # cited by a link outside the tables: kept, and the check passes once the table is rendered
    doc = d / "kernels" / "DOC.md"
    doc.write_text(doc.read_text() + "\nThe run before the fix: [old](results/2026-12-03-gpu-tests-old.json).\n")
    assert run("--root", str(d)).returncode == 0
    p = run("--check", "--root", str(d))
    assert p.returncode == 0, p.stderr
    assert "2026-12-03-gpu-tests-old" not in doc.read_text().split("<!-- /results -->")[0]  # rows: current only
    # a marker's record=NAME cites it too, and so does the pairing data under pkgs/
    doc.write_text("<!-- results:table gpu-tests record=2026-12-03-gpu-tests-old -->\n<!-- /results -->\n")
    assert run("--root", str(d)).returncode == 0 and run("--check", "--root", str(d)).returncode == 0
    doc.write_text("nothing\n")
    assert run("--check", "--root", str(d)).returncode == 1
    (d / "pkgs" / "deep-ep").mkdir(parents=True)
    (d / "pkgs" / "deep-ep" / "pairings.json").write_text(json.dumps({"record": "kernels/results/2026-12-03-gpu-tests-old.json"}))
    assert run("--check", "--root", str(d)).returncode == 0


def test_prune_apply_git_rms_what_the_rule_does_not_keep(tmp_path):
    d, c = retention_repo(tmp_path, 3, lambda c: [
        ("2026-12-03-gpu-tests-first.json", python_tests("2026-12-03", c[0], ranks=(2, 4))),
        ("2026-12-03-gpu-tests-second.json", python_tests("2026-12-03", c[1], ranks=(2,))),
        ("2026-12-03-gpu-tests-third.json", python_tests("2026-12-03", c[2], ranks=(4,)))])
    git = ["git", "-C", str(d)]
    subprocess.run(git + ["add", "kernels"], check=True)
    subprocess.run(git + ["-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "commit.gpgsign=false",
                          "commit", "-q", "-m", "records"], check=True)
    # "first" ran 2 and 4 ranks: "second" replaced it at 2, "third" at 4
    p = run("prune", "--root", str(d))
    assert p.returncode == 0 and p.stdout.count("\nremove ") + p.stdout.startswith("remove ") == 1, p.stdout
    assert "remove kernels/results/2026-12-03-gpu-tests-first.json" in p.stdout
    assert (d / "kernels" / "results" / "2026-12-03-gpu-tests-first.json").exists()  # listing changes nothing
    p = run("prune", "--apply", "--root", str(d))
    assert p.returncode == 0 and "removed kernels/results/2026-12-03-gpu-tests-first.json" in p.stdout, p.stdout + p.stderr
    assert sorted(os.listdir(d / "kernels" / "results")) == ["2026-12-03-gpu-tests-second.json", "2026-12-03-gpu-tests-third.json"]
    staged = subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True).stdout
    assert "D  kernels/results/2026-12-03-gpu-tests-first.json" in staged, staged
    assert run("--check", "--root", str(d)).returncode == 0
    assert ", 0 to remove" in run("prune", "--root", str(d)).stdout


def test_a_part_replaces_earlier_parts_and_a_whole_run_replaces_everything(tmp_path):
    d, c = retention_repo(tmp_path, 4, lambda c: [
        ("2026-12-03-gpu-tests-whole.json", python_tests("2026-12-03", c[0])),
        ("2026-12-03-gpu-tests-part-a.json", python_tests("2026-12-03", c[1], part="-k layout")),
        ("2026-12-03-gpu-tests-part-b.json", python_tests("2026-12-03", c[2], part="-k dead_peer"))])
    p = run("prune", "--root", str(d))
    # the last whole run stays current beside the later part; the earlier part goes
    assert "2 of 3 records kept" in p.stdout and "remove kernels/results/2026-12-03-gpu-tests-part-a.json" in p.stdout, p.stdout
    (d / "kernels" / "results" / "2026-12-03-gpu-tests-whole-again.json").write_text(json.dumps(python_tests("2026-12-03", c[3])))
    p = run("prune", "--root", str(d))
    assert "1 of 4 records kept" in p.stdout, p.stdout
    assert "remove kernels/results/2026-12-03-gpu-tests-part-b.json: not current (2026-12-03-gpu-tests-whole-again is later" in p.stdout


def test_machine_kinds_and_releases_are_separate_suites(tmp_path):
    two_gpus = dict(machine="2x NVIDIA H200 (NV18 NVLink)", machine_kind="2xH200")
    matrix = lambda release, date: record(kind="nvshmem-matrix", date=date, nvshmem=release,
                                          runs=[{"suite": "python/scripts/nvshmem-matrix.sh", "part": None, "ranks": [2]}])
    d, c = retention_repo(tmp_path, 1, lambda c: [
        ("2026-12-01-gpu-tests-h200x2.json", python_tests("2026-12-01", c[0], **two_gpus)),
        ("2026-12-03-gpu-tests-h200.json", python_tests("2026-12-03", c[0])),
        ("2026-12-01-nvshmem-matrix-3.8.0.json", matrix("3.8.0", "2026-12-01")),
        ("2026-12-03-nvshmem-matrix-3.4.5.json", matrix("3.4.5", "2026-12-03")),
        ("2026-12-04-nvshmem-matrix-3.4.5.json", matrix("3.4.5", "2026-12-04"))])
    p = run("prune", "--root", str(d))
    assert "4 of 5 records kept" in p.stdout, p.stdout
    assert "remove kernels/results/2026-12-03-nvshmem-matrix-3.4.5.json: not current (2026-12-04-nvshmem-matrix-3.4.5 " \
           "is later for nvshmem-matrix 'python/scripts/nvshmem-matrix.sh' at 2 ranks on 1xH200 with NVSHMEM 3.4.5)" in p.stdout


def test_a_tie_asks_for_the_time_field_and_time_decides(tmp_path):
    d, c = retention_repo(tmp_path, 1, lambda c: [
        ("2026-12-03-gpu-tests-b.json", python_tests("2026-12-03", c[0])),
        ("2026-12-03-gpu-tests-a.json", python_tests("2026-12-03", c[0]))])
    p = check_fails(d)
    assert ("2026-12-03-gpu-tests-a.json and " in p.stderr and "2026-12-03-gpu-tests-b.json both ran gpu-tests 'python/tests/gpu' "
            "at 2 ranks on 1xH200 on 2026-12-03" in p.stderr and "fix: add \"time\": \"HH:MM\"" in p.stderr), p.stderr
    assert run("prune", "--root", str(d)).returncode == 1
    # the time of the run decides
    for name, t in (("2026-12-03-gpu-tests-b.json", "09:15"), ("2026-12-03-gpu-tests-a.json", "17:40")):
        path = d / "kernels" / "results" / name
        path.write_text(json.dumps(dict(json.loads(path.read_text()), time=t)))
    p = run("prune", "--root", str(d))
    assert "remove kernels/results/2026-12-03-gpu-tests-b.json: not current (2026-12-03-gpu-tests-a is later" in p.stdout, p.stdout


def test_new_and_from_conformance_express_v2_suites_and_bench_figures(tmp_path):
    # DeepEP V2's elastic test with two argument sets: two suites, both current
    summary = ("library test                   nproc  result   seconds  log\n"
               "ours    elastic/test_ep.py         2  PASS          31  ours-elastic-2.log\n"
               "ours    elastic/test_ep.py         4  PASS          44  ours-elastic-4.log\n")
    (tmp_path / "summary.txt").write_text(summary)
    out = tmp_path / "repo" / "kernels" / "results"
    commits = git_commits(tmp_path / "repo", 1)
    for slug, args in (("v2-skip-perf", "--skip-perf-test"), ("v2-no-cpu-sync", "--do-cpu-sync 0")):
        p = run("from-conformance", str(tmp_path / "summary.txt"), f"--test-args={args}", "--commit", commits[0],
                "--machine", "1x NVIDIA H200 (driver 580.159.04)", "--command", "deepep-conformance.sh ...",
                "--date", "2026-12-05", "--slug", slug, "--out", str(out))
        assert p.returncode == 0, p.stderr
        rec = results.validate(p.stdout.strip())
        assert rec["runs"] == [{"suite": f"ours: elastic/test_ep.py {args}", "part": None, "ranks": [2, 4]}]
        assert [r["suite"] for r in rec["results"]] == [f"ours: elastic/test_ep.py {args}"] * 2
    # a bench record: the suite and rank counts named, the figures from a file; without --date: a time
    figs = [{"name": "LL combine BF16, host time per call", "value": 9.8, "unit": "us",
             "baseline": "DeepEP v1.2.1, same run", "baseline_value": 11.0, "note": ""}]
    (tmp_path / "figures.json").write_text(json.dumps(figs))
    p = run("new", "--kind", "bench", "--suite", "bench.py --mode ll --compare-deep-ep", "--suite", "host_profile.py",
            "--ranks", "1", "--figures", str(tmp_path / "figures.json"), "--commit", commits[0],
            "--machine", "1x NVIDIA H100 80GB HBM3 (driver 580.65.06)", "--command", "bench.py ...; host_profile.py",
            "--slug", "host-time", "--out", str(out))
    assert p.returncode == 0, p.stderr
    rec = results.validate(p.stdout.strip())
    assert rec["machine_kind"] == "1xH100" and rec["figures"] == figs and re.fullmatch(r"\d\d:\d\d", rec["time"])
    assert rec["runs"] == [{"suite": "bench.py --mode ll --compare-deep-ep", "part": None, "ranks": [1]},
                           {"suite": "host_profile.py", "part": None, "ranks": [1]}]
    # a --result row whose suite holds ':' and whose detail holds ':' too
    p = run("new", "--kind", "conformance", "--result", "ours: elastic/test_ep.py --skip-perf-test:8:pass:-:note: slow",
            "--commit", commits[0], "--machine", "1x NVIDIA H200", "--command", "c", "--date", "2026-12-05",
            "--slug", "v2-eight", "--out", str(out))
    assert p.returncode == 0, p.stderr
    rec = results.validate(p.stdout.strip())
    assert rec["results"][0]["suite"] == "ours: elastic/test_ep.py --skip-perf-test" and rec["results"][0]["detail"] == "note: slow"
    (tmp_path / "repo" / "kernels" / "DOC.md").write_text("none\n")
    p = run("prune", "--root", str(tmp_path / "repo"))
    assert "4 of 4 records kept" in p.stdout, p.stdout + p.stderr


def test_from_pytest_marks_a_run_with_deselected_tests_as_a_part(tmp_path):
    log = "collected 15 items / 14 deselected / 1 selected\n" + PYTEST_LOG.splitlines()[1] + "\n"
    rec, _ = record_from_log(tmp_path, "from-pytest", "gpu-ranks2.log", log, "--commit", COMMIT, "--machine", "1x NVIDIA H200",
                             "--command", "PYTEST_ARGS='-k hooks' python/scripts/gpu-run.sh W 2", "--date", "2026-12-03")
    assert rec["runs"] == [{"suite": "python/tests/gpu", "part": "1 of 15 tests selected (pytest -k/-m)", "ranks": [2]}]
    p = run("from-pytest", str(tmp_path / "gpu-ranks2.log"), "--part", "-k hooks", "--commit", COMMIT, "--machine", "1x NVIDIA H200",
            "--command", "c", "--date", "2026-12-03", "--slug", "named", "--out", str(tmp_path))
    assert results.validate(p.stdout.strip())["runs"][0]["part"] == "-k hooks"


def test_commits_git_does_not_know_are_named_as_the_cause_of_a_tie(tmp_path):
    # e.g. a shallow clone: the commits of two same-day records are not in this repository
    d, c = retention_repo(tmp_path, 1, lambda c: [
        ("2026-12-03-gpu-tests-a.json", python_tests("2026-12-03", "b" * 40)),
        ("2026-12-03-gpu-tests-b.json", python_tests("2026-12-03", "c" * 40))])
    p = check_fails(d)
    assert "(bbbbbbb, ccccccc) (git here does not know both commits: in a shallow clone, `git fetch --unshallow` first)" in p.stderr, p.stderr
    # records of different dates need no git at all
    path = d / "kernels" / "results" / "2026-12-03-gpu-tests-b.json"
    path.rename(d / "kernels" / "results" / "2026-12-04-gpu-tests-b.json")
    newer = d / "kernels" / "results" / "2026-12-04-gpu-tests-b.json"
    newer.write_text(json.dumps(dict(json.loads(newer.read_text()), date="2026-12-04")))
    p = run("prune", "--root", str(d))
    assert p.returncode == 0 and "remove kernels/results/2026-12-03-gpu-tests-a.json" in p.stdout, p.stdout + p.stderr
