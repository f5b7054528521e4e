"""Tiny random HF checkpoints of every family, with a tokenizer trained on the spot.

Used by the smoke config, the tests and the benchmarks: no hub access is needed. Every
tensor is random (norm scales too), so a mapping error in any tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: A fixed corpus for the tokenizer: arithmetic and chat words, so prompts tokenize sensibly.
CORPUS = [
    "What is 12 plus 30? The answer is 42.",
    "Compute 7 times 8 and give the result: 56.",
    "Let me think step by step. First add the numbers, then check the sum.",
    "The quick brown fox jumps over the lazy dog.",
    "<think> reasoning goes here </think> final answer",
    "user assistant system: You are a helpful assistant.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( )",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Per-family tiny configs (transformers config kwargs). D=64 and F=96 differ so that a
#: wrong transpose changes a shape; head dims are >= 32, the least vLLM's CPU kernels take.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
    "smollm2": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    "llama3": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    # Llama with `attention_bias`: biases on q, k, v and o_proj; 8 query heads per KV head.
    "llama_bias": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=32,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        query_pre_attn_scalar=24,
        sliding_window=4,
        rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh",
    ),
    # Mixture of experts: 8 experts of width 48, top-2 renormalised (norm_topk_prob), per-head
    # q/k norms. Every layer sparse; `intermediate_size` is unused (no dense layer).
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    # OLMoE: 4 experts of width `intermediate_size`, top-2 not renormalised (OLMoE's default;
    # vLLM's OLMoE ignores norm_topk_prob), q/k norms over the whole projection; eps 1e-5,
    # which vLLM's OLMoE hard-codes. N·H must equal D (HF sizes q_norm by D): head dim 32.
    "olmoe": dict(
        model_type="olmoe",
        hidden_size=64,
        intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
}


def make_tokenizer(path: str | Path, vocab_size: int = 256) -> Any:
    """Trains a byte-level BPE tokenizer on CORPUS and saves it (with a ChatML template).

    Returns the `PreTrainedTokenizerFast`. Its length is at most `vocab_size`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    return fast


def make_tiny_checkpoint(
    path: str | Path,
    variant: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 320,
    dtype: str = "float32",
    with_tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Writes a random HF checkpoint of `variant` (a key of TINY_CONFIGS) to `path`.

    Every tensor is drawn from a seeded normal (norm scales around 1, or 0 for Gemma's
    (1 + w) norms), saved as safetensors in `dtype`, with config.json and (by default)
    the tokenizer of `make_tokenizer`.

    Raises:
        KeyError: an unknown variant (the message lists the known ones).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if variant not in TINY_CONFIGS:
        raise KeyError(f"unknown tiny variant {variant!r}; known: {sorted(TINY_CONFIGS)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = dict(TINY_CONFIGS[variant], vocab_size=vocab_size, **overrides)
    model_type = kwargs.pop("model_type")
    eos = 0  # "<|endoftext|>" is the first special token of make_tokenizer
    config = AutoConfig.for_model(
        model_type,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=3,
        max_position_embeddings=512,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gemma = model_type.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                base = 0.0 if gemma else 1.0
                param.copy_(base + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.to(getattr(torch, dtype)).save_pretrained(str(out))
    if with_tokenizer:
        make_tokenizer(out, vocab_size=min(vocab_size, 256))
    return out
