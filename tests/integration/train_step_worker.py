"""One trainer process of the multi-process train-step tests (run as a script, one per process).

Joins the group (`trainer.distributed`), builds one ("dp"=1, "fsdp"=all) mesh over every
process's devices, loads the tiny checkpoint onto it (each process puts only its slices),
and, for each of `--optimizers` from the same init, takes `--steps` GRPO steps on a hand-built
`RLBatch` that only process 0 holds. Process 0 writes ``--out`` (npz): per optimizer every
param after the steps (gathered) and the metrics of each step; and the shapes of the shards
this process held. With ``--steps 0`` it steps until killed, printing
``STEP n`` after each (the fault tests).

Exit codes: 0 done; 3 the group did not form in time; 2 a `DistributedInitError` (message on
stderr); JAX's coordination service aborts a survivor whose peer died (SIGABRT, its message on
stderr).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

VOCAB = 320  # models.checkpoints.tiny's default vocab_size


def hand_batch():
    """4 groups of 2 completions (8 rows): fixed token ids, sampler log-probs near the uniform
    -log(320) = -5.77, rewards 0/1 in each group (nonzero advantages)."""
    from gateway.messages import Completion
    from trainer.batch import build_rl_batch
    from trainer.rollouts import RolloutGroup

    rng = np.random.default_rng(7)
    groups = []
    for p in range(4):
        comps = []
        for g in range(2):
            n = 2 + (p + g) % 5
            comps.append(
                Completion(
                    token_ids=rng.integers(1, VOCAB, n).tolist(),
                    logprobs=(-5.77 + 0.3 * rng.standard_normal(n)).tolist(),
                    finish_reason="stop",
                    version_start=0,
                    version_end=0,
                    reward=float(g % 2),
                )
            )
        prompt = rng.integers(1, VOCAB, 3 + p).tolist()
        groups.append(RolloutGroup(f"p{p}", prompt, comps))
    return build_rl_batch(groups, pad_id=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--devices", type=int, required=True, help="CPU devices of this process")
    ap.add_argument("--steps", type=int, default=1, help="0: step until killed")
    ap.add_argument("--init-timeout", type=int, default=60)
    ap.add_argument("--heartbeat-timeout", type=int, default=100)
    ap.add_argument("--optimizers", default="sgd,adamw", help="comma list: sgd, adamw")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from trainer.distributed import DistributedInitError, ProcessGroup, initialize, shutdown

    group = ProcessGroup(
        num_processes=args.num_processes,
        process_id=args.process_id,
        coordinator=args.coordinator,
        local_devices=args.devices,
        init_timeout_s=args.init_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        shutdown_timeout_s=30,
    )
    try:
        index, count = initialize(group)
    except DistributedInitError as exc:
        print(f"DistributedInitError: {exc}", file=sys.stderr, flush=True)
        return 2

    import jax
    import optax
    from jax.experimental import multihost_utils

    from models.checkpoints.hf_io import load_hf_checkpoint
    from models.sharding import make_mesh, mesh_devices
    from trainer.losses import make_loss
    from trainer.optim import OptimizerConfig, make_optimizer
    from trainer.train_step import TrainStep

    mesh = make_mesh(1, -1, devices=mesh_devices(args.devices))
    _, model = load_hf_checkpoint(args.checkpoint, mesh=mesh, min_shard_bytes=0)
    optimizers = {
        # plain SGD after clipping: the update is linear in the gradient (no amplification)
        "sgd": optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
        # the project's AdamW: its first step is g / (|g| + eps), sign-like, so rounding in a
        # gradient near eps moves that param by up to lr
        "adamw": make_optimizer(
            OptimizerConfig(learning_rate=1e-2, total_steps=10, max_grad_norm=1.0)
        ),
    }
    batch = hand_batch() if index == 0 else None
    print(f"process {index} of {count}: {len(jax.local_devices())} local devices", flush=True)
    saved: dict[str, np.ndarray] = {}
    for name in args.optimizers.split(","):
        step = TrainStep(
            model, make_loss("grpo"), optimizers[name], mesh, micro_batches=2, min_shard_bytes=0
        )
        state = step.init_state(model)
        rows: list[dict[str, float]] = []
        while args.steps == 0 or len(rows) < args.steps:
            state, metrics = step(state, batch)
            rows.append(metrics)
            print(f"STEP {len(rows)} {name} loss={metrics['loss']:.9g}", flush=True)
        params = multihost_utils.process_allgather(state.params, tiled=True)
        saved.update({f"{name}/param/{k}": np.asarray(v) for k, v in params.items()})
        saved.update({f"{name}/metric/{k}": np.array([r[k] for r in rows]) for k in rows[0]})
    embed = state.params["embed.embedding"]
    local_shapes = [tuple(s.data.shape) for s in embed.addressable_shards]
    if index == 0 and args.out:
        np.savez(
            args.out,
            **saved,
            embed_global_shape=np.array(embed.shape),
            embed_local_shapes=np.array(local_shapes),
            process_count=np.array(count),
            global_devices=np.array(len(jax.devices())),
        )
    print(f"process {index}: embed shards held here {local_shapes}", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
