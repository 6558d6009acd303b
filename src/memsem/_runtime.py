"""``memsem.Runtime``: the runtime users hold and parts receive.

It is :class:`memsem.core.RuntimeCore` (its parts, its lifetime, its spec-level calls: inherited,
not forwarded) plus the entry points of the layers above core: refs (``publish``, ``lookup``,
``ref``, ``xcopy``), pipelines, state dicts, followers and field sets, each a call into its layer
with the runtime itself. It registers itself with the core layer (``set_runtime_class``) so that
the runtimes memsem makes for users (the default runtime) are of this class.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memsem import _dtypes
from memsem._buffers import check_buffer
from memsem.gva import RefSpec
from memsem.refs._tensorref import TensorRef, check_ref
from memsem.core import Batch, Lease, RuntimeCore, default_runtime, set_runtime_class
from memsem.pipeline import Pipeline
from memsem.refs._fields import FIELD_MAGIC, FieldRef
from memsem.refs._fieldset import SET_MAGIC, FieldSet
from memsem.sync._acks import wait_loaded
from memsem.sync._follow import follow
from memsem.sync._state_dict import LAYOUT_MAGIC, REF_MAGIC, StateDictRef, lookup_state_dict, publish_state_dict
from memsem.topology import Route


_UINT8 = _dtypes.code_of("uint8")
#: bytes a state dict's window holds at least (its layout header starts with a magic)
_STATE_DICT_HEAD = 8


class Runtime(RuntimeCore):
    """A process's memsem runtime. Use as a context manager, or call ``close()``.

    Args:
        directory: ``"local"`` (default, or ``MEMSEM_DIRECTORY``): processes of one machine find
            each other's windows with no server; ``"redis://host:port/db"`` for many nodes.
        engines: engines to enable (default ``("loopback", "host")``); a requested engine that
            is unavailable raises NotSupportedError naming it.
        engine_objects: engine instances by name (e.g. ``memsem.testing.ScriptedEngine``).
        job: the job (directory namespace) this runtime joins: names and windows are seen only
            by runtimes of the same job. Default ``memsem.directory.default_job()``:
            ``MEMSEM_JOB`` when set, else the launcher's run id (torchrun, Slurm), else this
            process group, so the processes one command starts share a job and two runs
            never meet by accident. Name one (the same everywhere) to share it across
            separately started processes or nodes.
        timeout: default bound in seconds of every blocking call (default 30).
        prefer: force an engine for every route (``explain`` shows alternatives).
        workers: threads running asynchronous transfers (default 4).

    Example::

        with memsem.Runtime() as rt:
            ref = rt.publish(weights, name="w", access="r")
            send(ref.to_bytes())           # any control channel
            ...                            # consumer: TensorRef.from_bytes(b).get()

    A runtime holds native state (mappings, a directory rank, threads): close it. After
    ``close()`` its refs raise ``RuntimeClosedError``. In a process forked from this one, the
    inherited runtime is unusable (``RuntimeClosedError``) and refs bound to it use the child's
    default runtime; nothing the parent owns is touched.

    Attributes:
        closed: True once closed (and in a process forked from the one that made it).
        rank: this runtime's rank in the job's directory (its GVA slice).
        engines: the enabled engines by name (``{name: engine}``; ``list(rt.engines)``: their
            names).
        timeout: the default bound in seconds of its blocking calls (settable, > 0).

    The calls documented in docs/api.md are the user's API. A runtime also carries what memsem's
    own layers and integrations use (it is a :class:`memsem.core.RuntimeCore`): its parts
    (``publisher``, ``resolver``, ``transfers``...) and calls on ``RefSpec``s (``publish_spec``,
    ``get_spec``...).
    """

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.stats().windows_published} window(s)"
        return f"<memsem.Runtime rank {self.rank} {self.directory.url} {state}>"

    # -- publish ---------------------------------------------------------------------------------
    def publish(self, obj: Any, *, name: str | None = None, access: str | None = None,
                tile_bytes: int | None = None, tiles: int | None = None, slots: int = 1,
                write_guard: str | None = None, replace: bool = False) -> TensorRef:
        """Publish ``obj`` as a window and return its ref: in place (no staging copy) by
        default, or double-buffered (``slots=2``).

        Args:
            obj: C-contiguous CPU memory: a numpy array, a CPU torch tensor, an object with
                ``__dlpack__`` (its ``byte_offset`` is honoured and carried in the ref) or a
                buffer-protocol object. Non-contiguous views are rejected (ValueError): make them
                contiguous first or publish their base. The window keeps ``obj`` alive until
                unpublished.
            name: optional name: a non-empty str of at most 255 bytes of UTF-8 without control
                characters (``memsem._args.NAME_MAX_BYTES``; else ValueError naming the limit,
                before anything is created). A name has one owner in the job: a name a live
                process of the job publishes (another runtime, in any process, or this one) is
                refused with ``NameHeldError`` naming it, unless ``replace``. This runtime
                publishing its own name again with ``replace=True`` is a republish: the old
                generation is retired (waiting for its leases) and old refs become stale. A named window can be looked up by name
                (``lookup``) by any process of the job (docs/threat-model.md says who that is;
                ``memsem.directory.default_job`` how a job is chosen).
            access: "r" (read-only window: puts are refused) or "rw". Default "r" for read-only
                sources (a read-only numpy array) and for ``slots=2``, else "rw".
            tile_bytes / tiles: give the window ready words, one per tile of ``tile_bytes``
                bytes (or ``tiles`` equal tiles), for ``mark_ready``/``wait_tile`` and pipelines.
            slots: 1 (default): the window is ``obj``'s memory; the owner changes it inside
                ``write_section`` (readers wait while one is open). 2: memsem allocates two
                page-aligned slots and copies ``obj``'s bytes into version 1; each write section
                writes the next version into the other slot, so readers of the latest version
                are never blocked by the writer (the window is read-only to consumers).
            write_guard: debug/testing: ``"protect"`` keeps the published memory read-only
                between write sections (mprotect; needs ``slots=2`` or a whole ``alloc``'d
                array), so an owner write outside a section faults (SIGSEGV) instead of
                tearing readers' bytes silently; ``"checksum"`` (any memory) makes the next
                write section raise ``OwnerWriteError`` when the bytes changed outside one.
                Default: ``MEMSEM_WRITE_GUARD`` (unset: none).
            replace: take ``name`` over from a live holder in this job (explicitly), or
                republish this runtime's own window of that name: lookups find this window from
                then on. The holder's window is not retired (memsem never
                retires another process's window): its refs keep working, and its owner's
                unpublish or exit leaves the name alone.

        Returns:
            A TensorRef with the window's generation and a fresh 128-bit access key.

        Raises:
            TypeError: unsupported object or dtype, a name that is not a str. ValueError:
            non-contiguous or non-CPU memory, bad name/access/tiling/slots/write_guard.
            NameHeldError: a live process of the job, this one included, holds ``name`` (not
            ``replace``).
            AccessDeniedError: ``access="rw"`` on read-only memory. LeaseHeldError: republish
            while leases on the old generation outlast the timeout.
        """
        return TensorRef(self.publisher.publish(obj, name=name, access=access, tile_bytes=tile_bytes, tiles=tiles,
                                                slots=slots, write_guard=write_guard, replace=replace), self)

    def unpublish(self, ref: TensorRef | str, *, timeout: float | None = None) -> None:
        """Retire a window this runtime owns: wait for a write section open on it in another
        thread to close, refuse new leases, wait for held leases, bump the generation (every
        outstanding ref becomes stale), wait for in-flight copies to drain, then release the
        memory. Blocking; the three waits share one deadline of ``timeout`` s (default the
        runtime's); a state dict's delta history windows, retired with it, each get the
        runtime's timeout.

        Raises:
            MemsemError: a write section is open on the window in the calling thread (leave it
                first: waiting for it could never end).
            MemsemTimeoutError: a write section open in another thread outlasted ``timeout``
                (the window stays published), or copies in flight did not drain (retired;
                retry to finish).
            LeaseHeldError: leases outlasted ``timeout`` (the window stays published).
            WindowNotFoundError: this runtime owns no such window.
            StaleReferenceError: ``ref`` is from an older generation.
        """
        self.publisher.unpublish(ref if isinstance(ref, str) else check_ref(ref, "ref").spec, timeout=timeout)

    def lookup(self, name: str, *, timeout: float = 0.0) -> TensorRef:
        """Ref of the live window published under ``name`` in this job: by this runtime, or by
        any process of the job (local directory: this user's processes of the same ``job``;
        redis: processes holding the job secret; docs/threat-model.md). The ref follows the
        window's versions (``TensorRef.version``, ``wait_version``); a republish needs a new
        lookup (its refs raise ``WindowRetiredError``). A lookup racing a republish never
        returns the retired generation: the window is resolved (its generation checked) before
        the ref is returned.

        Args:
            name: the window's name (the limits of ``publish``).
            timeout: seconds to wait for the name to appear (a follower started before its
                trainer published), or for a retired window's successor, or a dead holder's
                (0, the default: read once). Blocking; the directory is read again every
                ``WAIT_SLICE_S``.

        Returns:
            The ref of the kind the name holds: a :class:`memsem.StateDictRef` for a state
            dict's window (``publish_state_dict``; its layout read and checked now), else a
            :class:`TensorRef`.

        Raises:
            WindowNotFoundError: no live window of that name (``timeout`` 0). PeerLostError:
            its holder died (``timeout`` 0). MemsemTimeoutError: none appeared within
            ``timeout`` s. AccessDeniedError: the directory holds no key for this process
            (redis without a job secret). TypeError / ValueError: a bad name or timeout.
        """
        spec = self.names.lookup(name, timeout)
        if spec.dtype_code == _UINT8 and spec.nbytes >= _STATE_DICT_HEAD:
            ref = TensorRef(spec, self)
            if ref.bytes(0, len(LAYOUT_MAGIC)).get().tobytes() == LAYOUT_MAGIC:
                sd = StateDictRef(spec, self)  # a state dict's window: its own kind
                _ = sd.layout  # validated now, as lookup_state_dict does
                return sd
        return TensorRef(spec, self)

    def ref(self, data: bytes | bytearray | memoryview) -> Any:
        """Deserialize a ref of any kind and bind it to this runtime: a ``TensorRef``, or what
        the bytes say they are (``FieldRef``, ``FieldSet``, ``StateDictRef``: the ``to_bytes()``
        of each starts with its own magic).

        Raises:
            TypeError: ``data`` is not bytes. ValueError: not a serialized memsem ref.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        kind = {REF_MAGIC: StateDictRef, SET_MAGIC: FieldSet, FIELD_MAGIC: FieldRef}.get(bytes(data[:4]), TensorRef)
        return kind.from_bytes(data, self)

    # -- data ------------------------------------------------------------------------------------
    def xcopy(self, pairs: Sequence[tuple[Any, Any]], *, lease: Lease | None = None) -> Batch:
        """Copy a batch of ranges, non-blocking; every range ends DONE, FAILED or CANCELLED.

        Args:
            pairs: ``(src, dst)`` pairs; each side is a TensorRef (a window or a range of one,
                see ``TensorRef.bytes``/``tile``) or a local buffer with the same byte count
                (C-contiguous CPU memory of a plain numeric or bool dtype: the ref's dtype, or
                uint8 for raw bytes; a destination must be writable). At least one side of each pair is a ref. Ref-to-ref copies go straight between
                mapped memories when the source route allows, else through a bounce buffer
                (counted in ``stats().bounce_bytes``).
            lease: optional lease checked for the ranges of its window.

        Returns:
            A Batch; ``batch.wait(timeout)`` returns the per-range results and raises only on
            timeout; failed ranges carry their error (``batch.errors``).

        Raises:
            TypeError / ValueError: a malformed pair, a pair of two local buffers, or a local
                buffer that no copy could use (object/structured dtype, conj/neg/sparse/non-CPU
                tensor, read-only destination...): raised before any range starts.
        """
        specs = []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"pairs[{i}] must be a (src, dst) pair, got {pair!r}")
            src, dst = pair
            s_ref, d_ref = isinstance(src, TensorRef), isinstance(dst, TensorRef)
            if s_ref:
                src = src.spec
            if d_ref:
                dst = dst.spec
            # Local buffers are checked here, before any range starts: a caller mistake is a
            # TypeError/ValueError now, not a FAILED range later.
            if not s_ref and not isinstance(src, RefSpec):
                if not d_ref and not isinstance(dst, RefSpec):
                    raise TypeError(f"pairs[{i}]: at least one side of each pair must be a ref, got "
                                    f"{type(src).__name__} and {type(dst).__name__}")
                check_buffer(src, f"pairs[{i}] src", writable=False, dtype_code=dst.dtype_code)
            elif not d_ref and not isinstance(dst, RefSpec):
                check_buffer(dst, f"pairs[{i}] dst", writable=True, dtype_code=src.dtype_code)
            specs.append((src, dst))
        return self.transfers.xcopy(specs, lease=lease)

    def explain(self, ref: TensorRef) -> str:
        """Which route reaches ``ref`` from here, why, its modeled cost, and why not the others."""
        return self.route(ref).explain()

    def route(self, ref: TensorRef) -> Route:
        """The :class:`memsem.topology.Route` that reaches ``ref`` from here."""
        return self.resolver.resolve(check_ref(ref, "ref").spec).route

    # -- pipeline & fields -----------------------------------------------------------------------
    def pipeline(self, ref: TensorRef, *, tile_bytes: int | None = None, depth: int | None = None,
                 wait_ready: bool | None = None, timeout: float | None = None, out: Any = None,
                 zero_copy: bool | None = None, lease: Lease | None = None):
        """Iterate tiles of ``ref`` with a double (``depth``-slot) buffer: tile i+1 moves while the
        caller computes tile i; where the route allows ``view()`` it hands out views instead.

        Example::

            with rt.pipeline(ref, tile_bytes=1 << 20, depth=2) as p:
                for tile in p:
                    with tile:                 # releases the slot, also if compute raises
                        compute(tile.array)
            print(p.stats)                     # first-tile latency, overlap, bytes moved

        See :class:`memsem.pipeline.Pipeline` for the arguments (``tile_bytes`` defaults to the
        window's tile size, else an automatic choice; ``out`` receives the whole ref;
        ``zero_copy`` forces or forbids views).
        """
        return Pipeline(self, check_ref(ref, "ref").spec, tile_bytes=tile_bytes, depth=depth,
                        wait_ready=wait_ready, timeout=timeout, zero_copy=zero_copy, out=out, lease=lease)

    def publish_state_dict(self, state_dict: Any, *, name: str | None = None, slots: int = 2,
                           align: int = 64, bucket_bytes: int = 64 << 20, write_guard: str | None = None,
                           replace: bool = False, delta_history: int = 4):
        """Publish a mapping of named tensors (``model.state_dict()``, torch or numpy) as one
        versioned window; returns its :class:`memsem.StateDictRef`.

        What it costs: the tensors are **copied** into one window memsem allocates (a layout
        header, then every tensor at an ``align`` boundary), in the segment directory
        (``/dev/shm``): ``slots`` times the state dict's bytes (twice with the default
        ``slots=2``), plus one copy of every tensor now and at each ``update``. The in-place
        form: publish with ``slots=1`` and make the model's parameters the window's own
        tensors (``ref.tensors()``), changed inside ``ref.write_section()``: one copy of the
        model, no copy per step (readers wait while a section is open).

        Args:
            state_dict: name -> C-contiguous CPU tensor/array of any dtype memsem supports
                (bf16, fp8...), 0-d and empty ones included. Its values are copied into version
                1 of the window (the owner publishes later values with ``ref.update(sd)`` or
                ``ref.write_section()``).
            name: window name, for ``lookup_state_dict`` in any process of the job (one owner:
                see ``publish``; ``replace`` takes it over).
            slots: 2 (default): double-buffered, readers of version v are never blocked while
                v+1 is written; 1: one slot in a shared segment (readers wait while a section
                is open).
            align: byte alignment of every tensor in the window (a power of two).
            bucket_bytes: the layout's bucket size for ``stream`` (consecutive tensors).
            write_guard: see ``publish`` (``"protect"`` works here: memsem owns the memory).
            delta_history: versions of delta history kept (0: none), so that readers holding
                a version move only what changed (``StateDictRef.load(base=)``, the follower
                loop): after each commit a background thread of this runtime digests the new
                version's tiles and records what changed since the one before (sparse
                patches, changed tiles), off the writer's path. What it costs: that thread's
                CPU (about one read of the window, plus one of the previous version's slot
                for the tiles that changed) and at most ``delta_history`` records in memory,
                each at most a quarter of the state dict's bytes (docs/weight-sync.md).

        One window: one registration per engine, one small ref (``to_bytes``: tens of bytes),
        the layout (names, shapes, dtypes, offsets, alignment, buckets) carried once, in the
        window's header.

        Raises:
            ValueError / TypeError: an empty mapping, a non-str key, a tensor memsem cannot
            publish (named), a bad align/bucket_bytes/slots.
        """
        return publish_state_dict(self, state_dict, name=name, slots=slots, align=align,
                                  bucket_bytes=bucket_bytes, write_guard=write_guard, replace=replace,
                                  delta_history=delta_history)

    def lookup_state_dict(self, name: str, *, timeout: float = 0.0):
        """The :class:`memsem.StateDictRef` of the state-dict window named ``name`` in this job
        (any process; see ``lookup``, whose ``timeout`` waits for it to appear). Its layout is
        read and checked now."""
        return lookup_state_dict(self, name, timeout=timeout)

    def follow(self, source: Any, *, into: Any = None, timeout: float | None = None, after: int = 0,
               pin: bool = True, pin_ttl: float | None = 10.0, every: bool = False, reader: str | None = None,
               delta: bool = True):
        """Follow the versions of ``source``: an iterator (sync and ``async for``) yielding
        ``(version, tensors)`` for each newer version it loads, ``tensors`` holding exactly
        that version (bit-exact). See :mod:`memsem.sync._follow`.

        Example::

            for version, params in rt.follow("policy", into=model.state_dict(), timeout=60):
                rollout(params)

        Args:
            source: a window name (a state dict's or a tensor's; looked up, waiting for it),
                a ``TensorRef`` / ``StateDictRef``, or a followable object (``version()``,
                ``wait_version(v, timeout)``, ``load(into, version=, timeout=)``: a
                ``memsem.Relay``).
            into: the existing tensors each version is loaded into: a mapping of name to
                tensor for a state dict (``load``'s ``into``), an array / tensor for a tensor
                window (``get``'s ``out``); None: allocated at the first load and reused
                (allocated again after a republish). Needed for a followable source.
            timeout: seconds each step may wait in all (for the name, a commit, a new owner,
                the load), default the runtime's; then ``MemsemTimeoutError``.
            after: yield only versions after this one (0: the latest at once).
            pin: pin each version while it is loaded (a lease at the owner), so a trainer that
                commits every step never overwrites it under the load; the owner waits for the
                pin, at most ``pin_ttl`` seconds. Routes that offer no pins load unpinned.
            every: yield every version in order, each loaded exactly (a stream whose versions
                each carry their own data, whose owner keeps every version readable until the
                follower is done with it); a version gone, a retired window or a dead owner
                are raised, never skipped over. Without it a slow follower skips to the
                latest version (``skipped`` counts them).
            reader: this follower's name in the acknowledgements it records after each load
                (1..48 characters of ``[A-Za-z0-9._-]``; default ``"rank<R>-<n>"``): the
                writer's :meth:`wait_loaded` waits for readers by these names. Use a stable
                name per rollout process (``"rollout-0"``) for lockstep syncs.
            delta: once a state dict's version is loaded into the tensors, load each next one
                as a delta: only what changed since (``StateDictRef.load(base=)``: checked
                against the writer's digests, a full load otherwise); False: in full each time.

        Returns:
            A :class:`memsem.sync._follow.Follower` (``version``, ``generation``, ``loads``,
            ``skipped``, ``recovered``; ``close()``).

        Raises:
            TypeError / ValueError: a bad source, name, timeout, after or pin_ttl (at once);
            the iterator raises as :meth:`memsem.sync._follow.Follower.next`.
        """
        return follow(self, source, into=into, timeout=timeout, after=after, pin=pin, pin_ttl=pin_ttl,
                      every=every, reader=reader, delta=delta)

    def wait_loaded(self, source: Any, version: int, *, readers: Sequence[str] | None = None,
                    n: int | None = None, timeout: float | None = None) -> dict[str, int]:
        """Block until the named ``readers`` (or any ``n`` readers) hold ``version`` of
        ``source``: the writer's side of a lockstep (synchronous RL) sync.

        Each follower of a name records, after every version it loads, which version it holds
        (a directory entry; :mod:`memsem.sync._acks`); this waits on those records (woken by
        the directory, no polling of its own). A record counts for the window's current
        generation only, at or past ``version``; a follower's record stays after it ends (its
        tensors still hold that version) and goes when the follower's runtime closes.

        Example::

            v = sd.update(model.state_dict())
            rt.wait_loaded(sd, v, readers=["rollout-0", "rollout-1"], timeout=60)

        Args:
            source: the window's name, or its ``TensorRef`` / ``StateDictRef`` (named).
            version: the version (>= 1) the readers must hold (or a newer one).
            readers: the reader names to wait for (``follow(..., reader=...)``).
            n: instead of ``readers``: how many readers (any) must hold it.
            timeout: seconds to wait (default the runtime's).

        Returns:
            ``{reader: version held}`` of the readers waited for (all of ``readers``; for
            ``n``, every reader holding the version, at least ``n``).

        Raises:
            MemsemTimeoutError: not reached within ``timeout``; the message names each reader
                that does not hold the version and the version it holds (or that it loaded none).
            ValueError / TypeError: both or neither of ``readers`` and ``n``, a bad reader name,
                version < 1, an unnamed ref. NotSupportedError: the directory stores no entries.
            MemsemTimeoutError: ``source`` is a name that is not published (the lookup's wait).
            RuntimeClosedError: the runtime is closed.
        """
        return wait_loaded(self, source, version, readers=readers, n=n, timeout=timeout)

    def publish_fields(self, fields: dict[str, Any], *, tile_rows: int | dict[str, int] | None = None,
                       name: str | None = None, access: str = "rw", replace: bool = False):
        """Publish a batch of named fields (an RL sample batch) as a FieldSet.

        See :meth:`memsem.refs.FieldSet.publish` (``replace=True`` to publish a set of a name
        again).
        """
        return FieldSet.publish(self, fields, tile_rows=tile_rows, name=name, access=access, replace=replace)


set_runtime_class(Runtime)  # the default runtime is one (the layers below never import this one)

__all__ = ["Runtime", "default_runtime"]
