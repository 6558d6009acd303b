"""Staging memory for pipelines: reusable, page-aligned, pre-faulted buffers."""
from __future__ import annotations

import threading

import numpy as np


class StagingPool:
    """Reusable, page-aligned, pre-faulted staging buffers (pipelines' slots).

    A fresh buffer pays a page fault per 4 KiB page on first touch (tens of microseconds per MiB
    on a VM), which would land in the first tiles of every pipeline; pooled buffers pay it once
    per runtime. At most ``limit`` bytes stay pooled. Thread safe.
    """

    ALIGN = 4096

    def __init__(self, limit: int = 256 << 20) -> None:
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = {}
        self._pooled = 0
        self._lock = threading.Lock()

    def borrow(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` (contents undefined), page aligned and faulted in."""
        with self._lock:
            lst = self._free.get(nbytes)
            if lst:
                self._pooled -= nbytes
                return lst.pop()
        mem = np.empty(nbytes + self.ALIGN, np.uint8)
        skip = (-mem.__array_interface__["data"][0]) % self.ALIGN
        arr = mem[skip:skip + nbytes]
        arr[::self.ALIGN] = 0  # fault every page in now, not during the first copies
        return arr

    def give_back(self, arr: np.ndarray) -> None:
        with self._lock:
            if self._pooled + arr.nbytes <= self.limit:
                self._free.setdefault(arr.nbytes, []).append(arr)
                self._pooled += arr.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._pooled = 0
