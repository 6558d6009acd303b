"""The ``local`` directory: files in a 0700 folder next to the segments, one machine, no server.

Layout of ``<segment dir>/memsem.<uid>.dir.<job>/``: ``r.<rank>`` (rank records), ``w.<gva hex>``
(window records), ``n.<hex of name>`` (name -> gva), ``k.<hex of key>`` (engine entries). Every file is written to a temporary name
and renamed, so readers never see a torn record. The job (``MEMSEM_JOB``, default ``default``)
namespaces everything.
"""
from __future__ import annotations

import json
import os
import secrets
from typing import Any, Callable

from memsem.directory._base import Directory, check_entry_key
from memsem.native import segment_dir

_MAX_RANKS = 1 << 16


def default_job() -> str:
    return os.environ.get("MEMSEM_JOB", "default")


class LocalDirectory(Directory):
    """Directory of one machine.

    Args:
        job: namespace; defaults to ``MEMSEM_JOB`` or ``"default"``.
        alive: ``alive(record) -> bool`` used to reap rank records of dead owners.
    """

    def __init__(self, job: str | None = None, *, alive: Callable[[dict[str, Any]], bool]) -> None:
        self.job = job or default_job()
        if not self.job.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"job must be alphanumeric (with - or _), got {self.job!r}")
        self.path = os.path.join(segment_dir(), f"memsem.{os.getuid()}.dir.{self.job}")
        self.url = f"local://{self.path}"
        self._alive = alive
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        st = os.stat(self.path)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(
                f"directory {self.path} must be owned by uid {os.getuid()} with mode 0700; "
                f"found uid {st.st_uid} mode {oct(st.st_mode & 0o777)}")

    # -- files ----------------------------------------------------------------------------------
    def _write(self, fname: str, data: dict[str, Any] | str) -> None:
        tmp = os.path.join(self.path, f".tmp.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(data if isinstance(data, str) else json.dumps(data))
        os.replace(tmp, os.path.join(self.path, fname))

    def _read(self, fname: str) -> str | None:
        try:
            with open(os.path.join(self.path, fname)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _unlink(self, fname: str) -> None:
        try:
            os.unlink(os.path.join(self.path, fname))
        except FileNotFoundError:
            pass

    # -- ranks ----------------------------------------------------------------------------------
    def claim_rank(self, record: dict[str, Any]) -> int:
        for attempt in range(3):
            try:
                return self._claim_rank(json.dumps(record))
            except FileNotFoundError:
                # An empty job folder was removed (close/gc) between makedirs and our claim.
                os.makedirs(self.path, mode=0o700, exist_ok=True)
        return self._claim_rank(json.dumps(record))

    def _claim_rank(self, payload: str) -> int:
        for rank in range(_MAX_RANKS):
            fname = os.path.join(self.path, f"r.{rank}")
            try:
                fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                old = self.rank_record(rank)
                if old is not None and not self._alive(old):
                    self._reap_rank(rank, old)
                    try:
                        fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    except FileExistsError:
                        continue
                else:
                    continue
            with os.fdopen(fd, "w") as f:
                f.write(payload)
            return rank
        raise RuntimeError(f"no free rank in {self.path}")

    def _reap_rank(self, rank: int, record: dict[str, Any]) -> None:
        for w in self.windows():
            if w.get("rank") == rank:
                self.remove_window(int(w["gva"]), str(w.get("name", "")))
        self._unlink(f"r.{rank}")

    def release_rank(self, rank: int) -> None:
        self._unlink(f"r.{rank}")

    def rank_record(self, rank: int) -> dict[str, Any] | None:
        text = self._read(f"r.{rank}")
        if not text:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:  # being written by O_EXCL creator: treat as held
            return {"pid": -1}

    def ranks(self) -> dict[int, dict[str, Any]]:
        out = {}
        for f in os.listdir(self.path):
            if f.startswith("r."):
                rec = self.rank_record(int(f[2:]))
                if rec is not None:
                    out[int(f[2:])] = rec
        return out

    # -- windows --------------------------------------------------------------------------------
    def put_window(self, gva: int, name: str, record: dict[str, Any], key: bytes | None = None) -> None:
        self._write(f"w.{gva:016x}", record)
        if name:
            self._write(f"n.{name.encode().hex()}", f"{gva:016x}")

    def remove_window(self, gva: int, name: str) -> None:
        if name and self.lookup(name) == gva:
            self._unlink(f"n.{name.encode().hex()}")
        self._unlink(f"w.{gva:016x}")

    def get_window(self, gva: int) -> dict[str, Any] | None:
        text = self._read(f"w.{gva:016x}")
        return json.loads(text) if text else None

    def lookup(self, name: str) -> int | None:
        text = self._read(f"n.{name.encode().hex()}")
        return int(text, 16) if text else None

    def windows(self) -> list[dict[str, Any]]:
        out = []
        for f in os.listdir(self.path):
            if f.startswith("w."):
                rec = self.get_window(int(f[2:], 16))
                if rec is not None:
                    out.append(rec)
        return out

    # -- entries --------------------------------------------------------------------------------
    def put_entry(self, key: str, record: dict[str, Any]) -> None:
        self._write(f"k.{check_entry_key(key).encode().hex()}", record)

    def get_entry(self, key: str) -> dict[str, Any] | None:
        text = self._read(f"k.{check_entry_key(key).encode().hex()}")
        if not text:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return None

    def remove_entry(self, key: str) -> None:
        self._unlink(f"k.{check_entry_key(key).encode().hex()}")

    def entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        head = f"k.{prefix.encode().hex()}"
        out = {}
        for f in os.listdir(self.path):
            if f.startswith(head) and len(f) % 2 == 0:  # "k." + whole bytes of hex
                key = bytes.fromhex(f[2:]).decode()
                rec = self.get_entry(key)
                if rec is not None:
                    out[key] = rec
        return out

    def close(self) -> None:
        """Remove the job folder when this was its last user (no rank, window or entry left)."""
        try:
            os.rmdir(self.path)
        except OSError:
            pass  # not empty: other runtimes of the job still use it
