"""cffi builder for ``memsem._native`` (API mode, compiled at install time).

The declarations come from ``native/memsem_native.h``: the header is the one source, fed to
``cdef`` with its preprocessor lines removed (cffi keeps ``#define NAME <int>`` constants).
"""
from __future__ import annotations

import pathlib
import re

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent


def _cdef_from_header(text: str) -> str:
    keep = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            # integer constants (a trailing one-line comment is dropped); other lines are not C
            m = re.match(r"(#define\s+MEMSEM_[A-Z0-9_]+\s+-?\d+)\s*(/\*.*\*/)?\s*$", stripped)
            if m:
                keep.append(m.group(1))
            continue
        keep.append(line)
    return "\n".join(keep)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_from_header((HERE / "memsem_native.h").read_text()))
ffibuilder.set_source(
    "memsem._native",
    '#include "memsem_native.h"',
    sources=[str((HERE / name).relative_to(HERE.parent)) for name in ("memsem_native.c", "memsem_wait.c", "memsem_pipe.c", "memsem_delta.c")],
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    extra_compile_args=["-O2", "-std=gnu11", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
