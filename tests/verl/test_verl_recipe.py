"""The verl recipe of docs/howto.md, checked against verl's own config: each ``python -m
verl.trainer.main_ppo`` block of the recipe is composed with verl 0.9.1's Hydra config
(``ppo_trainer``) exactly as written (a key verl does not have fails the composition), converted
to verl's dataclasses, and the checkpoint engine is built from it the way verl's
``CheckpointEngineWorker`` does (bucket size, ``engine_kwargs[backend]``, the custom backend
module imported, ``CheckpointEngineRegistry.new``). The cross-node block's environment reaches
Ray's workers through the runtime env verl builds (``get_ppo_ray_runtime_env`` merged with
``ray_kwargs.ray_init.runtime_env``, as ``verl.trainer.main_ppo.run_ppo`` does).

Runs in .venv-verl (``make test-verl``).
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
PREFIX = "actor_rollout_ref.rollout.checkpoint_engine"


def _recipe_commands() -> list[list[str]]:
    text = (ROOT / "docs" / "howto.md").read_text()
    section = text.split("## ... sync weights to verl's rollouts", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        lines = [x for x in block.splitlines() if not x.lstrip().startswith("#")]
        words = shlex.split(" ".join(x.rstrip("\\") for x in lines))
        at = words.index("verl.trainer.main_ppo")
        end = next((i for i in range(at + 1, len(words)) if words[i] in ("&&", ";", "|")), len(words))
        commands.append(words[at + 1:end])
    return commands


COMMANDS = _recipe_commands()


def _compose(overrides: list[str]):
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _engine_from(cfg):
    """What verl's CheckpointEngineWorker.__init__ does with the rollout config."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig

    ce = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    assert isinstance(ce, CheckpointEngineConfig)
    bucket_size = ce.update_weights_bucket_megabytes << 20
    engine_kwargs = ce.engine_kwargs.get(ce.backend, {})
    import_external_libs(ce.custom_backend_module or None)
    return ce, CheckpointEngineRegistry.new(ce.backend, bucket_size=bucket_size, **engine_kwargs)


def test_the_recipe_has_a_one_node_and_a_cross_node_command():
    assert len(COMMANDS) == 2, COMMANDS
    for words in COMMANDS:
        assert f"{PREFIX}.backend=memsem" in words
        assert f"{PREFIX}.custom_backend_module=memsem.integrations.verl" in words
    assert any("engine_kwargs.memsem.directory=redis://" in w for w in COMMANDS[1])


def test_one_node_recipe_composes_with_verls_config_and_builds_the_engine():
    from memsem.integrations.verl import MemsemCheckpointEngine

    cfg = _compose(COMMANDS[0])
    ce, engine = _engine_from(cfg)
    assert (ce.backend, ce.custom_backend_module) == ("memsem", "memsem.integrations.verl")
    assert isinstance(engine, MemsemCheckpointEngine)
    assert engine.bucket_size == 512 << 20
    assert (engine.device, engine.timeout, engine.directory) == ("cpu", 300.0, None)
    # the rollout config as a whole still converts (verl's RolloutConfig holds the engine config),
    # with the one override verl itself requires there (the rollout engine's name)
    from verl.utils.config import omega_conf_to_dataclass

    full = _compose(COMMANDS[0] + ["actor_rollout_ref.rollout.name=vllm"])
    rollout = omega_conf_to_dataclass(full.actor_rollout_ref.rollout)
    assert rollout.checkpoint_engine.backend == "memsem"
    meta = engine.prepare()  # starts its runtime (local directory)
    try:
        assert meta["pid"] == os.getpid() and meta["token"]
    finally:
        engine.close()


def test_the_delta_key_of_the_table_reaches_the_engine_as_a_bool():
    """``engine_kwargs.memsem.delta=true`` (docs/howto.md's table) composes with verl's config
    and makes an engine that sends deltas (a bool, as the engine requires)."""
    _, engine = _engine_from(_compose(COMMANDS[0] + [f"+{PREFIX}.engine_kwargs.memsem.delta=true"]))
    assert engine.delta is True
    _, engine = _engine_from(_compose(COMMANDS[0]))
    assert engine.delta is False


def test_cross_node_recipe_composes_and_reaches_the_workers_environment(monkeypatch):
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    cfg = _compose(COMMANDS[1])
    _, engine = _engine_from(cfg)
    assert engine.directory == "redis://10.0.0.5:6379/0" and engine.timeout == 300.0
    # main_ppo.run_ppo: verl's default runtime env merged with ray_kwargs.ray_init.runtime_env
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(cfg), cfg.ray_kwargs.ray_init.get("runtime_env", {}))
    env = OmegaConf.to_container(runtime_env)["env_vars"]
    assert env["MEMSEM_ENGINES"] == "loopback,host,tcp" and env["MEMSEM_JOB"] == "my-run-42"
    assert "MEMSEM_JOB_SECRET" not in env  # kept out of the config verl prints
    from memsem.core import default_engines

    monkeypatch.setenv("MEMSEM_ENGINES", env["MEMSEM_ENGINES"])
    assert default_engines() == ["loopback", "host", "tcp"]


@pytest.mark.parametrize("bad", [f"{PREFIX}.engine_kwarg.memsem.timeout=3", f"{PREFIX}.backnd=memsem"])
def test_a_misspelt_key_fails_the_composition(bad):
    # the check above means something: verl's config refuses keys it does not have
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose([bad])


def _tq_command() -> list[str]:
    text = (ROOT / "docs" / "transferqueue.md").read_text()
    section = text.split("### verl\n", 1)[1].split("\n### ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    words = shlex.split(" ".join(x.rstrip("\\") for x in block.splitlines()))
    return words[words.index("verl.trainer.main_ppo") + 1:]


def test_transferqueue_switch_of_the_docs_composes_with_verls_config():
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    words = _tq_command()
    cfg = _compose(words)
    tq = cfg.transfer_queue  # what TaskRunnerV1.run passes to tq.init
    assert tq.backend.storage_backend == "Memsem"
    assert tq.backend.Memsem.lease_ttl == 30
    runtime_env = OmegaConf.to_container(
        OmegaConf.merge(get_ppo_ray_runtime_env(cfg), cfg.ray_kwargs.ray_init.get("runtime_env", {})))
    hook = runtime_env["worker_process_setup_hook"]
    module, func = hook.rsplit(".", 1)
    assert module == "memsem.integrations.transferqueue"
    # the hook exists (the module itself imports transfer_queue, not installed in this venv)
    import ast

    source = (ROOT / "src" / "memsem" / "integrations" / "transferqueue.py").read_text()
    assert func in {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
