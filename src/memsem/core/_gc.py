"""Garbage collection of segments and directory entries left by dead processes.

Segment names carry their creator's pid and start time (``memsem.<uid>.<kind>.<pid>-<start>.<token>``),
so a segment whose creator is gone can be recognised without any registry; a recycled pid has a
different start time. ``collect`` runs at every Runtime start and from ``memsem gc``.

The segment directory (``/dev/shm``) is shared by every local user, so gc trusts nothing it finds
there: it never follows a symlink, never touches what another user owns, skips what it cannot
parse or remove, and reports each skipped item with the reason (``GcReport.skipped``). Nothing it
finds can make it raise: a Runtime start never fails because of a planted or corrupt file.

Inside a job folder of the ``local`` directory it removes, for dead owners on this node: rank
records (``r.``), window records (``w.``), the names they hold (``n.``: a name record names its
holder) or that point at them; names whose window record is gone and whose owner rank is dead
or gone (a death mid-republish); readers' acknowledgements (``k.`` entries ``loaded/...``) of
dead readers; temporary
records (``.tmp.<pid>-<start>.<token>``) of dead writers (a death between write and rename); and
then the folder itself when nothing is left in it.
"""
from __future__ import annotations

import logging
import os
import re
import stat
import time
from typing import Any

from memsem.directory.local import (
    TMP_PREFIX,
    check_folder,
    check_rank_record,
    check_window_record,
    parse_json_record,
    read_record,
)
from memsem.gva import split_gva
from memsem.native import node_id, process_alive, segment_dir, segment_prefix

log = logging.getLogger(__name__)

_NAME = re.compile(r"^memsem\.(\d+)\.([a-z]+)\.(\d+)-(\d+)\.[0-9a-f]{32}$")
_TMP = re.compile(r"^\.tmp\.(\d+)-(\d+)\.[0-9a-f]{16}$")
_LEGACY_TMP = re.compile(r"^\.tmp\.[0-9a-f]{16}$")
#: a temporary record of the old naming (no writer pid) older than this is a leftover (seconds)
LEGACY_TMP_AGE_S = 600.0
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class GcReport(list):
    """What ``collect`` removed (or would remove): a list of ``(path, reason)``.

    Attributes:
        skipped: ``(path, reason)`` of every item gc left alone because it could not parse,
            trust or remove it (another user's file, a symlink, a corrupt record, EPERM...).
    """

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[tuple[str, str]] = []


def collect(*, dry_run: bool = False) -> GcReport:
    """Remove (or with ``dry_run`` only list) this user's memsem segments whose creator is dead,
    and leftovers of dead processes in local job folders (see the module docstring).

    Never raises for anything found in the segment directory.

    Returns:
        A :class:`GcReport`: ``(path, reason)`` for every removed (or removable) item, with
        ``skipped`` listing what was left alone and why.
    """
    out = GcReport()
    base = segment_dir()
    prefix = segment_prefix()
    try:
        dfd = os.open(base, _O_DIR)
    except OSError as exc:
        out.skipped.append((base, f"cannot open the segment directory: {exc.strerror}"))
        return out
    try:
        try:
            names = os.listdir(dfd)
        except OSError as exc:
            out.skipped.append((base, f"cannot list the segment directory: {exc.strerror}"))
            return out
        uid = os.getuid()
        for name in names:
            if not name.startswith(prefix):
                continue
            path = os.path.join(base, name)
            try:
                _collect_entry(dfd, base, name, path, uid, dry_run, out)
            except Exception as exc:  # never fail a Runtime start over one entry
                out.skipped.append((path, f"unexpected {type(exc).__name__}: {exc}"))
    finally:
        os.close(dfd)
    for path, why in out.skipped:
        log.debug("gc skipped %s: %s", path, why)
    return out


def _collect_entry(dfd: int, base: str, name: str, path: str, uid: int, dry_run: bool, out: GcReport) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        out.skipped.append((path, "a symlink; never followed"))
        return
    if st.st_uid != uid:
        out.skipped.append((path, f"owned by uid {st.st_uid}, not by this user ({uid})"))
        return
    m = _NAME.match(name)
    if m is None:
        if ".dir." in name and stat.S_ISDIR(st.st_mode):
            _collect_dir(dfd, name, path, dry_run, out)
        else:
            out.skipped.append((path, "not a memsem segment name"))
        return
    if not stat.S_ISREG(st.st_mode):
        out.skipped.append((path, "not a regular file"))
        return
    pid, start = int(m.group(3)), int(m.group(4))
    if process_alive(pid, start):
        return
    _remove(dfd, name, path, f"{m.group(2)} segment of dead process {pid} (start {start})", dry_run, out)


def _remove(dfd: int, name: str, path: str, why: str, dry_run: bool, out: GcReport) -> None:
    if dry_run:
        out.append((path, why))
        return
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        return  # someone else removed it: fine
    except OSError as exc:
        out.skipped.append((path, f"{why}, but cannot remove it: {exc.strerror}"))
        return
    out.append((path, why))


def _collect_dir(parent: int, dname: str, path: str, dry_run: bool, out: GcReport) -> None:
    try:
        fd = os.open(dname, _O_DIR, dir_fd=parent)
    except OSError as exc:
        out.skipped.append((path, f"cannot open the job folder: {exc.strerror}"))
        return
    try:
        try:
            check_folder(fd, path)
        except PermissionError as exc:
            out.skipped.append((path, str(exc)))
            return
        try:
            files = os.listdir(fd)
        except OSError as exc:
            out.skipped.append((path, f"cannot list the job folder: {exc.strerror}"))
            return
        _collect_records(fd, path, files, dry_run, out)
        if not dry_run:
            try:
                os.rmdir(dname, dir_fd=parent)  # a job folder nobody uses any more (fails while not empty)
            except OSError:
                pass
            else:
                out.append((path, "empty job folder"))
        elif not _remaining(fd, files, out, path):
            out.append((path, "empty job folder"))
    finally:
        os.close(fd)


