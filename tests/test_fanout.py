"""Fan-out (memsem.FanoutSource, memsem.Relay): plans and their model, and the relay protocol in
one process (every window local: route loopback). Across nodes, with processes killed:
tests/netns/test_fanout.py.

Orders are forced with events in the relays' hook (``Relay._on_event``); bounds are counted
(re-attachments, dropped versions, faults), never timed.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time

import numpy as np
import pytest

import memsem
from memsem import FanoutPlan, LinkModel, fanout_plan, model_time
from memsem.sync._fanout_plan import TRAINER

WAIT = 30.0
CHUNK = 16 << 10


def model(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"embed": rng.standard_normal((64, 100)).astype(np.float32),
            "steps": np.array(step, np.int64),  # 0-d
            "empty": np.zeros((0, 3), np.float32),
            "head": rng.standard_normal(30011).astype(np.float32)}


def sha(sd) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(np.ascontiguousarray(sd[k]).view(np.uint8).tobytes())
    return h.hexdigest()


def fresh() -> dict[str, np.ndarray]:
    return {k: np.empty_like(v) for k, v in model(0).items()}


@pytest.fixture
def rt(memsem_runtime):
    return memsem_runtime


@pytest.fixture
def source(rt):
    src = memsem.FanoutSource(rt, model(1), name="policy", chunk_bytes=CHUNK, history=4)
    yield src
    src.close()


class Gated(memsem.Relay):
    """A relay whose hook blocks at ``(event, version, chunk)`` until ``gate`` is set, after
    setting ``reached`` (and may corrupt the chunks it serves)."""

    def __init__(self, *a, at=None, corrupt=None, **kw):
        self.at = at
        self.corrupt = corrupt
        self.reached = threading.Event()
        self.gate = threading.Event()
        super().__init__(*a, **kw)

    def _on_event(self, event, version, chunk, data):
        if self.corrupt is not None and event == "serve" and chunk == self.corrupt:
            data[0] ^= 0xFF
        if self.at is not None and (event, version, chunk) == self.at:
            self.reached.set()
            if not self.gate.wait(WAIT):
                raise memsem.MemsemTimeoutError("test gate not opened", what="gate", timeout=WAIT)
            if self._stop.is_set():  # closed while held here: this chunk never arrives
                from memsem.sync._relay_upstream import RelayClosing

                raise RelayClosing()


# -- plans and the model ------------------------------------------------------------------------------
def test_plans_parents_and_upstream():
    chain = fanout_plan(5, kind="chain")
    assert [chain.parent(r) for r in range(5)] == [TRAINER, 0, 1, 2, 3]
    assert chain.upstream(3) == [2, 1, 0, TRAINER] and chain.depth() == 5
    tree = fanout_plan(7, kind="tree", degree=2)
    assert [tree.parent(r) for r in range(7)] == [TRAINER, 0, 0, 1, 1, 2, 2]
    assert tree.children(1) == [3, 4] and tree.children(TRAINER) == [0] and tree.depth() == 3
    star = fanout_plan(4, kind="star")
    assert all(star.parent(r) == TRAINER for r in range(4)) and star.children(TRAINER) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="rank"):
        chain.parent(5)
    with pytest.raises(ValueError, match="kind"):
        fanout_plan(3, kind="ring")
    with pytest.raises(ValueError, match="world"):
        FanoutPlan("chain", 0)
    with pytest.raises(ValueError, match="bandwidth"):
        LinkModel(0)


def test_model_orders_the_plans_and_auto_picks_the_least():
    link = LinkModel(25e6, 5e-4)
    m, b = 64 << 20, 1 << 20
    one = model_time("chain", 1, m, b, link)
    assert one == pytest.approx(model_time("star", 1, m, b, link)) == pytest.approx(model_time("tree", 1, m, b, link))
    assert model_time("star", 8, m, b, link) == pytest.approx(link.hop_latency + 8 * m / link.bandwidth)
    assert model_time("chain", 8, m, b, link) < 1.2 * one < model_time("star", 8, m, b, link)
    # a chain's hops add up at 1,024 ranks with big chunks: a tree is chosen then
    assert fanout_plan(8, model_bytes=m, chunk_bytes=b, link=link).kind == "chain"
    big = fanout_plan(1024, model_bytes=m, chunk_bytes=4 << 20, link=link)
    assert big.kind == "tree" and "tree" in big.why
    assert model_time("tree", 1024, m, 4 << 20, link, degree=big.degree) < model_time("chain", 1024, m, 4 << 20, link)


def test_chunks_in_flight_keep_the_link_busy_and_no_more():
    """A relay asks its parent for the fewest chunks at once that cover a round trip: each one
    more delays every hop of a chain by a chunk's transfer (the chain's last rank finished 7 x
    ~3 chunk times late at 4 in flight over 200 Mbit/s links)."""
    from memsem.sync._fanout_plan import chunks_in_flight

    slow = LinkModel(25e6, 1.2e-3)  # 1 MiB takes 42 ms: one round trip is covered by a second chunk
    assert chunks_in_flight(slow, 1 << 20) == 2
    assert chunks_in_flight(slow, 16 << 10) == 1 + math.ceil(1.2e-3 / ((16 << 10) / 25e6))  # 3
    fast = LinkModel(12.5e9, 20e-6)  # 64 KiB takes 5 us: more in flight, up to the cap
    assert chunks_in_flight(fast, 64 << 10) == 5 and chunks_in_flight(fast, 4 << 10, most=8) == 8
    assert chunks_in_flight(None, 1 << 20) == 4
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunks_in_flight(slow, 0)


# -- the relay protocol ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,world", [("chain", 1), ("chain", 4), ("tree", 5), ("star", 3)])
def test_every_rollout_bit_exact_every_version(rt, source, kind, world):
    shas = {1: sha(model(1))}
    relays = [memsem.Relay(rt, "policy", rank=r, world=world, plan=kind, timeout=WAIT) for r in range(world)]
    try:
        intos = [fresh() for _ in relays]
        for step in range(1, 5):
            if step > 1:
                shas[step] = sha(model(step))
                assert source.update(model(step)) == step
            for r, into in zip(relays, intos):
                got = r.load(into, version=step, timeout=WAIT)
                assert sha(into) == shas[got] and got >= step
        plan = relays[0].plan
        for r in relays:
            st = r.stats()
            assert set(st.chunks) == {plan.parent(r.rank)}  # every chunk from its own parent
            assert not st.faults and not st.reattached
        assert relays[-1].held() and len(relays[-1].held()) <= 2
        with relays[-1].hold() as (v, tensors):  # zero-copy views of a held version
            assert sha(tensors) == shas[v]
    finally:
        for r in relays:
            r.close()


def test_versions_committed_while_a_fanout_is_in_flight(rt, source):
    """The root relay is held at chunk 1 of version 2; meanwhile the trainer commits 3 and 4
    (its two slots: version 2 is gone). Every rollout drops 2 and ends with 4, bit-exact."""
    root = Gated(rt, "policy", rank=0, world=3, plan="chain", at=("fetch", 2, 1), timeout=WAIT)
    rest = [memsem.Relay(rt, "policy", rank=r, world=3, plan="chain", timeout=WAIT) for r in (1, 2)]
    relays = [root, *rest]
    try:
        for r in relays:
            r.load(version=1, timeout=WAIT)
        source.update(model(2))
        assert root.reached.wait(WAIT)
        source.update(model(3))
        source.update(model(4))
        root.gate.set()
        for r in relays:
            into = fresh()
            got = r.load(into, version=4, timeout=WAIT)
            assert got == 4 and sha(into) == sha(model(4))
        assert 2 in root.stats().dropped
        for r in relays:  # 2 was never completed anywhere, 3 never offered: from 1 straight to 4
            assert r.stats().versions == [1, 4], (r.rank, r.stats())
    finally:
        for r in relays:
            r.close()


def test_a_relay_gone_mid_version_its_child_reattaches_to_the_grandparent(rt, source):
    """Rank 1 stops at chunk 3 of version 2 and is closed (its windows retired); rank 2 goes
    on from rank 0 with the chunks it lacks: bit-exact, one re-attachment, counted."""
    relays = [memsem.Relay(rt, "policy", rank=0, world=3, plan="chain", timeout=WAIT),
              Gated(rt, "policy", rank=1, world=3, plan="chain", at=("fetch", 2, 3), timeout=WAIT),
              memsem.Relay(rt, "policy", rank=2, world=3, plan="chain", timeout=WAIT, attach_timeout=2.0)]
    try:
        for r in relays:
            r.load(version=1, timeout=WAIT)
        from_rank1 = relays[2].stats().chunks.get(1, 0)
        source.update(model(2))
        assert relays[1].reached.wait(WAIT)
        # rank 2 holds a chunk of version 2 from rank 1 before rank 1 goes (else it finds rank 1
        # gone before it ever attached, and takes the version from rank 0 with no re-attachment)
        deadline = time.monotonic() + WAIT
        while relays[2].stats().chunks.get(1, 0) <= from_rank1:
            assert time.monotonic() < deadline, "rank 2 never read a chunk of version 2 from rank 1"
            time.sleep(0.01)
        threading.Thread(target=relays[1].close, daemon=True).start()
        while not relays[1]._stop.is_set():  # closing before its gate opens: it fetches nothing more
            assert time.monotonic() < deadline, "rank 1's close never began"
            time.sleep(0.001)
        relays[1].gate.set()
        into = fresh()
        assert relays[2].load(into, version=2, timeout=WAIT) == 2 and sha(into) == sha(model(2))
        st = relays[2].stats()
        assert [(v, frm, to) for v, frm, to, _ in st.reattached] == [(2, 1, 0)], st
        assert st.chunks[0] >= 1 and st.chunks[1] >= 1  # some from each, all checked
    finally:
        for r in relays:
            r.close()


@pytest.mark.parametrize("on_mismatch", ["raise", "bypass"])
def test_a_faulty_relay_is_caught_by_digest_and_named(rt, source, on_mismatch):
    """Rank 1 corrupts chunk 2 of what it serves. Rank 2 never accepts it: the mismatch names
    rank 1 (raised once by load with on_mismatch="raise"), and the version is completed from
    rank 0, bit-exact."""
    relays = [memsem.Relay(rt, "policy", rank=0, world=3, plan="chain", timeout=WAIT),
              Gated(rt, "policy", rank=1, world=3, plan="chain", corrupt=2, timeout=WAIT),
              memsem.Relay(rt, "policy", rank=2, world=3, plan="chain", timeout=WAIT, on_mismatch=on_mismatch)]
    try:
        into = fresh()
        if on_mismatch == "raise":
            with pytest.raises(memsem.DigestMismatchError, match="rank 1") as ei:
                relays[2].load(into, version=1, timeout=WAIT)
            assert ei.value.relay == "rank 1 of 'policy'" and ei.value.chunk == 2 and ei.value.version == 1
        assert relays[2].load(into, version=1, timeout=WAIT) == 1 and sha(into) == sha(model(1))
        st = relays[2].stats()
        assert len(st.faults) == 1 and st.faults[0].relay == "rank 1 of 'policy'"
        assert [(v, frm, to) for v, frm, to, _ in st.reattached] == [(1, 1, 0)]
    finally:
        for r in relays:
            r.close()


def test_follower_duck_typing_and_doors(rt, source):
    """A relay answers version / wait_version / load like a StateDictRef source; wrong
    arguments are named."""
    with memsem.Relay(rt, "policy", rank=0, world=1, timeout=WAIT) as relay:
        assert relay.version() == 1 and relay.wait_version(1, timeout=WAIT) == 1
        v = relay.version()
        into = fresh()
        assert relay.load(into, version=v, timeout=WAIT) == 1 and sha(into) == sha(model(1))
        with pytest.raises(KeyError, match="embed"):
            relay.load({"head": into["head"]}, timeout=WAIT)
        with pytest.raises(memsem.MemsemTimeoutError):
            relay.load(version=9, timeout=0.2)
    with pytest.raises(ValueError, match="rank"):
        memsem.Relay(rt, "policy", rank=2, world=2)
    with pytest.raises(ValueError, match="on_mismatch"):
        memsem.Relay(rt, "policy", rank=0, world=1, on_mismatch="ignore")
    with pytest.raises(ValueError, match="digest"):
        memsem.FanoutSource(rt, model(1), name="other", digest="crc32")


def test_digests_follow_commits_through_write_sections(rt, source):
    """FanoutSource.write_section: in-place changes are digested and committed; a body that
    raises commits nothing (neither the data nor digests)."""
    with memsem.Relay(rt, "policy", rank=0, world=1, timeout=WAIT) as relay:
        with source.write_section() as sec:
            sec.tensors["head"][:] = 5.0
        want = dict(model(1), head=np.full(30011, 5.0, np.float32))
        into = fresh()
        assert relay.load(into, version=2, timeout=WAIT) == 2 and sha(into) == sha(want)
        with pytest.raises(RuntimeError):
            with source.write_section() as sec:
                sec.tensors["head"][:] = 6.0
                raise RuntimeError("abort")
        assert source.version() == 2 and source.ref.version() == 2


def test_auto_plan_is_made_from_the_trainers_sizes(rt, source):
    link = LinkModel(1e6, 0.05)  # slow hops: a chain of 64 ranks adds up
    want = fanout_plan(64, kind="auto", model_bytes=source.nbytes, chunk_bytes=CHUNK, link=link)
    with memsem.Relay(rt, "policy", rank=0, world=64, plan="auto", link=link, timeout=WAIT) as relay:
        relay.prepare()
        assert (relay.plan.kind, relay.plan.degree) == (want.kind, want.degree) and want.kind == "tree"
        assert relay.load(version=1, timeout=WAIT) == 1


# -- waits: one primitive, each with its timeout, each ended by close() --------------------------------------
def _follower_alive(rank: int) -> bool:
    return any(t.name == f"memsem-relay{rank}" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("where", ["the parent's name", "the trainer's next version"])
def test_close_ends_the_followers_wait_whatever_it_waits_for(rt, source, where):
    """The follower's waits run far longer than close() waits for its thread (attach_timeout of
    an hour: a parent that never appears; or no next commit): close() must end them through
    the stop check, leaving no follower thread behind."""
    gate = threading.Event()

    class Seen(memsem.Relay):
        def _on_event(self, event, version, chunk, data):
            if event == "complete":
                gate.set()

    if where == "the parent's name":  # rank 1 of a chain whose rank 0 never starts
        relay = Seen(rt, "policy", rank=1, world=2, plan="chain", attach_timeout=3600.0, timeout=WAIT)
    else:  # holds version 1, then waits for version 2, which never comes
        relay = Seen(rt, "policy", rank=0, world=1, attach_timeout=3600.0, timeout=WAIT)
        assert gate.wait(WAIT) and relay.held() == [1]
    assert _follower_alive(relay.rank)
    relay.close()
    assert not _follower_alive(relay.rank)
    with pytest.raises(memsem.RuntimeClosedError):
        relay.load(version=1, timeout=WAIT)


def test_a_parent_that_never_appears_is_passed_over_with_one_named_timeout(rt, source):
    with memsem.Relay(rt, "policy", rank=1, world=2, plan="chain", attach_timeout=0.2, timeout=WAIT) as relay:
        into = fresh()
        assert relay.load(into, version=1, timeout=WAIT) == 1 and sha(into) == sha(model(1))
        (v, frm, to, reason), = relay.stats().reattached
        assert (v, frm, to) == (1, 0, TRAINER)
        assert reason.startswith("MemsemTimeoutError: an offer of version >= 1 by relay rank 0 of 'policy' "
                                 "not made after 0.2 s"), reason


def test_load_times_out_naming_the_version_and_what_the_relay_holds(rt, source):
    with memsem.Relay(rt, "policy", rank=0, world=1, timeout=WAIT) as relay:
        relay.load(version=1, timeout=WAIT)
        with pytest.raises(memsem.MemsemTimeoutError, match=r"not held after 0.2 s \(holds \[1\]\)") as ei:
            relay.load(version=9, timeout=0.2)
        assert ei.value.what == "version 9 at relay rank 0 of 'policy'"


# -- argument doors: every public argument of the fan-out API, named with its value ---------------------------
LINK = LinkModel(1e9, 1e-4)
BIG = 2 ** 64
DOORS = [
    # (call, argument, value, error)
    ("LinkModel", "bandwidth", True, TypeError),
    ("LinkModel", "bandwidth", "fast", TypeError),
    ("LinkModel", "bandwidth", 0, ValueError),
    ("LinkModel", "bandwidth", math.inf, ValueError),
    ("LinkModel", "bandwidth", math.nan, ValueError),
    ("LinkModel", "hop_latency", True, TypeError),
    ("LinkModel", "hop_latency", -1e-6, ValueError),
    ("LinkModel", "hop_latency", math.inf, ValueError),
    ("LinkModel", "hop_latency", math.nan, ValueError),
    ("fanout_plan", "world", 0, ValueError),
    ("fanout_plan", "world", 2.0, TypeError),
    ("fanout_plan", "kind", "ring", ValueError),
    ("fanout_plan", "kind", 3, TypeError),
    ("fanout_plan", "degree", 0, ValueError),
    ("fanout_plan", "degree", True, TypeError),
    ("fanout_plan", "model_bytes", 0, ValueError),
    ("fanout_plan", "model_bytes", BIG, ValueError),
    ("fanout_plan", "chunk_bytes", -1, ValueError),
    ("fanout_plan", "chunk_bytes", BIG, ValueError),
    ("fanout_plan", "link", 12.5e9, TypeError),
    ("model_time", "kind", "auto", ValueError),
    ("model_time", "kind", None, TypeError),
    ("model_time", "world", 0, ValueError),
    ("model_time", "model_bytes", BIG, ValueError),
    ("model_time", "chunk_bytes", 0, ValueError),
    ("model_time", "degree", 0, ValueError),
    ("model_time", "link", None, TypeError),
    ("FanoutPlan", "kind", "ring", ValueError),
    ("FanoutPlan", "kind", b"chain", TypeError),
    ("FanoutPlan", "world", 0, ValueError),
    ("FanoutPlan", "degree", 0, ValueError),
    ("FanoutSource", "name", "", ValueError),
    ("FanoutSource", "name", 7, TypeError),
    ("FanoutSource", "name", "p" * 250, ValueError),
    ("FanoutSource", "chunk_bytes", BIG, ValueError),
    ("FanoutSource", "chunk_bytes", 1024, ValueError),
    ("FanoutSource", "chunk_bytes", 65536.0, TypeError),
    ("FanoutSource", "digest", "crc32", ValueError),
    ("FanoutSource", "digest", None, TypeError),
    ("FanoutSource", "history", 1, ValueError),
    ("FanoutSource.update", "timeout", -1, ValueError),
    ("FanoutSource.write_section", "copy", "yes", TypeError),
    ("FanoutSource.write_section", "timeout", math.nan, ValueError),
    ("FanoutSource.close", "timeout", math.inf, ValueError),
    ("Relay", "name", "", ValueError),
    ("Relay", "name", None, TypeError),
    ("Relay", "rank", 1, ValueError),
    ("Relay", "rank", True, TypeError),
    ("Relay", "world", 0, ValueError),
    ("Relay", "plan", "ring", ValueError),
    ("Relay", "plan", 3, TypeError),
    ("Relay", "plan", FanoutPlan("chain", 2), ValueError),
    ("Relay", "link", 1e9, TypeError),
    ("Relay", "slots", 1, ValueError),
    ("Relay", "depth", 0, ValueError),
    ("Relay", "attach_timeout", 0, ValueError),
    ("Relay", "timeout", math.inf, ValueError),
    ("Relay", "on_mismatch", "ignore", ValueError),
    ("Relay", "follow", 1, TypeError),
    ("Relay.load", "version", 2 ** 48, ValueError),
    ("Relay.load", "version", -1, ValueError),
    ("Relay.load", "version", 1.0, TypeError),
    ("Relay.load", "timeout", -1, ValueError),
    ("Relay.hold", "version", 2 ** 48, ValueError),
    ("Relay.hold", "timeout", True, TypeError),
    ("Relay.wait_version", "version", 2 ** 48, ValueError),
    ("Relay.wait_version", "timeout", math.nan, ValueError),
    ("Relay.prepare", "timeout", -1, ValueError),
    ("Relay.close", "timeout", -1, ValueError),
]


def _call_door(rt, source, call, arg, value):
    """Call ``call`` with valid arguments but ``arg=value``."""
    def kw(**good):
        good[arg] = value
        return good

    if call == "LinkModel":
        return LinkModel(**kw(bandwidth=1e9, hop_latency=1e-4))
    if call == "fanout_plan":
        return fanout_plan(**kw(world=4, kind="tree", degree=2, model_bytes=1 << 20, chunk_bytes=1 << 16, link=LINK))
    if call == "model_time":
        return model_time(**kw(kind="tree", world=4, model_bytes=1 << 20, chunk_bytes=1 << 16, link=LINK, degree=2))
    if call == "FanoutPlan":
        return FanoutPlan(**kw(kind="tree", world=4, degree=2))
    if call == "FanoutSource":
        return memsem.FanoutSource(rt, model(1), **kw(name="other", chunk_bytes=CHUNK, digest="sha256", history=4))
    if call.startswith("FanoutSource."):
        meth = call.split(".")[1]
        if meth == "update":
            return source.update(model(2), **kw(timeout=WAIT))
        if meth == "close":
            return source.close(**kw(timeout=WAIT))
        with source.write_section(**kw(copy=True, timeout=WAIT)):
            return None
    if call == "Relay":
        return memsem.Relay(rt, **kw(name="policy", rank=0, world=1, plan="chain", link=LINK, slots=2, depth=2,
                                     attach_timeout=1.0, timeout=WAIT, on_mismatch="raise", follow=False))
    relay = memsem.Relay(rt, "policy", rank=0, world=1, timeout=WAIT, follow=False)
    try:
        meth = call.split(".")[1]
        if meth == "load":
            return relay.load(**kw(version=1, timeout=WAIT))
        if meth == "hold":
            with relay.hold(**kw(version=1, timeout=WAIT)):
                return None
        if meth == "wait_version":
            return relay.wait_version(**kw(version=1, timeout=WAIT))
        if meth == "prepare":
            return relay.prepare(**kw(timeout=WAIT))
        return relay.close(**kw(timeout=WAIT))
    finally:
        relay.close()


@pytest.mark.parametrize("call,arg,value,error", DOORS, ids=[f"{c}-{a}-{v!r:.12}" for c, a, v, _ in DOORS])
def test_every_argument_of_the_fanout_api_has_a_door(rt, source, call, arg, value, error):
    """A bad argument is refused at once (no relay started, nothing waited for), with a
    TypeError / ValueError naming the argument (and its value where it has a short form)."""
    with pytest.raises(error, match=arg) as ei:
        _call_door(rt, source, call, arg, value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and error is ValueError:
        assert repr(value) in str(ei.value) or str(value) in str(ei.value), ei.value


def test_a_tree_keeps_the_degree_it_was_given():
    assert fanout_plan(7, kind="tree", degree=1).degree == 1
    assert fanout_plan(7, kind="tree").degree == 2
    assert fanout_plan(7, kind="tree", degree=3).parent(6) == 1


# -- what a reader is given: a finished, verified version whatever the scheduling -------------------------------
class Paused(Gated):
    """``Gated``, plus: a consumer that chose and holds ``held_at`` stops there (``consumer``
    set) until ``resume`` is set; ``completed`` is set at each version completed."""

    def __init__(self, *a, held_at=None, **kw):
        self.held_at = held_at
        self.consumer = threading.Event()
        self.resume = threading.Event()
        self.completed: dict[int, threading.Event] = {v: threading.Event() for v in range(1, 8)}
        super().__init__(*a, **kw)

    def _on_event(self, event, version, chunk, data):
        if event == "complete":
            self.completed[version].set()
        if event == "held" and version == self.held_at:
            self.consumer.set()
            if not self.resume.wait(WAIT):
                raise memsem.MemsemTimeoutError("test resume not set", what="resume", timeout=WAIT)
            return
        super()._on_event(event, version, chunk, data)


def test_a_held_version_is_never_refilled_while_the_relay_moves_on(rt, source):
    """The consumer chose version 1 and stops before it looks at it; meanwhile the relay
    completes 2 and starts 3 (stopped after 3's first chunk). The block still sees version 1,
    bit-exact: 3 went to another buffer (the held one is never reused)."""
    relay = Paused(rt, "policy", rank=0, world=1, slots=2, timeout=WAIT, at=("fetch", 3, 1), held_at=1)
    try:
        assert relay.completed[1].wait(WAIT)
        got = {}

        def consumer():
            with relay.hold(version=1, timeout=WAIT) as (v, tensors):
                got["v"], got["sha"] = v, sha(tensors)

        t = threading.Thread(target=consumer, daemon=True)
        t.start()
        assert relay.consumer.wait(WAIT)  # chose 1, holds it, has not looked yet
        source.update(model(2))
        assert relay.completed[2].wait(WAIT)
        source.update(model(3))
        assert relay.reached.wait(WAIT)  # 3 started: chunk 0 written, chunk 1 not yet
        relay.resume.set()
        t.join(WAIT)
        assert not t.is_alive() and got == {"v": 1, "sha": sha(model(1))}
        relay.gate.set()
        into = fresh()
        assert relay.load(into, version=3, timeout=WAIT) == 3 and sha(into) == sha(model(3))
    finally:
        relay.resume.set()
        relay.gate.set()
        relay.close()


@pytest.mark.parametrize("call", ["hold", "load"])
def test_a_dropped_version_is_replaced_by_a_finished_one_never_one_being_filled(rt, source, call):
    """The consumer's load() returned 1; before it asks for 1 again the relay completed 2, then
    dropped 1 and started 3 in 1's memory (stopped after 3's first chunk). Asking for >= 1 gives
    2, whole; asking for the latest (3) waits until 3 is finished, then gives it whole."""
    relay = Paused(rt, "policy", rank=0, world=1, slots=2, timeout=WAIT, at=("fetch", 3, 1))
    try:
        assert relay.load(version=1, timeout=WAIT) == 1
        source.update(model(2))
        assert relay.completed[2].wait(WAIT)
        source.update(model(3))
        assert relay.reached.wait(WAIT)
        assert relay.held() == [2] and sorted(relay._held) == [2, 3]  # 1 dropped, 3 being filled

        def read(version):
            if call == "load":
                into = fresh()
                return relay.load(into, version=version, timeout=WAIT), sha(into)
            with relay.hold(version=version, timeout=WAIT) as (v, tensors):
                return v, sha(tensors)

        assert read(1) == (2, sha(model(2)))
        later = {}
        t = threading.Thread(target=lambda: later.update(r=read(0)), daemon=True)
        t.start()
        relay.gate.set()
        t.join(WAIT)
        assert not t.is_alive() and later["r"] == (3, sha(model(3)))
    finally:
        relay.resume.set()
        relay.gate.set()
        relay.close()


# -- closing the runtime wakes every waiter; a closed runtime refuses at once ------------------------------------
@pytest.fixture
def waits(monkeypatch):
    """Every ``Wait`` slice slept by this process, by what it waits for: ``waits.started(text)``
    is an event set at the first slice of a wait whose ``what`` holds ``text``; ``slices``
    lists what each slice waited for."""
    from memsem.core._wait import Wait

    class Seen:
        def __init__(self):
            self.slices: list[str] = []
            self.events: dict[str, threading.Event] = {}

        def started(self, text, thread=None):
            """Set at the first slice of a wait naming ``text`` (slept by the thread named
            ``thread``, when given)."""
            return self.events.setdefault((text, thread), threading.Event())

    seen = Seen()
    sleep = Wait.sleep

    def spy(self, block):
        seen.slices.append(self.what)
        me = threading.current_thread().name
        for (text, thread), ev in list(seen.events.items()):
            if text in self.what and thread in (None, me):
                ev.set()
        return sleep(self, block)

    monkeypatch.setattr(Wait, "sleep", spy)
    return seen


def _closing_under(rt2, call, waits, waiting_for):
    """Run ``call`` in a thread; once it sleeps in a wait naming ``waiting_for``, close ``rt2``
    from this thread; returns (the call's error, whether the close had begun when it ended)."""
    out = {}
    closing = threading.Event()

    def run():
        try:
            out["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc
        out["after_close"] = closing.is_set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert waits.started(waiting_for).wait(WAIT), f"the call never waited for {waiting_for!r}"
    closing.set()
    rt2.close()
    t.join(WAIT)
    assert not t.is_alive()
    return out.get("error"), out["after_close"]


@pytest.mark.parametrize("call", ["load", "hold", "wait_version", "follow(relay)", "follow(name)"])
def test_closing_the_runtime_ends_a_waiting_call_with_runtime_closed(rt, source, memsem_job, waits, call):
    """A relay's load / hold / wait_version and a follower (over a relay or a name) wait for a
    version that never comes (timeout=WAIT); the runtime is closed from another thread while
    they wait: each ends with RuntimeClosedError, after the close began (not by its timeout)."""
    rt2 = memsem.Runtime(job=memsem_job, timeout=WAIT)
    relay = memsem.Relay(rt2, "policy", rank=0, world=1, timeout=WAIT)
    try:
        assert relay.load(version=1, timeout=WAIT) == 1
        if call == "load":
            fn, what = (lambda: relay.load(fresh(), version=9, timeout=WAIT)), "version 9 at relay"
        elif call == "hold":
            def fn():
                with relay.hold(version=9, timeout=WAIT):
                    pass
            what = "version 9 at relay"
        elif call == "wait_version":
            fn, what = (lambda: relay.wait_version(9, timeout=WAIT)), "version 9 of"
        else:
            f = rt2.follow(relay if call == "follow(relay)" else "policy", into=fresh(), timeout=WAIT, after=1)
            fn, what = f.next, "version 2 of"
        err, after_close = _closing_under(rt2, fn, waits, what)
        assert isinstance(err, memsem.RuntimeClosedError), repr(err)
        assert after_close
    finally:
        relay.close()
        rt2.close()


@pytest.mark.parametrize("call", ["load", "hold", "wait_version", "version", "prepare", "follow(relay)", "follow(name)"])
def test_a_closed_runtime_refuses_new_calls_at_once(rt, source, memsem_job, waits, call):
    """After the runtime's close, every call of its relay and its followers raises
    RuntimeClosedError without sleeping a single slice of any wait."""
    rt2 = memsem.Runtime(job=memsem_job, timeout=WAIT)
    relay = memsem.Relay(rt2, "policy", rank=0, world=1, timeout=WAIT)
    f = rt2.follow(relay if call == "follow(relay)" else "policy", into=fresh(), timeout=WAIT)
    assert relay.load(version=1, timeout=WAIT) == 1
    rt2.close()
    del waits.slices[:]
    calls = {"load": lambda: relay.load(fresh(), version=9, timeout=WAIT),
             "hold": lambda: relay.hold(version=9, timeout=WAIT).__enter__(),
             "wait_version": lambda: relay.wait_version(9, timeout=WAIT),
             "version": relay.version, "prepare": lambda: relay.prepare(timeout=WAIT),
             "follow(relay)": f.next, "follow(name)": f.next}
    with pytest.raises(memsem.RuntimeClosedError):
        calls[call]()
    assert waits.slices == []
    relay.close()


# -- a call fails for its own reasons, within its own deadline ------------------------------------------------
def _follower_failed(relay) -> None:
    """Until the relay's follower has failed at least once (its attach_timeout ran out)."""
    deadline = time.monotonic() + WAIT
    while relay._errors < 1:
        assert time.monotonic() < deadline, "the follower never failed"
        time.sleep(0.01)


@pytest.mark.parametrize("call", ["load", "load(latest)", "hold", "wait_version", "follow(relay)"])
def test_a_rollout_started_before_its_trainer_gets_the_first_version(rt, waits, call):
    """The relay starts before the trainer (attach_timeout=0.2: its follower fails, then tries
    again); a call with a long timeout is made after that failure and waits; the trainer then
    publishes. The call returns version 1 (bit-exact): the follower's earlier failure is
    never raised by it."""
    relay = memsem.Relay(rt, "policy", rank=0, world=1, attach_timeout=0.2, timeout=WAIT)
    src = None
    try:
        _follower_failed(relay)
        into = fresh()
        calls = {"load": lambda: relay.load(into, version=1, timeout=WAIT),
                 "load(latest)": lambda: relay.load(into, timeout=WAIT),
                 "wait_version": lambda: relay.wait_version(1, timeout=WAIT),
                 "follow(relay)": lambda: rt.follow(relay, into=into, timeout=WAIT).next()[0]}

        def hold():
            with relay.hold(version=1, timeout=WAIT) as (v, tensors):
                into.update({k: t.copy() for k, t in tensors.items()})
                return v

        calls["hold"] = hold
        out = {}
        t = threading.Thread(target=lambda: out.update(v=calls[call]()), name="consumer", daemon=True)
        t.start()
        assert waits.started("", thread="consumer").wait(WAIT)  # it waits (for the name or a version)
        src = memsem.FanoutSource(rt, model(1), name="policy", chunk_bytes=CHUNK, history=4)
        t.join(WAIT)
        assert not t.is_alive() and out == {"v": 1}
        if call != "wait_version":
            assert sha(into) == sha(model(1))
    finally:
        relay.close()
        if src is not None:
            src.close()


@pytest.mark.parametrize("version", [0, 1])
def test_a_call_that_runs_out_says_what_it_waited_for_and_why(rt, monkeypatch, version):
    """No trainer ever: the call's own timeout (0.3 s) names the version at the relay. The
    call's first slice is held until the follower failed again (an attempt made while the
    call waited): that failure is the error's cause and its last words; the follower's
    failure from before the call is not."""
    from memsem.core._wait import Wait

    relay = memsem.Relay(rt, "policy", rank=0, world=1, attach_timeout=0.2, timeout=WAIT)
    try:
        _follower_failed(relay)
        before = relay._errors
        sleep = Wait.sleep

        def held_until_the_follower_failed_again(self, block):
            if threading.current_thread() is threading.main_thread():
                deadline = time.monotonic() + WAIT
                while relay._errors <= before:  # block() itself: a condition's wait lets the follower in
                    assert time.monotonic() < deadline, "the follower never failed again"
                    block(0.01)
            return sleep(self, block)

        monkeypatch.setattr(Wait, "sleep", held_until_the_follower_failed_again)
        with pytest.raises(memsem.MemsemTimeoutError) as ei:
            relay.load(version=version, timeout=0.3)
        what = f"version {version}" if version else "the latest version"
        assert ei.value.what == f"{what} at relay rank 0 of 'policy'" and ei.value.timeout == 0.3
        assert "not held after 0.3 s (holds []; the relay's last attempt: MemsemTimeoutError:" in str(ei.value)
        assert isinstance(ei.value.__cause__, memsem.MemsemTimeoutError)
        monkeypatch.setattr(Wait, "sleep", sleep)
        with pytest.raises(memsem.MemsemTimeoutError) as ei:
            rt.follow(relay, into=fresh(), timeout=0.3).next()
        assert ei.value.what.startswith("a version after 0 of <memsem.Relay rank 0 of 'policy'")
        assert "not loaded after 0.3 s" in str(ei.value)
    finally:
        relay.close()


# -- a restarted trainer is followed ------------------------------------------------------------------------
def _until(cond, what):
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("waiting", ["load", "hold", "wait_version", "follow(relay)"])
def test_a_restarted_trainer_is_followed_and_the_generation_change_said(rt, memsem_job, waits, waiting):
    """A chain of two relays holds version 3 of trainer 1. A call waits for version 4 when
    trainer 1 goes (its runtime closes: its windows retire) and trainer 2 publishes the name
    (from a restore: its versions count from 1). The waiting call ends with WindowRetiredError
    naming both generations (or, for the follower loop, yields version 1 of trainer 2); both
    relays then serve trainer 2's versions bit-exact, and say the change (generation,
    stats().generations); none of trainer 1's versions is offered or handed out again."""
    rt1 = memsem.Runtime(job=memsem_job, timeout=WAIT)
    src1 = memsem.FanoutSource(rt1, model(1), name="policy", chunk_bytes=CHUNK, history=4)
    relays = [memsem.Relay(rt, "policy", rank=r, world=2, plan="chain", timeout=WAIT, attach_timeout=1.0)
              for r in (0, 1)]
    rt2 = src2 = None
    try:
        src1.update(model(2))
        src1.update(model(3))
        for r in relays:
            assert r.load(version=3, timeout=WAIT) == 3
        g1 = relays[0].generation
        assert g1 == src1.ref.spec.generation and all(r.stats().generations == [g1] for r in relays)
        follower = rt.follow(relays[1], into=fresh(), timeout=WAIT, after=2)
        assert follower.next()[0] == 3 and follower.generation == g1
        out = {}
        calls = {"load": lambda: relays[1].load(fresh(), version=4, timeout=WAIT),
                 "hold": lambda: relays[1].hold(version=4, timeout=WAIT).__enter__(),
                 "wait_version": lambda: relays[1].wait_version(4, timeout=WAIT),
                 "follow(relay)": follower.next}

        def run():
            try:
                out["r"] = calls[waiting]()
            except BaseException as exc:  # noqa: BLE001 - looked at below
                out["e"] = exc

        t = threading.Thread(target=run, name="consumer", daemon=True)
        t.start()
        assert waits.started("version 4", thread="consumer").wait(WAIT)
        src1.close()
        rt1.close()  # trainer 1 is gone
        rt2 = memsem.Runtime(job=memsem_job, timeout=WAIT)
        src2 = memsem.FanoutSource(rt2, model(7), name="policy", chunk_bytes=CHUNK, history=4)  # restored
        t.join(WAIT)
        assert not t.is_alive()
        if waiting == "follow(relay)":
            v, tensors = out["r"]
            assert v == 1 and sha(tensors) == sha(model(7)) and follower.generation == relays[1].generation
            assert ("new generation", "WindowRetiredError") in follower.recovered, follower.recovered
        else:
            err = out.get("e")
            assert isinstance(err, memsem.WindowRetiredError), repr(err)
            assert "was replaced while version 4 was awaited" in str(err) and err.generation == g1
        for r in relays:
            _until(lambda: len(r.stats().generations) == 2, f"rank {r.rank} never followed trainer 2")
            assert r.generation == r.stats().generations[-1] and r.stats().generations[0] == g1
            into = fresh()
            assert r.load(into, version=1, timeout=WAIT) == 1 and sha(into) == sha(model(7))
        src2.update(model(8))
        for r in relays:
            into = fresh()
            assert r.load(into, version=2, timeout=WAIT) == 2 and sha(into) == sha(model(8))
            assert r.held() == [1, 2] or r.held() == [2]  # trainer 2's only
    finally:
        for r in relays:
            r.close()
        for x in (src2, rt2, src1, rt1):
            if x is not None:
                x.close()


def _fanout_trainer(conn, first: int) -> None:
    """A trainer process: publishes ``model(first)`` for fan-out, then commits ``model(k)`` for
    each ``k`` it is sent, until killed."""
    with memsem.Runtime(timeout=30.0) as rt:
        src = memsem.FanoutSource(rt, model(first), name="policy", chunk_bytes=CHUNK, history=4)
        conn.send(src.ref.spec.generation)
        while True:
            conn.send(src.update(model(conn.recv())))


@pytest.mark.multiproc
def test_a_trainer_killed_and_restored_is_followed(rt, waits):
    """Trainer 1 (a process) is SIGKILLed while a load waits for its version 2; trainer 2 (a
    new process, restored) takes the name over. The load ends with WindowRetiredError once
    the relay follows trainer 2 (not PeerLostError about trainer 1's windows, again and
    again); the relay then serves trainer 2's versions bit-exact."""
    from tests._proc import reap, recv, spawn

    p1, c1 = spawn(_fanout_trainer, 1)
    p2 = None
    relay = memsem.Relay(rt, "policy", rank=0, world=1, timeout=WAIT, attach_timeout=1.0)
    try:
        g1 = recv(c1)
        into = fresh()
        assert relay.load(into, version=1, timeout=WAIT) == 1 and sha(into) == sha(model(1))
        assert relay.generation == g1
        out = {}

        def run():
            try:
                out["r"] = relay.load(fresh(), version=2, timeout=WAIT)
            except BaseException as exc:  # noqa: BLE001 - looked at below
                out["e"] = exc

        t = threading.Thread(target=run, name="consumer", daemon=True)
        t.start()
        assert waits.started("version 2 at relay", thread="consumer").wait(WAIT)
        p1.kill()
        p1.join(WAIT)
        p2, c2 = spawn(_fanout_trainer, 7)
        g2 = recv(c2)
        t.join(WAIT)
        assert not t.is_alive() and isinstance(out.get("e"), memsem.WindowRetiredError), out
        assert relay.generation == g2 and relay.stats().generations == [g1, g2]
        into = fresh()
        assert relay.load(into, version=1, timeout=WAIT) == 1 and sha(into) == sha(model(7))
        c2.send(8)
        assert recv(c2) == 2
        assert relay.load(into, version=2, timeout=WAIT) == 2 and sha(into) == sha(model(8))
    finally:
        relay.close()
        reap([p for p in (p1, p2) if p is not None])


def test_a_chunk_asked_for_across_a_restart_comes_from_its_own_trainer(rt, memsem_job):
    """The relay is stopped before chunk 1 of trainer 1's version 2; trainer 1 goes, trainer
    2 publishes and commits its own version 2, and a caller's load looks the name up again
    (the relay's view of the trainer is now trainer 2). The stopped fetch then asks trainer 1's
    window (gone: the version is dropped), never trainer 2's version 2 checked against trainer
    1's digests: no fault is reported, and the relay goes on with trainer 2, bit-exact."""
    rt1 = memsem.Runtime(job=memsem_job, timeout=WAIT)
    src1 = memsem.FanoutSource(rt1, model(1), name="policy", chunk_bytes=CHUNK, history=4)
    relay = Gated(rt, "policy", rank=0, world=1, timeout=WAIT, attach_timeout=1.0, at=("fetch", 2, 1), depth=1)
    rt2 = src2 = None
    try:
        assert relay.load(version=1, timeout=WAIT) == 1
        src1.update(model(2))
        assert relay.reached.wait(WAIT)
        src1.close()
        rt1.close()
        rt2 = memsem.Runtime(job=memsem_job, timeout=WAIT)
        src2 = memsem.FanoutSource(rt2, model(7), name="policy", chunk_bytes=CHUNK, history=4)
        src2.update(model(8))
        out = {}
        t = threading.Thread(target=lambda: out.update(v=relay.load(into, timeout=WAIT)), daemon=True)
        into = fresh()
        t.start()
        new = (src2.ref.spec.gva, src2.ref.spec.generation)
        _until(lambda: relay._up.identity() == new, "the caller never looked the name up again")
        relay.gate.set()
        t.join(WAIT)
        assert not t.is_alive() and out == {"v": 2} and sha(into) == sha(model(8))
        st = relay.stats()
        assert st.faults == [] and 2 in st.dropped and len(st.generations) == 2, st
    finally:
        relay.gate.set()
        relay.close()
        for x in (src2, rt2, src1, rt1):
            if x is not None:
                x.close()
