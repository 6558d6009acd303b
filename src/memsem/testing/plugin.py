"""The pytest plugin (entry point ``memsem`` -> ``memsem.testing.plugin``): fixtures for code that uses memsem.

Fixtures:
    memsem_runtime: a ``memsem.Runtime`` in an isolated job namespace, closed after the test.
        Same-process refs use the loopback engine; spawn a process to test same-node routes.
    memsem_job: the job name of that namespace (pass it as ``MEMSEM_JOB`` to child processes).

Example::

    def test_my_loader(memsem_runtime):
        ref = memsem_runtime.publish(np.arange(10))
        assert (my_loader(ref) == np.arange(10)).all()
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest


@pytest.fixture
def memsem_job(monkeypatch: pytest.MonkeyPatch) -> str:
    job = f"test-{os.getpid()}-{secrets.token_hex(4)}"
    monkeypatch.setenv("MEMSEM_JOB", job)
    return job


@pytest.fixture
def memsem_runtime(memsem_job: str) -> Iterator["object"]:
    from memsem import Runtime

    with Runtime(job=memsem_job, timeout=10.0) as rt:
        yield rt
    _remove_job_dir(memsem_job)


def _remove_job_dir(job: str) -> None:
    import shutil

    from memsem.native import segment_dir

    shutil.rmtree(os.path.join(segment_dir(), f"memsem.{os.getuid()}.dir.{job}"), ignore_errors=True)
