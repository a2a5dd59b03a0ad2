"""At most 3 calls into the extension per dispatch and per combine in each mode (issue 37), counted
with a profile hook around real calls whose results are checked (calls_workers.py). Run by
python/scripts/gpu-run.sh on the GPU machine."""

import pytest

import calls_workers
import harness


@pytest.mark.parametrize("mode", ["intranode", "low_latency", "internode"])
def test_calls_into_the_extension(mode):
    harness.run(getattr(calls_workers, mode))
