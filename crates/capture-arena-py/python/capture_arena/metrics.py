"""Prometheus metrics for a sink: the writer's counters, the arena's occupancy, and who holds it.

How SGLang serves metrics: ``--enable-metrics`` sets ``PROMETHEUS_MULTIPROC_DIR`` before the
scheduler processes are spawned, and the HTTP process serves ``/metrics`` from a fresh
``CollectorRegistry`` that holds only a ``MultiProcessCollector`` over that directory
(``add_prometheus_middleware`` in ``sglang/srt/utils/common.py``). So only what a process
writes into the directory's ``*.db`` files is shown. A collector in the scheduler's own
``prometheus_client.REGISTRY`` is never shown.

What :func:`register` does:

- With ``PROMETHEUS_MULTIPROC_DIR`` set, a daemon thread reads ``sink.stats()`` and
  ``sink.store_usage()`` every ``SGLANG_SPEC_CAPTURE_METRICS_INTERVAL_S`` seconds (default 5;
  at least 0.05). It writes them through ``prometheus_client``'s multiprocess files: a
  ``Counter`` per running total and a ``Gauge(multiprocess_mode="mostrecent")`` per level, the
  mode SGLang uses for its own gauges.
- Without it, an :class:`ArenaCollector` is added to ``prometheus_client.REGISTRY`` and reads the
  sink at each scrape.

What an operator sees is the same names in both modes:

- counters ``capture_arena_<counter>_total``, e.g. ``capture_arena_published_samples_total``;
- gauges ``capture_arena_<gauge>``, e.g. ``capture_arena_free_bytes``;
- per trainer store, labelled ``store_id``: ``capture_arena_store_resident_bytes``,
  ``capture_arena_store_resident_objects`` and ``capture_arena_store_oldest_age_seconds``.

In multiprocess mode, these differences apply:

- Values are up to one interval old.
- Counters are summed over all processes, so a new sink adds to the totals rather than
  restarting them.
- A gauge shows the value written last. With several capturing schedulers, that is whichever one
  wrote last.
- A store that left the table, and the levels of a sink that closed, show 0: multiprocess mode
  cannot remove a series.
- At most 256 ``store_id`` labels are made per process; the other stores are summed into
  ``store_id="_other"``. Without ``PROMETHEUS_MULTIPROC_DIR`` a scrape names the 32 stores
  holding the most bytes and sums the rest into ``_other``; a closed sink's collector yields
  nothing (never a failed scrape).

A forked child forgets the parent's registrations (:func:`after_fork_in_child`, run at every
fork), so registering again in the child works.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Optional

from . import _logs
from .errors import WriterStoppedError

__all__ = [
    "GAUGES",
    "INTERVAL_ENV",
    "ArenaCollector",
    "MetricsHandle",
    "MultiprocessExporter",
    "register",
    "unregister",
    "after_fork_in_child",
]

_log = _logs.get("capture_arena")

#: The sink's stats that are levels, not running totals.
GAUGES = frozenset(
    {
        "capacity",
        "free_bytes",
        "largest_free",
        "free_extents",
        "resident_objects",
        "resident_bytes",
        "open_connections",
        "control_buffered_bytes",
        "waiting_bytes",
    }
)

PREFIX = "capture_arena"
#: Seconds between two refreshes of the multiprocess files.
INTERVAL_ENV = "SGLANG_SPEC_CAPTURE_METRICS_INTERVAL_S"
DEFAULT_INTERVAL_S = 5.0
MIN_INTERVAL_S = 0.05
#: The most distinct ``store_id`` labels one process creates; the others go to ``_other``.
MAX_STORE_LABELS = 256
#: The stores a scrape of the in-process collector names (the largest); the rest are summed
#: into ``store_id="_other"``.
MAX_STORE_SERIES = 32
OTHER_STORE = "_other"

#: Per-store gauges: (metric suffix, store_usage() field, help).
_STORE_GAUGES = (
    ("store_resident_bytes", "bytes", "Resident bytes per trainer store"),
    ("store_resident_objects", "objects", "Resident objects per trainer store"),
    ("store_oldest_age_seconds", "oldest_age_s", "Age of the oldest resident object per trainer store"),
)

# Guards the module's state and every write to a metric. The refresh threads hold it only while
# writing values (never while asking the sink), and a fork waits for it: the child then never
# inherits prometheus_client's value lock taken by one of our threads.
_LOCK = threading.RLock()
_PID = os.getpid()
_HANDLES: list["MetricsHandle"] = []
# Counter and Gauge objects, made once per process (with registry=None: they live in the
# multiprocess files only, so making them again could never clash in a registry).
_METRICS: dict[str, Any] = {}
_STORE_LABELS: set[str] = set()
_BAD_METRICS: set[str] = set()


class MetricsHandle:
    """What :func:`register` returns; :func:`unregister` (or ``close()``) stops it."""

    @property
    def sink(self) -> Any:
        """The sink (None once a weakly referenced sink was collected)."""
        return None

    @property
    def active(self) -> bool:
        """False once closed (or inherited by a forked child)."""
        return False

    def close(self) -> None:
        """Stops exporting. Idempotent."""

    def _forget_in_child(self) -> None:
        """In a forked child: drop what belongs to the parent, writing nothing."""


class ArenaCollector(MetricsHandle):
    """A ``prometheus_client`` collector over one sink (anything with ``stats()``; the per-store
    table when it also has ``store_usage()``). :func:`register` adds it to a registry when
    ``PROMETHEUS_MULTIPROC_DIR`` is unset."""

    def __init__(self, sink: Any, prefix: str = PREFIX) -> None:
        self._sink = sink
        self._prefix = prefix
        self._registry: Optional[Any] = None
        self._active = True

    @property
    def sink(self) -> Any:
        return self._sink

    @property
    def active(self) -> bool:
        return self._active

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self._prefix
        try:
            stats = self._sink.stats()
        except Exception:  # closed (its levels end with it): never a failed scrape of the registry
            return
        for name, value in sorted(stats.items()):
            if name in GAUGES:
                yield GaugeMetricFamily(f"{p}_{name}", f"capture-arena {name}", value=value)
            else:
                yield CounterMetricFamily(f"{p}_{name}", f"capture-arena {name}", value=value)
        usage = getattr(self._sink, "store_usage", None)
        if usage is None:
            return
        by_bytes = GaugeMetricFamily(f"{p}_store_resident_bytes", "Resident bytes per trainer store", labels=["store_id"])
        by_objects = GaugeMetricFamily(f"{p}_store_resident_objects", "Resident objects per trainer store", labels=["store_id"])
        age = GaugeMetricFamily(
            f"{p}_store_oldest_age_seconds", "Age of the oldest resident object per trainer store", labels=["store_id"]
        )
        try:
            rows = list(usage())
        except Exception:
            rows = []
        # The largest stores by name, the rest summed: store ids come from clients, and each
        # name would be a series of its own.
        top, rest = rows[:MAX_STORE_SERIES], rows[MAX_STORE_SERIES:]
        if rest:
            top.append({
                "store_id": OTHER_STORE,
                "bytes": sum(r["bytes"] for r in rest),
                "objects": sum(r["objects"] for r in rest),
                "oldest_age_s": max(r["oldest_age_s"] for r in rest),
            })
        for row in top:
            by_bytes.add_metric([row["store_id"]], row["bytes"])
            by_objects.add_metric([row["store_id"]], row["objects"])
            age.add_metric([row["store_id"]], row["oldest_age_s"])
        yield by_bytes
        yield by_objects
        yield age

    def close(self) -> None:
        with _LOCK:
            if not self._active:
                return
            self._active = False
            _forget_handle(self)
            registry, self._registry = self._registry, None
        _unregister_collector(registry, self)

    def _forget_in_child(self) -> None:
        self._active = False
        registry, self._registry = self._registry, None
        _unregister_collector(registry, self)


def _unregister_collector(registry: Optional[Any], collector: Any) -> None:
    if registry is None:
        return
    try:
        registry.unregister(collector)
    except Exception as e:  # not registered there (any more)
        _log.debug("capture_arena metrics: unregistering the collector: %r", e)


class MultiprocessExporter(MetricsHandle):
    """Writes one sink's stats into ``prometheus_client``'s multiprocess files from a daemon
    thread, every ``interval_s`` seconds, until closed or until the sink is closed or collected
    (only a weak reference to the sink is held)."""

    def __init__(self, sink: Any, interval_s: float) -> None:
        self.interval_s = interval_s
        self._ref: Callable[[], Any]
        try:
            self._ref = weakref.ref(sink)
        except TypeError:  # an object without weak references (not a capture_arena sink)
            self._ref = lambda: sink
        self._stop = threading.Event()
        self._stopped = False
        self._last: dict[str, float] = {}  # the sink's totals at the previous refresh
        self._shown: set[str] = set()  # store_id labels written non-zero at the previous refresh
        self._levels: set[str] = set()  # level stats written so far
        self._warned = False
        self.thread = threading.Thread(target=self._run, name="capture-arena-metrics", daemon=True)

    @property
    def sink(self) -> Any:
        return self._ref()

    @property
    def active(self) -> bool:
        return not self._stopped

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self._finish("unregistered")
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)

    def _forget_in_child(self) -> None:
        # The thread does not exist here, and the values are the parent's to write.
        self._stopped = True
        self._stop = threading.Event()
        self._stop.set()

    def _finish(self, why: str) -> None:
        """Stops (once), and shows the sink's levels and stores as 0: the series cannot be
        removed, and they would otherwise keep the sink's last values forever."""
        with _LOCK:
            if self._stopped:
                return
            self._stopped = True
            self._stop.set()
            _forget_handle(self)
            _log.debug("capture_arena metrics: refresh stopped (%s)", why)
            try:
                for name in self._levels:
                    _gauge(name).set(0)
                self._write_stores({})
            except Exception as e:
                _log.debug("capture_arena metrics: zeroing the levels: %r", e)

    def _run(self) -> None:
        try:
            while not self._stopped:
                why = self._refresh()
                if why is not None:
                    self._finish(why)
                    return
                if self._stop.wait(self.interval_s):
                    return
        except BaseException as e:  # never let the thread raise (not even at interpreter exit)
            try:
                _log.debug("capture_arena metrics: refresh thread ended: %r", e)
            except BaseException:
                pass

    def _complain(self, what: str, e: BaseException) -> None:
        if self._warned:
            _log.debug("capture_arena metrics: %s: %r", what, e)
        else:
            self._warned = True
            _log.warning("capture_arena metrics: %s: %r (retrying every %gs)", what, e, self.interval_s)

    def _refresh(self) -> Optional[str]:
        """One refresh; returns why to stop, or None to go on."""
        try:
            sink = self._ref()
            if sink is None:
                return "the sink was garbage-collected"
            if getattr(sink, "_closed", False) is True:  # a StoreSink keeps answering stats()
                return "the sink is closed"
            try:
                stats = dict(sink.stats())
            except WriterStoppedError:
                return "the sink is closed"
            except Exception as e:
                if "closed" in str(e).lower():
                    return "the sink is closed"
                self._complain("reading the sink's stats", e)
                return None
            # Levels only from a sink that exists: under tensor parallelism every rank registers,
            # and the ranks that never capture (their sinks never start, all zeros) would
            # overwrite the capturing rank's most recent levels with 0 on most scrapes.
            levels = getattr(sink, "started", True) is not False
            rows: Optional[list[Any]] = None
            usage = getattr(sink, "store_usage", None)
            if usage is not None:
                try:
                    rows = list(usage())
                except WriterStoppedError:
                    return "the sink is closed"
                except Exception as e:
                    self._complain("reading the sink's store table", e)
            del sink, usage  # never keep the sink alive while waiting
            with _LOCK:
                if self._stopped:
                    return None
                self._write(stats, rows, levels)
        except Exception as e:
            self._complain("refreshing", e)
        return None

    def _write(self, stats: dict[str, Any], rows: Optional[list[Any]], levels: bool = True) -> None:
        for name, value in sorted(stats.items()):
            try:
                v = float(value)
            except (TypeError, ValueError):
                continue
            try:
                if name in GAUGES:
                    if not levels:
                        continue
                    _gauge(name).set(v)
                    self._levels.add(name)
                else:
                    counter = _counter(name)
                    last = self._last.get(name, 0.0)
                    # A total that went down belongs to a new sink: it starts from 0.
                    delta = v - last if v >= last else v
                    if delta > 0:
                        counter.inc(delta)
                    self._last[name] = v
            except Exception as e:
                _bad_metric(name, e)
        if rows is not None:
            self._write_stores(_aggregate(rows))

    def _write_stores(self, now: dict[str, tuple[float, float, float]]) -> None:
        for label, values in now.items():
            for (suffix, _, _), v in zip(_STORE_GAUGES, values):
                _store_gauge(suffix).labels(store_id=label).set(v)
        for label in self._shown - now.keys():
            for suffix, _, _ in _STORE_GAUGES:
                _store_gauge(suffix).labels(store_id=label).set(0)
        self._shown = set(now)


