"""Liveness of peers: the owners of windows this runtime resolved.

Same node: a pidfd (a recycled pid is never mistaken for the owner), else pid + start time; a
verdict of death is final.

Other nodes: the directory's membership view (``Directory.member``: heartbeats, answered from a
view the directory's own thread keeps current, so a check never waits for the server). The rank
record's **incarnation** tells a stall from a restart: the first record seen pins it; the same
process with the same incarnation is alive (also after it re-claimed its rank following a
directory outage); another process, or the same one with another incarnation (a new runtime),
holds the rank now and the owner known here is dead for good (final). An absent record is
SUSPECT (counted alive: the holder may be re-claiming it) until the directory says GONE; GONE
is a "lost" verdict that is **re-checked**, never remembered: a holder that re-claims its rank
with its incarnation is alive again. Unknown counts as alive, and the transport's own errors
and timeouts then decide.

The **liveness interval** (``LIVENESS_INTERVAL_S``) is memsem's bound on detecting an owner's
death during a stream of small copies: a copy re-checks the owner when the last check is older
than the interval (or when it moved at least ``LIVENESS_CHECK_BYTES``), and blocking waits
re-check it between slices of at most ``WAIT_SLICE_S``. Tests state detection bounds in these
units (checks made, slices waited), never in wall-clock time.
"""
from __future__ import annotations

import functools
import os
import select
import threading
import time
import weakref
from typing import Any, Callable

from memsem import native
from memsem.directory import MemberState
from memsem.directory._base import same_process
from memsem.native import process_alive

#: smaller copies re-check the owner's liveness when the last check is older than this (s)
LIVENESS_INTERVAL_S = 0.05
#: copies of at least this many bytes re-check the owner's liveness after the copy
LIVENESS_CHECK_BYTES = 1 << 18
_INTERVAL_NS = int(LIVENESS_INTERVAL_S * 1e9)
_monotonic_ns = native.lib.memsem_monotonic_ns
#: slice of every blocking wait between liveness checks (seconds)
WAIT_SLICE_S = 0.05


class Peer:
    """One process that owns windows this runtime uses.

    Attributes:
        pid, start, node, rank: the process (rank -1 when unknown).
        checks: how many liveness checks were made (tests count these, not seconds).
        dead: found dead for good (final: its process exited, or another one holds its rank).
        why: what the last failed check found ("" after a check that passed).
        incarnation: the incarnation of the owner's rank record as first seen (other nodes).
    """

    __slots__ = ("pid", "start", "node", "rank", "_fd", "dead", "checks", "_checked", "checked_addr", "_remote",
                 "watchers", "why", "incarnation", "local", "is_self", "__weakref__")

    def __init__(self, pid: int, start: int, node: str, rank: int, remote: Callable[[], Any] | None,
                 local: bool | None = None) -> None:
        self.pid, self.start, self.node, self.rank = pid, start, node, rank
        #: the process runs on this node (``local``: the runtime's node, by default this
        #: process's ``node_id()`` now), and it is this very process (``is_self``)
        self.local = node == native.node_id() if local is None else local
        self.is_self = self.local and pid == os.getpid()
        self._fd = -1
        self.dead = False
        self.why = ""
        self.incarnation: Any = None
        self.checks = 0
        #: the time of the last check (CLOCK_MONOTONIC ns) as a native word: every plan of this
        #: owner reads it (``memsem_plan.checked_addr``), so the owner is checked once per
        #: interval however many of its windows are read, not once per window
        self._checked = native.ffi.new("uint64_t *", _monotonic_ns())
        self.checked_addr = int(native.ffi.cast("uintptr_t", self._checked))
        self._remote = remote
        #: id -> weak reference of objects with a ``close()`` closed when this peer is found dead
        #: (its resolutions, which remove themselves when released: a copy through them after
        #: that re-resolves and meets PeerLostError)
        self.watchers: "dict[int, weakref.ref[Any]]" = {}
        if self.local and not self.is_self:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                fd = -1
            # checked now, as the first check (``alive``): a peer made for a resolution needs
            # no second one at once; a verdict of death is final
            self.checks = 1
            if not process_alive(pid, start):
                if fd >= 0:
                    os.close(fd)
                    fd = -1
                self.dead = True
                self.why = "its process exited"
            self._fd = fd

    def __del__(self) -> None:
        if self._fd >= 0:  # the pidfd is this process's own (STYLE 8: a local thing)
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    @property
    def checked_ns(self) -> int:
        """When this owner was last checked (CLOCK_MONOTONIC ns)."""
        return self._checked[0]

    @property
    def pidfd(self) -> int:
        """The owner's pidfd (readable once it exited; open while this object lives), or -1
        (another node, this process, or no pidfd here): native waiters poll it."""
        return self._fd

    def alive(self) -> bool:
        """Check now (one check; other nodes: from the directory's view, no server round
        trip). True for this very process."""
        if self.dead:
            return False
        if self.is_self:
            return True
        self.checks += 1
        self._checked[0] = _monotonic_ns()
        final = True
        if self._fd >= 0:
            r, _, _ = select.select([self._fd], [], [], 0)
            ok = not r
            why = "its process exited"
        elif self.local:
            ok = process_alive(self.pid, self.start)
            why = "its process exited"
        else:
            ok, why, final = self._judge_remote()
        if ok:
            self.why = ""
            return True
        self.why = why
        if final:
            self.dead = True  # final: every later check says so at once
            for r in list(self.watchers.values()):
                w = r()
                if w is None:
                    continue
                try:
                    w.close()
                except Exception:  # noqa: BLE001 - a watcher's failure must not hide the death
                    pass
        return False

    def alive_recently(self) -> bool:
        """``alive()``, answered from the last check when that was less than
        ``LIVENESS_INTERVAL_S`` ago (through any window of this owner): the bound every copy
        keeps (the owner's death is seen within one interval), without a system call per
        view or lease."""
        if self.dead:
            return False
        if _monotonic_ns() - self._checked[0] < _INTERVAL_NS:
            return True
        return self.alive()

    def _judge_remote(self) -> tuple[bool, str, bool]:
        """``(alive, why not, final)`` from the directory's view of the owner's rank."""
        m = None if self._remote is None else self._remote()
        if m is None or m.state in (MemberState.UNKNOWN, MemberState.SUSPECT):
            return True, "", False
        if m.state is MemberState.GONE:
            return False, m.detail or "its rank record expired", False
        rec = m.record or {}
        inc = (rec.get("incarnation"), rec.get("token"))
        if not same_process(rec, self.pid, self.start, self.node):
            return False, (f"rank {self.rank} is held by another process now (pid {rec.get('pid')} on "
                           f"{rec.get('node')!r}, incarnation {inc[0]}): the owner exited or lost its rank"), True
        if self.incarnation is None:
            self.incarnation = inc
        elif inc != self.incarnation:
            return False, (f"it restarted: rank {self.rank} has incarnation {inc[0]} now, this ref's owner "
                           f"had {self.incarnation[0]}"), True
        return True, "", False

    def lost(self, what: str) -> "Exception":
        """The PeerLostError for this peer (one wording everywhere)."""
        from memsem._errors import PeerLostError

        if self.local:
            return PeerLostError(f"the owner of {what} (pid {self.pid}) is dead")
        why = f": {self.why}" if self.why else ""
        return PeerLostError(f"the owner of {what} (pid {self.pid} on {self.node}, rank {self.rank}) is "
                             f"{'dead' if self.dead else 'lost'}{why}")


