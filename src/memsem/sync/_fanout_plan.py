"""Fan-out plans and their time model: star, chain and k-ary tree (see docs/fanout.md).

A plan says, for each of ``world`` rollouts (ranks ``0 .. world - 1``), which upstream it reads
from: another rank (a relay) or the trainer (:data:`TRAINER`, -1). Ranks should be numbered so
that the rollouts of one node are consecutive: a chain then crosses each node boundary once,
and a tree keeps siblings together.

* ``star``: every rank reads from the trainer (the trainer's link carries ``world`` copies);
* ``chain``: rank 0 reads from the trainer, rank i from rank i - 1;
* ``tree``: rank 0 reads from the trainer, rank i from rank ``(i - 1) // degree`` (a
  ``degree``-ary heap under rank 0).

The model (all in seconds; ``model_bytes`` M, ``chunk_bytes`` b, ``bandwidth`` B bytes/s per
direction of each node's link, ``hop_latency`` a: the fixed time of one hop of one chunk:
the ready word's push, the request, the first byte back) gives the time until the last rank
holds a version, pipelined chunk by chunk:

* star: ``a + world * M / B`` (the trainer's uplink is shared by ``world`` readers);
* chain: ``world * (a + b / B) + (M - b) / B`` (the first chunk crosses ``world`` hops, the rest
  follow at the link rate);
* tree: the first hop at ``B``, every later hop shared by ``degree`` children:
  ``(a + b / B) + (d - 1) * (a + degree * b / B) + (M - b) * degree / B`` where ``d`` is the
  depth of the deepest rank.

:func:`plan` picks the kind with the smallest modelled time (chain wins while
``world * b`` is small against ``M``; a tree wins when the chain's hops add up: many ranks,
big chunks or long hops).
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from memsem import _args

#: the upstream "rank" of a rank that reads from the trainer
TRAINER = -1
KINDS = ("star", "chain", "tree")


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """What the model needs to know about the links.

    Attributes:
        bandwidth: payload bytes per second of one node's link, each direction.
        hop_latency: seconds of fixed cost per hop and chunk (push of the ready word, request,
            first byte back).
    """

    bandwidth: float
    hop_latency: float = 200e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", _rate(self.bandwidth, "bandwidth"))
        object.__setattr__(self, "hop_latency", _args.timeout(self.hop_latency, "hop_latency"))


def _rate(value: object, name: str) -> float:
    """A rate in bytes per second: a finite real number > 0 (``bool`` is not a number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of bytes per second, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number of bytes per second > 0, got {value!r}")
    return v


def kind_arg(value: object, kinds: tuple[str, ...], name: str = "kind") -> str:
    """One of ``kinds`` (a str; anything else is named)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {kinds} (a str), got {value!r} ({type(value).__name__})")
    if value not in kinds:
        raise ValueError(f"{name} must be one of {kinds}, got {value!r}")
    return value


def link_arg(value: object, name: str = "link") -> "LinkModel":
    """``value`` when it is a :class:`LinkModel` (TypeError naming ``name`` and the value)."""
    if not isinstance(value, LinkModel):
        raise TypeError(f"{name} must be a memsem.LinkModel, got {value!r:.80} ({type(value).__name__})")
    return value


def _depth(rank: int, degree: int) -> int:
    """Hops from the trainer to ``rank`` in a tree plan (rank 0: 1)."""
    d = 1
    while rank > 0:
        rank = (rank - 1) // degree
        d += 1
    return d


def chunks_in_flight(link: "LinkModel | None", chunk_bytes: int, most: int = 8) -> int:
    """Chunks a relay requests at once from its parent: with a link model, the fewest that keep
    the link busy, ``1 + ceil(hop_latency / chunk time)``, between 2 and ``most`` (each chunk
    more in flight delays every hop of a chain by one chunk's transfer: the parent's link sends
    the requests in turn); without one, 4."""
    most = _args.count(most, "most", minimum=1)
    chunk_bytes = _args.count(chunk_bytes, "chunk_bytes", minimum=1, maximum=_args.MAX_BYTES, unit="bytes")
    if link is None:
        return min(4, most)
    link = link_arg(link)
    hops = link.hop_latency / (chunk_bytes / link.bandwidth)  # round trips per chunk time (may be huge)
    return max(2, most if hops >= most else 1 + math.ceil(hops))


def model_time(kind: str, world: int, model_bytes: int, chunk_bytes: int, link: LinkModel, *,
               degree: int = 2) -> float:
    """Modelled seconds until all ``world`` ranks hold one version (see the module docstring).

    Raises:
        TypeError / ValueError: an unknown ``kind``, a count out of range, a ``link`` that is
            no ``LinkModel`` (named, with the value).
    """
    kind = kind_arg(kind, KINDS)
    world = _args.count(world, "world", minimum=1)
    m = _args.count(model_bytes, "model_bytes", minimum=1, maximum=_args.MAX_BYTES, unit="bytes")
    b = min(_args.count(chunk_bytes, "chunk_bytes", minimum=1, maximum=_args.MAX_BYTES, unit="bytes"), m)
    degree = _args.count(degree, "degree", minimum=1)
    link = link_arg(link)
    bw, a = link.bandwidth, link.hop_latency
    if kind == "star":
        return a + world * m / bw
    if kind == "chain":
        return world * (a + b / bw) + (m - b) / bw
    d = _depth(world - 1, degree)  # a tree
    k = min(degree, max(1, world - 1))  # rank 0 of a 2-rank tree has one child
    return (a + b / bw) + (d - 1) * (a + k * b / bw) + (m - b) * (k if world > 1 else 1) / bw


@dataclasses.dataclass(frozen=True)
class FanoutPlan:
    """Who reads from whom (see the module docstring).

    Attributes:
        kind: "star", "chain" or "tree". world: number of rollout ranks. degree: children per
        rank in a tree (1 for a chain; ``world`` for a star's trainer). why: how it was chosen.
    """

    kind: str
    world: int
    degree: int = 2
    why: str = ""

    def __post_init__(self) -> None:
        kind_arg(self.kind, KINDS)
        _args.count(self.world, "world", minimum=1)
        _args.count(self.degree, "degree", minimum=1)

    def _rank(self, rank: int) -> int:
        return _args.index(rank, "rank", self.world, of=f"a plan of {self.world} ranks")

    def parent(self, rank: int) -> int:
        """The rank ``rank`` reads from, or :data:`TRAINER`."""
        rank = self._rank(rank)
        if rank == 0 or self.kind == "star":
            return TRAINER
        return rank - 1 if self.kind == "chain" else (rank - 1) // self.degree

    def upstream(self, rank: int) -> list[int]:
        """Every rank above ``rank``, nearest first, ending with :data:`TRAINER`: where it
        re-attaches, in order, when its parent is gone."""
        out = []
        r = self.parent(rank)
        while r != TRAINER:
            out.append(r)
            r = self.parent(r)
        return out + [TRAINER]

    def children(self, rank: int) -> list[int]:
        """Ranks that read from ``rank`` (:data:`TRAINER` for the trainer's)."""
        return [r for r in range(self.world) if self.parent(r) == rank]

    def depth(self) -> int:
        """Hops from the trainer to the farthest rank."""
        return max(len(self.upstream(r)) for r in range(self.world))


def plan(world: int, *, kind: str = "auto", degree: int | None = None, model_bytes: int | None = None,
         chunk_bytes: int | None = None, link: LinkModel | None = None) -> FanoutPlan:
    """A fan-out plan for ``world`` ranks.

    Args:
        kind: "star", "chain", "tree" or "auto": the kind (and tree degree 2..4) with the
            smallest :func:`model_time` for ``model_bytes``, ``chunk_bytes`` and ``link``
            (without them: "chain", the plan that sends every byte over each link once).
        degree: children per rank of a tree (default 2, or the best one for "auto").

    Raises:
        TypeError / ValueError: an unknown kind, a count out of range, a link that is no
            ``LinkModel`` (each named, with its value), whatever the kind.
    """
    world = _args.count(world, "world", minimum=1)
    kind = kind_arg(kind, ("auto",) + KINDS)
    if degree is not None:
        degree = _args.count(degree, "degree", minimum=1)
    if model_bytes is not None:
        model_bytes = _args.count(model_bytes, "model_bytes", minimum=1, maximum=_args.MAX_BYTES, unit="bytes")
    if chunk_bytes is not None:
        chunk_bytes = _args.count(chunk_bytes, "chunk_bytes", minimum=1, maximum=_args.MAX_BYTES, unit="bytes")
    if link is not None:
        link = link_arg(link)
    if kind != "auto":
        return FanoutPlan(kind, world, 2 if degree is None else degree, why=f"{kind} asked for")
    if model_bytes is None or chunk_bytes is None or link is None:
        return FanoutPlan("chain", world, 1, why="chain: no model size, chunk size or link model given")
    cands = [("chain", 1)] + [("tree", k) for k in ((degree,) if degree is not None else (2, 3, 4))]
    times = {c: model_time(c[0], world, model_bytes, chunk_bytes, link, degree=c[1]) for c in cands}
    best = min(times, key=lambda c: times[c])
    star = model_time("star", world, model_bytes, chunk_bytes, link)
    desc = ", ".join(f"{k}{'' if k == 'chain' else f'({d})'} {t:.3g} s" for (k, d), t in times.items())
    return FanoutPlan(best[0], world, best[1],
                      why=f"{best[0]} chosen by the model for {world} ranks ({desc}; star {star:.3g} s)")


__all__ = ["FanoutPlan", "KINDS", "LinkModel", "TRAINER", "model_time", "plan"]
