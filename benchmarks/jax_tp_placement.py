"""Bytes per device of a JAX engine replica's params and KV cache at tensor-parallel degree 1, 2
and 4 (`rollout_engine.jax.tp`), for the Llama-3.2-1B and SmolLM2-360M shapes of
`benchmarks/model_scale.py` (abstract: nothing is allocated, the shard shapes come from the
replica mesh's NamedShardings on 4 host CPU devices).

Figures: `<model>_tp<t>_param_gib` (the largest per-device share of the params, fp32),
`<model>_tp<t>_kv_mib_per_slot` (one slot's KV cache at `--max-len` positions on one device,
fp32) and the ratio `<model>_tp<t>_over_tp1_params` against tp = 1 measured in the same run;
a model whose heads t does not divide prints the refusal instead (SmolLM2-360M's 15 query /
5 KV heads at t = 2 and 4). Usage: `python benchmarks/jax_tp_placement.py [--max-len 2048]`.
The last line is one JSON object.

Run 2026-12-04 (2-core shared host, avx2 avx512f avx512_bf16; the figures are shapes, not
timings, so the host does not change them): Llama-3.2-1B 4.604 / 2.302 / 1.151 GiB of params
per device at tp 1 / 2 / 4 (ratios 0.5, 0.25: the norms, replicated, are under 0.1 %), KV 128
/ 64 / 32 MiB per slot at 2,048 positions; SmolLM2-360M 1.348 GiB at tp 1, refused at 2 and 4.
"""

from __future__ import annotations

import argparse
import json
import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

GIB = 1 << 30


def main() -> None:
    """Print each model's per-device bytes at tp 1, 2, 4 and the JSON summary."""
    import jax
    import numpy as np
    from flax import nnx
    from model_scale import MODELS

    from models.config import ModelConfig
    from models.decoder import Decoder
    from models.sharding import MeshError
    from rollout_engine.jax.tp import param_shardings, replica_mesh

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-len", type=int, default=2048)
    args = p.parse_args()
    out: dict[str, float | str] = {}
    reference = 1
    for name in ("llama_1b", "smollm2_360m"):
        cfg = ModelConfig.from_hf(dict(MODELS[name]))
        abstract = nnx.eval_shape(lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)))
        flat = dict(nnx.to_flat_state(nnx.state(abstract)))
        for tp in (1, 2, 4):
            mesh = replica_mesh(jax.devices()[:tp], tp)
            try:
                shardings = param_shardings(cfg, mesh)
            except MeshError as e:
                out[f"{name}_tp{tp}"] = f"refused: {e}"
                print(f"{name} tp={tp}: refused: {e}")
                continue
            per_device = 0
            for path, var in flat.items():
                value = var.get_value()
                shard = shardings[tuple(path)].shard_shape(value.shape)
                per_device += math.prod(shard) * np.dtype(value.dtype).itemsize
            kv = 2 * cfg.num_layers * args.max_len * (cfg.num_kv_heads // tp) * cfg.head_dim * 4
            out[f"{name}_tp{tp}_param_gib"] = round(per_device / GIB, 4)
            out[f"{name}_tp{tp}_kv_mib_per_slot"] = round(kv / (1 << 20), 2)
            if tp == 1:
                reference = per_device
            else:
                out[f"{name}_tp{tp}_over_tp1_params"] = round(per_device / reference, 3)
            gib, mib = per_device / GIB, kv >> 20
            print(f"{name} tp={tp}: params {gib:.3f} GiB/device, KV {mib} MiB/slot")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
