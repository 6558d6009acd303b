"""The verl backend's delta buckets (``delta=True``, issue 36), in one process (no Ray): a
trainer and rollouts set up as verl does (prepare -> build_topology -> init_process_group), each
with its own runtime on the local directory, syncing the same state dict version after version.

Every received tensor is compared bit for bit with the trainer's of that sync; what moved is the
engines' own count (``metrics``): the data bytes sent and received, the buckets that went as
deltas, the rollouts' fallbacks (a bucket read whole from the trainer's copy).

Runs in .venv-verl (tests/verl/run_verl_tests.sh, ``make test-verl``).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import memsem
from memsem.integrations import verl as mv

BUCKET = 256 << 10
TIMEOUT = 30.0  # a test that reaches it has failed


def _engines(n: int, fanout: str = "chain", delta: bool = True):
    trainer = mv.MemsemCheckpointEngine(BUCKET, is_master=True, directory="local", timeout=TIMEOUT, meta_bytes=4096,
                                        fanout=fanout, delta=delta)
    return trainer, [_rollout() for _ in range(n)]


def _rollout():
    return mv.MemsemCheckpointEngine(BUCKET, directory="local", timeout=TIMEOUT, meta_bytes=4096)


def _setup(trainer, rollouts) -> None:
    everyone = [trainer] + rollouts
    metadata = [e.prepare() for e in everyone]
    actor, rollout = mv.MemsemCheckpointEngine.build_topology(1, len(rollouts), metadata)
    trainer.init_process_group(actor["rank"][0], actor["world_size"][0], actor["master_metadata"][0],
                               rollouts=actor["rollouts"][0])
    for k, e in enumerate(rollouts):
        e.init_process_group(rollout["rank"][k], rollout["world_size"][k], rollout["master_metadata"][k],
                             rollouts=rollout["rollouts"][k], upstream=rollout["upstream"][k])


async def _receive(engine, step: int, keep: dict | None = None) -> dict[str, torch.Tensor]:
    got = {}
    async for name, weight in engine.receive_weights(global_steps=step):
        got[name] = weight.clone()
        if keep is not None:
            keep[name] = weight  # the yielded tensor itself (a view of the rollout's copy)
    return got


def _sync(trainer, rollouts, sd: dict[str, torch.Tensor], step: int, keep: dict | None = None) -> dict:
    """One sync of ``sd``: every rollout's tensors checked equal to it, bit for bit. Returns the
    trainer's metrics."""
    _setup(trainer, rollouts)

    async def run():
        return await asyncio.gather(trainer.send_weights(iter(sd.items()), global_steps=step),
                                    *[_receive(e, step, keep if i == 0 else None) for i, e in enumerate(rollouts)])

    out = asyncio.run(run())
    for e in [trainer] + rollouts:
        e.finalize()
    for k, got in enumerate(out[1:]):
        assert set(got) == set(sd), (k, set(sd) ^ set(got))
        for name, want in sd.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, (k, name)
            assert torch.equal(got[name].view(torch.uint8), want.contiguous().view(torch.uint8)), (k, name)
    return out[0]


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 matrices (one bigger than a bucket: it travels in chunks), an fp32 vector, odd
    sizes and dtypes (bool, int64, complex128)."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"layer{i}.weight": torch.randn(96, 512, generator=g).to(torch.bfloat16) for i in range(6)}
    sd["embed"] = torch.randn(600, 512, generator=g).to(torch.bfloat16)  # 600 KiB: > BUCKET
    sd["norm"] = torch.randn(5001, generator=g)
    sd["mask"] = torch.rand(333, generator=g) > 0.5
    sd["ids"] = torch.randint(0, 1 << 40, (77,), generator=g)
    sd["freqs"] = torch.randn(64, 32, dtype=torch.complex128, generator=g)  # 16-byte elements
    return sd


