"""Write sections, versions, pinned leases, write guards, names across processes.

Orders are forced (a reader is known to be waiting once the runtime counted its busy retry; a
writer is known to be waiting once the lease it waits on is seen pinned), never hoped for, and
every wait has a timeout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import memsem
from tests._proc import SeenLock
from tests._proc import until as _until
from tests.conftest import run_children


# -- single slot ---------------------------------------------------------------------------------
def test_single_slot_reader_waits_for_the_section_and_gets_the_new_version(rt):
    a = np.zeros(1 << 16, np.uint8)
    ref = rt.publish(a, name="w")
    assert ref.version() == 1
    with memsem.Runtime(timeout=20.0) as reader_rt:
        r = reader_rt.ref(ref.to_bytes())
        sec = rt.write_section(ref)
        assert sec.version == 2
        got = {}

        def read():
            got["v"] = reader_rt.transfers.transfer(r.spec, False, 0, out.ctypes.data, out.nbytes, out)

        out = np.empty_like(a)
        t = threading.Thread(target=read)
        t.start()
        _until(lambda: reader_rt.stats().errors.get("busy", 0) > 3, what="the reader's busy retries")
        assert t.is_alive()  # it waits for the section: no bytes returned while it is open
        sec.array()[:] = 7
        sec.commit()
        t.join(20)
        assert not t.is_alive()
        assert got["v"] == 2 and (out == 7).all()
        assert r.version() == 2


def test_single_slot_busy_past_the_timeout_is_a_typed_error(rt):
    ref = rt.publish(np.zeros(64, np.uint8))
    with memsem.Runtime(timeout=0.2) as other:
        r = other.ref(ref.to_bytes())
        with rt.write_section(ref):
            with pytest.raises(memsem.MemsemTimeoutError, match="write section"):
                r.get()
        assert r.get().sum() == 0


def test_raising_body_publishes_nothing_single_slot_then_next_section_recovers(rt):
    ref = rt.publish(np.zeros(8, np.int64), name="w")
    with pytest.raises(RuntimeError):
        with rt.write_section(ref) as s:
            s.array()[:4] = 1
            raise RuntimeError("half written")
    assert ref.version() == 1
    with memsem.Runtime(timeout=0.2) as other:
        with pytest.raises(memsem.MemsemTimeoutError):
            other.ref(ref.to_bytes()).get()  # half-written bytes are never returned
    with rt.write_section(ref) as s:
        s.array()[:] = 3
    assert ref.version() == 2 and (ref.get() == 3).all()


# -- two slots ------------------------------------------------------------------------------------
def test_double_buffered_readers_keep_reading_latest_while_next_is_written(rt):
    ref = rt.publish(np.full(1000, 1.0, np.float32), slots=2, name="w")
    assert ref.access == "r"
    with memsem.Runtime(timeout=5.0) as other:
        r = other.ref(ref.to_bytes())
        with rt.write_section(ref) as s:
            assert s.copied and (s.array() == 1.0).all()  # filled with the latest version first
            s.array()[:] = 2.0
            got = r.get()  # not blocked: version 1 is in the other slot
            assert (got == 1.0).all() and r.version() == 1
            assert other.stats().errors.get("busy", 0) == 0
        assert r.version() == 2 and (r.get() == 2.0).all()
        assert (r.get(version=1) == 1.0).all()  # still in its slot
        with rt.write_section(ref) as s:
            s.array()[:] += 1
        with pytest.raises(memsem.StaleReferenceError) as ei:
            r.get(version=1)
        assert ei.value.expected == 1 and ei.value.found == 3
        assert "version 1" in str(ei.value) and "version 3" in str(ei.value)


def test_double_buffered_raising_body_keeps_latest_readable(rt):
    ref = rt.publish(np.arange(10, dtype=np.int32), slots=2)
    with pytest.raises(ValueError):
        with rt.write_section(ref) as s:
            s.array()[:] = -1
            raise ValueError("x")
    assert ref.version() == 1 and (ref.get() == np.arange(10)).all()
    with rt.write_section(ref, copy=False) as s:
        s.array()[:] = 5
    assert ref.version() == 2 and (ref.get() == 5).all()


def test_slots_argument_checks(rt):
    with pytest.raises(ValueError, match="slots"):
        rt.publish(np.zeros(4), slots=3)
    with pytest.raises(ValueError, match="slots=2"):
        rt.publish(np.zeros(4), slots=2, access="rw")
    with pytest.raises(ValueError, match="write_guard"):
        rt.publish(np.zeros(4), write_guard="loud")
    with pytest.raises(ValueError, match="protect"):
        rt.publish(np.zeros(4), write_guard="protect")  # private memory: cannot be protected
    ref = rt.publish(np.zeros(4), slots=2)
    with pytest.raises(memsem.NotSupportedError, match="double-buffered"):
        ref.view()
    with rt.write_section(ref):
        with pytest.raises(memsem.MemsemError, match="already open"):
            rt.write_section(ref)


# -- pinned leases and the writer -----------------------------------------------------------------
def test_pinned_version_holds_the_writer_until_released(rt):
    ref = rt.publish(np.zeros(256, np.float64), slots=2, name="w")
    with memsem.Runtime(timeout=10.0) as other:
        r = other.ref(ref.to_bytes())
        lease = r.pin()
        assert lease.version == 1
        with rt.write_section(ref) as s:  # version 2: the other slot, never waits for the pin
            s.array()[:] = 2
        assert s.blocked_s == 0.0
        with pytest.raises(memsem.LeaseHeldError, match="version"):
            rt.write_section(ref, timeout=0.05)  # version 3 overwrites the pinned version 1
        done = {}
        released = threading.Event()

        def write():
            with rt.write_section(ref, timeout=20.0) as s:
                s.array()[:] = 3
            done["after_release"] = released.is_set()  # it could not open before the pin went
            done["blocked"] = s.blocked_s

        t = threading.Thread(target=write)
        t.start()
        # the writer announced its intent: a new pin of version 1 backs off now
        _until(lambda: ref.version() == 2 and _writer_intent(rt, ref) == 3, what="the writer's intent")
        assert (r.get(version=1, lease=lease) == 0).all()  # the pinned reader is never blocked
        released.set()  # set first: a writer that finished before this point broke the pin
        lease.release()
        t.join(20)
        assert not t.is_alive() and done["after_release"], done
        assert r.version() == 3 and (r.get() == 3).all()


def _writer_intent(rt, ref):
    from memsem.gva._control_block import W_WRITER

    return rt.publisher.owned[ref.spec.gva].cb.word(W_WRITER)


def test_single_slot_pin_blocks_the_writer_and_expiry_frees_it(rt):
    ref = rt.publish(np.zeros(64, np.uint8))
    lease = ref.pin(ttl=0.3)
    t0 = time.monotonic()
    with rt.write_section(ref, timeout=20) as s:
        pass
    assert s.blocked_s > 0 and time.monotonic() - t0 >= 0.25  # never longer than the lease
    assert lease.expired()


def test_pin_of_a_gone_version_names_both(rt):
    ref = rt.publish(np.zeros(8), slots=2)
    for _ in range(3):
        with rt.write_section(ref):
            pass
    with pytest.raises(memsem.StaleReferenceError) as ei:
        ref.pin(version=2)
    assert ei.value.expected == 2 and ei.value.found == 4
    future = ref.pin(version=6)  # a reservation of a version not written yet
    for _ in range(3):  # 5, 6 (the reserved one), 7: none overwrites version 6
        with rt.write_section(ref, timeout=5):
            pass
    with pytest.raises(memsem.LeaseHeldError):
        rt.write_section(ref, timeout=0.05)  # 8 would overwrite 6
    future.release()


# -- waiting for versions -------------------------------------------------------------------------
def test_wait_version_woken_by_commit(rt):
    ref = rt.publish(np.zeros(8), slots=2, name="w")
    with memsem.Runtime(timeout=10.0) as other:
        r = other.ref(ref.to_bytes())
        assert r.wait_version(1, timeout=0) == 1
        with pytest.raises(memsem.MemsemTimeoutError, match="version 2"):
            r.wait_version(2, timeout=0.05)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("v", r.wait_version(3, timeout=20)))
        t.start()
        for _ in range(2):
            with rt.write_section(ref):
                pass
        t.join(20)
        assert got["v"] == 3


def test_wait_version_async_and_retire_is_stale(rt):
    import asyncio

    ref = rt.publish(np.zeros(8), slots=2, name="w")
    with memsem.Runtime(timeout=10.0) as other:
        r = other.ref(ref.to_bytes())

        async def main():
            fut = asyncio.ensure_future(r.wait_version_async(2, timeout=20))
            await asyncio.sleep(0)
            with rt.write_section(ref):
                pass
            return await fut

        assert asyncio.run(main()) == 2
        rt.unpublish(ref)
        with pytest.raises(memsem.StaleReferenceError):
            r.wait_version(5, timeout=5)


# -- write guards ---------------------------------------------------------------------------------
def test_checksum_guard_catches_an_owner_write_outside_a_section(rt):
    a = np.zeros(4096, np.uint8)
    ref = rt.publish(a, write_guard="checksum")
    with rt.write_section(ref) as s:
        s.array()[:] = 1
    a[10] = 99  # outside a section
    with pytest.raises(memsem.OwnerWriteError, match="outside a write section"):
        rt.write_section(ref)
    with rt.write_section(ref):  # reported once; sections work again
        pass


_PROTECT_CHILD = r"""
import sys, numpy as np, memsem
with memsem.Runtime() as rt:
    ref = rt.publish(np.zeros(100, np.float32), slots=2, write_guard="protect")
    o = rt.publisher.owned[ref.spec.gva]
    with rt.write_section(ref) as s:
        s.array()[:] = 1          # inside a section: fine
    print("inside ok", flush=True)
    if sys.argv[1] == "outside":
        o.slot_array(0)[0] = 5    # outside: the slot is read-only -> SIGSEGV
    print("end", flush=True)
