"""Process identity and liveness (pid plus start time, so a recycled pid is never mistaken)."""
from __future__ import annotations

import dataclasses
import os
import socket
from functools import lru_cache


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22); 0 when
    the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    if rest and rest[0] in (b"Z", b"X"):  # zombie or dead: not alive for our purposes
        return 0
    return int(rest[19])


def process_alive(pid: int, start_time: int) -> bool:
    """True when ``pid`` runs and is the same process that had ``start_time``."""
    if pid <= 0:
        return False
    st = process_start_time(pid)
    return st != 0 and (start_time == 0 or st == start_time)


@dataclasses.dataclass(frozen=True)
class ProcessIdentity:
    """A process as seen by a node: pid, start time (ticks) and node id."""

    pid: int
    start_time: int
    node: str

    @classmethod
    def current(cls) -> "ProcessIdentity":
        pid = os.getpid()
        return cls(pid, process_start_time(pid), node_id())

    def alive(self) -> bool:
        """Only meaningful on the same node."""
        return process_alive(self.pid, self.start_time)


@lru_cache(maxsize=1)
def _boot_node_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}-{boot}"


def node_id() -> str:
    """This process's node identity: ``MEMSEM_NODE_ID`` if set, else hostname plus boot id.

    Processes with different node ids never use shared memory or cross-memory attach with each
    other, even on one machine (tests use that to make two groups of processes act as two nodes).
    """
    return os.environ.get("MEMSEM_NODE_ID") or _boot_node_id()
