"""`python -m rollout_engine`: help answers fast without ML imports; flags become a validated
config (family read from config.json); bad input is refused naming what was expected."""

import json
import subprocess
import sys
import time

import pytest

from rollout_engine.cli import device_counts, engine_spec, parse
from rollout_engine.config import family_of


def _model(tmp_path, model_type="qwen2"):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def test_help_is_fast_and_imports_no_ml_library():
    code = (
        "import sys, contextlib, io\n"
        "from rollout_engine.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "print(sorted(m for m in ('jax', 'torch', 'vllm', 'flax') if m in sys.modules))\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert time.monotonic() - t0 < 5  # about 0.5 s alone; generous for a loaded machine
    assert out.stdout.strip() == "[]"


def test_flags_become_a_validated_config(tmp_path):
    model = _model(tmp_path)
    cfg = parse(
        ["--backend", "vllm", "--gateway", "127.0.0.1:5000", "--token-file", "t.txt",
         "--model", str(model), "--dtype", "float32", "--max-concurrent-prompts", "3",
         "--vllm-tensor-parallel-size", "2", "--jax-temperature", "0.5", "--transports", "gloo",
         "--vllm-block-size", "32"]
    )  # fmt: skip
    assert cfg.family == "qwen2" and cfg.dtype == "float32" and cfg.transports == ("gloo",)
    assert cfg.worker.max_concurrent_prompts == 3 and cfg.worker.lease_batch == 8
    assert cfg.vllm.tensor_parallel_size == 2 and cfg.jax.temperature == 0.5
    assert cfg.vllm.block_size == 32
    assert device_counts(cfg) == (2, 2)
    assert device_counts(cfg.model_copy(update={"backend": "jax"})) == (1, 1)
    assert cfg.jax.ignore_eos is False
    args = ["--backend", "jax", "--gateway", "h:1", "--token-file", "t", "--model", str(model)]
    assert parse([*args, "--jax-ignore-eos", "true"]).jax.ignore_eos is True
    assert parse([*args, "--jax-ignore-eos", "false"]).jax.ignore_eos is False  # not bool("false")
    lora = parse([*args, "--lora-rank", "4", "--lora-targets", "q_proj,v_proj"])
    assert (lora.lora_rank, lora.lora_targets) == (4, ("q_proj", "v_proj"))
    assert engine_spec(lora).adapter == "lora r=4 targets=q_proj,v_proj"  # checked at register
    assert engine_spec(cfg).adapter == ""
    assert (cfg.lora_rank, cfg.lora_targets) == (0, ())


def test_bad_input_is_refused(tmp_path, capsys):
    model = _model(tmp_path)
    base = ["--backend", "jax", "--token-file", "t", "--model", str(model)]
    with pytest.raises(SystemExit):
        parse([*base, "--gateway", "no-port"])
    assert "expected HOST:PORT, got 'no-port'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([*base, "--gateway", "h:1", "--max-concurrent-prompts", "0"])
    assert "max_concurrent_prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([*base, "--gateway", "h:1", "--jax-ignore-eos", "maybe"])
    assert "--jax-ignore-eos: invalid boolean value: 'maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--backend", "jax", "--gateway", "h:1", "--token-file", "t", "--model", "/nope"])
    assert "expected an HF checkpoint folder, got '/nope'" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        family_of(_model(other, "bert"))


def test_a_sigterm_after_the_worker_stopped_leaves_the_exit_status(tmp_path):
    """A launcher stopping gateway and engine together: the worker ends on the gateway's
    shutdown, the loop (and its signal handlers) closes, then the engine's own SIGTERM lands
    during the exit. The process still exits with its status (0), not -15 (seen in CI)."""
    model = _model(tmp_path)
    code = (
        "import asyncio, os, signal, sys\n"
        "import rollout_engine.cli as cli\n"
        "async def serve(cfg):\n"  # stands in for the worker: handlers on the loop, then stops
        "    loop = asyncio.get_running_loop()\n"
        "    loop.add_signal_handler(signal.SIGTERM, lambda: None)\n"
        "    return 'shutdown'\n"
        "cli.serve = serve\n"
        f"status = cli.main(['--backend', 'jax', '--gateway', '127.0.0.1:1', '--token-file',"
        f" 't', '--model', {str(model)!r}, '--log-level', 'WARNING'])\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('exiting', status, flush=True)\n"
        "sys.exit(status)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "exiting 0"), out.stderr
