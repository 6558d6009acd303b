"""StateDictRef: a mapping of named tensors (a model's state dict) as one versioned window.

Weight sync moves hundreds to thousands of tensors every training step. One window per tensor
means one registration, one ref and one copy call per tensor, and no way to read all of them
from one version. ``rt.publish_state_dict(model.state_dict())`` publishes them as **one
window**: a *layout* header (names, dtypes, shapes, byte offsets, alignment, buckets) followed by
every tensor's bytes, each at an ``align``-byte boundary. With ``slots=2`` (the default) the
window is double-buffered: the trainer writes version v+1 (``update`` or ``write_section``)
while rollouts read version v, never blocked by it.

Consumers hold one small :class:`StateDictRef` (``to_bytes``: a RefSpec plus 4 bytes; or
``rt.lookup_state_dict(name)`` in any process of the job) and read the layout once (two small
gets, cached per window generation). Then:

* ``load(into)`` copies every tensor of one version into existing tensors (a
  ``model.state_dict()``-shaped mapping, torch or numpy) in **one** call: same node, all copies
  run inside one native seqlock bracket (one version check, no round trip per tensor), and a
  torn bracket is redone, so ``into`` holds exactly one version when it returns;
* ``stream(into)`` yields bucket by bucket (bucket i+1 moves while the caller uses bucket i),
  every bucket from one version pinned by a lease for the stream's duration;
* ``get()`` returns a new dict.

**Delta versions** (``memsem.sync._delta``, the layer above, installs them): by default the
owner keeps a bounded history of what each commit changed (``delta_history`` versions), and a
reader whose tensors hold version ``v`` as memsem left them loads a later one with
``load(into, base=v)``, moving only what changed, checked against the writer's digests (a
mismatch loads in full). The follower loop does that by default.

The layout is carried once and never changes within a generation (a different set of tensors
is a republish). The framework (numpy or torch) of the published tensors is recorded; 0-d and
empty tensors and every dtype memsem supports (bf16 and fp8 through ml_dtypes) are allowed.

One module, over 600 lines, because it is one user-facing type: the layout, the section and the
stream bucket exist only for StateDictRef and are read together with it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from memsem import _args, _dtypes, native
from memsem._buffers import buffer_info, empty_arena
from memsem._errors import MemsemError
from memsem.gva import RefSpec
from memsem.refs._tensorref import TensorRef, Versioned, as_core
from memsem.core import Completion, Lease, RuntimeCore

#: first 8 bytes of a state-dict window (then u32 header bytes, u32 JSON bytes, the JSON)
LAYOUT_MAGIC = b"MSSDLAY1"
REF_MAGIC = b"MSSD"
REF_VERSION = 1
_HEAD = struct.Struct("<8sII")
#: the largest layout a consumer reads (bytes of JSON)
MAX_LAYOUT_BYTES = 64 << 20
DEFAULT_ALIGN = 64
DEFAULT_BUCKET_BYTES = 64 << 20
_UINT8 = _dtypes.code_of("uint8")
_layouts: dict[tuple[int, int, bytes], "StateDictLayout"] = {}
#: versions of delta history an owner keeps by default (``publish_state_dict(delta_history=)``)
DEFAULT_DELTA_HISTORY = 4
#: seconds the last full load of each window took here (what a delta's wait may save)
_full_s: dict[tuple[int, int, bytes], float] = {}


@dataclasses.dataclass(frozen=True)
class DeltaInfo:
    """Where a state dict's delta history is (``StateDictLayout.delta``).

    Attributes:
        index: the serialized ref (``RefSpec`` bytes) of the history's index window.
        tile_bytes: bytes per tile (a tensor's bytes are tiled from its start: the unit of digests
            and of changes). history: versions the owner keeps.
    """

    index: bytes
    tile_bytes: int
    history: int


class DeltaVersions(Protocol):
    """What the sync layer gives state dicts: delta versions (``memsem.sync._delta``).

    ``begin`` runs before the state dict's window is published (its history's windows are
    published first, their ref goes into the layout); ``attach`` once the window exists (the
    history then watches its commits); ``abandon`` when the publish failed in between.
    """

    def begin(self, core: RuntimeCore, layout: "StateDictLayout", sources: list[int], history: int) -> tuple[DeltaInfo, Any]: ...

    def attach(self, token: Any, ref: "StateDictRef") -> None: ...

    def abandon(self, token: Any) -> None: ...

    def load(self, ref: "StateDictRef", entries: Any, ranges: list, keep: list, *, base: int, version: int,
             lease: Lease | None, wait: float | None, full_s: float | None) -> int: ...

    def changed_ranges(self, ref: "StateDictRef", a: int, b: int, timeout: float | None) -> list[tuple[int, int]] | None: ...


_delta: DeltaVersions | None = None


def install_delta_versions(impl: DeltaVersions) -> None:
    """Called once by ``memsem.sync`` (the layer above): what ``publish_state_dict``'s history,
    ``load(base=)`` and ``changed_ranges`` use."""
    global _delta
    _delta = impl


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a state dict window.

    Attributes:
        name: the state-dict key. dtype_code: wire dtype code (``dtype``: numpy dtype).
        shape: element shape (``()`` for a 0-d tensor). offset: bytes from the start of the
        data (after the header). nbytes: bytes (``prod(shape) x itemsize``; 0 for an empty one).
    """

    name: str
    dtype_code: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def dtype(self) -> np.dtype:
        return _dtypes.numpy_dtype(self.dtype_code)


