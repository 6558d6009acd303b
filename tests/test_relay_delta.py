"""Relays pass deltas on (issue 36): a relay holding version v builds v+1 from the delta records
(its parent's, else the trainer's history) and moves only the chunks they do not rebuild;
every chunk is checked against the trainer's digests, so a wrong record, a changed buffer or a
restarted relay ends in chunks moved in full, never a mix.

Every version is compared bit for bit with the trainer's. Orders are forced with the relays'
hook (``Relay._on_event``) and the owner's record of a version, never by sleeping.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import memsem
from memsem.gva import RefSpec
from memsem.sync._fanout_plan import TRAINER
from tests import _proc

WAIT = 30.0
CHUNK = 64 << 10


def _model(rng) -> dict[str, np.ndarray]:
    return {"w1": rng.standard_normal((512, 1024)).astype(np.float32),  # 2 MiB
            "w2": rng.standard_normal(300_001).astype(np.float32),
            "step": np.zeros((), np.int64)}


def _change(rng, sd: dict, frac: float) -> None:
    for k, a in sd.items():
        flat = a.reshape(-1)
        if flat.size > 1000:
            idx = rng.choice(flat.size, max(1, int(frac * flat.size)), replace=False)
            flat[idx] += 1
        else:
            flat += 1


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


def _recorded(src: memsem.FanoutSource, version: int) -> None:
    """The trainer's history recorded ``version`` (its index moves in step with the window)."""
    src.ref.runtime.wait_version(RefSpec.from_bytes(src.ref.layout.delta.index), version, WAIT)


def _copy(sd: dict) -> dict:
    return {k: a.copy() for k, a in sd.items()}


def _empty(sd: dict) -> dict:
    return {k: np.empty_like(a) for k, a in sd.items()}


class Hooked(memsem.Relay):
    """A relay whose follower stops after completing ``at`` until ``gate`` is set; ``bad_record``
    flips a byte of every record it offers on (a faulty relay)."""

    def __init__(self, *a, at=None, bad_record=False, **kw):
        self.at, self.bad_record = at, bad_record
        self.reached, self.gate = threading.Event(), threading.Event()
        super().__init__(*a, **kw)

    def _on_event(self, event, version, chunk, data):
        if (event, version) == ("complete", self.at):
            self.reached.set()
            if not self.gate.wait(WAIT):
                raise memsem.MemsemTimeoutError("test gate not opened", what="gate", timeout=WAIT)

    def _offer_record(self, rec, gen):
        if self.bad_record and rec.payload.nbytes:
            rec = type(rec).parse(rec.raw.copy(), rec.version, self._tiles(rec))
            rec.payload[0] ^= 0xFF  # the first patch's first index: another element of its tile
        super()._offer_record(rec, gen)

    def _tiles(self, rec):
        from memsem.sync._relay_delta import tiles_of

        return tiles_of(self._up.trainer(WAIT)[0])[0]


@pytest.fixture
def rt(memsem_runtime):
    return memsem_runtime


def _relays(rt, world, **kw):
    return [memsem.Relay(rt, "policy", rank=r, world=world, plan="chain", timeout=WAIT, delta_wait=WAIT, **kw)
            for r in range(world)]


def test_a_chain_moves_about_the_deltas_bytes_per_hop_bit_exact(rt):
    """trainer -> rank 0 -> rank 1, 1% of elements changed per version (after a commit that
    failed midway): each hop moves the
    records (rank 1 gets them from rank 0, not the trainer) and one chunk (the 0-d ``step``,
    changed whole each version); bit-exact."""
    rng = np.random.default_rng(1)
    sd = _model(rng)
    with memsem.FanoutSource(rt, sd, name="policy", chunk_bytes=CHUNK) as src:
        relays = _relays(rt, 2)
        try:
            intos = [_empty(sd) for _ in relays]
            for r, into in zip(relays, intos):
                assert r.load(into, version=1, timeout=WAIT) == 1 and _same(into, sd)
            before = [r.stats() for r in relays]
            with pytest.raises(RuntimeError, match="killed"):  # a commit that fails midway: nothing seen
                with src.write_section() as sec:
                    sec.tensors["w1"][:7] = 0
                    raise RuntimeError("killed mid-commit")
            for v in range(2, 6):
                _change(rng, sd, 0.01)
                assert src.update(sd) == v
                for r, into in zip(relays, intos):
                    assert r.load(into, version=v, timeout=WAIT) == v and _same(into, sd)
            nbytes = src.nbytes
            for r, b in zip(relays, before):
                st = r.stats()
                assert st.deltas == [2, 3, 4, 5], st
                per_version = (st.bytes_received - b.bytes_received) / 4
                assert per_version <= 0.05 * nbytes, (r.rank, per_version, nbytes)
                assert st.chunks[r.plan.parent(r.rank)] == b.chunks[r.plan.parent(r.rank)] + 4  # step's chunk
                assert not st.faults
            assert set(relays[0].stats().records) == {TRAINER}
            assert set(relays[1].stats().records) == {0}  # passed on by its parent
        finally:
            for r in relays:
                r.close()


