"""Readers' acknowledgements: which reader holds which version of a name (lockstep syncs).

Synchronous RL needs the trainer to wait until its rollouts hold version v before it goes on.
A follower of a named window records, after each version it loads, one small directory entry:
``loaded/<digest of the name>/<reader>`` -> ``{"version", "generation", "reader", "pid",
"node", "rank"}`` (``Directory.put_entry``: the same on every directory backend that stores
entries: local, redis, ray). The writer waits on those entries (``Directory.watch_entries``,
never a poll loop of its own) until the readers it names, or ``n`` readers, hold the version:
:func:`wait_loaded` (``memsem.Runtime.wait_loaded``).

An entry counts only for the window's current generation (a republished name's versions count
again from 1), and only at or past the version waited for. An entry outlives its follower (a
follower closed, or a ``for`` loop left, after loading the last version: its tensors still hold
that version, and a writer waiting for it must see it, whatever the order of the two); it goes
when the runtime that wrote it closes (the reader left the job), and an entry of a reader that
died stays at the last version that reader loaded, so it never counts for a later one, until the
next runtime on its node removes it (``memsem.core._gc``: a record of a dead process).
"""
from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

from memsem import _args
from memsem._errors import MemsemTimeoutError, NotSupportedError
from memsem.core import RuntimeCore, Wait
from memsem.refs._tensorref import TensorRef

log = logging.getLogger(__name__)

#: a reader's name: 1..48 characters of ``[A-Za-z0-9._-]`` (it is part of a directory entry key)
READER_RE = re.compile(r"[A-Za-z0-9._-]{1,48}")


def check_reader(reader: Any, argname: str = "reader") -> str:
    """``reader`` checked: a str of 1..48 characters of ``[A-Za-z0-9._-]`` (else TypeError /
    ValueError naming ``argname`` and the value)."""
    if not isinstance(reader, str):
        raise TypeError(f"{argname} must be a str of 1..48 characters of [A-Za-z0-9._-], got {type(reader).__name__}")
    if not READER_RE.fullmatch(reader):
        raise ValueError(f"{argname} must be 1..48 characters of [A-Za-z0-9._-], got {reader!r}")
    return reader


def prefix(name: str) -> str:
    """The entry prefix of ``name``'s acknowledgements (a name may hold any UTF-8: its digest)."""
    return f"loaded/{hashlib.sha256(name.encode()).hexdigest()[:24]}/"


