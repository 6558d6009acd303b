"""What a newcomer trips on (issue 40), the items in the runtime's and the data path's files: the
API that takes a name returns the kind the name holds, and errors say why and point at the fix.
"""
from __future__ import annotations

import numpy as np
import pytest

import memsem
from memsem import AccessDeniedError, StateDictRef, TensorRef, WindowNotFoundError


@pytest.fixture
def rt():
    with memsem.Runtime(timeout=5) as r:
        yield r


def test_lookup_of_a_state_dicts_name_returns_a_state_dict_ref(rt):
    sd = {"w": np.arange(12, dtype=np.float32), "b": np.ones(3, np.int8)}
    pub = rt.publish_state_dict(sd, name="policy")
    with memsem.Runtime(timeout=5) as other:
        ref = other.lookup("policy")
        assert type(ref) is StateDictRef and ref.layout.names == pub.layout.names
        into = {k: np.zeros_like(v) for k, v in sd.items()}
        assert ref.load(into) == 1
        assert all((into[k] == v).all() for k, v in sd.items())
        assert type(other.ref(ref.to_bytes())) is StateDictRef  # bytes: the same kind


def test_lookup_of_a_plain_window_returns_a_tensor_ref(rt):
    rt.publish(np.arange(64, dtype=np.uint8), name="bytes")
    rt.publish(np.zeros(4, np.uint8), name="tiny")  # shorter than any state dict's header
    rt.publish(np.zeros(16, np.float32), name="floats")
    with memsem.Runtime(timeout=5) as other:
        for name in ("bytes", "tiny", "floats"):
            assert type(other.lookup(name)) is TensorRef, name


def test_a_put_through_a_read_only_ref_says_why(rt):
    ref = rt.publish(np.zeros(16, np.float32), slots=2)
    with memsem.Runtime(timeout=5) as other:
        r = other.ref(ref.to_bytes())
        with pytest.raises(AccessDeniedError) as ei:
            r.put(np.ones(16, np.float32))
        msg = str(ei.value)
        assert "read-only" in msg and "slots=2" in msg and "write section" in msg
        got = other.xcopy([(np.ones(16, np.float32), r)]).wait(5)[0]  # the same message on every path
        assert isinstance(got.error, AccessDeniedError) and "slots=2" in str(got.error)


def test_a_window_unpublished_here_is_not_a_job_question(rt):
    ref = rt.publish(np.zeros(16, np.float32), name="gone")
    rt.unpublish(ref)
    out = np.empty(16, np.float32)
    with pytest.raises(WindowNotFoundError) as ei:
        ref.get(out)
    msg = str(ei.value)
    assert "this runtime" in msg and "unpublished it" in msg and "MEMSEM_JOB" not in msg


# -- names: one rule in every runtime --------------------------------------------------------------
def test_the_same_runtime_republishing_a_name_needs_replace(rt):
    a = rt.publish(np.arange(8, dtype=np.float32), name="w")
    with pytest.raises(memsem.NameHeldError, match=r"held by this runtime.*replace=True") as ei:
        rt.publish(np.zeros(8, np.float32), name="w")
    assert ei.value.name == "w"
    assert (a.get() == np.arange(8, dtype=np.float32)).all()  # refused: the first window is untouched
    b = rt.publish(np.full(4, 7, np.int32), name="w", replace=True)  # explicit: a republish
    with pytest.raises(memsem.StaleReferenceError):
        a.get()
    assert (rt.lookup("w").get() == 7).all() and b.generation != a.generation
    sd = rt.publish_state_dict({"x": np.ones(3, np.float32)}, name="sd")
    with pytest.raises(memsem.NameHeldError):
        rt.publish_state_dict({"x": np.ones(3, np.float32)}, name="sd")
    assert sd.version() == 1
    rt.unpublish("w")
    rt.publish(np.zeros(2, np.uint8), name="w")  # unpublished first: free again
    rt.publish_fields({"x": np.zeros((4, 2), np.float32)}, name="batch")
    with pytest.raises(memsem.NameHeldError, match="batch/x"):
        rt.publish_fields({"x": np.zeros((4, 2), np.float32)}, name="batch")
    fs = rt.publish_fields({"x": np.ones((4, 2), np.float32)}, name="batch", replace=True)  # each step's batch
    assert (fs["x"].get() == 1).all()


