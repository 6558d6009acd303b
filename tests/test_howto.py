"""The recipes of docs/howto.md, run: the page shows calls that exist and do what it says."""
from __future__ import annotations

import numpy as np
import pytest

import memsem
from memsem.engines.host import HostEngine
from memsem.testing import ScriptedEngine


def test_share_and_follow_versions_of_a_state_dict(memsem_runtime):
    rt = memsem_runtime
    model = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.array(7, np.int64)}
    sd = rt.publish_state_dict(model, name="policy", slots=2)
    with memsem.Runtime(timeout=10.0, engines=["host"]) as other:
        rsd = memsem.StateDictRef.from_bytes(sd.to_bytes(), other)
        local = {k: np.zeros_like(v) for k, v in model.items()}
        v = rsd.load(local)
        assert (local["w"] == model["w"]).all() and int(local["step"]) == 7
        model["w"] += 1
        model["step"] += 1
        v2 = sd.update(model)
        assert v2 == v + 1
        assert rsd.wait_version(v + 1, timeout=10) >= v + 1
        with rsd.pin(version=v + 1) as lease:
            assert rsd.load(local, version=v + 1, lease=lease) == v + 1
        assert (local["w"] == model["w"]).all() and int(local["step"]) == 8
        assert rt.lookup_state_dict("policy").keys() == ("w", "step")


def test_follow_versions_with_the_follower_loop(memsem_runtime):
    """The recipe's loop: a trainer updating, a rollout following by name into its tensors."""
    import threading

    rt = memsem_runtime
    model = {"w": np.zeros((3, 4), np.float32), "step": np.array(0, np.int64)}
    sd = rt.publish_state_dict(model, name="policy", slots=2)
    seen = []
    with memsem.Runtime(timeout=10.0) as rollout:
        local = {k: np.zeros_like(v) for k, v in model.items()}
        follower = rollout.follow("policy", into=local, timeout=30)
        v, params = next(follower)
        assert params is local and v == 1
        done = threading.Event()

        def trainer():
            for step in range(1, 6):
                model["w"][:] = step
                model["step"][()] = step
                sd.update(model)
            done.set()

        t = threading.Thread(target=trainer)
        t.start()
        for version, params in follower:
            assert (params["w"] == params["step"]).all()  # one version, bit-exact
            assert int(params["step"]) == version - 1
            seen.append(version)
            if version == 6:
                break
        t.join(30)
    assert seen[-1] == 6 and seen == sorted(seen)
    # the in-place form: the trainer's tensors are the window's own memory (slots=1)
    inplace = rt.publish_state_dict(model, name="inplace", slots=1)
    params = inplace.tensors()
    with inplace.write_section() as sec:
        sec.tensors["w"][:] = 42  # the same memory as params["w"]
    assert (params["w"] == 42).all() and inplace.get()["w"][0, 0] == 42
    with pytest.raises(ValueError, match="slots=2"):
        sd.tensors()


def test_names_have_one_owner_in_a_job(memsem_runtime):
    rt = memsem_runtime
    rt.publish(np.ones(4), name="policy")
    with memsem.Runtime(timeout=10.0) as other:
        with pytest.raises(memsem.NameHeldError, match="replace=True"):
            other.publish(np.zeros(4), name="policy")
        other.publish(np.zeros(4), name="policy", replace=True)
        assert (rt.lookup("policy", timeout=10).get() == 0).all()


def test_stream_a_batch_of_fields(memsem_runtime):
    rt = memsem_runtime
    fs = rt.publish_fields({"logprobs": ((8, 4), "float32")}, tile_rows=2)
    rows = np.arange(32, dtype=np.float32).reshape(8, 4)
    fs["logprobs"].put_rows(0, rows)
    got = []
    with memsem.FieldSet.from_bytes(fs.to_bytes(), rt)["logprobs"].pipeline(tiles_per_step=2) as p:
        for tile in p:
            with tile:
                got.append(tile.array.copy())
    assert (np.concatenate(got) == rows).all()


def test_scripted_faults_fail_one_range(memsem_runtime):
    ref = memsem_runtime.publish(memsem_runtime.alloc(8192, np.uint8))
    eng = ScriptedEngine(HostEngine(), fail=lambda kind, off, n: off == 4096)
    with memsem.Runtime(timeout=10.0, engines=["host"], engine_objects={"host": eng}) as cons:
        cref = cons.ref(ref.to_bytes())
        batch = cons.xcopy([(cref.bytes(0, 4096), np.empty(4096, np.uint8)),
                            (cref.bytes(4096, 4096), np.empty(4096, np.uint8))])
        states = [r.state.name for r in batch.wait(10)]
        assert states == ["DONE", "FAILED"]
        assert isinstance(batch.errors[1], memsem.EngineError)
        with pytest.raises(memsem.MemsemError, match="1 of 2 ranges failed"):
            batch.raise_for_errors()
