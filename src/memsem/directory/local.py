"""The ``local`` directory: files in a 0700 folder next to the segments, one machine, no server.

Layout of ``<segment dir>/memsem.<uid>.dir.<job>/``: ``r.<rank>`` (rank records), ``w.<gva hex>``
(window records), ``n.<sha256 hex of name>`` (name records: the name, the gva of its window and
its holder: pid, start time, node, rank), ``k.<hex of key>`` (engine entries). The job
namespaces everything (:func:`default_job` says how one is chosen).

**Names have one owner.** A name record is claimed (``claim_name``) under an exclusive
``flock`` of the job folder, held across a few local system calls: a name held by a live holder
(its process alive and its rank record still its own) is refused (the holder is returned) unless
the claim replaces it explicitly; a dead holder's name is taken over. A window's removal drops
its name only while the name still points at it (under the same lock), so a replaced owner
that exits never removes its successor's name.

Named windows' records also hold their access key (field ``access_key``), so any process of
the job can look a window up by name (``Runtime.lookup``): the job's trust domain is this
user's processes that name the job (the folder is 0700, its files 0600; docs/threat-model.md).
With a job secret (``MEMSEM_JOB_SECRET``) the key is sealed for holders of the secret (XOR with
an HMAC-derived pad bound to the record's name), so a process of this user that was not handed
the secret cannot read it from the file. ``get_window`` and ``windows`` never return the field.

Safety (the segment directory, ``/dev/shm``, is writable by every local user):

* The job folder is opened once, with ``O_NOFOLLOW | O_DIRECTORY``, and checked through that
  descriptor (``fstat``): it must be a directory owned by this user with mode 0700, else
  :class:`memsem.AccessDeniedError` names the path. Every later file operation is relative to
  the descriptor (``dir_fd``), so the folder cannot be swapped for a symlink after the check.
  Files inside are opened with ``O_NOFOLLOW``.
* Every record is written to ``.tmp.<pid>-<start>.<token>`` and then renamed (rank claims are
  hard links, which fail if the rank is taken), so readers never see a torn record; a temporary
  file whose writer died between write and rename is recognised by its name and removed by gc.
* Records that do not parse, or hold fields of the wrong types, are skipped by the listings
  (``windows()``, ``ranks()``) and never stop a runtime from starting; ``get_window`` of such a
  record raises ValueError naming the file.

Waiting for entries (``watch_entries``): inotify on the job folder, through ``inotify_simple``
(a thin ctypes wrapper of ``inotify_init1`` / ``inotify_add_watch``). Every record lands by a
rename, so a watch asks for ``IN_MOVED_TO`` and wakes only for names of entries under its
prefix (``k.<hex of key>``: the hex of a prefix is a prefix of the hex of its keys). The
folder is watched through ``/proc/self/fd/<folder descriptor>``, i.e. the folder this
directory opened and checked, never a path that could have been swapped since. inotify was
chosen over a futex word in a shared segment because it needs no file of its own in the job
folder (whose removal at the last close stays as it is) and no shared state another process
could corrupt. Where inotify cannot be had (``inotify_simple`` missing, the per-user instance
limit ``fs.inotify.max_user_instances`` reached, the folder removed under the watch) a watch
falls back to ``EntryWatch``'s short sleeps: slower, never wrong, since waiters re-read the
directory after every wait.

One module, over 600 lines, because it is one backend of the Directory interface (records, name
claims, leases' files, entry watches over inotify), each method a few system calls.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import secrets
import select
import stat
import time
from typing import Any, Callable

from memsem import _args
from memsem._errors import AccessDeniedError
from memsem.directory._base import Directory, EntryWatch, check_entry_key, secret_keys, seal_key, unseal_key
from memsem.native import process_start_time, segment_dir

log = logging.getLogger(__name__)

_MAX_RANKS = 1 << 16
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
#: the largest record the directory reads (bytes): a bigger file is not a memsem record
MAX_RECORD_BYTES = 1 << 20
#: prefix of temporary record files: ``.tmp.<pid>-<start time>.<token>``
TMP_PREFIX = ".tmp."

_start_times: dict[int, int] = {}


def tmp_name() -> str:
    """A fresh temporary file name carrying this process's pid and start time (for gc)."""
    pid = os.getpid()
    start = _start_times.get(pid)
    if start is None:
        start = _start_times[pid] = process_start_time(pid)
    return f"{TMP_PREFIX}{pid}-{start}.{secrets.token_hex(8)}"


