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

:class:`SpanningDirectory` is what the ``redis`` and ``ray`` directories share above their
storage: the rank this runtime holds (token, incarnation, the records it refreshes), the
heartbeat and membership thread, a lost rank, name claims with their take-over of a dead holder
of this node, name records, lease members and the liveness of lease holders. Each directory
supplies its atomic steps (``heartbeat``, ``_claim_name_step``, the lease and record calls).
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

from memsem import _args
from memsem._errors import MemsemError, PeerLostError, WindowRetiredError
from memsem.directory._base import Directory, Member, MemberState, RecordCodec, check_entry_key

log = logging.getLogger("memsem.directory")

#: heartbeat TTL when neither ``ttl=`` nor ``MEMSEM_HEARTBEAT_TTL`` says (seconds)
DEFAULT_TTL = 10.0

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


def heartbeat_ttl(ttl: float | None) -> float:
    """The heartbeat TTL in seconds: ``ttl``, else ``MEMSEM_HEARTBEAT_TTL``, else DEFAULT_TTL.

    Raises:
        ValueError: not a positive number of seconds (naming ``ttl`` or the variable).
    """
    if ttl is not None:
        return _args.timeout(ttl, "ttl", positive=True)
    raw = os.environ.get("MEMSEM_HEARTBEAT_TTL", "") or ""
    try:
        value = float(raw) if raw else DEFAULT_TTL
    except ValueError:
        raise ValueError(f"MEMSEM_HEARTBEAT_TTL must be a number of seconds, got {raw!r}") from None
    return _args.timeout(value, "MEMSEM_HEARTBEAT_TTL", positive=True)


def check_job(job: str) -> str:
    """``job`` when it is a valid job name (alphanumeric with ``-`` and ``_``).

    Raises:
        ValueError: naming ``job``.
    """
    if not job.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"job must be alphanumeric (with - or _), got {job!r}")
    return job


#: why the directory refused a lease, by the atomic step's code
_LEASE_REFUSED = {-1: "is not published (or its owner's heartbeat expired)", -2: "is closing: no new leases",
                  -3: "moved to another generation"}


