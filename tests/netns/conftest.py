"""Fixtures for tests that run "nodes" in network namespaces joined by veth.

- The probe result is printed in pytest's header, so the output always says whether the
  namespace tests run or why they skip.
- Namespace tests skip only when namespaces cannot be created (not root, no ``ip``, refused);
  with MEMSEM_REQUIRE_NETNS=1 (CI on a machine known to allow them) they fail instead.
- A missing redis-server is installed with install_redis.sh when running as root; otherwise the
  Redis tests fail with the command to run (a missing Redis is not a reason to skip).
- Namespaces left by an earlier, SIGKILLed run (creator pid dead) are removed at session start.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import netns as _netns  # noqa: E402
import redis_server as _redis_server  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "netns: needs network namespaces (root)")
    config.addinivalue_line("markers", "bench: prints measured numbers; slower")


def pytest_report_header(config):
    ok, reason = _netns.probe()
    rs = _redis_server.find_redis_server()
    return [
        f"memsem netns: {'available' if ok else 'UNAVAILABLE -> namespace tests skip'}: {reason}",
        f"memsem redis-server: {rs or 'not installed (tests/netns/install_redis.sh)'}",
    ]


def pytest_sessionstart(session):
    _redis_server.cleanup_stale_dirs()
    ok, _ = _netns.probe()
    if ok:
        removed = _netns.cleanup_stale()
        if removed:
            print(f"memsem netns: removed stale namespaces {removed}", file=sys.stderr)


@pytest.fixture(scope="session")
def netns_available():
    ok, reason = _netns.probe()
    if not ok:
        msg = f"network namespaces unavailable here: {reason}"
        if os.environ.get("MEMSEM_REQUIRE_NETNS") == "1":
            pytest.fail(msg + " (MEMSEM_REQUIRE_NETNS=1)")
        pytest.skip(msg)
    return True


@pytest.fixture
def ns_pair(netns_available):
    """(a, b): two fresh namespaces joined by veth; torn down after the test."""
    with _netns.veth_pair() as pair:
        yield pair


@pytest.fixture(scope="session")
def redis_binary():
    path = _redis_server.find_redis_server()
    if path is None and os.geteuid() == 0:
        script = os.path.join(HERE, "install_redis.sh")
        cp = subprocess.run(["sh", script], capture_output=True, text=True, timeout=900)
        if cp.returncode != 0:
            pytest.fail(f"install_redis.sh failed:\n{cp.stdout[-2000:]}\n{cp.stderr[-2000:]}")
        path = _redis_server.find_redis_server()
    if path is None:
        pytest.fail("redis-server not found; run as root: sh tests/netns/install_redis.sh")
    return path
