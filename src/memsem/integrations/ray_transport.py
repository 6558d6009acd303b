"""memsem as a Ray tensor transport: ``@ray.method(tensor_transport="memsem")`` (docs/ray-transport.md).

Ray (2.60: ``ray.experimental.register_tensor_transport``, ``TensorTransportManager``) lets a
library move the tensors an actor method returns out of band, instead of through its object
store. This module registers memsem as such a transport for CPU memory::

    import memsem.integrations.ray_transport as mrt
    mrt.register()                       # in the driver, before the actor classes are defined

    @ray.remote
    class Trainer:
        @ray.method(tensor_transport="memsem")
        def weights(self) -> torch.Tensor:
            return self.w                # published in place; Ray carries its ref

Two transports, one per data type Ray extracts from a returned value (Ray's API takes one type
per transport): ``"memsem"`` for CPU torch tensors, ``"memsem_numpy"`` for numpy arrays.

What happens, by Ray's calls (each runs in the process named):

* ``extract_tensor_transport_metadata`` (the returning actor, right after the method returns):
  every returned tensor is published as a memsem window **in place** (a non-contiguous one, or
  a conj/neg view, is published from a contiguous copy that the window keeps alive); the
  metadata Ray keeps with the object carries each window's serialized ref (~100 bytes) and its
  record (~800 bytes: owner, generation, control block, descriptors by engine). The windows are
  *unlisted*: no record in the job's ``ray`` directory, so publishing makes no directory call
  (the directory is an actor: a call is a Ray task). The same memory returned again while an
  earlier object of it is alive reuses its window (counted), so a method that returns ``self.w``
  while the previous step's object lives publishes once. A tensor that is not on the CPU
  publishes nothing: Ray refuses the device with its own ``ValueError`` ("does not support tensor
  transfer on device ..."). Publishing is local work only: it never waits for a receiver, so the
  actor's next task is not held.
* ``recv_multiple_tensors`` / ``fetch_multiple_tensors`` (each receiving actor, or a process's
  ``ray.get``): one-sided memsem gets of every ref (each window resolved from the record beside
  it, checked as a directory's record would be: the ref's key, the generation at the window's
  control block or its owner, the owner's liveness; no directory read) into Ray's target
  buffers when it passes them (``ray.experimental.set_target_for_ref``), else into new tensors
  (of 4 MiB and more: memory advised for transparent huge pages, so the first copy faults far
  fewer pages); by the route memsem picks
  (cross-memory attach or a shared segment on one node, tcp across Ray nodes: each Ray node is a
  node of memsem's ``ray`` directory, nothing to set). A tensor larger than ``CHUNK_BYTES`` is
  read in chunks so that an abort is seen within one chunk. Every wait is bounded by the
  transport runtime's timeout (``TIMEOUT_S``, below Ray's own fetch timeout): a dead returning
  actor is ``PeerLostError`` (or the connection's error) at its next liveness check, which Ray
  raises to the receiver (a ``RayTaskError`` in the receiving task, the error itself from
  ``ray.get``), never a hang.
* ``abort_transport`` (a receiving actor; Ray calls it when a transfer failed or outran Ray's
  timeout, since ``can_abort_transport`` is True): the in-flight reads of that object stop at
  their next chunk with ``MemsemError`` ("aborted").
* ``garbage_collect`` (the returning actor, once Ray's reference counting found the object out of
  scope, so after every receiver): the object's windows are unpublished (a window reused by a
  live object stays until that one goes too): their generation moves, so the refs and records
  in the object's metadata read nothing from then on (``StaleReferenceError``).

Counters of this process's transport: :func:`transport_stats` (windows published, reused and
unpublished; tensors and bytes received; aborts) and the transport runtime's ``stats()`` (bytes by
route).

Limits (Ray's, 2.60): register before the actor classes are *defined* (``@ray.method`` checks the
name) and before the actors are created, in the process that creates them; Ray then registers the
transport in each actor. A module that defines such a class and is imported by Ray's workers
must call :func:`register` at import too (it is idempotent). Ray registers a serializer for the
transport's data type in a process that returns such an object; from then on that process's
other returns of that type are pickled in band (Ray's behaviour for every custom transport).
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import dataclasses
import logging
import threading
from typing import Any

import numpy as np
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
    TensorTransportMetadata,
)

from memsem._buffers import empty_arena
from memsem._errors import MemsemError, MemsemTimeoutError, NotSupportedError

logger = logging.getLogger(__name__)

#: the transport for CPU torch tensors (``@ray.method(tensor_transport="memsem")``)
TRANSPORT = "MEMSEM"
#: the transport for numpy arrays (``@ray.method(tensor_transport="memsem_numpy")``)
NUMPY_TRANSPORT = "MEMSEM_NUMPY"
#: bytes read per get of a larger tensor: an abort is seen within one chunk
CHUNK_BYTES = 32 << 20
#: bound in seconds of every wait of the transport's runtime (gets, unpublish); below Ray's own
#: fetch timeout (``RAY_rdt_fetch_fail_timeout_milliseconds``, 60 s), so memsem's error comes first
TIMEOUT_S = 30.0
#: an object's tensors holding this many bytes or more are received into memory advised for
#: transparent huge pages (fewer page faults on the first copy), smaller ones into ``torch.empty``
ARENA_MIN_BYTES = 4 << 20


#: the process's transport runtime (both transports' managers share it), made on first use
_RUNTIME: list[Any] = [None]
_RUNTIME_LOCK = threading.Lock()


def runtime() -> Any:
    """This process's transport runtime: a ``memsem.Runtime`` made on first use (inside a Ray job
    its directory is the job's own, nothing to set), bounded by ``TIMEOUT_S`` (and by half of
    Ray's fetch timeout), closed at exit."""
    with _RUNTIME_LOCK:
        rt = _RUNTIME[0]
        if rt is None or rt.closed:
            from memsem import Runtime

            rt = _RUNTIME[0] = Runtime(timeout=min(TIMEOUT_S, 0.5 * _ray_fetch_timeout()))
            atexit.register(rt.close)
        return rt


