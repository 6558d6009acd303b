"""Membership of directories that span nodes: the one view of ranks held by other nodes.

A directory outage is a bounded delay, never a death (docs/many-nodes.md, "Membership"): an
absent rank record is believed (GONE) only once the directory has answered smoothly for
``GRACE_TTLS`` TTLs since its last failed, slow or missed call as seen here, so every live holder
had the time to re-claim its rank; until then it is SUSPECT (counted alive). Liveness questions
(``member``) never wait for the server: the directory's own thread re-reads the watched ranks
every ``ttl / CHECKS_PER_TTL`` (``refresh``) and answers come from that view.

The directory gives the view two things: ``read(ranks)`` (the decoded rank records, None where
absent; raises PeerLostError in an outage) and ``ping()``; and it reports each of its own calls
to ``observe`` (failed or slow calls, and gaps with no call, end the smooth run).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from memsem._errors import PeerLostError
from memsem.directory._base import Member, MemberState

#: heartbeats per TTL: the rank record and this runtime's records are refreshed every TTL / 3
BEATS_PER_TTL = 3
#: watched ranks are re-read every TTL / CHECKS_PER_TTL; a failed heartbeat is retried then too
CHECKS_PER_TTL = 10
#: an absent rank record is believed (GONE) once the directory answered smoothly this many TTLs
#: since its last outage seen here: the re-claim grace
GRACE_TTLS = 1.0
#: a rank stays reserved for its holder this many TTLs after its last heartbeat
RESERVE_TTLS = 10
#: timeout of the membership thread's calls (heartbeats, rank reads), in TTLs (at most the
#: directory's own timeout); a call slower than half of it counts as an outage
MEMBER_TIMEOUT_TTLS = 0.25
#: a watched rank nobody asked about for this many TTLs is no longer re-read
FORGET_TTLS = 10


class _View:
    """The view of one watched rank."""

    __slots__ = ("state", "record", "read_ns", "asked_ns", "detail")

    def __init__(self, now: int) -> None:
        self.state = MemberState.UNKNOWN
        self.record: dict[str, Any] | None = None
        self.read_ns = 0
        self.asked_ns = now
        self.detail = "not read yet"


class MemberViews:
    """The membership view of one directory (thread-safe).

    Args:
        ttl: the directory's heartbeat TTL, seconds.
        timeout: the directory's call timeout, seconds (``member_timeout`` is at most this).
        where: the directory, for messages (``"redis://host:6379/0"``, ``"ray"``).
        read: ``read(ranks) -> [record or None, ...]``, one call (raises PeerLostError).
        ping: one cheap call (raises PeerLostError), made when no rank is watched.
        start: called once when the first rank is asked about (the directory's thread).

    Attributes:
        check_s: period of ``refresh`` (and of a failed heartbeat's retries), seconds.
        member_timeout: timeout of the membership thread's calls, seconds.
        grace_s: an absent rank is GONE once the directory answered smoothly this long.
        reclaim_s: a read of a record whose owner is SUSPECT is retried this long.
    """

    def __init__(self, *, ttl: float, timeout: float, where: str, read: Callable[[list[int]], list[Any]],
                 ping: Callable[[], Any], start: Callable[[], None]) -> None:
        self.ttl = ttl
        self.where = where
        self.check_s = ttl / CHECKS_PER_TTL
        self.beat_s = ttl / BEATS_PER_TTL
        self.member_timeout = min(timeout, ttl * MEMBER_TIMEOUT_TTLS)
        self.grace_s = GRACE_TTLS * ttl
        self.reclaim_s = self.grace_s + self.beat_s + self.member_timeout
        self._read, self._ping, self._start = read, ping, start
        self._lock = threading.Lock()
        self._views: dict[int, _View] = {}
        now = time.monotonic_ns()
        self._smooth_since: int | None = now  # the directory answered when it was opened
        self._last_ok_ns = now

    def member(self, rank: int) -> Member:
        """The view of ``rank``: the first question reads it now (one call, at most
        ``member_timeout``); later ones answer from the view ``refresh`` keeps. Never raises
        for an outage: the last-known state is kept (UNKNOWN if never read)."""
        now = time.monotonic_ns()
        with self._lock:
            v = self._views.get(rank)
            first = v is None
            if v is None:
                v = self._views[rank] = _View(now)
            v.asked_ns = now
        if first:
            self._start()
            self._read_ranks([rank])
        with self._lock:
            age = (time.monotonic_ns() - v.read_ns) / 1e9 if v.read_ns else float("inf")
            return Member(v.state, v.record, age, v.detail)

    def observe(self, t0: int, t1: int, ok: bool) -> None:
        """Account one call to the directory (monotonic ns): a failed or slow call, or a gap
        with no call (this process or its thread stalled), is an outage: absences are believed
        again only after ``grace_s`` of smooth answers."""
        with self._lock:
            if not ok:
                self._smooth_since = None
                return
            gap = t0 - self._last_ok_ns > (3 * self.check_s + self.member_timeout) * 1e9
            if (t1 - t0) > self.member_timeout * 5e8 or gap:
                self._smooth_since = t1
            elif self._smooth_since is None:
                self._smooth_since = t0
            self._last_ok_ns = max(self._last_ok_ns, t1)

    def judge(self, rank: int, record: dict[str, Any] | None, t1: int) -> tuple[MemberState, dict[str, Any] | None, str]:
        """The state of ``rank`` from its record (None: absent) read at ``t1``: the one rule."""
        if isinstance(record, dict):
            return MemberState.PRESENT, record, ""
        with self._lock:
            smooth = self._smooth_since
        if smooth is not None and t1 - smooth >= self.grace_s * 1e9:
            return MemberState.GONE, None, (
                f"its rank {rank} record expired (no heartbeat for the TTL of {self.ttl:g} s) and was not "
                f"re-claimed while {self.where} answered for {self.grace_s:g} s")
        return MemberState.SUSPECT, None, (
            f"its rank {rank} record is absent since a directory outage; it may still re-claim it")

    def _read_ranks(self, ranks: list[int]) -> None:
        try:
            recs = self._read(ranks)
        except PeerLostError:
            return  # an outage leaves the views as they were
        t1 = time.monotonic_ns()
        for rank, rec in zip(ranks, recs):
            state, rec, detail = self.judge(rank, rec, t1)
            with self._lock:
                v = self._views.get(rank)
                if v is not None:
                    v.state, v.record, v.read_ns, v.detail = state, rec, t1, detail

    def refresh(self) -> None:
        """Re-read the watched ranks (``ping`` when none: smoothness needs regular calls);
        forget ranks nobody asked about for ``FORGET_TTLS`` TTLs."""
        now = time.monotonic_ns()
        with self._lock:
            for r in [r for r, v in self._views.items() if now - v.asked_ns > FORGET_TTLS * self.ttl * 1e9]:
                del self._views[r]
            ranks = list(self._views)
        if ranks:
            self._read_ranks(ranks)
        else:
            try:
                self._ping()
            except PeerLostError:
                pass


__all__ = ["BEATS_PER_TTL", "CHECKS_PER_TTL", "GRACE_TTLS", "MEMBER_TIMEOUT_TTLS", "RESERVE_TTLS", "MemberViews"]
