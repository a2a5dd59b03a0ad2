#!/usr/bin/env python3
"""Time deepep_kernels through its Python API the way DeepEP's tests time DeepEP.

Usage (GPU machine, the wheel on PYTHONPATH or installed):
    python3 python/scripts/bench.py [--ranks 2] [--gpus N] [--mode intranode|ll|all]
        [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256] [--num-sms 24]
        [--ll-tokens 128] [--ll-experts 288] [--reps 30] [--warmup 5] [--no-profile] [--json FILE]

  Side by side with a real DeepEP build (DIR holds the `deep_ep` package and `deep_ep_cpp*.so`,
  e.g. the --target folder of DeepEP's `pip install --no-build-isolation --no-deps --target DIR .`):
    python3 python/scripts/bench.py --compare-deep-ep DIR [--ranks 1] [--mode ll|intranode|all]
        [--calls 300] [--call-warmup 30] [--normal-calls 50] [--rounds 1] [--no-graph] [--json FILE]
        (and the shape options above)

  V2 vs V1 side by side (ours: DeepEP 2.1's ElasticBuffer vs DeepEP v1.2.1's Buffer, intranode):
    python3 python/scripts/bench.py --mode v2 --ranks 2 [--gpus N]
        [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256] [--num-sms 24]
        [--normal-calls 50] [--call-warmup 30] [--reps 30] [--warmup 5] [--rounds 1] [--no-profile] [--json FILE]

Per op: the median of ``--reps`` repetitions after ``--warmup`` warm-ups, CUDA events around each
call on the current stream (so the binding, the stream joins and, for dispatch, the copy of the
outputs into torch-owned tensors are inside), the L2 flushed between repetitions, the slowest
rank; GB/s over the bytes each rank receives (DeepEP's "NVL GB/s": received rows x hidden x 2,
FP8 x (1 + 4/128) / 2, combine the same bytes as dispatch; LL: DeepEP's LL byte counts). With the
torch profiler (default on) the kernel time per call is also printed: the sum of the CUDA kernel
and memcpy durations of one repetition. Compare with the Rust figures of the same shapes in
kernels/BENCHMARKS.md (``deepep-bench``, whose outputs stay in the NVLink buffer: the zero-copy
figure). Ranks exchange through a gloo group; rank r uses GPU ``r * gpus // ranks``. ``--json
FILE`` also writes the rows (rank 0).

Side by side with DeepEP (``--compare-deep-ep DIR``)
----------------------------------------------------
The same calls, shapes and inputs go through real DeepEP (``import deep_ep`` with DIR first on
``sys.path``) and through ``deepep_kernels``, and one table prints, per op, DeepEP / ours and the
ratio ours / DeepEP of three statistics (each named in the table header; every figure is the
slowest rank's):

- device kernel time per call: the torch profiler (CUDA activity) around ``--calls`` back-to-back
  calls after ``--call-warmup`` warm-ups; the durations of every kernel, memcpy and memset in that
  region summed and divided by the number of calls (the two libraries' kernel names differ, so
  nothing is matched by name), plus the mean duration of the single largest kernel (by mean, the
  figure DeepEP's ``bench_kineto`` prints) with its name under the table;
- host time per call: ``time.perf_counter_ns()`` around ``--calls`` back-to-back calls with no
  synchronisation inside the loop, divided by the number of calls, after ``--call-warmup``
  warm-ups (the GPU work queues up; a call that waits for the GPU by design, the fresh normal
  dispatch, includes that wait);
- event time per call: CUDA events around each call, the median of ``--reps`` after
  ``--warmup`` warm-ups, the L2 flushed before each repetition (the statistic of the plain mode).

Ops: low-latency dispatch FP8, dispatch BF16 and combine BF16 (``--ll-tokens`` x ``--hidden``,
top-``--topk`` of ``--ll-experts``; default 128 x 7168, top-8 of 288, DeepEP's
test_low_latency.py defaults), any rank count, ``--ranks 1`` included; then, unless
``--no-graph``, dispatch + combine BF16 captured once per library in one CUDA graph and replayed
(the three statistics per replay). With ``--ranks`` >= 2 also the normal (intranode) ops: fresh
BF16 dispatch (layout + dispatch), cached BF16 and cached FP8 dispatch, and combine BF16
(``--tokens`` x ``--hidden``, top-``--topk`` of ``--experts``, default 4096 x 7168, top-8 of
256, each library's default dispatch/combine Config for the rank count with ``--num-sms`` SMs).
The normal ops use ``--normal-calls`` back-to-back calls for the first two statistics (a long
queue of 4096-token calls would fill the launch queue and block the host). Each library sizes
its Buffers with its own size hints (``Config.get_nvl_buffer_size_hint``, the larger of the
dispatch and combine configs'; ``Buffer.get_low_latency_rdma_size_hint``) and creates them with
``explicitly_destroy=True``, destroying each before the next. Inputs come from the same seeds
in both libraries (seed = rank for the normal ops, 100 + rank for low latency, drawn before any
library call); their SHA-256 per rank is recorded and the report says whether both libraries
got identical bytes. When ranks share a GPU the table is headed by ``NOT PERFORMANCE: N ranks
share one GPU; ratios only``. ``--json FILE`` writes every run's rows, the per-rank figures and
the combined table.

Design: one set of rank processes per library, run one after the other in this invocation
(DeepEP's ranks first, then ours; with ``--rounds K`` the order alternates DeepEP, ours, ours,
DeepEP, ... and the table gives the median and range over the rounds), each writing its rows to
a file that this process reads and joins into the table. Not both libraries in one process:
NVSHMEM is a per-process singleton and each library loads its own ``libnvshmem_host.so.3``
(whichever the loader finds first would serve both, and our package refuses one other than its
cubins' release); initialising NVSHMEM again after DeepEP's ``destroy()`` finalised it in the
same process is not something NVSHMEM promises; and separate processes also keep the CUDA
context, torch's caching allocator and the environment variables each library sets
(``NVSHMEM_*``) from leaking from one library's figures into the other's. The cost is that the
two libraries run seconds apart rather than interleaved: same GPU, same shapes, same inputs,
not the same instant (``--rounds`` shows the drift).

V2 vs V1 (``--mode v2``)
------------------------
The same machinery, statistics and table, with our two APIs in place of the two libraries (each
cell V1 / V2, the ratio V2 / V1): V1 is ``deepep_kernels.Buffer`` (intranode normal mode, set up as
the normal ops above: its default configs with ``--num-sms`` SMs, NVLink bytes from its size hint),
V2 is ``deepep_kernels.elastic.ElasticBuffer`` (sized by its hint for ``--tokens`` x ``--hidden``, top-``--topk``). BF16, ``--tokens``
x ``--hidden`` per rank, top-``--topk`` of ``--experts``, the normal ops' inputs (seed = rank),
``--normal-calls`` back-to-back calls, ``--ranks`` >= 2 (ranks may share one GPU: then the table
is headed by the NOT PERFORMANCE line). Ops, each through both APIs:

- fresh dispatch: V1 ``get_dispatch_layout`` + ``dispatch`` (topk_idx, topk_weights); V2
  ``dispatch(x, topk_idx=, topk_weights=, num_experts=--experts, num_max_tokens_per_rank=--tokens,
  num_sms=--num-sms, do_cpu_sync=True)``;
- fresh dispatch without a CPU sync: V2 ``do_cpu_sync=False`` (worst-case output sizes); V1 has
  none, its cell is V1's fresh dispatch measured again;
- cached dispatch: ``handle=`` of a first fresh (V2: synced) dispatch;
- combine: that dispatch's rows and handle (V2: the plain handle);
- dispatch + combine: a fresh (synced) dispatch, then the combine of its rows, per call.

Under the table the issue's criterion is read off the dispatch + combine row: V2's device kernel
time at most 1.1x V1's, V2's host time per call at most V1's (met / NOT met, the ratios).
``--json FILE`` writes the document of ``--compare-deep-ep`` (``meta`` with ``mode``, ``shapes``
and ``criterion``, every run's rows, the table with ``ratio_v2_over_v1``).
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

# The two libraries of --compare-deep-ep, by import name, and how the report names them.
LIB_DEEP_EP = "deep_ep"
LIB_OURS = "deepep_kernels"
LIBRARIES = (LIB_DEEP_EP, LIB_OURS)
LABELS = {LIB_DEEP_EP: "DeepEP", LIB_OURS: "ours"}
# The two APIs of --mode v2 (both ours, each in its own rank processes), and how the report names them.
LIB_V1 = "deepep_kernels.Buffer"
LIB_V2 = "deepep_kernels.elastic.ElasticBuffer"
V_LIBRARIES = (LIB_V1, LIB_V2)
LABELS.update({LIB_V1: "V1", LIB_V2: "V2"})
# The key of a table entry's ratio (second library / first), per pair of libraries.
RATIO_KEYS = {LIBRARIES: "ratio_ours_over_deep_ep", V_LIBRARIES: "ratio_v2_over_v1"}
# Statistics of a compare row: JSON key, the column header (formatted with the group's counts).
STATS = (
    ("kernel_us", "device kernel time per call, us (torch profiler: all kernels + memcpys + memsets of {calls} back-to-back "
                  "calls, summed, / {calls}; after {call_warmup} warm-ups)"),
    ("largest_kernel_mean_us", "largest kernel, mean us (torch profiler, same calls)"),
    ("host_us", "host time per call, us (perf_counter_ns around {calls} back-to-back calls, no sync inside, / {calls}; "
                "after {call_warmup} warm-ups)"),
    ("event_us", "event time per call, us (CUDA events around each call, median of {reps} after {warmup} warm-ups, "
                 "L2 flushed before each)"),
)
# Device activities the profiler may report that are not GPU work of the call (synchronisation).
_SYNC_ACTIVITIES = ("Stream Sync", "Event Sync", "Context Sync", "Stream Wait Event", "Device Sync")
GROUP_LL = "low-latency"
GROUP_NORMAL = "intranode"
GROUP_V2 = "V2 vs V1"
# The ops of --mode v2: (op, V1's callable, V2's callable), keys of v1_ops / v2_ops. V1 has no
# dispatch without a CPU sync: its row there is V1's fresh dispatch measured again.
V2_OPS = (
    ("dispatch BF16, fresh (V1: layout + dispatch; V2: do_cpu_sync=True)", "fresh", "fresh"),
    ("dispatch BF16, fresh, V2 do_cpu_sync=False (V1: its fresh dispatch again, always synced)", "fresh", "fresh_nosync"),
    ("dispatch BF16, cached (handle= of the fresh synced dispatch)", "cached", "cached"),
    ("combine BF16 (rows and handle of the fresh synced dispatch)", "combine", "combine"),
    ("dispatch + combine BF16 (fresh synced dispatch, then combine of its rows)", "pair", "pair"),
)
V2_PAIR_OP = V2_OPS[-1][0]
# The criterion on the pair: V2 / V1 at most this, per statistic.
V2_CRITERION = (("kernel_us", 1.1), ("host_us", 1.0))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible, at most --ranks)")
    p.add_argument("--mode", choices=["intranode", "ll", "all", "v2"], default="all",
                   help="intranode, ll, all (default), or v2: V2 (ElasticBuffer) vs V1 (Buffer) side by side, intranode, "
                        "BF16, the statistics of --compare-deep-ep (needs --ranks >= 2)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--ll-experts", type=int, default=288)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON to FILE")
    c = p.add_argument_group("side by side with DeepEP (and --mode v2)")
    c.add_argument("--compare-deep-ep", metavar="DIR", default=None,
                   help="run the same calls through the real DeepEP in DIR (holding deep_ep/ and deep_ep_cpp*.so) and through ours")
    c.add_argument("--calls", type=int, default=300, help="back-to-back calls for the profiler and host-time statistics (low latency)")
    c.add_argument("--normal-calls", type=int, default=50, help="the same for the normal (intranode) ops")
    c.add_argument("--call-warmup", type=int, default=30, help="warm-up calls before the profiled and the host-timed calls")
    c.add_argument("--rounds", type=int, default=1, help="run each library this many times, alternating (DeepEP, ours, ours, DeepEP, ...)")
    c.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph row (LL dispatch + combine BF16, per replay)")
    return p.parse_args(argv)


def deep_ep_dir_problem(path):
    """Why ``path`` is not a folder holding a built DeepEP (None when it looks like one)."""
    if not os.path.isdir(path):
        return f"--compare-deep-ep {path}: not a directory"
    if not os.path.isfile(os.path.join(path, "deep_ep", "__init__.py")):
        return f"--compare-deep-ep {path}: no deep_ep/__init__.py there (point it at the folder that holds the deep_ep package)"
    if not any(f.startswith("deep_ep_cpp") and f.endswith(".so") for f in os.listdir(path)):
        return (f"--compare-deep-ep {path}: no deep_ep_cpp*.so there (a built DeepEP: pip install --no-build-isolation --no-deps "
                "--target DIR . in its checkout)")
    for f in ("__init__.py", "buffer.py"):
        src = os.path.join(path, "deep_ep", f)
        if os.path.isfile(src):
            with open(src, encoding="utf-8", errors="replace") as fh:
                if "deepep_kernels" in fh.read():
                    return f"--compare-deep-ep {path}: its deep_ep is deepep_kernels' shim, not DeepEP"
    return None


def validate(args):
    """Problems with the arguments, as messages (empty when fine)."""
    out = []
    for name in ("ranks", "tokens", "hidden", "topk", "experts", "num_sms", "ll_tokens", "ll_experts", "reps"):
        if getattr(args, name) < 1:
            out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        out.append(f"--warmup must be >= 0, got {args.warmup}")
    if args.gpus < 0:
        out.append(f"--gpus must be >= 0 (0: all visible), got {args.gpus}")
    if args.mode == "v2":
        if args.compare_deep_ep is not None:
            out.append("--mode v2 compares our two APIs (V2 ElasticBuffer vs V1 Buffer); drop --compare-deep-ep, or pick another --mode")
        if args.ranks < 2:
            out.append(f"--mode v2 needs --ranks >= 2 (the intranode ops exchange between ranks; ranks may share one GPU), "
                       f"got --ranks {args.ranks}; use --ranks 2")
    elif args.compare_deep_ep is None:
        return out
    for name in ("calls", "normal_calls", "rounds"):
        if getattr(args, name) < 1:
            out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.call_warmup < 0:
        out.append(f"--call-warmup must be >= 0, got {args.call_warmup}")
    if args.hidden % 128 != 0 and args.mode != "v2":
        out.append(f"--hidden {args.hidden}: the FP8 ops need a multiple of 128")
    if args.ranks >= 1 and args.ll_experts % args.ranks != 0 and args.mode in ("ll", "all"):
        out.append(f"--ll-experts {args.ll_experts} must be a multiple of --ranks {args.ranks}")
    if args.ranks >= 2 and args.experts % args.ranks != 0 and args.mode in ("intranode", "all", "v2"):
        out.append(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if args.mode == "intranode" and args.ranks < 2:
        out.append("--mode intranode needs --ranks >= 2 (the normal ops exchange between ranks); use --mode ll at one rank")
    if args.num_sms % 2 != 0:
        out.append(f"--num-sms {args.num_sms} must be even (both libraries run num_sms / 2 channels)")
    problem = args.compare_deep_ep is not None and deep_ep_dir_problem(args.compare_deep_ep)
    if problem:
        out.append(problem)
    return out


def gpus_for(ranks, requested, visible):
    """GPUs the ranks spread over: --gpus (0: all visible), at most the ranks, at least one."""
    return max(1, min(requested or visible, ranks, visible))


def oversubscription_line(ranks, gpus):
    """The label that heads the table when ranks share a GPU (None when each rank has its own)."""
    if ranks <= gpus:
        return None
    where = "one GPU" if gpus == 1 else f"{gpus} GPUs"
    return f"NOT PERFORMANCE: {ranks} ranks share {where}; ratios only"


def run_order(rounds, libs=LIBRARIES):
    """(round, library) in run order: DeepEP, ours, then ours, DeepEP, ... (alternating, so a drift
    over the session weighs on both; V1, V2, V2, V1, ... with ``V_LIBRARIES``)."""
    order = []
    for r in range(rounds):
        order.extend((r, lib) for lib in (libs if r % 2 == 0 else libs[::-1]))
    return order


def summarize_device_events(events, calls):
    """Per-call device statistics from the profiler's device activities ``(name, duration_us)`` of
    ``calls`` calls: every kernel, memcpy and memset summed / calls, and the kernel with the
    largest mean duration (its name, mean, and how many times per call it ran)."""
    total, count = 0.0, 0
    kernels = {}
    for name, dur in events:
        if any(name.startswith(s) for s in _SYNC_ACTIVITIES):
            continue
        total += dur
        count += 1
        if name.startswith("Memcpy") or name.startswith("Memset"):
            continue
        k = kernels.setdefault(name, [0, 0.0])
        k[0] += 1
        k[1] += dur
    out = {"kernel_us": total / calls, "device_activities_per_call": count / calls,
           "largest_kernel": None, "largest_kernel_mean_us": None, "largest_kernel_per_call": None}
    if kernels:
        name, (n, tot) = max(kernels.items(), key=lambda kv: (kv[1][1] / kv[1][0], kv[0]))
        out.update(largest_kernel=name, largest_kernel_mean_us=tot / n, largest_kernel_per_call=n / calls)
    return out


def slowest(per_rank):
    """One rank-independent row from the per-rank statistics: the largest value of each figure
    (the slowest rank), the largest kernel of the rank with the largest one, the first error."""
    out = {}
    for key in ("kernel_us", "largest_kernel_mean_us", "host_us", "event_us", "device_activities_per_call"):
        vals = [s[key] for s in per_rank if s.get(key) is not None]
        out[key] = max(vals) if vals else None
    with_kernel = [s for s in per_rank if s.get("largest_kernel_mean_us") is not None]
    out["largest_kernel"] = max(with_kernel, key=lambda s: s["largest_kernel_mean_us"])["largest_kernel"] if with_kernel else None
    for key in ("error", "profiler_error"):
        errors = [f"rank {r}: {s[key]}" for r, s in enumerate(per_rank) if s.get(key)]
        out[key] = errors[0] if errors else None
    return out


def _median_range(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None, None, None
    return statistics.median(vals), min(vals), max(vals)


def build_table(runs, libs=LIBRARIES):
    """Join the rows of every run (``{"library", "round", "rows": [...]}``) into one entry per
    (group, op), in the order the ops first appear: per library the figures of every round and
    their median / min / max, and the ratio of the medians, second library / first (ours / DeepEP
    under ``ratio_ours_over_deep_ep``; with ``V_LIBRARIES`` V2 / V1 under ``ratio_v2_over_v1``)."""
    entries = {}
    for run in runs:
        lib = run["library"]
        for row in run.get("rows", []):
            key = (row["group"], row["op"])
            e = entries.get(key)
            if e is None:
                e = entries[key] = {"group": row["group"], "title": row.get("title"), "op": row["op"],
                                    "counts": {c: row.get(c) for c in ("calls", "call_warmup", "reps", "warmup")},
                                    "libraries": {lib_: {"rounds": []} for lib_ in libs}}
            e["libraries"][lib]["rounds"].append(row)
    for e in entries.values():
        for lib, d in e["libraries"].items():
            rows = d["rounds"]
            for key, _ in STATS:
                med, lo, hi = _median_range([r.get(key) for r in rows])
                d[key] = {"median": med, "min": lo, "max": hi, "n": len([r for r in rows if r.get(key) is not None])}
            names = [r.get("largest_kernel") for r in rows if r.get("largest_kernel")]
            d["largest_kernel"] = max(set(names), key=names.count) if names else None
            d["errors"] = [r["error"] for r in rows if r.get("error")]
            d["profiler_errors"] = [r["profiler_error"] for r in rows if r.get("profiler_error")]
            d["input_sha256"] = [list(t) for t in dict.fromkeys(tuple(r.get("input_sha256") or [None]) for r in rows)]
        ratios = {}
        for key, _ in STATS:
            a = e["libraries"][libs[0]][key]["median"]
            b = e["libraries"][libs[1]][key]["median"]
            ratios[key] = b / a if a and b is not None else None
        e[RATIO_KEYS[libs]] = ratios
    return list(entries.values())


def _fmt_us(stat, rounds):
    if stat["median"] is None:
        return "-"
    s = f"{stat['median']:.1f}"
    if rounds > 1 and stat["n"] > 1:
        s += f" [{stat['min']:.1f}-{stat['max']:.1f}]"
    return s


def format_cell(entry, key, rounds, libs=LIBRARIES):
    """``DeepEP / ours (ratio x)`` (``V1 / V2 (V2 / V1 x)``) for one statistic of one table entry."""
    a = _fmt_us(entry["libraries"][libs[0]][key], rounds)
    b = _fmt_us(entry["libraries"][libs[1]][key], rounds)
    r = entry[RATIO_KEYS[libs]][key]
    return f"{a} / {b}" + (f" ({r:.2f}x)" if r is not None else "")


def _short(name, width=90):
    return name if name is None or len(name) <= width else name[: width - 3] + "..."


def inputs_line(entries, libs=LIBRARIES):
    """Whether both libraries got the same input bytes, per group (from the recorded digests)."""
    parts = []
    for group in dict.fromkeys(e["group"] for e in entries):
        per_lib = {lib: [tuple(d) for e in entries if e["group"] == group for d in e["libraries"][lib]["input_sha256"]]
                   for lib in libs}
        seen = {d for ds in per_lib.values() for d in ds}
        if not all(per_lib.values()) or any(None in d for d in seen):
            parts.append(f"{group}: not checked")
        elif len(seen) == 1:
            parts.append(f"{group}: identical in both libraries")
        else:
            parts.append(f"{group}: DIFFER between the libraries (see the JSON)")
    return "inputs (SHA-256 of every rank's input tensors): " + "; ".join(parts)


def v2_criterion(entries):
    """The issue's criterion read off the --mode v2 table's pair row: per statistic of
    ``V2_CRITERION`` the ratio V2 / V1, its bound and whether it holds (None: not measured)."""
    pair = next((e for e in entries if e["op"] == V2_PAIR_OP), None)
    out = {}
    for key, bound in V2_CRITERION:
        r = pair[RATIO_KEYS[V_LIBRARIES]][key] if pair else None
        out[key] = {"ratio_v2_over_v1": r, "at_most": bound, "met": None if r is None else r <= bound}
    return out


def criterion_line(crit):
    parts = []
    for (key, bound), name in zip(V2_CRITERION, ("device kernel time", "host time per call")):
        c = crit[key]
        verdict = "not measured" if c["met"] is None else f"{c['ratio_v2_over_v1']:.2f}x, {'met' if c['met'] else 'NOT met'}"
        parts.append(f"{name} V2 / V1 <= {bound:g}x: {verdict}")
    return "criterion, dispatch + combine (fresh synced dispatch, then combine): " + "; ".join(parts)


def format_report(entries, meta, libs=LIBRARIES):
    """The side-by-side report: the NOT PERFORMANCE label when ranks share a GPU, what ran, then per
    group a title with the shape and a markdown table whose headers name the statistics (with
    ``V_LIBRARIES``: V1 / V2, then the issue's criterion on the pair row)."""
    lines = []
    over = oversubscription_line(meta["ranks"], meta["gpus"])
    if over:
        lines.append(over)
    first, second = (LABELS[lib] for lib in libs)
    what = (f"DeepEP: {meta.get('deep_ep') or '?'}; ours: {meta.get('ours') or '?'}" if libs == LIBRARIES else
            f"V1: {LIB_V1} (intranode), V2: {LIB_V2}, both from {meta.get('ours') or '?'}")
    lines.append(f"{what}; device: {meta.get('device') or '?'}; "
                 f"torch {meta.get('torch') or '?'}; {meta['rounds']} round(s); each cell {first} / {second} ({second} / {first}), "
                 "slowest rank" + ("; median [min-max] over the rounds" if meta["rounds"] > 1 else ""))
    if entries:
        lines.append(inputs_line(entries, libs))
    for note in meta.get("notes", []):
        lines.append(note)
    for group in dict.fromkeys(e["group"] for e in entries):
        rows = [e for e in entries if e["group"] == group]
        counts = rows[0]["counts"]
        fill = {k: ("?" if v is None else v) for k, v in counts.items()}
        lines.append("")
        lines.append(rows[0]["title"] or group)
        lines.append("")
        lines.append("| op | " + " | ".join(h.format(**fill) + f": {first} / {second}" for _, h in STATS) + " |")
        lines.append("|---" * (len(STATS) + 1) + "|")
        for e in rows:
            lines.append(f"| {e['op']} | " + " | ".join(format_cell(e, key, meta["rounds"], libs) for key, _ in STATS) + " |")
        lines.append("")
        if libs == V_LIBRARIES:
            lines.append(criterion_line(v2_criterion(rows)))
        for e in rows:
            names = [f"{LABELS[lib]} `{_short(e['libraries'][lib]['largest_kernel'])}`" for lib in libs
                     if e["libraries"][lib]["largest_kernel"]]
            if names:
                lines.append(f"largest kernel, {e['op']}: " + ", ".join(names))
            for lib in libs:
                for err in e["libraries"][lib]["errors"]:
                    lines.append(f"ERROR {LABELS[lib]}, {e['op']}: {_short(err, 300)}")
                for err in e["libraries"][lib]["profiler_errors"][:1]:
                    lines.append(f"no profiler figures, {LABELS[lib]}, {e['op']}: {_short(err, 300)}")
    for run in meta.get("failed_runs", []):
        lines.append(f"ERROR: the {LABELS[run['library']]} ranks of round {run['round'] + 1} failed: {_short(run['error'], 2000)}")
    return "\n".join(lines)


def write_json(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, path)


# --- GPU side (torch is imported inside the functions) -------------------------------------------


def time_op(torch, fn, reps, warmup, flush):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def kernel_us(torch, fn, profile):
    if not profile:
        return float("nan")
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in p.events():
        if e.device_type.name == "CUDA":
            total += e.device_time if hasattr(e, "device_time") else e.cuda_time
    return total


def device_stats(torch, fn, calls, warmup):
    """summarize_device_events over ``calls`` back-to-back calls under the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = []
    for e in p.events():
        kind = getattr(e.device_type, "name", str(e.device_type))
        if kind.upper().endswith("CUDA"):
            events.append((e.name, e.time_range.end - e.time_range.start))
    return summarize_device_events(events, calls)


def host_us(torch, fn, calls, warmup):
    """Host time per call: ``calls`` back-to-back calls, no synchronisation inside the loop."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    return (t1 - t0) / calls / 1e3


def input_digest(torch, tensors):
    """SHA-256 of the tensors' bytes (shape and dtype included), to check both libraries got the same."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{tuple(t.shape)} {t.dtype};".encode())
        raw = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
        try:
            h.update(raw.numpy().tobytes())
        except (ImportError, RuntimeError, TypeError):  # torch without numpy: not checked
            return None
    return h.hexdigest()


def switched(obj, attr, value, fn):
    """``fn`` with ``obj.attr`` set to ``value`` for the call only (e.g. a Buffer's ``_use_arena``)."""
    def run():
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        try:
            return fn()
        finally:
            setattr(obj, attr, old)
    return run


def cast_fp8(torch, x):
    """Per-token, per-128-channel FP8 (e4m3) cast: (values [n, h], float32 scales [n, h/128] row-major)."""
    n, h = x.shape
    blocks = x.float().view(n, h // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    q = (blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(n, h)
    return q, (amax / 448.0).contiguous()


def load_library(name, deep_ep_dir):
    """(Buffer, Config, where) of one library, in a rank process. DeepEP comes from DIR (put first on
    sys.path here, never in the parent, whose sys.path the spawned ranks inherit); ours from the
    installed wheel, with DIR kept off sys.path (V1 and V2 of --mode v2: ours, no DIR)."""
    d = os.path.realpath(deep_ep_dir) if deep_ep_dir else None
    if name == LIB_DEEP_EP:
        sys.path.insert(0, d)
        import deep_ep  # noqa: F401
        import deep_ep_cpp  # noqa: F401

        for m in (deep_ep, deep_ep_cpp):
            f = os.path.realpath(m.__file__)
            if not f.startswith(d + os.sep):
                raise RuntimeError(f"{m.__name__} was imported from {f}, not from --compare-deep-ep {d}")
        if LIB_OURS in sys.modules:
            raise RuntimeError(f"importing deep_ep from {d} imported {LIB_OURS} (is it our shim?); point --compare-deep-ep at a DeepEP build")
        return deep_ep.Buffer, deep_ep.Config, {"module": deep_ep.__file__, "extension": deep_ep_cpp.__file__}
    if d:
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != d]
    import deepep_kernels
    from deepep_kernels import Buffer, Config

    return Buffer, Config, {"module": deepep_kernels.__file__}


def normal_configs(Buffer, Config, world, num_sms):
    """The library's default dispatch and combine configs for ``world`` ranks with ``num_sms`` SMs
    (DeepEP's recipe), or Config(num_sms, 6, 256, 6, 128) for both where it has none."""
    Buffer.set_num_sms(num_sms)
    try:
        return Buffer.get_dispatch_config(world), Buffer.get_combine_config(world)
    except Exception:
        c = Config(num_sms, 6, 256, 6, 128)
        return c, c


class _Session:
    """One library's rank process: measures ops, gathers every rank's figures, rank 0 saves rows."""

    def __init__(self, torch, dist, group, rank, world, library, args, out_path, meta):
        self.torch, self.dist, self.group = torch, dist, group
        self.rank, self.world, self.library, self.args = rank, world, library, args
        self.out_path = out_path
        self.doc = {"library": library, "meta": meta, "rows": []}
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=torch.device("cuda", torch.cuda.current_device()))
        self.save()

    def save(self):
        if self.rank == 0:
            write_json(self.out_path, self.doc)

    def barrier(self):
        self.dist.barrier(self.group)

    def measure(self, fn, calls):
        torch, a = self.torch, self.args
        s = {}
        self.barrier()
        if not a.no_profile:
            try:
                s.update(device_stats(torch, fn, calls, a.call_warmup))
            except Exception as e:  # e.g. no CUPTI access: the other two statistics still count
                s["profiler_error"] = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
            self.barrier()
        s["host_us"] = host_us(torch, fn, calls, a.call_warmup)
        self.barrier()
        s["event_us"] = time_op(torch, fn, a.reps, a.warmup, self.flush)
        torch.cuda.synchronize()
        return s

    def op(self, group_name, title, op, fn, calls, digest, setup=None):
        try:
            if setup is not None:
                setup()
            s = self.measure(fn, calls)
        except Exception as e:  # recorded in the row; a CUDA error ends the run at the next call anyway
            s = {"error": f"{type(e).__name__}: {e}"}
        per_rank = [None] * self.world
        self.dist.all_gather_object(per_rank, s, self.group)
        digests = [None] * self.world
        self.dist.all_gather_object(digests, digest, self.group)
        row = {"group": group_name, "title": title, "op": op, "library": self.library, "calls": calls,
               "call_warmup": self.args.call_warmup, "reps": self.args.reps, "warmup": self.args.warmup,
               "per_rank": per_rank, "input_sha256": digests}
        row.update(slowest(per_rank))
        self.doc["rows"].append(row)
        self.save()


def normal_inputs(ses):
    """The normal ops' inputs, the same in every library and mode: seed = rank, then x [--tokens,
    --hidden] BF16, top---topk of --experts int64 expert ids, float weights."""
    torch, a = ses.torch, ses.args
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(ses.rank)
    x = torch.randn(a.tokens, a.hidden, device=dev).to(torch.bfloat16)
    idx = torch.randn(a.tokens, a.experts, device=dev).abs().topk(a.topk, dim=1).indices.to(torch.int64)
    w = torch.rand(a.tokens, a.topk, device=dev)
    return x, idx, w


def v1_buffer(ses, Buffer, Config):
    """(Buffer, dispatch config, combine config) of the normal ops: the library's default configs
    for the rank count with --num-sms SMs, the NVLink bytes from its size hint (the larger of the
    two configs'), ``explicitly_destroy=True``."""
    a = ses.args
    if ses.library in (LIB_OURS, LIB_V1):
        # ours sizes its NVLink buffer for a token capacity and a hidden size (docs/python.md)
        os.environ.setdefault("DEEPEP_KERNELS_HIDDEN", str(a.hidden))
        if a.tokens > 4096:
            os.environ.setdefault("DEEPEP_KERNELS_MAX_TOKENS", str(a.tokens))
    dcfg, ccfg = normal_configs(Buffer, Config, ses.world, a.num_sms)
    nvl = max(c.get_nvl_buffer_size_hint(a.hidden * 2, ses.world) for c in (dcfg, ccfg))
    return Buffer(ses.group, nvl, 0, explicitly_destroy=True), dcfg, ccfg


def v1_ops(buf, dcfg, ccfg, num_experts, x, idx, w, fp8=None):
    """V1 (``Buffer``, intranode; DeepEP's or ours) callables by key: fresh (get_dispatch_layout +
    dispatch with topk_idx / topk_weights), cached (handle= of a first fresh dispatch), cached_fp8
    (with ``fp8`` = (values, scales)), combine (that dispatch's rows), pair (fresh, then combine)."""
    def fresh():
        lay = buf.get_dispatch_layout(idx, num_experts)
        return buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                            topk_idx=idx, topk_weights=w, config=dcfg)

    def pair():
        r, _, _, _, hd, _ = fresh()
        return buf.combine(r, hd, config=ccfg)

    rx, _, _, _, handle, _ = fresh()
    ops = {"fresh": fresh, "cached": lambda: buf.dispatch(x, handle=handle, config=dcfg),
           "combine": lambda: buf.combine(rx, handle, config=ccfg), "pair": pair}
    if fp8 is not None:
        ops["cached_fp8"] = lambda: buf.dispatch(fp8, handle=handle, config=dcfg)
    return ops


