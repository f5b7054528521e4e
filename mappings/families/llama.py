"""Llama (SmolLM2, Llama 2/3.x): untied or tied head, GQA; with `attention_bias`, biases on
q, k, v and o."""

from mappings.families._base import (
    ATTENTION,
    ATTENTION_BIAS,
    EMBED,
    FINAL_NORM,
    LLAMA_NORMS,
    LM_HEAD,
    MLP,
    OUTPUT_BIAS,
)
from mappings.spec import Family

FAMILY = Family(
    name="llama",
    rules=(
        EMBED,
        *LLAMA_NORMS,
        *ATTENTION,
        *ATTENTION_BIAS,
        OUTPUT_BIAS,
        *MLP,
        FINAL_NORM,
        LM_HEAD,
    ),
)
