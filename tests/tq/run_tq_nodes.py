"""TransferQueue's e2e files against the Memsem backend across two "nodes": the storage agent in
network namespace A, the test driver, TQ's controller and every client (Ray workers) in
namespace B, joined by a veth pair; a real redis-server in A is the memsem directory.

    python tests/tq/run_tq_nodes.py VENV [extra pytest args...]

Different MEMSEM_NODE_IDs forbid shared memory and cross-memory attach between the agent and
its clients, so every put, get, commit word and lease goes over the tcp route (MEMSEM_ENGINES
enables it in code that names no engines). The bootstrap provider starts the agent as usual;
MEMSEM_TQ_AGENT_LAUNCHER makes that start happen inside namespace A. (The agent's control
channel is a unix socket: the namespaces share the file system, which nodes would not; the
data plane is what crosses the link.)

Exit status: run_tq_e2e.sh's; 0 with a message when namespaces cannot be made here (not root,
no iproute2), unless MEMSEM_REQUIRE_NETNS=1 (then 1).
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "netns"))

import netns  # noqa: E402
from redis_server import find_redis_server, redis_server  # noqa: E402


_PROBE = r"""
import os, numpy as np, memsem
from memsem.integrations._tq_agent import AgentClient, start_agent
from memsem.native import ProcessIdentity
agent = start_agent(job="tq-nodes-probe")
try:
    me = ProcessIdentity.current()
    grant = AgentClient(agent.address, agent.authkey, timeout=30).call("alloc", nbytes=4096, n_items=1, pid=me.pid,
                                                                      start=me.start_time)
    with memsem.Runtime(job="tq-nodes-probe") as rt:
        ref = rt.ref(grant["ref"])
        route = rt.route(ref).kind
        ref.bytes(0, 8).put(np.arange(8, dtype=np.uint8))
        assert (ref.bytes(0, 8).get() == np.arange(8)).all()
    theirs, mine = os.readlink(f"/proc/{agent.pid}/ns/net"), os.readlink("/proc/self/ns/net")
    print(f"run_tq_nodes: probe: route {route}; agent pid {agent.pid} in network namespace {theirs}, "
          f"this client in {mine}")
    raise SystemExit(0 if route == "tcp" and theirs != mine else 1)
finally:
    agent.stop()
"""


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    venv, extra = os.path.abspath(sys.argv[1]), sys.argv[2:]
    ok, why = netns.probe()
    if not ok:
        print(f"run_tq_nodes: skipped: {why}")
        return 1 if os.environ.get("MEMSEM_REQUIRE_NETNS") == "1" else 0
    if find_redis_server() is None:
        subprocess.run(["sh", os.path.join(ROOT, "tests", "netns", "install_redis.sh")], check=True, timeout=900)
    ip = netns._ip_binary() or "ip"
    with netns.veth_pair() as (a, b), redis_server(ns=a) as srv:
        env = dict(os.environ,
                   MEMSEM_DIRECTORY=srv.url, MEMSEM_ENGINES="loopback,host,tcp", MEMSEM_NODE_ID="tq-node-b",
                   MEMSEM_JOB_SECRET=secrets.token_hex(16),
                   MEMSEM_TQ_AGENT_LAUNCHER=f"{ip} netns exec {a.name} env MEMSEM_NODE_ID=tq-node-a",
                   TQ_EXTRA_BACKEND_MODULES="memsem.integrations.transferqueue")
        print(f"run_tq_nodes: agent in {a.name} ({a.addr}), clients in {b.name} ({b.addr}), directory {srv.url}",
              flush=True)
        # First, what the e2e run relies on: an agent started by a client in B runs in A, and the
        # client's route to its windows is tcp.
        cp = subprocess.run(b.argv([os.path.join(venv, "bin", "python"), "-c", _PROBE]), env=env, timeout=300,
                            capture_output=True, text=True)
        print(cp.stdout.strip() or cp.stderr[-3000:], flush=True)
        if cp.returncode != 0:
            return cp.returncode
        cmd = ["bash", os.path.join(HERE, "run_tq_e2e.sh"), venv, "Memsem", *extra]
        cp = subprocess.run(b.argv(cmd), env=env, timeout=int(os.environ.get("TQ_E2E_TIMEOUT", "900")) + 120)
        return cp.returncode


if __name__ == "__main__":
    raise SystemExit(main())
