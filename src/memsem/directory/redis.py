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
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

from memsem import _args
from memsem._errors import AccessDeniedError, MemsemError, PeerLostError, WindowRetiredError
from memsem.directory._base import (
    Directory,
    EntryWatch,
    Member,
    MemberState,
    check_entry_key,
    seal_key,
    secret_keys,
    unseal_key,
)
from memsem.directory.local import default_job

log = logging.getLogger(__name__)

DEFAULT_TTL = 10.0
#: heartbeats per TTL: the rank record and this runtime's records are refreshed every TTL / 3
BEATS_PER_TTL = 3
#: watched ranks (owners of windows this runtime uses) are re-read every TTL / CHECKS_PER_TTL; a
#: failed heartbeat is retried at that interval too
CHECKS_PER_TTL = 10
#: an absent rank record is believed (GONE) once the directory answered smoothly this many TTLs
#: since its last outage seen here: the re-claim grace
GRACE_TTLS = 1.0
#: a rank stays reserved for its holder this many TTLs after its last heartbeat
RESERVE_TTLS = 10
#: socket timeout of the membership thread's calls (heartbeats, rank reads), in TTLs (at most
#: the directory's ``timeout``); a call slower than half of it counts as an outage
MEMBER_TIMEOUT_TTLS = 0.25
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


class _View:
    """This directory's view of one watched rank."""

    __slots__ = ("state", "record", "read_ns", "asked_ns", "detail")

    def __init__(self, now: int) -> None:
        self.state = MemberState.UNKNOWN
        self.record: dict[str, Any] | None = None
        self.read_ns = 0
        self.asked_ns = now
        self.detail = "not read yet"


