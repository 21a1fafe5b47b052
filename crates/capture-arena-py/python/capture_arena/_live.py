"""Live capture from serving traffic: the semantics of SpecForge's online-live SGLang patch
(``patches/sglang/online-live/spec-capture-live.patch``), with capture-arena's sinks behind it.

The patched scheduler asks ``maybe_live_spec(rid)`` for every request it receives, on every rank;
a request the sink samples gets a spec (``{"store_id", "sample_id": "live-{rid}", "gen",
"replace": False, "features", "live": True}``, from the intake's config), so the scheduler
captures its hidden states; when it finishes, attention-TP rank 0 hands them over with
``put_sample_live(spec, aux=, last_hidden=, tokens=)``. A worker thread publishes the sample and
posts its record (the sink's result plus ``num_tokens``) to the intake
(``POST {intake}/v1/spec-capture/records``), whose trainer adopts it.

What follows upstream exactly: the sampling rule (the first 8 bytes of SHA-1 of ``str(rid)`` as
a big-endian integer over 2**64, below ``sample_rate``; so every rank decides alike), the sample
ids, the passthrough synthesis from the config (``source: "tokens"`` the token ids, anything
else ones; ``[1, L]`` int64), the row checks (rows == tokens, ``min_num_tokens`` default 2,
``max_num_tokens`` 0 = no cap), the record body, and the queue (``SPEC_CAPTURE_LIVE_QUEUE``,
default 64).

What is added:

- the queue is bounded by the memory its captures hold too, their tensors and token ids
  (``SGLANG_SPEC_CAPTURE_LIVE_QUEUE_BYTES``, 2 GiB; a capture over it only into an empty queue);
- the scheduler thread never waits on the network: the config is fetched by a thread of its own
  (every 5 s until it succeeds, and again when a record is refused with 404 or 422: the
  producer may have restarted with a new ``store_id``); requests that arrive before it are not
  captured;
- ``maybe_live_spec`` and ``put_sample_live`` never raise;
- CUDA tensors are published after the kernels the scheduler enqueued before handing them
  over (an event on its stream, which the worker's stream waits for);
- while the intake is down (no attempt of a record connected, or the proxy answered every
  attempt 502 or 503: taken as not reaching the intake), captures are dropped before
  they are published (``live_dropped_intake_down``): for 0.5 s, doubling up to 8 s while it
  stays down; the first capture after that tries again, and any HTTP answer ends the back-off;
- a full queue, a failed publish or a refused record drops that capture alone, and its objects
  are freed at once by the sink itself (no control round trip). Any non-2xx answer (redirects
  included) is a refusal. A ``duplicate`` answer means the rid was captured before and that
  sample was given to a trainer: this one never will be, so it is freed. It means success only
  when an earlier attempt of this record was sent and its answer lost (then the intake has this
  one), or was answered 502 or 504 by the proxy, which nginx and squid also answer for an
  intake that took the request and then closed the connection or did not answer; an earlier
  attempt that never connected proves nothing. (The price: a client that repeats a request id
  just as a proxy's 502 meant a refused connect gets a capture kept that no trainer reads,
  freed only by ``SGLANG_SPEC_CAPTURE_OBJECT_TTL_S``; the other way, the capture a trainer had
  taken was freed under it.)
- a record no attempt got an answer for (each attempt ends ``POST_TIMEOUT_S``, 10 s, after it
  began, whatever the intake sends meanwhile; so at most about 20 s after it was first sent) is
  freed too, and counted in
  ``live_dropped_unanswered``: its fate is unknown, but a hung or flaky intake must not fill
  the arena for ever. If the intake did take it, the trainer that reads it gets a clean error
  (every address carries its object's stamp, and a freed object's reads fail);
- the config and the records take one route to the intake: directly, or through the proxy the
  environment names for its scheme (``http_proxy``/``https_proxy``, ``HTTP_PROXY``/...; a host in
  ``no_proxy``/``NO_PROXY`` is reached directly), as ``urllib`` decides. The route is logged when
  live capture starts, and every network error names it;
- records carry the arena result (``arena``, each feature's ``address`` and ``stamp``), so a
  trainer reads them through :mod:`capture_arena.specforge` (``SpecForgeArenaStore.adopt_record``);
- counters (``live_captured`` and ``live_dropped_*`` by cause) are in the sink's ``stats()``, so
  SGLang's ``/metrics`` shows them.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import numpy as np

from . import _logs
from ._samples import Warnings, _interrupts
from ._samples import _torch_module as _torch
from .errors import ConfigError

__all__ = ["LiveCapture", "LiveSink", "CONFIG_PATH", "RECORDS_PATH", "sampled", "QUEUE_ENV", "INTAKE_WAIT_ENV", "intake_wait_s", "sync_wait_s"]

_log = _logs.get("capture_arena")

#: The intake's endpoints (SpecForge's ``CaptureIntakeServer``).
CONFIG_PATH = "/v1/spec-capture/config"
RECORDS_PATH = "/v1/spec-capture/records"
#: The environment variable of the queue's size (upstream's name and default).
QUEUE_ENV = "SPEC_CAPTURE_LIVE_QUEUE"
DEFAULT_QUEUE = 64
#: The memory the queued captures' tensors may hold (the server's, in device memory under
#: SGLang, until the worker has published them).
QUEUE_BYTES_ENV = "SGLANG_SPEC_CAPTURE_LIVE_QUEUE_BYTES"
DEFAULT_QUEUE_BYTES = 2 << 30
#: Upstream's timeouts: the config fetch, and each record post (two attempts).
CONFIG_TIMEOUT_S = 5.0
CONFIG_RETRY_S = 5.0
POST_TIMEOUT_S = 10.0
#: After a record that reached no intake (nothing connected), captures are dropped without
#: being published or posted for this long, doubling up to the most while it stays down; the
#: first capture after that tries again, and any answer ends the back-off.
DOWN_BACKOFF_S = 0.5
DOWN_BACKOFF_MAX_S = 8.0
#: The longest sample id a live capture takes (a client may send its own).
MAX_SAMPLE_ID = 512
POST_ATTEMPTS = 2
#: The intake refuses records over 1 MiB; a config or an answer is read up to this much.
MAX_RECORD_BYTES = 1 << 20
MAX_ANSWER_BYTES = 64 << 10
#: The most interim answers (HTTP 1xx but 101) read before a request's final one.
MAX_INTERIM = 8
#: The longest prompt a live capture takes, whatever the config says (tokens are ints).
MAX_TOKENS = 1 << 24
#: What one token id of a list holds: a Python int object (``sys.getsizeof(2**20)``).
INT_BYTES = 28
#: Token ids converted in one piece (one hold of the GIL), at most: about 2 to 4 ms.
TOKENS_PER_PIECE = 1 << 16

#: Counters, all present from the start (zero), in the order ``stats()`` lists them.
COUNTERS = (
    "live_captured",
    "live_not_ready",
    "live_dropped_queue_full",
    "live_dropped_bad_rows",
    "live_dropped_publish",
    "live_dropped_shed",
    "live_dropped_rejected",
    "live_dropped_duplicate",
    "live_dropped_intake_down",
    "live_dropped_unanswered",
    "live_dropped_no_intake",
    "live_dropped_closed",
)


def sampled(rid: Any, rate: float) -> bool:
    """Upstream's sampling rule: every rank makes the same decision for a request id."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.sha1(str(rid).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < rate


