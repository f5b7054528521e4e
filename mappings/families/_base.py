"""Rules shared by the Llama-shaped families (HF `LlamaForCausalLM` naming)."""

from __future__ import annotations

from mappings.spec import Rule

L = "model.layers.{layer}"
J = "layers.{layer}"
QKV = f"{L}.self_attn.qkv_proj.weight"
QKV_BIAS = f"{L}.self_attn.qkv_proj.bias"
GATE_UP = f"{L}.mlp.gate_up_proj.weight"


EMBED = Rule("embed.embedding", "model.embed_tokens.weight", "V D", "V D", tp_dim=0)
FINAL_NORM = Rule("final_norm.scale", "model.norm.weight", "D", "D")
LM_HEAD = Rule("lm_head.kernel", "lm_head.weight", "V D", "D V", tp_dim=0, when="untied")

ATTENTION = (
    Rule(f"{J}.attn.q.kernel", f"{L}.self_attn.q_proj.weight", "(N H) D", "D N H", 0, (QKV, "q")),
    Rule(f"{J}.attn.k.kernel", f"{L}.self_attn.k_proj.weight", "(K H) D", "D K H", 0, (QKV, "k")),
    Rule(f"{J}.attn.v.kernel", f"{L}.self_attn.v_proj.weight", "(K H) D", "D K H", 0, (QKV, "v")),
    Rule(f"{J}.attn.o.kernel", f"{L}.self_attn.o_proj.weight", "D (N H)", "N H D", 1),
)
ATTENTION_BIAS = (
    Rule(
        f"{J}.attn.q.bias",
        f"{L}.self_attn.q_proj.bias",
        "(N H)",
        "N H",
        0,
        (QKV_BIAS, "q"),
        when="attention_bias",
    ),
    Rule(
        f"{J}.attn.k.bias",
        f"{L}.self_attn.k_proj.bias",
        "(K H)",
        "K H",
        0,
        (QKV_BIAS, "k"),
        when="attention_bias",
    ),
    Rule(
        f"{J}.attn.v.bias",
        f"{L}.self_attn.v_proj.bias",
        "(K H)",
        "K H",
        0,
        (QKV_BIAS, "v"),
        when="attention_bias",
    ),
)
#: The output projection's bias (HF Llama's `attention_bias` biases o_proj as well as q, k, v):
#: row-parallel in the engine, so every TP rank holds it whole.
OUTPUT_BIAS = Rule(
    f"{J}.attn.o.bias", f"{L}.self_attn.o_proj.bias", "D", "D", None, when="output_bias"
)
QK_NORM = (
    Rule(f"{J}.attn.q_norm.scale", f"{L}.self_attn.q_norm.weight", "H", "H", when="qk_norm"),
    Rule(f"{J}.attn.k_norm.scale", f"{L}.self_attn.k_norm.weight", "H", "H", when="qk_norm"),
)
MLP = (
    Rule(f"{J}.mlp.gate.kernel", f"{L}.mlp.gate_proj.weight", "F D", "D F", 0, (GATE_UP, "0")),
    Rule(f"{J}.mlp.up.kernel", f"{L}.mlp.up_proj.weight", "F D", "D F", 0, (GATE_UP, "1")),
    Rule(f"{J}.mlp.down.kernel", f"{L}.mlp.down_proj.weight", "D F", "F D", 1),
)
#: Pre-norms as Llama names them: the MLP's pre-norm is HF's `post_attention_layernorm`.
LLAMA_NORMS = (
    Rule(f"{J}.attn_norm.scale", f"{L}.input_layernorm.weight", "D", "D"),
    Rule(f"{J}.mlp_norm.scale", f"{L}.post_attention_layernorm.weight", "D", "D"),
)
