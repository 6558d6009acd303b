"""The trainer's side of the fan-out (docs/fanout.md): its state dict published with a digest window.

:class:`FanoutSource` publishes the usual versioned state-dict window plus a small *digest
window* named ``<name>@digests`` holding, for each of the last ``history`` versions, one digest
(sha256 by default) of every *chunk* of ``chunk_bytes`` bytes of the state-dict window. Every
commit writes the data version ``v`` and then its digests as version ``v`` of the digest window,
so the two stay in step. This module owns that window's format: the writer (the source) and
the reader (:func:`read_digests`, :func:`read_sizes`, used by the relays).
"""
from __future__ import annotations

import concurrent.futures as _futures
import contextlib
import dataclasses
import hashlib
import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from memsem import _args
from memsem._errors import MemsemError, VersionGoneError
from memsem.core import RuntimeCore
from memsem.gva import RefSpec
from memsem.sync._state_dict import (
    DEFAULT_ALIGN,
    DEFAULT_BUCKET_BYTES,
    StateDictRef,
    StateDictSection,
    publish_state_dict,
)
from memsem.refs._tensorref import TensorRef, as_core, usable_core

#: default bytes per chunk (the unit of digests, ready words and pipelining)
DEFAULT_CHUNK_BYTES = 2 << 20
#: versions whose digests the digest window keeps
DEFAULT_HISTORY = 8
#: digest algorithms (hashlib names): sha256 is the fastest cryptographic one here (SHA
#: extensions; docs/fanout.md has the figures), blake2b where those are absent
DIGESTS = ("sha256", "blake2b", "sha1")
DIGEST_MAGIC = b"MSFDIG01"
#: the digest window's header: magic, chunk_bytes, n_chunks, window bytes, digest size, history, algo
DIGEST_HEAD = struct.Struct("<8sQQQII16s")


def digests_name(name: str) -> str:
    """The digest window's name for the state dict ``name``."""
    return f"{name}@digests"


#: the longest suffix a fan-out adds to the state dict's name (``@digests``, ``@relay.<rank>``)
NAME_SUFFIX_BYTES = len("@relay.") + 10


def fanout_name(value: Any, name: str = "name") -> str:
    """The name of a fan-out's state dict (the name door, ``_args.window_name``), short enough
    that its digest window and every relay's manifest (``<name>@relay.<rank>``) are names too.

    Raises:
        TypeError: not a str. ValueError: as ``window_name``, or longer than
            ``NAME_MAX_BYTES - NAME_SUFFIX_BYTES`` bytes.
    """
    value = _args.window_name(value, name)
    most = _args.NAME_MAX_BYTES - NAME_SUFFIX_BYTES
    if len(value.encode("utf-8")) > most:
        raise ValueError(f"{name} must be at most {most} bytes of UTF-8 (a fan-out adds '@digests' and "
                         f"'@relay.<rank>' to it), got {len(value.encode('utf-8'))} bytes ({value[:24]!r}...)")
    return value


def digest_of(algo: str, data: Any, size: int) -> bytes:
    """The first ``size`` bytes of ``algo``'s digest of ``data``."""
    return hashlib.new(algo, data).digest()[:size]


