"""The main job (`python -m trainer train`): gateway, engines and trainer on one machine.

`run_job(job)`:
1. resolves the checkpoint (`model_source`) and holds it against its family's mapping, loads the
   tokenizer and the problems, and sizes the engines' context (longest prompt + new tokens):
   starts W&B when ``logging.wandb`` asks for it (`wandb_log`): all before any process starts,
   so a checkpoint missing a tensor, a missing data file or a W&B that cannot start fails in
   seconds;
2. starts the gateway and the engines (`stack`), or joins ``launch.gateway`` when the serving
   side runs elsewhere; configures the run (family, engine dtype, gloo);
3. loads the policy into JAX and builds the train step while the engines start (with
   ``launch.trainer_processes`` > 1: starts that many trainer processes instead, process 0
   doing steps 3-4, `trainer.launch.trainer_processes`);
4. evaluates the held-out split (version 0 or the resumed one), runs `AsyncTrainer` with a
   progress bar and TensorBoard, evaluates again at the final version (taking back every
   training group still in flight at the stop), plots reward and lag;
5. shuts the gateway down (engines exit on their own), then stops every child process
   (SIGTERM, then SIGKILL after launch.stop_timeout_s). An exception or Ctrl-C stops them too.
   Only what this process started is stopped: a gateway joined through ``launch.gateway``
   (and its engines) keeps running, after a success or a failure, unless launch.stop_joined.

Its result (also ``RUN_DIR/job_summary.json``) holds the loop totals, the in-flight groups
taken back after the stop, the engines' final versions, held-out accuracy before and after,
the wall time, the plot's path, and why the run stopped (``stop_reason``; ``exit_code`` is 128 +
the signal after a graceful SIGINT/SIGTERM stop). ``job_summary.json`` is written on every way
out: when the job fails, it holds the error, the loop totals so far and the checkpoints saved
(`trainer.launch.report.failure_summary`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from trainer.launch.commands import run_settings, trainer_env
from trainer.launch.job_config import JOB_SECTIONS, JobConfig
from trainer.launch.library_logs import route_library_logs, unroute_library_logs
from trainer.user_error import UserError

ERROR_LOG = "trainer_error.log"

log = logging.getLogger(__name__)


def _context_length(lengths: list[int], new_tokens: int) -> int:
    """Positions an engine needs: the longest prompt plus `new_tokens`, rounded up to 16."""
    return int(math.ceil((max(lengths) + new_tokens) / 16) * 16)


def run_job(job: JobConfig) -> dict[str, Any]:
    """Run the whole job; returns the job summary (see the module docstring).

    Raises:
      RuntimeError: a child process exited early (its log's tail inside); TimeoutError: engines
        did not register, or rollouts did not come; whatever the trainer raised. Each after
      writing ``RUN_DIR/job_summary.json`` with the error.
    """
    from trainer.launch import interrupt
    from trainer.launch.report import failure_summary

    started = time.time()
    run_dir = job.run_dir.absolute()

    def write_failure(err: BaseException) -> None:
        if run_dir.is_dir():
            result = failure_summary(run_dir, err, started)
            (run_dir / "job_summary.json").write_text(json.dumps(result, indent=2) + "\n")
            write_traceback(run_dir, err)

    interrupt.at_forced_exit(lambda: write_failure(KeyboardInterrupt("forced stop (busy)")))
    quiet = route_library_logs(run_dir / "logs")  # absl/orbax notes: off the progress bar
    try:
        return _run_job(job)
    except BaseException as err:
        write_failure(err)
        raise
    finally:
        unroute_library_logs(quiet)


def error_log(run_dir: Path) -> Path:
    """Where a failed job's traceback goes: ``RUN_DIR/logs/trainer_error.log``."""
    return run_dir.absolute() / "logs" / ERROR_LOG


def write_traceback(run_dir: Path, err: BaseException) -> None:
    """Write `err`'s traceback (with its causes) to `error_log(run_dir)`."""
    import traceback

    path = error_log(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(err)))


def _preflight(job: JobConfig) -> tuple[Path, str]:
    """The checkpoint folder and its family, held against the family's mapping.

    Raises:
      UserError: model.path names no HF folder (or an unknown tiny variant, or SmolLM2's
        package is missing), its model_type selects no family, the folder does not match
        the family's mapping, routes are asked for (routing replay) from a dense model, or
        the mesh and the loss do not fit the model (trainer.tp, trainer.ep,
        loss.moe_aux_coef: `trainer.launch.model_fit`).
    """
    from models.checkpoints.hf_io import read_hf_config
    from models.config import ModelConfig
    from trainer.launch.model_fit import check_model_fit
    from trainer.launch.model_source import check_checkpoint, resolve_model

    try:
        model_path = resolve_model(job.run.model.path, job.run.trainer.seed)
        model_cfg = ModelConfig.from_hf(read_hf_config(model_path))
        family = model_cfg.family
        check_checkpoint(model_path, family)
        check_model_fit(model_cfg, job.run)
    except (OSError, KeyError, ValueError) as err:  # MappingError is a ValueError
        text = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise UserError(str(text)) from err
    return model_path, family


