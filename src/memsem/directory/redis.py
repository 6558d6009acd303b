"""The ``redis://`` directory: many nodes share one real Redis server (redis-py client).

Keys, all under ``memsem:<job>:`` (the job namespaces everything):

=======================  ======================================================================
key                      value
=======================  ======================================================================
``rank:<r>``             rank record (pid, start, node, token, incarnation); ``PX ttl``, refreshed
                         by the owner's heartbeat: a rank whose key expired is absent (see
                         "Membership" below)
``hold:<r>``             the token of the rank's last holder, ``PX`` RESERVE_TTLS x ttl from its
                         last heartbeat: no other runtime claims the rank meanwhile, so a holder
                         whose record expired while it lived (a directory outage) can re-claim it
``incarnation``          counter: each new runtime's claim takes the next value
``w:<gva hex>``          window record (WindowInfo JSON), same TTL, refreshed by the heartbeat,
                         so a dead node's windows disappear within the TTL
``n:<name hex>``         name record (the name, its window's gva, its holder: pid, start, node,
                         rank, the holder runtime's token), same TTL; claimed atomically (a Lua
                         script): refused while the holder's rank key still holds its token
``e:<entry key>``        engine rendezvous entries (RDMA QP numbers), same TTL
``ev:<entry key>``       pub/sub channel (no key): ``put_entry`` publishes an empty message on
                         it; a watch (``watch_entries``) subscribes to ``ev:<prefix>*``
``l:<gva hex>``          leases of consumers on any node: sorted set, member
                         ``<lease id>:<node hex>:<pid>:<holder rank>``, score = expiry in ms of
                         the server's clock (9e15 = until released); reaped when expired or when
                         the holder's rank key is gone
``own:<token>``           set of the keys one runtime wrote (windows, names, entries), same TTL:
                         one heartbeat refreshes them all server-side in one round trip
``c:<gva hex>``          "closing" flag: set (atomically with reading the leases) when the owner
                         starts to unpublish; no new lease is granted while it exists
=======================  ======================================================================

Every value is ``{"v": record, "s": signature, "k": sealed key}``. With a job secret
(``MEMSEM_JOB_SECRET`` or ``secret=``) each value carries an HMAC-SHA256 over the key name and
the record, and window values also carry the window's access key sealed for holders of the
secret (XOR with an HMAC-derived pad, under the same MAC), so ``Runtime.lookup(name)`` works
across nodes. A reader with a secret rejects unsigned or forged values (``AccessDeniedError`` on
point reads; skipped, with a warning, in listings). See docs/many-nodes.md for what this does and
does not protect.

Waiting for entries (``watch_entries``): Redis pub/sub. ``put_entry`` sets the entry and
publishes on ``ev:<entry key>`` in one pipelined round trip; a watch holds its own connection,
pattern-subscribed (``PSUBSCRIBE ev:<prefix>*``) before it is handed out, so a put after it
always reaches it, and blocks on that connection with the wait's timeout. Pub/sub needs nothing
from the server's configuration (keyspace notifications would need ``notify-keyspace-events``
set server-wide, which managed servers often refuse), leaves no state on the server, and every
watcher of a prefix is woken (a BLPOP list per consumer wakes one popper and needs lists
cleaned up). A message lost to a broken connection costs one wait: waiters re-read the
directory after every wait.

Environment: ``MEMSEM_JOB_SECRET`` (job secret), ``MEMSEM_HEARTBEAT_TTL`` (seconds, default 10;
the heartbeat refreshes every TTL/3).

Membership (docs/many-nodes.md, "Membership"): a directory outage is a bounded delay, never a
death. A runtime's rank record carries its **incarnation** (a job-wide counter taken at its first
claim, kept for the runtime's life). When the heartbeat finds the record gone while the runtime
lives (the server stalled or restarted, or this process stalled past the TTL) it re-claims the
rank with the same incarnation, unless another runtime took it, and writes its window, name and
entry records again (``SET NX``). Readers tell a stall from a restart by the incarnation: the same
one re-claimed means the same process and memory; another one (or another process) at the rank
means the owner they knew is gone for good. An absent record is believed (GONE) only once this
directory has answered smoothly for ``GRACE_TTLS`` TTLs since its own last failed, slow or missed
call, so every live holder had the time to re-claim. Liveness questions (``member``) never wait
for the server: one thread per directory beats and re-reads the watched ranks every
``ttl / CHECKS_PER_TTL`` with a socket timeout of ``MEMBER_TIMEOUT_TTLS`` TTLs, and answers come
from that view (stale by at most one check interval while the server answers).

One module, over 600 lines, because it is one backend's storage steps: each method of the
shared SpanningDirectory (directory/_membership.py) is a Lua script or a pipelined round trip here,
and the scripts sit beside the methods that call them.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

from memsem import _args
from memsem._errors import MemsemError, PeerLostError
from memsem.directory._base import EntryWatch, check_entry_key
from memsem.directory._membership import DEFAULT_TTL, GRACE_TTLS, RESERVE_TTLS, SpanningDirectory
from memsem.directory.local import default_job

log = logging.getLogger(__name__)

#: the incarnation counter lives this long after the last claim of the job (ms)
_COUNTER_MS = 7 * 86400 * 1000
_MAX_RANKS = 1 << 16
_FOREVER_MS = 9_000_000_000_000_000  # lease score of "until released"

# Lua: atomic lease acquisition. KEYS: window, leases, closing. ARGV: member, ttl ms (-1 = until
# released), expected generation. Returns 1, or -1 (window gone), -2 (closing), -3 (generation).
_ACQUIRE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return -1 end
if redis.call('EXISTS', KEYS[3]) == 1 then return -2 end
local ok, rec = pcall(cjson.decode, raw)
if not ok or type(rec) ~= 'table' or type(rec.v) ~= 'table' then return -1 end
if tonumber(rec.v.generation) ~= tonumber(ARGV[3]) then return -3 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local exp = 9000000000000000
if ARGV[2] ~= '-1' then exp = now + tonumber(ARGV[2]) end
redis.call('ZADD', KEYS[2], exp, ARGV[1])
return 1
"""

