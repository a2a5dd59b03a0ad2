"""``Config``: DeepEP's performance-tuning config, with the same constructor and size hints."""

from __future__ import annotations

import os

from . import _native

# Token capacity per rank that ``get_nvl_buffer_size_hint`` sizes the NVLink buffer for.
# DeepEP's hint does not depend on the token count (its kernels stream through a ring buffer);
# ours receive every row at its final place, so the buffer is sized for a token capacity.
DEFAULT_MAX_TOKENS_ENV = "DEEPEP_KERNELS_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 4096
# Experts per rank that get_rdma_buffer_size_hint sizes the internode buffer for.
INTERNODE_HINT_LOCAL_EXPERTS = 128


def default_max_tokens() -> int:
    v = os.environ.get(DEFAULT_MAX_TOKENS_ENV, "")
    if not v:
        return DEFAULT_MAX_TOKENS
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{DEFAULT_MAX_TOKENS_ENV}={v!r} must be a positive token count (tokens per rank per dispatch)")
    return n


class Config:
    """DeepEP's ``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``.

    ``num_sms`` sets the thread blocks of our intranode dispatch/combine kernels (and of the
    internode ones, which need it even: ``num_sms / 2`` channels). The four chunk
    sizes are DeepEP ring-buffer knobs; they are validated like DeepEP does and kept as
    attributes, but our kernels have no ring buffer and do not read them (they never change
    results).
    """

    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int = 6, num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6, num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        vals = [num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            raise TypeError(f"Config takes five ints, got {vals!r}")
        if num_sms < 0:
            raise ValueError(f"Config: num_sms={num_sms} must be >= 0")
        if not (0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens):
            raise ValueError("Config: need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "
                             f"got {num_max_nvl_chunked_send_tokens} and {num_max_nvl_chunked_recv_tokens}")
        if not (0 < num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens):
            raise ValueError("Config: need 0 < num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens, "
                             f"got {num_max_rdma_chunked_send_tokens} and {num_max_rdma_chunked_recv_tokens}")
        if num_max_rdma_chunked_send_tokens > num_max_rdma_chunked_recv_tokens // 2:
            raise ValueError("Config: num_max_rdma_chunked_send_tokens must be <= num_max_rdma_chunked_recv_tokens / 2, "
                             f"got {num_max_rdma_chunked_send_tokens} and {num_max_rdma_chunked_recv_tokens}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, {self.num_max_nvl_chunked_recv_tokens}), "
                f"rdma=({self.num_max_rdma_chunked_send_tokens}, {self.num_max_rdma_chunked_recv_tokens}))")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink buffer for rows of ``hidden_bytes`` (bf16: 2 bytes per channel) and
        ``DEEPEP_KERNELS_MAX_TOKENS`` (default 4096) tokens per rank and dispatch."""
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError(f"get_nvl_buffer_size_hint: hidden_bytes={hidden_bytes} and num_ranks={num_ranks} must be positive")
        hidden = (hidden_bytes + 1) // 2
        return _native.intranode_buffer_bytes(num_ranks, default_max_tokens(), hidden)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the internode (RDMA) symmetric buffer for rows of ``hidden_bytes`` (bf16: 2
        bytes per channel), ``num_ranks`` ranks in hosts of 8 GPUs (DeepEP's NUM_MAX_NVL_PEERS; or
        ``DEEPEP_KERNELS_RANKS_PER_HOST``), this config's ``num_sms`` and
        ``DEEPEP_KERNELS_MAX_TOKENS`` (default 4096) tokens per rank and dispatch, for up to 32
        top-k and 128 experts per rank. 0 when the ranks fit in one host, like DeepEP."""
        from .buffer import NUM_MAX_NVL_PEERS, ranks_per_host_from_env

        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError(f"get_rdma_buffer_size_hint: hidden_bytes={hidden_bytes} and num_ranks={num_ranks} must be positive")
        rph = ranks_per_host_from_env(num_ranks) or NUM_MAX_NVL_PEERS
        if num_ranks <= rph:
            return 0
        if num_ranks % rph != 0:
            raise ValueError(f"get_rdma_buffer_size_hint: {num_ranks} ranks do not form hosts of {rph} GPUs; use a multiple of {rph} "
                             "ranks (or set DEEPEP_KERNELS_RANKS_PER_HOST to the GPUs per host)")
        if self.num_sms < 2 or self.num_sms % 2 != 0:
            raise ValueError(f"get_rdma_buffer_size_hint: the internode mode needs an even num_sms >= 2, this Config has {self.num_sms}")
        hidden = (hidden_bytes + 1) // 2
        hidden = (hidden + 127) // 128 * 128  # the internode rows are multiples of 128 channels
        _, max_topk, _ = _native.internode_limits()
        return _native.internode_buffer_bytes(num_ranks, rph, default_max_tokens(), hidden, min(self.num_sms, 64), max_topk,
                                              INTERNODE_HINT_LOCAL_EXPERTS)
