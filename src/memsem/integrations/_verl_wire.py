"""The verl backend's wire: the bucket header, the status window's words, the digests, and
the helpers the trainer's and the rollouts' sides share (``memsem.integrations.verl``)."""
from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch

#: bucket header at the start of every slot: magic, bucket index, is_last, step, metadata bytes,
#: kind (``KIND_FULL``, ``KIND_DELTA``), bytes of the data area sent, the bucket's offset in the
#: trainer's store window (delta buckets)
HEAD = struct.Struct("<8sQQqIIQQ")
MAGIC = b"MSVERLB2"
#: a bucket's data area holds its tensor chunks (full) or a delta against the last sync's
#: bucket of the same layout (``memsem.integrations._verl_delta``)
KIND_FULL, KIND_DELTA = 0, 1
#: first version a bucket gets (1 is the empty window right after publish)
FIRST_BUCKET_VERSION = 2
#: ready words of a status window: done with slot 0, done with slot 1, failed, relay window ready
W_SLOT0, W_SLOT1, W_FAILED, W_RELAY = 0, 1, 2, 3
#: bytes of a status window: the failure message (UTF-8, NUL-terminated) in the first half, the
#: serialized ref of the rollout's relay window (length-prefixed) from ``RELAY_AT``
STATUS_BYTES = 4096
RELAY_AT = 2048
#: how the buckets reach the rollouts: "chain" (the trainer sends each bucket once, to rollout 1;
#: rollout k re-serves it to rollout k + 1 from a bucket window of its own), "star" (every rollout
#: reads every bucket from the trainer)
FANOUTS = ("chain", "star")
#: the trainer's digest of every bucket (hashlib name, bytes), in its digest window: entry b is
#: bucket b's, written before the bucket is committed and read by every rollout from the trainer
#: itself (never through a relay)
DIGEST, DIGEST_SIZE = "sha256", 32
#: bytes of a slot a rollout reads first: the header and (most often all of) the metadata
HEAD_PROBE = 4 << 10
#: buckets one sync may have (the digest window's entries: 2 MiB)
MAX_BUCKETS = 1 << 16
#: a slot's data area starts at ``meta_bytes``, a multiple of this; each tensor chunk in it at a
#: multiple of its dtype's size (a bucket of ``bool (3,)`` then ``float32 (2,)`` puts the float32
#: chunk at data offset 4, not 3: every rollout's view of it is aligned)
DATA_ALIGN = 64


def itemsize_of(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``: the alignment of a chunk of it in a bucket."""
    return int(dtype.itemsize)


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"bucket metadata names an unknown torch dtype {name!r}")
    return dt



def chunk_tiles(meta: list) -> list[tuple[int, int, int]]:
    """(data offset, bytes, itemsize) of each chunk of a bucket's metadata: what its tiles are
    made of (``_verl_delta.BucketTiles.of``)."""
    return [(int(e[5]), int(e[4]), itemsize_of(dtype_of(e[1]))) for e in meta]


def bucket_digest(buf: Any, head: int, meta_bytes: int, used: int, data: Any = None) -> bytes:
    """The bucket digest: of its header and metadata (``buf[:head]``) and its data bytes
    (``used`` from ``meta_bytes``, or of ``data`` where they were read to); the rest of the
    slot holds older buckets' bytes."""
    h = hashlib.new(DIGEST)
    h.update(memoryview(buf[:head]))
    h.update(memoryview(buf[meta_bytes:meta_bytes + used] if data is None else data[:used]))
    return h.digest()


def failure_message(raw: Any) -> str:
    """The message a rollout that left wrote into its status window (its first half)."""
    return bytes(raw[:RELAY_AT]).split(b"\0", 1)[0].decode("utf-8", "replace") or "no message"


def rollout_label(i: int, md: dict[str, Any]) -> str:
    return f"rollout {i} (pid {md.get('pid')} on {md.get('node')!r})"
