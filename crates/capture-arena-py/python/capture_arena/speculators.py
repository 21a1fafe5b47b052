"""capture-arena as a hidden-states backend of speculators' trainer (``hs_connectors`` 0.9,
speculators 0.9): vLLM publishes with :mod:`capture_arena.vllm`, the trainer reads by address
and frees over the control port, with no file in between.

Importing this module registers the backend ``capture-arena`` with
``hs_connectors.HiddenStatesBackend``; import it before speculators reads its backends
(``speculators.train.config.resolution`` collects their flags when it is imported)::

    import capture_arena.speculators  # noqa: F401  (registers --hidden-states-backend capture-arena)

Reading needs only torch and this package (no vLLM): :meth:`CaptureArenaTransfer.get_generated`
takes a request's ``kv_transfer_params`` and returns ``{"hidden_states": [n, k, H],
"token_ids": [n]}`` (the arena's ``[1, n, k*H]`` reshaped; the model's dtype, int64), copied
out; :meth:`CaptureArenaTransfer.delete` frees the request's objects, whether or not their read
succeeded (speculators deletes a handle whose ``get_generated`` raised, then asks again with a
fresh request). A request vLLM could not publish (a full arena, a prompt longer than the arena)
comes with a handle too (``capture-arena-error:{request id}``, naming no object), so that
speculators' client hands it on: :meth:`~CaptureArenaTransfer.get_generated` raises
:class:`CaptureArenaError` with vLLM's reason, which speculators logs with each attempt.

A transfer pickles (speculators' dataloader workers are spawned with their copy): each process
opens its own reader at ``setup()``. What a process read and speculators never deleted (a worker
stopped between its read and its delete: Ctrl+C reaches dataloader workers as a
``KeyboardInterrupt``, which speculators does not catch) is freed when that process exits.

speculators' client takes the handle out of vLLM's response in ``extract_output``
(speculators/data_generation/vllm_client.py), which refuses a response whose prompt token ids
differ from the sample's (a chat template re-rendered otherwise) or that lacks a field. vLLM has
published that capture already, and the handle never reaches :meth:`CaptureArenaTransfer.delete`;
each retry publishes another. A transfer therefore wraps ``extract_output`` (once per process):
a response it refuses has its capture freed before the error goes on.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import functools
import importlib
import multiprocessing.util
import os
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Optional

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer
from hs_connectors.transfer import FileTransfer

from . import _logs
from ._reader import ArenaFeatureStore, handle_of
from .errors import CaptureArenaError

__all__ = ["CaptureArenaBackend", "CaptureArenaTransfer", "NAME"]

#: The backend's name (``--hidden-states-backend``).
NAME = "capture-arena"
#: Results handed to get_generated and not yet deleted that a transfer remembers; past it the
#: oldest are freed.
MAX_UNDELETED = 4096

log = _logs.get(__name__)
#: The transfers of this process, for the exit hook.
_TRANSFERS: "weakref.WeakSet[CaptureArenaTransfer]" = weakref.WeakSet()


#: Frees the captures of responses speculators' client refused (made on first use).
_REFUSED: Optional[ArenaFeatureStore] = None
_REFUSED_LOCK = threading.Lock()


def _free_refused(response: Any) -> None:
    """Frees the capture a response refused by speculators' client carries, if any (never
    raises: the client's own error goes on)."""
    global _REFUSED
    params = getattr(response, "kv_transfer_params", None)
    result = params.get("capture_arena") if isinstance(params, dict) else None
    if not isinstance(result, dict) or "error" in result:
        return  # no capture: nothing was published
    try:
        with _REFUSED_LOCK:
            if _REFUSED is None:
                _REFUSED = ArenaFeatureStore()
            reader = _REFUSED
        reader.release(result)
        log.warning(
            "capture_arena.speculators: speculators' client refused vLLM's response for %r; its capture was freed",
            result.get("sample_id"),
        )
    except Exception as e:  # a result that is not one: nothing of ours to free
        log.warning("capture_arena.speculators: could not free the capture of a refused response: %s", e)


def _wrap_extract_output() -> None:
    """Has speculators' ``extract_output`` free the capture of a response it refuses (once per
    process; a speculators without it is left as it is)."""
    try:
        client = importlib.import_module("speculators.data_generation.vllm_client")
    except ImportError:
        return
    real = getattr(client, "extract_output", None)
    if not callable(real) or getattr(real, "_frees_refused", False):
        return

    @functools.wraps(real)
    def extract_output(response: Any, token_ids: Any) -> Any:
        try:
            return real(response, token_ids)
        except Exception:
            _free_refused(response)
            raise

    extract_output._frees_refused = True  # type: ignore[attr-defined]
    setattr(client, "extract_output", extract_output)


