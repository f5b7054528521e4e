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

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from mappings.registry import get_family
from mappings.spec import expand
from models.decoder import Decoder
from models.lora import TARGETS
from models.params import flat_params

PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection of one layer.

    Attributes:
        peft: PEFT module name, ``base_model.model.model.layers.0.self_attn.q_proj``.
        kernel: our dot path of its base kernel (`models.params.flat_params`),
            ``layers.0.attn.q.kernel``; the adapter params sit beside it (``...q.lora_a``).
        out_features, in_features: the HF `nn.Linear` sizes (its weight is [out, in]).
    """

    peft: str
    kernel: str
    out_features: int
    in_features: int

    @property
    def prefix(self) -> str:
        """The kernel's dot path without ``.kernel``: where ``lora_a`` / ``lora_b`` live."""
        return self.kernel.removesuffix(".kernel")


def adapter_modules(cfg: Any, targets: Sequence[str]) -> list[AdapterModule]:
    """Every projection of `cfg`'s model that a LoRA on `targets` (PEFT names,
    `models.lora.TARGETS`) adapts, layer by layer, from the family's mapping (HF names and
    shapes). The order is the tensors' sending order in an adapter-only push.

    Raises:
        ValueError: an unknown target, or a target the model's mapping lacks (an MoE MLP).
    """
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"LoRA targets {unknown or '[]'} unknown; known: {sorted(TARGETS)}")
    wanted = {f"{sub}.{name}.kernel" for t in targets for sub, name in [TARGETS[t]]}
    out = []
    for r in expand(get_family(cfg.family), cfg):
        if r.layer is None or r.jax.split(".", 2)[-1] not in wanted:
            continue
        o, i = r.hf_shape
        out.append(AdapterModule(PREFIX + r.hf.removesuffix(".weight"), r.jax, o, i))
    if len(out) != len(wanted) * cfg.num_layers:
        raise ValueError(
            f"LoRA targets {sorted(targets)}: the {cfg.family} mapping has {len(out)} of the "
            f"{len(wanted) * cfg.num_layers} projections (an MoE MLP has no gate/up/down_proj)"
        )
    return out


def adapter_shapes(cfg: Any, targets: Sequence[str], rank: int) -> list[tuple[str, tuple]]:
    """(PEFT tensor name, shape) of every adapter tensor, in sending order: per module
    ``lora_A.weight`` [r, in] then ``lora_B.weight`` [out, r].

    Raises:
        ValueError: see `adapter_modules`.
    """
    out: list[tuple[str, tuple]] = []
    for mod in adapter_modules(cfg, targets):
        out.append((f"{mod.peft}.lora_A.weight", (rank, mod.in_features)))
        out.append((f"{mod.peft}.lora_B.weight", (mod.out_features, rank)))
    return out


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

    Raises:
        KeyError: a tensor `spec` needs that `tensors` lacks (named).
    """
    out = dict(base)
    for mod in adapter_modules(cfg, targets):
        w = base[mod.kernel]
        a = jnp.asarray(tensors[f"{mod.peft}.lora_A.weight"], jnp.float32)  # [r, I]
        b = jnp.asarray(tensors[f"{mod.peft}.lora_B.weight"], jnp.float32)  # [O, r]
        delta = (a.T @ b.T).reshape(w.shape)  # [I, O] -> the kernel's (in..., out...) dims
        out[mod.kernel] = (w.astype(jnp.float32) + scaling * delta).astype(w.dtype)
    return out


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
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": facts["r"],
        "lora_alpha": facts["lora_alpha"],
        "target_modules": facts["target_modules"],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out
