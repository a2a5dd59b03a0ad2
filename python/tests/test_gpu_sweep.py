"""python/scripts/gpu-sweep.sh ends each job's line in summary.txt with the most GPU memory in use
while the job ran, so that a run near the card's limit (internode16 on an H100, DeepEP 2.1's test
at 8 ranks) says how near it came.

There is no GPU here, so a stand-in `nvidia-smi` first on PATH answers the sweep's queries: the
card's total, and memory in use that is 70000 MiB at the first sample of the whole run and
3000 MiB afterwards. Its plain call (the `info` job's) takes 1 s, so the sweep's 2 s sampler
takes its first sample inside the first job. The real card's answers differ; the sweep's
arithmetic over them does not."""

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(REPO, "python", "scripts", "gpu-sweep.sh")

FAKE_SMI = """#!/usr/bin/env bash
# stand-in for nvidia-smi (no GPU here): the first memory.used answer of the run is 70000 MiB
case "$*" in
  *memory.total*) echo 81559 ;;
  *memory.used*) if mkdir "$(dirname "$0")/first-sample-taken" 2>/dev/null; then echo 70000; else echo 3000; fi ;;
  *) sleep 1; echo "stand-in nvidia-smi" ;;
esac
"""

NO_SMI = """#!/usr/bin/env bash
# stand-in for a machine whose nvidia-smi answers nothing
exit 9
"""


def sweep(tmp_path, smi, *jobs):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(smi)
    (bindir / "nvidia-smi").chmod(0o755)
    wheel = tmp_path / "deepep_kernels-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl"
    wheel.write_bytes(b"not a wheel: the info job only lists it")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               SCRATCH=str(tmp_path / "scratch"), WHEEL=str(wheel), RECORD_COMMIT="0" * 40)
    p = subprocess.run(["bash", SWEEP, *jobs], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return (tmp_path / "out" / "summary.txt").read_text()


def test_each_job_line_gives_the_peak_memory_in_use_while_it_ran(tmp_path):
    summary = sweep(tmp_path, FAKE_SMI, "info", "info")
    ends = re.findall(r"end info: exit (\d+), peak (\S+) MiB of (\S+) MiB GPU memory in use", summary)
    # the first job saw 70000 MiB in its first sample and 3000 at its end: the peak is the largest
    # sample, not the last; the second job starts afresh and saw only 3000
    assert ends == [("0", "70000", "81559"), ("0", "3000", "81559")], summary
    assert "GPU memory 81559 MiB (big=0)" in summary, summary


def test_without_answers_from_nvidia_smi_the_peak_is_unknown_not_zero(tmp_path):
    summary = sweep(tmp_path, NO_SMI, "info")
    assert re.search(r"end info: exit 0, peak \? MiB of \? MiB GPU memory in use", summary), summary