def check_intake_url(url: Any) -> str:
    """The intake's origin (``http://host:port``, no trailing slash), or ConfigError."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"--spec-capture-intake-url must be an http:// URL, not {url!r:.80}")
    u = url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(u)
    try:
        port = parts.port  # raises for a port that is not a number in [0, 65535]
    except ValueError as e:
        port, why = 0, f" ({e})"
    else:
        why = " (port 0)" if port == 0 else ""
    if not u.isascii() or any(c.isspace() or not c.isprintable() for c in u):
        # http.client writes the request line and Host in ASCII: a capture would be published,
        # fail to post (UnicodeEncodeError) and be freed, every one.
        raise ConfigError(
            f"--spec-capture-intake-url {u!r:.200}: a URL is ASCII without spaces or control characters; "
            "percent-encode its path (urllib.parse.quote) and give the host as an address or in punycode"
        )
    if "@" in u:  # credentials: never sent (the intake takes none), and logged in every line
        # Shown without them, wherever a '#', '/' or '?' in a password moved them in the URL.
        hidden = f"{u.split('://', 1)[0]}://...@{u.rsplit('@', 1)[1]}"
        raise ConfigError(
            f"--spec-capture-intake-url {hidden!r:.200}: credentials (user:password@) in the intake's URL are never "
            "sent (SpecForge's capture intake takes none), and would show in every log line; remove them"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname or why:
        raise ConfigError(
            f"--spec-capture-intake-url {u!r:.200}{why}: expected http://host:port (SpecForge's capture intake), "
            "e.g. http://127.0.0.1:8600"
        )
    return u


def _length(tokens: Any) -> Optional[int]:
    """How many token ids ``tokens`` holds (a sequence's or a 1-D array's length), None if it
    is neither: read without converting them."""
    try:
        if isinstance(tokens, np.ndarray):
            return int(tokens.shape[0]) if tokens.ndim == 1 else None
        return len(tokens) if isinstance(tokens, Sequence) else None
    except Exception:
        return None


def check_sample_rate(rate: Any) -> float:
    try:
        r = float(rate)
    except (TypeError, ValueError):
        raise ConfigError(f"--spec-capture-sample-rate must be a number in [0, 1], not {rate!r:.40}") from None
    if not 0.0 <= r <= 1.0:
        raise ConfigError(f"--spec-capture-sample-rate must be in [0, 1], not {r}")
    return r


#: Seconds a server under tensor parallelism waits at start-up for the intake's config.
INTAKE_WAIT_ENV = "SGLANG_SPEC_CAPTURE_INTAKE_WAIT_S"
DEFAULT_INTAKE_WAIT_S = 60.0


def intake_wait_s() -> float:
    """``SGLANG_SPEC_CAPTURE_INTAKE_WAIT_S`` (default 60): how long a tensor-parallel server
    waits at start-up for the intake's config."""
    return _seconds_env(INTAKE_WAIT_ENV, DEFAULT_INTAKE_WAIT_S, 3600.0)


def _seconds_env(name: str, default: float, most: float) -> float:
    """A number of seconds in [0, most] from the variable ``name`` (``default`` when unset), or
    ConfigError naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= most:
        raise ConfigError(f"invalid configuration {name}: {raw!r} is not a number of seconds in [0, {most:g}]")
    return v


def _held_bytes(x: Any) -> int:
    """The memory ``x`` keeps alive: a tensor's whole storage (a view of a batch's tensor keeps
    all of it), an array's whole base array (a view of one keeps it too)."""
    if x is None:
        return 0
    storage = getattr(x, "untyped_storage", None)
    if storage is not None:
        return int(storage().nbytes())
    while isinstance(x, np.ndarray) and isinstance(x.base, np.ndarray):
        x = x.base
    return int(getattr(x, "nbytes", 0))


def _handed_over(*tensors: Any) -> Optional[Any]:
    """For CUDA tensors: an event recorded on the handing thread's current stream of their
    device (the scheduler's, where the kernels that wrote them were enqueued), which the worker
    makes its own stream wait for before it touches them; None for host tensors. The worker's
    current stream is another (the default one): without this, its copies (and a
    ``.contiguous()``) were ordered after nothing the scheduler enqueued."""
    for t in tensors:
        if t is not None and getattr(t, "is_cuda", False) is True:
            torch = _torch()
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            return (t.device, event)
    return None


def _wait_handed_over(ready: Optional[Any]) -> None:
    """On the worker: its current stream of the tensors' device waits for the hand-over's event
    (no host wait: the writer's copies are enqueued after it)."""
    if ready is not None:
        device, event = ready
        _torch().cuda.current_stream(device).wait_event(event)


