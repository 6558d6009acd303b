"""Sync layer: weight sync across owners (state dicts, sharded and delta versions, reshard plans,
follow, relays, fan-out), built on refs (docs/architecture.md).

Delta versions (``memsem.sync._delta``) are what ``StateDictRef`` uses for its history and for
``load(base=)`` (installed into it when this package is imported: ``import memsem`` imports it).

Sharded state dicts (docs/weight-sync.md, "Sharded trainer, tensor-parallel rollout"): each
trainer rank publishes its shards (:func:`publish_sharded`); a reader looks the ranks up
(:func:`lookup_sharded`), states its target layout (:class:`Target`, :func:`tp_targets`) and
loads exactly its bytes of one version across ranks through a plan made once
(:class:`ShardedReader`, :func:`plan_reshard`).
"""
from memsem.sync import _delta
from memsem.sync._dtype import to_fp8
from memsem.sync._fanout_plan import FanoutPlan, LinkModel, model_time, plan as fanout_plan
from memsem.sync._fanout_source import FanoutSource
from memsem.sync._follow import Followable, Follower
from memsem.sync._relay import Relay, RelayStats
from memsem.sync._reshard import (
    Replicate,
    ReshardPlan,
    Shard,
    ShardedLayout,
    SourceShard,
    SourceTensor,
    Target,
    local_box,
    plan_reshard,
    tp_targets,
)
from memsem.sync._sharded import ShardedPublisher, publish_sharded
from memsem.sync._sharded_read import ShardedReader, ShardedStateDictRef, lookup_sharded
from memsem.sync._sharded_relay import ShardedRelay, ShardedRelayReader
from memsem.sync._state_dict import StateDictLayout, StateDictRef, StateDictSection, StreamBucket, TensorEntry

__all__ = ["FanoutPlan", "FanoutSource", "Followable", "Follower", "LinkModel", "Relay", "RelayStats",
           "Replicate", "ReshardPlan", "Shard", "ShardedLayout", "ShardedPublisher", "ShardedReader", "ShardedRelay", "ShardedRelayReader",
           "ShardedStateDictRef", "SourceShard", "SourceTensor", "StateDictLayout", "StateDictRef",
           "StateDictSection", "StreamBucket", "Target", "TensorEntry", "fanout_plan", "local_box",
           "lookup_sharded", "model_time", "plan_reshard", "publish_sharded", "to_fp8", "tp_targets"]

_delta.install()
