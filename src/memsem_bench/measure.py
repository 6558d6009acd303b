"""Measurements behind ``memsem bench`` and ``benchmarks/``: memsem get / put / view / pipeline
on every route this machine has, and the peers a user would otherwise pick (``np.copyto``,
multiprocessing ``shared_memory`` plus a ``Pipe``, and MPI through ``memsem_bench.mpi``),
all in one run.

Every figure is a list of per-operation samples in nanoseconds; tables and the JSON report
medians (and p99). The machine is usually shared and noisy: compare ratios of figures taken in
the same run, not absolute times across runs.

A ratio (memsem against its baseline) is measured one way everywhere: both sides interleaved
round by round (:func:`paired`, the order reversed every other round), a median per side per
round, one ratio per round, and the figure is the median of those ratios with their p10 / p90
beside it (:func:`ratio_of_rounds`, :class:`RatioStat`). Foreign load that hits one round hits
both sides of it, so the median ratio holds while absolute times drift; the spread says how far
single rounds wandered.

One module, over 600 lines, because it is one benchmark's measurements: every route's get / put /
view / pipeline and their baselines, measured the same interleaved way.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
#: 64 B .. 256 MiB, powers of 4
SIZES_FULL = [64 * 4 ** k for k in range(12)]
#: the --quick subset (keeps 64 B and 64 MiB: the issue's key figures)
SIZES_QUICK = [64, 4 * KiB, 256 * KiB, 4 * MiB, 64 * MiB]

_now = time.perf_counter_ns


def smoke() -> bool:
    """``MEMSEM_BENCH_SMOKE=1``: every measurement of ``memsem bench`` at its smallest (a handful
    of rounds, small payloads): the structure of the output is complete, the figures mean
    nothing. For the tests of the bench itself; subprocesses inherit it."""
    return os.environ.get("MEMSEM_BENCH_SMOKE", "") == "1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at this moment (bound, read, released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def at_once(fns: list[Callable[[], Any]]) -> float:
    """Run ``fns`` in threads at once (one each); the seconds from the first start to the last
    end (numpy's copies release the GIL: two copies are two streams on two cores)."""
    import threading

    ts = [threading.Thread(target=fn) for fn in fns]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def emit(fig: dict[str, Any], args: Any, filename: str, table: Callable[[dict[str, Any]], None]) -> int:
    """The end of a ``memsem bench --<table>`` command: ``fig`` to ``<args.out>/<filename>``
    (when ``--out``), ``table(fig)`` (on stderr), and with ``--json`` ``fig`` as the last line of
    stdout. Returns the exit status (0)."""
    out = getattr(args, "out", None)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, filename), "w") as fh:
            json.dump(fig, fh, indent=1)
    table(fig)
    if getattr(args, "json", False):
        print(json.dumps(fig))
    return 0


def fmt_size(n: int) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= s and n % s == 0:
            return f"{n // s} {unit}"
    return f"{n} B"


def size_key(n: int) -> str:
    return fmt_size(n).replace(" ", "")


# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Series:
    """One system's samples across payload sizes (one line in the plots)."""

    system: str          # e.g. "memsem get host/shm", "np.copyto", "MPI Send/Recv"
    op: str              # get | put | view | pipeline | copy | sendrecv | rma_get | rma_put
    route: str           # route kind or peer mechanism
    samples: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    skipped: str | None = None   # reason the whole series did not run

    def median_us(self, n: int) -> float | None:
        s = self.samples.get(n)
        return statistics.median(s) / 1e3 if s else None

    def p99_us(self, n: int) -> float | None:
        s = self.samples.get(n)
        return float(np.percentile(s, 99)) / 1e3 if s else None

    def gbps(self, n: int) -> float | None:
        m = self.median_us(n)
        return n / (m * 1e3) if m else None

    def as_dict(self) -> dict[str, Any]:
        return {"system": self.system, "op": self.op, "route": self.route, "skipped": self.skipped,
                "points": {str(n): {"median_us": self.median_us(n), "p99_us": self.p99_us(n),
                                    "GBps": self.gbps(n), "n": len(s)}
                           for n, s in sorted(self.samples.items())}}


