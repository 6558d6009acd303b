"""Cost as the work grows (issue 24 section 4): each figure at scale against the same figure with
one window, both sides interleaved round by round in one run.

=====================================  ============================================================
``get_64B_us_at_10k_windows``          a 64 B get (host/shm, another process owns the windows)
                                       while 10,000 windows are live in the job and the consumer
                                       reads them in turn, after passes over all of them (its
                                       cache's bound follows that working set from
                                       ``RESOLUTION_LIMIT`` up to ``RESOLUTION_CAP``)
``copyto_64B_us_at_10k_mappings``      (context) the machine's cost of that access pattern:
                                       ``np.copyto`` of 64 B from 10,000 mappings of a page each,
                                       in turn, against one mapping (``_ratio``); and
                                       ``get_64B_us_at_10k_windows_vs_machine``: memsem's ratio
                                       over the machine's, per round
``get_64B_us_first_touch``             (context) the first get of each of those windows in this
                                       process: a resolve each (directory record, two mappings,
                                       the route)
``get_64B_us_at_10k_windows_hot``      the same job, one window read again and again (cached):
                                       what the number of windows costs when the cache holds
``publish_unpublish_us_at_10k_windows``  publish + unpublish of a 64 B ``Runtime.alloc`` array by
                                       an owner that holds 10,000 such windows
``get_64B_us_16_consumers``            16 consumer processes reading one window at once, per-get
                                       median (``cpus`` says how many cores they share)
``lookup_us_redis_10k_names``          ``Runtime.lookup`` of one of 10,000 names in a redis
                                       directory (a real ``redis-server`` on loopback); a lookup
                                       resolves the window it finds: both it and its base resolve
                                       anew each time (``lookup_us_redis_cached``: the one name
                                       with its window's resolution kept, for context)
=====================================  ============================================================

Each has a base measured beside it (one window in a job of its own; one consumer alone; one
name) and ``<key>_ratio`` = median of per-round ratios, ``<key>_ratio_spread`` = [p10, p90].
Goals (issue 24): <= 1.2, <= 1.5, reported, <= 1.5. The processes: an owner process holds the
10,000 windows (job of its own) and the one window (another job); the consumer is the calling
process; the 16 consumers are forked by one spawned hub; the redis owners are one more process.

One module, over 600 lines, because its figures share their owners (the processes holding the
10,000 windows and names, published once) and their rounds: split, each part would publish
its own 10,000 windows.
"""
from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from memsem_bench.measure import RatioStat, free_port

N_WINDOWS = 10_000
N_CONSUMERS = 16
_now = time.perf_counter_ns
_SPAWN = mp.get_context("spawn")

#: key -> (goal text, check of the ratio); None: reported, no goal
GOALS: dict[str, tuple[str, Callable[[float], bool] | None]] = {
    "get_64B_us_at_10k_windows_ratio": ("<= 1.2 (x get of one window)", lambda x: x <= 1.2),
    "publish_unpublish_us_at_10k_windows_ratio": ("<= 1.5 (x with one window)", lambda x: x <= 1.5),
    "get_64B_us_16_consumers_ratio": ("reported (x one consumer alone)", None),
    "lookup_us_redis_10k_names_ratio": ("<= 1.5 (x with one name)", lambda x: x <= 1.5),
}


def _ratio(num: list[float], den: list[float]) -> RatioStat:
    return RatioStat.of(a / b for a, b in zip(num, den) if b)


def _interleave(sides: dict[str, Callable[[], list[int]]], rounds: int) -> dict[str, list[float]]:
    """Rounds of every side (the order reversed every other round); each side returns its
    samples of one round (ns) and this keeps their median per round."""
    out: dict[str, list[float]] = {k: [] for k in sides}
    items = list(sides.items())
    for r in range(rounds):
        for k, fn in (items if r % 2 == 0 else items[::-1]):
            out[k].append(statistics.median(fn()))
    return out