@dataclasses.dataclass(frozen=True)
class StateDictLayout:
    """Where every tensor of a state dict window lies.

    Attributes:
        entries: the tensors, in publish order (offsets ascending). align: byte alignment of
        every tensor. header_bytes: bytes of the header before the data. data_bytes: bytes of
        the data. buckets: ``(first entry, stop entry)`` index ranges of consecutive tensors of
        at most ``bucket_bytes`` (a bigger tensor is a bucket alone). framework: "torch" or
        "numpy" (what ``get`` returns by default). delta: where the owner's delta history is
        (None: it keeps none).
    """

    entries: tuple[TensorEntry, ...]
    align: int
    header_bytes: int
    data_bytes: int
    buckets: tuple[tuple[int, int], ...]
    framework: str
    delta: DeltaInfo | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the window (one slot): header and data."""
        return self.header_bytes + self.data_bytes

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def index(self) -> dict[str, TensorEntry]:
        return {e.name: e for e in self.entries}

    def bucket_bytes(self, b: int) -> int:
        i, j = self.buckets[b]
        return sum(e.nbytes for e in self.entries[i:j])

    # -- build and (de)serialize ------------------------------------------------------------------
    @classmethod
    def build(cls, tensors: list[tuple[str, int, tuple[int, ...], int]], *, align: int, bucket_bytes: int,
              framework: str, delta: DeltaInfo | None = None) -> "StateDictLayout":
        """From ``(name, dtype_code, shape, nbytes)`` in order."""
        entries = []
        off = 0
        for name, code, shape, nbytes in tensors:
            off = -(-off // align) * align
            entries.append(TensorEntry(name, code, shape, off, nbytes))
            off += nbytes
        buckets = []
        start, size = 0, 0
        for i, e in enumerate(entries):
            if i > start and size + e.nbytes > bucket_bytes:
                buckets.append((start, i))
                start, size = i, 0
            size += e.nbytes
        if entries:
            buckets.append((start, len(entries)))
        body = cls._json(entries, align, buckets, framework, off, delta)
        header = -(-(_HEAD.size + len(body)) // align) * align
        return cls(tuple(entries), align, header, off, tuple(buckets), framework, delta)

    @staticmethod
    def _json(entries: Any, align: int, buckets: Any, framework: str, data_bytes: int,
              delta: DeltaInfo | None = None) -> bytes:
        d: dict[str, Any] = {"v": 1, "align": align, "framework": framework, "data_bytes": data_bytes,
                             "tensors": [[e.name, _dtypes.name_of(e.dtype_code), list(e.shape), e.offset, e.nbytes]
                                         for e in entries],
                             "buckets": [list(b) for b in buckets]}
        if delta is not None:
            d["delta"] = {"index": delta.index.hex(), "tile_bytes": delta.tile_bytes, "history": delta.history}
        return json.dumps(d, separators=(",", ":")).encode()

    def header(self) -> bytes:
        """The header bytes (``header_bytes`` long, zero-padded)."""
        body = self._json(self.entries, self.align, self.buckets, self.framework, self.data_bytes, self.delta)
        raw = _HEAD.pack(LAYOUT_MAGIC, self.header_bytes, len(body)) + body
        return raw + b"\0" * (self.header_bytes - len(raw))

    @classmethod
    def parse(cls, head: bytes, body: bytes, window_bytes: int) -> "StateDictLayout":
        """Validate a header read from a window of ``window_bytes`` bytes.

        Raises:
            ValueError: anything malformed (names the field): the layout never points outside
                the window, never overlaps two tensors, never disagrees with a shape.
        """
        magic, header_bytes, json_bytes = _HEAD.unpack(head)
        if magic != LAYOUT_MAGIC:
            raise ValueError(f"not a state-dict window (magic {magic!r})")
        try:
            d = json.loads(body)
        except ValueError:
            raise ValueError("state-dict layout is not valid JSON") from None
        if not isinstance(d, dict) or d.get("v") != 1:
            raise ValueError("state-dict layout: unknown layout version")
        align, framework, data_bytes = d.get("align"), d.get("framework"), d.get("data_bytes")
        if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align > 1 << 20:
            raise ValueError(f"state-dict layout: align must be an int in [1, 2**20], got {align!r}")
        if framework not in ("numpy", "torch"):
            raise ValueError(f"state-dict layout: framework must be 'numpy' or 'torch', got {framework!r}")
        if not isinstance(data_bytes, int) or data_bytes < 0 or header_bytes + data_bytes > window_bytes:
            raise ValueError(f"state-dict layout: {data_bytes!r} data bytes do not fit the window of "
                             f"{window_bytes} bytes")
        tensors, buckets = d.get("tensors"), d.get("buckets")
        if not isinstance(tensors, list) or not isinstance(buckets, list):
            raise ValueError("state-dict layout: tensors and buckets must be lists")
        entries = []
        seen = set()
        end = 0
        for i, t in enumerate(tensors):
            if not (isinstance(t, list) and len(t) == 5):
                raise ValueError(f"state-dict layout: tensors[{i}] must be [name, dtype, shape, offset, nbytes]")
            name, dt, shape, off, nbytes = t
            if not isinstance(name, str) or not name or name in seen:
                raise ValueError(f"state-dict layout: tensors[{i}] name {name!r} is empty, not a str or repeated")
            seen.add(name)
            try:
                code = _dtypes.code_of(dt)
            except (TypeError, ValueError):
                raise ValueError(f"state-dict layout: tensor {name!r} has unknown dtype {dt!r}") from None
            if not isinstance(shape, list) or len(shape) > 64 or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
                raise ValueError(f"state-dict layout: tensor {name!r} shape {shape!r} is not a list of ints >= 0")
            for v, what in ((off, "offset"), (nbytes, "nbytes")):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"state-dict layout: tensor {name!r} {what} {v!r} is not an int >= 0")
            if math.prod(shape) * _dtypes.numpy_dtype(code).itemsize != nbytes:
                raise ValueError(f"state-dict layout: tensor {name!r} nbytes {nbytes} disagrees with shape "
                                 f"{shape} of {dt}")
            if off < end or off + nbytes > data_bytes:
                raise ValueError(f"state-dict layout: tensor {name!r} bytes [{off}, {off + nbytes}) overlap "
                                 f"the one before or lie outside the {data_bytes} data bytes")
            end = off + nbytes
            entries.append(TensorEntry(name, code, tuple(shape), off, nbytes))
        prev = 0
        out_b = []
        for i, b in enumerate(buckets):
            if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) for x in b)
                    and b[0] == prev and b[0] < b[1] <= len(entries)):
                raise ValueError(f"state-dict layout: buckets[{i}] {b!r} does not continue the buckets before")
            prev = b[1]
            out_b.append((b[0], b[1]))
        if prev != len(entries):
            raise ValueError("state-dict layout: buckets do not cover every tensor")
        return cls(tuple(entries), align, header_bytes, data_bytes, tuple(out_b), framework, _parse_delta(d.get("delta")))


def _parse_delta(d: Any) -> DeltaInfo | None:
    """The layout's ``delta`` entry, checked (None: absent)."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError("state-dict layout: delta must be an object")
    index, tile, hist = d.get("index"), d.get("tile_bytes"), d.get("history")
    if not isinstance(index, str) or not 0 < len(index) <= 2048:
        raise ValueError("state-dict layout: delta.index must be a hex string of at most 2048 characters")
    try:
        raw = bytes.fromhex(index)
    except ValueError:
        raise ValueError("state-dict layout: delta.index is not hex") from None
    for v, what, lo, hi in ((tile, "tile_bytes", 1, 1 << 30), (hist, "history", 1, 1 << 16)):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ValueError(f"state-dict layout: delta.{what} must be an int in [{lo}, {hi}], got {v!r}")
    return DeltaInfo(raw, tile, hist)


