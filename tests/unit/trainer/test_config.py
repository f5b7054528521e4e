"""The run config: YAML plus key=value overrides, errors that name the key, no ML imports."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest

from trainer.config import Config, ConfigError, LossName, load_config, parse_overrides


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "trainer:\n  steps: 30\n  prompts_per_step: 4\n"
        "rollout:\n  backend: jax\n  group_size: 8\n  max_lag: 2\n"
        "loss:\n  name: cispo\n  eps_high: 2.0\n"
    )
    cfg = load_config(path, ["rollout.max_lag=0", "optim.learning_rate=3e-6", "loss.kl_coef=0.1"])
    assert cfg.trainer.steps == 30 and cfg.rollout.backend == "jax"
    assert (cfg.rollout.group_size, cfg.rollout.max_lag) == (8, 0)
    assert cfg.optim.learning_rate == 3e-6
    assert cfg.loss.loss_kwargs() == {"kl_coef": 0.1, "eps_high": 2.0}
    assert cfg.rollout.prompts_ahead(cfg.trainer.prompts_per_step) == 0
    assert load_config(overrides=["rollout.queue_steps=3"]).rollout.prompts_ahead(4) == 8
    assert parse_overrides(["model.path=/x", "optim.max_grad_norm="]) == {
        "model": {"path": "/x"},
        "optim": {"max_grad_norm": None},
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.maxlag=1"], "unknown key 'rollout.maxlag': rollout has no 'maxlag'"),
        (["nope.x=1"], "unknown key 'nope.x': the top level has no 'nope'"),
        (["rollout.max_lag.x=1"], "rollout.max_lag is not a section"),
        (["rollout.max_lag"], "expected section.key=value"),
        (["rollout.max_lag=-1"], "rollout.max_lag: Input should be greater than or equal to 0"),
        (["rollout.backend=tpu"], "rollout.backend: Input should be 'vllm' or 'jax' (got 'tpu')"),
        (["loss.name=ppo"], "loss.name: Input should be"),
        (["trainer.micro_batches=3"], "trainer.micro_batches=3 must divide the batch of"),
        (["loss.name=dapo", "loss.aggregation=token_mean"], "loss dapo fixes its aggregation"),
        (["trainer.fsdp=0"], "fsdp must be >= 1 or -1"),
        (["model.remat=dots"], "model.remat: Input should be 'none', 'full', 'dots_saveable'"),
        (["model.dtype=float16"], "model.dtype: Input should be 'float32' or 'bfloat16'"),
        (["model.scan_layers=maybe"], "model.scan_layers: Input should be a valid boolean"),
        (["sync.lora_only=true"], "sync.lora_only needs LoRA training: set lora.rank > 0"),
    ],
)
def test_bad_keys_and_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections, got list"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "extra.yaml").write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="trainer.stepz: Extra inputs are not permitted"):
        load_config(tmp_path / "extra.yaml")


def test_loss_names_match_the_registry_and_build():
    from trainer.losses import available_losses, make_loss

    assert set(typing.get_args(LossName)) == set(available_losses())
    for name in available_losses():
        section = Config().loss.model_copy(update={"name": name})
        assert make_loss(name, **section.loss_kwargs()).name == name


def test_config_imports_no_ml_library():
    code = (
        "import sys, trainer.config; "
        "print(sorted(m for m in ('jax', 'torch', 'vllm', 'numpy', 'flax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
