"""memsem as verl's checkpoint engine, tested the way verl tests its NIXL backend
(tests/checkpoint_engine/test_nixl_checkpoint_engine.py in verl's repository): Ray actors as 2
trainers and 2/4/6 rollout workers, 3 update rounds, every received weight equal to the
trainer's. On CPU, with a small model built locally from a transformers config (no download);
each round the trainer changes every weight, so each round is a new version.

The cross-node variant gives every actor its own memsem node id (``MEMSEM_NODE_ID``) and the tcp
engine: shared memory and cross-memory attach are then forbidden between them, so every bucket
and every ready word travels over tcp (the owner pushes ready transitions), as between nodes.

Runs in .venv-verl (tests/verl/run_verl_tests.sh, ``make test-verl``).
"""
from __future__ import annotations

import os
import secrets

import pytest
import ray
import torch

BUCKET = 64 << 10  # small: many buckets, and tensors bigger than a bucket travel in chunks


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, role: str) -> None:
        import memsem.integrations.verl  # registers the backend, as custom_backend_module does
        from verl.checkpoint_engine import CheckpointEngineRegistry

        self.role = role
        self.model = _model()
        self.engine = CheckpointEngineRegistry.new("memsem", bucket_size=BUCKET, timeout=120.0)
        self.received: dict[str, torch.Tensor] = {}
        self.round = 0

    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    async def update_weights(self, step: int):
        self.round = step
        if self.role == "trainer":
            with torch.no_grad():
                sd = {k: v + step for k, v in self.model.state_dict().items()}
            return await self.engine.send_weights(iter(sd.items()), global_steps=step)
        async for name, weight in self.engine.receive_weights(global_steps=step):
            self.received[name] = weight.clone()
        return len(self.received)

    def bytes_by_route(self) -> dict:
        rt = self.engine._rt
        return {} if rt is None else dict(rt.stats().bytes_by_route)

    def check_weights(self):
        if self.role == "trainer":
            return 0
        n = 0
        for name, weight in self.model.state_dict().items():
            assert name in self.received, f"weight {name} not received"
            want = weight + self.round
            got = self.received[name]
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), f"weight {name} not equal"
            n += 1
        self.received.clear()
        return n


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["MEMSEM_TEST_JOB"] = f"verl{os.getpid()}-{secrets.token_hex(3)}"
    # the actors import this module (its Worker class): PYTHONPATH in _env
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=_env(None))
    yield
    ray.shutdown()


def _env(node: str | None) -> dict:
    env = {"MEMSEM_JOB": os.environ["MEMSEM_TEST_JOB"], "RAY_worker_niceness": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    if node is not None:
        env.update(MEMSEM_NODE_ID=node, MEMSEM_ENGINES="loopback,host,tcp")
    return {"env_vars": env}


@pytest.mark.parametrize("num_rollout", [2, 4, 6])
def test_memsem_checkpoint_engine(ray_cluster, num_rollout):
    _rounds(num_rollout, across_nodes=False)


def test_memsem_checkpoint_engine_across_nodes(ray_cluster):
    """Trainers and rollouts on four different memsem nodes: the same 3 rounds, every weight
    equal, and every byte a rollout loaded came over the tcp route."""
    routes = _rounds(2, across_nodes=True)
    for r in routes[2:]:
        assert set(r) == {"tcp"} and r["tcp"] > 0, routes


def _rounds(num_rollout: int, across_nodes: bool) -> list[dict]:
    from memsem.integrations.verl import MemsemCheckpointEngine

    def make(role: str, i: int):
        if not across_nodes:
            return Worker.remote(role)
        return Worker.options(runtime_env=_env(f"verl-{role}-{i}")).remote(role)

    trainer = [make("trainer", i) for i in range(2)]
    rollout = [make("rollout", i) for i in range(num_rollout)]
    workers = trainer + rollout
    for step in range(1, 4):
        # 1. prepare all workers; 2. the engine's own topology; 3. init the process group
        metadata = ray.get([w.execute_checkpoint_engine.remote("prepare") for w in workers])
        actor_kw, rollout_kw = MemsemCheckpointEngine.build_topology(len(trainer), len(rollout), metadata)
        calls = []
        for i, w in enumerate(trainer):
            calls.append(w.execute_checkpoint_engine.remote("init_process_group", rank=actor_kw["rank"][i],
                                                            world_size=actor_kw["world_size"][i],
                                                            master_metadata=actor_kw["master_metadata"][i]))
        for i, w in enumerate(rollout):
            calls.append(w.execute_checkpoint_engine.remote("init_process_group", rank=rollout_kw["rank"][i],
                                                            world_size=rollout_kw["world_size"][i],
                                                            master_metadata=rollout_kw["master_metadata"][i]))
        ray.get(calls, timeout=120)
        # 4. update weights of all workers (trainer and rollouts concurrently)
        out = ray.get([w.update_weights.remote(step) for w in workers], timeout=300)
        assert out[0]["memsem/buckets"] > 1 and out[1] == {}
        assert all(n > 0 for n in out[len(trainer):])
        # 5. finalize; 6. every received weight equals the trainer's of this round
        ray.get([w.execute_checkpoint_engine.remote("finalize") for w in workers], timeout=120)
        counts = ray.get([w.check_weights.remote() for w in workers], timeout=120)
        assert all(c > 0 for c in counts[len(trainer):])
    routes = ray.get([w.bytes_by_route.remote() for w in workers], timeout=120)
    for w in workers:
        ray.get(w.execute_checkpoint_engine.remote("close"))
        ray.kill(w)
    return routes
