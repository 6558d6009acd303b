"""memsem's own tests of the TransferQueue backend (memsem.integrations.transferqueue).

The field cases the backend exists for, on the real client and storage agent (no Ray needed):
a recycled global index never yields old bytes, a clear racing a get never yields wrong bytes,
and data outlives the process that put it. TransferQueue's own e2e suite runs through
tests/tq/run_tq_e2e.sh. Skipped where transferqueue (extra ``memsem[transferqueue]``) is absent.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("transfer_queue", reason="transferqueue is not installed (pip install memsem[transferqueue])")
torch = pytest.importorskip("torch", reason="torch is not installed")

from memsem import StaleReferenceError  # noqa: E402
from memsem.integrations import transferqueue as mtq  # noqa: E402
from memsem.integrations._tq_agent import AgentClient, start_agent  # noqa: E402


@pytest.fixture(scope="module")
def agent():
    ag = start_agent(job=f"tqtest-{os.getpid()}", timeout=60)
    yield ag
    ag.stop()


def _client(agent, **extra) -> mtq.MemsemStorageClient:
    return mtq.MemsemStorageClient({"agent_address": agent.address, "agent_authkey": agent.authkey.hex(),
                                    "job": agent.job, **extra})


def _stats(agent) -> dict:
    return AgentClient(agent.address, agent.authkey).call("stats")


def _batch(seed: int, rows: int = 4, cols: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g)


def test_roundtrip_one_region_per_put(agent):
    cl = _client(agent)
    x = _batch(1)
    ids = torch.arange(4, dtype=torch.int64)
    keys = [f"{i}@x" for i in range(4)] + [f"{i}@ids" for i in range(4)] + [f"{i}@txt" for i in range(4)]
    values = list(x) + list(ids) + [f"s{i}" for i in range(4)]
    before = _stats(agent)
    metas = cl.put(keys, values)
    after = _stats(agent)
    assert after["allocs"] - before["allocs"] == 1  # one region (one registration) for the whole put
    got = cl.get(keys, custom_backend_meta=metas)
    for r in range(4):
        assert torch.equal(got[r], x[r])
        assert got[4 + r].shape == () and int(got[4 + r]) == r
        assert got[8 + r] == f"s{r}"
    got[0].add_(1)  # writable, and independent of the stored bytes
    assert torch.equal(cl.get(keys[:1], custom_backend_meta=metas[:1])[0], x[0])
    cl.clear(keys, metas)
    cl.clear(["99@x"], [None])  # never-put keys are tolerated


def test_recycled_index_never_yields_old_bytes(agent):
    cl = _client(agent)
    old = _batch(2, rows=2)
    keys = ["5@x", "6@x"]
    old_metas = cl.put(keys, list(old))
    # Clear index 5 only: its region stays alive (6 still lives there), its item word is zeroed.
    cl.clear(keys[:1], old_metas[:1])
    new = _batch(3)[:1]
    new_metas = cl.put(keys[:1], list(new))
    assert torch.equal(cl.get(keys[:1], custom_backend_meta=new_metas)[0], new[0])
    with pytest.raises(StaleReferenceError, match="5@x"):
        cl.get(keys[:1], custom_backend_meta=old_metas[:1])
    assert torch.equal(cl.get(keys[1:], custom_backend_meta=old_metas[1:])[0], old[1])
    # Clearing the last item frees the old region: its window generation moves.
    cl.clear(keys[1:], old_metas[1:])
    with pytest.raises(StaleReferenceError, match="6@x"):
        cl.get(keys[1:], custom_backend_meta=old_metas[1:])
    # A stale clear (old meta of a recycled index) never clears the new item.
    cl.clear(keys[:1], old_metas[:1])
    assert torch.equal(cl.get(keys[:1], custom_backend_meta=new_metas)[0], new[0])
    cl.clear(keys[:1], new_metas)


class _SlowReads:
    """Make the process runtime's data copies of gets slow, to hold a get inside its lease."""

    def __init__(self, rt, delay: float) -> None:
        self.rt, self.delay = rt, delay
        self.inside = threading.Event()
        self._orig = self.rt.transfer

    def __enter__(self):
        def slow(spec, kind, offset, local, *, lease=None):
            if kind == "get" and local.nbytes > 64 and lease is not None:
                self.inside.set()
                time.sleep(self.delay)
            return self._orig(spec, kind, offset, local, lease=lease)

        self.rt.transfer = slow
        return self

    def __exit__(self, *exc):
        del self.rt.transfer


