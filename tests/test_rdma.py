"""RDMA engine on a real device (soft-RoCE rxe0 in the test VM: tests/rdma/run_rdma_tests.sh).

Two or more runtimes in separate processes with different ``MEMSEM_NODE_ID`` act as separate
nodes: no shared memory or cross-memory attach between them, so every byte moves by RDMA READ /
WRITE through rxe0. Outside the VM these tests skip with the engine probe's reason; where an
RDMA device is present (``MEMSEM_IN_VM=1`` or an rxe device in sysfs) a failing probe or engine
init is a failure, never a skip.

Processes are forked from this (already imported) process: under TCG a fresh interpreter
needs seconds just to import numpy.
"""
from __future__ import annotations

import glob
import hashlib
import multiprocessing as mp
import os
import signal
import statistics
import threading
import time
import traceback

import numpy as np
import pytest

import memsem
from memsem import AccessDeniedError, PeerLostError, StaleReferenceError, native
from memsem.engines import WATCH_HEADER, Descriptor, Engine, Op, OpKind, RemoteRegion
from memsem.engines.rdma import BOUNCE_BYTES, RdmaEngine

pytestmark = [pytest.mark.rdma, pytest.mark.multiproc]

IN_VM = os.environ.get("MEMSEM_IN_VM") == "1" or bool(glob.glob("/sys/class/infiniband/rxe*"))
PROBE = RdmaEngine.probe()
CALL_TIMEOUT = 120.0
SIZES = [64, 4096, 1 << 20, 64 << 20]


def need_rdma() -> None:
    """Skip without a device (with the probe's reason); fail where a device is present."""
    if not PROBE:
        if IN_VM:
            pytest.fail(f"an RDMA device is present but the rdma engine probe failed: {PROBE.reason}")
        pytest.skip(f"rdma engine unavailable: {PROBE.reason}")


#: tests that run without a device too (the rest skip or fail through ``need_rdma``)
NO_DEVICE = {"test_probe_names_a_reason", "test_directory_entries", "test_directory_watch_wakes_on_put",
             "test_listener_is_woken_not_polling",
             "test_checked_read_round_trips_cma", "test_checked_read_kept_header_never_returns_torn_bytes"}


@pytest.fixture(autouse=True)
def _need_rdma(request):
    if request.function.__name__ not in NO_DEVICE:
        need_rdma()


# -- data ------------------------------------------------------------------------------------------
def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Position-dependent bytes (cheap to make under emulation)."""
    rng = np.random.default_rng(seed)
    if nbytes <= 1 << 16:
        return rng.integers(0, 256, nbytes, dtype=np.uint8)
    block = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    chunks = -(-nbytes // (1 << 16))
    arr = np.tile(block, chunks).reshape(chunks, 1 << 16)
    arr ^= ((np.arange(chunks, dtype=np.uint32) * 2654435761 + seed) >> 24).astype(np.uint8)[:, None]
    return arr.reshape(-1)[:nbytes].copy()


def digest(arr: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(arr).view(np.uint8).data, digest_size=16).hexdigest()


# -- agent: one node = one forked process with its own Runtime ---------------------------------------
def _c_publish(rt, st, name, nbytes, access, seed, replace=False):
    arr = pattern(nbytes, seed)
    st[name] = arr
    ref = rt.publish(arr, name=name, access=access, replace=replace)
    st["ref:" + name] = ref
    return ref.to_bytes()


def _c_digest(rt, st, name):
    return digest(st[name])


def _c_owner_stats(rt, st):
    return {"engine": rt.engine("rdma").stats(), "telemetry": dict(rt.stats().registrations)}


def _c_mr_access(rt, st, name):
    ref = st["ref:" + name]
    rec = rt.directory.get_window(ref.gva)
    return rt.engine("rdma").registration_access(Descriptor.from_json(rec["descriptors"]["rdma"]))


def _c_get(rt, st, data):
    ref = rt.ref(data)
    t0 = time.perf_counter()
    out = ref.get()
    return digest(out), time.perf_counter() - t0


def _c_put(rt, st, data, seed):
    ref = rt.ref(data)
    src = pattern(ref.nbytes, seed)
    t0 = time.perf_counter()
    ref.put(src)
    return digest(src), time.perf_counter() - t0


def _c_xcopy(rt, st, data, ranges, seed):
    """One batch: ``ranges`` gets of the first half and ``ranges`` puts into the second half."""
    ref = rt.ref(data)
    half = ref.nbytes // 2
    chunk = half // ranges
    got = np.zeros(half, np.uint8)
    src = pattern(half, seed)
    pairs = [(ref.bytes(i * chunk, chunk), got[i * chunk:(i + 1) * chunk]) for i in range(ranges)]
    pairs += [(src[i * chunk:(i + 1) * chunk], ref.bytes(half + i * chunk, chunk)) for i in range(ranges)]
    batch = rt.xcopy(pairs)
    results = batch.wait(60)
    states = [r.state.name for r in results]
    return states, digest(got), digest(src)


def _c_submit(rt, st, data, ranges):
    """Engine-level batch: ``ranges`` READ work requests posted as one list."""
    ref = rt.ref(data)
    res = rt.resolve(ref.spec)
    eng = rt.engine("rdma")
    chunk = ref.nbytes // ranges
    out = np.zeros(ref.nbytes, np.uint8)
    before = eng.stats()["posted"]
    req = eng.submit([Op(OpKind.GET, res.remote, i * chunk, out[i * chunk:(i + 1) * chunk])
                      for i in range(ranges)])
    req.wait(60)
    return [op.state.name for op in req.ops], digest(out), eng.stats()["posted"] - before


def _c_explain(rt, st, data):
    return rt.explain(rt.ref(data))


def _c_engine_stats(rt, st):
    return rt.engine("rdma").stats()


def _c_latency(rt, st, data, iters):
    ref = rt.ref(data)
    out = np.empty(ref.nbytes, np.uint8)
    ref.get(out)
    first = digest(out)
    lat = []
    same = 0
    for _ in range(iters):
        out[:] = 0
        t0 = time.perf_counter()
        ref.get(out)
        lat.append(time.perf_counter() - t0)
        same += digest(out) == first
    put_lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        ref.put(out)
        put_lat.append(time.perf_counter() - t0)
    return statistics.median(lat), statistics.median(put_lat), first, same, digest(ref.get())


def _c_raw_put(rt, st, data):
    """Bypass the runtime's permission check: post an RDMA WRITE with the window's rkey."""
    ref = rt.ref(data)
    rec = rt.directory.get_window(ref.gva)
    desc = Descriptor.from_json(rec["descriptors"]["rdma"])
    eng = rt.engine("rdma")
    remote = eng.attach(desc, ref.nbytes)
    try:
        eng.put(remote, 0, np.full(ref.nbytes, 0xAB, np.uint8))
    except memsem.EngineError as exc:
        return exc.name, exc.code
    finally:
        remote.close()
    return None, None


def _c_get_timed(rt, st, data):
    """Get, returning (error type name, error attrs, seconds) instead of raising."""
    ref = rt.ref(data)
    t0 = time.perf_counter()
    try:
        ref.get()
    except memsem.MemsemError as exc:
        return type(exc).__name__, getattr(exc, "name", None), time.perf_counter() - t0
    return None, None, time.perf_counter() - t0


# -- tile-ready words and versions of a window on the other node -------------------------------------
def _c_publish_tiled(rt, st, name, n_tiles, tile_bytes):
    """A zero-filled tiled window: the bytes of tile k are written just before it is marked."""
    arr = np.zeros(n_tiles * tile_bytes, np.uint8)
    st[name], st["tb:" + name] = arr, tile_bytes
    ref = rt.publish(arr, name=name, access="rw", tile_bytes=tile_bytes)
    st["ref:" + name] = ref
    return ref.to_bytes()


def _c_fill_mark(rt, st, name, tiles, seed):
    """Write tile k's final bytes (``pattern`` of the whole window, seed ``seed``), then mark it."""
    ref, arr, tb = st["ref:" + name], st[name], st["tb:" + name]
    want = pattern(arr.nbytes, seed)
    for k in tiles:
        arr[k * tb:(k + 1) * tb] = want[k * tb:(k + 1) * tb]
        ref.mark_ready(k)


