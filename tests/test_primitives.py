"""The three primitives every route repeats, written once (issue 20): the copy bracket (its
version range), the one wait (no retry outlives its timeout), and their single homes in the
source.

* A version beyond the range a window can hold (``memsem._args.VERSION_MAX`` = 2**48 - 1) is
  refused at the door of every call that takes a version, and natively by the bracket itself,
  so ``get(version=2**63)`` on a double-buffered window never returns the never-written slot's
  zeros as valid (``seq != version << 1`` wrapped at 2**63).
* An owner committing write sections back to back tears every read of a large window: each
  retrying path (get, get into ``out``, cross-memory attach, a state-dict load, an xcopy range,
  a copy through an engine inside the bracket, a pipeline) ends within its timeout with the
  bytes of one version or ``MemsemTimeoutError``, never a hang.
"""
from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest

import memsem
from memsem import MemsemTimeoutError, native
from memsem._args import VERSION_MAX
from memsem.core import Status
from memsem.engines import HostEngine
from memsem.testing import ScriptedEngine

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "memsem"

#: (value, error type) of versions no API may take
BAD_VERSIONS = [(True, TypeError), (False, TypeError), (1.5, TypeError), ("1", TypeError), (None, TypeError),
                (-1, ValueError), (VERSION_MAX + 1, ValueError), (2**63, ValueError), (2**63 + 1, ValueError),
                (2**64 - 1, ValueError), (2**64, ValueError)]


@pytest.fixture
def rt():
    with memsem.Runtime(timeout=2.0) as r:
        yield r


def _double_buffered(rt, n=4096):
    """A slots=2 window at version 1 whose other slot was never written (all zeros)."""
    return rt.publish(np.full(n, 7, np.uint8), slots=2)


# -- the version's range -----------------------------------------------------------------------
@pytest.mark.parametrize("bad,exc", BAD_VERSIONS)
def test_every_read_path_refuses_a_version_out_of_range(rt, bad, exc):
    ref = _double_buffered(rt)
    sd = rt.publish_state_dict({"w": np.arange(64, dtype=np.float32)})
    out = np.zeros(4096, np.uint8)
    calls = {
        "get": lambda: ref.get(version=bad),
        "get(out=)": lambda: ref.get(out, version=bad),
        "pin": lambda: ref.pin(version=bad),
        "lease": lambda: rt.lease(ref, version=bad),
        "wait_version": lambda: ref.wait_version(bad, timeout=0.1),
        "load": lambda: sd.load(sd.empty_like(), version=bad),
    }
    for what, call in calls.items():
        with pytest.raises(exc, match="version") as ei:
            call()
        assert repr(bad) in str(ei.value) or exc is TypeError, (what, ei.value)
    assert (out == 0).all()


def test_version_2_63_never_reads_the_unwritten_slot(rt):
    """The bracket compared ``seq != version << 1`` in 64 bits: 2**63 << 1 wraps to 0, the
    sequence word of the slot never written, and its zeros came back as version 2**63."""
    ref = _double_buffered(rt)
    res = rt.resolve(ref.spec)
    dst = np.full(4096, 0xAA, np.uint8)
    for v in (2**63, 2**63 + 2, VERSION_MAX + 1, 2**64 - 2):
        rc = native.lib.memsem_plan_copy(res.plan, 0, 0, dst.ctypes.data, dst.nbytes, v, 0, 0)
        assert rc & native.lib.MEMSEM_RC_STATUS_MASK == Status.VERSION_RANGE, hex(rc)
        assert (dst == 0xAA).all(), "the bracket copied bytes for a version out of range"
    assert (ref.get() == 7).all()
    assert ref.get(version=1)[0] == 7


def test_the_largest_version_is_waited_for_not_wrapped():
    """VERSION_MAX itself is a version (not committed yet): waited for, then a timeout; the
    native bracket takes it without wrapping (VERSION_MAX << 1 fits 64 bits)."""
    with memsem.Runtime(timeout=0.3) as rt:
        ref = _double_buffered(rt)
        with pytest.raises(MemsemTimeoutError, match="write section"):
            ref.get(version=VERSION_MAX)
        with pytest.raises(MemsemTimeoutError, match=f"version {VERSION_MAX}"):
            ref.wait_version(VERSION_MAX, timeout=0.2)


