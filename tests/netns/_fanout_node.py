"""Fan-out across nodes, for test_fanout.py: a trainer (FanoutSource) and rollouts (Relay).

    python _fanout_node.py trainer            publish "policy" (chunks of CHUNK bytes); print
                                              {"ready": true, "sha": ...}; per line
                                              {"steps": [k, ...]} commit those versions back
                                              to back and print {"shas": {v: sha}}; {"exit": true}
    python _fanout_node.py rollout RANK WORLD [--plan P] [--kill-at E:V:K] [--gate-at E:V:K
        --gate-file F] [--corrupt K] [--on-mismatch M]
                                              follow "policy" with a Relay; per line
                                              {"load": v} load a version >= v into existing
                                              tensors and print {"version", "sha", "stats"} or
                                              {"error", "relay", "msg"}; on the hook's
                                              "complete" print {"event": "complete", "version"}

--kill-at: SIGKILL this process at that hook event (fetch / serve / complete, version, chunk);
--gate-at: block there until --gate-file exists (bounded); --corrupt K: serve chunk K wrong;
--report-serve: print {"event": "serve", "version", "chunk"} for every chunk checked and served.
sha: sha256 of every tensor's bytes in name order.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import memsem

ENGINES = ("loopback", "host", "tcp")
CHUNK = 64 << 10
_out = threading.Lock()


def say(**kw) -> None:
    with _out:
        print(json.dumps(kw), flush=True)


def model(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"embed": rng.standard_normal((512, 256)).astype(np.float32),   # 512 KiB
            "steps": np.array(step, np.int64),
            "head": rng.standard_normal(100003).astype(np.float32)}


def sha(sd) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(np.ascontiguousarray(sd[k]).view(np.uint8).tobytes())
    return h.hexdigest()


def trainer() -> None:
    with memsem.Runtime(engines=ENGINES, timeout=60) as rt:
        src = memsem.FanoutSource(rt, model(1), name="policy", chunk_bytes=CHUNK)
        say(ready=True, sha=sha(model(1)), nbytes=src.nbytes, chunks=src.n_chunks)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("exit"):
                break
            shas = {}
            for k in cmd["steps"]:
                sd = model(k)
                shas[src.update(sd)] = sha(sd)
            say(shas=shas)
        src.close()


def _moment(s: str | None):
    if not s:
        return None
    e, v, k = s.split(":")
    return e, int(v), int(k)


class TestRelay(memsem.Relay):
    def __init__(self, *a, kill_at=None, gate_at=None, gate_file=None, corrupt=None, report_serve=False, **kw):
        self.kill_at, self.gate_at, self.gate_file, self.corrupt = kill_at, gate_at, gate_file, corrupt
        self.report_serve = report_serve
        super().__init__(*a, **kw)

    def _on_event(self, event, version, chunk, data):
        here = (event, version, chunk)
        if event == "complete" or (event == "serve" and self.report_serve):
            say(event=event, version=version, chunk=chunk)
        if self.corrupt is not None and event == "serve" and chunk == self.corrupt:
            data[0] ^= 0xFF
        if here == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if here == self.gate_at:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate_file):
                if time.monotonic() > deadline:
                    raise memsem.MemsemTimeoutError("gate file never appeared", what="gate", timeout=60)
                time.sleep(0.01)


def rollout(a) -> None:
    with memsem.Runtime(engines=ENGINES, timeout=60) as rt:
        relay = TestRelay(rt, "policy", rank=a.rank, world=a.world, plan=a.plan, timeout=120, attach_timeout=10,
                          on_mismatch=a.on_mismatch, kill_at=_moment(a.kill_at), gate_at=_moment(a.gate_at),
                          gate_file=a.gate_file, corrupt=a.corrupt, report_serve=a.report_serve)
        relay.prepare(30)
        into = rt.lookup_state_dict("policy").empty_like("numpy")
        say(ready=True, rank=a.rank)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("exit"):
                break
            try:
                v = relay.load(into, version=cmd["load"], timeout=120)
            except memsem.MemsemError as exc:
                say(error=type(exc).__name__, relay=getattr(exc, "relay", None), msg=str(exc))
                continue
            st = relay.stats()
            say(version=v, sha=sha(into), chunks={str(k): n for k, n in st.chunks.items()}, versions=st.versions,
                reattached=[[x[0], x[1], x[2], x[3].split(":")[0]] for x in st.reattached],
                faults=[f.relay for f in st.faults], dropped=st.dropped)
        relay.close()
        say(done=True, route=rt.route(rt.lookup("policy")).kind)


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        trainer()
    else:
        p = argparse.ArgumentParser()
        p.add_argument("role")
        p.add_argument("rank", type=int)
        p.add_argument("world", type=int)
        p.add_argument("--plan", default="chain")
        p.add_argument("--kill-at")
        p.add_argument("--gate-at")
        p.add_argument("--gate-file")
        p.add_argument("--corrupt", type=int)
        p.add_argument("--on-mismatch", default="raise")
        p.add_argument("--report-serve", action="store_true")
        rollout(p.parse_args())
