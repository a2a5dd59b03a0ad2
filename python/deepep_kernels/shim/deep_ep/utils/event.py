"""``deep_ep.utils.event``: a re-export of ``deepep_kernels.utils.event``."""

from deepep_kernels.utils.event import *  # noqa: F401,F403
from deepep_kernels.utils.event import __all__  # noqa: F401
