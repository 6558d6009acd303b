"""``memsem demo --pipeline``: stream the checkpoint's bytes through the tile pipeline.

A producer process holds the whole checkpoint file (private memory: route host/cma, or a shared
segment with ``--shm``, streamed with copies all the same); this process streams it with
``tile_bytes`` tiles and depth 2, hashing each tile while the next one moves, checks the sha256
against the file, and reports first-tile latency (against one tile-sized get), overlap and bytes
moved.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
from typing import Any

import numpy as np


def _holder(conn: Any, path: str, shm: bool) -> None:
    import memsem

    with memsem.Runtime() as rt:
        raw = np.fromfile(path, np.uint8)
        if shm:
            buf = rt.alloc(raw.nbytes, np.uint8)
            buf[:] = raw
            raw = buf
        ref = rt.publish(raw, access="r", name="demo-pipeline")
        conn.send(ref.to_bytes())
        conn.poll(600)


def pipeline_phase(path: str, args: Any, console: Any) -> bool:
    import memsem
    from memsem.pipeline import stream_report

    tile_bytes = int(getattr(args, "tile_bytes", 1 << 20))
    timeout = float(getattr(args, "timeout", 120.0))
    with open(path, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child, path, bool(getattr(args, "shm", False))), daemon=True)
    proc.start()
    child.close()
    try:
        if not conn.poll(timeout):
            console.print("[red]pipeline phase: the producer did not publish in time")
            return False
        data = conn.recv()
        h = hashlib.sha256()
        with memsem.Runtime(timeout=timeout) as rt:
            r = stream_report(rt, rt.ref(data), tile_bytes=tile_bytes, depth=2,
                              compute=lambda a: h.update(memoryview(a)), zero_copy=False, timeout=timeout)
    finally:
        try:
            conn.send("exit")
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    exact = h.hexdigest() == want
    ratio = r["first_tile_ratio"]
    console.print(
        f"pipeline: streamed {r['bytes_moved']:,} B in {r['tiles']} tiles of {tile_bytes:,} B (depth 2, "
        f"route {r['route']}): first tile {r['first_tile_s'] * 1e3:.3f} ms = "
        f"{ratio:.2f}x one {tile_bytes:,} B get ({r['one_tile_get_s'] * 1e3:.3f} ms); total "
        f"{r['total_s'] * 1e3:.1f} ms, moving {r['move_s'] * 1e3:.1f} ms, overlap {r['overlap_ratio']:.2f}; "
        + ("sha256 matches the file" if exact else "[red]sha256 DIFFERS from the file"))
    return exact
