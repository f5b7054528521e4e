"""One trainer process of a job whose trainer runs as several processes.

Two ways it starts:
- on one machine, by the launcher of a ``launch.trainer_processes=P`` job
  (`trainer.launch.trainer_processes`): ``python -m trainer.launch.trainer_worker --config
  RUN_DIR/config.yaml --run-dir RUN_DIR --process-id I --num-processes P --coordinator
  127.0.0.1:PORT --gateway HOST:PORT --token-file FILE --model PATH --result FILE``;
- on a cluster, by hand on every trainer host (e.g. one task per host under ``srun``), the
  gateway and engines started on their own hosts (docs/clusters.md, "Running on separate hosts"):
  the same command without ``--process-id``, ``--num-processes`` and ``--coordinator``, so
  `jax.distributed.initialize` takes them from the environment it detects (``--cluster
  slurm`` | ``ompi`` | ``mpi4py`` | ... names the detector; by default JAX tries each), and
  ``--result`` defaults to ``RUN_DIR/trainer_result.json``; config overrides (``key=value``,
  as ``python -m trainer train`` takes them) follow the flags. The process that JAX numbers 0
  leads, and first sets the run's settings at the gateway (family, dtype, data plane,
  backends: what the launcher does before it starts its workers).

Joins the group (`trainer.distributed`, `launch.trainer_devices` local devices on CPU), then:
process 0 runs the single-process training path (`trainer.launch.training.train_and_evaluate`)
with the gateway client and leads the others (`trainer.leader.Leader`), and writes its result
to ``--result`` (JSON); every other process builds the same model, step, checkpointer and
state (`build_parts`) and follows (`trainer.leader.follow`). All leave the group together at
the end (`trainer.distributed.shutdown`).

Exit status: 0 done (process 0: its result written, a graceful SIGINT/SIGTERM stop included;
the launcher takes the job's exit code from the result); 1 the group did not form in time
(`EXIT_INIT_TIMEOUT`) or an error (its traceback on stderr); 2 a bad config. JAX's
coordination service ends a process whose peer died (`trainer.distributed`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.launch.trainer_worker")
    ap.add_argument("--config", required=True, help="the job's RUN_DIR/config.yaml")
    ap.add_argument("--run-dir", default=None, help="default: the config's run_dir")
    ap.add_argument("--process-id", type=int, default=None, help="default: from the cluster")
    ap.add_argument("--num-processes", type=int, default=None, help="default: from the cluster")
    ap.add_argument(
        "--coordinator", default=None, help="HOST:PORT of process 0's service (default: cluster)"
    )
    ap.add_argument(
        "--cluster", default=None, help="jax.distributed's cluster detector (slurm, ompi, ...)"
    )
    ap.add_argument("--gateway", required=True, help="HOST:PORT of the gateway")
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--model", required=True, help="the resolved HF checkpoint folder")
    ap.add_argument("--result", default=None, help="process 0 writes its result here (RUN_DIR/...)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value (as `train`)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one trainer process (see the module docstring); returns the exit status."""
    from gateway.lifeline import hold_to_launcher

    hold_to_launcher()  # the launcher takes its trainer processes along when it dies
    args = _parser().parse_args(argv)
    from trainer.config import ConfigError
    from trainer.launch.job_config import load_job_config

    try:
        run_dir = [f"run_dir={args.run_dir}"] if args.run_dir else []
        job = load_job_config(args.config, [*args.overrides, *run_dir])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level="WARNING", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from trainer.launch.library_logs import route_library_logs

    route_library_logs(job.run_dir.absolute() / "logs")  # every process appends to one file
    from trainer.distributed import ProcessGroup, initialize, shutdown
    from trainer.launch.commands import resolve_accelerator

    cpu = resolve_accelerator(job) == "cpu"
    index, _ = initialize(
        ProcessGroup(
            num_processes=args.num_processes,
            process_id=args.process_id,
            coordinator=args.coordinator,
            local_devices=job.launch.trainer_devices if cpu else None,
            platform="cpu" if cpu else "gpu",
            cluster_detection_method=args.cluster,
            heartbeat_timeout_s=job.launch.trainer_heartbeat_timeout_s,
        )
    )
    args.result = args.result or str(job.run_dir.absolute() / "trainer_result.json")
    model_path = Path(args.model)
    if index == 0:
        _lead(job, args, model_path)
    else:
        try:
            _follow(job, index, model_path)
        except BaseException:  # leave at once: waiting at JAX's shutdown barrier would hide it
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    shutdown()
    return 0


