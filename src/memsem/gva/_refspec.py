"""RefSpec: the serializable content of a ref (what crosses process boundaries).

Wire format (little endian), 60 bytes plus 8 per dimension plus the name, plus 32 bytes of
mint when the owner minted the ref (flag ``FLAG_MINT``)::

    magic "MSR1" | flags u8 | dtype u8 | ndim u8 | name_len u8 |
    gva u64 | generation u64 | key 16 B | offset u64 | nbytes u64 | byte_offset u32 |
    shape ndim x u64 | name utf-8 |
    [mint: offset u64 | nbytes u64 | mac 16 B]     (FLAG_MINT; FLAG_MINT_RW: minted "rw")

It carries no pointer: the GVA is resolved through the directory, and the 128-bit access key is
a capability checked against the directory's digest before a byte moves.

**The mint.** The owner's runtime mints every ref it hands out (``publish``, ``lookup``, a
sub-range the owner itself makes): the byte range and access it gives, and a MAC over them
(HMAC-SHA256 under a secret that never leaves the owner's process, truncated to 128 bits;
:func:`mint_mac`). Owner-checked routes (tcp) verify the MAC and serve only requests inside the
minted range with no more than the minted access, so a ref edited to widen its range or to add
write access is refused. Sub-ranges made by consumers (``TensorRef.bytes``/``tile``, FieldRef
rows) keep the mint they were cut from: a RefSpec's own range always lies inside its mint, and
its access is never wider (checked at construction).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import struct

from memsem import _args, _dtypes

MAGIC = b"MSR1"
_HEAD = struct.Struct("<4sBBBBQQ16sQQI")
FLAG_RW = 1
FLAG_TORCH = 2
FLAG_DLPACK = 4
FLAG_MINT = 8
FLAG_MINT_RW = 16
_FLAGS = FLAG_RW | FLAG_TORCH | FLAG_DLPACK | FLAG_MINT | FLAG_MINT_RW
_MINT = struct.Struct("<QQ16s")
KEY_BYTES = 16
#: bytes of a mint's MAC (HMAC-SHA256 truncated)
MAC_BYTES = 16
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
#: the most dimensions a ref's shape may have
MAX_NDIM = _args.MAX_NDIM
#: the longest window name (UTF-8 bytes; the wire format's u8 length)
MAX_NAME_BYTES = 255
_FRAMEWORKS = ("numpy", "torch", "dlpack")
_ITEMSIZE = {code: _dtypes.numpy_dtype(code).itemsize for code in _dtypes.codes()}


def _uint(value: object, field: str, limit: int) -> int:
    if type(value) is int:  # fast path
        if 0 <= value <= limit:
            return value
    elif isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"RefSpec.{field} must be an int, got {value!r} ({type(value).__name__})")
    v = value.__index__()  # type: ignore[union-attr]
    if not 0 <= v <= limit:
        raise ValueError(f"RefSpec.{field} must be an int in [0, {limit}], got {value!r}")
    return v


@dataclasses.dataclass(frozen=True)
class Mint:
    """What the owner gave: a byte range of the window, an access, and the owner's MAC over
    them (see the module docstring). ``repr`` never shows the MAC."""

    offset: int
    nbytes: int
    access: str
    mac: bytes = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        off = _uint(self.offset, "mint.offset", _args.MAX_BYTES)
        n = _uint(self.nbytes, "mint.nbytes", _args.MAX_BYTES)
        if off + n > _args.MAX_BYTES:
            raise ValueError(f"RefSpec.mint.offset + nbytes = {off} + {n} overflows 63 bits")
        if self.access not in ("r", "rw"):
            raise ValueError(f"RefSpec.mint.access must be 'r' or 'rw', got {self.access!r}")
        if type(self.mac) is not bytes or len(self.mac) != MAC_BYTES:
            raise ValueError(f"RefSpec.mint.mac must be {MAC_BYTES} bytes")
        object.__setattr__(self, "offset", off)
        object.__setattr__(self, "nbytes", n)


def mint_mac(secret: bytes, gva: int, generation: int, offset: int, nbytes: int, access: str) -> bytes:
    """The owner's MAC over a minted range: HMAC-SHA256 under ``secret`` (the owner's, never sent
    anywhere) of the window (gva, generation), the byte range and the access, truncated to
    ``MAC_BYTES``."""
    msg = struct.pack("<8sQQQQB", b"memsemM1", gva, generation, offset, nbytes, 1 if access == "rw" else 0)
    return hmac.digest(secret, msg, "sha256")[:MAC_BYTES]


def mint_valid(secret: bytes, gva: int, generation: int, mint: "Mint") -> bool:
    """Whether ``mint`` was made by the holder of ``secret`` for this window generation."""
    good = mint_mac(secret, gva, generation, mint.offset, mint.nbytes, mint.access)
    return hmac.compare_digest(good, mint.mac)


#: the public part of a ref that a consumer shows an owner-checked route (``credential_token``)
_TOKEN = struct.Struct("<4sQQQQB16s")
TOKEN_MAGIC = b"MSC1"
TOKEN_BYTES = _TOKEN.size


def credential_token(spec: "RefSpec") -> bytes:
    """What a consumer shows an owner that checks requests itself (tcp): the window (gva,
    generation) and the ref's mint (range, access, MAC). Never the access key: that is proven
    with :func:`credential_proof` against the owner's challenge. A ref without a mint gives a
    token the owner refuses."""
    m = spec.mint
    if m is None:
        return _TOKEN.pack(TOKEN_MAGIC, spec.gva, spec.generation, 0, 0, 0xFF, bytes(MAC_BYTES))
    return _TOKEN.pack(TOKEN_MAGIC, spec.gva, spec.generation, m.offset, m.nbytes,
                       1 if m.access == "rw" else 0, m.mac)


def parse_token(token: bytes) -> tuple[int, int, "Mint | None"]:
    """``(gva, generation, mint)`` of a credential token (mint None: the ref had none).

    Raises:
        ValueError: not a token (length, magic, access byte, range).
    """
    if not isinstance(token, (bytes, bytearray, memoryview)) or len(token) != TOKEN_BYTES:
        raise ValueError(f"credential token must be {TOKEN_BYTES} bytes")
    magic, gva, gen, off, n, rw, mac = _TOKEN.unpack(bytes(token))
    if magic != TOKEN_MAGIC:
        raise ValueError("credential token has a wrong magic")
    if rw == 0xFF:
        return gva, gen, None
    if rw not in (0, 1):
        raise ValueError(f"credential token access byte {rw} is not 0 or 1")
    return gva, gen, Mint(off, n, "rw" if rw else "r", mac)


def credential_proof(key: bytes, challenge: bytes, token: bytes) -> bytes:
    """Proof of holding the window's access key for one challenge of the owner: HMAC-SHA256
    under the key of the challenge and the token, truncated to ``MAC_BYTES``. The challenge is
    fresh per connection (the owner's nonce), so a proof sniffed on one connection is worth
    nothing on another."""
    return hmac.digest(key, b"memsemP1" + bytes(challenge) + bytes(token), "sha256")[:MAC_BYTES]


@dataclasses.dataclass(frozen=True)
class RefSpec:
    """Addressing data of a ref: a byte range of a window plus how to interpret it.

    Attributes:
        gva: base GVA of the window (u64). generation: generation the ref was minted for (u64).
        key: 16-byte access key. access: "r" or "rw".
        offset: byte offset of this ref's range inside the window.
        nbytes: bytes in the range; ``offset + nbytes`` fits in 63 bits.
        dtype_code/shape: element view of the range (C order); ``prod(shape) x itemsize == nbytes``,
            at most ``MAX_NDIM`` dimensions.
        byte_offset: DLPack byte_offset of the published source (re-exported as is; u32).
        framework: "numpy", "torch" or "dlpack" (what ``get`` returns by default).
        name: the window's name, for messages ("" when unnamed; at most 255 UTF-8 bytes).
        mint: what the owner minted this ref from (:class:`Mint`), or None (a ref built by
            hand, or by a memsem without mints: owner-checked routes refuse it).

    Construction validates every field (``RefSpec(offset=-1, ...)`` is a ValueError naming
    ``offset``), so a RefSpec that exists is self-consistent: nothing derived from it (an
    allocation of ``shape``) can exceed ``nbytes``. The repr never shows the access key.
    """

    gva: int
    generation: int
    key: bytes = dataclasses.field(repr=False)
    access: str
    offset: int
    nbytes: int
    dtype_code: int
    shape: tuple[int, ...]
    byte_offset: int = 0
    framework: str = "numpy"
    name: str = ""
    mint: Mint | None = None

    def __post_init__(self) -> None:
        # Fast path (every RefSpec memsem itself builds): exact ints in range, a tuple shape that
        # matches nbytes, a known dtype code. Anything else goes through the full, naming check.
        shape = self.shape
        itemsize = _ITEMSIZE.get(self.dtype_code) if type(self.dtype_code) is int else None
        if (itemsize is not None and type(self.gva) is int and type(self.generation) is int
                and type(self.offset) is int and type(self.nbytes) is int and type(self.byte_offset) is int
                and type(shape) is tuple and type(self.key) is bytes and len(self.key) == KEY_BYTES
                and 0 <= self.gva <= _U64 and 0 <= self.generation <= _U64 and 0 <= self.offset
                and 0 <= self.nbytes and self.offset + self.nbytes <= _args.MAX_BYTES
                and 0 <= self.byte_offset <= _U32 and len(shape) <= MAX_NDIM
                and self.access in ("r", "rw") and self.framework in _FRAMEWORKS
                and type(self.name) is str and len(self.name) <= MAX_NAME_BYTES // 4
                and all(type(d) is int and d >= 0 for d in shape)
                and math.prod(shape) * itemsize == self.nbytes):
            if self.mint is not None:
                self._check_mint()
            return
        self._check()
        if self.mint is not None:
            self._check_mint()

    def _check_mint(self) -> None:
        m = self.mint
        if type(m) is not Mint:
            raise TypeError(f"RefSpec.mint must be a Mint or None, got {type(m).__name__}")
        if self.offset < m.offset or self.offset + self.nbytes > m.offset + m.nbytes:
            raise ValueError(f"RefSpec range [{self.offset}, {self.offset + self.nbytes}) lies outside its "
                             f"minted range [{m.offset}, {m.offset + m.nbytes})")
        if self.access == "rw" and m.access != "rw":
            raise ValueError("RefSpec.access 'rw' is wider than its minted access 'r'")

    def _check(self) -> None:
        put = object.__setattr__
        put(self, "gva", _uint(self.gva, "gva", _U64))
        put(self, "generation", _uint(self.generation, "generation", _U64))
        key = self.key
        if type(key) is not bytes:
            if not isinstance(key, (bytes, bytearray, memoryview)):
                raise TypeError(f"RefSpec.key must be {KEY_BYTES} bytes, got {type(key).__name__}")
            key = bytes(key)
            put(self, "key", key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"RefSpec.key must be {KEY_BYTES} bytes, got {len(key)} bytes")
        if self.access not in ("r", "rw"):
            raise ValueError(f"RefSpec.access must be 'r' or 'rw', got {self.access!r}")
        off = _uint(self.offset, "offset", _args.MAX_BYTES)
        n = _uint(self.nbytes, "nbytes", _args.MAX_BYTES)
        if off + n > _args.MAX_BYTES:
            raise ValueError(f"RefSpec.offset + nbytes = {off} + {n} overflows 63 bits")
        put(self, "offset", off)
        put(self, "nbytes", n)
        if type(self.dtype_code) is not int or isinstance(self.dtype_code, bool):
            raise TypeError(f"RefSpec.dtype_code must be an int, got {self.dtype_code!r}")
        try:
            itemsize = _dtypes.numpy_dtype(self.dtype_code).itemsize
        except ValueError:
            raise ValueError(f"RefSpec.dtype_code {self.dtype_code!r} is not a known dtype code "
                             f"(known: {sorted(_dtypes.codes())})") from None
        shape = self.shape
        if type(shape) is not tuple:
            if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
                raise TypeError(f"RefSpec.shape must be a tuple of ints, got {shape!r}")
            shape = tuple(shape)
        if len(shape) > MAX_NDIM:
            raise ValueError(f"RefSpec.shape has {len(shape)} dimensions; at most {MAX_NDIM}")
        elems = 1
        dims = []
        for i, d in enumerate(shape):
            d = _uint(d, f"shape[{i}]", _args.MAX_BYTES)
            dims.append(d)
            elems *= d
        if elems * itemsize != n:
            raise ValueError(f"RefSpec.shape {tuple(dims)} x {itemsize} bytes per "
                             f"{_dtypes.name_of(self.dtype_code)} is {elems * itemsize} bytes, but "
                             f"nbytes is {n}")
        put(self, "shape", tuple(dims))
        put(self, "byte_offset", _uint(self.byte_offset, "byte_offset", _U32))
        if self.framework not in _FRAMEWORKS:
            raise ValueError(f"RefSpec.framework must be one of {_FRAMEWORKS}, got {self.framework!r}")
        if type(self.name) is not str:
            raise TypeError(f"RefSpec.name must be a str, got {type(self.name).__name__}")
        if len(self.name) > MAX_NAME_BYTES // 4 and len(self.name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise ValueError(f"RefSpec.name must be at most {MAX_NAME_BYTES} UTF-8 bytes, got "
                             f"{len(self.name.encode('utf-8', 'surrogatepass'))}")

    @property
    def writable(self) -> bool:
        return self.access == "rw"

    def sub(self, offset: int, nbytes: int, dtype_code: int, shape: tuple[int, ...], *,
            byte_offset: int = 0, framework: str = "numpy") -> "RefSpec":
        """A ref to ``nbytes`` bytes at window offset ``offset`` (absolute, not relative to this
        ref), viewed as ``shape`` of ``dtype_code``, keeping this ref's key, access and mint.

        Raises:
            ValueError: the range lies outside this ref's mint (or the fields disagree).
        """
        return RefSpec(self.gva, self.generation, self.key, self.access, offset, nbytes, dtype_code, shape,
                       byte_offset, framework, self.name, self.mint)

    @property
    def label(self) -> str:
        return f"window {self.name!r} (gva {self.gva:#x})" if self.name else f"window gva {self.gva:#x}"

    @property
    def key_hint(self) -> str:
        """A short digest of the access key, safe to print (identifies the key, reveals nothing)."""
        return hashlib.sha256(b"memsem-key-hint\0" + self.key).hexdigest()[:8]

    def __repr__(self) -> str:
        return (f"RefSpec(gva={self.gva:#x}, generation={self.generation}, key=<hidden, "
                f"digest {self.key_hint}>, access={self.access!r}, offset={self.offset}, "
                f"nbytes={self.nbytes}, dtype={_dtypes.name_of(self.dtype_code)}, shape={self.shape}, "
                f"byte_offset={self.byte_offset}, framework={self.framework!r}, name={self.name!r}"
                + ("" if self.mint is None else f", mint=[{self.mint.offset}, "
                   f"{self.mint.offset + self.mint.nbytes}) {self.mint.access!r}") + ")")

    def to_bytes(self) -> bytes:
        name = self.name.encode()
        if len(name) > MAX_NAME_BYTES:
            raise ValueError(f"RefSpec.name must be at most {MAX_NAME_BYTES} UTF-8 bytes")
        m = self.mint
        flags = (FLAG_RW if self.writable else 0) | (FLAG_TORCH if self.framework == "torch" else 0) \
            | (FLAG_DLPACK if self.framework == "dlpack" else 0) \
            | (0 if m is None else FLAG_MINT | (FLAG_MINT_RW if m.access == "rw" else 0))
        head = _HEAD.pack(MAGIC, flags, self.dtype_code, len(self.shape), len(name), self.gva,
                          self.generation, self.key, self.offset, self.nbytes, self.byte_offset)
        out = head + struct.pack(f"<{len(self.shape)}Q", *self.shape) + name
        return out if m is None else out + _MINT.pack(m.offset, m.nbytes, m.mac)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "RefSpec":
        """Parse ``to_bytes`` output. Everything is validated here, before any caller allocates
        or resolves anything from it.

        Raises:
            ValueError: ``data`` is not a well-formed ref; the message names the field (length,
                flags, dtype code, ndim, shape vs nbytes, offset/nbytes range, name encoding).
            TypeError: ``data`` is not bytes-like.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEAD.size or data[:4] != MAGIC:
            raise ValueError(f"data is not a serialized memsem ref (got {len(data)} bytes starting {data[:4]!r})")
        magic, flags, dtype, ndim, nlen, gva, gen, key, off, nbytes, boff = _HEAD.unpack_from(data)
        if flags & ~_FLAGS:
            raise ValueError(f"serialized ref: unknown flag bits {flags & ~_FLAGS:#x} in flags {flags:#x}")
        if flags & FLAG_TORCH and flags & FLAG_DLPACK:
            raise ValueError(f"serialized ref: flags {flags:#x} name two frameworks (torch and dlpack)")
        if flags & FLAG_MINT_RW and not flags & FLAG_MINT:
            raise ValueError(f"serialized ref: flags {flags:#x} give a minted access but no mint")
        if ndim > MAX_NDIM:
            raise ValueError(f"serialized ref: ndim {ndim} exceeds {MAX_NDIM}")
        end = _HEAD.size + 8 * ndim + nlen
        total = end + (_MINT.size if flags & FLAG_MINT else 0)
        if len(data) != total:
            raise ValueError(f"serialized ref has {len(data)} bytes, its header (ndim {ndim}, name "
                             f"length {nlen}{', mint' if flags & FLAG_MINT else ''}) says {total}")
        shape = struct.unpack_from(f"<{ndim}Q", data, _HEAD.size)
        try:
            name = data[_HEAD.size + 8 * ndim:end].decode()
        except UnicodeDecodeError:
            raise ValueError("serialized ref: its name is not UTF-8") from None
        fw = "torch" if flags & FLAG_TORCH else "dlpack" if flags & FLAG_DLPACK else "numpy"
        try:
            mint = None
            if flags & FLAG_MINT:
                moff, mn, mac = _MINT.unpack_from(data, end)
                mint = Mint(moff, mn, "rw" if flags & FLAG_MINT_RW else "r", mac)
            return cls(gva, gen, key, "rw" if flags & FLAG_RW else "r", off, nbytes, dtype, tuple(shape),
                       boff, fw, name, mint)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"serialized ref: {exc}") from None
