"""Per-rank bodies of the V2 caller tests (test_v2_callers.py): the call sequences that SGLang,
vLLM and Megatron-LM make on DeepEP 2.1's ``ElasticBuffer``, with their argument values, made
through the ``deep_ep`` shim (``deepep_kernels.shim.install()``, then ``deep_ep.ElasticBuffer``)
as the callers import it. Each body names the caller's file and commit it follows:

- SGLang: sgl-project/sglang python/sglang/srt/layers/moe/token_dispatcher/deepep_v2.py at
  0134da0b (``DeepEPv2Buffer.get_buffer``, ``_DeepEPv2Impl.dispatch/combine``) and SGLang's
  DeepEP V2 dispatch test ("DeepEP dispatch/combine parity across prefill, decode, and CUDA
  graphs": an idle rank, decode captured after a warm-up on the capture stream);
- vLLM: vllm-project/vllm vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_v2.py at
  02bd2a49 (``DeepEPV2PrepareAndFinalize``) and ``DeepEPV2All2AllManager`` in
  vllm/distributed/device_communicators/all2all.py (the buffer's arguments);
- Megatron-LM: NVIDIA/Megatron-LM branch dev at d48bd6be0a, megatron/core/transformer/moe/
  fused_a2a.py (``get_elastic_buffer``, ``DeepepV2Dispatch``, ``DeepepV2Combine``) and
  ``_DeepepV2Manager`` in megatron/core/transformer/moe/token_dispatcher.py.

They are checked against references that never use our kernels:

- dispatch: every rank's inputs are gathered through the gloo group and the rows this rank must
  receive are computed here on the CPU (DeepEP's ``refs.dispatch`` would need
  ``all_to_all_single`` on CUDA tensors, which gloo cannot do); compared bit for bit after
  sorting by ``recv_src_metadata[:, 0]``, as DeepEP 2.1's ``tests/elastic/test_ep.py`` does;
- combine: ``deepep_kernels.utils.refs.combine`` (V2's reduction order) on expert outputs that
  the source rank computes itself from its own tokens with the same elementwise torch ops the
  receiving rank applies to what it received, so the two sides agree bit for bit.

The "experts" are what the callers run between dispatch and combine, reduced to one elementwise
step: each (token, expert) row is the token times ``(expert + 1) / num_experts * weight``, so the
router weight is applied before the combine, as SGLang's DeepGEMM runner and vLLM's
``TopKWeightAndReduceContiguous`` do, and the combine passes weights through.
"""

import gc

import torch

from harness import gather

# Experts per rank and top-k of the tests (DeepSeek-V3-like top-8; 16 local experts give 32 to
# 128 experts at 2 to 8 ranks)
LOCAL_EXPERTS = 16
TOPK = 8
FP8_BLOCK = 128
FP8_MAX = 448.0


# ---------------------------------------------------------------------------------------------
# Helpers that need no GPU (CPU tensors in, CPU tensors out)
# ---------------------------------------------------------------------------------------------

def pow2_bucket(n):
    """vLLM's per-call ``num_max_tokens_per_rank``: the next power of two of ``n`` (1 for 0 or 1)
    (vllm prepare_finalize/deepep_v2.py: ``1 << max(n - 1, 0).bit_length()``)."""
    return 1 << max(n - 1, 0).bit_length()


def align_up(x, a):
    return (x + a - 1) // a * a


def make_routing(rank, n, num_experts, hidden, seed, masked=0.0):
    """``x`` bf16 ``[n, hidden]``, ``topk_idx`` int64 ``[n, TOPK]`` (distinct experts per token,
    -1 for a masked slot), ``topk_weights`` fp32 ``[n, TOPK]`` (0 where masked, as DeepEP's test
    sets them), all on the CPU and the same for a given (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    scores = torch.rand(n, num_experts, generator=g)
    weights, idx = scores.topk(TOPK, dim=1)
    idx = idx.to(torch.int64)
    weights = (weights / weights.sum(1, keepdim=True).clamp(min=1e-6)).to(torch.float32)
    if masked > 0:
        drop = torch.rand(n, TOPK, generator=g) < masked
        idx[drop] = -1
        weights[drop] = 0.0
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    return x, idx, weights


def import_deep_ep():
    """``deep_ep`` as the callers import it: the deepep_kernels shim, installed in this process
    (it refuses to shadow a real DeepEP)."""
    import deepep_kernels.shim

    deepep_kernels.shim.install()
    import deep_ep as module

    if not getattr(module, "__deepep_kernels_shim__", False):
        raise AssertionError(f"import deep_ep loaded {module.__file__}, not the deepep_kernels shim")
    return module


def as_bytes(t):
    """FP8 tensors as their bytes (indexing, cat and comparison need no float8 kernels), others
    unchanged."""
    if t is not None and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def bits(t):
    """The tensor's bit patterns, for exact comparison (NaN payloads and -0.0 included)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    if t.is_floating_point():  # float8
        return t.view(torch.uint8)
    return t


def same(name, got, want):
    """``got`` equals ``want`` bit for bit (shape, dtype and every value), else an
    AssertionError naming the first rows that differ."""
    got = got.detach().cpu()
    want = want.detach().cpu()
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{name}: got shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if got.dtype != want.dtype:
        raise AssertionError(f"{name}: got dtype {got.dtype}, want {want.dtype}")
    if got.numel() == 0:
        return
    eq = bits(got) == bits(want)
    if bool(eq.all()):
        return
    flat = eq.reshape(eq.shape[0], -1) if eq.dim() > 0 else eq.reshape(1, 1)
    rows = (~flat.all(1)).nonzero().flatten().tolist()
    r = rows[0]
    g_row = got[r].flatten() if got.dim() > 0 else got.flatten()
    w_row = want[r].flatten() if want.dim() > 0 else want.flatten()
    cols = (~flat[r]).nonzero().flatten().tolist()
    c = cols[0]
    raise AssertionError(f"{name}: {len(rows)} of {flat.shape[0]} rows differ (first {rows[:10]}); row {r} differs "
                         f"in {len(cols)} of {flat.shape[1]} entries, first at {c}: got {g_row[c].item()!r}, "
                         f"want {w_row[c].item()!r}")


