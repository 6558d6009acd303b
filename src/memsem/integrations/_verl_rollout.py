"""The rollouts' side of the verl backend (``memsem.integrations.verl``, whose module docstring
says how a sync goes): waiting for each bucket, reading exactly its version, checking it against
the trainer's digest, re-serving it down a chain, keeping it for the next sync's deltas, and
reporting a failure to whoever sends to this rollout."""
from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import torch
from verl.checkpoint_engine.base import TensorMeta, merge_weight_chunks

import memsem
from memsem.integrations import _verl_delta as vd
from memsem.integrations._verl_wire import (
    HEAD,
    MAGIC,
    DIGEST,
    DIGEST_SIZE,
    FIRST_BUCKET_VERSION,
    HEAD_PROBE,
    KIND_DELTA,
    KIND_FULL,
    RELAY_AT,
    STATUS_BYTES,
    W_FAILED,
    W_RELAY,
    W_SLOT0,
    W_SLOT1,
    chunk_tiles,
    bucket_digest,
    dtype_of,
    failure_message,
    itemsize_of,
)


class RolloutSide:
    """The rollout's methods of ``MemsemCheckpointEngine`` (its state is made there)."""

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield (name, tensor) of every weight; a tensor is valid until the bucket after the
        next one arrives (copy it, as verl's loaders do). A failure here, or a consumer that
        stops before the last weight, is reported to the trainer (see the module docstring)."""
        if self.rank is None or self.rank < 1 or self._window is None or self._status is None:
            raise RuntimeError("receive_weights() runs on rollout ranks (>= 1) after prepare() and init_process_group()")
        try:
            async for name, weight in merge_weight_chunks(self._chunks(global_steps), self.bucket_size):
                yield name, weight.to(self.device) if self.device != "cpu" else weight
        except GeneratorExit:
            self._report_failure("it stopped receiving before the last weight (its consumer closed the stream)")
            raise
        except BaseException as exc:
            self._report_failure(f"it failed: {type(exc).__name__}: {exc}")
            raise

    def _check_bucket(self, win: Any, buf: np.ndarray, got: int, version: int,
                      global_steps: int | None) -> dict[str, Any]:
        """The header of the bucket in ``buf`` (exactly version ``version`` of ``win``), checked.

        Raises:
            DigestMismatchError: whatever is wrong with it (not a bucket, another bucket than
                this version's, sizes or offsets that do not fit, a relay's bucket of another
                step), naming who served it (``relay``: the trainer, or the rollout before this
                one in a chain), like a bucket whose bytes do not match the trainer's digest.
            MemsemError: the trainer's own bucket is of another step than ``global_steps``.
        """
        want = version - FIRST_BUCKET_VERSION

        def wrong(why: str) -> memsem.DigestMismatchError:
            return memsem.DigestMismatchError(
                f"bucket {want} (version {version}) from {win.spec.label}: {why}: {self._source_label} served a "
                "wrong bucket (none of it was accepted)", relay=self._source_label, version=version, chunk=want)

        magic, index, last, step, mlen, kind, wire, store_at = HEAD.unpack(buf[:HEAD.size].tobytes())
        if got != version or magic != MAGIC or mlen > self.meta_bytes - HEAD.size:
            raise wrong(f"version {got} is not a memsem verl bucket")
        if kind not in (KIND_FULL, KIND_DELTA) or wire > self.bucket_size:
            raise wrong(f"its header claims kind {kind} and {wire} bytes of a {self.bucket_size}-byte bucket")
        try:
            meta = json.loads(buf[HEAD.size:HEAD.size + mlen].tobytes())
            used = max((int(e[5]) + int(e[4]) for e in meta), default=0)
            misaligned = [e[0] for e in meta if int(e[5]) % itemsize_of(dtype_of(e[1]))]
        except (ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
            raise wrong(f"its metadata is malformed ({type(exc).__name__})") from None
        if used > self.bucket_size:
            raise wrong(f"it claims {used} bytes of a {self.bucket_size}-byte bucket")
        if kind == KIND_FULL and wire != used:
            raise wrong(f"a whole bucket of {used} bytes sent as {wire}")
        if misaligned:
            raise wrong(f"tensor {misaligned[0]!r} is not at a multiple of its dtype's size")
        if index != want:
            raise wrong(f"it holds bucket {index}: a bucket out of order")
        if global_steps is not None and step != int(global_steps):
            if self._upstream is None:  # the trainer's own bucket: the sync is of another step
                raise memsem.MemsemError(f"bucket {index} from {self._source_label} is of step {step}, this rollout "
                                         f"expects step {global_steps}")
            raise wrong(f"it is of step {step}, this rollout expects step {global_steps}")
        return {"meta": meta, "last": bool(last), "index": index, "head": HEAD.size + mlen, "used": used,
                "kind": kind, "wire": wire, "store_at": store_at,
                "body": buf[HEAD.size:HEAD.size + mlen].tobytes()}

    def _verify(self, buf: np.ndarray, head: dict[str, Any], version: int) -> None:
        """Bucket ``head["index"]`` in ``buf`` against the trainer's digest of it, read from the
        trainer's digest window (never through a relay). Blocking (a worker thread runs it).

        Raises:
            DigestMismatchError: the bytes are not the trainer's; names who served them.
        """
        index = head["index"]
        want = self._digests.bytes(index * DIGEST_SIZE, DIGEST_SIZE).get().tobytes()
        got = bucket_digest(buf, head["head"], self.meta_bytes, head["wire"], head.get("direct"))
        if got != want:
            raise memsem.DigestMismatchError(
                f"bucket {index} (version {version}) does not match the trainer's {DIGEST} digest: "
                f"{self._source_label} served wrong bytes (none were accepted)",
                relay=self._source_label, version=version, chunk=index)

    def _report_failure(self, why: str) -> None:
        """Tell the trainer (or the rollout before this one in a chain) this rollout leaves the
        sync: the message into the status window, then "failed" and both slot words marked
        (failed first: whoever sees a slot word sees it). A relaying rollout also retires its
        bucket window, so the rollout after it stops at once (its wait meets the retired
        window) instead of waiting out its timeout. Best effort: this rollout's own windows."""
        status, rt = self._status, self._rt
        if status is None or rt is None or rt.closed:
            return
        try:
            with rt.write_section(status, timeout=self.timeout) as sec:
                body = why.encode("utf-8", "replace")[:RELAY_AT - 1] + b"\0"
                sec.array()[:len(body)] = np.frombuffer(body, np.uint8)
            for w in (W_FAILED, W_SLOT0, W_SLOT1, W_RELAY):
                status.mark_ready(w)
        except memsem.MemsemError:
            pass
        relay, self._relay = self._relay, None
        if relay is not None:
            try:
                rt.unpublish(relay, timeout=min(self.timeout, 5.0))
            except memsem.MemsemError:
                pass

    async def _source(self) -> Any:
        """The bucket window this rollout reads: the trainer's, or in a chain its upstream
        rollout's (its ref read from the upstream's status window once ``W_RELAY`` is marked).

        Raises:
            PeerLostError: the upstream rollout died or left the sync (named, with its message).
            MemsemTimeoutError: it published no bucket window within ``timeout``.
        """
        if self._upstream is None:
            return self._window
        status, label = self._upstream
        try:
            await status.wait_tile_async(W_RELAY, timeout=self.timeout)
        except memsem.PeerLostError as exc:
            raise memsem.PeerLostError(f"{label} died before it relayed the buckets: {exc}") from exc
        except memsem.MemsemTimeoutError as exc:
            raise memsem.MemsemTimeoutError(f"{label} published no bucket window to relay within {self.timeout:g} s",
                                            what=label, timeout=self.timeout) from exc
        raw = bytes(await self.runtime.submit(f"{label}: its bucket window", status.get))
        if status.is_ready(W_FAILED):
            raise memsem.PeerLostError(f"{label} left the sync before it relayed the buckets: {failure_message(raw)}")
        (n,) = struct.unpack_from("<I", raw, RELAY_AT)
        if not 0 < n <= STATUS_BYTES - RELAY_AT - 4:
            raise memsem.MemsemError(f"{label}'s status window holds no bucket window ref ({n} bytes)")
        return self.runtime.ref(raw[RELAY_AT + 4:RELAY_AT + 4 + n])

    def _read(self, win: Any, buf: np.ndarray, version: int,
              builder: vd.StoreBuilder | None) -> tuple[int, np.ndarray | None]:
        """Read exactly ``version`` of ``win`` into ``buf``: the header and the metadata, then
        the data bytes the header names (none more: the rest of the slot holds older buckets).
        A header that is not a bucket's reads no further (``_check_bucket`` names it). With
        ``builder``, a whole bucket's data goes into this rollout's copy of that bucket (the
        last sync's of the same metadata, else a new array) instead of ``buf``. Blocking.
        Returns the version read and that copy (None: the data is in ``buf``).

        Raises:
            StaleReferenceError: that version was overwritten or the window retired.
        """
        probe = min(self.meta_bytes, HEAD_PROBE)
        got = win.bytes(0, probe).get(buf[:probe], version=version, with_version=True).version
        magic, index, _, _, mlen, kind, wire, _ = HEAD.unpack(buf[:HEAD.size].tobytes())
        if magic != MAGIC or HEAD.size + mlen > self.meta_bytes or wire > self.bucket_size:
            return got, None
        if HEAD.size + mlen > probe:
            win.bytes(probe, HEAD.size + mlen - probe).get(buf[probe:HEAD.size + mlen], version=version)
        dst, direct = buf[self.meta_bytes:self.meta_bytes + wire], None
        if builder is not None and kind == KIND_FULL and index == version - FIRST_BUCKET_VERSION:
            # (only the copy of this version's own bucket, which no yielded tensor views yet: a
            # header naming another bucket is refused by _check_bucket, its bytes in ``buf``)
            part = builder.old.part(index, buf[HEAD.size:HEAD.size + mlen].tobytes())
            dst = direct = part if part is not None and part.nbytes == wire else np.empty(wire, np.uint8)
        if wire:
            win.bytes(self.meta_bytes, wire).get(dst, version=version)
        return got, direct

    def _take(self, builder: vd.StoreBuilder, head: dict[str, Any], buf: np.ndarray, version: int,
              took: list[int]) -> np.ndarray:
        """This rollout's copy of the bucket in ``buf`` (its bytes already checked against the
        trainer's digest): a whole bucket copied into the last sync's copy of that bucket (the
        same layout) or a new array; a delta applied to that copy, every tile checked, else (the
        copy was not the last sync's bytes) the bucket read whole from the trainer's store window
        and checked again. Blocking. Returns the copy (the bucket's data area).

        Raises:
            DigestMismatchError: the trainer's store window does not hold the bucket's bytes
                either (nothing of the bucket is yielded).
            MemsemError: a delta this rollout cannot read (no store window, malformed).
        """
        used, body, index = head["used"], head["body"], head["index"]
        data = buf[self.meta_bytes:]
        part = builder.old.part(index, body)
        if part is not None and part.nbytes != used:
            part = None
        if head["kind"] == KIND_FULL:
            if head.get("direct") is not None:  # read straight into it
                part = head["direct"]
            else:
                part = part if part is not None else np.empty(used, np.uint8)
                part[:] = data[:used]
            builder.add(body, part, None)
            return part
        tiles = vd.BucketTiles.of(chunk_tiles(head["meta"]))
        try:
            delta = vd.parse(tiles, data[:head["wire"]])
        except ValueError as exc:
            raise memsem.MemsemError(f"bucket {index} (version {version}): the trainer's delta is malformed: "
                                     f"{exc}") from None
        took[0] += 1
        if part is None or vd.apply(self.runtime, tiles, delta, part):
            # not the last sync's bytes here: the trainer's copy, whole
            if self._store_win is None:
                raise memsem.MemsemError(f"bucket {index} (version {version}) is a delta this rollout cannot use, and "
                                         "the trainer published no store window to read it whole")
            part = part if part is not None else np.empty(used, np.uint8)
            took[1] += 1
            took[2] += used
            self._store_win.bytes(head["store_at"], used).get(part)
            if vd.check(self.runtime, tiles, part, delta.digests):
                raise memsem.DigestMismatchError(
                    f"bucket {index} (version {version}): the trainer's store window does not hold the bytes its "
                    "delta's digests name (none of the bucket was accepted)", relay="the trainer", version=version,
                    chunk=index)
        builder.add(body, part, None)
        return part

    async def _chunks(self, global_steps: int | None) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        rt = self.runtime
        status, relay = self._status, self._relay
        v = FIRST_BUCKET_VERSION
        status.mark_ready(W_SLOT0)  # joined: both slots may be written
        status.mark_ready(W_SLOT1)
        win = await self._source()
        cap = self.meta_bytes + self.bucket_size
        # A relay receives each bucket straight into the slot of its own window that the next
        # rollout will read (a write section of exactly that version); the last rollout (or
        # every rollout of a star) into two local buffers.
        bufs = [np.empty(cap, np.uint8) for _ in range(2)] if relay is None else None
        # delta (the master's choice): this sync's buckets kept for the next one (``_take``)
        builder = vd.StoreBuilder(self._store) if self._keep else None
        if builder is None:
            self._store = None  # the trainer sends no deltas: no copy is kept here
        # delta buckets, fallbacks (read whole from the trainer), data bytes received (fallbacks' included)
        took = [0, 0, 0]
        self.metrics = {}  # (a sync that fails leaves none)
        # every bucket in order, exactly its version (the ready words keep it readable)
        loop = asyncio.get_running_loop()

        async def fetch(version: int) -> tuple[dict, np.ndarray]:
            sec = None
            if bufs is not None:
                buf = bufs[version % 2]
            else:
                # the next rollout is done with what this slot holds (bucket version - 2)
                await self._await_slot(loop, version - FIRST_BUCKET_VERSION)
                # at once: nothing reads that slot now (so no await holds an open section)
                sec = rt.write_section(relay, copy=False, timeout=self.timeout)
                buf = sec.array()
            try:
                # exactly the next version: its header and metadata, then the data bytes it names
                await win.wait_version_async(version, timeout=self.timeout)
                # (a whole bucket of a sync that keeps its buckets, on a rollout that re-serves
                # nothing: its data straight into this rollout's copy)
                keep = builder if bufs is not None else None
                got, direct = await rt.submit(f"bucket {version - FIRST_BUCKET_VERSION}",
                                              lambda: self._read(win, buf, version, keep))
                head = self._check_bucket(win, buf, got, version, global_steps)
                head["direct"] = direct
                # before it is yielded or re-served: the trainer's bytes, whoever served them
                await rt.submit(f"bucket {head['index']}: its digest", lambda: self._verify(buf, head, version))
            except BaseException:
                if sec is not None:
                    sec.abort()
                raise
            if sec is not None:
                sec.commit()  # version ``version`` of this rollout's window: the next rollout reads it
            took[2] += head["wire"]
            if builder is not None:  # into this rollout's copy; the tensors are yielded from it
                head["part"] = await rt.submit(f"bucket {head['index']}: into this rollout's copy",
                                               lambda: self._take(builder, head, buf, version, took))
            elif head["kind"] != KIND_FULL:
                raise memsem.MemsemError(f"bucket {head['index']} from {self._source_label} is a delta, but the "
                                         "trainer said it sends no deltas this sync")
            return head, buf

        task = asyncio.ensure_future(fetch(v))
        try:
            while True:
                got, arr = await task
                part = got.get("part")
                buf, data_at = (torch.from_numpy(arr), self.meta_bytes) if part is None else (torch.from_numpy(part), 0)
                # copied out: the trainer (or the rollout before) may write this slot again (v + 2)
                status.mark_ready(v % 2)
                if not got["last"]:
                    task = asyncio.ensure_future(fetch(v + 1))
                for name, dt, shape, chunk_offset, chunk_size, off in got["meta"]:
                    at = data_at + off
                    yield (TensorMeta(name=name, shape=torch.Size(shape), dtype=dtype_of(dt), chunk_offset=chunk_offset,
                                      chunk_size=chunk_size, offset=off), buf[at:at + chunk_size])
                if got["last"]:
                    break
                v += 1
            if builder is not None:  # every bucket checked and yielded: the next sync's base
                self._store = builder.finish(str(self._sync_token), flat=False)
            self.metrics = {"memsem/buckets": float(v - FIRST_BUCKET_VERSION + 1),
                            "memsem/delta_buckets": float(took[0]), "memsem/fallbacks": float(took[1]),
                            "memsem/received_bytes": float(took[2])}
        finally:
            if not task.done():
                task.cancel()