def _tokens_bytes(tokens: Any) -> int:
    """The memory a capture's token ids keep alive: an array's or a tensor's as ``_held_bytes``
    says; a list's (or a tuple's) own size plus ``INT_BYTES`` per id (a Python int past 256 is
    an object of its own, and the patch hands over a list it made for the capture)."""
    if isinstance(tokens, (list, tuple)):
        return sys.getsizeof(tokens) + INT_BYTES * len(tokens)
    return _held_bytes(tokens)


def _int_env(name: str, default: int, most: int, what: str) -> int:
    """An integer in [1, most] from the variable ``name`` (``default`` when unset), or
    ConfigError naming it and ``what`` it sets."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= most:
        raise ConfigError(f"{name}={raw!r}: {what} must be an integer in [1, {most}]")
    return n


def _queue_size() -> int:
    return _int_env(QUEUE_ENV, DEFAULT_QUEUE, 1 << 20, "the live capture queue's size")


def _queue_bytes() -> int:
    """Sizes as every other ``*_BYTES`` variable (``2GiB``, ``512MiB`` or bytes)."""
    raw = os.environ.get(QUEUE_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_QUEUE_BYTES
    from ._capture_arena import _parse_bytes

    n = int(_parse_bytes(QUEUE_BYTES_ENV, raw))
    if not 1 <= n <= 1 << 50:
        raise ConfigError(f"{QUEUE_BYTES_ENV}={raw!r}: the bytes live captures may hold while queued must be in [1, 2^50]")
    return n


class _Config:
    """The intake's config, checked once (so the scheduler thread reads plain fields)."""

    __slots__ = ("store_id", "gen", "features", "passthrough", "min_tokens", "max_tokens")

    def __init__(self, raw: Any) -> None:
        if not isinstance(raw, Mapping):
            raise ValueError("the config is not a JSON object")
        store_id = raw.get("store_id")
        if not isinstance(store_id, str) or not store_id or "/" in store_id or len(store_id) > 256:
            raise ValueError(f"store_id must be a non-empty string without '/', not {store_id!r:.80}")
        gen = raw.get("gen", 1)
        if isinstance(gen, bool) or not isinstance(gen, int) or not 1 <= gen < 2**63:
            raise ValueError(f"gen must be an integer >= 1, not {gen!r:.40}")
        feats = raw.get("features") or {}
        if not isinstance(feats, Mapping) or not all(
            a in ("aux", "last_hidden") and isinstance(n, str) and n for a, n in feats.items()
        ):
            raise ValueError("features must map aux/last_hidden to feature names")
        passthrough = []
        for p in raw.get("passthrough") or []:
            if not isinstance(p, Mapping) or not isinstance(p.get("name"), str) or not p["name"]:
                raise ValueError("each passthrough needs a name")
            passthrough.append((p["name"], p.get("source") == "tokens"))
        if len(passthrough) > 64:
            raise ValueError(f"{len(passthrough)} passthrough features, more than 64")
        lo, hi = raw.get("min_num_tokens") or 2, raw.get("max_num_tokens") or 0
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (lo, hi)):
            raise ValueError("min_num_tokens and max_num_tokens must be integers >= 0")
        self.store_id: str = store_id
        self.gen: int = gen
        self.features: dict[str, str] = dict(feats)
        self.passthrough: list[tuple[str, bool]] = passthrough
        self.min_tokens: int = lo
        self.max_tokens: int = min(hi, MAX_TOKENS) if hi else MAX_TOKENS

    def spec(self, sample_id: str) -> dict[str, Any]:
        """A live capture's spec: the store, generation and features of this config, never a
        replace."""
        return {"store_id": self.store_id, "sample_id": sample_id, "gen": self.gen, "replace": False, "features": dict(self.features)}


Publish = Callable[[Any], "dict[str, Any]"]
Drop = Callable[["dict[str, Any]"], None]


