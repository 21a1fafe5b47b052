"""Attack: 10,000 connection attempts, some held open idle, some closed at once. Must show: at
most the connection limit is served at a time (the rest are counted as refused), the producer
publishes on, and a trainer's free still applies promptly."""

from __future__ import annotations

import socket
import time

from _common import address, legit_free_still_works, publish, wait_stats


def test_ten_thousand_connections(sink):
    victim = publish(sink, "v")
    host, port = address(victim)
    held: list[socket.socket] = []
    refused = 0
    for i in range(10_000):
        try:
            s = socket.create_connection((host, port), timeout=5)
        except OSError:
            refused += 1
            continue
        if i % 10 == 0 and len(held) < 900:
            held.append(s)  # idle, never writes
        else:
            s.close()
    st = wait_stats(sink, lambda st: st["control_connections"] >= 9_000)
    t0 = time.monotonic()
    later = publish(sink, "later")
    legit_free_still_works(sink, victim)
    legit_free_still_works(sink, later)
    assert time.monotonic() - t0 < 10
    for s in held:
        s.close()
    assert st["freed_objects"] == 0