"""


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_protect_guard_faults_an_owner_write_outside_a_section(where):
    cp = subprocess.run([sys.executable, "-c", _PROTECT_CHILD, where], capture_output=True, text=True,
                        timeout=120, env=dict(os.environ))
    assert "inside ok" in cp.stdout
    if where == "inside":
        assert cp.returncode == 0 and "end" in cp.stdout, cp.stderr
    else:
        assert cp.returncode == -signal.SIGSEGV and "end" not in cp.stdout


# -- a set of windows ----------------------------------------------------------------------------
def test_section_over_a_set_of_windows(rt):
    a = rt.publish(np.zeros(16), name="a", slots=2)
    b = rt.publish(np.zeros(16), name="b")
    with rt.write_section([a, "b"]) as s:
        assert set(s.versions.values()) == {2}
        for arr in s.arrays():
            arr[:] = 4
    assert a.version() == b.version() == 2
    assert (a.get() == 4).all() and (b.get() == 4).all()
    lease = a.pin()
    with rt.write_section(a):
        pass  # 3
    with pytest.raises(memsem.LeaseHeldError):
        rt.write_section([b, a], timeout=0.05)  # a's 4 is held: nothing opens, b untouched
    assert b.version() == 2
    with rt.write_section(b):
        pass
    lease.release()


# -- names across processes ---------------------------------------------------------------------
def _follow(name, until):
    import hashlib

    import memsem

    with memsem.Runtime(timeout=30.0) as rt:
        sd = rt.lookup_state_dict(name)
        seen = []
        while True:
            dst = sd.empty_like("numpy")
            got = sd.load(dst)
            seen.append((got, hashlib.sha256(dst["w"].tobytes()).hexdigest(), int(dst["step"])))
            if got >= until:
                return seen
            sd.wait_version(got + 1, timeout=30)


def test_versions_followed_by_name_in_other_processes(rt):
    import hashlib

    w = np.zeros(1000, np.float32)
    sd = {"w": w, "step": np.zeros((), np.int64)}
    ref = rt.publish_state_dict(sd, name="policy")
    want = {1: hashlib.sha256(w.tobytes()).hexdigest()}
    results = []
    t = threading.Thread(target=lambda: results.extend(run_children(_follow, [("policy", 4)] * 2, timeout=120)))
    t.start()
    for step in range(2, 5):
        sd["w"][:] = step
        sd["step"][()] = step
        ref.update(sd)
        want[step] = hashlib.sha256(sd["w"].tobytes()).hexdigest()
        time.sleep(0.05)
    t.join(120)
    assert len(results) == 2
    for seen in results:
        assert seen[-1][0] == 4
        for v, digest, step in seen:
            assert digest == want[v] and (step == v or (v == 1 and step == 0))


def test_lookup_of_an_unknown_name(rt):
    with pytest.raises(memsem.WindowNotFoundError):
        rt.lookup("nope")


def test_a_gather_counts_the_bytes_of_its_ranges_not_the_window():
    """``stats().bytes_by_route`` of a multi-range read is what the ranges moved (a reshard
    reader's partial reads are measured by it)."""
    with memsem.Runtime() as owner, memsem.Runtime() as reader:
        ref = owner.publish(np.arange(1 << 16, dtype=np.uint8), name="g", slots=2)
        spec = reader.lookup("g").spec
        dst = np.zeros(300, np.uint8)
        before = sum(reader.stats().bytes_by_route.values())
        ranges = [(0, 100, dst.ctypes.data), (1000, 200, dst.ctypes.data + 100)]
        assert reader.gather(spec, ranges, keep=dst) == 1
        assert sum(reader.stats().bytes_by_route.values()) - before == 300
        assert (dst[:100] == np.arange(100)).all() and (dst[100:] == (np.arange(1000, 1200) % 256)).all()
        del ref


# -- a retire and an open write section -----------------------------------------------------------
@pytest.mark.parametrize("slots", [1, 2])
def test_an_unpublish_from_another_thread_waits_for_the_open_section_then_retires(rt, slots):
    a = rt.alloc(1 << 16, np.uint8) if slots == 1 else np.zeros(1 << 16, np.uint8)
    ref = rt.publish(a, name="w", slots=slots)
    owned = rt.publisher.owned[ref.spec.gva]
    seen = owned.section_lock = SeenLock(owned.section_lock)
    sec = rt.write_section(ref)
    sec.array()[:] = 7
    done = {}

    def unpublish():
        try:
            rt.unpublish(ref, timeout=30)
            done["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported below
            done["exc"] = exc

    t = threading.Thread(target=unpublish)
    t.start()
    assert seen.waiting.wait(30), "the unpublish never waited on the open section"
    assert ref.version() == 1 and not owned.retiring  # the window is untouched while it waits
    sec.array()[:] = 9  # the slot is still mapped and writable: no SIGSEGV
    assert sec.commit() == 2
    t.join(30)
    assert done == {"ok": True}
    assert owned.retiring
    with pytest.raises(memsem.WindowRetiredError):
        ref.version()


def test_an_unpublish_bounded_by_an_open_section_names_it_and_leaves_the_window_live(rt):
    ref = rt.publish(np.zeros(4096, np.uint8), name="w", slots=2)
    with rt.write_section(ref) as sec:
        err = {}
        t = threading.Thread(target=lambda: err.setdefault("e", _raises(lambda: rt.unpublish(ref, timeout=0.2))))
        t.start()
        t.join(30)
        e = err["e"]
        assert isinstance(e, memsem.MemsemTimeoutError), e
        assert "write section open on it in another thread" in str(e) and "stays live" in str(e)
        sec.array()[:] = 3
    assert ref.version() == 2  # the section committed; the window lived on
    np.testing.assert_array_equal(ref.get(), np.full(4096, 3, np.uint8))
    rt.unpublish(ref)  # no section open now: retires at once


def test_an_unpublish_inside_its_own_threads_section_is_refused_at_once(rt):
    ref = rt.publish(np.zeros(4096, np.uint8), name="w", slots=2)
    with rt.write_section(ref) as sec:
        with pytest.raises(memsem.MemsemError, match="inside a write section open on it in this thread"):
            rt.unpublish(ref, timeout=30)
        with pytest.raises(memsem.MemsemError, match="inside a write section open on it in this thread"):
            rt.publish(np.ones(4096, np.uint8), name="w", replace=True)  # a republish retires it too
        sec.array()[:] = 5
    assert ref.version() == 2
    np.testing.assert_array_equal(ref.get(), np.full(4096, 5, np.uint8))


@pytest.mark.parametrize("slots", [1, 2])
def test_a_runtime_closed_inside_a_section_fails_its_commit_without_touching_freed_memory(slots):
    rt = memsem.Runtime(timeout=10.0)
    a = rt.alloc(1 << 20, np.uint8) if slots == 1 else np.zeros(1 << 20, np.uint8)
    ref = rt.publish(a, name="w", slots=slots)
    with pytest.warns(ResourceWarning, match="write section"):
        sec = rt.write_section(ref)
        arr = sec.array()
        t = threading.Thread(target=rt.close, kwargs={"timeout": 0.2})
        t.start()
        t.join(30)
    assert rt.closed
    arr[:] = 1  # the section still holds the slot's memory
    with pytest.raises(memsem.WindowRetiredError, match="retired while this write section was open"):
        sec.commit()
    assert not sec.open


def test_no_section_opens_on_a_window_once_retired(rt):
    from memsem.core._sections import open_sections

    ref = rt.publish(np.zeros(4096, np.uint8), name="w", slots=2)
    owned = rt.publisher.owned[ref.spec.gva]
    rt.unpublish(ref)
    with pytest.raises(memsem.WindowRetiredError, match="no write section opens"):
        open_sections([owned], copy=True, timeout=1.0, telemetry=rt.telemetry)


def _raises(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_a_section_body_that_publishes_while_another_thread_unpublishes_its_window_commits(rt):
    """A retire waits for an open section without holding the publisher's lock: a section body
    that needs it (a publish) goes on, the section commits, then the unpublish retires."""
    a = rt.publish(np.zeros(4096, np.uint8), name="a", slots=2)
    owned = rt.publisher.owned[a.spec.gva]
    seen = owned.section_lock = SeenLock(owned.section_lock)
    done = {}

    def unpublish():
        try:
            rt.unpublish(a, timeout=20)
            done["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported below
            done["exc"] = exc

    with rt.write_section(a) as sec:
        t = threading.Thread(target=unpublish)
        t.start()
        assert seen.waiting.wait(30)  # the unpublish waits for this section
        b = rt.publish(np.ones(16, np.uint8), name="b")  # needs the publisher's lock: not held by the wait
        sec.array()[:] = 4
    t.join(30)
    assert done == {"ok": True}
    assert b.version() == 1
    with pytest.raises(memsem.WindowRetiredError):
        a.version()


@pytest.mark.parametrize("ends", ["leases held: the window stays live", "retired"])
def test_a_section_opened_during_a_retire_waits_for_its_outcome(rt, monkeypatch, ends):
    """A section opened while a retire holds the window waits for the retire's outcome: a retire
    that fails (LeaseHeldError) leaves the window live and the section opens on it; one that
    succeeds ends the wait with WindowRetiredError. The retire's lease wait starts only once the
    section waits (order forced)."""
    from memsem.core import _publish

    ref = rt.publish(np.zeros(4096, np.uint8), name="w", slots=2)
    owned = rt.publisher.owned[ref.spec.gva]
    seen = owned.section_lock = SeenLock(owned.section_lock)
    real = _publish.Publisher._wait_unleased

    def after_the_section_waits(self, o, wait, **kw):
        assert seen.waiting.wait(30)
        return real(self, o, wait, **kw)

    monkeypatch.setattr(_publish.Publisher, "_wait_unleased", after_the_section_waits)
    with memsem.Runtime(timeout=10.0) as other:
        lease = other.ref(ref.to_bytes()).pin(ttl=60)  # a live holder: the retire cannot finish
        out = {}

        def retire():
            try:
                rt.unpublish(ref, timeout=0.2 if ends.startswith("leases") else 30)
            except BaseException as exc:  # noqa: BLE001 - checked below
                out["retire"] = exc

        r = threading.Thread(target=retire)
        r.start()
        _until(lambda: owned.section_thread == _publish.RETIRE_HOLDS, 30, "the retire holding the window")
        if not ends.startswith("leases"):
            threading.Thread(target=lambda: (seen.waiting.wait(30), lease.release())).start()
        try:
            with rt.write_section(ref, timeout=30) as sec:  # waits while the retire holds the window
                sec.array()[:] = 6
            out["section"] = sec.version
        except BaseException as exc:  # noqa: BLE001 - checked below
            out["section"] = exc
        r.join(30)
        if ends.startswith("leases"):
            assert isinstance(out["retire"], memsem.LeaseHeldError), out
            assert out["section"] == 2 and ref.version() == 2  # the window lived on: the section opened
            lease.release()
        else:
            assert "retire" not in out, out
            assert isinstance(out["section"], memsem.WindowRetiredError), out
