"""Building blocks of the decoder: RMSNorm, rotary embedding, GQA attention over a KV cache, MLP.

Axis legend used in every einsum here:
    B batch, T query length, S key length (cache slots), D model width, F MLP width,
    N query heads, K kv heads, G query heads per kv head (N = K·G), H head dim, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.axes import constrain, param
from models.blockwise import blockwise_attention
from models.config import ModelConfig, RopeConfig
from models.kernels import bf16_matmul as matmul_kernel
from models.kernels import decode_attention as decode_kernel
from models.kernels.scope import in_native_scope
from models.kv_cache import from_storage, to_storage
from models.scores import attention_mask, attention_probs

_INIT_STD = 0.02


class KeyStream:
    """Init keys folded from one base key: one `nnx.Rngs` draw for the whole model, which
    keeps `nnx.eval_shape` of a 30-layer model fast (an Rngs draw per param costs ~10 ms)."""

    def __init__(self, rngs: nnx.Rngs):
        self.key = rngs.params()
        self.count = 0

    def __call__(self) -> jax.Array:
        """The next key."""
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


def _normal(
    keys: KeyStream, shape: tuple[int, ...], axes: tuple[str, ...], dtype: str
) -> nnx.Param:
    """A param of `shape` drawn from N(0, 0.02²) with logical `axes` (`models.axes.param`)."""
    return param(_INIT_STD * jax.random.normal(keys(), shape, dtype=dtype), axes)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) as HF computes it.

    Llama style: `w * (x_fp32 * rsqrt(mean(x²) + eps)).astype(x.dtype)`.
    Gemma style (`plus_one`): `(x_fp32 * rsqrt(mean(x²) + eps) * (1 + w_fp32)).astype(x.dtype)`,
    the multiply done in fp32 (transformers PR 29402).

    Param `scale`: [dim], initialised to 1 (Llama) or 0 (Gemma), logical axes (`axis`,):
    "norm" for the model-width norms (over fsdp, never tp), "head_dim" for q/k norms
    (replicated).
    """

    def __init__(self, dim: int, eps: float, plus_one: bool, param_dtype: str, axis: str = "norm"):
        self.eps = eps
        self.plus_one = plus_one
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = param(init((dim,), dtype=param_dtype), (axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim], same dtype."""
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
    """Inverse frequencies [H/2] float32 of one rope config.

    "default": theta^(-2i/H) (RoFormer, arXiv:2104.09864); "linear": divided by `factor`;
    "llama3": the wavelength-banded scaling of Llama 3.1 (arXiv:2407.21783, as in
    transformers' `_compute_llama3_parameters`).
    """
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.int32).astype(jnp.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * jnp.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x: [B, T, heads, H] by positions [B, T] (int32), half-split layout of HF.

    The angles are computed in float32 and cos/sin cast to x's dtype, as transformers does.
    Inside `models.kernels.scope.native_scope` (the JAX engine's one-device CPU replica),
    cos/sin pass through an identity product first (`_materialized`: the same values).
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cs = jnp.stack([jnp.cos(angles), jnp.sin(angles)])  # [2, B, T, 1, H]
    if in_native_scope():
        cs = _materialized(cs)
    cos, sin = cs[0].astype(x.dtype), cs[1].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _materialized(x: jax.Array) -> jax.Array:
    """``x [..., H]`` float32 unchanged (times an identity matrix at full float32 precision:
    each entry x·1 plus zeros, exact for finite x), as a product XLA cannot fuse into the
    consumers. XLA:CPU otherwise fuses the rope's cos and sin into the rotation and
    evaluates them once per head element: SmolLM2 bf16 decode, 64 rows, 6.0 -> 2.5 ms of
    a 93 ms step in those fusions (a per-thunk trace, docs/benchmarks.md). An
    `optimization_barrier` or a `max(x, x)` is simplified away first."""
    eye = jnp.eye(x.shape[-1], dtype=jnp.float32)
    return jnp.einsum("...h,hk->...k", x, eye, precision=jax.lax.Precision.HIGHEST)


class Attention(nnx.Module):
    """Grouped-query attention (Ainslie et al. 2023) with rope, optional biases and q/k norms.

    Params (logical axes in `models.axes`: D embed, N heads, K kv_heads, H head_dim):
    q.kernel [D, N, H], k.kernel / v.kernel [D, K, H], o.kernel [N, H, D];
    with `attention_bias` q.bias [N, H], k.bias / v.bias [K, H]; with `output_bias` o.bias [D];
    with `qk_norm` q_norm.scale / k_norm.scale [H]; with `qk_norm_full` (OLMoE: one norm over
    the whole projection) q_norm.scale [N·H], k_norm.scale [K·H].
    """

    def __init__(self, cfg: ModelConfig, layer: int, keys: KeyStream):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        p = cfg.param_dtype
        self.cfg = cfg
        self.sliding = cfg.layer_types[layer] == "sliding_attention"
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.q = Projection(keys, (D, N, H), q_axes, cfg.attention_bias, p)
        self.k = Projection(keys, (D, K, H), kv_axes, cfg.attention_bias, p)
        self.v = Projection(keys, (D, K, H), kv_axes, cfg.attention_bias, p)
        self.o = Projection(keys, (N, H, D), ("heads", "head_dim", "embed"), cfg.output_bias, p)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, cfg.norm_plus_one, p, "head_dim")
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, cfg.norm_plus_one, p, "head_dim")
        if cfg.qk_norm_full:
            self.q_norm = RMSNorm(N * H, cfg.rms_norm_eps, cfg.norm_plus_one, p, "norm")
            self.k_norm = RMSNorm(K * H, cfg.rms_norm_eps, cfg.norm_plus_one, p, "norm")

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None,
        kv_len: int | None = None,
        block: int = 0,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x: [B, T, D]; positions: [B, T] int32; kv: this layer's cache ([Bc, K, S, H] ×2,
        head-major: `models.kv_cache`, Bc >= B: the call is over its first B rows, written
        and read in place, the rest untouched) or None.

        `kv_len` (static, <= S) bounds the attention to cache slots [0, kv_len): every query
        position must be below it (slots past a query are masked anyway, so the result is
        the unbounded one), and a decode step then reads kv_len of the S slots.

        `block` (static, tokens): without a cache and with T > block, the attention runs
        `block` queries at a time (`models.blockwise`: memory O(T · block), not
        O(T²)); the positions must then increase along T. 0: the dense path.

        Returns the output [B, T, D] and the updated cache (the call's keys and values
        written at slots `positions`; out-of-range slots are dropped).
        """
        cfg = self.cfg
        dt = cfg.dtype
        q = self.q("btd,dnh->btnh", x, dt)
        k = self.k("btd,dkh->btkh", x, dt)
        v = self.v("btd,dkh->btkh", x, dt)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        if cfg.attention_bias:
            q = q + self.q.bias[...].astype(q.dtype)
            k = k + self.k.bias[...].astype(k.dtype)
            v = v + self.v.bias[...].astype(v.dtype)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.qk_norm_full:  # [B, T, N·H] and [B, T, K·H] normed, then split into heads
            q = self.q_norm(q.reshape(*q.shape[:2], -1)).reshape(q.shape)
            k = self.k_norm(k.reshape(*k.shape[:2], -1)).reshape(k.shape)
        rope = cfg.rope_local if self.sliding else cfg.rope_global
        inv_freq = rope_inv_freq(rope, cfg.head_dim)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if kv is None:
            keys, values, k_pos = k, v, positions
        else:
            # the cache is head-major [B, K, S, H]: row b's (T, K, H) entries go to slots
            # positions[b] (advanced indices around a slice index [B, T] + [K, H])
            rows = jnp.arange(x.shape[0])[:, None]  # [B, 1]
            keys = kv[0].at[rows, :, positions].set(to_storage(k, kv[0]), mode="drop")
            values = kv[1].at[rows, :, positions].set(to_storage(v, kv[1]), mode="drop")
            kv = (keys, values)
            if keys.shape[0] > x.shape[0]:  # a call over the cache's first B rows
                keys, values = keys[: x.shape[0]], values[: x.shape[0]]
            if kv_len is not None and kv_len < keys.shape[2]:
                keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
            slots = keys.shape[2]
            k_pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (x.shape[0], slots))
        window = cfg.sliding_window if self.sliding else None
        B, T, N, H = q.shape
        K = k.shape[2]
        qg = q.reshape(B, T, K, N // K, H).astype(dt)  # [B, T, K, G, H]
        if kv is None and 0 < block < T:  # the queries' own keys, `block` at a time
            keys, values = keys.astype(dt), values.astype(dt)
            out = blockwise_attention(qg, keys, values, positions, cfg, window, block)
        elif kv is None:  # the queries' own keys [B, T, K, H], every score at once
            mask = attention_mask(positions, k_pos, window)  # [B, T, T]
            out = dense_attention(qg, keys.astype(dt), values.astype(dt), mask, cfg)
        elif T == 1 and kv[0].dtype == jnp.uint16 and decode_kernel.active():
            # bits cache, CPU, one-device engine: the native kernel reads the slots in place
            out = decode_kernel.bits_decode_attention(qg, *kv, positions[:, 0], cfg, window)
        elif T == 1:  # one query over the cache
            mask = attention_mask(positions, k_pos, window)  # [B, 1, S]
            out = decode_attention(
                qg, from_storage(keys, dt), from_storage(values, dt), mask[:, 0], cfg
            )
        else:  # a prompt (or an episode's next turn) over the cache
            mask = attention_mask(positions, k_pos, window)  # [B, T, S]
            keys, values = from_storage(keys, dt), from_storage(values, dt)
            out = dense_attention(qg, keys, values, mask, cfg, head_major=True)
        out = out.reshape(B, T, N, H)
        y = self.o("btnh,nhd->btd", out, dt)  # [B, T, D] float32
        if cfg.output_bias:
            y = y + self.o.bias[...].astype(y.dtype)
        return y, kv


def dense_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    cfg: ModelConfig,
    *,
    head_major: bool = False,
) -> jax.Array:
    """Attention of T queries over S key slots with every score materialised ([B, K, G, T, S]
    float32): the train forward's and the prefill's path.

    Args:
        q: [B, T, K, G, H]. keys / values: [B, S, K, H] (the train forward: the queries' own
            keys), or with `head_major` [B, K, S, H] (a KV cache, `models.kv_cache`); all in
            the model dtype.
        mask: [B, T, S] bool, the key slots each query sees (`scores.attention_mask`).

    Returns:
        [B, T, K, G, H] in the model dtype.
    """
    kv = "bksh" if head_major else "bskh"
    scores = jnp.einsum(f"btkgh,{kv}->bkgts", q, keys).astype(jnp.float32)
    probs = attention_probs(scores, mask[:, None, None], cfg, axis=-1)
    return jnp.einsum(f"bkgts,{kv}->btkgh", probs, values)


def decode_attention(
    q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, cfg: ModelConfig
) -> jax.Array:
    """Attention of one query position per row over the whole head-major cache: for each row
    and KV head, two plain matrix products, [G, H] x [H, S] for the scores and [G, S] x [S, H]
    for the output (batch dims B, K leading, so XLA's CPU dot runs them without moving the
    cache), operands in the cache dtype, accumulated in float32 (`preferred_element_type`),
    the softmax over S in float32.

    Why head-major: over a [B, S, K, H] cache (batch dims B, K not leading) XLA's CPU backend
    first copies each layer's cache into [B, K, S, H] order, every step. Measured on a 2-core
    AMD EPYC with avx512_bf16, SmolLM2 bf16 (K = 3, G = 3, H = 64): in the compiled decode
    loop at 64 rows over 288 slots (XLA's per-thunk trace) the transposing copy took 65 ms
    a step, the bitcast of the uint16 cache that replaces it 25 ms; all thunks 273 -> 212
    CPU-ms a step, wall 211 -> 191 ms. One layer's attention x 30 alone: bf16 128 x 192
    161 -> 88 ms, 64 x 288 100 -> 43 ms; float32 64 x 288 116 -> 59 ms (against the
    multiply-reduce the float32 cache used before). A product of two bf16 values is exact in
    float32 and the sums are float32, so bf16 operands differ from a float32 product of the
    same values only in summation order.

    Args:
        q: [B, 1, K, G, H]. keys / values: [B, K, S, H], both in the engine dtype.
        mask: [B, S] bool, the key slots the query sees.

    Returns:
        [B, 1, K, G, H] in `values`' dtype (the dense path's "btkgh" layout).
    """
    f32 = jnp.float32
    qk = q[:, 0].astype(keys.dtype)  # [B, K, G, H]
    scores = jnp.einsum("bkgh,bksh->bkgs", qk, keys, preferred_element_type=f32)
    probs = attention_probs(scores, mask[:, None, None], cfg, axis=-1)  # [B, K, G, S]
    out = jnp.einsum("bkgs,bksh->bkgh", probs.astype(values.dtype), values,
                     preferred_element_type=f32)  # fmt: skip
    return out.astype(values.dtype)[:, None]  # [B, 1, K, G, H]


class Projection(nnx.Module):
    """A projection's params: `kernel` of the given shape and logical axes, [inputs...,
    outputs...], and with `bias` a bias over its output axes (the dims after the first for a
    kernel whose input is the model width `embed`, else the last).

    With a LoRA adapter (`models.lora.add_lora`) also `lora_a` [I, r], `lora_b` [r, O], the
    static `lora_scale` alpha / r and `lora_in_dims` (how many leading kernel dims are its
    inputs); absent otherwise. In the JAX engine's one-device replica also `packed`, the
    kernel in the native bf16 kernel's layout (`models.packed.with_packed`)."""

    lora_a: nnx.LoRAParam
    lora_b: nnx.LoRAParam
    lora_scale: float
    lora_in_dims: int
    packed: nnx.Variable  # models.packed.PackedKernel

    def __init__(
        self,
        keys: KeyStream,
        kernel_shape: tuple[int, ...],
        kernel_axes: tuple[str, ...],
        bias: bool,
        param_dtype: str,
    ):
        self.kernel = _normal(keys, kernel_shape, kernel_axes, param_dtype)
        if bias:
            out = 1 if kernel_axes[0] == "embed" else len(kernel_shape) - 1
            self.bias = _normal(keys, kernel_shape[out:], kernel_axes[out:], param_dtype)

    def lora_delta(self) -> jax.Array:
        """With a LoRA adapter (`models.lora.add_lora`: lora_a [I, r], lora_b [r, O],
        lora_scale alpha / r): (alpha / r) A @ B reshaped to the kernel's shape, float32."""
        a, b = self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32)
        delta = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
        return (self.lora_scale * delta).reshape(self.kernel.shape)

    def weight(self, dtype: str) -> jax.Array:
        """The kernel in `dtype`; with a LoRA adapter the merged W + (alpha / r) A B (summed in
        float32, then cast): what a merged export or a full-weight push carries."""
        w = self.kernel[...]
        if not hasattr(self, "lora_a"):
            return w.astype(dtype)
        return (w.astype(jnp.float32) + self.lora_delta()).astype(dtype)

    def __call__(self, equation: str, x: jax.Array, dtype: str) -> jax.Array:
        """``einsum(equation, x, kernel)`` in `dtype`; with a LoRA adapter plus PEFT's
        unmerged (alpha / r) (x A) B: x's last ``lora_in_dims`` dims flattened to I, times
        A [I, r], times B [r, O], reshaped to the kernel's output dims. Unmerged, the
        backward pass keeps x A ([..., r]) instead of a merged copy of every adapted kernel,
        and no gradient of W is needed to reach A and B.

        Args:
            equation: the einsum of x [..., inputs...] and the kernel [inputs..., outputs...]
                giving [..., outputs...] (e.g. ``"btd,dnh->btnh"``).
            x: the input activations (float32 residual-stream values or `dtype`).
            dtype: the matmul operand dtype (x, the kernel and the adapters are cast to it).

        Returns:
            [..., outputs...]: float32 (`project`), or `dtype` when it is wider. The
            adapter's rank-r product runs in `dtype` (bf16 out in the bf16 path, as before
            the float32 residual stream) and is added in float32.
        """
        packed = self.packed[...] if hasattr(self, "packed") else None
        y = project(equation, x, self.kernel[...], dtype, packed)
        if not hasattr(self, "lora_a"):
            return y
        n_in = self.lora_in_dims
        lead = x.shape[: x.ndim - n_in]
        xa = x.reshape(*lead, -1).astype(dtype) @ self.lora_a[...].astype(dtype)  # [..., r]
        delta = (xa @ self.lora_b[...].astype(dtype)) * jnp.asarray(self.lora_scale, dtype)
        return y + delta.reshape(*lead, *self.kernel.shape[n_in:]).astype(y.dtype)


