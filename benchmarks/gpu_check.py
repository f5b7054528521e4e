"""One-GPU check: the train step, the JAX engine's decode and a 1 GB weight push on one device,
each against a reference measured in the same run (and the chip's data-sheet peak).

Made for a one-GPU H200 machine that has JAX with CUDA, torch, flax, optax, orbax, grpcio and
transformers but no vLLM and no model hub: the model is SmolLM2-135M's shape (`SMOLLM2`: the
same layers, heads and vocabulary as the real checkpoint) with random bf16 weights, which times
exactly as the real weights do. `benchmarks/gpu_check.sh` runs the three parts under a time
limit; each part also runs on a CPU with `--small` (tiny sizes), which is how the repository's
tests hold this script without a GPU.

Parts (`python benchmarks/gpu_check.py PART [--small]`), one JSON object on the last line each:

- ``train``: tokens/s of the RL train step (GRPO, AdamW, B x T positions, bf16 params and
  compute) and its model FLOP/s (6·N + 12·L·H·Dh·T per position, `train_step.py`'s count)
  over a square bf16 matmul measured right after (`over_bf16_matmul`) and over the data-sheet
  bf16 dense peak `--peak-tflops` (`mfu`, 989 for an H200 SXM).
- ``decode``: the JAX engine (`JaxEngine`, bf16) on `--prompts` prompts x `--samples` samples x
  `--max-tokens` new tokens, EOS ignored: tokens/s, and one decode step with every slot busy
  against its HBM roofline: the bytes one step reads (every weight once, plus the KV cache the
  step attends to) over the device-to-device copy bandwidth measured in the same run
  (`roofline_fraction` = roofline seconds / measured seconds; also against the data-sheet
  `--hbm-tbps`, 4.8 for an H200).
- ``push``: `--push-mb` MiB of bf16 weights (default 1,024) from this JAX process to a torch
  process on the same device, by CUDA IPC (the JAX buffer handed to torch through DLPack and
  shared with `torch.multiprocessing`'s CUDA IPC handle; the torch process copies it into its
  own buffer) and by `jax.experimental.transfer` (the project's jax_transfer data plane,
  `transport.jax_transfer`: the torch process pulls into its JAX client and takes the arrays
  through DLPack), each as GB/s over a device-to-device copy of the same bytes in this
  process (`ipc_over_d2d`, `jax_transfer_over_d2d`). Without CUDA the IPC figure is null and
  says why.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: SmolLM2-135M-Instruct's shape (its HF config), random weights.
SMOLLM2 = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    eos_token_id=2,
)
#: A tiny llama for `--small` (CPU self-checks).
TINY = dict(
    SMOLLM2,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def model_config(small: bool, dtype: str = "bfloat16") -> Any:
    """The `ModelConfig` of SmolLM2's shape, or `TINY`'s with `small`."""
    from models.config import ModelConfig

    return ModelConfig.from_hf(TINY if small else SMOLLM2, dtype=dtype)


def _median_seconds(fn: Any, repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `fn` (which must block until done)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def d2d_gb_per_s(num_bytes: int, repeats: int = 5) -> float:
    """GB/s (1e9 bytes) of a device-to-device copy of `num_bytes` bytes in JAX on the default
    device (a jitted copy that reads and writes every byte once: counted once)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(0))
    copy(x).block_until_ready()
    return num_bytes / _median_seconds(lambda: copy(x).block_until_ready(), repeats) / 1e9


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """The `train` part (see the module docstring)."""
    import jax
    from flax import nnx
    from train_step import TEMPERATURE, MatmulProbe, dense_batch, model_flops_per_position

    from models.decoder import Decoder
    from models.sharding import make_mesh
    from trainer.losses import make_loss
    from trainer.optim import OptimizerConfig, make_optimizer
    from trainer.train_step import TrainStep

    rows, length = (8, 64) if args.small else (args.batch, args.seq_len)
    model = Decoder(model_config(args.small), rngs=nnx.Rngs(0))
    per_pos, n_matmul = model_flops_per_position(model, length)
    batch = dense_batch(rows, length, model.cfg.vocab_size)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-5, total_steps=100, max_grad_norm=1.0))
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    step = TrainStep(model, make_loss("grpo"), tx, mesh, temperature=TEMPERATURE)
    state = step.init_state(model)
    state, _ = step(state, batch)  # compile
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        float(metrics["loss"])  # waits for the step
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    flops = per_pos * rows * length / step_s
    matmul = MatmulProbe(256 if args.small else 8192, "bfloat16").flops_per_s()
    return {
        "train_tokens_per_s": rows * length / step_s,
        "train_step_s": step_s,
        "train_flops_per_s": flops,
        "matmul_params": n_matmul,
        "bf16_matmul_flops_per_s": matmul,
        "over_bf16_matmul": flops / matmul,
        "mfu": flops / (args.peak_tflops * 1e12),
    }


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    """The `decode` part (see the module docstring)."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx
    from rollout_throughput import decode_step

    from models.decoder import Decoder
    from rollout_engine.jax.batcher import BatcherConfig
    from rollout_engine.jax.engine import EngineConfig, JaxEngine
    from rollout_engine.jax.sampling import SamplingConfig
    from rollout_engine.jax.stops import StopConfig
    from rollout_engine.jax.types import Request

    prompts_n, samples, new = (4, 2, 16) if args.small else (args.prompts, args.samples,
                                                             args.max_tokens)  # fmt: skip
    slots = 8 if args.small else args.slots
    cfg = model_config(args.small)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, int(rng.integers(16, 65))).tolist()
               for _ in range(prompts_n)]  # fmt: skip
    max_len = 64 + new
    bcfg = BatcherConfig(num_slots=slots, max_len=max_len, prefill_batch=8, steps_per_call=64)
    stops = StopConfig(eos_ids=(cfg.vocab_size,), pad_id=0)  # never sampled: EOS ignored
    ecfg = EngineConfig(bcfg, SamplingConfig(temperature=1.0), stops)
    reqs = [Request(i, p, samples, new) for i, p in enumerate(prompts)]
    with JaxEngine(cfg, params, ecfg) as engine:
        engine.generate([dataclasses.replace(r, prompt_id=f"w{r.prompt_id}") for r in reqs])
        t = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t
    tokens = sum(len(r.tokens) for r in results)

    step_s, kv_bytes = decode_step(cfg, graphdef, params, ecfg, prompts, new)
    param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))
    step_bytes = param_bytes + kv_bytes  # every weight once; the cache bound covers it all here
    copy = d2d_gb_per_s(64 << 20 if args.small else 1 << 30)
    roofline_s = step_bytes / (copy * 1e9)
    return {
        "decode_tokens_per_s": tokens / wall,
        "decode_step_s": step_s,
        "decode_step_bytes": step_bytes,
        "d2d_copy_gb_per_s": copy,
        "roofline_step_s": roofline_s,
        "roofline_fraction": roofline_s / step_s,
        "datasheet_roofline_fraction": step_bytes / (args.hbm_tbps * 1e12) / step_s,
    }


def _torch_side(conn: Any, mode: str, num_bytes: int) -> None:
    """The receiving torch process: per message, take the version (a CUDA IPC handle, or a
    jax_transfer pull description), copy it into its own torch buffer, synchronise, answer
    the seconds it took; "stop" ends it."""
    import torch

    own = None
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        t = time.perf_counter()
        if mode == "ipc":
            rebuild, handle = msg
            shared = rebuild(*handle)  # the sender's CUDA buffer, mapped here
            own = torch.empty_like(shared) if own is None else own
            own.copy_(shared)
            torch.cuda.synchronize()
            del shared
        else:
            arrays = _pull(msg)
            own = torch.from_dlpack(arrays[-1])  # on the device JAX pulled it to
            if own.is_cuda:
                torch.cuda.synchronize()
        conn.send(time.perf_counter() - t)


def _pull(msg: dict[str, Any]) -> list[Any]:
    """Pull one version through the project's jax_transfer receiver onto this process's
    device; returns the received arrays."""
    import jax

    from transport.jax_transfer import JaxTransferReceiver
    from transport.manifest import Manifest

    manifest = Manifest.from_dict(msg["manifest"])
    receiver = _pull.receivers.get(msg["address"])  # type: ignore[attr-defined]
    if receiver is None:
        receiver = JaxTransferReceiver((msg["address"],), msg["rank"], msg["group"], 60.0)
        _pull.receivers[msg["address"]] = receiver  # type: ignore[attr-defined]
    out = receiver.pull(manifest)
    return [jax.block_until_ready(x) for x in out.values()]


_pull.receivers = {}  # type: ignore[attr-defined]


def run_push(args: argparse.Namespace) -> dict[str, Any]:
    """The `push` part (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    num_bytes = (8 if args.small else args.push_mb) << 20
    n = num_bytes // 2
    weights = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    weights.block_until_ready()
    d2d = d2d_gb_per_s(num_bytes)
    out: dict[str, Any] = {"push_bytes": num_bytes, "d2d_copy_gb_per_s": d2d}
    ctx = mp.get_context("spawn")
    on_gpu = jax.default_backend() == "gpu"

    if on_gpu:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_torch_side, args=(child, "ipc", num_bytes), daemon=True)
        proc.start()
        shared = torch.from_dlpack(weights)  # the JAX buffer itself, no copy
        try:
            reduce_tensor(shared)
            out["ipc_source"] = "the JAX buffer (DLPack)"
        except RuntimeError as e:  # torch shares only what its own allocator made
            shared = shared.clone()
            out["ipc_source"] = f"a torch copy of the JAX buffer ({e})"
        seconds = []
        for _ in range(args.repeats + 1):
            t = time.perf_counter()
            parent.send(reduce_tensor(shared))
            parent.recv()
            seconds.append(time.perf_counter() - t)
        parent.send("stop")
        proc.join(30)
        ipc = num_bytes / statistics.median(seconds[1:]) / 1e9
        out.update(ipc_gb_per_s=ipc, ipc_over_d2d=ipc / d2d)
    else:
        out.update(ipc_gb_per_s=None, ipc_over_d2d=None, ipc_skipped="no CUDA device")

    from transport.jax_transfer import JaxTransferSender
    from transport.manifest import Manifest

    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_torch_side, args=(child, "jax_transfer", num_bytes), daemon=True)
    proc.start()
    sender = JaxTransferSender("127.0.0.1", 60.0, 0, (1,), 0)
    seconds = []
    for version in range(1, args.repeats + 2):
        manifest = Manifest.of(version, [("w", (n,))], "bfloat16", num_bytes)
        t = time.perf_counter()
        sender.send(manifest, [("w", weights)])
        parent.send({"manifest": manifest.to_dict(), "address": sender.address,
                     "rank": 1, "group": 0})  # fmt: skip
        parent.recv()
        seconds.append(time.perf_counter() - t)
    parent.send("stop")
    proc.join(30)
    sender.close()
    moved = num_bytes / statistics.median(seconds[1:]) / 1e9
    out.update(jax_transfer_gb_per_s=moved, jax_transfer_over_d2d=moved / d2d)
    return out


PARTS = {"train": run_train, "decode": run_decode, "push": run_push}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--small", action="store_true", help="tiny sizes (a CPU self-check)")
    p.add_argument("--batch", type=int, default=32, help="train: rows B")
    p.add_argument("--seq-len", type=int, default=1024, help="train: positions per row T")
    p.add_argument("--steps", type=int, default=5, help="train: timed steps")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="data-sheet bf16 dense peak")
    p.add_argument("--prompts", type=int, default=256, help="decode: prompts")
    p.add_argument("--samples", type=int, default=4, help="decode: samples per prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="decode: new tokens per sample")
    p.add_argument("--slots", type=int, default=512, help="decode: engine slots")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="data-sheet HBM TB/s")
    p.add_argument("--push-mb", type=int, default=1024, help="push: MiB of bf16 weights")
    p.add_argument("--repeats", type=int, default=3, help="push: timed pushes after the first")
    args = p.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    import jax

    result = {"part": args.part, "backend": jax.default_backend(), **PARTS[args.part](args)}
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