def _c_publish_sd(rt, st, name, step):
    sd = model(step)
    ref = rt.publish_state_dict(sd, name=name, slots=2)
    st["sd:" + name] = ref
    return ref.version(), sd_digest(sd)


def _c_update_sd(rt, st, name, step):
    sd = model(step)
    return st["sd:" + name].update(sd), sd_digest(sd)


def _w_pipeline(rt, st, log, data, tile_bytes):
    ref = rt.ref(data)
    with rt.pipeline(ref, tile_bytes=tile_bytes, depth=2, wait_ready=True, timeout=60) as pipe:
        for tile in pipe:
            with tile:
                log.append((tile.index, digest(tile.array)))
    return rt.route(ref).kind


def _w_wait_tiles(rt, st, log, data, tiles, tb):
    """wait_tile for each of ``tiles`` in turn (saying which one first), then get its bytes."""
    ref = rt.ref(data)
    for k in tiles:
        log.append(("waiting", k))
        ref.wait_tile(k, timeout=60)
        log.append((k, digest(ref.bytes(k * tb, tb).get())))
    return rt.route(ref).kind


def _w_follow(rt, st, log, name, last):
    """Follow versions 2..last of state dict ``name``: wait for each, load it, digest it."""
    ref = rt.lookup_state_dict(name)
    into = ref.empty_like("numpy")
    log.append((ref.load(into), sd_digest(into)))
    for want in range(2, last + 1):
        log.append(("waiting", want))
        v = ref.wait_version(want, timeout=60)
        log.append((ref.load(into, version=v), sd_digest(into)))
    return rt.route(ref).kind


def _c_start(rt, st, key, work, *args):
    """Run ``_w_<work>`` on a thread of this node; ``progress``/``result`` report on it."""
    log: list = []
    box: dict = {}

    def run():
        try:
            box["ok"] = WORK[work](rt, st, log, *args)
        except BaseException as exc:  # reported to the test by ``result``
            box["err"] = exc

    t = threading.Thread(target=run, daemon=True)
    st["bg:" + key] = (t, log, box)
    t.start()


def _c_progress(rt, st, key):
    """What the thread logged so far and how many RDMA work requests this node posted."""
    return list(st["bg:" + key][1]), rt.engine("rdma").stats()["posted"]


def _c_result(rt, st, key, timeout):
    t, log, box = st.pop("bg:" + key)
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"background work {key!r} still running after {timeout} s; log {log}")
    if "err" in box:
        raise box["err"]
    return box["ok"], list(log)


def _c_republish_tiled(rt, st, name, tile_bytes):
    arr = st[name]
    ref = rt.publish(arr, name=name, access="rw", tile_bytes=tile_bytes, replace=True)
    st["ref:" + name] = ref
    return ref.to_bytes()


def _c_unpublish(rt, st, name):
    rt.unpublish(st.pop("ref:" + name))


