"""Posting and polling: one group of ops on one connection becomes a list of work requests, posted
(at most ``SQ_DEPTH`` outstanding) and polled to completion with a deadline.

Completions are polled from the connection's CQ (20 us spin, then short sleeps) until a deadline
of ``timeout + bytes / MIN_BANDWIDTH``; on timeout the QP is moved to the error state and drained
(or destroyed) before raising, so no late DMA can touch a buffer the caller got back. Every bad
``wc.status`` raises EngineError carrying the status name and code; ``IBV_WC_RETRY_EXC_ERR`` /
``IBV_WC_RNR_RETRY_EXC_ERR`` (the peer's QP is gone: process killed, node down) raise
PeerLostError chained from it, within about 0.5 s (ack timeout 67 ms x 7 tries).

Local buffers: transfers up to ``BOUNCE_BYTES`` go through the connection's registered bounce
buffer (one small memcpy); larger ones register the caller's array for the duration of the call
(counted in ``local_registrations``). Each post-and-wait cycle counts one ``round_trips``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from memsem._errors import EngineError, MemsemError, MemsemTimeoutError, PeerLostError
from memsem.engines._base import Op, OpKind, OpState
from memsem.engines.rdma._connect import BOUNCE_BYTES, SQ_DEPTH, Conn
from memsem.engines.rdma._verbs import Counters, pyverbs_error, status_name

log = logging.getLogger(__name__)

#: largest message of one work request (bigger transfers are split)
MAX_WR_BYTES = 1 << 30
#: slowest bandwidth assumed when sizing a completion deadline (bytes/second)
MIN_BANDWIDTH = 10e6
#: seconds of busy CQ polling before the poller sleeps between polls (1/8 of the time waited so
#: far, 50 us .. 1 ms). Longer spinning hurts where the device is emulated in the kernel on the
#: same CPUs (rxe: a spinning poller delays the softirq that would complete the request).
SPIN_SECONDS = 20e-6


@dataclasses.dataclass
class _Item:
    """One op's work: its WRs are ``wr_ids[0] .. wr_ids[-1]``."""

    kind: OpKind
    local: np.ndarray
    remote_addr: int
    rkey: int
    bounce_off: int = -1  # offset in the bounce buffer, or -1: ``mr`` registers ``local``
    mr: Any = None
    error: BaseException | None = None
    wr_ids: list[int] = dataclasses.field(default_factory=list)


