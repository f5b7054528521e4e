"""Issue 13: two trainer processes (FSDP over 4 devices) push every version into a vLLM engine
at TP 2, each TP rank receiving its region from both (fan-in); afterwards the engine's greedy
tokens equal transformers' on the exported final checkpoint, token for token, and its
log-probs of those tokens at T=0.7 match transformers' within 1e-4, and the weights it serves
moved from the starting checkpoint's.

The gateway and the engine are started on their own (the launcher's stack functions) and the
job joins them (``launch.gateway``), so the engine still serves the last version when the job
has ended. Real processes; run under the heavy lock.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gateway import messages as m
from gateway.client import GatewayClient
from models.checkpoints.hf_io import read_hf_config
from models.config import ModelConfig
from tests.integration.smoke_job import REPO, child_env, jsonl_rows, smoke_command
from trainer.eval.export import export_checkpoint
from trainer.launch.job_config import load_job_config
from trainer.launch.model_source import resolve_model
from trainer.launch.processes import ProcessSet
from trainer.launch.stack import start_engines, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
STEPS = 4
PROMPTS = [[1, 5, 9, 23, 7], [1, 40, 41, 42], [1, 17, 3, 99, 100, 12, 8]]


def _helpers():
    path = Path(__file__).with_name("vllm_helpers.py")
    spec = importlib.util.spec_from_file_location("vllm_helpers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _serve(client: GatewayClient, temperature: float) -> list[tuple[list[int], list[float]]]:
    """Each prompt once at `temperature`, 12 tokens (EOS ignored), at version STEPS."""
    sampling = m.SamplingParams(temperature=temperature, max_new_tokens=12, ignore_eos=True)
    client.submit_prompts([
        m.Prompt(f"t{temperature}-{i}", np.asarray(p, np.int32), 1, sampling, min_version=STEPS)
        for i, p in enumerate(PROMPTS)
    ])  # fmt: skip
    got: dict[str, tuple[list[int], list[float]]] = {}
    while len(got) < len(PROMPTS):
        for g in client.fetch_rollouts(len(PROMPTS), timeout_s=120.0):
            (c,) = g.completions
            assert (c.version_start, c.version_end) == (STEPS, STEPS)
            got[g.sample_id] = (list(map(int, c.token_ids)), list(map(float, c.logprobs)))
    return [got[f"t{temperature}-{i}"] for i in range(len(PROMPTS))]


def test_vllm_tp2_serves_the_fanned_in_weights_of_two_trainer_processes(tmp_path, monkeypatch):
    H = _helpers()
    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    settings = ["rollout.backend=vllm", "launch.devices_per_engine=2",
                "launch.engine_dtype=float32", "eval.size=0", "optim.weight_decay=50"]  # fmt: skip
    job = load_job_config(str(REPO / "configs" / "smoke.yaml"), [f"run_dir={run_dir}", *settings])
    model = resolve_model(job.run.model.path)
    family = ModelConfig.from_hf(read_hf_config(model)).family
    procs = ProcessSet(tmp_path / "stack")
    (run_dir / "logs").mkdir(parents=True)
    try:
        address = start_gateway(job, procs, run_dir, family)
        tokens = run_dir / "tokens.txt"
        start_engines(job, procs, address, tokens, model, 256)
        done = subprocess.run(
            smoke_command(run_dir, *settings, "launch.trainer_processes=2",
                          "launch.trainer_devices=2", f"launch.gateway={address}",
                          f"launch.token_file={tokens}"),
            cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        metrics = jsonl_rows(run_dir / "metrics.jsonl")
        assert [r["sync_tp_shards"] for r in metrics] == [2] * STEPS
        sends = jsonl_rows(run_dir / "logs" / "trainer1_sends.jsonl")
        assert [r["version"] for r in sends if r["ok"]] == list(range(1, STEPS + 1))
        client = GatewayClient.from_token_file(address, tokens, "trainer")
        try:
            assert [e.weight_version for e in client.status().engines] == [STEPS]
            greedy = _serve(client, 0.0)
            warm = _serve(client, 0.7)
        finally:
            client.close()
    finally:
        procs.stop_all()
    hf = H.hf_model(export_checkpoint(run_dir / "checkpoints" / str(STEPS), tmp_path / "hf"))
    for prompt, (ids, _) in zip(PROMPTS, greedy, strict=True):
        assert ids == H.hf_greedy(hf, prompt, 12), prompt
    for prompt, (ids, logprobs) in zip(PROMPTS, warm, strict=True):
        want = H.hf_logprobs(hf, prompt, ids, 0.7)
        np.testing.assert_allclose(logprobs, want, atol=1e-4, rtol=0, err_msg=str(prompt))
    # the weights moved (weight decay shrinks them every step): the served version is not the
    # starting checkpoint's
    start = dict(H.hf_model(model).named_parameters())
    moved = max(float((p - start[n]).abs().max().detach()) for n, p in hf.named_parameters())
    assert moved > 1e-3, moved
