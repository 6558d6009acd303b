"""Model-based test: a hypothesis RuleBasedStateMachine over two real processes.

Participant P0 is this process; P1 is a long-lived child (``tests._agent``, forkserver) that
serves commands over a Pipe and is SIGKILLed and restarted by the ``kill_p1`` rule. Both run
the same operation code (``tests._agent._OPS``), so every rule can be issued by either side.
A plain-Python model (windows with generation, data, owner, liveness; refs; leases; views) says
what each call must return or raise; the real outcome is compared after every step.

Budget: ``MEMSEM_SM_EXAMPLES`` x ``MEMSEM_SM_STEPS`` (default 180 x 100, >= 10,000 steps; the
test asserts the count). Run time is printed (``-s``).
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import secrets
import time
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, \
    run_state_machine_as_test

import memsem
from memsem import AccessDeniedError, LeaseExpiredError, LeaseHeldError, MemsemError, NotSupportedError, \
    PeerLostError, StaleReferenceError
from memsem.gva import RefSpec
from memsem.native import segment_dir, segment_prefix
from memsem.core._liveness import LIVENESS_INTERVAL_S as LIVENESS_INTERVAL
from tests import _agent
from tests._agent import Agent, pattern

pytestmark = pytest.mark.multiproc

EXAMPLES = int(os.environ.get("MEMSEM_SM_EXAMPLES", "180"))
STEPS = int(os.environ.get("MEMSEM_SM_STEPS", "100"))
#: MEMSEM_SM_PLANT=<name> plants a known bug in both participants (see tests._agent.apply_plant);
#: the test is then expected to fail, which shows the model catches it.
PLANT = os.environ.get("MEMSEM_SM_PLANT", "")
RT_TIMEOUT = 0.02  # owner-side wait for leases on republish (unpublish passes timeout=0)
SIZES = (16, 256, 4096)
LONG_TTL, SHORT_TTL = 600.0, 0.001

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["memsem", "tests._agent"])
STATS = {"steps": 0, "examples": 0, "kills": 0, "errors_expected": 0}
TRACE: list[str] = []  # the current example's steps, for the failure report


# ---------------------------------------------------------------------------------- the model
@dataclasses.dataclass(eq=False)
class W:
    """A window as the model sees it."""
    owner: int            # 0 or 1
    epoch: int            # P1 incarnation that owns it (0 for P0)
    name: str | None
    nbytes: int
    shared: bool
    access: str
    data: np.ndarray
    gen: int = 0          # model generation: +1 per republish
    gva: int = 0
    live: bool = True     # published (not unpublished)
    dead: bool = False    # its owner was killed


@dataclasses.dataclass(eq=False)
class R:
    w: W
    gen: int
    refbytes: bytes
    access: str
    forged: bool = False

    @property
    def gva(self) -> int:
        return RefSpec.from_bytes(self.refbytes).gva


@dataclasses.dataclass(eq=False)
class L:
    holder: int
    epoch: int
    w: W
    gen: int
    gva: int
    short: bool
    lid: int
    held: bool = True
    views: int = 0


@dataclasses.dataclass(eq=False)
class V:
    holder: int
    epoch: int
    w: W
    lease: L | None       # None: the view took a lease of its own
    vid: int


class Mismatch(AssertionError):
    """The real outcome differs from the model's. The first one of a run prints the trace
    that led to it at once (stderr), before hypothesis starts shrinking."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        if not STATS.get("first_mismatch"):
            STATS["first_mismatch"] = msg
            import sys

            print(f"\nFIRST MISMATCH after {len(TRACE)} steps of example {STATS['examples']}: {msg}\n  "
                  + "\n  ".join(TRACE[-25:]), file=sys.stderr, flush=True)


def _names_of(cls: type) -> set[str]:
    """The names of ``cls`` and its subclasses (an error sent by name is one of them)."""
    out, todo = set(), [cls]
    while todo:
        c = todo.pop()
        out.add(c.__name__)
        todo.extend(c.__subclasses__())
    return out


