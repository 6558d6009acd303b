"""Refs layer: TensorRef, FieldRef, FieldSet, StateDictRef and the user-facing Runtime."""
from memsem.refs._fanout_plan import FanoutPlan, LinkModel, model_time, plan as fanout_plan
from memsem.refs._fields import FieldRef, FieldSchema, FieldSet
from memsem.refs._relay import FanoutSource, Relay, RelayStats
from memsem.refs._follow import Followable, Follower
from memsem.refs._runtime import Runtime, default_runtime
from memsem.refs._state_dict import StateDictLayout, StateDictRef, StateDictSection, StreamBucket, TensorEntry
from memsem.refs._tensorref import TensorRef, Versioned

__all__ = ["FanoutPlan", "FanoutSource", "LinkModel", "Relay", "RelayStats", "fanout_plan", "model_time",
           "FieldRef", "FieldSchema", "FieldSet", "Followable", "Follower", "Runtime", "StateDictLayout", "StateDictRef", "StateDictSection",
           "StreamBucket", "TensorEntry", "TensorRef", "Versioned", "default_runtime"]
