"""Counts the calls into the extension (``deepep_kernels._native``) that one Buffer call makes:
issue 37 asks for at most 3 per dispatch and per combine in each mode (DeepEP makes 1). A call is
a ``c_call`` profile event (``sys.setprofile``) of a function or method of the extension module
or of one of its classes; torch calls are not counted. Each body also checks that the counted
calls produced right results (a count of a broken call proves nothing)."""

import os
import sys

import torch

from deepep_kernels import Buffer, _native
from harness import gather
from workers import HIDDEN, LOCAL_EXPERTS, check_equal, expected_layout, expected_recv, ll_expected, make_routing, row_keys

MAX_CALLS = 3


def _is_native(fn) -> bool:
    owner = getattr(fn, "__self__", None)
    if owner is _native:
        return True
    if isinstance(owner, type):  # a static method of a native class
        return owner.__module__ == "deepep_kernels._native"
    return type(owner).__module__ == "deepep_kernels._native"


def counted(f):
    """``(f(), native calls f made, their names)``."""
    names = []

    def prof(frame, event, arg):
        if event == "c_call" and _is_native(arg):
            names.append(getattr(arg, "__qualname__", getattr(arg, "__name__", "?")))

    sys.setprofile(prof)
    try:
        out = f()
    finally:
        sys.setprofile(None)
    return out, len(names), names


def _expect(what, n, names, counts):
    assert 1 <= n <= MAX_CALLS, f"{what}: {n} calls into the extension ({names}); at most {MAX_CALLS} (and at least the call itself)"
    counts[what] = n


def _counter_counts():
    # the counter itself: two native calls, one torch call
    _, n, names = counted(lambda: (_native.cuda_available(), _native.is_sm90_compiled(), torch.zeros(1)))
    assert n == 2, names


def intranode(rank, world, group):
    """Layout, fresh and cached dispatch, combine (BF16), with and without async_finish."""
    _counter_counts()
    num_experts = LOCAL_EXPERTS * world
    buf = Buffer(group, _native.intranode_buffer_bytes(world, 512, HIDDEN), 0, explicitly_destroy=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = make_routing(rank, world, 64 + rank, num_experts, seed=31)
    all_x, all_idx, all_w = zip(*gather(group, (x, idx, w)))
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    buf.get_dispatch_layout(idxd, num_experts)  # creates the NVLink buffer (not counted: first use)
    counts = {}
    for async_finish in (False, True):
        tag = " async" if async_finish else ""
        (per_rank, _, per_expert, in_rank, ev), n, names = counted(lambda: buf.get_dispatch_layout(idxd, num_experts, async_finish=async_finish))
        _expect("layout" + tag, n, names, counts)
        if async_finish:
            # the layout ran on the comm stream: its outputs are ready only once the current stream
            # waits for its event (reading them before raced the kernel, and lost at 8 ranks under
            # MPS: all-zero counts, record 2026-12-07-gpu-tests-1xh100-8-ranks-dlpack-views)
            ev.current_stream_wait()
        want_rank, want_expert, want_in = expected_layout(idx, world, num_experts)
        check_equal("num_tokens_per_rank", per_rank, want_rank)
        check_equal("is_token_in_rank", in_rank, want_in)
        (rx, ri, rw, c, handle, ev), n, names = counted(lambda: buf.dispatch(
            xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd,
            previous_event=ev if async_finish else None, async_finish=async_finish))
        _expect("dispatch" + tag, n, names, counts)
        if async_finish:
            ev.current_stream_wait()
        ex, _, ei, ew, ecounts, _ = expected_recv(all_x, all_idx, all_w, rank, world, num_experts)
        check_equal("recv_x", rx, ex)
        assert c == ecounts
        (rx2, *_), n, names = counted(lambda: buf.dispatch(xd, handle=handle))
        _expect("cached dispatch" + tag, n, names, counts)
        check_equal("cached recv_x", rx2, ex)
        (cx, cw, ev), n, names = counted(lambda: buf.combine(rx, handle, topk_weights=rw, async_finish=async_finish))
        _expect("combine" + tag, n, names, counts)
        if async_finish:
            ev.current_stream_wait()
        assert cx.shape == (x.shape[0], HIDDEN) and cw.shape == w.shape
    print(f"rank {rank}: intranode extension calls {counts}")
    buf.destroy()


def low_latency(rank, world, group):
    """Low-latency dispatch and combine (BF16), with and without async_finish and hooks."""
    _counter_counts()
    num_experts, num_max = LOCAL_EXPERTS * world, 32
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max, HIDDEN, world, num_experts)
    buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=LOCAL_EXPERTS, explicitly_destroy=True)
    buf.clean_low_latency_buffer(num_max, HIDDEN, num_experts)
    dev = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = make_routing(rank, world, 16 + rank, num_experts, seed=32)
    all_x, all_idx = zip(*gather(group, (x, idx)))
    want = ll_expected(all_x, all_idx, rank, world, num_experts)
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    counts = {}
    for async_finish, hook_mode in ((False, False), (True, False), (False, True)):
        tag = (" async" if async_finish else "") + (" hook" if hook_mode else "")

        def finish(what, ev, hook):
            # the receive hook is one more counted call; an async call's event is waited for
            if hook_mode:
                _, n, names = counted(hook)
                _expect(what + " hook", n, names, counts)
            if async_finish:
                ev.current_stream_wait()

        (rx, cnt, h, ev, hook), n, names = counted(lambda: buf.low_latency_dispatch(
            xd, idxd, num_max, num_experts, use_fp8=False, async_finish=async_finish, return_recv_hook=hook_mode))
        _expect("ll dispatch" + tag, n, names, counts)
        finish("ll dispatch", ev, hook)
        assert cnt.cpu().tolist() == [len(r) for r in want]
        for le, rows in enumerate(want):
            assert row_keys(rx[le, : len(rows)].cpu()) == row_keys(rows)
        (out, ev, hook), n, names = counted(lambda: buf.low_latency_combine(rx, idxd, wd, h, async_finish=async_finish,
                                                                           return_recv_hook=hook_mode))
        _expect("ll combine" + tag, n, names, counts)
        finish("ll combine", ev, hook)
        assert out.shape == (x.shape[0], HIDDEN)
    print(f"rank {rank}: low-latency extension calls {counts}")
    buf.destroy()