def _aggregate(rows: list[Any]) -> dict[str, tuple[float, float, float]]:
    """The store table by label: bytes and objects summed, the oldest age the largest."""
    out: dict[str, tuple[float, float, float]] = {}
    for row in rows:
        try:
            label = _store_label(str(row["store_id"]))
            b, o, a = float(row["bytes"]), float(row["objects"]), float(row["oldest_age_s"])
        except Exception:
            continue
        pb, po, pa = out.get(label, (0.0, 0.0, 0.0))
        out[label] = (pb + b, po + o, max(pa, a))
    return out


def _store_label(store_id: str) -> str:
    if store_id in _STORE_LABELS:
        return store_id
    if len(_STORE_LABELS) < MAX_STORE_LABELS and store_id != OTHER_STORE:
        _STORE_LABELS.add(store_id)
        return store_id
    return OTHER_STORE


def _bad_metric(name: str, e: BaseException) -> None:
    if name not in _BAD_METRICS:
        _BAD_METRICS.add(name)
        _log.warning("capture_arena metrics: cannot export %r: %r", name, e)


def _counter(name: str) -> Any:
    key = f"counter:{name}"
    m = _METRICS.get(key)
    if m is None:
        from prometheus_client import Counter

        m = _METRICS[key] = Counter(f"{PREFIX}_{name}", f"capture-arena {name}", registry=None)
    return m


