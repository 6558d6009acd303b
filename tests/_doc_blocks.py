"""Every ```python block of README.md and docs/*.md, run (tests/test_docs.py) or listed as not
runnable here with the reason: a snippet cannot drift from the API unnoticed, and a new block
cannot be added without being run or listed.

A block is named by its file and a piece of its text that no other block of the file has.
``RUN`` says how it runs: a prelude provides the names the block assumes (a published ref, a
model, a channel), then the block runs as written, top-level statement by top-level statement.
A block that shows two sides (a trainer and a rollout, a producer and a consumer) is split at
a marker line: the first part runs in a thread, the second in the caller's thread, each with its
own names, as the two processes of a job would (two runtimes of one job). A follower loop in
the docs runs forever: the prelude's callback in its body (``generate``, ``train_step``) raises
``EndLoop`` once it saw what the check needs, which ends that statement and goes on with the
next. Every block runs in a job of its own (``MEMSEM_JOB``).

``python -m tests._doc_blocks RESULTS`` runs every block of ``RUN`` in this one process (one
import of memsem and torch; each block bounded by ``BLOCK_TIMEOUT_S``) and writes one JSON line
per block to the file RESULTS: ``{"block": "file:line", "key": [file, piece], "ok": ..., "error": ...}``
(the blocks' own output goes to stdout).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import queue
import re
import signal
import sys
import threading
import traceback
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: a block, or the second part of one, past this many seconds fails naming the block
BLOCK_TIMEOUT_S = 60
#: the bound of every wait of a prelude (a channel's receive, the other part's end)
WAIT_S = 60.0


def doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks() -> list[tuple[str, int, str]]:
    """(file relative to the repository, line of the fence, code) of every ```python block."""
    out = []
    for path in doc_files():
        text = path.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            out.append((str(path.relative_to(ROOT)), text[:m.start()].count("\n") + 1, m.group(1)))
    return out


class EndLoop(BaseException):
    """Raised by a prelude's callback to end the (endless) doc loop it is called from."""


# -- what preludes share -------------------------------------------------------------------------
class Channel:
    """The control channel a block sends a ref over (``channel.send`` / ``channel.recv``). With
    ``hold``, ``send`` returns once the receiving part finished (the sender's ``with`` would
    close its window right after the send)."""

    def __init__(self, hold: bool) -> None:
        self._q: queue.Queue = queue.Queue()
        self._hold = hold
        self.receiver_done = threading.Event()

    def send(self, data: bytes) -> None:
        self._q.put(bytes(data))
        if self._hold and not self.receiver_done.wait(WAIT_S):
            raise TimeoutError(f"the receiving part did not finish within {WAIT_S} s")

    def recv(self) -> bytes:
        return self._q.get(timeout=WAIT_S)


class Committer:
    """A trainer in the background: ``commit()`` every 20 ms until the block ends, so that a
    block's ``wait_version(v + 1)`` is satisfied whenever it runs (no order hoped for)."""

    def __init__(self, commit: Callable[[], Any]) -> None:
        self._stop = threading.Event()
        self._commit = commit
        self.errors: list[BaseException] = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.02):
                self._commit()
        except BaseException as exc:  # noqa: BLE001  (reported by close)
            self.errors.append(exc)

    def close(self) -> None:
        self._stop.set()
        self._t.join(WAIT_S)
        if self.errors:
            raise self.errors[0]


@dataclasses.dataclass
class Ctx:
    """What a block's preludes made that must be closed after it (runtimes, committers)."""

    closers: list[Callable[[], Any]] = dataclasses.field(default_factory=list)
    channel: Channel | None = None

    def runtime(self, **kw: Any) -> Any:
        import memsem

        rt = memsem.Runtime(timeout=30.0, **kw)
        self.closers.append(rt.close)
        return rt

    def committer(self, commit: Callable[[], Any]) -> Committer:
        c = Committer(commit)
        self.closers.insert(0, c.close)  # stopped before the runtimes close
        return c


def _ends_after(n: int, seen: list | None = None) -> Callable[..., None]:
    """A loop body's callback that ends the loop at its ``n``-th call (``seen`` gets its args)."""
    calls = [0]

    def body(*args: Any, **kw: Any) -> None:
        if seen is not None:
            seen.append(args)
        calls[0] += 1
        if calls[0] >= n:
            raise EndLoop

    return body


class _Model:
    """``model.state_dict()`` of a small torch model (``"w"`` and ``"b"``), the tensors themselves."""

    def __init__(self, value: float = 0.0) -> None:
        import torch

        self.sd = {"w": torch.full((64, 32), value), "b": torch.full((32,), value)}

    def state_dict(self) -> dict:
        return self.sd


# -- preludes (ctx) -> the names a block (or a part) assumes ----------------------------------------
def p_readme_producer(ctx: Ctx) -> dict:
    import numpy as np

    ctx.channel = Channel(hold=True)
    return {"weights": np.arange(1 << 16, dtype=np.float32), "channel": ctx.channel}


def p_readme_consumer(ctx: Ctx) -> dict:
    import numpy as np

    return {"channel": ctx.channel, "my_params": np.zeros(1 << 16, np.float32), "compute": lambda a: None}


def c_readme(a: dict, b: dict) -> None:
    assert (b["my_params"] == a["weights"]).all()


def p_readme_fields(ctx: Ctx) -> dict:
    import numpy as np

    return {"rt": ctx.runtime(), "rollout_logprobs": np.ones((512, 4096), np.float32)}


def c_readme_fields(a: dict, b: dict) -> None:
    assert (a["fs"]["logprobs"].get_rows(0, 64) == 1).all()


def p_asyncio(ctx: Ctx) -> dict:
    import numpy as np

    rt = ctx.runtime()
    ref = rt.publish(np.arange(256, dtype=np.float32))
    other = rt.publish(np.zeros(256, np.float32))
    return {"rt": rt, "ref": ref, "out": np.empty(256, np.float32),
            "new_values": np.full(256, 7, np.float32), "pairs": [(other, np.empty(256, np.float32))]}


def e_asyncio(ns: dict) -> None:
    import asyncio

    asyncio.run(ns["step"](ns["ref"], ns["out"]))
    assert (ns["out"] == range(256)).all() and (ns["ref"].get() == 7).all()  # got, then put


def p_fanout_source(ctx: Ctx) -> dict:
    import torch

    return {"rt": ctx.runtime(), "model": _Model(), "delta": torch.ones(64, 32)}


def c_fanout_source(a: dict, b: dict) -> None:
    assert a["v"] == 2 and a["sec"].version == 3


def p_fanout_relay(ctx: Ctx) -> dict:
    import memsem

    trainer = ctx.runtime()
    model = _Model(1.0)
    src = memsem.FanoutSource(trainer, model.state_dict(), name="policy")
    ctx.committer(lambda: src.update(model.state_dict()))
    seen: list = []
    engine = type("Engine", (), {"load_weights": staticmethod(lambda items: seen.extend(items))})()
    return {"rt": ctx.runtime(), "i": 0, "n": 1, "model": _Model(), "engine": engine, "_seen": seen}


def c_fanout_relay(a: dict, b: dict) -> None:
    assert a["v"] >= 2 and {k for k, _ in a["_seen"]} == {"w", "b"}
    assert float(a["model"].state_dict()["w"][0, 0]) == 1.0


def p_howto_share_trainer(ctx: Ctx) -> dict:
    ctx.channel = Channel(hold=True)
    return {"model": _Model(3.0), "channel": ctx.channel}


def p_howto_share_rollout(ctx: Ctx) -> dict:
    return {"my_model": _Model()}


def c_howto_share(a: dict, b: dict) -> None:
    import torch

    assert b["version"] == 1 and torch.equal(b["my_model"].sd["w"], a["model"].sd["w"])


def p_howto_follow_trainer(ctx: Ctx) -> dict:
    model = _Model()
    return {"rt": ctx.runtime(), "model": model, "steps": 3,
            "optimizer": type("Opt", (), {"step": staticmethod(lambda: model.sd["w"].add_(1))})()}


def p_howto_follow_rollout(ctx: Ctx) -> dict:
    seen: list = []

    def generate(params: dict) -> None:  # the loop ends at the trainer's last step
        seen.append(float(params["w"][0, 0]))
        if seen[-1] == 3.0:
            raise EndLoop

    return {"rt": ctx.runtime(), "my_model": _Model(), "generate": generate, "_seen": seen}


def c_howto_follow(a: dict, b: dict) -> None:
    assert b["_seen"][-1] == 3.0 and b["version"] == 4


def c_howto_lockstep(a: dict, b: dict) -> None:
    assert b["_seen"] == [0.0, 1.0, 2.0, 3.0], b["_seen"]  # every version, in order
    assert a["v"] == 4 and b["version"] == 4


def _consumer_of_a_state_dict(ctx: Ctx, name: str = "policy") -> tuple[Any, dict]:
    import numpy as np

    trainer = ctx.runtime()
    model = {"w": np.zeros((64, 32), np.float32), "step": np.zeros((), np.int64)}
    owner = trainer.publish_state_dict(model, name=name, slots=2)

    def commit() -> None:
        model["w"] += 1
        model["step"] += 1
        owner.update(model)

    ctx.committer(commit)
    rt = ctx.runtime()
    return rt, {k: np.zeros_like(v) for k, v in model.items()}


def p_weight_sync_delta(ctx: Ctx) -> dict:
    rt, local = _consumer_of_a_state_dict(ctx)
    return {"rt": rt, "sd": rt.lookup_state_dict("policy", timeout=WAIT_S), "model_state": local}


def c_weight_sync_delta(a: dict, b: dict) -> None:
    step = int(a["model_state"]["step"])  # one version throughout: w and step agree with it
    assert a["v"] == step + 1 and (a["model_state"]["w"] == step).all() and a["moved"] > 0


def p_howto_step(ctx: Ctx) -> dict:
    rt, local = _consumer_of_a_state_dict(ctx)
    return {"sd": rt.lookup_state_dict("policy", timeout=WAIT_S), "local": local}


def c_howto_step(a: dict, b: dict) -> None:
    assert int(a["local"]["step"]) == a["v"] - 1 and (a["local"]["w"] == a["v"] - 1).all()


def p_howto_fields_producer(ctx: Ctx) -> dict:
    import numpy as np

    ctx.channel = Channel(hold=False)
    return {"rt": ctx.runtime(), "send": ctx.channel.send,
            "rollout_logprobs": np.arange(512 * 4096, dtype=np.float32).reshape(512, 4096)}


def p_howto_fields_trainer(ctx: Ctx) -> dict:
    seen: list = []

    def train_step(array: Any, rows: Any) -> None:
        seen.append((array.copy(), rows))
        raise EndLoop  # the other rows come from other producers

    return {"rt": ctx.runtime(), "data": ctx.channel.recv(), "train_step": train_step, "_seen": seen}


def c_howto_fields(a: dict, b: dict) -> None:
    (array, rows), = b["_seen"]
    assert tuple(rows) == (0, 128) and (array == a["rollout_logprobs"][:128]).all()


def p_howto_pytest(ctx: Ctx) -> dict:
    import numpy as np

    return {"np": np, "my_loader": lambda ref: ref.get()}


def e_howto_pytest(ns: dict) -> None:
    import memsem

    with memsem.Runtime(timeout=30.0) as rt:  # what the plugin's memsem_runtime fixture gives
        ns["test_my_loader"](rt)


def p_ref(ctx: Ctx) -> dict:
    import numpy as np

    rt = ctx.runtime()
    return {"rt": rt, "ref": rt.publish(np.arange(1024, dtype=np.int64))}


def c_leases(a: dict, b: dict) -> None:
    assert (a["a"] == list(range(1024))).all() and not a["lease"].held


def p_metrics(ctx: Ctx) -> dict:
    return {"global_rank": 0}


def e_metrics(ns: dict) -> None:
    from prometheus_client import REGISTRY, generate_latest

    assert b"memsem_runtime_open{" in generate_latest(REGISTRY)  # the block's collector is registered
    ns["rt"].close()  # the block's own runtime (its collector holds it weakly: it reports 0 from here)


def p_weight_sync_sections(ctx: Ctx) -> dict:
    import numpy as np

    return {"rt": ctx.runtime(), "weights": np.zeros(4096, np.float32), "delta": np.float32(2)}


def c_weight_sync_sections(a: dict, b: dict) -> None:
    assert a["s"].version == 2 and (a["ref"].get() == 2).all()


def p_weight_sync_follow(ctx: Ctx) -> dict:
    rt, local = _consumer_of_a_state_dict(ctx)
    return {"rt": rt, "model_state": local, "generate": _ends_after(1)}


def c_weight_sync_follow(a: dict, b: dict) -> None:
    step = int(a["model_state"]["step"])  # the load's version is step + 1, one version throughout
    assert (a["model_state"]["w"] == step).all() and a["v"] >= step + 2


def p_weight_sync_sharded(ctx: Ctx) -> dict:
    return {"rt": ctx.runtime()}


def c_weight_sync_sharded(a: dict, b: dict) -> None:
    assert a["version"] == 1 and a["out"]["w"].tobytes() == a["full"][:, 2:].copy().tobytes()
    assert a["reader"].bytes_moved == 5 * 2 * 4  # its bytes only
    assert a["mine"]["w"].tobytes() == a["out"]["w"].tobytes() and a["child"].fallbacks == []
    assert a["child"].trainer_reader.bytes_moved == 0  # the relay's bytes, checked by digests


@dataclasses.dataclass(frozen=True)
class Run:
    """How a block runs: ``prelude`` (and ``epilogue``, called with its names) for a block of
    one side; with ``split``, the block is two parts at the line that starts with ``split``:
    ``prelude`` and ``second`` give their names, the first part runs in a thread. ``check``
    asserts the outcome, given both parts' names (the second's empty for a one-part block)."""

    prelude: Callable[[Ctx], dict]
    split: str | None = None
    second: Callable[[Ctx], dict] | None = None
    epilogue: Callable[[dict], None] | None = None
    check: Callable[[dict, dict], None] | None = None


#: (file, a piece of text only this block of the file has) -> how it runs
RUN: dict[tuple[str, str], Run] = {
    ("README.md", "# producer (trainer)"): Run(p_readme_producer, "# consumer", p_readme_consumer, check=c_readme),
    ("README.md", "rollout_logprobs[:64]"): Run(p_readme_fields, check=c_readme_fields),
    ("docs/asyncio.md", "async def step"): Run(p_asyncio, epilogue=e_asyncio),
    ("docs/fanout.md", "memsem.FanoutSource("): Run(p_fanout_source, check=c_fanout_source),
    ("docs/fanout.md", "memsem.Relay("): Run(p_fanout_relay, check=c_fanout_relay),
    ("docs/howto.md", "import memsem, torch"): Run(p_howto_share_trainer, "# rollout", p_howto_share_rollout,
                                                   check=c_howto_share),
    ("docs/howto.md", "# rollout: the follower loop"): Run(p_howto_follow_trainer, "# rollout",
                                                           p_howto_follow_rollout, check=c_howto_follow),
    ("docs/howto.md", "rt.wait_loaded(sd, v"): Run(p_howto_follow_trainer, "# rollout", p_howto_follow_rollout,
                                                   check=c_howto_lockstep),
    ("docs/howto.md", "with sd.pin(version=v)"): Run(p_howto_step, check=c_howto_step),
    ("docs/howto.md", "# producer side"): Run(p_howto_fields_producer, "# trainer side", p_howto_fields_trainer,
                                              check=c_howto_fields),
    ("docs/howto.md", "def test_my_loader"): Run(p_howto_pytest, epilogue=e_howto_pytest),
    ("docs/howto.md", "ScriptedEngine(HostEngine"): Run(lambda ctx: {}),
    ("docs/leases.md", "lease.renew(10.0)"): Run(p_ref, check=c_leases),
    ("docs/metrics.md", "memsem.metrics.serve("): Run(p_metrics, epilogue=e_metrics),
    ("docs/weight-sync.md", "rt.write_section(ref)"): Run(p_weight_sync_sections, check=c_weight_sync_sections),
    ("docs/weight-sync.md", "rt.follow(\"policy\""): Run(p_weight_sync_follow, check=c_weight_sync_follow),
    ("docs/weight-sync.md", "name=\"tiny\""): Run(p_weight_sync_sharded, check=c_weight_sync_sharded),
    ("docs/weight-sync.md", "sd.load(model_state, base=v)"): Run(p_weight_sync_delta, check=c_weight_sync_delta),
}

#: files none of whose blocks is code to run, with the reason
NOT_RUN_FILES = {
    "docs/api.md": "generated signatures (docs/gen_api.py), not statements; test_api_md_is_generated_from_the_code",
    "docs/ray-transport.md": "Ray actors (Ray is not in the test venv); tests/ray/test_ray_transport.py makes the "
                             "same calls on the suite's Ray cluster",
}

#: (file, piece of text) -> why the block is not run here
NOT_RUNNABLE = {
    ("docs/many-nodes.md", "redis://10.0.0.5"): "two nodes and a Redis server at the address shown; "
                                                "tests/netns/test_tcp.py makes the same calls across node ids",
    ("docs/many-nodes.md", "@ray.remote"): "a Ray cluster (Ray is not in the test venv); tests/ray run it",
    ("docs/mte.md", "MteEngine"): "Ascend SHMEM (libshmem.so) on several PEs; tests/test_mte.py makes these "
                                  "calls on the emulator's PEs",
    ("docs/transferqueue.md", "import transfer_queue"): "Ray and TransferQueue (their own venv); tests/tq run it",
    ("docs/weight-sync.md", "fully_shard(model)"): "the ranks of a torch.distributed job; tests/test_reshard.py "
                                                   "runs these calls with fully_shard over gloo (2 and 4 ranks)",
    ("docs/weight-sync.md", "tp_targets(sd.names"): "a rollout rank beside a sharded trainer; tests/test_reshard.py "
                                                    "runs these calls against FSDP2 trainers (TP 1, 2 and 4)",
}


def match(entries: dict[tuple[str, str], Any]) -> tuple[dict[tuple[str, int], tuple[str, str]], list[str]]:
    """Which entry names which block: ({(file, line): entry key}, problems: an entry that names
    no block or several)."""
    found: dict[tuple[str, int], tuple[str, str]] = {}
    problems = []
    all_blocks = blocks()
    for key in entries:
        file, piece = key
        hits = [(f, line) for f, line, code in all_blocks if f == file and piece in code]
        if len(hits) != 1:
            problems.append(f"{key}: names {len(hits)} blocks (one wanted)")
        for h in hits:
            found[h] = key
    return found, problems


# -- the runner ----------------------------------------------------------------------------------
def _split(code: str, marker: str) -> tuple[str, str]:
    lines = code.splitlines(keepends=True)
    at = [i for i, ln in enumerate(lines) if ln.startswith(marker)]
    if len(at) != 1:
        raise AssertionError(f"split marker {marker!r} found {len(at)} times")
    return "".join(lines[:at[0]]), "".join(lines[at[0]:])


def _imports(code: str) -> str:
    """The top-level imports of ``code`` (a block's imports hold for both of its sides)."""
    tree = ast.parse(code)
    return "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))


def _namespace(names: dict) -> dict:
    """A block's names: ``memsem`` (every page assumes ``import memsem``) and the prelude's."""
    import memsem

    return {"__name__": "__doc_block__", "memsem": memsem, **names}


def _exec(code: str, ns: dict, where: str) -> None:
    """``code`` statement by top-level statement; ``EndLoop`` ends only its statement."""
    for stmt in ast.parse(code, filename=where).body:
        mod = ast.Module(body=[stmt], type_ignores=[])
        try:
            exec(compile(mod, where, "exec"), ns)  # noqa: S102
        except EndLoop:
            pass


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the block ran past {BLOCK_TIMEOUT_S} s")


def run_block(file: str, line: int, code: str, how: Run, job: str) -> None:
    os.environ["MEMSEM_JOB"] = job
    ctx = Ctx()
    where = f"{file}:{line}"
    try:
        a = _namespace(how.prelude(ctx))
        b: dict = {}
        if how.split is None:
            _exec(code, a, where)
            if how.epilogue is not None:
                how.epilogue(a)
        else:
            first, second = _split(code, how.split)
            errors: list[BaseException] = []
            done = threading.Event()

            def run_first() -> None:
                try:
                    _exec(first, a, where)
                except BaseException as exc:  # noqa: BLE001  (reported below)
                    errors.append(exc)
                finally:
                    done.set()

            t = threading.Thread(target=run_first, daemon=True)
            t.start()
            try:  # the second part's prelude may receive what the first part sends
                b = _namespace(how.second(ctx) if how.second else {})
                _exec(_imports(first) + "\n" + second, b, where)
            finally:
                if ctx.channel is not None:
                    ctx.channel.receiver_done.set()
                if not done.wait(WAIT_S):
                    errors.append(TimeoutError(f"the first part did not end within {WAIT_S} s"))
            if errors:
                raise errors[0]
        if how.check is not None:
            how.check(a, b)
    finally:
        for close in ctx.closers:
            close()


def main(results_path: str) -> int:
    signal.signal(signal.SIGALRM, _alarm)
    found, problems = match(RUN)
    results = open(results_path, "w")
    if problems:
        print(json.dumps({"block": "RUN", "key": [], "ok": False, "error": "; ".join(problems)}), file=results)
        return 1
    code_of = {(f, line): code for f, line, code in blocks()}
    for k, ((file, line), key) in enumerate(sorted(found.items())):
        name = f"{file}:{line}"
        signal.alarm(BLOCK_TIMEOUT_S)
        try:
            run_block(file, line, code_of[(file, line)], RUN[key], f"docblk{os.getpid()}x{k}")
            result = {"block": name, "key": list(key), "ok": True, "error": ""}
        except BaseException:  # noqa: BLE001  (every block reports)
            result = {"block": name, "key": list(key), "ok": False, "error": traceback.format_exc()[-4000:]}
        finally:
            signal.alarm(0)
        print(json.dumps(result), file=results, flush=True)
    results.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
