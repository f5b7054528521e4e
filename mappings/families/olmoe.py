"""OLMoE: Llama attention with one q/k RMSNorm over the whole projection, and a
mixture-of-experts MLP in every layer (router `mlp.gate`, per-expert `mlp.experts.{e}.*`)."""

from mappings.families._base import ATTENTION, EMBED, FINAL_NORM, LLAMA_NORMS, LM_HEAD
from mappings.families._moe import MOE, QK_NORM_FULL
from mappings.spec import Family

FAMILY = Family(
    name="olmoe",
    rules=(EMBED, *LLAMA_NORMS, *ATTENTION, *QK_NORM_FULL, *MOE, FINAL_NORM, LM_HEAD),
)
