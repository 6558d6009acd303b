"""The ``ray`` directory's state machine without Ray (memsem.directory._ray_state), on a clock the
test moves, and how a directory is chosen (tests/ray runs it on a real Ray cluster).

Each DirectoryState method is one atomic step of the directory actor; these tests pin the
semantics shared with the redis directory: expiry on one clock, ranks reserved for their holder
and re-claimed with the same incarnation, a heartbeat that writes expired records again but never
over a successor's, names with one live owner, leases read atomically with the closing flag,
entry watches.
"""
from __future__ import annotations

import sys

import pytest

from memsem import NotSupportedError
from memsem.directory import choose_url, open_directory, spans_nodes
from memsem.directory._ray_state import DirectoryState

P = "memsem:j:"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _state():
    clock = Clock()
    return DirectoryState("s" * 64, clock), clock


def _rank_value(token: str, rank: int, inc: int) -> str:
    import json

    return json.dumps({"v": {"pid": 1, "start": 2, "node": "n", "token": token, "rank": rank, "incarnation": inc}})


def _claim(s: DirectoryState, token: str, ttl: float = 2.0, reserve: float = 20.0) -> tuple[int, int]:
    rank, inc = s.reserve_rank(P, token, reserve)
    assert s.claim(f"{P}rank:{rank}", f"{P}hold:{rank}", _rank_value(token, rank, inc), token, ttl, reserve, inc) == 1
    return rank, inc


def test_records_expire_on_the_state_clock():
    s, clock = _state()
    s.put({"k1": "a", "k2": "b"}, 2.0)
    s.put({"k3": "c"}, None)
    assert s.mget(["k1", "k2", "k3", "nope"]) == ["a", "b", "c", None]
    clock.t += 2.0
    assert s.get("k1") is None and s.scan("k") == {"k3": "c"}


def test_ranks_reserved_for_their_holder_and_reclaimed_with_the_same_incarnation():
    s, clock = _state()
    r0, i0 = _claim(s, "t0")
    r1, i1 = _claim(s, "t1")
    assert (r0, r1) == (0, 1) and i1 == i0 + 1
    clock.t += 3.0  # t0's record expired (no beat), its reservation not
    assert s.get(f"{P}rank:0") is None
    r2, _ = _claim(s, "t2")
    assert r2 == 2  # rank 0 stays reserved for t0
    rc, restored, replaced = s.beat(f"{P}rank:0", f"{P}hold:0", _rank_value("t0", 0, i0), "t0", 2.0, 20.0, i0,
                                    {f"{P}w:a": "wa"})
    assert rc == 2 and restored == [f"{P}w:a"] and replaced == []  # re-claimed, its record written again
    assert s.get(f"{P}w:a") == "wa"
    # another runtime cannot take a held rank; a beat of a rank held by another token loses it
    assert s.claim(f"{P}rank:0", f"{P}hold:0", _rank_value("tx", 0, 9), "tx", 2.0, 20.0, 9) == 0
    assert s.beat(f"{P}rank:0", f"{P}hold:0", _rank_value("tx", 0, 9), "tx", 2.0, 20.0, 9, {})[0] == -1
    # after the actor restarts (a new state) a re-claim keeps the counter ahead of live incarnations
    fresh = DirectoryState("s" * 64, clock)
    assert fresh.beat(f"{P}rank:1", f"{P}hold:1", _rank_value("t1", 1, i1), "t1", 2.0, 20.0, i1, {})[0] == 2
    assert fresh.reserve_rank(P, "t9", 20.0)[1] > i1


def test_a_beat_never_writes_over_a_successor():
    s, _ = _state()
    r, inc = _claim(s, "t0")
    s.put({f"{P}n:x": "mine"}, 2.0)
    s.put({f"{P}n:x": "theirs"}, 2.0)  # the name was replaced by another runtime
    rc, restored, replaced = s.beat(f"{P}rank:{r}", f"{P}hold:{r}", _rank_value("t0", r, inc), "t0", 2.0, 20.0, inc,
                                    {f"{P}n:x": "mine"})
    assert rc == 1 and restored == [] and replaced == [f"{P}n:x"] and s.get(f"{P}n:x") == "theirs"


