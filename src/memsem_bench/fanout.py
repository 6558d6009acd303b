"""Fan-out of weight versions to rollout nodes over shaped links: star, relay and gloo, same run.

``memsem bench --fanout [--json]`` (root: it makes network namespaces). A trainer node and N
rollout nodes (N = 1, 2, 4, 8) on a bridge, every node's link shaped with ``tc tbf`` to
``--rate-mbit`` in each direction, packets queued at most ``MEMSEM_FANOUT_QUEUE_MS`` (default 50;
tbf's ``latency``) (tests/netns/netns.py: ``star(rate_mbit=)``; so it needs a
source checkout), a redis directory in the trainer's namespace. For each N, in the same
namespaces:

* **star**: every rollout reads each chunk from the trainer (``Relay(plan="star")``);
* **relay**: ``Relay(plan="auto")`` with the shaped rate as the link model (a chain here), and
  a binary **tree** (N >= 4) to validate the tree model;
* **gloo**: ``torch.distributed.broadcast`` (gloo backend) of the same bytes over the same links.

Times are from the start of the trainer's commit (its copy and digests included) until the
last rollout's ``load`` returned with the version bit-exact; gloo's from the broadcast's start
(after a barrier) until the last rank returned. The trainer's egress is its veth0's byte
counter (headers included) over the model bytes.

The model (``memsem.model_time``) gets the link rate (``rate x 1448 / 1514``: TCP payload in
Ethernet frames of MTU 1500), the chunk size and a per-hop latency measured in the run (two
small-get round trips, one for the ready word's push and one for the request, plus the digest of
one chunk), plus the trainer's measured commit time. ``fanout_model_error`` is its worst
relative error over the measured star, chain and tree points.

Keys (the last line of stdout with ``--json``): ``fanout_relay_8r_vs_1r`` (goal <= 1.3),
``fanout_trainer_egress_ratio`` (<= 1.1), ``fanout_star_vs_relay_8r`` (>= 4),
``fanout_gloo_vs_relay_8r`` (>= 1.2), ``fanout_model_error`` (<= 0.25), and the raw times.
"""
from __future__ import annotations

from memsem_bench import CHECKOUT

import json
import os
import pathlib
import secrets
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20
ENGINES = ("loopback", "host", "tcp")
GOALS = {
    "fanout_relay_8r_vs_1r": "<= 1.3",
    "fanout_trainer_egress_ratio": "<= 1.1",
    "fanout_star_vs_relay_8r": ">= 4",
    "fanout_gloo_vs_relay_8r": ">= 1.2",
    "fanout_model_error": "<= 0.25",
}
#: TCP payload per Ethernet frame at MTU 1500 (timestamps on): what tbf's rate leaves for data
PAYLOAD_EFFICIENCY = 1448 / 1514


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _model(mib: int, step: int) -> dict[str, Any]:
    import numpy as np

    n = 16
    per = mib * MiB // n // 4
    return {f"layer{i}.w": np.full(per, float(step * 100 + i), np.float32) for i in range(n)}


# -- nodes (run inside the namespaces) ----------------------------------------------------------------
def node_trainer(a: Any) -> None:
    import memsem

    with memsem.Runtime(engines=ENGINES, timeout=300) as rt:
        src = memsem.FanoutSource(rt, _model(a.model_mib, 1), name="policy", chunk_bytes=a.chunk_kib << 10)
        say(ready=True, version=src.version(), nbytes=src.nbytes)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("exit"):
                break
            sd = _model(a.model_mib, cmd["step"])
            t0 = time.monotonic()
            v = src.update(sd)
            say(version=v, t0=t0, t1=time.monotonic(), digest_s=src.digest_s)
        src.close()


