"""What a test run left behind: ``snapshot`` before the run, ``check`` after it.

    python tests/leftovers.py snapshot BEFORE.json
    python tests/leftovers.py check BEFORE.json [--tmp RUN_TMP]

``check`` lists, and exits 1 on, what appeared during the run and is still there:

* entries of the segment directory (``MEMSEM_SHM_DIR`` or ``/dev/shm``) named ``memsem.*``
  (segments, job folders) or ``memsem-*`` (the tests' private segment folders);
* mounts under ``RUN_TMP`` (the run's TMPDIR, so every pytest temporary directory of the run),
  and other new mounts with ``memsem`` in their path (pytest directories of other runs on the
  machine are theirs);
* network namespaces named ``memsem-*``.

Only the run's own leftovers count: an item whose creator (the pid in a segment or namespace
name, the ranks of a job folder) is alive in another session than this one belongs to someone
else on the machine and is reported as such, not failed. Standard library only (runs before any
venv exists).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

SEG = re.compile(r"^memsem\.(\d+)\.([a-z]+)\.(\d+)-(\d+)\.[0-9a-f]{32}$")
NETNS_PID = re.compile(r"^memsem-(?:[a-z]+-)?(?:[a-z]+-)?(\d+)(?:-|$)")


def segment_dir() -> str:
    return os.environ.get("MEMSEM_SHM_DIR", "/dev/shm")


def _segment_entries() -> list[str]:
    try:
        return sorted(n for n in os.listdir(segment_dir()) if n.startswith(("memsem.", "memsem-")))
    except OSError:
        return []


def _mounts() -> list[str]:
    try:
        with open("/proc/self/mounts") as f:
            return sorted({line.split()[1].replace("\\040", " ") for line in f})
    except OSError:
        return []


def _netns() -> list[str]:
    try:
        cp = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(line.split()[0] for line in cp.stdout.splitlines() if line.startswith("memsem-"))


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(b")") + 2:].split()
    if rest and rest[0] in (b"Z", b"X"):
        return None
    return [x.decode() for x in rest]


def _alive(pid: int, start: int = 0) -> bool:
    st = _stat(pid)
    return st is not None and (start == 0 or int(st[19]) == start)


def _foreign(pid: int, start: int = 0) -> bool:
    """Alive and in another session than this checker's: not this run's."""
    st = _stat(pid)
    if st is None or (start and int(st[19]) != start):
        return False
    return int(st[3]) != os.getsid(0)


def _job_folder_users(path: str) -> list[int]:
    pids = []
    try:
        names = os.listdir(path)
    except OSError:
        return pids
    for n in names:
        if n.startswith("r."):
            try:
                with open(os.path.join(path, n)) as f:
                    rec = json.load(f)
                pids.append(int(rec["pid"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return pids


def snapshot() -> dict[str, list[str]]:
    return {"segments": _segment_entries(), "mounts": _mounts(), "netns": _netns()}


def check(before: dict[str, list[str]], run_tmp: str | None) -> tuple[list[str], list[str]]:
    """``(leftovers, others)``: this run's leftovers, and new items of other sessions."""
    left: list[str] = []
    others: list[str] = []
    base = segment_dir()
    for name in sorted(set(_segment_entries()) - set(before["segments"])):
        path = os.path.join(base, name)
        m = SEG.match(name)
        if m is not None:
            pid, start = int(m.group(3)), int(m.group(4))
            if _foreign(pid, start):
                others.append(f"{path} (segment of pid {pid}, another session)")
                continue
            state = "alive: a process of this run is still running" if _alive(pid, start) else "creator dead"
            left.append(f"{path} ({m.group(2)} segment of pid {pid}, {state})")
            continue
        if ".dir." in name and os.path.isdir(path):
            users = [p for p in _job_folder_users(path) if _foreign(p)]
            if users:
                others.append(f"{path} (job folder used by pids {users}, another session)")
                continue
            left.append(f"{path} (job folder, {len(os.listdir(path))} entries)")
            continue
        left.append(f"{path} (test segment folder or file)")
    for mnt in sorted(set(_mounts()) - set(before["mounts"])):
        if run_tmp and (mnt == run_tmp or mnt.startswith(run_tmp.rstrip("/") + "/")):
            left.append(f"{mnt} (mount)")
        elif mnt.startswith("/run/netns/"):
            continue  # a named namespace's own mount: reported with the namespaces below
        elif "memsem" in mnt and not re.search(r"/pytest-of-[^/]+/", mnt):
            left.append(f"{mnt} (mount)")  # outside the run's TMPDIR, but memsem's by name
    for ns in sorted(set(_netns()) - set(before["netns"])):
        m = NETNS_PID.match(ns)
        if m is not None and _foreign(int(m.group(1))):
            others.append(f"netns {ns} (pid {m.group(1)}, another session)")
            continue
        left.append(f"netns {ns}")
    return left, others


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "snapshot":
        with open(argv[1], "w") as f:
            json.dump(snapshot(), f)
        return 0
    if len(argv) >= 2 and argv[0] == "check":
        with open(argv[1]) as f:
            before = json.load(f)
        run_tmp = argv[argv.index("--tmp") + 1] if "--tmp" in argv else None
        left, others = check(before, run_tmp)
        for item in others:
            print(f"not this run's: {item}")
        for item in left:
            print(f"LEFT BEHIND: {item}")
        print(f"{len(left)} item(s) left behind by this run" + (f", {len(others)} of other sessions" if others else ""))
        return 1 if left else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
