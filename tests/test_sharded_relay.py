"""Relays of sharded slices (issue 35): a rollout rank of replica 2 loads its slices of a version
from replica 1's rank of the same layout, checked against the trainer ranks' own digests of the
byte runs its plan reads from each of them (memsem.sync._sharded_relay).

Trainer ranks publish a fp16/fp32 layer ``Shard(0)`` over 2 ranks (uneven rows); the rollout
layout is TP 2 with fused qkv, a row-parallel o and a column-parallel w. Every child's slices are
compared bit-exact with a reader that loads the same targets from the trainer ranks (itself
checked against torch's slicing in tests/test_reshard.py) and with torch's own ``chunk`` / ``cat``
of the full tensors.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import memsem
from memsem import DigestMismatchError, MemsemTimeoutError, VersionGoneError
from memsem.sync import Shard, Target, lookup_sharded, publish_sharded, tp_targets
from memsem.sync._sharded_relay import HEADER, ShardedRelay
from tests._proc import recv
from tests._sharded_ranks import far_trainers, random_model, row_shards, values

torch = pytest.importorskip("torch")

SHAPES = {"l.q": (40, 24), "l.k": (12, 24), "l.v": (12, 24), "l.o": (24, 40), "l.w": (31, 9), "l.norm": (24,)}
DTYPES = {"l.w": np.float32, "l.norm": np.float32}
TP = {"column": ["w"], "row": ["o"], "fused": {"qkv": ["q", "k", "v"]}}


def _full(seed: int) -> dict[str, np.ndarray]:
    return random_model(np.random.default_rng(seed), SHAPES, DTYPES)


@pytest.fixture
def trainer(memsem_runtime):
    """Two trainer ranks of ``"sd"`` in this process; ``commit(seed)`` commits the next version."""
    pubs = [publish_sharded(memsem_runtime, row_shards(_full(1), r), name="sd", rank=r, world_size=2,
                            placements={k: [Shard(0)] for k in SHAPES}, global_shapes=SHAPES) for r in range(2)]
    fulls = {1: _full(1)}

    def commit(seed: int) -> int:
        full = _full(seed)
        vs = {p.update(row_shards(full, r)) for r, p in enumerate(pubs)}
        assert len(vs) == 1
        fulls[vs.pop()] = full
        return max(fulls)

    yield memsem_runtime, commit, fulls
    for p in pubs:
        p.close()


def _targets(sd, rank: int):
    return tp_targets(sd.names, degree=2, rank=rank, **TP)


def _torch_expected(target: Target, full: dict) -> bytes:
    parts = []
    for s in target.sources:
        t = torch.from_numpy(full[s].copy())
        parts.append(torch.chunk(t, target.degree, dim=target.dim)[target.rank] if target.dim is not None else t)
    return (torch.cat(parts, dim=target.cat_dim) if len(parts) > 1 else parts[0]).contiguous().numpy().tobytes()


def _relay_and_child(rt, rank: int, name: str):
    sd = lookup_sharded(rt, "sd")
    reader = sd.reader(_targets(sd, rank), reader=rank)
    relay = ShardedRelay(rt, reader, name=name)
    child = sd.relay_reader(_targets(sd, rank), relay=name, reader=rank)
    return sd, relay, reader.empty("numpy"), child, child.empty("numpy")


def _bytes(into: dict) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in into.items()}


def test_child_of_a_relay_gets_the_slices_bit_exact_and_the_trainer_serves_none(trainer):
    rt, commit, fulls = trainer
    for rank in range(2):
        sd, relay, held, child, into = _relay_and_child(rt, rank, f"sd@tp{rank}")
        with relay:
            for seed in (None, 2, 3):
                if seed is not None and rank == 0:
                    commit(seed)
                v = relay.load(held)
                assert child.load(into, version=v) == v
                assert _bytes(into) == _bytes(held)
                direct = sd.reader(child.plan, delta=False)
                want = direct.empty("numpy")
                assert direct.load(want, version=v) == v and _bytes(into) == _bytes(want)
                for n, t in _targets(sd, rank).items():
                    assert into[n].tobytes() == _torch_expected(t, fulls[v]), (rank, v, n)
            # the trainer ranks served digests only: no byte of the slices came from them
            assert child.fallbacks == [] and child.trainer_reader.window_bytes == 0
            assert child.relay_bytes == 3 * child.plan.target_bytes() and child.loads == 3


def test_runs_are_checked_in_groups_and_a_flip_in_any_group_is_named(trainer, monkeypatch):
    """A plan of more runs than one digest request asks for (a column slice: one run per row)
    is checked group by group, every group against its own digest."""
    from memsem.sync import _sharded_relay

    monkeypatch.setattr(_sharded_relay, "DIGEST_RUNS", 4)
    rt, _, _ = trainer
    sd, relay, held, child, into = _relay_and_child(rt, 1, "sd@groups")
    with relay:
        assert min(len(g) for g in child._runs.values()) > 2  # l.o's columns: 24 rows over 2 ranks
        v = relay.load(held)
        assert child.load(into) == v and _bytes(into) == _bytes(held)
        with relay.ref.write_section() as sec:  # the last row's column slice of l.o
            sec.tensors["l.o"][-1, -1] += 1
        with pytest.raises(DigestMismatchError, match="relay 'sd@groups'"):
            child.load(into)


def test_a_relay_that_flips_a_byte_is_named(trainer):
    rt, _, _ = trainer
    _, relay, held, child, into = _relay_and_child(rt, 1, "sd@flip")
    with relay:
        v = relay.load(held)
        with relay.ref.write_section() as sec:  # the relay's bytes change, its label stays v
            sec.tensors["l.qkv"].reshape(-1).view(np.uint8)[7] ^= 0x10
        with pytest.raises(DigestMismatchError, match="relay 'sd@flip'") as e:
            child.load(into)
        assert e.value.relay == "sd@flip" and e.value.version == v
        assert child.loads == 0


def _relabel(relay, version: int) -> None:
    """The relay's bytes stay, its label says ``version`` (what a faulty relay may serve)."""
    with relay.ref.write_section() as sec:
        sec.tensors[HEADER][16:24] = np.frombuffer(version.to_bytes(8, "little"), np.uint8)


