"""Model configuration read from an HF `config.json`; imports no ML library.

One frozen dataclass covers every supported family; `ModelConfig.from_hf` reads both the
transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x one (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mappings.registry import family_for_model_type
from mappings.spec import MappingError

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "linear", "llama3")
#: Families whose every layer's MLP is a mixture of experts (`models.moe`).
MOE_FAMILIES = ("qwen3_moe", "olmoe")


class UnsupportedModelError(ValueError):
    """A checkpoint whose `model_type`, rope type, dtype or option the decoder cannot take."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one attention type.

    Attributes:
        theta: base wavelength.
        rope_type: "default", "linear" (positions divided by `factor`) or "llama3"
            (frequency-dependent scaling of Llama 3.1, arXiv:2407.21783).
        factor, low_freq_factor, high_freq_factor, original_max_position_embeddings:
            the scaling parameters of the "linear" and "llama3" types.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, params: Mapping[str, Any]) -> RopeConfig:
        """Builds from an HF rope dict (`rope_parameters` or `rope_scaling` plus theta)."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}"
            )
        return cls(
            theta=float(params.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only checkpoint, plus the dtypes we run it in.

    Attributes:
        family: "llama" | "qwen2" | "qwen3" | "gemma3" | "qwen3_moe" | "olmoe".
        vocab_size (V), hidden_size (D), intermediate_size (F), num_layers (L),
        num_heads (N), num_kv_heads (K), head_dim (H).
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: the LM head is the transposed embedding table.
        attention_bias: q/k/v projections carry biases (qwen2; llama with `attention_bias`).
        output_bias: the output projection carries a bias too (llama's `attention_bias`, which
            biases q, k, v and o; qwen2 biases q, k, v only).
        qk_norm: per-head RMSNorm of queries and keys before rope (qwen3, qwen3_moe, gemma3).
        qk_norm_full: one RMSNorm over the whole query projection [N·H] and one over the
            whole key projection [K·H], before rope (olmoe).
        num_experts (E), num_experts_per_tok (top-k), moe_intermediate_size (M, each
            expert's MLP width), norm_topk_prob (renormalise the top-k router probabilities
            to sum to 1), router_aux_loss_coef: the mixture-of-experts MLP of every layer
            (`models.moe`); num_experts 0 is the dense MLP.
        moe_dispatch: how the experts are computed, "dense" (every expert on every token) or
            "grouped" (sorted by expert, `jax.lax.ragged_dot`); both exact
            (`models.moe_dispatch`). Not from config.json: `replace(moe_dispatch=...)`.
        norm_plus_one: RMSNorm scales by (1 + w) and multiplies in fp32 (gemma3).
        post_norms: extra norms after attention and MLP (gemma3's four norms per layer).
        embed_scale: multiply embeddings by sqrt(D) (gemma3).
        hidden_act: "silu" or "gelu_pytorch_tanh".
        query_scale: factor applied to q·k (1/sqrt(H), or query_pre_attn_scalar**-0.5).
        layer_types: per layer "full_attention" or "sliding_attention".
        sliding_window: window in tokens of sliding layers (a key s is seen by query q
            when q - window < s <= q), or None.
        rope_global / rope_local: rope of full and of sliding-window layers.
        final_logit_softcap / attn_logit_softcap: tanh soft-capping, or None.
        bos_token_id, eos_token_ids: special tokens of the checkpoint.
        dtype: compute dtype: the matmul operands (accumulated in float32), attention and
            the KV cache; norms and rotary run in float32 whatever it is
            (`models.layers.project`). param_dtype: storage dtype of the params.
        residual_dtype: dtype of the residual stream, of each attention and MLP output added
            to it and of the MLP's hidden activation [B, T, F]: float32 (the default, what
            the engines use: bf16 greedy stays closest to fp32's) or `dtype` (a bf16
            residual, Megatron's default `fp32_residual_connection=False`: those activations
            a bf16 train step keeps for its backward pass are half as wide;
            `benchmarks/model_scale.py` precision `bf16_residual`).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    output_bias: bool = False
    qk_norm: bool = False
    qk_norm_full: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    moe_dispatch: str = "dense"
    norm_plus_one: bool = False
    post_norms: bool = False
    embed_scale: bool = False
    hidden_act: str = "silu"
    query_scale: float = 0.0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_global: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    rope_local: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    param_dtype: str = "float32"
    residual_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("dtype", "param_dtype", "residual_dtype"):
            value = getattr(self, name)
            if value not in SUPPORTED_DTYPES:
                raise UnsupportedModelError(
                    f"{name}={value!r} is not supported; supported: {list(SUPPORTED_DTYPES)}"
                )
        if self.residual_dtype not in ("float32", self.dtype):
            raise UnsupportedModelError(
                f"residual_dtype={self.residual_dtype!r}: expected 'float32' or the compute "
                f"dtype {self.dtype!r} (a residual narrower than float32 in a float32 model)"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(self.layer_types)} entries, expected {self.num_layers}"
            )
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(
                f"hidden_act {self.hidden_act!r} is not supported; "
                "supported: ['silu', 'gelu_pytorch_tanh']"
            )
        if self.num_experts:
            check_moe(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size)
        if self.moe_dispatch not in ("dense", "grouped"):
            raise UnsupportedModelError(
                f"moe_dispatch {self.moe_dispatch!r} is not supported; supported: "
                "['dense', 'grouped']"
            )

    def dims(self) -> dict[str, int]:
        """Symbolic dimension sizes used by the mappings: D, F, N, K, H, V, L, and E
        (experts), M (each expert's MLP width), both 0 for a dense model."""
        return {
            "D": self.hidden_size,
            "F": self.intermediate_size,
            "N": self.num_heads,
            "K": self.num_kv_heads,
            "H": self.head_dim,
            "V": self.vocab_size,
            "L": self.num_layers,
            "E": self.num_experts,
            "M": self.moe_intermediate_size,
        }

    def replace(self, **changes: Any) -> ModelConfig:
        """Returns a copy with `changes` applied (e.g. another dtype)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(
        cls,
        hf: Mapping[str, Any],
        *,
        dtype: str = "float32",
        param_dtype: str | None = None,
        residual_dtype: str = "float32",
    ) -> ModelConfig:
        """Reads an HF `config.json` dict.

        Args:
            hf: the parsed `config.json` (a multimodal gemma3 config's `text_config` is used).
            dtype: compute dtype, one of SUPPORTED_DTYPES.
            param_dtype: storage dtype of params; defaults to `dtype`.
            residual_dtype: the residual stream's dtype: float32 or `dtype` (see the class).

        Raises:
            UnsupportedModelError: unknown `model_type`, rope type, activation or dtype;
                the message lists what is supported.
        """
        model_type = hf.get("model_type")
        if model_type == "gemma3" and "text_config" in hf:
            hf = {**hf["text_config"], "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        try:
            family = family_for_model_type(model_type)
        except MappingError as e:
            raise UnsupportedModelError(str(e)) from None
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        num_layers = int(hf["num_hidden_layers"])
        gemma = family == "gemma3"
        rope_global, rope_local = _read_rope(hf, gemma)
        if gemma:
            layer_types = tuple(hf.get("layer_types") or _gemma_layer_types(hf, num_layers))
        else:
            if hf.get("use_sliding_window"):
                raise UnsupportedModelError(
                    f"{model_type} with use_sliding_window=true is not supported"
                )
            layer_types = ("full_attention",) * num_layers
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        scalar = hf.get("query_pre_attn_scalar") if gemma else None
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        moe = moe_fields(family, hf)
        return cls(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            output_bias=family == "llama" and bool(hf.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            qk_norm_full=family == "olmoe",
            norm_plus_one=gemma,
            post_norms=gemma,
            embed_scale=gemma,
            hidden_act=act,
            query_scale=float(scalar) ** -0.5 if scalar else 1.0 / math.sqrt(head_dim),
            layer_types=layer_types,
            sliding_window=int(hf["sliding_window"])
            if gemma and hf.get("sliding_window")
            else None,
            rope_global=rope_global,
            rope_local=rope_local,
            final_logit_softcap=hf.get("final_logit_softcapping"),
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
            param_dtype=param_dtype or dtype,
            residual_dtype=residual_dtype,
            **moe,
        )


def _read_rope(hf: Mapping[str, Any], gemma: bool) -> tuple[RopeConfig, RopeConfig]:
    """Returns (global, local) rope configs from either HF rope layout."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        full = RopeConfig.from_hf(params["full_attention"])
        local = RopeConfig.from_hf(params.get("sliding_attention", params["full_attention"]))
        return full, local
    if isinstance(params, Mapping):
        full = RopeConfig.from_hf(params)
    else:
        scaling = dict(hf.get("rope_scaling") or {})
        scaling.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        full = RopeConfig.from_hf(scaling)
    local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10000.0))) if gemma else full
    return full, local


