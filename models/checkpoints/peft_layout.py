"""PEFT's view of a LoRA adapter without JAX: which HF modules a LoRA on given targets
adapts (from the family's mapping), the PEFT names and shapes of its tensors, and the PEFT
folder they are written as. Imported by the vLLM engine process, which must not load JAX.

Tensor names are PEFT's for a causal LM: ``base_model.model.<module>.lora_A.weight`` [r, in]
and ``...lora_B.weight`` [out, r], where <module> is the HF module of the adapted projection
(its weight's name in the family mapping without ``.weight``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from mappings.registry import get_family
from mappings.spec import expand
from models.config import ModelConfig

PREFIX = "base_model.model."

#: PEFT target name -> (sub-module, projection) of a `models.decoder.Block`.
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("attn", "q"),
    "k_proj": ("attn", "k"),
    "v_proj": ("attn", "v"),
    "o_proj": ("attn", "o"),
    "gate_proj": ("mlp", "gate"),
    "up_proj": ("mlp", "up"),
    "down_proj": ("mlp", "down"),
}


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


def checkpoint_adapter_shapes(
    model_dir: str | Path, targets: Sequence[str], rank: int, dtype: str
) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, `dtype`) of every adapter tensor (`adapter_shapes`) of a LoRA on the HF
    checkpoint folder `model_dir` (its config.json).

    Raises:
        FileNotFoundError: no config.json. ValueError: see `adapter_modules`.
    """
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    return {n: (tuple(s), dtype) for n, s in adapter_shapes(cfg, targets, rank)}


def write_peft_folder(
    path: str | Path,
    tensors: Mapping[str, Any],
    rank: int,
    alpha: float,
    targets: Sequence[str],
    *,
    base: str | Path = "",
) -> Path:
    """Writes PEFT-named adapter tensors (numpy arrays or torch tensors, `adapter_shapes`) as a
    PEFT LoRA folder `path` (created): ``adapter_config.json`` (r, lora_alpha, target_modules;
    no rslora, no DoRA, no dropout) and ``adapter_model.safetensors``.

    Returns:
        The folder path.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": int(rank),
        "lora_alpha": float(alpha),
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if all(isinstance(t, np.ndarray) for t in tensors.values()):
        save_file(dict(tensors), out / "adapter_model.safetensors", metadata={"format": "pt"})
    else:
        from safetensors.torch import save_file as save_torch

        contiguous = {n: t.contiguous() for n, t in tensors.items()}
        save_torch(contiguous, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
