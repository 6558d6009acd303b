"""Versioned weight sync, measured: memsem against the peers a weight-sync user would pick.

One trainer process publishes a state dict (``publish_state_dict``, double-buffered) and
rollout processes follow it by name. Each rollout reserves the next version (a pinned lease)
before it lets go of the one it loads, so the trainer writes version v+1 while rollouts load v
and is blocked only when a rollout is two versions behind. Per version it measures the time
from "version closed" (the trainer's commit) to "every rollout loaded it", the trainer's time
blocked by readers, the torn reads memsem caught, and checks every rollout's bytes against a
sha256 the trainer computed.

Peers, same buckets, same machine, same run: ``torch.distributed`` broadcast over gloo (the
algorithm of verl's NCCL backend, on CPU) and Ray's object store (``ray.put`` once,
``ray.get`` in every rollout; in a subprocess of the first interpreter that has Ray: this one,
``.venv-tq``, ``.venv-verl``). Plus two anchors: two concurrent ``np.copyto`` streams of the same
bytes as one buffer each, and two streams copying the state dict's own tensors out of a window of
the sync's own layout (``SameTensorCopy``: the floor that means something). The 4-rollout figures are measured in interleaved rounds (see ``weight_sync_keys``).

Used by ``memsem demo`` (the versioned table) and ``memsem bench`` (keys ``weight_sync_4r_s``,
``gloo_broadcast_4r_s``, ``ray_object_store_4r_s``, ``weight_sync_first_bucket_ms``,
``weight_sync_trainer_blocked_ms``, the ratios ``gloo_vs_weight_sync_4r``,
``ray_vs_weight_sync_4r``, ``weight_sync_vs_copy_floor``, ``weight_sync_vs_same_tensor_floor``,
``weight_sync_first_bucket_ratio``); ``benchmarks/bench_weight_sync.py`` runs it alone.

One module, over 600 lines, because it is one benchmark: weight sync against its baselines (copy
floor, gloo), each side a process set that the same rounds drive.
"""
from __future__ import annotations

from memsem_bench import CHECKOUT

import contextlib
import functools
import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from memsem_bench.measure import at_once, free_port

_CTX = mp.get_context("spawn")


