"""capture-arena behind SpecForge's trainer: a SpecForge ``FeatureStore`` over capture-arena's
readers, for every placement (``shm://``, ``cuda://``, ``nixl://``, a Mooncake TransferEngine, the
Mooncake store).

A SpecForge trainer switches by changing two lines; its adapter, ``RolloutWorker`` and
``FeatureDataLoader`` stay as they are::

    store = SpecForgeArenaStore(store_id=store_id)          # was: MooncakeFeatureStore(...)
    adapter = SGLangServerCaptureAdapter(url, store, ..., post_fn=store.post_fn())

SpecForge's adapter keeps only shapes and dtypes of a capture result; ``post_fn()`` wraps the
adapter's HTTP call and records each result before its ``SampleRef`` is built, and ``adopt()``
puts the result into ``ref.metadata["capture_arena"]``, so the ref carries what any process
needs to read and free the sample (it survives SpecForge's ``ref_to_dict`` / ``ref_from_dict``).

SpecForge's lifecycle maps onto capture-arena's frees:

============================  =================================================================
SpecForge                     capture-arena
============================  =================================================================
``get(ref)``                  reads the result (a lease; ``KeyError`` once freed)
``release(handle)``           the last lease of the sample's generation frees its objects
``abort(sample_id)``          frees the sample; one this process never saw is freed by prefix
                              (``{store_id}/{sample_id}/``) at every control endpoint it knows
``discard_external_attempts`` frees attempts whose response was lost, by prefix
                              (``{store_id}/{sample_id}/g{gen}/``), or by their recorded result
``gc()``                      frees samples held longer than ``max_hold_age_s`` and not leased
``drain_*_removals``          waits (bounded) until every free was applied; raises if not
``health()``                  SpecForge's keys, with ``release_pending`` the frees not yet
                              confirmed, ``refused_frees`` those a producer refused for its
                              control token, ``tracked_results`` what this store remembers
============================  =================================================================

Frees never wait on the network in the caller's thread: keys go out from capture-arena's free
senders, prefixes from one sender thread of this module, each retried with a back-off until its
endpoint confirms it (a free counts as delivered only once the producer answered that it was
applied), and dropped only once the endpoint refuses connections (its producer is gone). A
producer that refuses frees for its control token (this store was given none, or a wrong one)
leaves them pending: ``drain_*`` raise saying so, ``health()["refused_frees"]`` counts them, and
a token learned later (``tokens=``, a result's ``arena.token``) gets them through.

Live capture (SpecForge's online-live intake) builds refs from records, not from a ``/generate``
response: wrap the intake's ref source with :meth:`SpecForgeArenaStore.live_ref_source` (or call
:meth:`SpecForgeArenaStore.record_result` with each record before ``adopt``), and ``adopt`` finds
the record's arena result.

What a store remembers is bounded: a result is forgotten (never freed for that) once its sample
is released or freed here, once a read finds it freed elsewhere, once its producer reports that
the store's oldest resident object is younger than it (asked at most every
``RESIDENCY_CHECK_S`` by ``gc()``, in the background), or when it is the oldest beyond
``max_tracked`` results (65536) or older than ``forget_after_s`` (24 h; never less than
``max_hold_age_s``). ``abort`` of a forgotten sample still frees it, by prefix.

SpecForge is imported when this module is (``capture_arena`` itself never imports it).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
import unicodedata
import urllib.parse
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

try:
    from specforge.runtime.contracts import FeatureHandle, SampleRef  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from specforge.runtime.data_plane.feature_store import FeatureStore  # type: ignore[import-not-found,import-untyped,unused-ignore]
except ImportError as e:  # pragma: no cover - exercised only without SpecForge
    raise ImportError(
        "capture_arena.specforge needs SpecForge importable: pip install specforge (0.2.0 on PyPI; its declared "
        f"dependencies pin torch and sglang, so `pip install --no-deps specforge` beside your own torch works): {e}"
    ) from e

from . import _logs
from ._live import _NotSent, _Route
from ._reader import ArenaFeatureStore
from ._samples import Warnings
from ._capture_arena import _is_valid_token, _send_frees, _stats_query
from ._store import is_store_result
from .errors import CaptureArenaError, FreeNotSentError, FreeRefusedError, ReleasedError

log = _logs.get("capture_arena.specforge")

#: Where a ref carries its capture-arena result.
META_KEY = "capture_arena"
#: Results recorded by ``post_fn`` and not adopted yet, at most (the oldest is freed beyond it).
MAX_RECORDED = 65536
#: The bytes the results recorded and not adopted yet hold (as JSON), at most (the oldest is
#: freed beyond it).
MAX_RECORDED_BYTES = 256 << 20
#: The bytes one result may hold (as JSON): a larger one is not recorded, nor adopted.
MAX_RESULT_BYTES = 1 << 20
#: The longest sample id (UTF-8 bytes) a recorded result may carry: the core's key bound.
MAX_ID_BYTES = 1024
#: The longest control endpoint (UTF-8 bytes) learned from a result: the core's bound.
MAX_CONTROL_BYTES = 256
#: Features a result may have, at most: the core's bound.
MAX_FEATURES = 256
#: Known control endpoints, at most.
MAX_ENDPOINTS = 4096
#: Prefix frees waiting, at most (the oldest is dropped and counted beyond it).
MAX_PREFIXES = 65536
#: The longest response ``post_fn``'s default reads.
MAX_RESPONSE_BYTES = 256 << 20
#: Results a store tracks at most (the oldest not leased is forgotten beyond it, not freed).
MAX_TRACKED = 65536
#: Results older than this are forgotten (not freed), unless ``max_hold_age_s`` is longer.
FORGET_AFTER_S = 24 * 3600.0
#: How often ``gc()`` asks producers which of this store's samples are still resident.
RESIDENCY_CHECK_S = 10.0
#: How old a producer's per-store table may be when it answers (``STATS_TABLE_INTERVAL``).
TABLE_AGE_S = 1.0


def escape_part(part: str) -> str:
    """An id as a key carries it: ``%``, ``/`` and control characters percent-encoded (each UTF-8
    byte as ``%XX``), as capture-arena's producers encode them."""
    out: List[str] = []
    for c in part:
        if c in "%/" or unicodedata.category(c) == "Cc":
            out.extend(f"%{b:02X}" for b in c.encode())
        else:
            out.append(c)
    return "".join(out)


def _control_of(result: Mapping[str, Any]) -> Any:
    """A result's control endpoint (``arena.control``), or None."""
    arena = result.get("arena")
    return arena.get("control") if isinstance(arena, Mapping) else None


