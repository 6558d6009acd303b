"""Sharded state dicts and reshard on read (issue 35).

Plans (pure, fast): every layout hypothesis draws is planned, the plan applied to modelled rank
windows with numpy and compared with torch's own slicing of the full tensors (``torch.chunk``,
``torch.cat``); a plan moves exactly the targets' bytes, in as few runs as the layouts allow.

Real sharding (spawned processes): FSDP2 ``fully_shard`` over gloo on CPU with 2 and 4 trainer
ranks (bf16 and fp32 parameters, uneven shards); rollout layouts of TP 1, 2 and 4 with fused
qkv and gate_up read every version bit-exact against ``full_tensor()`` sliced the same way; a
trainer rank killed mid-commit; a trainer committing faster than the reader reads.
"""
from __future__ import annotations

import math
import os
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import memsem
from memsem.sync import (
    Replicate,
    Shard,
    ShardedLayout,
    Target,
    local_box,
    lookup_sharded,
    plan_reshard,
    publish_sharded,
    tp_targets,
)
from memsem.sync._reshard import SourceShard, SourceTensor, check_tiling

from memsem_bench.measure import free_port
from tests._proc import CTX, reap, recv, spawn
from tests._sharded_ranks import far_trainers, np_trainer, values

torch = pytest.importorskip("torch")

DTYPES = ["float32", "bfloat16", "float16", "int8", "float64"]


