"""Testing code that uses memsem: a scripted engine for fault tests, and a pytest plugin.

* :class:`ScriptedEngine` wraps a real engine and slows, fails, reorders or holds its
  operations (``memsem.testing.ScriptedEngine(HostEngine(), delay=0.05)``), passed to
  ``Runtime(engine_objects={"host": ...})``.
* The pytest plugin (:mod:`memsem.testing.plugin`, registered through the ``pytest11`` entry
  point, so installing memsem is enough): the ``memsem_runtime`` and ``memsem_job`` fixtures.

Importing this package does not import pytest.
"""
from memsem.testing._scripted import ScriptedEngine

__all__ = ["ScriptedEngine"]
