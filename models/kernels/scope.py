"""Where the native CPU kernels may run: `native_scope`, entered by a caller while it traces.

A kernel is an XLA custom call, which XLA cannot split over a mesh; so each runs only inside
this scope, which the JAX engine opens on a one-device replica (its decode loop and its
prefill, `rollout_engine.jax`), and never in the trainer's sharded programs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_NATIVE = contextvars.ContextVar("jaxrl_native_kernels", default=False)


@contextlib.contextmanager
def native_scope(on: bool = True) -> Iterator[None]:
    """Within this block (while a function is traced) the native kernels serve where they
    are available (`models.kernels.decode_attention`, `models.kernels.embed_rows`,
    `models.kernels.bf16_matmul`); outside it, or with ``on=False``, their callers keep the
    XLA paths."""
    token = _NATIVE.set(on)
    try:
        yield
    finally:
        _NATIVE.reset(token)


def in_native_scope() -> bool:
    """True inside ``native_scope(True)``."""
    return _NATIVE.get()


def scoped(fn: Callable[P, R], on: bool) -> Callable[P, R]:
    """`fn` called inside ``native_scope(on)``: wrap a function before `jax.jit` so that its
    tracing (at the first call of each shape) sees the scope."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with native_scope(on):
            return fn(*args, **kwargs)

    return call
