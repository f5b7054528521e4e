"""Applies a family's mapping to whole checkpoints, one tensor at a time (numpy only).

Both directions are generators so that a caller never holds two full copies of a model:
`checkpoint_to_params` reads a tensor, transforms it and yields it; `params_to_engine`
does the reverse for the tensors an engine loads (HF names, the layout vLLM's
`load_weights` takes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from mappings.spec import ConcreteRule, Family, MappingError, expand
from mappings.transform import hf_to_jax, jax_to_hf


def checkpoint_to_params(
    family: Family,
    cfg: Any,
    read: Callable[[str], np.ndarray],
    available: set[str],
    jax_dims: Mapping[str, int] | None = None,
    contiguous: bool = True,
) -> Iterator[tuple[ConcreteRule, np.ndarray]]:
    """Yields (rule, JAX param array) for every param of `cfg`'s model.

    Args:
        family: the mapping; cfg: a ModelConfig.
        read: returns a checkpoint tensor by HF name.
        available: every tensor name in the checkpoint (checked before anything is read).
        jax_dims: JAX-side sizes that differ from the checkpoint's (a padded "V").
        contiguous: False yields views of what `read` returned wherever numpy can
            (`transform.hf_to_jax`): with a memory-mapped `read`, nothing is copied yet.

    A stacked expert param ([E, ...], from E per-expert HF tensors) is yielded once, with
    the rule of its last expert, after all E are read (always a copy).

    Raises:
        MappingError: tensors the mapping needs that the checkpoint lacks (all named, with
            the checkpoint's path left to the caller), per-expert tensors of experts past the
            config's `num_experts` (a wrong expert count), or a shape mismatch (named).
    """
    rules = expand(family, cfg, jax_dims)
    missing = [r.hf for r in rules if r.hf not in available]
    if missing:
        hint = ""
        if family.tied_head in missing:
            hint = f" (the config says tie_word_embeddings=false, so {family.tied_head} is needed)"
        raise MappingError(f"checkpoint lacks tensors {missing}{hint}")
    extra = extra_experts(family, cfg, available)
    if extra:
        raise MappingError(
            f"checkpoint holds experts the config does not (num_experts={cfg.dims()['E']}): "
            f"{extra[:4]}{' ...' if len(extra) > 4 else ''} ({len(extra)} tensors)"
        )
    hf_dims = cfg.dims()
    jdims = dict(hf_dims, **(jax_dims or {}))
    experts: list[np.ndarray] = []  # the slices of a stacked expert param read so far
    for rule in rules:
        if rule.expert is None:
            yield rule, hf_to_jax(rule, read(rule.hf), hf_dims, jdims, contiguous)
            continue
        experts.append(hf_to_jax(rule.expert_slice(), read(rule.hf), hf_dims, jdims))
        if rule.expert == rule.jax_shape[0] - 1:  # the last expert: [E, ...] stacked
            yield rule, np.stack(experts)
            experts = []


def extra_experts(family: Family, cfg: Any, available: set[str]) -> list[str]:
    """The names in `available` that a per-expert rule of `family` would map for an expert id
    at or past `cfg`'s expert count (sorted): a checkpoint with more experts than its config."""
    count = cfg.dims().get("E", 0)
    layer = r"\d+"
    out = []
    for rule in family.rules:
        if not rule.per_expert:
            continue
        pattern = re.escape(rule.hf).replace(re.escape("{layer}"), layer)
        pattern = pattern.replace(re.escape("{expert}"), r"(\d+)")
        for name in available:
            match = re.fullmatch(pattern, name)
            if match and int(match.group(1)) >= count:
                out.append(name)
    return sorted(out)


def params_to_engine(
    family: Family,
    cfg: Any,
    params: Mapping[str, Any],
    jax_dims: Mapping[str, int] | None = None,
    cast: Callable[[Any], Any] | None = None,
    host: bool = True,
    contiguous: bool = True,
) -> Iterator[tuple[str, Any]]:
    """Yields (HF tensor name, array) for every tensor an engine (or HF folder) holds.

    Args:
        params: flat JAX params by dot path (arrays convertible with np.asarray; on CPU
            that shares the buffer).
        cast: optional per-tensor cast (e.g. to the engine's dtype), applied before the
            layout change so that it touches each element once.
        host: True yields numpy arrays (`np.asarray` of each param); False keeps JAX arrays
            as they are (on their devices, FSDP shards kept) and yields JAX arrays.
        contiguous: True yields C-contiguous numpy arrays; False yields views of each param's
            buffer in the HF layout wherever numpy can (strided, no copy: `jax_to_hf`), for a
            consumer that copies them anyway.

    A stacked expert param [E, ...] gives E tensors, one per expert (HF's per-expert names,
    which vLLM's `load_weights` fuses into its `w13` / `w2` expert tensors itself).

    Raises:
        MappingError: a param the mapping expects that `params` lacks, or params the
            mapping does not know (all named), or a shape mismatch.
    """
    rules = expand(family, cfg, jax_dims)
    expected = {r.jax for r in rules}
    missing = sorted(expected - set(params))
    unknown = sorted(set(params) - expected)
    if missing or unknown:
        raise MappingError(
            f"{family.name}: params do not fit the mapping; missing {missing}, unknown {unknown}"
        )
    hf_dims = cfg.dims()
    jdims = dict(hf_dims, **(jax_dims or {}))
    for rule in rules:
        array = np.asarray(params[rule.jax]) if host else params[rule.jax]
        if rule.expert is not None:  # one expert's slice of a stacked [E, ...] param
            array, rule = array[rule.expert], rule.expert_slice()
        if cast is not None:
            array = cast(array)
        yield rule.hf, jax_to_hf(rule, array, hf_dims, jdims, contiguous)