def _default_post(url: str, json_body: Dict[str, Any], timeout: float) -> Any:
    """SpecForge's default post (``requests.post(...).json()``) without ``requests``: JSON in,
    JSON out, at most ``MAX_RESPONSE_BYTES`` read, through the proxy the environment names (as
    ``requests`` does), all within ``timeout``: connect, and an answer however slowly it comes
    (``urlopen`` bounds each read only). An answer that is not 2xx raises, naming its status."""
    query = urllib.parse.urlsplit(url).query
    try:
        status, body = _Route(url).request("POST", "?" + query if query else "", json.dumps(json_body).encode(), timeout, MAX_RESPONSE_BYTES + 1)
    except _NotSent as e:  # SpecForge reports str(exc): the cause (refused, timed out, DNS) goes in it
        raise OSError(f"{e}: {e.__cause__}") from e.__cause__
    if len(body) > MAX_RESPONSE_BYTES:
        raise RuntimeError(f"{url} answered more than {MAX_RESPONSE_BYTES} bytes")
    if not 200 <= status < 300:
        raise RuntimeError(f"{url} answered HTTP {status}: {body[:256].decode('utf-8', 'replace')!r}")
    return json.loads(body)


def _flatten(value: Any) -> List[Any]:
    """The leaves of nested lists, in order (in time linear in them, however deep)."""
    out: List[Any] = []
    stack = [iter((value,))]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


#: The most dimensions a feature's shape may have.
MAX_DIMS = 8


def _is_token(token: str) -> bool:
    """Whether ``token`` is a control token, by the core's own rule (a string the core cannot
    take, a lone surrogate, is not one)."""
    try:
        return isinstance(token, str) and _is_valid_token(token)
    except Exception:  # noqa: BLE001 - UnicodeEncodeError from the binding
        return False


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _json_bytes(result: Any) -> Optional[int]:
    """The bytes of ``result`` as JSON; None if it is not JSON (a cycle, a key that is not a
    string or a number, nesting too deep)."""
    try:
        return len(json.dumps(result, default=str))
    except (TypeError, ValueError, RecursionError):
        return None


def _recordable(result: Any, store_id: str) -> Tuple[Optional[Tuple[str, int]], str]:
    """``((sample_id, gen), "")`` for a result of ``store_id`` that may be recorded: a
    published result (no error, features) whose id, feature count and size are within the
    core's bounds. ``(None, why)`` for one of this store that may not (never recorded, so it
    costs nothing past this call); ``(None, "")`` for anything else."""
    if not isinstance(result, Mapping) or result.get("error"):
        return None, ""
    features = result.get("features")
    if not isinstance(features, Mapping) or str(result.get("store_id")) != store_id:
        return None, ""
    if len(features) > MAX_FEATURES:
        return None, f"{len(features)} features, over the {MAX_FEATURES} a result may have"
    sid = result.get("sample_id")
    if not isinstance(sid, (str, int)) or isinstance(sid, bool):
        return None, f"its sample_id is a {type(sid).__name__}, not a string"
    sid = str(sid)
    if _utf8_len(sid) > MAX_ID_BYTES:
        return None, f"its sample_id is {_utf8_len(sid)} bytes, over the {MAX_ID_BYTES} a key part may be"
    try:
        gen = int(result["gen"])
    except (KeyError, TypeError, ValueError, OverflowError):  # gen: 1e999
        return None, "it has no integer gen"
    size = _json_bytes(result)
    if size is None:
        return None, "it is not JSON"
    if size > MAX_RESULT_BYTES:
        return None, f"it is {size} bytes as JSON, over the {MAX_RESULT_BYTES} a result may hold"
    return (sid, gen), ""


#: Results of this store that were not recorded: said at most once a second.
_REFUSED = Warnings()