def v2_buffer(ses):
    """V2's ``ElasticBuffer`` sized by its hint for --tokens x --hidden, top---topk."""
    a = ses.args
    from deepep_kernels.elastic import ElasticBuffer

    return ElasticBuffer(ses.group, num_max_tokens_per_rank=a.tokens, hidden=a.hidden, num_topk=a.topk, explicitly_destroy=True)


def v2_ops(buf, num_experts, num_max_tokens_per_rank, num_sms, x, idx, w):
    """V2 (``ElasticBuffer``) callables by key: fresh (do_cpu_sync=True), fresh_nosync
    (do_cpu_sync=False: worst-case sizes), cached (handle= of a first fresh synced dispatch),
    combine (that dispatch's rows, plain handle), pair (fresh synced, then combine)."""
    def fresh(sync=True):
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
                            num_sms=num_sms, do_cpu_sync=sync)

    def pair():
        r, _, _, hd, _ = fresh()
        return buf.combine(r, hd)

    rx, _, _, handle, _ = fresh()
    return {"fresh": fresh, "fresh_nosync": lambda: fresh(False), "cached": lambda: buf.dispatch(x, handle=handle, num_sms=num_sms),
            "combine": lambda: buf.combine(rx, handle), "pair": pair}


def measure_buffer_ops(ses, buf, make_ops, group_name, title, ops, digest):
    """``ses.op`` for each ``(op, key)`` of ``ops`` over the callables ``make_ops()`` returns, then
    the buffer destroyed (collectively)."""
    torch = ses.torch
    try:
        fns = make_ops()
        torch.cuda.synchronize()
        for op, key in ops:
            ses.op(group_name, title, op, fns[key], ses.args.normal_calls, digest)
        torch.cuda.synchronize()
        fns.clear()
    finally:
        torch.cuda.synchronize()
        ses.barrier()
        buf.destroy()


