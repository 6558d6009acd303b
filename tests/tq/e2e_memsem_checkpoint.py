"""TransferQueue checkpoints on the Memsem backend, end to end through TQ's own API (Ray, the TQ
controller and the memsem storage agent): the checks of TQ's checkpoint e2e file that look at
SimpleStorage's files, made for Memsem's files, and a restart of the storage agent
(``tq.close()`` + ``tq.init()``) between save and load, which TQ's file does not do.

Run by tests/tq/run_tq_e2e.sh (TQ venv, conftest_plugin) when the backend is Memsem; named so that
the core suite (no Ray there) does not collect it.
"""
from __future__ import annotations

import json
import logging
import os

import pytest
import ray
import torch
from omegaconf import OmegaConf
from tensordict import NonTensorStack, TensorDict

import memsem.integrations.transferqueue as mtq
import transfer_queue as tq

CONFIG = OmegaConf.create(mtq.E2E_BACKEND_CONFIG)


@pytest.fixture(scope="module")
def ray_init():
    if not ray.is_initialized():
        ray.init(namespace="TestMemsemCheckpointE2E")
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def tq_system(ray_init):
    tq.init(CONFIG)
    yield
    tq.close()


def _controller():
    return ray.get_actor("TransferQueueController", namespace="transfer_queue")


def _agent_pids() -> list[int]:
    return [a.pid for a in mtq._AGENTS]


def _put(partition: str, keys: list[str], seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (len(keys), 16), generator=g)
    mask = torch.rand(len(keys), 16, generator=g)
    text = NonTensorStack(*[f"sample {k}" for k in keys])
    tq.kv_batch_put(keys=keys, partition_id=partition,
                    fields=TensorDict({"input_ids": ids, "mask": mask, "text": text}, batch_size=len(keys)),
                    tags=[{"i": i} for i in range(len(keys))])
    return ids, mask


def _rows(t) -> list[torch.Tensor]:
    """A field as a list of rows (TQ may hand a batch back as a jagged nested tensor)."""
    return list(t.unbind()) if t.is_nested else list(t)


def same(a, b) -> bool:
    ra, rb = _rows(a), _rows(b)
    return len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb))


def _logged(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_save_writes_memsem_storage_files(tq_system, tmp_path, caplog):
    ck = tmp_path / "ck"
    ids, _ = _put("p_files", ["f0", "f1", "f2"], 1)
    with caplog.at_level(logging.INFO):
        tq.save_checkpoint(ck)
    assert not _logged(caplog, "does not support checkpoint")
    meta = json.loads((ck / "metadata.json").read_text())
    assert meta["storage_saved"] is True
    index = json.loads((ck / "memsem_storage" / "index.json").read_text())
    assert index["format"] == "memsem-transferqueue-storage" and index["version"] == 1
    assert sum(r["live"] for r in index["regions"]) >= 3 * 3  # 3 keys x 3 fields, committed
    for r in index["regions"]:
        assert (ck / "memsem_storage" / r["file"]).stat().st_size == r["nbytes"]
    ray.get(_controller().clear_partition.remote("p_files"))
    tq.load_checkpoint(ck)
    got = tq.kv_batch_get(keys=["f0", "f1", "f2"], partition_id="p_files")
    assert same(got["input_ids"], ids)


def test_data_survives_a_restart_of_the_storage_agent(ray_init, tmp_path, caplog):
    ck = tmp_path / "ck"
    tq.init(CONFIG)
    try:
        keys = [f"r{i}" for i in range(6)]
        ids, mask = _put("p_restart", keys, 2)
        _put("p_other", ["o0"], 3)
        tq.save_checkpoint(ck, metadata={"step": 7})
        old_agents = _agent_pids()
    finally:
        with caplog.at_level(logging.WARNING):
            tq.close()  # stops the storage agent: its memory is gone
    assert not _logged(caplog, "not supported"), "tq.close() warned about the Memsem backend"
    assert old_agents and all(not os.path.exists(f"/proc/{pid}") or
                              open(f"/proc/{pid}/stat").read().split()[2] == "Z" for pid in old_agents)
    assert not mtq._AGENTS

    tq.init(CONFIG)  # a new controller and a new, empty storage agent
    try:
        assert _agent_pids() and set(_agent_pids()).isdisjoint(old_agents)
        assert ray.get(_controller().list_partitions.remote()) == []
        tq.load_checkpoint(ck)
        assert {"p_restart", "p_other"} <= set(ray.get(_controller().list_partitions.remote()))
        got = tq.kv_batch_get(keys=keys, partition_id="p_restart")
        assert same(got["input_ids"], ids) and same(got["mask"], mask)
        assert list(got["text"]) == [f"sample {k}" for k in keys]
        snap = ray.get(_controller().get_partition_snapshot.remote("p_restart"))
        assert [snap.custom_meta[snap.keys_mapping[k]]["i"] for k in keys] == list(range(6))
        # The restored data lives in the new agent: clear and put work as before.
        tq.kv_clear(keys=keys[:3], partition_id="p_restart")
        ids2, _ = _put("p_restart", keys[:3], 4)
        got = tq.kv_batch_get(keys=keys, partition_id="p_restart", select_fields=["input_ids"])
        rows = _rows(got["input_ids"])
        assert same(torch.stack(rows[:3]), ids2) and same(torch.stack(rows[3:]), ids[3:])
    finally:
        tq.close()


def test_include_storage_false_saves_no_storage(tq_system, tmp_path):
    ck = tmp_path / "ck"
    ids, _ = _put("p_nostore", ["n0", "n1"], 5)
    tq.save_checkpoint(ck, include_storage=False)
    assert json.loads((ck / "metadata.json").read_text())["storage_saved"] is False
    assert not (ck / "memsem_storage").exists()
    # The agent still holds the data: restoring the controller alone finds it again.
    ray.get(_controller().clear_partition.remote("p_nostore"))
    tq.load_checkpoint(ck)
    got = tq.kv_batch_get(keys=["n0", "n1"], partition_id="p_nostore", select_fields=["input_ids"])
    assert same(got["input_ids"], ids)


def test_damaged_storage_files_fail_the_load(tq_system, tmp_path):
    ck = tmp_path / "ck"
    _put("p_bad", ["b0"], 6)
    tq.save_checkpoint(ck)
    index_path = ck / "memsem_storage" / "index.json"
    index = json.loads(index_path.read_text())
    index["format"] = "something-else"
    index_path.write_text(json.dumps(index))
    with pytest.raises(Exception, match="not valid"):
        tq.load_checkpoint(ck)
    index["format"] = "memsem-transferqueue-storage"
    index_path.write_text(json.dumps(index))
    data = ck / "memsem_storage" / index["regions"][0]["file"]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="CRC-32"):
        tq.load_checkpoint(ck)
