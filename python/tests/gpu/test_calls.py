"""At most 3 calls into the extension per dispatch and per combine in each mode (issue 37), counted
with a profile hook around real calls whose results are checked (calls_workers.py). Run by
python/scripts/gpu-run.sh on the GPU machine."""

import calls_workers
import harness


def test_intranode_calls_into_the_extension():
    harness.run(calls_workers.intranode)


def test_low_latency_calls_into_the_extension():
    harness.run(calls_workers.low_latency)


def test_internode_calls_into_the_extension():
    harness.run(calls_workers.internode)