def reference_receive(inputs, rank, world, num_max_tokens_per_rank, local_experts=LOCAL_EXPERTS):
    """What this rank receives in a plain (non-expanded) dispatch, computed from every rank's
    inputs ``inputs[s] = dict(x=..., idx=..., w=..., sf=None or ...)`` (CPU tensors): the rows
    in DeepEP's reference order (by source global index ``s * num_max_tokens_per_rank + t``).

    Returns a dict: ``gidx`` int64 ``[M]``, ``src`` list of (s, t), ``x``, ``sf`` (or None),
    ``idx`` (local expert ids, -1 elsewhere), ``w`` (weights, 0 outside this rank), ``per_source``
    (rows from each source rank), ``per_expert`` (unaligned (token, expert) count per local
    expert)."""
    lo, hi = rank * local_experts, (rank + 1) * local_experts
    gidx, src, xs, sfs, ids, ws = [], [], [], [], [], []
    per_source = [0] * world
    per_expert = torch.zeros(local_experts, dtype=torch.int64)
    for s in range(world):
        idx = inputs[s]["idx"]
        mine = (idx >= lo) & (idx < hi)
        tokens = mine.any(1).nonzero().flatten()
        per_source[s] = int(tokens.numel())
        if tokens.numel() == 0:
            continue
        local = torch.where(mine, idx - lo, torch.full_like(idx, -1))[tokens]
        per_expert += torch.bincount(local[local >= 0].flatten(), minlength=local_experts)
        gidx.append(tokens.to(torch.int64) + s * num_max_tokens_per_rank)
        src.extend((s, int(t)) for t in tokens.tolist())
        xs.append(inputs[s]["x"][tokens])
        if inputs[s].get("sf") is not None:
            sfs.append(inputs[s]["sf"][tokens])
        ids.append(local)
        ws.append(torch.where(mine, inputs[s]["w"], torch.zeros_like(inputs[s]["w"]))[tokens])
    hidden = inputs[0]["x"].shape[1]
    has_sf = inputs[0].get("sf") is not None
    if gidx:
        out = dict(gidx=torch.cat(gidx), x=torch.cat(xs), idx=torch.cat(ids), w=torch.cat(ws),
                   sf=torch.cat(sfs) if has_sf else None)
    else:
        out = dict(gidx=torch.empty(0, dtype=torch.int64), x=torch.empty(0, hidden, dtype=inputs[0]["x"].dtype),
                   idx=torch.empty(0, TOPK, dtype=torch.int64), w=torch.empty(0, TOPK, dtype=torch.float32),
                   sf=torch.empty(0, inputs[0]["sf"].shape[1], dtype=torch.float32) if has_sf else None)
    out.update(src=src, per_source=per_source, per_expert=per_expert)
    return out


def expected_expert_psum(per_expert, alignment, expanded):
    """DeepEP's ``psum_num_recv_tokens_per_expert``: plain mode, the inclusive prefix sum of the
    aligned counts; expanded mode, each expert's aligned start plus its unaligned count."""
    out, start = [], 0
    for c in per_expert.tolist():
        if expanded:
            out.append(start + c)
            start = align_up(start + c, alignment)
        else:
            start += align_up(c, alignment)
            out.append(start)
    return torch.tensor(out, dtype=torch.int32)


def expanded_starts(psum, alignment):
    """Each local expert's first expanded row from an expanded-mode psum (the EPHandle docstring:
    expert i+1 starts at ``align(psum[i], expert_alignment)``)."""
    starts, prev = [], 0
    for p in psum.tolist():
        starts.append(align_up(prev, alignment) if starts else 0)
        prev = p
    return torch.tensor(starts, dtype=torch.int64)


def worst_case_rows(world, num_max, expanded, num_topk=TOPK, local_experts=LOCAL_EXPERTS, alignment=1):
    """The row count of a dispatch without CPU sync (DeepEP 2.1 csrc/elastic/buffer.hpp):
    ``world * num_max`` plain; expanded ``align(world * num_max * min(topk, local) +
    (alignment - 1) * local, alignment)``."""
    if not expanded:
        return world * num_max
    return align_up(world * num_max * min(num_topk, local_experts) + (alignment - 1) * local_experts, alignment)


# ---------------------------------------------------------------------------------------------
# Elementwise "experts" and FP8 casts, the same ops on the sending and the receiving rank
# ---------------------------------------------------------------------------------------------

def expert_scale(global_ids, weights, num_experts):
    """fp32 ``(expert + 1) / num_experts * weight``, elementwise."""
    return ((global_ids.to(torch.float32) + 1) / num_experts) * weights


def quantize_fp8(x):
    """Per-token, per-128-column FP8 cast: ``(values float8_e4m3fn [n, H], scales fp32 [n, H/128])``
    (row-major scales)."""
    n, h = x.shape
    blocks = x.float().view(n, h // FP8_BLOCK, FP8_BLOCK)
    scales = blocks.abs().amax(dim=2).clamp(min=1e-4) / FP8_MAX
    values = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(n, h)
    return values, scales


def tma_col_major(scales):
    """The same scale values in a TMA-aligned column-major layout (strides ``(1, align(n, 4))``),
    as SGLang's ``sglang_per_token_group_quant_fp8(column_major_scales=True,
    scale_tma_aligned=True)`` hands them to the dispatch."""
    n, b = scales.shape
    storage = torch.empty(b, align_up(max(n, 1), 4), dtype=scales.dtype, device=scales.device)
    view = storage[:, :n].t()
    view.copy_(scales)
    return view


def dequantize(values, scales):
    """bf16 ``values * scale`` per 128 columns (any scale strides)."""
    n, h = values.shape
    return (values.float().view(n, h // FP8_BLOCK, FP8_BLOCK) * scales.float().unsqueeze(2)).view(n, h).to(torch.bfloat16)


def reference_expert_outputs(x, idx, w, num_experts):
    """The source rank's ``y [n, K, H]``: token times its expert's scale in each slot, bf16,
    +0.0 where the slot is -1 (what ``refs.combine`` takes)."""
    scale = expert_scale(idx, w, num_experts)
    y = (x.float().unsqueeze(1) * scale.unsqueeze(2)).to(torch.bfloat16)
    return torch.where((idx >= 0).unsqueeze(2), y, torch.zeros((), dtype=torch.bfloat16, device=y.device))


def plain_expert_rows(x, local_idx, w, rank, num_experts, ordered_accumulate):
    """The receiving rank's combine input in plain mode: each received row's local slots run
    through their experts and summed in slot order (float32 from +0.0, like SGLang's
    ``ep_gather`` and vLLM's ``TopKWeightAndReduceContiguous`` reduce the top-k rows)."""
    gid = torch.where(local_idx >= 0, local_idx + rank * LOCAL_EXPERTS, torch.full_like(local_idx, -1))
    y = reference_expert_outputs(x, gid, w, num_experts)
    return ordered_accumulate(y)


def expanded_row_experts(num_rows, psum, alignment, device):
    """On the GPU, without a host sync (capturable): each expanded row's local expert and whether
    it is a real row (not alignment padding or the worst-case tail), from the handle's
    expanded-mode ``psum_num_recv_tokens_per_expert`` (SGLang's test derives them the same way)."""
    psum = psum.to(torch.int64)
    prev = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), psum[:-1]])
    starts = (prev + alignment - 1) // alignment * alignment
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    expert = (rows.unsqueeze(1) >= starts.unsqueeze(0)).sum(1) - 1
    real = rows < psum[expert]
    return expert, real


