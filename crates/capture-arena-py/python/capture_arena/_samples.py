"""Captured samples in, result rows out: what both sinks (:mod:`._sink`, :mod:`._store`) share.
Validates a caller's ``(spec, aux, last_hidden)`` into what the native writer takes, and makes
the error rows of samples that cannot be published."""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from . import _logs
from . import _tensors
from ._tensors import CudaBytes, HostBytes, host_bytes
from .errors import InvalidReadError, InvalidSampleError


Result = dict[str, Any]
"""A per-sample result: ``{"sample_id", "store_id", "gen", "aux_layer_ids", "features",
"arena"}``, or ``{"sample_id", "error"}`` for a sample of a failed batch."""

Sample = tuple[Mapping[str, Any], Any, Any]
"""``(spec, aux, last_hidden)`` exactly as the existing sink receives them."""


_log = _logs.get("capture_arena")


def _torch_module() -> Any:
    return importlib.import_module("torch")

#: The longest id or name text accepted (a key holds at most 1024 bytes in all).
_MAX_TEXT = 1024
#: The most features a result may name (readers refuse more: the core's ``MAX_FEATURES``).
MAX_FEATURES = 256


def feature_names(features: Any, names: Optional[Iterable[Any]] = None) -> list[str]:
    """The names of a result's ``features`` to read (all, or ``names`` once each), checked before
    anything is built from them: a mapping of at most :data:`MAX_FEATURES` string names, and at
    most that many asked for, in at most 16 times as many items (an endless iterable is read no
    further), else :class:`InvalidReadError`."""
    if not isinstance(features, Mapping) or len(features) > MAX_FEATURES:
        what = f"{len(features)} of them" if isinstance(features, Mapping) else type(features).__name__
        raise InvalidReadError(f"a result's features are a mapping of at most {MAX_FEATURES} names, not {what}")
    wanted: dict[Any, None] = {}
    for i, n in enumerate(features if names is None else names):
        wanted[n] = None
        if len(wanted) > MAX_FEATURES or i >= 16 * MAX_FEATURES:
            raise InvalidReadError(f"more than {MAX_FEATURES} feature names asked for (a result names at most {MAX_FEATURES})")
    bad = next((n for n in wanted if not isinstance(n, str)), None)
    if bad is not None:
        raise InvalidReadError(f"feature names are strings, not {type(bad).__name__} ({_logs.shown(repr(bad), 100)})")
    return list(wanted)
#: The highest rank a tensor may have (the core's ``MAX_RANK``).
MAX_DIMS = 8


def _text(what: str, v: Any) -> str:
    """An id or name as SGLang's sink takes it (``str(v)``), bounded."""
    if isinstance(v, (list, tuple, dict, set)) or v is None:
        raise InvalidSampleError(f"`{what}` must be a string or a number, not {type(v).__name__}")
    t = v if isinstance(v, str) else str(v)
    if len(t) > _MAX_TEXT:
        raise InvalidSampleError(f"`{what}` is {len(t)} characters; a key holds at most {_MAX_TEXT} bytes in all")
    return t