# -- the state dicts ------------------------------------------------------------------------------
def synthetic_state_dict(total_bytes: int, n: int = 300, seed: int = 0) -> dict[str, np.ndarray]:
    """~``total_bytes`` in ``n`` tensors, alternating bf16 and fp32, sizes spread 1:16."""
    from memsem import _dtypes

    bf16 = _dtypes.numpy_dtype(_dtypes.code_of("bfloat16"))
    rng = np.random.default_rng(seed)
    weights = rng.uniform(1.0, 16.0, n)
    weights *= total_bytes / weights.sum()
    out = {}
    for i, w in enumerate(weights):
        dt = bf16 if i % 2 == 0 else np.dtype(np.float32)
        cols = 1024
        rows = max(1, int(w) // (cols * dt.itemsize))
        out[f"layers.{i // 6}.p{i % 6}.weight"] = rng.integers(0, 255, rows * cols * dt.itemsize,
                                                                 dtype=np.uint8).view(dt).reshape(rows, cols)
    return out


def step_in_place(sd: dict[str, np.ndarray], step: int) -> None:
    """The demo's known update of every tensor: the raw bytes of each tensor rotate by one
    (``uint8 += 1``), cheap and bit-exact to check."""
    for a in sd.values():
        if a.size:
            raw = a.reshape(-1).view(np.uint8)
            np.add(raw, 1, out=raw)


def digest(sd: dict[str, Any], names: list[str]) -> str:
    h = hashlib.sha256()
    for n in names:
        a = sd[n]
        if hasattr(a, "numpy"):
            a = a.reshape(-1).view(__import__("torch").uint8).numpy()
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return h.hexdigest()


# -- memsem: trainer + rollouts ---------------------------------------------------------------------
def _follower(idx: int, name: str, versions: int, verify: bool, results: Any, job: str) -> None:
    """A rollout that is the follower loop (``Runtime.follow``): in lockstep with the trainer,
    it loads every version (pinned while it loads), checks it, and reports it."""
    os.environ["MEMSEM_JOB"] = job
    import memsem

    try:
        with memsem.Runtime(timeout=300.0) as rt:
            sd = rt.lookup_state_dict(name, timeout=300)
            into = sd.empty_like("numpy")
            names = list(sd.keys())
            results.put(("joined", idx))
            for v, tensors in rt.follow(sd, into=into, timeout=300):
                t_end = time.monotonic()
                ok = digest(tensors, names) if verify else ""
                e = rt.stats().errors
                results.put(("loaded", idx, v, t_end, ok, e.get("torn", 0) + e.get("busy", 0)))
                if v >= versions:
                    break
    except BaseException as exc:
        results.put(("error", idx, f"{type(exc).__name__}: {exc}"))


def _rollout(idx: int, name: str, versions: int, verify: bool, results: Any, job: str) -> None:
    """A rollout that loads *every* version however fast the trainer commits: it reserves the
    next two versions ahead (pins of versions not written yet), so the trainer waits for it."""
    os.environ["MEMSEM_JOB"] = job
    import memsem

    try:
        with memsem.Runtime(timeout=300.0) as rt:
            sd = rt.lookup_state_dict(name)
            dst = sd.empty_like("numpy")
            names = list(sd.keys())
            cur = sd.pin(version=1, ttl=None)
            nxt = sd.pin(version=2, ttl=None)  # reserved before the trainer writes it
            results.put(("joined", idx))
            while True:
                v = cur.version
                sd.wait_version(v, timeout=300)
                sd.load(dst, version=v, lease=cur)  # one bracket, every tensor of version v
                t_end = time.monotonic()
                ok = digest(dst, names) if verify else ""
                e = rt.stats().errors
                results.put(("loaded", idx, v, t_end, ok, e.get("torn", 0) + e.get("busy", 0)))
                if v >= versions:
                    break
                following = sd.pin(version=v + 2, ttl=None) if v + 2 <= versions else None
                cur.release()
                cur, nxt = nxt, following
            cur.release()
            if nxt is not None:
                nxt.release()
    except BaseException as exc:
        results.put(("error", idx, f"{type(exc).__name__}: {exc}"))


class SyncRun:
    """A trainer (this process) publishing ``sd`` (double-buffered state dict ``policy``) and
    ``rollouts`` processes following it by name for ``versions`` versions (1 is the publish).

    Use as a context manager: entering starts the rollouts and waits until every one holds
    version 1's pins; :meth:`step` writes the next version (in place, in a write section),
    :meth:`wait_loaded` waits until every rollout loaded a version, :meth:`records` gives one
    record per version (see :func:`memsem_sync`). Leaving joins the rollouts (they exit after
    loading version ``versions``)."""

    def __init__(self, sd: dict[str, np.ndarray], rollouts: int, versions: int, *, verify: bool = False,
                 timeout: float = 600.0, bucket_bytes: int = 64 << 20, follower: bool = False) -> None:
        self.sd, self.rollouts, self.versions, self.verify = sd, rollouts, versions, verify
        #: each rollout is the follower loop (``Runtime.follow``, lockstep) instead of reserving ahead
        self.follower = follower
        self.timeout, self.bucket_bytes = timeout, bucket_bytes
        self.names = list(sd)
        self.nbytes = sum(a.nbytes for a in sd.values())
        self.loaded: dict[int, dict[int, tuple]] = {}
        self.commits: dict[int, float] = {}
        self.blocked: dict[int, float] = {}
        self.digests: dict[int, str] = {}
        self.version = 0
        self._joined = 0

    def __enter__(self) -> "SyncRun":
        import secrets

        import memsem

        self.job = f"ws{os.getpid()}-{secrets.token_hex(3)}"
        self._old_job = os.environ.get("MEMSEM_JOB")
        os.environ["MEMSEM_JOB"] = self.job
        try:
            self._rt = memsem.Runtime(timeout=self.timeout, job=self.job)
            self.ref = self._rt.publish_state_dict(self.sd, name="policy", bucket_bytes=self.bucket_bytes)
            self._results = _CTX.Queue()
            self._procs = [_CTX.Process(target=_follower if self.follower else _rollout, args=(i, "policy", self.versions, self.verify,
                                                               self._results, self.job), daemon=True)
                           for i in range(self.rollouts)]
            for p in self._procs:
                p.start()
            self._deadline = time.monotonic() + self.timeout
            while self._joined < self.rollouts:
                self._pump(0.5)
            self.version = 1
            self.commits[1] = time.monotonic()
            self.digests[1] = digest(self.sd, self.names) if self.verify else ""
            self.blocked[1] = 0.0
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in getattr(self, "_procs", []):
            if p.pid is None:  # never started
                continue
            p.join(30)
            if p.is_alive():
                p.kill()
        rt = getattr(self, "_rt", None)
        if rt is not None:
            rt.close()
        if self._old_job is None:
            os.environ.pop("MEMSEM_JOB", None)
        else:
            os.environ["MEMSEM_JOB"] = self._old_job

    def _pump(self, block: float) -> None:
        try:
            msg = self._results.get(timeout=block) if block > 0 else self._results.get_nowait()
        except queue.Empty:
            if not any(p.is_alive() for p in self._procs):
                raise RuntimeError("every rollout process exited") from None
            if time.monotonic() > self._deadline:
                raise TimeoutError(f"weight sync did not finish in {self.timeout} s") from None
            return
        if msg[0] == "error":
            raise RuntimeError(f"rollout {msg[1]} failed: {msg[2]}")
        if msg[0] == "joined":
            self._joined += 1
        else:
            self.loaded.setdefault(msg[2], {})[msg[1]] = msg[3:]

    def drain(self) -> None:
        """Take the rollouts' reports that arrived meanwhile (never blocks)."""
        while not self._results.empty():
            self._pump(0)

    def step(self) -> int:
        """Write the next version in place (every tensor's bytes += 1) in a write section and
        commit it; returns its number."""
        import memsem

        v = self.version + 1
        if v > self.versions:
            raise ValueError(f"the rollouts follow {self.versions} versions; version {v} was asked for")
        step_in_place(self.sd, v)
        if self.verify:
            self.digests[v] = digest(self.sd, self.names)
        ref = self.ref
        with ref.write_section(copy=False) as sec:
            base = sec.flat.ctypes.data + ref.layout.header_bytes
            for e in ref.layout.entries:
                if e.nbytes:
                    memsem.native.memcpy(base + e.offset, self.sd[e.name].ctypes.data, e.nbytes)
        self.commits[v] = time.monotonic()
        self.blocked[v] = sec.blocked_s
        self.version = v
        return v

    def wait_loaded(self, v: int) -> float:
        """Wait until every rollout loaded version ``v``; seconds from its commit to the last load."""
        while len(self.loaded.get(v, {})) < self.rollouts:
            self._pump(0.5)
        return max(r[0] for r in self.loaded[v].values()) - self.commits[v]

    def records(self) -> list[dict]:
        """One record per version loaded by every rollout (see :func:`memsem_sync`)."""
        out = []
        caught_prev = [0] * self.rollouts
        for v in range(1, self.version + 1):
            rows = self.loaded.get(v, {})
            if len(rows) < self.rollouts:
                break
            exact = all(r[1] == self.digests[v] for r in rows.values()) if self.verify else None
            caught = 0
            for i, r in rows.items():
                caught += r[2] - caught_prev[i]
                caught_prev[i] = r[2]
            out.append({"version": v, "seconds": max(r[0] for r in rows.values()) - self.commits[v],
                        "blocked_s": self.blocked[v], "caught": caught, "exact": exact,
                        "accepted_torn": 0 if exact in (True, None) else sum(
                            1 for r in rows.values() if r[1] != self.digests[v]),
                        "bytes": self.nbytes * self.rollouts, "rollouts": len(rows)})
        return out


def memsem_sync(sd: dict[str, np.ndarray], rollouts: int, versions: int, *, verify: bool = False,
                timeout: float = 600.0, on_version: Callable[[dict], None] | None = None,
                bucket_bytes: int = 64 << 20, lockstep: bool = False) -> list[dict]:
    """Run the trainer here and ``rollouts`` processes; ``versions`` versions in all (1 is the
    publish, 2.. are in-place update steps). Returns one record per version: ``seconds``
    (close -> all loaded), ``blocked_s``, ``caught`` (torn reads caught in the rollouts),
    ``exact`` (every rollout's sha256 equal to the trainer's, when ``verify``).

    ``lockstep``: the trainer steps to version v+1 only once every rollout has loaded (and, with
    ``verify``, hashed) version v, so ``seconds`` is the load alone, with every rollout loading
    at once; otherwise the trainer commits as fast as it can and the rollouts follow (a version's
    time then includes whatever the rollouts were still doing with the one before)."""
    with SyncRun(sd, rollouts, versions, verify=verify, timeout=timeout, bucket_bytes=bucket_bytes,
                 follower=lockstep) as run:
        if lockstep:
            run.wait_loaded(1)
        for _ in range(2, versions + 1):
            v = run.step()
            if lockstep:
                run.wait_loaded(v)
            run.drain()
        run.wait_loaded(versions)
        out = run.records()
    if on_version is not None:
        for rec in out:
            on_version(rec)
    return out


# -- peers --------------------------------------------------------------------------------------
def _gloo_rank(rank: int, world: int, port: int, buckets: list[int], cmds: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        bufs = [torch.zeros(n, dtype=torch.uint8) for n in buckets]
        if rank == 0:
            for b in bufs:
                b.fill_(7)
        results.put((rank, "ready", True))
        while cmds.get() == "go":  # one version per command; idle ranks block here (no spin)
            dist.barrier()
            t0 = time.monotonic()
            for b in bufs:
                dist.broadcast(b, src=0)
            dist.barrier()
            ok = all(int(b[0]) == 7 and int(b[-1]) == 7 for b in bufs)
            results.put((rank, time.monotonic() - t0, ok))
        dist.destroy_process_group()
    except BaseException as exc:
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))