def n_chunks(nbytes: int, chunk: int) -> int:
    """Chunks of ``chunk`` bytes in ``nbytes`` (at least one)."""
    return max(1, -(-nbytes // chunk))


# ------------------------------------------------------------------------------------------------
class FanoutSource:
    """The trainer's side: a state dict published for fan-out (data window plus digests).

    Args:
        runtime: the trainer's ``memsem.Runtime``.
        state_dict: name -> tensor (see ``Runtime.publish_state_dict``); its values are version 1.
        name: the state dict's window name (relays find it and ``<name>@digests`` by name).
        chunk_bytes: bytes per chunk: the unit of digests, of relays' ready words and of the
            pipelining (smaller: the last rollout finishes sooner after the first; larger:
            fewer requests). slots / align / bucket_bytes / write_guard: as
            ``publish_state_dict``.
        digest: a hashlib algorithm of :data:`DIGESTS`. history: versions whose digests are
            kept (a relay that starts a version more than ``history`` commits late drops it).

    Commit versions with :meth:`update` or :meth:`write_section` (not with ``ref.update``:
    the digests would not follow). Blocking like ``StateDictRef.update``, plus the digests
    (computed in parallel threads; docs/fanout.md gives their cost).

    Raises:
        ValueError / TypeError: as ``publish_state_dict``; a bad chunk_bytes, digest or history.
    """

    def __init__(self, runtime: Any, state_dict: Mapping[str, Any], *, name: str,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, digest: str = "sha256", history: int = DEFAULT_HISTORY,
                 slots: int = 2, align: int = DEFAULT_ALIGN, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 write_guard: str | None = None) -> None:
        core = usable_core(as_core(runtime))
        name = fanout_name(name)
        self.chunk_bytes = _args.count(chunk_bytes, "chunk_bytes", minimum=4096, maximum=_args.MAX_BYTES, unit="bytes")
        if not isinstance(digest, str):
            raise TypeError(f"digest must be one of {DIGESTS} (a str), got {digest!r} ({type(digest).__name__})")
        if digest not in DIGESTS:
            raise ValueError(f"digest must be one of {DIGESTS}, got {digest!r}")
        self.history = _args.count(history, "history", minimum=2, maximum=1024)
        self.digest = digest
        self.digest_size = min(32, hashlib.new(digest).digest_size)
        self._core = core
        self.ref: StateDictRef = publish_state_dict(core, state_dict, name=name, slots=slots, align=align,
                                                    bucket_bytes=bucket_bytes, write_guard=write_guard)
        self.name = name
        self.nbytes = self.ref.spec.nbytes
        self.n_chunks = n_chunks(self.nbytes, self.chunk_bytes)
        self._rec = 8 + -(-self.n_chunks * self.digest_size // 8) * 8
        self._pool = _futures.ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)),
                                                 thread_name_prefix="memsem-digest")
        self.digest_s = 0.0  #: seconds the last version's digests took
        try:
            first = np.empty(self.nbytes, np.uint8)
            core.transfer(self.ref.spec, "get", 0, first)  # the window's bytes, padding included
            buf = np.zeros(DIGEST_HEAD.size + self.history * self._rec, np.uint8)
            buf[:DIGEST_HEAD.size] = np.frombuffer(DIGEST_HEAD.pack(DIGEST_MAGIC, self.chunk_bytes, self.n_chunks, self.nbytes,
                                                          self.digest_size, self.history, digest.encode()), np.uint8)
            v = self.ref.version()
            self._write_record(buf, v, self._digest_all(first))
            del first
            self.digests = TensorRef(core.publish_spec(buf, name=digests_name(name), access="r", slots=2), core)
        except BaseException:
            self._pool.shutdown()
            core.unpublish_spec(self.ref.spec)
            raise

    def _digest_all(self, flat: np.ndarray) -> list[bytes]:
        t0 = time.perf_counter()
        c, ds, algo = self.chunk_bytes, self.digest_size, self.digest
        out = list(self._pool.map(lambda k: digest_of(algo, flat[k * c:(k + 1) * c], ds), range(self.n_chunks)))
        self.digest_s = time.perf_counter() - t0
        return out

    def _write_record(self, arr: np.ndarray, version: int, digests: list[bytes]) -> None:
        off = DIGEST_HEAD.size + (version % self.history) * self._rec
        arr[off:off + 8] = np.frombuffer(struct.pack("<Q", version), np.uint8)
        body = b"".join(digests)
        arr[off + 8:off + 8 + len(body)] = np.frombuffer(body, np.uint8)

    def _publish_digests(self, version: int, digests: list[bytes]) -> None:
        with self._core.write_section(self.digests.spec, copy=True) as sec:
            self._write_record(sec.array().reshape(-1).view(np.uint8), version, digests)
        if sec.version != version:
            raise MemsemError(f"{self.name}@digests is at version {sec.version}, its state dict at {version}: "
                              "a version was committed without FanoutSource (ref.update): relays cannot check it")

    def version(self) -> int:
        """The latest committed version (with its digests)."""
        return self.digests.version()

    def update(self, state_dict: Mapping[str, Any], *, timeout: float | None = None) -> int:
        """Publish ``state_dict``'s values as the next version, then its digests; returns the
        version. Raises as ``StateDictRef.update``."""
        timeout = _args.timeout_or(timeout, self._core.timeout)
        srcs = self.ref.sources(state_dict)
        with self.ref.write_section(copy=False, timeout=timeout) as sec:
            self.ref.fill(sec, srcs)
            digests = self._digest_all(sec.flat)
        self._publish_digests(sec.version, digests)
        return sec.version

    @contextlib.contextmanager
    def write_section(self, *, copy: bool = True, timeout: float | None = None) -> Iterator[StateDictSection]:
        """A write section on the state dict (``StateDictRef.write_section``): change
        ``section.tensors`` in place; leaving the block digests the slot, commits the version,
        then its digests. A body that raises commits nothing.

        Raises:
            TypeError / ValueError: ``copy`` not a bool, a bad ``timeout`` (named). As
            ``StateDictRef.write_section``.
        """
        if not isinstance(copy, bool):
            raise TypeError(f"copy must be True or False, got {copy!r}")
        timeout = _args.timeout_or(timeout, self._core.timeout)
        sec = self.ref.write_section(copy=copy, timeout=timeout)
        try:
            yield sec
            digests = self._digest_all(sec.flat)
        except BaseException:
            sec.abort()
            raise
        v = sec.version
        sec.commit()
        self._publish_digests(v, digests)

    def close(self, timeout: float | None = None) -> None:
        """Unpublish both windows (relays then see the trainer gone), waiting up to ``timeout``
        s for each (default the runtime's). Safe twice."""
        timeout = _args.timeout_or(timeout, self._core.timeout)
        if self._pool is None:
            return
        self._pool.shutdown()
        self._pool = None
        for spec in (self.digests.spec, self.ref.spec):
            with contextlib.suppress(MemsemError):
                self._core.unpublish_spec(spec, timeout=timeout)

    def __enter__(self) -> "FanoutSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



