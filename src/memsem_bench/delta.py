"""Delta versions (issue 36): what a reader holding version v moves to hold v+1, and how long it takes,
beside a full load of the same version in the same rounds.

``memsem bench --delta [--json] [--quick]``. Three processes: a trainer (the owner of a bf16
state dict of ``MEMSEM_DELTA_MIB`` MiB, default 256, in 64 tensors), a reader on the trainer's
node (route host/shm) and a reader on another node id (route tcp, over loopback). For each
synthetic change (1% and 100% of the elements, chosen at random in every tensor), in rounds:

* the trainer changes the elements and commits (``ref.update``), then waits for its delta record;
* each reader, in an order reversed every other round: a delta load (``load(into, base=v - 1)``
  into tensors holding v - 1) and a full load of v into other tensors, both timed, both compared
  bit for bit (they must agree, and the reader's digest check passed or the load was full);
  whichever runs first after a commit is slower (cold caches at the owner), so the ratio of a
  round is combined with the next one's, whose order is the other (their geometric mean);
* bytes moved are the reader's own count (``stats().deltas``): the index, the records (patches:
  2 bytes of index beside each changed value) and the tiles moved whole.

Then real steps: ``torch.optim.AdamW`` (lr 1e-6, an RL-like rate) on an fp32 master of the same
shapes, its bf16 copy published each step: the fraction of bf16 elements that changed is measured
(``delta_adamw_changed_fraction``), and the bytes a delta load moved for it.

The trainer's side: ``delta_trainer_blocked_ms`` is the writer's own time per version spent on
delta bookkeeping (noting the commit for the history's thread: ``stats().deltas["commit_hook_s"]``)
plus the time its write sections waited for pins (the history takes none); ``delta_record_ms``
is how long after a commit its record is there (what a reader that wants the delta at once
waits); ``delta_update_vs_plain`` is ``ref.update`` with a history over one without (another
state dict of the same shapes), interleaved: the background thread's cost as the writer sees it.

Relays (in one process, every window local: what a hop moves, not a network's time): a trainer's
``FanoutSource`` of ``MEMSEM_DELTA_RELAY_MIB`` MiB (default 64) bf16, a chain of two relays that
pass deltas on, 1% of elements changed per version: ``delta_relay_bytes_per_hop_1pct`` is the
bytes each relay received per version (records and chunks) / the state dict's bytes, and
``delta_relay_deltas`` how many versions each built from records.

Keys (the last line of stdout with ``--json``; ``GOALS``): ``delta_bytes_ratio_1pct``,
``delta_vs_full_1pct`` and ``delta_vs_full_100pct`` (the tcp reader: across nodes, where bytes
are time; ``*_same_node`` the same on the trainer's node), ``delta_adamw_bytes_ratio``,
``delta_trainer_blocked_ms``; ratios are medians (of per-round ratios, for load times of pairs
of rounds), ``<key>_spread`` their [p10, p90]. ``delta_check_floor_vs_full_1pct[_same_node]``:
the time to digest every byte the reader holds (nothing else: the floor of the fail-closed check,
which must read them), measured by the reader after each round, / the same round's full load.

    python -m memsem_bench.delta [--quick] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20
ENGINES = ("loopback", "host", "tcp")
TENSORS = 64
GOALS = {
    "delta_bytes_ratio_1pct": ("<= 0.05", lambda x: x <= 0.05),
    "delta_vs_full_1pct": ("<= 0.15", lambda x: x <= 0.15),
    "delta_vs_full_100pct": ("<= 1.05", lambda x: x <= 1.05),
    "delta_adamw_bytes_ratio": ("reported", None),
    "delta_trainer_blocked_ms": ("<= 1", lambda x: x <= 1.0),
}


def _say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _shapes(mib: int) -> list[tuple[str, int]]:
    per = mib * MiB // 2 // TENSORS
    return [(f"layer{i}.w", per) for i in range(TENSORS)]


# -- the trainer ----------------------------------------------------------------------------------------
def _trainer(a: argparse.Namespace) -> None:
    import ml_dtypes
    import numpy as np

    import memsem
    from memsem.gva import RefSpec

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    shapes = _shapes(a.mib)
    sd = {k: (rng.standard_normal(n) * 0.02).astype(bf16) for k, n in shapes}
    with memsem.Runtime(engines=ENGINES, timeout=300) as rt:
        ref = rt.publish_state_dict(sd, name="bench/delta")
        plain = rt.publish_state_dict(sd, name="bench/plain", delta_history=0)
        index = RefSpec.from_bytes(ref.layout.delta.index)
        _say(ref=ref.to_bytes().hex(), version=ref.version())
        master = None
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("exit"):
                break
            if "change" in cmd:
                frac = cmd["change"]
                for k, arr in sd.items():
                    u = arr.view(np.uint16)
                    u[rng.random(u.size) < frac] ^= np.uint16(1)
                changed = None
            else:  # one AdamW step of the fp32 master; its bf16 copy is the next version
                import torch

                if master is None:
                    torch.manual_seed(0)
                    master = {k: torch.nn.Parameter(torch.from_numpy(sd[k].astype(np.float32))) for k in sd}
                    opt = torch.optim.AdamW(master.values(), lr=1e-6, weight_decay=0.0)
                opt.zero_grad()
                for p in master.values():
                    p.grad = torch.randn_like(p)
                opt.step()
                changed = total = 0
                for k, p in master.items():
                    new = p.detach().to(torch.bfloat16).view(torch.int16).numpy().view(bf16)
                    changed += int(np.count_nonzero(new.view(np.uint16) != sd[k].view(np.uint16)))
                    total += new.size
                    sd[k][...] = new
                changed /= total
            # the writer's side, interleaved: an update without a history, then with one (or the
            # other way round); the commit hook's time and the section's pin wait, per version
            order = (plain, ref) if cmd.get("round", 0) % 2 else (ref, plain)
            times = {}
            before = rt.stats()
            for r in order:
                t0 = time.perf_counter()
                v = r.update(sd)
                times[r is ref] = time.perf_counter() - t0
                if r is ref:
                    mine = v
                    t1 = time.perf_counter()
                    rt.wait_version(index, v, 120)  # the record is there
                    record_s = time.perf_counter() - t1
            after = rt.stats()
            hook = after.deltas["commit_hook_s"] - before.deltas["commit_hook_s"]
            pins = after.write_sections["blocked_s"] - before.write_sections["blocked_s"]
            _say(version=mine, update_s=times[True], plain_update_s=times[False], blocked_ms=(hook + pins) * 1e3,
                 record_ms=record_s * 1e3, changed=changed)


# -- relays ---------------------------------------------------------------------------------------------
def relay_figures(mib: int, versions: int) -> dict[str, Any]:
    """A chain trainer -> relay 0 -> relay 1 in one process, 1% changed per version (module docstring)."""
    import ml_dtypes
    import numpy as np

    import memsem
    from memsem.gva import RefSpec

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(1)
    sd = {n: rng.standard_normal(k).astype(bf16) for n, k in _shapes(mib)}
    with memsem.Runtime(engines=ENGINES, timeout=120) as rt:
        src = memsem.FanoutSource(rt, sd, name="bench/relay-delta")
        relays = [memsem.Relay(rt, "bench/relay-delta", rank=r, world=2, plan="chain", delta_wait=60) for r in (0, 1)]
        try:
            for r in relays:
                r.load(version=1, timeout=120)
            before = [r.stats().bytes_received for r in relays]
            for _ in range(versions):
                for arr in sd.values():
                    u = arr.view(np.uint16)
                    u[rng.random(u.size) < 0.01] ^= np.uint16(1)
                v = src.update(sd)
                rt.wait_version(RefSpec.from_bytes(src.ref.layout.delta.index), v, 120)  # recorded
                for r in relays:
                    r.load(version=v, timeout=120)
            per_hop = [(r.stats().bytes_received - b) / versions / src.nbytes for r, b in zip(relays, before)]
            return {"delta_relay_bytes_per_hop_1pct": round(max(per_hop), 4),
                    "delta_relay_deltas": [f"{len(r.stats().deltas)}/{versions}" for r in relays],
                    "delta_relay_mib": mib}
        finally:
            for r in relays:
                r.close()
            src.close()


# -- a reader -------------------------------------------------------------------------------------------
def _reader(a: argparse.Namespace) -> None:
    import numpy as np

    import memsem

    with memsem.Runtime(engines=ENGINES, timeout=300) as rt:
        first = json.loads(sys.stdin.readline())
        ref = rt.ref(bytes.fromhex(first["ref"]))
        held = ref.empty_like("numpy")
        other = ref.empty_like("numpy")
        v = ref.load(held)
        ref.load(other)
        _say(route=rt.route(ref).kind, version=v)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("exit"):
                break
            want = cmd["version"]
            out: dict[str, Any] = {}
            for kind in (("delta", "full") if cmd["round"] % 2 else ("full", "delta")):
                before = rt.stats().deltas
                t0 = time.perf_counter()
                got = (ref.load(held, version=want, base=v, delta_wait=30) if kind == "delta"
                       else ref.load(other, version=want))
                out[f"{kind}_s"] = time.perf_counter() - t0
                after = rt.stats().deltas
                if got != want:
                    raise SystemExit(f"{kind} load gave version {got}, not {want}")
                if kind == "delta":
                    out["delta_moved"] = after["bytes_moved"] - before["bytes_moved"]
                    out["delta_loaded"] = after["bytes_loaded"] - before["bytes_loaded"]
                    out["was_delta"] = after["loads_delta"] > before["loads_delta"]
                    out["mismatch"] = after["mismatches"] > before["mismatches"]
            out["exact"] = all(np.array_equal(held[k].view(np.uint8), other[k].view(np.uint8)) for k in held)
            out["check_s"] = _digest_held(rt, held)
            v = want
            _say(**out)


def _digest_held(rt: Any, held: dict) -> float:
    """Seconds to digest every tile the reader holds, split over the runtime's CPU threads as
    a delta load's check is: the floor of the fail-closed check (it must read every held byte)."""
    import numpy as np

    from memsem import native
    from memsem.sync._delta_format import DEFAULT_TILE_BYTES
    from memsem.sync._delta_writer import chunks

    addr, nb = [], []
    for arr in held.values():
        b = arr.reshape(-1).view(np.uint8)
        for off in range(0, b.nbytes, DEFAULT_TILE_BYTES):
            addr.append(b.ctypes.data + off)
            nb.append(min(DEFAULT_TILE_BYTES, b.nbytes - off))
    addr_a, nb_a = np.array(addr, np.uint64), np.array(nb, np.uint64)
    out = np.empty(len(addr), np.uint64)
    t0 = time.perf_counter()
    rt.cpu_map(lambda r: native.digest_tiles(addr_a.ctypes.data + 8 * r[0], nb_a.ctypes.data + 8 * r[0], r[1] - r[0],
                                             out.ctypes.data + 8 * r[0]), chunks(nb_a))
    return time.perf_counter() - t0