def close() -> None:
    """Close this process's transport runtime now (else at exit): its windows retire, so objects
    it published become unreadable. A driver that goes on after ``ray.shutdown()`` calls it
    first. Safe twice; a later transfer makes a new runtime."""
    with _RUNTIME_LOCK:
        rt, _RUNTIME[0] = _RUNTIME[0], None
    if rt is not None:
        rt.close()


def _ray_fetch_timeout() -> float:
    from ray._private import ray_constants

    return float(ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)


@dataclasses.dataclass
class MemsemTransportMetadata(TensorTransportMetadata):
    """Ray's ``tensor_meta`` and device, plus per tensor one serialized memsem ref and its
    window's record (None for an empty tensor: nothing to read). The windows are unlisted (no
    directory record): a receiver resolves each from the record beside its ref."""

    refs: list[bytes | None] = dataclasses.field(default_factory=list)
    records: list[dict | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class MemsemCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: a one-sided read needs only the refs the object's metadata carries."""


@dataclasses.dataclass
class MemsemFetchRequest(FetchRequest):
    """A fetch started by ``fetch_multiple_tensors`` (``ray.get``): the reads run on the
    transport's threads; ``wait_fetch_complete`` waits for them, bounded."""

    future: Any = None
    abort: Any = None

    def __del__(self) -> None:  # never waited for: stop the reads (Ray's contract for requests)
        fut, ev = self.future, self.abort
        if fut is not None and not fut.done() and ev is not None:
            ev.set()


@dataclasses.dataclass
class _Window:
    ref: Any          # the RefSpec of the window this process published (unlisted)
    data: Any         # the memory published (kept alive with the window)
    objects: int = 0  # live Ray objects whose metadata names it
    record: dict | None = None  # the window's record, carried in the objects' metadata


def _memory_key(t: Any) -> tuple:
    """What identifies published memory: address, bytes, dtype, shape (two returns of the same
    tensor share a window; a view of other bytes does not)."""
    if isinstance(t, np.ndarray):
        return ("np", t.__array_interface__["data"][0], t.nbytes, t.dtype.str, t.shape)
    return ("torch", t.data_ptr(), t.numel() * t.element_size(), str(t.dtype), tuple(t.shape))


class MemsemTensorTransport(TensorTransportManager):
    """Ray's transport manager for memsem over CPU torch tensors (one instance per process,
    made by Ray). Thread safety: Ray calls it from the actor's task thread (extract), its
    ``_ray_system`` thread (recv, free) and its ``_ray_system_error`` thread (abort); one lock
    guards the tables, no copy runs under it."""

    NAME = TRANSPORT

    def __init__(self, runtime: Any = None) -> None:
        #: the runtime it publishes and reads with (None: the process's transport runtime; Ray
        #: makes the manager with none)
        self._runtime = runtime
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._windows: dict[tuple, _Window] = {}
        #: windows no live object names that are being unpublished now: still live (counted in
        #: ``live_windows``) until their unpublish ended, so a caller that sees none live sees
        #: every unpublish done and counted
        self._retiring = 0
        self._objects: dict[str, tuple[MemsemTransportMetadata, list[tuple]]] = {}
        self._inflight: dict[str, set[threading.Event]] = {}
        self.counts = dict.fromkeys(("published", "reused", "unpublished", "objects", "freed", "received_tensors",
                                     "received_bytes", "aborted", "refused"), 0)

    def _count(self, key: str, n: int = 1) -> None:
        with self._count_lock:
            self.counts[key] += n

    # -- Ray's interface: what the transport is --------------------------------------------------
    def tensor_transport_backend(self) -> str:
        return self.NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """True: Ray registers the transport in every actor it creates after ``register`` (the
        call must not block: Ray makes it before every task submission)."""
        return True

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: str | None = None) -> MemsemCommunicatorMetadata:
        return MemsemCommunicatorMetadata()

    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                              communicator_metadata: Any) -> None:
        raise NotImplementedError("the memsem transport is one-sided: the receiver reads, nothing is sent")

    # -- the runtime -------------------------------------------------------------------------------
    @property
    def runtime(self) -> Any:
        """The runtime given, else this process's transport runtime (one for both transports;
        see :func:`runtime`)."""
        return self._runtime if self._runtime is not None else runtime()

    # -- the returning side ------------------------------------------------------------------------
    def _check(self, t: Any, i: int) -> str:
        """The device type of returned tensor ``i`` (TypeError for another data type)."""
        import torch

        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {i}: the {self.NAME.lower()} transport moves torch tensors, got {type(t).__name__}")
        return t.device.type

    def _publishable(self, t: Any) -> Any:
        t = t.detach()
        if t.is_conj() or t.is_neg() or not t.is_contiguous():
            t = t.resolve_conj().resolve_neg().contiguous()  # a copy the window keeps alive
        return t

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> MemsemTransportMetadata:
        """Publish the returned tensors in place and return their refs (see the module doc).

        A retried task's second call for the same object returns the first call's metadata.
        Tensors of a device other than the CPU publish nothing; Ray refuses the device.
        Raises TypeError / ValueError (memsem's, naming the tensor) for memory it cannot publish.
        """
        with self._lock:
            known = self._objects.get(obj_id)
        if known is not None:
            return known[0]
        devices = {self._check(t, i) for i, t in enumerate(rdt_object)}
        if len(devices) > 1:
            raise ValueError(f"all tensors of one object must be on one device type, got {sorted(devices)}")
        device = devices.pop() if devices else None
        meta = MemsemTransportMetadata(tensor_meta=[(t.shape, t.dtype) for t in rdt_object], tensor_device=device)
        if device not in (None, "cpu"):
            self._count("refused")
            return meta  # Ray raises its own error: "does not support tensor transfer on device ..."
        rt = self.runtime
        keys: list[tuple] = []
        try:
            for t in rdt_object:
                data = self._publishable(t)
                if data.nbytes == 0:
                    meta.refs.append(None)
                    meta.records.append(None)
                    continue
                key = _memory_key(data)
                with self._lock:
                    w = self._windows.get(key)
                    if w is not None:
                        w.objects += 1
                        self._count("reused")
                if w is None:
                    spec = rt.publish_spec(data, access="r", listed=False)  # no directory call
                    w = _Window(spec, data, 1, rt.publisher.record(spec))
                    with self._lock:
                        other = self._windows.setdefault(key, w)
                        if other is not w:  # published meanwhile by another thread: use that one
                            other.objects += 1
                            self._count("reused")
                        else:
                            self._count("published")
                    if other is not w:
                        rt.unpublish_spec(w.ref)
                        w = other
                keys.append(key)
                meta.refs.append(w.ref.to_bytes())
                meta.records.append(w.record)
        except BaseException:
            self._release(keys)
            raise
        with self._lock:
            self._objects[obj_id] = (meta, keys)
            self._count("objects")
        return meta

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        """Ray freed the object: unpublish its windows (each once no live object names it)."""
        with self._lock:
            known = self._objects.pop(obj_id, None)
        if known is not None:
            self._count("freed")
            self._release(known[1])

    def _release(self, keys: list[tuple]) -> None:
        gone = []
        with self._lock:
            for key in keys:
                w = self._windows.get(key)
                if w is None:
                    continue
                w.objects -= 1
                if w.objects <= 0:
                    del self._windows[key]
                    gone.append(w)
            self._retiring += len(gone)
        rt = self._runtime if self._runtime is not None else _RUNTIME[0]
        for w in gone:
            try:
                if rt is None or rt.closed:
                    continue  # the runtime's close retired every window already
                rt.unpublish_spec(w.ref)  # waits (bounded) for copies in flight to drain
                self._count("unpublished")
            except MemsemError as exc:
                logger.warning("memsem transport: unpublishing %s failed: %s", w.ref, exc)
            finally:
                with self._lock:
                    self._retiring -= 1

    def stats(self) -> dict[str, Any]:
        """Counters: windows ``published`` / ``reused`` / ``unpublished`` and ``live_windows``;
        ``objects`` returned and ``freed``; ``received_tensors`` / ``received_bytes``;
        ``reads_in_flight`` (objects being read now) and ``aborted`` reads; ``refused`` objects (not on the CPU); ``bytes_by_route`` of its runtime (moved by
        anything of this process that uses it; None before its first use)."""
        with self._lock:
            live, reading = len(self._windows) + self._retiring, sum(len(evs) for evs in self._inflight.values())
        with self._count_lock:
            out: dict[str, Any] = dict(self.counts, live_windows=live, reads_in_flight=reading)
        rt = self._runtime if self._runtime is not None else _RUNTIME[0]
        out["bytes_by_route"] = dict(rt.stats().bytes_by_route) if rt is not None and not rt.closed else None
        return out

    def live_windows(self) -> int:
        """Windows this process publishes for live Ray objects, and those being unpublished now."""
        with self._lock:
            return len(self._windows) + self._retiring

    # -- the receiving side ------------------------------------------------------------------------
    def _empties(self, tensor_meta: list[tuple[Any, Any]]) -> list[Any]:
        """New tensors for an object's ``(shape, dtype)`` list: from one mapping advised for
        transparent huge pages when they hold ``ARENA_MIN_BYTES`` or more (a first copy into
        fresh memory pays a fault per page: 2 MiB pages cost several times less than 4 KiB ones),
        else ``torch.empty``."""
        import torch

        sizes = [int(np.prod(tuple(shape), dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
                 for shape, dtype in tensor_meta]
        if sum(sizes) < ARENA_MIN_BYTES:
            return [torch.empty(shape, dtype=dtype) for shape, dtype in tensor_meta]
        raw = empty_arena([(np.uint8, (n,)) for n in sizes])
        return [torch.from_numpy(a).view(dtype).view(shape) for a, (shape, dtype) in zip(raw, tensor_meta)]

    def _flat_bytes(self, buf: Any) -> Any:
        return buf.view(-1).view(__import__("torch").uint8)

    def _check_target(self, buf: Any, i: int) -> None:
        if getattr(buf, "device", None) is not None and buf.device.type != "cpu":
            raise NotSupportedError(f"target buffer {i} is on {buf.device}: the memsem transport writes CPU memory only")

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any, communicator_metadata: Any,
                              target_buffers: list[Any] | None = None) -> list[Any]:
        """Read every tensor of the object (one-sided), into ``target_buffers`` when given.

        Blocking; every read bounded by the runtime's timeout. Raises memsem's errors
        (``PeerLostError`` for a dead returning actor, ``StaleReferenceError`` for a freed
        object, ``MemsemError`` "aborted" after ``abort_transport``)."""
        ev = threading.Event()
        self._track(obj_id, ev)
        try:
            return self._read_all(obj_id, tensor_transport_metadata, target_buffers, ev)
        finally:
            self._untrack(obj_id, ev)

    def _read_all(self, obj_id: str, meta: Any, target_buffers: list[Any] | None, ev: threading.Event) -> list[Any]:
        if not isinstance(meta, MemsemTransportMetadata):
            raise TypeError(f"object {obj_id}: metadata of another transport ({type(meta).__name__})")
        if len(meta.records) != len(meta.refs):
            raise ValueError(f"object {obj_id}: {len(meta.records)} window records for {len(meta.refs)} refs")
        if target_buffers is not None and len(target_buffers) != len(meta.refs):
            raise ValueError(f"object {obj_id}: {len(target_buffers)} target buffers for {len(meta.refs)} tensors")
        rt = self.runtime
        if target_buffers is not None:
            for i, buf in enumerate(target_buffers):
                self._check_target(buf, i)
            out = list(target_buffers)
        else:
            out = self._empties(meta.tensor_meta)
        for raw, record, buf in zip(meta.refs, meta.records, out):
            if raw is not None:
                ref = rt.ref(raw)
                with rt.resolver.carry(ref.spec, record):  # resolved from the record: no directory read
                    self._read(ref, buf, ev, obj_id)
        return out

    def _read(self, ref: Any, buf: Any, ev: threading.Event, obj_id: str) -> None:
        n = ref.nbytes
        if n <= CHUNK_BYTES:
            if ev.is_set():
                raise MemsemError(f"memsem transport: the read of object {obj_id} was aborted")
            ref.get(buf)
        else:
            flat = self._flat_bytes(buf)
            for off in range(0, n, CHUNK_BYTES):
                if ev.is_set():
                    raise MemsemError(f"memsem transport: the read of object {obj_id} was aborted "
                                      f"({off} of {n} bytes read)")
                k = min(CHUNK_BYTES, n - off)
                ref.bytes(off, k).get(flat[off:off + k])
        self._count("received_tensors")
        self._count("received_bytes", n)

    def _track(self, obj_id: str, ev: threading.Event) -> None:
        with self._lock:
            self._inflight.setdefault(obj_id, set()).add(ev)

    def _untrack(self, obj_id: str, ev: threading.Event) -> None:
        with self._lock:
            evs = self._inflight.get(obj_id)
            if evs is not None:
                evs.discard(ev)
                if not evs:
                    del self._inflight[obj_id]

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        """Stop this process's reads of ``obj_id`` in flight (at their next chunk). Never blocks."""
        with self._lock:
            evs = list(self._inflight.get(obj_id, ()))
            if evs:
                self._count("aborted")
        for ev in evs:
            ev.set()

    def fetch_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any, communicator_metadata: Any,
                               target_buffers: list[Any] | None = None) -> MemsemFetchRequest:
        """Start reading the object on the transport's threads (``ray.get`` of several objects
        reads them at once); ``wait_fetch_complete`` returns the tensors."""
        ev = threading.Event()
        self._track(obj_id, ev)

        def run() -> list[Any]:
            try:
                return self._read_all(obj_id, tensor_transport_metadata, target_buffers, ev)
            finally:
                self._untrack(obj_id, ev)

        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="memsem-ray-fetch")
            pool = self._pool
        return MemsemFetchRequest(obj_id=obj_id, tensors=[], future=pool.submit(run), abort=ev)

    def wait_fetch_complete(self, fetch_request: Any, timeout: float = -1) -> list[Any]:
        """The fetched tensors, waiting at most ``timeout`` s (-1: the runtime's bound).
        On a timeout the reads are stopped and ``TimeoutError`` raised (Ray's contract)."""
        if not isinstance(fetch_request, MemsemFetchRequest):
            return fetch_request.tensors
        bound = self.runtime.timeout + 5.0  # the reads end at the runtime's timeout: a margin over it
        t = bound if timeout is None or timeout < 0 else min(float(timeout), bound)
        try:
            return fetch_request.future.result(timeout=t)
        except cf.TimeoutError:
            fetch_request.abort.set()
            raise MemsemTimeoutError(f"memsem transport: object {fetch_request.obj_id} not read within {t} s",
                                     what=f"fetch of object {fetch_request.obj_id}", timeout=t) from None