def _coerce_spec(spec: Any) -> dict[str, Any]:
    """A request's ``spec_capture`` as the sink it replaces reads it: ``str(store_id)``,
    ``str(sample_id)``, ``int(gen)`` (default 1), ``bool(replace)``, feature and passthrough
    names as text, passthrough shapes as ints and ``dtype`` defaulting to ``int64``; array
    ``data`` is cast to the declared dtype (as ``torch.tensor(data, dtype=...)`` does), lists
    are read by the compiled code. Raises for what it cannot read; the caller makes that the
    sample's error row."""
    if not isinstance(spec, Mapping):
        raise InvalidSampleError(f"a spec_capture must be a dict, not {type(spec).__name__}")
    out: dict[str, Any] = {}
    for k in ("store_id", "sample_id"):
        if spec.get(k) is None:
            raise InvalidSampleError(f"spec_capture lacks `{k}`")
        out[k] = _text(k, spec[k])
    gen = spec.get("gen")
    try:
        out["gen"] = 1 if gen is None else int(gen)
    except (TypeError, ValueError):
        raise InvalidSampleError(f"`gen` must be an integer >= 1, not {gen!r:.40}") from None
    out["replace"] = bool(spec.get("replace", False))
    feats = spec.get("features") or {}
    if not isinstance(feats, Mapping):
        raise InvalidSampleError("`features` must map artifacts (aux, last_hidden) to feature names")
    out["features"] = {a: _text(f"features.{a}", feats[a]) for a in ("aux", "last_hidden") if feats.get(a) is not None}
    passthrough = spec.get("passthrough") or ()
    if not isinstance(passthrough, (list, tuple)):
        raise InvalidSampleError("`passthrough` must be a list")
    if len(out["features"]) + len(passthrough) > MAX_FEATURES:
        # Readers refuse a result naming more (it could be neither read nor released).
        raise InvalidSampleError(
            f"{len(out['features']) + len(passthrough)} features ({len(passthrough)} passthrough), more than the "
            f"{MAX_FEATURES} a result may name: send fewer passthrough tensors"
        )
    items = []
    for p in passthrough:
        if not isinstance(p, Mapping):
            raise InvalidSampleError("a passthrough must be a dict")
        name = _text("passthrough name", p.get("name"))
        dtype = p.get("dtype")
        dtype = "int64" if dtype is None else _text(f"passthrough {name!r} dtype", dtype)
        if dtype not in _tensors.DTYPES:
            raise InvalidSampleError(f"passthrough {name!r}: unsupported dtype {dtype!r} (supported: {', '.join(_tensors.DTYPES)})")
        shape = p.get("shape")
        if shape is None:
            raise InvalidSampleError(f"passthrough {name!r} lacks `shape`")
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
            raise InvalidSampleError(f"passthrough {name!r}: `shape` must be a list of at most {MAX_DIMS} integers")
        try:
            shape = [int(d) for d in shape]
        except (TypeError, ValueError):
            raise InvalidSampleError(f"passthrough {name!r}: `shape` must be a list of integers") from None
        data = p.get("data")
        if isinstance(data, tuple):
            data = list(data)
        elif data is not None and not isinstance(data, list):
            data = _cast(data, dtype)
        items.append({"name": name, "dtype": dtype, "shape": shape, "data": data})
    out["passthrough"] = items
    return out


def _cast(data: Any, dtype: str) -> Any:
    """Array ``data`` (torch, numpy) in the declared dtype, cast if it differs."""
    if _tensors.is_torch(data):
        torch = _torch_module()
        want = getattr(torch, dtype, None)
        if want is not None and data.dtype != want:
            return data.detach().to(want)
        return data
    if isinstance(data, np.ndarray):
        want_np = _tensors.numpy_dtype(dtype)
        return data if data.dtype == want_np else data.astype(want_np)
    return data


def _prepare(item: Any, host: bool) -> Any:
    """One ``(spec, aux, last_hidden)`` item for the compiled sink, or its error row."""
    try:
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise InvalidSampleError("a sample is a (spec_capture, aux, last_hidden) tuple")
        spec, aux, last_hidden = item
        spec = _coerce_spec(spec)
        arrays: Optional[dict[str, HostBytes]] = None
        if any(p["data"] is not None and not isinstance(p["data"], list) for p in spec["passthrough"]):
            # Array data (numpy, torch, ...) travels as bytes, not as a list of numbers.
            arrays = {}
            for p in spec["passthrough"]:
                if p["data"] is not None and not isinstance(p["data"], list):
                    arrays[p["name"]] = host_bytes(p.pop("data"), host)
                    p["data"] = None
        captured = []
        for artifact, t in (("aux", aux), ("last_hidden", last_hidden)):
            try:
                b = None if t is None else host_bytes(t, host)
            except InvalidSampleError as e:
                raise InvalidSampleError(f"{artifact}: {e}") from None
            if b is not None and b[2] not in _tensors.DTYPES:
                raise InvalidSampleError(f"{artifact}: unsupported dtype {b[2]!r} (supported: {', '.join(_tensors.DTYPES)})")
            captured.append(b)
        return (spec, captured[0], captured[1], arrays)
    except Exception as e:  # the request's own fault: its row, nothing else
        return _error_row(item, f"invalid sample: {e}")


