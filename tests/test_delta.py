"""Delta versions (issue 36): a reader holding version v moves only what changed and still holds
exactly v+1, checked against the writer's digests; a real optimizer's bf16 steps, frozen bases
with adapters, synthetic changes of 0 to 100% of elements, readers that skip versions, buffers
changed between versions, a writer killed mid-commit, and a reader on another node (tcp).

Every load is compared bit for bit with the writer's version. The waits are bounded by the
owner's own record of a version (``_recorded``), never by sleeping.
"""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

import memsem
from memsem import native
from memsem.gva import RefSpec
from memsem.sync._delta_format import PAYLOAD_MAX, Tiles, patch_sizes
from tests import _proc

MiB = 1 << 20


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _recorded(ref: memsem.StateDictRef, version: int, timeout: float = 60.0) -> None:
    """Wait for the owner to have recorded ``version`` (its index moves in step with the window)."""
    ref.runtime.wait_version(RefSpec.from_bytes(ref.layout.delta.index), version, timeout)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.asarray(a[k]).view(np.uint8).tobytes() == np.asarray(b[k]).view(np.uint8).tobytes() for k in a)


def _deltas(rt: memsem.Runtime) -> dict:
    return rt.stats().deltas


# -- the native pieces --------------------------------------------------------------------------------
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.05, 0.6, 1.0])
def test_record_then_check_rebuilds_every_tile_bit_exact(itemsize, frac):
    rng = np.random.default_rng(itemsize * 100 + int(frac * 1000))
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    n = 300_001  # not a multiple of a tile: a short last tile, and a tail shorter than 32 bytes
    old = rng.integers(0, 1 << 8 * min(itemsize, 4), n, dtype=np.uint64).astype(dt)
    new = old.copy()
    hit = rng.random(n) < frac
    new[hit] += dt(1)

    class E:  # one tensor of the layout
        nbytes, dtype = old.nbytes, old.dtype

    t = Tiles.of([E], 64 << 10)
    na, oa = t.addresses(np.array([new.ctypes.data], np.uint64)), t.addresses(np.array([old.ctypes.data], np.uint64))
    prev = np.empty(t.n, np.uint64)
    native.digest_tiles(oa.ctypes.data, t.nbytes.ctypes.data, t.n, prev.ctypes.data)
    dg, counts = np.empty(t.n, np.uint64), np.empty(t.n, np.uint32)
    cap = int(PAYLOAD_MAX * old.nbytes)
    out = np.empty(cap, np.uint8)
    lim = t.limits()
    used = native.record_tiles(na.ctypes.data, oa.ctypes.data, t.nbytes.ctypes.data, t.itemsize.ctypes.data,
                               lim.ctypes.data, prev.ctypes.data, t.n, dg.ctypes.data, counts.ctypes.data,
                               out.ctypes.data, cap)
    assert used == int(patch_sizes(counts, t.itemsize).sum())
    changed = np.array([bool(hit[i * t.tile_bytes // itemsize:(i + 1) * t.tile_bytes // itemsize].any())
                        for i in range(t.n)])
    assert ((counts != 0) == changed).all()  # unchanged tiles found unchanged, every changed one found
    # a reader holding the old bytes: the tiles moved whole first, then the patches and the check
    dst = old.copy()
    whole = counts == native.DELTA_DENSE
    for i in np.flatnonzero(whole):
        a, b = i * t.tile_bytes, i * t.tile_bytes + int(t.nbytes[i])
        dst.view(np.uint8)[a:b] = new.view(np.uint8)[a:b]
    sizes = patch_sizes(counts, t.itemsize)
    src = (np.cumsum(sizes) - sizes + np.uint64(out.ctypes.data)).astype(np.uint64)
    da = t.addresses(np.array([dst.ctypes.data], np.uint64))
    wrong = native.check_tiles(da.ctypes.data, t.nbytes.ctypes.data, t.itemsize.ctypes.data, counts.ctypes.data,
                               src.ctypes.data, dg.ctypes.data, t.n)
    assert wrong == 0 and np.array_equal(dst, new)
    if changed.any():  # and a buffer that is not the old version fails the check
        dst2 = old.copy()
        dst2[0] ^= dt(0x5)
        a2 = t.addresses(np.array([dst2.ctypes.data], np.uint64))
        wrong = native.check_tiles(a2.ctypes.data, t.nbytes.ctypes.data, t.itemsize.ctypes.data, 0, 0,
                                   dg.ctypes.data, t.n)
        assert wrong >= 1


@pytest.mark.parametrize("order", ["ascending", "shuffled", "one_past_the_tile"])
def test_the_check_patches_and_digests_in_one_pass_as_patch_then_digest_would(order):
    """check_tiles applies a tile's patch block by block as its digest reaches each block; it
    must equal patching the whole tile first, then digesting it: for ascending indices (the
    writer's), for indices out of order (one falling in a block already digested), and for an
    index past the tile (a mismatch, never written), whatever the element size and the tile's
    tail (sizes that are not whole digest blocks)."""
    rng = np.random.default_rng({"ascending": 1, "shuffled": 2, "one_past_the_tile": 3}[order])
    pad = lambda x: (x + 7) // 8 * 8  # noqa: E731
    for _ in range(150):
        size = int(rng.choice([1, 2, 4, 8]))
        nbytes = int(rng.integers(1, (64 << 10) // size + 1)) * size
        elems = nbytes // size
        a = rng.integers(0, 255, nbytes, dtype=np.uint8)
        ref = a.copy()
        c = int(rng.integers(1, min(elems, 2000) + 1))
        idx = rng.choice(elems, c, replace=False).astype(np.uint16)
        if order == "ascending":
            idx.sort()
        elif order == "shuffled" and c > 1:
            idx.sort()
            i, j = sorted(rng.choice(c, 2, replace=False))
            idx[i], idx[j] = idx[j], idx[i]  # a later entry falls before an earlier one
        elif order == "one_past_the_tile" and elems < 65535:
            idx.sort()
            idx[int(rng.integers(0, c))] = elems + int(rng.integers(0, min(8, 65535 - elems)))
        patch = np.zeros(pad(2 * c) + pad(c * size), np.uint8)
        patch[:2 * c] = idx.view(np.uint8)
        patch[pad(2 * c):pad(2 * c) + c * size] = rng.integers(0, 255, c * size, dtype=np.uint8)
        args = [np.array([nbytes], np.uint64), np.array([size], np.uint32), np.array([c], np.uint32),
                np.array([patch.ctypes.data], np.uint64)]
        bad = native.patch_tiles(np.array([ref.ctypes.data], np.uint64).ctypes.data, *(x.ctypes.data for x in args), 1)
        want = np.array([native.digest(ref.ctypes.data, nbytes)], np.uint64)
        dst = np.array([a.ctypes.data], np.uint64)
        wrong = native.check_tiles(dst.ctypes.data, *(x.ctypes.data for x in args), want.ctypes.data, 1)
        assert np.array_equal(a, ref), (size, nbytes, c)  # the same bytes written, the same left alone
        assert wrong == (1 if bad else 0), (size, nbytes, c, bad)
        if order == "one_past_the_tile" and elems < 65535:
            assert bad == 1 and wrong == 1


def test_a_patch_index_past_its_tile_is_never_written():
    dst = np.zeros(8, np.uint16)
    guard = np.zeros(64, np.uint16)
    patch = np.zeros(16, np.uint8)
    patch[:2] = np.frombuffer(np.uint16(40).tobytes(), np.uint8)  # element 40 of an 8-element tile
    args = [np.array([dst.ctypes.data], np.uint64), np.array([16], np.uint64), np.array([2], np.uint32),
            np.array([1], np.uint32), np.array([patch.ctypes.data], np.uint64)]  # kept alive for the call
    bad = native.patch_tiles(*(a.ctypes.data for a in args), 1)
    assert bad == 1 and not dst.any() and not guard.any()


def test_the_digest_sees_every_single_bit():
    a = np.random.default_rng(1).integers(0, 255, 4096 + 37, dtype=np.uint8)
    seen = {native.digest(a.ctypes.data, a.nbytes)}
    for i in range(0, a.nbytes, 7):
        a[i] ^= 1 << (i % 8)
        seen.add(native.digest(a.ctypes.data, a.nbytes))
        a[i] ^= 1 << (i % 8)
    assert len(seen) == 1 + len(range(0, a.nbytes, 7))
    assert native.digest(a.ctypes.data, a.nbytes) == native.digest(a.ctypes.data, a.nbytes)


@pytest.mark.parametrize("impl", [1, 2], ids=["base", "avx2"])
def test_every_digest_implementation_computes_the_same_function(impl):
    """A writer's digests are compared by readers on other machines: the base (SSE2 / C) and the
    AVX2 bulk must both compute the function written out in tests/_digest_ref.py, at every length
    around the stripe (64 B) and scramble (1 KiB) edges, with and without a seed, through every
    native entry (one buffer; tiles)."""
    from tests._digest_ref import digest as reference

    if native.lib.memsem_digest_impl(impl) != impl:
        native.lib.memsem_digest_impl(0)
        pytest.skip("this CPU has no AVX2" if impl == 2 else "no base implementation")
    try:
        rng = np.random.default_rng(impl)
        sizes = [0, 1, 7, 8, 9, 63, 64, 65, 127, 1023, 1024, 1025, 2048 + 64 + 3, 5000]
        for n in sizes:
            a = rng.integers(0, 256, n, dtype=np.uint8)
            for seed in (0, 0x0123456789ABCDEF):
                assert native.digest(a.ctypes.data, n, seed) == reference(a.tobytes(), seed), (n, seed)
        big = rng.integers(0, 256, 3 << 16, dtype=np.uint8)  # tiles of several sizes, one call
        bounds = np.array([0, 1000, 1000 + 65536, 1000 + 65536 + 64, big.nbytes], np.uint64)
        addr = (bounds[:-1] + np.uint64(big.ctypes.data)).astype(np.uint64)
        nbytes = np.diff(bounds).astype(np.uint64)
        out = np.zeros(len(nbytes), np.uint64)
        native.digest_tiles(addr.ctypes.data, nbytes.ctypes.data, len(nbytes), out.ctypes.data)
        want = [reference(big[int(s):int(e)].tobytes()) for s, e in zip(bounds[:-1], bounds[1:])]
        assert out.tolist() == want
    finally:
        assert native.lib.memsem_digest_impl(0) in (1, 2)


# -- state dicts ---------------------------------------------------------------------------------------
def _model(rng, dtype, sizes=(1 << 20, 3 << 18, 1 << 16, 1000, 7)) -> dict:
    return {f"w{i}": rng.integers(0, 1 << 15, n).astype(np.uint16).view(dtype) if dtype.itemsize == 2
            else rng.standard_normal(n).astype(dtype) for i, n in enumerate(sizes)}


def _change(rng, sd: dict, frac: float) -> float:
    """Change ``frac`` of every tensor's elements (each to another value); returns the fraction
    of all elements that changed."""
    changed = total = 0
    for a in sd.values():
        flat = a.reshape(-1).view(np.uint8).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])
        hit = rng.random(flat.size) < frac
        flat[hit] ^= flat.dtype.type(1)
        changed += int(hit.sum())
        total += flat.size
    return changed / total


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.01, 0.1, 1.0])
def test_synthetic_changes_move_what_changed_bit_exact(rt, dtype, frac):
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    sd = _model(rng, dt)
    ref = rt.publish_state_dict(sd, name="p")
    into = ref.empty_like("numpy")
    v = ref.load(into)
    _change(rng, sd, frac)
    v2 = ref.update(sd)
    _recorded(ref, v2)
    before = _deltas(rt)
    assert ref.load(into, base=v, delta_wait=30) == v2
    assert _same(into, sd)
    after = _deltas(rt)
    moved = after["bytes_moved"] - before["bytes_moved"]
    loaded = after["bytes_loaded"] - before["bytes_loaded"]
    ratio = moved / loaded
    if frac == 1.0:  # nothing to save: a full load, never more
        assert after["loads_full"] == before["loads_full"] + 1 and ratio == 1.0
        return
    assert after["loads_delta"] == before["loads_delta"] + 1
    # patches: 2 bytes of index per changed element beside its value, plus the record's tables
    per = (2 + dt.itemsize) / dt.itemsize
    assert ratio <= 2 * per * frac + 0.01, (ratio, frac)
    if dtype == "bfloat16" and frac == 0.01:
        assert ratio <= 0.05  # the goal, indices included


