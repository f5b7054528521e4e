"""Bytes per device of a JAX engine replica's params and KV cache at tensor-parallel degree 1, 2,
4, 8 and 16 (`rollout_engine.jax.tp`), for the Llama-3.2-1B and SmolLM2-360M shapes of
`benchmarks/model_scale.py` (abstract: nothing is allocated, the shard shapes come from the
replica mesh's NamedShardings on 16 host CPU devices).

Figures: `<model>_tp<t>_param_gib` (the largest per-device share of the params, fp32),
`<model>_tp<t>_kv_mib_per_slot` (one slot's KV cache at `--max-len` positions on one device,
fp32), `<model>_tp<t>_kv_heads_held` (the KV heads the replica holds: the model's, or t when
it has fewer and each is replicated t / K times) and the ratio `<model>_tp<t>_over_tp1_params`
against tp = 1 measured in the same run; a model whose heads t can neither split nor replicate
prints the refusal instead (SmolLM2-360M's 15 query heads at every even t).
Usage: `python benchmarks/jax_tp_placement.py [--max-len 2048]`.
The last line is one JSON object.

Run 2026-12-04 (2-core shared host, avx2 avx512f avx512_bf16; the figures are shapes, not
timings, so the host does not change them): Llama-3.2-1B 4.604 / 2.302 / 1.151 / 0.576 /
0.296 GiB of params per device at tp 1 / 2 / 4 / 8 / 16 (ratios 0.5, 0.25, 0.125, 0.064: at 16
its 8 KV heads are replicated, each k/v kernel share stays [D, 1, H] as at 8), KV 128 / 64 / 32
/ 16 / 16 MiB per slot at 2,048 positions (one KV head per device from tp 8 on); SmolLM2-360M
1.348 GiB at tp 1, refused at every even tp (15 query heads: 15 % 2 != 0, whatever its 5 KV
heads would allow).
"""

from __future__ import annotations

import argparse
import json
import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")

GIB = 1 << 30


def main() -> None:
    """Print each model's per-device bytes at tp 1, 2, 4, 8, 16 and the JSON summary."""
    import jax
    import numpy as np
    from flax import nnx
    from model_scale import MODELS

    from models.config import ModelConfig
    from models.decoder import Decoder
    from models.sharding import MeshError
    from rollout_engine.jax.tp import replica_layout, replica_mesh

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-len", type=int, default=2048)
    args = p.parse_args()
    out: dict[str, float | str] = {}
    reference = 1
    for name in ("llama_1b", "smollm2_360m"):
        cfg = ModelConfig.from_hf(dict(MODELS[name]))
        for tp in (1, 2, 4, 8, 16):
            mesh = replica_mesh(jax.devices()[:tp], tp)
            try:
                layout = replica_layout(cfg, mesh)
            except (MeshError, ValueError) as e:  # heads (MeshError), or mlp / vocab
                out[f"{name}_tp{tp}"] = f"refused: {e}"
                print(f"{name} tp={tp}: refused: {e}")
                continue
            held = layout.model_cfg  # KV heads repeated up to tp when the model has fewer
            abstract = nnx.eval_shape(lambda c=held: Decoder(c, rngs=nnx.Rngs(0)))
            per_device = 0
            for path, var in nnx.to_flat_state(nnx.state(abstract)):
                value = var.get_value()
                shard = layout.shardings[tuple(path)].shard_shape(value.shape)
                per_device += math.prod(shard) * np.dtype(value.dtype).itemsize
            kv = 2 * cfg.num_layers * args.max_len * (held.num_kv_heads // tp) * cfg.head_dim * 4
            out[f"{name}_tp{tp}_param_gib"] = round(per_device / GIB, 4)
            out[f"{name}_tp{tp}_kv_mib_per_slot"] = round(kv / (1 << 20), 2)
            out[f"{name}_tp{tp}_kv_heads_held"] = held.num_kv_heads
            if tp == 1:
                reference = per_device
            else:
                out[f"{name}_tp{tp}_over_tp1_params"] = round(per_device / reference, 3)
            gib, mib = per_device / GIB, kv >> 20
            print(
                f"{name} tp={tp}: params {gib:.3f} GiB/device, KV {mib} MiB/slot/device "
                f"({held.num_kv_heads} KV heads held for the model's {cfg.num_kv_heads})"
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
