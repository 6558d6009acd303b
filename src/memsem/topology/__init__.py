"""Topology: what can reach what, at what cost, and why a route was chosen.

A route is chosen per (consumer, window) from the window's engine-tagged descriptors, the two
ends' locations and the engines available here. Reachability rules (never guessed across
nodes: shared memory and cross-memory attach are only used between processes with the same node
id):

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
    """Every route that reaches the window, and why the others do not."""
    costs = costs or {}
    ok: list[Route] = []
    no: list[tuple[str, str]] = []
    same_node = me.node == owner.node
    for engine, desc in descriptors.items():
        avail = available.get(engine)
        if avail is None:
            no.append((engine, "engine not configured in this runtime"))
            continue
        if not avail:
            no.append((engine, f"unavailable here: {avail.reason}"))
            continue
        f = desc.fields
        if engine == "loopback":
            if same_node and me.pid == owner.pid:
                a, b = _cost("loopback", costs)
                ok.append(Route(engine, "loopback", "the window lives in this process", a, b, True))
            else:
                no.append((engine, "the owner is another process"))
        elif engine == "host":
            if not same_node:
                no.append((engine, f"owner is on node {owner.node!r}, this process on {me.node!r}"))
                continue
            kind = "host/shm" if f.get("kind") == "shm" else "host/cma"
            a, b = _cost(kind, costs)
            why = ("same node, window in a shared segment" if kind == "host/shm"
                   else "same node, private memory of another process (cross-memory attach)")
            ok.append(Route(engine, kind, why, a, b, kind == "host/shm"))
        elif engine == "mte":
            team = f.get("team")
            if team is not None and me.attrs.get("shmem_team") == team:
                a, b = _cost("mte", costs)
                ok.append(Route(engine, "mte", f"both ends are PEs of SHMEM team {team!r} with MTE reach",
                                a, b, bool(f.get("mapped", False))))
            else:
                no.append((engine, f"this process is not a PE of SHMEM team {team!r}"))
        elif engine == "rdma":
            if not me.attrs.get("rdma_port"):
                no.append((engine, "this process has no active RDMA port"))
            elif same_node and not f.get("force", False):
                no.append((engine, "same node: shared memory is cheaper than the NIC"))
            else:
                a, b = _cost("rdma", costs)
                ok.append(Route(engine, "rdma", f"different nodes ({me.node!r} -> {owner.node!r}), "
                                f"active ports {me.attrs.get('rdma_port')} and {f.get('port')}", a, b, False))
        elif engine == "tcp":
            a, b = _cost("tcp", costs)
            ok.append(Route(engine, "tcp", f"owner serves TCP at {f.get('endpoint')}", a, b, False))
        else:
            a, b = costs.get(engine, (100e-6, 1e9))
            ok.append(Route(engine, engine, "third-party engine", a, b, False))
    if any(r.engine == "mte" for r in ok):
        # A window in the SHMEM symmetric heap is NPU memory on hardware: cross-memory attach
        # of its (device) address would read garbage, so the team's MTE route takes it.
        for r in [r for r in ok if r.kind == "host/cma"]:
            ok.remove(r)
            no.append((r.engine, "the window lives in the SHMEM symmetric heap (NPU memory on "
                                 "hardware): reached through mte, not cross-memory attach"))
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
        pick = min(ok, key=lambda r: r.cost(nbytes))
    rejected = tuple(no) + tuple((r.engine, f"modeled slower ({r.kind})") for r in ok if r is not pick)
    return dataclasses.replace(pick, rejected=rejected)


def here(attrs: Mapping[str, Any] | None = None) -> Location:
    from memsem.native import node_id

    return Location(node_id(), os.getpid(), dict(attrs or {}))


__all__ = ["DEFAULT_COSTS", "Location", "Route", "candidates", "choose_route", "here"]
