"""Fails early when torch's extension builder would reject TORCH_CUDA_ARCH_LIST.

DeepEP's setup.py compiles through torch.utils.cpp_extension, whose _get_cuda_arch_flags raises
"Unknown CUDA arch (X) or GPU not supported" for entries outside torch's own allowlist, after
the build has started. pkgs/deep-ep/lib.nix filters nixpkgs' capabilities with the allowlist
read from pytorch's sources (torchExtensionArches); this asks the torch of the build itself.
A torch without that (private) function is not checked.
"""

import os
import sys

try:
    from torch.utils.cpp_extension import _get_cuda_arch_flags
except ImportError:
    sys.exit(0)

arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
try:
    _get_cuda_arch_flags()
except ValueError as e:
    sys.exit(
        f"deep-ep: this torch's extension builder rejects TORCH_CUDA_ARCH_LIST={arch_list!r}: {e}. "
        "Pass cudaCapabilities = [ ... ] with entries it accepts (pkgs/deep-ep/lib.nix torchExtensionArches "
        "lists the allowlists read so far; please add this torch's)."
    )
print(f"deep-ep: torch accepts TORCH_CUDA_ARCH_LIST={arch_list}")