class _Recorded(collections.OrderedDict[Tuple[str, int], Dict[str, Any]]):
    """Results recorded before their adoption, by ``(sample_id, gen)``, and the bytes they hold
    (as JSON): bounded in count and in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self._sizes: Dict[Tuple[str, int], int] = {}

    def __setitem__(self, ident: Tuple[str, int], result: Dict[str, Any]) -> None:
        size = _json_bytes(result) or 0
        super().__setitem__(ident, result)
        self.bytes += size - self._sizes.get(ident, 0)
        self._sizes[ident] = size

    def __delitem__(self, ident: Tuple[str, int]) -> None:
        super().__delitem__(ident)
        self.bytes -= self._sizes.pop(ident, 0)

    def pop(self, ident: Tuple[str, int], *default: Any) -> Any:
        self.bytes -= self._sizes.pop(ident, 0)
        return super().pop(ident, *default)

    def popitem(self, last: bool = True) -> Tuple[Tuple[str, int], Dict[str, Any]]:
        ident, result = super().popitem(last)
        self.bytes -= self._sizes.pop(ident, 0)
        return ident, result

    def clear(self) -> None:
        super().clear()
        self.bytes = 0
        self._sizes.clear()

    def over(self) -> bool:
        return len(self) > MAX_RECORDED or self.bytes > MAX_RECORDED_BYTES


def _short(value: Any, limit: int = 200) -> str:
    """``value`` as an error message shows it: bounded and escaped (ids come from results)."""
    return _logs.shown(str(value), limit)


def _shape_ok(shape: Any) -> bool:
    """Whether ``shape`` is a feature's shape: at most MAX_DIMS ints in [0, 2**63), their
    product too (checked before any arithmetic on what a record says)."""
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
        return False
    n = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < 2**63:
            return False
        n *= d
    return n < 2**63


def _result_bytes(result: Mapping[str, Any]) -> int:
    """The bytes a result's features hold (a feature whose shape fails :func:`_shape_ok`
    counts nothing): never raises."""
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
    total = 0
    for f in result.get("features", {}).values():
        shape = f.get("shape", ()) if isinstance(f, Mapping) else None
        if shape is not None and _shape_ok(shape):
            n = 1
            for d in shape:
                n *= d
            total += n * sizes.get(str(f.get("dtype")), 1)
    return total


class _Endpoint:
    """One control endpoint's prefix frees: what waits, with which token, when it is next tried
    and the back-off after that, and why its last try was refused (None: it was not)."""

    __slots__ = ("prefixes", "token", "due", "backoff", "refused", "busy", "sending")

    def __init__(self, token: Optional[str]) -> None:
        self.prefixes: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self.token = token
        self.due = 0.0
        self.backoff = PREFIX_BACKOFF_S
        self.refused: Optional[str] = None
        #: A sender is trying this endpoint now (one at a time per endpoint).
        self.busy = False
        #: The prefixes that sender took.
        self.sending: List[str] = []


def _covers(prefix: str, samples: Set[str], stores: Set[str]) -> bool:
    """Whether a prefix free reaches one of ``samples`` (each ``{store}/{sample}/``, encoded) of
    ``stores`` (each ``{store}/``): a sample's own prefix (any generation), or its store's."""
    head, _, rest = prefix.partition("/")
    sample, slash, _ = rest.partition("/")
    if not slash:
        return prefix in stores
    return f"{head}/{sample}/" in samples


#: A prefix free's back-off after a failed try: this, doubling to PREFIX_MAX_BACKOFF_S, per
#: control endpoint (every prefix waiting for one endpoint goes in one connection).
PREFIX_BACKOFF_S = 0.1
PREFIX_MAX_BACKOFF_S = 30.0
#: Prefixes sent in one connection at most.
PREFIXES_PER_SEND = 512
#: Sender threads at most, each trying one endpoint at a time: an endpoint whose connect hangs
#: (a host down) holds one of them, never the others' frees.
PREFIX_SENDERS = 4


#: Every prefix sender set of this process (reset in a forked child).
_ALL_PREFIXES: "weakref.WeakSet[_Prefixes]" = weakref.WeakSet()


def _prefixes_after_fork() -> None:
    for p in list(_ALL_PREFIXES):
        p._after_fork_in_child()


os.register_at_fork(after_in_child=_prefixes_after_fork)

_ALL_STORES: "weakref.WeakSet[SpecForgeArenaStore]" = weakref.WeakSet()


def _stores_after_fork() -> None:
    """A forked child (a DataLoader's worker) gets each store's lock anew: the fork may have
    come while another thread held it (the residency pass holds it over up to ``max_tracked``
    samples), and nobody would release it in the child."""
    for store in list(_ALL_STORES):
        store._lock = threading.RLock()
        store._residency = None


os.register_at_fork(after_in_child=_stores_after_fork)


class _Prefixes:
    """Prefix frees, sent from threads of their own (up to ``PREFIX_SENDERS``, one endpoint
    each at a time), all of one control endpoint in one connection; an endpoint that fails a try waits (100 ms doubling to 30 s, reset once one
    goes through) whatever asks for its frees meanwhile, so a client the producer refuses
    connects at most 1 + log2(T / 0.1 s) times in T seconds. An endpoint that refuses the
    control token waits for a token (``set_token``) or its back-off; one that refuses
    connections (its producer is gone) has its prefixes dropped."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._endpoints: Dict[str, _Endpoint] = {}
        self._count = 0
        self._sending = 0
        #: Sender threads running.
        self._threads = 0
        self.dropped = 0
        #: Connections made to send prefix frees (each a try of one endpoint's).
        self.tries = 0
        _ALL_PREFIXES.add(self)

    def _after_fork_in_child(self) -> None:
        """A forked child has none of its parent's senders (their lock may have been held at
        the fork) and sends none of its parent's prefixes: the parent sends them, and a copy
        sent again later by the child's first sender could free a newer capture of the sample
        (an abort's prefix covers every generation). It starts with a new lock and nothing
        queued or in flight."""
        self._lock = threading.Condition()
        self._threads = 0
        self._sending = 0
        self._endpoints = {}
        self._count = 0

    @property
    def refused(self) -> int:
        """Prefixes whose last try was refused for the control token (still pending)."""
        with self._lock:
            return sum(len(e.prefixes) for e in self._endpoints.values() if e.refused is not None)

    def last_refusal(self) -> str:
        with self._lock:
            return next((e.refused for e in reversed(list(self._endpoints.values())) if e.refused), "")

    def set_token(self, control: str, token: Optional[str]) -> None:
        """A token learned for ``control``: its waiting prefixes carry it and go now."""
        with self._lock:
            e = self._endpoints.get(control)
            if e is None or e.token == token:
                return
            e.token, e.due, e.backoff, e.refused = token, 0.0, PREFIX_BACKOFF_S, None
            self._lock.notify_all()

    def add(self, control: str, token: Optional[str], prefix: str) -> None:
        with self._lock:
            e = self._endpoints.get(control)
            if e is None:
                e = self._endpoints[control] = _Endpoint(token)
            elif token is not None and e.token != token:
                e.token, e.due, e.refused = token, 0.0, None
            if prefix not in e.prefixes:
                e.prefixes[prefix] = None
                self._count += 1
            while self._count > MAX_PREFIXES:  # the oldest prefix of the endpoint holding most goes
                most = max((x for x in self._endpoints.values() if x.prefixes), key=lambda x: len(x.prefixes))
                most.prefixes.popitem(last=False)
                self._count -= 1
                self.dropped += 1
            waiting = sum(1 for x in self._endpoints.values() if x.prefixes and not x.busy)
            if self._threads < PREFIX_SENDERS and self._threads < waiting + sum(x.busy for x in self._endpoints.values()):
                thread = threading.Thread(target=self._run, name="capture-arena-prefix-frees", daemon=True)
                try:
                    thread.start()
                    self._threads += 1
                except RuntimeError:  # no thread to be had: a running sender, or the next add, takes them
                    pass
            self._lock.notify_all()

    @property
    def pending(self) -> int:
        with self._lock:
            return self._count + self._sending

    def _take(self) -> Optional[Tuple[str, Optional[str], List[str]]]:
        """The next endpoint due and its prefixes (taken out), waiting for one; None when
        nothing waits at all (the thread ends). Under the lock."""
        while True:
            waiting = {c: e for c, e in self._endpoints.items() if e.prefixes and not e.busy}
            if not waiting:
                self._endpoints = {c: e for c, e in self._endpoints.items() if e.prefixes or e.refused or e.busy}
                self._threads -= 1
                self._lock.notify_all()
                return None
            now = time.monotonic()
            due = next(((c, e) for c, e in waiting.items() if e.due <= now), None)
            if due is None:
                self._lock.wait(min(e.due for e in waiting.values()) - now)
                continue
            control, e = due
            e.busy = True
            batch: List[str] = []
            while e.prefixes and len(batch) < PREFIXES_PER_SEND:
                batch.append(e.prefixes.popitem(last=False)[0])
            e.sending = batch
            self._count -= len(batch)
            self._sending += len(batch)
            return control, e.token, batch

    def _run(self) -> None:
        while True:
            with self._lock:
                taken = self._take()
            if taken is None:
                return
            control = taken[0]
            try:
                self._send(*taken)
            except BaseException:  # never expected (_send catches all): this sender ends, counted out
                log.exception("a prefix free sender ended")
                with self._lock:
                    self._threads -= 1
                raise
            finally:  # whatever happened, the endpoint is free for a sender again
                with self._lock:
                    ep = self._endpoints.get(control)
                    if ep is not None:
                        ep.busy, ep.sending = False, []
                    self._lock.notify_all()

    def _send(self, control: str, token: Optional[str], batch: List[str]) -> None:
        """One try of ``batch`` at ``control``; what failed waits with its endpoint."""
        failed: Optional[str] = None  # why the endpoint backs off (None: it does not)
        retry: List[str] = []
        with self._lock:
            self.tries += 1
        try:
            _send_frees(control, [], batch, token, 5.0)
        except FreeRefusedError as e:
            # Not applied: they wait (a token learned later gets them through), said once.
            with self._lock:
                first = self._endpoints[control].refused is None
                self._endpoints[control].refused = str(e)
            if first:
                log.error("%d prefix frees to %s: %s", len(batch), control, e)
            failed, retry = str(e), batch
        except FreeNotSentError as e:
            # ECONNREFUSED by its errno, never by a word an endpoint's own name may hold.
            if "(os error 111)" in str(e):
                log.warning("control endpoint %s refuses connections (its producer is gone): %d prefix frees dropped", control, len(batch))
                with self._lock:
                    self.dropped += len(batch)
            else:
                failed, retry = "", batch
        except BaseException as e:  # a prefix, token or endpoint that is not one (or a panic): never sendable
            if len(batch) > 1:  # find which: each goes alone next (each counted in flight until tried)
                for prefix in batch:
                    self._send_alone(control, token, prefix)
                return
            log.error("prefix free %s to %s dropped: %s", batch[0], control, e)
            with self._lock:
                self.dropped += 1
        with self._lock:
            self._sending -= len(batch)
            ep = self._endpoints[control]
            if failed is None:
                ep.backoff, ep.refused = PREFIX_BACKOFF_S, None
            else:
                for prefix in reversed(retry):  # back in front, in order
                    if prefix not in ep.prefixes:
                        ep.prefixes[prefix] = None
                        ep.prefixes.move_to_end(prefix, last=False)
                        self._count += 1
                if ep.token != token:  # a token learned meanwhile: at once
                    ep.due = 0.0
                else:
                    ep.due = time.monotonic() + ep.backoff
                    ep.backoff = min(ep.backoff * 2, PREFIX_MAX_BACKOFF_S)
            self._lock.notify_all()

    def _send_alone(self, control: str, token: Optional[str], prefix: str) -> None:
        """One prefix of a batch that was not sendable: sent alone, dropped if it is the bad one
        (any other failure puts it back to wait with its endpoint). It counts as in flight
        until this returns."""
        with self._lock:
            self.tries += 1
        try:
            _send_frees(control, [], [prefix], token, 5.0)
        except BaseException as e:  # a bad endpoint may raise anything (UnicodeEncodeError, a panic)
            with self._lock:
                self._sending -= 1
                if isinstance(e, FreeNotSentError):
                    ep = self._endpoints[control]
                    if prefix not in ep.prefixes:
                        ep.prefixes[prefix] = None
                        self._count += 1
                        ep.due = max(ep.due, time.monotonic() + ep.backoff)
                    return
                self.dropped += 1
            log.error("prefix free %s to %s dropped: %s", prefix, control, e)
            return
        with self._lock:
            self._sending -= 1

    def wait(self, timeout_s: float, samples: Optional[Set[str]] = None, stores: Optional[Set[str]] = None) -> bool:
        """Waits up to ``timeout_s`` for every prefix to go out (with ``samples`` and
        ``stores``: every one that reaches those samples, see :func:`_covers`); True if none
        waits. An endpoint in its back-off holding such prefixes is tried once now, unless it
        refused the control token (only a token, or its back-off, changes that): a drain that
        waits in many short calls must not turn the back-off into a retry loop."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            for e in self._endpoints.values():
                if e.refused is None and any(self._matters(p, samples, stores) for p in e.prefixes):
                    e.due = 0.0
            self._lock.notify_all()
            while self._waiting(samples, stores)[0]:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    @staticmethod
    def _matters(prefix: str, samples: Optional[Set[str]], stores: Optional[Set[str]]) -> bool:
        return samples is None or _covers(prefix, samples, stores or set())

    def _waiting(self, samples: Optional[Set[str]], stores: Optional[Set[str]]) -> Tuple[int, str]:
        """Prefixes waiting or in flight (those that reach ``samples``, if given), and the first
        endpoint holding one. Under the lock."""
        if samples is None:
            first = next((c for c, e in self._endpoints.items() if e.prefixes or e.sending), "")
            return self._count + self._sending, first
        n, first = 0, ""
        for c, e in self._endpoints.items():
            k = sum(1 for p in e.prefixes if self._matters(p, samples, stores))
            k += sum(1 for p in e.sending if self._matters(p, samples, stores))
            if k and not first:
                first = c
            n += k
        return n, first

    def waiting(self, samples: Optional[Set[str]] = None, stores: Optional[Set[str]] = None) -> Tuple[int, str]:
        """See :meth:`_waiting`."""
        with self._lock:
            return self._waiting(samples, stores)


class SpecForgeArenaStore(FeatureStore):  # type: ignore[misc,unused-ignore]
    """A SpecForge ``FeatureStore`` (with the ``MooncakeFeatureStore`` API that
    ``SGLangServerCaptureAdapter`` requires) over capture-arena's readers. See the module docs.

    ``store_id``: the run's store namespace (what the adapter sends as ``store_id``).
    ``controls``: control endpoints (``host:port``, a result's ``arena.control``) to free by
    prefix at, besides those learned from results: what ``abort`` of a sample this process never
    saw (the controller reconciling after a restart) and a response lost before any result of
    that producer arrived need. ``tokens``: a control token per endpoint, where producers have
    one. ``max_hold_age_s``: ``gc()`` frees samples held longer and not leased (None: never).
    ``reader``: the :class:`~capture_arena.ArenaFeatureStore` to read through (a new one by
    default)."""

    def __init__(
        self,
        *,
        store_id: Optional[str] = None,
        controls: Iterable[str] = (),
        tokens: Optional[Mapping[str, str]] = None,
        max_hold_age_s: Optional[float] = None,
        reader: Optional[ArenaFeatureStore] = None,
        clock: Callable[[], float] = time.monotonic,
        max_tracked: int = MAX_TRACKED,
        forget_after_s: float = FORGET_AFTER_S,
    ) -> None:
        import uuid

        self.store_id = store_id or uuid.uuid4().hex[:8]
        if not isinstance(self.store_id, str) or not self.store_id or "/" in self.store_id:
            raise ValueError(f"store_id must be a non-empty string without '/': {self.store_id!r}")
        self.max_hold_age_s = max_hold_age_s
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1, not {max_tracked}")
        self.max_tracked = max_tracked
        self.forget_after_s = max(forget_after_s, max_hold_age_s or 0.0)
        self.max_resident_bytes: Optional[int] = None
        self._reader = reader or ArenaFeatureStore()
        self._clock = clock
        self._lock = threading.RLock()
        _ALL_STORES.add(self)
        self._endpoints: "collections.OrderedDict[str, Optional[str]]" = collections.OrderedDict()
        controls = [str(c) for c in controls]
        self._configured = frozenset(controls)
        for c in controls:
            self._learn(str(c), (tokens or {}).get(str(c)))
        self._store_placement = False
        # Tracked samples (adopted, or read here): sample_id -> its result, generation, time, bytes.
        self._results: Dict[str, Dict[str, Any]] = {}
        self._generation: Dict[str, int] = {}
        # In tracking order (oldest first): what is forgotten first.
        self._put_time: "collections.OrderedDict[str, float]" = collections.OrderedDict()
        self._bytes: Dict[str, int] = {}
        self._leases: Dict[str, Any] = {}
        self._counter = 0
        # Results post_fn saw, until adopt() takes them; attempts sent and not adopted yet.
        self._recorded = _Recorded()
        self._provisional: Dict[Tuple[str, int], List[str]] = {}
        # Attempts sent more than once (SpecForge retries with the same generation).
        self._retried: Set[Tuple[str, int]] = set()
        # The control endpoints results named (as their servers name themselves), oldest first.
        self._named: Dict[str, None] = {}
        self._prefixes = _Prefixes()
        # Samples freed here (sample_id -> generation), the latest max_tracked: SpecForge aborts
        # every sample at its optimizer boundary, most of them released already.
        self._freed: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._stats = {"force_freed": 0, "force_freed_bytes": 0, "forgotten": 0}
        self._residency: Optional[threading.Thread] = None
        self._residency_at = -RESIDENCY_CHECK_S

    # -- what the adapter needs ---------------------------------------------------------------
    def post_fn(self, inner: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
        """The adapter's ``post_fn``: calls ``inner`` (default: a JSON POST) and records each
        capture result of the response before the adapter builds its refs. Never raises for a
        result it cannot use (that sample's ``adopt`` does); the response goes back unchanged."""
        post = inner or _default_post

        def recording_post(url: str, json_body: Dict[str, Any], timeout: float) -> Any:
            rows = post(url, json_body=json_body, timeout=timeout)
            try:
                self._record(rows, json_body)
            except Exception:  # a malformed response is the adapter's to report, not ours
                log.warning("capture results of a response could not be recorded", exc_info=True)
            return rows

        return recording_post

    def _record(self, rows: Any, body: Mapping[str, Any]) -> None:
        asked = body.get("spec_capture") if isinstance(body, Mapping) else None
        most = len(asked) if isinstance(asked, list) else 0
        seen = 0
        for row in _flatten(rows):
            if not isinstance(row, Mapping):
                continue
            meta = row.get("meta_info")
            if not isinstance(meta, Mapping):
                continue
            for result in _flatten(meta.get("spec_capture")):
                if seen >= most:
                    return  # more results than the request asked for: not ours to keep
                seen += 1  # refused ones too: each may name an endpoint to learn
                ident, why = _recordable(result, self.store_id)
                if ident is None:
                    self._refused(result, why)
                    continue
                with self._lock:
                    self._supersede(self._recorded.get(ident), result)
                    self._recorded[ident] = dict(result)
                    self._learn_from(result)
                    while self._recorded.over():
                        (sid, gen), old = self._recorded.popitem(last=False)
                        log.warning("capture results never adopted hold more than %d results or %d bytes: freeing the oldest, %s g%d", MAX_RECORDED, MAX_RECORDED_BYTES, sid, gen)
                        self._free_result(old)

    def _refused(self, result: Any, why: str) -> None:
        """A result of this store that is not recorded: said, and its endpoint learned (within
        its bound), so that abort frees its objects there by prefix."""
        if not why:
            return
        _REFUSED.warn(
            "refused",
            "a capture result of store %s was not recorded (%s): its adopt fails, and abort or discard frees its objects by prefix",
            self.store_id,
            why,
        )
        with self._lock:
            self._learn_from(result)

    def _learn(self, control: str, token: Optional[str]) -> None:
        if token is not None and not _is_token(token):
            # Never presented: the client would refuse it before sending, and drop the frees.
            log.warning("a result for control endpoint %r carries an arena.token that is not a control token: ignored", control[:256])
            token = None
        if control in self._endpoints:
            self._endpoints.move_to_end(control)
            if token and self._endpoints[control] != token:
                self._endpoints[control] = token
                self._prefixes.set_token(control, token)
            return
        self._endpoints[control] = token
        while len(self._endpoints) > MAX_ENDPOINTS:
            # The oldest learned goes; those the caller named (controls=) never do.
            oldest = next((c for c in self._endpoints if c not in self._configured), None)
            if oldest is None:
                break
            del self._endpoints[oldest]

    def _learn_from(self, result: Mapping[str, Any]) -> None:
        if is_store_result(result):
            self._store_placement = True
            return
        arena = result.get("arena")
        if not isinstance(arena, Mapping):
            return
        control = arena.get("control")
        # Within the core's bound: a longer one names no endpoint a client would send to.
        if isinstance(control, str) and 0 < _utf8_len(control) <= MAX_CONTROL_BYTES:
            token = arena.get("token")
            self._learn(control, token if isinstance(token, str) else None)
            if control in self._endpoints:
                self._named[control] = None
                while len(self._named) > MAX_ENDPOINTS:
                    self._named.pop(next(iter(self._named)))

    def adopt(self, sample_ref: SampleRef) -> None:
        """Takes charge of a sample the capture server wrote: its result (recorded by
        ``post_fn``, or carried by a ref that went through another process) goes into
        ``ref.metadata["capture_arena"]``, and ``release``/``abort``/``gc`` free it."""
        sid, gen = self._ident(sample_ref)
        with self._lock:
            result = sample_ref.metadata.get(META_KEY)
            recorded = self._recorded.pop((sid, gen), None)
            if result is None:
                result = recorded
            if result is None:
                raise ValueError(
                    f"cannot adopt {_short(sid)} g{gen}: no capture-arena result recorded for it, nor carried in its ref "
                    "(give the adapter post_fn=store.post_fn(); a result over the store's bounds is not recorded, and the log says why)"
                )
            try:
                self._check_result(sample_ref, result, gen)
            except BaseException:
                if recorded is not None:  # still recorded: abort and discard free it
                    self._recorded[(sid, gen)] = recorded
                raise
            sample_ref.metadata[META_KEY] = result
            self._supersede(recorded, result)
            self._track(sid, gen, result)
            self._provisional.pop((sid, gen), None)
            if (sid, gen) in self._retried:
                self._retried.discard((sid, gen))
                # Sent more than once: an earlier attempt whose response was lost may have
                # published on another server (a retry goes to any). Its keys there are freed
                # by prefix at the endpoints results named (each server names itself one way;
                # an endpoint given as `controls` may be another name of the adopted result's
                # server, whose objects have the same keys): never at the adopted one's.
                mine = _control_of(result)
                prefix = f"{escape_part(self.store_id)}/{escape_part(sid)}/g{gen}/"
                for control, token in self._endpoints.items():
                    if control != mine and control in self._named:
                        self._prefixes.add(control, token, prefix)

    def record_result(self, record: Mapping[str, Any]) -> None:
        """Remembers a capture result that reached this process another way than a
        ``/generate`` response: a live capture's record (the sink's result plus ``num_tokens``),
        as SpecForge's intake hands it to its ref source. The ``adopt`` of its ref then finds
        it. Results of other stores, and rows with an error, are ignored."""
        ident, why = _recordable(record, self.store_id)
        if ident is None:
            self._refused(record, why)
            return
        result = {k: v for k, v in record.items() if k not in ("num_tokens", "origin")}
        with self._lock:
            self._supersede(self._recorded.get(ident), result)
            self._recorded[ident] = result
            self._learn_from(result)
            while self._recorded.over():
                (sid, gen), old = self._recorded.popitem(last=False)
                log.warning("capture results never adopted hold more than %d results or %d bytes: freeing the oldest, %s g%d", MAX_RECORDED, MAX_RECORDED_BYTES, sid, gen)
                self._free_result(old)

    def live_ref_source(self, ref_source: Any) -> Any:
        """Wraps SpecForge's live intake ref source (``LiveIntakeRefSource``: ``config_payload()``,
        ``ref_from_record(record)``) so that every record it turns into a ref is remembered
        (:meth:`record_result`): give the wrapper to ``build_disagg_live_producer`` in its
        place. Everything else goes to the wrapped source."""
        return _RecordingRefSource(self, ref_source)

    def track_external_attempt(self, sample_id: str, *, generation: int, feature_names: List[str]) -> None:
        """Remembers an attempt before its request goes out, so that a response that never
        arrives can still be freed (``discard_external_attempts``)."""
        names = list(dict.fromkeys(str(n) for n in feature_names))
        if not names:
            raise ValueError("external capture attempt must name at least one feature")
        with self._lock:
            ident = (str(sample_id), int(generation))
            if ident in self._provisional:
                self._retried.add(ident)  # a retry: the attempt before may be on another server
            self._provisional[ident] = names

    def discard_external_attempts(self, *, reason: str = "unadopted-external-capture") -> int:
        """Frees every attempt that was sent and never adopted: by its recorded result, else by
        prefix at every known control endpoint (and by key from the Mooncake store once a
        store-placement result was seen). Returns how many were discarded; raises
        ``RuntimeError`` for attempts with nowhere to send their frees (they stay tracked)."""
        discarded, stuck = 0, []
        with self._lock:
            for (sid, gen), names in list(self._provisional.items()):
                if sid in self._generation and self._generation[sid] == gen:
                    self._provisional.pop((sid, gen), None)  # adopted meanwhile
                    self._retried.discard((sid, gen))
                    continue
                recorded = self._recorded.pop((sid, gen), None)
                if recorded is not None:
                    self._free_result(recorded)
                elif not self._free_unseen(sid, gen, names):
                    stuck.append(f"{sid} g{gen}")
                    continue
                self._provisional.pop((sid, gen), None)
                self._retried.discard((sid, gen))
                discarded += 1
        if stuck:
            raise RuntimeError(
                f"could not discard {len(stuck)} external capture attempts ({stuck[:8]}): no control endpoint is known yet; "
                "pass controls=[...] (a result's arena.control) to SpecForgeArenaStore"
            )
        if discarded:
            log.info("discarded %d external capture attempts (%s)", discarded, reason)
        return discarded

    # -- FeatureStore -------------------------------------------------------------------------
    def put(self, tensors: Dict[str, Any], *, sample_id: str, metadata: Dict[str, Any]) -> SampleRef:
        """Not supported: capture-arena's producer is the capture server (SGLang with the
        spec-capture patch); this store reads and frees what it publishes. For samples made in
        the trainer's own process, use SpecForge's ``LocalFeatureStore``."""
        raise NotImplementedError(
            "SpecForgeArenaStore reads what a capture server published (SGLangServerCaptureAdapter); "
            "it has no put(): use LocalFeatureStore or MooncakeFeatureStore for local puts"
        )

    def get(self, sample_ref: SampleRef, *, device: Any = "cpu", names: Optional[List[str]] = None) -> Tuple[Dict[str, Any], Any]:
        """Reads the sample into fresh torch tensors on ``device`` and leases it. ``KeyError`` for a
        sample released or aborted here, a name it lacks, or a ref without a capture-arena
        result; ``StaleSessionError`` when its producer is gone."""
        sid, gen = self._ident(sample_ref)
        with self._lock:
            result = sample_ref.metadata.get(META_KEY)
            if result is None and self._generation.get(sid) == gen:
                result = self._results.get(sid)
        if result is None:
            raise KeyError(f"sample {_short(sid)} g{gen}: its ref carries no capture-arena result (was it adopted by a SpecForgeArenaStore?)")
        self._check_result(sample_ref, result, gen)
        wanted = list(names) if names else list(sample_ref.feature_keys)
        dev = str(device)
        try:
            tensors = self._reader.get(result, wanted, torch=True, device=None if dev == "cpu" else dev)
        except ReleasedError:
            # Freed elsewhere (another trainer's release, an abort, its lease): nothing to keep.
            with self._lock:
                if self._generation.get(sid) == gen and not self._leased(sid, gen):
                    self._forget(sid)
                    self._remember_freed(sid, gen)
            raise
        with self._lock:
            cur = self._generation.get(sid)
            if cur is None or gen > cur:  # a newer generation supersedes (frees) the one tracked
                self._track(sid, gen, result)
            self._counter += 1
            handle = FeatureHandle(sample_id=sid, generation=gen, lease_token=f"{sid}:{gen}:{self._counter}")
            self._leases[handle.lease_token] = handle
        return tensors, handle

    def release(self, handle: Any, *, reason: str = "consumed") -> None:
        """Drops the lease; the sample's last lease on its current generation frees it."""
        with self._lock:
            self._leases.pop(handle.lease_token, None)
            sid = handle.sample_id
            cur = self._generation.get(sid)
            if cur is None or handle.generation != cur or self._leased(sid, cur):
                return
            self._free_tracked(sid)

    def abort(self, sample_id: str, *, reason: str = "aborted") -> None:
        """Frees the sample now, leases or not; one this process never tracked is freed by
        prefix at every known control endpoint. One freed here already (released: SpecForge
        aborts every sample at its optimizer boundary) is left alone, as Mooncake's store does,
        unless an attempt of another generation was sent for it since."""
        sid = str(sample_id)
        with self._lock:
            if sid in self._generation:
                self._free_tracked(sid)
                return
            for (s, gen), recorded in list(self._recorded.items()):
                if s == sid:
                    del self._recorded[(s, gen)]
                    self._free_result(recorded)
                    return
            freed = self._freed.get(sid)
            if freed is not None and not any(s == sid and g != freed for s, g in self._provisional):
                return  # its frees went when it was freed
            if not self._free_unseen(sid, None, []):
                log.warning("abort of %s (%s): no control endpoint known to free it at; pass controls=[...]", sid, reason)

    def gc(self, *, now: Optional[float] = None) -> Dict[str, int]:
        """Frees samples not leased and held longer than ``max_hold_age_s``."""
        now = self._clock() if now is None else now
        freed = freed_bytes = 0
        with self._lock:
            if self.max_hold_age_s is not None:
                for sid, t in list(self._put_time.items()):
                    if now - t > self.max_hold_age_s and not self._leased(sid, self._generation.get(sid)):
                        freed_bytes += self._bytes.get(sid, 0)
                        freed += 1
                        self._free_tracked(sid)
            self._stats["force_freed"] += freed
            self._stats["force_freed_bytes"] += freed_bytes
            self._forget_beyond_bounds(now)
        self._check_residency(now)
        return {"force_freed": freed, "force_freed_bytes": freed_bytes, "release_pending": self._pending()}

    def health(self) -> Dict[str, Any]:
        with self._lock:
            now = self._clock()
            ages = [now - t for t in self._put_time.values()]
            inner = self._reader.health()
            return {
                "store_id": self.store_id,
                "backend": "capture-arena",
                "resident_samples": len(self._generation),
                "provisional_external": len(self._provisional),
                "active_leases": len(self._leases),
                "resident_bytes": sum(self._bytes.values()),
                "max_resident_bytes": self.max_resident_bytes,
                "release_pending": self._pending(),
                "refused_frees": inner.get("refused_frees", 0) + self._prefixes.refused,
                "dropped_frees": inner["dropped_frees"] + self._prefixes.dropped,
                "tracked_results": len(self._results) + len(self._recorded),
                "forgotten_total": self._stats["forgotten"],
                "oldest_age_s": max(ages) if ages else 0.0,
                "avg_age_s": (sum(ages) / len(ages)) if ages else 0.0,
                "force_freed_total": self._stats["force_freed"],
                "control_endpoints": len(self._endpoints),
            }

    def drain_pending_removals(
        self, *, max_attempts: int = 8, retry_interval_s: float = 0.25, sleep: Callable[[float], None] = time.sleep
    ) -> Dict[str, int]:
        """Waits until every free went out: up to ``max_attempts`` waits of ``retry_interval_s``
        (at least 0.1 s each); raises ``RuntimeError`` with what still waits."""
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if retry_interval_s < 0:
            raise ValueError("retry_interval_s must be >= 0")
        before = self._pending()
        last = ""
        for attempt in range(max_attempts):
            wait = max(retry_interval_s, 0.1)
            t0 = time.monotonic()
            try:
                self._reader.flush(wait)
                last = ""
            except FreeNotSentError as e:
                last = str(e)
            self._prefixes.wait(max(0.0, wait - (time.monotonic() - t0)))
            if self._pending() == 0:
                return {"removed": before, "removed_bytes": 0, "release_pending": 0, "attempts": attempt + 1}
        left = self._pending()
        last = last or self._prefixes.last_refusal()
        raise RuntimeError(
            f"SpecForgeArenaStore {self.store_id} could not deliver {left} frees after {max_attempts} attempts"
            + (f": {last}" if last else "")
            + "; they stay queued and keep being retried"
        )

    def drain_sample_removals(
        self, sample_ids: List[str], *, max_attempts: int = 8, retry_interval_s: float = 0.25, sleep: Callable[[float], None] = time.sleep
    ) -> Dict[str, int]:
        """As :meth:`drain_pending_removals`, for the frees of ``sample_ids`` only (by key or by
        prefix; removals from the Mooncake store, one master for all, are waited for whole), as
        SpecForge's own Mooncake store drains them: SpecForge drains an optimizer window's
        samples here, and frees of other samples (waiting for a host that does not answer, say)
        must not end the run. ``removed``: the samples drained (all of them); raises
        ``RuntimeError`` saying which endpoint still holds some of their frees."""
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if retry_interval_s < 0:
            raise ValueError("retry_interval_s must be >= 0")
        ids = list(dict.fromkeys(str(s) for s in sample_ids))
        if not ids:
            return {"removed": 0, "removed_bytes": 0, "release_pending": 0}
        store = escape_part(self.store_id)
        samples, stores = {f"{store}/{escape_part(sid)}/" for sid in ids}, {f"{store}/"}
        last = ""
        for attempt in range(max_attempts):
            wait = max(retry_interval_s, 0.1)
            t0 = time.monotonic()
            try:
                self._reader.flush_samples(self.store_id, ids, wait)
                keys_out, last = True, ""
            except FreeNotSentError as e:
                keys_out, last = False, str(e)
            prefixes_out = self._prefixes.wait(max(0.0, wait - (time.monotonic() - t0)), samples, stores)
            if keys_out and prefixes_out:
                return {"removed": len(ids), "removed_bytes": 0, "release_pending": self._pending(), "attempts": attempt + 1}
        left, at = self._prefixes.waiting(samples, stores)
        if not last and left:
            last = self._prefixes.last_refusal() or f"their prefix frees wait for {at} ({left} in all)"
        raise RuntimeError(
            f"SpecForgeArenaStore {self.store_id} could not deliver the frees of {len(ids)} samples (first: {_short(ids[0])}) "
            f"after {max_attempts} attempts" + (f": {last}" if last else "") + "; they stay queued and keep being retried"
        )

    # -- internals ----------------------------------------------------------------------------
    def _ident(self, ref: SampleRef) -> Tuple[str, int]:
        gen = ref.metadata.get("generation")
        if gen is None:
            raise KeyError(f"sample {_short(ref.sample_id)}: its ref carries no generation")
        return str(ref.sample_id), int(gen)

    def _check_result(self, ref: SampleRef, result: Any, gen: int) -> None:
        """The result must be the ref's sample: ids, generation, every feature of the ref."""
        sid = _short(ref.sample_id)
        if not isinstance(result, Mapping) or not isinstance(result.get("features"), Mapping):
            raise KeyError(f"sample {sid}: its capture-arena result is not a result")
        ident = (str(result.get("store_id")), str(result.get("sample_id")), result.get("gen"))
        if ident != (self.store_id, str(ref.sample_id), gen):
            raise KeyError(f"sample {sid} g{gen} of store {_short(self.store_id)}: its ref carries the result of {_short(ident)}")
        missing = [n for n in ref.feature_keys if n not in result["features"]]
        if missing:
            raise KeyError(f"sample {sid}: its capture-arena result lacks features {_short(missing)}")
        size = _json_bytes(result)
        if size is None or size > MAX_RESULT_BYTES:
            held = "is not JSON" if size is None else f"is {size} bytes as JSON, over the {MAX_RESULT_BYTES} a result may hold"
            raise KeyError(f"sample {sid}: its capture-arena result {held}")
        for name, f in result["features"].items():
            if not isinstance(f, Mapping) or not _shape_ok(f.get("shape")):
                shape = f.get("shape") if isinstance(f, Mapping) else f
                raise KeyError(
                    f"sample {sid}: its feature {_short(name, 80)!r} has no shape of at most {MAX_DIMS} "
                    f"dimensions in [0, 2**63): {str(shape)[:120]}"
                )

    def _track(self, sid: str, gen: int, result: Mapping[str, Any]) -> None:
        old = self._results.get(sid)
        if old is not None and self._generation.get(sid) != gen:
            self._free_result(old)  # a new generation supersedes the old one
        elif old is not None:
            self._supersede(old, result)
        self._results[sid] = dict(result)
        self._generation[sid] = gen
        self._put_time[sid] = self._clock()
        self._put_time.move_to_end(sid)
        self._bytes[sid] = _result_bytes(result)
        self._learn_from(result)
        if len(self._results) > self.max_tracked:
            self._forget_beyond_bounds(self._put_time[sid])

    def _forget(self, sid: str) -> None:
        """Stops tracking a sample without freeing it (it was freed, or is left to its producer
        and to ``abort``'s prefix free)."""
        self._results.pop(sid, None)
        self._generation.pop(sid, None)
        self._put_time.pop(sid, None)
        self._bytes.pop(sid, None)
        self._stats["forgotten"] += 1

    def _forget_beyond_bounds(self, now: float) -> None:
        """Forgets the oldest results not leased beyond ``max_tracked``, and those older than
        ``forget_after_s``."""
        over = len(self._results) - self.max_tracked
        doomed = []
        for sid, t in self._put_time.items():  # oldest first; stops at the first kept
            if over <= 0 and now - t <= self.forget_after_s:
                break
            if self._leased(sid, self._generation.get(sid)):
                continue
            doomed.append(sid)
            over -= 1
        for sid in doomed:
            self._forget(sid)
        forgotten = len(doomed)
        if forgotten:
            log.info(
                "forgot %d tracked capture results (beyond %d, or older than %.0f s); not freed: an abort still frees them by prefix",
                forgotten,
                self.max_tracked,
                self.forget_after_s,
            )

    def _check_residency(self, now: float) -> None:
        """At most every RESIDENCY_CHECK_S, asks each control endpoint (in the background)
        which of this store's samples it still holds, and forgets those it no longer does."""
        with self._lock:
            if now - self._residency_at < RESIDENCY_CHECK_S or (self._residency is not None and self._residency.is_alive()):
                return
            self._residency_at = now
            endpoints = list(self._endpoints.items())
            if not endpoints or not self._results:
                return
            residency = threading.Thread(target=self._residency_pass, args=(endpoints,), name="capture-arena-residency", daemon=True)
            try:
                residency.start()
            except RuntimeError:  # no thread to be had (a thread limit, the interpreter's exit): next time
                return
            self._residency = residency

    def _residency_pass(self, endpoints: List[Tuple[str, Optional[str]]]) -> None:
        """Samples published before the oldest object a producer still holds for this store
        are freed: a result adopted before that object was published is forgotten. (Adoption
        follows publication, so this never forgets a resident sample.)"""
        for control, token in endpoints:
            asked = self._clock()
            try:
                report = _stats_query(control, token, 2.0)
            except Exception as e:  # unreachable, refused: nothing learned
                log.debug("residency of %s at %s: %s", self.store_id, control, e)
                continue
            rows = [r for r in report.get("stores", []) if r.get("store_id") == self.store_id]
            if rows:
                # Its oldest object was published no later than this: everything adopted before
                # it was freed. (A table made earlier lists the same oldest object, or an older
                # one freed since: an earlier, safe, cutoff.)
                cutoff = asked - float(rows[0].get("oldest_age_s", 0.0)) - 1.0
            elif int(report.get("stores_total", 0)) <= len(report.get("stores", [])):
                # It held nothing of this store when the table was made, which may be up to
                # TABLE_AGE_S before the answer: everything adopted before that is gone.
                cutoff = asked - TABLE_AGE_S - 1.0
            else:
                continue  # not among the listed holders: nothing can be said
            with self._lock:
                doomed = []
                for sid, t in self._put_time.items():  # oldest first
                    if t >= cutoff:
                        break
                    result = self._results.get(sid, {})
                    arena = result.get("arena") if isinstance(result, Mapping) else None
                    if isinstance(arena, Mapping) and arena.get("control") == control and not self._leased(sid, self._generation.get(sid)):
                        doomed.append(sid)
                for sid in doomed:
                    self._forget(sid)

    def _leased(self, sid: str, gen: Optional[int]) -> bool:
        return any(h.sample_id == sid and h.generation == gen for h in self._leases.values())

    def _free_tracked(self, sid: str) -> None:
        result = self._results.pop(sid, None)
        gen = self._generation.pop(sid, None)
        if gen is not None:
            self._remember_freed(sid, gen)
        self._put_time.pop(sid, None)
        self._bytes.pop(sid, None)
        if result is not None:
            self._free_result(result)

    def _supersede(self, old: Optional[Mapping[str, Any]], new: Mapping[str, Any]) -> None:
        """Frees ``old``, a result of the same sample and generation as ``new``, when it is in
        another arena (a retry published on another server: nothing else would free it). One in
        the same arena was replaced by ``new`` already (``replace``), and is left alone."""
        if old is None or old is new or is_store_result(old):  # store keys are global: the retry overwrote them
            return

        # The same server (its session may have changed: a NIXL server process replaced) keeps
        # one arena, where the retry replaced the objects under the same keys.
        if is_store_result(new) or _control_of(old) != _control_of(new):
            self._free_result(old)

    def _remember_freed(self, sid: str, gen: int) -> None:
        self._freed[sid] = gen
        self._freed.move_to_end(sid)
        while len(self._freed) > self.max_tracked:
            self._freed.popitem(last=False)

    def _free_result(self, result: Mapping[str, Any]) -> None:
        try:
            self._reader.release(result)
        except KeyError:
            pass  # released already: its frees were queued then
        except CaptureArenaError as e:  # a result that names nothing freeable: say so, go on
            log.error("frees of %s/%s not queued: %s", result.get("store_id"), result.get("sample_id"), e)

    def _free_unseen(self, sid: str, gen: Optional[int], names: List[str]) -> bool:
        """Frees a sample this process has no result of: by prefix at every known control
        endpoint, and by key from the Mooncake store where store-placement results were seen.
        False when there is nowhere to send it."""
        sent = False
        prefix = f"{escape_part(self.store_id)}/{escape_part(sid)}/" + (f"g{gen}/" if gen is not None else "")
        for control, token in self._endpoints.items():
            self._prefixes.add(control, token, prefix)
            sent = True
        if self._store_placement and gen is not None and names:
            shell = {"store_id": self.store_id, "sample_id": sid, "gen": gen, "features": {n: {"shape": [0], "dtype": "uint8"} for n in names}}
            self._free_result(shell)
            sent = True
        return sent

    def _pending(self) -> int:
        return int(self._reader.health()["pending_frees"]) + self._prefixes.pending


class _RecordingRefSource:
    """See :meth:`SpecForgeArenaStore.live_ref_source`."""

    def __init__(self, store: SpecForgeArenaStore, inner: Any) -> None:
        self._store = store
        self._inner = inner

    def ref_from_record(self, record: Mapping[str, Any]) -> Any:
        # Remembered once the wrapped source took it: a record it rejects never gets a ref.
        ref = self._inner.ref_from_record(record)
        self._store.record_result(record)
        return ref

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


__all__ = ["SpecForgeArenaStore", "META_KEY", "escape_part"]