class RedisDirectory(Directory):
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

    def __init__(self, url: str, *, job: str | None = None,
                 alive: Callable[[dict[str, Any]], bool] | None = None, ttl: float | None = None,
                 secret: bytes | str | None = None, timeout: float = 5.0) -> None:
        try:
            import redis
        except ImportError as exc:
            from memsem._errors import NotSupportedError

            raise NotSupportedError("the redis directory needs redis-py: pip install 'redis>=5'") from exc
        self.job = job or default_job()
        if not self.job.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"job must be alphanumeric (with - or _), got {self.job!r}")
        if ttl is None:
            raw = os.environ.get("MEMSEM_HEARTBEAT_TTL", "") or ""
            try:
                ttl = float(raw) if raw else DEFAULT_TTL
            except ValueError:
                raise ValueError(f"MEMSEM_HEARTBEAT_TTL must be a number of seconds, got {raw!r}") from None
            ttl = _args.timeout(ttl, "MEMSEM_HEARTBEAT_TTL", positive=True)
        else:
            ttl = _args.timeout(ttl, "ttl", positive=True)
        timeout = _args.timeout(timeout, "timeout", positive=True)
        self.ttl = ttl
        self._ttl_ms = max(1, int(ttl * 1000))
        #: socket timeout of every command, seconds
        self.timeout = timeout
        self._reserve_ms = max(1, int(RESERVE_TTLS * ttl * 1000))
        #: the membership thread's period (re-reads of watched ranks; retries of a failed beat)
        self.check_s = ttl / CHECKS_PER_TTL
        self._beat_s = ttl / BEATS_PER_TTL
        #: socket timeout of the membership thread's calls
        self.member_timeout = min(timeout, ttl * MEMBER_TIMEOUT_TTLS)
        #: an absent rank is GONE once this directory answered smoothly this long
        self.grace_s = GRACE_TTLS * ttl
        #: a read of a record whose owner is SUSPECT is retried this long (the re-claim grace,
        #: one heartbeat and one membership timeout)
        self.reclaim_s = self.grace_s + self._beat_s + self.member_timeout
        self.url = url
        self.prefix = f"memsem:{self.job}:"
        if secret is None:
            secret = os.environ.get("MEMSEM_JOB_SECRET") or None
        self._mac_key, self._seal_key = secret_keys(secret)
        self._redis = redis
        self._alive = alive
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
        self._lock = threading.Lock()
        #: records this runtime wrote and refreshes (windows, names, entries): key -> stored value
        self._own: dict[str, str] = {}
        #: changes to ``_own`` not yet applied to the server's set of owned keys (the next beat
        #: sends them: SREM, SADD, then the refresh, in one round trip)
        self._own_added: set[str] = set()
        self._own_removed: set[str] = set()
        self._rank: int | None = None
        self._rank_value = ""
        self._token = secrets.token_hex(8)
        self.incarnation: int | None = None
        self.reclaims = 0
        self.restored = 0
        self.lost_rank = False
        self._lost_why = ""
        # membership: the watched ranks' views and how smoothly the server answered
        self._mlock = threading.Lock()
        self._views: dict[int, _View] = {}
        now = time.monotonic_ns()
        self._smooth_since: int | None = now  # the ping above answered
        self._last_ok_ns = now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- signing ----------------------------------------------------------------------------------
    def _sign(self, key: str, payload: str, sealed: str) -> str:
        return hmac.new(self._mac_key, f"{key}\n{sealed}\n{payload}".encode(), hashlib.sha256).hexdigest()

    def _encode(self, key: str, record: Any, access_key: bytes | None = None) -> str:
        payload = json.dumps(record, sort_keys=True, separators=(",", ":"))
        out: dict[str, Any] = {"v": record}
        if self._mac_key is not None:
            sealed = ""
            if access_key is not None:
                sealed = seal_key(self._seal_key, key, access_key)
                out["k"] = sealed
            out["s"] = self._sign(key, payload, sealed)
        return json.dumps(out, separators=(",", ":"))

    def _decode(self, key: str, raw: bytes | str | None, *, strict: bool = True) -> dict[str, Any] | None:
        """The verified value stored at ``key`` (``{"v":..., "k":...}``), None when absent.
        A value failing verification raises AccessDeniedError (``strict``) or is skipped."""
        if raw is None:
            return None
        try:
            out = json.loads(raw)
            if not isinstance(out, dict) or "v" not in out:
                raise ValueError("not a memsem entry")
        except ValueError:
            return self._reject(key, "is not a memsem entry", strict)
        if self._mac_key is not None:
            sig = out.get("s")
            payload = json.dumps(out["v"], sort_keys=True, separators=(",", ":"))
            if not isinstance(sig, str) or not hmac.compare_digest(sig, self._sign(key, payload, out.get("k", ""))):
                return self._reject(key, "fails its HMAC: forged, or written without the job secret", strict)
        return out

    def _reject(self, key: str, why: str, strict: bool) -> None:
        msg = f"redis directory entry {key!r} {why}"
        if strict:
            raise AccessDeniedError(msg)
        log.warning("%s; ignored", msg)
        return None

    def _get(self, key: str, *, strict: bool = True) -> dict[str, Any] | None:
        return self._decode(key, self._call(self.client.get, key), strict=strict)

    def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic_ns()
        try:
            return fn(*args, **kwargs)
        except self._redis.RedisError as exc:
            self._observe(t0, time.monotonic_ns(), False)  # an outage seen here counts as well
            raise PeerLostError(f"redis directory {_safe_url(self.url)} failed: {exc}") from exc

    def _k(self, kind: str, ident: str) -> str:
        return f"{self.prefix}{kind}:{ident}"

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

    def rank_record(self, rank: int) -> dict[str, Any] | None:
        val = self._get(self._k("rank", str(rank)))
        return None if val is None else val["v"]

    def ranks(self) -> dict[int, dict[str, Any]]:
        out = {}
        for key in self._scan(self._k("rank", "*")):
            val = self._get(key, strict=False)
            if val is not None:
                out[int(key.rsplit(":", 1)[1])] = val["v"]
        return out

    # -- membership -------------------------------------------------------------------------------
    def member(self, rank: int) -> Member:
        """The view of ``rank`` (see ``Directory.member``). The first question about a rank
        reads it now (one call, ``member_timeout`` at most); later ones answer from the view
        the membership thread re-reads every ``check_s``. Never raises for an outage: the
        last-known state is kept (UNKNOWN if never read)."""
        now = time.monotonic_ns()
        with self._mlock:
            v = self._views.get(rank)
            if v is None:
                v = self._views[rank] = _View(now)
                first = True
            else:
                first = False
            v.asked_ns = now
        if first:
            self._start_thread()
            self._read_ranks([rank])
        with self._mlock:
            age = (time.monotonic_ns() - v.read_ns) / 1e9 if v.read_ns else float("inf")
            return Member(v.state, v.record, age, v.detail)

    def _observe(self, t0: int, t1: int, ok: bool) -> None:
        """Account one call to the server: a failed or slow call, or a gap with no call (this
        process or its thread stalled), is an outage: absences are believed again only after
        ``grace_s`` of smooth answers."""
        with self._mlock:
            if not ok:
                self._smooth_since = None
                return
            gap = t0 - self._last_ok_ns > (3 * self.check_s + self.member_timeout) * 1e9
            if (t1 - t0) > self.member_timeout * 5e8 or gap:
                self._smooth_since = t1
            elif self._smooth_since is None:
                self._smooth_since = t0
            self._last_ok_ns = max(self._last_ok_ns, t1)

    def _mcall(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """A call of the membership thread (short timeout), observed for smoothness."""
        t0 = time.monotonic_ns()
        try:
            out = fn(*args, **kwargs)
        except self._redis.RedisError as exc:
            self._observe(t0, time.monotonic_ns(), False)
            raise PeerLostError(f"redis directory {_safe_url(self.url)} failed: {exc}") from exc
        self._observe(t0, time.monotonic_ns(), True)
        return out

    def _judge(self, rank: int, raw: bytes | str | None, t1: int) -> tuple[MemberState, dict[str, Any] | None, str]:
        """The state of ``rank`` from its stored value read at ``t1`` (the one rule)."""
        val = None if not raw else self._decode(self._k("rank", str(rank)), raw, strict=False)
        if val is not None and isinstance(val["v"], dict):
            return MemberState.PRESENT, val["v"], ""
        with self._mlock:
            smooth = self._smooth_since
        if smooth is not None and t1 - smooth >= self.grace_s * 1e9:
            return MemberState.GONE, None, (
                f"its rank {rank} record expired (no heartbeat for the TTL of {self.ttl:g} s) and was not "
                f"re-claimed while {_safe_url(self.url)} answered for {self.grace_s:g} s")
        return MemberState.SUSPECT, None, (
            f"its rank {rank} record is absent since a directory outage; it may still re-claim it")

    def _read_ranks(self, ranks: list[int]) -> None:
        """Re-read the views of ``ranks`` (one MGET); an outage leaves them as they were."""
        try:
            raws = self._mcall(self._mclient.mget, [self._k("rank", str(r)) for r in ranks])
        except PeerLostError:
            return
        t1 = time.monotonic_ns()
        for rank, raw in zip(ranks, raws):
            state, rec, detail = self._judge(rank, raw, t1)
            with self._mlock:
                v = self._views.get(rank)
                if v is not None:
                    v.state, v.record, v.read_ns, v.detail = state, rec, t1, detail

    # -- heartbeat and membership thread ----------------------------------------------------------
    def _start_thread(self) -> None:
        with self._mlock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"memsem-redis-heartbeat-{self.job}")
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
                                    _safe_url(self.url), self.check_s, exc)
                        quiet_until = now + self.ttl
                    beat_due = now + self.check_s
            self._refresh()

    def _refresh(self) -> None:
        """Re-read the watched ranks (PING when none: the smoothness needs regular calls);
        forget ranks nobody asked about for ``10 x ttl``."""
        now = time.monotonic_ns()
        with self._mlock:
            for r in [r for r, v in self._views.items() if now - v.asked_ns > 10 * self.ttl * 1e9]:
                del self._views[r]
            ranks = list(self._views)
        if ranks:
            self._read_ranks(ranks)
        else:
            try:
                self._mcall(self._mclient.ping)
            except PeerLostError:
                pass

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
                self.reclaims += 1
                log.warning("memsem rank %d of job %r expired in %s while this runtime lived (a directory "
                            "outage, or a stall past the TTL of %g s): re-claimed, incarnation %s", rank,
                            self.job, _safe_url(self.url), self.ttl, self.incarnation)
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

    def _lose(self, rank: int) -> None:
        if self.lost_rank:
            return
        try:
            other = self.rank_record(rank)
        except MemsemError:
            other = None
        who = "another runtime" if other is None else \
            f"pid {other.get('pid')} on {other.get('node')!r} (incarnation {other.get('incarnation')})"
        self._lost_why = (f"its rank {rank} of job {self.job!r} expired in {_safe_url(self.url)} and {who} "
                          f"took it (this runtime was cut off or stalled longer than the TTL of {self.ttl:g} s "
                          f"and the reservation of {RESERVE_TTLS} TTLs)")
        self.lost_rank = True
        log.error("memsem runtime (incarnation %s): %s; its windows are gone for other nodes and it "
                  "can publish nothing more: create a new Runtime", self.incarnation, self._lost_why)

    def _check_rank(self) -> None:
        if self.lost_rank:
            raise PeerLostError(f"this runtime cannot publish: {self._lost_why}; create a new Runtime")

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
    def _name_value(self, name: str, gva: int, holder: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "gva": f"{gva:016x}", "pid": holder.get("owner_pid", holder.get("pid")),
                "start": holder.get("owner_start", holder.get("start")), "node": holder.get("node", ""),
                "rank": holder.get("rank"), "token": self._token}

    def claim_name(self, name: str, gva: int, holder: dict[str, Any], *, replace: bool = False,
                   pause: Callable[[], None] | None = None) -> dict[str, Any] | None:
        """Bind ``name`` to window ``gva`` of ``holder`` (this runtime): atomically, when no
        record holds it, this runtime does, its holder's rank key expired or holds another
        token (its runtime closed or its node died), or ``replace``. Returns None when bound,
        else the live holder's record."""
        nkey = self._k("n", name.encode().hex())
        value = self._encode(nkey, self._name_value(name, gva, holder))
        dead = ""
        for _ in range(2):
            raw = self._call(self._claim_name, keys=[nkey], args=[value, self._k("rank", ""), self._token, self._ttl_ms,
                                                            "1" if replace else "0", dead])
            if raw is None:
                self._own_put({nkey: value})
                return None
            val = self._decode(nkey, raw, strict=False)
            held = dict(val["v"]) if val is not None and isinstance(val["v"], dict) else {"name": name}
            # A holder on this node is dead when its process is (its heartbeat may not have
            # expired yet): take over exactly that record, unless it changed meanwhile.
            if self._alive is None or held.get("node") != holder.get("node") or \
                    self._alive({"pid": held.get("pid"), "start": held.get("start"), "node": held.get("node")}):
                return held
            dead = raw.decode() if isinstance(raw, bytes) else str(raw)
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

    def get_window(self, gva: int) -> dict[str, Any] | None:
        val = self._get(self._k("w", f"{gva:016x}"))
        return None if val is None else val["v"]

    holds_leases = True

    @property
    def seals_keys(self) -> bool:
        """True with a job secret: ``put_window(..., key=)`` stores the access key sealed."""
        return self._seal_key is not None

    def window_with_key(self, gva: int) -> tuple[dict[str, Any] | None, bytes | None]:
        """``(record, access key)`` of window ``gva`` from one read; the key is None when the
        window is absent, was published without a secret, or this directory has none."""
        wkey = self._k("w", f"{gva:016x}")
        val = self._get(wkey)
        if val is None:
            return None, None
        if self._seal_key is None or not val.get("k"):
            return val["v"], None
        try:
            return val["v"], unseal_key(self._seal_key, wkey, val["k"])
        except ValueError:
            return val["v"], None

    def lookup(self, name: str) -> int | None:
        rec = self.name_record(name)
        if rec is None:
            return None
        try:
            return int(rec["gva"], 16)
        except ValueError:
            return None

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
        member = f"{secrets.token_hex(8)}:{str(holder.get('node', '')).encode().hex()}:" \
                 f"{int(holder.get('pid', 0))}:{int(holder.get('rank', 0))}"
        ttl = _args.ttl(ttl)
        ms = -1 if ttl is None else max(1, int(ttl * 1000))
        g = f"{gva:016x}"
        rc = self._call(self._acquire, keys=[self._k("w", g), self._k("l", g), self._k("c", g)],
                        args=[member, ms, str(generation)])
        if rc == 1:
            return member
        why = {-1: "is not published (or its owner's heartbeat expired)", -2: "is closing: no new leases",
               -3: "moved to another generation"}.get(int(rc), f"refused the lease ({rc})")
        raise WindowRetiredError(f"window gva {gva:#x} {why}", generation=generation)

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
        t1 = time.monotonic_ns()
        res, reap = [], []
        for i in range(0, len(out), 3):
            member = out[i].decode() if isinstance(out[i], bytes) else str(out[i])
            parts = member.split(":")
            try:
                node, pid, rank = bytes.fromhex(parts[1]).decode(), int(parts[2]), int(parts[3])
            except (IndexError, ValueError):
                reap.append(member)  # not a member this directory wrote
                continue
            state, rec, _ = self._judge(rank, out[i + 2], t1)
            if state is MemberState.GONE or (state is MemberState.PRESENT and not (
                    isinstance(rec, dict) and rec.get("pid") == pid and rec.get("node") == node)):
                reap.append(member)
                continue
            res.append((pid, float(out[i + 1]) / 1000.0))
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

    def get_entry(self, key: str) -> dict[str, Any] | None:
        val = self._get(self._k("e", check_entry_key(key)), strict=False)
        return None if val is None else val["v"]

    def remove_entry(self, key: str) -> None:
        rkey = self._k("e", check_entry_key(key))
        self._own_drop([rkey])
        self._call(self.client.delete, rkey)

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
               f"{'signed' if self._mac_key else 'unsigned'} rank={self._rank} incarnation={self.incarnation}>"


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
