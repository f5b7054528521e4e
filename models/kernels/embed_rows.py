"""The token embedding lookup of a bfloat16 table as a native CPU kernel (``embed_rows.cc``):
`models.decoder.Decoder` takes its inference rows through it inside
`models.kernels.scope.native_scope` where `available()`.

XLA:CPU has no bfloat16 gather: a lookup in a bfloat16 table converted the whole table to
float32 first, and a lookup in its uint16 bits (`models.decoder`'s XLA path) copied the
table through the bitcast. Both copies are loop-invariant, so XLA hoists them out of the
engine's decode loop, and each loop call pays one: 15-19 ms of the ~27 ms each call cost
beyond its steps at SmolLM2 bf16 (57 MB table, XLA's per-thunk trace), which a multi-turn
episode's one-step calls (a stop-string check after every step) pay every step. The
kernel copies the N rows asked for and nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.kernels.build import load
from models.kernels.scope import in_native_scope

#: The FFI target (the handler symbol of ``embed_rows.cc``).
TARGET = "JaxrlEmbedRows"


def available() -> bool:
    """True where the kernel is compiled, loaded and registered (`models.kernels.build`)."""
    return load("embed_rows", (TARGET,))


def active() -> bool:
    """True inside `models.kernels.scope.native_scope()` where the kernel is `available()`."""
    return in_native_scope() and available()


def embed_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``jnp.take(table, ids, axis=0)`` for a bfloat16 table, by the kernel: the same values
    bit for bit, and as `jnp.take` by default an id in [-V, 0) counts from the end and any
    other outside [0, V) gives a row of NaN.

    Args:
        table: bfloat16 [V, D]. ids: int32, any shape [...].

    Returns:
        bfloat16 [..., D].

    Raises:
        RuntimeError: `available()` is False (take `jnp.take` instead).
        ValueError: the table is not a 2-D bfloat16 array.
    """
    if not available():
        raise RuntimeError("the native embed_rows kernel is not available")
    if table.ndim != 2 or table.dtype != jnp.bfloat16:
        raise ValueError(f"embed_rows takes a 2-D bfloat16 table, got {table.dtype}{table.shape}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*ids.shape, table.shape[1]), table.dtype))
    return call(table, ids.astype(jnp.int32))
