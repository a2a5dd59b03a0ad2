#!/usr/bin/env python3
"""GPU results as data: validate kernels/results/*.json and render the docs' tables from them.

Usage:
  scripts/results.py                 validate every record, then rewrite the tables between the
                                     docs' marker comments (README.md, docs/*.md, kernels/*.md)
  scripts/results.py --check         validate, and exit 1 when a doc's table differs from what
                                     the records give (CI runs this through python/tests)
  scripts/results.py validate FILE.. validate the named records only
  scripts/results.py new --kind K --commit C --machine M --command CMD [--nvshmem V]
                     [--result SUITE:RANKS:STATUS:SECONDS[:DETAIL]]... [--notes TEXT] [--out DIR]
                                     write a record
  scripts/results.py from-pytest LOG... --commit C --machine M --command CMD [--slug S] [--out DIR]
                                     a gpu-tests record from the `pytest -v` logs of
                                     python/tests/gpu, one per rank count (gpu-ranks<N>.log)
  scripts/results.py from-conformance SUMMARY --commit C --machine M --command CMD [...]
                                     a conformance record from deepep-conformance.sh's summary.txt
  (python/scripts/gpu-run.sh and deepep-conformance.sh call these with RECORD=1; --machine auto
  asks nvidia-smi and torch)
Options: --root DIR (the repository; default: this script's parent folder).

A record is kernels/results/<YYYY-MM-DD>-<kind>-<slug>.json, schema 1 (kernels/TESTING.md,
"Results as data"). A doc holds a rendered table between
  <!-- results:table KIND [suite=PREFIX] [record=NAME] -->  and  <!-- /results -->
KIND gpu-tests / conformance / nvshmem-matrix: the latest row per (suite, ranks) (per release,
suite, ranks for nvshmem-matrix) over all records of the kind, with a provenance line per record;
KIND bench with record=NAME (the file name without .json): that record's figures.
Exit status: 0 ok, 1 a record is invalid or a table drifted, 2 usage errors.
"""
import argparse
import datetime
import json
import os
import re
import sys

SCHEMA = 1
KINDS = ("gpu-tests", "conformance", "bench", "nvshmem-matrix")
STATUSES = ("pass", "fail", "skip")
TOP_FIELDS = {
    "schema": "int",
    "kind": "str",
    "date": "str",
    "commit": "str",
    "machine": "str",
    "command": "str",
    "results": "list",
    "figures": "list",
    "notes": "str",
}
OPTIONAL_TOP = {"nvshmem": "str"}
RESULT_FIELDS = ("suite", "ranks", "status", "seconds", "first_error", "detail")
FIGURE_FIELDS = ("name", "value", "unit", "baseline", "baseline_value", "note")
NAME_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})-([a-z0-9][a-z0-9._-]*)\.json$")
MARKER_RE = re.compile(r"^<!-- results:table ([^>\n]*?) -->\n(.*?)^<!-- /results -->", re.S | re.M)
OPEN_RE = re.compile(r"^<!-- results:table", re.M)
DOC_GLOBS = ("README.md", "docs", "kernels", "python")


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
    if data["schema"] != SCHEMA:
        bad("schema", f"is {data['schema']}, this tool reads schema {SCHEMA}", f"set \"schema\": {SCHEMA} (or update scripts/results.py)")
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
        if not isinstance(row["detail"], str):
            bad(f"{where}.detail", "is not a string", "write e.g. \"37 passed\" (\"\" when there is nothing to add)")
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
    """Every record under results_dir, validated, sorted oldest first (date, then file name)."""
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
    records.sort(key=lambda r: (r["date"], r["_name"]))
    return records, errors


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


