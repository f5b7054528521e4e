"""LoRA in the train step: adapters attached from the config, only they trained.

`trainable(cfg)` names the adapters (`models.lora.is_adapter` paths) as the train step's
trainable params: the step's `jax.value_and_grad` differentiates them alone (the base params
are closed over, so no base weight gradient is computed or held), and the optimizer (clipping,
AdamW) and its state cover them alone, so the base stays frozen and the gradients and the
optimizer state are the adapters' size (Hu et al. 2021, "LoRA", section 4.2).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from models.decoder import Decoder
from models.lora import add_lora, is_adapter
from trainer.config import Config


def trainable(cfg: Config) -> Callable[[str], bool] | None:
    """Which params a run trains, for `TrainStep`'s ``trainable``: with ``lora.rank > 0`` the
    adapters (`models.lora.is_adapter`: gradients, optimizer and its state for them only, the
    base frozen), else None (every param)."""
    return is_adapter if cfg.lora.rank > 0 else None


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
