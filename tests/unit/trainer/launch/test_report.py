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


def test_eval_rows_reach_tensorboard_and_the_plot(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.launch.eval_every import append_row

    reporter = Reporter(tmp_path, total_steps=4, show_bar=True)
    for step in (1, 2, 3, 4):
        append_row(tmp_path, _row(step))
        if step % 2 == 0:
            row = {"step": step, "version": step, "eval/tag": f"step{step}",
                   "eval/accuracy": step / 8, "eval/pass@2": step / 4}  # fmt: skip
            append_row(tmp_path, row)
            reporter.on_eval_row(row)
    reporter.on_eval_row({"step": 4, "version": 4, "eval/tag": "x", "eval/error": "TimeoutError"})
    reporter.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(2, 0.25), (4, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/pass@2")] == [(2, 0.5), (4, 1.0)]
    err = "".join(capsys.readouterr())  # tqdm.write: stdout
    assert "held-out accuracy step2 (step 2, version 2): 0.250" in err
    assert "held-out evaluation x (step 4) failed: TimeoutError" in err
    assert plot_metrics(tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # eval rows skipped


def test_eval_progress_bar_counts_groups_back(tmp_path, capsys):
    reporter = Reporter(tmp_path, total_steps=3, show_bar=True)
    for back in (0, 1, 3, 4):
        reporter.on_eval_progress("before", back, 4)
    assert "before" not in reporter._eval_bars  # closed once every group is back
    reporter.on_eval_progress("after", 2, 4)
    try:
        reporter.on_eval_progress("after", 5, 4)
        raise AssertionError("5/4 accepted")
    except ValueError as err:
        assert "5/4 is out of range" in str(err)
    reporter.close()
    err = capsys.readouterr().err
    for shown in ("eval before:  25%", "1/4", "3/4", "eval after:  50%", "2/4"):
        assert shown in err, err


def test_failure_summary_and_stop_line(tmp_path):
    import time

    from trainer.launch.report import failure_summary, format_summary

    started = time.time() - 1
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n" + json.dumps(_row(2)))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 2, "stop_reason": "x"}))
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    out = failure_summary(tmp_path, TimeoutError("no group arrived"), started)
    assert out["stop_reason"] == "TimeoutError: no group arrived"
    assert (out["loop"]["steps"], out["checkpoint_steps"], out["last_metrics_step"]) == (2, [2], 2)
    stale = failure_summary(tmp_path, RuntimeError("x"), time.time() + 60)
    assert stale["loop"] is None  # summary.json from an earlier run is not this run's
    loop = {"steps": 2, "version": 2, "submitted": 12, "trained_groups": 8, "filtered_lag": 0,
            "filtered_zero_variance": 0, "filtered_aborted": 0, "in_flight": 4}  # fmt: skip
    text = format_summary({"loop": loop, "backend": "jax", "stop_reason": "interrupted (SIGINT)"})
    assert "stopped: interrupted (SIGINT); checkpoint at step 2 (rerun the same command" in text


def test_the_plot_is_shown_relative_to_the_working_folder(tmp_path, monkeypatch):
    from trainer.launch.report import format_summary

    loop = {"steps": 1, "version": 1, "submitted": 1, "trained_groups": 1, "filtered_lag": 0,
            "filtered_zero_variance": 0, "filtered_aborted": 0, "in_flight": 0}  # fmt: skip
    monkeypatch.chdir(tmp_path)
    inside = format_summary({"loop": loop, "backend": "jax", "plot": str(tmp_path / "r/p.png")})
    assert inside.splitlines()[-1] == "plot: r/p.png"
    outside = format_summary({"loop": loop, "backend": "jax", "plot": "/elsewhere/p.png"})
    assert outside.splitlines()[-1] == "plot: /elsewhere/p.png"
