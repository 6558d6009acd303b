"""memsem as verl's checkpoint engine, tested the way verl tests its NIXL backend
(tests/checkpoint_engine/test_nixl_checkpoint_engine.py in verl's repository): Ray actors as 2
trainers and 2/4/6 rollout workers, 3 update rounds, every received weight equal to the
trainer's. On CPU, with a small model built locally from a transformers config (no download);
each round the trainer changes every weight, so each round is a new version.

The cross-node variant gives every actor its own memsem node id (``MEMSEM_NODE_ID``), the tcp
engine and the redis directory (a redis-server the module starts on loopback), with no job secret
and nothing passed by hand: the refs travel in verl's own metadata (prepare -> build_topology ->
init_process_group). Shared memory and cross-memory attach are forbidden between the actors, so
every bucket and every ready word travels over tcp (the owner pushes ready transitions), as
between nodes. A rollout SIGKILLed mid-sync, or one whose consumer fails, is reported by the
trainer as PeerLostError naming it: by memsem's liveness, not the trainer's timeout.

The engine's default fan-out is a chain (the trainer's window read by rollout 1 alone, each
rollout re-serving every bucket to the next); one case runs the star.

Runs in .venv-verl (tests/verl/run_verl_tests.sh, ``make test-verl``).
"""
from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
import time

import pytest
import ray
import torch

import memsem

BUCKET = 64 << 10  # small: many buckets, and tensors bigger than a bucket travel in chunks
NETNS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "netns")
TIMEOUT = 120.0  # the engines' bound of every wait: a test that hits it has failed


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


class _Odd(torch.nn.Module):
    """A state dict of every alignment: sizes that are not multiples of the next tensor's
    alignment (``bool (3,)`` then ``float32 (2,)``: packed end to end, the float32 tensor would
    start at an odd byte), and one tensor bigger than a bucket (it travels in chunks)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        for i, (dt, n) in enumerate([(torch.bool, 3), (torch.float32, 2), (torch.uint8, 5), (torch.float64, 3),
                                     (torch.int8, 1), (torch.bfloat16, 7), (torch.int64, 3), (torch.float16, 5),
                                     (torch.int32, 1), (torch.float32, 20011), (torch.bool, 1), (torch.int16, 3)]):
            t = torch.randint(0, 100, (n,), generator=g).to(dt) if not dt.is_floating_point else \
                torch.randn(n, generator=g).to(dt)
            self.register_buffer(f"t{i:02d}_{str(dt).removeprefix('torch.')}", t)


def _stepped(v: torch.Tensor, step: int) -> torch.Tensor:
    """The trainer's value of ``v`` at ``step`` (of the same dtype: a bool flips on odd steps)."""
    return v ^ bool(step % 2) if v.dtype == torch.bool else v + step


