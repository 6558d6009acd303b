"""What a new user meets first: `memsem topo` shows the cross-node route, and a full /dev/shm says
how to give it room."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

import memsem
from memsem.native import _segment


def _topo(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "MEMSEM_ENGINES"}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "memsem.cli", "topo", *args], capture_output=True, text=True,
                          timeout=120, env=e, check=True)


def test_topo_shows_the_tcp_route_to_another_node():
    info = json.loads(_topo("--json").stdout)
    assert info["engines"]["tcp"]["available"]
    other = info["routes"]["another node"]
    assert other["engine"] == "tcp" and other["kind"] == "tcp", other
    assert other["reason"].startswith("owner serves TCP at tcp://"), other
    text = _topo().stdout
    line = next(x for x in text.splitlines() if x.strip().startswith("another node"))
    assert "-> tcp" in line, text
    assert "MEMSEM_ENGINES=loopback,host,tcp" in text  # how a Runtime gets that route


def test_topo_says_why_when_nothing_reaches_another_node(monkeypatch):
    # tcp reported unavailable (as on a machine without it): the route is "none", with the reason
    from memsem.cli import _topo as topo

    real = topo.probe_engines

    def probe():
        out = real()
        out["tcp"] = {"available": False, "reason": "disabled for this test"}
        return out

    monkeypatch.setattr(topo, "probe_engines", probe)
    monkeypatch.delenv("MEMSEM_ENGINES", raising=False)

    class Args:
        json = True

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert topo.run_topo(Args()) == 0
    other = json.loads(buf.getvalue())["routes"]["another node"]
    assert other["engine"] is None and "no route reaches the window" in other["reason"], other


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.ENOMEM])
def test_a_full_segment_directory_says_how_to_give_it_room(monkeypatch, tmp_path, err):
    def full(fd, offset, length):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(_segment.os, "posix_fallocate", full)
    monkeypatch.setenv("MEMSEM_SHM_DIR", str(tmp_path))  # the setting the message names
    with pytest.raises(memsem.OutOfMemoryError) as info:
        _segment.Segment.create("data", 1 << 20)
    msg = str(info.value)
    assert "--shm-size" in msg and "MEMSEM_SHM_DIR" in msg and "cannot reserve 1048576 bytes" in msg, msg
    assert _segment.segment_dir() == str(tmp_path) and os.listdir(tmp_path) == []  # nothing half-created left
