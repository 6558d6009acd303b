"""TensorRef: the user-facing handle on a published tensor (or a byte range / tile of one)."""
from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

from memsem import _args, _dtypes, native
from memsem._buffers import as_byte_array, check_buffer
from memsem._errors import MemsemError
from memsem.gva import RefSpec
from memsem.core import Completion, Lease, PlanRoute, RuntimeCore, WireRoute, current_runtime, default_runtime

_ATTN = native.lib.MEMSEM_RC_ATTENTION
_UINT8 = _dtypes.code_of("uint8")


class Versioned(NamedTuple):
    """What a read of "the latest" returned and which version it was: ``(version, value)``.

    ``version`` is the version whose bytes ``value`` holds, from the copy's own bracket (the
    slot's sequence word around the copy, here or at the owner): it always agrees with the
    bytes, on every route. Returned by ``get(..., with_version=True)``.
    """

    version: int
    value: Any


def _default_core() -> RuntimeCore:
    """The current runtime, else the default one (a ``memsem.Runtime``)."""
    rt = current_runtime()
    if rt is not None:
        return rt
    return default_runtime()


def as_core(runtime: Any, argname: str = "runtime") -> RuntimeCore | None:
    """``runtime`` checked: a ``memsem.Runtime`` (or None)."""
    if runtime is None or isinstance(runtime, RuntimeCore):
        return runtime
    raise TypeError(f"{argname} must be a memsem.Runtime, got {type(runtime).__name__}")


def usable_core(rt: RuntimeCore | None) -> RuntimeCore:
    """The core a ref bound to ``rt`` works through: ``rt``; the current or default runtime when
    unbound or when ``rt`` was inherited through fork. Raises RuntimeClosedError when ``rt``
    was closed (never a silent fallback to another runtime)."""
    if rt is None or rt.forked:
        return _default_core()
    if rt.closed:
        rt.check_open()
    return rt


