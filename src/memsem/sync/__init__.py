"""Sync layer: weight sync across owners (state dicts, sharded and delta versions, reshard plans,
follow, relays, fan-out), built on refs (docs/architecture.md)."""
from memsem.sync._fanout_plan import FanoutPlan, LinkModel, model_time, plan as fanout_plan
from memsem.sync._fanout_source import FanoutSource
from memsem.sync._follow import Followable, Follower
from memsem.sync._relay import Relay, RelayStats
from memsem.sync._state_dict import StateDictLayout, StateDictRef, StateDictSection, StreamBucket, TensorEntry

__all__ = ["FanoutPlan", "FanoutSource", "Followable", "Follower", "LinkModel", "Relay", "RelayStats",
           "StateDictLayout", "StateDictRef", "StateDictSection", "StreamBucket", "TensorEntry", "fanout_plan",
           "model_time"]
