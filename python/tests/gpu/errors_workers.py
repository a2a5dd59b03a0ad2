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


def _valid_ll_round(buf, rank, world, group, num_experts, num_max, n, seed):
    """A BF16 low-latency dispatch + combine of clean routing (``n`` tokens per rank): received
    rows and counts against ll_expected, the combine against its torch expectation."""
    dev = _dev()
    x, idx, w = make_routing(rank, world, n, num_experts, seed=seed)
    all_x, all_idx = zip(*gather(group, (x, idx)))
    want = ll_expected(all_x, all_idx, rank, world, num_experts)
    rx, cnt, h, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), num_max, num_experts, use_fp8=False)
    assert cnt.cpu().tolist() == [len(r) for r in want], (cnt.cpu().tolist(), [len(r) for r in want])
    for le, rows in enumerate(want):
        assert row_keys(rx[le, : len(rows)].cpu()) == row_keys(rows), f"valid rows of local expert {le}"
    out, _, _ = buf.low_latency_combine(rx, idx.to(dev), w.to(dev), h)
    _check_ll_combine(out, x, idx, w)
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
    num_experts, num_max, n = LOCAL_EXPERTS * world, 64, 40 + rank
    buf = _low_latency_buffer(world, group, num_max, num_experts)
    dev = _dev()
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

        _valid_ll_round(buf, rank, world, group, num_experts, num_max, n, seed=31 + i)  # on the same Buffer
    buf.destroy()


def combine_ignores_bad_ids(rank, world, group):
    """low_latency_combine with the bad topk_idx its dispatch dropped: the dropped selections add
    nothing (the combine reads no stale slot for them)."""
    num_experts, num_max, n = LOCAL_EXPERTS * world, 64, 40 + rank
    buf = _low_latency_buffer(world, group, num_max, num_experts)
    dev = _dev()
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


def _low_latency_buffer(world, group, num_max, num_experts):
    """A Buffer in the low-latency mode for num_max tokens per rank, its buffer cleaned."""
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max, HIDDEN, world, num_experts)
    buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // world, explicitly_destroy=True)
    buf.clean_low_latency_buffer(num_max, HIDDEN, num_experts)
    return buf


def _internode_buffer(world, group):
    """A Buffer in the internode mode, hosts of one rank emulated (DEEPEP_KERNELS_RANKS_PER_HOST=1)."""
    import os

    os.environ["DEEPEP_KERNELS_RANKS_PER_HOST"] = "1"
    os.environ["DEEPEP_KERNELS_MAX_TOKENS"] = "256"
    rdma = Buffer.get_dispatch_config(world).get_rdma_buffer_size_hint(HIDDEN * 2, world)
    buf = Buffer(group, 0, rdma, explicitly_destroy=True)
    assert buf._internode
    return buf


