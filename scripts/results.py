#!/usr/bin/env python3
"""GPU results as data: validate kernels/results/*.json, keep only current or cited records, and
render the docs' tables from them.

Usage:
  scripts/results.py                 validate every record, then rewrite the tables between the
                                     docs' marker comments (README.md, docs/*.md, kernels/*.md)
  scripts/results.py --check         validate, and exit 1 when a doc's table differs from what
                                     the records give or a record is neither current nor cited
                                     (CI runs this through python/tests)
  scripts/results.py prune [--apply] list the records the retention rule does not keep; --apply
                                     `git rm`s them (git keeps their history)
  scripts/results.py validate FILE.. validate the named records only
  scripts/results.py new --kind K --commit C --machine M --command CMD [--suite S]... [--ranks R]
                     [--part P] [--nvshmem V] [--result SUITE:RANKS:STATUS:SECONDS[:DETAIL]]...
                     [--notes TEXT] [--out DIR]
                                     write a record
  scripts/results.py from-pytest LOG... --commit C --machine M --command CMD [--slug S] [--out DIR]
                                     a gpu-tests record from the `pytest -v` logs of
                                     python/tests/gpu, one per rank count (gpu-ranks<N>.log)
  scripts/results.py from-conformance SUMMARY --commit C --machine M --command CMD
                     [--test-args ARGS] [...]
                                     a conformance record from deepep-conformance.sh's summary.txt
  (python/scripts/gpu-run.sh and deepep-conformance.sh call these with RECORD=1; --machine auto
  asks nvidia-smi and torch; the from-* records' command starts with the library's knobs set in
  the environment, e.g. DEEPEP_KERNELS_KEEP_COMM_STREAMS=0, so that it says how the run was made)
Options: --root DIR (the repository; default: this script's parent folder).

A record is kernels/results/<YYYY-MM-DD>-<kind>-<slug>.json, schema 2 (kernels/TESTING.md,
"Results as data"). Retention: per suite (kind, a run's `suite`, one rank count; for
nvshmem-matrix also the release) and machine kind, the latest record that ran it is current
(latest: `date`, then the commits' order in git history, then `time`; never the file name); a
whole run replaces every earlier run, a part (`part` set) replaces earlier parts only. Records
that are neither current nor cited by a doc go (`prune --apply`).
A doc holds a rendered table between
  <!-- results:table KIND [suite=PREFIX] [record=NAME] -->  and  <!-- /results -->
KIND gpu-tests / conformance / nvshmem-matrix: the latest row per (suite, ranks, machine kind) (per
release too for nvshmem-matrix) over the current records of the kind, with a provenance line per
record; with record=NAME that record's rows; KIND bench with record=NAME (the file name without
.json): that record's figures.
Exit status: 0 ok, 1 a record is invalid, a table drifted or (--check) a record is neither current
nor cited, 2 usage errors.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

SCHEMA = 2
KINDS = ("gpu-tests", "conformance", "bench", "nvshmem-matrix")
STATUSES = ("pass", "fail", "skip")
TOP_FIELDS = {
    "schema": "int",
    "kind": "str",
    "date": "str",
    "commit": "str",
    "machine": "str",
    "machine_kind": "str",
    "command": "str",
    "runs": "list",
    "results": "list",
    "figures": "list",
    "notes": "str",
}
OPTIONAL_TOP = {"nvshmem": "str", "time": "str"}
RUN_FIELDS = ("suite", "part", "ranks")
RESULT_FIELDS = ("suite", "ranks", "status", "seconds", "first_error", "detail")
FIGURE_FIELDS = ("name", "value", "unit", "baseline", "baseline_value", "note")
NAME_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})-([a-z0-9][a-z0-9._-]*)\.json$")
MARKER_RE = re.compile(r"^<!-- results:table ([^>\n]*?) -->\n(.*?)^<!-- /results -->", re.S | re.M)
OPEN_RE = re.compile(r"^<!-- results:table", re.M)
DOC_GLOBS = ("README.md", "docs", "kernels", "python")
# Files that may cite a record besides the docs: the pairing data's evidence.
CITING_DATA = (("pkgs", ".json"),)
# "<count>x <GPU model>" at the start of `machine` (as --machine auto writes it): the machine kind.
MACHINE_KIND_RE = re.compile(r"^([1-9]\d*)x\s*(?:NVIDIA\s+)?([A-Z]+\d+[A-Za-z]*)\b")
MACHINE_KIND_FORMAT = re.compile(r"^([1-9]\d*x[A-Z]+\d+[A-Za-z]*|cpu)$")  # "cpu": no GPU (a dry run)
# A quoted error line ("RuntimeError: ...", a traceback): never the detail of a passing row.
PASS_DETAIL_ERROR_RE = re.compile(r"\b\w*(Error|Exception): |Traceback \(most recent call last\)")
# A record's name as a doc cites it (a link, a path, a marker's record=NAME).
CITED_NAME_RE = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9][a-z0-9._-]*")


class RecordError(Exception):
    """A record that does not follow the schema; the message names file, field and fix."""


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _type_ok(v, t):
    return {
        "int": isinstance(v, int) and not isinstance(v, bool),
        "str": isinstance(v, str),
        "list": isinstance(v, list),
    }[t]


def machine_kind_of(machine):
    """'1xH200' from '1x NVIDIA H200 (driver ...), CUDA 13.0' (the form --machine auto writes);
    None when `machine` does not start with "<count>x <GPU model>"."""
    m = MACHINE_KIND_RE.match(machine.strip())
    return f"{m.group(1)}x{m.group(2)}" if m else None


def validate(path, data=None):
    """Returns the record (a dict) or raises RecordError naming the file, the field and the fix."""
    name = os.path.basename(path)

    def bad(field, problem, fix):
        raise RecordError(f"{path}: field '{field}': {problem}; fix: {fix}")

    if data is None:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}: not valid JSON ({e}); fix: write the record as one JSON object")
    if not isinstance(data, dict):
        raise RecordError(f"{path}: the record is a {type(data).__name__}, not a JSON object; fix: write one object with the schema's fields")
    if "schema" in data and _type_ok(data["schema"], "int") and data["schema"] != SCHEMA:
        fix = (f"migrate it: add \"machine_kind\" and \"runs\" (kernels/TESTING.md, 'Results as data') and set \"schema\": {SCHEMA}"
               if data["schema"] == 1 else f"set \"schema\": {SCHEMA} (or update scripts/results.py)")
        bad("schema", f"is {data['schema']}, this tool reads schema {SCHEMA}", fix)
    for field, t in TOP_FIELDS.items():
        if field not in data:
            bad(field, "missing", f"add \"{field}\" ({t}; see kernels/TESTING.md, 'Results as data')")
        if not _type_ok(data[field], t):
            bad(field, f"is {json.dumps(data[field])[:60]}, not a {t}", f"make it a {t}")
    for field in data:
        if field not in TOP_FIELDS and field not in OPTIONAL_TOP:
            bad(field, "unknown field", f"remove it or rename it to one of {', '.join(list(TOP_FIELDS) + list(OPTIONAL_TOP))}")
    if "nvshmem" in data and not (isinstance(data["nvshmem"], str) and re.fullmatch(r"\d+\.\d+\.\d+", data["nvshmem"])):
        bad("nvshmem", f"is {json.dumps(data['nvshmem'])}, not a release like \"3.4.5\"", "write the NVSHMEM release as X.Y.Z")
    if data["kind"] not in KINDS:
        bad("kind", f"is \"{data['kind']}\"", f"use one of {', '.join(KINDS)}")
    try:
        datetime.date.fromisoformat(data["date"])
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]):
            raise ValueError
    except ValueError:
        bad("date", f"is \"{data['date']}\", not a date YYYY-MM-DD", "write the UTC date of the run, e.g. 2026-12-03")
    if not re.fullmatch(r"[0-9a-f]{40}", data["commit"]):
        bad("commit", f"is \"{data['commit']}\", not a full 40-hex commit", "write `git rev-parse HEAD` of the code that ran")
    for field in ("machine", "command"):
        if not data[field].strip():
            bad(field, "is empty", "say what ran where (e.g. '1x NVIDIA H200 (driver ...), CUDA 13.0') and the exact command")
    if not MACHINE_KIND_FORMAT.match(data["machine_kind"]):
        bad("machine_kind", f"is \"{data['machine_kind']}\", not <GPUs>x<model>", "write the GPUs of the machine, e.g. \"1xH200\" or \"2xH100\" (\"cpu\" for a run without GPU)")
    derived = machine_kind_of(data["machine"])
    if derived and derived != data["machine_kind"]:
        bad("machine_kind", f"is \"{data['machine_kind']}\", but \"machine\" says {derived}", f"write \"{derived}\", or correct \"machine\"")
    if "time" in data and not (isinstance(data["time"], str) and re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", data["time"])):
        bad("time", f"is {json.dumps(data['time'])}, not HH:MM", "write the UTC time the run started, e.g. \"14:05\", or leave the field out")
    m = NAME_RE.match(name)
    if not m:
        raise RecordError(f"{path}: file name '{name}' is not <YYYY-MM-DD>-<kind>-<slug>.json; fix: rename it, e.g. {data['date']}-{data['kind']}-h200.json")
    if m.group(1) != data["date"] or not m.group(2).startswith(data["kind"] + "-") or m.group(2) == data["kind"] + "-":
        raise RecordError(f"{path}: file name '{name}' does not match the record's date and kind; fix: rename it to {data['date']}-{data['kind']}-<slug>.json")
    if data["kind"] == "nvshmem-matrix" and "nvshmem" not in data:
        bad("nvshmem", "missing (a nvshmem-matrix record names the release that ran)", "add \"nvshmem\": \"X.Y.Z\"")
    def same_fields(where, obj, fields, what, nulls):
        """obj is an object with exactly these fields."""
        if not isinstance(obj, dict):
            bad(where, "is not an object", "write {" + ", ".join(f'"{k}": ...' for k in fields) + "}")
        missing = [k for k in fields if k not in obj]
        if missing:
            bad(f"{where}.{missing[0]}", "missing", f"add \"{missing[0]}\" (null for {nulls} where it does not apply)")
        unknown = [k for k in obj if k not in fields]
        if unknown:
            bad(f"{where}.{unknown[0]}", "unknown field", f"remove it; {what} has {', '.join(fields)}")

    if not data["runs"]:
        bad("runs", "is empty", "name what the command ran: [{\"suite\": \"python/tests/gpu\", \"part\": null, \"ranks\": [2]}]")
    seen = set()
    for i, run in enumerate(data["runs"]):
        where = f"runs[{i}]"
        same_fields(where, run, RUN_FIELDS, "a run", "part")
        if not isinstance(run["suite"], str) or not run["suite"].strip():
            bad(f"{where}.suite", "is not a non-empty string", "name what ran, e.g. \"python/tests/gpu\" or \"ours: elastic/test_ep.py --skip-perf-test\"")
        if run["suite"] in seen:
            bad(f"{where}.suite", f"\"{run['suite']}\" is named twice", "give each suite one run and list all its rank counts there")
        seen.add(run["suite"])
        if run["part"] is not None and not (isinstance(run["part"], str) and run["part"].strip()):
            bad(f"{where}.part", f"is {json.dumps(run['part'])}", "null for a whole run, or say which part ran, e.g. \"-k wrong_argument\"")
        ranks = run["ranks"]
        if not (isinstance(ranks, list) and ranks and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in ranks)):
            bad(f"{where}.ranks", f"is {json.dumps(ranks)}, not a non-empty list of whole numbers >= 0", "list the rank counts the command ran, e.g. [2, 4, 8]")
        if len(set(ranks)) != len(ranks):
            bad(f"{where}.ranks", f"is {json.dumps(ranks)}: a rank count twice", "list each rank count once")
    for i, row in enumerate(data["results"]):
        where = f"results[{i}]"
        same_fields(where, row, RESULT_FIELDS, "a result row", "seconds and first_error")
        if not isinstance(row["suite"], str) or not row["suite"].strip():
            bad(f"{where}.suite", "is not a non-empty string", "name the suite, e.g. \"deepep-gpu-tests\"")
        # 0 for a step that is not a run of ranks (e.g. building DeepEP in an NVSHMEM matrix run)
        if not (isinstance(row["ranks"], int) and not isinstance(row["ranks"], bool) and row["ranks"] >= 0):
            bad(f"{where}.ranks", f"is {json.dumps(row['ranks'])}, not a whole number >= 0", "write the number of ranks (0 for a step such as a build)")
        if row["status"] not in STATUSES:
            bad(f"{where}.status", f"is {json.dumps(row['status'])}", f"use one of {', '.join(STATUSES)}")
        if row["seconds"] is not None and not (_is_number(row["seconds"]) and row["seconds"] >= 0):
            bad(f"{where}.seconds", f"is {json.dumps(row['seconds'])}", "write the wall time in seconds, or null")
        if row["first_error"] is not None and not isinstance(row["first_error"], str):
            bad(f"{where}.first_error", "is not a string or null", "quote the first error line, or null")
        if row["status"] == "fail" and not row["first_error"]:
            bad(f"{where}.first_error", "is empty for a failed row", "quote the first error line of the failing run")
        if row["status"] != "fail" and row["first_error"] is not None:
            bad(f"{where}.first_error", f"is set for a {row['status']} row", "null unless the row failed (then set \"status\": \"fail\")")
        if not isinstance(row["detail"], str):
            bad(f"{where}.detail", "is not a string", "write e.g. \"37 passed\" (\"\" when there is nothing to add)")
        if row["status"] == "pass" and PASS_DETAIL_ERROR_RE.search(row["detail"]):
            bad(f"{where}.detail", "quotes an error in a passing row", "if the run failed, set \"status\": \"fail\" and quote the error in \"first_error\"; "
                "if the row's check passed, say so in \"detail\" and put what else went wrong in \"notes\"")
    for i, fig in enumerate(data["figures"]):
        where = f"figures[{i}]"
        same_fields(where, fig, FIGURE_FIELDS, "a figure", "baseline and baseline_value")
        if not isinstance(fig["name"], str) or not fig["name"].strip():
            bad(f"{where}.name", "is not a non-empty string", "say what was measured")
        if not _is_number(fig["value"]):
            bad(f"{where}.value", f"is {json.dumps(fig['value'])}, not a number", "write the measured number (its unit goes in \"unit\")")
        if not isinstance(fig["unit"], str):
            bad(f"{where}.unit", "is not a string", "write the unit, e.g. \"us\", \"GB/s\", \"x\"")
        if fig["baseline"] is not None and not isinstance(fig["baseline"], str):
            bad(f"{where}.baseline", "is not a string or null", "name what the figure is compared with, or null")
        if fig["baseline_value"] is not None and not _is_number(fig["baseline_value"]):
            bad(f"{where}.baseline_value", "is not a number or null", "write the baseline's number, or null")
        if (fig["baseline"] is None) != (fig["baseline_value"] is None):
            bad(f"{where}.baseline_value", "baseline and baseline_value must be given together", "set both or neither")
        if not isinstance(fig["note"], str):
            bad(f"{where}.note", "is not a string", "write \"\" when there is nothing to add")
    return data


def load_records(results_dir):
    """Every record under results_dir, validated, in file-name order (listing order only: which
    record is later is decided by `later`, never by the name)."""
    records = []
    errors = []
    if not os.path.isdir(results_dir):
        return records, errors
    for name in sorted(os.listdir(results_dir)):
        path = os.path.join(results_dir, name)
        if not name.endswith(".json"):
            if name != "README.md":
                errors.append(f"{path}: not a record (only <date>-<kind>-<slug>.json files belong here); fix: move it out of {results_dir}")
            continue
        try:
            rec = validate(path)
        except RecordError as e:
            errors.append(str(e))
            continue
        rec = dict(rec)
        rec["_path"] = path
        rec["_name"] = name[:-5]
        records.append(rec)
    return records, errors


class GitHistory:
    """Whether one commit is an ancestor of another in the repository at `root` (`git merge-base
    --is-ancestor`), cached; None when git cannot tell (no git, no repository, unknown commit)."""

    def __init__(self, root):
        self.root = root
        self.cache = {}

    def is_ancestor(self, a, b):
        if (a, b) not in self.cache:
            try:
                p = subprocess.run(["git", "-C", self.root, "merge-base", "--is-ancestor", a, b],
                                   capture_output=True, timeout=60)
                self.cache[(a, b)] = {0: True, 1: False}.get(p.returncode)
            except (OSError, subprocess.SubprocessError):
                self.cache[(a, b)] = None
        return self.cache[(a, b)]


def later(a, b, history):
    """1 when record a ran after record b, -1 when before, 0 when the fields cannot tell: the
    `date` first, then the commits' order in git history, then the `time` of both."""
    if a["date"] != b["date"]:
        return 1 if a["date"] > b["date"] else -1
    if a["commit"] != b["commit"]:
        if history.is_ancestor(b["commit"], a["commit"]):
            return 1
        if history.is_ancestor(a["commit"], b["commit"]):
            return -1
    if a.get("time") and b.get("time") and a["time"] != b["time"]:
        return 1 if a["time"] > b["time"] else -1
    return 0