class LiveCapture:
    """Live capture for one sink: see the module docs. ``publish(item)`` publishes one
    ``(spec, aux, last_hidden)`` and returns its row (never raises); ``drop(result)`` frees a
    published result's objects at once."""

    def __init__(self, intake_url: Any, sample_rate: Any, publish: Publish, drop: Drop, *, config_wait_s: Optional[float] = None) -> None:
        self.intake_url = check_intake_url(intake_url)
        self.sample_rate = check_sample_rate(sample_rate)
        self._route = _Route(self.intake_url)
        self._warnings = Warnings()
        _log.info("live capture: the intake %s is reached %s", self.intake_url, self._route.describe())
        self._publish = publish
        self._drop = drop
        self._queue: "queue.Queue[Optional[tuple[Any, Any, Any, Any, int, Any]]]" = queue.Queue(maxsize=_queue_size())
        #: The bytes the queued captures hold (tensors and token ids), and the most they may (a
        #: capture over it is taken only into an empty queue).
        self._queued_bytes = 0
        self._max_queued_bytes = _queue_bytes()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._counts_lock = threading.Lock()
        self._config: Optional[_Config] = None
        self._refetch = threading.Event()
        self._closed = threading.Event()
        self._put_lock = threading.Lock()
        self._last_log = 0.0
        #: The worker's back-off while the intake is down: captures are dropped until then.
        self._down_until = 0.0
        self._down_for = 0.0
        if config_wait_s is not None:
            # Under tensor parallelism every rank asks maybe_live_spec for every request, and a
            # rank that captures runs that request's batch differently (SGLang's CUDA graphs are
            # replayed only without captures): ranks that disagree hang their collectives. Ranks
            # agree once each has a config, and keep agreeing (it is never taken away), so the
            # config is known before the scheduler takes its first request.
            self._config = self._fetch_at_start(config_wait_s)
            _log.info("live capture: intake %s, store_id %s, gen %d (fetched at start-up)", self.intake_url, self._config.store_id, self._config.gen)
        self._fetcher = threading.Thread(target=self._fetch_loop, name="capture-arena-live-config", daemon=True)
        self._worker = threading.Thread(target=self._work, name="capture-arena-live", daemon=True)
        self._fetcher.start()
        try:
            self._worker.start()
        except BaseException:
            # No worker (the process at its thread limit): the config thread must not poll the
            # intake for good, holding this capture and its sink.
            self.close()
            raise

    # -- what the scheduler calls (never raises, never waits) ---------------------------------
    def maybe_live_spec(self, rid: Any) -> Optional[dict[str, Any]]:
        """The spec of a sampled request, None for the others and until the config is known."""
        try:
            if not sampled(rid, self.sample_rate):
                return None
            cfg = self._config
            if cfg is None:  # a capture missed: counted as such (the others were never to be)
                self._count("live_not_ready")
                return None
            sample_id = f"live-{rid}"
            if len(sample_id) > MAX_SAMPLE_ID:  # the worker would drop it: not worth a capture
                self._count("live_dropped_bad_rows")
                self._warnings.warn(
                    "long_id", "live capture: request id of %d characters not captured (a sample id is at most %d)", len(sample_id), MAX_SAMPLE_ID
                )
                return None
            return dict(cfg.spec(sample_id), live=True)
        except Exception:  # a rid whose str() raises: not captured, never the scheduler's problem
            self._warnings.warn("spec", "live capture: cannot make a spec for request %r", rid, exc_info=True)
            return None

    def put_sample_live(self, spec: Any, aux: Any = None, last_hidden: Any = None, tokens: Any = None) -> None:
        """Queues a finished request's capture for the worker; a full queue (in captures, or in
        the bytes their tensors hold) drops it."""
        try:
            held = _held_bytes(aux) + _held_bytes(last_hidden) + _tokens_bytes(tokens)
            ready = _handed_over(aux, last_hidden)
        except Exception:
            self._count("live_dropped_bad_rows")
            return
        with self._put_lock:  # never a put after close() has drained the queue
            if self._closed.is_set():
                self._count("live_dropped_closed")
                return
            if self._queued_bytes and self._queued_bytes + held > self._max_queued_bytes:
                self._count("live_dropped_queue_full")
                return
            try:
                self._queue.put_nowait((spec, aux, last_hidden, tokens, held, ready))
            except queue.Full:
                self._count("live_dropped_queue_full")
                return
            except Exception:
                self._count("live_dropped_bad_rows")
                return
            self._queued_bytes += held

    # -- counters ------------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[what] += n

    def stats(self) -> dict[str, int]:
        with self._counts_lock:
            return dict(self._counts)

    @property
    def config(self) -> Optional[dict[str, Any]]:
        """The intake's config in use (None until fetched)."""
        cfg = self._config
        if cfg is None:
            return None
        return {"store_id": cfg.store_id, "gen": cfg.gen, "features": dict(cfg.features)}

    def _log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= 60.0:
            self._last_log = now
            _log.info("spec-capture live stats: %s", self.stats())

    # -- the config thread ---------------------------------------------------------------------
    def _fetch_loop(self) -> None:
        if self._config is not None:  # fetched at start-up
            self._await_refetch()
        while not self._closed.is_set():
            try:
                cfg = _Config(self._get_json(CONFIG_PATH))
            except Exception as e:
                _log.warning(
                    "live capture: fetching the intake's config from %s %s failed (retrying in %.0f s): %s",
                    self.intake_url, self._route.describe(), CONFIG_RETRY_S, e,
                )
                self._closed.wait(CONFIG_RETRY_S)
                continue
            old = self._config
            self._config = cfg
            if old is None or old.store_id != cfg.store_id or old.gen != cfg.gen:
                _log.info("live capture: intake %s, store_id %s, gen %d, features %s", self.intake_url, cfg.store_id, cfg.gen, cfg.features)
            self._await_refetch()

    def _await_refetch(self) -> None:
        """Until a record is refused with 404 or 422 (a producer restarted with a new
        store_id), then at least CONFIG_RETRY_S more. Once known, the config is replaced, never taken away."""
        self._refetch.wait()
        self._refetch.clear()
        self._closed.wait(CONFIG_RETRY_S)

    def _fetch_at_start(self, wait_s: float) -> _Config:
        """The config, fetched on the caller's thread (every second until ``wait_s`` passed), or
        ConfigError."""
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                return _Config(self._get_json(CONFIG_PATH, max(0.1, min(CONFIG_TIMEOUT_S, left))))
            except Exception as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConfigError(
                        f"live capture under tensor parallelism needs the intake's config before the server takes requests "
                        f"(every rank must decide alike which requests are captured), and {self.intake_url} "
                        f"{self._route.describe()} did not give it within {wait_s:g} s: {e}. Start the trainer's intake "
                        f"first, or wait longer with {INTAKE_WAIT_ENV}"
                    ) from None
                time.sleep(min(1.0, left))

    def _get_json(self, path: str, timeout: float = CONFIG_TIMEOUT_S) -> Any:
        try:
            status, body = self._route.request("GET", path, None, timeout, MAX_RECORD_BYTES + 1)
        except _NotSent as e:
            raise OSError(f"{e}: {e.__cause__}") from None
        if status != 200:
            raise ValueError(f"HTTP {status}: {body[:256].decode('utf-8', 'replace')}")
        if len(body) > MAX_RECORD_BYTES:
            raise ValueError(f"the config is over {MAX_RECORD_BYTES} bytes")
        return json.loads(body)

    # -- the worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            held = item[4]
            with self._put_lock:  # out of the queue: its tensors are the worker's to let go
                self._queued_bytes -= held
            capture = list(item[:4]) + [item[5]]
            del item  # the capture's tensors are held by `capture` alone, let go once published
            try:
                self._write(capture)
            except BaseException as e:  # never ends the worker: the next capture goes on
                if _interrupts(e):
                    raise
                # A panic of the extension (pyo3's PanicException is no Exception) too: before,
                # it ended the worker, and every later capture was dropped as queue_full.
                self._warnings.warn("capture", "live capture: a capture failed", exc_info=True)
            finally:
                del capture
                self._log_stats()

    def _write(self, capture: list[Any]) -> None:
        """Publishes ``[spec, aux, last_hidden, tokens, ready]`` and posts its record; the
        tensors are let go (the list emptied) once published, not held through the post."""
        spec, tokens = capture[0], capture[3]
        cfg = self._config
        aux = capture[1]
        rows = int(aux.shape[0]) if aux is not None and len(getattr(aux, "shape", ())) > 0 else -1
        del aux
        if cfg is None:  # a client's own live spec before the intake's config is known
            self._count("live_not_ready")
            return
        sample_id = spec.get("sample_id") if isinstance(spec, Mapping) else None

        def fits(n: Optional[int]) -> bool:
            ok = n is not None and rows == n and cfg.min_tokens <= n <= cfg.max_tokens
            if not ok or not isinstance(sample_id, str) or len(sample_id) > MAX_SAMPLE_ID:
                self._count("live_dropped_bad_rows")
                self._warnings.warn(
                    "bad_rows",
                    "live capture: a capture dropped: %s rows, %s tokens (the intake takes %d to %d), sample id %r",
                    rows, n, cfg.min_tokens, cfg.max_tokens, str(sample_id)[:80],
                )
                return False
            return True

        # Counted before the ids are converted (their cost grows with the prompt): a capture
        # dropped for its length, or while the intake is down, costs nothing more.
        if not fits(_length(tokens)):
            return
        if time.monotonic() < self._down_until:  # the intake is down: not worth a publish, nor a connect
            self._count("live_dropped_intake_down")
            return
        toks = self._tokens(tokens)
        if not fits(None if toks is None else len(toks)):  # not ints, or changed meanwhile
            return
        assert toks is not None and isinstance(sample_id, str)  # fits() says so
        # The patch passes a request's own spec_capture when it has one, so a client can send a
        # "live" spec: only its sample id is kept. The store, generation, features and no
        # replace are the intake's config's, as maybe_live_spec makes them: a client never
        # replaces another request's capture, nor publishes under another store.
        spec = cfg.spec(sample_id)
        n = len(toks)
        ones = None
        passthrough = []
        for name, from_tokens in cfg.passthrough:
            if from_tokens:
                data = toks
            else:
                ones = np.ones((1, n), dtype=np.int64) if ones is None else ones
                data = ones
            passthrough.append({"name": name, "data": data, "shape": [1, n], "dtype": "int64"})
        item = (dict(spec, passthrough=passthrough), capture[1], capture[2])
        _wait_handed_over(capture[4])  # before the publish reads the stream its copies follow
        capture.clear()  # from here the item alone holds the tensors, and the publish takes it
        row = self._publish(item)
        del item
        if "error" in row:
            self._count("live_dropped_publish")
            self._warnings.warn("publish", "live capture: publishing %s failed: %s", spec.get("sample_id"), row["error"])
            return
        try:
            outcome = self._post(dict(row, num_tokens=n))
        except Exception:  # never leave a published capture behind
            self._warnings.warn("post", "live capture: posting the record of %s failed", spec.get("sample_id"), exc_info=True)
            outcome = "rejected"
        if outcome == "down":
            self._down_for = min(DOWN_BACKOFF_MAX_S, max(DOWN_BACKOFF_S, 2 * self._down_for))
            self._down_until = time.monotonic() + self._down_for
            self._warnings.warn(
                "down", "live capture: the intake %s is down; captures are dropped for %g s before trying it again",
                self.intake_url, self._down_for,
            )
        if outcome == "accepted":
            self._count("live_captured")
            return
        # Never given to a trainer, or its fate unknown after every attempt went unanswered (a
        # trainer holding it gets a clean error): freed now, never left to fill the arena.
        self._drop(row)
        self._count(
            {
                "shed": "live_dropped_shed",
                "duplicate": "live_dropped_duplicate",
                "down": "live_dropped_intake_down",
                "unknown": "live_dropped_unanswered",
            }.get(outcome, "live_dropped_rejected")
        )

    @staticmethod
    def _tokens(tokens: Any) -> Optional[np.ndarray[Any, Any]]:
        """The token ids as 1-D int64 (None if they are not a sequence of ints)."""
        try:
            if isinstance(tokens, np.ndarray):
                t = tokens
            else:
                if not isinstance(tokens, Sequence) or len(tokens) > MAX_TOKENS:
                    return None
                # In pieces: one conversion of a long list holds the GIL, which SGLang's
                # scheduler thread waits for, about 30 to 60 ms a million ids; between pieces
                # the interpreter hands it over at its switch interval.
                pieces = [np.asarray(tokens[i : i + TOKENS_PER_PIECE]) for i in range(0, len(tokens), TOKENS_PER_PIECE)]
                if not all(p.ndim == 1 and np.issubdtype(p.dtype, np.integer) for p in pieces):
                    return None
                t = np.concatenate([p.astype(np.int64, copy=False) for p in pieces]) if pieces else np.empty(0, dtype=np.int64)
            if t.ndim != 1 or len(t) > MAX_TOKENS or not np.issubdtype(t.dtype, np.integer):
                return None
            out: np.ndarray[Any, Any] = t.astype(np.int64, copy=False)
            return out
        except Exception:
            return None

    def _post(self, record: Mapping[str, Any]) -> str:
        """Posts a record: ``accepted``, ``duplicate`` (a first attempt's), ``shed`` (429),
        ``rejected`` (any other non-2xx answer, redirects included), ``down`` (no attempt
        reached the intake whole), or ``unknown`` (an attempt was sent and no attempt got an
        answer)."""
        body = json.dumps(record, separators=(",", ":")).encode()
        if len(body) > MAX_RECORD_BYTES:
            self._warnings.warn(
                "size", "live capture: the record of %s is %d bytes, over the intake's %d", record.get("sample_id"), len(body), MAX_RECORD_BYTES
            )
            return "rejected"
        last, sent, maybe_sent = "", False, False
        for attempt in range(POST_ATTEMPTS):
            try:
                status, answer = self._route.request("POST", RECORDS_PATH, body, POST_TIMEOUT_S, MAX_ANSWER_BYTES)
            except _NotSent as e:
                last = f"{e}: {e.__cause__}"
                continue
            except Exception as e:  # sent, no answer: try again once (the intake dedups ids)
                last, sent = str(e) or type(e).__name__, True
                continue
            if self._route.proxy is not None and not self._route.https and status in (502, 503, 504):
                # (Through an https tunnel the proxy's part ended with its CONNECT: what comes in
                # the tunnel is the intake's, end to end, a refusal as any other.)
                # The proxy's answer, not the intake's: it could not reach it (503, and 502 for
                # a refused connect: the record never got there) or got no whole answer from it
                # (504, and 502 too: nginx and squid answer 502 for an intake that closed the
                # connection after taking the request). After a 504 the record counts as sent;
                # after a 502 only a later "duplicate" is read as this record's own (before: the
                # capture a trainer had taken was freed as a repeated request's). Answered 502
                # alone, the intake is down (backed off).
                last = f"HTTP {status} from the proxy {self._route.describe()}: {answer[:200].decode('utf-8', 'replace')!r}"
                sent = sent or status == 504
                maybe_sent = maybe_sent or status == 502
                continue
            sent_before, sent = sent or maybe_sent, True
            self._down_for = 0.0  # an answer: the intake is up
            if status == 429:
                return "shed"
            if not 200 <= status < 300:
                # The intake's words quoted (repr): its newlines never make log lines of their own.
                self._warnings.warn(
                    "refused", "live capture: the intake refused %s: HTTP %d %r", record.get("sample_id"), status, answer[:512].decode("utf-8", "replace")
                )
                if status in (404, 422):
                    self._refetch.set()  # a trainer restarted with a new store_id?
                return "rejected"
            if _status_of(answer) == "duplicate" and not sent_before:
                # No earlier attempt reached the intake: the id it has is an earlier capture's.
                self._warnings.warn(
                    "duplicate",
                    "live capture: %s was already accepted by the intake (a repeated request id): this capture is freed",
                    record.get("sample_id"),
                )
                return "duplicate"
            return "accepted"
        self._warnings.warn(
            "unanswered", "live capture: the intake %s %s did not answer for %s: %s", self.intake_url, self._route.describe(), record.get("sample_id"), last
        )
        return "unknown" if sent else "down"

    def close(self) -> None:
        """Stops the threads (captures still queued are dropped and counted); the worker ends
        once the capture it holds, if any, is done. Never waits for it."""
        with self._put_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._refetch.set()
            dropped = 0
            while True:
                try:
                    if self._queue.get_nowait() is not None:
                        dropped += 1
                except queue.Empty:
                    break
            self._queued_bytes = 0
            if dropped:
                self._count("live_dropped_closed", dropped)
            # Empty, and nothing is put once closed is set (under the same lock): the stop
            # signal always fits.
            self._queue.put_nowait(None)


