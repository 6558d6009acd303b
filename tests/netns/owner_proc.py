"""The owner process of the tcp tests (``_owner.py``) and its command channel."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from lines import reader

HERE = os.path.dirname(os.path.abspath(__file__))
OWNER = os.path.join(HERE, "_owner.py")
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
SECRET = "tcp-test-secret"


class Owner:
    """The owner process and its command channel."""

    def __init__(self, url: str, job: str, ttl: float = 2.0, ns=None, node: str = "own-a",
                 secret: str = SECRET, env: dict | None = None) -> None:
        env = dict(os.environ, MEMSEM_NODE_ID=node, MEMSEM_DIRECTORY=url, MEMSEM_JOB=job,
                   MEMSEM_JOB_SECRET=secret, MEMSEM_HEARTBEAT_TTL=str(ttl), PYTHONUNBUFFERED="1",
                   **(env or {}))
        env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
        kw = dict(env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cmd = [sys.executable, OWNER]
        self.p = ns.popen(cmd, **kw) if ns is not None else subprocess.Popen(cmd, **kw)
        self.info = self._line(60)
        self.pid = self.p.pid

    def _line(self, timeout: float) -> dict:
        line = reader(self.p).readline(timeout)
        if line is None:
            self.p.kill()
            raise AssertionError(f"owner silent for {timeout} s; stderr: {self.p.stderr.read()[-3000:]}")
        if not line:
            raise AssertionError(f"owner exited rc={self.p.wait()}: {self.p.stderr.read()[-3000:]}")
        return json.loads(line)

    def __call__(self, op: str, timeout: float = 60.0, **kw) -> dict:
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        r = self._line(timeout)
        assert r.get("ok"), r
        return r

    def close(self) -> None:
        self.died = self.p.poll()  # the owner's exit status if it ended before close (None: alive)
        if self.p.poll() is None:
            try:
                self.p.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.p.stdin.flush()
                self.p.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(5)
        try:
            self.stderr = self.p.stderr.read()[-4000:]
        except (OSError, ValueError):
            self.stderr = ""
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            f.close()
        if self.stderr.strip() or self.died is not None:
            print(f"owner pid {self.pid} (status before close: {self.died}) stderr:\n{self.stderr}")


