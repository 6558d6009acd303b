"""Refs layer: TensorRef, FieldRef, FieldSet, StateDictRef and the user-facing Runtime."""
from memsem.refs._fanout_plan import FanoutPlan, LinkModel, model_time, plan as fanout_plan
from memsem.refs._fields import FieldRef, FieldSchema, FieldSet
from memsem.refs._relay import FanoutSource, Relay, RelayStats
from memsem.refs._runtime import Runtime, default_runtime
from memsem.refs._state_dict import StateDictLayout, StateDictRef, StateDictSection, TensorEntry
from memsem.refs._tensorref import TensorRef

__all__ = ["FanoutPlan", "FanoutSource", "LinkModel", "Relay", "RelayStats", "fanout_plan", "model_time",
           "FieldRef", "FieldSchema", "FieldSet", "Runtime", "StateDictLayout", "StateDictRef", "StateDictSection",
           "TensorEntry", "TensorRef", "default_runtime"]
