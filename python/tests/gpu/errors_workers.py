"""Per-rank bodies of test_errors.py: routing ids that point nowhere (< -1 or >= num_experts).

Every rank passes the same kind of bad input at the same positions, so every rank raises at the
same call and the ranks stay in step. Each case checks: the kernel completed its call with the bad
selections dropped (outputs equal the torch computation of the input with those ids replaced by
-1); the next Buffer call raises DeviceArgumentError (a ValueError) naming topk_idx, the FIRST bad
position [token, slot], its value, the valid range and the call; that error is raised once; then a
valid round (layout, dispatch, combine) matches its expected result, which proves the CUDA
context and the Buffer survived. Expected values come from workers.py's torch helpers, never from
the package under test."""

import pytest
import torch

from deepep_kernels import Buffer, DeviceArgumentError, _native, check_device_error
from harness import gather
from workers import (HIDDEN, LOCAL_EXPERTS, _combine_copies_weighted, check_equal, expected_layout, expected_recv,
                     ll_expected, make_routing, row_keys)

# (token, slot) of the bad ids: the first one is what the error must name (the kernels keep the
# smallest flat position whatever order their threads find them in).
BAD_AT = ((5, 2), (9, 0), (30, 1))


def _with_bad_ids(idx, value):
    """idx with `value` at BAD_AT (a later one is -2 when value is not, to mix both kinds), and
    the same routing with those selections dropped (-1), which is what the kernels must do."""
    bad, dropped = idx.clone(), idx.clone()
    for i, (t, k) in enumerate(BAD_AT):
        bad[t, k] = value if i < 2 else -2
        dropped[t, k] = -1
    return bad, dropped


def _expect_argument_error(call, value, num_experts, fn):
    """`fn` (the next Buffer call) raises DeviceArgumentError naming the first bad id."""
    t, k = BAD_AT[0]
    with pytest.raises(DeviceArgumentError) as e:
        fn()
    msg = str(e.value)
    assert isinstance(e.value, ValueError), type(e.value)
    want = f"topk_idx[{t}, {k}] = {value} in {call} is not an expert id"
    assert want in msg, f"{msg!r} does not contain {want!r}"
    assert f"[0, {num_experts})" in msg and "fix the router output" in msg, msg
    check_device_error()  # raised once: nothing left
    return msg


def _check_ll_combine(out, x, idx, w):
    """A low-latency combine of unchanged rows (y = recv_x) is sum_k w[t, k] * x[t] over the
    selections of idx that are not -1."""
    n = x.shape[0]
    acc = torch.zeros(n, HIDDEN)
    for k in range(idx.shape[1]):
        sel = idx[:, k] >= 0
        acc += torch.where(sel[:, None], w[:, k : k + 1] * x.float(), torch.zeros(n, HIDDEN))
    torch.testing.assert_close(out.cpu().float(), acc.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _valid_intranode_round(buf, rank, world, group, num_experts, seed):
    """Layout, fresh dispatch and combine of clean routing, each against its torch expectation."""
    n = 48 + 5 * rank
    x, idx, w = make_routing(rank, world, n, num_experts, seed)
    all_x, all_idx, all_w = zip(*gather(group, (x, idx, w)))
    dev = _dev()
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxd, num_experts)
    want_rank, want_expert, want_in = expected_layout(idx, world, num_experts)
    check_equal("valid num_tokens_per_rank", per_rank, want_rank)
    check_equal("valid num_tokens_per_expert", per_expert, want_expert)
    check_equal("valid is_token_in_rank", in_rank, want_in)
    rx, ri, rw, counts, handle, _ = buf.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd)
    ex, _, ei, ew, ecounts, _ = expected_recv(all_x, all_idx, all_w, rank, world, num_experts)
    check_equal("valid recv_x", rx, ex)
    check_equal("valid recv_topk_idx", ri, ei)
    check_equal("valid recv_topk_weights", rw, ew)
    assert counts == ecounts, (counts, ecounts)
    cx, _, _ = buf.combine(rx, handle, topk_weights=rw)
    check_equal("valid combine", cx, _combine_copies_weighted(x, idx, w, world))
    check_device_error()


