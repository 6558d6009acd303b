"""The directory interface: where windows are published and owners announce liveness.

A directory stores JSON-able records (window descriptors, rank records); it never holds tensor
data. It knows nothing about what a record means: the GVA layer above parses them.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
from typing import Any, Callable

from memsem import _args
from memsem._errors import AccessDeniedError, NotSupportedError

_ENTRY_KEY = re.compile(r"[A-Za-z0-9._/-]{1,200}")


def check_entry_key(key: str) -> str:
    """Validate an entry key: 1..200 characters of ``[A-Za-z0-9._/-]`` (ValueError otherwise)."""
    if not isinstance(key, str) or not _ENTRY_KEY.fullmatch(key):
        raise ValueError(f"entry key must be 1..200 characters of [A-Za-z0-9._/-], got {key!r}")
    return key


def seal_key(seal_key: bytes, context: str, access_key: bytes) -> str:
    """An access key sealed for holders of the job secret (``seal_key`` is derived from it):
    hex of ``nonce | key XOR HMAC-SHA256(seal_key, context | 0 | nonce)``. ``context`` binds it
    to where it is stored (a record name), so it cannot be moved to another record."""
    nonce = secrets.token_bytes(16)
    pad = hmac.new(seal_key, context.encode() + b"\0" + nonce, hashlib.sha256).digest()
    return (nonce + bytes(a ^ b for a, b in zip(access_key, pad))).hex()


def unseal_key(seal_key: bytes, context: str, sealed: str) -> bytes:
    """The access key of ``seal_key(...)``'s output; ValueError when malformed."""
    raw = bytes.fromhex(sealed)
    if len(raw) not in (32, 48):  # a 16-byte key, or the key and a 16-byte mint MAC
        raise ValueError(f"a sealed access key has 32 or 48 bytes, got {len(raw)}")
    nonce, ct = raw[:16], raw[16:]
    pad = hmac.new(seal_key, context.encode() + b"\0" + nonce, hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(ct, pad))


def secret_keys(secret: bytes | str | None) -> tuple[bytes | None, bytes | None]:
    """``(mac key, seal key)`` derived from a job secret (None, None without one)."""
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        return None, None
    return (hmac.new(secret, b"memsem-mac", hashlib.sha256).digest(),
            hmac.new(secret, b"memsem-seal", hashlib.sha256).digest())


class RecordCodec:
    """How directories that span nodes store a record: ``{"v": record, "s": MAC, "k": sealed
    key}`` as compact JSON. With a job secret each value carries an HMAC-SHA256 (key derived
    from the secret) over its storage key name, the sealed access key and the record, and a
    window's access key is sealed for holders of the secret (``seal_key``); without one values
    are plain ``{"v": record}`` and no access key is stored. The one codec of the ``redis`` and
    ``ray`` directories.

    Args:
        secret: the job secret (bytes or str), or None.
        where: the directory's name in error messages.
    """

    def __init__(self, secret: bytes | str | None, where: str) -> None:
        self.mac_key, self.seal_key = secret_keys(secret)
        self.where = where

    @property
    def signed(self) -> bool:
        """True with a job secret: values are MACed and access keys can be sealed."""
        return self.mac_key is not None

    def _sign(self, key: str, payload: str, sealed: str) -> str:
        return hmac.new(self.mac_key, f"{key}\n{sealed}\n{payload}".encode(), hashlib.sha256).hexdigest()

    def encode(self, key: str, record: Any, access_key: bytes | None = None) -> str:
        """The stored value of ``record`` under ``key`` (``access_key`` sealed in, with a secret)."""
        payload = json.dumps(record, sort_keys=True, separators=(",", ":"))
        out: dict[str, Any] = {"v": record}
        if self.mac_key is not None:
            sealed = ""
            if access_key is not None:
                sealed = seal_key(self.seal_key, key, access_key)
                out["k"] = sealed
            out["s"] = self._sign(key, payload, sealed)
        return json.dumps(out, separators=(",", ":"))

    def decode(self, key: str, raw: bytes | str | None, *, strict: bool = True) -> dict[str, Any] | None:
        """The verified value stored at ``key`` (``{"v":..., "k":...}``), None when absent.

        Raises:
            AccessDeniedError: (``strict``) the value is not a memsem value or fails its MAC
                (forged, or written without the job secret); not strict: logged, None.
        """
        if raw is None:
            return None
        try:
            out = json.loads(raw)
            if not isinstance(out, dict) or "v" not in out:
                raise ValueError("not a memsem entry")
        except ValueError:
            return self._reject(key, "is not a memsem entry", strict)
        if self.mac_key is not None:
            sig = out.get("s")
            payload = json.dumps(out["v"], sort_keys=True, separators=(",", ":"))
            if not isinstance(sig, str) or not hmac.compare_digest(sig, self._sign(key, payload, out.get("k", ""))):
                return self._reject(key, "fails its HMAC: forged, or written without the job secret", strict)
        return out

    def unseal(self, key: str, value: dict[str, Any]) -> bytes | None:
        """The access key sealed in a decoded value, None when there is none (or no secret)."""
        if self.seal_key is None or not value.get("k"):
            return None
        try:
            return unseal_key(self.seal_key, key, value["k"])
        except ValueError:
            return None

    def _reject(self, key: str, why: str, strict: bool) -> None:
        msg = f"{self.where} directory entry {key!r} {why}"
        if strict:
            raise AccessDeniedError(msg)
        logging.getLogger("memsem.directory").warning("%s; ignored", msg)
        return None