def test_a_frozen_base_with_small_adapters_moves_the_adapters(rt):
    rng = np.random.default_rng(3)
    sd = {f"base.{i}": rng.standard_normal(1 << 19).astype(np.float32) for i in range(6)}
    sd.update({f"lora.{i}.{ab}": np.zeros((16, 256) if ab == "A" else (256, 16), np.float32)
               for i in range(6) for ab in "AB"})
    adapters = sum(a.nbytes for k, a in sd.items() if k.startswith("lora"))
    ref = rt.publish_state_dict(sd, name="lora")
    into = ref.empty_like("numpy")
    v = ref.load(into)
    for step in range(3):
        for k in sd:
            if k.startswith("lora"):
                sd[k][:] = rng.standard_normal(sd[k].shape).astype(np.float32)  # every adapter element
        v2 = ref.update(sd)
        _recorded(ref, v2)
        before = _deltas(rt)
        assert ref.load(into, base=v, delta_wait=30) == v2 and _same(into, sd)
        moved = _deltas(rt)["bytes_moved"] - before["bytes_moved"]
        assert adapters <= moved <= adapters + (64 << 10), (moved, adapters)  # the adapters, the record's tables
        v = v2


def test_a_reader_that_skips_versions_gets_the_union_or_a_full_load(rt):
    rng = np.random.default_rng(5)
    sd = _model(rng, _bf16())
    ref = rt.publish_state_dict(sd, name="skip", delta_history=4)
    into = ref.empty_like("numpy")
    v = ref.load(into)
    for _ in range(3):  # three versions while the reader looks away: the union of their deltas
        _change(rng, sd, 0.01)
        last = ref.update(sd)
        _recorded(ref, last)
    before = _deltas(rt)
    assert ref.load(into, base=v, delta_wait=30) == last and _same(into, sd)
    assert _deltas(rt)["loads_delta"] == before["loads_delta"] + 1
    v = last
    for _ in range(5):  # more than the history holds: a full load
        _change(rng, sd, 0.01)
        last = ref.update(sd)
        _recorded(ref, last)
    before = _deltas(rt)
    assert ref.load(into, base=v, delta_wait=30) == last and _same(into, sd)
    assert _deltas(rt)["loads_full"] == before["loads_full"] + 1


