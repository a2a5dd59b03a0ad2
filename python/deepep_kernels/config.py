"""``Config``: DeepEP v1.2.1's performance-tuning config, native like DeepEP's (python/src/config.rs).

Same constructor (``Config(num_sms=20, num_max_nvl_chunked_send_tokens=6,
num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
num_max_rdma_chunked_recv_tokens=256)``), the same checks and the two size hints
(``get_nvl_buffer_size_hint``, ``get_rdma_buffer_size_hint``), which size this package's
buffers for ``DEEPEP_KERNELS_MAX_TOKENS`` (default 4096) tokens per rank and dispatch.
"""

from __future__ import annotations

from . import _native

Config = _native.Config
# The setting the size hints read: tokens per rank and dispatch the buffers are sized for.
DEFAULT_MAX_TOKENS_ENV = _native.DEFAULT_MAX_TOKENS_ENV
DEFAULT_MAX_TOKENS = _native.DEFAULT_MAX_TOKENS

__all__ = ["Config", "DEFAULT_MAX_TOKENS_ENV", "DEFAULT_MAX_TOKENS"]
