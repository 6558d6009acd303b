"""Fixtures of the Ray directory tests (run where Ray is installed: ``make test-tq`` runs them in the TransferQueue venv).

One Ray cluster of three nodes on this machine for the whole run (tests/ray/cluster.py: a start
takes tens of seconds): a head with no CPUs (this pytest process is its driver) and two workers
with one CPU each, every node a memsem node of its own. Heartbeat TTL 2 s everywhere, so deaths
are seen within a few seconds. A test that needs no cluster of the run's running (a cluster of its
own) asks for ``no_shared_cluster``, which shuts the shared one down first (test_teardown.py, last
by its name).
"""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

pytest.importorskip("ray", reason="Ray is not installed here (make test-tq runs tests/ray in the TransferQueue venv)")

from cluster import RayCluster  # noqa: E402

TTL = 2.0


@pytest.fixture(autouse=True)
def _isolated_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside Ray the job is the Ray job's own (``ray-<job id>``): no MEMSEM_JOB from the
    driver's environment, which Ray workers do not inherit."""
    monkeypatch.delenv("MEMSEM_JOB", raising=False)
    monkeypatch.delenv("MEMSEM_DIRECTORY", raising=False)
    monkeypatch.delenv("MEMSEM_JOB_SECRET", raising=False)
    monkeypatch.delenv("MEMSEM_ENGINES", raising=False)


_SHARED: list[RayCluster] = []


@pytest.fixture(scope="session")
def cluster():
    with RayCluster([("head", 0), ("w1", 1), ("w2", 1)], env={"MEMSEM_HEARTBEAT_TTL": str(TTL)}) as c:
        _SHARED.append(c)
        try:
            c.connect()
            yield c
        finally:
            if c in _SHARED:
                _SHARED.remove(c)


@pytest.fixture
def no_shared_cluster() -> None:
    """The run's shared cluster shut down (if one started): for a test that makes its own."""
    while _SHARED:
        _SHARED.pop().close()
