"""Attack: keys with path tricks, control characters, Unicode look-alikes and extreme lengths,
and prefixes that try to reach past their store. Must show: no such line frees anything but the
exact keys it names (unknown keys are counted), and the producer is unharmed."""

from __future__ import annotations

import json

from _common import connect, legit_free_still_works, publish, wait_stats


def test_tricky_keys_free_nothing(sink):
    victim = publish(sink, "v")
    keys = [
        "../victim/v/g1/target",
        "victim/v/g1/../g1/target",
        "victim/v/g1/target/",
        "victim//v/g1/target",
        "victim/v/g1/target\n",
        "victim/v/g1/target\u0000",
        "victim/v/g1/ta\u0072get\u200b",
        "VICTIM/v/g1/target",
        "victim/v/g01/target",
        "victim/v/g1/" + "x" * 5000,
        "*",
        "victim/*",
    ]
    prefixes = ["", "/", "victim", "vic/", "victim/v", "victim/v/g0/", "victim/v/g1/target/", "../"]
    s = connect(victim)
    s.sendall((json.dumps(keys) + "\n").encode())
    for p in prefixes:
        s.sendall((json.dumps({"free_prefix": p}) + "\n").encode())
    # A prefix of another store that merely starts with the same letters.
    s.sendall((json.dumps({"free_prefix": "vict/"}) + "\n").encode())
    s.close()
    st = wait_stats(sink, lambda st: st["unknown_frees"] >= len(keys))
    assert st["freed_objects"] == 0 and st["resident_objects"] == len(victim["features"]), st
    legit_free_still_works(sink, victim)
