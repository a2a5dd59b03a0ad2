"""``deep_ep.utils.testing``: timing helpers of DeepEP 2.1's tests, written for deepep_kernels.

- ``bench(fn)``: CUDA-event times of ``fn`` (average, min, max in seconds);
- ``bench_kineto(fn, kernel_names)``: the average GPU time of named kernels under the torch
  profiler, in seconds;
- ``flush_l2_cache``, ``suppress_stdout_stderr``, ``empty_suppress``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

__all__ = ["flush_l2_cache", "bench", "empty_suppress", "suppress_stdout_stderr", "bench_kineto"]

# bytes written to push earlier data out of the L2 cache (larger than any Hopper L2)
_L2_FLUSH_BYTES = 256_000_000


def flush_l2_cache(enabled: bool = True) -> None:
    """Zero 256 MB on the current CUDA device (evicting the L2 cache); nothing when disabled."""
    if enabled:
        torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int, device="cuda").zero_()


def bench(fn: Callable[[], object], num_warmups: int = 50, num_tests: int = 50,
          post_fn: Optional[Callable[[], object]] = None, flush_l2: bool = True) -> Tuple[float, float, float]:
    """Run ``fn`` ``num_warmups`` times, then time ``num_tests`` runs with CUDA events (the L2
    cache flushed before each, ``post_fn`` after each, outside the timed span). Returns
    ``(average, min, max)`` in seconds over the runs after the first."""
    import numpy as np

    torch.cuda.synchronize()
    for _ in range(num_warmups):
        fn()
    spans = []
    for _ in range(num_tests):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush_l2_cache(flush_l2)
        start.record()
        fn()
        end.record()
        spans.append((start, end))
        if post_fn is not None:
            post_fn()
    torch.cuda.synchronize()
    seconds = np.array([s.elapsed_time(e) / 1e3 for s, e in spans])[1:]
    return np.average(seconds), np.min(seconds), np.max(seconds)


class empty_suppress:
    """A ``with`` block that changes nothing (``bench_kineto`` without suppression)."""

    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass


class suppress_stdout_stderr:
    """A ``with`` block that sends file descriptors 1 and 2 (C and CUDA libraries' output too) and
    ``sys.stdout`` / ``sys.stderr`` to ``/dev/null``."""

    def __enter__(self):
        self._null = open(os.devnull, "w")
        self._saved_py = (sys.stdout, sys.stderr)
        self._fds = (sys.stdout.fileno(), sys.stderr.fileno())
        self._saved_fds = tuple(os.dup(fd) for fd in self._fds)
        for fd in self._fds:
            os.dup2(self._null.fileno(), fd)
        sys.stdout = sys.stderr = self._null
        return self

    def __exit__(self, *_):
        sys.stdout, sys.stderr = self._saved_py
        for fd, saved in zip(self._fds, self._saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        self._null.close()


def _kernel_events(profiler) -> list:
    """The profiler's averaged events that ran on the GPU, with their total GPU time."""
    out = []
    for evt in profiler.key_averages():
        total = getattr(evt, "device_time_total", None)
        if total is None:
            total = getattr(evt, "cuda_time_total", 0)
        if total > 0 and evt.count > 0:
            out.append((evt.key, total, evt.count))
    return out


def bench_kineto(fn: Callable[[], object],
                 kernel_names: Union[str, tuple],
                 num_tests: int = 30,
                 suppress_kineto_output: bool = False,
                 trace_path: Optional[str] = None,
                 flush_l2: bool = True,
                 barrier_comm_profiling: bool = False,
                 num_kernels_per_period: int = 1,
                 barrier: Optional[Callable[[], object]] = None):
    """The average GPU time in seconds of each kernel whose name contains one of ``kernel_names``
    (a tuple of names gives a list of times), over ``num_tests`` calls of ``fn`` profiled with
    kineto (after one unprofiled call and one profiled warm-up period).

    ``flush_l2`` flushes the L2 cache before each call; ``barrier_comm_profiling`` first queues a
    ~10 ms GPU sleep and a barrier (``barrier()``, or an all-reduce of one float on the default
    group) so that all ranks start together (off with ``EP_DISABLE_BARRIER_PROFILING=1``);
    ``trace_path`` saves the Chrome trace; ``num_kernels_per_period > 1`` returns, per name, the
    average of each of the ``num_kernels_per_period`` launches within one call. A name matching
    kernels of more than one name is refused (``AssertionError``), as DeepEP does. With
    ``EP_USE_NVIDIA_TOOLS=1`` (under Nsight or compute-sanitizer) nothing is profiled and every
    time is 1.
    """
    if not isinstance(kernel_names, (str, tuple)):
        raise TypeError(f"kernel_names must be a str or a tuple of str, got {type(kernel_names).__name__}")
    as_list = isinstance(kernel_names, tuple)
    names = kernel_names if as_list else (kernel_names,)
    if not all(isinstance(n, str) for n in names):
        raise TypeError("kernel_names must hold strings only")
    if int(os.environ.get("EP_USE_NVIDIA_TOOLS", 0)):
        return (1,) * len(names) if as_list else 1

    fn()  # kernels that tune or print on their first call do so outside the profile
    torch.cuda.synchronize()

    barrier_comm_profiling = barrier_comm_profiling and int(os.environ.get("EP_DISABLE_BARRIER_PROFILING", 0)) == 0
    with (suppress_stdout_stderr if suppress_kineto_output else empty_suppress)():
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule, acc_events=True)
        one = torch.ones(1, dtype=torch.float, device="cuda")
        with profiler:
            for _period in range(2):
                for _ in range(num_tests):
                    flush_l2_cache(flush_l2)
                    if barrier_comm_profiling:
                        torch.cuda._sleep(int(2e7))
                        if barrier is None:
                            dist.all_reduce(one)
                        else:
                            barrier()
                    fn()
                torch.cuda.synchronize()
                profiler.step()

    events = _kernel_events(profiler)
    averages: List[Union[float, List[float]]] = []
    for name in names:
        matching = [(key, total, count) for key, total, count in events if name in key]
        assert len(matching) <= 1, f"kernel name {name!r} matches several kernels: {[m[0] for m in matching]}"
        total_us = sum(m[1] for m in matching)
        count = sum(m[2] for m in matching)
        averages.append(total_us / 1e6 / count if count else 0)

    if trace_path is not None:
        profiler.export_chrome_trace(trace_path)

    if num_kernels_per_period > 1:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            profiler.export_chrome_trace(tmp.name)
            with open(tmp.name, encoding="utf-8") as f:
                trace = json.load(f)
        for i, name in enumerate(names):
            launches = sorted((e for e in trace["traceEvents"] if f"::{name}" in e.get("name", "")), key=lambda e: e["ts"])
            durations = [e["dur"] / 1e6 for e in launches]
            if len(durations) % num_kernels_per_period != 0:
                raise AssertionError(f"{len(durations)} launches of {name!r} are not a multiple of num_kernels_per_period = {num_kernels_per_period}")
            periods = len(durations) // num_kernels_per_period
            averages[i] = [sum(durations[j::num_kernels_per_period]) / periods for j in range(num_kernels_per_period)]

    return averages if as_list else averages[0]
