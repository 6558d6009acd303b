"""xcopy: batches of copies between local buffers and windows, or window to window.

Same-node ranges between a local buffer and a window already resolved here are done at once, in
the calling thread (the *inline lane*, ``XCOPY_INLINE_BYTES`` per batch at most); every other
range goes to the runtime's workers (``XCOPY_TASK_BYTES``: below it, one task for all), and
ranges of one window reached through an engine that posts batches to hardware
(``Engine.batches``) go to it as one batch, each range in its own bracket.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import _hot
from memsem._buffers import as_byte_array, check_dtype
from memsem._errors import EngineError, MemsemError, MemsemTimeoutError
from memsem.engines import Op, OpKind, OpState
from memsem.gva import RefSpec
from memsem.core import _translate as tr
from memsem.core._completion import Batch, RangeResult, State
from memsem.core._bracket import ATTENTION, Bracket, Status, failure, settle
from memsem.core._lease import Lease
from memsem.core._resolve import Resolution, Resolver
from memsem.core._routes import remote_slots

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore
    from memsem.core._transfer import Transfers

_hot_copy = _hot.copy
_RC_BUFFER = _hot.RC_BUFFER
_DONE = State.DONE
_ATTN = ATTENTION
#: bytes of one xcopy batch copied at once in the calling thread (same-node ranges resolved here)
XCOPY_INLINE_BYTES = 256 << 10
#: below this many bytes in all, an xcopy batch's remaining ranges go to one worker task
XCOPY_TASK_BYTES = 4 << 20


class XCopier:
    """The xcopy of one runtime: given the runtime's transfers (each range is one of their
    transfers), its resolver and its worker pool."""

    def __init__(self, core: "RuntimeCore", transfers: "Transfers", resolver: Resolver, pool: cf.ThreadPoolExecutor,
                 workers: int) -> None:
        self._tx = transfers
        self._core = core
        self._workers = workers
        self._resolver = resolver
        self._pool = pool

    def xcopy(self, pairs: Sequence[tuple[Any, Any]], *, lease: Lease | None = None) -> Batch:
        """Start a batch of copies (see ``memsem.Runtime.xcopy``). Ranges fail independently;
        the Batch gives every range a final state.

        Same-node ranges between a local buffer and a window already resolved here are done at
        once, in this thread, one native call each (``XCOPY_INLINE_BYTES`` per batch at most:
        a copy that small costs less than handing it to a worker); a range whose native outcome
        is anything but a plain success (a write section open, a stale ref, a closed
        resolution...) and every other range goes to the runtime's workers, in at most one task
        per worker. Ranges to or from a window whose engine posts batches to hardware
        (``Engine.batches``) go to it as one batch."""
        core = self._core
        core.check_open()
        results = []
        jobs = []
        lat: list[int] = []
        inline_left = XCOPY_INLINE_BYTES
        cached = self._tx.cached
        now = time.perf_counter_ns
        for i, pair in enumerate(pairs):
            try:
                src, dst = pair
            except (TypeError, ValueError):
                raise TypeError(f"pairs[{i}] must be a (src, dst) pair, got {pair!r}") from None
            if isinstance(src, RefSpec):
                spec, buf, put = src, (None if isinstance(dst, RefSpec) else dst), 0
            elif isinstance(dst, RefSpec):
                spec, buf, put = dst, src, 1
            else:
                raise TypeError(f"pairs[{i}]: at least one side of each pair must be a ref")
            r = RangeResult(i, spec.nbytes)
            results.append(r)
            # The inline lane (see the docstring): settled before the Batch exists.
            if buf is not None and spec.nbytes <= inline_left and (not put or spec.access == "rw"):
                res = cached(spec)
                if res is not None and res.direct:
                    t0 = now()
                    if lease is None:
                        rc = _hot_copy(res.addr, put, spec.offset, buf, spec.nbytes, spec.dtype_code)
                        out = True if not rc & _ATTN else self._inline_outcome(rc, res)
                    else:
                        out = self._inline(res, spec, put, buf, lease)
                    if out is not None:
                        inline_left -= spec.nbytes
                        if out is True:
                            r.state = _DONE
                            lat.append(now() - t0)
                        else:
                            r.state, r.error = State.FAILED, out
                        continue
            jobs.append((r, src, dst))
        core.telemetry.record_latencies("xcopy", lat)
        batch = Batch(results, timeout=core.timeout)
        grouped: dict[int, list[tuple[RangeResult, Any, Any]]] = {}
        single = []
        for job in jobs:
            eng_res = self._batchable(job[1], job[2])
            if eng_res is not None:
                grouped.setdefault(id(eng_res), []).append(job)
            else:
                single.append(job)

        def run(chunk: list[tuple[RangeResult, Any, Any]]) -> None:
            for r, src, dst in chunk:
                if not batch.start(r):
                    continue  # cancelled before it started
                if core.closed:  # closing: what has not started ends CANCELLED
                    batch.settle(r, State.CANCELLED)
                    continue
                try:
                    self._copy_one(src, dst, lease)
                except BaseException as exc:
                    batch.settle(r, State.FAILED, exc)
                else:
                    batch.settle(r, State.DONE)

        def run_group(group: list[tuple[RangeResult, Any, Any]]) -> None:
            self._copy_batch(group, batch, lease)

        for chunk in _chunks(single, self._workers):
            self._queue(batch, [j[0] for j in chunk], run, chunk)
        for group in grouped.values():
            self._queue(batch, [g[0] for g in group], run_group, group)
        return batch

    def _inline(self, res: Resolution, spec: RefSpec, put: int, buf: Any, lease: Lease) -> Any:
        """One xcopy range under ``lease`` done now, natively (see ``_inline_outcome``)."""
        if lease.spec.gva != spec.gva:
            rc = _hot_copy(res.addr, put, spec.offset, buf, spec.nbytes, spec.dtype_code)
        else:
            ls, lid = lease.native_args(spec)
            if not ls:
                return None
            rc = _hot_copy(res.addr, put, spec.offset, buf, spec.nbytes, spec.dtype_code, 0, ls, lid)
        return True if not rc & _ATTN else self._inline_outcome(rc, res)

    @staticmethod
    def _inline_outcome(rc: int, res: Resolution) -> Any:
        """What an xcopy range done inline came to: True for a success, its error when the owner
        was found dead after a read, None when it must go to a worker (the buffer needs the
        Python door, or any other native outcome: the worker does it all again, with the waits
        and errors of the general path)."""
        if rc == _RC_BUFFER:
            return None
        o = settle(res, rc)
        if not o.ok:
            return None
        if o.check_peer:
            try:
                res.peer_checked()
            except MemsemError as exc:
                return exc
        return True

    def _queue(self, batch: Batch, ranges: list[RangeResult], fn: Any, *args: Any) -> None:
        fut = self._pool.submit(self._tx.counted(fn), *args)

        def dropped(f: cf.Future, ranges: list[RangeResult] = ranges) -> None:
            if f.cancelled():  # dropped by the pool (runtime closing) before it ran
                for r in ranges:
                    batch.settle(r, State.CANCELLED)

        fut.add_done_callback(dropped)
        batch.track(fut)

    def _batchable(self, src: Any, dst: Any) -> Resolution | None:
        """The resolution when one side is a ref reached through a batching engine (not a
        direct route) and the other a local buffer."""
        if isinstance(src, RefSpec) == isinstance(dst, RefSpec):
            return None
        spec = src if isinstance(src, RefSpec) else dst
        try:
            res = self._resolver.resolve(spec)
        except (MemsemError, ValueError, TypeError):
            return None  # reported by the range itself
        if res.cb is None and not res.engine.versions and remote_slots(res) > 1:
            return None  # a double-buffered window on another node: each range picks its slot
        return res if res.engine.batches and not res.direct else None

    def _copy_batch(self, group: list[tuple[RangeResult, Any, Any]], batch: Batch, lease: Lease | None) -> None:
        """Hand ranges of one window to its engine's ``submit`` as one batch, each range in its
        own bracket."""
        ops: list[tuple[RangeResult, RefSpec, Op, Any]] = []
        for r, src, dst in group:
            if not batch.start(r):
                continue
            try:
                spec, local, put = (src, dst, False) if isinstance(src, RefSpec) else (dst, src, True)
                flat, info = as_byte_array(local, "dst" if not put else "src", writable=not put)
                if info.nbytes != spec.nbytes:
                    raise ValueError(f"xcopy sizes differ: ref {spec.nbytes} bytes, buffer {info.nbytes} bytes")
                check_dtype("dst" if not put else "src", info.dtype_code, spec.dtype_code)
                if put and not spec.writable:
                    raise tr.read_only_ref(spec)
                res = self._resolver.resolve(spec)
                if lease is not None and lease.spec.gva == spec.gva:
                    lease.check("before the transfer")
                b = Bracket(res)
                o = b.open(put, spec.offset, spec.nbytes)
                if o.status is Status.CHECK_FIRST:
                    res.peer_checked()  # PeerLostError when the owner died
                    o = b.open(put, spec.offset, spec.nbytes)
                if not o.ok:
                    raise failure(o, res, spec, put=put)
                op = Op(OpKind.PUT if put else OpKind.GET, res.remote, spec.offset, flat)
                ops.append((r, spec, op, (res, b, put)))
            except BaseException as exc:
                batch.settle(r, State.FAILED, exc)
        if not ops:
            return
        eng = ops[0][3][0].engine
        req = eng.submit([o[2] for o in ops])
        try:
            req.wait(self._core.timeout)
        except MemsemTimeoutError as exc:
            for r, spec, op, (res, st, put) in ops:
                batch.settle(r, State.FAILED, exc)
            # The hardware still owns the buffers: close the brackets when the ops end.
            self._pool.submit(_close_late, req, [o[3] for o in ops], self._core.timeout)
            return
        for r, spec, op, (res, b, put) in ops:
            o = b.close(failed=op.state != OpState.DONE)
            if op.state == OpState.DONE and o.ok:
                if lease is not None and lease.spec.gva == spec.gva and lease.expired():
                    batch.settle(r, State.FAILED, tr.lease_expired(spec, "during the transfer"))
                else:
                    batch.settle(r, State.DONE)
            elif op.state == OpState.DONE:
                batch.settle(r, State.FAILED, failure(o, res, spec, put=put))
            else:
                err = op.error or MemsemError(f"xcopy range {r.index}: engine op ended {op.state.name}")
                if isinstance(err, MemsemError) and not isinstance(err, EngineError):
                    batch.settle(r, State.FAILED, err)
                else:
                    batch.settle(r, State.FAILED, tr.chain(tr.engine_failure(err, spec, res.peer, "xcopy"), err))

    def _copy_one(self, src: Any, dst: Any, lease: Lease | None) -> None:
        t0 = time.perf_counter_ns()

        def lease_for(spec: RefSpec) -> Lease | None:
            # The lease is checked for the ranges of its own window only.
            return lease if lease is not None and lease.spec.gva == spec.gva else None

        if isinstance(src, RefSpec) and isinstance(dst, RefSpec):
            if src.nbytes != dst.nbytes:
                raise ValueError(f"xcopy sizes differ: src {src.nbytes} bytes, dst {dst.nbytes} bytes")
            if not dst.writable:
                raise tr.read_only_ref(dst, "xcopy")
            rs = self._resolver.resolve(src)
            if rs.route.zero_copy and rs.direct and not rs.remote.direct.cma:
                self._copy_mapped(rs, src, dst, lease_for(src), lease_for(dst))
            else:
                bounce = np.empty(src.nbytes, np.uint8)
                self._tx.transfer_array(src, False, 0, bounce, lease=lease_for(src))
                self._tx.transfer_array(dst, True, 0, bounce, lease=lease_for(dst))
                self._core.telemetry.bounce_bytes += src.nbytes
        elif isinstance(src, RefSpec):
            flat, info = as_byte_array(dst, "dst", writable=True)
            if info.nbytes != src.nbytes:
                raise ValueError(f"xcopy sizes differ: src ref {src.nbytes} bytes, dst {info.nbytes} bytes")
            check_dtype("dst", info.dtype_code, src.dtype_code)
            self._tx.transfer(src, False, 0, info.address, info.nbytes, flat, lease_for(src))
        else:
            flat, info = as_byte_array(src, "src", writable=False)
            if info.nbytes != dst.nbytes:
                raise ValueError(f"xcopy sizes differ: src {info.nbytes} bytes, dst ref {dst.nbytes} bytes")
            check_dtype("src", info.dtype_code, dst.dtype_code)
            self._tx.transfer(dst, True, 0, info.address, info.nbytes, flat, lease_for(dst))
        self._core.telemetry.record_latency("xcopy", time.perf_counter_ns() - t0)

    def _copy_mapped(self, rs: Resolution, src: RefSpec, dst: RefSpec, src_lease: Lease | None,
                     dst_lease: Lease | None) -> None:
        """Ref to ref with the source mapped here: one copy straight from its memory, inside the
        source's bracket (the bytes put count only if the source did not move meanwhile)."""
        if src_lease is not None:
            src_lease.check("before the transfer")
        ls, lid = src_lease.native_args(src) if src_lease is not None else (0, 0)
        b = Bracket(rs)
        o = b.open(False, src.offset, src.nbytes, 0, ls, lid)
        if not o.ok:
            if o.retry:  # take the general path (waits, re-resolves)
                bounce = np.empty(src.nbytes, np.uint8)
                self._tx.transfer_array(src, False, 0, bounce, lease=src_lease)
                self._tx.transfer_array(dst, True, 0, bounce, lease=dst_lease)
                self._core.telemetry.bounce_bytes += src.nbytes
                return
            raise failure(o, rs, src, lease=src_lease)
        failed = True
        try:
            self._tx.transfer(dst, True, 0, b.address, src.nbytes, rs.remote, dst_lease)
            failed = False
        finally:
            o = b.close(failed)
        if not o.ok:
            raise failure(o, rs, src, lease=src_lease)


