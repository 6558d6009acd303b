"""The ``ray`` directory: a job launched by Ray finds its windows through Ray itself.

Chosen automatically when memsem starts inside a Ray job (a driver after ``ray.init``, or any
Ray worker: task or actor) and no directory is named, or with ``directory="ray"``. Nothing
else is started or set: no Redis server, no job secret.

**Where the records live: one named detached actor per job.** The actor
(``memsem-directory:<Ray namespace>:<Ray job id>`` in Ray namespace ``_memsem``, created by the
first runtime of the Ray job
with ``get_if_exists``, ``num_cpus=0``, on the head node) holds the job's records in its memory
(:class:`memsem.directory._ray_state.DirectoryState`). Ray's own key-value store was the other
candidate; it was not chosen because its Python API (``ray.experimental.internal_kv``) is
internal, has no expiry, no atomic read-modify-write beyond "put unless present", and no way
to wait for a change: rank claims with reservations, name claims that check the holder's
liveness, leases read atomically with the "closing" flag, and TTLs on one clock all need a
server that runs a step atomically, as Redis runs a Lua script. An actor runs its methods one at
a time on one event loop, with its own monotonic clock, so each directory operation is one
atomic step there, and a long-poll method gives entry watches without polling.

The actor lives on the head node (``node:__internal_head__``), so it shares the fate of Ray's
GCS: when the head goes, the Ray cluster goes. It is restarted by Ray if its process dies
(``max_restarts=-1``); its records are then gone for a moment, which every runtime treats as a
directory outage (below): it re-claims its rank with its incarnation and writes its records
again. It exits by itself once nothing of the job has been held for ``idle_s`` seconds (every
runtime closed or dead, every reservation expired), so a long-lived cluster keeps no directory
of finished jobs; a runtime that comes later makes a new one.

One actor serves every memsem job of its Ray job (a TransferQueue instance has a job of its
own): records are namespaced by the memsem job inside it, as in Redis.

**Keys and the job secret.** The records, their keys (``memsem:<job>:rank:<r>``, ``w:<gva>``,
``n:<name>``, ``e:<key>``, ``hold:<r>``, ``c:<gva>``) and their encoding (``RecordCodec``: an
HMAC over each key name and value, a window's access key sealed) are the ``redis``
directory's. The secret is the job's own: the runtime that creates the actor draws 32 random
bytes and passes them as the actor's constructor argument (kept by Ray for restarts), and every
runtime of the job reads it from the actor once. So ``Runtime.lookup(name)`` works across nodes
with nothing set, and the trust domain is the one Ray already draws: whoever can call actors in
the cluster, i.e. whoever can run code on the Ray cluster (which can run anything on
every node anyway: docs/threat-model.md). ``MEMSEM_JOB_SECRET`` (or ``secret=``) overrides it:
then the actor holds only sealed keys and MACed records, and a Ray user without the secret can
neither read access keys nor forge records, as with Redis.

**Liveness and membership** are the ``redis`` directory's (docs/many-nodes.md,
"Membership"): each runtime's rank record carries its token and incarnation and expires after
the heartbeat TTL (``MEMSEM_HEARTBEAT_TTL``, default 10 s) on the actor's clock; one thread per
runtime beats every TTL/3 (one actor call refreshes the rank and every record the runtime wrote,
re-claims an expired rank with the same incarnation and writes expired records again) and
re-reads the ranks it watches every TTL/10; an absent record is believed (GONE) only after
the directory answered smoothly for a TTL (:mod:`memsem.directory._membership`). A rank stays
reserved for its holder for ``RESERVE_TTLS`` TTLs after its last heartbeat. A removed Ray node's
runtimes stop beating: their ranks, windows and entries expire within the TTL, and owners on
other nodes reap their leases.

**Waiting for entries** (``watch_entries``): the watch is registered in the actor before it is
handed out; ``put_entry`` marks every watch of a prefix of its key; ``EntryWatch.wait`` is one
long-poll call to the actor that returns when its watch is marked, when ``wake`` marks it, or
at its timeout. An actor that restarted forgets watches: the next wait returns True ("read
again") and registers the watch anew.

Addresses: the tcp engine advertises this node's Ray address (``ray.util.get_node_ip_address``),
which the other nodes of the cluster reach. Inside a Ray job a runtime that names no engines
enables ``tcp`` too (``MEMSEM_ENGINES`` overrides), so windows on other nodes are reachable.

Environment: ``MEMSEM_JOB`` (default: ``ray-<Ray job id>``), ``MEMSEM_JOB_SECRET``,
``MEMSEM_HEARTBEAT_TTL``; a process that is not a Ray worker (a subprocess a worker started)
opens the job's directory with ``RAY_ADDRESS`` (the GCS address) and ``MEMSEM_RAY_SCOPE`` (the
Ray job), which :func:`child_env` gives it. Two Ray jobs that must share windows set the same
``MEMSEM_RAY_SCOPE`` (and ``MEMSEM_JOB``).
"""
from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from typing import Any, Callable

