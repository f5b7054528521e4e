"""Qwen3 (dense): Llama layout plus per-head q/k RMSNorm, no biases."""

from mappings.families._base import (
    ATTENTION,
    EMBED,
    FINAL_NORM,
    LLAMA_NORMS,
    LM_HEAD,
    MLP,
    QK_NORM,
)
from mappings.spec import Family

FAMILY = Family(
    name="qwen3",
    rules=(EMBED, *LLAMA_NORMS, *ATTENTION, *QK_NORM, *MLP, FINAL_NORM, LM_HEAD),
)
