"""memsem as a Ray tensor transport (``@ray.method(tensor_transport="memsem")``), on the Ray
cluster of three nodes the suite starts once (conftest.py: a head with this driver, workers w1
and w2, each a memsem node of its own), plus cheap tests of the transport's manager alone.

Across nodes: the returning actor on w1, receivers on w2 (and the driver on the head), bytes
bit-exact and counted by route (tcp); on w1 the same object is read by cross-memory attach. The
windows go when Ray frees the object (after every receiver). A dead returning actor is a Ray
error for its receiver well before Ray's own fetch timeout (60 s): memsem's liveness bound,
never a hang. A device the transport does not support is refused with Ray's error; methods
without the transport work as before.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import memsem  # noqa: E402
import memsem.integrations.ray_transport as mrt  # noqa: E402
from cluster import node_id, placed  # noqa: E402

mrt.register()  # before the classes below: @ray.method checks the transport's name

LONG = 120.0
#: receivers of a dead actor must fail before Ray's own fetch timeout (60 s) would end the wait
BEFORE_RAY_TIMEOUT = 45.0
BIG = (mrt.CHUNK_BYTES + (3 << 20)) // 4  # float32 elements: over one chunk (the chunked read)


@pytest.fixture(scope="module", autouse=True)
def _transport_runtime_closed():
    """The driver's transport runtime (made by its ray.get) closed before the run's cluster is."""
    yield
    mrt.close()


#: the directory calls of a window's life: a receiver of the transport makes none of them
WINDOW_CALLS = ("get_window", "window_with_key", "put_window", "remove_window", "lease_holders")


def _counting():
    """``(count, calls)`` for ``actor.__ray_call__``: count the actor's transport runtime's
    directory calls of ``WINDOW_CALLS`` from now; the counts. (Nested: Ray's workers cannot
    import this module, so what an actor runs is pickled by value.)"""

    def count(self) -> None:
        d = mrt.runtime().directory
        calls = d.counted_calls = {}
        for name in WINDOW_CALLS:
            def counted(*a, _f=getattr(d, name), _n=name, **k):
                calls[_n] = calls.get(_n, 0) + 1
                return _f(*a, **k)

            setattr(d, name, counted)

    def counts(self) -> dict:
        return dict(mrt.runtime().directory.counted_calls)

    return count, counts


def _until(pred, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")


@ray.remote(num_cpus=0)
class Source:
    """A returning actor: its tensors stay its own (returned in place)."""

    def __init__(self) -> None:
        self.w = torch.arange(BIG, dtype=torch.float32)

    @ray.method(tensor_transport="memsem")
    def weights(self):
        return self.w

    @ray.method(tensor_transport="memsem")
    def batch(self, n: int):
        a = torch.arange(n, dtype=torch.int64).reshape(-1, 4)
        return {"t": a.t(), "small": torch.full((3,), 7, dtype=torch.bfloat16), "tag": "b", "empty": torch.empty(0)}

    @ray.method(tensor_transport="memsem_numpy")
    def array(self, n: int):
        return [np.arange(n, dtype=np.float64), np.ones((2, 3), dtype=np.int8)[:, ::2]]

    @ray.method(tensor_transport="memsem")
    def meta_device(self):
        return torch.empty(4, device="meta")

    def plain(self, n: int):
        return torch.arange(n)

    def live_metadata(self) -> list:
        """The metadata of this actor's live objects of the transport (what Ray carries)."""
        return [meta for meta, _ in mrt.manager()._objects.values()]


    def stats(self, name: str = "memsem") -> dict:
        return mrt.transport_stats(name)

    def node(self) -> str:
        return os.environ["MEMSEM_NODE_ID"]

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0, enable_tensor_transport=True)  # Ray's receive runs on its own thread
class Receiver:
    def digest(self, obj) -> dict:
        if isinstance(obj, dict):
            return {k: (v.tolist() if isinstance(v, torch.Tensor) and v.numel() < 100 else v) for k, v in obj.items()}
        if isinstance(obj, list):
            return {"sums": [float(a.sum()) for a in obj], "shapes": [a.shape for a in obj], "last": obj[1].tolist()}
        return {"n": obj.numel(), "exact": bool(torch.equal(obj, torch.arange(obj.numel(), dtype=obj.dtype))),
                "writable": True}

    def plain_sum(self, t) -> int:
        return int(t.sum())

    def read_meta(self, meta) -> list:
        """Read an object by its metadata, as Ray's receive does."""
        return [t.tolist() for t in mrt.manager().recv_multiple_tensors("probe", meta, None)]


    def stats(self, name: str = "memsem") -> dict:
        return mrt.transport_stats(name)