class MemsemNumpyTransport(MemsemTensorTransport):
    """The same transport for numpy arrays (``tensor_transport="memsem_numpy"``)."""

    NAME = NUMPY_TRANSPORT

    def _check(self, t: Any, i: int) -> str:
        if not isinstance(t, np.ndarray):
            raise TypeError(f"array {i}: the {self.NAME.lower()} transport moves numpy arrays, got {type(t).__name__}")
        return "cpu"

    def _publishable(self, t: Any) -> Any:
        return t if t.flags.c_contiguous else np.ascontiguousarray(t)

    def _empties(self, tensor_meta: list[tuple[Any, Any]]) -> list[Any]:
        sizes = [int(np.prod(tuple(shape), dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in tensor_meta]
        if sum(sizes) < ARENA_MIN_BYTES:
            return [np.empty(shape, dtype=dtype) for shape, dtype in tensor_meta]
        return empty_arena([(np.dtype(dtype), tuple(shape)) for shape, dtype in tensor_meta])

    def _flat_bytes(self, buf: Any) -> Any:
        return buf.reshape(-1).view(np.uint8)


def register() -> list[str]:
    """Register the transports with Ray in this process (idempotent): ``"memsem"`` for CPU torch
    tensors (when torch is importable) and ``"memsem_numpy"`` for numpy arrays. Call it in the
    driver before defining the actor classes that name them; returns the names registered now or
    before."""
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt.util import transport_manager_info

    wanted: list[tuple[str, type, Any]] = [(NUMPY_TRANSPORT, MemsemNumpyTransport, np.ndarray)]
    try:
        import torch

        wanted.insert(0, (TRANSPORT, MemsemTensorTransport, torch.Tensor))
    except ImportError:
        pass
    for name, cls, data_type in wanted:
        if name not in transport_manager_info:  # Ray refuses a name registered twice
            register_tensor_transport(name, ["cpu"], cls, data_type)
    return [name for name, _, _ in wanted]


def manager(name: str = TRANSPORT) -> MemsemTensorTransport:
    """This process's transport manager for ``name`` (Ray's singleton)."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    m = get_tensor_transport_manager(name.upper())
    if not isinstance(m, MemsemTensorTransport):
        raise ValueError(f"{name!r} is not a memsem transport")
    return m


def transport_stats(name: str = TRANSPORT) -> dict[str, Any]:
    """This process's counters of transport ``name`` (:meth:`MemsemTensorTransport.stats`)."""
    return manager(name).stats()


__all__ = ["CHUNK_BYTES", "close", "runtime", "NUMPY_TRANSPORT", "TIMEOUT_S", "TRANSPORT", "MemsemCommunicatorMetadata",
           "MemsemFetchRequest", "MemsemNumpyTransport", "MemsemTensorTransport", "MemsemTransportMetadata",
           "manager", "register", "transport_stats"]