def compare_normal(ses, Buffer, Config, gpus):
    torch, a, world = ses.torch, ses.args, ses.world
    n, h, k, e = a.tokens, a.hidden, a.topk, a.experts
    x, idx, w = normal_inputs(ses)
    xq, sc = cast_fp8(torch, x)
    digest = input_digest(torch, (x, idx, w, xq, sc))
    title = (f"{GROUP_NORMAL} (normal mode): {n} tokens x {h} hidden per rank, top-{k} of {e} experts, {a.num_sms} SMs; "
             f"{world} ranks on {gpus} GPU(s); num_nvl_bytes from each library's size hint")
    buf, dcfg, ccfg = v1_buffer(ses, Buffer, Config)
    ops = [("dispatch BF16, fresh (layout + dispatch)", "fresh"), ("dispatch BF16, cached", "cached"),
           ("dispatch FP8, cached", "cached_fp8"), ("combine BF16", "combine")]
    measure_buffer_ops(ses, buf, lambda: v1_ops(buf, dcfg, ccfg, e, x, idx, w, (xq, sc)), GROUP_NORMAL, title, ops, digest)


def compare_v2(ses, Buffer, Config, gpus):
    """--mode v2, one library's rank process: V1 (``Buffer``) or V2 (``ElasticBuffer``), the ops of
    ``V2_OPS`` over the inputs of the normal ops."""
    torch, a, world = ses.torch, ses.args, ses.world
    n, h, k, e = a.tokens, a.hidden, a.topk, a.experts
    x, idx, w = normal_inputs(ses)
    digest = input_digest(torch, (x, idx, w))
    title = (f"{GROUP_V2}, intranode, BF16: {n} tokens x {h} hidden per rank, top-{k} of {e} experts, {a.num_sms} SMs; "
             f"{world} ranks on {gpus} GPU(s); V1: Buffer with num_nvl_bytes from its size hint and its default configs; "
             f"V2: ElasticBuffer sized by its hint, num_max_tokens_per_rank={n}, num_sms={a.num_sms}")
    if ses.library == LIB_V1:
        buf, dcfg, ccfg = v1_buffer(ses, Buffer, Config)
        make = lambda: v1_ops(buf, dcfg, ccfg, e, x, idx, w)  # noqa: E731
        ops = [(op, key) for op, key, _ in V2_OPS]
    else:
        buf = v2_buffer(ses)
        make = lambda: v2_ops(buf, e, n, a.num_sms, x, idx, w)  # noqa: E731
        ops = [(op, key) for op, _, key in V2_OPS]
    measure_buffer_ops(ses, buf, make, GROUP_V2, title, ops, digest)