from memsem import _args
from memsem._errors import MemsemError, NotSupportedError, PeerLostError
from memsem.directory._base import EntryWatch, RecordCodec, check_entry_key
from memsem.directory._membership import DEFAULT_TTL, SpanningDirectory

log = logging.getLogger(__name__)

#: the actor exits once nothing of its job was held for this long (seconds), at least 2 TTLs
DEFAULT_IDLE_S = 120.0
#: Ray namespace of every directory actor (the Ray job is named in the actor's name: a detached
#: actor in the job's anonymous namespace would make Ray warn, and a child of the job that is a
#: driver of its own, like the TransferQueue agent, has another namespace and job id)
ACTOR_NAMESPACE = "_memsem"
_FOREVER = None  # lease ttl "until released"


def in_ray_job() -> bool:
    """Whether this process runs inside a Ray job (a connected driver or a Ray worker). Looks
    only at an already imported ``ray``: never imports it."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported or foreign 'ray' module is not a Ray job
        return False


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise NotSupportedError("the ray directory needs Ray in this process: pip install 'ray>=2.9'") from exc
    return ray


def _connect(ray: Any) -> bool:
    """Make sure this process is connected to a Ray cluster; True when this call connected it."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        raise NotSupportedError("the ray directory needs a Ray job: call ray.init() first, run inside a Ray "
                                "task or actor, or set RAY_ADDRESS and MEMSEM_RAY_SCOPE for a process started "
                                "by one (memsem.directory.child_env gives both)")
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, ignore_reinit_error=True)
    return True


def job_identity(job: str | None = None, scope: str | None = None) -> tuple[str, str]:
    """``(memsem job, scope)`` of this process's Ray job. The scope names the directory actor:
    ``scope`` or ``MEMSEM_RAY_SCOPE`` or ``<Ray namespace>:<Ray job id>``, the same in the
    driver and every worker of one Ray job and different for every other. The memsem job
    (the records' namespace inside it): ``job`` or ``MEMSEM_JOB`` or ``ray-<Ray job id>``.
    Connects to Ray first when this process is not (``RAY_ADDRESS``)."""
    ray = _import_ray()
    _connect(ray)
    ctx = ray.get_runtime_context()
    scope = scope or os.environ.get("MEMSEM_RAY_SCOPE") or f"{ctx.namespace}:{ctx.get_job_id()}"
    return (job or os.environ.get("MEMSEM_JOB") or f"ray-{ctx.get_job_id()}"), scope


def child_env(job: str | None = None) -> dict[str, str]:
    """Environment a process started from this Ray job (not itself a Ray worker) needs to open
    the same directory: ``MEMSEM_DIRECTORY=ray``, ``MEMSEM_JOB``, ``RAY_ADDRESS`` (the GCS
    address) and ``MEMSEM_RAY_SCOPE`` (which actor: a child that connects to Ray is a driver
    of a Ray job of its own)."""
    ray = _import_ray()
    job, scope = job_identity(job)
    return {"MEMSEM_DIRECTORY": "ray", "MEMSEM_JOB": job, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "MEMSEM_RAY_SCOPE": scope}


_ACTOR_CLASS: Any = None
_ACTOR_LOCK = threading.Lock()


def _actor_class(ray: Any) -> Any:
    """``ray.remote(DirectoryActor)``, made once per process (Ray is imported only when used;
    the class is pickled by reference: memsem is installed wherever the job runs)."""
    global _ACTOR_CLASS
    with _ACTOR_LOCK:
        if _ACTOR_CLASS is None:
            from memsem.directory._ray_state import DirectoryActor

            _ACTOR_CLASS = ray.remote(DirectoryActor)
        return _ACTOR_CLASS


