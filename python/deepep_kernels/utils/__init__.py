"""DeepEP's ``deep_ep.utils`` package, written for deepep_kernels.

- ``event``: ``EventHandle``, ``EventOverlap`` (imported here; no torch needed)
- ``envs``: ``init_dist``, ``init_seed``, ``get_global_seed``, ``get_local_seed``, ``dist_print``, ...
- ``math``: ``calc_diff``, ``ceil_div``, ``align``, ``per_token_cast_to_fp8``, ``per_token_cast_back``, ...
- ``gate``: ``get_unbalanced_scores`` and its generators (test routing with a given imbalance)
- ``refs``: the torch references of DeepEP 2.1's V2 test: ``dispatch``, ``combine``,
  ``generate_pre_combine_data``, ``ordered_accumulate``
- ``testing``: ``bench``, ``bench_kineto``, ...

The submodules other than ``event`` import torch, so they are imported only when named
(``from deepep_kernels.utils.math import align``); importing ``deepep_kernels`` never imports
torch. They follow the names, signatures and results of DeepEP 2.1's ``deep_ep/utils`` (commit
dd758ca); where the numerics matter (the references, the FP8 casts, the test's routing scores)
the results are bit-identical to DeepEP's on the same inputs (python/tests/gpu/test_v2_utils_bitwise.py
checks that against a DeepEP tree).
"""

from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
