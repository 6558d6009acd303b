"""cffi ABI-mode binding to Ascend SHMEM's host library (``libshmem.so``).

The declarations live in ``_aclshmem_cdef.h`` next to this file (written by hand from the
real C++ headers, which pycparser cannot read). :func:`load_aclshmem` finds the library,
``dlopen``\\ s it and checks up front that every required symbol is there, so a wrong or
partial library fails at load time with the missing name instead of at first use.

The same declarations load the memsem shmem host emulator (``libshmem_host_emu.so``, built
from ``native/shmem_emu``), a test double that exports the same symbols over host shared
memory. It is only ever used when ``MEMSEM_SHMEM_LIB`` (or the ``path`` argument) names it.

This module does not import torch, torch_npu or acl; it only loads the one library.
"""
from __future__ import annotations

import logging
import os
import pathlib
import re
import threading
from typing import Any

from cffi import FFI

from memsem._errors import EngineError, NotSupportedError

__all__ = [
    "CDEF_PATH",
    "ENV_LIB",
    "OPTIONAL_MARKER",
    "candidate_paths",
    "emu_last_error",
    "find_library",
    "is_test_double",
    "load_aclshmem",
    "optional_symbols",
    "required_symbols",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the library file to load (real libshmem.so or the emulator).
ENV_LIB = "MEMSEM_SHMEM_LIB"
CDEF_PATH = pathlib.Path(__file__).with_name("_aclshmem_cdef.h")
#: Line in the cdef file after which declarations are optional (emulator-only extensions).
OPTIONAL_MARKER = "@@OPTIONAL"

_FUNC_RE = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_TYPE_WORDS = {"sizeof"}
_lock = threading.Lock()
_cache: dict[str, tuple[FFI, Any]] = {}


def _cdef_text() -> str:
    return CDEF_PATH.read_text()


def _split_cdef(text: str) -> tuple[str, str]:
    idx = text.find(OPTIONAL_MARKER)
    if idx < 0:
        return text, ""
    line_start = text.rfind("\n", 0, idx) + 1
    return text[:line_start], text[line_start:]


def _function_names(decls: str) -> list[str]:
    """Names of the functions declared in a cdef fragment (comments removed)."""
    text = re.sub(r"/\*.*?\*/", " ", decls, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    names: list[str] = []
    for stmt in text.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(("typedef", "#", "struct", "}")) or "{" in stmt:
            continue
        m = _FUNC_RE.search(stmt)
        if m and m.group(1) not in _TYPE_WORDS and m.group(1) not in names:
            names.append(m.group(1))
    return names


def required_symbols() -> list[str]:
    """Function names a library must export to be usable (declaration order)."""
    return _function_names(_split_cdef(_cdef_text())[0])


def optional_symbols() -> list[str]:
    """Emulator-only function names (absent from the real libshmem.so)."""
    return _function_names(_split_cdef(_cdef_text())[1])


def candidate_paths() -> list[tuple[str, pathlib.Path]]:
    """Where the library is looked for, in order, as ``(source, path)`` pairs.

    ``MEMSEM_SHMEM_LIB`` first (a file path); then the SHMEM install that its ``set_env.sh``
    exported (``$SHMEM_HOME_PATH/shmem/lib/libshmem.so``); then, from the CANN install
    (``$ASCEND_HOME_PATH``, e.g. ``/usr/local/Ascend/ascend-toolkit/latest``), SHMEM's default
    install beside it (``<Ascend root>/shmem/latest/shmem/lib/libshmem.so``, where the root is
    one or two levels above ``$ASCEND_HOME_PATH``) and ``$ASCEND_HOME_PATH/lib64/libshmem.so``.
    """
    out: list[tuple[str, pathlib.Path]] = []
    env_lib = os.environ.get(ENV_LIB)
    if env_lib:
        out.append((ENV_LIB, pathlib.Path(env_lib)))
    shmem_home = os.environ.get("SHMEM_HOME_PATH")
    if shmem_home:
        out.append(("SHMEM_HOME_PATH", pathlib.Path(shmem_home) / "shmem" / "lib" / "libshmem.so"))
    ascend = os.environ.get("ASCEND_HOME_PATH")
    if ascend:
        home = pathlib.Path(ascend)
        seen: set[pathlib.Path] = set()
        for root in (home.parent, home.parent.parent):
            p = root / "shmem" / "latest" / "shmem" / "lib" / "libshmem.so"
            if p not in seen:
                seen.add(p)
                out.append(("ASCEND_HOME_PATH", p))
        out.append(("ASCEND_HOME_PATH", home / "lib64" / "libshmem.so"))
    return out


def find_library(path: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Resolve the library file to load.

    Args:
        path: an explicit file path; overrides the environment.

    Raises:
        NotSupportedError: no library found (the message lists what was tried), or the
            explicit path / ``MEMSEM_SHMEM_LIB`` names a file that does not exist.
    """
    if path is not None:
        p = pathlib.Path(path)
        if not p.is_file():
            raise NotSupportedError(f"mte engine unavailable: SHMEM library {str(p)!r} does not exist")
        return p
    env_lib = os.environ.get(ENV_LIB)
    if env_lib:
        p = pathlib.Path(env_lib)
        if not p.is_file():
            raise NotSupportedError(
                f"mte engine unavailable: {ENV_LIB}={env_lib!r} does not name an existing file")
        return p
    tried = candidate_paths()
    for _source, p in tried:
        if p.is_file():
            return p
    if not tried:
        raise NotSupportedError(
            f"mte engine unavailable: Ascend SHMEM library not found ({ENV_LIB}, SHMEM_HOME_PATH "
            "and ASCEND_HOME_PATH are unset)")
    listing = ", ".join(f"{p} (from {src})" for src, p in tried)
    raise NotSupportedError(f"mte engine unavailable: libshmem.so not found; tried {listing}")


def load_aclshmem(path: str | os.PathLike[str] | None = None) -> tuple[FFI, Any]:
    """Load Ascend SHMEM (or its host emulator) and return ``(ffi, lib)``.

    The library is found as described in :func:`candidate_paths` (``path`` overrides all).
    Every required function of ``_aclshmem_cdef.h`` is looked up now. Results are cached per
    resolved path; thread safe.

    Raises:
        NotSupportedError: the library is absent, or lacks a required symbol (named in the
            message, with the library path).
        EngineError: the file exists but the dynamic loader refused it (``name="dlopen"``).
    """
    lib_path = find_library(path)
    key = os.path.realpath(lib_path)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        ffi = FFI()
        ffi.cdef(_cdef_text())
        try:
            lib = ffi.dlopen(str(lib_path))
        except OSError as exc:
            raise EngineError(f"cannot load SHMEM library {str(lib_path)!r}: {exc}",
                              name="dlopen") from exc
        missing = []
        for name in required_symbols():
            try:
                getattr(lib, name)
            except AttributeError:
                missing.append(name)
        if missing:
            raise NotSupportedError(
                f"mte engine unavailable: {str(lib_path)!r} lacks required symbol "
                f"{missing[0]!r}" + (f" (and {len(missing) - 1} more: {', '.join(missing[1:])})"
                                     if len(missing) > 1 else ""))
        logger.debug("loaded SHMEM library %s (test double: %s)", lib_path, is_test_double(lib))
        _cache[key] = (ffi, lib)
        return ffi, lib


def is_test_double(lib: Any) -> bool:
    """True when ``lib`` is the memsem shmem host emulator rather than a real libshmem.so."""
    try:
        getattr(lib, "aclshmemx_emu_last_error")
    except AttributeError:
        return False
    return True


def emu_last_error(ffi: FFI, lib: Any) -> tuple[int, str]:
    """The emulator's last recorded error on this thread as ``(code, message)``, then cleared.

    ``(0, "")`` when the last calls succeeded. Emulator-only: the real library's data-plane
    functions return void and only log.

    Raises:
        NotSupportedError: ``lib`` is a real libshmem.so (no such call).
    """
    if not is_test_double(lib):
        raise NotSupportedError("aclshmemx_emu_last_error exists only in the shmem host emulator")
    buf = ffi.new("char[]", 256)
    code = lib.aclshmemx_emu_last_error(buf, 256)
    return int(code), ffi.string(buf).decode("utf-8", "replace")