# -- lockstep: the writer waits until its readers hold version v -------------------------------------
def _reader(name, reader, steps, loaded, go):
    """A rollout: follows ``name`` in its own runtime, one version per ``go`` event; closes its
    follower at the last event."""
    with memsem.Runtime(timeout=10) as r, r.follow(name, reader=reader, timeout=10) as f:
        for i in range(steps):
            go[i].wait(10)
            v, _ = f.next()
            loaded.append((reader, v))
        go[steps].wait(10)


def test_wait_loaded_returns_when_the_named_readers_hold_the_version(rt):
    import threading

    sd = rt.publish_state_dict({"w": np.zeros(16, np.float32)}, name="policy")
    loaded: list = []
    go = [threading.Event() for _ in range(3)]
    ts = [threading.Thread(target=_reader, args=("policy", f"rollout-{i}", 2, loaded, go)) for i in range(2)]
    for t in ts:
        t.start()
    go[0].set()
    assert rt.wait_loaded(sd, 1, readers=["rollout-0", "rollout-1"], timeout=10) == {"rollout-0": 1, "rollout-1": 1}
    v = sd.update({"w": np.ones(16, np.float32)})
    assert v == 2
    with pytest.raises(memsem.MemsemTimeoutError) as ei:  # nobody loaded 2 yet (go[1] not set)
        rt.wait_loaded(sd, 2, readers=["rollout-0", "rollout-1", "rollout-9"], timeout=0.3)
    msg = str(ei.value)
    assert "rollout-0 (at version 1)" in msg and "rollout-1 (at version 1)" in msg
    assert "rollout-9 (no version loaded)" in msg
    go[1].set()
    held = rt.wait_loaded("policy", 2, n=2, timeout=10)
    assert held == {"rollout-0": 2, "rollout-1": 2}
    go[2].set()
    for t in ts:
        t.join(10)
    assert sorted(loaded) == [("rollout-0", 1), ("rollout-0", 2), ("rollout-1", 1), ("rollout-1", 2)]
    # the followers closed: their records went with them
    with pytest.raises(memsem.MemsemTimeoutError, match=r"0 of 1 readers"):
        rt.wait_loaded(sd, 2, n=1, timeout=0.2)


def test_a_record_of_an_older_generation_never_counts(rt):
    rt.publish(np.zeros(4, np.float32), name="t", slots=2)
    with memsem.Runtime(timeout=5) as r, r.follow("t", reader="r0", timeout=5) as f:
        assert f.next()[0] == 1
        assert rt.wait_loaded("t", 1, readers=["r0"], timeout=5) == {"r0": 1}
        new = rt.publish(np.ones(4, np.float32), name="t", slots=2, replace=True)
        with pytest.raises(memsem.MemsemTimeoutError, match=r"r0 \(no version loaded\)"):
            rt.wait_loaded(new, 1, readers=["r0"], timeout=0.3)
        assert f.next()[0] == 1 and f.generation == new.generation  # the follower moved on to the new window
        assert rt.wait_loaded(new, 1, readers=["r0"], timeout=5) == {"r0": 1}


def test_a_reader_in_another_process_acknowledges(rt, tmp_path):
    import subprocess
    import sys

    sd = rt.publish_state_dict({"w": np.arange(6, dtype=np.float32)}, name="policy")
    code = ("import memsem\n"
            "with memsem.Runtime(timeout=20) as r, r.follow('policy', reader='far', timeout=20) as f:\n"
            "    v, t = f.next()\n"
            "    assert list(t['w']) == [0, 1, 2, 3, 4, 5], t\n"
            "    input()\n")  # holds the follower open until the test says so
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
    try:
        assert rt.wait_loaded(sd, 1, readers=["far"], timeout=30) == {"far": 1}
        p.communicate("\n", timeout=30)
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"readers": ["a"], "n": 1}, ValueError, "exactly one of readers"),
    ({}, ValueError, "exactly one of readers"),
    ({"readers": "a"}, TypeError, "sequence of reader names"),
    ({"readers": []}, ValueError, "at least one reader"),
    ({"readers": ["bad name"]}, ValueError, r"readers\[\] must be 1..48 characters"),
    ({"n": 0}, ValueError, "n"),
])
def test_wait_loaded_refuses_bad_arguments(rt, kwargs, err, match):
    sd = rt.publish_state_dict({"w": np.zeros(2, np.float32)}, name="policy")
    with pytest.raises(err, match=match):
        rt.wait_loaded(sd, 1, **kwargs)