#: file names of readers' acknowledgements (``memsem.sync._acks``: entries ``loaded/...``)
_ACK_PREFIX = "k." + b"loaded/".hex()


def _ack_leftover(fd: int, f: str, me: str, skip: Any, removals: list[tuple[str, str]]) -> None:
    """A reader's acknowledgement of a dead process of this node is removed."""
    try:
        text = read_record(fd, f, max_bytes=4096)
        if text is None:
            return
        rec = parse_json_record(text, f)
        pid, start = rec.get("pid"), rec.get("start")
    except (OSError, ValueError, AttributeError) as exc:
        skip(f, f"unparseable acknowledgement ({exc})")
        return
    if rec.get("node") == me and isinstance(pid, int) and isinstance(start, int) and not process_alive(pid, start):
        removals.append((f, f"acknowledgement of reader {rec.get('reader')!r} of dead process {pid}"))


def _remaining(fd: int, files: list[str], out: GcReport, path: str) -> bool:
    """(dry run) Whether the folder would keep any file after the removals listed in ``out``."""
    gone = {p for p, _ in out}
    return any(os.path.join(path, f) not in gone for f in files)


def _collect_records(fd: int, path: str, files: list[str], dry_run: bool, out: GcReport) -> None:
    me = node_id()
    removals: list[tuple[str, str]] = []
    live_ranks: set[int] = set()   # ranks whose owner lives (or lives on another node)
    dead_ranks: set[int] = set()
    windows: dict[int, str] = {}    # gva -> file name of window records that stay
    names: list[tuple[str, int]] = []
    dead_windows: dict[int, int] = {}  # gva -> owner pid of window records removed now

    def skip(f: str, why: str) -> None:
        out.skipped.append((os.path.join(path, f), why))

    for f in files:
        if not f.startswith("r."):
            continue
        if not f[2:].isdigit():
            skip(f, "not a rank record name")
            continue
        try:
            text = read_record(fd, f)
            if text is None:
                continue
            rec = check_rank_record(parse_json_record(text, f), f)
        except (OSError, ValueError) as exc:
            skip(f, f"unparseable rank record ({exc})")
            live_ranks.add(int(f[2:]))  # unknown owner: keep what may be its
            continue
        if rec.get("node", me) == me and not process_alive(rec["pid"], rec.get("start", 0)):
            dead_ranks.add(int(f[2:]))
            removals.append((f, f"rank {f[2:]} of dead process {rec['pid']}"))
        else:
            live_ranks.add(int(f[2:]))
    for f in files:
        if f.startswith("w."):
            try:
                gva = int(f[2:], 16)
                text = read_record(fd, f)
                if text is None:
                    continue
                rec = check_window_record(parse_json_record(text, f), f)
            except (OSError, ValueError) as exc:
                skip(f, f"unparseable window record ({exc})")
                continue
            if rec.get("node") == me and not process_alive(rec["owner_pid"], rec["owner_start"]):
                removals.append((f, f"window {rec.get('name') or f[2:]} of dead process {rec['owner_pid']}"))
                dead_windows[gva] = rec["owner_pid"]
            else:
                windows[gva] = f
        elif f.startswith("n."):
            try:
                text = read_record(fd, f, max_bytes=4096)
                if text is None:
                    continue
                if text.lstrip().startswith("{"):  # name, gva and holder (pid, start, node, rank)
                    rec = parse_json_record(text, f)
                    gva = int(rec["gva"], 16)
                    pid, start = rec.get("pid"), rec.get("start")
                    if rec.get("node") == me and isinstance(pid, int) and isinstance(start, int) \
                            and not process_alive(pid, start):
                        removals.append((f, f"name {rec.get('name')!r} held by dead process {pid}"))
                        continue
                    names.append((f, gva))
                else:
                    names.append((f, int(text.strip(), 16)))  # a record of an older memsem: the gva
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                skip(f, f"unparseable name record ({exc})")
        elif f.startswith(_ACK_PREFIX):
            _ack_leftover(fd, f, me, skip, removals)
        elif f.startswith(TMP_PREFIX):
            _tmp_leftover(fd, f, skip, removals)
        elif not f.startswith(("r.", "k.")):
            skip(f, "not a directory record")
    for f, gva in names:
        # A name is left over when the window it points at is gone (or goes now) and the rank
        # owning that GVA is dead or gone: a live owner may be between its two writes.
        if gva in windows:
            continue
        if gva in dead_windows:
            removals.append((f, f"name of window gva {gva:#x} of dead process {dead_windows[gva]}"))
            continue
        rank, _ = split_gva(gva)
        if rank in live_ranks:
            continue
        removals.append((f, f"name of window gva {gva:#x}, whose record and owner (rank {rank}) are gone"))
    for f, why in removals:
        _remove(fd, f, os.path.join(path, f), why, dry_run, out)


def _tmp_leftover(fd: int, f: str, skip, removals: list[tuple[str, str]]) -> None:
    m = _TMP.match(f)
    if m is not None:
        pid, start = int(m.group(1)), int(m.group(2))
        if not process_alive(pid, start):
            removals.append((f, f"temporary record of dead writer {pid} (start {start})"))
        return
    if _LEGACY_TMP.match(f):
        try:
            age = time.time() - os.stat(f, dir_fd=fd, follow_symlinks=False).st_mtime
        except OSError:
            return
        if age > LEGACY_TMP_AGE_S:
            removals.append((f, f"temporary record left {age:.0f} s ago (writer unknown)"))
        return
    skip(f, "not a memsem temporary record name")