def render_rows_table(kind, records, doc_dir, suite_prefix=None):
    """Latest row per key over the records of one kind, a numbered provenance line per record."""
    latest = {}
    for rec in records:  # oldest first: a later record replaces an earlier row
        if rec["kind"] != kind:
            continue
        for row in rec["results"]:
            if suite_prefix and not row["suite"].startswith(suite_prefix):
                continue
            key = (rec.get("nvshmem", ""), row["suite"], row["ranks"]) if kind == "nvshmem-matrix" else ("", row["suite"], row["ranks"])
            latest[key] = (row, rec)
    what = f"{kind} records" + (f" with a suite starting '{suite_prefix}'" if suite_prefix else "")
    if not latest:
        return f"No record yet ({what} under kernels/results/).\n"
    if kind == "nvshmem-matrix":
        keys = sorted(latest, key=lambda k: (_version_key(k[0]), k[1], k[2]))
        head = "| NVSHMEM | suite | ranks | status | seconds | first error | detail | source |\n|---|---|---|---|---|---|---|---|\n"
    else:
        keys = sorted(latest, key=lambda k: (k[1], k[2]))
        head = "| suite | ranks | status | seconds | first error | detail | source |\n|---|---|---|---|---|---|---|\n"
    sources = []
    lines = []
    for k in keys:
        row, rec = latest[k]
        if rec["_name"] not in sources:
            sources.append(rec["_name"])
        n = sources.index(rec["_name"]) + 1
        cells = [row["suite"], row["ranks"], row["status"].upper(), _fmt_num(row["seconds"]),
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


def render_block(spec, records, doc_path):
    """The rendered body for one marker's spec, e.g. 'gpu-tests suite=deepep-gpu-tests'."""
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
        return render_rows_table(kind, [r for r in records if r["_name"] == opts["record"]], doc_dir, opts.get("suite"))
    return render_rows_table(kind, records, doc_dir, opts.get("suite"))


def render_doc(text, records, doc_path):
    """The doc's text with every marker's body re-rendered."""
    def sub(m):
        return f"<!-- results:table {m.group(1)} -->\n" + render_block(m.group(1), records, doc_path) + "<!-- /results -->"
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


def sync_docs(root, check):
    """Renders every doc's tables; returns a list of problems (drift in check mode, errors)."""
    records, problems = load_records(os.path.join(root, "kernels", "results"))
    if problems:
        return problems
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
            new = render_doc(text, records, doc)
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
    return problems


ERROR_LINE_RE = re.compile(r"\b\w*(Error|Exception|Timeout)\b:? ")
PYTEST_RE = re.compile(r"^\S*::(test_\w+)(\[[^\]]*\])? (PASSED|FAILED|SKIPPED|ERROR)\b")
SECTION_RE = re.compile(r"^_{3,} (test_\w+)(\[[^\]]*\])? _{3,}$")


def first_error(lines):
    """The most telling error line of a failure's output: the last 'XxxError: ...' line, else
    the first non-empty one."""
    text = [l.strip() for l in lines if l.strip()]
    errs = [l for l in text if ERROR_LINE_RE.search(l)]
    return (errs[-1] if errs else text[0] if text else "failed (no error line in the log)")[:300]


def rows_from_pytest(log_text, ranks):
    """Result rows from one `pytest -v -rs` log of python/tests/gpu at `ranks` ranks."""
    rows, sections, current = [], {}, None
    for line in log_text.splitlines():
        m = SECTION_RE.match(line)
        if m:
            current = m.group(1)
            sections[current] = []
        elif current and line.startswith("E "):
            sections[current].append(line[1:])
    for line in log_text.splitlines():
        m = PYTEST_RE.match(line)
        if not m:
            continue
        name, status = m.group(1), m.group(3)
        st = {"PASSED": "pass", "SKIPPED": "skip"}.get(status, "fail")
        err = first_error(sections.get(name, [])) if st == "fail" else None
        rows.append({"suite": f"python/tests/gpu::{name}", "ranks": ranks, "status": st, "seconds": None,
                     "first_error": err, "detail": ""})
    return rows


def rows_from_conformance(summary_text):
    """Result rows from deepep-conformance.sh's summary.txt."""
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
        suite = ("ours: " if lib == "ours" else "DeepEP: ") + test + (f", {hosts} emulated hosts x {per} ranks" if hosts else "")
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
    import subprocess
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


def parse_result(spec):
    parts = spec.split(":", 4)
    if len(parts) < 4:
        raise argparse.ArgumentTypeError(f"--result '{spec}' is not SUITE:RANKS:STATUS:SECONDS[:DETAIL]")
    suite, ranks, status, seconds = parts[:4]
    detail = parts[4] if len(parts) > 4 else ""
    try:
        ranks_n = int(ranks)
        secs = None if seconds in ("", "-") else float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--result '{spec}': RANKS must be a whole number and SECONDS a number or '-'")
    first_error = detail if status == "fail" else None
    return {"suite": suite, "ranks": ranks_n, "status": status, "seconds": secs,
            "first_error": first_error, "detail": "" if status == "fail" else detail}


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
    if argv and argv[0] in ("new", "from-pytest", "from-conformance"):
        sub = argv[0]
        kind = {"from-pytest": "gpu-tests", "from-conformance": "conformance"}.get(sub)
        ap = argparse.ArgumentParser(prog=f"results.py {sub}", description="write a schema-1 record")
        if sub == "new":
            ap.add_argument("--kind", required=True, choices=KINDS)
            ap.add_argument("--result", action="append", type=parse_result, default=[])
        else:
            ap.add_argument("inputs", nargs="+", metavar="LOG",
                            help="gpu-ranks<N>.log files" if sub == "from-pytest" else "summary.txt of deepep-conformance.sh")
        ap.add_argument("--commit", required=True)
        ap.add_argument("--machine", required=True, help="what ran where; 'auto' asks nvidia-smi and torch")
        ap.add_argument("--command", required=True)
        ap.add_argument("--nvshmem")
        ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
        ap.add_argument("--slug", default="run")
        ap.add_argument("--notes", default="")
        ap.add_argument("--out", default=os.path.join(default_root, "kernels", "results"))
        a = ap.parse_args(argv[1:])
        rows = a.result if sub == "new" else []
        try:
            for path in ([] if sub == "new" else a.inputs):
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                if sub == "from-conformance":
                    rows += rows_from_conformance(text)
                    continue
                m = re.search(r"(\d+)\D*$", os.path.basename(path).rsplit(".", 1)[0])
                if not m:
                    print(f"error: {path}: the rank count is not in the file name (gpu-ranks<N>.log)", file=sys.stderr)
                    return 2
                rows += rows_from_pytest(text, int(m.group(1)))
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if sub != "new" and not rows:
            print(f"error: no test results in {', '.join(a.inputs)}; fix: pass the logs the run wrote", file=sys.stderr)
            return 1
        kind = a.kind if sub == "new" else kind
        machine = machine_auto() if a.machine == "auto" else a.machine
        rec = {"schema": SCHEMA, "kind": kind, "date": a.date, "commit": a.commit, "machine": machine,
               "command": a.command}
        if a.nvshmem:
            rec["nvshmem"] = a.nvshmem
        rec.update({"results": rows, "figures": [], "notes": a.notes})
        path = os.path.join(a.out, f"{a.date}-{kind}-{a.slug}.json")
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
    ap.add_argument("--check", action="store_true", help="compare instead of rewriting; exit 1 on drift")
    ap.add_argument("--root", default=default_root, help="repository root (default: %(default)s)")
    a = ap.parse_args(argv)
    problems = sync_docs(a.root, a.check)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 1
    if a.check:
        print("results: every record is valid and every doc's tables match the records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
