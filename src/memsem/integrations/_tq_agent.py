"""The memsem storage agent of the TransferQueue backend: a process that owns the bytes.

TransferQueue's data must outlive the process that put it until it is cleared, so the bytes
cannot live in the putter's memory. The agent is a small process (memsem only: no torch, Ray or
TransferQueue imported) that owns *regions*: one shared segment per put call, published as a
memsem window (``Runtime.alloc`` + ``publish``: one registration per region, never per item).
Clients write into a region and read from it with one-sided memsem puts/gets; the agent never
touches tensor bytes except to zero item words.

Region layout (bytes)::

    [ item generation words: n_items x u64 ][ field data, each field 64-byte aligned ... ]

An item's word holds its generation (unique in this agent) once the putter committed it, and 0
before the commit and after a clear. A reader checks the word before and after its copy, under a
lease on the region's window, so a cleared item, a recycled TQ global index or a freed region
never yields old bytes. A region is unpublished (its window generation bumped) and its segment
unlinked when its last item is cleared; while leases are held the clear waits (up to its timeout)
and the unpublish is deferred.

Control channel: ``multiprocessing.connection`` over an AF_UNIX socket in a 0700 directory, with
a random authkey (HMAC challenge). Requests are ``(op, kwargs)``; replies ``("ok", value)`` or
``("err", error class name, message)``. Ops: ``alloc``, ``abort``, ``free``, ``stats``, ``ping``, ``shutdown``.

The agent exits when the process that started it exits (checked every 0.2 s), on ``shutdown``,
or on SIGTERM; it then unpublishes everything and unlinks its segments. Segments of an agent
killed with SIGKILL are reaped by ``memsem gc`` or by the next memsem Runtime started on the node.

Run by :func:`start_agent` as ``python -m memsem.integrations._tq_agent``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np

from memsem._errors import (
    LeaseHeldError,
    MemsemError,
    MemsemTimeoutError,
    OutOfMemoryError,
    PeerLostError,
    StaleReferenceError,
)

log = logging.getLogger(__name__)

#: seconds between the agent's housekeeping passes (deferred frees, dead putters, parent check)
HOUSEKEEPING_S = 0.2
#: alignment of each field's data inside a region (bytes)
ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Region:
    rid: int
    arr: Any  # flat uint8 numpy array over the region's shared segment
    ref: Any  # memsem TensorRef of the published window
    n_items: int
    gen_base: int
    putter: tuple[int, int]  # (pid, start time) of the allocating process
    live: int
    retiring: bool = False

    @property
    def words(self) -> np.ndarray:
        return self.arr[: 8 * self.n_items].view(np.uint64)


class Agent:
    """Server side: owns the regions. Thread safe (one thread per connection)."""

    def __init__(self, *, job: str | None, directory: str | None, parent: tuple[int, int] | None) -> None:
        from memsem import Runtime

        self.rt = Runtime(directory=directory, job=job)
        self.parent = parent
        self._lock = threading.Lock()
        self._regions: dict[int, _Region] = {}
        self._next_rid = 1
        # Item generations are unique in this agent and, from a random 40-bit start, across agents.
        self._next_gen = (secrets.randbits(40) + 1) << 20
        self._retire_q: list[_Region] = []
        self._stop = threading.Event()
        self.counters = {"allocs": 0, "alloc_bytes": 0, "frees": 0, "items_freed": 0, "regions_retired": 0,
                         "clear_waits": 0, "clear_wait_s": 0.0, "putters_reaped": 0, "aborts": 0}

    # -- ops -------------------------------------------------------------------------------------
    def op_ping(self) -> str:
        return "pong"

    def op_alloc(self, nbytes: int, n_items: int, pid: int, start: int) -> dict[str, Any]:
        if nbytes < 8 * n_items or n_items < 0:
            raise ValueError(f"alloc: nbytes {nbytes} cannot hold {n_items} item words")
        arr = self.rt.alloc(max(int(nbytes), 8), np.uint8)  # tmpfs pages reserved now (fallocate)
        ref = self.rt.publish(arr, access="rw")
        with self._lock:
            rid = self._next_rid
            self._next_rid += 1
            gen_base = self._next_gen
            self._next_gen += max(n_items, 1)
            self._regions[rid] = _Region(rid, arr, ref, n_items, gen_base, (pid, start), n_items)
            self.counters["allocs"] += 1
            self.counters["alloc_bytes"] += int(nbytes)
        return {"ref": ref.to_bytes(), "rid": rid, "gen_base": gen_base}

    def op_free(self, items: list[tuple[int, int, int, int]], timeout: float) -> dict[str, int]:
        """Clear items ``(rid, window gva, index, generation)``. Waits (up to ``timeout`` s) while a reader
        holds a lease on a region before zeroing its words; unknown or already cleared items are
        ignored (TransferQueue clears keys that were never put)."""
        by_region: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for rid, gva, index, gen in items:
            by_region.setdefault((int(rid), int(gva)), []).append((int(index), int(gen)))
        freed = missing = 0
        deadline = time.monotonic() + timeout
        for (rid, gva), lst in by_region.items():
            with self._lock:
                region = self._regions.get(rid)
            if region is None or region.retiring or region.ref.spec.gva != gva:
                missing += len(lst)
                continue
            self._wait_unleased(region, deadline)
            freed_before = freed
            with self._lock:
                words = region.words
                for index, gen in lst:
                    if 0 <= index < region.n_items and gen != 0 and int(words[index]) == gen:
                        words[index] = 0
                        region.live -= 1
                        freed += 1
                    else:
                        missing += 1
                if region.live <= 0 and not region.retiring:
                    region.retiring = True
                    self._retire_q.append(region)
                self.counters["frees"] += 1
                self.counters["items_freed"] += freed - freed_before
        self._drain_retire_q()
        return {"freed": freed, "missing": missing}

    def op_abort(self, rid: int, gva: int) -> bool:
        """Free a region whose put failed before its commit (no item word set). Returns whether
        it was freed."""
        with self._lock:
            region = self._regions.get(int(rid))
            if region is None or region.retiring or region.ref.spec.gva != int(gva) or np.any(region.words):
                return False
            region.retiring = True
            self._retire_q.append(region)
            self.counters["aborts"] += 1
        self._drain_retire_q()
        return True

    def op_stats(self) -> dict[str, Any]:
        with self._lock:
            held = sum(int(r.arr.nbytes) for r in self._regions.values())
            out = dict(self.counters, regions=len(self._regions), held_bytes=held,
                       retire_pending=len(self._retire_q), pid=os.getpid())
        st = self.rt.stats()
        out["registrations"] = sum(st.registrations.values())
        return out

    def op_shutdown(self) -> str:
        self._stop.set()
        return "bye"

    # -- internals -------------------------------------------------------------------------------
    def _cb(self, region: _Region):
        owned = self.rt.core.publisher.owned.get(region.ref.spec.gva)
        return None if owned is None else owned.cb

    def _wait_unleased(self, region: _Region, deadline: float) -> None:
        from memsem.gva import lease as _lease

        cb = self._cb(region)
        if cb is None:
            return
        t0 = time.monotonic()
        waited = False
        while _lease.blocking_holders(cb):
            waited = True
            if time.monotonic() >= deadline:
                # Readers that still hold a lease fail their after-copy check: never old bytes.
                log.warning("clear of region %d proceeds with leases still held after the timeout", region.rid)
                break
            time.sleep(0.002)
        if waited:
            with self._lock:
                self.counters["clear_waits"] += 1
                self.counters["clear_wait_s"] += time.monotonic() - t0

    def _drain_retire_q(self) -> None:
        with self._lock:
            q, self._retire_q = self._retire_q, []
        keep = []
        for region in q:
            try:
                self.rt.unpublish(region.ref, timeout=0.0)
            except LeaseHeldError:
                keep.append(region)  # deferred while leased
                continue
            except (StaleReferenceError, MemsemError) as exc:
                log.warning("unpublishing region %d: %s", region.rid, exc)
            with self._lock:
                self._regions.pop(region.rid, None)
                self.counters["regions_retired"] += 1
            region.arr = None  # the segment is unlinked when its last mapping here goes
        if keep:
            with self._lock:
                self._retire_q.extend(keep)

    def _reap_dead_putters(self) -> None:
        """Free regions whose putter died before committing any item (no TQ meta names them)."""
        from memsem.native import process_alive

        with self._lock:
            cand = [r for r in self._regions.values() if not r.retiring]
        for r in cand:
            if process_alive(*r.putter):
                continue
            with self._lock:
                if r.retiring or r.arr is None or np.any(r.words):
                    continue
                r.retiring = True
                self._retire_q.append(r)
                self.counters["putters_reaped"] += 1

    def housekeeping(self) -> None:
        from memsem.native import process_alive

        n = 0
        while not self._stop.wait(HOUSEKEEPING_S):
            if self.parent is not None and not process_alive(*self.parent):
                log.info("agent parent %d exited; shutting down", self.parent[0])
                self._stop.set()
                break
            self._drain_retire_q()
            n += 1
            if n % 5 == 0:
                self._reap_dead_putters()

    def close(self) -> None:
        with self._lock:
            self._regions.clear()
            self._retire_q.clear()
        self.rt.close(timeout=0.5)

    # -- serving ---------------------------------------------------------------------------------
    def serve(self, listener: Listener) -> None:
        def accept_loop() -> None:
            while not self._stop.is_set():
                try:
                    conn = listener.accept()
                except Exception as exc:  # bad authkey, or the listener closed at shutdown
                    if self._stop.is_set():
                        return
                    log.warning("agent: refused a connection: %s", exc)
                    continue
                threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

        threading.Thread(target=accept_loop, daemon=True, name="memsem-tq-accept").start()
        self.housekeeping()

    def _serve_conn(self, conn: Connection) -> None:
        with conn:
            while not self._stop.is_set():
                try:
                    if not conn.poll(0.5):
                        continue
                    op, kwargs = conn.recv()
                except (EOFError, OSError):
                    return
                fn = getattr(self, f"op_{op}", None)
                try:
                    if fn is None:
                        raise ValueError(f"unknown agent op {op!r}")
                    reply = ("ok", fn(**kwargs))
                except Exception as exc:
                    reply = ("err", type(exc).__name__, str(exc))
                try:
                    conn.send(reply)
                except (OSError, ValueError):
                    return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memsem.integrations._tq_agent")
    ap.add_argument("--job", default=None)
    ap.add_argument("--directory", default=None)
    ap.add_argument("--parent", default=None, help="PID:START of the process whose exit stops the agent")
    args = ap.parse_args(argv)
    authkey = bytes.fromhex(sys.stdin.readline().strip())  # never on the command line
    parent = tuple(int(x) for x in args.parent.split(":")) if args.parent else None
    sockdir = tempfile.mkdtemp(prefix="memsem-tq-")  # mode 0700
    address = os.path.join(sockdir, "agent.sock")
    agent = Agent(job=args.job, directory=args.directory, parent=parent)  # type: ignore[arg-type]
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    signal.signal(signal.SIGTERM, lambda *_: agent._stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of the driver: it stops us by exiting
    print(f"READY {address}", flush=True)
    try:
        agent.serve(listener)
    finally:
        try:
            listener.close()
        finally:
            agent.close()
            shutil.rmtree(sockdir, ignore_errors=True)
    return 0


# ----------------------------------------------------------------------------------------------
_ERRORS = {c.__name__: c for c in (ValueError, TypeError, KeyError, MemsemError, OutOfMemoryError,
                                   StaleReferenceError, LeaseHeldError, MemsemTimeoutError)}


class AgentClient:
    """Control-channel client of an agent. Thread safe; reconnects after a fork."""

    def __init__(self, address: str, authkey: bytes, *, timeout: float = 60.0) -> None:
        self.address = address
        self.authkey = authkey
        self.timeout = timeout
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._pid = -1

    def _connection(self) -> Connection:
        if self._conn is None or self._pid != os.getpid():
            try:
                self._conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise PeerLostError(f"memsem TransferQueue agent at {self.address} is not running "
                                    f"(was tq.init's process, which owns it, stopped?)") from exc
            self._pid = os.getpid()
        return self._conn

    def call(self, op: str, **kwargs: Any) -> Any:
        with self._lock:
            conn = self._connection()
            try:
                conn.send((op, kwargs))
                if not conn.poll(self.timeout):
                    self._conn = None
                    raise MemsemTimeoutError(f"memsem TransferQueue agent: no reply to {op!r} in {self.timeout} s",
                                             what=f"agent reply to {op}", timeout=self.timeout)
                reply = conn.recv()
            except (EOFError, OSError) as exc:
                self._conn = None
                raise PeerLostError(f"memsem TransferQueue agent at {self.address} went away during {op!r}") from exc
        if reply[0] == "ok":
            return reply[1]
        cls = _ERRORS.get(reply[1], MemsemError)
        raise cls(f"agent: {reply[2]}")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None


class AgentProcess:
    """A started agent: ``address``, ``authkey``, memsem ``job`` and ``directory`` for clients;
    ``stop()`` (safe twice)."""

    def __init__(self, proc: subprocess.Popen, address: str, authkey: bytes, job: str,
                 directory: str | None) -> None:
        self.proc, self.address, self.authkey = proc, address, authkey
        self.job, self.directory = job, directory

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            AgentClient(self.address, self.authkey, timeout=2.0).call("shutdown")
        except MemsemError:
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_agent(*, job: str | None = None, directory: str | None = None, timeout: float = 30.0) -> AgentProcess:
    """Start an agent owned by this process (it exits when this process does).

    Args:
        job: memsem directory namespace of its windows (default ``MEMSEM_JOB`` or "default");
            clients must use the same (the bootstrap provider writes it into the TQ config).
        directory: memsem directory (default local).
        timeout: seconds to wait for it to report ready.

    Raises:
        MemsemTimeoutError: it did not report ready within ``timeout`` s. MemsemError: it exited.
    """
    from memsem.directory.local import default_job
    from memsem.native import ProcessIdentity

    me = ProcessIdentity.current()
    job = job or default_job()  # fixed now: clients get it from the config, not their environment
    cmd = [sys.executable, "-m", "memsem.integrations._tq_agent", "--parent", f"{me.pid}:{me.start_time}",
           "--job", job]
    if directory:
        cmd += ["--directory", directory]
    authkey = os.urandom(32)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    if proc.stdin is None or proc.stdout is None:  # pragma: no cover - Popen with PIPE sets both
        raise MemsemError("memsem TransferQueue agent: no pipes to the agent process")
    proc.stdin.write(authkey.hex().encode() + b"\n")
    proc.stdin.close()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        r, _, _ = select.select([proc.stdout], [], [], max(0.0, left))
        if not r:
            proc.kill()
            raise MemsemTimeoutError(f"memsem TransferQueue agent did not start in {timeout} s",
                                     what="agent start", timeout=timeout)
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            raise MemsemError(f"memsem TransferQueue agent exited at start (status {proc.wait()})")
        line += chunk
    proc.stdout.close()
    text = line.decode().strip()
    if not text.startswith("READY "):
        proc.kill()
        raise MemsemError(f"memsem TransferQueue agent: unexpected start line {text!r}")
    return AgentProcess(proc, text[len("READY "):], authkey, job, directory)


if __name__ == "__main__":
    sys.exit(main())