def _sparse(v: torch.Tensor, step: int) -> torch.Tensor:
    """The trainer's value of ``v`` at ``step`` when it changes few elements (the delta runs):
    every 50th element from ``step % 50`` stepped, the others as built (4% differ between two
    steps)."""
    out = v.clone()
    flat = out.view(-1)
    flat[step % 50::50] = _stepped(flat[step % 50::50], step)
    return out


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, role: str, index: int, fanout: str = "chain", model: str = "llama", delta: bool = False) -> None:
        import memsem.integrations.verl  # registers the backend, as custom_backend_module does
        from verl.checkpoint_engine import CheckpointEngineRegistry

        self.role = role
        self.model = _model() if model == "llama" else _Odd()
        # as verl's actor workers do: is_master=(rank == 0) on the actors
        self.engine = CheckpointEngineRegistry.new("memsem", bucket_size=BUCKET, timeout=TIMEOUT, fanout=fanout,
                                                   is_master=(role == "trainer" and index == 0), delta=delta)
        self.value = _sparse if delta else _stepped  # the trainer's value of a weight at a step
        self.received: dict[str, torch.Tensor] = {}
        self.round = 0
        self.stalled = False

    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    async def update_weights(self, step: int, stall_after: int | None = None, fail_after: int | None = None):
        """Trainer: send this round's weights. Rollout: receive them; ``stall_after`` n weights
        it stops consuming (and says so: ``is_stalled``), ``fail_after`` n weights it raises."""
        self.round = step
        if self.role == "trainer":
            with torch.no_grad():
                sd = {k: self.value(v, step) for k, v in self.model.state_dict().items()}
            return await self.engine.send_weights(iter(sd.items()), global_steps=step)
        async for name, weight in self.engine.receive_weights(global_steps=step):
            self.received[name] = weight.clone()
            if fail_after is not None and len(self.received) >= fail_after:
                raise ValueError(f"the test's rollout consumer fails after {fail_after} weights")
            if stall_after is not None and len(self.received) >= stall_after:
                self.stalled = True
                await asyncio.sleep(3600)  # killed meanwhile
        return len(self.received)

    def corrupt_relayed_bucket(self, index: int) -> None:
        """Make this rollout a faulty relay: it stops checking digests and flips a data byte of
        bucket ``index`` in the slot it re-serves, before committing it."""
        engine = self.engine

        def verify(buf, head, version):
            if head["index"] == index:
                buf[engine.meta_bytes] ^= 0xFF

        engine._verify = verify

    def reserve_an_older_bucket(self, index: int) -> None:
        """Make this rollout a faulty relay: it stops checking digests and re-serves bucket
        ``index - 1`` whole (its header, metadata and bytes, all the trainer's) in the slot of
        bucket ``index``."""
        engine = self.engine
        seen: dict = {}

        def verify(buf, head, version):
            seen[head["index"]] = buf.copy()
            if head["index"] == index:
                buf[:] = seen[index - 1]

        engine._verify = verify

    def is_stalled(self) -> bool:
        return self.stalled

    def received_so_far(self) -> tuple[int, int, list[str]]:
        """(weights received, weights of the model, names of those received that are not the
        trainer's of this round)."""
        sd = self.model.state_dict()
        wrong = [k for k, v in self.received.items() if not torch.equal(v, self.value(sd[k], self.round))]
        return len(self.received), len(sd), wrong

    def metrics(self) -> dict:
        return dict(self.engine.metrics)

    def pid(self) -> int:
        return os.getpid()

    def bytes_by_route(self) -> dict:
        rt = self.engine._rt
        return {} if rt is None else dict(rt.stats().bytes_by_route)

    def placement(self) -> dict:
        """Where this actor runs: its network namespace, memsem node, the directory its
        runtime opened and the memsem settings it inherited."""
        rt = self.engine._rt
        return {"netns": os.readlink("/proc/self/ns/net"), "node": memsem.native.node_id(),
                "directory": None if rt is None else type(rt.directory).__name__,
                "engines": None if rt is None else list(rt.engines),
                "ops": None if rt is None else dict(rt.stats().ops_by_route),
                "errors": None if rt is None else dict(rt.stats().errors),
                "env": sorted(k for k in os.environ if k.startswith("MEMSEM_"))}

    def check_weights(self):
        if self.role == "trainer":
            return 0
        n = 0
        for name, weight in self.model.state_dict().items():
            assert name in self.received, f"weight {name} not received"
            want = self.value(weight, self.round)
            got = self.received[name]
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), f"weight {name} not equal"
            n += 1
        self.received.clear()
        return n


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["MEMSEM_TEST_JOB"] = f"verl{os.getpid()}-{secrets.token_hex(3)}"
    os.environ.pop("MEMSEM_JOB_SECRET", None)  # nothing set by hand: the actors inherit this
    # the actors import this module (its Worker class): PYTHONPATH in _env
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=_env(None))
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def redis_url():
    """A redis-server on loopback for the cross-node runs (installed when missing and root)."""
    sys.path.insert(0, NETNS)
    try:
        import redis_server
    finally:
        sys.path.remove(NETNS)
    binary = redis_server.find_redis_server()
    if binary is None and os.geteuid() == 0:
        subprocess.run(["sh", os.path.join(NETNS, "install_redis.sh")], check=True, capture_output=True, timeout=900)
        binary = redis_server.find_redis_server()
    if binary is None:
        pytest.fail("redis-server not found; run as root: sh tests/netns/install_redis.sh")
    with redis_server.redis_server(binary=binary) as srv:
        yield srv.url


