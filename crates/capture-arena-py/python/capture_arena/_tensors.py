"""Argument conversion: tensors and arrays to the uint8 views the compiled module copies from.

Nothing here copies data except making a non-contiguous (or non-native byte order) input
contiguous and native, once. The compiled module reads each view's address and length from its
``__array_interface__`` and keeps the view referenced while it uses the memory.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import numpy as np

from .errors import InvalidReadError, InvalidSampleError

HostBytes = tuple[Any, list[int], str]
"""``(uint8 view, shape, dtype name)``: the view keeps the tensor's memory alive."""

_NP_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": None,  # ml_dtypes.bfloat16, imported at its first use (importing it takes ~1 s)
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}


#: The dtype names the contract has (what a feature's ``dtype`` may be).
DTYPES = tuple(_NP_DTYPES)


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a contract dtype name (bfloat16 through ml_dtypes)."""
    if name not in _NP_DTYPES:
        raise InvalidSampleError(f"unsupported dtype {name!r} (supported: {', '.join(_NP_DTYPES)})")
    if _NP_DTYPES[name] is None:
        _NP_DTYPES[name] = importlib.import_module("ml_dtypes").bfloat16
    dt: np.dtype[Any] = np.dtype(_NP_DTYPES[name])
    return dt


def _torch() -> Any:
    """torch, imported only when a torch tensor shows up (it is optional)."""
    return importlib.import_module("torch")


def is_torch(t: object) -> bool:
    """True for a torch tensor (without importing torch)."""
    return type(t).__module__.split(".")[0] == "torch"


class CudaBytes:
    """A CUDA tensor handed to the compiled module, which reads its address, length and device
    from the tensor itself (and checks it is contiguous), and keeps it referenced while it uses
    the memory. ``stream`` is the raw handle of the tensor's current stream when it was handed
    over: the writer records an event there and its copies wait for it, so the capture kernels
    need not have finished."""

    __slots__ = ("tensor", "stream")
    tensor: Any
    stream: int

    def __init__(self, tensor: Any) -> None:
        torch = _torch()
        # Set once, here: the compiled module hands ``stream`` to the CUDA driver, which does not
        # check a stream handle, so it must be one torch gave.
        object.__setattr__(self, "tensor", tensor)
        object.__setattr__(self, "stream", int(torch.cuda.current_stream(tensor.device).cuda_stream))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"CudaBytes is read-only: wrap another tensor instead of setting {name!r}")


def _torch_bytes(t: Any, host: bool = False) -> HostBytes:
    torch = _torch()
    # Refused before any copy below (.cpu(), .contiguous()) costs the whole tensor's bytes.
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _NP_DTYPES:
        raise InvalidSampleError(f"unsupported dtype {dtype!r} (supported: {', '.join(_NP_DTYPES)})")
    if t.device.type == "cuda" and host:
        t = t.detach().cpu()
    if t.device.type == "cuda":
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return CudaBytes(t), [int(d) for d in t.shape], dtype
    if t.device.type != "cpu":
        raise InvalidSampleError(f"tensor on {t.device}: publish CPU or CUDA tensors")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    shape = [int(d) for d in t.shape]
    return t.reshape(-1).view(torch.uint8).numpy(), shape, dtype


def _dlpack_is_cuda(t: Any) -> bool:
    """True for a DLPack object on a CUDA device (kDLCUDA = 2, kDLCUDAManaged = 13)."""
    dev = getattr(t, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        kind = int(dev()[0])
    except Exception:  # a look-alike that cannot say: treat it as host memory
        return False
    return kind in (2, 13)


def host_bytes(t: Any, host: bool = False) -> HostBytes:
    """Describes the bytes of a numpy array, a torch tensor (CPU, or CUDA as a
    :class:`CudaBytes`), or any object that offers DLPack or the buffer protocol, without copying
    (unless it is not C-contiguous or not in native byte order). ``host=True`` copies CUDA tensors
    to the host."""
    if isinstance(t, np.ndarray):
        if type(t) is not np.ndarray:  # a subclass (np.memmap, a masked array): its plain bytes
            t = t.view(np.ndarray)
        if t.flags.c_contiguous and t.dtype.isnative:  # the common case, no conversion at all
            return t.reshape(-1).view(np.uint8), list(t.shape), t.dtype.name
        a = t
    elif is_torch(t):
        return _torch_bytes(t, host)
    elif hasattr(t, "__dlpack__"):
        if _dlpack_is_cuda(t):
            # A CUDA array of another library (CuPy, JAX, ...): seen through torch, without a copy.
            try:
                torch = _torch()
            except ImportError:
                raise InvalidSampleError(
                    f"{type(t).__name__} lives on a CUDA device: publishing CUDA memory through "
                    "DLPack needs torch (pip install torch), or move it to the host"
                ) from None
            return _torch_bytes(torch.from_dlpack(t), host)
        a = np.from_dlpack(t)
    else:
        a = np.asarray(t)
    shape = list(a.shape)  # before ascontiguousarray, which makes 0-d arrays 1-d
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8), shape, a.dtype.name


def out_bytes(a: Any, shape: list[int], dtype: str) -> Any:
    """The writable uint8 view of an ``out=`` array or tensor, which must have the feature's
    shape and dtype and be C-contiguous."""
    if is_torch(a):
        torch = _torch()
        if a.device.type not in ("cpu", "cuda") or not a.is_contiguous():
            raise InvalidReadError("out= tensors must be contiguous, on the CPU or a CUDA device")
        if list(a.shape) != shape or str(a.dtype).removeprefix("torch.") != dtype:
            raise InvalidReadError(f"out= tensor is {list(a.shape)} {a.dtype}, the feature is {shape} {dtype}")
        if a.device.type == "cuda":
            return CudaBytes(a)
        return a.reshape(-1).view(torch.uint8).numpy()
    if not isinstance(a, np.ndarray):
        raise InvalidReadError(f"out= must hold numpy arrays or torch tensors, not {type(a).__name__}")
    if list(a.shape) != shape or a.dtype != numpy_dtype(dtype):
        raise InvalidReadError(f"out= array is {list(a.shape)} {a.dtype}, the feature is {shape} {dtype}")
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise InvalidReadError("out= arrays must be writable and C-contiguous")
    return a.reshape(-1).view(np.uint8)


def new_array(shape: list[int], dtype: str, torch: bool, device: Optional[str] = None) -> tuple[Any, Any]:
    """A fresh output array (numpy, or torch with ``torch=True``, on ``device`` if given) and
    what the compiled module writes: its uint8 view, or a :class:`CudaBytes` for a CUDA
    tensor."""
    if torch or device is not None:
        t = _torch()
        arr = t.empty(shape, dtype=getattr(t, dtype), device=device or "cpu")
        if arr.device.type == "cuda":
            return arr, CudaBytes(arr)
        if arr.device.type != "cpu":
            raise InvalidReadError(f"device={device!r}: read into CPU or CUDA tensors")
        return arr, arr.reshape(-1).view(t.uint8).numpy()
    a = np.empty(shape, dtype=numpy_dtype(dtype))
    return a, a.reshape(-1).view(np.uint8)