def _get_in_thread(cl, keys, metas):
    box: dict = {}

    def run():
        try:
            box["value"] = cl.get(keys, custom_backend_meta=metas)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def test_clear_during_get_waits_for_the_lease(agent):
    cl = _client(agent)
    x = _batch(4, rows=2, cols=4096)
    keys = ["0@x", "1@x"]
    metas = cl.put(keys, list(x))
    with _SlowReads(cl.runtime, 0.6) as slow:
        th, box = _get_in_thread(cl, keys, metas)
        assert slow.inside.wait(10), "the get never reached its copy"
        t0 = time.monotonic()
        cl.clear(keys, metas)  # the reader holds a lease: the clear waits for it
        waited = time.monotonic() - t0
        th.join(10)
    assert not th.is_alive()
    assert "error" not in box, box.get("error")
    assert all(torch.equal(a, b) for a, b in zip(box["value"], x))
    assert waited > 0.2, f"clear returned after {waited:.3f} s while a lease was held"
    with pytest.raises(StaleReferenceError):
        cl.get(keys, custom_backend_meta=metas)


def test_clear_during_get_that_outlasts_the_wait_fails_the_get(agent):
    reader = _client(agent)
    clearer = _client(agent, clear_timeout=0.05)  # gives up waiting for the reader's lease
    x = _batch(5, rows=2, cols=4096)
    keys = ["0@y", "1@y"]
    metas = reader.put(keys, list(x))
    with _SlowReads(reader.runtime, 0.6) as slow:
        th, box = _get_in_thread(reader, keys, metas)
        assert slow.inside.wait(10), "the get never reached its copy"
        clearer.clear(keys, metas)
        th.join(10)
    assert not th.is_alive()
    # The clear zeroed the items' words while the reader was copying: its after-copy check
    # fails with an error naming the keys instead of returning bytes of a cleared item.
    assert "value" not in box, "a get raced by a clear returned data"
    assert isinstance(box["error"], StaleReferenceError), repr(box["error"])
    assert "@y" in str(box["error"]) and "during the read" in str(box["error"])


