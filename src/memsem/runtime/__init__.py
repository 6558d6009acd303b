"""Runtime layer: publish, resolve, lease, get/put/xcopy, route selection, telemetry.

One concern per module (``tests/test_layers.py`` checks that each imports only those before it):
``_telemetry``, ``_completion``, ``_staging``, ``_liveness``, ``_translate`` (leaves), ``_resolve``
(resolutions and their lifetimes), ``_lease``, ``_transfer`` (the data path), ``_view``,
``_readiness`` (ready words), ``_versions`` (versions: latest, waits, pins, gathers), ``_publish`` (the owner side), ``_serve`` (grants of owner-checked
engines), ``_core`` (the runtime that composes them), ``_gc``.
"""
from memsem.runtime._completion import Batch, Completion, RangeResult, State
from memsem.runtime._core import CLOSE_TIMEOUT, DEFAULT_TIMEOUT, RuntimeCore, current_core
from memsem.runtime._gc import collect
from memsem.runtime._lease import Lease
from memsem.runtime._publish import WriteSection
from memsem.runtime._telemetry import Stats

__all__ = ["Batch", "Completion", "RangeResult", "State", "collect", "CLOSE_TIMEOUT", "DEFAULT_TIMEOUT",
           "Lease", "RuntimeCore", "current_core", "Stats", "WriteSection"]