def expanded_expert_rows(x, weights, expert, real, rank, num_experts):
    """The receiving rank's combine input in expanded mode: each real row times its expert's
    scale (router weight applied before the combine, as SGLang's ``masked_slab_to_expand`` does);
    other rows NaN, which a combine must never read."""
    scale = expert_scale(expert + rank * LOCAL_EXPERTS, weights, num_experts)
    y = (x.float() * scale.unsqueeze(1)).to(torch.bfloat16)
    return torch.where(real.unsqueeze(1), y, torch.full((), float("nan"), dtype=torch.bfloat16, device=y.device))


# ---------------------------------------------------------------------------------------------
# Checks of one dispatch against the reference
# ---------------------------------------------------------------------------------------------

def _sorted_received(handle, num_recv, ref, what):
    meta = handle.recv_src_metadata[:num_recv, 0].cpu().to(torch.int64)
    order = torch.argsort(meta, stable=True)
    same(f"{what}: recv_src_metadata[:, 0] (sorted source global indices)", meta[order], ref["gidx"])
    return order


def check_plain_dispatch(what, recv_x, recv_sf, recv_idx, recv_w, handle, num_recv, ref, alignment):
    """Rows ``[0, num_recv)`` of a plain dispatch, sorted by source index, equal the reference
    bit for bit; the handle's counts equal the reference's."""
    order = _sorted_received(handle, num_recv, ref, what)
    same(f"{what}: recv_x", as_bytes(recv_x)[:num_recv].cpu()[order], ref["x"])
    if ref["sf"] is not None:
        same(f"{what}: recv scales", recv_sf[:num_recv].cpu()[order], ref["sf"])
    got_idx = recv_idx[:num_recv].cpu()[order]
    same(f"{what}: recv_topk_idx", got_idx, ref["idx"])
    if recv_w is not None:
        got_w = recv_w[:num_recv].cpu()[order]
        same(f"{what}: recv_topk_weights (this rank's slots)", torch.where(got_idx >= 0, got_w, torch.zeros_like(got_w)), ref["w"])
    psum_rank = torch.tensor(ref["per_source"], dtype=torch.int64).cumsum(0).to(torch.int32)
    same(f"{what}: psum_num_recv_tokens_per_scaleup_rank", handle.psum_num_recv_tokens_per_scaleup_rank, psum_rank)
    same(f"{what}: psum_num_recv_tokens_per_expert", handle.psum_num_recv_tokens_per_expert,
         expected_expert_psum(ref["per_expert"], alignment, expanded=False))


def check_expanded_dispatch(what, recv_x, recv_sf, recv_w, handle, num_recv, ref, alignment, rank):
    """An expanded dispatch: ``recv_src_metadata[:num_recv, 2:]`` maps every received (token,
    slot) on this rank to a distinct row inside its expert's block (and -1 elsewhere); that row
    holds the token's data, scales and slot weight bit for bit; the handle's expert psum and
    unaligned counts equal the reference's."""
    order = _sorted_received(handle, num_recv, ref, what)
    psum = handle.psum_num_recv_tokens_per_expert.cpu()
    same(f"{what}: psum_num_recv_tokens_per_expert (expanded)", psum, expected_expert_psum(ref["per_expert"], alignment, expanded=True))
    unaligned = getattr(handle, "num_unaligned_recv_tokens_per_expert", None)
    if unaligned is None:
        raise AssertionError(f"{what}: the handle has no num_unaligned_recv_tokens_per_expert (DeepEP 2.1's EPHandle "
                             "field that vLLM reads to rebuild expanded expert ids without a CPU sync)")
    same(f"{what}: num_unaligned_recv_tokens_per_expert", unaligned.cpu().to(torch.int64), ref["per_expert"])
    starts = expanded_starts(psum, alignment)
    ends = starts + ref["per_expert"]
    slots = handle.recv_src_metadata[:num_recv, 2:].cpu().to(torch.int64)[order]
    local = ref["idx"]
    if tuple(slots.shape) != tuple(local.shape):
        raise AssertionError(f"{what}: recv_src_metadata has {slots.shape[1]} slot columns, want {local.shape[1]} (top-k)")
    same(f"{what}: which slots got an expanded row (recv_src_metadata[:, 2:] >= 0)", slots >= 0, local >= 0)
    valid = local >= 0
    rows_of_slots = slots[valid]
    experts_of_slots = local[valid]
    inside = (rows_of_slots >= starts[experts_of_slots]) & (rows_of_slots < ends[experts_of_slots])
    if not bool(inside.all()):
        bad = (~inside).nonzero().flatten()[0].item()
        raise AssertionError(f"{what}: an expanded row {rows_of_slots[bad].item()} lies outside its expert "
                             f"{experts_of_slots[bad].item()}'s block [{starts[experts_of_slots[bad]].item()}, "
                             f"{ends[experts_of_slots[bad]].item()})")
    if rows_of_slots.unique().numel() != rows_of_slots.numel():
        raise AssertionError(f"{what}: two (token, slot) pairs share one expanded row")
    token_of_slot = torch.arange(local.shape[0]).unsqueeze(1).expand_as(local)[valid]
    index = rows_of_slots.to(recv_x.device)
    same(f"{what}: expanded recv_x rows", as_bytes(recv_x)[index].cpu(), ref["x"][token_of_slot])
    if ref["sf"] is not None:
        same(f"{what}: expanded recv scales", recv_sf[index].cpu(), ref["sf"][token_of_slot])
    if recv_w is not None:
        if recv_w.dim() != 1:
            raise AssertionError(f"{what}: expanded recv_topk_weights has shape {tuple(recv_w.shape)}, want 1-D (one per row)")
        same(f"{what}: expanded recv_topk_weights", recv_w[index].cpu(), ref["w"][valid])
    return starts


def gathered_inputs(group, x, idx, w, sf=None):
    """Every rank's dispatch inputs as CPU tensors (an FP8 ``x`` as its bytes, uint8: the checks
    compare received FP8 rows as bytes too)."""
    payload = (as_bytes(x).cpu(), idx.cpu(), w.cpu(), None if sf is None else sf.contiguous().cpu())
    return [dict(x=gx, idx=gi, w=gw, sf=gs) for gx, gi, gw, gs in gather(group, payload)]


def barrier(group, tag):
    torch.cuda.synchronize()
    gather(group, tag)


def wait(event):
    """What every caller does after a call: ``if event.event is not None: current_stream_wait()``."""
    if event.event is not None:
        event.current_stream_wait()


# ---------------------------------------------------------------------------------------------
# SGLang: prefill (plain, CPU sync, FP8 with TMA-aligned column-major scales), then decode
# (expanded, no CPU sync, FP8 row-major scales) captured in a CUDA graph and replayed
# ---------------------------------------------------------------------------------------------

SGLANG_HIDDEN = 7168  # DeepSeek-V3
SGLANG_CAP = 128  # SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK, one cap for both phases
SGLANG_ALIGNMENT = 128  # DeepEPv2DispatchOutput.expert_alignment default (DeepGEMM's M block)


