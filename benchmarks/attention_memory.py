"""Peak memory and time of one attention layer's forward + backward: blockwise
(`models.blockwise`) against the dense path, at several sequence lengths.

Memory is XLA's planned temporary allocation of the compiled gradient function
(``compiled.memory_analysis().temp_size_in_bytes``: every intermediate buffer, excluding inputs
and outputs; on CPU the honest peak, the CPU client having no allocator statistics). Time is
the median of `--repeats` runs after compilation. Shapes: SmolLM2-135M's attention (9 query
heads, 3 kv heads, head dim 64), `--rows` sequences of each length T, fp32, positions
``arange(T)`` as in every training row.

Last line: one JSON object with, per T, both paths' bytes and seconds and the ratios
blockwise / dense (``temp_bytes_blockwise_over_dense``, ``seconds_blockwise_over_dense``).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from common import compiled_temp_and_seconds

from models.blockwise import blockwise_attention
from models.config import ModelConfig
from models.layers import dense_attention
from models.scores import attention_mask


def dense_path(q, k, v, positions, cfg: ModelConfig):  # noqa: ANN001, ANN201
    """The dense path of `models.layers.Attention` without a cache."""
    return dense_attention(q, k, v, attention_mask(positions, positions, None), cfg)


def measure(fn, args, repeats: int) -> dict[str, float]:  # noqa: ANN001
    """Compiled temp bytes and median seconds of value-and-grad of sum(fn(q, k, v) * cot)."""

    def loss(q, k, v, cot):  # noqa: ANN001, ANN202
        return jnp.sum(fn(q, k, v) * cot)

    return compiled_temp_and_seconds(
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), args, repeats
    )


def smollm2_attention_config() -> ModelConfig:
    """SmolLM2-135M's attention shapes (fp32)."""
    return ModelConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        query_scale=64**-0.5,
        layer_types=("full_attention",),
        dtype="float32",
        param_dtype="float32",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = smollm2_attention_config()
    K, H = cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // K
    results = {}
    for t in args.lengths:
        keys = jax.random.split(jax.random.key(t), 4)
        q = jax.random.normal(keys[0], (args.rows, t, K, G, H), jnp.float32)
        k = jax.random.normal(keys[1], (args.rows, t, K, H), jnp.float32)
        v = jax.random.normal(keys[2], (args.rows, t, K, H), jnp.float32)
        cot = jax.random.normal(keys[3], (args.rows, t, K, G, H), jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (args.rows, t))
        dense = measure(
            functools.partial(dense_path, positions=pos, cfg=cfg), (q, k, v, cot), args.repeats
        )
        blk = measure(
            functools.partial(
                blockwise_attention, positions=pos, cfg=cfg, window=None, block=args.block
            ),
            (q, k, v, cot),
            args.repeats,
        )
        row = {
            "dense_temp_bytes": dense["temp_bytes"],
            "blockwise_temp_bytes": blk["temp_bytes"],
            "dense_seconds": dense["seconds"],
            "blockwise_seconds": blk["seconds"],
            "temp_bytes_blockwise_over_dense": blk["temp_bytes"] / dense["temp_bytes"],
            "seconds_blockwise_over_dense": blk["seconds"] / dense["seconds"],
        }
        results[str(t)] = row
        print(
            f"T={t}: dense {dense['temp_bytes'] / 2**20:.1f} MiB {dense['seconds']:.3f} s, "
            f"blockwise ({args.block}) {blk['temp_bytes'] / 2**20:.1f} MiB "
            f"{blk['seconds']:.3f} s: bytes x{row['temp_bytes_blockwise_over_dense']:.3f}, "
            f"time x{row['seconds_blockwise_over_dense']:.2f}",
            flush=True,
        )
    print(json.dumps({"block": args.block, "rows": args.rows, "lengths": results}))


if __name__ == "__main__":
    main()
