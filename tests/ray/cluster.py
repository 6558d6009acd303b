"""A Ray cluster of several nodes on this machine, for memsem's Ray tests (ray.cluster_utils).

Each Ray node gets its own memsem node id (``MEMSEM_NODE_ID``, set in the environment its raylet
and so every worker on it inherits), so memsem treats the nodes as different machines: no
shared memory or cross-memory attach between them, windows reached over tcp, liveness by the
directory's heartbeats. Every node also has a custom resource named after it, to place tasks and
actors on it. Ray's files go to a private temporary folder (``RAY_TMPDIR``), so this cluster never
meets another one on the machine (``ray.init()`` finds the latest cluster through a file there),
and the folder is removed at the end; ``close`` shuts every node down (its processes, by their
handles) and checks none is left.

    with RayCluster([("head", 0), ("w1", 1), ("w2", 1)]) as c:   # (name, CPUs)
        c.connect()                                            # this process: a driver on "head"
        ...
        c.remove("w2")                                         # kill a node mid-run

A start is bounded by Ray's own waits (the one that failed under load, for the GCS server to
write its port, is raised by the runners that start Ray tests: ``RAY_gcs_server_port_wait_time_s``
in tests/tq/run_tq_all.sh); a start that fails anyway is shut down (its processes, its folder)
and made once more (``START_TRIES``), then its error stands.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Iterator

#: environment of every node (and of this driver): no usage reporting, workers at normal
#: priority (Ray starts them at nice 15, which starves them beside busy processes)
NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0", "RAY_DEDUP_LOGS": "0"}
#: tries of a cluster's start: a start past Ray's bound (a loaded machine) is made once more
START_TRIES = 2


@contextlib.contextmanager
def _env(**kw: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in kw}
    os.environ.update(kw)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def node_id(name: str) -> str:
    """The memsem node id of Ray node ``name``."""
    return f"ray-{name}"


class RayCluster:
    """Nodes ``[(name, cpus), ...]``; the first is the head. ``env``: more environment for
    every node (e.g. ``MEMSEM_HEARTBEAT_TTL``)."""

    def __init__(self, nodes: list[tuple[str, int]], env: dict[str, str] | None = None) -> None:
        self.specs = list(nodes)
        self.env = dict(NODE_ENV, **(env or {}))
        self.tmp = ""
        self._new_tmp()
        self.nodes: dict[str, Any] = {}
        self.cluster: Any = None
        self._old_env: dict[str, str | None] = {}

    def _new_tmp(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's unix sockets live there
        self.env["RAY_TMPDIR"] = self.tmp

    def __enter__(self) -> "RayCluster":
        from ray.cluster_utils import Cluster

        # this process (the driver, on the head) sees the same environment as the nodes
        self._old_env = {k: os.environ.get(k) for k in list(self.env) + ["MEMSEM_NODE_ID"]}
        try:
            for attempt in range(1, START_TRIES + 1):
                os.environ.update(self.env)
                os.environ["MEMSEM_NODE_ID"] = node_id(self.specs[0][0])
                try:
                    self.cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
                    for name, cpus in self.specs:
                        self.add(name, cpus)
                    return self
                except Exception as exc:
                    if attempt == START_TRIES:
                        raise
                    print(f"RayCluster: start {attempt} of {START_TRIES} failed ({exc!r}); "
                          "stopping what started, then once more", file=sys.stderr)
                    self._stop()
                    self._new_tmp()
        except BaseException:
            self.close()
            raise
        raise AssertionError("unreachable")  # the loop returns or raises

    def add(self, name: str, cpus: int) -> Any:
        """Start node ``name`` with ``cpus`` CPUs (its raylet's environment names its memsem node)."""
        head = not self.nodes
        args: dict[str, Any] = {"num_cpus": cpus, "resources": {f"node_{name}": 100},
                                "object_store_memory": 80 * 1024 * 1024}
        if head:
            args.update(include_dashboard=False, dashboard_agent_listen_port=None)
        with _env(MEMSEM_NODE_ID=node_id(name)):
            node = self.cluster.add_node(**args)
        self.nodes[name] = node
        return node

    @property
    def address(self) -> str:
        return self.cluster.address

    def connect(self, **kw: Any) -> None:
        import ray

        ray.init(address=self.address, log_to_driver=False, **kw)

    def remove(self, name: str) -> None:
        """Kill node ``name`` (its raylet and every worker on it), not gracefully."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def _stop(self) -> None:
        """Shut down the driver's connection and every node; wait for their processes; remove
        the folder."""
        import ray

        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            try:
                if self.cluster is not None:
                    self.cluster.shutdown()
            finally:
                self.cluster = None
                self.nodes.clear()
                _wait_no_processes(self.tmp)
                shutil.rmtree(self.tmp, ignore_errors=True)

    def close(self) -> None:
        try:
            self._stop()
        finally:
            for k, v in self._old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        self.close()


def placed(name: str) -> dict[str, Any]:
    """Task/actor options that put it on node ``name``."""
    return {"resources": {f"node_{name}": 0.01}}


def ray_processes(tmp: str) -> list[int]:
    """Pids of processes whose command line names ``tmp`` (a cluster's own Ray folder)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if tmp.encode() in cmd:
            out.append(int(pid))
    return out


def _wait_no_processes(tmp: str, timeout: float = 30.0) -> None:
    """Wait for the cluster's processes to exit (workers go after their raylet); kill stragglers."""
    import signal

    deadline = time.monotonic() + timeout
    while ray_processes(tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in ray_processes(tmp):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
