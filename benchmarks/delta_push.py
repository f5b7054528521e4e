"""Bytes per weight push of the file data plane's compressed deltas (`transport.file_delta`,
``FileTransportConfig(delta=True)``) against full bf16, over real training steps of
SmolLM2-135M-Instruct, in one run.

The trainer is the project's `TrainStep` (forward, fused log-probs, GRPO loss, backward, AdamW
with clipping) on the real checkpoint in fp32, at `--lr` (default 1e-5, configs/
smollm2_arith.yaml's), fed a fresh batch each step (`train_step.dense_batch`: B rows of T
random tokens with alternating rewards, a new seed per step). After the untimed version 0 (the
checkpoint) and after each of the `--steps` steps, the params (bf16 on the wire, as the
engines take them) are pushed twice, in the same process, to two folders: the plain file
transport (safetensors, `transport.file`: the reference, full bf16) and the delta transport
(a keyframe every `--full-every` versions). A `DeltaFileReceiver` then rebuilds every version
and it must be bit for bit the bf16 cast (counted in `mismatched_tensors`, 0 expected).

Figures: `full_bf16_bytes` (the payload of a version, the same for every push),
`delta_over_full_bf16` (the median over the delta pushes, keyframes excluded, of stored bytes
over full bf16 bytes), `mean_over_full_bf16` (every push from version 1 on, keyframes
included: the link's average), the median seconds of a delta send, of a full file send and of
a delta receive (rebuild and load into host tensors).

Usage: python benchmarks/delta_push.py [--steps 20] [--full-every 10] [--lr 1e-5]
    [--batch 8] [--seq-len 128] [--level 3] [--model smollm2|small]
Prints one line per push, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np
import torch
from train_step import build_model, dense_batch

from models.params import flat_params
from models.sharding import make_mesh
from trainer.losses import make_loss
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.train_step import TrainStep
from transport.base import as_torch
from transport.config import FileTransportConfig
from transport.factory import make_receiver, make_sender
from transport.file_delta import read_chain
from transport.manifest import Manifest


def _keep(into: dict[str, torch.Tensor], bucket: list[tuple[str, torch.Tensor]]) -> None:
    into.update({n: t.clone() for n, t in bucket})


def host_params(model) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Every param by dot path as a host fp32 array."""
    return {k: np.asarray(v) for k, v in flat_params(model).items()}


def main() -> None:
    """Trains, pushes each version both ways, checks the rebuilt ones; prints the figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "small"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--level", type=int, default=3, help="zstd level")
    args = parser.parse_args()

    model = build_model(args.model, "float32")
    tx = make_optimizer(
        OptimizerConfig(learning_rate=args.lr, total_steps=args.steps, max_grad_norm=1.0)
    )
    step = TrainStep(model, make_loss("grpo"), tx, make_mesh(1, 1, devices=jax.devices()[:1]))
    state = step.init_state(model)
    with tempfile.TemporaryDirectory() as tmp:
        full_cfg = FileTransportConfig(root=str(Path(tmp) / "full"), keep=1)
        delta_cfg = FileTransportConfig(
            root=str(Path(tmp) / "delta"), keep=1, delta=True, full_every=args.full_every,
            zstd_level=args.level,
        )  # fmt: skip
        full_tx, delta_tx = make_sender(full_cfg), make_sender(delta_cfg)
        receiver = make_receiver(delta_cfg)
        rows, mismatched = [], 0
        for version in range(args.steps + 1):
            if version:
                batch = dense_batch(args.batch, args.seq_len, model.cfg.vocab_size, seed=version)
                t0 = time.perf_counter()
                state, metrics = step(state, batch)
                train_s = time.perf_counter() - t0
            params = host_params(step.model(state))
            manifest = Manifest.of(
                version, [(k, v.shape) for k, v in params.items()], "bfloat16", 64 << 20
            )
            full = full_tx.send(manifest, params.items())
            delta = delta_tx.send(manifest, params.items())
            got: dict[str, torch.Tensor] = {}
            t0 = time.perf_counter()
            receiver.receive(manifest, partial(_keep, got))
            receive_s = time.perf_counter() - t0
            for k, v in params.items():
                want = as_torch(v).to(torch.bfloat16).view(torch.int16)
                mismatched += not torch.equal(got[k].view(torch.int16), want)
            assert delta.wire_bytes is not None
            row = {"version": version, "full_bytes": full.num_bytes, "stored": delta.wire_bytes,
                   "keyframe": read_chain(delta_cfg.root, version)["base"] is None,
                   "delta_send_s": delta.seconds,
                   "full_send_s": full.seconds, "receive_s": receive_s}  # fmt: skip
            rows.append(row)
            loss = f", loss {float(metrics['loss']):.4f}, step {train_s:.1f} s" if version else ""
            print(
                f"v{version}: {'keyframe' if row['keyframe'] else 'delta'} "
                f"{delta.wire_bytes / 1e6:.2f} MB of {full.num_bytes / 1e6:.2f} MB bf16 "
                f"({delta.wire_bytes / full.num_bytes:.4f}); send {delta.seconds:.2f} s "
                f"(full file {full.seconds:.2f} s), receive {receive_s:.2f} s{loss}",
                flush=True,
            )
    full_bytes = rows[0]["full_bytes"]
    deltas = [r for r in rows[1:] if not r["keyframe"]]
    result = {
        "benchmark": "delta_push",
        "model": args.model,
        "steps": args.steps,
        "lr": args.lr,
        "full_every": args.full_every,
        "zstd_level": args.level,
        "full_bf16_bytes": full_bytes,
        "delta_over_full_bf16": statistics.median(r["stored"] / full_bytes for r in deltas),
        "mean_over_full_bf16": statistics.mean(r["stored"] / full_bytes for r in rows[1:]),
        "keyframe_over_full_bf16": rows[0]["stored"] / full_bytes,
        "delta_send_s": statistics.median(r["delta_send_s"] for r in deltas),
        "full_file_send_s": statistics.median(r["full_send_s"] for r in rows),
        "delta_receive_s": statistics.median(r["receive_s"] for r in deltas),
        "mismatched_tensors": mismatched,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
