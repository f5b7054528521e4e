"""`python -m trainer eval`: start the engines the way the main job does, sample every problem,
score it with math-verify, save one JSONL row per problem and the metrics.

1. resolve the checkpoint (`trainer.launch.model_source`: an HF folder, ``smollm2``,
   ``tiny:VARIANT``; a ``RUN_DIR[/checkpoints/STEP]`` is exported once to
   ``RUN_DIR/exports/STEP`` and reused by later evaluations,
   `trainer.eval.export.export_once`), hold it against its family's mapping, load the tokenizer
   and the problems (`trainer.eval.problems`) and size the engines' context,
   all before any process starts;
2. start the gateway and ``launch.num_engines`` engines of ``rollout.backend`` with
   `trainer.launch.stack` (the main job's launcher; the engines serve the checkpoint's weights,
   version 0); both engines take the eval temperature per request;
3. submit every problem with ``eval.samples`` completions (`trainer.launch.evaluate`), with a
   progress bar, and score them in a thread pool;
4. write ``OUT/completions.jsonl`` (`trainer.eval.rows`) and ``OUT/summary.json`` (pass@1,
   pass@k, maj@k, mean completion length, fraction cut at the length limit, and what was
   evaluated), then stop every process it started (also on an error or Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from trainer.launch.job_config import JobConfig

log = logging.getLogger(__name__)


def out_dir_of(job: JobConfig) -> Path:
    """The eval command's output folder (eval.out_dir, default runs/eval), absolute."""
    return Path(job.eval.out_dir or "runs/eval").absolute()


