"""Weight sync under fire: the trainer rewrites every tensor in write sections as fast as it can
while 3 rollout processes follow the state dict by name and load every version they can.

Every version fills each tensor with one value derived from the version: a load is torn when
its tensors disagree, or disagree with the version the load reported. Torn loads accepted must
be 0; the ones memsem caught (a copy that raced a section: retried, or waited for) are counted
from the readers' own telemetry.

Bounded by counts (``VERSIONS`` versions), not by wall clock: it passes on a loaded 2-core
machine. ``MEMSEM_SOAK_S=30`` turns it into the 30 s soak of issue 13 (figures printed).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import memsem
from tests.conftest import run_children

VERSIONS = 300
READERS = 3
DTYPES = ("float32", "bfloat16", "int32", "float16", "int64", "uint8")


def _value(v: int) -> int:
    return v % 200 + 1  # exact in every dtype above (bf16 holds integers up to 256)


def _state_dict(n: int = 48) -> dict[str, np.ndarray]:
    from memsem import _dtypes

    out = {}
    rng = np.random.default_rng(0)
    for i in range(n):
        dt = _dtypes.numpy_dtype(_dtypes.code_of(DTYPES[i % len(DTYPES)]))
        shape = (int(rng.integers(1, 64)), int(rng.integers(1, 512)))
        out[f"layer{i}.w"] = np.zeros(shape, dt)
    out["num_batches_tracked"] = np.zeros((), np.int64)
    out["empty"] = np.zeros((0, 3), np.float32)
    return out


def _reader(name: str, last: int) -> dict:

    with memsem.Runtime(timeout=120.0) as rt:
        sd = rt.lookup_state_dict(name)
        dst = sd.empty_like("numpy")
        joined = sd.lease(None).acquire()  # tells the trainer this reader is here (pins nothing)
        loads = accepted_torn = 0
        versions = set()
        while True:
            try:
                v = sd.load(dst)
            except memsem.StaleReferenceError:
                break  # the soak's end: the trainer unpublished
            loads += 1
            vals = {float(a.reshape(-1)[0]) if a.size else None for a in dst.values()} - {None}
            uniform = all((a == a.reshape(-1)[0]).all() for a in dst.values() if a.size)
            want = float(_value(v)) if v > 1 else 0.0
            if not uniform or vals != {want}:
                accepted_torn += 1
            versions.add(v)
            if v >= last:
                break
        joined.release()
        e = rt.stats().errors
        return {"loads": loads, "accepted_torn": accepted_torn, "versions": len(versions),
                "caught_torn": e.get("torn", 0), "caught_busy": e.get("busy", 0)}


@pytest.mark.parametrize("slots", [1, 2])
def test_trainer_rewrites_while_three_rollouts_read(rt, slots):
    import threading

    soak = float(os.environ.get("MEMSEM_SOAK_S", "0") or 0)
    sd = _state_dict()
    ref = rt.publish_state_dict(sd, name="policy", slots=slots)
    # Counts, not time: the readers stop at the last version, known up front. In the opt-in
    # soak the trainer runs MEMSEM_SOAK_S seconds, then unpublishes: the readers stop there.
    last_version = 1 + VERSIONS if not soak else 1 << 40
    results: list = []
    errors: list = []

    def run():
        try:
            results.extend(run_children(_reader, [("policy", last_version)] * READERS, timeout=900))
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    # forced order: the trainer starts once every reader holds its (unpinned) lease
    deadline = time.monotonic() + 300
    while len(rt.lease_holders(ref)) < READERS:
        assert time.monotonic() < deadline and t.is_alive(), f"readers did not join: {errors}"
        time.sleep(0.01)
    t0 = time.monotonic()
    blocked = 0.0
    while True:
        with ref.write_section(copy=False, timeout=60) as sec:
            val = _value(sec.version)
            for a in sec.tensors.values():
                a.fill(val)  # element by element: a reader racing this would see a mixture
        v = sec.version
        blocked += sec.blocked_s
        if v >= last_version or (soak and time.monotonic() - t0 >= soak):
            break
    elapsed = time.monotonic() - t0
    if soak:
        rt.unpublish(ref, timeout=60)
    t.join(900)
    assert not errors, errors[0]
    assert len(results) == READERS
    for r in results:
        assert r["accepted_torn"] == 0, r
        assert r["loads"] >= 1 and r["versions"] >= 1
    caught = sum(r["caught_torn"] + r["caught_busy"] for r in results)
    print(f"\nslots={slots}: {v - 1} versions in {elapsed:.1f} s, trainer blocked {blocked * 1e3:.1f} ms, "
          f"loads {[r['loads'] for r in results]}, torn caught {caught}, accepted 0")
