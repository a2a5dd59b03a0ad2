"""Type stubs of ``deepep_kernels._native``, the PyO3 extension (python/src): a thin binding of the
kernels crate's rank context (``deepep_kernels::context::RankContext``, kernels/src/context).

``Tensor`` below is any tensor the doorway (python/src/doorway.rs) reads: a ``torch.Tensor`` (read
by attributes), an object with ``__dlpack__()``, or a DLPack capsule. Every ``Runtime`` method that
takes a ``Tensor`` checks it in Rust (dtype, shape against the other arguments and the handle,
contiguity, device) before anything launches: ``ValueError`` / ``TypeError`` naming the tensor and
the fix; ``check_call`` runs the same checks without a GPU. Every output is a torch tensor made in
Rust (python/src/outputs.rs). ``stream`` arguments are raw ``CUstream`` handles as integers
(``torch.cuda.current_stream().cuda_stream``; 0 is the legacy default stream).

Errors: ``ValueError`` for bad arguments, ``NotImplementedError`` for what the kernels do not
support, ``RuntimeError`` for CUDA / NVSHMEM / rendezvous failures; what a kernel recorded on the
GPU is raised as the ``DeviceError`` classes ``deepep_kernels.buffer`` registers
(``_register_error_types``)."""

from typing import Any, Callable, List, Optional, Tuple, Union

Tensor = Any  # torch.Tensor, a __dlpack__ exporter, or a DLPack capsule
Bias = Union[None, Tensor, Tuple[Optional[Tensor], Optional[Tensor]]]

__version__: str
DEBUG_BUILD: bool  # built with the dev profile (python/scripts/build-wheel.sh --dev): not for timings
RANKS_PER_HOST_ENV: str  # the environment variables python/src/settings.rs reads
DISPATCH_VIEWS_ENV: str
RECV_ARENA_ENV: str
DLPACK_VIEWS_ENV: str  # 1 (default): output views from DLPack capsules; 0: from __cuda_array_interface__
DEFAULT_MAX_TOKENS_ENV: str  # tokens per rank the Config size hints size the buffers for
DEFAULT_MAX_TOKENS: int
NUM_MAX_NVL_PEERS: int  # DeepEP's GPUs per host (8)
INTERNODE_LIMITS: Tuple[int, int, int]  # (max ranks per host, max top-k, max experts) of the internode kernels

class Event:
    """A CUDA event of the primary context (``EventHandle.event``)."""
    @staticmethod
    def recorded_on(stream: int) -> Event:
        """A new event recorded on ``stream``."""
    def wait_on(self, stream: int) -> None:
        """``stream`` waits for the event (no host wait)."""
    def synchronize(self) -> None:
        """Block the host until the event completed (GIL released)."""
    def query(self) -> bool:
        """Whether the work before the event has completed."""

class Config:
    """DeepEP's native ``Config`` (python/src/config.rs): ``num_sms`` is used, the four chunk sizes
    are checked as DeepEP checks them and kept (our kernels have no ring buffers)."""
    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int
    num_max_rdma_chunked_recv_tokens: int
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6, num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6, num_max_rdma_chunked_recv_tokens: int = 256) -> None: ...
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink buffer for rows of ``hidden_bytes`` and ``DEEPEP_KERNELS_MAX_TOKENS``
        (default 4096) tokens per rank."""
    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the internode symmetric buffer (0 within one host), for up to 32 top-k and 128
        experts per rank."""

class Handle:
    """An intranode dispatch's handle, indexable like DeepEP's 6-tuple (python/src/handles.rs):
    ``[0]`` rank_prefix_matrix (int32 ``[R, R]``), ``[3]`` recv_src_idx (int32 ``[M]``), ``[4]``
    is_token_in_rank (bool ``[N, R]``); the channel elements raise ``NotImplementedError``."""
    num_tokens: int
    num_recv_tokens: int
    num_topk: int
    num_experts: int
    num_rows: int  # rows of the dispatch's outputs (num_worst_tokens when given)
    hidden: int
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...

