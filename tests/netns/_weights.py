"""Versioned weight sync across nodes, for test_many_nodes.py: a trainer and rollouts.

    python _weights.py trainer     publish a state dict "policy" (double-buffered), print
                                   {"ready": ..., "version": 1, "sha": ...}; then per line
                                   {"step": k} write version k + 1 (every tensor changed) and
                                   print {"version": v, "sha": ...}; {"exit": true} ends
    python _weights.py rollout K   look "policy" up by name (job secret), then follow versions
                                   2..K: wait for each, load it into existing tensors, print
                                   {"version": v, "sha": ...}; then {"done": true, "route": ...}

sha is the sha256 of every tensor's bytes in name order. Every wait has a timeout.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

import memsem

ENGINES = ("loopback", "host", "tcp")


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def sha(sd) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(np.ascontiguousarray(sd[k]).view(np.uint8).tobytes())
    return h.hexdigest()


def model(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    base = {"embed": rng.standard_normal((256, 64)).astype(np.float32),
            "layer0.w": rng.standard_normal((64, 64)).astype(np.float32),
            "layer0.b": np.zeros(64, np.float32),
            "steps": np.array(0, np.int64),  # a 0-d tensor
            "head": rng.standard_normal((64, 1000)).astype(np.float32)}
    return {k: (v + np.asarray(step, v.dtype)) for k, v in base.items()}


def trainer() -> None:
    with memsem.Runtime(engines=ENGINES, timeout=30) as rt:
        sd = model(0)
        ref = rt.publish_state_dict(sd, name="policy", slots=2)
        say(ready=True, version=ref.version(), sha=sha(sd), endpoint=rt.engine("tcp").endpoint)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("exit"):
                break
            sd = model(cmd["step"])
            v = ref.update(sd)
            say(version=v, sha=sha(sd))


def rollout(last: int) -> None:
    with memsem.Runtime(engines=ENGINES, timeout=30) as rt:
        deadline = time.monotonic() + 30
        while True:
            try:
                ref = rt.lookup_state_dict("policy")
                break
            except memsem.WindowNotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        into = ref.empty_like("numpy")
        for want in range(2, last + 1):
            v = ref.wait_version(want, timeout=60)
            got = ref.load(into, version=v)
            say(version=got, sha=sha(into))
        say(done=True, route=rt.route(ref).kind)


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        trainer()
    else:
        rollout(int(sys.argv[2]))
