"""PackedWeight: a weight in oneDNN's blocked layout as plain bytes, and back, without a reorder.

References: torch's AOTInductor (it ships oneDNN-packed constants as bytes plus oneDNN's
serialized memory descriptor, and rebuilds them with `aoti_torch_create_tensor_from_blob_v2`),
oneDNN's `memory::desc` serialization.

linear.py runs its dense forms (bfloat16, float16, float32) as oneDNN matmuls on a weight packed
by `torch.ops.mkldnn._reorder_linear_weight`: on this repo's AMX host the plain weight runs
10-40% slower at 8-256 rows (the matmul re-blocks it every call; docs/performance.md "Kernel
forms chosen by measurement"). The packed tensor is opaque to torch, so before this module every
start repacked every dense form: 2.1 s of a 1B model's warm start and 2.1 GB of anonymous memory
per worker. Here the packed bytes are copied out once (`to_arrays`, for the repack cache) and a
later start wraps the cache's memory map of them as the packed tensor itself (`from_arrays`):
no reorder, no copy, and the pages are the page cache's, shared between workers of one model.

The blocked layout depends on the CPU's instruction set and on oneDNN's version, so the arrays
carry a tag of both (`LAYOUT_TAG`); a map made elsewhere is refused and the form repacked.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_DTYPE_FUNCTIONS = {torch.bfloat16: "aoti_torch_dtype_bfloat16",
                    torch.float16: "aoti_torch_dtype_float16",
                    torch.float32: "aoti_torch_dtype_float32"}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


# NOTE: what decides the blocked layout oneDNN picks: its ISA dispatch (the CPU's flags) and
# its version (torch's)
LAYOUT_TAG = hashlib.sha256(f"{torch.__version__}\0{_cpu_flags()}".encode()).hexdigest()[:16]


class _Shim:
    """torch's C entry points that wrap external memory as an opaque oneDNN tensor."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        self.create = lib.aoti_torch_create_tensor_from_blob_v2
        self.create.restype = ctypes.c_int32
        self.constants = {name: self._int(lib, name) for name in
                          ("aoti_torch_layout__mkldnn", "aoti_torch_device_type_cpu",
                           *_DTYPE_FUNCTIONS.values())}
        self.capsule = ctypes.pythonapi.PyCapsule_New
        self.capsule.restype = ctypes.py_object
        self.capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        self.steal = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr

    @staticmethod
    def _int(lib: ctypes.CDLL, name: str) -> int:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int32
        return int(fn())


@functools.cache
def _shim() -> _Shim | None:
    try:
        if not (hasattr(torch.ops.mkldnn, "_get_mkldnn_serialized_md")
                and hasattr(torch.ops.mkldnn, "data_ptr")):
            return None
        return _Shim()
    except (OSError, AttributeError) as exc:  # another torch build: repack every start
        logger.info("oneDNN-packed weights cannot be mapped with this torch (%s): the dense "
                    "forms are packed at every start", exc)
        return None


def available() -> bool:
    return _shim() is not None


@functools.cache
def runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs a matmul in `dtype` on this CPU. Not every CPU has every
    dtype: bfloat16 needs avx512bw/vl/dq or avx_ne_convert (an AMD Zen 3 has neither), float16
    avx512_fp16 or avx_ne_convert (a Zen 5 has neither); packing refuses, naming what is
    missing."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), packed, None, "none",
                                           [None], "")
    except RuntimeError as exc:
        logger.info("oneDNN does not run %s on this CPU (%s)", dtype, exc)
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's blocked layout (an opaque tensor, anonymous memory)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def to_arrays(packed: torch.Tensor) -> dict[str, np.ndarray]:
    """The packed tensor's bytes and descriptor as arrays (views of its memory: keep `packed`
    alive while they are used), tagged with the layout they were made for."""
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    raw = (ctypes.c_uint8 * nbytes).from_address(int(torch.ops.mkldnn.data_ptr(packed)))
    md = torch.ops.mkldnn._get_mkldnn_serialized_md(packed).numpy()
    return {"packed": np.frombuffer(memoryview(raw), dtype=np.uint8), "md": md,
            "tag": np.frombuffer(LAYOUT_TAG.encode(), dtype=np.uint8)}


def from_arrays(arrays: dict[str, np.ndarray], shape: tuple[int, int], dtype: torch.dtype
                ) -> torch.Tensor | None:
    """The packed tensor whose memory is `arrays["packed"]` (no copy: the caller keeps that
    array alive as long as the tensor), or None where the arrays are for another CPU or
    oneDNN, or this torch cannot wrap them."""
    shim = _shim()
    packed, md, tag = arrays.get("packed"), arrays.get("md"), arrays.get("tag")
    if shim is None or packed is None or md is None or tag is None:
        return None
    if bytes(tag) != LAYOUT_TAG.encode() or dtype not in _DTYPE_FUNCTIONS:
        return None
    sizes = (ctypes.c_int64 * 2)(*shape)
    strides = (ctypes.c_int64 * 2)(shape[1], 1)
    md_bytes = bytes(md)
    handle = ctypes.c_void_p()
    status = shim.create(
        ctypes.c_void_p(packed.ctypes.data), ctypes.c_int64(2), sizes, strides,
        ctypes.c_int64(0), ctypes.c_int32(shim.constants[_DTYPE_FUNCTIONS[dtype]]),
        ctypes.c_int32(shim.constants["aoti_torch_device_type_cpu"]), ctypes.c_int32(0),
        ctypes.byref(handle), ctypes.c_int32(shim.constants["aoti_torch_layout__mkldnn"]),
        (ctypes.c_uint8 * len(md_bytes)).from_buffer_copy(md_bytes),
        ctypes.c_int64(len(md_bytes)))
    if status != 0 or not handle.value:
        return None
    tensor = shim.steal(shim.capsule(handle, None, None))
    # NOTE: a descriptor that does not describe these bytes (another shape, a truncated
    # file) would have oneDNN read past the map
    if (tuple(tensor.shape) != shape or tensor.dtype != dtype
            or int(torch.ops.mkldnn._nbytes(tensor)) != packed.nbytes):
        return None
    return tensor