class Poster:
    """Runs groups of ops on connections (see the module docstring).

    Args:
        v: the pyverbs namespace.
        counters: the engine's counters (``posted``, ``round_trips``, ``failed``,
            ``local_registrations``).
        reconnect: ``reconnect(conn)``, called (under ``conn.lock``) when ``conn`` is broken.
    """

    def __init__(self, v: types.SimpleNamespace, counters: Counters,
                 reconnect: Callable[[Conn], None]) -> None:
        self._v = v
        self._counts = counters
        self._reconnect = reconnect

    def run_group(self, conn: Conn, ops: list[Op], timeout: float, *, retry: bool = True) -> None:
        """Run ``ops`` (all on ``conn``; the caller holds ``conn.lock``) as one list of work
        requests; every op ends DONE or FAILED with ``error``. Ops that failed only because a
        sibling broke the QP (flushed) are run once more on a new connection when ``retry``."""
        v = self._v
        e = v.e
        try:
            if conn.broken:
                self._reconnect(conn)
        except BaseException as exc:
            for op in ops:
                op.error, op.state = exc, OpState.FAILED
            return
        items: list[_Item] = []
        wrs: list[tuple[int, int, int, int, int, int]] = []  # (item, opcode, laddr, n, lkey, raddr)
        bounce_used = 0
        try:
            for op in ops:
                remote = op.remote
                it = _Item(op.kind, op.local, remote.address + op.offset, remote.rkey)  # type: ignore[attr-defined]
                n = op.nbytes
                if n <= BOUNCE_BYTES - bounce_used:
                    it.bounce_off = bounce_used
                    bounce_used += -(-n // 64) * 64
                    laddr, lkey = conn.bounce.ctypes.data + it.bounce_off, conn.bounce_mr.lkey
                    if op.kind == OpKind.PUT:
                        conn.bounce[it.bounce_off:it.bounce_off + n] = op.local.reshape(-1).view(np.uint8)
                else:
                    access = e.IBV_ACCESS_LOCAL_WRITE if op.kind == OpKind.GET else 0
                    try:
                        it.mr = v.MR(conn.dev.pd, n, access, address=op.local.ctypes.data)
                    except v.PyverbsError as exc:
                        raise pyverbs_error(exc, f"ibv_reg_mr of a local buffer of {n} bytes") from exc
                    self._counts.add("local_registrations")
                    laddr, lkey = op.local.ctypes.data, it.mr.lkey
                opcode = e.IBV_WR_RDMA_READ if op.kind == OpKind.GET else e.IBV_WR_RDMA_WRITE
                for at in range(0, n, MAX_WR_BYTES):
                    it.wr_ids.append(len(wrs))
                    wrs.append((len(items), opcode, laddr + at, min(MAX_WR_BYTES, n - at), lkey,
                                it.remote_addr + at))
                items.append(it)
            total = sum(w[3] for w in wrs)
            statuses = self._post_and_poll(conn, items, wrs, timeout,
                                           time.monotonic() + timeout + total / MIN_BANDWIDTH)
        except BaseException as exc:
            for it in items:
                if it.mr is not None:
                    it.mr.close()
            for op in ops:
                op.error, op.state = exc, OpState.FAILED
            return
        flushed: list[Op] = []
        for op, it in zip(ops, items):
            if it.mr is not None:
                it.mr.close()
            bad = [statuses[i] for i in it.wr_ids if statuses[i] != e.IBV_WC_SUCCESS]
            if not bad:
                if op.kind == OpKind.GET and it.bounce_off >= 0:
                    op.local.reshape(-1).view(np.uint8)[:] = conn.bounce[it.bounce_off:it.bounce_off + op.nbytes]
                op.state = OpState.DONE
                continue
            status = next((s for s in bad if s not in (e.IBV_WC_WR_FLUSH_ERR, -1)), bad[0])
            if status in (e.IBV_WC_WR_FLUSH_ERR, -1) and retry:
                flushed.append(op)  # failed only because a sibling broke the QP: retry once
                continue
            op.error, op.state = self._wc_error(conn, status, op), OpState.FAILED
        if flushed:
            self.run_group(conn, flushed, timeout, retry=False)

    def _post_and_poll(self, conn: Conn, items: list[_Item], wrs: list[tuple], timeout: float,
                       deadline: float) -> list[int]:
        """Post ``wrs`` (at most SQ_DEPTH outstanding) and poll every completion. Returns a status
        per WR (-1: not posted because the QP broke first). Marks ``conn`` broken on any error."""
        v = self._v
        e = v.e
        statuses = [-2] * len(wrs)
        nxt = outstanding = 0
        t_start = t_idle = time.monotonic()
        failed = False
        qp, cq = conn.qp, conn.cq
        self._counts.add("round_trips")
        while nxt < len(wrs) or outstanding:
            while not failed and nxt < len(wrs) and outstanding < SQ_DEPTH:
                _, opcode, laddr, n, lkey, raddr = wrs[nxt]
                wr = v.SendWR(wr_id=nxt, opcode=opcode, num_sge=1, sg=[v.SGE(laddr, n, lkey)],
                              send_flags=e.IBV_SEND_SIGNALED)
                wr.set_wr_rdma(items[wrs[nxt][0]].rkey, raddr)
                try:
                    qp.post_send(wr)
                except v.PyverbsError as exc:
                    failed = True
                    conn.broken = True
                    if not outstanding:
                        raise pyverbs_error(exc, f"ibv_post_send to {conn.label()}") from exc
                    break
                nxt += 1
                outstanding += 1
            if failed and nxt < len(wrs):
                for i in range(nxt, len(wrs)):
                    statuses[i] = -1
                nxt = len(wrs)
            if not outstanding:
                break
            got, wcs = cq.poll(min(outstanding, 32))
            if got:
                for wc in wcs:
                    statuses[wc.wr_id] = wc.status
                    outstanding -= 1
                    if wc.status != e.IBV_WC_SUCCESS:
                        failed = True
                        conn.broken = True
                t_idle = time.monotonic()
                continue
            now = time.monotonic()
            if now >= deadline:
                self._abort(conn, outstanding)
                raise MemsemTimeoutError(
                    f"{outstanding} RDMA work request(s) to {conn.label()} not complete by the "
                    f"deadline ({timeout:.1f} s + bytes / {MIN_BANDWIDTH / 1e6:.0f} MB/s); the "
                    "QP was reset", what="RDMA completion", timeout=timeout)
            if now - t_idle > SPIN_SECONDS:
                time.sleep(min(1e-3, max(5e-5, (now - t_start) / 8)))
        self._counts.add("posted", nxt)
        self._counts.add("failed", sum(1 for s in statuses if s not in (e.IBV_WC_SUCCESS, -1, -2)))
        return statuses

    def _abort(self, conn: Conn, outstanding: int) -> None:
        """Stop the QP so no late DMA touches caller buffers: move it to ERR and drain the flush
        completions (bounded), else destroy it."""
        v = self._v
        try:
            conn.qp.modify(v.QPAttr(qp_state=v.e.IBV_QPS_ERR), v.e.IBV_QP_STATE)
            deadline = time.monotonic() + 1.0
            while outstanding and time.monotonic() < deadline:
                got, _ = conn.cq.poll(min(outstanding, 32))
                outstanding -= got
                if not got:
                    time.sleep(1e-3)
        except v.PyverbsError as exc:
            log.debug("moving a QP to ERR failed: %s", exc)
        conn.destroy()

    def _wc_error(self, conn: Conn, status: int, op: Op) -> MemsemError:
        name = status_name(self._v, status) if status >= 0 else "NOT_POSTED"
        what = "READ" if op.kind == OpKind.GET else "WRITE"
        base = EngineError(f"RDMA {what} of {op.nbytes} bytes at offset {op.offset} from "
                           f"{conn.label()} failed at the device", code=status, name=name)
        if status in (self._v.e.IBV_WC_RETRY_EXC_ERR, self._v.e.IBV_WC_RNR_RETRY_EXC_ERR):
            conn.lost = True
            err = PeerLostError(f"{conn.label()} is unreachable: RDMA {what} failed with {name} "
                                f"(status {status}): its queue pair is gone (process killed or node down)")
            err.__cause__ = base
            err.name, err.code = name, status  # type: ignore[attr-defined]  # also when re-chained
            return err
        return base