def _env(node: str | None, directory: str | None = None) -> dict:
    env = {"MEMSEM_JOB": os.environ["MEMSEM_TEST_JOB"], "RAY_worker_niceness": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    if node is not None:
        env.update(MEMSEM_NODE_ID=node, MEMSEM_ENGINES="loopback,host,tcp")
    if directory is not None:
        env.update(MEMSEM_DIRECTORY=directory, MEMSEM_HEARTBEAT_TTL="2")
    return {"env_vars": env}


@pytest.mark.parametrize("num_rollout, fanout", [(2, "chain"), (4, "chain"), (6, "chain"), (4, "star")])
def test_memsem_checkpoint_engine(ray_cluster, num_rollout, fanout):
    """Chain (the default): the trainer's window is read by rollout 1 alone, rollout k by
    rollout k + 1; star: by every rollout. Either way every weight arrives equal."""
    _rounds(*_workers(2, num_rollout, fanout=fanout), readers=1 if fanout == "chain" else num_rollout)


def test_the_chain_follows_a_restarted_trainer(ray_cluster):
    """A round; then the sending trainer's actor is killed (a crash) and a new one made in its
    place (a restore from checkpoint: a new process, new windows); the same rollouts, whose
    engines saw the old trainer, sync the next rounds from the new one: every weight equal to
    the new trainer's, nothing of the old one's, and the old trainer's windows never looked
    for again (no error, no wait on the dead process)."""
    trainer, rollout = _workers(2, 2)
    try:
        _round(trainer, rollout, 1)
        old_pid = ray.get(trainer[0].pid.remote(), timeout=60)
        ray.kill(trainer[0], no_restart=True)
        trainer[0] = Worker.remote("trainer", 0, "chain", "llama")
        assert ray.get(trainer[0].pid.remote(), timeout=900) != old_pid
        for step in (2, 3):
            _round(trainer, rollout, step)
        errors = ray.get([w.placement.remote() for w in rollout], timeout=120)
        assert all(not p["errors"].get("peer_lost") for p in errors), errors
    finally:
        for w in trainer + rollout:
            ray.kill(w)


@pytest.mark.parametrize("num_rollout", [2, 3])
def test_memsem_checkpoint_engine_across_nodes(ray_cluster, redis_url, num_rollout):
    """2 trainers and 2 or 3 rollouts, each on a memsem node of its own, with the redis
    directory and no job secret: the same 3 rounds, every weight equal, every byte a rollout
    loaded came over the tcp route, and the chain holds: what an owner served (its server's
    copies out of its own windows count as its route ``loopback``) is exactly what the next one
    in the chain loaded over tcp, so the trainer's link carried the buckets once; besides, every
    rollout read each bucket's 32-byte digest from the trainer itself."""
    from memsem.integrations.verl import DIGEST_SIZE

    assert "MEMSEM_JOB_SECRET" not in os.environ
    stats: dict = {}
    routes = _rounds(*_workers(2, num_rollout, redis_url), stats=stats)
    digests = stats["buckets"] * DIGEST_SIZE  # what each rollout read from the trainer's digest window
    chain = [routes[0]] + routes[2:]  # the trainer (its idle second actor sends nothing), the rollouts
    for k, r in enumerate(chain[1:], 1):
        assert set(r) <= {"tcp", "loopback"} and r.get("tcp", 0) > digests, routes
        # served upstream == loaded here (from the trainer: also every other rollout's digests)
        want = r["tcp"] + (num_rollout - 1) * digests if k == 1 else r["tcp"] - digests
        assert chain[k - 1].get("loopback", 0) == want, (k, digests, routes)
    assert chain[-1].get("loopback", 0) == 0, routes  # the last rollout serves nothing


def test_deltas_across_nodes(ray_cluster, redis_url):
    """``delta=True`` across nodes (tcp, the redis directory), a chain of 2 rollouts, 4 rounds
    of 4% of the elements changed: the first round whole, the next ones every bucket a delta
    (the rollouts relay deltas), every weight equal to the trainer's, no fallback, and the bytes
    each rollout loaded over tcp in the delta rounds a small part of the first round's."""
    trainer, rollout = _workers(2, 2, redis_url, delta=True)
    workers = trainer + rollout
    try:
        tcp = []
        for step in range(1, 5):
            _setup(trainer, rollout)
            out = ray.get([w.update_weights.remote(step) for w in workers], timeout=300)
            ray.get([w.execute_checkpoint_engine.remote("finalize") for w in workers], timeout=120)
            assert all(c > 0 for c in ray.get([w.check_weights.remote() for w in rollout], timeout=120))
            m, rm = out[0], ray.get([w.metrics.remote() for w in rollout], timeout=60)
            assert m["memsem/delta_buckets"] == (0 if step == 1 else m["memsem/buckets"]), (step, m)
            assert all(r["memsem/fallbacks"] == 0 and r["memsem/received_bytes"] == m["memsem/sent_bytes"]
                       for r in rm), rm
            tcp.append([r.get("tcp", 0) for r in ray.get([w.bytes_by_route.remote() for w in rollout], timeout=60)])
        first = tcp[0]
        for a, b in zip(tcp[1:], tcp[2:]):
            assert all(y - x < 0.2 * f for x, y, f in zip(a, b, first)), tcp
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.parametrize("how", ["killed-across-nodes", "failed"])
def test_a_rollout_that_leaves_mid_sync_is_reported_by_name(ray_cluster, redis_url, how):
    """Rollout 2 receives the first weight, then is SIGKILLed (on its own node, redis
    directory), or its consumer raises (same node). The trainer's send_weights raises
    PeerLostError naming rollout 2, by memsem's liveness (the killed rollout's connection, its
    process) or its failure report, not by the trainer's timeout. (In the chain rollout 1 meets
    it first, waiting for rollout 2's word, and leaves the sync naming it: the trainer's error
    carries both.)"""
    across = how.startswith("killed")
    trainer, rollout = _workers(2, 2, redis_url if across else None)
    workers = trainer + rollout
    try:
        _setup(trainer, rollout)
        step = 1
        sends = [w.update_weights.remote(step) for w in trainer]
        keep = rollout[0].update_weights.remote(step)
        if across:
            leaving = rollout[1].update_weights.remote(step, stall_after=1)
            deadline = time.monotonic() + TIMEOUT
            while not ray.get(rollout[1].is_stalled.remote(), timeout=60):
                assert time.monotonic() < deadline, "rollout 2 never received its first weight"
                time.sleep(0.05)
            ray.kill(rollout[1], no_restart=True)
        else:
            leaving = rollout[1].update_weights.remote(step, fail_after=1)
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(sends[0], timeout=TIMEOUT + 60)
        err = info.value
        assert isinstance(err, memsem.PeerLostError), repr(err)
        text = str(err)
        assert "rollout 2 (pid" in text and "MemsemTimeoutError" not in text, text
        # a consumer that raises closes the stream: the engine reports that (it cannot see why)
        assert ("died" in text) if across else ("left the sync" in text and "stopped receiving" in text), text
        assert not re.search(r"\d\.\d{5,}", text), text  # no float noise in the message
        for ref in (leaving, sends[1]):
            try:
                ray.get(ref, timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                pass
        del keep
    finally:
        for w in workers:
            ray.kill(w)


def test_a_relay_that_passes_on_wrong_bytes_is_caught_by_the_trainers_digest(ray_cluster):
    """A chain of 3 rollouts whose first one (a relay) flips a byte of bucket 1 after it
    received it and re-serves it unchecked: rollout 2 refuses the bucket against the trainer's
    digest, read from the trainer's own digest window (DigestMismatchError naming rollout 1,
    the bucket and the version; nothing of it yielded), and the trainer's send_weights raises
    PeerLostError carrying that down the chain."""
    trainer, rollout = _workers(2, 3)
    workers = trainer + rollout
    try:
        _setup(trainer, rollout)
        ray.get(rollout[0].corrupt_relayed_bucket.remote(1), timeout=60)
        sends = [w.update_weights.remote(1) for w in trainer]
        received = [w.update_weights.remote(1) for w in rollout]
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(sends[0], timeout=TIMEOUT + 60)
        assert isinstance(info.value, memsem.PeerLostError), repr(info.value)
        text = str(info.value)
        assert "DigestMismatchError" in text and "bucket 1 (version 3)" in text, text
        assert re.search(r"rollout 1 \(pid \d+ on '[^']*'\) served wrong bytes", text), text
        with pytest.raises(ray.exceptions.RayTaskError) as second:
            ray.get(received[1], timeout=TIMEOUT)
        assert isinstance(second.value, memsem.DigestMismatchError), repr(second.value)
        assert "rollout 1 (pid" in str(second.value) and "none were accepted" in str(second.value)
        # rollout 2's consumer got the weights of bucket 0 alone, each equal to the trainer's
        n, total, wrong = ray.get(rollout[1].received_so_far.remote(), timeout=60)
        assert 0 < n < total and wrong == [], (n, total, wrong)
        for ref in received[::2] + sends[1:]:
            try:
                ray.get(ref, timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                pass
    finally:
        for w in workers:
            ray.kill(w)


def test_tensors_of_every_size_and_alignment_arrive_whole(ray_cluster):
    """A state dict whose tensor sizes are not multiples of the next tensor's alignment
    (bool (3,) then float32 (2,), ...; one tensor bigger than a bucket): through a chain of 2
    rollouts, every weight of every round arrives equal, of its dtype and shape."""
    _rounds(*_workers(2, 2, model="odd"))


def test_a_relay_that_reserves_an_older_bucket_whole_is_named(ray_cluster):
    """A chain of 3 rollouts whose first one re-serves bucket 0 whole (the trainer's own
    header, metadata and bytes) as bucket 1: rollout 2 refuses it as a wrong bucket naming
    rollout 1 (DigestMismatchError, like a flipped byte), and the trainer's send_weights
    raises PeerLostError carrying that down the chain."""
    trainer, rollout = _workers(2, 3)
    workers = trainer + rollout
    try:
        _setup(trainer, rollout)
        ray.get(rollout[0].reserve_an_older_bucket.remote(1), timeout=60)
        sends = [w.update_weights.remote(1) for w in trainer]
        received = [w.update_weights.remote(1) for w in rollout]
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(sends[0], timeout=TIMEOUT + 60)
        assert isinstance(info.value, memsem.PeerLostError), repr(info.value)
        text = str(info.value)
        assert "DigestMismatchError" in text and "bucket 1 (version 3)" in text, text
        assert re.search(r"rollout 1 \(pid \d+ on '[^']*'\) served a wrong bucket", text), text
        with pytest.raises(ray.exceptions.RayTaskError) as second:
            ray.get(received[1], timeout=TIMEOUT)
        assert isinstance(second.value, memsem.DigestMismatchError), repr(second.value)
        assert "it holds bucket 0: a bucket out of order" in str(second.value), str(second.value)
        assert "rollout 1 (pid" in str(second.value) and "none of it was accepted" in str(second.value)
        n, total, wrong = ray.get(rollout[1].received_so_far.remote(), timeout=60)
        assert 0 < n < total and wrong == [], (n, total, wrong)
        for ref in received[::2] + sends[1:]:
            try:
                ray.get(ref, timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                pass
    finally:
        for w in workers:
            ray.kill(w)


def _workers(num_trainer: int, num_rollout: int, directory: str | None = None,
             fanout: str = "chain", model: str = "llama", delta: bool = False) -> tuple[list, list]:
    """Trainer and rollout actors; with ``directory`` each on its own memsem node."""
    def make(role: str, i: int):
        if directory is None:
            return Worker.remote(role, i, fanout, model, delta)
        return Worker.options(runtime_env=_env(f"verl-{role}-{i}", directory)).remote(role, i, fanout, model, delta)

    return [make("trainer", i) for i in range(num_trainer)], [make("rollout", i) for i in range(num_rollout)]


def _setup(trainer: list, rollout: list) -> None:
    """verl's CheckpointEngineManager.build_process_group: prepare all workers, the engine's own
    topology, init the process group (the refs travel in this metadata)."""
    from memsem.integrations.verl import MemsemCheckpointEngine

    workers = trainer + rollout
    # (the first call of a round waits for the actors to start: torch, verl and a model each)
    metadata = ray.get([w.execute_checkpoint_engine.remote("prepare") for w in workers], timeout=900)
    actor_kw, rollout_kw = MemsemCheckpointEngine.build_topology(len(trainer), len(rollout), metadata)
    calls = []
    for group, kw in ((trainer, actor_kw), (rollout, rollout_kw)):
        for i, w in enumerate(group):
            calls.append(w.execute_checkpoint_engine.remote("init_process_group",
                                                            **{k: v[i] for k, v in kw.items()}))
    ray.get(calls, timeout=120)


def _round(trainer: list, rollout: list, step: int, readers: int = 1) -> int:
    """One round of verl's update (prepare, topology, send/receive, finalize), every received
    weight checked equal to the trainer's of ``step``; returns the buckets sent."""
    workers = trainer + rollout
    _setup(trainer, rollout)
    # update weights of all workers (trainer and rollouts concurrently)
    out = ray.get([w.update_weights.remote(step) for w in workers], timeout=300)
    assert out[0]["memsem/buckets"] > 1 and out[1] == {}
    assert out[0]["memsem/trainer_readers"] == readers  # who reads the trainer's window
    assert all(n > 0 for n in out[len(trainer):])
    # finalize; every received weight equals the trainer's of this round
    ray.get([w.execute_checkpoint_engine.remote("finalize") for w in workers], timeout=120)
    counts = ray.get([w.check_weights.remote() for w in workers], timeout=120)
    assert all(c > 0 for c in counts[len(trainer):])
    return int(out[0]["memsem/buckets"])


def _rounds(trainer: list, rollout: list, readers: int = 1, placements: list | None = None,
            stats: dict | None = None) -> list[dict]:
    """Three rounds of verl's update; each worker's bytes by route (and, into ``placements``,
    where each one ran; into ``stats``, ``buckets``: the buckets sent in all) before the
    workers go."""
    workers = trainer + rollout
    buckets = 0
    try:
        for step in range(1, 4):
            buckets += _round(trainer, rollout, step, readers)
        routes = ray.get([w.bytes_by_route.remote() for w in workers], timeout=120)
        if placements is not None:
            placements.extend(ray.get([w.placement.remote() for w in workers], timeout=120))
        if stats is not None:
            stats["buckets"] = buckets
        for w in workers:
            ray.get(w.execute_checkpoint_engine.remote("close"), timeout=120)
        return routes
    finally:
        for w in workers:
            ray.kill(w)