#: launchers' run ids a default job is derived from, in order (environment variable, prefix):
#: every process of one launch has the same one, on every node; two launches differ
RUN_ID_VARS = (("TORCHELASTIC_RUN_ID", "torchrun"), ("SLURM_JOB_ID", "slurm"))
_JOB_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def default_job() -> str:
    """The job a runtime joins when none is named: ``MEMSEM_JOB`` when set (an explicit, shared
    job: set the same value in every process of a job that is started by separate commands, or
    spans nodes); else the run id of the launcher that started this process (torchrun's
    ``TORCHELASTIC_RUN_ID``, Slurm's ``SLURM_JOB_ID``); else this process group's (``pg<pgid>``):
    the processes one command starts (a script, its ``multiprocessing`` children, a shell
    pipeline) share it, and two runs started separately never meet by accident.

    A process started in a new session (``start_new_session=True``, ``setsid``) is in another
    process group: hand it the job explicitly (``MEMSEM_JOB`` in its environment or ``job=``).
    """
    job = os.environ.get("MEMSEM_JOB")
    if job:
        return job
    for var, prefix in RUN_ID_VARS:
        run = os.environ.get(var, "")
        if run and run != "none":  # torchrun's static rendezvous says "none": not a run id
            return f"{prefix}-{_JOB_CHARS.sub('_', run)[:64]}"
    return f"pg{os.getpgrp()}"


def job_is_derived(job: str) -> bool:
    """Whether ``job`` is the derived default (no ``MEMSEM_JOB`` / ``job=`` named it)."""
    return not os.environ.get("MEMSEM_JOB") and job == default_job()


def name_file(name: str) -> str:
    """The record file of window name ``name`` (``n.`` and the sha256 hex of its UTF-8 bytes:
    every name ``memsem._args.window_name`` accepts has a file name of 66 characters)."""
    return "n." + hashlib.sha256(name.encode()).hexdigest()


def holder_of(record: dict[str, Any]) -> dict[str, Any]:
    """The holder fields of a window record (its owner): pid, start, node, rank."""
    return {"pid": record.get("owner_pid", record.get("pid")), "start": record.get("owner_start", record.get("start")),
            "node": record.get("node", ""), "rank": record.get("rank")}


def same_holder(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("pid", "start", "node", "rank"))


class DirectoryBusy(Exception):
    """The job folder's lock is held by another process right now (for a moment: a claim or a
    removal of a name): the caller's wait pauses and tries again."""


def job_folder_name(job: str, uid: int | None = None) -> str:
    return f"memsem.{os.getuid() if uid is None else uid}.dir.{job}"


def check_folder(fd: int, path: str) -> None:
    """Refuse a job folder (open as ``fd``) that is not a directory owned by this user with mode
    0700. Raises :class:`memsem.AccessDeniedError` naming ``path``."""
    st = os.fstat(fd)
    uid = os.getuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700:
        raise AccessDeniedError(
            f"directory {path} must be a folder owned by uid {uid} with mode 0700; found "
            f"{'a folder' if stat.S_ISDIR(st.st_mode) else 'no folder'} of uid {st.st_uid} mode "
            f"{oct(stat.S_IMODE(st.st_mode))}: another user may have planted it; remove it (as "
            "root or its owner) or use another MEMSEM_JOB")


#: how many times ``open_folder`` makes a job folder removed under it again
OPEN_TRIES = 100


