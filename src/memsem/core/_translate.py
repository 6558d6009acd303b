"""Errors, made in one place: the boundary where engine and native outcomes become memsem errors.

Every condition has one wording and one type whatever the call that met it (get, put, lease,
view, wait_tile, xcopy): a moved generation is ``WindowRetiredError`` (the ref's and the found
generations attached: look the name up again), an overwritten version ``VersionGoneError`` (the
wanted and found versions: read the latest), both ``StaleReferenceError``; a dead owner
``PeerLostError``, an expired lease ``LeaseExpiredError``.
Engine errors are chained (``raise ... from``) so their errno / status name stays visible.
"""
from __future__ import annotations

import errno as _errno
from typing import Any

from memsem._errors import (
    AccessDeniedError,
    EngineError,
    LeaseExpiredError,
    MemsemError,
    MemsemTimeoutError,
    VersionGoneError,
    WindowRetiredError,
)
from memsem import _args
from memsem.gva import RefSpec

def stale(spec: RefSpec, found: int | None, *, during: bool = False) -> WindowRetiredError:
    """The generation of ``spec``'s window moved (or the window is gone: ``found`` None)."""
    when = " during the transfer" if during else ""
    now = "it is gone" if found is None else f"it is now {found}"
    again = f"; look {spec.name!r} up again" if spec.name else ""
    return WindowRetiredError(
        f"{spec.label}: the ref is stale (generation {spec.generation}; {now}): the window was "
        f"unpublished, republished or reused{when}; no byte of it is valid{again}",
        window=spec.name, generation=spec.generation, found=found)


def version_gone(spec: RefSpec, wanted: int, found: int) -> VersionGoneError:
    """Version ``wanted`` of ``spec``'s window was overwritten by version ``found``."""
    return VersionGoneError(
        f"{spec.label}: version {wanted} is gone (the window holds version {found} now); read "
        f"the latest version, or hold a lease on a version to keep it readable",
        window=spec.name, wanted=wanted, found=found)


def lease_expired(spec: RefSpec, when: str) -> LeaseExpiredError:
    return LeaseExpiredError(f"lease on {spec.label} expired {when}")


def read_only(spec: RefSpec, what: str = "put") -> AccessDeniedError:
    return AccessDeniedError(f"{what} to {spec.label}: the window was published read-only")


def read_only_ref(spec: RefSpec, what: str = "put") -> AccessDeniedError:
    return AccessDeniedError(
        f"{what} through a read-only ref to {spec.label}: its owner published the window read-only "
        "(access='r'; a double-buffered window, slots=2, always is: its owner writes each version in a "
        "write section) or minted this ref read-only; write it in the owner's write section, or ask the "
        "owner for a ref of a window published access='rw'")


def wrong_key(spec: RefSpec) -> AccessDeniedError:
    return AccessDeniedError(f"wrong access key for {spec.label}: the ref was not minted by its owner")


def out_of_range(spec: RefSpec, start: int, end: int, size: int, whose: str = "window") -> ValueError:
    return ValueError(f"range [{start}, {end}) lies outside {spec.label}'s {size} bytes ({whose})")


def version_range(version: int) -> ValueError:
    """A version beyond the largest a window has (``MEMSEM_VERSION_MAX``)."""
    return ValueError(f"version must be an int in [0, {_args.VERSION_MAX}] (0: the latest), got {version!r}")


def busy_timeout(spec: RefSpec, timeout: float) -> MemsemTimeoutError:
    return MemsemTimeoutError(
        f"{spec.label}: a write section stayed open (or the version asked for was not committed) "
        f"for {timeout} s; no bytes were returned", what=f"write section on {spec.label}", timeout=timeout)


def engine_failure(exc: BaseException, spec: RefSpec, peer: Any, kind: str) -> MemsemError:
    """Translate an engine's or the native layer's failure: the owner's death (ESRCH, or a
    liveness check that fails now) is PeerLostError, memsem errors stay, anything else becomes
    an EngineError chained to the cause (the caller raises ``... from exc``)."""
    if isinstance(exc, MemsemError) and not isinstance(exc, EngineError):
        return exc
    err = getattr(exc, "errno", None)
    if peer is not None and (err == _errno.ESRCH or not peer.alive()):
        return peer.lost(f"{spec.label}, during the {kind},")
    if isinstance(exc, EngineError):
        return exc
    return EngineError(f"{kind} on {spec.label} failed: {exc}")


def chain(translated: BaseException, cause: BaseException) -> BaseException:
    """``raise chain(t, exc)``: chain ``t`` to ``exc`` unless they are the same error."""
    if translated is not cause:
        translated.__cause__ = cause
    return translated
