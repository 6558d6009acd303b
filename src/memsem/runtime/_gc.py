"""Garbage collection of segments and directory entries left by dead processes.

Segment names carry their creator's pid and start time (``memsem.<uid>.<kind>.<pid>-<start>.<token>``),
so a segment whose creator is gone can be recognised without any registry; a recycled pid has a
different start time. ``collect`` runs at every Runtime start and from ``memsem gc``.
"""
from __future__ import annotations

import os
import re

from memsem.native import process_alive, segment_dir, segment_prefix

_NAME = re.compile(r"^memsem\.(\d+)\.([a-z]+)\.(\d+)-(\d+)\.[0-9a-f]{32}$")


def collect(*, dry_run: bool = False) -> list[tuple[str, str]]:
    """Remove (or with ``dry_run`` only list) this user's memsem segments whose creator is dead,
    and rank/window records of dead owners in local directories.

    Returns:
        ``(path, reason)`` for every removed (or removable) item.
    """
    out: list[tuple[str, str]] = []
    base = segment_dir()
    prefix = segment_prefix()
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(base, name)
        m = _NAME.match(name)
        if m is None:
            if ".dir." in name and os.path.isdir(path):
                out += _collect_dir(path, dry_run)
            continue
        pid, start = int(m.group(3)), int(m.group(4))
        if process_alive(pid, start):
            continue
        out.append((path, f"{m.group(2)} segment of dead process {pid} (start {start})"))
        if not dry_run:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return out


def _collect_dir(path: str, dry_run: bool) -> list[tuple[str, str]]:
    import json

    from memsem.native import node_id

    out = []
    try:
        files = os.listdir(path)
    except OSError:
        return out
    dead_ranks = set()
    for f in files:
        if f.startswith("r."):
            try:
                with open(os.path.join(path, f)) as fh:
                    rec = json.load(fh)
            except (OSError, ValueError):
                continue
            if rec.get("node", node_id()) == node_id() and not process_alive(int(rec.get("pid", 0)), int(rec.get("start", 0))):
                dead_ranks.add(int(f[2:]))
                out.append((os.path.join(path, f), f"rank {f[2:]} of dead process {rec.get('pid')}"))
    for f in files:
        if f.startswith("w."):
            try:
                with open(os.path.join(path, f)) as fh:
                    rec = json.load(fh)
            except (OSError, ValueError):
                continue
            if rec.get("node") == node_id() and not process_alive(int(rec.get("owner_pid", 0)), int(rec.get("owner_start", 0))):
                out.append((os.path.join(path, f), f"window {rec.get('name') or f[2:]} of dead process {rec.get('owner_pid')}"))
                if rec.get("name"):
                    # Only if the name still points at this dead window: a live process may have
                    # published the same name since.
                    n = os.path.join(path, "n." + rec["name"].encode().hex())
                    try:
                        with open(n) as fh:
                            target = int(fh.read().strip() or "-1", 16)
                    except (OSError, ValueError):
                        target = -1
                    if target == int(rec.get("gva", -2)):
                        out.append((n, f"name {rec['name']!r} of a window of dead process {rec.get('owner_pid')}"))
    if not dry_run:
        for p, _ in out:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(path)  # a job folder nobody uses any more (fails while not empty)
        except OSError:
            pass
    return out