def _run_job(job: JobConfig) -> dict[str, Any]:
    t_start = time.monotonic()
    run_dir = job.run_dir.absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(_plain(job), sort_keys=False))
    for key, value in trainer_env(job, os.environ).items():
        os.environ[key] = value  # before JAX is imported: the trainer's own devices

    from transformers import AutoTokenizer

    from gateway.client import GatewayClient
    from gateway.errors import GatewayError
    from trainer.launch import joined
    from trainer.launch.data import load_job_data, make_decoder, make_encoder
    from trainer.launch.processes import ProcessSet
    from trainer.launch.stack import start_engines, start_gateway

    # math-verify warns on every call that its signal-based timeout is off (scoring runs in
    # threads, see trainer.rewards.math_verifier): keep that off the progress bar
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    model_path, family = _preflight(job)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    try:
        data = load_job_data(job)
    except (OSError, ValueError) as err:  # a data file that is not there, a bad row
        raise UserError(str(err)) from err
    encode = make_encoder(tokenizer, job.data.system_prompt)
    episodes = job.run.rollout.episodes()
    problems = [*data.train, *data.held_out]
    if episodes is None:
        lengths = [len(encode(p)) for p in problems]
        new_tokens = max(job.run.rollout.max_new_tokens, job.eval.max_new_tokens or 0)
    else:  # the first message, then a whole episode (model turns and observations)
        lengths = [len(encode(episodes.as_prompt_problem(p))) for p in problems]
        new_tokens = episodes.max_tokens
    max_len = _context_length(lengths, new_tokens)
    log.info("%d training / %d held-out problems; context %d", len(data.train),
             len(data.held_out), max_len)  # fmt: skip

    from trainer.launch.wandb_log import wandb_run

    launch, decode = job.launch, make_decoder(tokenizer)
    # W&B starts (or fails) before any process; it finishes after they are stopped
    with (
        wandb_run(job, run_dir, decode, _plain(job)) as wandb,
        ProcessSet(run_dir / "logs", launch.stop_timeout_s) as procs,
    ):
        if launch.gateway:
            address = launch.gateway
            token_file = Path(launch.token_file or run_dir / "tokens.txt")
            client = joined.connect(
                address, token_file, launch.gateway_wait_s, launch.gateway_ca_file or None
            )
        else:
            address = start_gateway(job, procs, run_dir, family)
            token_file = run_dir / "tokens.txt"
            client = GatewayClient.from_token_file(address, token_file, "trainer", margin_s=10.0)
            client.wait_ready(30.0)
        try:
            try:
                if launch.gateway:  # a gateway left at a finished run's version: refuse it
                    joined.check_start_version(client, address, run_dir, job.run.trainer.resume)
                client.configure(run_settings(job, family))
            except GatewayError as err:
                refused = joined.refused_token(err, address, token_file)
                if refused is None:
                    raise
                raise refused from err
            if not launch.gateway:
                start_engines(job, procs, address, token_file, model_path, max_len)
                if launch.progress:  # the engines take a while to start: say so
                    kinds = ", ".join(job.backend_of(i) for i in range(launch.num_engines))
                    print(f"started the gateway and {launch.num_engines} engine(s) ({kinds}); "
                          "waiting for them to register (vLLM takes about a minute)",
                          file=sys.stderr, flush=True)  # fmt: skip
            if launch.trainer_processes > 1:  # P processes, out of this one
                from trainer.launch.trainer_processes import run_trainer_processes

                result = run_trainer_processes(job, procs, client, address, token_file, model_path)
            else:
                from trainer.launch.training import train_and_evaluate

                result = train_and_evaluate(
                    job, client, procs, model_path, data, encode, decode, wandb=wandb
                )
            if not launch.gateway or launch.stop_joined:
                client.shutdown("the training job finished")
        except BaseException as e:
            if launch.gateway and launch.stop_joined:  # asked to: a joined gateway goes too
                with contextlib.suppress(GatewayError):
                    client.shutdown(f"the trainer failed: {type(e).__name__}"[:200])
            raise
        finally:
            client.close()
        procs.wait_all(launch.stop_timeout_s)
        result["exit_codes"] = procs.stop_all()
    result["wall_time_s"] = time.monotonic() - t_start
    (run_dir / "job_summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _plain(job: JobConfig) -> dict[str, Any]:
    """The job config as plain YAML-able data (the run's sections at the top level)."""
    out = job.run.model_dump(mode="json")
    out.update({k: getattr(job, k).model_dump(mode="json") for k in JOB_SECTIONS})
    return out
