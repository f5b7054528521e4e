"""W&B beside TensorBoard (`trainer.launch.wandb_log`): an offline run written through the
`Reporter` and read back from its ``run-ID.wandb`` transaction log and table files (no
network); a run that cannot start fails at once naming logging.wandb; disabled imports nothing.

The job-level test (the real trainer's rows) is tests/integration/test_wandb_job.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.wandb_records import finished_records, history, run_config, run_folder
from trainer.launch.job_config import load_job_config
from trainer.launch.report import Reporter
from trainer.launch.wandb_log import SAMPLE_COLUMNS, start_wandb, wandb_run
from trainer.rollouts import Completion, RolloutGroup

pytest.importorskip("wandb")


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    """W&B kept inside tmp_path: its folders, no API key, no network."""
    for key in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wbconfig"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wbcache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wbdata"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path / "wb"


def _decode(ids):
    return " ".join(f"t{i}" for i in ids)


def _group(step: int, g: int) -> RolloutGroup:
    completions = [
        Completion(
            token_ids=[10 + g, 11, step],
            logprobs=[-0.5, -0.25, -0.125],
            finish_reason="stop",
            version_start=step - 1,
            version_end=step - 1,
            reward=float(g % 2),
            text=None if g else f"text {step}",
        )  # fmt: skip
        for _ in range(2)
    ]
    return RolloutGroup(f"s{step}-{g}", [1, 2, 3 + g], completions)


def _row(step: int) -> dict:
    return {"step": step, "version": step, "reward_mean": 0.125 * step, "lag_max": 1,
            "train/loss": -0.5 / step, "flag": True, "note": "x"}  # fmt: skip


def test_offline_run_holds_metrics_config_and_sample_tables(tmp_path, offline_env):
    job = load_job_config(None, [f"run_dir={tmp_path / 'run'}", "logging.wandb.mode=offline",
                                 "logging.wandb.samples_every=2",
                                 "logging.wandb.samples_per_table=3"])  # fmt: skip
    config = {"logging": job.logging.model_dump(mode="json"), "trainer": {"steps": 5}}
    with wandb_run(job, tmp_path / "run", _decode, config) as wb:
        assert wb is not None
        reporter = Reporter(tmp_path / "run", 5, show_bar=False, wandb=wb)
        reporter.on_eval("before", 0.25, 0)
        for step in range(1, 6):
            reporter.on_metrics(_row(step))
            wb.on_groups(step, [_group(step, g) for g in range(4)])
        reporter.on_eval("after", 0.75, 5)
        reporter.close()
    assert wb.tables_logged == 3  # steps 1, 2, 4

    run = run_folder(offline_env)
    rows = history(run)
    assert sorted(rows) == [0, 1, 2, 3, 4, 5]
    for step in range(1, 6):
        assert rows[step]["reward_mean"] == 0.125 * step
        assert rows[step]["train/loss"] == -0.5 / step
        assert rows[step]["version"] == step and rows[step]["lag_max"] == 1
        assert "flag" not in rows[step] and "note" not in rows[step]
    assert rows[0]["eval/accuracy"] == 0.25 and rows[5]["eval/accuracy"] == 0.75
    tables = {s: r for s, r in rows.items() if "samples/nrows" in r}
    assert sorted(tables) == [1, 2, 4]
    assert all(r["samples/nrows"] == 3 and r["samples/_type"] == "table-file"
               for r in tables.values())  # fmt: skip
    table = json.loads((run / "files" / tables[4]["samples/path"]).read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"] == [
        [4, "t1 t2 t3", "text 4", 0.0, 3],  # the engine's text when it sent one
        [4, "t1 t2 t4", "t11 t11 t4", 1.0, 3],  # else the decoded token ids
        [4, "t1 t2 t5", "t12 t11 t4", 0.0, 3],
    ]
    cfg = run_config(run)
    assert cfg["logging"] == config["logging"] and cfg["trainer"] == {"steps": 5}


def test_online_without_api_key_fails_at_start_naming_the_section(tmp_path, offline_env):
    job = load_job_config(None, [f"run_dir={tmp_path / 'run'}", "logging.wandb.mode=online",
                                 "logging.wandb.init_timeout_s=20"])  # fmt: skip
    with pytest.raises(RuntimeError, match=r"logging\.wandb: wandb\.init failed \(mode=online.*"
                       r"UsageError: No API key configured"):  # fmt: skip
        start_wandb(job, tmp_path / "run", _decode, {})


def test_failed_block_marks_the_run_failed_and_reraises(tmp_path, offline_env):
    job = load_job_config(None, [f"run_dir={tmp_path / 'run'}", "logging.wandb.mode=offline"])
    with pytest.raises(ValueError, match="boom"), wandb_run(job, tmp_path / "run", _decode, {}):
        raise ValueError("boom")
    records = finished_records(run_folder(offline_env))
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]


def test_bad_mode_is_a_config_error():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"logging\.wandb\.mode: Input should be 'disabled'"):
        load_job_config(None, ["logging.wandb.mode=offlin"])
    with pytest.raises(ConfigError, match=r"logging\.wandb has no 'sample_every'"):
        load_job_config(None, ["logging.wandb.sample_every=3"])


def test_disabled_does_not_import_wandb(tmp_path):
    code = (
        "import sys\n"
        "from trainer.launch.job_config import load_job_config\n"
        "from trainer.launch.wandb_log import wandb_run\n"
        "job = load_job_config(None, [])\n"
        "with wandb_run(job, __import__('pathlib').Path(sys.argv[1]), str, {}) as wb:\n"
        "    assert wb is None\n"
        "print('wandb' in sys.modules)\n"
    )
    repo = Path(__file__).resolve().parents[4]
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=repo,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