@pytest.mark.parametrize("behind", [2, 6])
def test_a_relay_that_skips_versions_gets_the_union_or_a_full_version(rt, behind):
    """Rank 0 stops after version 1 while the trainer commits ``behind`` more (its window no
    longer holds 2). 2 behind: it builds 3 from 1 and the records of 2 and 3. 6 behind (the
    trainer's delta history keeps 4): no record of 2 anywhere, nothing fetched, 7 moves in
    full; the next version is a delta again. Bit-exact every time."""
    rng = np.random.default_rng(2)
    sd = _model(rng)
    last = 1 + behind
    with memsem.FanoutSource(rt, sd, name="policy", chunk_bytes=CHUNK) as src:
        r = Hooked(rt, "policy", rank=0, world=1, plan="chain", timeout=WAIT, delta_wait=WAIT, at=1)
        try:
            assert r.reached.wait(WAIT)
            for v in range(2, last + 1):
                _change(rng, sd, 0.01)
                assert src.update(sd) == v
                _recorded(src, v)  # (a commit before the last one is recorded makes that record weaker)
            r.gate.set()
            into = _empty(sd)
            assert r.load(into, version=last, timeout=WAIT) == last and _same(into, sd)
            st = r.stats()
            assert st.versions == [1, last]
            if behind == 2:
                assert st.deltas == [3] and st.records == {TRAINER: 2}
            else:
                assert st.deltas == [] and st.records == {}
                assert st.chunks[TRAINER] == 2 * -(-src.nbytes // CHUNK)
            _change(rng, sd, 0.01)
            assert src.update(sd) == last + 1
            assert r.load(into, version=last + 1, timeout=WAIT) == last + 1 and _same(into, sd)
            assert r.stats().deltas[-1] == last + 1
        finally:
            r.gate.set()
            r.close()


def test_a_wrong_record_or_a_changed_buffer_moves_those_chunks_in_full(rt):
    """Rank 0 offers records with a wrong byte; rank 1's held buffer is changed by hand (through
    ``hold``, against its contract): the chunks that do not match the trainer's digests are
    moved in full from upstream, the rest from the records; bit-exact."""
    rng = np.random.default_rng(3)
    sd = _model(rng)
    with memsem.FanoutSource(rt, sd, name="policy", chunk_bytes=CHUNK) as src:
        relays = [Hooked(rt, "policy", rank=0, world=2, plan="chain", timeout=WAIT, delta_wait=WAIT, bad_record=True),
                  memsem.Relay(rt, "policy", rank=1, world=2, plan="chain", timeout=WAIT, delta_wait=WAIT)]
        try:
            for r in relays:
                r.load(version=1, timeout=WAIT)
            with relays[1].hold(1) as (_, views):
                views["w2"][0] += 1  # a chunk is now wrong here (w1's first patch, step: in others)
            before = relays[1].stats().chunks.get(0, 0)
            _change(rng, sd, 0.01)
            assert src.update(sd) == 2
            for r in relays:
                into = _empty(sd)
                assert r.load(into, version=2, timeout=WAIT) == 2 and _same(into, sd)
            st = relays[1].stats()
            assert st.deltas == [2] and st.records == {0: 1}
            # the chunk the wrong index wrote, the chunk changed here, step's: not all
            assert 3 <= st.chunks[0] - before <= 4
            assert relays[0].stats().chunks == {TRAINER: -(-src.nbytes // CHUNK) + 1}  # version 1, step
        finally:
            for r in relays:
                r.close()


def test_a_relay_restarted_mid_chain_and_its_child_end_bit_exact(rt):
    """Rank 1 of a chain of 3 closes; the trainer commits 3 (rank 2 re-attaches to rank 0 and
    builds 3 from its records); a new rank 1 starts (3 in full) and 4 is a delta everywhere."""
    rng = np.random.default_rng(4)
    sd = _model(rng)
    with memsem.FanoutSource(rt, sd, name="policy", chunk_bytes=CHUNK) as src:
        relays = _relays(rt, 3, attach_timeout=1.0)
        try:
            for v in (1, 2):
                if v > 1:
                    _change(rng, sd, 0.01)
                    src.update(sd)
                for r in relays:
                    assert r.load(version=v, timeout=WAIT) == v
            relays[1].close()
            _change(rng, sd, 0.01)
            assert src.update(sd) == 3
            into = _empty(sd)
            assert relays[2].load(into, version=3, timeout=WAIT) == 3 and _same(into, sd)
            relays[1] = memsem.Relay(rt, "policy", rank=1, world=3, plan="chain", timeout=WAIT, delta_wait=WAIT)
            assert relays[1].load(into, version=3, timeout=WAIT) == 3 and _same(into, sd)
            _change(rng, sd, 0.01)
            assert src.update(sd) == 4
            for r in relays:
                into = _empty(sd)
                assert r.load(into, version=4, timeout=WAIT) == 4 and _same(into, sd)
            assert relays[2].stats().deltas == [2, 3, 4]
            assert relays[1].stats().deltas == [4] and relays[1].stats().versions == [3, 4]
            assert [(v, frm, to) for v, frm, to, _ in relays[2].stats().reattached][:1] == [(3, 1, 0)]
        finally:
            for r in relays:
                r.close()


def test_without_records_or_with_delta_false_every_chunk_moves(rt):
    """``delta=False``, and a trainer that changes every element: every chunk moves; bit-exact."""
    rng = np.random.default_rng(5)
    sd = _model(rng)
    with memsem.FanoutSource(rt, sd, name="policy", chunk_bytes=CHUNK) as src:
        plain = memsem.Relay(rt, "policy", rank=0, world=2, plan="star", timeout=WAIT, delta=False)
        auto = memsem.Relay(rt, "policy", rank=1, world=2, plan="star", timeout=WAIT, delta_wait=WAIT)
        try:
            for r in (plain, auto):
                r.load(version=1, timeout=WAIT)
            _change(rng, sd, 1.0)
            src.update(sd)
            _recorded(src, 2)
            for r in (plain, auto):
                into = _empty(sd)
                assert r.load(into, version=2, timeout=WAIT) == 2 and _same(into, sd)
                st = r.stats()
                assert st.deltas == [] and st.chunks[TRAINER] == 2 * -(-src.nbytes // CHUNK)
            with pytest.raises(TypeError, match="delta"):
                memsem.Relay(rt, "policy", rank=0, world=1, delta="yes")
        finally:
            plain.close()
            auto.close()


# -- another node (tcp) ------------------------------------------------------------------------------------
def _tcp_trainer(conn) -> None:
    os.environ["MEMSEM_NODE_ID"] = "relay-delta-trainer"
    rng = np.random.default_rng(6)
    with memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=30) as rt:
        sd = _model(rng)
        with memsem.FanoutSource(rt, sd, name="remote-policy", chunk_bytes=CHUNK) as src:
            conn.send(_copy(sd))
            while conn.recv() == "step":  # 1% changed, committed, recorded: the version and its values
                _change(rng, sd, 0.01)
                _recorded(src, src.update(sd))
                conn.send((src.version(), _copy(sd)))


@pytest.mark.multiproc
def test_relays_on_another_node_move_deltas_over_tcp(monkeypatch, memsem_job):
    p, conn = _proc.spawn(_tcp_trainer)
    try:
        sd = _proc.recv(conn)
        monkeypatch.setenv("MEMSEM_NODE_ID", "relay-delta-rollouts")
        with memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=30) as rt:
            relays = [memsem.Relay(rt, "remote-policy", rank=r, world=2, plan="chain", timeout=WAIT, delta_wait=WAIT)
                      for r in range(2)]
            try:
                for r in relays:
                    into = _empty(sd)
                    assert r.load(into, version=1, timeout=WAIT) == 1 and _same(into, sd)
                conn.send("step")
                v, sd = _proc.recv(conn)
                for r in relays:
                    into = _empty(sd)
                    assert r.load(into, version=v, timeout=WAIT) == v and _same(into, sd)
                    assert r.stats().deltas == [v]
                assert rt.route(relays[0]._up.trainer(WAIT)[0]).kind == "tcp"  # another node's windows
            finally:
                for r in relays:
                    r.close()
        conn.send("exit")
    finally:
        _proc.reap([p], timeout=10)
