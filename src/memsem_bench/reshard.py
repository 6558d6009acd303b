"""Sharded weight sync, measured: reshard on read against the two paths a user has without it.

``memsem bench --reshard [--json]``. Four trainer ranks hold a Llama-shaped bf16 model (at least
256 MiB; ``MEMSEM_RESHARD_MODEL_MIB``) as FSDP2 holds it: every tensor ``Shard(0)`` over the 4
ranks. Two rollout replicas of tensor parallel degree 2 (4 processes) want it in vLLM's layout:
fused ``qkv_proj`` and ``gate_up_proj`` split by rows, ``o_proj`` and ``down_proj`` by columns,
norms whole. All 8 processes are one gloo world (the baselines' transport), on this machine.

Per round, same processes, same bytes:

* **reshard on read** (memsem): every trainer rank commits its shards
  (``memsem.sync.publish_sharded``); every rollout rank loads exactly its slice of that version
  from every rank (``ShardedReader.load``). Time: from the loads' start to the last one's end.
* **gather + broadcast** (today's path, verl's): the trainer gathers the full model on rank 0
  (``dist.gather`` over gloo), rank 0 commits it to its state-dict window
  (``StateDictRef.update``), every rollout rank loads the whole state dict and cuts its slices
  out (``torch.cat`` of ``torch.chunk``). Time: gather + commit + the slowest rollout.
* **DTensor redistribute**: every trainer rank makes each tensor whole (``DTensor.full_tensor()``:
  the all-gather of ``redistribute`` to ``Replicate``, over gloo), cuts rollout rank r's slices
  and sends them to it (``dist.send``; trainer r serves rollout r). Time: until the last rank
  is done.

Keys: ``reshard_bytes_moved_ratio`` (bytes the rollouts' loads copied, the sum of the ranges
they read, / bytes they hold; goal 1.0), ``reshard_vs_gather_broadcast`` (>= 2) and
``reshard_vs_dtensor_redistribute`` (>= 3) (medians of per-round ratios, ``_spread`` their
[p10, p90]), ``reshard_plan_ms_1000_tensors`` (planning a 1,000-tensor model once; <= 100),
``reshard_trainer_blocked_ms`` (a trainer rank's wait for readers per version while the rollouts
load the previous one; <= 1), and the raw times.

**Relays of sharded slices** (after those rounds): replica 0's ranks load each version from the
trainer ranks and serve it (``ShardedRelay``), then replica 1's ranks load it from them, checked
against each trainer rank's digest of their runs (``ShardedRelayReader``). Keys:
``reshard_relay_trainer_bytes_ratio`` (bytes the trainer ranks served, digests included, with
the relays / without them, the reshard rounds' bytes; 1 / replicas when no child falls back),
``reshard_relay_s`` (replica 0's loads, then replica 1's: one node, so the copy from a relay
costs what a copy from the trainer does; the figure is the bytes), ``reshard_relay_fallbacks``.

**Deltas** (after those rounds, same processes): every trainer rank changes 1% of its elements,
spread over every tensor (``index_add_`` at random indices: what an AdamW step does to a bf16
copy), commits and waits for its delta record; every rollout rank loads that version into the
tensors its last load filled (a delta: the records' patches through its plan,
``ShardedReader``), then the same version in full with a reader of its own (``delta=False``).
Keys: ``reshard_delta_bytes_ratio_1pct`` (bytes the delta loads moved, window bytes and record
bytes, / bytes the rollouts hold; goal <= 0.05) and ``reshard_delta_vs_full_1pct`` (delta load
time / full load time, median of per-round ratios; goal <= 0.15: on one node a copy costs about
what the delta's digests of the reader's own tensors cost, so the figure says what the checks
cost, and a reader across nodes gains what the bytes not moved would have taken).
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from memsem_bench import measure as M

_CTX = mp.get_context("spawn")
MiB = 1 << 20
TRAINERS, REPLICAS, TP = 4, 2, 2
GOALS = {
    "reshard_bytes_moved_ratio": "== 1.0",
    "reshard_vs_gather_broadcast": ">= 2",
    "reshard_vs_dtensor_redistribute": ">= 3",
    "reshard_plan_ms_1000_tensors": "<= 100",
    "reshard_trainer_blocked_ms": "<= 1",
    "reshard_delta_bytes_ratio_1pct": "<= 0.05",
    "reshard_delta_vs_full_1pct": "<= 0.15",
}
#: fraction of each trainer rank's elements a delta round changes
DELTA_FRAC = 0.01
TP_RULES: dict[str, Any] = {
    "row": ["o_proj.weight", "down_proj.weight"], "column": ["embed_tokens.weight"],
    "fused": {"qkv_proj.weight": ["q_proj.weight", "k_proj.weight", "v_proj.weight"],
              "gate_up_proj.weight": ["gate_proj.weight", "up_proj.weight"]}}


def model_shapes(mib: int, *, hidden: int = 2048, inter: int = 5632, kv: int = 512, vocab: int = 8192,
                 layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """A Llama-shaped model of at least ``mib`` MiB of bf16 (or of ``layers`` layers): an
    embedding and its layers (q, k, v, o, gate, up, down and two norms each)."""
    layer = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,)}
    out = {"embed_tokens.weight": (vocab, hidden)}
    per = sum(math.prod(s) for s in layer.values()) * 2
    if layers is None:
        layers = max(1, -(-(mib * MiB - vocab * hidden * 2) // per))
    for i in range(layers):
        out.update({f"layers.{i}.{k}": s for k, s in layer.items()})
    out["norm.weight"] = (hidden,)
    return out


def _targets(names: Any, rank: int) -> dict:
    from memsem.sync import tp_targets

    return tp_targets(names, degree=TP, rank=rank, **TP_RULES)


def _slices(full: dict, targets: dict) -> dict:
    """The targets cut from whole tensors with torch (the baselines' slicing)."""
    import torch

    out = {}
    for n, t in targets.items():
        parts = [full[s] if t.dim is None else torch.chunk(full[s], t.degree, dim=t.dim)[t.rank] for s in t.sources]
        out[n] = torch.cat(parts, dim=t.cat_dim).contiguous() if len(parts) > 1 else parts[0].contiguous()
    return out


# -- the processes ---------------------------------------------------------------------------------
def _worker(conn: Any, rank: int, port: int, job: str, shapes: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MEMSEM_JOB=job)
    import torch
    import torch.distributed as dist

    import memsem
    from memsem.gva import RefSpec
    from memsem.sync import Shard, ShardedRelay, local_box, lookup_sharded, publish_sharded

    world = TRAINERS + REPLICAS * TP
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tg = dist.new_group(list(range(TRAINERS)))
    trainer = rank < TRAINERS
    try:
        with memsem.Runtime(timeout=300) as rt:
            if trainer:
                from torch.distributed.device_mesh import DeviceMesh
                from torch.distributed.tensor import DTensor
                from torch.distributed.tensor import Shard as TShard

                mesh = DeviceMesh.from_group(tg, "cpu")
                boxes = {n: local_box(s, (TRAINERS,), (rank,), [Shard(0)]) for n, s in shapes.items()}
                local = {n: torch.full(b[1], 1.0, dtype=torch.bfloat16) for n, b in boxes.items()}
                pub = publish_sharded(rt, local, name="bench", rank=rank, world_size=TRAINERS,
                                      placements={n: [Shard(0)] for n in shapes}, global_shapes=shapes)
                full_ref = None
                if rank == 0:
                    full_ref = rt.publish_state_dict({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()},
                                                     name="bench-full")
            else:
                r = rank - TRAINERS
                sd = lookup_sharded(rt, "bench", timeout=300)
                targets = _targets(sd.names, r % TP)
                # a delta whenever the histories allow (delta_wait given): the delta rounds time the
                # delta itself, where the default would load in full once a delta was slower
                reader = sd.reader(targets, reader=r // TP, delta_wait=300)
                into = reader.empty()
                full_ref = rt.lookup_state_dict("bench-full", timeout=300)
                full_into = full_ref.empty_like()
                in_full = sd.reader(targets, reader=r // TP, delta=False)  # the delta rounds' baseline
                in_full_into = in_full.empty()
                # relays of sharded slices: replica 0's ranks serve, replica 1's load from them
                if r // TP == 0:
                    relay = ShardedRelay(rt, sd.reader(targets, delta=False), name=f"bench@tp{r % TP}")
                else:
                    child = sd.relay_reader(targets, relay=f"bench@tp{r % TP}", timeout=300)
                relay_into = in_full.empty()
            conn.send({"ready": True, "targets_bytes": None if trainer else reader.plan.target_bytes(),
                       "plan_runs": None if trainer else reader.plan.n_runs})
            while True:
                cmd = conn.recv()
                op = cmd["op"]
                if op == "exit":
                    break
                step = cmd.get("step", 0)
                t0 = time.perf_counter()
                out: dict[str, Any] = {}
                if op == "commit":
                    for t in local.values():
                        t.fill_(float(step))
                    t1 = time.perf_counter()
                    out["version"] = pub.update(local)
                    out["update_s"] = time.perf_counter() - t1
                    out["blocked_s"] = pub.blocked_s
                elif op == "spread":  # DELTA_FRAC of every tensor's elements, spread over it
                    g = torch.Generator().manual_seed(step * TRAINERS + rank)
                    for t in local.values():
                        flat = t.view(-1)
                        idx = torch.randint(0, flat.numel(), (max(1, int(DELTA_FRAC * flat.numel())),), generator=g)
                        flat.index_add_(0, idx, torch.ones(len(idx), dtype=flat.dtype))
                    out["version"] = v = pub.update(local)
                    # the record is made off the trainer's path: the rollouts' delta_wait need not cover it
                    pub.ref.runtime.wait_version(RefSpec.from_bytes(pub.ref.layout.delta.index), v, 300)
                elif op == "load_in_full":
                    out["version"] = in_full.load(in_full_into, version=step)
                elif op == "load":
                    before = reader.bytes_moved
                    out["version"] = reader.load(into, version=step)
                    out["bytes"] = reader.bytes_moved - before
                elif op == "relay_load":  # replica 0: from the trainer ranks, then served
                    before = relay.reader.window_bytes
                    out["version"] = relay.load(relay_into, version=step)
                    out["trainer_bytes"] = relay.reader.window_bytes - before
                elif op == "child_load":  # replica 1: from the relay, checked by the trainer's digests
                    before = child.trainer_reader.window_bytes
                    out["version"] = child.load(relay_into, version=step)
                    out["trainer_bytes"] = child.trainer_reader.window_bytes - before
                    out["digest_bytes"] = 16 * len(child.plan.ranks)
                    out["fallbacks"] = len(child.fallbacks)
                elif op == "gather":
                    full = {}
                    for n, t in local.items():
                        parts = [torch.empty_like(t) for _ in range(TRAINERS)] if rank == 0 else None
                        dist.gather(t, parts, dst=0, group=tg)
                        if rank == 0:
                            full[n] = torch.cat(parts)
                    if rank == 0:
                        out["version"] = full_ref.update(full)
                elif op == "load_full":
                    out["version"] = full_ref.load(full_into)
                    for n, t in _slices(full_into, targets).items():
                        into[n].copy_(t)
                elif op == "dtensor":
                    dist.barrier()
                    t0 = time.perf_counter()
                    if trainer:
                        full = {n: DTensor.from_local(t, mesh, [TShard(0)], run_check=False, shape=torch.Size(shapes[n]),
                                                      stride=torch.empty(shapes[n], device="meta").stride()).full_tensor()
                                for n, t in local.items()}
                        names = list(full)
                        for n, t in _slices(full, _targets(names, rank % TP)).items():
                            dist.send(t, dst=TRAINERS + rank)
                    else:
                        for n in reader.plan.names:
                            dist.recv(into[n], src=r)
                out["s"] = time.perf_counter() - t0
                conn.send(out)
            if not trainer and r // TP == 0:
                relay.close()
            if trainer:
                pub.close()
                if full_ref is not None:
                    rt.unpublish_spec(full_ref.spec)
    finally:
        dist.destroy_process_group()


def plan_ms_1000_tensors(repeat: int = 3) -> tuple[float, int]:
    """Milliseconds to plan a 1,000-tensor model (111 Llama layers of hidden 1024 over 4 ranks,
    ``Shard(0)``) for one TP-2 rank, best of ``repeat``; and the plan's runs."""
    from memsem.sync import Shard, ShardedLayout, plan_reshard

    shapes = model_shapes(0, hidden=1024, inter=2816, kv=256, vocab=1024, layers=111)
    names = list(shapes)[:1000]
    layout = ShardedLayout.synthetic({n: (shapes[n], "bfloat16") for n in names}, (TRAINERS,),
                                     {n: [Shard(0)] for n in names})
    targets = _targets(names, 1)
    best, runs = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = plan_reshard(layout, targets, reader=1)
        best = min(best, time.perf_counter() - t0)
        runs = plan.n_runs
    return best * 1e3, runs


def figures(model_mib: int = 256, rounds: int = 3, log: Any = None) -> dict[str, Any]:
    """Run the three paths ``rounds`` times over the same 8 processes; the keys (module docstring)."""
    import secrets

    say = log or (lambda s: None)
    shapes = model_shapes(model_mib) if model_mib >= 64 else model_shapes(
        model_mib, hidden=256, inter=704, kv=64, vocab=512)
    model_bytes = sum(math.prod(s) for s in shapes.values()) * 2
    port, job = M.free_port(), f"bench-reshard-{os.getpid()}-{secrets.token_hex(3)}"
    world = TRAINERS + REPLICAS * TP
    pipes, procs = [], []
    for r in range(world):
        a, b = _CTX.Pipe()
        p = _CTX.Process(target=_worker, args=(b, r, port, job, shapes), daemon=True)
        p.start()
        b.close()
        pipes.append(a)
        procs.append(p)

    def recv(i: int, timeout: float = 600.0) -> dict:
        if not pipes[i].poll(timeout):
            raise RuntimeError(f"bench process {i} sent nothing for {timeout} s (exit code {procs[i].exitcode})")
        return pipes[i].recv()

    def run(ranks: range, op: str, step: int = 0) -> tuple[float, list[dict]]:
        t0 = time.perf_counter()
        for i in ranks:
            pipes[i].send({"op": op, "step": step})
        outs = [recv(i) for i in ranks]
        return time.perf_counter() - t0, outs

    trainers, rollouts = range(TRAINERS), range(TRAINERS, world)
    try:
        for i in trainers:
            recv(i)
        ready = [recv(i) for i in rollouts]
        held = sum(x["targets_bytes"] for x in ready)
        say(f"reshard bench: {model_bytes / MiB:.0f} MiB model, {len(shapes)} tensors, {TRAINERS} trainer ranks -> "
            f"{REPLICAS} x TP{TP}; rollouts hold {held / MiB:.0f} MiB in {sum(x['plan_runs'] for x in ready)} runs")
        step = 1
        rs, gb, dt, blocked, moved, commit = [], [], [], [], [], []
        for rnd in range(rounds):
            step += 1
            _, outs = run(trainers, "commit", step)
            commit.append(max(o["update_s"] for o in outs))
            w, outs = run(rollouts, "load", step)
            if any(o["version"] != step for o in outs):
                raise RuntimeError(f"a rollout loaded version {[o['version'] for o in outs]}, not {step}")
            rs.append(w)
            moved.append(sum(o["bytes"] for o in outs) / held)
            # the trainer commits the next version while the rollouts load this one again
            for i in rollouts:
                pipes[i].send({"op": "load", "step": step})
            _, touts = run(trainers, "commit", step + 1)
            for i in rollouts:
                recv(i)
            blocked.append(max(o["blocked_s"] for o in touts))
            step += 1
            g, _ = run(trainers, "gather", step)
            lf, _ = run(rollouts, "load_full", step)
            gb.append(g + lf)
            d, _ = run(range(world), "dtensor", step)
            dt.append(d)
            say(f"round {rnd + 1}/{rounds}: reshard {rs[-1] * 1e3:.0f} ms, gather+broadcast {gb[-1] * 1e3:.0f} ms, "
                f"DTensor full_tensor+send {dt[-1] * 1e3:.0f} ms, trainer blocked {blocked[-1] * 1e3:.3f} ms")
        # relays: the trainer ranks serve replica 0 only (replica 1: 16-byte digests per rank)
        rl, rbytes, rfall = [], [], 0
        replica0 = range(TRAINERS, TRAINERS + TP)
        replica1 = range(TRAINERS + TP, world)
        for rnd in range(rounds):
            step += 1
            run(trainers, "commit", step)
            w0, outs0 = run(replica0, "relay_load", step)
            w1, outs1 = run(replica1, "child_load", step)
            if any(o["version"] != step for o in outs0 + outs1):
                raise RuntimeError(f"a relayed load got version {[o['version'] for o in outs0 + outs1]}, not {step}")
            rl.append(w0 + w1)
            rbytes.append(sum(o["trainer_bytes"] + o.get("digest_bytes", 0) for o in outs0 + outs1) / held)
            rfall += sum(o["fallbacks"] for o in outs1)
            say(f"relay round {rnd + 1}/{rounds}: replica 0 {w0 * 1e3:.0f} ms then replica 1 from it "
                f"{w1 * 1e3:.0f} ms; trainer bytes served {rbytes[-1]:.4f} of the bytes held")
        dl, fl, dmoved = [], [], []
        run(rollouts, "load", step)  # into holds this version again (the baselines wrote over it)
        run(rollouts, "load_in_full", step)  # the full reader's first load (its tensors touched once)
        for rnd in range(rounds):
            step += 1
            _, outs = run(trainers, "spread", step)
            if any(o["version"] != step for o in outs):
                raise RuntimeError(f"a trainer committed version {[o['version'] for o in outs]}, not {step}")
            w, outs = run(rollouts, "load", step)
            dl.append(w)
            dmoved.append(sum(o["bytes"] for o in outs) / held)
            f, _ = run(rollouts, "load_in_full", step)
            fl.append(f)
            say(f"delta round {rnd + 1}/{rounds}: {DELTA_FRAC:.0%} of elements changed, delta load {w * 1e3:.0f} ms "
                f"({dmoved[-1]:.4f} of the bytes held), full load {f * 1e3:.0f} ms")
        for i in range(world):
            pipes[i].send({"op": "exit"})
    finally:
        for p in procs:
            p.join(60)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    plan_ms, plan_runs = plan_ms_1000_tensors()
    out: dict[str, Any] = {
        "reshard_bytes_moved_ratio": round(statistics.median(moved), 4),
        **M.ratio_of_rounds(gb, rs).keys("reshard_vs_gather_broadcast"),
        **M.ratio_of_rounds(dt, rs).keys("reshard_vs_dtensor_redistribute"),
        "reshard_plan_ms_1000_tensors": round(plan_ms, 2),
        "reshard_trainer_blocked_ms": round(statistics.median(blocked) * 1e3, 3),
        "reshard_delta_bytes_ratio_1pct": round(statistics.median(dmoved), 4),
        **M.ratio_of_rounds(dl, fl).keys("reshard_delta_vs_full_1pct"),
        "reshard_relay_trainer_bytes_ratio": round(statistics.median(rbytes) / statistics.median(moved), 4),
        "reshard_relay_s": round(statistics.median(rl), 4),
        "reshard_relay_fallbacks": rfall,
        "reshard_delta_s_1pct": round(statistics.median(dl), 4),
        "reshard_full_s_1pct": round(statistics.median(fl), 4),
        "reshard_s": round(statistics.median(rs), 4),
        "gather_broadcast_s": round(statistics.median(gb), 4),
        "dtensor_redistribute_s": round(statistics.median(dt), 4),
        "reshard_trainer_commit_ms": round(statistics.median(commit) * 1e3, 2),
        "reshard_model_MiB": round(model_bytes / MiB, 1),
        "reshard_rollout_held_MiB": round(held / MiB, 1),
        "reshard_plan_runs_1000_tensors": plan_runs,
        "reshard_rounds": rounds,
    }
    return out


def run_reshard(args: Any) -> int:
    """``memsem bench --reshard``: the table, and with ``--json`` the keys as the last line."""
    smoke = M.smoke()
    mib = int(os.environ.get("MEMSEM_RESHARD_MODEL_MIB", "8" if smoke else "256"))
    rounds = 1 if smoke else 2 if getattr(args, "quick", False) else 5
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    f = figures(mib, rounds, log)
    out = getattr(args, "out", None)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "reshard.json"), "w") as fh:
            json.dump(f, fh, indent=1)
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout
    for k, goal in GOALS.items():
        print(f"{k:<36} {f.get(k)!s:>10}   goal {goal}", file=stream)
    for k in ("reshard_relay_trainer_bytes_ratio", "reshard_relay_s", "reshard_relay_fallbacks",
              "reshard_s", "gather_broadcast_s", "dtensor_redistribute_s", "reshard_trainer_commit_ms",
              "reshard_delta_s_1pct", "reshard_full_s_1pct"):
        print(f"{k:<36} {f.get(k)!s:>10}", file=stream)
    if getattr(args, "json", False):
        print(json.dumps(f))
    return 0


__all__ = ["GOALS", "figures", "model_shapes", "plan_ms_1000_tensors", "run_reshard"]
