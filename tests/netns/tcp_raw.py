"""The tcp engine's protocol spoken by hand (raw sockets), for tests that act as a hostile or
broken peer: half headers, stalls, floods, forged proofs."""
from __future__ import annotations

import resource
import socket
import struct

from memsem.engines.tcp import _wire as W
from memsem.gva import RefSpec, credential_proof, credential_token


def connect(endpoint: str, *, kind: int = W.KIND_DATA, hello: bool = True,
            timeout: float = 20) -> tuple[socket.socket, bytes]:
    """A connection to an owner: its hello read (the nonce), ours sent when ``hello``."""
    host, port = W.split_endpoint(endpoint)
    s = socket.create_connection((host, port), timeout=timeout)
    magic, proto, status, nonce = W.HELLO.unpack(recv_exact(s, W.HELLO.size))
    assert magic == W.MAGIC and proto == W.PROTOCOL and status == W.HELLO_OK, (magic, proto, status)
    if hello:
        s.sendall(W.CHELLO.pack(W.MAGIC, W.PROTOCOL, kind))
    return s, nonce


def recv_exact(s: socket.socket, n: int) -> bytes:
    b = b""
    while len(b) < n:
        k = s.recv(n - len(b))
        if not k:
            raise EOFError(f"closed after {len(b)} of {n} bytes")
        b += k
    return b


def reply(s: socket.socket) -> tuple[tuple, bytes]:
    """The next reply header and its text (or data) body."""
    head = W.REP.unpack(recv_exact(s, W.REP.size))
    body = recv_exact(s, head[5]) if head[0] != W.DATA and head[5] else b""
    return head, body


def closed_by_peer(s: socket.socket, timeout: float = 30) -> bool:
    """Whether the owner closes ``s`` within ``timeout`` s (what it sent meanwhile is dropped).
    A bounded wait for an event, not a measured bound."""
    try:
        s.settimeout(timeout)
        while True:
            if not s.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def open_body(spec: RefSpec, nonce: bytes, handle: int, *, proof: bytes | None = None,
              token: bytes | None = None) -> bytes:
    tok = credential_token(spec) if token is None else token
    pf = credential_proof(spec.key, nonce + struct.pack("<H", handle), tok) if proof is None else proof
    return tok + pf


def open_handle(s: socket.socket, nonce: bytes, spec: RefSpec, handle: int = 1, rid: int = 1, **kw) -> tuple:
    body = open_body(spec, nonce, handle, **kw)
    s.sendall(W.REQ.pack(W.OP_OPEN, 0, handle, rid, 0, len(body), 0, 0) + body)
    return reply(s)


def endpoint_of(rt, ref) -> str:
    return rt.resolve(ref.spec).remote.endpoint


def raise_nofile(n: int) -> int:
    """Raise this process's open-file limit to at least ``n`` where the hard limit allows (root
    may raise the hard limit too); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= n:
        return soft
    want = max(n, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
