"""TCP engine: one-sided get/put of windows owned by another node, on plain sockets.

memsem's own request/response protocol, checked by the owner. The owner's *runtime* validates
every credential and request (``EngineContext.serve_open`` and the grant it returns: access key,
generation, the ref's minted range and access, permission) and brackets every copy with the
window's seqlock; this engine only moves bytes, carries the credential (whose secret it never
sends) and carries the owner's native outcome back (``RemoteOutcome``), which it never
interprets. Standard library sockets; measured against asyncio streams and pyzmq in
docs/many-nodes.md.

Modules, one concern each:

* :mod:`._wire`: frames, ops, statuses, the :class:`Bounds` of every phase of a connection, and
  the one receive/send primitive with a deadline;
* :mod:`._client`: a consumer's connections (a data connection per thread and owner, a watch
  connection per runtime and owner), recycled handles, pipelined transfers;
* :mod:`._server`: the owner's event loop (epoll, one thread for every connection), dispatch by
  op;
* :mod:`._engine`: :class:`TcpEngine`, the wiring and the one error boundary.

**At the door.** The owner reads a request's fixed header, checks its handle (opened on this
connection with a valid proof), range and direction, and only then reads its body: a PUT whose
handle, range or access fails is answered and the connection closed without reading a byte of
its payload; bodies of OPEN and WATCH are bounded; a refused credential closes the connection,
and a window not served there is refused exactly like a wrong proof.

**Pipelining.** Transfers larger than ``CHUNK_BYTES`` are split into chunks with up to
``PIPELINE_DEPTH`` requests in flight on the connection (replies come in order); every chunk is
its own bracket at the owner and all must report the same version (else the transfer is torn:
the runtime makes it again); a failure drops the connection, so no late reply is taken for a
later request.

Environment: ``MEMSEM_TCP_HOST`` (address to bind and advertise; default: the local address
that routes to the directory's Redis host, else 127.0.0.1), ``MEMSEM_TCP_PORT`` (default: any
free port), and the owner's bounds ``MEMSEM_TCP_*`` (:class:`Bounds`).
"""
from memsem.engines.tcp._engine import ATTEMPTS, TcpEngine, TcpRemote
from memsem.engines.tcp._wire import CHUNK_BYTES, MAX_PUT_BYTES, PIPELINE_DEPTH, Bounds

__all__ = ["ATTEMPTS", "Bounds", "CHUNK_BYTES", "MAX_PUT_BYTES", "PIPELINE_DEPTH", "TcpEngine", "TcpRemote"]