def sglang(rank, world, group):
    """sgl-project/sglang python/sglang/srt/layers/moe/token_dispatcher/deepep_v2.py at 0134da0b
    (``DeepEPv2Buffer.get_buffer``, ``_DeepEPv2Impl.dispatch/combine``) and SGLang's DeepEP V2
    dispatch test (an idle rank in prefill and decode; decode captured in
    ``torch.cuda.graph(graph, stream=stream)`` after a warm-up on that stream, inputs changed in
    place between replays).

    Prefill (``is_extend_in_batch``): plain layout, ``do_cpu_sync=True``, FP8 with TMA-aligned
    column-major scales (``capability.fp8_scale_tma_aligned``), the rows sliced to
    ``psum_num_recv_tokens_per_scaleup_rank[-1]``; a rank with no tokens sends one dummy token
    routed to experts ``0..topk-1`` with zero weights and drops its combined row. Decode:
    expanded, ``do_cpu_sync=False``, Hopper's row-major fp32 scales, router weights applied to
    the expanded rows before a combine without ``topk_weights``."""
    deep_ep = import_deep_ep()
    from deep_ep import ElasticBuffer  # SGLang's import

    from deepep_kernels.utils.refs import combine as ref_combine
    from deepep_kernels.utils.refs import ordered_accumulate

    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts = LOCAL_EXPERTS * world
    # one buffer for both phases, no explicitly_destroy (SGLang drops the reference)
    buf = ElasticBuffer(group, num_max_tokens_per_rank=SGLANG_CAP, hidden=SGLANG_HIDDEN, num_topk=TOPK,
                        use_fp8_dispatch=True, allow_hybrid_mode=False, sl_idx=0, prefer_overlap_with_compute=False)
    assert isinstance(buf, deep_ep.ElasticBuffer)
    assert buf.num_bytes > 0, "SGLang logs ElasticBuffer.num_bytes at creation"
    num_sms = buf.get_theoretical_num_sms(num_experts, TOPK)  # _resolve_num_sms_qps
    num_qps = buf.get_theoretical_num_qps(num_sms)
    call = dict(num_experts=num_experts, num_max_tokens_per_rank=SGLANG_CAP, expert_alignment=SGLANG_ALIGNMENT,
                num_sms=num_sms, num_qps=num_qps)

    def prefill(what, n, seed):
        """One prefill step of ``n`` local tokens (0: the idle rank's padding)."""
        x, idx, w = make_routing(rank, n, num_experts, SGLANG_HIDDEN, seed=seed)
        pad_empty = n == 0
        if pad_empty:  # _DeepEPv2Impl.dispatch: _pad_empty_combine
            x = torch.zeros(1, SGLANG_HIDDEN, dtype=torch.bfloat16)
            idx = torch.arange(TOPK, dtype=torch.int64).unsqueeze(0)
            w = torch.zeros(1, TOPK, dtype=torch.float32)
        xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
        q, sf = quantize_fp8(xd)
        sf_in = tma_col_major(sf)  # column_major_scales=True, scale_tma_aligned=True
        recv, recv_idx, recv_w, handle, event = buf.dispatch((q, sf_in), topk_idx=idxd, topk_weights=wd,
                                                             use_tma_aligned_col_major_sf=True, do_cpu_sync=True,
                                                             do_expand=False, **call)
        wait(event)
        rq, rsf = recv
        num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        inputs = gathered_inputs(group, q, idx, w, sf)
        ref = reference_receive(inputs, rank, world, SGLANG_CAP)
        assert num_recv == len(ref["src"]), (what, num_recv, len(ref["src"]))
        assert rq.shape[0] == num_recv, f"{what}: with CPU sync recv_x has exactly the received rows: {rq.shape[0]} != {num_recv}"
        assert rsf.stride(0) == 1 and rsf.stride(1) >= num_recv and rsf.stride(1) % 4 == 0, \
            f"{what}: use_tma_aligned_col_major_sf=True: recv scales want strides (1, align(rows, 4)), got {rsf.stride()}"
        check_plain_dispatch(what, rq, rsf, recv_idx, recv_w, handle, num_recv, ref, SGLANG_ALIGNMENT)
        counts = list(handle.num_recv_tokens_per_expert_list)
        assert counts == [align_up(c, SGLANG_ALIGNMENT) for c in ref["per_expert"].tolist()], \
            (what, counts, ref["per_expert"].tolist())
        # DeepGEMM runner: all_tokens = psum[-1].item() rows of grouped-GEMM input
        assert int(handle.psum_num_recv_tokens_per_expert[-1].item()) == sum(counts)
        # SGLang slices the received tensors to num_recv before its runner sees them
        rq, rsf, recv_idx, recv_w = rq[:num_recv], rsf[:num_recv], recv_idx[:num_recv], recv_w[:num_recv]
        # expert + ep_gather (weights applied); the received weights go back through the combine
        x_in = plain_expert_rows(dequantize(rq, rsf), recv_idx, recv_w, rank, num_experts, ordered_accumulate)
        out, out_w, event = buf.combine(x_in, handle=handle, topk_weights=recv_w, num_sms=num_sms, num_qps=num_qps)
        wait(event)
        y = reference_expert_outputs(dequantize(q, sf), idxd, wd, num_experts)
        same(f"{what}: combine", out, ref_combine(y, idxd, 1, world, num_experts, None, True, False))
        same(f"{what}: combined weights (passed through)", out_w, wd)
        if pad_empty:
            out = out[:0]  # combine(): the dummy token's row is dropped
            assert tuple(out.shape) == (0, SGLANG_HIDDEN), (what, tuple(out.shape))
        barrier(group, what)

    # --- prefill: every rank with tokens, then the last rank idle (padded as SGLang pads it)
    prefill("sglang prefill", SGLANG_CAP - 7 * rank, seed=101)
    prefill("sglang prefill with an idle rank", 0 if rank == world - 1 else 40 + 3 * rank, seed=102)

    # --- decode: expanded, no CPU sync, captured; the last rank is idle (0 tokens)
    n = 0 if rank == world - 1 else 12 + rank
    static_x = torch.zeros(n, SGLANG_HIDDEN, dtype=torch.bfloat16, device=dev)
    static_idx = torch.zeros(n, TOPK, dtype=torch.int64, device=dev)
    static_w = torch.zeros(n, TOPK, dtype=torch.float32, device=dev)

    def step():
        q, sf = quantize_fp8(static_x)  # Hopper decode: plain row-major fp32 scales
        recv, _, recv_w, handle, event = buf.dispatch((q, sf), topk_idx=static_idx, topk_weights=static_w,
                                                      use_tma_aligned_col_major_sf=False, do_cpu_sync=False,
                                                      do_expand=True, **call)
        wait(event)
        rq, rsf = recv
        expert, real = expanded_row_experts(rq.shape[0], handle.psum_num_recv_tokens_per_expert, SGLANG_ALIGNMENT, dev)
        x_in = expanded_expert_rows(dequantize(rq, rsf), recv_w, expert, real, rank, num_experts)
        out, _, event = buf.combine(x_in, handle=handle, topk_weights=None, num_sms=num_sms, num_qps=num_qps)
        wait(event)
        return dict(q=q, sf=sf, rq=rq, rsf=rsf, recv_w=recv_w, handle=handle, out=out)

    def load(seed):
        x, idx, w = make_routing(rank, n, num_experts, SGLANG_HIDDEN, seed=seed)
        static_x.copy_(x.to(dev))
        static_idx.copy_(idx.to(dev))
        static_w.copy_(w.to(dev))
        return idx, w

    def check(what, res, idx, w):
        handle = res["handle"]
        num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        rows = worst_case_rows(world, SGLANG_CAP, True, alignment=SGLANG_ALIGNMENT)
        assert res["rq"].shape[0] == rows, f"{what}: no CPU sync: {res['rq'].shape[0]} expanded rows, want the worst case {rows}"
        inputs = gathered_inputs(group, res["q"], idx, w, res["sf"])
        ref = reference_receive(inputs, rank, world, SGLANG_CAP)
        assert num_recv == len(ref["src"]), (what, num_recv, len(ref["src"]))
        check_expanded_dispatch(what, res["rq"], res["rsf"], res["recv_w"], handle, num_recv, ref, SGLANG_ALIGNMENT, rank)
        y = reference_expert_outputs(dequantize(res["q"], res["sf"]), idx.to(dev), w.to(dev), num_experts)
        same(f"{what}: combine", res["out"], ref_combine(y, idx.to(dev), 1, world, num_experts, None, True, False))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    idx, w = load(seed=201)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):  # eager warm-up on the capture stream, checked too
        eager = step()
    stream.synchronize()
    check("sglang decode (eager warm-up)", eager, idx, w)
    del eager
    barrier(group, "sglang warm-up")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    for seed in (202, 203):
        idx, w = load(seed)  # new tokens and new routing copied into the captured inputs
        barrier(group, f"sglang replay {seed}")
        graph.replay()
        torch.cuda.synchronize()
        check(f"sglang decode (replay with seed {seed})", captured, idx, w)
    barrier(group, "sglang replayed")
    del graph, captured
    # SGLang's DeepEPv2Buffer.destroy(): cls._buffer = None (prefill and step close over buf: this
    # clears their cell too, so the last reference goes here)
    buf = None
    gc.collect()
    barrier(group, "sglang done")


