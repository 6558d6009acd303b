"""The consumer side of versions: the latest version, waits for a newer one, pinned leases, and
one bracketed read of many ranges of one version.

A window's *version* counts its owner's write sections within one generation (the owner side
is ``_publish``). A consumer

* reads ``latest`` (one acquire load of the control block's latest-version word);
* waits for a version (``wait``): a futex wait on that word, woken by the owner's commit,
  sliced by ``WAIT_SLICE_S`` only to re-check the owner's liveness and the generation (no
  polling with sleeps); ``wait_async`` awaits the same word through the runtime's native
  word waiter, never blocking or polling the event loop;
* pins a version (``pin``): a lease whose slot names the version, so the owner does not
  overwrite it while the lease lasts. Pinning checks the writer-intent word after the lease is
  visible (Dekker with the writer's intent store and lease scan): a writer about to overwrite
  the version's slot wins, the reader backs off and waits for the commit, so pinned readers
  never starve the writer and never hold a version that is being overwritten;
* reads many ranges of one version at once (``gather``): one native seqlock bracket around all
  the copies, so a state dict of hundreds of tensors is loaded with one version check, no
  round trip per tensor, and never returned torn.

Every version operation of a window on another node goes through ``_remote`` (one function):
its latest-version word is mirrored here by the route's engine (``memsem.core._remote``).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from memsem import _args, native
from memsem._errors import MemsemTimeoutError, NotSupportedError, VersionGoneError
from memsem.gva import RefSpec
from memsem.gva._control_block import W_LATEST, W_SEQ0, W_WRITER
from memsem.core import _translate as tr
from memsem.core._bracket import Bracket, Outcome, Status, failure
from memsem.core._lease import Lease, acquire_on, pin_latest
from memsem.core._resolve import Resolution
from memsem.core._wait import Wait, window_checks

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore

#: gathers of the latest version restarted after the version moved on between ranges (routes
#: without one bracket here) before the error is raised
GATHER_RETRIES = 64


class Versions:
    """Version reads, waits and pins of one runtime (see the module docstring)."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = core

    # -- helpers ----------------------------------------------------------------------------------
    def _resolve(self, spec: RefSpec) -> Resolution:
        return self._core.resolver.resolve(spec)

    def _version_wait(self, spec: RefSpec, res: Resolution, at_least: int, t: float, words: Any,
                      stop: Callable[[], None] | None = None) -> Wait:
        return Wait(f"version {at_least} of {spec.label}", t, telemetry=self._core.telemetry, state="not committed",
                    detail=lambda: f"latest is {words.word(W_LATEST)}", stop=stop,
                    recheck=window_checks(res, spec, words, during=f"version {at_least}"))

    def _remote(self, res: Resolution, spec: RefSpec, what: str, *, at_least: int = 0, timeout: float = 0.0,
                loop: asyncio.AbstractEventLoop | None = None, stop: Callable[[], None] | None = None) -> Any:
        """Versions of a window with no control block here (another node). The one place the
        cross-node implementation plugs in: the window's latest-version word is read from its
        mirror here (``memsem.core._remote``: pushed by the owner over tcp, read one-sidedly
        over rdma) and waited for like any control word (``Readiness.wait_word``). Returns the
        version, or (``loop`` given) a coroutine giving it. Pins are leases in the owner's
        control block: not across nodes."""
        readiness = self._core.readiness
        if what == "the latest version":
            m = readiness.mirrors.control(res, spec)
            if m.mode == "read":
                m.sync()
            if m.generation != spec.generation:
                self._core.resolver.drop(spec.gva, res)
                raise tr.stale(spec, m.generation)
            # the mirror may lag what a get through this resolution already returned: never
            # report a version older than bytes this process holds
            return max(m.word(W_LATEST), res.seen)
        if what == "waiting for a version":
            label = f"version {at_least} of {spec.label}"
            if loop is None:
                return readiness.wait_word(spec, W_LATEST, lambda v: v >= at_least, timeout, what=label, stop=stop)
            return loop.run_in_executor(  # a thread waits on the mirror; the loop is never blocked
                None, lambda: readiness.wait_word(spec, W_LATEST, lambda v: v >= at_least, timeout, what=label))
        raise NotSupportedError(f"{what} of {spec.label} on route {res.route.kind}: a pinned version is a lease "
                                "in the owner's control block, which only its node maps; read with version= "
                                "(the owner checks it) or hold a lease instead")

    def _check_gen(self, res: Resolution, spec: RefSpec) -> None:
        g = res.cb.generation
        if g != spec.generation:
            self._core.resolver.drop(spec.gva, res)
            raise tr.stale(spec, g)

    # -- latest -----------------------------------------------------------------------------------
    def latest(self, spec: RefSpec) -> int:
        """The latest committed version of ``spec``'s window (a snapshot).

        Raises:
            StaleReferenceError: the generation moved. PeerLostError / AccessDeniedError: as
            for any resolution.
        """
        res = self._resolve(spec)
        if res.cb is None:
            return self._remote(res, spec, "the latest version")
        self._check_gen(res, spec)
        return res.cb.latest

    # -- waiting ----------------------------------------------------------------------------------
    def wait(self, spec: RefSpec, at_least: int, timeout: float | None = None, *,
             stop: Callable[[], None] | None = None) -> int:
        """Block until the latest committed version is ``>= at_least``; returns it.

        A futex wait on the latest-version word, woken by the owner's commit; between slices of
        at most ``WAIT_SLICE_S`` it re-checks the generation and the owner's liveness (the
        runtime's one wait, ``memsem.core._wait``), and calls ``stop`` (the caller's check: it
        raises to end the wait early).

        Raises:
            MemsemTimeoutError: not reached within ``timeout`` s (default the runtime's).
            StaleReferenceError: the window was retired or republished. PeerLostError: the
            owner died while waited for.
        """
        core = self._core
        at_least = _args.version(at_least, "version")
        t = _args.timeout_or(timeout, core.timeout)
        for _ in range(3):
            res = self._resolve(spec)
            if res.cb is None:
                return self._remote(res, spec, "waiting for a version", at_least=at_least, timeout=t, stop=stop)
            if res.enter():  # held: nothing unmaps the word while we sleep on it
                break
        else:
            raise tr.stale(spec, None)
        try:
            cb = res.cb
            return self._version_wait(spec, res, at_least, t, cb, stop).until(cb.latest_addr, lambda v: v >= at_least)
        finally:
            res.leave()

    async def wait_async(self, spec: RefSpec, at_least: int, timeout: float | None = None,
                         loop: asyncio.AbstractEventLoop | None = None) -> int:
        """``wait`` for asyncio: awaits the latest-version word through the runtime's native
        word waiter (one background thread for all awaited words); the event loop is never
        blocked and never polled. Liveness and generation are re-checked every second."""
        core = self._core
        at_least = _args.version(at_least, "version")
        t = _args.timeout_or(timeout, core.timeout)
        loop = loop or asyncio.get_running_loop()
        res = self._resolve(spec)
        if res.cb is None:
            return await self._remote(res, spec, "waiting for a version", at_least=at_least, timeout=t, loop=loop)
        cb = res.cb
        w = self._version_wait(spec, res, at_least, t, cb)
        return await w.until_async(cb.latest_addr, lambda v: v >= at_least, core.word_waiter(), res, loop)

    # -- pinning ----------------------------------------------------------------------------------
    def pin(self, spec: RefSpec, *, version: int = 0, ttl: float | None = 10.0,
            timeout: float | None = None) -> Lease:
        """A held lease pinning ``version`` (0: the latest committed one) of ``spec``'s window:
        the owner does not overwrite that version's slot while the lease lasts (it waits, at
        most until the lease expires). ``lease.version`` tells which version is pinned. A
        version not written yet may be pinned (a reservation: the owner may write it, and not
        the one after it in the same slot).

        Another node's window (a route whose engine ``reserves``, tcp): the pin is a
        reservation held at the owner by this thread's session with it (the owner's own lease,
        its ttl capped by the owner's timeout; it ends with the session).

        Raises:
            VersionGoneError: ``version`` is gone (names it and the version found).
            WindowRetiredError: the generation moved. MemsemTimeoutError: a write section kept
                the version being overwritten for ``timeout`` s. NotSupportedError: another
                node's window on a route that cannot reserve versions.
            TypeError / ValueError: ``version`` is not an int in ``[0, VERSION_MAX]``.
        """
        version = _args.version(version, "version")
        return self.pin_on(self._resolve(spec), spec, version, ttl, _args.timeout_or(timeout, self._core.timeout))

    def pin_on(self, res: Resolution, spec: RefSpec, version: int, ttl: float | None, timeout: float) -> Lease:
        """``pin`` through ``res``, the caller's resolution of ``spec`` (a view resolves once),
        with ``version`` and ``timeout`` (seconds) already checked. Raises as ``pin``."""
        core = self._core
        if res.cb is None:
            if not res.engine.reserves:
                return self._remote(res, spec, "pinning a version")
            return acquire_on(Lease(core, spec, ttl, version=version, reserve=True), res)  # reserved at the owner
        t = timeout
        cb = res.cb
        wait: Wait | None = None
        while True:
            lease, v, seq = self._pin_once(spec, res, version, ttl)
            if lease is not None:
                return lease
            # a writer is about to overwrite (or is writing) the version: wait for its commit
            if wait is None:
                wait = Wait(f"{spec.label}: the write section overwriting version {v}", t,
                            telemetry=core.telemetry, state="stayed open",
                            recheck=window_checks(res, spec, cb, during=f"a pin of version {v}"))
            if not version and seq == (v << 1 | 1):
                # the latest word says v, its slot's sequence is stored next (the commit's two
                # stores): the sequence word moves, the latest word does not
                wait.sleep_word(cb.addr(W_SEQ0 + cb.slot_of(v)), seq)
            else:
                wait.sleep_word(cb.latest_addr, cb.latest)

    def pin_now(self, spec: RefSpec, version: int, ttl: float | None) -> Lease | None:
        """One try of ``pin`` on a window whose control block is here (the owner serving a
        remote consumer's reservation): the lease, or None when a write section is overwriting
        the version (try again after its commit). Never waits.

        Raises:
            VersionGoneError, WindowRetiredError: as ``pin``. NotSupportedError: no control
            block here.
        """
        version = _args.version(version, "version")
        res = self._resolve(spec)
        if res.cb is None:
            raise NotSupportedError(f"{spec.label}: a version is reserved where its control block is")
        return self._pin_once(spec, res, version, ttl)[0]

    def _pin_once(self, spec: RefSpec, res: Resolution, version: int,
                  ttl: float | None) -> tuple[Lease | None, int, int]:
        """``(lease or None, the version tried, its slot's sequence word)``. Pinning checks the
        writer-intent word after the lease is visible (Dekker with the writer's intent store and
        lease scan): a writer about to overwrite the version wins, the reader backs off."""
        core, cb = self._core, res.cb
        if not version and cb.n_lease:  # the latest version: one native call
            lease = Lease(core, spec, ttl)
            got = pin_latest(lease, res)
            if got is not None:
                held, v, seq = got
                if held:
                    return lease, v, seq
                if held is None:  # the generation moved
                    self._check_gen(res, spec)
                    raise tr.stale(spec, None)
                return None, v, seq
        self._check_gen(res, spec)
        v = version or cb.latest
        lease = acquire_on(Lease(core, spec, ttl, version=v), res)  # ends with a seq_cst fence
        intent = cb.word(W_WRITER)
        seq = cb.seq(cb.slot_of(v))
        overwriting = intent > v and cb.slot_of(intent) == cb.slot_of(v)
        held = seq >> 1
        if not overwriting and (seq == v << 1 or (version and held < v) or (version and seq == (v << 1 | 1))):
            return lease, v, seq
        lease.release()
        if version and (held > version or overwriting):
            core.telemetry.count_error("stale")
            raise tr.version_gone(spec, version, max(held, intent))
        return None, v, seq

    # -- one bracket, many ranges -----------------------------------------------------------------
    def gather(self, spec: RefSpec, ranges: Sequence[tuple[int, int, int]], *, version: int = 0,
               lease: Lease | None = None, keep: Any = None) -> int:
        """Copy ranges of one version of ``spec``'s window here; returns the version read.

        Args:
            ranges: ``(offset, nbytes, address)``: ``nbytes`` bytes at ``offset`` bytes into the
                ref go to ``address`` here (memory the caller keeps alive: ``keep``).
            version: 0 reads the latest committed version, else exactly that one.
            lease: a held lease (a pinned one keeps ``version`` readable).

        Same node, every copy runs inside one native seqlock bracket (one generation and
        version check before, one after); a torn bracket is redone whole, so the ranges hold
        one version when this returns. Other routes copy range by range with the version of
        the first fixed. On an error the destination bytes are unspecified. Retries (an open
        write section, a torn bracket) are bounded by the runtime's timeout, like a get's.

        Raises:
            StaleReferenceError: the generation moved, or ``version`` is gone (both versions
                named). MemsemTimeoutError: a write section stayed open, or tore every try,
                past the timeout. LeaseExpiredError, PeerLostError, AccessDeniedError: as for
                ``get``. TypeError / ValueError: a bad ``version`` or range.
        """
        version = _args.version(version, "version")
        total = spec.nbytes
        for i, (off, n, _addr) in enumerate(ranges):
            if off < 0 or n < 0 or off + n > total:
                raise ValueError(f"ranges[{i}]: bytes [{off}, {off + n}) lie outside {spec.label}'s "
                                 f"{total} bytes")
        res = self._resolve(spec)
        if not res.direct:
            return self._gather_ranges(spec, ranges, version, lease, keep)
        ls, lid = lease.native_args(spec) if lease is not None else (0, 0)

        def attempt(r: Resolution) -> Outcome:
            if not r.direct:  # resolved again onto another route
                return Outcome(Status.OK, self._gather_ranges(spec, ranges, version, lease, keep))
            b = Bracket(r)
            o = b.open(False, spec.offset, total, version, ls, lid)
            if not o.ok:
                return o
            base = b.address
            d = r.remote.direct
            try:
                if d.cma:
                    for off, n, addr in ranges:
                        if n:
                            native.vm_read(d.pid, addr, base + off, n)
                else:
                    for off, n, addr in ranges:
                        if n:
                            native.memcpy(addr, base + off, n)
            except BaseException as exc:
                closed = b.close(failed=True)
                if closed.status in (Status.GEN_AFTER, Status.GEN_BEFORE):
                    raise failure(closed, r, spec, lease=lease, version=version) from None
                raise exc
            return b.close(moved=moved)  # the telemetry counts the ranges' bytes, not the window's

        moved = sum(n for _off, n, _addr in ranges)
        return self._core.transfers.run(spec, res, attempt, lease=lease, version=version)

    def digest(self, spec: RefSpec, runs: Sequence[tuple[int, int]], *, version: int = 0,
               lease: Lease | None = None) -> tuple[int, bytes]:
        """The digest (``memsem.engines.run_digest``, ``RUN_DIGEST_BYTES`` bytes) of the bytes
        of ``runs`` (``(offset, nbytes)`` into the ref, in that order, concatenated) of one
        version of ``spec``'s window: ``(the version, the digest)``. No byte of the runs moves
        here from another node: there the owner computes it (``Engine.digest_version``, tcp's
        DIGEST request, bracketed at the owner); on one node it is computed over the mapped
        window inside one seqlock bracket (like ``gather``; a torn bracket is redone whole).

        Args:
            version: 0 the latest committed version, else exactly that one (a pinned lease keeps
                it). lease: a held lease (its checks, as ``gather``).

        Raises:
            VersionGoneError: ``version`` is gone. StaleReferenceError, PeerLostError,
            MemsemTimeoutError: as ``gather``. NotSupportedError: a route whose engine cannot
            digest at the owner (the error names it). ValueError: a run outside the ref, or
            no runs.
        """
        version = _args.version(version, "version")
        total = spec.nbytes
        if not runs:
            raise ValueError("runs must hold at least one (offset, nbytes) run")
        for i, (off, n) in enumerate(runs):
            if off < 0 or n < 0 or off + n > total:
                raise ValueError(f"runs[{i}]: bytes [{off}, {off + n}) lie outside {spec.label}'s {total} bytes")
        out: list[bytes] = []

        def attempt(r: Resolution) -> Outcome:
            o, d = r.strategy.digest(r, spec, runs, version, lease)
            out[:] = [d]
            return o

        v = self._core.transfers.run(spec, self._resolve(spec), attempt, lease=lease, version=version)
        return v, out[0]

    def _gather_ranges(self, spec: RefSpec, ranges: Sequence[tuple[int, int, int]], version: int,
                       lease: Lease | None, keep: Any) -> int:
        """Routes without a native bracket here: range by range, the first fixes the version.

        The latest version (``version`` 0, no lease) is read unpinned first; when it moves on
        between ranges and the route reserves versions at the owner (tcp), the next try pins
        the latest there (one round trip each way), so a writer committing faster than the
        ranges move cannot starve the load; other routes try again from the new latest."""
        tx = self._core.transfers
        for tries in range(GATHER_RETRIES):
            v = version
            try:
                if tries and not version and lease is None and self._resolve(spec).engine.reserves:
                    pinned = self.pin(spec, version=0, ttl=self._core.timeout)
                    try:
                        return self._gather_ranges(spec, ranges, pinned.version, pinned, keep)
                    finally:
                        pinned.release()
                for off, n, addr in ranges:
                    got = tx.transfer(spec, False, off, addr, n, keep, lease, v)
                    v = v or got
                return v
            except VersionGoneError as exc:
                # the latest version moved on between ranges (it names the version it wanted):
                # start again from the new latest; anything else is the caller's error
                if version or not v or exc.wanted != v:
                    raise
        raise MemsemTimeoutError(
            f"{spec.label}: the latest version moved on during each of {GATHER_RETRIES} loads of its "
            "ranges (a writer faster than the load): pin a version (pin()) and load it with version=",
            what=f"one version of {spec.label}", timeout=self._core.timeout)


__all__ = ["GATHER_RETRIES", "Versions"]
