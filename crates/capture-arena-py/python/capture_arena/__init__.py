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
import concurrent.futures
import importlib
import importlib.util
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from . import errors
from ._capture_arena import FEATURES, ReadBuffer, __version__, _ArenaSink, _send_frees, _Store, arena_enabled, placement
from ._store import StoreReader, StoreSink, is_store_result
from ._tensors import CudaBytes, HostBytes, host_bytes, new_array, out_bytes
from .errors import *  # noqa: F401,F403


def _nixl_defaults() -> None:
    """NIXL's environment, set before its library loads (on the first ``nixl://`` session):
    ``SGLANG_SPEC_CAPTURE_NIXL_LIB`` from an installed ``nixl-cu12`` wheel when unset, and
    ``UCX_MODULES=^ib`` where the machine has no InfiniBand device (UCX's InfiniBand module
    crashes at exit there, in the libnl the wheel bundles)."""
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


def _convert(
    samples: Iterable[Sample], host: bool = False
) -> list[tuple[Any, Optional[HostBytes], Optional[HostBytes], Optional[dict[str, HostBytes]]]]:
    """Describes every tensor of a batch for the compiled sink (``host=True``: CUDA tensors
    copied to the host first, for placements that publish host bytes)."""
    out = []
    for spec, aux, last_hidden in samples:
        arrays: Optional[dict[str, HostBytes]] = None
        passthrough = spec.get("passthrough") or ()
        if any(not isinstance(p.get("data"), (list, tuple, type(None))) for p in passthrough):
            # Array data (numpy, torch, ...) travels as bytes, not as a list of numbers.
            arrays = {}
            new = []
            for p in passthrough:
                data = p.get("data")
                if isinstance(data, (list, tuple, type(None))):
                    new.append(p)
                else:
                    arrays[p["name"]] = host_bytes(data, host)
                    new.append({**p, "data": None})
            spec = {**spec, "passthrough": new}
        out.append((
            spec,
            None if aux is None else host_bytes(aux, host),
            None if last_hidden is None else host_bytes(last_hidden, host),
            arrays,
        ))
    return out


class ArenaSink(_ArenaSink):
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

    Nothing is allocated until the first capture, unless ``eager=True``: then the arena is
    created (and pre-faulted, about a second per GiB) here, with the GIL released, instead of on
    the scheduler's thread at the first capture. The sink reads tensors in place: a tensor
    handed to it must not be written, resized or freed until its batch's results are back.
    ``close()`` (or leaving a ``with`` block, or interpreter exit) stops the writer and removes
    the arena.
    """

    _starting = threading.Lock()

    def __init__(self, **kwargs: Any) -> None:
        # The arguments were taken by the compiled __new__; register for the close at exit.
        _LIVE_SINKS.add(self)
        if self.eager:
            self._ensure_started()  # the engine placement's arena (the others started already)

    def _ensure_started(self, converted: Optional[list[Any]] = None) -> None:
        """Under the engine placement, takes the arena from a Mooncake TransferEngine on the first
        capture (other placements start inside the compiled sink): on the configured GPU, else
        the GPU of the batch's first CUDA tensor, else 0."""
        if self.placement != "engine" or self.started:
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

            device = self.device
            if device is None:
                device = next((d for d in (_cuda_device(x) for s in converted or () for x in s[1:]) if d is not None), None)
            arena = EngineArena(nbytes, protocol_of(self.protocol), device)
            self._start_with_region(arena.ptr, arena.nbytes, arena.session, arena, arena.device)

    @classmethod
    def from_env(cls) -> "ArenaSink":
        """A sink configured from the environment alone."""
        return cls()

    def submit_samples(self, samples: Sequence[Sample], *, block: bool = True) -> "concurrent.futures.Future[list[Result]]":
        """Queues a batch and returns a future of its results, one dict per sample.

        Blocks (with the GIL released) while the writer already holds ``max_pending_batches``
        batches; with ``block=False`` raises :class:`QueueFullError` instead (and nothing is
        queued: no future is returned or completed). Invalid samples
        raise :class:`InvalidSampleError` here, before anything is written. A batch that fails
        later (arena full, a resident key without ``replace``) completes with
        ``{"sample_id", "error"}`` for every sample. Do not write, resize or free the tensors
        until the future is done. Callbacks added to the future run on the sink's helper thread
        and must not block.
        """
        converted = _convert(samples)
        self._ensure_started(converted)
        fut: concurrent.futures.Future[list[Result]] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        self._submit(converted, fut, block)
        return fut

    def put_samples(self, samples: Sequence[Sample]) -> list[Result]:
        """Publishes a batch and waits for its results (GIL released while waiting and copying);
        errors as :meth:`submit_samples`."""
        converted = _convert(samples)
        self._ensure_started(converted)
        return self._put(converted)

    def put_sample(self, spec: Mapping[str, Any], *, aux: Any = None, last_hidden: Any = None) -> Result:
        """Publishes one sample and returns its result."""
        return self.put_samples([(spec, aux, last_hidden)])[0]

    def __enter__(self) -> "ArenaSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    """Stops every live sink's writer and removes its arena when the interpreter exits."""
    for sink in list(_LIVE_SINKS):
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
    inside a :class:`ReadBuffer` (``out=`` views of ``numpy.asarray(buf)``) are registered once;
    other outputs are registered for each read.
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

        Raises :class:`ReleasedError` (a ``KeyError``) after :meth:`release`,
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
        arrays, views = self._outputs(result, wanted, out, torch, device)
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
        arrays, views = self._outputs(result, wanted, out, torch, None)
        if any(not isinstance(v, np.ndarray) for v in views):
            raise InvalidReadError("this placement is read into host memory: pass CPU out= tensors")
        return arrays, views

    @staticmethod
    def _outputs(
        result: Mapping[str, Any], wanted: list[str], out: Optional[Mapping[str, Any]], torch: bool, device: Optional[str]
    ) -> tuple[dict[str, Any], list[Any]]:
        """Each wanted feature's output (the caller's ``out=`` entry, else a fresh array or tensor
        of its shape and dtype) and what the readers write: its uint8 view, or a CudaBytes."""
        feats = result["features"]
        arrays: dict[str, Any] = {}
        views = []
        for name in wanted:
            f = feats[name]
            if out is not None and name in out:
                arr, view = out[name], out_bytes(out[name], list(f["shape"]), f["dtype"])
            else:
                arr, view = new_array(list(f["shape"]), f["dtype"], torch, device)
            arrays[name] = arr
            views.append(view)
        return arrays, views

    def release(self, result: Mapping[str, Any]) -> None:
        """Frees every object of ``result``: over its control endpoint (arena placements), or by
        removing it from the Mooncake store (store placement). Later reads of it raise
        :class:`ReleasedError` (a ``KeyError``)."""
        if is_store_result(result):
            self._stores().release(result)
        else:
            super().release(result)

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
            reader.read(result["arena"]["session"], targets)
            return arrays
        arrays, views = self._host_outputs(result, wanted, lens, out, torch or device is not None)
        reader.read(
            result["arena"]["session"],
            [(int(feats[n]["address"]), int(v.ctypes.data), int(v.nbytes)) for n, v in zip(wanted, views)],
        )
        return _to_device(arrays, device)

    def __enter__(self) -> "ArenaFeatureStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()