def test_cross_node_read_by_each_receiver_bytes_by_route_and_freed_windows(cluster):
    """w1 returns 35 MiB (read in two chunks); two receivers on w2 and the driver read it over
    tcp, one on w1 by cross-memory attach; each counts its bytes by route; the window is
    published once and unpublished once Ray frees the object."""
    src = Source.options(**placed("w1")).remote()
    far = [Receiver.options(**placed("w2")).remote() for _ in range(2)]
    near = Receiver.options(**placed("w1")).remote()
    try:
        assert ray.get(src.node.remote(), timeout=LONG) == node_id("w1")
        ref = src.weights.remote()
        got = ray.get([r.digest.remote(ref) for r in far + [near]], timeout=LONG)
        assert got == [{"n": BIG, "exact": True, "writable": True}] * 3
        mine = ray.get(ref, timeout=LONG)  # the driver, on the head: a third node
        assert torch.equal(mine, torch.arange(BIG, dtype=torch.float32))
        nbytes = BIG * 4
        for r in far:
            st = ray.get(r.stats.remote(), timeout=LONG)
            assert st["bytes_by_route"] == {"tcp": nbytes} and st["received_bytes"] == nbytes
        st = ray.get(near.stats.remote(), timeout=LONG)
        assert st["bytes_by_route"] == {"host/cma": nbytes}
        assert mrt.transport_stats()["bytes_by_route"]["tcp"] >= nbytes
        s = ray.get(src.stats.remote(), timeout=LONG)
        assert s["published"] == 1 and s["live_windows"] == 1 and s["objects"] == 1
        # a second object of the same memory while the first lives: its window, counted
        ref2 = src.weights.remote()
        assert ray.get(far[0].digest.remote(ref2), timeout=LONG)["exact"]
        s = ray.get(src.stats.remote(), timeout=LONG)
        assert s["published"] == 1 and s["reused"] == 1 and s["live_windows"] == 1
        del ref, mine
        s = ray.get(src.stats.remote(), timeout=LONG)
        assert s["live_windows"] == 1  # the second object still names it
        del ref2
        _until(lambda: ray.get(src.stats.remote(), timeout=LONG)["live_windows"] == 0, "the window unpublished")
        s = ray.get(src.stats.remote(), timeout=LONG)
        assert s["unpublished"] == 1 and s["freed"] == 2
    finally:
        for a in [src, near, *far]:
            ray.kill(a)