@pytest.mark.multiproc
def test_data_survives_the_putters_exit(agent):
    script = textwrap.dedent(f"""
        import os, pickle, sys, torch
        from memsem.integrations import transferqueue as mtq
        cl = mtq.MemsemStorageClient({{"agent_address": {agent.address!r}, "agent_authkey": {agent.authkey.hex()!r},
                                      "job": {agent.job!r}}})
        g = torch.Generator().manual_seed(7)
        x = torch.randn(8, 1024, generator=g)
        metas = cl.put([f"{{i}}@x" for i in range(8)], list(x))
        sys.stdout.buffer.write(pickle.dumps((os.getpid(), metas)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    pid, metas = pickle.loads(proc.stdout)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    # Past two of the agent's dead-putter passes after the putter's death (counted, not timed):
    # committed regions are kept.
    passes = _stats(agent)["reap_passes"]
    deadline = time.monotonic() + 60
    while _stats(agent)["reap_passes"] < passes + 2:
        assert time.monotonic() < deadline, "the agent's housekeeping never ran"
        time.sleep(0.05)
    cl = _client(agent)
    keys = [f"{i}@x" for i in range(8)]
    got = cl.get(keys, custom_backend_meta=metas)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip(got, x))
    cl.clear(keys, metas)


def test_clears_release_the_memory(agent):
    cl = _client(agent)
    base = _stats(agent)
    metas = cl.put(["0@z", "1@z"], list(_batch(9)[:2]))
    assert _stats(agent)["regions"] == base["regions"] + 1
    cl.clear(["0@z", "1@z"], metas)
    deadline = time.monotonic() + 5
    while _stats(agent)["regions"] != base["regions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    st = _stats(agent)
    assert st["regions"] == base["regions"] and st["retire_pending"] == 0


def test_failed_put_frees_its_region(agent, monkeypatch):
    cl = _client(agent)
    base = _stats(agent)
    rt = cl.runtime

    def broken(spec, kind, offset, local, *, lease=None):
        raise OSError("injected failure")

    monkeypatch.setattr(rt, "transfer", broken)
    with pytest.raises(OSError, match="injected"):
        cl.put(["0@w"], [torch.ones(8)])
    monkeypatch.undo()
    st = _stats(agent)
    assert st["aborts"] == base["aborts"] + 1 and st["regions"] == base["regions"]


# -- checkpoints and agent restarts (tq.save_checkpoint / tq.load_checkpoint underneath) ---------
def _fresh_agent(tag: str):
    return start_agent(job=f"tqtest-{os.getpid()}-{tag}", timeout=60)


def test_checkpoint_survives_an_agent_restart(tmp_path):
    first = _fresh_agent("a")
    try:
        cl = _client(first)
        x = _batch(11, rows=4, cols=1024)
        keys = [f"{i}@x" for i in range(4)] + ["0@txt", "1@txt"]
        metas = cl.put(keys, list(x) + ["hello", {"k": 1}])
        st = cl.save_checkpoint(str(tmp_path))
        assert st["regions"] == 1 and st["items"] == 6
        assert (tmp_path / "memsem_storage" / "index.json").exists()
        cl.close()
    finally:
        first.stop()
    second = _fresh_agent("b")
    try:
        cl = _client(second)
        # The old metas name a window of the stopped agent: without a load there is nothing.
        with pytest.raises(StaleReferenceError, match="not held by the storage agent"):
            cl.get(keys, custom_backend_meta=metas)
        st = cl.load_checkpoint(str(tmp_path))
        assert st == {"regions": 1, "kept": 0, "items": 6}
        got = cl.get(keys, custom_backend_meta=metas)  # the metas TQ restores, unchanged
        assert all(torch.equal(a, b) for a, b in zip(got[:4], x))
        assert got[4:] == ["hello", {"k": 1}]
        # New puts in the restored agent never reuse a restored item's generation.
        new = cl.put(["9@x"], [x[0]])
        assert new[0]["g"] not in {m["g"] for m in metas} and new[0]["rid"] != metas[0]["rid"]
        # Clears work on restored items (named by region id and generation).
        cl.clear(keys[:2], metas[:2])
        with pytest.raises(StaleReferenceError, match="0@x"):
            cl.get(keys[:1], custom_backend_meta=metas[:1])
        assert torch.equal(cl.get(keys[2:3], custom_backend_meta=metas[2:3])[0], x[2])
        cl.clear(keys + ["9@x"], metas + new)
        cl.close()
    finally:
        second.stop()


def test_checkpoint_holds_committed_items_and_restores_cleared_ones(agent, tmp_path):
    cl = _client(agent)
    x = _batch(12, rows=3, cols=512)
    keys = ["0@c", "1@c", "2@c"]
    metas = cl.put(keys, list(x))
    cl.clear(keys[:1], metas[:1])  # cleared before the save: not in the checkpoint
    st = cl.save_checkpoint(str(tmp_path))
    assert st["items"] >= 2
    cl.clear(keys[1:2], metas[1:2])  # cleared after the save, region still held
    with pytest.raises(StaleReferenceError):
        cl.get(keys[1:2], custom_backend_meta=metas[1:2])
    st = cl.load_checkpoint(str(tmp_path))
    assert st["kept"] >= 1
    assert torch.equal(cl.get(keys[1:2], custom_backend_meta=metas[1:2])[0], x[1])
    assert torch.equal(cl.get(keys[2:3], custom_backend_meta=metas[2:3])[0], x[2])
    with pytest.raises(StaleReferenceError, match="0@c"):  # never saved: never comes back
        cl.get(keys[:1], custom_backend_meta=metas[:1])
    cl.clear(keys, metas)


def test_checkpoint_of_freed_regions_restores_into_new_windows(agent, tmp_path):
    cl = _client(agent)
    x = _batch(13, rows=2, cols=256)
    keys = ["0@f", "1@f"]
    metas = cl.put(keys, list(x))
    cl.save_checkpoint(str(tmp_path))
    cl.clear(keys, metas)  # the region is freed: its window generation moves
    with pytest.raises(StaleReferenceError):
        cl.get(keys, custom_backend_meta=metas)
    assert cl.load_checkpoint(str(tmp_path))["regions"] >= 1
    got = cl.get(keys, custom_backend_meta=metas)
    assert all(torch.equal(a, b) for a, b in zip(got, x))
    other = _client(agent)  # another client finds the region by its id too
    assert torch.equal(other.get(keys[1:], custom_backend_meta=metas[1:])[0], x[1])
    cl.clear(keys, metas)


def test_damaged_checkpoint_restores_nothing(agent, tmp_path):
    import json

    cl = _client(agent)
    a = cl.put(["0@d"], [_batch(14)[0]])
    b = cl.put(["1@d"], [_batch(15)[0]])
    cl.save_checkpoint(str(tmp_path))
    cl.clear(["0@d", "1@d"], a + b)
    before = _stats(agent)["regions"]
    folder = tmp_path / "memsem_storage"
    files = sorted(folder.glob("r*.bin"))
    assert len(files) >= 2
    raw = bytearray(files[-1].read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in the last region's data
    files[-1].write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="CRC-32"):
        cl.load_checkpoint(str(tmp_path))
    assert _stats(agent)["regions"] == before  # not even the intact region came back
    with pytest.raises(StaleReferenceError):
        cl.get(["0@d"], custom_backend_meta=a)
    index = json.loads((folder / "index.json").read_text())
    index["version"] = 99
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="version"):
        cl.load_checkpoint(str(tmp_path))
    (folder / "index.json").unlink()
    with pytest.raises(FileNotFoundError, match="index"):
        cl.load_checkpoint(str(tmp_path))
