"""Same TransferQueue workload against one storage backend; prints wall time and bytes moved.

    python tests/tq/bench_tq.py --backend SimpleStorage [--batches 8 --batch-size 32 --seq-len 4096]
    python tests/tq/bench_tq.py --backend Probe          (tests/tq on PYTHONPATH)

Workload: a Ray task (the producer) puts --batches TensorDicts of
{"tokens": int64 [B, L], "logprobs": float32 [B, L]} into one partition and exits;
the driver (the consumer) then get_meta/get_data's every batch, checks it bit for bit,
and clears the partition. So every get reads data whose putting process is gone.

Measured, per phase (put / get / clear), with nothing else running on the machine:
  wall_s        wall time of the phase (put: the producer's put calls only)
  lo_bytes      bytes the loopback interface carried (/proc/net/dev 'lo' rx): ZMQ/TCP
                traffic, so every byte here was copied user->kernel->user at least twice
  cpu_s         CPU seconds the whole machine spent (/proc/stat, all cores): copies,
                serialization and Ray's own work together
  payload       tensor bytes the workload moved (B*L*(8+4) per batch)
A backend's own counters (e.g. memsem telemetry) can be added to the JSON through
--extra-stats MODULE:FUNC, a zero-argument function returning a dict, called per phase.
Prints one JSON line; --json FILE also writes it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def lo_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])  # rx bytes (== tx on lo)
    return 0


def cpu_seconds() -> float:
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    ticks = [int(x) for x in parts]
    busy = sum(ticks) - ticks[3] - ticks[4]  # minus idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


class Phase:
    def __init__(self, name: str, extra=None):
        self.name, self.extra = name, extra

    def __enter__(self):
        self.t0, self.lo0, self.c0 = time.perf_counter(), lo_bytes(), cpu_seconds()
        self.x0 = self.extra() if self.extra else {}
        return self

    def __exit__(self, *exc):
        self.result = {
            "wall_s": round(time.perf_counter() - self.t0, 4),
            "lo_bytes": lo_bytes() - self.lo0,
            "cpu_s": round(cpu_seconds() - self.c0, 3),
        }
        if self.extra:
            x1 = self.extra()
            self.result.update({k: x1[k] - self.x0.get(k, 0) for k in x1 if isinstance(x1[k], int | float)})


def backend_config(name: str, batches: int, batch_size: int) -> dict:
    if name == "SimpleStorage":
        section = {"total_storage_size": batches * batch_size * 2, "num_data_storage_units": 2}
    else:
        section = {}
    return {"controller": {"polling_mode": True}, "backend": {"storage_backend": name, name: section}}


def make_batch(i: int, batch_size: int, seq_len: int):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(i)
    return TensorDict(
        {
            "tokens": torch.randint(0, 50000, (batch_size, seq_len), generator=g, dtype=torch.int64),
            "logprobs": torch.randn(batch_size, seq_len, generator=g, dtype=torch.float32),
        },
        batch_size=batch_size,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--backend-module", action="append", default=[], help="import to register a backend")
    ap.add_argument("--extra-stats", default=None, help="MODULE:FUNC returning a dict of counters")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    os.environ.setdefault("RAY_OVERRIDE_RESOURCES", '{"CPU": 8}')
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    modules = args.backend_module or (["probe_backend"] if args.backend == "Probe" else [])
    for m in modules:
        importlib.import_module(m)
    extra = None
    if args.extra_stats:
        mod, func = args.extra_stats.split(":")
        extra = getattr(importlib.import_module(mod), func)

    import ray
    import torch
    from omegaconf import OmegaConf

    import transfer_queue as tq

    runtime_env = {}
    if modules:
        os.environ["TQ_BENCH_MODULES"] = ",".join(modules)
        runtime_env["worker_process_setup_hook"] = "bench_tq.worker_setup"
    ray.init(runtime_env=runtime_env or None)
    t_init = time.perf_counter()
    tq.init(OmegaConf.create(backend_config(args.backend, args.batches, args.batch_size)))
    init_s = time.perf_counter() - t_init
    partition = "bench"
    bs, L = args.batch_size, args.seq_len
    payload = args.batches * bs * L * (8 + 4)

    # max_calls=1: the worker process exits after the task, so every get below reads
    # data whose putting process is gone. The producer times its own puts (batches are
    # built before the clock starts); lo/cpu cover the whole task, worker start included.
    @ray.remote(max_calls=1)
    def producer(n: int, bs: int, L: int) -> tuple[int, float]:
        import time

        import transfer_queue as tq

        tq.init()
        client = tq.get_client()
        batches = [make_batch(i, bs, L) for i in range(n)]
        t0 = time.perf_counter()
        for b in batches:
            client.put(data=b, partition_id=partition)
        return os.getpid(), time.perf_counter() - t0

    results = {}
    with Phase("put", extra) as ph:
        producer_pid, put_s = ray.get(producer.remote(args.batches, bs, L))
    results["put"] = ph.result
    results["put"]["wall_s"] = round(put_s, 4)
    for _ in range(50):
        if not os.path.exists(f"/proc/{producer_pid}"):
            break
        time.sleep(0.1)
    producer_exited = not os.path.exists(f"/proc/{producer_pid}")

    client = tq.get_client()
    got = []
    with Phase("get", extra) as ph:
        for _ in range(args.batches):
            meta = client.get_meta(
                partition_id=partition, data_fields=["tokens", "logprobs"], batch_size=bs,
                mode="fetch", task_name="bench",
            )
            got.append(client.get_data(meta))
    results["get"] = ph.result

    # Verify outside the timed window: every batch back bit for bit.
    expected = {}
    for i in range(args.batches):
        b = make_batch(i, bs, L)
        for r in range(bs):
            expected[b["tokens"][r, 0].item(), b["tokens"][r, 1].item()] = (b["tokens"][r], b["logprobs"][r])
    ok = 0
    for td in got:
        tokens = td["tokens"]
        logprobs = td["logprobs"]
        for r in range(len(tokens)):
            t = tokens[r]
            e = expected[t[0].item(), t[1].item()]
            ok += int(torch.equal(t, e[0]) and torch.equal(logprobs[r], e[1]))

    with Phase("clear", extra) as ph:
        client.clear_partition(partition)
    results["clear"] = ph.result

    out = {
        "backend": args.backend,
        "batches": args.batches,
        "batch_size": bs,
        "seq_len": L,
        "payload_bytes": payload,
        "init_s": round(init_s, 3),
        "rows_verified": ok,
        "rows_expected": args.batches * bs,
        "producer_exited_before_get": producer_exited,
        **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()},
    }
    out["lo_bytes_per_payload_byte"] = round((out["put_lo_bytes"] + out["get_lo_bytes"]) / payload, 3)
    line = json.dumps(out)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    tq.close()
    ray.shutdown()
    for m in modules:  # tq.close() tears down only TQ's own backends
        cleanup = getattr(sys.modules[m], "remove_run_dirs", None)
        if callable(cleanup):
            cleanup()
    return 0 if ok == args.batches * bs else 1


def worker_setup() -> None:
    for m in os.environ.get("TQ_BENCH_MODULES", "").split(","):
        if m:
            importlib.import_module(m)


if __name__ == "__main__":
    sys.exit(main())
