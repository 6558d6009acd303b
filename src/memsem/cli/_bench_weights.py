"""Versioned weight sync, measured: memsem against the peers a weight-sync user would pick.

One trainer process publishes a state dict (``publish_state_dict``, double-buffered) and
rollout processes follow it by name. Each rollout reserves the next version (a pinned lease)
before it lets go of the one it loads, so the trainer writes version v+1 while rollouts load v
and is blocked only when a rollout is two versions behind. Per version it measures the time
from "version closed" (the trainer's commit) to "every rollout loaded it", the trainer's time
blocked by readers, the torn reads memsem caught, and checks every rollout's bytes against a
sha256 the trainer computed.

Peers, same buckets, same machine, same run: ``torch.distributed`` broadcast over gloo (the
algorithm of verl's NCCL backend, on CPU) and Ray's object store (``ray.put`` once,
``ray.get`` in every rollout; run in ``.venv-tq`` when Ray is not importable here). Plus the
anchor: two concurrent ``np.copyto`` streams of the same bytes.

Used by ``memsem demo`` (the versioned table) and ``memsem bench`` (keys ``weight_sync_4r_s``,
``gloo_broadcast_4r_s``, ``ray_object_store_4r_s``, ``weight_sync_first_bucket_ms``,
``weight_sync_trainer_blocked_ms``); ``benchmarks/bench_weight_sync.py`` runs it alone.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

_CTX = mp.get_context("spawn")


# -- the state dicts ------------------------------------------------------------------------------
def synthetic_state_dict(total_bytes: int, n: int = 300, seed: int = 0) -> dict[str, np.ndarray]:
    """~``total_bytes`` in ``n`` tensors, alternating bf16 and fp32, sizes spread 1:16."""
    from memsem import _dtypes

    bf16 = _dtypes.numpy_dtype(_dtypes.code_of("bfloat16"))
    rng = np.random.default_rng(seed)
    weights = rng.uniform(1.0, 16.0, n)
    weights *= total_bytes / weights.sum()
    out = {}
    for i, w in enumerate(weights):
        dt = bf16 if i % 2 == 0 else np.dtype(np.float32)
        cols = 1024
        rows = max(1, int(w) // (cols * dt.itemsize))
        out[f"layers.{i // 6}.p{i % 6}.weight"] = rng.integers(0, 255, rows * cols * dt.itemsize,
                                                                 dtype=np.uint8).view(dt).reshape(rows, cols)
    return out


def step_in_place(sd: dict[str, np.ndarray], step: int) -> None:
    """The demo's known update of every tensor: the raw bytes of each tensor rotate by one
    (``uint8 += 1``), cheap and bit-exact to check."""
    for a in sd.values():
        if a.size:
            raw = a.reshape(-1).view(np.uint8)
            np.add(raw, 1, out=raw)


def digest(sd: dict[str, Any], names: list[str]) -> str:
    h = hashlib.sha256()
    for n in names:
        a = sd[n]
        if hasattr(a, "numpy"):
            a = a.reshape(-1).view(__import__("torch").uint8).numpy()
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return h.hexdigest()


# -- memsem: trainer + rollouts ---------------------------------------------------------------------
def _follower(idx: int, name: str, versions: int, verify: bool, results: Any, job: str) -> None:
    """A rollout that is the follower loop (``Runtime.follow``): in lockstep with the trainer,
    it loads every version (pinned while it loads), checks it, and reports it."""
    os.environ["MEMSEM_JOB"] = job
    import memsem

    try:
        with memsem.Runtime(timeout=300.0) as rt:
            sd = rt.lookup_state_dict(name, timeout=300)
            into = sd.empty_like("numpy")
            names = list(sd.keys())
            results.put(("joined", idx))
            for v, tensors in rt.follow(sd, into=into, timeout=300):
                t_end = time.monotonic()
                ok = digest(tensors, names) if verify else ""
                e = rt.stats().errors
                results.put(("loaded", idx, v, t_end, ok, e.get("torn", 0) + e.get("busy", 0)))
                if v >= versions:
                    break
    except BaseException as exc:
        results.put(("error", idx, f"{type(exc).__name__}: {exc}"))


def _rollout(idx: int, name: str, versions: int, verify: bool, results: Any, job: str) -> None:
    """A rollout that loads *every* version however fast the trainer commits: it reserves the
    next two versions ahead (pins of versions not written yet), so the trainer waits for it."""
    os.environ["MEMSEM_JOB"] = job
    import memsem

    try:
        with memsem.Runtime(timeout=300.0) as rt:
            sd = rt.lookup_state_dict(name)
            dst = sd.empty_like("numpy")
            names = list(sd.keys())
            cur = sd.pin(version=1, ttl=None)
            nxt = sd.pin(version=2, ttl=None)  # reserved before the trainer writes it
            results.put(("joined", idx))
            while True:
                v = cur.version
                sd.wait_version(v, timeout=300)
                sd.load(dst, version=v, lease=cur)  # one bracket, every tensor of version v
                t_end = time.monotonic()
                ok = digest(dst, names) if verify else ""
                e = rt.stats().errors
                results.put(("loaded", idx, v, t_end, ok, e.get("torn", 0) + e.get("busy", 0)))
                if v >= versions:
                    break
                following = sd.pin(version=v + 2, ttl=None) if v + 2 <= versions else None
                cur.release()
                cur, nxt = nxt, following
            cur.release()
            if nxt is not None:
                nxt.release()
    except BaseException as exc:
        results.put(("error", idx, f"{type(exc).__name__}: {exc}"))


def memsem_sync(sd: dict[str, np.ndarray], rollouts: int, versions: int, *, verify: bool = False,
                timeout: float = 600.0, on_version: Callable[[dict], None] | None = None,
                bucket_bytes: int = 64 << 20, lockstep: bool = False) -> list[dict]:
    """Run the trainer here and ``rollouts`` processes; ``versions`` versions in all (1 is the
    publish, 2.. are in-place update steps). Returns one record per version: ``seconds``
    (close -> all loaded), ``blocked_s``, ``caught`` (torn reads caught in the rollouts),
    ``exact`` (every rollout's sha256 equal to the trainer's, when ``verify``).

    ``lockstep``: the trainer steps to version v+1 only once every rollout has loaded (and, with
    ``verify``, hashed) version v, so ``seconds`` is the load alone, with every rollout loading
    at once; otherwise the trainer commits as fast as it can and the rollouts follow (a version's
    time then includes whatever the rollouts were still doing with the one before)."""
    import secrets

    import memsem

    job = f"ws{os.getpid()}-{secrets.token_hex(3)}"
    old_job = os.environ.get("MEMSEM_JOB")
    os.environ["MEMSEM_JOB"] = job
    names = list(sd)
    out: list[dict] = []
    try:
        with memsem.Runtime(timeout=timeout, job=job) as rt:
            ref = rt.publish_state_dict(sd, name="policy", bucket_bytes=bucket_bytes)
            nbytes = sum(a.nbytes for a in sd.values())
            results = _CTX.Queue()
            # in lockstep each rollout is the follower loop; otherwise it reserves versions ahead
            target = _follower if lockstep else _rollout
            procs = [_CTX.Process(target=target, args=(i, "policy", versions, verify, results, job), daemon=True)
                     for i in range(rollouts)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            joined = 0
            loaded: dict[int, dict[int, tuple]] = {}
            caught_prev = [0] * rollouts

            def pump(block: float) -> None:
                nonlocal joined
                try:
                    msg = results.get(timeout=block)
                except queue.Empty:
                    if not any(p.is_alive() for p in procs):
                        raise RuntimeError("every rollout process exited") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"weight sync did not finish in {timeout} s") from None
                    return
                if msg[0] == "error":
                    raise RuntimeError(f"rollout {msg[1]} failed: {msg[2]}")
                if msg[0] == "joined":
                    joined += 1
                else:
                    loaded.setdefault(msg[2], {})[msg[1]] = msg[3:]

            while joined < rollouts:
                pump(0.5)
            commits = {1: time.monotonic()}
            while lockstep and len(loaded.get(1, {})) < rollouts:
                pump(0.5)
            digests = {1: digest(sd, names) if verify else ""}
            blocked = {1: 0.0}
            for v in range(2, versions + 1):
                step_in_place(sd, v)
                if verify:
                    digests[v] = digest(sd, names)
                with ref.write_section(copy=False) as sec:
                    flat = sec.flat
                    base = flat.ctypes.data + ref.layout.header_bytes
                    for e in ref.layout.entries:
                        if e.nbytes:
                            memsem.native.memcpy(base + e.offset, sd[e.name].ctypes.data, e.nbytes)
                commits[v] = time.monotonic()
                blocked[v] = sec.blocked_s
                while lockstep and len(loaded.get(v, {})) < rollouts:
                    pump(0.5)
                while True:  # drain what arrived meanwhile (never blocks the trainer)
                    try:
                        pump(0)
                    except (TimeoutError, RuntimeError):
                        raise
                    if results.empty():
                        break
            while len(loaded.get(versions, {})) < rollouts:
                pump(0.5)
            for v in range(1, versions + 1):
                rows = loaded.get(v, {})
                t_end = max(r[0] for r in rows.values())
                exact = all(r[1] == digests[v] for r in rows.values()) if verify else None
                caught = 0
                for i, r in rows.items():
                    caught += r[2] - caught_prev[i]
                    caught_prev[i] = r[2]
                rec = {"version": v, "seconds": t_end - commits[v], "blocked_s": blocked[v], "caught": caught,
                       "exact": exact, "accepted_torn": 0 if exact in (True, None) else sum(
                           1 for r in rows.values() if r[1] != digests[v]),
                       "bytes": nbytes * rollouts, "rollouts": len(rows)}
                out.append(rec)
                if on_version is not None:
                    on_version(rec)
            for p in procs:
                p.join(30)
    finally:
        if old_job is None:
            os.environ.pop("MEMSEM_JOB", None)
        else:
            os.environ["MEMSEM_JOB"] = old_job
    return out


# -- peers --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, buckets: list[int], reps: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        bufs = [torch.zeros(n, dtype=torch.uint8) for n in buckets]
        if rank == 0:
            for b in bufs:
                b.fill_(7)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.monotonic()
            for b in bufs:
                dist.broadcast(b, src=0)
            dist.barrier()
            times.append(time.monotonic() - t0)
        ok = all(int(b[0]) == 7 and int(b[-1]) == 7 for b in bufs)
        results.put((rank, times, ok))
        dist.destroy_process_group()
    except BaseException as exc:
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))


def gloo_broadcast(bucket_sizes: list[int], rollouts: int, reps: int = 3, timeout: float = 600.0) -> float | None:
    """Seconds for one version (every bucket broadcast from the trainer to ``rollouts`` ranks,
    barrier to barrier), median over ``reps``; None when torch is missing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    world = rollouts + 1
    port = _free_port()
    results = _CTX.Queue()
    procs = [_CTX.Process(target=_gloo_rank, args=(r, world, port, bucket_sizes, reps, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + timeout
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("gloo broadcast did not finish")
            rank, times, ok = results.get(timeout=left)
            if times is None:
                raise RuntimeError(f"gloo rank {rank}: {ok}")
            got[rank] = (times, ok)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    per_rep = [max(got[r][0][i] for r in got) for i in range(reps)]
    return statistics.median(per_rep)


def _ray_figure(total_bytes: int, n: int, rollouts: int, reps: int) -> float | None:
    import ray

    ray.init(num_cpus=max(2, rollouts), include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        @ray.remote
        def load(obj: Any) -> int:
            return sum(a.nbytes for a in obj.values())

        sd = synthetic_state_dict(total_bytes, n)
        times = []
        for _ in range(reps):
            t0 = time.monotonic()
            r = ray.put(sd)
            got = ray.get([load.remote(r) for _ in range(rollouts)])
            times.append(time.monotonic() - t0)
            if any(g != sum(a.nbytes for a in sd.values()) for g in got):
                raise RuntimeError("ray.get returned other bytes")
            del r
        return statistics.median(times)
    finally:
        ray.shutdown()


def ray_object_store(total_bytes: int, n: int, rollouts: int, reps: int = 3) -> tuple[float | None, str | None]:
    """Seconds for one version through Ray's object store (put once, get in each rollout task),
    median; run in ``.venv-tq`` when Ray is not importable here. ``(None, why)`` otherwise."""
    try:
        import ray  # noqa: F401
        return _ray_figure(total_bytes, n, rollouts, reps), None
    except ImportError:
        pass
    root = pathlib.Path(__file__).resolve().parents[3]
    py = root / ".venv-tq" / "bin" / "python"
    if not py.exists():
        return None, "Ray is not installed here nor in .venv-tq (make test-tq builds it)"
    code = (f"import sys, json; sys.path.insert(0, {str(root / 'src')!r}); "
            "from memsem.cli._bench_weights import _ray_figure; "
            f"print(json.dumps(_ray_figure({total_bytes}, {n}, {rollouts}, {reps})))")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0")
    cp = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=900, env=env)
    if cp.returncode != 0:
        return None, f"Ray run failed: {cp.stderr.strip().splitlines()[-1] if cp.stderr.strip() else cp.returncode}"
    return float(json.loads(cp.stdout.strip().splitlines()[-1])), None


def two_stream_copyto_gbps(nbytes: int) -> float:
    """GB/s of two concurrent ``np.copyto`` streams of ``nbytes`` each (the machine's copy
    bandwidth with two cores busy), best of 3."""
    a = [np.ones(nbytes, np.uint8) for _ in range(2)]
    b = [np.empty(nbytes, np.uint8) for _ in range(2)]
    for x, y in zip(a, b):
        np.copyto(y, x)
    best = float("inf")
    for _ in range(3):
        ts = [threading.Thread(target=np.copyto, args=(y, x)) for x, y in zip(a, b)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def one_bucket_get_ms(bucket: int) -> float:
    """ms of one same-node get of ``bucket`` bytes (host/shm), best of 5."""
    import memsem

    with memsem.Runtime() as rt:
        src = rt.alloc(bucket, np.uint8)
        ref = rt.publish(src)
        dst = np.empty(bucket, np.uint8)
        ref.get(dst)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            ref.get(dst)
            best = min(best, time.perf_counter() - t0)
        rt.unpublish(ref)
    return best * 1e3


def first_bucket_ms(sd: dict[str, np.ndarray], bucket_bytes: int, reps: int = 5) -> float:
    """ms from a version's close to the first bucket loaded by a streaming reader (another
    runtime here: same route as a rollout's), median."""
    import memsem

    out = []
    with memsem.Runtime() as rt, memsem.Runtime() as reader:
        ref = rt.publish_state_dict(sd, bucket_bytes=bucket_bytes)
        r = memsem.StateDictRef.from_bytes(ref.to_bytes(), reader)
        dst = r.empty_like("numpy")
        for _ in r.stream(dst):
            pass
        for _ in range(reps):
            with ref.write_section(copy=False):
                pass
            t0 = time.monotonic()
            it = r.stream(dst)
            next(it)
            out.append(time.monotonic() - t0)
            for _ in it:
                pass
    return statistics.median(out) * 1e3


# -- the benchmark keys ---------------------------------------------------------------------------
def weight_sync_keys(quick: bool, notes: list[str] | None = None) -> dict[str, Any]:
    """The keys of ``memsem bench --json`` for issue 13 (seconds / ms; null where a peer is
    missing, with a note)."""
    notes = notes if notes is not None else []
    total = (256 << 20) if quick else (1 << 30)
    bucket = 64 << 20
    sd = synthetic_state_dict(total, 300)
    nbytes = sum(a.nbytes for a in sd.values())
    fig: dict[str, Any] = {"weight_sync_state_dict_MB": round(nbytes / 1e6, 1)}
    versions = 4 if quick else 6
    per_r = {}
    blocked = []
    for r in (1, 2, 4):
        recs = memsem_sync(sd, r, versions, bucket_bytes=bucket)
        steady = [x for x in recs if x["version"] > 1]
        per_r[r] = statistics.median(x["seconds"] for x in steady)
        blocked += [x["blocked_s"] for x in steady]
    for r, s in per_r.items():
        fig[f"weight_sync_{r}r_s"] = round(s, 4)
    fig["weight_sync_trainer_blocked_ms"] = round(statistics.median(blocked) * 1e3, 3)
    sizes = _bucket_sizes(nbytes, bucket)
    g = gloo_broadcast(sizes, 4, reps=2 if quick else 3)
    fig["gloo_broadcast_4r_s"] = None if g is None else round(g, 4)
    ray_s, why = ray_object_store(total, 300, 4, reps=2 if quick else 3)
    fig["ray_object_store_4r_s"] = None if ray_s is None else round(ray_s, 4)
    if why:
        notes.append(f"ray_object_store_4r_s: {why}")
    fig["weight_sync_first_bucket_ms"] = round(first_bucket_ms(sd, bucket), 3)
    fig["one_bucket_get_ms"] = round(one_bucket_get_ms(bucket), 3)
    fig["copyto_2stream_GBps"] = round(two_stream_copyto_gbps(min(nbytes, 256 << 20)), 2)
    fig["weight_sync_4r_GBps"] = round(4 * nbytes / per_r[4] / 1e9, 2)
    return fig


def _bucket_sizes(nbytes: int, bucket: int) -> list[int]:
    out = [bucket] * (nbytes // bucket)
    if nbytes % bucket:
        out.append(nbytes % bucket)
    return out


WEIGHT_GOALS = {
    "weight_sync_4r_s": ">= 2x faster than gloo_broadcast_4r_s, >= 1.5x than ray_object_store_4r_s",
    "weight_sync_trainer_blocked_ms": "<= 1 ms per version (double buffering)",
    "weight_sync_first_bucket_ms": "<= 3 x one_bucket_get_ms",
}


def weight_goals_met(fig: dict[str, Any]) -> dict[str, bool | None]:
    w = fig.get("weight_sync_4r_s")
    g, r = fig.get("gloo_broadcast_4r_s"), fig.get("ray_object_store_4r_s")
    fb, one = fig.get("weight_sync_first_bucket_ms"), fig.get("one_bucket_get_ms")
    return {
        "weight_sync_4r_s": None if w is None or g is None or r is None else (g >= 2 * w and r >= 1.5 * w),
        "weight_sync_trainer_blocked_ms": None if fig.get("weight_sync_trainer_blocked_ms") is None
        else fig["weight_sync_trainer_blocked_ms"] <= 1.0,
        "weight_sync_first_bucket_ms": None if fb is None or one is None else fb <= 3 * one,
    }


__all__ = ["WEIGHT_GOALS", "digest", "gloo_broadcast", "memsem_sync", "ray_object_store", "step_in_place",
           "synthetic_state_dict", "two_stream_copyto_gbps", "weight_goals_met", "weight_sync_keys"]
