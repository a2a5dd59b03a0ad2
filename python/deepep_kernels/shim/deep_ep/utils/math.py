"""``deep_ep.utils.math``: a re-export of ``deepep_kernels.utils.math``."""

from deepep_kernels.utils.math import *  # noqa: F401,F403
from deepep_kernels.utils.math import __all__  # noqa: F401