# -- the reader (relays) -------------------------------------------------------------------------
@dataclasses.dataclass
class Digests:
    """The digests of one version: ``values[k]`` is chunk ``k``'s (``size`` bytes of ``algo``)."""

    version: int
    chunk_bytes: int
    n_chunks: int
    nbytes: int
    algo: str
    size: int
    values: list[bytes]


def _head(core: RuntimeCore, spec: RefSpec) -> tuple:
    head = np.empty(DIGEST_HEAD.size, np.uint8)
    core.transfer(spec, "get", 0, head)
    return DIGEST_HEAD.unpack(head.tobytes())


def read_sizes(core: RuntimeCore, spec: RefSpec) -> tuple[int, int]:
    """``(chunk_bytes, state-dict window bytes)`` of the digest window ``spec``."""
    _, chunk, _, nbytes, _, _, _ = _head(core, spec)
    return chunk, nbytes


def read_digests(core: RuntimeCore, spec: RefSpec, version: int, timeout: float,
                 stop: Callable[[], None] | None = None) -> Digests:
    """Wait (up to ``timeout`` s; ``stop`` as ``Wait``'s) for the digest window ``spec`` to
    commit ``version``, then read that version's digests.

    Raises:
        VersionGoneError: the record was overwritten (``history`` commits later). MemsemError:
        ``spec`` is no digest window. As ``wait_version`` and ``get``.
    """
    core.wait_version(spec, version, timeout, stop=stop)
    magic, chunk, n, nbytes, ds, hist, algo = _head(core, spec)
    algo_s = algo.rstrip(b"\0").decode("ascii", "replace")
    if magic != DIGEST_MAGIC or algo_s not in DIGESTS or not 0 < ds <= 64 or not 0 < n <= 1 << 24:
        raise MemsemError(f"{spec.label} is not a fan-out digest window")
    rec = 8 + -(-n * ds // 8) * 8
    body = np.empty(rec, np.uint8)
    core.transfer(spec, "get", DIGEST_HEAD.size + (version % hist) * rec, body)
    tag = struct.unpack("<Q", body[:8].tobytes())[0]
    if tag != version:
        raise VersionGoneError(f"{spec.label}: the digests of version {version} were overwritten by version {tag}",
                               window=spec.name, wanted=version, found=tag)
    raw = body[8:8 + n * ds].tobytes()
    return Digests(version, chunk, n, nbytes, algo_s, ds, [raw[k * ds:(k + 1) * ds] for k in range(n)])


__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_HISTORY", "DIGESTS", "DIGEST_HEAD", "DIGEST_MAGIC", "Digests",
           "FanoutSource", "NAME_SUFFIX_BYTES", "digest_of", "digests_name", "fanout_name", "n_chunks", "read_digests", "read_sizes"]
