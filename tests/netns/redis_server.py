"""Start a real ``redis-server`` for a test, inside a network namespace or on loopback.

    from tests.netns.redis_server import redis_server

    with veth_pair() as (a, b):
        with redis_server(ns=a) as srv:      # listens on a.addr:6379 inside namespace a
            srv.url                          # "redis://10.201.x.1:6379/0"
            srv.ping()                       # True (over the unix socket, from any namespace)

    with redis_server() as srv:              # no namespace: 127.0.0.1, a free port
        ...

The server runs in the foreground (``--daemonize no``) as a direct child, with no persistence
(``--save '' --appendonly no``), its working dir and log in a private temp dir, and also a unix
socket in that dir. Unix sockets are filesystem objects, not per network namespace, so the parent
can PING the server (readiness) and shut it down from the root namespace without entering the
namespace. On exit: SHUTDOWN NOSAVE, then SIGTERM / SIGKILL if needed, remove the temp dir; no
process is left. If the test process itself is SIGKILLed, PR_SET_PDEATHSIG kills the server.

Needs the ``redis-server`` binary (``sh tests/netns/install_redis.sh``); :func:`find_redis_server`
returns its path or None.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = ["RedisServer", "RedisStartError", "redis_server", "find_redis_server", "free_port",
           "cleanup_stale_dirs"]


class RedisStartError(RuntimeError):
    """redis-server did not start or did not answer PING in time; carries the server log tail."""


def find_redis_server() -> str | None:
    """Path of the redis-server binary, or None (PATH, then /usr/bin, /usr/local/bin)."""
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.access(p, os.X_OK)),
        None,
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` in the current namespace a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: PR_SET_PDEATHSIG=SIGKILL (see netns._die_with_parent)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


@dataclass
class RedisServer:
    host: str
    port: int
    db: int
    unix_socket: str
    proc: subprocess.Popen
    logfile: str
    ns_name: str | None
    password: str | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/db`` -- the URL a client in a namespace that can reach
        ``host`` (the same namespace, or the peer across the veth) uses."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/{self.db}"

    @property
    def unix_url(self) -> str:
        """``unix://path?db=N`` -- reachable from any network namespace on this machine."""
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.unix_socket}?db={self.db}"

    def command(self, *args: str, timeout: float = 2.0) -> bytes:
        """Send one command over the unix socket (RESP, stdlib only); returns the raw reply."""
        payload = b"*%d\r\n" % len(args) + b"".join(
            b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(self.unix_socket)
            if self.password:
                auth = ("AUTH", self.password)
                s.sendall(b"*2\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in auth))
                if not s.recv(64).startswith(b"+OK"):
                    raise RedisStartError("AUTH rejected")
            s.sendall(payload)
            return s.recv(65536)

    def ping(self, timeout: float = 1.0) -> bool:
        try:
            return self.command("PING", timeout=timeout).startswith(b"+PONG")
        except OSError:
            return False

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.logfile, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        """SHUTDOWN NOSAVE over the unix socket (immediate; SIGTERM alone waits for redis's next
        100 ms cron tick), then SIGTERM, then SIGKILL, each after ``timeout``."""
        p = self.proc
        if p.poll() is None:
            with contextlib.suppress(OSError, RedisStartError):
                self.command("SHUTDOWN", "NOSAVE", timeout=timeout)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=timeout)
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(timeout=timeout)


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a killed run's zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


def cleanup_stale_dirs() -> list[str]:
    """Remove memsem-redis-<pid>-* temp dirs whose creating pid is gone (SIGKILLed runs)."""
    removed = []
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        parts = name.split("-")
        if name.startswith("memsem-redis-") and len(parts) >= 4 and parts[2].isdigit():
            if not _pid_alive(int(parts[2])):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
                removed.append(name)
    return removed


@contextlib.contextmanager
def redis_server(ns=None, host: str | None = None, port: int | None = None, *, db: int = 0,
                 password: str | None = None, timeout: float = 10.0,
                 extra_args: Sequence[str] = (), binary: str | None = None) -> Iterator[RedisServer]:
    """Run redis-server for the duration of the ``with`` block.

    ns:        a netns.Namespace (or a namespace name) to run in; None = current namespace.
    host:      bind address; default ``ns.addr`` for a Namespace, else 127.0.0.1.
    port:      default 6379 inside a namespace (private port space), else a free port.
    password:  sets ``requirepass`` (protected mode is off: the server is bound to a private
               address; set a password to exercise AUTH).
    timeout:   seconds to wait for PING; RedisStartError (with the log tail) after that.
    """
    binary = binary or find_redis_server()
    if binary is None:
        raise RedisStartError("redis-server not found; run: sh tests/netns/install_redis.sh")
    ns_name = None if ns is None else (ns if isinstance(ns, str) else ns.name)
    if host is None:
        host = getattr(ns, "addr", None) or "127.0.0.1"
    if port is None:
        port = 6379 if ns_name is not None else free_port(host)

    tmpdir = tempfile.mkdtemp(prefix=f"memsem-redis-{os.getpid()}-")
    sock_path = os.path.join(tmpdir, "redis.sock")
    logfile = os.path.join(tmpdir, "redis.log")
    argv = [
        binary,
        "--bind", host,
        "--port", str(port),
        "--unixsocket", sock_path,
        "--unixsocketperm", "700",
        "--daemonize", "no",
        "--supervised", "no",
        "--save", "",
        "--appendonly", "no",
        "--dir", tmpdir,
        "--logfile", "",          # log to stdout, redirected to logfile below
        "--protected-mode", "no",
        "--databases", str(max(16, db + 1)),
    ]
    if password:
        argv += ["--requirepass", password]
    argv += list(extra_args)
    if ns_name is not None:
        ip = shutil.which("ip") or "/usr/sbin/ip"
        argv = [ip, "netns", "exec", ns_name, *argv]

    log = open(logfile, "wb")
    # start_new_session: Ctrl-C at the terminal goes to pytest, which then stops the server cleanly.
    # `ip netns exec` execs redis-server in place, so proc.pid is redis-server's pid.
    # preexec_fn: the kernel SIGKILLs redis if this process dies without running the teardown.
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_die_with_parent)
    log.close()
    srv = RedisServer(host, port, db, sock_path, proc, logfile, ns_name, password)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RedisStartError(
                    f"redis-server exited with {proc.returncode} before answering PING "
                    f"({' '.join(argv)}):\n{srv.log_tail()}")
            if os.path.exists(sock_path) and srv.ping(timeout=0.5):
                break
            if time.monotonic() > deadline:
                raise RedisStartError(
                    f"redis-server did not answer PING within {timeout}s:\n{srv.log_tail()}")
            time.sleep(0.005)
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
