"""Applies a rule's layout change in both directions, with shape checks (numpy only).

HF -> JAX: reshape the HF tensor to its split axes (one axis per symbol), transpose into
the JAX order, merge the JAX groups, pad a "V" axis that the JAX side pads.
JAX -> HF: the exact inverse (slice the padding off first). Both are bit-exact: only
reshapes, transposes, pads and slices, no arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mappings.spec import ConcreteRule, MappingError, parse_axes


def _split(pattern: str, dims: Mapping[str, int]) -> tuple[list[str], list[int]]:
    symbols = [s for group in parse_axes(pattern) for s in group]
    return symbols, [int(s) if s.isdigit() else dims[s] for s in symbols]


def hf_to_jax(
    rule: ConcreteRule,
    tensor: np.ndarray,
    hf_dims: Mapping[str, int],
    jax_dims: Mapping[str, int],
    contiguous: bool = True,
) -> np.ndarray:
    """Turns the HF tensor of `rule` into its JAX param layout.

    Args:
        tensor: the checkpoint tensor, shape `rule.hf_shape`.
        hf_dims / jax_dims: symbol sizes on each side (they differ only in a padded "V").
        contiguous: True returns a C-contiguous array; False a view of `tensor` wherever
            numpy can express the layout change as one (a padded axis is always a copy), for
            a caller that copies only slices of it (`models.checkpoints.hf_io`).

    Raises:
        MappingError: the tensor's shape is not `rule.hf_shape` (names the tensor).
    """
    if tuple(tensor.shape) != rule.hf_shape:
        raise MappingError(
            f"{rule.hf}: expected shape {rule.hf_shape} ({rule.rule.hf_axes}), "
            f"got {tuple(tensor.shape)}"
        )
    hf_syms, hf_sizes = _split(rule.rule.hf_axes, hf_dims)
    jax_syms, _ = _split(rule.rule.jax_axes, hf_dims)
    x = tensor.reshape(hf_sizes).transpose([hf_syms.index(s) for s in jax_syms])
    x = x.reshape([_group_size(g, hf_dims) for g in parse_axes(rule.rule.jax_axes)])
    if tuple(x.shape) != rule.jax_shape:
        pads = [(0, want - have) for have, want in zip(x.shape, rule.jax_shape, strict=True)]
        if any(p[1] < 0 for p in pads):
            raise MappingError(f"{rule.jax}: cannot pad {x.shape} to {rule.jax_shape}")
        x = np.pad(x, pads)
    return np.ascontiguousarray(x) if contiguous else x


def jax_to_hf(
    rule: ConcreteRule,
    param: np.ndarray,
    hf_dims: Mapping[str, int],
    jax_dims: Mapping[str, int],
    contiguous: bool = True,
) -> np.ndarray:
    """Turns the JAX param of `rule` into the HF / engine tensor layout (inverse of hf_to_jax).

    A numpy param gives a C-contiguous numpy array, or with `contiguous=False` a view of the
    param's buffer wherever numpy can express the layout change as one (a transpose, a slice
    of the padding: strided, no copy; numpy copies only a reshape that no strides express).
    A JAX array gives a JAX array (sharded as XLA places the result: a transpose keeps the
    FSDP split, on another dim).

    Raises:
        MappingError: the param's shape is not `rule.jax_shape` (names the param).
    """
    if tuple(param.shape) != rule.jax_shape:
        raise MappingError(
            f"{rule.jax}: expected shape {rule.jax_shape} ({rule.rule.jax_axes}), "
            f"got {tuple(param.shape)}"
        )
    unpadded = [_group_size(g, hf_dims) for g in parse_axes(rule.rule.jax_axes)]
    x = param[tuple(slice(0, n) for n in unpadded)]
    hf_syms, _ = _split(rule.rule.hf_axes, hf_dims)
    jax_syms, jax_sizes = _split(rule.rule.jax_axes, hf_dims)
    x = x.reshape(jax_sizes).transpose([jax_syms.index(s) for s in hf_syms])
    if not isinstance(x, np.ndarray) or not contiguous:  # JAX: the same ops, shards kept
        return x.reshape(rule.hf_shape)
    return np.ascontiguousarray(x.reshape(rule.hf_shape))


def _group_size(group: tuple[str, ...], dims: Mapping[str, int]) -> int:
    size = 1
    for s in group:
        size *= int(s) if s.isdigit() else dims[s]
    return size