class LowLatencyHandle:
    """A low-latency dispatch's handle, indexable like DeepEP's 5-tuple: ``[0]`` src_info (int32
    ``[L, R*num_max]``), ``[1]`` layout_range (int64 ``[L, R]``), ``[2]`` num_max, ``[3]`` hidden,
    ``[4]`` num_experts."""
    num_tokens: int
    num_topk: int
    hidden: int
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...

class NativeHook:
    """The receive half of a low-latency call made with ``return_hook`` (``Runtime.ll_recv``, once)."""

class Keep:
    """Keeps the memory under views alive (an intranode dispatch's arena lease or outputs)."""

class InternodeHandle:
    """An internode dispatch's handle, indexable like DeepEP's 10-tuple: ``[0]``
    is_token_in_rank, ``[6]`` recv_gbl_rank_prefix_sum (int32 ``[R]``)."""
    num_tokens: int
    num_recv_tokens: int
    num_topk: int
    num_experts: int
    hidden: int
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...

InterDims = Tuple[int, int, int, int, int, int]  # (ranks_per_host, max_tokens, hidden, num_sms, max_topk, max_local_experts)
# (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event):
# the last five None for a cached dispatch; the event None without async_finish
DispatchResult = Tuple[Any, Optional[Any], Optional[Any], Optional[Any], Optional[List[int]], Optional[Any], Optional[Event]]
CombineResult = Tuple[Any, Optional[Any], Optional[Event]]  # (combined_x, combined_topk_weights, event)