class GlooGroup:
    """``rollouts + 1`` ranks of ``torch.distributed`` over gloo (rank 0 the trainer), kept up
    so that their broadcasts interleave with other measurements: :meth:`rep` broadcasts every
    bucket once, barrier to barrier, and returns the seconds of the slowest rank. Raises
    ImportError when torch is missing."""

    def __init__(self, bucket_sizes: list[int], rollouts: int, timeout: float = 600.0) -> None:
        import torch  # noqa: F401  (ImportError: no gloo peer)

        self.world = rollouts + 1
        self.timeout = timeout
        port = free_port()
        self._results = _CTX.Queue()
        self._cmds = [_CTX.Queue() for _ in range(self.world)]
        self._procs = [_CTX.Process(target=_gloo_rank, args=(r, self.world, port, bucket_sizes, self._cmds[r],
                                                             self._results), daemon=True)
                       for r in range(self.world)]
        for p in self._procs:
            p.start()
        self._ready = False

    def wait_ready(self) -> "GlooGroup":
        """Wait until every rank joined the group (the constructor only starts them, so other
        peers can start meanwhile)."""
        if not self._ready:
            try:
                self._collect()
            except BaseException:
                self.close()
                raise
            self._ready = True
        return self

    def _collect(self) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(got) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("gloo broadcast did not finish")
            try:
                rank, t, ok = self._results.get(timeout=min(left, 5.0))
            except queue.Empty:
                if not all(p.is_alive() for p in self._procs):
                    raise RuntimeError("a gloo rank exited") from None
                continue
            if t is None:
                raise RuntimeError(f"gloo rank {rank}: {ok}")
            if ok is not True:
                raise RuntimeError(f"gloo rank {rank} received other bytes")
            got[rank] = t
        return got

    def rep(self) -> float:
        self.wait_ready()
        for q in self._cmds:
            q.put("go")
        return max(self._collect().values())

    def close(self) -> None:
        for q in self._cmds:
            q.put("stop")
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> "GlooGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gloo_broadcast(bucket_sizes: list[int], rollouts: int, reps: int = 3, timeout: float = 600.0) -> float | None:
    """Seconds for one version (every bucket broadcast from the trainer to ``rollouts`` ranks,
    barrier to barrier), median over ``reps``; None when torch is missing."""
    try:
        group = GlooGroup(bucket_sizes, rollouts, timeout)
    except ImportError:
        return None
    with group:
        return statistics.median([group.rep() for _ in range(reps)])