def internode_layout_bad_ids(rank, world, group):
    """get_dispatch_layout of the internode mode (hosts of one rank emulated) with ids that point
    nowhere, far past num_experts and -2: the layout kernel counts them as -1 (the per-host counts
    from its mask too), the next call raises once, and a clean layout follows; the torch path
    (groups over 8 ranks) leaves the same ids out without a record."""
    num_experts = LOCAL_EXPERTS * world
    buf = _internode_buffer(world, group)
    dev = _dev()
    value = num_experts + 5 * LOCAL_EXPERTS  # a destination rank far outside the group
    _, idx, _ = make_routing(rank, world, 40, num_experts, seed=14)
    bad, dropped = _with_bad_ids(idx, value)
    per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(bad.to(dev), num_experts)
    torch.cuda.synchronize()  # the kernel completed (no trap, no CUDA error)
    want_rank, want_expert, want_in = expected_layout(dropped, world, num_experts)
    assert torch.equal(per_rank.cpu(), want_rank), (per_rank.cpu(), want_rank)
    assert torch.equal(per_host.cpu(), want_rank), (per_host.cpu(), want_rank)  # hosts of one rank
    assert torch.equal(per_expert.cpu(), want_expert), (per_expert.cpu(), want_expert)
    assert torch.equal(in_rank.cpu(), want_in)
    _expect_argument_error("get_dispatch_layout", value, num_experts, lambda: buf.get_dispatch_layout(idx.to(dev), num_experts))
    for layout_kernel in (True, False):
        # the torch path of groups the layout kernel does not serve (more than 8 ranks) leaves the
        # bad ids out too, without a record (the internode dispatch reports them)
        buf._layout_kernel = layout_kernel
        if not layout_kernel:
            per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(bad.to(dev), num_experts)
            want_rank, want_expert, want_in = expected_layout(dropped, world, num_experts)
            check_equal("torch path, bad ids: num_tokens_per_rank", per_rank, want_rank)
            check_equal("torch path, bad ids: num_tokens_per_rdma_rank", per_host, want_rank)
            check_equal("torch path, bad ids: num_tokens_per_expert", per_expert, want_expert)
            check_equal("torch path, bad ids: is_token_in_rank", in_rank, want_in)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx.to(dev), num_experts)
        want_rank, want_expert, want_in = expected_layout(idx, world, num_experts)
        check_equal(f"clean internode num_tokens_per_rank ({layout_kernel=})", per_rank, want_rank)
        check_equal(f"clean internode num_tokens_per_rdma_rank ({layout_kernel=})", per_host, want_rank)
        check_equal(f"clean internode num_tokens_per_expert ({layout_kernel=})", per_expert, want_expert)
        check_equal(f"clean internode is_token_in_rank ({layout_kernel=})", in_rank, want_in)
        check_device_error()
    buf.destroy()


def internode_dispatch_bad_id(rank, world, group):
    """The internode (two-hop) dispatch, hosts emulated (one rank per host), with a valid layout
    and a topk_idx holding ids that point nowhere: its notify kernel recomputes the routing from
    topk_idx, drops the bad selections, records the first one; rows go where the clean routing
    says; the next call (the combine) raises once; then a valid round matches."""
    num_experts = LOCAL_EXPERTS * world
    buf = _internode_buffer(world, group)
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


