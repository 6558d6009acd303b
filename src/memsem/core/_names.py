"""Names: one owner each, scoped by the job, looked up (and waited for) by any process of it.

* **One owner.** A publisher claims a name in the directory (``Directory.claim_name``: one
  atomic step) before it creates anything: a name held by a live holder of the job (another
  runtime whose process is alive and whose rank is still its own) is refused with
  :class:`memsem.NameHeldError` naming the holder, unless the publisher asks to replace it
  (``replace=True``), this runtime included: republishing its own name takes ``replace=True``.
  A dead holder's name is taken over.
  A window's removal drops its name only while the name still points at it, so a replaced
  owner that exits never removes its successor's name.
* **Jobs scope names** (and every other record): :func:`memsem.directory.default_job` says
  which job a runtime joins when none is named.
* **Limits.** A name is a non-empty ``str`` of at most ``NAME_MAX_BYTES`` (255) bytes of UTF-8
  without control characters (``memsem._args.window_name``), checked at publish before anything
  is created and at lookup, so what publish accepts works in every directory.
* **Lookup** reads the name's record, then its window's record and key, and checks the window
  is live at that generation (it resolves the window: a lookup racing a republish never returns
  the retired generation; it reads again). ``timeout`` > 0 waits for the name to appear (or for
  its retired window's successor, or a dead holder's successor): the directory has no word to
  sleep on, so the one wait pauses a slice between reads.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from memsem import _args
from memsem._errors import (
    AccessDeniedError,
    NameHeldError,
    NotSupportedError,
    PeerLostError,
    WindowNotFoundError,
    WindowRetiredError,
)
from memsem.directory.local import job_is_derived
from memsem.gva import Mint, RefSpec, WindowInfo, key_matches
from memsem.core._wait import Wait

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore


class Names:
    """The names of one runtime's windows in its job's directory (see the module docstring)."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = core

    @property
    def holder(self) -> dict:
        """This runtime as a name's holder: pid, start time, node, rank."""
        me = self._core.identity
        return {"pid": me.pid, "start": me.start_time, "node": me.node, "rank": self._core.rank}

    def _job(self) -> str:
        d = self._core.directory
        return f"job {getattr(d, 'job', '?')!r} ({d.url})"

    def _wait(self, what: str, timeout: float, state: str = "not reached",
              stop: Callable[[], None] | None = None) -> Wait:
        return Wait(what, timeout, telemetry=self._core.telemetry, state=state, stop=stop)

    # -- owner side -------------------------------------------------------------------------------
    def claim(self, name: str, gva: int, *, replace: bool = False) -> None:
        """Bind ``name`` to this runtime's window ``gva`` (before the window is created).

        Raises:
            NameHeldError: a live holder other than this runtime holds it and not ``replace``.
            MemsemTimeoutError: the directory stayed busy for the runtime's timeout.
        """
        core = self._core
        wait = self._wait(f"the claim of name {name!r} in {self._job()}", core.timeout)
        held = core.directory.claim_name(name, gva, self.holder, replace=replace, pause=wait.pause)
        if held is not None:
            core.telemetry.count_error("name_held")
            raise NameHeldError(
                f"name {name!r} is held in {self._job()} by a live process: pid {held.get('pid')} on node "
                f"{held.get('node')!r} (rank {held.get('rank')}, window gva {held.get('gva')}); a name has "
                "one owner: publish under another name, or pass replace=True to take it over",
                name=name, holder=held)

    def holds(self, name: str, gva: int) -> bool:
        """Whether the directory still binds ``name`` to this runtime's window ``gva`` (a
        publisher that replaced it holds it now, or the record was lost)."""
        rec = self._core.directory.name_record(name)
        if rec is None:
            return False
        try:
            if int(rec["gva"], 16) != gva:
                return False
        except (KeyError, TypeError, ValueError):
            return False
        h = self.holder
        return all(rec.get(k, h[k]) == h[k] for k in ("pid", "start", "rank"))

    def release(self, name: str, gva: int, wait: Wait | None = None) -> None:
        """Drop ``name``'s record while it points at ``gva`` (the window's record goes too)."""
        self._core.directory.remove_window(gva, name, pause=wait.pause if wait is not None else None)

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, name: str, timeout: float = 0.0, *, stop: Callable[[], None] | None = None) -> RefSpec:
        """RefSpec of the live window published under ``name`` in this job (see
        ``memsem.Runtime.lookup``); ``timeout`` seconds to wait for one to appear (0: read once).
        ``stop``: the caller's check after every slice of that wait (``Wait``'s ``stop``).

        Raises:
            WindowNotFoundError: no live window holds the name (``timeout`` 0). PeerLostError:
            its holder died (``timeout`` 0). MemsemTimeoutError: none appeared within
            ``timeout`` s (chained to why the last read found none). AccessDeniedError: the
            directory holds no key for this process. TypeError / ValueError: a bad name or timeout.
        """
        name = _args.window_name(name)
        t = _args.timeout(timeout)
        core = self._core
        core.check_open()
        wait: Wait | None = None
        while True:
            try:
                return self._read(name)
            except (WindowRetiredError, PeerLostError) as exc:
                if t == 0:
                    raise
                if wait is None:
                    hint = self._job_hint()
                    wait = Wait(f"a live window named {name!r} in {self._job()}", t, telemetry=core.telemetry,
                                state="not published", stop=stop, detail=(lambda: hint) if hint else None)
                if wait.expired:
                    raise wait.error() from exc
                wait.pause()

    def _read(self, name: str) -> RefSpec:
        core = self._core
        gva = core.publisher.names.get(name)
        if gva is not None and gva in core.publisher.owned and self.holds(name, gva):
            return core.publisher.owned[gva].spec()
        d = core.directory
        why = "no record holds it"
        # Another process's window: its key is in the directory for the job's members (the local
        # directory's 0700 folder, or sealed with the job secret; docs/threat-model.md).
        for _ in range(3):  # a republish between the reads: read again
            gva = d.lookup(name)
            if gva is None:
                break
            rec, key = d.window_with_key(gva)
            if rec is None:
                why = f"its window gva {gva:#x} has no record (retired, or being published)"
                continue
            i = WindowInfo.from_json(rec)
            mint = None
            if key is not None and len(key) == 32:  # the key and the whole-window mint's MAC
                key, mac = key[:16], key[16:]
                mint = Mint(0, i.nbytes, i.access, mac)
            if key is None:
                raise AccessDeniedError(
                    f"window {name!r} is published in {d.url} but its access key is not there for this "
                    "process (a redis directory seals keys only with a job secret: set "
                    "MEMSEM_JOB_SECRET in every process of the job); pass the serialized ref instead")
            if not key_matches(key, i.key_digest):
                why = f"the record of window gva {gva:#x} changed while read"
                continue
            spec = RefSpec(gva, i.generation, key, i.access, 0, i.nbytes, i.dtype_code, i.shape,
                           i.byte_offset, i.framework, name, mint)
            try:
                core.resolver.resolve(spec, i)  # the generation is live (same node: its control block)
            except WindowRetiredError as exc:
                why = f"its window gva {gva:#x} was retired ({exc})"
                continue
            except NotSupportedError:
                pass  # no route from here: its first use says so
            return spec
        hint = self._job_hint()
        raise WindowNotFoundError(f"no live window named {name!r} in {self._job()}: {why}{'; ' + hint if hint else ''}",
                                  window=name)

    def _job_hint(self) -> str:
        """Why another process's name may be missing here: this job was derived, not named ("")."""
        if not job_is_derived(getattr(self._core.directory, "job", "")):
            return ""
        return ("this job was derived from the process group (no MEMSEM_JOB): processes started "
                "separately, or on other nodes, share names only under a job they all name "
                "(MEMSEM_JOB or Runtime(job=...))")


__all__ = ["Names"]