def _c_raw_ctl_write(rt, st, data):
    """Bypass the runtime: post an RDMA WRITE to the window's generation word with the rkey
    of its control words. Returns the work completion's status name and code."""
    from memsem.gva._control_block import W_GENERATION

    res = rt.resolve(rt.ref(data).spec)
    eng = rt.engine("rdma")
    try:
        eng.put(res.remote.ctl_header, 8 * W_GENERATION, np.full(8, 0x5A, np.uint8))
    except memsem.EngineError as exc:
        return exc.name, exc.code
    return None, None


def _c_window_record(rt, st, data):
    return rt.directory.get_window(rt.ref(data).gva)


def _c_bad_reads(rt, st, data):
    """read_words outside the descriptor's words: the error type of each attempt."""
    from memsem.engines import WATCH_HEADER, WATCH_READY

    ref = rt.ref(data)
    res = rt.resolve(ref.spec)
    eng = rt.engine("rdma")
    out = []
    for args in ((WATCH_READY, 4, 1), (WATCH_HEADER, 0, 25), (7, 0, 1), (WATCH_HEADER, True, 1)):
        try:
            eng.read_words(res.remote, *args)
            out.append(None)
        except (TypeError, ValueError) as exc:
            out.append(type(exc).__name__)
    return out


def _c_ready_tiles(rt, st, data):
    return rt.ref(data).ready_tiles()


def _c_wait_tile_outcome(rt, st, data, tile, timeout):
    try:
        rt.ref(data).wait_tile(tile, timeout=timeout)
    except memsem.MemsemError as exc:
        return type(exc).__name__
    return None


def _c_publish_versioned(rt, st, name, nbytes, seed):
    """A double-buffered window (``slots=2``) holding ``pattern(nbytes, seed)`` as version 1."""
    ref = rt.publish(pattern(nbytes, seed), name=name, slots=2)
    st["ref:" + name] = ref
    return ref.to_bytes(), digest(pattern(nbytes, seed))


def _c_commit(rt, st, name, seed):
    """One write section writing ``pattern(.., seed)``; returns (version, digest)."""
    ref = st["ref:" + name]
    with rt.write_section(ref, copy=False) as sec:
        sec.array().reshape(-1).view(np.uint8)[:] = pattern(ref.nbytes, seed)
        v = sec.version
    return v, digest(pattern(ref.nbytes, seed))