def _gemma_layer_types(hf: Mapping[str, Any], num_layers: int) -> list[str]:
    """Gemma 3's default pattern: every `sliding_window_pattern`-th layer is global."""
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def check_moe(num_experts: int, top_k: int, width: int) -> None:
    """Raises UnsupportedModelError unless 1 <= top_k <= num_experts and width > 0."""
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}"
        )
    if width <= 0:
        raise UnsupportedModelError(f"the experts' MLP width must be positive, got {width}")


def moe_fields(family: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` from an HF config of `family`
    (empty for a dense family).

    Qwen3-MoE (HF `Qwen3MoeConfig`) names the experts' width `moe_intermediate_size`;
    OLMoE (`OlmoeConfig`) uses `intermediate_size`. Both configs say `num_experts`.

    Raises:
        UnsupportedModelError: a Qwen3-MoE checkpoint with dense layers (`mlp_only_layers`,
            `decoder_sparse_step` != 1), an OLMoE one with `clip_qkv`, or a top-k outside
            [1, num_experts].
    """
    if family not in MOE_FAMILIES:
        return {}
    if family == "qwen3_moe" and (
        hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1
    ):
        raise UnsupportedModelError(
            "qwen3_moe with dense layers (mlp_only_layers or decoder_sparse_step != 1) is not "
            "supported: every layer must be a mixture of experts"
        )
    if family == "olmoe" and hf.get("clip_qkv") is not None:
        raise UnsupportedModelError("olmoe with clip_qkv is not supported")
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    width = int(
        hf.get("moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size") or 0
    )
    check_moe(experts, top_k, width)
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
    )
