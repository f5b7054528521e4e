"""Gemma 3 (text): four norms per layer, q/k norms, (1+w) norms stored as w, tied head."""

from mappings.families._base import (
    ATTENTION,
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    MLP,
    QK_NORM,
    J,
    L,
)
from mappings.spec import Family, Rule

NORMS = (
    Rule(f"{J}.attn_norm.scale", f"{L}.input_layernorm.weight", "D", "D"),
    Rule(f"{J}.post_attn_norm.scale", f"{L}.post_attention_layernorm.weight", "D", "D"),
    Rule(f"{J}.mlp_norm.scale", f"{L}.pre_feedforward_layernorm.weight", "D", "D"),
    Rule(f"{J}.post_mlp_norm.scale", f"{L}.post_feedforward_layernorm.weight", "D", "D"),
)

FAMILY = Family(
    name="gemma3",
    rules=(EMBED, *NORMS, *ATTENTION, *QK_NORM, *MLP, FINAL_NORM, LM_HEAD),
    # Gemma 3 text checkpoints say "gemma3_text"; multimodal ones "gemma3" (with a text_config).
    model_types=("gemma3", "gemma3_text"),
)
