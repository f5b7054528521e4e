"""The model-parity demo: SmolLM2 (or any HF folder) in JAX against transformers.

Loads the checkpoint both ways, prints the max abs logit difference on a chat prompt and
both 32-token greedy continuations, decoded.
"""

from __future__ import annotations

import time
from pathlib import Path


def run_parity(path: Path, prompt: str, new_tokens: int = 32) -> dict[str, object]:
    """Returns {"max_abs_logit_diff", "jax_text", "hf_text", "same_tokens", "seconds"}."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.checkpoints.hf_io import load_hf_checkpoint
    from models.kv_cache import KVCache

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": prompt}]
    ids = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _, model = load_hf_checkpoint(path)

    @nnx.jit
    def step(model, tokens, positions, cache):
        logits, cache = model(tokens, positions, cache)
        return logits, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    cache = KVCache.init(model.cfg, 1, len(ids) + new_tokens)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    logits, tok, cache = step(model, jnp.asarray([ids], jnp.int32), positions, cache)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    diff = float(np.abs(np.asarray(logits)[0] - ref).max())
    jax_tokens = [int(tok[0])]
    for i in range(new_tokens - 1):
        if jax_tokens[-1] in model.cfg.eos_token_ids:
            break
        pos = jnp.asarray([[len(ids) + i]], jnp.int32)
        _, tok, cache = step(model, tok[:, None], pos, cache)
        jax_tokens.append(int(tok[0]))
    hf_tokens = hf_out[0, len(ids) :].tolist()
    return {
        "max_abs_logit_diff": diff,
        "jax_text": tokenizer.decode(jax_tokens),
        "hf_text": tokenizer.decode(hf_tokens),
        "same_tokens": jax_tokens == hf_tokens[: len(jax_tokens)],
        "seconds": round(time.perf_counter() - start, 1),
    }
