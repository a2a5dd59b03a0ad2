"""GPU tests of deepep_kernels: every Buffer method against an independent torch computation of
the contract, at DEEPEP_TEST_RANKS ranks (default 2) on DEEPEP_TEST_GPUS GPUs (see harness.py;
4 and 8 ranks on one GPU run oversubscribed through a gloo group). Run by
python/scripts/gpu-run.sh on the GPU machine."""

import harness
import workers


def test_intranode_layout_dispatch_combine():
    harness.run(workers.intranode)


def test_low_latency_dispatch_combine_hooks_graphs():
    harness.run(workers.low_latency)
