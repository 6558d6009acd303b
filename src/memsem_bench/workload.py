"""``memsem bench --workload``: one RL-shaped run, measured as a whole (issue 39).

A trainer (this process, also the run's controller) commits a state dict every step (a
transformer-like mix of tensor sizes: embedding, attention and MLP matrices, norms, biases);
``rollouts`` processes follow it (``Runtime.follow``, every version in order, full loads, each
under a stable reader name). After loading version v each rollout publishes a FieldSet of that
step's rollout data (``tokens``, ``logprobs``, ``rewards``; a number of rows of its own each
step) and sends its wire form to the trainer; it then writes the rows in chunks of uneven sizes
at uneven times (its "generation"). The trainer consumes every batch through the pipeline as its
rows arrive (one ``FieldRef.pipeline`` per field, staged copies, in the order the batches are
announced), "trains" and commits version v+1: the trainer and its rollouts run in lockstep
through the data itself. At one step one rollout is killed (SIGKILL) while the trainer waits for
its last tile; the trainer's pipeline raises ``PeerLostError`` naming the rollout's process, the
controller starts a new rollout under the same reader name, which loads the current version and
produces that step's batch again.

The compute of a step is modelled as the time an accelerator would take (sleeps: the CPU is free
meanwhile, as it is while a GPU trains or generates): the trainer's ``train_s`` per step and
each rollout's generation (the sum of its chunks' delays, drawn per step). The trainer's
per-tile work on the rows (a reduction over each tile) is real.

Figures (``workload_*``): ``workload_vs_ideal`` is the wall time of the steady steps (every step
after the first, except the step of the kill) against their ideal: the copies at the copy
bandwidth measured in the same step (after its rows were consumed, the rollouts idle, taken out
of the step's wall time: one ``np.copyto`` stream of the state dict's tensors for the commit and
the rows, two streams at once for each two rollouts' loads, the machine's two cores) plus the
compute (train, the slowest rollout's generation, the trainer's per-tile work).
``workload_vs_ideal_with_recovery`` counts every step after the first. ``workload_recovery_s``:
from the kill to the restarted rollout holding the current version (its own clock reading after
the load; CLOCK_MONOTONIC is one clock for the machine); its bound is 3 x the liveness bound
(``workload_liveness_bound_s``: the membership TTL after which a silent peer is dead, the
library's stated bound across nodes; on one node a death is seen sooner, through the pidfd).
``workload_death_to_error_s``: from the kill to the trainer's ``PeerLostError``. Latencies:
``workload_version_load_ms_p50/p99/p999`` (a commit to each rollout holding it; the first version
and the restarted rollout's first load excluded), ``workload_field_wait_ms_p50/p99/p999`` (the
trainer in ``next()`` of a field's pipeline, per tile: mostly the rollouts' generation pacing).
``workload_rss_growth_MiB``: the trainer's (owner and controller) RSS at the end against after
step 2 (both slots of the state dict written by then).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import secrets
import signal
import statistics
import threading
import time
from typing import Any

import numpy as np

from memsem_bench.weights import TensorCopy

_CTX = mp.get_context("spawn")
MiB = 1 << 20
#: the issue's workload: a state dict of at least 256 MiB, 4 rollouts, at least 20 steps
FULL = dict(state_bytes=256 * MiB, rollouts=4, steps=20, rows=(48, 160), seq=512, tile_rows=16,
            gen_s=0.03, train_s=0.02)
#: the test's size (tests/test_bench.py)
TINY = dict(state_bytes=16 * MiB, rollouts=2, steps=3, rows=(24, 64), seq=64, tile_rows=8,
            gen_s=0.01, train_s=0.005)
FIELDS = ("tokens", "logprobs", "rewards")


def transformer_state_dict(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A state dict shaped like a transformer's, of at least ``total_bytes``: a float32
    embedding and output head, then layers of four attention matrices (hidden x hidden), three
    MLP matrices (hidden x 8/3 hidden) in float16, two norms and a bias (hidden) in float32,
    until the total is reached. Hidden size 1024 (512 below 64 MiB)."""
    hidden = 1024 if total_bytes >= 64 * MiB else 512
    vocab = max(1024, (total_bytes // 8) // (hidden * 4))  # embedding + head: about a quarter
    mlp = hidden * 8 // 3
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}

    def add(name: str, shape: tuple[int, ...], dtype: Any) -> None:
        out[name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    add("embed.weight", (vocab, hidden), np.float32)
    total = out["embed.weight"].nbytes * 2
    i = 0
    while total < total_bytes:
        p = f"layers.{i}."
        for m in ("q", "k", "v", "o"):
            add(p + f"attn.{m}.weight", (hidden, hidden), np.float16)
        add(p + "mlp.gate.weight", (mlp, hidden), np.float16)
        add(p + "mlp.up.weight", (mlp, hidden), np.float16)
        add(p + "mlp.down.weight", (hidden, mlp), np.float16)
        for n in ("norm1", "norm2"):
            add(p + f"{n}.weight", (hidden,), np.float32)
        add(p + "mlp.down.bias", (hidden,), np.float32)
        total += sum(out[k].nbytes for k in out if k.startswith(p))
        i += 1
    add("head.weight", (vocab, hidden), np.float32)
    return out


def liveness_bound_s() -> float:
    """The library's liveness bound: the heartbeat TTL after which a silent member is dead
    (``MEMSEM_HEARTBEAT_TTL``, default 10 s); the workload's recovery is judged against 3x it."""
    from memsem.directory._membership import heartbeat_ttl

    return heartbeat_ttl(None)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(xs: list[float], q: float, scale: float = 1e3) -> float | None:
    return None if not xs else round(float(np.percentile(xs, q)) * scale, 3)


# -- a rollout ----------------------------------------------------------------------------------
def _rollout(idx: int, conn: Any, cfg: dict[str, Any], after: int, stall_at: int, job: str) -> None:
    """One rollout process: follow ``cfg["policy"]`` (every version from ``after + 1`` on), and
    per version publish that step's FieldSet, announce it, write its rows in uneven chunks at
    uneven times. At version ``stall_at`` it writes all but the last tile and waits to be
    killed (the run's kill). Ends after the last version, when the trainer says so."""
    os.environ["MEMSEM_JOB"] = job
    import memsem

    timeout = cfg["timeout"]
    try:
        with memsem.Runtime(timeout=timeout) as rt:
            sd = rt.lookup_state_dict(cfg["policy"], timeout=timeout)
            into = sd.empty_like("numpy")
            rng = np.random.default_rng(1000 * idx + after + 7)
            fs = None
            lo, hi = cfg["rows"]
            seq, tr = cfg["seq"], cfg["tile_rows"]
            follower = rt.follow(sd, into=into, every=True, reader=f"rollout-{idx}", after=after,
                                 delta=False, timeout=timeout)
            for v, _params in follower:
                t_loaded = time.monotonic()
                rows = int(rng.integers(lo, hi + 1))
                chunks: list[int] = []
                left = rows
                while left:  # uneven chunks: 1 .. 2 tiles' rows
                    k = min(left, int(rng.integers(1, 2 * tr + 1)))
                    chunks.append(k)
                    left -= k
                delays = rng.exponential(cfg["gen_s"] / len(chunks), len(chunks))
                if fs is not None:
                    fs.unpublish(timeout=timeout)
                fs = rt.publish_fields({"tokens": ((rows, seq), "int32"), "logprobs": ((rows, seq), "float32"),
                                        "rewards": ((rows,), "float32")}, tile_rows=tr,
                                       name=f"{cfg['prefix']}/rollout-{idx}", replace=True)
                conn.send(("batch", idx, v, t_loaded, float(delays.sum()), fs.to_bytes(), os.getpid()))
                stall = v == stall_at
                last_tile_row = ((rows - 1) // tr) * tr
                r = 0
                for k, d in zip(chunks, delays):
                    time.sleep(float(d))
                    if stall and r + k > last_tile_row:
                        k = last_tile_row - r  # never completes the last tile: killed meanwhile
                        if k <= 0:
                            break
                    fs["tokens"].put_rows(r, rng.integers(0, 32000, (k, seq), dtype=np.int32))
                    fs["logprobs"].put_rows(r, rng.standard_normal((k, seq), dtype=np.float32))
                    fs["rewards"].put_rows(r, rng.standard_normal(k, dtype=np.float32))
                    r += k
                if stall:
                    time.sleep(timeout)  # the controller kills this process here
                    raise RuntimeError(f"rollout-{idx} was not killed at version {v}")
                if v >= cfg["last_version"]:
                    break
            follower.close()
            if not conn.poll(timeout):  # the trainer reads the last batch, then says stop
                raise TimeoutError(f"rollout-{idx}: no stop from the trainer in {timeout} s")
            conn.recv()
            conn.send(("done", idx, rt.stats().bounce_bytes))
            if fs is not None:
                fs.unpublish(timeout=timeout)
    except BaseException as exc:  # reported to the trainer, which raises it
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", idx, f"{type(exc).__name__}: {exc}"))
        raise


# -- the trainer and controller -------------------------------------------------------------------
class _Rollouts:
    """The rollout processes and their control connections; stops every one it started."""

    def __init__(self, cfg: dict[str, Any], job: str) -> None:
        self.cfg, self.job = cfg, job
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}

    def start(self, idx: int, after: int, stall_at: int) -> None:
        mine, theirs = _CTX.Pipe()
        p = _CTX.Process(target=_rollout, args=(idx, theirs, self.cfg, after, stall_at, self.job), daemon=True)
        p.start()
        theirs.close()
        self.procs[idx], self.conns[idx] = p, mine

    def recv(self, idx: int, timeout: float) -> tuple:
        conn = self.conns[idx]
        if not conn.poll(timeout):
            raise TimeoutError(f"rollout-{idx} sent nothing in {timeout} s")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"rollout-{msg[1]} failed: {msg[2]}")
        return msg

    def close(self, grace: float) -> None:
        """Join every rollout within ``grace`` seconds in all, then kill what is left."""
        end = time.monotonic() + grace
        for idx, p in self.procs.items():
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(10)
            self.conns[idx].close()


def run_workload(*, state_bytes: int, rollouts: int, steps: int, rows: tuple[int, int], seq: int,
                 tile_rows: int, gen_s: float, train_s: float, kill_step: int | None = None,
                 timeout: float = 120.0) -> dict[str, Any]:
    """Run the workload (see the module docstring) and return its figures.

    Args:
        state_bytes: the state dict's size (at least; see ``transformer_state_dict``).
        rollouts: rollout processes (one of them killed and restarted).
        steps: versions committed after the first (each a training step).
        rows: each batch's rows are drawn in ``[rows[0], rows[1]]`` per rollout and step.
        seq: tokens per row. tile_rows: rows per ready tile of each field.
        gen_s: a rollout's mean generation time per step (the sum of its chunks' delays).
        train_s: the trainer's modelled compute per step.
        kill_step: the step whose batch of the last rollout is cut by a SIGKILL (default the
            middle one).
        timeout: bound of every wait (s).

    Raises:
        ValueError: fewer than 2 steps or no rollout. RuntimeError / TimeoutError: a rollout
            failed or sent nothing in ``timeout``. memsem errors of the trainer's own calls.
    """
    import memsem
    from memsem.core import collect

    if steps < 2 or rollouts < 1:
        raise ValueError(f"the workload needs at least 2 steps and 1 rollout, got {steps} and {rollouts}")
    kill_step = steps // 2 + 1 if kill_step is None else kill_step
    victim = rollouts - 1
    sd = transformer_state_dict(state_bytes)
    nbytes = sum(a.nbytes for a in sd.values())
    # the copies of a step at the machine's bandwidth of the moment: the state dict's tensors
    # into tensors of their own, one stream (a commit) and two at once (two rollouts' loads)
    floor = TensorCopy(sd)
    floors: list[tuple[float, float]] = []
    job = f"wl{os.getpid()}-{secrets.token_hex(3)}"
    prefix = f"wl-{secrets.token_hex(3)}"
    cfg = dict(policy=f"{prefix}/policy", prefix=prefix, rows=rows, seq=seq, tile_rows=tile_rows, gen_s=gen_s,
               timeout=timeout, last_version=steps + 1)
    old_job = os.environ.get("MEMSEM_JOB")
    os.environ["MEMSEM_JOB"] = job
    fig: dict[str, Any] = {}
    commits: dict[int, float] = {}
    loads_ms: list[float] = []
    waits: list[float] = []
    first_tiles: list[float] = []
    overlaps: list[float] = []
    moved = 0
    tile_compute = 0.0
    step_wall: dict[int, float] = {}
    step_ideal: dict[int, float] = {}
    rss: dict[int, int] = {}
    kill: dict[str, Any] = {}
    last_seen: dict[int, int] = {}
    parts: dict[str, list[float]] = {"commit": [], "loads": [], "rows": []}
    procs = _Rollouts(cfg, job)
    ok = False
    t_run = time.monotonic()
    try:
        with memsem.Runtime(timeout=timeout, job=job) as rt:
            ref = rt.publish_state_dict(sd, name=cfg["policy"], slots=2)
            v = ref.version()
            commits[v] = time.monotonic()
            for i in range(rollouts):
                procs.start(i, 0, v + kill_step if i == victim else -1)
            for step in range(steps + 1):  # step 0 consumes version 1's batches (warm-up)
                t_step = commits[v]
                gen_max = 0.0
                work = 0.0
                row_bytes = 0
                pending = set(range(rollouts))
                loaded_last = t_step
                while pending:
                    ready = mpc.wait([procs.conns[i] for i in pending], timeout)
                    if not ready:
                        raise TimeoutError(f"no rollout announced a batch of version {v} in {timeout} s")
                    i = next(j for j in pending if procs.conns[j] in ready)
                    msg = procs.recv(i, timeout)
                    _, _, mv, t_loaded, gen, data, pid = msg
                    if mv != v:
                        raise RuntimeError(f"rollout-{i} announced version {mv}, the trainer committed {v}")
                    if step > 0:  # version 1's loads include the rollouts' start
                        loads_ms.append(t_loaded - commits[v])
                    loaded_last = max(loaded_last, t_loaded)
                    gen_max = max(gen_max, gen)
                    last_seen[i] = mv
                    fset = memsem.FieldSet.from_bytes(data, rt)
                    if i == victim and step == kill_step and not kill:
                        fset, mv = _kill_and_restart(rt, procs, i, pid, fset, kill, v, (waits, first_tiles, overlaps),
                                                     min(gen, 0.05), timeout)
                        if mv != v:
                            raise RuntimeError(f"the restarted rollout-{i} announced version {mv}, not {v}")
                        last_seen[i] = mv
                    b, w = _consume(fset, (waits, first_tiles, overlaps), timeout)
                    moved += b
                    row_bytes += b
                    work += w
                    pending.discard(i)
                tile_compute += work
                t_rows = time.monotonic()
                if step == steps:
                    break
                # this step's copies at the machine's bandwidth of the moment, the rollouts idle
                # (waiting for the next version); taken out of the step's wall time
                t1, t2 = floor.one_stream(), floor.rep()
                floors.append((t1, t2))
                floor_s = time.monotonic() - t_rows
                time.sleep(train_s)  # the trainer's step (an accelerator's time)
                for a in sd.values():  # every weight changes each step (a full load each time)
                    a.reshape(-1)[:1] += 1
                t_update = time.monotonic()
                v = ref.update(sd)
                commits[v] = time.monotonic()
                rss[step + 1] = _rss_bytes()
                if step > 0:
                    if step != kill_step:
                        parts["commit"].append(commits[v] - t_update)
                        parts["loads"].append(loaded_last - t_step)
                        parts["rows"].append(t_rows - loaded_last)
                    step_wall[step] = commits[v] - t_step - floor_s
                    step_ideal[step] = t1 * (1 + row_bytes / nbytes) + t2 * rollouts / 2 + gen_max + train_s + work
            rss_end = _rss_bytes()
            for i in range(rollouts):
                procs.conns[i].send("stop")
            bounce = rt.stats().bounce_bytes
            for i in range(rollouts):
                msg = procs.recv(i, timeout)
                bounce += int(msg[2])
            held = v
        ok = True
    finally:
        procs.close(10.0 if ok else 0.5)
        if old_job is None:
            os.environ.pop("MEMSEM_JOB", None)
        else:
            os.environ["MEMSEM_JOB"] = old_job
        collect()  # the killed rollout's segments (its creator is dead)
    steady = [s for s in step_wall if s != kill_step]
    wall = sum(step_wall[s] for s in steady)
    ideal = sum(step_ideal[s] for s in steady)
    base = rss.get(2, rss.get(1))  # both slots of the window written by then
    rss = {s: b for s, b in rss.items() if s >= 2}
    bound = 3 * liveness_bound_s()
    fig.update({
        "workload_state_dict_MiB": round(nbytes / MiB, 1), "workload_tensors": len(sd),
        "workload_rollouts": rollouts, "workload_steps": steps, "workload_kill_step": kill_step,
        "workload_seconds": round(time.monotonic() - t_run, 2),
        "workload_copy_GBps": round(nbytes / statistics.median(f[0] for f in floors) / 1e9, 2),
        "workload_copy_2stream_GBps": round(2 * nbytes / statistics.median(f[1] for f in floors) / 1e9, 2),
        "workload_wall_s": round(wall, 3), "workload_ideal_s": round(ideal, 3),
        "workload_vs_ideal": round(wall / ideal, 3) if ideal else None,
        "workload_vs_ideal_with_recovery": round(sum(step_wall.values()) / sum(step_ideal.values()), 3)
        if step_ideal else None,
        "workload_recovery_s": _r(kill.get("recovered_s")),
        "workload_liveness_bound_s": liveness_bound_s(),
        "workload_recovery_bound_s": bound,
        "workload_recovered_version": kill.get("recovered_version"),
        "workload_held_version": held,
        "workload_restarted_holds_current": last_seen.get(victim) == held and kill.get("restarted") == victim,
        "workload_death_to_error_s": _r(kill.get("error_s")),
        "workload_error_names_rollout": kill.get("names_pid"),
        "workload_error": kill.get("error"),
        "workload_rss_growth_MiB": None if base is None else round((max(rss_end, *rss.values()) - base) / MiB, 2),
        "workload_bounce_bytes": bounce,
        "workload_bytes_moved": moved,
        "workload_first_tile_ms_p50": _pct(first_tiles, 50),
        "workload_overlap_ratio": round(statistics.median(overlaps), 3) if overlaps else None,
        "workload_tile_compute_s": round(tile_compute, 4),
    })
    per_step = [step_wall[s] / step_ideal[s] for s in steady if step_ideal[s]]
    fig["workload_vs_ideal_spread"] = None if not per_step else \
        [round(float(np.percentile(per_step, q)), 3) for q in (10, 90)]
    for k in ("workload_recovery_s", "workload_rss_growth_MiB"):  # one figure per run: no spread of rounds
        fig[f"{k}_spread"] = None if fig[k] is None else [fig[k], fig[k]]
    for k, xs in parts.items():  # where a steady step's time went (medians)
        fig[f"workload_step_{k}_ms"] = _pct(xs, 50)
    for q, tag in ((50, "p50"), (99, "p99"), (99.9, "p999")):
        fig[f"workload_version_load_ms_{tag}"] = _pct(loads_ms, q)
        fig[f"workload_field_wait_ms_{tag}"] = _pct(waits, q)
    return fig


def _consume(fset: Any, out: tuple[list[float], list[float], list[float]], timeout: float) -> tuple[int, float]:
    """The trainer's side of one batch: each field through a pipeline (staged copies), a
    reduction over each tile. Appends to ``out`` (the waits in ``next()``, first-tile times,
    overlap ratios); returns the bytes moved and the seconds of per-tile work."""
    waits, first_tiles, overlaps = out
    moved, work = 0, 0.0
    now = time.perf_counter
    for name in FIELDS:
        with fset[name].pipeline(zero_copy=False, timeout=timeout) as p:
            it = iter(p)
            while True:
                t0 = now()
                tile = next(it, None)
                if tile is None:
                    break
                waits.append(now() - t0)
                with tile:
                    t1 = now()
                    float(tile.array.sum())
                    work += now() - t1
            st = p.stats
        moved += st.bytes_moved
        if st.first_tile_s is not None:
            first_tiles.append(st.first_tile_s)
        if st.bytes_moved:
            overlaps.append(st.overlap_ratio)
    return moved, work


def _kill_and_restart(rt: Any, procs: _Rollouts, i: int, pid: int, fset: Any, kill: dict[str, Any], v: int,
                      out: tuple[list[float], list[float], list[float]], after_s: float,
                      timeout: float) -> tuple[Any, int]:
    """The run's fault: rollout ``i`` (which stalls before its last tile at this version) is
    killed ``after_s`` into the trainer's consumption of its batch; the trainer's pipeline must
    end in ``PeerLostError``. Then a new rollout ``i`` is started from the current version.
    Fills ``kill`` (``t``, ``error_s``, ``names_pid``, ``error``, ``recovered_s``,
    ``recovered_version``); returns the new batch's FieldSet and its version."""
    import memsem

    def shoot() -> None:
        kill["t"] = time.monotonic()  # before the signal: the trainer may see the death at once
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(after_s, shoot)
    timer.start()
    try:
        _consume(fset, out, timeout)
    except memsem.PeerLostError as exc:
        kill["error_s"] = time.monotonic() - kill["t"]
        kill["names_pid"] = f"pid {pid}" in str(exc)
        kill["error"] = str(exc)
    else:
        raise RuntimeError(f"rollout-{i}'s cut batch was consumed whole: its death was not seen")
    finally:
        timer.join(timeout)
    procs.procs[i].join(timeout)
    procs.conns[i].close()
    procs.start(i, v - 1, -1)  # the restart: the current version first, then each next one
    kill["restarted"] = i
    _, _, mv, t_loaded, _gen, data, _pid = procs.recv(i, timeout)
    kill["recovered_s"] = t_loaded - kill["t"]
    kill["recovered_version"] = mv
    return memsem.FieldSet.from_bytes(data, rt), mv


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


#: the workload's goals (issue 39): key, bound text, check
WORKLOAD_GOALS: tuple[tuple[str, str, Any], ...] = (
    ("workload_vs_ideal", "<= 1.3 (steady steps' wall time / copies at the measured bandwidth + compute)",
     lambda f: f["workload_vs_ideal"] <= 1.3),
    ("workload_recovery_s", "<= 3 x the liveness bound (workload_recovery_bound_s)",
     lambda f: f["workload_recovery_s"] <= 3 * liveness_bound_s()),
    ("workload_rss_growth_MiB", "<= 32 (the trainer's RSS, end against after step 2)",
     lambda f: f["workload_rss_growth_MiB"] <= 32),
)


#: the table's other rows: key, what it is
ROWS: tuple[tuple[str, str], ...] = (
    ("workload_vs_ideal_with_recovery", "x, every step after the first (the kill's included)"),
    ("workload_wall_s", "s, the steady steps"), ("workload_ideal_s", "s, their ideal"),
    ("workload_death_to_error_s", "s, the kill to the trainer's PeerLostError"),
    ("workload_error_names_rollout", "the error names the rollout's pid"),
    ("workload_restarted_holds_current", "the restarted rollout holds the current version"),
    ("workload_bounce_bytes", "B through intermediate buffers (trainer + rollouts)"),
    ("workload_first_tile_ms_p50", "ms, a field pipeline's first tile (p50)"),
    ("workload_overlap_ratio", "the field pipelines' overlap (median)"),
    ("workload_version_load_ms_p50", "ms, a commit to a rollout holding it"),
    ("workload_version_load_ms_p99", "ms"), ("workload_version_load_ms_p999", "ms"),
    ("workload_field_wait_ms_p50", "ms, the trainer in next() of a field's pipeline"),
    ("workload_field_wait_ms_p99", "ms"), ("workload_field_wait_ms_p999", "ms"),
    ("workload_step_commit_ms", "ms, a steady step's commit (update: one copy of the state dict)"),
    ("workload_step_loads_ms", "ms, a commit to the last rollout holding that version"),
    ("workload_step_rows_ms", "ms, then to the last row of the step consumed"),
    ("workload_seconds", "s, the whole run"),
)


def workload_goals(fig: dict[str, Any]) -> dict[str, str]:
    """``{key: "met" | "not met" | "skipped"}`` for each of ``WORKLOAD_GOALS``."""
    out = {}
    for key, _text, ok in WORKLOAD_GOALS:
        try:
            out[key] = "met" if ok(fig) else "not met"
        except (KeyError, TypeError):  # a figure is null: the run did not measure it
            out[key] = "skipped"
    return out


def figures(tiny: bool = False) -> dict[str, Any]:
    """The workload's figures at the issue's size (``FULL``; ``tiny``: the test's 16 MiB, 2
    rollouts, 3 steps), with the machine's load average before the run
    (``workload_loadavg``) and each goal's verdict (``workload_goals``)."""
    cfg = dict(TINY if tiny else FULL)
    load = os.getloadavg()
    fig = run_workload(**cfg)
    fig["workload_loadavg"] = [round(x, 2) for x in load]
    fig["workload_goals"] = workload_goals(fig)
    return fig


def print_table(fig: dict[str, Any], file: Any = None) -> None:
    """The workload's table, on stderr by default (stdout keeps the JSON line)."""
    import sys

    f = fig.get
    out = file if file is not None else sys.stderr
    g = fig.get("workload_goals", {})
    lines = [
        f"workload: a trainer committing {f('workload_state_dict_MiB')} MiB ({f('workload_tensors')} tensors) "
        f"each step, {f('workload_rollouts')} rollouts following it, {f('workload_steps')} steps, rollout "
        f"{(f('workload_rollouts') or 1) - 1} killed at step {f('workload_kill_step')}; load average before "
        f"{f('workload_loadavg')}",
        f"  copy bandwidth measured: {f('workload_copy_GBps')} GB/s one stream, {f('workload_copy_2stream_GBps')}"
        " GB/s two",
    ]
    for key, text, _ok in WORKLOAD_GOALS:
        lines.append(f"  {key:<34} {f(key)!s:>10}  goal {text}: {g.get(key, '-')}")
    for key, what in ROWS:
        lines.append(f"  {key:<34} {f(key)!s:>10}  {what}")
    print("\n".join(lines), file=out, flush=True)


def run_workload_cmd(args: Any) -> int:
    """``memsem bench --workload`` (the same run with ``--quick``; ``--json``: the figures as
    the last line of stdout; ``--out``: ``workload.json`` there; ``MEMSEM_BENCH_SMOKE=1``: the
    test's tiny run)."""
    from memsem_bench.measure import emit, smoke

    return emit(figures(tiny=smoke()), args, "workload.json", print_table)


__all__ = ["FULL", "TINY", "WORKLOAD_GOALS", "figures", "liveness_bound_s", "print_table", "run_workload", "run_workload_cmd",
           "transformer_state_dict", "workload_goals"]