def node_rollout(a: Any) -> None:
    import hashlib

    import numpy as np

    import memsem

    with memsem.Runtime(engines=ENGINES, timeout=300) as rt:
        link = memsem.LinkModel(a.rate_mbit * 1e6 / 8 * PAYLOAD_EFFICIENCY, a.hop_s)
        relay = memsem.Relay(rt, "policy", rank=a.rank, world=a.world, plan=memsem.fanout_plan(
            a.world, kind=a.plan, model_bytes=a.model_mib * MiB, chunk_bytes=a.chunk_kib << 10, link=link),
            link=link, timeout=300)  # the link also sets the chunks in flight (Relay.auto_depth)
        relay.prepare(60)
        into = rt.lookup_state_dict("policy").empty_like("numpy")
        relay.load(into, version=1, timeout=600)  # the version published at start: not timed
        extra: dict[str, Any] = {"plan": relay.plan.kind, "why": relay.plan.why}
        if a.latency:
            small = rt.lookup("policy").bytes(0, 64)
            out = np.empty(64, np.uint8)
            ts = []
            for _ in range(40):
                t = time.perf_counter()
                small.get(out=out)
                ts.append(time.perf_counter() - t)
            chunk = np.ones(a.chunk_kib << 10, np.uint8)
            hs = []
            for _ in range(10):
                t = time.perf_counter()
                hashlib.sha256(chunk).digest()
                hs.append(time.perf_counter() - t)
            extra.update(rtt_s=statistics.median(ts), digest_chunk_s=statistics.median(hs))
        say(ready=True, **extra)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("exit"):
                break
            c0 = time.process_time()
            v = relay.load(into, version=cmd["version"], timeout=600)
            t = time.monotonic()
            st = relay.stats()
            say(version=v, t=t, chunks={str(k): n for k, n in st.chunks.items()}, reattached=len(st.reattached),
                cpu_s=time.process_time() - c0, digest_s=st.digest_s)
        relay.close()


def node_gloo(a: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=600))
    n = a.model_mib * MiB
    t = torch.full((n,), 7, dtype=torch.uint8) if a.rank == 0 else torch.empty(n, dtype=torch.uint8)
    for _ in range(a.reps):
        dist.barrier()
        t0 = time.monotonic()
        dist.broadcast(t, src=0)
        say(t0=t0, t=time.monotonic(), ok=bool(t[-1].item() == 7))
    dist.destroy_process_group()


# -- the run (root namespace) ----------------------------------------------------------------------------
def _checkout() -> pathlib.Path:
    root = CHECKOUT
    if not (root / "tests" / "netns" / "netns.py").is_file():
        raise SystemExit("memsem bench --fanout needs a source checkout (tests/netns/netns.py makes the namespaces); "
                         f"not found under {root}")
    return root


