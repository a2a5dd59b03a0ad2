"""A peer that dies (SIGKILL) mid-run: bounded, named errors on every survivor, a live CUDA
context, a working destroy() (or, with DeepEP's default options, a dropped Buffer whose error
record goes with it), and a new Buffer of the survivors (dead_peer.py says how)."""

import pytest

import dead_peer
import harness


def _check_survivors(codes, reports, world, lost, new_ll):
    assert codes[lost] == -9, f"rank {lost} was to die by SIGKILL, exit code {codes[lost]}"
    for r in range(world):
        if r == lost:
            continue
        rep = reports.get(r)
        assert rep is not None, f"rank {r} wrote no report (exit code {codes[r]})"
        assert "exception" not in rep, f"rank {r}: {rep.get('exception')}"
        assert rep.get("warmup_ok"), f"rank {r}: the round before the loss failed"
        assert rep.get("error_type"), f"rank {r}: no error after rank {lost} died: {rep}"
        assert rep["names_rank"] and rep["names_peer"] and rep["names_call"], f"rank {r}: the error does not name rank, peer and call: {rep['message']}"
        assert rep["elapsed_s"] <= dead_peer.BOUND_S + dead_peer.SLACK_S, f"rank {r}: the error came after {rep['elapsed_s']:.1f} s"
        assert rep["destroy_s"] < 10, f"rank {r}: destroy() took {rep['destroy_s']:.1f} s"
        assert rep["context_alive"], f"rank {r}: the CUDA context did not survive"
        if r in (0, 1):
            assert rep.get("second_buffer_ok"), f"rank {r}: no working Buffer on the survivors' group: {rep}"
            if new_ll:
                assert rep.get("second_ll") == "ok", f"rank {r}: the survivors' low-latency Buffer: {rep.get('second_ll')}"


def _only_once():
    if harness.num_ranks() != 2:
        pytest.skip("runs once, in the 2-rank pass (it starts its own 4 and 3 ranks)")


def _survivors_of(body, world, new_ll):
    """Runs `body` at `world` ranks, of which the last dies, and checks every survivor; the reports."""
    _only_once()
    codes, reports = dead_peer.run(body, world)
    print(reports)
    _check_survivors(codes, reports, world, world - 1, new_ll=new_ll)
    return reports


def test_dead_peer_normal_mode_4_to_2():
    reports = _survivors_of(dead_peer.normal_body, 4, new_ll=False)
    assert all(reports[r]["sticky"] for r in range(3)), "the Buffer that lost a peer must keep refusing until destroy()"


def test_dead_peer_low_latency_3_to_2():
    _survivors_of(dead_peer.ll_body, 3, new_ll=True)


def test_dead_peer_between_dispatch_and_combine_default_options_normal_4_to_2():
    reports = _survivors_of(dead_peer.normal_default_body, 4, new_ll=False)
    assert all(reports[r]["old_record_gone"] for r in range(3)), "dropping the Buffer must retire its error record"


def test_dead_peer_between_dispatch_and_combine_default_options_low_latency_3_to_2():
    reports = _survivors_of(dead_peer.ll_default_body, 3, new_ll=True)
    assert all(reports[r]["old_record_gone"] for r in range(2)), "dropping the Buffer must retire its error record"
