"""The core layer: ``RuntimeCore`` and its parts (publish, resolve, lease, get/put/xcopy,
readiness, versions, grants, telemetry); ``memsem.Runtime`` is this class plus the entry points
of the layers above it.

One concern per module (``tests/test_layers.py`` checks that each imports only those before it;
the table is in docs/architecture.md).
"""
from memsem.core._bracket import ATTENTION, Outcome, Status, settle
from memsem.core._completion import Batch, Completion, RangeResult, State
from memsem.core._runtime_core import (CLOSE_TIMEOUT, DEFAULT_TIMEOUT, RuntimeCore, current_runtime, default_engines,
                                      default_runtime, set_runtime_class, window_of)
from memsem.core._gc import collect
from memsem.core._lease import Lease
from memsem.core._sections import CommitWatch, CommittedSlots, WriteSection
from memsem.core._telemetry import Stats
from memsem.core._routes import ROUTE_STALE, CopyRoute, PlanRoute, WireRoute
from memsem.core._wait import Wait

__all__ = ["CommitWatch", "CommittedSlots", "ATTENTION", "Outcome", "Status", "settle", "Batch", "Completion", "RangeResult", "State", "collect", "CLOSE_TIMEOUT", "DEFAULT_TIMEOUT",
           "Lease", "PlanRoute", "ROUTE_STALE", "CopyRoute", "WireRoute", "RuntimeCore", "current_runtime", "default_runtime", "default_engines",
           "set_runtime_class", "window_of", "Stats", "Wait", "WriteSection"]