def compare_ll(ses, Buffer, gpus):
    torch, a, world, rank = ses.torch, ses.args, ses.world, ses.rank
    dev = torch.device("cuda", torch.cuda.current_device())
    n, h, k, e = a.ll_tokens, a.hidden, a.topk, a.ll_experts
    torch.manual_seed(100 + rank)
    x = torch.randn(n, h, device=dev).to(torch.bfloat16)
    idx = torch.randn(n, e, device=dev).abs().topk(k, dim=1).indices.to(torch.int64)
    w = torch.rand(n, k, device=dev)
    y = torch.randn(e // world, world * n, h, device=dev).to(torch.bfloat16)
    out = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
    digest = input_digest(torch, (x, idx, w, y))
    title = (f"{GROUP_LL}: {n} tokens x {h} hidden per rank, top-{k} of {e} experts; {world} rank(s) on {gpus} GPU(s); "
             "num_rdma_bytes from each library's size hint")
    rdma = Buffer.get_low_latency_rdma_size_hint(n, h, world, e)
    buf = Buffer(ses.group, 0, rdma, low_latency_mode=True, num_qps_per_rank=e // world, explicitly_destroy=True)
    state = {}
    try:
        def dispatch_for_combine():
            # a fresh handle (the state a decode step combines in; an older one would read its own copy)
            state["handle"] = buf.low_latency_dispatch(x, idx, n, e, use_fp8=True)[2]
            torch.cuda.synchronize()

        ops = [
            ("LL dispatch FP8", lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=True), None),
            ("LL dispatch BF16", lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=False), None),
            ("LL combine BF16", lambda: buf.low_latency_combine(y, idx, w, state["handle"], out=out), dispatch_for_combine),
        ]
        for op, fn, setup in ops:
            ses.op(GROUP_LL, title, op, fn, a.calls, digest, setup)
        state.clear()

        if not a.no_graph:
            def capture():
                cur = torch.cuda.current_stream()
                s = torch.cuda.Stream()
                s.wait_stream(cur)
                with torch.cuda.stream(s):  # warm-up outside the capture
                    for _ in range(3):
                        r, _, hd, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=False)
                        buf.low_latency_combine(r, idx, w, hd, out=out)
                cur.wait_stream(s)
                torch.cuda.synchronize()
                ses.barrier()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    r, _, hd, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=False)
                    buf.low_latency_combine(r, idx, w, hd, out=out)
                torch.cuda.synchronize()
                state["graph"] = g

            ses.op(GROUP_LL, title, "LL dispatch + combine BF16, one CUDA graph (per replay)",
                   lambda: state["graph"].replay(), a.calls, digest, capture)
            state.clear()
    finally:
        state.clear()
        torch.cuda.synchronize()
        ses.barrier()
        buf.destroy()


