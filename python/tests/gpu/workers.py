"""Per-rank bodies of the GPU tests. Each checks deepep_kernels against an independent torch
computation (on the CPU, from every rank's inputs gathered through the gloo group) of the
contract in the project's docs (ep-contract.md section 7): the expected values are computed
here, never by the package under test."""

import os

import torch

from deepep_kernels import Buffer, EventOverlap, _native, check_device_error
from deepep_kernels.utils import EventHandle
from harness import gather

HIDDEN = 2048
TOPK = 4
LOCAL_EXPERTS = 4


def make_routing(rank, world, n, num_experts, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    scores = torch.rand(n, num_experts, generator=g)
    idx = scores.topk(TOPK, dim=1).indices.to(torch.int64)
    # some unused slots (-1), like the DeepEP tests
    drop = torch.rand(n, TOPK, generator=g) < 0.1
    idx[drop] = -1
    w = torch.rand(n, TOPK, generator=g, dtype=torch.float32)
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    return x, idx, w


def expected_layout(idx, world, num_experts):
    local = num_experts // world
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    in_rank = torch.zeros(idx.shape[0], world, dtype=torch.bool)
    for t in range(idx.shape[0]):
        for e in idx[t].tolist():
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // local] = True
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


def expected_recv(all_x, all_idx, all_w, rank, world, num_experts, alignment=1, all_scales=None):
    """Rows this rank receives, ordered by source rank, then source token."""
    local = num_experts // world
    lo, hi = rank * local, (rank + 1) * local
    xs, ss, ids, ws, src = [], [], [], [], []
    counts = [0] * local
    for s in range(world):
        for t in range(all_idx[s].shape[0]):
            row = all_idx[s][t]
            if not any(lo <= e < hi for e in row.tolist()):
                continue
            xs.append(all_x[s][t])
            if all_scales is not None:
                ss.append(all_scales[s][t])
            mine = torch.where((row >= lo) & (row < hi), row - lo, torch.full_like(row, -1))
            ids.append(mine)
            ws.append(torch.where(mine >= 0, all_w[s][t], torch.zeros_like(all_w[s][t])))
            src.append((s, t))
            for e in mine.tolist():
                if e >= 0:
                    counts[e] += 1
    counts = [(c + alignment - 1) // alignment * alignment for c in counts]
    m = len(xs)
    dtype = all_x[0].dtype
    x = torch.stack(xs) if m else torch.empty(0, HIDDEN, dtype=dtype)
    sc = (torch.stack(ss) if m else torch.empty(0, all_scales[0].shape[1])) if all_scales is not None else None
    i = torch.stack(ids) if m else torch.empty(0, TOPK, dtype=torch.int64)
    w = torch.stack(ws) if m else torch.empty(0, TOPK)
    return x, sc, i, w, counts, src


def combined_copies(x, sends):
    """The combine of unchanged copies: x times the number of ranks the token went to, summed
    from +0.0 as the kernel does, so a token sent nowhere is +0.0 (x * 0 would keep x's sign and
    give -0.0 for negative x, a different bit pattern)."""
    cnt = sends.sum(1, keepdim=True).float()
    return torch.where(cnt > 0, x.float() * cnt, torch.zeros_like(x, dtype=torch.float32)).to(torch.bfloat16)


def bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int16)


def check_equal(name, got, want):
    # a kernel that gave up a wait (or dropped a bad id) recorded why: report that, not a data mismatch
    check_device_error()
    got = got.cpu()
    check_device_error()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: got shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if got.dtype in (torch.bfloat16, torch.float8_e4m3fn):
        same = bits(got) == bits(want)
    else:
        same = got == want
    if bool(same.all()):
        return
    # where it differs: rows, and for float rows the ratio got/want (e.g. a missing contribution)
    bad = ~same.reshape(same.shape[0], -1).all(1) if same.dim() > 1 else ~same
    rows = bad.nonzero().flatten().tolist()
    r = rows[0]
    detail = f"{len(rows)} of {same.shape[0]} rows differ (first {rows[:12]}); row {r}: got {got[r].flatten()[:6].tolist()} want {want[r].flatten()[:6].tolist()}"
    if got.is_floating_point() and got.dim() == 2:
        g, w = got[r].float(), want[r].float()
        nz = w.abs() > 1e-3
        if bool(nz.any()):
            ratio = (g[nz] / w[nz])
            detail += f"; got/want in row {r}: min {ratio.min().item():.4g} max {ratio.max().item():.4g}"
    raise AssertionError(f"{name}: {detail}")


def _check_dispatch_aligned_to_4(got, all_x, all_idx, all_w, rank, world, num_experts):
    """Checks a fresh BF16 dispatch with expert_alignment=4 (`got`: what buf.dispatch returned, after
    an EventOverlap without event) against expected_recv: rows, top-k ids and weights, the counts
    list and no event. Returns the expected rows, top-k ids and sources."""
    rx, ri, rw, counts, _, ev = got
    ex, _, ei, ew, ecounts, src = expected_recv(all_x, all_idx, all_w, rank, world, num_experts, alignment=4)
    check_equal("recv_x", rx, ex)
    check_equal("recv_topk_idx", ri, ei)
    check_equal("recv_topk_weights", rw, ew)
    assert counts == ecounts, (counts, ecounts)
    assert isinstance(counts, list) and ev.event is None
    return ex, ei, src


def _micro_batch_b(buf, group, rank, world, num_experts, dev, batch_a, seed, rdma_layout=False):
    """Micro-batch B (fresh routing from `seed`, its layout, a dispatch) while micro-batch A's
    outputs are in use (`batch_a`: A's received rows, the rows expected and A's handle): both
    received rows must still be right, then both are combined. `rdma_layout`: the dispatch gets
    B's num_tokens_per_rdma_rank too (internode). Returns A's and B's combined rows, and B's
    tokens and top-k ids."""
    rxa, exa, handle_a = batch_a
    xb, idxb, wb = make_routing(rank, world, 64 + 7 * rank, num_experts, seed=seed)
    all_xb, all_idxb, all_wb = zip(*gather(group, (xb, idxb, wb)))
    pr_b, ph_b, pe_b, ir_b, _ = buf.get_dispatch_layout(idxb.to(dev), num_experts)
    layout = dict(num_tokens_per_rank=pr_b, is_token_in_rank=ir_b, num_tokens_per_expert=pe_b)
    if rdma_layout:
        layout["num_tokens_per_rdma_rank"] = ph_b
    rxb, _, _, _, handle_b, _ = buf.dispatch(xb.to(dev), topk_idx=idxb.to(dev), topk_weights=wb.to(dev), **layout)
    exb = expected_recv(all_xb, all_idxb, all_wb, rank, world, num_experts)[0]
    check_equal("micro-batch A recv_x after B's dispatch", rxa, exa)
    check_equal("micro-batch B recv_x", rxb, exb)
    ca, _, _ = buf.combine(rxa, handle_a)
    cb, _, _ = buf.combine(rxb, handle_b)
    return ca, cb, xb, idxb


def _check_cached_dispatch(buf, group, x, handle, src, dev):
    """A cached dispatch of other data (2x + 1) along the routes of `handle`: the rows of every
    rank's data at the sources `src` (pairs of (rank, token)), and no layout outputs."""
    x2 = (x.float() * 2 + 1).to(torch.bfloat16)
    all_x2 = gather(group, x2)
    rx2, a, b, c, d, _ = buf.dispatch(x2.to(dev), handle=handle)
    assert (a, b, c, d) == (None, None, None, None)
    check_equal("cached recv_x", rx2, torch.stack([all_x2[s][t] for s, t in src]) if src else torch.empty(0, HIDDEN, dtype=torch.bfloat16))


def _scale_layouts(sc, dev):
    """FP8 scales on the device as DeepEP's callers pass them: (False, row-major), then (True, a
    column-major view, DeepEP's intranode test)."""
    return ((False, sc.to(dev)), (True, sc.to(dev).t().contiguous().t()))


def _fp8_routing(group, rank, world, n, num_experts, all_idx, all_w, seed):
    """FP8 inputs of this rank (n x HIDDEN e4m3 and its [n, HIDDEN / 128] scales), the rows and
    scales this rank should receive of every rank's along the given routing, and the generator
    they were drawn from (for the draws that follow)."""
    g = torch.Generator().manual_seed(seed)
    xq = torch.randn(n, HIDDEN, generator=g).to(torch.float8_e4m3fn)
    sc = torch.rand(n, HIDDEN // 128, generator=g) + 0.5
    # float8 tensors do not survive all_gather_object's unpickling in torch 2.11: send the bytes.
    all_xq, all_sc = zip(*gather(group, (xq.view(torch.uint8), sc)))
    all_xq = [t.view(torch.float8_e4m3fn) for t in all_xq]
    exq, esc, _, _, _, _ = expected_recv(all_xq, all_idx, all_w, rank, world, num_experts, all_scales=all_sc)
    return xq, sc, exq, esc, g


def intranode(rank, world, group):
    """Layout, fresh/cached dispatch (BF16, FP8 row- and column-major scales), expert alignment,
    num_worst_tokens, combine with weights and two biases, previous_event/async_finish/
    allocate_on_comm_stream, and two micro-batches alive at once."""
    num_experts = LOCAL_EXPERTS * world
    nvl_bytes = _native.intranode_buffer_bytes(world, 512, 7168)
    os.environ.pop("DEEPEP_KERNELS_RECV_ARENA_BYTES", None)  # the default receive arena (twice the fixed receive region)
    buf = Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
    assert buf.group_size == world and buf.rank == rank
    cs = buf.get_comm_stream()
    assert cs.cuda_stream == buf._rt().comm_stream()
    n = 96 + 13 * rank
    x, idx, w = make_routing(rank, world, n, num_experts, seed=1)
    all_x, all_idx, all_w = zip(*gather(group, (x, idx, w)))
    dev = torch.device("cuda", torch.cuda.current_device())
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)

    # layout
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idxd, num_experts)
    assert per_rdma is None and ev.event is None
    want_rank, want_expert, want_in = expected_layout(idx, world, num_experts)
    check_equal("num_tokens_per_rank", per_rank, want_rank)
    check_equal("num_tokens_per_expert", per_expert, want_expert)
    check_equal("is_token_in_rank", in_rank, want_in)

    # routing tensors of another batch are refused before anything runs (on every rank alike:
    # the checks precede the collective launch), each named
    import pytest

    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd)
    for name, wrong in (("topk_idx", idxd[:-1].contiguous()), ("topk_weights", wd[:, :-1].contiguous()),
                        ("is_token_in_rank", in_rank[:-1].contiguous())):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            buf.dispatch(xd, **{**layout, name: wrong})

    # fresh BF16 dispatch with alignment 4
    got = buf.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=idxd, topk_weights=wd, expert_alignment=4,
                       previous_event=ev)  # an EventOverlap without event, as Megatron passes it
    rx, _, rw, _, handle, _ = got
    ex, ei, src = _check_dispatch_aligned_to_4(got, all_x, all_idx, all_w, rank, world, num_experts)

    _check_cached_dispatch(buf, group, x, handle, src, dev)

    # FP8 with row-major and column-major scales
    xq, sc, exq, esc, g = _fp8_routing(group, rank, world, n, num_experts, all_idx, all_w, seed=77 + rank)
    for colmajor, scd in _scale_layouts(sc, dev):
        (rq, rs), _, _, _, _, _ = buf.dispatch((xq.to(dev), scd), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd)
        check_equal(f"fp8 recv_x (colmajor={colmajor})", rq, exq)
        check_equal(f"fp8 recv_scales (colmajor={colmajor})", rs, esc)

    # num_worst_tokens: W rows, no counts list, padded top-k ids are -1
    worst = sum(t.shape[0] for t in all_idx)
    wx, wi, ww, wcounts, whandle, _ = buf.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd, num_worst_tokens=worst)
    m = ex.shape[0]
    assert wx.shape[0] == worst and wcounts == []
    check_equal("worst recv_x[:M]", wx[:m], ex)
    check_equal("worst recv_topk_idx[:M]", wi[:m], ei)
    assert bool((wi[m:] == -1).all()), "rows past the received count must have top-k id -1"
    # combine and cached dispatch with the padded handle (DeepEP passes W rows around)
    wc, wcw, _ = buf.combine(wx, whandle, topk_weights=ww)
    sends = torch.stack([torch.tensor([any(d * LOCAL_EXPERTS <= e < (d + 1) * LOCAL_EXPERTS for e in row.tolist()) for row in idx])
                         for d in range(world)], 1)
    check_equal("worst combine", wc, combined_copies(x, sends))
    torch.testing.assert_close(wcw.cpu(), torch.where(idx >= 0, w, torch.zeros_like(w)), rtol=1e-6, atol=1e-6)
    wx2, _, _, _, _, _ = buf.dispatch(xd, handle=whandle)
    assert wx2.shape[0] == worst
    check_equal("worst cached recv_x[:M]", wx2[:m], ex)

    # combine: y_d = recv_x * (d+1) in bf16, weights, two biases
    y = (rx.float() * (rank + 1)).to(torch.bfloat16)
    b0 = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    b1 = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    cx, cw, ev = buf.combine(y, handle, topk_weights=rw, bias=(b0.to(dev), b1.to(dev)))
    local = num_experts // world
    acc = b0.float() + b1.float()
    for d in range(world):
        sent = torch.tensor([any(d * local <= e < (d + 1) * local for e in row.tolist()) for row in idx])
        contrib = (x.float() * (d + 1)).to(torch.bfloat16).float()
        acc = acc + torch.where(sent[:, None], contrib, torch.zeros_like(contrib))
    # one bf16 rounding of an f32 sum: allow one bf16 ulp for a different summation order
    torch.testing.assert_close(cx.cpu().float(), acc.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(cw.cpu(), torch.where(idx >= 0, w, torch.zeros_like(w)), rtol=1e-6, atol=1e-6)
    cx1, cw1, _ = buf.combine(y, handle, bias=b0.to(dev))
    assert cw1 is None

    # from another thread, as autograd runs Megatron's backward combine
    import threading

    box = {}

    def other_thread():
        torch.cuda.set_device(dev)
        try:
            box["out"] = buf.combine(y, handle, topk_weights=rw, bias=(b0.to(dev), b1.to(dev)))[0]
            torch.cuda.current_stream().synchronize()
        except BaseException as e:  # reported below
            box["err"] = e

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert "err" not in box, box.get("err")
    check_equal("combine from another thread", box["out"], cx.cpu())

    # previous_event + async_finish + allocate_on_comm_stream, Megatron's fused_a2a sequence
    prev = EventOverlap(EventHandle())
    pr2, _, pe2, ir2, lev = buf.get_dispatch_layout(idxd, num_experts, previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
    assert lev.event is not None
    rxa, _, _, _, handle_a, eva = buf.dispatch(xd, num_tokens_per_rank=pr2, is_token_in_rank=ir2, num_tokens_per_expert=pe2,
                                               topk_idx=idxd, topk_weights=wd, previous_event=lev, async_finish=True,
                                               allocate_on_comm_stream=True)
    assert isinstance(eva, EventOverlap) and eva.event is not None
    eva.current_stream_wait()
    check_equal("async recv_x", rxa, ex)

    # two micro-batches: dispatch A, dispatch B, then use both
    ca, cb, xb, idxb = _micro_batch_b(buf, group, rank, world, num_experts, dev, (rxa, ex, handle_a), seed=2)
    for name, c, xx, ii in (("A", ca, x, idx), ("B", cb, xb, idxb)):
        sends = torch.stack([torch.tensor([any(d * local <= e < (d + 1) * local for e in row.tolist()) for row in ii]) for d in range(world)], 1)
        want = combined_copies(xx, sends)
        check_equal(f"micro-batch {name} combine", c, want)

    # owned outputs are written by the dispatch kernel into a region of the receive arena (after
    # the part get_local_buffer_tensor exposes), which they keep leased: they stay valid across
    # later dispatches; when the arena is full a dispatch falls back to copying out of the fixed
    # region; dropping the outputs returns their regions
    rt_ = buf._rt()
    cap, free0, live0 = rt_.arena_usage()
    exposed = buf.get_local_buffer_tensor(torch.uint8)
    arena_lo = exposed.data_ptr() + exposed.numel()
    del exposed
    # distinct data per dispatch (the same routes): two outputs sharing a region cannot both match
    held, trail = [], []
    # enough cached dispatches to fill every rank's arena, the same count on every rank (dispatch
    # is collective): the arena was sized for the buffer's hidden, these rows are HIDDEN wide
    region = -(-ex.shape[0] * HIDDEN * 2 // 512) * 512
    fills = gather(group, cap // region + 3 if region else 0)
    rounds = max(fills)
    for i in range(rounds):
        xi = (x.float() + (i + 1)).to(torch.bfloat16)
        want = torch.stack([(all_x[s][t].float() + (i + 1)).to(torch.bfloat16) for s, t in src]) if src else \
            torch.empty(0, HIDDEN, dtype=torch.bfloat16)
        out = buf.dispatch(xi.to(dev), handle=handle)[0]
        held.append((out, want, i))
        trail.append((i, out.data_ptr() - arena_lo, rt_.arena_usage()))
    # the arena is [end of the exposed part, + capacity); torch's own allocations (the copies of a
    # fallback) may lie at any address, above it too
    in_arena = [arena_lo <= t.data_ptr() < arena_lo + cap for t, _, _ in held]
    why = f"arena capacity {cap}, before: free {free0} live {live0}; (dispatch, offset in arena, (cap, free, live)): {trail}"
    for t, want, i in held:
        try:
            check_equal(f"held cached recv_x {i} after {len(held) - 1 - i} later dispatches", t, want)
        except AssertionError as e:
            raise AssertionError(f"{e}; {why}") from None
    if ex.shape[0] > 0:
        assert in_arena[0] and in_arena[1], f"the first owned outputs are not in the receive arena; {why}"
        assert not all(in_arena), f"the arena never filled in {rounds} dispatches of {ex.shape[0]} rows; {why}"
        _, free1, live1 = rt_.arena_usage()
        assert live1 == live0 + sum(in_arena) and free1 < free0, why
    del held, t, want, out
    _, free2, live2 = rt_.arena_usage()
    assert (free2, live2) == (free0, live0), f"regions not returned: {(free0, live0)} -> {(free2, live2)}"

    # the opt-in zero-copy mode (DEEPEP_KERNELS_DISPATCH_VIEWS=1, read at construction; switched
    # on this Buffer directly here): the same rows, as a view inside this rank's NVLink buffer
    buf._dispatch_views = True
    try:
        vx = buf.dispatch(xd, handle=handle)[0]
    finally:
        buf._dispatch_views = False
    check_equal("zero-copy view recv_x", vx, ex)
    base = buf.get_local_buffer_tensor(torch.uint8)
    assert base.data_ptr() <= vx.data_ptr() < base.data_ptr() + base.numel(), "the view is not inside the NVLink buffer"

    # the raw local buffer
    t = buf.get_local_buffer_tensor(torch.int32)
    assert t.dtype == torch.int32 and t.numel() * 4 <= nvl_bytes and t.is_cuda
    t2 = buf.get_local_buffer_tensor(torch.bfloat16, size=(4, 8), offset=256)
    assert t2.shape == (4, 8) and t2.data_ptr() == t.data_ptr() + 256
    torch.cuda.synchronize()
    buf.destroy()


def ll_expected(all_x, all_idx, rank, world, num_experts):
    """Per local expert: the multiset of rows it receives (each selection separately)."""
    local = num_experts // world
    out = []
    for le in range(local):
        e = rank * local + le
        rows = [all_x[s][t] for s in range(world) for t in range(all_idx[s].shape[0]) for k in all_idx[s][t].tolist() if k == e]
        out.append(rows)
    return out


def row_keys(rows):
    return sorted(tuple(r.view(torch.int16).tolist()) for r in rows)


def low_latency(rank, world, group):
    """BF16 and FP8 dispatch, combine, hooks, cumulative stats, zero-copy combine, and a
    captured CUDA graph of dispatch + combine replayed with new inputs."""
    num_experts = LOCAL_EXPERTS * world
    num_max = 32
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max, HIDDEN, world, num_experts)
    buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // world, explicitly_destroy=True)
    buf.clean_low_latency_buffer(num_max, HIDDEN, num_experts)
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 20 + rank
    x, idx, w = make_routing(rank, world, n, num_experts, seed=3)
    all_x, all_idx = zip(*gather(group, (x, idx)))
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    want = ll_expected(all_x, all_idx, rank, world, num_experts)
    stats = torch.zeros(num_experts // world, dtype=torch.int32, device=dev)

    def check_bf16(rx, cnt, what):
        assert rx.shape == (num_experts // world, world * num_max, HIDDEN) and rx.dtype == torch.bfloat16
        got_counts = cnt.cpu().tolist()
        assert got_counts == [len(r) for r in want], (what, got_counts)
        for le, rows in enumerate(want):
            assert row_keys(rx[le, : len(rows)].cpu()) == row_keys(rows), f"{what}: rows of local expert {le}"

    def expected_combine(y_factor=1.0):
        acc = torch.zeros(n, HIDDEN)
        for k in range(TOPK):
            sel = idx[:, k] >= 0
            acc += torch.where(sel[:, None], w[:, k : k + 1] * (x.float() * y_factor).to(torch.bfloat16).float(), torch.zeros(n, HIDDEN))
        return acc.to(torch.bfloat16)

    # plain BF16 dispatch + combine, with stats
    rx, cnt, h, ev, hook = buf.low_latency_dispatch(xd, idxd, num_max, num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=False)
    assert hook is None and ev.event is None
    check_bf16(rx, cnt, "bf16 dispatch")
    assert stats.cpu().tolist() == [len(r) for r in want]
    out, ev, hook = buf.low_latency_combine(rx, idxd, wd, h)
    torch.testing.assert_close(out.cpu().float(), expected_combine().float(), rtol=1e-2, atol=1e-2)
    # shapes other than the dispatch's are refused before any launch (the kernel reads and writes
    # by the handle's sizes): x, topk_idx, topk_weights and out, each named
    import pytest

    wrong_shapes = dict(x=torch.zeros(num_experts // world, world * num_max // 2, HIDDEN, dtype=torch.bfloat16, device=dev),
                        topk_idx=idxd[:-1].contiguous(), topk_weights=wd[:, :-1].contiguous(),
                        out=torch.empty(n, HIDDEN // 2, dtype=torch.bfloat16, device=dev))
    for name, wrong in wrong_shapes.items():
        with pytest.raises(ValueError, match=f"^low_latency_combine: {name} is "):
            buf.low_latency_combine(**{**dict(x=rx, topk_idx=idxd, topk_weights=wd, handle=h), name: wrong})
    out_again, _, _ = buf.low_latency_combine(rx, idxd, wd, h)  # the buffer is still usable
    torch.testing.assert_close(out_again.cpu().float(), expected_combine().float(), rtol=1e-2, atol=1e-2)

    # FP8 dispatch: dequantized rows match x within e4m3 precision
    for round_scale, ue8m0 in ((False, False), (True, False), (True, True)):
        (q, s), cnt, h8, _, _ = buf.low_latency_dispatch(xd, idxd, num_max, num_experts, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0)
        assert q.dtype == torch.float8_e4m3fn
        if ue8m0:
            assert s.dtype == torch.int32 and s.shape == (num_experts // world, world * num_max, HIDDEN // 512)
            continue
        assert s.shape == (num_experts // world, world * num_max, HIDDEN // 128) and s.stride(1) == 1, "scales are a column-major view"
        for le, rows in enumerate(want):
            c = len(rows)
            deq = (q[le, :c].float().view(c, HIDDEN // 128, 128) * s[le, :c].float()[:, :, None]).view(c, HIDDEN).cpu()
            if c:
                # slot order is nondeterministic: match each received row to its nearest source row
                exp = torch.stack(rows).float()
                nearest = torch.cdist(deq, exp).argmin(dim=1)
                assert sorted(nearest.tolist()) == list(range(c)), f"fp8 rows of local expert {le} are not a permutation of the sent rows"
                torch.testing.assert_close(deq, exp[nearest], rtol=0.07, atol=0.07)
            if round_scale:
                sv = s[le, :c].float().cpu()
                assert bool((torch.log2(sv) == torch.log2(sv).round()).all()), "round_scale gives powers of two"

    # hooks: send now, receive on call
    rx, cnt, h, _, hook = buf.low_latency_dispatch(xd, idxd, num_max, num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=False,
                                                   return_recv_hook=True)
    assert callable(hook)
    hook()
    check_bf16(rx, cnt, "hooked dispatch")
    assert stats.cpu().tolist() == [2 * len(r) for r in want]
    out, _, chook = buf.low_latency_combine(rx, idxd, wd, h, return_recv_hook=True)
    chook()
    torch.testing.assert_close(out.cpu().float(), expected_combine().float(), rtol=1e-2, atol=1e-2)

    # zero-copy combine through get_next_low_latency_combine_buffer, into a given out
    rx, cnt, h, _, _ = buf.low_latency_dispatch(xd, idxd, num_max, num_experts, use_fp8=False)
    zbuf = buf.get_next_low_latency_combine_buffer(h)
    zbuf.copy_(rx)
    given = torch.empty(n, HIDDEN, dtype=torch.bfloat16, device=dev)
    out, _, _ = buf.low_latency_combine(zbuf, idxd, wd, h, zero_copy=True, out=given)
    assert out.data_ptr() == given.data_ptr()
    torch.testing.assert_close(out.cpu().float(), expected_combine().float(), rtol=1e-2, atol=1e-2)

    # CUDA graph: capture dispatch (with a hook) + combine on static tensors, replay with new x
    sx = xd.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        r0, _, h0, _, _ = buf.low_latency_dispatch(sx, idxd, num_max, num_experts, use_fp8=False)
        buf.low_latency_combine(r0, idxd, wd, h0)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gather(group, "captured")  # every rank finished the warm-up before anyone captures
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grx, gcnt, gh, _, ghook = buf.low_latency_dispatch(sx, idxd, num_max, num_experts, use_fp8=False, return_recv_hook=True)
        ghook()
        gout, _, _ = buf.low_latency_combine(grx, idxd, wd, gh)
    for factor in (3.0, -0.5):
        sx.copy_((x.float() * factor).to(torch.bfloat16).to(dev))
        torch.cuda.synchronize()
        gather(group, factor)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(gout.cpu().float(), expected_combine(factor).float(), rtol=1e-2, atol=2e-2)
    gather(group, "replayed")
    del graph
    torch.cuda.synchronize()
    # a receive hook whose buffer is destroyed before it is called refuses instead of launching
    # into the freed memory; so does indexing a handle whose routing lived in that memory (the
    # handle does not keep the buffer: its collective free is not delayed)
    _, _, kept, _, _ = buf.low_latency_dispatch(xd, idxd, num_max, num_experts, use_fp8=False)
    _, _, _, _, pending = buf.low_latency_dispatch(xd, idxd, num_max, num_experts, use_fp8=False, return_recv_hook=True)
    buf.destroy()
    with pytest.raises(ValueError, match="this receive hook's low-latency buffer was destroyed or re-created"):
        pending()
    with pytest.raises(ValueError, match="this low-latency handle's buffer was destroyed or re-created"):
        kept[0]
    assert kept[2] == num_max  # the scalars stay


def deepep_semantics(rank, world, group):
    """What DeepEP's own test files taught us (python/scripts/deepep-conformance.sh): handles are
    indexable with DeepEP's element order, dispatch works without top-k, an intranode handle
    outlives later dispatches and the caller's layout tensors, the low-latency handle's src_info /
    layout_range describe the packed rows, and a zero-copy combine reads the handed-out buffer.
    Also: low-latency calls on different streams stay ordered, including a combine on a stream
    that never waited for its dispatch's stream."""
    import gc

    import pytest

    num_experts = LOCAL_EXPERTS * world
    local = LOCAL_EXPERTS
    dev = torch.device("cuda", torch.cuda.current_device())
    nvl_bytes = _native.intranode_buffer_bytes(world, 512, 7168)
    buf = Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
    n = 64 + 7 * rank
    x, idx, w = make_routing(rank, world, n, num_experts, seed=11)
    all_x, all_idx, all_w = zip(*gather(group, (x, idx, w)))
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxd, num_experts)
    rx, ri, rw, counts, h, _ = buf.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd)
    ex, _, _, _, ecounts, src = expected_recv(all_x, all_idx, all_w, rank, world, num_experts)

    # handle[0]: DeepEP's rank_prefix_matrix, [i][j] = rows rank j receives from ranks 0..i
    sent = torch.zeros(world, world, dtype=torch.int32)
    for s_ in range(world):
        for row in all_idx[s_]:
            for d in {e // local for e in row.tolist() if e >= 0}:
                sent[s_, d] += 1
    assert len(h) == 6
    prefix = h[0]
    assert prefix.is_cuda and prefix.dtype == torch.int32 and tuple(prefix.shape) == (world, world)
    check_equal("handle[0] rank_prefix_matrix", prefix, sent.cumsum(0).to(torch.int32))
    assert h[-6] is prefix
    # rows from source i sit at [prefix[i-1][rank], prefix[i][rank]) (what test_intranode checks)
    start = 0
    for i in range(world):
        end = int(prefix[i][rank])
        assert [s_ for s_, _ in src[start:end]] == [i] * (end - start), f"rows of source {i}"
        start = end
    check_equal("handle[3] recv_src_idx", h[3], torch.tensor([t for _, t in src], dtype=torch.int32))
    assert h[4] is in_rank
    for i in (1, 2, 5):
        with pytest.raises(NotImplementedError, match="no DeepEP channels"):
            h[i]
    with pytest.raises(IndexError):
        h[6]

    # dispatch without top-k: same rows, no top-k outputs, counts from num_tokens_per_expert
    nx, ni, nw, ncounts, nh, _ = buf.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert)
    assert ni is None and nw is None
    assert ncounts == ecounts, (ncounts, ecounts)
    check_equal("recv_x without top-k", nx, ex)
    check_equal("handle[0] without top-k", nh[0], prefix.cpu())
    nc, ncw, _ = buf.combine(nx, nh)
    assert ncw is None
    sends = torch.stack([torch.tensor([any(d * local <= e < (d + 1) * local for e in row.tolist()) for row in idx])
                         for d in range(world)], 1)
    check_equal("combine without top-k", nc, combined_copies(x, sends))
    with pytest.raises(ValueError, match="together"):
        buf.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idxd)

    # an older handle after other dispatches, with the caller's layout tensors dropped: combine
    # and cached dispatch still use its own routing (DeepEP's handle owns its tensors)
    x3, idx3, w3 = make_routing(rank, world, n + 5, num_experts, seed=12)
    pr3, _, pe3, ir3, _ = buf.get_dispatch_layout(idx3.to(dev), num_experts)
    buf.dispatch(x3.to(dev), num_tokens_per_rank=pr3, is_token_in_rank=ir3, num_tokens_per_expert=pe3,
                 topk_idx=idx3.to(dev), topk_weights=w3.to(dev))
    del per_rank, per_expert, in_rank, pr3, pe3, ir3
    gc.collect()
    torch.cuda.empty_cache()
    junk = torch.ones(n * world * 4, dtype=torch.bool, device=dev)  # reuses freed memory
    c_old, _, _ = buf.combine(rx, h, topk_weights=rw)
    check_equal("combine with an older handle", c_old, _combine_copies_weighted(x, idx, w, world))
    rx_old, *_ = buf.dispatch(xd, handle=h)
    check_equal("cached dispatch with an older handle", rx_old, ex)
    del junk
    buf.destroy()

    # low latency: handle = (src_info, layout_range, num_max, hidden, num_experts)
    num_max = 32
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max, HIDDEN, world, num_experts)
    ll = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=local, explicitly_destroy=True)
    m = 20 + rank
    lx, lidx, lw = make_routing(rank, world, m, num_experts, seed=13)
    # the last 128 channels carry the token index, as in DeepEP's test
    lx[:, -128:] = torch.arange(m).to(torch.bfloat16)[:, None]
    all_lx, all_lidx = zip(*gather(group, (lx, lidx)))
    lxd, lidxd, lwd = lx.to(dev), lidx.to(dev), lw.to(dev)
    rxl, cnt, lh, _, _ = ll.low_latency_dispatch(lxd, lidxd, num_max, num_experts, use_fp8=False)
    assert len(lh) == 5 and (lh[2], lh[3], lh[4]) == (num_max, HIDDEN, num_experts)
    src_info, layout_range = lh[0], lh[1]
    assert src_info.dtype == torch.int32 and tuple(src_info.shape) == (local, world * num_max)
    assert layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (local, world)
    mask = (1 << 32) - 1

    def check_ll_routing(src_info, layout_range, cnt, rxl, all_lx, all_lidx):
        for le in range(local):
            e = rank * local + le
            c = int(cnt[le])
            lr = layout_range[le].cpu()
            assert int((lr & mask).sum()) == c
            for j in range(world):
                begin, count = int(lr[j] >> 32), int(lr[j] & mask)
                assert count == int((all_lidx[j] == e).sum()), f"layout_range count of source {j} for expert {le}"
                rows = rxl[le, begin:begin + count].cpu()
                toks = src_info[le, begin:begin + count].cpu()
                for r_, t in zip(rows, toks.tolist()):
                    assert bool((r_ == all_lx[j][t]).all()), f"src_info of a row from source {j} names token {t}"

    check_ll_routing(src_info, layout_range, cnt, rxl, all_lx, all_lidx)
    # the copies made at indexing survive later dispatches
    keep = src_info.clone()
    # DeepEP's handle is self-contained (its bench times many dispatches, then many combines with
    # one handle): dispatches with other routings, then combines with the older handles, which
    # must equal the combines made right after their dispatches, bit for bit, and an older handle
    # never indexed before must still give its routing
    runs = []
    for j in range(4):
        xj, ij, wj = make_routing(rank, world, m - j, num_experts, seed=30 + j)
        xj[:, -128:] = torch.arange(m - j).to(torch.bfloat16)[:, None]
        if j == 0:
            all_x0, all_i0 = zip(*gather(group, (xj, ij)))
        xj, ij, wj = xj.to(dev), ij.to(dev), wj.to(dev)
        rj, cj, hj, _, _ = ll.low_latency_dispatch(xj, ij, num_max, num_experts, use_fp8=False)
        yj = rj.clone()  # the packed rows are not kept past two later dispatches (DeepEP's limit too)
        ref = ll.low_latency_combine(yj, ij, wj, hj)[0].clone()
        runs.append((yj, ij, wj, hj, ref, cj.clone()))
    assert lh[0] is src_info and torch.equal(lh[0], keep)
    for j, (yj, ij, wj, hj, ref, _) in enumerate(runs):
        again = ll.low_latency_combine(yj, ij, wj, hj)[0]
        check_equal(f"combine with the handle of dispatch {j} of 4", again, ref.cpu())
    y0, _, _, h0, _, c0 = runs[0]
    check_ll_routing(h0[0], h0[1], c0, y0, all_x0, all_i0)
    # calls on different streams stay ordered (calls without async_finish launch on the caller's
    # stream): dispatch on a side stream, combine on the default stream (raw handle 0), against the
    # same pair made on the default stream alone, bit for bit
    rd, _, hd, _, _ = ll.low_latency_dispatch(lxd, lidxd, num_max, num_experts, use_fp8=False)
    yd = rd.clone()
    want_d = ll.low_latency_combine(yd, lidxd, lwd, hd)[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rs, _, hs, _, _ = ll.low_latency_dispatch(lxd, lidxd, num_max, num_experts, use_fp8=False)
        ys = rs.clone()
    torch.cuda.current_stream().wait_stream(side)  # the caller orders its own use of ys
    check_equal("combine on the default stream of a dispatch on a side stream", ll.low_latency_combine(ys, lidxd, lwd, hs)[0],
                want_d.cpu())
    # the stream of the previous call may be gone by the next call (an ExternalStream its owner
    # destroyed): the next call orders itself through an event, never through the old handle
    try:
        import cupy
    except ImportError:
        cupy = None
        print(f"[rank {rank}] cupy not importable: the destroyed-stream case is skipped", flush=True)
    if cupy is not None:
        with cupy.cuda.Device(torch.cuda.current_device()):
            cs = cupy.cuda.Stream(non_blocking=True)
        ext = torch.cuda.ExternalStream(cs.ptr)
        ext.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ext):
            re_, _, he, _, _ = ll.low_latency_dispatch(lxd, lidxd, num_max, num_experts, use_fp8=False)
            ye = re_.clone()
        ext.synchronize()
        del ext
        del cs  # cupy destroys the stream here
        check_equal("combine after the previous call's stream was destroyed", ll.low_latency_combine(ye, lidxd, lwd, he)[0],
                    want_d.cpu())
    # no ordering by the caller at all: a dispatch on the default stream queued behind a long
    # sleep, then its combine on a side stream that never waited for the default stream. The
    # combine must wait for the dispatch through the buffer's ordering event (on the default
    # stream it is recorded only when a call on another stream comes): without it the combine
    # would read the dispatch's rows before they exist, or wait for peers that cannot start.
    torch.cuda.synchronize()
    gather(group, "unordered")
    later = torch.cuda.Stream()
    torch.cuda._sleep(50_000_000)  # tens of ms of GPU time on the default stream
    rl, _, hl, _, _ = ll.low_latency_dispatch(lxd, lidxd, num_max, num_experts, use_fp8=False)
    with torch.cuda.stream(later):
        out_l = ll.low_latency_combine(rl, lidxd, lwd, hl)[0]
    later.synchronize()
    check_equal("combine on a stream that never waited for its dispatch's stream", out_l, want_d.cpu())
    torch.cuda.synchronize()
    # zero-copy: the combine reads the handed-out buffer, not x's data (DeepEP's semantics)
    rz, _, hz, _, _ = ll.low_latency_dispatch(lxd, lidxd, num_max, num_experts, use_fp8=False)
    zb = ll.get_next_low_latency_combine_buffer(hz)
    zb.copy_(rz)
    out_z, _, _ = ll.low_latency_combine(torch.zeros_like(rz), lidxd, lwd, hz, zero_copy=True)
    out_ref, _, _ = ll.low_latency_combine(rz, lidxd, lwd, hz)
    check_equal("zero-copy combine reads the combine buffer", out_z, out_ref.cpu())
    ll.destroy()


def _combine_copies_weighted(x, idx, w, world):
    """Intranode combine of unchanged copies (y = recv_x): x times the ranks the token went to."""
    local = LOCAL_EXPERTS
    sends = torch.stack([torch.tensor([any(d * local <= e < (d + 1) * local for e in row.tolist()) for row in idx])
                         for d in range(world)], 1)
    return combined_copies(x, sends)


def peer_stops_calling(rank, world, group):
    """A rank that stops calling: the other rank's kernel gives up its bounded wait, records
    {rank, call, phase, peer} and returns (no trap). Rank 0's next Buffer call, within the device
    bound + 1 s of the call that waited, raises PeerTimeoutError naming the call, the phase and the
    rank it waited for; every later call raises it again; the CUDA context still works."""
    import os
    import time

    import torch.distributed as dist
    from deepep_kernels import PeerTimeoutError

    timeout_s = 2.0
    os.environ["DEEPEP_GPU_TIMEOUT_MS"] = str(int(timeout_s * 1000))  # read when the Buffer creates its runtime
    os.environ.pop("DEEPEP_KERNELS_TRAP_ON_ERROR", None)
    num_experts = LOCAL_EXPERTS * world
    buf = Buffer(group, _native.intranode_buffer_bytes(world, 512, HIDDEN), 0, explicitly_destroy=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = make_routing(rank, world, 64, num_experts, seed=5)
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxd, num_experts)
    rx, _, _, _, handle, _ = buf.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                          num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd)
    torch.cuda.synchronize()
    check_device_error()  # nothing recorded so far
    if rank == 0:
        # a cached dispatch has no host synchronisation: the call returns, the kernel waits for
        # rank 1, which never comes, and gives up after timeout_s
        t0 = time.monotonic()
        buf.dispatch(xd, handle=handle)
        torch.cuda.synchronize()  # completes: the kernel recorded the timeout and returned
        try:
            buf.get_dispatch_layout(idxd, num_experts)
            raise AssertionError("a Buffer call after the recorded timeout did not raise")
        except PeerTimeoutError as e:
            msg = str(e)
        elapsed = time.monotonic() - t0
        assert msg.startswith("rank 0: dispatch waited ") and "for rank 1 (phase dispatch/" in msg, msg
        assert "rank 1 probably died" in msg and "destroy()" in msg, msg
        assert elapsed < timeout_s + 1.0, f"the timeout came after {elapsed:.1f} s (bound {timeout_s} s + 1 s)"
        # reported again by every later call, not only once
        for _ in range(2):
            try:
                buf.dispatch(xd, handle=handle)
                raise AssertionError("a second call after the timeout did not raise")
            except PeerTimeoutError as e:
                assert str(e) == msg, (str(e), msg)
        # the CUDA context survived: torch still computes on this GPU
        y = torch.arange(1000, device=dev, dtype=torch.float32)
        assert float((y * 2).sum().item()) == 999000.0
        print(f"rank 0: after {elapsed:.2f} s the next call said: {msg}", flush=True)
    dist.barrier(group)
    # rank 0's Buffer cannot run collectives any more and rank 1's peer is gone: leave without
    # the destructors' collective teardown (destroying a Buffer after a timeout is not covered here)
    os._exit(0)


def internode_ranks_per_host(world):
    """Emulated hosts for the internode test on one machine: 2 ranks -> hosts of 1, 4 -> 2,
    8 -> 4 (both hops with several GPUs per host), as the Rust harness's cases do."""
    return 1 if world <= 2 else min(world // 2, 4)


def internode(rank, world, group, ranks_per_host=None):
    """Internode (two-hop) mode through DEEPEP_KERNELS_RANKS_PER_HOST: layout with per-host
    counts, fresh BF16 dispatch with expert alignment, cached dispatch, FP8 (row- and column-major
    scales, fresh and cached), combine with weights and two biases, previous_event/async_finish/
    allocate_on_comm_stream, and two micro-batches alive at once. Rows arrive ordered by source
    rank, then source token (docs/internode.md; the Rust harness compares bit-exact against the
    same order), so they are compared exactly, like the intranode ones."""
    import os

    k_host = ranks_per_host or internode_ranks_per_host(world)
    # read by the Buffer (host grouping) and by the size hint (token capacity)
    os.environ["DEEPEP_KERNELS_RANKS_PER_HOST"] = str(k_host)
    os.environ["DEEPEP_KERNELS_MAX_TOKENS"] = "256"
    num_hosts = world // k_host
    num_experts = LOCAL_EXPERTS * world
    local = LOCAL_EXPERTS
    cfg = Buffer.get_dispatch_config(world)
    rdma_bytes = cfg.get_rdma_buffer_size_hint(HIDDEN * 2, world)
    assert rdma_bytes > 0, "more than one (emulated) host needs an RDMA buffer"
    buf = Buffer(group, 0, rdma_bytes, explicitly_destroy=True)
    assert buf._internode and buf._num_hosts == num_hosts and buf._ranks_per_host == k_host
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 96 + 13 * rank
    x, idx, w = make_routing(rank, world, n, num_experts, seed=11)
    all_x, all_idx, all_w = zip(*gather(group, (x, idx, w)))
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)

    # layout, with tokens per host (num_tokens_per_rdma_rank)
    per_rank, per_host, per_expert, in_rank, ev = buf.get_dispatch_layout(idxd, num_experts)
    assert ev.event is None
    want_rank, want_expert, want_in = expected_layout(idx, world, num_experts)
    want_host = want_in.view(n, num_hosts, k_host).any(2).sum(0).to(torch.int32)
    check_equal("num_tokens_per_rank", per_rank, want_rank)
    check_equal("num_tokens_per_rdma_rank", per_host, want_host)
    check_equal("num_tokens_per_expert", per_expert, want_expert)
    check_equal("is_token_in_rank", in_rank, want_in)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)

    # fresh BF16 dispatch with alignment 4
    got = buf.dispatch(xd, topk_idx=idxd, topk_weights=wd, expert_alignment=4, previous_event=ev, **layout)
    rx, _, rw, _, handle, _ = got
    ex, ei, src = _check_dispatch_aligned_to_4(got, all_x, all_idx, all_w, rank, world, num_experts)
    assert handle.num_recv_tokens == ex.shape[0]
    # handle[-4]: DeepEP's recv_gbl_rank_prefix_sum, rows grouped by source rank (what
    # test_internode.py's check_data reads; its padding bug showed at 16 ranks in hosts of 8)
    per_source = torch.tensor([sum(1 for s_, _ in src if s_ == i) for i in range(world)], dtype=torch.int32)
    check_equal("handle[-4] recv_gbl_rank_prefix_sum", handle[-4], per_source.cumsum(0).to(torch.int32))
    # dispatch without top-k: the same rows (every rank a token goes to, in source order)
    nx, ni, nw, ncounts, nh, _ = buf.dispatch(xd, **layout)
    ecounts1 = expected_recv(all_x, all_idx, all_w, rank, world, num_experts)[4]
    assert ni is None and nw is None and ncounts == ecounts1, (ncounts, ecounts1)
    check_equal("recv_x without top-k", nx, ex)
    check_equal("handle[-4] without top-k", nh[-4], per_source.cumsum(0).to(torch.int32))

    _check_cached_dispatch(buf, group, x, handle, src, dev)

    # FP8 with row-major and column-major scales, fresh and cached
    xq, sc, exq, esc, g = _fp8_routing(group, rank, world, n, num_experts, all_idx, all_w, seed=177 + rank)
    for colmajor, scd in _scale_layouts(sc, dev):
        (rq, rs), qi, _, qcounts, qhandle, _ = buf.dispatch((xq.to(dev), scd), topk_idx=idxd, topk_weights=wd, **layout)
        check_equal(f"fp8 recv_x (colmajor={colmajor})", rq, exq)
        check_equal(f"fp8 recv_scales (colmajor={colmajor})", rs, esc)
        check_equal(f"fp8 recv_topk_idx (colmajor={colmajor})", qi, ei)
        (cq, cs), _, _, _, _, _ = buf.dispatch((xq.to(dev), scd), handle=qhandle)
        check_equal(f"fp8 cached recv_x (colmajor={colmajor})", cq, exq)
        check_equal(f"fp8 cached recv_scales (colmajor={colmajor})", cs, esc)

    # num_worst_tokens is refused by name (DeepEP's internode dispatch refuses it too)
    try:
        buf.dispatch(xd, topk_idx=idxd, topk_weights=wd, num_worst_tokens=4 * n, **layout)
        raise AssertionError("num_worst_tokens was accepted in the internode mode")
    except NotImplementedError as e:
        assert "num_worst_tokens" in str(e), e

    # combine: y_d = recv_x * (d+1) in bf16, weights, two biases. The kernels sum each host's rows
    # in f32 and round to bf16, then add the host partials and biases in f32 and round: the error
    # is at most one bf16 rounding of each partial plus one of the sum (bound below).
    def combine_bound(contribs, biases):
        want = sum(bb.float() for bb in biases) + sum(contribs)
        mag = sum(bb.float().abs() for bb in biases) + sum(cc.abs() for cc in contribs)
        # bf16's unit roundoff is 2^-8: one rounding per host partial plus the final one stays
        # below 2^-7 * mag; 2^-6 leaves room for the f32 sums (a lost row is ~mag/world)
        return want, mag * 2 ** -6 + 1e-6

    y = (rx.float() * (rank + 1)).to(torch.bfloat16)
    b0 = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    b1 = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    cx, cw, ev = buf.combine(y, handle, topk_weights=rw, bias=(b0.to(dev), b1.to(dev)))
    assert ev.event is None
    contribs = []
    for dst in range(world):
        sent = torch.tensor([any(dst * local <= e < (dst + 1) * local for e in row.tolist()) for row in idx])
        contrib = (x.float() * (dst + 1)).to(torch.bfloat16).float()
        contribs.append(torch.where(sent[:, None], contrib, torch.zeros_like(contrib)))
    want, tol = combine_bound(contribs, (b0, b1))
    err = (cx.cpu().float() - want).abs()
    assert bool((err <= tol).all()), f"combine: max error {err.max().item():.4g} beyond the rounding bound (worst excess {(err - tol).max().item():.4g})"
    assert cx.dtype == torch.bfloat16 and tuple(cx.shape) == (n, HIDDEN)
    torch.testing.assert_close(cw.cpu(), torch.where(idx >= 0, w, torch.zeros_like(w)), rtol=1e-6, atol=1e-6)
    cx1, cw1, _ = buf.combine(y, handle, bias=b0.to(dev))
    assert cw1 is None
    want1, tol1 = combine_bound(contribs, (b0,))
    err1 = (cx1.cpu().float() - want1).abs()
    assert bool((err1 <= tol1).all()), f"combine with one bias: max error {err1.max().item():.4g}"

    # previous_event + async_finish + allocate_on_comm_stream, Megatron's fused_a2a sequence
    prev = EventOverlap(EventHandle())
    pr2, ph2, pe2, ir2, lev = buf.get_dispatch_layout(idxd, num_experts, previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
    assert lev.event is not None
    rxa, _, _, _, handle_a, eva = buf.dispatch(xd, num_tokens_per_rank=pr2, num_tokens_per_rdma_rank=ph2, is_token_in_rank=ir2,
                                               num_tokens_per_expert=pe2, topk_idx=idxd, topk_weights=wd, previous_event=lev,
                                               async_finish=True, allocate_on_comm_stream=True)
    assert isinstance(eva, EventOverlap) and eva.event is not None
    eva.current_stream_wait()
    check_equal("async num_tokens_per_rdma_rank", ph2, want_host)
    check_equal("async recv_x", rxa, ex)
    ca_ev = buf.combine(rxa, handle_a, previous_event=eva, async_finish=True)
    ca_ev[2].current_stream_wait()

    # two micro-batches: dispatch A (above), dispatch B, then use both
    ca, cb, xb, idxb = _micro_batch_b(buf, group, rank, world, num_experts, dev, (rxa, ex, handle_a), seed=12, rdma_layout=True)
    for name, cc, xx, ii in (("A", ca, x, idx), ("B", cb, xb, idxb)):
        parts = []
        for dst in range(world):
            sent = torch.tensor([any(dst * local <= e < (dst + 1) * local for e in row.tolist()) for row in ii])
            parts.append(torch.where(sent[:, None], xx.float(), torch.zeros(xx.shape)))
        want, tol = combine_bound(parts, ())
        err = (cc.cpu().float() - want).abs()
        assert bool((err <= tol).all()), f"micro-batch {name} combine: max error {err.max().item():.4g}"
    check_equal("async combine (micro-batch A)", ca_ev[0], ca.cpu())

    # expert outputs whose row count differs from the handle's dispatch are refused, naming it
    try:
        buf.combine(rx[:1], handle)
        raise AssertionError("a combine with the wrong row count was accepted")
    except ValueError as e:
        assert "order and width of recv_x" in str(e), e
    torch.cuda.synchronize()
    gather(group, "internode done")
    buf.destroy()


def internode_hosts_of_one(rank, world, group):
    """The internode mode with every rank its own host (every token takes the NVSHMEM path)."""
    internode(rank, world, group, ranks_per_host=1)


def tensors_outlive_their_buffer(rank, world, group):
    """Tensors that async_finish tied to a Buffer's comm stream (record_stream) and outputs
    allocated on it, freed after that Buffer was destroyed (explicitly_destroy=True) or collected
    (DeepEP's default options): torch then records an event on the comm stream, which must still
    exist (at 7a7d2c3 it did not, and the process aborted with 'invalid device context'). The next
    Buffer of the device takes the idle stream over, and a round on it is checked."""
    import gc

    num_experts = LOCAL_EXPERTS * world
    nvl_bytes = _native.intranode_buffer_bytes(world, 512, 7168)
    n = 64 + 7 * rank
    x, idx, w = make_routing(rank, world, n, num_experts, seed=5)
    all_x, all_idx, all_w = zip(*gather(group, (x, idx, w)))
    want_x, _, _, _, _, _ = expected_recv(all_x, all_idx, all_w, rank, world, num_experts)
    dev = torch.device("cuda", torch.cuda.current_device())
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)

    def async_round(buf):
        """Layout and dispatch with previous_event + async_finish + allocate_on_comm_stream, then
        an async combine: every output tied to the comm stream. Returns the outputs, unread."""
        lay = buf.get_dispatch_layout(idxd, num_experts, previous_event=EventOverlap(EventHandle()), async_finish=True,
                                      allocate_on_comm_stream=True)
        per_rank, _, per_expert, in_rank, lev = lay
        rx, ri, rw, counts, handle, ev = buf.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd,
                                                      previous_event=lev, async_finish=True, allocate_on_comm_stream=True)
        cx, cw, cev = buf.combine(rx, handle, topk_weights=rw, previous_event=ev, async_finish=True, allocate_on_comm_stream=True)
        cev.current_stream_wait()
        return [per_rank, per_expert, in_rank, rx, ri, rw, cx, cw]

    streams = []
    for explicit in (True, False):
        buf = Buffer(group, nvl_bytes, 0, explicitly_destroy=explicit)
        streams.append(buf.get_comm_stream().cuda_stream)
        kept = async_round(buf)
        check_equal(f"recv_x (explicitly_destroy={explicit})", kept[3], want_x)
        torch.cuda.synchronize()
        group.barrier()  # every rank done with the buffer before any destroys it
        if explicit:
            buf.destroy()
        del buf
        gc.collect()  # the default Buffer is collected here
        del kept  # the tensors recorded on the old comm stream are freed after their Buffer
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    # the second Buffer took the first one's idle stream over (the default keeps it)
    assert streams[0] == streams[1], f"comm streams {streams}: a dropped Buffer's idle stream should be reused"

    buf = Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
    assert buf.get_comm_stream().cuda_stream == streams[0]
    out = async_round(buf)
    check_equal("recv_x on the Buffer after", out[3], want_x)
    check_equal("combine on the Buffer after", out[6], _combine_copies_weighted(x, idx, w, world))
    torch.cuda.synchronize()
    group.barrier()
    buf.destroy()
    del out
    torch.cuda.synchronize()
