"""The docs stand on their own: generated API reference up to date, no references outside the
repository, ``memsem --version``, and every ```python block of README.md and docs/*.md run or
listed as not runnable with the reason (tests/_doc_blocks.py)."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

import memsem
from tests import _doc_blocks as DB

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_api_md_is_generated_from_the_code():
    got = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py")], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    want = (ROOT / "docs" / "api.md").read_text()
    assert got == want, "docs/api.md is stale: run `python docs/gen_api.py > docs/api.md`"
    assert "._" not in "".join(re.findall(r"^## `([^`]*)`", want, re.M)), "api.md documents private paths"


def test_docs_reference_nothing_outside_the_repository():
    bad = []
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]:
        text = path.read_text()
        for pat in (r"\.\./shared", r"DESIGN\.md", r"/work/"):
            for m in re.finditer(pat, text):
                bad.append(f"{path.relative_to(ROOT)}: {text[max(0, m.start() - 30):m.end() + 30]!r}")
    assert not bad, "\n".join(bad)


def test_relative_links_in_docs_resolve():
    bad = []
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            if not (path.parent / target).exists():
                bad.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not bad, bad


def test_version_command():
    out = subprocess.run([sys.executable, "-m", "memsem.cli", "--version"], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == f"memsem {memsem.__version__}"


def test_readme_lists_every_extra():
    """README's Install section names every extra pyproject.toml defines (its list once missed
    ``cli`` and ``tcp``)."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    listed = set(re.search(r"# with an extra: ([^\n]*)", install).group(1).replace(" ", "").split(","))
    assert listed == extras, (sorted(extras - listed), sorted(listed - extras))
    described = set(re.findall(r"`([a-z]+)`", install.split("The extras:", 1)[1].split("\n\n", 1)[0]))
    assert extras <= described, sorted(extras - described)


def test_a_state_dicts_ref_is_the_size_the_docs_say():
    """README and docs/weight-sync.md give the demo's checkpoint's state-dict ref as 111 bytes."""
    from memsem.cli._demo import default_weights, load_state_dict

    for doc in ("README.md", "docs/weight-sync.md"):
        assert "111 bytes for the demo's" in " ".join((ROOT / doc).read_text().split()), doc
    sd = load_state_dict(default_weights())
    with memsem.Runtime() as rt:
        ref = rt.publish_state_dict(sd, name="policy")
        assert (len(sd), len(ref.to_bytes())) == (104, 111)


def test_every_python_block_of_the_docs_is_run_or_listed():
    """A block is run (``DB.RUN``) or listed with its reason (``DB.NOT_RUNNABLE``, or its whole
    file in ``DB.NOT_RUN_FILES``), by exactly one entry; every entry names exactly one block."""
    entries = {**DB.RUN, **DB.NOT_RUNNABLE}
    assert len(entries) == len(DB.RUN) + len(DB.NOT_RUNNABLE), "a block both run and listed"
    named, problems = DB.match(entries)
    assert not problems, problems
    assert all(reason for reason in [*DB.NOT_RUNNABLE.values(), *DB.NOT_RUN_FILES.values()])
    loose = [f"{f}:{line}" for f, line, _ in DB.blocks() if f not in DB.NOT_RUN_FILES and (f, line) not in named]
    assert not loose, f"python blocks neither run nor listed in tests/_doc_blocks.py: {loose}"
    assert not [k for k in entries if k[0] in DB.NOT_RUN_FILES]
    for f in DB.NOT_RUN_FILES:
        assert any(b[0] == f for b in DB.blocks()), f"{f} has no python block left: drop it from NOT_RUN_FILES"


@pytest.fixture(scope="module")
def doc_block_results(tmp_path_factory):
    """Every block of ``DB.RUN``, run once in one process (python -m tests._doc_blocks)."""
    import json

    out = tmp_path_factory.mktemp("docblocks") / "results.jsonl"
    cp = subprocess.run([sys.executable, "-m", "tests._doc_blocks", str(out)], cwd=ROOT, capture_output=True,
                        text=True, timeout=20 * DB.BLOCK_TIMEOUT_S)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:] + repr(rows)
    return {tuple(r["key"]): r for r in rows}


@pytest.mark.parametrize("key", sorted(DB.RUN), ids=lambda k: f"{k[0]}:{k[1][:24]}")
def test_a_python_block_of_the_docs_runs(doc_block_results, key):
    r = doc_block_results.get(key)
    assert r is not None, f"{key}: not run"
    assert r["ok"], f"{r['block']} failed:\n{r['error']}"
