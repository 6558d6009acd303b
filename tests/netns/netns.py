"""Two network namespaces joined by a veth pair, for tests that need "two nodes" on one machine.

Standard library only; drives iproute2's ``ip`` through subprocess. Needs root (CAP_SYS_ADMIN and
CAP_NET_ADMIN); :func:`probe` says whether namespaces can be created here and, if not, why.

    from tests.netns.netns import probe, veth_pair

    ok, reason = probe()
    with veth_pair() as (a, b):          # a, b: Namespace
        a.run(["ip", "addr"])            # subprocess.run inside namespace a
        p = b.popen([sys.executable, "client.py", a.addr])

Layout for one pair (x is chosen per pair, 1..254):

    netns memsem-a-<pid>-<n>: lo up, veth0 = 10.201.x.1/24
    netns memsem-b-<pid>-<n>: lo up, veth0 = 10.201.x.2/24

Both veth ends are created directly inside their namespaces (``ip link add ... netns``), so nothing
appears in the root namespace and the 10.201.x.0/24 addresses never meet the host's own routes.
Teardown kills every process still running inside the namespaces (they would keep the network
namespace alive after ``ip netns del``), then deletes both namespaces, which also removes the veth
pair. :func:`cleanup_stale` removes namespaces left behind by a test run that was SIGKILLed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

__all__ = [
    "NetnsError",
    "Namespace",
    "probe",
    "veth_pair",
    "star",
    "shape",
    "tx_bytes",
    "cleanup_stale",
    "PREFIX",
]

PREFIX = "memsem"
_counter = itertools.count()
_probe_cache: tuple[bool, str] | None = None


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message carries the command and its stderr."""


def _ip_binary() -> str | None:
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip") if os.access(p, os.X_OK)),
        None,
    )


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    ip = _ip_binary()
    if ip is None:
        raise NetnsError("iproute2 'ip' not found (apt-get install iproute2)")
    cp = subprocess.run([ip, *args], capture_output=True, text=True, timeout=timeout)
    if check and cp.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed (rc={cp.returncode}): {cp.stderr.strip()}")
    return cp


@dataclass
class Namespace:
    """One network namespace of a pair: its name, its veth interface and address."""

    name: str
    addr: str  # IPv4 address of veth0 inside this namespace, e.g. "10.201.7.1"
    peer_addr: str  # address of the other end
    ifname: str = "veth0"
    prefixlen: int = 24
    _popens: list = field(default_factory=list, repr=False)

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed so that it runs inside this namespace."""
        return [_ip_binary() or "ip", "netns", "exec", self.name, *cmd]

    def run(self, cmd: Sequence[str], *, check: bool = True, timeout: float | None = 60.0,
            **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(cmd) inside the namespace (capture_output/text default to True)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(cmd), check=check, timeout=timeout, **kwargs)

    def popen(self, cmd: Sequence[str], *, die_with_parent: bool = True,
              **kwargs) -> subprocess.Popen:
        """subprocess.Popen(cmd) inside the namespace.

        ``ip netns exec`` execs the command in place, so ``Popen.pid`` is the command's own pid
        (signals reach it directly). The process runs in its own session so that a terminal Ctrl-C
        reaches pytest first; the pair's teardown kills it if the caller did not, and with
        ``die_with_parent`` the kernel kills it if this process is SIGKILLed.
        """
        kwargs.setdefault("start_new_session", True)
        if die_with_parent and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = _die_with_parent
        p = subprocess.Popen(self.argv(cmd), **kwargs)
        self._popens.append(p)
        return p

    def ping(self, addr: str | None = None, timeout: float = 2.0) -> tuple[bool, str]:
        """ICMP echo from this namespace to ``addr`` (default: the peer). Returns (ok, detail).

        Uses the ``ping`` binary when installed (iputils-ping), else a raw-socket echo in Python
        (root only), so the check needs no extra package.
        """
        addr = addr or self.peer_addr
        ping = shutil.which("ping")
        if ping:
            cp = self.run([ping, "-c", "1", "-W", str(max(1, int(timeout))), addr],
                          check=False, timeout=timeout + 5)
            return cp.returncode == 0, (cp.stdout + cp.stderr).strip()
        cp = self.run([sys.executable, "-c", _PY_PING, addr, str(timeout)],
                      check=False, timeout=timeout + 5)
        return cp.returncode == 0, (cp.stdout + cp.stderr).strip()

    def pids(self) -> list[int]:
        """Pids of all processes whose network namespace is this one."""
        cp = _ip("netns", "pids", self.name, check=False)
        return [int(x) for x in cp.stdout.split()] if cp.returncode == 0 else []

    def kill_all(self, grace: float = 2.0) -> None:
        """SIGTERM every process in the namespace, then SIGKILL what is left after ``grace`` s."""
        for p in self._popens:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        _signal_pids(self.pids(), signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not self.pids() and all(p.poll() is not None for p in self._popens):
                break
            time.sleep(0.02)
        _signal_pids(self.pids(), signal.SIGKILL)
        for p in self._popens:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        self._popens.clear()


_PY_PING = r"""
import os, socket, struct, sys, time
addr, timeout = sys.argv[1], float(sys.argv[2])
def csum(b):
    if len(b) % 2: b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b)); s = (s >> 16) + (s & 0xFFFF); s += s >> 16
    return ~s & 0xFFFF
