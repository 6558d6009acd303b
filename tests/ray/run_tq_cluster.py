"""TransferQueue's e2e files against the Memsem backend on a Ray cluster of three nodes, with no
Redis and nothing memsem-specific set: the directory is the Ray job's own (memsem.directory.ray).

    python tests/ray/run_tq_cluster.py VENV [extra pytest args...]

The cluster (tests/ray/cluster.py) has a head with no CPUs, where the test driver and the
storage agent it starts run, and two worker nodes with 4 CPUs each, where TQ's controller and
the tests' Ray tasks run; each node is a memsem node of its own, so every client on a worker
node reaches the agent's windows over tcp. The test driver connects with ``RAY_ADDRESS``; the
nodes' environment carries what TQ's workers import (tests/tq/conftest_plugin.py's hook).
First a probe checks what the run relies on: the agent uses the ray directory, and a Ray task on
a worker node writes and reads the agent's region over tcp; then TQ's own API across nodes: a
batch put by a task on w1 and read bit-exact by a task on w2, both over tcp (``_across_nodes``).

Exit status: run_tq_e2e.sh's (1 when the probe fails).
"""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TQ = os.path.join(ROOT, "tests", "tq")
sys.path.insert(0, HERE)

from cluster import RayCluster, node_id, placed  # noqa: E402

MODULES = "memsem.integrations.transferqueue"


def _probe() -> int:
    import ray

    import memsem
    from memsem.integrations._tq_agent import AgentClient, start_agent
    from memsem.native import ProcessIdentity

    @ray.remote(num_cpus=0)
    def client(ref_bytes: bytes) -> tuple[str, str, str, bool]:
        import numpy as np

        import memsem

        with memsem.Runtime(job=job) as rt:
            ref = rt.ref(ref_bytes)
            ref.bytes(0, 8).put(np.arange(8, dtype=np.uint8))
            ok = bool((ref.bytes(0, 8).get() == np.arange(8)).all())
            return os.environ.get("MEMSEM_NODE_ID", ""), rt.route(ref).kind, rt.directory.url, ok

    job = "tq-cluster-probe"
    agent = start_agent(job=job, timeout=120)
    try:
        me = ProcessIdentity.current()
        grant = AgentClient(agent.address, agent.authkey, timeout=60).call("alloc", nbytes=4096, n_items=1,
                                                                            pid=me.pid, start=me.start_time)
        where, route, url, ok = ray.get(client.options(**placed("w1")).remote(grant["ref"]), timeout=300)
        with memsem.Runtime(job=job) as rt:  # the driver, on the agent's node
            local = rt.route(rt.ref(grant["ref"])).kind
            seen = bytes(rt.ref(grant["ref"]).bytes(0, 8).get())
        print(f"run_tq_cluster: probe: agent directory {agent.directory!r}; a client on {where} reaches its "
              f"region over {route} ({url} directory), the driver on {node_id('head')} over {local}", flush=True)
        good = (agent.directory == "ray" and where == node_id("w1") and route == "tcp" and url == "ray" and ok
                and seen == bytes(range(8)) and local.startswith("host"))
        return 0 if good else 1
    finally:
        agent.stop()


def _across_nodes() -> int:
    """TQ itself across the cluster's nodes: the driver (on the head) inits TQ with the Memsem
    backend, a Ray task on w1 writes a batch with ``tq.kv_batch_put`` and a task on w2 reads it
    with ``tq.kv_batch_get``; both reach the agent's regions on the head over tcp (their
    runtimes' routes say so) through the Ray job's own directory."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    import memsem.integrations.transferqueue  # noqa: F401 - registers the backend here

    @ray.remote(num_cpus=0)
    def producer(n: int) -> tuple[str, dict]:
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        from memsem.integrations.transferqueue import _PROC

        tq.init()
        keys = [f"k{i}" for i in range(n)]
        x = torch.arange(n * 64, dtype=torch.float32).reshape(n, 64)
        tq.kv_batch_put(keys=keys, partition_id="cross", fields=TensorDict({"x": x}, batch_size=[n]))
        routes = {k: v for rt in _PROC._rts.values() for k, v in rt.stats().bytes_by_route.items()}
        return os.environ.get("MEMSEM_NODE_ID", ""), routes

    @ray.remote(num_cpus=0)
    def consumer(n: int) -> tuple[str, dict, bool]:
        import torch
        import transfer_queue as tq

        from memsem.integrations.transferqueue import _PROC

        tq.init()
        got = tq.kv_batch_get(keys=[f"k{i}" for i in range(n)], partition_id="cross")
        want = torch.arange(n * 64, dtype=torch.float32).reshape(n, 64)
        rows = got["x"].unbind() if got["x"].is_nested else list(got["x"])  # TQ may return rows jagged
        ok = len(rows) == n and all(torch.equal(a.reshape(-1), b) for a, b in zip(rows, want))
        routes = {k: v for rt in _PROC._rts.values() for k, v in rt.stats().bytes_by_route.items()}
        return os.environ.get("MEMSEM_NODE_ID", ""), routes, ok

    tq.init(OmegaConf.create({"backend": {"storage_backend": "Memsem"}}))
    try:
        n = 32
        pnode, proutes = ray.get(producer.options(**placed("w1")).remote(n), timeout=300)
        cnode, croutes, ok = ray.get(consumer.options(**placed("w2")).remote(n), timeout=300)
    finally:
        tq.close()
    print(f"run_tq_cluster: TQ across nodes: kv_batch_put on {pnode} (bytes by route {proutes}), kv_batch_get on "
          f"{cnode} (bytes by route {croutes}): {'bit-exact' if ok else 'WRONG DATA'}", flush=True)
    good = (ok and pnode == node_id("w1") and cnode == node_id("w2") and proutes.get("tcp", 0) >= n * 64 * 4
            and croutes.get("tcp", 0) >= n * 64 * 4 and set(proutes) == {"tcp"} and set(croutes) == {"tcp"})
    return 0 if good else 1


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    venv, extra = os.path.abspath(sys.argv[1]), sys.argv[2:]
    for k in ("MEMSEM_DIRECTORY", "MEMSEM_JOB", "MEMSEM_JOB_SECRET", "MEMSEM_ENGINES", "RAY_OVERRIDE_RESOURCES",
              "RAY_ADDRESS", "RAY_AUTH_MODE"):
        os.environ.pop(k, None)  # nothing set by hand: the Ray job's own directory, tcp by default
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join([TQ, *paths]), "TQ_EXTRA_BACKEND_MODULES": MODULES}
    with RayCluster([("head", 0), ("w1", 4), ("w2", 4)], env=env) as c:
        print(f"run_tq_cluster: Ray cluster at {c.address}: head (driver, agent), w1, w2; no Redis", flush=True)
        c.connect()
        rc = _probe() or _across_nodes()
        import ray

        ray.shutdown()
        if rc != 0:
            return rc
        # The drivers of the e2e files join this cluster: with its authentication mode (its nodes
        # run without token authentication; a driver in token mode gets its actors cancelled
        # before they start: ActorDiedError), not run_tq_e2e.sh's default for a cluster of its own.
        run_env = dict(os.environ, RAY_ADDRESS=c.address, RAY_AUTH_MODE="disabled")
        cmd = ["bash", os.path.join(TQ, "run_tq_e2e.sh"), venv, "Memsem", *extra]
        cp = subprocess.run(cmd, env=run_env, timeout=int(os.environ.get("TQ_E2E_TIMEOUT", "900")) + 120)
        return cp.returncode


if __name__ == "__main__":
    raise SystemExit(main())
