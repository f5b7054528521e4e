"""Builds the train step's parts from the run config (the launcher's and the tests' one way)."""

from __future__ import annotations

from jax.sharding import Mesh

from models.decoder import Decoder
from trainer.config import Config
from trainer.lora import attach_lora, trainable
from trainer.losses import make_loss
from trainer.losses.base import PolicyLoss
from trainer.losses.corrections import make_correction
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.train_step import TrainStep


def loss_from_config(cfg: Config) -> PolicyLoss:
    """The registry's loss named by ``cfg.loss.name`` with the section's settings and its
    off-policy correction (``loss.correction``, `trainer.losses.corrections`)."""
    s = cfg.loss
    correction = make_correction(
        s.correction, tis_cap=s.tis_cap, icepop_beta=s.icepop_beta, decoupled_cap=s.decoupled_cap
    )
    return make_loss(s.name, **s.loss_kwargs()).with_correction(correction)


def optimizer_config(cfg: Config) -> OptimizerConfig:
    """`OptimizerConfig` of the optim section; the schedule spans ``trainer.steps`` updates and
    accumulation is left to the train step (``grad_accum_steps=1``)."""
    o = cfg.optim
    return OptimizerConfig(
        learning_rate=o.learning_rate,
        warmup_steps=min(o.warmup_steps, cfg.trainer.steps),
        total_steps=cfg.trainer.steps,
        min_lr_ratio=o.min_lr_ratio,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        max_grad_norm=o.max_grad_norm,
        grad_accum_steps=1,
    )


def train_step_from_config(cfg: Config, model: Decoder, mesh: Mesh) -> TrainStep:
    """The compiled `TrainStep` of `model` on `mesh` as `cfg` describes it: the loss, AdamW,
    the sampling temperature and truncation (top-k, top-p), micro-batches, log-prob chunk size,
    attention block, FSDP threshold, scanned layers, remat, routing replay and the MoE
    load-balancing coefficient; with a KL term (``loss.kl_coef > 0``) `model`, as it is now,
    becomes the frozen reference. With ``lora.rank > 0`` the adapters are first added to
    `model` (in place) and only they are trained (`trainer.lora`)."""
    attach_lora(cfg, model)
    tx = make_optimizer(optimizer_config(cfg))
    step = TrainStep(
        model,
        loss_from_config(cfg),
        tx,
        mesh,
        temperature=cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
        micro_batches=cfg.trainer.micro_batches,
        chunk_size=cfg.trainer.logprob_chunk_size,
        attention_block=cfg.trainer.attention_block,
        min_shard_bytes=cfg.trainer.min_shard_bytes,
        scan_layers=cfg.model.scan_layers,
        remat=cfg.model.remat,
        routing_replay=cfg.loss.routing_replay == "engine",
        moe_aux_coef=cfg.loss.moe_aux_coef,
        trainable=trainable(cfg),
    )
    if cfg.loss.kl_coef > 0:
        step.set_reference(model)
    return step
