"""Lines of a child process's stdout with a timeout.

``select`` on a pipe says whether the *pipe* has bytes; a buffered ``readline`` may already hold
the next line in its buffer (a child that printed two lines at once), and a ``select`` before
the second ``readline`` then waits for bytes that already arrived. This reads the pipe's bytes
itself (``os.read``) and keeps its own buffer, so ``readline(timeout)`` never waits for a line
it already has.
"""
from __future__ import annotations

import os
import select
import time
import weakref

_readers: "weakref.WeakKeyDictionary[object, LineReader]" = weakref.WeakKeyDictionary()


class LineReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def readline(self, timeout: float) -> str | None:
        """The next line (without its newline), "" at end of file, None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.fd], [], [], left)
            if not r:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                if self.buf:
                    line, self.buf = self.buf, b""
                    return line.decode()
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def reader(proc) -> LineReader:
    """The one reader of ``proc``'s stdout (never mix it with ``proc.stdout.readline``)."""
    r = _readers.get(proc)
    if r is None:
        r = _readers[proc] = LineReader(proc.stdout.fileno())
    return r
