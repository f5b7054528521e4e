"""A decoder's LoRA adapters (`models.lora`) as a PEFT adapter folder: `adapter_config.json` and
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, folder)` and vLLM's
`LoRARequest` load onto the base checkpoint.

Tensor names are PEFT's for a causal LM: ``base_model.model.<module>.lora_A.weight`` [r, I] and
``...lora_B.weight`` [O, r], where <module> is the HF module of the adapted projection (its
weight's name in the family mapping, `mappings.families`, without ``.weight``), and our A [I, r],
B [r, O] are transposed to torch's `nn.Linear` layout [out, in]. The flattening of I and O is
the HF tensor's: our kernels keep HF's (N H) order (the mapping's layouts "(N H) D" / "D (N H)"
are plain reshapes), which the PEFT-logits test holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.checkpoints.peft_layout import TARGETS, adapter_modules, write_peft_folder
from models.decoder import Decoder
from models.params import flat_params


def peft_tensors(
    params: Mapping[str, Any], cfg: Any, targets: Sequence[str]
) -> Iterator[tuple[str, np.ndarray]]:
    """The PEFT-named adapter tensors of flat params (`models.params.flat_params` paths, with
    ``lora_a`` [I, r] and ``lora_b`` [r, O] beside each adapted kernel), one at a time, in
    `adapter_shapes` order: A as [r, I] and B as [O, r], transposed views of host copies
    (their dtype unchanged; the receiver's packing copy casts).

    Raises:
        KeyError: a target projection without its adapter params (named).
    """
    for mod in adapter_modules(cfg, targets):
        a = np.asarray(jax.device_get(params[f"{mod.prefix}.lora_a"]))  # [I, r]
        b = np.asarray(jax.device_get(params[f"{mod.prefix}.lora_b"]))  # [r, O]
        yield f"{mod.peft}.lora_A.weight", a.T
        yield f"{mod.peft}.lora_B.weight", b.T


def merge_peft(
    base: Mapping[str, jax.Array],
    cfg: Any,
    tensors: Mapping[str, np.ndarray],
    targets: Sequence[str],
    scaling: float,
    *,
    only_adapted: bool = False,
) -> dict[str, jax.Array]:
    """Base flat params with each adapted kernel merged: W + (alpha / r) reshape((B A)^T),
    computed in float32 and cast to the kernel's dtype (Hu et al. 2021, eq. 3; PEFT's
    `merge`). `base` is not changed; the result shares every other array with it.

    Args:
        base: flat params of the base model (dot paths).
        cfg: its `ModelConfig`.
        tensors: PEFT names -> A [r, in], B [out, r] (`adapter_shapes`).
        targets: the adapted projections (PEFT names).
        scaling: alpha / r (PEFT's `scaling`).
        only_adapted: return only the merged kernels (flat path -> kernel, each of its base
            kernel's shape and dtype), for a caller that keeps every other param as it is
            (the JAX engine's `models.params.replace_params`); False: every path of `base`.

    Raises:
        KeyError: a tensor `spec` needs that `tensors` lacks (named).
    """
    out = {} if only_adapted else dict(base)
    s = jnp.float32(scaling)
    for mod in adapter_modules(cfg, targets):
        a = tensors[f"{mod.peft}.lora_A.weight"]  # [r, I]
        b = tensors[f"{mod.peft}.lora_B.weight"]  # [O, r]
        out[mod.kernel] = _merge_kernel(base[mod.kernel], a, b, s)
    return out


@jax.jit
def _merge_kernel(w: jax.Array, a: Any, b: Any, scaling: jax.Array) -> jax.Array:
    """W + scaling * reshape((B A)^T) in float32, cast to W's dtype: one compiled call per
    kernel shape (an adapter's kernels have a handful), not six eager ops per kernel."""
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)  # [r, I], [O, r]
    delta = (a32.T @ b32.T).reshape(w.shape)  # [I, O] -> the kernel's (in..., out...) dims
    return (w.astype(jnp.float32) + scaling * delta).astype(w.dtype)


def adapter_tensors(model: Decoder, dtype: str = "float32") -> tuple[dict[str, np.ndarray], dict]:
    """PEFT-named adapter tensors of `model` (numpy, `dtype`) and the adapter's shape facts
    {"r", "lora_alpha", "target_modules"}.

    Raises:
        ValueError: `model` has no adapter.
    """
    targets, rank, scale = set(), 0, 0.0
    for block in model.layers:
        for target, (sub, name) in TARGETS.items():
            proj = getattr(getattr(block, sub), name, None)
            if proj is not None and hasattr(proj, "lora_a"):
                targets.add(target)
                rank, scale = proj.lora_a.shape[1], proj.lora_scale
    if not targets:
        raise ValueError("the model has no LoRA adapter to export (lora.rank is 0)")
    flat = flat_params(model)
    tensors = {
        n: np.ascontiguousarray(a.astype(dtype))
        for n, a in peft_tensors(flat, model.cfg, sorted(targets))
    }
    facts = {"r": rank, "lora_alpha": scale * rank, "target_modules": sorted(targets)}
    return tensors, facts


def save_peft_adapter(
    model: Decoder, path: str | Path, *, base: str | Path = "", dtype: str = "float32"
) -> Path:
    """Writes `model`'s adapters as a PEFT LoRA folder `path` (created) for the base checkpoint
    `base` (recorded as `base_model_name_or_path`), tensors in `dtype`.

    Returns:
        The folder path.

    Raises:
        ValueError: `model` has no adapter.
    """
    tensors, facts = adapter_tensors(model, dtype)
    return write_peft_folder(path, tensors, facts["r"], facts["lora_alpha"],
                             facts["target_modules"], base=base)  # fmt: skip
