"""FieldRef / FieldSet: named fields with their own dtypes, shapes and per-tile readiness."""
from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest

import memsem
from memsem import FieldRef, FieldSchema, FieldSet, MemsemTimeoutError, TensorRef

from tests._proc import recv, reap, spawn, until




SCHEMA = {
    "prompts": ((20, 6), np.int32),
    "logprobs": ((20, 5), np.float32),
    "values": {"shape": (20,), "dtype": np.float64},
    "rewards": ((20,), np.float16),
}


def rows_of(name, r0, r1):
    shape, dtype = {"prompts": ((6,), np.int32), "logprobs": ((5,), np.float32),
                    "values": ((), np.float64), "rewards": ((), np.float16)}[name]
    base = np.arange(r0, r1, dtype=np.float64).reshape((-1,) + (1,) * len(shape))
    return (base * 10 + np.ones(shape)).astype(dtype)


def test_publish_schema_and_mapping():
    with memsem.Runtime() as rt:
        fs = rt.publish_fields(SCHEMA, tile_rows={"prompts": 4, "logprobs": 8, "values": 20, "rewards": 3},
                               name="batch")
        assert isinstance(fs, FieldSet) and set(fs) == set(SCHEMA) and len(fs) == 4
        sc = fs.schema
        assert sc["prompts"] == FieldSchema("prompts", fs["prompts"].spec.dtype_code, (20, 6), 4)
        assert sc["prompts"].n_tiles == 5 and sc["prompts"].tile_bytes == 4 * 24
        assert sc["logprobs"].n_tiles == 3 and sc["logprobs"].rows_of_tile(2) == (16, 20)
        assert sc["values"].n_tiles == 1 and sc["rewards"].n_tiles == 7
        r = fs["logprobs"]
        assert isinstance(r, FieldRef) and isinstance(r, TensorRef)
        assert r.name == "logprobs" and r.window_name == "batch/logprobs"
        assert r.dtype == np.float32 and r.shape == (20, 5) and r.tile_bytes == 8 * 20
        assert r.route().zero_copy  # allocated in a shared segment
        with pytest.raises(KeyError, match="nope"):
            fs["nope"]


def test_publish_existing_arrays_default_one_tile():
    with memsem.Runtime() as rt:
        a = np.arange(12, dtype=np.int64).reshape(6, 2)
        fs = rt.publish_fields({"x": a})
        assert fs["x"].n_tiles == 1 and fs["x"].tile_rows == 6
        assert fs.local("x") is a
        fs["x"].mark_rows(0, 6)
        np.testing.assert_array_equal(fs["x"].get_rows(2, 4, timeout=1), a[2:4])


def test_publish_argument_checks():
    with memsem.Runtime() as rt:
        with pytest.raises(ValueError, match="non-empty"):
            rt.publish_fields({})
        with pytest.raises(ValueError, match="'/'"):
            rt.publish_fields({"a/b": ((4,), np.float32)})
        with pytest.raises(ValueError, match="dimension"):
            rt.publish_fields({"s": np.zeros((), np.float32)})
        with pytest.raises(ValueError, match="tile_rows"):
            rt.publish_fields({"a": ((4,), np.float32)}, tile_rows=-1)


def test_put_rows_marks_only_complete_tiles():
    with memsem.Runtime() as rt:
        fs = rt.publish_fields(SCHEMA, tile_rows=4)
        p = fs["prompts"]
        first = p.put_rows(0, rows_of("prompts", 0, 6))
        assert first == [0] and first.partial == {1: (2, 4)}  # tile 1 (rows 4..8): 2 of 4 rows counted
        assert p.ready_tiles() == [0]
        second = p.put_rows(6, rows_of("prompts", 6, 8))  # the write whose rows complete tile 1 marks it
        assert second == [1] and not second.partial
        assert p.ready_tiles() == [0, 1]
        assert p.mark_rows(4, 8) == [1]  # marking a ready tile again is harmless
        assert p.rows_ready(0, 8) and not p.rows_ready(0, 9)
        np.testing.assert_array_equal(p.get_rows(0, 8, timeout=1), rows_of("prompts", 0, 8))
        with pytest.raises(ValueError, match="shape"):
            p.put_rows(0, np.zeros((2, 5), np.int32))
        with pytest.raises(TypeError, match="dtype"):
            p.put_rows(0, np.zeros((2, 6), np.int64))
        with pytest.raises(ValueError, match="outside"):
            p.put_rows(18, rows_of("prompts", 0, 4))


def test_wait_rows_times_out_naming_the_tile():
    with memsem.Runtime() as rt:
        fs = rt.publish_fields(SCHEMA, tile_rows=4, name="tw")
        fs["logprobs"].put_rows(0, rows_of("logprobs", 0, 4))
        fs["logprobs"].wait_rows(0, 4, timeout=0.01)
        with pytest.raises(MemsemTimeoutError, match="tile 1") as ei:
            fs.wait("logprobs", rows=(2, 6), timeout=0.1)
        assert "tw/logprobs" in str(ei.value)
        with pytest.raises(MemsemTimeoutError):
            fs.wait(timeout=0.05)


