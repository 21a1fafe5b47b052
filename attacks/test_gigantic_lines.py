"""Attack: peers send lines of several MiB without a newline, from many connections at once; and
many peers hold unfinished lines just under the limit.
Must show: each line over 1 MiB closes its connection (``oversized_lines``, and the peer reads the
close); unfinished lines are held within the shared pool (16 MiB by default, plus 4 KiB per
connection and one line that may always finish), however many peers send; frees from others
still apply."""

from __future__ import annotations

import socket
import threading
import time

from _common import connect, legit_free_still_works, publish, rss_bytes, wait_stats

MIB = 1 << 20


def settled(sink, key: str, quiet_s: float = 1.0, timeout_s: float = 60.0) -> dict[str, int]:
    """The stats once ``key`` has not changed for ``quiet_s`` (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    last, since = sink.stats(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = sink.stats()
        if now[key] != last[key]:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"{key} never settled: {last[key]}")


def test_each_line_over_the_limit_closes_its_connection(sink):
    victim = publish(sink, "v")
    chunk = b"[" + b'"a",' * (64 * 1024)  # 256 KiB of an unfinished array
    closed: list[str] = []

    def flood() -> None:
        s = connect(victim)
        s.settimeout(10)
        try:
            for _ in range(12):  # 3 MiB without a newline
                s.sendall(chunk)
        except OSError:
            pass  # closed on us while sending: what must happen
        try:
            while s.recv(65536):  # to the end: the server must close it
                pass
            closed.append("eof")
        except ConnectionResetError:  # closed with our bytes unread: a reset
            closed.append("reset")
        except socket.timeout:
            closed.append("still open after 10 s")
        finally:
            s.close()

    threads = [threading.Thread(target=flood) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c in ("eof", "reset") for c in closed) and len(closed) == 10, closed
    st = wait_stats(sink, lambda st: st["oversized_lines"] == 10)
    assert st["freed_objects"] == 0 and st["resident_objects"] == len(victim["features"])
    legit_free_still_works(sink, victim)


def test_unfinished_lines_of_many_peers_are_held_within_the_pool(sink):
    """100 peers with 900 KiB each of an unfinished line (under the limit, so none is closed):
    buffering them all would hold 88 MiB; the producer holds at most its pool."""
    victim = publish(sink, "w")
    before = rss_bytes()
    line = b'["' + b"a" * (900 * 1024)
    peers = [connect(victim) for _ in range(100)]

    def send(s: socket.socket) -> None:
        s.settimeout(2)
        try:
            s.sendall(line)
        except OSError:
            pass  # the producer stopped reading this one: TCP pushes back, as it must

    threads = [threading.Thread(target=send, args=(s,)) for s in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool, per_conn, one_line = 16 * MIB, 4 * 1024, MIB + 1
    bound = pool + len(peers) * per_conn + one_line
    # The producer reads until it holds all it may (the pool fills first), then stops: wait for
    # its buffered bytes to stop moving; buffering everything would end at 88 MiB instead.
    wait_stats(sink, lambda st: st["control_buffered_bytes"] >= pool)
    st = settled(sink, "control_buffered_bytes")
    assert st["control_buffered_bytes"] <= bound, (st["control_buffered_bytes"], bound)
    assert st["oversized_lines"] == 0 and st["open_connections"] >= len(peers)
    grew = rss_bytes() - before
    assert grew < 2 * bound, f"RSS grew by {grew} bytes, the pool's bound is {bound}"
    legit_free_still_works(sink, victim)  # others' frees still apply meanwhile
    for s in peers:
        s.close()
