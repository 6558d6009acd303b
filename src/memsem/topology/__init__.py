"""Topology: what can reach what, at what cost, and why a route was chosen.

A route is chosen per (consumer, window) from the window's engine-tagged descriptors, the two
ends' locations and the engines available here. Each engine states its own reachability rule
(``Engine.reach``); they are, for the built-in engines (never guessed across nodes: shared
memory and cross-memory attach are only used between processes with the same node id):

=========  ==================================================================================
engine     reaches the window when
=========  ==================================================================================
loopback   same node and same pid
host       same node (``shm`` descriptor: any same-user process; ``cma``: same user, ptrace
           scope allows process_vm_readv)
mte        both ends are PEs of one SHMEM team with MTE reach (same server id / super-pod);
           it then also excludes host/cma for that window (symmetric heap = NPU memory)
rdma       different nodes (or forced) and both ends have an active RDMA port
tcp        any node whose owner serves TCP
=========  ==================================================================================

Costs are ``alpha + nbytes / beta`` per engine (seconds); defaults below are modest figures for
this class of machine and are replaced by measured ones when ``memsem bench`` calibrates.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from memsem._errors import NotSupportedError
from memsem.engines._base import Availability, Descriptor

#: engine -> (alpha seconds, beta bytes/second); measured defaults on a 2-core x86 VM.
DEFAULT_COSTS: dict[str, tuple[float, float]] = {
    "loopback": (0.5e-6, 8e9),
    "host/shm": (1.0e-6, 8e9),
    "host/cma": (2.0e-6, 6e9),
    "mte": (10e-6, 50e9),
    "rdma": (5e-6, 10e9),
    "tcp": (40e-6, 1.5e9),
}


@dataclasses.dataclass(frozen=True)
class Location:
    """Where a process is: node id, pid, and optional fabric attributes.

    Attributes:
        node: node identity (``MEMSEM_NODE_ID`` or hostname + boot id).
        pid: process id on that node.
        attrs: fabric facts, e.g. ``{"shmem_team": "...", "rdma_port": "rxe0/1"}``.
    """

    node: str
    pid: int
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Route:
    """The chosen way to reach one window.

    Attributes:
        engine: engine name. kind: e.g. ``host/shm``. reason: why it was chosen.
        alpha: latency in seconds. beta: bandwidth in bytes/second.
        zero_copy: whether ``view()`` can work on this route.
        rejected: ``(engine, why not)`` for every engine considered and not chosen.
    """

    engine: str
    kind: str
    reason: str
    alpha: float
    beta: float
    zero_copy: bool
    rejected: tuple[tuple[str, str], ...] = ()

    def cost(self, nbytes: int) -> float:
        """Modeled seconds to move ``nbytes``."""
        return self.alpha + nbytes / self.beta

    def explain(self) -> str:
        lines = [f"route {self.kind} via engine {self.engine!r}: {self.reason}",
                 f"  model: {self.alpha * 1e6:.1f} us + bytes / {self.beta / 1e9:.1f} GB/s; "
                 f"view(): {'zero-copy' if self.zero_copy else 'not possible'}"]
        lines += [f"  not {e}: {why}" for e, why in self.rejected]
        return "\n".join(lines)


def _cost(kind: str, costs: Mapping[str, tuple[float, float]]) -> tuple[float, float]:
    return costs.get(kind) or DEFAULT_COSTS[kind]


def candidates(me: Location, owner: Location, descriptors: Mapping[str, Descriptor],
               available: Mapping[str, Availability],
               costs: Mapping[str, tuple[float, float]] | None = None) -> tuple[list[Route], list[tuple[str, str]]]:
    """Every route that reaches the window, and why the others do not.

    Each engine's own rule decides (``Engine.reach``); this function only collects the answers,
    applies the cost model and the engines' exclusions (e.g. mte excludes host/cma).
    """
    from memsem.engines import engine_class

    costs = costs or {}
    ok: list[Route] = []
    no: list[tuple[str, str]] = []
    excluded: dict[str, str] = {}
    for engine, desc in descriptors.items():
        avail = available.get(engine)
        if avail is None:
            no.append((engine, "engine not configured in this runtime"))
            continue
        if not avail.ok:
            no.append((engine, f"unavailable here: {avail.reason}"))
            continue
        try:
            cls = engine_class(engine)
        except (ValueError, NotSupportedError) as exc:
            no.append((engine, str(exc)))
            continue
        got = cls.reach(me, owner, desc, None)  # a corrupt descriptor: ValueError naming the field
        if isinstance(got, str):
            no.append((engine, got))
            continue
        kind, why, zero_copy = got
        a, b = costs.get(kind) or DEFAULT_COSTS.get(kind) or (100e-6, 1e9)
        ok.append(Route(engine, kind, why, a, b, zero_copy))
        excluded.update(cls.excludes)
    if excluded:
        for r in [r for r in ok if r.kind in excluded]:
            ok.remove(r)
            no.append((r.engine, excluded[r.kind]))
    return ok, no


def choose_route(me: Location, owner: Location, descriptors: Mapping[str, Descriptor],
                 available: Mapping[str, Availability], *, nbytes: int = 1 << 20,
                 prefer: str | None = None,
                 costs: Mapping[str, tuple[float, float]] | None = None) -> Route:
    """Pick the cheapest route for ``nbytes`` (or the engine named by ``prefer``).

    Raises:
        NotSupportedError: nothing reaches the window; the message lists every engine and why.
    """
    ok, no = candidates(me, owner, descriptors, available, costs)
    if prefer is not None:
        chosen = [r for r in ok if r.engine == prefer]
        if not chosen:
            why = dict(no).get(prefer, "the window has no descriptor for it")
            raise NotSupportedError(f"engine {prefer!r} was requested but cannot reach the window: {why}")
        pick = chosen[0]
    elif not ok:
        detail = "; ".join(f"{e}: {w}" for e, w in no) or "the window has no descriptors"
        raise NotSupportedError(f"no route reaches the window (owner node {owner.node!r} pid "
                                f"{owner.pid}): {detail}")
    else:
        pick = ok[0]
        for r in ok[1:]:
            if r.alpha + nbytes / r.beta < pick.alpha + nbytes / pick.beta:  # Route.cost, the model
                pick = r
    rejected = list(no)
    for r in ok:
        if r is not pick:
            rejected.append((r.engine, f"modeled slower ({r.kind})"))
    return Route(pick.engine, pick.kind, pick.reason, pick.alpha, pick.beta, pick.zero_copy, tuple(rejected))


def here(attrs: Mapping[str, Any] | None = None) -> Location:
    from memsem.native import node_id

    return Location(node_id(), os.getpid(), dict(attrs or {}))


__all__ = ["DEFAULT_COSTS", "Location", "Route", "candidates", "choose_route", "here"]