def suites_of(rec):
    """(suite, whole) for every suite the record ran: a suite is (kind, a run's suite, one rank
    count, the machine kind, and for nvshmem-matrix the release); whole is False for a part."""
    release = rec.get("nvshmem") if rec["kind"] == "nvshmem-matrix" else None
    for run in rec["runs"]:
        for n in run["ranks"]:
            yield (rec["kind"], run["suite"], n, rec["machine_kind"], release), run["part"] is None


def describe_suite(suite):
    kind, name, n, machine_kind, release = suite
    return f"{kind} '{name}' at {n} rank{'s' if n != 1 else ''} on {machine_kind}" + (f" with NVSHMEM {release}" if release else "")


def tie_error(a, b, what, history):
    unknown = a["commit"] != b["commit"] and history.is_ancestor(a["commit"], b["commit"]) is None
    why = (" (git here does not know both commits: in a shallow clone, `git fetch --unshallow` first)" if unknown else "")
    return (f"{a['_path']} and {b['_path']} both ran {what} on {a['date']}, and neither the commits' order in git history "
            f"({a['commit'][:7]}, {b['commit'][:7]}){why} nor a \"time\" field tells which ran later; "
            f"fix: add \"time\": \"HH:MM\" (the UTC start of the run) to both records")


def current_records(records, history):
    """The retention rule's first half. Per suite (suites_of), the latest record that ran it is
    current: a whole run replaces every earlier run of the suite, a part replaces earlier parts
    only. Returns (names of the current records, {name: (suite, name of a later record)} for the
    others, tie errors)."""
    by_suite = {}
    for rec in records:
        for suite, whole in suites_of(rec):
            by_suite.setdefault(suite, []).append((rec, whole))
    current, replaced, ties = set(), {}, []
    for suite, runs in by_suite.items():
        for rec, whole in runs:
            newer, tie = [], None
            for other, other_whole in runs:
                if other is rec or not (other_whole or not whole):
                    continue  # a part never replaces a whole run
                order = later(other, rec, history)
                if order > 0:
                    newer.append(other)
                elif order == 0:
                    tie = other
            if newer:
                # name the latest of the later records (the one that is current, unless tied)
                latest = next((n for n in newer if not any(later(o, n, history) > 0 for o in newer)), newer[0])
                replaced.setdefault(rec["_name"], (suite, latest["_name"]))
            elif tie is not None:
                err = tie_error(*sorted((rec, tie), key=lambda r: r["_name"]), describe_suite(suite), history)
                if err not in ties:
                    ties.append(err)
            else:
                current.add(rec["_name"])
    for name in current:
        replaced.pop(name, None)
    return current, replaced, ties