class Runtime:
    """One rank's Buffer state: a ``RankContext`` (buffers, lifecycle and generations, streams and
    events, capacity, error records) and the cached torch views of the low-latency outputs. Each
    dispatch / combine / layout is one call: the recorded error of THIS Buffer raised first, the
    checks, the joins of ``previous_event`` (or ``stream``), the launch, the outputs as torch
    tensors made here, and the join back to ``stream`` (or, with ``async_finish``, an event)."""
    def __init__(self, device: int, rank: int, world: int, local_rank: int, local_world: int,
                 all_gather: Callable[[bytes], List[bytes]], ranks_per_gpu: int = 1) -> None:
        """Rank ``rank`` of ``world`` on CUDA ``device``, exchanging through ``all_gather``."""
    def set_buffer_sizes(self, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                         ranks_per_host: int = 0, recv_arena_bytes: Optional[int] = None) -> None:
        """The Buffer's sizes and mode, which bound the buffers created on first use."""
    intranode_generation: int
    ll_generation: int
    rank: int
    world: int
    device: int
    sm_count: int
    def comm_stream(self) -> int:
        """The comm stream's raw handle (wrap with ``torch.cuda.ExternalStream``)."""
    def check_error(self) -> None:
        """Raise what this Buffer's kernels recorded (DeviceArgumentError once; PeerTimeoutError /
        DeviceError until the Buffer is destroyed or dropped). Other Buffers' records are not read."""
    def recorded_cause(self) -> Optional[Exception]:
        """The PeerTimeoutError / DeviceError this Buffer's fatal record stands for, or None."""
    def comm_wait_stream(self, stream: int) -> None: ...
    def stream_wait_comm(self, stream: int) -> None: ...
    def end_call(self, async_finish: bool, stream: int) -> Optional[Event]:
        """End a call whose last work the caller queued on the comm stream: an event recorded there
        (``async_finish``) or ``stream`` waits for it."""
    def comm_after_ll(self) -> None:
        """The comm stream waits for every low-latency call so far."""
    def intranode_create(self, max_tokens: int, hidden: int, arena_bytes: Optional[int] = None) -> None: ...
    def intranode_ensure(self, hidden: int) -> None: ...
    def intranode_dims(self) -> Optional[Tuple[int, int]]: ...
    def arena_usage(self) -> Optional[Tuple[int, int, int]]:
        """The receive arena's (capacity, free bytes, live leases)."""
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[Event], async_finish: bool,
                            stream: int, use_kernel: bool = True, defer_end: bool = False) -> Tuple[Any, Any, Any, Optional[Event], bool]:
        """``topk_idx`` int64 ``[n, k]`` -> (num_tokens_per_rank int32 ``[R]``, num_tokens_per_expert
        int32 ``[E]``, is_token_in_rank bool ``[n, R]``, event, kernel ran)."""
    def dispatch(self, x: Tensor, scales: Optional[Tensor], topk_idx: Optional[Tensor], topk_weights: Optional[Tensor],
                 num_tokens_per_rank: Optional[Tensor], num_tokens_per_expert: Optional[Tensor], is_token_in_rank: Optional[Tensor],
                 handle: Optional[Handle], expert_alignment: int, num_sms: int, num_worst_tokens: int,
                 previous_event: Optional[Event], async_finish: bool, stream: int, arena: bool = True,
                 views: bool = False) -> DispatchResult:
        """Intranode dispatch: x bf16 ``[n, hidden]`` (or float8_e4m3fn with scales f32
        ``[n, hidden/128]``), fresh (layout tensors, top-k ``[n, k]`` or none) or cached (handle)."""
    def combine(self, x: Tensor, handle: Handle, topk_weights: Optional[Tensor], bias: Bias, num_sms: int,
                previous_event: Optional[Event], async_finish: bool, stream: int) -> CombineResult:
        """Intranode combine: x bf16 ``[rows, hidden]``, topk_weights f32 ``[rows, k]``, bias bf16
        ``[N, hidden]`` -> combined bf16 ``[N, hidden]`` and f32 ``[N, k]``."""
    def internode_create(self, dims: InterDims) -> InterDims: ...
    def internode_dims(self) -> Optional[InterDims]: ...
    def internode_fit_sms(self, num_sms: int) -> int: ...
    def internode_dispatch(self, x: Tensor, scales: Optional[Tensor], topk_idx: Optional[Tensor], topk_weights: Optional[Tensor],
                           num_tokens_per_rank: Optional[Tensor], num_tokens_per_rdma_rank: Optional[Tensor],
                           num_tokens_per_expert: Optional[Tensor], is_token_in_rank: Optional[Tensor], handle: Optional[InternodeHandle],
                           expert_alignment: int, num_sms: int, previous_event: Optional[Event], async_finish: bool, stream: int,
                           expert_counts: Optional[List[List[int]]] = None) -> DispatchResult:
        """Internode dispatch (as ``dispatch``; the layout adds num_tokens_per_rdma_rank int32
        ``[hosts]``; scales row-major); outputs copied into torch tensors on the comm stream.
        ``expert_counts`` (every rank's num_tokens_per_expert): DeepEP's dispatch without top-k."""
    def internode_combine(self, x: Tensor, handle: InternodeHandle, topk_weights: Optional[Tensor], bias: Bias,
                          previous_event: Optional[Event], async_finish: bool, stream: int) -> CombineResult:
        """Internode combine: x bf16 ``[m, hidden]`` in the order of the dispatch's recv_x."""
    def ll_create(self, num_max: int, hidden: int, num_experts: int) -> None: ...
    def ll_ensure(self, num_max: int, hidden: int, num_experts: int) -> None: ...
    def ll_dims(self) -> Optional[Tuple[int, int, int]]: ...
    def ll_dispatch(self, x: Tensor, topk_idx: Tensor, num_max: int, num_experts: int, use_fp8: bool, round_scale: bool,
                    use_ue8m0: bool, return_hook: bool, stats: Optional[Tensor] = None, wait_for: Optional[int] = None,
                    join_back: Optional[int] = None) -> Tuple[Any, Optional[Any], Any, LowLatencyHandle, Optional[NativeHook]]:
        """Low-latency dispatch: x bf16 ``[n, hidden]``, topk_idx int64 ``[n, k]``, stats int32
        ``[L]`` -> (recv_x ``[L, R*num_max, hidden]``, scales or None, recv_count int32 ``[L]``,
        handle, hook); launched on ``wait_for`` itself when it equals ``join_back``."""
    def ll_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: LowLatencyHandle, out: Optional[Tensor],
                   return_hook: bool, wait_for: Optional[int] = None, join_back: Optional[int] = None,
                   zero_copy: Optional[Tensor] = None) -> Tuple[Any, Optional[NativeHook]]:
        """Low-latency combine: x bf16 ``[L, R*num_max, hidden]``, topk_idx int64 / topk_weights f32
        ``[n, k]``, out bf16 ``[n, hidden]`` (None: a new tensor) -> (out, hook)."""
    def ll_recv(self, hook: NativeHook, wait_for: Optional[int] = None, join_back: Optional[int] = None) -> None: ...
    def local_buffer_tensor(self, dtype: Any, shape: Optional[List[int]], offset: int, rdma: bool, owner: Any) -> Any:
        """This rank's NVLink (or low-latency) buffer from byte ``offset`` as a ``dtype`` tensor."""
    def synchronize(self) -> None: ...
    def destroy(self) -> None:
        """Release the buffers (collective; local only after a lost peer)."""

