"""DeepEP V2's ``ElasticBuffer`` and ``EPHandle`` (DeepEP 2.1's signatures) over our kernels.

Within one NVLink node (1 to 8 ranks, any count), the dispatch and combine of DeepEP 2.1 run on
``kernels/cuda/elastic.cu`` over CUDA IPC: no NCCL, no GIN, no RDMA. What one node cannot offer
(hybrid / RDMA mode across hosts, Engram, pipeline-parallel send/recv, AGRS, QPs, a CPU buffer)
is refused with an error that names the feature and what to use instead. The checks live in Rust
(``kernels/src/elastic/checks.rs``); this module keeps DeepEP's signatures, the handle and the
torch-side stream bookkeeping. docs/python.md ("DeepEP V2: ElasticBuffer") lists what is
supported, what is refused and how it differs from DeepEP 2.1.
"""

from __future__ import annotations

import contextlib
import socket
import weakref
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import _native
from .buffer import _current_raw_stream, _torch
from .utils.event import EventHandle, EventOverlap

__all__ = ["ElasticBuffer", "EPHandle"]

_DESTROYED = "this ElasticBuffer was destroyed; create a new one"


def _refused(feature: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"deepep_kernels.ElasticBuffer serves one NVLink node: {feature} is not available; {instead}")