def _change(sd: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """``sd`` with ``fraction`` of every tensor's elements changed (chosen at random)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sd.items():
        t = t.clone()
        flat = t.view(-1)
        n = int(round(fraction * flat.numel()))
        idx = torch.randperm(flat.numel(), generator=g)[:n]
        flat[idx] = ~flat[idx] if t.dtype == torch.bool else flat[idx] + 1
        out[name] = t
    return out


def _close(*engines) -> None:
    for e in engines:
        e.close()


@pytest.mark.parametrize("fanout", ["chain", "star"])
def test_changes_of_every_size_arrive_exactly_and_move_what_changed(fanout):
    """0%, 0.1%, 1%, 10%, 100% of the elements changed: the first sync is whole, the next ones
    deltas whose bytes follow the change (index and value per changed element, or tiles whole);
    every element changed goes whole (the delta would not pay); every result bit-exact."""
    trainer, rollouts = _engines(3, fanout)
    try:
        sd = _model()
        first = _sync(trainer, rollouts, sd, 1)
        assert first["memsem/delta_buckets"] == 0 and first["memsem/sent_bytes"] == first["memsem/bucket_bytes"]
        ratios = {}
        for step, frac in enumerate((0.0, 0.001, 0.01, 0.1, 1.0), 2):
            sd = _change(sd, frac, step)
            m = _sync(trainer, rollouts, sd, step)
            ratios[frac] = m["memsem/sent_bytes"] / m["memsem/bucket_bytes"]
            for r in rollouts:
                assert r.metrics["memsem/fallbacks"] == 0
                assert r.metrics["memsem/received_bytes"] == m["memsem/sent_bytes"]
            if frac < 1.0:
                assert m["memsem/delta_buckets"] == m["memsem/buckets"], (frac, m)
            else:
                assert m["memsem/delta_buckets"] == 0, m
        assert ratios[0.0] < 0.01 and ratios[0.001] < ratios[0.01] < 0.05, ratios
        assert ratios[0.01] < ratios[0.1] <= mv.vd.DELTA_MAX and ratios[1.0] == 1.0, ratios
    finally:
        _close(trainer, *rollouts)


def test_a_real_optimizer_bf16_copy_moves_as_deltas():
    """An fp32 master updated by torch.optim.AdamW at an RL-like learning rate, its bf16 copy
    sent each step: the fraction of bf16 elements that changed is measured, and the bytes sent
    follow it (at most 2 bytes of index beside each changed value, plus the tile digests)."""
    torch.manual_seed(3)
    master = {f"p{i}": torch.nn.Parameter(torch.randn(256, 512) * 0.02) for i in range(4)}
    opt = torch.optim.AdamW(master.values(), lr=1e-6, weight_decay=0.0)
    trainer, rollouts = _engines(2)
    try:
        prev = {k: v.detach().to(torch.bfloat16) for k, v in master.items()}
        _sync(trainer, rollouts, prev, 1)
        for step in range(2, 5):
            opt.zero_grad()
            loss = sum((p * torch.randn_like(p)).sum() for p in master.values())
            loss.backward()
            opt.step()
            cur = {k: v.detach().to(torch.bfloat16) for k, v in master.items()}
            changed = sum(int((cur[k] != prev[k]).sum()) for k in cur) / sum(v.numel() for v in cur.values())
            m = _sync(trainer, rollouts, cur, step)
            assert 0 < changed < 0.5, changed  # measured, not assumed
            assert m["memsem/delta_buckets"] == m["memsem/buckets"], m
            ratio = m["memsem/sent_bytes"] / m["memsem/bucket_bytes"]
            assert ratio <= 2 * changed + 0.01, (ratio, changed)
            prev = cur
    finally:
        _close(trainer, *rollouts)


def test_a_rollout_whose_tensors_were_written_reads_the_trainers_copy():
    """Rollout 1's consumer writes into a tensor it was yielded (a view of its copy) after the
    sync: at the next sync its copy does not check for that bucket, which it reads whole from the
    trainer's store window (counted); the tensors are still exactly the trainer's, and the
    rollout after it in the chain (its own copy intact) needs no fallback."""
    trainer, rollouts = _engines(2)
    try:
        sd = _model()
        kept: dict[str, torch.Tensor] = {}
        _sync(trainer, rollouts, sd, 1, keep=kept)
        kept["layer3.weight"].view(-1)[17] += 5  # the consumer's write, into the rollout's copy
        sd = _change(sd, 0.01, 2)
        m = _sync(trainer, rollouts, sd, 2)
        assert m["memsem/delta_buckets"] == m["memsem/buckets"]
        assert rollouts[0].metrics["memsem/fallbacks"] == 1, rollouts[0].metrics
        assert rollouts[1].metrics["memsem/fallbacks"] == 0, rollouts[1].metrics
        # the bucket read whole is counted beside the deltas
        assert rollouts[0].metrics["memsem/received_bytes"] > m["memsem/sent_bytes"]
        assert rollouts[1].metrics["memsem/received_bytes"] == m["memsem/sent_bytes"]
        # and its copy is right again: the next delta checks everywhere
        sd = _change(sd, 0.01, 3)
        _sync(trainer, rollouts, sd, 3)
        assert all(r.metrics["memsem/fallbacks"] == 0 for r in rollouts)
    finally:
        _close(trainer, *rollouts)


def test_a_bucket_that_checks_nowhere_is_refused_whole():
    """The rollout's copy and the trainer's store window both hold wrong bytes for a bucket (a
    fault the trainer cannot see): DigestMismatchError names the bucket and the trainer, and the
    sync fails; nothing of that bucket is yielded. The next sync is whole (no base is trusted)
    and exact."""
    trainer, rollouts = _engines(1)
    try:
        sd = _model()
        kept: dict[str, torch.Tensor] = {}
        _sync(trainer, rollouts, sd, 1, keep=kept)
        kept["layer0.weight"].view(-1)[3] += 1
        sd = _change(sd, 0.01, 2)
        _setup(trainer, rollouts)
        flat = trainer._store.flat
        keep = trainer._keep_bucket

        def keep_then_break(builder, index, body, meta, used, out):
            got = keep(builder, index, body, meta, used, out)
            if index == 0:  # after the trainer wrote its copy of bucket 0: a fault in it
                flat[got[2] + 5] ^= 0xFF
            return got

        trainer._keep_bucket = keep_then_break
        names: list[str] = []

        async def run():
            async def recv():
                async for name, _ in rollouts[0].receive_weights(global_steps=2):
                    names.append(name)

            return await asyncio.gather(trainer.send_weights(iter(sd.items()), global_steps=2), recv(),
                                        return_exceptions=True)

        sent, got = asyncio.run(run())
        assert isinstance(got, memsem.DigestMismatchError), got
        assert "bucket 0" in str(got) and "the trainer" in str(got), got
        assert names == [], names  # nothing of bucket 0 (the first) was yielded
        assert isinstance(sent, memsem.PeerLostError) and "DigestMismatchError" in str(sent), sent
        for e in [trainer] + rollouts:
            e.finalize()
        trainer._keep_bucket = keep
        m = _sync(trainer, rollouts, _change(sd, 0.01, 3), 3)
        assert m["memsem/delta_buckets"] == 0, m
    finally:
        _close(trainer, *rollouts)


def test_a_new_rollout_makes_that_sync_whole_for_all_then_deltas_again():
    """A rollout restarted (a new engine: no copy) joins: the trainer sends that sync whole to
    everyone (it cannot send deltas some rollouts cannot use), then deltas again."""
    trainer, rollouts = _engines(2)
    try:
        sd = _model()
        _sync(trainer, rollouts, sd, 1)
        rollouts[1].close()
        rollouts[1] = _rollout()
        sd = _change(sd, 0.01, 2)
        m = _sync(trainer, rollouts, sd, 2)
        assert m["memsem/delta_buckets"] == 0, m
        sd = _change(sd, 0.01, 3)
        m = _sync(trainer, rollouts, sd, 3)
        assert m["memsem/delta_buckets"] == m["memsem/buckets"], m
    finally:
        _close(trainer, *rollouts)


def test_a_changed_layout_goes_whole_where_it_changed():
    """A tensor added at the end, then one resized in the middle: the buckets whose layout held
    go as deltas, the others whole; every result exact; the sync after is all deltas."""
    trainer, rollouts = _engines(2)
    try:
        sd = _model()
        _sync(trainer, rollouts, sd, 1)
        sd = dict(_change(sd, 0.01, 2), extra=torch.ones(1000, dtype=torch.bfloat16))
        m = _sync(trainer, rollouts, sd, 2)
        assert 0 < m["memsem/delta_buckets"] < m["memsem/buckets"], m
        sd = dict(sd)
        sd["layer2.weight"] = torch.randn(95, 512).to(torch.bfloat16)  # resized: the buckets from it on move
        m = _sync(trainer, rollouts, sd, 3)
        assert 0 < m["memsem/delta_buckets"] < m["memsem/buckets"], m
        m = _sync(trainer, rollouts, _change(sd, 0.01, 4), 4)
        assert m["memsem/delta_buckets"] == m["memsem/buckets"], m
    finally:
        _close(trainer, *rollouts)


def test_a_sync_that_failed_is_no_base():
    """A rollout's consumer fails mid-sync: the trainer raises (PeerLostError), and neither the
    trainer's copy nor any rollout's (each changed in part) is taken as a base: the next sync
    is whole, then deltas again, every result exact."""
    trainer, rollouts = _engines(2)
    try:
        sd = _model()
        _sync(trainer, rollouts, sd, 1)
        sd = _change(sd, 0.01, 2)
        _setup(trainer, rollouts)

        async def run():
            async def fail():
                n = 0
                async for _ in rollouts[1].receive_weights(global_steps=2):
                    n += 1
                    if n == 3:
                        raise ValueError("the test's consumer fails")

            return await asyncio.gather(trainer.send_weights(iter(sd.items()), global_steps=2),
                                        _receive(rollouts[0], 2), fail(), return_exceptions=True)

        out = asyncio.run(run())
        assert trainer.metrics == {} and rollouts[1].metrics == {}  # a failed sync reports no figures
        # (the consumer's error closes the stream: the rollout reports that it stopped receiving)
        assert isinstance(out[0], memsem.PeerLostError) and "stopped receiving" in str(out[0]), out[0]
        assert isinstance(out[2], ValueError), out[2]
        for e in [trainer] + rollouts:
            e.finalize()
        m = _sync(trainer, rollouts, sd, 3)
        assert m["memsem/delta_buckets"] == 0, m
        m = _sync(trainer, rollouts, _change(sd, 0.01, 4), 4)
        assert m["memsem/delta_buckets"] == m["memsem/buckets"], m
    finally:
        _close(trainer, *rollouts)


def test_a_relay_that_passes_on_a_wrong_delta_is_named():
    """A relaying rollout flips a byte of a delta bucket it re-serves: the next rollout's check of
    the bytes as sent (the trainer's sha256 of the bucket) names the relay, before any patch."""
    trainer, rollouts = _engines(2)
    try:
        sd = _model()
        _sync(trainer, rollouts, sd, 1)
        relay = rollouts[0]

        def verify(buf, head, version):
            if head["index"] == 1:
                assert head["kind"] == mv.KIND_DELTA
                buf[relay.meta_bytes + head["wire"] - 1] ^= 0xFF

        relay._verify = verify
        sd = _change(sd, 0.01, 2)
        _setup(trainer, rollouts)

        async def run():
            return await asyncio.gather(trainer.send_weights(iter(sd.items()), global_steps=2),
                                        _receive(rollouts[0], 2), _receive(rollouts[1], 2), return_exceptions=True)

        out = asyncio.run(run())
        err = out[2]
        assert isinstance(err, memsem.DigestMismatchError), out
        assert "rollout 1" in str(err) and "bucket 1" in str(err), err
    finally:
        _close(trainer, *rollouts)


def test_a_relay_serving_another_buckets_header_never_touches_yielded_tensors():
    """A faulty relay serves, in the slot of bucket 2, bucket 1's header and metadata with wrong
    data (a sync whose buckets go whole: every element changed). The last rollout refuses it
    (DigestMismatchError naming the relay), and the tensors it yielded from bucket 1 (views of
    its copy of bucket 1) still hold the trainer's bytes: the wrong data was never read into that
    copy."""
    trainer, rollouts = _engines(2)
    try:
        sd = _model()
        _sync(trainer, rollouts, sd, 1)
        relay, last = rollouts
        seen: dict = {}

        def verify(buf, head, version):
            seen[head["index"]] = buf.copy()
            if head["index"] == 2:
                buf[:] = seen[1]
                buf[relay.meta_bytes] ^= 0xFF

        relay._verify = verify
        sd = _change(sd, 1.0, 2)
        _setup(trainer, rollouts)
        views: dict[str, torch.Tensor] = {}

        async def run():
            return await asyncio.gather(trainer.send_weights(iter(sd.items()), global_steps=2),
                                        _receive(relay, 2), _receive(last, 2, keep=views), return_exceptions=True)

        out = asyncio.run(run())
        assert isinstance(out[2], memsem.DigestMismatchError) and "rollout 1" in str(out[2]), out
        assert views, "the last rollout yielded nothing before the faulty bucket"
        for name, view in views.items():
            assert torch.equal(view.view(torch.uint8), sd[name].view(torch.uint8)), name
    finally:
        _close(trainer, *rollouts)


def test_without_delta_nothing_is_kept():
    """``delta=False`` (the default): every sync whole, no copy kept by anyone."""
    trainer, rollouts = _engines(1, delta=False)
    try:
        sd = _model()
        for step in (1, 2):
            m = _sync(trainer, rollouts, _change(sd, 0.01, step), step)
            assert m["memsem/delta_buckets"] == 0 and m["memsem/sent_bytes"] == m["memsem/bucket_bytes"]
        assert trainer._store is None and rollouts[0]._store is None
        # a trainer that sends deltas makes the rollout keep a copy; one that does not (a
        # restart with delta=False) makes it drop that copy
        delta_trainer = _engines(0)[0]
        try:
            _sync(delta_trainer, rollouts, sd, 3)
            assert rollouts[0]._store is not None and rollouts[0]._store.nbytes() > 0
        finally:
            delta_trainer.close()
        _sync(trainer, rollouts, sd, 4)
        assert rollouts[0]._store is None
    finally:
        _close(trainer, *rollouts)


def test_delta_must_be_a_bool():
    with pytest.raises(ValueError, match="delta must be a bool, got 'yes'"):
        mv.MemsemCheckpointEngine(BUCKET, delta="yes")


def test_bucket_tiles_and_a_delta_round_trip():
    """The codec alone: a delta of random bytes in tiles of every itemsize decodes to the new
    bytes exactly (every tile checked), a copy that is not the old bytes is found, and a delta
    bigger than ``DELTA_MAX`` of the bucket is refused."""
    vd = mv.vd
    rng = np.random.default_rng(0)
    chunks = [(0, 300000, 2), (300032, 4000, 4), (304032, 3, 1), (304040, 80000, 8)]
    used = 384040
    tiles = vd.BucketTiles.of(chunks)
    assert int(tiles.nbytes.sum()) == sum(c[1] for c in chunks)
    old = rng.integers(0, 256, used, dtype=np.uint8)
    new = old.copy()
    new[rng.choice(used, used // 100, replace=False)] ^= 1
    out = np.zeros(used, np.uint8)
    wire, digests = vd.encode(tiles, new, old, None, out)
    assert wire is not None and wire < 0.1 * used
    with memsem.Runtime(directory="local") as rt:
        dst = old.copy()
        assert vd.apply(rt, tiles, vd.parse(tiles, out[:wire]), dst) == 0
        assert all(np.array_equal(dst[o:o + n], new[o:o + n]) for o, n, _ in chunks)
        bad = old.copy()
        bad[7] ^= 0x10
        assert vd.apply(rt, tiles, vd.parse(tiles, out[:wire]), bad) == 1
    wide = vd.BucketTiles.of([(0, 64, 16)])  # complex128: patched as 8-byte words
    assert wide.itemsize.tolist() == [8] and wide.nbytes.tolist() == [64]
    with pytest.raises(ValueError, match="itemsize must be an int > 0"):
        vd.BucketTiles.of([(0, 8, 0)])
    with pytest.raises(ValueError, match="tiles"):
        vd.parse(vd.BucketTiles.of(chunks[:2]), out[:wire])
    assert vd.encode(tiles, rng.integers(0, 256, used, dtype=np.uint8), old, digests, out)[0] is None