def cited_records(root):
    """{record name: [files that cite it]}: the docs (doc_files), outside their rendered tables
    (a marker's record=NAME counts, the provenance links the tool renders do not), and the data
    files of CITING_DATA (pkgs/**/*.json: the pairing data's evidence)."""
    results_dir = os.path.join(root, "kernels", "results")
    files = [d for d in doc_files(root) if not os.path.abspath(d).startswith(os.path.abspath(results_dir) + os.sep)]
    for folder, ext in CITING_DATA:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(ext))
    cited = {}
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        text = MARKER_RE.sub(lambda m: f"<!-- results:table {m.group(1)} -->", text)
        names = set()
        for token in CITED_NAME_RE.findall(text):
            name = token.rstrip(".")
            names.add((name[:-5] if name.endswith(".json") else name).rstrip("."))
        for name in names:
            cited.setdefault(name, []).append(os.path.relpath(path, root))
    return cited


class Retention:
    """The records of a tree and which of them the rule keeps: the current ones and the cited ones."""

    def __init__(self, root, records):
        self.history = GitHistory(root)
        self.records = records
        self.current, self.replaced, self.ties = current_records(records, self.history)
        self.cited = cited_records(root)

    def dropped(self):
        """[(record, why)] for the records that are neither current nor cited."""
        out = []
        for rec in self.records:
            name = rec["_name"]
            if name in self.current or name in self.cited or name not in self.replaced:
                continue  # a record in a tie is reported by the tie, not here
            suite, newer = self.replaced[name]
            out.append((rec, f"{newer} is later for {describe_suite(suite)}"))
        return out


