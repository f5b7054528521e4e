"""The KV cache of the decoder: one (keys, values) pair per layer, slot index = position."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer keys and values, each [B, S, K, H] in the cache dtype.

    Slot s of row b holds the key/value of the token at absolute position s of that row;
    a call writes its tokens at slots `positions` and attends to slots <= its positions,
    so right padding needs no shifting and a slot beyond a row's length is never read
    before it is written.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> KVCache:
        """Zeros for `batch` rows of `max_len` slots; dtype defaults to cfg.dtype.

        Memory: 2 · L · B · S · K · H · itemsize bytes.
        """
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        dt = dtype or cfg.dtype
        return cls(
            k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
            v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
        )

    @property
    def max_len(self) -> int:
        """Number of slots S."""
        return int(self.k[0].shape[1])
