"""memsem as a verl checkpoint engine (``verl.checkpoint_engine``, verl 0.9.1).

Select it by config, no patch to verl::

    actor_rollout_ref.rollout.checkpoint_engine.backend=memsem
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=memsem.integrations.verl
    # across nodes nothing more (the ray directory); optional: ...engine_kwargs.memsem.directory=redis://host:6379/0
    # deltas (each sync moves what changed since the last one): ...engine_kwargs.memsem.delta=true

How the refs travel: through verl's own metadata channel, no name lookup and no job secret.
verl calls ``prepare()`` on every worker before each sync, hands the results to
``build_topology()`` and passes what that returns to each worker's ``init_process_group()``:

* the master actor (verl makes actor rank 0's engine with ``is_master=True``) publishes the
  **bucket window** in ``prepare()`` and returns its serialized ref;
* every other engine (the rollouts, and actors that send nothing) publishes its **status
  window** in ``prepare()`` and returns its ref: three ready words (0 and 1: "done with what
  bucket slot 0 / 1 holds", 2: "failed") and a message area;
* ``build_topology`` gives every rollout the master's ref and the master the rollouts' refs,
  in rank order.

A ref carries its window's access key (it is a capability, like an rkey), so the directory holds
only the windows' records: the backend works on any directory, ``redis://`` across nodes, with no
``MEMSEM_JOB_SECRET`` and nothing passed by hand.

How it moves weights (bucketed, double-buffered, versions checked; ``fanout="chain"`` by
default: the trainer sends each bucket once, to rollout 1, and rollout k re-serves it to rollout
k + 1 from a double-buffered bucket window of its own, receiving each bucket straight into the
slot the next rollout reads, bucket by bucket, so the last rollout holds bucket b a few bucket
times after the first; ``fanout="star"``: every rollout reads every bucket from the trainer):

* The trainer writes bucket b as version ``FIRST_BUCKET_VERSION + b`` of its double-buffered
  window, inside a write section (a rollout never reads a half-filled bucket), in the slot of
  that version, which the rollouts are not reading.
* A rollout marks both slot words of its status window when it joins, and the word of slot s
  again once it has copied the bucket out of slot s. Before the trainer writes a bucket into
  slot s it waits for word s of every rollout it sends to (all of them in a star, rollout 1 in
  a chain), then clears them and looks at their "failed" words once more (a rollout that
  leaves between the look and the clear marks "failed" first: its failure is never cleared
  away with the slot word); a relaying rollout does the same with the rollout after it before
  it receives the next bucket into its own slot s: every writer is at most two buckets ahead of
  its slowest reader and never overwrites a bucket someone still needs. A relay publishes its
  bucket window in ``init_process_group`` and puts its ref into its status window
  (``W_RELAY``), where the rollout after it finds it.
* A rollout takes the window's versions one by one: each bucket is exactly the next version,
  waited for on the window's latest-version word (``wait_version_async``), then read at that
  version (a gone version raises ``StaleReferenceError`` naming both): its header and
  metadata, then as many data bytes as the header names (a last bucket half full, or a delta
  bucket, moves only those), into one of two local buffers while the previous bucket's
  tensors are being consumed; it checks the bucket's index and step.
* Every bucket is checked end to end: the trainer writes its ``sha256`` digest (of the header,
  the metadata and the data bytes) into entry b of its **digest window** (published in
  ``prepare()`` beside the bucket window, its ref in the master's metadata) before it commits
  bucket b, and every rollout, having copied bucket b from whoever serves it, reads entry b
  from the trainer itself (32 bytes, never through a relay) and compares before it yields a
  tensor or re-serves the bucket: a relay that passes on wrong bytes is named in a
  ``DigestMismatchError`` and nothing of the bucket is accepted (the sync then ends as below).
  So is a bucket whose header is wrong (not a bucket, another bucket than its version's, such
  as an older one re-served whole, sizes or offsets that do not fit): every kind of wrong bucket
  names who served it.
* Each tensor chunk lies in the bucket's data area (at ``meta_bytes``, a multiple of
  ``DATA_ALIGN``) at an offset that is a multiple of its dtype's size, so every rollout's view
  of it is aligned whatever the sizes of the tensors before it.
* Awaiting a rollout's word is a memsem wait on that rollout's window, so a rollout that dies
  is reported by memsem's liveness (its process on the same node; its connection and heartbeat
  across nodes) as ``PeerLostError`` naming the rollout, within the library's liveness bound,
  not after ``timeout``. A rollout whose receive fails (or whose consumer stops) writes the
  error into its status window and marks "failed" and both slot words: the trainer raises it at
  once, naming the rollout (``PeerLostError``: the rollout left the sync). In a chain the
  rollout before it raises it the same way and leaves the sync in turn, passing the message on,
  so the trainer's error names the first rollout on the way and every one after it up to the
  one that died or failed; a relay that leaves retires its bucket window, so the rollouts after
  it stop at once too.

With ``delta=True`` (the master's choice) the trainer and every rollout keep the last sync's
buckets in host memory, and a bucket whose layout did not change goes as a delta against them
(``memsem.integrations._verl_delta``: the changed elements of each tile, or the tile whole, and
the digest of every new tile): checked as sent by its sha256 as above, then patched into the
rollout's copy and checked tile by tile; a copy that does not check is read whole from the
trainer's copy (its store window, published for the sync). Deltas are sent only when every
rollout completed the trainer's last sync.

Errors are exceptions (``memsem.MemsemError`` subclasses, ``MemsemTimeoutError``), never an
``exit``. Every wait is bounded by ``timeout``. Same node: route host/shm; across nodes the
windows are reached through memsem's remote routes (tcp, rdma), on the ``ray`` directory that
memsem opens inside a Ray job by itself (verl's workers are Ray actors: nothing to set), or on a
``redis://`` directory named by ``directory``.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import struct
from collections.abc import AsyncGenerator, Generator
from typing import Any

import numpy as np
import torch
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    split_weight_chunks,
)

import memsem
from memsem.integrations import _verl_delta as vd
from memsem.integrations._verl_rollout import RolloutSide
from memsem.integrations._verl_wire import (
    DATA_ALIGN,
    DIGEST,
    DIGEST_SIZE,
    FANOUTS,
    FIRST_BUCKET_VERSION,
    HEAD,
    HEAD_PROBE,
    KIND_DELTA,
    KIND_FULL,
    MAGIC,
    MAX_BUCKETS,
    RELAY_AT,
    STATUS_BYTES,
    W_FAILED,
    W_RELAY,
    W_SLOT0,
    W_SLOT1,
    bucket_digest,
    chunk_tiles,
    failure_message,
    itemsize_of,
    rollout_label,
)


@CheckpointEngineRegistry.register("memsem")
class MemsemCheckpointEngine(RolloutSide, CheckpointEngine):
    """verl checkpoint engine over memsem windows (see the module docstring).

    Args:
        bucket_size: bytes of one bucket (verl's ``update_weights_bucket_megabytes``); the
            trainer's window holds two (double buffering), and so does each relaying rollout's
            (chain), the last rollout (or every rollout of a star) two local buffers.
        device: where received tensors live ("cpu"; a GPU rollout copies them on).
        rollout_dtype: kept for verl's signature (tensors travel in their own dtype).
        is_master: True on the actor that sends (verl passes ``rank == 0``): its ``prepare``
            publishes the bucket window, whose ref travels to the rollouts in verl's metadata.
        directory: memsem directory URL (default: ``MEMSEM_DIRECTORY``, else ``ray`` inside a Ray
            job, as verl's workers are, else ``local``; ``redis://host:port/db``: a Redis server).
        timeout: bound in seconds of every wait (joins, buckets, write sections).
        meta_bytes: bytes reserved per slot for the bucket's metadata.
        fanout: "chain" (default: the trainer's link carries each bucket once; every rollout
            but the last re-serves it to the next from a double-buffered bucket window of its
            own, bucket by bucket) or "star" (every rollout reads every bucket from the
            trainer). The master's choice holds for the sync.
        delta: keep the bytes of the last sync's buckets in host memory (the trainer and every
            rollout: about the model's bytes each, beside the buckets) and send a bucket whose
            layout did not change as a delta against them (``memsem.integrations._verl_delta``):
            the changed elements of each 64 KiB tile, or the tile whole, with the digest of
            every tile; each rollout patches its copy, checks every tile, and yields views of
            it (valid until the next sync). Used for a sync only when every rollout holds the
            trainer's last sync (a new or restarted rollout makes that sync full for all); a
            bucket whose delta would be more than half its bytes goes in full. A rollout whose
            copy does not check (a consumer wrote into a yielded tensor) reads that bucket whole
            from the trainer's copy (``metrics["memsem/fallbacks"]``): never a mix. The
            master's choice holds for the sync. Default False (host memory).
    """

    def __init__(self, bucket_size: int, device: str = "cpu", rollout_dtype: torch.dtype = torch.bfloat16,
                 is_master: bool = False, directory: str | None = None, timeout: float = 300.0,
                 meta_bytes: int = 1 << 20, fanout: str = "chain", delta: bool = False) -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"bucket_size must be an int > 0 (bytes), got {bucket_size!r}")
        if fanout not in FANOUTS:
            raise ValueError(f"fanout must be one of {FANOUTS}, got {fanout!r}")
        if (isinstance(meta_bytes, bool) or not isinstance(meta_bytes, int) or meta_bytes <= HEAD.size
                or meta_bytes % DATA_ALIGN):
            raise ValueError(f"meta_bytes must be an int > {HEAD.size} and a multiple of {DATA_ALIGN} (bytes: the "
                             f"data area of a slot starts there, aligned for every dtype), got {meta_bytes!r}")
        if not isinstance(delta, bool):
            raise ValueError(f"delta must be a bool, got {delta!r}")
        self.fanout = fanout
        self.delta = delta
        self.bucket_size = bucket_size
        self.device = device
        self.rollout_dtype = rollout_dtype
        self.is_master = bool(is_master)
        self.directory = directory
        self.timeout = float(timeout)
        self.meta_bytes = int(meta_bytes)
        self._rt: memsem.Runtime | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self._window: Any = None  # the bucket window (published on the master, a ref elsewhere)
        self._digests: Any = None  # the master's digest window (published there, a ref on rollouts)
        self._source_label = "the trainer"  # who serves this rollout its buckets
        self._status: Any = None  # this engine's status window (not on the master)
        #: (status ref, label) of the rollouts this engine sends to: the master's (every rollout
        #: in a star, rollout 1 in a chain), a relay's (the next rollout in the chain)
        self._rollouts: list[tuple[Any, str]] = []
        self._everyone: list[tuple[Any, str]] = []  # the master's: every rollout (the final wait)
        self._relay: Any = None  # a relaying rollout's own bucket window
        self._upstream: tuple[Any, str] | None = None  # a chained rollout's upstream: (status ref, label)
        self._token = ""
        #: delta: the last completed sync's buckets (``_verl_delta.BucketStore``), the trainer's
        #: copy published for the sync (its window on the trainer, a ref on rollouts), whether
        #: this sync sends deltas (the master: every rollout holds its last sync), the master's
        #: token of this sync (rollouts), the trainer's bucket being filled
        self._store: vd.BucketStore | None = None
        self._store_win: Any = None
        self._delta_now = False
        self._keep = False  # a rollout: keep this sync's buckets (the master sends deltas)
        self._sync_token: str | None = None
        self._cur: np.ndarray | None = None
        #: per-sync figures of the last send (verl merges the trainer's into its metrics)
        self.metrics: dict[str, float] = {}

    @property
    def runtime(self) -> memsem.Runtime:
        if self._rt is None or self._rt.closed:
            self._rt = memsem.Runtime(directory=self.directory, timeout=self.timeout)
        return self._rt

    # -- verl's setup calls -----------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Publish this sync's window (the master: the bucket window; others: a status window)
        and return its serialized ref with this process's identity: the metadata verl hands to
        ``build_topology``."""
        self._drop_windows()
        self._token = secrets.token_hex(8)
        rt = self.runtime
        out: dict[str, Any] = {"token": self._token, "pid": os.getpid(), "node": memsem.native.node_id(),
                               "rank": rt.rank}
        if self.is_master:
            cap = self.meta_bytes + self.bucket_size
            self._window = rt.publish(np.zeros(cap, np.uint8), slots=2)
            self._digests = rt.publish(np.zeros(MAX_BUCKETS * DIGEST_SIZE, np.uint8), access="r")
            out["window"] = self._window.to_bytes().hex()
            out["digests"] = self._digests.to_bytes().hex()
            out["fanout"] = self.fanout
            out["delta"] = self.delta
            st = self._store
            if self.delta and st is not None and st.token is not None and st.flat is not None:
                # the trainer's copy of the last sync, changed in place bucket by bucket as this
                # sync sends them: a rollout whose own copy does not check reads a bucket here
                self._store_win = rt.publish(st.flat, access="r")
                out["store"] = self._store_win.to_bytes().hex()
                out["base"] = st.token
        else:
            st = self._store
            out["base"] = st.token if st is not None else None
            # (a relay's bucket window is published in init_process_group, once this engine
            # knows it is a rollout with a rollout after it: no other engine pays for one)
            self._status = rt.publish(np.zeros(STATUS_BYTES, np.uint8), tiles=4, access="rw")
            out["status"] = self._status.to_bytes().hex()
        return out

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """One trainer (rank 0: the first actor, the master) and the rollouts (ranks 1..N);
        other actors are rank -1 and send nothing. Every rollout gets the master's metadata (the
        bucket window), the master every rollout's (their status windows: in a chain it writes
        for rollout 1 and waits for all of them at the end). Chain (the master's ``fanout``):
        rollout k also gets rollout k + 1's (``rollouts``) and rollout k - 1's (``upstream``).

        Raises:
            ValueError: the first actor's metadata has no bucket window (its engine was not made
                with ``is_master=True``), or the metadata are not this backend's.
        """
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(f"expected {actor_wg_world_size} + {rollout_world_size} prepare() results, "
                             f"got {len(metadata)}")
        master = metadata[0]
        if not isinstance(master, dict) or not isinstance(master.get("window"), str):
            raise ValueError("the first actor's prepare() published no bucket window: make the sending actor's "
                             "memsem engine with is_master=True (verl's actor workers pass is_master=(rank == 0))")
        rollouts = list(metadata[actor_wg_world_size:])
        for i, md in enumerate(rollouts, 1):
            if not isinstance(md, dict) or not isinstance(md.get("status"), str):
                raise ValueError(f"rollout {i}'s prepare() result is not a memsem status window: {md!r:.200}")
        world = rollout_world_size + 1
        chain = master.get("fanout", "star") == "chain"
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master_metadata": [master] * actor_wg_world_size,
                 "rollouts": [rollouts] + [None] * (actor_wg_world_size - 1)}
        # chain: rollout k reads from rollout k - 1 (rollout 1 from the trainer) and sends to k + 1
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master_metadata": [master] * rollout_world_size,
                   "rollouts": [[rollouts[k + 1]] if chain and k + 1 < len(rollouts) else None
                                for k in range(len(rollouts))],
                   "upstream": [rollouts[k - 1] if chain and k > 0 else None for k in range(len(rollouts))]}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any],
                           rollouts: list[dict[str, Any]] | None = None,
                           upstream: dict[str, Any] | None = None) -> None:
        """Rank 0 (the master) resolves the status windows of the rollouts it sends to;
        rollouts resolve the bucket window from the master's ref. In a chain, a rollout with a
        rollout after it (``rollouts``: that one) publishes its own bucket window and puts its
        ref into its status window (``W_RELAY``); a rollout after the first reads the buckets
        from ``upstream``'s window, found through ``upstream``'s status window.

        Raises:
            ValueError: metadata that are not ``build_topology``'s.
        """
        if not isinstance(master_metadata, dict) or not isinstance(master_metadata.get("window"), str):
            raise ValueError(f"master_metadata must be the master's prepare() result, got {master_metadata!r:.200}")
        self.rank, self.world_size = int(rank), int(world_size)
        rt = self.runtime
        if self.rank == 0:
            if self._window is None:
                raise ValueError("rank 0 sends, but this engine published no bucket window in prepare(): "
                                 "make it with is_master=True")
            if not isinstance(rollouts, list) or len(rollouts) != self.world_size - 1:
                raise ValueError(f"rank 0 needs the metadata of its {self.world_size - 1} rollouts, got {rollouts!r:.200}")
            self._everyone = [(rt.ref(bytes.fromhex(md["status"])), rollout_label(i, md)) for i, md in enumerate(rollouts, 1)]
            self._rollouts = self._everyone[:1] if self.fanout == "chain" else list(self._everyone)
            base = self._store.token if self._store is not None else None
            self._delta_now = (self.delta and self._store_win is not None and base is not None
                               and all(md.get("base") == base for md in rollouts))
        elif self.rank > 0:
            if not isinstance(master_metadata.get("digests"), str):
                raise ValueError("master_metadata has no digest window: the trainer runs another version of this backend")
            self._window = rt.ref(bytes.fromhex(master_metadata["window"]))
            self._digests = rt.ref(bytes.fromhex(master_metadata["digests"]))
            # the master's choice: keep this sync's buckets for the next one's deltas
            self._keep = bool(master_metadata.get("delta"))
            self._sync_token = str(master_metadata.get("token"))
            store = master_metadata.get("store")
            self._store_win = rt.ref(bytes.fromhex(store)) if isinstance(store, str) else None
            self._source_label = f"the trainer (pid {master_metadata.get('pid')} on {master_metadata.get('node')!r})"
            if upstream is not None:
                self._upstream = (rt.ref(bytes.fromhex(upstream["status"])), rollout_label(self.rank - 1, upstream))
                self._source_label = self._upstream[1]
            if rollouts:
                md = rollouts[0]
                self._rollouts = [(rt.ref(bytes.fromhex(md["status"])), rollout_label(self.rank + 1, md))]
                cap = self.meta_bytes + self.bucket_size
                self._relay = rt.publish(np.zeros(cap, np.uint8), slots=2)
                ref = self._relay.to_bytes()
                with rt.write_section(self._status, timeout=self.timeout) as sec:
                    sec.array()[RELAY_AT:RELAY_AT + 4 + len(ref)] = np.frombuffer(struct.pack("<I", len(ref)) + ref,
                                                                                  np.uint8)
                self._status.mark_ready(W_RELAY)

    def finalize(self) -> None:
        """Unpublish this sync's window (waiting, within ``timeout``, for copies still running)."""
        self._drop_windows()
        self.rank = self.world_size = None

    def _drop_windows(self) -> None:
        rt = self._rt
        first: BaseException | None = None
        for ref, owned in ((self._window, self.is_master), (self._digests, self.is_master), (self._relay, True),
                           (self._status, True), (self._store_win, self.is_master)):
            if ref is not None and owned and rt is not None and not rt.closed:
                try:
                    rt.unpublish(ref, timeout=self.timeout)
                except memsem.MemsemError as exc:  # the others are retired all the same
                    first = first or exc
        self._window = self._digests = self._status = self._relay = self._upstream = self._store_win = None
        self._rollouts, self._everyone = [], []
        if first is not None:
            raise first

    def close(self) -> None:
        if self._rt is not None:
            self._rt.close()
            self._rt = None
        self._window = self._digests = self._status = self._relay = self._upstream = self._store_win = None
        self._store = self._cur = None
        self._rollouts, self._everyone = [], []

    # -- trainer ----------------------------------------------------------------------------------
    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Send every (name, tensor) bucket by bucket; returns per-sync figures.

        Raises:
            PeerLostError: a rollout died or failed (named, with its error).
            MemsemTimeoutError: a rollout did not join or finish a bucket within ``timeout``.
        """
        if self.rank is None:
            raise RuntimeError("init_process_group() must run before send_weights()")
        if self.rank < 0:
            async for _ in _aiter(weights):
                pass
            return {}
        if self.rank != 0:
            raise RuntimeError(f"only the trainer (rank 0) sends weights; this is rank {self.rank}")
        rt = self.runtime
        core = rt
        loop = asyncio.get_running_loop()
        step = -1 if global_steps is None else int(global_steps)
        buckets = 0
        # delta: the chunks go into ``_cur``, each bucket then into its slot (a delta or whole)
        # and into the store, in place where its layout held (``_keep_bucket``)
        builder = vd.StoreBuilder(self._store) if self.delta else None
        if builder is not None and (self._cur is None or self._cur.nbytes != self.bucket_size):
            self._cur = np.empty(self.bucket_size, np.uint8)
        sent = [0, 0, 0]  # delta buckets, data bytes sent, data bytes of the buckets
        self.metrics = {}  # (a sync that fails leaves none)
        blocked = await self._await_slot(loop, 0)
        sec = await core.submit("open bucket", lambda: rt.write_section(self._window, copy=False,
                                                                        timeout=self.timeout))
        meta: list[list[Any]] = []
        offset = 0
        data = None
        try:
            async for tm, chunk in split_weight_chunks(weights, self.bucket_size):
                entry = [tm.name, str(tm.dtype), list(tm.shape), tm.chunk_offset, tm.chunk_size, 0]
                size = itemsize_of(tm.dtype)
                at = -(-offset // size) * size  # the chunk's data offset: a multiple of its dtype's size
                if meta and (at + tm.chunk_size > self.bucket_size or self._meta_len(meta + [entry]) > self.meta_bytes):
                    await self._seal(sec, buckets, False, step, meta, offset, builder, sent)
                    blocked += sec.blocked_s
                    sec.commit()
                    buckets += 1
                    blocked += await self._await_slot(loop, buckets)
                    sec = await core.submit("open bucket", lambda: rt.write_section(self._window, copy=False,
                                                                                    timeout=self.timeout))
                    meta, offset, at = [], 0, 0
                data = torch.from_numpy(self._cur if builder is not None else sec.array()[self.meta_bytes:])
                entry[5] = at
                data[at:at + tm.chunk_size].copy_(chunk.reshape(-1).view(torch.uint8).cpu())
                meta.append(entry)
                offset = at + tm.chunk_size
            await self._seal(sec, buckets, True, step, meta, offset, builder, sent)
            blocked += sec.blocked_s
            sec.commit()
            buckets += 1
        except BaseException:
            sec.abort()
            raise
        await self._await_done(loop, buckets - 1)
        if builder is not None:  # every rollout holds this sync: the next one's base
            self._store = builder.finish(self._token, flat=True)
        self.metrics = {"memsem/buckets": float(buckets), "memsem/trainer_blocked_s": blocked,
                        "memsem/trainer_readers": float(len(self._rollouts)),
                        "memsem/delta_buckets": float(sent[0]), "memsem/sent_bytes": float(sent[1]),
                        "memsem/bucket_bytes": float(sent[2])}
        return dict(self.metrics)

    def _meta_len(self, meta: list) -> int:
        return HEAD.size + len(json.dumps(meta, separators=(",", ":")))

    async def _seal(self, sec: Any, index: int, last: bool, step: int, meta: list, used: int,
                    builder: vd.StoreBuilder | None, sent: list[int]) -> None:
        """Write bucket ``index``'s header and metadata (with ``builder``, the delta mode: its
        ``used`` data bytes from ``_cur`` into the slot, a delta or whole, see ``_keep_bucket``),
        then its digest (over the header, the metadata and the data bytes sent) into entry
        ``index`` of the digest window, before the caller commits the bucket. Counts into
        ``sent``: delta buckets, data bytes sent, data bytes of the buckets.

        Raises:
            MemsemError: more than ``MAX_BUCKETS`` buckets in one sync.
        """
        if index >= MAX_BUCKETS:
            raise memsem.MemsemError(f"a sync of more than {MAX_BUCKETS} buckets: raise the bucket size "
                                     f"(update_weights_bucket_megabytes; {self.bucket_size} bytes now)")
        body = json.dumps(meta, separators=(",", ":")).encode()
        arr = sec.array()
        rt, at = self.runtime, index * DIGEST_SIZE

        def put() -> None:
            kind, wire, store_at = KIND_FULL, used, 0
            if builder is not None:
                kind, wire, store_at = self._keep_bucket(builder, index, body, meta, used, arr[self.meta_bytes:])
            head = HEAD.pack(MAGIC, index, 1 if last else 0, step, len(body), kind, wire, store_at)
            arr[:HEAD.size] = np.frombuffer(head, np.uint8)
            arr[HEAD.size:HEAD.size + len(body)] = np.frombuffer(body, np.uint8)
            d = bucket_digest(arr, HEAD.size + len(body), self.meta_bytes, wire)
            with rt.write_section(self._digests, copy=False, timeout=self.timeout) as ds:
                ds.array()[at:at + DIGEST_SIZE] = np.frombuffer(d, np.uint8)
            sent[0] += kind == KIND_DELTA
            sent[1] += wire
            sent[2] += used

        await rt.submit(f"digest of bucket {index}", put)

    def _keep_bucket(self, builder: vd.StoreBuilder, index: int, body: bytes, meta: list, used: int,
                     out: np.ndarray) -> tuple[int, int, int]:
        """The trainer's bucket ``index`` (its ``used`` bytes in ``_cur``) into the slot's data
        area ``out``: a delta against the last sync's bucket of the same layout when this sync
        sends deltas and it pays, else whole; and into the store (in place where the layout
        held: the store window, where rollouts whose copy does not check read it). Blocking.
        Returns the header's kind, data bytes sent and offset in the store window."""
        new = self._cur[:used]
        st = builder.old
        old = st.part(index, body)
        if old is None or old.nbytes != used:
            out[:used] = new
            builder.add(body, new.copy(), None)
            return KIND_FULL, used, 0
        kind, wire, digests = KIND_FULL, used, None
        if self._delta_now:
            got, digests = vd.encode(vd.BucketTiles.of(chunk_tiles(meta)), new, old, st.digests[index], out)
            if got is not None:
                kind, wire = KIND_DELTA, got
        if kind == KIND_FULL:
            out[:used] = new
        at = st.offsets[index]
        # (the store window, published for the sync, is written outside a write section, so a
        # rollout's fallback read of an earlier bucket is never retried for it: each bucket's
        # range is written once per sync, before its bucket is committed, and read only after,
        # by rollouts that check every tile of it against the delta's digests)
        old[:] = new
        builder.add(body, old, digests)
        return kind, wire, at

    async def _await_slot(self, loop: asyncio.AbstractEventLoop, bucket: int) -> float:
        """Before bucket ``bucket`` is written: every rollout is done with what its slot holds
        (its status word of that slot is marked), then the words are cleared. Returns the
        seconds waited (joining is not counted as blocking).

        Raises:
            PeerLostError: a rollout died while awaited, or reported a failure.
            MemsemTimeoutError: a rollout's word was not marked within ``timeout``.
        """
        core = self.runtime
        slot = (FIRST_BUCKET_VERSION + bucket) % 2
        what = "join" if bucket < 2 else f"finish copying bucket {bucket - 2}"
        t0 = loop.time()
        await self._await_words(loop, self._rollouts, slot, what, f" (bucket slot {slot})")
        left = await core.submit("clear slot words", lambda: self._clear_words(slot))
        if left is not None:
            await self._left(left[0], left[1], what)
        return loop.time() - t0 if bucket >= 2 else 0.0

    def _clear_words(self, slot: int) -> tuple[Any, str] | None:
        """Clear word ``slot`` of every rollout this engine sends to, then look at their
        "failed" words again: returns the first rollout that failed, else None. Blocking.

        A rollout that leaves marks "failed" before its slot words, so a clear that erased the
        slot mark of a failure (marked between the wait's look and this clear) comes after its
        "failed" mark, which the look after the clear sees: the failure is never lost with the
        word (the final wait, on that very word, would otherwise wait out its timeout).
        """
        core = self.runtime
        for st, _ in self._rollouts:
            core.readiness.clear(st.spec, slot)
        for st, label in self._rollouts:
            if st.is_ready(W_FAILED):
                return st, label
        return None

    async def _left(self, status: Any, label: str, what: str) -> None:
        """Raise that ``label`` (its status window ``status``) left the sync, with its message.

        Raises:
            PeerLostError: always.
        """
        raw = await self.runtime.submit(f"{label}: its error", status.get)
        raise memsem.PeerLostError(f"{label} left the sync before it could {what}: {failure_message(raw)}")

    async def _await_done(self, loop: asyncio.AbstractEventLoop, last: int) -> None:
        """After the last bucket (index ``last``): every rollout has copied it (its word of that
        slot is marked again), so ``send_weights`` returns when the version is everywhere, and a
        rollout that left during the last buckets (or anywhere down a chain) is reported.

        Raises:
            PeerLostError: a rollout died or left the sync (named, with its error).
            MemsemTimeoutError: a rollout did not copy the last bucket within ``timeout``.
        """
        await self._await_words(loop, self._everyone, (FIRST_BUCKET_VERSION + last) % 2,
                                f"copy the last bucket ({last})")

    async def _await_words(self, loop: asyncio.AbstractEventLoop, rollouts: list[tuple[Any, str]], slot: int,
                           what: str, where: str = "") -> None:
        """Wait, within one ``timeout``, for the word of ``slot`` of each of ``rollouts``.

        Raises:
            PeerLostError: a rollout died while awaited, or marked "failed" (named, with its message).
            MemsemTimeoutError: a rollout's word was not marked within ``timeout``.
        """
        core = self.runtime
        deadline = loop.time() + self.timeout
        for status, label in rollouts:
            left = max(0.0, deadline - loop.time())
            try:
                failed = await core.submit(f"{label}: {what}", lambda st=status, t=left: _await_word(st, slot, t))
            except memsem.PeerLostError as exc:
                raise memsem.PeerLostError(f"{label} died before it could {what}{where}: {exc}") from exc
            except memsem.MemsemTimeoutError as exc:
                raise memsem.MemsemTimeoutError(f"{label} did not {what} within {self.timeout:g} s",
                                                what=label, timeout=self.timeout) from exc
            if failed:
                await self._left(status, label, what)

def _await_word(status: Any, slot: int, timeout: float) -> bool:
    """Block until a rollout's word of ``slot`` is marked (memsem's wait: PeerLostError when the
    rollout dies); True when the rollout also marked "failed"."""
    status.wait_tile(slot, timeout=timeout)
    return status.is_ready(W_FAILED)


async def _aiter(weights: Any) -> AsyncGenerator[Any, None]:
    if hasattr(weights, "__aiter__"):
        async for x in weights:
            yield x
    else:
        for x in weights:
            yield x


__all__ = ["MemsemCheckpointEngine", "DATA_ALIGN", "DIGEST", "DIGEST_SIZE", "FANOUTS", "FIRST_BUCKET_VERSION",
           "HEAD_PROBE", "KIND_DELTA", "KIND_FULL", "MAX_BUCKETS", "RELAY_AT", "STATUS_BYTES", "W_FAILED", "W_RELAY",
           "W_SLOT0", "W_SLOT1"]