class EntryWatch:
    """A bounded wait for entries under one prefix to be put (``Directory.watch_entries``).

    ``wait(timeout)`` blocks until an entry whose key starts with the prefix was put (created or
    replaced) since the watch was made or since the previous ``wait`` returned, or until
    ``wake()`` was called, or ``timeout`` seconds passed. It returns True when something may
    have changed and False when the timeout passed with nothing seen. It is a hint, never an
    answer: read the directory after every wait, whatever it returned. Make the watch *before*
    the read or write it guards (scan, then wait; write a request, then wait for its reply), so
    a put after that read always wakes the waiter.

    This base class is the fallback for directories that cannot notify (and for a notifier that
    cannot be set up here): each wait sleeps at most ``POLL_S`` and returns True, so the caller
    re-reads that often. ``local`` (inotify on the job folder) and ``redis`` (pub/sub) notify.

    Thread safety: one thread waits (and closes); ``wake`` may be called from any thread, also
    after ``close``. Use as a context manager, or ``close()`` it (safe twice).
    """

    #: seconds a fallback wait sleeps before it says "look again"
    POLL_S = 0.002

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._woken = threading.Event()

    def wait(self, timeout: float) -> bool:
        """Block at most ``timeout`` seconds (see the class docstring); True: read again.

        Raises:
            TypeError / ValueError: ``timeout`` is not a finite number of seconds >= 0.
        """
        timeout = _args.timeout(timeout)
        self._woken.wait(min(timeout, self.POLL_S))
        self._woken.clear()
        return True

    def wake(self) -> None:
        """Make the current (or the next) ``wait`` return True now."""
        self._woken.set()

    def close(self) -> None:
        """Release what the watch holds; safe twice."""
        with self._lock:
            self._closed = True

    def __enter__(self) -> "EntryWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
class MemberState(enum.IntEnum):
    """What a directory knows of a rank's holder (see ``Directory.member``)."""

    #: this directory cannot tell (it keeps no liveness of its own, or never reached the rank)
    UNKNOWN = 0
    #: the rank's record is there: ``Member.record`` names the process and its incarnation
    PRESENT = 1
    #: the record is absent, but the directory has not answered smoothly for a whole re-claim
    #: grace since its last outage: the holder may still be re-claiming it (counted as alive)
    SUSPECT = 2
    #: the record is absent although the directory answered smoothly for at least the re-claim
    #: grace: the holder stopped refreshing it (dead, stalled or cut off). Not final: a holder
    #: that comes back and re-claims its rank with the same incarnation is PRESENT again.
    GONE = 3


