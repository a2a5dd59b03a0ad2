"""GPU tests of deepep_kernels: every Buffer method against an independent torch computation of
the contract (intranode, low-latency, and internode through emulated hosts), at
DEEPEP_TEST_RANKS ranks (default 2) on DEEPEP_TEST_GPUS GPUs (see harness.py; 4 and 8 ranks on
one GPU run oversubscribed through a gloo group). Run by
python/scripts/gpu-run.sh on the GPU machine."""

import harness
import workers


def test_intranode_layout_dispatch_combine():
    harness.run(workers.intranode)


def test_low_latency_dispatch_combine_hooks_graphs():
    harness.run(workers.low_latency)


def test_internode_layout_dispatch_combine():
    # emulated hosts (DEEPEP_KERNELS_RANKS_PER_HOST set in the worker): 2 ranks in hosts of 1,
    # 4 in hosts of 2, 8 in hosts of 4
    harness.run(workers.internode)


def test_internode_one_rank_per_host():
    if harness.num_ranks() == 2:
        import pytest

        pytest.skip("at 2 ranks test_internode_layout_dispatch_combine already runs hosts of one rank")
    harness.run(workers.internode_hosts_of_one)


def test_deepep_semantics_handles_without_topk_zero_copy():
    # what DeepEP's own tests exercise (python/scripts/deepep-conformance.sh runs them unchanged)
    harness.run(workers.deepep_semantics)


def test_peer_that_stops_calling_is_reported_not_partial_rows():
    # rank 0 gets the named timeout from its next call and keeps a working CUDA context
    if harness.num_ranks() != 2:
        import pytest

        pytest.skip("runs at 2 ranks only (one peer stops; the other reports it)")
    harness.run(workers.peer_stops_calling)


def test_tensors_freed_after_their_buffer_and_the_stream_taken_over():
    # tensors tied to a destroyed or collected Buffer's comm stream are freed afterwards without
    # an abort; the next Buffer reuses the idle stream (DEEPEP_KERNELS_KEEP_COMM_STREAMS, default 1)
    harness.run(workers.tensors_outlive_their_buffer)
