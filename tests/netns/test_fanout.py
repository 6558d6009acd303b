"""Fan-out across nodes: a trainer node and rollout nodes on a bridge (netns.star), a redis
directory in the trainer's namespace, every byte over tcp.

Relays are killed (SIGKILL) at several moments: before they held a chunk of a version, in the
middle of one, and after they held it while their child was still reading it (the child held
at a gate until the kill). A faulty relay corrupts a chunk it serves. The trainer commits
versions back to back while a fan-out is in flight. Every rollout must end with a version
bit-exact (sha256 against the trainer's) or a clear error, and never a mixture; re-attachments
are counted and say why (a relay's death is found by its connection ending: PeerLostError,
within the liveness bound, not by the 120 s timeout the relays run with). No wall-clock bound.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile

import pytest

from lines import reader
from redis_server import redis_server

HERE = os.path.dirname(os.path.abspath(__file__))
NODE = os.path.join(HERE, "_fanout_node.py")
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
PY = sys.executable

pytest.importorskip("redis", reason="the redis extra is not installed (pip install 'memsem[redis]')")


def _env(node: str, url: str, job: str, secret: str) -> dict:
    env = dict(os.environ, MEMSEM_NODE_ID=node, MEMSEM_DIRECTORY=url, MEMSEM_JOB=job, MEMSEM_JOB_SECRET=secret,
               MEMSEM_HEARTBEAT_TTL="2", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Node:
    def __init__(self, ns, args, env):
        self.p = ns.popen([PY, NODE, *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)

    def send(self, **kw):
        self.p.stdin.write(json.dumps(kw) + "\n")
        self.p.stdin.flush()

    def read(self, timeout=90.0, skip_events=True) -> dict:
        while True:
            line = reader(self.p).readline(timeout)
            if not line:
                if line is None:
                    self.p.kill()
                raise AssertionError(f"node gave no line ({'timeout' if line is None else 'exit'}, rc={self.p.poll()}); "
                                     f"stderr: {self.p.stderr.read()[-3000:]}")
            d = json.loads(line)
            if skip_events and "event" in d:
                continue
            return d

    def finish(self):
        if self.p.poll() is None:
            try:
                self.send(exit=True)
                self.p.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(5)


@pytest.fixture
def cluster(netns_available, redis_binary):
    """start(world) -> (trainer, [rollout namespaces], env maker): a trainer node and ``world``
    rollout namespaces on one bridge, redis in the trainer's."""
    import netns

    stack = []

    def start(world):
        cm = netns.star(world + 1)
        nodes = cm.__enter__()
        stack.append(cm)
        rs = redis_server(ns=nodes[0], binary=redis_binary)
        srv = rs.__enter__()
        stack.append(rs)
        job, secret = f"f{os.getpid()}{secrets.token_hex(3)}", secrets.token_hex(8)
        trainer = Node(nodes[0], ["trainer"], _env("node-t", srv.url, job, secret))
        procs.append(trainer)
        first = trainer.read(60)
        assert first["ready"], first

        def rollout(rank, *extra):
            n = Node(nodes[rank + 1], ["rollout", str(rank), str(world), *extra],
                     _env(f"node-r{rank}", srv.url, job, secret))
            procs.append(n)
            return n

        return trainer, first, rollout, nodes

    procs: list[Node] = []
    try:
        yield start
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()
                p.p.wait(5)
        for cm in reversed(stack):
            cm.__exit__(None, None, None)


def _ready(*rolls):
    for r in rolls:
        assert r.read(60)["ready"]


def _load(r, v, timeout=120):
    r.send(load=v)
    return r.read(timeout)


@pytest.mark.netns
def test_tree_bit_exact_per_version_and_the_trainer_sends_about_one_copy(cluster):
    import netns

    trainer, first, rollout, nodes = cluster(4)
    rolls = [rollout(r, "--plan", "tree") for r in range(4)]
    _ready(*rolls)
    shas = {1: first["sha"]}
    for r in rolls:
        got = _load(r, 1)
        assert got["version"] == 1 and got["sha"] == shas[1], got
    for step in (2, 3):
        tx0 = netns.tx_bytes(nodes[0].name)
        trainer.send(steps=[step])
        shas.update({int(k): v for k, v in trainer.read()["shas"].items()})
        outs = [_load(r, step) for r in rolls]
        tx = netns.tx_bytes(nodes[0].name) - tx0
        for rank, got in enumerate(outs):
            assert got["version"] == step and got["sha"] == shas[step], got
            assert set(got["chunks"]) == {str([-1, 0, 0, 1][rank])}, got  # every chunk from its parent
        # the trainer's link carried one copy (plus headers and small control traffic), not four
        assert tx < 1.5 * first["nbytes"], (tx, first["nbytes"])
    for r in rolls:
        r.send(exit=True)
        assert r.read(30)["route"] == "tcp"
        r.finish()


def _kill_scenario(cluster, victim_args):
    trainer, first, rollout, nodes = cluster(3)
    r0 = rollout(0)
    r1 = rollout(1, *victim_args(first["chunks"]))
    r2 = rollout(2)
    _ready(r0, r1, r2)
    for r in (r0, r1, r2):
        assert _load(r, 1)["sha"] == first["sha"]
    r2.send(load=2)
    r0.send(load=2)
    trainer.send(steps=[2])
    sha2 = trainer.read()["shas"]["2"]
    return trainer, first, (r0, r1, r2), sha2