def _gauge(name: str) -> Any:
    key = f"gauge:{name}"
    m = _METRICS.get(key)
    if m is None:
        from prometheus_client import Gauge

        m = _METRICS[key] = Gauge(f"{PREFIX}_{name}", f"capture-arena {name}", registry=None, multiprocess_mode="mostrecent")
    return m


def _store_gauge(suffix: str) -> Any:
    key = f"store:{suffix}"
    m = _METRICS.get(key)
    if m is None:
        from prometheus_client import Gauge

        help_text = next(h for s, _, h in _STORE_GAUGES if s == suffix)
        m = _METRICS[key] = Gauge(
            f"{PREFIX}_{suffix}", help_text, labelnames=["store_id"], registry=None, multiprocess_mode="mostrecent"
        )
    return m


def _forget_handle(handle: MetricsHandle) -> None:
    try:
        _HANDLES.remove(handle)
    except ValueError:
        pass


def _interval() -> float:
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= MIN_INTERVAL_S):
        _log.warning(
            "%s=%r is not a number of seconds >= %g; using %g", INTERVAL_ENV, raw, MIN_INTERVAL_S, DEFAULT_INTERVAL_S
        )
        return DEFAULT_INTERVAL_S
    return v


def _multiprocess_ready() -> bool:
    """Whether prometheus_client writes the multiprocess files (it decides once, when first
    imported: an import before ``PROMETHEUS_MULTIPROC_DIR`` was set keeps values in memory)."""
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        _log.warning(
            "capture_arena metrics: prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR "
            "was set, so this process cannot write the multiprocess files; the metrics go to "
            "prometheus_client.REGISTRY instead (which SGLang's /metrics does not show)"
        )
        return False
    return True


