"""``deep_ep`` backed by deepep_kernels (opt-in shim; see deepep_kernels.shim)."""

from deepep_kernels.shim import check_not_shadowing as _check

_check()

from deepep_kernels import Buffer, Config, EventOverlap  # noqa: E402
from deepep_kernels.utils import EventHandle  # noqa: E402

from . import buffer, utils  # noqa: E402,F401

__deepep_kernels_shim__ = True
__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle"]