def test_a_relay_that_serves_an_older_version_under_the_new_label_is_named(trainer):
    rt, commit, _ = trainer
    sd, relay, held, child, into = _relay_and_child(rt, 0, "sd@stale")
    with relay:
        assert relay.load(held) == 1
        assert commit(2) == 2
        # the relay labels version 1's bytes as version 2 (a relay that skipped its copy)
        old = _bytes(held)
        _relabel(relay, 2)
        with pytest.raises(DigestMismatchError, match="not version 2's") as e:
            child.load(into, version=2)
        assert e.value.relay == "sd@stale" and _bytes(into)["l.qkv"] == old["l.qkv"]
        # a label the trainer has not committed yet is named too (never waited for)
        _relabel(relay, 9)
        with pytest.raises(DigestMismatchError, match="committed only up to 2"):
            child.load(into)


def test_a_child_whose_plan_differs_is_refused_naming_both(trainer):
    rt, _, _ = trainer
    sd = lookup_sharded(rt, "sd")
    relay = ShardedRelay(rt, sd.reader({"o": Target("l.o", dim=1, degree=2, rank=0)}), name="sd@o0")
    with relay:
        # the same target names, shapes and dtypes, the other column half: another plan
        with pytest.raises(ValueError, match="relay 'sd@o0' serves plan [0-9a-f]{32} .* plan is [0-9a-f]{32}"):
            sd.relay_reader({"o": Target("l.o", dim=1, degree=2, rank=1)}, relay="sd@o0")
        with pytest.raises(ValueError, match="relay 'sd@o0' does not serve this plan"):
            sd.relay_reader(_targets(sd, 0), relay="sd@o0")
        assert sd.relay_reader({"o": Target("l.o", dim=1, degree=2, rank=0)}, relay="sd@o0").version() == 0


def test_a_relay_behind_is_waited_for_within_the_timeout_then_named(trainer):
    rt, commit, _ = trainer
    _, relay, held, child, into = _relay_and_child(rt, 1, "sd@behind")
    with relay:
        assert relay.load(held) == 1
        assert commit(2) == 2
        with pytest.raises(MemsemTimeoutError, match="relay 'sd@behind' of 'sd' serves version 1, not 2"):
            child.load(into, version=2, timeout=0.05)
        waiting = threading.Event()
        got: list = []
        real = child.wait_version

        def wait_version(version, timeout=None):
            waiting.set()
            return real(version, timeout)

        child.wait_version = wait_version
        t = threading.Thread(target=lambda: got.append(child.load(into, version=2, timeout=30)))
        t.start()
        assert waiting.wait(30)  # the child waits for the relay (forced order: then it loads)
        assert relay.load(held) == 2
        t.join(30)
        assert got == [2] and _bytes(into) == _bytes(held)


