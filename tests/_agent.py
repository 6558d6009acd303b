"""A long-lived memsem participant in another process, driven over a multiprocessing Pipe.

Used by the lease, fault and state-machine tests: the test process is one participant, an
``Agent`` is another (owner of windows, consumer of the test's windows, lease holder, viewer),
and ``Agent.kill()`` is a real SIGKILL. Every call is bounded (``timeout``); a remote failure
comes back as the same memsem exception class with the remote message.
"""
from __future__ import annotations

import builtins
import os
import signal
import time
import traceback
from typing import Any

import numpy as np

class AgentHung(AssertionError):
    """The agent did not answer within the call's timeout."""


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """The bytes a window published with ``seed`` holds (both sides compute them)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# ---------------------------------------------------------------------------------------- child
class _State:
    def __init__(self) -> None:
        self.rt: Any = None
        # Every array this participant published, kept alive until its runtime closes: a bug
        # that lets a stale ref through then shows up as wrong results, not as a crash.
        self.windows: list[Any] = []
        self.leases: dict[int, Any] = {}
        self.views: dict[int, Any] = {}
        self.next_id = 1

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id


def _ref(st: _State, refbytes: bytes):
    return st.rt.ref(refbytes)


def _op_runtime(st: _State, job: str, timeout: float, engines: Any = None, delay: float = 0.0) -> int:
    import memsem

    _op_close(st)
    os.environ["MEMSEM_JOB"] = job
    kw: dict[str, Any] = {}
    if delay:
        from memsem.engines.host import HostEngine
        from memsem.testing import ScriptedEngine

        kw["engine_objects"] = {"host": ScriptedEngine(HostEngine(), delay=delay)}
    st.rt = memsem.Runtime(timeout=timeout, engines=engines, **kw)
    return os.getpid()


def _op_close(st: _State) -> None:
    st.views.clear()
    for lease in st.leases.values():
        try:
            lease.release()
        except Exception:
            pass
    st.leases.clear()
    if st.rt is not None:
        st.rt.close(timeout=0.5)
        st.rt = None
    st.windows.clear()


def _op_publish(st: _State, seed: int, nbytes: int, shared: bool, access: str, name: str | None,
                replace: bool = False) -> bytes:
    data = pattern(seed, nbytes)
    if shared:
        arr = st.rt.alloc(nbytes, np.uint8)
        arr[:] = data
    else:
        arr = data
    ref = st.rt.publish(arr, name=name, access=access, replace=replace)
    st.windows.append(arr)
    return ref.to_bytes()


def _op_publish_big(st: _State, nbytes: int, shared: bool) -> bytes:
    arr = st.rt.alloc(nbytes, np.uint8) if shared else np.empty(nbytes, np.uint8)
    arr[:] = 7
    ref = st.rt.publish(arr, access="r")
    st.windows.append(arr)
    return ref.to_bytes()


def _op_unpublish(st: _State, refbytes: bytes, timeout: float) -> None:
    st.rt.unpublish(_ref(st, refbytes), timeout=timeout)


def _op_lease(st: _State, refbytes: bytes, ttl: float | None) -> int:
    lease = _ref(st, refbytes).lease(ttl=ttl).acquire()
    lid = st.new_id()
    st.leases[lid] = lease
    return lid


def _op_renew(st: _State, lid: int, ttl: float | None = None) -> float:
    return st.leases[lid].renew(ttl)


def _op_release(st: _State, lid: int) -> None:
    st.leases[lid].release()


def _op_get(st: _State, refbytes: bytes, lid: int | None = None) -> bytes:
    ref = _ref(st, refbytes)
    out = np.empty(ref.nbytes, np.uint8)
    ref.bytes(0, ref.nbytes).get(out, lease=st.leases.get(lid) if lid else None)
    return out.tobytes()


def _op_put(st: _State, refbytes: bytes, data: bytes, lid: int | None = None) -> None:
    ref = _ref(st, refbytes)
    ref.bytes(0, ref.nbytes).put(np.frombuffer(data, np.uint8), lease=st.leases.get(lid) if lid else None)


def _op_view(st: _State, refbytes: bytes, lid: int | None = None) -> tuple[int, bytes]:
    ref = _ref(st, refbytes)
    v = ref.bytes(0, ref.nbytes).view(lease=st.leases.get(lid) if lid else None)
    vid = st.new_id()
    st.views[vid] = v
    return vid, v.tobytes()


def _op_read_view(st: _State, vid: int) -> bytes:
    return st.views[vid].tobytes()


def _op_drop_view(st: _State, vid: int) -> None:
    del st.views[vid]  # no cycles: the view's finalizer runs now


def _op_xcopy(st: _State, refbytes: bytes, ranges: list[tuple[int, int]], timeout: float) -> list[tuple[str, str]]:
    ref = _ref(st, refbytes)
    pairs = []
    for off, n in ranges:
        from memsem.gva import RefSpec

        s = ref.spec
        spec = RefSpec(s.gva, s.generation, s.key, s.access, s.offset + off, n, s.dtype_code, (n,), 0,
                       "numpy", s.name)
        from memsem import TensorRef

        pairs.append((TensorRef(spec, st.rt), np.empty(n, np.uint8)))
    batch = st.rt.xcopy(pairs)
    try:
        res = batch.wait(timeout)
    finally:
        batch.close(timeout)
    return [(r.state.name, type(r.error).__name__ if r.error else "") for r in res]


def _op_pid(st: _State) -> int:
    return os.getpid()


def _op_segments(st: _State) -> list[str]:
    from memsem.native import segment_dir, segment_prefix

    tag = f".{os.getpid()}-"
    return sorted(n for n in os.listdir(segment_dir()) if n.startswith(segment_prefix()) and tag in n)


def _op_loop_get(st: _State, refbytes: bytes, seconds: float) -> list[str]:
    """Resolve and get ``refbytes`` over and over (fresh resolution each time) for ``seconds``;
    return the outcome of each attempt (``"ok"`` or an exception class name)."""
    out = []
    ref = _ref(st, refbytes)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        st.rt.resolver.drop(ref.spec.gva)
        try:
            a = ref.get()
            out.append("ok" if a.size == ref.nbytes else "short")
        except Exception as exc:  # noqa: BLE001 - the test inspects every outcome
            out.append(type(exc).__name__)
    return out


def _op_loop_put(st: _State, refbytes: bytes, seconds: float) -> list[str]:
    """Put to ``refbytes`` over and over for ``seconds``; outcomes as for ``loop_get``."""
    out = []
    ref = _ref(st, refbytes)
    src = np.full(ref.nbytes, 3, np.uint8)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            ref.bytes(0, ref.nbytes).put(src)
            out.append("ok")
        except Exception as exc:  # noqa: BLE001 - the test inspects every outcome
            out.append(type(exc).__name__)
    return out


def _op_chaos(st: _State, refbytes: bytes, seed: int, seconds: float) -> int:
    """Random operations on one window (get, put, lease + get, view, wait_tile, pipeline) for
    ``seconds``, expected errors swallowed; returns how many ran. Killed at a random instant by
    the kill-loop test."""
    import random

    import memsem

    rng = random.Random(seed)
    ref = _ref(st, refbytes)
    raw = ref.bytes(0, ref.nbytes)
    buf = np.empty(ref.nbytes, np.uint8)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        op = rng.randrange(7)
        try:
            if op == 0:
                raw.get(buf)
            elif op == 1:
                raw.put(buf)
            elif op == 2:
                with ref.lease(ttl=rng.choice([0.05, 5.0, None])) as lease:
                    raw.get(buf, lease=lease)
            elif op == 3:
                v = raw.view()
                v[:8].sum()
                del v
            elif op == 4:
                ref.wait_tile(rng.randrange(max(1, len(ref.ready_tiles()) or 1)), timeout=0.01)
            elif op == 5:
                with st.rt.pipeline(raw, tile_bytes=max(1, ref.nbytes // 4), wait_ready=False) as p:
                    for tile in p:
                        with tile:
                            tile.raw[:1].sum()
            else:
                st.rt.resolver.drop(ref.spec.gva)
        except (memsem.MemsemError, ValueError):
            pass
        n += 1
    return n


def apply_plant(name: str) -> None:
    """Plant a known bug in this process (used to show the state machine catches it; the
    source files are never edited). Names: ``no-bump-on-republish`` (a republish keeps the old
    generation), ``renew-ignores-expiry`` (renew extends an expired lease)."""
    import threading

    from memsem import native
    from memsem.gva import _control_block as _control, _lease_slots as _lease
    from memsem.core import _publish

    if name == "no-bump-on-republish":
        flag = threading.local()
        orig_rep, orig_bump = _publish.Publisher._republish, _control.ControlBlock.bump_generation

        def _republish(self, *a, **k):
            flag.on = True
            try:
                return orig_rep(self, *a, **k)
            finally:
                flag.on = False

        def bump(self):
            return self.generation if getattr(flag, "on", False) else orig_bump(self)

        _publish.Publisher._republish = _republish
        _control.ControlBlock.bump_generation = bump
    elif name == "renew-ignores-expiry":
        def renew(cb, slot, lease_id, ttl_ns):
            a = cb.lease_slot_addr(slot)
            if native.load_acquire(a + 24) != lease_id:
                return 0
            new = native.monotonic_ns() + ttl_ns
            native.store_release(a + 16, new)
            return new

        _lease.renew = renew
    elif name:
        raise ValueError(f"unknown plant {name!r}")


def _op_plant(st: _State, name: str) -> None:
    apply_plant(name)


_OPS = {k[4:]: v for k, v in globals().items() if k.startswith("_op_")}


def serve(conn: Any) -> None:
    """Child main loop: ``(op, args)`` in, ``("ok", result)`` or ``("err", cls, msg, holders)`` out."""
    st = _State()
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "exit":
            _op_close(st)
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", _OPS[op](st, *args)))
        except BaseException as exc:  # noqa: BLE001 - shipped to the parent
            conn.send(("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}",
                       getattr(exc, "holders", None)))


# --------------------------------------------------------------------------------------- parent
def remote_error(cls_name: str, msg: str, holders: Any) -> BaseException:
    import memsem

    cls = getattr(memsem, cls_name, None) or getattr(builtins, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        return RuntimeError(f"{cls_name}: {msg}")
    if cls_name == "LeaseHeldError":
        return cls(msg, holders=holders)
    try:
        return cls(msg)
    except TypeError:
        return RuntimeError(f"{cls_name}: {msg}")


class Agent:
    """Parent-side handle of one participant process.

    Args:
        ctx: a multiprocessing context (spawn or forkserver).
        job: MEMSEM_JOB for the child's runtime.
        timeout: the child runtime's default timeout.
    """

    def __init__(self, ctx: Any, job: str | None = None, timeout: float = 5.0, start_runtime: bool = True,
                 **runtime_kw: Any) -> None:
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        if start_runtime:
            self.call("runtime", job or os.environ["MEMSEM_JOB"], timeout, runtime_kw.get("engines"),
                      runtime_kw.get("delay", 0.0), timeout=60)

    def send(self, op: str, *args: Any) -> None:
        """Start a call without waiting (pair with ``result``)."""
        self._conn.send((op, args))

    def result(self, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
            if not self.proc.is_alive():
                raise AgentHung(f"agent pid {self.pid} died (exit code {self.proc.exitcode}) without answering")
            if time.monotonic() >= deadline:
                raise AgentHung(f"agent pid {self.pid} did not answer within {timeout} s")
        msg = self._conn.recv()
        if msg[0] == "ok":
            return msg[1]
        raise remote_error(msg[1], msg[2], msg[3])

    def call(self, op: str, *args: Any, timeout: float = 30.0) -> Any:
        self.send(op, *args)
        return self.result(timeout)

    def kill(self) -> None:
        """SIGKILL and reap (bounded)."""
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)
        self._conn.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask to close its runtime and exit; kill it if it does not within ``timeout``."""
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=timeout)
            except (AgentHung, EOFError, OSError, BrokenPipeError):
                pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
        else:
            self._conn.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