class ElasticRuntime:
    """One rank's DeepEP V2 buffer (``deepep_kernels.elastic.ElasticBuffer``): its own rank context
    with a CUDA IPC buffer of the same size on every rank. Each dispatch and combine is one call:
    this buffer's recorded error raised first, the Rust checks (``kernels/src/elastic/checks.rs``),
    the joins of ``previous_event`` (or ``stream``), the launches, the outputs as torch tensors made
    on the current stream, and the join back to ``stream`` (or, with ``async_finish``, an event)."""
    def __init__(self, device: int, rank: int, world: int, all_gather: Callable[[bytes], List[bytes]], ranks_per_gpu: int,
                 num_bytes: int, gpu_timeout_secs: float, cpu_timeout_secs: float) -> None:
        """Collective: every rank of the group passes the same ``num_bytes``."""
    def comm_stream(self) -> int:
        """Raw ``CUstream`` of the comm stream."""
    def num_bytes(self) -> int: ...
    def num_sms(self) -> int:
        """SMs this rank's kernels may use (its share when ranks share a GPU)."""
    def barrier(self, stream: int, with_cpu_sync: bool) -> None:
        """Collective barrier on the comm stream (``stream`` 0) or on ``stream``."""
    def destroy(self) -> None: ...
    def dispatch(self, x: Any, sf: Optional[Any], topk_idx: Any, topk_weights: Optional[Any], stats: Optional[Any],
                 cached: Optional[Tuple[Any, Any, Any, Any, Any, bool, int]], num_experts: int, max_tokens: int,
                 expert_alignment: int, num_sms: int, expand: bool, zero_padding: bool, cpu_sync: bool, handle_copy: bool,
                 tma_sf: bool, previous_event: Optional[Event], event_before_epilogue: Optional[Event], async_finish: bool,
                 stream: int) -> Tuple[Any, Optional[Any], Optional[Any], Optional[Any], Optional[Tuple[Any, ...]], Optional[Event]]:
        """``(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, handle parts, event)``; ``cached`` is
        the handle's ``(plan, psum_rank, psum_expert, unaligned, recv_src_metadata, do_expand, rows)``;
        the handle parts (None for a cached call) are ``(plan, topk copy or None, psum_rank,
        psum_expert, unaligned, recv_src_metadata, num_recv_tokens, num_expanded_tokens,
        num_recv_tokens_per_expert_list)``."""
    def combine(self, x: Any, topk_weights: Optional[Any], bias0: Optional[Any], bias1: Optional[Any], meta: Any, psum_rank: Any,
                topk_idx: Any, plan: Any, num_experts: int, max_tokens: int, expand: bool, allow_multiple_reduction: bool,
                num_sms: int, previous_event: Optional[Event], event_before_epilogue: Optional[Event], async_finish: bool,
                stream: int) -> Tuple[Any, Optional[Any], Optional[Event]]:
        """``(combined_x, combined_topk_weights or None, event)``."""

def elastic_buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False) -> int:
    """``ElasticBuffer.get_buffer_size_hint``: bytes per rank, a multiple of 2 MiB (``num_topk`` 0:
    sized for ``max(num_ranks, 8)``)."""

def launch_timing(reset: bool = False) -> Tuple[int, int]:
    """(launches, ns) spent in cuLaunchKernelEx (DEEPEP_HOST_TIMING=1)."""
