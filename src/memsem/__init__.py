"""memsem: memory semantics for remote tensors.

Wrap an existing tensor as a window, hand its small serialized ref to anyone, and get / put /
xcopy byte ranges and tiles of it one-sidedly, with generation and lease checks, topology-aware
engines and tile-ready events. See docs/architecture.md.
"""
from memsem._errors import (
    AccessDeniedError,
    AddressInUseError,
    DigestMismatchError,
    EngineError,
    LeaseExpiredError,
    LeaseHeldError,
    MemsemError,
    MemsemTimeoutError,
    NameHeldError,
    NotSupportedError,
    OutOfMemoryError,
    OwnerWriteError,
    PeerLostError,
    RuntimeClosedError,
    StaleReferenceError,
    VersionGoneError,
    WindowNotFoundError,
    WindowRetiredError,
)
from memsem.refs import (
    FieldRef,
    FieldSchema,
    FieldSet,
    Followable,
    Follower,
    Runtime,
    StateDictLayout,
    StateDictRef,
    StreamBucket,
    TensorRef,
    Versioned,
    default_runtime,
)
from memsem.refs import FanoutPlan, FanoutSource, LinkModel, Relay, RelayStats, fanout_plan, model_time
from memsem.core import Batch, Completion, Lease, RangeResult, State, Stats, WriteSection
from memsem import sync as _sync  # noqa: F401 - installs the delta versions state dicts use

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError", "AddressInUseError", "Batch", "DigestMismatchError", "FanoutPlan", "FanoutSource", "LinkModel", "Relay",
    "RelayStats", "fanout_plan", "model_time", "Completion", "EngineError", "FieldRef", "FieldSchema", "FieldSet", "Followable", "Follower",
    "Lease", "LeaseExpiredError",
    "LeaseHeldError", "MemsemError", "MemsemTimeoutError", "NameHeldError", "NotSupportedError", "OutOfMemoryError",
    "OwnerWriteError", "PeerLostError", "RangeResult", "Runtime", "RuntimeClosedError", "StateDictLayout", "StateDictRef", "StaleReferenceError", "State", "Stats", "StreamBucket", "TensorRef",
    "VersionGoneError", "Versioned", "WindowNotFoundError", "WindowRetiredError", "WriteSection", "default_runtime", "__version__",
]
