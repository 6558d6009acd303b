"""Directory layer: where windows are published (``local`` by default, ``redis://`` for many nodes)."""
from __future__ import annotations

import os
from typing import Any, Callable

from memsem.directory._base import Directory, Member, MemberState
from memsem.directory.local import LocalDirectory, default_job


def open_directory(url: str | None, *, alive: Callable[[dict[str, Any]], bool], job: str | None = None) -> Directory:
    """Open the directory named by ``url`` (or ``MEMSEM_DIRECTORY``; ``local`` by default).

    Raises:
        ValueError: unknown scheme.
        NotSupportedError: the backend's client library is not installed.
    """
    url = url or os.environ.get("MEMSEM_DIRECTORY") or "local"
    if url == "local" or url.startswith("local://"):
        return LocalDirectory(job, alive=alive)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from memsem.directory.redis import RedisDirectory  # imports redis-py lazily

        return RedisDirectory(url, job=job, alive=alive)
    raise ValueError(f"directory must be 'local' or 'redis://host:port/db', got {url!r}")


__all__ = ["Directory", "LocalDirectory", "Member", "MemberState", "default_job", "open_directory"]