def _fmt_num(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _link(rec, doc_dir):
    rel = os.path.relpath(rec["_path"], doc_dir).replace(os.sep, "/")
    return f"[`{rec['_name']}`]({rel})"


def provenance(rec, doc_dir):
    extra = f", NVSHMEM {rec['nvshmem']}" if "nvshmem" in rec else ""
    return (f"commit `{rec['commit'][:7]}`, {rec['date']}, {rec['machine']}{extra}; "
            f"`{rec['command']}` (record {_link(rec, doc_dir)})")


def _version_key(v):
    return tuple(int(x) for x in v.split("."))


def render_rows_table(kind, records, doc_dir, history, suite_prefix=None):
    """Latest row per key over the records of one kind (`later` decides), a numbered provenance
    line per record."""
    latest = {}
    for rec in records:
        if rec["kind"] != kind:
            continue
        for row in rec["results"]:
            if suite_prefix and not row["suite"].startswith(suite_prefix):
                continue
            # per machine kind too: an H100 run does not hide the H200 run of the same suite
            key = (rec.get("nvshmem", "") if kind == "nvshmem-matrix" else "", row["suite"], row["ranks"], rec["machine_kind"])
            if key in latest and latest[key][1] is not rec:
                order = later(rec, latest[key][1], history)
                if order == 0:
                    raise RecordError(tie_error(latest[key][1], rec, f"the row '{row['suite']}' at {row['ranks']} ranks", history))
                if order < 0:
                    continue
            latest[key] = (row, rec)
    what = f"{kind} records" + (f" with a suite starting '{suite_prefix}'" if suite_prefix else "")
    if not latest:
        return f"No record yet ({what} under kernels/results/).\n"
    if kind == "nvshmem-matrix":
        keys = sorted(latest, key=lambda k: (_version_key(k[0]), k[1], k[2], k[3]))
        head = "| NVSHMEM | suite | ranks | machine | status | seconds | first error | detail | source |\n|---|---|---|---|---|---|---|---|---|\n"
    else:
        keys = sorted(latest, key=lambda k: (k[1], k[2], k[3]))
        head = "| suite | ranks | machine | status | seconds | first error | detail | source |\n|---|---|---|---|---|---|---|---|\n"
    sources = []
    lines = []
    for k in keys:
        row, rec = latest[k]
        if rec["_name"] not in sources:
            sources.append(rec["_name"])
        n = sources.index(rec["_name"]) + 1
        cells = [row["suite"], row["ranks"], k[3], row["status"].upper(), _fmt_num(row["seconds"]),
                 row["first_error"] or "-", row["detail"] or "-", f"[{n}]"]
        if kind == "nvshmem-matrix":
            cells.insert(0, k[0])
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |\n")
    by_name = {r["_name"]: r for r in records}
    prov = "".join(f"- [{i + 1}] {provenance(by_name[s], doc_dir)}\n" for i, s in enumerate(sources))
    return head + "".join(lines) + "\n" + prov


def render_bench_table(record_name, records, doc_dir, doc):
    rec = next((r for r in records if r["_name"] == record_name), None)
    if rec is None:
        raise RecordError(f"{doc}: table 'bench record={record_name}': no record kernels/results/{record_name}.json; fix: name an existing record (file name without .json)")
    if not rec["figures"]:
        return f"No figures in {_link(rec, doc_dir)}.\n"
    out = ["| figure | value | baseline | baseline value | value / baseline | note |\n|---|---|---|---|---|---|\n"]
    for fig in rec["figures"]:
        ratio = "-"
        if fig["baseline_value"]:
            ratio = f"{fig['value'] / fig['baseline_value']:.2f}"
        unit = f" {fig['unit']}" if fig["unit"] else ""
        base = "-" if fig["baseline"] is None else fig["baseline"]
        bval = "-" if fig["baseline_value"] is None else f"{_fmt_num(fig['baseline_value'])}{unit}"
        cells = [fig["name"], f"{_fmt_num(fig['value'])}{unit}", base, bval, ratio, fig["note"] or "-"]
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |\n")
    out.append("\nProvenance: " + provenance(rec, doc_dir) + "\n")
    return "".join(out)


def render_block(spec, retention, doc_path):
    """The rendered body for one marker's spec, e.g. 'gpu-tests suite=deepep-gpu-tests': rows of
    the current records, or of the record a record=NAME names."""
    records = retention.records
    words = spec.split()
    if not words or words[0] not in KINDS:
        raise RecordError(f"{doc_path}: marker 'results:table {spec}': the first word must be a kind ({', '.join(KINDS)}); fix the marker")
    kind, opts = words[0], {}
    for w in words[1:]:
        if "=" not in w or w.split("=", 1)[0] not in ("suite", "record"):
            raise RecordError(f"{doc_path}: marker 'results:table {spec}': option '{w}' is not suite=PREFIX or record=NAME; fix the marker")
        k, v = w.split("=", 1)
        opts[k] = v
    doc_dir = os.path.dirname(os.path.abspath(doc_path))
    if kind == "bench":
        if "record" not in opts:
            raise RecordError(f"{doc_path}: marker 'results:table {spec}': a bench table needs record=NAME; fix the marker")
        return render_bench_table(opts["record"], records, doc_dir, doc_path)
    if "record" in opts:
        named = [r for r in records if r["_name"] == opts["record"]]
        if not named:
            raise RecordError(f"{doc_path}: table '{spec}': no record kernels/results/{opts['record']}.json; fix: name an existing record (file name without .json)")
        return render_rows_table(kind, named, doc_dir, retention.history, opts.get("suite"))
    current = [r for r in records if r["_name"] in retention.current]
    return render_rows_table(kind, current, doc_dir, retention.history, opts.get("suite"))


def render_doc(text, retention, doc_path):
    """The doc's text with every marker's body re-rendered."""
    def sub(m):
        return f"<!-- results:table {m.group(1)} -->\n" + render_block(m.group(1), retention, doc_path) + "<!-- /results -->"
    return MARKER_RE.sub(sub, text)


def doc_files(root):
    out = []
    for g in DOC_GLOBS:
        p = os.path.join(root, g)
        if os.path.isfile(p):
            out.append(p)
        elif os.path.isdir(p):
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = [d for d in dirnames if d not in ("target", "node_modules") and not d.startswith(".")]
                out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".md"))
    return sorted(out)


