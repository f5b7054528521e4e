"""One flax NNX decoder for every supported family (llama, qwen2, qwen3, gemma3, qwen3_moe,
olmoe).

The family differences are switches of `ModelConfig` (biases, q/k norms, (1+w) norms,
post norms, embedding scale, sliding-window layers, activation); see config.py.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.axes import constrain
from models.config import ModelConfig
from models.kernels import bf16_matmul as matmul_kernel
from models.kernels import embed_rows as embed_kernel
from models.kv_cache import KVCache, from_storage
from models.layers import MLP, Attention, KeyStream, RMSNorm, _normal, native_rows
from models.moe import MoE
from models.scan import LayerIO, loop_layers_io, scan_layers_io


class _Embed(nnx.Module):
    """Holds the token embedding table `embedding` [V, D]."""

    def __init__(self, embedding: nnx.Param):
        self.embedding = embedding


class _Head(nnx.Module):
    """Holds an untied LM head `kernel` [D, V]."""

    def __init__(self, kernel: nnx.Param):
        self.kernel = kernel


class Block(nnx.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    With `post_norms` (gemma3) the attention and MLP outputs are normed before the residual add.
    Params: attn_norm, mlp_norm (and post_attn_norm, post_mlp_norm) `.scale` [D]; attn; mlp
    (a mixture of experts, `models.moe.MoE`, when `num_experts`).
    """

    def __init__(self, cfg: ModelConfig, layer: int, keys: KeyStream):
        D, eps, p1, p = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one, cfg.param_dtype
        self.post_norms = cfg.post_norms
        self.attn_norm = RMSNorm(D, eps, p1, p)
        self.attn = Attention(cfg, layer, keys)
        self.mlp_norm = RMSNorm(D, eps, p1, p)
        self.mlp = MoE(cfg, keys) if cfg.num_experts else MLP(cfg, keys)
        if cfg.post_norms:
            self.post_attn_norm = RMSNorm(D, eps, p1, p)
            self.post_mlp_norm = RMSNorm(D, eps, p1, p)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None,
        kv_len: int | None = None,
        block: int = 0,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x: [B, T, D], positions: [B, T] -> ([B, T, D], updated layer cache); `kv_len`
        bounds the attention to the first cache slots, `block` makes a cache-free attention
        blockwise (see `Attention`)."""
        h, kv = self.attn(self.attn_norm(x), positions, kv, kv_len, block)
        if self.post_norms:
            h = self.post_attn_norm(h)
        x = x + h.astype(x.dtype)  # the residual stream keeps its dtype (`residual_dtype`)
        h = self.mlp(self.mlp_norm(x))
        if self.post_norms:
            h = self.post_mlp_norm(h)
        return x + h.astype(x.dtype), kv


class Decoder(nnx.Module):
    """A decoder-only language model.

    Params (logical axes in `models.axes`): embed.embedding [V, D] (vocab, embed); layers[i]
    (see Block); final_norm.scale [D] (norm); lm_head.kernel [D, V] (embed, vocab) unless
    `tie_word_embeddings` (then the LM head is embedding.T).

    Calls:
        model(tokens, positions, cache=None, kv_len=None) -> (logits [B, T, V] float32, cache)
        model.hidden(tokens, positions, cache=None, kv_len=None) -> (hidden [B, T, D], cache)
        model.logits(hidden [..., D]) -> [..., V] float32
    tokens and positions are int32 [B, T]; see KVCache for the cache semantics. `kv_len`
    (static) makes the attention read only cache slots [0, kv_len); every position must be
    below it.

    In the JAX engine's one-device replica also `lm_head_packed`, the LM head [D, V] in the
    native bf16 kernel's layout (`models.packed.with_packed`).
    """

    lm_head_packed: nnx.Variable  # models.packed.PackedKernel

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        keys = KeyStream(rngs)
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = _Embed(_normal(keys, (V, D), ("vocab", "embed"), cfg.param_dtype))
        self.layers = nnx.List([Block(cfg, i, keys) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one, cfg.param_dtype
        )
        if not cfg.tie_word_embeddings:
            self.lm_head = _Head(_normal(keys, (D, V), ("embed", "vocab"), cfg.param_dtype))

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        kv_len: int | None = None,
        attention_block: int = 0,
        *,
        scan_layers: bool = False,
        remat: str = "none",
    ) -> tuple[jax.Array, KVCache | None]:
        """Final hidden states [B, T, D] float32 (after the final norm), without the LM head.

        `attention_block` (static, tokens; 0 = dense): without a cache, attend `block`
        queries at a time when T exceeds it (`models.blockwise`; the positions must
        increase along T).

        Without a cache, `scan_layers` runs the layers as one `jax.lax.scan` over their params
        stacked inside the call (`models.scan`: one layer body in the program, one transient
        copy of the layer params per call), and `remat` (a `models.scan.REMAT_POLICIES`
        name) checkpoints each layer for the backward pass; the trainer's forward uses both.
        With a cache (the JAX engine's prefill and decode) the layers run in a Python loop:
        each layer reads and writes its own cache entry (`KVCache` holds one head-major
        [B, K, S, H] pair per layer), and `scan_layers` / `remat` are ignored there.

        Raises:
            ValueError: an unknown remat name.
        """
        if cache is None:
            x = self._embed(tokens)
            hidden, _ = self._run_layers(x, positions, attention_block, scan_layers, remat)
            return hidden, None
        x = self._embed(tokens, by_bits=True)  # inference: no gradient flows to the table
        new_k, new_v = [], []
        for i, block in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x, kv = block(x, positions, (cache.k[i], cache.v[i]), kv_len, attention_block)
                x = constrain(x, ("batch", "length", "act_embed"))
            assert kv is not None  # a layer given its cache entry returns the updated one
            new_k.append(kv[0])
            new_v.append(kv[1])
        return self.final_norm(x), KVCache(k=tuple(new_k), v=tuple(new_v))

    def hidden_with_layer_io(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        layer_io: LayerIO,
        attention_block: int = 0,
        *,
        scan_layers: bool = False,
        remat: str = "none",
    ) -> tuple[jax.Array, Any]:
        """`hidden(tokens, positions, attention_block=..., scan_layers=..., remat=...)` (no
        cache) with an input into and an output out of every layer (`LayerIO`; routing replay
        and the routers' record, `models.routing`), kept under a scan and under remat.

        Returns:
            (hidden [B, T, D] float32, the layers' outputs: a list of one per
            layer when looped, stacked along a leading [L] axis when scanned).

        Raises:
            ValueError: an unknown remat name, or layers whose params differ when scanned.
        """
        x = self._embed(tokens)
        return self._run_layers(x, positions, attention_block, scan_layers, remat, layer_io)

    def _embed(self, tokens: jax.Array, by_bits: bool = False) -> jax.Array:
        """int32 [B, T] -> [B, T, D] in `residual_dtype` (float32 by default), the residual
        stream: the rows taken in the compute dtype (and scaled in it where the family does,
        as transformers), then widened.

        `by_bits` (no gradient to the table: the engine's prefill and decode) takes the rows
        of a bfloat16 table as their uint16 bit patterns, the same values: XLA:CPU has no
        bfloat16 gather and converted the whole table to float32 first (hoisted out of a
        decode loop, once per loop call: 113 MB written at SmolLM2). Inside
        `models.kernels.scope.native_scope` (the JAX engine on one device) the native
        kernel `models.kernels.embed_rows` copies the rows alone: the bitcast of the table
        also cost a copy of it per loop call (15-19 ms at SmolLM2)."""
        cfg = self.cfg
        table = self.embed.embedding[...]
        if by_bits and table.dtype == jnp.bfloat16:
            if embed_kernel.active():
                rows = embed_kernel.embed_rows(table, tokens)  # the rows alone, no table copy
            else:
                bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), tokens, axis=0)
                rows = from_storage(bits, jnp.bfloat16)  # the cache's bits, `models.kv_cache`
        else:
            rows = jnp.take(table, tokens, axis=0)
        x = rows.astype(cfg.dtype)  # [B, T, D]
        if cfg.embed_scale:
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), dtype=table.dtype).astype(cfg.dtype)
        return x.astype(cfg.residual_dtype)

    def _run_layers(
        self,
        x: jax.Array,
        positions: jax.Array,
        attention_block: int,
        scan_layers: bool,
        remat: str,
        layer_io: LayerIO | None = None,
    ) -> tuple[jax.Array, Any]:
        """The layers without a cache, then the final norm: ([B, T, D], the layers' outputs)."""

        def call(block: nnx.Module, h: jax.Array, xi: Any) -> tuple[jax.Array, Any]:
            if layer_io is not None:
                layer_io.enter(block, xi)
            out = block(h, positions, None, None, attention_block)[0]
            y = None if layer_io is None else layer_io.leave(block)
            return constrain(out, ("batch", "length", "act_embed")), y

        blocks = list(self.layers)
        if scan_layers:
            xs = None if layer_io is None else layer_io.stacked_inputs
            x, ys = scan_layers_io(blocks, x, call, remat, xs)
        else:
            per = [None] * len(blocks) if layer_io is None else layer_io.inputs
            x, ys = loop_layers_io(blocks, x, call, remat, per)
        return self.final_norm(x), ys

    def lm_head_weight(self) -> jax.Array:
        """The LM head as [D, V] in param dtype (the embedding transposed when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> logits [..., V] float32 (LM head accumulated in fp32, then
        soft-cap). A bf16 head is not converted to fp32 first (a copy of the whole [D, V]
        table each call): bf16 operands with fp32 accumulation (`preferred_element_type`) give
        the same products (a bf16 product is exact in fp32). The operands are in the wider
        of the compute and param dtypes (the float32 hidden states rounded once to bf16 in
        the bf16 path). A tied head contracts the [V, D] embedding as it is stored: its
        transpose as a [D, V] operand made XLA:CPU copy the whole table before the product
        (hoisted out of a decode loop, still once per loop call: 57 MB, about 60 ms at
        SmolLM2 bf16, against 2 ms more for the product on the table as stored). With
        `lm_head_packed` (`models.packed.with_packed`), a bf16 head of at most
        `models.layers.PACKED_MATMUL_MAX_ROWS` rows inside the native scope multiplies by that
        packed [D, V] copy through the native kernel (64 rows at SmolLM2: 13.0 -> 9.9 ms)."""
        if self.cfg.tie_word_embeddings:
            w, equation = self.embed.embedding[...], "nd,vd->nv"  # [V, D] as stored
        else:
            w, equation = self.lm_head.kernel[...], "nd,dv->nv"
        dt = jnp.promote_types(self.cfg.dtype, w.dtype)
        flat = hidden.reshape(-1, hidden.shape[-1]).astype(dt)  # [N, D]
        packed = self.lm_head_packed[...] if hasattr(self, "lm_head_packed") else None
        if packed is not None and dt == jnp.bfloat16 and native_rows("nd,dv->nv", flat, True):
            logits = matmul_kernel.bf16_matmul_packed(flat, packed, self.cfg.vocab_size)
        else:
            logits = jnp.einsum(equation, flat, w.astype(dt),
                                preferred_element_type=jnp.float32)  # fmt: skip
        logits = logits.reshape(*hidden.shape[:-1], logits.shape[-1])
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        kv_len: int | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions: int32 [B, T] -> (logits [B, T, V] float32, updated cache)."""
        h, cache = self.hidden(tokens, positions, cache, kv_len)
        return self.logits(h), cache