def layout_bad_ids(rank, world, group):
    """get_dispatch_layout with ids = num_experts, then with ids = -2: counts as if -1, the next
    call raises once, a valid round works."""
    num_experts = LOCAL_EXPERTS * world
    buf = Buffer(group, _native.intranode_buffer_bytes(world, 512, HIDDEN), 0, explicitly_destroy=True)
    dev = _dev()
    for value in (num_experts, -2):
        _, idx, _ = make_routing(rank, world, 40, num_experts, seed=11)
        bad, dropped = _with_bad_ids(idx, value)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(bad.to(dev), num_experts)
        torch.cuda.synchronize()  # the kernel completed (no trap, no CUDA error)
        want_rank, want_expert, want_in = expected_layout(dropped, world, num_experts)
        # read the outputs directly (check_equal would report the record first)
        assert torch.equal(per_rank.cpu(), want_rank), (value, per_rank.cpu(), want_rank)
        assert torch.equal(per_expert.cpu(), want_expert), (value, per_expert.cpu(), want_expert)
        assert torch.equal(in_rank.cpu(), want_in), value
        _expect_argument_error("get_dispatch_layout", value, num_experts,
                               lambda: buf.get_dispatch_layout(idx.to(dev), num_experts))
        _valid_intranode_round(buf, rank, world, group, num_experts, seed=12)
    buf.destroy()


def intranode_dispatch_bad_id(rank, world, group):
    """A fresh intranode dispatch whose layout is valid (computed from routing with -1 at the bad
    positions) but whose topk_idx holds ids that point nowhere: rows go where the layout says,
    the bad slots arrive as -1 with weight 0, the next call (the combine) raises once."""
    num_experts = LOCAL_EXPERTS * world
    buf = Buffer(group, _native.intranode_buffer_bytes(world, 512, HIDDEN), 0, explicitly_destroy=True)
    dev = _dev()
    n = 40 + 3 * rank
    value = num_experts + 7
    x, idx, w = make_routing(rank, world, n, num_experts, seed=13)
    bad, dropped = _with_bad_ids(idx, value)
    all_x, all_idx, all_w = zip(*gather(group, (x, dropped, w)))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(dropped.to(dev), num_experts)
    check_device_error()  # the layout itself was clean
    rx, ri, rw, counts, handle, _ = buf.dispatch(x.to(dev), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=bad.to(dev), topk_weights=w.to(dev))
    torch.cuda.synchronize()
    ex, _, ei, ew, ecounts, _ = expected_recv(all_x, all_idx, all_w, rank, world, num_experts)
    assert torch.equal(rx.cpu().view(torch.int16), ex.view(torch.int16)), "recv_x with a bad id in topk_idx"
    assert torch.equal(ri.cpu(), ei), (ri.cpu(), ei)
    assert torch.equal(rw.cpu(), ew), "recv_topk_weights: a dropped slot has weight 0"
    assert counts == ecounts, (counts, ecounts)
    _expect_argument_error("dispatch", value, num_experts, lambda: buf.combine(rx, handle, topk_weights=rw))
    _valid_intranode_round(buf, rank, world, group, num_experts, seed=14)
    buf.destroy()


def low_latency_bad_ids(rank, world, group):
    """low_latency_dispatch with ids = num_experts, then -5: the received rows are those of the
    routing with the bad selections dropped, the next call raises once, then a valid dispatch +
    combine matches."""
    num_experts = LOCAL_EXPERTS * world
    num_max = 64
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max, HIDDEN, world, num_experts)
    buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // world, explicitly_destroy=True)
    buf.clean_low_latency_buffer(num_max, HIDDEN, num_experts)
    dev = _dev()
    n = 40 + rank
    for i, value in enumerate((num_experts, -5)):
        x, idx, w = make_routing(rank, world, n, num_experts, seed=21 + i)
        bad, dropped = _with_bad_ids(idx, value)
        all_x, all_dropped = zip(*gather(group, (x, dropped)))
        want = ll_expected(all_x, all_dropped, rank, world, num_experts)
        rx, cnt, h, _, _ = buf.low_latency_dispatch(x.to(dev), bad.to(dev), num_max, num_experts, use_fp8=False)
        torch.cuda.synchronize()
        assert cnt.cpu().tolist() == [len(r) for r in want], (value, cnt.cpu().tolist(), [len(r) for r in want])
        for le, rows in enumerate(want):
            assert row_keys(rx[le, : len(rows)].cpu()) == row_keys(rows), f"rows of local expert {le} (bad id {value})"
        _expect_argument_error("low_latency_dispatch", value, num_experts,
                               lambda: buf.low_latency_combine(rx, bad.to(dev), w.to(dev), h))

        # a valid round on the same Buffer
        x, idx, w = make_routing(rank, world, n, num_experts, seed=31 + i)
        all_x, all_idx = zip(*gather(group, (x, idx)))
        want = ll_expected(all_x, all_idx, rank, world, num_experts)
        rx, cnt, h, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), num_max, num_experts, use_fp8=False)
        assert cnt.cpu().tolist() == [len(r) for r in want]
        for le, rows in enumerate(want):
            assert row_keys(rx[le, : len(rows)].cpu()) == row_keys(rows), f"valid rows of local expert {le}"
        out, _, _ = buf.low_latency_combine(rx, idx.to(dev), w.to(dev), h)
        _check_ll_combine(out, x, idx, w)
        check_device_error()
    buf.destroy()


