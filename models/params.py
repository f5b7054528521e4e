"""Flat views of a Decoder's params by dot path ("layers.3.attn.q.kernel"), both ways."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from models.axes import axes_of
from models.config import ModelConfig
from models.decoder import Decoder


def path_str(path: tuple) -> str:
    """("layers", 3, "attn", "q", "kernel") -> "layers.3.attn.q.kernel"."""
    return ".".join(str(p) for p in path)


def flat_params(model: Decoder) -> dict[str, jax.Array]:
    """Every param of `model` by dot path (the arrays themselves, no copy)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {path_str(path): var.get_value() for path, var in flat}


def replace_params(state: nnx.State, new: Mapping[str, jax.Array]) -> nnx.State:
    """`state` (``nnx.split(decoder)[1]``) with the leaves named in `new` (dot paths)
    replaced and every other leaf shared, not copied: a new version of some params (e.g. a
    LoRA merge's adapted kernels) without rebuilding the model (`model_from_params` traces
    the whole Decoder again).

    Raises:
        KeyError: a name of `new` that `state` lacks (named).
        ValueError: an array whose shape differs from the leaf it replaces (named).
    """
    flat, seen = [], set()
    for path, var in nnx.to_flat_state(state):
        name = path_str(path)
        if name in new:
            value, old = new[name], var.get_value()
            if tuple(value.shape) != tuple(old.shape):
                raise ValueError(f"param {name}: expected shape {old.shape}, got {value.shape}")
            var = var.replace(value)
            seen.add(name)
        flat.append((path, var))
    if missing := sorted(set(new) - seen):
        raise KeyError(f"no param {missing[0]} in the model ({len(missing)} unknown names)")
    return nnx.from_flat_state(flat)


def param_axes(model: Decoder) -> dict[str, tuple[str, ...] | None]:
    """The logical axes every param of `model` declared (`models.axes.param`), by dot path;
    None for a param that declared none (a test holds that there is none)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {path_str(path): axes_of(var) for path, var in flat}


def abstract_axes(cfg: ModelConfig) -> dict[str, tuple[str, ...] | None]:
    """`param_axes` of a Decoder for `cfg`, built without allocating."""
    return param_axes(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def abstract_params(cfg: ModelConfig) -> dict[str, Any]:
    """Shapes and dtypes of every param of a Decoder for `cfg`, built without allocating."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    return flat_params(abstract)


def model_from_params(
    cfg: ModelConfig,
    get: Callable[[str, jax.ShapeDtypeStruct], jax.Array] | Mapping[str, jax.Array],
) -> Decoder:
    """Builds a Decoder whose params come from `get` (a mapping, or a callable taking the dot
    path and the expected ShapeDtypeStruct), without ever initialising random weights.

    Raises:
        KeyError: a param path that `get` lacks (named).
        ValueError: an array whose shape differs from the model's (named, expected vs got).
    """
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    filled = []
    for path, var in nnx.to_flat_state(state):
        name, want = path_str(path), var.get_value()
        if isinstance(get, Mapping):
            if name not in get:
                raise KeyError(f"param {name} is missing; expected shape {want.shape}")
            value = get[name]
        else:
            value = get(name, want)
        if tuple(value.shape) != tuple(want.shape):
            raise ValueError(f"param {name}: expected shape {want.shape}, got {value.shape}")
        filled.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))