class _NotSent(Exception):
    """A request that cannot have reached the intake whole (nothing connected, or its connection
    broke before it was written); ``__cause__`` says why."""


class _Route:
    """The one way to the intake that the config fetch and every record post take: directly, or
    through the proxy the environment names for the intake's scheme (``urllib``'s rule:
    ``{scheme}_proxy`` or its upper-case name, skipped for hosts in ``no_proxy``/``NO_PROXY``)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        self.path = parts.path
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.proxy: Optional[urllib.parse.SplitResult] = None
        self.proxy_var = ""
        proxies = urllib.request.getproxies_environment()
        proxy = proxies.get(parts.scheme)
        bypass = getattr(urllib.request, "proxy_bypass_environment")  # not in typeshed
        if proxy and not bypass(f"{self.host}:{self.port}", proxies):
            p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
            if p.hostname:
                names = (f"{parts.scheme}_proxy", f"{parts.scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY")
                var = next((n for n in names if os.environ.get(n, "").strip() == proxy), names[0])
                try:
                    p.port  # raises for a port that is not a number in [0, 65535]
                except ValueError as e:
                    raise ConfigError(f"{var}={proxy!r:.200} ({e}): the proxy for the capture intake must be host:port") from None
                self.proxy, self.proxy_var = p, var

    def describe(self) -> str:
        """Says how the intake is reached, and how to change it."""
        if self.proxy is None:
            return "(directly: no proxy variable applies to it)"
        return (
            f"(through the proxy {self.proxy.hostname}:{self.proxy.port or 80} from {self.proxy_var}; "
            f"add {self.host} to no_proxy to connect directly)"
        )

    def request(self, method: str, path: str, body: Optional[bytes], timeout: float, limit: int) -> tuple[int, bytes]:
        """One request: its status and at most ``limit`` bytes of its answer, all within
        ``timeout`` of the call, name resolution, connect (to every address of the name), proxy
        tunnel and headers included. Raises _NotSent when it was not written whole (nothing connected,
        or the connection broke first), another exception when it was sent and no whole answer
        came."""
        deadline = time.monotonic() + timeout
        target = self.path + path
        if self.proxy is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = cls(self.host, self.port, timeout=timeout)
        elif self.https:  # a tunnel through the proxy (CONNECT)
            conn = http.client.HTTPSConnection(self.proxy.hostname or "", self.proxy.port or 80, timeout=timeout)
            conn.set_tunnel(self.host, self.port, headers=self._proxy_auth())
        else:  # the proxy takes the whole URL
            conn = http.client.HTTPConnection(self.proxy.hostname or "", self.proxy.port or 80, timeout=timeout)
            target = self.origin + target
        # http.client's connect gives each address of a name the whole timeout in turn.
        cut = threading.Event()
        held: list[socket.socket] = []
        conn._create_connection = _connect_by(deadline, held, cut)  # type: ignore[attr-defined]
        # http.client bounds each socket operation, not the request: an intake (or proxy) that
        # sends "100 Continue" again and again, or its headers a byte at a time, would hold the
        # worker for good. At the deadline the connection is shut down under whatever reads it:
        # through a duplicate of its socket, which a TLS handshake (its socket detached into
        # an SSLSocket) or a connect just returning cannot take away.
        def at_deadline() -> None:
            cut.set()
            for sock in held:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(timeout, at_deadline)
        watchdog.daemon = True
        try:
            watchdog.start()
        except RuntimeError as e:  # no thread to be had: nothing was sent
            raise _NotSent(
                f"timing a request to {self.origin} {self.describe()} (no thread could be started: the process is at its "
                "thread limit, ulimit -u or the cgroup's pids.max)"
            ) from e
        late = TimeoutError(f"no whole answer from {self.origin} {self.describe()} within {timeout:g} s")
        try:
            try:
                conn.connect()
            except Exception as e:  # a proxy's CONNECT answer, a resolver thread not started, included
                # A resolution cut at the deadline says so itself, whichever of it and the
                # watchdog came first.
                honest = isinstance(e, ResolveTimeout) or not cut.is_set()
                raise _NotSent(f"connecting to {self.origin} {self.describe()}") from (e if honest else late)
            if cut.is_set():  # connected as the deadline passed: nothing sent
                raise _NotSent(f"connecting to {self.origin} {self.describe()}") from late
            headers = {"Content-Type": "application/json"} if body is not None else {}
            if self.proxy is not None and not self.https:
                headers.update(self._proxy_auth())
            try:
                conn.request(method, target, body=body, headers=headers)
            except Exception as e:  # not written whole (whatever failed first): never taken
                raise _NotSent(f"sending to {self.origin} {self.describe()}") from (late if cut.is_set() else e)
            try:
                resp = conn.getresponse()
                # http.client skips "100 Continue" only: another interim answer (102
                # Processing, 103 Early Hints from a proxy) comes before the final one on the
                # same connection, and would be taken for it (a 103 read as a refusal, while the
                # intake goes on to accept the record).
                interim = 0
                while 100 <= resp.status < 200 and resp.status != 101:
                    interim += 1
                    if interim > MAX_INTERIM:
                        raise http.client.HTTPException(f"over {MAX_INTERIM} interim answers (HTTP 1xx) from {self.origin} {self.describe()}")
                    resp = _after_interim(conn, resp, method)
                answer = _read_within(resp, limit, deadline, late)
            except (OSError, http.client.HTTPException) as e:
                if cut.is_set() and e is not late:
                    raise late from e
                raise
            if cut.is_set():  # the shutdown ended the answer early: not a whole one
                raise late
            return resp.status, answer
        finally:
            watchdog.cancel()
            # A deadline that fired is shutting the duplicates down: closed under it, a
            # duplicate's number could be another socket's by the time its shutdown runs.
            watchdog.join()
            conn.close()
            for sock in held:
                sock.close()

    def _proxy_auth(self) -> dict[str, str]:
        if self.proxy is None or self.proxy.username is None:
            return {}
        import base64

        cred = f"{urllib.parse.unquote(self.proxy.username)}:{urllib.parse.unquote(self.proxy.password or '')}"
        return {"Proxy-Authorization": "Basic " + base64.b64encode(cred.encode()).decode()}


#: Name resolutions running at once, at most (one abandoned at its deadline holds its thread
#: until the system resolver gives up, seconds later).
MAX_RESOLUTIONS = 8
_resolutions = threading.BoundedSemaphore(MAX_RESOLUTIONS)


def _resolutions_in_child() -> None:
    """A forked child has none of its parent's resolving threads: all its permits."""
    global _resolutions
    _resolutions = threading.BoundedSemaphore(MAX_RESOLUTIONS)


