"""LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on the decoder's projections.

A projection with kernel W of shape [inputs..., outputs...] gets two `nnx.LoRAParam`s:
``lora_a`` [I, r] and ``lora_b`` [r, O] (I, O the products of the input and output dims, the
HF / PEFT `in_features` and `out_features` of that `nn.Linear`), and its forward is PEFT's
unmerged x W + (alpha / r) (x A) B (`models.layers.Projection.__call__`); a merged export or a
full-weight push carries W + (alpha / r) · reshape(A @ B, W.shape), equal up to float
rounding. Init as PEFT's default: A from PEFT's `nn.init.kaiming_uniform_(a=sqrt(5))`,
uniform in ±sqrt(6 / ((1 + 5) · I)) = ±1 / sqrt(I), B zeros, so a fresh adapter leaves the
model unchanged.

Why a wrapper around the existing projection (`models.layers.Projection`) and not `nnx.LoRA`:
our kernels keep their head axes ([D, N, H], [N, H, D]) with logical axes for sharding, and
every call site einsums the kernel; `nnx.LoRA` wraps a 2-D `nnx.Linear` call. The
projection's own call adds the adapter's path beside the kernel's einsum, which keeps one
forward for every family and leaves the base params, their names and their sharding
untouched. The adapters are `nnx.LoRAParam` (a subclass of `nnx.Param`), so
`nnx.state(model, nnx.LoRAParam)` selects them.

Target names are PEFT's (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
`down_proj`); `TARGETS` maps each to its module path inside a layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.checkpoints.peft_layout import TARGETS
from models.decoder import Decoder
from models.params import flat_params

#: Path suffixes of the adapter params in `models.params.flat_params`.
ADAPTER_NAMES = ("lora_a", "lora_b")


def input_dims(kernel_axes: Sequence[str]) -> int:
    """How many leading dims of a kernel are its inputs: 1 when the input is the model width
    (`embed`, [D, ...]) or the MLP width, else all but the last (the output projection
    [N, H, D])."""
    return 1 if kernel_axes[0] in ("embed", "mlp") else len(kernel_axes) - 1


def add_lora(
    model: Decoder,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    key: jax.Array,
    b_init_std: float = 0.0,
) -> None:
    """Attaches a LoRA adapter to each target projection of every layer, in place.

    Args:
        model: a dense decoder (an MoE MLP has no `gate_proj` etc. to adapt: those targets
            raise).
        rank: r >= 1.
        alpha: the scaling numerator; the update is (alpha / r) A B.
        targets: PEFT names, a subset of `TARGETS`.
        key: PRNG key of A's init (and B's, with `b_init_std`).
        b_init_std: 0 (PEFT's init: B = 0, the model unchanged); > 0 draws B from
            N(0, b_init_std²): a non-zero adapter for tests of the engines' adapter path.

    Adapters are float32 whatever the base's param dtype (PEFT keeps them in the base's
    dtype; fp32 adapters on bf16 base weights are the usual mixed set-up).

    Raises:
        ValueError: rank < 1, an unknown or empty target list, a model that already has
            adapters, or a target the model's layers do not have (MoE experts).
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1; got {rank}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"LoRA targets {unknown or '[]'} unknown; known: {sorted(TARGETS)}")
    for i, block in enumerate(model.layers):
        for t in targets:
            sub, name = TARGETS[t]
            proj = getattr(getattr(block, sub), name, None)
            if proj is None or not hasattr(proj, "kernel"):
                raise ValueError(f"layer {i} has no {t} to adapt (an MoE MLP?)")
            if hasattr(proj, "lora_a"):
                raise ValueError(f"layer {i}'s {t} already has a LoRA adapter")
            shape = proj.kernel.shape
            n_in = input_dims(proj.kernel.get_metadata()["out_sharding"])
            fan_in, fan_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
            key, ka, kb = jax.random.split(key, 3)
            bound = 1.0 / math.sqrt(fan_in)
            a = jax.random.uniform(ka, (fan_in, rank), jnp.float32, -bound, bound)
            b = b_init_std * jax.random.normal(kb, (rank, fan_out), jnp.float32)
            meta = dict(eager_sharding=False)
            proj.lora_a = nnx.LoRAParam(a, out_sharding=("lora_io", "lora_rank"), **meta)
            proj.lora_b = nnx.LoRAParam(b, out_sharding=("lora_rank", "lora_io"), **meta)
            proj.lora_scale = float(alpha) / rank
            proj.lora_in_dims = n_in


def merge_lora(model: Decoder) -> None:
    """Folds every adapter into its base kernel (W <- W + (alpha/r) A B in float32, stored in
    the kernel's dtype) and removes the adapters, in place: the model a merged HF export or
    a full-weight push carries."""
    for block in model.layers:
        for sub, name in TARGETS.values():
            proj = getattr(getattr(block, sub), name, None)
            if proj is None or not hasattr(proj, "lora_a"):
                continue
            w = proj.kernel[...]
            proj.kernel[...] = (w.astype(jnp.float32) + proj.lora_delta()).astype(w.dtype)
            del proj.lora_a, proj.lora_b, proj.lora_scale, proj.lora_in_dims


def is_adapter(path: str) -> bool:
    """True for the flat param path (`models.params.path_str`) of a LoRA A or B."""
    return path.rsplit(".", 1)[-1] in ADAPTER_NAMES


def engine_params(model: Decoder) -> dict[str, jax.Array]:
    """The flat params an engine serves (`models.params.flat_params` paths): each adapted
    kernel merged, W + (alpha / r) A B in float32 cast to the kernel's dtype, and no adapter
    params; without adapters exactly `flat_params(model)` (the same arrays).

    This is the full-weight push of a LoRA run: the engines need no adapter support, and a
    push carries the whole model (an adapter-only push is not built yet)."""
    flat = flat_params(model)
    if not any(is_adapter(p) for p in flat):
        return flat
    out = {p: v for p, v in flat.items() if not is_adapter(p)}
    for i, block in enumerate(model.layers):
        for sub, name in TARGETS.values():
            proj = getattr(getattr(block, sub), name, None)
            if proj is not None and hasattr(proj, "lora_a"):
                out[f"layers.{i}.{sub}.{name}.kernel"] = proj.weight(proj.kernel[...].dtype)
    return out
