"""The tcp engine's wire: frames, ops, statuses, the bounds of a connection, and the one
receive/send primitive with a deadline that both sides use.

Little endian throughout::

    on connect   owner -> consumer  HELLO  "MSTC" | protocol u16 | status u16 | nonce 16 B
                                           (status FULL: the nonce field is cap u32 | open u32
                                           | 0 u64, and the owner closes the connection)
                 consumer -> owner  HELLO  "MSTC" | protocol u16 | kind u16 (0 data, 1 watch)
    request      op u8 | 0 u8 | handle u16 | req_id u32 | offset u64 | nbytes u64 | arg u64 |
                 wait_ms u32 | 0 u32                                   (40 bytes), then a body:
                 OPEN: token | proof (nbytes of it); PUT: nbytes of data; WATCH: targets
    reply        status u8 | flags u8 | handle u16 | req_id u32 | value u64 | nbytes u64 (24 B),
                 then nbytes of data (DATA) or of a message (UTF-8)
    GET          DATA + the bytes + a trailer reply (OK, value = the version read, or OUTCOME)
    EVENT        owner -> consumer on a watch connection: value = n entries of
                 kind u8 | 0 u24 | index u32 | value u64

Ops: OPEN (handle: the consumer's number for a credential on this connection; the body is the
credential's token and its proof for the challenge ``nonce | handle``), CLOSE (no reply), GET
(arg: the version asked for, 0 the latest; wait_ms: how long the owner may wait for an open
write section, capped by the owner), PUT, MARK / CLEAR (offset: the tile; a MARK whose arg is
``rows | total << 32`` counts rows of the tile instead, reply OK with the rows written so far:
the owner marks it once complete), WATCH / UNWATCH
(watch connections; UNWATCH has no reply), SYNC (watch connections: the words of the handle's
subscription that changed since they were last sent, as EVENT, then OK: a consumer that wrote a
word through its data connection reads its own write once SYNC returns), PIN (arg: the version to hold, 0 the latest;
offset: the ttl in ms, capped by the owner; wait_ms as for GET; reply OK with the version
held: the owner's writer does not overwrite it until UNPIN, the ttl, or the end of the
session that holds it), UNPIN (arg: the version; no reply).

Statuses: OK (value: the version moved), DATA, OUTCOME (the owner's native outcome: ``flags``
is its ``MEMSEM_RC_*`` status, ``value`` the value that comes with it; the engine carries it
and never interprets it), DENIED (the owner's checks refused the request: the message says
why; after a refused credential the owner closes the connection), FULL (the owner serves its
maximum of connections; value: the cap; it closes the connection), ERROR (a message), EVENT.

Every read and write of either side goes through :func:`recv_some` / :func:`send_some`; the
consumer's blocking forms :func:`read_exact` / :func:`write_all` carry a deadline checked at
every slice of the socket's receive/send timeout, whatever byte the peer stalls at.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from memsem.native import lib as _lib

_monotonic = time.monotonic

MAGIC = b"MSTC"
PROTOCOL = 3
KIND_DATA, KIND_WATCH = 0, 1
HELLO_OK, HELLO_FULL = 0, 1
HELLO = struct.Struct("<4sHH16s")
CHELLO = struct.Struct("<4sHH")
FULL_INFO = struct.Struct("<II8x")
REQ = struct.Struct("<BBHIQQQI4x")
REP = struct.Struct("<BBHIQQ")
TGT = struct.Struct("<B3xII")
EVT = struct.Struct("<B3xIQ")
H16 = struct.Struct("<H")

OP_OPEN, OP_CLOSE, OP_GET, OP_PUT, OP_MARK, OP_CLEAR, OP_WATCH, OP_UNWATCH, OP_PIN, OP_UNPIN, OP_SYNC, OP_DIGEST = range(1, 13)
#: one run of a DIGEST request's body: ``(offset, nbytes)``
RUN = struct.Struct("<QQ")
#: runs one DIGEST request may carry (its body: ``RUN.size`` bytes each)
MAX_DIGEST_RUNS = 1 << 16
#: reservations (PIN) one grant holds at once
MAX_PINS = 8
OK, DATA, OUTCOME, DENIED, FULL, ERROR, EVENT = range(7)
#: the native status an engine reports for chunks of one transfer that saw two versions
TORN_STATUS = _lib.MEMSEM_RC_TORN
STATUS_NAMES = {OK: "OK", DATA: "DATA", OUTCOME: "OUTCOME", DENIED: "DENIED", FULL: "FULL",
                ERROR: "ERROR", EVENT: "EVENT"}
#: the native statuses an owner's OUTCOME may carry (``MEMSEM_RC_*`` of native/memsem_native.h,
#: carried, never interpreted); anything else is a protocol violation
OWNER_OUTCOMES = frozenset(range(_lib.MEMSEM_RC_CLOSED, _lib.MEMSEM_RC_CHECK_FIRST + 1)) | {_lib.MEMSEM_RC_VERSION_RANGE}
#: the errno an OUTCOME of status ``MEMSEM_RC_ERRNO`` may carry (Linux errnos are below 4096)
ERRNO_MAX = 4095
#: the largest version a window has (``MEMSEM_VERSION_MAX``): the most an OK of a GET, PUT or PIN
#: may name
VERSION_MAX = _lib.MEMSEM_VERSION_MAX

#: transfers larger than this go as chunks of this size, pipelined
CHUNK_BYTES = 1 << 20
#: requests in flight per connection in a pipelined transfer
PIPELINE_DEPTH = 8
#: GETs and PUTs of at most this many bytes are copied in one native call on the owner
SMALL_BYTES = 1 << 16
#: bytes one PUT request may carry (the owner closes the connection beyond)
MAX_PUT_BYTES = 64 << 20
#: bodies of OPEN and WATCH, and the text of a reply
MAX_OPEN_BODY = 512
MAX_WATCH_TARGETS = 16
MAX_ERROR_TEXT = 4096
#: handles (opened credentials) the owner keeps per connection; a consumer keeps at most
#: CLIENT_HANDLES open per connection and closes the least recently used beyond
MAX_HANDLES = 4096
CLIENT_HANDLES = 1024
#: entries per EVENT frame (more changes go in more frames)
MAX_EVENTS = 4096
#: slice of every blocking receive and send of a consumer (seconds): its deadline and the
#: owner's liveness are checked between slices
POLL_SLICE = 0.1
DEFAULT_TIMEOUT = 30.0


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What bounds each phase of a connection on the owner (seconds unless said otherwise).

    Attributes:
        grace_s: from accept to the first credential that verifies (sshd's LoginGraceTime);
            the hello and the OPEN must arrive within it. ``MEMSEM_TCP_GRACE_S``.
        stall_s: a request whose first byte arrived must arrive whole (header and OPEN/WATCH
            body) within this; a PUT's payload must make progress at least this often.
            ``MEMSEM_TCP_STALL_S``.
        send_s: a reply (or pushed event) being sent must make progress at least this often,
            else the connection is closed (a copy bracket is never held while waiting: see
            the server). ``MEMSEM_TCP_SEND_S``.
        max_wait_s: the longest wait a request may ask for (``wait_ms`` of a GET/PUT meeting
            an open write section); None: the owner runtime's timeout. ``MEMSEM_TCP_MAX_WAIT_S``.
        idle_s: a data connection with no request in progress for this long is closed
            (gRPC's max_connection_idle); so is a watch connection without subscriptions.
            ``MEMSEM_TCP_IDLE_S``.
        user_timeout_s: TCP_USER_TIMEOUT: sent data unacknowledged this long ends the
            connection (keepalive alone never runs while data is unacknowledged).
            ``MEMSEM_TCP_USER_TIMEOUT_S``.
        keepalive: TCP keepalive idle, interval (seconds) and probe count: a silent peer that
            vanished is noticed within idle + interval x count.
        max_connections: connections an owner serves at once (clamped to the process's open
            file limit); beyond, a connection is answered FULL. ``MEMSEM_TCP_MAX_CONNECTIONS``.
        max_preauth: connections not authenticated yet; beyond, the oldest is closed to admit
            a new one (sshd's MaxStartups), so unauthenticated floods never lock out a
            consumer that authenticates. ``MEMSEM_TCP_MAX_PREAUTH``.
    """

    grace_s: float = 10.0
    stall_s: float = 10.0
    send_s: float = 10.0
    max_wait_s: float | None = None
    idle_s: float = 300.0
    user_timeout_s: float = 10.0
    keepalive: tuple[int, int, int] = (1, 1, 3)
    max_connections: int = 4096
    max_preauth: int = 128

    @classmethod
    def from_env(cls) -> "Bounds":
        """Defaults, overridden by the ``MEMSEM_TCP_*`` settings named above.

        Raises:
            ValueError: a setting that is not a positive number (naming it).
        """
        kw: dict[str, Any] = {}
        for field, env in (("grace_s", "GRACE_S"), ("stall_s", "STALL_S"), ("send_s", "SEND_S"),
                           ("max_wait_s", "MAX_WAIT_S"), ("idle_s", "IDLE_S"),
                           ("user_timeout_s", "USER_TIMEOUT_S")):
            v = env_number(f"MEMSEM_TCP_{env}", float)
            if v is not None:
                kw[field] = v
        for field, env in (("max_connections", "MAX_CONNECTIONS"), ("max_preauth", "MAX_PREAUTH")):
            v = env_number(f"MEMSEM_TCP_{env}", int)
            if v is not None:
                kw[field] = v
        return cls(**kw)

    def connection_cap(self) -> int:
        """``max_connections``, at most the open-file limit less a reserve for everything else."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - 64 - soft // 8))


def env_number(name: str, kind: type) -> Any:
    """A positive number from the environment, or None when unset or empty.

    Raises:
        ValueError: not a number of ``kind`` > 0 (the message names the setting).
    """
    raw = os.environ.get(name, "") or ""
    if not raw:
        return None
    try:
        v = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be a {kind.__name__} > 0, got {raw!r}") from None
    if not v > 0:
        raise ValueError(f"{name} must be a {kind.__name__} > 0, got {raw!r}")
    return v


class Closed(Exception):
    """The connection ended or must end (the peer closed it, a protocol violation, a bound ran
    out). Private to the engine: it never leaves it."""


def configure(sock: socket.socket, bounds: Bounds, slice_s: float | None) -> None:
    """TCP_NODELAY, keepalive and TCP_USER_TIMEOUT; ``slice_s``: a blocking socket whose
    receives and sends return after at most that long (the consumer), None: non-blocking
    (the owner's event loop)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = bounds.keepalive
    for opt, v in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                   ("TCP_USER_TIMEOUT", int(bounds.user_timeout_s * 1000))):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)
    if slice_s is None:
        sock.setblocking(False)
        return
    sock.settimeout(None)
    sec = int(slice_s)
    tv = struct.pack("ll", sec, int((slice_s - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)  # cheaper than Python's timeouts,
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)  # which poll before every call


def recv_some(sock: socket.socket, mv: Any) -> int:
    """One receive into ``mv``: the bytes received, 0 when none are there now (or the slice of
    a blocking socket passed).

    Raises:
        Closed: the peer closed the connection. OSError: it failed (reset, timed out).
    """
    try:
        k = sock.recv_into(mv)
    except (BlockingIOError, InterruptedError):
        return 0
    if not k:
        raise Closed("the peer closed the connection")
    return k


def send_some(sock: socket.socket, data: Any) -> int:
    """One send of (a prefix of) ``data``: the bytes sent, 0 when the socket takes none now.

    Raises:
        OSError: the connection failed (reset, broken pipe, timed out).
    """
    try:
        return sock.send(data)
    except (BlockingIOError, InterruptedError):
        return 0


def read_exact(sock: socket.socket, mv: memoryview, deadline: float, waited: Callable[[float], None],
               at_least: int | None = None) -> int:
    """Fill ``mv`` (or at least its first ``at_least`` bytes, taking what else is there) from a
    blocking socket with a receive slice; ``waited(deadline)`` runs whenever a slice passed
    with nothing, whatever byte the peer stalls at, and after any receive that leaves bytes
    missing once ``deadline`` (``time.monotonic()``) has passed, so a peer that trickles its
    bytes faster than the slice is cut at the deadline too (``waited`` raises to end the
    wait). Returns the bytes received.

    Raises:
        Closed, OSError: as :func:`recv_some`; whatever ``waited`` raises.
    """
    need = len(mv) if at_least is None else at_least
    try:  # the first receive inline: most replies are there whole
        got = sock.recv_into(mv)
    except (BlockingIOError, InterruptedError):
        got = 0
    else:
        if not got:
            raise Closed("the peer closed the connection")
    while got < need:
        k = recv_some(sock, mv[got:])
        got += k
        if got < need and (not k or _monotonic() >= deadline):
            waited(deadline)
    return got


def write_all(sock: socket.socket, data: Any, deadline: float, waited: Callable[[float], None]) -> None:
    """Send all of ``data`` (bytes-like, 1-byte items) on a blocking socket with a send slice;
    ``waited(deadline)`` runs whenever a slice passed with nothing sent (a peer that stopped
    reading), and after any send that leaves bytes unsent once ``deadline`` has passed (a peer
    that reads a little at a time is cut at the deadline too).

    Raises:
        OSError: as :func:`send_some`; whatever ``waited`` raises.
    """
    try:  # the first send inline: most requests go whole
        sent = sock.send(data)
    except (BlockingIOError, InterruptedError):
        sent = 0
    n = len(data)
    if sent == n:
        return
    mv = memoryview(data)
    while sent < n:
        k = send_some(sock, mv[sent:])
        sent += k
        if sent < n and (not k or _monotonic() >= deadline):
            waited(deadline)


def events(handle: int, changes: list[tuple[int, int, int]]) -> bytes:
    """EVENT frames carrying ``changes`` (at most MAX_EVENTS entries each)."""
    out = []
    for i in range(0, len(changes), MAX_EVENTS):
        part = changes[i:i + MAX_EVENTS]
        out.append(REP.pack(EVENT, 0, handle, 0, len(part), len(part) * EVT.size))
        out.extend(EVT.pack(k, idx, v) for k, idx, v in part)
    return b"".join(out)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of ``tcp://host:port``.

    Raises:
        ValueError: not of that form (naming the descriptor field).
    """
    rest = endpoint[len("tcp://"):] if endpoint.startswith("tcp://") else endpoint
    host, sep, port = rest.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not sep or not host or not 0 < p < 65536:
        raise ValueError(f"tcp descriptor field 'endpoint' must be tcp://host:port, got {endpoint!r}")
    return host.strip("[]"), p


__all__ = [
    "Bounds", "CHUNK_BYTES", "Closed", "MAX_PUT_BYTES", "PIPELINE_DEPTH", "SMALL_BYTES", "configure",
    "events", "read_exact", "recv_some", "send_some", "split_endpoint", "write_all",
]
