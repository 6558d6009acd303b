"""The sharded reader loads deltas (issues 35, 36): a reader whose tensors hold version b of its
slices applies the writer's patches (element indices and values) of the versions since through
its reshard plan, and reads at the new version only the tiles recorded whole. Checked by its own
digests of what it holds (tensors changed by the user, a history that no longer covers the
versions, other tensors, a record that is not that version's: a full load). Every delta load is
compared bit for bit with a full load of the same version by a reader of the same targets.
"""
from __future__ import annotations

import numpy as np
import pytest

from memsem.gva import RefSpec
from memsem.sync import Shard, Target, lookup_sharded, publish_sharded, tp_targets
from memsem.sync import _delta_format
from memsem.sync._sharded_delta import intersect
from tests._proc import recv
from tests._sharded_ranks import far_trainers, random_model, row_shards, values

WAIT = 30.0
#: one layer of a model over 2 trainer ranks (``Shard(0)``; 301 rows: uneven shards); float16
#: (2 bytes: what a bf16 model moves) and float32 tensors, 64 KiB tiles across rows
SHAPES = {"l.q": (256, 512), "l.k": (64, 512), "l.v": (64, 512), "l.o": (512, 256), "l.w": (301, 96),
          "l.norm": (512,)}
DTYPES = {"l.w": np.float32, "l.norm": np.float32}
TP = {"column": ["w"], "row": ["o"], "fused": {"qkv": ["q", "k", "v"]}}


def _full(rng) -> dict[str, np.ndarray]:
    return random_model(rng, SHAPES, DTYPES)


def _local(full: dict, rank: int) -> dict[str, np.ndarray]:
    return row_shards(full, rank)


def _spread(rng, full: dict, frac: float) -> None:
    """Change ``frac`` of every tensor's elements, spread over it (what an AdamW step does to a
    bf16 copy)."""
    for a in full.values():
        flat = a.reshape(-1)
        i = rng.choice(flat.size, max(1, int(frac * flat.size)), replace=False)
        flat[i] += 1


@pytest.fixture
def pubs(memsem_runtime):
    rng = np.random.default_rng(7)
    full = _full(rng)
    out = [publish_sharded(memsem_runtime, _local(full, r), name="sd", rank=r, world_size=2,
                           placements={k: [Shard(0)] for k in SHAPES}, global_shapes=SHAPES) for r in range(2)]
    yield memsem_runtime, out, full, rng
    for p in out:
        p.close()


def _commit(pubs, full) -> int:
    """Commit the next version on every rank, and wait for each rank to have recorded it (its
    records are made after the commit, off the trainer's path: a commit before the last one was
    recorded makes that record weaker or absent, see memsem.sync._delta_writer)."""
    vs = {p.update(_local(full, r)) for r, p in enumerate(pubs)}
    assert len(vs) == 1
    v = vs.pop()
    for p in pubs:
        p.ref.runtime.wait_version(RefSpec.from_bytes(p.ref.layout.delta.index), v, WAIT)
    return v


def _readers(rt, **kw):
    """Every rank of TP 1, 2 and 4: fused qkv, a column slice of o, rows of w, whole norm."""
    sd = lookup_sharded(rt, "sd")
    return [sd.reader(tp_targets(sd.names, degree=d, rank=r, **TP), reader=r, delta_wait=WAIT, **kw)
            for d in (1, 2, 4) for r in range(d)]


def _bytes(into: dict) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in into.items()}


def _full_load(rt, reader, version: int) -> dict[str, bytes]:
    """The same targets loaded in full by a reader of its own."""
    other = lookup_sharded(rt, "sd").reader(reader.targets, delta=False)
    into = other.empty("numpy")
    assert other.load(into, version=version) == version
    return _bytes(into)


@pytest.mark.parametrize("frac", [0.001, 0.01, 0.1])
def test_spread_changes_apply_the_patches_bit_exact_for_tp_1_2_4(pubs, frac):
    rt, ps, full, rng = pubs
    readers = _readers(rt)
    assert any(t.dim == 1 for t in readers[1].targets.values())  # a column slice
    assert len(readers[1].targets["l.qkv"].sources) == 3  # a fused target
    intos = [r.empty("numpy") for r in readers]
    for r, into in zip(readers, intos):
        assert r.load(into) == 1
    for v in (2, 3):
        _spread(rng, full, frac)
        assert _commit(ps, full) == v
        for r, into in zip(readers, intos):
            w0, r0 = r.window_bytes, r.record_bytes
            assert r.load(into, version=v) == v
            assert _bytes(into) == _full_load(rt, r, v), (r.targets, frac)
            held = r.plan.target_bytes()
            # patches moved, and only tiles recorded whole (none at these fractions) were read
            assert r.record_bytes - r0 > 0 and r.window_bytes - w0 < held
            assert r.bytes_moved - w0 - r0 <= (0.6 if frac == 0.1 else 0.12) * held
    assert all(r.deltas == 2 for r in readers)