def test_buffers_changed_between_versions_fail_the_check_and_load_in_full(rt):
    rng = np.random.default_rng(9)
    sd = _model(rng, np.dtype(np.float32))
    ref = rt.publish_state_dict(sd, name="mod")
    into = ref.empty_like("numpy")
    v = ref.load(into)
    for where in ("w0", "w3", "w4"):  # a big tensor, a small one, the smallest (7 elements)
        into[where].reshape(-1)[-1] += 1.0  # the user's own change, in a tile no delta touches
        _change(rng, sd, 0.001)
        v2 = ref.update(sd)
        _recorded(ref, v2)
        before = _deltas(rt)
        assert ref.load(into, base=v, delta_wait=30) == v2 and _same(into, sd)  # never a mix
        after = _deltas(rt)
        assert after["mismatches"] == before["mismatches"] + 1
        assert after["loads_full"] == before["loads_full"] + 1
        v = v2
    _change(rng, sd, 0.001)
    v2 = ref.update(sd)
    _recorded(ref, v2)
    before = _deltas(rt)
    assert ref.load(into, base=v, delta_wait=30) == v2 and _same(into, sd)  # untouched buffers: a delta again
    assert _deltas(rt)["loads_delta"] == before["loads_delta"] + 1


def test_a_wrong_base_is_caught_too(rt):
    rng = np.random.default_rng(11)
    sd = _model(rng, np.dtype(np.float32))
    ref = rt.publish_state_dict(sd, name="wb")
    into = ref.empty_like("numpy")
    ref.load(into)
    old = {k: a.copy() for k, a in sd.items()}
    _change(rng, sd, 0.01)
    v2 = ref.update(sd)
    _recorded(ref, v2)
    _change(rng, sd, 0.01)
    v3 = ref.update(sd)
    _recorded(ref, v3)
    # into holds version 1, the caller says 2: the patches of 3 land on the wrong bytes
    before = _deltas(rt)
    assert ref.load(into, base=v2, delta_wait=30) == v3 and _same(into, sd)
    assert _deltas(rt)["mismatches"] == before["mismatches"] + 1
    assert not _same(into, old)