def _follow(job, process_id: int, model_path: Path) -> None:  # noqa: ANN001
    """A follower: the same parts as process 0, then its ops until "stop"."""
    from trainer.launch.commands import data_plane_config
    from trainer.launch.training import build_parts
    from trainer.leader import follow, with_transfer_servers
    from trainer.publish.co_sender import FollowerSends
    from transport.config import JaxTransferTransportConfig, serves_blocks

    parts = build_parts(job, model_path)
    sends = None
    transport = with_transfer_servers(data_plane_config(job))  # jax_transfer: its address
    if serves_blocks(transport):  # this process sends its own blocks of each push
        log_path = job.run_dir.absolute() / "logs" / f"trainer{process_id}_sends.jsonl"
        sends = FollowerSends(
            parts.model_cfg.family, parts.model_cfg, job.engine_dtype, process_id, log_path,
            on_device=isinstance(transport, JaxTransferTransportConfig),
        )  # fmt: skip
    try:
        steps, reason = follow(parts.step, parts.state, parts.checkpointer, sends)
    finally:
        if sends is not None:
            sends.close()
    parts.checkpointer.close()
    print(
        f"trainer process {process_id}: {steps} steps; process 0 stopped: {reason}",
        file=sys.stderr,
        flush=True,
    )


def _lead(job, args: argparse.Namespace, model_path: Path) -> None:  # noqa: ANN001
    """Process 0: the single-process training path, leading the others; writes the result."""
    from transformers import AutoTokenizer

    from gateway.client import GatewayClient
    from gateway.errors import GatewayError
    from gateway.lifeline import LAUNCHER_PID_ENV
    from trainer.launch import interrupt
    from trainer.launch.data import load_job_data, make_decoder, make_encoder
    from trainer.launch.training import train_and_evaluate
    from trainer.leader import Leader

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # the launcher passes a user's stop on as SIGINT (a graceful stop); its SIGTERM means it
    # stops the whole job (a peer lost, a failure): at once, even mid-call to a gone gateway
    interrupt.install(term_now=LAUNCHER_PID_ENV in os.environ)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    data = load_job_data(job)
    encode = make_encoder(tokenizer, job.data.system_prompt)
    from models.checkpoints.hf_io import read_hf_config
    from models.config import ModelConfig
    from trainer.launch.commands import run_settings

    ca_file = job.launch.gateway_ca_file or None
    client = GatewayClient.from_token_file(
        args.gateway, args.token_file, "trainer", ca_file, margin_s=10.0
    )
    # Started by hand (a cluster) no launcher configured the run; the launcher's settings are
    # these same ones, and configuring the same settings again changes nothing.
    client.wait_ready(30.0)
    client.configure(run_settings(job, ModelConfig.from_hf(read_hf_config(model_path)).family))
    try:
        with Leader() as leader:  # the followers stop on every way out, told why
            result = train_and_evaluate(
                job, client, None, model_path, data, encode, make_decoder(tokenizer), leader
            )
        if job.launch.stop_joined:  # asked to: the gateway (and its engines) ends with the run
            client.shutdown("the training job finished")
    except BaseException as e:
        if job.launch.stop_joined:
            with contextlib.suppress(GatewayError):
                client.shutdown(f"the trainer failed: {type(e).__name__}"[:200])
        raise
    finally:
        client.close()
    out = Path(args.result)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