# ---------------------------------------------------------------------------------------------
# vLLM: decode plain without CPU sync with a per-call power-of-two num_max_tokens_per_rank, then
# prefill expanded with CPU sync
# ---------------------------------------------------------------------------------------------

VLLM_HIDDEN = 2048  # Qwen3-30B-A3B
VLLM_MAX_NUM_TOKENS = 256  # moe.max_num_tokens (max batched tokens), the constructor's cap


def vllm(rank, world, group):
    """vllm-project/vllm vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_v2.py at
    02bd2a49 (``DeepEPV2PrepareAndFinalize``) and ``DeepEPV2All2AllManager``
    (vllm/distributed/device_communicators/all2all.py): ``deep_ep.ElasticBuffer(**kwargs)`` with
    ``explicitly_destroy=True`` and the env defaults (hybrid, prefer-overlap, multiple reduction
    all off), ``max_sms_used()`` from ``get_theoretical_num_sms``, ``destroy()`` at the end.

    Decode (``use_cudagraph``): plain, ``do_cpu_sync=False``, ``num_max_tokens_per_rank`` the
    next power of two of the DP-wide max batch (capped at the buffer's), ``recv_topk_idx``
    globalised in place (rows past ``psum_num_recv_tokens_per_scaleup_rank[-1]`` set to -1, on
    the device), the combine through ``finalize_async`` (``async_with_compute_stream`` and
    ``allocate_on_comm_stream``, then ``current_stream_wait`` and ``output.copy_``). Prefill:
    expanded, ``do_cpu_sync=True``, expert ids rebuilt from ``num_recv_tokens_per_expert_list``,
    the combine through the synchronous ``finalize``."""
    deep_ep = import_deep_ep()
    from deepep_kernels.utils.refs import combine as ref_combine
    from deepep_kernels.utils.refs import ordered_accumulate

    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts = LOCAL_EXPERTS * world
    rank_expert_offset = rank * LOCAL_EXPERTS
    buf = deep_ep.ElasticBuffer(group=group, num_max_tokens_per_rank=VLLM_MAX_NUM_TOKENS, hidden=VLLM_HIDDEN,
                                num_topk=TOPK, use_fp8_dispatch=False, allow_hybrid_mode=False,
                                prefer_overlap_with_compute=False, allow_multiple_reduction=False,
                                explicitly_destroy=True)
    num_sms = buf.get_theoretical_num_sms(num_experts=num_experts, num_topk=TOPK)  # max_sms_used()
    assert num_sms > 0

    # --- decode steps: the DP-wide max batch differs per step, so does the per-call cap
    for step, most in enumerate((5, 13, 1)):
        n = max(0, most - rank % 3)  # rank 0 has the max; some ranks are idle at the last step
        dp_max = max(gather(group, n))  # dp_metadata.num_tokens_across_dp_cpu.max()
        cap = min(pow2_bucket(dp_max), VLLM_MAX_NUM_TOKENS)
        assert cap == pow2_bucket(most)
        what = f"vllm decode step {step} (cap {cap})"
        x, idx, w = make_routing(rank, n, num_experts, VLLM_HIDDEN, seed=300 + step)
        xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
        recv_x, recv_idx, recv_w, handle, event = buf.dispatch(x=xd, topk_idx=idxd, topk_weights=wd, num_experts=num_experts,
                                                               num_max_tokens_per_rank=cap, do_expand=False,
                                                               do_cpu_sync=False, async_with_compute_stream=False)
        wait(event)  # _receiver
        assert recv_x.shape[0] == worst_case_rows(world, cap, False), \
            f"{what}: no CPU sync: {recv_x.shape[0]} rows, want world * per-call cap = {world * cap}"
        assert handle.num_max_tokens_per_rank == cap, (handle.num_max_tokens_per_rank, cap)
        assert list(handle.num_recv_tokens_per_expert_list) == [], \
            f"{what}: without CPU sync the per-expert list is empty (vLLM then passes no expert_tokens_meta)"
        recv_idx_as_received = recv_idx.clone()  # checked below; vLLM rewrites recv_idx in place now
        # _globalize_recv_topk_idx: local -> global ids, -1 elsewhere and on rows >= num_recv (no host sync)
        psum_recv_per_rank = handle.psum_num_recv_tokens_per_scaleup_rank
        live = torch.arange(recv_x.shape[0], device=dev) < psum_recv_per_rank[-1]
        keep = (recv_idx >= 0) & (recv_idx + rank_expert_offset < num_experts) & live.unsqueeze(1)
        recv_idx.copy_(torch.where(keep, recv_idx + rank_expert_offset, torch.full_like(recv_idx, -1)))
        # the experts see global ids; rows past num_recv: uninitialised in vLLM's output, NaN here,
        # which the combine must never read
        x_in = plain_expert_rows(recv_x, torch.where(recv_idx >= 0, recv_idx - rank_expert_offset, recv_idx), recv_w,
                                 rank, num_experts, ordered_accumulate)
        x_in = torch.where(live.unsqueeze(1), x_in, torch.full((), float("nan"), dtype=torch.bfloat16, device=dev))
        output = torch.empty(n, VLLM_HIDDEN, dtype=torch.bfloat16, device=dev)
        # finalize_async: the combine on the comm stream, joined by the receiver
        combined, _, event = buf.combine(x=x_in, handle=handle, topk_weights=None, async_with_compute_stream=True,
                                         allocate_on_comm_stream=True)
        if event.event is not None:
            event.current_stream_wait()
        output.copy_(combined, non_blocking=True)
        torch.cuda.synchronize()
        num_recv = int(psum_recv_per_rank[-1].item())
        inputs = gathered_inputs(group, x, idx, w)
        ref = reference_receive(inputs, rank, world, cap)  # source indices use the per-call cap
        assert num_recv == len(ref["src"]), (what, num_recv, len(ref["src"]))
        check_plain_dispatch(what, recv_x, None, recv_idx_as_received, recv_w, handle, num_recv, ref, 1)
        y = reference_expert_outputs(xd, idxd, wd, num_experts)
        same(f"{what}: combine", output, ref_combine(y, idxd, 1, world, num_experts, None, True, False))
        barrier(group, what)

    # --- prefill: expanded with CPU sync, the constructor's cap, no alignment passed (1)
    n = 200 - 11 * rank
    what = "vllm prefill"
    x, idx, w = make_routing(rank, n, num_experts, VLLM_HIDDEN, seed=350, masked=0.05)
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    recv_x, recv_idx, recv_w, handle, event = buf.dispatch(x=xd, topk_idx=idxd, topk_weights=wd, num_experts=num_experts,
                                                           num_max_tokens_per_rank=None, do_expand=True, do_cpu_sync=True,
                                                           async_with_compute_stream=False)
    wait(event)
    assert recv_idx is None, "expanded dispatch returns no recv_topk_idx"
    counts = list(handle.num_recv_tokens_per_expert_list)
    inputs = gathered_inputs(group, x, idx, w)
    ref = reference_receive(inputs, rank, world, VLLM_MAX_NUM_TOKENS)
    assert counts == ref["per_expert"].tolist(), (what, counts, ref["per_expert"].tolist())
    # vLLM pairs recv_x with sum(counts) expert ids built from the list: the rows must be exactly that
    assert recv_x.shape[0] == sum(counts), f"{what}: {recv_x.shape[0]} expanded rows, vLLM builds {sum(counts)} expert ids"
    num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
    check_expanded_dispatch(what, recv_x, None, recv_w, handle, num_recv, ref, 1, rank)
    # vLLM's _receiver: expert ids per row from the list, in order
    row_expert = torch.repeat_interleave(torch.arange(LOCAL_EXPERTS), torch.tensor(counts, dtype=torch.int64)).to(dev)
    x_in = expanded_expert_rows(recv_x, recv_w, row_expert, torch.ones_like(row_expert, dtype=torch.bool), rank, num_experts)
    # finalize: a synchronous combine copied into the layer's output
    output = torch.empty(n, VLLM_HIDDEN, dtype=torch.bfloat16, device=dev)
    combined, _, event = buf.combine(x=x_in, handle=handle, topk_weights=None, async_with_compute_stream=False,
                                     allocate_on_comm_stream=False)
    assert event.event is None, "a synchronous combine returns EventOverlap(None)"
    output.copy_(combined, non_blocking=True)
    torch.cuda.synchronize()
    y = reference_expert_outputs(xd, idxd, wd, num_experts)
    # allow_multiple_reduction=False: every slot reduced once, in slot order (recipe (False, False))
    same(f"{what}: combine", output, ref_combine(y, idxd, 1, world, num_experts, None, False, False))
    barrier(group, "vllm done")
    buf.destroy()  # DeepEPV2All2AllManager.destroy()


