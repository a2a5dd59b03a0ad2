"""``Buffer``: DeepEP v1.2.1's ``deep_ep.Buffer`` over the deepep-nix kernels.

Same names, arguments, return tuples and semantics as DeepEP's ``deep_ep/buffer.py`` for what
Megatron-LM (``fused_a2a.py``), vLLM and SGLang use; anything not supported raises
``NotImplementedError`` naming it. Each dispatch, combine or layout is one call into the native
``Runtime`` (python/src/runtime.rs), the binding of the kernels crate's rank context: it checks the
tensors as they are (python/src/doorway.rs, kernels/src/args.rs), sizes the buffers, joins the
streams, launches and returns every output as a torch tensor. This file keeps DeepEP's signatures,
the choices only torch knows (CUDA-graph capture, ``allocate_on_comm_stream``) and the
``EventOverlap`` bookkeeping. docs/python.md ("Semantics") says which stream each call runs on,
what the outputs are (owned tensors, arena leases, views of the low-latency buffer halves) and how
the internode mode differs.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Any, Callable, List, Optional, Tuple, Union

from . import _native
from .config import Config
from .utils import EventHandle, EventOverlap

# The hidden size the NVLink buffer is first sized for when get_dispatch_layout runs before any
# dispatch (a dispatch with another hidden re-creates it, collectively).
DEFAULT_HIDDEN_ENV = "DEEPEP_KERNELS_HIDDEN"
# Opt-in: intranode dispatch returns views of the NVLink buffer instead of torch-owned copies.
DISPATCH_VIEWS_ENV = _native.DISPATCH_VIEWS_ENV
# Bytes of the intranode receive arena that owned dispatch outputs are written into directly (no
# second pass): "auto" (the default: twice the fixed receive region), a byte count, or 0 (no
# arena: the outputs are copied out of the NVLink buffer, the path before the arena).
RECV_ARENA_ENV = _native.RECV_ARENA_ENV
# Testing on one machine: treat every K consecutive ranks as one host (internode mode on one host).
RANKS_PER_HOST_ENV = _native.RANKS_PER_HOST_ENV
# DeepEP's NUM_MAX_NVL_PEERS: GPUs per host assumed by Config.get_rdma_buffer_size_hint.
NUM_MAX_NVL_PEERS = _native.NUM_MAX_NVL_PEERS


# The settings above are read and checked in Rust (python/src/settings.rs), naming the fix.
ranks_per_host_from_env = _native.ranks_per_host_from_env  # (world, environ=None) -> Optional[int]

# SM count assumed by get_low_latency_rdma_size_hint when no GPU is visible (H100/H200).
_DEFAULT_LL_GRID = 132


_RAW_STREAM = None


def _current_raw_stream(device_index: int) -> int:
    """The raw ``CUstream`` of torch's current stream on ``device_index``, without building a
    ``torch.cuda.Stream`` object (microseconds per call on a path that runs every decode step);
    torch's reader is looked up once."""
    global _RAW_STREAM
    if _RAW_STREAM is None:
        torch = _torch()
        _RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda i: torch.cuda.current_stream(i).cuda_stream)
    return _RAW_STREAM(device_index)


_TORCH = None


def _torch():
    global _TORCH
    if _TORCH is not None:
        return _TORCH
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised only where torch is missing
        raise ImportError("deepep_kernels.Buffer needs PyTorch (torch with CUDA) at run time; install torch first") from e
    _TORCH = torch
    return torch


def _dim(t, i: int) -> Optional[int]:
    """``t.shape[i]`` for sizing outputs before the native call, None when ``t`` has no such
    dimension (the native call then refuses ``t``, naming what is wrong)."""
    try:
        return int(t.shape[i])
    except (AttributeError, IndexError, TypeError):
        return None


class DeviceError(RuntimeError):
    """A kernel of this Buffer recorded an error in its host-mapped record. The CUDA context
    survives (unless ``DEEPEP_KERNELS_TRAP_ON_ERROR=1``); the subclass says what the Buffer can
    still do: :class:`DeviceArgumentError` (bad input, dropped; the Buffer stays usable) or
    :class:`PeerTimeoutError` (a peer stopped answering; the Buffer cannot be used again). A plain
    ``DeviceError`` is another failed device-side check (ranks that disagree about a call) and is
    as final as a timeout. Kernels run asynchronously: the error is raised by the next call on a
    Buffer (or by the call itself where the host waits for the GPU, e.g. a fresh intranode
    dispatch), or by :func:`check_device_error`."""


class DeviceArgumentError(DeviceError, ValueError):
    """A routing id in ``topk_idx`` points nowhere (``< -1`` or ``>= num_experts``). The kernel
    treated that selection as ``-1`` (no expert), dropped nothing else, and completed the call
    with its peers; the message names the call, ``topk_idx[token, slot]`` of the first bad id,
    its value and the valid range. Raised once (the record is cleared); the Buffer and the CUDA
    context stay usable. Fix the router output, or mask such ids to -1."""


class PeerTimeoutError(DeviceError):
    """A bounded GPU wait expired (``DEEPEP_GPU_TIMEOUT_MS``, default 5000): the message names this
    rank, the call, the rank it waited for, the phase and channel. That rank probably died or
    stopped calling. Raised by every later call on this Buffer until it is destroyed or dropped;
    drop it (``del``, or ``destroy()`` with ``explicitly_destroy=True``) and create a new Buffer on
    a group of the ranks that remain: the error belongs to the Buffer whose kernel recorded it, so
    the new Buffer starts clean. The CUDA context survives (unless
    ``DEEPEP_KERNELS_TRAP_ON_ERROR=1``)."""