def _error_row(item: Any, error: str) -> Result:
    """``{"sample_id", "error"}`` for an item of a batch (its sample_id when it has one)."""
    sid: Any = None
    try:
        spec = item[0] if isinstance(item, (tuple, list)) and item else None
        sid = spec.get("sample_id") if isinstance(spec, Mapping) else None
        if not isinstance(sid, (str, int, float, bool, type(None))):
            sid = repr(sid)[:200]
    except Exception:
        pass
    return {"sample_id": sid, "error": error}


def _convert(samples: Iterable[Any], host: bool = False) -> list[Any]:
    """Every item of a batch for the compiled sink: its tensors described (``host=True``: CUDA
    tensors copied to the host first, for placements that publish host bytes), or its error
    row (a dict) where the item cannot be read."""
    return [_prepare(item, host) for item in samples]


def _rows_for(items: Sequence[Any], error: str) -> list[Result]:
    """Every item's row when the whole batch failed (rows already made are kept)."""
    return [it if isinstance(it, dict) else {"sample_id": it[0]["sample_id"], "error": error} for it in items]


def _log_failures(fut: "concurrent.futures.Future[list[Result]]") -> None:
    """One warning line per batch with failed samples (the scheduler writes them back to each
    request; this is the server's record)."""
    try:
        rows = fut.result()
    except Exception as e:
        _log.error("capture batch failed: %s", e)
        return
    _log_failures_of(rows)


class Warnings:
    """Warnings at most one a second of each kind (one per request or batch would flood the
    server's log: a full arena, an intake that refuses every record); those left out are counted
    in the next of their kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._left_out: dict[str, int] = {}
        _ALL_WARNINGS.add(self)

    def warn(self, kind: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(kind, 0.0):
                self._left_out[kind] = self._left_out.get(kind, 0) + 1
                return
            self._next[kind] = now + 1.0
            left_out = self._left_out.pop(kind, 0)
        if left_out:
            msg += f" ({left_out} more like it since the last)"
        _log.warning(msg, *args, exc_info=exc_info)


#: Every limiter: a fork may come while another thread holds one's lock, so the child's are new.
_ALL_WARNINGS: "weakref.WeakSet[Warnings]" = weakref.WeakSet()


def _new_warning_locks() -> None:
    for w in list(_ALL_WARNINGS):
        w._lock = threading.Lock()


os.register_at_fork(after_in_child=_new_warning_locks)

_FAILURES = Warnings()


def _log_failures_of(rows: list[Result]) -> None:
    """One warning per batch with failures, at most one a second (the scheduler thread calls
    this per request under a synchronous patch: a full arena would flood the log); the ones
    left out are counted in the next."""
    bad = [r for r in rows if "error" in r]
    if bad:
        _FAILURES.warn(
            # Cut to a log line: a refused sample id may be megabytes.
            "batch", "%d of %d captured samples failed (first: sample %.200r: %.2000s)", len(bad), len(rows), bad[0].get("sample_id"), bad[0]["error"]
        )


def _complete(fut: "concurrent.futures.Future[list[Result]]", items: Sequence[Any], error: str) -> None:
    """Completes a batch's future with every item's error row, unless it is done already."""
    if not fut.done():
        try:
            fut.set_result(_rows_for(items, error))
        except concurrent.futures.InvalidStateError:
            pass


def _cuda_device(x: Any) -> Optional[int]:
    """The GPU of a converted tensor ``(view, shape, dtype)`` if it is a CUDA tensor; the first
    of a passthrough dict's."""
    if isinstance(x, dict):
        return next((d for d in map(_cuda_device, x.values()) if d is not None), None)
    if isinstance(x, tuple) and x and isinstance(x[0], CudaBytes):
        return int(x[0].tensor.get_device())
    return None


def _interrupts(e: BaseException) -> bool:
    """Whether ``e`` ends the thread it is raised in (Ctrl+C, ``sys.exit``), as opposed to an
    error of a call, a panic of the extension among them (pyo3's ``PanicException`` derives from
    ``BaseException`` only)."""
    return isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit))


def _reason(e: BaseException) -> str:
    """``e``'s message, or its type's name where it has none."""
    return str(e) or type(e).__name__
