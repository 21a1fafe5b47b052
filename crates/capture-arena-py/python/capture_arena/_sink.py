"""The arena sink: what an inference server's capture hook calls (:class:`ArenaSink`), and
:func:`new_sink`, which picks the sink of the placement the environment selects."""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import json
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, TypeVar

from ._capture_arena import _ArenaSink, _exiting, _forked_child, _result_keys, _result_stamped_keys, placement
from ._live import LiveSink
from ._store import StoreSink
from .errors import ConfigError, InvalidSampleError, QueueFullError
from ._samples import Result, Sample, _complete, _convert, _cuda_device, _interrupts, _log, _log_failures, _log_failures_of, _reason, _rows_for

_T = TypeVar("_T")

#: ``put_samples(within_s=...)`` left out: the sink's own ``sync_bound``.
_SINK_BOUND: Any = object()
#: How long interpreter exit waits for a sink's starter thread (see ``_drain_starter``).
STARTER_EXIT_WAIT_S = 2.0

#: After the arena could not be created, it is tried again at most this often (batches between
#: fail at once with the reason, synchronous and asynchronous alike).
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
    ``placement``               ``SGLANG_SPEC_CAPTURE_PLACEMENT``              auto (by protocol)
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
        #: The GPU the last start that named one asked for: a later try after a failed start
        #: (asked by a caller with no tensor, as vLLM's connector reserving rows) makes the arena
        #: there too, not on GPU 0.
        self._start_device: Optional[int] = None
        #: Threads that write reserved objects into the arena, stopped before it goes.
        self._stops: list[Callable[[], bool]] = []
        self._writers_stopped = True
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
        wait for it there. A failure is logged, and a capture at least ``START_RETRY_S`` (5 s)
        later tries again."""
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
        Callbacks added to the future run on the sink's helper thread (or, for a batch published
        again one sample at a time, see :meth:`_settle`, on the thread that did it) and must not
        block.
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
            try:
                self._enqueue(items, fut, block)
            except QueueFullError:
                raise
            except Exception as e:  # closed meanwhile (by another thread): the batch's rows
                _complete(fut, items, str(e))
        else:
            self._submit_now(items, fut, block)
        return fut

    def _submit_now(self, items: list[Any], fut: "concurrent.futures.Future[list[Result]]", block: bool) -> None:
        placed: concurrent.futures.Future[list[Result]] = concurrent.futures.Future()
        placed.set_running_or_notify_cancel()
        placed.add_done_callback(lambda f: self._settle(items, f, fut))
        try:
            self._submit(items, placed, block)
        except QueueFullError:
            if not block:
                raise
            _complete(fut, items, "the writer's queue is full")
        except BaseException as e:
            if _interrupts(e):
                raise
            # A panic of the extension (pyo3's PanicException is no Exception) too: the batch's
            # rows, never a raise into the scheduler's loop.
            _complete(fut, items, _reason(e))

    def _settle(
        self, items: list[Any], placed: "concurrent.futures.Future[list[Result]]", fut: "concurrent.futures.Future[list[Result]]"
    ) -> None:
        """Passes a placed batch's rows on (on the sink's helper thread); a batch that failed as
        a whole for what one sample may cause alone (a key already resident, more bytes than the
        arena) is published again one sample at a time, on a thread of its own, so that only the
        samples at fault fail."""
        def settle(rows: Any = None, error: Optional[BaseException] = None) -> None:
            try:
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(rows)
            except concurrent.futures.InvalidStateError:  # cancelled by its caller: nothing to do
                pass

        try:
            rows = placed.result()
        except BaseException as e:
            if isinstance(e, Exception) or _interrupts(e):
                settle(error=e)
            else:  # a panic of the extension: rows, not an exception the caller cannot catch
                settle(_rows_for(items, _reason(e)))
            return
        if not _alone(rows):
            settle(rows)
            return

        def one_by_one() -> None:
            try:
                again = self._put_each(items, self.arena_wait_s)
            except Exception as e:
                again = _rows_for(items, str(e))
            settle(again)

        try:
            threading.Thread(target=one_by_one, name="capture-arena-one-by-one", daemon=True).start()
        except RuntimeError:  # no thread to be had: the batch's own rows
            settle(rows)

    def _enqueue(
        self, items: list[Any], fut: "Optional[concurrent.futures.Future[list[Result]]]", block: bool, device: Optional[int] = None
    ) -> None:
        """Hands a batch that arrived before the writer started to the starter thread. The
        batches waiting there count against ``max_pending_batches``; a start asked for alone
        (:meth:`start_in_background`) does not."""
        limit = max(1, self.max_pending_batches)
        with self._early_lock:
            while fut is not None and (waiting := sum(f is not None for _, f in self._early)) >= limit:
                if not block:
                    raise QueueFullError(f"{waiting} batches already wait for the arena to be created")
                self._early_lock.wait(1.0)
            started = self._hand_to_starter((items, fut), device)
            why = f"creating the capture arena failed ({self._start_error})"
        if not started:
            if fut is None:
                _log.error("%s; a capture at least %g s later tries again", why, START_RETRY_S)
            else:
                _complete(fut, items, why)

    def _started_or_closed(self) -> bool:
        """``started``, never raising (a closed sink's getters raise): True once closed."""
        try:
            return bool(self.started)
        except Exception:
            return True

    def _recently_failed(self) -> bool:
        """Whether the last start failed less than ``START_RETRY_S`` ago."""
        return self._start_error is not None and time.monotonic() - self._start_failed_at < START_RETRY_S

    def _hand_to_starter(self, entry: Any, device: Optional[int]) -> bool:
        """Queues ``entry`` for the starter thread, starting it if none runs (``_early_lock``
        held); False, nothing queued, where no arena exists and a start failed moments ago (its
        reason at once, no thread for another try) or no thread can be had."""
        if device is None:
            device = self._start_device
        else:
            self._start_device = device
        if self._starter is not None:
            self._early.append(entry)
            return True
        if not self.started and self._recently_failed():
            return False
        self._early.append(entry)
        if not self._start_starter(device):
            self._early.pop()
            return False
        return True

    def _start_starter(self, device: Optional[int]) -> bool:
        """Starts the starter thread (``_early_lock`` held); False, with the reason recorded as
        a failed start, where no thread can be had (a process at its thread limit; interpreter
        exit on Python 3.12+): the batches that asked fail, and the next try waits
        ``START_RETRY_S`` as after any failed start."""
        starter = threading.Thread(target=self._start_early, args=(device,), name="capture-arena-start", daemon=True)
        try:
            starter.start()
        except RuntimeError as e:
            self._starter = None
            self._start_error = f"no thread to create it on: {e}"
            self._start_failed_at = time.monotonic()
            return False
        self._starter = starter
        return True

    def _start_early(self, device: Optional[int]) -> None:
        """The starter thread: creates the arena (GIL released while it does), then submits the
        batches that waited for it, in order; a failed start fails the batch at hand with the
        reason, and a batch at least ``START_RETRY_S`` later tries again (those between fail at
        once with the reason)."""
        while True:
            with self._early_lock:
                if not self._early:
                    self._starter = None
                    return
                items, fut = self._early[0]
            interrupted = True
            try:
                self._start_one(items, fut, device)
                interrupted = False
            finally:
                # Whatever happened, the batch leaves the queue and the waiters are woken; a
                # thread ended by an interrupt fails its batch and hands the ones behind to a new
                # starter (they are never left to a dead thread).
                stranded: list[Any] = []
                with self._early_lock:
                    self._early.popleft()
                    self._starts_done += 1
                    if interrupted:
                        self._starter = None
                        if self._early and not self._start_starter(device):
                            stranded, why = list(self._early), f"creating the capture arena failed ({self._start_error})"
                            self._early.clear()
                    self._early_lock.notify_all()
                # Completed outside the lock (a future's callbacks run here).
                if interrupted and fut is not None:
                    _complete(fut, items, "the thread creating the capture arena was interrupted")
                for left_items, left_fut in stranded:
                    if left_fut is not None:
                        _complete(left_fut, left_items, why)
            del items, fut

    def _start_one(self, items: Any, fut: "Optional[concurrent.futures.Future[list[Result]]]", device: Optional[int]) -> None:
        """The starter's work for one queued batch (``fut`` None: a start asked for alone)."""
        if not self._started_or_closed() and self._recently_failed():
            # A start failed a moment ago (the batches queued behind it among others): its
            # reason at once, not another try (each can allocate and pre-fault the whole arena
            # before what fails), as the synchronous calls have it; unless a synchronous call
            # has made the arena meanwhile.
            if fut is not None:
                _complete(fut, items, f"creating the capture arena failed ({self._start_error})")
            return
        try:
            self._ensure_started(items or None, device)
        except BaseException as e:
            if _interrupts(e):
                raise
            # A panic of the extension (pyo3's PanicException is no Exception) fails the same.
            self._start_error = _reason(e)
            self._start_failed_at = time.monotonic()
            if fut is None:
                _log.error("creating the capture arena in the background failed (a capture at least %g s later tries again): %s", START_RETRY_S, e)
            else:
                _complete(fut, items, _reason(e))
            return
        self._start_error = None
        if fut is not None:
            self._submit_now(items, fut, True)

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
            # A starter creating the arena is waited for: it would leave the arena behind, and
            # an engine-placement one runs in Mooncake (C++ that a finalizing interpreter must
            # not unwind). Otherwise it is in Python or in a call of ours (a submit waiting for
            # queue room behind a batch that waits for frees, up to
            # SGLANG_SPEC_CAPTURE_ARENA_WAIT_S): the exit hook waits a while for such calls and
            # parks what comes back later, so the exit need not wait that out.
            starter.join(STARTER_EXIT_WAIT_S)
            if starter.is_alive() and not self._started_or_closed():
                starter.join()  # it creates the arena, or is about to (its batch is the last)

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
                if _alone(rows):  # see _settle
                    rows = self._put_each(items, self.arena_wait_s)
            except BaseException as e:
                if _interrupts(e):
                    raise
                rows = _rows_for(items, _reason(e))  # a panic of the extension too
        if any("error" in r for r in rows):
            _log_failures_of(rows)
        return rows

    def _put_within(self, items: list[Any], bound: float, each: bool = False) -> list[Result]:
        """A bounded synchronous publish (see :meth:`put_samples`; ``each``: :meth:`put_each`)."""
        deadline = time.monotonic() + max(0.0, bound)
        try:
            if not self._started_within(items, deadline, bound):
                return _rows_for(items, self._not_started(bound))
            left = max(0.0, deadline - time.monotonic())
            if each:
                return self._put_each(items, left)
            rows = self._put(items, left)
            if _alone(rows):  # see _settle
                return self._put_each(items, max(0.0, deadline - time.monotonic()))
            return rows
        except BaseException as e:
            if _interrupts(e):
                raise
            return _rows_for(items, _reason(e))  # a panic of the extension too

    def _started_within(self, items: list[Any], deadline: float, bound: float) -> bool:
        return self.started or self._wait_started(items, deadline)

    def _not_started(self, bound: Optional[float]) -> str:
        """Why a bounded caller got no arena (``bound`` None: one that does not wait for it)."""
        if self._start_error is not None:
            return (
                f"not captured: creating the capture arena failed ({self._start_error}); tried again at a capture "
                f"at least {START_RETRY_S:g} s after the last try"
                + ("" if bound is not None else ", which vLLM's thread does not wait for")
            )
        waits = (
            "this caller does not wait for it"
            if bound is None
            else f"a synchronous caller waits at most {bound:g} s (SGLANG_SPEC_CAPTURE_SYNC_WAIT_S)"
        )
        return (
            f"not captured: the capture arena is still being created, off this thread (about half a second per "
            f"GiB of SGLANG_SPEC_CAPTURE_ARENA_BYTES), and {waits}; later captures go in once it exists"
        )

    def put_each(self, samples: Sequence[Sample], *, within_s: float) -> list[Result]:
        """Publishes each sample as a batch of its own (whole, or failing alone), all handed to
        the writer at once, and waits for every row (one per sample, in order; never raises for
        a sample or the machine). The whole call waits at most ``within_s`` for space (and for
        the arena, which is never created here): the samples wait for frees in order until that
        one deadline, and a sample whose turn comes after it is published if it fits at once and
        gets its error row at once otherwise. So the call takes ``within_s`` plus the copies of
        what it publishes, however many samples it has (what vLLM's connector gives an engine
        step). Batches other threads queued before it are waited for."""
        items = _convert(samples)
        rows: list[Result]
        if all(isinstance(it, dict) for it in items):
            rows = items
        else:
            rows = self._put_within(items, float(within_s), each=True)
        if any("error" in r for r in rows):
            _log_failures_of(rows)
        return rows

    def _wait_started(self, items: list[Any], deadline: float) -> bool:
        """Has the starter thread create the arena and waits until it exists, or until
        ``deadline``, or until that start failed (False at once). A failed start is tried again
        by a call at least ``START_RETRY_S`` later; the calls between fail at once with its
        reason, so a machine that cannot make the arena costs each capture nothing."""
        with self._early_lock:
            if self.started:
                return True
            if self._starter is None:
                device = next((d for d in (_cuda_device(x) for s in items if not isinstance(s, dict) for x in s[1:]) if d is not None), None)
                if not self._hand_to_starter(([], None), device):
                    return False
            seen = self._starts_done
            while not self.started:
                left = deadline - time.monotonic()
                if left <= 0 or (self._starts_done > seen and self._start_error is not None):
                    return False
                self._early_lock.wait(left)
            return True

    def reserve_each(
        self, specs: Sequence[Mapping[str, Any]], *, within_s: float
    ) -> "list[tuple[Result, Optional[dict[str, int]]]]":
        """Reserves each ``{"store_id", "sample_id", "gen", "replace", "features": {name:
        {"shape", "dtype"}}}`` as a sample of its own whose bytes the caller writes itself, and
        returns at once, for each spec in order (never raising for a spec or the machine),
        ``(result, writable)``: the result, whose objects' stamp words say "still being written"
        (readers wait for them: the readiness rule of docs/protocol.md), and ``{name: address}``,
        where this process writes each feature's bytes (its own mapping of the arena: host
        memory, or device memory of a device arena; a NIXL server process advertises others in
        the result); or ``({"sample_id", "error"}, None)``. The caller then calls
        :meth:`finish_writes`, always: a free meanwhile waits for it. The whole call waits for
        space at most ``within_s``, as :meth:`put_each`."""
        items: list[Any] = list(specs)
        out = self._reserved(within_s, lambda left: self._reserve_each(items, left))
        if isinstance(out, str):
            return [(r, None) for r in _unreserved(items, out)]
        if any("error" in r for r, _ in out):
            _log_failures_of([r for r, _ in out])
        return out

    def _reserve_each_keys(
        self, specs: Sequence[Mapping[str, Any]], *, within_s: float, hold_gil_s: Optional[float] = None
    ) -> "list[_Reserved]":
        """:meth:`reserve_each` for a caller that sends each row on as JSON and keeps no dict of
        it: :meth:`_reserve_each_begin` and its ``wait`` in one call."""
        return self._reserve_each_begin(specs, within_s=within_s).wait(hold_gil_s)

    def _reserve_each_begin(self, specs: Sequence[Mapping[str, Any]], *, within_s: float) -> "_Reservations":
        """Hands :meth:`reserve_each`'s reservations to the writer and returns at once (waiting
        only while the arena is being created or the writer's queue has no room), for a caller
        that collects them later with ``wait()``: vLLM's connector begins when a step is bound
        and collects after the forward, so vLLM's thread never waits for the writer to place
        them. The space is waited for at most ``within_s`` from now. Each spec's reservation is
        ``(keys, writable, json)``: the objects' keys for :meth:`_finish_keys` and
        :meth:`_drop_keys` (None for an error row), where this process writes each feature and
        the object's stamp (``{name: (address, stamp)}``), and the row's compact JSON text, both
        made by the extension (no dict of the row)."""
        items: list[Any] = list(specs)
        begun = self._reserved(within_s, lambda left: self._begin_reserving(items, left))
        return _Reservations(items, begun)

    def _reserve_rows_begin(
        self, store_id: str, dtype: str, width: int, requests: list[tuple[str, int, int]], *, within_s: float, wait_for_retry: bool = True
    ) -> "_Reservations":
        """:meth:`_reserve_each_begin` for requests of rows, with no spec to build or read: each
        ``(sample_id, gen, n)`` is ``hidden_states`` ``[1, n, width]`` of ``dtype`` and
        ``token_ids`` ``[1, n]`` int64 (vLLM's connector: a step's finished prompts). Without
        ``wait_for_retry``, a new try to create the arena after a failed one is asked for and
        never waited for: the requests fail at once (vLLM's thread; the first creation is
        waited for, at most ``within_s``, so that the first captures are not lost to start-up)."""
        begun = self._reserved(
            within_s, lambda left: self._begin_reserving_rows(store_id, dtype, width, requests, left), wait_for_retry=wait_for_retry
        )
        return _Reservations(requests, begun)

    def _reserved(self, within_s: float, reserve: "Callable[[float], _T]", wait_for_retry: bool = True) -> "_T | str":
        """``reserve(seconds left)`` once the arena exists, waiting for it at most ``within_s``
        (for a try after a failed start, not at all without ``wait_for_retry``); the reason
        instead when it does not, or the reservation raised (never raises)."""
        now = time.monotonic()
        deadline = now + max(0.0, float(within_s))
        wait = wait_for_retry or self._start_error is None
        try:
            if not self._started_within([], deadline if wait else now, float(within_s)):
                return self._not_started(float(within_s) if wait else None)
            return reserve(max(0.0, deadline - time.monotonic()))
        except BaseException as e:  # a panic of the extension too: the caller's rows, never a raise
            if _interrupts(e):
                raise
            return _reason(e)

    @property
    def local_region(self) -> Optional[tuple[int, int]]:
        """The arena's memory in this process, ``(address, bytes)`` (None before it exists)."""
        try:
            return self._local_region()
        except Exception:  # closed
            return None

    def finish_writes(self, results: Sequence[Mapping[str, Any]], ok: bool = True) -> None:
        """The caller wrote every byte of these results (from :meth:`reserve_each`) and they
        are visible to other processes (a device copy has completed): readers may read them. With
        ``ok=False`` they never will be: their readers fail, and their space is freed. A free
        asked for meanwhile is applied now. Never raises for a result (a closed sink has no
        arena left to finish): one that names no object of this sink's is logged and costs the
        others nothing."""
        keys: list[str] = []
        stamped: list[tuple[str, int]] = []
        for r in results:
            try:
                if "error" not in r:
                    for key, stamp in _result_stamped_keys(r):
                        if stamp is None:
                            keys.append(key)
                        else:
                            stamped.append((key, stamp))
            except Exception as e:  # not a result (a reserve_each pair, a forged one): its own loss
                _log.warning("finish_writes: skipped what is not a result of this sink's: %.300s", e)
        # By stamp where the result gives one: a late or repeated finish of a result never
        # finishes (or fails) a newer object published under its key since.
        self._finishing(self._finish_writes_stamped, stamped, ok)
        self._finish_keys(keys, ok)

    def _finish_keys(self, keys: list[str], ok: bool = True) -> None:
        """:meth:`finish_writes` by the objects' keys (:meth:`_reserve_each_keys`)."""
        self._finishing(self._finish_writes, keys, ok)

    def _finish_written_objects(self, objects: list[tuple[int, int, int]], ok: bool = True) -> None:
        """Finishes (``ok``) or fails the objects this process wrote, each named by what it
        checked before writing: ``(stamp, address, bytes)``, the address in this process's
        mapping. So a writer finishes or fails exactly what it wrote, whatever keys its
        bookkeeping holds (with ``ok``, an object that does not lie there is failed; without,
        left to its own writer). Never raises (as :meth:`_finish_keys`)."""
        self._finishing(self._finish_written, objects, ok)

    @staticmethod
    def _finishing(finish: Callable[[Any, bool], None], objects: Sequence[Any], ok: bool) -> None:
        """Hands finished (or failed) writes to the writer; never raises."""
        if not objects:
            return
        try:
            finish(objects, ok)
        except Exception as e:  # closed meanwhile: its arena went with it
            _log.debug("finishing writes: %s", e)

    def stats(self) -> dict[str, int]:
        """The writer's counters (all zero before the first capture), and live capture's
        (``live_*``) when it is on."""
        d = dict(super().stats())
        d.update(self._live_stats())
        return d

    def close(self) -> None:
        """Stops live capture, the threads writing reserved objects (:meth:`on_close`), the
        writer, and removes the arena. Idempotent. If a thread writing into the arena does not
        stop, the arena is left mapped (removed at exit) rather than pulled from under it."""
        self._close(at_exit=False)

    def _close(self, at_exit: bool) -> None:
        self._stop_live()
        if not self._stop_writers():
            if at_exit:
                # Left mapped under the write; its name must not outlive the process in /dev/shm.
                self._remove_name_at_exit()
            _log.error("a thread still writes into the capture arena: it is left in place until the process exits")
            return
        if at_exit:
            self._close_at_exit()
        else:
            super().close()

    def _stop_writers(self) -> bool:
        """Calls the :meth:`on_close` callbacks (once); whether every writing thread stopped."""
        stops, self._stops = self._stops, []
        self._writers_stopped = all([_stopped(stop) for stop in stops]) and self._writers_stopped
        return self._writers_stopped

    def on_close(self, stop: "Callable[[], bool]") -> None:
        """Registers ``stop``, called first by :meth:`close` (and at interpreter exit): it stops
        a thread that writes reserved objects' bytes into the arena (:meth:`reserve_each`) and
        returns whether it stopped, so the arena is never removed under a write."""
        self._stops.append(stop)

    def _publish_live(self, item: Any) -> Result:
        # On live capture's worker, not the scheduler's thread: a full arena is waited for as by
        # any batch (SGLANG_SPEC_CAPTURE_ARENA_WAIT_S), not for the scheduler's bound alone.
        try:
            bound = max(self.sync_wait_s, self.arena_wait_s)
        except Exception:  # closed: the batch's own row says so
            bound = 0.0
        return self.put_samples([item], within_s=bound)[0]

    def _drop_published(self, result: Mapping[str, Any]) -> None:
        """Frees a result this process published and will never hand out, at once."""
        self._drop_keys(_result_keys(result))

    def _drop_keys(self, keys: list[str]) -> None:
        """:meth:`_drop_published` by the objects' keys (:meth:`_reserve_each_keys`)."""
        try:
            self._free_local(keys)
        except Exception as e:  # closed meanwhile: its arena went with it
            _log.debug("freeing a dropped capture: %s", e)

    def put_sample(self, spec: Mapping[str, Any], *, aux: Any = None, last_hidden: Any = None) -> Result:
        """Publishes one sample and returns its result."""
        return self.put_samples([(spec, aux, last_hidden)])[0]

    def __enter__(self) -> "ArenaSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



#: A reservation as :meth:`ArenaSink._reserve_each_keys` returns it: the objects' keys (None:
#: not published), where this process writes each feature with the object's stamp
#: (``{name: (address, stamp)}``: vLLM's native row copy checks the stamp word before it
#: writes), and the result's JSON text.
_Reserved = tuple[Optional[list[str]], Optional[dict[str, tuple[int, int]]], bytes]
#: A reservation as :meth:`_Reservations.wait_dicts` returns it: its result as a dict.
_ReservedRow = tuple[Optional[list[str]], Optional[dict[str, tuple[int, int]]], dict[str, Any]]


class _Reservations:
    """Reservations handed to the writer (:meth:`ArenaSink._reserve_each_begin`), collected
    once with :meth:`wait`. Dropped uncollected, the extension fails and frees their objects."""

    def __init__(self, items: list[Any], begun: Any) -> None:
        self._items, self._begun = items, begun

    def wait(self, hold_gil_s: Optional[float] = None) -> "list[_Reserved]":
        """Each spec's ``(keys, writable, json)``, in order, once the writer has placed them (or
        the deadline passed); never raises. The wait keeps the GIL for its first 2 ms
        (``hold_gil_s``): given up, the GIL can take Python's switch interval (5 ms) to come
        back while another thread runs Python."""
        out: "list[_Reserved] | str" = self._collect(False, hold_gil_s)
        if isinstance(out, str):
            return [(None, None, json.dumps(r, separators=(",", ":"), default=str).encode()) for r in _unreserved(self._items, out)]
        failed = [json.loads(text) for keys, _, text in out if keys is None]
        if failed:
            _log_failures_of(failed)
        return out

    def wait_dicts(self, hold_gil_s: Optional[float] = None) -> "list[_ReservedRow]":
        """:meth:`wait` with each result as a dict, made by the extension (no JSON text to parse
        for a caller that keeps the row in this process)."""
        out: "list[_ReservedRow] | str" = self._collect(True, hold_gil_s)
        if isinstance(out, str):
            return [(None, None, r) for r in _unreserved(self._items, out)]
        failed = [row for keys, _, row in out if keys is None]
        if failed:
            _log_failures_of(failed)
        return out

    def _collect(self, dicts: bool, hold_gil_s: Optional[float]) -> Any:
        """The extension's reservations (JSON texts, or with ``dicts`` dicts), or why there are
        none."""
        begun, self._begun = self._begun, None
        if begun is None:
            return "these reservations were collected already"
        if isinstance(begun, str):
            return begun
        try:
            if hold_gil_s is None:
                return begun.wait(True, dicts=dicts)
            return begun.wait(True, float(hold_gil_s), dicts=dicts)
        except BaseException as e:  # the extension fails what it reserved itself (a panic too)
            if _interrupts(e):
                raise
            return _reason(e)



def _alone(rows: list[Result]) -> bool:
    """Whether a batch's rows ask for its samples to be published one by one (the native sink
    marks them so when the batch failed whole for what one sample may cause alone); the marker
    is taken off every row."""
    alone = False
    for r in rows:
        if isinstance(r, dict) and r.pop("_alone", False):
            alone = True
    return alone


def _unreserved(specs: Sequence[Any], error: str) -> list[Result]:
    """``{"sample_id", "error"}`` for each reservation spec when none could be reserved (its
    ``sample_id`` if it has one)."""
    return [{"sample_id": _spec_id(sp), "error": error} for sp in specs]


def _spec_id(spec: Any) -> Any:
    """A reservation's ``sample_id``: a spec's, or the first of a request of rows
    (:meth:`ArenaSink._reserve_rows_begin`)."""
    if isinstance(spec, Mapping):
        return spec.get("sample_id")
    if isinstance(spec, tuple) and spec:
        return spec[0]
    return None


def _stopped(stop: "Callable[[], bool]") -> bool:
    try:
        return bool(stop())
    except Exception:
        _log.exception("stopping a thread that writes into the capture arena failed")
        return False


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


def _after_fork_in_child() -> None:
    """A forked child closes none of its parent's sinks at its exit (their writers, threads and
    locks are the parent's: one held at the fork would hang the child's exit), and waits for
    none of the parent's calls in flight."""
    global _LIVE_SINKS
    _LIVE_SINKS = weakref.WeakSet()
    # The fork may have come while another thread made an engine arena under this lock.
    ArenaSink._starting = threading.Lock()
    _forked_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_sinks_at_exit() -> None:
    """Stops every live sink's writer and removes its arena when the interpreter exits. A starter
    thread still creating an engine-placement arena (in Mooncake) is waited for first: it would
    otherwise come back to a finalizing interpreter, which ends the thread in the middle of native
    code; any other starter at most ``STARTER_EXIT_WAIT_S`` (its calls of ours park if they come
    back after the exit hook)."""
    sinks = list(_LIVE_SINKS)
    for sink in sinks:
        # Live capture takes no more captures, and threads that write reserved objects (vLLM's
        # copies) stop, before calls into the extension park (below) and before any arena is
        # removed.
        sink._stop_live()
        sink._stop_writers()
    for sink in sinks:
        sink._drain_starter()
    # From here on, another thread coming back from native code (a daemon thread's capture or
    # read) parks instead of being ended mid-unwind by the finalizing interpreter; calls still in
    # flight are waited for (a while), so no library is torn down under them.
    left = _exiting()
    if left:
        _log.warning("exiting with %d capture_arena calls still running in other threads", left)
    for sink in sinks:
        # A call that parks holds its sink for good: a shared-memory arena's name goes even so.
        sink._close(at_exit=True)

