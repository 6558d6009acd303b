"""The owner side of engines whose owner checks every request (``enforces_generation == "owner"``:
tcp): validated credentials ("grants") and the seqlock bracket around the owner's own copy.

A grant is cached per credential. It holds a claim on the owner's own resolution of the window
(so the control block stays mapped and the copy is counted in this process's in-flight slot)
and a flat view of the window's memory (which keeps the published object alive). Retiring the
window evicts its grants.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from memsem import native
from memsem._buffers import address_view
from memsem._errors import AccessDeniedError, MemsemError, WindowNotFoundError
from memsem.gva import RefSpec, WindowState, key_matches
from memsem.gva._control import W_STATE
from memsem.runtime import _translate as tr
from memsem.runtime._resolve import Resolution

if TYPE_CHECKING:
    from memsem.runtime._core import RuntimeCore

#: grants cached per runtime; past this the cache is emptied (grants are cheap to remake)
GRANT_LIMIT = 4096

_ffi = native.ffi
_lib = native.lib


class Grant:
    """A validated credential of a remote consumer for one window generation of this runtime.

    Attributes:
        gva, generation: the window. nbytes: its size. writable: the ref and the window allow
        puts. lo, hi: the byte range of the window the credential's ref covers (requests must
        lie inside it). mem: flat uint8 array over the window's memory (keeps it alive).
    """

    __slots__ = ("gva", "generation", "nbytes", "writable", "lo", "hi", "mem", "_res", "_closed")

    def __init__(self, res: Resolution, spec: RefSpec, mem: Any, writable: bool) -> None:
        self._res = res
        self.gva, self.generation = spec.gva, spec.generation
        self.nbytes = res.nbytes
        self.lo, self.hi = spec.offset, spec.offset + spec.nbytes
        self.mem = mem
        self.writable = writable
        self._closed = False

    def current(self) -> int:
        """The window's generation now (0 when its control block is gone)."""
        cb = self._res.cb
        return 0 if cb is None or cb.closed else cb.generation

    def enter(self, put: bool, offset: int, nbytes: int) -> Any:
        """Open the seqlock bracket for one copy (counted in flight); returns a token for
        ``leave``, or None when the generation moved / the window is busy (nothing counted)."""
        st = _ffi.new("uint64_t[5]")
        rc = _lib.memsem_bracket_open(self._res.plan, 1 if put else 0, offset, nbytes, 0, 0, 0, st)
        if rc & tr.RC_LAST_OUT:
            self._res.release()
        if rc & tr.RC_STATUS:
            return None
        return (st, put, nbytes)

    def leave(self, token: Any, failed: bool = False) -> bool:
        """Close the bracket; True when the bytes moved are valid (generation and version did
        not move meanwhile)."""
        st, put, nbytes = token
        rc = _lib.memsem_bracket_close(self._res.plan, 1 if put else 0, nbytes, 0, 0, st, 1 if failed else 0)
        if rc & tr.RC_LAST_OUT:
            self._res.release()
        return not (rc & tr.RC_STATUS)

    def close(self) -> None:
        """Drop the grant's claim on the resolution (safe twice)."""
        if not self._closed:
            self._closed = True
            self._res.leave()


class Server:
    """Grants of one runtime (the owner side of owner-checked engines)."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = core
        self._grants: dict[bytes, Grant] = {}
        self._lock = threading.Lock()

    def check(self, credential: bytes, put: bool, offset: int, nbytes: int) -> Grant:
        """Validate a remote consumer's request for a window this runtime owns.

        ``credential`` is the consumer's serialized RefSpec; ``offset``/``nbytes`` the byte
        range inside the window; ``put`` the direction. Checks, before a byte moves: the window
        is owned here and LIVE at the credential's generation, the access key matches, the range
        lies inside the credential's own range, a put has a writable ref to a writable window.
        Validations are cached per credential; the generation is re-checked by every bracket.

        Raises:
            WindowNotFoundError, StaleReferenceError, AccessDeniedError, ValueError (range).
        """
        with self._lock:
            g = self._grants.get(credential)
            if g is None or g.current() != g.generation:
                g = self._grant(credential)
        if offset < g.lo or nbytes < 0 or offset + nbytes > g.hi:
            raise ValueError(f"range [{offset}, {offset + nbytes}) lies outside the ref's range "
                             f"[{g.lo}, {g.hi}) of window gva {g.gva:#x}")
        if put and not g.writable:
            raise AccessDeniedError(f"put to window gva {g.gva:#x}: the ref or the window is read-only")
        return g

    def _grant(self, credential: bytes) -> Grant:
        old = self._grants.pop(credential, None)
        if old is not None:
            old.close()
        try:
            spec = RefSpec.from_bytes(credential)
        except (ValueError, KeyError) as exc:
            raise AccessDeniedError(f"malformed credential: {exc}") from None
        core = self._core
        owned = core.publisher.owned.get(spec.gva)
        if owned is None or owned.retiring:
            raise WindowNotFoundError(f"{spec.label} is not published by this runtime (unpublished, "
                                      "or never): the ref is stale", window=spec.name, expected=spec.generation)
        if not key_matches(spec.key, owned.info.key_digest):
            if spec.generation != owned.generation:
                raise tr.stale(spec, owned.generation)
            raise tr.wrong_key(spec)
        cb = owned.cb
        gen = cb.generation
        if gen != spec.generation or cb.word(W_STATE) != WindowState.LIVE:
            raise tr.stale(spec, gen)
        if spec.offset < 0 or spec.offset + spec.nbytes > owned.info.nbytes:
            raise tr.out_of_range(spec, spec.offset, spec.offset + spec.nbytes, owned.info.nbytes)
        res = core.resolver.resolve(owned.spec())
        if not res.enter():  # the grant's claim
            raise tr.stale(spec, cb.generation)
        mem = address_view(owned.region.address, owned.info.nbytes, owned.keepalive)
        g = Grant(res, spec, mem, spec.writable and owned.info.access == "rw")
        if len(self._grants) >= GRANT_LIMIT:
            self._evict(lambda g: True)
        self._grants[credential] = g
        return g

    def sweep(self) -> None:
        """Drop cached grants of windows whose generation moved."""
        with self._lock:
            self._evict(lambda g: g.current() != g.generation)

    def evict(self, gva: int) -> None:
        """Drop every grant of window ``gva`` (it is being retired)."""
        with self._lock:
            self._evict(lambda g: g.gva == gva)

    def close(self) -> None:
        with self._lock:
            self._evict(lambda g: True)

    def _evict(self, which: Any) -> None:
        for cred, g in list(self._grants.items()):
            if which(g):
                del self._grants[cred]
                try:
                    g.close()
                except MemsemError:
                    pass
