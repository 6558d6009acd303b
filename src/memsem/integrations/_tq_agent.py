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

Region ids (``rid``) and item generations are unique across agents (random 40-bit bases), so a
region restored from a checkpoint into another agent keeps its id and its items keep their
generations: TransferQueue's restored metadata names them unchanged.

Checkpoints (``save_checkpoint`` / ``load_checkpoint``, TQ's ``tq.save_checkpoint`` /
``tq.load_checkpoint`` through the backend): the agent writes its own regions, in
``<checkpoint>/memsem_storage/``: ``index.json`` (format, version, one entry per region: rid,
bytes, item count, CRC-32) and ``r<rid>.bin`` (the region's bytes, item words first). Only
committed items are saved (their word set before the snapshot of the words); a load re-creates
every saved region that this agent does not hold (new window, same rid, same item words) and
restores the words of items cleared since, in regions it still holds. Clients find a region's
current window by its rid (``locate``) when the window in their meta is gone.

Control channel: ``multiprocessing.connection`` over an AF_UNIX socket in a 0700 directory, with
a random authkey (HMAC challenge). Requests are ``(op, kwargs)``; replies ``("ok", value)`` or
``("err", error class name, message)``. Ops: ``alloc``, ``abort``, ``free``, ``locate``,
``save_checkpoint``, ``load_checkpoint``, ``stats``, ``ping``, ``shutdown``.

The agent exits when the process that started it exits (checked every 0.2 s), on ``shutdown``,
or on SIGTERM; it then unpublishes everything and unlinks its segments. Segments of an agent
killed with SIGKILL are reaped by ``memsem gc`` or by the next memsem Runtime started on the node.

Run by :func:`start_agent` as ``python -m memsem.integrations._tq_agent``.

One module, over 600 lines, because the agent is one process's program: its regions, the
requests it answers and its life cycle (started, orphaned, reaped) are read together.
"""
from __future__ import annotations

import memsem

import argparse
import dataclasses
import json
import logging
import os
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
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
#: folder of the agent's files inside a TransferQueue checkpoint, and its index file
CHECKPOINT_SUBDIR = "memsem_storage"
CHECKPOINT_INDEX = "index.json"
CHECKPOINT_FORMAT = "memsem-transferqueue-storage"
CHECKPOINT_VERSION = 1


def _lease_holders(rt: Any, ref: Any) -> list[tuple[int, float]]:
    """``(pid, seconds left)`` of unexpired leases of live holders on ``ref``'s window (a window
    this agent's runtime owns; [] when it owns it no more)."""
    try:
        return rt.lease_holders(ref)
    except memsem.WindowNotFoundError:
        return []


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
        # Region ids and item generations are unique in this agent and, from random 40-bit
        # starts, across agents (a checkpoint restored elsewhere keeps both).
        self._next_rid = (secrets.randbits(40) + 1) << 20
        self._next_gen = (secrets.randbits(40) + 1) << 20
        self._retire_q: list[_Region] = []
        self._stop = threading.Event()
        self.counters = {"allocs": 0, "alloc_bytes": 0, "frees": 0, "items_freed": 0, "regions_retired": 0,
                         "clear_waits": 0, "clear_wait_s": 0.0, "putters_reaped": 0, "aborts": 0,
                         "checkpoints_saved": 0, "regions_saved": 0, "checkpoints_loaded": 0,
                         "regions_restored": 0, "items_restored": 0, "locates": 0, "reap_passes": 0}

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
        ignored (TransferQueue clears keys that were never put). An item is named by its rid and
        generation (both unique across agents); the gva is that of the window the meta was
        minted with, which a region restored from a checkpoint no longer has."""
        by_region: dict[int, list[tuple[int, int]]] = {}
        for rid, _gva, index, gen in items:
            by_region.setdefault(int(rid), []).append((int(index), int(gen)))
        freed = missing = 0
        deadline = time.monotonic() + timeout
        for rid, lst in by_region.items():
            with self._lock:
                region = self._regions.get(rid)
            if region is None or region.retiring:
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

    def op_locate(self, rids: list[int]) -> dict[int, bytes | None]:
        """The current window ref of each region (None: not held here, or being retired)."""
        out: dict[int, bytes | None] = {}
        with self._lock:
            self.counters["locates"] += 1
            for rid in rids:
                r = self._regions.get(int(rid))
                out[int(rid)] = None if r is None or r.retiring else r.ref.to_bytes()
        return out

    def op_save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Write every region holding committed items to ``checkpoint_dir/memsem_storage``.

        Items are saved if committed when the words are read (a put committing meanwhile is
        not saved, like one after the save); their bytes never change once committed, so the
        data copy needs no lock. Returns counts for the caller's log."""
        folder = os.path.join(checkpoint_dir, CHECKPOINT_SUBDIR)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with self._lock:
            snap = [(r, r.arr, r.words.copy()) for r in self._regions.values() if not r.retiring and r.arr is not None]
        entries = []
        items = nbytes = 0
        for region, arr, words in snap:
            live = int(np.count_nonzero(words))
            if not live:
                continue
            name = f"r{region.rid}.bin"
            crc = 0
            with open(os.path.join(folder, name), "wb") as f:
                head = words.view(np.uint8)
                body = arr[head.nbytes:]
                for chunk in (head, body):
                    mv = memoryview(chunk)
                    f.write(mv)
                    crc = zlib.crc32(mv, crc)
                f.flush()
                os.fsync(f.fileno())
            entries.append({"rid": region.rid, "file": name, "nbytes": int(arr.nbytes), "n_items": region.n_items,
                            "gen_base": region.gen_base, "live": live, "crc32": crc})
            items += live
            nbytes += int(arr.nbytes)
        index = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "regions": entries}
        tmp = os.path.join(folder, CHECKPOINT_INDEX + ".tmp")
        with open(tmp, "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, CHECKPOINT_INDEX))
        with self._lock:
            self.counters["checkpoints_saved"] += 1
            self.counters["regions_saved"] += len(entries)
        return {"regions": len(entries), "items": items, "bytes": nbytes, "folder": folder}

    def op_load_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Restore the regions of ``checkpoint_dir/memsem_storage`` (see the module docstring).

        Raises:
            FileNotFoundError: no index (the checkpoint was saved without Memsem storage).
            ValueError: the index or a region file is not what was saved (format, version,
                size or CRC-32 differ): nothing of it is restored.
        """
        folder = os.path.join(checkpoint_dir, CHECKPOINT_SUBDIR)
        path = os.path.join(folder, CHECKPOINT_INDEX)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Memsem storage index not found: {path}")
        try:
            with open(path) as f:
                index = json.load(f)
            if index.get("format") != CHECKPOINT_FORMAT or index.get("version") != CHECKPOINT_VERSION:
                raise ValueError(f"format {index.get('format')!r} version {index.get('version')!r}, expected "
                                 f"{CHECKPOINT_FORMAT!r} version {CHECKPOINT_VERSION}")
            entries = [(int(e["rid"]), str(e["file"]), int(e["nbytes"]), int(e["n_items"]), int(e["gen_base"]),
                        int(e["crc32"])) for e in index["regions"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"Memsem storage index {path} is not valid: {exc}") from exc
        # Read and check every file before touching any state.
        loaded = []
        for rid, name, nbytes, n_items, gen_base, crc in entries:
            fpath = os.path.join(folder, os.path.basename(name))
            if not os.path.exists(fpath):
                raise FileNotFoundError(f"Memsem storage file of region {rid} not found: {fpath}")
            if os.path.getsize(fpath) != nbytes or nbytes < 8 * n_items:
                raise ValueError(f"Memsem storage file {fpath} holds {os.path.getsize(fpath)} bytes, the index "
                                 f"says {nbytes} (for {n_items} items)")
            loaded.append((rid, fpath, nbytes, n_items, gen_base, crc))
        # Regions this agent does not hold are read into new memory and checked first; only when
        # every file matched its index is anything published or changed.
        fresh = []
        keep = []
        for rid, fpath, nbytes, n_items, gen_base, crc in loaded:
            with self._lock:
                live = self._regions.get(rid)
            if live is not None and not live.retiring:
                words = np.empty(n_items, np.uint64)
                got, c = 0, 0
                with open(fpath, "rb") as f:
                    got = f.readinto(memoryview(words).cast("B"))
                    c = zlib.crc32(memoryview(words).cast("B"))
                    while chunk := f.read(1 << 24):
                        c = zlib.crc32(chunk, c)
                        got += len(chunk)
                if got != nbytes or c != crc:
                    raise ValueError(f"Memsem storage file {fpath} does not match its CRC-32 in the index: "
                                     "nothing of the checkpoint was restored")
                keep.append((live, words))
                continue
            arr = self.rt.alloc(max(nbytes, 8), np.uint8)
            with open(fpath, "rb") as f:
                got = f.readinto(memoryview(arr))
            if got != nbytes or zlib.crc32(memoryview(arr)) != crc:
                raise ValueError(f"Memsem storage file {fpath} does not match its CRC-32 in the index: "
                                 "nothing of the checkpoint was restored")
            words = arr[: 8 * n_items].view(np.uint64)
            if np.count_nonzero(words):
                fresh.append((rid, arr, n_items, gen_base, words))
        restored = items = 0
        for rid, arr, n_items, gen_base, words in fresh:
            ref = self.rt.publish(arr, access="rw")
            live_n = int(np.count_nonzero(words))
            with self._lock:
                self._regions[rid] = _Region(rid, arr, ref, n_items, gen_base, (os.getpid(), 0), live_n)
                self._next_gen = max(self._next_gen, int(words.max()) + 1)
                self._next_rid = max(self._next_rid, rid + 1)
            restored += 1
            items += live_n
        for live, words in keep:
            with self._lock:
                cur = live.words
                back = (cur == 0) & (words != 0)
                cur[back] = words[back]
                live.live += int(back.sum())
                items += int(back.sum())
        kept = len(keep)
        with self._lock:
            self.counters["checkpoints_loaded"] += 1
            self.counters["regions_restored"] += restored
            self.counters["items_restored"] += items
        return {"regions": restored, "kept": kept, "items": items}

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
    def _wait_unleased(self, region: _Region, deadline: float) -> None:
        t0 = time.monotonic()
        waited = bool(_lease_holders(self.rt, region.ref))
        if waited:
            try:  # asleep on the leases' own words (woken by their release), within the deadline
                left = self.rt.wait_unleased(region.ref.spec, max(0.0, deadline - t0))
            except memsem.WindowNotFoundError:
                left = []
            if left:
                # Readers that still hold a lease fail their after-copy check: never old bytes.
                log.info("clear of region %d proceeds with leases still held after the timeout", region.rid)
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
            if r.putter[1] == 0 or process_alive(*r.putter):  # 0: restored from a checkpoint
                continue
            with self._lock:
                if r.retiring or r.arr is None or np.any(r.words):
                    continue
                r.retiring = True
                self._retire_q.append(r)
                self.counters["putters_reaped"] += 1
        with self._lock:
            self.counters["reap_passes"] += 1

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
_ERRORS = {c.__name__: c for c in (ValueError, TypeError, KeyError, FileNotFoundError, MemsemError,
                                   OutOfMemoryError, StaleReferenceError, LeaseHeldError, MemsemTimeoutError)}


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

    def call(self, op: str, /, *, reply_timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``op(**kwargs)`` in the agent; wait up to ``reply_timeout`` s (default: this
        client's ``timeout``) for the reply. Raises the agent's error, mapped to its class."""
        timeout = self.timeout if reply_timeout is None else reply_timeout
        with self._lock:
            conn = self._connection()
            try:
                conn.send((op, kwargs))
                if not conn.poll(timeout):
                    self._conn = None
                    conn.close()  # a late reply must not answer the next request
                    raise MemsemTimeoutError(f"memsem TransferQueue agent: no reply to {op!r} in {timeout} s",
                                             what=f"agent reply to {op}", timeout=timeout)
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
        directory: memsem directory (default: the one this process would use: ``ray`` inside a
            Ray job, else ``MEMSEM_DIRECTORY`` or local).
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
    # MEMSEM_TQ_AGENT_LAUNCHER: a command prefix that runs the agent elsewhere (e.g. "ip netns exec
    # nodeA env MEMSEM_NODE_ID=node-a": the agent on another node, its clients reaching it over tcp)
    cmd = shlex.split(os.environ.get("MEMSEM_TQ_AGENT_LAUNCHER", "")) + cmd
    # The directory this process would use (inside a Ray job: its Ray directory) and what the
    # agent, not a Ray worker itself, needs to open it (the job's Ray address and namespace).
    from memsem.directory import child_env, choose_url

    directory = choose_url(directory)[0]
    cmd += ["--directory", directory]
    env = dict(os.environ, **child_env(directory, job))
    authkey = os.urandom(32)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, env=env)
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