def sample(fn: Callable[[], Any], nbytes: int, *, quick: bool, max_reps: int | None = None,
           setup: Callable[[], Any] | None = None) -> list[int]:
    """Time ``fn()`` repeatedly; per-call nanoseconds. Warm-up calls are not recorded.

    The budget per point scales with the payload: small payloads get thousands of repetitions
    (medians of sub-microsecond calls need them), large ones a handful (each moves MiBs).
    ``setup`` (untimed) runs before every timed call when given.
    """
    budget = (0.04 if quick else 0.25) if nbytes < MiB else (0.12 if quick else 0.6)
    cap = max_reps or (20000 if quick else 100000)
    for _ in range(2 if nbytes >= 16 * MiB else 20):
        if setup is not None:
            setup()
        fn()
    out: list[int] = []
    end = _now() + int(budget * 1e9)
    while len(out) < cap and (len(out) < 5 or _now() < end):
        if setup is not None:
            setup()
        t = _now()
        fn()
        out.append(_now() - t)
    return out


def paired(fns: dict[str, Callable[[], Any]], *, rounds: int, per_round: int,
           alternate: bool = True) -> dict[str, list[int]]:
    """Interleaved samples of several calls: round after round, ``per_round`` timed calls of
    each (the order of the calls reversed every other round when ``alternate``, so no side
    always runs second). Noise from other load on a shared machine then hits every contender
    alike, so their ratio holds even when absolute times drift (the key figures use this).
    Returns per-call nanoseconds, ``rounds * per_round`` per name, in round order."""
    out: dict[str, list[int]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    items = list(fns.items())
    for r in range(rounds):
        for k, fn in (items[::-1] if alternate and r % 2 else items):
            dst = out[k]
            for _ in range(per_round):
                t = _now()
                fn()
                dst.append(_now() - t)
    return out


def round_medians(samples: list[float], per_round: int) -> list[float]:
    """Median of each round of ``per_round`` consecutive samples (what :func:`paired` returns)."""
    if per_round < 1:
        raise ValueError(f"per_round must be >= 1, got {per_round!r}")
    return [statistics.median(samples[i:i + per_round]) for i in range(0, len(samples) - per_round + 1, per_round)]


@dataclasses.dataclass
class RatioStat:
    """A ratio measured round by round: ``value`` is the median of the per-round ratios, ``p10``
    / ``p90`` their 10th / 90th percentiles, ``rounds`` how many there were."""

    value: float | None
    p10: float | None = None
    p90: float | None = None
    rounds: int = 0

    @classmethod
    def of(cls, ratios: Iterable[float]) -> "RatioStat":
        rs = [float(r) for r in ratios if r is not None and math.isfinite(r)]
        if not rs:
            return cls(None)
        p10, p90 = (float(x) for x in np.percentile(rs, [10, 90]))
        return cls(statistics.median(rs), p10, p90, len(rs))

    def spread(self, nd: int = 3) -> list[float] | None:
        """``[p10, p90]`` rounded (the ``<key>_spread`` of the JSON), None when not measured."""
        return None if self.value is None else [round(self.p10, nd), round(self.p90, nd)]

    def keys(self, key: str, nd: int = 3) -> dict[str, Any]:
        """``{key: median, key_spread: [p10, p90]}`` for the figures."""
        return {key: None if self.value is None else round(self.value, nd), f"{key}_spread": self.spread(nd)}


def ratio_of_rounds(num: list[float], den: list[float]) -> RatioStat:
    """Per-round ratios ``num[i] / den[i]`` (per-round medians of the two sides), summarized."""
    if len(num) != len(den):
        raise ValueError(f"num and den must have one value per round, got {len(num)} and {len(den)}")
    return RatioStat.of(a / b for a, b in zip(num, den) if b)


def tails_us(samples: list[float]) -> tuple[float | None, float | None]:
    """The p99 and p999 (us) of per-call times given in ns; None, None without samples."""
    if not samples:
        return None, None
    p99, p999 = np.percentile(samples, [99, 99.9])
    return float(p99) / 1e3, float(p999) / 1e3


def tail_ratio(num: list[float], den: list[float], per_round: int, q: float = 99.0) -> RatioStat:
    """Tail against tail: the ``q``-th percentile of ``num``'s per-call times over ``den``'s,
    every round pooled (the samples of :func:`paired`, ``per_round`` per round, both sides in
    the same rounds); ``p10`` / ``p90`` of the same ratio taken round by round."""
    if per_round < 1:
        raise ValueError(f"per_round must be >= 1, got {per_round!r}")
    if not num or not den:
        return RatioStat(None)
    value = float(np.percentile(num, q)) / float(np.percentile(den, q))
    rs = [float(np.percentile(num[i:i + per_round], q)) / float(np.percentile(den[i:i + per_round], q))
          for i in range(0, min(len(num), len(den)) - per_round + 1, per_round)]
    if not rs:
        return RatioStat(value, value, value, 1)
    p10, p90 = (float(x) for x in np.percentile(rs, [10, 90]))
    return RatioStat(value, p10, p90, len(rs))


def spread_keys(key: str, per_round: list[float], scale: float = 1.0, nd: int = 3) -> dict[str, Any]:
    """``{key: median, key_spread: [p10, p90]}`` of per-round values (times ``scale``): the
    spread of an absolute figure across its rounds."""
    st = RatioStat.of(v * scale for v in per_round)
    return st.keys(key, nd)


def core_figures(get64: Any, get64m: Any, view64m: Any, *, quick: bool) -> dict[str, Any]:
    """Issue 2's benchmark: cross-process get of 64 B and 64 MiB and ``view()`` of a 64 MiB
    window, each interleaved with ``np.copyto`` of the same size (medians, us and GB/s), and the
    ratios of rounds (``get_64B_vs_copyto``, ``get_64MiB_vs_copyto`` = get GB/s over copyto
    GB/s) as :class:`RatioStat`; ``rounds`` holds the per-round medians (ns). The 64 B tails:
    p99 / p999 of every call of those rounds (``get_64B_p99_us``, ``copyto_64B_p99_us``...) and
    ``get_64B_p99_vs_copyto_p99`` (:func:`tail_ratio`)."""
    med = statistics.median
    small_out, s_src, s_dst = np.empty(64, np.uint8), np.ones(64, np.uint8), np.empty(64, np.uint8)
    pr = 200
    a = paired({"get": lambda: get64.get(small_out), "copyto": lambda: np.copyto(s_dst, s_src)},
               rounds=30 if quick else 100, per_round=pr)
    big_out, b_src, b_dst = np.empty(64 * MiB, np.uint8), np.ones(64 * MiB, np.uint8), np.empty(64 * MiB, np.uint8)
    b = paired({"get": lambda: get64m.get(big_out), "copyto": lambda: np.copyto(b_dst, b_src)},
               rounds=25 if quick else 60, per_round=1)
    del big_out, b_src, b_dst

    vs: list[int] = []  # view() alone; the drop (a lease release) is untimed
    for _ in range(500 if quick else 3000):
        t = _now()
        arr = view64m.view()
        vs.append(_now() - t)
        del arr
    ag, ac = round_medians(a["get"], pr), round_medians(a["copyto"], pr)
    vr = round_medians(vs, 50)
    (g99, g999), (c99, c999) = tails_us(a["get"]), tails_us(a["copyto"])
    return {
        # tails of the per-call times of the same rounds as the medians
        "get_64B_p99_us": g99, "get_64B_p999_us": g999, "copyto_64B_p99_us": c99, "copyto_64B_p999_us": c999,
        "get_64B_p99_vs_copyto_p99": tail_ratio(a["get"], a["copyto"], pr),
        "get_64B_p999_vs_copyto_p999": tail_ratio(a["get"], a["copyto"], pr, 99.9),
        "get_64B_us": med(a["get"]) / 1e3, "copyto_64B_us": med(a["copyto"]) / 1e3,
        "get_64MiB_GBps": 64 * MiB / med(b["get"]), "copyto_64MiB_GBps": 64 * MiB / med(b["copyto"]),
        "view_64MiB_us": med(vs) / 1e3,
        "get_64B_vs_copyto": ratio_of_rounds(ag, ac),
        "get_64MiB_vs_copyto": ratio_of_rounds(b["copyto"], b["get"]),  # GB/s ratio = time ratio inverted
        "rounds": {"get_64B": ag, "copyto_64B": ac, "get_64MiB": b["get"], "copyto_64MiB": b["copyto"],
                   "view_64MiB": vr},
    }


def raw_cma_reader(pid: int, remote: int, nbytes: int) -> tuple[Callable[[], Any], np.ndarray, str]:
    """``process_vm_readv`` of ``nbytes`` at ``remote`` in ``pid`` through cffi's ABI mode on
    libc: nothing of memsem around it. Returns the call, its destination and the binding."""
    import cffi

    out = np.empty(nbytes, np.uint8)
    abi = cffi.FFI()
    abi.cdef("struct iovec { void *iov_base; size_t iov_len; };"
             "ssize_t process_vm_readv(int, const struct iovec *, unsigned long, const struct iovec *,"
             " unsigned long, unsigned long);")
    libc = abi.dlopen(None)
    liov = abi.new("struct iovec *", (abi.cast("void *", out.__array_interface__["data"][0]), nbytes))
    riov = abi.new("struct iovec *", (abi.cast("void *", remote), nbytes))

    def call(fn: Any = libc.process_vm_readv, pid: int = pid, liov: Any = liov, riov: Any = riov,
             _keep: Any = (abi, libc)) -> int:
        return fn(pid, liov, 1, riov, 1, 0)

    return call, out, "cffi (ABI mode, libc)"


def ctypes_cma_reader(pid: int, remote: int, nbytes: int) -> tuple[Callable[[], Any], np.ndarray, str]:
    """``process_vm_readv`` through ctypes (the binding most Python code would write)."""
    import ctypes

    out = np.empty(nbytes, np.uint8)

    class _Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    loc = _Iovec(out.__array_interface__["data"][0], nbytes)
    rem = _Iovec(remote, nbytes)
    lp, rp = ctypes.byref(loc), ctypes.byref(rem)

    def call(fn: Any = fn, pid: int = pid, lp: Any = lp, rp: Any = rp, _keep: Any = (loc, rem, libc)) -> int:
        return fn(pid, lp, 1, rp, 1, 0)

    return call, out, "ctypes"


def cma_figures(get64_cma: Any, raw: tuple[int, int] | None, *, quick: bool) -> dict[str, Any]:
    """Issue 15's cross-memory-attach figure: a memsem 64 B get over host/cma interleaved with
    one bare ``process_vm_readv`` of the same 64 bytes from Python (no memsem around it: the
    cheaper of cffi ABI mode and ctypes), medians in us; ``get_64B_cma_vs_raw`` is the
    :class:`RatioStat` of the rounds against the cheaper binding."""
    med = statistics.median
    out = np.empty(64, np.uint8)
    fns: dict[str, Callable[[], Any]] = {"get": lambda: get64_cma.get(out)}
    bindings = {}
    if raw is not None:
        for name, make in (("cffi", raw_cma_reader), ("ctypes", ctypes_cma_reader)):
            try:
                fn, dst, what = make(raw[0], raw[1], 64)
            except Exception:
                continue
            if fn() != 64:  # it must really read the 64 bytes
                continue
            fns[name] = fn
            bindings[name] = (what, dst)
    pr = 200
    a = paired(fns, rounds=30 if quick else 100, per_round=pr)
    res: dict[str, Any] = {"get_64B_us_cma": med(a["get"]) / 1e3}
    raws = {k: med(a[k]) / 1e3 for k in bindings}
    if raws:
        best = min(raws, key=raws.get)
        res["cma_raw_64B_us"] = raws[best]
        res["cma_raw_binding"] = bindings[best][0]
        res["cma_raw_by_binding_us"] = {bindings[k][0]: v for k, v in raws.items()}
        res["get_64B_cma_vs_raw"] = ratio_of_rounds(round_medians(a["get"], pr), round_medians(a[best], pr))
    else:
        res["cma_raw_64B_us"] = None
        res["get_64B_cma_vs_raw"] = RatioStat(None)
    return res


# ---------------------------------------------------------------------------------- producer --
def _producer(conn: Any, sizes: list[int], fill: int) -> None:
    """A separate process owning windows: per size, one in a shared segment (``rt.alloc``,
    route host/shm) and one in private memory (route host/cma); both ``rw``. Also serves the
    multiprocessing shared_memory + Pipe peer."""
    import memsem

    try:
        with memsem.Runtime() as rt:
            refs: dict[str, Any] = {"host/shm": {}, "host/cma": {}}
            keep = []
            for n in sizes:
                a = rt.alloc(n, np.uint8)
                a.fill(fill)
                b = np.full(n, fill, np.uint8)
                keep += [a, b]
                refs["host/shm"][n] = rt.publish(a, name=f"bench/shm/{n}", access="rw").to_bytes()
                refs["host/cma"][n] = rt.publish(b, name=f"bench/cma/{n}", access="rw").to_bytes()
                if n == 64:  # for the raw process_vm_readv peer: where those 64 bytes are
                    refs["raw_cma_64"] = (os.getpid(), b.__array_interface__["data"][0])
            conn.send(("ok", refs))
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                if msg[0] == "mp":
                    _serve_mp(conn, msg[1], msg[2])
            conn.send(("bye", rt.stats().as_dict()))
    except BaseException as exc:  # reported to the parent
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except Exception:
            pass


def _serve_mp(conn: Any, shm_name: str, n: int) -> None:
    """Peer "multiprocessing shared_memory + Pipe": the consumer asks over the Pipe, the owner
    answers once the bytes are in the segment (here they already are), the consumer copies."""
    from multiprocessing import shared_memory

    seg = shared_memory.SharedMemory(name=shm_name)
    try:
        np.frombuffer(seg.buf, np.uint8, n).fill(7)
        conn.send_bytes(b"r")
        while True:
            m = conn.recv_bytes()
            if m == b"x":
                break
            conn.send_bytes(b"k")
    finally:
        seg.close()


class Producer:
    """Handle on the producer process (spawned, so it is a real separate process)."""

    def __init__(self, sizes: list[int], fill: int = 7) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer, args=(child, sizes, fill), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("bench producer did not start within 120 s")
        tag, body = self.conn.recv()
        if tag != "ok":
            raise RuntimeError(f"bench producer failed: {body}")
        #: route -> size -> ref bytes; "raw_cma_64": (pid, address) of the 64 B private array
        self.raw_cma: tuple[int, int] | None = body.pop("raw_cma_64", None)
        self.refs: dict[str, dict[int, bytes]] = body
        self.stats: dict[str, Any] | None = None

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                if self.conn.poll(30):
                    tag, body = self.conn.recv()
                    if tag == "bye":
                        self.stats = body
            except (OSError, EOFError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# ---------------------------------------------------------------------------------- memsem ----
def memsem_series(rt: Any, route: str, refs: dict[int, Any], sizes: list[int], *, quick: bool,
                  tick: Callable[[], None], ops: Iterable[str] = ("get", "put", "view", "pipeline")
                  ) -> list[Series]:
    """get / put / view / pipeline through ``refs`` (one TensorRef per size) on ``route``."""
    from memsem import NotSupportedError

    out = []
    for op in ops:
        s = Series(f"memsem {op} {route}", op, route)
        for n in sizes:
            ref = refs[n]
            try:
                if op == "get":
                    buf = np.empty(n, np.uint8)
                    s.samples[n] = sample(lambda: ref.get(buf), n, quick=quick)
                elif op == "put":
                    src = np.full(n, 3, np.uint8)
                    s.samples[n] = sample(lambda: ref.put(src), n, quick=quick)
                elif op == "view":
                    s.samples[n] = _view_samples(ref, n, quick)
                elif op == "pipeline":
                    s.samples[n] = _pipeline_samples(rt, ref, n, quick)
            except NotSupportedError as exc:
                s.skipped = f"{type(exc).__name__}: {exc}"
                for _ in sizes[sizes.index(n):]:
                    tick()
                break
            tick()
        out.append(s)
    return out


def _view_samples(ref: Any, n: int, quick: bool) -> list[int]:
    """Time ``ref.view()`` alone (lease acquire + mapping the window); the view is dropped
    (lease released) between timed calls, untimed."""
    cap = 2000 if quick else 10000
    res: list[int] = []
    arr = ref.view()
    del arr
    end = _now() + int((0.04 if quick else 0.25) * 1e9)
    while len(res) < cap and (len(res) < 5 or _now() < end):
        t = _now()
        arr = ref.view()
        res.append(_now() - t)
        del arr
    return res


def pipeline_tile_bytes(n: int) -> int:
    """Tile size the sweep uses: 8 tiles of at least 4 KiB (one tile for small payloads)."""
    return min(n, max(4 * KiB, n // 8))


def _pipeline_samples(rt: Any, ref: Any, n: int, quick: bool) -> list[int]:
    """Time streaming the whole ref through a depth-2 staged pipeline (copies, no compute)."""
    tb = pipeline_tile_bytes(n)

    def run() -> None:
        with rt.pipeline(ref, tile_bytes=tb, depth=2, zero_copy=False, wait_ready=False) as p:
            for tile in p:
                tile.release()

    return sample(run, n, quick=quick, max_reps=300 if quick else 2000)


# ------------------------------------------------------------------------------------- peers --
def copyto_series(sizes: list[int], *, quick: bool, tick: Callable[[], None]) -> Series:
    """``np.copyto`` between two private arrays of one process: the physical anchor."""
    s = Series("np.copyto", "copy", "memcpy")
    for n in sizes:
        src = np.full(n, 5, np.uint8)
        dst = np.empty(n, np.uint8)
        s.samples[n] = sample(lambda: np.copyto(dst, src), n, quick=quick)
        tick()
    return s


def mp_series(prod: Producer, sizes: list[int], *, quick: bool, tick: Callable[[], None]) -> Series:
    """multiprocessing ``shared_memory`` + ``Pipe``: request over the Pipe, the owner answers
    when the bytes are ready, the consumer copies them out of its mapping of the segment."""
    from multiprocessing import shared_memory

    s = Series("mp shared_memory+Pipe", "get", "shm+pipe")
    conn = prod.conn
    for n in sizes:
        seg = shared_memory.SharedMemory(create=True, size=n)
        try:
            conn.send(("mp", seg.name, n))
            if conn.recv_bytes() != b"r":
                raise RuntimeError("mp peer: unexpected answer")
            view = np.frombuffer(seg.buf, np.uint8, n)
            out = np.empty(n, np.uint8)

            def one() -> None:
                conn.send_bytes(b"g")
                conn.recv_bytes()
                np.copyto(out, view)

            s.samples[n] = sample(one, n, quick=quick)
            conn.send_bytes(b"x")
            del view
        finally:
            seg.close()
            seg.unlink()
        tick()
    return s


def mpi_available() -> tuple[bool, str]:
    """Whether mpi4py is importable and an ``mpiexec`` can be found (the mpich wheel's first)."""
    if importlib.util.find_spec("mpi4py") is None:
        return False, "mpi4py is not installed (pip install 'mpi4py>=3.1' mpich: mpi4py and the mpich wheel)"
    if mpiexec_path() is None:
        return False, "no mpiexec found (the mpich PyPI wheel installs one next to python)"
    return True, ""


def mpiexec_path() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    return shutil.which("mpiexec")


def mpi_series(sizes: list[int], *, quick: bool, timeout: float = 120.0) -> tuple[list[Series], str | None, dict]:
    """Run ``memsem_bench.mpi`` under ``mpiexec -n 2``; its JSON becomes three Series
    (Send/Recv one-way, RMA Get, RMA Put with passive-target locks)."""
    names = {"sendrecv": "MPI Send/Recv", "rma_get": "MPI RMA Get (lock)", "rma_put": "MPI RMA Put (lock)"}
    series = [Series(v, k, "mpi") for k, v in names.items()]
    ok, why = mpi_available()
    if not ok:
        for s in series:
            s.skipped = why
        return series, why, {}
    cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "memsem_bench.mpi", "--pair-memsem",
           "--sizes", ",".join(map(str, sizes))] + (["--quick"] if quick else [])
    env = dict(os.environ, MEMSEM_JOB=f"benchmpi{os.getpid()}")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        why = f"mpiexec -n 2 did not finish in {timeout:.0f} s"
        for s in series:
            s.skipped = why
        return series, why, {}
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    if p.returncode != 0 or line is None:
        why = f"mpiexec -n 2 failed (rc {p.returncode}): {(p.stderr or p.stdout).strip()[-400:]}"
        for s in series:
            s.skipped = why
        return series, why, {}
    data = json.loads(line)
    for s in series:
        for n, samples in data["samples"][s.op].items():
            s.samples[int(n)] = samples
    info: dict[str, Any] = {"library": data.get("library", "")}
    pair = data.get("paired")
    if pair:
        info["get_64B_vs_mpi_sendrecv"] = ratio_of_rounds(pair["get"], pair["sendrecv"])
        info["pair_route"] = pair.get("route")
        info["pair_get_64B_us"] = statistics.median(pair["get"]) / 1e3
        info["pair_sendrecv_64B_us"] = statistics.median(pair["sendrecv"]) / 1e3
    return series, None, info


# ------------------------------------------------------------------------- optional engines --
def _engine_status(name: str) -> str | None:
    """None when engine ``name`` exists and its probe says it can run, else why not."""
    if importlib.util.find_spec(f"memsem.engines.{name}") is None:
        return f"memsem.engines.{name} does not exist in this install"
    try:
        from memsem.engines import engine_class

        avail = engine_class(name).probe()
    except Exception as exc:
        return f"engine {name!r} cannot be loaded: {type(exc).__name__}: {exc}"
    return None if avail else f"engine {name!r} unavailable: {avail.reason}"


def tcp_status() -> str | None:
    """None when a TCP engine exists to benchmark, else the reason it is skipped."""
    return _engine_status("tcp")


def mte_status() -> str | None:
    """None when the MTE engine can run (through the SHMEM emulator), else why it is skipped."""
    if not os.environ.get("MEMSEM_SHMEM_LIB"):
        return "MEMSEM_SHMEM_LIB is not set (build the SHMEM emulator and point it there)"
    return _engine_status("mte")


def _engine_producer(conn: Any, engine: str, sizes: list[int], uid: Any) -> None:
    """Producer of an optional engine's windows (TCP, or MTE as PE 0 of a 2-PE team)."""
    import memsem

    team = None
    try:
        kw: dict[str, Any] = {}
        if engine == "mte":
            from memsem.engines.mte import init_team

            team = init_team(0, 2, uid, heap_bytes=_heap_bytes(sizes))
        with memsem.Runtime(engines=("loopback", "host", engine), prefer=engine) as rt:
            refs = {}
            keep = []
            for n in sizes:
                a = rt.alloc(n, np.uint8, engine="mte") if engine == "mte" else np.full(n, 7, np.uint8)
                if engine == "mte":
                    a[...] = 7
                keep.append(a)
                refs[n] = rt.publish(a, name=f"bench/{engine}/{n}", access="rw").to_bytes()
            conn.send(("ok", refs))
            conn.recv()
            conn.send(("bye", None))
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except Exception:
            pass
    finally:
        if team is not None:
            try:
                team.close()
            except Exception:
                pass


def _heap_bytes(sizes: list[int]) -> int:
    return max(64 * MiB, 2 * sum(sizes) + 16 * MiB)


def engine_series(engine: str, sizes: list[int], *, quick: bool, tick: Callable[[], None]) -> list[Series]:
    """get / put on an optional engine's route; raises with the reason when it cannot run."""
    import memsem

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    uid = None
    team = None
    if engine == "mte":
        from memsem.engines.mte import init_team, new_uniqueid

        uid = new_uniqueid()
    proc = ctx.Process(target=_engine_producer, args=(child, engine, sizes, uid), daemon=True)
    proc.start()
    try:
        if engine == "mte":
            team = init_team(1, 2, uid, heap_bytes=_heap_bytes(sizes))
        if not conn.poll(120):
            raise RuntimeError(f"{engine} producer did not start")
        tag, body = conn.recv()
        if tag != "ok":
            raise RuntimeError(f"{engine} producer failed: {body}")
        with memsem.Runtime(engines=("loopback", "host", engine), prefer=engine) as rt:
            refs = {n: rt.ref(b) for n, b in body.items()}
            route = refs[sizes[0]].route().kind
            series = memsem_series(rt, route, refs, sizes, quick=quick, tick=tick, ops=("get", "put"))
        conn.send("stop")
        return series
    finally:
        if proc.is_alive():
            try:
                conn.send("stop")
            except OSError:
                pass
        proc.join(20)
        if proc.is_alive():
            proc.kill()
        if team is not None:
            try:
                team.close()
            except Exception:
                pass
