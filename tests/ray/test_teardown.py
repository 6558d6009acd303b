"""A Ray cluster of its own, shut down: none of its processes is left, nor its folder (run last
by its name: the run's shared cluster is shut down first, ``no_shared_cluster``)."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("ray")

import memsem  # noqa: E402
from cluster import RayCluster, ray_processes  # noqa: E402


def test_no_ray_process_outlives_a_cluster(no_shared_cluster):
    """A cluster of its own, shut down: none of its processes is left, nor its folder."""
    with RayCluster([("solo", 1)]) as c:
        tmp = c.tmp
        c.connect()
        with memsem.Runtime(timeout=60) as rt:
            rt.publish(np.zeros(8), name="z")
        assert ray_processes(tmp)
    assert ray_processes(tmp) == [] and not os.path.exists(tmp)