def project(
    equation: str, x: jax.Array, kernel: jax.Array, dtype: str, packed: jax.Array | None = None
) -> jax.Array:
    """``einsum(equation, x, kernel)`` with both operands in `dtype`, accumulated and returned
    in float32 (`preferred_element_type`) when `dtype` is narrower (bf16): one rounding of the
    operands, none of the products (a bf16 product is exact in float32), and on XLA's CPU
    backend 2-4x faster than a bf16-out or an fp32 einsum of the same shape
    (`benchmarks/decode_pieces.py`). A float32 `dtype` is the plain einsum, unchanged.

    Args:
        equation: e.g. ``"btd,dnh->btnh"`` (x [B, T, D], kernel [D, N, H]).
        x: activations, any float dtype. kernel: the weight, any float dtype.
        dtype: the operand dtype ("float32" or "bfloat16").
        packed: the kernel flattened to [K, N] and packed once for the native kernel
            (`models.kernels.bf16_matmul.pack`), or None: where the native kernel serves
            (`native_rows`) it multiplies by this copy instead of packing the kernel anew.

    Raises:
        ValueError: `packed` not of the kernel's packed shape, where it serves.
    """
    equation, x, kernel = _flat_contraction(equation, x, kernel)
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum(equation, x, kernel.astype(dtype))
    if native_rows(equation, x, packed is not None):
        k, rows = x.shape[-1], x.reshape(-1, x.shape[-1]).astype(dtype)
        if packed is not None:
            y = matmul_kernel.bf16_matmul_packed(rows, packed, math.prod(kernel.shape[1:]))
        else:
            y = matmul_kernel.bf16_matmul(rows, kernel.reshape(k, -1).astype(dtype))
        return y.reshape(*x.shape[:-1], *kernel.shape[1:])
    return jnp.einsum(equation, x.astype(dtype), kernel.astype(dtype),
                      preferred_element_type=jnp.float32)  # fmt: skip