def test_a_version_the_trainer_no_longer_holds_loads_from_the_trainer_ranks(trainer):
    rt, commit, fulls = trainer
    _, relay, held, child, into = _relay_and_child(rt, 0, "sd@slow")
    with relay:
        assert relay.load(held) == 1
        commit(2)
        commit(3)  # version 1's slots are overwritten: the relay's bytes cannot be checked
        assert child.load(into) == 3
        assert [v for v, _ in child.fallbacks] == [1] and "no longer holds version 1" in child.fallbacks[0][1]
        for n, t in _targets(lookup_sharded(rt, "sd"), 0).items():
            assert into[n].tobytes() == _torch_expected(t, fulls[3])


def test_the_digest_of_runs_is_of_exactly_one_version(trainer):
    """``RuntimeCore.digest_runs`` on one node: the runs' bytes of the version asked, in order,
    concatenated; a version overwritten is VersionGoneError."""
    from memsem.engines import run_digest

    rt, commit, _ = trainer
    ref = lookup_sharded(rt, "sd").refs[1]
    raw = np.asarray(rt.get_spec(ref.spec)).view(np.uint8).reshape(-1)
    runs = [(ref.layout.header_bytes + 40, 7), (3, 5), (ref.spec.nbytes - 9, 9)]
    h = run_digest()
    for off, n in runs:
        h.update(raw[off:off + n].tobytes())
    assert rt.digest_runs(ref.spec, runs, version=1) == (1, h.digest())
    commit(2)
    commit(3)
    with pytest.raises(VersionGoneError):
        rt.digest_runs(ref.spec, runs, version=1)
    with pytest.raises(ValueError, match="runs\\[0\\]"):
        rt.digest_runs(ref.spec, [(ref.spec.nbytes, 1)], version=3)


def test_the_follower_of_a_relay_child(trainer):
    rt, commit, _ = trainer
    _, relay, held, child, into = _relay_and_child(rt, 1, "sd@follow")
    with relay:
        relay.load(held)
        with rt.follow(child, into=into, timeout=30) as follower:
            v, _ = next(follower)
            assert v == 1 and _bytes(into) == _bytes(held)
            commit(2)
            relay.load(held)
            v, _ = next(follower)
        assert v == 2 and _bytes(into) == _bytes(held)


