"""The run config held against the model's config before anything starts: the mesh's tensor-
and expert-parallel degrees and the mixture-of-experts loss settings, each a clear error
instead of a failure in the trainer process."""

from __future__ import annotations

from models.config import ModelConfig
from models.sharding import check_ep, check_tp
from trainer.config import Config
from trainer.moe_aux import check_moe_aux


def check_model_fit(model_cfg: ModelConfig, cfg: Config) -> None:
    """Raises a ValueError (`models.sharding.MeshError` is one) naming the setting when
    trainer.tp does not divide the heads, trainer.ep is above 1 on a dense model or does not
    divide num_experts, or loss.moe_aux_coef is set on a dense model
    (`trainer.moe_aux.check_moe_aux`), or routes are asked for (routing replay,
    `rollout.return_routes`) from a dense model."""
    if cfg.wants_routes and not model_cfg.num_experts:
        raise ValueError(
            "loss.routing_replay=engine / rollout.return_routes need a mixture-of-experts "
            f"model; the model is the dense {model_cfg.family}; nothing was started"
        )
    check_tp(model_cfg, cfg.trainer.tp)
    check_ep(model_cfg, cfg.trainer.ep)
    check_moe_aux(model_cfg, cfg.loss.moe_aux_coef)