#: The most rows (x's leading dims multiplied) a bf16 projection takes through the native
#: kernel inside `models.kernels.scope.native_scope`, packing the weight in the call: the
#: decode step's shapes, where it beats XLA's dot; at 128 rows the two are level and at a
#: prefill's thousands XLA's is faster (`benchmarks/bf16_matmul.py`).
NATIVE_MATMUL_MAX_ROWS = 64

#: The same bound for a projection that holds its weight packed already (`models.packed`):
#: without the packing the kernel is level with XLA's dot or ahead of it at 128 rows too
#: (`packed_over_xla` 0.93-1.18 by shape), and SmolLM2's 128-row decode step 4-10% faster
#: through it than through XLA's dot.
PACKED_MATMUL_MAX_ROWS = 128


def native_rows(equation: str, x: jax.Array, packed: bool = False) -> bool:
    """True where `project`'s bf16 einsum is x [..., K] times a kernel [K, outputs...] giving
    [..., outputs...] (x's last dim contracted with the kernel's first, nothing else shared),
    with at most `NATIVE_MATMUL_MAX_ROWS` rows (`PACKED_MATMUL_MAX_ROWS` with the weight
    `packed`), inside the native scope where `models.kernels.bf16_matmul` is available."""
    ins, out = equation.split("->")
    xs, ks = ins.split(",")
    plain = (
        len(xs) >= 2 and len(ks) >= 2 and ks[0] == xs[-1] and out == xs[:-1] + ks[1:]
        and len(set(xs + ks[1:])) == len(xs) + len(ks) - 1
    )  # fmt: skip
    rows = math.prod(x.shape[:-1])
    bound = PACKED_MATMUL_MAX_ROWS if packed else NATIVE_MATMUL_MAX_ROWS
    return plain and 0 < rows <= bound and matmul_kernel.active()