os.register_at_fork(after_in_child=_resolutions_in_child)


class ResolveTimeout(TimeoutError):
    """A name's resolution not done by its deadline (:func:`_resolve_by`)."""


def _resolve_by(host: str, port: int, deadline: float) -> list[Any]:
    """``socket.getaddrinfo`` for a stream socket, by ``deadline``: on a thread of its own,
    because the system resolver takes as long as its configuration says (10 s and more when its
    name server does not answer) and cannot be interrupted. Past the deadline it raises
    TimeoutError and the thread ends when the resolver does."""
    try:  # an address needs no resolver
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except OSError:
        pass
    permits = _resolutions  # a fork replaces it; this call's permit goes back to this one
    if not permits.acquire(blocking=False):
        raise ResolveTimeout(f"resolving {host}: {MAX_RESOLUTIONS} resolutions are running already (the name server does not answer?)")
    got: list[Any] = []
    done = threading.Event()

    def resolve() -> None:
        try:
            got.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except BaseException as e:  # handed to the caller
            got.append(e)
        finally:
            permits.release()
            done.set()

    try:
        threading.Thread(target=resolve, name="capture-arena-resolve", daemon=True).start()
    except BaseException:  # no thread to be had: its permit goes back
        permits.release()
        raise
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise ResolveTimeout(f"resolving {host} did not end in time (the system resolver's name server does not answer?)")
    if isinstance(got[0], BaseException):
        raise got[0]
    out: list[Any] = got[0]
    return out