def load_tree(root):
    """(Retention of the tree's records, problems): problems are invalid records or ties."""
    records, problems = load_records(os.path.join(root, "kernels", "results"))
    if problems:
        return None, problems
    retention = Retention(root, records)
    return retention, list(retention.ties)


def sync_docs(root, check):
    """Renders every doc's tables; returns (problems, notes): problems are invalid records, ties,
    drift in check mode, and in check mode records that are neither current nor cited (in render
    mode those are notes)."""
    retention, problems = load_tree(root)
    if problems:
        return problems, []
    for doc in doc_files(root):
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        opened = len(OPEN_RE.findall(text))
        if not opened:
            continue
        if len(MARKER_RE.findall(text)) != opened:
            problems.append(f"{doc}: a '<!-- results:table ... -->' marker has no '<!-- /results -->' after it; fix: close every table")
            continue
        try:
            new = render_doc(text, retention, doc)
        except RecordError as e:
            problems.append(str(e))
            continue
        if new != text:
            rel = os.path.relpath(doc, root)
            if check:
                problems.append(f"{rel}: its results tables differ from kernels/results/; fix: run scripts/results.py and commit the result")
            else:
                with open(doc, "w", encoding="utf-8") as f:
                    f.write(new)
                print(f"rendered {rel}")
    dropped = [f"{os.path.relpath(rec['_path'], root)}: neither current ({why}) nor cited by a doc; "
               "fix: scripts/results.py prune --apply (git keeps it), or cite it in a doc" for rec, why in retention.dropped()]
    return (problems + dropped, []) if check else (problems, dropped)