def internode(rank, world, group):
    """Internode (emulated hosts of world/2 ranks) layout, fresh and cached dispatch, combine."""
    _counter_counts()
    os.environ["DEEPEP_KERNELS_RANKS_PER_HOST"] = str(max(1, world // 2))
    os.environ["DEEPEP_KERNELS_MAX_TOKENS"] = "256"
    num_experts = LOCAL_EXPERTS * world
    rdma = Buffer.get_dispatch_config(world).get_rdma_buffer_size_hint(HIDDEN * 2, world)
    buf = Buffer(group, 0, rdma, explicitly_destroy=True)
    assert buf._internode
    dev = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = make_routing(rank, world, 64 + rank, num_experts, seed=33)
    all_x, all_idx, all_w = zip(*gather(group, (x, idx, w)))
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    counts = {}
    (per_rank, per_host, per_expert, in_rank, _), n, names = counted(lambda: buf.get_dispatch_layout(idxd, num_experts))
    _expect("internode layout", n, names, counts)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    buf.dispatch(xd, topk_idx=idxd, topk_weights=wd, **layout)  # creates the internode buffer (first use)
    (rx, ri, rw, c, handle, _), n, names = counted(lambda: buf.dispatch(xd, topk_idx=idxd, topk_weights=wd, **layout))
    _expect("internode dispatch", n, names, counts)
    ex, _, _, _, ecounts, _ = expected_recv(all_x, all_idx, all_w, rank, world, num_experts)
    check_equal("internode recv_x", rx, ex)
    assert c == ecounts
    (nx, ni, _, nc, _, _), n, names = counted(lambda: buf.dispatch(xd, **layout))
    _expect("internode dispatch without top-k", n, names, counts)
    assert ni is None and nc == expected_recv(all_x, all_idx, all_w, rank, world, num_experts)[4]
    (rx2, *_), n, names = counted(lambda: buf.dispatch(xd, handle=handle))
    _expect("internode cached dispatch", n, names, counts)
    check_equal("internode cached recv_x", rx2, ex)
    (cx, cw, _), n, names = counted(lambda: buf.combine(rx, handle, topk_weights=rw))
    _expect("internode combine", n, names, counts)
    assert cx.shape == (x.shape[0], HIDDEN)
    print(f"rank {rank}: internode extension calls {counts}")
    buf.destroy()
