"""The trainer's part of the main job, once the gateway answers and engines are starting.

Builds the model, train step, checkpointer (resuming from ``RUN_DIR/checkpoints`` when asked:
it prints "resuming from step N (checkpoint PATH)"; the problems in flight at that checkpoint
are submitted again), weight publisher (gloo) and rollout source; evaluates the held-out split
(with a progress bar of groups back), trains ``trainer.steps`` updates with a progress bar,
TensorBoard and W&B (``logging.wandb``), evaluates again at the final version while taking
back the training groups still in flight, and plots reward, lag and held-out accuracy. With
``eval.every=N`` it also evaluates every N steps on the running engines
(`trainer.launch.eval_every`), and every evaluation of the run (before, in-loop, after) is a
row of metrics.jsonl with its step and weight version.
A SIGINT or SIGTERM during training stops it after the update under way and a checkpoint
(`trainer.launch.interrupt`); the final evaluation is then skipped and the result's
``exit_code`` is 128 + the signal.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from gateway import messages as m
from gateway.client import GatewayClient
from models.checkpoints.hf_io import load_hf_checkpoint
from models.sharding import make_mesh, mesh_devices
from trainer.build import train_step_from_config
from trainer.checkpointing import Checkpointer, Progress
from trainer.data import ProblemStream
from trainer.data.problem import Problem
from trainer.launch import interrupt
from trainer.launch.commands import data_plane_config, far_data_plane_config, far_engine_names
from trainer.launch.data import JobData
from trainer.launch.eval_every import EvalEvery, append_row, eval_row
from trainer.launch.evaluate import EvalResult, drain_training_groups, evaluate
from trainer.launch.job_config import JobConfig
from trainer.launch.processes import ProcessSet
from trainer.launch.report import Reporter, plot_metrics, read_metrics, reward_ends
from trainer.launch.stack import wait_for_engines
from trainer.launch.supervisor import EngineSupervisor, deregister_dead
from trainer.launch.wandb_log import WandbLogger
from trainer.leader import (
    Leader,
    LeaderCheckpointer,
    LeaderPublisher,
    LeaderStep,
    with_transfer_servers,
)
from trainer.loop import AsyncTrainer
from trainer.positions import ConsumedPositions, PositionLedger
from trainer.publish import WeightPublisher
from trainer.rewards import ScoringPool
from trainer.rollout_source import RolloutSource
from trainer.run_files import next_attempt
from trainer.train_step import TrainStep
from transport.adapter_spec import AdapterSpec
from transport.config import serves_blocks


def _sampling(
    job: JobConfig, temperature: float, new_tokens: int, routes: bool = False
) -> m.SamplingParams:
    r = job.run.rollout
    return m.SamplingParams(
        temperature=temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=new_tokens,
        return_routes=routes,
    )  # fmt: skip


def _push_row(p: Any) -> dict[str, Any]:
    """One push of the run's data plane for job_summary.json's ``pushes`` (a
    `trainer.publish.PushStats`): the version, the engines that loaded it (the near ones of a
    mixed plan), payload bytes, attempts, and its seconds in all."""
    return {
        "version": p.version, "engines": list(p.engines), "num_bytes": p.num_bytes,
        "attempts": p.attempts, "seconds": round(p.seconds, 4),
    }  # fmt: skip


@dataclasses.dataclass
class TrainerParts:
    """What every trainer process builds the same way, in the same order (each step of it may
    be a collective across processes): the model, its compiled step on the global mesh, the
    checkpointer and the initial (or restored) state, with the progress restored (None: a
    fresh start)."""

    model_cfg: Any
    model: Any
    step: TrainStep
    checkpointer: Checkpointer
    state: Any
    progress: Progress | None


def build_parts(job: JobConfig, model_path: Path) -> TrainerParts:
    """The model on the ("dp", "fsdp", "ep", "tp") mesh over the first launch.trainer_devices
    devices of every trainer process, its train step, the checkpointer of
    ``RUN_DIR/checkpoints`` and the state (restored from the newest checkpoint when
    trainer.resume and there is one)."""
    cfg, launch, run_dir = job.run, job.launch, job.run_dir.absolute()
    devices = mesh_devices(launch.trainer_devices)
    t = cfg.trainer
    mesh = make_mesh(t.dp, t.fsdp, devices=devices, tp=t.tp, ep=t.ep)
    model_cfg, model = load_hf_checkpoint(
        model_path, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
        residual_dtype=cfg.model.residual_dtype,
    )  # fmt: skip
    step = train_step_from_config(cfg, model, mesh)
    checkpointer = Checkpointer(run_dir / "checkpoints", cfg.trainer.max_checkpoints)
    state, progress = step.init_state(model), None
    if cfg.trainer.resume and checkpointer.latest_step() is not None:
        state, progress = checkpointer.restore(step.abstract_state())
    return TrainerParts(model_cfg, model, step, checkpointer, state, progress)


def train_and_evaluate(
    job: JobConfig,
    client: GatewayClient,
    procs: ProcessSet | None,
    model_path: Path,
    data: JobData,
    encode: Callable[[Problem], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    leader: Leader | None = None,
    wandb: WandbLogger | None = None,
) -> dict[str, Any]:
    """Train and evaluate (see the module docstring); returns the job summary's fields.

    `procs`: the launcher's children when the engines are this process's own (they are
    supervised and restarted here); None when another process owns them (a joined gateway,
    or trainer process 0 of several, whose launcher supervises them). `leader`: on trainer
    process 0 of several, the op channel to the others (`trainer.leader`): the step,
    publisher and checkpointer then run on every process (the caller holds it in a ``with``,
    which tells the followers to stop on every way out). `wandb`, given, gets every metrics
    row, held-out accuracy and the trained groups (its sample tables) beside TensorBoard; the
    caller finishes it.

    Raises:
      RuntimeError: a child exited; TimeoutError: engines, rollouts or eval groups too late.
    """
    cfg, launch, run_dir = job.run, job.launch, job.run_dir.absolute()
    parts = build_parts(job, model_path)
    model_cfg, step, checkpointer = parts.model_cfg, parts.step, parts.checkpointer
    state = parts.state
    version, rng = 0, None
    consumed, attempt, resumed_from = ConsumedPositions(), 0, None
    if parts.progress is not None:
        progress = parts.progress
        version, rng = progress.weight_version, progress.rng
        consumed, attempt, resumed_from = progress.consumed, progress.attempt + 1, progress.step
        print(
            f"resuming from step {progress.step} (checkpoint "
            f"{checkpointer.path_of(progress.step)}): weight version {version}, "
            f"{consumed.count} problems consumed",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    attempt = next_attempt(run_dir, attempt)  # unique sample ids even at a joined gateway
    engine_ids = wait_for_engines(
        client, launch.num_engines, launch.start_timeout_s, None if launch.gateway else procs
    )
    own_engines = procs is not None and not launch.gateway
    transport = with_transfer_servers(data_plane_config(job))  # jax_transfer: addresses
    fan_in = leader is not None and serves_blocks(transport)  # every trainer process sends
    publisher = WeightPublisher(
        client, transport, model_cfg.family, model_cfg, job.engine_dtype,
        min_engines=launch.min_engines, senders=jax.process_count() if fan_in else 1,
        announce=leader.announce if fan_in and leader is not None else None,
        adapter=AdapterSpec.of(cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
        if cfg.sync.lora_only else None,
        far_transport=far_data_plane_config(job), far_names=far_engine_names(job),
    )  # fmt: skip
    if launch.restart_engines:  # a restarted engine gets the current version between pushes
        publisher.start_catch_up()
    supervisor = None
    if own_engines and procs is not None:  # the engines are ours: restart the ones that die
        supervisor = EngineSupervisor(
            procs, [f"engine{i}" for i in range(launch.num_engines)],
            restart=launch.restart_engines, max_restarts=launch.max_restarts,
            backoff_s=launch.restart_backoff_s, backoff_max_s=launch.restart_backoff_max_s,
            min_engines=launch.min_engines,
            on_death=deregister_dead(client),
        ).start()  # fmt: skip
    reporter = Reporter(
        run_dir, cfg.trainer.steps, int(state.step), show_bar=launch.progress, wandb=wandb
    )
    r = cfg.rollout
    eval_sampling = _sampling(
        job, job.eval_temperature, job.eval.max_new_tokens or r.max_new_tokens
    )
    pad_id = int(model_cfg.eos_token_ids[0]) if model_cfg.eos_token_ids else 0
    held_out_points: list[tuple[int, float]] = []  # (step, accuracy) without eval.every
    try:
        with ScoringPool(max_workers=r.scoring_workers, decode=decode) as scoring:

            def log_eval(row: dict[str, Any]) -> None:
                append_row(run_dir, row)
                reporter.on_eval_row(row)

            def run_eval(
                tag: str, at: int, expect_drained: int = 0, on_training_group: Any = None
            ) -> EvalResult:
                return evaluate(
                    client, data.held_out, encode, scoring, eval_sampling,
                    samples=job.eval.samples, version=at, tag=tag,
                    timeout_s=job.eval.timeout_s, expect_drained=expect_drained,
                    out_dir=run_dir, decode=decode,
                    on_progress=lambda back, total: reporter.on_eval_progress(tag, back, total),
                    on_training_group=on_training_group, episodes=r.episodes(),
                )  # fmt: skip

            def held_out(tag: str, at: int, expect_drained: int = 0) -> EvalResult:
                result = run_eval(tag, at, expect_drained)
                if job.eval.every:  # every evaluation of the run is a row of metrics.jsonl
                    log_eval(eval_row(result, int(trainer.state.step)))
                else:  # the plot marks it all the same
                    reporter.on_eval(tag, result.accuracy, int(trainer.state.step))
                    held_out_points.append((int(trainer.state.step), result.accuracy))
                return result

            source = RolloutSource(
                client,
                ProblemStream(data.train, seed=cfg.trainer.seed),
                encode,
                scoring,
                group_size=r.group_size,
                sampling=_sampling(job, r.temperature, r.max_new_tokens, cfg.wants_routes),
                fetch_timeout_s=r.fetch_timeout_s,
                ledger=PositionLedger(consumed),
                attempt=attempt,
                episodes=r.episodes(),
            )
            every = EvalEvery(
                job.eval.every if data.held_out else 0, cfg.trainer.steps,
                lambda tag, at, hand_over: run_eval(tag, at, on_training_group=hand_over),
                source, log_eval,
            )  # fmt: skip
            loop_step, loop_publisher, loop_checkpointer = step, publisher, checkpointer
            if leader is not None and cfg.sync.background:
                raise ValueError(
                    "sync.background: expected false with several trainer processes (each "
                    "version is pushed by all of them together, from the train state)"
                )
            if leader is not None:  # every trainer process takes these (trainer.leader)
                loop_step = LeaderStep(step, leader)  # type: ignore[assignment]
                loop_publisher = LeaderPublisher(publisher, leader)  # type: ignore[assignment]
                loop_checkpointer = LeaderCheckpointer(checkpointer, leader)  # type: ignore[assignment]
            trainer = AsyncTrainer(
                cfg, loop_step, state, source, loop_publisher, run_dir, version=version, rng=rng,
                checkpointer=loop_checkpointer, client=client, pad_id=pad_id,
                on_metrics=reporter.on_metrics, on_groups=wandb.on_groups if wandb else None,
                before_update=supervisor.check if supervisor else None,
                stop_requested=interrupt.requested,
                after_update=every if every.every else None,
            )  # fmt: skip
            if version:
                trainer.resync_engines()
            before = held_out("before", trainer.version) if data.held_out else None
            remaining = cfg.trainer.steps - int(trainer.state.step)
            interrupt.reset()  # a stop asked of an earlier job in this process is not ours
            with interrupt.graceful():
                summary = trainer.run(remaining) if remaining > 0 else trainer.summary()
            waiting_here = source.waiting_here
            expected = summary.in_flight - waiting_here
            stopped = interrupt.requested()
            if stopped:  # the user wants out: no final evaluation, no drain
                after, drained = None, 0
            elif data.held_out:
                after = held_out("after", trainer.version, expected)
                drained = after.drained
            else:
                after = None
                drained = drain_training_groups(client, expected, job.eval.timeout_s)
            engines = {e.engine_id: int(e.weight_version) for e in client.status().engines}
    finally:
        if supervisor is not None:
            supervisor.stop()
        reporter.close()
        delta_pushes = publisher.delta_pushes
        pushes = [_push_row(p) for p in publisher.pushes]
        publisher.close()
        checkpointer.close()
    rewards = [row["reward_mean"] for row in read_metrics(run_dir) if "reward_mean" in row]
    return {
        "stop_reason": stopped or "completed",
        "exit_code": interrupt.exit_code() if stopped else 0,
        "resumed_from_step": resumed_from,
        "backend": r.backend,
        "model": str(model_path),
        "engine_ids": engine_ids,
        "loop": dataclasses.asdict(summary),
        "in_flight_waiting_in_trainer": waiting_here,
        "in_flight_drained_after_stop": drained,
        "engine_versions": engines,
        "engine_restarts": dict(supervisor.restarts) if supervisor else {},
        "delta_pushes": delta_pushes,
        "pushes": pushes,
        "eval_before": dataclasses.asdict(before) if before else None,
        "eval_after": dataclasses.asdict(after) if after else None,
        "eval_every": every.summary() if every.every else None,
        **reward_ends(rewards),
        "plot": str(plot_metrics(run_dir, held_out_points)) if rewards else None,
    }