def open_folder(path: str, *, create: bool) -> int:
    """Open (creating it when ``create``) the job folder at ``path`` without following a symlink,
    and check it (:func:`check_folder`). Returns the directory descriptor.

    Another runtime of the job that closes may remove the empty folder between this mkdir and
    this open (it found no rank, window or entry in it): then it is made again, up to
    ``OPEN_TRIES`` times (a loaded CI machine met that order once).

    Raises:
        AccessDeniedError: ``path`` is a symlink or not a folder of this user with mode 0700.
        FileNotFoundError: ``path`` does not exist and ``create`` is False, or it was removed
            ``OPEN_TRIES`` times in a row as it was made.
    """
    for tries in range(1, OPEN_TRIES + 1):
        if create:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
        try:
            fd = _open_dir(path)
        except FileNotFoundError:
            if not create or tries == OPEN_TRIES:
                raise
            continue
        break
    try:
        check_folder(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(path: str) -> int:
    """``os.open`` of the job folder, without following a symlink; errors named."""
    try:
        return os.open(path, _O_DIR)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symlink" if os.path.islink(path) else "not a folder"
            raise AccessDeniedError(f"directory {path} is {kind}; memsem never follows it (another "
                                    "user may have planted it): remove it or use another MEMSEM_JOB") from None
        if exc.errno == errno.EACCES:
            try:
                st = os.lstat(path)
                found = f"uid {st.st_uid} mode {oct(stat.S_IMODE(st.st_mode))}"
            except OSError:
                found = "it cannot even be inspected"
            raise AccessDeniedError(f"directory {path} must be a folder owned by uid {os.getuid()} with "
                                    f"mode 0700; found {found}: another user may have planted it; remove "
                                    "it (as root or its owner) or use another MEMSEM_JOB") from None
        raise


def read_record(fd: int, name: str, max_bytes: int = MAX_RECORD_BYTES) -> str | None:
    """Text of regular file ``name`` in folder ``fd`` (not following symlinks); None when absent.

    Raises:
        ValueError: ``name`` is a symlink, not a regular file, larger than ``max_bytes`` or not
            UTF-8 (the message names it).
    """
    try:
        f = os.open(name, _O_READ, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"record {name} is a symlink; not followed") from None
        raise
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"record {name} is not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"record {name} has {st.st_size} bytes; a record has at most {max_bytes}")
        chunks, left = [], st.st_size + 1  # +1: see a file that grew since fstat
        while left > 0:
            chunk = os.read(f, min(left, max_bytes + 1))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise ValueError(f"record {name} has more than {max_bytes} bytes")
    finally:
        os.close(f)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ValueError(f"record {name} is not UTF-8 text") from None


_RAW_DECODE = json.JSONDecoder().raw_decode


def parse_json_record(text: str, name: str) -> dict[str, Any]:
    """A JSON object, else ValueError naming the record."""
    t = text.strip(" \t\n\r")  # JSON's whitespace, as json.loads skips it
    try:
        rec, end = _RAW_DECODE(t)
    except ValueError:
        raise ValueError(f"record {name} is not valid JSON") from None
    if end != len(t):
        raise ValueError(f"record {name} is not valid JSON (data after the object)")
    if not isinstance(rec, dict):
        raise ValueError(f"record {name} is JSON {type(rec).__name__}, not an object")
    return rec


def _int_field(rec: dict[str, Any], field: str, name: str, default: Any = ...) -> int:
    v = rec.get(field, default)
    if v is ... or isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"record {name} field {field!r} must be an int, got {v!r:.40}")
    return v


def check_rank_record(rec: dict[str, Any], name: str) -> dict[str, Any]:
    """A rank record has int ``pid`` and ``start`` and a str ``node``; ValueError otherwise."""
    _int_field(rec, "pid", name)
    _int_field(rec, "start", name, 0)
    if not isinstance(rec.get("node", ""), str):
        raise ValueError(f"record {name} field 'node' must be a str")
    return rec


