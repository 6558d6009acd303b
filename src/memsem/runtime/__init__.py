"""Runtime layer: publish, resolve, lease, get/put/xcopy, route selection, telemetry."""
from memsem.runtime._completion import Batch, Completion, RangeResult, State
from memsem.runtime._gc import collect
from memsem.runtime._runtime import DEFAULT_TIMEOUT, Lease, RuntimeCore, current_core
from memsem.runtime._telemetry import Stats

__all__ = ["Batch", "Completion", "RangeResult", "State", "collect", "DEFAULT_TIMEOUT", "Lease",
           "RuntimeCore", "current_core", "Stats"]
