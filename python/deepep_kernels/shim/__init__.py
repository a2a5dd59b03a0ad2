"""The opt-in ``deep_ep`` shim.

``python -m deepep_kernels.shim`` prints the directory that holds the shim's ``deep_ep``
package; put it on ``PYTHONPATH`` to make ``import deep_ep`` load deepep_kernels::

    export PYTHONPATH="$(python -m deepep_kernels.shim)${PYTHONPATH:+:$PYTHONPATH}"

Or, in code, before the first ``import deep_ep``::

    import deepep_kernels.shim; deepep_kernels.shim.install()

Both refuse (ImportError) when a real DeepEP is importable too, so it is never shadowed by
accident; set ``DEEPEP_KERNELS_SHADOW_DEEP_EP=1`` to shadow it on purpose.
"""

from __future__ import annotations

import importlib.util
import os
import sys

PATH = os.path.dirname(os.path.abspath(__file__))
SHADOW_ENV = "DEEPEP_KERNELS_SHADOW_DEEP_EP"


# Every copy of the shim's deep_ep/__init__.py carries this marker (the conformance runner
# builds one per DeepEP 2.x run, with DeepEP's reference utilities over ours).
SHIM_MARKER = "__deepep_kernels_shim__ = True"


def is_shim_copy(init_py: str) -> bool:
    """Whether ``init_py`` (a ``deep_ep/__init__.py``) is this shim's or a copy of it."""
    try:
        with open(init_py, encoding="utf-8", errors="replace") as f:
            return SHIM_MARKER in f.read(65536)
    except OSError:
        return False


def real_deep_ep_locations() -> list:
    """Directories on sys.path (other than the shim's) holding a ``deep_ep`` package or the
    ``deep_ep_cpp`` extension of a real DeepEP installation."""
    found = []
    for entry in sys.path:
        d = os.path.abspath(entry or os.getcwd())
        if d == PATH or not os.path.isdir(d):
            continue
        init = os.path.join(d, "deep_ep", "__init__.py")
        if os.path.isfile(init):
            if not is_shim_copy(init):
                found.append(os.path.join(d, "deep_ep"))
            continue
        try:
            names = os.listdir(d)
        except OSError:
            continue
        found.extend(os.path.join(d, n) for n in names if n.startswith("deep_ep_cpp") and n.endswith(".so"))
    return found


def check_not_shadowing() -> None:
    if os.environ.get(SHADOW_ENV) == "1":
        return
    real = real_deep_ep_locations()
    if real:
        raise ImportError(
            "the deepep_kernels deep_ep shim would shadow a real DeepEP installation at "
            + ", ".join(real)
            + f"; remove the shim directory from PYTHONPATH (or do not call deepep_kernels.shim.install()) to use DeepEP, "
            f"or set {SHADOW_ENV}=1 to use deepep_kernels under the name deep_ep anyway"
        )


def install() -> None:
    """Make ``import deep_ep`` load the shim (in-process opt-in, no PYTHONPATH change)."""
    existing = sys.modules.get("deep_ep")
    if existing is not None and not getattr(existing, "__deepep_kernels_shim__", False):
        raise ImportError(f"deep_ep is already imported from {getattr(existing, '__file__', '?')}; call install() before any import of deep_ep")
    check_not_shadowing()
    if PATH not in sys.path:
        sys.path.insert(0, PATH)
    importlib.import_module("deep_ep")