def _ray_serve(total_bytes: int, n: int, rollouts: int) -> None:
    """Ray's side of the interleaved weight-sync rounds, in an interpreter that has Ray: prints
    ``ready`` once warm, then for every ``go`` line on stdin one version (``ray.put`` once,
    ``ray.get`` in every rollout task) and its seconds; stops at EOF or ``stop``."""
    import ray

    ray.init(num_cpus=max(2, rollouts), include_dashboard=False, logging_level="ERROR",
             log_to_driver=False, object_store_memory=max(4 * total_bytes, 256 << 20))
    try:
        @ray.remote
        def load(obj: Any) -> int:
            return sum(a.nbytes for a in obj.values())

        sd = synthetic_state_dict(total_bytes, n)
        want = sum(a.nbytes for a in sd.values())

        def rep() -> float:
            t0 = time.monotonic()
            r = ray.put(sd)
            got = ray.get([load.remote(r) for _ in range(rollouts)])
            dt = time.monotonic() - t0
            if any(g != want for g in got):
                raise RuntimeError("ray.get returned other bytes")
            del r
            return dt

        rep()  # the rollout workers start here, untimed
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            print(json.dumps(rep()), flush=True)
    finally:
        ray.shutdown()


def ray_interpreters() -> list[pathlib.Path]:
    """Interpreters where this project may have installed Ray, in order: this one, the
    TransferQueue venv (``TQ_VENV`` or ``.venv-tq``, made by ``tests/tq/run_tq_all.sh``), the
    verl venv (``VERL_VENV`` or ``.venv-verl``, ``tests/verl/run_verl_tests.sh``)."""
    root = CHECKOUT
    out = [pathlib.Path(sys.executable)]
    for env, default in (("TQ_VENV", ".venv-tq"), ("VERL_VENV", ".venv-verl")):
        for v in (os.environ.get(env), str(root / default)):
            if v:
                py = pathlib.Path(v) / "bin" / "python"
                if py not in out:
                    out.append(py)
    return out


