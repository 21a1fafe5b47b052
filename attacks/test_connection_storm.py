"""Attack: 10,000 connection attempts, some held open idle, some closed at once, against a producer
whose connection limit (``SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS``) is 200. Must show: at most the
limit is served at a time and exactly the connections past it are counted as refused (each
closed at once), the producer publishes on, and a trainer's free still applies once a slot is
free."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

import capture_arena as ca
from _common import address, legit_free_still_works, publish, wait_stats

LIMIT = 200


@pytest.fixture
def limited(monkeypatch: pytest.MonkeyPatch) -> Iterator[ca.ArenaSink]:
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS", str(LIMIT))
    s = ca.ArenaSink(arena_bytes="16MiB", wait_s=2.0)
    yield s
    s.close()


def closed_by_peer(s: socket.socket) -> bool:
    """True when the producer closed `s` (EOF or a reset; an open socket times out: False)."""
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_ten_thousand_connections_past_the_limit(limited):
    sink = limited
    victim = publish(sink, "v")
    host, port = address(victim)
    # Churn: 10,000 connections opened and closed at once.
    for _ in range(10_000):
        socket.create_connection((host, port), timeout=5).close()
    wait_stats(sink, lambda st: st["control_connections"] >= 10_000 and st["open_connections"] == 0)
    # Held: 250 idle connections, 50 past the limit.
    held = [socket.create_connection((host, port), timeout=5) for _ in range(LIMIT + 50)]
    st = wait_stats(sink, lambda st: st["refused_connections"] == 50)
    assert st["open_connections"] == LIMIT, st
    # The ones past the limit are closed at once; the others are served (left open).
    assert sum(closed_by_peer(s) for s in held[LIMIT:]) == 50
    later = publish(sink, "later")  # publication goes on with the slots taken
    assert "error" not in later, later
    # With slots taken, a trainer waits for one: closing some idle peers lets its frees in.
    for s in held[:LIMIT]:
        s.close()
    wait_stats(sink, lambda st: st["open_connections"] == 0)
    legit_free_still_works(sink, victim)
    legit_free_still_works(sink, later)
    st = sink.stats()
    assert st["refused_connections"] == 50 and st["freed_objects"] == 2 * len(victim["features"]), st