def register(sink: Any, registry: Any = None) -> Optional[MetricsHandle]:
    """Exports ``sink``'s metrics; returns the handle to pass to :func:`unregister`, or ``None``
    when ``prometheus_client`` is not installed (or registering failed, which is logged).

    With ``PROMETHEUS_MULTIPROC_DIR`` set and no ``registry``, a :class:`MultiprocessExporter`
    (what SGLang's ``/metrics`` shows); else an :class:`ArenaCollector` registered with
    ``registry`` (default ``prometheus_client.REGISTRY``). Registering a sink again returns its
    live handle. Never raises."""
    try:
        import prometheus_client
    except ImportError:
        return None
    try:
        with _LOCK:
            multiprocess = registry is None and bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
            if multiprocess and not _multiprocess_ready():
                multiprocess = False
            target: Any = None if multiprocess else (registry if registry is not None else prometheus_client.REGISTRY)
            for h in _HANDLES:
                if not h.active or h.sink is not sink:
                    continue
                if multiprocess and isinstance(h, MultiprocessExporter):
                    return h
                if isinstance(h, ArenaCollector) and h._registry is target:
                    return h
            if multiprocess:
                exporter = MultiprocessExporter(sink, _interval())
                _HANDLES.append(exporter)
                exporter.start()
                return exporter
            collector = ArenaCollector(sink)
            target.register(collector)
            collector._registry = target
            _HANDLES.append(collector)
            return collector
    except Exception as e:
        _log.warning("capture_arena metrics: not exported: %r", e)
        return None


