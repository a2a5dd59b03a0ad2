"""``deep_ep.utils.envs``: a re-export of ``deepep_kernels.utils.envs``."""

from deepep_kernels.utils.envs import *  # noqa: F401,F403
from deepep_kernels.utils.envs import __all__  # noqa: F401