# Lua: renew. KEYS: leases. ARGV: member, ttl ms (-1 = until released). 1 renewed, 0 lost/expired.
_RENEW = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not s then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(s) <= now then redis.call('ZREM', KEYS[1], ARGV[1]) return 0 end
local exp = 9000000000000000
if ARGV[2] ~= '-1' then exp = now + tonumber(ARGV[2]) end
redis.call('ZADD', KEYS[1], exp, ARGV[1])
return 1
"""

# Lua: unexpired leases, reaping the expired ones; optionally set the closing flag in the same
# atomic step (so a consumer either sees "closing" or is counted here: never neither). Each
# lease comes with its holder's rank record ('' when absent): the caller judges the holder's
# liveness (membership, with the re-claim grace) and reaps the leases of gone holders.
# KEYS: leases, closing. ARGV: rank key prefix, "1" to set closing, closing flag ttl ms.
_HOLDERS = """
if ARGV[2] == '1' then redis.call('SET', KEYS[2], '1', 'PX', tonumber(ARGV[3])) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local m = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local out = {}
for i = 1, #m, 2 do
  local rank = string.match(m[i], ':(%d+)$')
  local rec = false
  if rank then rec = redis.call('GET', ARGV[1] .. rank) end
  table.insert(out, m[i])
  table.insert(out, tostring(tonumber(m[i + 1]) - now))
  table.insert(out, rec or '')
end
return out
"""

# Lua: claim a name. KEYS: name key. ARGV: new value, rank key prefix, holder token, ttl ms,
# "1" to replace, the value a dead holder's record had ("" for none: a replace of exactly that
# record). Returns nil when bound, else the value of the live holder's record (unchanged). A
# holder is live while its rank key exists and still holds its token (its runtime is open).
_CLAIM_NAME = """
local raw = redis.call('GET', KEYS[1])
if raw and ARGV[5] ~= '1' and raw ~= ARGV[6] then
  local ok, rec = pcall(cjson.decode, raw)
  if ok and type(rec) == 'table' and type(rec.v) == 'table' and rec.v.token ~= ARGV[3] then
    local r = rec.v.rank
    if r ~= nil then
      local held = redis.call('GET', ARGV[2] .. tostring(r))
      if held and rec.v.token and string.find(held, rec.v.token, 1, true) then return raw end
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[4]))
return nil
"""

# Lua: remove a name record while it still points at a window. KEYS: name key. ARGV: gva hex.
_DROP_NAME = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, rec = pcall(cjson.decode, raw)
if ok and type(rec) == 'table' and type(rec.v) == 'table' and rec.v.gva == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# Lua helper: the token of a stored rank value (nil when it is not a memsem rank value).
_TOKEN_OF = """
local function token_of(raw)
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' or type(rec.v) ~= 'table' then return nil end
  return rec.v.token
