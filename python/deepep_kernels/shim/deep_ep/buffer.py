"""``deep_ep.buffer`` of the shim."""

from deepep_kernels.buffer import Buffer  # noqa: F401
from deepep_kernels.config import Config  # noqa: F401
from deepep_kernels.utils import EventHandle, EventOverlap  # noqa: F401