class RayDirectory(SpanningDirectory):
    """Directory of a Ray job, held by a named detached actor (see the module docstring).

    Args:
        job: namespace of the records (``MEMSEM_JOB``; default ``ray-<Ray job id>``, the same
            in the driver and every worker of the job).
        alive: ``alive(record) -> bool`` of a process of this node: a name held by a dead
            process of this node is taken over before its heartbeat expires.
        ttl: heartbeat TTL, seconds (``MEMSEM_HEARTBEAT_TTL``, default 10): a runtime silent
            for this long is gone, its rank, windows and entries expire.
        secret: job secret (``MEMSEM_JOB_SECRET``); None: the job's own, kept by the actor.
        timeout: seconds any call to the actor may take (the membership thread's calls use
            ``MEMBER_TIMEOUT_TTLS`` TTLs, at most this).
        scope: the Ray job whose actor holds the records (``MEMSEM_RAY_SCOPE``; default
            ``<Ray namespace>:<Ray job id>`` of this process).
        idle_s: seconds the actor stays once nothing of the job is held (when this runtime
            creates it).
        start_timeout: seconds the actor may take to be ready (it is a new Ray worker process
            when this runtime creates it).

    Raises:
        NotSupportedError: Ray is not installed, or this process is not in a Ray job and
            ``RAY_ADDRESS`` is not set.
        PeerLostError: the actor could not be created or does not answer within ``timeout``.

    Attributes:
        incarnation: this runtime's incarnation (None before ``claim_rank``).
        reclaims: how many times the heartbeat re-claimed the rank after its record expired.
        restored: how many of this runtime's records it wrote again after they expired.
        lost_rank: True once another runtime took the rank (this one can publish nothing more).
        actor_name: the actor's name (in Ray namespace ``ACTOR_NAMESPACE``).

    Thread safety: every method may be called from several threads.
    """

    url = "ray"
    kind = "ray"

    def __init__(self, *, job: str | None = None, alive: Callable[[dict[str, Any]], bool] | None = None,
                 ttl: float | None = None, secret: bytes | str | None = None, timeout: float = 10.0,
                 scope: str | None = None, idle_s: float | None = None, start_timeout: float = 60.0) -> None:
        ray = self._ray = _import_ray()
        job, self.scope = job_identity(job, scope)
        self.timeout = _args.timeout(timeout, "timeout", positive=True)
        if secret is None:
            secret = os.environ.get("MEMSEM_JOB_SECRET") or None
        self._setup(job=job, ttl=ttl, timeout=self.timeout, secret=secret, alive=alive,
                    where=f"the ray directory of job {job!r}")
        #: seconds the actor may take to start (a new Ray worker process) when this runtime makes it
        self.start_timeout = _args.timeout(start_timeout, "start_timeout", positive=True)
        self._idle_s = max(2 * self.ttl, DEFAULT_IDLE_S if idle_s is None else _args.timeout(idle_s, "idle_s"))
        self.actor_name = f"memsem-directory:{self.scope}"
        self._errors = ray.exceptions
        self._actor_lock = threading.Lock()
        self._actor: Any = None
        #: the secret an actor this runtime creates is given: the job's own once read from the
        #: actor (so a re-created actor keeps it and records written again stay valid); with a
        #: hand-set secret a random one, never the hand-set secret itself
        self._actor_secret = secrets.token_hex(32)
        self._resolve()
        if secret is None:
            self._actor_secret = self._call("secret")
            self._codec = RecordCodec(self._actor_secret, self.kind)

    # -- the actor --------------------------------------------------------------------------------
    def _resolve(self) -> Any:
        """Get (or create) the job's actor; a handle whose actor died for good is replaced."""
        ray = self._ray
        cls = _actor_class(ray)
        try:
            actor = cls.options(
                name=self.actor_name, namespace=ACTOR_NAMESPACE, get_if_exists=True, lifetime="detached",
                num_cpus=0, max_restarts=-1, max_concurrency=10_000,
                resources={"node:__internal_head__": 0.001},
                scheduling_strategy="DEFAULT",  # never inside the caller's placement group
            ).remote(self._actor_secret, self._idle_s)
            ray.get(actor.__ray_ready__.remote(), timeout=self.start_timeout)
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here; one memsem error
            raise PeerLostError(f"the ray directory of job {self.job!r} could not be reached or created within "
                                f"{self.start_timeout:g} s (actor {self.actor_name!r} in namespace "
                                f"{ACTOR_NAMESPACE!r}): {exc}") from exc
        with self._actor_lock:
            self._actor = actor
        return actor

    def _call(self, method: str, *args: Any, timeout: float | None = None, observe: bool = False) -> Any:
        """One call to the actor (PeerLostError when it fails or takes longer than ``timeout``).
        An actor that died for good (it left when idle, or was killed) is made again once."""
        t = self.timeout if timeout is None else timeout
        if not self._ray.is_initialized():  # shut down here: a call would start a new local Ray (auto-init)
            raise PeerLostError(f"the ray directory of job {self.job!r} is out of reach: Ray is shut down "
                                f"in this process ({method})")
        for attempt in (0, 1):
            with self._actor_lock:
                actor = self._actor
            t0 = time.monotonic_ns()
            try:
                out = self._ray.get(actor.call.remote(method, *args), timeout=t)
            except self._errors.ActorDiedError as exc:
                self._views.observe(t0, time.monotonic_ns(), False)
                if attempt == 0:
                    self._resolve()
                    continue
                raise PeerLostError(f"the ray directory of job {self.job!r} is gone: {exc}") from exc
            except self._errors.GetTimeoutError as exc:
                self._views.observe(t0, time.monotonic_ns(), False)
                raise PeerLostError(f"the ray directory of job {self.job!r} did not answer {method} within "
                                    f"{t:g} s") from exc
            except self._errors.RayError as exc:
                self._views.observe(t0, time.monotonic_ns(), False)
                raise PeerLostError(f"the ray directory of job {self.job!r} failed ({method}): {exc}") from exc
            if observe:
                self._views.observe(t0, time.monotonic_ns(), True)
            return out
        raise AssertionError("unreachable")  # pragma: no cover

    def _mcall(self, method: str, *args: Any) -> Any:
        """A call of the membership thread: short timeout, observed for smoothness."""
        return self._call(method, *args, timeout=self.member_timeout, observe=True)

    def _get_raw(self, key: str) -> str | None:
        return self._call("get", key)

    def _scan(self, kind: str) -> dict[str, dict[str, Any]]:
        out = {}
        for key, raw in sorted(self._call("scan", self._k(kind, "")).items()):
            val = self._codec.decode(key, raw, strict=False)
            if val is not None:
                out[key] = val
        return out

    # -- ranks ------------------------------------------------------------------------------------
    def claim_rank(self, record: dict[str, Any]) -> int:
        """Claim the lowest rank that is neither held nor reserved for another runtime; the
        record gets this runtime's token and a new incarnation. Starts the heartbeat."""
        for _ in range(64):  # another runtime may take the reserved rank's record first: retry
            rank, inc = self._call("reserve_rank", self.prefix, self._token, self._reserve_s)
            key = self._k("rank", str(rank))
            value = self._codec.encode(key, dict(record, token=self._token, rank=rank, incarnation=inc))
            rc = self._call("claim", key, self._k("hold", str(rank)), value, self._token, self.ttl, self._reserve_s, inc)
            if rc == 1:
                self._rank, self._rank_value, self.incarnation = rank, value, inc
                self._start_thread()
                return rank
        raise MemsemError(f"no rank could be claimed in the ray directory of job {self.job!r}")

    def release_rank(self, rank: int) -> None:
        self._stop.set()
        self._call("release", self._k("rank", str(rank)), self._k("hold", str(rank)), self._token)
        if rank == self._rank:
            self._rank = None

    def ranks(self) -> dict[int, dict[str, Any]]:
        return {int(k.rsplit(":", 1)[1]): v["v"] for k, v in self._scan("rank").items()}

    # -- membership (memsem.directory._membership) ----------------------------------------------
    def _read_ranks(self, ranks: list[int]) -> list[dict[str, Any] | None]:
        keys = [self._k("rank", str(r)) for r in ranks]
        return [self._rank_of(r, raw) for r, raw in zip(ranks, self._mcall("mget", keys))]

    def _ping(self) -> None:
        self._mcall("ping")

    # -- heartbeat --------------------------------------------------------------------------------
    def heartbeat(self, rank: int) -> None:
        """Refresh the rank record and every record this runtime wrote, in one actor call: a
        rank record that expired while this runtime lived is re-claimed with the same
        incarnation, records that expired are written again, records another value replaced
        are no longer refreshed; a rank another runtime took is lost for good (``lost_rank``).

        Raises:
            PeerLostError: the actor did not answer within ``member_timeout``.
        """
        with self._lock:
            own = dict(self._own)
        rc, restored, replaced = self._mcall("beat", self._k("rank", str(rank)), self._k("hold", str(rank)),
                                             self._rank_value, self._token, self.ttl, self._reserve_s,
                                             self.incarnation or 0, own)
        if rc == -1:
            self._lose(rank)
            return
        if rc == 2:
            self._reclaimed(rank)
        if restored or replaced:
            with self._lock:
                self.restored += len([k for k in restored if k in self._own])
                for k in replaced:
                    if self._own.get(k) == own.get(k):
                        self._own.pop(k, None)

    # -- windows ----------------------------------------------------------------------------------
    def put_window(self, gva: int, name: str, record: dict[str, Any], key: bytes | None = None) -> None:
        """Publish (or replace) window ``gva``'s record, sealing ``key`` in, and ``name``'s
        record pointing at it, in one step."""
        self._check_rank()
        wkey = self._k("w", f"{gva:016x}")
        values = {wkey: self._codec.encode(wkey, record, key)}
        if name:
            nkey = self._k("n", name.encode().hex())
            values[nkey] = self._codec.encode(nkey, self._name_value(name, gva, record))
        self._call("put", values, self.ttl, [self._k("c", f"{gva:016x}")])
        self._own_put(values)

    def remove_window(self, gva: int, name: str, *, pause: Callable[[], None] | None = None) -> None:
        """Remove window ``gva``'s record and leases, and ``name``'s record while it still
        points at ``gva`` (a successor's name is never removed)."""
        g = f"{gva:016x}"
        keys = [self._k("w", g), self._k("l", g), self._k("c", g)]
        nkey = self._k("n", name.encode().hex()) if name else ""
        self._own_drop(keys + [nkey])  # first: the heartbeat writes no removed record again
        if nkey:
            self._call("drop_name", nkey, g)
        self._call("delete", keys)

    def windows(self) -> list[dict[str, Any]]:
        return [v["v"] for v in self._scan("w").values()]

    # -- names ------------------------------------------------------------------------------------
    def _claim_name_step(self, nkey: str, value: str, replace: bool, dead: str) -> str | None:
        return self._call("claim_name", nkey, value, self._k("rank", ""), self._token, self.ttl, replace, dead)

    # -- leases across nodes ----------------------------------------------------------------------
    def acquire_lease(self, gva: int, generation: int, holder: dict[str, Any], ttl: float | None) -> str:
        """Record a lease on window ``gva`` at ``generation``; returns its member id.

        ``holder``: ``{"node", "pid", "rank"}`` of the consumer. ``ttl`` seconds on the
        actor's clock (None: until released; reaped when the holder's rank is gone).

        Raises:
            WindowRetiredError: the window is gone, closing, or at another generation.
        """
        member = self._lease_member(holder)
        ttl = _args.ttl(ttl)
        g = f"{gva:016x}"
        rc = self._call("acquire_lease", self._k("w", g), self._k("l", g), self._k("c", g), member, ttl, int(generation))
        if rc == 1:
            return member
        raise self._lease_refused(gva, rc, generation)

    def renew_lease(self, gva: int, member: str, ttl: float | None) -> bool:
        """Extend an unexpired lease to ``ttl`` s from now (actor clock); False when it was lost."""
        return bool(self._call("renew_lease", self._k("l", f"{gva:016x}"), member, _args.ttl(ttl)))

    def release_lease(self, gva: int, member: str) -> None:
        self._call("release_lease", self._k("l", f"{gva:016x}"), member)

    def lease_holders(self, gva: int, *, closing: bool = False) -> list[tuple[int, float]]:
        """``(holder pid, seconds left)`` of unexpired leases of live holders. ``closing``: first
        mark the window closing (no new leases), in the same step. A holder counts as live
        while its rank record names it, and while it is absent but not yet GONE (it may be
        re-claiming it after a directory outage); the leases of gone holders are reaped."""
        g = f"{gva:016x}"
        lkey = self._k("l", g)
        out = self._call("lease_holders", lkey, self._k("c", g), self._k("rank", ""), bool(closing),
                         max(self.ttl, 600.0))
        res, reap = self._live_leases([(member, float(left), raw) for member, left, raw in out])
        if reap:
            self._call("reap_leases", lkey, reap)
        return res

    def reopen_window(self, gva: int) -> None:
        """Clear the closing flag (the owner gave up unpublishing: leases still held)."""
        self._call("delete", [self._k("c", f"{gva:016x}")])

    # -- entries ----------------------------------------------------------------------------------
    def put_entry(self, key: str, record: dict[str, Any]) -> None:
        """Store ``record`` under ``key`` (with the heartbeat TTL) and wake the watches of its
        prefixes, in one step."""
        self._check_rank()
        rkey = self._k("e", check_entry_key(key))
        value = self._codec.encode(rkey, record)
        self._call("put_entry", rkey, value, self.ttl, key)
        self._own_put({rkey: value})

    def _delete(self, keys: list[str]) -> None:
        if keys:
            self._call("delete", keys)

    def entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        head = self._k("e", "")
        return {k[len(head):]: v["v"] for k, v in self._scan("e").items() if k[len(head):].startswith(prefix)}

    def watch_entries(self, prefix: str) -> EntryWatch:
        """A watch woken by ``put_entry`` of keys under ``prefix`` (a long-poll on the actor;
        see the module docstring).

        Raises:
            ValueError: ``prefix`` is not a valid entry key prefix.
            PeerLostError: the actor did not register the watch.
        """
        return _ActorWatch(self, check_entry_key(prefix))

    # -- misc -------------------------------------------------------------------------------------
    def advertise_host(self) -> str | None:
        """This node's address in the Ray cluster (the other nodes reach it)."""
        try:
            return self._ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - no address known: the engine decides
            return None

    def close(self) -> None:
        """Stop the heartbeat (the rank is released by ``release_rank``); safe twice. The actor
        stays for the job's other runtimes (it leaves by itself when the job holds nothing)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.ttl)

    def __repr__(self) -> str:
        return f"<RayDirectory job={self.job!r} actor={self.actor_name!r} " \
               f"ttl={self.ttl:g}s rank={self._rank} incarnation={self.incarnation}>"


class _ActorWatch(EntryWatch):
    """``EntryWatch`` over the directory actor: a watch registered there, waited on with one
    long-poll call per ``wait``, woken by ``put_entry`` of its prefix or by ``wake``."""

    def __init__(self, d: RayDirectory, prefix: str) -> None:
        super().__init__()
        self._d = d
        self._prefix = prefix
        self._wid = d._call("watch", prefix)

    def wait(self, timeout: float) -> bool:
        timeout = _args.timeout(timeout)
        if self._closed:
            return super().wait(timeout)
        d = self._d
        with d._actor_lock:
            actor = d._actor
        try:
            fired = d._ray.get(actor.wait_watch.remote(self._wid, timeout), timeout=timeout + d.timeout)
        except d._errors.RayError:
            return super().wait(timeout)  # the actor is away: "look again" after a short pause
        if fired is None:  # the actor restarted (or dropped the watch): register it again
            try:
                self._wid = d._call("watch", self._prefix)
            except PeerLostError:
                pass
            return True
        return bool(fired)

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
        super().wake()
        try:
            with self._d._actor_lock:
                actor = self._d._actor
            actor.call.remote("wake", self._wid)  # no wait: the waiter's call returns
        except Exception:  # noqa: BLE001 - the waiter's slice ends within its timeout anyway
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            with self._d._actor_lock:
                actor = self._d._actor
            actor.call.remote("unwatch", self._wid)
        except Exception:  # noqa: BLE001 - the actor drops watches nobody waits on
            pass


__all__ = ["ACTOR_NAMESPACE", "DEFAULT_TTL", "RayDirectory", "child_env", "in_ray_job", "job_identity"]