def test_structures_numpy_target_buffers_and_plain_methods(cluster):
    """Tensors inside a dict (a non-contiguous one, bf16, an empty one, a plain value beside
    them); numpy arrays through "memsem_numpy" (a strided one); the driver's ray.get into its
    own buffer (set_target_for_ref); a method without the transport, as before."""
    from ray.experimental import set_target_for_ref

    src = Source.options(**placed("w1")).remote()
    dst = Receiver.options(**placed("w2")).remote()
    try:
        ref = src.batch.remote(16)
        want = torch.arange(16, dtype=torch.int64).reshape(-1, 4).t()
        got = ray.get(dst.digest.remote(ref), timeout=LONG)
        assert got == {"t": want.tolist(), "small": [7.0] * 3, "tag": "b", "empty": []}
        mine = ray.get(ref, timeout=LONG)
        assert torch.equal(mine["t"], want) and mine["small"].dtype == torch.bfloat16

        arrays = src.array.remote(1000)
        got = ray.get(dst.digest.remote(arrays), timeout=LONG)
        assert got == {"sums": [499500.0, 4.0], "shapes": [(1000,), (2, 2)], "last": [[1, 1], [1, 1]]}
        st = ray.get(dst.stats.remote("memsem_numpy"), timeout=LONG)
        assert st["received_tensors"] == 2 and st["bytes_by_route"]["tcp"] >= 8000 + 4

        big = src.weights.remote()
        target = torch.zeros(BIG, dtype=torch.float32)
        set_target_for_ref(big, [target])
        out = ray.get(big, timeout=LONG)
        assert out.data_ptr() == target.data_ptr() and torch.equal(target, torch.arange(BIG, dtype=torch.float32))

        assert ray.get(dst.plain_sum.remote(src.plain.remote(10)), timeout=LONG) == 45
        del ref, arrays, big, out
        for name in ("memsem", "memsem_numpy"):
            _until(lambda: ray.get(src.stats.remote(name), timeout=LONG)["live_windows"] == 0, f"{name} windows gone")
    finally:
        ray.kill(src)
        ray.kill(dst)


def test_windows_resolve_from_the_metadata_and_a_freed_objects_window_is_gone(cluster):
    """The windows are unlisted: their records travel in the object's metadata, so the
    returning actor (publish, unpublish) and its receivers on w1 (cross-memory attach) and on
    w2 (tcp) make no directory call for them. Once Ray freed the object, its metadata reads
    nothing on either node: its windows are gone (StaleReferenceError)."""
    src = Source.options(**placed("w1")).remote()
    near = Receiver.options(**placed("w1")).remote()
    far = Receiver.options(**placed("w2")).remote()
    try:
        count, counts = _counting()
        ray.get([a.__ray_call__.remote(count) for a in (src, near, far)], timeout=LONG)
        ref = src.batch.remote(16)
        want = {"t": torch.arange(16, dtype=torch.int64).reshape(-1, 4).t().tolist(), "small": [7.0] * 3,
                "tag": "b", "empty": []}
        assert ray.get([r.digest.remote(ref) for r in (near, far)], timeout=LONG) == [want] * 2
        (meta,) = ray.get(src.live_metadata.remote(), timeout=LONG)
        assert len(meta.records) == 3 and meta.records[2] is None  # the empty tensor: no window
        got = ray.get([r.read_meta.remote(meta) for r in (near, far)], timeout=LONG)
        assert got == [[want["t"], want["small"], []]] * 2
        calls = ray.get([a.__ray_call__.remote(counts) for a in (src, near, far)], timeout=LONG)
        assert calls == [{}, {}, {}], calls
        assert ray.get(far.stats.remote(), timeout=LONG)["bytes_by_route"] == {"tcp": 2 * (128 + 6)}
        del ref
        _until(lambda: ray.get(src.stats.remote(), timeout=LONG)["live_windows"] == 0, "the windows unpublished")
        assert ray.get(src.__ray_call__.remote(counts), timeout=LONG) == {}  # the unpublish made none either
        for r in (near, far):
            with pytest.raises(ray.exceptions.RayTaskError) as err:
                ray.get(r.read_meta.remote(meta), timeout=LONG)
            assert isinstance(err.value, memsem.StaleReferenceError), err.value
    finally:
        for a in (src, near, far):
            ray.kill(a)


def test_unsupported_device_is_refused_with_rays_error(cluster):
    src = Source.options(**placed("w1")).remote()
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="does not support tensor transfer on device meta"):
            ray.get(src.meta_device.remote(), timeout=LONG)
        s = ray.get(src.stats.remote(), timeout=LONG)
        assert s["refused"] == 1 and s["published"] == 0
    finally:
        ray.kill(src)