class SpanningDirectory(Directory):
    """The part of a directory of many nodes above its storage (see the module docstring).

    A subclass calls ``_setup`` in its constructor, gives ``_k``/``_get`` their storage through
    ``prefix``, ``_codec`` and ``_get_raw``, and implements ``heartbeat(rank)`` (one beat;
    PeerLostError in an outage), ``_read_ranks``, ``_ping`` and ``_claim_name_step``.

    Attributes:
        incarnation: this runtime's incarnation (None before ``claim_rank``).
        reclaims: how many times the heartbeat re-claimed the rank after its record expired.
        restored: how many of this runtime's records it wrote again after they expired.
        lost_rank: True once another runtime took the rank (this one can publish nothing more).
    """

    holds_leases = True
    #: the directory in messages (``redis://host:6379/0``, ``the ray directory of job 'j'``)
    where: str = ""
    #: the kind in thread names (``redis``, ``ray``)
    kind: str = ""

    def _setup(self, *, job: str, ttl: float | None, timeout: float, secret: bytes | str | None,
               alive: Callable[[dict[str, Any]], bool] | None, where: str) -> None:
        self.job = check_job(job)
        self.ttl = heartbeat_ttl(ttl)
        self.where = where
        self.prefix = f"memsem:{self.job}:"
        self._alive = alive
        self._codec = RecordCodec(secret, self.kind)
        self._views = MemberViews(ttl=self.ttl, timeout=timeout, where=where,
                                  read=lambda ranks: self._read_ranks(ranks), ping=lambda: self._ping(),
                                  start=self._start_thread)
        #: the membership thread's period (re-reads of watched ranks; retries of a failed beat)
        self.check_s = self._views.check_s
        self._beat_s = self._views.beat_s
        #: timeout of the membership thread's calls
        self.member_timeout = self._views.member_timeout
        #: an absent rank is GONE once this directory answered smoothly this long
        self.grace_s = self._views.grace_s
        #: a read of a record whose owner is SUSPECT is retried this long (the re-claim grace,
        #: one heartbeat and one membership timeout)
        self.reclaim_s = self._views.reclaim_s
        self._reserve_s = RESERVE_TTLS * self.ttl
        self._lock = threading.Lock()
        self._mlock = threading.Lock()
        #: records this runtime wrote and refreshes (windows, names, entries): key -> stored value
        self._own: dict[str, str] = {}
        self._rank: int | None = None
        self._rank_value = ""
        self._token = secrets.token_hex(8)
        self.incarnation: int | None = None
        self.reclaims = 0
        self.restored = 0
        self.lost_rank = False
        self._lost_why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- storage, given by the subclass ---------------------------------------------------------
    def _k(self, kind: str, ident: str) -> str:
        return f"{self.prefix}{kind}:{ident}"

    def _get_raw(self, key: str) -> bytes | str | None:
        raise NotImplementedError

    def _get(self, key: str, *, strict: bool = True) -> dict[str, Any] | None:
        """The verified value at ``key`` (``{"v":..., "k":...}``), None when absent."""
        return self._codec.decode(key, self._get_raw(key), strict=strict)

    def _rank_of(self, rank: int, raw: bytes | str | None) -> dict[str, Any] | None:
        """The rank record in a stored value (None: absent, or not a verified rank record)."""
        val = None if not raw else self._codec.decode(self._k("rank", str(rank)), raw, strict=False)
        return val["v"] if val is not None and isinstance(val["v"], dict) else None

    def _read_ranks(self, ranks: list[int]) -> list[dict[str, Any] | None]:
        raise NotImplementedError

    def _own_put(self, values: dict[str, str]) -> None:
        """Records this runtime wrote (key -> stored value): the heartbeat refreshes them."""
        with self._lock:
            self._own.update(values)

    def _own_drop(self, keys: list[str]) -> None:
        """Records this runtime removes: the heartbeat neither refreshes nor writes them again."""
        with self._lock:
            for k in keys:
                self._own.pop(k, None)

    def _ping(self) -> None:
        raise NotImplementedError

    def _delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (absent ones are no error)."""
        raise NotImplementedError

    # -- entries: reads and removals over the storage steps ------------------------------------
    def get_entry(self, key: str) -> dict[str, Any] | None:
        val = self._get(self._k("e", check_entry_key(key)), strict=False)
        return None if val is None else val["v"]

    def remove_entry(self, key: str) -> None:
        rkey = self._k("e", check_entry_key(key))
        self._own_drop([rkey])  # first: the heartbeat writes no removed record again
        self._delete([rkey])

    def heartbeat(self, rank: int) -> None:
        raise NotImplementedError

    @property
    def seals_keys(self) -> bool:  # type: ignore[override]
        """True with a job secret: ``put_window(..., key=)`` stores the access key sealed."""
        return self._codec.signed

    # -- ranks and membership -------------------------------------------------------------------
    def rank_record(self, rank: int) -> dict[str, Any] | None:
        val = self._get(self._k("rank", str(rank)))
        return None if val is None else val["v"]

    def member(self, rank: int) -> Member:
        """The view of ``rank`` (see ``Directory.member``). The first question about a rank
        reads it now (one call, ``member_timeout`` at most); later ones answer from the view
        the membership thread re-reads every ``check_s``. Never raises for an outage: the
        last-known state is kept (UNKNOWN if never read)."""
        return self._views.member(rank)

    def _start_thread(self) -> None:
        with self._mlock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"memsem-{self.kind}-heartbeat-{self.job}")
        self._thread.start()

    def _loop(self) -> None:
        beat_due = time.monotonic() + self._beat_s
        quiet_until = 0.0
        while not self._stop.wait(self.check_s):
            now = time.monotonic()
            rank = self._rank
            if rank is not None and now >= beat_due and not self.lost_rank:
                try:
                    self.heartbeat(rank)
                    beat_due = now + self._beat_s
                except MemsemError as exc:  # an outage: retry soon, never die silently
                    if now >= quiet_until:  # once per TTL, not at every retry
                        log.warning("memsem heartbeat to %s failed (retried every %g s): %s",
                                    self.where, self.check_s, exc)
                        quiet_until = now + self.ttl
                    beat_due = now + self.check_s
            self._views.refresh()

    def _reclaimed(self, rank: int) -> None:
        """Count (and log) a re-claim of ``rank`` by the heartbeat."""
        self.reclaims += 1
        log.warning("memsem rank %d of job %r expired in %s while this runtime lived (a directory outage or "
                    "restart, or a stall past the TTL of %g s): re-claimed, incarnation %s", rank, self.job,
                    self.where, self.ttl, self.incarnation)

    def _lose(self, rank: int) -> None:
        """Another runtime took ``rank``: this runtime can publish nothing more (logged once)."""
        if self.lost_rank:
            return
        try:
            other = self.rank_record(rank)
        except MemsemError:
            other = None
        who = "another runtime" if other is None else \
            f"pid {other.get('pid')} on {other.get('node')!r} (incarnation {other.get('incarnation')})"
        self._lost_why = (f"its rank {rank} of job {self.job!r} expired in {self.where} and {who} "
                          f"took it (this runtime was cut off or stalled longer than the TTL of {self.ttl:g} s "
                          f"and the reservation of {RESERVE_TTLS} TTLs)")
        self.lost_rank = True
        log.error("memsem runtime (incarnation %s): %s; its windows are gone for other nodes and it "
                  "can publish nothing more: create a new Runtime", self.incarnation, self._lost_why)

    def _check_rank(self) -> None:
        if self.lost_rank:
            raise PeerLostError(f"this runtime cannot publish: {self._lost_why}; create a new Runtime")

    # -- windows and names ----------------------------------------------------------------------
    def get_window(self, gva: int) -> dict[str, Any] | None:
        val = self._get(self._k("w", f"{gva:016x}"))
        return None if val is None else val["v"]

    def window_with_key(self, gva: int) -> tuple[dict[str, Any] | None, bytes | None]:
        """``(record, access key)`` of window ``gva`` from one read; the key is None when the
        window is absent, was published without a key, or this directory has no secret."""
        wkey = self._k("w", f"{gva:016x}")
        val = self._get(wkey)
        if val is None:
            return None, None
        return val["v"], self._codec.unseal(wkey, val)

    def _name_value(self, name: str, gva: int, holder: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "gva": f"{gva:016x}", "pid": holder.get("owner_pid", holder.get("pid")),
                "start": holder.get("owner_start", holder.get("start")), "node": holder.get("node", ""),
                "rank": holder.get("rank", self._rank), "token": self._token}

    def _claim_name_step(self, nkey: str, value: str, replace: bool, dead: str) -> str | None:
        """One atomic claim of name key ``nkey`` (see ``claim_name``): None when bound, else the
        stored value of the live holder's record. ``dead``: the value of a record whose holder
        was found dead here ("" for none), replaced exactly."""
        raise NotImplementedError

    def claim_name(self, name: str, gva: int, holder: dict[str, Any], *, replace: bool = False,
                   pause: Callable[[], None] | None = None) -> dict[str, Any] | None:
        """Bind ``name`` to window ``gva`` of ``holder`` (this runtime): atomically, when no
        record holds it, this runtime does, its holder's rank record expired or holds another
        token (its runtime closed or its node died), or ``replace``. Returns None when bound,
        else the live holder's record."""
        nkey = self._k("n", name.encode().hex())
        value = self._codec.encode(nkey, self._name_value(name, gva, holder))
        dead = ""
        held: dict[str, Any] = {"name": name}
        for _ in range(2):
            raw = self._claim_name_step(nkey, value, bool(replace), dead)
            if raw is None:
                self._own_put({nkey: value})
                return None
            val = self._codec.decode(nkey, raw, strict=False)
            held = dict(val["v"]) if val is not None and isinstance(val["v"], dict) else {"name": name}
            # A holder on this node is dead when its process is (its heartbeat may not have
            # expired yet): take over exactly that record, unless it changed meanwhile.
            if self._alive is None or held.get("node") != holder.get("node") or \
                    self._alive({"pid": held.get("pid"), "start": held.get("start"), "node": held.get("node")}):
                return held
            dead = raw
        return held

    def name_record(self, name: str) -> dict[str, Any] | None:
        """The record of ``name`` (``gva`` hex and its holder), or None."""
        val = self._get(self._k("n", name.encode().hex()))
        if val is None:
            return None
        v = val["v"]
        if isinstance(v, str):  # a record of an older memsem: the gva alone
            return {"name": name, "gva": v}
        return v if isinstance(v, dict) and isinstance(v.get("gva"), str) else None

    def lookup(self, name: str) -> int | None:
        rec = self.name_record(name)
        if rec is None:
            return None
        try:
            return int(rec["gva"], 16)
        except ValueError:
            return None

    # -- leases ---------------------------------------------------------------------------------
    @staticmethod
    def _lease_member(holder: dict[str, Any]) -> str:
        """A new lease's member id: ``<lease id>:<node hex>:<pid>:<holder rank>``."""
        return f"{secrets.token_hex(8)}:{str(holder.get('node', '')).encode().hex()}:" \
               f"{int(holder.get('pid', 0))}:{int(holder.get('rank', 0))}"

    @staticmethod
    def _lease_refused(gva: int, rc: int, generation: int) -> WindowRetiredError:
        why = _LEASE_REFUSED.get(int(rc), f"refused the lease ({rc})")
        return WindowRetiredError(f"window gva {gva:#x} {why}", generation=generation)

    def _live_leases(self, rows: list[tuple[str, float, bytes | str | None]]) -> tuple[list[tuple[int, float]], list[str]]:
        """``(live, reap)`` of lease rows ``(member, seconds left, stored rank value or None)``
        read in one step: ``(holder pid, seconds left)`` of leases whose holder counts as live
        (its rank record names it, or it is absent but not yet GONE), and the members to reap."""
        t1 = time.monotonic_ns()
        res, reap = [], []
        for member, left, raw in rows:
            parts = member.split(":")
            try:
                node, pid, rank = bytes.fromhex(parts[1]).decode(), int(parts[2]), int(parts[3])
            except (IndexError, ValueError):
                reap.append(member)  # not a member this directory wrote
                continue
            state, rec, _ = self._views.judge(rank, self._rank_of(rank, raw), t1)
            if state is MemberState.GONE or (state is MemberState.PRESENT and not (
                    isinstance(rec, dict) and rec.get("pid") == pid and rec.get("node") == node)):
                reap.append(member)
                continue
            res.append((pid, float(left)))
        return res, reap


__all__ = ["BEATS_PER_TTL", "CHECKS_PER_TTL", "DEFAULT_TTL", "GRACE_TTLS", "MEMBER_TIMEOUT_TTLS", "RESERVE_TTLS",
           "MemberViews", "SpanningDirectory", "check_job", "heartbeat_ttl"]