def combine_ignores_bad_ids(rank, world, group):
    """low_latency_combine with the bad topk_idx its dispatch dropped: the dropped selections add
    nothing (the combine reads no stale slot for them)."""
    num_experts = LOCAL_EXPERTS * world
    num_max = 64
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max, HIDDEN, world, num_experts)
    buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // world, explicitly_destroy=True)
    buf.clean_low_latency_buffer(num_max, HIDDEN, num_experts)
    dev = _dev()
    n = 40 + rank
    x, idx, w = make_routing(rank, world, n, num_experts, seed=41)
    bad, dropped = _with_bad_ids(idx, num_experts + 3)
    rx, _, h, _, _ = buf.low_latency_dispatch(x.to(dev), bad.to(dev), num_max, num_experts, use_fp8=False)
    torch.cuda.synchronize()
    with pytest.raises(DeviceArgumentError):
        check_device_error()
    out, _, _ = buf.low_latency_combine(rx, bad.to(dev), w.to(dev), h)
    _check_ll_combine(out, x, dropped, w)
    check_device_error()
    buf.destroy()


def internode_dispatch_bad_id(rank, world, group):
    """The internode (two-hop) dispatch, hosts emulated (one rank per host), with a valid layout
    and a topk_idx holding ids that point nowhere: its notify kernel recomputes the routing from
    topk_idx, drops the bad selections, records the first one; rows go where the clean routing
    says; the next call (the combine) raises once; then a valid round matches."""
    import os

    os.environ["DEEPEP_KERNELS_RANKS_PER_HOST"] = "1"
    os.environ["DEEPEP_KERNELS_MAX_TOKENS"] = "256"
    num_experts = LOCAL_EXPERTS * world
    rdma = Buffer.get_dispatch_config(world).get_rdma_buffer_size_hint(HIDDEN * 2, world)
    buf = Buffer(group, 0, rdma, explicitly_destroy=True)
    assert buf._internode
    dev = _dev()
    n = 40 + 3 * rank
    value = num_experts + 7
    for seed, bad_value in ((15, value), (16, None)):
        x, idx, w = make_routing(rank, world, n, num_experts, seed=seed)
        bad, dropped = _with_bad_ids(idx, bad_value) if bad_value is not None else (idx, idx)
        all_x, all_idx, all_w = zip(*gather(group, (x, dropped, w)))
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(dropped.to(dev), num_experts)
        check_device_error()  # the layout (computed from the clean routing) raised nothing
        rx, ri, rw, counts, handle, _ = buf.dispatch(x.to(dev), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                                                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                     topk_idx=bad.to(dev), topk_weights=w.to(dev))
        torch.cuda.synchronize()
        ex, _, ei, ew, ecounts, _ = expected_recv(all_x, all_idx, all_w, rank, world, num_experts)
        assert torch.equal(rx.cpu().view(torch.int16), ex.view(torch.int16)), f"internode recv_x (bad id {bad_value})"
        assert torch.equal(ri.cpu(), ei), (bad_value, ri.cpu(), ei)
        assert torch.equal(rw.cpu(), ew), f"internode recv_topk_weights (bad id {bad_value})"
        assert counts == ecounts, (bad_value, counts, ecounts)
        if bad_value is not None:
            _expect_argument_error("internode dispatch", bad_value, num_experts, lambda: buf.combine(rx, handle, topk_weights=rw))
        else:
            cx, _, _ = buf.combine(rx, handle, topk_weights=rw)
            check_equal("valid internode combine", cx, _combine_copies_weighted(x, idx, w, world))
            check_device_error()
    buf.destroy()
