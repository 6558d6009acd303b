"""Edges of the weight-sync and rollout job (issue 22): tiles written in parts by several
producers, destinations of another dtype, zero-size windows on every path."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import memsem
from tests.conftest import run_children

torch = pytest.importorskip("torch")


# -- readiness counts what was written -----------------------------------------------------------
def test_two_producers_each_writing_half_of_a_tile_complete_it(rt):
    fs = rt.publish_fields({"lp": ((150, 4), "float32")}, tile_rows=64)  # tiles of 64, 64, 22 rows
    with memsem.Runtime(timeout=10) as a, memsem.Runtime(timeout=10) as b:
        fa = memsem.FieldSet.from_bytes(fs.to_bytes(), a)["lp"]
        fb = memsem.FieldSet.from_bytes(fs.to_bytes(), b)["lp"]
        first = fa.put_rows(0, np.full((32, 4), 1, np.float32))
        assert list(first) == [] and first.partial == {0: (32, 64)}  # completes nothing: says so
        assert not fs["lp"].rows_ready(0, 64)
        second = fb.put_rows(32, np.full((32, 4), 2, np.float32))
        assert list(second) == [0] and second.partial == {}
        fs["lp"].wait_rows(0, 64, timeout=10)
        # a write spanning a whole tile and parts of two others; the short last tile
        mid = fa.put_rows(40, np.full((100, 4), 3, np.float32))  # rows 40..140: tile 1 whole
        assert 1 in mid and mid.partial == {2: (12, 22)}
        last = fb.put_rows(140, np.full((10, 4), 4, np.float32))
        assert list(last) == [2]
        fs["lp"].wait_rows(0, 150, timeout=10)
        assert (fs["lp"].get_rows(0, 150)[[0, 32, 64, 140]] == [[1] * 4, [2] * 4, [3] * 4, [4] * 4]).all()


def test_rows_counted_twice_are_refused_and_mark_false_counts_nothing(rt):
    fs = rt.publish_fields({"x": ((128, 2), "int32")}, tile_rows=64)
    f = fs["x"]
    f.put_rows(64, np.ones((40, 2), np.int32))
    with pytest.raises(ValueError, match="written twice"):
        f.put_rows(90, np.ones((30, 2), np.int32))  # 40 + 30 > 64: rows 90..104 written again
    assert f.put_rows(104, np.ones((10, 2), np.int32), mark=False) == []
    assert not f.rows_ready(64, 128)
    f.mark_rows(64, 128)  # the owner marks what it wrote in place: ready whatever was counted
    assert f.rows_ready(64, 128)
    assert f.put_rows(100, np.ones((4, 2), np.int32)) == [1]  # a marked tile stays marked


def _half_writer(setbytes: bytes, start: int, value: float) -> list:
    with memsem.Runtime(timeout=30) as rt:
        f = memsem.FieldSet.from_bytes(setbytes, rt)["lp"]
        r = f.put_rows(start, np.full((32, 8), value, np.float32))
        return [list(r), {str(k): v for k, v in r.partial.items()}]


@pytest.mark.multiproc
def test_producers_in_two_processes_complete_a_tile(rt):
    fs = rt.publish_fields({"lp": ((64, 8), "float32")}, tile_rows=64)
    got = run_children(_half_writer, [(fs.to_bytes(), 0, 1.0), (fs.to_bytes(), 32, 2.0)])
    assert sorted(len(g[0]) for g in got) == [0, 1]  # exactly one of them completed the tile
    fs["lp"].wait_rows(0, 64, timeout=30)
    rows = fs["lp"].get_rows(0, 64)
    assert (rows[:32] == 1).all() and (rows[32:] == 2).all()


def test_concurrent_partial_writers_count_every_row(rt):
    """8 writers of 8 rows each into one tile at once (threads, two runtimes): one marks it."""
    fs = rt.publish_fields({"x": ((64, 1), "int64")}, tile_rows=64)
    with memsem.Runtime(timeout=10) as other:
        refs = [fs["x"], memsem.FieldSet.from_bytes(fs.to_bytes(), other)["x"]]
        barrier = threading.Barrier(8)
        out: list = []

        def write(i: int) -> None:
            barrier.wait(30)
            out.append(list(refs[i % 2].put_rows(8 * i, np.full((8, 1), i, np.int64))))

        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sum(len(o) for o in out) == 1 and fs["x"].rows_ready(0, 64)


# -- destinations of another dtype ---------------------------------------------------------------
def test_a_destination_of_another_dtype_is_an_error_unless_raw(rt):
    src = np.arange(16, dtype=np.float32)
    ref = rt.publish(src, name="f")
    with memsem.Runtime(timeout=10) as other:
        for who in (ref, other.lookup("f")):
            for bad in (np.empty(16, np.int32), torch.empty(16, dtype=torch.int32), np.empty(8, np.float64)):
                with pytest.raises(TypeError, match="dtype .* differs from the ref's float32"):
                    who.get(bad)
                with pytest.raises(TypeError, match="dtype"):
                    who.get_async(bad)
                with pytest.raises(TypeError, match="dtype"):
                    who.get(bad, with_version=True)
            with pytest.raises(TypeError, match="dtype"):
                other.xcopy([(who, np.empty(16, np.int32))])
            with pytest.raises(TypeError, match="dtype"):
                other.pipeline(who, out=np.empty(16, np.int32))
            raw = who.get(np.empty(64, np.uint8))  # uint8: raw bytes
            assert (raw.view(np.float32) == src).all()
            (r,) = other.xcopy([(who, np.empty(64, np.uint8))]).wait(10)
            assert r.state.name == "DONE"
            assert (who.bytes(0, 64).get(np.empty(16, np.int32)).view(np.float32) == src).all()  # a uint8 ref
        with pytest.raises(TypeError, match="dtype"):
            ref.put(np.zeros(16, np.int32)) if ref.spec.writable else other.lookup("f").put(np.zeros(16, np.int32))
        fs = rt.publish_fields({"x": ((8, 2), "float32")}, tile_rows=4)
        fs["x"].put_rows(0, np.ones((8, 2), np.float32))
        with pytest.raises(TypeError, match="dtype"):
            fs["x"].get_rows(0, 8, out=np.empty((8, 2), np.int32))
        # the core's own xcopy lane (no check of the local buffer): the range fails with the TypeError
        b = rt.transfers.xcopy([(ref.spec, np.empty(16, np.int32))])
        (r,) = b.wait(10)
        assert r.state.name == "FAILED" and isinstance(r.error, TypeError)


# -- zero-size windows ---------------------------------------------------------------------------
def _empties(rt):
    return {"torch.empty(0)": torch.empty(0), "np (0,)": np.empty(0, np.float32),
            "np (0, 4)": np.empty((0, 4), np.float32), "alloc(0)": rt.alloc(0, np.float32)}


@pytest.mark.parametrize("kind", ["torch.empty(0)", "np (0,)", "np (0, 4)", "alloc(0)"])
def test_zero_size_windows_work_on_every_path(rt, kind):
    obj = _empties(rt)[kind]
    shape = tuple(obj.shape)
    ref = rt.publish(obj, name="empty")
    with memsem.Runtime(timeout=10) as other:
        for who in (ref, other.lookup("empty")):  # loopback, and host (another runtime)
            assert who.get().shape == shape and who.get(framework="torch").shape == torch.Size(shape)
            v, got = who.get(np.empty(shape, np.float32), with_version=True)
            assert v == 1 and got.shape == shape
            who.put(np.empty(shape, np.float32))
            assert who.view().shape == shape
            assert who.get_async().wait(10).shape == shape
            (r,) = other.xcopy([(who, np.empty(shape, np.float32))]).wait(10)
            assert r.state.name == "DONE", r
            tiles = [t.array.size for t in other.pipeline(who)]
            assert sum(tiles) == 0
            with who.pin() as lease:
                assert lease.version == 1
        two = rt.publish(obj, name="empty2", slots=2)
        with rt.write_section(two, copy=False):
            pass
        assert other.lookup("empty2").get(with_version=True).version == 2
    sd = rt.publish_state_dict({"e": obj, "s": torch.ones(())}, name="sd")
    got = memsem.StateDictRef.from_bytes(sd.to_bytes(), rt).get()
    assert tuple(got["e"].shape) == shape and float(got["s"]) == 1.0
    assert [b.version for b in sd.stream()] == [1]
    rt.unpublish("empty")
