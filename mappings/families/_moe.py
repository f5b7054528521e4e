"""Rules shared by the mixture-of-experts families (HF `Qwen3MoeForCausalLM` /
`OlmoeForCausalLM` naming, as transformers 5.x saves them: one tensor per expert).

The JAX side stacks the experts on a leading "E" axis (`models.moe.Experts`: gate / up
[E, D, M], down [E, M, D]). vLLM takes the per-expert HF names in `load_weights` and packs
them itself into its fused expert tensors (`w13_weight` [E, 2M, D]: gate then up; `w2_weight`
[E, D, M]), through its expert params mapping (not `packed_modules_mapping`), so these rules
carry no `fused` target. TP shard dims are those of the dense MLP: vLLM's fused-MoE layer
splits each expert's M.
"""

from __future__ import annotations

from mappings.families._base import J, L
from mappings.spec import Rule

EXPERT = f"{L}.mlp.experts.{{expert}}"

MOE = (
    Rule(f"{J}.mlp.router.kernel", f"{L}.mlp.gate.weight", "E D", "D E"),
    Rule(f"{J}.mlp.experts.gate.kernel", f"{EXPERT}.gate_proj.weight", "M D", "E D M", 0),
    Rule(f"{J}.mlp.experts.up.kernel", f"{EXPERT}.up_proj.weight", "M D", "E D M", 0),
    Rule(f"{J}.mlp.experts.down.kernel", f"{EXPERT}.down_proj.weight", "D M", "E M D", 1),
)
#: OLMoE's q/k norms: one RMSNorm over the whole projection ([N·H], [K·H]), not per head.
QK_NORM_FULL = (
    Rule(f"{J}.attn.q_norm.scale", f"{L}.self_attn.q_norm.weight", "(N H)", "(N H)",
         when="qk_norm_full"),
    Rule(f"{J}.attn.k_norm.scale", f"{L}.self_attn.k_norm.weight", "(K H)", "(K H)",
         when="qk_norm_full"),
)  # fmt: skip