def test_names_have_one_live_owner():
    import json

    s, clock = _state()
    r, _ = _claim(s, "t0")
    mine = json.dumps({"v": {"gva": "01", "token": "t0", "rank": r}})
    theirs = json.dumps({"v": {"gva": "02", "token": "t1", "rank": 5}})
    assert s.claim_name(f"{P}n:x", mine, f"{P}rank:", "t0", 2.0, False, "") is None
    assert s.claim_name(f"{P}n:x", theirs, f"{P}rank:", "t1", 2.0, False, "") == mine  # t0 is live
    assert s.claim_name(f"{P}n:x", theirs, f"{P}rank:", "t1", 2.0, False, mine) is None  # found dead
    assert not s.drop_name(f"{P}n:x", "01") and s.drop_name(f"{P}n:x", "02")
    assert s.claim_name(f"{P}n:x", mine, f"{P}rank:", "t0", 2.0, False, "") is None
    clock.t += 2.5  # t0's rank record expired: its name may be taken
    assert s.claim_name(f"{P}n:x", theirs, f"{P}rank:", "t1", 2.0, False, "") is None


def test_leases_closing_flag_and_holders():
    import json

    s, clock = _state()
    r, _ = _claim(s, "t0", ttl=100.0)
    s.put({f"{P}w:g": json.dumps({"v": {"generation": 7}})}, 100.0)
    args = (f"{P}w:g", f"{P}l:g", f"{P}c:g")
    assert s.acquire_lease(*args, f"a:6e:3:{r}", 5.0, 6) == -3
    assert s.acquire_lease(*args, f"a:6e:3:{r}", 5.0, 7) == 1
    assert s.acquire_lease(*args, "b:6e:4:9", None, 7) == 1
    out = s.lease_holders(f"{P}l:g", f"{P}c:g", f"{P}rank:", True, 60.0)
    assert sorted(m for m, _, _ in out) == [f"a:6e:3:{r}", "b:6e:4:9"]
    assert {m: rec is not None for m, _, rec in out} == {f"a:6e:3:{r}": True, "b:6e:4:9": False}
    assert s.acquire_lease(*args, "c:6e:5:1", 5.0, 7) == -2  # closing: never granted and uncounted
    s.delete([f"{P}c:g"])
    clock.t += 6.0
    assert not s.renew_lease(f"{P}l:g", f"a:6e:3:{r}", 5.0)  # expired
    s.reap_leases(f"{P}l:g", ["b:6e:4:9"])
    assert s.lease_holders(f"{P}l:g", f"{P}c:g", f"{P}rank:", False, 60.0) == []
    assert s.acquire_lease("nope", f"{P}l:x", f"{P}c:x", "m", 1.0, 7) == -1


def test_entry_watches_and_idle():
    s, clock = _state()
    w = s.watch("qp/")
    assert s.take(w) is False
    s.put_entry(f"{P}e:other/1", "v", 2.0, "other/1")
    assert s.take(w) is False
    s.put_entry(f"{P}e:qp/1", "v", 2.0, "qp/1")
    assert s.take(w) is True and s.take(w) is False
    s.wake(w)
    assert s.take(w) is True
    s.unwatch(w)
    assert s.take(w) is None  # unknown: the client registers it again
    assert s.sweep() is True and s.idle_since is None
    clock.t += 3.0
    assert s.sweep() is False and s.idle_since == clock.t  # nothing held any more


def test_directory_choice_without_ray(monkeypatch):
    monkeypatch.delenv("MEMSEM_DIRECTORY", raising=False)
    if "ray" not in sys.modules:  # never imported by choosing
        assert choose_url(None)[0] == "local" and "ray" not in sys.modules
    assert choose_url("redis://h:1/0") == ("redis://h:1/0", "named by the caller")
    monkeypatch.setenv("MEMSEM_DIRECTORY", "ray")
    assert choose_url(None) == ("ray", "MEMSEM_DIRECTORY")
    assert spans_nodes("ray") and not spans_nodes("local")
    from memsem.core import default_engines

    monkeypatch.delenv("MEMSEM_ENGINES", raising=False)
    assert "tcp" in default_engines("ray") and "tcp" not in default_engines("local")


@pytest.mark.skipif("ray" in sys.modules or __import__("importlib").util.find_spec("ray") is not None,
                    reason="Ray is installed here: tests/ray covers the directory")
def test_ray_directory_without_ray_is_not_supported():
    with pytest.raises(NotSupportedError, match="needs Ray"):
        open_directory("ray", alive=lambda rec: True)
