"""Logical axes: every param of every family declares them, the engine TP shard kind that
follows from them is the mapping rule's, and the rules table places them as Megatron does."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from mappings.registry import get_family
from mappings.spec import expand, parse_axes
from models.axes import PARAM_AXES, logical_spec, param, shard_kind
from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.params import abstract_axes, abstract_params

#: The mapping's axis symbols (`ModelConfig.dims`) and the logical axis each one is.
SYMBOL_AXES = {"D": "embed", "N": "heads", "K": "kv_heads", "H": "head_dim", "F": "mlp"}
SYMBOL_AXES |= {"V": "vocab", "E": "experts", "M": "mlp"}  # M: an expert's MLP width


def _cfg(variant: str) -> ModelConfig:
    return ModelConfig.from_hf(dict(TINY_CONFIGS[variant], vocab_size=320))


def test_every_param_declares_its_logical_axes(family_variant):
    _, variant = family_variant
    cfg = _cfg(variant)
    axes, shapes = abstract_axes(cfg), abstract_params(cfg)
    missing = sorted(k for k, a in axes.items() if a is None)
    assert not missing, f"params without logical axes: {missing}"
    for name, a in axes.items():
        assert a is not None and len(a) == len(shapes[name].shape), name
        assert set(a) <= PARAM_AXES, (name, a)


def test_shard_kind_from_axes_is_the_mapping_rules(family_variant):
    family_name, variant = family_variant
    cfg = _cfg(variant)
    axes = abstract_axes(cfg)
    rules = expand(get_family(family_name), cfg)
    assert {r.jax for r in rules} == set(axes)
    for r in rules:
        assert shard_kind(axes[r.jax]) == r.rule.shard_kind, r.jax
        symbols = [g[0] for g in parse_axes(r.rule.jax_axes)]
        # a norm's width is "norm" whatever it spans (D; OLMoE's whole projection N·H)
        want = [SYMBOL_AXES[s] for s in symbols]
        named = [w if a == "norm" else a for a, w in zip(axes[r.jax], want, strict=True)]
        assert named == want, r.jax


def test_rules_place_params_megatron_style():
    mesh = {"dp": 2, "fsdp": 2, "tp": 2}
    assert tuple(logical_spec(("embed", "heads", "head_dim"), (64, 4, 32), mesh)) == (
        "fsdp",
        "tp",
        None,
    )
    assert tuple(logical_spec(("heads", "head_dim", "embed"), (4, 32, 64), mesh)) == (
        "tp",
        None,
        "fsdp",
    )
    assert tuple(logical_spec(("vocab", "embed"), (320, 64), mesh)) == ("tp", "fsdp")
    assert tuple(logical_spec(("norm",), (64,), mesh)) == ("fsdp",)
    assert tuple(logical_spec(("head_dim",), (32,), mesh)) == (None,)
    assert tuple(logical_spec(("batch", "length", "act_embed"), (8, 5, 64), mesh)) == (
        ("dp", "fsdp"),
        None,
        None,
    )
    # Mesh axes of size 1 split nothing and are left out.
    assert tuple(logical_spec(("embed", "mlp"), (64, 96), {"dp": 1, "fsdp": 4, "tp": 1})) == (
        "fsdp",
        None,
    )


def test_bad_axes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"'heads' of size 3 does not split over tp=2"):
        logical_spec(("embed", "heads"), (64, 3), {"fsdp": 1, "tp": 2})
    with pytest.raises(ValueError, match="logical axes"):
        param(jnp.zeros((4, 4)), ("embed",))
    with pytest.raises(ValueError, match="logical axes"):
        param(jnp.zeros((4,)), ("width",))