def prune(root, apply):
    """Lists the records the retention rule does not keep; with apply, `git rm`s them."""
    retention, problems = load_tree(root)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 1
    dropped = retention.dropped()
    kept = len(retention.records) - len(dropped)
    for rec, why in dropped:
        print(f"{'removed' if apply else 'remove'} {os.path.relpath(rec['_path'], root)}: not current ({why}) and cited nowhere")
    print(f"{kept} of {len(retention.records)} records kept (current or cited), {len(dropped)} "
          + ("removed with git rm" if apply else "to remove (scripts/results.py prune --apply)"))
    if apply and dropped:
        p = subprocess.run(["git", "-C", root, "rm", "-q", "--"] + [os.path.relpath(r["_path"], root) for r, _ in dropped],
                           capture_output=True, text=True)
        if p.returncode != 0:
            print(f"error: git rm failed: {p.stderr.strip()}; fix: run it in the repository's checkout", file=sys.stderr)
            return 1
    return 0


ERROR_LINE_RE = re.compile(r"\b\w*(Error|Exception|Timeout)\b:? ")
PYTEST_RE = re.compile(r"^\S*::(test_\w+)(\[[^\]]*\])? (PASSED|FAILED|SKIPPED|ERROR)\b")
SECTION_RE = re.compile(r"^_{3,} (test_\w+)(\[[^\]]*\])? _{3,}$")


def first_error(lines):
    """The most telling error line of a failure's output: the last 'XxxError: ...' line, else
    the first non-empty one."""
    text = [l.strip() for l in lines if l.strip()]
    errs = [l for l in text if ERROR_LINE_RE.search(l)]
    return (errs[-1] if errs else text[0] if text else "failed (no error line in the log)")[:300]


def first_traceback_error(lines):
    """The exception line that ends the first Python traceback in `lines` (a failure's captured
    stderr), or None. Ranks print their tracebacks as they fail, so the first one is the cause:
    the error pytest shows is the one torch's spawn picked, often a rank that failed after it."""
    in_tb = False
    for line in lines:
        if line.startswith("Traceback (most recent call last):"):
            in_tb = True
        elif in_tb and line.strip() and not line[0].isspace():
            return line.strip()[:300]
    return None


def rows_from_pytest(log_text, ranks):
    """Result rows from one `pytest -v -rs` log of python/tests/gpu at `ranks` ranks. A failed
    row's first_error is the first traceback's error in the test's captured stderr (the rank that
    failed first), else the most telling `E` line of pytest's report."""
    rows, sections, stderr, current, in_stderr = [], {}, {}, None, False
    for line in log_text.splitlines():
        m = SECTION_RE.match(line)
        if m:
            current = m.group(1) + (m.group(2) or "")  # a parametrized test keeps its id: test_x[intranode]
            sections[current], stderr[current], in_stderr = [], [], False
        elif current and line.startswith("E "):
            sections[current].append(line[1:])
        elif current and line.startswith("----") and "Captured" in line:
            in_stderr = "Captured stderr" in line
        elif current and line.startswith("===="):
            current = None
        elif current and in_stderr:
            stderr[current].append(line)
    for line in log_text.splitlines():
        m = PYTEST_RE.match(line)
        if not m:
            continue
        name, status = m.group(1) + (m.group(2) or ""), m.group(3)
        st = {"PASSED": "pass", "SKIPPED": "skip"}.get(status, "fail")
        err = (first_traceback_error(stderr.get(name, [])) or first_error(sections.get(name, []))) if st == "fail" else None
        rows.append({"suite": f"python/tests/gpu::{name}", "ranks": ranks, "status": st, "seconds": None,
                     "first_error": err, "detail": ""})
    return rows


PYTEST_DESELECTED_RE = re.compile(r"collected (\d+) items? / (\d+) deselected")


def pytest_selection(log_text):
    """'1 of 15 tests selected (pytest -k/-m)' when the log shows deselected tests, else None."""
    m = PYTEST_DESELECTED_RE.search(log_text)
    if not m or not int(m.group(2)):
        return None
    total, off = int(m.group(1)), int(m.group(2))
    return f"{total - off} of {total} tests selected (pytest -k/-m)"