class CaptureArenaTransfer(HiddenStatesTransfer):
    """The trainer's reader. ``cache_dir``: where previously cached samples are
    (``hs_{file_idx}.safetensors``, as the file backend writes them), or None."""

    def __init__(self, cache_dir: Optional[Path] = None) -> None:
        # In every process that has a transfer (a spawned dataloader worker makes its copy here).
        _wrap_extract_output()
        self._cached = FileTransfer(cache_dir) if cache_dir is not None else None
        self._store: Optional[ArenaFeatureStore] = None
        self._read: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def setup(self) -> None:
        """Opens the reader (in the process that reads: a dataloader worker's own). In a
        worker, SIGTERM frees what it read first (installed here: torch's DataLoader puts its
        own SIGTERM handler over any made before its worker loop starts)."""
        if self._store is None:
            self._store = ArenaFeatureStore()
            _TRANSFERS.add(self)
            # A transfer let go (its dataset dropped) with results read and never deleted frees
            # them then; at exit the exit hook does (before the reader's flush).
            weakref.finalize(self, _free_left, self._store, self._read).atexit = False
        if multiprocessing.parent_process() is not None or torch.utils.data.get_worker_info() is not None:
            _free_on_sigterm()

    def get_cached(self, file_idx: int) -> Optional[dict[str, torch.Tensor]]:
        return self._cached.get_cached(file_idx) if self._cached is not None else None

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> Optional[dict[str, torch.Tensor]]:
        """``{"hidden_states": [n, k, H], "token_ids": [n]}`` of the request whose
        ``kv_transfer_params`` these are, copied out of the arena."""
        result = hs_transfer_params.get("capture_arena") if isinstance(hs_transfer_params, dict) else None
        if not isinstance(result, dict):
            raise CaptureArenaError(
                "kv_transfer_params carry no `capture_arena` result: start vLLM with "
                "--kv-transfer-config '{\"kv_connector\": \"CaptureArenaConnector\", \"kv_role\": \"kv_producer\", "
                "\"kv_connector_module_path\": \"capture_arena.vllm\"}'"
            )
        if "error" in result:
            # Outside input, logged by speculators at each retry: bounded (an error naming a
            # request id carries the id, of any length).
            raise CaptureArenaError(f"vLLM did not publish request {str(result.get('sample_id'))[:200]!r}: {str(result['error'])[:1000]}")
        self.setup()
        assert self._store is not None
        # What speculators' client took as the handle, and deletes: it must name this result's
        # objects, else that delete would free nothing (or another request's).
        handle = hs_transfer_params.get("hidden_states_path") or hs_transfer_params.get("handle")
        expected = handle_of(result)
        if handle != expected:
            try:  # nobody could free it by that handle: freed here
                self._store.release(result)
                freed = "the result was freed"
            except Exception as e:
                freed = f"freeing the result failed too ({_logs.shown(str(e), 500)})"
            raise CaptureArenaError(
                f"request {_logs.shown(str(result.get('sample_id')), 200)!r}: its handle {str(handle)[:200]!r} does not name its result "
                f"({expected[:200]!r}), so deleting it would free nothing; {freed}"
            )
        # Remembered before the read: speculators deletes the handle when this raises, and that
        # delete must free the objects (else every failed read leaves a sample resident).
        self._remember(handle, result)
        got = self._store.get(result, ["hidden_states", "token_ids"], torch=True)
        hs, tokens = got["hidden_states"], got["token_ids"]
        k = len(result.get("aux_layer_ids") or ())
        n = int(tokens.numel())
        if k < 1 or hs.dim() != 3 or hs.shape[0] != 1 or hs.shape[1] != n or hs.shape[2] % k or tuple(tokens.shape) != (1, n) or tokens.dtype != torch.int64:
            raise CaptureArenaError(
                f"request {_logs.shown(str(result.get('sample_id')), 200)!r}: hidden_states {tuple(hs.shape)} and token_ids {tuple(tokens.shape)} "
                f"{tokens.dtype} are not [1, {n}, k*H] with k={k} and [1, {n}] int64"
            )
        return {"hidden_states": hs.view(n, k, hs.shape[2] // k), "token_ids": tokens.view(n)}

    def _remember(self, handle: str, result: dict[str, Any]) -> None:
        with self._lock:
            before = self._read.pop(handle, None)
            self._read[handle] = result
            old = [self._read.popitem(last=False)[1] for _ in range(len(self._read) - MAX_UNDELETED)]
        if before is not None and before.get("arena") != result.get("arena"):
            old.append(before)  # the same keys in another arena (another server): its own objects
        self._free_each(old, "read long ago and never deleted")  # freed rather than held

    def _free_each(self, results: list[dict[str, Any]], why: str) -> None:
        if self._store is not None:
            _free_each(self._store, results, why)

    def _release_all(self, lock_wait: float = -1) -> None:
        """Frees every result read and not deleted (at exit; never raises). ``lock_wait``: how
        long to wait for the lock, from a signal handler (which may have interrupted its holder
        on this very thread: then it goes on without it, between two whole dict operations)."""
        got = self._lock.acquire(timeout=lock_wait)
        try:
            left = list(self._read.values())
            self._read.clear()
        finally:
            if got:
                self._lock.release()
        self._free_each(left, "at exit")
        if left:
            log.warning("capture_arena.speculators: freed %d results read and never deleted, at exit", len(left))

    def delete(self, handle: str) -> None:
        """Frees the request's objects, read or not (queued; never waits on the network).
        Unknown or already deleted handles, and those of requests vLLM could not publish, are
        ignored."""
        if not isinstance(handle, str):  # vLLM's params carried a list or a dict: refused at read, never remembered
            return
        with self._lock:
            result = self._read.pop(handle, None)
        if result is not None and self._store is not None:
            self._store.release(result)

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned dataloader worker gets: the cache directory only (a reader, its lock
        and what it handed out stay with this process)."""
        return {"cache_dir": self._cached.hidden_states_path if self._cached is not None else None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.get("cache_dir"))  # type: ignore[misc]
        # A spawned dataloader worker (unpickled before its parent is known: by its name, which
        # multiprocessing sets first).
        if multiprocessing.parent_process() is not None or multiprocessing.current_process().name != "MainProcess":
            _free_on_sigterm()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Waits until every free has been delivered, those of responses speculators' client
        refused included (``FreeNotSentError`` past ``timeout_s``)."""
        end = time.monotonic() + timeout_s
        for store in (self._store, _REFUSED):
            if store is not None:
                store.flush(max(0.0, end - time.monotonic()))


def _free_each(store: ArenaFeatureStore, results: list[dict[str, Any]], why: str) -> None:
    """Frees each result alone (never raises): one that cannot be freed (malformed) is logged,
    and costs neither the others nor the caller."""
    for r in results:
        try:
            store.release(r)
        except Exception as e:
            log.warning("capture_arena.speculators: could not free %r (%s): %s", r.get("sample_id"), why, e)


def _free_left(store: ArenaFeatureStore, read: "collections.OrderedDict[str, dict[str, Any]]") -> None:
    """What a transfer collected had read and never deleted, freed (never raises). No lock: the
    transfer is gone, so nothing else uses ``read``."""
    left = list(read.values())
    read.clear()
    _free_each(store, left, "its transfer was let go")
    if left:
        log.warning("capture_arena.speculators: freed %d results read and never deleted, as their transfer was let go", len(left))


def _release_at_exit(lock_wait: float = -1) -> None:
    for t in list(_TRANSFERS):
        t._release_all(lock_wait)


# Registered after the reader module's exit flush (imported above), so it runs first (atexit is
# last in, first out), and that flush sends these frees.
atexit.register(_release_at_exit)


def _after_fork_in_child() -> None:
    """A forked process starts with nothing read: what its parent read is the parent's to
    free (the child's exit would free it under the parent); and with locks of its own (the
    fork may have come while another thread held one)."""
    global _REFUSED_LOCK
    _REFUSED_LOCK = threading.Lock()
    for t in list(_TRANSFERS):
        t._lock = threading.Lock()
        # Emptied, not replaced: the transfer's finalizer frees what this dict holds when the
        # transfer is let go, and in this process that must never be its parent's reads.
        t._read.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _in_forked_worker(_: object) -> None:
    """A dataloader worker multiprocessing forked ends in ``os._exit``, where atexit never
    runs: multiprocessing's finalizers do. Priority 20: before the reader's flush (10). (Every
    forked multiprocessing child runs this, a pool's workers too: SIGTERM's handler is left to
    the processes that read, :meth:`CaptureArenaTransfer.setup`, and a spawned worker's
    unpickled transfer; put here, it delayed a ``Pool.terminate()`` of workers that read
    nothing.)"""
    multiprocessing.util.Finalize(None, _release_at_exit, exitpriority=20)


#: How long SIGTERM's handler waits for the frees of what its worker read to go out, at most.
SIGTERM_WORK_S = 3.0


def _free_and_flush() -> None:
    """SIGTERM's work: frees what this process read and never deleted, then flushes every free
    (at most 2 s); never raises."""
    try:
        _release_at_exit(lock_wait=0.5)
        end = time.monotonic() + 2.0
        for store in [t._store for t in list(_TRANSFERS)] + [_REFUSED]:
            if store is None:
                continue
            try:
                store.flush(max(0.0, end - time.monotonic()))
            except Exception as e:  # what is not out by then is lost with the process
                log.warning("capture_arena.speculators: frees not sent before SIGTERM ended the worker: %s", e)
    except BaseException:  # never into the thread's default hook, nor the handler
        log.exception("capture_arena.speculators: freeing what this worker read at SIGTERM failed")


def _free_on_sigterm() -> None:
    """In a worker process (torch's DataLoader terminates a worker that does not stop in time
    with SIGTERM, whose default action, like torch's own worker handler, skips every exit hook):
    SIGTERM first frees what this process read and never deleted, flushes the frees (at most
    2 s), then ends the process: in a DataLoader worker with status 0, as torch's handler ends
    one its parent terminates (the loader reports a worker killed by a signal as an error),
    elsewhere as SIGTERM would. Installed from the main thread only, over no handler, ours, or
    torch's (a C handler: Python does not see it and reports what it last set), never over the
    application's own; again at each ``setup()``, since torch's worker loop puts its handler
    over one installed when the worker was made."""
    if threading.current_thread() is not threading.main_thread():
        return
    if not (signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None) or getattr(signal.getsignal(signal.SIGTERM), "_capture_arena", False)):
        return  # the application's own handler: left alone

    def on_sigterm(signum: int, _frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)
        in_loader = torch.utils.data.get_worker_info() is not None
        try:
            # On a thread of its own, waited for a bounded time: the code this handler
            # interrupted, on this very thread, may hold a lock the frees need (a store reader's,
            # the one store readers are made under), which this thread would wait for forever.
            work = threading.Thread(target=_free_and_flush, name="capture-arena-sigterm", daemon=True)
            try:
                work.start()
            except RuntimeError:  # no thread to be had: here, as before
                _free_and_flush()
            else:
                work.join(SIGTERM_WORK_S)
                if work.is_alive():
                    log.warning(
                        "capture_arena.speculators: freeing what this worker read did not end within %g s of SIGTERM "
                        "(a lock held by the code it interrupted?); what was not sent is lost with the process",
                        SIGTERM_WORK_S,
                    )
        finally:
            if in_loader:
                os._exit(0)
            os.kill(os.getpid(), signum)

    on_sigterm._capture_arena = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, on_sigterm)