def _connect_by(deadline: float, held: list[socket.socket], cut: threading.Event) -> Callable[..., socket.socket]:
    """``socket.create_connection`` (as http.client calls it) with one deadline over the name's
    resolution (:func:`_resolve_by`) and every address the name resolves to: each attempt gets
    an equal share of what is left of it (not the whole timeout again, nor all that is left: an
    address that drops connects, a firewalled IPv6 one, would leave none to the live one after
    it). Past the deadline it raises TimeoutError (the last attempt's error its cause). The
    connected socket's duplicate goes in ``held`` (for the watchdog to shut the connection
    through), shut at once if ``cut`` is set (the deadline passed as it connected)."""

    def create(address: tuple[str, int], timeout: Any = None, source_address: Any = None, *_: Any, **__: Any) -> socket.socket:
        host, port = address[0], address[1]
        last: Optional[OSError] = None
        addresses = _resolve_by(host, port, deadline)
        for i, (family, kind, proto, _name, addr) in enumerate(addresses):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock: Optional[socket.socket] = None
            try:  # a family this host cannot make sockets of (IPv6 turned off) is tried past
                sock = socket.socket(family, kind, proto)
                sock.settimeout(left / (len(addresses) - i))
                if source_address:
                    sock.bind(source_address)
                sock.connect(addr)
                held.append(sock.dup())
            except OSError as e:
                last = e
                if sock is not None:
                    sock.close()
                continue
            if cut.is_set():  # the watchdog may have looked before the duplicate was there
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            # http.client's bound on each read and write from here.
            sock.settimeout(timeout if isinstance(timeout, (int, float)) else None)
            return sock
        if last is not None and time.monotonic() < deadline:
            raise last
        raise TimeoutError(f"connecting to {host}:{port}: no address answered in time") from last

    return create


