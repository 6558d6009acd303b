"""The rdma engine's connection manager: QP setup and exchange through the directory, reconnects.

Every engine instance has a random endpoint id ``ep``; an owner's descriptors name its ``ep``.
A consumer that needs a queue pair to an owner (``Connections.reconnect``):

1. watches its reply key, creates an RC QP (RESET) and writes
   ``rdma/<owner ep>/req/<own ep>.<seq>`` = ``{qpn, gid, lid, mtu, device, seq, node, pid}``;
2. the owner's listener thread (started at its first ``register``) is woken by the directory
   (``Directory.watch_entries`` on its prefix ``rdma/<owner ep>/``), creates a responder QP for
   that consumer (replacing an older one of the same consumer), moves it to RTS towards the
   consumer's QP, writes ``{qpn, gid, lid, mtu, seq}`` to ``rdma/<consumer ep>/rep/<owner ep>``
   and removes the request;
3. the consumer, woken by that write, reads the reply with its ``seq``, moves its QP to RTS and
   removes the reply. No answer within ``connect_timeout`` (``LOST_CONNECT_TIMEOUT`` after the
   peer was lost) raises PeerLostError.

Neither side polls the directory: each waits on a watch (inotify on the local directory's
folder, a Redis pub/sub pattern subscription; see ``memsem.directory``). A watch is made before
the scan or the write it guards, so a record put after it always wakes the waiter; each wait is
still bounded (``LISTEN_WAIT`` for the listener, the connect deadline for a consumer) and every
wake is followed by a read of the directory, so a lost notification costs at most one wait,
never a wrong answer.

One requester QP per (consumer engine, owner engine, device) serves every window of that
owner; all traffic is one-sided, so the owner's CPU is not involved after setup. A failed work
completion marks the connection broken and the next operation reconnects with a new request.
``close`` writes ``rdma/<owner ep>/bye/<own ep>`` so the owner destroys its side.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import types
from typing import Any

import numpy as np

from memsem._errors import EngineError, NotSupportedError, PeerLostError
from memsem.engines.rdma._verbs import Counters, Device, new_qp, pyverbs_error, qp_attr

log = logging.getLogger(__name__)

#: send queue depth of a requester QP (work requests in flight per connection)
SQ_DEPTH = 128
#: transfers up to this size go through the connection's registered bounce buffer
BOUNCE_BYTES = 1 << 18
DEFAULT_CONNECT_TIMEOUT = 10.0
#: after a peer was lost, reconnect attempts wait at most this long
LOST_CONNECT_TIMEOUT = 2.0
#: the listener's longest wait on its watch between two reads of its prefix (seconds): what a
#: lost notification could cost; ``close`` wakes it at once
LISTEN_WAIT = 1.0


class Conn:
    """Consumer-side requester QP to one owner engine on one device."""

    def __init__(self, key: tuple[str, str], dev: Device, owner: dict[str, Any]) -> None:
        self.key = key
        self.dev = dev
        self.owner = owner  # {"ep", "device", "node", "pid", ...}
        self.lock = threading.Lock()
        self.qp: Any = None
        self.cq: Any = None
        self.bounce = np.empty(BOUNCE_BYTES, np.uint8)
        self.bounce_mr: Any = None
        self.broken = True  # not connected yet
        self.lost = False  # last failure said the peer is gone
        self.seq = 0

    def label(self) -> str:
        o = self.owner
        return f"RDMA peer (pid {o.get('pid')} on node {o.get('node')!r}, {o.get('port')})"

    def destroy(self) -> None:
        for obj in (self.qp, self.cq):
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:  # already gone with its context
                    log.debug("closing %r failed: %s", obj, exc)
        self.qp = self.cq = None
        self.broken = True


class Connections:
    """Both sides of connection setup for one engine: the consumer's requester QPs (``get``,
    ``reconnect``) and the owner's listener with its responder QPs.

    Args:
        v: the pyverbs namespace (``_verbs.verbs()``).
        devices: the engine's opened devices (the first one answers requests naming none).
        ep: the engine's endpoint id.
        counters: the engine's counters (``connects``, ``served``).
        connect_timeout: bound in seconds of one connection setup.

    ``bind(directory, node)`` hands it the directory (the engine's, or its runtime's).
    Thread safety: every method may be called from several threads; ``reconnect`` expects the
    caller to hold ``conn.lock``.
    """

    def __init__(self, v: types.SimpleNamespace, devices: list[Device], ep: str, counters: Counters,
                 connect_timeout: float) -> None:
        self._v = v
        self._devices = devices
        self._by_name = {d.name: d for d in devices}
        self.ep = ep
        self._counts = counters
        self.connect_timeout = connect_timeout
        self.directory: Any = None
        self.node = ""
        self._lock = threading.Lock()
        self._conns: dict[tuple[str, str], Conn] = {}
        self._served: dict[str, tuple[int, Any]] = {}  # consumer ep -> (seq, QP)
        self._served_cq: dict[str, Any] = {}
        self._listener: threading.Thread | None = None
        self._watch: Any = None
        self._stop = threading.Event()
        self._closed = False

    def bind(self, directory: Any, node: str) -> None:
        self.directory = directory
        self.node = node

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"served_live": len(self._served),
                    "connections": sum(1 for c in self._conns.values() if not c.broken)}

    # -- consumer side ---------------------------------------------------------------------------
    def get(self, owner_ep: str, dev: Device, owner: dict[str, Any]) -> Conn:
        """The (possibly not yet connected) connection to ``owner_ep`` on ``dev``."""
        key = (owner_ep, dev.name)
        with self._lock:
            conn = self._conns.get(key)
            if conn is None:
                conn = self._conns[key] = Conn(key, dev, owner)
            return conn

    def reconnect(self, conn: Conn) -> None:
        """(Re)create ``conn``'s QP and exchange QP numbers with the owner. Holds ``conn.lock``.

        Raises:
            PeerLostError: the owner did not answer in time.
            NotSupportedError: no directory was bound.
            EngineError: the owner refused, or the device failed.
        """
        v = self._v
        d = self.directory
        if d is None:
            raise NotSupportedError("engine 'rdma' needs a directory to exchange QP numbers "
                                    "(use it from a Runtime, or pass directory=)")
        conn.destroy()
        dev = conn.dev
        try:
            if conn.bounce_mr is None:
                conn.bounce_mr = v.MR(dev.pd, conn.bounce.nbytes, v.e.IBV_ACCESS_LOCAL_WRITE,
                                      address=conn.bounce.ctypes.data)
            conn.cq = v.CQ(dev.ctx, SQ_DEPTH + 8)
        except v.PyverbsError as exc:
            raise pyverbs_error(exc, f"setting up an RDMA connection on {dev.name}") from exc
        conn.qp = new_qp(v, dev, conn.cq, max_send_wr=SQ_DEPTH)
        conn.seq += 1
        owner_ep = conn.key[0]
        reply_key = f"rdma/{self.ep}/rep/{owner_ep}"
        req_key = f"rdma/{owner_ep}/req/{self.ep}.{conn.seq}"
        limit = LOST_CONNECT_TIMEOUT if conn.lost else self.connect_timeout
        rep = None
        with d.watch_entries(reply_key) as watch:  # before the request: its reply always wakes us
            d.remove_entry(reply_key)
            d.put_entry(req_key, dict(dev.endpoint(), qpn=int(conn.qp.qp_num), seq=conn.seq,
                                      device=conn.owner.get("device"), node=self.node, pid=os.getpid()))
            deadline = time.monotonic() + limit
            while True:
                rec = d.get_entry(reply_key)
                if rec is not None and int(rec.get("seq", -1)) == conn.seq:
                    rep = rec
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                watch.wait(left)
        d.remove_entry(reply_key)
        if rep is None:
            d.remove_entry(req_key)
            conn.destroy()
            conn.lost = True
            raise PeerLostError(f"{conn.label()} did not answer an RDMA connection request within "
                                f"{limit:.1f} s (owner dead or its runtime closed)")
        if "error" in rep:
            conn.destroy()
            raise EngineError(f"{conn.label()} refused the RDMA connection: {rep['error']}",
                              name="RDMA_CONNECT")
        try:
            conn.qp.to_rts(qp_attr(v, dev, rep))
        except v.PyverbsError as exc:
            conn.destroy()
            raise pyverbs_error(exc, f"moving an RC QP to RTS towards {conn.label()}") from exc
        conn.broken = conn.lost = False
        self._counts.add("connects")

    # -- owner side: the listener ----------------------------------------------------------------
    def start_listener(self) -> None:
        """Start the owner's listener thread (once; not without a directory)."""
        with self._lock:
            if self._listener is not None or self.directory is None or self._closed:
                return
            # made here, before the thread's first read: nothing put after it is missed
            self._watch = self.directory.watch_entries(f"rdma/{self.ep}/")
            self._listener = threading.Thread(target=self._listen, args=(self._watch,), daemon=True,
                                              name=f"memsem-rdma-listen-{self.ep}")
            self._listener.start()

    def _listen(self, watch: Any) -> None:
        d = self.directory
        prefix = f"rdma/{self.ep}/"
        try:
            while not self._stop.is_set():
                try:
                    ents = d.entries(prefix)
                except Exception as exc:  # directory hiccup: retry, never die silently
                    log.warning("rdma listener: reading the directory failed: %s", exc)
                    ents = {}
                for key, rec in sorted(ents.items(), key=lambda kv: int(kv[1].get("seq", 0))):
                    kind, _, rest = key[len(prefix):].partition("/")
                    try:
                        if kind == "req":
                            self._serve(rest.rsplit(".", 1)[0], rec)
                            d.remove_entry(key)
                        elif kind == "bye":
                            self._drop_served(rest)
                            d.remove_entry(key)
                    except Exception as exc:  # a directory hiccup: the next round retries
                        log.warning("rdma listener: handling %s failed: %s", key, exc)
                if self._stop.is_set():
                    break
                watch.wait(LISTEN_WAIT)
        finally:
            watch.close()

    def _serve(self, consumer: str, rec: dict[str, Any]) -> None:
        v = self._v
        reply_key = f"rdma/{consumer}/rep/{self.ep}"
        seq = int(rec.get("seq", 0))
        try:
            dev = self._by_name.get(str(rec.get("device"))) or self._devices[0]
            with self._lock:
                if self._closed:
                    return
                old = self._served.pop(consumer, None)
                cq = self._served_cq.get(dev.name)
                if cq is None:
                    cq = self._served_cq[dev.name] = v.CQ(dev.ctx, 16)
            if old is not None:
                old[1].close()
            qp = new_qp(v, dev, cq, max_send_wr=1)
            try:
                qp.to_rts(qp_attr(v, dev, rec))
            except BaseException:
                qp.close()
                raise
            with self._lock:
                self._served[consumer] = (seq, qp)
            self._counts.add("served")
            reply = dict(dev.endpoint(), qpn=int(qp.qp_num), seq=seq)
        except Exception as exc:
            log.warning("rdma listener: connecting consumer %s failed: %s", consumer, exc)
            reply = {"seq": seq, "error": f"{type(exc).__name__}: {exc}"}
        self.directory.put_entry(reply_key, reply)

    def _drop_served(self, consumer: str) -> None:
        with self._lock:
            old = self._served.pop(consumer, None)
        if old is not None:
            old[1].close()

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the listener (woken at once), say goodbye to owners, destroy every QP. Safe twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, watch = self._listener, self._watch
        self._stop.set()
        if watch is not None:
            watch.wake()
        if listener is not None:
            listener.join(timeout=2.0)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            served = list(self._served.values())
            self._served.clear()
        for conn in conns:
            with conn.lock:
                if self.directory is not None and conn.seq:
                    try:
                        self.directory.put_entry(f"rdma/{conn.key[0]}/bye/{self.ep}", {"seq": conn.seq})
                    except Exception as exc:  # best effort: the owner replaces or outlives it
                        log.debug("rdma bye to %s failed: %s", conn.key[0], exc)
                conn.destroy()
        for _, qp in served:
            qp.close()
