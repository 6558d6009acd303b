"""Trainer ranks of tests/test_reshard.py that need no torch (a spawned child imports this module,
not the test module, so it starts without importing torch)."""
from __future__ import annotations

import contextlib
import math
import os
import signal

import numpy as np

import memsem
from memsem.sync import Shard, local_box, publish_sharded

G = (9, 4)  # 9 rows over 2 ranks: 5 and 4


def random_model(rng: np.random.Generator, shapes: dict, dtypes: dict) -> dict[str, np.ndarray]:
    """A model of ``shapes``: normal values, float16 but for the tensors ``dtypes`` names."""
    return {k: rng.standard_normal(s).astype(dtypes.get(k, np.float16)) for k, s in shapes.items()}


def row_shards(full: dict, rank: int, world: int = 2) -> dict[str, np.ndarray]:
    """Trainer rank ``rank``'s ``Shard(0)`` boxes of ``full``'s tensors over ``world`` ranks
    (torch.chunk's cut: uneven shards)."""
    out = {}
    for k, a in full.items():
        off, size = local_box(a.shape, (world,), (rank,), [Shard(0)])
        out[k] = np.ascontiguousarray(a[off[0]:off[0] + size[0]])
    return out


def values(version: int) -> np.ndarray:
    return (np.arange(math.prod(G), dtype=np.float32).reshape(G) + 1000 * version)


def np_trainer(conn, rank: int, name: str, barrier, steps: int) -> None:
    """Rank ``rank`` of 2, ``Shard(0)`` of a (9, 4) float32 tensor whose version v holds
    ``values(v)``. ``steps``: commit that many versions in lockstep (the barrier stands for the
    training step's collective), as fast as it can; else follow the parent's commands ("commit":
    the next version holds ``values(v)``; "bump": element (0, 3) of its rows changes)."""
    off, size = local_box(G, (2,), (rank,), [Shard(0)])
    o, n = off[0], size[0]
    with memsem.Runtime(timeout=30) as rt:
        pub = publish_sharded(rt, {"w": values(1)[o:o + n].copy(), "b": np.ones(3, np.int64)}, name=name, rank=rank,
                              world_size=2, placements={"w": [Shard(0)]}, global_shapes={"w": G})
        conn.send("published")
        if steps:
            for v in range(2, steps + 1):
                barrier.wait(30)
                assert pub.update({"w": values(v)[o:o + n], "b": np.full(3, v, np.int64)}) == v
            conn.send("done")
            conn.recv()
            return
        cur = values(1)[o:o + n].copy()
        while True:
            cmd = conn.recv()
            if cmd == "commit":
                cur = values(pub.version() + 1)[o:o + n].copy()
                conn.send(pub.update({"w": cur, "b": np.ones(3, np.int64)}))
            elif cmd == "bump":  # one element of the rank's first row changes (column 3)
                cur[0, 3] += 1
                conn.send(pub.update({"w": cur, "b": np.ones(3, np.int64)}))
            elif cmd == "stats":  # the tcp server's counters (digests answered, from its cache)
                conn.send(rt.engines["tcp"].server_stats() if "tcp" in rt.engines else {})
            elif cmd == "small digest slices":  # the owner hashes a DIGEST 8 bytes per turn of its loop
                from memsem.engines.tcp import _requests

                _requests.DIGEST_SLICE_BYTES = 8
                conn.send("ok")
            elif cmd == "die mid-commit":
                sec = pub.write_section()
                sec.tensors["w"][:] = -1.0  # half-written: never committed
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                return


def np_trainer_on_node(conn, rank: int, name: str, node: str) -> None:
    os.environ.update(MEMSEM_NODE_ID=node, MEMSEM_ENGINES="loopback,host,tcp")
    np_trainer(conn, rank, name, None, 0)


@contextlib.contextmanager
def far_trainers(monkeypatch, name: str):
    """Two :func:`np_trainer` ranks of ``name`` on another node ("node-trainer"), and a runtime
    of this process on node "node-rollout" (tcp between them): yields the runtime and the
    ranks' pipes; stops the ranks after."""
    from tests._proc import reap, recv, spawn

    monkeypatch.setenv("MEMSEM_JOB_SECRET", "sharded-test-secret")
    procs = [spawn(np_trainer_on_node, r, name, "node-trainer") for r in range(2)]
    try:
        for _, c in procs:
            assert recv(c, 60) == "published"
        monkeypatch.setenv("MEMSEM_NODE_ID", "node-rollout")
        with memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=20) as rt:
            yield rt, [c for _, c in procs]
        for _, c in procs:
            c.send("stop")
    finally:
        reap([p for p, _ in procs], 30)
