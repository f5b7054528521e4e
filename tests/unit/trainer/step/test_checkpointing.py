"""Checkpoints: stopping after k updates and resuming from the checkpoint gives the same params as
the uninterrupted run (on the 8-device FSDP mesh), with step, data position, weight version and
RNG restored."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models.sharding import make_mesh
from trainer.checkpointing import Checkpointer, Progress
from trainer.losses import make_loss
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.train_step import TrainStep
from trainer.user_error import UserError


def _advance(step, state, progress, batch_source, n):
    """n updates; the batch depends on the data position and on the RNG (so both must resume)."""
    rng, position = progress.rng, progress.data_position
    for _ in range(n):
        rng, sub = jax.random.split(rng)
        salt = int(jax.random.randint(sub, (), 0, 1000))
        state, _ = step(state, batch_source(position * 1000 + salt, prompts=4, group=4))
        position += 1
    done = int(state.step)
    return state, Progress(done, position, progress.weight_version + n, rng)


def test_resume_equals_uninterrupted_run(tmp_path, model_factory, batch_source):
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=2, total_steps=8))
    model = model_factory(0)
    step = TrainStep(model, make_loss("cispo"), tx, make_mesh(2, 4), min_shard_bytes=0)
    start = Progress(0, 0, 0, jax.random.key(7))

    full, full_progress = _advance(step, step.init_state(model), start, batch_source, 4)

    half, half_progress = _advance(step, step.init_state(model), start, batch_source, 2)
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2) as ckpt:
        ckpt.save(half, half_progress)
    del half

    # A new process: other random weights, everything comes back from disk.
    other = step.init_state(model_factory(1))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() == 2
        restored, progress = ckpt.restore(step.abstract_state())
    assert (progress.step, progress.data_position, progress.weight_version) == (2, 2, 2)
    assert np.array_equal(jax.random.key_data(progress.rng), jax.random.key_data(half_progress.rng))
    assert int(restored.step) == 2
    name = "layers.0.mlp.up.kernel"
    assert restored.params[name].sharding == other.params[name].sharding
    assert "fsdp" in str(restored.params[name].sharding.spec)

    resumed, resumed_progress = _advance(step, restored, progress, batch_source, 2)
    assert (resumed_progress.step, resumed_progress.data_position) == (4, 4)
    for key, ref in full.params.items():
        np.testing.assert_allclose(
            np.asarray(resumed.params[key]), np.asarray(ref), rtol=1e-6, atol=1e-7, err_msg=key
        )
    assert int(resumed.opt_state[1][0].count) == int(full.opt_state[1][0].count) == 4
    assert np.array_equal(
        jax.random.key_data(resumed_progress.rng), jax.random.key_data(full_progress.rng)
    )


def test_checkpointer_keeps_newest_and_refuses_bad_calls(tmp_path, model_factory):
    model = model_factory(0)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    step = TrainStep(model, make_loss("grpo"), tx, make_mesh(1, 1, devices=jax.devices()[:1]))
    state = step.init_state(model)
    with Checkpointer(tmp_path / "c", max_to_keep=2) as ckpt:
        with pytest.raises(FileNotFoundError, match="no checkpoint at all"):
            ckpt.restore(step.abstract_state())
        with pytest.raises(ValueError, match="progress.step 1 != state.step 0"):
            ckpt.save(state, Progress(1, 0, 0, jax.random.key(0)))
        for s in range(3):
            state = step.init_state(model, step=s)
            ckpt.save(state, Progress(s, 10 * s, s, jax.random.key(s)))
        assert ckpt.all_steps() == [1, 2]
        with pytest.raises(ValueError, match="already exists"):
            ckpt.save(state, Progress(2, 0, 0, jax.random.key(0)))
        restored, progress = ckpt.restore(step.abstract_state(), step=1)
        assert (progress.data_position, int(restored.step)) == (10, 1)
        assert (progress.consumed_beyond, progress.attempt) == ((), 0)
        state = step.init_state(model, step=3)
        ckpt.save(state, Progress(3, 10, 3, jax.random.key(3), consumed_beyond=(12, 15), attempt=2))
        _, progress = ckpt.restore(step.abstract_state())
        assert (progress.step, progress.consumed_beyond, progress.attempt) == (3, (12, 15), 2)
        assert progress.consumed.count == 12
        assert ckpt.path_of(3).is_dir()
        with pytest.raises(FileNotFoundError, match="no checkpoint 0"):
            ckpt.restore(step.abstract_state(), step=0)


def test_damaged_checkpoint_names_its_step_folder_and_the_previous_one(tmp_path, model_factory):
    model = model_factory(0)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    step = TrainStep(model, make_loss("grpo"), tx, make_mesh(1, 1, devices=jax.devices()[:1]))
    with Checkpointer(tmp_path / "c", max_to_keep=3) as ckpt:
        for s in (2, 4):
            ckpt.save(step.init_state(model, step=s), Progress(s, s, s, jax.random.key(s)))
    folder = tmp_path / "c" / "4"
    for path in (folder / "params").rglob("*"):  # a copy cut short: every data file emptied
        if path.is_file():
            path.write_bytes(b"")
    with Checkpointer(tmp_path / "c") as ckpt, pytest.raises(UserError) as caught:
        ckpt.restore(step.abstract_state())
    first, second = str(caught.value).splitlines()
    assert first.startswith(f"checkpoint step 4 ({folder}) is damaged and cannot be restored (")
    assert second == (
        f"delete {folder} to resume from step 2 ({tmp_path / 'c' / '2'}, optimizer moments "
        "reset), or start over with another run_dir"
    )
    with Checkpointer(tmp_path / "c") as ckpt:  # the offered one restores
        _, progress = ckpt.restore(step.abstract_state(), step=2)
    assert progress.weight_version == 2


def test_only_the_newest_checkpoint_keeps_optimizer_state(tmp_path, model_factory):
    model = model_factory(0)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    step = TrainStep(model, make_loss("grpo"), tx, make_mesh(1, 1, devices=jax.devices()[:1]))
    state = step.init_state(model)
    moved = type(state)(state.params, jax.tree.map(lambda x: x + 1, state.opt_state), state.step)
    with Checkpointer(tmp_path / "c", max_to_keep=3) as ckpt:
        for s in (2, 4, 6):
            saved = type(moved)(moved.params, moved.opt_state, jax.numpy.asarray(s))
            ckpt.save(saved, Progress(s, s, s, jax.random.key(s)))
        assert [ckpt.has_optimizer_state(s) for s in (2, 4, 6)] == [False, False, True]
        items = {s: sorted(p.name for p in ckpt.path_of(s).iterdir() if p.is_dir()) for s in (4, 6)}
        assert items == {4: ["params", "progress"], 6: ["opt_state", "params", "progress"]}
        newest, _ = ckpt.restore(step.abstract_state())
        older, progress = ckpt.restore(step.abstract_state(), step=4)
    one = jax.tree.leaves(newest.opt_state)[0]
    assert np.asarray(one).ravel()[0] == 1  # the newest: the saved optimizer state
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(older.opt_state))  # zeros
    assert (int(older.step), progress.weight_version) == (4, 4)
    for key, value in older.params.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(newest.params[key]), key)
    sizes = {
        s: sum(f.stat().st_size for f in (tmp_path / "c" / str(s)).rglob("*") if f.is_file())
        for s in (4, 6)
    }
    opt_bytes = sum(
        f.stat().st_size for f in (tmp_path / "c" / "6" / "opt_state").rglob("*") if f.is_file()
    )
    # the older one is the newest less its opt_state (orbax's metadata and packing of the
    # params vary by a few KB between two saves)
    assert sizes[6] - sizes[4] > 0.9 * opt_bytes, (sizes, opt_bytes)
