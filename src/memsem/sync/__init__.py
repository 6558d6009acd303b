"""Sync layer: weight sync across owners (state dicts, sharded and delta versions, reshard plans,
follow, relays, fan-out), built on refs (docs/architecture.md).

Delta versions (``memsem.sync._delta``) are what ``StateDictRef`` uses for its history and for
``load(base=)``: the refs layer below reaches them only through the ``DeltaVersions`` this
package installs when it is imported (``import memsem`` imports it).
"""
from memsem.sync import _delta

_delta.install()

__all__: list[str] = []
