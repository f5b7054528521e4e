"""Progress/TensorBoard reporter and the reward/lag plot."""

from __future__ import annotations

import json

from trainer.launch.report import Reporter, plot_metrics, read_metrics


def _row(step: int) -> dict:
    return {"step": step, "reward_mean": 0.1 * step, "reward_std": 0.05, "lag_mean": 0.5,
            "lag_max": 1, "tokens_per_s": 100.0, "flag": True}  # fmt: skip


def test_reporter_writes_scalars_and_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporter = Reporter(tmp_path, total_steps=3, show_bar=False)
    for step in (1, 2, 3):
        reporter.on_metrics(_row(step))
        with (tmp_path / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(_row(step)) + "\n")
    reporter.on_eval("after", 0.25, 3)
    reporter.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    rewards = [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")]
    assert rewards == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(3, 0.25)]
    assert "flag" not in acc.Tags()["scalars"]  # booleans are not scalars
    assert len(read_metrics(tmp_path)) == 3
    png = plot_metrics(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