class Peers:
    """The peers of one runtime, one object per process (kept while a resolution uses it).

    Args:
        directory: the runtime's directory (other nodes' liveness). node: the runtime's node
            (default ``node_id()`` now): the processes on it are checked through their pids.
    """

    def __init__(self, directory: Any, node: str | None = None) -> None:
        self._directory = directory
        self._node = native.node_id() if node is None else node
        #: (pid, start, node) -> a weak reference to its Peer (removed when the peer goes)
        self._peers: dict[tuple[int, int, str], "weakref.ref[Peer]"] = {}
        self._lock = threading.Lock()

    def get(self, pid: int, start: int, node: str, rank: int = -1, what: Any = None) -> Peer:
        """The peer of this process (made now if no resolution holds it). With ``what`` (a ref
        spec: what the error names), its liveness is checked now: a peer made now on this node
        was checked as it was made, this very process needs none.

        Raises:
            PeerLostError: (``what`` given) it is dead, or lost.
        """
        key = (pid, start, node)
        with self._lock:
            r = self._peers.get(key)
            p = None if r is None else r()
            made = p is None
            if made:
                local = node == self._node
                remote = None
                if not local and rank >= 0:
                    d = self._directory
                    remote = lambda: d.member(rank)  # noqa: E731
                p = Peer(pid, start, node, rank, remote, local)
                self._peers[key] = weakref.ref(p, functools.partial(_forget, self._peers, key))
        if what is not None and (p.dead or not (p.is_self or (made and p.local) or p.alive())):
            raise p.lost(what.label)
        return p

    def alive(self, pid: int, start: int, node: str, rank: int = -1) -> bool:
        return self.get(pid, start, node, rank).alive()

    def reread(self, rank: int, read: Callable[[], Any]) -> Any:
        """A record that was not found, read again while the rank that owns it is SUSPECT
        (its record expired in a directory outage and its holder may be re-claiming it and
        writing its records again): at most ``directory.reclaim_s`` seconds, re-reading every
        ``directory.check_s``. Returns the record, or None (the rank is PRESENT, GONE or
        unknown, or the bound passed). Other errors of ``read`` propagate.
        """
        d = self._directory
        if rank < 0 or d.reclaim_s <= 0:
            return None
        deadline = native.monotonic_ns() + int(d.reclaim_s * 1e9)
        while d.member(rank).state is MemberState.SUSPECT and native.monotonic_ns() < deadline:
            time.sleep(d.check_s)
            rec = read()
            if rec is not None:
                return rec
        return None


def _forget(peers: dict, key: tuple[int, int, str], ref: "weakref.ref[Peer]") -> None:
    if peers.get(key) is ref:  # not a newer peer of the same process
        del peers[key]


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

