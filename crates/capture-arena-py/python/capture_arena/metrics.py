"""Prometheus metrics for a sink: the writer's counters, the arena's occupancy, and who holds it.

``register(sink)`` adds a collector to ``prometheus_client``'s registry (when the package is
installed), so the server's existing metrics endpoint shows the arena; each scrape reads the
sink's counters and asks the writer for its per-store table (one pass over its objects).

Names follow Prometheus conventions: counters ``capture_arena_<counter>_total`` (e.g.
``capture_arena_freed_bytes_total``), gauges ``capture_arena_<gauge>`` (e.g.
``capture_arena_free_bytes``), and per trainer store ``capture_arena_store_resident_bytes``,
``capture_arena_store_resident_objects``, ``capture_arena_store_oldest_age_seconds`` labelled
``store_id``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

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
    }
)


class ArenaCollector:
    """A ``prometheus_client`` collector over one sink (anything with ``stats()``; the per-store
    table when it also has ``store_usage()``)."""

    def __init__(self, sink: Any, prefix: str = "capture_arena") -> None:
        self._sink = sink
        self._prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self._prefix
        for name, value in sorted(self._sink.stats().items()):
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
        for row in usage():
            by_bytes.add_metric([row["store_id"]], row["bytes"])
            by_objects.add_metric([row["store_id"]], row["objects"])
            age.add_metric([row["store_id"]], row["oldest_age_s"])
        yield by_bytes
        yield by_objects
        yield age


def register(sink: Any, registry: Any = None) -> Optional[ArenaCollector]:
    """Registers an :class:`ArenaCollector` for ``sink`` with ``registry`` (default:
    ``prometheus_client.REGISTRY``); ``None`` when ``prometheus_client`` is not installed."""
    try:
        import prometheus_client
    except ImportError:
        return None
    collector = ArenaCollector(sink)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector
