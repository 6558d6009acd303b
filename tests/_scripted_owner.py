"""A scripted tcp owner: a real listening socket that speaks memsem's tcp protocol
(memsem.engines.tcp._wire) and answers each request as a test script says, so the consumer's
side (TcpEngine, its connections, the kept route) can be tried against replies no memsem owner
sends: bare OKs, wrong ids, huge numbers, trickled bytes, stalls.

A script is ``answer(req) -> reply``; ``req`` is a :class:`Request` (op, handle, rid, offset,
nbytes, arg, wait_ms, body: an OPEN's credential, a PUT's payload or a DIGEST's runs, read whole). The reply is
bytes sent at once, a list of ``(bytes, pause_s)`` sent piece by piece (trickled), ``None``
(nothing: a stall until the connection ends) or the helpers below. OPEN is answered OK unless
``scripts_open`` is set; CLOSE, UNWATCH and UNPIN are never answered.
"""
from __future__ import annotations

import dataclasses
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from memsem.engines import Credential, Descriptor
from memsem.engines.tcp import _wire as W


@dataclasses.dataclass
class Request:
    op: int
    handle: int
    rid: int
    offset: int
    nbytes: int
    arg: int
    wait_ms: int
    body: bytes


def data_reply(req: Request, payload: bytes, version: int) -> bytes:
    """A GET's plain reply: DATA, the bytes, the OK trailer."""
    return (W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, len(payload)) + payload
            + W.REP.pack(W.OK, 0, req.handle, req.rid, version, 0))


def ok(req: Request, value: int = 1) -> bytes:
    return W.REP.pack(W.OK, 0, req.handle, req.rid, value, 0)


def outcome(req: Request, status: int, value: int) -> bytes:
    return W.REP.pack(W.OUTCOME, status, req.handle, req.rid, value, 0)


def trickle(data: bytes, every_s: float, piece: int = 1) -> list[tuple[bytes, float]]:
    return [(data[i:i + piece], every_s) for i in range(0, len(data), piece)]


class ScriptedOwner:
    """A listening owner on 127.0.0.1 answering by ``script`` (see the module docstring);
    ``hello`` may replace the owner's hello (bytes, or a trickle list). Use as a context
    manager; ``requests`` lists every request received, in order."""

    def __init__(self, script: Callable[[Request], Any], *, hello: Any = None, body_after: float = 0.0,
                 rcvbuf: int = 0) -> None:
        self.script = script
        self.hello = hello
        #: seconds the owner waits after a request's header before it reads the body (a PUT's
        #: payload then stays in the consumer's socket buffer meanwhile)
        self.body_after = body_after
        self.requests: list[Request] = []
        #: the script answers OPEN too (else OPEN is answered OK)
        self.scripts_open = False
        self.connections = 0
        self._ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:  # set before listen: accepted connections advertise this window
            self._ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._ls.bind(("127.0.0.1", 0))
        self._ls.listen(16)
        self._ls.settimeout(0.2)
        self.port = self._ls.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def __enter__(self) -> "ScriptedOwner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        for s in list(self._socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._thread.join(5)
        self._ls.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                s, _ = self._ls.accept()
            except OSError:
                continue
            self.connections += 1
            self._socks.append(s)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _send(self, s: socket.socket, reply: Any) -> None:
        if reply is None:
            self._stop.wait(60)  # a stall: nothing more on this connection
            return
        if isinstance(reply, (bytes, bytearray)):
            s.sendall(reply)
            return
        for piece, pause in reply:
            if self._stop.is_set():
                return
            s.sendall(piece)
            time.sleep(pause)

    def _recv(self, s: socket.socket, n: int) -> bytes:
        out = b""
        while len(out) < n:
            k = s.recv(n - len(out))
            if not k:
                raise ConnectionError("closed")
            out += k
        return out

    def _serve(self, s: socket.socket) -> None:
        try:
            self._send(s, self.hello if self.hello is not None
                       else W.HELLO.pack(W.MAGIC, W.PROTOCOL, W.HELLO_OK, secrets.token_bytes(16)))
            self._recv(s, W.CHELLO.size)
            while not self._stop.is_set():
                op, _, handle, rid, off, n, arg, wait_ms = W.REQ.unpack(self._recv(s, W.REQ.size))
                if op == W.OP_PUT and self.body_after:
                    time.sleep(self.body_after)
                body = self._recv(s, n) if op in (W.OP_OPEN, W.OP_PUT, W.OP_WATCH, W.OP_DIGEST) else b""
                req = Request(op, handle, rid, off, n, arg, wait_ms, body)
                self.requests.append(req)
                if op in (W.OP_CLOSE, W.OP_UNWATCH, W.OP_UNPIN):
                    continue
                self._send(s, ok(req) if op == W.OP_OPEN and not self.scripts_open else self.script(req))
        except (OSError, ConnectionError):
            pass


def remote_of(engine: Any, owner: ScriptedOwner, nbytes: int) -> Any:
    """A region of ``nbytes`` at the scripted owner, as ``engine`` attaches a window's."""
    token = b"MSTK" + (0x1000).to_bytes(8, "little") + bytes(20)
    desc = Descriptor("tcp", {"endpoint": owner.endpoint, "rank": 0, "pid": 1, "start": 1, "node": "scripted"})
    return engine.attach(desc, nbytes, Credential(token, lambda challenge: bytes(16)))


def ops(owner: ScriptedOwner, op: int) -> list[Request]:
    """The requests of ``op`` the owner received."""
    return [r for r in owner.requests if r.op == op]
