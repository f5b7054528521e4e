"""Llama (SmolLM2, Llama 2/3.x): untied or tied head, GQA, no biases."""

from mappings.families._base import (
    ATTENTION,
    EMBED,
    FINAL_NORM,
    LLAMA_NORMS,
    LM_HEAD,
    MLP,
)
from mappings.spec import Family

FAMILY = Family(
    name="llama",
    rules=(EMBED, *LLAMA_NORMS, *ATTENTION, *MLP, FINAL_NORM, LM_HEAD),
)
