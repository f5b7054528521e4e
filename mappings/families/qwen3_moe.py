"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no biases) with a mixture-of-experts
MLP in every layer (router `mlp.gate`, per-expert `mlp.experts.{e}.*_proj`)."""

from mappings.families._base import ATTENTION, EMBED, FINAL_NORM, LLAMA_NORMS, LM_HEAD, QK_NORM
from mappings.families._moe import MOE
from mappings.spec import Family

FAMILY = Family(
    name="qwen3_moe",
    rules=(EMBED, *LLAMA_NORMS, *ATTENTION, *QK_NORM, *MOE, FINAL_NORM, LM_HEAD),
)