def _refused(what, fn, names):
    """`fn` (a Buffer call with one wrong argument) is refused before any launch with a
    ValueError / TypeError whose message names the argument (one of `names`)."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert any(n in msg for n in names), f"{what}: the message does not name {names}: {msg}"
        return msg
    raise AssertionError(f"{what}: accepted")


def bad_arguments_refused(rank, world, group):
    """Every class of wrong argument, through the API on live Buffers (intranode and low latency):
    a wrong dtype, a CPU tensor, a non-contiguous tensor, a tensor of another batch, FP8 scales
    of the wrong shape, a handle of another Buffer, more tokens than the buffer holds; each is
    refused by the extension's checks with an error naming the argument, no kernel runs (every
    rank passes the same wrong call, so the ranks stay in step), and valid rounds afterwards
    match their expectations: the process and the Buffers stay usable."""
    num_experts = LOCAL_EXPERTS * world
    dev = _dev()
    n = 48
    buf = Buffer(group, _native.intranode_buffer_bytes(world, 64, HIDDEN), 0, explicitly_destroy=True)
    other = Buffer(group, _native.intranode_buffer_bytes(world, 64, HIDDEN), 0, explicitly_destroy=True)
    x, idx, w = make_routing(rank, world, n, num_experts, seed=51)
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxd, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    msgs = []
    msgs.append(_refused("layout, float ids", lambda: buf.get_dispatch_layout(idxd.float(), num_experts), ["topk_idx"]))
    msgs.append(_refused("layout, CPU ids", lambda: buf.get_dispatch_layout(idx, num_experts), ["topk_idx"]))
    nc = torch.empty(idxd.shape[1], n, dtype=torch.int64, device=dev).t()
    nc.copy_(idxd)
    msgs.append(_refused("layout, non-contiguous ids", lambda: buf.get_dispatch_layout(nc, num_experts), ["topk_idx"]))
    msgs.append(_refused("dispatch, float32 x", lambda: buf.dispatch(xd.float(), topk_idx=idxd, topk_weights=wd, **layout), ["x"]))
    msgs.append(_refused("dispatch, x of another batch", lambda: buf.dispatch(xd[: n - 1], topk_idx=idxd[: n - 1], topk_weights=wd[: n - 1], **layout),
                         ["is_token_in_rank", "num_tokens_per_rank", "topk_idx"]))
    msgs.append(_refused("dispatch, weights [n, k-1]", lambda: buf.dispatch(xd, topk_idx=idxd, topk_weights=wd[:, :-1].contiguous(), **layout),
                         ["topk_weights"]))
    xq = xd.to(torch.float8_e4m3fn)
    bad_scales = torch.ones(n, HIDDEN // 128 + 1, dtype=torch.float32, device=dev)
    msgs.append(_refused("dispatch, FP8 scales [n, hidden/128 + 1]", lambda: buf.dispatch((xq, bad_scales), topk_idx=idxd, topk_weights=wd, **layout),
                         ["scales"]))
    big = make_routing(rank, world, 200, num_experts, seed=52)
    bl = buf.get_dispatch_layout(big[1].to(dev), num_experts)
    msgs.append(_refused("dispatch, more tokens than num_nvl_bytes holds",
                         lambda: buf.dispatch(big[0].to(dev), topk_idx=big[1].to(dev), topk_weights=big[2].to(dev), num_tokens_per_rank=bl[0],
                                              is_token_in_rank=bl[3], num_tokens_per_expert=bl[2]), ["num_nvl_bytes"]))
    # a handle of another Buffer
    op, _, oe, oi, _ = other.get_dispatch_layout(idxd, num_experts)
    orx, _, orw, _, oh, _ = other.dispatch(xd, topk_idx=idxd, topk_weights=wd, num_tokens_per_rank=op, is_token_in_rank=oi, num_tokens_per_expert=oe)
    msgs.append(_refused("combine, handle of another Buffer", lambda: buf.combine(orx, oh, topk_weights=orw), ["handle", "Buffer"]))
    check_device_error()  # nothing reached a kernel
    _valid_intranode_round(buf, rank, world, group, num_experts, seed=53)
    _valid_intranode_round(other, rank, world, group, num_experts, seed=54)
    other.destroy()
    buf.destroy()

    num_max = 32
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max, HIDDEN, world, num_experts)
    ll = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=LOCAL_EXPERTS, explicitly_destroy=True)
    x, idx, w = make_routing(rank, world, 20, num_experts, seed=55)
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    msgs.append(_refused("low_latency_dispatch, float32 x", lambda: ll.low_latency_dispatch(xd.float(), idxd, num_max, num_experts), ["x"]))
    msgs.append(_refused("low_latency_dispatch, int32 ids", lambda: ll.low_latency_dispatch(xd, idxd.int(), num_max, num_experts), ["topk_idx"]))
    msgs.append(_refused("low_latency_dispatch, CPU x", lambda: ll.low_latency_dispatch(x, idxd, num_max, num_experts), ["x"]))
    x40, i40, _ = make_routing(rank, world, num_max + 8, num_experts, seed=56)
    msgs.append(_refused("low_latency_dispatch, more tokens than num_max", lambda: ll.low_latency_dispatch(x40.to(dev), i40.to(dev), num_max, num_experts),
                         ["num_max", "tokens"]))
    check_device_error()
    _valid_ll_round(ll, rank, world, group, num_experts, num_max, 20, seed=55)  # the same routing, now valid
    ll.destroy()
    if rank == 0:
        print("refusals:", *msgs, sep="\n  ", flush=True)
