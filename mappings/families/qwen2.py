"""Qwen2 / Qwen2.5: Llama layout plus q/k/v biases."""

from mappings.families._base import (
    ATTENTION,
    ATTENTION_BIAS,
    EMBED,
    FINAL_NORM,
    LLAMA_NORMS,
    LM_HEAD,
    MLP,
)
from mappings.spec import Family

FAMILY = Family(
    name="qwen2",
    rules=(EMBED, *LLAMA_NORMS, *ATTENTION, *ATTENTION_BIAS, *MLP, FINAL_NORM, LM_HEAD),
)
