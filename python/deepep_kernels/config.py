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
# No GPU holds a buffer of 1 TiB (an H200 has 141 GB): a hint above it comes from arguments or a
# DEEPEP_KERNELS_MAX_TOKENS that cannot be meant, and is refused instead of returned.
MAX_HINT_BYTES = 1 << 40


def _check_count(fn: str, name: str, v, minimum: int = 1) -> int:
    """``v`` as a count argument of ``fn``: an int (not a bool) >= ``minimum``, else an error naming it."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{fn}: {name}={v} must be >= {minimum}")
    return v


def _sized(fn: str, what: str, compute) -> int:
    """The byte count ``compute()`` gives, refused (naming the inputs in ``what``) when it
    overflows the native 64-bit arithmetic or exceeds MAX_HINT_BYTES."""
    try:
        n = compute()
        shown = f"{n / (1 << 40):.1f} TiB"
    except OverflowError:  # an argument past the native 64-bit range
        n, shown = None, "more than 2^64 bytes"
    except ValueError as e:
        # The native sizing refuses more than 1 TiB itself, naming its own parameters; other
        # refusals (e.g. a rank count the kernels do not run) pass on, said by this hint.
        if "exceed 1 TiB" not in str(e):
            note = (f" (the hints take max_tokens_per_rank from {DEFAULT_MAX_TOKENS_ENV})"
                    if "max_tokens_per_rank" in str(e) else "")
            raise ValueError(f"{fn}: {e}{note}") from None
        n, shown = None, "more than 1 TiB"
    if n is None or n > MAX_HINT_BYTES:
        raise ValueError(f"{fn}: {what} needs {shown} of buffer, more than any GPU holds (the hint refuses above 1 TiB); "
                         f"lower them (DEEPEP_KERNELS_MAX_TOKENS is the tokens per rank and dispatch)")
    return n


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
        names = ["num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"]
        for name, v in zip(names, vals):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"Config: {name} must be an int, got {type(v).__name__} {v!r}")
        # DeepEP asserts num_sms >= 0; 0 thread blocks cannot run a dispatch, so it is refused here
        # at once instead of at the first kernel launch.
        if num_sms < 1:
            raise ValueError(f"Config: num_sms={num_sms} must be >= 1 (the thread blocks of dispatch and combine)")
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
        fn = "get_nvl_buffer_size_hint"
        _check_count(fn, "hidden_bytes", hidden_bytes)
        _check_count(fn, "num_ranks", num_ranks)
        from .buffer import NUM_MAX_NVL_PEERS

        # DeepEP's own assertion (csrc/config.hpp get_nvl_buffer_size_hint), said with the argument.
        if num_ranks >= NUM_MAX_NVL_PEERS and num_ranks % NUM_MAX_NVL_PEERS != 0:
            raise ValueError(f"{fn}: num_ranks={num_ranks} must be below {NUM_MAX_NVL_PEERS} or a multiple of it "
                             f"(hosts of {NUM_MAX_NVL_PEERS} GPUs), as in DeepEP")
        hidden = (hidden_bytes + 1) // 2
        tokens = default_max_tokens()
        return _sized(fn, f"hidden_bytes={hidden_bytes}, num_ranks={num_ranks} and {tokens} tokens per rank",
                      lambda: _native.intranode_buffer_bytes(num_ranks, tokens, hidden))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the internode (RDMA) symmetric buffer for rows of ``hidden_bytes`` (bf16: 2
        bytes per channel), ``num_ranks`` ranks in hosts of 8 GPUs (DeepEP's NUM_MAX_NVL_PEERS; or
        ``DEEPEP_KERNELS_RANKS_PER_HOST``), this config's ``num_sms`` and
        ``DEEPEP_KERNELS_MAX_TOKENS`` (default 4096) tokens per rank and dispatch, for up to 32
        top-k and 128 experts per rank. 0 when the ranks fit in one host, like DeepEP."""
        from .buffer import NUM_MAX_NVL_PEERS, ranks_per_host_from_env

        fn = "get_rdma_buffer_size_hint"
        _check_count(fn, "hidden_bytes", hidden_bytes)
        _check_count(fn, "num_ranks", num_ranks)
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
        tokens = default_max_tokens()
        return _sized(fn, f"hidden_bytes={hidden_bytes}, num_ranks={num_ranks} and {tokens} tokens per rank",
                      lambda: _native.internode_buffer_bytes(num_ranks, rph, tokens, hidden, min(self.num_sms, 64), max_topk,
                                                             INTERNODE_HINT_LOCAL_EXPERTS))
