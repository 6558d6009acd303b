"""The follower loop: an iterator over the new versions of a name, loading each into existing
tensors, that handles what a follower meets on the way.

A rollout that follows a trainer writes::

    for version, params in rt.follow("policy", into=model_params, timeout=60):
        generate(params)                  # params holds exactly `version`, bit-exact

and the loop handles, without the caller seeing them:

* **not yet published**: the name is looked up waiting (``Runtime.lookup(name, timeout=)``);
* **version gone** (``VersionGoneError``: the owner overwrote the version being read): the
  load is made again, of the latest version;
* **window retired and republished** (``WindowRetiredError``, ``WindowNotFoundError``): the
  name is looked up again, waiting for the new window; the new generation's versions count
  from 1 again (``follower.generation`` tells them apart);
* **the owner's death** (``PeerLostError``): the name is looked up again, waiting for a new
  owner (a restarted trainer that publishes the name again takes over the dead one's);
* **timeout**: each step (the next version, a lookup, the load) waits at most ``timeout``
  seconds in all, then raises ``MemsemTimeoutError`` naming what it waited for. No error of
  the caller (a destination that does not fit) is retried.

**Deltas.** Once the loop holds a version of a state dict in its tensors, each next load moves
only what changed since (``StateDictRef.load(base=)``: the owner's delta history, checked
against the writer's digests, a full load when the check fails or the history does not cover
it); ``delta=False`` loads in full every time. A step loaded into other tensors (``next(into=)``)
than the step before loads in full.

Each load pins the version it reads (a lease at the owner, ``TensorRef.pin``) for the load's
duration, so a load always completes against a trainer that commits every step: the owner waits
for the pin (never longer than ``pin_ttl``) instead of overwriting the version under the reader.
Routes that cannot pin (another node, where pins are not offered) load unpinned, retrying what a
commit overwrote.

**Sources.** ``source`` is a window name, a ``TensorRef`` / ``StateDictRef`` (followed while its
window lives; a named one is looked up again after a republish), or any *followable* object
that has ``version()``, ``wait_version(version, timeout)`` and ``load(into, version=, timeout=)``
(returning the version loaded, at least the one asked for): the fan-out's ``memsem.Relay``
fits as it is, and recovers from its own failures (the loop only waits and loads through it).
A followable that may follow another trainer (a relay, across a trainer's restart) has a
``generation`` attribute and raises ``WindowRetiredError`` from a wait or load of a version of
the trainer it no longer follows: the loop then counts versions from 1 again, like a
republished window, and ``follower.generation`` is the source's.

**Every version, in order** (``every=True``): a stream whose versions each carry their own
data (a bucket stream: verl's buckets), where the owner keeps every version readable until the
follower is done with it (flow control, or pins of versions ahead). Each step waits for exactly
the next version and loads exactly it; a version gone, a retired window or a dead owner break
the stream and are raised (never skipped over).

Async: ``async for version, params in rt.follow(...)`` (or ``await follower.next_async()``)
runs the same loop's step in a worker thread (the event loop never blocks).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Protocol, runtime_checkable

from memsem import _args, _dtypes
from memsem._errors import (
    LeaseExpiredError,
    MemsemError,
    MemsemTimeoutError,
    NotSupportedError,
    PeerLostError,
    VersionGoneError,
    WindowRetiredError,
)
from memsem.core import RuntimeCore, Wait
from memsem.sync import _acks
from memsem.sync._state_dict import LAYOUT_MAGIC, StateDictRef
from memsem.refs._tensorref import TensorRef, check_ref

_UINT8 = _dtypes.code_of("uint8")
#: numbers of this process's followers' default reader names
_READERS = itertools.count(1)
_monotonic = time.monotonic
#: default seconds a pin of a version being loaded may hold the owner's next write section
DEFAULT_PIN_TTL = 10.0


@runtime_checkable
class Followable(Protocol):
    """What a follower needs of a source that is not a window (``memsem.Relay`` has it)."""

    def version(self) -> int: ...

    def wait_version(self, version: int, timeout: float | None = None) -> int: ...

    def load(self, into: Any = None, *, version: int = 0, timeout: float | None = None) -> int: ...


class Follower:
    """An iterator over new versions of a source (``Runtime.follow``): yields ``(version,
    tensors)``, ``tensors`` being ``into`` (or tensors allocated once), holding exactly that
    version. See the module docstring for what it handles.

    Attributes:
        version: the version yielded last (0: none yet). generation: its window's generation
            (for a followable source, its ``generation`` attribute, None where it has none). ref: the window's current ref (None until found,
            and for a followable source). loads: versions loaded. skipped: versions committed
            but never loaded (the owner was faster: the loop always loads the latest).
            recovered: ``(what, error type)`` of each recovery (a lookup again, a load again).
            loaded_at: ``time.monotonic()`` of the last load (None before the first).

    Its runtime's ``stats().followers`` (and the exporter's ``memsem_follower_*`` metrics)
    report it while it is open: :meth:`staleness`.

    Thread safety: one thread iterates (``async for`` in one task); ``staleness`` may be called
    from any thread.
    """

    def __init__(self, core: RuntimeCore, source: Any, *, into: Any = None, timeout: float | None = None,
                 after: int = 0, pin: bool = True, pin_ttl: float | None = DEFAULT_PIN_TTL,
                 every: bool = False, reader: str | None = None,
                 delta: bool = True) -> None:
        self._core = core
        #: this follower's name in its acknowledgements (``wait_loaded``)
        self.reader = _acks.check_reader(reader) if reader is not None else f"rank{core.rank}-{next(_READERS)}"
        #: the name this reader's acknowledgement is recorded under ("": none); it stays when the
        #: follower ends (its tensors hold that version) and goes when its runtime closes
        self._acked = ""
        self.timeout = _args.timeout_or(timeout, core.timeout, "timeout")
        self._after = _args.version(after, "after")
        if not isinstance(pin, bool):
            raise TypeError(f"pin must be True or False, got {pin!r}")
        if not isinstance(every, bool):
            raise TypeError(f"every must be True or False, got {every!r}")
        if not isinstance(delta, bool):
            raise TypeError(f"delta must be True or False, got {delta!r}")
        self.every = every
        self.delta = delta
        #: the tensors the last load filled, the window it read and the version it put there (a
        #: delta's base: see ``_load``)
        self._held: tuple[Any, int, int, int] | None = None
        self._pin = pin
        self._pin_ttl = _args.ttl(pin_ttl, "pin_ttl")
        self._source: Followable | None = None
        self._name = ""
        self.ref: TensorRef | None = None
        if isinstance(source, str):
            self._name = _args.window_name(source, "source")
        elif isinstance(source, TensorRef):
            self.ref = source
            self._name = source.spec.name
        elif isinstance(source, Followable):
            if into is None:
                raise ValueError("into is needed to follow a followable source (the tensors it loads into)")
            self._source = source
        else:
            raise TypeError(f"source must be a window name, a TensorRef / StateDictRef or a followable "
                            f"(version, wait_version, load), got {type(source).__name__}")
        self._into = into
        self._own_into = into is None
        self.version = 0
        self.generation: int | None = None if self.ref is None else self.ref.spec.generation
        self.loads = 0
        self.skipped = 0
        self.recovered: list[tuple[str, str]] = []
        self.loaded_at: float | None = None
        self._closed = False
        core.telemetry.add_follower(self)
        core.children.add(self)  # closed before the runtime closes

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> "Follower":
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._closed:
            raise StopIteration
        return self.next()

    def __aiter__(self) -> "Follower":
        return self

    async def __anext__(self) -> tuple[int, Any]:
        if self._closed:
            raise StopAsyncIteration
        return await self.next_async()

    async def next_async(self, into: Any = None) -> tuple[int, Any]:
        """``next`` for asyncio: the step runs in a worker thread (the loop never blocks)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.next, into)

    def close(self) -> None:
        """End the iteration (a blocked step ends by its timeout). This reader's acknowledgement
        stays (the tensors hold the version it names, and ``wait_loaded`` counts it) until its
        runtime closes. Safe twice."""
        self._closed = True

    def __enter__(self) -> "Follower":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        what = repr(self._name) if self._name else type(self._source or self.ref).__name__
        return f"<memsem.Follower of {what} at version {self.version} ({self.loads} loads)>"

    # -- one step ---------------------------------------------------------------------------------
    def next(self, into: Any = None) -> tuple[int, Any]:
        """Block until a version newer than the last one yielded is loaded into the tensors;
        return ``(version, tensors)``. ``into``: load this step into these tensors instead
        (e.g. two buffers used in turn); ``every``: exactly the next version.

        Raises:
            MemsemTimeoutError: no newer version could be loaded within ``timeout`` s (no name,
                no commit, no new owner). KeyError / ValueError / TypeError: ``into`` does not
                fit the window. AccessDeniedError: as ``lookup``. Errors of a followable
                source's own (a relay's ``DigestMismatchError``). RuntimeClosedError: the
                runtime is closed (at once, or within a slice of a wait when it closes
                meanwhile).
        """
        self._core.check_open()
        what = f"a version after {self.version} of {self._label()}"
        wait = Wait(what, self.timeout, telemetry=self._core.telemetry, state="not loaded")
        while True:
            try:
                if self._source is not None:
                    return self._next_followable(wait, into)
                return self._next_window(wait, into)
            except MemsemTimeoutError as exc:
                if exc.what == what:
                    raise
                if wait.expired:
                    err = wait.error()  # one error naming the step, whatever wait ran out in it
                    if self.ref is None and self._name:  # the name never appeared (or not again): say so here
                        err = MemsemTimeoutError(f"{err}: {exc}", what=err.what, timeout=err.timeout)
                    raise err from exc
                # a wait of the source with a bound of its own, shorter than this step's (a
                # relay's attach_timeout): not this step's failure; tried again (after a slice,
                # the one wait's pause, which raises this step's error at its deadline)
                self._note("wait again", exc)
                wait.pause()

    def _next_window(self, wait: Wait, into: Any) -> tuple[int, Any]:
        while True:
            wait.check()
            try:
                if self.ref is None:
                    self._attach(wait)
                want = (self.version if self.ref.spec.generation == self.generation else 0) + 1
                want = max(want, self._after + 1) if self.version == 0 else want
                self._core.wait_version(self.ref.spec, want, wait.left(), stop=self._core.check_open)
                v = self._load(wait, want if self.every else 0, into)
            except (VersionGoneError, LeaseExpiredError) as exc:
                if self.every:
                    raise  # the stream lost a version: never skipped over
                self._note("load again", exc)  # overwritten under the load: load the latest again
                continue
            except (WindowRetiredError, PeerLostError) as exc:
                if not self._name or self.every:
                    raise
                self._note("look up again", exc)
                self.ref = None
                continue
            if v < want:  # the window holds an older version than waited for: never yielded
                continue
            if self.version and self.ref.spec.generation == self.generation:
                self.skipped += max(0, v - self.version - 1)
            self.generation = self.ref.spec.generation
            self.version = v
            self.loads += 1
            self.loaded_at = _monotonic()
            self._ack(self.ref.spec.name, self.generation)
            return v, into if into is not None else self._into

    def _next_followable(self, wait: Wait, into: Any) -> tuple[int, Any]:
        src = self._source
        dst = into if into is not None else self._into
        want = max(self.version, self._after) + 1
        if self.version and getattr(src, "generation", None) != self.generation:
            want = 1  # the source follows a new trainer since the last step: its versions count from 1
        while True:
            wait.check()
            gen = getattr(src, "generation", None)
            try:
                src.wait_version(want, timeout=wait.left())
                v = src.load(dst, version=want, timeout=wait.left())
            except VersionGoneError as exc:
                if self.every:
                    raise
                self._note("load again", exc)
                continue
            except WindowRetiredError as exc:  # a relay's trainer was replaced (restarted) meanwhile
                if self.every:
                    raise
                self._note("new generation", exc)
                want = 1
                continue
            if gen is None:  # the source found its first trainer during this step
                gen = getattr(src, "generation", None)
            if self.version and gen == self.generation:
                self.skipped += max(0, v - self.version - 1)
            self.generation = gen
            self.version = v
            self.loads += 1
            self.loaded_at = _monotonic()
            name = getattr(src, "name", None)
            if isinstance(name, str) and isinstance(gen, int):
                self._ack(name, gen)
            return v, dst

    # -- staleness (read by the runtime's stats, from any thread) ------------------------------------
    def staleness(self) -> dict[str, Any] | None:
        """How far behind its writer this follower is, now: ``{"name", "held", "latest",
        "since_load_s"}`` (``latest`` absent when it cannot be read: no window found yet, the
        window retired, the owner gone; ``since_load_s`` absent before the first load); None
        once closed. Reads what the loop records, and the writer's latest version (the
        window's version word; across nodes one request, bounded by the runtime's timeout):
        the loop itself does no extra work for it.
        """
        if self._closed:
            return None
        ref, src = self.ref, self._source
        name = self._name or (ref.spec.name if ref is not None else "") or str(getattr(src, "name", "") or "")
        out: dict[str, Any] = {"name": name, "held": self.version}
        try:
            if src is not None:
                out["latest"] = int(src.version())
            elif ref is not None and (self.version == 0 or ref.spec.generation == self.generation):
                out["latest"] = int(ref.version())
        except MemsemError:
            pass  # no latest to report now (the loop recovers on its own)
        if self.loaded_at is not None:
            out["since_load_s"] = max(0.0, _monotonic() - self.loaded_at)
        return out

    # -- helpers -----------------------------------------------------------------------------------
    def _ack(self, name: str, generation: int) -> None:
        """Record that this reader holds ``self.version`` of ``name`` (``wait_loaded``)."""
        if not name:
            return
        if self._acked and self._acked != name:
            _acks.forget(self._core, self._acked, self.reader)
        self._acked = name if _acks.record(self._core, name, self.reader, self.version, generation) else ""

    def _label(self) -> str:
        if self._name:
            return f"window {self._name!r}"
        if self.ref is not None:
            return self.ref.spec.label
        return repr(self._source)

    def _note(self, what: str, exc: BaseException) -> None:
        self.recovered.append((what, type(exc).__name__))
        if len(self.recovered) > 256:
            del self.recovered[:128]

    def _attach(self, wait: Wait) -> None:
        """Look the name up (waiting for it, a successor of a retired window, a new owner)."""
        core = self._core
        spec = core.lookup_spec(self._name, max(wait.left(), 1e-3), stop=core.check_open)
        ref = StateDictRef(spec, core) if _is_state_dict(core, spec) else TensorRef(spec, core)
        if isinstance(ref, StateDictRef):
            _ = ref.layout  # read and checked now: a wrong window is an error here
        if ref.spec.generation != self.generation and self._own_into:
            self._into = None  # another generation may have another layout: allocate again
        self.ref = ref

    def _load(self, wait: Wait, exact: int, into: Any) -> int:
        """Load the latest version (``exact`` 0; pinned while it loads), or exactly ``exact``,
        into ``into`` (else the follower's tensors); returns the version loaded."""
        ref = self.ref
        is_sd = isinstance(ref, StateDictRef)
        dst = into if into is not None else self._into
        if dst is None:
            if not is_sd:  # the first load allocates the tensor the next ones fill
                v, self._into = ref.get(version=exact, with_version=True)
                return v
            dst = self._into = ref.empty_like()
        lease = None
        if self._pin:
            try:
                lease = ref.pin(exact, ttl=self._pin_ttl, timeout=wait.left())
            except NotSupportedError:
                self._pin = False  # the route offers no pins: unpinned loads from now on
        try:
            version = lease.version if lease is not None else exact
            if is_sd:
                # the tensors hold the version the last load put there, as it left them: a delta
                held, self._held = self._held, None
                base = held[3] if (self.delta and held is not None and held[0] is dst
                                   and held[1:3] == (ref.spec.gva, ref.spec.generation)) else 0
                v = ref.load(dst, version=version, lease=lease, base=base)
                self._held = (dst, ref.spec.gva, ref.spec.generation, v)
                return v
            return ref.get(dst, version=version, lease=lease, with_version=True).version
        finally:
            if lease is not None:
                lease.release()


def _is_state_dict(core: RuntimeCore, spec: Any) -> bool:
    """Whether the window of ``spec`` holds a state dict (a uint8 window whose first bytes are
    the layout's magic)."""
    if spec.dtype_code != _UINT8 or spec.nbytes < len(LAYOUT_MAGIC):
        return False
    head = TensorRef(spec, core).bytes(0, len(LAYOUT_MAGIC)).get()
    return head.tobytes() == LAYOUT_MAGIC


def follow(core: RuntimeCore, source: Any, **kwargs: Any) -> Follower:
    """See ``memsem.Runtime.follow``."""
    if isinstance(source, TensorRef):
        check_ref(source, "source")
    return Follower(core, source, **kwargs)


__all__ = ["DEFAULT_PIN_TTL", "Followable", "Follower", "follow"]
