"""The native doorway: every tensor-taking ``Runtime`` method reads the tensors it is given and
the kernels crate refuses wrong ones (python/src/doorway.rs, kernels/src/args.rs).

CI has no CUDA and no torch, so the GPU path (real torch tensors, then a launch) is not exercised
here: python/tests/gpu runs it; the attribute reader itself is run on a stand-in torch module in a
separate interpreter (the last test). The other tests call ``_native.check_call``,
which runs the very parse function each ``Runtime`` method runs before launching, on real numpy
arrays (read through DLPack) and on DLPack capsules over numpy memory: bfloat16 and fp8 do not
exist in numpy, and a capsule may also describe the memory as CUDA's, so that an argument set the
checks accept can be shown (nothing ever dereferences it)."""

import ast
import ctypes
import os

import numpy as np
import pytest

from deepep_kernels import _native

PYI = os.path.join(os.path.dirname(_native.__file__), "_native.pyi")

# --- DLPack capsules over numpy memory (dlpack.h: DLTensor, DLManagedTensor) --------------------


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManaged(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# (DLPack code, bits) of the dtypes used below
CODES = {"bfloat16": (4, 16), "float8_e4m3fn": (10, 8), "float32": (2, 32), "float64": (2, 64), "float16": (2, 16), "int32": (0, 32),
         "int64": (0, 64), "bool": (6, 8)}


class Dl:
    """An array exporting ``__dlpack__`` with any dtype, device and strides, over numpy memory
    (keeps everything the capsule points to alive)."""

    def __init__(self, dtype, shape, device=(2, 0), strides=None):
        code, bits = CODES[dtype]
        n = int(np.prod(shape)) if shape else 1
        span = n if strides is None else 1 + sum((s - 1) * st for s, st in zip(shape, strides))
        self.mem = np.zeros(max(span, 1) * bits // 8 + 16, dtype=np.uint8)
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(shape))(*strides) if strides is not None else None
        t = _DLTensor(self.mem.ctypes.data, device[0], device[1], len(shape), code, bits, 1, self.shape,
                      ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64)) if self.strides is not None else None, 0)
        self.managed = _DLManaged(t, None, None)
        self.dims = tuple(shape)

    def __dlpack__(self, stream=None):
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)


def cuda(dtype, *shape):
    return Dl(dtype, list(shape))


# --- every tensor-taking Runtime method --------------------------------------------------------