class _Proc:
    def __init__(self, ns: Any, argv: list[str], env: dict[str, str]) -> None:
        self.p = ns.popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
        from lines import reader

        self.r = reader(self.p)

    def send(self, **kw: Any) -> None:
        self.p.stdin.write(json.dumps(kw) + "\n")
        self.p.stdin.flush()

    def read(self, timeout: float = 600.0) -> dict[str, Any]:
        line = self.r.readline(timeout)
        if not line:
            self.p.kill()
            err = self.p.stderr.read()[-3000:] if self.p.stderr else ""
            raise RuntimeError(f"node {self.p.args[-8:]} gave no line ({'timeout' if line is None else 'exit'}): {err}")
        return json.loads(line)

    def close(self) -> None:
        if self.p.poll() is None:
            with_exit = self.p.stdin and not self.p.stdin.closed
            if with_exit:
                try:
                    self.send(exit=True)
                except OSError:
                    pass
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def _env(node: str, url: str, job: str, secret: str) -> dict[str, str]:
    env = dict(os.environ, MEMSEM_NODE_ID=node, MEMSEM_DIRECTORY=url, MEMSEM_JOB=job, MEMSEM_JOB_SECRET=secret,
               MEMSEM_HEARTBEAT_TTL="5", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="veth0",
               OMP_NUM_THREADS="1")
    return env


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine so far (/proc/stat)."""
    with open("/proc/stat") as fh:
        vals = [int(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


def figures(*, ns: tuple[int, ...] = (1, 2, 4, 8), rate_mbit: float = 200.0, model_mib: int = 64,
            chunk_kib: int = 512, reps: int = 2, kinds: tuple[str, ...] = ("star", "auto", "tree", "gloo"),
            log: Any = None, queue_ms: float = 50.0) -> dict[str, Any]:
    """Run everything (see the module docstring); returns the figures. ``queue_ms``: the most
    a packet waits in a shaped link's queue (tbf's ``latency``)."""
    root = _checkout()
    sys.path.insert(0, str(root / "tests" / "netns"))
    import netns
    import redis_server

    ok, why = netns.probe()
    if not ok:
        raise SystemExit(f"memsem bench --fanout needs network namespaces: {why}")
    binary = redis_server.find_redis_server()
    if binary is None:
        raise SystemExit("memsem bench --fanout needs redis-server (as root: sh tests/netns/install_redis.sh)")
    import memsem

    py = sys.executable
    me = [py, "-m", "memsem_bench.fanout", "node"]
    common = ["--model-mib", str(model_mib), "--chunk-kib", str(chunk_kib), "--rate-mbit", str(rate_mbit)]
    nbytes = None
    meas: dict[str, dict[int, float]] = {"star": {}, "chain": {}, "tree": {}, "gloo": {}}
    commit_s: list[float] = []
    egress: dict[int, float] = {}
    plans: dict[int, str] = {}
    rtt = dig = None
    busy: dict[tuple[str, int], float] = {}
    rcpu: dict[tuple[str, int], float] = {}
    say_ = log or (lambda *a: None)
    for n in ns:
        with netns.star(n + 1, rate_mbit=rate_mbit, queue_ms=queue_ms) as nodes, redis_server.redis_server(ns=nodes[0], binary=binary) as srv:
            job, secret = f"fo{os.getpid()}{secrets.token_hex(3)}", secrets.token_hex(16)
            trainer = _Proc(nodes[0], me + ["trainer"] + common, _env("node-t", srv.url, job, secret))
            procs = [trainer]
            try:
                first = trainer.read(120)
                nbytes = first["nbytes"]
                step = 1
                hop = 2 * (rtt or 2e-4) + (dig or 2e-3)
                for kind in [k for k in ("star", "auto", "tree") if k in kinds and (k != "tree" or n >= 4)]:
                    rolls = [_Proc(nodes[i + 1], me + ["rollout", "--rank", str(i), "--world", str(n), "--plan", kind,
                                                       "--hop-s", str(hop)] + common
                                   + (["--latency"] if (rtt is None and i == 0) else []),
                                   _env(f"node-r{i}", srv.url, job, secret)) for i in range(n)]
                    procs += rolls
                    ready = [r.read(180) for r in rolls]
                    if rtt is None and "rtt_s" in ready[0]:
                        rtt, dig = ready[0]["rtt_s"], ready[0]["digest_chunk_s"]
                    got_kind = ready[0]["plan"]
                    name = "star" if kind == "star" else got_kind
                    if kind == "auto":
                        plans[n] = f"{got_kind}: {ready[0]['why']}"
                    times = []
                    for _rep in range(1 if (kind == "star" and n >= 4) else reps):
                        step += 1
                        for r in rolls:
                            r.send(version=step)
                        tx0 = netns.tx_bytes(nodes[0].name)
                        cpu0 = _cpu_ticks()
                        trainer.send(step=step)
                        c = trainer.read(600)
                        done = [r.read(900) for r in rolls]
                        cpu1 = _cpu_ticks()
                        tx1 = netns.tx_bytes(nodes[0].name)
                        busy[(name, n)] = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
                        rcpu[(name, n)] = sum(d["cpu_s"] for d in done) / len(done)
                        if any(d["version"] < step for d in done):
                            raise RuntimeError(f"a rollout returned an older version: {done}")
                        times.append(max(d["t"] for d in done) - c["t0"])
                        commit_s.append(c["t1"] - c["t0"])
                        if kind == "auto":
                            egress[n] = (tx1 - tx0) / nbytes
                    meas[name][n] = min(times)
                    say_(f"N={n} {name}: {min(times):.3f} s (runs {[round(t, 3) for t in times]}; machine CPU busy "
                         f"{busy[(name, n)]:.0%}, a rollout's CPU {rcpu[(name, n)]:.2f} s)")
                    for r in rolls:
                        r.close()
                trainer.close()
                if "gloo" not in kinds:
                    continue
                # gloo over the same links
                port = 29500 + secrets.randbelow(2000)
                gl = [_Proc(nodes[i], me + ["gloo", "--rank", str(i), "--world", str(n + 1), "--master", nodes[0].addr,
                                            "--port", str(port), "--reps", str(reps)] + common,
                            _env(f"node-g{i}", srv.url, job, secret)) for i in range(n + 1)]
                procs += gl
                gt = []
                for _rep in range(reps):
                    res = [g.read(900) for g in gl]
                    if not all(x["ok"] for x in res):
                        raise RuntimeError(f"gloo broadcast delivered wrong bytes: {res}")
                    gt.append(max(x["t"] for x in res) - res[0]["t0"])
                meas["gloo"][n] = min(gt)
                say_(f"N={n} gloo: {min(gt):.3f} s")
                for g in gl:
                    g.close()
            finally:
                for p in procs:
                    if p.p.poll() is None:
                        p.p.kill()
                        p.p.wait(5)
    # the model against the measured points
    bw = rate_mbit * 1e6 / 8 * PAYLOAD_EFFICIENCY
    hop = 2 * (rtt or 0.0) + (dig or 0.0)
    link = memsem.LinkModel(bw, hop)
    commit = statistics.median(commit_s) if commit_s else 0.0
    model_pts = []
    for kind in ("star", "chain", "tree"):
        for n, t in sorted(meas[kind].items()):
            pred = commit + memsem.model_time(kind, n, nbytes, chunk_kib << 10, link, degree=2)
            model_pts.append({"kind": kind, "n": n, "measured_s": t, "model_s": pred, "rel_err": abs(pred - t) / t})
    relay = {n: meas["chain"].get(n) or meas["tree"].get(n) for n in ns if n in meas["chain"] or n in meas["tree"]}
    big = max(ns)
    out: dict[str, Any] = {
        "fanout_relay_8r_vs_1r": relay[big] / relay[min(ns)] if relay.get(big) and relay.get(min(ns)) else None,
        "fanout_trainer_egress_ratio": egress.get(big),
        "fanout_star_vs_relay_8r": meas["star"][big] / relay[big] if big in meas["star"] else None,
        "fanout_gloo_vs_relay_8r": meas["gloo"][big] / relay[big] if big in meas["gloo"] else None,
        "fanout_model_error": max(p["rel_err"] for p in model_pts) if model_pts else None,
        "fanout_star_s": meas["star"], "fanout_chain_s": meas["chain"], "fanout_tree_s": meas["tree"],
        "fanout_gloo_s": meas["gloo"], "fanout_egress_ratio_by_n": egress, "fanout_commit_s": commit,
        "fanout_rate_mbit": rate_mbit, "fanout_queue_ms": queue_ms, "fanout_model_mib": model_mib,
        "fanout_chunk_kib": chunk_kib,
        "fanout_hop_latency_s": hop, "fanout_rtt_s": rtt, "fanout_digest_chunk_s": dig,
        "fanout_model_points": model_pts, "fanout_plans": plans,
        "fanout_cpu_busy": {f"{k}_{n}": v for (k, n), v in busy.items()},
        "fanout_rollout_cpu_s": {f"{k}_{n}": v for (k, n), v in rcpu.items()},
        "fanout_model_1024": {kind: memsem.model_time(kind, 1024, nbytes, chunk_kib << 10, link)
                              for kind in ("star", "chain", "tree")},
    }
    return out


def _print_table(f: dict[str, Any]) -> None:
    print(f"fan-out over links shaped to {f['fanout_rate_mbit']} Mbit/s (queue {f.get('fanout_queue_ms', 50):g} ms), "
          f"model {f['fanout_model_mib']} MiB, "
          f"chunks of {f['fanout_chunk_kib']} KiB, per-hop latency {f['fanout_hop_latency_s'] * 1e3:.2f} ms, "
          f"trainer commit {f['fanout_commit_s']:.3f} s")
    print(f"{'N':>3} {'star s':>9} {'chain s':>9} {'tree s':>9} {'gloo s':>9} {'egress':>7}")
    for n in sorted(set(f["fanout_chain_s"]) | set(f["fanout_star_s"]) | set(f["fanout_gloo_s"])):
        def g(k: str) -> str:
            v = f[k].get(n)
            return f"{v:9.3f}" if v is not None else f"{'-':>9}"
        e = f["fanout_egress_ratio_by_n"].get(n)
        print(f"{n:>3} {g('fanout_star_s')} {g('fanout_chain_s')} {g('fanout_tree_s')} {g('fanout_gloo_s')} "
              f"{(f'{e:7.3f}' if e is not None else '-'):>7}")
    print("model vs measured:")
    for p in f["fanout_model_points"]:
        print(f"  {p['kind']:>5} N={p['n']:<2} measured {p['measured_s']:8.3f} s  model {p['model_s']:8.3f} s  "
              f"error {p['rel_err']:6.1%}")
    print("model at N=1024: " + ", ".join(f"{k} {v:.1f} s" for k, v in f["fanout_model_1024"].items()))
    for k, goal in GOALS.items():
        v = f.get(k)
        print(f"{k:32} {('%.3f' % v) if v is not None else 'n/a':>8}   goal {goal}")


def plot(runs: list[dict[str, Any]], path: str) -> str | None:
    """Measured (points, one marker per run) against modelled (lines) time per N and plan, and
    the model out to 1,024 ranks; PNG at ``path``. Returns why not, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is missing ({exc}); pip install 'matplotlib>=3.7'"
    import memsem

    f0 = runs[0]
    link = memsem.LinkModel(f0["fanout_rate_mbit"] * 1e6 / 8 * PAYLOAD_EFFICIENCY, f0["fanout_hop_latency_s"])
    m, b, commit = f0["fanout_model_mib"] * MiB, f0["fanout_chunk_kib"] << 10, f0["fanout_commit_s"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"star": "tab:red", "chain": "tab:blue", "tree": "tab:green", "gloo": "tab:gray"}
    ns = list(range(1, 9))
    for kind in ("star", "chain", "tree"):
        ax.plot(ns, [commit + memsem.model_time(kind, n, m, b, link) for n in ns], color=colors[kind],
                label=f"{kind} model")
    for i, f in enumerate(runs):
        for kind in ("star", "chain", "tree", "gloo"):
            pts = sorted((int(n), t) for n, t in f[f"fanout_{kind}_s"].items())
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "os^x"[i % 4], color=colors[kind], ls="none",
                        label=f"{kind} measured (run {i + 1})")
    ax.set_xlabel("rollout nodes")
    ax.set_ylabel("seconds until every rollout holds the version")
    ax.set_title(f"{f0['fanout_model_mib']} MiB over {f0['fanout_rate_mbit']:g} Mbit/s links", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    big = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    for kind, deg in (("star", 2), ("chain", 1), ("tree", 2), ("tree", 4)):
        ax2.plot(big, [memsem.model_time(kind, n, m, b, link, degree=deg) for n in big],
                 color=colors[kind], ls="-" if deg <= 2 else "--", label=kind + (f" (degree {deg})" if kind == "tree" else ""))
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("rollout nodes")
    ax2.set_ylabel("modelled seconds")
    ax2.set_title("the model to 1,024 nodes (same link, chunk)", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run_fanout(args: Any) -> int:
    """``memsem bench --fanout``: needs root (namespaces, tc)."""
    if os.geteuid() != 0:
        print("memsem bench --fanout needs root: it makes network namespaces and shapes their links with tc "
              f"(euid {os.geteuid()}); run it as root", file=sys.stderr)
        return 2
    rate = float(os.environ.get("MEMSEM_FANOUT_RATE_MBIT", "200"))
    mib = int(os.environ.get("MEMSEM_FANOUT_MODEL_MIB", "64"))
    chunk = int(os.environ.get("MEMSEM_FANOUT_CHUNK_KIB", "512"))
    queue = float(os.environ.get("MEMSEM_FANOUT_QUEUE_MS", "50"))
    try:
        f = figures(rate_mbit=rate, model_mib=mib, chunk_kib=chunk, queue_ms=queue,
                    log=(lambda s: print(s, file=sys.stderr, flush=True)))
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    out = getattr(args, "out", None)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "fanout.json"), "w") as fh:
            json.dump(f, fh, indent=1, default=str)
        why = plot([json.loads(json.dumps(f, default=str))], os.path.join(out, "fanout.png"))
        if why:
            print(why, file=sys.stderr)
    _print_table(f)
    if getattr(args, "json", False):
        print(json.dumps(f, default=str))
    return 0


def _node_main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("trainer", "rollout", "gloo"))
    p.add_argument("--model-mib", type=int, default=64)
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--rate-mbit", type=float, default=200)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--plan", default="auto")
    p.add_argument("--hop-s", type=float, default=5e-4)
    p.add_argument("--latency", action="store_true")
    p.add_argument("--master", default="")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args(argv)
    {"trainer": node_trainer, "rollout": node_rollout, "gloo": node_gloo}[a.role](a)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        _node_main(sys.argv[2:])
    else:
        import argparse

        ns_ = argparse.Namespace(json="--json" in sys.argv, out="bench-out")
        sys.exit(run_fanout(ns_))