class _Written:
    """The acknowledgements one runtime wrote (a part of it: ``RuntimeCore.part``), removed when
    it closes."""

    def __init__(self, core: RuntimeCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self.keys: set[str] = set()

    def close(self) -> None:
        with self._lock:
            keys, self.keys = sorted(self.keys), set()
        for key in keys:
            try:
                self._core.directory.remove_entry(key)
            except Exception:  # noqa: BLE001 - an unreachable directory: gc removes it (a dead pid's)
                log.debug("acknowledgement %s could not be removed", key, exc_info=True)


def record(core: RuntimeCore, name: str, reader: str, version: int, generation: int) -> bool:
    """Record that ``reader`` holds ``version`` of ``name`` (generation ``generation``); the
    record stays until :func:`forget` or until ``core`` closes.

    Returns False (recording nothing) where the directory stores no entries."""
    me = core.identity
    key = prefix(name) + reader
    written = core.part("sync.acks", lambda: _Written(core))
    with written._lock:
        written.keys.add(key)
    try:
        core.directory.put_entry(key, {
            "version": int(version), "generation": int(generation), "reader": reader,
            "pid": me.pid, "start": me.start_time, "node": me.node, "rank": core.rank})
    except NotSupportedError:
        with written._lock:
            written.keys.discard(key)
        return False
    return True


def forget(core: RuntimeCore, name: str, reader: str) -> None:
    """Remove ``reader``'s acknowledgement of ``name`` (a follower that moved to another name)."""
    key = prefix(name) + reader
    written = core.part("sync.acks", lambda: _Written(core))
    with written._lock:
        written.keys.discard(key)
    try:
        core.directory.remove_entry(key)
    except NotSupportedError:
        pass


def _held(core: RuntimeCore, name: str, generation: int) -> dict[str, int]:
    """``{reader: version}`` of the readers acknowledging ``name`` at ``generation``."""
    out: dict[str, int] = {}
    for key, rec in core.directory.entries(prefix(name)).items():
        reader = key.rsplit("/", 1)[-1]
        try:
            if int(rec.get("generation", -1)) != generation:
                continue
            out[reader] = _args.version(rec.get("version"), "version")
        except (TypeError, ValueError):
            continue  # a malformed record is no acknowledgement
    return out


def wait_loaded(core: RuntimeCore, source: Any, version: int, *, readers: Sequence[str] | None = None,
                n: int | None = None, timeout: float | None = None) -> dict[str, int]:
    """Block until the given ``readers`` (or any ``n`` readers) hold ``version`` of ``source``.

    See ``memsem.Runtime.wait_loaded``."""
    if isinstance(source, str):
        name = _args.window_name(source, "source")
        generation = None
    elif isinstance(source, TensorRef):
        name = source.spec.name
        generation = source.spec.generation
        if not name:
            raise ValueError("source must be a named window (readers acknowledge names), got an unnamed ref "
                             f"{source.spec.label}")
    else:
        raise TypeError(f"source must be a window name or a TensorRef / StateDictRef, got {type(source).__name__}")
    version = _args.version(version, "version")
    if version < 1:
        raise ValueError(f"version must be >= 1 (a committed version), got {version!r}")
    if (readers is None) == (n is None):
        raise ValueError(f"give exactly one of readers (names) and n (a count), got readers={readers!r}, n={n!r}")
    want: list[str] = []
    if readers is not None:
        if isinstance(readers, str) or not isinstance(readers, Sequence):
            raise TypeError(f"readers must be a sequence of reader names, got {readers!r}")
        want = [check_reader(r, "readers[]") for r in readers]
        if not want:
            raise ValueError("readers must name at least one reader, got an empty sequence")
    else:
        n = _args.count(n, "n", minimum=1, maximum=1 << 20)
    timeout = _args.timeout_or(timeout, core.timeout, "timeout")
    core.check_open()
    who = f"{len(want)} named readers" if want else f"{n} readers"
    wait = Wait(f"{who} holding version {version} of window {name!r}", timeout, telemetry=core.telemetry,
                state="not acknowledged")
    try:
        watch = core.directory.watch_entries(prefix(name))
    except NotSupportedError as exc:
        raise NotSupportedError(f"wait_loaded needs a directory that stores entries; {core.directory.url} "
                                "does not") from exc
    held: dict[str, int] = {}
    with watch:
        while True:
            core.check_open()
            gen = generation if generation is not None else core.lookup_spec(name, max(wait.left(), 1e-3)).generation
            held = _held(core, name, gen)
            done = {r: v for r, v in held.items() if v >= version}
            if want and all(r in done for r in want):
                return {r: done[r] for r in want}
            if not want and len(done) >= n:
                return done
            left = wait.left()
            if left <= 0:
                break
            watch.wait(min(left, 0.5))  # a hint: read again after every wait (and at least twice a second)
    if want:
        behind = ", ".join(f"{r} (at version {held[r]})" if r in held else f"{r} (no version loaded)"
                           for r in want if held.get(r, 0) < version)
        msg = f"readers not holding version {version} of window {name!r} after {timeout:g} s: {behind}"
    else:
        have = sorted(r for r, v in held.items() if v >= version)
        behind = sorted(f"{r} (at version {v})" for r, v in held.items() if v < version)
        msg = (f"{len(have)} of {n} readers hold version {version} of window {name!r} after {timeout:g} s"
               f" ({', '.join(have) or 'none'}); behind: {', '.join(behind) or 'no other reader recorded'}")
    core.telemetry.count_error("timeout")
    raise MemsemTimeoutError(msg, what=wait.what, timeout=timeout)