def unregister(handle: Optional[MetricsHandle]) -> None:
    """Stops what :func:`register` started (the refresh thread, or the collector's
    registration). Idempotent; accepts ``None``; never raises."""
    if handle is None:
        return
    try:
        handle.close()
    except Exception as e:
        _log.debug("capture_arena metrics: unregister: %r", e)


# Locks taken before a fork and given back after it (in the parent and the child), so that the
# child never inherits one held by a thread that does not exist there.
_FORK_HELD: list[Any] = []


def _before_fork() -> None:
    locks: list[Any] = [_LOCK]
    for h in list(_HANDLES):
        lock = getattr(getattr(h, "_registry", None), "_lock", None)
        if lock is not None and hasattr(lock, "acquire") and all(lock is not x for x in locks):
            locks.append(lock)
    for lock in locks:
        try:
            if lock.acquire(timeout=2.0):
                _FORK_HELD.append(lock)
        except Exception:
            pass


def _release_fork_locks() -> None:
    while _FORK_HELD:
        try:
            _FORK_HELD.pop().release()
        except Exception:
            pass


def _after_fork_in_parent() -> None:
    _release_fork_locks()


def after_fork_in_child() -> None:
    """Forgets the parent's registrations in a forked child, so that :func:`register` works
    there: the parent's refresh threads do not exist in the child and their handles become
    inactive; collectors the parent registered are unregistered from their registries. Runs at
    every fork (registered with ``os.register_at_fork`` at import); calling it again, or in the
    process that imported the module, does nothing."""
    global _LOCK, _PID
    if os.getpid() == _PID:
        return
    _PID = os.getpid()
    _release_fork_locks()  # held by this thread (the fork's), or by none
    _LOCK = threading.RLock()
    handles = list(_HANDLES)
    _HANDLES.clear()
    for h in handles:
        try:
            h._forget_in_child()
        except Exception as e:
            _log.debug("capture_arena metrics: after fork: %r", e)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=after_fork_in_child)
