"""Attack: frees of a sample's keys racing the producer's retries of that same sample
(`"replace": true`), from several connections at once, while its size changes so that each
retry lands somewhere else. Must show: every retry is published whole or fails whole (never
half); the books balance (every published object is freed, replaced or resident, and none is
counted twice); at the end a prefix free leaves the arena completely free; and a sample that no
free touched reads back exactly what was published."""

from __future__ import annotations

import json
import threading

import ml_dtypes
import numpy as np

from _common import connect, publish, spec, wait_stats

import capture_arena as ca


def test_frees_racing_replace_keep_the_books(sink: ca.ArenaSink) -> None:
    first = publish(sink, "raced")
    keys = [f"victim/raced/g1/{name}" for name in first["features"]]
    line = (json.dumps(keys) + "\n").encode()
    stop = threading.Event()
    sent = [0] * 4

    def hammer(i: int) -> None:
        s = connect(first)
        try:
            while not stop.is_set():
                s.sendall(line * 16)
                sent[i] += 16
        finally:
            s.close()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    published = failed = 0
    try:
        for n in range(300):
            # Sizes change, so retries land at other addresses; every 10th needs 20 MiB, more
            # than the whole arena (16 MiB), and must fail whole.
            L = 1 << 19 if n % 10 == 9 else 4 + n % 29
            sp = spec("raced", L)
            sp["replace"] = True
            aux = np.full((L, 12), n % 7, dtype=ml_dtypes.bfloat16)
            r = sink.put_sample(sp, aux=aux, last_hidden=np.ones((L, 4), dtype=ml_dtypes.bfloat16))
            if "error" in r:  # a sink never raises for a sample: the row says it failed
                assert set(r) == {"sample_id", "error"} and "whole arena holds" in r["error"], r
                assert L == 1 << 19, r
                failed += 1
            else:
                assert set(r["features"]) == set(first["features"])  # whole
                published += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    print(f"published {published}, failed {failed}, sent {sum(sent)} free lines")
    assert published + failed == 300 and (published, failed) == (270, 30)
    # Everything that is left goes; then the books must balance exactly. A connection's lines are
    # applied in order, so the stats answer after the prefix line says it was applied (the
    # hammers' frees may empty the arena first; a sample published before the prefix is
    # applied would go with it).
    s = connect(first)
    s.sendall((json.dumps({"free_prefix": "victim/"}) + "\n" + json.dumps({"stats": True}) + "\n").encode())
    answer = s.makefile("rb").readline()
    s.close()
    assert b"resident_objects" in answer, answer
    st = wait_stats(sink, lambda st: st["resident_objects"] == 0)
    st = wait_stats(sink, lambda st: st["free_bytes"] == st["capacity"])
    n_features = len(first["features"])
    assert st["published_objects"] == (1 + published) * n_features, st
    assert st["published_objects"] == st["freed_objects"] + st["replaced_objects"] + st["expired_objects"], st
    assert st["failed_batches"] == failed, st
    print({k: st[k] for k in ("published_objects", "freed_objects", "replaced_objects", "unknown_frees")})
    assert sum(sent) > 0 and st["unknown_frees"] > 0, st  # most frees found nothing to free

    # A sample nobody raced still reads back exactly.
    calm = publish(sink, "calm", L=16)
    got = ca.ArenaFeatureStore().get(calm)
    assert got["input_ids"].tolist() == [list(range(16))]