def _chunks(jobs: list[tuple[RangeResult, Any, Any]], workers: int) -> list[list[tuple[RangeResult, Any, Any]]]:
    """Split xcopy ranges into at most ``workers`` tasks of about equal bytes (one task when
    they hold less than ``XCOPY_TASK_BYTES`` in all): a task per range would cost a hand-off
    to a worker thread per range."""
    if not jobs:
        return []
    total = sum(j[0].nbytes for j in jobs)
    n = 1 if total < XCOPY_TASK_BYTES else max(1, min(workers, len(jobs)))
    if n == 1:
        return [jobs]
    out: list[list[tuple[RangeResult, Any, Any]]] = [[]]
    share = total / n
    acc = 0
    for j in jobs:
        if out[-1] and acc >= share * len(out) and len(out) < n:
            out.append([])
        out[-1].append(j)
        acc += j[0].nbytes
    return out


def _close_late(req: Any, brackets: list[tuple[Resolution, Bracket, bool]], timeout: float) -> None:
    """Close the brackets of a batch that timed out once its ops end (bounded waits)."""
    for _ in range(100):
        try:
            req.wait(timeout)
            break
        except MemsemTimeoutError:
            continue
    for _res, b, _put in brackets:
        b.close(failed=True)


__all__ = ["XCOPY_INLINE_BYTES", "XCOPY_TASK_BYTES", "XCopier"]