def intranode_buffer_bytes(num_ranks: int, max_tokens: int, hidden: int) -> int: ...
def intranode_max_tokens(num_ranks: int, hidden: int, bytes: int) -> int: ...
def ll_buffer_bytes(num_ranks: int, num_experts: int, num_max: int, hidden: int, grid: int) -> int: ...
def internode_buffer_bytes(world: int, ranks_per_host: int, max_tokens: int, hidden: int, num_sms: int, max_topk: int,
                           max_local_experts: int) -> int: ...
def internode_max_tokens(world: int, ranks_per_host: int, hidden: int, num_sms: int, max_topk: int, max_local_experts: int,
                         bytes: int) -> int: ...
def internode_limits() -> Tuple[int, int, int]: ...
def is_sm90_compiled() -> bool: ...
def nvshmem_device_version() -> Optional[Tuple[int, int, int]]: ...
def nvshmem_releases() -> List[str]: ...
def cuda_available() -> bool: ...
def nvshmem_host_check() -> Tuple[str, str]: ...
def _exchange_selftest(rank: int, world: int, data: bytes, all_gather: Callable[[bytes], List[bytes]]) -> Tuple[List[bytes], bytes, List[int]]: ...
def capture(stream: int) -> Event: ...
def device_error() -> Optional[str]:
    """What a kernel of any live Buffer of this process recorded (only looks)."""
def take_device_error(fatal_only: bool = False) -> Optional[Tuple[str, str]]: ...
def check_device_error() -> None:
    """Raise what a kernel of any live Buffer of this process recorded (``deepep_kernels.check_device_error``)."""
def recorded_cause() -> Optional[Exception]: ...
def _register_error_types(device: type, argument: type, timeout: type) -> None: ...
def handle_elements(kind: str) -> List[str]: ...
def ranks_per_host_from_env(world: int, environ: Optional[dict] = None) -> Optional[int]: ...
def host_topology(hosts: List[str], environ: Optional[dict] = None) -> Tuple[int, int]: ...
def recv_arena_from_env(environ: Optional[dict] = None) -> Optional[int]: ...
def dispatch_views_from_env(environ: Optional[dict] = None) -> bool: ...
def nvshmem_env(num_qps_per_rank: int, allow_nvlink_for_low_latency_mode: bool, allow_mnnvl: bool,
                environ: Optional[dict] = None) -> dict: ...
def deepep_config(combine: bool, num_ranks: int) -> Tuple[int, int, int, int]: ...
def group_layout(places: List[Tuple[str, int]], rank: int, internode_wanted: bool,
                 environ: Optional[dict] = None) -> Tuple[int, int, bool, int, int, int]: ...
def recv_counts_per_expert(all_counts: List[List[int]], rank: int, alignment: int) -> List[int]: ...
def prepare_nvshmem(num_qps_per_rank: int, allow_nvlink_for_low_latency_mode: bool, allow_mnnvl: bool) -> Tuple[str, str]: ...

class RawRange:
    """Device memory as ``__cuda_array_interface__`` (bytes), for ``torch.as_tensor``: how output
    views are made with ``DEEPEP_KERNELS_DLPACK_VIEWS=0`` (the default makes them from DLPack
    capsules)."""
def check_call(method: str, state: dict, *args: Any) -> None:
    """The argument checks of ``Runtime.<method>`` on ``args`` with plain ``state`` (keys:
    ``device`` always; ``ll_dispatch``: world, num_max, num_experts, args (x, topk_idx, stats);
    ``ll_combine``: num_tokens, num_topk, hidden, local_experts, rows, args (x, topk_idx,
    topk_weights, out, zero_copy); ``get_dispatch_layout``: world, num_experts, args (topk_idx,
    num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank); ``dispatch``: world, args (x,
    scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank);
    ``combine``: num_tokens, num_recv_tokens, num_rows, args (x, topk_weights, bias, out,
    out_weights); ``internode_dispatch``: world, hosts, args (x, scales, topk_idx, topk_weights,
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank);
    ``internode_combine``: num_tokens, num_recv_tokens, hidden, args (x, topk_weights, bias))."""
    ...
def checked_methods() -> List[str]: ...
def read_tensor(obj: Tensor, dlpack: bool = False) -> Tuple[int, List[int], List[int], str, str]: ...
