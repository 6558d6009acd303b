"""The sharded reader loads deltas (issues 35, 36): a reader whose tensors hold version v of its
slices moves only the parts of its plan's ranges in tiles that changed (each rank's delta
history), checked by its own digests of what it holds: tensors changed by the user, a history
that no longer covers the versions, or other tensors mean a full load. Every load is compared bit
for bit with the trainer's full tensors sliced the same way.
"""
from __future__ import annotations

import numpy as np
import pytest

from memsem.sync import Shard, Target, local_box, lookup_sharded, publish_sharded
from memsem.sync._sharded_delta import intersect

WAIT = 30.0
SHAPES = {"w": (1024, 512), "b": (8192,)}  # float32: 2 MiB and 32 KiB over 2 ranks


def _full(rng) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _local(full: dict, rank: int) -> dict[str, np.ndarray]:
    out = {}
    for k, s in SHAPES.items():
        off, size = local_box(s, (2,), (rank,), [Shard(0)])
        out[k] = np.ascontiguousarray(full[k][off[0]:off[0] + size[0]])
    return out


def _rows(rng, full: dict, frac: float) -> None:
    """Change ``frac`` of ``w``'s rows (what a frozen base with a few trained rows does)."""
    rows = rng.choice(SHAPES["w"][0], max(1, int(frac * SHAPES["w"][0])), replace=False)
    full["w"][rows] += 1


def _want(full: dict) -> dict[str, bytes]:
    return {"w": np.ascontiguousarray(full["w"][:, :256]).tobytes(), "b": full["b"][4096:].tobytes()}


def _got(into: dict) -> dict[str, bytes]:
    return {k: np.asarray(into[k]).tobytes() for k in ("w", "b")}


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
    vs = {p.update(_local(full, r)) for r, p in enumerate(pubs)}
    assert len(vs) == 1
    return vs.pop()


def _reader(rt, **kw):
    sd = lookup_sharded(rt, "sd")
    # a column slice of w (read row by row) and the second half of b: a tensor-parallel rank
    return sd.reader({"w": Target("w", dim=1, degree=2, rank=0), "b": Target("b", dim=0, degree=2, rank=1)},
                     delta_wait=WAIT, **kw)


def test_one_percent_of_rows_moves_their_tiles_bit_exact(pubs):
    rt, ps, full, rng = pubs
    reader = _reader(rt)
    into = reader.empty("numpy")
    assert reader.load(into) == 1 and _got(into) == _want(full)
    for v in range(2, 5):
        _rows(rng, full, 0.01)
        assert _commit(ps, full) == v
        before = reader.bytes_moved
        assert reader.load(into, version=v) == v and _got(into) == _want(full)
        # 10 rows of 2 KiB: at most 10 tiles of 64 KiB (32 rows each), the reader's half of each
        assert reader.bytes_moved - before <= 10 * 32 * 1024, reader.bytes_moved - before
    assert reader.deltas == 3 and reader.loads == 4
    # the trainer's b changes everywhere: the whole of the reader's half moves, as a delta
    full["b"] += 1
    assert _commit(ps, full) == 5
    before = reader.bytes_moved
    assert reader.load(into, version=5) == 5 and _got(into) == _want(full)
    assert reader.deltas == 4 and reader.bytes_moved - before == 4096 * 4


def test_skipped_versions_changed_tensors_and_other_tensors_fail_closed(pubs):
    rt, ps, full, rng = pubs
    reader = _reader(rt)
    into = reader.empty("numpy")
    reader.load(into)
    for _ in range(2):  # a reader that skipped a version: the union of what changed
        _rows(rng, full, 0.01)
        v = _commit(ps, full)
    assert reader.load(into, version=v) == v and _got(into) == _want(full) and reader.deltas == 1
    into["w"][500, 3] += 1  # changed by the user between versions: caught, a full load
    _rows(rng, full, 0.01)
    v = _commit(ps, full)
    before = reader.bytes_moved
    assert reader.load(into, version=v) == v and _got(into) == _want(full)
    assert reader.deltas == 1 and reader.bytes_moved - before == reader.plan.nbytes
    other = reader.empty("numpy")  # other tensors: a full load
    _rows(rng, full, 0.01)
    v = _commit(ps, full)
    assert reader.load(other, version=v) == v and _got(other) == _want(full) and reader.deltas == 1
    # a commit that fails midway on one rank commits nothing; the next one is a delta
    with pytest.raises(RuntimeError):
        with ps[0].write_section() as sec:
            sec.tensors["w"][:] = -1
            raise RuntimeError("killed mid-commit")
    _rows(rng, full, 0.01)
    v = _commit(ps, full)
    assert reader.load(other, version=v) == v and _got(other) == _want(full) and reader.deltas == 2
    for _ in range(6):  # further behind than the history (4): a full load
        _rows(rng, full, 0.01)
        v = _commit(ps, full)
    before = reader.bytes_moved
    assert reader.load(other, version=v) == v and _got(other) == _want(full)
    assert reader.deltas == 2 and reader.bytes_moved - before == reader.plan.nbytes


def test_the_follower_of_a_sharded_reader_moves_deltas_and_delta_false_does_not(pubs):
    rt, ps, full, rng = pubs
    for delta in (True, False):
        reader = _reader(rt, delta=delta)
        seen = []
        with rt.follow(reader, into=reader.empty("numpy"), timeout=WAIT) as follower:
            for v, got in follower:
                assert _got(got) == _want(full)
                seen.append(v)
                if len(seen) == 3:
                    break
                _rows(rng, full, 0.01)
                _commit(ps, full)
        assert reader.deltas == (2 if delta else 0) and reader.loads == 3
    with pytest.raises(TypeError, match="delta"):
        _reader(rt, delta=1)


def test_intersect_cuts_runs_to_the_changed_ranges():
    runs = [(0, 100, 1000), (200, 50, 5000), (400, 10, 9000)]
    changed = [(50, 200), (405, 100)]
    assert intersect(runs, changed) == [(50, 50, 1050), (200, 50, 5000), (405, 5, 9005)]
    assert intersect(runs, []) == [] and intersect([], changed) == []
    assert intersect([(0, 10, 0)], [(10, 5)]) == []
