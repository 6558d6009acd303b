"""An owner "node" for the tcp tests: publishes windows and obeys JSON commands on stdin.

    python _owner.py            prints {"ready": true, "endpoint": ..., "pid": ...}, then one JSON
                                reply line per command line

Environment: MEMSEM_DIRECTORY (redis://...), MEMSEM_NODE_ID, MEMSEM_JOB, MEMSEM_JOB_SECRET.
Commands (``op`` and arguments) - see ``handle``. Every wait has a timeout.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

import numpy as np

import memsem

ENGINES = ("loopback", "host", "tcp")


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


class Owner:
    def __init__(self) -> None:
        self.rt = memsem.Runtime(engines=ENGINES, timeout=float(os.environ.get("OWNER_TIMEOUT", "10")))
        self.wins: dict[str, memsem.TensorRef] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.sets: dict[str, memsem.FieldSet] = {}
        self.writer: threading.Thread | None = None
        self.writer_stop = threading.Event()
        self.sections = 0

    def publish(self, name: str, n: int, dtype: str = "int64", kind: str = "arange", access: str = "rw",
                tile_bytes: int | None = None, value: float = 0) -> str:
        if kind == "torch_empty":  # an empty tensor with no memory at all (data_ptr 0)
            import torch

            ref = self.rt.publish(torch.empty(0), name=name, access=access)
            self.wins[name] = ref
            self.arrays[name] = np.empty(0, np.float32)
            return ref.to_bytes().hex()
        if kind == "arange":
            a = np.arange(n, dtype=dtype)
        elif kind == "full":
            a = np.full(n, value, dtype=dtype)
        else:
            a = np.zeros(n, dtype=dtype)
        if access == "r":
            a.flags.writeable = False
        self.arrays[name] = a
        ref = self.rt.publish(a, name=name, access=access, tile_bytes=tile_bytes)
        self.wins[name] = ref
        return ref.to_bytes().hex()

    def write_loop(self, name: str, seconds: float) -> None:
        """Write sections filling the window with one value each (a reader must never see two)."""
        a = self.arrays[name]
        end = time.monotonic() + seconds
        v = 0
        while not self.writer_stop.is_set() and time.monotonic() < end:
            v += 1
            with self.rt.write_section(self.wins[name]):
                a[:] = v
            self.sections += 1

    def versioned_loop(self, name: str, seconds: float) -> None:
        """Write sections back to back, each filling the window (or every tensor of a state
        dict) with its own version: the bytes name the version they belong to."""
        ref = self.wins[name]
        end = time.monotonic() + seconds
        while not self.writer_stop.is_set() and time.monotonic() < end:
            if isinstance(ref, memsem.StateDictRef):
                with ref.write_section(copy=False) as sec:
                    for t in sec.tensors.values():
                        t[...] = sec.version
            else:
                with self.rt.write_section(ref, copy=False) as sec:
                    sec.array()[...] = sec.version
            self.sections += 1

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        rt = self.rt
        if op == "publish":
            return {"ref": self.publish(cmd["name"], cmd["n"], cmd.get("dtype", "int64"), cmd.get("kind", "arange"),
                                        cmd.get("access", "rw"), cmd.get("tile_bytes"), cmd.get("value", 0))}
        if op == "bytes":
            return {"ref": self.wins[cmd["name"]].bytes(cmd["offset"], cmd["nbytes"]).to_bytes().hex()}
        if op == "fields":
            fs = rt.publish_fields({k: (tuple(v[0]), v[1]) for k, v in cmd["fields"].items()},
                                   tile_rows=cmd["tile_rows"], name=cmd["name"])
            self.sets[cmd["name"]] = fs
            return {"set": fs.to_bytes().hex()}
        if op == "put_rows":
            fs = self.sets[cmd["set"]]
            f = fs[cmd["field"]]
            rows = np.full((cmd["stop"] - cmd["start"],) + f.shape[1:], cmd["value"], f.dtype)
            return {"marked": f.put_rows(cmd["start"], rows)}
        if op == "mark":
            for t in cmd["tiles"]:
                self.wins[cmd["name"]].mark_ready(t)
            return {}
        if op == "clear":
            for t in cmd["tiles"]:
                rt.readiness.clear(self.wins[cmd["name"]].spec, t)
            return {}
        if op == "hold_pushes":  # the watch hub tells no subscriber of a change until release_pushes
            self.held = []
            for w in list(rt.server.hub._windows.values()):
                for sub in list(w.subs):
                    orig = sub.notify
                    sub.notify = lambda: None
                    self.held.append((sub, orig))
            return {"held": len(self.held)}
        if op == "release_pushes":
            for sub, orig in getattr(self, "held", []):
                sub.notify = orig
                sub.dirty = True
                orig()
            self.held = []
            return {}
        if op == "write":
            with rt.write_section(self.wins[cmd["name"]]) as ws:
                self.arrays[cmd["name"]][:] = cmd["value"]
            return {"version": ws.version}
        if op == "writer":
            self.writer_stop.clear()
            self.writer = threading.Thread(target=self.write_loop, args=(cmd["name"], cmd["seconds"]), daemon=True)
            self.writer.start()
            return {}
        if op == "publish_versioned":  # a window whose bytes are its version (1 at publish)
            if cmd.get("state_dict"):
                sd = {f"t{i}": np.ones(cmd["n"], np.int64) for i in range(cmd.get("tensors", 4))}
                ref = rt.publish_state_dict(sd, name=cmd["name"], slots=cmd.get("slots", 2))
            else:
                self.arrays[cmd["name"]] = a = np.ones(cmd["n"], np.int64)
                ref = rt.publish(a, name=cmd["name"], access="r", slots=cmd.get("slots", 1))
            self.wins[cmd["name"]] = ref
            return {"ref": ref.to_bytes().hex()}
        if op == "versioned_writer":
            self.writer_stop.clear()
            self.sections = 0
            self.writer = threading.Thread(target=self.versioned_loop, args=(cmd["name"], cmd["seconds"]),
                                           daemon=True)
            self.writer.start()
            return {}
        if op == "commit":  # one write section: its version, or the error that ended it
            ref = self.wins[cmd["name"]]
            try:
                with rt.write_section(ref, copy=False, timeout=cmd.get("wait", 1.0)) as sec:
                    sec.array()[...] = sec.version
                return {"version": sec.version, "blocked_s": sec.blocked_s}
            except memsem.MemsemError as exc:
                return {"error": type(exc).__name__, "msg": str(exc)}
        if op == "writer_stop":
            self.writer_stop.set()
            if self.writer is not None:
                self.writer.join(30)
            return {"sections": self.sections}
        if op == "republish":
            name = cmd["name"]
            ref = rt.publish(self.arrays[name], name=name, tile_bytes=cmd.get("tile_bytes"), replace=True)
            self.wins[name] = ref
            return {"ref": ref.to_bytes().hex()}
        if op == "unpublish":
            rt.unpublish(self.wins[cmd["name"]], timeout=cmd.get("timeout", 5.0))
            return {}
        if op == "read":
            a = self.arrays[cmd["name"]]
            return {"head": a.ravel()[:8].tolist(), "sum": float(a.astype(np.float64).sum())}
        if op == "read_field":
            a = self.sets[cmd["set"]].local(cmd["field"])
            return {"sum": float(a.astype(np.float64).sum()), "head": a.ravel()[:8].tolist()}
        if op == "ready_words":  # the window's ready words as the owner's control block holds them
            spec = self.sets[cmd["set"]][cmd["field"]].spec if "set" in cmd else self.wins[cmd["name"]].spec
            cb = rt.resolve(spec).cb
            from memsem.gva._control_block import W_READY_SEQ

            return {"words": [memsem.native.load_acquire(cb.ready_addr(t)) for t in range(cb.n_ready)],
                    "seq": cb.word(W_READY_SEQ), "generation": cb.generation,
                    "hub": rt.server.hub.count}
        if op == "rss":
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return {"rss": int(line.split()[1]) * 1024}
            return {"rss": -1}
        if op == "stats":
            return {"stats": rt.stats().as_dict()}
        if op == "tcp_stats":  # the owner's tcp server counters, and this process's threads
            return {"tcp": rt.engine("tcp").server_stats(), "threads": threading.active_count(),
                    "os_threads": len(os.listdir("/proc/self/task"))}
        if op == "publish_many":  # n small windows, value i in window i
            refs = []
            for i in range(cmd["n"]):
                a = np.full(cmd.get("len", 8), i, dtype=np.int64)
                self.arrays[f"many{i}"] = a
                refs.append(rt.publish(a, name=f"many{i}").to_bytes().hex())
            return {"refs": refs}
        if op == "bytes_many":  # owner-minted sub-ranges of ``nbytes`` each, consecutive
            w, nb = self.wins[cmd["name"]], cmd["nbytes"]
            return {"refs": [w.bytes(i * nb, nb).to_bytes().hex() for i in range(cmd["n"])]}
        if op == "hold_section":  # a write section left open until release_section
            self.section = rt.write_section(self.wins[cmd["name"]])
            self.section.__enter__()
            return {}
        if op == "release_section":
            self.section.__exit__(None, None, None)
            self.section = None
            return {}
        if op == "hold_fds":  # an owner holding many open files (its exit takes longer)
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            self.fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(min(cmd["n"], hard - 256))]
            return {"held": len(self.fds)}
        raise ValueError(f"unknown op {op}")


def main() -> None:
    owner = Owner()
    say(ready=True, endpoint=owner.rt.engine("tcp").endpoint if owner.rt.engine("tcp").endpoint else None,
        pid=os.getpid(), rank=owner.rt.rank)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            say(ok=True)
            break
        try:
            out = owner.handle(cmd)
            say(ok=True, **out)
        except Exception as exc:
            say(ok=False, error=type(exc).__name__, msg=str(exc), tb=traceback.format_exc()[-2000:])
    owner.writer_stop.set()
    owner.rt.close()


if __name__ == "__main__":
    main()