def compare_worker(rank, world, gpus, init, args, library, out_path):
    """One rank of one library's run (spawned): the ops of --mode, rows saved to ``out_path``."""
    Buffer, Config, where = load_library(library, args.compare_deep_ep)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank * gpus // world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    group = dist.group.WORLD
    meta = dict(where, torch=torch.__version__, device=torch.cuda.get_device_name(), ranks=world, gpus=gpus)
    ses = _Session(torch, dist, group, rank, world, library, args, out_path, meta)
    if args.mode == "v2":
        compare_v2(ses, Buffer, Config, gpus)
    if args.mode in ("intranode", "all") and world >= 2:
        compare_normal(ses, Buffer, Config, gpus)
    if args.mode in ("ll", "all"):
        compare_ll(ses, Buffer, gpus)
    ses.barrier()
    dist.destroy_process_group()


def compare_main(args):
    import torch
    import torch.multiprocessing as mp

    gpus = gpus_for(args.ranks, args.gpus, torch.cuda.device_count())
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for i, (rnd, lib) in enumerate(run_order(args.rounds, libraries_of(args))):
            out = os.path.join(d, f"run{i}.json")
            print(f"[bench] round {rnd + 1}/{args.rounds}: {LABELS[lib]}, {args.ranks} rank process(es) on {gpus} GPU(s)",
                  file=sys.stderr, flush=True)
            err = None
            try:
                mp.spawn(compare_worker, args=(args.ranks, gpus, os.path.join(d, f"pg{i}"), args, lib, out),
                         nprocs=args.ranks, join=True)
            except Exception as e:  # a failed run still shows what it measured, and the error
                err = f"{type(e).__name__}: {e}"
            run = {"library": lib, "meta": {}, "rows": []}
            if os.path.exists(out):
                with open(out) as f:
                    run = json.load(f)
            run.update(round=rnd, error=err)
            runs.append(run)
    text, doc, status = summarize_runs(args, gpus, runs)
    print(text, flush=True)
    if args.json:
        write_json(args.json, doc)
    return status


