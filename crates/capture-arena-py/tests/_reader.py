"""Child-process side of the cross-process tests (a separate module so `spawn` can import it)."""

from __future__ import annotations

from typing import Any

import numpy as np

import capture_arena as ca


def read_all(results: list[dict[str, Any]]) -> list[dict[str, bytes]]:
    """Reads every feature of every result as raw bytes, then releases each result."""
    store = ca.ArenaFeatureStore()
    out = []
    for r in results:
        got = store.get(r)
        out.append({name: np.ascontiguousarray(a).view(np.uint8).tobytes() for name, a in got.items()})
        shapes_ok = all(list(got[n].shape) == r["features"][n]["shape"] for n in got)
        dtypes_ok = all(got[n].dtype.name == r["features"][n]["dtype"] for n in got)
        assert shapes_ok and dtypes_ok, (r, {n: (a.shape, a.dtype) for n, a in got.items()})
        store.release(r)
        try:
            store.get(r)
        except KeyError:
            pass
        else:
            raise AssertionError("get after release must raise KeyError")
    store.flush(10)  # the frees go out from a sender thread: wait for them
    assert store.health()["pending_frees"] == 0
    return out
