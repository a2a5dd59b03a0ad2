"""``deep_ep.utils.gate``: a re-export of ``deepep_kernels.utils.gate``."""

from deepep_kernels.utils.gate import *  # noqa: F401,F403
from deepep_kernels.utils.gate import __all__  # noqa: F401
