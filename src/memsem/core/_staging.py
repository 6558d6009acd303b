"""Staging memory for pipelines: reusable, page-aligned, pre-faulted buffers."""
from __future__ import annotations

import threading

import numpy as np


class StagingPool:
    """Reusable, page-aligned, pre-faulted staging buffers (pipelines' slots).

    A fresh buffer pays a page fault per 4 KiB page on first touch (tens of microseconds per MiB
    on a VM), which would land in the first tiles of every pipeline; pooled buffers pay it once
    per runtime. The pool keeps (owns) at most ``limit`` bytes of buffers, free or lent out.
    Thread safe: lending a free buffer and taking back one of the pool's own are one atomic list
    operation each (no lock); only making a buffer, adopting one and ``clear`` take the lock.
    """

    ALIGN = 4096

    def __init__(self, limit: int = 256 << 20) -> None:
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = {}
        #: id of the allocation under each buffer the pool owns -> that allocation (kept alive
        #: here, so its id names it while it is in this dict)
        self._owned: dict[int, np.ndarray] = {}
        self._pooled = 0  # bytes of the buffers the pool owns
        self._lock = threading.Lock()

    def borrow(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` (contents undefined), page aligned and faulted in."""
        lst = self._free.get(nbytes)
        if lst:
            try:
                return lst.pop()  # atomic: one borrower gets each buffer
            except IndexError:
                pass  # taken by another thread meanwhile
        mem = np.empty(nbytes + self.ALIGN, np.uint8)
        skip = (-mem.__array_interface__["data"][0]) % self.ALIGN
        arr = mem[skip:skip + nbytes]
        arr[::self.ALIGN] = 0  # fault every page in now, not during the first copies
        return arr

    def give_back(self, arr: np.ndarray) -> None:
        """Take back a buffer of ``borrow``: kept for the next borrow of its size while the
        pool owns at most ``limit`` bytes, else dropped."""
        base = arr.base
        if base is not None and id(base) in self._owned:
            lst = self._free.get(arr.nbytes)
            if lst is not None:
                lst.append(arr)  # atomic
                return
        with self._lock:
            if base is None or self._pooled + arr.nbytes > self.limit:
                return
            if id(base) not in self._owned:
                self._owned[id(base)] = base
                self._pooled += arr.nbytes
            self._free.setdefault(arr.nbytes, []).append(arr)

    def clear(self) -> None:
        with self._lock:
            self._free = {}
            self._owned = {}
            self._pooled = 0