def _c_open(rt, st, name, seed):
    """Open a write section and write half of ``pattern(.., seed)`` (left open: torn bytes)."""
    ref = st["ref:" + name]
    sec = rt.write_section(ref, copy=False)
    flat = sec.array().reshape(-1).view(np.uint8)
    flat[:ref.nbytes // 2] = pattern(ref.nbytes, seed)[:ref.nbytes // 2]
    st["sec:" + name] = sec
    return sec.version


def _c_close(rt, st, name):
    ref, sec = st["ref:" + name], st.pop("sec:" + name)
    sec.array().reshape(-1).view(np.uint8)[ref.nbytes // 2:] = 0
    return sec.commit()


def _c_read_counted(rt, st, data, version):
    """A checked one-sided read of ``version`` (0: the latest): (version read, digest, round
    trips the engine made for it, torn copies counted)."""
    ref = rt.ref(data)
    out = np.empty(ref.nbytes, np.uint8)
    eng = rt.engine("rdma")
    before, torn = eng.stats()["round_trips"], rt.stats().errors.get("torn", 0)
    v = rt.transfer(ref.spec, "get", 0, out, version=version)
    return v, digest(out), eng.stats()["round_trips"] - before, rt.stats().errors.get("torn", 0) - torn


class CmaOnesided(Engine):
    """A stand-in for the rdma engine where there is no RDMA device (the core suite): a window
    of another process is read one-sidedly with process_vm_readv, its header words too
    (``can_watch`` "read"), so the runtime takes the very path it takes over RDMA (the checked
    one-sided read of ``_onesided_get``). Named "rdma" (``RdmaEngine.reach`` routes to it
    between two node ids); every read is one round trip (``stats()["round_trips"]``);
    ``before(kind)`` runs before each ("get" or "words"): a test acts there, at a known point
    of the read. A test double: it enforces no generation in hardware and never writes."""

    name = "rdma"
    enforces_generation = "device"

    def __init__(self) -> None:
        super().__init__()
        self.location_attrs = {"rdma_port": "cma/1"}
        self.trips = 0
        self.before = None

    def stats(self) -> dict:
        return {"round_trips": self.trips, "posted": self.trips}

    def register(self, region):
        return Descriptor(self.name, {"pid": os.getpid(), "addr": region.address, "nbytes": region.nbytes,
                                      "port": "cma/1", "force": False})

    def on_publish(self, descriptor, n_tiles, gva, words=None):
        if words is not None:
            descriptor.fields["ctl"] = {"hdr": words.header.address, "hdr_words": words.header.nbytes // 8}

    def attach(self, descriptor, nbytes, credential=b""):
        r = RemoteRegion(self, nbytes, None, writable=False)
        r.pid, r.addr = descriptor.field("pid", int), descriptor.field("addr", int)
        r.hdr = descriptor.field("ctl", dict, {}).get("hdr", 0)
        return r

    def can_watch(self, remote):
        return "read" if remote.hdr else ""

    def _trip(self, kind):
        self.trips += 1
        if self.before is not None:
            self.before(kind)

    def read_words(self, remote, kind, index, count):
        if kind != WATCH_HEADER:
            raise memsem.NotSupportedError("CmaOnesided reads header words only")
        self._trip("words")
        out = np.empty(count, np.uint64)
        native.vm_read(remote.pid, out.ctypes.data, remote.hdr + 8 * index, 8 * count)
        return out.tolist()

    def get(self, remote, offset, dst):
        self._trip("get")
        native.vm_read(remote.pid, dst.ctypes.data, remote.addr + offset, dst.nbytes)

    def put(self, remote, offset, src):
        raise memsem.NotSupportedError("CmaOnesided never writes")


def model(step: int) -> dict:
    rng = np.random.default_rng(7)
    base = {"embed": rng.standard_normal((64, 32)).astype(np.float32),
            "layer0.w": rng.standard_normal((32, 32)).astype(np.float32),
            "steps": np.array(0, np.int64),
            "head": rng.standard_normal((32, 100)).astype(np.float32)}
    return {k: v + np.asarray(step, v.dtype) for k, v in base.items()}


def sd_digest(sd: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(sd):
        h.update(np.ascontiguousarray(sd[k]).view(np.uint8).tobytes())
    return h.hexdigest()


WORK = {k[3:]: v for k, v in dict(globals()).items() if k.startswith("_w_")}
COMMANDS = {k[3:]: v for k, v in dict(globals()).items() if k.startswith("_c_")}


def _cause(exc: BaseException) -> dict | None:
    c = exc.__cause__
    if c is None or c is exc:
        return None
    return {"type": type(c).__name__, "name": getattr(c, "name", None), "code": getattr(c, "code", None)}


def _agent(conn, node: str, job: str, fake: bool) -> None:
    os.environ["MEMSEM_NODE_ID"] = node
    state: dict = {}
    try:
        if fake:
            rt = memsem.Runtime(engines=("loopback", "host"), engine_objects={"rdma": CmaOnesided()},
                                job=job, timeout=20)
        else:
            rt = memsem.Runtime(engines=("loopback", "host", "rdma"), job=job, timeout=20)
    except BaseException as exc:
        conn.send((False, (exc, None, traceback.format_exc())))
        os._exit(1)
    conn.send((True, None))
    while True:
        try:
            cmd, args, kwargs = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            rt.close()
            conn.send((True, None))
            break
        try:
            conn.send((True, COMMANDS[cmd](rt, state, *args, **kwargs)))
        except BaseException as exc:
            try:
                conn.send((False, (exc, _cause(exc), traceback.format_exc())))
            except Exception:  # unpicklable
                conn.send((False, (RuntimeError(repr(exc)), _cause(exc), traceback.format_exc())))
    os._exit(0)


class Node:
    """A forked process that acts as node ``node`` (its own MEMSEM_NODE_ID and Runtime; with
    ``fake``, ``CmaOnesided`` stands in for the rdma engine)."""

    def __init__(self, node: str, job: str, fake: bool = False) -> None:
        ctx = mp.get_context("fork")
        self.node = node
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_agent, args=(child, node, job, fake), daemon=True)
        self.proc.start()
        child.close()
        self._answer("startup", CALL_TIMEOUT)

    def _answer(self, what: str, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"node {self.node}: no answer to {what} after {timeout} s")
        ok, val = self.conn.recv()
        if ok:
            return val
        exc, cause, tb = val
        exc.remote_cause = cause
        exc.remote_traceback = tb
        raise exc

    def __call__(self, cmd: str, *args, timeout: float = CALL_TIMEOUT, **kwargs):
        self.conn.send((cmd, args, kwargs))
        return self._answer(cmd, timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("exit", timeout=30)
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


@pytest.fixture(scope="module")
def job():
    return f"rdmatest{os.getpid()}"


@pytest.fixture(scope="module")
def nodes(job):
    if not PROBE:
        pytest.skip(f"rdma engine unavailable: {PROBE.reason}")
    owner = Node("node-a", job)
    try:
        consumer = Node("node-b", job)
    except BaseException:
        owner.close()
        raise
    yield owner, consumer
    consumer.close()
    owner.close()


def report(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\n[rdma] {line}", flush=True)


# -- tests that run everywhere ----------------------------------------------------------------------
def test_probe_names_a_reason():
    if IN_VM:
        assert PROBE.ok, PROBE.reason
    elif not PROBE:
        assert "RDMA" in PROBE.reason or "pyverbs" in PROBE.reason, PROBE.reason


def test_directory_entries(tmp_path, monkeypatch):
    """The small key/value API the engine rendezvous on (QP numbers, GIDs)."""
    from memsem.directory import LocalDirectory

    monkeypatch.setenv("MEMSEM_SHM_DIR", str(tmp_path))
    d = LocalDirectory("entries", alive=lambda rec: True)
    d.put_entry("rdma/ep1/req/c1.1", {"qpn": 17, "seq": 1})
    d.put_entry("rdma/ep1/bye/c2", {"seq": 3})
    d.put_entry("rdma/ep2/req/c1.1", {"qpn": 18, "seq": 1})
    assert d.get_entry("rdma/ep1/req/c1.1") == {"qpn": 17, "seq": 1}
    assert set(d.entries("rdma/ep1/")) == {"rdma/ep1/req/c1.1", "rdma/ep1/bye/c2"}
    d.remove_entry("rdma/ep1/req/c1.1")
    d.remove_entry("rdma/ep1/req/c1.1")  # twice is fine
    assert d.get_entry("rdma/ep1/req/c1.1") is None
    assert list(d.entries("rdma/ep1/")) == ["rdma/ep1/bye/c2"]
    with pytest.raises(ValueError, match="entry key"):
        d.put_entry("no spaces", {})
    d.close()


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_directory_watch_wakes_on_put(tmp_path, monkeypatch, kind):
    """The directory wait the rdma connection manager uses instead of polling: a watch made
    before a put under its prefix wakes (also when the put came before the wait), ignores
    other prefixes, ends at its timeout with False, wakes on ``wake()``; every wait has a
    timeout here, and the order is forced by the test (put, then wait)."""
    from memsem.directory import LocalDirectory
    from memsem.directory._base import EntryWatch

    monkeypatch.setenv("MEMSEM_SHM_DIR", str(tmp_path))
    if kind == "local":
        d = LocalDirectory("watch", alive=lambda rec: True)
        srv = None
    else:
        from tests.netns.redis_server import find_redis_server, redis_server

        if find_redis_server() is None:
            pytest.skip("redis-server is not installed (make test-core installs it as root)")
        if IN_VM:
            pytest.skip("the VM's / is read-only: the redis watch runs in the core suite")
        srv = redis_server()
        url = srv.__enter__().url
        from memsem.directory.redis import RedisDirectory

        d = RedisDirectory(url, job="watch", ttl=10)
    try:
        w = d.watch_entries("rdma/ep1/")
        assert type(w) is not EntryWatch, "this directory should notify, not poll"
        assert w.wait(0.05) is False  # nothing put: the timeout ends it
        d.put_entry("rdma/ep2/req/c.1", {"seq": 1})  # another prefix: not for this watch
        assert w.wait(0.05) is False
        d.put_entry("rdma/ep1/req/c.1", {"seq": 1})  # put before the wait: not lost
        assert w.wait(30) is True
        assert w.wait(0.05) is False  # consumed
        done = threading.Event()

        def put_later():
            d.put_entry("rdma/ep1/bye/c", {"seq": 2})
            done.set()

        t = threading.Thread(target=put_later)
        t.start()
        assert done.wait(30)
        assert w.wait(30) is True
        t.join(30)
        w.wake()
        assert w.wait(30) is True
        w.close()
        w.close()
        w.wake()  # after close: harmless
        with pytest.raises(ValueError, match="entry key"):
            d.watch_entries("no spaces")
        for key in d.entries("rdma/"):
            d.remove_entry(key)
    finally:
        d.close()
        if srv is not None:
            srv.__exit__(None, None, None)


def test_listener_is_woken_not_polling(tmp_path, monkeypatch):
    """The owner's listener waits on the directory: with its longest wait made far longer than
    the test's own timeouts, each goodbye entry is still handled (removed) after one more scan,
    and ``close`` joins the listener at once (it is woken, not left to time out)."""
    from memsem.directory import LocalDirectory
    from memsem.engines.rdma import _connect
    from memsem.engines.rdma._verbs import Counters

    monkeypatch.setenv("MEMSEM_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(_connect, "LISTEN_WAIT", 3600.0)
    d = LocalDirectory("listen", alive=lambda rec: True)
    scans = []

    class Counting:
        """The directory, counting the listener's scans."""

        def __getattr__(self, name):
            return getattr(d, name)

        def entries(self, prefix):
            scans.append(prefix)
            return d.entries(prefix)

    conns = _connect.Connections(None, [], "ep1", Counters(), 5.0)
    conns.bind(Counting(), "node")
    try:
        conns.start_listener()
        for i in range(3):
            d.put_entry(f"rdma/ep1/bye/c{i}", {"seq": 1})
            deadline = time.monotonic() + 30
            while d.get_entry(f"rdma/ep1/bye/c{i}") is not None:
                assert time.monotonic() < deadline, f"bye {i} not handled (scans {len(scans)})"
                time.sleep(0.01)
        assert 3 <= len(scans) <= 3 + 2  # the first scan, one per put (two may fold into one), no polls
        assert conns._listener.is_alive()
    finally:
        conns.close()
        d.close()
    assert not conns._listener.is_alive()  # close woke it (its own wait was an hour)


def _round_trip_sequence(owner, read, name):
    """The counts of a checked one-sided read on a double-buffered window (version v lives in
    slot v % 2): 3 round trips (header, copy, header) when no kept header can serve, 2 (copy,
    header) in steady state, 4 when the latest version moved since the kept header (its copy is
    valid but not the latest: done again from the header read after it). Every result bit-exact."""
    data, sha1 = owner("publish_versioned", name, 4096, 1)
    assert read(data, 0) == (1, sha1, 3, 0)  # first read of this resolution: nothing kept
    for _ in range(3):
        assert read(data, 0) == (1, sha1, 2, 0)  # steady state
    assert read(data, 1) == (1, sha1, 2, 0)
    v2, sha2 = owner("commit", name, 2)
    assert v2 == 2
    assert read(data, 2) == (2, sha2, 3, 0)  # kept sequence of slot 0 is not version 2's
    assert read(data, 0) == (2, sha2, 2, 0)
    v3, sha3 = owner("commit", name, 3)
    assert read(data, 0) == (3, sha3, 4, 0)  # copied version 2 (intact), then the new latest
    assert read(data, 0) == (3, sha3, 2, 0)
    assert read(data, 2) == (2, sha2, 2, 0)  # version 2 still in slot 0
    return data


def test_checked_read_round_trips_cma(job, monkeypatch):
    """The round trips of the checked one-sided read, counted on ``CmaOnesided`` (the same
    runtime path as over RDMA, no device needed): see ``_round_trip_sequence``."""
    if not memsem.engines.HostEngine.cma_availability():
        pytest.skip(f"no cross-memory attach here: {memsem.engines.HostEngine.cma_availability().reason}")
    owner = Node("node-cma-a", job, fake=True)
    try:
        monkeypatch.setenv("MEMSEM_NODE_ID", "node-cma-b")
        with memsem.Runtime(engines=("loopback", "host"), engine_objects={"rdma": CmaOnesided()},
                            job=job, timeout=20) as rt:
            _round_trip_sequence(owner, lambda data, v: _c_read_counted(rt, {}, data, v), "cma")
            assert rt.route(rt.ref(owner("publish_versioned", "cma2", 64, 1)[0])).kind == "rdma"
    finally:
        owner.close()


def test_checked_read_kept_header_never_returns_torn_bytes(job, monkeypatch):
    """A write section that opens on the slot being read after the kept header was read (the
    2-round-trip path: the header the copy trusts is from the previous read) is caught by the
    header read after the copy: a read of that version raises (version gone), a read of the
    latest copies again from the other slot; never the torn bytes. The owner acts at a known
    point: just before the consumer's copy."""
    if not memsem.engines.HostEngine.cma_availability():
        pytest.skip(f"no cross-memory attach here: {memsem.engines.HostEngine.cma_availability().reason}")
    owner = Node("node-torn-a", job, fake=True)
    try:
        monkeypatch.setenv("MEMSEM_NODE_ID", "node-torn-b")
        eng = CmaOnesided()
        with memsem.Runtime(engines=("loopback", "host"), engine_objects={"rdma": eng},
                            job=job, timeout=20) as rt:
            def read(data, v):
                return _c_read_counted(rt, {}, data, v)

            def at_next_copy(action):
                def hook(kind):
                    if kind == "get":
                        eng.before = None
                        action()
                eng.before = hook

            data = _round_trip_sequence(owner, read, "torn")  # kept: latest 3, slots 0/1 at 2/3
            assert owner("commit", "torn", 4)[0] == 4  # slot 0
            # Version 3 (slot 1) from the kept header; just before the copy the owner opens
            # version 5 on slot 1 and writes half of it: the header after the copy says so.
            at_next_copy(lambda: owner("open", "torn", 5))
            with pytest.raises(StaleReferenceError, match="version 3"):
                read(data, 3)
            assert eng.before is None  # the hook ran: the copy read the slot being written
            assert owner("close", "torn") == 5
            sha5 = digest(np.concatenate([pattern(4096, 5)[:2048], np.zeros(2048, np.uint8)]))
            # "version gone" keeps the resolution (the window is intact) and the header read
            # after the copy: it names version 4 (slot 0), copied intact, but 5 is the latest
            # by the header read after it, so 5 is copied: 4 round trips
            assert read(data, 0) == (5, sha5, 4, 0)
            v6, sha6 = owner("commit", "torn", 6)  # slot 0
            # The latest from the kept header is 5 (slot 1); just before its copy the owner
            # opens version 7 on slot 1: torn, so the read copies the latest, 6, from slot 0.
            at_next_copy(lambda: owner("open", "torn", 7))
            assert read(data, 0) == (v6, sha6, 4, 1)
            assert eng.before is None
            assert owner("close", "torn") == 7
            assert read(data, 0)[::2] == (7, 4)  # kept: 6 (intact, not the latest): again
    finally:
        owner.close()


# -- tests on a device (the VM) ----------------------------------------------------------------------
def test_engine_opens_device():
    """Engine init on a present device works (a failure here fails, never skips)."""
    eng = RdmaEngine()
    try:
        devs = eng.devices()
        assert devs and all(d["gid"] for d in devs)
        assert eng.location_attrs["rdma_port"]
    finally:
        eng.close()


def test_explain_names_rdma(nodes):
    owner, consumer = nodes
    ref = owner("publish", "explain", 4096, "rw", 1)
    text = consumer("explain", ref)
    assert "route rdma via engine 'rdma'" in text and "different nodes" in text, text
    assert "not host: owner is on node 'node-a'" in text, text


@pytest.mark.parametrize("nbytes", SIZES, ids=lambda n: f"{n}B")
def test_get_put_sizes(nodes, nbytes, capsys):
    owner, consumer = nodes
    name = f"w{nbytes}"
    ref = owner("publish", name, nbytes, "rw", nbytes)
    got, t_get = consumer("get", ref)
    assert got == owner("digest", name)
    sent, t_put = consumer("put", ref, nbytes + 7)
    assert sent == owner("digest", name)
    if nbytes < SIZES[-1]:
        got2, _ = consumer("get", ref)
        assert got2 == sent
    if nbytes == SIZES[-1]:
        report(capsys, f"{nbytes >> 20} MiB (emulated rxe under TCG): READ {t_get:.3f} s = "
                       f"{nbytes / t_get / 1e6:.0f} MB/s, WRITE {t_put:.3f} s = {nbytes / t_put / 1e6:.0f} MB/s "
                       "(runtime get/put incl. registering the local buffer)")
    if nbytes > BOUNCE_BYTES:
        assert consumer("engine_stats")["local_registrations"] > 0


def test_checked_read_round_trips(nodes):
    """A checked one-sided read over RDMA (seqlock over the wire) costs 2 round trips in
    steady state, 3 when the kept sequence value cannot serve (``_round_trip_sequence``,
    counted by the engine: one per posted-and-polled work request list)."""
    owner, consumer = nodes
    data = _round_trip_sequence(owner, lambda data, v: consumer("read_counted", data, v), "rtt")
    assert consumer("explain", data).startswith("route rdma")


def test_latency_64b(nodes, capsys):
    owner, consumer = nodes
    ref = owner("publish", "lat", 64, "rw", 3)
    get_s, put_s, first, same, after = consumer("latency", ref, 200)
    report(capsys, f"64 B (emulated rxe under TCG): get median {get_s * 1e6:.0f} us, "
                   f"put median {put_s * 1e6:.0f} us (runtime get/put, 200 each)")
    assert first == owner("digest", "lat")  # every get returned the window's bytes
    assert same == 200
    assert after == first == owner("digest", "lat")  # the puts wrote them back unchanged


@pytest.mark.parametrize("nbytes,ranges", [(64, 1), (1 << 20, 4), (64 << 20, 8)],
                         ids=lambda v: f"{v}")
def test_xcopy_batch(nodes, nbytes, ranges):
    """One xcopy batch: ``ranges`` gets from the first half, ``ranges`` puts into the second."""
    owner, consumer = nodes
    name = f"xcopy{nbytes}"
    ref = owner("publish", name, nbytes, "rw", 11)
    before = owner("digest", name)
    states, got, sent = consumer("xcopy", ref, ranges, 12)
    assert states == ["DONE"] * (2 * ranges)
    whole = pattern(nbytes, 11)
    assert got == digest(whole[:nbytes // 2])
    whole[nbytes // 2:] = pattern(nbytes // 2, 12)
    assert sent == digest(pattern(nbytes // 2, 12))
    assert owner("digest", name) == digest(whole) != before


def test_submit_posts_a_list(nodes):
    owner, consumer = nodes
    nbytes = 1 << 20
    ref = owner("publish", "submit", nbytes, "rw", 21)
    states, got, posted = consumer("submit", ref, 32)
    assert states == ["DONE"] * 32
    assert got == owner("digest", "submit")
    assert posted == 32


def test_stale_rkey_after_republish(nodes):
    owner, consumer = nodes
    ref1 = owner("publish", "stale", 4096, "rw", 31)
    got, _ = consumer("get", ref1)
    assert got == owner("digest", "stale")
    regs_before = owner("owner_stats")["engine"]
    ref2 = owner("publish", "stale", 4096, "rw", 32, True)  # republish (replace=True): generation bump, MR re-registered
    regs_after = owner("owner_stats")["engine"]
    assert regs_after["registrations"] == regs_before["registrations"] + 1
    assert regs_after["deregistrations"] == regs_before["deregistrations"] + 1
    with pytest.raises(StaleReferenceError) as ei:
        consumer("get", ref1)  # the consumer's cached rkey is the old one: the device refuses it
    cause = ei.value.remote_cause
    assert cause and cause["name"] == "IBV_WC_REM_ACCESS_ERR" and cause["code"] == 10, cause
    with pytest.raises(StaleReferenceError):
        consumer("put", ref1, 5)
    got, _ = consumer("get", ref2)  # the connection is re-established for the new generation
    assert got == owner("digest", "stale")


def test_read_only_window_refuses_write(nodes):
    owner, consumer = nodes
    ref = owner("publish", "ro", 4096, "r", 41)
    before = owner("digest", "ro")
    import pyverbs.enums as e

    access = owner("mr_access", "ro")
    assert access & e.IBV_ACCESS_REMOTE_READ and not access & e.IBV_ACCESS_REMOTE_WRITE
    got, _ = consumer("get", ref)
    assert got == before
    posted = consumer("engine_stats")["posted"]
    with pytest.raises(AccessDeniedError):
        consumer("put", ref, 42)  # the runtime refuses before posting anything
    assert consumer("engine_stats")["posted"] == posted
    name, code = consumer("raw_put", ref)  # and the MR itself lacks REMOTE_WRITE
    assert (name, code) == ("IBV_WC_REM_ACCESS_ERR", 10)
    assert owner("digest", "ro") == before
    got, _ = consumer("get", ref)  # the connection recovers
    assert got == before


@pytest.mark.parametrize("n_consumers", [1, 3])
def test_one_registration_for_n_consumers(job, n_consumers):
    owner = Node("node-owner-n", job)
    consumers = []
    try:
        ref = owner("publish", "shared", 1 << 16, "r", 51)
        want = owner("digest", "shared")
        consumers = [Node(f"node-c{i}", job) for i in range(n_consumers)]
        for c in consumers:
            assert c("get", ref)[0] == want
            assert c("get", ref)[0] == want
        st = owner("owner_stats")
        assert st["engine"]["registrations"] == 1
        assert st["engine"]["live_registrations"] == 1
        assert st["telemetry"].get("rdma") == 1
        assert st["engine"]["served_live"] == n_consumers
    finally:
        for c in consumers:
            c.close()
        owner.close()


def test_peer_killed_gives_typed_error(job, capsys):
    owner = Node("node-doomed", job)
    consumer = Node("node-survivor", job)
    try:
        ref = owner("publish", "doomed", 4096, "rw", 61)
        assert consumer("get", ref)[0] == owner("digest", "doomed")
        owner.kill()
        err, status, secs = consumer("get_timed", ref, timeout=30)
        report(capsys, f"owner killed: consumer got {err} ({status}) after {secs * 1e3:.0f} ms")
        # bounded by the QP's retries (ack timeout x retry count), not by a wall clock here
        assert err == PeerLostError.__name__ and status in ("IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR")
        err, _, secs = consumer("get_timed", ref, timeout=30)  # reconnecting fails, bounded
        report(capsys, f"then a reconnect attempt gave {err} after {secs * 1e3:.0f} ms")
        assert err == PeerLostError.__name__
    finally:
        consumer.close()
        owner.close()


# -- tile-ready words and versions across nodes (one-sided reads of the owner's control words) ------
def until(node: Node, key: str, pred, what: str, timeout: float = 60.0):
    """Poll ``node``'s background work ``key`` until ``pred(log, posted)`` holds (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        log, posted = node("progress", key)
        if pred(log, posted):
            return log, posted
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached after {timeout} s (log {log})")
        time.sleep(0.02)


def waiting_on(node: Node, key: str, item) -> None:
    """Return once ``node``'s work logged ("waiting", item) and then posted two more RDMA work
    requests (it is inside the wait, reading the owner's words)."""
    log, posted = until(node, key, lambda log, _: ("waiting", item) in log, f"waiting for {item}")
    until(node, key, lambda log, p: p >= posted + 2, f"reads while waiting for {item}")


def test_control_words_registered_read_only(nodes):
    """The owner registers the header and ready words remote-read only and names them."""
    owner, consumer = nodes
    ref = owner("publish_tiled", "ctl", 4, 4096)
    rec = consumer("window_record", ref)
    ctl = rec["descriptors"]["rdma"]["fields"]["ctl"]
    assert ctl["hdr_words"] == 24 and ctl["ready_words"] == 4
    assert all(m["hdr_rkey"] and m["ready_rkey"] for m in ctl["mrs"])
    assert consumer("raw_ctl_write", ref) == ("IBV_WC_REM_ACCESS_ERR", 10)  # no remote write
    assert consumer("ready_tiles", ref) == []  # the generation word is intact, the QP recovered
    # words outside what the descriptor names are refused before anything is posted
    assert consumer("bad_reads", ref) == ["ValueError", "ValueError", "ValueError", "TypeError"]


def test_pipeline_waits_for_tiles_marked_out_of_order(nodes):
    """A consumer on the other node pipelines a tiled window with wait_ready=True while the
    owner writes and marks tiles 1, 2, then 0, 3: nothing is handed out before tile 0 is
    marked, and every tile has its final bytes (a tile read before its mark would be zeros)."""
    owner, consumer = nodes
    n, tb = 4, 64 << 10
    ref = owner("publish_tiled", "pipe", n, tb)
    consumer("start", "pipe", "pipeline", ref, tb)
    owner("fill_mark", "pipe", [1, 2], 5)
    log, posted = consumer("progress", "pipe")
    until(consumer, "pipe", lambda log, p: p >= posted + 4, "pipeline reading the ready words")
    assert consumer("progress", "pipe")[0] == []  # tile 0 is not marked: nothing may move
    owner("fill_mark", "pipe", [0], 5)
    until(consumer, "pipe", lambda log, _: len(log) == 3, "tiles 0..2")
    owner("fill_mark", "pipe", [3], 5)
    route, log = consumer("result", "pipe", 60)
    want = pattern(n * tb, 5)
    assert route == "rdma"
    assert log == [(k, digest(want[k * tb:(k + 1) * tb])) for k in range(n)]


def test_wait_tile_each_tile_after_its_mark(nodes):
    owner, consumer = nodes
    n, tb = 4, 4096
    ref = owner("publish_tiled", "wt", n, tb)
    order = [3, 0, 2, 1]
    consumer("start", "wt", "wait_tiles", ref, order, tb)
    for k in order:
        waiting_on(consumer, "wt", k)  # the consumer waits on tile k before it is marked
        owner("fill_mark", "wt", [k], 9)
    route, log = consumer("result", "wt", 60)
    want = pattern(n * tb, 9)
    assert route == "rdma"
    assert [x for x in log if x[0] != "waiting"] == [(k, digest(want[k * tb:(k + 1) * tb])) for k in order]


def test_republish_while_waiting_is_stale_and_old_marks_never_satisfy(nodes):
    owner, consumer = nodes
    n, tb = 4, 4096
    old = owner("publish_tiled", "gen", n, tb)
    owner("fill_mark", "gen", [0, 1, 2], 3)
    assert consumer("ready_tiles", old) == [0, 1, 2]
    consumer("start", "gen", "wait_tiles", old, [3], tb)
    waiting_on(consumer, "gen", 3)
    new = owner("republish_tiled", "gen", tb)  # same control block: the old marks stay in the words
    with pytest.raises(StaleReferenceError):
        consumer("result", "gen", 60)
    with pytest.raises(StaleReferenceError):
        consumer("ready_tiles", old)
    assert consumer("ready_tiles", new) == []
    assert consumer("wait_tile_outcome", new, 0, 0.3) == "MemsemTimeoutError"  # a mark of gen 1
    owner("fill_mark", "gen", [0], 4)
    assert consumer("wait_tile_outcome", new, 0, 60) is None
    assert consumer("ready_tiles", new) == [0]


def test_unpublish_while_waiting_is_stale(nodes):
    owner, consumer = nodes
    ref = owner("publish_tiled", "gone", 2, 4096)
    consumer("start", "gone", "wait_tiles", ref, [1], 4096)
    waiting_on(consumer, "gone", 1)
    owner("unpublish", "gone")
    with pytest.raises(StaleReferenceError):
        consumer("result", "gone", 60)


def test_versions_followed_across_nodes(nodes):
    """A state dict (double-buffered) on the owner; the consumer follows versions 2 and 3
    through wait_version and loads each bit-exact (one-sided seqlock around each read)."""
    owner, consumer = nodes
    v1, sha1 = owner("publish_sd", "policy", 0)
    assert v1 == 1
    consumer("start", "sd", "follow", "policy", 3)
    waiting_on(consumer, "sd", 2)
    v2, sha2 = owner("update_sd", "policy", 1)
    waiting_on(consumer, "sd", 3)
    v3, sha3 = owner("update_sd", "policy", 2)
    route, log = consumer("result", "sd", 60)
    assert route == "rdma"
    assert (v2, v3) == (2, 3)
    assert [x for x in log if x[0] != "waiting"] == [(1, sha1), (2, sha2), (3, sha3)]
    assert len({sha1, sha2, sha3}) == 3


def test_owner_killed_while_waiting_is_peer_lost(job):
    owner = Node("node-wait-doomed", job)
    consumer = Node("node-wait-survivor", job)
    try:
        # a name of its own: "doomed" of test_peer_killed_gives_typed_error stays held in this job's
        # local directory (its holder claims another node id, whose process this directory cannot judge)
        ref = owner("publish_tiled", "doomed-wait", 2, 4096)
        consumer("start", "dead", "wait_tiles", ref, [1], 4096)
        waiting_on(consumer, "dead", 1)
        owner.kill()
        with pytest.raises(PeerLostError) as ei:
            consumer("result", "dead", 60)
        assert "dead" in str(ei.value) or "unreachable" in str(ei.value)
    finally:
        consumer.close()
        owner.close()
