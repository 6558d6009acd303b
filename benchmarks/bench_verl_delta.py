"""The verl backend's syncs with and without deltas (issue 36), in one process on one node.

A trainer engine and ``--rollouts`` rollout engines (a chain), set up as verl does, each with
its own runtime on the local directory, sync a bf16 state dict of ``--mib`` MiB in ``--tensors``
tensors (buckets of ``--bucket-mib`` MiB). Per change (0, 0.01 and 1.0 of the elements, chosen
at random; 0 shows what a sync costs besides moving and checking bytes: windows published and
retired, the bucket stream's waits): a sync by engines made with ``delta=False`` and one by engines with ``delta=True``
(holding the previous version), in turns, ``--rounds`` each. Printed (the last line with
``--json``): per change, the median of each round's delta sync time / full sync time
(``verl_delta_vs_full_<pct>``) and the data bytes the trainer sent / the buckets' data bytes
(``verl_delta_bytes_ratio_<pct>``); every sync's tensors compared bit for bit with the trainer's.

Runs in .venv-verl: ``.venv-verl/bin/python benchmarks/bench_verl_delta.py [--json]``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import torch

from memsem.integrations import verl as mv


def _engines(bucket: int, rollouts: int, delta: bool):
    trainer = mv.MemsemCheckpointEngine(bucket, is_master=True, directory="local", timeout=300.0, delta=delta)
    return trainer, [mv.MemsemCheckpointEngine(bucket, directory="local", timeout=300.0) for _ in range(rollouts)]


def _sync(trainer, rollouts, sd: dict, step: int) -> tuple[float, dict]:
    """One sync (prepare, topology, init, send and receive, finalize): seconds, trainer's metrics."""
    t0 = time.perf_counter()
    everyone = [trainer] + rollouts
    md = [e.prepare() for e in everyone]
    actor, ro = mv.MemsemCheckpointEngine.build_topology(1, len(rollouts), md)
    trainer.init_process_group(actor["rank"][0], actor["world_size"][0], actor["master_metadata"][0],
                               rollouts=actor["rollouts"][0])
    for k, e in enumerate(rollouts):
        e.init_process_group(ro["rank"][k], ro["world_size"][k], ro["master_metadata"][k],
                             rollouts=ro["rollouts"][k], upstream=ro["upstream"][k])
    wrong: list[str] = []

    async def receive(e):
        async for name, w in e.receive_weights(global_steps=step):
            if not torch.equal(w.view(torch.uint8), sd[name].view(torch.uint8)):
                wrong.append(name)

    async def run():
        return await asyncio.gather(trainer.send_weights(iter(sd.items()), global_steps=step),
                                    *[receive(e) for e in rollouts])

    metrics = asyncio.run(run())[0]
    for e in everyone:
        e.finalize()
    if wrong:
        raise SystemExit(f"tensors not the trainer's after a sync: {wrong[:5]}")
    return time.perf_counter() - t0, metrics


def _change(sd: dict, fraction: float, g: torch.Generator) -> dict:
    out = {}
    for name, t in sd.items():
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:int(fraction * flat.numel())]
        flat[idx] += 1
        out[name] = t
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    n = a.mib * (1 << 20) // 2 // a.tensors
    sd = {f"t{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i in range(a.tensors)}
    bucket = a.bucket_mib << 20
    full, delta = _engines(bucket, a.rollouts, False), _engines(bucket, a.rollouts, True)
    fig: dict = {"verl_model_mib": a.mib, "verl_bucket_mib": a.bucket_mib, "verl_rollouts": a.rollouts}
    try:
        step = 1
        _sync(*delta, sd, step)  # the delta engines hold a version
        for label, frac in (("0pct", 0.0), ("1pct", 0.01), ("100pct", 1.0)):
            ratios, sent = [], []
            for r in range(a.rounds):
                step += 1
                sd = _change(sd, frac, g)
                order = (full, delta) if r % 2 else (delta, full)
                times = {}
                for eng in order:
                    s, m = _sync(*eng, sd, step)
                    times[eng is delta] = s
                    if eng is delta:
                        sent.append(m["memsem/sent_bytes"] / m["memsem/bucket_bytes"])
                ratios.append(times[True] / times[False])
                print(f"{label} round {r}: delta {times[True]:.3f} s, full {times[False]:.3f} s", file=sys.stderr)
            fig[f"verl_delta_vs_full_{label}"] = round(statistics.median(ratios), 4)
            fig[f"verl_delta_bytes_ratio_{label}"] = round(statistics.median(sent), 4)
    finally:
        for e in [*full[1], full[0], *delta[1], delta[0]]:
            e.close()
    print(json.dumps(fig) if a.json else "\n".join(f"{k}: {v}" for k, v in fig.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