def test_a_dead_returning_actor_is_a_ray_error_for_its_receiver(cluster):
    """The object's owner (this driver) lives, its returning actor is killed: the receiver's
    task fails with memsem's error for the dead peer inside Ray's, before Ray's own timeout."""
    src = Source.options(**placed("w1")).remote()
    dst = Receiver.options(**placed("w2")).remote()
    try:
        ref = src.batch.remote(8)
        ray.get(dst.digest.remote(ref), timeout=LONG)  # created and read once
        pid = ray.get(src.pid.remote(), timeout=LONG)
        ray.kill(src)
        _until(lambda: not os.path.exists(f"/proc/{pid}"), "the actor's process gone")  # one machine
        with pytest.raises(ray.exceptions.RayError) as err:
            ray.get(dst.digest.remote(ref), timeout=BEFORE_RAY_TIMEOUT)
        # RayTaskError(PeerLostError): "the owner of window ... (node 'ray-w1', pid ...) is unreachable"
        assert isinstance(err.value, memsem.PeerLostError) and "ray-w1" in str(err.value), err.value
    finally:
        ray.kill(dst)


# -- the manager alone (no Ray task: one process, a runtime of its own) ----------------------------
@pytest.fixture
def manager():
    with memsem.Runtime(directory="local", job=f"rt-{time.monotonic_ns()}") as rt:
        yield mrt.MemsemTensorTransport(runtime=rt), rt


def test_manager_publishes_in_place_and_frees_on_gc(manager):
    m, rt = manager
    t = torch.arange(100, dtype=torch.float32)
    strided = t[::2].clone()
    meta = m.extract_tensor_transport_metadata("o1", [t, t[::2]])  # the second: from a contiguous copy
    assert meta.tensor_device == "cpu" and [tuple(s) for s, _ in meta.tensor_meta] == [(100,), (50,)]
    assert m.extract_tensor_transport_metadata("o1", [t, t[::2]]) is meta  # a retried task: the same
    ref = rt.ref(meta.refs[0])
    t[0] = 42  # in place: the window is the tensor's memory
    assert ref.get()[0] == 42
    got = m.recv_multiple_tensors("o1", meta, mrt.MemsemCommunicatorMetadata())
    assert torch.equal(got[0], t) and torch.equal(got[1], strided)
    assert m.stats()["live_windows"] == 2
    m.garbage_collect("o1", meta, [t])
    assert m.stats()["live_windows"] == 0 and m.stats()["unpublished"] == 2
    with pytest.raises(memsem.StaleReferenceError):
        ref.get()
    with pytest.raises(memsem.StaleReferenceError):
        m.recv_multiple_tensors("o1", meta, mrt.MemsemCommunicatorMetadata())
    with pytest.raises(NotImplementedError, match="one-sided"):
        m.send_multiple_tensors([t], meta, mrt.MemsemCommunicatorMetadata())
    with pytest.raises(TypeError, match="torch tensors"):
        m.extract_tensor_transport_metadata("o2", [np.zeros(3)])
    # 4 MiB and more: received into memory advised for huge pages, every dtype viewed over it
    big = [torch.arange(1 << 20, dtype=torch.float32), torch.full((3, 2), 1.5, dtype=torch.bfloat16), torch.empty(0)]
    meta4 = m.extract_tensor_transport_metadata("o4", big)
    got = m.recv_multiple_tensors("o4", meta4, None)
    assert [(g.dtype, tuple(g.shape)) for g in got] == [(b.dtype, tuple(b.shape)) for b in big]
    assert all(torch.equal(g, b) for g, b in zip(got, big))
    got[1][0, 0] = 3  # the receiver's own, writable memory
    assert float(big[1][0, 0]) == 1.5
    m.garbage_collect("o4", meta4, big)
    refused = m.extract_tensor_transport_metadata("o3", [torch.empty(2, device="meta")])
    assert refused.tensor_device == "meta" and refused.refs == [] and m.stats()["published"] == 4