def test_serialization_roundtrip():
    with memsem.Runtime() as rt:
        fs = rt.publish_fields(SCHEMA, tile_rows=4, name="ser")
        for name in fs:
            fs[name].put_rows(0, rows_of(name, 0, 20))
        data = fs.to_bytes()
        assert len(data) < 600
        back = FieldSet.from_bytes(data, rt)
        assert back == fs and back.name == "ser" and back.schema == fs.schema
        pick = pickle.loads(pickle.dumps(fs))
        assert pick == fs
        fr = FieldRef.from_bytes(fs["values"].to_bytes(), rt)
        assert fr == fs["values"] and fr.name == "values" and fr.tile_rows == 4
        assert pickle.loads(pickle.dumps(fs["values"])) == fs["values"]
        np.testing.assert_array_equal(fr.get(), rows_of("values", 0, 20))
        plain = TensorRef.from_bytes(fs["values"].spec.to_bytes(), rt)
        np.testing.assert_array_equal(plain.get(), rows_of("values", 0, 20))
        with pytest.raises(ValueError, match="FieldSet"):
            FieldSet.from_bytes(b"nope")
        with pytest.raises(ValueError, match="FieldRef"):
            FieldRef.from_bytes(fs["values"].spec.to_bytes())


def test_tile_events_in_readiness_order_and_as_ready():
    with memsem.Runtime() as rt:
        fs = rt.publish_fields({"a": ((8,), np.float32), "b": ((8,), np.int32)}, tile_rows=4)
        fs["b"].put_rows(4, np.arange(4, 8, dtype=np.int32))   # b tile 1 first

        events: list = []

        def produce():  # each tile once the consumer reported the one before: the order is forced
            for k, (name, start, dtype) in enumerate([("a", 0, np.float32), ("b", 0, np.int32),
                                                      ("a", 4, np.float32)], start=1):
                until(lambda: len(events) >= k, what=f"event {k}")
                fs[name].put_rows(start, np.zeros(4, dtype))

        th = threading.Thread(target=produce, daemon=True)
        th.start()
        for r, t in fs.tile_events(timeout=10):
            events.append((r.name, t))
        th.join(5)
        assert events == [("b", 1), ("a", 0), ("b", 0), ("a", 1)]
        assert [r.name for r in fs.as_ready(timeout=1)] == ["a", "b"]  # all done: scan order
        fs2 = rt.publish_fields({"c": ((4,), np.float32)}, tile_rows=2)
        with pytest.raises(MemsemTimeoutError, match="c tiles"):
            list(fs2.tile_events(timeout=0.1))


def test_field_pipeline_gives_typed_rows():
    with memsem.Runtime() as rt:
        fs = rt.publish_fields(SCHEMA, tile_rows=4)
        lp = fs["logprobs"]
        lp.put_rows(0, rows_of("logprobs", 0, 20))
        for zc in (None, False):
            with lp.pipeline(tiles_per_step=2, zero_copy=zc, timeout=5) as p:
                got = []
                for tile in p:
                    with tile:
                        assert tile.array.shape[1:] == (5,) and tile.array.dtype == np.float32
                        got.append((tile.rows, tile.array.copy()))
            assert [g[0] for g in got] == [(0, 8), (8, 16), (16, 20)]
            np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), rows_of("logprobs", 0, 20))


# -- multi process: producers at different speeds --------------------------------------------------
def _field_producer(conn, data, fields, delay, gated=False):
    with memsem.Runtime() as rt:
        fs = FieldSet.from_bytes(data, rt)
        if gated:
            assert conn.recv() == "go"  # the test orders the producers; no timing is hoped for
        for name in fields:
            ref = fs[name]
            for t in range(ref.n_tiles):
                r0, r1 = ref.schema.rows_of_tile(t)
                time.sleep(delay)
                ref.put_rows(r0, rows_of(name, r0, r1))
        conn.send(("done", fields))


def _field_consumer(conn, data):
    with memsem.Runtime() as rt:
        fs = FieldSet.from_bytes(data, rt)
        conn.send("waiting")
        order = []
        for r in fs.as_ready(timeout=120):
            order.append(r.name)
            if len(order) == 2:
                conn.send(("half", list(order)))  # the test starts the second producer after this
        out = {name: fs[name].get() for name in fs}
        conn.send(("got", order, {k: v.tolist() for k, v in out.items()}))


@pytest.mark.multiproc
@pytest.mark.parametrize("n_consumers", [1, 2, 4])
def test_two_producers_different_speeds(n_consumers):
    """The owner publishes the schema; two producer processes fill different fields one-sidedly,
    the second only after the first finished (the test forces that order); consumer processes,
    waiting on every field from the start, see fields complete in readiness order with exact
    data."""
    with memsem.Runtime() as rt:
        fs = rt.publish_fields(SCHEMA, tile_rows=5, name="mp")
        data = fs.to_bytes()
        cons = [spawn(_field_consumer, data) for _ in range(n_consumers)]
        for _, cc in cons:
            assert recv(cc) == "waiting"
        fast, fc = spawn(_field_producer, data, ["prompts", "rewards"], 0.0)
        slow, sc = spawn(_field_producer, data, ["logprobs", "values"], 0.001, True)
        procs = [fast, slow] + [c for c, _ in cons]
        try:
            assert recv(fc)[0] == "done"
            for _, cc in cons:  # every consumer saw the first two fields complete
                kind, half = recv(cc)
                assert kind == "half" and set(half) == {"prompts", "rewards"}
            sc.send("go")
            assert recv(sc)[0] == "done"
            for _, cc in cons:
                kind, order, got = recv(cc)
                assert set(order[:2]) == {"prompts", "rewards"} and set(order[2:]) == {"logprobs", "values"}
                for name in SCHEMA:
                    np.testing.assert_array_equal(np.asarray(got[name], dtype=fs[name].dtype), rows_of(name, 0, 20))
            for name in SCHEMA:
                np.testing.assert_array_equal(fs.local(name), rows_of(name, 0, 20))
        finally:
            reap(procs)
        fs.unpublish(timeout=5)
