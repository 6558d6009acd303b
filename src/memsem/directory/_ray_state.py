"""The state of the ``ray`` directory, held by its actor (plain Python: no Ray here).

One object per job, in one process (the directory actor); every method is one atomic step, as a
Lua script is in Redis: the actor runs its methods one at a time on one event loop, and none of
them awaits in the middle except ``wait_watch``, which touches no record. Expiry uses the
actor's own monotonic clock, one clock for the whole job (like the Redis server's ``TIME``), so
no node's clock skew ever decides a TTL.

Keys are the ``redis`` directory's (``memsem:<job>:rank:<r>``, ``w:``, ``n:``, ``e:``, ``hold:``,
``c:``); values are the strings the clients encoded (``RecordCodec``): the state parses only the
fields an atomic step needs (a window's generation, a record's token, rank and gva).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, Callable

#: a watch nobody waited on or refreshed for this long is dropped (its client is gone), seconds
WATCH_IDLE_S = 600.0
_FOREVER = float("inf")


def _field(raw: str | None, name: str) -> Any:
    """``v[name]`` of a stored value, None when it is not a memsem value of a dict."""
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    v = rec.get("v") if isinstance(rec, dict) else None
    return v.get(name) if isinstance(v, dict) else None


class DirectoryState:
    """Records with expiry, leases, rank claims, name claims and entry watches of one job.

    Args:
        secret: the job's secret (hex), handed to members by ``secret()``.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, secret: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._secret = secret
        self._clock = clock
        self._rec: dict[str, tuple[str, float]] = {}  # key -> (value, expiry)
        self._leases: dict[str, dict[str, float]] = {}  # lease key -> member -> expiry
        self._lease_window: dict[str, str] = {}  # lease key -> its window's key
        self._counter = 0
        self._watches: dict[str, list[Any]] = {}  # id -> [prefix, fired, last_seen, event or None]
        self.started = clock()
        self.idle_since: float | None = None

    # -- plain records --------------------------------------------------------------------------
    def _get(self, key: str) -> str | None:
        item = self._rec.get(key)
        if item is None:
            return None
        if item[1] <= self._clock():
            del self._rec[key]
            return None
        return item[0]

    def _set(self, key: str, value: str, ttl: float | None) -> None:
        self._rec[key] = (value, _FOREVER if ttl is None else self._clock() + ttl)

    def secret(self) -> str:
        return self._secret

    def ping(self) -> float:
        """Seconds since the state was made (a restarted actor answers with a small number)."""
        return self._clock() - self.started

    def get(self, key: str) -> str | None:
        return self._get(key)

    def mget(self, keys: list[str]) -> list[str | None]:
        return [self._get(k) for k in keys]

    def scan(self, prefix: str) -> dict[str, str]:
        """Every live record whose key starts with ``prefix``."""
        out = {}
        for k in [k for k in self._rec if k.startswith(prefix)]:
            v = self._get(k)
            if v is not None:
                out[k] = v
        return out

    def put_entry(self, key: str, value: str, ttl: float, entry_key: str) -> None:
        """Set an entry and wake the watches of its prefixes, in one step."""
        self._set(key, value, ttl)
        self.fire(entry_key)

    def put(self, values: dict[str, str], ttl: float | None, delete: list[str] = ()) -> None:
        """Set ``values`` (with ``ttl`` s) and delete ``delete``, in one step."""
        for k in delete:
            self._rec.pop(k, None)
        for k, v in values.items():
            self._set(k, v, ttl)

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self._rec.pop(k, None)
            self._leases.pop(k, None)
            self._lease_window.pop(k, None)

    # -- ranks -----------------------------------------------------------------------------------
    def reserve_rank(self, prefix: str, token: str, reserve: float) -> tuple[int, int]:
        """The lowest rank neither held (a live ``rank:`` record) nor reserved for another
        runtime (a live ``hold:`` record), reserved now for ``token``, and a new incarnation."""
        rank = 0
        while True:
            held = self._get(f"{prefix}rank:{rank}")
            hold = self._get(f"{prefix}hold:{rank}")
            if held is None and hold in (None, token):
                break
            rank += 1
        self._set(f"{prefix}hold:{rank}", token, reserve)
        self._counter += 1
        return rank, self._counter

    def claim(self, key: str, hold: str, value: str, token: str, ttl: float, reserve: float, incarnation: int) -> int:
        """Claim (or re-claim) a rank: 1 claimed or already ours (refreshed), 0 held by another
        runtime, -1 reserved for another runtime. Raises the incarnation counter to at least
        ``incarnation`` (a re-claim after the actor restarted keeps the counter ahead)."""
        cur = self._get(key)
        if cur is not None:
            if _field(cur, "token") != token:
                return 0
            self._set(key, cur, ttl)
        else:
            h = self._get(hold)
            if h is not None and h != token:
                return -1
            self._set(key, value, ttl)
        self._set(hold, token, reserve)
        self._counter = max(self._counter, int(incarnation))
        return 1

    def beat(self, key: str, hold: str, value: str, token: str, ttl: float, reserve: float, incarnation: int,
             own: dict[str, str]) -> tuple[int, list[str], list[str]]:
        """A heartbeat: refresh the rank record (re-claim it when it expired), then every record
        this runtime wrote (``own``: key -> the value it wrote): refreshed while it holds that
        value, written again when it expired, left alone when another value replaced it.

        Returns ``(rc, restored, replaced)``: rc 1 refreshed, 2 re-claimed, -1 the rank is held
        or reserved by another runtime (nothing refreshed); the keys written again; the keys
        another value holds now (the caller stops refreshing them).
        """
        cur = self._get(key)
        if cur is not None and _field(cur, "token") != token:
            return -1, [], []
        rc = 1 if cur is not None else 2
        if self.claim(key, hold, value, token, ttl, reserve, incarnation) != 1:
            return -1, [], []
        restored, replaced = [], []
        for k, v in own.items():
            now = self._get(k)
            if now is None:
                restored.append(k)
            elif now != v:
                replaced.append(k)
                continue
            self._set(k, v, ttl)
        return rc, restored, replaced

    def release(self, key: str, hold: str, token: str) -> None:
        """Give a rank up: delete its record and reservation while they hold ``token``."""
        cur = self._get(key)
        if cur is not None and _field(cur, "token") == token:
            del self._rec[key]
        if self._get(hold) == token:
            del self._rec[hold]

    # -- names -----------------------------------------------------------------------------------
    def claim_name(self, key: str, value: str, rank_prefix: str, token: str, ttl: float, replace: bool,
                   dead: str) -> str | None:
        """Bind a name: None when bound, else the live holder's stored value (unchanged). A
        holder is live while its rank record exists and still holds its token; ``dead`` is a
        value the caller found dead (a process of its node): exactly that one is replaced."""
        cur = self._get(key)
        if cur is not None and not replace and cur != dead:
            holder_token, rank = _field(cur, "token"), _field(cur, "rank")
            if holder_token is not None and holder_token != token and rank is not None:
                if _field(self._get(f"{rank_prefix}{rank}"), "token") == holder_token:
                    return cur
        self._set(key, value, ttl)
        return None

    def drop_name(self, key: str, gva_hex: str) -> bool:
        """Remove a name record while it still points at window ``gva_hex``."""
        cur = self._get(key)
        if cur is None:
            return False
        gva = _field(cur, "gva")
        if gva is None:  # a plain alias (the gva string itself)
            try:
                gva = json.loads(cur).get("v")
            except (ValueError, AttributeError):
                gva = None
        if gva == gva_hex:
            del self._rec[key]
            return True
        return False

    # -- leases ----------------------------------------------------------------------------------
    def acquire_lease(self, wkey: str, lkey: str, ckey: str, member: str, ttl: float | None, generation: int) -> int:
        """1 granted; -1 the window is not published, -2 it is closing, -3 another generation."""
        raw = self._get(wkey)
        if raw is None:
            return -1
        if self._get(ckey) is not None:
            return -2
        gen = _field(raw, "generation")
        if gen is None:
            return -1
        if int(gen) != int(generation):
            return -3
        self._leases.setdefault(lkey, {})[member] = _FOREVER if ttl is None else self._clock() + ttl
        self._lease_window[lkey] = wkey
        return 1

    def renew_lease(self, lkey: str, member: str, ttl: float | None) -> bool:
        leases = self._leases.get(lkey, {})
        exp = leases.get(member)
        if exp is None:
            return False
        if exp <= self._clock():
            del leases[member]
            return False
        leases[member] = _FOREVER if ttl is None else self._clock() + ttl
        return True

    def release_lease(self, lkey: str, member: str) -> None:
        self._leases.get(lkey, {}).pop(member, None)

    def lease_holders(self, lkey: str, ckey: str, rank_prefix: str, closing: bool,
                      closing_ttl: float) -> list[tuple[str, float, str | None]]:
        """Unexpired leases ``(member, seconds left, holder's rank value or None)``, reaping the
        expired; ``closing``: first set the closing flag, in the same step."""
        if closing:
            self._set(ckey, "1", closing_ttl)
        now = self._clock()
        leases = self._leases.get(lkey, {})
        out = []
        for m, exp in list(leases.items()):
            if exp <= now:
                del leases[m]
                continue
            rank = m.rsplit(":", 1)[-1]
            out.append((m, exp - now, self._get(f"{rank_prefix}{rank}") if rank.isdigit() else None))
        return out

    def reap_leases(self, lkey: str, members: list[str]) -> None:
        leases = self._leases.get(lkey, {})
        for m in members:
            leases.pop(m, None)

    # -- entry watches ---------------------------------------------------------------------------
    def watch(self, prefix: str) -> str:
        """Register a watch of entries under ``prefix`` (its id); made before the read it guards."""
        wid = secrets.token_hex(8)
        self._watches[wid] = [prefix, False, self._clock(), None]
        return wid

    def fire(self, entry_key: str) -> None:
        """An entry was put: mark every watch of a prefix of its key (and wake its waiter)."""
        for w in self._watches.values():
            if entry_key.startswith(w[0]):
                w[1] = True
                if w[3] is not None:
                    w[3].set()

    def take(self, wid: str) -> bool | None:
        """Whether the watch fired since the last take (clearing it); None: unknown watch."""
        w = self._watches.get(wid)
        if w is None:
            return None
        w[2] = self._clock()
        fired, w[1] = w[1], False
        return fired

    def wake(self, wid: str) -> None:
        w = self._watches.get(wid)
        if w is not None:
            w[1] = True
            if w[3] is not None:
                w[3].set()

    def unwatch(self, wid: str) -> None:
        self._watches.pop(wid, None)

    def set_waiter(self, wid: str, event: Any) -> None:
        w = self._watches.get(wid)
        if w is not None:
            w[3] = event

    # -- housekeeping ----------------------------------------------------------------------------
    def sweep(self) -> bool:
        """Drop expired records, leases and abandoned watches; True while anything is held
        (a rank record, a reservation or any record with an expiry)."""
        now = self._clock()
        for k in [k for k, (_, exp) in self._rec.items() if exp <= now]:
            del self._rec[k]
        for lkey in list(self._leases):
            leases = self._leases[lkey]
            for m in [m for m, exp in leases.items() if exp <= now]:
                del leases[m]
            if not leases or self._lease_window.get(lkey) not in self._rec:  # the window is gone
                del self._leases[lkey]
                self._lease_window.pop(lkey, None)
        for wid in [w for w, v in self._watches.items() if v[3] is None and now - v[2] > WATCH_IDLE_S]:
            del self._watches[wid]
        busy = bool(self._rec) or bool(self._leases)
        self.idle_since = None if busy else (self.idle_since if self.idle_since is not None else now)
        return busy


