"""``deep_ep.utils.testing``: a re-export of ``deepep_kernels.utils.testing``."""

from deepep_kernels.utils.testing import *  # noqa: F401,F403
from deepep_kernels.utils.testing import __all__  # noqa: F401