def check_window_record(rec: dict[str, Any], name: str) -> dict[str, Any]:
    """The fields of a window record the directory and gc read themselves (the GVA layer checks
    the rest): int ``gva``, ``rank``, ``owner_pid``, ``owner_start``; str ``name``, ``node``."""
    for field in ("gva", "rank", "owner_pid", "owner_start"):
        if rec.get(field).__class__ is not int:  # JSON gives exact ints (and bools apart)
            _int_field(rec, field, name)  # raises, naming the field
    for field in ("name", "node"):
        if not isinstance(rec.get(field, ""), str):
            raise ValueError(f"record {name} field {field!r} must be a str")
    return rec


class LocalDirectory(Directory):
    """Directory of one machine.

    Args:
        job: namespace; default :func:`default_job` (``MEMSEM_JOB``, a launcher's run id, else
            this process group).
        alive: ``alive(record) -> bool`` used to reap rank records of dead owners.

    Raises:
        ValueError: ``job`` is not alphanumeric (with ``-``/``_``).
        AccessDeniedError: the job folder is a symlink, not a folder, not owned by this user or
            not mode 0700 (the message names the path).
    """

    def __init__(self, job: str | None = None, *, alive: Callable[[dict[str, Any]], bool]) -> None:
        self.job = job or default_job()
        if not isinstance(self.job, str) or not self.job.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"job must be alphanumeric (with - or _), got {self.job!r}")
        self.path = os.path.join(segment_dir(), job_folder_name(self.job))
        self.url = f"local://{self.path}"
        self._alive = alive
        _, self._seal_key = secret_keys(os.environ.get("MEMSEM_JOB_SECRET") or None)
        self._fd: int | None = open_folder(self.path, create=True)

    #: named windows' keys are kept for the job's members (see the module docstring)
    seals_keys = True

    # -- files ----------------------------------------------------------------------------------
    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"directory {self.path} is closed")
        return self._fd

    def _reopen(self) -> None:
        """The folder was removed (an empty job folder is removed by close/gc) between our open
        and our rank claim: open (create) it again."""
        old, self._fd = self._fd, None
        if old is not None:
            os.close(old)
        self._fd = open_folder(self.path, create=True)

    def _write_tmp(self, data: dict[str, Any] | str) -> str:
        tmp = tmp_name()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.fd)
        with os.fdopen(fd, "w") as f:
            f.write(data if isinstance(data, str) else json.dumps(data))
        return tmp

    def _write(self, fname: str, data: dict[str, Any] | str) -> None:
        tmp = self._write_tmp(data)
        try:
            os.replace(tmp, fname, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self._unlink(tmp)
            raise

    def _read(self, fname: str) -> str | None:
        return read_record(self.fd, fname)

    def _unlink(self, fname: str) -> None:
        try:
            os.unlink(fname, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def _list(self) -> list[str]:
        return os.listdir(self.fd)

    # -- ranks ----------------------------------------------------------------------------------
    def claim_rank(self, record: dict[str, Any]) -> int:
        payload = json.dumps(record)
        for attempt in range(3):
            try:
                return self._claim_rank(payload)
            except FileNotFoundError:
                self._reopen()
        return self._claim_rank(payload)

    def _claim_rank(self, payload: str) -> int:
        # The record is written whole to a temporary file and hard-linked to r.<rank>: the link
        # fails if the rank is taken, and a reader never sees a half-written rank record.
        tmp = self._write_tmp(payload)
        try:
            for rank in range(_MAX_RANKS):
                fname = f"r.{rank}"
                try:
                    os.link(tmp, fname, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
                    return rank
                except FileExistsError:
                    pass
                old = self.rank_record(rank)
                if old is not None and not self._alive(old):
                    self._reap_rank(rank, old)
                    try:
                        os.link(tmp, fname, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
                        return rank
                    except FileExistsError:
                        continue
            raise RuntimeError(f"no free rank in {self.path}")
        finally:
            self._unlink(tmp)

    def _reap_rank(self, rank: int, record: dict[str, Any]) -> None:
        for w in self.windows():
            if w.get("rank") == rank:
                self.remove_window(int(w["gva"]), str(w.get("name", "")))
        self._unlink(f"r.{rank}")

    def release_rank(self, rank: int) -> None:
        self._unlink(f"r.{rank}")

    def rank_record(self, rank: int) -> dict[str, Any] | None:
        """The record of ``rank``; None when no runtime holds it or when the file is not a valid
        rank record (a corrupt or planted file is never taken for a dead owner to reap)."""
        name = f"r.{rank}"
        try:
            text = self._read(name)
            if not text:
                return None
            return check_rank_record(parse_json_record(text, name), name)
        except ValueError:
            return None

    def ranks(self) -> dict[int, dict[str, Any]]:
        out = {}
        for f in self._list():
            if f.startswith("r.") and f[2:].isdigit():
                rec = self.rank_record(int(f[2:]))
                if rec is not None:
                    out[int(f[2:])] = rec
        return out

    # -- windows --------------------------------------------------------------------------------
    def put_window(self, gva: int, name: str, record: dict[str, Any], key: bytes | None = None) -> None:
        fname = f"w.{gva:016x}"
        if key is not None:
            sealed = seal_key(self._seal_key, fname, key) if self._seal_key is not None else None
            record = dict(record, access_key={"sealed": sealed} if sealed else {"plain": key.hex()})
        self._write(fname, record)
        if name:
            self._write(name_file(name), self._name_payload(name, gva, holder_of(record)))

    def remove_window(self, gva: int, name: str, *, pause: Callable[[], None] | None = None) -> None:
        """Remove window ``gva``'s record, and ``name``'s record while it still points at ``gva``
        (under the folder's lock: a successor's name is never removed). ``pause``: called while
        the lock is held by another process (the caller's wait); without it a busy lock leaves
        the name record, which a claim takes over once its holder is gone (and gc removes)."""
        self._unlink(f"w.{gva:016x}")  # first: a lookup meanwhile finds no window, never a retired one
        if name:
            try:
                self._locked(lambda: self._drop_name(name, gva), pause)
            except DirectoryBusy:
                pass

    # -- names ------------------------------------------------------------------------------------
    @staticmethod
    def _name_payload(name: str, gva: int, holder: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "gva": f"{gva:016x}", "pid": holder.get("pid"), "start": holder.get("start"),
                "node": holder.get("node", ""), "rank": holder.get("rank")}

    def _locked(self, fn: Callable[[], Any], pause: Callable[[], None] | None) -> Any:
        """``fn()`` under an exclusive flock of the job folder (held across a few local system
        calls). While another process holds it: ``pause()`` and try again (it raises at its
        deadline), or without ``pause`` raise :class:`DirectoryBusy`."""
        fd = self.fd
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if pause is None:
                    raise DirectoryBusy(self.path) from None
                pause()
        try:
            return fn()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def name_record(self, name: str) -> dict[str, Any] | None:
        """The record of ``name`` (``name``, ``gva`` hex, holder ``pid``/``start``/``node``/``rank``),
        or None when no record (or an unparseable one) holds it."""
        fname = name_file(name)
        try:
            text = self._read(fname)
            if not text:
                return None
            rec = parse_json_record(text, fname)
            if rec.get("name") != name or not isinstance(rec.get("gva"), str):
                return None
            int(rec["gva"], 16)
        except ValueError:
            return None
        return rec

    def _holder_alive(self, rec: dict[str, Any]) -> bool:
        """The holder of a name record is alive and its runtime open (its rank record is its own)."""
        if not self._alive({"pid": rec.get("pid"), "start": rec.get("start"), "node": rec.get("node")}):
            return False
        rank = rec.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool):
            return True  # a record without a rank: the process decides
        r = self.rank_record(rank)
        return r is not None and r.get("pid") == rec.get("pid") and int(r.get("start", 0)) == int(rec.get("start") or 0)

    def claim_name(self, name: str, gva: int, holder: dict[str, Any], *, replace: bool = False,
                   pause: Callable[[], None] | None = None) -> dict[str, Any] | None:
        """Bind ``name`` to window ``gva`` of ``holder`` (``pid``, ``start``, ``node``, ``rank``):
        when no record holds it, ``holder`` itself does, its holder is dead (or its runtime
        closed), or ``replace``. Returns None when bound, else the live holder's record (nothing
        changed). ``pause``: see ``remove_window``."""
        def claim() -> dict[str, Any] | None:
            cur = self.name_record(name)
            if cur is not None and not replace and not same_holder(cur, holder) and self._holder_alive(cur):
                return cur
            self._write(name_file(name), self._name_payload(name, gva, holder))
            return None

        return self._locked(claim, pause)

    def _drop_name(self, name: str, gva: int) -> None:
        cur = self.name_record(name)
        if cur is not None and int(cur["gva"], 16) == gva:
            self._unlink(name_file(name))

    def get_window(self, gva: int) -> dict[str, Any] | None:
        """The record of window ``gva`` or None.

        Raises:
            ValueError: the record file exists but is not a valid record (names the file).
        """
        rec = self._window_record(gva)
        if rec is not None:
            rec.pop("access_key", None)
        return rec

    def _window_record(self, gva: int) -> dict[str, Any] | None:
        name = f"w.{gva:016x}"
        text = read_record(self.fd, name)
        if not text:
            return None
        try:
            return check_window_record(parse_json_record(text, name), name)
        except ValueError as exc:
            raise ValueError(f"directory {self.path}: {exc}") from None

    def window_with_key(self, gva: int) -> tuple[dict[str, Any] | None, bytes | None]:
        """``(record, access key)`` of window ``gva`` from one read; the key is None for an
        unnamed window, or one sealed with a job secret this process does not hold (or a
        different one: the key then fails the record's digest check)."""
        rec = self._window_record(gva)
        if rec is None:
            return None, None
        held = rec.pop("access_key", None)
        key = None
        if isinstance(held, dict):
            try:
                if isinstance(held.get("plain"), str):
                    key = bytes.fromhex(held["plain"])
                elif isinstance(held.get("sealed"), str) and self._seal_key is not None:
                    key = unseal_key(self._seal_key, f"w.{gva:016x}", held["sealed"])
            except ValueError:
                key = None
            if key is not None and len(key) not in (16, 32):  # 32: the key and its mint's MAC
                key = None
        return rec, key

    def lookup(self, name: str) -> int | None:
        rec = self.name_record(name)
        return None if rec is None else int(rec["gva"], 16)

    def windows(self) -> list[dict[str, Any]]:
        """Every parseable window record (corrupt ones are skipped)."""
        out = []
        for f in self._list():
            if f.startswith("w."):
                try:
                    rec = self.get_window(int(f[2:], 16))
                except ValueError:
                    continue
                if rec is not None:
                    out.append(rec)
        return out

    # -- entries --------------------------------------------------------------------------------
    def put_entry(self, key: str, record: dict[str, Any]) -> None:
        self._write(f"k.{check_entry_key(key).encode().hex()}", record)

    def get_entry(self, key: str) -> dict[str, Any] | None:
        name = f"k.{check_entry_key(key).encode().hex()}"
        try:
            text = self._read(name)
            if not text:
                return None
            return parse_json_record(text, name)
        except ValueError:
            return None

    def remove_entry(self, key: str) -> None:
        self._unlink(f"k.{check_entry_key(key).encode().hex()}")

    def entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        head = f"k.{prefix.encode().hex()}"
        out = {}
        for f in self._list():
            if f.startswith(head) and len(f) % 2 == 0:  # "k." + whole bytes of hex
                try:
                    key = bytes.fromhex(f[2:]).decode()
                    check_entry_key(key)
                except ValueError:
                    continue
                rec = self.get_entry(key)
                if rec is not None:
                    out[key] = rec
        return out

    def watch_entries(self, prefix: str) -> EntryWatch:
        """A watch woken by entries put under ``prefix`` (inotify on the job folder; see the
        module docstring). Falls back to ``EntryWatch``'s short sleeps where inotify cannot be
        set up here.

        Raises:
            ValueError: ``prefix`` is not a valid entry key prefix, or the directory is closed.
        """
        check_entry_key(prefix)
        try:
            return _InotifyWatch(self.fd, f"k.{prefix.encode().hex()}")
        except (ImportError, OSError) as exc:  # no inotify_simple, or EMFILE/ENOSPC: poll instead
            log.debug("directory %s: no inotify watch (%s); waits poll every %.0f ms", self.path, exc,
                      EntryWatch.POLL_S * 1e3)
            return EntryWatch()

    def close(self) -> None:
        """Remove the job folder when this was its last user (no rank, window or entry left);
        close its descriptor. Safe twice."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            parent = os.open(segment_dir(), _O_DIR)
        except OSError:
            parent = None
        try:
            # Only if the name still refers to the folder we opened (not a replacement).
            if parent is not None:
                st, mine = os.stat(os.path.basename(self.path), dir_fd=parent, follow_symlinks=False), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    os.rmdir(os.path.basename(self.path), dir_fd=parent)
        except OSError:
            pass  # not empty: other runtimes of the job still use it (or it is gone already)
        finally:
            if parent is not None:
                os.close(parent)
            os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


class _InotifyWatch(EntryWatch):
    """``EntryWatch`` over inotify: wakes for renames into the job folder of files named
    ``head...`` (entries under the watched prefix), on queue overflow, and on ``wake()`` (an
    eventfd in the same poll set). Once the folder itself is gone (``IN_IGNORED``) it falls back
    to ``EntryWatch``'s short sleeps."""

    def __init__(self, dir_fd: int, head: str) -> None:
        from inotify_simple import INotify, flags

        super().__init__()
        self._head = head
        self._masks = (flags.Q_OVERFLOW, flags.IGNORED | flags.DELETE_SELF | flags.MOVE_SELF)
        self._ino = INotify(nonblocking=True)
        try:
            self._ino.add_watch(f"/proc/self/fd/{dir_fd}",
                                flags.MOVED_TO | flags.DELETE_SELF | flags.MOVE_SELF | flags.ONLYDIR)
            self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except BaseException:
            self._ino.close()
            raise
        self._poller = select.poll()
        self._poller.register(self._ino.fileno(), select.POLLIN)
        self._poller.register(self._efd, select.POLLIN)
        self._dead = False

    def wait(self, timeout: float) -> bool:
        timeout = _args.timeout(timeout)
        if self._dead or self._closed:
            return super().wait(timeout)
        end = time.monotonic() + timeout
        left = timeout
        while True:
            ready = self._poller.poll(math.ceil(left * 1000))
            hit = False
            for fd, _ in ready:
                if fd == self._efd:
                    try:
                        os.eventfd_read(self._efd)
                    except BlockingIOError:
                        pass
                    hit = True
                    continue
                for ev in self._ino.read(timeout=0):
                    if ev.mask & self._masks[0]:
                        hit = True  # events were lost: say "look again"
                    elif ev.mask & self._masks[1]:
                        hit = self._dead = True  # the folder is gone: poll from now on
                    elif ev.name.startswith(self._head):
                        hit = True
            if hit:
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False

    def wake(self) -> None:
        with self._lock:
            if not self._closed:
                os.eventfd_write(self._efd, 1)
                return
        super().wake()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ino.close()
            os.close(self._efd)
