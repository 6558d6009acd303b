"""Refs layer: TensorRef, FieldRef, FieldSet, StateDictRef and the user-facing Runtime."""
from memsem.refs._fields import FieldRef, FieldSchema, FieldSet
from memsem.refs._runtime import Runtime, default_runtime
from memsem.refs._state_dict import StateDictLayout, StateDictRef, StateDictSection, TensorEntry
from memsem.refs._tensorref import TensorRef

__all__ = ["FieldRef", "FieldSchema", "FieldSet", "Runtime", "StateDictLayout", "StateDictRef", "StateDictSection",
           "TensorEntry", "TensorRef", "default_runtime"]