#: the state methods a client may call through ``DirectoryActor.call``
CALLS = frozenset({
    "secret", "ping", "get", "mget", "scan", "put", "delete", "put_entry", "reserve_rank", "claim", "beat",
    "release", "claim_name", "drop_name", "acquire_lease", "renew_lease", "release_lease", "lease_holders",
    "reap_leases", "watch", "wake", "unwatch",
})


class DirectoryActor:
    """The directory actor of one job (``ray.remote`` makes it one, in memsem.directory.ray).

    Async: every method runs on the actor's one event loop and only ``wait_watch`` awaits, so
    each call is one atomic step of :class:`DirectoryState`. A sweep every ``SWEEP_S`` drops
    what expired; once nothing of the job was held for ``idle_s`` the actor kills itself
    without restart (a later runtime of the job creates it again).

    Args:
        secret: the job's secret (hex), handed to members.
        idle_s: seconds to stay once nothing is held.
    """

    SWEEP_S = 1.0

    def __init__(self, secret: str, idle_s: float) -> None:
        self._s = DirectoryState(secret)
        self._idle_s = idle_s
        self._janitor: asyncio.Task | None = None

    async def call(self, method: str, *args: Any) -> Any:
        """One step ``DirectoryState.<method>(*args)`` (a name in ``CALLS``)."""
        if self._janitor is None:
            self._janitor = asyncio.get_running_loop().create_task(self._sweep())
        if method not in CALLS:
            raise ValueError(f"not a directory call: {method!r}")
        return getattr(self._s, method)(*args)

    async def wait_watch(self, wid: str, timeout: float) -> bool | None:
        """True: the watch fired (or was woken) since the last wait; False: ``timeout`` s passed
        with nothing; None: no such watch (the actor restarted, or dropped it)."""
        fired = self._s.take(wid)
        if fired is None or fired:
            return fired
        ev = asyncio.Event()
        self._s.set_waiter(wid, ev)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._s.set_waiter(wid, None)
        return bool(self._s.take(wid))

    async def _sweep(self) -> None:
        import ray

        while True:
            await asyncio.sleep(self.SWEEP_S)
            self._s.sweep()
            idle = self._s.idle_since
            if idle is not None and time.monotonic() - idle >= self._idle_s:
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


__all__ = ["CALLS", "DirectoryActor", "DirectoryState"]
