"""The directory interface: where windows are published and owners announce liveness.

A directory stores JSON-able records (window descriptors, rank records); it never holds tensor
data. It knows nothing about what a record means: the GVA layer above parses them.
"""
from __future__ import annotations

import abc
import re
from typing import Any

from memsem._errors import NotSupportedError

_ENTRY_KEY = re.compile(r"[A-Za-z0-9._/-]{1,200}")


def check_entry_key(key: str) -> str:
    """Validate an entry key: 1..200 characters of ``[A-Za-z0-9._/-]`` (ValueError otherwise)."""
    if not isinstance(key, str) or not _ENTRY_KEY.fullmatch(key):
        raise ValueError(f"entry key must be 1..200 characters of [A-Za-z0-9._/-], got {key!r}")
    return key


class Directory(abc.ABC):
    """Control-plane store. Implementations: ``local`` (one machine, no server), ``redis``."""

    url: str = ""

    @abc.abstractmethod
    def claim_rank(self, record: dict[str, Any]) -> int:
        """Reserve a free rank for a new runtime (reaping ranks of dead owners); returns it."""

    @abc.abstractmethod
    def release_rank(self, rank: int) -> None:
        """Give up a rank claimed by this runtime."""

    @abc.abstractmethod
    def rank_record(self, rank: int) -> dict[str, Any] | None:
        """The record of a rank, or None when no runtime holds it."""

    @abc.abstractmethod
    def put_window(self, gva: int, name: str, record: dict[str, Any]) -> None:
        """Publish (or replace) the record of window ``gva``; ``name`` ("" for none) aliases it."""

    @abc.abstractmethod
    def remove_window(self, gva: int, name: str) -> None:
        """Remove a window record and its name alias if it still points at ``gva``."""

    @abc.abstractmethod
    def get_window(self, gva: int) -> dict[str, Any] | None:
        """The record of window ``gva``, or None."""

    @abc.abstractmethod
    def lookup(self, name: str) -> int | None:
        """GVA of the window published under ``name``, or None."""

    @abc.abstractmethod
    def windows(self) -> list[dict[str, Any]]:
        """Every window record (for ``memsem topo``/``gc``)."""

    @abc.abstractmethod
    def ranks(self) -> dict[int, dict[str, Any]]:
        """Every rank record."""

    # -- small records for engines' connection setup (e.g. RDMA QP exchange) --------------------
    def put_entry(self, key: str, record: dict[str, Any]) -> None:
        """Store (or replace) a small JSON-able ``record`` under ``key`` (``[A-Za-z0-9._/-]``).

        Engines use entries to rendezvous (the rdma engine exchanges QP numbers and GIDs); the
        directory does not interpret them. Raises NotSupportedError where a backend lacks them."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} stores no entries")

    def get_entry(self, key: str) -> dict[str, Any] | None:
        """The record stored under ``key``, or None."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} stores no entries")

    def remove_entry(self, key: str) -> None:
        """Remove ``key`` if present."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} stores no entries")

    def entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every entry whose key starts with ``prefix``, by key."""
        raise NotSupportedError(f"directory {self.url or type(self).__name__} stores no entries")

    def heartbeat(self, rank: int) -> None:
        """Refresh this rank's liveness (no-op where pid liveness is enough)."""

    def close(self) -> None:
        """Release connections; safe twice."""

    def __enter__(self) -> "Directory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
