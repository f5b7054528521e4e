"""LoRA in the train step: adapters attached from the config, only they in the optimizer.

`adapter_only(tx)` is `optax.multi_transform`: the adapters (`models.lora.is_adapter` paths)
get `tx` (clipping, AdamW) and its state; every base param gets `optax.set_to_zero()`, which
holds no state, so the base stays frozen and the optimizer state is the adapters' size.
The base's gradients are still computed by the step's `jax.value_and_grad` (and dropped).
"""

from __future__ import annotations

import jax
import optax

from models.decoder import Decoder
from models.lora import add_lora, is_adapter
from trainer.config import Config


def adapter_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` on the LoRA params of a flat param dict (path -> array), zero updates elsewhere.

    Raises (on `init`): ValueError when the params hold no adapter (nothing would train).
    """

    def labels(params: dict[str, jax.Array]) -> dict[str, str]:
        out = {p: "adapter" if is_adapter(p) else "frozen" for p in params}
        if "adapter" not in out.values():
            raise ValueError("adapter_only: the params hold no LoRA adapter (lora_a / lora_b)")
        return out

    return optax.multi_transform({"adapter": tx, "frozen": optax.set_to_zero()}, labels)


def attach_lora(cfg: Config, model: Decoder) -> None:
    """Adds the adapters of ``cfg.lora`` to `model` in place (nothing when ``lora.rank == 0``);
    A's init key is ``trainer.seed`` folded with 0x10AA.

    Raises:
        ValueError: see `models.lora.add_lora`.
    """
    s = cfg.lora
    if s.rank == 0:
        return
    key = jax.random.fold_in(jax.random.key(cfg.trainer.seed), 0x10AA)
    add_lora(model, s.rank, s.alpha, s.targets, key, b_init_std=s.init_b_std)
