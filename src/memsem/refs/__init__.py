"""Refs layer: TensorRef, FieldRef, FieldSet, StateDictRef and the user-facing Runtime."""
from memsem.refs._fields import FieldRef, FieldSchema, FieldSet
from memsem.refs._follow import Followable, Follower
from memsem.refs._runtime import Runtime, default_runtime
from memsem.refs._state_dict import StateDictLayout, StateDictRef, StateDictSection, StreamBucket, TensorEntry
from memsem.refs._tensorref import TensorRef, Versioned

__all__ = ["FieldRef", "FieldSchema", "FieldSet", "Followable", "Follower", "Runtime", "StateDictLayout", "StateDictRef", "StateDictSection",
           "StreamBucket", "TensorEntry", "TensorRef", "Versioned", "default_runtime"]
