"""The JAX engine's two ways to serve a LoRA version (issue 30 item 2): merge each version into
the base on load, or apply the adapter unmerged in every forward; measured in one run.

On `--model` (default smollm2) in each `--dtypes` dtype, with a rank `--rank` adapter on all
seven projections (alpha 2r, B drawn with std 0.02 so the adapter is not zero):

- ``merged_step_s``: one decode step (T = 1) of `--rows` rows over a KV cache of `--slots`
  slots with the adapter folded into the kernels (what the engine serves today,
  `rollout_engine.jax.backend` via `models.checkpoints.peft_io.merge_peft`);
- ``unmerged_step_s``: the same step with the kernels left as the base and PEFT's unmerged
  x W + (alpha / r) (x A) B in each projection (`models.layers.Projection`, the trainer's forward);
- ``merge_s``: what merging one version costs the engine: `merge_peft(..., only_adapted=True)`
  of the PEFT tensors a push carries, to the merged kernels on device.

The steps are timed in interleaved rounds (each once per round, after one untimed call), so a
burst of load on a shared machine hits both alike; ``merge_s`` likewise per round. Both steps'
logits are compared: ``max_abs_logit_diff`` and ``argmax_agreement`` (the fraction of rows whose
greedy token is the same); the two forms differ only by float rounding, which in bf16 grows
through the layers (this adapter is large: B std 0.02).
``unmerged_over_merged_step`` is the ratio of step seconds; ``break_even_steps`` is how many
decode steps per version make merging cheaper than the unmerged forward,
``merge_s / (unmerged_step_s - merged_step_s)`` (null when the unmerged step is not slower).

Usage: python benchmarks/lora_decode.py [--model smollm2|tiny|HF_DIR] [--dtypes float32,bfloat16]
    [--rank 16] [--rows 64] [--slots 192] [--repeats 5]
Prints one line per dtype, then one JSON object on the last line: per dtype ``<dt>_merged_step_s``,
``<dt>_unmerged_step_s``, ``<dt>_merge_s``, ``<dt>_unmerged_over_merged_step``,
``<dt>_break_even_steps``, ``<dt>_max_abs_logit_diff``, ``<dt>_argmax_agreement`` (dt: fp32,
bf16).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from common import model_path
from decode_pieces import interleaved_medians
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.peft_io import adapter_tensors, merge_peft
from models.checkpoints.peft_layout import TARGETS
from models.kv_cache import KVCache
from models.lora import add_lora, merge_lora
from models.params import flat_params

SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def measure(path: Path, dtype: str, rank: int, rows: int, slots: int, repeats: int) -> dict:
    """The figures of one dtype (keys without the dtype prefix; see the module docstring).

    Raises:
        ValueError: `rank` < 1 (`models.lora.add_lora`).
    """
    cfg, unmerged = load_hf_checkpoint(path, dtype=dtype)
    base = flat_params(unmerged)  # the kernels before the adapter: the engine's kept base
    targets = sorted(TARGETS)
    add_lora(unmerged, rank, 2.0 * rank, targets, jax.random.key(0), b_init_std=0.02)
    tensors, facts = adapter_tensors(unmerged, "float32")  # what an adapter-only push carries
    scaling = facts["lora_alpha"] / facts["r"]
    merged = copy.deepcopy(unmerged)
    merge_lora(merged)
    cache = KVCache.init(cfg, rows, slots)
    tokens = (jnp.arange(rows, dtype=jnp.int32) % cfg.vocab_size)[:, None]  # [rows, 1]
    positions = jnp.full((rows, 1), slots - 1, jnp.int32)

    def decode(model: Any) -> Callable[[], jax.Array]:
        graphdef, params = nnx.split(model)
        step = jax.jit(lambda p, c: nnx.merge(graphdef, p)(tokens, positions, c)[0])
        return lambda: step(params, cache)

    def merge() -> dict[str, jax.Array]:
        return merge_peft(base, cfg, tensors, targets, scaling, only_adapted=True)

    calls = {"merged_step": decode(merged), "unmerged_step": decode(unmerged), "merge": merge}
    seconds = interleaved_medians(calls, repeats)
    merged_logits = np.asarray(calls["merged_step"]())[:, -1]  # [rows, V] float32
    unmerged_logits = np.asarray(calls["unmerged_step"]())[:, -1]
    diff = np.abs(merged_logits - unmerged_logits)
    same = merged_logits.argmax(-1) == unmerged_logits.argmax(-1)  # [rows]
    extra = seconds["unmerged_step"] - seconds["merged_step"]
    return {
        "merged_step_s": seconds["merged_step"],
        "unmerged_step_s": seconds["unmerged_step"],
        "merge_s": seconds["merge"],
        "unmerged_over_merged_step": seconds["unmerged_step"] / seconds["merged_step"],
        "break_even_steps": seconds["merge"] / extra if extra > 0 else None,
        "max_abs_logit_diff": float(diff.max()),
        "argmax_agreement": float(same.mean()),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Measures each dtype and prints the figures, the JSON object on the last line (also
    returned)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(SHORT) or args.rank < 1:
        parser.error(f"--dtypes takes {sorted(SHORT)} (comma-separated) and --rank >= 1")
    out: dict[str, object] = {"model": args.model, "rank": args.rank, "rows": args.rows,
                              "slots": args.slots}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        for dtype in dtypes:
            fig = measure(path, dtype, args.rank, args.rows, args.slots, args.repeats)
            short = SHORT[dtype]
            print(
                f"{short}: decode step merged {fig['merged_step_s'] * 1e3:.1f} ms, unmerged "
                f"{fig['unmerged_step_s'] * 1e3:.1f} ms "
                f"({fig['unmerged_over_merged_step']:.2f}x); merging a version "
                f"{fig['merge_s'] * 1e3:.1f} ms; break-even {fig['break_even_steps']} steps",
                flush=True,
            )
            out.update({f"{short}_{k}": v for k, v in fig.items()})
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
