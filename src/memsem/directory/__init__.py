"""Directory layer: where windows are published (``local`` by default, ``redis://`` for many
nodes, ``ray`` inside a Ray job)."""
from __future__ import annotations

import os
from typing import Any, Callable

from memsem.directory._base import Directory, Member, MemberState
from memsem.directory.local import LocalDirectory, default_job


def choose_url(url: str | None = None) -> tuple[str, str]:
    """``(url, why)``: the directory a Runtime opens for ``url`` (None: ``MEMSEM_DIRECTORY``;
    else ``ray`` when this process runs inside a Ray job, else ``local``). Never imports Ray."""
    if url:
        return url, "named by the caller"
    env = os.environ.get("MEMSEM_DIRECTORY")
    if env:
        return env, "MEMSEM_DIRECTORY"
    from memsem.directory.ray import in_ray_job

    if in_ray_job():
        return "ray", "this process runs inside a Ray job"
    return "local", "the default (one node; inside a Ray job memsem would use 'ray')"


def spans_nodes(url: str) -> bool:
    """Whether directory ``url`` reaches other nodes (not ``local``)."""
    return not (url == "local" or url.startswith("local://"))


def open_directory(url: str | None, *, alive: Callable[[dict[str, Any]], bool], job: str | None = None) -> Directory:
    """Open the directory named by ``url`` (see :func:`choose_url`).

    Raises:
        ValueError: unknown scheme.
        NotSupportedError: the backend's client library is not installed (redis-py, Ray), or
            ``ray`` outside a Ray job.
    """
    url, _ = choose_url(url)
    if url == "local" or url.startswith("local://"):
        return LocalDirectory(job, alive=alive)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from memsem.directory.redis import RedisDirectory  # imports redis-py lazily

        return RedisDirectory(url, job=job, alive=alive)
    if url == "ray":
        from memsem.directory.ray import RayDirectory  # imports Ray lazily

        return RayDirectory(job=job, alive=alive)
    raise ValueError(f"directory must be 'local', 'ray' or 'redis://host:port/db', got {url!r}")


def child_env(url: str | None = None, job: str | None = None) -> dict[str, str]:
    """Environment variables a process started from this one (not a Ray worker itself) needs
    to open the same directory in the same job: for ``ray``, the job's Ray address and
    namespace and its memsem job (:func:`memsem.directory.ray.child_env`); else
    ``MEMSEM_DIRECTORY`` (and ``MEMSEM_JOB`` when ``job`` is given)."""
    url, _ = choose_url(url)
    if url == "ray":
        from memsem.directory.ray import child_env as ray_env

        return ray_env(job)
    out = {"MEMSEM_DIRECTORY": url}
    if job:
        out["MEMSEM_JOB"] = job
    return out


__all__ = ["Directory", "LocalDirectory", "Member", "MemberState", "child_env", "choose_url", "default_job",
           "open_directory", "spans_nodes"]