def _flat_contraction(
    equation: str, x: jax.Array, kernel: jax.Array
) -> tuple[str, jax.Array, jax.Array]:
    """An einsum contracting several trailing dims of x with the same leading dims of the
    kernel, in the same order (``"btnh,nhd->btd"``), rewritten over one flattened dim
    (``"btz,zd->btd"``: x [B, T, N·H], kernel [N·H, D], both reshapes free); any other
    equation unchanged. Left to choose the order of the contracted dims, XLA:CPU laid the
    attention output out as [B, T, H, N] and copied every layer's o.kernel to match, once
    per call of the engine's decode loop (30 transposing copies, 11 ms a call at SmolLM2
    bf16)."""
    ins, out = equation.split("->")
    xs, ks = ins.split(",")
    n = 0
    while n < len(ks) and ks[n] not in out and ks[n] in xs:
        n += 1
    if n < 2 or not xs.endswith(ks[:n]) or "z" in equation:
        return equation, x, kernel
    x = x.reshape(*x.shape[: x.ndim - n], -1)
    kernel = kernel.reshape(-1, *kernel.shape[n:])
    return f"{xs[:-n]}z,z{ks[n:]}->{out}", x, kernel


class MLP(nnx.Module):
    """Gated MLP (Shazeer 2020, GLU variants): down(act(gate(x)) * up(x)).

    Params: gate.kernel / up.kernel [D, F] (logical axes embed, mlp), down.kernel [F, D]
    (mlp, embed). act is SiLU (Llama, Qwen) or tanh-approximated GELU (Gemma).
    """

    def __init__(self, cfg: ModelConfig, keys: KeyStream):
        D, F, p = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.cfg = cfg
        self.gate = Projection(keys, (D, F), ("embed", "mlp"), False, p)
        self.up = Projection(keys, (D, F), ("embed", "mlp"), False, p)
        self.down = Projection(keys, (F, D), ("mlp", "embed"), False, p)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, T, D] -> [B, T, D] float32 (`project`); the hidden activation [B, T, F]
        in the model's `residual_dtype` (float32, or bf16 with a bf16 residual)."""
        dt, rd = self.cfg.dtype, self.cfg.residual_dtype
        gate = self.gate("btd,df->btf", x, dt).astype(rd)
        up = self.up("btd,df->btf", x, dt).astype(rd)
        if self.cfg.hidden_act == "silu":
            act = jax.nn.silu(gate)
        else:
            act = jax.nn.gelu(gate, approximate=True)
        hidden = constrain(act * up, ("batch", "length", "mlp"))  # [B, T, F]
        return self.down("btf,fd->btd", hidden, dt)