# -- helpers: modelled windows, torch's slicing ---------------------------------------------------
def _globals(layout: ShardedLayout, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for n, t in layout.tensors.items():
        raw = rng.integers(0, 255, size=t.nbytes, dtype=np.uint8)
        out[n] = raw.view(t.dtype).reshape(t.shape) if t.nbytes else np.empty(t.shape, t.dtype)
    return out


def _windows(layout: ShardedLayout, full: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
    """Each rank's window bytes as the layout places its boxes."""
    size: dict[int, int] = {}
    for t in layout.tensors.values():
        for s in t.shards:
            size[s.rank] = max(size.get(s.rank, 0), s.window_offset + math.prod(s.shape) * t.dtype.itemsize)
    wins = {r: np.full(n, 0xEE, np.uint8) for r, n in size.items()}
    for n, t in layout.tensors.items():
        for s in t.shards:
            box = full[n][tuple(slice(o, o + k) for o, k in zip(s.offset, s.shape))]
            b = np.ascontiguousarray(box).reshape(-1).view(np.uint8)
            wins[s.rank][s.window_offset:s.window_offset + len(b)] = b
    return wins


def _apply(plan, wins: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Load through the plan with numpy copies (what gather does with the ranges), into one
    arena holding the targets back to back (so ranges of adjacent targets coalesce)."""
    sizes = [math.prod(s) * d.itemsize for s, d in zip(plan.shapes, plan.dtypes)]
    arena = np.full(sum(sizes) + 1, 0xAB, np.uint8)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(int) if sizes else []
    base = arena.ctypes.data
    for r, ranges in plan.ranges([base + int(o) for o in starts]).items():
        for off, n, addr in ranges:
            arena[addr - base:addr - base + n] = wins[r][off:off + n]
    return {name: arena[o:o + n].view(d).reshape(s)
            for name, o, n, s, d in zip(plan.names, starts, sizes, plan.shapes, plan.dtypes)}


def _torch_slice(full: np.ndarray, dim: int | None, degree: int, rank: int) -> np.ndarray:
    """Slice ``rank`` of ``degree`` along ``dim`` as torch.chunk cuts it (empty past its chunks)."""
    if dim is None:
        return full
    t = torch.from_numpy(full.view(np.uint8).reshape(full.shape + (full.dtype.itemsize,)).copy())
    chunks = torch.chunk(t, degree, dim=dim) if full.shape[dim] else ()
    if rank < len(chunks):
        part = chunks[rank].contiguous().numpy()
    else:
        shape = list(full.shape) + [full.dtype.itemsize]
        shape[dim] = 0
        part = np.empty(shape, np.uint8)
    return part.reshape(-1).view(full.dtype).reshape(part.shape[:-1])


def _expected(target: Target, full: dict[str, np.ndarray]) -> np.ndarray:
    parts = [_torch_slice(full[s], target.dim, target.degree, target.rank) for s in target.sources]
    if len(parts) == 1:
        return parts[0]
    ts = [torch.from_numpy(p.view(np.uint8).reshape(p.shape + (p.dtype.itemsize,)).copy()) for p in parts]
    cat = torch.cat(ts, dim=target.cat_dim).numpy()
    return cat.reshape(-1).view(parts[0].dtype).reshape(cat.shape[:-1])


def _check(layout, targets, seed=0, reader=0):
    full = _globals(layout, seed)
    plan = plan_reshard(layout, targets, reader=reader)
    got = _apply(plan, _windows(layout, full))
    for n, t in targets.items():
        want = _expected(t, full)
        assert got[n].shape == want.shape, n
        assert got[n].tobytes() == want.tobytes(), n
    assert plan.nbytes == plan.target_bytes() == sum(_expected(t, full).nbytes for t in targets.values())
    return plan


# -- plans: drawn layouts ---------------------------------------------------------------------------
@st.composite
def _layouts(draw):
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    nd = draw(st.integers(0, 3))
    tensors, placements, targets = {}, {}, {}
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=nd, max_size=nd)))
        dt = draw(st.sampled_from(DTYPES))
        for j in range(draw(st.integers(1, 3))):  # a group of fusable tensors
            name = f"t{i}.{j}"
            s = list(shape)
            if nd and j:
                s[0] = draw(st.integers(0, 7))
            tensors[name] = (tuple(s), dt)
            placements[name] = [draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(nd)])) for _ in mesh]
        names = [f"t{i}.{j}" for j in range(j + 1)]
        degree = draw(st.integers(1, 5))
        dim = draw(st.sampled_from([None] + list(range(nd))))
        rank = draw(st.integers(0, degree - 1))
        if len(names) > 1 and nd:
            targets[f"fused{i}"] = Target(names, dim=dim, degree=degree, rank=rank, cat_dim=0)
        else:
            for n in names:
                targets[n] = Target(n, dim=dim, degree=degree, rank=rank)
    return ShardedLayout.synthetic(tensors, mesh, placements), targets, draw(st.integers(0, 7))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layouts(), st.integers(0, 2**31))
def test_plan_matches_torch_slicing_for_drawn_layouts(drawn, seed):
    layout, targets, reader = drawn
    _check(layout, targets, seed, reader)


def test_local_box_cuts_like_torch_chunk_uneven():
    # 5 rows over 4 ranks: torch.chunk gives 2, 2, 1 and an empty fourth shard
    assert [local_box((5, 3), (4,), (r,), [Shard(0)]) for r in range(4)] == [
        ((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (1, 3)), ((5, 0), (0, 3))]
    # a 2-d mesh sharding dim 0 twice splits each chunk again; Replicate keeps the extent
    assert local_box((8, 6), (2, 2), (1, 1), [Shard(0), Shard(0)]) == ((6, 0), (2, 6))
    assert local_box((8, 6), (2, 2), (1, 0), [Shard(1), Replicate()]) == ((0, 3), (8, 3))


def test_row_split_to_row_split_is_one_run_per_rank_and_target():
    layout = ShardedLayout.synthetic({"w": ((64, 32), "bfloat16")}, (4,), {"w": [Shard(0)]})
    plan = _check(layout, {"w": Target("w", dim=0, degree=2, rank=1)})
    assert plan.ranks == (2, 3) and plan.n_runs == 2 and plan.nbytes == 32 * 32 * 2


def test_column_slice_is_read_row_by_row_in_place():
    # a row-parallel target (dim 1) of a row-sharded source: one run per row, of the target's
    # width; nothing beyond the target's bytes is read (no staging of the source)
    layout = ShardedLayout.synthetic({"w": ((16, 40), "float32")}, (2,), {"w": [Shard(0)]})
    plan = _check(layout, {"w": Target("w", dim=1, degree=4, rank=3)})
    assert plan.n_runs == 16 and set(plan.runs[0][:, 3]) == {10 * 4} and plan.nbytes == 16 * 10 * 4


def test_fused_qkv_is_each_source_sliced_then_concatenated():
    layout = ShardedLayout.synthetic({"q": ((8, 4), "bfloat16"), "k": ((4, 4), "bfloat16"), "v": ((4, 4), "bfloat16")},
                                     (2,), {n: [Shard(0)] for n in "qkv"})
    plan = _check(layout, {"qkv": Target(("q", "k", "v"), dim=0, degree=2, rank=1)})
    assert plan.shapes == ((8, 4),)


def test_replicas_are_spread_over_readers_and_read_once():
    layout = ShardedLayout.synthetic({"w": ((6, 4), "float32")}, (2, 3), {"w": [Replicate(), Shard(0)]})
    seen = set()
    for reader in range(2):
        plan = _check(layout, {"w": Target("w")}, reader=reader)
        assert plan.nbytes == 6 * 4 * 4  # each box once, though two ranks hold it
        seen.add(plan.ranks)
    assert seen == {(0, 1, 2), (3, 4, 5)}


def test_adjacent_targets_coalesce_when_bound():
    # two whole tensors that lie back to back in the window and in the destination: one range
    layout = ShardedLayout.synthetic({"a": ((16,), "float32"), "b": ((16,), "float32")}, (1,), {})
    plan = plan_reshard(layout, {"a": Target("a"), "b": Target("b")})
    buf = np.empty(32, np.float32)
    assert plan.ranges([buf.ctypes.data, buf.ctypes.data + 64]) == {0: [(0, 128, buf.ctypes.data)]}


def test_tp_targets_fuses_and_renames():
    names = ["l0.q_proj.weight", "l0.k_proj.weight", "l0.v_proj.weight", "l0.o_proj.weight", "l0.gate.weight",
             "l0.up.weight", "l0.down.weight", "norm.weight"]
    t = tp_targets(names, degree=2, rank=1, column=["embed.weight"], row=["o_proj.weight", "down.weight"],
                   fused={"qkv_proj.weight": ["q_proj.weight", "k_proj.weight", "v_proj.weight"],
                          "gate_up_proj.weight": ["gate.weight", "up.weight"]},
                   rename={"l0.": "model.layers.0."})
    assert t == {"model.layers.0.qkv_proj.weight": Target(names[:3], dim=0, degree=2, rank=1),
                 "model.layers.0.o_proj.weight": Target(names[3], dim=1, degree=2, rank=1),
                 "model.layers.0.gate_up_proj.weight": Target(names[4:6], dim=0, degree=2, rank=1),
                 "model.layers.0.down.weight": Target(names[6], dim=1, degree=2, rank=1),
                 "norm.weight": Target("norm.weight")}


def test_plan_refuses_what_cannot_be_planned():
    layout = ShardedLayout.synthetic({"a": ((4, 2), "float32"), "b": ((4, 2), "bfloat16"), "c": ((4, 3), "float32")},
                                     (2,), {"a": [Shard(0)]})
    with pytest.raises(KeyError, match="'zz'"):
        plan_reshard(layout, {"x": Target("zz")})
    with pytest.raises(ValueError, match="cannot be fused"):
        plan_reshard(layout, {"x": Target(("a", "b"))})
    with pytest.raises(ValueError, match="differ outside cat_dim 0"):
        plan_reshard(layout, {"x": Target(("a", "c"))})
    with pytest.raises(ValueError, match="dim 2 but 'a' has 2"):
        plan_reshard(layout, {"x": Target("a", dim=2)})
    with pytest.raises(ValueError, match="rank must be in"):
        Target("a", dim=0, degree=2, rank=2)
    with pytest.raises(memsem.NotSupportedError, match="Partial"):
        from torch.distributed.tensor import Partial
        from memsem.sync._reshard import placement

        placement(Partial())


def test_boxes_that_do_not_tile_are_refused():
    def src(*boxes):
        return SourceTensor("w", (4, 4), np.dtype("float32"), ("S0",),
                            tuple(SourceShard(r, o, s, 0) for r, (o, s) in enumerate(boxes)))

    check_tiling(src(((0, 0), (2, 4)), ((2, 0), (2, 4))))
    with pytest.raises(ValueError, match="gap or overlap along dimension 0"):
        check_tiling(src(((0, 0), (3, 4)), ((2, 0), (2, 4))))
    with pytest.raises(ValueError, match="cover 3 of 4"):
        check_tiling(src(((0, 0), (3, 4))))
    with pytest.raises(ValueError, match="grid"):
        check_tiling(src(((0, 0), (2, 2)), ((2, 2), (2, 2))))
    with pytest.raises(ValueError, match="outside"):
        check_tiling(src(((0, 0), (5, 4))))


# -- real sharding: FSDP2 over gloo ---------------------------------------------------------------
def _np(t) -> np.ndarray:
    """A CPU torch tensor's bytes as numpy of the same dtype (bf16 through ml_dtypes)."""
    from memsem import _dtypes

    dt = _dtypes.numpy_dtype(_dtypes.code_of(t.dtype))
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().view(dt).reshape(tuple(t.shape)).copy()


class _Block(torch.nn.Module if torch is not None else object):
    """A transformer block's parameter shapes, small and uneven over 2 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.embed = nn.Embedding(11, 6)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(6, 3)
        self.o_proj = nn.Linear(6, 6, bias=False)
        self.gate, self.up = nn.Linear(6, 7, bias=False), nn.Linear(6, 7, bias=False)
        self.down = nn.Linear(7, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("rope", torch.arange(5.0))


TP = {"column": ["embed.weight"], "row": ["o_proj.weight", "down.weight"],
      "fused": {"qkv_proj.weight": ["q_proj.weight", "k_proj.weight", "v_proj.weight"],
                "qkv_proj.bias": ["q_proj.bias", "k_proj.bias", "v_proj.bias"],
                "gate_up_proj.weight": ["gate.weight", "up.weight"]}}


def _fsdp_trainer(conn, rank: int, world: int, port: int, name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = _Block().to(torch.bfloat16)
        model.norm.float()  # mixed dtypes: an fp32 group of its own
        fully_shard(model.norm, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with memsem.Runtime(timeout=30) as rt:
            pub = publish_sharded(rt, model.state_dict(), name=name)
            step = 1
            while True:
                full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
                if rank == 0:
                    conn.send((step, {k: v.detach().clone() for k, v in full.items()}))
                if conn.recv() != "step":
                    break
                step += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-1.5).add_(step)
                assert pub.update(model.state_dict()) == step
            pub.close()
    finally:
        dist.destroy_process_group()


def _check_tp(sd, full: dict, version: int) -> int:
    """Every TP 1, 2, 4 rank's targets loaded at ``version``, bit-exact against torch's slicing
    of the full tensors; returns the bytes moved."""
    full = {k: _np(v) for k, v in full.items()}
    moved = 0
    for degree in (1, 2, 4):
        for rank in range(degree):
            targets = tp_targets(sd.names, degree=degree, rank=rank, **TP)
            assert "qkv_proj.weight" in targets and "gate_up_proj.weight" in targets
            reader = sd.reader(targets, reader=rank)
            into = reader.empty()
            assert reader.load(into, version=version) == version
            for n, t in targets.items():
                want = _expected(t, full)
                got = _np(into[n])
                assert got.shape == want.shape and got.tobytes() == want.tobytes(), (degree, rank, n)
            moved += reader.bytes_moved
            assert reader.bytes_moved == reader.plan.target_bytes()
    return moved


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_trainer_to_tp_rollouts_bit_exact(world):
    port, name = free_port(), "policy"
    procs = [spawn(_fsdp_trainer, r, world, port, name) for r in range(world)]
    try:
        step, full = recv(procs[0][1], 120)
        with memsem.Runtime(timeout=30) as rt:
            sd = lookup_sharded(rt, name, timeout=60)
            assert sd.world_size == world and sd.version() == 1
            # FSDP2 shards dim 0 unevenly (k_proj: 3 rows): the ranks' boxes say so
            k = sd.layout.tensors["k_proj.weight"]
            assert k.placements == ("S0",) and [s.shape[0] for s in k.shards] == [len(c) for c in torch.chunk(torch.empty(3), world)]
            assert sd.layout.tensors["norm.weight"].dtype == np.float32
            assert sd.layout.tensors["q_proj.weight"].dtype.name == "bfloat16"
            assert sd.layout.tensors["rope"].placements == ("R",)  # a buffer: replicated
            _check_tp(sd, full, 1)
            # the next version, through the follower loop, at TP 2 rank 1
            reader = sd.reader(tp_targets(sd.names, degree=2, rank=1, **TP), reader=1)
            into = reader.empty()
            with rt.follow(reader, into=into, timeout=60, after=1) as follower:
                for _, c in procs:
                    c.send("step")
                v, got = next(follower)
                step, full = recv(procs[0][1], 60)
                assert v == step == 2 and got is into
                fulln = {k: _np(t) for k, t in full.items()}
                for n, t in reader.targets.items():
                    assert _np(into[n]).tobytes() == _expected(t, fulln).tobytes(), n
                _check_tp(sd, full, 2)
        for _, c in procs:
            c.send("stop")
    finally:
        reap([p for p, _ in procs], 60)
    assert [p.exitcode for p, _ in procs] == [0] * world


# -- faults and a fast trainer (numpy trainer ranks: no torch in the children) --------------------
@pytest.mark.multiproc
def test_rank_killed_mid_commit_never_makes_its_version_and_is_named():
    procs = [spawn(np_trainer, r, "w", None, 0) for r in range(2)]
    try:
        for _, c in procs:
            assert recv(c, 60) == "published"
        with memsem.Runtime(timeout=10) as rt:
            sd = lookup_sharded(rt, "w", timeout=30)
            both = sd.reader({"w": Target("w", dim=1, degree=2, rank=1)})  # reads rows of both ranks
            into = both.empty("numpy")
            assert both.load(into) == 1 and into["w"].tobytes() == values(1)[:, 2:].tobytes()
            procs[0][1].send("commit")
            assert recv(procs[0][1]) == 2  # rank 0 committed version 2 ...
            procs[1][1].send("die mid-commit")  # ... rank 1 dies inside its write section
            procs[1][0].join(30)
            assert procs[1][0].exitcode == -signal.SIGKILL
            assert sd.latest() == [2, 1] and sd.version() == 1  # version 2 never exists
            with pytest.raises(memsem.PeerLostError, match="trainer rank 1 of sharded state dict 'w'"):
                both.wait_version(2, timeout=10)
            with pytest.raises(memsem.PeerLostError, match="trainer rank 1 of sharded state dict 'w'"):
                both.load(into, version=2, timeout=10)
            assert into["w"].tobytes() == values(1)[:, 2:].tobytes()  # still version 1, whole
        procs[0][1].send("stop")
    finally:
        reap([p for p, _ in procs], 30)


@pytest.mark.multiproc
def test_trainer_committing_faster_than_the_reader_never_mixes_versions():
    steps = 200
    barrier = CTX.Barrier(2)
    procs = [spawn(np_trainer, r, "fast", barrier, steps) for r in range(2)]
    try:
        for _, c in procs:
            assert recv(c, 60) == "published"
        with memsem.Runtime(timeout=30) as rt:
            sd = lookup_sharded(rt, "fast", timeout=30)
            reader = sd.reader({"w": Target("w", dim=1, degree=2, rank=0), "b": Target("b")})
            into = reader.empty("numpy")
            seen = []
            with rt.follow(reader, into=into, timeout=60) as follower:
                for v, got in follower:
                    # every row from one version, both ranks' rows alike: never a mix
                    assert got["w"].tobytes() == values(v)[:, :2].tobytes(), v
                    assert got["b"].tolist() == [1 if v == 1 else v] * 3
                    seen.append(v)
                    if v == steps:
                        break
                skipped = follower.skipped
        assert seen == sorted(set(seen)) and seen[-1] == steps
        # versions committed while the reader loaded others are skipped (counted), never mixed
        assert skipped == seen[-1] - seen[0] + 1 - len(seen) and reader.loads == len(seen)
        assert reader.window_bytes == len(seen) * (9 * 2 * 4 + 3 * 8)
        for _, c in procs:
            assert recv(c, 60) == "done"
            c.send("stop")
    finally:
        reap([p for p, _ in procs], 30)


@pytest.mark.multiproc
def test_across_nodes_over_tcp_one_version_pinned_at_each_owner(monkeypatch):
    """Trainer ranks on another node (their own node id): every range is read over memsem's tcp
    route, owner-checked, and the version is pinned at each owner (a reservation); the second
    version is a delta: ``b`` did not change, so it does not move."""
    with far_trainers(monkeypatch, "far") as (rt, conns):
        sd = lookup_sharded(rt, "far", timeout=30)
        assert rt.route(sd.refs[1]).engine == "tcp"
        reader = sd.reader({"w": Target("w", dim=1, degree=2, rank=1), "b": Target("b")}, delta_wait=30)
        into = reader.empty("numpy")
        assert reader.load(into) == 1 and into["w"].tobytes() == values(1)[:, 2:].tobytes()
        for c in conns:
            c.send("commit")
        assert [recv(c) for c in conns] == [2, 2]
        with rt.follow(reader, into=into, timeout=30, after=1) as follower:
            v, _ = next(follower)
        assert v == 2 and into["w"].tobytes() == values(2)[:, 2:].tobytes()
        assert reader.retries == 0 and reader.deltas == 1
        assert reader.window_bytes == (9 * 2 * 4 + 3 * 8) + 9 * 2 * 4 and reader.record_bytes > 0


# -- dtype on read: bf16 -> fp8 e4m3fn with block or per-tensor scales ----------------------------
def _fp8_reference(full, block):
    """torch's conversion of the whole tensor, block by block (or per tensor), written out here."""
    x = full.float()
    if block is None:
        s = torch.clamp(x.abs().max(), min=1e-12) / 448.0
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn), s.reshape(1)
    bh, bw = block
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty((-(-x.shape[0] // bh), -(-x.shape[1] // bw)))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            b = x[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw]
            s = torch.clamp(b.abs().max(), min=1e-12) / 448.0
            scales[i, j] = s
            q[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw] = (b / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scales


def _u8(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_fp8_on_read_bit_exact_against_the_full_tensors_conversion(rt):
    g = torch.Generator().manual_seed(3)
    shapes = {"q": (256, 128), "k": (128, 128), "v": (128, 128), "o": (128, 256), "n": (64, 48)}
    full = {k: (torch.randn(s, generator=g) * torch.logspace(-3, 2, s[1])).to(torch.bfloat16) for k, s in shapes.items()}
    full["k"][:64] = 0  # an all-zero block: its scale is the floor, never a division by zero
    pubs = []
    for r in range(2):
        local = {}
        for k, s in shapes.items():
            (o, _), (n, _) = local_box(s, (2,), (r,), [Shard(0)])
            local[k] = full[k][o:o + n].clone()
        pubs.append(publish_sharded(rt, local, name="fp8", rank=r, world_size=2,
                                    placements={k: [Shard(0)] for k in shapes}, global_shapes=shapes))
    sd = lookup_sharded(rt, "fp8")
    blk = (64, 64)
    ref = {k: _fp8_reference(v, blk) for k, v in full.items()}
    for rank in range(2):
        reader = sd.reader({"qkv": Target(("q", "k", "v"), dim=0, degree=2, rank=rank, dtype="float8_e4m3fn", block=blk),
                            "o": Target("o", dim=1, degree=2, rank=rank, dtype="float8_e4m3fn", block=blk),
                            "n": Target("n", dtype="float8_e4m3fn"),
                            "q_bf16": Target("q", dim=0, degree=2, rank=rank)})
        into = reader.empty()
        assert into["qkv"].dtype == torch.float8_e4m3fn and into["qkv_scale_inv"].shape == (4, 2)
        assert reader.load(into) == 1
        want_q = torch.cat([torch.chunk(ref[k][0], 2)[rank] for k in "qkv"])
        want_s = torch.cat([torch.chunk(ref[k][1], 2)[rank] for k in "qkv"])
        assert _u8(into["qkv"]) == _u8(want_q) and _u8(into["qkv_scale_inv"]) == _u8(want_s)
        assert _u8(into["o"]) == _u8(torch.chunk(ref["o"][0], 2, dim=1)[rank])
        assert _u8(into["o_scale_inv"]) == _u8(torch.chunk(ref["o"][1], 2, dim=1)[rank])
        nq, ns = _fp8_reference(full["n"], None)
        assert _u8(into["n"]) == _u8(nq) and _u8(into["n_scale"]) == _u8(ns)
        assert _u8(into["q_bf16"]) == _u8(torch.chunk(full["q"], 2)[rank])  # the rest as it is
        assert reader.bytes_moved == reader.plan.nbytes  # bf16 bytes read once, converted here
    # the plan says what it cannot convert from the reader's own bytes
    with pytest.raises(ValueError, match="block edges"):
        sd.plan({"o": Target("o", dim=1, degree=2, rank=1, dtype="float8_e4m3fn", block=(96, 96))})
    with pytest.raises(memsem.NotSupportedError, match="whole tensor's amax"):
        sd.plan({"o": Target("o", dim=1, degree=2, rank=1, dtype="float8_e4m3fn")})
    for p in pubs:
        p.close()


def test_async_follow_of_a_sharded_reader(rt):
    """``async for`` over ``rt.follow(reader)``: each step runs off the event loop, every
    version whole (both ranks' rows of it)."""
    import asyncio

    from memsem.sync import Shard

    full = {v: values(v) for v in (1, 2)}
    pubs = []
    for r in range(2):
        (o, _), (n, _) = local_box(full[1].shape, (2,), (r,), [Shard(0)])
        pubs.append(publish_sharded(rt, {"w": full[1][o:o + n].copy()}, name="aio", rank=r, world_size=2,
                                    placements={"w": "S0"}, global_shapes={"w": full[1].shape}))
    reader = lookup_sharded(rt, "aio").reader({"w": Target("w", dim=1, degree=2, rank=0)})

    async def follow():
        seen = []
        async for v, t in rt.follow(reader, into=reader.empty("numpy"), timeout=10):
            seen.append((v, t["w"].tobytes()))
            if v == 1:
                for r, p in enumerate(pubs):
                    (o, _), (n, _) = local_box(full[2].shape, (2,), (r,), [Shard(0)])
                    assert p.update({"w": full[2][o:o + n]}) == 2
            else:
                return seen

    seen = asyncio.run(asyncio.wait_for(follow(), 30))
    assert seen == [(1, full[1][:, :2].tobytes()), (2, full[2][:, :2].tobytes())]
    for p in pubs:
        p.close()
