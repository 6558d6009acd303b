"""Sync layer: weight sync across owners (state dicts, sharded and delta versions, reshard plans,
follow, relays, fan-out), built on refs (docs/architecture.md)."""

__all__: list[str] = []