def test_one_percent_spread_moves_at_most_five_percent_of_the_bytes_held(pubs):
    rt, ps, full, rng = pubs
    sd = lookup_sharded(rt, "sd")
    held = moved = 0
    for rank in range(2):
        reader = sd.reader(tp_targets(sd.names, degree=2, rank=rank, **TP), reader=rank, delta_wait=WAIT)
        into = reader.empty("numpy")
        reader.load(into)
        _spread(rng, full, 0.01)
        v = _commit(ps, full)
        before = reader.bytes_moved
        assert reader.load(into, version=v) == v and _bytes(into) == _full_load(rt, reader, v)
        moved += reader.bytes_moved - before
        held += reader.plan.target_bytes()
    # 1% of 2-byte elements: an index and a value each (2% of a rank's bytes per record), the
    # patches of the tiles a reader holds part of, and the records' digests and counts. Whole
    # tiles (before patches) moved every byte held.
    assert moved <= 0.05 * held, moved / held


def test_skipped_versions_apply_the_union_of_their_records(pubs):
    rt, ps, full, rng = pubs
    reader = _readers(rt)[1]
    into = reader.empty("numpy")
    reader.load(into)
    for _ in range(3):
        _spread(rng, full, 0.01)
        v = _commit(ps, full)
    before = reader.record_bytes
    assert reader.load(into, version=v) == v and _bytes(into) == _full_load(rt, reader, v)
    assert reader.deltas == 1 and reader.record_bytes - before > 0
    # a version recorded whole on top: those tiles are read at v, the patches of the others kept
    full["l.norm"] += 1
    _spread(rng, full, 0.01)
    v1 = _commit(ps, full)
    _spread(rng, full, 0.01)
    v2 = _commit(ps, full)
    assert (v1, v2) == (v + 1, v + 2)
    assert reader.load(into, version=v2) == v2 and _bytes(into) == _full_load(rt, reader, v2)
    assert reader.deltas == 2


def test_one_source_in_two_targets_gets_its_patches_in_both(pubs):
    rt, ps, full, rng = pubs
    sd = lookup_sharded(rt, "sd")
    reader = sd.reader({"whole": Target("l.o"), "half": Target("l.o", dim=1, degree=2, rank=1),
                        "rows": Target("l.w", dim=0, degree=4, rank=3)}, delta_wait=WAIT)
    into = reader.empty("numpy")
    reader.load(into)
    for _ in range(2):
        _spread(rng, full, 0.01)
        v = _commit(ps, full)
        assert reader.load(into, version=v) == v and _bytes(into) == _full_load(rt, reader, v)
    assert reader.deltas == 2
    assert into["half"].tobytes() == np.ascontiguousarray(full["l.o"][:, 128:]).tobytes()
    assert into["rows"].tobytes() == full["l.w"][228:].tobytes()  # torch.chunk of 301 rows: 76, 76, 76, 73


def test_buffers_changed_between_versions_load_in_full(pubs):
    rt, ps, full, rng = pubs
    reader = _readers(rt)[2]
    into = reader.empty("numpy")
    reader.load(into)
    into["l.o"][7, 3] += 1  # changed by the user between versions: caught, a full load
    _spread(rng, full, 0.01)
    v = _commit(ps, full)
    before = reader.window_bytes
    assert reader.load(into, version=v) == v and _bytes(into) == _full_load(rt, reader, v)
    assert reader.deltas == 0 and reader.window_bytes - before == reader.plan.nbytes
    _spread(rng, full, 0.01)  # untouched since: a delta again
    v = _commit(ps, full)
    assert reader.load(into, version=v) == v and _bytes(into) == _full_load(rt, reader, v)
    assert reader.deltas == 1
    other = reader.empty("numpy")  # other tensors: a full load
    assert reader.load(other, version=v) == v and _bytes(other) == _bytes(into) and reader.deltas == 1


def test_a_history_that_no_longer_covers_the_base_loads_in_full(pubs):
    rt, ps, full, rng = pubs
    reader = _readers(rt)[1]
    into = reader.empty("numpy")
    reader.load(into)
    for _ in range(6):  # further behind than the history (4 versions)
        _spread(rng, full, 0.01)
        v = _commit(ps, full)
    before = reader.window_bytes
    assert reader.load(into, version=v) == v and _bytes(into) == _full_load(rt, reader, v)
    assert reader.deltas == 0 and reader.window_bytes - before == reader.plan.nbytes