end
"""

# Lua: claim (or re-claim) a rank. KEYS: rank key, hold key, incarnation counter. ARGV: value,
# token, ttl ms, reserve ms, incarnation, counter ttl ms. Returns 1 claimed (or already ours:
# refreshed), 0 held by another runtime, -1 reserved for another runtime.
_CLAIM = _TOKEN_OF + """
local cur = redis.call('GET', KEYS[1])
if cur then
  if token_of(cur) ~= ARGV[2] then return 0 end
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
else
  local h = redis.call('GET', KEYS[2])
  if h and h ~= ARGV[2] then return -1 end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[3]))
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', tonumber(ARGV[4]))
local c = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
if c < tonumber(ARGV[5]) then redis.call('SET', KEYS[3], ARGV[5]) end
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]))
return 1
"""

# Lua: refresh the rank key and its reservation while they hold this runtime's token. KEYS:
# rank key, hold key. ARGV: token, ttl ms, reserve ms. Returns 1 refreshed, 0 absent (expired:
# re-claim it), -1 held by another runtime.
_BEAT = _TOKEN_OF + """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
if token_of(raw) ~= ARGV[1] then return -1 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[3]))
return 1
"""

# Lua: refresh every record a runtime wrote, listed in its set of owned keys. KEYS: the set.
# ARGV: ttl ms. Returns the members whose key had expired (the caller writes them again), or
# false when the set itself is gone (the server lost it: the caller rebuilds it). One round trip
# whatever the number of records: the beat's cost at the client is flat in the windows it holds.
_BEAT_OWN = """
local ms = redis.call('SMEMBERS', KEYS[1])
if #ms == 0 then return false end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
local gone = {}
for i = 1, #ms do
  if redis.call('PEXPIRE', ms[i], tonumber(ARGV[1])) == 0 then gone[#gone + 1] = ms[i] end
end
return gone
"""

# Lua: give a rank up. KEYS: rank key, hold key. ARGV: token. Deletes what holds the token.
_RELEASE = _TOKEN_OF + """
local raw = redis.call('GET', KEYS[1])
if raw and token_of(raw) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""


class RedisDirectory(SpanningDirectory):
    """Directory of many nodes on a Redis server.

    Args:
        url: ``redis://[:password@]host:port/db``, ``rediss://`` (TLS) or ``unix://path?db=N``.
        job: namespace (``MEMSEM_JOB``, default "default").
        alive: ``alive(record) -> bool`` of a process on this node: a name held by a dead process
            of this node is taken over before its heartbeat expires (other liveness is the rank
            key's TTL).
        ttl: heartbeat TTL in seconds (``MEMSEM_HEARTBEAT_TTL``, default 10): a node silent for
            this long is dead, its ranks, windows and entries expire.
        secret: job secret (``MEMSEM_JOB_SECRET``); bytes or str. None: entries are unsigned.
        timeout: socket timeout of every Redis command, seconds (the membership thread's
            calls use ``MEMBER_TIMEOUT_TTLS`` TTLs, at most this).

    Raises:
        NotSupportedError: redis-py is not installed (``pip install 'redis>=5'``).
        PeerLostError: the server does not answer.

    Attributes:
        incarnation: this runtime's incarnation (None before ``claim_rank``).
        reclaims: how many times the heartbeat re-claimed the rank after its record expired.
        restored: how many of this runtime's records it wrote again after they expired.
        lost_rank: True once another runtime took the rank (this one can publish nothing more).

    Thread safety: all methods may be called from several threads (redis-py's pool).
    """

    kind = "redis"

    def __init__(self, url: str, *, job: str | None = None,
                 alive: Callable[[dict[str, Any]], bool] | None = None, ttl: float | None = None,
                 secret: bytes | str | None = None, timeout: float = 5.0) -> None:
        try:
            import redis
        except ImportError as exc:
            from memsem._errors import NotSupportedError

            raise NotSupportedError("the redis directory needs redis-py: pip install 'redis>=5'") from exc
        timeout = _args.timeout(timeout, "timeout", positive=True)
        if secret is None:
            secret = os.environ.get("MEMSEM_JOB_SECRET") or None
        self._setup(job=job or default_job(), ttl=ttl, timeout=timeout, secret=secret, alive=alive,
                    where=_safe_url(url))
        self._ttl_ms = max(1, int(self.ttl * 1000))
        #: socket timeout of every command, seconds
        self.timeout = timeout
        self._reserve_ms = max(1, int(self._reserve_s * 1000))
        self.url = url
        self._redis = redis
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           health_check_interval=30)
        try:
            self.client.ping()
        except redis.RedisError as exc:
            self.client.close()
            raise PeerLostError(f"redis directory {_safe_url(url)} does not answer: {exc}") from exc
        # the membership thread's own connection: short timeouts, never behind a slow command
        self._mclient = redis.Redis.from_url(url, socket_timeout=self.member_timeout,
                                             socket_connect_timeout=self.member_timeout)
        self._acquire = self.client.register_script(_ACQUIRE)
        self._renew = self.client.register_script(_RENEW)
        self._holders = self.client.register_script(_HOLDERS)
        self._claim = self.client.register_script(_CLAIM)
        self._beat = self.client.register_script(_BEAT)
        self._release = self.client.register_script(_RELEASE)
        self._claim_name = self.client.register_script(_CLAIM_NAME)
        self._drop_name = self.client.register_script(_DROP_NAME)
        self._beat_own = self.client.register_script(_BEAT_OWN)
        #: changes to ``_own`` not yet applied to the server's set of owned keys (the next beat
        #: sends them: SREM, SADD, then the refresh, in one round trip)
        self._own_added: set[str] = set()
        self._own_removed: set[str] = set()

    # -- storage (values in the one codec of directories that span nodes: _base.RecordCodec) --------
    def _encode(self, key: str, record: Any, access_key: bytes | None = None) -> str:
        return self._codec.encode(key, record, access_key)

    def _get_raw(self, key: str) -> bytes | str | None:
        return self._call(self.client.get, key)

    def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic_ns()
        try:
            return fn(*args, **kwargs)
        except self._redis.RedisError as exc:
            self._views.observe(t0, time.monotonic_ns(), False)  # an outage seen here counts as well
            raise PeerLostError(f"redis directory {_safe_url(self.url)} failed: {exc}") from exc

    # -- ranks ------------------------------------------------------------------------------------
    def claim_rank(self, record: dict[str, Any]) -> int:
        """Claim the lowest rank that is neither held nor reserved for another runtime; the
        record gets this runtime's token and a new incarnation. Starts the heartbeat."""
        counter = f"{self.prefix}incarnation"
        inc = int(self._call(self.client.incr, counter))
        for rank in range(_MAX_RANKS):
            key = self._k("rank", str(rank))
            value = self._encode(key, dict(record, token=self._token, rank=rank, incarnation=inc))
            rc = self._call(self._claim, keys=[key, self._k("hold", str(rank)), counter],
                            args=[value, self._token, self._ttl_ms, self._reserve_ms, inc, _COUNTER_MS])
            if rc == 1:
                self._rank, self._rank_value, self.incarnation = rank, value, inc
                self._start_thread()
                return rank
        raise MemsemError(f"no free rank in redis directory {_safe_url(self.url)} job {self.job!r}")

    def release_rank(self, rank: int) -> None:
        self._stop.set()
        self._call(self._release, keys=[self._k("rank", str(rank)), self._k("hold", str(rank))],
                   args=[self._token])
        if rank == self._rank:
            self._rank = None

    def ranks(self) -> dict[int, dict[str, Any]]:
        out = {}
        for key in self._scan(self._k("rank", "*")):
            val = self._get(key, strict=False)
            if val is not None:
                out[int(key.rsplit(":", 1)[1])] = val["v"]
        return out

    # -- membership (memsem.directory._membership) ----------------------------------------------
    def _mcall(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """A call of the membership thread (short timeout), observed for smoothness."""
        t0 = time.monotonic_ns()
        try:
            out = fn(*args, **kwargs)
        except self._redis.RedisError as exc:
            self._views.observe(t0, time.monotonic_ns(), False)
            raise PeerLostError(f"redis directory {_safe_url(self.url)} failed: {exc}") from exc
        self._views.observe(t0, time.monotonic_ns(), True)
        return out

    def _read_ranks(self, ranks: list[int]) -> list[dict[str, Any] | None]:
        """The records of ``ranks`` (one MGET of the membership thread's connection).

        Raises:
            PeerLostError: the server did not answer within ``member_timeout``.
        """
        raws = self._mcall(self._mclient.mget, [self._k("rank", str(r)) for r in ranks])
        return [self._rank_of(r, raw) for r, raw in zip(ranks, raws)]

    def _ping(self) -> None:
        self._mcall(self._mclient.ping)

    # -- heartbeat --------------------------------------------------------------------------------
    def heartbeat(self, rank: int) -> None:
        """Refresh the rank record and every record this runtime wrote. A rank record that
        expired while this runtime lived is re-claimed with the same incarnation, and records
        that expired are written again; a rank another runtime took is lost for good
        (``lost_rank``; logged once).

        Raises:
            PeerLostError: the server did not answer within ``member_timeout``.
        """
        key, hold = self._k("rank", str(rank)), self._k("hold", str(rank))
        rc = self._mcall(self._beat, keys=[key, hold], args=[self._token, self._ttl_ms, self._reserve_ms],
                         client=self._mclient)
        if rc == 0:
            counter = f"{self.prefix}incarnation"
            rc = self._mcall(self._claim, keys=[key, hold, counter],
                             args=[self._rank_value, self._token, self._ttl_ms, self._reserve_ms,
                                   self.incarnation or 0, _COUNTER_MS], client=self._mclient)
            if rc == 1:
                self._reclaimed(rank)
        if rc != 1:
            self._lose(rank)
            return
        self._refresh_own()

    def _own_put(self, values: dict[str, str]) -> None:
        """Records this runtime wrote (key -> stored value): the heartbeat refreshes them."""
        with self._lock:
            self._own.update(values)
            self._own_added.update(values)
            self._own_removed.difference_update(values)

    def _own_drop(self, keys: list[str]) -> None:
        """Records this runtime removes: the heartbeat neither refreshes nor writes them again."""
        with self._lock:
            for k in keys:
                if self._own.pop(k, None) is not None:
                    self._own_removed.add(k)
                self._own_added.discard(k)

    def _refresh_own(self) -> None:
        """One round trip: apply the changes to the server's set of this runtime's keys, refresh
        every key in it (``_BEAT_OWN``), then write again what had expired (``SET NX``: never
        over a record written meanwhile). A set the server lost is rebuilt from ``_own``."""
        with self._lock:
            if not self._own and not self._own_removed:
                return
            added, removed = list(self._own_added), list(self._own_removed)
            self._own_added.clear()
            self._own_removed.clear()
        oset = self._k("own", self._token)
        pipe = self._mclient.pipeline(transaction=False)
        if removed:
            pipe.srem(oset, *removed)
        if added:
            pipe.sadd(oset, *added)
        self._beat_own(keys=[oset], args=[self._ttl_ms], client=pipe)
        try:
            gone = self._mcall(pipe.execute)[-1]
        except BaseException:
            with self._lock:  # sent again with the next beat
                self._own_added.update(k for k in added if k in self._own)
                self._own_removed.update(k for k in removed if k not in self._own)
            raise
        with self._lock:  # a record removed meanwhile is not written again (remove_* hold it)
            if gone is None:  # the set is gone (a server restart): every record, written if absent
                back = list(self._own.items())
            else:
                back = [(k, self._own[k]) for k in (g.decode() if isinstance(g, bytes) else g for g in gone)
                        if k in self._own]
            if not back:
                return
            pipe = self._mclient.pipeline(transaction=False)
            if gone is None:
                pipe.sadd(oset, *[k for k, _ in back])
                pipe.pexpire(oset, self._ttl_ms)
            for k, value in back:
                pipe.set(k, value, px=self._ttl_ms, nx=True)
            res = self._mcall(pipe.execute)
            self.restored += sum(1 for ok in res[-len(back):] if ok)

    # -- windows ----------------------------------------------------------------------------------
    def put_window(self, gva: int, name: str, record: dict[str, Any], key: bytes | None = None) -> None:
        self._check_rank()
        wkey = self._k("w", f"{gva:016x}")
        values = {wkey: self._encode(wkey, record, key)}
        if name:
            nkey = self._k("n", name.encode().hex())
            values[nkey] = self._encode(nkey, self._name_value(name, gva, record))
        pipe = self.client.pipeline(transaction=True)
        for k, value in values.items():
            pipe.set(k, value, px=self._ttl_ms)
        pipe.delete(self._k("c", f"{gva:016x}"))
        self._call(pipe.execute)
        self._own_put(values)

    def remove_window(self, gva: int, name: str, *, pause: Callable[[], None] | None = None) -> None:
        """Remove window ``gva``'s record (and its leases' keys), and ``name``'s record while it
        still points at ``gva`` (atomically: a successor's name is never removed)."""
        wkey = self._k("w", f"{gva:016x}")
        keys = [wkey, self._k("l", f"{gva:016x}"), self._k("c", f"{gva:016x}")]
        if name:
            keys.append(self._k("n", name.encode().hex()))
        self._own_drop(keys)  # first: the heartbeat writes no removed record again
        if name:  # the name only while it still points at this window (a successor's is kept)
            self._call(self._drop_name, keys=[keys[3]], args=[f"{gva:016x}"])
        self._call(self.client.delete, *keys[:3])

    # -- names ------------------------------------------------------------------------------------
    def _claim_name_step(self, nkey: str, value: str, replace: bool, dead: str) -> str | None:
        raw = self._call(self._claim_name, keys=[nkey], args=[value, self._k("rank", ""), self._token, self._ttl_ms,
                                                        "1" if replace else "0", dead])
        return None if raw is None else (raw.decode() if isinstance(raw, bytes) else str(raw))

    def windows(self) -> list[dict[str, Any]]:
        out = []
        for key in self._scan(self._k("w", "*")):
            val = self._get(key, strict=False)
            if val is not None:
                out.append(val["v"])
        return out

    # -- leases across nodes ----------------------------------------------------------------------
    def acquire_lease(self, gva: int, generation: int, holder: dict[str, Any], ttl: float | None) -> str:
        """Record a lease on window ``gva`` at ``generation``; returns its member id.

        ``holder``: ``{"node", "pid", "rank"}`` of the consumer. ``ttl`` seconds (None: until
        released, reaped when the holder's rank expires).

        Raises:
            WindowRetiredError: the window is gone, closing, or at another generation.
        """
        member = self._lease_member(holder)
        ttl = _args.ttl(ttl)
        ms = -1 if ttl is None else max(1, int(ttl * 1000))
        g = f"{gva:016x}"
        rc = self._call(self._acquire, keys=[self._k("w", g), self._k("l", g), self._k("c", g)],
                        args=[member, ms, str(generation)])
        if rc == 1:
            return member
        raise self._lease_refused(gva, rc, generation)

    def renew_lease(self, gva: int, member: str, ttl: float | None) -> bool:
        """Extend an unexpired lease to ``ttl`` s from now (server clock); False when it was lost."""
        ttl = _args.ttl(ttl)
        ms = -1 if ttl is None else max(1, int(ttl * 1000))
        return bool(self._call(self._renew, keys=[self._k("l", f"{gva:016x}")], args=[member, ms]))

    def release_lease(self, gva: int, member: str) -> None:
        self._call(self.client.zrem, self._k("l", f"{gva:016x}"), member)

    def lease_holders(self, gva: int, *, closing: bool = False) -> list[tuple[int, float]]:
        """``(holder pid, seconds left)`` of unexpired leases of live holders. ``closing``: first
        mark the window closing (no new leases), atomically. A holder counts as live while its
        rank record names it, and while it is absent but not yet GONE (it may be re-claiming it
        after a directory outage); the leases of gone holders are reaped."""
        g = f"{gva:016x}"
        lkey = self._k("l", g)
        out = self._call(self._holders, keys=[lkey, self._k("c", g)],
                         args=[self._k("rank", ""), "1" if closing else "0", max(self._ttl_ms, 600_000)])
        rows = [(out[i].decode() if isinstance(out[i], bytes) else str(out[i]), float(out[i + 1]) / 1000.0, out[i + 2])
                for i in range(0, len(out), 3)]
        res, reap = self._live_leases(rows)
        if reap:
            self._call(self.client.zrem, lkey, *reap)
        return res

    def reopen_window(self, gva: int) -> None:
        """Clear the closing flag (the owner gave up unpublishing: leases still held)."""
        self._call(self.client.delete, self._k("c", f"{gva:016x}"))

    # -- entries ----------------------------------------------------------------------------------
    def put_entry(self, key: str, record: dict[str, Any]) -> None:
        """Store ``record`` under ``key`` (with the heartbeat TTL) and wake the watches of its
        prefixes (a publish on ``ev:<key>``, pipelined with the write)."""
        self._check_rank()
        rkey = self._k("e", check_entry_key(key))
        value = self._encode(rkey, record)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(rkey, value, px=self._ttl_ms)
        pipe.publish(self._k("ev", key), b"")
        self._call(pipe.execute)
        self._own_put({rkey: value})

    def _delete(self, keys: list[str]) -> None:
        if keys:
            self._call(self.client.delete, *keys)

    def entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        head = self._k("e", "")
        out = {}
        for rkey in self._scan(head + prefix + "*"):
            val = self._get(rkey, strict=False)
            if val is not None:
                out[rkey[len(head):]] = val["v"]
        return out

    def watch_entries(self, prefix: str) -> EntryWatch:
        """A watch woken by ``put_entry`` of keys under ``prefix`` (pub/sub; see the module
        docstring). Holds one connection of its own until closed.

        Raises:
            ValueError: ``prefix`` is not a valid entry key prefix.
            PeerLostError: the server did not confirm the subscription.
        """
        return _PubSubWatch(self, self._k("ev", check_entry_key(prefix)) + "*", self._k("wake", secrets.token_hex(8)))

    # -- misc -------------------------------------------------------------------------------------
    def _scan(self, pattern: str) -> list[str]:
        # Glob metacharacters in names are escaped: the prefix is ours, the rest hex or checked.
        keys = self._call(lambda: list(self.client.scan_iter(match=pattern, count=1000)))
        return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)

    def close(self) -> None:
        if self._closed:
            return
        with self._mlock:
            self._closed = True
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.ttl)
        self.client.close()
        self._mclient.close()

    def __repr__(self) -> str:
        return f"<RedisDirectory {_safe_url(self.url)} job={self.job!r} ttl={self.ttl:g}s " \
               f"{'signed' if self._codec.signed else 'unsigned'} rank={self._rank} incarnation={self.incarnation}>"