def test_numpy_integer_versions_go_through_the_door(rt):
    ref = _double_buffered(rt)
    assert (ref.get(version=np.int64(1)) == 7).all()
    with pytest.raises(ValueError, match="version"):
        ref.get(version=np.uint64(2**63))


# -- no retry outlives its timeout -------------------------------------------------------------
N = 8 << 20


def _storm_owner(conn, n: int) -> None:
    """Publishes single-slot windows (a shared segment, private memory, a state dict) and
    commits write sections on all of them back to back, each version's bytes uniform (the
    version mod 251), until told to stop: every read longer than a section tears."""
    with memsem.Runtime(timeout=30.0) as rt:
        shm = rt.alloc(n, np.uint8)
        priv = np.zeros(n, np.uint8)
        refs = [rt.publish(shm, name="shm", access="r"), rt.publish(priv, name="priv", access="r")]
        sd = rt.publish_state_dict({"a": np.zeros(n // 2, np.uint8), "b": np.zeros(n // 2, np.uint8)},
                                   name="sd", slots=1)
        conn.send([r.to_bytes() for r in refs] + [sd.to_bytes()])
        commits = 0
        while not conn.poll():
            for r in refs:
                with rt.write_section(r, copy=False) as sec:
                    sec.array()[:] = (sec.version % 251)
            with sd.write_section(copy=False) as sec:
                for t in sec.tensors.values():
                    t[...] = sec.version % 251
            commits += 1
        conn.recv()
        conn.send(commits)


def _bounded(call) -> tuple[str, object]:
    """Run ``call`` in a thread; it must end (a hang fails the test, whatever the load)."""
    out: list = []

    def run() -> None:
        try:
            out.append(("ok", call()))
        except BaseException as exc:  # noqa: BLE001 - inspected by the caller
            out.append(("err", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(300)
    assert not t.is_alive(), "a retrying read outlived its timeout by far: it hangs"
    return out[0]


def _one_version(a) -> None:
    a = np.asarray(a).reshape(-1)
    assert (a == a[0]).all(), "bytes of two versions returned as one"


@pytest.mark.multiproc
def test_a_torn_retry_storm_ends_within_the_timeout():
    """Every retrying read path against an owner committing write sections back to back:
    each ends with the bytes of one version or MemsemTimeoutError (the runtime's 0.3 s),
    never a hang; the torn and busy outcomes were counted (the storm was real). A view (and a
    pipeline over a shared segment, which hands out views) pins the version it shows: one
    version, never torn."""
    from tests._proc import reap, recv, spawn

    p, conn = spawn(_storm_owner, N)
    outcomes = {}
    try:
        shm_b, priv_b, sd_b = recv(conn)
        for path in ("get", "get_out", "cma", "xcopy", "engine", "pipeline", "load", "view", "pipeline_view"):
            kw = {"engine_objects": {"host": ScriptedEngine(HostEngine())}} if path == "engine" else {}
            with memsem.Runtime(timeout=0.3, **kw) as rt:
                ref = rt.ref(priv_b if path in ("cma", "pipeline") else shm_b)
                if path == "engine":
                    assert rt.resolve(ref.spec).strategy.kind == "engine"

                def call(path=path, rt=rt, ref=ref):
                    if path in ("get", "cma", "engine"):
                        return ref.get()
                    if path == "get_out":
                        return ref.get(np.empty(N, np.uint8))
                    if path == "xcopy":
                        dst = np.empty(N, np.uint8)
                        (r,) = rt.xcopy([(ref, dst)]).wait(60)
                        if r.error is not None:
                            raise r.error
                        return dst
                    if path == "view":  # pinned: the owner's sections wait while it lives
                        v = ref.view()
                        got = np.array(v)
                        del v
                        return got
                    if path in ("pipeline", "pipeline_view"):  # cma: the native mover; shm: a view
                        parts = []
                        for tile in rt.pipeline(ref, tile_bytes=N):
                            with tile:
                                parts.append(np.array(tile.array))
                        return np.concatenate(parts)
                    sd = memsem.StateDictRef.from_bytes(sd_b, rt)
                    dst = sd.empty_like()
                    sd.load(dst)
                    return np.concatenate([np.asarray(t).reshape(-1) for t in dst.values()])

                kind, val = _bounded(call)
                if kind == "err":
                    assert isinstance(val, MemsemTimeoutError), (path, repr(val))
                    assert val.timeout == 0.3, (path, val)
                else:
                    try:
                        _one_version(val)
                    except AssertionError as exc:
                        raise AssertionError(f"{path}: {exc}") from None
                errs = rt.stats().errors
                outcomes[path] = (kind, errs["torn"] + errs["busy"])
        conn.send("stop")
        assert recv(conn) > 0
    finally:
        reap([p])
    # the storm was real: the copying paths met open and tearing sections (a view pins its
    # version: nothing to tear)
    assert sum(n for path, (_, n) in outcomes.items() if "view" not in path) >= 3, outcomes


# -- one home each -----------------------------------------------------------------------------
def test_the_bracket_protocol_is_named_in_one_module():
    """The last-out flag of the native result word (release the resolution) and the native
    bracket calls are handled only by memsem.core._bracket."""
    homes = {"LAST_OUT": set(), "memsem_bracket_open": set(), "memsem_bracket_close": set()}
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for key in homes:
            if key in text:
                homes[key].add(str(path.relative_to(SRC)))
    for key, files in homes.items():
        assert files == {"core/_bracket.py"}, (key, sorted(files))


def test_no_sleep_polls_in_the_core():
    """Waits sleep on words (the one wait, memsem.core._wait); a plain sleep exists only where
    nothing can be waited on: a lease held in another node's directory (_publish), one-sided
    reads of a remote word (_remote), a rank re-claiming its records in the directory after an
    outage (_liveness.reread: the directory has no word to wait on)."""
    allowed = {"core/_wait.py", "core/_remote.py", "core/_publish.py", "core/_liveness.py"}
    bad = []
    for path in (SRC / "core").glob("*.py"):
        rel = str(path.relative_to(SRC))
        if "time.sleep(" in path.read_text() and rel not in allowed:
            bad.append(rel)
    assert not bad, bad


# -- pins of a watched control block: released exactly once, whatever closes first ---------------
def _watched_grant(rt):
    from memsem.gva import credential_proof, credential_token

    ref = rt.publish(np.zeros(4096, np.uint8), tile_bytes=1024)
    spec = rt.server.mint(ref.spec)
    token, challenge = credential_token(spec), b"c" * 24
    grant = rt.server.open(token, challenge, credential_proof(spec.key, challenge, token))
    return ref, grant


@pytest.mark.parametrize("order", ["subscription first", "hub first", "grant then hub"])
def test_a_watch_releases_its_control_block_pins_once(order):
    """The watch hub, a subscription and a grant each hold pins of a window's control block;
    whichever closes first (a runtime's close closes the hub with subscriptions still open),
    each pin is dropped once: the mapping never goes while a holder remains (a double unpin
    unmapped it under the owner's serving resolution: a segfault at close)."""
    from memsem.core._watches import WATCHABLE_HEADER

    with memsem.Runtime() as rt:
        ref, grant = _watched_grant(rt)
        target = [(0, WATCHABLE_HEADER[0], 1)]
        seg = rt.publisher.owned[ref.gva].cb.segment
        before = seg.holders
        sub = grant.watch(target, lambda: None)
        assert seg.holders == before + 2  # the subscription's pin and the hub's
        hub = rt.server.hub
        if order == "subscription first":
            sub.close()
            hub.close()
        elif order == "hub first":
            hub.close()  # closes the subscription too
            sub.close()
        else:
            grant.close()
            hub.close()
            sub.close()
        assert seg.holders == before and seg.mapped
        if order != "grant then hub":
            grant.close()
