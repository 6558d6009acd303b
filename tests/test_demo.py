"""``memsem demo`` runs end to end: its rollouts are the follower loop (``Runtime.follow``) and
every version reaches every rollout bit-exact (sha256)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.multiproc
def test_the_demo_follows_every_version_bit_exact(tmp_path):
    """As ``make demo`` runs it (``--pipeline``), where torch cannot be imported (``make demo``
    installs none; README says so): a ``torch`` package that raises ImportError shadows it."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch here (test_demo)')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    cp = subprocess.run([sys.executable, "-m", "memsem.cli", "demo", "--consumers", "2", "--steps", "2",
                         "--timeout", "300", "--pipeline"], capture_output=True, text=True, timeout=600, env=env)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "demo passed" in cp.stdout and "rt.follow" in cp.stdout
    assert "NO" not in cp.stdout.split("aggregate")[0]  # no version failed its sha256
    assert "sha256 matches the file" in " ".join(cp.stdout.split())  # the pipeline phase ran and checked
