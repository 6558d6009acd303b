"""Every install command memsem prints, and every one its docs show, works as printed.

The commands are collected from the sources, not listed here, so a new hint cannot be missed:
every string literal under src/ (implicitly concatenated parts and f-string text merged, as
Python compiles them) and every ``pip install`` in README.md, docs/*.md and examples/. Each is
resolved by pip itself (``pip install --dry-run --ignore-installed``: the index or the checkout
must provide everything it names; nothing is installed): the library's from a folder outside
the checkout (a hint is read wherever the user happens to be), the docs' from the checkout
root (the docs say so). A resolution that would bring torch must bring the tested local 2.13.0
wheel (any other torch is GBs of CUDA wheels). Hints also survive rich's markup untouched
(rich once rendered ``pip install 'memsem[bench]'`` as ``pip install 'memsem'``); a hint in a
docstring is never printed and may name an extra (``pip install '.[metrics]'``, in the checkout).
"""
from __future__ import annotations

import ast
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# `pip install` and its arguments: quoted words, or bare words of requirement/option characters
# (a URL's "://" allowed). Prose around a hint ends it: ")", ",", ":", ";", "`", "#", a newline.
_WORD = r"""(?:'[^'\n]*'|"[^"\n]*"|[\w.=<>!~\[\]@/+-]+(?:://[\w.=<>!~\[\]@/+-]+)?)"""
HINT = re.compile(rf"pip install((?:[ \t]+{_WORD})+)")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _strings(tree: ast.AST) -> list[tuple[str, bool]]:
    """Every string literal of ``tree`` and whether it is a docstring (never printed)."""
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.value, id(node) in docs))
        elif isinstance(node, ast.JoinedStr):
            out.append(("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values), False))
    return out


def _commands(text: str) -> list[str]:
    cmds = []
    for m in HINT.finditer(text):
        words = shlex.split(m.group(1))
        while words and words[-1].endswith("."):  # a sentence's full stop, not part of a name
            if words[-1] == ".":
                break
            words[-1] = words[-1][:-1]
        cmds.append(shlex.join(["pip", "install", *words]))
    return cmds


def library_hints() -> tuple[dict[str, list[str]], set[str]]:
    """``{command: [where]}`` of every ``pip install`` in a string literal under src/, and the
    commands that appear outside docstrings (printed: messages, exceptions)."""
    found: dict[str, list[str]] = {}
    printed: set[str] = set()
    for path in sorted((ROOT / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for s, is_doc in _strings(tree):
            for cmd in _commands(s):
                found.setdefault(cmd, []).append(str(path.relative_to(ROOT)))
                if not is_doc:
                    printed.add(cmd)
    return found, printed


def doc_commands() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*"))]
    for path in paths:
        if path.is_file():
            for cmd in _commands(path.read_text()):
                found.setdefault(cmd, []).append(str(path.relative_to(ROOT)))
    return found


LIBRARY, PRINTED = library_hints()
DOCS = {c: w for c, w in doc_commands().items() if c not in LIBRARY}


def test_hints_were_found():
    # the collector itself: it sees the hints we know of (a regex that matched nothing would
    # make every other test here pass vacuously)
    assert "pip install 'prometheus_client>=0.20'" in LIBRARY, sorted(LIBRARY)
    assert any("redis" in c for c in LIBRARY), sorted(LIBRARY)
    assert len(PRINTED) >= 5 and len(DOCS) >= 2, (sorted(LIBRARY), sorted(DOCS))


@pytest.mark.parametrize("cmd", sorted(LIBRARY))
def test_library_hints_name_no_unpublished_package(cmd):
    # memsem is on no index: `pip install 'memsem[x]'` fails for everyone; extras are installed
    # from the checkout (the docs' `pip install '.[x]'`), the library's hints name packages.
    words = shlex.split(cmd)[2:]
    assert not [w for w in words if re.match(r"memsem\b", w)], f"{cmd} (in {LIBRARY[cmd]})"


@pytest.mark.parametrize("cmd", sorted(PRINTED))
def test_printed_hints_survive_rich_markup(cmd):
    # any of them may be printed through a rich console (memsem bench and demo print with rich)
    from rich.text import Text

    assert Text.from_markup(cmd).plain == cmd


def _resolve(cmd: str, cwd: pathlib.Path, tmp_path: pathlib.Path) -> list[dict]:
    words = shlex.split(cmd)
    assert words[:2] == ["pip", "install"], cmd
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                           "--report", str(report), *words[2:]], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"`{cmd}` does not resolve (cwd {cwd}):\n{proc.stderr[-3000:]}"
    return json.loads(report.read_text())["install"]


def _check_torch(cmd: str, install: list[dict]) -> None:
    for item in install:
        meta = item["metadata"]
        if meta["name"].lower() == "torch":
            assert meta["version"].startswith("2.13.0"), (
                f"`{cmd}` picks torch {meta['version']} ({item['download_info']['url']}): only the "
                "tested 2.13.0 wheel may be installed (pass -c tests/constraints.txt)")


def _in_checkout(cmd: str) -> bool:
    """Whether ``cmd`` names the checkout (``.``, ``'.[x]'``, ``-c tests/constraints.txt``): such
    a command says "in the memsem checkout" where it is printed, and is resolved there."""
    return any(w.startswith(".") or w.startswith("tests/") for w in shlex.split(cmd)[2:])


@pytest.mark.parametrize("cmd", sorted(c for c in LIBRARY if not _in_checkout(c)))
def test_library_hint_resolves_from_anywhere(cmd, tmp_path):
    away = tmp_path / "elsewhere"
    away.mkdir()
    _check_torch(cmd, _resolve(cmd, away, tmp_path))


@pytest.mark.parametrize("cmd", sorted({*DOCS, *(c for c in LIBRARY if _in_checkout(c))}))
def test_doc_command_resolves_in_the_checkout(cmd, tmp_path):
    install = _resolve(cmd, ROOT, tmp_path)
    _check_torch(cmd, install)
    if _in_checkout(cmd) and any(w.startswith(".") for w in shlex.split(cmd)[2:]):
        assert any(i["metadata"]["name"] == "memsem" for i in install), cmd