def test_strict_false_loads_a_subset_as_a_delta(rt):
    rng = np.random.default_rng(13)
    sd = _model(rng, _bf16())
    ref = rt.publish_state_dict(sd, name="sub")
    part = {k: np.empty_like(sd[k]) for k in ("w0", "w2")}
    v = ref.load(part, strict=False)
    _change(rng, sd, 0.01)
    v2 = ref.update(sd)
    _recorded(ref, v2)
    before = _deltas(rt)
    assert ref.load(part, strict=False, base=v, delta_wait=30) == v2
    assert _same(part, {k: sd[k] for k in part})
    assert _deltas(rt)["loads_delta"] == before["loads_delta"] + 1


def test_changed_ranges_cover_every_changed_byte_and_nothing_is_claimed_beyond_the_history(rt):
    sd = {"a": np.zeros(1 << 20, np.float32), "b": np.zeros(4096, np.int64), "c": np.zeros(3 << 16, np.uint8)}
    ref = rt.publish_state_dict(sd, name="cr")
    lay = ref.layout
    sd["a"][100_000] = 1.0
    sd["c"][-1] = 7
    v2 = ref.update(sd)
    _recorded(ref, v2)
    got = ref.changed_ranges(1, v2)
    tb = lay.delta.tile_bytes
    ea, ec = lay.index()["a"], lay.index()["c"]
    want = [(lay.header_bytes + ea.offset + (100_000 * 4 // tb) * tb, tb),
            (lay.header_bytes + ec.offset + ((ec.nbytes - 1) // tb) * tb, ec.nbytes - ((ec.nbytes - 1) // tb) * tb)]
    assert got == want
    assert ref.changed_ranges(v2 - 1, v2) == want
    for _ in range(5):
        v2 = ref.update(sd)
        _recorded(ref, v2)
    assert ref.changed_ranges(1, v2) is None  # version 2 fell out of the history
    assert ref.changed_ranges(v2 - 1, v2) == []  # nothing changed in the last one
    with pytest.raises(ValueError, match="a < b"):
        ref.changed_ranges(3, 3)


@pytest.mark.parametrize("delta, why", [
    ([1], "delta must be an object"), ({"index": 5, "tile_bytes": 65536, "history": 4}, "delta.index"),
    ({"index": "zz", "tile_bytes": 65536, "history": 4}, "not hex"),
    ({"index": "00", "tile_bytes": 0, "history": 4}, "tile_bytes"),
    ({"index": "00", "tile_bytes": 65536, "history": True}, "history")])
def test_a_layouts_delta_entry_is_checked(delta, why):
    import json

    from memsem.sync._state_dict import _HEAD, LAYOUT_MAGIC, StateDictLayout

    lay = StateDictLayout.build([("w", 1, (4,), 4)], align=64, bucket_bytes=1 << 20, framework="numpy")
    d = json.loads(lay.header()[_HEAD.size:].rstrip(b"\0"))
    d["delta"] = delta
    body = json.dumps(d).encode()
    with pytest.raises(ValueError, match=why):
        StateDictLayout.parse(_HEAD.pack(LAYOUT_MAGIC, 4096, len(body)), body, 1 << 20)


def test_without_a_history_there_is_nothing_to_move_but_everything(rt):
    sd = {"w": np.arange(1 << 16, dtype=np.float32)}
    ref = rt.publish_state_dict(sd, name="nohist", delta_history=0)
    assert ref.layout.delta is None
    into = ref.empty_like("numpy")
    v = ref.load(into)
    sd["w"][0] = -1
    v2 = ref.update(sd)
    before = _deltas(rt)
    assert ref.load(into, base=v, delta_wait=30) == v2 and _same(into, sd)
    assert _deltas(rt)["loads_full"] == before["loads_full"] + 1
    assert ref.changed_ranges(1, v2) is None
    with pytest.raises(ValueError, match="delta_history"):
        rt.publish_state_dict(sd, name="bad", delta_history=-1)


def test_single_slot_windows_record_changed_tiles_whole(rt):
    rng = np.random.default_rng(19)
    sd = _model(rng, np.dtype(np.float32))
    ref = rt.publish_state_dict(sd, name="one", slots=1)
    into = ref.empty_like("numpy")
    v = ref.load(into)
    mine = ref.tensors()
    with ref.write_section(copy=False) as sec:
        sec.tensors["w0"].reshape(-1)[5] += 1  # one element: one tile, moved whole (no previous slot)
    v2 = sec.version
    _recorded(ref, v2)
    before = _deltas(rt)
    assert ref.load(into, base=v, delta_wait=30) == v2 and _same(into, mine)
    after = _deltas(rt)
    assert after["loads_delta"] == before["loads_delta"] + 1
    assert (64 << 10) <= after["bytes_moved"] - before["bytes_moved"] <= (64 << 10) + (16 << 10)


def test_the_history_goes_with_its_window(rt):
    sd = {"w": np.zeros(1 << 16, np.float32)}
    ref = rt.publish_state_dict(sd, name="gone")
    idx = RefSpec.from_bytes(ref.layout.delta.index)
    for _ in range(3):
        v = ref.update(sd)
        _recorded(ref, v)  # each one recorded before the next commit overwrites its previous slot
    n = rt.stats().windows_published
    assert n == 1 + 1 + ref.layout.delta.history  # the state dict, its index, a record per version held
    rt.unpublish(ref)
    assert rt.stats().windows_published == 0  # before unpublish returns
    with pytest.raises(memsem.StaleReferenceError):
        memsem.TensorRef(idx, rt).get()


# -- a real optimizer: AdamW on an fp32 master, its bf16 copy published each step ----------------------
def test_adamw_bf16_steps_move_a_measured_fraction_bit_exact(rt):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    shapes = {"embed": (4096, 256), "attn.qkv": (768, 256), "attn.out": (256, 256), "mlp.up": (1024, 256),
              "mlp.down": (256, 1024), "norm": (256,)}
    master = {k: torch.nn.Parameter(torch.randn(s) * 0.02) for k, s in shapes.items()}
    opt = torch.optim.AdamW(master.values(), lr=1e-6, weight_decay=0.0)  # an RL-like learning rate
    pub = {k: p.detach().to(torch.bfloat16) for k, p in master.items()}
    ref = rt.publish_state_dict(pub, name="policy")
    into = ref.empty_like("torch")
    v = ref.load(into)
    fracs, ratios = [], []
    for step in range(4):
        opt.zero_grad()
        loss = sum((p * torch.randn_like(p)).sum() for p in master.values())
        loss.backward()
        opt.step()
        new = {k: p.detach().to(torch.bfloat16) for k, p in master.items()}
        changed = sum(int((new[k].view(torch.int16) != pub[k].view(torch.int16)).sum()) for k in new)
        fracs.append(changed / sum(t.numel() for t in new.values()))
        pub = new
        v2 = ref.update(pub)
        _recorded(ref, v2)
        before = _deltas(rt)
        assert ref.load(into, base=v, delta_wait=30) == v2
        assert all(torch.equal(into[k].view(torch.int16), pub[k].view(torch.int16)) for k in pub)
        after = _deltas(rt)
        ratios.append((after["bytes_moved"] - before["bytes_moved"]) / (after["bytes_loaded"] - before["bytes_loaded"]))
        v = v2
    print(f"AdamW lr=1e-6 bf16: changed fraction per step {[round(f, 4) for f in fracs]}, "
          f"bytes moved / model bytes {[round(r, 4) for r in ratios]}")
    assert all(0 < f < 0.5 for f in fracs)  # measured, not assumed: some, and far from all
    for f, r in zip(fracs, ratios):
        assert r <= 2 * 3 * f + 0.02  # about 3 bytes moved per 2-byte element changed (index + value)


# -- the follower loop ------------------------------------------------------------------------------------
def test_the_follower_loads_deltas_by_default_and_in_full_when_asked(rt):
    rng = np.random.default_rng(23)
    sd = _model(rng, _bf16())
    ref = rt.publish_state_dict(sd, name="fol")
    for delta in (True, False):
        before = _deltas(rt)
        with rt.follow("fol", timeout=30, delta=delta) as f:
            v, params = f.next()
            assert v == ref.version() and _same(params, sd)
            for _ in range(3):
                _change(rng, sd, 0.01)
                v2 = ref.update(sd)
                _recorded(ref, v2)  # the record is there before the follower looks: a delta
                got, params = f.next()
                assert got == v2 and _same(params, sd)
        after = _deltas(rt)
        if delta:  # the first is a delta; the next ones too unless deltas were slower here than full loads
            assert after["loads_delta"] - before["loads_delta"] >= 1
            assert after["loads_delta"] + after["loads_full"] - before["loads_delta"] - before["loads_full"] == 4
        else:
            assert after["loads_delta"] == before["loads_delta"]
            assert after["loads_full"] - before["loads_full"] == 4
    with pytest.raises(TypeError, match="delta"):
        rt.follow("fol", delta=1)


def test_a_follower_loading_into_other_tensors_loads_them_in_full(rt):
    rng = np.random.default_rng(29)
    sd = _model(rng, np.dtype(np.float32))
    ref = rt.publish_state_dict(sd, name="two")
    bufs = [ref.empty_like("numpy"), ref.empty_like("numpy")]
    with rt.follow("two", into=bufs[0], timeout=30) as f:
        f.next()
        for i in range(1, 4):
            _change(rng, sd, 0.01)
            _recorded(ref, ref.update(sd))
            before = _deltas(rt)
            _, got = f.next(into=bufs[i % 2])  # buffers used in turn: each holds an older version
            assert got is bufs[i % 2] and _same(got, sd)
            assert _deltas(rt)["loads_full"] == before["loads_full"] + 1


# -- a writer killed mid-commit ---------------------------------------------------------------------------
def _trainer(conn, name: str, seed: int, stall: bool) -> None:
    """Child: publish ``name`` (seed's model, float32), then obey: "step" commits 1% changes and
    sends the version once recorded; "stall" makes the next records never come; "half" opens a
    write section, changes half the tensors and stays in it (to be killed there)."""
    import threading

    import memsem.sync._delta_writer as W

    rng = np.random.default_rng(seed)
    with memsem.Runtime(timeout=30) as rt:
        sd = _model(rng, np.dtype(np.float32))
        ref = rt.publish_state_dict(sd, name=name, replace=True)
        conn.send(("ready", ref.version(), {k: a.copy() for k, a in sd.items()}))
        while True:
            cmd = conn.recv()
            if cmd == "step":
                _change(rng, sd, 0.01)
                v = ref.update(sd)
                _recorded(ref, v)
                conn.send((v, {k: a.copy() for k, a in sd.items()}))
            elif cmd == "stall":
                blocked = threading.Event()
                W.DeltaHistory._record = lambda self, v: blocked.wait(3600)  # the keeper never records again
                _change(rng, sd, 0.01)
                v = ref.update(sd)
                conn.send((v, {k: a.copy() for k, a in sd.items()}))
            elif cmd == "half":
                sec = ref.write_section(copy=True)
                for k in list(sec.tensors)[::2]:
                    sec.tensors[k][...] = 0
                conn.send("in the section")
                threading.Event().wait(3600)


@pytest.mark.multiproc
def test_a_writer_killed_mid_commit_leaves_readers_with_one_version(rt):
    p, conn = _proc.spawn(_trainer, "killed", 1, False)
    p2 = None
    try:
        _, v, sd = _proc.recv(conn)
        ref = rt.lookup_state_dict("killed", timeout=30)
        into = ref.empty_like("numpy")
        assert ref.load(into) == v and _same(into, sd)
        conn.send("step")
        v2, sd = _proc.recv(conn)
        assert ref.load(into, base=v, delta_wait=30) == v2 and _same(into, sd)
        # the owner commits a version whose record never comes: the reader loads it in full
        conn.send("stall")
        v3, sd = _proc.recv(conn)
        before = _deltas(rt)
        assert ref.load(into, base=v2, delta_wait=0.2) == v3 and _same(into, sd)
        assert _deltas(rt)["loads_full"] == before["loads_full"] + 1
        # killed inside the next write section (half its tensors written, its record stalled)
        conn.send("half")
        assert _proc.recv(conn) == "in the section"
        os.kill(p.pid, signal.SIGKILL)
        p.join(20)
        held = {k: a.copy() for k, a in into.items()}
        try:  # the dead owner's last committed version, or an error: never its half-written slot
            got = ref.load(into, base=v3, delta_wait=0.2)
        except (memsem.PeerLostError, memsem.StaleReferenceError, memsem.MemsemTimeoutError):
            assert _same(into, held)
        else:
            assert got == v3 and _same(into, sd)
        # a restarted trainer publishes the name again: a follower takes its versions in full first
        p2, conn2 = _proc.spawn(_trainer, "killed", 2, False)
        _, w, sd2 = _proc.recv(conn2)
        with rt.follow("killed", into=into, timeout=30) as f:
            got, params = f.next()
            assert got == w and _same(params, sd2)
            gen = f.generation
            conn2.send("step")
            w2, sd2 = _proc.recv(conn2)
            before = _deltas(rt)
            got, params = f.next()
            assert got == w2 and f.generation == gen and _same(params, sd2)
            assert _deltas(rt)["loads_delta"] == before["loads_delta"] + 1
    finally:
        _proc.reap([p] + ([p2] if p2 is not None else []), timeout=5)


# -- another node (tcp) ------------------------------------------------------------------------------------
def _tcp_owner(conn) -> None:
    os.environ["MEMSEM_NODE_ID"] = "delta-owner"
    rng = np.random.default_rng(31)
    with memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=30) as rt:
        sd = _model(rng, _bf16())
        ref = rt.publish_state_dict(sd, name="remote")
        conn.send((ref.to_bytes(), ref.version(), {k: a.copy() for k, a in sd.items()}))
        while conn.recv() == "step":
            _change(rng, sd, 0.01)
            v = ref.update(sd)
            _recorded(ref, v)
            conn.send((v, {k: a.copy() for k, a in sd.items()}))


@pytest.mark.multiproc
def test_a_reader_on_another_node_moves_deltas_over_tcp(monkeypatch):
    p, conn = _proc.spawn(_tcp_owner)
    try:
        raw, v, sd = _proc.recv(conn)
        monkeypatch.setenv("MEMSEM_NODE_ID", "delta-reader")
        with memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=30) as rt:
            ref = rt.ref(raw)
            assert rt.route(ref).kind == "tcp"  # (its latest-version word here is a mirror that may lag:
            # the loads name the version the owner said it committed)
            into = ref.empty_like("numpy")
            assert ref.load(into) == v and _same(into, sd)
            for _ in range(2):
                conn.send("step")
                v2, sd = _proc.recv(conn)
                before = _deltas(rt)
                assert ref.load(into, version=v2, base=v, delta_wait=30) == v2 and _same(into, sd)
                after = _deltas(rt)
                assert after["loads_delta"] == before["loads_delta"] + 1
                assert (after["bytes_moved"] - before["bytes_moved"]) <= 0.05 * (after["bytes_loaded"] - before["bytes_loaded"])
                v = v2
            into["w1"].reshape(-1)[0] = 0  # changed here: caught across nodes too
            conn.send("step")
            v2, sd = _proc.recv(conn)
            before = _deltas(rt)
            assert ref.load(into, version=v2, base=v, delta_wait=30) == v2 and _same(into, sd)
            assert _deltas(rt)["mismatches"] == before["mismatches"] + 1
        conn.send("exit")
    finally:
        _proc.reap([p], timeout=10)


def test_a_republish_while_the_keeper_writes_the_index_waits_for_its_section(rt, monkeypatch):
    """The owner's history keeper writes each record's index entry inside a write section on the
    index window; a republish (or unpublish) of the state dict meanwhile retired the index under
    that open section and the section's commit wrote to unmapped memory (SIGSEGV: a loaded run's
    owner died silently). The keeper is held inside its section here while the state dict is
    republished in another thread: the republish waits for the section (seen waiting on its
    lock), the section commits into mapped memory, and when the republish returns the old index
    and records are gone (nothing left to a later moment)."""
    from memsem.sync import _delta_writer

    entered, go = threading.Event(), threading.Event()
    write_entry = _delta_writer.write_entry

    def held(arr, history, entry):
        if entry.version == 2:
            entered.set()
            assert go.wait(60)
        return write_entry(arr, history, entry)

    monkeypatch.setattr(_delta_writer, "write_entry", held)
    sd = {"w": np.ones(4096, np.float32)}
    ref = rt.publish_state_dict(sd, name="hold")
    index = RefSpec.from_bytes(ref.layout.delta.index)
    owned = rt.publisher.owned[index.gva]
    seen = owned.section_lock = _proc.SeenLock(owned.section_lock)
    sd["w"][:10] = 2
    assert ref.update(sd) == 2
    assert entered.wait(60)  # the keeper's section on the index is open
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("ref", rt.publish_state_dict(sd, name="hold", replace=True)))
    t.start()
    assert seen.waiting.wait(60), "the republish did not wait for the keeper's section"
    assert not _index_gone(rt, index)  # still live while its section is open
    go.set()  # the keeper commits its entry, then the republish retires the index
    t.join(60)
    again = got["ref"]
    assert _index_gone(rt, index)  # gone when the republish returned
    # the new state dict, its index and its version 1's record (digests); none of the old four left
    assert rt.stats().windows_published == 3
    assert again.update(sd) == 2 and again.version() == 2




def _index_gone(rt, index) -> bool:
    try:
        rt.ref(index.to_bytes()).get()
    except (memsem.StaleReferenceError, memsem.WindowNotFoundError):
        return True
    return False
