"""The ``redis://`` directory: many nodes share one real Redis server (redis-py client).

Keys, all under ``memsem:<job>:`` (the job namespaces everything):

=======================  ======================================================================
key                      value
=======================  ======================================================================
``rank:<r>``             rank record (pid, start, node, token); ``SET NX PX ttl``, refreshed by
                         the owner's heartbeat: a rank whose key expired belongs to a dead node
``w:<gva hex>``          window record (WindowInfo JSON), same TTL, refreshed by the heartbeat,
                         so a dead node's windows disappear within the TTL
``n:<name hex>``         name -> gva alias, same TTL
``e:<entry key>``        engine rendezvous entries (RDMA QP numbers), same TTL
``ev:<entry key>``       pub/sub channel (no key): ``put_entry`` publishes an empty message on
                         it; a watch (``watch_entries``) subscribes to ``ev:<prefix>*``
``l:<gva hex>``          leases of consumers on any node: sorted set, member
                         ``<lease id>:<node hex>:<pid>:<holder rank>``, score = expiry in ms of
                         the server's clock (9e15 = until released); reaped when expired or when
                         the holder's rank key is gone
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
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

from memsem import _args
from memsem._errors import MemsemError, PeerLostError, StaleReferenceError
from memsem.directory._base import Directory, EntryWatch, RecordCodec, check_entry_key, secret_keys, unseal_key
from memsem.directory.local import default_job

log = logging.getLogger(__name__)

DEFAULT_TTL = 10.0
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

# Lua: unexpired leases of live holders, reaping the others; optionally set the closing flag in
# the same atomic step (so a consumer either sees "closing" or is counted here: never neither).
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
  if rank and redis.call('EXISTS', ARGV[1] .. rank) == 0 then
    redis.call('ZREM', KEYS[1], m[i])
  else
    table.insert(out, m[i])
    table.insert(out, tostring(tonumber(m[i + 1]) - now))
  end
end
return out
"""

# Lua: refresh the rank key only while it still holds this runtime's token. KEYS: rank key.
# ARGV: token, ttl ms. Returns 1 refreshed, 0 lost.
_BEAT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
if not string.find(raw, ARGV[1], 1, true) then return 0 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""