def test_over_tcp_the_trainer_ranks_answer_digests_of_the_runs(monkeypatch):
    """Trainer ranks on another node: the child checks the relay's bytes with the DIGEST request
    each trainer rank's owner answers (16 bytes back), and names a lying relay."""
    from memsem.engines.tcp._engine import TcpEngine

    asked: list = []
    real = TcpEngine.digest_version

    def digest_version(self, remote, runs, version):
        asked.append(version)
        return real(self, remote, runs, version)

    monkeypatch.setattr(TcpEngine, "digest_version", digest_version)
    with far_trainers(monkeypatch, "farrelay") as (rt, conns):
        sd = lookup_sharded(rt, "farrelay", timeout=30)
        assert rt.route(sd.refs[0]).engine == "tcp"
        targets = {"w": Target("w", dim=1, degree=2, rank=1), "b": Target("b")}
        relay = ShardedRelay(rt, sd.reader(targets), name="farrelay@tp1")
        with relay:
            held = relay.reader.empty("numpy")
            child = sd.relay_reader(targets, relay="farrelay@tp1")
            into = child.empty("numpy")
            assert relay.load(held) == 1 and child.load(into) == 1
            assert into["w"].tobytes() == values(1)[:, 2:].tobytes() and child.fallbacks == []
            for c in conns:
                c.send("commit")
            assert [recv(c) for c in conns] == [2, 2]
            assert relay.load(held, version=2) == 2 and child.load(into, version=2) == 2
            assert into["w"].tobytes() == values(2)[:, 2:].tobytes()
            assert asked == [1, 1, 2, 2]  # one DIGEST per trainer rank and version, at its owner
            # a second child of the same plan: each trainer rank answers from its cache
            other = sd.relay_reader(targets, relay="farrelay@tp1")
            assert other.load(other.empty("numpy"), version=2) == 2
            for c in conns:
                c.send("stats")
            stats = [recv(c) for c in conns]
            assert [(st["digests"], st["digests_cached"]) for st in stats] == [(2, 1), (2, 1)]
            # a digest is hashed in slices, the owner's loop serving other sessions between two:
            # with 8-byte slices the same version checks equal, in many slices
            for c in conns:
                c.send("small digest slices")
            assert [recv(c) for c in conns] == ["ok", "ok"]
            for c in conns:
                c.send("commit")
            assert [recv(c) for c in conns] == [3, 3]
            assert relay.load(held, version=3) == 3 and child.load(into, version=3) == 3
            assert into["w"].tobytes() == values(3)[:, 2:].tobytes() and child.fallbacks == []
            for c in conns:
                c.send("stats")
            after = [recv(c) for c in conns]
            runs_bytes = [sum(n for g in child._runs[r] for _, n in g[0]) for r in (0, 1)]
            for st, was, nb in zip(after, stats, runs_bytes):
                assert st["digests"] == was["digests"] + 1
                assert st["digest_slices"] - was["digest_slices"] >= -(-nb // 8) > 1
            with relay.ref.write_section() as sec:
                sec.tensors["w"][4, 0] += 1
            with pytest.raises(DigestMismatchError, match="relay 'farrelay@tp1'"):
                child.load(into)
            # version 3 overwritten at the owners: its digest is refused, cached or not
            for c in conns:
                c.send("commit")
                c.send("commit")
            assert [recv(c) for c in conns for _ in range(2)] == [4, 5, 4, 5]
            for r in (0, 1):
                with pytest.raises(VersionGoneError):
                    rt.digest_runs(sd.refs[r].spec, child._runs[r][0][0], version=3)
            assert child.trainer_reader.window_bytes == 0


@pytest.mark.multiproc
def test_fsdp2_trainer_to_two_tp2_replicas_through_relays_bit_exact():
    """FSDP2 ``fully_shard`` over gloo on 2 trainer ranks (bf16 and fp32, uneven shards); replica
    1's TP 2 ranks load from the trainer ranks and relay, replica 2's ranks load from them: every
    slice bit-exact against torch's ``full_tensor()`` sliced the same way, two versions."""
    from memsem_bench.measure import free_port
    from tests._proc import reap, spawn
    from tests.test_reshard import TP as FSDP_TP, _expected, _fsdp_trainer, _np

    port, name = free_port(), "policy"
    procs = [spawn(_fsdp_trainer, r, 2, port, name) for r in range(2)]
    try:
        step, full = recv(procs[0][1], 120)
        with memsem.Runtime(timeout=30) as rt:
            sd = lookup_sharded(rt, name, timeout=60)
            ranks = []
            for rank in range(2):
                targets = tp_targets(sd.names, degree=2, rank=rank, **FSDP_TP)
                reader = sd.reader(targets, reader=rank)
                relay = ShardedRelay(rt, reader, name=f"{name}@tp{rank}")
                child = sd.relay_reader(targets, relay=f"{name}@tp{rank}", reader=rank)
                ranks.append((targets, relay, reader.empty(), child, child.empty()))
            for version in (1, 2):
                if version == 2:
                    for _, c in procs:
                        c.send("step")
                    step, full = recv(procs[0][1], 60)
                fulln = {k: _np(t) for k, t in full.items()}
                for targets, relay, held, child, into in ranks:
                    assert relay.load(held, version=version) == version == step
                    assert child.load(into, version=version) == version
                    for n, t in targets.items():
                        assert _np(into[n]).tobytes() == _expected(t, fulln).tobytes(), (version, n)
            for targets, relay, held, child, into in ranks:
                assert child.fallbacks == [] and child.trainer_reader.bytes_moved == 0
                relay.close()
        for _, c in procs:
            c.send("stop")
    finally:
        reap([p for p, _ in procs], 60)
    assert [p.exitcode for p, _ in procs] == [0, 0]