multiprocessing.util.register_after_fork(_TRANSFERS, _in_forked_worker)


def _add(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    dest = kwargs.get("dest") or args[0].lstrip("-").replace("-", "_")
    if not any(a.dest == dest for a in parser._actions):
        parser.add_argument(*args, **kwargs)


@HiddenStatesBackend.register(NAME)
class CaptureArenaBackend(HiddenStatesBackend):
    """speculators' backend: the vLLM flags (:func:`build_kv_transfer_config`) and the trainer's
    reader (:func:`from_train_args`)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        _add(parser, "--hidden-states-path", type=str, default=None,
             help="Where cached hidden states files are (hs_{idx}.safetensors); generated ones come from the arena")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        _add(parser, "--capture-arena-bytes", type=str, default=None,
             help="The arena's size (e.g. 8GiB; default SGLANG_SPEC_CAPTURE_ARENA_BYTES, else 1 GiB)")
        _add(parser, "--capture-arena-store-id", type=str, default=None,
             help="The store_id of every key (default vllm)")

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> CaptureArenaTransfer:
        path = getattr(args, "hidden_states_path", None)
        return CaptureArenaTransfer(Path(path) if path else None)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if getattr(args, "capture_arena_bytes", None):
            extra["arena_bytes"] = args.capture_arena_bytes
        if getattr(args, "capture_arena_store_id", None):
            extra["store_id"] = args.capture_arena_store_id
        return {
            "kv_connector": "CaptureArenaConnector",
            "kv_role": "kv_producer",
            "kv_connector_module_path": "capture_arena.vllm",
            "kv_connector_extra_config": extra,
        }
