"""A mixture of experts against a dense model of the same active parameters: the RL train
step's tokens per second and the weight push's bytes and GB/s, in one run.

Models (random weights, fp32): `moe`, a Qwen3-MoE of D 256, 4 layers, 8 heads of 32 (4 KV
heads), vocabulary 8,192, every layer a top-2 router over E = 8 experts of width 256
(`models.moe`); `dense`, the Qwen3 of the same shape with one MLP of width k · 256 = 512, so
that each token passes through the same number of matmul weights (the router's D · E aside).
The MoE has E / k = 4 times the MLP params the dense model has; a push sends them all.

Train step: `trainer.train_step.TrainStep` (forward, fused log-probs, GRPO loss, backward,
AdamW with clipping) on one device, fed `train_step.dense_batch` (B rows of exactly T tokens,
no padding); after one compiling call each, `--steps` rounds that time every model's step once;
tokens/s from the median step, the ratio the median of the rounds' paired ratios. Each MoE dispatch
(`--dispatch`, `models.moe_dispatch`: "dense" computes every expert on every token and keeps
the top-k, exact and simple; "grouped" sorts the (token, expert) pairs and runs one grouped
matmul per projection, `jax.lax.ragged_dot`) is timed against the same dense model's step.

Push: the params cast to bf16 and written by the file data plane (`transport.file`, safetensors
in a fresh folder of the temporary directory, packing included): the median of 3 sends, bytes
over seconds. The engine's load is not included (it is the same code for both).

Figures: ``moe_<dispatch>_over_dense_tokens_per_s`` per dispatch (step tokens/s of the MoE
over the dense model's), ``moe_over_dense_push_bytes`` and ``moe_over_dense_push_s`` (what
the larger payload costs per push) and each push's GB/s.

Usage: python benchmarks/moe.py [--batch 8] [--seq-len 128] [--steps 3]
    [--dispatch dense,grouped] [--layers 4]
Prints one line per measurement, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from train_step import dense_batch

from models.config import ModelConfig
from models.decoder import Decoder
from models.params import flat_params
from models.sharding import make_mesh
from trainer.losses import make_loss
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.train_step import TrainStep
from transport.config import FileTransportConfig
from transport.factory import make_sender
from transport.manifest import Manifest

EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 256
SHAPE = dict(
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=8192,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)


def model_config(kind: str, layers: int, dispatch: str = "dense") -> ModelConfig:
    """The `moe` (Qwen3-MoE, E experts, top-k) or `dense` (Qwen3, MLP width k · expert width)
    model of the module docstring, fp32, `layers` deep.

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "moe":
        hf = dict(
            SHAPE, model_type="qwen3_moe", num_hidden_layers=layers, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH, norm_topk_prob=True,
            intermediate_size=TOP_K * EXPERT_WIDTH,
        )  # fmt: skip
        return dataclasses.replace(ModelConfig.from_hf(hf, dtype="float32"), moe_dispatch=dispatch)
    if kind == "dense":
        hf = dict(
            SHAPE, model_type="qwen3", num_hidden_layers=layers,
            intermediate_size=TOP_K * EXPERT_WIDTH,
        )  # fmt: skip
        return ModelConfig.from_hf(hf, dtype="float32")
    raise ValueError(f"kind must be 'moe' or 'dense', got {kind!r}")


class StepTimer:
    """The compiled train step of a random model of `cfg` on one device, and its timed calls."""

    def __init__(self, cfg: ModelConfig, rows: int, length: int) -> None:
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        tx = make_optimizer(OptimizerConfig(learning_rate=1e-5, total_steps=100, max_grad_norm=1.0))
        mesh = make_mesh(1, 1, devices=jax.devices()[:1])
        self.step = TrainStep(model, make_loss("grpo"), tx, mesh)
        self.state = self.step.init_state(model)
        self.batch = dense_batch(rows, length, cfg.vocab_size)
        self.tokens = rows * length
        self.compile_s = self.seconds()  # the first call compiles

    def seconds(self) -> float:
        """Wall seconds of one step (host batch in, loss fetched)."""
        t0 = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        float(metrics["loss"])
        return time.perf_counter() - t0


def push_seconds(cfg: ModelConfig, repeats: int = 3) -> dict[str, float]:
    """(bf16 bytes of a version, median seconds of a file-plane send, GB/s) of `cfg`'s params."""
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = {k: np.asarray(v) for k, v in flat_params(model).items()}
    times, num_bytes = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        sender = make_sender(FileTransportConfig(root=str(Path(tmp) / "push"), keep=1))
        for version in range(1, repeats + 1):
            manifest = Manifest.of(
                version, [(k, v.shape) for k, v in params.items()], "bfloat16", 64 << 20
            )
            sent = sender.send(manifest, params.items())
            times.append(sent.seconds)
            num_bytes = sent.num_bytes
    push_s = statistics.median(times)
    return {"bytes": num_bytes, "push_s": push_s, "gb_per_s": num_bytes / push_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8, help="rows B")
    parser.add_argument("--seq-len", type=int, default=128, help="padded length T")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dispatch", default="dense,grouped", help="MoE dispatches to time")
    args = parser.parse_args()
    dispatches = [d for d in args.dispatch.split(",") if d]
    if args.steps < 1 or not dispatches:
        parser.error("need --steps >= 1 and at least one --dispatch")
    unknown = sorted(set(dispatches) - {"dense", "grouped"})
    if unknown:
        parser.error(f"--dispatch: unknown {unknown}; known: ['dense', 'grouped']")

    result: dict[str, Any] = {"benchmark": "moe", "batch": args.batch, "seq_len": args.seq_len}
    timers = {"dense": StepTimer(model_config("dense", args.layers), args.batch, args.seq_len)}
    for dispatch in dispatches:
        cfg = model_config("moe", args.layers, dispatch)
        timers[f"moe_{dispatch}"] = StepTimer(cfg, args.batch, args.seq_len)
    # rounds: each model's step once per round, the ratios paired within a round (the load of
    # shared cores changes during a run)
    rounds = [{name: t.seconds() for name, t in timers.items()} for _ in range(args.steps)]
    for name, timer in timers.items():
        step_s = statistics.median(r[name] for r in rounds)
        result[f"{name}_tokens_per_s"] = round(timer.tokens / step_s, 1)
        result[f"{name}_compile_s"] = round(timer.compile_s, 1)
        line = f"{name} step: {step_s:.3f} s, {timer.tokens / step_s:.0f} tokens/s"
        if name != "dense":
            ratio = statistics.median(r["dense"] / r[name] for r in rounds)
            result[f"{name}_over_dense_tokens_per_s"] = round(ratio, 4)
            line += f" = {ratio:.3f} of dense's"
        print(line + f" (compile {timer.compile_s:.1f} s)")
    push = {kind: push_seconds(model_config(kind, args.layers)) for kind in ("dense", "moe")}
    for kind, p in push.items():
        print(f"{kind} push: {p['bytes'] / 1e6:.1f} MB bf16 in {p['push_s']:.3f} s, "
              f"{p['gb_per_s']:.3f} GB/s")  # fmt: skip
        result[f"{kind}_push_bytes"] = p["bytes"]
        result[f"{kind}_push_s"] = round(p["push_s"], 4)
        result[f"{kind}_push_gb_per_s"] = round(p["gb_per_s"], 4)
    result["moe_over_dense_push_bytes"] = round(push["moe"]["bytes"] / push["dense"]["bytes"], 4)
    result["moe_over_dense_push_s"] = round(push["moe"]["push_s"] / push["dense"]["push_s"], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
