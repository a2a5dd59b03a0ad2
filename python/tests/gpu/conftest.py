"""GPU tests: skipped (with the reason) where torch or a CUDA device is missing."""

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch (torch.cuda.is_available() is False)", allow_module_level=True)