def _fmt(outcome: tuple[str, Any]) -> str:
    if outcome[0] == "ok":
        return "ok"
    e = outcome[1]
    return f"{type(e).__name__}: {str(e).splitlines()[0][:140]}"


# -------------------------------------------------------------------------------- the machine
class MemsemMachine(RuleBasedStateMachine):
    p1: Agent | None = None  # kept across examples (restarted when killed)

    def __init__(self) -> None:
        super().__init__()
        self.job = f"sm{os.getpid()}-{secrets.token_hex(4)}"
        os.environ["MEMSEM_JOB"] = self.job
        self.rt0 = memsem.Runtime(timeout=RT_TIMEOUT)
        self.st0 = _agent._State()
        self.st0.rt = self.rt0
        cls = type(self)
        if cls.p1 is None or not cls.p1.proc.is_alive():
            cls.p1 = self.start_p1()
        else:
            cls.p1.call("runtime", self.job, RT_TIMEOUT, None, 0.0, timeout=30)
        self.epoch = 1
        self.windows: list[W] = []
        self.refs: list[R] = []
        self.leases: list[L] = []
        self.views: list[V] = []
        self.seed = 0
        self._kills = 0
        TRACE.clear()
        STATS["examples"] += 1

    def start_p1(self) -> Agent:
        a = Agent(_ctx, job=self.job, timeout=RT_TIMEOUT)
        if PLANT:
            a.call("plant", PLANT)
        return a

    # -- plumbing ------------------------------------------------------------------------------
    def call(self, who: int, op: str, *args: Any) -> tuple[str, Any]:
        STATS["steps"] += 1
        try:
            if who == 0:
                return "ok", _agent._OPS[op](self.st0, *args)
            return "ok", self.p1.call(op, *args, timeout=20)
        except _agent.AgentHung:
            raise
        except Exception as exc:  # noqa: BLE001 - compared with the model
            return "err", exc

    def expect(self, what: str, outcome: tuple[str, Any], allowed: tuple[type, ...] | None) -> Any:
        """``allowed`` None: the call must succeed; else it must raise one of ``allowed``."""
        TRACE.append(f"{what} -> {_fmt(outcome)}")
        if allowed is None:
            if outcome[0] != "ok":
                raise Mismatch(f"{what}: model expects success, got {_fmt(outcome)}")
            return outcome[1]
        if outcome[0] == "ok":
            raise Mismatch(f"{what}: model expects {[c.__name__ for c in allowed]}, got success")
        if not isinstance(outcome[1], allowed):
            raise Mismatch(f"{what}: model expects {[c.__name__ for c in allowed]}, got {_fmt(outcome)}")
        STATS["errors_expected"] += 1
        return outcome[1]

    def alive(self, holder: int, epoch: int) -> bool:
        return holder == 0 or epoch == self.epoch

    def pick(self, items: list, i: int):
        return items[i % len(items)]

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed * 7919 + 13

    # -- model predicates ----------------------------------------------------------------------
    def resolve_errors(self, r: R) -> tuple[type, ...] | None:
        """Errors resolving ``r`` must give (None: it resolves)."""
        w = r.w
        if w.dead:
            return (PeerLostError, StaleReferenceError) + ((AccessDeniedError,) if r.forged else ())
        if r.forged:
            if w.live and r.gen == w.gen:
                return (AccessDeniedError,)
            return (AccessDeniedError, StaleReferenceError)
        if not w.live or r.gen != w.gen:
            return (StaleReferenceError,)
        return None

    def blockers(self, w: W) -> set[int]:
        """pids whose unexpired leases keep ``w`` from being retired."""
        pids = set()
        for lease in self.leases:
            if lease.w is w and lease.held and not lease.short and lease.gen == w.gen \
                    and self.alive(lease.holder, lease.epoch):
                pids.add(self.pid(lease.holder))
        for v in self.views:
            if v.w is w and v.lease is None and self.alive(v.holder, v.epoch):
                pids.add(self.pid(v.holder))
        return pids

    def pid(self, who: int) -> int:
        return os.getpid() if who == 0 else self.p1.pid

    def lease_errors(self, lease: L | None, r: R) -> tuple[type, ...] | None:
        if lease is None:
            return None
        if lease.gva != r.gva:
            return (ValueError,)
        if not lease.held or lease.short:
            return (LeaseExpiredError,)
        return None

    def late_extra(self, who: int, r: R, lease: L | None, errs: tuple[type, ...] | None, op: str):
        """For a ref that is stale or whose owner died, the caller may still hold a resolution
        cached while it was valid; the transfer then runs its local checks (write permission,
        zero-copy route, lease) before the copy's generation/liveness check. Any of those errors
        is correct (each moves no byte), so the model accepts them too."""
        if errs is None:
            return errs
        extra = self.lease_errors(lease, r) or ()
        if op == "put" and (r.access == "r" or r.w.access == "r"):
            extra += (AccessDeniedError,)
        if op == "view" and not (who == r.w.owner or r.w.shared):
            extra += (NotSupportedError,)
        return errs + extra

    def mine(self, items: list, holder: int) -> list:
        return [x for x in items if x.holder == holder and self.alive(x.holder, x.epoch)]

    # -- rules: windows ------------------------------------------------------------------------
    @rule(owner=st.integers(0, 1), size=st.sampled_from(SIZES), shared=st.booleans(),
          access=st.sampled_from(["r", "rw"]), named=st.booleans())
    def publish(self, owner, size, shared, access, named):
        seed = self.next_seed()
        name = f"n{seed}" if named else None
        out = self.call(owner, "publish", seed, size, shared, access, name)
        refbytes = self.expect(f"P{owner}.publish({size}, shared={shared}, {access}, {name})", out, None)
        w = W(owner, 0 if owner == 0 else self.epoch, name, size, shared, access, pattern(seed, size))
        w.gva = RefSpec.from_bytes(refbytes).gva
        self.windows.append(w)
        self.refs.append(R(w, 0, refbytes, access))

    @precondition(lambda self: any(w.name and w.live and not w.dead for w in self.windows))
    @rule(i=st.integers(0, 999), grow=st.booleans())
    def republish(self, i, grow):
        w = self.pick([w for w in self.windows if w.name and w.live and not w.dead], i)
        seed = self.next_seed()
        size = w.nbytes * 2 if grow else w.nbytes
        out = self.call(w.owner, "publish", seed, size, w.shared, w.access, w.name, True)  # replace=True
        what = f"P{w.owner}.republish({w.name}, {size})"
        blockers = self.blockers(w)
        if blockers:
            err = self.expect(what, out, (LeaseHeldError,))
            if {p for p, _ in err.holders} != blockers:
                raise Mismatch(f"{what}: holders {err.holders}, model says pids {sorted(blockers)}")
            return
        refbytes = self.expect(what, out, None)
        w.gen += 1
        w.nbytes = size
        w.data = pattern(seed, size)
        w.gva = RefSpec.from_bytes(refbytes).gva
        self.refs.append(R(w, w.gen, refbytes, w.access))

    @precondition(lambda self: any(w.live and not w.dead for w in self.windows))
    @rule(i=st.integers(0, 999))
    def unpublish(self, i):
        w = self.pick([w for w in self.windows if w.live and not w.dead], i)
        r = next(r for r in self.refs if r.w is w and r.gen == w.gen and not r.forged)
        out = self.call(w.owner, "unpublish", r.refbytes, 0.0)
        what = f"P{w.owner}.unpublish({w.name or hex(w.gva)})"
        blockers = self.blockers(w)
        if blockers:
            err = self.expect(what, out, (LeaseHeldError,))
            if {p for p, _ in err.holders} != blockers:
                raise Mismatch(f"{what}: holders {err.holders}, model says pids {sorted(blockers)}")
            return
        self.expect(what, out, None)
        w.live = False

    @rule(size=st.sampled_from(SIZES))
    def alloc(self, size):
        """An unpublished shared array: its segment exists while the array lives, then goes."""
        STATS["steps"] += 1
        tag = f"{segment_prefix()}data.{os.getpid()}-"

        def mine() -> set[str]:
            return {n for n in os.listdir(segment_dir()) if n.startswith(tag)}

        before = mine()
        a = self.rt0.alloc(size, np.uint8)
        new = mine() - before
        a[:] = 1
        del a
        gone = mine() & new
        TRACE.append(f"P0.alloc({size}) -> {len(new)} new, {len(gone)} left")
        if len(new) != 1 or gone:
            raise Mismatch(f"alloc: expected one new segment unlinked with its array, got {new}, left {gone}")

    # -- rules: refs ---------------------------------------------------------------------------
    @precondition(lambda self: self.refs)
    @rule(i=st.integers(0, 999), kind=st.sampled_from(["forge_key", "flip_access"]))
    def derive_ref(self, i, kind):
        r = self.pick(self.refs, i)
        s = RefSpec.from_bytes(r.refbytes)
        if kind == "forge_key":
            s = dataclasses.replace(s, key=secrets.token_bytes(16))
            self.refs.append(R(r.w, r.gen, s.to_bytes(), r.access, forged=True))
        else:
            acc = "r" if s.access == "rw" else "rw"
            # widening access means forging the mint too (its MAC no longer verifies)
            mint = s.mint if s.mint is None or acc == "r" else dataclasses.replace(s.mint, access="rw")
            self.refs.append(R(r.w, r.gen, dataclasses.replace(s, access=acc, mint=mint).to_bytes(), acc, r.forged))
        TRACE.append(f"derive_ref({kind})")

    # -- rules: leases -------------------------------------------------------------------------
    @precondition(lambda self: self.refs)
    @rule(who=st.integers(0, 1), i=st.integers(0, 999), short=st.booleans())
    def lease(self, who, i, short):
        r = self.pick(self.refs, i)
        if sum(1 for x in self.leases if x.w is r.w and x.held) >= 48:
            return  # keep clear of the 64 slots
        out = self.call(who, "lease", r.refbytes, SHORT_TTL if short else LONG_TTL)
        what = f"P{who}.lease({r.w.name or hex(r.w.gva)} g{r.gen}{' forged' if r.forged else ''}, short={short})"
        errs = self.resolve_errors(r)
        lid = self.expect(what, out, errs)
        if errs is None:
            if short:
                time.sleep(2 * SHORT_TTL)  # surely expired from here on
            self.leases.append(L(who, 0 if who == 0 else self.epoch, r.w, r.gen, r.gva, short, lid))

    @precondition(lambda self: any(self.alive(x.holder, x.epoch) for x in self.leases))
    @rule(i=st.integers(0, 999))
    def renew(self, i):
        lease = self.pick([x for x in self.leases if self.alive(x.holder, x.epoch)], i)
        out = self.call(lease.holder, "renew", lease.lid, LONG_TTL)
        what = f"P{lease.holder}.renew(lease {lease.lid} held={lease.held} short={lease.short})"
        if not lease.held or lease.short:
            self.expect(what, out, (LeaseExpiredError,))
            lease.held = False
        else:
            self.expect(what, out, None)

    @precondition(lambda self: any(self.alive(x.holder, x.epoch) for x in self.leases))
    @rule(i=st.integers(0, 999))
    def release(self, i):
        lease = self.pick([x for x in self.leases if self.alive(x.holder, x.epoch)], i)
        out = self.call(lease.holder, "release", lease.lid)
        what = f"P{lease.holder}.release(lease {lease.lid}, views={lease.views})"
        if lease.views and lease.held:
            self.expect(what, out, (MemsemError,))
        else:
            self.expect(what, out, None)
            lease.held = False

    # -- rules: data ---------------------------------------------------------------------------
    def pick_lease(self, who: int, j: int, use: bool) -> L | None:
        mine = self.mine(self.leases, who)
        return self.pick(mine, j) if use and mine else None

    @precondition(lambda self: self.refs)
    @rule(who=st.integers(0, 1), i=st.integers(0, 999), j=st.integers(0, 999), use_lease=st.booleans())
    def get(self, who, i, j, use_lease):
        r = self.pick(self.refs, i)
        lease = self.pick_lease(who, j, use_lease)
        out = self.call(who, "get", r.refbytes, lease.lid if lease else None)
        what = f"P{who}.get({r.w.name or hex(r.w.gva)} g{r.gen}/{r.w.gen}{' forged' if r.forged else ''}" \
               f"{', lease ' + str(lease.lid) if lease else ''})"
        errs = self.late_extra(who, r, lease, self.resolve_errors(r), "get") or self.lease_errors(lease, r)
        got = self.expect(what, out, errs)
        if errs is None and got != r.w.data.tobytes():
            raise Mismatch(f"{what}: bytes differ from the model's")

    @precondition(lambda self: self.refs)
    @rule(who=st.integers(0, 1), i=st.integers(0, 999), j=st.integers(0, 999), use_lease=st.booleans())
    def put(self, who, i, j, use_lease):
        r = self.pick(self.refs, i)
        lease = self.pick_lease(who, j, use_lease)
        seed = self.next_seed()
        data = pattern(seed, RefSpec.from_bytes(r.refbytes).nbytes)
        out = self.call(who, "put", r.refbytes, data.tobytes(), lease.lid if lease else None)
        what = f"P{who}.put({r.w.name or hex(r.w.gva)} g{r.gen}/{r.w.gen} {r.access}/{r.w.access}" \
               f"{' forged' if r.forged else ''}{', lease ' + str(lease.lid) if lease else ''})"
        errs = self.late_extra(who, r, lease, self.resolve_errors(r), "put")
        if errs is None and (r.access == "r" or r.w.access == "r"):
            errs = (AccessDeniedError,)
        errs = errs or self.lease_errors(lease, r)
        self.expect(what, out, errs)
        if errs is None:
            r.w.data = data

    @precondition(lambda self: self.refs)
    @rule(who=st.integers(0, 1), i=st.integers(0, 999), j=st.integers(0, 999), use_lease=st.booleans())
    def view(self, who, i, j, use_lease):
        r = self.pick(self.refs, i)
        lease = self.pick_lease(who, j, use_lease)
        out = self.call(who, "view", r.refbytes, lease.lid if lease else None)
        what = f"P{who}.view({r.w.name or hex(r.w.gva)} g{r.gen}/{r.w.gen} owner P{r.w.owner} " \
               f"shared={r.w.shared}{' forged' if r.forged else ''}{', lease ' + str(lease.lid) if lease else ''})"
        errs = self.late_extra(who, r, lease, self.resolve_errors(r), "view")
        if errs is None and not (who == r.w.owner or r.w.shared):
            errs = (NotSupportedError,)
        errs = errs or self.lease_errors(lease, r)
        res = self.expect(what, out, errs)
        if errs is None:
            vid, content = res
            if content != r.w.data.tobytes():
                raise Mismatch(f"{what}: view shows bytes that differ from the model's")
            self.views.append(V(who, 0 if who == 0 else self.epoch, r.w, lease, vid))
            if lease is not None:
                lease.views += 1

    @precondition(lambda self: any(self.alive(v.holder, v.epoch) for v in self.views))
    @rule(i=st.integers(0, 999), drop=st.booleans())
    def read_or_drop_view(self, i, drop):
        v = self.pick([v for v in self.views if self.alive(v.holder, v.epoch)], i)
        if drop:
            self.expect(f"P{v.holder}.drop_view({v.vid})", self.call(v.holder, "drop_view", v.vid), None)
            self.views.remove(v)
            if v.lease is not None:
                v.lease.views -= 1
            return
        content = self.expect(f"P{v.holder}.read_view({v.vid})", self.call(v.holder, "read_view", v.vid), None)
        if content != v.w.data.tobytes():
            raise Mismatch(f"P{v.holder}.read_view({v.vid}): a live view shows bytes that differ from the model's")

    @precondition(lambda self: self.refs)
    @rule(who=st.integers(0, 1), i=st.integers(0, 999), bad=st.integers(-1, 4))
    def xcopy(self, who, i, bad):
        r = self.pick(self.refs, i)
        nb = RefSpec.from_bytes(r.refbytes).nbytes
        n = max(1, nb // 5)
        ranges = [(k * n, n) for k in range(5)]
        if bad >= 0:
            ranges[bad] = (nb - n + max(1, n // 2), n)  # runs past the end of the window
        out = self.call(who, "xcopy", r.refbytes, ranges, 10.0)
        what = f"P{who}.xcopy({r.w.name or hex(r.w.gva)} g{r.gen}/{r.w.gen}, bad range {bad})"
        states = self.expect(what, out, None)
        if [s for s, _ in states if s not in ("DONE", "FAILED")]:
            raise Mismatch(f"{what}: a range is not final: {states}")
        errs = self.resolve_errors(r)
        for k, (state, err) in enumerate(states):
            if errs is None:
                want = ("FAILED", "ValueError") if k == bad else ("DONE", "")
                if (state, err) != want:
                    raise Mismatch(f"{what}: range {k} is {state} {err}, model says {want}")
            else:
                ok = {n for c in errs for n in _names_of(c)} | {"WindowNotFoundError"} | \
                    ({"ValueError"} if k == bad else set())
                if state != "FAILED" or err not in ok:
                    raise Mismatch(f"{what}: range {k} is {state} {err}, model says FAILED with one of {ok}")

    # -- rule: kill a participant --------------------------------------------------------------
    @precondition(lambda self: self._kills < 2)
    @rule()
    def kill_p1(self):
        STATS["steps"] += 1
        STATS["kills"] += 1
        self._kills += 1
        dead_pid = self.p1.pid
        self.p1.kill()
        time.sleep(LIVENESS_INTERVAL + 0.01)  # any cached liveness verdict is stale by now
        for w in self.windows:
            if w.owner == 1 and w.epoch == self.epoch:
                w.dead = True
        self.epoch += 1
        type(self).p1 = self.start_p1()  # its Runtime start runs gc
        left = [n for n in os.listdir(segment_dir()) if n.startswith(segment_prefix()) and f".{dead_pid}-" in n]
        TRACE.append(f"kill P1 (pid {dead_pid}); restarted as pid {self.p1.pid}; {len(left)} segments left")
        if left:
            raise Mismatch(f"kill_p1: segments of the dead P1 survived the next Runtime start: {left}")

    _kills = 0

    # -- invariants and teardown ---------------------------------------------------------------
    @invariant()
    def p0_views_match(self):
        for v in self.views:
            if v.holder == 0:
                arr = self.st0.views[v.vid]
                if arr.tobytes() != v.w.data.tobytes():
                    raise Mismatch(f"P0 view {v.vid} differs from the model's bytes")

    def teardown(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            self.st0.views.clear()
            for lease in list(self.st0.leases.values()):
                try:
                    lease.release()
                except MemsemError:
                    pass
            self.st0.leases.clear()
            if self.p1 is not None and self.p1.proc.is_alive():
                try:
                    self.p1.call("close", timeout=30)
                except Exception:  # noqa: BLE001 - a broken child is replaced next example
                    self.p1.kill()
            self.rt0.close(timeout=0.2)
            self.st0.windows.clear()


@pytest.mark.timeout(900)  # ~1 min when it passes; shrinking a failure restarts processes
def test_state_machine():
    t0 = time.monotonic()
    STATS.update(steps=0, examples=0, kills=0, errors_expected=0, first_mismatch="")
    job = os.environ.get("MEMSEM_JOB")
    if PLANT:
        _agent.apply_plant(PLANT)
    try:
        run_state_machine_as_test(
            MemsemMachine,
            settings=settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                              suppress_health_check=list(HealthCheck), database=None))
    except Exception:
        print("\nlast trace:\n  " + "\n  ".join(TRACE[-40:]))
        raise
    finally:
        if MemsemMachine.p1 is not None:
            MemsemMachine.p1.stop()
            MemsemMachine.p1 = None
        if job is not None:
            os.environ["MEMSEM_JOB"] = job
    elapsed = time.monotonic() - t0
    print(f"\nstate machine: {STATS['steps']} steps in {STATS['examples']} examples, {STATS['kills']} kills, "
          f"{STATS['errors_expected']} expected errors, {elapsed:.1f} s")
    if EXAMPLES * STEPS >= 10_000:
        assert STATS["steps"] >= 10_000, STATS
