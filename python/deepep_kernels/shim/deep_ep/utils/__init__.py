"""``deep_ep.utils`` of the shim: DeepEP 2.1's package layout over ``deepep_kernels.utils``.

``EventHandle`` / ``EventOverlap`` are here (as in DeepEP v1.2.1 and 2.1); the submodules
``envs``, ``math``, ``gate``, ``refs``, ``testing`` and ``event`` re-export
``deepep_kernels.utils.<name>`` and are imported when named (all but ``event`` import torch).
"""

from deepep_kernels.utils.event import EventHandle, EventOverlap  # noqa: F401
