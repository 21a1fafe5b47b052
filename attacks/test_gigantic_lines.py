"""Attack: peers send lines of several MiB without a newline, from many connections at once.
Must show: each is closed at the 1 MiB line limit (oversized_lines), the producer's memory grows
by a bounded amount (the shared pool, 16 MiB by default), and frees from others still apply."""

from __future__ import annotations

import threading

from _common import connect, legit_free_still_works, publish, rss_bytes, wait_stats


def test_many_giant_lines_are_cut_off_and_memory_stays_bounded(sink):
    victim = publish(sink, "v")
    before = rss_bytes()
    chunk = b"[" + b'"a",' * (64 * 1024)  # 256 KiB of an unfinished array

    def flood() -> None:
        s = connect(victim)
        try:
            for _ in range(12):  # 3 MiB without a newline
                s.sendall(chunk)
        except OSError:
            pass  # closed on us: what must happen
        finally:
            s.close()

    threads = [threading.Thread(target=flood) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = wait_stats(sink, lambda st: st["oversized_lines"] >= 1)
    grew = rss_bytes() - before
    assert grew < 64 << 20, f"RSS grew by {grew} bytes"
    assert st["freed_objects"] == 0 and st["resident_objects"] == len(victim["features"])
    legit_free_still_works(sink, victim)