def test_a_record_that_is_not_that_versions_loads_in_full(pubs, monkeypatch):
    rt, ps, full, rng = pubs
    reader = _readers(rt)[1]
    into = reader.empty("numpy")
    reader.load(into)
    _spread(rng, full, 0.01)
    v = _commit(ps, full)
    assert reader.load(into, version=v) == v and reader.deltas == 1
    _spread(rng, full, 0.01)
    v2 = _commit(ps, full)
    entry = _delta_format.Index.entry

    def swapped(self, version):  # the index names the record of the version before
        e = entry(self, version)
        older = entry(self, version - 1)
        return e if e is None or older is None else _delta_format.Entry(version, e.kind, older.record_bytes,
                                                                        older.payload, older.dense, older.ref)

    monkeypatch.setattr(_delta_format.Index, "entry", swapped)
    before = reader.window_bytes
    assert reader.load(into, version=v2) == v2 and _bytes(into) == _full_load(rt, reader, v2)
    assert reader.deltas == 1 and reader.window_bytes - before == reader.plan.nbytes


def test_targets_converted_on_read_read_the_changed_tiles(pubs):
    torch = pytest.importorskip("torch")
    rt, ps, full, rng = pubs
    sd = lookup_sharded(rt, "sd")
    targets = {"qkv": Target(("l.q", "l.k", "l.v"), dim=0, degree=2, rank=1, dtype="float8_e4m3fn", block=(32, 64)),
               "o": Target("l.o", dim=1, degree=2, rank=1)}
    reader = sd.reader(targets, delta_wait=WAIT)
    into = reader.empty()
    reader.load(into)
    _spread(rng, full, 0.01)
    v = _commit(ps, full)
    w0, r0 = reader.window_bytes, reader.record_bytes
    assert reader.load(into, version=v) == v and reader.deltas == 1
    other = sd.reader(targets, delta=False)
    want = other.empty()
    other.load(want, version=v)
    for k in into:
        assert into[k].view(torch.uint8).numpy().tobytes() == want[k].view(torch.uint8).numpy().tobytes(), k
    # qkv: every changed tile's bytes read whole into its staging buffer; o: patches only
    qkv = 2 * sum(512 * x // 2 for x in (256, 64, 64))
    assert reader.window_bytes - w0 == qkv and reader.record_bytes - r0 < 0.05 * reader.plan.nbytes


def test_the_follower_of_a_sharded_reader_moves_deltas_and_delta_false_does_not(pubs):
    rt, ps, full, rng = pubs
    for delta in (True, False):
        reader = _readers(rt, delta=delta)[1]
        seen = []
        with rt.follow(reader, into=reader.empty("numpy"), timeout=WAIT) as follower:
            for v, got in follower:
                assert _bytes(got) == _full_load(rt, reader, v)
                seen.append(v)
                if len(seen) == 3:
                    break
                _spread(rng, full, 0.01)
                _commit(ps, full)
        assert reader.deltas == (2 if delta else 0) and reader.loads == 3
        assert (reader.record_bytes > 0) == delta
    with pytest.raises(TypeError, match="delta"):
        lookup_sharded(rt, "sd").reader({"w": Target("l.w")}, delta=1)


def test_intersect_cuts_runs_to_the_changed_ranges():
    runs = [(0, 100, 1000), (200, 50, 5000), (400, 10, 9000)]
    changed = [(50, 200), (405, 100)]
    assert intersect(runs, changed) == [(50, 50, 1050), (200, 50, 5000), (405, 5, 9005)]
    assert intersect(runs, []) == [] and intersect([], changed) == []
    assert intersect([(0, 10, 0)], [(10, 5)]) == []


def _one_patch(indices: list[int]):
    """Heads of one record over a float16 tensor of 64 elements in tiles of 32 (64 bytes), at
    window offset 1000: tile 0 patched at ``indices`` (values 100, 101, ...), tile 1 unchanged."""
    from types import SimpleNamespace

    from memsem.sync._delta import Heads

    tiles = _delta_format.Tiles.of([SimpleNamespace(nbytes=128, dtype=np.dtype(np.float16))], 64)
    c = np.array([len(indices), 0], np.uint32)
    size = int(_delta_format.patch_sizes(c, tiles.itemsize).sum())
    rec = _delta_format.Record.new(2, 1, np.zeros(2, np.uint64), c, size, 0, 64)
    n = len(indices)
    rec.payload[:2 * n] = np.array(indices, np.uint16).view(np.uint8)
    v0 = (2 * n + 7) & ~7
    rec.payload[v0:v0 + 2 * n] = np.arange(100, 100 + n, dtype=np.uint16).view(np.uint8)
    return Heads(None, tiles, 1000 + tiles.start, [rec], [None], 0)


def test_patches_decode_inside_their_tiles_and_map_through_whole_elements():
    from memsem.sync._sharded_delta import _decode, _through

    heads = _one_patch([3, 31])
    eo, vals = _decode(heads, 0, np.array([0]), 2)
    assert eo.tolist() == [1006, 1062] and vals.tolist() == [100, 101]
    # two runs into targets 1 and 0: elements outside every run are not written
    rs, rn = np.array([1060, 1000]), np.array([4, 8])
    p = _through(eo, vals, rs, rn, np.array([0, 1]), np.array([10, 500]))
    assert [(x.target, x.offset.tolist(), x.values.tolist()) for x in p] == [(0, [12], [101]), (1, [506], [100])]
    assert _through(eo, vals, np.array([1000]), np.array([7]), np.array([0]), np.array([0])) is None  # cut
    assert _decode(_one_patch([3, 32]), 0, np.array([0]), 2) is None  # past its tile
    assert _decode(_one_patch([5, 5]), 0, np.array([0]), 2) is None  # twice
    assert _decode(_one_patch([7, 5]), 0, np.array([0]), 2) is not None  # out of order: sorted


@pytest.mark.multiproc
def test_a_reader_on_another_node_reads_the_patches_over_tcp(monkeypatch):
    """Trainer ranks on another node: the records and their patches come over memsem's tcp
    route, owner-checked; one element changed per rank moves no bytes of the windows."""
    with far_trainers(monkeypatch, "farpatch") as (rt, conns):
        sd = lookup_sharded(rt, "farpatch", timeout=30)
        assert rt.route(sd.refs[0]).engine == "tcp"
        reader = sd.reader({"w": Target("w", dim=1, degree=2, rank=1)}, delta_wait=WAIT)
        into = reader.empty("numpy")
        assert reader.load(into) == 1
        for c in conns:
            c.send("bump")
        assert [recv(c) for c in conns] == [2, 2]
        w0 = reader.window_bytes
        assert reader.load(into, version=2) == 2 and reader.deltas == 1
        want = values(1)
        want[[0, 5], 3] += 1  # the first row of each rank (5 and 4 rows)
        assert into["w"].tobytes() == want[:, 2:].tobytes()
        assert reader.window_bytes == w0 and reader.record_bytes > 0


def test_by_default_a_reader_loads_in_full_while_its_deltas_are_slower_and_tries_one_again(pubs, monkeypatch):
    """``delta_wait=None``: a delta load that took longer than the last full load makes the
    next loads full (no digests kept), and one in ``PROBE_EVERY`` tries a delta again; with a
    number for ``delta_wait`` every load that can be a delta is one. The loads' clock is one tick
    per reading, so a delta (its check and its body: two spans) is always slower than a full load
    (one span): the order is forced, not timed."""
    from memsem.sync import _sharded_read
    from memsem.sync._delta import PROBE_EVERY

    ticks = iter(range(1, 1 << 30))
    monkeypatch.setattr(_sharded_read, "_clock", lambda: float(next(ticks)))
    rt, ps, full, rng = pubs
    sd = lookup_sharded(rt, "sd")
    targets = tp_targets(sd.names, degree=2, rank=1, **TP)
    adaptive, eager = sd.reader(targets, reader=1), sd.reader(targets, reader=1, delta_wait=WAIT)
    intos = {id(r): r.empty("numpy") for r in (adaptive, eager)}
    for r in (adaptive, eager):
        assert r.load(intos[id(r)]) == 1
    _spread(rng, full, 0.01)
    v = _commit(ps, full)
    for r in (adaptive, eager):  # the first delta is tried by both, and is slower
        assert r.load(intos[id(r)], version=v) == v and r.deltas == 1
    for k in range(PROBE_EVERY - 1):  # full loads (the same version), no delta tried
        w0 = adaptive.window_bytes
        assert adaptive.load(intos[id(adaptive)], version=v) == v
        assert adaptive.deltas == 1 and adaptive.window_bytes - w0 == adaptive.plan.nbytes, k
    assert eager.load(intos[id(eager)], version=v) == v and eager.deltas == 2  # always a delta
    _spread(rng, full, 0.01)
    v = _commit(ps, full)
    w0 = adaptive.window_bytes
    assert adaptive.load(intos[id(adaptive)], version=v) == v  # the probe: a delta again
    assert adaptive.deltas == 2 and adaptive.window_bytes - w0 < adaptive.plan.nbytes
    assert _bytes(intos[id(adaptive)]) == _full_load(rt, adaptive, v)