def libraries_of(args):
    """The two libraries the side-by-side table compares: V1 and V2 (--mode v2) or DeepEP and ours."""
    return V_LIBRARIES if args.mode == "v2" else LIBRARIES


def shapes_of(args):
    """The shapes the run measured (for the JSON and the records made from it)."""
    names = []
    if args.mode in ("intranode", "all", "v2"):
        names += ["tokens", "hidden", "topk", "experts", "num_sms"]
    if args.mode in ("ll", "all"):
        names += ["ll_tokens", "hidden", "topk", "ll_experts"]
    return dict({k: getattr(args, k) for k in names}, ranks=args.ranks)


def summarize_runs(args, gpus, runs):
    """(report text, --json document, exit status) of the side-by-side runs (``{"library", "round",
    "meta", "rows", "error"}`` each, in run order): the table, the meta with the mode and the
    shapes (and, --mode v2, the issue's criterion), every run's rows."""
    libs = libraries_of(args)
    entries = build_table(runs, libs)
    first = {lib: next((r["meta"] for r in runs if r["library"] == lib and r["meta"]), {}) for lib in libs}
    any_meta = first[libs[1]] or first[libs[0]]
    notes = []
    if args.mode == "all" and args.ranks < 2:
        notes.append("normal (intranode) ops skipped: they need --ranks >= 2")
    meta = {"mode": args.mode, "shapes": shapes_of(args), "ranks": args.ranks, "gpus": gpus, "rounds": args.rounds, "notes": notes,
            "ours": any_meta.get("module"), "device": any_meta.get("device"), "torch": any_meta.get("torch"),
            "failed_runs": [{"library": r["library"], "round": r["round"], "error": r["error"]} for r in runs if r["error"]]}
    if libs == LIBRARIES:
        meta.update(deep_ep=first[LIB_DEEP_EP].get("extension") or os.path.abspath(args.compare_deep_ep),
                    ours=first[LIB_OURS].get("module"))
    else:
        meta["criterion"] = v2_criterion(entries)
    doc = {"meta": dict(meta, args=vars(args), not_performance=oversubscription_line(args.ranks, gpus)), "runs": runs, "table": entries}
    status = 1 if meta["failed_runs"] or any(e["libraries"][lib]["errors"] for e in entries for lib in libs) else 0
    return format_report(entries, meta, libs), doc, status


