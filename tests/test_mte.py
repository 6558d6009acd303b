"""MTE engine through the shmem host emulator (a TEST DOUBLE of Ascend SHMEM), 2 and 4 PEs.

Every PE is a spawned process with its own ``memsem.Runtime(engines=("loopback", "host",
"mte"))``, loading the emulator through ``MEMSEM_SHMEM_LIB`` exactly as a real libshmem.so
would be loaded. PE 0 makes the SHMEM unique id and hands it to the others (the application's
job in real use); refs travel between PEs as bytes. Every wait is bounded: queue reads and
joins have timeouts, the emulator's collectives use the team timeout, signal waits take one.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

pytestmark = [pytest.mark.npu, pytest.mark.multiproc]

ROOT = pathlib.Path(__file__).resolve().parents[1]
EMU_BUILD = ROOT / "native" / "shmem_emu" / "build.sh"
CTX = mp.get_context("spawn")
HEAP = 4 << 20
PE_TIMEOUT = 90.0
STEP = 30.0  # bound of each exchange between PEs


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def emu_lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        pytest.skip("no C compiler to build the shmem host emulator")
    out = tmp_path_factory.mktemp("shmem_emu_mte")
    subprocess.run(["sh", str(EMU_BUILD), str(out)], check=True, timeout=120, capture_output=True)
    return str(out / "libshmem_host_emu.so")


# --------------------------------------------------------------------------- PE side
class Peers:
    """Exchange of small Python objects between the PEs of one test (bounded)."""

    def __init__(self, pe: int, n: int, inboxes) -> None:
        self.pe, self.n, self.inboxes = pe, n, inboxes
        self._early: dict[str, dict[int, object]] = {}

    def allgather(self, tag: str, obj: object) -> dict[int, object]:
        for q in range(self.n):
            if q != self.pe:
                self.inboxes[q].put((tag, self.pe, obj))
        got = self._early.pop(tag, {})
        got[self.pe] = obj
        deadline = time.monotonic() + STEP
        while len(got) < self.n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"PE {self.pe}: {tag!r} from PEs {sorted(set(range(self.n)) - set(got))} "
                                   f"not received within {STEP} s")
            t, src, o = self.inboxes[self.pe].get(timeout=left)
            if t == tag:
                got[src] = o
            else:
                self._early.setdefault(t, {})[src] = o
        return got


def _pe_main(pe: int, n: int, lib: str, scenario: str, env: dict, inboxes, results) -> None:
    try:
        os.environ.update(env)
        os.environ["MEMSEM_SHMEM_LIB"] = lib
        os.environ["MEMSEM_SHMEM_EMU_LOG"] = "0"
        from memsem.engines import mte

        peers = Peers(pe, n, inboxes)
        uid = mte.MteEngine.new_uniqueid() if pe == 0 else None   # PE 0 makes the id ...
        uid = peers.allgather("uid", uid)[0]                       # ... and sends it anywhere
        team = mte.MteEngine.init_team(pe, n, uid, HEAP, timeout=20)
        try:
            out = SCENARIOS[scenario](team, peers)
            team.barrier()
        finally:
            team.close()
        results.put((pe, "ok", out))
    except BaseException:
        results.put((pe, "error", traceback.format_exc()))


def run_pes(lib: str, n: int, scenario: str, env: dict | None = None) -> dict[int, object]:
    env = {"MEMSEM_JOB": os.environ["MEMSEM_JOB"], **(env or {})}
    inboxes = [CTX.Queue() for _ in range(n)]
    results = CTX.Queue()
    procs = [CTX.Process(target=_pe_main, args=(pe, n, lib, scenario, env, inboxes, results), daemon=True)
             for pe in range(n)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + PE_TIMEOUT
    try:
        while len(got) < n and time.monotonic() < deadline:
            try:
                pe, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            got[pe] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {pe: r[1] for pe, r in got.items() if r[0] != "ok"}
    assert not errors, "\n".join(f"--- PE {pe}\n{tb}" for pe, tb in sorted(errors.items()))
    missing = sorted(set(range(n)) - set(got))
    assert not missing, f"PEs {missing} gave no result within {PE_TIMEOUT} s ({[p.exitcode for p in procs]})"
    return {pe: r[1] for pe, r in got.items()}


def _pattern(pe: int, nbytes: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.int64) * (pe + 3) + 11 * pe + salt) % 251).astype(np.uint8)


def _runtime():
    import memsem

    return memsem.Runtime(engines=("loopback", "host", "mte"), timeout=20)


# --------------------------------------------------------------------------- scenarios
def _scenario_data(team, peers: Peers) -> dict:
    """get / put / view / xcopy / stale through route mte; non-heap memory gets no mte route."""
    import memsem

    pe, n = team.my_pe, team.n_pes
    nb = 64 * 1024
    with _runtime() as rt:
        assert rt.location.attrs["shmem_team"] == team.team_id and rt.location.attrs["shmem_pe"] == pe
        w = rt.alloc(nb, np.uint8, engine="mte")                  # collective
        assert team.in_heap(w.__array_interface__["data"][0], nb)
        w[:] = _pattern(pe, nb)
        ref = rt.publish(w, name=f"w{pe}")
        assert "mte" in rt.publisher.owned[ref.gva].info.descriptors
        priv = rt.publish(np.full(4096, pe, np.uint8), name=f"private{pe}")
        assert "mte" not in rt.publisher.owned[priv.gva].info.descriptors  # not in the symmetric heap
        gathered = peers.allgather("refs", (ref.to_bytes(), priv.to_bytes()))
        refs = {q: rt.ref(b[0]) for q, b in gathered.items() if q != pe}
        privs = {q: rt.ref(b[1]) for q, b in gathered.items() if q != pe}
        for q, r in refs.items():
            route = r.route()
            assert route.kind == "mte", rt.explain(r)
            assert team.team_id in route.reason and route.zero_copy
            assert "cross-memory attach" in rt.explain(r)           # host/cma explicitly excluded
            assert (r.get() == _pattern(q, nb)).all()
            part = r.bytes(1000, 5000).get()
            assert (part == _pattern(q, nb)[1000:6000]).all()
            v = r.view()                                            # aclshmem_ptr: host-usable here
            assert (v == _pattern(q, nb)).all()
            del v
        for q, r in privs.items():
            assert r.route().kind == "host/cma"
            assert "mte" not in rt.resolve(r.spec).info.descriptors   # no mte route offered
        peers.allgather("read", None)
        # put: every PE writes its slot [pe*1024, +1024) of its right neighbour's window
        right = (pe + 1) % n
        refs[right].bytes(pe * 1024, 1024).put(np.full(1024, 200 + pe, np.uint8))
        peers.allgather("put", None)
        left = (pe - 1) % n
        assert (w[left * 1024:(left + 1) * 1024] == 200 + left).all()
        # xcopy: ref -> local, local -> ref, ref -> ref (peer to peer through mapped source)
        dst = np.zeros(2048, np.uint8)
        q1 = right
        q2 = (pe + 2) % n if n > 2 else right
        src_buf = np.arange(512, dtype=np.uint8) ^ pe
        batch = rt.xcopy([(refs[q1].bytes(8192, 2048), dst),
                          (src_buf, refs[q1].bytes(16384 + 512 * pe, 512)),
                          (refs[q2].bytes(60000, 256), refs[q1].bytes(32768 + 256 * pe, 256))])
        res = batch.wait(20)
        assert not batch.errors, batch.errors
        assert all(r.state.name == "DONE" for r in res)
        assert (dst == _pattern(q1, nb)[8192:8192 + 2048]).all()
        peers.allgather("xcopy", None)
        src_pe = (pe - 1) % n
        assert (w[16384 + 512 * src_pe:16384 + 512 * (src_pe + 1)] == (np.arange(512, dtype=np.uint8) ^ src_pe)).all()
        q2_of_src = (src_pe + 2) % n if n > 2 else pe
        assert (w[32768 + 256 * src_pe:32768 + 256 * (src_pe + 1)] == _pattern(q2_of_src, nb)[60000:60256]).all()
        # engine batch (nbi + one quiet); with MEMSEM_SHMEM_EMU_DEFER_NBI=1 a missing quiet shows
        eng = rt.engine("mte")
        remote = rt.resolve(refs[right].spec).remote
        from memsem.engines import Op, OpKind

        got = np.zeros(4096, np.uint8)
        ops = [Op(OpKind.GET, remote, 40000, got),
               Op(OpKind.PUT, remote, 48000 + 128 * pe, np.full(128, 77, np.uint8)),
               Op(OpKind.GET, remote, nb - 10, np.zeros(100, np.uint8))]        # out of range
        req = eng.submit(ops)
        req.wait(20)
        assert [o.state.name for o in ops] == ["DONE", "DONE", "FAILED"], [(o.state, o.error) for o in ops]
        assert isinstance(ops[2].error, ValueError)
        assert (got == _pattern(right, nb)[40000:44096]).all()
        peers.allgather("submit", None)
        assert (w[48000 + 128 * left:48000 + 128 * (left + 1)] == 77).all()
        # stale: republishing bumps the generation; an old ref fails on route mte too
        peers.allgather("before-stale", None)
        old = {q: r for q, r in refs.items()}
        ref2 = rt.publish(w, name=f"w{pe}", replace=True)
        assert ref2.generation != ref.generation
        peers.allgather("republished", None)
        for q, r in old.items():
            with pytest.raises(memsem.StaleReferenceError):
                r.get()
        peers.allgather("stale-done", None)
        # free is refused while published; allowed after unpublish (collective)
        with pytest.raises(memsem.MemsemError, match="unpublish before free"):
            eng.free(w)
        rt.unpublish(ref2)
        peers.allgather("unpublished", None)
        eng.free(w)
    return {"team": team.team_id}


def _scenario_ready(team, peers: Peers) -> dict:
    """Tile-ready events: put_tile = putmem_signal + ready word; owner waits on either."""
    import memsem

    pe, n = team.my_pe, team.n_pes
    tb, tiles = 4096, 2 * (n - 1) + 1
    nb = tb * tiles
    with _runtime() as rt:
        w = rt.alloc(nb, np.uint8, engine="mte")
        ref = rt.publish(w, name="tiles", tile_bytes=tb) if pe == 0 else None
        b = peers.allgather("ref", ref.to_bytes() if ref is not None else None)[0]
        eng = rt.engine("mte")
        if pe == 0:
            desc = rt.publisher.owned[ref.gva].info.descriptors["mte"]
            assert desc.fields["n_sig"] == tiles
            # producers write tiles in reverse order; the owner waits on each SHMEM signal
            for t in reversed(range(tiles - 1)):
                eng.wait_signal(desc, t, ref.generation, timeout=20)
                ref.wait_tile(t, timeout=20)                        # the ready word agrees
                src = 1 + t // 2
                assert (w[t * tb:(t + 1) * tb] == (t * 7 + src) % 256).all()
            assert sorted(ref.ready_tiles()) == list(range(tiles - 1))
            # the last tile is never written: both waits are bounded and say what they waited for
            with pytest.raises(memsem.MemsemTimeoutError, match="signal of tile"):
                eng.wait_signal(desc, tiles - 1, ref.generation, timeout=0.3)
            with pytest.raises(memsem.MemsemTimeoutError):
                ref.wait_tile(tiles - 1, timeout=0.3)
            with pytest.raises(ValueError, match="tile must be"):
                eng.wait_signal(desc, tiles, ref.generation, timeout=0.1)
        else:
            r = rt.ref(b)
            assert r.route().kind == "mte"
            for t in reversed((2 * (pe - 1), 2 * (pe - 1) + 1)):
                r.put_tile(t, np.full(tb, (t * 7 + pe) % 256, np.uint8))
            # a consumer on the same node sees the ready words too
            for t in range(2 * (pe - 1), 2 * pe):
                r.wait_tile(t, timeout=20)
        peers.allgather("done", None)
    return {}


def _scenario_pipeline(team, peers: Peers) -> dict:
    pe, n = team.my_pe, team.n_pes
    tb = 8192
    nb = tb * 6 + 100
    with _runtime() as rt:
        w = rt.alloc(nb, np.uint8, engine="mte")
        w[:] = _pattern(pe, nb, salt=5)
        ref = rt.publish(w, name=f"p{pe}", tile_bytes=tb)
        for t in range(ref.num_tiles(tb)):
            ref.mark_ready(t)
        refs = {q: rt.ref(b) for q, b in peers.allgather("ref", ref.to_bytes()).items() if q != pe}
        modes = {}
        for q, r in refs.items():
            assert r.route().kind == "mte"
            for zc in (None, False):
                chunks = []
                with rt.pipeline(r, tile_bytes=tb, depth=2, zero_copy=zc, timeout=20) as p:
                    for tile in p:
                        with tile:
                            chunks.append(np.array(tile.array, copy=True).reshape(-1).view(np.uint8))
                    modes[zc] = p.mode
                assert (np.concatenate(chunks) == _pattern(q, nb, salt=5)).all()
        peers.allgather("done", None)
    return {"modes": {str(k): v for k, v in modes.items()}}


def _scenario_bad_input(team, peers: Peers) -> dict:
    import memsem
    from memsem.engines import Descriptor
    from memsem.engines.mte._engine import _MteRemote

    pe, n = team.my_pe, team.n_pes
    with _runtime() as rt:
        eng = rt.engine("mte")
        w = rt.alloc(4096, np.uint8, engine="mte")
        ref = rt.publish(w, name=f"b{pe}")
        desc = rt.publisher.owned[ref.gva].info.descriptors["mte"]
        f = desc.fields
        # an unmapped peer: aclshmem_ptr gives NULL -> EngineError naming it
        with pytest.raises(memsem.EngineError, match="PE 99") as info:
            eng.attach(Descriptor("mte", {**f, "pe": 99}), 4096)
        assert info.value.name == "aclshmem_ptr"
        with pytest.raises(memsem.EngineError, match="outside the .*symmetric heap") as info:
            eng.attach(Descriptor("mte", {**f, "offset": HEAP - 100}), 4096)
        assert info.value.name == "aclshmem_ptr"
        # another team's window is not ours to attach
        with pytest.raises(memsem.NotSupportedError, match="shmem-0000"):
            eng.attach(Descriptor("mte", {**f, "team": "shmem-0000"}), 4096)
        # a descriptor of another engine is never reinterpreted
        with pytest.raises(ValueError, match="tagged for engine 'host'"):
            eng.attach(Descriptor("host", f), 4096)
        # a range running off the heap end: the library's own check, named
        peer = (pe + 1) % n
        r = _MteRemote(eng, HEAP, peer, team.heap_base + HEAP - 4096, 0, True, -1, 0)
        with pytest.raises(memsem.EngineError, match="outside the symmetric heap") as info:
            eng.get(r, 0, np.zeros(8192, np.uint8))
        assert info.value.name == "aclshmemx_getmem_on_stream"
        with pytest.raises(memsem.EngineError) as info:
            eng.put(r, 0, np.zeros(8192, np.uint8))
        assert info.value.name == "aclshmemx_putmem_on_stream"
        with pytest.raises(ValueError, match="outside the region"):
            eng.get(r, HEAP - 10, np.zeros(100, np.uint8))
        # put_signal on a window without tiles
        good = eng.attach(desc, 4096)
        with pytest.raises(memsem.NotSupportedError, match="no SHMEM signal words"):
            eng.put_signal(good, 0, np.zeros(16, np.uint8), 0, 1)
        good.close()
        # a non-collective (asymmetric) allocation is refused by the library, named
        with pytest.raises(memsem.EngineError, match="asymmetric") as info:
            rt.alloc(100 * (pe + 1), np.uint8, engine="mte")
        assert info.value.name == "aclshmem_calloc"
        # the heap is full
        with pytest.raises(memsem.OutOfMemoryError, match="symmetric heap"):
            rt.alloc(2 * HEAP, np.uint8, engine="mte")
        # an engine without memory of its own
        with pytest.raises(memsem.NotSupportedError, match="'host' has no memory"):
            rt.alloc(16, np.uint8, engine="host")
        # a second team in one process
        with pytest.raises(memsem.MemsemError, match="already"):
            from memsem.engines.mte import init_team

            init_team(0, 1, b"\0" * 136, HEAP)
        peers.allgather("done", None)
    return {}


SCENARIOS = {"data": _scenario_data, "ready": _scenario_ready, "pipeline": _scenario_pipeline,
             "bad": _scenario_bad_input}


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("n", [2, 4])
def test_get_put_view_xcopy_through_mte(emu_lib: str, n: int) -> None:
    results = run_pes(emu_lib, n, "data")
    assert len({r["team"] for r in results.values()}) == 1


def test_deferred_completion_needs_the_quiet(emu_lib: str) -> None:
    # nbi / on-stream operations complete only at quiet: a missing quiet would fail the checks
    run_pes(emu_lib, 2, "data", env={"MEMSEM_SHMEM_EMU_DEFER_NBI": "1"})


@pytest.mark.parametrize("n", [2, 4])
def test_tile_ready_through_put_signal(emu_lib: str, n: int) -> None:
    run_pes(emu_lib, n, "ready")


@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_through_mte(emu_lib: str, n: int) -> None:
    results = run_pes(emu_lib, n, "pipeline")
    assert results[0]["modes"] == {"None": "view", "False": "staged"}


def test_bad_input_is_named(emu_lib: str) -> None:
    run_pes(emu_lib, 2, "bad")


# --------------------------------------------------------------------------- no team / no library
def _stub_lib(tmp_path: pathlib.Path, names: list[str]) -> str:
    src = tmp_path / "libshmem_stub.c"
    src.write_text("".join(f"void {nm}(void) {{}}\n" for nm in names))
    out = tmp_path / "libshmem_stub.so"
    subprocess.run([os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", str(out), str(src)],
                   check=True, timeout=60)
    return str(out)


def test_library_missing_a_symbol_is_named(emu_lib: str, tmp_path: pathlib.Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import memsem
    from memsem.engines.mte import _binding as _aclshmem
    from memsem.engines.mte import MteEngine

    names = [nm for nm in _aclshmem.required_symbols() if nm != "aclshmemx_putmem_signal"]
    monkeypatch.setenv("MEMSEM_SHMEM_LIB", _stub_lib(tmp_path, names))
    avail = MteEngine.probe()
    assert not avail and "'aclshmemx_putmem_signal'" in avail.reason
    with pytest.raises(memsem.NotSupportedError, match="aclshmemx_putmem_signal"):
        memsem.Runtime(engines=("loopback", "host", "mte"))


def test_probe_names_the_test_double_and_needs_a_team(emu_lib: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import memsem
    from memsem.engines.mte import MteEngine

    for var in ("MEMSEM_SHMEM_LIB", "SHMEM_HOME_PATH", "ASCEND_HOME_PATH"):
        monkeypatch.delenv(var, raising=False)
    avail = MteEngine.probe()
    assert not avail and "not found" in avail.reason
    monkeypatch.setenv("MEMSEM_SHMEM_LIB", emu_lib)
    avail = MteEngine.probe()
    assert avail and "TEST DOUBLE" in avail.reason and emu_lib in avail.reason
    with pytest.raises(memsem.NotSupportedError, match="init_team"):
        memsem.Runtime(engines=("loopback", "host", "mte"))


def test_topo_says_test_double_or_why_not(emu_lib: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEMSEM_SHMEM_LIB", "SHMEM_HOME_PATH", "ASCEND_HOME_PATH")}
    out = subprocess.run([sys.executable, "-m", "memsem.cli", "topo"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("mte "))
    assert "unavailable" in line and "not found" in line, line
    env["MEMSEM_SHMEM_LIB"] = emu_lib
    out = subprocess.run([sys.executable, "-m", "memsem.cli", "topo"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("mte "))
    assert "available" in line and "TEST DOUBLE" in line, line


def test_init_team_argument_checks(emu_lib: str) -> None:
    from memsem.engines.mte import init_team

    with pytest.raises(ValueError, match="my_pe"):
        init_team(2, 2, b"\0" * 136, HEAP, lib_path=emu_lib)
    with pytest.raises(ValueError, match="136 bytes"):
        init_team(0, 1, b"short", HEAP, lib_path=emu_lib)
    with pytest.raises(TypeError, match="uniqueid"):
        init_team(0, 1, "not bytes", HEAP, lib_path=emu_lib)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine_type"):
        init_team(0, 1, b"\0" * 136, HEAP, engine_type="pcie", lib_path=emu_lib)
