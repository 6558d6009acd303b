"""``memsem demo`` runs end to end: its rollouts are the follower loop (``Runtime.follow``) and
every version reaches every rollout bit-exact (sha256)."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.multiproc
def test_the_demo_follows_every_version_bit_exact():
    cp = subprocess.run([sys.executable, "-m", "memsem.cli", "demo", "--consumers", "2", "--steps", "2",
                         "--timeout", "300"], capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "demo passed" in cp.stdout and "rt.follow" in cp.stdout
    assert "NO" not in cp.stdout.split("aggregate")[0]  # no version failed its sha256
