"""Refs layer: TensorRef, FieldRef, FieldSet and the user-facing Runtime."""
from memsem.refs._runtime import Runtime, default_runtime
from memsem.refs._tensorref import TensorRef

__all__ = ["Runtime", "TensorRef", "default_runtime"]
