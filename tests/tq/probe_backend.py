"""Probe: a minimal cross-process TransferQueue storage backend, registered as ``Probe``.

A test double for finding out what TransferQueue (transferqueue 0.1.11) asks of a KV
backend; it is not memsem. Each value is pickled into its own file under a run
directory in /dev/shm, so data outlives the process that put it and any process on the
node can read it. The run directory is made by the bootstrap provider during
``tq.init()`` and published to every client through the config the controller stores.

``put`` returns one small dict per key (``{"gen": N, "nbytes": B}``); TransferQueue keeps
it in the controller and hands it back to ``get``/``clear`` as ``custom_backend_meta``.
``get`` checks the generation, so a recycled global index never yields older bytes.

Set ``TQ_PROBE_TRACE=/path/file.jsonl`` to log every call (pid, process kind, key
samples, value types, shapes/dtypes, metas, bytes) as JSON lines.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import shutil
import threading
import time
import urllib.parse
import uuid
from typing import Any

import torch

from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
from transfer_queue.storage.clients.base import StorageClientFactory, StorageKVClient
from transfer_queue.storage.managers.base import KVStorageManager, StorageManagerFactory

BACKEND_NAME = "Probe"
CLIENT_NAME = "ProbeStorageClient"
SHM_BASE = os.environ.get("TQ_PROBE_BASE", "/dev/shm")

_gen_lock = threading.Lock()
_gen_counter = itertools.count(1)


def _process_kind() -> str:
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            if ctx.get_actor_id() is not None:
                return "ray-actor"
            if ctx.get_task_id() is not None:
                return "ray-task"
            return "ray-driver"
    except Exception:
        pass
    return "plain"


def _describe(value: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": f"{type(value).__module__}.{type(value).__qualname__}"}
    for attr in ("shape", "dtype", "is_nested", "layout", "device"):
        if hasattr(value, attr):
            try:
                d[attr] = str(getattr(value, attr))
            except Exception:
                pass
    if hasattr(value, "is_contiguous"):
        try:
            d["contiguous"] = bool(value.is_contiguous())
            d["storage_offset"] = int(value.storage_offset())
            d["storage_nbytes"] = int(value.untyped_storage().nbytes())
            d["nbytes"] = int(value.nelement() * value.element_size())
        except Exception:
            pass
    return d


def _by_field(keys: list[str], items: list[Any], describe=_describe, limit: int = 3) -> dict[str, list]:
    """{field: first few distinct descriptions} for a trace line."""
    out: dict[str, list] = {}
    for key, item in zip(keys, items):
        field = key.split("@", 1)[1] if "@" in key else key
        desc = describe(item)
        if isinstance(desc, dict):
            desc = {k: v for k, v in desc.items() if k not in ("storage_offset",)}
        seen = out.setdefault(field, [])
        if desc not in seen and len(seen) < limit:
            seen.append(desc)
    return out


def _trace(event: str, **fields: Any) -> None:
    path = os.environ.get("TQ_PROBE_TRACE")
    if not path:
        return
    rec = {"t": time.time(), "pid": os.getpid(), "kind": _process_kind(), "event": event, **fields}
    line = json.dumps(rec, default=str) + "\n"
    # One write() on an O_APPEND descriptor keeps lines from several processes whole.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _next_gen() -> int:
    # Unique across processes: pid in the high bits, a per-process counter below.
    with _gen_lock:
        return (os.getpid() << 32) | next(_gen_counter)


@StorageClientFactory.register(CLIENT_NAME)
class ProbeStorageClient(StorageKVClient):
    """One file per key: ``<root>/<quoted key>`` holding pickle((gen, value))."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        root = config.get("root")
        if not root:
            raise ValueError("Probe backend: config has no 'root' (was the Probe bootstrap provider run by tq.init?)")
        self.root = str(root)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        _trace("client_init", root=self.root, config_keys=sorted(config.keys()))

    def _path(self, key: str) -> str:
        return os.path.join(self.root, urllib.parse.quote(key, safe=""))

    def put(self, keys: list[str], values: list[Any]) -> list[Any] | None:
        if len(keys) != len(values):
            raise ValueError(f"keys ({len(keys)}) and values ({len(values)}) differ in length")
        metas = []
        total = 0
        for key, value in zip(keys, values, strict=True):
            gen = _next_gen()
            if (
                isinstance(value, torch.Tensor)
                and not value.is_nested
                and value.untyped_storage().nbytes() > value.nbytes
            ):
                # TQ hands over per-sample views of the batch tensor; pickling a view
                # writes its whole storage, so a batch of n would cost n x the batch.
                value = value.clone()
            blob = pickle.dumps((gen, value), protocol=pickle.HIGHEST_PROTOCOL)
            path = self._path(key)
            tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            total += len(blob)
            metas.append({"gen": gen, "nbytes": len(blob)})
        _trace(
            "put",
            n=len(keys),
            keys=keys[:6],
            value_types=sorted({_describe(v)["type"] for v in values}),
            fields=_by_field(keys, values),
            offsets=[_describe(v).get("storage_offset") for v in values[:6]],
            bytes=total,
        )
        return metas

    def get(self, keys: list[str], shapes=None, dtypes=None, custom_backend_meta=None) -> list[Any]:
        out = []
        total = 0
        for i, key in enumerate(keys):
            meta = custom_backend_meta[i] if custom_backend_meta is not None else None
            try:
                with open(self._path(key), "rb") as f:
                    blob = f.read()
            except FileNotFoundError:
                raise KeyError(f"Probe backend: key {key!r} not found") from None
            gen, value = pickle.loads(blob)
            if isinstance(meta, dict) and "gen" in meta and meta["gen"] != gen:
                raise RuntimeError(
                    f"Probe backend: key {key!r} holds generation {gen}, the caller's meta names {meta['gen']}"
                )
            total += len(blob)
            out.append(value)
        _trace(
            "get",
            n=len(keys),
            keys=keys[:6],
            shapes=None if shapes is None else [str(s) for s in shapes[:6]],
            dtypes=None if dtypes is None else [str(d) for d in dtypes[:6]],
            shapes_len=None if shapes is None else len(shapes),
            metas=None if custom_backend_meta is None else custom_backend_meta[:6],
            value_types=sorted({_describe(v)["type"] for v in out}),
            fields=_by_field(keys, out),
            shape_dtype_by_field=None
            if shapes is None
            else _by_field(keys, list(zip(shapes, dtypes or [None] * len(shapes))), describe=lambda sd: [str(sd[0]), str(sd[1])]),
            bytes=total,
        )
        return out

    def clear(self, keys: list[str], custom_backend_meta=None) -> None:
        removed = 0
        for i, key in enumerate(keys):
            meta = custom_backend_meta[i] if custom_backend_meta is not None else None
            path = self._path(key)
            try:
                if isinstance(meta, dict) and "gen" in meta:
                    # Remove only the generation the caller named; a newer put survives.
                    with open(path, "rb") as f:
                        gen, _ = pickle.load(f)
                    if gen != meta["gen"]:
                        continue
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
        _trace(
            "clear",
            n=len(keys),
            keys=keys[:6],
            metas=None if custom_backend_meta is None else custom_backend_meta[:6],
            removed=removed,
        )


