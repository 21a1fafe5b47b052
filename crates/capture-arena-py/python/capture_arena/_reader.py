"""The trainer's reader: :class:`ArenaFeatureStore` reads a result's tensors over whichever
transport its session names, then releases them; queued frees are flushed at exit."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import math
import multiprocessing.util
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import numpy as np

from . import _logs
from . import _capture_arena
from ._capture_arena import _send_frees, _Store
from . import _pool
from ._store import StoreReader, is_store_result, same_sizes
from ._tensors import new_array, numpy_dtype, out_bytes
from ._samples import _torch_module, feature_names
from .errors import ArenaOSError, InvalidReadError, StaleSessionError


def handle_of(result: Mapping[str, Any]) -> str:
    """``{store_id}/{sample_id}/g{gen}/`` with the ids as they are: what vLLM's connector hands
    out as a request's handle, and what errors name an object by. The prefix of the result's
    keys only where no id holds ``%``, ``/`` or a control character (keys escape those): free by
    the result, never by this as a prefix."""
    return f"{result.get('store_id')}/{result.get('sample_id')}/g{result.get('gen')}/"



def _memory_limit() -> tuple[int, str]:
    """The most memory this process may use, and whose limit it is: the host's, or its cgroup's
    where that is lower (the core's ``limits::memory_limit``, read once)."""
    limit, of = _capture_arena._memory_limit()
    return int(limit), str(of)


def _nbytes(feature: Mapping[str, Any]) -> int:
    """A validated feature's size: its shape's product times its dtype's."""
    return math.prod(int(d) for d in feature["shape"]) * numpy_dtype(str(feature["dtype"])).itemsize


def _fits_in_memory(wanted: list[str], lens: list[int], out: Optional[Mapping[str, Any]]) -> None:
    """Refuses a read whose fresh host outputs (the features ``out=`` does not supply) need more
    than this process may use at all (:func:`_memory_limit`): a container's trainer is killed
    past its cgroup's limit, where an error costs only this read."""
    need = sum(n for name, n in zip(wanted, lens) if out is None or name not in out)
    limit, of = _memory_limit()
    if need > limit:
        raise InvalidReadError(
            f"the result's features need {need} bytes, more than {of}'s {limit} bytes of memory: "
            "read fewer of them (names=), into arrays of your own (out=), or give the process more memory"
        )


#: What the NIXL reader's error says of a read that timed out with its request in flight
#: (crates/capture-arena/src/transport/nixl.rs, ``Waited::TimedOut``).
NIXL_TIMED_OUT = "did not complete in"


def _to_device(arrays: dict[str, Any], device: Optional[str]) -> dict[str, Any]:
    """Host arrays read for ``device=``: torch tensors (from ``new_array(torch=True)``) moved
    there; a numpy ``out=`` array cannot be, and is refused."""
    if device is None:
        return arrays
    if any(isinstance(a, np.ndarray) for a in arrays.values()):
        raise InvalidReadError("device= needs torch outputs: pass torch out= tensors, or no out=")
    with _no_memory_as_error(f"moving the result's features to {device}", sum(int(a.nbytes) for a in arrays.values())):
        return {n: a.to(device) for n, a in arrays.items()}


@contextlib.contextmanager
def _no_memory_as_error(what: str, nbytes: int) -> Iterator[None]:
    """A device (or the host) out of memory: ArenaOSError saying what and how much, as every
    read error is a CaptureArenaError (torch's OutOfMemoryError is none)."""
    try:
        yield
    except Exception as e:
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
            raise ArenaOSError(f"{what} ({nbytes} bytes) failed, out of memory: {e}") from None
        raise


def _stamps(result: Mapping[str, Any], wanted: list[str], lens: list[int]) -> list[tuple[str, int, int]]:
    """``(key, address, stamp)`` of each wanted feature whose result carries a stamp: the word
    after its ``n`` bytes rounded up to 8 (validated by ``_validate``: an aligned address, a stamp
    in range)."""
    feats = result["features"]
    out = []
    for name, n in zip(wanted, lens):
        stamp = feats[name].get("stamp")
        if stamp is not None:
            key = handle_of(result) + name
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
        wanted = feature_names(result["features"], names)
        if is_store_result(result):
            return self._get_from_store(result, wanted, out, torch, device)
        if _is_engine_session(result):
            return self._get_through_engine(result, wanted, out, torch, device)
        # Released? Known names, shapes and addresses inside the arena? Before allocating.
        self._check(result, wanted)
        if device is None or str(device).startswith("cpu"):
            feats = result["features"]
            _fits_in_memory(wanted, [_nbytes(feats[n]) for n in wanted], out)
        nixl = str(result["arena"].get("session", "")).startswith("nixl://")
        arrays, views = self._outputs(result, wanted, out, torch, device, nixl and device is None)
        try:
            self._read_into(result, list(zip(wanted, views)))
        except StaleSessionError as e:
            if nixl and NIXL_TIMED_OUT in str(e):
                # Over RDMA a NIC may still complete the abandoned READ into these outputs (a
                # pooled range would go to the next read): held as a Mooncake read's are.
                from ._engine import QUARANTINE

                QUARANTINE.hold((arrays, views))
            raise
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
        memory, after the sizes were validated; at most this process's memory in all (the host's,
        or its cgroup's limit where lower: a container's trainer is killed past it)."""
        _fits_in_memory(wanted, lens, out)
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
                with _no_memory_as_error(f"allocating {name} on {device or 'the host'}", _nbytes(f)):
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
        self._flush_store_removals(timeout_s, t0)

    def flush_samples(self, store_id: str, sample_ids: list[str], timeout_s: float) -> None:
        """As :meth:`flush`, for the frees of ``sample_ids`` (of ``store_id``) only: frees of
        other samples, waiting for a control endpoint that does not answer say, do not make it
        raise. Removals from the Mooncake store (one master for all) are waited for whole."""
        t0 = time.monotonic()
        super().flush_samples(store_id, sample_ids, timeout_s)
        self._flush_store_removals(timeout_s, t0)

    def _flush_store_removals(self, timeout_s: float, t0: float) -> None:
        """The tail of a flush of ``timeout_s`` begun at ``t0``: waits what is left of it for the
        removals queued for the Mooncake store (raising if they still wait, none left included);
        a flush of 0 does not wait for them."""
        if self._store_reader is not None and timeout_s > 0:
            self._store_reader.flush(max(0.0, timeout_s - (time.monotonic() - t0)))

    def health(self) -> dict[str, int]:
        """``{"resident_samples", "resident_bytes", "pending_frees", "dropped_frees", "refused_frees",
        "open_sessions", "mooncake_clients", "stuck_clients"}``; frees count the store
        placement's queued removals too. ``resident_*`` count samples read through shared
        memory, CUDA handles and NIXL and not released; reads through a TransferEngine or the
        Mooncake store are not counted there. ``mooncake_clients``: the TransferEngines and store
        clients this reader holds; ``stuck_clients``: those with a read stuck in them past its
        deadline (a partition; reads fail at once while there are
        ``SGLANG_SPEC_CAPTURE_MAX_STUCK_CLIENTS``, 8)."""
        h = dict(super().health())
        h["mooncake_clients"] = h["stuck_clients"] = 0
        if self._store_reader is not None:
            h["pending_frees"] += self._store_reader.pending
            h["dropped_frees"] += self._store_reader.dropped
        for reader in (self._store_reader, self._engine_reader):
            if reader is not None:
                held, stuck = reader.clients()
                h["mooncake_clients"] += held
                h["stuck_clients"] += stuck
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
        with the samples a dead trainer held. Returns once the producer confirmed the lines (a sync)
        or raises; its stats show what was freed.
        A bad prefix or token raises before anything is sent."""
        _send_frees(control, list(keys), list(prefixes), token, timeout_s)

    def _get_through_engine(
        self, result: Mapping[str, Any], wanted: list[str], out: Optional[Mapping[str, Any]], torch: bool, device: Optional[str]
    ) -> dict[str, Any]:
        """A TransferEngine session: validated here (released? names, sizes), then read with this
        process's engine: into host arrays over TCP/RDMA (moved to ``device`` if asked). Over
        NVLink, whose transports move device memory, into CUDA tensors on ``device``, else on
        this thread's current GPU; a caller that asked for host arrays (no ``device``, or
        ``"cpu"``, and no ``out=``) gets them copied to the host from there, as every other
        placement hands them."""
        lens = self._validate(result, wanted)
        reader = self._engines()
        feats = result["features"]
        if reader.nvlink:
            t = _torch_module()
            to_host = out is None and (device is None or t.device(device).type == "cpu")
            gpu = device if device is not None and not to_host else f"cuda:{t.cuda.current_device()}"
            if out is None:
                total = t.cuda.mem_get_info(gpu)[1]
                if sum(lens) > total:
                    raise InvalidReadError(f"the result's features need {sum(lens)} bytes, more than {gpu}'s {total} bytes of memory")
            oom = getattr(t, "OutOfMemoryError", None) or t.cuda.OutOfMemoryError
            try:
                arrays, views = self._outputs(result, wanted, out, True, gpu)
            except oom as e:
                raise ArenaOSError(f"allocating {sum(lens)} bytes on {gpu} for the result's features failed: {e}") from None
            targets = []
            for name, n, view in zip(wanted, lens, views):
                if isinstance(view, np.ndarray):
                    raise InvalidReadError("over NVLink, TransferEngine sessions are read into CUDA tensors")
                same_sizes([name], [n], [int(view.tensor.numel() * view.tensor.element_size())])
                # The engine's copy is not ordered with the caller's stream: work queued there on
                # the output (a zero_(), a kernel still reading it) finishes first.
                t.cuda.current_stream(view.tensor.device).synchronize()
                targets.append((int(feats[name]["address"]), int(view.tensor.data_ptr()), n))
            # The stamp words too (the readiness rule), read into a tensor on the outputs' GPU.
            reader.read(
                result["arena"]["session"],
                targets,
                keep=(arrays, views),
                stamps=_stamps(result, wanted, lens),
                words_device=views[0].tensor.device if views else None,
            )
            if not to_host:
                return arrays
            host, host_views = self._host_outputs(result, wanted, lens, None, torch or device is not None)
            for src, dst in zip(views, host_views):
                np.copyto(dst, src.tensor.reshape(-1).view(t.uint8).cpu().numpy())
            return host
        arrays, views = self._host_outputs(result, wanted, lens, out, torch or device is not None)
        same_sizes(wanted, lens, [int(v.nbytes) for v in views])
        reader.read(
            result["arena"]["session"],
            [(int(feats[name]["address"]), int(v.ctypes.data), n) for name, n, v in zip(wanted, lens, views)],
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
    _logs.get("capture_arena").warning(
        "SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S=%r is not a number of seconds in [0, 3600]; using 5", raw
    )
    return 5.0


def _flush_quietly(store: "ArenaFeatureStore", timeout_s: float) -> None:
    """Waits for a store's frees, warning (never raising) about what could not go out."""
    try:
        store.flush(timeout_s)
    except Exception as e:  # an exit path: say what is left, never raise
        _logs.get("capture_arena").warning("frees not sent before exit: %s", e)


def _flush_stores_at_exit() -> None:
    deadline = time.monotonic() + _exit_flush_s()
    for store in list(_OPEN_STORES):
        _flush_quietly(store, max(0.0, deadline - time.monotonic()))


atexit.register(_flush_stores_at_exit)


def _after_fork_in_child() -> None:
    # The fork may have come while another thread made a reader under this lock.
    ArenaFeatureStore._making = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _in_forked_worker(_: object) -> None:
    """In a process multiprocessing forked (a DataLoader worker): it ends in ``os._exit``, so
    atexit never runs there; multiprocessing's own finalizers do, and this one flushes the
    frees as the exit hook would. Priority 10: after a backend's release of what it read (20)."""
    multiprocessing.util.Finalize(None, _flush_stores_at_exit, exitpriority=10)


multiprocessing.util.register_after_fork(_OPEN_STORES, _in_forked_worker)