def rows_from_conformance(summary_text, test_args=""):
    """Result rows from deepep-conformance.sh's summary.txt; `test_args` (its --test-args) are
    part of each row's suite: the same file with other arguments is another suite."""
    rows = []
    for line in summary_text.splitlines():
        f = line.split()
        if len(f) < 6 or f[0] not in ("ours", "deepep") or not f[1].endswith(".py"):
            if rows and rows[-1]["status"] == "fail" and line.startswith("    "):
                rows[-1]["_lines"].append(line)
            continue
        lib, test, nproc, result, secs = f[:5]
        hosts, _, per = nproc.rpartition("x")
        ranks = int(per) * (int(hosts) if hosts else 1)
        suite = (("ours: " if lib == "ours" else "DeepEP: ") + test + (f" {test_args.strip()}" if test_args.strip() else "")
                 + (f", {hosts} emulated hosts x {per} ranks" if hosts else ""))
        st = "pass" if result.startswith("PASS") else "fail"
        rows.append({"suite": suite, "ranks": ranks, "status": st, "seconds": float(secs), "first_error": None,
                     "detail": "" if result == "PASS" else result, "_lines": []})
    for r in rows:
        lines = r.pop("_lines")
        if r["status"] == "fail":
            r["first_error"] = first_error(lines) if lines else r["detail"]
    return rows


def machine_auto():
    """'1x NVIDIA H200 (driver 580.159.04), CUDA 13.0, torch 2.11.0+cu130' from nvidia-smi and torch."""
    parts = []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        gpus = [l.split(", ") for l in out.splitlines() if l.strip()]
        if gpus:
            parts.append(f"{len(gpus)}x {gpus[0][0]} (driver {gpus[0][1]})")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda, torch.__version__)"],
                             capture_output=True, text=True, timeout=120).stdout.split()
        if len(out) == 2:
            parts.append(f"CUDA {out[0]}, torch {out[1]}")
    except (OSError, subprocess.SubprocessError):
        pass
    return ", ".join(parts) or "unknown machine (nvidia-smi and torch not found)"


RESULT_SPEC_RE = re.compile(r"^(.+?):(\d+):(pass|fail|skip):(-|\d+(?:\.\d*)?)?(?::(.*))?$", re.S)


def parse_result(spec):
    """A row from SUITE:RANKS:STATUS:SECONDS[:DETAIL]; SUITE and DETAIL may hold ':'."""
    m = RESULT_SPEC_RE.match(spec)
    if not m:
        raise argparse.ArgumentTypeError(f"--result '{spec}' is not SUITE:RANKS:STATUS:SECONDS[:DETAIL] "
                                         "(RANKS a whole number, STATUS pass, fail or skip, SECONDS a number or '-')")
    suite, ranks, status, seconds, detail = m.group(1), int(m.group(2)), m.group(3), m.group(4), m.group(5) or ""
    secs = None if seconds in (None, "-") else float(seconds)
    return {"suite": suite, "ranks": ranks, "status": status, "seconds": secs,
            "first_error": detail if status == "fail" else None, "detail": "" if status == "fail" else detail}


# The library's knobs (docs/python.md, "Knobs"): the settings that change how a run behaves.
KNOB_NAME = re.compile(r"DEEPEP_(KERNELS_[A-Z_]+|GPU_TIMEOUT_MS|HOST_TIMEOUT_S|SHARED_GPU_GRIDS)")


def with_knobs(command, environ):
    """``command`` preceded by the knobs set in ``environ`` (``NAME=VALUE `` each, sorted)."""
    return "".join(f"{k}={v} " for k, v in sorted(environ.items()) if KNOB_NAME.fullmatch(k)) + command