# ---------------------------------------------------------------------------------------------
# Megatron-LM: dispatch/combine as autograd Functions (training), plain with CPU sync
# ---------------------------------------------------------------------------------------------

MEGATRON_HIDDEN = 4096
MEGATRON_TOKENS = 128  # the same on every rank (a training micro-batch)


class MegatronDispatch(torch.autograd.Function):
    """Megatron-LM dev d48bd6be0a, megatron/core/transformer/moe/fused_a2a.py
    ``DeepepV2Dispatch``: forward a dispatch, backward a combine of the gradients with the probs'
    gradients as ``topk_weights`` (passed through)."""

    @staticmethod
    def forward(ctx, buffer, x, token_indices, token_probs, num_experts, num_max_tokens_per_rank, expert_alignment,
                num_sms, async_finish=False, allocate_on_comm_stream=False):
        previous_event = buffer.capture() if async_finish and allocate_on_comm_stream else None
        recv_x, recv_token_indices, recv_token_probs, handle, event = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_experts=num_experts,
            num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment, num_sms=num_sms,
            previous_event=previous_event, async_with_compute_stream=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            event.current_stream_wait()
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.num_sms = handle.num_sms
        ctx.async_finish = async_finish
        ctx.allocate_on_comm_stream = allocate_on_comm_stream
        tokens_per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        previous_event = ctx.buffer.capture() if ctx.async_finish and ctx.allocate_on_comm_stream else None
        grad_x, grad_token_probs, event = ctx.buffer.combine(
            grad_output.contiguous(), handle=ctx.handle, topk_weights=grad_token_probs.float(), num_sms=ctx.num_sms,
            previous_event=previous_event, async_with_compute_stream=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            event.current_stream_wait()
        return None, grad_x, None, grad_token_probs, None, None, None, None, None, None


class MegatronCombine(torch.autograd.Function):
    """Megatron-LM dev d48bd6be0a, fused_a2a.py ``DeepepV2Combine``: forward a combine, backward
    a cached dispatch (``handle=``) of the gradient."""

    @staticmethod
    def forward(ctx, buffer, x, handle, num_sms, async_finish=False, allocate_on_comm_stream=False):
        previous_event = buffer.capture() if async_finish and allocate_on_comm_stream else None
        combined_x, combined_token_probs, event = buffer.combine(
            x, handle=handle, num_sms=num_sms, previous_event=previous_event, async_with_compute_stream=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            event.current_stream_wait()
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.num_sms = handle.num_sms if num_sms == 0 else num_sms
        ctx.async_finish = async_finish
        ctx.allocate_on_comm_stream = allocate_on_comm_stream
        return combined_x, combined_token_probs

    @staticmethod
    def backward(ctx, grad_output, grad_combined_token_probs):
        previous_event = ctx.buffer.capture() if ctx.async_finish and ctx.allocate_on_comm_stream else None
        grad_x, _, _, _, event = ctx.buffer.dispatch(
            grad_output.contiguous(), handle=ctx.handle, num_sms=ctx.num_sms, previous_event=previous_event,
            async_with_compute_stream=ctx.async_finish, allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            event.current_stream_wait()
        return None, grad_x, None, None, None, None


def megatron_expert(recv_x, recv_idx, recv_probs, rank, num_experts):
    """A differentiable expert on the received rows: ``x * sum_k(local probs_k * (e_k + 1) / E)``,
    the sum taken slot by slot from +0.0 (so the source rank can redo it exactly)."""
    s = torch.zeros(recv_x.shape[0], dtype=torch.float32, device=recv_x.device)
    for k in range(recv_idx.shape[1]):
        mine = recv_idx[:, k] >= 0
        c = (recv_idx[:, k] + rank * LOCAL_EXPERTS).to(torch.float32).add(1).div(num_experts)
        s = s + torch.where(mine, recv_probs[:, k] * c, torch.zeros_like(c))
    return (recv_x.float() * s.unsqueeze(1)).to(torch.bfloat16)


def rank_rows_reference(rows_by_dest, idx, world, num_experts, ref_combine):
    """V2's combine of one bf16 row per (token, destination rank): ``rows_by_dest[d]`` is
    ``[n, H]`` (rows of tokens that did not go to ``d`` unused). Each row is put in one slot of
    its rank in ``y`` and ``refs.combine`` (recipe (True, False)) sums them in V2's order."""
    n, k = idx.shape
    hidden = rows_by_dest[0].shape[1]
    y = torch.zeros(n, k, hidden, dtype=torch.bfloat16, device=idx.device)
    dest = torch.where(idx >= 0, idx // LOCAL_EXPERTS, torch.full_like(idx, -1))
    for j in range(k):
        first = dest[:, j] >= 0
        for i in range(j):
            first &= dest[:, i] != dest[:, j]
        for d in range(world):
            sel = first & (dest[:, j] == d)
            y[:, j] = torch.where(sel.unsqueeze(1), rows_by_dest[d], y[:, j])
    return ref_combine(y, idx, 1, world, num_experts, None, True, False)


def megatron(rank, world, group):
    """Megatron-LM dev d48bd6be0a: ``get_elastic_buffer`` (``num_bytes`` from
    ``get_buffer_size_hint``, flags at their defaults), ``_DeepepV2Manager`` in
    megatron/core/transformer/moe/token_dispatcher.py (``num_max_tokens_per_rank`` = the batch,
    ``expert_alignment=1``, ``num_sms=0``), and the two autograd Functions, once synchronous and
    once with ``async_finish`` + ``allocate_on_comm_stream`` (``buffer.capture()`` events)."""
    import_deep_ep()
    from deep_ep import ElasticBuffer  # fused_a2a.py's import
    from deepep_kernels.utils.refs import combine as ref_combine

    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts = LOCAL_EXPERTS * world
    n, hidden = MEGATRON_TOKENS, MEGATRON_HIDDEN
    num_bytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank=n, hidden=hidden, num_topk=TOPK)
    assert num_bytes > 0 and num_bytes % (2 << 20) == 0, f"get_buffer_size_hint: {num_bytes} is not a positive multiple of 2 MiB"
    buf = ElasticBuffer(group, num_bytes=num_bytes, num_max_tokens_per_rank=n, hidden=hidden, num_topk=TOPK)
    # what get_elastic_buffer compares before reusing the buffer
    assert buf.group is group and buf.num_bytes >= num_bytes and buf.num_max_tokens_per_rank == n, \
        (buf.num_bytes, num_bytes, buf.num_max_tokens_per_rank)

    for it, async_finish in enumerate((False, True)):
        what = f"megatron ({'async_finish + allocate_on_comm_stream' if async_finish else 'synchronous'})"
        x, idx, probs = make_routing(rank, n, num_experts, hidden, seed=400 + it)
        g = torch.Generator().manual_seed(500 + 10 * it + rank)
        grad_out = torch.randn(n, hidden, generator=g).to(torch.bfloat16)  # the loss's gradient, bf16 exact
        xd = x.to(dev).requires_grad_()
        probsd = probs.to(dev).requires_grad_()
        idxd = idx.to(dev)

        recv_x, recv_idx, recv_probs, tokens_per_expert, handle = MegatronDispatch.apply(
            buf, xd, idxd, probsd, num_experts, n, 1, 0, async_finish, async_finish)
        seen = {}
        recv_x.register_hook(lambda t: seen.__setitem__("recv_x", t.detach().clone()))
        recv_probs.register_hook(lambda t: seen.__setitem__("recv_probs", t.detach().clone()))
        rows = megatron_expert(recv_x, recv_idx, recv_probs, rank, num_experts)
        rows.register_hook(lambda t: seen.__setitem__("rows", t.detach().clone()))
        combined, combined_probs = MegatronCombine.apply(buf, rows, handle, 0, async_finish, async_finish)
        assert combined_probs is None, "a combine without topk_weights returns no weights"
        (combined.float() * grad_out.to(dev).float()).sum().backward()
        torch.cuda.synchronize()

        # forward: the dispatch against the reference, the counts Megatron turns into a tensor
        inputs = gathered_inputs(group, x, idx, probs)
        ref = reference_receive(inputs, rank, world, n)
        num_recv = len(ref["src"])
        assert recv_x.shape[0] == num_recv, (what, recv_x.shape[0], num_recv)
        check_plain_dispatch(f"{what}: dispatch", recv_x.detach(), None, recv_idx, recv_probs.detach(), handle, num_recv, ref, 1)
        same(f"{what}: tokens_per_expert", tokens_per_expert.to(torch.int64), ref["per_expert"])
        # forward combine: each destination's row redone on the source rank
        rows_by_dest = []
        for d in range(world):
            on_d = (idxd >= d * LOCAL_EXPERTS) & (idxd < (d + 1) * LOCAL_EXPERTS)
            local = torch.where(on_d, idxd - d * LOCAL_EXPERTS, torch.full_like(idxd, -1))
            rows_by_dest.append(megatron_expert(xd.detach(), local, probsd.detach(), d, num_experts))
        same(f"{what}: combine (forward)", combined, rank_rows_reference(rows_by_dest, idxd, world, num_experts, ref_combine))

        # backward of the combine: a cached dispatch; each received row gets its token's gradient
        everything = gather(group, dict(grad_out=grad_out, meta=handle.recv_src_metadata[:num_recv, 0].cpu().to(torch.int64),
                                        grad_recv_x=seen["recv_x"].cpu(), grad_recv_probs=seen["recv_probs"].cpu()))
        order = torch.argsort(handle.recv_src_metadata[:num_recv, 0].cpu().to(torch.int64), stable=True)
        want_rows = torch.stack([everything[s]["grad_out"][t] for s, t in ref["src"]]) if num_recv else \
            torch.empty(0, hidden, dtype=torch.bfloat16)
        same(f"{what}: combine backward = cached dispatch of the gradient", seen["rows"].cpu()[order], want_rows)

        # backward of the dispatch: a combine of the receivers' gradients, probs' gradients passed through
        grad_rows_by_dest = [torch.zeros(n, hidden, dtype=torch.bfloat16) for _ in range(world)]
        grad_probs_want = torch.zeros(n, TOPK, dtype=torch.float32)
        for d in range(world):
            src_rank = everything[d]["meta"] // n
            tok = everything[d]["meta"] % n
            for j in (src_rank == rank).nonzero().flatten().tolist():
                t = int(tok[j])
                grad_rows_by_dest[d][t] = everything[d]["grad_recv_x"][j]
                on_d = (idx[t] >= d * LOCAL_EXPERTS) & (idx[t] < (d + 1) * LOCAL_EXPERTS)
                grad_probs_want[t] = torch.where(on_d, everything[d]["grad_recv_probs"][j], grad_probs_want[t])
        want_grad_x = rank_rows_reference([r.to(dev) for r in grad_rows_by_dest], idxd, world, num_experts, ref_combine)
        same(f"{what}: x.grad (dispatch backward = combine)", xd.grad, want_grad_x)
        same(f"{what}: probs.grad (the combine's passed-through weights)", probsd.grad, grad_probs_want)
        barrier(group, what)
    # get_elastic_buffer keeps the buffer; nothing destroys it explicitly
    del buf
    gc.collect()
    barrier(group, "megatron done")


# ---------------------------------------------------------------------------------------------
# V1 Buffer and ElasticBuffer side by side in one process on one group (issue 38 item 6)
# ---------------------------------------------------------------------------------------------

V2_SIDE_HIDDEN = 2048
V2_SIDE_CAP = 128


def v1_and_v2_side_by_side(rank, world, group):
    """A ``deepep_kernels.Buffer`` (intranode, like workers.intranode) and an ``ElasticBuffer``
    alive at once on the same gloo group; their calls interleaved (V1 dispatch, V2 dispatch, V1
    combine, V2 combine, V2 expanded dispatch, V1 cached dispatch, ...), each checked; the V2
    buffer destroyed first and the V1 buffer still working after it."""
    import workers
    from deepep_kernels import Buffer, _native
    from deepep_kernels.elastic import ElasticBuffer
    from deepep_kernels.utils.refs import combine as ref_combine
    from deepep_kernels.utils.refs import ordered_accumulate

    dev = torch.device("cuda", torch.cuda.current_device())
    v1 = Buffer(group, _native.intranode_buffer_bytes(world, 512, 7168), 0, explicitly_destroy=True)
    v2 = ElasticBuffer(group, num_max_tokens_per_rank=V2_SIDE_CAP, hidden=V2_SIDE_HIDDEN, num_topk=TOPK, explicitly_destroy=True)
    e1 = workers.LOCAL_EXPERTS * world
    e2 = LOCAL_EXPERTS * world

    def v1_round(seed):
        x, idx, w = workers.make_routing(rank, world, 80 + 5 * rank, e1, seed=seed)
        all_x, all_idx, all_w = zip(*gather(group, (x, idx, w)))
        xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
        per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(idxd, e1)
        rx, ri, rw, counts, h, _ = v1.dispatch(xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd)
        ex, _, ei, ew, ecounts, src = workers.expected_recv(all_x, all_idx, all_w, rank, world, e1)
        return dict(x=x, idx=idx, rx=rx, h=h, ex=ex, ei=ei, ri=ri, counts=counts, ecounts=ecounts)

    def v1_check(what, r):
        workers.check_equal(f"{what}: V1 recv_x", r["rx"], r["ex"])
        workers.check_equal(f"{what}: V1 recv_topk_idx", r["ri"], r["ei"])
        assert r["counts"] == r["ecounts"], (what, r["counts"], r["ecounts"])

    def v1_combine_check(what, r):
        c, _, _ = v1.combine(r["rx"], r["h"])
        sends = torch.stack([torch.tensor([any(d * workers.LOCAL_EXPERTS <= e < (d + 1) * workers.LOCAL_EXPERTS
                                               for e in row.tolist()) for row in r["idx"]]) for d in range(world)], 1)
        workers.check_equal(f"{what}: V1 combine", c, workers.combined_copies(r["x"], sends))

    def v2_dispatch(seed, expanded):
        x, idx, w = make_routing(rank, V2_SIDE_CAP - 3 * rank, e2, V2_SIDE_HIDDEN, seed=seed)
        xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
        recv_x, recv_idx, recv_w, handle, event = v2.dispatch(xd, topk_idx=idxd, topk_weights=wd, num_experts=e2,
                                                              do_expand=expanded)
        wait(event)
        return dict(x=x, idx=idx, w=w, xd=xd, idxd=idxd, wd=wd, recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w,
                    handle=handle, expanded=expanded)

    def v2_check_and_combine(what, r):
        inputs = gathered_inputs(group, r["x"], r["idx"], r["w"])
        ref = reference_receive(inputs, rank, world, V2_SIDE_CAP)
        handle = r["handle"]
        num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        assert num_recv == len(ref["src"]), (what, num_recv, len(ref["src"]))
        if r["expanded"]:
            check_expanded_dispatch(what, r["recv_x"], None, r["recv_w"], handle, num_recv, ref, 1, rank)
            expert, real = expanded_row_experts(r["recv_x"].shape[0], handle.psum_num_recv_tokens_per_expert, 1, dev)
            x_in = expanded_expert_rows(r["recv_x"], r["recv_w"], expert, real, rank, e2)
        else:
            check_plain_dispatch(what, r["recv_x"], None, r["recv_idx"], r["recv_w"], handle, num_recv, ref, 1)
            x_in = plain_expert_rows(r["recv_x"], r["recv_idx"], r["recv_w"], rank, e2, ordered_accumulate)
        out, _, event = v2.combine(x_in, handle)
        wait(event)
        y = reference_expert_outputs(r["xd"], r["idxd"], r["wd"], e2)
        same(f"{what}: V2 combine", out, ref_combine(y, r["idxd"], 1, world, e2, None, True, False))

    a = v1_round(seed=61)
    b = v2_dispatch(seed=62, expanded=False)
    v1_check("round 1", a)
    v1_combine_check("round 1", a)
    v2_check_and_combine("round 1 (plain)", b)
    c = v2_dispatch(seed=63, expanded=True)
    cached, *_ = v1.dispatch(a["x"].to(dev), handle=a["h"])  # V1 cached dispatch between V2 calls
    v2_check_and_combine("round 2 (expanded)", c)
    workers.check_equal("round 2: V1 cached recv_x", cached, a["ex"])
    d = v1_round(seed=64)
    v1_check("round 3", d)
    barrier(group, "side by side")
    v2.destroy()
    e = v1_round(seed=65)  # the V1 buffer outlives the V2 one
    v1_check("after the V2 buffer's destroy", e)
    v1_combine_check("after the V2 buffer's destroy", e)
    barrier(group, "side by side done")
    v1.destroy()