def test_wait_loaded_refuses_a_version_before_the_first_and_an_unnamed_ref(rt):
    sd = rt.publish_state_dict({"w": np.zeros(2, np.float32)}, name="policy")
    with pytest.raises(ValueError, match="version must be >= 1"):
        rt.wait_loaded(sd, 0, n=1)
    with pytest.raises(ValueError, match="named window"):
        rt.wait_loaded(rt.publish(np.zeros(2, np.float32)), 1, n=1)
    with pytest.raises(ValueError, match="reader must be 1..48"):
        rt.follow("policy", reader="a/b")


def test_a_followers_record_outlives_the_follower_and_goes_with_its_runtime(rt):
    """A rollout that loads the last version and leaves its loop (closed, or dropped unclosed by
    an exception) still holds that version: the writer waiting for it afterwards sees it (the
    order forced here: the follower ends before the writer waits). The record goes when the
    reader's runtime closes; nothing of it stays in the job's directory."""
    import gc

    from memsem.sync import _acks

    sd = rt.publish_state_dict({"w": np.zeros(4, np.float32)}, name="policy")

    def records() -> dict:
        return rt.directory.entries(_acks.prefix("policy"))

    with memsem.Runtime(timeout=5) as r:
        f = r.follow("policy", reader="dropped", timeout=5)
        assert f.next()[0] == 1 and set(records()) == {_acks.prefix("policy") + "dropped"}
        del f
        gc.collect()
        assert rt.wait_loaded(sd, 1, readers=["dropped"], timeout=5) == {"dropped": 1}
        sd.update({"w": np.ones(4, np.float32)})
        with r.follow("policy", reader="closed", timeout=5) as g:
            assert g.next()[0] == 2
        assert rt.wait_loaded(sd, 2, readers=["closed"], timeout=5) == {"closed": 2}
        with pytest.raises(memsem.MemsemTimeoutError, match=r"dropped \(at version 1\)"):
            rt.wait_loaded(sd, 2, readers=["closed", "dropped"], timeout=0.2)  # 1 never counts for 2
        assert len(records()) == 2
    assert records() == {}  # the reader's runtime closed: its records went with it
    with pytest.raises(memsem.MemsemTimeoutError, match=r"closed \(no version loaded\)"):
        rt.wait_loaded(sd, 2, readers=["closed"], timeout=0.2)
    assert sd.version() == 2


def test_a_republished_name_keeps_one_record_per_reader(rt):
    """A follower of a name whose window is replaced keeps one record: the new generation's."""
    from memsem.sync import _acks

    rt.publish(np.zeros(4, np.float32), name="t", slots=2)
    with memsem.Runtime(timeout=5) as r, r.follow("t", reader="r0", timeout=5) as f:
        assert f.next()[0] == 1
        new = rt.publish(np.ones(4, np.float32), name="t", slots=2, replace=True)
        assert f.next()[0] == 1 and f.generation == new.generation
        recs = rt.directory.entries(_acks.prefix("t"))
        assert [rec["generation"] for rec in recs.values()] == [new.generation]


def test_a_dead_readers_record_is_collected(rt):
    """A reader killed (SIGKILL: nothing of it runs again) leaves its acknowledgement; the next
    runtime on the node removes it (memsem.core._gc), so no job folder is kept by it."""
    import subprocess
    import sys

    from memsem.core import _gc
    from memsem.sync import _acks

    rt.publish_state_dict({"w": np.zeros(4, np.float32)}, name="policy")
    code = ("import memsem, os, signal\n"
            "r = memsem.Runtime(timeout=20)\n"
            "f = r.follow('policy', reader='killed', timeout=20)\n"
            "f.next()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert p.returncode == -9
    entries = rt.directory.entries(_acks.prefix("policy"))
    assert list(entries) == [_acks.prefix("policy") + "killed"]  # left by the dead reader
    report = _gc.collect()
    # gone now, and only a collect removes a dead process's record (this one, or one of another
    # runtime of this node that ran first: then this report does not name it)
    assert rt.directory.entries(_acks.prefix("policy")) == {}, list(report)