def main(argv=None):
    default_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "validate":
        if len(argv) < 2:
            print("results.py validate: name one or more record files", file=sys.stderr)
            return 2
        bad = 0
        for p in argv[1:]:
            try:
                validate(p)
                print(f"ok {p}")
            except (RecordError, OSError) as e:
                print(f"error: {e}", file=sys.stderr)
                bad += 1
        return 1 if bad else 0
    if argv and argv[0] == "prune":
        ap = argparse.ArgumentParser(prog="results.py prune", description="list (--apply: git rm) the records that are neither current nor cited")
        ap.add_argument("--apply", action="store_true", help="git rm them (git keeps their history)")
        ap.add_argument("--root", default=default_root, help="repository root (default: %(default)s)")
        a = ap.parse_args(argv[1:])
        return prune(a.root, a.apply)
    if argv and argv[0] in ("new", "from-pytest", "from-conformance"):
        sub = argv[0]
        kind = {"from-pytest": "gpu-tests", "from-conformance": "conformance"}.get(sub)
        now = datetime.datetime.now(datetime.timezone.utc)
        ap = argparse.ArgumentParser(prog=f"results.py {sub}", description=f"write a schema-{SCHEMA} record (kernels/TESTING.md, 'Results as data')")
        if sub == "new":
            ap.add_argument("--kind", required=True, choices=KINDS)
            ap.add_argument("--result", action="append", type=parse_result, default=[],
                            help="a row SUITE:RANKS:STATUS:SECONDS[:DETAIL] (SUITE may hold ':'; '-' for unknown seconds; for fail, DETAIL is the first error)")
            ap.add_argument("--figures", metavar="FILE", help="a JSON list of figures (name, value, unit, baseline, baseline_value, note)")
            ap.add_argument("--suite", action="append", default=[],
                            help="what ran (repeat for several); default: the suites of the --result rows")
            ap.add_argument("--ranks", help="the rank counts each --suite ran, e.g. 2,4,8 (required with --suite)")
        else:
            ap.add_argument("inputs", nargs="+", metavar="LOG",
                            help="gpu-ranks<N>.log files" if sub == "from-pytest" else "summary.txt of deepep-conformance.sh")
        if sub == "from-pytest":
            ap.add_argument("--suite", default="python/tests/gpu", help="what ran (default: %(default)s)")
        if sub == "from-conformance":
            ap.add_argument("--test-args", default="", metavar="ARGS",
                            help="the --test-args the test files ran with (write --test-args=ARGS when ARGS starts with '-'): part of each suite's name")
        ap.add_argument("--part", help="which part of the suite ran, when not all of it (e.g. '-k wrong_argument'); "
                                       "from-pytest sees deselected tests in the logs by itself")
        ap.add_argument("--commit", required=True)
        ap.add_argument("--machine", required=True, help="what ran where; 'auto' asks nvidia-smi and torch")
        ap.add_argument("--machine-kind", help="<GPUs>x<model>, e.g. 1xH200 (default: from --machine)")
        ap.add_argument("--command", required=True)
        ap.add_argument("--nvshmem")
        ap.add_argument("--date", help="UTC date of the run (default: today)")
        ap.add_argument("--time", help="UTC time the run started, HH:MM (default: now, unless --date is given)")
        ap.add_argument("--slug", default="run")
        ap.add_argument("--notes", default="")
        ap.add_argument("--out", default=os.path.join(default_root, "kernels", "results"))
        a = ap.parse_args(argv[1:])
        rows = a.result if sub == "new" else []
        ranks_seen = []
        selected = None  # from-pytest: "N of M tests selected" when a log shows deselected tests
        try:
            for path in ([] if sub == "new" else a.inputs):
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                if sub == "from-conformance":
                    rows += rows_from_conformance(text, a.test_args)
                    continue
                m = re.search(r"(\d+)\D*$", os.path.basename(path).rsplit(".", 1)[0])
                if not m:
                    print(f"error: {path}: the rank count is not in the file name (gpu-ranks<N>.log)", file=sys.stderr)
                    return 2
                ranks_seen.append(int(m.group(1)))
                rows += rows_from_pytest(text, int(m.group(1)))
                selected = selected or pytest_selection(text)
            figures = []
            if sub == "new" and a.figures:
                with open(a.figures, encoding="utf-8") as f:
                    figures = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if sub != "new" and not rows:
            print(f"error: no test results in {', '.join(a.inputs)}; fix: pass the logs the run wrote", file=sys.stderr)
            return 1
        part = a.part or selected
        if sub == "from-pytest":
            runs = [{"suite": a.suite, "part": part, "ranks": sorted(set(ranks_seen))}]
        elif sub == "new" and a.suite:
            try:
                ranks = [int(n) for n in (a.ranks or "").replace(" ", ",").split(",") if n]
            except ValueError:
                ranks = []
            if not ranks:
                print(f"error: --ranks '{a.ranks or ''}': give the rank counts each --suite ran, e.g. --ranks 2,4,8", file=sys.stderr)
                return 2
            runs = [{"suite": suite, "part": part, "ranks": ranks} for suite in a.suite]
        else:  # the suites of the rows, each with the rank counts it ran at
            runs = []
            for row in rows:
                run = next((r for r in runs if r["suite"] == row["suite"]), None)
                if run is None:
                    runs.append({"suite": row["suite"], "part": part, "ranks": [row["ranks"]]})
                elif row["ranks"] not in run["ranks"]:
                    run["ranks"].append(row["ranks"])
            for run in runs:
                run["ranks"].sort()
            if not runs:
                print("error: the record names no suite; fix: pass --suite NAME --ranks R (e.g. --suite 'bench.py --mode ll' --ranks 1) or --result rows", file=sys.stderr)
                return 2
        kind = a.kind if sub == "new" else kind
        machine = machine_auto() if a.machine == "auto" else a.machine
        machine_kind = a.machine_kind or machine_kind_of(machine)
        if not machine_kind:
            print(f"error: --machine '{machine}' does not start with '<GPUs>x <model>'; fix: pass --machine-kind, e.g. 1xH200", file=sys.stderr)
            return 2
        date = a.date or now.strftime("%Y-%m-%d")
        time = a.time or (None if a.date else now.strftime("%H:%M"))
        rec = {"schema": SCHEMA, "kind": kind, "date": date}
        if time:
            rec["time"] = time
        rec.update({"commit": a.commit, "machine": machine, "machine_kind": machine_kind, "command": a.command if sub == "new" else with_knobs(a.command, os.environ)})
        if a.nvshmem:
            rec["nvshmem"] = a.nvshmem
        rec.update({"runs": runs, "results": rows, "figures": figures, "notes": a.notes})
        path = os.path.join(a.out, f"{date}-{kind}-{a.slug}.json")
        try:
            validate(path, rec)
        except RecordError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        os.makedirs(a.out, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=2)
            f.write("\n")
        print(path)
        return 0
    ap = argparse.ArgumentParser(prog="results.py", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare instead of rewriting; exit 1 on drift or on a record that is neither current nor cited")
    ap.add_argument("--root", default=default_root, help="repository root (default: %(default)s)")
    a = ap.parse_args(argv)
    problems, notes = sync_docs(a.root, a.check)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    for p in notes:
        print(f"note: {p}", file=sys.stderr)
    if problems:
        return 1
    if a.check:
        print("results: every record is valid, current or cited, and every doc's tables match the records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