def _read_within(resp: Any, limit: int, deadline: float, late: TimeoutError) -> bytes:
    """At most ``limit`` bytes of an answer, by ``deadline`` (an intake that drips its answer
    does not hold the worker past it); past it, raises ``late``: the same error whichever of
    this look and the request's watchdog comes first."""
    out = bytearray()  # appended in place: a bytes += copied it all per chunk (minutes at 256 MiB)
    while len(out) < limit:
        if time.monotonic() > deadline:
            raise late
        chunk = resp.read1(min(65536, limit - len(out))) if hasattr(resp, "read1") else resp.read(limit - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _after_interim(conn: http.client.HTTPConnection, interim: http.client.HTTPResponse, method: str) -> http.client.HTTPResponse:
    """The answer after an interim one (HTTP 1xx, whose headers ``begin`` read), from the same
    buffered stream: what the stream holds already is the next answer's start."""
    nxt = http.client.HTTPResponse(conn.sock, method=method)
    own, nxt.fp = nxt.fp, interim.fp
    interim.fp = None  # type: ignore[assignment]  # the interim's close must not close the stream
    own.close()
    nxt.begin()
    return nxt


def _status_of(answer: bytes) -> Optional[str]:
    try:
        v = json.loads(answer)
    except Exception:  # not JSON, or JSON nested too deep to read: no status
        return None
    return v.get("status") if isinstance(v, dict) and isinstance(v.get("status"), str) else None


#: How long a synchronous caller waits by default (``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S``, as the
#: compiled sink reads it).
SYNC_WAIT_ENV = "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S"


def sync_wait_s() -> float:
    """``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S`` (default 1): seconds a synchronous caller waits."""
    return _seconds_env(SYNC_WAIT_ENV, 1.0, 86400.0)


class LiveSink:
    """What both sinks (the arena's and the store's) have for live capture: the online-live
    patch's names (``maybe_live_spec``, ``put_sample_live``, ``intake_url``, ``sample_rate``),
    over a :class:`LiveCapture` made by :meth:`start_live`. A sink class using it provides
    ``_publish_live(item) -> row`` and ``_drop_published(result)``."""

    _live: Optional[LiveCapture] = None
    _no_intake = 0

    @property
    def intake_url(self) -> Optional[str]:
        """The intake live captures are posted to (None: live capture is off)."""
        live = self._live
        return None if live is None else live.intake_url

    @property
    def sample_rate(self) -> float:
        """The fraction of requests captured live (1.0 when live capture is off)."""
        live = self._live
        return 1.0 if live is None else live.sample_rate

    def start_live(self, intake_url: Any, sample_rate: Any = 1.0, *, config_wait_s: Optional[float] = None) -> None:
        """Turns live capture on (once): the config fetch and the worker start now, in threads
        of their own; with ``config_wait_s`` the config is fetched here first, waiting up to that
        long (what a tensor-parallel server needs: see :class:`LiveCapture`). ConfigError for a
        bad URL, rate or ``SPEC_CAPTURE_LIVE_QUEUE``, or no config within ``config_wait_s``."""
        if self._live is None:
            self._live = LiveCapture(intake_url, sample_rate, self._publish_live, self._drop_published, config_wait_s=config_wait_s)

    def maybe_live_spec(self, rid: Any) -> Optional[dict[str, Any]]:
        """A live spec for request ``rid`` if it is sampled (never raises; None when live
        capture is off or its config is not known yet)."""
        live = self._live
        return None if live is None else live.maybe_live_spec(rid)

    def put_sample_live(self, spec: Any, *, aux: Any = None, last_hidden: Any = None, tokens: Any = None) -> None:
        """Hands a finished live request's capture to the worker; returns at once, never raises.
        Without an intake (a client that sent ``"live": true`` itself) it is dropped and
        counted (``live_dropped_no_intake``)."""
        live = self._live
        if live is not None:
            live.put_sample_live(spec, aux, last_hidden, tokens)
            return
        self._no_intake += 1
        if self._no_intake == 1 or self._no_intake % 1000 == 0:
            _log.warning(
                "a live capture arrived but this server has no --spec-capture-intake-url: dropped "
                "(%d so far; counted in live_dropped_no_intake)",
                self._no_intake,
            )

    def _live_stats(self) -> dict[str, int]:
        live = self._live
        if live is None:
            return {"live_dropped_no_intake": self._no_intake} if self._no_intake else {}
        s = live.stats()
        s["live_dropped_no_intake"] += self._no_intake
        return s

    def _stop_live(self) -> None:
        live = self._live
        if live is not None:
            live.close()

    def _publish_live(self, item: Any) -> dict[str, Any]:  # pragma: no cover - provided by the sink
        raise NotImplementedError

    def _drop_published(self, result: Mapping[str, Any]) -> None:  # pragma: no cover - provided by the sink
        raise NotImplementedError
