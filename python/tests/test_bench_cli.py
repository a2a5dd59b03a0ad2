"""CPU tests of python/scripts/bench.py (no GPU, no torch): the arguments of the side-by-side mode
(``--compare-deep-ep``), the checks of the DeepEP folder, the run order, the per-call device
statistics, the slowest-rank reduction, and the report and JSON the parent prints from the rows
of the rank processes. The script is imported by path; it imports torch only inside the functions
that run on the GPU, which these tests do not call."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "scripts", "bench.py")
BENCHMARKS_MD = os.path.join(os.path.dirname(os.path.dirname(HERE)), "kernels", "BENCHMARKS.md")


def _load():
    spec = importlib.util.spec_from_file_location("deepep_bench_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load()
DE, OURS = bench.LIB_DEEP_EP, bench.LIB_OURS


def deep_ep_dir(tmp_path, so=True, init="import torch\n"):
    d = tmp_path / "deepep-site"
    (d / "deep_ep").mkdir(parents=True)
    (d / "deep_ep" / "__init__.py").write_text(init)
    (d / "deep_ep" / "buffer.py").write_text("import deep_ep_cpp\n")
    if so:
        (d / "deep_ep_cpp.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    return str(d)


def test_importing_the_script_imports_no_torch():
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('b', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, SCRIPT], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_parse_defaults_keep_the_plain_mode_and_deepep_shapes():
    a = bench.parse([])
    assert a.compare_deep_ep is None and a.json is None
    assert (a.ranks, a.mode, a.tokens, a.hidden, a.topk, a.experts, a.num_sms) == (2, "all", 4096, 7168, 8, 256, 24)
    # DeepEP's test_low_latency.py defaults
    assert (a.ll_tokens, a.ll_experts) == (128, 288)
    assert (a.reps, a.warmup, a.no_profile) == (30, 5, False)
    assert (a.calls, a.normal_calls, a.call_warmup, a.rounds, a.no_graph) == (300, 50, 30, 1, False)


def test_parse_compare_options(tmp_path):
    d = deep_ep_dir(tmp_path)
    a = bench.parse(["--compare-deep-ep", d, "--ranks", "1", "--mode", "ll", "--json", "out.json", "--ll-tokens", "64",
                     "--ll-experts", "256", "--hidden", "4096", "--topk", "6", "--calls", "100", "--rounds", "3", "--no-graph"])
    assert a.compare_deep_ep == d and a.json == "out.json"
    assert (a.ranks, a.mode, a.ll_tokens, a.ll_experts, a.hidden, a.topk, a.calls, a.rounds, a.no_graph) == \
        (1, "ll", 64, 256, 4096, 6, 100, 3, True)
    assert bench.validate(a) == []


def test_usage_text_names_the_new_options():
    for flag in ("--compare-deep-ep", "--json", "--calls", "--normal-calls", "--call-warmup", "--rounds", "--no-graph"):
        assert flag in bench.__doc__
    assert "NOT PERFORMANCE" in bench.__doc__


def test_deep_ep_dir_problem(tmp_path):
    assert "not a directory" in bench.deep_ep_dir_problem(str(tmp_path / "missing"))
    assert "deep_ep/__init__.py" in bench.deep_ep_dir_problem(str(tmp_path))
    assert "deep_ep_cpp" in bench.deep_ep_dir_problem(deep_ep_dir(tmp_path / "a", so=False))
    assert bench.deep_ep_dir_problem(deep_ep_dir(tmp_path / "b")) is None
    shim = deep_ep_dir(tmp_path / "c", init="from deepep_kernels import Buffer\n")
    assert "shim" in bench.deep_ep_dir_problem(shim)


@pytest.mark.parametrize("argv, fragment", [
    (["--ranks", "1", "--mode", "intranode"], "--ranks >= 2"),
    (["--hidden", "7000"], "multiple of 128"),
    (["--num-sms", "23"], "even"),
    (["--ranks", "5", "--mode", "ll"], "--ll-experts 288 must be a multiple of --ranks 5"),
    (["--ranks", "3", "--mode", "intranode"], "--experts 256 must be a multiple of --ranks 3"),
    (["--calls", "0"], "--calls must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--call-warmup", "-1"], "--call-warmup must be >= 0"),
])
def test_validate_compare_mode(tmp_path, argv, fragment):
    a = bench.parse(["--compare-deep-ep", deep_ep_dir(tmp_path)] + argv)
    assert any(fragment in p for p in bench.validate(a)), bench.validate(a)


def test_validate_one_rank_all_modes_is_fine_and_plain_mode_ignores_compare_checks(tmp_path):
    assert bench.validate(bench.parse(["--compare-deep-ep", deep_ep_dir(tmp_path), "--ranks", "1"])) == []
    # the plain mode keeps accepting what it accepted (its own options only)
    assert bench.validate(bench.parse(["--ranks", "1", "--mode", "ll", "--hidden", "7000", "--num-sms", "23"])) == []
    assert "--reps must be >= 1, got 0" in bench.validate(bench.parse(["--reps", "0"]))


def test_main_rejects_a_missing_deep_ep_before_importing_torch(tmp_path, capsys):
    assert bench.main(["--compare-deep-ep", str(tmp_path / "nowhere"), "--ranks", "1"]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("ranks, requested, visible, gpus", [
    (1, 0, 1, 1), (2, 0, 1, 1), (2, 0, 2, 2), (8, 0, 2, 2), (2, 1, 8, 1), (4, 0, 0, 1), (2, 4, 8, 2),
])
def test_gpus_for(ranks, requested, visible, gpus):
    assert bench.gpus_for(ranks, requested, visible) == gpus


def test_oversubscription_line():
    assert bench.oversubscription_line(1, 1) is None
    assert bench.oversubscription_line(2, 2) is None
    assert bench.oversubscription_line(2, 1) == "NOT PERFORMANCE: 2 ranks share one GPU; ratios only"
    assert bench.oversubscription_line(8, 2) == "NOT PERFORMANCE: 8 ranks share 2 GPUs; ratios only"


def test_run_order_alternates_the_libraries():
    assert bench.run_order(1) == [(0, DE), (0, OURS)]
    assert bench.run_order(3) == [(0, DE), (0, OURS), (1, OURS), (1, DE), (2, DE), (2, OURS)]


def test_summarize_device_events_sums_everything_per_call_and_names_the_largest_kernel():
    events = []
    for _ in range(4):  # 4 calls, each: a small and a large kernel, a memcpy, a sync activity
        events += [("notify_kernel", 2.0), ("dispatch_kernel<128>", 15.0), ("Memcpy DtoD (Device -> Device)", 3.0),
                   ("Stream Wait Event", 50.0)]
    s = bench.summarize_device_events(events, 4)
    assert s["kernel_us"] == pytest.approx(20.0)  # 2 + 15 + 3, the sync activity left out
    assert s["device_activities_per_call"] == pytest.approx(3.0)
    assert s["largest_kernel"] == "dispatch_kernel<128>"
    assert s["largest_kernel_mean_us"] == pytest.approx(15.0)
    assert s["largest_kernel_per_call"] == pytest.approx(1.0)


def test_summarize_device_events_largest_by_mean_not_by_total():
    events = [("tiny", 1.0)] * 30 + [("big", 12.0), ("big", 14.0)]
    s = bench.summarize_device_events(events, 2)
    assert (s["largest_kernel"], s["largest_kernel_mean_us"]) == ("big", pytest.approx(13.0))
    assert s["kernel_us"] == pytest.approx((30 + 26) / 2)


def test_summarize_device_events_without_kernels():
    s = bench.summarize_device_events([("Memset (Device)", 1.0)], 1)
    assert s["kernel_us"] == 1.0 and s["largest_kernel"] is None and s["largest_kernel_mean_us"] is None
    assert bench.summarize_device_events([], 10)["kernel_us"] == 0.0


def test_slowest_takes_the_worst_rank():
    per_rank = [
        {"kernel_us": 10.0, "largest_kernel": "a", "largest_kernel_mean_us": 8.0, "host_us": 30.0, "event_us": 40.0,
         "device_activities_per_call": 2.0},
        {"kernel_us": 12.0, "largest_kernel": "b", "largest_kernel_mean_us": 9.0, "host_us": 25.0, "event_us": 45.0,
         "device_activities_per_call": 2.0},
    ]
    s = bench.slowest(per_rank)
    assert (s["kernel_us"], s["largest_kernel"], s["largest_kernel_mean_us"], s["host_us"], s["event_us"]) == \
        (12.0, "b", 9.0, 30.0, 45.0)
    assert s["error"] is None
    s = bench.slowest([{"host_us": 1.0, "event_us": 2.0}, {"error": "ValueError: x"}])
    assert s["error"] == "rank 1: ValueError: x" and s["host_us"] == 1.0 and s["kernel_us"] is None


def _row(lib, group, op, k, big, host, ev, calls=300, digest=("aa",), error=None):
    title = {bench.GROUP_LL: "low-latency: 128 tokens x 7168 hidden per rank, top-8 of 288 experts; 1 rank(s) on 1 GPU(s)",
             bench.GROUP_NORMAL: "intranode (normal mode): 4096 tokens x 7168 hidden per rank, top-8 of 256 experts"}[group]
    r = {"group": group, "title": title, "op": op, "library": lib, "calls": calls, "call_warmup": 30, "reps": 30, "warmup": 5,
         "kernel_us": k, "largest_kernel": f"{lib}_kernel_{op}", "largest_kernel_mean_us": big, "host_us": host, "event_us": ev,
         "input_sha256": list(digest), "error": error}
    return r


def _runs(rounds=1, ours_scale=1.0):
    runs = []
    for rnd, lib in bench.run_order(rounds):
        f = (0.8 if lib == OURS else 1.0) * (1.0 + 0.1 * rnd) * (ours_scale if lib == OURS else 1.0)
        rows = [_row(lib, bench.GROUP_LL, "LL dispatch FP8", 19.0 * f, 18.0 * f, 40.0 * f, 50.0 * f),
                _row(lib, bench.GROUP_LL, "LL combine BF16", 22.5 * f, 22.0 * f, 20.0 * f, 42.0 * f),
                _row(lib, bench.GROUP_NORMAL, "dispatch BF16, cached", 300.0 * f, 280.0 * f, 30.0 * f, 350.0 * f, calls=50,
                     digest=("bb", "cc"))]
        runs.append({"library": lib, "round": rnd, "meta": {}, "rows": rows, "error": None})
    return runs


def _meta(ranks=1, gpus=1, rounds=1, **kw):
    m = {"ranks": ranks, "gpus": gpus, "rounds": rounds, "notes": [], "deep_ep": "/x/deep_ep_cpp.so", "ours": "/y/deepep_kernels",
         "device": "NVIDIA H200", "torch": "2.9.0", "failed_runs": []}
    m.update(kw)
    return m


def test_build_table_pairs_the_libraries_and_computes_ratios():
    entries = bench.build_table(_runs())
    assert [(e["group"], e["op"]) for e in entries] == [
        (bench.GROUP_LL, "LL dispatch FP8"), (bench.GROUP_LL, "LL combine BF16"), (bench.GROUP_NORMAL, "dispatch BF16, cached")]
    e = entries[0]
    assert e["libraries"][DE]["kernel_us"]["median"] == pytest.approx(19.0)
    assert e["libraries"][OURS]["kernel_us"]["median"] == pytest.approx(15.2)
    assert e["ratio_ours_over_deep_ep"]["kernel_us"] == pytest.approx(0.8)
    assert e["counts"] == {"calls": 300, "call_warmup": 30, "reps": 30, "warmup": 5}
    assert entries[2]["counts"]["calls"] == 50
    json.dumps(entries)  # the table goes into --json as it is


def test_format_report_one_rank():
    text = bench.format_report(bench.build_table(_runs()), _meta())
    lines = text.splitlines()
    assert not any("NOT PERFORMANCE" in ln for ln in lines)
    assert "inputs (SHA-256 of every rank's input tensors): low-latency: identical in both libraries; intranode: identical in both libraries" in lines
    # the shape is in the title, the statistic in the header, each cell DeepEP / ours (ours / DeepEP)
    assert any(ln.startswith("low-latency: 128 tokens x 7168 hidden per rank, top-8 of 288 experts") for ln in lines)
    header = next(ln for ln in lines if ln.startswith("| op |"))
    assert "device kernel time per call, us (torch profiler: all kernels + memcpys + memsets of 300 back-to-back calls" in header
    assert "largest kernel, mean us" in header
    assert "host time per call, us (perf_counter_ns around 300 back-to-back calls, no sync inside" in header
    assert "event time per call, us (CUDA events around each call, median of 30 after 5 warm-ups, L2 flushed" in header
    assert header.count(": DeepEP / ours") == 4
    row = next(ln for ln in lines if ln.startswith("| LL dispatch FP8 |"))
    assert row == "| LL dispatch FP8 | 19.0 / 15.2 (0.80x) | 18.0 / 14.4 (0.80x) | 40.0 / 32.0 (0.80x) | 50.0 / 40.0 (0.80x) |"
    # the normal group has its own header with its own call count
    normal_header = [ln for ln in lines if ln.startswith("| op |")][1]
    assert "of 50 back-to-back calls" in normal_header
    assert "largest kernel, LL dispatch FP8: DeepEP `deep_ep_kernel_LL dispatch FP8`, ours `deepep_kernels_kernel_LL dispatch FP8`" in lines
    assert not any(ln.startswith("ERROR") for ln in lines)


def test_format_report_oversubscribed_heads_with_not_performance():
    text = bench.format_report(bench.build_table(_runs()), _meta(ranks=2, gpus=1))
    assert text.splitlines()[0] == "NOT PERFORMANCE: 2 ranks share one GPU; ratios only"


def test_format_report_rounds_give_median_and_range():
    text = bench.format_report(bench.build_table(_runs(rounds=2)), _meta(rounds=2))
    row = next(ln for ln in text.splitlines() if ln.startswith("| LL combine BF16 |"))
    # DeepEP 22.5 and 24.75, ours 18.0 and 19.8: medians 23.6 / 18.9
    assert row.startswith("| LL combine BF16 | 23.6 [22.5-24.8] / 18.9 [18.0-19.8] (0.80x) |")
    assert "median [min-max] over the rounds" in text


def test_format_report_errors_and_failed_runs():
    runs = _runs()
    ours = runs[1]
    ours["rows"][1] = dict(ours["rows"][1], kernel_us=None, largest_kernel=None, largest_kernel_mean_us=None, host_us=None,
                           event_us=None, error="rank 0: RuntimeError: capture failed")
    runs.append({"library": DE, "round": 1, "meta": {}, "rows": [], "error": "ProcessRaisedException: boom"})
    text = bench.format_report(bench.build_table(runs), _meta(failed_runs=[{"library": DE, "round": 1, "error": "ProcessRaisedException: boom"}]))
    lines = text.splitlines()
    row = next(ln for ln in lines if ln.startswith("| LL combine BF16 |"))
    assert row.startswith("| LL combine BF16 | 22.5 / - | ")
    assert "ERROR ours, LL combine BF16: rank 0: RuntimeError: capture failed" in lines
    assert "ERROR: the DeepEP ranks of round 2 failed: ProcessRaisedException: boom" in lines


def test_format_report_profiler_failure_keeps_the_other_statistics():
    runs = _runs()
    runs[0]["rows"][0] = dict(runs[0]["rows"][0], kernel_us=None, largest_kernel=None, largest_kernel_mean_us=None,
                              profiler_error="rank 0: RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES")
    lines = bench.format_report(bench.build_table(runs), _meta()).splitlines()
    assert next(ln for ln in lines if ln.startswith("| LL dispatch FP8 |")) == \
        "| LL dispatch FP8 | - / 15.2 | - / 14.4 | 40.0 / 32.0 (0.80x) | 50.0 / 40.0 (0.80x) |"
    assert "no profiler figures, DeepEP, LL dispatch FP8: rank 0: RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES" in lines
    assert not any(ln.startswith("ERROR") for ln in lines)
    assert bench.slowest([{"host_us": 1.0, "profiler_error": "E"}])["profiler_error"] == "rank 0: E"


def test_format_report_flags_inputs_that_differ():
    runs = _runs()
    runs[1]["rows"][0]["input_sha256"] = ["zz"]
    text = bench.format_report(bench.build_table(runs), _meta())
    assert "low-latency: DIFFER between the libraries (see the JSON)" in text
    runs = _runs()
    runs[1]["rows"][0]["input_sha256"] = [None]
    assert "low-latency: not checked" in bench.format_report(bench.build_table(runs), _meta())


def test_write_json_round_trip(tmp_path):
    p = str(tmp_path / "out.json")
    doc = {"meta": _meta(), "runs": _runs(), "table": bench.build_table(_runs())}
    bench.write_json(p, doc)
    with open(p) as f:
        back = json.load(f)
    assert back["table"][0]["op"] == "LL dispatch FP8" and back["runs"][0]["library"] == DE
    assert not os.path.exists(p + ".tmp")


def test_benchmarks_md_has_the_side_by_side_command():
    with open(BENCHMARKS_MD) as f:
        text = f.read()
    assert "## Side by side with DeepEP" in text
    section = text.split("## Side by side with DeepEP", 1)[1].split("\n## ", 1)[0]
    assert "bench.py --ranks 1 --mode ll --compare-deep-ep" in section


# --- --mode v2: V2 (ElasticBuffer) vs V1 (Buffer) -------------------------------------------------
V1, V2 = bench.LIB_V1, bench.LIB_V2


def test_mode_v2_is_accepted_with_the_normal_shapes():
    a = bench.parse(["--mode", "v2", "--ranks", "4", "--tokens", "2048", "--hidden", "4096", "--topk", "6", "--experts", "128",
                     "--num-sms", "20", "--normal-calls", "40", "--json", "v2.json"])
    assert (a.mode, a.ranks, a.tokens, a.hidden, a.topk, a.experts, a.num_sms, a.normal_calls, a.json) == \
        ("v2", 4, 2048, 4096, 6, 128, 20, 40, "v2.json")
    assert a.compare_deep_ep is None
    assert bench.validate(a) == []
    assert bench.validate(bench.parse(["--mode", "v2"])) == []  # the defaults: 2 ranks
    assert bench.libraries_of(a) == (V1, V2) and bench.libraries_of(bench.parse([])) == (DE, OURS)


def test_mode_v2_refuses_one_rank_naming_the_fix(capsys):
    problems = bench.validate(bench.parse(["--mode", "v2", "--ranks", "1"]))
    assert problems == ["--mode v2 needs --ranks >= 2 (the intranode ops exchange between ranks; ranks may share one GPU), "
                        "got --ranks 1; use --ranks 2"]
    # refused before torch is imported (main returns 2)
    assert bench.main(["--mode", "v2", "--ranks", "1"]) == 2
    assert "--mode v2 needs --ranks >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--ranks", "3"], "--experts 256 must be a multiple of --ranks 3"),
    (["--num-sms", "23"], "--num-sms 23 must be even"),
    (["--normal-calls", "0"], "--normal-calls must be >= 1"),
    (["--call-warmup", "-1"], "--call-warmup must be >= 0"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_mode_v2_checks_its_shapes(argv, fragment):
    problems = bench.validate(bench.parse(["--mode", "v2"] + argv))
    assert any(fragment in p for p in problems), problems


def test_mode_v2_takes_no_deep_ep_and_no_fp8_constraint(tmp_path):
    problems = bench.validate(bench.parse(["--mode", "v2", "--compare-deep-ep", deep_ep_dir(tmp_path)]))
    assert problems == ["--mode v2 compares our two APIs (V2 ElasticBuffer vs V1 Buffer); drop --compare-deep-ep, or pick another --mode"]
    # BF16 only: no multiple of 128 needed
    assert bench.validate(bench.parse(["--mode", "v2", "--hidden", "7000"])) == []


def test_help_and_usage_name_mode_v2():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, check=True).stdout
    assert "v2" in out and "ElasticBuffer" in out and "--ranks >= 2" in out
    for text in ("--mode v2", "deepep_kernels.elastic.ElasticBuffer", "do_cpu_sync=False",
                 "ratio_v2_over_v1", "1.1x"):
        assert text in bench.__doc__, text


def test_v2_ops_pair_both_apis_and_keys():
    ops = [op for op, _, _ in bench.V2_OPS]
    assert len(set(ops)) == len(ops) == 5 and bench.V2_PAIR_OP == ops[-1]
    assert [v1 for _, v1, _ in bench.V2_OPS] == ["fresh", "fresh", "cached", "combine", "pair"]
    assert [v2 for _, _, v2 in bench.V2_OPS] == ["fresh", "fresh_nosync", "cached", "combine", "pair"]
    assert bench.run_order(2, bench.V_LIBRARIES) == [(0, V1), (0, V2), (1, V2), (1, V1)]


def _v2_runs(kernel=1.0, host=1.0, rounds=1):
    runs = []
    title = "V2 vs V1, intranode, BF16: 4096 tokens x 7168 hidden per rank, top-8 of 256 experts, 24 SMs"
    for rnd, lib in bench.run_order(rounds, bench.V_LIBRARIES):
        kf, hf = (kernel, host) if lib == V2 else (1.0, 1.0)
        rows = []
        for i, (op, _, _) in enumerate(bench.V2_OPS):
            base = 100.0 * (i + 1)
            rows.append({"group": bench.GROUP_V2, "title": title, "op": op, "library": lib, "calls": 50, "call_warmup": 30,
                         "reps": 30, "warmup": 5, "kernel_us": base * kf, "largest_kernel": f"{lib}_k{i}",
                         "largest_kernel_mean_us": base * kf / 2, "host_us": base / 10 * hf, "event_us": base * 1.2,
                         "input_sha256": ["aa", "bb"], "error": None})
        runs.append({"library": lib, "round": rnd, "meta": {"module": "/site/deepep_kernels/__init__.py", "device": "NVIDIA H100",
                                                            "torch": "2.9.0"}, "rows": rows, "error": None})
    return runs


def test_format_report_v2_names_v1_and_v2_and_the_criterion():
    runs = _v2_runs(kernel=1.05, host=0.9)
    entries = bench.build_table(runs, bench.V_LIBRARIES)
    assert entries[0]["ratio_v2_over_v1"]["kernel_us"] == pytest.approx(1.05)
    assert "ratio_ours_over_deep_ep" not in entries[0]
    text = bench.format_report(entries, _meta(ranks=2, gpus=2, ours="/site/deepep_kernels"), bench.V_LIBRARIES)
    lines = text.splitlines()
    assert not any("NOT PERFORMANCE" in ln for ln in lines)
    assert lines[0].startswith("V1: deepep_kernels.Buffer (intranode), V2: deepep_kernels.elastic.ElasticBuffer, both from /site")
    assert "each cell V1 / V2 (V2 / V1), slowest rank" in lines[0]
    assert "inputs (SHA-256 of every rank's input tensors): V2 vs V1: identical in both libraries" in lines
    header = next(ln for ln in lines if ln.startswith("| op |"))
    assert header.count(": V1 / V2") == 4 and "DeepEP" not in header
    assert "device kernel time per call, us (torch profiler: all kernels + memcpys + memsets of 50 back-to-back calls" in header
    assert "host time per call, us (perf_counter_ns around 50 back-to-back calls" in header
    assert "event time per call, us (CUDA events around each call, median of 30 after 5 warm-ups, L2 flushed" in header
    pair = next(ln for ln in lines if ln.startswith("| dispatch + combine BF16"))
    assert pair == ("| dispatch + combine BF16 (fresh synced dispatch, then combine of its rows) | 500.0 / 525.0 (1.05x) | "
                    "250.0 / 262.5 (1.05x) | 50.0 / 45.0 (0.90x) | 600.0 / 600.0 (1.00x) |")
    assert ("criterion, dispatch + combine (fresh synced dispatch, then combine): device kernel time V2 / V1 <= 1.1x: 1.05x, met; "
            "host time per call V2 / V1 <= 1x: 0.90x, met") in lines
    assert "largest kernel, combine BF16 (rows and handle of the fresh synced dispatch): V1 `deepep_kernels.Buffer_k3`, " \
           "V2 `deepep_kernels.elastic.ElasticBuffer_k3`" in lines


def test_v2_criterion_not_met_and_not_measured():
    crit = bench.v2_criterion(bench.build_table(_v2_runs(kernel=1.2, host=1.5), bench.V_LIBRARIES))
    assert crit["kernel_us"] == {"ratio_v2_over_v1": pytest.approx(1.2), "at_most": 1.1, "met": False}
    assert crit["host_us"]["met"] is False
    assert "device kernel time V2 / V1 <= 1.1x: 1.20x, NOT met" in bench.criterion_line(crit)
    runs = _v2_runs()
    runs[1]["rows"] = [r for r in runs[1]["rows"] if r["op"] != bench.V2_PAIR_OP]  # V2's pair failed to run
    crit = bench.v2_criterion(bench.build_table(runs, bench.V_LIBRARIES))
    assert crit["kernel_us"]["met"] is None and "not measured" in bench.criterion_line(crit)


def test_summarize_runs_v2_json_has_mode_shapes_criterion_and_rows(tmp_path):
    args = bench.parse(["--mode", "v2", "--ranks", "2", "--json", str(tmp_path / "v2.json")])
    text, doc, status = bench.summarize_runs(args, 1, _v2_runs(kernel=1.0, host=1.1))
    assert status == 0
    assert text.splitlines()[0] == "NOT PERFORMANCE: 2 ranks share one GPU; ratios only"
    assert "host time per call V2 / V1 <= 1x: 1.10x, NOT met" in text
    meta = doc["meta"]
    assert meta["mode"] == "v2" and meta["not_performance"] == "NOT PERFORMANCE: 2 ranks share one GPU; ratios only"
    assert meta["shapes"] == {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "num_sms": 24, "ranks": 2}
    assert meta["criterion"]["kernel_us"]["met"] is True and meta["criterion"]["host_us"]["met"] is False
    assert meta["ours"] == "/site/deepep_kernels/__init__.py" and "deep_ep" not in meta
    assert meta["args"]["mode"] == "v2"
    assert [r["library"] for r in doc["runs"]] == [V1, V2]
    assert [e["op"] for e in doc["table"]] == [op for op, _, _ in bench.V2_OPS]
    bench.write_json(args.json, doc)
    with open(args.json) as f:
        back = json.load(f)
    assert back["table"][-1]["ratio_v2_over_v1"]["host_us"] == pytest.approx(1.1)
    assert back["table"][0]["libraries"][V2]["rounds"][0]["op"] == bench.V2_OPS[0][0]


def test_summarize_runs_v2_errors_give_status_1():
    runs = _v2_runs()
    runs[1]["rows"][2] = dict(runs[1]["rows"][2], kernel_us=None, host_us=None, event_us=None, error="rank 1: RuntimeError: x")
    _, _, status = bench.summarize_runs(bench.parse(["--mode", "v2"]), 2, runs)
    assert status == 1
    runs = _v2_runs()
    runs[1]["error"] = "ProcessRaisedException: boom"
    text, doc, status = bench.summarize_runs(bench.parse(["--mode", "v2"]), 2, runs)
    assert status == 1 and "ERROR: the V2 ranks of round 1 failed: ProcessRaisedException: boom" in text


def test_summarize_runs_compare_mode_keeps_its_meta(tmp_path):
    d = deep_ep_dir(tmp_path)
    args = bench.parse(["--compare-deep-ep", d, "--ranks", "1", "--mode", "ll"])
    runs = _runs()
    runs[0]["meta"] = {"extension": "/x/deep_ep_cpp.so", "device": "NVIDIA H200", "torch": "2.9.0"}
    runs[1]["meta"] = {"module": "/y/deepep_kernels/__init__.py", "device": "NVIDIA H200", "torch": "2.9.0"}
    text, doc, status = bench.summarize_runs(args, 1, runs)
    assert status == 0
    assert text.splitlines()[0].startswith("DeepEP: /x/deep_ep_cpp.so; ours: /y/deepep_kernels/__init__.py; device: NVIDIA H200")
    assert doc["meta"]["mode"] == "ll" and "criterion" not in doc["meta"]
    assert doc["meta"]["shapes"] == {"ll_tokens": 128, "hidden": 7168, "topk": 8, "ll_experts": 288, "ranks": 1}
    assert "ratio_ours_over_deep_ep" in doc["table"][0]


def _load_host_profile():
    path = os.path.join(os.path.dirname(HERE), "scripts", "host_profile.py")
    spec = importlib.util.spec_from_file_location("deepep_host_profile_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_profile_modes_take_their_own_defaults_and_refuse_wrong_rank_counts(capsys):
    hp = _load_host_profile()
    ll = hp.parse([])
    assert (ll.mode, ll.tokens, ll.experts, ll.calls, ll.ranks) == ("ll", 128, 288, 300, 1)
    intra = hp.parse(["--mode", "intranode"])
    # bench.py's normal ops: its shapes and --normal-calls, so the two tools time the same calls
    b = bench.parse([])
    assert (intra.tokens, intra.hidden, intra.topk, intra.experts, intra.num_sms) == (b.tokens, b.hidden, b.topk, b.experts, b.num_sms)
    assert (intra.calls, intra.ranks) == (b.normal_calls, 2)
    assert hp.parse(["--mode", "intranode", "--ranks", "4", "--calls", "20"]).calls == 20
    for argv, fragment in ((["--ranks", "2"], "--mode ll runs one rank"),
                           (["--mode", "intranode", "--ranks", "1"], "needs --ranks >= 2"),
                           (["--calls", "0"], "must be >= 1")):
        with pytest.raises(SystemExit):
            hp.parse(argv)
        assert fragment in capsys.readouterr().err


def test_switched_sets_the_attribute_for_the_call_only_even_when_it_raises():
    class Obj:
        flag = False

    o = Obj()
    seen = []
    bench.switched(o, "flag", True, lambda: seen.append(o.flag))()
    assert seen == [True] and o.flag is False

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        bench.switched(o, "flag", True, boom)()
    assert o.flag is False