def _torch_view(arr: np.ndarray, code: int) -> Any:
    import torch

    t = torch.from_numpy(arr.reshape(-1).view(np.uint8))
    return t.view(_dtypes.torch_dtype(code)).reshape(arr.shape)


def _tensors_over(layout: StateDictLayout, flat: np.ndarray) -> dict[str, Any]:
    """Every tensor of ``layout`` as an array (torch tensor for torch layouts) over ``flat``,
    the bytes of one slot of the window."""
    h = layout.header_bytes
    out: dict[str, Any] = {}
    torch_out = layout.framework == "torch" and "torch" in sys.modules
    for e in layout.entries:
        a = flat[h + e.offset:h + e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
        out[e.name] = _torch_view(a, e.dtype_code) if torch_out else a
    return out


class StateDictSection:
    """An open write section on a state-dict window (``StateDictRef.write_section``).

    ``tensors`` maps every name to an array (numpy) or tensor (torch, for windows published
    from torch) over the slot being written: change them in place; leaving the ``with`` block
    publishes the next version (see :class:`memsem.core.WriteSection`).
    """

    def __init__(self, ref: "StateDictRef", section: Any) -> None:
        self.ref = ref
        self.section = section
        self.flat = section.array()
        self.tensors = _tensors_over(ref.layout, self.flat)

    @property
    def version(self) -> int:
        return self.section.version

    @property
    def blocked_s(self) -> float:
        return self.section.blocked_s

    def commit(self) -> int:
        return self.section.commit()

    def abort(self) -> None:
        self.section.abort()

    def __enter__(self) -> "StateDictSection":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.section.__exit__(exc_type, *exc)


class StreamBucket(tuple):
    """One bucket of ``StateDictRef.stream``: the pair ``(index, {name: tensor})`` (it unpacks
    as before), and ``version``: the version the stream's bytes belong to (one for the whole
    stream, pinned while it runs)."""

    def __new__(cls, index: int, tensors: dict[str, Any], version: int) -> "StreamBucket":
        obj = super().__new__(cls, (index, tensors))
        obj.version = version
        return obj

    @property
    def index(self) -> int:
        return self[0]

    @property
    def tensors(self) -> dict[str, Any]:
        return self[1]

    def __repr__(self) -> str:
        return f"StreamBucket(index={self[0]}, {len(self[1])} tensors, version={self.version})"


class StateDictRef(TensorRef):
    """A ref to a state-dict window: many named tensors, one window, one layout.

    Build one with ``rt.publish_state_dict(...)`` (the owner), ``rt.lookup_state_dict(name)``
    or ``StateDictRef.from_bytes`` / unpickling (anyone). As a TensorRef it covers the whole
    window (uint8); the tensor-level calls are below. ``keys()``/``layout`` fetch the layout
    once (two small gets; cached for the window's generation).
    """

    __slots__ = ()

    # -- serialization ---------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Wire form: ``"MSSD" | version u8 | RefSpec bytes``. Carries the access key: treat it
        like a capability."""
        return REF_MAGIC + bytes([REF_VERSION]) + self.spec.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, runtime: Any = None) -> "StateDictRef":
        """Rebuild a StateDictRef. Raises ValueError when ``data`` is not one."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if data[:4] != REF_MAGIC or len(data) < 5:
            raise ValueError(f"data is not a serialized StateDictRef (got {len(data)} bytes starting {data[:4]!r})")
        if data[4] != REF_VERSION:
            raise ValueError(f"serialized StateDictRef version {data[4]}; this memsem reads {REF_VERSION}")
        spec = RefSpec.from_bytes(data[5:])
        if spec.dtype_code != _UINT8 or spec.offset != 0:
            raise ValueError("serialized StateDictRef: its ref must cover a whole uint8 window")
        return cls(spec, as_core(runtime))

    def __reduce__(self) -> tuple[Any, ...]:
        return (StateDictRef.from_bytes, (self.to_bytes(),))

    def __repr__(self) -> str:
        lay = _layouts.get(_cache_key(self.spec))
        what = f"{len(lay.entries)} tensors, " if lay is not None else ""
        return f"StateDictRef({self.spec.label}, gen={self.spec.generation}, {what}{self.spec.nbytes} bytes)"

    # -- layout ----------------------------------------------------------------------------------
    @property
    def layout(self) -> StateDictLayout:
        """The window's layout, read once per generation (two small gets of the header)."""
        k = _cache_key(self.spec)
        lay = _layouts.get(k)
        if lay is None:
            lay = self._read_layout()
            if len(_layouts) > 1024:
                _layouts.clear()
            _layouts[k] = lay
        return lay

    def _read_layout(self) -> StateDictLayout:
        rt = self._core()
        n = self.spec.nbytes
        if n < _HEAD.size:
            raise ValueError(f"{self.spec.label} ({n} bytes) is too small to be a state-dict window")
        head = np.empty(_HEAD.size, np.uint8)
        rt.transfer(self.spec, "get", 0, head)
        magic, header_bytes, json_bytes = _HEAD.unpack(head.tobytes())
        if magic != LAYOUT_MAGIC:
            raise ValueError(f"{self.spec.label} is not a state-dict window (magic {magic!r})")
        if json_bytes > MAX_LAYOUT_BYTES or _HEAD.size + json_bytes > header_bytes or header_bytes > n:
            raise ValueError(f"{self.spec.label}: state-dict header of {header_bytes} bytes ({json_bytes} bytes of "
                             f"layout) does not fit the window of {n} bytes")
        body = np.empty(json_bytes, np.uint8)
        rt.transfer(self.spec, "get", _HEAD.size, body)
        return StateDictLayout.parse(head.tobytes(), body.tobytes(), n)

    def keys(self) -> tuple[str, ...]:
        return self.layout.names

    def __len__(self) -> int:
        return len(self.layout.entries)

    # -- consumers -------------------------------------------------------------------------------
    def ranges(self, into: Mapping[str, Any], entries: Any, argname: str) -> tuple[list[tuple[int, int, int]], list]:
        """``(offset, nbytes, address)`` of every tensor of ``entries`` (the layout's) in ``into``,
        and the objects that keep those addresses valid: what a gather of one version copies
        (``load``, ``stream``, a relay). Raises KeyError / ValueError / TypeError naming
        ``argname`` for a tensor missing, of another dtype or shape, or not plain memory."""
        h = self.layout.header_bytes
        ranges, keep = [], []
        for e in entries:
            if e.name not in into:
                raise KeyError(f"{argname} has no tensor {e.name!r} (the state dict has {len(self.layout.entries)})")
            dst = into[e.name]
            info = buffer_info(dst, f"{argname}[{e.name!r}]")
            if info.readonly:
                raise ValueError(f"{argname}[{e.name!r}] is read-only")
            if info.dtype_code != e.dtype_code or tuple(info.shape) != e.shape:
                raise ValueError(f"{argname}[{e.name!r}] is {tuple(info.shape)} {_dtypes.name_of(info.dtype_code)}; "
                                 f"the state dict holds {e.shape} {_dtypes.name_of(e.dtype_code)}")
            ranges.append((h + e.offset, e.nbytes, info.address))
            keep.append(info.keepalive)
        return ranges, keep

    def _entries_for(self, into: Any, strict: bool) -> Any:
        """The layout's entries ``load`` copies into ``into``: all of them, with ``into``'s names
        exactly the state dict's (``strict``), else those ``into`` has. Raises TypeError for a
        non-mapping or a non-bool ``strict``; KeyError naming every missing and extra name."""
        if not isinstance(into, Mapping):
            raise TypeError(f"into must be a mapping of name to tensor, got {type(into).__name__}")
        if strict is not True and strict is not False:
            raise TypeError(f"strict must be True or False, got {strict!r}")
        lay = self.layout
        if not strict:
            return [e for e in lay.entries if e.name in into]
        names = set(lay.names)
        missing = [n for n in lay.names if n not in into]
        extra = [k for k in into if k not in names]
        if missing or extra:
            def some(keys: list) -> str:
                return ", ".join(repr(k) for k in keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")

            parts = ([f"missing {some(missing)}"] if missing else []) + (
                [f"not in the state dict {some(extra)} (they would keep their old values)"] if extra else [])
            raise KeyError(f"into does not match the state dict's {len(lay.entries)} tensors: {'; '.join(parts)}. "
                           "Pass strict=False to load only the names both have")
        return lay.entries

    def load(self, into: Mapping[str, Any], *, version: int = 0, lease: Lease | None = None,
             strict: bool = True, base: int = 0, delta_wait: float | None = None) -> int:
        """Copy every tensor of one version into the existing tensors of ``into``; returns the
        version loaded. Blocking; bit-exact.

        Args:
            into: name -> destination (numpy array or CPU torch tensor of exactly the tensor's
                dtype and shape, C-contiguous, writable), e.g. ``model.state_dict()``.
            version: 0 (default) the latest committed version, else exactly that one (a pinned
                lease keeps it readable: ``pin``).
            strict: True (default): ``into``'s names are exactly the state dict's; a name
                missing from ``into``, or one ``into`` has and the state dict lacks (a tensor
                that would silently keep its old values: a renamed parameter), raises KeyError
                naming them. False: loads the names both have and leaves the rest of ``into``.
            base: the version ``into`` holds as memsem last left it (what an earlier ``load``
                into these tensors returned); 0 (default): unknown. Given, and the owner keeps a
                delta history covering ``base`` to the version loaded, only what changed moves
                (the patches and changed tiles of the versions after ``base``); the result is
                checked against the writer's digests of that version, every tile of ``into``,
                and anything else (``into`` changed since, the history does not cover it, the
                delta is not cheaper) is a full load: never a mix of versions.
            delta_wait: with ``base``, seconds to wait for the owner's delta record of the
                version (made in the background after its commit) before loading in full.
                None (default): a delta only where it pays: waiting at most the time the last
                full load here took less the last delta load's (at most 2 s), not at all while
                the owner's records take longer than that, and in full while the last delta
                load here was slower than the last full load (a delta is tried again every
                16 loads; ``memsem.sync._delta``).

        Same node, one native bracket spans every copy (one version check, no per-tensor round
        trip); a torn bracket is redone whole. On an error ``into``'s contents are unspecified.
        ``rt.stats().deltas`` counts delta and full loads and the bytes they moved.

        Raises:
            KeyError: with ``strict``, names missing from ``into`` or not in the state dict
                (all named), before any byte moves. ValueError / TypeError: a mis-shaped,
                mis-typed or read-only destination (named), before any byte moves.
                StaleReferenceError: the window was republished, or ``version`` is gone.
                MemsemTimeoutError, PeerLostError: as for get.
        """
        entries = self._entries_for(into, strict)
        ranges, keep = self.ranges(into, entries, "into")
        if base.__class__ is not int or base:
            base = _args.version(base, "base")
        if delta_wait is not None:
            delta_wait = _args.timeout(delta_wait, "delta_wait")
        if base and _delta is not None and self.layout.delta is not None:
            return _delta.load(self, entries, ranges, keep, base=base, version=version, lease=lease, wait=delta_wait,
                               full_s=_full_s.get(_cache_key(self.spec)))
        return self.load_full(ranges, keep, version=version, lease=lease)

    def load_full(self, ranges: list[tuple[int, int, int]], keep: Any, *, version: int = 0,
                  lease: Lease | None = None) -> int:
        """``load`` of ``ranges`` (``self.ranges``) in full, counted in ``stats().deltas``."""
        core = self._core()
        t0 = time.perf_counter()
        v = core.gather(self.spec, ranges, version=version, lease=lease, keep=keep)
        if len(_full_s) > 1024:
            _full_s.clear()
        _full_s[_cache_key(self.spec)] = time.perf_counter() - t0
        n = sum(r[1] for r in ranges)
        core.telemetry.count_delta(loads_full=1, bytes_moved=n, bytes_loaded=n)
        return v

    def changed_ranges(self, a: int, b: int, *, timeout: float | None = None) -> list[tuple[int, int]] | None:
        """The byte ranges of this window that changed from version ``a`` to version ``b``
        (``a < b``), from the owner's delta history: ``(offset, nbytes)`` into the window (the
        ``offset`` of ``ranges``), ascending and coalesced, whole tiles (``layout.delta``'s
        ``tile_bytes``, tiled from each tensor's start); every byte outside them is the same
        in both versions. None when the history does not cover ``a`` to ``b`` (the owner keeps
        none, or not that far back, or a version was recorded without a delta): then treat
        everything as changed. Waits up to ``timeout`` s (default the runtime's) for the owner
        to record ``b``. What a reader of part of each tensor (a reshard plan) intersects with
        its own ranges to move only what changed.

        Raises:
            TypeError / ValueError: ``a`` / ``b`` not versions, or ``a >= b``.
        """
        a, b = _args.version(a, "a"), _args.version(b, "b")
        if not 0 < a < b:
            raise ValueError(f"changed_ranges needs versions 0 < a < b, got a={a}, b={b}")
        if timeout is not None:
            timeout = _args.timeout(timeout, "timeout")
        if _delta is None or self.layout.delta is None:
            return None
        return _delta.changed_ranges(self, a, b, timeout)

    def load_async(self, into: Mapping[str, Any], *, version: int = 0, lease: Lease | None = None,
                   strict: bool = True) -> Completion:
        """Start a ``load``; returns a :class:`memsem.Completion` (``await`` it, or
        ``wait(timeout)``) whose result is the version loaded. ``into`` is checked now (the
        errors ``load`` raises before any byte moves are raised here, not by the wait).

        Completion is remote completion: every tensor of ``into`` holds that version's bytes.
        The load runs in the runtime's worker pool; the event loop never blocks. Cancelling
        the await cancels a load that has not started (it ends CANCELLED, ``into`` untouched);
        a running load runs to its end (``into`` is written until ``done()``: read it only
        then). The Completion keeps ``into``'s tensors referenced until it is done.

        Raises:
            At the call: as ``load`` for ``into``. From the wait: as ``load``.
        """
        entries = self._entries_for(into, strict)
        ranges, keep = self.ranges(into, entries, "into")
        if version.__class__ is not int or version:
            version = _args.version(version, "version")
        rt = self._core()
        return rt.submit(f"load of {self.spec.label}",
                         lambda: rt.gather(self.spec, ranges, version=version, lease=lease, keep=(keep, into)))

    def empty_like(self, framework: str | None = None) -> dict[str, Any]:
        """New uninitialized tensors of the state dict's names, dtypes and shapes."""
        lay = self.layout
        fw = framework or (lay.framework if lay.framework != "torch" or _torch_ok() else "numpy")
        if fw not in ("numpy", "torch"):
            raise ValueError(f"framework must be 'numpy' or 'torch', got {framework!r}")
        # One huge-page mapping for all of them: a first load into fresh tensors faults 2 MiB
        # pages, not 4 KiB ones (issue 15: first sync).
        arrs = empty_arena([(np.uint8 if fw == "torch" else e.dtype, (e.nbytes,) if fw == "torch" else e.shape)
                            for e in lay.entries])
        if fw == "torch":
            import torch

            return {e.name: torch.from_numpy(a).view(_dtypes.torch_dtype(e.dtype_code)).reshape(e.shape)
                    for e, a in zip(lay.entries, arrs)}
        return {e.name: a for e, a in zip(lay.entries, arrs)}

    def get(self, out: Any = None, *, framework: str | None = None, lease: Lease | None = None,
            version: int = 0, with_version: bool = False) -> Any:  # type: ignore[override]
        """A new dict of every tensor of one version (``framework``: "numpy" or "torch"; default
        what was published); with ``out`` (a mapping), the same as ``load(out)`` and returns it.
        ``with_version``: return ``Versioned(version, dict)`` (the version whose bytes it holds)."""
        if with_version is not False and with_version is not True:
            raise TypeError(f"with_version must be True or False, got {with_version!r}")
        dst = out if out is not None else self.empty_like(framework)
        v = self.load(dst, version=version, lease=lease)
        return Versioned(v, dst) if with_version else dst

    def stream(self, into: Mapping[str, Any] | None = None, *, depth: int = 2, ttl: float | None = 60.0,
               timeout: float | None = None) -> Iterator["StreamBucket"]:
        """Yield ``(bucket index, {name: tensor})`` bucket by bucket, every bucket of one
        version (pinned by a lease while the stream runs), while up to ``depth - 1`` next
        buckets move in the background: the caller uses bucket i while bucket i+1 moves.
        Each item is a :class:`StreamBucket`: it unpacks as that pair, and ``.version`` is
        the version its bytes (every bucket's) belong to.

        ``into`` (default: new tensors) receives the bytes (the yielded dicts are its tensors).
        The stream pins the latest committed version when it starts; the owner may write the
        next version meanwhile (double-buffered windows), not the one after.

        Raises:
            As ``load``; the lease's expiry during the stream is a LeaseExpiredError.
        """
        depth = _args.count(depth, "depth", minimum=1, maximum=64)
        dst = dict(into) if into is not None else self.empty_like()
        lay = self.layout
        per_bucket = []
        for i, j in lay.buckets:
            per_bucket.append(self.ranges(dst, lay.entries[i:j], "into"))
        return self._stream(dst, per_bucket, depth, ttl, timeout)

    def _stream(self, dst: dict[str, Any], per_bucket: list, depth: int, ttl: float | None,
                timeout: float | None) -> Iterator[tuple[int, dict[str, Any]]]:
        rt = self._core()
        lay = self.layout
        lease = rt.pin_version(self.spec, ttl=ttl, timeout=timeout)
        v = lease.version
        try:
            futs: dict[int, Any] = {}

            def start(b: int) -> None:
                ranges, keep = per_bucket[b]
                futs[b] = rt.submit(f"bucket {b} of {self.spec.label}",
                                    lambda r=ranges, k=keep: rt.gather(self.spec, r, version=v, lease=lease, keep=k))

            for b in range(min(depth, len(per_bucket))):
                start(b)
            for b in range(len(per_bucket)):
                futs.pop(b).wait()
                if b + depth < len(per_bucket):
                    start(b + depth)
                i, j = lay.buckets[b]
                yield StreamBucket(b, {e.name: dst[e.name] for e in lay.entries[i:j]}, v)
        finally:
            for f in futs.values():
                try:
                    f.wait()
                except MemsemError:
                    pass
            lease.release()

    # -- owner -----------------------------------------------------------------------------------
    def tensors(self) -> dict[str, Any]:
        """Owner of a single-slot window (``publish_state_dict(..., slots=1)``): every tensor
        as an array (torch tensor for a torch state dict) over the window's own memory, no
        copy: the in-place form. Make the model's parameters these tensors (torch:
        ``param.data = tensors[name]``) and change them only inside ``write_section()`` (its
        ``tensors`` are the same memory), so each step's update is published with no copy at
        all; readers wait the section out (one slot).

        Raises:
            ValueError: a double-buffered window (slots=2: its versions alternate between two
                slots). WindowNotFoundError: this runtime does not publish the window.
        """
        return _tensors_over(self.layout, self._core().window_memory(self.spec))

    def write_section(self, *, copy: bool = True, timeout: float | None = None) -> StateDictSection:
        """Owner: open a write section (see ``Runtime.write_section``); ``section.tensors`` are
        the tensors of the version being written (filled with the latest version when ``copy``)."""
        rt = self._core()
        sec = rt.write_section(self.spec, copy=copy, timeout=timeout)
        try:
            out = StateDictSection(self, sec)
            if not copy:
                out.flat[:self.layout.header_bytes] = np.frombuffer(self.layout.header(), np.uint8)
        except BaseException:
            sec.abort()
            raise
        return out

    def update(self, state_dict: Mapping[str, Any], *, timeout: float | None = None) -> int:
        """Owner: publish ``state_dict``'s current values as the next version (one write section,
        every tensor copied into the slot being written); returns the version. Blocking only
        while pinned leases of the version it overwrites last.

        Raises:
            KeyError / ValueError / TypeError: a tensor missing or of another dtype or shape
                (before anything is opened). As ``Runtime.write_section``.
        """
        srcs = self.sources(state_dict)
        with self.write_section(copy=False, timeout=timeout) as sec:
            self.fill(sec, srcs)
        return sec.version

    def sources(self, state_dict: Mapping[str, Any]) -> list:
        """Checked ``(entry, buffer info)`` of every tensor of ``state_dict`` (``update``'s door)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of name to tensor, got {type(state_dict).__name__}")
        lay = self.layout
        srcs = []
        for e in lay.entries:
            if e.name not in state_dict:
                raise KeyError(f"state_dict has no tensor {e.name!r}")
            info = buffer_info(state_dict[e.name], f"state_dict[{e.name!r}]")
            if info.dtype_code != e.dtype_code or tuple(info.shape) != e.shape:
                raise ValueError(f"state_dict[{e.name!r}] is {tuple(info.shape)} {_dtypes.name_of(info.dtype_code)}; "
                                 f"the window holds {e.shape} {_dtypes.name_of(e.dtype_code)}")
            srcs.append((e, info))
        return srcs

    def fill(self, sec: StateDictSection, srcs: list) -> None:
        """Copy ``sources``' tensors into the slot an open section writes (the owner's ``update``)."""
        base = sec.flat.ctypes.data + self.layout.header_bytes
        for e, info in srcs:
            if e.nbytes:
                native.memcpy(base + e.offset, info.address, e.nbytes)


def _cache_key(spec: RefSpec) -> tuple[int, int, bytes]:
    return (spec.gva, spec.generation, spec.key)


def _torch_ok() -> bool:
    if "torch" in sys.modules:
        return True
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def publish_state_dict(core: RuntimeCore, state_dict: Mapping[str, Any], *, name: str | None = None,
                       slots: int = 2, align: int = DEFAULT_ALIGN, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       write_guard: str | None = None, replace: bool = False,
                       delta_history: int = DEFAULT_DELTA_HISTORY) -> StateDictRef:
    """See ``memsem.Runtime.publish_state_dict``."""
    if name is not None:
        name = _args.window_name(name, "name")  # before anything is allocated or copied
    delta_history = _args.count(delta_history, "delta_history", minimum=0, maximum=64)
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise ValueError("state_dict must be a non-empty mapping of name to tensor")
    align = _args.count(align, "align", minimum=1, maximum=1 << 20, unit="bytes")
    if align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    bucket_bytes = _args.count(bucket_bytes, "bucket_bytes", minimum=1, unit="bytes")
    infos = []
    frameworks = set()
    for key, t in state_dict.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"state_dict keys must be non-empty str, got {key!r}")
        info = buffer_info(t, f"state_dict[{key!r}]")
        infos.append((key, info))
        frameworks.add(info.framework)
    fw = "torch" if "torch" in frameworks else "numpy"
    tensors = [(k, i.dtype_code, tuple(i.shape), i.nbytes) for k, i in infos]
    lay = StateDictLayout.build(tensors, align=align, bucket_bytes=bucket_bytes, framework=fw)
    token = None
    if delta_history and _delta is not None:
        # the history's windows first: the layout carries their ref (version 1's digests)
        info_d, token = _delta.begin(core, lay, [i.address for _, i in infos], delta_history)
        lay = StateDictLayout.build(tensors, align=align, bucket_bytes=bucket_bytes, framework=fw, delta=info_d)
    try:
        total = lay.nbytes
        buf = core.alloc(total, np.uint8) if slots == 1 else np.empty(total, np.uint8)
        buf[:lay.header_bytes] = np.frombuffer(lay.header(), np.uint8)
        base = buf.ctypes.data + lay.header_bytes
        for (k, info), e in zip(infos, lay.entries):
            if e.nbytes:
                native.memcpy(base + e.offset, info.address, e.nbytes)
        spec = core.publish_spec(buf, name=name, access="r", slots=slots, write_guard=write_guard, replace=replace)
    except BaseException:
        if token is not None:
            _delta.abandon(token)
        raise
    ref = StateDictRef(spec, core)
    _layouts[_cache_key(spec)] = lay
    if token is not None:
        _delta.attach(token, ref)
    return ref


def lookup_state_dict(core: RuntimeCore, name: str, *, timeout: float = 0.0,
                      stop: Callable[[], None] | None = None) -> StateDictRef:
    """See ``memsem.Runtime.lookup_state_dict``; ``stop`` as ``RuntimeCore.lookup_spec``'s."""
    spec = core.lookup_spec(name, timeout, stop=stop)
    if spec.dtype_code != _UINT8:
        raise ValueError(f"window {name!r} is not a state-dict window (dtype {_dtypes.name_of(spec.dtype_code)})")
    ref = StateDictRef(spec, core)
    _ = ref.layout  # validates now: a wrong window is an error here, not at the first load
    return ref


__all__ = ["DEFAULT_DELTA_HISTORY", "DeltaInfo", "DeltaVersions", "StateDictLayout", "StateDictRef",
           "StateDictSection", "StreamBucket", "TensorEntry", "install_delta_versions", "lookup_state_dict",
           "publish_state_dict"]