class EPHandle:
    """Communication handle returned by ``ElasticBuffer.dispatch``; reused by a cached dispatch
    (``handle=``) and consumed by ``combine``.

    Attributes (DeepEP 2.1's):
        do_expand: whether the expanded layout (one row per token x local expert) was used.
        num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
        topk_idx: ``[num_tokens, num_topk]`` ``torch.int64``: a copy of the dispatch's ``topk_idx``
            (``do_handle_copy=True``) or the caller's tensor itself.
        num_recv_tokens: tokens received (exact with CPU sync, else the worst case
            ``num_ranks * num_max_tokens_per_rank``).
        num_expanded_tokens: rows of the expanded layout (exact with CPU sync, else the worst
            case; 0 for the plain layout).
        num_recv_tokens_per_expert_list: with CPU sync, each local expert's received count padded
            to ``expert_alignment`` (a Python list); an empty list without CPU sync.
        psum_num_recv_tokens_per_scaleup_rank: ``[num_ranks]`` ``torch.int``, inclusive prefix sum
            of the tokens received from each rank; the last element is the total.
        psum_num_recv_tokens_per_expert: ``[num_local_experts]`` ``torch.int``: plain layout, the
            inclusive prefix sum of the aligned counts; expanded, expert ``i``'s first row plus its
            count (``psum[i] - align(psum[i-1])`` is the count).
        num_unaligned_recv_tokens_per_expert: ``[num_local_experts]`` ``torch.int``, the counts.
        recv_src_metadata: ``[rows, num_topk + 2]`` ``torch.int``: per received token its source's
            global token index (``rank * num_max_tokens_per_rank + i``), its combine slot, and per
            top-k slot the row it went to (expanded; -1 if none) or the token's row (plain; -1 if
            the slot selects no expert here). Settable (callers slice it).
        dst_buffer_slot_idx: ``[num_tokens, num_topk]`` ``torch.int``: per top-k slot the token's
            position in the stream to the expert's rank (-1: no expert).
        token_metadata_at_forward, channel_linked_list: hybrid mode only: always None here.
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int,
                 topk_idx: Any, num_recv_tokens: int, num_expanded_tokens: int, num_recv_tokens_per_expert_list: list,
                 psum_num_recv_tokens_per_scaleup_rank: Any, psum_num_recv_tokens_per_expert: Any,
                 num_unaligned_recv_tokens_per_expert: Any, recv_src_metadata: Any, dst_buffer_slot_idx: Any,
                 token_metadata_at_forward: Optional[Any], channel_linked_list: Optional[Any]) -> None:
        if topk_idx is None:
            raise ValueError("EPHandle needs topk_idx")
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        # the kernels' routing plan (dst_buffer_slot_idx is its first num_tokens * num_topk
        # elements) and a weak reference to the buffer that made the handle
        self._plan = None
        self._owner = None

    def _made_by(self, buffer: "ElasticBuffer") -> bool:
        return self._owner is not None and self._owner() is buffer


class ElasticBuffer:
    """DeepEP 2.1's ``ElasticBuffer`` for one NVLink node (see the module documentation).

    Attributes (DeepEP 2.1's): ``group``, ``rank_idx``, ``num_ranks``, ``allow_hybrid_mode``,
    ``allow_multiple_reduction``, ``prefer_overlap_with_compute``, ``deterministic``,
    ``num_bytes``, ``num_max_tokens_per_rank``, ``num_allocated_qps`` (always 0: no RDMA),
    ``num_scaleout_ranks`` (1), ``num_scaleup_ranks`` (the group size), ``scaleout_rank_idx`` (0),
    ``scaleup_rank_idx`` (the rank), ``num_rdma_ranks`` (1), ``num_nvlink_ranks`` (the group
    size), ``explicitly_destroy``.
    """

    def __init__(self, group: Any, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        """Create the buffer collectively on every rank of ``group`` (one NVLink node).

        Arguments:
            group: the ``torch.distributed`` process group (1 to 8 ranks on one host).
            num_bytes: bytes per rank; None: ``get_buffer_size_hint`` of the MoE settings below.
            num_cpu_bytes: must be 0 (no CPU buffer: Engram storage is not offered).
            num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch: the sizes the buffer is
                made for (``num_topk=0`` sizes for ``max(group size, 8)``); also the dispatch default
                of ``num_max_tokens_per_rank``.
            deterministic: accepted; the outputs are always in a deterministic order (by source
                rank, then source token).
            allow_hybrid_mode: accepted (hybrid mode is a multi-host feature).
            allow_multiple_reduction: expanded combine sums each rank's expert rows first
                (rounded to bfloat16 once per rank), as DeepEP; False: one reduction at the origin.
            prefer_overlap_with_compute: ``get_theoretical_num_sms`` suggests fewer SMs.
            sl_idx: the RDMA service level (0 to 15): accepted and unused (no RDMA here).
            num_allocated_qps: must be 0 (no RDMA queue pairs).
            num_cpu_timeout_secs, num_gpu_timeout_secs: bounds of the host and GPU waits.
            explicitly_destroy: then ``destroy()`` must be called; else the buffer is released
                when garbage-collected.
        """
        if num_cpu_bytes:
            raise _refused(f"a CPU buffer (num_cpu_bytes={num_cpu_bytes}, for Engram storage)", "pass num_cpu_bytes=0, or use DeepEP 2.x with NCCL GIN for Engram")
        if num_allocated_qps:
            raise _refused(f"RDMA queue pairs (num_allocated_qps={num_allocated_qps})", "pass num_allocated_qps=0 (NVLink needs none), or use DeepEP 2.x for RDMA")
        if not isinstance(sl_idx, int) or not 0 <= sl_idx <= 15:
            raise ValueError(f"sl_idx={sl_idx!r} is not an InfiniBand service level (0 to 15); it is unused within one NVLink node")
        torch = _torch()
        import torch.distributed as dist

        if not torch.cuda.is_available():
            raise RuntimeError("deepep_kernels.ElasticBuffer needs a CUDA device (torch.cuda.is_available() is False)")
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = size = group.size()
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.num_allocated_qps = 0
        self._device_index = torch.cuda.current_device()
        self._device = torch.device("cuda", self._device_index)

        def all_gather_object(obj):
            out = [None] * size
            dist.all_gather_object(out, obj, group)
            return out

        where = [tuple(w) for w in all_gather_object((socket.gethostname(), self._device_index))]
        num_hosts, _, _, _, _, ranks_per_gpu = _native.group_layout(where, self.rank_idx, False)
        if num_hosts > 1:
            raise _refused(f"a group over {num_hosts} hosts (DeepEP's hybrid RDMA / scale-out mode)",
                           "use DeepEP 2.x with NCCL GIN across hosts, or deepep_kernels.Buffer (DeepEP V1's API, internode mode)")
        if num_bytes is None:
            num_bytes = _native.elastic_buffer_size_hint(size, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.runtime = _native.ElasticRuntime(self._device_index, self.rank_idx, size,
                                              lambda data: [bytes(x) for x in all_gather_object(bytes(data))],
                                              ranks_per_gpu, num_bytes, float(num_gpu_timeout_secs), float(num_cpu_timeout_secs))
        self._comm_raw = self.runtime.comm_stream()
        self._comm_obj = None
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        torch.cuda.synchronize()
        group.barrier()
        torch.cuda.synchronize()

    # --- lifecycle and helpers -----------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffer (collectively). Needs ``explicitly_destroy=True`` at construction, as
        in DeepEP; later calls raise."""
        assert self.explicitly_destroy, "destroy() needs explicitly_destroy=True at construction (else the buffer is released when garbage-collected)"
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None

    def _rt(self):
        if self.runtime is None:
            raise RuntimeError(_DESTROYED)
        return self.runtime

    def _comm_stream(self):
        if self._comm_obj is None:
            self._comm_obj = _torch().cuda.ExternalStream(self._comm_raw, device=self._device)
        return self._comm_obj

    def _alloc_ctx(self, allocate_on_comm_stream: bool):
        return _torch().cuda.stream(self._comm_stream()) if allocate_on_comm_stream else contextlib.nullcontext()

    def _finish(self, ev: Any, async_with_compute_stream: bool, allocate_on_comm_stream: bool, inputs: Sequence[Any],
                outputs: Sequence[Any]) -> EventOverlap:
        """The call's EventOverlap, and the stream records that keep its tensors' memory until its
        kernels ran (DeepEP's ``record_stream``)."""
        torch = _torch()
        if allocate_on_comm_stream:
            cur = torch.cuda.current_stream(self._device)
            for t in outputs:
                if isinstance(t, torch.Tensor):
                    t.record_stream(cur)
        if ev is None:
            return EventOverlap(None)
        comm = self._comm_stream()
        for t in (inputs if allocate_on_comm_stream else (*inputs, *outputs)):
            if isinstance(t, torch.Tensor):
                t.record_stream(comm)
        return EventOverlap(EventHandle(ev))

    @staticmethod
    def _event(e: Optional[EventHandle]):
        if e is None:
            return None
        if not isinstance(e, (EventHandle, EventOverlap)):
            raise TypeError(f"expected an EventHandle (from ElasticBuffer.capture()), got {type(e).__name__}")
        inner = e.event
        return inner.event if isinstance(inner, EventHandle) else inner

    # --- statics and queries -----------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True) -> int:
        """Bytes per rank (a multiple of 2 MiB) for dispatches of up to ``num_max_tokens_per_rank``
        tokens of ``hidden`` channels and top-``num_topk`` (0: ``max(group size, 8)``) and their
        combines. The last two arguments do not change the size here."""
        return _native.elastic_buffer_size_hint(group.size(), num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (for ``previous_event``)."""
        return EventHandle()

    def get_comm_stream(self):
        """The communication stream (a ``torch.cuda.ExternalStream``) the kernels run on."""
        self._rt()
        return self._comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(RDMA ranks, NVLink ranks)``: ``(1, group size)`` on one node."""
        return 1, self.num_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(scale-out ranks, scale-up ranks)``: ``(1, group size)`` on one node."""
        return 1, self.num_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0, rdma_gbs: float = 0,
                                nvlink_gbs: float = 0, sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """The SM count dispatch and combine use by default: this rank's SMs (its share when ranks
        share a GPU), at most 32 (16 with ``prefer_overlap_with_compute``), even, at least 2. The
        bandwidth arguments are accepted for DeepEP's signature and not used."""
        if num_scaleout_topk:
            raise ValueError("num_scaleout_topk is reserved in DeepEP 2.1 and must be 0")
        cap = 16 if self.prefer_overlap_with_compute else 32
        n = min(self._rt().num_sms(), cap)
        return max(2, n - n % 2)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """0: NVLink needs no RDMA queue pairs (``num_allocated_qps`` is 0)."""
        return 0

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A GPU barrier over every rank, on the comm stream (else the current stream); with
        ``with_cpu_sync`` the host waits for it (bounded). ``sequential`` is accepted (one barrier
        kernel either way)."""
        rt = self._rt()
        if with_cpu_sync:
            _torch().cuda.synchronize(self._device)
        rt.barrier(0 if use_comm_stream else _current_raw_stream(self._device_index), with_cpu_sync)

    # --- what one node does not offer ------------------------------------------------------------
    @staticmethod
    def get_engram_storage_size_hint(*args: Any, **kwargs: Any) -> int:
        raise _refused("Engram (remote KV-cache fetch over RDMA)", "use DeepEP 2.x with NCCL GIN")

    @staticmethod
    def get_pp_buffer_size_hint(*args: Any, **kwargs: Any) -> int:
        raise _refused("pipeline-parallel send/recv", "use torch.distributed send/recv (NCCL P2P) or DeepEP 2.x")

    @staticmethod
    def get_agrs_num_max_session_bytes(*args: Any, **kwargs: Any) -> int:
        raise _refused("AGRS (all-gather / reduce-scatter sessions)", "use torch.distributed all_gather_into_tensor / reduce_scatter_tensor, or DeepEP 2.x")

    get_agrs_buffer_size_hint = get_agrs_num_max_session_bytes

    def engram_write(self, *args: Any, **kwargs: Any) -> None:
        raise _refused("Engram (remote KV-cache fetch over RDMA)", "use DeepEP 2.x with NCCL GIN")

    engram_fetch = engram_write

    def pp_set_config(self, *args: Any, **kwargs: Any) -> None:
        raise _refused("pipeline-parallel send/recv", "use torch.distributed send/recv (NCCL P2P) or DeepEP 2.x")

    pp_send = pp_recv = pp_set_config

    def create_agrs_session(self, *args: Any, **kwargs: Any) -> None:
        raise _refused("AGRS (all-gather / reduce-scatter sessions)", "use torch.distributed all_gather_into_tensor / reduce_scatter_tensor, or DeepEP 2.x")

    destroy_agrs_session = agrs_new_session = agrs_set_config = agrs_get_inplace_tensor = all_gather = create_agrs_session

    # --- dispatch and combine ------------------------------------------------------------------
    def dispatch(self, x: Union[Any, Tuple[Any, Any]], topk_idx: Optional[Any] = None, topk_weights: Optional[Any] = None,
                 cumulative_local_expert_recv_stats: Optional[Any] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None, num_sms: int = 0,
                 num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """Send every token to the ranks of its experts.

        Arguments:
            x: ``[num_tokens, hidden]`` ``torch.bfloat16``, or ``(x, sf)`` with ``x``
                ``torch.float8_e4m3fn`` and ``sf`` ``[num_tokens, num_packs]`` 4-byte scale packs
                (``torch.float`` or ``torch.int``, any strides), passed through as they are.
            topk_idx: ``[num_tokens, num_topk]`` ``torch.int64`` expert ids (-1: none); None with
                ``handle``.
            topk_weights: ``[num_tokens, num_topk]`` ``torch.float``, passed through (optional).
            cumulative_local_expert_recv_stats: ``[num_local_experts]`` ``torch.int``: each local
                expert's received count is added (fresh dispatches).
            num_experts: all experts (a multiple of the group size); from ``handle`` if given.
            num_max_tokens_per_rank: the most tokens any rank dispatches in this call (the same on
                every rank); default: the constructor's, or the handle's.
            expert_alignment: pad each local expert's row count to a multiple (default 1).
            num_sms: SMs to use (0: ``get_theoretical_num_sms``).
            num_qps: must be 0 (no RDMA).
            previous_event: the kernels wait for it (else for the current stream).
            previous_event_before_epilogue: the copy into the outputs also waits for it.
            async_with_compute_stream: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate the outputs on the comm stream.
            handle: a handle of an earlier dispatch with the same routing (cached dispatch: no
                routing work and no CPU sync; the handle itself is returned).
            do_handle_copy: the handle keeps a copy of ``topk_idx`` (else the caller's tensor).
            do_cpu_sync: wait on the host for the received counts to size the outputs exactly
                (default True without ``handle``); False: worst-case sizes, counts on the GPU only
                (CUDA-graph capturable).
            do_expand: one row per (token, local expert), grouped by expert, each expert padded to
                ``expert_alignment``.
            do_zero_padding: zero the expanded layout's padding rows.
            use_tma_aligned_col_major_sf: received scale packs column-major, rows padded to 4.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_x`` like ``x``
            (a tuple for FP8); ``recv_topk_idx`` ``[rows, num_topk]`` ``torch.int64`` local expert
            ids (-1: not here), None when expanded; ``recv_topk_weights`` ``[rows, num_topk]`` (plain)
            or ``[rows]`` (expanded) ``torch.float``, None without ``topk_weights``; the handle;
            an ``EventOverlap`` (its event is None unless ``async_with_compute_stream``).
        """
        rt = self._rt()
        if num_qps:
            raise _refused(f"RDMA queue pairs (num_qps={num_qps})", "pass num_qps=0 (get_theoretical_num_qps returns 0 here)")
        x, sf = x if isinstance(x, tuple) else (x, None)
        cached = None
        if handle is not None:
            if not isinstance(handle, EPHandle) or not handle._made_by(self):
                raise ValueError("handle must be an EPHandle returned by a dispatch on this ElasticBuffer")
            if topk_idx is not None:
                raise ValueError("a cached dispatch (handle=...) takes its topk_idx from the handle: pass topk_idx=None")
            if do_cpu_sync:
                raise ValueError("a cached dispatch (handle=...) cannot do a CPU sync: its sizes come from the handle; pass do_cpu_sync=None or False")
            settings = (num_experts, expert_alignment, num_max_tokens_per_rank)
            mine = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            if any(a is not None and a != b for a, b in zip(settings, mine)):
                raise ValueError(f"(num_experts, expert_alignment, num_max_tokens_per_rank)={settings} differ from the handle's {mine}; "
                                 "pass None or the handle's values")
            num_experts, expert_alignment, num_max_tokens_per_rank = mine
            topk_idx = handle.topk_idx
            do_cpu_sync = False
            rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
            cached = (handle._plan, handle.psum_num_recv_tokens_per_scaleup_rank, handle.psum_num_recv_tokens_per_expert,
                      handle.num_unaligned_recv_tokens_per_expert, handle.recv_src_metadata, handle.do_expand, rows)
        elif topk_idx is None:
            raise ValueError("dispatch needs topk_idx (or handle= of an earlier dispatch)")
        if num_experts is None:
            raise ValueError("dispatch needs num_experts (or handle=)")
        num_max_tokens_per_rank = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        expert_alignment = 1 if expert_alignment is None else expert_alignment
        do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        num_sms = num_sms or self.get_theoretical_num_sms(num_experts, topk_idx.shape[1])
        stream = _current_raw_stream(self._device_index)  # the caller's, read before the allocation stream is made current
        with self._alloc_ctx(bool(allocate_on_comm_stream)):
            recv_x, recv_sf, recv_idx, recv_w, parts, ev = rt.dispatch(
                x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats, cached, num_experts, num_max_tokens_per_rank,
                expert_alignment, num_sms, bool(do_expand), bool(do_zero_padding), do_cpu_sync, bool(do_handle_copy),
                bool(use_tma_aligned_col_major_sf), self._event(previous_event), self._event(previous_event_before_epilogue),
                bool(async_with_compute_stream), stream)
        if parts is not None:
            plan, copy, psum_rank, psum_expert, unaligned, meta, num_recv, num_expanded, per_expert = parts
            n, k = topk_idx.shape
            handle = EPHandle(do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms,
                              copy if copy is not None else topk_idx, num_recv, num_expanded, per_expert, psum_rank, psum_expert,
                              unaligned, meta, plan[:n * k].view(n, k), None, None)
            handle._plan = plan
            handle._owner = weakref.ref(self)
        out_tensors = (recv_x, recv_sf, recv_idx, recv_w)
        event = self._finish(ev, async_with_compute_stream, allocate_on_comm_stream,
                             (x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats), out_tensors)
        return (recv_x, recv_sf) if recv_sf is not None else recv_x, recv_idx, recv_w, handle, event

    def combine(self, x: Any, handle: EPHandle, topk_weights: Optional[Any] = None,
                bias: Union[Any, Tuple[Any, Any], None] = None, num_sms: int = 0, num_qps: int = 0,
                previous_event: Optional[EventHandle] = None, previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Send every received row back to its token's rank and reduce there.

        Arguments:
            x: ``[rows, hidden]`` ``torch.bfloat16``: one row per received token (plain handle) or
                per expanded row (expanded handle).
            handle: the ``EPHandle`` of the dispatch.
            topk_weights: ``[rows, num_topk]`` (plain) or ``[rows]`` (expanded) ``torch.float``,
                passed back through to ``combined_topk_weights`` (never multiplied in).
            bias: None, one or two ``[num_tokens, hidden]`` ``torch.bfloat16`` tensors added in
                float32 before the rows.
            num_sms: SMs to use (0: the handle's).
            num_qps: must be 0 (no RDMA).
            previous_event, previous_event_before_epilogue, async_with_compute_stream,
                allocate_on_comm_stream: as in ``dispatch``.

        Returns:
            ``(combined_x, combined_topk_weights, event)``: ``[num_tokens, hidden]``
            ``torch.bfloat16`` (float32 sum of the biases, then the rows in top-k slot order, one
            rounding, as DeepEP 2.1), ``[num_tokens, num_topk]`` ``torch.float`` (None without
            ``topk_weights``), and an ``EventOverlap``.
        """
        rt = self._rt()
        if num_qps:
            raise _refused(f"RDMA queue pairs (num_qps={num_qps})", "pass num_qps=0 (get_theoretical_num_qps returns 0 here)")
        if not isinstance(handle, EPHandle) or not handle._made_by(self):
            raise ValueError("handle must be an EPHandle returned by a dispatch on this ElasticBuffer")
        bias_0, bias_1 = None, None
        if isinstance(bias, tuple):
            if len(bias) != 2:
                raise ValueError(f"bias must be None, a tensor or a tuple of two tensors, got a tuple of {len(bias)}")
            bias_0, bias_1 = bias
        elif bias is not None:
            bias_0 = bias
        stream = _current_raw_stream(self._device_index)  # the caller's, read before the allocation stream is made current
        with self._alloc_ctx(bool(allocate_on_comm_stream)):
            out, out_w, ev = rt.combine(x, topk_weights, bias_0, bias_1, handle.recv_src_metadata,
                                        handle.psum_num_recv_tokens_per_scaleup_rank, handle.topk_idx, handle._plan,
                                        handle.num_experts, handle.num_max_tokens_per_rank, bool(handle.do_expand),
                                        bool(self.allow_multiple_reduction), num_sms or handle.num_sms, self._event(previous_event),
                                        self._event(previous_event_before_epilogue), bool(async_with_compute_stream), stream)
        event = self._finish(ev, async_with_compute_stream, allocate_on_comm_stream, (x, topk_weights, bias_0, bias_1), (out, out_w))
        return out, out_w, event
