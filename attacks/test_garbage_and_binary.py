"""Attack: a peer writes random bytes, invalid UTF-8, NULs and JSON of every wrong shape to the
control port. Must show: every such line is counted as bad (or closes its connection), nothing
resident is freed, the producer publishes on, and a trainer's free still applies."""

from __future__ import annotations

import json
import os

from _common import connect, legit_free_still_works, publish, wait_stats


def test_random_bytes_and_wrong_json_free_nothing(sink):
    victim = publish(sink, "v")
    wrong = [
        b"\x00\x01\x02\xff\xfe\n",
        b'{"keys": ["victim/v/g1/target"]}\n',
        b'["victim/v/g1/target"\n',
        b"[1, 2, 3]\n",
        b'[["victim/v/g1/target"]]\n',
        b'"victim/v/g1/target"\n',
        b"null\n",
        b'[{"$ne": null}]\n',
        json.dumps({"token": "x" * 32}).encode() + b"\n",
        b'{"free_prefix": "victim"}\n',
        b'{"free_prefix": "../victim/"}\n',
        "[\"victim/v/g1/target\u0000\"]\n".encode(),
        b"[\"\\ud800\"]\n",
    ]
    s = connect(victim)
    for line in wrong:
        s.sendall(line)
    for _ in range(64):  # 64 KiB of noise with newlines scattered through it
        s.sendall(os.urandom(1024) + b"\n")
    s.close()
    st = wait_stats(sink, lambda st: st["bad_lines"] + st["unknown_frees"] >= len(wrong) - 2)
    assert st["freed_objects"] == 0, st
    assert st["resident_objects"] == len(victim["features"])
    # The producer publishes on and a trainer's free applies.
    later = publish(sink, "later")
    legit_free_still_works(sink, victim)
    legit_free_still_works(sink, later)