@StorageManagerFactory.register(BACKEND_NAME)
class ProbeStorageManager(KVStorageManager):
    """KVStorageManager over ProbeStorageClient; all the key/value mapping is TQ's."""

    def __init__(self, controller_info, config, zmq_context=None):
        config = dict(config or {})
        config["client_name"] = CLIENT_NAME
        _trace("manager_init", config=config)
        super().__init__(controller_info, config, zmq_context=zmq_context)


@StorageBootstrapProvider.register_provider(BACKEND_NAME)
def bootstrap_probe(conf) -> dict[str, Any]:
    """Run once by the process that calls tq.init() first: make the run directory and
    publish it in conf.backend.Probe.root, which the controller stores for all clients."""
    root = os.path.join(SHM_BASE, f"tqprobe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(root, mode=0o700)
    if conf.backend.get(BACKEND_NAME) is None:
        conf.backend[BACKEND_NAME] = {}
    conf.backend[BACKEND_NAME].root = root
    _trace("bootstrap", root=root)
    return {"root": root}


def remove_run_dirs(pid: int | None = None) -> None:
    """Delete run directories made by bootstrap_probe in process ``pid`` (default: this one)."""
    prefix = f"tqprobe-{pid or os.getpid()}-"
    for name in os.listdir(SHM_BASE):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(SHM_BASE, name), ignore_errors=True)


def worker_setup() -> None:
    """Ray worker_process_setup_hook: importing this module registered the backend."""
    _trace("worker_setup")