class TensorRef:
    """A small, serializable reference to (part of) a published window.

    Hand it to anyone (``to_bytes()``, or pickle); a consumer's runtime resolves it. It holds no
    pointer valid on its own: the GVA is resolved through the directory and the access key is
    checked before any byte moves.

    Attributes:
        spec: the addressing data (:class:`memsem.gva.RefSpec`).
        shape: element shape (C order). dtype: numpy dtype (ml_dtypes for bf16/fp8).
        nbytes: bytes covered by this ref. name: window name ("" when unnamed).
        generation: window generation this ref was minted for.
        access: "r" or "rw".
    """

    __slots__ = ("spec", "_rt", "_route")

    def __init__(self, spec: RefSpec, runtime: Any = None) -> None:
        if not isinstance(spec, RefSpec):
            raise TypeError(f"spec must be a RefSpec, got {type(spec).__name__}")
        self.spec = spec
        self._rt = as_core(runtime)
        #: the route this ref's next plain get or put takes (``Transfers.ref_route``: a
        #: ``PlanRoute`` on the same node, one native call that reads neither the cache nor the
        #: spec; a ``WireRoute`` over tcp, one bracket around one request); None: none yet
        self._route: PlanRoute | WireRoute | None = None

    # -- identity --------------------------------------------------------------------------------
    @property
    def runtime(self) -> Any:
        """The ``memsem.Runtime`` this ref works through (its own, or the current/default one
        when unbound). Raises RuntimeClosedError when its runtime was closed."""
        return usable_core(self._rt)

    def _core(self) -> RuntimeCore:
        rt = self._rt
        if rt is None or rt.closed:
            return usable_core(rt)
        return rt

    def bind(self, runtime: Any) -> "TensorRef":
        """The same ref, bound to ``runtime`` (a ``memsem.Runtime``)."""
        return type(self)(self.spec, as_core(runtime))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> np.dtype:
        return _dtypes.numpy_dtype(self.spec.dtype_code)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def gva(self) -> int:
        """GVA of this ref's first byte (window base + offset)."""
        return self.spec.gva + self.spec.offset

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def access(self) -> str:
        return self.spec.access

    @property
    def byte_offset(self) -> int:
        """DLPack byte_offset the producer exported with (re-exported by ``get(framework='dlpack')``)."""
        return self.spec.byte_offset

    # -- serialization ---------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Compact wire form (60 bytes + 8 per dimension + name + 32 of the owner's mint). Carries the access key: treat
        it like a capability."""
        return self.spec.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, runtime: Any = None) -> "TensorRef":
        """Rebuild a ref; bound to ``runtime`` or, lazily, the current/default runtime.

        Raises:
            ValueError: ``data`` is not a serialized ref.
        """
        return cls(RefSpec.from_bytes(data), as_core(runtime))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).from_bytes, (self.spec.to_bytes(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorRef) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return (f"TensorRef({self.spec.label}, gen={self.spec.generation}, shape={self.shape}, "
                f"dtype={_dtypes.name_of(self.spec.dtype_code)}, access={self.access!r}, "
                f"bytes [{self.spec.offset}, {self.spec.offset + self.nbytes}))")

    # -- sub-ranges ------------------------------------------------------------------------------
    def bytes(self, offset: int, nbytes: int) -> "TensorRef":
        """A uint8 ref to ``nbytes`` bytes starting ``offset`` bytes into this ref.

        Made by the window's owner (a ref bound to the runtime that published it), the new ref
        is minted for exactly this range: handed to a consumer on another node, it reads or
        writes this range and no other (the owner checks). Made anywhere else, it keeps the mint
        of this ref.

        Raises:
            ValueError: the range lies outside this ref.
        """
        offset = _args.count(offset, "offset", unit="bytes")
        nbytes = _args.count(nbytes, "nbytes", unit="bytes")
        if offset + nbytes > self.spec.nbytes:
            raise ValueError(f"byte range [{offset}, {offset + nbytes}) lies outside the ref's "
                             f"{self.spec.nbytes} bytes")
        s = self.spec
        return type(self)(narrowed(self._rt, s.sub(s.offset + offset, nbytes, _UINT8, (nbytes,))), self._rt)

    def tile(self, index: int, tile_bytes: int) -> "TensorRef":
        """Tile ``index`` of ``tile_bytes`` bytes (the last one may be shorter), as a uint8 ref."""
        n = self.num_tiles(tile_bytes)
        index = _args.index(index, "index", n, of=f"tiles of {tile_bytes} bytes")
        start = index * int(tile_bytes)
        return self.bytes(start, min(int(tile_bytes), self.spec.nbytes - start))

    def num_tiles(self, tile_bytes: int) -> int:
        """Tiles of ``tile_bytes`` bytes covering this ref (at least 1)."""
        tile_bytes = _args.count(tile_bytes, "tile_bytes", minimum=1, unit="bytes")
        return max(1, -(-self.spec.nbytes // tile_bytes))

    # -- data ------------------------------------------------------------------------------------
    def get(self, out: Any = None, *, framework: str | None = None, lease: Lease | None = None,
            version: int = 0, with_version: bool = False) -> Any:
        """Copy the ref's bytes here. Blocking; returns when every byte is in the result.

        Args:
            out: destination with exactly ``nbytes`` bytes (numpy array, CPU torch tensor,
                DLPack or buffer object) of the ref's dtype, or uint8 (raw bytes: a uint8 ``out``
                takes the bytes of any dtype, and a uint8 ref fills any ``out``), or None to
                allocate one of ``shape``/``dtype``. Another dtype is a TypeError, never a
                reinterpretation of the bytes. Its shape is not checked: a get fills bytes in C
                order, so an ``out`` of the ref's dtype and byte count in another shape (a flat
                buffer, a reshaped batch) receives the elements in the ref's C order, as
                ``np.copyto(out.reshape(-1), src.reshape(-1))`` would (decided, issue 40: flat
                and reshaped destinations are how pipelines and state-dict loads reuse memory).
            framework: "numpy" (default for numpy/buffer sources), "torch" (default when the
                producer published a torch tensor and torch is importable) or "dlpack" (a
                :class:`DLPackBuffer` re-exporting the producer's byte_offset). Ignored with out.
            lease: a held Lease on the window; checked before and after the copy.
            version: 0 (default) reads the latest committed version; else exactly that version
                (``StaleReferenceError`` naming both versions when it was overwritten; a pinned
                lease keeps it readable); a version not committed yet is waited for.
            with_version: return ``Versioned(version, value)``: the version whose bytes were
                read, so a read of the latest says which it was (``ref.version()`` read before
                or after may differ from it: another version may be committed meanwhile).

        Returns:
            ``out``, or a new array / tensor of ``shape`` and the ref's dtype; with
            ``with_version``, :class:`Versioned` ``(version, that value)``.

        Raises:
            WindowRetiredError: the generation moved before or during the copy (no valid
                bytes). VersionGoneError: ``version`` was overwritten (both named). Both are
                StaleReferenceError.
            LeaseExpiredError: ``lease`` expired before or during the copy.
            PeerLostError: the owner is dead. AccessDeniedError: wrong key.
            ValueError / TypeError: ``out`` has the wrong size or is read-only, or is not plain
                memory: a dtype that is not a number or bool (object, structured, str,
                datetime...), or a torch tensor that is a conj/neg view, sparse, nested,
                quantized, meta or not on the CPU (the message says which and how to fix it).
        """
        rt = self._rt
        if rt is None or rt.closed:
            rt = usable_core(rt)
        if with_version is not False and with_version is not True:
            raise TypeError(f"with_version must be True or False, got {with_version!r}")
        if out is not None:
            if with_version is False:
                if lease is None and version.__class__ is int and not version:  # a plain get
                    r = self._route
                    if r is not None and r.spec is self.spec and r.token is rt.token:
                        rc = r.get(out)  # same node: one native call
                        if not rc & _ATTN:
                            return out
                    else:
                        r, rc = None, 0
                    self._route = rt.transfers.after_route(self.spec, r, rc, False, out)
                    return out
                return rt.transfers.get(self.spec, out, lease, version)
            return Versioned(*rt.transfers.get_versioned(self.spec, out, lease, version))
        fw = framework or self._default_framework()
        _check_before_alloc(rt, self.spec)
        if fw == "numpy":
            v, got = rt.transfers.get_versioned(self.spec, None, lease, version)
        elif fw == "torch":
            import torch

            got = torch.empty(self.shape, dtype=_dtypes.torch_dtype(self.spec.dtype_code))
            v, _ = rt.transfers.get_versioned(self.spec, got, lease, version)
        elif fw == "dlpack":
            from memsem.refs._dlpack import DLPackBuffer

            got = DLPackBuffer(self.spec.dtype_code, self.shape, self.spec.byte_offset)
            v, _ = rt.transfers.get_versioned(self.spec, got.array, lease, version)
        else:
            raise ValueError(f"framework must be 'numpy', 'torch' or 'dlpack', got {framework!r}")
        return Versioned(v, got) if with_version else got

    def _default_framework(self) -> str:
        if self.spec.framework == "torch" and ("torch" in sys.modules or _torch_importable()):
            return "torch"
        return "numpy"

    def get_async(self, out: Any = None, *, framework: str | None = None, lease: Lease | None = None) -> Completion:
        """Start a get; returns a Completion whose ``wait(timeout)`` returns what ``get`` would.

        Completion is remote completion (bytes in ``out``). Errors surface from ``wait``.
        """
        if out is None:
            out = self._alloc(framework)
        else:
            check_buffer(out, "out", writable=True, dtype_code=self.spec.dtype_code)  # raises now, not in wait()
        return self._core().submit(f"get of {self.spec.label}", lambda: self.get(out, lease=lease))

    def _alloc(self, framework: str | None) -> Any:
        fw = framework or self._default_framework()
        _check_before_alloc(self._core(), self.spec)
        if fw == "torch":
            import torch

            return torch.empty(self.shape, dtype=_dtypes.torch_dtype(self.spec.dtype_code))
        if fw == "numpy":
            return np.empty(self.shape, self.dtype)
        raise ValueError(f"framework must be 'numpy' or 'torch' for get_async, got {framework!r}")

    def put(self, src: Any, *, lease: Lease | None = None) -> None:
        """Write ``src`` (exactly ``nbytes`` bytes, same dtype or uint8) into the window.

        Blocking; returns when the bytes are visible at the target (remote completion).

        Raises:
            AccessDeniedError: the ref is read-only, or the window was published read-only.
            StaleReferenceError / LeaseExpiredError / PeerLostError: as for ``get``; on a stale
                error the target is being retired and the bytes count for nothing.
            ValueError / TypeError: size or dtype mismatch, or ``src`` is not plain memory (as
                for ``get``'s ``out``).
        """
        rt = self._rt
        if rt is None or rt.closed:
            rt = usable_core(rt)
        if lease is not None:
            rt.transfers.put(self.spec, src, lease)
            return
        r = self._route  # the route the last plain get or put took (see get)
        if r is not None and r.writable and r.spec is self.spec and r.token is rt.token:
            rc = r.put(src)
            if not rc & _ATTN:
                return
        else:
            r, rc = None, 0
        self._route = rt.transfers.after_route(self.spec, r, rc, True, src)

    def put_async(self, src: Any, *, lease: Lease | None = None) -> Completion:
        """Start a put; ``src`` must not change until the Completion is final.

        Raises:
            TypeError / ValueError: ``src`` is not usable memory (see ``put``); raised now, before
                anything is started.
        """
        check_buffer(src, "src", writable=False)
        return self._core().submit(f"put to {self.spec.label}", lambda: self.put(src, lease=lease))

    def view(self, *, lease: Lease | None = None, framework: str | None = None) -> Any:
        """Zero-copy array over the window's memory itself (same process, or same node with a
        shared segment). O(1): nothing is copied.

        The view is held under a lease: ``lease`` if given (which then refuses ``release`` while
        the view lives), else a lease of its own, released when the array is garbage collected.
        The owner cannot unpublish while it exists (it waits, then raises LeaseHeldError).
        A read-only ref gives a read-only array.

        Raises:
            NotSupportedError: the route cannot map the memory (it names the route); use get().
        """
        arr = self._core().view_spec(self.spec, lease=lease)
        if (framework or "numpy") == "torch":
            import torch

            return torch.from_numpy(arr) if self.spec.dtype_code not in (13, 14, 15) else \
                torch.from_numpy(arr.view(np.uint8)).view(_dtypes.torch_dtype(self.spec.dtype_code)).reshape(self.shape)
        return arr

    def lease(self, ttl: float | None = 10.0) -> Lease:
        """A (not yet acquired) lease on this ref's window; use as ``with ref.lease(ttl) as l:``."""
        return Lease(self._core(), self.spec, ttl)

    # -- versions ---------------------------------------------------------------------------------
    def version(self) -> int:
        """The latest committed version of the window's bytes (versions count the owner's write
        sections; 1 right after publish). A snapshot: it may move right after.

        Raises:
            StaleReferenceError: the window was retired or republished (a new generation).
        """
        return self._core().latest_version(self.spec)

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        """Block until the window's latest committed version is at least ``version`` (a newer
        one than ``v``: ``wait_version(v + 1)``); returns it. A futex wait on the control
        block's latest-version word, woken by the owner's commit: no polling.

        Raises:
            MemsemTimeoutError: not reached within ``timeout`` s (default the runtime's).
            StaleReferenceError: the window was retired or republished. PeerLostError: the owner
            died while waited for (on another node: its link ended, or its heartbeat expired).
        """
        return self._core().wait_version(self.spec, version, timeout)

    async def wait_version_async(self, version: int, timeout: float | None = None) -> int:
        """``wait_version`` for asyncio (the runtime's native word waiter; the loop never blocks)."""
        return await self._core().wait_version_async(self.spec, version, timeout)

    def pin(self, version: int = 0, *, ttl: float | None = 10.0, timeout: float | None = None) -> Lease:
        """A held lease pinning ``version`` (0: the latest committed version) of the window: the
        owner's write sections do not overwrite it while the lease lasts; read it with
        ``get(lease=..., version=lease.version)``. Release it (``with`` or ``release()``).

        Raises:
            StaleReferenceError: that version is gone (names it and the one found).
            MemsemTimeoutError: a write section kept overwriting it past ``timeout``.
        """
        return self._core().pin_version(self.spec, version=version, ttl=ttl, timeout=timeout)

    # -- tile-ready events -----------------------------------------------------------------------
    def mark_ready(self, index: int) -> None:
        """Producer: publish tile ``index`` as ready (release store; data written before is
        visible to any consumer that sees the mark)."""
        self._core().mark_ready(self.spec, index)

    def put_tile(self, index: int, data: Any) -> None:
        """Producer: write tile ``index`` (its bytes, per the window's tile size), then mark it
        ready. Blocking. On route ``mte`` the bytes and the tile's SHMEM signal word travel in
        one ``aclshmemx_putmem_signal`` (the owner may wait on either)."""
        rt = self._core()
        res = rt.resolve(self.spec)
        tb = res.info.tile_bytes
        if not tb:
            raise ValueError(f"{self.spec.label} was published without tiles")
        if self.spec.offset != 0 or self.spec.nbytes != res.info.nbytes:
            raise ValueError(f"put_tile needs a ref to the whole window (tile indices are the "
                             f"window's); this ref covers bytes [{self.spec.offset}, "
                             f"{self.spec.offset + self.spec.nbytes}) of {res.info.nbytes}")
        index = _args.index(index, "index", res.info.n_ready, of=self.spec.label)
        tile = self.bytes(0, self.nbytes).tile(index, tb)
        flat, info = as_byte_array(data, "data", writable=False)
        if info.nbytes != tile.nbytes:
            raise ValueError(f"data holds {info.nbytes} bytes; tile {index} is {tile.nbytes} bytes")
        # On route mte the data and the tile's SHMEM signal word go in one putmem_signal.
        rt.transfer(tile.spec, "put", 0, flat, signal_tile=int(index))
        rt.mark_ready(self.spec, index)

    def wait_tile(self, index: int, timeout: float | None = None) -> None:
        """Consumer: block until tile ``index`` is ready for this ref's generation.

        Raises:
            MemsemTimeoutError (a TimeoutError): not ready within ``timeout`` s (finite, default the
                runtime's); names window and tile. TypeError / ValueError: bad index or timeout.
            PeerLostError: the owner died while waiting (within 0.05 s of its death).
            StaleReferenceError: the window's generation moved.
        """
        self._core().wait_tile(self.spec, index, timeout)

    async def wait_tile_async(self, index: int, timeout: float | None = None) -> None:
        """``wait_tile`` for asyncio: the tile's ready word is awaited through the runtime's
        native word waiter (the event loop never blocks, nothing polls; a window on another node
        is awaited on its mirror in a worker thread). Cancelling the awaiting task ends the wait
        (its waiter is removed; nothing else was started).

        Raises:
            As ``wait_tile``.
        """
        await self._core().wait_tile_async(self.spec, index, timeout)

    def ready_tiles(self) -> list[int]:
        """Indices of the tiles ready for this ref's generation (a snapshot)."""
        return self._core().ready_tiles(self.spec)

    def is_ready(self, index: int) -> bool:
        return self._core().is_ready(self.spec, index)

    @property
    def tile_bytes(self) -> int:
        """Tile size in bytes of the window's ready words (0 when published without tiles)."""
        return self._core().resolve(self.spec).info.tile_bytes

    def route(self) -> Any:
        """The :class:`memsem.topology.Route` this process uses to reach the window."""
        return self._core().route_of(self.spec)


def narrowed(rt: RuntimeCore | None, spec: RefSpec) -> RefSpec:
    """``spec`` minted for its own range when ``rt`` owns its window (the owner narrows the
    capability it hands out), else ``spec`` as is."""
    if rt is None or rt.closed or not rt.owns(spec):
        return spec
    return rt.mint(spec)


def _check_before_alloc(rt: RuntimeCore, spec: RefSpec) -> None:
    """Before allocating a destination from a ref's own shape: resolve it (access key,
    generation and owner checked) and check its range against the window, so a forged or
    corrupted ref never makes this process allocate more than the window it names holds."""
    info = rt.resolve(spec).info
    if spec.offset + spec.nbytes > info.nbytes:
        raise ValueError(f"ref range [{spec.offset}, {spec.offset + spec.nbytes}) lies outside "
                         f"{spec.label} of {info.nbytes} bytes")
    if spec.byte_offset not in (0, info.byte_offset):
        raise ValueError(f"ref byte_offset {spec.byte_offset} differs from {spec.label}'s "
                         f"{info.byte_offset}")


def _torch_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def check_ref(obj: Any, argname: str) -> TensorRef:
    if not isinstance(obj, TensorRef):
        raise TypeError(f"{argname} must be a TensorRef, got {type(obj).__name__}")
    return obj


__all__ = ["TensorRef", "Versioned", "check_ref", "narrowed", "MemsemError"]