def find_ray() -> tuple[pathlib.Path | None, str]:
    """``(interpreter that imports ray, "")`` or ``(None, why not)`` naming every place looked at."""
    tried = []
    for py in ray_interpreters():
        if not py.exists():
            tried.append(f"{py.parent.parent.name} (not built)")
            continue
        try:
            cp = subprocess.run([str(py), "-c", "import ray"], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            tried.append(f"{py} (import ray did not finish in 120 s)")
            continue
        if cp.returncode == 0:
            return py, ""
        tried.append(f"{py} (no ray)" if "ModuleNotFoundError" in cp.stderr else
                     f"{py} (import ray failed: {cp.stderr.strip().splitlines()[-1] if cp.stderr.strip() else cp.returncode})")
    return None, ("Ray is importable nowhere the project installs it: " + "; ".join(tried)
                  + " (make test-tq builds .venv-tq with Ray)")


class RayPeer:
    """Ray's object store as a weight-sync peer, in a subprocess of an interpreter that has Ray
    (:func:`find_ray`); :meth:`rep` runs one version there and returns its seconds."""

    def __init__(self, python: pathlib.Path, total_bytes: int, n: int, rollouts: int, timeout: float = 600.0) -> None:
        root = CHECKOUT
        code = (f"import sys; sys.path.insert(0, {str(root / 'src')!r}); "
                "from memsem_bench.weights import _ray_serve; "
                f"_ray_serve({total_bytes}, {n}, {rollouts})")
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0")
        self.python = python
        self._err = tempfile.TemporaryFile("w+")  # Ray may say much; a pipe left unread would block it
        self._p = subprocess.Popen([str(python), "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=self._err, text=True, env=env)
        self._timeout = timeout
        self._ready = False

    def wait_ready(self) -> "RayPeer":
        """Wait until Ray is up and warm there (the constructor only starts the subprocess)."""
        if not self._ready:
            try:
                line = self._line()
                if line != "ready":
                    raise RuntimeError(f"Ray peer did not start: {line!r}")
            except BaseException:
                self.close()
                raise
            self._ready = True
        return self

    def _line(self) -> str:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self._p.stdout, selectors.EVENT_READ)
            if not sel.select(self._timeout):
                raise TimeoutError(f"Ray peer said nothing in {self._timeout} s")
        line = self._p.stdout.readline()
        if not line:
            self._err.seek(0)
            err = self._err.read().strip().splitlines()
            raise RuntimeError(f"Ray peer exited (rc {self._p.wait(10)}): {err[-1] if err else ''}")
        return line.strip()

    def rep(self) -> float:
        self.wait_ready()
        self._p.stdin.write("go\n")
        self._p.stdin.flush()
        return float(json.loads(self._line()))

    def close(self) -> None:
        if self._p.poll() is None:
            try:
                self._p.stdin.write("stop\n")
                self._p.stdin.close()
            except OSError:
                pass
            try:
                self._p.wait(60)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.wait(10)
        self._err.close()

    def __enter__(self) -> "RayPeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ray_object_store(total_bytes: int, n: int, rollouts: int, reps: int = 3) -> tuple[float | None, str | None]:
    """Seconds for one version through Ray's object store (put once, get in each rollout task),
    median, in an interpreter that has Ray (:func:`find_ray`). ``(None, why)`` otherwise."""
    py, why = find_ray()
    if py is None:
        return None, why
    try:
        with RayPeer(py, total_bytes, n, rollouts) as peer:
            return statistics.median([peer.rep() for _ in range(reps)]), None
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        return None, f"Ray run with {py} failed: {exc}"


class TwoStreamCopy:
    """Two concurrent ``np.copyto`` streams of ``nbytes`` each (the machine's copy bandwidth
    with two cores busy); :meth:`rep` runs them once and returns the seconds."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = [np.ones(nbytes, np.uint8) for _ in range(2)]
        self.dst = [np.empty(nbytes, np.uint8) for _ in range(2)]
        for x, y in zip(self.src, self.dst):
            np.copyto(y, x)

    def rep(self) -> float:
        return at_once([functools.partial(np.copyto, y, x) for x, y in zip(self.src, self.dst)])

    def gbps(self, seconds: float) -> float:
        return 2 * self.nbytes / seconds / 1e9


class TensorCopy:
    """Two streams copying a state dict's tensors (``src``) into two sets of tensors of their own,
    each an ``np.copyto`` per tensor: :meth:`one_stream` runs one, :meth:`rep` both at once (the
    machine's two cores); each returns the seconds."""

    def __init__(self, src: dict[str, np.ndarray], dst: list[dict[str, np.ndarray]] | None = None) -> None:
        self.src = src
        self.dst = dst if dst is not None else [{k: np.empty_like(a) for k, a in src.items()} for _ in range(2)]
        self.nbytes = sum(a.nbytes for a in src.values())
        for d in self.dst:
            self._one(d)

    def _one(self, dst: dict[str, np.ndarray]) -> None:
        for k, a in self.src.items():
            np.copyto(dst[k], a)

    def one_stream(self) -> float:
        t0 = time.perf_counter()
        self._one(self.dst[0])
        return time.perf_counter() - t0

    def rep(self) -> float:
        return at_once([functools.partial(self._one, d) for d in self.dst])

    def gbps(self, seconds: float) -> float:
        return 2 * self.nbytes / seconds / 1e9


class SameTensorCopy(TensorCopy):
    """The floor of a weight sync made of its own tensors: two concurrent streams, each an
    ``np.copyto`` of every tensor of the state dict, from arrays over a shared-segment window of
    the sync's own layout (``publish_state_dict``: the same offsets, alignment and sizes a
    rollout reads) into tensors of their own (``empty_like``: what a rollout loads into). The
    machine's cost of copying exactly what a sync copies, on two cores; :meth:`rep` runs the
    two streams once and returns the seconds."""

    def __init__(self, rt: Any, sd: dict[str, np.ndarray], bucket_bytes: int) -> None:
        ref = rt.publish_state_dict(sd, slots=1, bucket_bytes=bucket_bytes)
        super().__init__(ref.tensors(), [ref.empty_like("numpy") for _ in range(2)])


def two_stream_copyto_gbps(nbytes: int) -> float:
    """GB/s of two concurrent ``np.copyto`` streams of ``nbytes`` each (the machine's copy
    bandwidth with two cores busy), best of 3."""
    c = TwoStreamCopy(nbytes)
    return c.gbps(min(c.rep() for _ in range(3)))


def first_bucket_ms(sd: dict[str, np.ndarray], bucket_bytes: int, reps: int = 5) -> float:
    """ms from a version's close to the first bucket loaded by a streaming reader (another
    runtime here: same route as a rollout's), median."""
    return statistics.median(first_bucket_rounds(sd, bucket_bytes, reps)[0])


def first_bucket_rounds(sd: dict[str, np.ndarray], bucket_bytes: int, reps: int) -> tuple[list[float], list[float]]:
    """Rounds of: a version closed and the first bucket loaded by a streaming reader (another
    runtime here, the route of a rollout), and one plain get of ``bucket_bytes`` (host/shm) by the
    same reader, the order reversed every other round. Returns the two lists of ms."""
    import memsem

    first: list[float] = []
    one: list[float] = []
    with memsem.Runtime() as rt, memsem.Runtime() as reader:
        ref = rt.publish_state_dict(sd, bucket_bytes=bucket_bytes)
        r = memsem.StateDictRef.from_bytes(ref.to_bytes(), reader)
        dst = r.empty_like("numpy")
        for _ in r.stream(dst):
            pass
        src = rt.alloc(bucket_bytes, np.uint8)
        bref = reader.ref(rt.publish(src).to_bytes())
        bdst = np.empty(bucket_bytes, np.uint8)
        bref.get(bdst)

        def stream() -> None:
            with ref.write_section(copy=False):
                pass
            t0 = time.monotonic()
            it = r.stream(dst)
            next(it)
            first.append((time.monotonic() - t0) * 1e3)
            for _ in it:
                pass

        def get() -> None:
            t0 = time.monotonic()
            bref.get(bdst)
            one.append((time.monotonic() - t0) * 1e3)

        for i in range(reps):
            for fn in ((stream, get) if i % 2 == 0 else (get, stream)):
                fn()
    return first, one


# -- the benchmark keys ---------------------------------------------------------------------------
def weight_sync_keys(quick: bool, notes: list[str] | None = None) -> dict[str, Any]:
    """The keys of ``memsem bench --json`` for weight sync (seconds / ms; null where a peer is
    missing, with a note saying why).

    The 4-rollout figures come from interleaved rounds: per round one memsem version (lockstep:
    commit, then every rollout loads it), one gloo broadcast of the same buckets to 4 ranks, one
    version through Ray's object store (where Ray is installed) and one two-stream
    ``np.copyto`` of the state dict's bytes (the machine's copy floor) and one of its own
    tensors out of a window of its layout (``SameTensorCopy``), the order reversed every other
    round. Ratios (``gloo_vs_weight_sync_4r``, ``ray_vs_weight_sync_4r``,
    ``weight_sync_vs_copy_floor``, ``weight_sync_vs_same_tensor_floor``,
    ``weight_sync_first_bucket_ratio``) are medians of per-round
    ratios, with ``<key>_spread`` = [p10, p90]."""
    from memsem_bench.measure import RatioStat, smoke, spread_keys

    notes = notes if notes is not None else []
    tiny = smoke()
    total = (16 << 20) if tiny else (256 << 20) if quick else (1 << 30)
    bucket = (4 << 20) if tiny else 64 << 20
    rounds = 2 if tiny else 6 if quick else 12
    sd = synthetic_state_dict(total, 300)
    nbytes = sum(a.nbytes for a in sd.values())
    fig: dict[str, Any] = {"weight_sync_state_dict_MB": round(nbytes / 1e6, 1), "weight_sync_rounds": rounds}
    for r in (1, 2):  # context: how the time grows with the rollouts (lockstep, not interleaved)
        recs = memsem_sync(sd, r, 2 if tiny else 4 if quick else 6, bucket_bytes=bucket, lockstep=True)
        steady = [x["seconds"] for x in recs if x["version"] > 1]
        fig[f"weight_sync_{r}r_s"] = round(statistics.median(steady), 4)
        fig[f"weight_sync_{r}r_s_spread"] = spread_keys("x", steady, nd=4)["x_spread"]
    sizes = _bucket_sizes(nbytes, bucket)
    sides: dict[str, Callable[[], float]] = {}
    per: dict[str, list[float]] = {"memsem": [], "gloo": [], "ray": [], "floor": [], "same": []}
    ray_py, why = (None, "not started in a smoke run (MEMSEM_BENCH_SMOKE=1)") if tiny else find_ray()
    floor = TwoStreamCopy(min(nbytes, 256 << 20))
    with contextlib.ExitStack() as stack:
        # the peers start side by side (their imports and daemons overlap), then all must be up
        gloo = ray = None
        try:
            gloo = stack.enter_context(GlooGroup(sizes, 4))
        except ImportError as exc:
            notes.append(f"gloo_broadcast_4r_s: torch is not installed in {sys.executable} ({exc}); "
                         "pip install torch==2.13.0 (the CPU wheel) gives the gloo peer")
        if ray_py is not None:
            ray = stack.enter_context(RayPeer(ray_py, total, 300, 4))
        import memsem

        same = SameTensorCopy(stack.enter_context(memsem.Runtime()), sd, bucket)
        run = stack.enter_context(SyncRun(sd, 4, 2 + rounds, bucket_bytes=bucket))
        run.wait_loaded(1)

        def one_version() -> float:
            return run.wait_loaded(run.step())

        sides["memsem"] = one_version
        if gloo is not None:
            try:
                sides["gloo"] = gloo.wait_ready().rep
            except (RuntimeError, TimeoutError) as exc:
                notes.append(f"gloo_broadcast_4r_s: gloo failed: {exc}")
        if ray is not None:
            try:
                sides["ray"] = ray.wait_ready().rep
                fig["ray_python"] = str(ray_py)
            except (RuntimeError, TimeoutError, OSError) as exc:
                why = f"Ray run with {ray_py} failed: {exc}"
        sides["floor"] = floor.rep
        sides["same"] = same.rep
        for fn in sides.values():  # warm: one untimed round
            fn()
        items = list(sides.items())
        for i in range(rounds):
            for k, fn in (items if i % 2 == 0 else items[::-1]):
                per[k].append(fn())
        blocked = [run.blocked[v] for v in range(2, run.version + 1)]
    if why and "ray" not in sides:
        notes.append(f"ray_object_store_4r_s: {why}")
    med = statistics.median
    ws = per["memsem"]
    fig["weight_sync_4r_s"] = round(med(ws), 4)
    fig["weight_sync_4r_s_spread"] = spread_keys("x", ws, nd=4)["x_spread"]
    fig["weight_sync_trainer_blocked_ms"] = round(med(blocked) * 1e3, 3)
    fig["weight_sync_trainer_blocked_ms_spread"] = spread_keys("x", blocked, 1e3)["x_spread"]
    for k, peer in (("gloo_broadcast_4r_s", "gloo"), ("ray_object_store_4r_s", "ray")):
        fig[k] = round(med(per[peer]), 4) if per[peer] else None
        fig[f"{k}_spread"] = spread_keys("x", per[peer], nd=4)["x_spread"]
        fig.update(RatioStat.of(p / w for p, w in zip(per[peer], ws)).keys(f"{peer}_vs_weight_sync_4r"))
    fl = per["floor"]
    fig["copyto_2stream_GBps"] = round(floor.gbps(med(fl)), 2)
    fig["copyto_2stream_GBps_spread"] = spread_keys("x", [floor.gbps(t) for t in fl], nd=2)["x_spread"]
    fig["weight_sync_4r_GBps"] = round(4 * nbytes / med(ws) / 1e9, 2)
    fig["weight_sync_4r_GBps_spread"] = spread_keys("x", [4 * nbytes / w / 1e9 for w in ws], nd=2)["x_spread"]
    fig.update(RatioStat.of((4 * nbytes / w / 1e9) / floor.gbps(f) for w, f in zip(ws, fl)).keys("weight_sync_vs_copy_floor"))
    sm = per["same"]
    fig["copyto_same_tensors_2stream_GBps"] = round(same.gbps(med(sm)), 2)
    fig["copyto_same_tensors_2stream_GBps_spread"] = spread_keys("x", [same.gbps(t) for t in sm], nd=2)["x_spread"]
    fig.update(RatioStat.of((4 * nbytes / w / 1e9) / same.gbps(f) for w, f in zip(ws, sm))
               .keys("weight_sync_vs_same_tensor_floor"))
    del floor, same
    first, one = first_bucket_rounds(sd, bucket, 3 if tiny else 9 if quick else 21)
    fig["weight_sync_first_bucket_ms"] = round(med(first), 3)
    fig["one_bucket_get_ms"] = round(med(one), 3)
    fig["weight_sync_first_bucket_ms_spread"] = spread_keys("x", first)["x_spread"]
    fig["one_bucket_get_ms_spread"] = spread_keys("x", one)["x_spread"]
    fig.update(RatioStat.of(f / o for f, o in zip(first, one)).keys("weight_sync_first_bucket_ratio"))
    return fig


def _bucket_sizes(nbytes: int, bucket: int) -> list[int]:
    out = [bucket] * (nbytes // bucket)
    if nbytes % bucket:
        out.append(nbytes % bucket)
    return out


WEIGHT_GOALS = {
    "weight_sync_4r_s": ">= 2x faster than gloo_broadcast_4r_s, >= 1.5x than ray_object_store_4r_s",
    "gloo_vs_weight_sync_4r": ">= 2 (gloo_broadcast_4r_s / weight_sync_4r_s, per round)",
    "ray_vs_weight_sync_4r": ">= 1.5 (ray_object_store_4r_s / weight_sync_4r_s, per round)",
    "weight_sync_vs_copy_floor": "reported (weight_sync_4r_GBps / copyto_2stream_GBps: one large buffer, per round)",
    "weight_sync_vs_same_tensor_floor": ">= 0.9 (weight_sync_4r_GBps / copyto_same_tensors_2stream_GBps, per round)",
    "weight_sync_trainer_blocked_ms": "<= 1 ms per version (double buffering)",
    "weight_sync_first_bucket_ms": "<= 3 x one_bucket_get_ms",
    "weight_sync_first_bucket_ratio": "<= 3 (first bucket / one bucket get, per round)",
}


def weight_goals_met(fig: dict[str, Any]) -> dict[str, bool | None]:
    """True / False per goal of ``WEIGHT_GOALS``; None where a figure it needs is null."""
    def cmp(key: str, ok: Callable[[float], bool]) -> bool | None:
        v = fig.get(key)
        return None if v is None else bool(ok(v))

    g, r = cmp("gloo_vs_weight_sync_4r", lambda x: x >= 2), cmp("ray_vs_weight_sync_4r", lambda x: x >= 1.5)
    if g is None and fig.get("weight_sync_4r_s") and fig.get("gloo_broadcast_4r_s") is not None:
        g = fig["gloo_broadcast_4r_s"] >= 2 * fig["weight_sync_4r_s"]
    if r is None and fig.get("weight_sync_4r_s") and fig.get("ray_object_store_4r_s") is not None:
        r = fig["ray_object_store_4r_s"] >= 1.5 * fig["weight_sync_4r_s"]
    fb = cmp("weight_sync_first_bucket_ratio", lambda x: x <= 3)
    if fb is None and fig.get("weight_sync_first_bucket_ms") is not None and fig.get("one_bucket_get_ms"):
        fb = fig["weight_sync_first_bucket_ms"] <= 3 * fig["one_bucket_get_ms"]
    return {
        "weight_sync_4r_s": None if g is None or r is None else (g and r),
        "gloo_vs_weight_sync_4r": g,
        "ray_vs_weight_sync_4r": r,
        "weight_sync_vs_copy_floor": None,
        "weight_sync_vs_same_tensor_floor": cmp("weight_sync_vs_same_tensor_floor", lambda x: x >= 0.9),
        "weight_sync_trainer_blocked_ms": cmp("weight_sync_trainer_blocked_ms", lambda x: x <= 1.0),
        "weight_sync_first_bucket_ms": fb,
        "weight_sync_first_bucket_ratio": fb,
    }


__all__ = ["WEIGHT_GOALS", "GlooGroup", "RayPeer", "SameTensorCopy", "SyncRun", "TensorCopy", "TwoStreamCopy", "digest", "find_ray",
           "gloo_broadcast", "memsem_sync", "ray_object_store", "step_in_place", "synthetic_state_dict",
           "two_stream_copyto_gbps", "weight_goals_met", "weight_sync_keys"]