class RedisDirectory(Directory):
    """Directory of many nodes on a Redis server.

    Args:
        url: ``redis://[:password@]host:port/db``, ``rediss://`` (TLS) or ``unix://path?db=N``.
        job: namespace (``MEMSEM_JOB``, default "default").
        alive: unused here (liveness is the rank key's TTL); kept for the common signature.
        ttl: heartbeat TTL in seconds (``MEMSEM_HEARTBEAT_TTL``, default 10): a node silent for
            this long is dead, its ranks, windows and entries expire.
        secret: job secret (``MEMSEM_JOB_SECRET``); bytes or str. None: entries are unsigned.
        timeout: socket timeout of every Redis command, seconds.

    Raises:
        NotSupportedError: redis-py is not installed (``pip install 'redis>=5'``).
        PeerLostError: the server does not answer.

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
        self.url = url
        self.prefix = f"memsem:{self.job}:"
        if secret is None:
            secret = os.environ.get("MEMSEM_JOB_SECRET") or None
        self._mac_key, self._seal_key = secret_keys(secret)
        self._codec = RecordCodec(secret, "redis")
        self._redis = redis
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           health_check_interval=30)
        try:
            self.client.ping()
        except redis.RedisError as exc:
            self.client.close()
            raise PeerLostError(f"redis directory {_safe_url(url)} does not answer: {exc}") from exc
        self._acquire = self.client.register_script(_ACQUIRE)
        self._renew = self.client.register_script(_RENEW)
        self._holders = self.client.register_script(_HOLDERS)
        self._beat = self.client.register_script(_BEAT)
        self._lock = threading.Lock()
        self._own: set[str] = set()  # keys this runtime refreshes (windows, names, entries)
        self._rank: int | None = None
        self._token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.lost_rank = False  #: set when the heartbeat found the rank key gone (stalled > TTL)

    # -- signing (the one codec of directories that span nodes: _base.RecordCodec) ----------------
    def _encode(self, key: str, record: Any, access_key: bytes | None = None) -> str:
        return self._codec.encode(key, record, access_key)

    def _decode(self, key: str, raw: bytes | str | None, *, strict: bool = True) -> dict[str, Any] | None:
        return self._codec.decode(key, raw, strict=strict)

    def _get(self, key: str, *, strict: bool = True) -> dict[str, Any] | None:
        return self._decode(key, self._call(self.client.get, key), strict=strict)

    def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._redis.RedisError as exc:
            raise PeerLostError(f"redis directory {_safe_url(self.url)} failed: {exc}") from exc

    def _k(self, kind: str, ident: str) -> str:
        return f"{self.prefix}{kind}:{ident}"

    # -- ranks ------------------------------------------------------------------------------------
    def claim_rank(self, record: dict[str, Any]) -> int:
        rec = dict(record, token=self._token)
        for rank in range(_MAX_RANKS):
            key = self._k("rank", str(rank))
            if self._call(self.client.set, key, self._encode(key, dict(rec, rank=rank)), nx=True, px=self._ttl_ms):
                self._rank = rank
                self._start_heartbeat()
                return rank
        raise MemsemError(f"no free rank in redis directory {_safe_url(self.url)} job {self.job!r}")

    def release_rank(self, rank: int) -> None:
        key = self._k("rank", str(rank))
        self._stop.set()
        val = self._decode(key, self._call(self.client.get, key), strict=False)
        if val is not None and val["v"].get("token") == self._token:
            self._call(self.client.delete, key)
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

    def owner_alive(self, rank: int, pid: int, start: int, node: str) -> bool:
        """Whether rank ``rank`` is still held (heartbeat not expired) by that process."""
        try:
            val = self._get(self._k("rank", str(rank)), strict=False)
        except PeerLostError:
            return True  # the directory is unreachable: that says nothing about the owner
        if val is None:
            return False
        v = val["v"]
        return v.get("pid") == pid and v.get("node") == node and int(v.get("start", 0)) == int(start)

    # -- heartbeat --------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                            name=f"memsem-redis-heartbeat-{self.job}")
            self._thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            rank = self._rank
            if rank is None:
                continue
            try:
                self.heartbeat(rank)
            except MemsemError as exc:  # a Redis hiccup: retry next beat, never die silently
                log.warning("memsem heartbeat to %s failed: %s", _safe_url(self.url), exc)

    def heartbeat(self, rank: int) -> None:
        """Refresh the rank key (only while it still holds this runtime's token) and every
        window, name and entry this runtime wrote."""
        key = self._k("rank", str(rank))
        if not self._call(self._beat, keys=[key], args=[self._token, self._ttl_ms]):
            if not self.lost_rank:
                log.error("memsem rank %d of job %r expired in %s (this process stalled longer than "
                          "the heartbeat TTL of %.1f s): its windows vanished for other nodes",
                          rank, self.job, _safe_url(self.url), self.ttl)
            self.lost_rank = True
            return
        with self._lock:
            own = list(self._own)
        if own:
            pipe = self.client.pipeline(transaction=False)
            for k in own:
                pipe.pexpire(k, self._ttl_ms)
            self._call(pipe.execute)

    # -- windows ----------------------------------------------------------------------------------
    def put_window(self, gva: int, name: str, record: dict[str, Any], key: bytes | None = None) -> None:
        wkey = self._k("w", f"{gva:016x}")
        pipe = self.client.pipeline(transaction=True)
        pipe.set(wkey, self._encode(wkey, record, key), px=self._ttl_ms)
        pipe.delete(self._k("c", f"{gva:016x}"))
        keys = [wkey]
        if name:
            nkey = self._k("n", name.encode().hex())
            pipe.set(nkey, self._encode(nkey, f"{gva:016x}"), px=self._ttl_ms)
            keys.append(nkey)
        self._call(pipe.execute)
        with self._lock:
            self._own.update(keys)

    def remove_window(self, gva: int, name: str) -> None:
        wkey = self._k("w", f"{gva:016x}")
        keys = [wkey, self._k("l", f"{gva:016x}"), self._k("c", f"{gva:016x}")]
        if name and self.lookup(name) == gva:
            keys.append(self._k("n", name.encode().hex()))
        self._call(self.client.delete, *keys)
        with self._lock:
            self._own.difference_update(keys)

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
        val = self._get(self._k("n", name.encode().hex()))
        return None if val is None else int(val["v"], 16)

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
            StaleReferenceError: the window is gone, closing, or at another generation.
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
        raise StaleReferenceError(f"window gva {gva:#x} {why}", expected=generation)

    def renew_lease(self, gva: int, member: str, ttl: float | None) -> bool:
        """Extend an unexpired lease to ``ttl`` s from now (server clock); False when it was lost."""
        ttl = _args.ttl(ttl)
        ms = -1 if ttl is None else max(1, int(ttl * 1000))
        return bool(self._call(self._renew, keys=[self._k("l", f"{gva:016x}")], args=[member, ms]))

    def release_lease(self, gva: int, member: str) -> None:
        self._call(self.client.zrem, self._k("l", f"{gva:016x}"), member)

    def lease_holders(self, gva: int, *, closing: bool = False) -> list[tuple[int, float]]:
        """``(holder pid, seconds left)`` of unexpired leases of live holders (reaping the
        others). ``closing``: first mark the window closing (no new leases), atomically."""
        g = f"{gva:016x}"
        out = self._call(self._holders, keys=[self._k("l", g), self._k("c", g)],
                         args=[self._k("rank", ""), "1" if closing else "0", max(self._ttl_ms, 600_000)])
        res = []
        for i in range(0, len(out), 2):
            member = out[i].decode() if isinstance(out[i], bytes) else str(out[i])
            left = float(out[i + 1]) / 1000.0
            res.append((int(member.split(":")[2]), left))
        return res

    def reopen_window(self, gva: int) -> None:
        """Clear the closing flag (the owner gave up unpublishing: leases still held)."""
        self._call(self.client.delete, self._k("c", f"{gva:016x}"))

    # -- entries ----------------------------------------------------------------------------------
    def put_entry(self, key: str, record: dict[str, Any]) -> None:
        """Store ``record`` under ``key`` (with the heartbeat TTL) and wake the watches of its
        prefixes (a publish on ``ev:<key>``, pipelined with the write)."""
        rkey = self._k("e", check_entry_key(key))
        pipe = self.client.pipeline(transaction=False)
        pipe.set(rkey, self._encode(rkey, record), px=self._ttl_ms)
        pipe.publish(self._k("ev", key), b"")
        self._call(pipe.execute)
        with self._lock:
            self._own.add(rkey)

    def get_entry(self, key: str) -> dict[str, Any] | None:
        val = self._get(self._k("e", check_entry_key(key)), strict=False)
        return None if val is None else val["v"]

    def remove_entry(self, key: str) -> None:
        rkey = self._k("e", check_entry_key(key))
        self._call(self.client.delete, rkey)
        with self._lock:
            self._own.discard(rkey)

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
        self._closed = True
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.ttl)
        self.client.close()

    def __repr__(self) -> str:
        return f"<RedisDirectory {_safe_url(self.url)} job={self.job!r} ttl={self.ttl}s " \
               f"{'signed' if self._mac_key else 'unsigned'}>"


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


__all__ = ["DEFAULT_TTL", "RedisDirectory"]
