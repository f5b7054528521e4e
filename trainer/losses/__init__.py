"""Policy-gradient losses (GRPO, Dr. GRPO, DAPO, CISPO) behind one registry, and advantages."""

from trainer.losses.advantages import GroupAdvantages, group_advantages
from trainer.losses.base import AGGREGATIONS, LossInputs, LossOutput, PolicyLoss, aggregate, k3_kl
from trainer.losses.cispo import CISPOLoss
from trainer.losses.dapo import DAPOLoss
from trainer.losses.dr_grpo import DrGRPOLoss
from trainer.losses.grpo import GRPOLoss
from trainer.losses.registry import available_losses, make_loss, register_loss

__all__ = [
    "AGGREGATIONS",
    "CISPOLoss",
    "DAPOLoss",
    "DrGRPOLoss",
    "GRPOLoss",
    "GroupAdvantages",
    "LossInputs",
    "LossOutput",
    "PolicyLoss",
    "aggregate",
    "available_losses",
    "group_advantages",
    "k3_kl",
    "make_loss",
    "register_loss",
]
