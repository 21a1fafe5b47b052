"""capture_arena: the capture server's arena, from Python.

- :class:`ArenaSink` is what an inference server's capture hook calls: it publishes each batch of
  captured samples into the arena and returns one result dict per sample.
- :class:`ArenaFeatureStore` is what a trainer uses, usually in another process: it reads a
  result's tensors and releases them.

Everything runs in the Rust core; this module only converts arguments. The GIL is released
while waiting and while copying.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import importlib
import importlib.util
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from . import _tensors, errors
from ._capture_arena import FEATURES, UCX_TCP_SEG_SIZE, ReadBuffer, __version__, _ArenaSink, _exiting, _result_keys, _send_frees, _Store, arena_enabled, placement
from . import _pool
from ._live import LiveSink
from ._store import StoreReader, StoreSink, is_store_result
from ._tensors import CudaBytes, HostBytes, host_bytes, new_array, out_bytes
from .errors import *  # noqa: F401,F403


def _nixl_defaults() -> None:
    """NIXL's environment, set before its library loads (on the first ``nixl://`` session):
    ``SGLANG_SPEC_CAPTURE_NIXL_LIB`` from an installed ``nixl-cu12`` wheel when unset,
    ``UCX_MODULES=^ib`` where the machine has no InfiniBand device (UCX's InfiniBand module
    crashes at exit there, in the libnl the wheel bundles), UCX's TCP segment size, and the NIXL
    server process (``SGLANG_SPEC_CAPTURE_NIXL_SERVER``)."""
    if "nixl" not in FEATURES:
        return
    if not os.environ.get("SGLANG_SPEC_CAPTURE_NIXL_LIB"):
        spec = importlib.util.find_spec("nixl_cu12")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            libs = os.path.join(os.path.dirname(loc), ".nixl_cu12.mesonpy.libs")
            if os.path.exists(os.path.join(libs, "libnixl_capi.so")):
                os.environ["SGLANG_SPEC_CAPTURE_NIXL_LIB"] = libs
                break
    if "UCX_MODULES" not in os.environ and not (os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")):
        os.environ["UCX_MODULES"] = "^ib"
    # Over TCP a READ comes back in segments of this size (UCX's default, 8 KiB, made reads across
    # hosts 0.58 x a Mooncake TransferEngine's; 512 KiB: 2.3 x). Both sides need the same value.
    for var in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"):
        os.environ.setdefault(var, UCX_TCP_SEG_SIZE)
    # A host arena's READs are served by a process of its own (UCX can abort the process it runs
    # in: that must not be SGLang's); ``inline`` serves them in this process.
    os.environ.setdefault("SGLANG_SPEC_CAPTURE_NIXL_SERVER", json.dumps([sys.executable, "-m", "capture_arena._nixl_serve"]))


_nixl_defaults()

__all__ = [
    "ArenaSink",
    "StoreSink",
    "ArenaFeatureStore",
    "ReadBuffer",
    "FEATURES",
    "new_sink",
    "placement",
    "arena_enabled",
    "errors",
    "__version__",
    *errors.__all__,
]

Result = dict[str, Any]
"""A per-sample result: ``{"sample_id", "store_id", "gen", "aux_layer_ids", "features",
"arena"}``, or ``{"sample_id", "error"}`` for a sample of a failed batch."""

Sample = tuple[Mapping[str, Any], Any, Any]
"""``(spec, aux, last_hidden)`` exactly as the existing sink receives them."""


_log = logging.getLogger("capture_arena")

#: The longest id or name text accepted (a key holds at most 1024 bytes in all).
_MAX_TEXT = 1024


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
            b = None if t is None else host_bytes(t, host)
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


_failures = {"next": 0.0, "suppressed": 0}
_failures_lock = threading.Lock()


def _log_failures_of(rows: list[Result]) -> None:
    """One warning per batch with failures, at most one a second (the scheduler thread calls
    this per request under a synchronous patch: a full arena would flood the log); the ones
    left out are counted in the next."""
    bad = [r for r in rows if "error" in r]
    if not bad:
        return
    now = time.monotonic()
    with _failures_lock:
        if now < _failures["next"]:
            _failures["suppressed"] += 1
            return
        _failures["next"] = now + 1.0
        suppressed, _failures["suppressed"] = _failures["suppressed"], 0
    more = f"; {suppressed} more batches with failures since the last warning" if suppressed else ""
    _log.warning(
        "%d of %d captured samples failed (first: sample %r: %s)%s", len(bad), len(rows), bad[0].get("sample_id"), bad[0]["error"], more
    )


#: ``put_samples(within_s=...)`` left out: the sink's own ``sync_bound``.
_SINK_BOUND: Any = object()
#: After the arena could not be created, a synchronous caller tries again at most this often.
START_RETRY_S = 5.0


class ArenaSink(LiveSink, _ArenaSink):
    """The sink an inference server's capture hook calls.

    Every keyword argument defaults to its environment variable:

    ==========================  ============================================  =========
    argument                    variable                                      default
    ==========================  ============================================  =========
    ``arena_bytes``             ``SGLANG_SPEC_CAPTURE_ARENA_BYTES``            required
    ``control_host``            ``SGLANG_SPEC_CAPTURE_CONTROL_HOST``,          127.0.0.1
                                else ``MOONCAKE_LOCAL_HOSTNAME``
    ``control_port``            ``SGLANG_SPEC_CAPTURE_CONTROL_PORT``           0
    ``alignment``               ``SGLANG_SPEC_CAPTURE_ARENA_ALIGN``            256
    ``wait_s``                  ``SGLANG_SPEC_CAPTURE_ARENA_WAIT_S``           30
    ``max_pending_batches``     ``SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES``    2
    ``timing``                  ``SGLANG_SPEC_CAPTURE_TIMING``                 off
    ``protocol``                ``MOONCAKE_PROTOCOL``                          unset
    ``gpu_put``                 ``SGLANG_SPEC_CAPTURE_GPU_PUT``                unset
    ``eager``                   ``SGLANG_SPEC_CAPTURE_ARENA_EAGER``            off
    ``device``                  ``SGLANG_SPEC_CAPTURE_ARENA_DEVICE``           first CUDA tensor's
    ``transport``               ``SGLANG_SPEC_CAPTURE_TRANSPORT``              auto (``nixl``: any host)
    ``control_token``           ``SGLANG_SPEC_CAPTURE_CONTROL_TOKEN``          none (``auto``: random)
    ``aux_layer_ids``           (none; echoed in every result)                None
    ==========================  ============================================  =========

    ``sync_wait_s`` is ``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S`` (default 1): with ``sync_bound`` set
    to it (as :mod:`capture_arena.sglang` does), :meth:`put_samples` and :meth:`put_sample`
    never create the arena on the caller's thread and wait at most that long for their batch to
    start (see :meth:`put_samples`).

    Nothing is allocated until the first capture: that creates the arena (and pre-faults it,
    about half a second per GiB) on a background thread, so the caller's thread pays nothing;
    the first batches wait for it there, in order. With ``eager=True`` the arena is created
    here instead (GIL released); :func:`capture_arena.sglang.maybe_init_sink` starts it in the
    background instead, and only on the rank that captures. The sink reads tensors in place: a
    tensor handed to it must not be written, resized or freed until its batch's results are
    back. ``close()`` (or leaving a ``with`` block, or interpreter exit) stops the writer and
    removes the arena.
    """

    _starting = threading.Lock()

    def __init__(self, **kwargs: Any) -> None:
        # The arguments were taken by the compiled __new__; register for the close at exit.
        _LIVE_SINKS.add(self)
        # Batches that arrived before the writer started, in order, for the starter thread.
        self._early: collections.deque[tuple[list[Any], concurrent.futures.Future[list[Result]]]] = collections.deque()
        self._early_lock = threading.Condition()
        self._starter: Optional[threading.Thread] = None
        #: Seconds a synchronous call waits for its batch to start (None: as long as the arena's
        #: wait for frees, creating the arena on the caller's thread if needed).
        self.sync_bound: Optional[float] = None
        #: Why the last start on the starter thread failed (None once one succeeded), when, and
        #: how many starts the starter thread has finished.
        self._start_error: Optional[str] = None
        self._start_failed_at = -START_RETRY_S
        self._starts_done = 0
        if self.eager:
            self._ensure_started()  # the engine placement's arena (the others started already)

    def _ensure_started(self, converted: Optional[list[Any]] = None, device: Optional[int] = None) -> None:
        """Creates the arena and starts the writer if it has not (the caller's thread pays): the
        engine placement takes its arena from a Mooncake TransferEngine (on the configured GPU,
        else the GPU of the batch's first CUDA tensor, else 0); the others create it in the
        compiled sink. A configured device wins over ``device``."""
        if self.started:
            return
        if self.device is not None:
            device = self.device
        if device is None:
            device = next((d for d in (_cuda_device(x) for s in converted or () if not isinstance(s, dict) for x in s[1:]) if d is not None), None)
        if self.placement != "engine":
            self._start(device)
            return
        with ArenaSink._starting:
            if self.started:
                return
            nbytes = self.arena_bytes
            if nbytes is None:
                raise ConfigError(
                    "the engine placement needs the arena size: set SGLANG_SPEC_CAPTURE_ARENA_BYTES "
                    "(or arena_bytes=); it is never taken silently"
                )
            from ._engine import EngineArena, protocol_of

            arena = EngineArena(nbytes, protocol_of(self.protocol), device)
            self._start_with_region(arena.ptr, arena.nbytes, arena.session, arena, arena.device)

    def start_in_background(self, device: Optional[int] = None) -> None:
        """Creates the arena on the starter thread now, before the first capture (what
        ``SGLANG_SPEC_CAPTURE_ARENA_EAGER=1`` does under SGLang); batches submitted meanwhile
        wait for it there. A failure is logged, and the first capture tries again."""
        self._enqueue([], None, block=True, device=device)

    @classmethod
    def from_env(cls) -> "ArenaSink":
        """A sink configured from the environment alone."""
        return cls()

    def submit_samples(self, samples: Sequence[Sample], *, block: bool = True) -> "concurrent.futures.Future[list[Result]]":
        """Queues a batch and returns a future of its rows, one per sample, in order: a result
        dict, or ``{"sample_id", "error"}``.

        Never raises for anything a request or the machine causes: a sample that cannot be
        published (a bad spec, a tensor that does not match it, a key too long, a duplicate
        within the batch) gets its own error row and the others are published; a batch that
        fails as a whole (arena full after ``wait_s``, the arena cannot be created, the sink is
        closed) gives every sample its row. Blocks (GIL released) while the writer already holds
        ``max_pending_batches`` batches; ``block=False`` raises :class:`QueueFullError` instead
        (and queues nothing). Before the writer has started, the batch waits on the starter
        thread, not here. Do not write, resize or free the tensors until the future is done.
        Callbacks added to the future run on the sink's helper thread and must not block.
        """
        fut: concurrent.futures.Future[list[Result]] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        fut.add_done_callback(_log_failures)
        try:
            items = _convert(samples)
        except Exception as e:  # not a sequence of samples at all: no rows can be made
            fut.set_exception(InvalidSampleError(f"submit_samples takes a list of (spec, aux, last_hidden): {e}"))
            return fut
        if all(isinstance(it, dict) for it in items):  # nothing to publish: no arena needed
            fut.set_result(items)
            return fut
        try:
            early = not self.started or bool(self._early)
        except Exception as e:  # closed
            _complete(fut, items, str(e))
            return fut
        if early:
            self._enqueue(items, fut, block)
        else:
            self._submit_now(items, fut, block)
        return fut

    def _submit_now(self, items: list[Any], fut: "concurrent.futures.Future[list[Result]]", block: bool) -> None:
        try:
            self._submit(items, fut, block)
        except QueueFullError:
            if not block:
                raise
            _complete(fut, items, "the writer's queue is full")
        except Exception as e:
            _complete(fut, items, str(e))

    def _enqueue(
        self, items: list[Any], fut: "Optional[concurrent.futures.Future[list[Result]]]", block: bool, device: Optional[int] = None
    ) -> None:
        """Hands a batch that arrived before the writer started to the starter thread."""
        limit = max(1, self.max_pending_batches)
        with self._early_lock:
            while fut is not None and len(self._early) >= limit:
                if not block:
                    raise QueueFullError(f"{len(self._early)} batches already wait for the arena to be created")
                self._early_lock.wait(1.0)
            self._early.append((items, fut))  # type: ignore[arg-type]
            if self._starter is None:
                self._starter = threading.Thread(target=self._start_early, args=(device,), name="capture-arena-start", daemon=True)
                self._starter.start()

    def _start_early(self, device: Optional[int]) -> None:
        """The starter thread: creates the arena (GIL released while it does), then submits the
        batches that waited for it, in order; a failed start fails the batch at hand with the
        reason, and the next batch tries again."""
        while True:
            with self._early_lock:
                if not self._early:
                    self._starter = None
                    return
                items, fut = self._early[0]
            try:
                self._ensure_started(items or None, device)
            except Exception as e:
                self._start_error = str(e)
                self._start_failed_at = time.monotonic()
                if fut is None:
                    _log.error("creating the capture arena in the background failed (the first capture tries again): %s", e)
                else:
                    _complete(fut, items, str(e))
            else:
                self._start_error = None
                if fut is not None:
                    self._submit_now(items, fut, True)
            with self._early_lock:
                self._early.popleft()
                self._starts_done += 1
                self._early_lock.notify_all()
            del items, fut

    def _drain_starter(self) -> None:
        """Fails the batches still waiting for the arena and waits for the starter thread."""
        with self._early_lock:
            waiting = list(self._early)[1:]  # the first one is the starter's, in progress
            for _ in waiting:
                self._early.pop()
            starter = self._starter
            self._early_lock.notify_all()
        for items, fut in waiting:
            if fut is not None:
                _complete(fut, items, "the interpreter is exiting")
        if starter is not None:
            starter.join()

    def put_samples(self, samples: Sequence[Sample], *, within_s: Optional[float] = _SINK_BOUND) -> list[Result]:
        """Publishes a batch and waits for its rows (one per sample, as :meth:`submit_samples`
        gives them; never raises for a sample or the machine).

        Unbounded (``within_s=None``, or the sink's ``sync_bound`` left at None): the arena is
        created on this thread if it has not been, and a batch that does not fit waits for frees
        up to ``wait_s``. Bounded (``within_s`` seconds, or ``sync_bound``: what SGLang's
        scheduler thread gets under a patch that calls ``put_sample``): the arena is never
        created here but on the sink's starter thread, and the batch waits at most that long to
        start (for the arena, earlier batches, frees); one that did not start gets every
        sample's error row and is never written. Once its copy started, the call returns when it
        is done. A ``close()`` from another thread lets this call finish."""
        bound = self.sync_bound if within_s is _SINK_BOUND else within_s
        items = _convert(samples)
        rows: list[Result]
        if all(isinstance(it, dict) for it in items):
            rows = items
        elif bound is not None:
            rows = self._put_within(items, float(bound))
        else:
            try:
                self._ensure_started(items)
                rows = self._put(items)
            except Exception as e:
                rows = _rows_for(items, str(e))
        if any("error" in r for r in rows):
            _log_failures_of(rows)
        return rows

    def _put_within(self, items: list[Any], bound: float) -> list[Result]:
        """A bounded synchronous publish (see :meth:`put_samples`)."""
        deadline = time.monotonic() + max(0.0, bound)
        try:
            if not self.started and not self._wait_started(items, deadline):
                if self._start_error is not None:
                    return _rows_for(
                        items,
                        f"not captured: creating the capture arena failed ({self._start_error}); tried again at a capture "
                        f"at least {START_RETRY_S:g} s after the last try",
                    )
                return _rows_for(
                    items,
                    f"not captured: the capture arena is still being created, off this thread (about half a second per "
                    f"GiB of SGLANG_SPEC_CAPTURE_ARENA_BYTES), and a synchronous caller waits at most {bound:g} s "
                    "(SGLANG_SPEC_CAPTURE_SYNC_WAIT_S); later captures go in once it exists",
                )
            return self._put(items, max(0.0, deadline - time.monotonic()))
        except Exception as e:
            return _rows_for(items, str(e))

    def _wait_started(self, items: list[Any], deadline: float) -> bool:
        """Has the starter thread create the arena and waits until it exists, or until
        ``deadline``, or until that start failed (False at once). A failed start is tried again
        by a call at least ``START_RETRY_S`` later; the calls between fail at once with its
        reason, so a machine that cannot make the arena costs each capture nothing."""
        with self._early_lock:
            if self.started:
                return True
            if self._starter is None:
                if self._start_error is not None and time.monotonic() - self._start_failed_at < START_RETRY_S:
                    return False
                device = next((d for d in (_cuda_device(x) for s in items if not isinstance(s, dict) for x in s[1:]) if d is not None), None)
                self._early.append(([], None))  # type: ignore[arg-type]
                self._starter = threading.Thread(target=self._start_early, args=(device,), name="capture-arena-start", daemon=True)
                self._starter.start()
            seen = self._starts_done
            while not self.started:
                left = deadline - time.monotonic()
                if left <= 0 or (self._starts_done > seen and self._start_error is not None):
                    return False
                self._early_lock.wait(left)
            return True

    def stats(self) -> dict[str, int]:
        """The writer's counters (all zero before the first capture), and live capture's
        (``live_*``) when it is on."""
        d = dict(super().stats())
        d.update(self._live_stats())
        return d

    def close(self) -> None:
        """Stops live capture, the writer, and removes the arena. Idempotent."""
        self._stop_live()
        super().close()

    def _publish_live(self, item: Any) -> Result:
        return self.put_samples([item], within_s=self.sync_wait_s)[0]

    def _drop_published(self, result: Mapping[str, Any]) -> None:
        """Frees a result this process published and will never hand out, at once."""
        try:
            self._free_local(_result_keys(result))
        except Exception as e:  # closed meanwhile: its arena went with it
            _log.debug("freeing a dropped capture: %s", e)

    def put_sample(self, spec: Mapping[str, Any], *, aux: Any = None, last_hidden: Any = None) -> Result:
        """Publishes one sample and returns its result."""
        return self.put_samples([(spec, aux, last_hidden)])[0]

    def __enter__(self) -> "ArenaSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def new_sink(**kwargs: Any) -> "ArenaSink | StoreSink":
    """The sink of the placement the environment selects (:func:`placement`): an
    :class:`ArenaSink` for ``arena`` and ``engine``, a :class:`StoreSink` for ``store``. Both have
    the same API, so callers never branch on the placement. ``kwargs`` go to the sink
    (``aux_layer_ids`` for both).

    ==================================================  ===========  ========================================
    protocol and settings                               placement    a trainer reads with
    ==================================================  ===========  ========================================
    ``nvlink`` / ``nvlink_intra`` (auto)                engine       a TransferEngine (``transfer_sync_read``)
                                                                     or ArenaFeatureStore; frees to control
    ``tcp`` / ``rdma`` (auto)                           store        the Mooncake store (``get_into``) or
                                                                     ArenaFeatureStore; frees by ``remove``
    ``SGLANG_SPEC_CAPTURE_PLACEMENT=engine``             engine       as above (a host arena under tcp/rdma)
    ``SGLANG_SPEC_CAPTURE_PLACEMENT=arena``              arena        ArenaFeatureStore (``shm://``, ``cuda://``)
    ==================================================  ===========  ========================================
    """
    if placement() == "store":
        return StoreSink(**kwargs)
    return ArenaSink(**kwargs)


_LIVE_SINKS: "weakref.WeakSet[ArenaSink]" = weakref.WeakSet()


@atexit.register
def _close_sinks_at_exit() -> None:
    """Stops every live sink's writer and removes its arena when the interpreter exits. A starter
    thread still creating an arena is waited for first: it would otherwise come back to a
    finalizing interpreter, which ends the thread in the middle of native code."""
    sinks = list(_LIVE_SINKS)
    for sink in sinks:
        sink._drain_starter()
    # From here on, another thread coming back from native code (a daemon thread's capture or
    # read) parks instead of being ended mid-unwind by the finalizing interpreter; calls still in
    # flight are waited for (a while), so no library is torn down under them.
    left = _exiting()
    if left:
        _log.warning("exiting with %d capture_arena calls still running in other threads", left)
    for sink in sinks:
        sink.close()


def _torch_module() -> Any:
    return importlib.import_module("torch")


def _to_device(arrays: dict[str, Any], device: Optional[str]) -> dict[str, Any]:
    """Host arrays read for ``device=``: torch tensors (from ``new_array(torch=True)``) moved
    there; a numpy ``out=`` array cannot be, and is refused."""
    if device is None:
        return arrays
    if any(isinstance(a, np.ndarray) for a in arrays.values()):
        raise InvalidReadError("device= needs torch outputs: pass torch out= tensors, or no out=")
    return {n: a.to(device) for n, a in arrays.items()}


def _stamps(result: Mapping[str, Any], wanted: list[str], lens: list[int]) -> list[tuple[str, int, int]]:
    """``(key, address, stamp)`` of each wanted feature whose result carries a stamp: the word
    after its ``n`` bytes rounded up to 8 (validated by ``_validate``: an aligned address, a stamp
    in range)."""
    feats = result["features"]
    out = []
    for name, n in zip(wanted, lens):
        stamp = feats[name].get("stamp")
        if stamp is not None:
            key = f"{result['store_id']}/{result['sample_id']}/g{result['gen']}/{name}"
            out.append((key, int(feats[name]["address"]) + (n + 7) // 8 * 8, int(stamp)))
    return out


def _is_engine_session(result: Mapping[str, Any]) -> bool:
    """A TransferEngine session (``<host>:<port>``) rather than a capture-arena one
    (``shm://``, ``cuda://``)."""
    arena = result.get("arena")
    session = arena.get("session") if isinstance(arena, Mapping) else None
    return isinstance(session, str) and "://" not in session


class ArenaFeatureStore(_Store):
    """What a trainer uses: read a result's tensors, then release them.

    Works in any process on the producer's host: the result's ``arena.session`` names the shared
    memory to map (``shm://``) or the device arena to import (``cuda://``: by POSIX descriptor on
    the producer's host, by fabric handle anywhere in its NVLink domain); and on any host for an
    arena served through NIXL (``nixl://``, a build with the nixl feature). For NIXL, outputs
    inside a :class:`ReadBuffer` (``out=`` views of ``numpy.asarray(buf)``) are registered once,
    and so are fresh outputs (no ``out=``), which come from a pool of such buffers
    (``SGLANG_SPEC_CAPTURE_READ_POOL_BYTES``); other ``out=`` arrays are registered for each read.
    Every read checks the objects' stamps: a sample freed by anyone (another trainer's release,
    an abort, the lease) raises :class:`ReleasedError`, one whose space was reused
    :class:`ObjectChangedError`, never another sample's bytes.
    """

    def get(
        self,
        result: Mapping[str, Any],
        names: Optional[Iterable[str]] = None,
        out: Optional[Mapping[str, Any]] = None,
        *,
        torch: bool = False,
        device: Optional[str] = None,
    ) -> dict[str, Any]:
        """Reads the result's features (all, or ``names``) into fresh arrays of the result's shape
        and dtype (numpy; bfloat16 via ``ml_dtypes``), or into the caller's ``out`` arrays or
        tensors (CPU or CUDA) without allocating. ``torch=True`` returns torch tensors
        (``torch.bfloat16``); ``device="cuda:0"`` returns torch tensors on that GPU, copied
        there from any arena (device arenas device-to-device over the imported handle, host
        arenas host-to-device). The copies have finished when this returns.

        Raises :class:`ReleasedError` (a ``KeyError``) after :meth:`release`, or when the sample
        was freed elsewhere (its stamp, checked around the copy), :class:`ObjectChangedError` (a
        ``KeyError``) when its space holds another object now,
        :class:`UnknownFeatureError` (a ``KeyError``) for a name the result lacks, and
        :class:`StaleSessionError` if the producer is gone.
        """
        if "features" not in result:
            self._check(result)  # raises: a failed sample's result, or not a result at all
        feats = result["features"]
        wanted = list(feats) if names is None else list(dict.fromkeys(names))
        if is_store_result(result):
            return self._get_from_store(result, wanted, out, torch, device)
        if _is_engine_session(result):
            return self._get_through_engine(result, wanted, out, torch, device)
        # Released? Known names, shapes and addresses inside the arena? Before allocating.
        self._check(result, wanted)
        pooled = device is None and str(result["arena"].get("session", "")).startswith("nixl://")
        arrays, views = self._outputs(result, wanted, out, torch, device, pooled)
        self._read_into(result, list(zip(wanted, views)))
        return arrays

    _engine_reader: Optional[Any] = None
    _store_reader: Optional[StoreReader] = None
    _making = threading.Lock()

    def _stores(self) -> StoreReader:
        with ArenaFeatureStore._making:
            if self._store_reader is None:
                self._store_reader = StoreReader()
            return self._store_reader

    def _engines(self) -> Any:
        with ArenaFeatureStore._making:
            if self._engine_reader is None:
                from ._engine import EngineReader

                self._engine_reader = EngineReader()
            return self._engine_reader

    def _get_from_store(
        self, result: Mapping[str, Any], wanted: list[str], out: Optional[Mapping[str, Any]], torch: bool, device: Optional[str]
    ) -> dict[str, Any]:
        """A store-placement result: validated (ids, shapes, released?), then read from the
        Mooncake store into host arrays (moved to ``device`` if asked)."""
        reader = self._stores()
        planned = reader.check(result, wanted)
        arrays, views = self._host_outputs(result, wanted, [n for _, n in planned], out, torch or device is not None)
        reader.read(planned, views)
        return _to_device(arrays, device)

    def _host_outputs(
        self, result: Mapping[str, Any], wanted: list[str], lens: list[int], out: Optional[Mapping[str, Any]], torch: bool
    ) -> tuple[dict[str, Any], list[Any]]:
        """Host output arrays (fresh, or the caller's ``out=``) for placements read into host
        memory, after the sizes were validated; at most this host's memory in all."""
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if sum(lens) > limit:
            raise InvalidReadError(f"the result's features need {sum(lens)} bytes, more than this host's {limit} bytes of memory")
        arrays, views = self._outputs(result, wanted, out, torch, None, _is_engine_session(result))
        if any(not isinstance(v, np.ndarray) for v in views):
            raise InvalidReadError("this placement is read into host memory: pass CPU out= tensors")
        return arrays, views

    @staticmethod
    def _outputs(
        result: Mapping[str, Any],
        wanted: list[str],
        out: Optional[Mapping[str, Any]],
        torch: bool,
        device: Optional[str],
        pooled: bool = False,
    ) -> tuple[dict[str, Any], list[Any]]:
        """Each wanted feature's output (the caller's ``out=`` entry, else a fresh array or tensor
        of its shape and dtype: from the registered pool when ``pooled``, for transports that
        register destinations) and what the readers write: its uint8 view, or a CudaBytes."""
        feats = result["features"]
        arrays: dict[str, Any] = {}
        views = []
        for name in wanted:
            f = feats[name]
            made = None
            if out is not None and name in out:
                arr, view = out[name], out_bytes(out[name], list(f["shape"]), f["dtype"])
            elif pooled and device is None and (made := _pool.fresh(list(f["shape"]), f["dtype"], torch)) is not None:
                arr, view = made
            else:
                arr, view = new_array(list(f["shape"]), f["dtype"], torch, device)
            arrays[name] = arr
            views.append(view)
        return arrays, views

    def release(self, result: Mapping[str, Any]) -> None:
        """Frees every object of ``result``: over its control endpoint (arena placements), or by
        removing it from the Mooncake store (store placement). Later reads of it raise
        :class:`ReleasedError` (a ``KeyError``).

        Never waits on the network: the keys are queued, and a sender thread per control
        endpoint sends them, retrying an unreachable endpoint (back-off from 100 ms to 30 s)
        until it answers, or dropping them once it refuses connections (its producer is gone).
        ``health()["pending_frees"]`` counts what waits; :meth:`flush` waits for it."""
        _OPEN_STORES.add(self)
        if is_store_result(result):
            self._stores().release(result)
        else:
            super().release(result)

    def flush(self, timeout_s: float = 0.0) -> None:
        """Has the free senders send what waits, then waits up to ``timeout_s`` seconds for all
        of it to go out (``0``, the default: returns at once). Raises
        :class:`FreeNotSentError` for an endpoint that still has frees waiting: known unreachable
        now (in its back-off), or not done within ``timeout_s``. The frees keep waiting either
        way; a trainer about to exit waits here (``with`` blocks and interpreter exit wait up to
        ``SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S``, 5 s)."""
        t0 = time.monotonic()
        super().flush(timeout_s)
        if self._store_reader is not None and timeout_s > 0:
            self._store_reader.flush(max(0.0, timeout_s - (time.monotonic() - t0)))

    def health(self) -> dict[str, int]:
        """``{"resident_samples", "resident_bytes", "pending_frees", "dropped_frees",
        "open_sessions"}``; frees count the store placement's queued removals too."""
        h = dict(super().health())
        if self._store_reader is not None:
            h["pending_frees"] += self._store_reader.pending
            h["dropped_frees"] += self._store_reader.dropped
        return h

    @staticmethod
    def reclaim(
        control: str,
        *,
        keys: Iterable[str] = (),
        prefixes: Iterable[str] = (),
        token: Optional[str] = None,
        timeout_s: float = 5.0,
    ) -> None:
        """Frees ``keys`` and every object under ``prefixes`` (``"{store_id}/"``,
        ``"{store_id}/{sample_id}/"`` or ``"{store_id}/{sample_id}/g{gen}/"``) at the control
        endpoint ``control`` (a result's ``arena.control``), presenting ``token`` (a result's
        ``arena.token``) when the producer has one: what a restarted trainer or an operator does
        with the samples a dead trainer held. One-way: the producer's stats show what was freed.
        A bad prefix or token raises before anything is sent."""
        _send_frees(control, list(keys), list(prefixes), token, timeout_s)

    def _get_through_engine(
        self, result: Mapping[str, Any], wanted: list[str], out: Optional[Mapping[str, Any]], torch: bool, device: Optional[str]
    ) -> dict[str, Any]:
        """A TransferEngine session: validated here (released? names, sizes), then read with this
        process's engine: into host arrays over TCP/RDMA (moved to ``device`` if asked), into CUDA
        tensors on ``device`` (default ``cuda:0``) over NVLink, whose transports move device
        memory."""
        lens = self._validate(result, wanted)
        reader = self._engines()
        feats = result["features"]
        if reader.nvlink:
            arrays, views = self._outputs(result, wanted, out, True, device or "cuda:0")
            targets = []
            for name, n, view in zip(wanted, lens, views):
                if isinstance(view, np.ndarray):
                    raise InvalidReadError("over NVLink, TransferEngine sessions are read into CUDA tensors")
                # The engine's copy is not ordered with the caller's stream: work queued there on
                # the output (a zero_(), a kernel still reading it) finishes first.
                _torch_module().cuda.current_stream(view.tensor.device).synchronize()
                targets.append((int(feats[name]["address"]), int(view.tensor.data_ptr()), n))
            reader.read(result["arena"]["session"], targets, keep=(arrays, views))
            return arrays
        arrays, views = self._host_outputs(result, wanted, lens, out, torch or device is not None)
        reader.read(
            result["arena"]["session"],
            [(int(feats[n]["address"]), int(v.ctypes.data), int(v.nbytes)) for n, v in zip(wanted, views)],
            keep=(arrays, views),
            stamps=_stamps(result, wanted, lens),
        )
        return _to_device(arrays, device)

    def __enter__(self) -> "ArenaFeatureStore":
        return self

    def __exit__(self, *exc: object) -> None:
        _flush_quietly(self, _exit_flush_s())


# Stores that released something: interpreter exit gives their frees time to go out.
_OPEN_STORES: "weakref.WeakSet[ArenaFeatureStore]" = weakref.WeakSet()


def _exit_flush_s() -> float:
    """``SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S`` (default 5): how long exit waits for frees."""
    raw = os.environ.get("SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S", "").strip()
    if not raw:
        return 5.0
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if 0.0 <= v <= 3600.0:
        return v
    # Read at exit: a bad value must not cost the frees, so it is named and the default used.
    logging.getLogger("capture_arena").warning(
        "SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S=%r is not a number of seconds in [0, 3600]; using 5", raw
    )
    return 5.0


def _flush_quietly(store: "ArenaFeatureStore", timeout_s: float) -> None:
    """Waits for a store's frees, warning (never raising) about what could not go out."""
    try:
        store.flush(timeout_s)
    except Exception as e:  # an exit path: say what is left, never raise
        logging.getLogger("capture_arena").warning("frees not sent before exit: %s", e)


def _flush_stores_at_exit() -> None:
    deadline = time.monotonic() + _exit_flush_s()
    for store in list(_OPEN_STORES):
        _flush_quietly(store, max(0.0, deadline - time.monotonic()))


atexit.register(_flush_stores_at_exit)
