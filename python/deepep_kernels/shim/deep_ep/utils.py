"""``deep_ep.utils`` of the shim."""

from deepep_kernels.utils import EventHandle, EventOverlap  # noqa: F401
