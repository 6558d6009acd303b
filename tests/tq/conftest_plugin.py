"""pytest plugin that points TransferQueue's backend-neutral e2e tests at extra backends.

Load it with ``-p conftest_plugin`` (its folder on PYTHONPATH). It

* imports the backend modules named in ``TQ_EXTRA_BACKEND_MODULES`` (comma-separated,
  default ``probe_backend``), which registers them with TQ's factories in the driver;
* makes every Ray worker import them too: it sets ``RAY_RUNTIME_ENV_HOOK`` so each
  ``ray.init()`` the tests make gets a ``worker_process_setup_hook`` that imports the
  module, and puts this folder on ``PYTHONPATH`` so raylet-spawned workers can import it;
* after collection, adds a ``BACKEND_CONFIGS[name]`` entry to each collected test module
  that has that dict (tests/e2e/test_e2e_lifecycle_consistency.py and
  tests/e2e/test_kv_interface_e2e.py), so ``TQ_TEST_BACKEND=name`` selects it. TQ's
  files are not edited: the dict is read at fixture time, after collection;
* for a module that names one backend in a module-level ``_TQ_CONFIG`` (TQ 0.1.11's
  tests/e2e/test_checkpoint_e2e.py hard-codes SimpleStorage there), replaces that config with
  the selected backend's when ``TQ_TEST_BACKEND`` is not SimpleStorage, and skips the tests
  listed in ``SIMPLESTORAGE_ONLY`` (checks of SimpleStorage's own checkpoint files and of an
  override TQ applies to SimpleStorage only), each with its reason (docs/transferqueue.md).

Each extra backend module should define ``BACKEND_NAME`` (else TQ_TEST_BACKEND is used) and may define
``E2E_BACKEND_CONFIG`` (the dict to add; default: polling_mode controller + an empty
``backend.<name>`` section) and ``remove_run_dirs()`` (called at session end; returns what it
could not remove, which fails the run).
"""

from __future__ import annotations

import copy
import importlib
import os

import pytest

#: tests of TQ's checkpoint e2e file that check SimpleStorage itself, not the backend under test
SIMPLESTORAGE_ONLY = {
    "test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_tensor_fields":
        "checks SimpleStorage's own checkpoint files (simple_storage/storage_unit_info.json); the backend's "
        "data round trip is covered by the other roundtrip tests and its own files by "
        "tests/tq/e2e_memsem_checkpoint.py",
    "test_checkpoint_e2e.py::TestIncludeStorageFalse::test_storage_saved_is_true":
        "tq.save_checkpoint forces include_storage=True only for SimpleStorage (an isinstance check); for "
        "every other backend include_storage=False means storage is not saved, and storage_saved is False",
    "test_checkpoint_e2e.py::TestCheckpointErrors::test_load_raises_on_storage_unit_count_mismatch":
        "tampers with SimpleStorage's storage_unit_info.json (its count of storage units); other backends "
        "have no storage units",
}

_HERE = os.path.dirname(os.path.abspath(__file__))
_MODULES: list = []


def _default_config(name: str) -> dict:
    return {
        "controller": {"polling_mode": True},
        "backend": {"storage_backend": name, name: {}},
    }


def pytest_configure(config: pytest.Config) -> None:
    # Workers are spawned by raylet, which inherits this process's environment when
    # ray.init() starts the local cluster: set both variables before any ray.init().
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _HERE not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_HERE, *paths])

    names = [m.strip() for m in os.environ.get("TQ_EXTRA_BACKEND_MODULES", "probe_backend").split(",") if m.strip()]
    for name in names:
        _MODULES.append(importlib.import_module(name))

    # One module can be named in RAY_RUNTIME_ENV_HOOK; a hook in the first module adds a
    # worker setup hook that imports them all (see _chain_hook below).
    os.environ.setdefault("TQ_EXTRA_BACKEND_MODULES", ",".join(names))
    os.environ.setdefault("RAY_RUNTIME_ENV_HOOK", f"{__name__}.ray_runtime_env_hook")


def ray_runtime_env_hook(runtime_env: dict | None) -> dict:
    """Ray calls this (via RAY_RUNTIME_ENV_HOOK) with each ray.init()'s runtime_env."""
    runtime_env = dict(runtime_env or {})
    existing = runtime_env.get("worker_process_setup_hook")
    if existing is not None:
        raise RuntimeError(
            f"conftest_plugin: ray.init() already sets worker_process_setup_hook={existing!r}; "
            "cannot add the backend import hook"
        )
    runtime_env["worker_process_setup_hook"] = f"{__name__}.worker_setup"
    return runtime_env


def worker_setup() -> None:
    """Ray worker_process_setup_hook: import (hence register) every extra backend."""
    for name in os.environ.get("TQ_EXTRA_BACKEND_MODULES", "probe_backend").split(","):
        if name.strip():
            mod = importlib.import_module(name.strip())
            hook = getattr(mod, "worker_setup", None)
            if callable(hook):
                hook()


def _backend_entry(mod) -> tuple[str | None, dict]:
    name = getattr(mod, "BACKEND_NAME", None) or os.environ.get("TQ_TEST_BACKEND")
    return name, copy.deepcopy(getattr(mod, "E2E_BACKEND_CONFIG", None) or _default_config(name or ""))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    selected = os.environ.get("TQ_TEST_BACKEND", "SimpleStorage")
    if selected != "SimpleStorage":
        for item in items:
            for suffix, reason in SIMPLESTORAGE_ONLY.items():
                if item.nodeid.endswith(suffix):
                    item.add_marker(pytest.mark.skip(reason=f"SimpleStorage only: {reason}"))
    seen = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        fixed = getattr(module, "_TQ_CONFIG", None)
        if fixed is not None and selected != "SimpleStorage":
            from omegaconf import OmegaConf

            for mod in _MODULES:
                name, entry = _backend_entry(mod)
                if name == selected:
                    module._TQ_CONFIG = OmegaConf.create(entry)
        configs = getattr(module, "BACKEND_CONFIGS", None)
        if not isinstance(configs, dict):
            continue
        for mod in _MODULES:
            name, entry = _backend_entry(mod)
            if name:
                configs.setdefault(name, entry)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After every fixture (ray.shutdown included) is torn down: the run must leave nothing
    behind; a backend's ``remove_run_dirs()`` returns what is left, and that fails the run."""
    left = []
    for mod in _MODULES:
        cleanup = getattr(mod, "remove_run_dirs", None)
        if callable(cleanup):
            left += list(cleanup() or [])
    if left:
        print(f"\nconftest_plugin: FAILED: left behind after the run: {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