# -- the owner of 10,000 windows ------------------------------------------------------------------------
def _owner(conn: Any, n: int, job_big: str, job_one: str) -> None:
    import memsem

    try:
        with memsem.Runtime(job=job_big, timeout=120) as big, memsem.Runtime(job=job_one, timeout=120) as one:
            keep = []
            refs = []
            for i in range(n):
                a = big.alloc(64, np.uint8)
                a[:] = i % 251
                keep.append(a)
                refs.append(big.publish(a, access="r").to_bytes())
            a1 = one.alloc(64, np.uint8)
            a1[:] = 7
            ref1 = one.publish(a1, access="r").to_bytes()
            conn.send(("ok", refs, ref1))
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                if msg[0] == "pubunpub":
                    _, rounds, per_round = msg
                    conn.send(("ok", _publish_rounds(big, one, rounds, per_round)))
        conn.send(("bye",))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _publish_rounds(big: Any, one: Any, rounds: int, per_round: int) -> dict[str, list[float]]:
    """publish + unpublish of a 64 B ``alloc`` array on the owner of many windows and on one of
    one window, interleaved; per-round medians (ns)."""
    arrays = {id(big): big.alloc(64, np.uint8), id(one): one.alloc(64, np.uint8)}

    def side(rt: Any) -> Callable[[], list[int]]:
        a = arrays[id(rt)]

        def run() -> list[int]:
            ts = []
            for _ in range(per_round):
                t = _now()
                rt.unpublish(rt.publish(a))
                ts.append(_now() - t)
            return ts
        return run

    for rt in (big, one):
        side(rt)()
    return _interleave({"big": side(big), "one": side(one)}, rounds)


class _Owner:
    def __init__(self, n: int) -> None:
        tok = f"{os.getpid()}{secrets.token_hex(2)}"
        self.job_big, self.job_one = f"benchscale{tok}big", f"benchscale{tok}one"
        self.conn, child = _SPAWN.Pipe()
        self.proc = _SPAWN.Process(target=_owner, args=(child, n, self.job_big, self.job_one), daemon=True)
        self.proc.start()
        child.close()
        self.refs: list[bytes] = []
        self.ref1 = b""

    def wait_ready(self) -> "_Owner":
        """Wait until every window is published (the constructor only starts the owner)."""
        if not self.refs:
            msg = self._recv(900)
            self.refs, self.ref1 = msg[1], msg[2]
        return self

    def _recv(self, timeout: float) -> tuple:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the scale owner did not answer in {timeout:.0f} s")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"the scale owner failed: {msg[1]}")
        return msg

    def publish_rounds(self, rounds: int, per_round: int) -> dict[str, list[float]]:
        self.conn.send(("pubunpub", rounds, per_round))
        return self._recv(600)[1]

    def stop(self) -> None:
        """Ask the owner to retire its windows and exit (:meth:`close` waits for it)."""
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
            while self._recv(600)[0] != "bye":
                pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# -- 16 consumers -----------------------------------------------------------------------------------------
