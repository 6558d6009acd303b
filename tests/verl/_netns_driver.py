"""Driver of tests/verl/test_verl_netns.py: run inside network namespace A (the Ray head's),
with ``PYTHONPATH`` naming tests/verl (the actors' class comes from test_verl_backend).

    python _netns_driver.py GCS_ADDRESS

Connects to the two-node Ray cluster, places 2 trainers on node ``node_a`` (namespace A) and 2
rollouts on node ``node_b`` (namespace B), runs test_verl_backend's 3 rounds of verl's update
(every received weight equal to the trainer's, checked in the rollouts) and prints one JSON
object on its last line: every worker's bytes by route and placement, and the buckets sent. Nothing memsem-specific is
set anywhere: no directory, no engines, no job, no secret.
"""
from __future__ import annotations

import json
import sys
import time

import ray

import test_verl_backend as t


def main(address: str) -> None:
    ray.init(address=address, log_to_driver=False)
    deadline = time.monotonic() + 120
    while sum(1 for n in ray.nodes() if n["Alive"]) < 2:
        if time.monotonic() > deadline:
            raise SystemExit(f"the Ray worker node in namespace B never joined: {ray.nodes()}")
        time.sleep(0.2)
    trainer = [t.Worker.options(resources={"node_a": 0.01}).remote("trainer", i) for i in range(2)]
    rollout = [t.Worker.options(resources={"node_b": 0.01}).remote("rollout", i) for i in range(2)]
    placements: list[dict] = []
    stats: dict = {}
    routes = t._rounds(trainer, rollout, placements=placements, stats=stats)
    print(json.dumps({"routes": routes, "placements": placements, "buckets": stats["buckets"]}))


if __name__ == "__main__":
    main(sys.argv[1])
