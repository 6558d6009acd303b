"""verl's checkpoint engine on memsem across two nodes that are network namespaces: a Ray head
in namespace A, a Ray worker node in namespace B, joined by one veth link, as a user runs a verl
job on two machines (``ray start --head`` on one, ``ray start --address`` on the other).

The two trainers run on A, the two rollouts on B, with the recipe of docs/howto.md and nothing
memsem-specific set: no directory (inside a Ray job memsem opens the ``ray`` directory, a
detached actor on the head), no engines (tcp is enabled inside a Ray job), no job, no secret.
Each Ray node's environment names its memsem node (``MEMSEM_NODE_ID``), which on two machines
differs by itself: so shared memory and cross-memory attach are refused between A and B, as
between machines, and every bucket that crosses goes over the link.

Checked: 3 rounds with every received weight equal to the trainer's (in the rollouts); the
trainers and rollouts ran in different namespaces on different memsem nodes, each runtime on the
ray directory with no MEMSEM_ setting but the node; the chain holds across the link (what the
trainer served is what rollout 1 loaded over tcp, and rollout 2, on rollout 1's node, loaded
rollout 1's copy without tcp; each rollout also read every bucket's 32-byte digest from the
trainer itself); the veth link carried at least those bytes out of A.

Needs root (namespaces); skips otherwise, fails under CI (MEMSEM_REQUIRE_NETNS=1).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
NETNS = os.path.join(os.path.dirname(HERE), "netns")
sys.path.insert(0, NETNS)
import netns  # noqa: E402

sys.path.remove(NETNS)

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
GCS_PORT = 6379  # inside namespace A: no other cluster can hold it


@pytest.fixture
def two_ray_nodes():
    """(a, b, gcs_address): Ray head in namespace A, a worker node in B; stopped, namespaces
    and Ray's folder removed afterwards."""
    ok, reason = netns.probe()
    if not ok:
        msg = f"network namespaces unavailable here: {reason}"
        if os.environ.get("MEMSEM_REQUIRE_NETNS") == "1":
            pytest.fail(msg + " (MEMSEM_REQUIRE_NETNS=1)")
        pytest.skip(msg)
    tmp = tempfile.mkdtemp(prefix="mv", dir="/tmp")  # short: Ray's unix sockets live there
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSEM_", "RAY_"))}
    # (RAY_AUTH_MODE: a token file another Ray of this machine left in ~/.ray must not switch it on)
    base.update(RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0", RAY_AUTH_MODE="disabled", PYTHONPATH=HERE)
    try:
        with netns.veth_pair() as (a, b):
            for ns in (a, b):  # Ray finds a node's address by the route out of it
                netns._ip("-n", ns.name, "route", "add", "default", "dev", ns.ifname)
            gcs = f"{a.addr}:{GCS_PORT}"
            logs = {n: open(os.path.join(tmp, f"{n}.log"), "w") for n in ("head", "worker")}
            try:
                a.popen([RAY, "start", "--head", "--block", f"--node-ip-address={a.addr}", f"--port={GCS_PORT}",
                         "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={tmp}",
                         '--resources={"node_a": 100}', "--object-store-memory=100000000"],
                        env=dict(base, MEMSEM_NODE_ID="verl-ns-a"), stdout=logs["head"], stderr=subprocess.STDOUT)
                a.run([sys.executable, "-c", _WAIT_PORT, a.addr, str(GCS_PORT)], timeout=150)
                b.popen([RAY, "start", "--block", f"--address={gcs}", f"--node-ip-address={b.addr}", "--num-cpus=2",
                         '--resources={"node_b": 100}', "--object-store-memory=100000000"],
                        env=dict(base, MEMSEM_NODE_ID="verl-ns-b"), stdout=logs["worker"], stderr=subprocess.STDOUT)
                yield a, b, gcs, base, tmp
            finally:
                for ns in (b, a):  # the worker node first, then the head (each stops its own processes)
                    ns.kill_all(grace=15)
                for f in logs.values():
                    f.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_WAIT_PORT = r"""
import socket, sys, time
deadline = time.monotonic() + 120
while True:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise SystemExit(f"the Ray head's GCS never listened on {sys.argv[1]}:{sys.argv[2]}")
        time.sleep(0.2)
"""


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def test_verl_across_two_namespace_nodes(two_ray_nodes):
    a, b, gcs, env, tmp = two_ray_nodes
    sent_before = netns.tx_bytes(a.name)
    cp = a.run([sys.executable, os.path.join(HERE, "_netns_driver.py"), gcs], env=env, timeout=1500, check=False)
    assert cp.returncode == 0, (f"driver failed (rc={cp.returncode}):\n{cp.stdout[-3000:]}\n{cp.stderr[-6000:]}\n"
                                f"head:\n{_tail(os.path.join(tmp, 'head.log'))}\n"
                                f"worker:\n{_tail(os.path.join(tmp, 'worker.log'))}")
    sent = netns.tx_bytes(a.name) - sent_before
    out = json.loads(cp.stdout.strip().splitlines()[-1])
    routes, where = out["routes"], out["placements"]
    trainers, rollouts = where[:2], where[2:]
    ns_a, ns_b = (os.readlink(f"/proc/{ns.pids()[0]}/ns/net") for ns in (a, b))
    assert {w["netns"] for w in trainers} == {ns_a} and {w["netns"] for w in rollouts} == {ns_b}, where
    assert {w["node"] for w in trainers} == {"verl-ns-a"} and {w["node"] for w in rollouts} == {"verl-ns-b"}, where
    for w in where:
        assert w["env"] == ["MEMSEM_NODE_ID"], w  # nothing memsem-specific set but the node
        assert w["directory"] in (None, "RayDirectory"), w  # the idle second trainer may open none
    assert all(w["directory"] == "RayDirectory" for w in (trainers[0], *rollouts)), where
    digests = out["buckets"] * 32  # each rollout read every bucket's digest from the trainer itself
    trainer, r1, r2 = ({k: v for k, v in r.items() if v} for r in (routes[0], routes[2], routes[3]))
    assert set(r1) == {"tcp"}, routes  # rollout 1 loaded every bucket over the link
    assert trainer.get("loopback", 0) == r1["tcp"] + digests, routes  # served == loaded by the rollouts
    assert r2.get("tcp", 0) == digests and set(r2) <= {"host/shm", "host/cma", "tcp"}, routes
    assert r2.get("host/shm", 0) == r1["tcp"] - digests, routes  # every bucket rollout 1 received, once, on node B
    assert sent >= r1["tcp"], (sent, routes)  # and those bytes crossed the link
