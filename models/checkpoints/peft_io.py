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
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from mappings.registry import get_family
from models.decoder import Decoder
from models.lora import TARGETS

PREFIX = "base_model.model."


def _hf_module(rules: dict[str, str], layer: int, sub: str, name: str) -> str:
    """The HF module name of layer `layer`'s projection `sub.name` ("model.layers.0.self_attn.
    q_proj"), from the mapping rule of its kernel."""
    hf = rules[f"layers.{{layer}}.{sub}.{name}.kernel"].format(layer=layer)
    return hf.removesuffix(".weight")


def adapter_tensors(model: Decoder, dtype: str = "float32") -> tuple[dict[str, np.ndarray], dict]:
    """PEFT-named adapter tensors of `model` (numpy, `dtype`) and the adapter's shape facts
    {"r", "lora_alpha", "target_modules"}.

    Raises:
        ValueError: `model` has no adapter.
    """
    rules = {r.jax: r.hf for r in get_family(model.cfg.family).rules}
    tensors: dict[str, np.ndarray] = {}
    targets, rank, scale = set(), 0, 0.0
    for i, block in enumerate(model.layers):
        for target, (sub, name) in TARGETS.items():
            proj = getattr(getattr(block, sub), name, None)
            if proj is None or not hasattr(proj, "lora_a"):
                continue
            module = PREFIX + _hf_module(rules, i, sub, name)
            a = np.asarray(jax.device_get(proj.lora_a[...]))  # [I, r]
            b = np.asarray(jax.device_get(proj.lora_b[...]))  # [r, O]
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a.T.astype(dtype))
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b.T.astype(dtype))
            targets.add(target)
            rank, scale = a.shape[1], proj.lora_scale
    if not tensors:
        raise ValueError("the model has no LoRA adapter to export (lora.rank is 0)")
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
