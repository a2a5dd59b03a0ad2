"""``deep_ep.utils.refs``: a re-export of ``deepep_kernels.utils.refs``."""

from deepep_kernels.utils.refs import *  # noqa: F401,F403
from deepep_kernels.utils.refs import __all__  # noqa: F401
