"""What vLLM cannot run, checked before the engine starts vLLM or registers.

vLLM's CPU attention (``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend``) runs only
the head sizes its ``get_supported_head_sizes()`` lists (in vLLM 0.32: 32, 64, 80, 96, 112,
128, 160, 192, 224, 256, 512); another one starts the engine and then kills its core at the
first forward pass (``RuntimeError: Unsupported CPU attention configuration: head_dim=16``),
leaving an engine that can serve nothing. `check_model` reads the list from vLLM itself, so a
newer vLLM's list is the one held.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollout_engine.precheck import ModelUnsupported


def head_dim_of(model: str | Path) -> int:
    """The attention head size of the HF checkpoint folder `model`: its config's ``head_dim``,
    else ``hidden_size // num_attention_heads``.

    Raises:
      OSError: no readable config.json; KeyError: neither is given.
    """
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # a multimodal config holds the language model's
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def check_model(model: str | Path) -> None:
    """Refuse a checkpoint vLLM's attention cannot run on this platform (CPU: a head size
    outside CPU_ATTN's list); a no-op on other platforms.

    Raises:
      ModelUnsupported: names the model's head size and the supported ones.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = sorted(CPUAttentionBackend.get_supported_head_sizes())
    head_dim = head_dim_of(model)
    if head_dim not in sizes:
        raise ModelUnsupported(
            f"the model at {model} has head_dim {head_dim}; vLLM's CPU attention (CPU_ATTN) "
            f"supports head sizes {sizes} only: its engine core would die at the first "
            "forward pass. Not starting vLLM and not registering (use rollout.backend=jax, "
            "or a model with a supported head size)"
        )
