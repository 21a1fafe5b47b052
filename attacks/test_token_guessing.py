"""Attack: against a producer with a control token, guess it byte by byte (one connection per
guess), send frees without it, and send frees before it. Must show: no guess frees anything,
every attempt is counted and its connection closed, and the legitimate trainer (which has the
token from the result) still frees."""

from __future__ import annotations

import json
import string

import capture_arena as ca

from _common import connect, legit_free_still_works, publish, wait_stats


def test_guessing_the_token_frees_nothing():
    sink = ca.ArenaSink(arena_bytes="16MiB", wait_s=2.0, control_token="auto")
    try:
        victim = publish(sink, "v")
        token = victim["arena"]["token"]
        frees = json.dumps([f"victim/v/g1/{n}" for n in victim["features"]]) + "\n"
        attempts = 0
        guess = ""
        for _ in range(4):  # the first four characters, every candidate each
            for c in string.hexdigits.lower()[:16]:
                s = connect(victim)
                s.sendall((json.dumps({"token": (guess + c).ljust(len(token), "0")}) + "\n" + frees).encode())
                s.close()
                attempts += 1
            guess += token[len(guess)]  # as if the attacker learnt it: still never complete
        for line in (frees, "\n" + frees, frees + json.dumps({"token": token}) + "\n"):
            s = connect(victim)
            s.sendall(line.encode())
            s.close()
            attempts += 1
        st = wait_stats(sink, lambda st: st["unauthorized_lines"] >= attempts)
        assert st["freed_objects"] == 0 and st["resident_objects"] == len(victim["features"]), st
        assert token not in json.dumps(st)
        legit_free_still_works(sink, victim)
    finally:
        sink.close()
