"""Fresh outputs for transports that register destination memory (NIXL, a TransferEngine): arrays
carved from a few large :class:`ReadBuffer` slabs, each registered once, instead of a new array
registered for every read (about 30 ms per 100 MiB with NIXL).

An array handed out owns its range through the object its memory comes from (numpy's ``base``):
when the array and every view of it are gone, the range goes back to the pool. The slabs stay
(``SGLANG_SPEC_CAPTURE_READ_POOL_BYTES`` in all, 4 GiB by default; ``0`` turns the pool off); a
read that finds no room gets a plain array, registered for that read as before.
"""

from __future__ import annotations

import bisect
import collections
import os
import threading
from typing import Any, Optional

import numpy as np

from ._capture_arena import ReadBuffer

SLAB_BYTES = 256 << 20
ALIGN = 64


def _limit() -> int:
    raw = os.environ.get("SGLANG_SPEC_CAPTURE_READ_POOL_BYTES", "").strip()
    if not raw:
        return 4 << 30
    from ._capture_arena import _parse_bytes

    return int(_parse_bytes("SGLANG_SPEC_CAPTURE_READ_POOL_BYTES", raw))


class _Slab:
    __slots__ = ("buf", "addr", "size", "free")

    def __init__(self, size: int) -> None:
        self.buf = ReadBuffer(size)
        self.addr = int(np.asarray(self.buf).ctypes.data)
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, length), by offset


class _Lease:
    """Owns ``[off, off + n)`` of a slab while an array made from it lives."""

    __slots__ = ("pool", "slab", "off", "n", "__array_interface__")

    def __init__(self, pool: "OutputPool", slab: _Slab, off: int, n: int) -> None:
        self.pool, self.slab, self.off, self.n = pool, slab, off, n
        self.__array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (slab.addr + off, False), "version": 3}

    def __del__(self) -> None:
        # Queued, not freed here: this may run inside the pool's own lock (a garbage collection
        # during an allocation), so the pool takes returns back when it next hands out or counts.
        self.pool._returned.append((self.slab, self.off, self.n))


class OutputPool:
    """See the module docs. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        self._limit: Optional[int] = None
        self._returned: "collections.deque[tuple[_Slab, int, int]]" = collections.deque()

    def bytes_u8(self, n: int) -> Optional[np.ndarray[Any, Any]]:
        """``n`` fresh bytes (a uint8 array) inside a registered slab, or None without room."""
        if n <= 0:
            return None
        need = (n + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            self._take_back()
            if self._limit is None:
                self._limit = _limit()
            for slab in self._slabs:
                off = self._take(slab, need)
                if off is not None:
                    return np.asarray(_Lease(self, slab, off, need))[:n]
            size = max(SLAB_BYTES, need)
            if sum(s.size for s in self._slabs) + size > self._limit:
                return None
            slab = _Slab(size)
            self._slabs.append(slab)
            off = self._take(slab, need)
            assert off == 0
            return np.asarray(_Lease(self, slab, 0, need))[:n]

    @staticmethod
    def _take(slab: _Slab, need: int) -> Optional[int]:
        for i, (off, length) in enumerate(slab.free):
            if length >= need:
                if length == need:
                    del slab.free[i]
                else:
                    slab.free[i] = (off + need, length - need)
                return off
        return None

    def _take_back(self) -> None:
        """Puts returned ranges back in their slabs' free lists (the lock held)."""
        while True:
            try:
                slab, off, n = self._returned.popleft()
            except IndexError:
                return
            free = slab.free
            i = bisect.bisect_left(free, (off, 0))
            free.insert(i, (off, n))
            # Coalesce with the neighbours.
            if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
                free[i] = (free[i][0], free[i][1] + free[i + 1][1])
                del free[i + 1]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
                free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
                del free[i]

    def slab_of(self, addr: int, n: int) -> Optional[tuple[int, int]]:
        """``(address, size)`` of the slab holding ``[addr, addr + n)``, if any."""
        with self._lock:
            for s in self._slabs:
                if s.addr <= addr and addr + n <= s.addr + s.size:
                    return s.addr, s.size
        return None

    def stats(self) -> dict[str, int]:
        """Slabs, their bytes, and the bytes free in them."""
        with self._lock:
            self._take_back()
            return {
                "slabs": len(self._slabs),
                "bytes": sum(s.size for s in self._slabs),
                "free_bytes": sum(n for s in self._slabs for _, n in s.free),
                "registrations": sum(s.buf.registrations for s in self._slabs),
            }


    def _after_fork_in_child(self) -> None:
        """A forked child starts with an empty pool and a new lock: the fork may have come while
        another thread held the lock (a slab being made), which nobody would release here."""
        self._lock = threading.Lock()
        self._slabs = []
        self._returned = collections.deque()
        self._limit = None


POOL = OutputPool()
os.register_at_fork(after_in_child=POOL._after_fork_in_child)


def fresh(shape: list[int], dtype: str, torch: bool) -> Optional[tuple[Any, np.ndarray[Any, Any]]]:
    """A fresh host output of ``shape`` and ``dtype`` from the pool (numpy, or a CPU torch tensor
    sharing the memory) and its uint8 view; None without room."""
    from ._tensors import numpy_dtype

    dt = numpy_dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    u8 = POOL.bytes_u8(n)
    if u8 is None:
        return None
    arr: Any
    if torch:
        import torch as t

        arr = t.from_numpy(u8).view(getattr(t, dtype)).reshape(shape)
    else:
        arr = u8.view(dt).reshape(shape)
    return arr, u8