def run_eval(job: JobConfig) -> dict[str, Any]:
    """Evaluate (see the module docstring); returns the summary also saved as
    ``OUT/summary.json``: the metrics of `trainer.eval.metrics.summarize` plus model (a run's
    ``RUN_DIR/checkpoints/STEP``, with run_dir, step and exported_to), data, backend,
    temperature, max_new_tokens, wall_time_s and the paths written.

    Raises:
      FileNotFoundError, KeyError, ValueError: the model or data cannot be read (nothing was
        started); RuntimeError: a child process exited early (its log's tail inside);
        TimeoutError: engines did not register, or no group came back for eval.timeout_s.
    """
    from transformers import AutoTokenizer

    from gateway import messages as m
    from gateway.client import GatewayClient
    from models.checkpoints.hf_io import read_hf_config
    from models.config import ModelConfig
    from trainer.eval.problems import eval_problems
    from trainer.eval.rows import problem_row, summary_from_rows
    from trainer.launch.data import make_decoder, make_encoder
    from trainer.launch.evaluate import gather_eval_groups
    from trainer.launch.job import _context_length
    from trainer.launch.model_source import check_checkpoint
    from trainer.launch.processes import ProcessSet
    from trainer.launch.stack import start_engines, start_gateway, wait_for_engines
    from trainer.rewards import MathVerifier, ScoringPool

    t0 = time.monotonic()
    out = out_dir_of(job)
    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    model_path, scored = _model_folder(job)
    family = ModelConfig.from_hf(read_hf_config(model_path)).family
    check_checkpoint(model_path, family)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    problems = eval_problems(job)
    if not problems:
        raise ValueError("eval: the data holds no problem")
    if job.data.verifier is not None:  # the data file's verifier is math-verify unless set
        problems = [dataclasses.replace(p, verifier=job.data.verifier) for p in problems]
    encode, decode = make_encoder(tokenizer, job.data.system_prompt), make_decoder(tokenizer)
    prompts = {p.problem_id: encode(p) for p in problems}
    new_tokens = job.eval.max_new_tokens or job.run.rollout.max_new_tokens
    max_len = _context_length([len(ids) for ids in prompts.values()], new_tokens)
    r = job.run.rollout
    sampling = m.SamplingParams(
        temperature=job.eval_temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=new_tokens
    )
    verifier = MathVerifier()
    launch = job.launch
    with ProcessSet(out / "logs", launch.stop_timeout_s) as procs:
        address = start_gateway(job, procs, out, family)
        tokens = out / "tokens.txt"
        client = GatewayClient.from_token_file(address, tokens, "trainer", margin_s=10.0)
        try:
            client.wait_ready(30.0)
            client.configure(m.RunSettings(model_family=family, dtype=job.engine_dtype,
                                           transport="gloo", backends=job.backends))  # fmt: skip
            start_engines(job, procs, address, out / "tokens.txt", model_path, max_len)
            engine_ids = wait_for_engines(client, launch.num_engines, launch.start_timeout_s, procs)
            bar = _progress(launch.progress, len(problems))
            with ScoringPool(max_workers=r.scoring_workers, decode=decode,
                             verifiers={"math": verifier}) as scoring:  # fmt: skip
                groups, _ = gather_eval_groups(
                    client, problems, lambda p: prompts[p.problem_id], scoring, sampling,
                    samples=job.eval.samples, version=0, tag="eval", timeout_s=job.eval.timeout_s,
                    on_progress=bar,
                )  # fmt: skip
            client.shutdown("the evaluation finished")
        finally:
            client.close()
        procs.wait_all(launch.stop_timeout_s)
        exit_codes = procs.stop_all()
    rows = [
        problem_row(p, decode(prompts[p.problem_id]), g, decode, verifier.extract)
        for p, g in groups
    ]
    with (out / "completions.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    summary: dict[str, Any] = {
        **summary_from_rows(rows),
        **scored,
        "data": job.eval.data or job.data.path,
        "backend": r.backend,
        "engine_ids": engine_ids,
        "temperature": job.eval_temperature,
        "max_new_tokens": new_tokens,
        "completions": str(out / "completions.jsonl"),
        "exit_codes": exit_codes,
        "wall_time_s": time.monotonic() - t0,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def is_run_checkpoint(spec: str) -> bool:
    """True when `spec` names a run folder (``RUN_DIR/checkpoints``) or one of its
    ``RUN_DIR/checkpoints/STEP`` folders rather than an HF folder."""
    path = Path(spec)
    return (path / "checkpoints").is_dir() or (
        path.parent.name == "checkpoints" and path.name.isdigit() and path.is_dir()
    )


def _model_folder(job: JobConfig) -> tuple[Path, dict[str, Any]]:
    """The HF folder the engines load and what the summary says was scored: model.path
    resolved (``model``: that folder), or a run's checkpoint exported once to
    ``RUN_DIR/exports/STEP`` (`trainer.eval.export.export_once`; ``model``:
    ``RUN_DIR/checkpoints/STEP``, with ``run_dir``, ``step`` and ``exported_to``)."""
    from trainer.launch.model_source import resolve_model

    spec = job.run.model.path
    if spec and is_run_checkpoint(spec):
        from trainer.eval.export import export_once

        folder, run_dir, step = export_once(spec)
        return folder, {
            "model": str(run_dir / "checkpoints" / str(step)),
            "run_dir": str(run_dir),
            "step": step,
            "exported_to": str(folder),
        }
    path = resolve_model(spec, job.run.trainer.seed)
    return path, {"model": str(path)}


def _progress(show: bool, total: int) -> Any:
    """An `on_progress(back, total)` callback drawing a tqdm bar of problems back (or nothing)."""
    if not show:
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="eval", unit="problem", dynamic_ncols=True)

    def on_progress(back: int, _total: int) -> None:
        bar.update(back - bar.n)
        if back >= total:
            bar.close()

    return on_progress


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end: every pass@k / maj@k, mean length, length cut-offs."""
    keys = [k for k in summary if k.startswith(("pass@", "maj@"))]
    head = f"{summary['problems']} problems x {summary['samples']} samples ({summary['backend']}"
    head += f", T={summary['temperature']}, {summary['max_new_tokens']} new tokens)"
    metrics = "  ".join(f"{k} {summary[k]:.4f}" for k in keys)
    tail = (
        f"mean completion length {summary['mean_length']:.1f} tokens; "
        f"{summary['length_cut_fraction']:.3f} cut at the length limit"
    )
    return "\n".join([head, metrics, tail, f"rows: {summary['completions']}"])