@dataclasses.dataclass(frozen=True)
class Member:
    """A directory's last-known view of one rank.

    Attributes:
        state: see :class:`MemberState`.
        record: the rank record (``pid``, ``start``, ``node``, ``incarnation``, ...) when
            PRESENT, else None.
        age_s: seconds since the directory read it (the staleness of this view).
        detail: why the state is what it is, for error messages ("" when PRESENT).
    """

    state: MemberState
    record: dict[str, Any] | None = None
    age_s: float = 0.0
    detail: str = ""


def same_process(record: dict[str, Any] | None, pid: int, start: int, node: str) -> bool:
    """Whether a rank record names the process ``(pid, start, node)``."""
    if not isinstance(record, dict):
        return False
    try:
        return (int(record.get("pid", -1)) == int(pid) and int(record.get("start", 0)) == int(start)
                and record.get("node") == node)
    except (TypeError, ValueError):
        return False


class Directory(abc.ABC):
    """Control-plane store. Implementations: ``local`` (one machine, no server), ``redis``."""

    url: str = ""

    @abc.abstractmethod
    def claim_rank(self, record: dict[str, Any]) -> int:
        """Reserve a free rank for a new runtime (reaping ranks of dead owners); returns it."""

    @abc.abstractmethod
    def release_rank(self, rank: int) -> None:
        """Give up a rank claimed by this runtime."""

    @abc.abstractmethod
    def rank_record(self, rank: int) -> dict[str, Any] | None:
        """The record of a rank, or None when no runtime holds it."""

    @abc.abstractmethod
    def put_window(self, gva: int, name: str, record: dict[str, Any], key: bytes | None = None) -> None:
        """Publish (or replace) the record of window ``gva``; ``name`` ("" for none) aliases it.
        ``key`` (where ``seals_keys``): the access key, stored sealed for the job's members."""

    @abc.abstractmethod
    def remove_window(self, gva: int, name: str, *, pause: Callable[[], None] | None = None) -> None:
        """Remove a window record and its name record if it still points at ``gva`` (never a
        successor's). ``pause``: the caller's wait, called while the directory is busy."""

    @abc.abstractmethod
    def get_window(self, gva: int) -> dict[str, Any] | None:
        """The record of window ``gva``, or None."""

    @abc.abstractmethod
    def lookup(self, name: str) -> int | None:
        """GVA of the window published under ``name``, or None."""

    # -- names: one owner each ---------------------------------------------------------------
    def claim_name(self, name: str, gva: int, holder: dict[str, Any], *, replace: bool = False,
                   pause: Callable[[], None] | None = None) -> dict[str, Any] | None:
        """Bind ``name`` to window ``gva`` of ``holder`` (``pid``, ``start``, ``node``, ``rank``
        of the publishing runtime), atomically: when no record holds the name, ``holder`` does,
        its holder is dead (or its runtime closed), or ``replace``. Returns None when bound,
        else the live holder's record (nothing changed). ``pause``: the caller's wait, called
        while the directory is busy for a moment (it raises at its deadline)."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} cannot claim names")

    def name_record(self, name: str) -> dict[str, Any] | None:
        """The record of ``name``: ``gva`` (hex) of its window and its holder, or None."""
        gva = self.lookup(name)
        return None if gva is None else {"name": name, "gva": f"{gva:016x}"}

    @abc.abstractmethod
    def windows(self) -> list[dict[str, Any]]:
        """Every window record (for ``memsem topo``/``gc``)."""

    @abc.abstractmethod
    def ranks(self) -> dict[int, dict[str, Any]]:
        """Every rank record."""

    # -- small records for engines' connection setup (e.g. RDMA QP exchange) --------------------
    def put_entry(self, key: str, record: dict[str, Any]) -> None:
        """Store (or replace) a small JSON-able ``record`` under ``key`` (``[A-Za-z0-9._/-]``).

        Engines use entries to rendezvous (the rdma engine exchanges QP numbers and GIDs); the
        directory does not interpret them. Raises NotSupportedError where a backend lacks them."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} stores no entries")

    def get_entry(self, key: str) -> dict[str, Any] | None:
        """The record stored under ``key``, or None."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} stores no entries")

    def remove_entry(self, key: str) -> None:
        """Remove ``key`` if present."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} stores no entries")

    def entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every entry whose key starts with ``prefix``, by key."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} stores no entries")

    def watch_entries(self, prefix: str) -> EntryWatch:
        """A watch that wakes when an entry whose key starts with ``prefix`` is put (see
        :class:`EntryWatch`: make it before the read it guards, re-read after every wait).

        Engines wait on it instead of polling for a rendezvous record (the rdma engine's
        listener waits for connection requests, a consumer for the reply). The default polls
        (``EntryWatch.POLL_S``); ``local`` and ``redis`` notify.

        Raises:
            ValueError: ``prefix`` is not 1..200 characters of ``[A-Za-z0-9._/-]``.
        """
        check_entry_key(prefix)
        return EntryWatch()

    def heartbeat(self, rank: int) -> None:
        """Refresh this rank's liveness (no-op where pid liveness is enough)."""

    # -- capabilities of directories that span nodes (defaults: one node, none of them) ----------
    #: True when ``put_window(..., key=)`` keeps named windows' access keys for the job's
    #: members, so a process of the job can look a window up by name (local: in the 0700 job
    #: folder, sealed with the job secret when there is one; redis: only with a job secret)
    seals_keys: bool = False
    #: True when this directory holds leases of consumers on other nodes (redis)
    holds_leases: bool = False

    def window_with_key(self, gva: int) -> tuple[dict[str, Any] | None, bytes | None]:
        """``(record, access key)`` of window ``gva``; the key is None where it is not sealed in."""
        return self.get_window(gva), None

    #: seconds a reader keeps re-reading a record whose owner's rank is SUSPECT (its record
    #: expired during a directory outage and may be re-claimed): the bound of that delay
    reclaim_s: float = 0.0
    #: seconds between re-reads while waiting out ``reclaim_s``
    check_s: float = 0.05

    def member(self, rank: int) -> Member:
        """This directory's view of ``rank`` (heartbeat liveness of runtimes on other nodes).

        Never blocks for long: directories that span nodes answer from a view their own thread
        keeps current, stale by at most their check interval while the server answers (and
        the last-known state while it does not). Default: UNKNOWN (one node: pids decide)."""
        return Member(MemberState.UNKNOWN)

    def owner_alive(self, rank: int, pid: int, start: int, node: str) -> bool | None:
        """Whether ``rank`` is held now by that process, from ``member``: True/False, or None
        when this directory cannot tell (UNKNOWN, or SUSPECT: absent, maybe re-claiming)."""
        m = self.member(rank)
        if m.state is MemberState.PRESENT:
            return same_process(m.record, pid, start, node)
        return False if m.state is MemberState.GONE else None

    def acquire_lease(self, gva: int, generation: int, holder: dict[str, Any], ttl: float | None) -> str:
        """A lease on a window of another node, held here; returns its member id."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} holds no leases across "
                                "nodes (use redis://)")

    def renew_lease(self, gva: int, member: str, ttl: float | None) -> bool:
        raise NotSupportedError(f"directory {self.url or type(self).__name__} holds no leases")

    def release_lease(self, gva: int, member: str) -> None:
        raise NotSupportedError(f"directory {self.url or type(self).__name__} holds no leases")

    def lease_holders(self, gva: int, *, closing: bool = False) -> list[tuple[int, float]]:
        """``(pid, seconds left)`` of leases held here on window ``gva`` (``closing``: mark the
        window closing atomically, so no new lease is granted). Default: none."""
        return []

    def reopen_window(self, gva: int) -> None:
        """Undo ``lease_holders(closing=True)`` when the owner gave up unpublishing."""

    def advertise_host(self) -> str | None:
        """The address of this node that processes on other nodes reach (engines that serve
        over the network advertise it), or None where this directory does not know one."""
        return None

    def close(self) -> None:
        """Release connections; safe twice."""

    def __enter__(self) -> "Directory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
