"""GPU tests of the device-side errors that keep the CUDA context: routing ids that point nowhere
(< -1 or >= num_experts) in get_dispatch_layout (intranode and internode), the intranode and internode dispatch and the
low-latency dispatch are dropped, reported once as DeviceArgumentError by the next call, and the Buffer keeps
working (errors_workers.py). At 2 ranks (every rank passes the bad input); run by
python/scripts/gpu-run.sh with the other GPU tests. The peer-timeout case is
test_gpu.py::test_peer_that_stops_calling_is_reported_not_partial_rows."""

import pytest

import errors_workers
import harness


@pytest.fixture(autouse=True)
def _two_ranks():
    if harness.num_ranks() != 2:
        pytest.skip("runs at 2 ranks only (the error paths do not depend on the rank count)")


def test_layout_drops_and_reports_ids_out_of_range():
    # id = num_experts, then id = -2
    harness.run(errors_workers.layout_bad_ids)


def test_intranode_dispatch_drops_and_reports_a_bad_topk_idx_with_a_valid_layout():
    harness.run(errors_workers.intranode_dispatch_bad_id)


def test_internode_layout_drops_and_reports_ids_out_of_range():
    # hosts of one rank; an id whose destination rank is far outside the group, then -2
    harness.run(errors_workers.internode_layout_bad_ids)


def test_internode_dispatch_drops_and_reports_a_bad_topk_idx_with_a_valid_layout():
    # hosts of one rank (DEEPEP_KERNELS_RANKS_PER_HOST=1 in the worker)
    harness.run(errors_workers.internode_dispatch_bad_id)


def test_low_latency_dispatch_drops_and_reports_ids_out_of_range():
    # id = num_experts, then id = -5
    harness.run(errors_workers.low_latency_bad_ids)


def test_low_latency_combine_adds_nothing_for_a_dropped_id():
    harness.run(errors_workers.combine_ignores_bad_ids)


def test_every_kind_of_wrong_argument_is_refused_and_the_buffers_stay_usable():
    harness.run(errors_workers.bad_arguments_refused)