_native._register_error_types(DeviceError, DeviceArgumentError, PeerTimeoutError)
# Raise what a kernel of any live Buffer of this process recorded, if anything (python/src/lib.rs):
# DeviceArgumentError once (the record is cleared), PeerTimeoutError or DeviceError every time until
# that Buffer is destroyed or dropped. The Buffer methods look at their own Buffer's record only.
check_device_error = _native.check_device_error

# (max ranks per host, max top-k, max experts) of the internode kernels.
_INTERNODE_LIMITS = _native.INTERNODE_LIMITS


def _checked(method):
    """Raise what this Buffer's kernels recorded before the method runs (one look at this Buffer's
    own record: ``Runtime.check_error``); if the method fails while this Buffer holds a fatal record
    (a host wait that ended because a kernel timed out), raise the recorded cause
    (:class:`PeerTimeoutError` / :class:`DeviceError`) instead of the bare error."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        rt = getattr(self, "_runtime", None)
        if rt is not None:
            rt.check_error()
        try:
            return method(self, *args, **kwargs)
        except DeviceError:
            raise
        except Exception as e:
            _raise_recorded_cause(self, e)
            raise

    return wrapper


def _raise_recorded_cause(buf, e: Exception) -> None:
    """The failure path of :func:`_checked`: a call that failed while ``buf`` holds a fatal record
    raises the recorded cause instead (chained to ``e``)."""
    rt = getattr(buf, "_runtime", None)
    cause = rt.recorded_cause() if rt is not None else None
    if cause is not None:
        raise cause from e


# What a call without async_finish returns as its event (DeepEP returns an EventOverlap without an
# event; one shared instance saves an object per call: it holds nothing).
_NO_EVENT = EventOverlap(None)

_DESTROYED = "this Buffer was destroyed; create a new one"


def _unsupported(name: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"deepep_kernels does not support {name}: {why}")


# The handles, indexable like DeepEP v1.2.1's handle tuples (python/src/handles.rs).
Handle = _native.Handle
InternodeHandle = _native.InternodeHandle
LowLatencyHandle = _native.LowLatencyHandle


class Buffer:
    """DeepEP's ``Buffer``: the communication buffers of one rank of ``group`` for expert-parallel
    dispatch and combine.

    - normal mode, within one host: intranode (NVLink) dispatch/combine, needs ``num_nvl_bytes``;
    - normal mode, across hosts (or hosts emulated with ``DEEPEP_KERNELS_RANKS_PER_HOST``):
      internode (two-hop, NVSHMEM) dispatch/combine, needs ``num_rdma_bytes``;
    - low-latency mode (``low_latency_mode=True``): low-latency dispatch/combine over NVSHMEM,
      needs ``num_rdma_bytes`` from :meth:`get_low_latency_rdma_size_hint`.

    Errors a kernel records (a bad routing id, a peer that stopped answering) belong to this Buffer:
    its next call raises them, and dropping it (garbage collection, ``del``, or ``destroy()``)
    retires them, so a new Buffer on the ranks that remain starts clean.
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm=None) -> None:
        """Create this rank's Buffer (collective over ``group``: every rank calls it).

        Arguments:
            group: the ``torch.distributed`` process group of the EP ranks (or None with ``comm``).
            num_nvl_bytes: int, bytes of the NVLink buffer of the intranode normal mode
                (:meth:`Config.get_nvl_buffer_size_hint`); 0 without that mode.
            num_rdma_bytes: int, bytes of the NVSHMEM symmetric buffer: the low-latency buffer
                (:meth:`get_low_latency_rdma_size_hint`) or the internode one
                (:meth:`Config.get_rdma_buffer_size_hint`); 0 within one host in normal mode.
            low_latency_mode: bool, whether this Buffer serves the low-latency calls.
            num_qps_per_rank: int > 0, NVSHMEM queue pairs per peer (``NVSHMEM_IBGDA_NUM_RC_PER_PE``).
            allow_nvlink_for_low_latency_mode: bool, whether NVSHMEM may use NVLink (P2P).
            allow_mnnvl: bool, whether NVSHMEM may use multi-node NVLink.
            explicitly_destroy: bool, whether the caller releases the buffers with :meth:`destroy`
                (else they are released when the Buffer is garbage-collected).
            comm: an mpi4py-like communicator (``Get_rank``, ``Get_size``, ``allgather``) instead of
                ``group``.
        """
        # Everything checkable without torch or a GPU comes first.
        if not isinstance(num_nvl_bytes, int) or num_nvl_bytes < 0:
            raise ValueError(f"num_nvl_bytes={num_nvl_bytes!r} must be a non-negative int (bytes of the NVLink buffer)")
        if not isinstance(num_rdma_bytes, int) or num_rdma_bytes < 0:
            raise ValueError(f"num_rdma_bytes={num_rdma_bytes!r} must be a non-negative int (bytes of the low-latency buffer)")
        if low_latency_mode and num_qps_per_rank <= 0:
            raise ValueError(f"num_qps_per_rank={num_qps_per_rank} must be > 0 in low-latency mode")
        if group is None and comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self._dispatch_views = _native.dispatch_views_from_env()
        # owned intranode outputs go into the receive arena when it has room (off: copied out, the
        # path before the arena; bench.py measures both)
        self._use_arena = True
        # the internode layout by the layout kernel where it serves the group (off: the torch path
        # that groups of more than 8 ranks take; tests use it to run that path)
        self._layout_kernel = True
        self._runtime = None
        self._comm_stream_obj = None
        self.explicitly_destroy = explicitly_destroy
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode

        torch = _torch()
        # The exchange closures the native Runtime keeps must not refer to this Buffer: a cycle
        # through the native object would keep the Buffer (and its error record) alive after the
        # caller dropped it.
        if group is not None:
            import torch.distributed as dist

            self.rank = group.rank()
            self.group = group
            self.group_size = size = group.size()

            def all_gather_object(obj):
                out = [None] * size
                dist.all_gather_object(out, obj, group)
                return out
        else:
            self.rank = comm.Get_rank()
            self.group = comm
            self.group_size = comm.Get_size()

            def all_gather_object(obj):
                return comm.allgather(obj)

        self._all_gather_object = all_gather_object
        if not torch.cuda.is_available():
            raise RuntimeError("deepep_kernels.Buffer needs a CUDA device (torch.cuda.is_available() is False)")
        # Device selection is explicit: this rank's GPU is torch's current device (set it with
        # torch.cuda.set_device before creating the Buffer; several ranks may share one GPU).
        self._device_index = torch.cuda.current_device()
        self._device = torch.device("cuda", self._device_index)
        _current_raw_stream(self._device_index)  # looks torch's reader up once (_RAW_STREAM)

        # Where every rank runs (python/src/settings.rs): hosts of the normal mode (the real ones, or
        # K-rank blocks under DEEPEP_KERNELS_RANKS_PER_HOST; a group that spans hosts runs the
        # internode family), this rank's index on its host, and the most ranks that share one GPU
        # (on purpose, for testing: each then sizes its grids to its share of the SMs, so the
        # waiting blocks of all fit at once).
        where = [tuple(w) for w in all_gather_object((socket.gethostname(), self._device_index))]
        self._num_hosts, self._ranks_per_host, self._internode, local_rank, local_world, self._ranks_per_gpu = \
            _native.group_layout(where, self.rank, not low_latency_mode and num_rdma_bytes > 0)
        if low_latency_mode or self._internode:
            # DeepEP sets the same NVSHMEM variables for its internode mode as for low latency; a
            # host library other than the cubins' NVSHMEM release is refused now, with the fix
            _native.prepare_nvshmem(num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl)

        def all_gather_bytes(data: bytes) -> List[bytes]:
            return [bytes(x) for x in all_gather_object(bytes(data))]

        self._runtime = _native.Runtime(
            self._device_index, self.rank, self.group_size, local_rank, local_world, all_gather_bytes, self._ranks_per_gpu
        )
        # the capacity checks and the buffers' (re-)creation are the rank context's
        self._runtime.set_buffer_sizes(num_nvl_bytes, num_rdma_bytes, low_latency_mode, self._ranks_per_host if self._internode else 0,
                                       _native.recv_arena_from_env() if num_nvl_bytes > 0 and not self._internode else None)
        self._comm_stream_raw = self._runtime.comm_stream()  # never changes
        self._intra_ready = False  # the NVLink buffer was created (get_dispatch_layout)
        self._next_combine_buffers: List[Any] = []
        self._next_combine_parity = 0
        # the buffer get_next_low_latency_combine_buffer handed out last (a zero-copy combine reads it)
        self._next_combine_last = None

    # --- helpers -----------------------------------------------------------------------------
    def _rt(self):
        rt = self._runtime
        if rt is None:
            raise RuntimeError(_DESTROYED)
        return rt

    def _cur(self) -> int:
        return _current_raw_stream(self._device_index)

    def _comm_torch_stream(self):
        # one ExternalStream object per Buffer (the comm stream never changes)
        s = self._comm_stream_obj
        if s is None:
            torch = _torch()
            s = self._comm_stream_obj = torch.cuda.ExternalStream(self._comm_stream_raw, device=self._device)
        return s

    @staticmethod
    def _previous(previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
        """The native event the call waits for (None: the comm stream waits for the current
        stream). Like DeepEP, an EventOverlap without an event counts as no previous event."""
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap (from Buffer.capture() or an earlier call), got {type(previous_event).__name__}")
        handle = getattr(previous_event, "event", None)
        if allocate_on_comm_stream and (handle is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True needs a previous_event with an event and async_finish=True (as in DeepEP)")
        return None if handle is None else handle.event

    def _overlap(self, ev, tensors: Tuple[Any, ...]) -> EventOverlap:
        """The EventOverlap of a call: none without ``async_finish`` (the current stream already
        waits); else the event, with the tensors recorded on the comm stream (freed only after the
        call's kernels), as DeepEP's ``record_stream``."""
        if ev is None:
            return _NO_EVENT
        torch = _torch()
        comm = self._comm_torch_stream()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t.record_stream(comm)
        return EventOverlap(EventHandle(ev))

    def _alloc_ctx(self, allocate_on_comm_stream: bool):
        """Where the native call allocates its outputs: the comm stream (DeepEP's
        ``allocate_on_comm_stream``) or the current stream."""
        if allocate_on_comm_stream:
            return _torch().cuda.stream(self._comm_torch_stream())
        import contextlib

        return contextlib.nullcontext()

    def _check_normal_mode(self) -> None:
        """Refuse the normal (intranode) mode where this Buffer cannot run it."""
        if self._num_hosts > 1:
            if self.low_latency_mode:
                raise _unsupported("normal (non-low-latency) dispatch across hosts in a Buffer with low_latency_mode=True",
                                   f"the group spans {self._num_hosts} hosts; create a second Buffer with low_latency_mode=False and "
                                   "num_rdma_bytes from Config.get_rdma_buffer_size_hint for the normal (internode) mode")
            raise ValueError(f"the group spans {self._num_hosts} hosts, so normal dispatch uses the internode mode, which needs "
                             "num_rdma_bytes > 0; create the Buffer with num_rdma_bytes=Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)")
        if self.num_nvl_bytes == 0:
            raise ValueError("this Buffer has num_nvl_bytes=0; create it with num_nvl_bytes from Config.get_nvl_buffer_size_hint for normal dispatch")

    def _arena_ok(self) -> bool:
        """Whether an intranode dispatch may write its rows into a receive-arena region its outputs
        then own (no second pass): not in the views mode, and not under CUDA-graph capture (a replay
        would write the captured region again while the tensors of an earlier replay may still use
        it). The native call also leaves padded (num_worst_tokens) outputs out of the arena."""
        return self._use_arena and not self._dispatch_views and not _torch().cuda.is_current_stream_capturing()

    # --- static API --------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the kernels were compiled for SM90 (Hopper): the embedded cubins are present."""
        return _native.is_sm90_compiled()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count (an even int > 0) of the configs :meth:`get_dispatch_config` and
        :meth:`get_combine_config` return (the default for calls without ``config``)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise ValueError(f"The SM count must be even (and positive), got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream now, to pass as ``previous_event``."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        """Bytes of the low-latency symmetric buffer (``num_rdma_bytes``) for at most
        ``num_max_dispatch_tokens_per_rank`` tokens per rank and call, rows of ``hidden`` bf16
        channels, ``num_ranks`` ranks and ``num_experts`` experts (all ints), on this GPU's SMs
        (132 when no GPU is visible)."""
        grid = _DEFAULT_LL_GRID
        try:
            import torch

            if torch.cuda.is_available():
                grid = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        except ImportError:
            pass
        return _native.ll_buffer_bytes(num_ranks, num_experts, num_max_dispatch_tokens_per_rank, hidden, grid)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's tuned dispatch :class:`Config` for ``num_ranks`` ranks (2 to 160), with
        :attr:`num_sms` SMs."""
        return Config(Buffer.num_sms, *_native.deepep_config(False, num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's tuned combine :class:`Config` for ``num_ranks`` ranks (2 to 160), with
        :attr:`num_sms` SMs."""
        return Config(Buffer.num_sms, *_native.deepep_config(True, num_ranks))

    # --- buffer-level API --------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffers now (collective: every rank calls it; local only after a lost peer).
        Needs ``explicitly_destroy=True``; the Buffer cannot be used afterwards."""
        if not self.explicitly_destroy:
            raise RuntimeError("`explicitly_destroy` flag must be set to call destroy()")
        self._rt().destroy()
        self._runtime = None
        self._comm_stream_obj = None
        self._next_combine_buffers = []
        self._next_combine_last = None

    def get_comm_stream(self):
        """The communication stream (a ``torch.cuda.ExternalStream``) the kernels run on; it first
        waits for the low-latency calls that ran on the callers' streams, so work ordered after it
        sees them as in DeepEP."""
        self._rt().comm_after_ll()
        return self._comm_torch_stream()

    @_checked
    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """This rank's raw NVLink buffer (or, with ``use_rdma_buffer``, the low-latency symmetric
        buffer) from byte ``offset`` as a 1-D tensor of ``dtype`` (a torch dtype), or its first
        ``size.numel()`` elements shaped ``size`` (a ``torch.Size`` or tuple). The view keeps the
        Buffer alive."""
        shape = None if size is None else list(_torch().Size(size))
        return self._rt().local_buffer_tensor(dtype, shape, offset, use_rdma_buffer, self)

    # --- normal mode ---------------------------------------------------------------------------
    @_checked
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Where each token goes, from its top-k experts (on the comm stream).

        Arguments:
            topk_idx: ``[num_tokens, num_topk]`` ``torch.int64``, the experts of each token; -1 is no
                expert (other ids outside ``[0, num_experts)`` are dropped and reported by the next
                call as :class:`DeviceArgumentError`).
            num_experts: int, experts over all ranks (a multiple of the rank count).
            previous_event: an :class:`EventOverlap` to wait for first (else the current stream).
            async_finish: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate the outputs on the comm stream (needs both of the above).

        Returns:
            num_tokens_per_rank: ``[num_ranks]`` ``torch.int32``, tokens sent to each rank.
            num_tokens_per_rdma_rank: ``[num_hosts]`` ``torch.int32`` in the internode mode, else None.
            num_tokens_per_expert: ``[num_experts]`` ``torch.int32``, tokens sent to each expert.
            is_token_in_rank: ``[num_tokens, num_ranks]`` ``torch.bool``, whether a token goes to a rank.
            event: an :class:`EventOverlap` (with an event only with ``async_finish``).
        """
        if self._internode:
            return self._internode_layout(topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream)
        self._check_normal_mode()
        rt = self._rt()
        if not self._intra_ready:
            # the NVLink buffer for the hidden of the dispatches to come (a dispatch with another
            # hidden re-creates it, collectively), once: it then exists until the Buffer goes
            if rt.intranode_dims() is None:
                rt.intranode_ensure(int(os.environ.get(DEFAULT_HIDDEN_ENV, "7168")))
            self._intra_ready = True
        prev = self._previous(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_ctx(allocate_on_comm_stream):
            per_rank, per_expert, in_rank, ev, _ = rt.get_dispatch_layout(topk_idx, num_experts, prev, async_finish, self._cur())
        return per_rank, None, per_expert, in_rank, self._overlap(ev, (topk_idx, per_rank, per_expert, in_rank))

    @_checked
    def dispatch(self, x, handle: Optional[Handle] = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each token to the ranks of its experts (normal mode: intranode within one host,
        internode across hosts), on the comm stream. Fresh with the layout of
        :meth:`get_dispatch_layout`, or cached with the ``handle`` of an earlier dispatch (the same
        routing again, e.g. in a backward pass).

        Arguments:
            x: ``[num_tokens, hidden]`` ``torch.bfloat16``, or a pair (``[num_tokens, hidden]``
                ``torch.float8_e4m3fn``, ``[num_tokens, hidden // 128]`` ``torch.float32`` scales).
            handle: the handle of an earlier dispatch on this Buffer (cached dispatch), or None.
            num_tokens_per_rank: ``[num_ranks]`` ``torch.int32`` (fresh dispatch).
            num_tokens_per_rdma_rank: ``[num_hosts]`` ``torch.int32`` in the internode mode, else None.
            is_token_in_rank: ``[num_tokens, num_ranks]`` ``torch.bool`` (fresh dispatch).
            num_tokens_per_expert: ``[num_experts]`` ``torch.int32`` (fresh dispatch).
            topk_idx: ``[num_tokens, num_topk]`` ``torch.int64`` expert ids (-1: none), or None
                (a dispatch without top-k: rows go by ``is_token_in_rank``).
            topk_weights: ``[num_tokens, num_topk]`` ``torch.float32``, with ``topk_idx``.
            expert_alignment: int >= 1, the received count per local expert is rounded up to it.
            num_worst_tokens: int >= 0, intranode only: pad the outputs to this many rows with no
                host sync (CUDA-graph compatible); 0: as many rows as received.
            config: a :class:`Config` (its ``num_sms``), default :meth:`get_dispatch_config`.
            previous_event: an :class:`EventOverlap` to wait for first (else the current stream).
            async_finish: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate the outputs on the comm stream.

        Returns:
            recv_x: the received rows, like ``x`` (a tensor, or a pair with the
                ``[num_recv_tokens, hidden // 128]`` ``torch.float32`` scales).
            recv_topk_idx: ``[num_recv_tokens, num_topk]`` ``torch.int64`` local expert ids (-1:
                not this rank's), None when cached or without top-k.
            recv_topk_weights: ``[num_recv_tokens, num_topk]`` ``torch.float32``, likewise.
            num_recv_tokens_per_expert_list: list of int, received rows per local expert (aligned);
                empty with ``num_worst_tokens``; None when cached.
            handle: the communication handle for :meth:`combine` (None when cached).
            event: an :class:`EventOverlap` (with an event only with ``async_finish``).
        """
        internode = getattr(self, "_internode", False)
        if num_tokens_per_rdma_rank is not None and not internode:
            raise _unsupported("num_tokens_per_rdma_rank in a Buffer whose group is within one host",
                               "it belongs to the internode mode (a group that spans hosts, or DEEPEP_KERNELS_RANKS_PER_HOST); pass None "
                               "(get_dispatch_layout returns None for it within one host)")
        if internode and num_worst_tokens:
            raise _unsupported("num_worst_tokens in the internode mode",
                               "like DeepEP's internode dispatch, it always syncs with the host for the received count; pass num_worst_tokens=0")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment={expert_alignment!r} must be an int >= 1")
        if num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens={num_worst_tokens} must be >= 0")
        num_sms = Buffer.num_sms if config is None else config.num_sms
        if internode:
            return self._internode_dispatch(x, x_scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_sms,
                                            previous_event, async_finish, allocate_on_comm_stream)
        self._check_normal_mode()
        rt = self._rt()
        prev = self._previous(previous_event, async_finish, allocate_on_comm_stream)
        # one call: the checks of every tensor (dtype, shapes against each other and the handle,
        # contiguity, device), the NVLink buffer for this hidden (collective when it changed), the
        # joins, the launch, the outputs as tensors and the join back (or the event)
        with self._alloc_ctx(allocate_on_comm_stream):
            recv_x, recv_scales, recv_idx, recv_w, counts, h, ev = rt.dispatch(
                x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, handle,
                expert_alignment, num_sms, num_worst_tokens, prev, async_finish, self._cur(), self._arena_ok(), self._dispatch_views)
        if handle is not None:
            ev = self._overlap(ev, (x, x_scales, recv_x, recv_scales))
            return (recv_x, recv_scales) if x_scales is not None else recv_x, None, None, None, None, ev
        ev = self._overlap(ev, (x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank,
                                recv_x, recv_scales, recv_idx, recv_w))
        return (recv_x, recv_scales) if x_scales is not None else recv_x, recv_idx, recv_w, counts, h, ev

    @_checked
    def combine(self, x, handle: Handle, topk_weights=None, bias: Union[Any, Tuple[Any, Any]] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send the expert outputs back to the ranks their tokens came from and sum them per token
        (the reverse of the dispatch whose ``handle`` is given), on the comm stream.

        Arguments:
            x: ``[num_recv_tokens, hidden]`` ``torch.bfloat16``, rows in the order of the dispatch's
                ``recv_x`` (padding rows of ``num_worst_tokens`` take no part).
            handle: the handle of a dispatch on this Buffer.
            topk_weights: ``[num_recv_tokens, num_topk]`` ``torch.float32`` summed per token like
                ``x``, or None.
            bias: None, a ``[num_tokens, hidden]`` ``torch.bfloat16`` tensor, or a pair of them,
                added once per token.
            config: a :class:`Config` (its ``num_sms``), default :meth:`get_combine_config`.
            previous_event: an :class:`EventOverlap` to wait for first (else the current stream).
            async_finish: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate the outputs on the comm stream.

        Returns:
            combined_x: ``[num_tokens, hidden]`` ``torch.bfloat16``, the sum per token.
            combined_topk_weights: ``[num_tokens, num_topk]`` ``torch.float32``, or None.
            event: an :class:`EventOverlap` (with an event only with ``async_finish``).
        """
        num_sms = Buffer.num_sms if config is None else config.num_sms
        prev = self._previous(previous_event, async_finish, allocate_on_comm_stream)
        rt = self._rt()
        with self._alloc_ctx(allocate_on_comm_stream):
            if isinstance(handle, InternodeHandle):
                out, out_w, ev = rt.internode_combine(x, handle, topk_weights, bias, prev, async_finish, self._cur())
            elif isinstance(handle, Handle):
                # one call: the checks of x, topk_weights and bias against the handle (and its
                # buffer generation), the joins, the launch into fresh outputs, the join back
                out, out_w, ev = rt.combine(x, handle, topk_weights, bias, num_sms, prev, async_finish, self._cur())
            else:
                raise TypeError(f"handle must come from a dispatch on this Buffer, got {type(handle).__name__}")
        ev = self._overlap(ev, (x, topk_weights, out, out_w) + (bias if isinstance(bias, tuple) else (bias,)))
        return out, out_w, ev

    # --- internode normal mode (the group spans hosts) ---------------------------------------
    def _internode_layout(self, topk_idx, num_experts: int, previous_event, async_finish: bool, allocate_on_comm_stream: bool):
        """DeepEP's layout for a group that spans hosts, on the comm stream (no host sync): the
        layout kernel (which checks topk_idx, and drops and reports ids that point nowhere) writes
        the per-rank and per-expert counts and the token-to-rank mask, or, for a group it does not
        serve (more than 8 ranks), torch ops leaving such ids out; the per-host counts
        (``num_tokens_per_rdma_rank``) come from the mask. The internode dispatch recomputes its
        routing from ``topk_idx``; these tensors are for the caller (and are checked by dispatch)."""
        torch = _torch()
        r, nh, dev = self.group_size, self._num_hosts, self._device
        rt = self._rt()
        prev = self._previous(previous_event, async_finish, allocate_on_comm_stream)
        cur = self._cur()
        with self._alloc_ctx(allocate_on_comm_stream):
            per_rank, per_expert, in_rank, _, kernel = rt.get_dispatch_layout(topk_idx, num_experts, prev, async_finish, cur,
                                                                              self._layout_kernel, True)
            n = in_rank.shape[0]
            per_host = torch.empty((nh,), dtype=torch.int32, device=dev)
        with torch.cuda.stream(self._comm_torch_stream()):
            if not kernel:
                # a group the layout kernel does not count for (more than 8 ranks): torch ops, ids
                # outside [0, num_experts) left out (the internode dispatch, which routes from
                # topk_idx itself, drops and reports them)
                valid = (topk_idx >= 0) & (topk_idx < num_experts)
                dest = torch.where(valid, topk_idx // (num_experts // r), torch.full_like(topk_idx, r))  # column r: dropped
                mask = torch.zeros((n, r + 1), dtype=torch.bool, device=dev)
                mask.scatter_(1, dest, True)
                in_rank.copy_(mask[:, :r])
                per_rank.copy_(in_rank.sum(0))
                per_expert.zero_().scatter_add_(0, torch.where(valid, topk_idx, 0).flatten(), valid.flatten().to(torch.int32))
            per_host.copy_(in_rank.view(n, nh, r // nh).any(2).sum(0))
        ev = rt.end_call(async_finish, cur)
        return per_rank, per_host, per_expert, in_rank, self._overlap(ev, (topk_idx, per_rank, per_host, per_expert, in_rank))

    def _internode_dispatch(self, x, x_scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_sms, previous_event, async_finish,
                            allocate_on_comm_stream):
        torch = _torch()
        rt = self._rt()
        if x_scales is not None and hasattr(x_scales, "is_contiguous") and not x_scales.is_contiguous():
            # the internode kernels read row-major scales: a column-major tensor is copied (on the
            # current stream, which the comm stream waits for)
            x_scales = x_scales.contiguous()
        with_topk = topk_idx is not None or topk_weights is not None
        if handle is None and not with_topk:
            # DeepEP's dispatch without top-k: rows go to the ranks of is_token_in_rank. The internode
            # kernels route by top-k ids, so route each token to the first local expert of every rank
            # it goes to (one slot per rank, -1 elsewhere); no top-k output comes back, and the
            # per-expert counts come from the ranks' num_tokens_per_expert, as in DeepEP. The layout
            # tensors are checked first (the same native checks), then the routing is made from them.
            r = self.group_size
            _native.check_call("internode_dispatch", {"world": r, "hosts": self._num_hosts, "device": self._device_index}, x, x_scales,
                               None, None, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank)
            if r > _INTERNODE_LIMITS[1]:
                raise _unsupported(f"dispatch without top-k on {r} ranks in the internode mode",
                                   f"it routes one slot per rank and the kernels take at most {_INTERNODE_LIMITS[1]}; pass topk_idx")
            n, local = is_token_in_rank.shape[0], num_tokens_per_expert.shape[0] // r
            first = torch.arange(r, dtype=torch.int64, device=self._device) * local
            topk_idx = torch.where(is_token_in_rank, first.expand(n, r), torch.full((n, r), -1, dtype=torch.int64, device=self._device))
            topk_weights = torch.zeros((n, r), dtype=torch.float32, device=self._device)
            # DeepEP's num_recv_tokens_per_expert_list without top-k comes from every rank's
            # per-expert counts (gathered through the group, a host sync like the dispatch's own)
            expert_counts = self._all_gather_object([int(v) for v in num_tokens_per_expert.tolist()])
        else:
            expert_counts = None
        prev = self._previous(previous_event, async_finish, allocate_on_comm_stream)
        # one call: the checks of every tensor (against each other and the hosts), the internode
        # buffer created or grown (collective), its token capacity, the joins, the launch, the
        # outputs copied into tensors and the join back (or the event)
        with self._alloc_ctx(allocate_on_comm_stream):
            recv_x, recv_scales, recv_idx, recv_w, counts, h, ev = rt.internode_dispatch(
                x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                is_token_in_rank, handle, expert_alignment, num_sms, prev, async_finish, self._cur(), expert_counts)
        if handle is not None:
            return (recv_x, recv_scales) if x_scales is not None else recv_x, None, None, None, None, \
                self._overlap(ev, (x, x_scales, recv_x, recv_scales))
        ev = self._overlap(ev, (x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                num_tokens_per_expert, is_token_in_rank, recv_x, recv_scales, recv_idx, recv_w))
        return (recv_x, recv_scales) if x_scales is not None else recv_x, recv_idx, recv_w, counts, h, ev


    # --- low-latency mode --------------------------------------------------------------------
    @_checked
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Create the low-latency buffer for these sizes (ints: tokens per rank and call, bf16
        channels per row, experts over all ranks) if needed (collective). Our buffer is separate
        from the NVLink one and self-resetting, so nothing else needs cleaning."""
        # the rank context checks the mode and num_rdma_bytes and (re-)creates the buffer collectively
        self._rt().ll_ensure(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Low-latency dispatch (decode): send each token to the ranks of its experts, received
        per local expert in fixed slots of the low-latency buffer. No host sync; CUDA-graph
        compatible.

        Arguments:
            x: ``[num_tokens, hidden]`` ``torch.bfloat16``, ``num_tokens <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[num_tokens, num_topk]`` ``torch.int64`` expert ids (-1: none).
            num_max_dispatch_tokens_per_rank: int, the most tokens any rank sends per call (the
                same on every rank; it sizes the buffer).
            num_experts: int, experts over all ranks.
            cumulative_local_expert_recv_stats: ``[num_local_experts]`` ``torch.int32`` to which the
                received counts are added, or None.
            dispatch_wait_recv_cost_stats: not supported (None).
            use_fp8: cast to ``torch.float8_e4m3fn`` with per-128-channel scales while sending.
            round_scale: round the scales to powers of two (FP8).
            use_ue8m0: UE8M0 scales packed in ``torch.int32`` (FP8, with ``round_scale``).
            async_finish: return an event instead of making the current stream wait.
            return_recv_hook: launch only the send half; the returned hook launches the receive half.

        Returns:
            recv_x: ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``
                ``torch.bfloat16``, or with ``use_fp8`` a pair of that in ``torch.float8_e4m3fn`` and
                its scales (``[num_local_experts, num_ranks * num_max, hidden // 128]``
                ``torch.float32``, or ``hidden // 512`` ``torch.int32`` with UE8M0; column-major
                in the last two dimensions, as DeepEP's). Views of the buffer half this call used:
                valid until the call after next reuses it.
            recv_count: ``[num_local_experts]`` ``torch.int32``, rows received per local expert.
            handle: the communication handle for :meth:`low_latency_combine`.
            event: an :class:`EventOverlap` (with an event only with ``async_finish``).
            hook: the receive half (a callable) with ``return_recv_hook``, else None.
        """
        # @_checked, inlined on the two low-latency calls (they run every decode step): the native
        # call raises a recorded device error first, and a failure while a fatal record is pending
        # raises that record
        try:
            if dispatch_wait_recv_cost_stats is not None:
                raise _unsupported("dispatch_wait_recv_cost_stats", "the kernels record no per-peer wait times; pass None")
            stats = cumulative_local_expert_recv_stats
            rt = self._runtime
            if rt is None:
                raise RuntimeError(_DESTROYED)
            cur = _RAW_STREAM(self._device_index)
            # One crossing into Rust: the checks (x, topk_idx, stats: dtype, shapes, contiguity,
            # device), the buffer for these sizes (created collectively when needed), the comm stream
            # waiting for the current one, the launch and (without async_finish) the current stream
            # waiting for the comm stream, so the caller may reuse x and topk_idx right away (with a
            # hook too: the send half reads them; DeepEP launches a hooked call on the current stream
            # itself); the outputs are cached views of the buffer half. The stats are added on the
            # current stream after that join (DeepEP adds them in its kernel), after the receive half
            # with a hook; with async_finish on the comm stream before the event.
            recv_x, recv_scales, recv_count, handle, native_hook = rt.ll_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, return_recv_hook, stats, cur,
                cur if not async_finish else None)
            if return_recv_hook:
                hook = self._make_hook(native_hook, stats, recv_count)
                if async_finish:
                    return (recv_x, recv_scales) if use_fp8 else recv_x, recv_count, handle, \
                        self._ll_event((x, topk_idx, recv_x, recv_scales, recv_count, stats)), hook
                return (recv_x, recv_scales) if use_fp8 else recv_x, recv_count, handle, _NO_EVENT, hook
            if async_finish:
                if stats is not None:
                    with _torch().cuda.stream(self._comm_torch_stream()):
                        stats.add_(recv_count)
                ev = self._ll_event((x, topk_idx, recv_x, recv_scales, recv_count, stats))
            else:
                if stats is not None:
                    stats.add_(recv_count)
                ev = _NO_EVENT
            return (recv_x, recv_scales) if use_fp8 else recv_x, recv_count, handle, ev, None
        except DeviceError:
            raise
        except Exception as e:
            _raise_recorded_cause(self, e)
            raise

    def _ll_event(self, tensors: Tuple[Any, ...]) -> EventOverlap:
        """The event of a low-latency call with ``async_finish``: recorded on the comm stream after
        it joined the call, the tensors kept alive by the EventOverlap (CUDA-graph safe, as DeepEP)."""
        return EventOverlap(EventHandle(self._rt().end_call(True, 0)), tensors)

    def _make_hook(self, native_hook, stats=None, recv_count=None) -> Callable[[], None]:
        """The receive half of a hooked call: joins the current stream both ways around the launch,
        then adds the dispatch's counts to ``stats`` (when given) on the current stream. Refuses
        (ValueError) once the low-latency buffer of its call was destroyed or re-created."""
        rt = self._rt()

        def hook() -> None:
            cur = self._cur()
            # the Runtime reports this Buffer's recorded error first (a hook is called like a
            # Buffer method) and refuses (ValueError) a hook whose low-latency buffer was destroyed
            # or re-created since its call: its kernel arguments point into freed symmetric memory
            rt.ll_recv(native_hook, cur, cur)
            if stats is not None:
                stats.add_(recv_count)

        return hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False, out=None, combine_wait_recv_cost_stats=None):
        """Low-latency combine (decode): send the expert outputs back to the ranks their tokens came
        from and sum them per token with the top-k weights (the reverse of the dispatch whose
        ``handle`` is given). No host sync; CUDA-graph compatible.

        Arguments:
            x: ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``
                ``torch.bfloat16``, the expert outputs in the slots of the dispatch's ``recv_x``.
            topk_idx: ``[num_tokens, num_topk]`` ``torch.int64``, this rank's ids of the dispatch.
            topk_weights: ``[num_tokens, num_topk]`` ``torch.float32``, the weight of each expert.
            handle: the handle of a low-latency dispatch on this Buffer.
            use_logfmt: not supported (False).
            zero_copy: read the expert outputs from the tensor :meth:`get_next_low_latency_combine_buffer`
                handed out last (``x`` then only has to have its shape).
            async_finish: return an event instead of making the current stream wait.
            return_recv_hook: launch only the send half; the returned hook launches the receive half.
            out: ``[num_tokens, hidden]`` ``torch.bfloat16`` to write into, or None (a new tensor).
            combine_wait_recv_cost_stats: not supported (None).

        Returns:
            combined_x: ``[num_tokens, hidden]`` ``torch.bfloat16``.
            event: an :class:`EventOverlap` (with an event only with ``async_finish``).
            hook: the receive half (a callable) with ``return_recv_hook``, else None.
        """
        try:  # @_checked, inlined (as low_latency_dispatch)
            if use_logfmt:
                raise _unsupported("use_logfmt=True", "the LogFMT combine format is not implemented; combine in bf16 (use_logfmt=False)")
            if combine_wait_recv_cost_stats is not None:
                raise _unsupported("combine_wait_recv_cost_stats", "the kernels record no per-peer wait times; pass None")
            zc = None
            if zero_copy:
                # DeepEP's zero-copy combine reads the expert outputs from the buffer that
                # get_next_low_latency_combine_buffer handed out (x only has to have its shape)
                zc = self._next_combine_last
                if zc is None:
                    raise ValueError("zero_copy=True reads the expert outputs from get_next_low_latency_combine_buffer(handle); "
                                     "call it and write the outputs there first (or pass zero_copy=False)")
            rt = self._runtime
            if rt is None:
                raise RuntimeError(_DESTROYED)
            cur = _RAW_STREAM(self._device_index)
            # one crossing: the checks of the handle, x, topk_idx, topk_weights and out against the
            # handle's dispatch (and of the handle's buffer), out made when None, the joins and the launch
            out, native_hook = rt.ll_combine(x, topk_idx, topk_weights, handle, out, return_recv_hook, cur,
                                             cur if not async_finish else None, zc)
            ev = self._ll_event((x if zc is None else zc, topk_idx, topk_weights, out)) if async_finish else _NO_EVENT
            return out, ev, self._make_hook(native_hook) if return_recv_hook else None
        except DeviceError:
            raise
        except Exception as e:
            _raise_recorded_cause(self, e)
            raise

    @_checked
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle):
        """A ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``
        ``torch.bfloat16`` tensor to write the expert outputs of the dispatch of ``handle`` into and
        pass to ``low_latency_combine(..., zero_copy=True)``. Two are kept and handed out
        alternately (like DeepEP's two buffer halves); the combine reads it in place."""
        torch = _torch()
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError("handle must come from low_latency_dispatch on this Buffer")
        shape = (handle.num_experts // self.group_size, self.group_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        if not self._next_combine_buffers or tuple(self._next_combine_buffers[0].shape) != shape:
            self._next_combine_buffers = [torch.empty(shape, dtype=torch.bfloat16, device=self._device) for _ in range(2)]
        t = self._next_combine_buffers[self._next_combine_parity]
        self._next_combine_parity ^= 1
        self._next_combine_last = t
        return t