class _PubSubWatch(EntryWatch):
    """``EntryWatch`` over Redis pub/sub: a connection of its own, subscribed to the pattern of
    the watched prefix and to a channel of its own that ``wake`` publishes on."""

    def __init__(self, d: RedisDirectory, pattern: str, wake_channel: str) -> None:
        super().__init__()
        self._d = d
        self._wake_channel = wake_channel
        self._ps = d.client.pubsub()
        try:
            self._ps.psubscribe(pattern)
            self._ps.subscribe(wake_channel)
            # Only once the server confirmed both is a later put sure to reach this watch.
            deadline = time.monotonic() + d.timeout
            confirmed = 0
            while confirmed < 2:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLostError(f"redis directory {_safe_url(d.url)} did not confirm a "
                                        f"subscription within {d.timeout:.1f} s")
                msg = self._ps.get_message(timeout=left)
                if msg is not None and msg["type"] in ("psubscribe", "subscribe"):
                    confirmed += 1
        except d._redis.RedisError as exc:
            self._ps.close()
            raise PeerLostError(f"redis directory {_safe_url(d.url)} failed: {exc}") from exc
        except BaseException:
            self._ps.close()
            raise

    def wait(self, timeout: float) -> bool:
        timeout = _args.timeout(timeout)
        if self._closed:
            return super().wait(timeout)
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                msg = self._ps.get_message(timeout=max(0.0, left))
            except self._d._redis.RedisError:
                # The connection broke (redis-py subscribes again when it reconnects); what was
                # published meanwhile is lost: say "look again" after a short pause.
                return super().wait(max(0.0, left))
            if msg is not None and msg["type"] in ("pmessage", "message"):
                return True
            if left <= 0:
                return False

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
        try:
            self._d.client.publish(self._wake_channel, b"")
        except self._d._redis.RedisError:
            super().wake()  # the waiter's next slice ends within its timeout anyway

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._ps.close()
        except self._d._redis.RedisError:
            pass


def _safe_url(url: str) -> str:
    """``url`` without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


__all__ = ["DEFAULT_TTL", "GRACE_TTLS", "RESERVE_TTLS", "RedisDirectory"]