def tensor_methods_from_pyi():
    """Runtime methods of _native.pyi with a parameter annotated with ``Tensor``."""
    tree = ast.parse(open(PYI).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime")
    out = set()
    for f in cls.body:
        if isinstance(f, ast.FunctionDef) and any(a.annotation is not None and "Tensor" in ast.unparse(a.annotation) for a in f.args.args):
            out.add(f.name)
    return out


# state, then the arguments in check_call's order as (message name, dtype, shape) or None
N, K, H, R, E, M, NUM_MAX = 6, 4, 256, 2, 8, 10, 16
CASES = {
    "ll_dispatch": (dict(world=R, num_max=NUM_MAX, num_experts=E),
                    [("x", "bfloat16", (N, H)), ("topk_idx", "int64", (N, K)), ("cumulative_local_expert_recv_stats", "int32", (E // R,))]),
    "ll_combine": (dict(num_tokens=N, num_topk=K, hidden=H, local_experts=E // R, rows=R * NUM_MAX),
                   [("x", "bfloat16", (E // R, R * NUM_MAX, H)), ("topk_idx", "int64", (N, K)), ("topk_weights", "float32", (N, K)),
                    ("out", "bfloat16", (N, H))]),
    "get_dispatch_layout": (dict(world=R, num_experts=E),
                            [("topk_idx", "int64", (N, K)), ("num_tokens_per_rank", "int32", (R,)),
                             ("num_tokens_per_expert", "int32", (E,)), ("is_token_in_rank", "bool", (N, R))]),
    "dispatch": (dict(world=R),
                 [("x", "float8_e4m3fn", (N, H)), ("x scales", "float32", (N, H // 128)), ("topk_idx", "int64", (N, K)),
                  ("topk_weights", "float32", (N, K)), ("num_tokens_per_rank", "int32", (R,)), ("num_tokens_per_expert", "int32", (E,)),
                  ("is_token_in_rank", "bool", (N, R))]),
    "combine": (dict(num_tokens=N, num_recv_tokens=M, num_rows=M),
                [("x", "bfloat16", (M, H)), ("topk_weights", "float32", (M, K)), ("bias[0]", "bfloat16", (N, H)), ("out", "bfloat16", (N, H)),
                 ("out_weights", "float32", (N, K))]),
    "internode_dispatch": (dict(world=R * 2, hosts=2),
                           [("x", "float8_e4m3fn", (N, H)), ("x scales", "float32", (N, H // 128)), ("topk_idx", "int64", (N, K)),
                            ("topk_weights", "float32", (N, K)), ("num_tokens_per_rank", "int32", (R * 2,)),
                            ("num_tokens_per_rdma_rank", "int32", (2,)), ("num_tokens_per_expert", "int32", (E,)),
                            ("is_token_in_rank", "bool", (N, R * 2))]),
    "internode_combine": (dict(num_tokens=N, num_recv_tokens=M, hidden=H),
                          [("x", "bfloat16", (M, H)), ("topk_weights", "float32", (M, K)), ("bias[0]", "bfloat16", (N, H))]),
}
NUMPY = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64, "bool": np.bool_}


def call(method, args, device=0):
    state, _ = CASES[method]
    _native.check_call(method, {**state, "device": device}, *args)


def good(method):
    return [cuda(dt, *shape) for _, dt, shape in CASES[method][1]]


def test_every_tensor_taking_method_has_checks():
    # a new Runtime method taking tensors without a parse function in check_call fails here
    assert tensor_methods_from_pyi() == set(_native.checked_methods()) == set(CASES)


@pytest.mark.parametrize("method", sorted(CASES))
def test_right_tensors_pass_the_checks(method):
    call(method, good(method))


@pytest.mark.parametrize("method", sorted(CASES))
def test_wrong_tensors_are_refused_naming_them(method):
    specs = CASES[method][1]
    for i, (name, dt, shape) in enumerate(specs):
        def with_arg(a):
            args = good(method)
            args[i] = a
            return args

        # wrong dtype (a real numpy array: refused for its dtype before its device)
        wrong = "float64" if dt != "float64" else "float32"
        with pytest.raises(ValueError, match=rf"^{name.replace('[', '.').replace(']', '.')} (must be|scales must be)") as e:
            call(method, with_arg(np.zeros(shape, dtype=NUMPY[wrong])))
        assert "float64" in str(e.value) or "float32" in str(e.value), e.value
        # wrong rank (one more dimension)
        with pytest.raises(ValueError, match=r"must be|is \[|has|got"):
            call(method, with_arg(cuda(dt, *shape, 1)))
        # wrong size of the first dimension: refused, named (by itself or by what it must match)
        with pytest.raises(ValueError):
            call(method, with_arg(cuda(dt, shape[0] + 1, *shape[1:])))
        # not a tensor at all
        with pytest.raises(TypeError, match=rf"{name.replace('[', '.').replace(']', '.')} must be a torch.Tensor, got str"):
            call(method, with_arg("not a tensor"))
        # right dtype and shape but in CPU memory: refused only for the device
        cpu = np.zeros(shape, dtype=NUMPY[dt]) if dt in NUMPY else Dl(dt, list(shape), device=(1, 0))
        with pytest.raises(ValueError, match=rf"must be on a CUDA device \(got cpu\); move it with .cuda\(\)"):
            call(method, with_arg(cpu))
        # on another GPU than the Buffer's
        with pytest.raises(ValueError, match=r"is on cuda:1 but this Buffer uses cuda:0"):
            call(method, with_arg(Dl(dt, list(shape), device=(2, 1))))
        # not contiguous (a 2-D or 3-D tensor with its rows spaced out); scales may be column-major
        if len(shape) >= 2:
            st = [1] * len(shape)
            for d in range(len(shape) - 2, -1, -1):
                st[d] = st[d + 1] * shape[d + 1] * (2 if d == len(shape) - 2 else 1)
            want = r"row-major or column-major" if name == "x scales" else rf"must be contiguous .*call .contiguous\(\) first"
            with pytest.raises(ValueError, match=want):
                call(method, with_arg(Dl(dt, list(shape), strides=st)))


def test_shape_messages_keep_their_wording():
    # the GPU tests match these beginnings (python/tests/gpu/workers.py)
    args = good("dispatch")
    args[2] = cuda("int64", N - 1, K)
    with pytest.raises(ValueError, match=rf"^topk_idx must be \[{N}, {K}\] \(one row per token of x: {N} tokens\), got \[{N - 1}, {K}\]"):
        call("dispatch", args)
    args = good("ll_combine")
    args[3] = cuda("bfloat16", N, H // 2)
    with pytest.raises(ValueError, match=rf"^low_latency_combine: out is \[{N}, {H // 2}\], must be \[{N}, {H}\]"):
        call("ll_combine", args)
    args = good("ll_dispatch")
    args[0] = cuda("bfloat16", NUM_MAX + 1, H)
    args[1] = cuda("int64", NUM_MAX + 1, K)
    with pytest.raises(ValueError, match=rf"x has {NUM_MAX + 1} tokens, more than num_max_dispatch_tokens_per_rank={NUM_MAX}"):
        call("ll_dispatch", args)


def test_column_major_scales_and_dispatch_without_topk_pass():
    args = good("dispatch")
    args[1] = Dl("float32", [N, H // 128], strides=[1, N])  # column-major, as DeepEP's FP8 casts produce
    call("dispatch", args)
    args[2] = args[3] = None  # no top-k
    call("dispatch", args)
    with pytest.raises(ValueError, match=r"with scales, x must be float8_e4m3fn"):
        call("dispatch", [cuda("bfloat16", N, H)] + good("dispatch")[1:])


def test_reader_reads_numpy_through_dlpack_and_capsules_without_consuming_them():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    ptr, shape, strides, dtype, device = _native.read_tensor(a)
    assert (ptr, shape, strides, dtype, device) == (a.ctypes.data, [3, 2], [4, 2], "int64", "cpu")
    _, _, _, dtype, _ = _native.read_tensor(np.zeros(2, dtype=np.float16))
    assert dtype == "float16"
    d = Dl("bfloat16", [2, 8])
    cap = d.__dlpack__()
    assert _native.read_tensor(cap)[1:] == ([2, 8], [8, 1], "bfloat16", "cuda:0")
    assert _native.read_tensor(cap)[1] == [2, 8]  # still readable: not consumed


def test_the_stub_file_describes_every_class_method_and_function():
    # _native.pyi stays true to the module: the same classes, public methods/attributes and
    # functions (a method added in Rust without its stub, or a stale stub, fails here)
    tree = ast.parse(open(PYI).read())
    stub_classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    stub_funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    real_classes = {k for k, v in vars(_native).items() if isinstance(v, type)}
    real_funcs = {k for k, v in vars(_native).items() if callable(v) and not isinstance(v, type)}
    assert set(stub_classes) == real_classes
    assert stub_funcs == real_funcs
    for name, node in stub_classes.items():
        stub = {f.name for f in node.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
        stub |= {a.target.id for a in node.body if isinstance(a, ast.AnnAssign)}
        real = {a for a in dir(getattr(_native, name)) if not a.startswith("_")}
        assert stub == real, (name, sorted(stub ^ real))


def test_versioned_dlpack_capsules_are_read_too():
    class Versioned(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                    ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]

    d = Dl("int64", [3, 5])
    v = Versioned(1, 0, None, None, 0, d.managed.dl_tensor)
    cap = _capsule_new(ctypes.addressof(v), b"dltensor_versioned", None)
    assert _native.read_tensor(cap)[1:] == ([3, 5], [5, 1], "int64", "cuda:0")
    used = _capsule_new(ctypes.addressof(v), b"used_dltensor", None)
    with pytest.raises(ValueError, match="already consumed"):
        _native.read_tensor(used)


# A stand-in for torch (CI has none: the real one is read on the GPU machine, python/tests/gpu):
# a module named torch whose Tensor answers the attributes the reader asks for. Run in a fresh
# interpreter, since the extension caches the torch module it first sees for the process.
_FAKE_TORCH = r'''
import json, sys, types

torch = types.ModuleType("torch")
class _DType:
    def __init__(self, name):
        self.name = name
    def __str__(self):
        return "torch." + self.name
for n in ("bfloat16", "float32", "int32", "int64", "uint8", "float8_e4m3fn", "bool", "float16"):
    setattr(torch, n, _DType(n))

class Tensor:
    def __init__(self, dtype, shape, strides, ptr, dev):
        self.dtype, self.shape, self._strides, self._ptr, self._dev = dtype, tuple(shape), tuple(strides), ptr, dev
    def is_contiguous(self):
        want, acc = [], 1
        for n in reversed(self.shape):
            want.insert(0, acc)
            acc *= max(n, 1)
        return tuple(want) == self._strides
    def stride(self):
        return self._strides
    def data_ptr(self):
        return self._ptr
    def get_device(self):
        return self._dev
    @property
    def device(self):
        return "cpu" if self._dev < 0 else f"cuda:{self._dev}"

class Moved(Tensor):
    """A subclass overriding data_ptr in Python: the reader must ask it by name."""
    def data_ptr(self):
        return self._ptr + 64

torch.Tensor = Tensor
sys.modules["torch"] = torch
from deepep_kernels import _native

out = {}
out["plain"] = _native.read_tensor(Tensor(torch.bfloat16, (4, 8), (8, 1), 0x1000, 0))
out["strided"] = _native.read_tensor(Tensor(torch.int64, (6, 3), (1, 6), 0x2000, 1))
out["cpu"] = _native.read_tensor(Tensor(torch.float32, (5,), (1,), 0x3000, -1))
out["half"] = _native.read_tensor(Tensor(torch.float16, (2, 2), (2, 1), 0x4000, 0))
out["subclass"] = _native.read_tensor(Moved(torch.bfloat16, (4, 8), (8, 1), 0x1000, 0))
state = {"world": 2, "num_max": 16, "num_experts": 8, "device": 0}
idx = Tensor(torch.int64, (6, 4), (4, 1), 0x5000, 0)
_native.check_call("ll_dispatch", state, Tensor(torch.bfloat16, (6, 256), (256, 1), 0x6000, 0), idx, None)
out["accepted"] = True
for name, x in (("float32 x", Tensor(torch.float32, (6, 256), (256, 1), 0x6000, 0)),
                ("cpu x", Tensor(torch.bfloat16, (6, 256), (256, 1), 0x6000, -1)),
                ("strided x", Tensor(torch.bfloat16, (6, 256), (1, 6), 0x6000, 0))):
    try:
        _native.check_call("ll_dispatch", state, x, idx, None)
        out[name] = None
    except (ValueError, TypeError) as e:
        out[name] = str(e)
print(json.dumps(out))
'''


def test_torch_tensors_are_read_by_attributes_and_checked(tmp_path):
    import json
    import subprocess
    import sys

    # the installed package this process tests (not the source tree: run from an empty folder)
    site = os.path.dirname(os.path.dirname(os.path.abspath(_native.__file__)))
    env = {**os.environ, "PYTHONPATH": site}
    r = subprocess.run([sys.executable, "-c", _FAKE_TORCH], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["plain"] == [0x1000, [4, 8], [8, 1], "bfloat16", "cuda:0"]
    assert out["strided"] == [0x2000, [6, 3], [1, 6], "int64", "cuda:1"]  # strides read only when not contiguous
    assert out["cpu"] == [0x3000, [5], [1], "float32", "cpu"]
    assert "float16" in out["half"][3]  # a dtype the kernels do not take keeps its name for the message
    assert out["subclass"][0] == 0x1000 + 64  # a subclass's own data_ptr is honoured
    assert out["accepted"] is True
    assert out["float32 x"] == "x must be torch.bfloat16, got torch.float32"
    assert out["cpu x"].startswith("x must be on a CUDA device (got cpu)"), out["cpu x"]
    assert out["strided x"].startswith("x must be contiguous (shape [6, 256], strides [1, 6])"), out["strided x"]