def worker(rank, world, gpus, init, args):
    import torch
    import torch.distributed as dist

    from deepep_kernels import Buffer, Config

    torch.cuda.set_device(rank * gpus // world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    group = dist.group.WORLD
    dev = torch.device("cuda", torch.cuda.current_device())
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    rows = []
    json_rows = []

    def report(op, shape, us, nbytes, kus):
        all_us = [None] * world
        dist.all_gather_object(all_us, (us, kus), group)
        worst = max(u for u, _ in all_us)
        kworst = max(k for _, k in all_us)
        all_b = [None] * world
        dist.all_gather_object(all_b, nbytes, group)
        gbs = min(b / (u * 1e3) for b, (u, _) in zip(all_b, all_us))
        rows.append(f"{op:<40} {shape:<28} {worst:9.1f} {gbs:9.1f} {kworst:10.1f}")
        json_rows.append({"op": op, "shape": shape, "us": worst, "gbs": gbs, "kernel_us": None if kworst != kworst else kworst,
                          "per_rank_us": [u for u, _ in all_us], "per_rank_kernel_us": [None if k != k else k for _, k in all_us],
                          "per_rank_bytes": all_b})

    if args.mode in ("intranode", "all"):
        torch.manual_seed(rank)
        n, h, k, e = args.tokens, args.hidden, args.topk, args.experts
        nvl = Config(args.num_sms, 6, 256, 6, 128).get_nvl_buffer_size_hint(h * 2, world)
        os.environ.setdefault("DEEPEP_KERNELS_HIDDEN", str(h))
        buf = Buffer(group, nvl, 0, explicitly_destroy=True)
        x = torch.randn(n, h, device=dev).to(torch.bfloat16)
        scores = torch.randn(n, e, device=dev).abs()
        idx = scores.topk(k, dim=1).indices.to(torch.int64)
        w = torch.rand(n, k, device=dev)
        cfg = Config(args.num_sms, 6, 256, 6, 128)
        layout = buf.get_dispatch_layout(idx, e)
        rx, ri, rw, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                    num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=cfg)
        m = rx.shape[0]
        xq = x.to(torch.float8_e4m3fn)
        sc = torch.ones(n, h // 128, device=dev)
        shape = f"{n}x{h} top-{k}/{e} {args.num_sms}SMs"

        def fresh():
            lay = buf.get_dispatch_layout(idx, e)
            buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                         topk_idx=idx, topk_weights=w, config=cfg)

        def views(fn):
            # the opt-in zero-copy mode (DEEPEP_KERNELS_DISPATCH_VIEWS=1): outputs are views of
            # the fixed receive region, no copy after the kernel
            return switched(buf, "_dispatch_views", True, fn)

        def copied(fn):
            # owned outputs the way they were made before the receive arena: the kernel writes
            # the fixed receive region and a second pass copies the rows into torch tensors
            return switched(buf, "_use_arena", False, fn)

        cached_bf16 = lambda: buf.dispatch(x, handle=handle, config=cfg)  # noqa: E731
        cached_fp8 = lambda: buf.dispatch((xq, sc), handle=handle, config=cfg)  # noqa: E731
        # the owned rows below must come from the arena, or they would time the copy again
        exposed = buf.get_local_buffer_tensor(torch.uint8)
        probe = cached_bf16()[0]
        arena_lo, arena_cap = exposed.data_ptr() + exposed.numel(), (buf._rt().arena_usage() or (0,))[0]
        if m > 0 and not arena_lo <= probe.data_ptr() < arena_lo + arena_cap:
            raise SystemExit(f"rank {rank}: owned dispatch outputs are not in the receive arena (arena {buf._rt().arena_usage()}); "
                             "unset DEEPEP_KERNELS_RECV_ARENA_BYTES or raise it")
        del probe, exposed
        ops = [
            ("dispatch BF16, cached, owned outputs", cached_bf16, m * h * 2),
            ("dispatch BF16, cached, zero-copy views", views(cached_bf16), m * h * 2),
            ("dispatch BF16, cached, owned, copied", copied(cached_bf16), m * h * 2),
            ("dispatch FP8, cached, owned outputs", cached_fp8, m * h * (1 + 4 / 128)),
            ("dispatch FP8, cached, zero-copy views", views(cached_fp8), m * h * (1 + 4 / 128)),
            ("combine BF16", lambda: buf.combine(rx, handle, config=cfg), m * h * 2),
            ("dispatch BF16, fresh (layout+notify+sync)", fresh, m * h * 2),
            ("dispatch BF16, fresh, zero-copy views", views(fresh), m * h * 2),
        ]
        for op, fn, nbytes in ops:
            us = time_op(torch, fn, args.reps, args.warmup, flush)
            report("intranode " + op, shape, us, nbytes, kernel_us(torch, fn, not args.no_profile))
        # issue 23's statistic: owned outputs over zero-copy views, the same cached dispatch in
        # this run (slowest rank of each)
        us_of = {r["op"]: r["us"] for r in json_rows}
        for dt in ("BF16", "FP8"):
            o, v = us_of[f"intranode dispatch {dt}, cached, owned outputs"], us_of[f"intranode dispatch {dt}, cached, zero-copy views"]
            rows.append(f"ratio owned / zero-copy, cached {dt}: {o / v:.3f}")
        c = us_of["intranode dispatch BF16, cached, owned, copied"]
        rows.append(f"ratio copied (no arena) / zero-copy, cached BF16: {c / us_of['intranode dispatch BF16, cached, zero-copy views']:.3f}")
        torch.cuda.synchronize()
        buf.destroy()

    if args.mode in ("ll", "all"):
        torch.manual_seed(100 + rank)
        n, h, k, e = args.ll_tokens, args.hidden, args.topk, args.ll_experts
        rdma = Buffer.get_low_latency_rdma_size_hint(n, h, world, e)
        buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=e // world, explicitly_destroy=True)
        x = torch.randn(n, h, device=dev).to(torch.bfloat16)
        idx = torch.randn(n, e, device=dev).abs().topk(k, dim=1).indices.to(torch.int64)
        w = torch.rand(n, k, device=dev)
        (q, s), cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=True)
        recv_sel = int(cnt.sum().item())
        y = torch.randn(e // world, world * n, h, device=dev).to(torch.bfloat16)
        out = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
        shape = f"{n}x{h} top-{k}/{e}"
        sent = int((idx >= 0).sum().item())
        ops = [
            ("dispatch FP8", lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=True), recv_sel * (h + h // 128 * 4 + 16)),
            ("dispatch BF16", lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=False), recv_sel * (2 * h + 16)),
            ("combine BF16", lambda: buf.low_latency_combine(y, idx, w, handle, out=out), sent * h * 2),
        ]
        for op, fn, nbytes in ops:
            if op == "combine BF16":
                # a fresh handle (the state a decode step combines in; an older one would read its own copy)
                (q, s), cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=True)
            us = time_op(torch, fn, args.reps, args.warmup, flush)
            report("low-latency " + op, shape, us, nbytes, kernel_us(torch, fn, not args.no_profile))
        torch.cuda.synchronize()
        buf.destroy()

    if rank == 0:
        if gpus < world:
            print(f"NOT PERFORMANCE: {world} ranks share {gpus} GPU(s) (oversubscribed); the ranks compete for the same SMs "
                  "and memory, the 'NVLink' traffic is local memory, and the profiler column may include other ranks' "
                  "kernels. Use the figures only to compare rows of this run with each other.")
        print(f"{'op':<40} {'shape':<28} {'us':>9} {'GB/s':>9} {'kernel us':>10}")
        for r in rows:
            print(r)
        sys.stdout.flush()
        if args.json:
            write_json(args.json, {"meta": {"ranks": world, "gpus": gpus, "reps": args.reps, "warmup": args.warmup,
                                            "oversubscribed": gpus < world, "args": vars(args)}, "rows": json_rows})
    dist.destroy_process_group()


def main(argv=None):
    args = parse(argv)
    problems = validate(args)
    if problems:
        for p in problems:
            print(f"bench.py: {p}", file=sys.stderr)
        return 2
    if args.compare_deep_ep is not None or args.mode == "v2":
        return compare_main(args)
    import torch
    import torch.multiprocessing as mp

    gpus = gpus_for(args.ranks, args.gpus, torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args.ranks, gpus, os.path.join(d, "pg"), args), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
