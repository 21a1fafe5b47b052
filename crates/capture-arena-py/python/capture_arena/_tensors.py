"""Argument conversion: tensors and arrays to the byte views the compiled module copies from.

Nothing here copies data except making a non-contiguous input contiguous (once).
"""

from __future__ import annotations

import importlib
from typing import Any

import ml_dtypes  # noqa: F401  (registers numpy's bfloat16)
import numpy as np

HostBytes = tuple[Any, int, int, list[int], str]
"""``(owner, address, nbytes, shape, dtype name)``: ``owner`` keeps the memory alive."""

_NP_DTYPES = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a contract dtype name (bfloat16 through ml_dtypes)."""
    try:
        dt: np.dtype[Any] = np.dtype(_NP_DTYPES[name])
        return dt
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (supported: {', '.join(_NP_DTYPES)})") from None


def _is_torch(t: object) -> bool:
    return type(t).__module__.split(".")[0] == "torch"


def _torch() -> Any:
    """torch, imported only when a torch tensor shows up (it is optional)."""
    return importlib.import_module("torch")


def _torch_bytes(t: Any) -> HostBytes:
    torch = _torch()

    if t.device.type != "cpu":
        raise ValueError(
            f"tensor on {t.device}: this build publishes host tensors; move it to the CPU "
            "(device arenas come with the cuda feature)"
        )
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    shape = [int(d) for d in t.shape]
    dtype = str(t.dtype).removeprefix("torch.")
    flat = t.reshape(-1).view(torch.uint8)
    return flat, int(flat.data_ptr()), int(flat.numel()), shape, dtype


def host_bytes(t: Any) -> HostBytes:
    """Describes the bytes of a numpy array, a torch CPU tensor, or any object that offers DLPack
    or the buffer protocol, without copying (unless it is not C-contiguous)."""
    if _is_torch(t):
        return _torch_bytes(t)
    if isinstance(t, np.ndarray):
        a = t
    elif hasattr(t, "__dlpack__"):
        a = np.from_dlpack(t)
    else:
        a = np.asarray(t)
    shape = [int(d) for d in a.shape]  # before ascontiguousarray, which makes 0-d arrays 1-d
    a = np.ascontiguousarray(a)
    return a, int(a.ctypes.data), int(a.nbytes), shape, a.dtype.name


def writable_bytes(a: Any) -> tuple[Any, int, int]:
    """``(owner, address, nbytes)`` of a writable C-contiguous numpy array or torch CPU tensor."""
    if _is_torch(a):
        if a.device.type != "cpu" or not a.is_contiguous():
            raise ValueError("out= tensors must be contiguous and on the CPU")
        return a, int(a.data_ptr()), int(a.numel() * a.element_size())
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError("out= arrays must be writable, C-contiguous numpy arrays")
    return a, int(a.ctypes.data), int(a.nbytes)