def test_a_window_being_unpublished_is_still_live_until_its_unpublish_is_counted(manager, monkeypatch):
    """A freed object's window leaves ``live_windows`` only once its unpublish ended and was
    counted (CI: a stats read between the two saw no live window and nothing unpublished). The
    unpublish is held in the test while stats are read."""
    m, rt = manager
    entered, go = threading.Event(), threading.Event()
    unpublish = rt.unpublish_spec

    def held(spec, **kw):
        entered.set()
        assert go.wait(60)
        return unpublish(spec, **kw)

    monkeypatch.setattr(rt, "unpublish_spec", held)
    t = torch.arange(64, dtype=torch.float32)
    meta = m.extract_tensor_transport_metadata("held", [t])
    gc = threading.Thread(target=m.garbage_collect, args=("held", meta, [t]))
    gc.start()
    try:
        assert entered.wait(60)
        st = m.stats()
        assert st["live_windows"] == 1 and m.live_windows() == 1
        assert st["unpublished"] == 0 and st["freed"] == 1
    finally:
        go.set()
        gc.join(60)
    st = m.stats()
    assert not gc.is_alive() and st["live_windows"] == 0 and st["unpublished"] == 1


def test_abort_stops_a_read_in_flight(manager, monkeypatch):
    """The owner holds a write section open, so the first chunk waits; an abort meanwhile ends
    the read before its next chunk (nothing after the chunk in flight is written), and a fetch's timeout aborts too."""
    m, rt = manager
    monkeypatch.setattr(mrt, "CHUNK_BYTES", 4096)
    t = torch.ones(16384, dtype=torch.float32)  # 64 KiB: 16 chunks
    meta = m.extract_tensor_transport_metadata("o", [t])
    src = rt.ref(meta.refs[0])
    out = torch.zeros(16384, dtype=torch.float32)
    box: dict = {}

    def recv() -> None:
        try:
            box["got"] = m.recv_multiple_tensors("o", meta, None, [out])
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            box["err"] = exc

    with rt.write_section(src):
        th = threading.Thread(target=recv)
        th.start()
        _until(lambda: m.stats()["reads_in_flight"] == 1, "the read in flight", timeout=30)
        m.abort_transport("o", None)
    th.join(30)
    assert not th.is_alive() and isinstance(box.get("err"), memsem.MemsemError) and "aborted" in str(box["err"])
    assert int(out.sum()) in (0, 1024) and m.stats()["aborted"] == 1  # at most the chunk in flight
    assert m.stats()["reads_in_flight"] == 0
    with rt.write_section(src):
        req = m.fetch_multiple_tensors("o", meta, None)
        with pytest.raises(TimeoutError):
            m.wait_fetch_complete(req, timeout=0.2)
    with pytest.raises(memsem.MemsemError, match="aborted"):
        req.future.result(30)
    req = m.fetch_multiple_tensors("o", meta, None, [out])  # and a fetch that is let run
    assert m.wait_fetch_complete(req, timeout=LONG)[0] is out and int(out.sum()) == 16384
    m.garbage_collect("o", meta, [t])


def test_numpy_manager_and_registration():
    assert mrt.register() == ["MEMSEM", "MEMSEM_NUMPY"]  # idempotent
    assert mrt.register() == ["MEMSEM", "MEMSEM_NUMPY"]
    from ray.experimental.rdt.util import is_one_sided_transport

    assert is_one_sided_transport("MEMSEM") and is_one_sided_transport("MEMSEM_NUMPY")
    with memsem.Runtime(directory="local", job=f"rn-{time.monotonic_ns()}") as rt:
        m = mrt.MemsemNumpyTransport(runtime=rt)
        a = np.arange(12, dtype=np.int32).reshape(3, 4)
        meta = m.extract_tensor_transport_metadata("n", [a, a[:, 1]])
        got = m.recv_multiple_tensors("n", meta, None)
        assert np.array_equal(got[0], a) and np.array_equal(got[1], a[:, 1]) and got[0].dtype == np.int32
        big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: received into huge-page memory
        meta8 = m.extract_tensor_transport_metadata("n8", [big])
        (got8,) = m.recv_multiple_tensors("n8", meta8, None)
        assert np.array_equal(got8, big) and got8.flags.writeable
        m.garbage_collect("n8", meta8, [big])
        with pytest.raises(TypeError, match="numpy arrays"):
            m.extract_tensor_transport_metadata("n2", [torch.zeros(2)])
        m.garbage_collect("n", meta, [a])
        assert m.stats()["live_windows"] == 0