def _consumer(ref: bytes, job: str, cmds: Any, results: Any, barrier: Any) -> None:
    import memsem

    try:
        with memsem.Runtime(job=job) as rt:
            r = rt.ref(ref)
            out = np.empty(64, np.uint8)
            for _ in range(200):
                r.get(out)
            results.put(("ready", None))
            while True:
                cmd, per_round = cmds.get()
                if cmd == "stop":
                    break
                if cmd == "all":
                    barrier.wait(60)
                ts = []
                for _ in range(per_round):
                    t = _now()
                    r.get(out)
                    ts.append(_now() - t)
                results.put(("samples", ts))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def _hub(conn: Any, ref: bytes, job: str, n: int, rounds: int, per_round: int) -> None:
    """Fork ``n`` consumers (cheaper than spawning each), then rounds of: consumer 0 alone, all
    ``n`` at once (released together by a barrier); per-round medians (ns) back on ``conn``."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    barrier = ctx.Barrier(n + 1)
    cmds = [ctx.Queue() for _ in range(n)]
    procs = [ctx.Process(target=_consumer, args=(ref, job, cmds[i], results, barrier), daemon=True)
             for i in range(n)]
    try:
        for p in procs:
            p.start()

        def take(k: int) -> list[int]:
            got: list[int] = []
            for _ in range(k):
                try:
                    tag, body = results.get(timeout=600)  # 16 processes on a loaded 2-core machine
                except queue.Empty:
                    alive = sum(p.is_alive() for p in procs)
                    raise TimeoutError(f"a consumer did not answer in 600 s ({alive} of {n} alive)") from None
                if tag == "error":
                    raise RuntimeError(f"a consumer failed: {body}")
                if body is not None:
                    got += body
            return got

        take(n)  # every consumer resolved the window and is warm

        def alone() -> list[int]:
            cmds[0].put(("one", per_round))
            return take(1)

        def together() -> list[int]:
            for q in cmds:
                q.put(("all", per_round))
            barrier.wait(60)
            return take(n)

        conn.send(("ok", _interleave({"one": alone, "all": together}, rounds)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for q in cmds:
            q.put(("stop", 0))
        for p in procs:
            if p.pid is None:
                continue
            p.join(10)
            if p.is_alive():
                p.kill()


def consumers_rounds(ref: bytes, job: str, n: int, rounds: int, per_round: int) -> dict[str, list[float]]:
    conn, child = _SPAWN.Pipe()
    # not a daemon: it has children of its own; it exits when its rounds are done (or killed below)
    p = _SPAWN.Process(target=_hub, args=(child, ref, job, n, rounds, per_round), daemon=False)
    p.start()
    child.close()
    try:
        if not conn.poll(1800):
            raise TimeoutError("the 16-consumer hub did not answer in 1800 s")
        tag, body = conn.recv()
        if tag != "ok":
            raise RuntimeError(body)
        return body
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


# -- redis --------------------------------------------------------------------------------------------------
def redis_unavailable() -> str | None:
    """None when a redis-server binary and redis-py are here, else why the lookups are skipped."""
    if _redis_binary() is None:
        return "no redis-server binary (sh tests/netns/install_redis.sh installs it, as make test-core does)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (pip install redis, or install memsem with its redis extra)"
    return None


def _redis_binary() -> str | None:
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.access(p, os.X_OK)), None)


@contextlib.contextmanager
def redis_server(timeout: float = 20.0) -> Iterator[str]:
    """A private ``redis-server`` on 127.0.0.1 (no persistence, files in a temp dir), stopped and
    removed on exit; yields its URL."""
    import redis  # noqa: F401  (redis.Redis, redis.RedisError below)

    port = free_port()
    tmp = tempfile.mkdtemp(prefix=f"memsem-redis-{os.getpid()}-")
    log = open(os.path.join(tmp, "redis.log"), "wb")
    proc = subprocess.Popen([_redis_binary(), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", tmp, "--daemonize", "no", "--protected-mode", "no"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}: "
                                   f"{open(os.path.join(tmp, 'redis.log'), errors='replace').read()[-400:]}")
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server did not answer PING in {timeout} s")
            time.sleep(0.02)
        yield url
    finally:
        with contextlib.suppress(redis.RedisError):
            client.shutdown(nosave=True)
        client.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(tmp, ignore_errors=True)


def _redis_owner(conn: Any, url: str, n: int, job_big: str, job_one: str, secret: str) -> None:
    import memsem

    os.environ["MEMSEM_JOB_SECRET"] = secret  # lookups by name need the key sealed with it
    # A beat refreshes every key the owner wrote (2 per named window): with 10,000 names and a
    # loaded machine the default 10 s TTL was missed and every name vanished mid-run (see
    # docs/performance.md). The lookups measured here do not depend on the TTL.
    os.environ["MEMSEM_HEARTBEAT_TTL"] = "120"
    try:
        with memsem.Runtime(directory=url, job=job_big, timeout=120) as big, \
                memsem.Runtime(directory=url, job=job_one, timeout=120) as one:
            src = np.zeros(64 * n, np.uint8)
            for i in range(n):
                big.publish(src[64 * i:64 * (i + 1)], name=f"scale/{i}", access="r")
            one.publish(np.zeros(64, np.uint8), name="scale/0", access="r")
            # one heartbeat (rank key and every key the runtime wrote), at n names and at one
            beats: dict[str, list[float]] = {"big": [], "one": []}
            for r in range(5):
                for k, rt in ((("big", big), ("one", one)) if r % 2 == 0 else (("one", one), ("big", big))):
                    t = _now()
                    rt.directory.heartbeat(rt.rank)
                    beats[k].append(_now() - t)
            conn.send(("ok", beats))
            conn.recv()
        conn.send(("bye",))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _RedisOwner:
    """A process owning ``n`` named windows in one job of a redis directory and one in another."""

    def __init__(self, url: str, n: int) -> None:
        tok = f"{os.getpid()}{secrets.token_hex(2)}"
        self.url, self.n = url, n
        self.job_big, self.job_one = f"benchlookup{tok}big", f"benchlookup{tok}one"
        self.secret = secrets.token_hex(16)
        self.conn, child = _SPAWN.Pipe()
        self.proc = _SPAWN.Process(target=_redis_owner, args=(child, url, n, self.job_big, self.job_one,
                                                              self.secret), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> "_RedisOwner":
        if not self.ready:
            if not self.conn.poll(900):
                raise TimeoutError("the redis owner did not publish in 900 s")
            msg = self.conn.recv()
            if msg[0] != "ok":
                raise RuntimeError(f"the redis owner failed: {msg[-1]}")
            self.beats = msg[1]
            self.ready = True
        return self

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))

    def close(self) -> None:
        self.stop()
        self.proc.join(300)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def lookup_rounds(owner: _RedisOwner, rounds: int, per_round: int) -> dict[str, list[float]]:
    """``Runtime.lookup`` of a random one of the owner's ``n`` names against the one name of the
    other job, interleaved; per-round medians (ns)."""
    import memsem

    owner.wait_ready()
    old = os.environ.get("MEMSEM_JOB_SECRET")
    os.environ["MEMSEM_JOB_SECRET"] = owner.secret
    try:
        with memsem.Runtime(directory=owner.url, job=owner.job_big) as big, \
                memsem.Runtime(directory=owner.url, job=owner.job_one) as one:
            rng = np.random.default_rng(0)

            def side(rt: Any, names: int, cold: bool = True) -> Callable[[], list[int]]:
                # A lookup resolves the window it finds (its generation must be live). Both
                # sides resolve anew (the consumer's resolution dropped after each lookup,
                # untimed): what the ratio measures is the directory's size, not whether the
                # one name's window happens to stay cached. ``cold`` False: it stays.
                def run() -> list[int]:
                    ts = []
                    for i in rng.integers(0, names, per_round):
                        name = f"scale/{int(i)}"
                        t = _now()
                        ref = rt.lookup(name)
                        ts.append(_now() - t)
                        if cold:
                            rt.resolver.drop(ref.spec.gva)
                    return ts
                return run

            side(big, owner.n)()
            side(one, 1)()
            return _interleave({"big": side(big, owner.n), "one": side(one, 1), "cached": side(one, 1, False)},
                               rounds)
    finally:
        if old is None:
            os.environ.pop("MEMSEM_JOB_SECRET", None)
        else:
            os.environ["MEMSEM_JOB_SECRET"] = old


# -- the figures --------------------------------------------------------------------------------------------
def _keys(key: str, num: list[float], den: list[float], base: str | None) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {key: round(med(num) / 1e3, 3)}
    if base is not None:
        out[base] = round(med(den) / 1e3, 3)
    out.update(_ratio(num, den).keys(f"{key}_ratio"))
    return out


def scale_keys(quick: bool, notes: list[str], stage: Callable[[str], None] = lambda _: None,
               n: int = N_WINDOWS, consumers: int = N_CONSUMERS) -> dict[str, Any]:
    """The keys of ``memsem bench --json`` for cost at scale (see the module docstring); null
    where a part could not run, with a note saying why. The two owners publish side by side
    (setup only); every measurement runs with both owners idle."""
    import memsem

    from memsem_bench.measure import smoke

    rounds = 3 if smoke() else 20 if quick else 60
    fig: dict[str, Any] = {"scale_windows": n, "scale_consumers": consumers, "scale_cpus": os.cpu_count()}
    for k in ("get_64B_us_at_10k_windows", "get_64B_us_at_10k_windows_hot", "publish_unpublish_us_at_10k_windows",
              "get_64B_us_16_consumers", "lookup_us_redis_10k_names"):
        fig.update({k: None, f"{k}_ratio": None, f"{k}_ratio_spread": None})
    fig.update(get_64B_us_first_touch=None, scale_resolution_cache=None, scale_resolution_cache_grown=None,
               copyto_64B_us_at_10k_mappings=None, copyto_64B_us_one_mapping=None,
               copyto_64B_us_at_10k_mappings_ratio=None, copyto_64B_us_at_10k_mappings_ratio_spread=None,
               get_64B_us_at_10k_windows_vs_machine=None, get_64B_us_at_10k_windows_vs_machine_spread=None,
               lookup_us_redis_cached=None)
    fig.update(publish_unpublish_us=None, lookup_us_redis=None, get_64B_us_one_consumer=None,
               redis_heartbeat_ms_at_10k_names=None, redis_heartbeat_ms=None,
               redis_heartbeat_ms_at_10k_names_ratio=None, redis_heartbeat_ms_at_10k_names_ratio_spread=None)
    with contextlib.ExitStack() as stack:
        stage(f"scale: publishing {n} windows (local, redis)")
        why = redis_unavailable()
        rowner = None
        if why is None:
            try:
                url = stack.enter_context(redis_server())
                rowner = _RedisOwner(url, n)
                stack.callback(rowner.close)
            except (RuntimeError, TimeoutError, OSError) as exc:
                why = f"redis-server could not be used: {exc}"
        if why:
            notes.append(f"lookup_us_redis_10k_names skipped: {why}")
        try:
            owner = _Owner(n)
            stack.callback(owner.close)
            owner.wait_ready()
        except (RuntimeError, TimeoutError, OSError, memsem.MemsemError) as exc:
            notes.append(f"scale figures at {n} windows skipped: {exc}")
            owner = None
        if rowner is not None:
            stack.callback(rowner.stop)  # runs first: both owners retire side by side
        if owner is not None:
            stack.callback(owner.stop)
            stage(f"scale: get at {n} windows")
            fig.update(_get_figures(owner, n, rounds))
            stage(f"scale: publish+unpublish at {n} windows")
            pu = owner.publish_rounds(rounds, 10)
            fig.update(_keys("publish_unpublish_us_at_10k_windows", pu["big"], pu["one"], "publish_unpublish_us"))
            stage(f"scale: {consumers} consumers at once")
            try:
                cr = consumers_rounds(owner.ref1, owner.job_one, consumers, rounds, 200)
                fig.update(_keys("get_64B_us_16_consumers", cr["all"], cr["one"], "get_64B_us_one_consumer"))
            except (RuntimeError, TimeoutError, OSError, memsem.MemsemError) as exc:
                notes.append(f"get_64B_us_16_consumers: {exc}")
        if rowner is not None:
            stage(f"scale: redis lookup of {n} names")
            try:
                lk = lookup_rounds(rowner, rounds, 25)
                fig.update(_keys("lookup_us_redis_10k_names", lk["big"], lk["one"], "lookup_us_redis"))
                fig["lookup_us_redis_cached"] = round(statistics.median(lk["cached"]) / 1e3, 3)
                b = rowner.beats
                fig["redis_heartbeat_ms_at_10k_names"] = round(statistics.median(b["big"]) / 1e6, 3)
                fig["redis_heartbeat_ms"] = round(statistics.median(b["one"]) / 1e6, 3)
                fig.update(_ratio(b["big"], b["one"]).keys("redis_heartbeat_ms_at_10k_names_ratio"))
            except (RuntimeError, TimeoutError, OSError, memsem.MemsemError) as exc:
                notes.append(f"lookup_us_redis_10k_names skipped: {exc}")
        stage("scale: retiring the windows")
    return fig


def _get_figures(owner: _Owner, n: int, rounds: int) -> dict[str, Any]:
    """Gets of the owner's windows in turn (a prime stride over all ``n``: the next one is never
    among the consumer's cached resolutions), of one of them again and again, and of the one
    window of the other job, interleaved."""
    import memsem

    fig: dict[str, Any] = {}
    with memsem.Runtime(job=owner.job_big) as cb, memsem.Runtime(job=owner.job_one) as c1:
        refs = [cb.ref(b) for b in owner.refs]
        one = c1.ref(owner.ref1)
        out = np.empty(64, np.uint8)
        resolver = cb.resolver
        stride = next(p for p in (7919, 104729, 1299709) if n % p)  # a prime not dividing n
        cursor = [0]

        def cycle(k: int) -> list[int]:
            ts = []
            i = cursor[0]
            for _ in range(k):
                r = refs[i]
                i = (i + stride) % n
                t = _now()
                r.get(out)
                ts.append(_now() - t)
            cursor[0] = i
            return ts

        # The first pass: every get is the first of its window here (a resolve each). Then
        # passes until the cache's bound, which follows the working set, stops growing.
        fig["get_64B_us_first_touch"] = round(statistics.median(cycle(n)) / 1e3, 3)
        for _ in range(4):
            before = resolver.limit
            cycle(n)
            if resolver.limit == before:
                break

        def reader(r: Any) -> Callable[[], list[int]]:
            def run() -> list[int]:
                ts = []
                for _ in range(100):
                    t = _now()
                    r.get(out)
                    ts.append(_now() - t)
                return ts
            return run

        # The machine's own cost of the same access pattern: np.copyto of 64 B from n mappings
        # of a page each, in turn with the same stride, against one mapping again and again.
        maps = [mmap.mmap(-1, mmap.PAGESIZE) for _ in range(n)]
        arrays = [np.frombuffer(m, np.uint8, 64) for m in maps]
        mcursor = [0]

        def mcycle(k: int) -> list[int]:
            ts = []
            i = mcursor[0]
            for _ in range(k):
                a = arrays[i]
                i = (i + stride) % n
                t = _now()
                np.copyto(out, a)
                ts.append(_now() - t)
            mcursor[0] = i
            return ts

        def mone() -> list[int]:
            ts = []
            a = arrays[0]
            for _ in range(100):
                t = _now()
                np.copyto(out, a)
                ts.append(_now() - t)
            return ts

        mcycle(n)
        g = _interleave({"cycle": lambda: cycle(30), "hot": reader(refs[0]), "one": reader(one),
                         "mcycle": lambda: mcycle(30), "mone": mone}, rounds)
        arrays.clear()  # the arrays export the mappings: dropped before they close
        for m in maps:
            m.close()
        fig.update(_keys("get_64B_us_at_10k_windows", g["cycle"], g["one"], None))
        fig.update(_keys("copyto_64B_us_at_10k_mappings", g["mcycle"], g["mone"], "copyto_64B_us_one_mapping"))
        fig.update(RatioStat.of((c / o) / (mc / mo) for c, o, mc, mo in zip(g["cycle"], g["one"], g["mcycle"], g["mone"])
                                if o and mc and mo).keys("get_64B_us_at_10k_windows_vs_machine"))
        fig.update(_keys("get_64B_us_at_10k_windows_hot", g["hot"], g["one"], None))
        fig["get_64B_us_one_window"] = round(statistics.median(g["one"]) / 1e3, 3)
        fig["scale_resolution_cache"] = resolver.limit
        fig["scale_resolution_cache_grown"] = resolver.grown
    return fig


def goals_met(fig: dict[str, Any]) -> dict[str, bool | None]:
    out = {}
    for k, (_, ok) in GOALS.items():
        v = fig.get(k)
        out[k] = None if v is None or ok is None else bool(ok(v))
    return out


__all__ = ["GOALS", "N_CONSUMERS", "N_WINDOWS", "goals_met", "redis_server", "redis_unavailable", "scale_keys"]
