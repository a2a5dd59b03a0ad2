"""``deep_ep`` backed by deepep_kernels (opt-in shim; see deepep_kernels.shim).

DeepEP v1.2.1's API (``Buffer``, ``Config``, ``EventOverlap``, ``EventHandle``, ``deep_ep.buffer``,
``deep_ep.utils``) is imported here; DeepEP 2.1's names are resolved at first use, so importing
the shim imports no torch: ``topk_idx_t`` (``torch.int64``), ``ElasticBuffer`` and ``EPHandle``
(from ``deepep_kernels.elastic``), ``get_physical_domain_size`` / ``get_logical_domain_size``
(``deep_ep.utils.envs``). ``__version__`` is the DeepEP API version the shim follows.
"""

from deepep_kernels.shim import check_not_shadowing as _check

_check()

import importlib as _importlib  # noqa: E402

from deepep_kernels import Buffer, Config, EventOverlap  # noqa: E402
from deepep_kernels.utils import EventHandle  # noqa: E402

from . import buffer, utils  # noqa: E402,F401

__deepep_kernels_shim__ = True
__version__ = "2.1.0"
__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle"]

# DeepEP 2.1's names that need torch or the V2 module: name -> (module, attribute)
_LAZY = {
    "ElasticBuffer": ("deepep_kernels.elastic", "ElasticBuffer"),
    "EPHandle": ("deepep_kernels.elastic", "EPHandle"),
    "get_physical_domain_size": ("deepep_kernels.utils.envs", "get_physical_domain_size"),
    "get_logical_domain_size": ("deepep_kernels.utils.envs", "get_logical_domain_size"),
}


def __getattr__(name):
    if name == "topk_idx_t":
        import torch

        return torch.int64
    if name not in _LAZY:
        raise AttributeError(f"module 'deep_ep' (the deepep_kernels shim) has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    try:
        module = _importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise ImportError(
            f"deep_ep.{name} (DeepEP 2.x's V2 API) is not in this deepep_kernels build: it has no {module_name} module. "
            f"Use a deepep_kernels wheel that ships it, or DeepEP v1.2.1's API (deep_ep.Buffer), which this shim serves",
            name=module_name) from e
    try:
        value = getattr(module, attr)
    except AttributeError:
        raise ImportError(f"deep_ep.{name}: {module_name} does not define {attr} (this deepep_kernels build is incomplete); "
                          f"use deep_ep.Buffer (DeepEP v1.2.1's API) meanwhile", name=module_name) from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"topk_idx_t"})
