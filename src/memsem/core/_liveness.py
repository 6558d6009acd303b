"""Liveness of peers: the owners of windows this runtime resolved.

Same node: a pidfd (a recycled pid is never mistaken for the owner), else pid + start time.
Other nodes: the directory's liveness (heartbeats); unknown counts as alive, and the transport's
own errors and timeouts then decide. A verdict of death is final.

The **liveness interval** (``LIVENESS_INTERVAL_S``) is memsem's bound on detecting an owner's
death during a stream of small copies: a copy re-checks the owner when the last check is older
than the interval (or when it moved at least ``LIVENESS_CHECK_BYTES``), and blocking waits
re-check it between slices of at most ``WAIT_SLICE_S``. Tests state detection bounds in these
units (checks made, slices waited), never in wall-clock time.
"""
from __future__ import annotations

import os
import select
import threading
import weakref
from typing import Any, Callable

from memsem import native
from memsem.native import process_alive

#: smaller copies re-check the owner's liveness when the last check is older than this (s)
LIVENESS_INTERVAL_S = 0.05
#: copies of at least this many bytes re-check the owner's liveness after the copy
LIVENESS_CHECK_BYTES = 1 << 18
#: slice of every blocking wait between liveness checks (seconds)
WAIT_SLICE_S = 0.05


class Peer:
    """One process that owns windows this runtime uses.

    Attributes:
        pid, start, node, rank: the process (rank -1 when unknown).
        checks: how many liveness checks were made (tests count these, not seconds).
    """

    __slots__ = ("pid", "start", "node", "rank", "_fd", "dead", "checks", "checked_ns", "_remote",
                 "watchers", "__weakref__")

    def __init__(self, pid: int, start: int, node: str, rank: int,
                 remote: Callable[[], bool | None] | None) -> None:
        self.pid, self.start, self.node, self.rank = pid, start, node, rank
        self._fd = -1
        self.dead = False
        self.checks = 0
        self.checked_ns = native.monotonic_ns()
        self._remote = remote
        #: objects with a ``close()`` closed when this peer is found dead (its resolutions: a
        #: copy through them after that re-resolves and meets PeerLostError)
        self.watchers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        if node == native.node_id() and pid != os.getpid():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                fd = -1
            if fd >= 0 and not process_alive(pid, start):
                os.close(fd)
                fd = -1
            self._fd = fd
            if fd >= 0:
                weakref.finalize(self, os.close, fd)

    @property
    def pidfd(self) -> int:
        """The owner's pidfd (readable once it exited; open while this object lives), or -1
        (another node, this process, or no pidfd here): native waiters poll it."""
        return self._fd

    @property
    def is_self(self) -> bool:
        return self.pid == os.getpid() and self.node == native.node_id()

    def alive(self) -> bool:
        """Check now (one check). True for this very process."""
        if self.dead:
            return False
        if self.is_self:
            return True
        self.checks += 1
        self.checked_ns = native.monotonic_ns()
        if self._fd >= 0:
            r, _, _ = select.select([self._fd], [], [], 0)
            ok = not r
        elif self.node == native.node_id():
            ok = process_alive(self.pid, self.start)
        else:
            verdict = None if self._remote is None else self._remote()
            ok = verdict is None or bool(verdict)
        if not ok:
            self.dead = True  # final: every later check says so at once
            for w in list(self.watchers):
                try:
                    w.close()
                except Exception:  # noqa: BLE001 - a watcher's failure must not hide the death
                    pass
        return ok

    def lost(self, what: str) -> "Exception":
        """The PeerLostError for this peer (one wording everywhere)."""
        from memsem._errors import PeerLostError

        where = "" if self.node == native.node_id() else f" on {self.node}"
        return PeerLostError(f"the owner of {what} (pid {self.pid}{where}) is dead")


class Peers:
    """The peers of one runtime, one object per process (kept while a resolution uses it)."""

    def __init__(self, directory: Any) -> None:
        self._directory = directory
        self._peers: "weakref.WeakValueDictionary[tuple[int, int, str], Peer]" = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, pid: int, start: int, node: str, rank: int = -1) -> Peer:
        key = (pid, start, node)
        with self._lock:
            p = self._peers.get(key)
            if p is None:
                remote = None
                if node != native.node_id() and rank >= 0:
                    d = self._directory
                    remote = lambda: d.owner_alive(rank, pid, start, node)  # noqa: E731
                p = Peer(pid, start, node, rank, remote)
                self._peers[key] = p
            return p

    def alive(self, pid: int, start: int, node: str, rank: int = -1) -> bool:
        return self.get(pid, start, node, rank).alive()


def record_alive(rec: dict[str, Any]) -> bool:
    """Liveness of a rank record's process for the directories' reaping (other nodes: True; their
    heartbeats decide)."""
    node = rec.get("node")
    if node is not None and node != native.node_id():
        return True
    try:
        pid = int(rec.get("pid", 0))
        start = int(rec.get("start", 0))
    except (TypeError, ValueError):
        return False
    if pid == -1:
        return True
    return process_alive(pid, start)

