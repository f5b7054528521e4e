"""The train step with LoRA (`trainer.lora`): only the adapters move and only they hold optimizer
state; a checkpoint saves and resumes them (the params after resume equal the uninterrupted
run's); only the adapters' gradients are computed; the config wiring; the fault of a LoRA step
on a model without adapters."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models.lora import is_adapter
from models.sharding import make_mesh
from trainer.build import train_step_from_config
from trainer.checkpointing import Checkpointer, Progress
from trainer.config import load_config
from trainer.lora import attach_lora
from trainer.losses import make_loss
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.train_step import TrainStep

OPTIM = OptimizerConfig(learning_rate=1e-2, total_steps=8)


def _lora_step(model_factory, init_b_std: float = 0.0):
    cfg = load_config(None, ["lora.rank=4", "lora.alpha=8", f"lora.init_b_std={init_b_std}"])
    model = model_factory(0)
    attach_lora(cfg, model)
    step = TrainStep(model, make_loss("grpo"), make_optimizer(OPTIM), make_mesh(2, 4),
                     min_shard_bytes=0, trainable=is_adapter)  # fmt: skip
    return model, step


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def test_only_adapters_move_and_hold_optimizer_state(model_factory, batch_source):
    model, step = _lora_step(model_factory)
    state = step.init_state(model)
    before = {k: np.asarray(v) for k, v in state.params.items()}
    adapters = {k: v for k, v in state.params.items() if is_adapter(k)}
    assert len(adapters) == 2 * 7 * model.cfg.num_layers
    # AdamW's two moments per adapter; the base params hold none.
    assert _nbytes(state.opt_state) - 2 * _nbytes(adapters) < 64
    for i in range(2):
        state, metrics = step(state, batch_source(i, prompts=4, group=2))
        assert float(metrics["grad_norm"]) > 0
    for k, v in state.params.items():
        moved = not np.array_equal(np.asarray(v), before[k])
        # B starts at 0 so the first update moves B only; A moves from the second on.
        assert moved == is_adapter(k), k


def test_lora_resume_equals_uninterrupted_run(tmp_path, model_factory, batch_source):
    model, step = _lora_step(model_factory, init_b_std=0.02)
    full = step.init_state(model)
    for i in range(4):
        full, _ = step(full, batch_source(i))
    half = step.init_state(model)
    for i in range(2):
        half, _ = step(half, batch_source(i))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(half, Progress(2, 2, 2, jax.random.key(0)))
    del half
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored, _ = ckpt.restore(step.abstract_state())
    losses = []
    for i in range(2, 4):
        restored, m = step(restored, batch_source(i))
        losses.append(float(m["loss"]))
    for key, ref in full.params.items():
        np.testing.assert_allclose(
            np.asarray(restored.params[key]), np.asarray(ref), rtol=1e-6, atol=1e-7, err_msg=key
        )
    _, m_full = step(full, batch_source(4))
    restored, m_res = step(restored, batch_source(4))
    assert float(m_res["loss"]) == pytest.approx(float(m_full["loss"]), rel=1e-6, abs=1e-7)


def test_config_wiring_and_faults(model_factory):
    cfg = load_config(None, ["lora.rank=2", "lora.targets=[q_proj,v_proj]"])
    model = model_factory(0)
    step = train_step_from_config(cfg, model, make_mesh(1, 1, devices=jax.devices()[:1]))
    state = step.init_state(model)
    assert sorted({k.split(".")[-2] for k in state.params if is_adapter(k)}) == ["q", "v"]
    with pytest.raises(ValueError, match="selects none of the model's"):
        TrainStep(model_factory(0), make_loss("grpo"), make_optimizer(OPTIM),
                  make_mesh(1, 1, devices=jax.devices()[:1]), trainable=is_adapter)  # fmt: skip
    with pytest.raises(Exception, match="lora.rank"):
        load_config(None, ["lora.rank=-1"])


def test_the_step_holds_no_gradient_of_the_frozen_base(model_factory, batch_source):
    """XLA's plan of the LoRA step holds at least 0.8x the base params' bytes less temporary
    memory than the same model's full step: the base weights' gradients (fp32, the base's size)
    are neither computed nor accumulated; the tiny model's activations are far smaller."""
    temp = {}
    for name, trainable in (("full", None), ("lora", is_adapter)):
        model = model_factory(0)
        attach_lora(load_config(None, ["lora.rank=4", "lora.alpha=8"]), model)
        mesh = make_mesh(1, 1, devices=jax.devices()[:1])
        step = TrainStep(model, make_loss("grpo"), make_optimizer(OPTIM), mesh,
                         trainable=trainable)  # fmt: skip
        plan = step.lower(batch_source(0)).compile().memory_analysis()
        temp[name] = plan.temp_size_in_bytes
        params = step.abstract_state().params
        base = sum(int(np.prod(s.shape)) * s.dtype.itemsize
                   for k, s in params.items() if not is_adapter(k))  # fmt: skip
    assert temp["full"] - temp["lora"] >= 0.8 * base, (temp, base)
