"""Refs layer: TensorRef, FieldRef, FieldSet (user-facing, serializable; wrap numpy / torch / DLPack)."""
from memsem.refs._fields import FieldRef, FieldSchema
from memsem.refs._fieldset import FieldSet
from memsem.refs._tensorref import TensorRef, Versioned

__all__ = ["FieldRef", "FieldSchema", "FieldSet", "TensorRef", "Versioned"]