@pytest.mark.netns
def test_a_relay_killed_before_it_held_a_chunk(cluster):
    """Rank 1 of a chain of 3 SIGKILLs itself when it is about to ask for chunk 0 of version 2
    (it offered the version but held nothing of it). Rank 2 re-attaches to rank 0
    (PeerLostError: its connection to rank 1 ended) and ends with version 2 bit-exact."""
    trainer, first, (r0, r1, r2), sha2 = _kill_scenario(cluster, lambda n: ["--kill-at", "fetch:2:0"])
    assert r1.p.wait(60) == -signal.SIGKILL
    got2, got0 = r2.read(), r0.read()
    assert got0["version"] == 2 and got0["sha"] == sha2
    assert got2["version"] == 2 and got2["sha"] == sha2, got2
    assert got2["reattached"] == [[2, 1, 0, "PeerLostError"]], got2
    r0.finish()
    r2.finish()


@pytest.mark.netns
def test_a_relay_killed_mid_version(cluster):
    """Rank 1 is held at a gate before the middle chunk of version 2; once rank 2 has a chunk of
    it from rank 1, the test SIGKILLs rank 1. Rank 2 re-attaches to rank 0 and ends with
    version 2 bit-exact, its chunks from both (one version: every one matched its digest)."""
    with tempfile.TemporaryDirectory() as d:
        trainer, first, rollout, nodes = cluster(3)
        n = first["chunks"]
        r0 = rollout(0)
        r1 = rollout(1, "--gate-at", f"fetch:2:{n // 2}", "--gate-file", os.path.join(d, "never"))
        r2 = rollout(2, "--report-serve")
        _ready(r0, r1, r2)
        for r in (r0, r1, r2):
            assert _load(r, 1)["sha"] == first["sha"]
        r2.send(load=2)
        trainer.send(steps=[2])
        sha2 = trainer.read()["shas"]["2"]
        while True:  # rank 2 checked a chunk of version 2 (from rank 1: rank 0 is not its parent)
            ev = r2.read(90, skip_events=False)
            if ev.get("event") == "serve" and ev["version"] == 2:
                break
        os.kill(r1.p.pid, signal.SIGKILL)
        r1.p.wait(30)
        while "event" in (got := r2.read(120, skip_events=False)):
            pass
        assert got["version"] == 2 and got["sha"] == sha2, got
        assert got["reattached"] == [[2, 1, 0, "PeerLostError"]], got
        assert got["chunks"]["0"] >= 1, got  # the rest from rank 0 (the first ones came from rank 1)
        r0.finish()
        r2.finish()


@pytest.mark.netns
def test_a_relay_killed_while_serving_a_version_it_holds(cluster):
    """Rank 1 holds version 2 complete; rank 2 is held at a gate before its second-to-last
    chunk; the test SIGKILLs rank 1, then opens the gate: rank 2 re-attaches to rank 0 and
    ends bit-exact."""
    with tempfile.TemporaryDirectory() as d:
        gate = os.path.join(d, "gate")
        trainer, first, rollout, nodes = cluster(3)
        r0, r1 = rollout(0), rollout(1)
        r2 = rollout(2, "--gate-at", f"fetch:2:{first['chunks'] - 2}", "--gate-file", gate)
        _ready(r0, r1, r2)
        for r in (r0, r1, r2):
            assert _load(r, 1)["sha"] == first["sha"]
        r2.send(load=2)
        trainer.send(steps=[2])
        sha2 = trainer.read()["shas"]["2"]
        while True:  # rank 1's hook says when it holds version 2 complete
            ev = r1.read(90, skip_events=False)
            if ev.get("event") == "complete" and ev["version"] == 2:
                break
        os.kill(r1.p.pid, signal.SIGKILL)
        r1.p.wait(30)
        open(gate, "w").close()
        got = r2.read()
        assert got["version"] == 2 and got["sha"] == sha2, got
        assert got["reattached"] == [[2, 1, 0, "PeerLostError"]], got
        r0.finish()
        r2.finish()


@pytest.mark.netns
def test_a_faulty_relay_is_caught_by_digest_and_named_across_nodes(cluster):
    trainer, first, rollout, nodes = cluster(3)
    r0, r1 = rollout(0), rollout(1, "--corrupt", "3")
    r2 = rollout(2)
    _ready(r0, r1, r2)
    bad = _load(r2, 1)
    assert bad["error"] == "DigestMismatchError" and bad["relay"] == "rank 1 of 'policy'", bad
    assert "chunk 3" in bad["msg"]
    good = _load(r2, 1)
    assert good["version"] == 1 and good["sha"] == first["sha"], good
    assert good["faults"] == ["rank 1 of 'policy'"] and good["reattached"] == [[1, 1, 0, "DigestMismatchError"]]
    assert _load(r0, 1)["sha"] == first["sha"]
    for r in (r0, r1, r2):
        r.finish()


@pytest.mark.netns
def test_versions_committed_while_a_fanout_is_in_flight_across_nodes(cluster):
    """The trainer commits versions 2..7 back to back; each rollout of a chain loads newer
    versions until it has 7. Every version any rollout returns is bit-exact that version."""
    trainer, first, rollout, nodes = cluster(3)
    rolls = [rollout(r) for r in range(3)]
    _ready(*rolls)
    shas = {1: first["sha"]}
    for r in rolls:
        assert _load(r, 1)["sha"] == shas[1]
    trainer.send(steps=[2, 3, 4, 5, 6, 7])
    shas.update({int(k): v for k, v in trainer.read()["shas"].items()})
    for r in rolls:
        last = 1
        while last < 7:
            got = _load(r, last + 1)
            assert got["version"] > last and got["sha"] == shas[got["version"]], got  # never a mixture
            last = got["version"]
        assert set(got["versions"]) <= set(shas)
    for r in rolls:
        r.finish()
