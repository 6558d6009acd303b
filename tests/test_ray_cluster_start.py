"""tests/ray/cluster.py makes a failed cluster start once more (Ray's start can pass its own
bound on a loaded machine), after stopping what the first try started; a second failure
stands. Ray itself is replaced here by a stand-in (this runs where Ray is not installed)."""
from __future__ import annotations

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray"))
import cluster as C  # noqa: E402


class _FakeCluster:
    """ray.cluster_utils.Cluster's part that RayCluster uses; the first ``fail`` instances
    fail their second node's start as Ray's does when the GCS port is not written in time."""

    made: list["_FakeCluster"] = []
    fail = 0

    def __init__(self, initialize_head: bool, shutdown_at_exit: bool) -> None:
        self.failing = len(self.made) < self.fail
        self.made.append(self)
        self.tmp = os.environ["RAY_TMPDIR"]
        self.nodes: list[dict] = []
        self.shut = False

    def add_node(self, **args):
        if self.failing and self.nodes:
            raise TimeoutError("Timed out waiting for the GCS server's port file")
        self.nodes.append(args)
        return object()

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def fake_ray(monkeypatch):
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: False
    ray.shutdown = lambda: None
    utils = types.ModuleType("ray.cluster_utils")
    utils.Cluster = _FakeCluster
    ray.cluster_utils = utils
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.cluster_utils", utils)
    monkeypatch.setattr(_FakeCluster, "made", [])
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    return _FakeCluster


def test_a_failed_start_is_stopped_and_made_once_more(fake_ray, monkeypatch):
    monkeypatch.setattr(fake_ray, "fail", 1)
    with C.RayCluster([("head", 0), ("w1", 1)]) as c:
        first, second = fake_ray.made
        assert first.shut and not os.path.exists(first.tmp)  # the first try left nothing
        assert c.cluster is second and len(second.nodes) == 2 and set(c.nodes) == {"head", "w1"}
        assert second.tmp == c.tmp != first.tmp and os.path.isdir(c.tmp)
    assert second.shut and not os.path.exists(second.tmp) and "RAY_TMPDIR" not in os.environ


def test_a_second_failure_stands(fake_ray, monkeypatch):
    monkeypatch.setattr(fake_ray, "fail", C.START_TRIES)
    with pytest.raises(TimeoutError, match="GCS"):
        with C.RayCluster([("head", 0), ("w1", 1)]):
            pass
    assert len(fake_ray.made) == C.START_TRIES
    assert all(f.shut and not os.path.exists(f.tmp) for f in fake_ray.made)
    assert "RAY_TMPDIR" not in os.environ