# -- the three processes ------------------------------------------------------------------------------------
class _Proc:
    def __init__(self, role: str, env: dict[str, str], a: argparse.Namespace) -> None:
        me = [sys.executable, "-m", "memsem_bench.delta", "--role", role, "--mib", str(a.mib)]
        self.p = subprocess.Popen(me, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.role = role

    def send(self, **kw: Any) -> None:
        self.p.stdin.write(json.dumps(kw) + "\n")
        self.p.stdin.flush()

    def read(self) -> dict[str, Any]:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.role} ended: {self.p.stderr.read()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send(exit=True)
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(5)


def _paired(values: list[float]) -> list[float]:
    """Per-round ratios combined two by two (the geometric mean of a round and the next, whose
    order is the other): whichever load runs first after a commit pays for it (cold caches at
    the owner), and a pair pays it once on each side."""
    return [(a * b) ** 0.5 for a, b in zip(values[0::2], values[1::2])] or values


def _stat(values: list[float]) -> tuple[float | None, list[float] | None]:
    if not values:
        return None, None
    s = sorted(values)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return round(statistics.median(s), 4), [round(pick(0.1), 4), round(pick(0.9), 4)]


def figures(quick: bool = False, mib: int | None = None, log: Any = None) -> dict[str, Any]:
    """Run the trainer and both readers; the figures (see the module docstring)."""
    a = argparse.Namespace(mib=mib or int(os.environ.get("MEMSEM_DELTA_MIB", "256")))
    rounds = 4 if quick else 8  # even: each order of the two loads as often
    log = log or (lambda s: None)
    job = f"benchdelta{os.getpid()}{secrets.token_hex(2)}"
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MEMSEM_JOB=job, MEMSEM_DIRECTORY="local",
               PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MEMSEM_NODE_ID", None)
    procs: list[_Proc] = []
    fig: dict[str, Any] = {"delta_model_mib": a.mib}
    try:
        tr = _Proc("trainer", dict(env, MEMSEM_NODE_ID="delta-a"), a)
        procs.append(tr)
        first = tr.read()
        readers = {"same_node": _Proc("reader", dict(env, MEMSEM_NODE_ID="delta-a"), a),
                   "tcp": _Proc("reader", dict(env, MEMSEM_NODE_ID="delta-b"), a)}
        procs += readers.values()
        for name, r in readers.items():
            r.send(ref=first["ref"])
            fig[f"delta_route_{name}"] = r.read()["route"]
        rec: dict[str, list] = {}
        rnd = 0
        for label, cmd in (("1pct", {"change": 0.01}), ("100pct", {"change": 1.0}), ("adamw", {"adamw": True})):
            rnd += rnd % 2  # each label starts a pair of rounds
            for i in range(rounds if label != "adamw" else max(2, rounds // 2)):
                log(f"delta: {label} round {i + 1}")
                tr.send(round=rnd, **cmd)
                w = tr.read()
                rec.setdefault(f"{label}/trainer", []).append(w)
                for name, r in readers.items():
                    r.send(version=w["version"], round=rnd)
                for name, r in readers.items():
                    got = r.read()
                    if not got["exact"]:
                        raise RuntimeError(f"{name} reader: the delta load and the full load of version "
                                           f"{w['version']} differ")
                    rec.setdefault(f"{label}/{name}", []).append(got)
                rnd += 1
        for label in ("1pct", "100pct", "adamw"):
            for name in ("tcp", "same_node"):
                rows = rec[f"{label}/{name}"]
                suffix = "" if name == "tcp" else "_same_node"
                ratio, spread = _stat([r["delta_moved"] / r["delta_loaded"] for r in rows])
                vs, vs_spread = _stat(_paired([r["delta_s"] / r["full_s"] for r in rows]))
                key = "delta_adamw_bytes_ratio" if label == "adamw" else f"delta_bytes_ratio_{label}"
                fig[key + suffix], fig[key + suffix + "_spread"] = ratio, spread
                fig[f"delta_vs_full_{label}{suffix}"], fig[f"delta_vs_full_{label}{suffix}_spread"] = vs, vs_spread
                fig[f"delta_load_ms_{label}{suffix}"] = _stat([r["delta_s"] * 1e3 for r in rows])[0]
                fig[f"full_load_ms_{label}{suffix}"] = _stat([r["full_s"] * 1e3 for r in rows])[0]
                fig[f"delta_loads_{label}{suffix}"] = f"{sum(r['was_delta'] for r in rows)}/{len(rows)} delta"
                if label == "1pct":  # the check's floor: digesting the held bytes alone / the full load
                    fig[f"delta_check_floor_vs_full_1pct{suffix}"] = _stat(_paired([r["check_s"] / r["full_s"]
                                                                                     for r in rows]))[0]
        tw = [w for k, ws in rec.items() if k.endswith("/trainer") for w in ws]
        fig["delta_trainer_blocked_ms"] = _stat([w["blocked_ms"] for w in tw])[0]
        fig["delta_trainer_blocked_ms_max"] = round(max(w["blocked_ms"] for w in tw), 4)
        for label in ("1pct", "100pct", "adamw"):
            ws = rec[f"{label}/trainer"]
            fig[f"delta_record_ms_{label}"] = _stat([w["record_ms"] for w in ws])[0]
        fig["delta_update_vs_plain"], fig["delta_update_vs_plain_spread"] = _stat(
            [w["update_s"] / w["plain_update_s"] for w in tw])
        fig["delta_adamw_changed_fraction"] = _stat([w["changed"] for w in rec["adamw/trainer"]])[0]
        fig["delta_cpus"] = len(os.sched_getaffinity(0))
    finally:
        for p in reversed(procs):
            p.close()
    log("delta: relays")
    fig.update(relay_figures(int(os.environ.get("MEMSEM_DELTA_RELAY_MIB", "64")), 2 if quick else 4))
    return fig


def print_table(fig: dict[str, Any], out: Any = sys.stderr) -> None:
    print(f"delta versions: a {fig['delta_model_mib']} MiB bf16 state dict, {fig.get('delta_cpus')} CPUs", file=out)
    for k, (goal, ok) in GOALS.items():
        v = fig.get(k)
        state = "reported" if ok is None else ("met" if v is not None and ok(v) else "not met")
        print(f"  {k:<28} {v!s:>10}  goal {goal:<8} {state}  spread {fig.get(k + '_spread')}", file=out)
    for k in ("delta_check_floor_vs_full_1pct", "delta_check_floor_vs_full_1pct_same_node",
              "delta_vs_full_1pct_same_node", "delta_vs_full_100pct_same_node", "delta_bytes_ratio_1pct_same_node",
              "delta_adamw_changed_fraction", "delta_record_ms_1pct", "delta_update_vs_plain",
              "delta_load_ms_1pct", "full_load_ms_1pct", "delta_load_ms_1pct_same_node",
              "full_load_ms_1pct_same_node", "delta_relay_bytes_per_hop_1pct", "delta_relay_deltas"):
        print(f"  {k:<34} {fig.get(k)}", file=out)


def run_delta(args: Any) -> int:
    """``memsem bench --delta``."""
    fig = figures(quick=bool(getattr(args, "quick", False)), log=lambda s: print(s, file=sys.stderr, flush=True))
    out = getattr(args, "out", None)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "delta.json"), "w") as fh:
            json.dump(fig, fh, indent=1)
    print_table(fig)
    if getattr(args, "json", False):
        print(json.dumps(fig))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memsem_bench.delta")
    p.add_argument("--role", choices=("trainer", "reader"))
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="bench-out")
    a = p.parse_args(argv)
    if a.role == "trainer":
        _trainer(a)
        return 0
    if a.role == "reader":
        _reader(a)
        return 0
    return run_delta(a)


if __name__ == "__main__":
    sys.exit(main())
