"""TransferQueue storage backend ``Memsem`` (the ``transferqueue`` extra: docs/transferqueue.md).

TransferQueue (PyPI ``transferqueue``) keeps managing keys, fields, readiness, consumption and
retries; memsem manages addresses, transfers, completion, leases and generations under it.
Select it with::

    import memsem.integrations.transferqueue          # registers "Memsem" with TQ's factories
    tq.init(OmegaConf.create({"backend": {"storage_backend": "Memsem"}}))

and make every Ray worker import this module too (TQ has no plugin discovery)::

    ray.init(runtime_env=memsem.integrations.transferqueue.ray_runtime_env())

Where the bytes live: in a memsem storage agent (:mod:`memsem.integrations._tq_agent`), a small
process started by the bootstrap provider in the process whose ``tq.init`` creates the controller;
its address and authkey reach every client through ``conf.backend.Memsem``, which the controller
stores. The agent owns one shared-segment window per put call (one registration per region,
never per item), so data outlives the putting process until it is cleared.

* ``put(keys, values)``: groups the values by field, asks the agent for one region sized for the
  whole call, writes each field with one-sided memsem puts (one copy per contiguous run: TQ's
  per-row views of a batch tensor go in one copy; non-tensor values are pickled), then commits
  every item by writing its generation word. Returns one small dict per key (the region's
  serialized ref, item index, generation, byte range, dtype, shape): TQ stores it and hands it
  back to ``get``/``clear`` as ``custom_backend_meta``.
* ``get(keys, ..., custom_backend_meta)``: takes a lease on each region's window, checks every
  item's generation word, copies the bytes with one-sided memsem gets (seqlock-checked against
  the window generation), re-checks the words, then releases the lease. It returns writable
  tensors that share nothing with the storage. ``shapes``/``dtypes`` from TQ are not trusted:
  the meta carries what was stored.
* ``clear(keys, custom_backend_meta)``: the agent zeroes the items' words (waiting while a reader
  holds a lease), and unpublishes a region once its last item is cleared (deferred while leased):
  its generation moves, so every outstanding meta of it is stale. Never-put keys are ignored.
* checkpoints (``tq.save_checkpoint`` / ``tq.load_checkpoint``): the storage manager asks the
  agent to write its regions into ``<checkpoint>/memsem_storage/`` and to restore them from
  there, into this agent or a new one (after ``tq.close()`` and ``tq.init()``). A region keeps its
  id and its items their generations, so the metas TQ restores name them unchanged; a client
  whose meta names a window that is gone asks the agent where the region lives now (by id).
* ``tq.close()`` in the process that ran ``tq.init`` stops the agent (TQ 0.1.11's ``close``
  knows only its own backends: this module wraps it, see :func:`_install_close_hook`).

Guarantees: a recycled TQ global index never yields old bytes (the item's generation is in its
meta and in the region); a clear that races a get either waits for it or makes the get raise
``StaleReferenceError`` naming the keys, never return wrong bytes; a checkpoint restores exactly
the items committed when it was saved (CRC-checked; a damaged file restores nothing).

Scope: one agent per TQ instance, on the node that ran ``tq.init``; clients on that node reach it
through shared segments (route ``host/shm``). Other nodes need a memsem directory and engine that
reach across nodes (``directory: redis://...``, RDMA), which this backend passes through
(``backend.Memsem.directory``) but does not yet test.

One module, over 600 lines, because TransferQueue loads a backend by one module path: the client,
the manager and their process bootstrap must be importable together (the agent is _tq_agent).
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import logging
import os
import pickle
import secrets
import threading
import time
from typing import Any

import numpy as np
import torch
from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
from transfer_queue.storage.clients.base import StorageClientFactory, StorageKVClient
from transfer_queue.storage.managers.base import KVStorageManager, StorageManagerFactory

from memsem._errors import MemsemError, PeerLostError, StaleReferenceError
from memsem.integrations._tq_agent import ALIGN, AgentClient, AgentProcess, align, start_agent

log = logging.getLogger(__name__)

__all__ = [
    "BACKEND_NAME", "CLIENT_NAME", "E2E_BACKEND_CONFIG", "MemsemStorageClient", "MemsemStorageManager",
    "bootstrap_memsem", "counters", "ray_runtime_env", "remove_run_dirs", "stop_agents", "worker_setup",
]

BACKEND_NAME = "Memsem"
CLIENT_NAME = "MemsemStorageClient"
META_VERSION = 1

#: config TransferQueue's backend-neutral e2e tests use for this backend (tests/tq harness)
E2E_BACKEND_CONFIG = {
    "controller": {"polling_mode": True},
    "backend": {"storage_backend": BACKEND_NAME, BACKEND_NAME: {}},
}

_KIND_TENSOR = "t"
_KIND_PICKLE = "p"

#: bytes this process moved, for benchmarks (``counters()``): one-sided puts/gets, and staging
#: copies made before a put (non-contiguous tensors, pickled objects)
_counters = {"put_bytes": 0, "get_bytes": 0, "staged_bytes": 0, "puts": 0, "gets": 0, "regions": 0,
             "runs_put": 0, "runs_get": 0}
_counters_lock = threading.Lock()


def _count(**kw: int) -> None:
    with _counters_lock:
        for k, v in kw.items():
            _counters[k] += v


def counters() -> dict[str, Any]:
    """This process's transfer counters, plus the agent's (when this process started it)."""
    with _counters_lock:
        out: dict[str, Any] = {f"memsem_{k}": v for k, v in _counters.items()}
    for agent in list(_AGENTS):
        if agent.alive():
            try:
                st = AgentClient(agent.address, agent.authkey, timeout=5.0).call("stats")
            except MemsemError:
                continue
            out.update({f"memsem_agent_{k}": v for k, v in st.items() if k != "pid"})
    return out


# ----------------------------------------------------------------------------------------------
class _ProcessRuntime:
    """One memsem Runtime per process (per directory/job), shared by every client instance and
    closed when the last open client of its job closes (so a closed TQ instance leaves no rank
    record of this process in its job's folder). The runtime bounds its own cache of resolved
    windows (regions the agent frees stop being mapped here); this backend keeps no mappings of
    its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rts: dict[tuple[str | None, str | None], Any] = {}
        self._users: dict[tuple[str | None, str | None], int] = {}
        self._pid = os.getpid()

    def _forked(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's runtimes are not ours
            self._rts, self._users, self._pid = {}, {}, os.getpid()

    def acquire(self, directory: str | None, job: str | None) -> None:
        with self._lock:
            self._forked()
            key = (directory, job)
            self._users[key] = self._users.get(key, 0) + 1

    def release(self, directory: str | None, job: str | None) -> None:
        with self._lock:
            self._forked()
            key = (directory, job)
            n = self._users.get(key, 0) - 1
            if n > 0:
                self._users[key] = n
                return
            self._users.pop(key, None)
            rt = self._rts.pop(key, None)
        if rt is not None:
            rt.close()

    def runtime(self, directory: str | None, job: str | None) -> Any:
        from memsem import Runtime

        with self._lock:
            self._forked()
            rt = self._rts.get((directory, job))
            if rt is None or rt.closed:
                rt = Runtime(directory=directory, job=job)
                self._rts[(directory, job)] = rt
                atexit.register(rt.close)
            return rt


_PROC = _ProcessRuntime()


# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Item:
    pos: int  # position in the caller's key list
    key: str
    kind: str
    nbytes: int
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0  # byte offset in the region


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of a contiguous CPU tensor (no copy)."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def _runs(tensors: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """Group consecutive tensors that lie back to back in one storage (TQ's per-row views of a
    batch tensor, rows of a jagged tensor) into ``(first, count, flat tensor)`` runs."""
    runs: list[tuple[int, int, torch.Tensor]] = []
    i = 0
    n = len(tensors)
    while i < n:
        t0 = tensors[i]
        ptr = t0.untyped_storage().data_ptr()
        end = t0.storage_offset() + t0.numel()
        j = i + 1
        while j < n:
            t = tensors[j]
            if (t.dtype != t0.dtype or not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr
                    or t.storage_offset() != end):
                break
            end += t.numel()
            j += 1
        total = end - t0.storage_offset()
        flat = t0.as_strided((total,), (1,), t0.storage_offset()) if j - i > 1 else t0
        runs.append((i, j - i, flat))
        i = j
    return runs


def _dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"Memsem backend: unknown torch dtype {name!r} in custom_backend_meta")
    return dt


@StorageClientFactory.register(CLIENT_NAME)
class MemsemStorageClient(StorageKVClient):
    """TransferQueue KV client over memsem windows owned by the storage agent.

    Config (``backend.Memsem``): ``agent_address`` and ``agent_authkey`` (written by the
    bootstrap provider), optional ``job`` and ``directory`` (memsem directory; default local),
    ``lease_ttl`` (s a get may hold a region, default 30), ``clear_timeout`` (s a clear waits
    for readers' leases, default 30), ``agent_timeout`` (s per control request, default 60),
    ``checkpoint_timeout`` (s a checkpoint save or load may take in the agent, default 3600).

    Thread safety: every method may be called from any thread (TQ calls put from executor
    threads and get/clear from its event loop thread).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        address = config.get("agent_address")
        authkey = config.get("agent_authkey")
        if not address or not authkey:
            raise ValueError("Memsem backend: backend.Memsem has no agent_address/agent_authkey; tq.init() "
                             "runs the Memsem bootstrap provider, which writes them: was this module imported "
                             "in the process that called tq.init() first?")
        self.lease_ttl = float(config.get("lease_ttl", 30.0))
        self.clear_timeout = float(config.get("clear_timeout", 30.0))
        self._directory = config.get("directory") or None
        self._job = config.get("job") or None
        self._agent = AgentClient(str(address), bytes.fromhex(str(authkey)),
                                  timeout=float(config.get("agent_timeout", 60.0)))
        _PROC.acquire(self._directory, self._job)
        self._closed = False
        self.checkpoint_timeout = float(config.get("checkpoint_timeout", 3600.0))
        self._ident: tuple[int, int] | None = None
        # rid -> the current window ref of a region whose meta names an older window (restored
        # from a checkpoint); bounded, refilled from the agent on demand
        self._where: dict[int, bytes] = {}
        self._where_lock = threading.Lock()

    @property
    def runtime(self) -> Any:
        return _PROC.runtime(self._directory, self._job)

    def _identity(self) -> tuple[int, int]:
        from memsem.native import ProcessIdentity

        if self._ident is None or self._ident[0] != os.getpid():
            me = ProcessIdentity.current()
            self._ident = (me.pid, me.start_time)
        return self._ident

    # -- put -------------------------------------------------------------------------------------
    def put(self, keys: list[str], values: list[Any]) -> list[dict[str, Any]]:
        """Store ``values[i]`` under ``keys[i]`` ("{global_index}@{field}") in one new region.

        Blocking; when it returns, every byte is in the agent's region and committed. Tensors
        are stored raw (any CPU dtype; other devices are copied to CPU first); other values are
        pickled.

        Returns:
            One meta dict per key (TQ's ``custom_backend_meta``).

        Raises:
            ValueError: keys and values differ in length. OutOfMemoryError: the agent's segment
            directory cannot hold the region. PeerLostError: the agent is gone.
        """
        if len(keys) != len(values):
            raise ValueError(f"keys ({len(keys)}) and values ({len(values)}) differ in length")
        if not keys:
            return []
        by_field: dict[str, list[int]] = {}
        for pos, key in enumerate(keys):
            by_field.setdefault(str(key).partition("@")[2], []).append(pos)

        items: list[_Item] = [None] * len(keys)  # type: ignore[list-item]
        sources: list[tuple[int, np.ndarray]] = []  # (region offset, bytes) to put
        staged = 0
        cursor = 8 * len(keys)  # the item words come first
        plans = []
        for field, positions in by_field.items():
            vals = [values[p] for p in positions]
            if all(isinstance(v, torch.Tensor) and not v.is_nested and v.layout == torch.strided for v in vals):
                ts = []
                for v in vals:
                    t = v.detach()
                    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
                        t = t.resolve_conj().resolve_neg().to("cpu").contiguous()
                        staged += t.numel() * t.element_size()
                    ts.append(t)
                plans.append((field, positions, _KIND_TENSOR, ts))
            else:
                blobs = []
                for v in vals:
                    if isinstance(v, torch.Tensor) and not v.is_nested and \
                            v.untyped_storage().nbytes() > v.numel() * v.element_size():
                        v = v.clone()  # pickling a view writes its whole storage
                    blobs.append(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))
                plans.append((field, positions, _KIND_PICKLE, blobs))
        for field, positions, kind, objs in plans:
            cursor = align(cursor)
            if kind == _KIND_TENSOR:
                for (first, count, flat) in _runs(objs):
                    nb = flat.numel() * flat.element_size()
                    if nb:
                        sources.append((cursor, _tensor_bytes(flat)))
                    for k in range(first, first + count):
                        t = objs[k]
                        n = t.numel() * t.element_size()
                        p = positions[k]
                        items[p] = _Item(p, keys[p], kind, n, str(t.dtype).rpartition(".")[2], tuple(t.shape), cursor)
                        cursor += n
            else:
                blob = b"".join(objs)
                staged += len(blob)
                if blob:
                    sources.append((cursor, np.frombuffer(blob, np.uint8)))
                for k, b in enumerate(objs):
                    p = positions[k]
                    items[p] = _Item(p, keys[p], kind, len(b), offset=cursor)
                    cursor += len(b)
        total = max(align(cursor), ALIGN)

        pid, start = self._identity()
        grant = self._agent.call("alloc", nbytes=total, n_items=len(keys), pid=pid, start=start)
        from memsem.refs import TensorRef

        rt = self.runtime
        ref_bytes = grant["ref"]
        spec = TensorRef.from_bytes(ref_bytes, rt).spec
        gens = np.arange(grant["gen_base"], grant["gen_base"] + len(keys), dtype=np.uint64)
        moved = 0
        try:
            for off, src in sources:
                rt.transfer(spec, "put", off, src)
                moved += src.nbytes
            # Commit: the item words go last; a reader accepts an item only once its word is set.
            rt.transfer(spec, "put", 0, gens.view(np.uint8))
        except BaseException:
            try:
                self._agent.call("abort", rid=int(grant["rid"]), gva=spec.gva)
            except MemsemError as exc:  # the agent reaps it when this process exits
                log.warning("Memsem backend: freeing the region of a failed put: %s", exc)
            raise
        _count(put_bytes=moved, staged_bytes=staged, puts=1, regions=1, runs_put=len(sources))
        rid = int(grant["rid"])
        return [{"v": META_VERSION, "ref": ref_bytes, "rid": rid, "gva": spec.gva, "i": it.pos,
                 "g": int(gens[it.pos]), "o": it.offset, "n": it.nbytes, "k": it.kind, "dt": it.dtype,
                 "sh": list(it.shape)} for it in items]

    # -- get -------------------------------------------------------------------------------------
    def get(self, keys: list[str], shapes: Any = None, dtypes: Any = None,
            custom_backend_meta: list[Any] | None = None) -> list[Any]:
        """Read the values of ``keys`` (metas from ``put``) into new, writable memory.

        Blocking. Each region is leased across resolve, generation checks and copy; TQ's
        ``shapes``/``dtypes`` are ignored (the meta records what was stored).

        Raises:
            KeyError: a key has no Memsem meta (never put through this backend).
            StaleReferenceError: an item was cleared or its region freed (before or during the
                read); names the keys. No bytes of it are returned.
        """
        if custom_backend_meta is None or len(custom_backend_meta) != len(keys):
            raise KeyError(f"Memsem backend: get of {len(keys)} keys needs one custom_backend_meta per key "
                           f"(got {None if custom_backend_meta is None else len(custom_backend_meta)})")
        if not keys:
            return []
        rt = self.runtime
        metas = []
        for key, m in zip(keys, custom_backend_meta):
            if not isinstance(m, dict) or m.get("v") != META_VERSION:
                raise KeyError(f"Memsem backend: key {key!r} has no Memsem meta ({m!r}); it was not put "
                               "through this backend")
            metas.append(m)
        # Output buffer: keys grouped by field (as TQ orders them), each item at the offset its
        # element size needs; items adjacent in a region and in the output copy as one run.
        out_off = []
        cursor = 0
        prev_field = None
        for key, m in zip(keys, metas):
            field = key.partition("@")[2]
            if field != prev_field:
                cursor = align(cursor)
                prev_field = field
            out_off.append(cursor)
            cursor += int(m["n"])
        out = torch.empty(max(cursor, 1), dtype=torch.uint8)
        out_np = out.numpy()

        regions: dict[int, list[int]] = {}
        for idx, m in enumerate(metas):
            regions.setdefault(int(m["rid"]), []).append(idx)
        moved = runs = 0
        for rid, idxs in regions.items():
            spec, lease = self._lease_region(rt, rid, metas[idxs[0]]["ref"], keys, idxs)
            try:
                self._check_words(rt, spec, lease, keys, metas, idxs, "before")
                i = 0
                while i < len(idxs):
                    a = idxs[i]
                    src, dst, n = int(metas[a]["o"]), out_off[a], int(metas[a]["n"])
                    j = i + 1
                    while j < len(idxs):
                        b = idxs[j]
                        if int(metas[b]["o"]) != src + n or out_off[b] != dst + n:
                            break
                        n += int(metas[b]["n"])
                        j += 1
                    if n:
                        try:
                            rt.transfer(spec, "get", src, out_np[dst:dst + n], lease=lease)
                        except StaleReferenceError as exc:
                            raise self._gone(keys, idxs[i:j], "its region was freed during the read") from exc
                        moved += n
                        runs += 1
                    i = j
                self._check_words(rt, spec, lease, keys, metas, idxs, "during")
            finally:
                lease.release()
        _count(get_bytes=moved, gets=1, runs_get=runs)

        values: list[Any] = []
        for m, o in zip(metas, out_off):
            n = int(m["n"])
            if m["k"] == _KIND_TENSOR:
                values.append(out[o:o + n].view(_dtype_of(m["dt"])).reshape(tuple(m["sh"])))
            else:
                values.append(pickle.loads(out_np[o:o + n].data))
        return values

    def _lease_region(self, rt: Any, rid: int, meta_ref: bytes, keys: list[str],
                      idxs: list[int]) -> tuple[Any, Any]:
        """Lease the window that holds region ``rid`` now: the one in its meta, else (restored
        from a checkpoint, possibly by another agent) the one the agent names."""
        from memsem.refs import TensorRef
        from memsem.core import Lease

        with self._where_lock:
            ref_bytes = self._where.get(rid, meta_ref)
        for attempt in (0, 1):
            spec = TensorRef.from_bytes(ref_bytes, rt).spec
            try:
                return spec, Lease(rt, spec, self.lease_ttl).acquire()
            except (StaleReferenceError, PeerLostError) as exc:
                if attempt:
                    raise self._gone(keys, idxs, "its region was freed") from exc
                now = self._agent.call("locate", rids=[rid]).get(rid)
                if now is None or now == ref_bytes:
                    raise self._gone(keys, idxs, "its region is not held by the storage agent") from exc
                with self._where_lock:
                    if len(self._where) >= _WHERE_MAX:
                        self._where.clear()
                    self._where[rid] = ref_bytes = now
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _gone(keys: list[str], idxs: list[int], why: str) -> StaleReferenceError:
        names = [keys[i] for i in idxs[:8]]
        more = f" (+{len(idxs) - 8} more)" if len(idxs) > 8 else ""
        return StaleReferenceError(f"Memsem backend: keys {names}{more} are no longer stored: {why} "
                                   "(cleared, the global index was recycled, or the storage agent restarted "
                                   "without tq.load_checkpoint); no bytes of them are returned")

    def _check_words(self, rt: Any, spec: Any, lease: Any, keys: list[str], metas: list[dict],
                     idxs: list[int], when: str) -> None:
        hi = max(int(metas[i]["i"]) for i in idxs) + 1
        words = np.empty(hi, np.uint64)
        try:
            rt.transfer(spec, "get", 0, words.view(np.uint8), lease=lease)
        except StaleReferenceError as exc:
            raise self._gone(keys, idxs, f"its region was freed {when} the read") from exc
        bad = [i for i in idxs if int(words[int(metas[i]["i"])]) != int(metas[i]["g"])]
        if bad:
            raise self._gone(keys, bad, "the item was cleared" if when == "before" else
                             "the item was cleared during the read")

    # -- clear -----------------------------------------------------------------------------------
    def clear(self, keys: list[str], custom_backend_meta: list[Any] | None = None) -> None:
        """Clear ``keys``. Keys without a Memsem meta (never put) are ignored. Blocks while a
        reader holds a lease on their region (up to ``clear_timeout`` s), then returns; the
        region's memory is released once its last item is cleared and no lease is held."""
        if not custom_backend_meta:
            return
        items = [(int(m["rid"]), int(m["gva"]), int(m["i"]), int(m["g"])) for m in custom_backend_meta
                 if isinstance(m, dict) and m.get("v") == META_VERSION]
        if items:
            self._agent.call("free", items=items, timeout=self.clear_timeout)

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Have the agent write its committed items into ``checkpoint_dir/memsem_storage``.

        Blocking (up to ``checkpoint_timeout`` s). The agent writes the files itself: no tensor
        byte passes through this process. Returns the agent's counts (regions, items, bytes).
        """
        return self._agent.call("save_checkpoint", checkpoint_dir=os.path.abspath(checkpoint_dir),
                                reply_timeout=self.checkpoint_timeout)

    def load_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Have the agent restore the regions saved in ``checkpoint_dir/memsem_storage``.

        Raises:
            FileNotFoundError: the checkpoint holds no Memsem storage.
            ValueError: its files are damaged (index or CRC-32 mismatch); nothing was restored.
        """
        with self._where_lock:
            self._where.clear()
        return self._agent.call("load_checkpoint", checkpoint_dir=os.path.abspath(checkpoint_dir),
                                reply_timeout=self.checkpoint_timeout)

    def close(self) -> None:
        """Close the control connection and, with the last open client of this job in this
        process, the process's memsem runtime. Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._agent.close()
        _PROC.release(self._directory, self._job)


#: regions whose current window a client remembers (after a checkpoint restore)
_WHERE_MAX = 1 << 16


@StorageManagerFactory.register(BACKEND_NAME)
class MemsemStorageManager(KVStorageManager):
    """KVStorageManager over :class:`MemsemStorageClient`; TQ's key/value mapping is unchanged.

    The lease that TQ's own ``kv_batch_get`` lacks is taken by the client's ``get``: it spans
    resolving each region named by the metadata, checking the items' generations and copying.
    A clear that lands between TQ's metadata lookup and the read is reported as
    ``StaleReferenceError`` naming the keys, never as other bytes.
    """

    def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
        config = dict(config or {})
        config["client_name"] = CLIENT_NAME
        super().__init__(controller_info, config, zmq_context=zmq_context)

    def close(self) -> None:
        """TQ's close of the storage manager; TQ's KV manager does not close its client."""
        client = getattr(self, "storage_client", None)
        if client is not None:
            client.close()
        super().close()

    async def save_checkpoint(self, checkpoint_dir: str) -> None:
        """TQ's storage checkpoint: the agent writes ``checkpoint_dir/memsem_storage``."""
        st = await asyncio.get_running_loop().run_in_executor(None, self.storage_client.save_checkpoint,
                                                              checkpoint_dir)
        log.info("Memsem backend: saved %d regions (%d items, %d bytes) to %s", st["regions"], st["items"],
                 st["bytes"], st["folder"])

    async def load_checkpoint(self, checkpoint_dir: str) -> None:
        """TQ's storage restore from ``checkpoint_dir/memsem_storage`` (see the client)."""
        st = await asyncio.get_running_loop().run_in_executor(None, self.storage_client.load_checkpoint,
                                                              checkpoint_dir)
        log.info("Memsem backend: restored %d regions (%d items; %d already held) from %s", st["regions"],
                 st["items"], st["kept"], checkpoint_dir)


# ----------------------------------------------------------------------------------------------
_AGENTS: list[AgentProcess] = []


@StorageBootstrapProvider.register_provider(BACKEND_NAME)
def bootstrap_memsem(conf: Any) -> dict[str, Any]:
    """TQ bootstrap provider: start the storage agent and publish its address.

    Runs in the process whose ``tq.init`` creates the controller, before the controller stores
    the config; the agent's address and authkey go into ``conf.backend.Memsem`` and so reach
    every client. An ``agent_address`` already in the config (an agent you run yourself) is
    used as is. The agent lives until ``tq.close()`` in this process (see
    :func:`_install_close_hook`), this process's exit, or :func:`stop_agents`; a new bootstrap
    in this process stops the agents of an earlier instance first.
    """
    if conf.backend.get(BACKEND_NAME) is None:
        conf.backend[BACKEND_NAME] = {}
    section = conf.backend[BACKEND_NAME]
    if section.get("agent_address"):
        return {"agent": "external", "address": section.agent_address}
    stop_agents()
    # A memsem job of its own per TQ instance (unless configured): two instances on one node
    # never share a namespace, and what a run leaves is recognisable and reaped as one.
    job = section.get("job") or f"tq-{os.getpid()}-{secrets.token_hex(4)}"
    agent = start_agent(job=job, directory=section.get("directory") or None)
    _AGENTS.append(agent)
    _JOBS.add(agent.job)
    section.agent_address = agent.address
    section.agent_authkey = agent.authkey.hex()
    section.job = agent.job
    return {"agent": agent, "address": agent.address, "pid": agent.pid}


def stop_agents() -> None:
    """Stop the storage agents this process started (their data is gone), then remove what
    dead processes of their memsem jobs left (records, segments; the job folder once empty).
    Safe twice."""
    while _AGENTS:
        agent = _AGENTS.pop()
        agent.stop()
        _reap_job(agent.job, 0.0)


#: memsem jobs of the agents this process started
_JOBS: set[str] = set()


def _job_folder(job: str) -> str:
    from memsem.native import segment_dir, segment_prefix

    return os.path.join(segment_dir(), f"{segment_prefix()}dir.{job}")


def _reap_job(job: str, timeout: float) -> bool:
    """Garbage-collect dead processes' leftovers (``memsem gc``) until ``job``'s folder is gone
    or ``timeout`` s passed (clients in live processes still use it). True when it is gone."""
    from memsem.core import collect

    deadline = time.monotonic() + timeout
    folder = _job_folder(job)
    while True:
        if os.path.isdir(folder):
            collect()
        if not os.path.isdir(folder):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def remove_run_dirs(timeout: float = 30.0) -> list[str]:
    """Harness hook (tests/tq, at session end): stop this process's agents and wait up to
    ``timeout`` s for the clients of their jobs (Ray workers, killed by ``ray.shutdown``) to be
    gone, reaping what they left. Returns the job folders still present (none expected)."""
    stop_agents()
    deadline = time.monotonic() + timeout
    left = [j for j in sorted(_JOBS) if not _reap_job(j, max(0.0, deadline - time.monotonic()))]
    return [_job_folder(j) for j in left]


atexit.register(stop_agents)


def _install_close_hook() -> None:
    """Make ``tq.close()`` stop this backend's agent, without TQ's per-close warning.

    TransferQueue 0.1.11's ``close`` walks the storage resources its bootstrap providers
    returned and shuts down the backends it knows (SimpleStorage, MooncakeStore, Yuanrong); for
    any other it logs "close for _TQ_STORAGE with key ... is not supported" and leaves it
    running. TQ has no close hook for providers, so this wraps ``transfer_queue.close`` (and
    ``transfer_queue.interface.close``): it takes this backend's entry out of TQ's resources,
    runs TQ's own close, then stops the agents this process started. Idempotent; code that
    bound ``from transfer_queue import close`` before this module was imported keeps TQ's
    original (which then warns and leaves the agent to this process's exit).
    """
    import transfer_queue as _tq
    import transfer_queue.interface as _iface

    orig = _iface.close
    if getattr(orig, "__memsem_wrapped__", False):
        return

    @functools.wraps(orig)
    def close(*args: Any, **kwargs: Any) -> Any:
        storage = getattr(_iface, "_TQ_STORAGE", None)
        ours = storage.pop(BACKEND_NAME, None) if isinstance(storage, dict) else None
        try:
            return orig(*args, **kwargs)
        finally:
            if ours is not None:
                stop_agents()

    close.__memsem_wrapped__ = True  # type: ignore[attr-defined]
    _iface.close = close
    if getattr(_tq, "close", None) is orig:
        _tq.close = close


_install_close_hook()


def worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: importing this module registered the backend."""


def ray_runtime_env(runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """``runtime_env`` for ``ray.init`` that imports this backend in every Ray worker.

    Raises:
        ValueError: ``runtime_env`` already names another ``worker_process_setup_hook``.
    """
    env = dict(runtime_env or {})
    hook = f"{__name__}.worker_setup"
    if env.get("worker_process_setup_hook") not in (None, hook):
        raise ValueError(f"runtime_env already sets worker_process_setup_hook="
                         f"{env['worker_process_setup_hook']!r}; call {hook}() from it instead")
    env["worker_process_setup_hook"] = hook
    return env
