"""deepep_kernels: DeepEP v1.2.1's ``deep_ep`` Python API over the deepep-nix kernels.

Import this package as ``deepep_kernels``; existing ``import deep_ep`` code can opt in to the
``deep_ep`` shim shipped inside it (see ``deepep_kernels.shim`` and docs/python.md). Nothing
here imports torch at import time, so the API shape can be inspected without torch; creating a
``Buffer`` or calling a communication method needs torch with CUDA.
"""

from . import _native
from .config import Config
from .utils.event import EventHandle, EventOverlap
from .buffer import Buffer, DeviceArgumentError, DeviceError, PeerTimeoutError, check_device_error

__version__ = _native.__version__
__all__ = ["Buffer", "Config", "DeviceError", "DeviceArgumentError", "PeerTimeoutError", "check_device_error", "EventHandle",
           "EventOverlap", "__version__"]
