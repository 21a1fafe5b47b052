"""The store placement: one Mooncake store object per tensor, as SpecForge's sink does.

:class:`StoreSink` has the sink API of :class:`capture_arena.ArenaSink` (``submit_samples``,
``put_samples``, ``put_sample``, ``stats``, ``close``). A batch is validated and built by the same
compiled code as an arena batch (so the same errors are raised before anything is written), and
published straight from the tensors' memory (registered with the store for the call) with one
``batch_put_from`` per scheduler batch, hard-pinned (soft-pinned where the client has no hard pin,
as SpecForge's patches fall back: older and Ascend clients). With device publication (SpecForge's
``SGLANG_SPEC_CAPTURE_GPU_PUT``: on by default under ``MOONCAKE_PROTOCOL=rdma`` when torch sees
CUDA, ``1`` requires ``rdma``) CUDA tensors are registered and put from device memory, after the
work that wrote them (an event recorded when they were handed over); otherwise they are copied to
the host first. ``replace`` removes the old keys first (a
re-put of an existing key keeps the old bytes in Mooncake). Any failed status removes every key of
the batch and fails each sample with the count and the first failure: nothing is half-published.
Results are the store sink's: ``{"sample_id", "store_id", "gen", "aux_layer_ids", "features":
{name: {"shape", "dtype"}}}`` (no ``arena``, no ``address``).

:class:`StoreReader` reads such results for :class:`capture_arena.ArenaFeatureStore`
(one ``batch_get_into`` straight into the outputs, registered for the call) and frees them with
``remove(key, force=True)``.

The client is made from the ``MOONCAKE_*`` variables with the defaults of the sink this one
replaces (SpecForge's SGLang patch), so a sink and a trainer left on defaults agree:
``MOONCAKE_MASTER_SERVER_ADDR`` (default ``localhost:50051``), ``MOONCAKE_METADATA_SERVER``
(default ``http://localhost:8080/metadata``), ``MOONCAKE_LOCAL_HOSTNAME`` (default
``localhost``), ``MOONCAKE_PROTOCOL`` (default ``tcp``), ``MOONCAKE_RDMA_DEVICES``,
``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (the memory a sink contributes to the store: default 32 GiB, as
the capture contract has it; a reader contributes none) and ``MOONCAKE_LOCAL_BUFFER_SIZE``
(default 1 GiB). The sink connects at its first batch, so a server boots without a master.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import importlib
import os
import queue
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import numpy as np

from . import _logs
from . import _capture_arena
from ._live import LiveSink, sync_wait_s
from ._samples import Warnings, feature_names
from .errors import (
    ArenaOSError,
    ConfigError,
    FreeNotSentError,
    InvalidReadError,
    InvalidSampleError,
    QueueFullError,
    ReleasedError,
    StaleSessionError,
    WriterStoppedError,
)

# Mooncake status codes worth naming in messages.
NOT_FOUND = -704

#: How long the store worker waits for device tensors to be written before it puts them.
READY_TIMEOUT_S = 60.0

_log = _logs.get("capture_arena")
#: Dropped store removals: a warning at most once a second.
_DROPPED = Warnings()

#: Defaults of the sink this one replaces (SpecForge's ``spec_capture_sink``), shared by sinks and
#: readers.
DEFAULTS = {
    "MOONCAKE_MASTER_SERVER_ADDR": "localhost:50051",
    "MOONCAKE_METADATA_SERVER": "http://localhost:8080/metadata",
    "MOONCAKE_LOCAL_HOSTNAME": "localhost",
}


def _bytes_var(name: str, default: int) -> int:
    v = os.environ.get(name, "").strip()
    return _capture_arena._parse_bytes(name, v) if v else default


def connect(contribute: bool) -> Any:
    """A ``MooncakeDistributedStore`` set up from the ``MOONCAKE_*`` variables; with
    ``contribute`` (a sink) it mounts ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` of its memory into the
    store, else (a reader) none, so that objects never land in a trainer's memory."""
    try:
        store_mod = importlib.import_module("mooncake.store")
    except ImportError as e:
        from ._engine import INSTALL_HINT

        raise ConfigError(
            f"the store placement needs Mooncake's store client, which is not importable ({e}): {INSTALL_HINT}; "
            "or set SGLANG_SPEC_CAPTURE_PLACEMENT=arena for capture-arena's own arena"
        ) from None
    master = os.environ.get("MOONCAKE_MASTER_SERVER_ADDR", "").strip() or DEFAULTS["MOONCAKE_MASTER_SERVER_ADDR"]
    host = os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "").strip() or DEFAULTS["MOONCAKE_LOCAL_HOSTNAME"]
    metadata = os.environ.get("MOONCAKE_METADATA_SERVER", "").strip() or DEFAULTS["MOONCAKE_METADATA_SERVER"]
    protocol = os.environ.get("MOONCAKE_PROTOCOL", "").strip().lower() or "tcp"
    devices = os.environ.get("MOONCAKE_RDMA_DEVICES", "").strip()
    segment = _bytes_var("MOONCAKE_GLOBAL_SEGMENT_SIZE", 32 << 30) if contribute else 0
    # A reader reads with batch_get_into straight into its registered outputs and never uses
    # Mooncake's local buffer: none unless asked for (under RDMA it is registered, so pinned, for
    # every reader client: with clients set aside after stuck reads, gigabytes per process).
    local = _bytes_var("MOONCAKE_LOCAL_BUFFER_SIZE", 1 << 30 if contribute else 0)
    # setup() holds the GIL while it retries an unreachable master (about 4 s a try, 20 tries),
    # and while it waits on one that accepts connections but does not answer (stopped,
    # overloaded: 30 s a try): the whole process, SGLang's scheduler or a trainer's read deadline
    # included, would stand still. Short probes first turn that into this batch's error: a
    # connection to the master, and an answer from an http:// metadata server (which
    # mooncake_master serves itself under --enable_http_metadata_server, so a stopped master
    # does not answer there either).
    # A sink's batch fails, and its next tries again; a reader's read fails, and its next does.
    then = "This batch fails; the next tries again" if contribute else "This read fails; the next tries again"
    _reachable("MOONCAKE_MASTER_SERVER_ADDR", master, then)
    if metadata.startswith("http://"):
        _answers("MOONCAKE_METADATA_SERVER", metadata, then)
    elif metadata.startswith("https://"):
        _reachable("MOONCAKE_METADATA_SERVER", metadata.split("://", 1)[1].split("/", 1)[0], then)
    s = store_mod.MooncakeDistributedStore()
    rc = s.setup(host, metadata, segment, local, protocol, devices, master)
    if rc != 0:
        raise ArenaOSError(
            f"MooncakeDistributedStore.setup({host!r}, {metadata!r}, {segment}, {local}, {protocol!r}, {devices!r}, "
            f"{master!r}) returned {rc}: is mooncake_master running there, and MOONCAKE_METADATA_SERVER right?"
        )
    return s


#: How long a connection to the master (or the metadata server) may take before the store is
#: taken as unreachable.
PROBE_TIMEOUT_S = 2.0
#: How long an http:// metadata server may take to answer the probe (the GIL is free meanwhile).
PROBE_ANSWER_S = 5.0


def _answers(var: str, url: str, then: str) -> None:
    """Raises ArenaOSError (ending with ``then``) unless the HTTP server at ``url`` answers a GET
    (any status: an unknown key is 404) within :data:`PROBE_TIMEOUT_S`, connecting included (the
    GIL is released while it waits)."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    try:
        conn = http.client.HTTPConnection(u.hostname or "localhost", u.port or 80, timeout=PROBE_TIMEOUT_S)
        try:
            conn.connect()
            if conn.sock is not None:  # a loaded server may take longer to answer than to accept
                conn.sock.settimeout(PROBE_ANSWER_S)
            conn.request("GET", (u.path or "/") + "?key=capture_arena_probe")
            conn.getresponse().read(4096)
        finally:
            conn.close()
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise ArenaOSError(
            f"the Mooncake store's metadata server does not answer: {var}={url} ({e}; {PROBE_TIMEOUT_S:g} s to connect, "
            f"{PROBE_ANSWER_S:g} s to answer); is "
            f"mooncake_master running and not stopped (with --enable_http_metadata_server)? {then}"
        ) from None


def _reachable(var: str, addr: str, then: str) -> None:
    """Raises ArenaOSError (ending with ``then``, what follows) unless a TCP connection to
    ``addr`` (``host:port``) opens within :data:`PROBE_TIMEOUT_S` (the GIL is released while it
    tries)."""
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=PROBE_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise ArenaOSError(
            f"the Mooncake store is not reachable: {var}={addr} ({e}); is mooncake_master running there "
            f"(with --enable_http_metadata_server for an http:// metadata server)? {then}"
        ) from None


def store_gpu_put() -> bool:
    """SpecForge's rule for the store placement's device publication (its ``gpu_put_enabled``,
    v0.5.20 and main): ``SGLANG_SPEC_CAPTURE_GPU_PUT`` unset is on under
    ``MOONCAKE_PROTOCOL=rdma`` when torch is a CUDA build that sees a GPU; ``1`` is on (and needs
    ``rdma``: :func:`check_store_gpu_put` says so at startup); off is off. Flags are spelled as
    the core reads them (``true``, ``on``, ...; another value is refused at startup and off
    here). Never raises."""
    protocol = os.environ.get("MOONCAKE_PROTOCOL", "").strip().lower() or "tcp"
    try:
        configured = _capture_arena._env_flag("SGLANG_SPEC_CAPTURE_GPU_PUT")
    except ConfigError:
        return False
    if configured is None:
        if protocol != "rdma":
            return False
        try:
            torch = importlib.import_module("torch")
            return torch.version.cuda is not None and bool(torch.cuda.is_available())
        except Exception:
            return False
    return configured


def check_store_gpu_put() -> None:
    """ConfigError for device publication into the store without RDMA (SpecForge's sink raises
    the same in its scheduler loop; here the server does not start)."""
    protocol = os.environ.get("MOONCAKE_PROTOCOL", "").strip().lower() or "tcp"
    if _capture_arena._env_flag("SGLANG_SPEC_CAPTURE_GPU_PUT") is True and protocol != "rdma":
        raise ConfigError(
            f"SGLANG_SPEC_CAPTURE_GPU_PUT={os.environ['SGLANG_SPEC_CAPTURE_GPU_PUT'].strip()} publishes device memory into the Mooncake store, which needs "
            f"MOONCAKE_PROTOCOL=rdma (it is {protocol}): set MOONCAKE_PROTOCOL=rdma, unset SGLANG_SPEC_CAPTURE_GPU_PUT, "
            "or choose an arena (SGLANG_SPEC_CAPTURE_PLACEMENT=arena) for device publication over another transport"
        )


def replicate_config(mod: Any) -> Any:
    """One replica, hard-pinned; soft-pinned where the client has no hard pin (older and Ascend
    Mooncake clients), as SpecForge's patches (v0.5.18 on) fall back; unpinned if it has neither."""
    cfg = mod.ReplicateConfig()
    cfg.replica_num = 1
    if hasattr(cfg, "with_hard_pin"):
        cfg.with_hard_pin = True
    elif hasattr(cfg, "with_soft_pin"):
        cfg.with_soft_pin = True
    return cfg


class _Registered:
    """Ranges registered with the store for one call (about 0.1 ms each for host memory,
    measured), and unregistered after it, also when it fails."""

    def __init__(self, store: Any, ranges: list[tuple[int, int, int]]) -> None:
        self._store = store
        self._done: list[int] = []
        for ptr, n, device in dict.fromkeys(ranges):
            rc = store.register_buffer(ptr, n)
            if rc not in (0, None):
                self.close()
                hint = (
                    f" (device memory of GPU {device}: the Mooncake client must be a CUDA build with GPUDirect RDMA, "
                    "and torch's memory registerable: unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments)"
                    if device >= 0
                    else ""
                )
                raise ArenaOSError(f"registering {n} bytes with the Mooncake store returned {rc}{hint}")
            self._done.append(ptr)

    def close(self) -> None:
        for ptr in self._done:
            self._store.unregister_buffer(ptr)
        self._done = []


class _Ticket:
    """A bounded caller's batch (see :meth:`StoreSink.put_samples`): the worker starts it only
    if its caller still waits, and removes what it published if the caller gave up meanwhile
    (the caller's wait is bounded whatever the store does)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "waiting"

    @property
    def abandoned(self) -> bool:
        with self._lock:
            return self._state == "abandoned"

    def finish(self) -> bool:
        """The worker is done: False if the caller gave up first (then what was published
        must go)."""
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "done"
            return True

    def abandon(self) -> bool:
        """The caller gives up: True unless the batch is done already."""
        with self._lock:
            if self._state == "done":
                return False
            self._state = "abandoned"
            return True


#: ``put_samples(within_s=...)`` left out: the sink's own ``sync_bound``.
_SINK_BOUND: Any = object()


#: How long a store sink's close (and interpreter exit) lets its worker run the batches and
#: removals queued; those not begun by then fail (batches get error rows) without a store call.
QUEUE_WAIT_S = 5.0
#: A store sink's own removals that failed (the cleanup of a failed or abandoned batch, a dropped
#: live capture's objects: the master unreachable, a status not 0): retried on its worker, after
#: 0.1 s doubling to 30 s while they fail, and first whenever a batch writes one of their keys.
#: At most this many keys wait (past it the oldest are dropped, logged: they stay in the store
#: until the sink's client closes).
MAX_LEFTOVER_KEYS = 262144
LEFTOVER_BACKOFF_S = (0.1, 30.0)
#: How long a store sink's close (and interpreter exit) waits, at most, for the store call its
#: worker is in: longer than Mooncake's own RPC timeout (30 s), after which the call comes back
#: by itself.
CLOSE_WAIT_S = 60.0


class StoreSink(LiveSink):
    """The sink of the store placement. See the module docs."""

    def __init__(
        self,
        *,
        aux_layer_ids: Optional[list[int]] = None,
        max_pending_batches: Optional[int] = None,
        gpu_put: Optional[bool] = None,
    ) -> None:
        self.aux_layer_ids = aux_layer_ids
        pending = max_pending_batches or _capture_arena._max_pending_batches()
        if pending < 1:
            raise ConfigError("max_pending_batches must be >= 1")
        if gpu_put is None:
            check_store_gpu_put()
        #: Device tensors are put from device memory (else copied to the host first).
        self.device_publication = store_gpu_put() if gpu_put is None else bool(gpu_put)
        #: ``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S``; and the bound of :meth:`put_samples` when set
        #: (None: it waits for the store as long as the store takes).
        self.sync_wait_s = sync_wait_s()
        self.sync_bound: Optional[float] = None
        self._slots = threading.BoundedSemaphore(pending)
        self._pool = _Worker("capture-arena-store")
        self._lock = threading.Lock()
        self._store: Optional[Any] = None
        _CLIENTS.add(self)
        _SINKS.add(self)
        self._stats = dict.fromkeys(
            ("published_batches", "published_samples", "published_objects", "published_bytes", "failed_batches", "replaced_objects"), 0
        )
        self._closed = False
        #: This sink's keys whose removal failed, to be retried (an ordered set; the worker's).
        self._leftover: dict[str, None] = {}
        self._leftover_backoff = 0.0
        self._leftover_timer: Optional[threading.Timer] = None

    placement = "store"
    session = None
    control = None

    @property
    def started(self) -> bool:
        return self._store is not None

    def _client(self) -> Any:
        if self._store is None:
            self._store = connect(True)
        return self._store

    def start_in_background(self) -> None:
        """Connects to the store on the sink's worker now, before the first capture (a failure
        is logged; the first capture tries again)."""

        def connect_now() -> None:
            if self._closed:
                return
            try:
                with self._lock:
                    self._client()
            except Exception as e:
                _log.error("connecting to the Mooncake store in the background failed (the first capture tries again): %s", e)

        try:
            self._pool.submit(connect_now)
        except RuntimeError:  # closed
            pass

    def _after_fork_in_child(self) -> None:
        """A forked child must not close or destroy the parent's store client (the parent's
        objects would go with it): it keeps it referenced, and this sink is closed there."""
        if self._store is not None:
            _FORKED_LEFTOVERS.append(self._store)
        self._store = None
        self._closed = True
        self._leftover = {}  # the parent's to remove
        self._leftover_timer = None
        self._lock = threading.Lock()
        self._pool = _Worker("capture-arena-store")  # the parent's thread is not here
        self._pool.shutdown(0)

    def _config(self) -> Any:
        return replicate_config(importlib.import_module("mooncake.store"))

    def _publish(
        self, batch: Any, refused: list[tuple[int, dict[str, Any]]], ticket: Optional[_Ticket] = None
    ) -> list[dict[str, Any]]:
        """One batch's rows: its samples published (or failed together), the rows of the samples
        refused before it put back in their places."""
        try:
            rows = self._publish_batch(batch, ticket)
        except Exception as e:  # nothing of a batch may escape as an exception
            rows = self._fail(batch, f"publishing to the Mooncake store failed: {e}")
        for i, row in refused:
            rows.insert(i, row)
        return rows

    def _publish_batch(self, batch: Any, ticket: Optional[_Ticket] = None) -> list[dict[str, Any]]:
        """One batch: replace (or refuse keys already there), one batched put straight from the
        tensors' memory (registered for the call; device memory once the work that wrote it has
        finished); on any failure every key this batch wrote is removed again. A bounded
        caller's batch starts only if its caller still waits."""
        if not batch.samples():
            return []
        if self._closed:  # queued when the sink closed: not made, so its close waits for none
            return self._fail(batch, "not captured: the store sink closed before this batch could start (never written)")
        with self._lock:
            if ticket is not None and ticket.abandoned:
                return self._fail(batch, "its synchronous caller stopped waiting before it could start (never written)")
            try:
                store = self._client()
            except Exception as e:  # connecting failed: nothing was written
                return self._fail(batch, str(e))
            samples = batch.samples()
            tensors = [t for t in batch.tensors() if t[6] > 0]  # Mooncake cannot store 0 bytes
            if self._leftover:
                # Keys this sink failed to remove before, written again now: removed first (they
                # were never handed out), never by a retry after this batch made them anew.
                mine = [k for _, _, keys in samples for k in keys if self._leftover.pop(k, 0) is None]
                self._remove(store, mine)
            if any(t[7] >= 0 for t in tensors):
                # The capture kernels that wrote them, enqueued before the hand-over, finish first.
                batch.wait_ready(READY_TIMEOUT_S)
            for sid, replace, keys in samples:
                # A status missing, or an error for existence, is never taken as "absent": a put
                # over a key still there keeps Mooncake's old bytes and answers success.
                if replace:
                    removed = list(store.batch_remove(keys, True))
                    if len(removed) != len(keys):
                        return self._fail(batch, f"replace: the Mooncake store answered {len(removed)} statuses for removing {len(keys)} old objects")
                    for k, rc in zip(keys, removed):
                        if rc not in (0, NOT_FOUND):
                            return self._fail(batch, f"replace: removing the old object {k} returned {rc}")
                        self._stats["replaced_objects"] += rc == 0
                else:
                    # A re-put keeps Mooncake's old bytes: refuse instead, as the arena does.
                    exist = list(store.batch_is_exist(keys))
                    if len(exist) != len(keys):
                        return self._fail(batch, f"the Mooncake store answered {len(exist)} statuses for whether {len(keys)} keys exist")
                    unknown = [(k, e) for k, e in zip(keys, exist) if e not in (0, 1)]
                    if unknown:
                        return self._fail(batch, f"the Mooncake store could not tell whether {unknown[0][0]} exists (status {unknown[0][1]})")
                    there = [k for k, e in zip(keys, exist) if e == 1]
                    if there:
                        return self._fail(
                            batch,
                            f"key {there[0]} is already in the store; free it first or publish with \"replace\": true",
                        )
            total = sum(t[6] for t in tensors)
            keys = [t[2] for t in tensors]
            ptrs = [t[5] for t in tensors]
            sizes = [t[6] for t in tensors]
            rcs: list[int] = []
            why = ""
            try:
                registered = _Registered(store, [(t[5], t[6], t[7]) for t in tensors])
                try:
                    rcs = list(store.batch_put_from(keys, ptrs, sizes, self._config())) if keys else []
                finally:
                    registered.close()
            except Exception as e:
                why = f"the batched put failed ({e})"
            if not why and len(rcs) != len(keys):
                why = f"the Mooncake store answered {len(rcs)} statuses for {len(keys)} objects"
            failed = [(k, rc) for k, rc in zip(keys, rcs) if rc != 0]
            if not why and failed:
                k, rc = failed[0]
                why = f"the Mooncake store refused {len(failed)} of {len(keys)} objects (first: {k}: status {rc})"
            if why:
                # Every key of the batch is this batch's (checked absent or removed above).
                left = self._remove(store, keys)
                kept = f"; {len(left)} could not be removed yet (first: {left[0][0]}: {left[0][1]}; retried)" if left else "; none kept"
                return self._fail(batch, why + kept)
            if ticket is not None and not ticket.finish():
                # Its caller gave up meanwhile and told its request so: never to be read.
                left = self._remove(store, keys)
                return self._fail(batch, "its synchronous caller stopped waiting; removed again" + (f" ({len(left)} could not be yet; retried)" if left else ""))
            for k in keys:  # published now: a removal kept from before must never reach them
                self._leftover.pop(k, None)
            self._stats["published_batches"] += 1
            self._stats["published_samples"] += len(samples)
            self._stats["published_objects"] += len(keys)
            self._stats["published_bytes"] += total
            return list(batch.results())

    def _remove(self, store: Any, keys: list[str]) -> list[tuple[str, Any]]:
        """Removes this sink's ``keys`` (force; on its worker). Those that could not be are kept
        and retried (``MAX_LEFTOVER_KEYS``): returned, each with why."""
        if not keys:
            return []
        try:
            rcs = list(store.batch_remove(keys, True))
            bad = [(k, rc) for k, rc in zip(keys, rcs) if rc not in (0, NOT_FOUND)]
            bad += [(k, "no status answered") for k in keys[len(rcs) :]]
        except Exception as e:  # the master unreachable
            bad = [(k, str(e)) for k in keys]
        if bad:
            self._keep([k for k, _ in bad])
        return bad

    def _keep(self, keys: list[str]) -> None:
        """Keeps keys whose removal failed, and has them retried after the back-off."""
        for k in keys:
            self._leftover[k] = None
        lost = []
        while len(self._leftover) > MAX_LEFTOVER_KEYS:
            k = next(iter(self._leftover))
            del self._leftover[k]
            lost.append(k)
        if lost:
            _DROPPED.warn(
                "dropped_leftovers",
                "the store sink gave up removing %d of its objects (more than %d failed removals waited: the master has "
                "been unreachable); they stay in the store until this sink's client closes (first: %s)",
                len(lost), MAX_LEFTOVER_KEYS, lost[0],
            )
        lo, hi = LEFTOVER_BACKOFF_S
        self._leftover_backoff = min(hi, max(lo, 2 * self._leftover_backoff))
        if self._leftover_timer is not None and self._leftover_timer.is_alive():
            return
        timer = threading.Timer(self._leftover_backoff, self._queue_retry)
        timer.daemon = True
        try:
            timer.start()
            self._leftover_timer = timer
        except RuntimeError:  # no thread to be had: the next batch with one of these keys retries them
            self._leftover_timer = None

    def _queue_retry(self) -> None:
        try:
            self._pool.submit(self._retry_removals)
        except RuntimeError:  # closed: the client's close drops its keys
            pass

    def _retry_removals(self) -> None:
        """On the worker: one more try at the removals that failed."""
        with self._lock:
            store = self._store
            if store is None or self._closed or not self._leftover:
                return
            keys = list(self._leftover)
            self._leftover.clear()
            self._leftover_timer = None
            left = self._remove(store, keys)
        if left:
            _log.warning(
                "the store sink still cannot remove %d of its objects (first: %s: %s); retried in %g s",
                len(left), left[0][0], left[0][1], self._leftover_backoff,
            )
        else:
            self._leftover_backoff = 0.0
            _log.info("the store sink removed %d of its objects whose removal had failed", len(keys))

    def _fail(self, batch: Any, why: str) -> list[dict[str, Any]]:
        self._stats["failed_batches"] += 1
        return [{"sample_id": sid, "error": why} for sid, _, _ in batch.samples()]

    def submit_samples(self, samples: Sequence[Any], *, block: bool = True) -> "concurrent.futures.Future[list[dict[str, Any]]]":
        """Queues a batch (each sample validated now); the future gets one row per sample, in
        order: a result, or ``{"sample_id", "error"}``. Never raises for anything a request or
        the store causes (as :meth:`capture_arena.ArenaSink.submit_samples`). Blocks while
        ``max_pending_batches`` batches are pending (``block=False``: QueueFullError)."""
        return self._submit(samples, block=block)

    def _submit(
        self, samples: Sequence[Any], *, block: bool = True, until: Optional[float] = None, ticket: Optional[_Ticket] = None
    ) -> "concurrent.futures.Future[list[dict[str, Any]]]":
        from ._samples import _complete, _convert, _log_failures

        fut: concurrent.futures.Future[list[dict[str, Any]]] = concurrent.futures.Future()
        try:
            items = _convert(samples, host=not self.device_publication)
        except Exception as e:  # not a sequence of samples: no rows can be made
            fut.set_running_or_notify_cancel()
            fut.set_exception(InvalidSampleError(f"submit_samples takes a list of (spec, aux, last_hidden): {e}"))
            return fut
        try:
            if self._closed:
                raise WriterStoppedError("the StoreSink is closed")
            batch, refused = _capture_arena._plan_batch(items, self.aux_layer_ids)
        except Exception as e:
            fut.set_running_or_notify_cancel()
            _complete(fut, items, str(e))
            return fut
        if until is not None:
            if not self._slots.acquire(timeout=max(0.0, until - time.monotonic())):
                fut.set_running_or_notify_cancel()
                _complete(fut, items, "not captured: the store sink still held max_pending_batches batches when its synchronous caller stopped waiting")
                return fut
        elif not self._slots.acquire(blocking=block):
            raise QueueFullError("the store sink already holds max_pending_batches batches")
        try:
            fut = self._pool.submit(self._publish, batch, refused, ticket)
        except RuntimeError:  # closed meanwhile
            self._slots.release()
            fut.set_running_or_notify_cancel()
            _complete(fut, items, "the StoreSink is closed")
            return fut
        fut.add_done_callback(lambda _: self._slots.release())
        fut.add_done_callback(_log_failures)
        return fut

    def put_samples(self, samples: Sequence[Any], *, within_s: Optional[float] = _SINK_BOUND) -> list[dict[str, Any]]:
        """Publishes a batch and waits for its results. Bounded (``within_s`` seconds, or the
        sink's ``sync_bound``; what SGLang's scheduler thread gets under a patch that calls
        ``put_sample``): the call returns within that long whatever the store does (the store
        connection, earlier batches, a stalled master); a batch not published by then gets every
        sample's error row, and what of it the worker publishes later is removed again. Never
        raises for a sample or the store."""
        bound = self.sync_bound if within_s is _SINK_BOUND else within_s
        if bound is None:
            return self.submit_samples(samples).result()
        deadline = time.monotonic() + max(0.0, float(bound))
        ticket = _Ticket()
        fut = self._submit(samples, until=deadline, ticket=ticket)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            if not ticket.abandon():
                return fut.result()  # done just now
            rows: list[dict[str, Any]] = []
            for item in samples:
                spec = item[0] if isinstance(item, (tuple, list)) and item else None
                sid = spec.get("sample_id") if isinstance(spec, Mapping) else None
                rows.append(
                    {
                        "sample_id": sid,
                        "error": f"not captured: the Mooncake store sink did not publish this batch within {bound:g} s "
                        "(connecting to the store, earlier batches, or the store itself; SGLANG_SPEC_CAPTURE_SYNC_WAIT_S); "
                        "nothing of it stays in the store",
                    }
                )
            return rows

    def _publish_live(self, item: Any) -> dict[str, Any]:
        return self.put_samples([item], within_s=self.sync_wait_s)[0]

    def _drop_published(self, result: Mapping[str, Any]) -> None:
        """Removes a result this process published and will never hand out (on the worker)."""
        try:
            keys = _capture_arena._result_keys(result, True)
            self._pool.submit(self._remove_quietly, keys)
        except Exception as e:  # closed meanwhile: its client's objects went with it
            _log.debug("removing a dropped capture: %s", e)

    def _remove_quietly(self, keys: list[str]) -> None:
        with self._lock:
            store = self._store
        if store is None or self._closed:  # closing: the client's close drops its keys anyway
            return
        # Not under the lock: stats() and a publish never wait on a removal's call (the store
        # client is closed only once this worker has ended).
        bad = self._remove(store, keys)
        if bad:
            _log.warning("removing %d objects of a dropped capture from the Mooncake store failed (first: %s: %s); retried", len(bad), *bad[0])

    def put_sample(self, spec: Mapping[str, Any], *, aux: Any = None, last_hidden: Any = None) -> dict[str, Any]:
        """Publishes one sample and returns its result."""
        return self.put_samples([(spec, aux, last_hidden)])[0]

    def stats(self) -> dict[str, int]:
        """Counters of this sink, and live capture's (``live_*``) when it is on. Never waits
        for the store (only the worker thread writes the counters: a copy of them is whole)."""
        d = dict(self._stats)
        d["leftover_objects"] = len(self._leftover)  # removals that failed, being retried
        d.update(self._live_stats())
        return d

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Lets the worker run the batches queued for ``QUEUE_WAIT_S`` (5 s); then those not
        begun get error rows (never written) and the removals queued are dropped (the client's
        close removes its keys), the call in flight is waited for at most ``timeout_s``
        (``CLOSE_WAIT_S``, 60 s), and the store client is closed (its objects stay in the store
        only while a client holds them: Mooncake drops the keys of a closed client). A worker
        still in a store call after that is left to it, and the client open: closing it under
        that call would crash the process; its objects go when the process ends. Idempotent."""
        if self._closed:
            return
        if not self._stop(timeout_s):
            return
        with self._lock:
            if self._store is not None:
                self._store.close()

    def _stop(self, timeout_s: Optional[float]) -> bool:
        """Takes no more batches and lets the worker run those queued for ``QUEUE_WAIT_S``; then
        fails those not begun and waits for the one in flight (at most ``timeout_s``,
        ``CLOSE_WAIT_S``); whether the worker ended."""
        self._stop_live()
        bound = CLOSE_WAIT_S if timeout_s is None else timeout_s
        ran = self._pool.shutdown(min(QUEUE_WAIT_S, bound))
        self._closed = True  # what is still queued fails at once
        if ran or self._pool.shutdown(bound):
            return True
        _log.error(
            "closing the store sink: its worker is still in a Mooncake store call after %g s (the master stalled?); "
            "the store client is left open, and what it holds goes when this process ends",
            bound,
        )
        return False

    def __enter__(self) -> "StoreSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Mooncake's status for a size mismatch (a result whose shapes are not the stored object's).
SIZE_MISMATCH = -600


class _Worker:
    """Runs submitted calls in order on one daemon thread (started by the first). A one-thread
    ``ThreadPoolExecutor`` did this, but its thread is not a daemon: interpreter exit joins it
    without a bound after it ran everything queued, and with the master stalled each queued
    publish or removal waits out Mooncake's own timeout, for good if it has none."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: "queue.SimpleQueue[Optional[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> "concurrent.futures.Future[Any]":
        """Queues ``fn(*args)``; RuntimeError once shut down, or where no thread can be had."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the store sink's worker is shut down")
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                thread.start()  # RuntimeError where no thread can be had: nothing queued
                self._thread = thread
            self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the caller's future carries it
                fut.set_exception(e)

    def shutdown(self, timeout_s: float) -> bool:
        """Takes no more calls and waits up to ``timeout_s`` for those queued; whether the
        thread ended (none is left in a call)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(max(0.0, timeout_s))
        return not thread.is_alive()


class StoreReader:
    """Reads and frees store-placement results for ArenaFeatureStore.

    Reads have the read deadline (``SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S``): the store client works
    on a thread of its own and the caller waits at most that long; past it the read raises
    :class:`StaleSessionError`, the client is set aside (never destroyed) and a new one connects
    for the next read. A missing object (its producer gone, its segment unmounted) is
    :class:`StaleSessionError` too, as on every transport. Releases never wait on the network: the
    removals go out from a thread of their own, retried with a back-off (100 ms to 30 s) while the
    master cannot be reached; :meth:`flush` waits for them.
    """

    MAX_RELEASED = 262144
    MAX_PENDING_KEYS = 262144

    def __init__(self) -> None:
        from ._engine import _Clients

        _CLIENTS.add(self)
        self._lock = threading.Lock()
        #: The store clients reads and removals use (one unless reads got stuck).
        self._clients = _Clients(lambda: connect(False), "Mooncake store client")
        self._released: set[tuple[str, str, int]] = set()
        self._order: deque[tuple[str, str, int]] = deque()
        self._removals: deque[str] = deque()
        self._removing = 0
        self._changed = threading.Condition(self._lock)
        self._remover: Optional[threading.Thread] = None
        self.dropped = 0

    def _client(self, gone: Optional[threading.Event] = None) -> Any:
        """The store client (see :meth:`_Clients.get`: a read waiting for another thread's
        connect gives up once ``gone`` is set)."""
        return self._clients.get(gone)

    def clients(self) -> tuple[int, int]:
        """How many store clients this reader holds, and how many have reads stuck in them."""
        return self._clients.counts()

    def _after_fork_in_child(self) -> None:
        """A forked child keeps the parent's clients referenced (their destructors would unmount
        the parent's connections) and starts afresh with a new lock, and without the parent's
        queued removals (the parent's to make: made twice, one could remove a newer object)."""
        self._clients.after_fork_in_child(_FORKED_LEFTOVERS)
        self._removals = deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._remover = None
        self._removing = 0

    @staticmethod
    def ident(result: Mapping[str, Any]) -> tuple[str, str, int]:
        return (str(result["store_id"]), str(result["sample_id"]), int(result["gen"]))

    def check(self, result: Mapping[str, Any], names: list[str]) -> list[tuple[str, int]]:
        """``(key, bytes)`` of each name, validated (ids, shapes, dtypes) before anything is
        allocated; ReleasedError after :meth:`release`. (Validated first: a result without a
        ``gen`` is InvalidReadError, never a KeyError taken for a released one.)"""
        keys = [tuple(x) for x in _capture_arena._store_keys(result, names)]
        if self.ident(result) in self._released:
            raise ReleasedError(
                f"sample {result['store_id']}/{result['sample_id']}/g{result['gen']} was already released: its "
                "objects were removed from the store"
            )
        return keys  # type: ignore[return-value]

    def read(self, planned: list[tuple[str, int]], views: list[np.ndarray[Any, Any]]) -> None:
        """Reads each ``(key, bytes)`` into the matching uint8 view, within the read deadline."""
        from ._engine import read_timeout_s, run_bounded

        timeout = read_timeout_s()
        with self._lock:
            self._ensure_remover()
        wanted = [(k, n, v) for (k, n), v in zip(planned, views) if n > 0]
        if not wanted:
            return
        same_sizes([k for k, _, _ in wanted], [n for _, n, _ in wanted], [int(v.nbytes) for _, _, v in wanted])
        used: list[Any] = []
        # Set when the caller gave up (run_bounded sets it before timed_out runs): a read whose
        # client was still connecting then starts no transfer into the abandoned outputs, and
        # holds no client for timed_out or late to count.
        gone = threading.Event()
        guard = threading.Lock()
        # Set once a transfer may begin: a connect that failed or was given up on wrote nothing.
        began = threading.Event()

        def work() -> None:
            # A read given up on while another thread connects stops waiting (before: it waited
            # for that connect, and became the next connector for nobody when it failed).
            store = self._client(gone)
            with guard:
                if gone.is_set():
                    return
                used.append(store)
                began.set()
            ptrs = [int(v.ctypes.data) for _, _, v in wanted]
            registered = _Registered(store, [(p, n, -1) for p, (_, n, _) in zip(ptrs, wanted)])
            try:
                rcs = store.batch_get_into([k for k, _, _ in wanted], ptrs, [n for _, n, _ in wanted])
            finally:
                registered.close()
            if len(rcs) != len(wanted):  # never take an object without its status as read
                raise StaleSessionError(f"the Mooncake store answered {len(rcs)} statuses for {len(wanted)} objects")
            for (k, n, _), rc in zip(wanted, rcs):
                if rc == n:
                    continue
                if rc == SIZE_MISMATCH:
                    raise InvalidReadError(f"the Mooncake store holds {k} with another size than the result's {n} bytes (status {rc})")
                if rc >= 0:  # a smaller object there: published again under the key, with another shape
                    raise InvalidReadError(
                        f"the Mooncake store holds {k} with {rc} bytes, not the result's {n}: the object was published again "
                        "under its key (replace) since this result was made"
                    )
                why = "no such object: its producer is gone (its segment unmounted) or it was removed" if rc == NOT_FOUND else "the store or the object's segment cannot be reached"
                raise StaleSessionError(f"the Mooncake store returned {rc} for {k} ({n} bytes expected): {why}")

        def timed_out() -> str:
            with guard:
                if used:
                    self._clients.set_aside(used[0])
            _logs.get("capture_arena").warning("a Mooncake store read timed out after %.1f s; later reads use a new client", timeout)
            return (
                f"the Mooncake store read of {len(wanted)} objects ({sum(n for _, n, _ in wanted)} bytes) did not finish in "
                f"{timeout:.1f} s: the master or the objects' segment is unreachable from here (a partition, a host down); "
                "raise SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S for slower links"
            )

        def late() -> None:  # the stuck read returned: its client is let go when it was the last
            if used:
                self._clients.returned(used[0])

        run_bounded("capture-arena-store-read", work, views, timeout, timed_out, gone, late=late, began=began)

    def release(self, result: Mapping[str, Any]) -> None:
        """Marks ``result`` released (later reads raise ReleasedError) and queues the removal of
        its objects from the store (force: a reader's lease does not hold it back); returns without
        waiting on the network."""
        names = feature_names(result.get("features"))
        keys = [k for k, _ in self.check(result, names)]
        with self._lock:
            ident = self.ident(result)
            self._released.add(ident)
            self._order.append(ident)
            while len(self._order) > self.MAX_RELEASED:
                self._released.discard(self._order.popleft())
            self._removals.extend(keys)
            lost = []
            while len(self._removals) > self.MAX_PENDING_KEYS:
                lost.append(self._removals.popleft())
                self.dropped += 1
            self._changed.notify_all()
            self._ensure_remover()
        if lost:
            # Store objects have no lease: these stay until their producer's client closes.
            _DROPPED.warn(
                "dropped_removals",
                "%d removals from the Mooncake store dropped, %d in all (more than %d waited: the master has been unreachable); "
                "they stay in the store until their producer's client closes (first dropped: %s)",
                len(lost),
                self.dropped,
                self.MAX_PENDING_KEYS,
                lost[0],
            )

    def _ensure_remover(self) -> None:
        """Starts the remover thread unless it runs (``self._lock`` held). It is started by the
        first read as well as the first release: a release made at interpreter exit (as
        speculators' backend makes them) finds it there, where Python 3.12 and later can start
        no thread, so the exit flush waits for it within its bound."""
        if self._remover is not None and self._remover.is_alive():
            return
        remover = threading.Thread(target=_remove_for, args=(weakref.ref(self),), name="capture-arena-store-remove", daemon=True)
        try:
            remover.start()
            self._remover = remover
        except RuntimeError:
            # No thread to be had (a process at its limit, or an exit with no read before it):
            # the keys wait; flush removes them on its caller's thread.
            self._remover = None

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._removals) + self._removing

    def _remove_once(self) -> list[tuple[str, Any]]:
        """One try at removing what is queued; what failed (queued again), with why."""
        with self._lock:
            keys = list(self._removals)
            self._removals.clear()
            self._removing += len(keys)  # flush's own try may run beside the remover's
        if not keys:
            return []
        try:
            rcs = list(self._client().batch_remove(keys, True))
            bad = [(k, rc) for k, rc in zip(keys, rcs) if rc not in (0, NOT_FOUND)]
            # A key the store gave no status for was not removed as far as anyone knows.
            bad += [(k, "no status answered") for k in keys[len(rcs) :]]
        except Exception as e:  # the master unreachable, the client not connecting
            bad = [(k, str(e)) for k in keys]
        with self._lock:
            self._removing -= len(keys)
            if bad:
                self._removals.extendleft(reversed([k for k, _ in bad]))
            self._changed.notify_all()
        return bad

    def flush(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the queued removals; FreeNotSentError if some still wait.
        With no thread removing them (none could be started), one try is made on this thread."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            orphaned = bool(self._removals) and (self._remover is None or not self._remover.is_alive())
        if orphaned and timeout_s > 0:
            self._remove_once()
        with self._lock:
            while self._removals or self._removing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FreeNotSentError(
                        f"{len(self._removals) + self._removing} removals from the Mooncake store still wait after "
                        f"{timeout_s:.1f} s (the master is unreachable?); they keep being retried"
                    )
                self._changed.wait(min(left, 0.1))


#: How often an idle remover thread looks whether its reader is still there.
IDLE_LOOK_S = 1.0


def _remove_for(ref: "weakref.ref[StoreReader]") -> None:
    """A reader's remover: removes what it queued, retrying with a back-off while that fails,
    then waits for more. It holds the reader only while removals wait, so a reader nobody holds
    any more is collected (its clients with it) and the thread ends within ``IDLE_LOOK_S``."""
    backoff = 0.1
    log = _logs.get("capture_arena")
    while True:
        reader = ref()
        if reader is None:
            return
        changed = reader._changed
        with changed:
            if not reader._removals:
                del reader  # not held while it waits
                changed.wait(IDLE_LOOK_S)
                continue
        bad = reader._remove_once()
        del reader
        if bad:
            log.warning("removing %d objects from the Mooncake store failed (first: %s: %s); retrying in %.1f s", len(bad), bad[0][0], bad[0][1], backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
        else:
            backoff = 0.1


def same_sizes(names: list[str], lens: list[int], got: list[int]) -> None:
    """Raises unless each output holds exactly its feature's validated bytes (the result was
    read again to size the outputs: an object that answers differently the second time must not
    make a transfer write past one)."""
    for name, n, m in zip(names, lens, got):
        if n != m:
            raise InvalidReadError(f"the output for {name!r} holds {m} bytes, but the result's feature has {n} (did the result change while it was read?)")


def is_store_result(result: Mapping[str, Any]) -> bool:
    """A store-placement result: no arena, and features without addresses (an arena result
    that lost its ``arena`` is not one: reading or freeing it as one would ask the store)."""
    feats = result.get("features")
    return (
        "arena" not in result
        and isinstance(feats, Mapping)
        and not any(isinstance(f, Mapping) and "address" in f for f in feats.values())
    )


# Store clients a forked child must not destroy: the parent's.
_FORKED_LEFTOVERS: list[Any] = []
_CLIENTS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_SINKS: "weakref.WeakSet[StoreSink]" = weakref.WeakSet()


@atexit.register
def _stop_sinks_at_exit() -> None:
    """Stops every store sink at interpreter exit, as :meth:`StoreSink.close` waits (its worker
    is a daemon thread, which the exit would not wait for): queued batches run for
    ``QUEUE_WAIT_S``, those not begun then fail, the call in flight is waited for at most
    ``CLOSE_WAIT_S``. The store client is left to the process's end, as before (Mooncake drops
    its keys then; closing it against a master that does not answer takes its RPC timeouts over
    again)."""
    for sink in list(_SINKS):
        try:
            if not sink._closed:
                sink._stop(None)
        except Exception:  # never an exit's error
            _log.exception("stopping a store sink at exit")


def _after_fork_in_child() -> None:
    for c in list(_CLIENTS):
        c._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["StoreSink", "StoreReader", "is_store_result", "same_sizes", "connect"]