ident, payload = os.getpid() & 0xFFFF, b"memsem-ping"
hdr = struct.pack("!BBHHH", 8, 0, 0, ident, 1)
pkt = struct.pack("!BBHHH", 8, 0, csum(hdr + payload), ident, 1) + payload
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(timeout)
t0 = time.perf_counter(); s.sendto(pkt, (addr, 0)); deadline = t0 + timeout
while True:
    data, src = s.recvfrom(2048); ihl = (data[0] & 0x0F) * 4
    typ, _, _, rid, _ = struct.unpack("!BBHHH", data[ihl:ihl + 8])
    if typ == 0 and rid == ident and src[0] == addr:
        print("reply from %s in %.1f us" % (addr, (time.perf_counter() - t0) * 1e6)); break
    if time.perf_counter() > deadline: sys.exit("timeout")
"""


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it dies (PR_SET_PDEATHSIG).

    Survives the exec of ``ip netns exec`` and of the command it runs, so a SIGKILLed test run
    leaves no server behind. Caveat: "parent" is the starting *thread*; start long-lived
    children from the main thread (pytest's), not from a short-lived worker thread.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _signal_pids(pids: Sequence[int], sig: int) -> None:
    me = os.getpid()
    for pid in pids:
        if pid != me:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _existing_netns() -> set[str]:
    cp = _ip("netns", "list", check=False)
    return {line.split()[0] for line in cp.stdout.splitlines() if line.strip()}


def _pick_subnet_octet(pid: int, n: int) -> int:
    """Third octet x of 10.201.x.0/24: 1..254, spread by pid and pair counter.

    The addresses only exist inside the two private namespaces, so a clash with the host or with
    another pair cannot break routing; distinct x just makes concurrent runs easy to tell apart.
    """
    return (pid * 7 + n) % 254 + 1


def probe() -> tuple[bool, str]:
    """Can this process create namespaces joined by veth? Returns (ok, reason); cached.

    Checks: effective uid 0, ``ip`` present, ``ip netns add`` allowed, veth creation allowed (the
    veth module may be missing in some kernels/containers). Everything it creates is removed.
    """
    global _probe_cache
    if _probe_cache is not None:
        return _probe_cache
    _probe_cache = _probe_uncached()
    return _probe_cache


def _probe_uncached() -> tuple[bool, str]:
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, f"network namespaces need root (euid={os.geteuid()}); run the tests as root"
    if _ip_binary() is None:
        return False, "iproute2 'ip' not found (apt-get install iproute2)"
    name_a = f"{PREFIX}-probe-{os.getpid()}-a"
    name_b = f"{PREFIX}-probe-{os.getpid()}-b"
    try:
        cp = _ip("netns", "add", name_a, check=False)
        if cp.returncode != 0:
            return False, f"'ip netns add' refused: {cp.stderr.strip() or cp.returncode}"
        cp = _ip("netns", "add", name_b, check=False)
        if cp.returncode != 0:
            return False, f"'ip netns add' refused: {cp.stderr.strip() or cp.returncode}"
        cp = _ip("link", "add", "veth0", "netns", name_a, "type", "veth",
                 "peer", "name", "veth0", "netns", name_b, check=False)
        if cp.returncode != 0:
            return False, f"veth pair creation refused: {cp.stderr.strip() or cp.returncode}"
        cp = _ip("netns", "exec", name_a, "ip", "link", "set", "lo", "up", check=False)
        if cp.returncode != 0:
            return False, f"'ip netns exec' failed: {cp.stderr.strip() or cp.returncode}"
        return True, "network namespaces and veth available"
    except (OSError, subprocess.SubprocessError, NetnsError) as e:
        return False, f"namespace probe failed: {e}"
    finally:
        for n in (name_a, name_b):
            _ip("netns", "del", n, check=False)


@contextlib.contextmanager
def veth_pair(prefix: str = PREFIX, subnet_octet: int | None = None,
              mtu: int | None = None) -> Iterator[tuple[Namespace, Namespace]]:
    """Create namespaces ``<prefix>-a-<pid>-<n>`` and ``<prefix>-b-<pid>-<n>`` joined by veth.

    Yields ``(a, b)``; a has 10.201.x.1, b has 10.201.x.2 (``subnet_octet`` = x, default derived
    from pid and a counter). ``lo`` is up in both. On exit -- normal or exception -- kills every
    process left in either namespace and deletes both (the veth pair goes with them).
    Raises NetnsError (with ip's stderr) when creation fails; whatever was created is removed.
    """
    n = next(_counter)
    pid = os.getpid()
    x = subnet_octet if subnet_octet is not None else _pick_subnet_octet(pid, n)
    if not 1 <= x <= 254:
        raise ValueError(f"subnet_octet must be in 1..254, got {x}")
    name_a, name_b = f"{prefix}-a-{pid}-{n}", f"{prefix}-b-{pid}-{n}"
    addr_a, addr_b = f"10.201.{x}.1", f"10.201.{x}.2"
    a = Namespace(name_a, addr_a, addr_b)
    b = Namespace(name_b, addr_b, addr_a)
    created: list[Namespace] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns.name)
            created.append(ns)
        _ip("link", "add", a.ifname, "netns", a.name, "type", "veth",
            "peer", "name", b.ifname, "netns", b.name)
        for ns in (a, b):
            _ip("-n", ns.name, "link", "set", "lo", "up")
            _ip("-n", ns.name, "addr", "add", f"{ns.addr}/{ns.prefixlen}", "dev", ns.ifname)
            if mtu is not None:
                _ip("-n", ns.name, "link", "set", ns.ifname, "mtu", str(mtu))
            _ip("-n", ns.name, "link", "set", ns.ifname, "up")
        _wait_link_up(a, b)
        yield a, b
    finally:
        _teardown(created)


def shape(ns_name: str, ifname: str, rate_mbit: float, burst_bytes: int | None = None,
          queue_ms: float = 50.0) -> None:
    """Rate-limit what ``ifname`` in namespace ``ns_name`` sends to ``rate_mbit`` Mbit/s with a
    token bucket (``tc qdisc replace ... root tbf``; this kernel has tbf, not netem).

    ``burst_bytes`` (default: 4 ms at the rate, at least 128 KiB) must hold the largest packet
    the interface hands the qdisc: veth passes GSO packets of up to 64 KiB, and tbf drops
    packets larger than its bucket. Packets wait at most ``queue_ms`` in the queue (tbf's
    ``latency``; beyond it they are dropped and TCP backs off): a bulk TCP stream keeps that
    queue nearly full, so every small message behind it on the same link waits about as long.
    Raises NetnsError (with tc's stderr) when tc refuses.
    """
    if not (isinstance(rate_mbit, (int, float)) and rate_mbit > 0):
        raise ValueError(f"rate_mbit must be a number > 0, got {rate_mbit!r}")
    burst = burst_bytes or max(128 << 10, int(rate_mbit * 1e6 / 8 * 0.004))
    tc = shutil.which("tc") or "/usr/sbin/tc"
    cmd = [tc, "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", f"{rate_mbit}mbit",
           "burst", str(burst), "latency", f"{queue_ms:g}ms"]
    cp = _ip("netns", "exec", ns_name, *cmd, check=False)
    if cp.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} in {ns_name} failed (rc={cp.returncode}): {cp.stderr.strip()}")


def tx_bytes(ns_name: str, ifname: str = "veth0") -> int:
    """Bytes ``ifname`` in namespace ``ns_name`` has sent (its kernel counter, headers included)."""
    cp = _ip("-n", ns_name, "-s", "-j", "link", "show", ifname)
    import json

    return int(json.loads(cp.stdout)[0]["stats64"]["tx"]["bytes"])


@contextlib.contextmanager
def star(n: int, prefix: str = PREFIX, *, rate_mbit: float | None = None,
         queue_ms: float = 50.0) -> Iterator[list[Namespace]]:
    """``n`` namespaces on one subnet, each joined by veth to a bridge in a hub namespace:
    ``<prefix>-s<i>-<pid>-<k>`` get 10.202.x.(i + 1)/24 (``addr``); every one reaches every
    other (``peer_addr`` is the first one's address). The hub (``<prefix>-h-<pid>-<k>``) holds
    only the bridge. On exit every process left in them is killed and all are deleted.

    ``rate_mbit``: shape every node's link to that rate in both directions (:func:`shape` on
    the node's ``veth0``, what it sends, and on its hub port, what it receives), like a switch
    with full-duplex ports of that speed.
    """
    if not 2 <= n <= 16:
        raise ValueError(f"n must be in 2..16, got {n}")
    k = next(_counter)
    pid = os.getpid()
    x = _pick_subnet_octet(pid, k)
    hub = Namespace(f"{prefix}-h-{pid}-{k}", "", "")
    leaves = [Namespace(f"{prefix}-s{i}-{pid}-{k}", f"10.202.{x}.{i + 1}", f"10.202.{x}.1") for i in range(n)]
    created: list[Namespace] = []
    try:
        for ns in [hub, *leaves]:
            _ip("netns", "add", ns.name)
            created.append(ns)
        _ip("-n", hub.name, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub.name, "link", "set", "br0", "up")
        for i, ns in enumerate(leaves):
            _ip("link", "add", f"p{i}", "netns", hub.name, "type", "veth", "peer", "name", ns.ifname,
                "netns", ns.name)
            _ip("-n", hub.name, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", hub.name, "link", "set", f"p{i}", "up")
            _ip("-n", ns.name, "link", "set", "lo", "up")
            _ip("-n", ns.name, "addr", "add", f"{ns.addr}/{ns.prefixlen}", "dev", ns.ifname)
            _ip("-n", ns.name, "link", "set", ns.ifname, "up")
            if rate_mbit is not None:
                shape(ns.name, ns.ifname, rate_mbit, queue_ms=queue_ms)
                shape(hub.name, f"p{i}", rate_mbit, queue_ms=queue_ms)
        _wait_link_up(*leaves)
        yield leaves
    finally:
        _teardown(created)


def _teardown(created: list[Namespace]) -> None:
    """Kill every process left in ``created`` and delete them (newest first); raises once,
    naming every namespace that could not be removed."""
    errors = []
    for ns in reversed(created):
        try:
            ns.kill_all()
        except Exception as e:  # keep tearing down the rest
            errors.append(f"{ns.name}: kill: {e}")
        cp = _ip("netns", "del", ns.name, check=False)
        if cp.returncode != 0 and ns.name in _existing_netns():
            errors.append(f"{ns.name}: del: {cp.stderr.strip()}")
    if errors:
        raise NetnsError("namespace teardown incomplete: " + "; ".join(errors))


def _wait_link_up(*nss: Namespace, timeout: float = 5.0) -> None:
    """Wait until veth0 reports operstate UP on every side (usually immediate)."""
    deadline = time.monotonic() + timeout
    for ns in nss:
        while True:
            cp = _ip("-n", ns.name, "-o", "link", "show", ns.ifname, check=False)
            if "state UP" in cp.stdout or "LOWER_UP" in cp.stdout:
                break
            if time.monotonic() > deadline:
                raise NetnsError(f"{ns.name}/{ns.ifname} did not come up: {cp.stdout.strip()}")
            time.sleep(0.01)


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a killed run's zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete ``<prefix>-*-<pid>-*`` namespaces whose creating pid is no longer alive.

    Call at session start: a test run killed with SIGKILL cannot run its teardown. Returns the
    names deleted. Namespaces of live processes (e.g. a parallel test run) are left alone.
    """
    removed = []
    for name in sorted(_existing_netns()):
        parts = name.split("-")
        if len(parts) < 4 or parts[0] != prefix:
            continue
        try:
            owner = int(parts[-2])
        except ValueError:
            continue
        if _pid_alive(owner):
            continue
        ns = Namespace(name, "", "")
        ns.kill_all(grace=1.0)
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed
